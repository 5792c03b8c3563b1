"""FlashInfer's fp8 decode beside ours in ``bench quant_decode`` (its section ``peers``): the project's own
fp8_e4m3/tensor cache (e4m3 codes, one scale per tensor for K and one for V) handed to FlashInfer as it stands (NHD
pages are FlashInfer's NHD layout; the page table exported as its CSR by ``workbench.bench.byok_decode.op_inputs``),
each of FlashInfer's decode backends planned on it once (``workbench.conformance.peers.flashinfer_plan``), run once
against the same dequantized float32 reference as our row, then timed as our row is (the lower of two
``triton.testing`` medians and the CUDA-graph median, ``decode_timing.time_eager_and_graph``).

Rows (beside ``section: "peers"``, ``workload``, ``scheme``, ``bytes``): ``impl`` (``ours`` first, then
``flashinfer``), ``backend`` (ours: ``heuristic``; FlashInfer's: :data:`FLASHINFER_FP8_BACKENDS`), ``resolved`` (the
kernel FlashInfer picked), ``declared_accurate`` (the backend keeps q in fp16), ``accurate`` (declared, and its
``rel_err`` within :data:`ACCURATE`), ``time_us``, ``time_us_graph``, and on FlashInfer's rows ``ours_speedup`` (the
peer's time over ours: above 1, ours is faster) with ``ratio_basis`` (``graph`` when both rows have a CUDA-graph
time, else ``eager``). A backend that fails is a row with ``error``; one that loses the CUDA context stops the
section (the rows after it say so).
"""

from __future__ import annotations

import importlib
import math

import torch

from workbench.bench import harness
from workbench.bench.byok_decode import op_inputs
from workbench.bench.decode_timing import time_eager_and_graph
from workbench.conformance.isolation import context_lost, sticky
from workbench.conformance.peers import FLASHINFER_FP8_BACKENDS, flashinfer_plan

PEER_SCHEME = "fp8_e4m3/tensor"  #: the scheme FlashInfer reads as we store it (one scalar k_scale / v_scale)
ACCURATE = 1e-2  #: rel_err an accurate row stays within (ours < 1e-3; XQA's e4m3 q and probabilities: 3.6e-2)
WORKSPACE = 128 << 20  #: bytes of each backend's zeroed workspace (one each: XQA keeps semaphores in its first 8 MiB)
_ARGS = ("q", "k_cache", "v_cache", "layout", "kv_indptr", "kv_indices", "kv_last_page_len", "block_size", "sm_scale",
         "k_scale", "v_scale")


def load_flashinfer(device) -> tuple[object | None, str]:
    """``(flashinfer, "")`` when it imports and ``device`` is a CUDA device; else ``(None, line)``, the one line the
    benchmark prints instead of the section (``peers: flashinfer not installed, skipped``)."""
    try:
        fi = importlib.import_module("flashinfer")  # optional: the peers kit brings it (../shared/peers/README.md)
    except ModuleNotFoundError as e:
        if e.name == "flashinfer":
            return None, "peers: flashinfer not installed, skipped"
        return None, f"peers: flashinfer not importable ({type(e).__name__}: {str(e)[:160]}), skipped"
    except Exception as e:  # noqa: BLE001  (a broken install: the section is skipped, the run goes on)
        return None, f"peers: flashinfer not importable ({type(e).__name__}: {str(e)[:160]}), skipped"
    if torch.device(device).type != "cuda":
        return None, f"peers: flashinfer runs on a CUDA GPU, not on {device}, skipped"
    return fi, ""


def flashinfer_fns(fi, p, k_cache, v_cache, k_scale, v_scale, out, *, cuda_graph: bool = True) -> dict:
    """backend -> ``{"impl", "fn", "accurate", "resolved"}`` for each of :data:`FLASHINFER_FP8_BACKENDS` on ``p``'s
    page table with our caches ``k_cache`` / ``v_cache`` and their one-element scales; ``fn`` writes ``out`` (an
    Exception when planning failed). ``fi``: the flashinfer module (a test passes a stand-in)."""
    inputs = {**op_inputs(p, out), "k_cache": k_cache, "v_cache": v_cache, "k_scale": k_scale, "v_scale": v_scale}
    args = [inputs[k] for k in _ARGS]
    fns = {}
    for name, accurate in FLASHINFER_FP8_BACKENDS.items():
        try:
            ws = torch.zeros(WORKSPACE, dtype=torch.uint8, device=p.q.device)
            fn, resolved = flashinfer_plan(fi, *args, workspace=ws, backend=name, out=out, cuda_graph=cuda_graph,
                                           block_table=p.block_table, seq_lens=p.seq_lens)
        except Exception as e:  # noqa: BLE001  (a backend this GPU or build lacks: its row says why)
            fn, resolved = e, ""
        fns[name] = {"impl": "flashinfer", "fn": fn, "accurate": accurate, "resolved": resolved}
    return fns


def ours_vs(ours: dict, peer: dict) -> dict:
    """``{"ours_speedup": peer time / our time, "ratio_basis"}``: CUDA-graph times when both rows have one, else the
    eager ones; ``{}`` when either row lacks a usable time."""
    for key, basis in (("time_us_graph", "graph"), ("time_us", "eager")):
        a, b = ours.get(key), peer.get(key)
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0:
            return {"ours_speedup": b / a, "ratio_basis": basis}
    return {}


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}"


def peer_rows(entries: dict, out: torch.Tensor, ref: torch.Tensor, rep_ms: float, timed: bool, base: dict) -> list:
    """One row per entry (backend -> ``{"impl", "fn", "accurate", "resolved"}``, ours first): ``fn()`` run once into
    ``out`` (NaN-filled before) and judged against ``ref``, then (``timed``) timed; each later row gets
    :func:`ours_vs` against the first. ``base``: the fields every row shares."""
    rows, lost = [], ""
    for backend, e in entries.items():
        row = {**base, "impl": e["impl"], "backend": backend, "resolved": e.get("resolved") or None,
               "declared_accurate": bool(e["accurate"])}
        fn = e["fn"]
        if lost:
            row["error"] = f"not run: an earlier backend left the CUDA context unusable ({lost})"
        elif isinstance(fn, Exception):
            row["error"] = _error(fn)
        else:
            try:
                out.fill_(float("nan"))
                got = fn()
                row["rel_err"] = harness.rel_err((out if got is None else got).reshape(ref.shape), ref)
                if timed:
                    t, tg, gerr = time_eager_and_graph(fn, rep_ms, graph=True)
                    row.update(time_us=t, time_us_graph=tg, **({"graph_error": gerr} if gerr else {}))
            except Exception as err:  # noqa: BLE001  (a failing backend is a row, not a crash)
                row["error"] = _error(err)
                lost = row["error"] if sticky(row["error"]) else context_lost()
        row["accurate"] = bool(e["accurate"] and row.get("rel_err") is not None and row["rel_err"] <= ACCURATE)
        if rows:
            row.update(ours_vs(rows[0], row))
        rows.append(row)
    return rows


def summary_lines(rows: list[dict]) -> list[str]:
    """Per workload of the ``peers`` rows: ours against the fastest accurate FlashInfer backend (the ratio, both times,
    the basis) and every other backend's ratio; then whether ours is ahead of every accurate one on every workload."""
    peers = [r for r in rows if r.get("section") == "peers"]
    lines, ahead = [], []
    for key in dict.fromkeys(r["workload"] for r in peers):
        rs = [r for r in peers if r["workload"] == key]
        ours = next((r for r in rs if r["impl"] == "ours"), {})
        timed = [r for r in rs if r["impl"] != "ours" and r.get("ours_speedup")]
        accurate = [r for r in timed if r["accurate"]]
        others = "; ".join(f"{r['backend']} {r['ours_speedup']:.3f}x" + ("" if r["accurate"] else
                                                                         f" (not accurate: rel_err {r['rel_err']:.2g})")
                           for r in timed)
        failed = "; ".join(f"{r['backend']}: {r.get('error') or 'no time'}" for r in rs
                           if r["impl"] != "ours" and not r.get("ours_speedup"))
        if accurate:
            best = min(accurate, key=lambda r: r["ours_speedup"])
            ahead.append(best["ours_speedup"] > 1)
            basis = "time_us_graph" if best["ratio_basis"] == "graph" else "time_us"
            head = (f"{best['ours_speedup']:.3f}x against {best['backend']} (ours {ours[basis]:.1f} us, "
                    f"FlashInfer {best[basis]:.1f} us, {best['ratio_basis']})")
        else:
            ahead.append(False)
            head = "no accurate FlashInfer backend timed"
        tail = "".join(f" | {x}" for x in (others, failed) if x)
        lines.append(f"{key}: fp8 ours vs best accurate FlashInfer fp8: {head}{tail}")
    if lines:
        lines.append(f"fp8 ours ahead of every accurate FlashInfer fp8 backend on every workload: "
                     f"{'yes' if all(ahead) else 'no'}")
    return lines
