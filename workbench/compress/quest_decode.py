"""Quest decode on the paged cache: per step, the top pages of each sequence by their key bounds, then the paged
decode kernel over the compacted block table.

``PagedKVCache(..., key_bounds=True)`` keeps the bounds per block (``kernels/quest/``); :class:`QuestDecode` /
:func:`quest_decode` run scores -> top-k and compacted table -> the paged decode kernel. The choice is
:func:`~workbench.compress.page_selection.select_pages`' (its PyTorch reference, the same table bit for bit).

    qd = QuestDecode(cache, seq_ids, page_budget=128)   # once per step: 128 pages of 16 = 2048 tokens
    out = qd.run(q, layer)                               # per layer: [B, Hq, D]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from workbench.cache import PagedKVCache
from workbench.compress.page_selection import check_page_budget, forced_scores, select_pages
from workbench.kernels import DecodePlan
from workbench.kernels.common import Q_DTYPES
from workbench.kernels.quest import QuestPlan, quest_page_scores
from workbench.kernels.quest.reference import quest_page_scores_ref

DECODE_REDUCES = ("max", "sum", "softmax")


class QuestDecode:
    """Quest decode of one batch on a :class:`~workbench.cache.PagedKVCache` built with ``key_bounds=True``: planned
    once per step (as :class:`~workbench.kernels.decode.DecodePlan`), run per layer.

    ``run(q, layer)``: page scores from the layer's key bounds (``workbench.kernels.quest.quest_page_scores``), the
    top ``page_budget`` pages of each sequence and the compacted table (``quest_select``, one launch), then the
    existing paged decode kernel over it. On the GPU nothing reads the device from the host (the table buffers are
    the plan's, rewritten in place), so a step can be captured in a CUDA graph. With ``ops="torch"`` caches the same
    steps run in PyTorch (:func:`select_pages`, the decode reference).

    Args:
        cache: the cache (``key_bounds=True``).
        seq_ids: the batch (one block size).
        page_budget: pages attended per sequence (``page_budget * block_size`` tokens at most), forced pages included.
        reduce: how the per-query-head bounds become one score per page: ``"sum"`` (default) of
            ``sm_scale * bound``, ``"max"`` over heads, ``"softmax"`` (each head's softmax over pages, summed). On the
            captured SmolLM2-135M activations (5 prompts x 6 layers x 16 queries, 16-token pages, 3-8 of 9-18
            pages kept) ``"sum"`` keeps 0.671 / 0.751 / 0.849 / 0.910 of the attention mass at 3 / 4 / 6 / 8 pages,
            ``"softmax"`` the same within 0.0012, ``"max"`` 0.007-0.009 less; ``"sum"`` is fused in the scores kernel
            (``"softmax"`` needs every head's scores and a second pass), so it is the default.
        keep_first, keep_last: pages always kept (the attention sink, the newest tokens).
        sm_scale: default ``1 / sqrt(head_dim)``.
        **launch: :class:`~workbench.kernels.decode.DecodePlan` options (``num_splits`` and the launch keys) of the
            attend over the compacted table; by default its split heuristic, which already splits a short compacted
            context into about one wave of programs (8 seqs x 8 kv heads x 8 splits at a 2048-token budget).

    The first run for a query shape and dtype checks ``q`` and makes the kernel path's plans (a
    :class:`~workbench.kernels.quest.QuestPlan` and a DecodePlan on the table buffers); later runs only compare
    ``q``'s metadata with them and launch (scores, select, decode and its split reduce).

    After a run, ``block_table`` / ``seq_lens`` hold the compacted table and lengths it attended over, and
    ``scores`` the page scores (the kernel path).
    """

    def __init__(self, cache, seq_ids: Sequence, page_budget: int, *, reduce: str = "sum", keep_first: int = 1,
                 keep_last: int = 1, sm_scale: float | None = None, **launch):
        if not isinstance(cache, PagedKVCache):
            raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        if cache.k_bounds is None:
            raise ValueError("cache must be built with key_bounds=True (Quest reads its per-block key bounds)")
        if reduce not in DECODE_REDUCES:
            raise ValueError(f"reduce must be one of {DECODE_REDUCES}, got {reduce!r}")
        check_page_budget(page_budget, keep_first, keep_last)
        meta = cache.vllm_metadata(seq_ids)  # validates the ids (one block size)
        self.cache, self.seq_ids, self.page_budget = cache, list(seq_ids), page_budget
        self.reduce, self.keep_first, self.keep_last, self.sm_scale = reduce, keep_first, keep_last, sm_scale
        self.launch = launch
        self.page_size = bs = meta.block_size
        self.full_table, self.full_lens = meta.block_table, meta.seq_lens
        B, W = meta.block_table.shape
        self.width = k = min(page_budget, W)
        # the compacted lengths, known on the host (an upper bound where the last page is not forced)
        host = []
        for s in self.seq_ids:
            n = cache.manager.num_tokens(s)
            pages = -(-n // bs)
            host.append(n if pages <= k else (k - 1) * bs + (n - (pages - 1) * bs) if keep_last else k * bs)
        self.max_seq_len, self.mean_seq_len = max(host), sum(host) / B
        dev = cache.device
        self.block_table = torch.empty((B, k), dtype=torch.int32, device=dev)
        self.seq_lens = torch.empty((B,), dtype=torch.int32, device=dev)
        self.scores = torch.empty((B, W), dtype=torch.float32, device=dev)
        self._plans: dict = {}

    def _check(self, q: torch.Tensor, layer: int) -> None:
        _check_q(self.cache, q, len(self.seq_ids), layer)

    def _kernel_plans(self, q: torch.Tensor, layer: int):
        """``(QuestPlan, DecodePlan)`` of the kernel path for q's shape and dtype, made (and q checked) once: later
        calls check only q's metadata against the plans (and the layer, in ``cache.key_bounds``)."""
        plans = self._plans.get((q.shape, q.dtype))
        if plans is None:
            self._check(q, layer)
            c, bs = self.cache, self.page_size
            # the scores kernel's reduce; "softmax" scores come from torch (every head's bounds), then only select()
            red = "sum" if self.reduce == "softmax" else self.reduce
            sel = QuestPlan(self.full_table, self.full_lens, self.page_budget, page_size=bs, num_q_heads=q.shape[1],
                            num_kv_heads=c.num_kv_heads, head_dim=q.shape[2], q_dtype=q.dtype, reduce=red,
                            sm_scale=self.sm_scale, keep_first=self.keep_first, keep_last=self.keep_last,
                            scores=self.scores, out_table=self.block_table, out_lens=self.seq_lens)
            kw = dict(quant=c.scheme, sm_scale=self.sm_scale, **self.launch)
            if c.scheme.needs_static_scales:  # each run passes its layer's (per-layer scales)
                kw.update(zip(("k_scale", "v_scale"), c.layer_scales(layer), strict=True))
            dec = DecodePlan(self.block_table, self.seq_lens, layout=c.layout, k_cache=c.k_cache(layer, bs),
                             v_cache=c.v_cache(layer, bs), num_q_heads=q.shape[1], q_dtype=q.dtype,
                             max_seq_len=self.max_seq_len, mean_seq_len=self.mean_seq_len, validate=False, **kw)
            self._plans[(q.shape, q.dtype)] = plans = (sel, dec)
        return plans

    def select(self, q: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The compacted ``(block_table, seq_lens)`` for ``q`` ``[B, Hq, D]`` over layer ``layer`` (no decode)."""
        c, bs = self.cache, self.page_size
        kw = dict(keep_first=self.keep_first, keep_last=self.keep_last)
        if c.ops == "torch":
            self._check(q, layer)
            bounds = c.key_bounds(layer)
            red = "none" if self.reduce == "softmax" else self.reduce
            s = quest_page_scores_ref(q, bounds, self.full_table, self.full_lens, bs, red, self.sm_scale).float()
            if self.reduce == "softmax":
                s = _softmax_sum(s, self.sm_scale, q.shape[2])
            table, lens = select_pages(s, self.full_lens, self.full_table, self.page_budget, page_size=bs, **kw)
            self.block_table.copy_(table)
            self.seq_lens.copy_(lens)
            self.scores.copy_(forced_scores(s, (self.full_lens.long() + bs - 1) // bs, **kw))
            return self.block_table, self.seq_lens
        sel, _ = self._kernel_plans(q, layer)
        bounds = c.key_bounds(layer)
        if self.reduce == "softmax":
            per_head = quest_page_scores(q, bounds, self.full_table, self.full_lens, page_size=bs, reduce="none")
            n_pages = (self.full_lens.long() + bs - 1) // bs
            self.scores.copy_(forced_scores(_softmax_sum(per_head, self.sm_scale, q.shape[2]), n_pages, **kw))
            return sel.select()
        return sel.run(q, bounds)

    def run(self, q: torch.Tensor, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Quest decode attention of ``q`` ``[B, Hq, D]`` over layer ``layer`` -> ``[B, Hq, D]`` (q's dtype)."""
        table, lens = self.select(q, layer)
        c = self.cache
        if c.ops == "torch":
            o, _ = c.decode_torch(q, layer, self.page_size, table, lens, sm_scale=self.sm_scale)
            return o.to(q.dtype) if out is None else out.copy_(o)
        _, plan = self._kernel_plans(q, layer)
        k_scale, v_scale = c.layer_scales(layer)
        return plan.run(q, c.k_cache(layer, self.page_size), c.v_cache(layer, self.page_size), out, k_scale=k_scale,
                        v_scale=v_scale)


def _check_q(c, q, batch: int, layer) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] != batch or q.shape[2] != c.head_dim \
            or q.shape[1] % c.num_kv_heads or q.device != c.device or q.dtype not in Q_DTYPES:
        raise ValueError(f"q must be an fp16/bf16/fp32 [{batch}, Hq, {c.head_dim}] tensor on {c.device} with Hq a "
                         f"multiple of {c.num_kv_heads}, got {getattr(q, 'shape', type(q).__name__)} "
                         f"{getattr(q, 'dtype', '')}")
    if not c.scheme.quantized and q.dtype != c.dtype:
        raise ValueError(f"q must have the cache's dtype {c.dtype}, got {q.dtype}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < c.num_layers:
        raise ValueError(f"layer must be in [0, {c.num_layers}), got {layer!r}")


def _softmax_sum(per_head: torch.Tensor, sm_scale: float | None, head_dim: int) -> torch.Tensor:
    """``[B, Hq, P]`` per-head bounds -> ``[B, P]``: each head's softmax over its pages (padding ``-inf`` -> 0),
    summed over heads, so every head votes with weight one."""
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    return torch.softmax(per_head.float() * scale, dim=-1).nan_to_num(0.0).sum(1)


def quest_decode(cache, q: torch.Tensor, seq_ids: Sequence, layer: int, *, page_budget: int, **kwargs) -> torch.Tensor:
    """One-shot :class:`QuestDecode`: ``QuestDecode(cache, seq_ids, page_budget, **kwargs).run(q, layer)``; the page
    size is the cache's block size."""
    if isinstance(cache, PagedKVCache) and isinstance(seq_ids, Sequence) and not isinstance(seq_ids, (str, bytes)):
        _check_q(cache, q, len(seq_ids), layer)  # before anything is built
    return QuestDecode(cache, seq_ids, page_budget, **kwargs).run(q, layer)
