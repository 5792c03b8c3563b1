"""Quest's page choice planned once per decode step and run per layer (FlashInfer's plan / run): the page scores and
the compacted table, their checks and launch arguments made once, the buffers the plan's own."""

from __future__ import annotations

import math

import torch

from .. import common
from ..decode.config import _num_sms
from ..launch import PlannedLaunch
from .scores import _page_scores_kernel, _scores_config
from .select import _check_select_inputs, _select_config, _select_pages_kernel
from .select_split import _split_config, _split_select_kernel, split_scratch, split_select


class QuestPlan:
    """Quest's page choice for one batch, planned once per decode step (as
    :class:`~workbench.kernels.decode.DecodePlan`), run per layer: the page scores (:func:`quest_page_scores`)
    into a scores buffer, then the compacted table (:func:`quest_select`) into the table buffers, both owned by the
    plan. Everything but ``q`` and the layer's ``bounds`` is checked and turned into launch arguments here, so
    ``run`` only compares their metadata with the plan and launches two kernels, each through a
    :class:`~workbench.kernels.launch.PlannedLaunch` (Triton's launch path once, then the compiled kernel's runner):
    no host sync, no allocation (CUDA graph capture works).

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
        select_split: the multi-program select (:mod:`.select_split`, True), the one-program one (False), or the
            rule's choice (None: :func:`~.select_split.split_select` on the batch, the table width and the GPU's
            SMs); :attr:`split` says which. select_block_s: its pages per program (default: as many programs as SMs).

    ``block_table`` / ``seq_lens`` are referenced, not copied (their contents may change between runs, as for a
    DecodePlan); after ``run`` the plan's ``block_table_out`` / ``seq_lens_out`` hold the compacted table. The
    multi-program select's scratch (histograms, tickets: zero before a launch and after it) belongs to the plan:
    runs of one plan must be ordered (one stream), which the layers of a step are.
    """

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, page_budget: int, *, page_size: int,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, q_dtype: torch.dtype, reduce: str = "sum",
                 sm_scale: float | None = None, keep_first: int = 0, keep_last: int = 0,
                 scores: torch.Tensor | None = None, out_table: torch.Tensor | None = None,
                 out_lens: torch.Tensor | None = None, block_p: int | None = None, num_warps: int = 4,
                 num_stages: int | None = None, block_w: int | None = None, select_warps: int | None = None,
                 select_radix: int = 4, select_split: bool | None = None, select_block_s: int | None = None):
        if reduce not in ("max", "sum"):
            raise ValueError(f"reduce must be 'max' or 'sum' (one page set per sequence), got {reduce!r}")
        if select_split is not None and not isinstance(select_split, bool):
            raise ValueError(f"select_split must be True, False or None (the rule's choice), got {select_split!r}")
        if select_split is False and select_block_s is not None:
            raise ValueError(f"select_block_s is the multi-program select's (select_split=True or None), got "
                             f"{select_block_s!r} with select_split=False")
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
        scores_grid, scores_ce = _scores_config(B, W, num_q_heads, hkv, D, q_dtype, page_size, reduce, block_p,
                                                num_warps, num_stages)
        num_sms = _num_sms(dev)
        split_grid, split_ce = (None, None) if select_split is False else _split_config(
            B, W, page_size, num_sms, select_block_s, block_w, None, select_warps, select_radix, prefix="select_")
        one_ce = _select_config(W, page_size, block_w, select_warps, select_radix)
        self.split = split_select(B, W, num_sms) if select_split is None else select_split
        self.scores, self.block_table_out, self.seq_lens_out = scores, out_table, out_lens
        self.device, self.q_dtype, self._q_shape, self._bounds_row = dev, q_dtype, (B, num_q_heads, D), (hkv, 2, D)
        self._launch = B > 0 and W > 0
        self._scores_grid = scores_grid
        self._scores_args = (block_table, seq_lens, scores)
        self._scores_tail = (block_table.stride(0), scores.stride(0), 0, W, hkv,
                             1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale), keep_first, keep_last)
        head = (scores, block_table, seq_lens, out_table, out_lens)
        tail = (W, k, scores.stride(0), block_table.stride(0), out_table.stride(0))
        if self.split:  # the kernel's scratch, the plan's (each launch leaves it zero for the next)
            self._select_grid, self._select_args = split_grid, (*head, *split_scratch(B, W, dev), *tail)
            kernel, select_ce = _split_select_kernel, split_ce
        else:
            self._select_grid, self._select_args = (B,), (*head, *tail)
            kernel, select_ce = _select_pages_kernel, one_ce
        # the launches the plan repeats: Triton's per-launch path once (kernels/launch.py)
        self._launches = {"scores": PlannedLaunch(_page_scores_kernel, scores_ce),
                          "select": PlannedLaunch(kernel, select_ce)}

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
            self._launches["scores"](self._scores_grid, q, bounds, bt, lens, out, q.stride(0), q.stride(1), s_b[0],
                                     s_b[1], *self._scores_tail)
        return self.scores

    def select(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The compacted ``(block_table, seq_lens)`` from the scores buffer (one launch, of the kernel
        :attr:`split` names)."""
        if self._launch:
            self._launches["select"](self._select_grid, *self._select_args)
        return self.block_table_out, self.seq_lens_out

    def run(self, q: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`score` then :meth:`select`: the compacted ``(block_table, seq_lens)`` for ``q`` over ``bounds``."""
        self.score(q, bounds)
        return self.select()
