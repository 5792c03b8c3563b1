"""Block copy: ``block src[i] -> block dst[i]`` in every layer, K and V, in one launch.

Used for copy-on-write (a shared block about to be appended to) and compaction. The pool is the
cache's one physical buffer ``[num_layers, 2, num_blocks, block_stride]``; a block is a contiguous
run of ``block_stride`` elements, so the copy is layout-agnostic. The pool is reinterpreted as
the widest integer words its geometry allows (8 bytes when blocks are 128-byte multiples), and
each program copies one block pair in ``ROWS`` (layer, K/V) rows, ``BLOCK_W`` words at a time.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _copy_blocks_kernel(
    pool_ptr,  # [L, 2, num_blocks, block_words] integer words
    src_ptr, dst_ptr,  # [n] int32/int64 block ids
    num_blocks,
    num_rows,  # L * 2: (layer, kind) rows
    block_words,  # words per block (the whole block stride)
    s_layer, s_kind, s_blk,  # word strides of the pool
    ALIGN: tl.constexpr,  # proven divisibility (words) of every row start
    ROWS: tl.constexpr,  # (layer, kind) rows per program
    BLOCK_W: tl.constexpr,  # words per load/store
):
    i_p = tl.program_id(0)
    i_r0 = tl.program_id(1) * ROWS
    i_src = tl.load(src_ptr + i_p).to(tl.int64)
    i_dst = tl.load(dst_ptr + i_p).to(tl.int64)
    ok = (i_src >= 0) & (i_src < num_blocks) & (i_dst >= 0) & (i_dst < num_blocks)  # never touch outside the pool
    o_w = tl.arange(0, BLOCK_W)  # [BLOCK_W]
    if ok:
        for i_r in range(ROWS):
            r = (i_r0 + i_r).to(tl.int64)
            if r < num_rows:
                o_row = (r // 2) * s_layer + (r % 2) * s_kind
                o_src = o_row + i_src * s_blk
                o_dst = o_row + i_dst * s_blk
                for o in range(0, block_words, BLOCK_W):
                    m = o + o_w < block_words  # [BLOCK_W]
                    p_src = pool_ptr + tl.multiple_of(o_src + o, ALIGN) + o_w
                    p_dst = pool_ptr + tl.multiple_of(o_dst + o, ALIGN) + o_w
                    tl.store(p_dst, tl.load(p_src, mask=m), mask=m)


def _word_view(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` reinterpreted as the widest integer words its strides, size and address allow."""
    elem = pool.element_size()
    nbytes = [pool.shape[3] * elem, *(s * elem for s in pool.stride()[:3]), pool.data_ptr()]
    for w, dtype in _WORDS.items():
        if all(b % w == 0 for b in nbytes):
            return pool.view(torch.uint8).view(dtype) if w != elem else pool.view(dtype)
    raise AssertionError("unreachable: 1-byte words always fit")


def default_copy_launch(block_bytes: int, num_rows: int) -> tuple[int, int, int]:
    """Heuristic ``(rows_per_program, block_bytes_per_step, num_warps)``: at least ~32 KB per program,
    8 KB (or the whole block, if smaller) per step with 4 warps."""
    step = min(8192, triton.next_power_of_2(block_bytes))
    rows = 1
    while rows * block_bytes < 32768 and rows < num_rows:
        rows *= 2
    return rows, step, 4 if step >= 4096 else max(1, step // 1024)


def _check_ids(name: str, ids, device) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32 or int64 tensor of block ids, got {getattr(ids, 'dtype', ids)}")
    if ids.device != device:
        raise ValueError(f"{name} must be on the pool's device {device}, got {ids.device}")


def copy_blocks(
    pool: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    rows_per_program: int | None = None,
    step_bytes: int | None = None,
    num_warps: int | None = None,
    validate: bool = True,
) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` in every layer, K and V, in place.

    Args:
        pool: ``[num_layers, 2, num_blocks, block_stride]``, any dtype, unit stride in the last dim.
        src: ``[n]`` int32/int64 source block ids (may repeat: one block forked to several).
        dst: ``[n]`` int32/int64 destination block ids: distinct, and none of them a source.
        rows_per_program: (layer, K/V) rows each program copies (power of two); default heuristic.
        step_bytes: bytes per load/store step (power of two); default heuristic.
        num_warps: warps per program; default heuristic.
        validate: check ids are in range, ``dst`` distinct and disjoint from ``src`` (one device sync).
            Skipped while a CUDA graph is being captured; out-of-range pairs are never copied either way.
    """
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4 or pool.shape[1] != 2:
        raise ValueError(f"pool must be [num_layers, 2, num_blocks, block_stride], got {getattr(pool, 'shape', pool)}")
    if pool.shape[3] > 1 and pool.stride(3) != 1:
        raise ValueError(f"pool must have unit stride in its last dim (a block is contiguous), got {pool.stride()}")
    _check_ids("src", src, pool.device)
    _check_ids("dst", dst, pool.device)
    if src.shape != dst.shape:
        raise ValueError(f"dst must have src's length {src.shape[0]}, got {dst.shape[0]}")
    num_layers, _, num_blocks, _ = pool.shape
    n = src.shape[0]
    if validate and n and not (pool.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo = int(torch.minimum(src.min(), dst.min()))
        hi = int(torch.maximum(src.max(), dst.max()))
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"src and dst ids must be in [0, {num_blocks}), got range [{lo}, {hi}]")
        if torch.unique(dst).numel() != n:
            raise ValueError("dst must not repeat a block (two copies into one block: ambiguous)")
        if bool(torch.isin(dst.long(), src.long()).any()):
            raise ValueError("dst must not also be a src in the same call (order would matter)")
    if n == 0 or pool.numel() == 0:
        return
    words = _word_view(pool)
    wsize = words.element_size()
    block_words = words.shape[3]
    rows_auto, step_auto, warps_auto = default_copy_launch(block_words * wsize, 2 * num_layers)
    rows = rows_auto if rows_per_program is None else rows_per_program
    step = step_auto if step_bytes is None else step_bytes
    warps = warps_auto if num_warps is None else num_warps
    for name, v in (("rows_per_program", rows), ("step_bytes", step), ("num_warps", warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    s_layer, s_kind, s_blk, _ = words.stride()
    block_w = max(1, step // wsize)
    align = math.gcd(s_layer, s_kind, s_blk, block_w, max(1, 16 // wsize))  # 16 bytes is all a vector needs
    grid = (n, triton.cdiv(2 * num_layers, rows))
    _copy_blocks_kernel[grid](
        words, src, dst, num_blocks, 2 * num_layers, block_words, s_layer, s_kind, s_blk,
        ALIGN=align, ROWS=rows, BLOCK_W=block_w, num_warps=warps,
    )
