"""Plotly figures of notebook 09 (bring your own kernel), built from a conformance report's rows
(``workbench.conformance.Report.rows()``) and the committed bandwidth runs (``workbench.results.byok``).

- :func:`error_figure`: the error of every case against its tolerance, cases grouped by one axis of the suite;
- :func:`failures_table`: the failing cases, why each failed (a plotly Table; :func:`failure_rows` gives the rows);
- :func:`conformance_figure`: the two on one page (what the notebook's conformance panel shows);
- :func:`bandwidth_figure`: per workload W1-W5, each implementation's fraction of the copy bandwidth, ours and the
  peers beside it; implementations without a bar (absent peers, failed checks) are named, never drawn as zeros.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.conformance.suite_formats import SUITE_FORMATS

PASS, FAIL, TOL = "#2a9d8f", "#d62828", "#555555"
#: the axes a report's cases can be grouped by: row key -> words
AXES = {"kv_format": "format", "block_size": "block size", "layout": "layout", "head_dim": "head dim",
        "group": "query heads per kv head", "num_kv_heads": "kv heads", "lens": "context lengths",
        "pad": "block-stride padding"}
_SHORT = {"block_size": "bs ", "head_dim": "d ", "group": "g ", "num_kv_heads": "hkv ", "pad": "pad "}
IMPL_COLORS = {"ours": "#2a9d8f", "mine": "#7b2cbf", "starter": "#f4a261", "sdpa_contiguous": "#264653",
               "gather_sdpa": "#e76f51", "flex_paged": "#e9c46a", "flashinfer": "#457b9d", "vllm_triton": "#90be6d"}
_SPARE = ("#b5838d", "#6d597a", "#8ab17d", "#577590", "#f9844a", "#43aa8b")
TIMING_WORDS = {"eager": "eager launches", "graph": "CUDA-graph replays"}
NO_FINITE = "no finite error"
PLOT_PX, CHAR_PX = 760, 6.5  # the plot's width in the lab at 1280 px, and a tick character's at 10-11 px


def impl_color(impl: str) -> str:
    """A fixed colour per implementation (ours teal, yours purple, the starter orange; others from a palette)."""
    return IMPL_COLORS.get(impl) or _SPARE[sum(map(ord, impl)) % len(_SPARE)]


def value_label(key: str, value) -> str:
    """How one value of an axis reads on the figure: ``bs 16``, ``fp8_e4m3/head``, ``lens 37,0,1,150``."""
    if key == "lens":
        return "lens " + ",".join(map(str, value))
    if key == "kv_format":
        return str(value).replace("/", "<br>/")  # fp8_e4m3<br>/head: eight formats side by side stay level
    return f"{_SHORT.get(key, '')}{value}"


def _order(key: str, values: list) -> list:
    """The values of an axis in a reading order: formats as the suite lists them, numbers ascending, the rest as
    they come."""
    uniq = list(dict.fromkeys(tuple(v) if isinstance(v, list) else v for v in values))
    if key == "kv_format":
        rank = {f: i for i, f in enumerate(SUITE_FORMATS)}
        return sorted(uniq, key=lambda v: rank.get(v, len(rank)))
    if key == "layout":
        rank = {"nhd": 0, "hnd": 1, "vllm": 2}
        return sorted(uniq, key=lambda v: rank.get(v, 3))
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in uniq):
        return sorted(uniq)
    return uniq


def _key(row: Mapping, key: str):
    if key not in AXES:
        raise ValueError(f"color_by must be one of {list(AXES)}, got {key!r}")
    v = row[key]
    return tuple(v) if isinstance(v, list) else v


def _crowded(groups: Mapping, key: str) -> bool:
    """Whether some group along x is narrower than its tick's label (a group is as wide as its cases, plus one)."""
    slots = sum(n + 1 for _, n in groups.values())
    return any((n + 1) * PLOT_PX / slots < CHAR_PX * max(map(len, value_label(key, v).split("<br>")), default=0)
               for v, (_, n) in groups.items())


def _finite(err) -> bool:
    return err is not None and math.isfinite(err)


def failure_counts(rows: Sequence[Mapping], key: str) -> dict:
    """``{value: (failed, cases)}`` along one axis, values in reading order."""
    out = {v: [0, 0] for v in _order(key, [_key(r, key) for r in rows])}
    for r in rows:
        c = out[_key(r, key)]
        c[0] += not r["passed"]
        c[1] += 1
    return {v: tuple(c) for v, c in out.items()}


def caught_summary(reports: Mapping, axes: Sequence[str]) -> str:
    """Three lines per report (``{name: Report}``, one axis of :data:`AXES` each, in order): how many cases
    failed, and where along its axis (``value failed/cases``); the first failing case; why it failed."""
    axes = list(axes)
    if len(axes) != len(reports):
        raise ValueError(f"axes must give one axis per report: {len(reports)} reports, {len(axes)} axes")
    lines = []
    for (name, r), axis in zip(reports.items(), axes, strict=True):
        if axis not in AXES:
            raise ValueError(f"axes: {axis!r} is not one of {list(AXES)}")
        counts = failure_counts(r.rows(), axis)
        lines.append(f"{name}: {len(r.failures)} of {len(r.results)} cases failed; by {AXES[axis]}: "
                     + ", ".join(f"{value_label(axis, v)} {bad}/{n}" for v, (bad, n) in counts.items()))
        first = r.first_failure
        lines += ([f"  first caught by {first.case.id}", f"  why: {first.reason}"] if first else
                  ["  no case caught it"])
    return "\n".join(lines)


def _wrap(text: str, width: int = 90) -> str:
    return "<br>".join(textwrap.wrap(text, width)) if text else ""


def _hover(r: Mapping) -> str:
    err = ("0 (exact)" if r["error"] == 0 else f"{r['error']:.2e}") if _finite(r["error"]) else (
        "inf" if r["error"] is not None else "none (it raised)")
    head = f"<b>{r['case']}</b><br>error {err}, tolerance {r['tol']:.0e}: {'passed' if r['passed'] else 'FAILED'}"
    return head + (f"<br>{_wrap(r['reason'])}" if r["reason"] else "")


def error_figure(rows: Sequence[Mapping], color_by: str = "kv_format", title: str = "",
                 fig: go.Figure | None = None, row: int | None = None) -> go.Figure:
    """Every case's error (log scale) beside its tolerance (a grey dash), green where it passed and red where it
    failed; cases grouped along x by ``color_by`` (one of :data:`AXES`), each group's tick saying how many failed.
    A case with no finite error (a NaN in the output, or it raised) sits on a line at the top, one with an error of
    exactly 0 (a single token: the output is its value) at the bottom. Hover: the case id, its error and why it
    failed.

    ``fig`` / ``row``: draw into that subplot row of an existing figure (``conformance_figure``)."""
    own = fig is None
    fig = go.Figure() if own else fig
    at = {} if own else {"row": row, "col": 1}
    groups = failure_counts(rows, color_by)
    xs, tick_x, tick_text, edges, pos = {}, [], [], [], 0.0
    many = _crowded(groups, color_by)
    for value, (bad, n) in groups.items():
        members = [i for i, r in enumerate(rows) if _key(r, color_by) == value]
        for j, i in enumerate(members):
            xs[i] = pos + j
        tick_x.append(pos + (len(members) - 1) / 2)
        if many:  # one slanted line each (shared_prefix's context lengths, a full level's): no overlap
            tick_text.append(f"{value_label(color_by, value).removeprefix('lens ')}: "
                             + (f"{bad}/{n} failed" if bad else f"{n} ok"))
        else:
            tick_text.append(f"{value_label(color_by, value)}<br>{bad}/{n} failed" if bad else
                             f"{value_label(color_by, value)}<br>{n} passed")
        pos += len(members) + 1
        edges.append(pos - 1)
    finite = [r["error"] for r in rows if _finite(r["error"])]
    positive = [e for e in finite if e > 0] + [r["tol"] for r in rows if r["tol"] > 0]
    floor = min(positive, default=1e-6) / 10
    ceil = 10 ** math.ceil(math.log10(max(max(finite, default=1.0), max((r["tol"] for r in rows), default=1.0),
                                          1.0) * 10))
    if not positive:  # every error and tolerance 0 (an exact op): a short axis over the floor
        ceil = floor * 100
    order = list(range(len(rows)))
    # a tolerance of 0 (the write and copy ops: exact) sits on the floor, with the errors of exactly 0
    fig.add_scatter(x=[xs[i] for i in order], y=[rows[i]["tol"] if rows[i]["tol"] > 0 else floor for i in order],
                    mode="markers", name="tolerance", marker=dict(symbol="line-ew-open", size=18, color=TOL,
                                                                  line=dict(width=2)),
                    hovertext=[f"tolerance {rows[i]['tol']:.0e}" if rows[i]["tol"] > 0 else "tolerance 0 (exact)"
                               for i in order], hoverinfo="text", **at)
    kinds = [("passed", lambda r: r["passed"], dict(symbol="circle", size=10, color=PASS)),
             ("failed: over tolerance", lambda r: not r["passed"] and _finite(r["error"]),
              dict(symbol="diamond", size=11, color=FAIL)),
             (f"failed: {NO_FINITE} (NaN / inf output, or it raised)", lambda r: not r["passed"] and
              not _finite(r["error"]), dict(symbol="x", size=12, color=FAIL))]
    for name, keep, marker in kinds:
        sel = [i for i in order if keep(rows[i])]
        if not sel:
            continue
        ys = [min(max(rows[i]["error"], floor), ceil) if _finite(rows[i]["error"]) else ceil for i in sel]
        fig.add_scatter(x=[xs[i] for i in sel], y=ys, mode="markers", name=name, marker=marker,
                        hovertext=[_hover(rows[i]) for i in sel], hoverinfo="text", **at)
    for e in edges[:-1]:
        fig.add_vline(x=e, line=dict(color="#cccccc", width=1, dash="dot"), **at)
    if any(not _finite(r["error"]) for r in rows):
        fig.add_hline(y=ceil, line=dict(color=FAIL, width=1, dash="dash"), **at)  # the legend says what it is
    fig.update_xaxes(tickvals=tick_x, ticktext=tick_text, range=[-1, max(pos - 1, 1)], showgrid=False,
                     tickangle=-40 if many else 0, automargin=many,
                     tickfont_size=11 if len(groups) <= 5 else 10,
                     title_text=f"cases, grouped by {AXES[color_by]}", zeroline=False, **at)
    if not positive:  # an exact op (write, copy: tolerance 0) where every error is 0: the floor is all there is
        fig.update_yaxes(tickvals=[floor], ticktext=["0 (exact)"], **at)
    fig.update_yaxes(type="log", range=[math.log10(floor) - 0.4, math.log10(ceil) + 0.35], exponentformat="power",
                     title_text="relative error vs float64 reference" if positive else
                     "error (tolerance 0: exact)", **at)
    if own:
        fig.update_layout(height=460, margin=dict(t=90, r=10, b=60), title=title, title_font_size=14,
                          legend=dict(orientation="h", x=0, y=1.02, yanchor="bottom", font_size=11))
    return fig


def failure_rows(rows: Sequence[Mapping], limit: int = 8) -> list[dict]:
    """The first ``limit`` failing cases as ``{"case", "error", "tol", "reason"}`` (formatted text), then one row
    saying how many more failed (if any)."""
    bad = [r for r in rows if not r["passed"]]
    out = [{"case": r["case"], "error": f"{r['error']:.2e}" if r["error"] is not None else "raised",
            "tol": f"{r['tol']:.0e}", "reason": r["reason"]} for r in bad[:limit]]
    if len(bad) > limit:
        out.append({"case": f"... and {len(bad) - limit} more", "error": "", "tol": "", "reason": ""})
    return out


def _break_id(case: str, width: int = 40) -> str:
    """A case id broken at its slashes so a table column holds it (``<br>`` between the pieces)."""
    lines, cur = [], ""
    for part in case.split("/"):
        piece = part if not cur else f"{cur}/{part}"
        if len(piece) > width and cur:
            lines.append(cur + "/")
            cur = part
        else:
            cur = piece
    return "<br>".join([*lines, cur])


REASON_CHARS = 52  # characters of a reason per table line in a figure ~850 px wide (the lab's output at 1280 px)


def _table_px(rows: Sequence[Mapping]) -> int:
    """The height the failures table takes at ~850 px (wider: a little room to spare): header plus each row's
    lines, a row as tall as its longer cell."""
    lines = [max(_break_id(r["case"]).count("<br>") + 1, math.ceil(len(r["reason"]) / REASON_CHARS), 1) for r in rows]
    return 40 + sum(12 + 16 * n for n in lines)


def failures_table(rows: Sequence[Mapping], limit: int = 8) -> go.Table:
    """The failing cases as a plotly Table trace (:func:`failure_rows`): case id, error, tolerance, why."""
    fr = failure_rows(rows, limit)
    return go.Table(columnwidth=[0.36, 0.08, 0.06, 0.5],
                    header=dict(values=["<b>case</b>", "<b>error</b>", "<b>tol</b>", "<b>why it failed</b>"],
                                fill_color="#eeeeee", align="left", font=dict(size=12)),
                    cells=dict(values=[[_break_id(r["case"]) for r in fr], [r["error"] for r in fr],
                                       [r["tol"] for r in fr], [r["reason"] for r in fr]],
                               align="left", font=dict(size=11, family="monospace"), height=22,
                               fill_color="white", line_color="#dddddd"))


def conformance_figure(rows: Sequence[Mapping], color_by: str = "kv_format", title: str = "",
                       limit: int = 8) -> go.Figure:
    """The report on one page: :func:`error_figure` above, :func:`failures_table` below (when a case failed)."""
    bad = sum(not r["passed"] for r in rows)
    if not bad:
        fig = error_figure(rows, color_by, title)
        fig.add_annotation(text=f"all {len(rows)} cases passed", xref="paper", yref="paper", x=1, y=1.0,
                           xanchor="right", yanchor="bottom", showarrow=False, font=dict(color=PASS, size=13))
        return fig
    table_px = _table_px(failure_rows(rows, limit))
    plot_px = 380
    gap = 110 + 70 * _crowded(failure_counts(rows, color_by), color_by)  # slanted ticks take more room
    fig = make_subplots(rows=2, cols=1, specs=[[{"type": "xy"}], [{"type": "table"}]],
                        row_heights=[plot_px, table_px], vertical_spacing=gap / (plot_px + table_px + gap),
                        subplot_titles=("", f"failures ({bad} of {len(rows)}"
                                        + (f"; the first {limit} shown)" if bad > limit else ")")))
    error_figure(rows, color_by, fig=fig, row=1)
    fig.add_trace(failures_table(rows, limit), row=2, col=1)
    fig.update_layout(height=plot_px + table_px + gap + 90, margin=dict(t=90, r=10, b=20), title=title,
                      title_font_size=14, legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", font_size=11))
    return fig


BUILT_IN = ("ours", "reference", "starter")  # registered in every process: a shell knows them without --load


def first_failure(rows: Sequence[Mapping]) -> Mapping | None:
    """The first failing row (``Report.first_failure`` of a report's rows), None when every case passed."""
    return next((r for r in rows if not r["passed"]), None)


def replay_lines(impl: str, row: Mapping, measured: str = "") -> list[str]:
    """How to run one case again (the first failure): in Python, and from a shell. ``measured``: where a committed
    report's failure was measured (``NVIDIA H200 (compiled), commit 05219e8, 2026-12-02``): the commands replay it
    on this machine."""
    where = [f"measured on    {measured}: the commands below replay it on this machine"] if measured else []
    op = row["case"].split("/", 1)[0]
    op = "" if op == "decode" else f" --op {op}"  # the shell's default op
    return [f"first failure  {row['case']}", f"why            {row['reason']}", *where,
            f"in Python      conformance.replay({impl!r}, {row['case']!r})",
            f"from a shell   python -m workbench check {impl}{op} --case '{row['case']}'"
            + ("   (add --load FILE.py: a file that registers it)" if impl not in BUILT_IN else "")]


def verdict(rows: Sequence[Mapping]) -> str:
    """``every case passed`` or ``3 of 12 cases failed``."""
    bad = sum(not r["passed"] for r in rows)
    return "every case passed" if not bad else f"{bad} of {len(rows)} cases failed"


def committed_title(report: Mapping, provenance: str) -> str:
    """The conformance figure's title for a committed report (a :func:`workbench.results.byok.check_reports`
    entry): what it checked, where and when, and that the panel's implementation and level do not apply."""
    level = report["level"] + (f" ({report['tag']})" if report["tag"] else "")
    seconds = f" in {report['seconds']:.1f} s" if report.get("seconds") is not None else ""
    return (f"{report['impl']} {report['op']}, {level} cases on the GPU: {verdict(report['rows'])}"
            f"<br><sup>committed report: {provenance}, checked{seconds}; implementation and cases are the "
            f"report's</sup>")


def _reason(why: str) -> str:
    """An error's class (``ModuleNotFoundError``), or the whole text when it has none."""
    head = why.split(":", 1)[0]
    return head if head and " " not in head else why[:60]


def _bar_hover(b: Mapping) -> str:
    gbps = f", {b['gbps']:.0f} GB/s" if b.get("gbps") else ""
    err = f", rel err {b['rel_err']:.1e}" if b.get("rel_err") is not None else ""
    return f"{b['impl']} ({b['origin']}): {b['frac']:.3f} of copy, {b['time_us']:.1f} µs{gbps}{err}"


def bandwidth_figure(bw, workload: str, title: str) -> go.Figure:
    """Left: every workload's bars, one per implementation, as a fraction of the copy bandwidth measured in the
    same run (the line at 1), ``workload`` framed; right: that workload's implementations, best first, with their
    times. Implementations without a bar are named under the plots: absent peers, failed checks, missing timings.

    Args:
        bw: a :class:`workbench.results.byok.Bandwidth`.
        workload: the key (``W1``) shown on the right.
        title: the first lines of the title (then the timing, the copy bandwidth and the absent peers).
    """
    keys = list(bw.workloads)
    if workload not in keys:
        raise ValueError(f"workload must be one of {keys}, got {workload!r}")
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.14,
                        subplot_titles=("every workload (fraction of the copy bandwidth)",
                                        f"{workload} {bw.workloads[workload]}"))
    ticks = [f"{k}<br>{bw.workloads[k]}" for k in keys]
    for impl in bw.impls:
        bars = {b["workload"]: b for b in bw.bars if b["impl"] == impl}
        xs = [k for k in keys if k in bars]
        fig.add_bar(x=[ticks[keys.index(k)] for k in xs], y=[bars[k]["frac"] for k in xs], name=impl,
                    legendgroup=impl, marker_color=impl_color(impl),
                    hovertext=[f"{impl} ({bw.origin[impl]}) on {k}: {bars[k]['frac']:.3f} of copy, "
                               f"{bars[k]['time_us']:.1f} µs" for k in xs], hoverinfo="text", row=1, col=1)
    i = keys.index(workload)
    fig.add_vrect(x0=i - 0.5, x1=i + 0.5, fillcolor="#264653", opacity=0.07, line_width=0, layer="below",
                  row=1, col=1)
    fig.add_hline(y=1.0, line=dict(color="#555555", width=1, dash="dash"), layer="below", row=1, col=1)
    top = max([b["frac"] for b in bw.bars] + [1.0])
    copy = f"{bw.copy_gbps:.0f} GB/s" if bw.copy_gbps else "copy"
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=ticks, tickfont_size=10, row=1, col=1)
    fig.update_yaxes(title_text=f"fraction of the copy bandwidth ({copy})", range=[0, top * 1.12], row=1, col=1)
    here = sorted((b for b in bw.bars if b["workload"] == workload), key=lambda b: b["frac"])
    fig.add_bar(y=[b["impl"] for b in here], x=[b["frac"] for b in here], orientation="h", showlegend=False,
                marker_color=[impl_color(b["impl"]) for b in here],
                text=[f"{b['frac']:.2f} · {b['time_us']:.0f} µs" for b in here], textposition="outside",
                cliponaxis=False, hovertext=[_bar_hover(b) for b in here], hoverinfo="text", row=1, col=2)
    fig.add_vline(x=1.0, line=dict(color="#555555", width=1, dash="dash"), layer="below", row=1, col=2)
    fig.update_xaxes(title_text="fraction of the copy bandwidth", range=[0, top * 2.0], row=1, col=2)
    fig.update_yaxes(type="category", tickfont_size=11, row=1, col=2)
    missing = [f"{impl} ({status.replace('_', ' ')})" for impl, w, status, _ in bw.failed if w == workload]
    missing += [f"{impl} (no time)" for impl, w in bw.untimed if w == workload]
    missing += [f"{p} (absent)" for p in bw.absent]
    if missing:
        fig.add_annotation(text="no bar: " + ", ".join(missing), xref="x2 domain", yref="y2 domain", x=1, y=-0.3,
                           xanchor="right", yanchor="top", showarrow=False, font=dict(size=11, color="#8a1c1c"))
    notes = []
    failed = [f"{impl} on {w} ({status}: {_wrap(why, 60).split('<br>')[0]})" for impl, w, status, why in bw.failed]
    if failed:
        notes.append("no bar, failed the run's check or raised: " + "; ".join(failed))
    if bw.untimed:
        notes.append(f"no {TIMING_WORDS[bw.timing]} time: " + ", ".join(f"{i} on {w}" for i, w in bw.untimed))
    by_reason: dict[str, list[str]] = {}
    for p, why in bw.absent.items():
        by_reason.setdefault(_reason(why), []).append(p)
    absent = "; ".join(f"{', '.join(ps)} ({why})" for why, ps in by_reason.items())
    sub = [f"{TIMING_WORDS[bw.timing]}; dashed line: the copy bandwidth of the same run ({copy})"]
    if absent:
        sub.append(f"absent peers (not installed where it ran): {absent}")
    head, _, rest = title.partition("<br>")  # a second line of the caller's (the run) shares the first sub line
    if rest:
        sub[0] = f"{rest.removeprefix('<sup>').removesuffix('</sup>')} · {sub[0]}"
    fig.update_layout(
        barmode="group", height=500 + 18 * len(notes), title_font_size=14,
        margin=dict(t=64 + 17 * len(sub), r=20, b=80 + 18 * len(notes)),
        title=dict(text=f"{head}<br><sup>{'<br>'.join(sub)}</sup>", y=1, yref="container", yanchor="top",
                   pad=dict(t=14)),
        legend=dict(orientation="h", x=0, y=-0.16, yanchor="top", font_size=11))
    for k, note in enumerate(notes):
        fig.add_annotation(text=note, xref="paper", yref="paper", x=0, y=-0.26 - 0.05 * k, xanchor="left",
                           yanchor="top", showarrow=False, font=dict(size=11, color="#8a1c1c"), align="left")
    return fig
