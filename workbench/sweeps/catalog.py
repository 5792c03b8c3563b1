"""Every study the sweep command runs, by name: the studies of ``workbench.studies``, one module per notebook group
(each lists its own in ``STUDIES``), and any a caller adds with :func:`register` (a test's, a user's)."""

from __future__ import annotations

from collections.abc import Sequence

from workbench.studies import cache, compress, conformance, kernels, model, quant, shared_prefix, tiers, whatif
from workbench.studies.base import Study

MODULES = (cache, quant, tiers, compress, shared_prefix, model, conformance, kernels, whatif)
_STUDIES: dict[str, Study] = {s.name: s for module in MODULES for s in module.STUDIES}


def register(study: Study) -> Study:
    if study.name in _STUDIES and _STUDIES[study.name] is not study:
        raise ValueError(f"a sweep named {study.name!r} is already registered")
    _STUDIES[study.name] = study
    return study


def names() -> list[str]:
    return sorted(_STUDIES)


def get(name: str) -> Study:
    if name not in _STUDIES:
        raise ValueError(f"unknown sweep {name!r}; choose from {', '.join(sorted(_STUDIES))}")
    return _STUDIES[name]


def listing(studies: Sequence[Study] | None = None) -> str:
    """``sweep --list``: every sweep, where it is plotted, and its parameters."""
    lines = []
    for s in studies or [get(n) for n in names()]:
        gpu = " [GPU]" if s.needs_gpu(s.defaults()) else ""
        lines.append(f"{s.name}{gpu}: {s.description} (notebook {s.notebook}, {s.panel})")
        lines.extend(f"    {p.describe()}" for p in s.params)
        lines.append(f"    plotted: {', '.join(s.y)}")
    return "\n".join(lines)
