"""Run a sweep: check every point, skip the finished ones, run the rest on an executor, journal each as it
finishes, then write the tidy files. The same function behind ``python -m workbench sweep`` and a notebook."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from workbench.results.provenance import machine_meta
from workbench.studies.base import Study
from workbench.sweeps import executors, grid, store
from workbench.sweeps.catalog import get


@dataclass
class SweepRun:
    """What a run did: the tidy files, the rows of the points it was asked for, how many ran and were reused."""

    sweep: Study
    json_path: Path
    csv_path: Path
    journal_path: Path
    rows: list[dict]
    ran: int = 0
    reused: int = 0
    failed: list[dict] = field(default_factory=list)

    def summary(self) -> str:
        failed = f", {len(self.failed)} failed" if self.failed else ""
        lines = [f"sweep {self.sweep.name}: {len(self.rows)} points ({self.ran} run, {self.reused} already done"
                 f"{failed})"]
        if self.json_path.is_file():  # not when every point failed
            lines += [f"  rows: {self.json_path}", f"        {self.csv_path}"]
        for f in self.failed[:3]:
            lines.append(f"  failed {f['params']}: {f['error']}")
        return "\n".join(lines)


def stem_for(sweep: Study, out: Path | str | None, tag: str | None) -> Path:
    if tag is not None and (not tag or any(c in tag for c in "/\\ ") or tag.startswith(".")):
        raise ValueError(f"tag: expected a file-name word (letters, digits, - or _), got {tag!r}")
    directory = store.OUT if out is None else Path(out)
    return directory / (f"{sweep.name}-{tag}" if tag else sweep.name)


def check_options(sweep: Study, executor: str = "local", workers: int = 1, address: str | None = None,
                  out: Path | str | None = None, tag: str | None = None) -> Path:
    """Where the rows of a run with these options go (``out/<name>[-tag]``), every option checked (``ValueError``
    naming it); nothing is created."""
    if executor not in executors.EXECUTORS:
        raise ValueError(f"executor: expected one of {', '.join(executors.EXECUTORS)}, got {executor!r}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers: expected an int >= 1, got {workers!r}")
    if workers > 1 and executor == "ray":
        raise ValueError("workers: only with executor 'local' (Ray runs as many points at once as it has CPUs)")
    if address is not None and executor != "ray":
        raise ValueError("address: only with executor 'ray'")
    return stem_for(sweep, out, tag)


def plan(sweep: Study | str, values: Mapping[str, Any] | None = None) -> tuple[Study, list[dict]]:
    """The sweep and its points, every value checked (nothing has run)."""
    sweep = get(sweep) if isinstance(sweep, str) else sweep
    return sweep, grid.points(grid.check_values(sweep, values or {}))


def run(sweep: Study | str, values: Mapping[str, Any] | None = None, *, executor: str = "local", workers: int = 1,
        address: str | None = None, out: Path | str | None = None, tag: str | None = None, fresh: bool = False,
        progress: bool = True, points: Sequence[dict] | None = None) -> SweepRun:
    """Run ``sweep`` over ``values`` (name -> list; unnamed parameters take their own range) or the given
    ``points``. Points already in the journal ``out/<name>[-tag].jsonl`` are reused unless ``fresh``.

    Raises ``ValueError`` (bad argument, named) or ``RuntimeError`` (no GPU, no Ray) before anything is written.
    """
    if points is None:
        sweep, points = plan(sweep, values)
    else:
        sweep = get(sweep) if isinstance(sweep, str) else sweep
        points = [grid.points(grid.check_values(sweep, {k: [v] for k, v in p.items()}))[0] for p in points]
    stem = check_options(sweep, executor, workers, address, out, tag)
    gpu = [bool(sweep.needs_gpu(p)) for p in points]
    if executor == "ray":
        missing = executors.ray_available()
        if missing:
            raise RuntimeError(f"executor ray: {missing}")
    elif any(gpu):
        if not torch.cuda.is_available():
            raise RuntimeError(f"sweep {sweep.name}: {sum(gpu)} of its {len(points)} points need a GPU and this "
                               "machine has none; run it on one, or with --executor ray on a cluster with GPUs")
    store.ensure_dir(stem.parent)
    journal = store.Journal(stem.with_suffix(".jsonl"), fresh=fresh)
    if not fresh:  # a committed sweep has no journal: its tidy rows are its finished points
        store.seed_from_tidy(journal, stem.with_suffix(".json"), sweep)
    keys = [grid.point_key(p) for p in points]
    todo = [(p, g) for p, g, k in zip(points, gpu, keys, strict=True) if k not in journal]
    result = SweepRun(sweep, stem.with_suffix(".json"), stem.with_suffix(".csv"), journal.path, [],
                      reused=len(points) - len(todo))
    stamp = {k: v for k, v in machine_meta().items() if k in ("commit", "run")}  # the driver's: one run id a run
    if executor == "ray":
        stream = executors.run_ray(sweep.name, [p for p, _ in todo], stamp, [g for _, g in todo], address)
    else:
        stream = executors.run_local(sweep.name, [p for p, _ in todo], stamp, workers)
    bar = _bar(sweep.name, len(points), result.reused, progress)
    try:
        for record in stream:
            if "error" in record:
                result.failed.append(record)
            else:
                journal.add(record)
                result.ran += 1
            bar.update(1)
    finally:  # also after Ctrl-C: the tidy files hold every finished point
        bar.close()
        meta = {"updated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "executor": executor,
                "values": {k: list(v) for k, v in _values(points).items()}}
        if journal.records:
            store.write_tidy(stem, sweep.name, journal.records.values(), meta)
    result.rows = store.tidy(sweep.name, [journal.records[k] for k in keys if k in journal])
    return result


def _values(points: Sequence[dict]) -> dict[str, list]:
    values: dict[str, list] = {}
    for p in points:
        for k, v in p.items():
            if v not in values.setdefault(k, []):
                values[k].append(v)
    return values


def _bar(name: str, total: int, initial: int, on: bool):
    return tqdm(total=total, initial=initial, desc=f"sweep {name}", unit="point", disable=not on, leave=True)
