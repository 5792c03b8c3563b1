"""The notebook series as a static site (``python -m workbench report``): every notebook executed headless, one
progress bar each, written as an :func:`workbench.publish.page.offline_html` page, and an index page with the key
numbers each notebook concluded with (:func:`workbench.publish.notebook.conclusions`, collected by
:func:`key_numbers`) and links to copies of the data files they came from. plotly.js is written once beside the
pages (``plotly.min.js``), not inlined in each: the site works offline and is a tenth of the size.

nbformat, nbclient, plotly and tqdm are imported in the functions that use them: the GPU image has no UI-side
libraries, and every module but the panels and figures imports without them (tests/test_packaging.py).
"""

from __future__ import annotations

import contextlib
import datetime
import html
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from workbench.publish.notebook import KEY_NUMBERS_MIME, ROOT, SMOKE_ENV, format_value
from workbench.publish.page import CellProgress, local_kernel, offline_html

PLOTLY_FILE = "plotly.min.js"

def notebook_title(nb, default: str = "") -> str:
    """The text of the first markdown heading in ``nb`` (``# 01 The *allocator*`` -> ``01 The allocator``: links,
    code and emphasis marks dropped), else ``default``."""
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            m = re.match(r"\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", line)
            if m:
                text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
                return re.sub(r"\*\*|__|\*|`", "", text).strip() or default
    return default


def key_numbers(nb) -> list[dict]:
    """Every :data:`~workbench.publish.notebook.KEY_NUMBERS_MIME` output of ``nb``, in order, as
    ``{"cell", "title", "numbers", "sources"}`` (a malformed payload keeps what can be read)."""
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            payload = output.get("data", {}).get(KEY_NUMBERS_MIME)
            if not isinstance(payload, dict):
                continue
            numbers = payload.get("numbers")
            sources = payload.get("sources")
            found.append({
                "cell": index,
                "title": str(payload.get("title") or f"cell {index}"),
                "numbers": {str(k): v for k, v in numbers.items() if _plain_value(v)} if isinstance(numbers, dict)
                else {},
                "sources": [str(s) for s in sources] if isinstance(sources, list) else [],
            })
    return found


def _plain_value(v) -> bool:
    """A value the index can show (what ``conclusions`` stores): a bool, a finite number or a string."""
    return isinstance(v, bool | str) or (isinstance(v, int | float) and math.isfinite(v))


def site_path(source: str) -> PurePosixPath | None:
    """Where a source file's copy goes in the site: its repository-relative path itself
    (``data/results/X.json`` -> ``OUT/data/results/X.json``); ``None`` for an absolute path or one with ``..``."""
    rel = PurePosixPath(source.replace("\\", "/"))
    drive = re.match(r"^[A-Za-z]:", source)  # C:... is absolute on Windows
    if not source.strip() or drive or rel.is_absolute() or ".." in rel.parts or str(rel) == ".":
        return None
    return rel


def copy_sources(sources: Iterable[str], out: Path, root: Path = ROOT) -> dict[str, str | None]:
    """Copy each source file (relative to ``root``) to the same relative path under ``out``; returns
    ``source -> link`` (the copy's path relative to ``out``), ``""`` for a folder (named, not copied: the captures
    are megabytes), ``None`` for a file that is missing or not a repository-relative path."""
    copied: dict[str, str | None] = {}
    for source in dict.fromkeys(sources):
        rel = site_path(source)
        src = root / rel if rel is not None else None
        if src is not None and src.is_dir():
            copied[source] = ""
            continue
        if src is None or not src.is_file():
            copied[source] = None
            continue
        dst = out / rel
        if dst.resolve() != src.resolve():  # a site written into the repository itself already holds it
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        copied[source] = rel.as_posix()
    return copied


@dataclass
class NotebookRun:
    """One notebook of the site: where it came from, its page, how it ran, what it concluded."""

    source: Path
    page: str  # the page's file name in the site
    title: str
    seconds: float
    ok: bool
    error: str | None = None  # one line: the cell and the exception, when it failed
    numbers: list[dict] = field(default_factory=list)  # key_numbers(executed notebook)
    files: dict[str, str | None] = field(default_factory=dict)  # copy_sources(...): None = missing


@dataclass
class Site:
    out: Path
    index: Path
    runs: list[NotebookRun]
    seconds: float
    full: bool

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs)


INDEX_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 70rem; margin: 2rem auto;
       padding: 0 1rem; color: #1b1f24; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; }
th, td { border-bottom: 1px solid #d0d7de; padding: 0.25rem 0.75rem; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.ok { color: #1a7f37; font-weight: 600; } .failed { color: #cf222e; font-weight: 600; }
.missing { color: #cf222e; } .muted { color: #57606a; } code { font-size: 0.9em; }
section { border-top: 1px solid #d0d7de; margin-top: 1.5rem; }
"""


def _status(run: NotebookRun) -> str:
    return '<span class="ok">ok</span>' if run.ok else '<span class="failed">failed</span>'


def _numbers_html(entry: dict, files: dict[str, str | None]) -> str:
    e = html.escape
    rows = "".join(f'<tr><td>{e(str(k))}</td><td class="num">{e(format_value(v))}</td></tr>'
                   for k, v in entry["numbers"].items())
    parts = [f"<h3>{e(entry['title'])}</h3>", f"<table><tr><th>number</th><th>value</th></tr>{rows}</table>"]
    links = []
    for source in entry["sources"]:
        link = files.get(source)
        if link is None:
            links.append(f'<li class="missing"><code>{e(source)}</code> (missing: not copied)</li>')
        elif not link:
            links.append(f'<li><code>{e(source)}</code> (a folder of the repository, not copied)</li>')
        else:
            links.append(f'<li><a href="{e(link, quote=True)}"><code>{e(source)}</code></a></li>')
    if links:
        parts.append("<p>from:</p><ul>" + "".join(links) + "</ul>")
    return "\n".join(parts)


def index_html(runs: list[NotebookRun], *, full: bool, seconds: float, generated: str | None = None) -> str:
    """The site's index page: a table of the notebooks (link, title, seconds, ok/failed), then each one's key
    numbers with links to the copied data files. Self-contained: inline CSS, no script, nothing fetched."""
    e = html.escape
    generated = generated or datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    failed = sum(not r.ok for r in runs)
    sizes = "full sizes (WORKBENCH_SMOKE=0)" if full else "smoke sizes (WORKBENCH_SMOKE=1)"
    rows = "".join(
        f'<tr><td><a href="{e(r.page, quote=True)}">{e(Path(r.page).stem)}</a></td><td>{e(r.title)}</td>'
        f'<td class="num">{r.seconds:.1f}</td><td>{_status(r)}</td>'
        f'<td class="num">{sum(len(n["numbers"]) for n in r.numbers)}</td></tr>' for r in runs)
    sections = []
    for r in runs:
        body = [f'<section id="{e(Path(r.page).stem, quote=True)}">',
                f'<h2><a href="{e(r.page, quote=True)}">{e(r.title)}</a></h2>',
                f'<p><code>{e(r.source.name)}</code>: {_status(r)} in {r.seconds:.1f} s</p>']
        if r.error:
            body.append(f'<p class="failed">{e(r.error)}</p>')
        if r.numbers:
            body += [_numbers_html(entry, r.files) for entry in r.numbers]
        else:
            body.append('<p class="muted">no key numbers recorded '
                        '(no output of workbench.publish.notebook.conclusions)</p>')
        sections.append("\n".join(body) + "\n</section>")
    status = (f'<span class="failed">{failed} of {len(runs)} failed</span>' if failed
              else f'<span class="ok">all {len(runs)} ran</span>')
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Paged KV-cache workbench: notebook report</title>
<style>{INDEX_CSS}</style>
</head>
<body>
<h1>Paged KV-cache workbench: notebook report</h1>
<p>{len(runs)} notebooks executed headless at {e(sizes)}, {seconds:.1f} s in all: {status}. Generated {e(generated)}.
Each page shows the notebook's outputs with its charts drawn offline; interactive panels are snapshots.</p>
<table>
<tr><th>notebook</th><th>title</th><th>seconds</th><th>status</th><th>key numbers</th></tr>
{rows}
</table>
{chr(10).join(sections)}
</body>
</html>
"""


class CellBar(CellProgress):
    """NotebookClient hooks that advance a tqdm bar (one per notebook) as each code cell finishes, and
    remember the cell that failed."""

    def __init__(self, nb, desc: str, enabled: bool = True):
        from tqdm import tqdm

        super().__init__(nb, write=lambda _line: None)
        self.failed_cell: int | None = None
        self.current: int | None = None
        self.bar = tqdm(total=self.total, desc=desc, unit="cell", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True, leave=True)

    def started(self, cell_index: int | None = None, **hook_args) -> None:
        super().started()
        self.current = cell_index
        if cell_index is not None:
            self.bar.set_postfix_str(f"cell {cell_index}", refresh=True)

    def executed(self, cell_index: int, execute_reply: dict | None = None, **hook_args) -> None:
        super().executed(cell_index, execute_reply, **hook_args)
        if (execute_reply or {}).get("content", {}).get("status") == "error":
            self.failed_cell = cell_index
            self.bar.set_postfix_str(f"cell {cell_index} failed", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


@contextlib.contextmanager
def smoke_environment(full: bool) -> Iterator[None]:
    """``WORKBENCH_SMOKE`` set to ``0`` (full) or ``1`` in ``os.environ`` (a kernel inherits it), restored after."""
    before = os.environ.get(SMOKE_ENV)
    os.environ[SMOKE_ENV] = "0" if full else "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SMOKE_ENV, None)
        else:
            os.environ[SMOKE_ENV] = before


def _failure(e: Exception, bar: CellBar, timeout: int) -> str:
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    cell = bar.failed_cell if bar.failed_cell is not None else bar.current
    where = f"cell {cell}: " if cell is not None else ""
    if isinstance(e, CellExecutionError):
        return f"{where}{e.ename}: {e.evalue}".strip()
    if isinstance(e, CellTimeoutError):
        return f"{where}timed out after {timeout} s"
    if isinstance(e, DeadKernelError):
        return f"{where}the kernel died"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{where}{type(e).__name__}: {first}"


def execute_notebook(path: Path, *, full: bool = False, timeout: int = 900, progress: bool = True,
                     kernel_name: str = "python3"):
    """Execute the notebook at ``path`` headless (kernel cwd: its folder, ``WORKBENCH_SMOKE`` from ``full``);
    returns ``(executed notebook, seconds, error)``: ``error`` is ``None`` when every cell ran, else one line
    (the notebook then holds the outputs of what ran, the failing cell's traceback included)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    bar = CellBar(nb, desc=path.stem, enabled=progress)
    # no widget state: it holds each view's plotly.js (5 MB) and no viewer without a kernel can use it
    error = None
    start = time.perf_counter()
    try:
        with smoke_environment(full), local_kernel() as kernel:
            NotebookClient(nb, timeout=timeout, kernel_name=kernel_name, store_widget_state=False,
                           resources={"metadata": {"path": str(path.parent)}}, **bar.hooks(), **kernel).execute()
    except Exception as e:  # noqa: BLE001  (a cell's error, a timeout, a dead kernel: the notebook failed, go on)
        error = _failure(e, bar, timeout)
    finally:
        bar.close()
    nb.metadata.pop("widgets", None)
    return nb, time.perf_counter() - start, error


def build_site(notebooks: Iterable[Path | str], out: Path | str, full: bool = False, progress: bool = True,
               timeout: int = 900, root: Path | str = ROOT, kernel_name: str = "python3") -> Site:
    """Execute each notebook headless and write the static site to ``out``: ``<stem>.html`` per notebook
    (:func:`offline_html`, also for a notebook that failed: what ran; plotly.js in :data:`PLOTLY_FILE`), copies
    of the data files their key numbers name (same relative path as in ``root``), and ``index.html``
    (:func:`index_html`). ``full`` runs at full
    sizes (``WORKBENCH_SMOKE=0``), else smoke sizes; ``timeout`` is seconds per cell. A failing notebook is
    recorded (``Site.ok`` is then false) and the next one runs."""
    out, root = Path(out), Path(root)
    import plotly.offline

    out.mkdir(parents=True, exist_ok=True)
    (out / PLOTLY_FILE).write_text(plotly.offline.get_plotlyjs(), encoding="utf-8")
    runs = []
    start = time.perf_counter()
    for path in map(Path, notebooks):
        nb, seconds, error = execute_notebook(path, full=full, timeout=timeout, progress=progress,
                                              kernel_name=kernel_name)
        title = notebook_title(nb, default=path.stem)
        page = path.stem + ".html"
        (out / page).write_text(offline_html(nb, title=title, plotly_src=PLOTLY_FILE), encoding="utf-8")
        numbers = key_numbers(nb)
        files = copy_sources([s for entry in numbers for s in entry["sources"]], out, root)
        runs.append(NotebookRun(path, page, title, seconds, error is None, error, numbers, files))
    seconds = time.perf_counter() - start
    index = out / "index.html"
    index.write_text(index_html(runs, full=full, seconds=seconds), encoding="utf-8")
    return Site(out, index, runs, seconds, full)
