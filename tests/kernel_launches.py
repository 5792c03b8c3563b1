"""The GPU test list by a rule, not by hand (issue 30 item 2): a test that launches a Triton kernel carries the
``kernels`` marker (``pytestmark = pytest.mark.kernels`` in its file), and ``scripts/gpu_run.sh tests`` runs
``pytest -m kernels``, so on the GPU every such test runs compiled.

The rule is checked by watching: every kernel launch (interpreted here, compiled on a GPU) is counted while a test
sets up and runs (a module fixture's launches count for the first test that uses it), and an unmarked test that
launched one fails, saying what to add. ``tests/conftest.py`` installs these hooks; ``tests/test_gpu_tests.py``
checks the static half (files that import the kernels, or need CUDA, are marked).

With ``WORKBENCH_SKIP_MISSING=1`` (``scripts/gpu_run.sh`` sets it: the GPU image has torch, triton, numpy and pytest
but not every optional package) a test module that fails to import a package from outside this repository is
reported skipped, naming the package, instead of an error."""

from __future__ import annotations

import os
import re

import pytest

MARKER = "kernels"
OWN = ("workbench", "kernels", "conftest", "test_")  # modules of this repository: never skipped when missing
_LAUNCHES = [0]  # kernel launches since the session started (one process: pytest runs tests one at a time)
_START = pytest.StashKey[int]()  # the count when a test's setup began


def _count_launches() -> None:
    """Wrap ``run`` of Triton's interpreted and compiled kernels: ``kernel[grid](...)`` and autotuners call it."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for cls in (InterpretedFunction, JITFunction):
        if getattr(cls.run, "_counts_launches", False):
            continue
        orig = cls.run

        def run(self, *args, _orig=orig, **kwargs):
            if not kwargs.get("warmup"):
                _LAUNCHES[0] += 1
            return _orig(self, *args, **kwargs)

        run._counts_launches = True
        cls.run = run


def pytest_configure(config) -> None:
    _count_launches()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    item.stash[_START] = _LAUNCHES[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    missing = _missing_package(call.excinfo.value) if rep.failed and call.excinfo is not None else None
    if missing:  # a test importing an absent optional package inside its body (WORKBENCH_SKIP_MISSING)
        rep.outcome, rep.longrepr = "skipped", (str(item.path), 0, f"Skipped: needs {missing}, not installed here")
        return
    if call.when != "call" or not rep.passed or item.get_closest_marker(MARKER) is not None:
        return
    launched = _LAUNCHES[0] - item.stash.get(_START, _LAUNCHES[0])
    if launched:
        rep.outcome = "failed"
        rep.longrepr = (f"{item.nodeid} launched {launched} Triton kernel(s) but is not marked '{MARKER}': add "
                        f"`pytestmark = pytest.mark.{MARKER}` to {item.path.name} so scripts/gpu_run.sh (pytest -m "
                        f"{MARKER}) runs it on the GPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed or os.environ.get("WORKBENCH_SKIP_MISSING") != "1":
        return
    m = re.search(r"No module named '([\w.]+)'", str(rep.longrepr))
    if m and not m.group(1).startswith(OWN):
        rep.outcome = "skipped"
        rep.longrepr = (str(collector.path), 0, f"Skipped: needs {m.group(1)}, not installed here")


def _missing_package(exc: BaseException) -> str | None:
    """The absent package outside this repository that ``exc`` reports, with WORKBENCH_SKIP_MISSING=1; else None."""
    if os.environ.get("WORKBENCH_SKIP_MISSING") != "1" or not isinstance(exc, ModuleNotFoundError):
        return None
    name = exc.name or ""
    return name if name and not name.startswith(OWN) else None
