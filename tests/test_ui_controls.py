"""A study's parameters as a panel's controls (``workbench.ui.controls``): the widget each kind of parameter gets,
its words and values, and the panel's narrower options."""

from __future__ import annotations

import pytest

from workbench.studies import Param, Study

W = pytest.importorskip("ipywidgets")

from workbench.ui.controls import control, controls_for  # noqa: E402

STUDY = Study("_controls", "test", (
    Param("n", "int", 4, choices=(2, 4, 8), label="size"),
    Param("mode", "str", "a", choices=("a", "b"), labels={"a": "first", "b": "second"}),
    Param("name", "str", "x", choices=("w", "x", "y", "z")),
    Param("order", "str", "lo", choices=("lo", "mid", "hi"), widget="slider"),
    Param("k", "int", 3, minimum=1, maximum=10),
    Param("f", "float", 0.5, minimum=0.0, maximum=1.0),
    Param("on", "bool", True),
    Param("free", "str", "any", help="no choices, no bounds: not a control")),
    lambda **_: {}, notebook="-", panel="-", y=(), controls=("n", "mode", "name", "order", "k", "f", "on"))


def test_each_kind_gets_its_widget_with_the_parameters_words():
    c = controls_for(STUDY)
    assert list(c) == list(STUDY.controls)
    kinds = {k: type(w).__name__ for k, w in c.items()}
    assert kinds == {"n": "SelectionSlider", "mode": "ToggleButtons", "name": "Dropdown", "order": "SelectionSlider",
                     "k": "IntSlider", "f": "FloatSlider", "on": "Checkbox"}
    assert c["n"].description == "size" and c["name"].description == "name"
    assert [o for o in c["mode"].options] == [("first", "a"), ("second", "b")] and c["mode"].value == "a"
    assert (c["k"].min, c["k"].max, c["k"].value) == (1, 10, 3)
    with pytest.raises(ValueError, match="needs choices or both bounds"):
        control(STUDY.param("free"))


def test_a_panel_offers_fewer_values_and_its_own_words():
    c = controls_for(STUDY, {"k": 6, "n": 8}, options={"k": range(2, 9, 2), "name": ("z", "x")},
                     labels={"mode": {"a": "A"}})
    assert type(c["k"]).__name__ == "SelectionSlider" and list(c["k"].options) == [2, 4, 6, 8] and c["k"].value == 6
    assert list(c["name"].options) == ["z", "x"] and c["n"].value == 8
    assert list(c["mode"].options) == [("A", "a"), ("b", "b")]
    with pytest.raises(ValueError, match="expected one of"):
        controls_for(STUDY, {"n": 3})
    with pytest.raises(ValueError, match="not its panel's controls"):
        controls_for(STUDY, {"free": "x"})
