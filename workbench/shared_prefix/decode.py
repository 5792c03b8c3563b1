"""Decode of a batch that may share prefixes: find the shared runs, let the cost model choose, plan the winner.

    dec = SharedPrefixDecode(block_table, seq_lens, layout="nhd", k_cache=k, v_cache=v, num_q_heads=32,
                             q_dtype=torch.float16)          # path "auto": plain decode unless the cascade wins
    dec.path, dec.choice.predicted_speedup                   # what was chosen and why
    out = dec.run(q, k, v)                                   # per layer, as DecodePlan.run

The shared runs come from :func:`~workbench.shared_prefix.runs.find_shared_runs` (exact, from the tables), the
decision from :func:`~workbench.shared_prefix.cost.choose` with this GPU's fitted model
(``kernels/tuning/shared_prefix.json``), the plan is :class:`~workbench.kernels.CascadePlan` or
:class:`~workbench.kernels.DecodePlan`.
"""

from __future__ import annotations

import functools

import torch

from workbench.core.layout import Layout
from workbench.kernels import CascadePlan, DecodePlan, common
from workbench.kernels.decode import checks
from workbench.kernels.decode.plan import _values_head_dim
from workbench.shared_prefix.cost import CostModel, Geometry, choose
from workbench.shared_prefix.runs import find_shared_runs


@functools.cache
def cost_model(gpu: str | None = None, mode: str = "graph") -> CostModel:
    """This GPU's fitted cost model (``kernels/tuning/shared_prefix.json``; the file's default GPU if unmeasured):
    ``mode="graph"`` fitted on CUDA-graph replays (how serving engines run decode steps), ``"eager"`` on steps
    launched from Python, where the cascade's extra launches cost far more."""
    if mode not in ("graph", "eager"):
        raise ValueError(f"mode must be 'graph' or 'eager', got {mode!r}")
    name, entries = common.tuning_table("shared_prefix", gpu)
    entries = entries.get("eager", entries) if mode == "eager" else entries
    return CostModel(**{k: entries[k] for k in ("plain_us", "plain_gbs", "cascade_us", "shared_gbs", "margin")},
                     source=f"{name} ({mode})")


def rows_per_tile_default(gpu: str | None = None) -> int:
    return int(common.tuning_table("shared_prefix", gpu)[1]["rows_per_tile"])


def random_batch(tables, lens, block_size: int, num_kv_heads: int, num_q_heads: int, head_dim: int, *,
                 seed: int = 0, dtype: torch.dtype = torch.float16):
    """A small random paged batch on the CPU to check a plan against the reference: ``(q [B, Hq, D], k, v
    [max block + 1, block_size, Hkv, D] (NHD), table [B, max blocks] int32 (short rows padded with block 0),
    seq_lens [B] int32)``; K, V then q drawn from one generator seeded ``seed``, in ``dtype``."""
    rows = [list(t) for t in tables]
    if len(rows) != len(lens) or not rows or not all(rows):
        raise ValueError(f"tables and lens must be non-empty, one table per length, got {len(rows)} and {len(lens)}")
    g = torch.Generator().manual_seed(seed)
    pages = max(max(r) for r in rows) + 1
    k = torch.randn(pages, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(pages, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(rows), num_q_heads, head_dim, generator=g).to(dtype)
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    return q, k, v, table, torch.tensor(list(lens), dtype=torch.int32)


class SharedPrefixDecode:
    """See the module docstring.

    Args:
        block_table, seq_lens: the batch, as for :class:`~workbench.kernels.DecodePlan` (on the caches' device;
            read to the host once to find the shared runs).
        ref_counts: optional holders per physical block (the allocator's), to look only at blocks held twice.
        path: ``"auto"`` (the cost model decides), ``"shared"`` (the cascade whenever anything is shared) or
            ``"plain"``.
        model: a :class:`CostModel` (default: this GPU's fitted one for CUDA-graph replay; ``cost_model(mode="eager")``
            for steps launched one by one).
        rows_per_tile: the cascade's shared tile (default: this GPU's tuned one).
        **kwargs: :class:`~workbench.kernels.DecodePlan`'s (layout, caches, heads, dtype, scales, launch options).
    """

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, *, layout: Layout | str,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, q_dtype: torch.dtype,
                 ref_counts=None, path: str = "auto", model: CostModel | None = None, rows_per_tile: int | None = None,
                 **kwargs) -> None:
        if path not in ("auto", "shared", "plain"):
            raise ValueError(f"path must be 'auto', 'shared' or 'plain', got {path!r}")
        layout = Layout.parse(layout)
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise ValueError(f"block_table must be a [B, max_blocks] int32 tensor, got {type(block_table).__name__}")
        if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < 1:
            raise ValueError(f"num_q_heads must be an int >= 1, got {num_q_heads!r}")
        hkv, block_size = checks._check_batch(k_cache, v_cache, layout, block_table, seq_lens, block_table.shape[0],
                                              num_q_heads, q_dtype, block_table.device)
        lens = seq_lens.tolist()
        on_gpu = block_table.device.type == "cuda"
        tile = rows_per_tile or (rows_per_tile_default() if on_gpu else 16)
        head_dim = _values_head_dim(k_cache, v_cache, layout, q_dtype, block_table.device, kwargs.get("quant"))
        geo = Geometry(num_q_heads, hkv, head_dim, block_size, float(k_cache.element_size()), tile)
        runs = find_shared_runs(block_table, lens, block_size, ref_counts=ref_counts)
        self.runs = runs
        self.choice = choose(runs, lens, geo, model or cost_model(), path)
        self.path = self.choice.path
        kw = dict(layout=layout, k_cache=k_cache, v_cache=v_cache, num_q_heads=num_q_heads, q_dtype=q_dtype, **kwargs)
        if self.path == "shared":
            self.plan = CascadePlan(block_table, seq_lens, self.choice.segments, self.choice.suffix_start,
                                    rows_per_tile=tile, **kw)
        else:
            self.plan = DecodePlan(block_table, seq_lens, max_seq_len=max(lens, default=0), **kw)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None = None, *,
            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
        """Decode attention of one layer, by the chosen path (``[B, Hq, D]``); ``k_scale``, ``v_scale``: the layer's
        own static scales (:meth:`~workbench.kernels.DecodePlan.run`)."""
        return self.plan.run(q, k_cache, v_cache, out=out, k_scale=k_scale, v_scale=v_scale)

    def __repr__(self) -> str:
        c = self.choice
        return (f"SharedPrefixDecode(path={self.path!r}, runs={len(self.runs)}, segments={len(c.segments)}, "
                f"predicted {c.predicted_speedup:.2f}x, bytes {c.bytes['cascade'] / 1e6:.1f} / "
                f"{c.bytes['plain'] / 1e6:.1f} MB)")
