"""What the headless panel tests do to a control, as the browser test does in the page (imported by the
``test_*_panels.py`` files; tests/ is on their import path)."""


def control_values(control) -> list:
    """Every value a control can take: a dropdown's or toggle's options (the values of (label, value) pairs), or an
    integer slider's range."""
    if hasattr(control, "options"):
        return [o[1] if isinstance(o, tuple) else o for o in control.options]
    return list(range(control.min, control.max + 1, control.step))


def next_value(control):
    """The option next to the current one (the previous at the end), as the browser test moves a slider."""
    vals = control_values(control)
    i = vals.index(control.value)
    return vals[i + 1] if i + 1 < len(vals) else vals[i - 1]
