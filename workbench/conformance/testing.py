"""The conformance suite as pytest tests: one test per case, named by the case's id, so a failure is one line of
pytest's report and ``pytest -k`` replays it.

    # tests/test_my_kernel.py
    import mykernels  # registers "mine"
    from workbench.conformance.testing import cases_of, assert_conforms

    @cases_of("mine", level="pairwise")
    def test_mine(case):
        assert_conforms("mine", case)

pytest is imported only when these are called (it is a dev dependency, not the core's).
"""

from __future__ import annotations

import shlex

from workbench.conformance.cases import cases_for
from workbench.conformance.implementations import get
from workbench.conformance.judge import run_case
from workbench.conformance.loading import command_name
from workbench.conformance.problems import Case


def cases_of(impl: str, op: str = "decode", level: str = "pairwise"):
    """``pytest.mark.parametrize("case", ...)`` over the cases ``impl`` claims at ``level``, ids = case ids."""
    import pytest  # here: pytest is a dev dependency, present where this helper is used (a test file)

    cases = cases_for(get(impl, op), level)
    return pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])


def assert_conforms(impl: str, case: Case | str, op: str | None = None, device=None) -> float:
    """Run one case; AssertionError with the reason and the replay command if it fails. Returns the case's error."""
    case = Case.parse(case) if isinstance(case, str) else case
    found = get(impl, op or case.op)
    result = run_case(found, case, device)
    assert result.passed, (f"{case.id}: {result.reason}\n  replay: "
                           f"{case.replay().replace('<impl>', shlex.quote(command_name(found)))}")
    return result.error
