"""Quantize-on-write of the ``token`` family (fp8 / int8 symmetric, uint8 asymmetric): one fp32 scale (and zero
point) per token and kv head, computed from the row in registers, stored in the block after its codes.

One program quantizes ``BLOCK_T`` tokens of one kv head, K or V. A row's ``D`` channels are loaded as ``P`` planes
of ``W`` (channel ``k * W + j``), each a ``[BLOCK_T, W]`` tile of its own, all of one layout: a thread holds the
same rows in every plane, so it covers ``P`` times the channels of each of its rows that a ``[BLOCK_T, D]`` tile
gives it, and the row's work (slot, address, the scale's division and reciprocal, the reduction's shuffles) is
spread over ``P`` times the elements. (One 3-D ``[P, BLOCK_T, W]`` tile would do the same where Triton puts the
plane axis in a thread; Triton 3.6 and 3.9 order two axes of one contiguity the opposite ways.)
One pass: load, reduce (NaN-propagating, so a bad row is seen), scale, codes by :func:`~.qmath._div_rcp` (three
FMAs an element, IEEE's quotient) and the low byte of one add (integers) or the converter (fp8: ``cvt.rn.satfinite``
on the GPU, rounded in software under the interpreter), store. No clamp: ``|x| / scale`` rounds to at most ``QMAX``
(``scale = amax / QMAX`` rounded; asymmetric: ``0 <= x - min <= max - min``).

The rare path (a program holding a NaN/Inf, or a scale below ``2**-80``, which only an fp32/bf16 source reaches)
counts the non-finite inputs into ``bad_ptr`` and recomputes the tile with IEEE division and clamps, the arithmetic
of ``kernels/write/dynamic.py``'s generic kernel.

The source is ``[T, H, D]`` rows or blocks read where they lie (``SRC_BS``, ``qmath._src_rows``: a tier's demotion);
with ``ZERO_NONFINITE`` its NaN/Inf are stored as 0 and counted as they are loaded, so the rare path never sees one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel import FP8_GRID, SOFT_ROUND, _quantize, _round_to_grid
from .qmath import (
    TINY_SCALE,
    _columns,
    _div_rcp,
    _div_rcp_signed,
    _int_bits,
    _int_codes,
    _n_nonfinite,
    _rcp,
    _rmax,
    _rmin,
    _slot_rows,
    _src_cols,
    _src_rows,
    _zero_nonfinite,
    rcp32,
)


@triton.jit
def _scale(b_r, FP16: tl.constexpr, QMAX: tl.constexpr, RQ: tl.constexpr):
    """``r / QMAX`` rounded as IEEE division: three FMAs where ``r`` is a difference or magnitude of fp16 values
    (0 or >= 2**-24: nothing subnormal), else ``div_rn`` (an fp32 source's tiny range must be exact too)."""
    if FP16:
        b_s = _div_rcp(b_r, QMAX, RQ)
    else:
        b_s = tl.math.div_rn(b_r, tl.full(b_r.shape, QMAX, tl.float32))
    return b_s


@triton.jit
def _stats(b_xs, m_c, SYM: tl.constexpr, PAD: tl.constexpr):
    """A plane's ``(amax, amax)`` (symmetric) or ``(min, max)`` per row, NaN-propagating, in the source's dtype
    (exact); ``PAD``: channels past ``HEAD_DIM`` (``m_c`` false) are out of the range."""
    if SYM:
        b_a = _rmax(tl.abs(b_xs), 1, False)
        b_b = b_a
    elif PAD:
        b_a = _rmin(tl.where(m_c, b_xs, float("inf")), 1, False)
        b_b = _rmax(tl.where(m_c, b_xs, float("-inf")), 1, False)
    else:
        b_a = _rmin(b_xs, 1, False)
        b_b = _rmax(b_xs, 1, False)
    return b_a, b_b


@triton.jit
def _merge(b_a, b_b, b_ak, b_bk, SYM: tl.constexpr):
    """Row statistics of two planes as one (:func:`_stats`), NaN-propagating."""
    if SYM:
        b_a = tl.maximum(b_a, b_ak, propagate_nan=tl.PropagateNan.ALL)
    else:
        b_a = tl.minimum(b_a, b_ak, propagate_nan=tl.PropagateNan.ALL)
    return b_a, tl.maximum(b_b, b_bk, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _codes(b_xs, b_s, b_r, b_lo, SYM: tl.constexpr, FP8: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
           SOFT: tl.constexpr, DTYPE: tl.constexpr):
    """A plane's codes, the fast path: three FMAs an element, no clamp (module docstring)."""
    b_x = b_xs.to(tl.float32)
    if not SYM:
        b_x = b_x - b_lo[:, None]
    if FP8:  # the sign of a zero is in the code
        b_y = _div_rcp_signed(b_x, b_s[:, None], b_r[:, None])
        if SOFT:  # the interpreter's converter is inexact: round in software
            b_y = _round_to_grid(b_y, MANT, EMIN)
        b_q = b_y.to(DTYPE)
    else:
        b_q = _int_bits(_div_rcp(b_x, b_s[:, None], b_r[:, None])).to(DTYPE)  # the low byte
    return b_q


@triton.jit
def _rare_codes(p_x, m_x, m_n, b_s, b_lo, bad_ptr, SYM: tl.constexpr, FP8: tl.constexpr, QMIN: tl.constexpr,
                QMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, SOFT: tl.constexpr,
                DTYPE: tl.constexpr, ZERO: tl.constexpr):
    """A plane's codes on the rare path: loaded again, its NaN/Inf (where ``m_n``) counted into ``bad_ptr`` (``ZERO``:
    zeroed again, counted already), IEEE division and clamps (the generic kernel's arithmetic)."""
    b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
    if ZERO:  # zeroed and counted when first loaded: zeroed again, so nothing is counted twice
        b_x, _ = _zero_nonfinite(b_x, m_n)
    n_bad = _n_nonfinite(b_x, m_n)
    if n_bad > 0:
        tl.atomic_add(bad_ptr, n_bad)
    if SYM:
        b_q = _quantize(b_x, b_s[:, None], DTYPE, 1 if FP8 else 2, QMIN, QMAX, MANT, EMIN, 0, SOFT)
    else:
        b_y = tl.math.div_rn(b_x - b_lo[:, None], b_s[:, None] + tl.zeros_like(b_x))
        b_q = _int_codes(b_y, QMAX).to(DTYPE)
    return b_q


@triton.jit
def _write_token_kernel(
    src_ptr,  # K or V of the new tokens: [T, H, D] rows, unit stride in D, or blocks (SRC_BS)
    cache_ptr,  # one layer's K or V codes, any layout (1-byte elements)
    slot_ptr,  # [T] int32/int64 slots, -1 = padding
    bad_ptr,  # [1] int32: non-finite inputs seen
    num_tokens, block_size, num_slots,
    s_st, s_sh,  # source strides (token, head)
    s_sblk, s_sdgrp,  # a source in blocks: block stride, vLLM key group stride (qmath._src_rows, _src_cols)
    s_blk, s_tok, s_head, s_dgrp,  # code (blk, tok, h, c) at blk*s_blk + tok*s_tok + h*s_head + (c // X)*s_dgrp + ...
    sc_blk, sc_off, sc_tg, sc_h, z_off,  # fp32 scales (then zero points) in blocks, in scale elements
    S_D: tl.constexpr, X: tl.constexpr,  # ... + (c % X)*S_D: stride of c inside a 16-byte group, the group (X == D)
    SYM: tl.constexpr,  # scale = amax / QMAX; else scale = (max - min) / QMAX and zero point min (uint8 codes)
    FP8: tl.constexpr,  # fp8 codes (else integer codes)
    QMIN: tl.constexpr, QMAX: tl.constexpr, RQ: tl.constexpr,  # RQ: 1 / QMAX rounded to fp32
    MANT: tl.constexpr, EMIN: tl.constexpr, SOFT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    P: tl.constexpr, W: tl.constexpr,  # a row as P (1, 2 or 4) planes of W channels (P * W >= HEAD_DIM)
    SHIFT: tl.constexpr,  # log2(block_size), or -1
    TINY: tl.constexpr,  # the rare path's scale bound (qmath.TINY_SCALE)
    BLOCK_T: tl.constexpr,  # tokens per program
    SRC_BS: tl.constexpr, SS_D: tl.constexpr, SX: tl.constexpr,  # the source's tokens a block (0: rows), channels
    ZERO_NONFINITE: tl.constexpr,  # NaN/Inf inputs stored as 0 and counted here (a tier's device blocks)
):
    PAD: tl.constexpr = HEAD_DIM != P * W
    DTYPE: tl.constexpr = cache_ptr.dtype.element_ty
    i_tb = tl.program_id(0)
    i_h = tl.program_id(1)
    o_t = i_tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    o_j = tl.arange(0, W)[None, :]  # [1, W] channel k * W + j of plane k
    p_x = src_ptr + _src_rows(o_t, i_h, s_st, s_sh, s_sblk, SRC_BS)[:, None] + _src_cols(o_j, s_sdgrp, SS_D, SX)
    d_w = _src_cols(W, s_sdgrp, SS_D, SX)  # plane k is k * d_w on: W channels (rows: W itself)
    m_t = (o_t < num_tokens)[:, None]
    # every plane's load first (they go out together), in the source's dtype: min/max are exact in it
    b_x0 = tl.load(p_x, mask=m_t & (o_j < HEAD_DIM), other=0.0)  # [BLOCK_T, W]
    if P >= 2:
        b_x1 = tl.load(p_x + d_w, mask=m_t & (W + o_j < HEAD_DIM), other=0.0)
    if P == 4:
        b_x2 = tl.load(p_x + 2 * d_w, mask=m_t & (2 * W + o_j < HEAD_DIM), other=0.0)
        b_x3 = tl.load(p_x + 3 * d_w, mask=m_t & (3 * W + o_j < HEAD_DIM), other=0.0)
    m_w, i_blk, i_off = _slot_rows(slot_ptr, o_t, num_tokens, block_size, num_slots, SHIFT)
    if ZERO_NONFINITE:  # before the statistics, so no NaN/Inf reaches a scale; counted over the written tokens
        m_z = m_w[:, None]
        b_x0, n_bad = _zero_nonfinite(b_x0, m_z & (o_j < HEAD_DIM))
        if P >= 2:
            b_x1, n_k = _zero_nonfinite(b_x1, m_z & (W + o_j < HEAD_DIM))
            n_bad += n_k
        if P == 4:
            b_x2, n_k = _zero_nonfinite(b_x2, m_z & (2 * W + o_j < HEAD_DIM))
            n_bad += n_k
            b_x3, n_k = _zero_nonfinite(b_x3, m_z & (3 * W + o_j < HEAD_DIM))
            n_bad += n_k
        if n_bad > 0:
            tl.atomic_add(bad_ptr, n_bad)
    b_a, b_b = _stats(b_x0, o_j < HEAD_DIM, SYM, PAD)  # [BLOCK_T]
    if P >= 2:
        b_ak, b_bk = _stats(b_x1, W + o_j < HEAD_DIM, SYM, PAD)
        b_a, b_b = _merge(b_a, b_b, b_ak, b_bk, SYM)
    if P == 4:
        b_ak, b_bk = _stats(b_x2, 2 * W + o_j < HEAD_DIM, SYM, PAD)
        b_a, b_b = _merge(b_a, b_b, b_ak, b_bk, SYM)
        b_ak, b_bk = _stats(b_x3, 3 * W + o_j < HEAD_DIM, SYM, PAD)
        b_a, b_b = _merge(b_a, b_b, b_ak, b_bk, SYM)
    FP16: tl.constexpr = src_ptr.dtype.element_ty == tl.float16
    if SYM:
        b_amax = b_a.to(tl.float32)
        b_s = _scale(b_amax, FP16, QMAX, RQ)
        b_s = tl.where(b_s > 0, b_s, 1.0)  # amax == 0, or amax / QMAX underflowing: never a division by 0
        b_s = tl.where(b_amax == b_amax, b_s, b_amax)  # a NaN row keeps a NaN scale (counted on the rare path)
        b_lo = b_s  # no zero point (keeps both branches' values one type)
        b_ok = b_amax < float("inf")
    else:
        b_lo = b_a.to(tl.float32)
        b_hi = b_b.to(tl.float32)
        b_s = _scale(b_hi - b_lo, FP16, QMAX, RQ)
        b_s = tl.where(b_s > 0, b_s, 1.0)  # a constant row or an underflow (a NaN row: counted on the rare path)
        b_ok = (b_hi - b_lo) < float("inf")
    if not FP16:  # an fp16 source's scales are >= 2**-24 / QMAX: never tiny
        b_ok = b_ok & (b_s >= TINY)
    b_r = _rcp(b_s)
    b_q0 = _codes(b_x0, b_s, b_r, b_lo, SYM, FP8, MANT, EMIN, SOFT, DTYPE)
    if P >= 2:
        b_q1 = _codes(b_x1, b_s, b_r, b_lo, SYM, FP8, MANT, EMIN, SOFT, DTYPE)
    if P == 4:
        b_q2 = _codes(b_x2, b_s, b_r, b_lo, SYM, FP8, MANT, EMIN, SOFT, DTYPE)
        b_q3 = _codes(b_x3, b_s, b_r, b_lo, SYM, FP8, MANT, EMIN, SOFT, DTYPE)
    if tl.sum((~b_ok).to(tl.int32), 0) > 0:  # a NaN/Inf or a tiny scale: count, and divide as IEEE does
        m_n = m_w[:, None]
        b_q0 = _rare_codes(p_x, m_t & (o_j < HEAD_DIM), m_n & (o_j < HEAD_DIM), b_s, b_lo, bad_ptr, SYM, FP8, QMIN,
                           QMAX, MANT, EMIN, SOFT, DTYPE, ZERO_NONFINITE)
        if P >= 2:
            b_q1 = _rare_codes(p_x + d_w, m_t & (W + o_j < HEAD_DIM), m_n & (W + o_j < HEAD_DIM), b_s, b_lo, bad_ptr,
                               SYM, FP8, QMIN, QMAX, MANT, EMIN, SOFT, DTYPE, ZERO_NONFINITE)
        if P == 4:
            b_q2 = _rare_codes(p_x + 2 * d_w, m_t & (2 * W + o_j < HEAD_DIM), m_n & (2 * W + o_j < HEAD_DIM), b_s,
                               b_lo, bad_ptr, SYM, FP8, QMIN, QMAX, MANT, EMIN, SOFT, DTYPE, ZERO_NONFINITE)
            b_q3 = _rare_codes(p_x + 3 * d_w, m_t & (3 * W + o_j < HEAD_DIM), m_n & (3 * W + o_j < HEAD_DIM), b_s,
                               b_lo, bad_ptr, SYM, FP8, QMIN, QMAX, MANT, EMIN, SOFT, DTYPE, ZERO_NONFINITE)
    p_sc = cache_ptr.to(tl.pointer_type(tl.float32)) + sc_off + i_h.to(tl.int64) * sc_h + i_blk * sc_blk + i_off * sc_tg
    tl.store(p_sc, b_s, mask=m_w)
    if not SYM:
        tl.store(p_sc + z_off, b_lo, mask=m_w)
    p_c = cache_ptr + (i_blk * s_blk + i_off * s_tok + i_h.to(tl.int64) * s_head)[:, None]  # [BLOCK_T, 1] rows
    m_c = m_w[:, None]
    tl.store(p_c + _columns(o_j, s_dgrp, S_D, X, P * W), b_q0, mask=m_c & (o_j < HEAD_DIM))
    if P >= 2:
        tl.store(p_c + _columns(W + o_j, s_dgrp, S_D, X, P * W), b_q1, mask=m_c & (W + o_j < HEAD_DIM))
    if P == 4:
        tl.store(p_c + _columns(2 * W + o_j, s_dgrp, S_D, X, P * W), b_q2, mask=m_c & (2 * W + o_j < HEAD_DIM))
        tl.store(p_c + _columns(3 * W + o_j, s_dgrp, S_D, X, P * W), b_q3, mask=m_c & (3 * W + o_j < HEAD_DIM))


def token_kernel(scheme, kind: str, head_dim: int, sc, tokens_per_program: int | None, num_warps: int | None):
    """``(kernel, tokens a program, constexprs)`` of one kind's launch (``kernels/write/dynamic.py``'s table): every
    shape (``HEAD_DIM`` padded to the planes)."""
    fmt = scheme.format
    mant, emin = FP8_GRID.get(fmt.storage, (0, 0))
    shape = token_launch_shape(head_dim, tokens_per_program, num_warps)
    consts = dict(SYM=scheme.symmetric, FP8=fmt.codes == "fp8", QMIN=fmt.qmin, QMAX=fmt.qmax, RQ=rcp32(fmt.qmax),
                  MANT=mant, EMIN=emin, SOFT=SOFT_ROUND, HEAD_DIM=head_dim, TINY=TINY_SCALE, **shape)
    return _write_token_kernel, shape["BLOCK_T"], consts


def token_launch_shape(head_dim: int, tokens_per_program: int | None, num_warps: int | None) -> dict:
    """``P``, ``W``, ``BLOCK_T`` and ``num_warps`` of a launch: four planes (a thread then holds 32 channels of a
    row), 64 tokens (16 KB of fp16 source a program at ``D = 128``) over 4 warps."""
    block_d = triton.next_power_of_2(head_dim)
    p = 4 if block_d >= 32 else max(1, block_d // 8)
    return dict(P=p, W=block_d // p, BLOCK_T=tokens_per_program or 64, num_warps=num_warps or 4)
