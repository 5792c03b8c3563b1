"""``python -m workbench bench results``: the newest timed decode run of a result folder, printed (no GPU needed).

The rows are read and shaped by :mod:`workbench.results.decode`, which notebook 02 and the decode results panel use.
"""

from __future__ import annotations

from pathlib import Path

from workbench.bench.command import BenchParser
from workbench.results.decode import TIMED, best_per_workload, copy_ceiling, load_decode
from workbench.results.run_files import print_table


def main(argv: list[str] | None = None) -> int:
    """``python -m workbench bench results``: print the newest timed decode run's summary (no GPU needed)."""
    ap = BenchParser("results", main.__doc__, out=False)
    ap.add_argument("--dir", type=Path, default=None, help="result folder (default data/results)")
    ap.add_argument("--graph", action="store_true", help="rank by CUDA-graph time")
    args = ap.parse_args(argv)
    rows = load_decode(results_dir=args.dir, latest=True, where=TIMED)
    if not rows:
        print("no decode results: run `python -m workbench bench decode` on a GPU")
        return 0
    r0 = rows[0]
    print(f"{r0['gpu']} {r0['date']} commit {r0['commit']}: copy bandwidth {copy_ceiling(rows):.0f} GB/s")
    best = best_per_workload(rows, args.graph)
    print_table([r for impls in best.values() for r in impls.values()],
                ["workload", "impl", "variant", "time_us", "time_us_graph", "frac_copy_bw", "frac_copy_bw_graph"])
    return 0
