"""The decode benchmark's result rows (``data/results/decode-*.json``) shaped for tables and plots.

``python -m workbench bench results [--dir DIR] [--graph]`` (``workbench.bench.results``) prints the newest timed
(not ``--smoke``) run.

Pure helpers over the tidy rows that :mod:`workbench.bench.decode` writes (one row per
measurement; see that module for the columns). Rows without a time (smoke runs, failed
peers) are dropped by :func:`load_decode`; everything else keeps its columns.

Roofline of a decode step: ``4 * Hq * D * sum(context)`` FLOPs (``q.k`` and ``p.v``, two
FLOPs per multiply-add) over the bytes it must move (the row's ``bytes``); its arithmetic
intensity is about ``Hq / Hkv`` FLOP/byte at fp16 (1 for MHA, 4 for the GQA workloads),
so every point sits far left of the ridge and the ceiling that matters is the copy bandwidth
measured in the same run (``copy_gbps``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from workbench.analysis.coalescing import analyze
from workbench.core.kv_spec import dtype_size
from workbench.core.workloads import WORKLOADS
from workbench.results.run_files import load_results

# H200 SXM dense FP16/BF16 tensor-core peak: NVIDIA's datasheet gives 1,979 TFLOPS "with sparsity", half dense.
H200_PEAK_TFLOPS_FP16 = 989.5


def load_decode(pattern: str = "decode-*.json", results_dir: Path | str | None = None,
                latest: bool = False, where: Mapping | None = None) -> list[dict]:
    """Timed rows of every matching result file (oldest file first).

    Args:
        pattern: file glob inside ``results_dir``.
        results_dir: default ``data/results``.
        latest: keep only the newest run of those that match ``where``.
        where: keep only files whose metadata matches (:func:`workbench.results.run_files.matches`), e.g.
            ``{"gpu": "NVIDIA H200", "mode": "full"}`` (the committed runs the notebooks show).
    """
    rows = load_results(pattern, Path(results_dir) if results_dir else None, where=where, latest=latest)
    return [r for r in rows if r.get("time_us")]


# Runs that measured anything: smoke runs only check correctness (no times).
TIMED = {"mode": lambda mode: mode != "smoke"}


def decode_flops(row: dict) -> float | None:
    """FLOPs of the row's decode step, ``4 * Hq * D * sum(context)``; None for an unknown workload."""
    w = WORKLOADS.get(row.get("workload", ""))
    if w is None:
        return None
    return 4.0 * w.num_q_heads * w.head_dim * sum(w.seq_lens())


def _time(row: dict, graph: bool) -> float | None:
    return row.get("time_us_graph") if graph else row.get("time_us")


def label(row: dict) -> str:
    """``impl`` plus what distinguishes the row (variant, layout, page size, dtype, padding)."""
    parts = [row["impl"]]
    if row.get("sweep"):
        parts.append(f"{row['layout']}/bs{row['block_size']}/{row['kv_dtype']}")
        if row.get("block_stride_pad"):
            parts.append(f"pad{row['block_stride_pad']}")
        if row["sweep"] == "stages":
            parts.append(f"stages{row.get('num_stages')}")
    elif row.get("variant"):
        parts.append(row["variant"])
    return " ".join(parts)


def roofline_points(rows: Iterable[dict], graph: bool = False) -> list[dict]:
    """One point per timed row: ``intensity`` (FLOP/byte), ``tflops``, ``gbps`` and ``frac`` of copy bandwidth.

    Args:
        rows: decode rows.
        graph: use the CUDA-graph time (rows without one are skipped).
    """
    out = []
    for r in rows:
        t, flops = _time(r, graph), decode_flops(r)
        if not t or flops is None or not r.get("bytes"):
            continue
        gbps = r["bytes"] / (t * 1e-6) / 1e9
        out.append({"workload": r["workload"], "impl": r["impl"], "label": label(r), "sweep": r.get("sweep", ""),
                    "intensity": flops / r["bytes"], "tflops": flops / (t * 1e-6) / 1e12, "gbps": gbps,
                    "frac": gbps / r["copy_gbps"] if r.get("copy_gbps") else None, "time_us": t})
    return out


def copy_ceiling(rows: Iterable[dict]) -> float | None:
    """Median copy bandwidth (GB/s) over the rows' runs."""
    bw = [r["copy_gbps"] for r in rows if r.get("copy_gbps")]
    return statistics.median(bw) if bw else None


def best_per_workload(rows: Iterable[dict], graph: bool = False) -> dict[str, dict[str, dict]]:
    """``{workload: {impl: fastest row}}`` over the main (non-sweep) rows, workloads in W1..W5 order."""
    best: dict[str, dict[str, dict]] = {}
    for r in rows:
        t = _time(r, graph)
        if r.get("sweep") or not t:
            continue
        cur = best.setdefault(r["workload"], {}).get(r["impl"])
        if cur is None or t < _time(cur, graph):
            best[r["workload"]][r["impl"]] = r
    return {k: best[k] for k in sorted(best, key=lambda k: (k not in WORKLOADS, k))}


def fastest(rows: Iterable[dict], by: Sequence[str] = ("workload", "layout", "impl"),
            graph: bool = False) -> list[dict]:
    """The fastest timed row for each distinct value of the ``by`` columns, sorted by them."""
    best: dict[tuple, dict] = {}
    for r in rows:
        t = _time(r, graph)
        if not t:
            continue
        key = tuple(str(r.get(c)) for c in by)
        if key not in best or t < _time(best[key], graph):
            best[key] = r
    return [best[k] for k in sorted(best)]


def headline_rows(rows: Iterable[dict], graph: bool = False) -> list[dict]:
    """The fastest row of each implementation per workload, plus the fp8-storage sweep (the roofline's points)."""
    rows = list(rows)
    return best_rows(best_per_workload(rows, graph)) + sweep_rows(rows, "fp8")


def frac(row: dict, graph: bool = False) -> float | None:
    """The row's fraction of the copy bandwidth (eager or graph time)."""
    return row.get("frac_copy_bw_graph") if graph else row.get("frac_copy_bw")


def sweep_rows(rows: Iterable[dict], sweep: str) -> list[dict]:
    """The rows of one sweep (``layout``, ``fp8``, ``align``, ``stages``), newest run last, sorted for plotting."""
    keys = ("kv_dtype", "layout", "block_size", "block_stride_pad", "num_stages")
    return sorted((r for r in rows if r.get("sweep") == sweep), key=lambda r: tuple(str(r.get(k, "")).zfill(6)
                                                                                     for k in keys))


def with_coalescing(rows: Sequence[dict]) -> list[dict]:
    """Copies of the rows with the coalescing model's tile-read numbers for their K and V caches.

    Adds ``model_k_line_eff``, ``model_k_sector_eff``, ``model_v_line_eff``, ``model_v_sector_eff``
    and ``model_lane_bytes`` (the smaller of K and V), from the row's layout, page size, dtype,
    ``block_stride_pad`` (elements) and ``BLOCK_N``.
    """
    out = []
    for r in rows:
        w = WORKLOADS.get(r.get("workload", ""))
        r = dict(r)
        if w is not None and r.get("BLOCK_N"):
            elem = int(dtype_size(r["kv_dtype"]))
            lanes = []
            for kind in ("k", "v"):
                c = analyze(r["layout"], kind, r["block_size"], w.num_kv_heads, w.head_dim, elem,
                            pad_bytes=elem * int(r.get("block_stride_pad") or 0), block_n=int(r["BLOCK_N"]))
                r[f"model_{kind}_line_eff"] = c.tile.line_efficiency
                r[f"model_{kind}_sector_eff"] = c.tile.sector_efficiency
                lanes.append(c.tile.lane_bytes)
            r["model_lane_bytes"] = min(lanes)
        out.append(r)
    return out


def best_rows(best: Mapping[str, Mapping[str, dict]]) -> list[dict]:
    """The rows of :func:`best_per_workload`'s ``{workload: {impl: row}}`` as one list (workload, then impl order)."""
    return [r for impls in best.values() for r in impls.values()]


def layout_sweep(rows: Iterable[dict]) -> list[dict]:
    """The ``layout`` sweep's rows, each with ``series`` = ``"<layout> <kv_dtype>"`` (one line per layout and
    dtype against the block size)."""
    return [{**r, "series": f"{r['layout']} {r['kv_dtype']}"} for r in sweep_rows(rows, "layout")]


def align_sweep(rows: Iterable[dict]) -> list[dict]:
    """The ``align`` sweep's rows with the coalescing model's columns (:func:`with_coalescing`) and ``pad_bytes``,
    the bytes added to the block stride (``block_stride_pad`` elements times the element size)."""
    return [{**r, "pad_bytes": int(r.get("block_stride_pad") or 0) * int(dtype_size(r["kv_dtype"]))}
            for r in with_coalescing(sweep_rows(rows, "align"))]


def run_label(rows: Sequence[dict]) -> str:
    """``"<gpu> <date> commit <commit>"`` of the run the rows come from (their first row's metadata)."""
    r0 = rows[0]
    return f"{r0['gpu']} {r0['date']} commit {r0['commit']}"
