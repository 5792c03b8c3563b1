"""Plain PyTorch reference of the paged gather: slow, obvious, and the ground truth in tests."""

from __future__ import annotations

import torch

from workbench.core.layout import Layout, to_nhd


def paged_gather_ref(
    cache: torch.Tensor, layout: Layout | str, kind: str, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """Tokens of every sequence, packed: ``[sum(seq_lens), heads, head_dim]``.

    Token ``p`` of sequence ``b`` lives in block ``block_table[b, p // block_size]`` at
    offset ``p % block_size``.
    """
    nhd = to_nhd(cache, layout, kind)
    block_size = nhd.shape[1]
    rows = []
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=cache.device)
        blocks = block_table[b, pos // block_size].long()
        rows.append(nhd[blocks, pos % block_size])
    return torch.cat(rows) if rows else nhd.new_empty((0, *nhd.shape[2:]))
