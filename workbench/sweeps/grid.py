"""From ``--param k=v`` and ``--grid k=v1,v2`` to the list of points, and the key that names a point.

Every parameter is fixed by ``--param``, swept by ``--grid``, or else takes its own range (``Param.grid``:
the panel's main axes sweep over their usual values, the rest stay at their defaults). All of it is checked
before the first point runs, and each error names the argument.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from workbench.studies.base import Study


def _split(flag: str, text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise ValueError(f"{flag}: expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def parse(sweep: Study, params: Iterable[str] = (), grids: Iterable[str] = ()) -> dict[str, tuple]:
    """The value list of every parameter: ``--param`` texts give one value, ``--grid`` texts a comma list."""
    chosen: dict[str, tuple] = {}
    for flag, texts in (("--param", params), ("--grid", grids)):
        for text in texts:
            key, value = _split(flag, text)
            p = sweep.param(key)
            if key in chosen:
                raise ValueError(f"{flag} {text}: {key} is given twice")
            values = [value] if flag == "--param" else value.split(",")
            if any(not v.strip() for v in values):
                raise ValueError(f"{flag} {text}: an empty value in the list")
            parsed = tuple(p.parse(v) for v in values)
            if len(set(parsed)) != len(parsed):
                raise ValueError(f"{flag} {text}: a value repeats")
            chosen[key] = parsed
    return {p.name: chosen.get(p.name, p.grid) for p in sweep.params}


def check_values(sweep: Study, values: Mapping[str, Sequence]) -> dict[str, tuple]:
    """``values`` (name -> list) from Python: every name a parameter, every value allowed; the rest from the
    parameters' own ranges."""
    for name in values:
        sweep.param(name)
    out = {}
    for p in sweep.params:
        given = values.get(p.name, p.grid)
        given = (given,) if isinstance(given, str | int | float | bool) else tuple(given)
        if not given:
            raise ValueError(f"{p.name}: an empty list of values")
        out[p.name] = tuple(p.check(v) for v in given)
    return out


def points(values: Mapping[str, Sequence]) -> list[dict[str, Any]]:
    """Every combination, the last parameter varying fastest."""
    names = list(values)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(values[n] for n in names))]


def point_key(params: Mapping[str, Any]) -> str:
    """A point's name: its parameters as canonical JSON (sorted keys), the same on every machine."""
    return json.dumps(dict(sorted(params.items())), sort_keys=True, separators=(",", ":"))
