"""Paged gather: block table -> contiguous K or V, for any storage layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.core.layout import Layout, addressing, from_nhd, to_nhd

from ..validate import check_table_tensors, table_stats
from .reference import paged_gather_ref


@triton.jit
def _paged_gather_kernel(
    cache_ptr,  # one K or V cache, any layout (addressed through the strides below)
    block_table_ptr,  # [B, max_blocks] int32: physical block of each logical block
    seq_lens_ptr,  # [B] int32: tokens in each sequence
    cu_seqlens_ptr,  # [B + 1] int32: first output row of each sequence
    out_ptr,  # [sum(seq_lens), H, D] contiguous
    stride_bt,  # row stride of block_table
    s_blk, s_tok, s_head, s_dgrp, s_d,  # element (blk, tok, h, d) at blk*s_blk + tok*s_tok + h*s_head
    head_dim,  # + (d // X) * s_dgrp + (d % X) * s_d
    num_heads,
    block_size,  # tokens per block
    X: tl.constexpr,  # key split (head_dim for unsplit layouts)
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
):
    i_b = tl.program_id(0)
    i_t = tl.program_id(1)
    i_h = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + i_b)
    if i_t * BLOCK_T >= seq_len:
        return
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] token positions
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_t = o_t < seq_len
    m_d = o_d < head_dim
    i_blk = tl.load(block_table_ptr + i_b.to(tl.int64) * stride_bt + o_t // block_size, mask=m_t, other=0)
    o_tok = (
        i_blk.to(tl.int64) * s_blk + (o_t % block_size).to(tl.int64) * s_tok + i_h.to(tl.int64) * s_head
    )  # [BLOCK_T]
    o_dim = (o_d // X).to(tl.int64) * s_dgrp + (o_d % X).to(tl.int64) * s_d  # [BLOCK_D]
    m = m_t[:, None] & m_d[None, :]
    b_x = tl.load(cache_ptr + o_tok[:, None] + o_dim[None, :], mask=m)  # [BLOCK_T, BLOCK_D]
    row = tl.load(cu_seqlens_ptr + i_b).to(tl.int64) + o_t.to(tl.int64)
    p_out = out_ptr + (row[:, None] * num_heads + i_h) * head_dim + o_d[None, :]
    tl.store(p_out, b_x, mask=m)


def paged_gather(
    cache: torch.Tensor,
    layout: Layout | str,
    kind: str,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Copy every sequence's tokens out of the paged cache, packed in order.

    Args:
        cache: one K or V cache tensor in ``layout`` (see ``workbench.core.layout``).
        layout: ``"nhd"``, ``"hnd"`` or ``"vllm"``.
        kind: ``"k"`` or ``"v"`` (the vllm layout stores them differently).
        block_table: ``[B, max_blocks]`` int32, physical block of each logical block.
        seq_lens: ``[B]`` int32, tokens per sequence.
        out: optional ``[sum(seq_lens), heads, head_dim]`` output buffer.
        validate: check that every block id a sequence uses (the first ``ceil(seq_lens[b] / block_size)``
            entries of row ``b``; later ones are padding) lies in ``[0, cache.shape[0])``
            (:func:`~workbench.kernels.validate.check_block_table`). The wrapper reads ``seq_lens`` on the
            host anyway (the output size), so the check shares that one device sync; benchmarks pass
            ``validate=False`` to time the kernel alone. The lengths are range-checked either way.

    Returns:
        ``[sum(seq_lens), heads, head_dim]``, same dtype as the cache.
    """
    nhd_shape = to_nhd(cache[:0], layout, kind).shape  # cheap: no blocks, just the shape
    _, block_size, num_heads, head_dim = nhd_shape
    check_table_tensors(block_table, seq_lens, cache.device)
    stats = table_stats(block_table, seq_lens, block_size, cache.shape[0], check_ids=validate)  # the one sync
    total = stats.total
    if out is None:
        out = torch.empty((total, num_heads, head_dim), dtype=cache.dtype, device=cache.device)
    elif out.shape != (total, num_heads, head_dim) or out.dtype != cache.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous {cache.dtype} of shape {(total, num_heads, head_dim)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if total == 0:
        return out
    cu = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=cache.device)
    torch.cumsum(seq_lens, 0, out=cu[1:])
    a = addressing(cache, layout, kind)
    block_t = 32
    grid = (seq_lens.shape[0], triton.cdiv(stats.max, block_t), num_heads)
    _paged_gather_kernel[grid](
        cache, block_table, seq_lens, cu, out, block_table.stride(0),
        a.s_blk, a.s_tok, a.s_head, a.s_dgrp, a.s_d, head_dim, num_heads, block_size,
        X=a.x, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


def check_against_reference(
    layouts=tuple(Layout),
    kind: str = "k",
    block_size: int = 16,
    num_heads: int = 2,
    head_dim: int = 64,
    seq_lens=(40, 7, 100),
    num_blocks: int = 32,
    seed: int = 0,
) -> dict[str, bool]:
    """:func:`paged_gather` against the PyTorch reference on the same random data in each layout.

    Random fp16 K (or V) in ``num_blocks`` blocks of ``block_size`` tokens, ``seq_lens`` sequences whose pages are
    a random permutation of the pool (a fragmented cache), on the CPU (the Triton interpreter) or the GPU.

    Returns:
        ``{layout: whether the kernel's output equals the reference's bit for bit}``.
    """
    per_seq = [-(-int(n) // block_size) for n in seq_lens]
    if sum(per_seq) > num_blocks:
        raise ValueError(f"num_blocks: {num_blocks} blocks cannot hold seq_lens {list(seq_lens)} "
                         f"({sum(per_seq)} blocks of {block_size} tokens)")
    g = torch.Generator().manual_seed(seed)
    nhd = torch.randn(num_blocks, block_size, num_heads, head_dim, generator=g).half()
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(len(per_seq), max(per_seq, default=0) or 1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[start:start + n]
        start += n
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lens = torch.tensor(list(seq_lens), dtype=torch.int32, device=device)
    table = table.to(device)
    out = {}
    for layout in layouts:
        cache = from_nhd(nhd, layout, kind).to(device)
        got = paged_gather(cache, layout, kind, table, lens)
        out[str(layout)] = torch.equal(got, paged_gather_ref(cache, layout, kind, table, lens))
    return out
