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
import triton
import triton.language as tl


class LenStats(NamedTuple):
    """``seq_lens`` read back by the same sync as the check."""

    min: int
    max: int
    total: int


def check_table_tensors(block_table, seq_lens, device, *, batch: int | None = None, owner: str = "the cache") -> None:
    """A block table and its lengths as tensors: ``[B, W]`` and ``[B]`` int32 on ``device``, unit stride along
    a row and along the lengths (host only; their values are :func:`table_stats`'). ``batch``: the ``B`` they
    must have (default: the table's rows); ``owner`` names whose device ``device`` is, for the messages."""
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    B = (block_table.shape[0] if block_table.dim() else -1) if batch is None else batch
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be a 2-D int32 tensor of shape [{B}, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32 or seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must be int32 of shape [{B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != device:
            raise ValueError(f"{name} must be on {owner}'s device {device}, got {t.device}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must have unit stride in its last dimension, got strides {block_table.stride()}")
    if B > 1 and seq_lens.stride(0) != 1:
        raise ValueError(f"seq_lens must be contiguous, got stride {seq_lens.stride(0)}")


def capturing(t: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on ``t``'s device (no host reads allowed then)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@triton.jit
def _table_check_kernel(
    bt_ptr,  # [B, W] int32 block table
    lens_ptr,  # [B] int32 sequence lengths
    out_ptr,  # [B, 3] int32 out: (seq_len, bad entries, first bad column or W)
    s_bt,  # row stride of the table
    W,  # table width
    block_size,
    num_blocks,  # ids must be in [0, num_blocks)
    BLOCK_W: tl.constexpr,
):
    i_b = tl.program_id(0)
    n = tl.load(lens_ptr + i_b)
    n_used = tl.minimum((n + block_size - 1) // block_size, W)  # entries this row reads (<= 0 if n <= 0)
    n_bad = tl.zeros((), tl.int32)
    first = tl.zeros((), tl.int32) + W
    for j0 in range(0, n_used, BLOCK_W):
        o_j = j0 + tl.arange(0, BLOCK_W)
        m_j = o_j < n_used
        b_id = tl.load(bt_ptr + i_b.to(tl.int64) * s_bt + o_j, mask=m_j, other=0)  # [BLOCK_W]
        b_bad = m_j & ((b_id < 0) | (b_id >= num_blocks))
        n_bad += tl.sum(b_bad.to(tl.int32))
        first = tl.minimum(first, tl.min(tl.where(b_bad, o_j, W)))
    tl.store(out_ptr + i_b * 3, n)
    tl.store(out_ptr + i_b * 3 + 1, n_bad)
    tl.store(out_ptr + i_b * 3 + 2, first)


def row_checks(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int,
               *, use_kernel: bool | None = None) -> torch.Tensor:
    """``[B, 3]`` int32 per row: seq_len, number of used entries outside ``[0, num_blocks)``, the first
    such column (``W`` if none). One Triton launch on a GPU (``use_kernel=None``), plain torch on a CPU."""
    B, W = block_table.shape
    if use_kernel is None:
        use_kernel = block_table.is_cuda
    if use_kernel:
        out = torch.empty((B, 3), dtype=torch.int32, device=block_table.device)
        _table_check_kernel[(B,)](block_table, seq_lens, out, block_table.stride(0), W, block_size, num_blocks,
                                  BLOCK_W=min(1024, triton.next_power_of_2(max(1, W))))
        return out
    lens = seq_lens.to(torch.int64)
    n_used = torch.div(lens + (block_size - 1), block_size, rounding_mode="floor").clamp(max=W)  # [B]
    cols = torch.arange(W, device=block_table.device)
    bad = (cols[None, :] < n_used[:, None]) & ((block_table < 0) | (block_table >= num_blocks))  # [B, W]
    first = torch.where(bad, cols[None, :], W).amin(dim=1) if W else torch.zeros_like(lens)
    return torch.stack([lens, bad.sum(dim=1), first], dim=1).to(torch.int32)


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
    ``[0, num_blocks)``, naming its row, column and value. Shapes and dtypes are the caller's to check.

    Cost on a GPU: one small kernel (with ``check_ids``) and one device -> host read of ``[B, 3]``
    values; the error path reads more, the good path nothing else."""
    if block_table.dim() != 2 or seq_lens.dim() != 1 or seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(f"{name} must be [B, max_blocks] and seq_lens [B], got {tuple(block_table.shape)} "
                         f"and {tuple(seq_lens.shape)}")
    B, W = block_table.shape
    if B == 0:
        return LenStats(0, 0, 0)
    check_ids = check_ids and W > 0
    if check_ids:
        rows = row_checks(block_table, seq_lens, block_size, num_blocks).tolist()  # the one device -> host sync
        lens = [r[0] for r in rows]
    else:
        lens = seq_lens.tolist()
    lo, hi, total = min(lens), max(lens), sum(lens)
    if lo < 0:
        raise ValueError(f"seq_lens must be non-negative, got min {lo}")
    if hi > W * block_size:
        raise ValueError(f"seq_lens max {hi} exceeds {name} capacity {W} blocks x {block_size} tokens")
    if check_ids:
        r = next((i for i, row in enumerate(rows) if row[1]), None)
        if r is not None:
            c, n = rows[r][2], rows[r][0]
            value = int(block_table[r, c])  # the error path: a second read is fine
            raise ValueError(
                f"{name}[{r}, {c}] = {value} is out of range: block ids must be in [0, {num_blocks}) (the cache's "
                f"blocks). Row {r} has seq_len {n}, so it uses its first {-(-n // block_size)} entries; entries "
                f"past a sequence's last block are padding and not checked"
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
