"""Block moves between two block spaces (device pool, staging buffer, pinned host tier), in one launch.

A *block space* is a flat uint8 buffer where block ``id``'s row ``r`` (``r = layer * 2 + kind``) starts at byte
``r * row_stride + id * block_stride`` and runs ``row_bytes``. The cache's pool is one (rows are its K/V planes,
``row_stride`` one plane, ``block_stride`` one block of the size class); a host-tier buffer or a staging buffer
is another, block-major (``row_stride = row_bytes``, ``block_stride`` one unit or one whole block), so a block's
bytes lie together there and a batch of them is one contiguous range.

Two uses (``workbench.tiers.transfer``):

- the *SM path*: the kernel's threads read the device pool and write pinned host memory directly (pinned memory
  is mapped into the device's address space; Triton accepts such tensors), so scattered blocks move in one
  launch with no staging copy and no per-block copy-engine call. The copy engine is slow for small copies (vLLM
  measured 4-7 GB/s for 4-24 KiB pages and moved to an SM copy below 28 KiB). ``num_programs`` caps the grid:
  an SM copy takes SMs from the compute running beside it;
- the *DMA path*'s gather/scatter: scattered device blocks into one contiguous staging buffer (then one
  ``cudaMemcpyAsync`` of the whole batch), and back.

Programs loop over (block, row) tasks ``pid, pid + num_programs, ...``; each copies its row ``BLOCK_W`` words
at a time, in the widest integer word every offset allows (8 bytes for 128-byte-aligned blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _move_blocks_kernel(
    src_ptr, dst_ptr,  # flat word buffers of the two block spaces
    src_id_ptr, dst_id_ptr,  # [n] int64: block i moves from src id src_ids[i] to dst id dst_ids[i]
    num_tasks,  # n * num_rows * chunks
    num_rows,  # rows per block (layers * 2)
    row_words,  # words per row
    chunks,  # pieces a row is cut into (one task each: a large row is copied by many programs)
    chunk_words,  # words per piece (a multiple of BLOCK_W)
    s_src_row, s_src_blk, s_dst_row, s_dst_blk,  # word strides of a row and of a block id, in each space
    num_programs,  # the grid (programs loop over tasks)
    ALIGN: tl.constexpr,  # proven divisibility (words) of every row start
    BLOCK_W: tl.constexpr,  # words per load/store
):
    i_pid = tl.program_id(0)
    o_w = tl.arange(0, BLOCK_W)  # [BLOCK_W]
    for t in range(i_pid, num_tasks, num_programs):
        i_blk = t // (num_rows * chunks)
        i_row = ((t // chunks) % num_rows).to(tl.int64)
        o_first = (t % chunks).to(tl.int64) * chunk_words
        i_src = tl.load(src_id_ptr + i_blk)
        i_dst = tl.load(dst_id_ptr + i_blk)
        o_src = i_row * s_src_row + i_src * s_src_blk
        o_dst = i_row * s_dst_row + i_dst * s_dst_blk
        for o in range(o_first, tl.minimum(o_first + chunk_words, row_words), BLOCK_W):
            m = o + o_w < row_words  # [BLOCK_W]
            p_src = src_ptr + tl.multiple_of(o_src + o, ALIGN) + o_w
            p_dst = dst_ptr + tl.multiple_of(o_dst + o, ALIGN) + o_w
            tl.store(p_dst, tl.load(p_src, mask=m), mask=m)


def _word(*nbytes: int) -> int:
    """The widest word (8, 4, 2, 1 bytes) dividing every one of ``nbytes``."""
    return next(w for w in _WORDS if all(b % w == 0 for b in nbytes))


def _flat_bytes(name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous tensor (a block space's buffer), got "
                         f"{type(t).__name__ if not isinstance(t, torch.Tensor) else 'a strided tensor'}")
    return t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)


def move_blocks(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor, *,
    num_rows: int, row_bytes: int, src_row_stride: int, src_block_stride: int, dst_row_stride: int,
    dst_block_stride: int, src_offset: int = 0, dst_offset: int = 0, num_programs: int | None = None,
    step_bytes: int = 8192, chunk_bytes: int = 16 << 10, num_warps: int = 4,
) -> None:
    """Copy block ``src_ids[i]`` of the ``src`` space to block ``dst_ids[i]`` of the ``dst`` space, every row.

    Args:
        src, dst: contiguous buffers of the two spaces (any dtype; read as bytes). On a GPU one may be pinned host
            memory (the SM path); the kernel runs on the device of the ids.
        src_ids, dst_ids: ``[n]`` int64 block ids (``dst_ids`` distinct), on the device the kernel runs on.
        num_rows: rows per block (``layers * 2``); row_bytes: bytes per row.
        src_row_stride, src_block_stride, dst_row_stride, dst_block_stride: byte strides of a row and of a block
            id in each space; src_offset, dst_offset: the spaces' first byte in their buffers.
        num_programs: the grid (default: one program per task, at most 4096).
        step_bytes: bytes per load/store step (a power of two); num_warps: warps per program.
        chunk_bytes: a row longer than this is cut into pieces of this size, one task each (one program would
            copy a 2 MiB row at a fraction of the link, or of HBM in a gather: its steps are serial). 16 KiB
            measured best on the H200: 64 KiB was no faster, 4 KiB pieces cut host reads from 0.86 to 0.77 of
            the link at 2 MiB (``bench tiers``).

    The caller (``workbench.tiers.transfer``) checks ids against the spaces' sizes; nothing here reads past
    ``num_rows`` rows of ``row_bytes``.
    """
    src_b, dst_b = _flat_bytes("src", src), _flat_bytes("dst", dst)
    for name, ids in (("src_ids", src_ids), ("dst_ids", dst_ids)):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
            raise ValueError(f"{name} must be a 1-D int64 tensor, got {getattr(ids, 'dtype', ids)}")
    if src_ids.shape != dst_ids.shape:
        raise ValueError(f"dst_ids must have src_ids' length {src_ids.shape[0]}, got {dst_ids.shape[0]}")
    n = src_ids.shape[0]
    if n == 0 or num_rows == 0 or row_bytes == 0:
        return
    strides = (row_bytes, src_row_stride, src_block_stride, dst_row_stride, dst_block_stride)
    w = _word(*strides, src_offset, dst_offset, src_b.data_ptr(), dst_b.data_ptr())
    dtype = _WORDS[w]
    src_w = src_b[src_offset:].view(dtype) if w > 1 else src_b[src_offset:]
    dst_w = dst_b[dst_offset:].view(dtype) if w > 1 else dst_b[dst_offset:]
    align = 1
    while align < 16 and all(s // w % (align * 2) == 0 for s in strides):
        align *= 2
    row_words = row_bytes // w
    block_w = max(1, min(triton.next_power_of_2(row_words), step_bytes // w, chunk_bytes // w))
    chunk_words = max(block_w, chunk_bytes // w // block_w * block_w)
    chunks = -(-row_words // chunk_words)
    tasks = n * num_rows * chunks
    grid = min(tasks, 4096) if num_programs is None else max(1, min(int(num_programs), tasks))
    _move_blocks_kernel[(grid,)](
        src_w, dst_w, src_ids, dst_ids, tasks, num_rows, row_words, chunks, chunk_words,
        src_row_stride // w, src_block_stride // w, dst_row_stride // w, dst_block_stride // w, grid,
        ALIGN=align, BLOCK_W=block_w, num_warps=num_warps,
    )
