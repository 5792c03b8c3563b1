"""A sweep's tidy rows as a plot's series: one column on x, one on colour, every other varying parameter held
at one value. The same function draws a file a terminal sweep wrote and the rows a notebook computed live, so
the two cannot be plotted differently.

    from workbench.sweeps import view
    v = view.select(rows, sweeps.get("quant"), x="outlier", y="attn_err", color="family")
    v.series  # {"int4": [(1, 0.12), (4, 0.13), ...], ...}
    v.titles["y"]  # "attention-output error (relative, vs fp32)": the sweep's column table, never the bare name
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workbench.results.provenance import machine_meta
from workbench.studies.base import Column, Study
from workbench.sweeps.catalog import get
from workbench.sweeps.executors import execute_point
from workbench.sweeps.runner import plan
from workbench.sweeps.store import tidy

NO_COLOR = "(none)"


def column(sweep: Study, name: str) -> Column:
    """``name``'s label and unit from the sweep's table; a column it lacks (a newer file's) reads as its words."""
    return sweep.column(name) or Column(name.replace("_", " "))


def shown_value(sweep: Study, name: str, value) -> str:
    """A held parameter as a title says it: ``block size = 16 tokens``."""
    c = column(sweep, name)
    return f"{c.label} = {value}" + (f" {c.unit}" if c.unit and not isinstance(value, str) else "")


def value_range(values: Sequence[float], yes_no: bool = False) -> list[float] | None:
    """An axis range that fits ``values`` (non-finite ones left out): from 0 when none is negative (a constant or
    non-negative quantity never gets a negative axis), padded by 8% of the span, or of the value when they are all
    equal; ``[-0.3, 1.3]`` for yes/no. None when no value is finite."""
    if yes_no:
        return [-0.3, 1.3]
    finite = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    if not finite:
        return None
    lo, hi = min(finite), max(finite)
    if lo >= 0:
        lo = 0.0
    pad = 0.08 * (hi - lo) or 0.08 * abs(hi) or 1.0
    return [lo if lo == 0 else lo - pad, hi + pad]


def varying(rows: Sequence[Mapping], sweep: Study) -> dict[str, list]:
    """The parameters that take more than one value in ``rows``, in the sweep's order, each value list in the
    parameter's own order (its choices, else sorted)."""
    out = {}
    for p in sweep.params:
        seen = list(dict.fromkeys(r[p.name] for r in rows if p.name in r))
        if len(seen) > 1:
            order = {v: i for i, v in enumerate(p.choices or ())}
            out[p.name] = sorted(seen, key=lambda v: (order.get(v, len(order)), v))
    return out


def numeric_columns(rows: Sequence[Mapping], sweep: Study) -> list[str]:
    """Columns that are numbers (or bools) in every row and are not parameters: what a y axis can show. The
    sweep's own ``y`` first."""
    params = {p.name for p in sweep.params}
    found = [k for k in dict.fromkeys(k for r in rows for k in r)
             if k not in params and k != "seconds" and rows
             and all(isinstance(r.get(k), int | float) and r.get(k) is not None for r in rows)]
    return [k for k in sweep.y if k in found] + [k for k in found if k not in sweep.y]


@dataclass(frozen=True)
class View:
    """What one plot shows: ``series[color value] = [(x, y), ...]`` sorted by x, the values the other varying
    parameters were held at, and the rows that matched."""

    sweep: str
    x: str
    y: str
    color: str | None
    series: dict[Any, list[tuple[Any, float]]]
    held: dict[str, Any] = field(default_factory=dict)
    rows: int = 0
    absent: dict[str, Any] = field(default_factory=dict)  # held values asked for that no row has: nothing drawn
    yes_no: bool = False  # y is a yes/no column (bools stored, drawn 0/1 with yes/no ticks)
    titles: dict[str, str] = field(default_factory=dict)  # axis titles ("x", "y": label and unit), "x_label",
    # "y_label", "color" (labels) and "=name" (a held value in words)

    @property
    def numeric_x(self) -> bool:
        xs = [x for pts in self.series.values() for x, _ in pts]
        return bool(xs) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in xs)

    @property
    def log_x(self) -> bool:
        """A numeric x axis on positive values spanning 16x or more (block sizes, lengths): a log axis."""
        xs = [x for pts in self.series.values() for x, _ in pts]
        return self.numeric_x and min(xs) > 0 and max(xs) / min(xs) >= 16

    def title(self) -> str:
        """What the plot shows, in the sweep's words: ``y by x and colour``, and on a second line the held values
        (or the held values no row has)."""
        t = {"x": self.x, "y": self.y, "color": self.color, **self.titles}
        if self.absent:
            absent = ", ".join(t.get(f"={k}", f"{k}={v}") for k, v in self.absent.items())
            return f"{self.sweep}: no points at {absent} in these rows (another file may have them)"
        held = ", ".join(t.get(f"={k}", f"{k}={v}") for k, v in self.held.items())
        y, x = t.get("y_label", t["y"]), t.get("x_label", t["x"])  # the units are on the axes
        return f"{self.sweep}: {y} by {x}" + (f" and {t['color']}" if self.color else "") + (
            f"<br>at {held}" if held else "")

    def duplicates(self) -> dict[Any, Any]:
        """Series whose points are another's, drawn over it: ``{key: the earlier key it repeats}`` (the figure
        says so in the legend, so that no series hides unseen)."""
        seen: dict[tuple, Any] = {}
        out = {}
        for key, pts in self.series.items():
            sig = tuple(pts)
            if sig in seen:
                out[key] = seen[sig]
            else:
                seen[sig] = key
        return out


def select(rows: Sequence[Mapping], sweep: Study | str, x: str, y: str, color: str | None = None,
           held: Mapping[str, Any] | None = None) -> View:
    """``rows`` of ``sweep`` as series of ``y`` against ``x``, one per value of ``color`` (None or
    :data:`NO_COLOR`: one series). Every other varying parameter is held at ``held[name]`` when given, else at the
    sweep's default when it occurs, else at its first value. A held value no row has (a panel's choice that only
    another file holds) leaves the view empty and says so in ``absent``. Raises ``ValueError`` naming the argument
    for a column the rows do not have."""
    sweep = get(sweep) if isinstance(sweep, str) else sweep
    color = None if color in (None, NO_COLOR) else color
    if not rows:
        raise ValueError(f"rows: no rows of sweep {sweep.name!r} to plot")
    columns = set().union(*(r.keys() for r in rows))
    for arg, name in (("x", x), ("y", y), ("color", color)):
        if name is not None and name not in columns:
            raise ValueError(f"{arg}: {name!r} is not a column of the rows ({', '.join(sorted(columns))})")
    if color == x:
        raise ValueError(f"color: {color!r} is already the x axis")
    held = dict(held or {})
    chosen = {}
    defaults = sweep.defaults()
    for name, values in varying(rows, sweep).items():
        if name in (x, color):
            continue
        chosen[name] = next((v for v in (held.get(name), defaults.get(name)) if v in values), values[0])
    params = {p.name for p in sweep.params} - {x, color}
    absent = {k: v for k, v in held.items() if k in params and k in columns and all(r.get(k) != v for r in rows)}
    kept = [] if absent else [r for r in rows if all(r.get(k) == v for k, v in chosen.items())]
    yes_no = bool(kept) and all(isinstance(r.get(y), bool) for r in kept)
    series: dict[Any, list] = {}
    for r in kept:
        series.setdefault(r.get(color) if color else y, []).append((r[x], _number(r[y])))
    rank = {v: i for i, v in enumerate(varying(kept, sweep).get(x, []))}  # choices' order (schemes), else sorted
    for key, pts in series.items():
        series[key] = sorted(pts, key=lambda p: (rank.get(p[0], len(rank)), isinstance(p[0], str), p[0]))
    if color:
        order = varying(kept, sweep).get(color) or list(series)
        series = {k: series[k] for k in order if k in series}
    titles = {"x": column(sweep, x).title(), "y": column(sweep, y).title(), "x_label": column(sweep, x).label,
              "y_label": column(sweep, y).label}
    if color:
        titles["color"] = column(sweep, color).label
    titles.update({f"={k}": shown_value(sweep, k, v) for k, v in {**chosen, **absent}.items()})
    return View(sweep.name, x, y, color, series, chosen, len(kept), absent, yes_no, titles)


def _number(value) -> float:
    return float(value) if isinstance(value, bool | int | float) else float("nan")


def live_rows(sweep: Study | str, values: Mapping[str, Sequence] | None = None) -> list[dict]:
    """The tidy rows of ``sweep`` over ``values`` computed here and now, in this process, written nowhere (what
    a notebook panel shows live); a failed point raises."""
    sweep, points = plan(sweep, values)
    stamp = {k: v for k, v in machine_meta().items() if k in ("commit", "run")}
    records = []
    for params in points:
        record = execute_point(sweep.name, params, stamp)
        if "error" in record:
            raise RuntimeError(f"sweep {sweep.name}: point {params} failed: {record['error']}")
        records.append(record)
    return tidy(sweep.name, records)
