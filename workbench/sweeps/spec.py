"""What a sweep is: named parameters with types and allowed values, and one pure function per point.

A :class:`Sweep` is the terminal's form of a notebook panel: its parameters are the panel's controls, its
``point`` is the package function the panel calls, reduced to one flat row of numbers. The registry is filled
by :mod:`workbench.sweeps.catalog` on first use, so importing this module costs nothing.
"""

from __future__ import annotations

import fnmatch
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

KINDS = {"int": int, "float": float, "str": str, "bool": bool}
# a tidy row's columns beside the parameters: where a point ran (workbench.sweeps.store), no parameter's name
META_KEYS = ("seconds", "gpu", "cpu", "torch", "triton", "cuda", "python", "commit", "date", "run", "host",
             "worker_commit")
RESERVED = ("sweep", *META_KEYS)
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Param:
    """One parameter: its type (``int``/``float``/``str``/``bool``), its default, and either ``choices`` or
    bounds. ``grid`` is the range the sweep covers when no ``--grid`` names this parameter (default: the
    default alone)."""

    name: str
    kind: str
    default: Any
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    grid: tuple = ()
    help: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Param {self.name!r}: kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "default", self.check(self.default))
        object.__setattr__(self, "grid", tuple(self.check(v) for v in self.grid) or (self.default,))

    def parse(self, text: str) -> Any:
        """``text`` from the command line as this parameter's value; ``ValueError`` naming it otherwise."""
        text = text.strip()
        if self.kind == "bool":
            if text.lower() not in TRUE | FALSE:
                raise ValueError(f"{self.name}: expected true or false, got {text!r}")
            return self.check(text.lower() in TRUE)
        try:
            value = KINDS[self.kind](text)
        except ValueError:
            raise ValueError(f"{self.name}: expected {'an' if self.kind == 'int' else 'a'} {self.kind}, "
                             f"got {text!r}") from None
        return self.check(value)

    def check(self, value: Any) -> Any:
        """``value`` if this parameter allows it (ints are accepted for floats), else ``ValueError`` naming it."""
        want = KINDS[self.kind]
        if self.kind == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ValueError(f"{self.name}: expected {self.kind}, got {value!r} ({type(value).__name__})")
        if want is float and not math.isfinite(value):
            raise ValueError(f"{self.name}: expected a finite number, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name}: expected one of {', '.join(map(str, self.choices))}, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{self.name}: expected >= {self.minimum:g}, got {value!r}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{self.name}: expected <= {self.maximum:g}, got {value!r}")
        return value

    def describe(self) -> str:
        allowed = (" | ".join(map(str, self.choices)) if self.choices is not None else
                   f"{self.kind}" + (f" >= {self.minimum:g}" if self.minimum is not None else "")
                   + (f" <= {self.maximum:g}" if self.maximum is not None else ""))
        swept = f"; swept {','.join(map(str, self.grid))}" if len(self.grid) > 1 else ""
        return f"{self.name}={self.default} ({allowed}{swept})" + (f": {self.help}" if self.help else "")


@dataclass(frozen=True)
class Column:
    """How a column (a parameter or a result) reads on an axis: ``label`` in words, ``unit`` ("" for a count, a
    ratio or a share) and ``scale``, the factor from the stored value to the unit (seconds stored, ms shown: 1e3).
    A sweep's panel shows ``value * scale`` under ``title()``, so a sweep and its notebook panel agree on units."""

    label: str
    unit: str = ""
    scale: float = 1.0

    def title(self) -> str:
        return f"{self.label} ({self.unit})" if self.unit else self.label


@dataclass(frozen=True)
class Sweep:
    """A named sweep: ``point(**params) -> dict`` of numbers (one tidy row per point, the parameters are added
    by the runner). ``needs_gpu(params)`` says whether a point needs a GPU (a Ray task then asks for one);
    ``notebook`` and ``panel`` name where it is plotted; ``x``/``y``/``color`` are the panel's default axes.
    ``columns`` labels every parameter and result column (name -> :class:`Column` or ``(label, unit[, scale])``;
    a name with ``*`` matches a family of columns, ``{}`` in its label taking the matched part): what the panel
    writes on its axes instead of the column's name."""

    name: str
    description: str
    params: tuple[Param, ...]
    point: Callable[..., Mapping[str, Any]]
    notebook: str
    panel: str
    y: tuple[str, ...]
    x: str | None = None
    color: str | None = None
    needs_gpu: Callable[[Mapping[str, Any]], bool] = field(default=lambda _params: False)
    columns: Mapping[str, Column | tuple] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "columns", {k: c if isinstance(c, Column) else Column(*c)
                                             for k, c in self.columns.items()})
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"sweep {self.name!r}: parameter names repeat: {names}")
        clash = sorted(set(names) & set(RESERVED))
        if clash:
            raise ValueError(f"sweep {self.name!r}: parameters {clash} would clash with a tidy row's own columns "
                             f"({', '.join(RESERVED)})")
        for axis in (self.x, self.color):
            if axis is not None and axis not in names:
                raise ValueError(f"sweep {self.name!r}: axis {axis!r} is not a parameter ({', '.join(names)})")

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise ValueError(f"sweep {self.name!r} has no parameter {name!r}; its parameters: "
                         f"{', '.join(p.name for p in self.params)}")

    def column(self, name: str) -> Column | None:
        """The label and unit of column ``name`` (exact, else the first ``*`` pattern that matches), None if the
        sweep's table has none."""
        if name in self.columns:
            return self.columns[name]
        for pattern, c in self.columns.items():
            if "*" in pattern and fnmatch.fnmatchcase(name, pattern):
                head, _, tail = pattern.partition("*")
                part = name[len(head): len(name) - len(tail)]
                return Column(c.label.replace("{}", part), c.unit, c.scale)
        return None

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def default_grid(self) -> dict[str, tuple]:
        """The parameters the sweep varies when the command names none: the panel's main axes."""
        return {p.name: p.grid for p in self.params if len(p.grid) > 1}


_SWEEPS: dict[str, Sweep] = {}
# the catalog's modules, imported on first use (each registers its sweeps): the registry stays cheap to import
CATALOG = ("cache", "quant", "tiers", "compress", "shared_prefix", "model", "conformance", "kernels")
_loaded = False


def register(sweep: Sweep) -> Sweep:
    if sweep.name in _SWEEPS and _SWEEPS[sweep.name] is not sweep:
        raise ValueError(f"a sweep named {sweep.name!r} is already registered")
    _SWEEPS[sweep.name] = sweep
    return sweep


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in CATALOG:
            importlib.import_module(f"workbench.sweeps.catalog.{module}")


def names() -> list[str]:
    _load()
    return sorted(_SWEEPS)


def get(name: str) -> Sweep:
    _load()
    if name not in _SWEEPS:
        raise ValueError(f"unknown sweep {name!r}; choose from {', '.join(sorted(_SWEEPS))}")
    return _SWEEPS[name]


def listing(sweeps: Sequence[Sweep] | None = None) -> str:
    """``sweep --list``: every sweep, where it is plotted, and its parameters."""
    lines = []
    for s in sweeps or [get(n) for n in names()]:
        gpu = " [GPU]" if s.needs_gpu(s.defaults()) else ""
        lines.append(f"{s.name}{gpu}: {s.description} (notebook {s.notebook}, {s.panel})")
        lines.extend(f"    {p.describe()}" for p in s.params)
        lines.append(f"    plotted: {', '.join(s.y)}")
    return "\n".join(lines)
