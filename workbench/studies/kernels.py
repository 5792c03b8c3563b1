"""The decode kernel's study, on a GPU: notebook 02 (layouts and kernels), the paged decode kernel timed on one workload
and cache variant, with a baseline timed in the same point, as ``python -m workbench bench decode`` measures them
(``workbench.bench.decode``: the workload's fragmented paged cache, our launch heuristic, ``DecodePlan.run`` timed
eagerly and as CUDA-graph replays, the error against a float32 reference); ``decode_results_panel`` plots the
committed bench runs of the same rows.

Every point needs a CUDA GPU: the runner refuses the sweep on a machine without one (``bench decode --smoke`` is
the CPU's correctness check). Times are measurements, not pure functions of the parameters; everything else in a
row (the launch configuration, bytes moved, the relative error) is.
"""

from __future__ import annotations

import functools
import math

import torch

from workbench.bench import decode_timing as timing
from workbench.bench import harness
from workbench.core import workloads
from workbench.studies.base import BLOCK_SIZES, Param, Study

WORKLOADS = tuple(workloads.WORKLOADS)
KV_DTYPES = tuple(timing.DTYPES)
BASELINES = (*timing.PEERS, "none")
DEVICE = "cuda"
SHORT = {"BLOCK_N": "BLOCK_N", "num_splits": "splits", "num_warps": "warps", "num_stages": "stages"}  # variant names


@functools.cache
def _copy_gbps() -> float:
    """The device's copy bandwidth (``harness.copy_bandwidth_gbps``), measured once a process: the ceiling every
    row's ``frac_copy_bw`` is against, as one bench run measures it once."""
    return harness.copy_bandwidth_gbps()


def _measure(w, *, layout: str, block_size: int, kv_dtype: str, pad: int, change: dict, baseline: str,
             rep_ms: float, graph: bool, seed: int, device: str = DEVICE) -> dict:
    """One bench decode row of ours on ``w`` (``decode.run_sweep_point``'s measurement) and ``baseline``'s time on
    the same cache (``decode.run_main``'s peers): ``x_baseline`` is the baseline's time over ours."""
    dtype = timing.DTYPES[kv_dtype]
    p = workloads.build_paged(w, layout=layout, block_size=block_size, kv_dtype=dtype, device=device,
                              block_stride_pad=pad, seed=seed)
    out = torch.empty_like(p.q)
    cfg = {**timing.heuristic_config(p, dtype), **change}
    fn = timing.ours_fn(p, cfg, out)
    out.fill_(float("nan"))
    fn()
    # the peers read fp16 for fp8
    k, v = workloads.contiguous_kv(p, dtype=torch.float16 if dtype.itemsize == 1 else None)
    ref = timing.ref_fp32(p.q, k, v, p.lens)
    err = harness.rel_err(out, ref)
    # ours first: a peer's compile must not disturb our timing
    t, tg, _ = timing.time_eager_and_graph(fn, rep_ms, graph=graph)
    copy_gbps = _copy_gbps()
    variant = "-".join(f"{SHORT[k]}{v}" for k, v in change.items()) or "heuristic"  # as bench decode names them
    row = timing.decode_row(w, "ours", variant, p, kv_dtype,
                            workloads.bytes_moved(w, dtype.itemsize, p.q.element_size()), copy_gbps, t, tg, err, cfg,
                            {"block_stride_pad": pad})
    base = {"baseline_time_us": math.nan, "baseline_time_us_graph": math.nan, "baseline_rel_err": math.nan,
            "baseline_error": ""}
    if baseline != "none":
        fns = timing.peer_fns(p, k, v)
        bfn = fns.pop(baseline)
        fns.clear()
        try:
            if isinstance(bfn, Exception):
                raise bfn
            base["baseline_rel_err"] = harness.rel_err(bfn().squeeze(2), ref)
            bt, btg, gerr = timing.time_eager_and_graph(bfn, rep_ms, graph=graph)
            base.update(baseline_time_us=bt, baseline_time_us_graph=math.nan if btg is None else btg,
                        baseline_error=gerr or "")
        except Exception as e:  # noqa: BLE001  (a baseline that fails is a row's field, as in bench decode)
            base["baseline_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        del bfn
    row.update(base)
    bt = base["baseline_time_us"]
    row["x_baseline"] = bt / t if t and math.isfinite(bt) else math.nan
    if baseline != "none" and math.isfinite(bt):
        row[f"x_{baseline}"] = row["x_baseline"]  # the bench row's name for the ratio
    for key in ("time_us_graph", "frac_copy_bw_graph"):
        if row.get(key) is None:
            row[key] = math.nan  # graph=False
    del fn, p, out, k, v, ref
    if device != "cpu":
        timing.free_memory()
    # the parameters are the runner's columns: the bench row's copies of them are left out
    return {key: val for key, val in row.items() if key not in ("workload", "layout", "block_size", "kv_dtype")}


def decode_point(workload: str, layout: str, block_size: int, kv_dtype: str, pad: int, block_n: int, splits: int,
                 warps: int, stages: int, baseline: str, rep_ms: float, graph: bool, seed: int) -> dict:
    """Ours on one workload and cache variant, timed as ``bench decode`` times it (``time_us``: the lower of two
    ``do_bench`` medians; ``time_us_graph``: CUDA-graph replay; ``frac_copy_bw`` of the copy bandwidth measured in
    the same process; ``rel_err`` against float32), the launch configuration used (the heuristic's, a nonzero
    ``block_n``/``splits``/``warps``/``stages`` overriding it), then ``baseline`` on the same cache: its times,
    ``baseline_error`` when it cannot run (``gather_sdpa`` needs nhd; an fp8 cache is read as fp16 by SDPA) and
    ``x_baseline`` = its time over ours (also ``x_<baseline>``, as the bench row names it)."""
    change = {k: v for k, v in (("BLOCK_N", block_n), ("num_splits", splits), ("num_warps", warps),
                                ("num_stages", stages)) if v}
    return _measure(workloads.WORKLOADS[workload], layout=layout, block_size=block_size, kv_dtype=kv_dtype, pad=pad,
                    change=change, baseline=baseline, rep_ms=rep_ms, graph=graph, seed=seed)


# every column's label and unit on the panel's axes (workbench.studies.base.Column); x_*: a baseline's time / ours
DECODE_COLUMNS = {
    "workload": ("workload",), "layout": ("layout",), "block_size": ("block size", "tokens"),
    "kv_dtype": ("KV dtype",), "pad": ("block stride padding", "elements"),
    "block_n": ("tile (0: heuristic)", "tokens"),
    "splits": ("KV splits (0: heuristic)",), "warps": ("warps (0: heuristic)",),
    "stages": ("pipeline stages (0: heuristic)",), "baseline": ("baseline",), "rep_ms": ("time per measurement", "ms"),
    "graph": ("CUDA graph timed",), "seed": ("seed",),
    "frac_copy_bw": ("fraction of the copy bandwidth, eager",),
    "frac_copy_bw_graph": ("fraction of the copy bandwidth, CUDA graph",), "time_us": ("time, eager", "µs"),
    "time_us_graph": ("time, CUDA graph", "µs"), "x_baseline": ("baseline's time / ours",),
    "x_*": ("{}'s time / ours",), "rel_err": ("error vs float32 (relative)",), "bytes": ("bytes moved", "MB", 1e-6),
    "copy_gbps": ("copy bandwidth", "GB/s"), "gbps": ("bandwidth", "GB/s"), "BLOCK_N": ("tile used", "tokens"),
    "num_splits": ("KV splits used",), "num_warps": ("warps used",), "num_stages": ("pipeline stages used",),
    "use_dot": ("tensor-core dot",), "block_stride_pad": ("block stride padding", "elements"),
    "baseline_time_us": ("baseline time, eager", "µs"), "baseline_time_us_graph": ("baseline time, CUDA graph", "µs"),
    "baseline_rel_err": ("baseline error vs float32 (relative)",),
}

DECODE = Study(
    "decode", "the paged decode kernel timed on a GPU against a baseline: fraction of copy bandwidth by layout", (
        Param("workload", "str", "W1", choices=WORKLOADS, help="docs/workloads.md (W1: 64 x 4k GQA)"),
        Param("layout", "str", "nhd", choices=("nhd", "hnd", "vllm"), grid=("nhd", "hnd", "vllm")),
        Param("block_size", "int", 16, choices=BLOCK_SIZES, grid=(8, 16, 32, 64, 128), help="tokens a page"),
        Param("kv_dtype", "str", "fp16", choices=KV_DTYPES, help="the cache's storage"),
        Param("pad", "int", 0, minimum=0, maximum=4096, help="elements added to the block stride"),
        Param("block_n", "int", 0, choices=(0, 16, 32, 64, 128), help="tokens a tile; 0: the heuristic's"),
        Param("splits", "int", 0, minimum=0, maximum=1024, help="KV splits; 0: the heuristic's"),
        Param("warps", "int", 0, choices=(0, 2, 4, 8), help="0: the heuristic's"),
        Param("stages", "int", 0, choices=(0, 1, 2, 3, 4, 5), help="pipeline stages; 0: the heuristic's"),
        Param("baseline", "str", "sdpa_contiguous", choices=BASELINES, help="timed on the same cache"),
        Param("rep_ms", "float", 50.0, minimum=1.0, maximum=10000.0, help="do_bench time per measurement"),
        Param("graph", "bool", True, help="also time CUDA-graph replays"),
        Param("seed", "int", 0, minimum=0, help="the cache's data and page permutation")),
    decode_point, notebook="02_layouts_and_kernels", panel="decode_results_panel", x="block_size", color="layout",
    y=("frac_copy_bw", "frac_copy_bw_graph", "time_us", "time_us_graph", "x_baseline", "rel_err"),
    columns=DECODE_COLUMNS,
    needs_gpu=lambda p: True)
STUDIES = (DECODE,)
