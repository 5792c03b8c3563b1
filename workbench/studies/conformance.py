"""The bring-your-own-kernel conformance study: notebook 09 (write your own kernel), a registered implementation's
conformance suite at one level, as ``conformance_panel`` runs it on this machine (``check_quietly``): how many
cases passed, the worst error against its tolerance, per format, and the first failure's case id and reason.

On a CPU the kernels run in the Triton interpreter (one torch thread): ``reference`` (PyTorch) checks its 32 smoke
cases in under a second, the ``starter`` kernel its 12 in about 4 s, ``ours`` its 32 in about 10 s (twice that on a
busy machine); ``pairwise`` is two to three times the cases.
"""

from __future__ import annotations

import math

from workbench import conformance
from workbench.conformance.suite import check_quietly
from workbench.studies.base import Param, Study, one_thread

# the implementations registered by default (workbench.conformance.builtin); a user's own, registered by name
# before the sweep runs (``conformance.register``), is accepted as well, in that process only: the in-process
# executor or a notebook's live panel (spawned --workers and Ray workers know the built-in ones)
BUILTIN = ("reference", "starter", "ours")


def _key(name: str) -> str:
    """A case field's value as part of a column name: ``fp8_e4m3/head`` -> ``fp8_e4m3_head``."""
    return "".join(c if c.isalnum() else "_" for c in str(name))


def conformance_point(impl: str, level: str, op: str) -> dict:
    """``conformance.suite.check_quietly(impl, level)``, the panel's check, as one row: cases passed and failed,
    the worst relative error (decode; differing bytes or codes for write and copy) and its ratio to the case's
    tolerance, the worst error per storage format, and the first failure (``""`` when every case passed). An
    implementation that does not claim ``op`` or is not registered raises ``ValueError`` naming the registered ones."""
    names = conformance.names(op)
    if impl not in names:
        raise ValueError(f"impl: no {op} implementation named {impl!r} is registered; registered: "
                         f"{', '.join(names) or 'none'}")
    with one_thread():
        report = check_quietly(impl, level=level, op=op)
    results = report.results
    n, bad = len(results), len(report.failures)
    errors = [r.error for r in results if r.error is not None and math.isfinite(r.error)]
    over = [r.error / r.tol if r.tol else r.error for r in results  # write, copy: tolerance 0, bytes that differ
            if r.error is not None and math.isfinite(r.error)]
    first = report.first_failure
    row = {"cases": n, "passed_cases": n - bad, "failed_cases": bad, "pass_rate": (n - bad) / n if n else 1.0,
           "all_passed": report.passed, "worst_error": max(errors, default=0.0),
           "worst_error_over_tol": max(over, default=0.0),
           "non_finite_cases": sum(r.error is None or not math.isfinite(r.error) for r in results),
           "raised_cases": sum(r.reason.startswith("raised ") for r in results),
           "first_failure": first.case.id if first else "", "first_failure_reason": first.reason if first else "",
           "backend": report.backend, "claims": conformance.get(impl, op).claims()}
    for fmt, (worst, cnt, nbad) in report.worst_by("kv_format").items():
        k = _key(fmt)
        row[f"cases_{k}"] = cnt
        row[f"failed_{k}"] = nbad
        row[f"worst_error_{k}"] = worst if math.isfinite(worst) else -1.0  # -1: a case of it gave no finite error
    return row


def draw(result: dict):
    """The conformance panel's figure (``conformance_figures.conformance_figure``): every case's error against its
    tolerance, grouped by ``result["color_by"]``."""
    from workbench.figures import conformance as conformance_figures  # plotly: optional, imported to draw

    return conformance_figures.conformance_figure(result["rows"], result["color_by"], result["title"])


# every column's label and unit on the panel's axes (workbench.studies.base.Column); * : a storage format
CONFORMANCE_COLUMNS = {
    "impl": ("implementation",), "level": ("level",), "op": ("op",),
    "pass_rate": ("cases passed (share)",), "cases": ("cases",), "passed_cases": ("cases passed",),
    "failed_cases": ("cases failed",), "all_passed": ("every case passed",),
    "worst_error": ("worst error (relative; write, copy: bytes that differ)",),
    "worst_error_over_tol": ("worst error / its tolerance",), "non_finite_cases": ("cases with a non-finite output",),
    "raised_cases": ("cases that raised",), "cases_*": ("cases, {}",), "failed_*": ("cases failed, {}",),
    "worst_error_*": ("worst error, {} (-1: none finite)",),
}

CONFORMANCE = Study(
    "conformance", "a registered kernel's conformance suite: cases passed and worst error against the tolerance", (
        Param("impl", "str", "reference", grid=BUILTIN,
              help=f"a registered implementation ({', '.join(BUILTIN)} by default, or your own)"),
        Param("level", "str", "smoke", choices=conformance.LEVELS, label="cases",
              help="smoke: about a dozen to 30 cases; pairwise: every pair of axis values; full: for a GPU"),
        Param("op", "str", "decode", choices=tuple(conformance.OPS), help="the panel checks decode")),
    conformance_point, notebook="09_write_your_own_kernel", panel="conformance_panel", x="impl", color="level",
    y=("pass_rate", "failed_cases", "worst_error", "worst_error_over_tol"), columns=CONFORMANCE_COLUMNS,
    controls=("level",), draw=draw)
STUDIES = (CONFORMANCE,)
