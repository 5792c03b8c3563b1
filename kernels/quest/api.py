"""Quest's page selection as one call: the top ``page_budget`` pages of every sequence and the compacted table, from
the kernel that suits the batch (:mod:`.select`'s one program a sequence, or :mod:`.select_split`'s many programs a
row for a few long rows), both the same table bit for bit."""

from __future__ import annotations

import torch

from .. import common
from ..decode.config import _num_sms
from .select import _check_select_inputs, _select_config, _select_pages_kernel
from .select_split import _split_config, _split_select_kernel, split_scratch, split_select


def quest_select(scores: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, page_budget: int, *,
                 page_size: int, out_table: torch.Tensor | None = None, out_lens: torch.Tensor | None = None,
                 block_w: int | None = None, split: bool | None = None,
                 block_s: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The compacted block table of each sequence's ``page_budget`` best pages: one launch, on the device (no host
    sync, no ``torch.topk``).

    The choice is :func:`workbench.compress.page_selection.select_pages`' (the reference, the same table bit for bit): per
    sequence the ``min(page_budget, pages)`` pages of highest score among its ``ceil(seq_lens / page_size)`` pages,
    equal scores going to the lower page index; NaN counts as ``+inf``, ``-0.0`` as ``+0.0``. The forced pages are
    the scores kernel's ``+inf`` (``keep_first`` / ``keep_last``); the scores of padding pages are not read.

    Args:
        scores: ``[B, max_blocks]`` fp32 page scores (:func:`quest_page_scores`), unit last stride.
        block_table: ``[B, max_blocks]`` int32, unit last stride; seq_lens: ``[B]`` int32.
        page_budget: pages kept per sequence (all of them where a sequence has fewer).
        page_size: tokens per page.
        out_table, out_lens: optional buffers ``[B, min(page_budget, max_blocks)]`` / ``[B]`` int32 (a plan's).
        block_w: pages per tile of the kernel (a power of two; default: the whole row up to 8192 pages). Tests use
            small tiles to cover rows of several.
        split: the multi-program kernel (:mod:`.select_split`, True), the one-program kernel (False), or the rule's
            choice (None: :func:`~.selectsplit_select` on ``B``, ``max_blocks`` and the GPU's SMs).
        block_s: pages per program of the multi-program kernel (a power of two; default: as many programs as SMs).

    Returns:
        ``(table, lens)``: the chosen pages' blocks in their original order (then padding: the sequence's first
        block, never read), and each sequence's length over them (every chosen page full but the sequence's last,
        which keeps its partial length).

    One program per sequence: the scores become order-preserving int32 keys; a radix search (4 key bits a pass,
    16 candidate thresholds counted in one reduction, at most 8 passes, fewer once exactly the budget's count is
    above a threshold) finds the budget-th largest key; one prefix sum then places every chosen page at its rank
    in page order. The multi-program kernel gives the same table (its docstring says how); this call allocates its
    scratch (a plan keeps its own).
    """
    if split is not None and not isinstance(split, bool):
        raise ValueError(f"split must be True, False or None (the rule's choice), got {split!r}")
    if split is False and block_s is not None:
        raise ValueError(f"block_s is the multi-program kernel's (split=True or None), got {block_s!r} with split=False")
    B, W, k, out_table, out_lens = _check_select_inputs(block_table, seq_lens, page_budget, page_size, out_table,
                                                        out_lens)
    if not isinstance(scores, torch.Tensor) or scores.shape != (B, W) or scores.dtype != torch.float32 \
            or scores.device != block_table.device or (W and scores.stride(1) != 1):
        raise ValueError(f"scores must be an fp32 [{B}, {W}] tensor on {block_table.device} with unit last stride, "
                         f"got {common.describe(scores)}")
    num_sms = _num_sms(block_table.device)
    split_ce = _split_config(B, W, page_size, num_sms, block_s, block_w) if split is not False else None
    if split is None:
        split = split_select(B, W, num_sms)
    grid, ce = split_ce if split else ((B,), _select_config(W, page_size, block_w))
    if B and W:
        if split:
            _split_select_kernel[grid](scores, block_table, seq_lens, out_table, out_lens,
                                              *split_scratch(B, W, scores.device), W, k, scores.stride(0),
                                              block_table.stride(0), out_table.stride(0), **ce)
        else:
            _select_pages_kernel[grid](scores, block_table, seq_lens, out_table, out_lens, W, k, scores.stride(0),
                                       block_table.stride(0), out_table.stride(0), **ce)
    return out_table, out_lens
