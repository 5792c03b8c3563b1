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

Storage conventions (the same as :func:`workbench.kernels.reference.write_kv_ref`):

- fp32 / fp16 / bf16 caches: a plain cast (round to nearest even).
- fp8 (e4m3fn / e5m2) caches, vLLM's convention: ``stored = fp8(clamp(x / scale, -max, max))``
  with ``scale`` fp32, per tensor (one element) or per KV head (``[H]``). Saturating, as the
  hardware conversion on Hopper does.
- int8 caches: ``stored = clamp(round_half_even(x / scale), -128, 127)``.

How the codes are computed (``quant_math``):

- ``"exact"``: IEEE division (``div_rn``), then rounding (half to even) onto the fp8 grid in fp32
  arithmetic before an exact cast, so the codes do not depend on the converter (the
  interpreter's fp32 -> fp8 cast rounds ties up and drops carries into the exponent, DESIGN
  section 6). Some 30 instructions an element: the fp8 write is compute-bound on the H200.
- ``"cast"``: IEEE division, then the converter rounds. On the GPU that is one
  ``cvt.rn.satfinite`` (round half to even, saturating), so the codes equal ``"exact"``'s; under
  the interpreter the software rounding is kept, because its converter is not exact.
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

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

import workbench
from workbench import formats
from workbench.backend import is_interpreted
from workbench.layout import Layout, addressing

from . import common

FP8_DTYPES = common.FP8_DTYPES
CAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SOURCE_DTYPES = CAST_DTYPES
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
    b_r = tl.where(b_f < 0, -b_r, b_r)  # keeps -0.0
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
        else:
            b_f = tl.math.div_rn(b_x.to(tl.float32), b_scale)  # IEEE division, as torch does
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
    """Store codes ``b_q`` ``[BLOCK_H, BLOCK_T, BLOCK_D]`` into one cache (the address formula of workbench.layout)."""
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


# ----------------------------------------------------------------------------- launch choices
def quant_mode(dtype: torch.dtype) -> tuple[int, float, float]:
    """``(QUANT, QMIN, QMAX)`` for a cache dtype, from its format (``workbench.formats``): cast, fp8
    (saturating at +-max) or int (rounded, clamped to the code range)."""
    fmt = formats.get(dtype)
    return {"cast": QUANT_NONE, "fp8": QUANT_FP8, "int": QUANT_INT8}[fmt.codes], fmt.qmin, fmt.qmax


def default_launch(num_tokens: int, num_heads: int, head_dim: int, block_size: int, layout: Layout | str):
    """Heuristic ``(tokens_per_program, num_warps)`` of the ``"head"`` scheme.

    Big batches (prefill): 16 tokens x one head x D per program (8 KB of fp16 K+V read at D=128),
    enough programs to fill the GPU. Small batches (decode): one token per program, so the few
    rows spread over many SMs. For the vLLM value layout the tile must fit a block to be stored
    as a run, so tokens per program also divides the block size.
    """
    bt = 1
    while bt < 16 and num_tokens * num_heads >= 2048 * (2 * bt):
        bt *= 2
    if Layout.parse(layout) is Layout.VLLM and block_size > 1:
        bt = min(bt, common.pow2_divisor(block_size, 16))
    tile = bt * triton.next_power_of_2(head_dim)
    num_warps = min(8, max(1, tile // 512))
    return bt, num_warps


def rows_launch(
    num_tokens: int, num_heads: int, head_dim: int, block_size: int, layout: Layout | str,
    heads_per_program: int | None = None, kv_split: bool = False,
) -> tuple[int, int]:
    """Heuristic ``(tokens_per_program, num_warps)`` of the ``"rows"`` scheme.

    Tiles of up to 8192 elements per tensor (16 KB of fp16 K and as much V in flight per
    program at 4 warps, 64 elements a thread), while the grid keeps >= 1024 programs; for the
    vLLM value layout the tokens per program also divide the block size (runs).
    """
    bh = triton.next_power_of_2(max(1, min(heads_per_program or num_heads, num_heads)))
    bd = triton.next_power_of_2(head_dim)
    n_sub = -(-num_heads // bh) * (2 if kv_split else 1)
    bt = 1
    while bt < 16 and 2 * bt * bh * bd <= 8192 and -(-num_tokens // (2 * bt)) * n_sub >= 1024:
        bt *= 2
    if Layout.parse(layout) is Layout.VLLM and block_size > 1:
        bt = min(bt, common.pow2_divisor(block_size, 16))
    num_warps = min(8, max(1, bt * bh * bd // 2048))
    return bt, num_warps


class WriteConfig(NamedTuple):
    """One launch of :func:`write_kv`, resolved (every field is a ``write_kv`` keyword)."""

    scheme: str
    tokens_per_program: int
    num_warps: int
    heads_per_program: int  # 1 for "head"; BLOCK_H (a power of two) for "rows"
    kv_split: bool
    quant_math: str


# Batches this big are "prefill": the head scheme's heuristic is at its largest tile there.
PREFILL_MIN_ROWS = 2048 * 16  # num_tokens * num_heads
# THE TABLE: launch defaults for prefill-sized batches, per GPU and (layout, quantized cache), measured and kept
# as data in tuning/write_prefill.json (what each entry means and where it was measured is written there).
# Launch plans are cached per geometry: edit PREFILL_DEFAULTS before the first write_kv call (or clear _PLANS).
_QUANT_MATH = "exact" if workbench.is_interpreted() else "cast"  # see tuning/write_prefill.json's "about"


def prefill_defaults(gpu: str | None = None) -> dict[tuple[Layout, bool], dict]:
    """The write_kv keywords for prefill-sized batches on ``gpu`` (default: this machine's), from the table."""
    _, entries = common.tuning_table("write_prefill", gpu)
    table = {}
    for e in entries:
        cfg = dict(e["config"])
        if e["quantized"]:
            cfg.setdefault("quant_math", _QUANT_MATH)
        table[(Layout.parse(e["layout"]), bool(e["quantized"]))] = cfg
    return table


PREFILL_DEFAULTS: dict[tuple[Layout, bool], dict] = prefill_defaults()


def _is_pow2(n) -> bool:
    return isinstance(n, int) and n >= 1 and not n & (n - 1)


def launch_config(
    num_tokens: int, num_heads: int, head_dim: int, block_size: int, layout: Layout | str, quantized: bool = False,
    *, scheme: str | None = None, tokens_per_program: int | None = None, num_warps: int | None = None,
    heads_per_program: int | None = None, kv_split: bool | None = None, quant_math: str | None = None,
) -> WriteConfig:
    """The launch :func:`write_kv` uses: explicit keywords first, then PREFILL_DEFAULTS (prefill-sized
    batches), then the scheme's heuristic. Raises ValueError for a bad keyword."""
    layout = Layout.parse(layout)
    table = PREFILL_DEFAULTS.get((layout, quantized), {}) if num_tokens * num_heads >= PREFILL_MIN_ROWS else {}
    pick = lambda name, given: table.get(name) if given is None else given  # noqa: E731
    scheme = pick("scheme", scheme) or "head"
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    quant_math = pick("quant_math", quant_math) or "exact"
    if quant_math not in QUANT_MATHS:
        raise ValueError(f"quant_math must be one of {QUANT_MATHS}, got {quant_math!r}")
    bt, warps = pick("tokens_per_program", tokens_per_program), pick("num_warps", num_warps)
    split, hpp = bool(pick("kv_split", kv_split)), pick("heads_per_program", heads_per_program)
    if hpp is not None and not _is_pow2(hpp):
        raise ValueError(f"heads_per_program must be a power of two, got {hpp}")
    if scheme == "head":
        if split or (hpp or 1) != 1:
            raise ValueError("kv_split and heads_per_program > 1 need scheme='rows' (the head scheme does one head, K+V)")
        bt_auto, warps_auto = default_launch(num_tokens, num_heads, head_dim, block_size, layout)
        bh = 1
    else:
        bh = min(hpp or num_heads, num_heads)  # all heads by default
        bh = triton.next_power_of_2(max(bh, 1))
        bt_auto, warps_auto = rows_launch(num_tokens, num_heads, head_dim, block_size, layout, bh, split)
    bt = bt_auto if bt is None else bt
    warps = warps_auto if warps is None else warps
    if not _is_pow2(bt):
        raise ValueError(f"tokens_per_program must be a power of two, got {bt}")
    if not _is_pow2(warps):
        raise ValueError(f"num_warps must be a power of two, got {warps}")
    return WriteConfig(scheme, bt, warps, bh, split, quant_math)


# ----------------------------------------------------------------------------- wrapper
def _check_scale(name: str, scale, num_heads: int, device) -> int:
    """Validate a quantization scale; return its head stride (0 per tensor, else the [H] stride)."""
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"{name} must be an fp32 tensor (one element or [{num_heads}]), got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}")
    if scale.device != device:
        raise ValueError(f"{name} must be on the cache's device {device}, got {scale.device}")
    if scale.numel() == 1:
        return 0
    if scale.dim() == 1 and scale.shape[0] == num_heads:
        return scale.stride(0)
    raise ValueError(f"{name} must have one element or shape [{num_heads}] (per kv head), got {tuple(scale.shape)}")


def _row_align(a, elem_size: int) -> int:
    """Divisibility (elements) of every row offset blk*s_blk + tok*s_tok + h*s_head, capped at 16 bytes."""
    g = math.gcd(a.s_blk, a.s_tok, a.s_head)
    return common.pow2_divisor(g, max(1, 16 // elem_size))


def _cache_geometry(cache: torch.Tensor, layout: Layout, kind: str) -> tuple[int, int, int, int]:
    """``(blocks, block_size, heads, head_dim)`` of one cache, read off its shape (workbench.layout)."""
    s = cache.shape
    if layout is Layout.NHD:
        return s[0], s[1], s[2], s[3]
    if layout is Layout.HND:
        return s[0], s[2], s[1], s[3]
    if kind == "k":  # [blocks, H, D // x, block_size, x]
        return s[0], s[3], s[1], s[2] * s[4]
    return s[0], s[3], s[1], s[2]  # [blocks, H, D, block_size]


def _checked_shapes(key, value, k_cache, v_cache, layout, slot_mapping):
    """Validate shapes, dtypes and devices; return ``(block_size, num_blocks)``."""
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [T, H, D] tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype not in SOURCE_DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(f"{name} must have unit stride in head_dim, got strides {t.stride()}")
    if value.shape != key.shape:
        raise ValueError(f"value must have the key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    num_tokens, num_heads, head_dim = key.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(cache).__name__}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    writable = [f.storage for f in formats.FORMATS.values() if f.writable]
    if k_cache.dtype not in writable:
        raise ValueError(f"k_cache dtype must be one of {writable} (formats with a write kernel), got {k_cache.dtype}")
    shapes = {}
    for name, cache, kind in (("k_cache", k_cache, "k"), ("v_cache", v_cache, "v")):
        want = 5 if (layout is Layout.VLLM and kind == "k") else 4
        if cache.dim() != want:
            raise ValueError(f"{name} must be a {want}-D {layout.value} cache, got shape {tuple(cache.shape)}")
        nb, bs, h, d = _cache_geometry(cache, layout, kind)
        if (h, d) != (num_heads, head_dim):
            raise ValueError(
                f"key has {num_heads} heads x {head_dim} dims but {name} holds {h} x {d} ({layout.value} layout)"
            )
        shapes[name] = (nb, bs)
    if shapes["k_cache"] != shapes["v_cache"]:
        raise ValueError(f"v_cache must have k_cache's blocks and block size {shapes['k_cache']}, got {shapes['v_cache']}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1 or slot_mapping.dtype not in (
        torch.int32, torch.int64
    ):
        raise ValueError(f"slot_mapping must be a 1-D int32 or int64 tensor, got {getattr(slot_mapping, 'dtype', None)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must have {num_tokens} entries (one per token), got {slot_mapping.shape[0]}")
    device = k_cache.device
    for name, t in (("key", key), ("value", value), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != device:
            raise ValueError(f"{name} must be on the cache's device {device}, got {t.device}")
    num_blocks, block_size = shapes["k_cache"]
    return block_size, num_blocks


class _Plan(NamedTuple):
    """Everything a launch needs that depends only on shapes, strides, dtypes and keywords."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple  # runtime scalars after the 7 tensors
    consts: dict  # constexprs and num_warps
    num_slots: int
    s_scale_h: int
    empty: bool  # nothing to write (no tokens or no heads)


_PLANS: common.PlanCache[_Plan] = common.PlanCache()  # per geometry: a repeated call's host work is a lookup


def _meta(t) -> tuple | None:
    """What validation and the plan read from a tensor (None for a non-tensor: never cached)."""
    return (t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else None


def _make_plan(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, kw) -> _Plan:
    """Validate everything but the slot values and choose the launch (see write_kv)."""
    layout = Layout.parse(layout)
    block_size, num_blocks = _checked_shapes(key, value, k_cache, v_cache, layout, slot_mapping)
    num_tokens, num_heads, head_dim = key.shape
    quant, qmin, qmax = quant_mode(k_cache.dtype)
    if quant == QUANT_NONE:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise ValueError(f"{name} is only for fp8/int8 caches; this cache stores {k_cache.dtype}")
        s_scale_h = 0
    else:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is None:
                raise ValueError(f"{name} is required: the cache stores {k_cache.dtype} (quantized)")
        s_k = _check_scale("k_scale", k_scale, num_heads, k_cache.device)
        s_v = _check_scale("v_scale", v_scale, num_heads, k_cache.device)
        if s_k != s_v:
            raise ValueError("k_scale and v_scale must both be per tensor or both per head, with the same stride")
        s_scale_h = s_k
    cfg = launch_config(num_tokens, num_heads, head_dim, block_size, layout, quant != QUANT_NONE, **kw)
    num_slots = num_blocks * block_size
    if num_tokens == 0 or num_heads == 0:
        return _Plan(None, (), (), {}, num_slots, s_scale_h, True)
    ka, va = addressing(k_cache, layout, "k"), addressing(v_cache, layout, "v")
    elem = k_cache.element_size()
    src_align = common.pow2_divisor(
        math.gcd(key.stride(0), key.stride(1), value.stride(0), value.stride(1)), max(1, 16 // key.element_size())
    )
    bt = cfg.tokens_per_program
    # runs are stored along the token axis only where tokens are innermost and a run fits one block
    run_ok = bt > 1 and block_size % bt == 0

    def run_align(a) -> int:
        return common.pow2_divisor(math.gcd(a.s_blk, a.s_head, a.s_dgrp, a.s_d, bt), max(1, 16 // elem))

    mant, emin = FP8_GRID.get(k_cache.dtype, (0, 0))
    consts = dict(
        KS_D=ka.s_d, VS_D=va.s_d, KX=ka.x, VX=va.x, K_SPLIT=ka.x != head_dim, V_SPLIT=va.x != head_dim,
        K_RUN=run_ok and ka.s_tok == 1, V_RUN=run_ok and va.s_tok == 1, A_SRC=src_align,
        KA_ROW=_row_align(ka, elem), VA_ROW=_row_align(va, elem), KA_RUN=run_align(ka), VA_RUN=run_align(va),
        QUANT=quant, QMIN=qmin, QMAX=qmax, MANT=mant, EMIN=emin,
        QMATH=QUANT_MATHS.index(cfg.quant_math), SOFT=SOFT_ROUND,
        BLOCK_T=bt, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=cfg.num_warps,
    )
    strides = (key.stride(0), key.stride(1), value.stride(0), value.stride(1), s_scale_h,
               ka.s_blk, ka.s_tok, ka.s_head, ka.s_dgrp, va.s_blk, va.s_tok, va.s_head, va.s_dgrp)
    if cfg.scheme == "head":
        grid = (triton.cdiv(num_tokens, bt), num_heads)
        return _Plan(_write_kv_kernel, grid, (num_tokens, head_dim, block_size, num_slots, *strides), consts,
                     num_slots, s_scale_h, False)
    n_kind = 2 if cfg.kv_split else 1
    n_hgroups = triton.cdiv(num_heads, cfg.heads_per_program)
    consts.update(N_KIND=n_kind, BLOCK_H=cfg.heads_per_program)
    grid = (triton.cdiv(num_tokens, bt) * n_hgroups * n_kind,)
    args = (num_tokens, num_heads, head_dim, block_size, num_slots, n_hgroups, *strides)
    return _Plan(_write_rows_kernel, grid, args, consts, num_slots, s_scale_h, False)


def _cached_plan(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, kw) -> _Plan:
    """The launch plan of this geometry, from the per-geometry cache or made (and validated) now."""
    metas = (_meta(key), _meta(value), _meta(k_cache), _meta(v_cache), _meta(slot_mapping))
    plan_key = None
    if None not in metas and isinstance(layout, str) and (k_scale is None or isinstance(k_scale, torch.Tensor)) and (
        v_scale is None or isinstance(v_scale, torch.Tensor)
    ):
        plan_key = (layout, *metas, _meta(k_scale) if k_scale is not None else None,
                    _meta(v_scale) if v_scale is not None else None, *kw.values())
    return _PLANS.get(plan_key, lambda: _make_plan(key, value, k_cache, v_cache, layout, slot_mapping, k_scale,
                                                   v_scale, kw))


def check_write_kv(key, value, k_cache, v_cache, layout, k_scale=None, v_scale=None) -> None:
    """Raise the ValueError :func:`write_kv` would raise for these tensors, without writing anything.

    Everything but the slot values is checked (shapes, strides, dtypes, devices, scales), so a
    caller can validate before it commits state (the cache checks before it allocates blocks).
    """
    slots = torch.empty(key.shape[0] if isinstance(key, torch.Tensor) and key.dim() else 0, dtype=torch.int64,
                        device=k_cache.device if isinstance(k_cache, torch.Tensor) else None)
    _cached_plan(key, value, k_cache, v_cache, layout, slots, k_scale, v_scale, dict.fromkeys(_WRITE_KEYWORDS))


_WRITE_KEYWORDS = ("scheme", "tokens_per_program", "num_warps", "heads_per_program", "kv_split", "quant_math")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: Layout | str,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    tokens_per_program: int | None = None,
    num_warps: int | None = None,
    scheme: str | None = None,
    heads_per_program: int | None = None,
    kv_split: bool | None = None,
    quant_math: str | None = None,
    validate: bool = True,
) -> None:
    """Write new tokens' K and V into one layer's paged cache, in place.

    Args:
        key: ``[T, H, D]`` fp32/fp16/bf16, any token/head strides, unit stride in ``D``.
        value: ``[T, H, D]``, like ``key``.
        k_cache: one layer's K cache in ``layout`` (``workbench.layout``; padded block strides are fine).
        v_cache: one layer's V cache, same dtype, blocks and block size as ``k_cache``.
        layout: ``"nhd"``, ``"hnd"`` or ``"vllm"``.
        slot_mapping: ``[T]`` int32/int64, ``block * block_size + offset``; ``-1`` skips the token.
        k_scale: fp32, one element or ``[H]``: required for fp8/int8 caches, rejected otherwise.
        v_scale: like ``k_scale``, for V.
        tokens_per_program: tokens each program writes (power of two).
        num_warps: warps per program (power of two).
        scheme: ``"head"`` (one head x ``tokens_per_program`` tokens, K and V, per program) or ``"rows"``
            (``heads_per_program`` heads x ``tokens_per_program`` tokens, all loads before the stores);
            see the module docstring.
        heads_per_program: ``"rows"`` only: heads per program, a power of two (default: all heads).
        kv_split: ``"rows"`` only: K and V in separate programs (twice the programs, half the tile each).
        quant_math: fp8/int8 caches: ``"exact"``, ``"cast"`` or ``"rcp"`` (module docstring).
        validate: check that every slot is ``-1`` or inside the cache (one device sync). Skipped while a
            CUDA graph is being captured. The kernel never writes an out-of-range slot either way.

    Keywords left ``None`` come from :data:`PREFILL_DEFAULTS` (prefill-sized batches) and then the
    scheme's heuristic (:func:`default_launch`, :func:`rows_launch`); :func:`launch_config` resolves them.
    Validation of shapes and the launch choice are cached per geometry, so a repeated call costs a
    dictionary lookup on the host; with ``validate=False`` the call does no device work besides the kernel.
    """
    kw = dict(scheme=scheme, tokens_per_program=tokens_per_program, num_warps=num_warps,
              heads_per_program=heads_per_program, kv_split=kv_split, quant_math=quant_math)
    plan = _cached_plan(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, kw)
    if validate and slot_mapping.numel() and not (k_cache.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = (int(v) for v in torch.aminmax(slot_mapping))
        if lo < -1 or hi >= plan.num_slots:
            raise ValueError(f"slot_mapping values must be -1 or in [0, {plan.num_slots}), got range [{lo}, {hi}]")
    if plan.empty:
        return
    if plan.consts["QUANT"] == QUANT_NONE:
        k_scale, v_scale = k_cache, v_cache  # placeholders: never read
    plan.kernel[plan.grid](key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, *plan.args, **plan.consts)
