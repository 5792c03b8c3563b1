"""A study's parameters as a panel's controls: one ipywidget per parameter, chosen by its kind.

Choices of numbers are an ordered slider; a few words are toggle buttons, more a dropdown; an int or float with
bounds a slider; a bool a checkbox. ``Param.widget`` picks another form, ``Param.labels`` the words shown for some
values and ``Param.label`` the description, so that a panel and its sweep declare a parameter once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets as W

from workbench.studies.base import Param, Study

TOGGLE_MAX = 3  # words up to this many are toggle buttons, more a dropdown


def _options(values: Sequence, labels: Mapping[Any, str]) -> list:
    """The values as a widget's options: ``(text, value)`` pairs where ``labels`` names them, else the values."""
    if not labels:
        return list(values)
    return [(labels.get(v, str(v)), v) for v in values]


def control(p: Param, value: Any = None, options: Sequence | None = None,
            labels: Mapping[Any, str] | None = None) -> W.ValueWidget:
    """The control of parameter ``p`` at ``value`` (default its default); ``options``: the values offered when the
    panel offers fewer or another order than the parameter's choices; ``labels``: the words shown for the values
    (default ``p.labels``), where the panel's own words are its figures'."""
    value = p.default if value is None else p.check(value)
    description = p.label or p.name
    values = p.choices if options is None else tuple(p.check(v) for v in options)
    if p.kind == "bool":
        return W.Checkbox(value=value, description=description)
    if values is not None:
        form = p.widget or ("slider" if p.kind in ("int", "float")
                            else "toggle" if len(values) <= TOGGLE_MAX else "dropdown")
        widget = {"slider": W.SelectionSlider, "toggle": W.ToggleButtons, "dropdown": W.Dropdown}[form]
        return widget(options=_options(values, p.labels if labels is None else labels), value=value,
                      description=description)
    if p.minimum is None or p.maximum is None:
        raise ValueError(f"{p.name}: a control needs choices or both bounds")
    if p.kind == "int":
        return W.IntSlider(value=value, min=int(p.minimum), max=int(p.maximum), description=description)
    return W.FloatSlider(value=value, min=p.minimum, max=p.maximum, description=description)


def controls_for(study: Study, values: Mapping[str, Any] | None = None, options: Mapping[str, Sequence] | None = None,
             labels: Mapping[str, Mapping[Any, str]] | None = None) -> dict[str, W.ValueWidget]:
    """The panel's controls of ``study`` (``study.controls``, in that order), each at ``values[name]``, offering
    ``options[name]`` and showing ``labels[name]`` where given (:func:`control`)."""
    values, options, labels = values or {}, options or {}, labels or {}
    unknown = sorted((set(values) | set(options) | set(labels)) - set(study.controls))
    if unknown:
        raise ValueError(f"study {study.name!r}: {unknown} are not its panel's controls ({', '.join(study.controls)})")
    return {name: control(study.param(name), values.get(name), options.get(name), labels.get(name))
            for name in study.controls}
