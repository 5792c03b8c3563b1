"""Figure titles that fit: a plotly title does not wrap by itself, and a line wider than its figure is cut off."""

from __future__ import annotations

import textwrap

# characters of a title line (14 px, ~9.2 px a character) and of a line under it (<sup>) that fit a figure of
# ~850 px (a panel at 1280 px) beside its left margin
TITLE_CHARS, SUB_CHARS = 80, 120


def wrap(text: str, chars: int) -> str:
    """Plain ``text`` broken at word boundaries into lines of at most ``chars`` characters, joined by ``<br>``: a
    plotly title does not wrap by itself, and a line wider than its figure is cut off at the edge."""
    return "<br>".join(textwrap.wrap(text, chars, break_long_words=False, break_on_hyphens=False)) if text else ""


def setup_title(setup, margin_t: int, height: int) -> dict:
    """``setup["title"]`` over ``setup["subtitle"]`` (lines split at ``<br>``) as one title, each line wrapped to fit
    the figure, with the top margin and height grown by the lines wrapping added: ``fig.update_layout(**...)``."""
    head = wrap(setup["title"], TITLE_CHARS)
    lines = setup.get("subtitle", "").split("<br>")
    sub = "<br>".join(wrap(line, SUB_CHARS) for line in lines)
    extra = head.count("<br>") + sub.count("<br>") - (len(lines) - 1)
    return {"title": head + (f"<br><sup>{sub}</sup>" if sub else ""), "margin_t": margin_t + 20 * extra,
            "height": height + 20 * extra}
