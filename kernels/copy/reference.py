"""Plain PyTorch reference of the block copy: slow, obvious, and the ground truth in tests."""

from __future__ import annotations

import torch


def copy_blocks_ref(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``pool[:, :, dst[i]] = pool[:, :, src[i]]`` for every pair, every layer, K and V; in place.

    ``pool`` is ``[num_layers, 2, num_blocks, block_stride]``; a block is its whole row.
    """
    pool[:, :, dst.long()] = pool[:, :, src.long()].clone()
