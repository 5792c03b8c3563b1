"""The vLLM paper's memory saving by sharing (section 6.3, Figure 15) against ours: its figures (:data:`PAPER`), the
table of :func:`workbench.sim.forks_serving.serve` runs beside them, beam search's saving over ``p_top``
(:func:`sensitivity`, with the ``p_top`` each paper figure implies), and their text tables (``python -m workbench sim
forks``).
"""

from __future__ import annotations

from workbench.sim import traces as tr
from workbench.sim.forks import MODES, WIDTHS, check_int, check_mode, check_prob, lifetime_saving, load_trace
from workbench.sim.forks_serving import serve

# Section 6.3 of the paper, percent: (smallest, largest) saving over n / beam width 2, 4, 6. The text gives only
# the range; we read its ends as n = 2 and n = 6 (sharing grows with n). The n = 4 bars are not stated.
PAPER: dict[tuple[str, str], tuple[float, float]] = {
    ("alpaca", "parallel"): (6.1, 9.8),
    ("alpaca", "beam"): (37.6, 55.2),
    ("sharegpt", "parallel"): (16.2, 30.5),
    ("sharegpt", "beam"): (44.3, 66.3),
}
PAPER_SOURCE = (
    "Kwon et al., Efficient Memory Management for Large Language Model Serving with PagedAttention, "
    "SOSP'23 (arXiv 2309.06180), section 6.3: 'Fig. 15 plots the amount of memory saving, computed by the "
    "number of blocks we saved by sharing divided by the number of total blocks without sharing. We show "
    "6.1% - 9.8% memory saving on parallel sampling and 37.6% - 55.2% on beam search. In the same "
    "experiments with the ShareGPT dataset, we saw 16.2% - 30.5% memory saving on parallel sampling and "
    "44.3% - 66.3% on beam search.' (OPT-13B, Alpaca first)"
)


def _paper(trace_name: str, mode: str, n: int) -> float | None:
    key = next((k for k in PAPER if trace_name.startswith(k[0]) and k[1] == mode), None)
    if key is None:
        return None
    return {2: PAPER[key][0], 6: PAPER[key][1]}.get(n)


def table(
    traces: tuple[str | tr.Trace, ...] = ("alpaca", "sharegpt"),
    modes: tuple[str, ...] = MODES,
    ns: tuple[int, ...] = WIDTHS,
    *,
    requests: int | None = None,
    **kw,
) -> list[dict]:
    """Tidy rows, one per trace x mode x n: :meth:`ForkResult.summary` plus the paper's figure and the gap.

    ``paper_pct`` is the end of the paper's range that ``n`` stands for (n = 2: low end, n = 6: high end; None
    otherwise, or for a trace the paper did not run); ``gap_pp`` = ours - paper in percentage points.
    ``kw`` goes to :func:`serve`.
    """
    for m in modes:
        check_mode(m)
    for v in ns:
        check_int("n", v)
    loaded = [load_trace(trace, requests) for trace in traces]  # every argument checked before the first run
    rows = []
    for t in loaded:
        for m in modes:
            for v in ns:
                row = serve(t, m, v, **kw).summary()
                row["paper_pct"] = _paper(t.name, m, v)
                row["paper_range_pct"] = next(
                    (list(p) for k, p in PAPER.items() if t.name.startswith(k[0]) and k[1] == m), None
                )
                row["gap_pp"] = None if row["paper_pct"] is None else round(row["saving_pct"] - row["paper_pct"], 2)
                rows.append(row)
    return rows


def sensitivity(
    traces: tuple[str | tr.Trace, ...] = ("alpaca", "sharegpt"),
    ns: tuple[int, ...] = WIDTHS,
    p_tops: tuple[float, ...] = (0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
    *,
    requests: int | None = 1000,
    block_size: int = 16,
    seed: int = 0,
) -> list[dict]:
    """Beam search's saving (percent, :func:`lifetime_saving`) over ``p_top``; one row per trace x width, with the
    ``p_top`` the paper's figure implies (linear interpolation on the grid; None outside it or when not stated)."""
    p_tops = tuple(sorted(check_prob("p_tops entry", p) for p in p_tops))
    for v in ns:
        check_int("n", v)
    loaded = [load_trace(trace, requests) for trace in traces]
    rows = []
    for t in loaded:
        for v in ns:
            sav = [
                round(100 * lifetime_saving(t, "beam", v, block_size=block_size, p_top=p, seed=seed), 2) for p in p_tops
            ]
            paper = _paper(t.name, "beam", v)
            rows.append(
                {
                    "trace": t.name,
                    "n": v,
                    "p_top": list(p_tops),
                    "saving_pct": sav,
                    "paper_pct": paper,
                    "implied_p_top": _invert(p_tops, sav, paper),
                }
            )
    return rows


def _invert(xs, ys, y) -> float | None:
    if y is None:
        return None
    for i in range(len(xs) - 1):
        (x0, x1), (y0, y1) = xs[i : i + 2], ys[i : i + 2]
        if y0 != y1 and min(y0, y1) <= y <= max(y0, y1):
            return round(x0 + (y - y0) * (x1 - x0) / (y1 - y0), 3)
    return None


def format_table(rows: list[dict]) -> str:
    """A text table of :func:`table`: our saving against the paper's, blocks with / without sharing, CoW copies."""
    lines = [
        "Memory saved by sharing (vLLM paper, section 6.3 / Figure 15): blocks saved / blocks without sharing, "
        "time-averaged over the run",
        f"{'trace':<14} {'mode':<9} {'n':>2} {'ours %':>7} {'paper %':>8} {'gap pp':>7} {'saturated %':>12} "
        f"{'blocks shared / not':>20} {'CoW/req':>8} {'groups':>7} {'preempt':>8}",
    ]
    for r in rows:
        paper = "-" if r["paper_pct"] is None else f"{r['paper_pct']:.1f}"
        gap = "-" if r["gap_pp"] is None else f"{r['gap_pp']:+.1f}"
        sat = "-" if r["saving_saturated_pct"] is None else f"{r['saving_saturated_pct']:.1f}"
        blocks = f"{r['blocks_shared_mean']:.0f} / {r['blocks_unshared_mean']:.0f}"
        lines.append(
            f"{r['trace']:<14} {r['mode']:<9} {r['n']:>2} {r['saving_pct']:>7.1f} {paper:>8} {gap:>7} "
            f"{sat:>12} {blocks:>20} {r['cow_per_request']:>8.2f} {r['mean_groups']:>7.1f} "
            f"{r['preemptions']:>8}"
        )
    beams = {r["p_top"] for r in rows if r["mode"] == "beam"}
    if beams:
        lines.append(
            f"beam model: p_top = {', '.join(str(p) for p in sorted(beams))} (chance a beam slot goes to a "
            f"child of the best beam; not fitted, see --sensitivity)"
        )
    lines.append("paper: the text states only each range; its ends are read as n = 2 and n = 6, n = 4 is not stated")
    return "\n".join(lines)


def format_against_paper(rows: list[dict]) -> str:
    """Rows of :func:`table` (or a committed ``sim_forks-*.json``'s) as one short line each: the saving against
    the paper's figure for that width and the gap in points, or that the paper gives none."""
    lines = []
    for r in rows:
        given = r["paper_pct"] is not None
        paper = f"paper {r['paper_pct']:.1f}% (gap {r['gap_pp']:+.1f})" if given else "paper: not given"
        lines.append(f"{r['trace']:>14} {r['mode']:>8} n={r['n']}: saves {r['saving_pct']:5.1f}%  {paper}")
    return "\n".join(lines)


def format_sensitivity(rows: list[dict]) -> str:
    if not rows:
        return ""
    grid = rows[0]["p_top"]
    lines = [
        "beam search saving (%) over p_top (lifetime ratio, first requests of each trace)",
        f"{'trace':<14} {'width':>5} " + " ".join(f"{p:>6g}" for p in grid) + f" {'paper':>6} {'implied':>8}",
    ]
    for r in rows:
        paper = "-" if r["paper_pct"] is None else f"{r['paper_pct']:.1f}"
        imp = "-" if r["implied_p_top"] is None else f"{r['implied_p_top']:.3f}"
        lines.append(
            f"{r['trace']:<14} {r['n']:>5} " + " ".join(f"{v:>6.1f}" for v in r["saving_pct"]) + f" {paper:>6} {imp:>8}"
        )
    return "\n".join(lines)
