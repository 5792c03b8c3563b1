"""Quest page selection (Tang et al. 2024) on the paged cache.

Per page (block) the elementwise min and max of its keys bound ``q . k`` for every key of the page:
``sum_i max(q_i * min_i, q_i * max_i) >= q . k``. Decode attends only to the top-k pages by that bound.

Dense (pure torch) helpers for studies, used by ``workbench.compress.policies`` too:

- :func:`page_key_bounds` per-page min/max of a dense key sequence.
- :func:`page_upper_bounds` the Quest score of every page for a query, per head or aggregated over heads.
- :func:`quest_recall` the share of the true attention mass inside the chosen pages (per-head choice, the shared
  choice a paged cache can use, and the oracle shared choice).

On the paged cache (``PagedKVCache(..., key_bounds=True)`` keeps the bounds per block, ``kernels/quest/``):

- :func:`select_pages` the top pages of each sequence as a compacted block table and lengths (PyTorch, on device).
- :class:`QuestDecode` / :func:`quest_decode` scores -> top-k and compacted table -> the paged decode kernel.

    qd = QuestDecode(cache, seq_ids, page_budget=128)   # once per step: 128 pages of 16 = 2048 tokens
    out = qd.run(q, layer)                               # per layer: [B, Hq, D]

A page set is shared by all heads of a sequence (the block table is per sequence); the heads' bounds are summed
(``reduce="sum"``, see :class:`QuestDecode` for the recall that chose it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

REDUCES = ("max", "sum", "softmax", "none")


def page_key_bounds(k: torch.Tensor, page_size: int) -> torch.Tensor:
    """Elementwise min and max of the keys of every page.

    Args:
        k: ``[T, Hkv, D]`` keys of one sequence (any float dtype), in token order.
        page_size: tokens per page; the last page may be partial (its bounds cover only its tokens).

    Returns:
        ``[P, Hkv, 2, D]`` fp32 with ``P = ceil(T / page_size)``; ``[:, :, 0]`` the min, ``[:, :, 1]`` the max.
    """
    if k.dim() != 3:
        raise ValueError(f"k must be [T, Hkv, D], got shape {tuple(k.shape)}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    T, H, D = k.shape
    if T == 0:
        raise ValueError("k must hold at least one token")
    P = math.ceil(T / page_size)
    kf = k.float()
    pad = P * page_size - T
    # Pad with +inf for the min and -inf for the max so padding never wins.
    lo = torch.nn.functional.pad(kf, (0, 0, 0, 0, 0, pad), value=float("inf")).view(P, page_size, H, D)
    hi = torch.nn.functional.pad(kf, (0, 0, 0, 0, 0, pad), value=float("-inf")).view(P, page_size, H, D)
    return torch.stack([lo.amin(dim=1), hi.amax(dim=1)], dim=2)  # [P, H, 2, D]


def page_upper_bounds(
    q: torch.Tensor,
    bounds: torch.Tensor,
    reduce: str = "sum",
    *,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Quest score of every page: the upper bound of ``q . k`` over the page's keys.

    Args:
        q: ``[Hq, D]`` one query (one decode step), or ``[B, Hq, D]`` a batch sharing ``bounds``.
        bounds: ``[P, Hkv, 2, D]`` from :func:`page_key_bounds` (or a cache's key bounds gathered per page);
            ``Hq`` must be a multiple of ``Hkv`` (GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``).
        reduce: how the per-head bounds become one score per page (default ``"sum"``, the best shared recall on
            real activations: :class:`QuestDecode`; pages are shared by all heads of a sequence
            in a paged cache, so a selection that saves reads is one page set per sequence):
            ``"none"`` keeps ``[..., Hq, P]`` (per-head selection, for studies); ``"max"`` the max over heads;
            ``"sum"`` the sum over heads of ``sm_scale * bound``; ``"softmax"`` the sum over heads of each head's
            softmax over pages of ``sm_scale * bound`` (every head votes with weight one).
        sm_scale: softmax scale, default ``1 / sqrt(D)`` (used by ``"sum"`` and ``"softmax"``).

    Returns:
        fp32 ``[P]`` (or ``[B, P]``) for an aggregated reduce, ``[Hq, P]`` (or ``[B, Hq, P]``) for ``"none"``.
    """
    if reduce not in REDUCES:
        raise ValueError(f"reduce must be one of {REDUCES}, got {reduce!r}")
    if bounds.dim() != 4 or bounds.shape[2] != 2:
        raise ValueError(f"bounds must be [P, Hkv, 2, D], got shape {tuple(bounds.shape)}")
    squeeze = q.dim() == 2
    if squeeze:
        q = q.unsqueeze(0)
    if q.dim() != 3:
        raise ValueError(f"q must be [Hq, D] or [B, Hq, D], got shape {tuple(q.shape)}")
    B, Hq, D = q.shape
    P, Hkv, _, Db = bounds.shape
    if Db != D:
        raise ValueError(f"q head_dim {D} does not match bounds head_dim {Db}")
    if Hq % Hkv != 0:
        raise ValueError(f"q heads {Hq} must be a multiple of bounds kv heads {Hkv}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    g = Hq // Hkv
    b = bounds.float().repeat_interleave(g, dim=1)  # [P, Hq, 2, D]
    qf = q.float()[:, None]  # [B, 1, Hq, D]
    ub = torch.maximum(qf * b[None, :, :, 0], qf * b[None, :, :, 1]).sum(-1)  # [B, P, Hq]
    ub = ub.transpose(1, 2)  # [B, Hq, P]
    if reduce == "none":
        out = ub
    elif reduce == "max":
        out = ub.amax(dim=1)
    elif reduce == "sum":
        out = (ub * sm_scale).sum(dim=1)
    else:
        out = torch.softmax(ub * sm_scale, dim=-1).sum(dim=1)
    return out[0] if squeeze else out


# ---- selection ----------------------------------------------------------------------------
def _check_budget(page_budget, keep_first, keep_last) -> None:
    for name, v in (("keep_first", keep_first), ("keep_last", keep_last)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if isinstance(page_budget, bool) or not isinstance(page_budget, int) or page_budget < 1:
        raise ValueError(f"page_budget must be an int >= 1 (pages per sequence), got {page_budget!r}")
    if keep_first + keep_last > page_budget:
        raise ValueError(f"page_budget ({page_budget}) must cover keep_first + keep_last ({keep_first} + {keep_last})")


def _force(scores: torch.Tensor, n_pages: torch.Tensor, keep_first: int, keep_last: int) -> torch.Tensor:
    """Scores ``[..., P]`` with the first ``keep_first`` and last ``keep_last`` pages of each row ``+inf`` and the
    padding (pages ``>= n_pages``, broadcast over the last dim) ``-inf``; NaN counts as ``+inf`` (keep the page)."""
    cols = torch.arange(scores.shape[-1], device=scores.device)
    n = n_pages[..., None]
    valid = cols < n
    forced = valid & ((cols < keep_first) | (cols >= n - keep_last))
    s = scores.float()
    s = torch.where(s.isnan(), float("inf"), s)  # (nan_to_num would also turn +inf into the largest finite)
    return torch.where(forced, float("inf"), torch.where(valid, s, float("-inf")))


def select_pages(scores: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, page_budget: int, *,
                 page_size: int, keep_first: int = 1, keep_last: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's ``page_budget`` best pages as a compacted block table (PyTorch, on the scores' device, no
    host sync): the reference of ``workbench.kernels.quest.quest_select``, which gives the same table bit for bit.

    The choice, exactly: the ``min(page_budget, pages)`` pages of highest score among the sequence's
    ``ceil(seq_len / page_size)`` pages (the forced ones ``+inf``), equal scores going to the lower page index (a
    stable sort); NaN counts as ``+inf`` (keep the page), ``-0.0`` as ``+0.0``.

    Args:
        scores: ``[B, max_blocks]`` page scores (higher is kept first; e.g. :func:`page_upper_bounds` or
            ``workbench.kernels.quest.quest_page_scores``); entries past a sequence's pages are ignored.
        seq_lens: ``[B]`` int context lengths; block_table: ``[B, max_blocks]`` int32.
        page_budget: pages kept per sequence, the forced ones included (a sequence with fewer keeps all).
        page_size: tokens per page (the cache's block size).
        keep_first: the sink pages always kept (StreamingLLM's attention sink lives in page 0).
        keep_last: the newest pages always kept (the last, partial page holds the current token's neighbours).

    Returns:
        ``(block_table [B, min(page_budget, max_blocks)] int32, seq_lens [B] int32)``: the chosen pages' blocks in
        their original order (then padding: the sequence's first block, never read), every chosen page full but the
        sequence's last page, which keeps its partial length.
    """
    _check_budget(page_budget, keep_first, keep_last)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError(f"block_table must be a [B, max_blocks] tensor, got {getattr(block_table, 'shape', None)}")
    B, W = block_table.shape
    if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (B, W):
        raise ValueError(f"scores must be a [{B}, {W}] tensor (block_table's shape), got "
                         f"{tuple(getattr(scores, 'shape', ()))}")
    if not isinstance(seq_lens, torch.Tensor) or tuple(seq_lens.shape) != (B,):
        raise ValueError(f"seq_lens must be a [{B}] tensor, got {tuple(getattr(seq_lens, 'shape', ()))}")
    k = min(page_budget, W)
    lens = seq_lens.to(device=scores.device, dtype=torch.int64)
    n_pages = (lens + page_size - 1) // page_size  # [B]
    s = _force(scores, n_pages, keep_first, keep_last)
    s = torch.where(s == 0, 0.0, s)  # -0.0 ties with +0.0
    idx = s.sort(dim=1, descending=True, stable=True).indices[:, :k]  # [B, k] ties: the lower page first
    key = torch.where(idx < n_pages[:, None], idx, W + idx).sort(dim=1).values  # chosen pages in order, then padding
    ok = key < W
    table = block_table.to(scores.device)
    out = torch.where(ok, table.gather(1, torch.where(ok, key, 0)), table[:, :1]).to(torch.int32)
    last_len = lens - (n_pages - 1) * page_size
    has_last = (key == (n_pages - 1)[:, None]).any(1)
    new = ok.sum(1) * page_size - torch.where(has_last, page_size - last_len, 0)
    return out, torch.where(lens > 0, new, 0).to(torch.int32)


# ---- recall -------------------------------------------------------------------------------
class QuestRecall(NamedTuple):
    """Share of each query head's true attention mass inside the chosen pages, ``[Nq, Hq]`` each."""

    per_head: torch.Tensor  # every query head chooses its own pages (Quest's original, per-head selection)
    shared: torch.Tensor  # one page set per query (all heads), from the aggregated score: what a paged cache can use
    oracle: torch.Tensor  # one page set per query from the true attention mass summed over heads (the best shared)


def _top_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def quest_recall(q: torch.Tensor, k: torch.Tensor, page_size: int, page_budget: int, *, reduce: str = "sum",
                 keep_first: int = 1, keep_last: int = 1, sm_scale: float | None = None) -> QuestRecall:
    """How much attention Quest's page choice keeps, on dense data (real activations: ``workbench.model.capture``).

    Args:
        q: ``[Nq, Hq, D]`` (or ``[Hq, D]``) queries attending to all of ``k``.
        k: ``[T, Hkv, D]`` keys, token order; ``Hq`` a multiple of ``Hkv``.
        page_size: tokens per page; page_budget: pages kept (the forced ones included).
        reduce: the shared selection's aggregate over heads (:func:`page_upper_bounds`).
        keep_first, keep_last: pages always kept (as :func:`select_pages`).
        sm_scale: default ``1 / sqrt(D)``.

    Returns:
        :class:`QuestRecall`: fractions in ``[0, 1]``, all 1 when ``page_budget`` covers every page.
    """
    _check_budget(page_budget, keep_first, keep_last)
    if reduce not in REDUCES or reduce == "none":
        raise ValueError(f"reduce must be one of {tuple(r for r in REDUCES if r != 'none')}, got {reduce!r}")
    bounds = page_key_bounds(k, page_size)  # [P, Hkv, 2, D] (validates k and page_size)
    squeeze = q.dim() == 2
    q = q[None] if squeeze else q
    if q.dim() != 3 or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q must be [Nq, Hq, {k.shape[-1]}] with Hq a multiple of {k.shape[1]}, got "
                         f"{tuple(q.shape)}")
    T, Hkv, D = k.shape
    Nq, Hq, _ = q.shape
    P = bounds.shape[0]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    kk = k.float().repeat_interleave(Hq // Hkv, dim=1)  # [T, Hq, D]
    p = torch.softmax(torch.einsum("nhd,thd->nht", q.float(), kk) * sm_scale, dim=-1)  # [Nq, Hq, T]
    mass = torch.nn.functional.pad(p, (0, P * page_size - T)).view(Nq, Hq, P, page_size).sum(-1)  # [Nq, Hq, P]
    n = torch.tensor(P, device=q.device)
    kb = min(page_budget, P)
    per_head = _top_mask(_force(page_upper_bounds(q, bounds, "none", sm_scale=sm_scale), n, keep_first, keep_last), kb)
    shared = _top_mask(_force(page_upper_bounds(q, bounds, reduce, sm_scale=sm_scale), n, keep_first, keep_last), kb)
    oracle = _top_mask(_force(mass.sum(1), n, keep_first, keep_last), kb)
    out = QuestRecall((mass * per_head).sum(-1), (mass * shared[:, None]).sum(-1), (mass * oracle[:, None]).sum(-1))
    return QuestRecall(*(t[0] for t in out)) if squeeze else out


# ---- decode on the paged cache ------------------------------------------------------------
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
        from workbench.cache import PagedKVCache

        if not isinstance(cache, PagedKVCache):
            raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        if cache.k_bounds is None:
            raise ValueError("cache must be built with key_bounds=True (Quest reads its per-block key bounds)")
        if reduce not in DECODE_REDUCES:
            raise ValueError(f"reduce must be one of {DECODE_REDUCES}, got {reduce!r}")
        _check_budget(page_budget, keep_first, keep_last)
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
            from workbench.kernels import DecodePlan
            from workbench.kernels.quest import QuestPlan

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
            from workbench.kernels.quest.reference import quest_page_scores_ref

            self._check(q, layer)
            bounds = c.key_bounds(layer)
            red = "none" if self.reduce == "softmax" else self.reduce
            s = quest_page_scores_ref(q, bounds, self.full_table, self.full_lens, bs, red, self.sm_scale).float()
            if self.reduce == "softmax":
                s = _softmax_sum(s, self.sm_scale, q.shape[2])
            table, lens = select_pages(s, self.full_lens, self.full_table, self.page_budget, page_size=bs, **kw)
            self.block_table.copy_(table)
            self.seq_lens.copy_(lens)
            self.scores.copy_(_force(s, (self.full_lens.long() + bs - 1) // bs, **kw))
            return self.block_table, self.seq_lens
        sel, _ = self._kernel_plans(q, layer)
        bounds = c.key_bounds(layer)
        if self.reduce == "softmax":
            from workbench.kernels.quest import quest_page_scores

            per_head = quest_page_scores(q, bounds, self.full_table, self.full_lens, page_size=bs, reduce="none")
            n_pages = (self.full_lens.long() + bs - 1) // bs
            self.scores.copy_(_force(_softmax_sum(per_head, self.sm_scale, q.shape[2]), n_pages, **kw))
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
    from workbench.kernels.common import Q_DTYPES

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
    from workbench.cache import PagedKVCache

    if isinstance(cache, PagedKVCache) and isinstance(seq_ids, Sequence) and not isinstance(seq_ids, (str, bytes)):
        _check_q(cache, q, len(seq_ids), layer)  # before anything is built
    return QuestDecode(cache, seq_ids, page_budget, **kwargs).run(q, layer)
