"""Result files of benchmark runs: where a run writes, where the committed runs live, a run written with its stamp,
found by its metadata and read back, its rows picked and printed.

A run writes to :data:`DEFAULT_OUT` (``results/`` at the top of the checkout, ignored by git) unless ``--out DIR``
names another folder; the committed results the notebooks plot live in :data:`RESULTS` (``data/results/``) and are
written there only by ``--out data/results``. A file is ``{"meta": ..., <extra fields>, "rows": [...]}`` named
``<bench>-<gpu>-<YYYYMMDDTHHMMSS>.json``, every row carrying the meta columns (:func:`write_results`); notebooks pick
committed runs by their metadata (:func:`load_runs`, :func:`load_results` with ``where=``).

Sweeps keep files of their own (``workbench.sweeps.store``): an append-only journal while a sweep runs and tidy
JSON / CSV whose values are typed by the sweep's parameters, found by the sweep's name; that store reads the sweep
catalog, which sits above these results.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from workbench.core.argtypes import ensure_writable_dir
from workbench.results.provenance import ROOT

RESULTS = ROOT / "data" / "results"  # committed results (what the notebooks plot); loaders read here
DEFAULT_OUT = ROOT / "results"  # where a run writes unless --out says otherwise (git-ignored)


def write_results(
    bench: str, rows: Sequence[dict], meta: dict[str, str], out_dir: Path | None = None, extra: dict | None = None
) -> Path:
    """Write ``{"meta": ..., "rows": [...]}`` as ``<bench>-<gpu>-<YYYYMMDDTHHMMSS>.json`` in ``out_dir``
    (default :data:`DEFAULT_OUT`); every row carries the meta columns.

    The file is created exclusively: another run in the same second gets ``-2``, ``-3``, ... before
    ``.json`` instead of overwriting an earlier one. The same run (``meta["run"]``, from
    :func:`machine_meta`) writing again, to checkpoint its progress, rewrites its own file.
    """
    out_dir = ensure_writable_dir(DEFAULT_OUT if out_dir is None else out_dir)
    gpu = meta["gpu"].replace("NVIDIA ", "").replace(" ", "-").lower()
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    keep = ("gpu", "torch", "triton", "commit", "date")
    tidy = [{**row, **{k: meta[k] for k in keep}} for row in rows]
    text = json.dumps({"meta": meta, **(extra or {}), "rows": tidy}, indent=1) + "\n"
    key = (bench, str(out_dir.resolve()), meta.get("run"))
    own = _WRITTEN.get(key) if meta.get("run") else None
    if own is not None and own.is_file():
        own.write_text(text)
        return own
    for n in range(1, 10_000):
        path = out_dir / f"{bench}-{gpu}-{stamp}{'' if n == 1 else f'-{n}'}.json"
        try:
            with open(path, "x") as f:
                f.write(text)
        except FileExistsError:
            continue
        _WRITTEN[key] = path
        return path
    raise FileExistsError(f"no free file name for {bench}-{gpu}-{stamp} in {out_dir}")


_WRITTEN: dict[tuple, Path] = {}  # (bench, folder, run id) -> the file this process wrote for that run


def run_name(run: Mapping) -> str:
    """A loaded run's file name (``tiers-h200-20261201T205651.json``): what the notebooks quote."""
    return Path(run["path"]).name


def run_info(doc: Mapping) -> dict:
    """A result file's metadata: its ``meta`` plus the other top-level fields (``mode``, ``smoke``, ...)."""
    return {**doc.get("meta", {}), **{k: v for k, v in doc.items() if k not in ("meta", "rows")}}


def matches(info: Mapping, where: Mapping | None) -> bool:
    """Whether metadata ``info`` satisfies every condition of ``where``.

    Each value of ``where`` is a callable (a predicate on the field, which gets None when the field is
    missing), a list/tuple/set of accepted values, or one value the field must equal.
    """
    for key, want in (where or {}).items():
        have = info.get(key)
        if callable(want):
            if not want(have):
                return False
        elif isinstance(want, (list, tuple, set, frozenset)):
            if have not in want:
                return False
        elif have != want:
            return False
    return True


def load_runs(pattern: str, results_dir: Path | str | None = None, where: Mapping | None = None) -> list[dict]:
    """The result files matching ``pattern`` whose metadata (:func:`run_info`) :func:`matches` ``where``,
    oldest first (by their ``date``, then name): each ``{"path", "info", "rows"}``."""
    runs = []
    for path in Path(results_dir or RESULTS).glob(pattern):
        doc = json.loads(path.read_text())
        info = run_info(doc)
        if matches(info, where):
            runs.append({"path": path, "info": info, "rows": doc["rows"]})
    return sorted(runs, key=lambda r: (str(r["info"].get("date", "")), r["path"].name))


def latest_with_updates(pattern: str, results_dir: Path | str | None = None,
                        where: Mapping | None = None) -> tuple[dict | None, list[dict]]:
    """The newest run of ``pattern`` matching ``where`` that measured all it measures (no ``schemes`` field), and the
    runs of some schemes only (a benchmark's ``--schemes``: a top-level ``schemes`` list) after it, oldest first,
    each re-measuring its schemes after a change: ``(run, updates)`` as :func:`load_runs` gives runs, ``(None, [])``
    without a whole run."""
    runs = load_runs(pattern, results_dir, where)
    whole = [i for i, r in enumerate(runs) if r["info"].get("schemes") is None]
    if not whole:
        return None, []
    return runs[whole[-1]], [r for r in runs[whole[-1] + 1:] if r["info"].get("schemes") is not None]


def load_results(pattern: str, results_dir: Path | str | None = None, where: Mapping | None = None,
                 latest: bool = False) -> list[dict]:
    """All rows of the result files matching ``pattern`` (default folder :data:`RESULTS`), oldest file first.

    Args:
        pattern: file glob inside ``results_dir``.
        results_dir: default ``data/results`` (the committed results).
        where: keep only files whose metadata matches (see :func:`matches`), e.g.
            ``{"gpu": "NVIDIA H200", "mode": "full"}``.
        latest: only the newest of the matching files.
    """
    runs = load_runs(pattern, results_dir, where)
    if latest:
        runs = runs[-1:]
    return [row for run in runs for row in run["rows"]]


def join_parts(docs: Sequence[Mapping]) -> dict:
    """One result document from the parts of a run split over calls (a GPU's per-call time limit): the rows of every
    part in order, the first part's ``meta`` with the newest ``date`` (the run's end), the other top-level fields of
    the first part, and ``parts``: each part's ``meta`` and top-level fields, so that nothing a part measured on its
    own (e.g. its copy bandwidth) is lost. ``ValueError`` when the parts ran on other GPUs, builds or commits."""
    if not docs:
        raise ValueError("docs: at least one part, got none")
    keys = ("gpu", "torch", "triton", "commit")
    first = docs[0]["meta"]
    for i, d in enumerate(docs[1:], 1):
        other = {k: d["meta"].get(k) for k in keys if d["meta"].get(k) != first.get(k)}
        if other:
            raise ValueError(f"docs[{i}]: a part of another run ({other}; the first part has "
                             f"{ {k: first.get(k) for k in other} })")
    meta = {**first, "date": max(d["meta"]["date"] for d in docs)}
    extra = {k: v for k, v in docs[0].items() if k not in ("meta", "rows")}
    parts = [{**{k: v for k, v in d.items() if k != "rows"}, "rows": len(d["rows"])} for d in docs]
    return {"meta": meta, **extra, "parts": parts, "rows": [r for d in docs for r in d["rows"]]}


def pick(rows: Sequence[Mapping], **where) -> Mapping:
    """The last of ``rows`` whose columns satisfy every condition of ``where`` (as :func:`matches`): with the rows
    of several runs, oldest first, the newest run's. ``ValueError`` naming the conditions when none does."""
    found = [r for r in rows if matches(r, where)]
    if not found:
        raise ValueError(f"where: no row matches {where} (of {len(rows)} rows)")
    return found[-1]


def print_table(rows: Sequence[dict], columns: Sequence[str], headers: Mapping[str, str] | None = None) -> None:
    """A plain fixed-width table of ``columns`` (floats with 3 significant digits).

    ``headers`` maps a column to a shorter title, so a wide table fits a notebook's output area.
    """

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    titles = [(headers or {}).get(c, c) for c in columns]
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(t), *(len(row[i]) for row in cells)) if cells else len(t) for i, t in enumerate(titles)]
    print("  ".join(t.rjust(w) for t, w in zip(titles, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
