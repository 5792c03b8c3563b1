"""Timing, copy bandwidth and accuracy shared by every benchmark.

Speed figures are ratios measured in one run: a kernel's achieved bandwidth over the
device-to-device copy bandwidth measured by :func:`copy_bandwidth_gbps` in the same
process, or one implementation's time over a peer's. Results are tidy rows (one per
measurement), stamped by :func:`workbench.results.provenance.machine_meta` and written by
:func:`workbench.results.run_files.write_results`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_us(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median time of one call in microseconds (device events through triton's do_bench)."""
    import triton.testing  # here: triton adds 0.2 s to this module's import, which rel_err's users (notebook 08) skip

    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def time_us_graph(fn: Callable[[], object], calls_per_graph: int = 10, rep_ms: float = 200) -> float:
    """Median time of one call replayed from a CUDA graph (launch gaps removed), in microseconds."""
    import triton.testing  # here: as in time_us

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


def time_us_events(fn: Callable[[], object], reps: int = 10, rounds: int = 3) -> float:
    """Median over ``rounds`` of the mean device time (us) of ``reps`` back-to-back calls, CUDA events on the
    current stream, after one call to warm up: for calls that overlap with other streams, where ``do_bench``'s
    cache flushes and its own synchronizations would change what is measured."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(out)


def host_us(fn: Callable[[], object], calls: int = 20, warmup: int = 3) -> float:
    """Host microseconds a call of ``fn`` takes to issue its work, without waiting for it (the GPU synchronized
    before and after, not between): what an eager step pays for its launches."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


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
