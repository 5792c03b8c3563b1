"""What the notebooks share: the ``SMOKE`` switch, its sizes, plain-text summaries and the key numbers each
notebook concludes with (no plotly, no widgets).

``SMOKE`` is on under CI (nbval, ``scripts/execute_notebooks.py``) and on any machine without a GPU: the
notebooks then use the small sizes that keep their stored outputs reproducible on a CPU. ``WORKBENCH_SMOKE=1``
forces it on, ``WORKBENCH_SMOKE=0`` off (full sizes), whatever the machine: ``python -m workbench report`` sets it
for the kernels it starts.

:func:`conclusions` is what a notebook ends a section with: a few named numbers and the data files they came from,
shown as ``key: value`` lines (a table in JupyterLab) and carried in the output as
``application/vnd.workbench.key-numbers+json``, which the report's index page collects.

A checked output shows only digits that are the same on every CPU (docs/notebooks.md): a key number is carried and
shown to :data:`KEY_DIGITS` significant digits (:func:`sig`), and an error that is float rounding (a result against
its reference) as the power of ten it stays below (:class:`Bound`, ``< 1e-03``).
"""

from __future__ import annotations

import math
import numbers as _numbers
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import TypeVar

import numpy as np
import torch

from workbench.analysis.fragmentation import PARTS

T = TypeVar("T")

#: The environment variable that overrides the machine's choice: ``1`` small sizes, ``0`` full sizes.
SMOKE_ENV = "WORKBENCH_SMOKE"
#: The output mime type of :func:`conclusions` (JSON: ``{"title", "numbers", "sources"}``).
KEY_NUMBERS_MIME = "application/vnd.workbench.key-numbers+json"
ROOT = Path(__file__).resolve().parents[2]  # sources are paths relative to the repository root


def smoke_setting(environ: Mapping[str, str] | None = None, cuda: bool | None = None) -> bool:
    """Whether to use the small sizes: ``WORKBENCH_SMOKE`` (``1`` or ``0``) when set, else on under CI (``CI``
    set) or without a GPU. ``environ`` defaults to ``os.environ``, ``cuda`` to ``torch.cuda.is_available()``.
    Raises ``ValueError`` naming the variable for any other value of it."""
    environ = os.environ if environ is None else environ
    value = environ.get(SMOKE_ENV)
    if value is not None:
        if value.strip() in ("0", "1"):
            return value.strip() == "1"
        raise ValueError(f"{SMOKE_ENV} must be 1 (small sizes) or 0 (full sizes), not {value!r}")
    return "CI" in environ or not (torch.cuda.is_available() if cuda is None else cuda)


#: Small sizes: under CI or without a GPU, unless ``WORKBENCH_SMOKE`` says otherwise.
SMOKE: bool = smoke_setting()


def smoke_size(full: T, smoke: T, on: bool | None = None) -> T:
    """``smoke`` when :data:`SMOKE` (or ``on``) is set, else ``full``."""
    return smoke if (SMOKE if on is None else on) else full


def format_breakdown(b) -> str:
    """Two indented lines for a :class:`workbench.analysis.fragmentation.LiveBreakdown`: its slots by part with the
    cached, stranded and utilization figures, then the vLLM paper's bars (percent of the pool)."""
    parts = ", ".join(f"{k} {getattr(b, k)}" for k in PARTS)
    return (f"  {parts} slots | cached {b.cached}, stranded {b.stranded} | utilization {b.block_utilization:.2f}\n"
            "  paper's bars (%): " + ", ".join(f"{k} {v:.1f}" for k, v in b.paper().items()))


# ---------------------------------------------------------------------------------------------- key numbers
#: Significant digits of a key number: float noise between CPUs (~1e-7 relative) stays far below the third.
KEY_DIGITS = 3


def sig(value, digits: int = KEY_DIGITS) -> float:
    """``value`` rounded to ``digits`` significant digits, as a float (0, inf and nan as they are)."""
    value = float(value)
    if value == 0 or not math.isfinite(value):
        return value
    return float(f"{value:.{digits - 1}e}")


class Bound(float):
    """An error that is float rounding (fp16 storage, a kernel or a check against its reference), shown as the
    power of ten it stays below, ``< 1e-03``: its own digits differ between CPUs. Still a float (compare, sort, sum);
    every format spec prints the bound, so tables and f-strings downstream show the claim, not the noise. Zero
    shows ``0`` and a non-finite value as itself; a negative one is refused (errors are >= 0)."""

    def __new__(cls, value):
        value = float(value)
        if value < 0:
            raise ValueError(f"Bound: value must be an error >= 0, got {value}")
        return super().__new__(cls, value)

    @property
    def limit(self) -> float:
        """The power of ten the value stays below (the value itself when it is 0 or not finite)."""
        value = float(self)
        if value == 0 or not math.isfinite(value):
            return value
        exp = int(f"{value:.16e}".split("e")[1])  # the decimal exponent, free of log10's rounding
        limit = float(f"1e{exp + 1}")
        return limit if value < limit else float(f"1e{exp + 2}")  # a power of ten whose double is below 10**k

    def __str__(self) -> str:
        value = float(self)
        if value == 0 or not math.isfinite(value):
            return "0" if value == 0 else str(value)
        return f"< {self.limit:.0e}"

    __repr__ = __str__

    def __format__(self, spec: str) -> str:
        width = re.fullmatch(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.\d+)?[a-zA-Z%]?", spec)
        align = next((a for a in "<^" if a in spec[:2]), ">")  # right-aligned, as numbers are, unless asked
        return format(str(self), align + (width.group(1) if width else ""))


def as_bounds(rows: Iterable[Mapping], columns: Iterable[str], **where) -> list[dict]:
    """Copies of ``rows`` with ``columns`` as :class:`Bound` in each row whose ``where`` columns hold one of the
    given values (``scheme=("fp16", "bf16")``): the rows whose errors are float rounding, in a table of errors that
    are not. Raises ``ValueError`` naming a column a selected row lacks, or a ``where`` that is not a collection."""
    columns = [columns] if isinstance(columns, str) else list(columns)
    for key, values in where.items():
        if isinstance(values, str) or not isinstance(values, Iterable):
            raise ValueError(f"as_bounds: {key} must be a tuple of values, got {values!r}")
    where = {key: tuple(values) for key, values in where.items()}
    out = []
    for row in rows:
        row = dict(row)
        if all(row.get(key) in values for key, values in where.items()):
            missing = [c for c in columns if c not in row]
            if missing:
                raise ValueError(f"as_bounds: columns {missing} are not in the row {row}")
            row.update({c: Bound(row[c]) for c in columns})
        out.append(row)
    return out


def format_value(value) -> str:
    """A key number as a reader sees it: ints with thousands separators, floats to :data:`KEY_DIGITS` significant
    digits (scientific below 0.001 and from a million on), a :class:`Bound` as its bound, strings and booleans as
    they are."""
    if isinstance(value, (bool, str, Bound)):
        return str(value)
    if isinstance(value, _numbers.Integral):
        return f"{int(value):,}"
    value = sig(value)
    size = abs(value)
    if size == 0:
        return "0"
    if not math.isfinite(value):
        return str(value)
    exp = int(f"{value:e}".split("e")[1])
    if size >= 1e6 or size < 1e-3:
        return f"{value:.{KEY_DIGITS - 1}e}"
    text = f"{value:,.{max(0, KEY_DIGITS - 1 - exp)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _number(name: str, value):
    """``value`` as a plain JSON value (bool, int, float or str); ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, _numbers.Integral):
        return int(value)
    if isinstance(value, _numbers.Real):
        if not math.isfinite(value):
            raise ValueError(f"conclusions: numbers[{name!r}] must be finite, got {float(value)}")
        # carried as shown (the payload is what nbval compares): a Bound as its claim, a float to KEY_DIGITS
        return str(value) if isinstance(value, Bound) else sig(value)
    hint = " (a tensor or array: pass .item())" if hasattr(value, "item") else ""
    raise ValueError(f"conclusions: numbers[{name!r}] must be a number, str or bool, got {type(value).__name__}{hint}")


def _source(path, root: Path = ROOT) -> str:
    """``path`` as a repository-relative POSIX path: a relative one as it is, an absolute one inside the
    repository made relative; ``ValueError`` for anything else (not a path, outside the repository, ``..``)."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise ValueError(f"conclusions: sources must be paths (str), got {type(path).__name__}: {path!r}")
    p = Path(path)
    if p.is_absolute():
        try:
            p = p.resolve().relative_to(root.resolve())
        except ValueError:
            raise ValueError(f"conclusions: source {str(path)!r} is outside the repository {root}") from None
    rel = PurePosixPath(p.as_posix())
    if not str(path).strip() or str(rel) == "." or ".." in rel.parts:
        raise ValueError(f"conclusions: source {str(path)!r} must be a path relative to the repository root "
                         "(such as data/results/NAME.json), without '..'")
    return str(rel)


class Conclusions:
    """What :func:`conclusions` returns: shown as ``key: value`` lines (``text/plain``), a table
    (``text/markdown``), and carried as :data:`KEY_NUMBERS_MIME` for the report's index page."""

    def __init__(self, title: str, numbers: dict, sources: list[str]):
        self.title, self.numbers, self.sources = title, numbers, sources

    def payload(self) -> dict:
        return {"title": self.title, "numbers": dict(self.numbers), "sources": list(self.sources)}

    def text(self) -> str:
        width = max(map(len, self.numbers), default=0)
        lines = [f"Key numbers: {self.title}"]
        lines += [f"  {name + ':':<{width + 1}} {format_value(v)}" for name, v in self.numbers.items()]
        if self.sources:
            lines.append("  from: " + ", ".join(self.sources))
        return "\n".join(lines)

    def markdown(self) -> str:
        def cell(text: str) -> str:
            return text.replace("|", "\\|").replace("\n", " ")

        lines = [f"**Key numbers: {cell(self.title)}**", "", "| number | value |", "|---|--:|"]
        lines += [f"| {cell(name)} | {cell(format_value(v))} |" for name, v in self.numbers.items()]
        if self.sources:
            lines += ["", "from " + ", ".join(f"`{s}`" for s in self.sources)]
        return "\n".join(lines)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return {"text/plain": self.text(), "text/markdown": self.markdown(), KEY_NUMBERS_MIME: self.payload()}

    def __repr__(self) -> str:
        return self.text()


def conclusions(title_or_notebook: str, numbers: Mapping[str, object],
                sources: Iterable[str | os.PathLike] = ()) -> Conclusions:
    """The key numbers a notebook (or one of its sections) computed, for the reader and for the report.

    ``numbers`` maps a short name to a number, string or bool (numpy scalars become Python numbers);
    ``sources`` are the data/results files they came from, relative to the repository root
    (``data/results/NAME.json``; an absolute path inside the repository is made relative). End a cell with the
    returned object (or ``display()`` it): the notebook shows ``key: value`` lines, the report's index page
    lists them with links to copies of the files. Raises ``ValueError`` for a bad argument, naming it.
    """
    if not isinstance(title_or_notebook, str) or not title_or_notebook.strip():
        raise ValueError(f"conclusions: title_or_notebook must be a non-empty str, got {title_or_notebook!r}")
    if not isinstance(numbers, Mapping) or not numbers:
        raise ValueError(f"conclusions: numbers must be a non-empty dict of name -> value, got {numbers!r}")
    checked = {}
    for name, value in numbers.items():
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"conclusions: number names must be non-empty str, got {name!r}")
        checked[name] = _number(name, value)
    if isinstance(sources, (str, os.PathLike)):
        raise ValueError(f"conclusions: sources must be a list of paths, got one path {str(sources)!r}: "
                         "wrap it in a list")
    try:
        sources = list(sources)
    except TypeError:
        raise ValueError(f"conclusions: sources must be a list of paths, got {type(sources).__name__}") from None
    return Conclusions(title_or_notebook.strip(), checked, list(dict.fromkeys(_source(s) for s in sources)))
