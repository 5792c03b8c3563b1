"""The browser test, second half: every notebook not in ``notebook_checks.FIRST_HALF`` (``notebook_checks`` says
what is checked). A module of its own, so that ``--dist loadfile`` runs it beside the first half."""

import pytest
from notebook_checks import check_notebook, half, lab  # noqa: F401  (lab: the fixture)


@pytest.mark.parametrize("path", half(first=False), ids=lambda p: p.stem)
def test_notebook_in_browser(lab, path):  # noqa: F811
    check_notebook(lab, path)
