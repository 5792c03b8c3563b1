"""Where a sweep's points go: an append-only journal while it runs, tidy CSV and JSON beside it.

``DIR/<stem>.jsonl`` gets one line per finished point, flushed and fsynced before the next is counted, so a
killed sweep loses at most the points that were running; the next run with the same stem reads the journal and
skips every point it holds (keyed by parameters, :func:`workbench.sweeps.grid.point_key`). A line torn by a kill
is ignored. ``<stem>.json`` (``{"meta", "rows"}``) and ``<stem>.csv`` are rewritten from the journal after the
run: one row per point, parameters then numbers then where it ran (gpu, versions, commit, date), as benchmark
results are stamped.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.core.argtypes import ensure_writable_dir
from workbench.results.provenance import ROOT
from workbench.studies.base import META_KEYS
from workbench.sweeps.catalog import get
from workbench.sweeps.grid import point_key

OUT = ROOT / "results" / "sweeps"  # git-ignored: what a user's sweep writes unless --out says otherwise
COMMITTED = ROOT / "data" / "results" / "sweeps"  # what the notebooks show by default
FORMAT = "workbench-sweep/1"


def ensure_dir(path: Path) -> Path:
    """``path`` created and writable, else ``ValueError`` naming ``out`` (before any point runs)."""
    try:
        return ensure_writable_dir(path)
    except ValueError as e:
        raise ValueError(f"out: {e}") from None


class Journal:
    """The finished points of one sweep file, appended one JSON line at a time. ``fresh``: the points on disk are
    forgotten, and the file is emptied only when the first new point is added (a run refused or stopped before
    any point finished leaves it as it was)."""

    def __init__(self, path: Path, fresh: bool = False):
        self.path = Path(path)
        self._truncate = fresh and self.path.exists()
        self.records: dict[str, dict] = {}
        if self.path.exists() and not fresh:
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # the last line of a killed run: that point runs again
                    continue
                if isinstance(record, dict) and "key" in record and "row" in record:
                    self.records[record["key"]] = record

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def add(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True, default=_plain) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w" if self._truncate else "a", encoding="utf-8") as f:
            self._truncate = False
            if f.tell() and not self._ends_with_newline():
                f.write("\n")  # after a torn line: keep this record on a line of its own
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records[record["key"]] = dict(record)

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"


def tidy_records(json_path: Path, sweep) -> list[dict]:
    """The journal records behind the tidy ``json_path`` of ``sweep`` (none when it is missing, another sweep's or
    not a sweep file); a row without every parameter (an older version of the sweep) is left out: it runs again."""
    try:
        doc = json.loads(Path(json_path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("meta", {}).get("sweep") != sweep.name:
        return []
    names = {p.name for p in sweep.params}
    records = []
    for r in doc.get("rows", []):
        params = {k: v for k, v in r.items() if k in names}
        if len(params) == len(names):
            meta = {k: r[k] for k in META_KEYS if k in r}
            row = {k: v for k, v in r.items() if k not in names and k not in META_KEYS and k != "sweep"}
            records.append({"key": point_key(params), "sweep": sweep.name, "params": params, "row": row, "meta": meta})
    return records


def seed_from_tidy(journal: Journal, json_path: Path, sweep) -> int:
    """A journal with no file yet takes the rows of the tidy ``json_path`` beside it (a committed sweep: its journal
    is not committed), so that adding points to it keeps the points it has. Returns how many were taken."""
    if journal.path.exists():
        return 0
    for record in tidy_records(json_path, sweep):
        journal.add(record)
    return len(journal.records)


def _plain(value):
    """JSON for numpy and torch scalars a point may return."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON: {value!r} ({type(value).__name__})")


def tidy(sweep_name: str, records: Iterable[Mapping]) -> list[dict]:
    """One flat row per record: ``sweep``, the parameters, the point's numbers, then where it ran."""
    rows = []
    for r in records:
        row = {"sweep": sweep_name, **r["params"], **r["row"]}
        row.update({k: r["meta"][k] for k in META_KEYS if k in r["meta"]})
        rows.append(row)
    return rows


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def csv_text(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in row.items()})
    return buf.getvalue()


def write_tidy(stem: Path, sweep_name: str, records: Iterable[Mapping], meta: Mapping) -> tuple[Path, Path]:
    """``stem.json`` and ``stem.csv`` with every record, in parameter order of the run that wrote them."""
    rows = tidy(sweep_name, records)
    doc = {"format": FORMAT, "meta": {"sweep": sweep_name, **meta, "points": len(rows)}, "rows": rows}
    json_path, csv_path = stem.with_suffix(".json"), stem.with_suffix(".csv")
    _atomic_write(json_path, json.dumps(doc, indent=1, default=_plain) + "\n")
    _atomic_write(csv_path, csv_text(rows))
    return json_path, csv_path


@dataclass(frozen=True)
class SweepFile:
    """A sweep's rows read back from any of its three files."""

    path: Path
    sweep: str
    meta: dict
    rows: list[dict]

    @property
    def label(self) -> str:
        gpus = sorted({str(r.get("gpu", "?")) for r in self.rows})
        commits = sorted({str(r.get("commit", "?")) for r in self.rows})
        return f"{self.path.name}: {len(self.rows)} points, {', '.join(gpus)}, commit {', '.join(commits)}"


def load(path: Path | str) -> SweepFile:
    """Rows from ``.json`` (as written), ``.jsonl`` (a running or interrupted sweep's journal) or ``.csv``
    (values typed by the sweep's parameter kinds; numbers as floats). ``ValueError`` naming the file when it is
    not a sweep file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: no sweep file at {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"path: {path} is not a sweep file (no format {FORMAT!r})")
        return SweepFile(path, doc["meta"]["sweep"], doc["meta"], doc["rows"])
    if path.suffix == ".jsonl":
        journal = Journal(path)
        records = list(journal.records.values())
        name = records[0]["sweep"] if records else path.stem
        return SweepFile(path, name, {"sweep": name, "journal": True}, tidy(name, records))
    if path.suffix == ".csv":
        rows = [dict(r) for r in csv.DictReader(io.StringIO(text))]
        if not rows or "sweep" not in rows[0]:
            raise ValueError(f"path: {path} is not a sweep file (no 'sweep' column)")
        name = rows[0]["sweep"]
        return SweepFile(path, name, {"sweep": name}, [_typed(name, r) for r in rows])
    raise ValueError(f"path: {path} is not a sweep file (expected .json, .jsonl or .csv)")


def _typed(sweep_name: str, row: dict) -> dict:
    try:
        params = {p.name: p for p in get(sweep_name).params}
    except ValueError:
        params = {}
    out = {}
    for key, text in row.items():
        if key in params:
            out[key] = params[key].parse(text)
        elif key in META_KEYS[1:]:
            out[key] = text
        else:
            try:
                out[key] = float(text)
            except ValueError:
                out[key] = {"True": True, "False": False, "": None}.get(text, text)  # csv writes bools by name
    return out


def files(name: str | None = None, dirs: Iterable[Path] | None = None) -> list[Path]:
    """The tidy JSON files of sweep ``name`` (every sweep when None) in ``dirs`` (default: the committed folder
    first, then the git-ignored one), each folder's files by name, a sweep's untagged file (``NAME.json``) first."""
    found = []
    for d in dirs if dirs is not None else (COMMITTED, OUT):
        for p in sorted(Path(d).glob("*.json"), key=lambda p: (p.stem != name, p.name)):
            try:
                doc = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(doc, dict) and doc.get("format") == FORMAT and name in (None, doc["meta"].get("sweep")):
                found.append(p)
    return found
