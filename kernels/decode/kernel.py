"""Paged decode attention kernels (Triton): one query token per sequence against its paged K/V (GQA, split-KV).

One program handles one (split, kv head, sequence) and ALL ``G = Hq // Hkv`` query heads
that share the kv head, so each K/V row is read from memory once. It walks its chunk of
the context in tiles of ``BLOCK_N`` tokens gathered through the block table (a tile may
span several pages or be part of one), keeping an online softmax in fp32 (``exp2``).

Split-KV (flash-decoding): when ``B * Hkv`` programs cannot fill the GPU, each
sequence's context is cut into chunks of ``chunk`` tokens (the same for every sequence,
so every program does about the same work; a ragged batch's short sequences simply
have fewer chunks and their extra programs exit at once). Each chunk writes its
normalized partial output and log2-sum-exp; a second small kernel combines them.

The vLLM split layout (key ``[blocks, heads, D // x, block_size, x]``, value ``[blocks, heads, D,
block_size]``): the key tile is read per d-group as runs of a page's tokens (x elements each, back to
back), so a warp reads whole runs, and permuted in registers to the ``[D, BLOCK_N]`` operand; the value
tile has tokens as its fast axis. The loop then takes whole tiles only: a mask along the value's vector
axis would break its 16-byte copies, so the partial last tile is done after the loop, masked.

Quantized caches (``QMODE``, see ``workbench.quant``): codes are read in their own dtype and turned into the
MMA operand in registers, never through a separate dequantization pass (the helpers are ``dequant.py``'s).
Per-tensor and per-head scales fold into the score scale and the output (free); per-token scales (fp8 / int8,
in the block after its codes) multiply the score columns and the probabilities (``p * scale * QMAX``, so the
fp16 operand keeps its precision; the ``QMAX`` comes off with the normalisation), zero points add ``z * sum(q)``
to the scores and ``sum(p * z)`` to the output.

A sequence of length 0 gives an output of zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dequant import _fp8_operand, _int_operand, _row_scales, _unpack_tile

LOG2E = 1.4426950408889634


@triton.jit
def _load_page(p, ASM: tl.constexpr):
    """Block-table entries at ``p`` (all in bounds). On the GPU through inline PTX: the compiler's
    software pipeliner cannot see this load, so it keeps K/V multi-buffered (a table load it can
    see turns the K/V loads into a dependent chain with a single buffer)."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [p], dtype=tl.int32, is_pure=True,
                                         pack=1)
    return tl.load(p)


@triton.jit
def _page_rows(bt_row, start, hi, s_blk_k, s_tok_k, s_blk_v, s_tok_v, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
               ASM: tl.constexpr, BY_PAGE: tl.constexpr = True):
    """Row offsets of the tile's tokens ``[start, start + BLOCK_N)`` in the K and V caches.

    Tokens past ``hi`` (the end) get a valid page of the sequence, so their rows are in bounds. The table index is
    clamped to the last page even for a whole tile past ``hi``: the pipeliner computes the addresses of tiles
    ahead (K/V multi-buffering) and, the table load being pure inline asm, runs it unpredicated for tiles past the
    loop's end; unclamped, the last row's read ran past the table (an illegal address when the table ends a page)."""
    last = tl.maximum(hi - 1, 0)  # the last token of the sequence (0 for an empty one: its row's first entry)
    if PAGE % BLOCK_N == 0:
        # the tile sits inside one page: one table lookup per tile
        i_pg = _load_page(bt_row + tl.minimum(start, last) // PAGE, ASM).to(tl.int64)
        o_tok = (start % PAGE) + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    elif BLOCK_N % PAGE == 0:
        # the tile covers BLOCK_N // PAGE whole pages (start is a multiple of PAGE)
        o_n = tl.arange(0, BLOCK_N)
        first = tl.minimum(start, last // BLOCK_N * BLOCK_N)  # scalar clamps only: per-token ones cost W3 7%
        if BY_PAGE:  # one lookup a page, spread over its tokens (one a token: 172 loop instructions of fp8's, W1)
            NPG: tl.constexpr = BLOCK_N // PAGE
            pg = _load_page(bt_row + first // PAGE + tl.minimum(tl.arange(0, NPG), (last - first) // PAGE), ASM)
            i_pg = tl.reshape(tl.broadcast_to(pg.to(tl.int64)[:, None], [NPG, PAGE]), [BLOCK_N])
        else:  # the generic kernel's packed codes: a lookup a token holds fewer registers (KIVI W1: 128 against 141)
            i_pg = _load_page(bt_row + first // PAGE + tl.minimum(o_n, last - first) // PAGE, ASM).to(tl.int64)
        o_tok = o_n % PAGE  # [BLOCK_N]
    else:
        o_n = start + tl.arange(0, BLOCK_N)
        i_pg = _load_page(bt_row + tl.minimum(o_n, last) // PAGE, ASM).to(tl.int64)
        o_tok = o_n % PAGE  # [BLOCK_N]
    o_krow = i_pg * s_blk_k + o_tok * s_tok_k  # [BLOCK_N] int64: pages can lie beyond 2**31 elements
    o_vrow = i_pg * s_blk_v + o_tok * s_tok_v  # [BLOCK_N]
    return o_krow, o_vrow, i_pg, o_tok


@triton.jit
def _attend_tile(b_q, b_m, b_l, b_acc, start, hi, bt_row, k_base, v_base, o_d, m_d, s_scale,
                 k_s_blk, k_s_tok, k_s_dgrp, v_s_blk, v_s_tok, v_s_d,
                 ks_base, vs_base, b_qsum, ks_blk, ks_tg, kz_off, vs_blk, vs_tg, vz_off,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                 KX: tl.constexpr, V_TRANS: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
                 K3D: tl.constexpr, MASKED: tl.constexpr, V_ALIGN: tl.constexpr, G_PAD: tl.constexpr,
                 ASM: tl.constexpr, QMODE: tl.constexpr, QMAX: tl.constexpr, DC: tl.constexpr, BLOCK_DC: tl.constexpr,
                 BITS: tl.constexpr, K_TG: tl.constexpr, K_DG: tl.constexpr, V_TG: tl.constexpr, V_DG: tl.constexpr,
                 CODES: tl.constexpr, FAST_INT: tl.constexpr):
    """One tile of tokens ``[start, start + BLOCK_N)``: scores, online-softmax update, ``acc += p @ v``.

    ``MASKED``: the tile may run past ``hi`` (otherwise every token is valid and nothing is masked).
    ``QMODE``: 0 plain or per-tensor / per-head scales (folded outside), 2 per-token scales, 3 per-token scales
    and zero points, 4 packed groups (module docstring); ``DC`` stored elements per row (``HEAD_DIM`` but for
    packed codes). Returns the updated ``(b_m [G_PAD], b_l [G_PAD], b_acc [G_PAD, BLOCK_D])``."""
    o_n = start + tl.arange(0, BLOCK_N)
    m_n = o_n < hi  # [BLOCK_N]
    o_krow, o_vrow, i_pg, o_tok = _page_rows(bt_row, start, hi, k_s_blk, k_s_tok, v_s_blk, v_s_tok, PAGE, BLOCK_N,
                                             ASM, QMODE != 4)
    if QMODE == 4:  # packed codes: the tile is DC bytes a row
        o_d = tl.arange(0, BLOCK_DC)
        m_d = o_d < DC
    if K3D:
        # the split key, per d-group: a page's tokens are back-to-back x-element (16-byte) chunks, so
        # the tile is [D // x, pages, run] with runs of RUN tokens * x contiguous elements: lanes walk
        # the runs and a warp reads whole ones, whatever order the compiler gives the other two dims
        NPG: tl.constexpr = BLOCK_N // PAGE if BLOCK_N > PAGE else 1  # pages per tile
        RUN: tl.constexpr = BLOCK_N // NPG  # tokens per run
        o_g3 = tl.arange(0, BLOCK_D // KX)
        o_p3 = tl.arange(0, NPG)
        o_j3 = tl.arange(0, RUN * KX)  # token j // x of the run, element j % x
        if NPG == 1:
            i_pg3 = _load_page(bt_row + tl.minimum(start, tl.maximum(hi - 1, 0)) // PAGE, ASM).to(tl.int64)
            o_run = i_pg3 * k_s_blk + (start % PAGE) * KX + tl.zeros([1], dtype=tl.int64)  # [1]
        else:
            i_pg3 = _load_page(bt_row + tl.minimum(start // PAGE + o_p3, tl.maximum(hi - 1, 0) // PAGE), ASM).to(tl.int64)
            o_run = i_pg3 * k_s_blk  # [NPG] runs start at a page
        p_k3 = k_base + (o_g3 * k_s_dgrp)[:, None, None] + o_run[None, :, None] + o_j3[None, None, :]
        m_g3 = (o_g3 < HEAD_DIM // KX)[:, None, None]
        if MASKED:
            m_k3 = (start + o_p3 * RUN)[None, :, None] + (o_j3 // KX)[None, None, :] < hi
            if BLOCK_D != HEAD_DIM:
                m_k3 = m_k3 & m_g3
            b_k3 = tl.load(p_k3, mask=m_k3, other=0.0)  # [BLOCK_D // KX, NPG, RUN * KX]
        elif BLOCK_D == HEAD_DIM:
            b_k3 = tl.load(p_k3)
        else:
            b_k3 = tl.load(p_k3, mask=m_g3, other=0.0)
        b_k3 = tl.reshape(b_k3, (BLOCK_D // KX, BLOCK_N, KX))
        b_kt = tl.reshape(tl.permute(b_k3, (0, 2, 1)), (BLOCK_D, BLOCK_N))  # [BLOCK_D, BLOCK_N] (k transposed)
    else:
        o_kd = (o_d // KX) * k_s_dgrp + o_d % KX  # [BLOCK_D] 16-byte runs of x elements
        p_k = k_base + o_krow[:, None] + o_kd[None, :]
        if MASKED:
            b_k = tl.load(p_k, mask=m_n[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        elif BLOCK_D == HEAD_DIM:
            b_k = tl.load(p_k)
        else:
            b_k = tl.load(p_k, mask=m_d[None, :], other=0.0)
    if V_TRANS:
        # tokens run contiguously inside a page: dim 0 of the tile is the fast one
        o_v = o_vrow[:, None] + (o_d * v_s_d)[None, :]  # [BLOCK_N, BLOCK_D]
        # the compiler cannot see through the table lookup: say it. Runs of BLOCK_N (or PAGE) tokens
        # start at a multiple of BLOCK_N in a page (or at a page): aligned like the block and channel strides
        if PAGE % BLOCK_N == 0:
            o_v = tl.multiple_of(tl.max_contiguous(o_v, [BLOCK_N, 1]), [V_ALIGN, 1])
        elif BLOCK_N % PAGE == 0:
            o_v = tl.multiple_of(tl.max_contiguous(o_v, [PAGE, 1]), [V_ALIGN, 1])
        # a mask along the token (vector) dim would break 16-byte loads: rows past the end are
        # in bounds (see _page_rows) but may hold anything, so zero them after the load
        if BLOCK_D == HEAD_DIM:
            b_v = tl.load(v_base + o_v)
        else:
            b_v = tl.load(v_base + o_v, mask=m_d[None, :], other=0.0)
        if MASKED:
            b_v = tl.where(m_n[:, None], b_v, tl.zeros_like(b_v))  # [BLOCK_N, BLOCK_D], in the codes' dtype
    else:
        p_v = v_base + o_vrow[:, None] + o_d[None, :]
        if MASKED:
            b_v = tl.load(p_v, mask=m_n[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        elif BLOCK_D == HEAD_DIM:
            b_v = tl.load(p_v)
        else:
            b_v = tl.load(p_v, mask=m_d[None, :], other=0.0)

    if QMODE == 4:  # unpack in registers: [BLOCK_N, DC] bytes -> [BLOCK_N, BLOCK_D] operands
        b_k = _unpack_tile(b_k, ks_base, i_pg, o_tok, m_n, ks_blk, ks_tg, kz_off, DC, BITS, K_TG, K_DG, PAGE,
                           BLOCK_N, b_q.dtype)
        b_v = _unpack_tile(b_v, vs_base, i_pg, o_tok, m_n, vs_blk, vs_tg, vz_off, DC, BITS, V_TG, V_DG, PAGE,
                           BLOCK_N, b_q.dtype)
        if MASKED:
            b_v = tl.where(m_n[:, None], b_v, 0.0)  # rows past the end: their scales are anything
    if QMODE == 2 or QMODE == 3:
        b_ksc, b_kz = _row_scales(ks_base, i_pg, o_tok, m_n, ks_blk, ks_tg, kz_off, K_TG, QMODE == 3, MASKED)
        b_vsc, b_vz = _row_scales(vs_base, i_pg, o_tok, m_n, vs_blk, vs_tg, vz_off, V_TG, QMODE == 3, MASKED)
        if QMODE == 3:  # uint8 codes are read centred (c - 128): the zero points take the 128 * scale
            b_kz = b_kz + 128.0 * b_ksc
            b_vz = b_vz + 128.0 * b_vsc
    if CODES != 0:  # int8 / uint8 codes -> the MMA operand, right after the load
        if K3D:
            b_kt = _int_operand(b_kt, CODES, FAST_INT, b_q.dtype)
        else:
            b_k = _int_operand(b_k, CODES, FAST_INT, b_q.dtype)
        b_v = _int_operand(b_v, CODES, FAST_INT, b_q.dtype)
    if K3D:
        b_kt = b_kt.to(b_q.dtype)
        if IEEE:
            b_s = tl.dot(b_q, b_kt, input_precision="ieee")  # [G_PAD, BLOCK_N]
        else:
            b_s = tl.dot(b_q, b_kt)
    elif USE_DOT:
        b_k = b_k.to(b_q.dtype)
        if IEEE:
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")  # [G_PAD, BLOCK_N]
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
    elif G_PAD == 1:  # MHA: plain 2-D products, no 3-D broadcast
        b_s = tl.sum(b_q * b_k.to(tl.float32), axis=1)[None, :]  # [1, BLOCK_N]
    else:
        b_s = tl.sum(b_q[:, None, :] * b_k.to(tl.float32)[None, :, :], axis=2)  # [G_PAD, BLOCK_N]
    if QMODE == 2 or QMODE == 3:  # k = code * scale (+ zero): q . k = (q . code) * scale (+ zero * sum(q))
        b_s = b_s * b_ksc[None, :]
        if QMODE == 3:
            b_s += b_qsum[:, None] * b_kz[None, :]
    if MASKED:
        b_s = tl.where(m_n[None, :], b_s * s_scale, float("-inf"))
    else:
        b_s = b_s * s_scale
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # finite: every tile holds a valid token
    b_alpha = tl.exp2(b_m - b_m_new)  # [G_PAD]
    b_p = tl.exp2(b_s - b_m_new[:, None])  # [G_PAD, BLOCK_N]
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None]
    b_pv = b_p
    if QMODE == 2 or QMODE == 3:  # v = code * scale (+ zero); p * scale * QMAX keeps the fp16 operand normal
        b_pv = b_p * (b_vsc * QMAX)[None, :]
        if QMODE == 3:  # codes centred on 0 (exact in fp16): (c - 128) s + (z + 128 s), half the cancellation
            b_acc += (tl.sum(b_p * b_vz[None, :], 1) * QMAX)[:, None]
    if USE_DOT:
        b_v = _fp8_operand(b_v, b_q.dtype, ASM)
        if IEEE:
            b_acc += tl.dot(b_pv, b_v, input_precision="ieee")  # [G_PAD, BLOCK_D]
        else:
            b_acc += tl.dot(b_pv.to(b_q.dtype), b_v)
    elif G_PAD == 1:
        b_acc += tl.sum(tl.trans(b_pv) * b_v.to(tl.float32), axis=0)[None, :]
    else:
        b_acc += tl.sum(b_pv[:, :, None] * b_v.to(tl.float32)[None, :, :], axis=1)
    return b_m_new, b_l, b_acc


@triton.jit
def _attend_context(
    b_q, i_b, i_hk, lo, hi, k_ptr, v_ptr, bt_ptr, k_scale_ptr, v_scale_ptr, k_scale, v_scale, qk_scale, s_bt,
    k_s_blk, k_s_tok, k_s_head, k_s_dgrp, v_s_blk, v_s_tok, v_s_head, v_s_d, s_sc_h,
    ks_blk, ks_off, ks_tg, ks_h, kz_off, vs_blk, vs_off, vs_tg, vs_h, vz_off,
    G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    KX: tl.constexpr, V_TRANS: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr, SCALE_PTR: tl.constexpr,
    K_BM: tl.constexpr, K_TM: tl.constexpr, K_HM: tl.constexpr, K_GM: tl.constexpr, V_BM: tl.constexpr,
    V_TM: tl.constexpr, V_HM: tl.constexpr, V_DM: tl.constexpr, V_ALIGN: tl.constexpr, ASM: tl.constexpr,
    K3D: tl.constexpr, QMODE: tl.constexpr, QMAX: tl.constexpr, SC_DTYPE: tl.constexpr, DC: tl.constexpr,
    BLOCK_DC: tl.constexpr, BITS: tl.constexpr, K_TG: tl.constexpr, K_DG: tl.constexpr, V_TG: tl.constexpr,
    V_DG: tl.constexpr, CODES: tl.constexpr, FAST_INT: tl.constexpr,
):
    """The query rows ``b_q`` ``[G_PAD, BLOCK_D]`` (of kv head ``i_hk``) against tokens ``[lo, hi)`` of the
    sequence whose table row is ``i_b``: ``(out, lse)``, the normalized output ``[G_PAD, BLOCK_D]`` fp32 (values'
    scale applied) and its base-2 log-sum-exp ``[G_PAD]`` (``-inf`` for no tokens). The decode kernels' common body
    (this module's and the cascade's shared pass, which gathers its query rows)."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    if SCALE_PTR:
        k_scale = tl.load(k_scale_ptr + i_hk * s_sc_h)
        v_scale = tl.load(v_scale_ptr + i_hk * s_sc_h)
    s_scale = qk_scale * k_scale
    if IEEE or not USE_DOT:
        b_q = b_q.to(tl.float32)
    # the blocks' scale arrays, read through the caches' own pointers (the scales live in the blocks)
    ks_base = k_ptr.to(tl.pointer_type(SC_DTYPE)) + (ks_off + i_hk.to(tl.int64) * ks_h)
    vs_base = v_ptr.to(tl.pointer_type(SC_DTYPE)) + (vs_off + i_hk.to(tl.int64) * vs_h)
    b_qsum = tl.sum(b_q.to(tl.float32), 1)  # [G_PAD] for zero points: q . (code * s + z) = s (q . code) + z sum(q)
    if QMODE == 2 or QMODE == 3:
        v_scale = v_scale / QMAX  # the probabilities carried scale * QMAX

    k_base = k_ptr + i_hk.to(tl.int64) * (k_s_head * K_HM)
    v_base = v_ptr + i_hk.to(tl.int64) * (v_s_head * V_HM)
    bt_row = bt_ptr + i_b.to(tl.int64) * s_bt

    b_m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([G_PAD], dtype=tl.float32)
    b_acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
    # PEEL: the loop takes whole tiles only, the partial last tile follows it, masked. V_TRANS needs it (no token
    # mask, so the V copies feed the dot straight from shared memory); 1-byte codes gain by it (Triton 3.6, W1 loop
    # instructions: fp8 per tensor 1134 -> 918, int8 per token 1423 -> 1211, registers at their 255 either way),
    # while fp16 and packed codes keep one masked loop: peeled, fp16 went from 80 to 122 registers, packed int4
    # from 107 to 194 (fewer programs an SM)
    PEEL: tl.constexpr = V_TRANS or (k_ptr.dtype.element_ty.primitive_bitwidth == 8 and QMODE != 4)
    i_end = hi // BLOCK_N if PEEL else tl.cdiv(hi, BLOCK_N)
    for i_t in range(lo // BLOCK_N, i_end):
        b_m, b_l, b_acc = _attend_tile(
            b_q, b_m, b_l, b_acc, i_t * BLOCK_N, hi, bt_row, k_base, v_base, o_d, m_d, s_scale,
            k_s_blk * K_BM, k_s_tok * K_TM, k_s_dgrp * K_GM, v_s_blk * V_BM, v_s_tok * V_TM, v_s_d * V_DM,
            ks_base, vs_base, b_qsum, ks_blk, ks_tg, kz_off, vs_blk, vs_tg, vz_off,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, KX, V_TRANS, USE_DOT, IEEE, K3D, not PEEL, V_ALIGN, G_PAD, ASM,
            QMODE, QMAX, DC, BLOCK_DC, BITS, K_TG, K_DG, V_TG, V_DG, CODES, FAST_INT)
    if PEEL and hi % BLOCK_N != 0:
        b_m, b_l, b_acc = _attend_tile(
            b_q, b_m, b_l, b_acc, i_end * BLOCK_N, hi, bt_row, k_base, v_base, o_d, m_d, s_scale,
            k_s_blk * K_BM, k_s_tok * K_TM, k_s_dgrp * K_GM, v_s_blk * V_BM, v_s_tok * V_TM, v_s_d * V_DM,
            ks_base, vs_base, b_qsum, ks_blk, ks_tg, kz_off, vs_blk, vs_tg, vz_off,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, KX, V_TRANS, USE_DOT, IEEE, K3D, True, V_ALIGN, G_PAD, ASM,
            QMODE, QMAX, DC, BLOCK_DC, BITS, K_TG, K_DG, V_TG, V_DG, CODES, FAST_INT)

    b_l_safe = tl.where(b_l > 0, b_l, 1.0)  # an empty sequence keeps acc == 0
    b_o = b_acc * (v_scale / b_l_safe)[:, None]  # [G_PAD, BLOCK_D]
    return b_o, b_m + tl.log2(b_l_safe)


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D] query, unit stride in D
    k_ptr,  # K cache, any layout, addressed as blk*s_blk + tok*s_tok + head*s_head + (d // KX)*s_dgrp + d % KX
    v_ptr,  # V cache: blk*s_blk + tok*s_tok + head*s_head + d (V_TRANS: + d*s_d, with s_tok == 1)
    bt_ptr,  # [B, max_blocks] int32 block table
    lens_ptr,  # [B] int32 context lengths
    out_ptr,  # [B, Hq, D] output (used when not SPLIT)
    o_part_ptr,  # [B, Hq, S, D] fp32 normalized partial outputs (SPLIT)
    lse_ptr,  # [B, Hq, S] fp32 log2-sum-exp of each partial (SPLIT)
    k_scale_ptr, v_scale_ptr,  # fp32 scalars (SCALE_PTR) ...
    k_scale, v_scale,  # ... or plain floats: read K = stored * k_scale
    qk_scale,  # sm_scale * log2(e)
    s_qb, s_qh,  # q strides
    s_ob, s_oh,  # out strides
    s_bt,  # block-table row stride
    k_s_blk, k_s_tok, k_s_head, k_s_dgrp,  # each in units of its K_*M elements (see _stride_split)
    v_s_blk, v_s_tok, v_s_head, v_s_d,  # each in units of its V_*M elements
    chunk,  # tokens per split, a multiple of BLOCK_N
    num_splits,
    s_sc_h,  # head stride of k_scale_ptr / v_scale_ptr: 0 per tensor, 1 per head (SCALE_PTR)
    ks_blk, ks_off, ks_tg, ks_h, kz_off,  # K's scale arrays in blocks (QMODE >= 2), in scale elements: block
    vs_blk, vs_off, vs_tg, vs_h, vz_off,  # stride, offset in a block, token-group and head strides, zero offset
    G: tl.constexpr,  # query heads per kv head
    G_PAD: tl.constexpr,  # G rounded up (>= 16 for tl.dot)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_N: tl.constexpr,  # tokens per tile
    PAGE: tl.constexpr,  # tokens per cache block
    KX: tl.constexpr,  # key split x (BLOCK_D when K is not split)
    V_TRANS: tl.constexpr,  # V stored [D, tokens] per block (vLLM value layout): tokens are the fast dim
    USE_DOT: tl.constexpr,  # tensor cores (tl.dot) or broadcast-multiply + sum
    IEEE: tl.constexpr,  # dot in fp32 without TF32 (fp32 q; bf16 in the interpreter, whose bf16 dot is wrong)
    SPLIT: tl.constexpr,  # write partials for the reduce kernel
    SCALE_PTR: tl.constexpr,
    K_BM: tl.constexpr,  # k_s_blk was divided by this power of two (keeps 16-byte alignment visible)
    K_TM: tl.constexpr,  # ... k_s_tok by this one (the split key's token stride is x = 8: not "divisible by 16")
    K_HM: tl.constexpr,
    K_GM: tl.constexpr,
    V_BM: tl.constexpr,
    V_TM: tl.constexpr,
    V_HM: tl.constexpr,
    V_DM: tl.constexpr,  # v_s_d (the vLLM value's channel stride = block_size, 8 for 8-token pages)
    V_ALIGN: tl.constexpr,  # min(V_BM, V_DM): alignment of a page's V run (V_TRANS)
    ASM: tl.constexpr,  # block-table loads through inline PTX (GPU only)
    K3D: tl.constexpr,  # split key read as [D // x, pages, run * x] tiles (lanes along tokens), then permuted
    QMODE: tl.constexpr = 0,  # 0 plain / static scales, 2 per-token, 3 per-token asymmetric, 4 packed groups
    QMAX: tl.constexpr = 1.0,  # the code range's max (per-token schemes: p * scale * QMAX)
    SC_DTYPE: tl.constexpr = tl.float32,  # the scale arrays' dtype (fp16 for packed groups)
    DC: tl.constexpr = 0,  # stored elements per row (packed: HEAD_DIM * BITS // 8)
    BLOCK_DC: tl.constexpr = 16,
    BITS: tl.constexpr = 8,
    K_TG: tl.constexpr = 1, K_DG: tl.constexpr = 1,  # tokens / channels per scale group, K and V
    V_TG: tl.constexpr = 1, V_DG: tl.constexpr = 1,
    CODES: tl.constexpr = 0,  # 1 int8 codes, 2 uint8 codes (read centred), 0 float / packed
    FAST_INT: tl.constexpr = False,  # int codes to fp16 four a register by byte permutes (GPU, fp16 queries)
    BATCH_FAST: tl.constexpr = False,  # grid (B, Hkv, splits): a cascade's tiles of one chunk run side by side (L2)
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
    if SPLIT:
        if lo >= seq_len:
            return  # a ragged batch's short sequence has fewer chunks; the reduce skips them
    # the last split takes the rest, so a too-small chunk is slow, never wrong
    hi = tl.where(i_s == num_splits - 1, seq_len, tl.minimum(lo + chunk, seq_len))

    o_g = tl.arange(0, G_PAD)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < G
    m_d = o_d < HEAD_DIM
    i_hq = i_hk * G + o_g  # [G_PAD] query heads of this kv head
    p_q = q_ptr + i_b.to(tl.int64) * s_qb + i_hq[:, None] * s_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)  # [G_PAD, BLOCK_D]
    b_o, b_lse = _attend_context(
        b_q, i_b, i_hk, lo, hi, k_ptr, v_ptr, bt_ptr, k_scale_ptr, v_scale_ptr, k_scale, v_scale, qk_scale, s_bt,
        k_s_blk, k_s_tok, k_s_head, k_s_dgrp, v_s_blk, v_s_tok, v_s_head, v_s_d, s_sc_h,
        ks_blk, ks_off, ks_tg, ks_h, kz_off, vs_blk, vs_off, vs_tg, vs_h, vz_off,
        G_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, KX, V_TRANS, USE_DOT, IEEE, SCALE_PTR, K_BM, K_TM, K_HM, K_GM,
        V_BM, V_TM, V_HM, V_DM, V_ALIGN, ASM, K3D, QMODE, QMAX, SC_DTYPE, DC, BLOCK_DC, BITS, K_TG, K_DG, V_TG, V_DG,
        CODES, FAST_INT)
    m_o = m_g[:, None] & m_d[None, :]
    if SPLIT:
        row = (i_b.to(tl.int64) * (G * tl.num_programs(1)) + i_hq) * num_splits + i_s  # [G_PAD]
        tl.store(o_part_ptr + row[:, None] * HEAD_DIM + o_d[None, :], b_o, mask=m_o)
        tl.store(lse_ptr + row, b_lse, mask=m_g)
    else:
        p_o = out_ptr + i_b.to(tl.int64) * s_ob + i_hq[:, None] * s_oh + o_d[None, :]
        tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_o)


@triton.jit
def _decode_reduce_kernel(
    o_part_ptr,  # [B, Hq, S, D] fp32 normalized partials
    lse_ptr,  # [B, Hq, S] fp32 log2-sum-exp
    lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D]
    s_ob, s_oh,
    chunk,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits rounded up to a power of two
):
    i_h = tl.program_id(0)
    i_b = tl.program_id(1)
    seq_len = tl.load(lens_ptr + i_b)
    n_valid = tl.minimum(tl.cdiv(seq_len, chunk), num_splits)  # splits that wrote something
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_s = o_s < n_valid
    m_d = o_d < HEAD_DIM
    row = (i_b.to(tl.int64) * tl.num_programs(0) + i_h) * num_splits + o_s  # [BLOCK_S]
    b_lse = tl.load(lse_ptr + row, mask=m_s, other=float("-inf"))
    b_max = tl.max(b_lse, 0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)  # an empty sequence: no valid split
    b_w = tl.where(m_s, tl.exp2(b_lse - b_max), 0.0)  # [BLOCK_S]
    b_o = tl.load(o_part_ptr + row[:, None] * HEAD_DIM + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
    b_wsum = tl.sum(b_w, 0)
    b_out = tl.sum(b_w[:, None] * b_o, 0) / tl.where(b_wsum > 0, b_wsum, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + i_b.to(tl.int64) * s_ob + i_h * s_oh + o_d, b_out.to(out_ptr.dtype.element_ty), mask=m_d)
