"""argparse types shared by every command line (``python -m workbench ...``): numbers that must be
positive are refused at parse time, so ``--seconds 0`` never runs; an output folder is created and checked
writable before any work, so a bad ``--out`` fails at once, not after the work."""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path


def _number(text: str, cast, ok, expected: str):
    try:
        v = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _number(text, int, lambda v: v >= 1, "an integer >= 1")


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _number(text, float, lambda v: v > 0 and math.isfinite(v), "a number > 0")


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    return _number(text, float, lambda v: v >= 0 and math.isfinite(v), "a number >= 0")


def share(text: str) -> float:
    """A number in (0, 1] (a share of something)."""
    return _number(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def positive_int_list(text: str) -> list[int]:
    """Comma-separated integers, each >= 1 (``--budgets 2048,4096``)."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return vals


def ensure_writable_dir(path: Path | str) -> Path:
    """Create ``path`` (and its parents) if needed and check a file can be written in it.

    Called before a benchmark or notebook runs, so a bad ``--out`` fails at once, not after the work.
    Raises ``ValueError`` with a one-line reason.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except FileExistsError:
        raise ValueError(f"{path} exists and is not a folder") from None
    except OSError as e:
        raise ValueError(f"cannot write to {path}: {e.strerror or e}") from None
    return path


def writable_dir(parser: argparse.ArgumentParser, path: Path | str, flag: str = "--out") -> Path:
    """:func:`ensure_writable_dir` of a command's argument: a bad folder ends the program through ``parser.error``
    (exit 2, a message naming ``flag``)."""
    try:
        return ensure_writable_dir(path)
    except ValueError as e:
        parser.error(f"argument {flag}: {e}")
