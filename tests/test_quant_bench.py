"""``bench quant_decode``'s additions of issue 31: fp32 storage timed beside fp16 (its queries fp32, as the plan
requires), and the ``peers`` section (FlashInfer's fp8 decode backends on our own fp8 cache): skipped in one line
without FlashInfer, its rows and ratios built from stand-in peers on the CPU, and the export and scale folding of
``conformance.peers.flashinfer_plan`` checked through a stand-in FlashInfer that computes in PyTorch."""

import json
import sys
import types

import pytest
import torch

from workbench.bench import quant_decode, quant_peers
from workbench.conformance import peers
from workbench.core.workloads import Workload
from workbench.quant import names

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

TINY = Workload("T", "tiny", 3, 40, 4, 2, head_dim=64, min_context=9, seed=7)  # GQA 2, ragged lengths


def _decode(q, k, v, lens, sm_scale, k_scale=1.0, v_scale=1.0):
    """Float64 decode over per-sequence ``[n, Hkv, D]`` K/V (codes times the scales)."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    hq, hkv = q.shape[1], k[0].shape[1]
    for b, n in enumerate(lens):
        kb = (k[b][:n].double() * k_scale).repeat_interleave(hq // hkv, dim=1)
        vb = (v[b][:n].double() * v_scale).repeat_interleave(hq // hkv, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[b].double(), kb) * sm_scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", p, vb)
    return out


class _Wrapper:
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` as it reads our export: NHD pages, CSR page table,
    k_scale folded into the softmax scale and v_scale applied to the output."""

    made: list = []

    def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False, backend="auto", use_cuda_graph=False,
                 **buffers):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8 and not workspace.any()
        assert not use_cuda_graph or set(buffers) == {"paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                                                      "paged_kv_last_page_len_buffer"}
        self.resolved_backend = "fa2"
        self.made.append((use_tensor_cores, backend, use_cuda_graph))

    def plan(self, indptr, indices, last, hq, hkv, d, page, *, q_data_type, kv_data_type, sm_scale):
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32 and kv_data_type == torch.float8_e4m3fn
        self.csr, self.sm_scale = (indptr.tolist(), indices.tolist(), last.tolist(), page), sm_scale

    def run(self, q, kv, *, k_scale=None, v_scale=None, out=None):
        indptr, indices, last, page = self.csr
        k, v = ([c.float()[indices[indptr[b]:indptr[b + 1]]].reshape(-1, *c.shape[2:]) for b in range(q.shape[0])]
                for c in kv)
        lens = [(indptr[b + 1] - indptr[b] - 1) * page + last[b] for b in range(q.shape[0])]
        got = _decode(q, k, v, lens, self.sm_scale * (k_scale or 1.0), 1.0, v_scale or 1.0).to(q.dtype)
        return got if out is None else out.copy_(got)


def _xqa(q, kv, workspace, table, lens, max_len, *, bmm1_scale, bmm2_scale, kv_layout, out):
    """XQA as FlashInfer runs it on SM90 with an e4m3 cache: q cast to e4m3 (the inaccuracy the row must flag)."""
    assert table.dtype == torch.int32 and lens.dtype == torch.uint32 and kv_layout == "NHD"
    n = lens.to(torch.int64).tolist()
    k, v = ([c.float()[table[b].long()].reshape(-1, *c.shape[2:]) for b in range(q.shape[0])] for c in kv)
    q8 = q.to(torch.float8_e4m3fn).to(q.dtype)
    return out.copy_(_decode(q8, k, v, n, bmm1_scale, 1.0, bmm2_scale).to(q.dtype))


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fi = types.ModuleType("fake_flashinfer")
    fi.BatchDecodeWithPagedKVCacheWrapper = _Wrapper
    dec = types.ModuleType("fake_flashinfer.decode")
    dec.xqa_batch_decode_with_kv_cache = _xqa
    monkeypatch.setitem(sys.modules, "fake_flashinfer", fi)
    monkeypatch.setitem(sys.modules, "fake_flashinfer.decode", dec)
    _Wrapper.made = []
    return fi


def test_fp32_is_timed_and_in_the_smoke_list():
    assert names.DECODE_BENCH_SCHEMES[:2] == ("fp16", "fp32") and "fp32" in names.DECODE_SMOKE_SCHEMES
    assert "peers" in quant_decode.SECTIONS


def test_fp32_storage_decodes_with_fp32_queries_and_twice_the_bytes(device):
    rows = quant_decode.run_decode(TINY, 0.0, ["fp16", "fp32"], 10, False, str(device))
    fp16, fp32 = rows
    assert (fp16["q_dtype"], fp32["q_dtype"]) == ("float16", "float32") and not fp32.get("error")
    assert fp32["bytes_per_token"] == 2 * fp16["bytes_per_token"] and fp32["bytes"] == 2 * fp16["bytes"]
    assert fp32["rel_err"] < 1e-5 < fp16["rel_err"] < 1e-3  # fp32 output: no fp16 rounding
    fp16["speedup_vs_fp16"], fp32["speedup_vs_fp16"] = 1.0, 0.52
    lines = quant_decode.summary(rows)
    assert lines == [f"T: fp32 vs fp16 storage: speed-up 0.520, bytes per token {fp32['bytes_per_token']} vs "
                     f"{fp16['bytes_per_token']}, rel_err {fp32['rel_err']:.2g} vs {fp16['rel_err']:.2g}"]


def test_peers_section_skips_in_one_line_without_flashinfer(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # importing it now raises ModuleNotFoundError
    assert quant_peers.load_flashinfer("cuda") == (None, "peers: flashinfer not installed, skipped")
    assert quant_decode.main(["--smoke", "--sections", "peers", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "peers: flashinfer not installed, skipped" and printed[1].startswith("wrote ")
    (path,) = tmp_path.glob("quant-decode-*.json")
    assert json.loads(path.read_text())["rows"] == []


def test_peers_section_needs_a_gpu_and_known_sections(monkeypatch, fake_flashinfer, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    assert quant_peers.load_flashinfer("cpu") == (None, "peers: flashinfer runs on a CUDA GPU, not on cpu, skipped")
    assert quant_peers.load_flashinfer("cuda") == (fake_flashinfer, "")
    with pytest.raises(SystemExit):
        quant_decode.main(["--smoke", "--sections", "decode,peer", "--out", str(tmp_path)])
    assert "argument --sections: ['peer'] not among decode, write, midpoints, peers" in capsys.readouterr().err


def test_flashinfer_plan_refuses_unknown_backends_and_xqa_without_a_table(fake_flashinfer):
    q = torch.randn(2, 4, 64).half()
    k = torch.randn(3, 16, 2, 64).to(torch.float8_e4m3fn)
    csr = [torch.tensor(x, dtype=torch.int32) for x in ([0, 1, 3], [0, 1, 2], [5, 16])]
    ws = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"backend must be one of \['cuda_core', 'tensor_core', 'xqa'\], got 'fa3'"):
        peers.flashinfer_plan(fake_flashinfer, q, k, k, "nhd", *csr, 16, 0.125, workspace=ws, backend="fa3")
    with pytest.raises(ValueError, match="backend 'xqa' needs block_table"):
        peers.flashinfer_plan(fake_flashinfer, q, k, k, "nhd", *csr, 16, 0.125, workspace=ws, backend="xqa")


def test_peers_rows_through_a_stand_in_flashinfer(device, fake_flashinfer):
    """Our fp8 cache exported to each backend: the accurate ones match the dequantized reference as ours does, XQA's
    e4m3 queries are flagged; each backend planned as it should be (tensor cores for fa2, CUDA-graph buffers)."""
    rows = quant_decode.run_peers(TINY, 0.0, 10, str(device), fake_flashinfer, timed=False)
    assert [(r["impl"], r["backend"]) for r in rows] == [("ours", "heuristic"), ("flashinfer", "cuda_core"),
                                                         ("flashinfer", "tensor_core"), ("flashinfer", "xqa")]
    assert _Wrapper.made == [(False, "auto", True), (True, "fa2", True)]
    assert all(r["section"] == "peers" and r["scheme"] == "fp8_e4m3/tensor" and not r.get("error") for r in rows)
    assert [r["accurate"] for r in rows] == [True, True, True, False]
    assert [r["declared_accurate"] for r in rows] == [True, True, True, False]
    ours, cuda_core, tensor_core, xqa = (r["rel_err"] for r in rows)
    assert ours < 1e-3 and cuda_core < 1e-3 and tensor_core < 1e-3 and xqa > quant_peers.ACCURATE
    assert "time_us" not in rows[0] and "ours_speedup" not in rows[1]  # judged, not timed (timed=False)


def test_timed_peers_rows_carry_rates_and_ratios(monkeypatch, device, fake_flashinfer):
    times = iter([(10.0, 8.0, None), (12.0, 10.0, None), (11.0, 9.0, None), (9.0, 6.0, None)])
    monkeypatch.setattr(quant_peers, "time_eager_and_graph", lambda fn, rep_ms, graph: next(times))
    rows = quant_decode.run_peers(TINY, 100.0, 10, str(device), fake_flashinfer, timed=True)
    assert [r.get("ours_speedup") for r in rows] == [None, 1.25, 1.125, 0.75]
    assert rows[0]["bw_fraction"] == pytest.approx(rows[0]["bytes"] / 8e-6 / 1e9 / 100.0)
    fp8 = quant_decode.bench_scheme("fp8_e4m3/tensor").bytes_per_token(2, 64) * sum(TINY.seq_lens())
    assert {r["bytes"] for r in rows} == {int(fp8 + 2 * 3 * 4 * 64 * 2)}  # one cache, one byte count: codes, q, out
    assert quant_decode.summary(rows)[0].startswith("T: fp8 ours vs best accurate FlashInfer fp8: 1.125x against "
                                                    "tensor_core (ours 8.0 us, FlashInfer 9.0 us, graph)")


def test_peer_rows_time_ratio_and_summary(monkeypatch, device):
    """Stand-in peers on random data: rel_err against the reference, ours' time over each peer's (graph when both have
    one), the flag, an error row, and the summary's verdict."""
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(3, 4, 64, generator=g)
    out = torch.empty(3, 4, 64, dtype=torch.float16)
    noisy = (ref + 0.05 * torch.randn(ref.shape, generator=g)).half()
    entries = {"heuristic": {"impl": "ours", "fn": lambda: out.copy_(ref), "accurate": True},
               "fast_exact": {"impl": "flashinfer", "fn": lambda: out.copy_(ref), "accurate": True, "resolved": "fa2"},
               "eager_only": {"impl": "flashinfer", "fn": lambda: ref.half(), "accurate": True},
               "lossy": {"impl": "flashinfer", "fn": lambda: out.copy_(noisy), "accurate": False},
               "broken": {"impl": "flashinfer", "fn": RuntimeError("no kernel for sm_90"), "accurate": True}}
    times = iter([(100.0, 90.0, None), (120.0, 99.0, None), (105.0, None, "graph: RuntimeError: capture"),
                  (80.0, 60.0, None)])
    monkeypatch.setattr(quant_peers, "time_eager_and_graph", lambda fn, rep_ms, graph: next(times))
    base = {"section": "peers", "workload": "W9", "scheme": "fp8_e4m3/tensor"}
    rows = quant_peers.peer_rows(entries, out, ref, 10, True, base)
    by = {r["backend"]: r for r in rows}
    assert by["heuristic"]["rel_err"] < 1e-3 and by["lossy"]["rel_err"] > quant_peers.ACCURATE
    assert by["fast_exact"]["resolved"] == "fa2" and by["eager_only"]["resolved"] is None
    assert (by["fast_exact"]["ours_speedup"], by["fast_exact"]["ratio_basis"]) == (pytest.approx(1.1), "graph")
    assert (by["eager_only"]["ours_speedup"], by["eager_only"]["ratio_basis"]) == (pytest.approx(1.05), "eager")
    assert by["eager_only"]["graph_error"].startswith("graph: RuntimeError")
    assert not by["lossy"]["accurate"] and by["lossy"]["ours_speedup"] == pytest.approx(60 / 90)
    assert by["broken"]["error"] == "RuntimeError: no kernel for sm_90" and not by["broken"]["accurate"]
    assert "ours_speedup" not in by["broken"] and "ours_speedup" not in by["heuristic"]
    lines = quant_peers.summary_lines(rows)
    assert lines[0].startswith("W9: fp8 ours vs best accurate FlashInfer fp8: 1.050x against eager_only (ours 100.0 "
                               "us, FlashInfer 105.0 us, eager) | fast_exact 1.100x; eager_only 1.050x; lossy 0.667x "
                               "(not accurate: rel_err")
    assert lines[0].endswith("| broken: RuntimeError: no kernel for sm_90")
    assert lines[1] == "fp8 ours ahead of every accurate FlashInfer fp8 backend on every workload: yes"
    assert quant_peers.ours_vs({"time_us": 0.0}, {"time_us": 5.0}) == {}
    assert quant_peers.ours_vs({"time_us": 2.0, "time_us_graph": None}, {"time_us": 3.0, "time_us_graph": 1.0}) == {
        "ours_speedup": 1.5, "ratio_basis": "eager"}


def test_a_lost_context_stops_the_section(monkeypatch):
    out, ref = torch.empty(2, 3), torch.randn(2, 3, generator=torch.Generator().manual_seed(1))

    def faults():
        raise RuntimeError("CUDA error: misaligned address")

    entries = {"heuristic": {"impl": "ours", "fn": lambda: out.copy_(ref), "accurate": True},
               "bad": {"impl": "flashinfer", "fn": faults, "accurate": True},
               "after": {"impl": "flashinfer", "fn": lambda: out.copy_(ref), "accurate": True}}
    rows = quant_peers.peer_rows(entries, out, ref, 10, False, {"section": "peers", "workload": "W1"})
    assert rows[1]["error"] == "RuntimeError: CUDA error: misaligned address"
    assert rows[2]["error"].startswith("not run: an earlier backend left the CUDA context unusable")
    first, verdict = quant_peers.summary_lines(rows)
    assert first.startswith("W1: fp8 ours vs best accurate FlashInfer fp8: no accurate FlashInfer backend timed | "
                            "bad: RuntimeError: CUDA error: misaligned address; after: not run")
    assert verdict.endswith("every workload: no")
