"""Allocator throughput of an older commit and of the working tree, interleaved in one process.

    python scripts/allocator_before_after.py REV [--seconds S] [--rounds N]

Loads ``workbench/allocator.py`` (or the ``workbench/allocator/`` package) as it was at ``REV``
through ``git show``, then runs ``workbench.bench.allocator.measure`` alternately on the old and
the current classes, so both see the same machine state; prints the median rate of each and the
ratio. Needs a git checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from workbench.bench import allocator as bench

ROOT = Path(__file__).resolve().parent.parent


def _git_show(rev: str, path: str) -> str | None:
    r = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def load_old(rev: str):
    """The allocator module at ``rev`` (a single file or a package), imported under a private name."""
    tmp = Path(tempfile.mkdtemp())
    src = _git_show(rev, "workbench/allocator.py")
    if src is not None:
        (tmp / "old_allocator.py").write_text(src)
        spec = importlib.util.spec_from_file_location("old_allocator", tmp / "old_allocator.py")
    else:  # a package: copy its files and rewrite its absolute imports
        pkg = tmp / "old_allocator"
        pkg.mkdir()
        names = subprocess.run(["git", "ls-tree", "--name-only", rev, "workbench/allocator/"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()
        for name in names:
            text = _git_show(rev, name).replace("workbench.allocator", "old_allocator")
            (pkg / Path(name).name).write_text(text)
        spec = importlib.util.spec_from_file_location("old_allocator", pkg / "__init__.py",
                                                      submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_allocator"] = mod
    spec.loader.exec_module(mod)
    return mod


def best_times(old, rev: str) -> None:
    """Microseconds per operation, the best of 7 ``timeit`` repeats, old and new alternated twice."""
    import timeit

    from workbench import allocator as new

    for _ in range(2):
        for name, mod in ((rev, old), ("now", new)):
            pool = mod.BlockPool(num_pages=100_000, page_tokens=16)
            m = mod.BlockManager(pool)
            m.add("p", list(range(4096)))
            m2, prompt = mod.BlockManager(pool), list(range(4096))

            def fork_free(m=m):
                m.fork("p", "c")
                m.free("c")

            def add_free(m2=m2, prompt=prompt):
                m2.add("r", prompt)
                m2.free("r")

            ops = [("allocate+free 1", lambda pool=pool: pool.decref(16, pool.allocate(16, 1)), 20000),
                   ("allocate+free 16", lambda pool=pool: pool.decref(16, pool.allocate(16, 16)), 3000),
                   ("fork+free 4096", fork_free, 1000), ("prefix hit add+free 4096", add_free, 200)]
            cells = [f"{label} {min(timeit.repeat(fn, number=k, repeat=7)) / k * 1e6:.2f} us" for label, fn, k in ops]
            print(f"{name:>10}: " + " | ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the older commit, e.g. HEAD or a hash")
    ap.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    ap.add_argument("--rounds", type=int, default=5, help="old/new alternations")
    ap.add_argument("--out", default=None, help="also write the rows as JSON to this folder (e.g. results/)")
    ap.add_argument("--timeit", action="store_true", help="instead: the best of 7 timeit repeats per operation "
                    "(steadier than rates on a busy machine)")
    args = ap.parse_args()
    old = load_old(args.rev)
    if args.timeit:
        return best_times(old, args.rev)
    new = (bench.BlockPool, bench.BlockManager)
    rates: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for _ in range(args.rounds):
        for name, (pool, manager) in (("old", (old.BlockPool, old.BlockManager)), ("new", new)):
            bench.BlockPool, bench.BlockManager = pool, manager
            for row in bench.measure(args.seconds):
                key = f"{row['op']} [batch {row['batch_blocks']}]"
                rates[name].setdefault(key, []).append(row["per_second"])
    bench.BlockPool, bench.BlockManager = new
    print(f"{'operation':<58} {args.rev + ' /s':>14} {'now /s':>12} {'now/old':>8}")
    rows = []
    for key in rates["old"]:
        o, n = statistics.median(rates["old"][key]), statistics.median(rates["new"][key])
        print(f"{key:<58} {o:>14,.0f} {n:>12,.0f} {n / o:>8.3f}")
        rows.append({"op": key, "baseline_rev": args.rev, "per_second_baseline": o, "per_second_now": n,
                     "ratio": n / o, "rounds": args.rounds, "seconds": args.seconds})
    if args.out:
        from workbench.results import provenance, run_files

        meta = provenance.machine_meta()
        meta["gpu"] = f"cpu-{meta['cpu']}"
        print(run_files.write_results("allocator_before_after", rows, meta, args.out))


if __name__ == "__main__":
    main()
