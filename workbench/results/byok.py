"""The committed bring-your-own-kernel decode runs (``python -m workbench bench decode --impl NAME``,
``data/results/byok-decode-*.json``) as plain tables: per workload W1-W5, each implementation's fraction of the copy
bandwidth measured in the same run, and the implementations that have no bar and why (a peer not installed, a
kernel that failed the run's correctness check or raised, a timing that was not taken).

Pure functions of a loaded run (no plotly, no widgets): notebook 09 plots them, ``tests/test_conformance_panels.py``
checks them on a fixture. ``workbench/bench/byok_decode.py`` documents the rows: one per workload x implementation,
with ``impl``, ``origin`` (``ours``, ``example``, ``user``, ``peer``), ``status`` (``ok``, ``absent``,
``check_failed``, ``error``), ``time_us`` / ``time_us_graph``, ``gbps``, ``frac_copy_bw`` / ``frac_copy_bw_graph``,
``rel_err``, ``error`` and ``copy_gbps``; rows with a ``sweep`` (W1 by layout and page size) are another section.

The same GPU session commits the conformance suite's reports, compiled (``python -m workbench check NAME --json``,
``data/results/byok-check-<impl>-<op>-<level>[-<tag>]-<gpu>-<date>.json``): :func:`check_reports` lists them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from workbench.results import run_files

PATTERN = "byok-decode-*.json"
FULL = {"mode": "full"}  # timed runs (``--smoke`` runs check correctness only and carry no times)
TIMINGS = {"eager": ("time_us", "frac_copy_bw"), "graph": ("time_us_graph", "frac_copy_bw_graph")}
ORIGIN_ORDER = ("ours", "user", "example", "peer")  # how the bars are ordered: ours, yours, the starter, the peers
#: what a committed run is missing, and how one is made
NO_RUNS = ("No committed bring-your-own-kernel run yet (data/results/byok-decode-*.json): the bandwidth panel\n"
           "needs one measured on a GPU. `OUT=data/results scripts/byok_gpu.sh` makes it (the suite compiled, then\n"
           "the starter timed beside ours and the installed peers), or, for the timing alone,\n"
           "`python -m workbench bench decode --impl starter --out data/results`.")


def runs(results_dir: Path | str | None = None, where: Mapping | None = None) -> list[dict]:
    """The timed runs (default: every ``mode: full`` run in ``data/results``), oldest first: each
    ``{"path", "info", "rows"}`` (:func:`workbench.results.run_files.load_runs`)."""
    return run_files.load_runs(PATTERN, results_dir, FULL if where is None else where)


run_name = run_files.run_name  # the run's file name: what the notebook quotes


def describe(found: Sequence[Mapping]) -> str:
    """One line per run (its file, GPU, copy bandwidth, the implementations it timed), or :data:`NO_RUNS`."""
    if not found:
        return NO_RUNS
    lines = []
    for run in found:
        info = run["info"]
        copy = info.get("copy_gbps")
        impls = ", ".join(dict.fromkeys(r["impl"] for r in main_rows(run)))
        lines.append(f"{run_name(run)}: {info.get('gpu', '?')}, copy bandwidth "
                     f"{f'{copy:.0f} GB/s' if copy else 'not measured'}; {impls}")
    return "\n".join(lines)


def main_rows(run: Mapping) -> list[dict]:
    """The rows of the workload section (W1-W5 at the run's default layout and page size), without the sweep."""
    return [r for r in run["rows"] if not r.get("sweep")]


def workloads(run: Mapping) -> dict[str, str]:
    """``{key: name}`` of the run's workloads, in file order (``{"W1": "gqa-b64-l4k", ...}``)."""
    return {r["workload"]: r.get("workload_name", r["workload"]) for r in main_rows(run)}


def _timing(timing: str) -> tuple[str, str]:
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {sorted(TIMINGS)}, got {timing!r}")
    return TIMINGS[timing]


@dataclass(frozen=True)
class Bandwidth:
    """One run's workload section at one timing.

    Attributes:
        workloads: ``{key: name}``, in the run's order.
        impls: the implementations with at least one bar: ours first, then users', the starter, the peers (each
            group by its best fraction).
        origin: ``{impl: origin}`` of every implementation in the section.
        bars: the drawable rows, each ``{"workload", "impl", "origin", "frac", "time_us", "gbps", "rel_err"}``
            (``frac`` of the copy bandwidth of the same run, ``gbps`` recomputed from the timing's time).
        absent: ``{impl: why}``: peers the run could not import (never bars).
        failed: ``[(impl, workload, status, why)]``: rows that failed the run's correctness check or raised.
        untimed: ``[(impl, workload)]``: correct rows without a time at this timing (a CUDA graph not captured).
        copy_gbps: the run's copy bandwidth (what ``frac`` divides by).
        timing: ``eager`` or ``graph``.
    """

    workloads: dict[str, str]
    impls: list[str]
    origin: dict[str, str]
    bars: list[dict]
    absent: dict[str, str] = field(default_factory=dict)
    failed: list[tuple[str, str, str, str]] = field(default_factory=list)
    untimed: list[tuple[str, str]] = field(default_factory=list)
    copy_gbps: float | None = None
    timing: str = "eager"

    def value(self, impl: str, workload: str) -> dict | None:
        """The bar of ``impl`` on ``workload`` (None: it has none)."""
        return next((b for b in self.bars if b["impl"] == impl and b["workload"] == workload), None)


def bandwidth(run: Mapping, timing: str = "eager") -> Bandwidth:
    """The workload section of ``run`` at ``timing`` (``eager``: launched from Python; ``graph``: CUDA-graph
    replays), every row either a bar or named with the reason it has none."""
    t_key, f_key = _timing(timing)
    rows = main_rows(run)
    if not rows:
        raise ValueError(f"run {run_name(run)} has no workload rows")
    origin, absent, failed, untimed, bars = {}, {}, [], [], []
    for r in rows:
        impl, status = r["impl"], r.get("status", "ok")
        origin.setdefault(impl, r.get("origin", "peer"))
        if status == "absent":
            absent.setdefault(impl, r.get("error") or "not importable")
        elif status != "ok":
            why = r.get("error") or (f"rel err {r['rel_err']:.2g}" if r.get("rel_err") is not None else status)
            failed.append((impl, r["workload"], status, why))
        elif not r.get(t_key) or r.get(f_key) is None:
            untimed.append((impl, r["workload"]))
        else:
            bars.append({"workload": r["workload"], "impl": impl, "origin": origin[impl], "frac": r[f_key],
                         "time_us": r[t_key], "gbps": r["bytes"] / (r[t_key] * 1e-6) / 1e9 if r.get("bytes") else None,
                         "rel_err": r.get("rel_err")})
    best = {}
    for b in bars:
        best[b["impl"]] = max(best.get(b["impl"], 0.0), b["frac"])
    rank = {o: i for i, o in enumerate(ORIGIN_ORDER)}
    impls = sorted(best, key=lambda i: (rank.get(origin[i], len(rank)), -best[i]))
    copies = [r["copy_gbps"] for r in rows if r.get("copy_gbps")]
    copy = run["info"].get("copy_gbps") or (copies[0] if copies else None)
    return Bandwidth(workloads(run), impls, origin, bars, absent, failed, untimed, copy, timing)


def format_bandwidth(bw: Bandwidth) -> str:
    """A table of ``bw``: a line per workload, a column per implementation with a bar (its fraction of the copy
    bandwidth, ``-`` where it has none), then the peers absent from the run and why."""
    lines = [f"{'':18}" + "".join(f"{impl:>17}" for impl in bw.impls)]
    for key, name in bw.workloads.items():
        cells = [bw.value(impl, key) for impl in bw.impls]
        lines.append(f"{key} {name:<15}" + "".join(f"{c['frac']:>17.3f}" if c else f"{'-':>17}" for c in cells))
    lines.append("absent: " + (", ".join(f"{p} ({why})" for p, why in bw.absent.items()) or "none"))
    return "\n".join(lines)


def relative_to_ours(bw: Bandwidth, workload: str) -> dict[str, float]:
    """``{impl: frac / ours' frac}`` on one workload (empty when ours has no bar there)."""
    ours = bw.value("ours", workload)
    if ours is None or not ours["frac"]:
        return {}
    return {b["impl"]: b["frac"] / ours["frac"] for b in bw.bars if b["workload"] == workload}


CHECK_PATTERN = "byok-check-*.json"
_CHECK_NAME = re.compile(r"byok-check-(?P<impl>.+)-(?P<op>decode|shared_prefix|write|copy)-"
                         r"(?P<level>smoke|pairwise|full)(?:-(?P<tag>[a-z]+))?-(?P<gpu>[^-]+)-(?P<date>[0-9T]+)\.json$")


def check_reports(results_dir: Path | str | None = None) -> list[dict]:
    """The committed conformance reports, oldest first: each ``{"path", "impl", "op", "level", "tag", "backend",
    "seconds", "cases", "failed", "passed", "gpu", "commit", "date", "rows"}`` (``rows``: the report's case rows, as
    ``Report.rows()`` gives them; ``tag``: ``cold`` / ``warm`` for a run with / without first compiles,
    ``partial`` for a subset of a level)."""
    out = []
    for path in sorted(Path(results_dir or run_files.RESULTS).glob(CHECK_PATTERN)):
        m = _CHECK_NAME.match(path.name)
        if m is None:
            continue
        doc = json.loads(path.read_text())
        rows = doc.get("cases", [])
        out.append({"path": path, "impl": doc.get("impl", m["impl"]), "op": doc.get("op", m["op"]),
                    "level": m["level"], "tag": m["tag"] or "", "backend": doc.get("backend", ""),
                    "seconds": doc.get("seconds"), "cases": len(rows), "failed": sum(not r["passed"] for r in rows),
                    "passed": bool(doc.get("passed")) and all(r["passed"] for r in rows),
                    "gpu": doc.get("meta", {}).get("gpu", m["gpu"]), "commit": doc.get("meta", {}).get("commit", ""),
                    "date": doc.get("meta", {}).get("date", ""),
                    "rows": rows})
    return sorted(out, key=lambda r: (r["date"], r["path"].name))


def format_check_reports(reports: Sequence[Mapping]) -> str:
    """A line per committed report (:func:`check_reports`): implementation, op, level and tag, cases, the verdict,
    the time and the backend."""
    lines = []
    for r in reports:
        verdict = "all passed" if r["passed"] else f"{r['failed']} failed"
        tag = f" ({r['tag']})" if r["tag"] else ""
        seconds = f"{r['seconds']:.1f} s" if r.get("seconds") is not None else "? s"
        lines.append(f"{r['impl']:>12} {r['op']:<7} {r['level'] + tag:<15} {r['cases']:>4} cases: {verdict:<11} "
                     f"in {seconds}, {r['backend']}")
    return "\n".join(lines)


OP_ORDER = ("decode", "shared_prefix", "write", "copy")  # how committed reports are listed: the decode op first
_IMPL_ORDER = ("starter", "broken_", "ours")  # then the starter, its broken versions, ours (each by prefix)


def _report_rank(r: Mapping) -> tuple:
    op = OP_ORDER.index(r["op"]) if r["op"] in OP_ORDER else len(OP_ORDER)
    impl = next((i for i, p in enumerate(_IMPL_ORDER) if r["impl"].startswith(p)), len(_IMPL_ORDER))
    return op, impl, r["impl"], ("smoke", "pairwise", "full").index(r["level"]), r["tag"] != "warm", r["tag"]


def report_label(r: Mapping) -> str:
    """How a committed report reads in a list: ``H200: broken_gqa decode, pairwise: 33 cases, 16 failed``."""
    gpu = str(r["gpu"]).removeprefix("NVIDIA ")
    level = r["level"] + (f" ({r['tag']})" if r["tag"] else "")
    verdict = "all passed" if r["passed"] else f"{r['failed']} failed"
    return f"{gpu}: {r['impl']} {r['op']}, {level}: {r['cases']} cases, {verdict}"


def report_choices(reports: Sequence[Mapping], ops: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """``[(label, file name)]`` of the committed reports (of ``ops``, default all) with case rows: the decode op
    first, then by implementation (the starter, its broken versions, ours), level and tag (warm before cold)."""
    keep = [r for r in reports if r["rows"] and (ops is None or r["op"] in ops)]
    return [(report_label(r), Path(r["path"]).name) for r in sorted(keep, key=_report_rank)]


def find_report(reports: Sequence[Mapping], name: str) -> dict:
    """The committed report whose file is ``name`` (KeyError naming the ones there are)."""
    for r in reports:
        if Path(r["path"]).name == name:
            return dict(r)
    raise KeyError(f"no committed report {name!r}; there are {[Path(r['path']).name for r in reports]}")


def provenance(r: Mapping) -> str:
    """Where and when a committed report was measured: ``NVIDIA H200 (compiled), commit 05219e8, 2026-12-02``."""
    compiled = " (compiled)" if str(r.get("backend", "")).startswith("compiled") else ""
    parts = [f"{r['gpu']}{compiled}"]
    if r.get("commit"):
        parts.append(f"commit {r['commit']}")
    if r.get("date"):
        parts.append(str(r["date"])[:10])
    return ", ".join(parts)
