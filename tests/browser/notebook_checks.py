"""The browser test's checks (``test_notebooks_in_browser.py`` runs them).

Every notebook as a user meets it: JupyterLab in headless Chromium at 1280 px (the tour also at 1920 px: ``WIDE``).

For each notebook: the stored copy shows its figures before anything runs (never a widget's text repr);
Run All finishes with no error or stderr output, every checked cell showing its stored outputs as nbval compares
them (``tests/stored_outputs.py``: `make test` runs each notebook once, here), every panel showing its parameters
cell's settings (a check cell puts back what it moved); every plotly figure draws at its output area's width, nothing
is cut off inside an output or panel, no title is wider than its figure and no axis is titled with a column's name
(``page_checks``);
then every panel's text boxes, dropdowns, sliders (keyboard on the handle), toggles and buttons are used, and
after each change the figure on the page must be exactly the kernel's ``panel.figure`` drawn afresh: same
data, no stale layout keys, and the kernel holding every value the page's controls show. The tour's HTML report must
draw its charts with every network request refused. Screenshots go to ``test-artifacts/browser/``
(``WORKBENCH_TEST_ARTIFACTS`` moves it).

Needs Debian's chromium and the playwright package, which ``make test`` installs; elsewhere the test
skips with that message, and with ``WORKBENCH_REQUIRE_BROWSER=1`` (set by ``make test``) it fails instead.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
import stored_outputs
from lab_driver import CHROMIUM, COMPARE_JS, FIGURES_JS, FLATTEN_JS, KernelConsole, LabServer
from page_checks import FITTED_OUTPUTS, MOVED_PY, page_problems, wrapped_lines

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
WIDTHS = (1280, 1920)
# Notebooks also checked at the second width. The figures follow their output area's width through one shared
# widget (workbench.ui.plot_view), so one notebook shows it; every notebook at both widths cost the 10-minute
# test command ~40 s of a 2-core machine (every figure redraws and is compared again).
WIDE = ("00_tour",)
ARTIFACTS = Path(os.environ.get("WORKBENCH_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "browser"
MAX_OPTIONS = 1  # options tried per dropdown (then back to the first); each may run a model (06)
TEXTAREA_LINE = " Be brief."  # what the test adds to a text box (06's prompt box: one prompt a line, the last edited)
BUTTON_TIMEOUT_S = 180  # a button may run a model (06's Generate: seconds on a CPU)
try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:  # the fixture skips (or fails) with the reason
    PlaywrightTimeout = TimeoutError
PYTHON_SIDE = """
import json as _json
from workbench.ui.panels import Panel as _Panel
from workbench.ui.plot_view import figure_json as _figure_json
def _shown(c):  # a control's value as the page writes it
    if hasattr(c, "label"):
        return str(c.label)
    if isinstance(c.value, bool):
        return c.value
    return format(c.value, c.readout_format) if isinstance(c.value, float) else str(c.value)
def _wb_side(pid=None):  # one panel (what a comparison polls), or all of them
    print(_json.dumps({p.id: {"figure": _figure_json(p.figure), "status": p.status.value,
                              "controls": [_shown(c) for c in p.controls.values()]}
                       for p in _Panel.live() if pid is None or p.id == pid}))
"""


def _unavailable(reason: str):
    if os.environ.get("WORKBENCH_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (WORKBENCH_REQUIRE_BROWSER=1; scripts/setup_browser.sh installs it)")
    pytest.skip(f"{reason}: the browser test needs it; `make test` installs it (scripts/setup_browser.sh)")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed")
    if not Path(CHROMIUM).exists():
        _unavailable(f"no Chromium at {CHROMIUM}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    server = LabServer(NOTEBOOKS, tmp_path_factory.mktemp("lab"), env={"CI": "1"})  # CI: SMOKE sizes
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            lab_page = LabPage(server, browser)
            yield server, browser, lab_page
            lab_page.finish_shutdowns()
            browser.close()
    finally:
        server.stop()
        print(f"\nbrowser test screenshots: {ARTIFACTS}")


class LabPage:
    """One JupyterLab page for every notebook, as a user keeps one tab open: loading the app is the slow part
    on a 2-core machine (~10 s of Chromium's CPU a page), so each notebook opens in it (``docmanager:open``)
    and closes when checked, leaving the page empty for the next."""

    def __init__(self, server: LabServer, browser):
        self.context = browser.new_context(viewport={"width": WIDTHS[0], "height": 900})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.add_init_script(FLATTEN_JS)
        self.server = server
        self.shutdowns: list[tuple[threading.Thread, list]] = []
        self.page.goto(f"{server.url}/lab/workspaces/browser-test?reset")
        self.page.wait_for_function("() => window.jupyterapp !== undefined", timeout=90_000)
        self.page.evaluate("() => window.jupyterapp.started")

    def open(self, name: str) -> None:
        self.errors.clear()
        self.page.set_viewport_size({"width": WIDTHS[0], "height": 900})
        # null, not the command's widget: Playwright would serialize the whole widget tree (~2-3 s a notebook)
        self.page.evaluate("(path) => window.jupyterapp.commands.execute('docmanager:open', {path}).then(() => null)",
                           name)

    def shut_down(self, session_id: str) -> None:
        """End a notebook's session (the server stops its kernel: a second or more, the kernel's own exit) in the
        background, while the next notebook opens."""
        errors: list = []

        def delete():
            try:
                req = urllib.request.Request(f"{self.server.url}/api/sessions/{session_id}", method="DELETE")
                urllib.request.urlopen(req).close()
            except Exception as e:  # noqa: BLE001  (raised by finish_shutdowns)
                errors.append(e)

        t = threading.Thread(target=delete, daemon=True)
        t.start()
        self.shutdowns.append((t, errors))

    def finish_shutdowns(self, timeout_s: float = 60) -> None:
        for t, errors in self.shutdowns:
            t.join(timeout_s)
            if errors:
                raise errors[0]
        self.shutdowns.clear()

    def close_all(self) -> None:
        # run cells leave the notebook unsaved: mark it clean so closing asks nothing (the test never saves)
        self.page.evaluate("""() => { for (const w of [...window.jupyterapp.shell.widgets('main')]) {
            if (w.context) { w.context.model.dirty = false; } w.close(); } }""")
        self.page.wait_for_selector(".jp-Notebook", state="detached", timeout=30_000)


def _menu(page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=menu).first.click()
    page.locator(".lm-Menu-itemLabel", has_text=item).first.click()


def _session(server: LabServer, name: str, timeout_s: float = 60) -> dict:
    """The notebook's kernel session (the page creates it once the notebook has opened)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{server.url}/api/sessions") as r:
            found = [s for s in json.load(r) if s["path"].endswith(name) and s.get("kernel")]
        if found:
            return found[0]
        time.sleep(0.5)
    raise TimeoutError(f"no kernel session for {name} after {timeout_s:.0f} s")


class Notebook:
    """One notebook open in a page, with its kernel reachable from the test."""

    def __init__(self, server: LabServer, lab_page: LabPage, path: Path):
        self.server, self.name, self.lab_page = server, path.name, lab_page
        self.page, self.page_errors = lab_page.page, lab_page.errors
        lab_page.open(self.name)
        self.page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
        self.page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
        self.dismiss_kernel_dialog()
        session = _session(server, self.name)
        self.session_id = session["id"]
        self.connection = server.root / "runtime" / f"kernel-{session['kernel']['id']}.json"
        self.console: KernelConsole | None = None

    def dismiss_kernel_dialog(self) -> None:
        """JupyterLab may ask which kernel to start: it asks before the kernel starts, so once the notebook's
        execution indicator has shown the kernel idle (``__init__`` waits for it) the question is on the page or
        never comes; it is looked for, not waited for."""
        select = self.page.locator(".jp-Dialog button", has_text="Select")
        if select.count():
            select.first.click()

    def run_all(self, timeout_s: float = 400) -> float:
        self.dismiss_kernel_dialog()
        t0 = time.monotonic()
        _menu(self.page, "Edit", "Clear Outputs of All Cells")
        _menu(self.page, "Run", "Run All Cells")
        # every cell numbered, or a cell failed (an error stops Run All: the kernel idles, its traceback on stderr)
        self.page.wait_for_function(
            """() => { const ps = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
                       const err = document.querySelector("[data-mime-type='application/vnd.jupyter.stderr']");
                       const idle = document.querySelector(".jp-Notebook-ExecutionIndicator[data-status='idle']");
                       return (ps.length > 0 && ps.every(p => /\\[\\d+\\]/.test(p.textContent)))
                         || (err !== null && idle !== null); }""",
            timeout=timeout_s * 1000)
        self.page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
        return time.monotonic() - t0

    def figures(self) -> list[dict]:
        return self.page.evaluate(FIGURES_JS)

    def kernel(self, code: str) -> str:
        """Run ``code`` in the notebook's kernel (a second client, set up once); its stdout."""
        if self.console is None:
            self.console = KernelConsole(self.connection)
            self.console.run(PYTHON_SIDE)
        return self.console.run(code)

    def python_side(self, panel_id: int | None = None) -> dict[int, dict]:
        """The kernel's view of its live panels (figure, status, control values), or of one of them."""
        arg = "" if panel_id is None else int(panel_id)
        return {int(k): v for k, v in json.loads(self.kernel(f"_wb_side({arg})")).items()}

    def compare(self, panel_id: int, changed_from: str | None = None, timeout_s: float = 30,
                redraw_from: str | None = None) -> dict:
        """Wait until the page shows the kernel's figure for this panel and, when ``changed_from`` is given,
        a figure other than that one (the kernel may not have seen the change yet); return the comparison.
        ``redraw_from``: what the page showed before a change that redraws it, waited for like ``changed_from``
        (a few seconds at most) but not checked."""
        deadline = time.monotonic() + timeout_s
        before = changed_from if changed_from is not None else redraw_from
        if before is not None:  # first the page's own redraw (cheap to poll), then the full comparison: one that
            try:  # starts before the redraw fails and is redone (a kernel round trip and a plot each time)
                wait_s = timeout_s if changed_from is not None else min(timeout_s, 5)
                self.page.wait_for_function(CHANGED_JS, arg=[panel_id, before], polling=25, timeout=wait_s * 1000)
            except PlaywrightTimeout:
                pass  # the loop below says what the page shows
        while True:
            py = self.python_side(panel_id)[panel_id]
            result = self.page.evaluate(COMPARE_JS, [panel_id, json.dumps(py["figure"])])
            result["status"] = py["status"]
            result["changed"] = changed_from is None or _panel_data(self, panel_id) != changed_from
            # the kernel has every value the page's controls show (else it has not seen the last change yet)
            result["controls"] = (self.page.evaluate(CONTROLS_JS, panel_id), py["controls"])
            clean = (not (result["stale"] or result["missing"] or result["differ"]) and result["data_same"]
                     and result["controls"][0] == result["controls"][1])
            if (clean and result["changed"]) or time.monotonic() > deadline:
                return result
            time.sleep(0.3)

    def close(self) -> None:
        if self.console is not None:
            self.console.close()
        self.lab_page.close_all()  # before its kernel goes: a notebook whose kernel died would ask what to do
        self.lab_page.shut_down(self.session_id)


# Each control's value as the page shows it, in the panel's order (its first child holds the controls).
CONTROLS_JS = """(pid) => [...document.querySelector(`.wb-panel-${pid}`).firstElementChild.children].map(el => {
    const area = el.querySelector('textarea');
    if (area) return area.value;
    const select = el.querySelector('select');
    if (select) return select.selectedOptions[0].text.replace(/\u00a0/g, ' ');  // options use no-break spaces
    const readout = el.querySelector('.widget-readout');
    if (readout) return readout.textContent.trim();
    const box = el.querySelector('input[type=checkbox]');
    if (box) return box.checked;
    const active = el.querySelector('button.mod-active');
    return active ? active.textContent.trim() : null;
})"""


# A panel's controls whose right edge passes the panel's, and its slider tracks under 100 px wide.
CONTROL_BOXES_JS = """(pid) => { const panel = document.querySelector(`.wb-panel-${pid}`);
    const right = panel.getBoundingClientRect().right;
    const over = [...panel.querySelectorAll('.widget-inline-hbox, .widget-toggle-buttons')]
        .filter(el => el.getBoundingClientRect().right > right + 1).map(el => el.innerText);
    const narrow = [...panel.querySelectorAll('.noUi-target')].map(el => el.getBoundingClientRect().width)
        .filter(w => w < 100);
    return [over, narrow]; }"""


# What a panel's figure shows: its data and its layout's text (titles, annotations), as one string.
PANEL_DATA_JS = """(pid) => { const gd = document.querySelector(`.wb-panel-${pid} .js-plotly-plot`);
    const text = Object.entries(__wbFlatten(gd.layout)).filter(([k]) => /(^|[.])text$/.test(k));
    return JSON.stringify([__wbFlatten({d: gd.data}), text]); }"""


# The notebook as the page holds it after Run All (nbformat v4 JSON, its outputs those of this run).
NOTEBOOK_JSON_JS = """(name) => JSON.stringify([...window.jupyterapp.shell.widgets('main')]
    .find(w => w.context && w.context.path.endsWith(name)).context.model.toJSON())"""

# Whether a panel shows something other than `before`, polled every 25 ms while the kernel redraws. The string of a
# large figure takes ~15 ms of the page's CPU to build (a 0.3-MB heatmap), so it is built again only once the page
# holds another figure (Plotly.react replaces gd.data and gd.layout) or 1 s after the last time (a change in place).
CHANGED_JS = f"""([pid, before]) => {{
  const gd = document.querySelector(`.wb-panel-${{pid}} .js-plotly-plot`);
  const seen = (window.__wbSeen ??= new WeakMap()), last = seen.get(gd), now = performance.now();
  if (last && last.data === gd.data && last.layout === gd.layout && last.before === before && now - last.t < 1000) {{
    return last.changed;
  }}
  const changed = ({PANEL_DATA_JS})(pid) !== before;
  seen.set(gd, {{data: gd.data, layout: gd.layout, before, changed, t: now}});
  return changed;
}}"""

# Every figure on the page drawn (an svg) at its output area's width: what the checks after Run All read.
FIGURES_DRAWN_JS = f"() => ({FIGURES_JS})().every(f => f.svg > 0 && Math.abs(f.width - f.output_width) <= 2)"


def _panel_data(nb: Notebook, panel_id: int) -> str:
    return nb.page.evaluate(PANEL_DATA_JS, panel_id)


def _assert_clean(nb: Notebook, panel_id: int, what: str, changed_from: str | None = None,
                  timeout_s: float = 30, redraw_from: str | None = None) -> None:
    r = nb.compare(panel_id, changed_from, timeout_s, redraw_from)
    assert not r["status"], f"panel {panel_id} after {what}: {r['status']}"
    assert not r["stale"], f"panel {panel_id} after {what}: stale layout keys on the page: {r['stale']}"
    assert not r["missing"], f"panel {panel_id} after {what}: layout keys missing on the page: {r['missing']}"
    assert not r["differ"], f"panel {panel_id} after {what}: layout values differ from the kernel's: {r['differ']}"
    assert r["data_same"], f"panel {panel_id} after {what}: the page's data is not the kernel's"
    page, kernel = r["controls"]
    assert page == kernel, f"panel {panel_id} after {what}: the page's controls show {page}, the kernel has {kernel}"
    assert r["changed"], f"panel {panel_id}: {what} changed nothing on the page"
    problems = page_problems(nb.page, panel_id)
    assert not problems, f"panel {panel_id} after {what}: {problems}"


def _exercise_panel(nb: Notebook, panel_id: int, width: int, shots: str, full: bool = True) -> list[str]:
    """Add a line to every text box, move every dropdown through a few options and every slider by a step, flip
    every toggle, then press every plain button (a panel's Generate), checking the page against the kernel after
    each (``full=False``, a second width: the layout checks and the screenshot only)."""
    options_per_dropdown = MAX_OPTIONS if full else 1
    controls = slice(None) if full else slice(1)
    panel = nb.page.locator(f".wb-panel-{panel_id}")
    panel.scroll_into_view_if_needed()
    moved = []
    overflowing, narrow = nb.page.evaluate(CONTROL_BOXES_JS, panel_id)  # one round trip for every box
    assert not overflowing, f"panel {panel_id} at {width} px: a control overflows the panel: {overflowing[0]!r}"
    assert not narrow, f"panel {panel_id} at {width} px: slider track too narrow ({narrow[0]:.0f} px)"

    if not full:  # a second width: the layout checks above and the screenshot; the controls were moved at the first
        panel.screenshot(path=shots)
        return ["layout"]

    for i, area in enumerate(panel.locator("textarea:not([disabled])").all()[controls]):
        before = _panel_data(nb, panel_id)
        area.fill(area.input_value() + TEXTAREA_LINE)
        area.blur()  # a Textarea with continuous_update=False sends its value on change
        _assert_clean(nb, panel_id, f"textarea {i}", changed_from=before)
        moved.append(f"textarea {i}")

    # a greyed-out dropdown (a sweep panel's value for the parameter on an axis) is left alone; each dropdown goes
    # back to its first value before the next, so the ones greyed out are those of the panel as built
    for i, select in enumerate(panel.locator("select").all()[controls]):
        if select.is_disabled():
            continue
        options = select.locator("option").all_inner_texts()
        first = select.input_value()
        current = select.evaluate("s => s.selectedOptions[0].text")
        shown = None  # the page after the last option tried: going back to the first redraws it
        for label in [o for o in options if o != current][:options_per_dropdown]:
            before = _panel_data(nb, panel_id)
            select.select_option(label=label)
            _assert_clean(nb, panel_id, f"dropdown {i} -> {label}", changed_from=before)
            moved.append(f"dropdown {i} -> {label}")
            shown = _panel_data(nb, panel_id)
        select.select_option(value=first)
        _assert_clean(nb, panel_id, f"dropdown {i} back", redraw_from=shown)

    # a greyed-out slider (it does not apply to the other settings) is left alone
    for i, handle in enumerate(panel.locator(".noUi-target:not([disabled]) .noUi-handle").all()[controls]):
        before = _panel_data(nb, panel_id)
        at_max = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
        handle.focus()
        handle.press("ArrowLeft" if at_max else "ArrowRight")
        _assert_clean(nb, panel_id, f"slider {i}", changed_from=before)
        moved.append(f"slider {i}")

    for i, group in enumerate(panel.locator(".widget-toggle-buttons").all()[controls]):
        buttons = group.locator("button")
        for j in range(buttons.count()):
            if "mod-active" not in (buttons.nth(j).get_attribute("class") or ""):
                before = _panel_data(nb, panel_id)
                buttons.nth(j).click()
                _assert_clean(nb, panel_id, f"toggle {i} -> {j}", changed_from=before)
                moved.append(f"toggle {i} -> {j}")
                break

    # plain buttons (not a toggle's): a panel's Generate runs a model, so the kernel may take a while; pressed at
    # the first width only (at the others the same run would only be redrawn wider, which the sliders check)
    buttons = panel.locator("button.widget-button:not([disabled])").all() if full else []
    for i, button in enumerate(buttons):
        before = _panel_data(nb, panel_id)
        button.click()
        _assert_clean(nb, panel_id, f"button {i} ({button.inner_text().strip()!r})", changed_from=before,
                      timeout_s=BUTTON_TIMEOUT_S)
        moved.append(f"button {i}")
    panel.screenshot(path=shots)
    return moved


def _stored_figures(path: Path) -> int:
    """Outputs of the stored notebook that hold a plotly figure."""
    cells = json.loads(path.read_text())["cells"]
    return sum("application/vnd.plotly.v1+json" in o.get("data", {}) for c in cells for o in c.get("outputs", []))


def check_notebook(lab, path: Path) -> None:
    server, _, lab_page = lab
    t0 = time.monotonic()
    nb = Notebook(server, lab_page, path)
    opened = time.monotonic() - t0
    try:
        text = nb.page.inner_text(".jp-Notebook")
        assert "VBox(children" not in text and "model not found" not in text, \
            "before Run All a panel shows a widget's text repr instead of its stored figure"
        stored = _stored_figures(path)
        if stored:  # the stored figures (panels' snapshots included) draw before anything runs
            nb.page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {stored}",
                                      timeout=30_000)
            nb.page.locator(".js-plotly-plot").first.scroll_into_view_if_needed()
        nb.page.screenshot(path=str(ARTIFACTS / f"{path.stem}-stored.png"))

        seconds = nb.run_all()
        stderr = nb.page.locator("[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
        assert not stderr, f"cells wrote errors or warnings: {stderr[:3]}"
        assert "Error displaying widget" not in nb.page.inner_text(".jp-Notebook")
        ran = nbformat.reads(nb.page.evaluate(NOTEBOOK_JSON_JS, nb.name), as_version=4)
        differ = stored_outputs.differences(nbformat.read(path, as_version=4), ran)  # nbval's check, this run's
        assert not differ, "checked outputs differ from the stored ones:\n" + "\n".join(differ)
        panels = sorted({int(f["panel"].rsplit("-", 1)[1]) for f in nb.figures() if f["panel"]})
        assert len(panels) == len(nb.python_side()), "a live panel has no figure on the page"
        moved = {pid: m for pid, m in json.loads(nb.kernel(MOVED_PY)).items() if m}
        assert not moved, f"after Run All these panels are not as their parameters cell set them: {moved}"

        for width in WIDTHS if path.stem in WIDE else WIDTHS[:1]:
            if width != WIDTHS[0]:  # the page has been at the first width since the notebook opened
                nb.page.set_viewport_size({"width": width, "height": 900})
                nb.page.wait_for_timeout(700)  # the ResizeObserver redraws at the new width
            try:
                nb.page.wait_for_function(FIGURES_DRAWN_JS, polling=100, timeout=10_000)
            except PlaywrightTimeout:
                pass  # the checks below say which figure
            for f in nb.figures():
                assert f["svg"] > 0, f"cell {f['cell']}: a figure did not render"
                fits = abs(f["width"] - f["output_width"]) <= 2
                assert fits, f"cell {f['cell']} at {width} px: figure {f['width']:.0f} px in {f['output_width']:.0f}"
            problems = page_problems(nb.page)
            assert not problems, f"after Run All at {width} px: {problems}"
            if path.stem in FITTED_OUTPUTS:
                wrapped = wrapped_lines(nb.page)
                assert not wrapped, f"printed lines wrap mid-word at {width} px: {wrapped}"
            for pid in panels:
                _assert_clean(nb, pid, f"Run All at {width} px", timeout_s=60)  # a loaded 2-core machine
                shot = str(ARTIFACTS / f"{path.stem}-{width}-panel{pid}.png")
                moved = _exercise_panel(nb, pid, width, shot, full=width == WIDTHS[0])
                assert moved, f"panel {pid} has no control the test could move"
        assert not nb.page_errors, f"JavaScript errors on the page: {nb.page_errors[:3]}"
        print(f"{path.name}: opened in {opened:.0f} s, ran in {seconds:.0f} s, {len(panels)} panel(s) checked at "
              f"{WIDTHS if path.stem in WIDE else WIDTHS[:1]} px; {time.monotonic() - t0:.0f} s in all")
    finally:
        nb.close()


def check_tour_report_offline(lab, tmp_path: Path) -> None:
    """The tour's HTML report (``python -m workbench tour`` writes it with ``workbench.publish.page.offline_html``),
    opened with every network request refused, draws every chart. Made here from the stored notebook: running it again
    would add ~25 s of a 2-core machine to the 10-minute test command for nothing this checks (the notebook's own
    test runs it; tests/test_cli.py runs the command's whole path with a stand-in kernel)."""

    from workbench.publish.page import offline_html

    _, browser, _ = lab
    report = tmp_path / "00_tour.html"
    report.write_text(offline_html(nbformat.read(ROOT / "notebooks" / "00_tour.ipynb", as_version=4)))
    context = browser.new_context(viewport={"width": WIDTHS[0], "height": 900})
    page = context.new_page()
    fetched = []
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
               else (fetched.append(route.request.url), route.abort()))
    try:
        page.goto(report.as_uri())
        expected = _stored_figures(ROOT / "notebooks" / "00_tour.ipynb")
        page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {expected}",
                               timeout=30_000)
        page.locator(".js-plotly-plot").first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "00_tour-report-offline.png"))
        assert not fetched, f"the report asked the network for {fetched[:3]}"
    finally:
        context.close()
