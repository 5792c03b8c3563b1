"""Probe launch configs of ``paged_decode`` for the vLLM split layout on W1, against NHD, on the GPU.

``python scripts/probe_vllm_decode.py [--out DIR] [--budget-s S] [--smoke]``

W1 (fp16) in the vLLM and NHD layouts at pages 8..128: per page a few launch configs (BLOCK_N,
num_stages, num_warps, splits, key tile) timed eagerly (the lower of two medians) and replayed from a
CUDA graph, as fractions of the copy bandwidth measured in the same run; each row carries ``rel_err``
against a float32 reference on the contiguous cache and, where Triton exposes it, the compiled
kernel's registers, spills and shared memory. Rows are written after every page, so a run stopped
at its budget keeps what it measured, as ``vllm-decode-probe-<gpu>-<date>.json`` (not ``decode-*.json``, which
the decode benchmark's readers take as its own). ``--smoke``: tiny W1, correctness only (compiled on a GPU, the
interpreter on a CPU).
Findings: docs/decode_tuning.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from workbench.kernels import paged_decode
from workbench.kernels.decode import kernel as dec

import workbench  # backend first (importing workbench.kernels imports it too)
from workbench.bench import harness
from workbench.bench.decode_timing import ref_fp32
from workbench.core.workloads import WORKLOADS, build_paged, bytes_moved, contiguous_kv
from workbench.results import provenance, run_files

# (name, launch overrides); the heuristic's pick on W1 is BLOCK_N 32, 4 stages, 4 warps, 1 split
BASE = {"BLOCK_N": 32, "num_stages": 4, "num_warps": 4, "num_splits": 1}
VLLM_CFGS = [
    ("n32-s4-w4", {}),
    ("n16-s4-w4", {"BLOCK_N": 16}),
    ("n32-s3-w4", {"num_stages": 3}),
    ("n64-s3-w4", {"BLOCK_N": 64, "num_stages": 3}),
    ("n32-s4-w8", {"num_warps": 8}),
    ("n64-s3-w8", {"BLOCK_N": 64, "num_stages": 3, "num_warps": 8}),
    ("n32-s4-w4-split2", {"num_splits": 2}),
    ("n32-s4-w4-k2d", {"k3d": False}),
]
PAGES = [8, 128, 64, 16, 32]  # the lagging pages first
NHD_CFGS = [("n32-s4-w4", {})]


def _kernels() -> set:
    """Compiled kernels Triton holds for the decode kernel (empty where its cache is not reachable)."""
    out = set()
    for cache in getattr(dec._paged_decode_kernel, "device_caches", {}).values():
        kc = cache[0] if isinstance(cache, tuple) else cache
        if isinstance(kc, dict):
            out.update(id(k) for k in kc.values())
            _kernels.objs.update({id(k): k for k in kc.values()})
    return out


_kernels.objs = {}


def _compiled_info(before: set) -> dict:
    new = _kernels() - before
    if len(new) != 1:
        return {}
    k = _kernels.objs[new.pop()]
    info = {}
    for name in ("n_regs", "n_spills"):
        if getattr(k, name, None) is not None:
            info[name] = int(getattr(k, name))
    shared = getattr(getattr(k, "metadata", None), "shared", None)
    if shared is not None:
        info["smem"] = int(shared)
    return info


def _kernels_safe() -> set:
    try:
        return _kernels()
    except Exception:  # noqa: BLE001  (introspection only: Triton's cache layout differs by version)
        return set()


def _compiled_info_safe(before: set) -> dict:
    try:
        return _compiled_info(before)
    except Exception:  # noqa: BLE001
        return {}


def _decode_fn(p, out, splits, launch):
    return lambda: paged_decode(p.q, p.k_cache, p.v_cache, p.layout, p.block_table, p.seq_lens, out=out,
                                num_splits=splits, max_seq_len=p.max_seq_len, mean_seq_len=p.max_seq_len,
                                validate=False, **launch)


def probe_page(w, layout, page, cfgs, copy_gbps, rep_ms, smoke, device):
    p = build_paged(w, layout=layout, block_size=page, kv_dtype=torch.float16, device=device)
    ref = ref_fp32(p.q, *contiguous_kv(p), p.lens)
    nbytes = bytes_moved(w, 2, 2)
    out = torch.empty_like(p.q)
    rows = []
    for name, change in cfgs:
        cfg = {**BASE, **change}
        launch = {key: cfg[key] for key in ("BLOCK_N", "num_stages", "num_warps", "k3d") if key in cfg}

        fn = _decode_fn(p, out, cfg["num_splits"], launch)

        row = {"workload": w.key, "layout": layout, "block_size": page, "kv_dtype": "fp16", "variant": name,
               "BLOCK_N": cfg["BLOCK_N"], "num_stages": cfg["num_stages"], "num_warps": cfg["num_warps"],
               "num_splits": cfg["num_splits"], "k3d": cfg.get("k3d", True), "bytes": nbytes, "copy_gbps": copy_gbps}
        try:
            out.fill_(float("nan"))
            before = _kernels_safe()
            fn()
            row.update(_compiled_info_safe(before))
            row["rel_err"] = harness.rel_err(out.float(), ref)
            if not smoke:
                t = min(harness.time_us(fn, rep_ms=rep_ms) for _ in range(2))
                tg = harness.time_us_graph(fn, rep_ms=rep_ms)
                row.update(time_us=t, time_us_graph=tg, frac_copy_bw=nbytes / (t * 1e-6) / 1e9 / copy_gbps,
                           frac_copy_bw_graph=nbytes / (tg * 1e-6) / 1e9 / copy_gbps)
        except Exception as err:  # noqa: BLE001  (one failing config must not lose the rest)
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        print({key: (round(val, 4) if isinstance(val, float) else val) for key, val in row.items()
               if key not in ("workload", "kv_dtype", "bytes", "copy_gbps")}, flush=True)
        rows.append(row)
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default results/, git-ignored; data/results to commit)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop starting pages after this many seconds")
    ap.add_argument("--rep-ms", type=float, default=40.0)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny W1, no timing (compiled on a GPU, the interpreter on a CPU)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    smoke = args.smoke or not torch.cuda.is_available()
    device = str(workbench.device()) if smoke else "cuda"  # compiled kernels read GPU memory only
    w = WORKLOADS["W1"].smoke() if smoke else WORKLOADS["W1"]
    meta = provenance.machine_meta()
    copy_gbps = None if smoke else harness.copy_bandwidth_gbps()
    print(f"copy bandwidth {copy_gbps} GB/s", flush=True)
    rows = []
    plan = [("nhd", 8, NHD_CFGS), ("nhd", 128, NHD_CFGS)] + [("vllm", pg, VLLM_CFGS) for pg in PAGES]
    if smoke:
        plan = [("nhd", 8, NHD_CFGS)] + [("vllm", pg, VLLM_CFGS) for pg in (8, 16, 64)]
    for layout, page, cfgs in plan:
        if time.monotonic() - t0 > args.budget_s:
            print(f"budget spent: skipped {layout} page {page}", flush=True)
            continue
        rows += probe_page(w, layout, page, cfgs, copy_gbps, args.rep_ms, smoke, device)
        path = run_files.write_results("vllm-decode-probe", rows, meta, args.out,
                                       extra={"copy_gbps": copy_gbps, "workload": w.key})
    print(f"wrote {path} ({len(rows)} rows, {time.monotonic() - t0:.0f} s)")
    bad = [r for r in rows if r.get("error") or not r.get("rel_err", 1.0) < 1e-2]
    if bad:
        raise SystemExit(f"{len(bad)} rows failed or off the reference: {[r['variant'] for r in bad]}")


if __name__ == "__main__":
    main()
