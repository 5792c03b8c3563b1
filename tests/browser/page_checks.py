"""What a user notices on a notebook's page beyond the figures' data (``notebook_checks`` runs these after Run All
and after every change to a panel): content cut off inside an output or a panel, a plotly title or subplot title
wider than its figure, an axis titled with a bare column name, printed lines that wrap mid-word, and panels that
show a check cell's last state instead of their parameters cell's (issue 30, item 8).
"""

from __future__ import annotations

# JupyterLab wraps a printed line longer than its output area anywhere, mid-word (word-break: break-all). The
# notebooks listed print lines that fit (at most ~107 characters of 13-px monospace at 1280 px); the others still
# print some longer ones (tables of many columns, dict reprs) and are not held to it yet.
FITTED_OUTPUTS = ("00_tour", "02_layouts_and_kernels", "03_dtypes_and_quantization", "05_prefetch_and_tiers",
                  "08_shared_prefix", "10_serving_whatif")

# Elements inside the outputs (or one panel) whose content is cut off: a box that hides, clips or scrolls more than
# it shows (06's generated texts sat in a 110-px box: 4 of 6 sequences showed, with no scrollbar in sight). Form
# controls (a select, a text box) scroll by design; a figure's own svg is checked by the title check.
CLIPPED_JS = """(pid) => {
  const tops = pid === null ? [...document.querySelectorAll('.jp-OutputArea-output')]
                            : [document.querySelector(`.wb-panel-${pid}`)];
  const hides = v => ['hidden', 'auto', 'scroll', 'clip'].includes(v);
  const found = [];
  for (const top of tops) {
    for (const el of [top, ...top.querySelectorAll('*')]) {
      if (el.closest('.js-plotly-plot') || el.closest('select, textarea, input')) continue;
      const cs = getComputedStyle(el);
      const dy = el.scrollHeight - el.clientHeight, dx = el.scrollWidth - el.clientWidth;
      if ((hides(cs.overflowY) && dy > 2) || (hides(cs.overflowX) && dx > 2)) {
        const cell = [...document.querySelectorAll('.jp-Notebook .jp-Cell')].indexOf(el.closest('.jp-Cell'));
        found.push(`cell ${cell}: <${el.tagName.toLowerCase()} class="${el.className}"> shows ` +
                   `${el.clientWidth}x${el.clientHeight} px of ${el.scrollWidth}x${el.scrollHeight}: ` +
                   `'${el.textContent.trim().slice(0, 60)}'`);
      }
    }
  }
  return found.slice(0, 5);
}"""

# Every figure (or one panel's): its title and subplot titles inside the figure's width, and no axis titled with a
# bare snake_case column name (the sweep panels' `bytes_per_token`, `attn_err`).
FIGURE_TEXT_JS = """(pid) => {
  const gds = pid === null ? [...document.querySelectorAll('.js-plotly-plot')]
                           : [...document.querySelectorAll(`.wb-panel-${pid} .js-plotly-plot`)];
  const found = [];
  for (const gd of gds) {
    const box = gd.getBoundingClientRect();
    const cell = [...document.querySelectorAll('.jp-Notebook .jp-Cell')].indexOf(gd.closest('.jp-Cell'));
    for (const t of gd.querySelectorAll('.gtitle, .annotation-text-g')) {
      const r = t.getBoundingClientRect();
      if (r.width > 0 && (r.left < box.left - 1 || r.right > box.right + 1)) {
        found.push(`cell ${cell}: '${t.textContent.slice(0, 70)}' spans ${Math.round(r.left - box.left)} to ` +
                   `${Math.round(r.right - box.left)} px of a ${Math.round(box.width)}-px figure`);
      }
    }
    for (const [key, axis] of Object.entries(gd.layout || {})) {
      const title = /^[xy]axis\\d*$/.test(key) && axis && axis.title ? (axis.title.text || '') : '';
      if (/^[A-Za-z0-9]+(_[A-Za-z0-9]+)+$/.test(title)) {
        found.push(`cell ${cell}: ${key} is titled with a column's name, '${title}'`);
      }
    }
  }
  return found;
}"""

# Printed outputs whose lines wrap: a stream's box taller than its lines.
WRAPPED_JS = """() => {
  const found = [];
  for (const pre of document.querySelectorAll('[data-mime-type="application/vnd.jupyter.stdout"] pre')) {
    const lines = pre.textContent.replace(/\\n$/, '').split('\\n');
    const lh = parseFloat(getComputedStyle(pre).lineHeight);
    if (pre.getBoundingClientRect().height > (lines.length + 0.5) * lh) {
      const cell = [...document.querySelectorAll('.jp-Notebook .jp-Cell')].indexOf(pre.closest('.jp-Cell'));
      const longest = lines.reduce((a, b) => (b.length > a.length ? b : a));
      found.push(`cell ${cell}: a line of ${longest.length} characters wraps: '${longest.slice(0, 60)}...'`);
    }
  }
  return found.slice(0, 5);
}"""

# The kernel's panels whose controls are not where the panel was built (its parameters cell's settings).
MOVED_PY = """
import json as _json
from workbench.ui.panels import Panel as _Panel
print(_json.dumps({p.id: {k: [repr(c.value), repr(p.initial[k])] for k, c in p.controls.items()
                          if c.value != p.initial[k]} for p in _Panel.live()}))
"""


def page_problems(page, panel_id: int | None = None) -> list[str]:
    """Clipped content and figure text that does not fit or names a column, on the page or in one panel."""
    return page.evaluate(CLIPPED_JS, panel_id) + page.evaluate(FIGURE_TEXT_JS, panel_id)


def wrapped_lines(page) -> list[str]:
    return page.evaluate(WRAPPED_JS)


# A notebook that shows each class once: the checks above must name every one of them.
PROBE_CELLS = [
    'print("a printed line of 160 characters " + "word " * 26)',
    'from IPython.display import HTML\n'
    'HTML("<div style=\'max-height:40px;overflow:auto\'>" + "<p>a sequence</p>" * 6 + "</div>")',
    "import ipywidgets as W\nimport plotly.graph_objects as go\nfrom workbench.ui.panels import Panel\n"
    "panel = Panel({'n': W.IntSlider(value=1, min=0, max=5)}, lambda n: n, lambda n: go.Figure(\n"
    "    go.Bar(y=[n]), layout=dict(title='a title far too long for its figure ' * 6,\n"
    "                             xaxis_title='bytes_per_token', yaxis_title='attention error')))\npanel",
    "panel.controls['n'].value = 3  # a check cell that leaves the panel moved",
]


def check_the_checks(lab, notebook_class) -> None:
    """Run :data:`PROBE_CELLS` in the lab: every check of this module names its class there."""
    import nbformat

    server, _, lab_page = lab
    path = server.root / "notebooks" / "zz_page_checks_probe.ipynb"
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_code_cell(src) for src in PROBE_CELLS]
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(book, path)
    nb = notebook_class(server, lab_page, path)
    try:
        nb.run_all(timeout_s=120)
        nb.page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length > 0",
                                  timeout=30_000)
        nb.page.wait_for_timeout(500)
        import json

        found = "\n".join(page_problems(nb.page) + wrapped_lines(nb.page))
        for what in ("wraps", "shows", "of a ", "titled with a column's name, 'bytes_per_token'"):
            assert what in found, f"the checks missed {what!r}; they found:\n{found}"
        moved = json.loads(nb.kernel(MOVED_PY))
        assert list(moved.values()) == [{"n": ["3", "1"]}], moved
    finally:
        nb.close()
