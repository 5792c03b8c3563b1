"""Quest page selection (Tang et al. 2024): which pages (blocks) of a sequence a decode step reads, in PyTorch.

Per page the elementwise min and max of its keys bound ``q . k`` for every key of the page:
``sum_i max(q_i * min_i, q_i * max_i) >= q . k``. Decode attends only to the top-k pages by that bound.

- :func:`page_key_bounds` per-page min/max of a dense key sequence.
- :func:`page_upper_bounds` the Quest score of every page for a query, per head or aggregated over heads.
- :func:`select_pages` the top pages of each sequence as a compacted block table and lengths (on device): the
  reference of ``workbench.kernels.quest.quest_select``.
- :func:`quest_recall` the share of the true attention mass inside the chosen pages (per-head choice, the shared
  choice a paged cache can use, and the oracle shared choice).

A page set is shared by all heads of a sequence (the block table is per sequence); the heads' bounds are summed
(``reduce="sum"``, see :class:`~workbench.compress.quest_decode.QuestDecode` for the recall that chose it). The
policies (``workbench.compress.policies``) and the studies use these dense helpers; Quest decode on the paged
cache with the kernels is :mod:`workbench.compress.quest_decode`.
"""

from __future__ import annotations

import math
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
            real activations: :class:`~workbench.compress.quest_decode.QuestDecode`; pages are shared by all heads
            of a sequence in a paged cache, so a selection that saves reads is one page set per sequence):
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
def check_page_budget(page_budget, keep_first, keep_last) -> None:
    """ValueError unless ``page_budget`` pages (an int >= 1) cover ``keep_first + keep_last`` forced pages."""
    for name, v in (("keep_first", keep_first), ("keep_last", keep_last)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if isinstance(page_budget, bool) or not isinstance(page_budget, int) or page_budget < 1:
        raise ValueError(f"page_budget must be an int >= 1 (pages per sequence), got {page_budget!r}")
    if keep_first + keep_last > page_budget:
        raise ValueError(f"page_budget ({page_budget}) must cover keep_first + keep_last ({keep_first} + {keep_last})")


def forced_scores(scores: torch.Tensor, n_pages: torch.Tensor, keep_first: int, keep_last: int) -> torch.Tensor:
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
    check_page_budget(page_budget, keep_first, keep_last)
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
    s = forced_scores(scores, n_pages, keep_first, keep_last)
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
    check_page_budget(page_budget, keep_first, keep_last)
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

    def top(scores: torch.Tensor) -> torch.Tensor:  # the budget's pages of highest score, the forced ones included
        return _top_mask(forced_scores(scores, n, keep_first, keep_last), kb)

    per_head = top(page_upper_bounds(q, bounds, "none", sm_scale=sm_scale))
    shared = top(page_upper_bounds(q, bounds, reduce, sm_scale=sm_scale))
    oracle = top(mass.sum(1))
    out = QuestRecall((mass * per_head).sum(-1), (mass * shared[:, None]).sum(-1), (mass * oracle[:, None]).sum(-1))
    return QuestRecall(*(t[0] for t in out)) if squeeze else out
