"""Bring your own kernel: a registry of implementations per op, a conformance suite that checks any of them on the
cases our kernels pass, problems exported to files for kernels outside Python, and the starter kernel to edit.

    from workbench import conformance
    conformance.register("decode", "mine", my_fn, layouts=("nhd",), formats=("fp16",))
    report = conformance.check("mine")          # pairwise cases; level="smoke" / "full"
    print(report.summary())

``python -m workbench check <impl>`` runs the same from a shell (``--help``); docs/byo_kernel.md is the guide.
"""

from . import builtin, implementations
from .cases import LEVELS, cases_for
from .implementations import Impl, available, get, names, register, unregister
from .judge import CaseResult, run_case
from .ops import OPS
from .problems import Case
from .suite import Report, check, replay

implementations.add_loader(builtin.load)

__all__ = ["LEVELS", "OPS", "Case", "CaseResult", "Impl", "Report", "available", "cases_for", "check", "get", "names",
           "register", "replay", "run_case", "unregister"]
