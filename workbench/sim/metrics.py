"""Where KV memory goes in the serving simulator: definitions, formulas, time averages.

At every step the pool of ``budget`` token slots splits exactly into six parts (the engine checks it):

    budget = token + reservation + internal + slack + external + free

For running request ``i`` with ``c_i`` tokens stored now, final length ``F_i = prompt_i + output_i`` and
``cap_i`` slots held for it (its reservation, or its blocks times the block size):

- ``token = sum_i c_i``: token states, K/V actually stored.
- ``reservation = sum_i (min(cap_i, F_i) - c_i)``: held slots that this request will fill later.
- ``internal = sum_i max(cap_i - F_i, 0)``: internal fragmentation, held slots it will never fill:
  over-allocated contiguous space (``max_len - F_i`` for Orca Max, ``pow2(o) - o`` for Orca Pow2, 0 for
  Oracle) or the tail of the last block past ``F_i`` for paged caches.
- ``slack = sum_i (alloc_i - cap_i)``: allocator rounding, the slots the allocator hands out beyond what was
  asked (a buddy block of ``pow2ceil(cap_i)``); 0 for first-fit and for paged blocks.
- ``external``: external fragmentation, free slots that cannot serve the request at the head of the queue
  because of the allocation structure: for a contiguous allocator the free holes (buddy blocks) smaller than
  the head's reservation (0 when nobody waits); for a slab the free sub-blocks of pages carved for the small
  class; the pool's tail that no block covers (``budget mod block``).
- ``free``: the remaining free slots.

Shares are parts / budget. The vLLM paper's Figure 2 has four bars: token states, reservation, internal
fragmentation, and "external fragmentation & others" = ``slack + external + free`` (the paper charges the buddy
allocator's rounding to external fragmentation: its Oracle bar shows no internal fragmentation).

Block utilization = ``token / (token + reservation + internal)``: the stored share of held slots.

Time averages weight every decode step equally. The engine records a row at each event step; between events
every running request grows by one token, so ``token`` rises by ``batch`` per step and ``reservation`` falls
by ``batch`` while the other parts stay put, and a segment of ``L`` steps starting at value ``v`` sums to
``L v +- batch L (L - 1) / 2`` exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

PARTS = ("token", "reservation", "internal", "slack", "external", "free")
ROW_FIELDS = ("step", "batch", "waiting") + PARTS
PAPER_KEYS = ("token_states", "reservation", "internal", "external")


@dataclass(frozen=True)
class Breakdown:
    """Slots of the pool by part (floats when time-averaged); ``budget`` is the pool size."""

    token: float
    reservation: float
    internal: float
    slack: float
    external: float
    free: float
    budget: float

    def shares(self) -> dict[str, float]:
        """Each part as a fraction of the budget."""
        return {k: getattr(self, k) / self.budget for k in PARTS}

    def paper(self) -> dict[str, float]:
        """The four bars of the vLLM paper's Figure 2, in percent of the KV memory."""
        s = self.shares()
        return {"token_states": 100 * s["token"], "reservation": 100 * s["reservation"],
                "internal": 100 * s["internal"], "external": 100 * (s["slack"] + s["external"] + s["free"])}

    def bytes(self, bytes_per_token: float) -> dict[str, float]:
        return {k: v * bytes_per_token for k, v in asdict(self).items()}

    @property
    def block_utilization(self) -> float:
        held = self.token + self.reservation + self.internal
        return self.token / held if held else 1.0

    def residual(self) -> float:
        """``budget - sum(parts)``: 0 when memory is conserved."""
        return self.budget - sum(getattr(self, k) for k in PARTS)


def segment_lengths(steps: np.ndarray, end: int) -> np.ndarray:
    """Steps covered by each row: from its step to the next row's (the last one to ``end``, exclusive)."""
    return np.diff(np.append(steps, end))


def expand(rows: dict[str, np.ndarray], name: str, end: int) -> np.ndarray:
    """Per-step series ``[end]`` of one row field (token and reservation move by ``batch`` each step)."""
    lengths = segment_lengths(rows["step"], end)  # [R]
    base = np.repeat(rows[name], lengths)  # [end]
    if name not in ("token", "reservation"):
        return base
    offset = np.arange(end) - np.repeat(rows["step"], lengths)  # steps since the row, [end]
    slope = np.repeat(rows["batch"], lengths) * (1 if name == "token" else -1)
    return base + slope * offset


def time_average(rows: dict[str, np.ndarray], end: int, budget: int, saturated: bool = False) -> Breakdown:
    """Step-weighted mean of each part over ``[first step, end)``.

    Args:
        rows: event rows (``ROW_FIELDS`` -> arrays ``[R]``).
        end: one past the last simulated step.
        budget: pool size in slots.
        saturated: average only over steps where requests were waiting (memory was the limit).
    """
    lengths = segment_lengths(rows["step"], end).astype(np.float64)  # [R]
    if saturated:
        lengths = lengths * (rows["waiting"] > 0)
    total = lengths.sum()
    if total == 0:
        return Breakdown(0, 0, 0, 0, 0, float(budget), float(budget))
    tri = rows["batch"] * lengths * (lengths - 1) / 2  # growth within a segment, [R]
    out = {}
    for k in PARTS:
        s = (rows[k] * lengths).sum()
        if k == "token":
            s += tri.sum()
        elif k == "reservation":
            s -= tri.sum()
        out[k] = float(s / total)
    return Breakdown(**out, budget=float(budget))
