"""The cascade's kernels (:mod:`.cascade` plans them): the shared pass, which reads its stacked query rows straight
from the batch's queries, and the merge of both passes' split partials.

**The shared pass** (:func:`_shared_pass_kernel`). One program decodes one (shared tile, kv head, split) like the
decode kernel (its body is :func:`.kernel._attend_context`), but its query rows come from ``q`` through the tile's row
map: no gathered copy of the queries, one launch less a step.

**Merged in the shared pass, measured and dropped** (H100, 2026-12-05, ``scripts/probe_cascade_passes.py``): the
program that finished a row's last shared partial (an atomic ticket) merged the row, so a step was two launches.
The host time fell (112 against 167 us a step) but the GPU time rose by 30-100 us at 32k x 64: the merges ran in the
32 programs that finished last, each a serial chain of dependent loads over its 64 rows' split partials, where the
separate merge kernel spreads them over 2048 programs on every SM.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel import _attend_context


@triton.jit
def _absorb(b_m, b_l, b_acc, b_s, p_v, m_d):
    """One partial state (base-2 LSE ``b_s``, normalized output at ``p_v``) folded into the running merge."""
    b_v = tl.load(p_v, mask=m_d, other=0.0)
    b_m_new = tl.maximum(b_m, b_s)
    b_alpha = tl.exp2(b_m - b_m_new)
    b_w = tl.exp2(b_s - b_m_new)
    return b_m_new, b_l * b_alpha + b_w, b_acc * b_alpha + b_w * b_v


@triton.jit
def _shared_pass_kernel(
    # the decode kernel's arguments (the shared plan's, SPLIT), q the batch's own [B, Hq, D] (contiguous)
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, o_part_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, k_scale, v_scale,
    qk_scale, s_qb, s_qh, s_ob, s_oh, s_bt, k_s_blk, k_s_tok, k_s_head, k_s_dgrp, v_s_blk, v_s_tok, v_s_head, v_s_d,
    chunk, num_splits, s_sc_h, ks_blk, ks_off, ks_tg, ks_h, kz_off, vs_blk, vs_off, vs_tg, vs_h, vz_off,
    rows_ptr,  # [tiles, Hkv, G] int32: the q row (batch row * Hq + query head) of each tile row, or -1
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, KX: tl.constexpr, V_TRANS: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr, SCALE_PTR: tl.constexpr, K_BM: tl.constexpr, K_TM: tl.constexpr, K_HM: tl.constexpr,
    K_GM: tl.constexpr, V_BM: tl.constexpr, V_TM: tl.constexpr, V_HM: tl.constexpr, V_DM: tl.constexpr,
    V_ALIGN: tl.constexpr, ASM: tl.constexpr, K3D: tl.constexpr, QMODE: tl.constexpr = 0, QMAX: tl.constexpr = 1.0,
    SC_DTYPE: tl.constexpr = tl.float32, DC: tl.constexpr = 0, BLOCK_DC: tl.constexpr = 16, BITS: tl.constexpr = 8,
    K_TG: tl.constexpr = 1, K_DG: tl.constexpr = 1, V_TG: tl.constexpr = 1, V_DG: tl.constexpr = 1,
    CODES: tl.constexpr = 0, FAST_INT: tl.constexpr = False, BATCH_FAST: tl.constexpr = False,
):
    if BATCH_FAST:
        i_b = tl.program_id(0)
        i_s = tl.program_id(2)
    else:
        i_s = tl.program_id(0)
        i_b = tl.program_id(2)
    i_hk = tl.program_id(1)
    seq_len = tl.load(lens_ptr + i_b)
    lo = i_s * chunk
    if lo >= seq_len:
        return  # a split past its segment's chunks
    hi = tl.where(i_s == num_splits - 1, seq_len, tl.minimum(lo + chunk, seq_len))
    o_g = tl.arange(0, G_PAD)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < G
    m_d = o_d < HEAD_DIM
    r_q = tl.load(rows_ptr + (i_b * tl.num_programs(1) + i_hk) * G + o_g, mask=m_g, other=-1).to(tl.int64)
    b_q = tl.load(q_ptr + r_q[:, None] * s_qh + o_d[None, :], mask=(r_q >= 0)[:, None] & m_d[None, :], other=0.0)
    b_o, b_lse = _attend_context(
        b_q, i_b, i_hk, lo, hi, k_ptr, v_ptr, bt_ptr, k_scale_ptr, v_scale_ptr, k_scale, v_scale, qk_scale, s_bt,
        k_s_blk, k_s_tok, k_s_head, k_s_dgrp, v_s_blk, v_s_tok, v_s_head, v_s_d, s_sc_h,
        ks_blk, ks_off, ks_tg, ks_h, kz_off, vs_blk, vs_off, vs_tg, vs_h, vz_off,
        G_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, KX, V_TRANS, USE_DOT, IEEE, SCALE_PTR, K_BM, K_TM, K_HM, K_GM,
        V_BM, V_TM, V_HM, V_DM, V_ALIGN, ASM, K3D, QMODE, QMAX, SC_DTYPE, DC, BLOCK_DC, BITS, K_TG, K_DG, V_TG,
        V_DG, CODES, FAST_INT)
    row = (i_b.to(tl.int64) * (G * tl.num_programs(1)) + i_hk * G + o_g) * num_splits + i_s  # [G_PAD]
    tl.store(o_part_ptr + row[:, None] * HEAD_DIM + o_d[None, :], b_o, mask=m_g[:, None] & m_d[None, :])
    tl.store(lse_ptr + row, b_lse, mask=m_g)


@triton.jit
def _merge_passes_kernel(
    sh_o_ptr, sh_s_ptr,  # the shared pass's split partials [V, Hkv * T, S_sh, D] fp32 / [V, Hkv * T, S_sh]
    sh_len_ptr,  # [V] int32 tokens of each shared tile's segment
    sx_o_ptr, sx_s_ptr,  # the suffix pass's [B, Hq, S_sx, D] / [B, Hq, S_sx]
    sx_len_ptr,  # [B] int32 suffix tokens
    idx_ptr,  # [B, L, Hq] int32 shared state of each (row, segment, query head): tile * Hkv * T + tile row, or -1
    out_ptr,  # [B, Hq, D]
    lse_ptr,  # [B, Hq] fp32 (HAS_LSE)
    s_ob, s_oh,
    num_segments, num_heads, tile_heads,  # L, Hq, Hkv * T
    sh_splits, sh_chunk, sx_splits, sx_chunk,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """Every state of one (row, query head): each split partial of each of its segments, then of its suffix (a
    split past a sequence's ``ceil(len / chunk)`` was never written, an empty one has LSE ``-inf``)."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    b_m = tl.zeros((), tl.float32) + float("-inf")
    b_l = tl.zeros((), tl.float32)
    b_acc = tl.zeros([BLOCK_D], tl.float32)
    for i_s in range(num_segments):
        st = tl.load(idx_ptr + (i_b * num_segments + i_s) * num_heads + i_h).to(tl.int64)
        if st >= 0:
            n = tl.minimum(tl.cdiv(tl.load(sh_len_ptr + st // tile_heads), sh_chunk), sh_splits)
            for j in range(n):
                b_s = tl.load(sh_s_ptr + st * sh_splits + j)
                if b_s > float("-inf"):
                    b_m, b_l, b_acc = _absorb(b_m, b_l, b_acc, b_s, sh_o_ptr + (st * sh_splits + j) * HEAD_DIM + o_d,
                                              m_d)
    row = i_b * num_heads + i_h
    n = tl.minimum(tl.cdiv(tl.load(sx_len_ptr + i_b), sx_chunk), sx_splits)
    for j in range(n):
        b_s = tl.load(sx_s_ptr + row * sx_splits + j)
        if b_s > float("-inf"):
            b_m, b_l, b_acc = _absorb(b_m, b_l, b_acc, b_s, sx_o_ptr + (row * sx_splits + j) * HEAD_DIM + o_d, m_d)
    b_l_safe = tl.where(b_l > 0, b_l, 1.0)
    tl.store(out_ptr + i_b * s_ob + i_h * s_oh + o_d, (b_acc / b_l_safe).to(out_ptr.dtype.element_ty), mask=m_d)
    if HAS_LSE:
        tl.store(lse_ptr + i_b * num_heads + i_h, tl.where(b_l > 0, b_m + tl.log2(b_l_safe), float("-inf")))
