"""An executed notebook as one HTML page that shows its charts with no network: the tour's report.

nbconvert's lab template renders a widget from its saved state with scripts from a CDN (the widget
html-manager, through require.js) and loads MathJax from another, so a report opened offline showed no
chart. :func:`offline_html` instead renders each figure from its plotly snapshot
(``application/vnd.plotly.v1+json``, which workbench panels carry beside their widget view) as a plotly
div, inlines plotly.js once in the page head, and leaves out every script the template would fetch.

:class:`CellProgress` holds NotebookClient hooks that print one line per executed cell; :func:`local_kernel` starts
the kernels of ``tour`` and ``report`` on local sockets.

:mod:`workbench.publish.site` builds the notebook series' static site from these pages.

plotly, nbconvert, jinja2 and traitlets are imported in the functions that use them: the GPU image has no UI-side
libraries, and every module but the panels and figures imports without them (tests/test_packaging.py).
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import time
from collections.abc import Callable, Iterator

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = "interactive panel: run this notebook in JupyterLab to use it"
PANEL_NOTE = "a snapshot of an interactive panel: its controls work when the notebook runs in JupyterLab"
FIGURE_HEIGHT = 525  # px, plotly's notebook default, for figures whose layout sets no height

# The lab template without its network fetches: require.js (it would also make plotly.js register as an AMD
# module instead of setting window.Plotly), the widget html-manager (widget state is not saved), MathJax and
# mermaid (the notebooks have neither math nor diagrams). plotly.js comes inline (or from a file beside the page,
# a site's pages sharing one), before any figure.
TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}
{%- if resources.plotly_src -%}
<script type="text/javascript" src="{{ resources.plotly_src }}"></script>
{%- elif resources.plotly_js -%}
<script type="text/javascript">{{ resources.plotly_js }}</script>
{%- endif -%}
{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def figure_html(fig: dict, div_id: str) -> str:
    """One plotly snapshot as a div and its ``Plotly.newPlot`` call (plotly.js itself not included)."""
    import plotly.io as pio

    config = {**fig.get("config", {}), "responsive": True}
    body = {k: fig[k] for k in ("data", "layout", "frames") if k in fig}
    return pio.to_html(body, config=config, full_html=False, include_plotlyjs=False, div_id=div_id,
                       default_height=FIGURE_HEIGHT, validate=False)  # already plotly's own JSON


def static_notebook(nb):
    """A copy of ``nb`` with plotly snapshots as HTML and no widgets; returns ``(copy, figures)``.

    An output with a snapshot keeps only its HTML rendering (and text/plain): other renderings such as
    plotly's notebook HTML would need require.js. A panel's snapshot (one beside a widget view) gets a caption
    saying where its controls work; a widget without a snapshot becomes that one-line note alone.
    """
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)  # saved widget state would make the template load the html-manager
    figures = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data")
            if not data:
                continue
            plain = {"text/plain": data["text/plain"]} if "text/plain" in data else {}
            if PLOTLY_MIME in data:
                figures += 1
                html = figure_html(data[PLOTLY_MIME], f"figure-{figures}")
                if WIDGET_MIME in data:  # the text around a panel says "move the sliders": say where they are
                    html += f"<p><em>{PANEL_NOTE}</em></p>"
                output["data"] = {"text/html": html, **plain}
            elif WIDGET_MIME in data:
                output["data"] = {"text/html": f"<p><em>{WIDGET_NOTE}</em></p>", "text/plain": WIDGET_NOTE}
    return nb, figures


def offline_html(nb, title: str | None = None, plotly_src: str | None = None) -> str:
    """``nb`` (executed, left unchanged) as a self-contained HTML page; plotly.js inlined only if it has figures,
    or, with ``plotly_src``, loaded from that relative path (a file the caller writes beside the page)."""
    import plotly.offline
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    page, figures = static_notebook(nb)
    exporter = HTMLExporter(template_name="lab", template_file="offline.html.j2",
                            extra_loaders=[DictLoader({"offline.html.j2": TEMPLATE})])
    resources = {"plotly_js": plotly.offline.get_plotlyjs() if figures and not plotly_src else "",
                 "plotly_src": plotly_src if figures else ""}
    if title:
        resources["metadata"] = {"name": title}
    html, _ = exporter.from_notebook_node(page, resources=resources)
    return html


# ---------------------------------------------------------------------------------------------- progress
def executed_cells(nb) -> list[int]:
    """Indices of the cells nbclient runs: code cells with some source."""
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]


def progress_line(done: int, total: int, index: int, seconds: float, failed: bool = False) -> str:
    """``[3/5] cell 7 ... 2.1 s``: the 3rd of 5 code cells, cell 7 of the notebook, ran 2.1 s."""
    return f"[{done}/{total}] cell {index} ... {seconds:.1f} s" + (" (error)" if failed else "")


class CellProgress:
    """NotebookClient hooks printing a :func:`progress_line` as each code cell finishes:
    ``NotebookClient(nb, **CellProgress(nb).hooks())``."""

    def __init__(self, nb, write: Callable[[str], object] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.total = len(executed_cells(nb))
        self.done = 0
        self._write = write or (lambda line: print(line, flush=True))
        self._clock = clock
        self._start = clock()

    def started(self, **_hook_args) -> None:
        self._start = self._clock()

    def executed(self, cell_index: int, execute_reply: dict | None = None, **_hook_args) -> None:
        self.done += 1
        failed = (execute_reply or {}).get("content", {}).get("status") == "error"
        self._write(progress_line(self.done, self.total, cell_index, self._clock() - self._start, failed))

    def hooks(self) -> dict:
        # on_cell_execute fires only for cells that run (on_cell_start fires for markdown too)
        return {"on_cell_execute": self.started, "on_cell_executed": self.executed}


@contextlib.contextmanager
def local_kernel() -> Iterator[dict]:
    """``NotebookClient`` keyword arguments for a kernel that talks over IPC (Unix sockets in a private temporary
    folder) instead of TCP on localhost: what a headless run needs, and ipykernel's "Kernel is running over TCP
    without encryption" warning (printed by every TCP kernel) does not apply, so a real warning stands out. TCP where
    there are no Unix sockets (Windows)."""
    if os.name != "posix":
        yield {}
        return
    from traitlets.config import Config

    with tempfile.TemporaryDirectory(prefix="wb-kernel-") as folder:
        config = Config()
        config.KernelManager.transport = "ipc"
        config.KernelManager.ip = os.path.join(folder, "k")  # socket files k-1 .. k-5, removed with the folder
        yield {"config": config}
