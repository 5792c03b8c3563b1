"""The offline HTML report (workbench.publish.page) on notebooks built in memory: charts from plotly snapshots,
plotly.js inlined once, nothing fetched from a network, widgets gone; and the tour's per-cell progress lines."""

import json
import re

import nbformat
import plotly.graph_objects as go
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from workbench.publish.page import (
    PANEL_NOTE,
    PLOTLY_MIME,
    WIDGET_MIME,
    WIDGET_NOTE,
    CellProgress,
    executed_cells,
    offline_html,
    progress_line,
    static_notebook,
)

PLOTLY_JS_BANNER = "* plotly.js v"  # the licence comment at the top of plotly.min.js


def _snapshot(y) -> dict:
    return json.loads(go.Figure(go.Bar(x=["a", "b"], y=y)).to_json())


def _widget_view(model_id: str) -> dict:
    return {"version_major": 2, "version_minor": 0, "model_id": model_id}


def _notebook(figures: bool = True):
    """A markdown cell, a static figure, a panel (widget view + snapshot), a bare widget, a stream."""
    outputs = [new_output("stream", name="stdout", text="hello from a cell\n")]
    if figures:
        outputs += [
            new_output("display_data", data={PLOTLY_MIME: _snapshot([1, 2]), "text/plain": "Figure()"}),
            new_output("display_data", data={WIDGET_MIME: _widget_view("m1"), PLOTLY_MIME: _snapshot([3, 4]),
                                             "text/plain": "<interactive panel>"}),
        ]
    outputs.append(new_output("display_data", data={WIDGET_MIME: _widget_view("m2"), "text/plain": "VBox()"}))
    nb = new_notebook(cells=[new_markdown_cell("# A report\nsome *text*"),
                             new_code_cell("show()", outputs=outputs, execution_count=1)])
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"version_major": 2, "version_minor": 0,
                                                                            "state": {"m1": {}, "m2": {}}}}
    nbformat.validate(nb)
    return nb


@pytest.fixture(scope="module")
def page() -> str:
    return offline_html(_notebook(), title="a report")


def test_plotly_js_is_inlined_once_before_the_first_figure(page):
    assert page.count(PLOTLY_JS_BANNER) == 1
    assert page.index(PLOTLY_JS_BANNER) < page.index('id="figure-1"')


def test_each_figure_is_a_div_and_a_newplot_call(page):
    for div in ("figure-1", "figure-2"):
        assert re.search(rf'<div[^>]*\bid="{div}"', page), div
        assert re.search(rf'Plotly\.newPlot\(\s*"{div}"', page), div
    assert page.count("Plotly.newPlot(") == 2
    assert '"responsive": true' in page


def test_nothing_is_fetched_from_a_network(page):
    assert not re.search(r"<script[^>]*\bsrc\s*=", page)  # every script inline
    assert not re.search(r"<link[^>]*\bhref\s*=\s*[\"']?https?:", page)
    # plotly.js itself names URLs (map tiles, its CDN) that a bar chart never fetches: look outside it
    page_without_plotly = re.sub(r"<script type=\"text/javascript\">/\*\*\n\* plotly\.js.*?</script>", "", page,
                                 count=1, flags=re.S)
    for cdn in ("require.js", "require.min.js", "MathJax", "html-manager", "unpkg.com", "mermaid.esm", "cdn.plot.ly"):
        assert cdn not in page_without_plotly, cdn


def test_widgets_are_gone_and_a_bare_widget_becomes_a_note(page):
    assert WIDGET_MIME not in page and "widget-state+json" not in page
    assert page.count(WIDGET_NOTE) == 1  # the bare widget; the panel shows its figure instead
    assert page.count(PANEL_NOTE) == 1 and page.index(PANEL_NOTE) > page.index('id="figure-2"')


def test_text_and_markdown_are_kept(page):
    assert "hello from a cell" in page and "<em>text</em>" in page and "<title>a report</title>" in page


def test_a_sites_page_loads_plotly_js_from_the_file_beside_it():
    page = offline_html(_notebook(), plotly_src="plotly.min.js")  # workbench.publish.site writes the file once
    assert PLOTLY_JS_BANNER not in page
    scripts = re.findall(r"<script[^>]*\bsrc\s*=\s*\"([^\"]+)\"", page)
    assert scripts == ["plotly.min.js"] and page.index("plotly.min.js") < page.index('id="figure-1"')
    assert "src=" not in offline_html(_notebook(figures=False), plotly_src="plotly.min.js")


def test_a_notebook_without_figures_gets_no_plotly_js():
    page = offline_html(_notebook(figures=False))
    assert PLOTLY_JS_BANNER not in page and "Plotly.newPlot" not in page
    assert not re.search(r"<script[^>]*\bsrc\s*=", page)


def test_the_notebook_itself_is_left_unchanged():
    nb = _notebook()
    before = nbformat.writes(nb)
    copy, figures = static_notebook(nb)
    assert figures == 2 and nbformat.writes(nb) == before
    kinds = [sorted(o.get("data", {})) for o in copy.cells[1].outputs]
    assert kinds == [[], ["text/html", "text/plain"], ["text/html", "text/plain"], ["text/html", "text/plain"]]
    assert "widgets" not in copy.metadata


# ------------------------------------------------------------------------------------------------ tour progress
def test_progress_line():
    assert progress_line(3, 5, 7, 2.06) == "[3/5] cell 7 ... 2.1 s"
    assert progress_line(1, 1, 0, 0.0, failed=True) == "[1/1] cell 0 ... 0.0 s (error)"


def test_cell_progress_counts_only_the_cells_that_run():
    nb = new_notebook(cells=[new_markdown_cell("# t"), new_code_cell("x = 1"), new_code_cell("  \n"),
                             new_code_cell("y = 2")])
    assert executed_cells(nb) == [1, 3]
    lines, now = [], iter([0.0, 10.0, 12.5, 20.0, 20.25])
    progress = CellProgress(nb, write=lines.append, clock=lambda: next(now))
    hooks = progress.hooks()
    assert set(hooks) == {"on_cell_execute", "on_cell_executed"}
    hooks["on_cell_execute"](cell=nb.cells[1], cell_index=1)
    hooks["on_cell_executed"](cell=nb.cells[1], cell_index=1, execute_reply={"content": {"status": "ok"}})
    hooks["on_cell_execute"](cell=nb.cells[3], cell_index=3)
    hooks["on_cell_executed"](cell=nb.cells[3], cell_index=3, execute_reply={"content": {"status": "error"}})
    assert lines == ["[1/2] cell 1 ... 2.5 s", "[2/2] cell 3 ... 0.2 s (error)"]
