"""Host-side checks of a block table against the cache it indexes, in one device sync.

The kernels trust every block id they read: an id equal to ``num_blocks`` lands in whatever follows
the cache (the V plane of a K/V pool), ``-1`` before it, a huge id outside the allocation. So the
wrappers check the table first, with one reduction read back once. Only the entries a kernel reads
are checked: ``block_table[b, j]`` for ``j < ceil(seq_lens[b] / block_size)``; the entries past a
sequence's last block are padding (vLLM pads its tables) and may hold anything.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LenStats(NamedTuple):
    """``seq_lens`` read back by the same sync as the check."""

    min: int
    max: int
    total: int


def capturing(t: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on ``t``'s device (no host reads allowed then)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def table_stats(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_blocks: int,
    *,
    check_ids: bool = True,
    name: str = "block_table",
) -> LenStats:
    """``seq_lens``' min, max and sum, read in one device sync; raises ValueError for a negative length,
    a length beyond the table's ``W * block_size`` tokens, and (``check_ids``) for a used entry outside
    ``[0, num_blocks)``, naming its row, column and value. Shapes and dtypes are the caller's to check."""
    if block_table.dim() != 2 or seq_lens.dim() != 1 or seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(f"{name} must be [B, max_blocks] and seq_lens [B], got {tuple(block_table.shape)} "
                         f"and {tuple(seq_lens.shape)}")
    B, W = block_table.shape
    if B == 0:
        return LenStats(0, 0, 0)
    lens = seq_lens.to(torch.int64)
    parts = [lens.min(), lens.max(), lens.sum()]
    check_ids = check_ids and W > 0
    if check_ids:
        n_used = torch.div(lens + (block_size - 1), block_size, rounding_mode="floor")  # [B] blocks each row reads
        used = torch.arange(W, device=block_table.device)[None, :] < n_used[:, None]  # [B, W]
        bad = used & ((block_table < 0) | (block_table >= num_blocks))
        first = torch.argmax(bad.reshape(-1).to(torch.int32))  # the first maximum: the first bad entry, row-major
        value = block_table.reshape(-1).index_select(0, first.reshape(1)).reshape(())  # a 0-d index would sync
        row_len = lens.index_select(0, torch.div(first, W, rounding_mode="floor").reshape(1)).reshape(())
        parts += [bad.any(), first, value, row_len]
    vals = torch.stack([p.to(torch.int64) for p in parts]).tolist()  # the one device -> host sync
    lo, hi, total = vals[:3]
    if lo < 0:
        raise ValueError(f"seq_lens must be non-negative, got min {lo}")
    if hi > W * block_size:
        raise ValueError(f"seq_lens max {hi} exceeds {name} capacity {W} blocks x {block_size} tokens")
    if check_ids and vals[3]:
        r, c = divmod(vals[4], W)
        n = vals[6]
        raise ValueError(
            f"{name}[{r}, {c}] = {vals[5]} is out of range: block ids must be in [0, {num_blocks}) (the cache's "
            f"blocks). Row {r} has seq_len {n}, so it uses its first {-(-n // block_size)} entries; entries past a "
            f"sequence's last block are padding and not checked"
        )
    return LenStats(lo, hi, total)


def check_block_table(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_blocks: int,
    *,
    name: str = "block_table",
) -> LenStats | None:
    """Check every used entry of ``block_table`` (``[B, W]``; row ``b`` uses its first
    ``ceil(seq_lens[b] / block_size)`` entries) is a block id in ``[0, num_blocks)``, and ``seq_lens`` is in
    ``[0, W * block_size]``: one reduction, one device sync. Raises ValueError naming ``name``, the valid
    range and the first offending ``(row, column, value)``. Skipped (returns None) while a CUDA graph is
    being captured, as ``write_kv(validate=...)`` is; otherwise returns the lengths' min, max and sum."""
    if capturing(block_table):
        return None
    return table_stats(block_table, seq_lens, block_size, num_blocks, check_ids=True, name=name)
