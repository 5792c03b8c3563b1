"""Timing, copy bandwidth and result files shared by every benchmark.

Speed figures are ratios measured in one run: a kernel's achieved bandwidth over the
device-to-device copy bandwidth measured by :func:`copy_bandwidth_gbps` in the same
process, or one implementation's time over a peer's. Results are tidy rows (one per
measurement) written with their metadata by :func:`write_results`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "data" / "results"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_meta() -> dict[str, str]:
    """GPU, versions, commit and date: stamped on every result file and row."""
    import triton

    # The GPU machine gets the working tree without .git: pass WORKBENCH_COMMIT there.
    commit = os.environ.get("WORKBENCH_COMMIT") or _git("rev-parse", "--short=12", "HEAD") or "unknown"
    if "WORKBENCH_COMMIT" not in os.environ and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "none",
        "python": sys.version.split()[0],
        "commit": commit,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def time_us(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median time of one call in microseconds (device events through triton's do_bench)."""
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def time_us_graph(fn: Callable[[], object], calls_per_graph: int = 10, rep_ms: float = 200) -> float:
    """Median time of one call replayed from a CUDA graph (launch gaps removed), in microseconds."""
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile, autotune) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median") / calls_per_graph


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read plus bytes written (the ceiling we report against)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src))
    return 2 * nbytes / (t * 1e-6) / 1e9


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def write_results(
    bench: str, rows: Sequence[dict], meta: dict[str, str], out_dir: Path | None = None, extra: dict | None = None
) -> Path:
    """Write ``{"meta": ..., "rows": [...]}`` as ``<bench>-<gpu>-<date>.json``; every row carries the meta columns."""
    out_dir = Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = meta["gpu"].replace("NVIDIA ", "").replace(" ", "-").lower()
    stamp = meta["date"].replace(":", "").replace("-", "")[:13]
    path = out_dir / f"{bench}-{gpu}-{stamp}.json"
    keep = ("gpu", "torch", "triton", "commit", "date")
    tidy = [{**row, **{k: meta[k] for k in keep}} for row in rows]
    path.write_text(json.dumps({"meta": meta, **(extra or {}), "rows": tidy}, indent=1) + "\n")
    return path


def load_results(pattern: str, results_dir: Path | None = None) -> list[dict]:
    """All rows of the result files matching ``pattern`` (newest file last)."""
    rows = []
    for path in sorted(Path(results_dir or RESULTS).glob(pattern)):
        rows.extend(json.loads(path.read_text())["rows"])
    return rows


def print_table(rows: Sequence[dict], columns: Sequence[str]) -> None:
    """A plain fixed-width table of ``columns`` (floats with 3 significant digits)."""

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
