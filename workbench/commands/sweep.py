"""``python -m workbench sweep NAME [--param k=v ...] [--grid k=v1,v2 ...]``: a panel's sweep from a terminal.

Exit status 0 when every point finished, 1 when some failed (their errors printed; a rerun tries them again),
2 for bad input (a message naming the argument, nothing written).
"""

from __future__ import annotations

import argparse
import sys

from workbench.sweeps import catalog, executors, grid, runner, store


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m workbench sweep", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a notebook panel's sweep over a grid of parameters; tidy rows (CSV and JSON, one row per "
                    "point, with gpu, versions, commit and date) go to results/sweeps/ (git-ignored) unless --out. "
                    "An interrupted sweep resumes: points already in the file's journal are not run again.",
        epilog="examples:\n  python -m workbench sweep --list\n"
               "  python -m workbench sweep coalescing --grid block_size=1,8,16,64 --grid layout=nhd,vllm\n"
               "  python -m workbench sweep fragmentation --workers 2\n"
               "  python -m workbench sweep decode --executor ray --address HEAD_IP:6379   (one GPU per point)")
    p.add_argument("name", nargs="?", help="the sweep (see --list)")
    p.add_argument("--list", action="store_true", help="every sweep, where it is plotted, and its parameters")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="fix a parameter")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...", help="sweep a parameter")
    p.add_argument("--executor", choices=executors.EXECUTORS, default="local",
                   help="local: this process or --workers processes; ray: one Ray task per point")
    p.add_argument("--workers", type=int, default=1, help="local processes (default 1: in this process)")
    p.add_argument("--address", default=None,
                   help="an existing Ray cluster (HOST:PORT, or 'auto' for the one `ray start` runs here); "
                        "default: RAY_ADDRESS, else a cluster started here, else a private one")
    p.add_argument("--out", default=None, help="folder for the files (default results/sweeps)")
    p.add_argument("--tag", default=None, help="a word added to the file name: a separate journal")
    p.add_argument("--fresh", action="store_true", help="forget the journal's finished points and run all")
    p.add_argument("--dry-run", action="store_true", help="print the points and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print(catalog.listing())
        return 0
    if args.name is None:
        print("sweep: name a sweep (or --list):\n  " + ", ".join(catalog.names()), file=sys.stderr)
        return 2
    try:
        sweep = catalog.get(args.name)
        values = grid.parse(sweep, args.param, args.grid)
        if args.dry_run:  # the points, and which of them the journal already holds: what a run would do
            stem = runner.check_options(sweep, args.executor, args.workers, args.address, args.out, args.tag)
            if stem.parent.exists() and not stem.parent.is_dir():  # what the run would refuse (nothing created)
                raise ValueError(f"out: {stem.parent} exists and is not a folder")
            journal = store.Journal(stem.with_suffix(".jsonl"), fresh=args.fresh)
            finished = set() if args.fresh else set(journal.records) or {
                r["key"] for r in store.tidy_records(stem.with_suffix(".json"), sweep)}  # as run would seed it
            points = grid.points(values)
            done = sum(grid.point_key(p) in finished for p in points)
            print(f"sweep {sweep.name}: {len(points)} points, {done} already done; rows to {stem.with_suffix('.json')}")
            for p in points:
                print(("  done " if grid.point_key(p) in finished else "  ") + grid.point_key(p))
            return 0
        result = runner.run(sweep, values, executor=args.executor, workers=args.workers, address=args.address,
                            out=args.out, tag=args.tag, fresh=args.fresh, progress=not args.no_progress)
    except (ValueError, RuntimeError) as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sweep: interrupted; the finished points are kept; run the same command again to resume",
              file=sys.stderr)
        return 130
    print(result.summary())
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
