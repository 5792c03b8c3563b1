"""Quantize-on-write of the ``groups`` family (KIVI int4 / int2): asymmetric codes packed ``8 // BITS`` to a byte,
an fp16 scale and zero point per group, computed in registers and stored in the block after its codes.

Packing order (``workbench.quant.families.groups``): byte ``j`` of a row holds channel ``k * DC + j`` in bits
``[k * BITS, (k + 1) * BITS)``. So the kernels load a row as its ``8 // BITS`` planes (channels ``k * DC + [0, DC)``),
each a tile of its own and all of one layout (a thread holds the same bytes of every plane), every load before the
first store, and a byte is the sum of its planes' shifted code words (:func:`~.qmath._int_bits`), elementwise: no
reshape, no shuffle. One pass: load, group min/max (NaN-propagating, in the source's dtype), fp16 scale and zero
point, codes by :func:`~.qmath._div_rcp` (three FMAs, IEEE's quotient; an fp16 scale is never tiny), the low bits of
one add, pack, store. No clamp for an fp16 source whose scales are normal fp16 (:func:`_codes_of`).

- :func:`_write_groups_kernel`: groups of ``DG`` channels per token (values; keys with ``key_mode="token"``), where
  ``DG`` divides a plane: a plane is ``[BLOCK_T, NGI, DG]`` (``NGI = DC / DG`` groups), its group ``k * NGI + g``.
- :func:`_write_key_groups_kernel`: keys per channel over groups of ``G`` consecutive slots (KIVI), ``NKG`` groups a
  program; a plane is ``[G, NKG, DC]`` (or ``[NKG, G, DC]``: :data:`TOKEN_AXIS`) with a group's tokens in one
  thread and ``VEC`` channels a thread, so the min/max over tokens is in registers and a channel's scale is
  computed once for its ``G`` codes.

The rare path (a NaN/Inf in the program, an overflow, a subnormal fp16 scale) recomputes the codes with IEEE
division and clamps, the generic kernel's arithmetic (``kernels/write/dynamic.py``), and counts the NaN/Inf into
``bad_ptr``.

The source is ``[T, H, D]`` rows or blocks read where they lie (``SRC_BS``, ``qmath._src_rows``: a tier's demotion);
with ``ZERO_NONFINITE`` its NaN/Inf are stored as 0 and counted as they are loaded, so the rare path never sees one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .qmath import (
    _columns,
    _div_rcp,
    _fp16_params_fast,
    _int_bits,
    _int_codes,
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
def _codes_of(b_x, b_z, b_s, FAST: tl.constexpr, QMAX: tl.constexpr, FP16: tl.constexpr):
    """int32 words whose low bits are ``round(clamp((x - z) / s, 0, QMAX))``: the fast division, or IEEE's. ``FP16``
    (an fp16 source, scales normal fp16: :func:`_plane` sends the rest to the rare path) needs no clamp: ``z`` is
    the group's min itself, so ``x - z >= 0``, and ``(max - z) / s <= QMAX * (1 + 2**-11)`` rounds to ``QMAX``."""
    b_d = b_x - b_z
    if FAST:
        b_y = _div_rcp(b_d, b_s, _rcp(b_s))
        if not FP16:
            b_y = tl.minimum(tl.maximum(b_y, 0.0), QMAX)
        b_w = _int_bits(b_y)
    else:
        b_w = _int_bits(_int_codes(tl.math.div_rn(b_d, b_s + tl.zeros_like(b_d)), QMAX))
    return b_w


@triton.jit
def _plane(b_xs, AXIS: tl.constexpr, FAST: tl.constexpr, QMAX: tl.constexpr, RQ: tl.constexpr):
    """One plane's source tile: min/max over ``AXIS`` (NaN-propagating), fp16 scales and zero points (kept dims),
    code words; ``(words, scale, zero, groups for the rare path, NaN/Inf inputs)``, the last only where not ``FAST``
    (the rare path, which also divides as IEEE does and clamps)."""
    b_lo = _rmin(b_xs, AXIS, True).to(tl.float32)
    b_hi = _rmax(b_xs, AXIS, True).to(tl.float32)
    b_s, b_z = _fp16_params_fast(b_lo, b_hi, QMAX, RQ)
    b_x = b_xs.to(tl.float32)
    b_w = _codes_of(b_x, b_z.to(tl.float32), b_s.to(tl.float32), FAST, QMAX, b_xs.dtype == tl.float16)
    b_nf = tl.zeros_like(b_w)
    if not FAST:
        b_nf = ((b_x != b_x) | (tl.abs(b_x) == float("inf"))).to(tl.int32)
    b_rare = ~((b_hi - b_lo) < float("inf"))  # a NaN/Inf, or an overflow
    if b_xs.dtype == tl.float16:
        b_rare = b_rare | (b_s < 6.103515625e-05)  # a subnormal fp16 scale (< 2**-14) needs the clamps
    return b_w, b_s, b_z, b_rare.to(tl.int32), b_nf


@triton.jit
def _fold(b_xs, k: tl.constexpr, b_q, b_ss, b_zs, b_bad, o_k, AXIS: tl.constexpr, BITS: tl.constexpr,
          QMAX: tl.constexpr, RQ: tl.constexpr):
    """Plane ``k`` into the packed words ``b_q`` (its bits at ``k * BITS``: the words' constant adds nothing below
    bit 22), its scales and zero points into ``b_ss``/``b_zs`` where ``o_k == k``, its rare groups into ``b_bad``."""
    b_w, b_s, b_z, b_g, b_nf = _plane(b_xs, AXIS, True, QMAX, RQ)
    return (b_q + (b_w << (k * BITS)), tl.where(o_k == k, b_s, b_ss), tl.where(o_k == k, b_z, b_zs),
            b_bad | b_g)


@triton.jit
def _rare_words(p_x, d_p, m_x, m_w, bad_ptr, b_q, AXIS: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr,
                QMAX: tl.constexpr, RQ: tl.constexpr, ZERO: tl.constexpr):
    """The rare path: every plane again (plane ``k`` at ``p_x + k * d_p``) with IEEE division and clamps, its NaN/Inf
    inputs (where ``m_w``) counted into ``bad_ptr`` (``ZERO``: zeroed again, counted already); the packed words."""
    b_q = tl.zeros_like(b_q)
    b_cnt = tl.zeros_like(b_q)
    for k in tl.static_range(P):
        b_x = tl.load(p_x + k * d_p, mask=m_x, other=0.0)
        if ZERO:  # zeroed and counted when first loaded: zeroed again, so nothing is counted twice
            b_x, _ = _zero_nonfinite(b_x, m_w)
        b_w, b_s, b_z, b_g, b_nf = _plane(b_x, AXIS, False, QMAX, RQ)
        b_q += b_w << (k * BITS)
        b_cnt += b_nf
    n_bad = tl.sum(tl.where(m_w, b_cnt, 0))
    if n_bad > 0:
        tl.atomic_add(bad_ptr, n_bad)
    return b_q


@triton.jit
def _write_groups_kernel(
    src_ptr,  # K or V of the new tokens: [T, H, D] rows, unit stride in D, or blocks (SRC_BS)
    cache_ptr,  # one layer's K or V packed codes, any layout (bytes)
    slot_ptr,  # [T] int32/int64 slots, -1 = padding
    bad_ptr,  # [1] int32: non-finite inputs seen
    num_tokens, block_size, num_slots,
    s_st, s_sh,  # source strides (token, head)
    s_sblk, s_sdgrp,  # a source in blocks: block stride, vLLM key group stride (qmath._src_rows, _src_cols)
    s_blk, s_tok, s_head, s_dgrp,  # byte (blk, tok, h, j) at blk*s_blk + tok*s_tok + h*s_head + (j // X)*s_dgrp + ...
    sc_blk, sc_off, sc_tg, sc_h, z_off,  # fp16 scales, then zero points, in blocks, in scale elements
    S_D: tl.constexpr, X: tl.constexpr,  # ... + (j % X)*S_D
    QMAX: tl.constexpr, RQ: tl.constexpr, BITS: tl.constexpr,  # RQ: 1 / QMAX rounded to fp32
    DC: tl.constexpr,  # bytes a row: plane k holds channels k * DC + [0, DC)
    NGI: tl.constexpr, DG: tl.constexpr,  # a plane's groups and their channels (NGI * DG == DC)
    SHIFT: tl.constexpr,  # log2(block_size), or -1
    BLOCK_T: tl.constexpr,  # tokens per program
    SRC_BS: tl.constexpr, SS_D: tl.constexpr, SX: tl.constexpr,  # the source's tokens a block (0: rows), channels
    ZERO_NONFINITE: tl.constexpr,  # NaN/Inf inputs stored as 0 and counted here (a tier's device blocks)
):
    P: tl.constexpr = 8 // BITS
    i_tb = tl.program_id(0)
    i_h = tl.program_id(1)
    o_t = i_tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    o_j = tl.arange(0, NGI)[None, :, None] * DG + tl.arange(0, DG)[None, None, :]  # [1, NGI, DG] byte
    p_x = src_ptr + _src_rows(o_t, i_h, s_st, s_sh, s_sblk, SRC_BS)[:, None, None] + _src_cols(o_j, s_sdgrp, SS_D, SX)
    d_p = _src_cols(DC, s_sdgrp, SS_D, SX)  # plane k is k * d_p on: DC channels (rows: DC itself)
    m_x = (o_t < num_tokens)[:, None, None]
    m_w, i_blk, i_off = _slot_rows(slot_ptr, o_t, num_tokens, block_size, num_slots, SHIFT)
    b_x0 = tl.load(p_x, mask=m_x, other=0.0)  # every plane's load first: they go out together
    b_x1 = tl.load(p_x + d_p, mask=m_x, other=0.0)
    if P == 4:
        b_x2 = tl.load(p_x + 2 * d_p, mask=m_x, other=0.0)
        b_x3 = tl.load(p_x + 3 * d_p, mask=m_x, other=0.0)
    if ZERO_NONFINITE:  # before the statistics, so no NaN/Inf reaches a scale; counted over the written tokens
        m_z = m_w[:, None, None]
        b_x0, n_bad = _zero_nonfinite(b_x0, m_z)
        b_x1, n_k = _zero_nonfinite(b_x1, m_z)
        n_bad += n_k
        if P == 4:
            b_x2, n_k = _zero_nonfinite(b_x2, m_z)
            n_bad += n_k
            b_x3, n_k = _zero_nonfinite(b_x3, m_z)
            n_bad += n_k
        if n_bad > 0:
            tl.atomic_add(bad_ptr, n_bad)
    o_k = tl.arange(0, P)[None, None, :]  # [1, 1, P] the planes' scales: group k * NGI + g
    b_q = tl.zeros([BLOCK_T, NGI, DG], tl.int32)
    b_bad = tl.zeros([BLOCK_T, NGI, 1], tl.int32)
    b_ss = tl.zeros([BLOCK_T, NGI, P], tl.float16)
    b_zs = tl.zeros([BLOCK_T, NGI, P], tl.float16)
    b_q, b_ss, b_zs, b_bad = _fold(b_x0, 0, b_q, b_ss, b_zs, b_bad, o_k, 2, BITS, QMAX, RQ)
    b_q, b_ss, b_zs, b_bad = _fold(b_x1, 1, b_q, b_ss, b_zs, b_bad, o_k, 2, BITS, QMAX, RQ)
    if P == 4:
        b_q, b_ss, b_zs, b_bad = _fold(b_x2, 2, b_q, b_ss, b_zs, b_bad, o_k, 2, BITS, QMAX, RQ)
        b_q, b_ss, b_zs, b_bad = _fold(b_x3, 3, b_q, b_ss, b_zs, b_bad, o_k, 2, BITS, QMAX, RQ)
    p_sc = (cache_ptr.to(tl.pointer_type(tl.float16)) + sc_off + i_h.to(tl.int64) * sc_h
            + (i_blk * sc_blk + i_off * sc_tg)[:, None, None] + tl.arange(0, NGI)[None, :, None] + o_k * NGI)
    tl.store(p_sc, b_ss, mask=m_w[:, None, None])
    tl.store(p_sc + z_off, b_zs, mask=m_w[:, None, None])
    if tl.sum(b_bad) > 0:  # a NaN/Inf (or an overflow, a subnormal scale) in the program: the rare path
        b_q = _rare_words(p_x, d_p, m_x, m_w[:, None, None], bad_ptr, b_q, 2, P, BITS, QMAX, RQ, ZERO_NONFINITE)
    o_col = _columns(o_j, s_dgrp, S_D, X, DC)
    p_c = cache_ptr + (i_blk * s_blk + i_off * s_tok + i_h.to(tl.int64) * s_head)[:, None, None] + o_col
    tl.store(p_c, b_q.to(tl.uint8), mask=m_w[:, None, None])


@triton.jit
def _key_plane(b_xs, k: tl.constexpr, b_q, b_bad, p_sc, m_sc, z_off, TOK: tl.constexpr, BITS: tl.constexpr,
               QMAX: tl.constexpr, RQ: tl.constexpr):
    """Key plane ``k`` (tokens on axis ``TOK``): its per-channel scales and zero points stored at ``p_sc``, its bits
    into the packed words ``b_q``, its rare groups into ``b_bad``."""
    b_w, b_s, b_z, b_g, b_nf = _plane(b_xs, TOK, True, QMAX, RQ)
    tl.store(p_sc, b_s, mask=m_sc)
    tl.store(p_sc + z_off, b_z, mask=m_sc)
    return b_q + (b_w << (k * BITS)), b_bad | b_g


@triton.jit
def _write_key_groups_kernel(
    src_ptr, cache_ptr, slot_ptr, bad_ptr,  # as _write_groups_kernel
    num_tokens, block_size, num_slots, s_st, s_sh, s_sblk, s_sdgrp, s_blk, s_tok, s_head, s_dgrp,
    sc_blk, sc_off, sc_tg, sc_h, z_off,  # scales per (token group, head, channel) (workbench.quant.blocks)
    S_D: tl.constexpr, X: tl.constexpr, QMAX: tl.constexpr, RQ: tl.constexpr, BITS: tl.constexpr,
    DC: tl.constexpr,  # bytes a row
    G: tl.constexpr,  # tokens a key group (consecutive slots from a multiple of G: the wrapper checks)
    NKG: tl.constexpr,  # key groups per program
    VEC: tl.constexpr,  # channels a thread loads at once (fewer: more tokens a thread, one scale for more codes)
    TOK: tl.constexpr,  # the tile's token axis, 0 ([G, NKG, DC]) or 1 ([NKG, G, DC]): the one Triton keeps in a thread
    SHIFT: tl.constexpr,
    SRC_BS: tl.constexpr, SS_D: tl.constexpr, SX: tl.constexpr, ZERO_NONFINITE: tl.constexpr,  # as above
):
    P: tl.constexpr = 8 // BITS
    i_p = tl.program_id(0)
    i_h = tl.program_id(1)
    o_n = i_p.to(tl.int64) * NKG + tl.arange(0, NKG)  # [NKG] key groups
    o_g = tl.arange(0, G)
    # a group is G consecutive slots from a multiple of G (the wrapper checks), or G padding slots: its first
    # slot says where its codes and scales go
    m_g, i_blk, i_off0 = _slot_rows(slot_ptr, o_n * G, num_tokens, block_size, num_slots, SHIFT)  # [NKG]
    o_sg = i_blk * sc_blk + (i_off0 // G) * sc_tg  # [NKG] the group's scale row
    if TOK == 0:
        o_t = o_g[:, None] + o_n[None, :] * G  # [G, NKG] tokens
        i_row = i_blk[None, :] * s_blk + (i_off0[None, :] + o_g[:, None]) * s_tok
        m_g2 = m_g[None, :]
        o_sg2 = o_sg[None, :]
    else:
        o_t = o_n[:, None] * G + o_g[None, :]  # [NKG, G]
        i_row = i_blk[:, None] * s_blk + (i_off0[:, None] + o_g[None, :]) * s_tok
        m_g2 = m_g[:, None]
        o_sg2 = o_sg[:, None]
    o_j = tl.max_contiguous(tl.multiple_of(tl.arange(0, DC), VEC), VEC)[None, None, :]  # [1, 1, DC] byte
    p_x = src_ptr + _src_rows(o_t, i_h, s_st, s_sh, s_sblk, SRC_BS)[:, :, None] + _src_cols(o_j, s_sdgrp, SS_D, SX)
    d_p = _src_cols(DC, s_sdgrp, SS_D, SX)  # plane k is k * d_p on, as in _write_groups_kernel
    m_x = (o_t < num_tokens)[:, :, None]
    m_w = m_g2[:, :, None] & m_x
    b_x0 = tl.load(p_x, mask=m_x, other=0.0)  # every plane's load first, as in _write_groups_kernel
    b_x1 = tl.load(p_x + d_p, mask=m_x, other=0.0)
    if P == 4:
        b_x2 = tl.load(p_x + 2 * d_p, mask=m_x, other=0.0)
        b_x3 = tl.load(p_x + 3 * d_p, mask=m_x, other=0.0)
    if ZERO_NONFINITE:  # as in _write_groups_kernel
        b_x0, n_bad = _zero_nonfinite(b_x0, m_w)
        b_x1, n_k = _zero_nonfinite(b_x1, m_w)
        n_bad += n_k
        if P == 4:
            b_x2, n_k = _zero_nonfinite(b_x2, m_w)
            n_bad += n_k
            b_x3, n_k = _zero_nonfinite(b_x3, m_w)
            n_bad += n_k
        if n_bad > 0:
            tl.atomic_add(bad_ptr, n_bad)
    p_sc = (cache_ptr.to(tl.pointer_type(tl.float16)) + sc_off + i_h.to(tl.int64) * sc_h
            + o_sg2[:, :, None] + o_j)  # [1, NKG, DC] or [NKG, 1, DC]: channel k * DC + j of plane k
    m_sc = m_g2[:, :, None]
    b_q = tl.zeros(b_x0.shape, tl.int32)
    b_bad = tl.zeros(m_sc.shape, tl.int32)
    b_q, b_bad = _key_plane(b_x0, 0, b_q, b_bad, p_sc, m_sc, z_off, TOK, BITS, QMAX, RQ)
    b_q, b_bad = _key_plane(b_x1, 1, b_q, b_bad, p_sc + DC, m_sc, z_off, TOK, BITS, QMAX, RQ)
    if P == 4:
        b_q, b_bad = _key_plane(b_x2, 2, b_q, b_bad, p_sc + 2 * DC, m_sc, z_off, TOK, BITS, QMAX, RQ)
        b_q, b_bad = _key_plane(b_x3, 3, b_q, b_bad, p_sc + 3 * DC, m_sc, z_off, TOK, BITS, QMAX, RQ)
    if tl.sum(b_bad) > 0:  # the rare path, as in _write_groups_kernel
        b_q = _rare_words(p_x, d_p, m_x, m_w, bad_ptr, b_q, TOK, P, BITS, QMAX, RQ, ZERO_NONFINITE)
    p_c = cache_ptr + (i_row + i_h.to(tl.int64) * s_head)[:, :, None] + _columns(o_j, s_dgrp, S_D, X, DC)
    tl.store(p_c, b_q.to(tl.uint8), mask=m_w)


# A 3-D tile's two axes of unit contiguity (tokens, key groups): Triton 3.9 gives lanes to the later one, 3.6 to the
# earlier one. The token axis goes where the lanes do not, so a group's tokens stay in one thread.
TOKEN_AXIS = 0 if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 9) else 1


def groups_kernel(scheme, kind: str, head_dim: int, sc, tokens_per_program: int | None, num_warps: int | None):
    """``(kernel, tokens a program, constexprs)`` of one kind's launch (``kernels/write/dynamic.py``'s table), or
    None where the shape is not one these kernels take (a byte row that is not a power of two, or per-token groups
    wider than a plane): the generic kernel writes those."""
    dc, bits = scheme.code_dim(head_dim), scheme.bits
    per = 8 // bits
    if per not in (2, 4) or dc < 2 or dc & (dc - 1):
        return None
    warps = num_warps or 4
    base = dict(QMAX=scheme.format.qmax, RQ=rcp32(scheme.format.qmax), BITS=bits, DC=dc, num_warps=warps)
    if sc.tokens_per_group == 1:  # per token, groups of channels
        dg = sc.channels_per_group
        if dg > dc or dc % dg:
            return None
        bt = tokens_per_program or 64
        return _write_groups_kernel, bt, dict(base, NGI=dc // dg, DG=dg, BLOCK_T=bt)
    g = sc.tokens_per_group  # per channel over g consecutive tokens
    vec = max(1, min(8, 128 // (g * per), dc))  # <= 128 elements a thread: g tokens x per planes x vec bytes
    nkg = max(1, 32 * warps * vec // dc)  # the lanes and warps across groups and bytes, the tokens in a thread
    return _write_key_groups_kernel, nkg * g, dict(base, G=g, NKG=nkg, VEC=vec, TOK=TOKEN_AXIS)
