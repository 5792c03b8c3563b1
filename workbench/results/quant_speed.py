"""The quantized decode run joined with the error study: per scheme its bytes, its attention error and its measured
decode speed-up over fp16, and the schemes no other beats on all three (notebook 03's speed axis).

The error study (:mod:`workbench.quant.error_study`: ``summarize`` rows) gives each scheme's bytes per token (K+V,
scales and any fp16 residual counted, at the study's shape) and attention error against fp32; a ``bench
quant_decode`` run (``data/results/quant-decode-*.json``, one row per workload and scheme as
``workbench.ui.quant_panels.best_decode_rows`` keeps them) gives its speed-up over fp16 in the same run, its
fraction of the copy bandwidth and the bytes it read. :func:`speed_rows` joins them by scheme name; a scheme the
run did not time keeps ``None`` for its speed and is on no front. Pure functions over plain rows (no plotly).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from decimal import ROUND_HALF_UP, Decimal

SCHEME_COLUMNS = ("scheme", "bytes_per_token", "attn_err")  # what a row of the error study must hold
DECODE_COLUMNS = ("workload", "scheme", "speedup_vs_fp16")  # what a row of the decode run must hold
LESS = ("bytes_per_token", "attn_err")  # the 3-way front: fewer bytes, lower error ...
MORE = ("speedup",)  # ... and a higher measured speed-up
# Speed-ups within 2% count as equal: the spread of one kernel timed against itself in one H200 run (bf16 against
# fp16, 0.996-1.004 on W1-W5, 2026-12-05; fp16 against fp16 after a restructuring, median 0.999).
SPEED_TOLERANCE = 0.02


def _median(values: list) -> float | None:
    return float(statistics.median(values)) if values else None


def speed_rows(schemes: Sequence[Mapping], decode: Sequence[Mapping], baseline: str = "fp16",
               tolerance: float = SPEED_TOLERANCE) -> list[dict]:
    """Each scheme of ``schemes`` with its measured decode speed, and whether it is on the 3-way front.

    Args:
        schemes: one row per scheme with ``scheme``, ``bytes_per_token`` and ``attn_err`` (other columns, e.g.
            ``title`` and ``family``, are kept); the error study's ``summarize`` rows.
        decode: the run's rows, one per (``workload``, ``scheme``), with ``speedup_vs_fp16`` and optionally
            ``bw_fraction`` (of the copy bandwidth) and ``bytes_per_token`` (bytes read per token in the run);
            ``[]`` when there is no run.
        baseline: the scheme whose bytes the run's bytes are compared with (each workload's own).
        tolerance: speed-ups this close (relative) count as equal on the front (:func:`speed_front`).

    Returns:
        The rows of ``schemes`` in their order, each with: ``speedup`` (median over the run's workloads),
        ``speedup_min``, ``speedup_max``, ``bw_fraction`` (median), ``bytes_vs_fp16`` (median over workloads of
        the scheme's bytes read over the baseline's), ``bytes_limit`` (``1 / bytes_vs_fp16``: the speed-up of a
        decode that reads its bytes as fast as the baseline reads its own), ``of_limit`` (``speedup /
        bytes_limit``: how much of that limit it reaches), ``workloads`` (how many were timed)
        and ``on_front`` (:func:`speed_front`). Each is None (``workloads`` 0) for a scheme the run did not time.

    Raises:
        ValueError: a row of ``schemes`` or ``decode`` lacks a column, a scheme appears twice in ``schemes``, or a
            (workload, scheme) pair twice in ``decode``.
    """
    _check(schemes, "schemes", SCHEME_COLUMNS)
    _check(decode, "decode", DECODE_COLUMNS)
    names = [r["scheme"] for r in schemes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"schemes: one row per scheme expected, {twice} appear more than once")
    by: dict[tuple, Mapping] = {}
    for r in decode:
        key = (r["workload"], r["scheme"])
        if key in by:
            raise ValueError(f"decode: one row per (workload, scheme) expected, {key} appears twice "
                             "(best_decode_rows keeps one)")
        by[key] = r
    out = []
    for s in schemes:
        measured = [r for (_, name), r in by.items() if name == s["scheme"]]
        speeds = [float(r["speedup_vs_fp16"]) for r in measured if r["speedup_vs_fp16"] is not None]
        ratios = [float(r["bytes_per_token"]) / float(base["bytes_per_token"]) for r in measured
                  if r.get("bytes_per_token") and (base := by.get((r["workload"], baseline)))
                  and base.get("bytes_per_token")]
        ratio, speed = _median(ratios), _median(speeds)
        out.append({**s, "speedup": speed, "speedup_min": min(speeds) if speeds else None,
                    "speedup_max": max(speeds) if speeds else None,
                    "bw_fraction": _median([float(r["bw_fraction"]) for r in measured
                                            if r.get("bw_fraction") is not None]),
                    "bytes_vs_fp16": ratio, "bytes_limit": 1.0 / ratio if ratio else None,
                    "of_limit": speed * ratio if ratio and speed is not None else None,
                    "workloads": len(speeds)})
    front = {id(r) for r in speed_front(out, tolerance=tolerance)}
    return [{**r, "on_front": id(r) in front} for r in out]


def speed_front(rows: Sequence[Mapping], less: Sequence[str] = LESS, more: Sequence[str] = MORE,
                tolerance: float = SPEED_TOLERANCE) -> list[Mapping]:
    """The rows no other row dominates, sorted by ``less`` then ``more``. Another row dominates one when it is at
    least as good in every column and strictly better in one: as small or smaller in each of ``less``; in each of
    ``more`` (measured, so noisy) at least ``1 - tolerance`` times as large, and strictly better only when more
    than ``1 + tolerance`` times as large. Rows with None in any of these columns (a scheme not timed) are on no
    front and dominate nothing; rows equal in every column are all on it.

    Args:
        rows: mappings holding the columns of ``less`` and ``more``.
        less: columns where smaller is better (default: bytes per token, attention error).
        more: columns where larger is better (default: the measured speed-up); values > 0.
        tolerance: the relative difference in a ``more`` column that counts as none (0: exact comparisons).

    Raises:
        ValueError: a row lacks one of the columns, ``less`` and ``more`` are both empty, or ``tolerance`` is not
            in ``[0, 1)``.
    """
    less, more = list(less), list(more)
    if not (less or more):
        raise ValueError("speed_front: less and more name no column")
    if not 0 <= tolerance < 1:
        raise ValueError(f"speed_front: tolerance must be in [0, 1), got {tolerance!r}")
    _check(rows, "rows", (*less, *more))
    timed = [r for r in rows if all(r[c] is not None for c in (*less, *more))]

    def dominates(a: Mapping, b: Mapping) -> bool:
        as_good = (all(a[c] <= b[c] for c in less)
                   and all(a[c] >= b[c] * (1 - tolerance) for c in more))
        better = any(a[c] < b[c] for c in less) or any(a[c] > b[c] * (1 + tolerance) for c in more)
        return as_good and better

    front = [r for r in timed if not any(dominates(o, r) for o in timed if o is not r)]
    return sorted(front, key=lambda r: ([r[c] for c in less], [-r[c] for c in more]))


def run_label(decode: Sequence[Mapping]) -> str:
    """What a median of ``decode`` stands for, e.g. ``"H200, median W1-W5"`` (the GPU of its first row without
    ``NVIDIA``, its first and last workloads sorted); ``""`` without rows."""
    if not decode:
        return ""
    _check(decode, "decode", DECODE_COLUMNS)
    workloads = sorted({str(r["workload"]) for r in decode})
    span = workloads[0] if len(workloads) == 1 else f"{workloads[0]}-{workloads[-1]}"
    gpu = str(decode[0].get("gpu", "GPU")).replace("NVIDIA ", "")
    return f"{gpu}, median {span}"


def format_speed_rows(rows: Sequence[Mapping]) -> list[dict]:
    """:func:`speed_rows` as printable strings at the precision they mean: bytes whole, errors to 2 significant
    digits (a ``Bound`` as its bound), speed-ups, bandwidth fractions, limits and fractions of them to 2 decimals,
    the speed-up as ``median (min-max)``, ``-`` where the run has no number, ``*`` on the front."""

    def num(v, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    _check(rows, "rows", (*SCHEME_COLUMNS, "speedup", "speedup_min", "speedup_max", "bw_fraction", "bytes_limit",
                          "of_limit", "on_front"))
    return [{"scheme": r["scheme"], "bytes_per_token": num(r["bytes_per_token"], ".0f"),
             "attn_err": _two_digits(r["attn_err"]),
             "speedup": "-" if r["speedup"] is None else
             f"{r['speedup']:.2f} ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})",
             "bw_fraction": num(r["bw_fraction"], ".2f"), "bytes_limit": num(r["bytes_limit"], ".2f"),
             "of_limit": num(r["of_limit"], ".2f"),
             "on_front": "*" if r["on_front"] else ""} for r in rows]


def _two_digits(value) -> str:
    """An error to 2 significant digits, rounded half up from its first 3 (the digits that are the same on every
    CPU: ``workbench.publish.notebook.KEY_DIGITS``), so that float noise cannot move it across a rounding boundary
    (0.095500 and 0.095499 both show 0.096). A value with a format of its own (a ``Bound``) formats itself."""
    if type(value).__format__ is not float.__format__ or value == 0 or not math.isfinite(value):
        return format(value, "#.2g")
    three = Decimal(f"{value:.2e}")
    return format(float(three.quantize(Decimal(1).scaleb(three.adjusted() - 1), rounding=ROUND_HALF_UP)), "#.2g")


def _check(rows, name: str, columns: Sequence[str]) -> None:
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
        raise ValueError(f"{name}: a list of rows (dicts) expected, got {type(rows).__name__}")
    for i, r in enumerate(rows):
        if not isinstance(r, Mapping):
            raise ValueError(f"{name}[{i}]: a dict expected, got {type(r).__name__}")
        missing = [c for c in columns if c not in r]
        if missing:
            raise ValueError(f"{name}[{i}] lacks the columns {missing} (it has {sorted(r)})")
