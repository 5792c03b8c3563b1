"""The panels of notebook 09: a conformance report of any registered decode implementation (checked here, or one
of the GPU session's committed reports), and the committed bandwidth runs of ``bench decode --impl`` beside ours
and the peers.

Like ``workbench.ui.panels``, they hold no logic: ``workbench.conformance`` runs the cases and judges them (the
``conformance`` study's check, ``workbench.studies.conformance``, whose level and figure the panel takes),
``workbench.results.byok`` reads the committed runs, ``conformance_figures`` draws.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

import ipywidgets as W

import workbench
from workbench import conformance
from workbench.conformance.suite import check_quietly  # the panel's checks (the sweep conformance's too)
from workbench.figures import conformance as cf
from workbench.results import byok as measured
from workbench.studies.conformance import CONFORMANCE
from workbench.ui.controls import controls_for
from workbench.ui.panels import Panel

LEVELS = ("smoke", "pairwise")  # what a CPU runs in a panel (``full`` is several hundred cases: for a GPU)
COLOR_BY = [("format", "kv_format"), ("block size", "block_size"), ("layout", "layout"), ("head dim", "head_dim"),
            ("GQA group", "group"), ("lengths", "lens"), ("padding", "pad")]
HERE = "here"  # the source "this machine": checks run in this process (else a committed report's file name)
_ORDER = ("user", "example", "ours", "reference", "peer")  # the panel's dropdown: yours first, then the starter, ours


def decode_choices() -> list[str]:
    """The registered decode implementations: ``mine`` first, then the other users', the starter, ours, the
    reference and the peers."""
    rank = {o: i for i, o in enumerate(_ORDER)}
    impls = conformance.available("decode")
    return [i.name for i in sorted(impls, key=lambda i: (rank[i.origin], i.name != "mine", i.name))]


class ReportCache:
    """Reports by (implementation, level), each kept with the :class:`~workbench.conformance.Impl` it checked: a
    name registered again (an edited kernel) is checked again, anything else is answered at once."""

    def __init__(self, reports: Mapping[str, conformance.Report] | None = None, level: str = "smoke"):
        self._reports: dict[tuple[str, str], tuple[conformance.Impl, conformance.Report]] = {}
        self.runs = 0  # checks this cache ran (the rest came from it)
        for name, report in (reports or {}).items():
            self._reports[(name, level)] = (conformance.get(name, "decode"), report)

    def cached(self, name: str, level: str) -> bool:
        hit = self._reports.get((name, level))
        return hit is not None and hit[0] is conformance.get(name, "decode")

    def get(self, name: str, level: str) -> conformance.Report:
        if not self.cached(name, level):
            self._reports[(name, level)] = (conformance.get(name, "decode"), check_quietly(name, level))
            self.runs += 1
        return self._reports[(name, level)][1]


def replay_html(impl: str, rows: Sequence[dict] | conformance.Report, measured: str = "") -> str:
    """The first failure's replay commands as a block of text to copy (or a line saying every case passed).
    ``measured``: where a committed report was measured (:func:`workbench.results.byok.provenance`)."""
    rows = rows.rows() if isinstance(rows, conformance.Report) else rows
    f = cf.first_failure(rows)
    if f is None:
        where = f" on {measured}" if measured else ""
        return (f"<div style='color:{cf.PASS};padding:2px 6px'>{html.escape(impl)}: all {len(rows)} "
                f"cases passed{html.escape(where)}: nothing to replay.</div>")
    text = "\n".join(cf.replay_lines(impl, f, measured))
    return ("<pre style='margin:4px 0;padding:6px 8px;background:#f6f6f6;border-left:3px solid #d62828;"
            f"font-size:12px;white-space:pre-wrap'>{html.escape(text)}</pre>")


def source_choices(committed: Sequence[dict]) -> list[tuple[str, str]]:
    """The panel's sources: this machine (checks run here), then each committed GPU report (shown as it is)."""
    here = "Triton interpreter" if workbench.is_interpreted() else str(workbench.device())
    return [(f"this machine ({here})", HERE), *measured.report_choices(committed)]


def conformance_panel(impls: Sequence[str] | None = None, reports: Mapping[str, conformance.Report] | None = None,
                      impl: str | None = None, level: str = "smoke", color_by: str = "kv_format",
                      committed: Sequence[dict] | None = None, source: str = HERE) -> Panel:
    """Source, implementation, level and grouping -> every case's error against its tolerance, the failures and
    how to replay the first.

    Args:
        impls: the dropdown's implementations (default :func:`decode_choices`: every registered decode one).
        reports: ``{name: report}`` already run at ``level`` (the notebook's own checks), so showing them costs
            nothing; any other (implementation, level) is checked when first chosen and kept.
        impl: the implementation shown first (default the first of ``impls``).
        level: ``smoke`` (about a dozen cases) or ``pairwise`` (every pair of axis values; about three times more).
        color_by: the axis the cases are grouped by (a key of :data:`workbench.figures.conformance.AXES`).
        committed: the committed GPU reports the source can show (default
            :func:`workbench.results.byok.check_reports`); one is shown as measured, nothing runs, and the
            implementation and level are greyed out (they are the report's, named in the title).
        source: :data:`HERE` (checks run on this machine) or a committed report's file name.
    """
    names = list(decode_choices() if impls is None else impls)
    if not names:
        raise ValueError("no decode implementation is registered")
    committed = list(measured.check_reports() if committed is None else committed)
    cache = ReportCache(reports, level)
    replay = W.HTML()
    holder: dict = {}

    # the level is the conformance study's (what a CPU runs of it); the other controls are the panel's own
    level_control = controls_for(CONFORMANCE, {"level": level}, options={"level": LEVELS})["level"]
    controls = {
        "source": W.Dropdown(options=source_choices(committed), value=source, description="source",
                             layout=W.Layout(width="460px")),
        "impl": W.Dropdown(options=names, value=impl or names[0], description="implementation"),
        "level": level_control,
        "color_by": W.Dropdown(options=COLOR_BY, value=color_by, description="group by"),
    }

    def compute(source, impl, level, color_by):
        if source != HERE:  # a committed report: shown as it was measured, nothing runs
            r = measured.find_report(committed, source)
            where = measured.provenance(r)
            return {"rows": r["rows"], "color_by": color_by, "impl": r["impl"], "measured": where,
                    "title": cf.committed_title(r, where)}
        panel = holder.get("panel")
        if panel is not None and not cache.cached(impl, level):  # the check runs in this call: say so meanwhile
            n = len(conformance.cases_for(conformance.get(impl, "decode"), level))
            panel.status.value = f"<i style='color:#555'>checking {html.escape(impl)} on {n} {level} cases...</i>"
        report = cache.get(impl, level)
        claims = conformance.get(impl, "decode").claims()
        rows = report.rows()
        return {"rows": rows, "color_by": color_by, "impl": impl, "measured": "",
                "title": f"{impl}, {level} cases: {cf.verdict(rows)}"
                         f"<br><sup>{report.backend}, checked in {report.seconds:.1f} s; claims {claims}</sup>"}

    def draw(r):
        fig = CONFORMANCE.draw(r)
        replay.value = replay_html(r["impl"], r["rows"], r["measured"])
        return fig

    here = {"impl": lambda source, **_: source == HERE, "level": lambda source, **_: source == HERE}
    panel = Panel(controls, compute, draw, enabled=here)
    holder["panel"] = panel
    panel.cache = cache
    panel.replay = replay
    panel.widget.children = (*panel.widget.children, replay)
    return panel


def bandwidth_panel(runs: Sequence[dict] | None = None, workload: str = "W1", timing: str = "graph") -> Panel:
    """Workload, timing and run -> each implementation's fraction of the copy bandwidth on W1-W5, the chosen
    workload's times; absent peers and failed checks named.

    Args:
        runs: loaded ``bench decode --impl`` runs (default :func:`workbench.results.byok.runs`: the committed
            ones). ValueError when there is none (:data:`workbench.results.byok.NO_RUNS` says how to make one).
        workload: the workload shown first on the right.
        timing: ``graph`` (CUDA-graph replays) or ``eager``.
    """
    runs = list(measured.runs() if runs is None else runs)
    if not runs:
        raise ValueError(measured.NO_RUNS)
    names = [measured.run_name(r) for r in runs]
    loads = measured.workloads(runs[-1])
    controls = {
        "workload": W.Dropdown(options=[(f"{k} {v}", k) for k, v in loads.items()],
                               value=workload if workload in loads else next(iter(loads)), description="workload"),
        "timing": W.ToggleButtons(options=[("CUDA graph", "graph"), ("eager", "eager")], value=timing,
                                  description="timing"),
        "run": W.Dropdown(options=names, value=names[-1], description="run", layout=W.Layout(width="420px")),
    }

    def compute(workload, timing, run):
        doc = runs[names.index(run)]
        bw = measured.bandwidth(doc, timing)
        if workload not in bw.workloads:
            workload = next(iter(bw.workloads))
        gpu = doc["info"].get("gpu", "?")
        return {"bw": bw, "workload": workload,
                "title": f"Decode bandwidth beside ours and the peers, {gpu}<br><sup>{run}</sup>"}

    return Panel(controls, compute, lambda r: cf.bandwidth_figure(r["bw"], r["workload"], r["title"]))
