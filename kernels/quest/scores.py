"""Quest page scores: the bound of ``q . k`` over each page's keys, for every page of every sequence.

For a query ``q`` the score ``sum_i max(q_i * min_i, q_i * max_i)`` bounds ``q . k`` for every key of the page
(:mod:`.bounds` keeps the min and max). The block table is per sequence, so a selection that saves reads is one page
set shared by all heads: :func:`quest_page_scores` aggregates the per-query-head bound over heads (``reduce="max"`` or
``"sum"`` of ``sm_scale * bound``), or returns it per head (``reduce="none"``, ``[B, Hq, max_blocks]``, for studies
and the softmax-normalised aggregate). The products are two tensor-core dots, ``max(q, 0) @ max^T + min(q, 0) @
min^T`` (equal to the elementwise max since ``max >= min``). Padding pages score ``-inf``; pages to keep whatever
their score (the sink, the last) ``+inf``. Reference: ``reference.quest_page_scores_ref``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import common

REDUCES = {"max": 0, "sum": 1, "none": 2}  # the kernel's REDUCE


@triton.jit
def _page_scores_kernel(
    q_ptr,  # [B, Hq, D] queries, unit stride in D
    bnd_ptr,  # [num_blocks, Hkv, 2, D] fp16 key bounds of one layer
    bt_ptr,  # [B, W] int32 block table
    lens_ptr,  # [B] int32 context lengths
    out_ptr,  # [B, W] fp32 page scores (REDUCE 0, 1) or [B, Hq, W] per query head (REDUCE 2)
    s_qb, s_qh,  # q strides
    s_bb, s_bh,  # bounds strides: block, head
    s_bt,  # block-table row stride
    s_ob, s_oh,  # out strides: sequence, head (REDUCE 2)
    W,  # table width (pages per row)
    num_kv_heads,
    sm_scale,  # REDUCE 1 sums sm_scale * bound over the heads
    keep_first, keep_last,  # pages forced in (+inf): the first keep_first and the last keep_last of a sequence
    G: tl.constexpr,  # query heads per kv head
    G_PAD: tl.constexpr,  # G rounded up to 16 (the dot's smallest tile)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,  # pages per program
    PAGE: tl.constexpr,  # tokens per page
    REDUCE: tl.constexpr,  # 0 max over heads, 1 sum over heads, 2 none (per query head)
    FP16_DOT: tl.constexpr,  # fp16 queries: fp16 tensor-core dots; else fp32 operands, IEEE dots
):
    i_p = tl.program_id(0)
    i_b = tl.program_id(1)
    seq_len = tl.load(lens_ptr + i_b)
    n_pages = tl.cdiv(seq_len, PAGE)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P] logical pages
    m_p = o_p < n_pages
    o_g = tl.arange(0, G_PAD)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < G
    m_d = o_d < HEAD_DIM
    i_blk = tl.load(bt_ptr + i_b.to(tl.int64) * s_bt + o_p, mask=m_p, other=0).to(tl.int64)  # [BLOCK_P]
    m_pd = m_p[:, None] & m_d[None, :]
    if REDUCE == 0:
        b_acc = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    else:
        b_acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    for i_hk in range(num_kv_heads):
        i_hq = i_hk * G + o_g  # [G_PAD]
        p_q = q_ptr + i_b.to(tl.int64) * s_qb + i_hq[:, None] * s_qh + o_d[None, :]
        b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)  # [G_PAD, BLOCK_D]
        p_lo = bnd_ptr + i_blk[:, None] * s_bb + i_hk * s_bh + o_d[None, :]  # [BLOCK_P, BLOCK_D]
        b_lo = tl.load(p_lo, mask=m_pd, other=0.0)
        b_hi = tl.load(p_lo + HEAD_DIM, mask=m_pd, other=0.0)
        # max(q * lo, q * hi) = max(q, 0) * hi + min(q, 0) * lo, as max >= min: two dots
        if FP16_DOT:
            b_qp = tl.maximum(b_q, 0.0).to(tl.float16)
            b_qn = tl.minimum(b_q, 0.0).to(tl.float16)
            b_s = tl.dot(b_qp, tl.trans(b_hi)) + tl.dot(b_qn, tl.trans(b_lo))  # [G_PAD, BLOCK_P] fp32
        else:
            b_qf = b_q.to(tl.float32)
            b_s = tl.dot(tl.maximum(b_qf, 0.0), tl.trans(b_hi.to(tl.float32)), input_precision="ieee")
            b_s += tl.dot(tl.minimum(b_qf, 0.0), tl.trans(b_lo.to(tl.float32)), input_precision="ieee")
        b_s = tl.where(b_s != b_s, float("inf"), b_s)  # 0 * inf (a bound outside fp16's range): keep the page
        if REDUCE == 0:
            b_acc = tl.maximum(b_acc, tl.max(tl.where(m_g[:, None], b_s, float("-inf")), 0))
        elif REDUCE == 1:
            b_acc += tl.sum(tl.where(m_g[:, None], b_s, 0.0), 0) * sm_scale
        else:
            m_keep = m_p & ((o_p < keep_first) | (o_p >= n_pages - keep_last))
            b_s = tl.where(m_keep[None, :], float("inf"), b_s)
            b_s = tl.where(m_p[None, :], b_s, float("-inf"))
            p_o = out_ptr + i_b.to(tl.int64) * s_ob + i_hq[:, None].to(tl.int64) * s_oh + o_p[None, :]
            tl.store(p_o, b_s, mask=m_g[:, None] & (o_p < W)[None, :])
    if REDUCE != 2:
        m_keep = m_p & ((o_p < keep_first) | (o_p >= n_pages - keep_last))
        b_acc = tl.where(m_keep, float("inf"), b_acc)
        b_acc = tl.where(m_p, b_acc, float("-inf"))  # [BLOCK_P] padding pages never win
        tl.store(out_ptr + i_b.to(tl.int64) * s_ob + o_p, b_acc, mask=o_p < W)


def _check_scores_inputs(q, bounds, block_table, seq_lens):
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in common.Q_DTYPES or q.stride(2) != 1:
        raise ValueError(f"q must be a [B, Hq, D] fp16/bf16/fp32 tensor with unit last stride, got "
                         f"{common.describe(q)}")
    B, Hq, D = q.shape
    if not isinstance(bounds, torch.Tensor) or bounds.dim() != 4 or bounds.dtype != torch.float16 \
            or bounds.shape[2] != 2 or bounds.shape[3] != D or bounds.stride(3) != 1 or bounds.stride(2) != D:
        raise ValueError(f"bounds must be fp16 [num_blocks, Hkv, 2, {D}] (min, max rows of D contiguous), got "
                         f"{common.describe(bounds)}")
    hkv = bounds.shape[1]
    if Hq % hkv:
        raise ValueError(f"q's {Hq} heads must be a multiple of the bounds' {hkv} kv heads")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != B or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be an int32 [{B}, max_blocks] tensor with unit last stride, got "
                         f"{common.describe(block_table)}")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (B,):
        raise ValueError(f"seq_lens must be an int32 [{B}] tensor, got {common.describe(seq_lens)}")
    for name, t in (("bounds", bounds), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    return B, Hq, D, hkv


def quest_page_scores(q: torch.Tensor, bounds: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                      page_size: int, reduce: str = "sum", sm_scale: float | None = None, keep_first: int = 0,
                      keep_last: int = 0, out: torch.Tensor | None = None, block_p: int | None = None,
                      num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """Quest score of every page of every sequence.

    Args:
        q: ``[B, Hq, D]`` one query per sequence (fp16 / bf16 / fp32); query head ``h`` reads kv head
            ``h // (Hq // Hkv)``.
        bounds: ``[num_blocks, Hkv, 2, D]`` fp16 key bounds of one layer (``PagedKVCache.key_bounds(layer)``).
        block_table: ``[B, max_blocks]`` int32.
        seq_lens: ``[B]`` int32; pages past ``ceil(seq_lens[b] / page_size)`` are padding.
        page_size: tokens per page (the cache's block size).
        reduce: ``"max"`` (the largest head bound), ``"sum"`` (the sum over heads of ``sm_scale * bound``) or
            ``"none"`` (every query head's bound, ``[B, Hq, max_blocks]``).
        sm_scale: default ``1 / sqrt(D)`` (``"sum"`` only).
        keep_first, keep_last: the first / last pages of each sequence score ``+inf`` (always chosen).
        out: optional output buffer of the returned shape (fp32).
        block_p, num_warps, num_stages: launch overrides (pages per program, a power of two >= 16; default: 64, 32
            or 16, the largest that still gives 512 / 256 programs; Triton's default stages), for tuning sweeps.

    Returns:
        fp32 ``[B, max_blocks]`` (``[B, Hq, max_blocks]`` for ``"none"``), padding pages ``-inf``. A score is an upper
        bound of ``q . k`` over the page's keys up to the fp32 rounding of its sum; NaN (``0 * inf`` for a bound out
        of fp16's range) becomes ``+inf``.
    """
    if reduce not in REDUCES:
        raise ValueError(f"reduce must be one of {tuple(REDUCES)}, got {reduce!r}")
    B, Hq, D, hkv = _check_scores_inputs(q, bounds, block_table, seq_lens)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    for name, v in (("keep_first", keep_first), ("keep_last", keep_last)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    W = block_table.shape[1]
    shape = (B, Hq, W) if reduce == "none" else (B, W)
    out = common.output_buffer("out", out, shape, torch.float32, q.device)
    if B == 0 or W == 0:
        return out
    grid, ce = _scores_config(B, W, Hq, hkv, D, q.dtype, page_size, reduce, block_p, num_warps, num_stages)
    _page_scores_kernel[grid](
        q, bounds, block_table, seq_lens, out, q.stride(0), q.stride(1), bounds.stride(0), bounds.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1) if reduce == "none" else 0, W, hkv,
        1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale), keep_first, keep_last, **ce,
    )
    return out


def _scores_config(B, W, Hq, hkv, D, q_dtype, page_size, reduce, block_p, num_warps, num_stages):
    """``(grid, constexprs and launch options)`` of the scores kernel."""
    if block_p is None:  # enough programs to fill the GPU (B * pages / BLOCK_P), else the largest tile
        block_p = 64 if B * -(-W // 64) >= 512 else 32 if B * -(-W // 32) >= 256 else 16
    elif isinstance(block_p, bool) or not isinstance(block_p, int) or block_p < 16 or block_p & (block_p - 1):
        raise ValueError(f"block_p must be a power of two >= 16, got {block_p!r}")
    G = Hq // hkv
    ce = dict(G=G, G_PAD=max(16, common.next_pow2(G)), HEAD_DIM=D, BLOCK_D=max(16, common.next_pow2(D)),
              BLOCK_P=block_p, PAGE=page_size, REDUCE=REDUCES[reduce], FP16_DOT=q_dtype == torch.float16,
              num_warps=num_warps)
    if num_stages is not None:
        ce["num_stages"] = num_stages
    return (-(-W // block_p), B), ce
