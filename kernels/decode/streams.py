"""Paged decode of packed per-token codes (int4 / int2): the MMA's padding rows filled by streams.

A dot's smallest M is 16 rows, and a GQA group has 4 query heads (1 for MHA): the planes kernel (``groups.py``) pads
the group to 16 rows, so 3/4 of every score, softmax and scale instruction works on padding. Per token, packed codes
are 3-4x fewer bytes than fp16 but the same per-token arithmetic; on padded rows that arithmetic, not the bytes,
set the speed (``bench anatomy``, int4 with one scale a token-head: the planes kernel at 1.87x the H200's issue
budget, docs/quant_tuning.md; 1.21x at 128-token tiles).

Here the padding rows carry work. A tile of ``BLOCK_N`` tokens is cut into ``R`` *streams* of ``NR = BLOCK_N / R``
consecutive tokens (``G * R <= 16``); row ``r = g * R + j`` of the tile's ``[16, NR]`` scores is query head ``g``
against stream ``j``:

- per stream, one plain ``[NR, CW / 2]`` tile of code words is loaded and dotted with q's plane (every row of a head
  holds its q); row ``(g, j)`` keeps the result of stream ``j`` (a select): the same MMA work as the padded kernel,
  and softmax, scales and zero points on ``16 NR`` entries of which ``G R NR`` are useful (all of them at ``G R = 16``)
  instead of ``16 BLOCK_N`` of which ``G BLOCK_N``;
- each row keeps its own online softmax (a row is a split of its head's tokens: flash-decoding inside a program);
- ``acc += p_j @ v_j`` with ``p_j`` the probabilities of stream ``j``'s rows only (the others zeroed), so each row
  accumulates its own stream; at the end each head's ``R`` rows are merged by their log-sum-exp.

Codes are read as int16 words (two code bytes): each bit field of a word is an elementwise, same-width function
of it (``_word_planes``: on the GPU one PTX block does two words, ``prmt`` + ``and`` + ``sub.f16x2``; under the
interpreter the same arithmetic in Triton), so the compiler moves fp16 values, not bytes, into the MMA's operand
layout. Field ``(b, k)`` of word ``i`` of chunk ``c`` is channel ``k * DC + c * CW + 2 i + b``: q is loaded in that
order (a dot does not care) and the output stored back to those channels.

Scales per token (``K_TG == 1``; keys per channel stay on ``groups.py``) multiply the score columns
(``s (q . c) + z sum(q)``) and the probabilities, per plane, or once for all planes where a group is the whole
head (``K_DG >= HEAD_DIM``, e.g. ``bench quant_decode``'s ``int4/token@head``): that case is the one this design
is for (per-plane scales keep a score accumulator per plane). Layouts ``nhd`` and ``hnd``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from workbench.core.layout import Layout

from .kernel import _load_page

ROWS = tl.constexpr(16)  # a dot's smallest M: the rows a program fills with (query head, stream) pairs


@triton.jit
def _word_planes(w, BITS: tl.constexpr, ASM: tl.constexpr):
    """The bit fields of an int16 tile (two code bytes a word) as fp16 tiles of the same shape: field ``(b, k)``
    (byte ``b`` of the word, bits ``[k BITS, (k + 1) BITS)`` of it) holds ``(code - HALF) 2**(BITS k)`` (exact;
    ``HALF = 2**(BITS - 1)``). A tuple of ``2 * 8 // BITS`` tiles, index ``b * (8 // BITS) + k``. Same-width and
    elementwise, so the compiler converts the fp16 results (not bytes) to the MMA's operand layout."""
    if ASM:  # one return at the end: Triton 3.6 types every return of a function, pruned branch or not
        # int4: one lop3 a field pair, (w & mask) | 0x64006400 puts a nibble of each of the register's two words under
        # the 0x64 exponent byte (byte 1 of each word after a shift by 8); sub.f16x2 takes 1024 (+ HALF) off both
        # halves. int2: prmt puts byte b of each word under 0x64 (selector 0x5240: bytes 0 and 2; 0x5341: 1 and 3)
        if BITS == 4:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 h, m, n; mov.b32 m, 0x64086408; mov.b32 n, 0x64806480; shr.b32 h, $4, 8; "
                "lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xea; lop3.b32 $1, $4, 0x00F000F0, 0x64006400, 0xea; "
                "lop3.b32 $2, h, 0x000F000F, 0x64006400, 0xea; lop3.b32 $3, h, 0x00F000F0, 0x64006400, 0xea; "
                "sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, n; sub.f16x2 $2, $2, m; sub.f16x2 $3, $3, n; }",
                "=r,=r,=r,=r,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
        else:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t, u, m0, m1, m2, m3; mov.b32 m0, 0x64026402; mov.b32 m1, 0x64086408; "
                "mov.b32 m2, 0x64206420; mov.b32 m3, 0x64806480; "
                "prmt.b32 t, $8, 0x64646464, 0x5240; prmt.b32 u, $8, 0x64646464, 0x5341; "
                "and.b32 $0, t, 0xFF03FF03; and.b32 $1, t, 0xFF0CFF0C; and.b32 $2, t, 0xFF30FF30; "
                "and.b32 $3, t, 0xFFC0FFC0; and.b32 $4, u, 0xFF03FF03; and.b32 $5, u, 0xFF0CFF0C; "
                "and.b32 $6, u, 0xFF30FF30; and.b32 $7, u, 0xFFC0FFC0; "
                "sub.f16x2 $0, $0, m0; sub.f16x2 $1, $1, m1; sub.f16x2 $2, $2, m2; sub.f16x2 $3, $3, m3; "
                "sub.f16x2 $4, $4, m0; sub.f16x2 $5, $5, m1; sub.f16x2 $6, $6, m2; sub.f16x2 $7, $7, m3; }",
                "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16,
                       tl.float16), is_pure=True, pack=2)
    else:
        x = w.to(tl.int32) & 0xFFFF
        out = ()
        for b in tl.static_range(2):
            for k in tl.static_range(8 // BITS):
                f = ((((x >> (8 * b)) & (((1 << BITS) - 1) << (k * BITS))) | 0x6400).to(tl.int16)
                     .to(tl.float16, bitcast=True))
                out = out + (f - (1024.0 + (1 << (BITS - 1 + k * BITS))),)
    return out


@triton.jit
def _scale_of(ptr, m_t, MASKED: tl.constexpr):
    """fp32 of the fp16 scales (or zero points) at ``ptr``; in a ``MASKED`` tile 0 where ``m_t`` is false."""
    if MASKED:
        return tl.load(ptr, mask=m_t, other=0.0).to(tl.float32)
    return tl.load(ptr).to(tl.float32)


@triton.jit
def _spread(x, ROWS_: tl.constexpr, R: tl.constexpr):
    """``[R, NR]`` values of the streams spread over a tile's rows ``[ROWS, NR]`` (row ``g R + j``: stream ``j``)."""
    return tl.reshape(tl.broadcast_to(x[None, :, :], [ROWS_ // R, R, x.shape[1]]), [ROWS_, x.shape[1]])


@triton.jit
def _scale_rows(bt_row, t, last, ks_blk, ks_tg, vs_blk, vs_tg, PAGE: tl.constexpr, ASM: tl.constexpr,
                MASKED: tl.constexpr):
    """Offsets of the K and V per-token scales of the tokens ``t`` ``[ROWS, NR]`` (the caller adds the group); tokens
    past ``last`` (only in a ``MASKED`` tile) read its page."""
    i_pg = _load_page(bt_row + (tl.minimum(t, last) if MASKED else t) // PAGE, ASM).to(tl.int64)
    o_t = t % PAGE
    return i_pg * ks_blk + o_t * ks_tg, i_pg * vs_blk + o_t * vs_tg


@triton.jit
def _streams_tile(b_qp, b_qsum, b_m, b_l, b_zs, b_acc, start, hi, bt_row, k_base, v_base, s_scale,
                  k_s_blk, k_s_tok, v_s_blk, v_s_tok, ks_base, vs_base, ks_blk, ks_tg, kz_off, vs_blk, vs_tg, vz_off,
                  NR: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr,
                  DC: tl.constexpr, CW: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr,
                  K_DG: tl.constexpr, V_DG: tl.constexpr, HEAD_DIM: tl.constexpr, OP: tl.constexpr,
                  IEEE: tl.constexpr, ROWS_: tl.constexpr):
    """One tile: ``R`` streams of ``NR`` tokens from ``start``. Planes ``(c, b, k)`` (chunk, byte of the word, field
    of the byte; index ``(c * 2 + b) * PER + k``): ``b_qp`` q's plane ``[ROWS, CW / 2]`` (every row of a head);
    ``b_qsum`` per plane ``[ROWS]`` fp32 (one entry when a group is the head); ``b_m`` ``[ROWS]``; ``b_l`` and
    (``V_DG >= HEAD_DIM``) ``b_zs``, the sums of p and of p times the value zero points, kept per column ``[ROWS, NR]``
    and added up after the loop (a row sum a tile is shuffles and a barrier across the warps); ``b_acc``
    per plane ``[ROWS, CW / 2]`` fp32, each row its own stream's. ``k_base``/``v_base``: int16 pointers."""
    PER: tl.constexpr = 8 // BITS
    NP: tl.constexpr = 2 * PER  # planes a chunk of words
    CW2: tl.constexpr = CW // 2  # words a chunk
    HALF: tl.constexpr = 1 << (BITS - 1)  # the planes hold codes centred on it
    K_ONE: tl.constexpr = K_DG >= HEAD_DIM  # one key scale a token: the planes' dots add up before it
    V_ONE: tl.constexpr = V_DG >= HEAD_DIM
    last = tl.maximum(hi - 1, 0)
    o_i = tl.arange(0, CW2)
    o_n = tl.arange(0, NR)
    j_r = tl.arange(0, ROWS_) % R  # the row's stream
    t = start + j_r[:, None] * NR + o_n[None, :]  # [ROWS, NR]: the token of each score
    m_t = t < hi  # all true but in the last (MASKED) tile: no masks in the loop's tiles
    o_ks, o_vs = _scale_rows(bt_row, t, last, ks_blk, ks_tg, vs_blk, vs_tg, PAGE, ASM, MASKED)
    # one scale a token-head: each (stream, token) loaded once, [R, NR], then spread over the heads' rows
    t_r = start + tl.arange(0, R)[:, None] * NR + o_n[None, :]
    m_tr = t_r < hi
    o_ksr, o_vsr = _scale_rows(bt_row, t_r, last, ks_blk, ks_tg, vs_blk, vs_tg, PAGE, ASM, MASKED)
    # the streams' rows (in words): stream j is tokens [start + j NR, start + (j + 1) NR), a plain tile each
    k_rows = ()
    v_rows = ()
    m_rows = ()
    for j in tl.static_range(R):
        t_j = start + j * NR + o_n
        i_pg = _load_page(bt_row + (tl.minimum(t_j, last) if MASKED else t_j) // PAGE, ASM).to(tl.int64)
        k_rows = k_rows + ((i_pg * k_s_blk + (t_j % PAGE) * k_s_tok) // 2,)
        v_rows = v_rows + ((i_pg * v_s_blk + (t_j % PAGE) * v_s_tok) // 2,)
        m_rows = m_rows + (t_j < hi,)
    # scores: every row's q against stream j's keys, kept in the rows of stream j (one q operand a plane: copies
    # masked per stream cost registers and spill the operands to shared memory)
    b_s = tl.zeros([ROWS_, NR], dtype=tl.float32)
    b_d = ()  # K_ONE: per stream, the sum of every plane's dots
    for _j in tl.static_range(R):
        b_d = b_d + (tl.zeros([ROWS_, NR], dtype=tl.float32),)
    for c in tl.static_range(DC // CW):
        b_dp = ()  # per plane of the chunk (not K_ONE): its dots, each row's own stream
        for _f in tl.static_range(NP):
            b_dp = b_dp + (tl.zeros([ROWS_, NR], dtype=tl.float32),)
        new_d = ()
        for j in tl.static_range(R):
            p_k = k_base + k_rows[j][:, None] + (c * CW2 + o_i)[None, :]
            if MASKED:
                b_kc = tl.load(p_k, mask=m_rows[j][:, None], other=0)  # [NR, CW2] words
            else:
                b_kc = tl.load(p_k)
            planes = _word_planes(b_kc, BITS, ASM)
            b_dj = b_d[j]
            new_p = ()
            for f in tl.static_range(NP):
                if K_ONE:
                    b_dj = tl.dot(b_qp[c * NP + f], tl.trans(planes[f].to(OP)), b_dj,
                                  input_precision="ieee" if IEEE else None)
                else:
                    b_x = tl.dot(b_qp[c * NP + f], tl.trans(planes[f].to(OP)), input_precision="ieee" if IEEE else None)
                    new_p = new_p + (b_dp[f] + tl.where((j_r == j)[:, None], b_x, 0.0),)
            new_d = new_d + (b_dj,)
            if not K_ONE:
                b_dp = new_p
        b_d = new_d
        if not K_ONE:
            for f in tl.static_range(NP):
                ch0 = (f % PER) * DC + c * CW  # the plane's channels lie in group ch0 // K_DG
                b_sc = _scale_of(ks_base + o_ks + ch0 // K_DG, m_t, MASKED)
                b_z = _scale_of(ks_base + kz_off + o_ks + ch0 // K_DG, m_t, MASKED)
                b_s += b_dp[f] * b_sc + b_qsum[c * NP + f][:, None] * (b_z + HALF * b_sc)
    if K_ONE:
        b_sc = _spread(_scale_of(ks_base + o_ksr, m_tr, MASKED), ROWS_, R)
        b_z = _spread(_scale_of(ks_base + kz_off + o_ksr, m_tr, MASKED), ROWS_, R)
        b_all = tl.zeros([ROWS_, NR], dtype=tl.float32)
        for j in tl.static_range(R):
            b_all = tl.where((j_r == j)[:, None], b_d[j], b_all)
        b_s = b_all * b_sc + b_qsum[0][:, None] * (b_z + HALF * b_sc)
    if MASKED:
        b_s = tl.where(m_t, b_s * s_scale, float("-inf"))
    else:
        b_s = b_s * s_scale
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # -inf for a row whose stream has not begun: its p is 0
    b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_alpha = tl.exp2(b_m - b_m_use)
    b_p = tl.exp2(b_s - b_m_use[:, None])  # [ROWS, NR]; 0 past the end
    b_l = b_l * b_alpha[:, None] + b_p
    if V_ONE:  # one value scale a token: one operand for every plane
        b_vsc = _spread(_scale_of(vs_base + o_vsr, m_tr, MASKED), ROWS_, R)
        b_vz = _spread(_scale_of(vs_base + vz_off + o_vsr, m_tr, MASKED), ROWS_, R)
        b_pv_one = (b_p * (b_vsc * QMAX)).to(OP)
        b_zs = b_zs * b_alpha[:, None] + b_p * (b_vz + HALF * b_vsc)
    acc = ()
    for c in tl.static_range(DC // CW):
        cur = ()  # this chunk's planes: the rescaled accumulator plus the zero point's share
        b_pvs = ()  # and the fp16 operand p * scale * QMAX
        for f in tl.static_range(NP):
            if V_ONE:
                b_pv = b_pv_one
            else:
                ch0 = (f % PER) * DC + c * CW
                b_vsc = _scale_of(vs_base + o_vs + ch0 // V_DG, m_t, MASKED)
                b_vz = _scale_of(vs_base + vz_off + o_vs + ch0 // V_DG, m_t, MASKED)
                b_pv = (b_p * (b_vsc * QMAX)).to(OP)
                b_pz = tl.sum(b_p * (b_vz + HALF * b_vsc), 1)
            b_pvs = b_pvs + (b_pv,)
            if V_ONE:  # the zero point's share: b_zs, after the loop
                cur = cur + (b_acc[c * NP + f] * b_alpha[:, None],)
            else:  # the zero point's share, in the accumulator's units (x QMAX x the field's power of two)
                cur = cur + (b_acc[c * NP + f] * b_alpha[:, None]
                             + (b_pz * (QMAX * (1 << ((f % PER) * BITS))))[:, None],)
        for j in tl.static_range(R):
            p_v = v_base + v_rows[j][:, None] + (c * CW2 + o_i)[None, :]
            if MASKED:
                b_vc = tl.load(p_v, mask=m_rows[j][:, None], other=0)
            else:
                b_vc = tl.load(p_v)
            planes = _word_planes(b_vc, BITS, ASM)
            new = ()
            for f in tl.static_range(NP):
                b_pj = tl.where((j_r == j)[:, None], b_pvs[f], 0.0).to(OP)  # stream j's rows only
                new = new + (tl.dot(b_pj, planes[f].to(OP), cur[f], input_precision="ieee" if IEEE else None),)
            cur = new
        acc = acc + cur
    return b_m_new, b_l, b_zs, acc


@triton.jit
def _streams_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, o_part_ptr, lse_ptr,
    k_scale_ptr, v_scale_ptr, k_scale, v_scale, qk_scale,
    s_qb, s_qh, s_ob, s_oh, s_bt,
    k_s_blk, k_s_tok, k_s_head, k_s_dgrp,
    v_s_blk, v_s_tok, v_s_head, v_s_d,
    chunk, num_splits,
    s_sc_h,
    ks_blk, ks_off, ks_tg, ks_h, kz_off,
    vs_blk, vs_off, vs_tg, vs_h, vz_off,
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, KX: tl.constexpr, V_TRANS: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr, SCALE_PTR: tl.constexpr,
    K_BM: tl.constexpr, K_TM: tl.constexpr, K_HM: tl.constexpr, K_GM: tl.constexpr,
    V_BM: tl.constexpr, V_TM: tl.constexpr, V_HM: tl.constexpr, V_DM: tl.constexpr, V_ALIGN: tl.constexpr,
    ASM: tl.constexpr, K3D: tl.constexpr,
    QMODE: tl.constexpr = 4, QMAX: tl.constexpr = 15.0, SC_DTYPE: tl.constexpr = tl.float16,
    DC: tl.constexpr = 0, BLOCK_DC: tl.constexpr = 16, BITS: tl.constexpr = 4,
    K_TG: tl.constexpr = 1, K_DG: tl.constexpr = 1, V_TG: tl.constexpr = 1, V_DG: tl.constexpr = 1,
    CODES: tl.constexpr = 0, FAST_INT: tl.constexpr = False, BATCH_FAST: tl.constexpr = False,
    CW: tl.constexpr = 32, R: tl.constexpr = 4,
):
    """``_paged_decode_kernel``'s arguments (the plan launches either); see the module docstring. ``R``: streams a
    tile (``G * R <= 16``); ``CW``: bytes of a row a chunk (``streams_launch``)."""
    PER: tl.constexpr = 8 // BITS
    NP: tl.constexpr = 2 * PER
    CW2: tl.constexpr = CW // 2
    NR: tl.constexpr = BLOCK_N // R
    GR: tl.constexpr = ROWS // R  # heads a program's rows can hold (>= G)
    K_ONE: tl.constexpr = K_DG >= HEAD_DIM
    if BATCH_FAST:
        i_b = tl.program_id(0)
        i_s = tl.program_id(2)
    else:
        i_s = tl.program_id(0)
        i_b = tl.program_id(2)
    i_hk = tl.program_id(1)
    seq_len = tl.load(lens_ptr + i_b)
    lo = i_s * chunk
    if SPLIT:
        if lo >= seq_len:
            return
    hi = tl.where(i_s == num_splits - 1, seq_len, tl.minimum(lo + chunk, seq_len))

    OP: tl.constexpr = tl.float32 if IEEE else q_ptr.dtype.element_ty
    o_r = tl.arange(0, ROWS)
    g_r = o_r // R  # the row's query head
    m_r = g_r < G
    o_i = tl.arange(0, CW2)
    p_q = q_ptr + i_b.to(tl.int64) * s_qb + (i_hk * G + g_r)[:, None] * s_qh
    b_qp = ()  # per plane (c, b, k): q at channels k DC + c CW + 2 i + b, every row of its head
    b_qsum = ()
    b_acc = ()
    b_qtot = tl.zeros([ROWS], dtype=tl.float32)
    for c in tl.static_range(DC // CW):
        for f in tl.static_range(NP):
            ch = (f % PER) * DC + c * CW + 2 * o_i + f // PER
            b_q = tl.load(p_q + ch[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
            b_qsum = b_qsum + (tl.sum(b_q, 1),)
            b_qtot += tl.sum(b_q, 1)
            b_qp = b_qp + ((b_q * (1.0 / (1 << ((f % PER) * BITS)))).to(OP),)  # exact: a power of two
            b_acc = b_acc + (tl.zeros([ROWS, CW2], dtype=tl.float32),)
    if K_ONE:
        b_qsum = (b_qtot,)
    ks_base = k_ptr.to(tl.pointer_type(SC_DTYPE)) + (ks_off + i_hk.to(tl.int64) * ks_h)
    vs_base = v_ptr.to(tl.pointer_type(SC_DTYPE)) + (vs_off + i_hk.to(tl.int64) * vs_h)
    k_base = k_ptr.to(tl.pointer_type(tl.int16)) + i_hk.to(tl.int64) * (k_s_head * K_HM) // 2
    v_base = v_ptr.to(tl.pointer_type(tl.int16)) + i_hk.to(tl.int64) * (v_s_head * V_HM) // 2
    bt_row = bt_ptr + i_b.to(tl.int64) * s_bt
    s_scale = qk_scale * k_scale

    b_m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([ROWS, NR], dtype=tl.float32)
    b_zs = tl.zeros([ROWS, NR], dtype=tl.float32)
    i_end = hi // BLOCK_N  # whole tiles in the loop, the partial last one after it (masked)
    for i_t in range(lo // BLOCK_N, i_end):
        b_m, b_l, b_zs, b_acc = _streams_tile(
            b_qp, b_qsum, b_m, b_l, b_zs, b_acc, i_t * BLOCK_N, hi, bt_row, k_base, v_base, s_scale,
            k_s_blk * K_BM, k_s_tok * K_TM, v_s_blk * V_BM, v_s_tok * V_TM, ks_base, vs_base, ks_blk, ks_tg, kz_off,
            vs_blk, vs_tg, vz_off, NR, R, PAGE, ASM, False, DC, CW, BITS, QMAX, K_DG, V_DG, HEAD_DIM, OP, IEEE, ROWS)
    if hi % BLOCK_N != 0:
        b_m, b_l, b_zs, b_acc = _streams_tile(
            b_qp, b_qsum, b_m, b_l, b_zs, b_acc, i_end * BLOCK_N, hi, bt_row, k_base, v_base, s_scale,
            k_s_blk * K_BM, k_s_tok * K_TM, v_s_blk * V_BM, v_s_tok * V_TM, ks_base, vs_base, ks_blk, ks_tg, kz_off,
            vs_blk, vs_tg, vz_off, NR, R, PAGE, ASM, True, DC, CW, BITS, QMAX, K_DG, V_DG, HEAD_DIM, OP, IEEE, ROWS)

    b_l = tl.sum(b_l, 1)
    if V_DG >= HEAD_DIM:  # the value zero points' share, in the accumulator's units (x QMAX x the field's power of 2)
        b_pz = tl.sum(b_zs, 1)
        acc = ()
        for f in tl.static_range(NP * (DC // CW)):
            acc = acc + (b_acc[f] + (b_pz * (QMAX * (1 << ((f % PER) * BITS))))[:, None],)
        b_acc = acc
    # merge each head's R streams: weights 2**(m_r - M_g), M_g the head's max (a stream that saw nothing weighs 0)
    b_mg = tl.max(tl.reshape(b_m, [GR, R]), 1)  # [GR]
    b_mg_use = tl.where(b_mg == float("-inf"), 0.0, b_mg)
    b_w = tl.exp2(tl.reshape(b_m, [GR, R]) - b_mg_use[:, None])  # [GR, R]
    b_lg = tl.sum(tl.reshape(b_l, [GR, R]) * b_w, 1)  # [GR]
    b_lg_safe = tl.where(b_lg > 0, b_lg, 1.0)  # an empty sequence keeps acc == 0
    o_g = tl.arange(0, GR)
    m_g = o_g < G
    i_hq = i_hk * G + o_g
    for c in tl.static_range(DC // CW):
        for f in tl.static_range(NP):
            ch = (f % PER) * DC + c * CW + 2 * o_i + f // PER  # the plane's channels
            b_head = tl.sum(tl.reshape(b_acc[c * NP + f], [GR, R, CW2]) * b_w[:, :, None], 1)  # [GR, CW2]
            # the accumulator carried QMAX and the field's power of two: both come off here
            b_o = b_head * ((v_scale / (QMAX * (1 << ((f % PER) * BITS)))) / b_lg_safe)[:, None]
            if SPLIT:
                row = (i_b.to(tl.int64) * (G * tl.num_programs(1)) + i_hq) * num_splits + i_s
                tl.store(o_part_ptr + row[:, None] * HEAD_DIM + ch[None, :], b_o, mask=m_g[:, None])
            else:
                p_o = out_ptr + i_b.to(tl.int64) * s_ob + i_hq[:, None] * s_oh + ch[None, :]
                tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_g[:, None])
    if SPLIT:
        row = (i_b.to(tl.int64) * (G * tl.num_programs(1)) + i_hq) * num_splits + i_s
        tl.store(lse_ptr + row, b_mg + tl.log2(b_lg_safe), mask=m_g)


def streams_tile(mean_context: float, max_context: float) -> int:
    """The streams kernel's tile where the caller names none: 256 tokens for batches of even contexts from 1k tokens,
    else 128 (int4 with one scale a token-head, H200, 2026-12-05, speed-up over fp16 at 256 / 128: W1 (4k) 1.50 /
    1.42, W2 (32k) 1.58 / 1.30, W4 (2k, MHA) 1.50 / 1.35; W3 (512) 1.12 / 1.15; the ragged W5 (mean 4k, longest
    8k) 1.31 / 1.53)."""
    return 256 if mean_context >= 1024 and max_context <= 1.25 * mean_context else 128


def streams_launch(consts: dict, layout, block_n: int, group: int, streams: int | None = None) -> dict | None:
    """The constexprs that move a packed per-token decode onto this kernel: ``CW`` (each plane of a chunk in one
    scale group), ``R`` (streams: the largest power of two with ``group * R <= 16``, at most ``streams``, default 4)
    and the tile (``R`` streams of at least 16 tokens). None where it does not apply: keys per channel (KIVI,
    ``groups.py``), the vLLM split layout, a chunk under 16 bytes, a group over 16 heads."""
    if consts.get("QMODE") != 4 or consts.get("K_TG") != 1 or Layout.parse(layout) is Layout.VLLM or group > ROWS.value:
        return None
    dc = consts["DC"]
    cw = min(dc, consts["V_DG"], consts["K_DG"])
    if cw < 32 or dc % cw:  # a chunk's planes are cw / 2 words wide: a dot's K of 16 at least
        return None
    r = 1
    while group * r * 2 <= ROWS.value and r * 2 <= (4 if streams is None else streams):
        r *= 2
    return {"CW": cw, "R": r, "BLOCK_N": max(block_n, 16 * r)}
