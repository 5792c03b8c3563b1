"""The browser test: every notebook in JupyterLab in headless Chromium (``notebook_checks`` says what is checked).

One file, so ``pytest -n 2 --dist loadfile --no-loadscope-reorder`` runs it on one worker from the start while the
other worker runs everything else: two browsers at once on 2 cores were measured slower (the halves took 250 s
each, against 320 s for the whole alone) and let a figure miss its 30 s to draw."""

import pytest
from notebook_checks import NOTEBOOKS, Notebook, check_notebook, check_tour_report_offline, lab  # noqa: F401
from page_checks import check_the_checks


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_in_browser(lab, path):  # noqa: F811
    check_notebook(lab, path)


def test_tour_report_shows_its_charts_offline(lab, tmp_path):  # noqa: F811
    """``python -m workbench tour``'s report, opened with every network request refused, draws every chart."""
    check_tour_report_offline(lab, tmp_path)


def test_the_page_checks_name_what_they_check(lab):  # noqa: F811
    """A probe notebook with a wrapped line, a clipped box, a too-wide title, an axis titled with a column's name and
    a panel left moved: each check names its case (``page_checks``)."""
    check_the_checks(lab, Notebook)
