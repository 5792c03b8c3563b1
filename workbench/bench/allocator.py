"""Allocator throughput on the CPU: ``python -m workbench bench allocator [--out DIR] [--seconds S]``.

Measures, in pure Python (no GPU involved):
- block allocate+free pairs per second, in batches of 1, 16 and 256 blocks (a decode step
  allocates one block per sequence now and then; a prefill allocates many at once);
- fork + free of a 4096-token sequence (256 blocks of 16) per second;
- prefix lookup: adding a 4096-token prompt whose first 4080 tokens are cached (hash chain
  of 255 blocks, reuse without copying), then freeing it, per second; and the same with
  prefix caching off (all blocks allocated fresh), for comparison.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

from workbench.allocator import BlockManager, BlockPool
from workbench.bench.command import BenchParser
from workbench.core.argtypes import positive_float
from workbench.results import provenance, run_files


def rate(fn: Callable[[], int], seconds: float) -> float:
    """Operations per second: ``fn`` does a batch and returns how many operations it did."""
    fn()  # warm up
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        done += fn()
    return done / elapsed


BATCHES = (1, 16, 256)
MEASUREMENTS = len(BATCHES) + 3  # then fork+free, prefix hit, prefix caching off


def measure(seconds: float = 1.0, progress: bool = False) -> list[dict]:
    """One row per measurement, each ``seconds`` long; ``progress``: a tqdm bar on stderr."""
    rows = []
    bar = tqdm(total=MEASUREMENTS, desc="allocator", unit="op", file=sys.stderr, disable=not progress)
    pool = BlockPool(num_pages=100_000, page_tokens=16)

    for batch in BATCHES:
        def pairs(batch=batch):
            for _ in range(64):
                pool.decref(16, pool.allocate(16, batch))
            return 64 * batch

        rows.append({"op": "allocate+free", "batch_blocks": batch, "per_second": rate(pairs, seconds)})
        bar.update()

    prompt = list(range(4096))
    m = BlockManager(pool)
    m.add("parent", prompt)

    def fork_free():
        m.fork("parent", "child")
        m.free("child")
        return 1

    rows.append({"op": "fork+free (4096 tokens, 256 blocks)", "batch_blocks": 256,
                 "per_second": rate(fork_free, seconds)})
    bar.update()

    for caching in (True, False):
        m2 = BlockManager(pool, prefix_caching=caching)

        def add_free(m2=m2):
            m2.add("req", prompt)
            m2.free("req")
            return 1

        name = "prefix hit add+free" if caching else "add+free, prefix caching off"
        rows.append({"op": f"{name} (4096 tokens)", "batch_blocks": 256, "per_second": rate(add_free, seconds)})
        bar.update()
    bar.close()
    m.check_invariants()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = BenchParser("allocator", __doc__)
    parser.add_argument("--seconds", type=positive_float, default=1.0, help="time per measurement (> 0)")
    args = parser.parse_args(argv)
    out = parser.start(args)  # checked before the measurement, not after
    meta = provenance.machine_meta()
    meta["gpu"] = "cpu-" + (platform.machine() or "unknown")  # this benchmark never touches a GPU
    rows = measure(args.seconds, progress=True)  # 6 x --seconds: a bar on stderr, stdout keeps the table
    run_files.print_table(rows, ["op", "batch_blocks", "per_second"])
    path = run_files.write_results("allocator", rows, meta, out, extra={"seconds": args.seconds})
    print(f"wrote {path}")
    return 0
