"""Quest's page choice planned once per decode step and run per layer (FlashInfer's plan / run): the page scores and
the compacted table, their checks and launch arguments made once, the buffers the plan's own."""

from __future__ import annotations

import math

import torch

from .. import common
from .scores import _page_scores_kernel, _scores_config
from .select import _check_select_inputs, _select_config, _select_pages_kernel


class QuestPlan:
    """Quest's page choice for one batch, planned once per decode step (as
    :class:`~workbench.kernels.decode.DecodePlan`), run per layer: the page scores (:func:`quest_page_scores`)
    into a scores buffer, then the compacted table (:func:`quest_select`) into the table buffers, both owned by the
    plan. Everything but ``q`` and the layer's ``bounds`` is checked and turned into launch arguments here, so
    ``run`` only compares their metadata with the plan and launches two kernels: no host sync, no allocation (CUDA
    graph capture works).

    Args:
        block_table: ``[B, max_blocks]`` int32 (the full table); seq_lens: ``[B]`` int32.
        page_budget: pages kept per sequence, the forced ones included.
        page_size: tokens per page; num_q_heads, num_kv_heads, head_dim: the queries' and bounds' shape;
            q_dtype: the queries' dtype.
        reduce: ``"max"`` or ``"sum"`` (``quest_page_scores``; ``"none"`` has no single page set).
        sm_scale, keep_first, keep_last: as for :func:`quest_page_scores`.
        scores, out_table, out_lens: optional buffers (``[B, max_blocks]`` fp32, ``[B, k]`` / ``[B]`` int32).
        block_p, num_warps, num_stages: the scores kernel's launch overrides (:func:`quest_page_scores`).
        block_w, select_warps, select_radix: the select kernel's (pages per tile, warps, key bits a pass: 2, 4).

    ``block_table`` / ``seq_lens`` are referenced, not copied (their contents may change between runs, as for a
    DecodePlan); after ``run`` the plan's ``block_table_out`` / ``seq_lens_out`` hold the compacted table.
    """

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, page_budget: int, *, page_size: int,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, q_dtype: torch.dtype, reduce: str = "sum",
                 sm_scale: float | None = None, keep_first: int = 0, keep_last: int = 0,
                 scores: torch.Tensor | None = None, out_table: torch.Tensor | None = None,
                 out_lens: torch.Tensor | None = None, block_p: int | None = None, num_warps: int = 4,
                 num_stages: int | None = None, block_w: int | None = None, select_warps: int | None = None,
                 select_radix: int = 4):
        if reduce not in ("max", "sum"):
            raise ValueError(f"reduce must be 'max' or 'sum' (one page set per sequence), got {reduce!r}")
        B, W, k, out_table, out_lens = _check_select_inputs(block_table, seq_lens, page_budget, page_size, out_table,
                                                            out_lens)
        for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if q_dtype not in common.Q_DTYPES:
            raise ValueError(f"q_dtype must be fp16, bf16 or fp32, got {q_dtype}")
        for name, v in (("keep_first", keep_first), ("keep_last", keep_last)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        dev = block_table.device
        scores = common.output_buffer("scores", scores, (B, W), torch.float32, dev)
        D, hkv = head_dim, num_kv_heads
        self.scores, self.block_table_out, self.seq_lens_out = scores, out_table, out_lens
        self.device, self.q_dtype, self._q_shape, self._bounds_row = dev, q_dtype, (B, num_q_heads, D), (hkv, 2, D)
        self._launch = B > 0 and W > 0
        self._scores_grid, self._scores_ce = _scores_config(B, W, num_q_heads, hkv, D, q_dtype, page_size, reduce,
                                                            block_p, num_warps, num_stages)
        self._scores_args = (block_table, seq_lens, scores)
        self._scores_tail = (block_table.stride(0), scores.stride(0), 0, W, hkv,
                             1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale), keep_first, keep_last)
        self._select_args = (scores, block_table, seq_lens, out_table, out_lens, W, k, scores.stride(0),
                             block_table.stride(0), out_table.stride(0))
        self._select_ce = _select_config(W, page_size, block_w, select_warps, select_radix)

    def score(self, q: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        """The page scores of ``q`` ``[B, Hq, D]`` over one layer's ``bounds`` into ``scores`` (one launch)."""
        if not isinstance(q, torch.Tensor) or q.shape != self._q_shape or q.dtype != self.q_dtype \
                or q.device != self.device or q.stride(2) != 1:
            raise ValueError(f"q must be a {self.q_dtype} tensor of shape {self._q_shape} on {self.device} with unit "
                             f"last stride, as planned; got {common.describe(q)}")
        s_b = bounds.stride() if isinstance(bounds, torch.Tensor) and bounds.dim() == 4 else None
        if s_b is None or bounds.dtype != torch.float16 or bounds.shape[1:] != self._bounds_row \
                or bounds.device != self.device or s_b[3] != 1 or s_b[2] != self._bounds_row[2]:
            raise ValueError(f"bounds must be fp16 [num_blocks, {', '.join(map(str, self._bounds_row))}] on "
                             f"{self.device} (min, max rows contiguous); got {common.describe(bounds)}")
        if self._launch:
            bt, lens, out = self._scores_args
            _page_scores_kernel[self._scores_grid](q, bounds, bt, lens, out, q.stride(0), q.stride(1), s_b[0], s_b[1],
                                                   *self._scores_tail, **self._scores_ce)
        return self.scores

    def select(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The compacted ``(block_table, seq_lens)`` from the scores buffer (one launch)."""
        if self._launch:
            _select_pages_kernel[(self._q_shape[0],)](*self._select_args, **self._select_ce)
        return self.block_table_out, self.seq_lens_out

    def run(self, q: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`score` then :meth:`select`: the compacted ``(block_table, seq_lens)`` for ``q`` over ``bounds``."""
        self.score(q, bounds)
        return self.select()
