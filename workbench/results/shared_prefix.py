"""The committed shared-prefix measurements (``python -m workbench bench shared_prefix``,
``data/results/shared-prefix-*.json``) as plain tables: the crossover map (prefix x sharers -> speedup of the
cascade over plain paged decode, with the selector's pick), the times of every path by sharers, and how each path's
time grows with the tokens it must read. Pure functions of a loaded run (no plotly): notebook 08 plots them.
``workbench/bench/shared_prefix.py`` documents the rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from workbench.results import run_files

PATTERN = "shared-prefix-*.json"
H200 = {"gpu": "NVIDIA H200", "mode": "full"}
TIMINGS = {"graph": ("time_us_graph", "speedup_graph", "auto_path", "auto_ok"),
           "eager": ("time_us", "speedup", "auto_path_eager", "auto_ok_eager")}


def runs(results_dir: Path | str | None = None, where: Mapping | None = None) -> list[dict]:
    """The committed full runs (default: the H200's in ``data/results``), oldest first."""
    return run_files.load_runs(PATTERN, results_dir, H200 if where is None else where)


run_name = run_files.run_name  # the run's file name: what the notebook quotes


def _timing(timing: str) -> tuple[str, str, str, str]:
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {sorted(TIMINGS)}, got {timing!r}")
    return TIMINGS[timing]


def _map_rows(run: Mapping, gqa: str, impl: str) -> list[dict]:
    return [r for r in run["rows"] if r.get("section") == "map" and r.get("gqa") == gqa and r.get("impl") == impl]


def gqa_ratios(run: Mapping) -> list[str]:
    return sorted({r["gqa"] for r in run["rows"] if r.get("section") == "map"}, key=lambda g: -int(g.split("/")[1]))


def suffixes(run: Mapping) -> list[int]:
    return sorted({r["suffix"] for r in run["rows"] if r.get("section") == "map"})


@dataclass(frozen=True)
class CrossoverMap:
    prefixes: list[int]
    sharers: list[int]
    speedup: list[list[float | None]]  # [prefix][sharers]; None: no cascade (one sharer)
    picked: list[list[bool | None]]  # the selector took the cascade
    right: list[list[bool | None]]  # its pick was the faster path


def crossover(run: Mapping, gqa: str, suffix: int, timing: str = "graph") -> CrossoverMap:
    """The map at one GQA ratio and suffix length."""
    _, speed, path, ok = _timing(timing)
    rows = [r for r in _map_rows(run, gqa, "cascade") if r["suffix"] == suffix]
    if not rows:
        raise ValueError(f"no map rows for gqa {gqa!r}, suffix {suffix} in {run_name(run)}")
    prefixes = sorted({r["prefix"] for r in _map_rows(run, gqa, "plain")})
    sharers = sorted({r["sharers"] for r in _map_rows(run, gqa, "plain")})
    at = {(r["prefix"], r["sharers"]): r for r in rows}

    def grid(f):
        return [[f(at[(p, s)]) if (p, s) in at else None for s in sharers] for p in prefixes]

    return CrossoverMap(prefixes, sharers, grid(lambda r: r[speed]), grid(lambda r: r.get(path) == "shared"),
                        grid(lambda r: r.get(ok)))


def times_by_sharers(run: Mapping, gqa: str, prefix: int, suffix: int, timing: str = "graph") -> dict[str, list]:
    """``{impl: [(sharers, time_us), ...]}`` for plain, cascade and SDPA at one prefix and suffix (SDPA only where its
    contiguous copy fit)."""
    key = _timing(timing)[0]
    out = {}
    for impl in ("plain", "cascade", "sdpa"):
        pts = [(r["sharers"], r[key]) for r in _map_rows(run, gqa, impl)
               if r["prefix"] == prefix and r["suffix"] == suffix and r.get(key)]
        if pts:
            out[impl] = sorted(pts)
    return out


def growth(run: Mapping, gqa: str, timing: str = "graph") -> dict[str, list[tuple[float, float, dict]]]:
    """How time grows: plain against ``sharers * (prefix + suffix)`` tokens, the cascade against ``tiles * prefix +
    sharers * suffix`` (``tiles = ceil(sharers * G / rows_per_tile)``): ``{impl: [(tokens, time_us, row)]}``."""
    key = _timing(timing)[0]
    hq, hkv = (int(x) for x in gqa.split("/"))
    out = {"plain": [], "cascade": []}
    for r in _map_rows(run, gqa, "plain"):
        out["plain"].append((r["sharers"] * (r["prefix"] + r["suffix"]), r[key], r))
    for r in _map_rows(run, gqa, "cascade"):
        tiles = -(-r["sharers"] * (hq // hkv) // r["rows_per_tile"])
        out["cascade"].append((tiles * r["prefix"] + r["sharers"] * r["suffix"], r[key], r))
    return out


def section(run: Mapping, name: str) -> list[dict]:
    """The rows of one section (``fp8``, ``nested``, ``batching``, ``tile_sweep``)."""
    return [r for r in run["rows"] if r.get("section") == name]


def headline(run: Mapping, gqa: str, prefix: int = 32768, sharers: int = 64) -> dict[int, float]:
    """``{suffix: graph speedup}`` of the cascade at one prefix and sharer count (the issue's 32k x 64 target)."""
    return {r["suffix"]: r["speedup_graph"] for r in _map_rows(run, gqa, "cascade")
            if r["prefix"] == prefix and r["sharers"] == sharers}


def selector_picks(run: Mapping, gqa: str, timing: str = "graph") -> dict:
    """How the selector did on the run's map at one GQA ratio: ``points`` (cascade points), ``picked`` (where it
    took the cascade), ``wrong`` (picks where the cascade was not faster), ``slowest`` (the smallest speedup it
    took; None when it took none)."""
    _, speed, path, _ = _timing(timing)
    rows = _map_rows(run, gqa, "cascade")
    picked = [r for r in rows if r.get(path) == "shared"]
    return {"points": len(rows), "picked": len(picked), "wrong": sum(r[speed] <= 1 for r in picked),
            "slowest": min((r[speed] for r in picked), default=None)}


def format_selector(runs: list[dict], timing: str = "graph") -> str:
    """Two lines per run and GQA ratio (each fits a notebook's output area): the 32k x 64 headline speedups, then
    how the selector did (:func:`selector_picks`)."""
    lines = []
    for run in runs:
        for gqa in gqa_ratios(run):
            head, s = headline(run, gqa), selector_picks(run, gqa, timing)
            slowest = "-" if s["slowest"] is None else f"{s['slowest']:.2f}x"
            lines.append(f"{run_name(run)} {gqa:>5}: 32k x 64 sharers, "
                         + ", ".join(f"suffix {n}: {x:.1f}x" for n, x in sorted(head.items())))
            lines.append(f"    selector took the cascade at {s['picked']} of {s['points']} points, wrong at "
                         f"{s['wrong']}; slowest pick {slowest}")
    return "\n".join(lines)


def format_sections(run: Mapping) -> str:
    """The run's nested-tree and FP8 cascade rows (time against plain decode, error) and its batching rows (bytes
    and time a step, arrival order against grouped by overlap), a line each."""
    lines = []
    for name in ("nested", "fp8"):
        for r in section(run, name):
            if r["impl"] == "cascade":
                lines.append(f"{name:>6} {r['gqa']}: {r['prefix']} prefix x {r['sharers']} + {r['suffix']}: cascade "
                             f"{r['time_us_graph']:.0f} µs vs plain {r['plain_us_graph']:.0f} µs = "
                             f"{r['speedup_graph']:.2f}x, rel err {r['rel_err']:.1e}")
    for r in section(run, "batching"):
        lines.append(f"batching {r['impl']:>8}: {r['batches']} batches, {r['bytes'] / 1e6:.0f} MB read, "
                     f"{r['time_us_graph']:.0f} µs a step (no sharing: {r['plain_bytes'] / 1e6:.0f} MB)")
    return "\n".join(lines)
