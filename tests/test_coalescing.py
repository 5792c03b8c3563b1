"""The coalescing model against hand-counted lines and sectors, real tensor strides and brute force;
the decode result helpers on a FAKE fixture (tests/fixtures/decode-fake-fixture.json, not a measurement)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.analysis.coalescing import (
    H200_L2_BYTES,
    LINE,
    SECTOR,
    CacheGeometry,
    analyze,
    read_stats,
    seed_block_size,
)
from workbench.bench import results as bench_results
from workbench.core.layout import block_shape, to_nhd
from workbench.results import decode

FIXTURES = Path(__file__).parent / "fixtures"


def test_nhd_fp16_token_row_is_two_full_lines():
    c = analyze("nhd", "k", block_size=16, num_kv_heads=8, head_dim=128, elem_size=2, block_n=64)
    t = c.token
    assert (t.useful_bytes, t.lines, t.sectors, t.lane_bytes) == (256, 2, 8, 16)
    assert t.line_efficiency == 1.0 and t.sector_efficiency == 1.0
    s = c.tile  # 64 rows of 256 B: 128 lines; 32 requests of 512 B, 4 full lines each
    assert (s.lines, s.sectors, s.requests, s.lines_per_request) == (128, 512, 32, 4)
    assert c.aligned and c.geometry.block_misalignments() == [0]


def test_vllm_value_per_token_is_one_sector_per_element_but_tiles_are_contiguous():
    # value block [heads, D, 16 tokens]: one token's 128 values are 32 bytes apart
    c = analyze("vllm", "v", block_size=16, num_kv_heads=8, head_dim=128, elem_size=2, block_n=16)
    t = c.token
    assert (t.sectors, t.lines, t.lane_bytes, t.fast_axis) == (128, 32, 2, "d")
    assert t.sector_efficiency == pytest.approx(2 / 32) and t.line_efficiency == pytest.approx(256 / (32 * 128))
    assert t.requests == 4  # 128 two-byte lanes
    s = c.tile  # 16 tokens x 128 values = the head's whole 4 KB: contiguous along tokens
    assert (s.fast_axis, s.lane_bytes, s.lines, s.line_efficiency, s.sector_efficiency) == ("token", 16, 32, 1.0, 1.0)
    s64 = analyze("vllm", "v", 16, 8, 128, 2, block_n=64).tile  # a tile over 4 pages
    assert (s64.lines, s64.line_efficiency, s64.lines_per_request) == (128, 1.0, 4)


def test_vllm_key_per_token_is_16_byte_pieces():
    t = analyze("vllm", "k", 16, 8, 128, 2, block_n=16).token  # x = 8: 16 runs of 16 B, 256 B apart
    assert (t.lines, t.sectors, t.lane_bytes) == (16, 16, 16)
    assert t.sector_efficiency == 0.5 and t.line_efficiency == 0.125
    assert analyze("vllm", "k", 16, 8, 128, 2, block_n=16).tile.line_efficiency == 1.0


def test_one_element_misaligned_stride_straddles_lines():
    # block stride 32768 + 2 bytes: block b starts at 2b mod 128 (64 blocks per period); a 256-byte row from
    # offset o takes 3 lines unless o == 0, and 9 sectors unless o % 32 == 0 (4 of the 64 offsets)
    c = analyze("nhd", "k", 16, 8, 128, 2, pad_bytes=2)
    g = c.geometry
    assert not c.aligned and g.alignment_period == 64 and g.block_misalignments() == list(range(0, 128, 2))
    assert c.token.lines == pytest.approx((1 * 2 + 63 * 3) / 64)
    assert c.token.sectors == pytest.approx((4 * 8 + 60 * 9) / 64)
    assert c.token.line_efficiency == pytest.approx(256 / (128 * 191 / 64))
    assert c.token.lane_bytes == 2 and c.tile.requests == 256  # no 16-byte vectors: 8x the requests
    sixteen = analyze("nhd", "k", 16, 8, 128, 2, pad_bytes=16)  # 16-byte aligned: vectors survive, lines do not
    assert sixteen.token.lane_bytes == 16 and sixteen.token.lines == pytest.approx((2 + 7 * 3) / 8)
    padded = analyze("nhd", "k", 16, 8, 128, 2, pad_bytes=128)  # a whole line of padding: aligned again
    assert padded.aligned and padded.tile.line_efficiency == 1.0
    based = CacheGeometry("nhd", "k", 16, 8, 128, 2, base_offset=64)
    assert not based.blocks_aligned and read_stats(based, 1).lines == 3


def test_hnd_vs_nhd_for_one_head_at_head_dim_80():
    # 160-byte rows: HND keeps one head's tokens contiguous (10 KB tile = 80 full lines);
    # NHD rows sit 8 * 160 bytes apart, each spanning 2 lines (64 rows -> 128 lines)
    nhd = analyze("nhd", "k", 16, 8, 80, 2, block_n=64, heads=[1])
    hnd = analyze("hnd", "k", 16, 8, 80, 2, block_n=64, heads=[1])
    assert (hnd.tile.lines, hnd.tile.line_efficiency) == (80, 1.0)
    assert (nhd.tile.lines, nhd.tile.line_efficiency) == (128, 0.625)
    assert nhd.tile.sector_efficiency == hnd.tile.sector_efficiency == 1.0  # rows start on 32-byte boundaries
    assert nhd.token.lines == hnd.token.lines == 2


@pytest.mark.parametrize("layout,kind", [("nhd", "k"), ("hnd", "v"), ("vllm", "k"), ("vllm", "v")])
@pytest.mark.parametrize("elem,dtype", [(2, torch.float16), (1, torch.uint8), (4, torch.float32)])
def test_addresses_follow_real_strides(layout, kind, elem, dtype):
    """Every element's byte address equals its offset in a real padded tensor (values = element offsets)."""
    bs, heads, d, pad, nb = 5, 3, 32, 3, 4
    g = CacheGeometry(layout, kind, bs, heads, d, elem, pad_bytes=pad * elem, base_offset=7 * elem)
    shape = block_shape(layout, kind, bs, heads, d, elem)
    per = int(np.prod(shape))
    store = torch.arange(nb * (per + pad), dtype=torch.int64)
    cache = store.as_strided((nb, *shape), (per + pad, *torch.empty(shape, device="meta").stride()))
    offs = to_nhd(cache, layout, kind)  # [nb, bs, heads, d] element offsets
    ib, it, ih, idd = np.meshgrid(*(np.arange(n) for n in offs.shape), indexing="ij")
    want = 7 * elem + elem * offs.numpy()
    np.testing.assert_array_equal(g.addresses(ib, it, ih, idd), want)


@pytest.mark.parametrize("layout,kind,pad,n_tok", [("nhd", "k", 2, 1), ("vllm", "v", 6, 16), ("hnd", "k", 48, 24),
                                                   ("vllm", "k", 10, 8)])
def test_means_equal_brute_force_over_the_pool(layout, kind, pad, n_tok):
    """The exact mean over one alignment period equals a direct count over many blocks and every head."""
    g = CacheGeometry(layout, kind, 8, 2, 40, 2, pad_bytes=pad)
    lines, sectors = [], []
    P = g.block_size
    tiles = np.lcm(n_tok, P) // n_tok
    for blk in range(3 * g.alignment_period):
        for h in range(g.num_kv_heads):
            for i in range(tiles):
                pos = i * n_tok + np.arange(n_tok)
                # pages of one tile on blocks far apart with the same residue
                b = blk + 1000 * g.alignment_period * (pos // P)
                a = g.addresses(b[:, None], (pos % P)[:, None], h, np.arange(g.head_dim)).ravel()
                lines.append(len(np.unique(a // LINE)))
                sectors.append(len(np.unique(a // SECTOR)))
    s = read_stats(g, n_tok)
    assert s.lines == pytest.approx(np.mean(lines)) and s.sectors == pytest.approx(np.mean(sectors))


def test_line_map_rows_sum_to_the_token_bytes():
    c = analyze("nhd", "k", 16, 8, 128, 2, pad_bytes=2, block_n=64)
    m = c.line_map
    assert len(m.tokens) == 16 and m.block_start_mod_line == 2
    assert all(sum(row) == 256 for row in m.bytes) and m.bytes[0][:3] == [126, 128, 2]


def test_seed_block_size_on_h200():
    assert H200_L2_BYTES == 52_428_800
    assert seed_block_size(H200_L2_BYTES, 128, 2) == 102_400  # tokens of one kv head, one layer
    with pytest.raises(ValueError, match="head_dim"):
        seed_block_size(H200_L2_BYTES, 0, 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(layout="xyz"), "layout"),
    (dict(kind="q"), "kind"),
    (dict(block_size=0), "block_size"),
    (dict(elem_size=3), "elem_size"),
    (dict(pad_bytes=3), "pad_bytes"),
    (dict(base_offset=-2), "base_offset"),
    (dict(layout="vllm", head_dim=12), "head_dim"),
    (dict(block_n=0), "block_n"),
    (dict(heads=[2]), "heads"),
])
def test_bad_input(kwargs, match):
    args = dict(layout="nhd", kind="k", block_size=16, num_kv_heads=2, head_dim=64, elem_size=2)
    with pytest.raises(ValueError, match=match):
        analyze(**{**args, **kwargs})


def test_results_helpers_on_fake_fixture():
    rows = decode.load_decode(results_dir=FIXTURES)
    assert rows and all(r["time_us"] for r in rows)  # the smoke row and the failed peer are dropped
    best = decode.best_per_workload(rows)
    assert list(best) == ["W1", "W4"] and best["W1"]["ours"]["variant"] == "splits*2"
    assert decode.best_per_workload(rows, graph=True)["W1"]["ours"]["variant"] == "heuristic"
    pts = decode.roofline_points(rows)
    w1 = next(p for p in pts if p["workload"] == "W1" and p["impl"] == "sdpa_contiguous")
    assert w1["intensity"] == pytest.approx(4.0, rel=1e-3)  # GQA 32/8 at fp16: 4 FLOP per byte
    w4 = next(p for p in pts if p["workload"] == "W4")
    assert w4["intensity"] == pytest.approx(1.0, rel=1e-3)
    assert w1["tflops"] == pytest.approx(4 * 32 * 128 * 64 * 4096 / 280e-6 / 1e12)
    assert decode.copy_ceiling(rows) == 4000.0
    head = decode.headline_rows(rows)
    assert len(head) == 6 and head[-1]["sweep"] == "fp8"  # 3 timed W1 impls, 2 W4, the fp8 point
    align = decode.with_coalescing(decode.sweep_rows(rows, "align"))
    assert [r["block_stride_pad"] for r in align] == [0, 1]
    assert align[0]["model_k_line_eff"] == 1.0 and align[1]["model_k_line_eff"] < 0.7
    assert align[1]["model_lane_bytes"] == 2
    assert decode.load_decode(results_dir=FIXTURES, pattern="nothing-*.json") == []


def test_results_cli(capsys):
    assert bench_results.main(["--dir", str(FIXTURES)]) == 0
    out = capsys.readouterr().out
    assert "FAKE-GPU" in out and "W4" in out
