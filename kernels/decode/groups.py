"""Paged decode of packed group codes (KIVI int4 / int2): a kernel shaped for its data, not a flag of the generic one.

The bytes of a token-head row hold ``PER = 8 // BITS`` codes each: byte ``j`` holds channel ``j + k * DC`` in bits
``[k * BITS, (k + 1) * BITS)`` (``workbench.quant.pack``, ``DC = D * BITS / 8`` bytes a row). So every bit field
``k`` of a run of bytes is a contiguous run of channels: a *plane*. The kernel never puts the channels back in order
(the generic kernel's ``tl.join`` / ``tl.permute`` shuffle of every tile): it loads the row in chunks of ``CW``
bytes, turns each bit field of a chunk into an fp16 operand elementwise, and does one dot per plane against the
matching ``CW`` channels of q, loaded once per program in that order. The output is kept per plane and stored to
the planes' channels at the end.

Dequantization is a bit trick, not a convert: ``(byte & (MASK << BITS k)) | 0x6400`` read as fp16 is ``1024 + c
2**(BITS k)`` exactly, minus 1024 is the code times a power of two (FasterTransformer / QServe). On the GPU one inline
PTX block does it four bytes at a time (``prmt`` spreads two bytes under the 0x64 exponent byte, ``and`` keeps a
field, ``sub.f16x2`` takes the 1024 off two codes at once); the interpreter runs the same arithmetic in Triton
(``ASM=False``), the tested reference.

Scales stay out of the inner loop where the math allows (``CW`` is chosen so that each plane lies in one scale
group):

- keys per token (``K_TG == 1``): ``q . k_t = sum_planes s_tg (q_p . c_p) + z_tg sum(q_p)``: one multiply per score
  column and plane, the power of two of the field folded into ``q_p`` once per program;
- keys per channel (KIVI, ``K_TG`` tokens a group, a tile inside one group): ``q'_p = q_p * s_g`` once per tile and
  ``q . z_g`` once per tile: the codes go into the dot as they are;
- values per token: ``acc_p += (p * s_tg QMAX) @ c_p`` (the fp16 operand kept normal, as the per-token path does) and
  ``sum(p z_tg)``; the field's power of two and ``QMAX`` come off with the normalisation.

Rows past a sequence's end read a valid page (``_page_rows``), their scales are loaded as 0 and their scores are
masked: no NaN of an unwritten slot reaches the output. Layouts ``nhd`` and ``hnd`` (rows of contiguous bytes); the
vLLM split layout stays on the generic kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from workbench.core.layout import Layout

from .kernel import _page_rows


@triton.jit
def _planes(b, BITS: tl.constexpr, ASM: tl.constexpr):
    """The bit fields of a uint8 tile as fp16 tiles of the same shape: field ``k`` holds ``(code - HALF) 2**(BITS k)``
    (exact; ``HALF = 2**(BITS - 1)``: codes read centred, so the zero point's term cancels half as much). A tuple of
    ``8 // BITS`` tiles."""
    if ASM:  # one return at the end: Triton 3.6 types every return of a function, pruned branch or not
        if BITS == 4:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t, u, m, n; mov.b32 m, 0x64086408; mov.b32 n, 0x64806480; "
                "prmt.b32 t, $4, 0x64646464, 0x5140; prmt.b32 u, $4, 0x64646464, 0x5342; "
                "and.b32 $0, t, 0xFF0FFF0F; and.b32 $1, u, 0xFF0FFF0F; "
                "and.b32 $2, t, 0xFFF0FFF0; and.b32 $3, u, 0xFFF0FFF0; "
                "sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; sub.f16x2 $2, $2, n; sub.f16x2 $3, $3, n; }",
                "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t, u, m0, m1, m2, m3; mov.b32 m0, 0x64026402; mov.b32 m1, 0x64086408; "
                "mov.b32 m2, 0x64206420; mov.b32 m3, 0x64806480; "
                "prmt.b32 t, $8, 0x64646464, 0x5140; prmt.b32 u, $8, 0x64646464, 0x5342; "
                "and.b32 $0, t, 0xFF03FF03; and.b32 $1, u, 0xFF03FF03; and.b32 $2, t, 0xFF0CFF0C; "
                "and.b32 $3, u, 0xFF0CFF0C; and.b32 $4, t, 0xFF30FF30; and.b32 $5, u, 0xFF30FF30; "
                "and.b32 $6, t, 0xFFC0FFC0; and.b32 $7, u, 0xFFC0FFC0; "
                "sub.f16x2 $0, $0, m0; sub.f16x2 $1, $1, m0; sub.f16x2 $2, $2, m1; sub.f16x2 $3, $3, m1; "
                "sub.f16x2 $4, $4, m2; sub.f16x2 $5, $5, m2; sub.f16x2 $6, $6, m3; sub.f16x2 $7, $7, m3; }",
                "=r,=r,=r,=r,=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=4)
    else:
        w = b.to(tl.int16)
        out = ()
        for k in tl.static_range(8 // BITS):
            f = ((w & (((1 << BITS) - 1) << (k * BITS))) | 0x6400).to(tl.float16, bitcast=True)
            out = out + (f - (1024.0 + (1 << (BITS - 1 + k * BITS))),)
    return out


@triton.jit
def _row_scale(sc_base, o_s, m_n, MASKED: tl.constexpr):
    """Per-token scale elements ``[BLOCK_N]`` as fp32; rows past the end read 0."""
    if MASKED:
        return tl.load(sc_base + o_s, mask=m_n, other=0.0).to(tl.float32)
    return tl.load(sc_base + o_s).to(tl.float32)


@triton.jit
def _groups_tile(b_qp, b_qsum, b_m, b_l, b_acc, start, hi, bt_row, k_base, v_base, s_scale,
                 k_s_blk, k_s_tok, v_s_blk, v_s_tok, ks_base, vs_base, ks_blk, ks_tg, kz_off, vs_blk, vs_tg, vz_off,
                 BLOCK_N: tl.constexpr, PAGE: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr,
                 DC: tl.constexpr, CW: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr,
                 K_TG: tl.constexpr, K_DG: tl.constexpr, V_DG: tl.constexpr, OP: tl.constexpr, IEEE: tl.constexpr,
                 G_PAD: tl.constexpr):
    """One tile of tokens ``[start, start + BLOCK_N)``: scores from every plane, the online-softmax update and every
    plane's ``acc_p += p @ v_p``. ``b_qp``: q's planes ``[G_PAD, CW]`` (fields' powers of two folded in);
    ``b_qsum``: their plain sums ``[G_PAD]`` fp32; ``b_acc``: a tuple of ``[G_PAD, CW]`` fp32 accumulators."""
    PER: tl.constexpr = 8 // BITS
    HALF: tl.constexpr = 1 << (BITS - 1)  # the planes hold codes centred on it
    # one scale a token-head (a group the whole head): the planes' dots add up before the scale, and the values'
    # operand and zero-point sum are made once for every plane
    K_ONE: tl.constexpr = K_DG >= DC * PER if K_TG == 1 else False
    V_ONE: tl.constexpr = V_DG >= DC * PER
    o_n = start + tl.arange(0, BLOCK_N)
    m_n = o_n < hi
    o_krow, o_vrow, i_pg, o_tok = _page_rows(bt_row, start, hi, k_s_blk, k_s_tok, v_s_blk, v_s_tok, PAGE, BLOCK_N,
                                             ASM)
    o_w = tl.arange(0, CW)
    o_ks = i_pg * ks_blk + (o_tok // K_TG) * ks_tg  # [BLOCK_N] (or a scalar: a tile inside one page)
    o_vs = i_pg * vs_blk + o_tok * vs_tg
    b_s = tl.zeros([G_PAD, BLOCK_N], dtype=tl.float32)
    b_bias = tl.zeros([G_PAD], dtype=tl.float32)  # keys per channel: q . z of the tile's group
    for c in tl.static_range(DC // CW):
        p_k = k_base + o_krow[:, None] + (c * CW + o_w)[None, :]
        if MASKED:
            b_kc = tl.load(p_k, mask=m_n[:, None], other=0)  # [BLOCK_N, CW] bytes
        else:
            b_kc = tl.load(p_k)
        planes = _planes(b_kc, BITS, ASM)
        for k in tl.static_range(PER):
            ch0 = k * DC + c * CW  # the plane's first channel
            b_q = b_qp[c * PER + k]
            if K_ONE:
                b_s = tl.dot(b_q, tl.trans(planes[k].to(OP)), b_s, input_precision="ieee" if IEEE else None)
            elif K_TG == 1:  # per-token groups: the plane lies in group ch0 // K_DG
                b_d = tl.dot(b_q, tl.trans(planes[k].to(OP)), input_precision="ieee" if IEEE else None)
                b_sc = _row_scale(ks_base, o_ks + ch0 // K_DG, m_n, MASKED)
                b_z = _row_scale(ks_base + kz_off, o_ks + ch0 // K_DG, m_n, MASKED) + HALF * b_sc
                b_s += b_d * b_sc[None, :] + b_qsum[c * PER + k][:, None] * b_z[None, :]
            else:  # per channel: the tile is inside one key group; fold its scales into q
                o_sc = tl.max(o_ks, 0) + ch0 + o_w  # [CW]: every token of the tile is in one group
                b_sc = tl.load(ks_base + o_sc).to(tl.float32)
                b_z = tl.load(ks_base + kz_off + o_sc).to(tl.float32) + HALF * b_sc
                b_qf = b_q.to(tl.float32) * (1 << (k * BITS))  # the plain q (exact: a power of two)
                b_bias += tl.sum(b_qf * b_z[None, :], 1)
                b_qs = (b_q.to(tl.float32) * b_sc[None, :]).to(OP)
                b_s += tl.dot(b_qs, tl.trans(planes[k].to(OP)), input_precision="ieee" if IEEE else None)
    if K_ONE:  # s (q . c) + (z + HALF s) sum(q), every plane's dot in b_s
        b_sc = _row_scale(ks_base, o_ks, m_n, MASKED)
        b_z = _row_scale(ks_base + kz_off, o_ks, m_n, MASKED) + HALF * b_sc
        b_qt = b_qsum[0]
        for i in tl.static_range(1, PER * (DC // CW)):
            b_qt += b_qsum[i]
        b_s = b_s * b_sc[None, :] + b_qt[:, None] * b_z[None, :]
    b_s += b_bias[:, None]
    if MASKED:
        b_s = tl.where(m_n[None, :], b_s * s_scale, float("-inf"))
    else:
        b_s = b_s * s_scale
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # finite: every tile holds a valid token
    b_alpha = tl.exp2(b_m - b_m_new)
    b_p = tl.exp2(b_s - b_m_new[:, None])  # [G_PAD, BLOCK_N]; 0 past the end
    b_l = b_l * b_alpha[:, None] + b_p  # per column: added up after the loop (no row sum a tile)
    if V_ONE:
        b_sc = _row_scale(vs_base, o_vs, m_n, MASKED)
        b_z = _row_scale(vs_base + vz_off, o_vs, m_n, MASKED) + HALF * b_sc
        b_pv_one = (b_p * (b_sc * QMAX)[None, :]).to(OP)
        b_pz_one = tl.sum(b_p * b_z[None, :], 1)
    out = ()
    for c in tl.static_range(DC // CW):
        p_v = v_base + o_vrow[:, None] + (c * CW + o_w)[None, :]
        if MASKED:
            b_vc = tl.load(p_v, mask=m_n[:, None], other=0)
        else:
            b_vc = tl.load(p_v)
        planes = _planes(b_vc, BITS, ASM)
        for k in tl.static_range(PER):
            ch0 = k * DC + c * CW
            if V_ONE:
                b_pv = b_pv_one
                b_pz = b_pz_one
            else:
                b_sc = _row_scale(vs_base, o_vs + ch0 // V_DG, m_n, MASKED)
                b_z = _row_scale(vs_base + vz_off, o_vs + ch0 // V_DG, m_n, MASKED) + HALF * b_sc
                b_pv = (b_p * (b_sc * QMAX)[None, :]).to(OP)
                b_pz = tl.sum(b_p * b_z[None, :], 1)
            b_a = b_acc[c * PER + k] * b_alpha[:, None]
            b_a += tl.dot(b_pv, planes[k].to(OP), input_precision="ieee" if IEEE else None)
            # the zero point's share, in the accumulator's units (x QMAX x the field's power of two)
            b_a += (b_pz * (QMAX * (1 << (k * BITS))))[:, None]
            out = out + (b_a,)
    return b_m_new, b_l, out


@triton.jit
def _groups_decode_kernel(
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
    CW: tl.constexpr = 16,  # bytes a chunk: each of its planes lies in one scale group (planes_launch)
):
    """``_paged_decode_kernel``'s arguments (the plan launches either); see the module docstring. ``KX``, ``K3D``,
    ``V_TRANS``, ``USE_DOT``, ``CODES``, ``FAST_INT`` are the generic kernel's and must be the plain rows' values."""
    PER: tl.constexpr = 8 // BITS  # planes a chunk (HEAD_DIM // CW in all)
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

    OP: tl.constexpr = tl.float32 if IEEE else q_ptr.dtype.element_ty  # the dots' operand type
    o_g = tl.arange(0, G_PAD)
    o_w = tl.arange(0, CW)
    m_g = o_g < G
    i_hq = i_hk * G + o_g
    p_q = q_ptr + i_b.to(tl.int64) * s_qb + i_hq[:, None] * s_qh
    b_qp = ()
    b_qsum = ()
    b_acc = ()
    for c in tl.static_range(DC // CW):
        for k in tl.static_range(PER):
            b_q = tl.load(p_q + (k * DC + c * CW + o_w)[None, :], mask=m_g[:, None], other=0.0).to(tl.float32)
            b_qsum = b_qsum + (tl.sum(b_q, 1),)
            b_qp = b_qp + ((b_q * (1.0 / (1 << (k * BITS)))).to(OP),)  # exact: a power of two
            b_acc = b_acc + (tl.zeros([G_PAD, CW], dtype=tl.float32),)
    ks_base = k_ptr.to(tl.pointer_type(SC_DTYPE)) + (ks_off + i_hk.to(tl.int64) * ks_h)
    vs_base = v_ptr.to(tl.pointer_type(SC_DTYPE)) + (vs_off + i_hk.to(tl.int64) * vs_h)
    k_base = k_ptr + i_hk.to(tl.int64) * (k_s_head * K_HM)
    v_base = v_ptr + i_hk.to(tl.int64) * (v_s_head * V_HM)
    bt_row = bt_ptr + i_b.to(tl.int64) * s_bt
    s_scale = qk_scale * k_scale

    b_m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([G_PAD, BLOCK_N], dtype=tl.float32)
    i_end = hi // BLOCK_N  # whole tiles in the loop, the partial last one after it (masked)
    for i_t in range(lo // BLOCK_N, i_end):
        b_m, b_l, b_acc = _groups_tile(
            b_qp, b_qsum, b_m, b_l, b_acc, i_t * BLOCK_N, hi, bt_row, k_base, v_base, s_scale,
            k_s_blk * K_BM, k_s_tok * K_TM, v_s_blk * V_BM, v_s_tok * V_TM, ks_base, vs_base, ks_blk, ks_tg, kz_off,
            vs_blk, vs_tg, vz_off, BLOCK_N, PAGE, ASM, False, DC, CW, BITS, QMAX, K_TG, K_DG, V_DG, OP, IEEE, G_PAD)
    if hi % BLOCK_N != 0:
        b_m, b_l, b_acc = _groups_tile(
            b_qp, b_qsum, b_m, b_l, b_acc, i_end * BLOCK_N, hi, bt_row, k_base, v_base, s_scale,
            k_s_blk * K_BM, k_s_tok * K_TM, v_s_blk * V_BM, v_s_tok * V_TM, ks_base, vs_base, ks_blk, ks_tg, kz_off,
            vs_blk, vs_tg, vz_off, BLOCK_N, PAGE, ASM, True, DC, CW, BITS, QMAX, K_TG, K_DG, V_DG, OP, IEEE, G_PAD)

    b_l = tl.sum(b_l, 1)
    b_l_safe = tl.where(b_l > 0, b_l, 1.0)  # an empty sequence keeps acc == 0
    m_o = m_g[:, None]
    for c in tl.static_range(DC // CW):
        for k in tl.static_range(PER):
            ch = k * DC + c * CW + o_w  # the plane's channels
            # the accumulator carried QMAX and the field's power of two: both come off here
            b_o = b_acc[c * PER + k] * ((v_scale / (QMAX * (1 << (k * BITS)))) / b_l_safe)[:, None]
            if SPLIT:
                row = (i_b.to(tl.int64) * (G * tl.num_programs(1)) + i_hq) * num_splits + i_s
                tl.store(o_part_ptr + row[:, None] * HEAD_DIM + ch[None, :], b_o, mask=m_o)
            else:
                p_o = out_ptr + i_b.to(tl.int64) * s_ob + i_hq[:, None] * s_oh + ch[None, :]
                tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_o)
    if SPLIT:
        row = (i_b.to(tl.int64) * (G * tl.num_programs(1)) + i_hq) * num_splits + i_s
        tl.store(lse_ptr + row, b_m + tl.log2(b_l_safe), mask=m_g)


def planes_launch(consts: dict, layout, block_n: int) -> dict | None:
    """The constexprs that move a packed-groups decode (``consts``: the scheme's, ``QMODE == 4``) onto this kernel:
    ``CW`` (bytes of a row loaded at once, so that each plane of a chunk lies in one scale group of K and of V) and
    the tile (keys per channel: a tile inside one key group). None where it does not apply (the generic kernel
    then): the vLLM split layout, a chunk or a key group under 16 (a dot's smallest size)."""
    if consts.get("QMODE") != 4 or Layout.parse(layout) is Layout.VLLM:
        return None
    dc = consts["DC"]
    cw = min(dc, consts["V_DG"], consts["K_DG"] if consts["K_TG"] == 1 else dc)
    if cw < 16 or dc % cw:
        return None
    if consts["K_TG"] > 1:
        if consts["K_TG"] < 16:
            return None
        block_n = min(block_n, consts["K_TG"])
    return {"CW": cw, "BLOCK_N": block_n}
