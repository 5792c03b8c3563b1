"""Write-to-cache: new tokens' K and V into one layer's paged cache, with optional quantization.

``slot_mapping[t] = block * block_size + offset`` says where token ``t`` goes (``-1``: a
padding token, skipped). One launch writes K and V, in one of two program shapes (``scheme``):

- ``"head"``: a program moves ``BLOCK_T`` tokens x one head x the whole ``head_dim`` row, K then
  V; the grid is (token tiles, heads), heads the slow axis.
- ``"rows"``: a program moves ``BLOCK_T`` tokens x ``BLOCK_H`` heads (all heads by default) x
  ``head_dim``; the grid is one axis, head groups fastest, so neighbouring programs touch
  neighbouring memory. Every load (K, V, scales, slots) is issued before the first store, so a
  program waits for memory once. In NHD a run of consecutive slots is one contiguous
  ``[BLOCK_T, H * D]`` region of the page. ``kv_split=True`` gives K and V separate programs.

Storage conventions (the same as :func:`workbench.kernels.write.reference.write_kv_ref`):

- fp32 / fp16 / bf16 caches: a plain cast (round to nearest even).
- fp8 (e4m3fn / e5m2) caches, vLLM's convention: ``stored = fp8(clamp(x / scale, -max, max))``
  with ``scale`` fp32, per tensor (one element) or per KV head (``[H]``). Saturating, as the
  hardware conversion on Hopper does.
- int8 caches: ``stored = clamp(round_half_even(x / scale), -128, 127)``.

How the codes are computed (``quant_math``):

- ``"exact"``: IEEE division (``div_rn``), then rounding (half to even) onto the fp8 grid in fp32
  arithmetic before an exact cast, so the codes do not depend on the converter (the
  interpreter's fp32 -> fp8 cast rounds ties up and drops carries into the exponent: the midpoint
  cases of ``tests/test_write_copy.py``).
- ``"cast"``: IEEE division, then the converter rounds. On the GPU that is one
  ``cvt.rn.satfinite`` (round half to even, saturating: no clamp before it), so the codes equal
  ``"exact"``'s; under the interpreter the software rounding is kept, because its converter is not exact.

For an fp16 source ``"exact"`` and ``"cast"`` divide in three FMAs from the program's ``1 / scale``
(``qmath._div_rcp``: IEEE's quotient, ``-0`` kept for fp8), not an IEEE division an element; the reciprocal is
capped at ``2**100`` (``|x| <= 65504`` then keeps every product finite, and ``x / scale`` past ``2**76``
saturates either way). Scales must be finite and > 0 (the cache checks).
- ``"rcp"``: ``x * (1 / scale)`` with the reciprocal computed once per program, then the converter.
  The product can differ from ``x / scale`` in the last fp32 bit, so a code can differ from
  torch's by one where ``x / scale`` lies within an fp32 ulp of a midpoint between two codes
  (rare; never when the scale is a power of two).

Tests allow one code at exact midpoints for all three (and at near-midpoints for ``"rcp"``).

Access pattern: in every layout the source is read as rows of ``head_dim``, 16 bytes a lane.
NHD, HND and the vLLM split key keep ``head_dim`` (or 16-byte groups of it) innermost, so stores
vectorize along ``d``. The vLLM value layout keeps *tokens* innermost (``[H, D, block_size]``):
when a program's tokens are a run of consecutive slots inside one block (prefill), it stores the
tile transposed, vectorized along the token axis; otherwise (decode) it scatters along ``d``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.core.backend import is_interpreted

from .. import common
from .qmath import _div_rcp, _div_rcp_signed

FP8_DTYPES = common.FP8_DTYPES
SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what K/V may arrive in
FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # mantissa bits, smallest normal exponent
QUANT_NONE, QUANT_FP8, QUANT_INT8 = 0, 1, 2
SCHEMES = ("head", "rows")
QUANT_MATHS = ("exact", "cast", "rcp")  # index = the kernels' QMATH
SOFT_ROUND = is_interpreted()  # the converter is inexact only in the interpreter: round in software there


@triton.jit
def _round_to_grid(b_f, MANT: tl.constexpr, EMIN: tl.constexpr):
    """Round fp32 to the nearest value with MANT mantissa bits (exponent >= EMIN, subnormals below), ties to
    even, in fp32 arithmetic; the cast that follows is then exact, whatever rounding the converter uses."""
    b_a = tl.abs(b_f)
    b_e = ((b_a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # unbiased exponent (-127 for zero)
    b_ulp = tl.maximum(b_e, EMIN) - MANT  # log2 of the target format's spacing at |b_f|
    b_c = (((b_ulp + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)  # 1.5 * 2**(ulp + 23)
    b_r = (b_a + b_c) - b_c  # the add rounds |b_f| to a multiple of 2**ulp, ties to even
    b_r = (b_r.to(tl.int32, bitcast=True) | (b_f.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32,
                                                                                                bitcast=True)  # -0.0 too
    return tl.where(b_e > 100, b_f, b_r)  # huge, inf, NaN: left to the cast (b_c would overflow)


@triton.jit
def _quantize(
    b_x, b_scale, out_dtype: tl.constexpr, QUANT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
    MANT: tl.constexpr, EMIN: tl.constexpr, QMATH: tl.constexpr, SOFT: tl.constexpr,
):
    """Source tile -> storage codes (see the module docstring). For QMATH 2 ``b_scale`` is 1 / scale."""
    if QUANT == 0:
        b_q = b_x.to(out_dtype)
        if out_dtype == tl.bfloat16:
            if b_x.dtype != tl.bfloat16:  # round to nearest even first: the interpreter's fp32 -> bf16 cast truncates
                b_q = _round_to_grid(b_x.to(tl.float32), 7, -126).to(out_dtype)
    else:
        if QMATH == 2:
            b_f = b_x.to(tl.float32) * b_scale  # one multiply; may differ from x / scale in the last bit
        elif b_x.dtype == tl.float16:  # IEEE's quotient in three FMAs from the program's 1 / scale (qmath._div_rcp)
            b_r = tl.math.div_rn(tl.full(b_scale.shape, 1.0, tl.float32), b_scale)
            b_r = tl.minimum(b_r, 2.0**100)  # |x| <= 65504 keeps x * r finite; x / scale > 2**76 saturates anyway
            if QUANT == 1:  # the sign of a zero is in an fp8 code
                b_f = _div_rcp_signed(b_x.to(tl.float32), b_scale, b_r)
            else:
                b_f = _div_rcp(b_x.to(tl.float32), b_scale, b_r)
        else:
            b_f = tl.math.div_rn(b_x.to(tl.float32), b_scale)  # IEEE division, as torch does
        if QUANT == 2 or QMATH == 0 or SOFT:  # the GPU's fp8 convert saturates (cvt.rn.satfinite): no clamp
            b_f = tl.maximum(b_f, QMIN, propagate_nan=tl.PropagateNan.ALL)
            b_f = tl.minimum(b_f, QMAX, propagate_nan=tl.PropagateNan.ALL)
        if QUANT == 2:
            b_f = (b_f + 12582912.0) - 12582912.0  # round half to even (|b_f| <= 128 here)
        elif QMATH == 0 or SOFT:
            b_f = _round_to_grid(b_f, MANT, EMIN)  # else the GPU's cvt.rn.satfinite rounds (half to even)
        b_q = b_f.to(out_dtype)
    return b_q


# ----------------------------------------------------------------------------- scheme "head"
@triton.jit
def _write_one(
    src_ptr, cache_ptr, scale_ptr,
    o_t, m_t, i_blk, i_off, i_h, is_run, i_blk0, i_off0,
    s_st, s_sh, s_scale_h, head_dim,
    s_blk, s_tok, s_head, s_dgrp,
    S_D: tl.constexpr, X: tl.constexpr, SPLIT: tl.constexpr, RUN: tl.constexpr,
    A_SRC: tl.constexpr, A_ROW: tl.constexpr, A_RUN: tl.constexpr,
    QUANT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
    QMATH: tl.constexpr, SOFT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Load ``[BLOCK_T, D]`` of one head from ``src``, quantize, store into one cache."""
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_d = o_d < head_dim
    m = m_t[:, None] & m_d[None, :]  # [BLOCK_T, BLOCK_D]
    o_src = tl.multiple_of(o_t.to(tl.int64) * s_st + i_h.to(tl.int64) * s_sh, A_SRC)  # [BLOCK_T]
    b_x = tl.load(src_ptr + o_src[:, None] + o_d[None, :], mask=m, other=0.0)  # [BLOCK_T, BLOCK_D]
    b_scale = 1.0
    if QUANT != 0:
        b_scale = tl.load(scale_ptr + i_h * s_scale_h)
        if QMATH == 2:
            b_scale = tl.math.div_rn(tl.full([], 1.0, tl.float32), b_scale)  # once per program
    b_q = _quantize(b_x, b_scale, cache_ptr.dtype.element_ty, QUANT, QMIN, QMAX, MANT, EMIN, QMATH, SOFT)
    if SPLIT:  # vLLM split key: 16-byte groups of d, tokens between groups
        o_col = (o_d // X).to(tl.int64) * s_dgrp + (o_d % X) * S_D  # [BLOCK_D]
    else:
        o_col = o_d.to(tl.int64) * S_D  # [BLOCK_D]
    o_row = tl.multiple_of(i_blk * s_blk + i_off * s_tok + i_h.to(tl.int64) * s_head, A_ROW)  # [BLOCK_T]
    p_row = cache_ptr + o_row[:, None] + o_col[None, :]  # [BLOCK_T, BLOCK_D] one row per token
    if RUN:  # tokens innermost in the cache: a run of slots is stored along the token axis
        if is_run:
            o_base = i_blk0 * s_blk + i_off0 + i_h.to(tl.int64) * s_head  # scalar, first token of the run (s_tok 1)
            o_run = tl.multiple_of(o_base + o_col, A_RUN)  # [BLOCK_D]
            p_run = cache_ptr + o_run[None, :] + tl.arange(0, BLOCK_T)[:, None]  # [BLOCK_T, BLOCK_D]
            tl.store(p_run, b_q, mask=m_d[None, :])
        else:
            tl.store(p_row, b_q, mask=m)
    else:
        tl.store(p_row, b_q, mask=m)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr,  # [T, H, D] new tokens, unit stride in D
    k_cache_ptr, v_cache_ptr,  # one layer's K and V cache, any layout (addressed by the strides below)
    slot_ptr,  # [T] int32/int64: block * block_size + offset, -1 = padding
    k_scale_ptr, v_scale_ptr,  # fp32 scales, one or [H] (s_scale_h = 0 or 1); unused when QUANT == 0
    num_tokens, head_dim, block_size, num_slots,  # num_slots = blocks * block_size
    s_kt, s_kh, s_vt, s_vh,  # source strides (token, head)
    s_scale_h,
    ks_blk, ks_tok, ks_head, ks_dgrp,  # K element (blk, tok, h, d) at blk*s_blk + tok*s_tok + h*s_head
    vs_blk, vs_tok, vs_head, vs_dgrp,  # + (d // X) * s_dgrp + (d % X) * S_D; same for V
    KS_D: tl.constexpr, VS_D: tl.constexpr,  # stride of d within a group (constexpr: unit strides vectorize)
    KX: tl.constexpr, VX: tl.constexpr,  # d split (vLLM key); SPLIT false means X == head_dim
    K_SPLIT: tl.constexpr, V_SPLIT: tl.constexpr,
    K_RUN: tl.constexpr, V_RUN: tl.constexpr,  # tokens innermost (s_tok == 1) and BLOCK_T divides block_size
    A_SRC: tl.constexpr,  # proven divisibility (elements) of source row offsets
    KA_ROW: tl.constexpr, VA_ROW: tl.constexpr,  # ... of cache row offsets
    KA_RUN: tl.constexpr, VA_RUN: tl.constexpr,  # ... of run base offsets
    QUANT: tl.constexpr,  # 0 cast, 1 fp8, 2 int8
    QMIN: tl.constexpr, QMAX: tl.constexpr,  # clamp range of x / scale (quantized caches)
    MANT: tl.constexpr, EMIN: tl.constexpr,  # fp8: mantissa bits, smallest normal exponent
    QMATH: tl.constexpr,  # 0 exact, 1 cast, 2 rcp (module docstring)
    SOFT: tl.constexpr,  # round onto the fp8 grid in software even for QMATH 1, 2 (the interpreter)
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
):
    i_tb = tl.program_id(0)
    i_h = tl.program_id(1)
    i_t0 = i_tb.to(tl.int64) * BLOCK_T
    o_t = i_t0 + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    m_t = o_t < num_tokens
    b_slot = tl.load(slot_ptr + o_t, mask=m_t, other=-1).to(tl.int64)  # [BLOCK_T]
    m_t = m_t & (b_slot >= 0) & (b_slot < num_slots)  # padding and out-of-range slots write nothing
    b_slot = tl.where(m_t, b_slot, 0)
    i_blk = b_slot // block_size  # [BLOCK_T]
    i_off = b_slot % block_size
    # a run: all BLOCK_T slots valid and consecutive from a multiple of BLOCK_T (so inside one block)
    slot0 = tl.load(slot_ptr + i_t0).to(tl.int64)  # i_t0 < num_tokens always
    n_run = tl.sum((m_t & (b_slot == slot0 + tl.arange(0, BLOCK_T))).to(tl.int32), axis=0)
    is_run = (n_run == BLOCK_T) & (slot0 % BLOCK_T == 0)
    i_blk0 = slot0 // block_size
    i_off0 = slot0 % block_size
    _write_one(
        key_ptr, k_cache_ptr, k_scale_ptr, o_t, m_t, i_blk, i_off, i_h, is_run, i_blk0, i_off0,
        s_kt, s_kh, s_scale_h, head_dim, ks_blk, ks_tok, ks_head, ks_dgrp,
        KS_D, KX, K_SPLIT, K_RUN, A_SRC, KA_ROW, KA_RUN, QUANT, QMIN, QMAX, MANT, EMIN, QMATH, SOFT, BLOCK_T, BLOCK_D,
    )
    _write_one(
        value_ptr, v_cache_ptr, v_scale_ptr, o_t, m_t, i_blk, i_off, i_h, is_run, i_blk0, i_off0,
        s_vt, s_vh, s_scale_h, head_dim, vs_blk, vs_tok, vs_head, vs_dgrp,
        VS_D, VX, V_SPLIT, V_RUN, A_SRC, VA_ROW, VA_RUN, QUANT, QMIN, QMAX, MANT, EMIN, QMATH, SOFT, BLOCK_T, BLOCK_D,
    )


# ----------------------------------------------------------------------------- scheme "rows"
@triton.jit
def _rows_load(src_ptr, o_h, m_h, o_t, m_t, s_st, s_sh, head_dim, A_SRC: tl.constexpr, BLOCK_D: tl.constexpr):
    """Source rows ``[BLOCK_H, BLOCK_T, BLOCK_D]`` of heads ``o_h`` and tokens ``o_t`` (no slot needed)."""
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    o_sh = tl.multiple_of(o_h.to(tl.int64) * s_sh, A_SRC)  # [BLOCK_H]
    o_st = tl.multiple_of(o_t * s_st, A_SRC)  # [BLOCK_T]
    p = src_ptr + o_sh[:, None, None] + o_st[None, :, None] + o_d[None, None, :]  # [BLOCK_H, BLOCK_T, BLOCK_D]
    m = m_h[:, None, None] & m_t[None, :, None] & (o_d < head_dim)[None, None, :]
    return tl.load(p, mask=m, other=0.0)


@triton.jit
def _rows_scale(scale_ptr, o_h, m_h, s_scale_h, QUANT: tl.constexpr, QMATH: tl.constexpr, BLOCK_H: tl.constexpr):
    """Scales of heads ``o_h`` as ``[BLOCK_H, 1, 1]`` (reciprocals for QMATH 2; ones for a plain cast)."""
    b_s = tl.full([BLOCK_H], 1.0, tl.float32)  # [BLOCK_H]
    if QUANT != 0:
        b_s = tl.load(scale_ptr + o_h * s_scale_h, mask=m_h, other=1.0)
        if QMATH == 2:
            b_s = tl.math.div_rn(tl.full([BLOCK_H], 1.0, tl.float32), b_s)  # once per program, IEEE
    return b_s[:, None, None]


@triton.jit
def _rows_slots(slot_ptr, o_t, m_t, i_t0, block_size, num_slots, RUN: tl.constexpr, BLOCK_T: tl.constexpr):
    """``(m_w, i_blk, i_off, is_run, i_blk0, i_off0)``: which tokens write where; whether they form a run
    (all BLOCK_T slots valid and consecutive from a multiple of BLOCK_T, so inside one block)."""
    b_slot = tl.load(slot_ptr + o_t, mask=m_t, other=-1).to(tl.int64)  # [BLOCK_T]
    m_w = m_t & (b_slot >= 0) & (b_slot < num_slots)  # padding and out-of-range slots write nothing
    b_slot = tl.where(m_w, b_slot, 0)
    is_run = i_t0 < 0  # false; scalars of the same types as below, so the return never mixes constexprs in
    i_blk0 = i_t0 * 0
    i_off0 = i_t0 * 0
    if RUN:
        slot0 = tl.load(slot_ptr + i_t0).to(tl.int64)  # i_t0 < num_tokens always
        n_run = tl.sum((m_w & (b_slot == slot0 + tl.arange(0, BLOCK_T))).to(tl.int32), axis=0)
        is_run = (n_run == BLOCK_T) & (slot0 % BLOCK_T == 0)
        i_blk0 = slot0 // block_size
        i_off0 = slot0 % block_size
    return m_w, b_slot // block_size, b_slot % block_size, is_run, i_blk0, i_off0


@triton.jit
def _rows_store(
    cache_ptr, b_q, o_h, m_h, m_w, i_blk, i_off, is_run, i_blk0, i_off0, head_dim,
    s_blk, s_tok, s_head, s_dgrp,
    S_D: tl.constexpr, X: tl.constexpr, SPLIT: tl.constexpr, RUN: tl.constexpr,
    A_ROW: tl.constexpr, A_RUN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Store codes ``b_q`` ``[BLOCK_H, BLOCK_T, BLOCK_D]`` into one cache (the address formula of workbench.core.layout)."""
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_d = o_d < head_dim
    if SPLIT:  # vLLM split key: 16-byte groups of d, tokens between groups
        o_col = (o_d // X).to(tl.int64) * s_dgrp + (o_d % X) * S_D  # [BLOCK_D]
    else:
        o_col = o_d.to(tl.int64) * S_D  # [BLOCK_D]
    o_hd = tl.multiple_of(o_h.to(tl.int64) * s_head, A_ROW)  # [BLOCK_H]
    o_tok = tl.multiple_of(i_blk * s_blk + i_off * s_tok, A_ROW)  # [BLOCK_T]
    p_row = cache_ptr + o_hd[:, None, None] + o_tok[None, :, None] + o_col[None, None, :]  # one row per (h, t)
    m = m_h[:, None, None] & m_w[None, :, None] & m_d[None, None, :]  # [BLOCK_H, BLOCK_T, BLOCK_D]
    if RUN:  # tokens innermost in the cache: a run of slots is stored along the token axis
        if is_run:
            o_run = tl.multiple_of((o_hd + (i_blk0 * s_blk + i_off0))[:, None] + o_col[None, :], [A_RUN, A_RUN])
            p_run = cache_ptr + o_run[:, None, :] + tl.arange(0, BLOCK_T)[None, :, None]  # [BLOCK_H, BLOCK_T, BLOCK_D]
            tl.store(p_run, b_q, mask=m_h[:, None, None] & m_d[None, None, :])
        else:
            tl.store(p_row, b_q, mask=m)
    else:
        tl.store(p_row, b_q, mask=m)


@triton.jit
def _rows_one(
    src_ptr, cache_ptr, scale_ptr, slot_ptr, o_h, m_h, o_t, m_t, i_t0,
    head_dim, block_size, num_slots, s_st, s_sh, s_scale_h, s_blk, s_tok, s_head, s_dgrp,
    S_D: tl.constexpr, X: tl.constexpr, SPLIT: tl.constexpr, RUN: tl.constexpr,
    A_SRC: tl.constexpr, A_ROW: tl.constexpr, A_RUN: tl.constexpr,
    QUANT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
    QMATH: tl.constexpr, SOFT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """K or V alone (``kv_split``): loads first, then slots, then the store."""
    b_x = _rows_load(src_ptr, o_h, m_h, o_t, m_t, s_st, s_sh, head_dim, A_SRC, BLOCK_D)
    b_s = _rows_scale(scale_ptr, o_h, m_h, s_scale_h, QUANT, QMATH, BLOCK_H)
    m_w, i_blk, i_off, is_run, i_blk0, i_off0 = _rows_slots(slot_ptr, o_t, m_t, i_t0, block_size, num_slots, RUN,
                                                            BLOCK_T)
    b_q = _quantize(b_x, b_s, cache_ptr.dtype.element_ty, QUANT, QMIN, QMAX, MANT, EMIN, QMATH, SOFT)
    _rows_store(cache_ptr, b_q, o_h, m_h, m_w, i_blk, i_off, is_run, i_blk0, i_off0, head_dim,
                s_blk, s_tok, s_head, s_dgrp, S_D, X, SPLIT, RUN, A_ROW, A_RUN, BLOCK_T, BLOCK_D)


@triton.jit
def _write_rows_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,  # as _write_kv_kernel
    num_tokens, num_heads, head_dim, block_size, num_slots,
    num_hgroups,  # cdiv(num_heads, BLOCK_H)
    s_kt, s_kh, s_vt, s_vh, s_scale_h,
    ks_blk, ks_tok, ks_head, ks_dgrp,
    vs_blk, vs_tok, vs_head, vs_dgrp,
    KS_D: tl.constexpr, VS_D: tl.constexpr, KX: tl.constexpr, VX: tl.constexpr,
    K_SPLIT: tl.constexpr, V_SPLIT: tl.constexpr, K_RUN: tl.constexpr, V_RUN: tl.constexpr,
    A_SRC: tl.constexpr, KA_ROW: tl.constexpr, VA_ROW: tl.constexpr, KA_RUN: tl.constexpr, VA_RUN: tl.constexpr,
    QUANT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
    QMATH: tl.constexpr, SOFT: tl.constexpr,
    N_KIND: tl.constexpr,  # 1: K and V in one program; 2: K or V (kv_split), the kind the fastest grid index
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # heads per program (power of two)
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
):
    i_p = tl.program_id(0)  # one grid axis: (token tile, head group, kind), the last fastest
    n_sub = num_hgroups * N_KIND
    i_tb = i_p // n_sub
    i_sub = i_p % n_sub
    i_hg = i_sub // N_KIND
    i_kind = i_sub % N_KIND
    i_t0 = i_tb.to(tl.int64) * BLOCK_T
    o_t = i_t0 + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    m_t = o_t < num_tokens
    o_h = i_hg * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < num_heads
    if N_KIND == 1:  # every load before the first store: one wait for memory per program
        b_k = _rows_load(key_ptr, o_h, m_h, o_t, m_t, s_kt, s_kh, head_dim, A_SRC, BLOCK_D)  # [BLOCK_H, BLOCK_T, BLOCK_D]
        b_v = _rows_load(value_ptr, o_h, m_h, o_t, m_t, s_vt, s_vh, head_dim, A_SRC, BLOCK_D)
        b_ks = _rows_scale(k_scale_ptr, o_h, m_h, s_scale_h, QUANT, QMATH, BLOCK_H)  # [BLOCK_H, 1, 1]
        b_vs = _rows_scale(v_scale_ptr, o_h, m_h, s_scale_h, QUANT, QMATH, BLOCK_H)
        m_w, i_blk, i_off, is_run, i_blk0, i_off0 = _rows_slots(
            slot_ptr, o_t, m_t, i_t0, block_size, num_slots, K_RUN or V_RUN, BLOCK_T
        )
        b_kq = _quantize(b_k, b_ks, k_cache_ptr.dtype.element_ty, QUANT, QMIN, QMAX, MANT, EMIN, QMATH, SOFT)
        _rows_store(k_cache_ptr, b_kq, o_h, m_h, m_w, i_blk, i_off, is_run, i_blk0, i_off0, head_dim,
                    ks_blk, ks_tok, ks_head, ks_dgrp, KS_D, KX, K_SPLIT, K_RUN, KA_ROW, KA_RUN, BLOCK_T, BLOCK_D)
        b_vq = _quantize(b_v, b_vs, v_cache_ptr.dtype.element_ty, QUANT, QMIN, QMAX, MANT, EMIN, QMATH, SOFT)
        _rows_store(v_cache_ptr, b_vq, o_h, m_h, m_w, i_blk, i_off, is_run, i_blk0, i_off0, head_dim,
                    vs_blk, vs_tok, vs_head, vs_dgrp, VS_D, VX, V_SPLIT, V_RUN, VA_ROW, VA_RUN, BLOCK_T, BLOCK_D)
    else:
        if i_kind == 0:
            _rows_one(key_ptr, k_cache_ptr, k_scale_ptr, slot_ptr, o_h, m_h, o_t, m_t, i_t0,
                      head_dim, block_size, num_slots, s_kt, s_kh, s_scale_h, ks_blk, ks_tok, ks_head, ks_dgrp,
                      KS_D, KX, K_SPLIT, K_RUN, A_SRC, KA_ROW, KA_RUN, QUANT, QMIN, QMAX, MANT, EMIN, QMATH, SOFT,
                      BLOCK_T, BLOCK_H, BLOCK_D)
        else:
            _rows_one(value_ptr, v_cache_ptr, v_scale_ptr, slot_ptr, o_h, m_h, o_t, m_t, i_t0,
                      head_dim, block_size, num_slots, s_vt, s_vh, s_scale_h, vs_blk, vs_tok, vs_head, vs_dgrp,
                      VS_D, VX, V_SPLIT, V_RUN, A_SRC, VA_ROW, VA_RUN, QUANT, QMIN, QMAX, MANT, EMIN, QMATH, SOFT,
                      BLOCK_T, BLOCK_H, BLOCK_D)
