"""A run's journal: each unit (a conformance case, a benchmark measurement) is written down before it runs and its
row after, one fsynced JSON line each. A process that dies mid-run (a kernel that takes the CUDA context or the
interpreter with it) leaves a unit started and never finished: that unit is the one to blame, and ``--resume``
reports it as crashed and continues after it, reusing every finished row.

    with Journal(path, {"run": "check", "impl": "mine", ...}, resume=False) as j:
        j.start(key); ...; j.finish(key, row)
    Journal(path, same_header, resume=True).done / .crashed
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from workbench.core.argtypes import ensure_writable_dir


def digest(keys) -> str:
    """A short fingerprint of a run's unit keys: a resumed run must be the same run."""
    return hashlib.sha1("\n".join(keys).encode()).hexdigest()[:12]


class Journal:
    """``done``: key -> row of every finished unit (resumed); ``crashed``: keys started and never finished, in
    order. A new journal (``resume=False``) replaces the file; ``resume=True`` needs the file and the same
    ``header`` (ValueError otherwise, before anything is written)."""

    def __init__(self, path: Path | str, header: dict, resume: bool = False):
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"journal {path} is a folder; name a file")
        self.path, self.header = path, dict(header)
        self.done: dict[str, dict] = {}
        self.crashed: list[str] = []
        if resume:
            if not path.is_file():
                raise ValueError(f"resume: no journal at {path} (run once without --resume first)")
            self._read()
        try:
            ensure_writable_dir(path.parent)
        except ValueError as e:
            raise ValueError(f"journal {path}: {e}") from None
        self._f = open(path, "a" if resume else "w", encoding="utf-8")  # noqa: SIM115  (closed by close())
        if not resume:
            self._write({"header": self.header})

    def _read(self) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        records = []
        for i, line in enumerate(lines):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    continue  # the last line torn by the crash: that unit counts as started only
                raise ValueError(f"journal {self.path}: line {i + 1} is not JSON") from None
        theirs = records[0].get("header") if records and isinstance(records[0], dict) else None
        if theirs != self.header:
            raise ValueError(f"journal {self.path} is of another run ({theirs}), not this one ({self.header}): "
                             f"drop --resume to start over, or name another journal")
        started: dict[str, None] = {}
        for rec in records[1:]:
            if "start" in rec:
                started[rec["start"]] = None
            elif "done" in rec:
                self.done[rec["done"]] = rec["row"]
        self.crashed = [k for k in started if k not in self.done]

    def _write(self, record: dict) -> None:
        self._f.write(json.dumps(record, default=str) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())  # on disk before the unit runs: a crash cannot lose the attribution

    def start(self, key: str) -> None:
        self._write({"start": key})

    def finish(self, key: str, row: dict) -> None:
        self.done[key] = row
        self._write({"done": key, "row": row})

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
