"""Where a shared-prefix cascade step's GPU time goes, and what the shared pass's tile and the two passes' overlap
change (issue 33): at the bench's 32k x 64 points (GQA 32/8 and MHA 32/32, suffix 128 and 1024), CUDA-graph times of

- plain decode and the cascade three ways: its shared pass reading the query rows itself (the default: three
  launches), with a separate query gather (``fuse_gather=False``: four), and with ``overlap=True`` (the shared pass
  on a side stream beside the suffix pass);
- each piece alone: the query gather with the shared pass, the suffix pass, the merge (the rest);
- the shared pass alone per ``rows_per_tile`` x ``BLOCK_N`` x ``num_warps`` x ``num_stages`` (the shared pass does
  not depend on the suffix: suffix 128 points only), then the cascade with the fastest, with and without overlap,
  checked against plain decode.

Writes JSON to ``--out`` (default ``results/``, untracked)."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from workbench.kernels.decode import kernel as _kernel
from workbench.kernels.decode.cascade_kernels import _shared_pass_kernel

from workbench.bench.harness import rel_err, time_us, time_us_graph
from workbench.bench.shared_prefix import Point
from workbench.results.provenance import machine_meta

POINTS = {"gqa s128": (32, 8, 128), "gqa s1024": (32, 8, 1024), "mha s128": (32, 32, 128), "mha s1024": (32, 32, 1024)}
TILES = [64, 128]
BLOCK_NS = [32, 64, 128]
WARPS = [4, 8]
STAGES = [2, 3]
SPLITS: list[int] = []
SWEEP_OFF: list[bool] = []  # non-empty: --best given


def shared_alone(p: Point, plan) -> float:
    """The query gather and the shared pass of ``plan`` (built with ``fuse_gather=False``), under a graph."""
    sh = plan.plans[0]
    B, Hq, D = p.q.shape
    V = plan.num_tiles

    def fn():
        torch.index_select(p.q.view(B * Hq, D), 0, plan._q_idx, out=plan._q_v)
        sh.run_partials(plan._q_v.view(V, -1, D), p.k, p.v)
    return time_us_graph(fn, rep_ms=60)


def probe_point(name, emit, best) -> None:
    """Every row of one point (module docstring)."""
    hq, hkv, suffix = POINTS[name]
    p = Point(32768, 64, suffix, hq, hkv)
    plain = p.plain()
    ref = plain.run(p.q, p.k, p.v)
    fn_p = lambda: plain.run(p.q, p.k, p.v)  # noqa: E731
    tg_plain, t_plain = time_us_graph(fn_p, rep_ms=100), time_us(fn_p, rep_ms=100)
    emit({"point": name, "impl": "plain", "time_us": t_plain, "time_us_graph": tg_plain})
    configs = [("default", 64, {})]
    if name.endswith("s128") and not SWEEP_OFF:
        for tile, bn, w, st in itertools.product(TILES, BLOCK_NS, WARPS, STAGES):
            launch = {"BLOCK_N": bn, "num_warps": w, "num_stages": st}
            try:
                plan = p.cascade(tile, {"fuse_gather": False}, **launch)
                t = shared_alone(p, plan)
                err = rel_err(plan.run(p.q, p.k, p.v), ref)
            except Exception as e:  # noqa: BLE001  (out of shared memory and the like: recorded)
                emit({"point": name, "impl": "shared alone", "tile": tile, "launch": launch,
                      "error": repr(e)[:200]})
                continue
            emit({"point": name, "impl": "shared alone", "tile": tile, "launch": launch, "time_us_graph": t,
                  "rel_err": err})
            key = name.split()[0]
            if err < 1e-2 and (key not in best or t < best[key][0]):
                best[key] = (t, tile, launch)
    key = name.split()[0]
    if key in best:
        configs.append(("best shared", best[key][1], best[key][2]))
        if SPLITS:  # fewer shared programs, so the suffix pass's fit beside them on the SMs (with overlap)
            configs += [(f"best shared, {n} splits", best[key][1], {**best[key][2], "num_splits": n}) for n in SPLITS]
    for label, tile, launch in configs:
        for variant, kw in (("own gather", {}), ("separate gather", {"fuse_gather": False}),
                            ("overlap", {"overlap": True})):
            plan = p.cascade(tile, kw, **launch)
            fn = lambda plan=plan: plan.run(p.q, p.k, p.v)  # noqa: E731
            err = rel_err(fn(), ref)
            tg, t = time_us_graph(fn, rep_ms=100), time_us(fn, rep_ms=100)
            row = {"point": name, "impl": "cascade", "config": label, "tile": tile, "launch": launch,
                   "variant": variant, "overlap": variant == "overlap", "time_us": t,
                   "time_us_graph": tg, "speedup_graph": tg_plain / tg, "speedup_eager": t_plain / t, "rel_err": err,
                   "shared_splits": plan.plans[0].num_splits}
            if variant == "separate gather":
                sfx = plan.plans[1]
                row["shared_us_graph"] = shared_alone(p, plan)
                row["suffix_us_graph"] = time_us_graph(lambda sfx=sfx: sfx.run_partials(p.q, p.k, p.v), rep_ms=60)
            emit(row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results")
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--splits", default="", help="shared-pass split counts to try beside the best launch")
    ap.add_argument("--best", default="", help="skip the sweep: TILE,BLOCK_N,WARPS,STAGES for every point")
    args = ap.parse_args()
    SPLITS[:] = [int(x) for x in args.splits.split(",") if x]
    rows, best = [], {}
    if args.best:
        SWEEP_OFF.append(True)
        t, bn, w, st = (int(x) for x in args.best.split(","))
        best.update({k: (0.0, t, {"BLOCK_N": bn, "num_warps": w, "num_stages": st}) for k in ("gqa", "mha")})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "cascade-passes.json").write_text(json.dumps({"meta": machine_meta(), "rows": rows}, indent=1))

    for name in args.points.split(","):
        probe_point(name, emit, best)
        torch.cuda.empty_cache()
    for fn in (_kernel._paged_decode_kernel, _shared_pass_kernel):  # what each compiled variant holds
        for cache in getattr(fn, "device_caches", {}).values():
            for compiled in (cache[0] if isinstance(cache, tuple) else cache).values():
                md = compiled.metadata
                emit({"impl": "compiled", "kernel": fn.__name__, "n_regs": compiled.n_regs,
                      "n_spills": compiled.n_spills, "shared_bytes": md.shared, "num_warps": md.num_warps,
                      "num_stages": md.num_stages})


if __name__ == "__main__":
    main()
