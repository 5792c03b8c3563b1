"""Quest page selection (Tang et al. 2024): per-block key bounds, page scores, and the compacted block table.

Quest keeps, per page (block) and kv head, the elementwise min and max of the page's keys; for a query ``q`` the
score ``sum_i max(q_i * min_i, q_i * max_i)`` bounds ``q . k`` for every key of the page, and decode attends only
to the top-k pages. Three kernels, each with its PyTorch reference in ``reference.py`` beside this module (or
``workbench.compress.quest``):

- :func:`key_bounds` recomputes the bounds ``[num_blocks, Hkv, 2, D]`` (fp16) of the blocks a write touched, from
  the keys *as stored*: read in any layout (nhd, hnd, vllm split key) and dequantized as the decode kernel
  dequantizes them (static fp8/int8 scales, per-token scales kept in the blocks). Why a separate pass after each
  write kernel rather than a min/max fused into the write: the bounds are then exact bounds of what attention
  reads (after fp8/int8 rounding, whatever the write kernel's rounding mode); a block's bound is one program's
  reduction over the block's stored tokens, so no atomics are needed even when one write puts many tokens into a
  block (a fused running min/max would need atomic min/max across the write kernel's programs, and fp32 atomics on
  fp16 bounds); and it is idempotent (a repeated or undone write leaves nothing stale, and a block newly handed to
  a sequence never keeps its previous owner's keys). It is cheap at decode: one block per sequence per layer
  (``block_size`` tokens' K), against a decode that reads the whole context.
- :func:`quest_page_scores` the score of every page of every sequence, ``[B, max_blocks]`` fp32. The block table
  is per sequence, so a selection that saves reads is one page set shared by all heads: the per-query-head bound
  is aggregated over heads (``reduce="max"`` or ``"sum"`` of ``sm_scale * bound``), or returned per head
  (``reduce="none"``, ``[B, Hq, max_blocks]``, for studies and the softmax-normalised aggregate). The products
  are two tensor-core dots, ``max(q, 0) @ max^T + min(q, 0) @ min^T`` (equal to the elementwise max since
  ``max >= min``). Padding pages score ``-inf``; pages to keep whatever their score (the sink, the last) ``+inf``.
- :func:`quest_select` the top ``page_budget`` pages of every sequence and the compacted table, in one launch (one
  program per sequence): a radix search over order-preserving int32 keys of the scores finds the budget-th largest,
  a prefix sum places the chosen pages in page order, their block ids and the new lengths are written (every chosen
  page full but the sequence's last, which keeps its partial length). Ties go to the lower page index, as in the
  reference (``workbench.compress.quest.select_pages``), so the tables match bit for bit. No host sync anywhere:
  the tables feed :class:`~workbench.kernels.decode.DecodePlan` built once on these buffers.
- :class:`QuestPlan` the last two planned once per decode step and run per layer (FlashInfer's plan / run): the
  checks and launch arguments made once, the scores and table buffers its own.

Index arithmetic is int64 (pools beyond 2**31 elements).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from workbench import quant
from workbench.backend import is_interpreted
from workbench.layout import Layout, addressing

from .. import common

FP16_MAX = 65504.0  # the bounds saturate here when the true bound lies inside fp16's range
REDUCES = {"max": 0, "sum": 1, "none": 2}  # the kernel's REDUCE


# ---- bounds -------------------------------------------------------------------------------
@triton.jit
def _key_bounds_kernel(
    k_ptr,  # one layer's K cache, any layout: blk*s_blk + tok*s_tok + head*s_head + (d // KX)*s_dgrp + (d % KX)*s_d
    blk_ptr,  # [N] block ids to recompute (distinct: one program per block and head group writes each bound)
    cnt_ptr,  # [N] tokens stored in each block, 0..PAGE (0: reset to the empty bound +inf / -inf)
    out_ptr,  # [num_blocks, Hkv, 2, D] fp16 bounds of this layer: [.., 0, :] min, [.., 1, :] max
    ks_ptr,  # fp32 static key scale, one or [Hkv] (SCALE_PTR)
    s_sc_h,  # head stride of ks_ptr (0: per tensor)
    num_heads,
    s_blk, s_tok, s_head, s_dgrp, s_d,  # K cache element strides (workbench.layout.addressing)
    s_ob, s_oh,  # bounds strides of a block and a head (min at +0, max at +HEAD_DIM)
    sc_blk, sc_off, sc_tg, sc_h, z_off,  # per-token scales in the blocks (QMODE 2, 3), in scale elements
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_T: tl.constexpr,  # tokens per block (PAGE) rounded up to a power of two
    BLOCK_H: tl.constexpr,  # kv heads per program (a power of two)
    KX: tl.constexpr,  # the vLLM key split x (HEAD_DIM for nhd / hnd)
    QMODE: tl.constexpr,  # 0 plain or static scale, 2 per-token scale, 3 per-token scale and zero point
    SCALE_PTR: tl.constexpr,
    SC_DTYPE: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_hg = tl.program_id(1)
    i_blk = tl.load(blk_ptr + i_n).to(tl.int64)
    n_tok = tl.load(cnt_ptr + i_n).to(tl.int32)

    o_t = tl.arange(0, BLOCK_T)
    o_h = i_hg * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_t = o_t < n_tok
    m_h = o_h < num_heads
    m_d = o_d < HEAD_DIM
    m_th = m_t[:, None] & m_h[None, :]  # [BLOCK_T, BLOCK_H]
    m_thd = m_th[:, :, None] & m_d[None, None, :]  # [BLOCK_T, BLOCK_H, BLOCK_D]
    o_row = (o_t * s_tok)[:, None] + (o_h.to(tl.int64) * s_head)[None, :]  # [BLOCK_T, BLOCK_H]
    o_col = (o_d // KX) * s_dgrp + (o_d % KX) * s_d  # [BLOCK_D]
    p_k = k_ptr + i_blk * s_blk + o_row[:, :, None] + o_col[None, None, :]
    b_k = tl.load(p_k, mask=m_thd, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_H, BLOCK_D] keys as stored (codes)
    if QMODE == 2 or QMODE == 3:  # per-token scales after the block's codes (workbench.quant.blocks)
        sc_base = k_ptr.to(tl.pointer_type(SC_DTYPE)) + sc_off
        o_s = i_blk * sc_blk + (o_t * sc_tg)[:, None] + (o_h.to(tl.int64) * sc_h)[None, :]  # [BLOCK_T, BLOCK_H]
        b_sc = tl.load(sc_base + o_s, mask=m_th, other=0.0).to(tl.float32)
        b_k = b_k * b_sc[:, :, None]
        if QMODE == 3:
            b_z = tl.load(sc_base + z_off + o_s, mask=m_th, other=0.0).to(tl.float32)
            b_k = b_k + b_z[:, :, None]
    if SCALE_PTR:
        b_ks = tl.load(ks_ptr + o_h * s_sc_h, mask=m_h, other=1.0)  # [BLOCK_H]
        b_k = b_k * b_ks[None, :, None]
    b_lo = tl.min(tl.where(m_thd, b_k, float("inf")), 0)  # [BLOCK_H, BLOCK_D] the keys as attention reads them
    b_hi = tl.max(tl.where(m_thd, b_k, float("-inf")), 0)
    # outward to fp16: a margin of 2**-10 relative (fp16's whole ulp, twice its rounding error) plus 2**-24 (its
    # smallest subnormal) keeps the rounded value a true bound; inf (an empty block) stays as it is; a bound inside
    # fp16's range saturates at its max instead of overflowing
    m_lo = tl.abs(b_lo) < float("inf")
    m_hi = tl.abs(b_hi) < float("inf")
    b_lo_f = tl.where(m_lo, b_lo, 0.0)  # no inf - inf on the discarded lanes
    b_hi_f = tl.where(m_hi, b_hi, 0.0)
    b_lo_w = b_lo_f - tl.abs(b_lo_f) * 0.0009765625 - 5.960464477539063e-08
    b_hi_w = b_hi_f + tl.abs(b_hi_f) * 0.0009765625 + 5.960464477539063e-08
    b_lo_w = tl.where(b_lo >= -65504.0, tl.maximum(b_lo_w, -65504.0), b_lo_w)
    b_hi_w = tl.where(b_hi <= 65504.0, tl.minimum(b_hi_w, 65504.0), b_hi_w)
    b_lo = tl.where(m_lo, b_lo_w, b_lo)
    b_hi = tl.where(m_hi, b_hi_w, b_hi)
    p_o = out_ptr + i_blk * s_ob + (o_h.to(tl.int64) * s_oh)[:, None] + o_d[None, :]  # [BLOCK_H, BLOCK_D]
    m_o = m_h[:, None] & m_d[None, :]
    tl.store(p_o, b_lo.to(tl.float16), mask=m_o)
    tl.store(p_o + HEAD_DIM, b_hi.to(tl.float16), mask=m_o)


def _cast_args(scheme, k_cache, block_size, hkv, head_dim, k_scale):
    if k_scale is not None:
        raise ValueError(f"k_scale is only for static-scale schemes; {scheme.name} has none")
    return 0, False, tl.float32, None, 0, (0, 0, 0, 0, 0)


def _static_args(scheme, k_cache, block_size, hkv, head_dim, k_scale):
    if not isinstance(k_scale, torch.Tensor) or k_scale.dtype != torch.float32 or k_scale.numel() not in (1, hkv):
        raise ValueError(f"k_scale must be an fp32 tensor of one element or [{hkv}] for {scheme.name}, got "
                         f"{common.describe(k_scale)}")
    if k_scale.device != k_cache.device:
        raise ValueError(f"k_scale must be on the cache's device {k_cache.device}, got {k_scale.device}")
    k_scale = k_scale.reshape(-1)
    return 0, True, tl.float32, k_scale, int(k_scale.numel() > 1), (0, 0, 0, 0, 0)


def _token_args(scheme, k_cache, block_size, hkv, head_dim, k_scale):
    if k_scale is not None:
        raise ValueError(f"k_scale is only for static-scale schemes; {scheme.name} has none")
    sc = common.block_scales_in(k_cache, "k_cache", scheme, "k", block_size, hkv, head_dim)
    item = sc.dtype.itemsize
    s_tg, s_h, _ = sc.strides
    qmode = 3 if sc.has_zero else 2
    args = (k_cache.stride(0) * k_cache.element_size() // item, sc.offset // item, s_tg, s_h, sc.count)
    return qmode, False, common.SCALE_DTYPES[sc.dtype], None, 0, args


# the bounds kernel's arguments by storage family (workbench.quant.families); a family without an entry has no
# key bounds (the groups family: its packed key groups and fp16 residual are not read per block)
BOUNDS_FAMILIES = {"cast": _cast_args, "static": _static_args, "token": _token_args}


def _scheme_args(scheme: quant.Scheme, k_cache: torch.Tensor, block_size: int, hkv: int, head_dim: int, k_scale):
    """``(QMODE, SCALE_PTR, SC_DTYPE, ks_ptr, s_sc_h, (sc_blk, sc_off, sc_tg, sc_h, z_off))`` for the bounds kernel."""
    build = BOUNDS_FAMILIES.get(scheme.family) if scheme.supports_key_bounds else None
    if build is None:
        raise ValueError(f"key bounds do not support {scheme.name}: its packed key groups (and its fp16 residual of "
                         "newest tokens) are not read per block")
    return build(scheme, k_cache, block_size, hkv, head_dim, k_scale)


def _k_geometry(k_cache: torch.Tensor, layout: Layout) -> tuple[int, int, int]:
    """``(block_size, kv heads, code_dim)`` of a K cache in ``layout``."""
    s = k_cache.shape
    if layout is Layout.NHD:
        return s[1], s[2], s[3]
    if layout is Layout.HND:
        return s[2], s[1], s[3]
    return s[3], s[1], s[2] * s[4]


def key_bounds(k_cache: torch.Tensor, layout: Layout | str, bounds: torch.Tensor, blocks: torch.Tensor,
               counts: torch.Tensor, *, quant=None, k_scale: torch.Tensor | None = None) -> None:
    """Recompute the key bounds of ``blocks`` from the keys stored in them, in place.

    Args:
        k_cache: one layer's K cache in ``layout`` (``[num_blocks, *block_shape]``; a quantized scheme's codes).
        layout: ``"nhd"``, ``"hnd"`` or ``"vllm"``.
        bounds: ``[num_blocks, Hkv, 2, head_dim]`` fp16, unit stride in ``head_dim``: ``[.., 0, :]`` the
            elementwise min, ``[.., 1, :]`` the max of the block's keys, rounded outward to fp16.
        blocks: ``[N]`` int32/int64 distinct block ids (the kernel does not check them).
        counts: ``[N]`` tokens stored in each block (its slots ``0 .. count - 1``); 0 resets the block's bound to
            the empty one (min ``+inf``, max ``-inf``: its pages score ``-inf``).
        quant: the cache's ``workbench.quant`` scheme (name or object) when its dtype alone does not say it.
        k_scale: fp32 static key scale (one element or ``[Hkv]``) of fp8/int8 per-tensor / per-head schemes.
    """
    layout = Layout.parse(layout)
    scheme = common.scheme_of(k_cache.dtype, quant)
    for name, t in (("bounds", bounds), ("blocks", blocks), ("counts", counts)):
        if not isinstance(t, torch.Tensor) or t.device != k_cache.device:
            raise ValueError(f"{name} must be a tensor on the cache's device {k_cache.device}, got "
                             f"{common.describe(t)}")
    block_size, hkv, code_dim = _k_geometry(k_cache, layout)
    head_dim = code_dim
    if bounds.dtype != torch.float16 or bounds.dim() != 4 or tuple(bounds.shape[1:]) != (hkv, 2, head_dim) \
            or bounds.shape[0] != k_cache.shape[0] or bounds.stride(3) != 1:
        raise ValueError(f"bounds must be fp16 [{k_cache.shape[0]}, {hkv}, 2, {head_dim}] with unit last stride, got "
                         f"{common.describe(bounds)}")
    if blocks.dim() != 1 or counts.shape != blocks.shape:
        raise ValueError(f"blocks and counts must be 1-D of one length, got {tuple(blocks.shape)} and "
                         f"{tuple(counts.shape)}")
    qmode, scale_ptr, sc_dtype, ks, s_sc_h, sc_args = _scheme_args(scheme, k_cache, block_size, hkv, head_dim,
                                                                    k_scale)
    n = blocks.shape[0]
    if n == 0:
        return
    blocks, counts = blocks.contiguous(), counts.contiguous()  # no-ops for the cache's own
    a = addressing(k_cache, layout, "k")
    block_t, block_d = triton.next_power_of_2(block_size), triton.next_power_of_2(head_dim)
    # kv heads per program: a [BLOCK_T, BLOCK_H, BLOCK_D] tile of <= 4k values on the GPU (registers; more programs
    # for a decode step's few blocks), <= 16k under the interpreter (fewer programs, each numpy op bigger)
    cap = 16384 if is_interpreted() else 4096
    block_h = min(triton.next_power_of_2(hkv), max(1, cap // (block_t * block_d)))
    _key_bounds_kernel[(n, triton.cdiv(hkv, block_h))](
        k_cache, blocks, counts, bounds, ks if ks is not None else bounds, s_sc_h, hkv,
        a.s_blk, a.s_tok, a.s_head, a.s_dgrp, a.s_d, bounds.stride(0), bounds.stride(1), *sc_args,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_T=block_t, BLOCK_H=block_h, KX=a.x, QMODE=qmode,
        SCALE_PTR=scale_ptr, SC_DTYPE=sc_dtype, num_warps=8,
    )


# ---- page scores --------------------------------------------------------------------------
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
    out = _buffer("out", out, shape, torch.float32, q.device)
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
    ce = dict(G=G, G_PAD=max(16, _next_pow2(G)), HEAD_DIM=D, BLOCK_D=max(16, _next_pow2(D)), BLOCK_P=block_p,
              PAGE=page_size, REDUCE=REDUCES[reduce], FP16_DOT=q_dtype == torch.float16, num_warps=num_warps)
    if num_stages is not None:
        ce["num_stages"] = num_stages
    return (-(-W // block_p), B), ce


def _next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` in plain Python (no constexpr-function wrapper on the per-call path)."""
    return 1 << (n - 1).bit_length()


# ---- the compacted table ------------------------------------------------------------------
INT_MIN = tl.constexpr(-(2**31))  # a padding lane's key: below every score's (-inf's is -2139095041)
INT_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _page_keys(sc_row, o_w, n_valid):
    """``[BLOCK_W]`` int32 keys of the page scores at ``o_w``, ordered as the scores: NaN counts as ``+inf`` (keep),
    ``-0.0`` as ``+0.0`` (equal scores, equal keys), the lanes past ``n_valid`` (padding) ``INT_MIN``."""
    m_w = o_w < n_valid
    b_s = tl.load(sc_row + o_w, mask=m_w, other=0.0)
    b_s = tl.where(b_s != b_s, float("inf"), b_s)
    b_s = tl.where(b_s == 0.0, 0.0, b_s)
    b_bits = b_s.to(tl.int32, bitcast=True)
    b_key = tl.where(b_bits < 0, b_bits ^ INT_MAX, b_bits)  # negatives: larger magnitude, smaller key
    return tl.where(m_w, b_key, INT_MIN)


@triton.jit
def _emit_tile(b_key, o_w, m_w, t_lo, t_hi, need, n_above, n_bucket, bt_row, out_row, last_page):
    """Write the chosen pages of one tile of keys to the compacted row, in page order. A page is chosen when its key
    is above the bucket ``[t_lo, t_hi]`` or it is one of the bucket's first ``need`` pages (lowest index first);
    ``n_above`` / ``n_bucket``: pages of each kind in the tiles before. Returns the updated counts and whether the
    sequence's last page is in this tile's choice."""
    m_above = m_w & (b_key > t_hi)
    m_bucket = m_w & (b_key >= t_lo) & (b_key <= t_hi)
    # one scan for both prefix counts: above in the low 16 bits, bucket in the high ones (a tile < 2**15 pages)
    b_cnt = tl.cumsum(m_above.to(tl.int32) + (m_bucket.to(tl.int32) << 16), 0)  # [BLOCK_W] inclusive
    b_above = n_above + (b_cnt & 0xFFFF)
    b_bucket = n_bucket + (b_cnt >> 16)
    m_sel = m_above | (m_bucket & (b_bucket <= need))
    b_pos = b_above + tl.minimum(b_bucket, need) - 1  # [BLOCK_W] this page's place in the compacted row
    b_blk = tl.load(bt_row + o_w, mask=m_sel, other=0)
    tl.store(out_row + b_pos, b_blk, mask=m_sel)
    n_tot = tl.sum(m_above.to(tl.int32) + (m_bucket.to(tl.int32) << 16), 0)
    has_last = tl.sum((m_sel & (o_w == last_page)).to(tl.int32), 0) > 0
    return n_above + (n_tot & 0xFFFF), n_bucket + (n_tot >> 16), has_last


@triton.jit
def _select_pages_kernel(
    sc_ptr,  # [B, W] fp32 page scores (padding past a sequence's pages is not read; forced pages +inf)
    bt_ptr,  # [B, W] int32 block table
    lens_ptr,  # [B] int32 context lengths
    out_bt_ptr,  # [B, K] int32 compacted table: the chosen pages' blocks in page order, then the first block
    out_lens_ptr,  # [B] int32 lengths over the compacted table
    W,  # table width (pages per row)
    K,  # pages chosen per sequence (min(page_budget, W))
    s_sc, s_bt, s_obt,  # row strides
    PAGE: tl.constexpr,  # tokens per page
    BLOCK_W: tl.constexpr,  # pages per tile (a power of two, < 2**15)
    ONE_TILE: tl.constexpr,  # W <= BLOCK_W: the row's keys stay in registers across the passes
    RADIX: tl.constexpr,  # key bits resolved per pass (2**RADIX candidates counted at once)
):
    i_b = tl.program_id(0)
    seq_len = tl.load(lens_ptr + i_b)
    n_pages = tl.cdiv(seq_len, PAGE)
    n_valid = tl.minimum(n_pages, W)
    kk = tl.minimum(K, n_valid)  # pages this sequence keeps
    sc_row = sc_ptr + i_b.to(tl.int64) * s_sc
    bt_row = bt_ptr + i_b.to(tl.int64) * s_bt
    out_row = out_bt_ptr + i_b.to(tl.int64) * s_obt
    o_w = tl.arange(0, BLOCK_W)
    o_r = tl.arange(0, 2**RADIX)
    n_tiles = tl.cdiv(n_valid, BLOCK_W)
    n_pad = n_tiles * BLOCK_W - n_valid  # padding lanes of the tiles read (key INT_MIN)
    if ONE_TILE:
        n_pad = BLOCK_W - n_valid
        b_key = _page_keys(sc_row, o_w, n_valid)  # [BLOCK_W]
    # radix search for the kk-th largest key, RADIX bits a pass from the top. Invariant: the bucket [t_lo, t_hi]
    # holds the kk-th largest key; n_ge keys are >= t_lo (>= kk), n_hi keys > t_hi (< kk). It stops early once
    # exactly kk keys are >= t_lo (then the whole bucket is chosen), after 32 / RADIX passes at most (then the
    # bucket is one key value: ties, the lowest pages first).
    t_lo = tl.full([], INT_MIN, tl.int32)
    t_hi = tl.full([], INT_MAX, tl.int32)
    n_ge = n_valid
    n_hi = tl.zeros([], dtype=tl.int32)
    shift = tl.full([], 32 - RADIX, tl.int32)
    while (n_ge > kk) & (shift >= 0):
        # [2**RADIX] each candidate's true value lies in [t_lo, t_hi] (int32); in the first pass o_r << shift wraps,
        # and the two's complement sum is still that value (no nsw: Triton's adds wrap, as numpy's)
        b_cand = t_lo + (o_r << shift)
        # [2**RADIX] keys >= each candidate: one reduction of a [2**RADIX, BLOCK_W] comparison for all of them
        if ONE_TILE:
            b_cnt = tl.sum((b_key[None, :] >= b_cand[:, None]).to(tl.int32), 1)
        else:
            b_cnt = tl.zeros([2**RADIX], dtype=tl.int32)
            for i_t in range(0, n_tiles):
                b_kt = _page_keys(sc_row, i_t * BLOCK_W + o_w, n_valid)
                b_cnt += tl.sum((b_kt[None, :] >= b_cand[:, None]).to(tl.int32), 1)
        b_cnt -= tl.where((o_r == 0) & (t_lo == INT_MIN), n_pad, 0)  # padding lanes pass only the INT_MIN candidate
        m_ok = b_cnt >= kk  # [2**RADIX] a prefix (counts fall as the candidate grows)
        d = tl.sum(m_ok.to(tl.int32), 0) - 1
        n_ge = tl.min(tl.where(m_ok, b_cnt, INT_MAX), 0)
        n_hi = tl.maximum(n_hi, tl.max(tl.where(m_ok, 0, b_cnt), 0))
        t_lo = t_lo + (d << shift)
        t_hi = t_lo + ((1 << shift) - 1)
        shift -= RADIX
    need = kk - n_hi  # bucket pages to take (all of it when the search stopped early)
    last_page = n_pages - 1
    n_above = tl.zeros([], dtype=tl.int32)
    n_bucket = tl.zeros([], dtype=tl.int32)
    if ONE_TILE:
        _, _, has_last = _emit_tile(b_key, o_w, o_w < n_valid, t_lo, t_hi, need, n_above, n_bucket, bt_row,
                                    out_row, last_page)
    else:
        has_last = n_valid < 0
        for i_t in range(0, n_tiles):
            o_t = i_t * BLOCK_W + o_w
            n_above, n_bucket, h = _emit_tile(_page_keys(sc_row, o_t, n_valid), o_t, o_t < n_valid, t_lo, t_hi,
                                              need, n_above, n_bucket, bt_row, out_row, last_page)
            has_last = has_last | h
    first = tl.load(bt_row)  # padding entries: a block of the sequence's row (never read past its length)
    for i_t in range(0, tl.cdiv(K, BLOCK_W)):
        o_t = i_t * BLOCK_W + o_w
        tl.store(out_row + o_t, tl.zeros([BLOCK_W], dtype=tl.int32) + first, mask=(o_t >= kk) & (o_t < K))
    last_len = seq_len - (n_pages - 1) * PAGE  # 1..PAGE tokens in the sequence's last page
    new_len = kk * PAGE - tl.where(has_last, PAGE - last_len, 0)
    tl.store(out_lens_ptr + i_b, tl.where(seq_len > 0, new_len, 0))


def _select_config(W: int, page_size: int, block_w: int | None, num_warps: int | None = None, radix: int = 4) -> dict:
    """The select kernel's constexprs and warps: the whole row in one tile up to 8192 pages (4096 under the
    interpreter), else tiles of that; 4 key bits a pass (16 candidates)."""
    if radix not in (2, 4):
        raise ValueError(f"radix must be 2 or 4 key bits a pass, got {radix!r}")
    if block_w is None:
        block_w = min(4096 if is_interpreted() else 8192, max(16, _next_pow2(max(W, 1))))
    elif isinstance(block_w, bool) or not isinstance(block_w, int) or block_w < 16 or block_w & (block_w - 1) \
            or block_w >= 2**15:
        raise ValueError(f"block_w must be a power of two in [16, 2**15), got {block_w!r}")
    if num_warps is None:  # 64+ keys a warp, 4 warps (one a scheduler) to 16 (four: the passes are issue-bound)
        num_warps = min(16, max(4, block_w // 64))
    return dict(PAGE=page_size, BLOCK_W=block_w, ONE_TILE=W <= block_w, RADIX=radix, num_warps=num_warps)


def _check_select_inputs(block_table, seq_lens, page_budget, page_size, out_table, out_lens):
    """``(B, W, k, out_table, out_lens)`` (the buffers made when not given) after the checks."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or (block_table.shape[1] and block_table.stride(1) != 1):
        raise ValueError(f"block_table must be an int32 [B, max_blocks] tensor with unit last stride, got "
                         f"{common.describe(block_table)}")
    B, W = block_table.shape
    dev = block_table.device
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32 or seq_lens.shape != (B,) \
            or seq_lens.device != dev:
        raise ValueError(f"seq_lens must be an int32 [{B}] tensor on {dev}, got {common.describe(seq_lens)}")
    if isinstance(page_budget, bool) or not isinstance(page_budget, int) or page_budget < 1:
        raise ValueError(f"page_budget must be an int >= 1, got {page_budget!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    k = min(page_budget, W)
    out_table = _buffer("out_table", out_table, (B, k), torch.int32, dev)
    out_lens = _buffer("out_lens", out_lens, (B,), torch.int32, dev)
    return B, W, k, out_table, out_lens


def _buffer(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, dev) -> torch.Tensor:
    """A caller's output buffer after its checks (shape, dtype, device, unit last stride), or a new one."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=dev)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype or t.device != dev \
            or (len(shape) > 1 and shape[-1] and t.stride(-1) != 1):
        kind = {torch.float32: "fp32", torch.int32: "int32"}.get(dtype, str(dtype))
        raise ValueError(f"{name} must be an {kind} {list(shape)} tensor on {dev} with unit last stride, got "
                         f"{common.describe(t)}")
    return t


def quest_select(scores: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, page_budget: int, *,
                 page_size: int, out_table: torch.Tensor | None = None, out_lens: torch.Tensor | None = None,
                 block_w: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The compacted block table of each sequence's ``page_budget`` best pages: one launch, on the device (no host
    sync, no ``torch.topk``).

    The choice is :func:`workbench.compress.quest.select_pages`' (the reference, the same table bit for bit): per
    sequence the ``min(page_budget, pages)`` pages of highest score among its ``ceil(seq_lens / page_size)`` pages,
    equal scores going to the lower page index; NaN counts as ``+inf``, ``-0.0`` as ``+0.0``. The forced pages are
    the scores kernel's ``+inf`` (``keep_first`` / ``keep_last``); the scores of padding pages are not read.

    Args:
        scores: ``[B, max_blocks]`` fp32 page scores (:func:`quest_page_scores`), unit last stride.
        block_table: ``[B, max_blocks]`` int32, unit last stride; seq_lens: ``[B]`` int32.
        page_budget: pages kept per sequence (all of them where a sequence has fewer).
        page_size: tokens per page.
        out_table, out_lens: optional buffers ``[B, min(page_budget, max_blocks)]`` / ``[B]`` int32 (a plan's).
        block_w: pages per tile of the kernel (a power of two; default: the whole row up to 8192 pages). Tests use
            small tiles to cover rows of several.

    Returns:
        ``(table, lens)``: the chosen pages' blocks in their original order (then padding: the sequence's first
        block, never read), and each sequence's length over them (every chosen page full but the sequence's last,
        which keeps its partial length).

    One program per sequence: the scores become order-preserving int32 keys; a radix search (4 key bits a pass,
    16 candidate thresholds counted in one reduction, at most 8 passes, fewer once exactly the budget's count is
    above a threshold) finds the budget-th largest key; one prefix sum then places every chosen page at its rank
    in page order.
    """
    B, W, k, out_table, out_lens = _check_select_inputs(block_table, seq_lens, page_budget, page_size, out_table,
                                                        out_lens)
    if not isinstance(scores, torch.Tensor) or scores.shape != (B, W) or scores.dtype != torch.float32 \
            or scores.device != block_table.device or (W and scores.stride(1) != 1):
        raise ValueError(f"scores must be an fp32 [{B}, {W}] tensor on {block_table.device} with unit last stride, "
                         f"got {common.describe(scores)}")
    ce = _select_config(W, page_size, block_w)
    if B and W:
        _select_pages_kernel[(B,)](scores, block_table, seq_lens, out_table, out_lens, W, k, scores.stride(0),
                                   block_table.stride(0), out_table.stride(0), **ce)
    return out_table, out_lens


# ---- plan once per step, run per layer ----------------------------------------------------
class QuestPlan:
    """Quest's page choice for one batch, planned once per decode step (as
    :class:`~workbench.kernels.decode.DecodePlan`), run per layer: the page scores (:func:`quest_page_scores`)
    into a scores buffer, then the compacted table (:func:`quest_select`) into the table buffers, both owned by the
    plan. Everything but ``q`` and the layer's ``bounds`` is checked and turned into launch arguments here, so
    ``run`` only compares their metadata with the plan and launches two kernels: no host sync, no allocation (CUDA
    graph capture works).

    Args:
        block_table: ``[B, max_blocks]`` int32 (the full table); seq_lens: ``[B]`` int32.
        page_budget: pages kept per sequence, the forced ones included.
        page_size: tokens per page; num_q_heads, num_kv_heads, head_dim: the queries' and bounds' shape;
            q_dtype: the queries' dtype.
        reduce: ``"max"`` or ``"sum"`` (``quest_page_scores``; ``"none"`` has no single page set).
        sm_scale, keep_first, keep_last: as for :func:`quest_page_scores`.
        scores, out_table, out_lens: optional buffers (``[B, max_blocks]`` fp32, ``[B, k]`` / ``[B]`` int32).
        block_p, num_warps, num_stages: the scores kernel's launch overrides (:func:`quest_page_scores`).
        block_w, select_warps, select_radix: the select kernel's (pages per tile, warps, key bits a pass: 2, 4).

    ``block_table`` / ``seq_lens`` are referenced, not copied (their contents may change between runs, as for a
    DecodePlan); after ``run`` the plan's ``block_table_out`` / ``seq_lens_out`` hold the compacted table.
    """

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, page_budget: int, *, page_size: int,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, q_dtype: torch.dtype, reduce: str = "sum",
                 sm_scale: float | None = None, keep_first: int = 0, keep_last: int = 0,
                 scores: torch.Tensor | None = None, out_table: torch.Tensor | None = None,
                 out_lens: torch.Tensor | None = None, block_p: int | None = None, num_warps: int = 4,
                 num_stages: int | None = None, block_w: int | None = None, select_warps: int | None = None,
                 select_radix: int = 4):
        if reduce not in ("max", "sum"):
            raise ValueError(f"reduce must be 'max' or 'sum' (one page set per sequence), got {reduce!r}")
        B, W, k, out_table, out_lens = _check_select_inputs(block_table, seq_lens, page_budget, page_size, out_table,
                                                            out_lens)
        for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if q_dtype not in common.Q_DTYPES:
            raise ValueError(f"q_dtype must be fp16, bf16 or fp32, got {q_dtype}")
        for name, v in (("keep_first", keep_first), ("keep_last", keep_last)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        dev = block_table.device
        scores = _buffer("scores", scores, (B, W), torch.float32, dev)
        D, hkv = head_dim, num_kv_heads
        self.scores, self.block_table_out, self.seq_lens_out = scores, out_table, out_lens
        self.device, self.q_dtype, self._q_shape, self._bounds_row = dev, q_dtype, (B, num_q_heads, D), (hkv, 2, D)
        self._launch = B > 0 and W > 0
        self._scores_grid, self._scores_ce = _scores_config(B, W, num_q_heads, hkv, D, q_dtype, page_size, reduce,
                                                            block_p, num_warps, num_stages)
        self._scores_args = (block_table, seq_lens, scores)
        self._scores_tail = (block_table.stride(0), scores.stride(0), 0, W, hkv,
                             1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale), keep_first, keep_last)
        self._select_args = (scores, block_table, seq_lens, out_table, out_lens, W, k, scores.stride(0),
                             block_table.stride(0), out_table.stride(0))
        self._select_ce = _select_config(W, page_size, block_w, select_warps, select_radix)

    def score(self, q: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        """The page scores of ``q`` ``[B, Hq, D]`` over one layer's ``bounds`` into ``scores`` (one launch)."""
        if not isinstance(q, torch.Tensor) or q.shape != self._q_shape or q.dtype != self.q_dtype \
                or q.device != self.device or q.stride(2) != 1:
            raise ValueError(f"q must be a {self.q_dtype} tensor of shape {self._q_shape} on {self.device} with unit "
                             f"last stride, as planned; got {common.describe(q)}")
        s_b = bounds.stride() if isinstance(bounds, torch.Tensor) and bounds.dim() == 4 else None
        if s_b is None or bounds.dtype != torch.float16 or bounds.shape[1:] != self._bounds_row \
                or bounds.device != self.device or s_b[3] != 1 or s_b[2] != self._bounds_row[2]:
            raise ValueError(f"bounds must be fp16 [num_blocks, {', '.join(map(str, self._bounds_row))}] on "
                             f"{self.device} (min, max rows contiguous); got {common.describe(bounds)}")
        if self._launch:
            bt, lens, out = self._scores_args
            _page_scores_kernel[self._scores_grid](q, bounds, bt, lens, out, q.stride(0), q.stride(1), s_b[0], s_b[1],
                                                   *self._scores_tail, **self._scores_ce)
        return self.scores

    def select(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The compacted ``(block_table, seq_lens)`` from the scores buffer (one launch)."""
        if self._launch:
            _select_pages_kernel[(self._q_shape[0],)](*self._select_args, **self._select_ce)
        return self.block_table_out, self.seq_lens_out

    def run(self, q: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`score` then :meth:`select`: the compacted ``(block_table, seq_lens)`` for ``q`` over ``bounds``."""
        self.score(q, bounds)
        return self.select()
