"""When the shared-prefix path pays: a cost model of both paths, fitted to measured times, and the selector.

Both paths are memory-bound streams of K/V with a fixed cost per step, so each is modelled as
``time = fixed + bytes / bandwidth``:

- plain paged decode: ``plain_us + plain_bytes / plain_gbs`` (every sharer reads the shared blocks);
- cascade: ``cascade_us + shared_bytes / shared_gbs + suffix_bytes / plain_gbs``, where ``shared_bytes`` counts
  a segment once per shared tile (``ceil(sharers * G / rows_per_tile)``) and ``cascade_us`` holds its extra
  launches (the query gather, the second pass, the merge). ``shared_gbs`` is lower than ``plain_gbs``: a shared
  tile does ``rows_per_tile`` query rows of math per K/V row.

The four numbers are fitted per GPU by :func:`fit` from a benchmark's measured times (``bench shared_prefix``)
and kept in ``kernels/tuning/shared_prefix.json`` with the run they came from. The selector picks the cascade
only when it is predicted faster by ``margin``, and :func:`fit` sets the margin from the same measurements:
above every predicted speedup of a measured point where the cascade lost, so the selector never picks it
where the measured map says it loses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from workbench.shared_prefix.runs import SharedRun, cut


@dataclass(frozen=True)
class Geometry:
    """What the bytes of a step depend on: heads, head_dim, block size, bytes per stored element."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    elem_bytes: float = 2.0
    rows_per_tile: int = 64

    def __post_init__(self):
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "rows_per_tile"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if not self.elem_bytes > 0:
            raise ValueError(f"elem_bytes must be > 0, got {self.elem_bytes!r}")

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def token_bytes(self) -> float:
        """K and V bytes of one token (all kv heads)."""
        return 2 * self.num_kv_heads * self.head_dim * self.elem_bytes

    def tiles(self, sharers: int) -> int:
        """Shared tiles of a segment with this many sharers: how often its blocks are read."""
        return math.ceil(sharers * self.group / self.rows_per_tile)


def step_bytes(segments, seq_lens: Sequence[int], suffix_start: Sequence[int], geo: Geometry) -> dict:
    """K/V bytes one step reads: ``{"plain", "shared", "suffix", "cascade"}`` (a segment once per tile)."""
    tb, bs = geo.token_bytes, geo.block_size
    shared = sum(geo.tiles(len(rows)) * (e - s) * bs for s, e, rows in segments) * tb
    suffix = sum(max(0, n - s * bs) for n, s in zip(seq_lens, suffix_start, strict=True)) * tb
    return {"plain": sum(seq_lens) * tb, "shared": shared, "suffix": suffix, "cascade": shared + suffix}


@dataclass(frozen=True)
class CostModel:
    """See the module docstring. Times in microseconds, bandwidths in GB/s."""

    plain_us: float
    plain_gbs: float
    cascade_us: float
    shared_gbs: float
    margin: float = 1.1
    source: str = "unmeasured defaults"

    def plain(self, b: dict) -> float:
        return self.plain_us + b["plain"] / (self.plain_gbs * 1e3)

    def cascade(self, b: dict) -> float:
        return self.cascade_us + b["shared"] / (self.shared_gbs * 1e3) + b["suffix"] / (self.plain_gbs * 1e3)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Choice:
    """The selector's decision for one batch: ``path`` ("shared" or "plain"), the cut it would use, the bytes and
    predicted times of both paths."""

    path: str
    segments: list
    suffix_start: list[int]
    bytes: dict
    plain_us: float
    cascade_us: float

    @property
    def predicted_speedup(self) -> float:
        return self.plain_us / self.cascade_us if self.cascade_us > 0 else 1.0


def choose(runs: Sequence[SharedRun], seq_lens: Sequence[int], geo: Geometry, model: CostModel,
           path: str = "auto") -> Choice:
    """Pick the runs worth reading once (those whose blocks cost less as shared tiles than read by every sharer),
    then the path: the cascade when predicted faster by ``model.margin`` (``path="auto"``), or as forced."""
    if path not in ("auto", "shared", "plain"):
        raise ValueError(f"path must be 'auto', 'shared' or 'plain', got {path!r}")
    lens = list(seq_lens)
    per_block = geo.token_bytes * geo.block_size / 1e3
    chosen = [i for i, r in enumerate(runs)
              if r.sharers * per_block / model.plain_gbs > geo.tiles(r.sharers) * per_block / model.shared_gbs]
    if path == "shared" and not chosen:
        chosen = list(range(len(runs)))
    segments, suffix = cut(runs, chosen, len(lens))
    b = step_bytes(segments, lens, suffix, geo)
    t_plain, t_casc = model.plain(b), model.cascade(b)
    if path == "auto":
        path = "shared" if segments and t_plain > model.margin * t_casc else "plain"
    return Choice(path, segments, suffix, b, t_plain, t_casc)


def fit(rows: Sequence[dict]) -> CostModel:
    """A :class:`CostModel` from measured rows, each ``{"plain_bytes", "shared_bytes", "suffix_bytes", "plain_us",
    "cascade_us"}`` (one batch measured both ways): least squares for ``plain_us = a + bytes / bw`` on the plain
    times, then for the cascade's fixed cost and shared bandwidth given the suffix read at the plain bandwidth;
    the margin is set above the predicted speedup of every row where the cascade was measured slower."""
    if len(rows) < 2:
        raise ValueError(f"rows must hold at least 2 measured batches, got {len(rows)}")
    a_p, inv_p = _line([(r["plain_bytes"], r["plain_us"]) for r in rows])
    plain_gbs = 1 / max(inv_p, 1e-9) / 1e3
    rest = [(r["shared_bytes"], r["cascade_us"] - r["suffix_bytes"] / (plain_gbs * 1e3)) for r in rows]
    a_c, inv_s = _line(rest)
    model = CostModel(max(a_p, 0.0), plain_gbs, max(a_c, 0.0), 1 / max(inv_s, 1e-9) / 1e3, 1.0, "fit")
    worst = 1.0
    for r in rows:
        b = {"plain": r["plain_bytes"], "shared": r["shared_bytes"], "suffix": r["suffix_bytes"]}
        if r["cascade_us"] >= r["plain_us"]:  # measured: the cascade lost here
            worst = max(worst, model.plain(b) / model.cascade(b))
    return CostModel(model.plain_us, model.plain_gbs, model.cascade_us, model.shared_gbs, round(worst * 1.05, 3), "fit")


def _line(points) -> tuple[float, float]:
    """``y = a + b x`` minimising the squared *relative* error (weights ``1 / y**2``: the small batches, where the
    two paths cross, count as much as the large ones), the intercept clamped at 0 (refit through the origin)."""
    pts = [(x, y, 1 / y**2) for x, y in points if y > 0]
    sw = sum(w for _, _, w in pts)
    sx = sum(w * x for x, _, w in pts)
    sy = sum(w * y for _, y, w in pts)
    sxx = sum(w * x * x for x, _, w in pts)
    sxy = sum(w * x * y for x, y, w in pts)
    den = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / den if den else (sy / sx if sx else 0.0)
    a = (sy - b * sx) / sw if sw else 0.0
    if a < 0:
        a, b = 0.0, (sxy / sxx if sxx else 0.0)
    return a, b
