"""``stored_outputs``: the browser test's check of a notebook's checked outputs is nbval's (``--nbval-lax``): a stored
notebook matches itself; a changed digit in a checked cell is caught and named, a timing or an address is not, streams
split differently compare equal, unchecked cells and execution counts are not compared."""

import copy
import random
from pathlib import Path

import nbformat
import pytest
import stored_outputs as so

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9]*.ipynb"))


@pytest.fixture(scope="module")
def books():
    return {p.stem: nbformat.read(p, as_version=4) for p in NOTEBOOKS}


def checked_streams(book):
    """(code cell index, cell) of the checked cells that printed a digit."""
    code = [c for c in book.cells if c.cell_type == "code"]
    return [(i, c) for i, c in enumerate(code) if so.options(c).get("check") and c.execution_count is not None
            and any(o.output_type == "stream" and any(ch.isdigit() for ch in o.text) for o in c.outputs)]


def test_every_stored_notebook_matches_itself_and_has_checked_cells(books):
    for stem, book in books.items():
        assert so.differences(book, copy.deepcopy(book)) == [], stem
        assert checked_streams(book), f"{stem}: no checked cell printed a number"


def test_a_changed_digit_is_caught_in_any_checked_cell(books):
    rng = random.Random(11)
    for stem, book in books.items():
        ran = copy.deepcopy(book)
        i, _ = rng.choice(checked_streams(book))
        cell = [c for c in ran.cells if c.cell_type == "code"][i]
        out = next(o for o in cell.outputs if o.output_type == "stream" and any(ch.isdigit() for ch in o.text))
        text = out.text
        while so.sanitize(out.text) == so.sanitize(text):  # a digit of a number, not of a timing (sanitized)
            at = rng.choice([k for k, ch in enumerate(text) if ch.isdigit()])
            out.text = text[:at] + str((int(text[at]) + rng.randint(1, 9)) % 10) + text[at + 1:]
        found = so.differences(book, ran)
        assert len(found) == 1 and found[0].startswith(f"code cell {i} (stdout) differs"), (stem, found)


def test_what_nbval_leaves_alone_is_left_alone(books):
    book = books["00_tour"]
    ran = copy.deepcopy(book)
    code = [c for c in ran.cells if c.cell_type == "code"]
    i, _ = checked_streams(book)[0]
    stream = next(o for o in code[i].outputs if o.output_type == "stream")
    cut, k, n = len(stream.text) // 2, code[i].outputs.index(stream), len(code[i].outputs)
    code[i].outputs[k:k + 1] = [nbformat.v4.new_output("stream", name="stdout", text=stream.text[:cut]),
                                nbformat.v4.new_output("stream", name="stdout", text=stream.text[cut:])]
    assert len(code[i].outputs) == n + 1  # the same text in two outputs, as a page may hold it
    for c in code:
        c.execution_count = (c.execution_count or 0) + 40 if c.execution_count else None
    unchecked = next(c for c in code if not so.options(c).get("check") and c.outputs)
    unchecked.outputs = [nbformat.v4.new_output("stream", name="stdout", text="anything")]
    assert so.differences(book, ran) == []
    assert so.sanitize("took 12.3 s at 0x7f3a9c") == so.sanitize("took 7 ms at 0x55d1")


def test_extra_fields_unrun_outputs_and_other_cells_are_reported(books):
    book = books["03_dtypes_and_quantization"]
    ran = copy.deepcopy(book)
    code = [c for c in ran.cells if c.cell_type == "code"]
    i, _ = checked_streams(book)[-1]
    code[i].outputs.append(nbformat.v4.new_output("stream", name="stderr", text="a warning\n"))
    assert so.differences(book, ran) == [f"code cell {i}: output fields ['stderr', 'stdout'], stored ['stdout']"]
    stored = copy.deepcopy(book)
    j = next(k for k, c in enumerate(c for c in stored.cells if c.cell_type == "code") if c.outputs)
    [c for c in stored.cells if c.cell_type == "code"][j].execution_count = None
    assert f"code cell {j}: unrun reference cell has outputs" in so.differences(stored, copy.deepcopy(stored))
    code[0].source += "\nx = 1"
    with pytest.raises(ValueError, match="code cells differ"):
        so.differences(book, ran)
