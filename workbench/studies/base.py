"""What a study is: one notebook panel and its sweep, declared once. Its parameters (types, allowed values, the
panel's controls), one pure function per point, the columns' labels and units, and the panel's figure.

A :class:`Study` is what its panel and the ``python -m workbench sweep`` command share: the panel builds its
controls from ``params`` (``workbench.ui.controls``), computes with the study's module and draws with ``draw``;
the sweep runs ``point`` over a grid of the same parameters, one flat row a point. Importing this module costs
nothing (no torch, no plotly).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

KINDS = {"int": int, "float": float, "str": str, "bool": bool}
# a tidy row's columns beside the parameters: where a point ran (workbench.sweeps.store), no parameter's name
META_KEYS = ("seconds", "gpu", "cpu", "torch", "triton", "cuda", "python", "commit", "date", "run", "host",
             "worker_commit")
RESERVED = ("sweep", *META_KEYS)
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # tokens a block: the panels' block-size choices
WIDGETS = ("", "dropdown", "toggle", "slider")  # how a panel shows a parameter ("": by its kind, workbench.ui.controls)


@dataclass(frozen=True)
class Param:
    """One parameter: its type (``int``/``float``/``str``/``bool``), its default, and either ``choices`` or
    bounds. ``grid`` is the range the sweep covers when no ``--grid`` names this parameter (default: the
    default alone). As a panel's control: ``label`` its short description (default the name), ``labels`` the
    words shown for some values (value -> text), ``widget`` a form other than its kind's (``WIDGETS``)."""

    name: str
    kind: str
    default: Any
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    grid: tuple = ()
    help: str = ""
    label: str = ""
    labels: Mapping[Any, str] = field(default_factory=dict, hash=False)
    widget: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Param {self.name!r}: kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        if self.widget not in WIDGETS:
            raise ValueError(f"Param {self.name!r}: widget must be one of {WIDGETS}, got {self.widget!r}")
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
class Study:
    """A notebook panel and its sweep. ``point(**params) -> dict``: one flat row of numbers (the parameters are
    added by the sweep's runner), a pure function of the parameters. ``needs_gpu(params)`` says whether a point
    needs a GPU (a Ray task then asks for one); ``notebook`` and ``panel`` name where it is shown; ``x``/``y``/
    ``color`` are the sweep panel's default axes. ``columns`` labels every parameter and result column (name ->
    :class:`Column` or ``(label, unit[, scale])``; a name with ``*`` matches a family of columns, ``{}`` in its label
    taking the matched part): what a plot writes on its axes instead of the column's name.

    The panel: ``controls`` are the parameters it shows as controls, in its order (the others are the panel's
    arguments), ``enabled[name](**values)`` says whether control ``name`` matters for the other values (greyed out
    when not), and ``draw(result)`` is its figure of what it computed (plotly is imported there: the core runs
    without it)."""

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
    controls: tuple[str, ...] = ()
    enabled: Mapping[str, Callable[..., bool]] = field(default_factory=dict)
    draw: Callable[..., Any] | None = None

    def __post_init__(self):
        object.__setattr__(self, "columns", {k: c if isinstance(c, Column) else Column(*c)
                                             for k, c in self.columns.items()})
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"study {self.name!r}: parameter names repeat: {names}")
        clash = sorted(set(names) & set(RESERVED))
        if clash:
            raise ValueError(f"study {self.name!r}: parameters {clash} would clash with a tidy row's own columns "
                             f"({', '.join(RESERVED)})")
        for axis in (self.x, self.color, *self.controls, *self.enabled):
            if axis is not None and axis not in names:
                raise ValueError(f"study {self.name!r}: {axis!r} is not a parameter ({', '.join(names)})")

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise ValueError(f"study {self.name!r} has no parameter {name!r}; its parameters: "
                         f"{', '.join(p.name for p in self.params)}")

    def column(self, name: str) -> Column | None:
        """The label and unit of column ``name`` (exact, else the first ``*`` pattern that matches), None if the
        study's table has none."""
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


@contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread while a point runs: the small tensors of the compression, model and conformance points
    (two threads stall each other on a shared 2-core CPU: a smoke check of ``reference`` took 0.4 s on one thread,
    6 to 10 s on two), and a row that does not depend on the caller's thread count."""
    import torch  # here: this module stays free of torch (the sweep command's listing, the registry)

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
