"""Every notebook of the series keeps one shape: a title and the question it answers, a parameters cell, its panels
(each sweep it plots through ``sweep_panel``), and a conclusions cell that quotes numbers it computed. Read from the
stored notebooks, nothing executed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from workbench import sweeps
from workbench.publish.notebook import KEY_DIGITS, KEY_NUMBERS_MIME, sig

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.fixture(scope="module", params=NOTEBOOKS, ids=lambda p: p.stem)
def nb(request):
    return request.param.stem, nbformat.read(request.param, as_version=4)


def code(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_title_and_question(nb):
    stem, book = nb
    first = book.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith(f"# {stem[:2]} · ")
    assert re.search(r"\*\*[^*]+\?\*\*", first.source), "the first cell states its question in bold, ending in '?'"


def test_one_parameters_cell_of_plain_assignments(nb):
    _, book = nb
    cells = [c for c in code(book) if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1
    body = ast.parse(cells[0].source).body
    assert body and all(isinstance(s, ast.Assign | ast.AnnAssign) for s in body), "assignments only"
    assert code(book).index(cells[0]) <= 2, "near the top, after the imports"


def test_every_sweep_of_the_notebook_has_its_panel(nb):
    stem, book = nb
    mine = {name for name in sweeps.names() if sweeps.get(name).notebook == stem}
    shown = set(re.findall(r"sweep_panel\(\"([a-z_]+)\"", "\n".join(c.source for c in code(book))))
    assert mine and mine <= shown, f"sweeps of {stem} without a panel: {sorted(mine - shown)}"


def test_it_ends_with_conclusions_that_were_computed(nb):
    stem, book = nb
    cells = [c for c in code(book) if "conclusions(" in c.source]
    assert cells, "a conclusions(...) cell"
    payloads = [o["data"][KEY_NUMBERS_MIME] for o in cells[-1].outputs if KEY_NUMBERS_MIME in o.get("data", {})]
    assert len(payloads) == 1 and len(payloads[0]["numbers"]) >= 4, "the stored output carries its key numbers"
    for source in payloads[0]["sources"]:
        assert (ROOT / source).exists(), f"{stem} cites {source}, which is not in the repository"
    assert code(book).index(cells[-1]) >= len(code(book)) - 2, "the conclusions close the notebook"


def test_key_numbers_carry_only_stable_digits(nb):
    """A key number is carried as it is shown (``workbench.publish.notebook.sig``, ``Bound``): the payload nbval
    compares holds no float noise (docs/notebooks.md)."""
    stem, book = nb
    for cell in code(book):
        for output in cell.outputs:
            for name, value in output.get("data", {}).get(KEY_NUMBERS_MIME, {}).get("numbers", {}).items():
                assert not isinstance(value, float) or sig(value) == value, (
                    f"{stem}: key number {name!r} = {value!r} carries more than {KEY_DIGITS} significant digits")


def test_checked_outputs_print_no_float_repr(nb):
    """No checked output prints a float's full repr (more than 6 significant digits): its last digits are noise."""
    stem, book = nb
    for i, cell in enumerate(code(book)):
        if "NBVAL_CHECK_OUTPUT" not in cell.source:
            continue
        for output in cell.outputs:
            texts = [output.text] if output.output_type == "stream" else [
                v for k, v in output.get("data", {}).items() if isinstance(v, str) and k.startswith("text/")]
            for text in texts:
                for m in re.finditer(r"(?<![\w.])\d*\.\d+", text):
                    assert len(m.group().replace(".", "").lstrip("0")) <= 6, (
                        f"{stem} code cell {i} prints {m.group()} ({text[max(0, m.start() - 40):m.end()]!r})")
