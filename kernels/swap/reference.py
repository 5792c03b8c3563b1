"""Plain PyTorch reference of the block moves between block spaces: slow, obvious, and the ground truth in tests."""

from __future__ import annotations

import torch


def move_blocks_ref(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor, *,
                    num_rows: int, row_bytes: int, src_row_stride: int, src_block_stride: int, dst_row_stride: int,
                    dst_block_stride: int, src_offset: int = 0, dst_offset: int = 0, **_launch) -> None:
    """``workbench.kernels.swap.move_blocks`` in PyTorch: block ``src_ids[i]`` of one byte space to block
    ``dst_ids[i]`` of another, row by row (strides in bytes; see that module)."""
    s = src.reshape(-1).view(torch.uint8)[src_offset:]
    d = dst.reshape(-1).view(torch.uint8)[dst_offset:]
    rows = torch.arange(num_rows, dtype=torch.int64)
    cols = torch.arange(row_bytes, dtype=torch.int64)
    for i_s, i_d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        o_s = (rows * src_row_stride + i_s * src_block_stride)[:, None] + cols  # [rows, row_bytes]
        o_d = (rows * dst_row_stride + i_d * dst_block_stride)[:, None] + cols
        d[o_d.reshape(-1).to(d.device)] = s[o_s.reshape(-1).to(s.device)].to(d.device)
