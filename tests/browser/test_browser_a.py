"""The browser test, first half: the notebooks of ``notebook_checks.FIRST_HALF`` and the tour's offline report
(``notebook_checks`` says what is checked)."""

import pytest
from notebook_checks import check_notebook, check_tour_report_offline, half, lab  # noqa: F401  (lab: the fixture)


@pytest.mark.parametrize("path", half(first=True), ids=lambda p: p.stem)
def test_notebook_in_browser(lab, path):  # noqa: F811
    check_notebook(lab, path)


def test_tour_report_shows_its_charts_offline(lab, tmp_path):  # noqa: F811
    """``python -m workbench tour``'s report, opened with every network request refused, draws every chart."""
    check_tour_report_offline(lab, tmp_path)
