"""Where a shared-prefix cascade step's eager time goes on the host (issue 33): the GPU is idle while Python
launches, so an eager step costs ``max(host time, GPU time)``.

For the bench's 32k x 64 GQA 32/8 point (suffix 128) and a tiny one (GPU time ~nothing: the loop measures the
host), times ``CascadePlan.run`` and ``DecodePlan.run`` back to back without a sync (host us a call), and each
launch inside a cascade run (Triton's ``JITFunction.run``, ``torch.index_select``) by wrapping them. Writes JSON to
``--out`` (default ``results/``, untracked)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from triton.runtime.jit import JITFunction
from workbench.kernels.launch import PlannedLaunch

from workbench.bench.harness import host_us, time_us, time_us_graph
from workbench.bench.shared_prefix import Point
from workbench.results.provenance import machine_meta


def per_launch(fn) -> dict:
    """Host us of each launch (Triton kernels by name, planned launches, index_select) within one call of ``fn``,
    median of the last 50 of 60 calls."""
    seen: dict[str, list[float]] = {}

    def timed(orig, name_of):
        def wrapper(*a, **k):
            t = time.perf_counter()
            r = orig(*a, **k)
            seen.setdefault(name_of(a), []).append((time.perf_counter() - t) * 1e6)
            return r
        return wrapper

    wrapped = [(JITFunction, "run", lambda a: a[0].fn.__name__), (torch, "index_select", lambda a: "index_select"),
               (PlannedLaunch, "__call__", lambda a: a[0].fn.__name__ + " (planned)")]
    origs = [getattr(owner, attr) for owner, attr, _ in wrapped]
    for (owner, attr, name_of), orig in zip(wrapped, origs, strict=True):
        setattr(owner, attr, timed(orig, name_of))
    try:
        for _ in range(60):
            t = time.perf_counter()
            fn()
            seen.setdefault("(whole call)", []).append((time.perf_counter() - t) * 1e6)
    finally:
        for (owner, attr, _), orig in zip(wrapped, origs, strict=True):
            setattr(owner, attr, orig)
    torch.cuda.synchronize()
    out = {}
    for name, v in seen.items():
        per_call = len(v) / 60  # Triton's path runs only the first time where a launch is planned
        v = sorted(v[-50 * max(1, int(per_call)):]) if per_call >= 1 else sorted(v)
        out[name] = {"calls": round(per_call, 2), "median_us": v[len(v) // 2]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    rows = []
    for label, (prefix, sharers, suffix) in {"32k x 64": (32768, 64, 128), "tiny": (256, 4, 16)}.items():
        p = Point(prefix, sharers, suffix, 32, 8)
        plain, casc, separate = p.plain(), p.cascade(64), p.cascade(64, {"fuse_gather": False})
        for impl, plan in (("plain", plain), ("cascade", casc), ("cascade, separate gather", separate)):
            def fn(plan=plan, p=p):
                return plan.run(p.q, p.k, p.v)
            rows.append({"point": label, "impl": impl, "host_us": host_us(fn, calls=200, warmup=10),
                         "time_us": time_us(fn, rep_ms=100), "time_us_graph": time_us_graph(fn, rep_ms=100),
                         "launches": per_launch(fn)})
            print(json.dumps(rows[-1]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cascade-host.json").write_text(json.dumps({"meta": machine_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
