"""The notebook series' report site (``python -m workbench report``): ``conclusions`` and its mime bundle, the
``WORKBENCH_SMOKE`` switch, key numbers read from a notebook, the index page, and ``build_site`` end to end on two
tiny notebooks (one kernel each: an ok one and a failing one)."""

import json
import os
import re
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from workbench.__main__ import main
from workbench.publish.notebook import KEY_NUMBERS_MIME, ROOT, SMOKE_ENV, conclusions, format_value, smoke_setting
from workbench.publish.site import (
    CellBar,
    NotebookRun,
    Site,
    build_site,
    copy_sources,
    index_html,
    key_numbers,
    notebook_title,
    site_path,
    smoke_environment,
)

SOURCE = "data/results/allocator-cpu-x86_64-20261129T1114.json"  # a committed run
MISSING = "data/results/no-such-run.json"


# ---------------------------------------------------------------------------------------------- conclusions
def test_conclusions_mime_bundle():
    c = conclusions("02 layouts", {"peak fraction": 0.91234, "blocks": 12345, "dtype": "fp16", "exact": True,
                                   "numpy": np.float32(2.5), "n": np.int64(7),
                                   "flag": np.bool_(False)}, [SOURCE, Path(SOURCE), SOURCE])
    bundle = c._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/markdown", KEY_NUMBERS_MIME}
    payload = bundle[KEY_NUMBERS_MIME]
    assert payload == {"title": "02 layouts", "sources": [SOURCE],  # deduplicated, paths as POSIX strings
                       "numbers": {"peak fraction": 0.912, "blocks": 12345, "dtype": "fp16", "exact": True,
                                   "numpy": 2.5, "n": 7, "flag": False}}
    assert [type(payload["numbers"][k]) for k in ("n", "numpy", "flag")] == [int, float, bool]
    json.dumps(payload)  # what nbformat stores
    text = bundle["text/plain"].splitlines()
    assert text[0] == "Key numbers: 02 layouts"
    assert [line.split(":", 1)[0].strip() for line in text[1:-1]] == list(payload["numbers"])
    assert re.match(r"\s+peak fraction:\s+0\.912$", text[1]) and text[2].endswith(" 12,345")
    assert text[-1] == f"  from: {SOURCE}"
    assert repr(c) == bundle["text/plain"]
    md = bundle["text/markdown"]
    assert "| number | value |" in md and "| peak fraction | 0.912 |" in md and f"`{SOURCE}`" in md


def test_conclusions_relative_source_from_an_absolute_path_and_no_sources():
    c = conclusions("t", {"x": 1}, [ROOT / SOURCE])
    assert c.sources == [SOURCE]
    bundle = conclusions("t", {"x": 1})._repr_mimebundle_()
    assert bundle[KEY_NUMBERS_MIME]["sources"] == [] and "from" not in bundle["text/plain"]


def test_format_value():
    assert [format_value(v) for v in (0.0, 1.0, 0.5, 12.3456, 123.456, 12345.67, 2.5e7, 1.5e-5, -3.25)] == [
        "0", "1", "0.5", "12.3", "123", "12,300", "2.50e+07", "1.50e-05", "-3.25"]
    assert [format_value(v) for v in (3, 1234567, True, "H200")] == ["3", "1,234,567", "True", "H200"]


@pytest.mark.parametrize("args, needle", [
    ((None, {"x": 1}), "title_or_notebook"),
    (("  ", {"x": 1}), "title_or_notebook"),
    (("t", {}), "numbers must be a non-empty dict"),
    (("t", [("x", 1)]), "numbers must be a non-empty dict"),
    (("t", {1: 1}), "names must be non-empty str"),
    (("t", {"x": [1, 2]}), "numbers['x'] must be a number, str or bool, got list"),
    (("t", {"x": None}), "numbers['x'] must be a number"),
    (("t", {"x": torch.tensor(1.0)}), "pass .item()"),
    (("t", {"x": float("nan")}), "numbers['x'] must be finite"),
    (("t", {"x": 1}, SOURCE), "wrap it in a list"),
    (("t", {"x": 1}, 3), "sources must be a list of paths"),
    (("t", {"x": 1}, [3]), "sources must be paths (str), got int"),
    (("t", {"x": 1}, ["../secrets.json"]), "without '..'"),
    (("t", {"x": 1}, [""]), "relative to the repository root"),
    (("t", {"x": 1}, ["/etc/hostname"]), "outside the repository"),
])
def test_conclusions_argument_errors(args, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        conclusions(*args)


# ---------------------------------------------------------------------------------------------- WORKBENCH_SMOKE
def test_smoke_setting():
    assert smoke_setting({}, cuda=False) is True
    assert smoke_setting({}, cuda=True) is False
    assert smoke_setting({"CI": "1"}, cuda=True) is True
    assert smoke_setting({SMOKE_ENV: "1"}, cuda=True) is True
    assert smoke_setting({SMOKE_ENV: "0", "CI": "true"}, cuda=False) is False  # the override wins
    assert smoke_setting({SMOKE_ENV: " 1 "}, cuda=True) is True
    for bad in ("yes", "", "2", "true"):
        with pytest.raises(ValueError, match=SMOKE_ENV):
            smoke_setting({SMOKE_ENV: bad}, cuda=True)


def test_smoke_environment_sets_and_restores(monkeypatch):
    monkeypatch.delenv(SMOKE_ENV, raising=False)
    with smoke_environment(full=True):
        assert os.environ[SMOKE_ENV] == "0"
    assert SMOKE_ENV not in os.environ
    monkeypatch.setenv(SMOKE_ENV, "0")
    with pytest.raises(RuntimeError), smoke_environment(full=False):
        assert os.environ[SMOKE_ENV] == "1"
        raise RuntimeError
    assert os.environ[SMOKE_ENV] == "0"


# ---------------------------------------------------------------------------------------------- pure helpers
def _output(c) -> dict:
    return new_output("display_data", data=c._repr_mimebundle_())


def _hand_built():
    outputs = [new_output("stream", name="stdout", text="hi\n"),
               _output(conclusions("memory", {"saved GiB": 1.25, "blocks": 4096}, [SOURCE, MISSING]))]
    nb = new_notebook(cells=[
        new_code_cell("x = 1"),
        new_markdown_cell("Intro\n\n# 01 · The *allocator* and `sharing`\n## later"),
        new_code_cell("show()", outputs=outputs, execution_count=1),
        new_code_cell("more()", execution_count=2, outputs=[
            new_output("execute_result", data={KEY_NUMBERS_MIME: {"numbers": {"speed": 2.0, "bad": None, "x": [1]}}},
                       execution_count=2),
            new_output("display_data", data={KEY_NUMBERS_MIME: "not a dict"})]),
    ])
    nbformat.validate(nb)
    return nb


def test_notebook_title():
    assert notebook_title(_hand_built()) == "01 · The allocator and sharing"
    assert notebook_title(new_notebook(cells=[new_markdown_cell("no heading")]), default="nb") == "nb"


def test_key_numbers():
    found = key_numbers(_hand_built())
    assert found == [
        {"cell": 2, "title": "memory", "numbers": {"saved GiB": 1.25, "blocks": 4096}, "sources": [SOURCE, MISSING]},
        # no title, no sources: kept; values conclusions() refuses (None, a list) left out, so the index shows all
        {"cell": 3, "title": "cell 3", "numbers": {"speed": 2.0}, "sources": []},
    ]
    assert key_numbers(new_notebook(cells=[new_markdown_cell("# t")])) == []


def test_site_path_and_copy_sources(tmp_path):
    assert str(site_path(SOURCE)) == SOURCE
    assert [site_path(s) for s in ("/abs/x.json", "../x.json", "a/../../x", "C:\\x.json", "", ".")] == [None] * 6
    out = tmp_path / "site"
    copied = copy_sources([SOURCE, MISSING, SOURCE, "../escape.json", "data/activations"], out)
    assert copied == {SOURCE: SOURCE, MISSING: None, "../escape.json": None, "data/activations": ""}
    assert (out / SOURCE).read_bytes() == (ROOT / SOURCE).read_bytes()
    assert [p.name for p in out.rglob("*") if p.is_file()] == [Path(SOURCE).name]
    folder = {"title": "t", "numbers": {"x": 1}, "sources": ["data/activations"]}
    page = index_html([NotebookRun(Path("a.ipynb"), "a.html", "a", 1.0, True, None, [folder], copied)], full=False,
                      seconds=1.0)
    assert "<code>data/activations</code> (a folder of the repository, not copied)" in page


def test_index_html():
    nb = _hand_built()
    numbers = key_numbers(nb)
    runs = [NotebookRun(Path("nb/01_alloc.ipynb"), "01_alloc.html", notebook_title(nb), 12.34, True, None, numbers,
                        {SOURCE: SOURCE, MISSING: None}),
            NotebookRun(Path("nb/02_<bad>.ipynb"), "02_<bad>.html", "02 & more", 3.0, False,
                        "cell 4: ZeroDivisionError: division by zero")]
    page = index_html(runs, full=False, seconds=15.5, generated="2026-12-03")
    assert page.startswith("<!DOCTYPE html>") and "smoke sizes (WORKBENCH_SMOKE=1)" in page and "15.5 s" in page
    assert '<a href="01_alloc.html">' in page and "01 · The allocator and sharing" in page
    assert '<td class="num">12.3</td>' in page and '<span class="failed">1 of 2 failed</span>' in page
    assert '<td>saved GiB</td><td class="num">1.25</td>' in page and '<td class="num">4,096</td>' in page
    assert f'<a href="{SOURCE}"><code>{SOURCE}</code></a>' in page
    assert f'<li class="missing"><code>{MISSING}</code> (missing: not copied)</li>' in page
    assert "ZeroDivisionError: division by zero" in page and "no key numbers recorded" in page
    assert "02_&lt;bad&gt;.html" in page and "02 &amp; more" in page and "<bad>" not in page  # escaped
    assert "<script" not in page and not re.search(r"(src|href)=\"https?:", page)  # nothing fetched
    assert "full sizes (WORKBENCH_SMOKE=0)" in index_html(runs[:1], full=True, seconds=1.0)


def test_cell_bar_counts_code_cells_and_remembers_the_failure():
    nb = new_notebook(cells=[new_markdown_cell("# t"), new_code_cell("x = 1"), new_code_cell("1/0")])
    bar = CellBar(nb, desc="t", enabled=False)
    hooks = bar.hooks()
    hooks["on_cell_execute"](cell=nb.cells[1], cell_index=1)
    hooks["on_cell_executed"](cell=nb.cells[1], cell_index=1, execute_reply={"content": {"status": "ok"}})
    hooks["on_cell_execute"](cell=nb.cells[2], cell_index=2)
    hooks["on_cell_executed"](cell=nb.cells[2], cell_index=2, execute_reply={"content": {"status": "error"}})
    assert (bar.total, bar.done, bar.failed_cell) == (2, 2, 2)
    bar.close()


# ---------------------------------------------------------------------------------------------- the CLI
def test_report_checks_arguments_before_running(tmp_path, capsys):
    assert main(["report", "--notebooks", str(tmp_path / "nothing-*.ipynb"), "--out", str(tmp_path)]) == 2
    assert "argument --notebooks: no notebook matches" in capsys.readouterr().err
    assert main(["report", "--notebooks", str(ROOT / "README.md"), "--out", str(tmp_path)]) == 2
    assert "argument --notebooks:" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    nb = tmp_path / "t.ipynb"
    nbformat.write(new_notebook(), nb)
    assert main(["report", "--notebooks", str(nb), "--out", str(tmp_path / "file")]) == 2
    assert "argument --out:" in capsys.readouterr().err
    assert main(["report", "--timeout", "0"]) == 2


def test_report_defaults_to_the_numbered_series_and_prints_a_summary(tmp_path, monkeypatch, capsys):
    import workbench.publish.site

    seen = {}

    def fake_build_site(paths, out, full=False, timeout=0, **_):
        seen.update(paths=[p.name for p in paths], full=full)
        runs = [NotebookRun(p, p.stem + ".html", p.stem, 1.5, i != 1, None if i != 1 else "cell 3: Boom: x")
                for i, p in enumerate(paths)]
        return Site(Path(out), Path(out) / "index.html", runs, 9.0, full)

    monkeypatch.setattr(workbench.publish.site, "build_site", fake_build_site)
    assert main(["report", "--full", "--out", str(tmp_path)]) == 1  # one "failed"
    names = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert seen == {"paths": names, "full": True} and names[0] == "00_tour.ipynb"
    out = capsys.readouterr().out
    assert f"site: {tmp_path / 'index.html'}" in out and "full sizes" in out
    assert re.search(r"00_tour\s+1\.5 s  ok", out) and "FAILED" in out and "cell 3: Boom: x" in out
    assert re.search(r"total\s+9\.0 s  1 failed: " + Path(names[1]).stem, out)


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """build_site at full sizes on two notebooks: one that concludes (its SMOKE, its kernel's cwd) and prints, one
    that fails in its second code cell. Two kernels, a few seconds."""
    folder = tmp_path_factory.mktemp("notebooks")
    conclude = new_code_cell(
        "import os\nfrom workbench.publish.notebook import SMOKE, conclusions\n"
        f"conclusions('tiny', {{'smoke': SMOKE, 'answer': 42.125, 'cwd': os.path.basename(os.getcwd())}}, "
        f"[{SOURCE!r}, {MISSING!r}])")
    nbformat.write(new_notebook(cells=[new_markdown_cell("# 90 · A tiny notebook"), conclude,
                                       new_code_cell("print('hello from cell 2')")]), folder / "90_ok.ipynb")
    nbformat.write(new_notebook(cells=[new_markdown_cell("# 91 · It fails"), new_code_cell("print('before')"),
                                       new_code_cell("1 / 0"), new_code_cell("print('never')")]),
                   folder / "91_fails.ipynb")
    before = os.environ.get(SMOKE_ENV)
    result = build_site([folder / "90_ok.ipynb", folder / "91_fails.ipynb"], tmp_path_factory.mktemp("site"),
                        full=True, progress=False, timeout=120)
    assert os.environ.get(SMOKE_ENV) == before  # restored
    return folder.name, result


def test_build_site_pages_index_and_data(site):
    folder, site = site
    ok, failed = site.runs
    assert (ok.ok, failed.ok, site.ok) == (True, False, False)
    assert ok.title == "90 · A tiny notebook" and ok.seconds > 0
    # WORKBENCH_SMOKE=0 reached the kernel (full sizes even on a CPU), which ran in the notebook's folder
    assert ok.numbers == [{"cell": 1, "title": "tiny", "numbers": {"smoke": False, "answer": 42.1, "cwd": folder},
                           "sources": [SOURCE, MISSING]}]
    assert ok.files == {SOURCE: SOURCE, MISSING: None}
    assert (site.out / SOURCE).read_bytes() == (ROOT / SOURCE).read_bytes()
    page = (site.out / "90_ok.html").read_text()
    assert "hello from cell 2" in page and "Key numbers: tiny" in page
    assert (site.out / "plotly.min.js").read_text().startswith("/**")  # one copy for every page's figures
    index = site.index.read_text()
    assert "full sizes (WORKBENCH_SMOKE=0)" in index and '<a href="90_ok.html">' in index
    assert '<td>answer</td><td class="num">42.1</td>' in index
    assert f'<a href="{SOURCE}">' in index and f"<code>{MISSING}</code> (missing: not copied)" in index


def test_build_site_failing_notebook_keeps_its_page(site):
    _, site = site
    failed = site.runs[1]
    assert failed.error == "cell 2: ZeroDivisionError: division by zero"
    page = (site.out / "91_fails.html").read_text()
    assert "before" in page and "ZeroDivisionError" in page  # what ran, the failing cell's traceback included
    index = site.index.read_text()
    assert '<span class="failed">1 of 2 failed</span>' in index and "cell 2: ZeroDivisionError" in index
