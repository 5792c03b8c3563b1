"""Key bounds (Quest page selection, ``workbench.compress.page_selection``): per layer, block and kv head, the
elementwise min and max of the block's keys as attention reads them (dequantized), fp16 rounded outward so they stay
true bounds.

Every write recomputes the bounds of the blocks it touched from the stored keys (one launch per layer after the
write kernel: ``workbench.kernels.quest.key_bounds``, or its reference); block copies (copy-on-write,
compaction's moves) copy them with the block. Costs ``2 * head_dim * 2`` bytes per block, kv head and layer (1/16
of the K+V of 16-token fp16 blocks).
"""

from __future__ import annotations

import torch

from workbench.cache.storage import Storage


class KeyBounds:
    """The bounds of every block of one size class: ``table`` ``[num_layers, num_blocks, Hkv, 2, head_dim]`` fp16
    (``[..., 0, :]`` min, ``[..., 1, :]`` max); unwritten blocks hold the empty bound (+inf, -inf). Only
    :meth:`refresh` and :meth:`copy` change it (the cache calls them from its writes and block copies)."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int, device: torch.device):
        self.table = torch.empty((num_layers, num_blocks, num_kv_heads, 2, head_dim), dtype=torch.float16,
                                 device=device)
        self.table[:, :, :, 0] = float("inf")
        self.table[:, :, :, 1] = float("-inf")

    @staticmethod
    def check(scheme, block_sizes: tuple[int, ...]) -> None:
        """ValueError unless a cache of ``scheme`` with ``block_sizes`` can keep key bounds."""
        if len(block_sizes) > 1:
            raise ValueError(f"key_bounds=True needs a cache with one block size (a Quest page is a block), got "
                             f"block_sizes {block_sizes}")
        if not scheme.supports_key_bounds:
            raise ValueError(f"key_bounds=True is not supported with kv_dtype {scheme.name}: its keys are packed "
                             "in groups and its newest tokens live in an fp16 residual outside the blocks")

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def touched(self, block_size: int, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks a write fills and their tokens after it, ``(blocks, counts)`` on the device: from ``{block:
        tokens}`` (host) or from a slot tensor with one slot per block (a decode step: every sequence writes its own
        block; device arithmetic, no sync)."""
        if isinstance(slots, torch.Tensor):
            return slots // block_size, slots % block_size + 1
        pairs = torch.tensor(list(slots.items()), dtype=torch.int64).reshape(-1, 2).T.contiguous()
        pairs = pairs.to(self.table.device)
        return pairs[0], pairs[1]  # one host -> device copy

    def refresh(self, ops, st: Storage, layer: int, block_size: int, touched, k_scale) -> None:
        """Recompute layer ``layer``'s bounds of the ``touched`` blocks from their stored keys (``ops``: the
        cache's backend, ``workbench.cache.ops``)."""
        blocks, counts = touched
        ops.key_bounds(st, layer, block_size, self.table[layer], blocks, counts, k_scale)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The bounds travel with their blocks ``src -> dst`` (every layer)."""
        self.table[:, dst] = self.table[:, src]



def filled_by(block_size: int, slots: list[int]) -> dict[int, int]:
    """``{block: tokens in it after a write}`` of a write to ``slots`` (``block * block_size + offset``)."""
    fill: dict[int, int] = {}
    for s in slots:
        fill[s // block_size] = max(fill.get(s // block_size, 0), s % block_size + 1)
    return fill


def filled_blocks(manager, seq_ids) -> dict[int, int]:
    """``{block: tokens}`` of the sequences' blocks (a block several share: the most any of them holds)."""
    fill: dict[int, int] = {}
    for s in seq_ids:
        bs, n = manager.block_size(s), manager.num_tokens(s)
        for i, b in enumerate(manager.block_table(s)):
            fill[b] = max(fill.get(b, 0), min(bs, n - i * bs))
    return fill
