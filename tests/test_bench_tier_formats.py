"""``bench tiers``' formats section (``workbench.bench.tier_formats``, issue 34): the CPU smoke's rows (every format's
round trip through a TieredCache's mover equals the format's reference roundtrip, no timing claimed), the figures
derived from measured times (break-even, ratio to fp16, a decode beside swaps) on random numbers, and bad options
refused before any work. The smoke takes a few seconds (tiny shapes, the torch ops)."""

import json
import random

import pytest
import torch

from workbench.bench import tier_formats, tiers
from workbench.quant.names import TIER_FORMATS


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiers")
    assert tiers.main(["--smoke", "--out", str(out)]) == 0
    (path,) = out.glob("tiers-*.json")
    return json.loads(path.read_text())


def test_smoke_checks_every_format_and_claims_no_time(smoke_run, capsys):
    doc, rows = smoke_run, smoke_run["rows"]
    assert doc["smoke"] is True and doc["sections"] == ["formats"] and doc["meta"]["gpu"].startswith("cpu")
    assert {r["section"] for r in rows} == {"formats"} and all(r["smoke"] for r in rows)
    checks = [r for r in rows if r["kind"] == "check"]
    cases = {(r["format"], r["block_size"]) for r in checks}
    skipped = {(r["format"], r["block_size"]) for r in rows if r["kind"] == "skipped"}
    assert skipped == {("int4/kivi", 16)}  # 32-token key groups do not tile a 16-token block
    assert cases | skipped == {(f, bs) for f in TIER_FORMATS for bs in tier_formats.SMOKE_BLOCK_SIZES}
    assert all(r["ok"] for r in checks)
    by = {(r["format"], r["block_size"]): r for r in checks}
    assert by[("fp16", 16)]["max_abs_change"] == 0 and not by[("fp16", 16)]["lossy"]
    assert 0 < by[("int8/token", 16)]["max_abs_change"] < by[("int2/token", 16)]["max_abs_change"]
    moves = [r for r in rows if r["kind"] == "move"]
    transcoding = {c for c in cases if c[0] != "fp16"}  # timed twice: in chunks and the batch at once (serial)
    assert len(moves) == 2 * len(tier_formats.SMOKE_BATCHES) * (len(cases) + len(transcoding))  # both directions
    assert {(r["format"], r["block_size"]) for r in moves if r["serial"]} == transcoding
    assert all(r["chunks"] >= 1 for r in moves)
    for r in moves + [r for r in rows if r["kind"] == "transcode"]:
        assert r["time_us"] is None and r["tokens_per_s"] is None and r.get("gbps") is None  # no claim from a CPU
    int4 = next(r for r in moves if r["format"] == "int4/token")
    assert int4["format_block_bytes"] < int4["device_block_bytes"] / 3 and int4["bytes_fraction"] < 1 / 3
    assert {r["op"] for r in rows if r["kind"] == "transcode"} == {"encode", "decode"}
    assert not any(r["format"] == "fp16" for r in rows if r["kind"] == "transcode")  # nothing to transcode


def test_break_even_on_random_numbers():
    rng = random.Random(3)
    for _ in range(20):
        dev, t = rng.randint(1 << 20, 1 << 30), rng.uniform(1e-5, 1e-2)
        fmt = rng.randint(1, dev)
        be = tier_formats.break_even(dev, fmt, t)
        assert be["hide_gbps"] == pytest.approx(fmt / t / 1e9)  # transcode time == the format's DMA time there
        link = be["pays_serial_gbps"] * 1e9  # serial transcode + format DMA == fp16 DMA at this link
        assert t + fmt / link == pytest.approx(dev / link) if link else fmt == dev
        assert be["pays_pipelined_gbps"] >= be["pays_serial_gbps"]
    assert tier_formats.break_even(8, 2, None) == dict.fromkeys(("hide_gbps", "pays_serial_gbps",
                                                                 "pays_pipelined_gbps"))
    for bad in ((0, 1, 1.0), (8, 2.5, 1.0), (8, 2, 0.0), (8, 2, -1.0), (True, 2, 1.0)):
        with pytest.raises(ValueError, match="device_bytes|format_bytes|transcode_s"):
            tier_formats.break_even(*bad)


def test_ratios_to_fp16_at_the_same_size_batch_and_direction():
    g = torch.Generator().manual_seed(5)
    speed = (torch.rand(3, 2, 2, 2, generator=g) * 1e6 + 1e3).tolist()  # format x size x batch x direction
    rows = [dict(kind="move", format=f, block_size=bs, blocks=n, direction=d, tokens_per_s=speed[i][j][k][m])
            for i, f in enumerate(TIER_FORMATS[:3]) for j, bs in enumerate((16, 64)) for k, n in enumerate((64, 256))
            for m, d in enumerate(("d2h", "h2d"))]
    rows.append(dict(kind="transcode", format="int4/token", block_size=16))
    tier_formats.add_ratios(rows)
    for r in rows[:-1]:
        i, j, k, m = (TIER_FORMATS.index(r["format"]), (16, 64).index(r["block_size"]), (64, 256).index(r["blocks"]),
                      ("d2h", "h2d").index(r["direction"]))
        assert r["tokens_ratio"] == pytest.approx(speed[i][j][k][m] / speed[0][j][k][m])
    assert "tokens_ratio" not in rows[-1]
    rows[0]["tokens_per_s"] = None  # an untimed reference: no ratio
    assert tier_formats.add_ratios(rows)[8]["tokens_ratio"] is None  # the next format, same size, batch, d2h


def test_beside_figures_from_event_times():
    rng = random.Random(7)
    alone, steps = rng.uniform(50, 500), rng.randint(10, 300)
    d0, x0 = rng.uniform(0, 10), rng.uniform(5, 20)
    d1 = d0 + steps * alone * 1.2
    x1 = x0 + d1 - d0
    f = tier_formats.beside_figures(alone, (d0, d1), (x0, x1), steps, 10 << 20)
    assert f["slowdown"] == pytest.approx(0.2) and f["decode_beside_us"] == pytest.approx(1.2 * alone)
    assert f["overlap"] == pytest.approx((d1 - max(d0, x0)) / (d1 - d0))
    assert f["wire_gbps"] == pytest.approx((10 << 20) / (x1 - x0) / 1e3)
    assert tier_formats.beside_figures(alone, (0, 10), (20, 30), 1, 8)["overlap"] == 0
    with pytest.raises(ValueError, match="spans"):
        tier_formats.beside_figures(alone, (5, 5), (0, 1), 1, 8)


def test_staged_blocks_are_what_the_mover_gathers_and_swaps_move_them():
    from workbench.tiers import TieredCache, formats

    cache = tier_formats.filled_cache((2, 2, 32), 16, 4, "cpu", "torch")
    tc = TieredCache(cache, host_bytes=4 * formats.block_bytes(cache, formats.DEVICE, 16), fsync=False, path="dma")
    starts = tc.lower.host.allocate([1, 1])
    want = tier_formats.staged_blocks(cache, 16, [3, 1])
    assert want.float().std() > 0  # filled, not zeros
    tier_formats.swap(tc.lower.mover, 16, [3, 1], starts, "d2h")()
    assert torch.equal(want, tc.lower.host.buffer[starts])
    tier_formats.swap(tc.lower.mover, 16, [0, 2], starts, "h2d")()  # back into two other blocks
    assert torch.equal(tier_formats.staged_blocks(cache, 16, [0, 2]), want)
    tc.close()


def test_bad_options_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tier_formats, "format_rows", lambda *a, **k: pytest.fail("ran before the checks"))
    with pytest.raises(SystemExit) as e:
        tiers.main(["--smoke", "--only", "link", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--smoke" in capsys.readouterr().err
    monkeypatch.undo()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="smoke"):
            tier_formats.format_rows(None)
