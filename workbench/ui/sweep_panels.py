"""A sweep's rows in a notebook: any file ``python -m workbench sweep`` wrote, or a small grid computed live,
plotted by the same function (``workbench.sweeps.view.select``) whichever it is.

    sweep_panel("quant")                               # the committed file, then any in results/sweeps
    sweep_panel("quant", live={"outlier": [1, 8]})     # also a grid computed here, written nowhere
    sweep_panel("results/sweeps/quant-night.json")     # one file first
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import ipywidgets as W
import plotly.graph_objects as go

from workbench.figures.titles import SUB_CHARS, TITLE_CHARS, wrap
from workbench.studies.base import Study
from workbench.sweeps import catalog, runner, store, view
from workbench.ui.panels import Panel

LIVE = "live"
PALETTE = ("#2a9d8f", "#e76f51", "#264653", "#e9c46a", "#8ab17d", "#9c6644", "#6d597a", "#f4a261", "#577590")
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star", "cross", "triangle-down", "pentagon")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
MAX_TICKS = 12  # a numeric x with this many values or fewer is ticked at the values swept


def sources_for(name_or_path: str | Path, live: Mapping[str, Sequence] | None = None
                ) -> tuple[Study, dict[str, str]]:
    """The sweep and its sources, ``{value: label}``: the file given first (when a path), then the sweep's
    committed files, then the git-ignored ones, then the live grid (when ``live`` is given)."""
    if not isinstance(name_or_path, str | Path):
        raise ValueError(f"name_or_path: expected a sweep's name or a sweep file's path, got {name_or_path!r}")
    if live is not None and not isinstance(live, Mapping):
        raise ValueError(f"live: expected a dict of parameter -> values, got {type(live).__name__}")
    given = Path(name_or_path)
    first: list[Path] = []
    if given.suffix in (".json", ".jsonl", ".csv"):
        try:
            loaded = store.load(given)
        except ValueError as e:
            raise ValueError(f"name_or_path: {str(e).removeprefix('path: ')}") from None
        sweep, first = catalog.get(loaded.sweep), [given]
    else:
        sweep = catalog.get(str(name_or_path))
    sources, seen = {}, set()
    for path in [*first, *store.files(sweep.name)]:
        if path.resolve() not in seen:  # the file given may also be one of the sweep's folders'
            seen.add(path.resolve())
            sources[str(path)] = _label(path)
    if live is not None:
        sources[LIVE] = f"live: {len(runner.plan(sweep, live)[1])} points computed here"
    if not sources:
        raise ValueError(f"name_or_path: sweep {sweep.name!r} has no file in {store.COMMITTED} or {store.OUT}; run "
                         f"`python -m workbench sweep {sweep.name}` or pass live={{...}}")
    return sweep, sources


def _label(path: Path) -> str:
    where = "committed" if store.COMMITTED in path.resolve().parents else "file"
    return f"{where}: {store.load(path).label}"


def sweep_figure(v: view.View, source: str = "") -> go.Figure:
    """Lines over a numeric x (log axis over a wide range), grouped bars over a categorical one, markers for a
    yes/no column; axes in the sweep's labels and units (``Study.columns``, values times the unit's scale), the y
    range from the data (from 0 when nothing is negative). Series that coincide keep apart: each has its own marker
    and dash, and one that repeats another says so in the legend."""
    sweep = catalog.get(v.sweep)
    scale = view.column(sweep, v.y).scale
    same = v.duplicates()
    fig = go.Figure()
    ys_all = []
    for i, (key, pts) in enumerate(v.series.items()):
        name = str(key) if v.color else v.titles.get("y", v.y)
        if key in same:
            name += f" (same as {same[key]})"
        color = PALETTE[i % len(PALETTE)]
        xs, ys = [p[0] for p in pts], [p[1] * scale for p in pts]
        ys_all += ys
        marker = dict(color=color, symbol=SYMBOLS[i % len(SYMBOLS)], size=max(6, 14 - 3 * i),
                      line=dict(color="white", width=1))
        if v.yes_no:  # markers side by side in each category (scattermode group), never a line through 0.5
            fig.add_scatter(x=[str(x) for x in xs], y=ys, name=name, mode="markers", marker={**marker, "size": 12})
        elif v.numeric_x:
            fig.add_scatter(x=xs, y=ys, name=name, mode="lines+markers", marker=marker,
                            line=dict(color=color, dash=DASHES[i % len(DASHES)]))
        else:
            fig.add_bar(x=[str(x) for x in xs], y=ys, name=name, marker_color=color)
    head, _, held = v.title().partition("<br>")
    below = wrap("; ".join(x for x in (held, source) if x), SUB_CHARS)
    title = wrap(head, TITLE_CHARS) + (f"<br><sup>{below}</sup>" if below else "")
    lines = title.count("<br>") + 1
    fig.update_layout(title=dict(text=title, font_size=14), xaxis_title=v.titles.get("x", v.x),
                      yaxis_title=v.titles.get("y", v.y), height=340 + 20 * lines, margin=dict(t=40 + 20 * lines),
                      barmode="group", legend_title_text=v.titles.get("color", ""))
    fig.update_yaxes(range=view.value_range(ys_all, v.yes_no))
    if v.yes_no:
        fig.update_yaxes(tickvals=[0, 1], ticktext=["no", "yes"])
        fig.update_layout(scattermode="group")
    if v.absent:
        fig.add_annotation(text="no points here: pick another value or another file under 'rows'", showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.5, font_size=14)
    ticks = sorted({p[0] for pts in v.series.values() for p in pts}) if v.numeric_x else []
    if v.yes_no or not v.numeric_x:
        fig.update_xaxes(type="category")
    elif v.log_x or len(ticks) <= MAX_TICKS:  # the values swept, as written (32768, not 32.768k; no 2.5 samples)
        fig.update_xaxes(type="log" if v.log_x else "linear", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])
    return fig


def _labelled(sweep: Study, names) -> list[tuple[str, str]]:
    return [(f"{view.column(sweep, n).label} [{n}]", n) for n in names]


def sweep_panel(name_or_path: str | Path, live: Mapping[str, Sequence] | None = None) -> Panel:
    """Source (a sweep file or the live grid), y column, x and colour parameters, and a value for every other
    parameter the rows vary -> the rows as :func:`sweep_figure` draws them.

    Args:
        name_or_path: a sweep's name (its files: ``data/results/sweeps`` first, then ``results/sweeps``) or one
            sweep file (``.json``, ``.csv``, or a running sweep's ``.jsonl``), shown first.
        live: a grid (name -> values; other parameters take their sweep range) computed in this kernel when
            chosen as the source, for a sweep with no file yet or one you are changing.
    """
    sweep, sources = sources_for(name_or_path, live)
    loaded: dict[str, list[dict]] = {}

    def rows(source: str) -> list[dict]:
        if source not in loaded:
            loaded[source] = (view.live_rows(sweep, live) if source == LIVE else store.load(source).rows)
        return loaded[source]

    planned = runner.plan(sweep, live)[1] if live is not None else []  # the live grid's points: nothing run yet
    files = [r for s in sources if s != LIVE for r in rows(s)]
    varying = view.varying(files + planned, sweep)  # what any source varies: the controls' options
    columns = view.numeric_columns(files, sweep) if files else list(sweep.y)
    axes = list(varying) or [p.name for p in sweep.params]
    # the first plot is the first source's alone: a file in the git-ignored folder may add options, not change it
    shown = next(iter(sources))
    mine = view.varying(planned if shown == LIVE else rows(shown), sweep)
    x0 = sweep.x if sweep.x in mine else next(iter(mine), sweep.x if sweep.x in axes else axes[0])
    c0 = sweep.color if sweep.color in mine and sweep.color != x0 else view.NO_COLOR
    # one varying parameter is always on x: no colour to choose and nothing to hold (a control that changes nothing)
    held = varying if len(varying) > 1 else {}
    controls = {
        # wide: its labels name the file, the points, the GPU and the commit
        "source": W.Dropdown(options=[(label, value) for value, label in sources.items()], description="rows",
                             layout=W.Layout(width="560px")),
        # labelled as the axes are (the sweep's column table), the column name kept in brackets for code
        "y": W.Dropdown(options=_labelled(sweep, columns), value=sweep.y[0] if sweep.y[0] in columns else columns[0],
                        description="y", layout=W.Layout(width="460px")),
        "x": W.Dropdown(options=_labelled(sweep, axes), value=x0, description="x", layout=W.Layout(width="340px")),
        "color": W.Dropdown(options=[(view.NO_COLOR, view.NO_COLOR), *_labelled(sweep, held)], value=c0,
                            description="colour", layout=W.Layout(width="340px")),
    }
    defaults = sweep.defaults()
    for name, values in held.items():
        controls[f"at_{name}"] = W.Dropdown(options=values, value=defaults[name] if defaults[name] in values
                                            else values[0], description=view.column(sweep, name).label)

    def compute(source, y, x, color, **held):
        r = rows(source)
        if color == x:
            color = view.NO_COLOR
        v = view.select(r, sweep, x=x, y=y, color=color, held={k[3:]: val for k, val in held.items()})
        return v, sources[source]

    def free(name: str):  # a held parameter's control matters unless it is on an axis
        return lambda x, color, **_: name not in (x, color)

    enabled = {f"at_{name}": free(name) for name in held}
    return Panel(controls, compute, lambda r: sweep_figure(*r), enabled=enabled)
