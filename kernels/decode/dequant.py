"""The decode kernel's dequantization in registers: a K/V tile's stored codes -> the MMA operand's values.

Called by :func:`~workbench.kernels.decode.kernel._attend_tile` right after a tile's load, so no separate
dequantization pass ever reads the cache:

- int8 / uint8 codes (``CODES``) become the operand's dtype exactly (:func:`_int_operand`; on the GPU with fp16
  queries four codes a register by byte permutes);
- per-token scales and zero points (``QMODE`` 2, 3) are read per tile row (:func:`_row_scales`) and applied to the
  scores and probabilities by the kernel (its docstring says how);
- packed int4 / int2 codes (KIVI groups, ``QMODE`` 4) are unpacked slice by slice, one shift and one mask each,
  scaled with their group's fp16 scale and zero point and joined into the operand tile (:func:`_unpack_tile`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _int_operand(b, CODES: tl.constexpr, FAST: tl.constexpr, out_dtype: tl.constexpr):
    """int8 codes -> ``c``, uint8 codes -> ``c - 128`` (centred), exact, as ``out_dtype``. ``FAST`` (fp16, GPU): four
    codes a register, each byte permuted under 0x64 (the fp16 1024 + byte) and 1152 subtracted, 5 instructions for
    4 codes where a convert is one a code (FasterTransformer's trick; int8 flips its sign bit first). Pure: marked
    not pure (kept in place, fp16 values into the operand layout) it had 1211 -> 871 loop instructions (int8 per
    token, W1, Triton 3.6) but ran 0.96x fp16 on the H200 against 1.45x pure (W1, 2026-12-05)."""
    if FAST:
        flip: tl.constexpr = "xor.b32 t, $2, 0x80808080;" if CODES == 1 else "mov.b32 t, $2;"
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, m; " + flip + " mov.b32 m, 0x64806480; "
            "prmt.b32 $0, t, 0x64646464, 0x5150; prmt.b32 $1, t, 0x64646464, 0x5352; "
            "sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; }",
            "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    if CODES == 1:
        return b.to(out_dtype)
    return (b.to(tl.float32) - 128.0).to(out_dtype)


@triton.jit
def _fp8_operand(b, out_dtype: tl.constexpr, ASM: tl.constexpr):
    """fp8 codes -> ``out_dtype``. On the GPU with fp16 operands: ``cvt.rn.f16x2.e4m3x2`` (``e5m2x2``), two codes an
    instruction, in an asm block Triton may not move (``is_pure=False``): a pure convert lets the compiler carry the
    1-byte codes, not their fp16 values, into the MMA operand's layout, one shared-memory byte load a code (fp8 per
    tensor, W1, Triton 3.6: 918 -> 656 loop instructions, 255 -> 201 registers)."""
    if ASM and out_dtype == tl.float16 and (b.dtype == tl.float8e4nv or b.dtype == tl.float8e5):
        if b.dtype == tl.float8e4nv:
            asm: tl.constexpr = "{ .reg .b16 a, b; mov.b32 {a, b}, $2; cvt.rn.f16x2.e4m3x2 $0, a; " \
                                "cvt.rn.f16x2.e4m3x2 $1, b; }"
        else:
            asm: tl.constexpr = "{ .reg .b16 a, b; mov.b32 {a, b}, $2; cvt.rn.f16x2.e5m2x2 $0, a; " \
                                "cvt.rn.f16x2.e5m2x2 $1, b; }"
        out = tl.inline_asm_elementwise(asm, "=r,=r,r", [b.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                                        is_pure=False, pack=4)
    else:
        out = b.to(out_dtype)
    return out


@triton.jit
def _row_scales(sc_base, i_pg, o_tok, m_n, sc_blk, sc_tg, z_off, TG: tl.constexpr, HAS_ZERO: tl.constexpr,
                MASKED: tl.constexpr):
    """Per-token scales (and zero points) ``[BLOCK_N]`` fp32 of one head from the blocks' scale arrays; rows past
    the end read 0 (their scale may be anything, and ``p * scale`` must stay 0 there)."""
    o_s = i_pg * sc_blk + (o_tok // TG) * sc_tg  # [BLOCK_N]
    if MASKED:
        b_sc = tl.load(sc_base + o_s, mask=m_n, other=0.0).to(tl.float32)
    else:
        b_sc = tl.load(sc_base + o_s).to(tl.float32)
    b_z = b_sc
    if HAS_ZERO:
        if MASKED:
            b_z = tl.load(sc_base + z_off + o_s, mask=m_n, other=0.0).to(tl.float32)
        else:
            b_z = tl.load(sc_base + z_off + o_s).to(tl.float32)
    return b_sc, b_z


@triton.jit
def _slice_params(sc_base, o_srow, m_n, z_off, k: tl.constexpr, DC: tl.constexpr, TG: tl.constexpr,
                  DG: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp16 scale and zero point of every (token, channel) of slice ``k``, broadcastable to ``[BLOCK_N, DC]``: a
    vector per token when the slice is one channel group, a row per page when a key group is a whole page
    (KIVI's per-channel keys), else one read per element (from L1)."""
    o_c = k * DC + tl.arange(0, DC)  # [DC] channels of this slice
    if TG == 1 and DG % DC == 0:  # per token, the slice inside one channel group
        o_p = o_srow + (k * DC) // DG  # [BLOCK_N]
        b_s = tl.load(sc_base + o_p, mask=m_n, other=0.0)[:, None]
        b_z = tl.load(sc_base + z_off + o_p, mask=m_n, other=0.0)[:, None]
    elif TG == 1 and DC % DG == 0 and DG > 1:  # per token, a few channel groups in the slice: [BLOCK_N, groups]
        NGS: tl.constexpr = DC // DG
        o_p = o_srow[:, None] + ((k * DC) // DG + tl.arange(0, NGS))[None, :]  # [BLOCK_N, NGS]
        b_s = tl.load(sc_base + o_p, mask=m_n[:, None], other=0.0)
        b_z = tl.load(sc_base + z_off + o_p, mask=m_n[:, None], other=0.0)
        b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (BLOCK_N, NGS, DG)), (BLOCK_N, DC))
        b_z = tl.reshape(tl.broadcast_to(b_z[:, :, None], (BLOCK_N, NGS, DG)), (BLOCK_N, DC))
    elif DG == 1 and TG == PAGE and BLOCK_N % PAGE == 0:  # one key group per page: [pages, DC] rows
        NPG: tl.constexpr = BLOCK_N // PAGE
        o_prow = tl.max(tl.reshape(o_srow, (NPG, PAGE)), 1)  # [NPG] the same within a page
        o_p = o_prow[:, None] + o_c[None, :]  # [NPG, DC]
        b_s = tl.reshape(tl.broadcast_to(tl.load(sc_base + o_p)[:, None, :], (NPG, PAGE, DC)), (BLOCK_N, DC))
        b_z = tl.reshape(tl.broadcast_to(tl.load(sc_base + z_off + o_p)[:, None, :], (NPG, PAGE, DC)), (BLOCK_N, DC))
    else:
        o_p = o_srow[:, None] + (o_c // DG)[None, :]  # [BLOCK_N, DC] scale element of (token, channel)
        b_s = tl.load(sc_base + o_p, mask=m_n[:, None], other=0.0)
        b_z = tl.load(sc_base + z_off + o_p, mask=m_n[:, None], other=0.0)
    return b_s, b_z


@triton.jit
def _unpack_slice(b_c, sc_base, o_srow, m_n, z_off, k: tl.constexpr, DC: tl.constexpr, BITS: tl.constexpr,
                  TG: tl.constexpr, DG: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  out_dtype: tl.constexpr):
    """Channels ``[k * DC, (k + 1) * DC)`` of a packed tile ``b_c`` ``[BLOCK_N, DC]`` (uint8): codes ``* scale +
    zero`` with each channel group's fp16 parameters, as ``out_dtype``."""
    b_code = ((b_c >> (k * BITS)) & ((1 << BITS) - 1)).to(tl.float32)  # [BLOCK_N, DC]
    b_s, b_z = _slice_params(sc_base, o_srow, m_n, z_off, k, DC, TG, DG, PAGE, BLOCK_N)
    return (b_code * b_s.to(tl.float32) + b_z.to(tl.float32)).to(out_dtype)


@triton.jit
def _unpack_tile(b_c, sc_base, i_pg, o_tok, m_n, sc_blk, sc_tg, z_off, DC: tl.constexpr, BITS: tl.constexpr,
                 TG: tl.constexpr, DG: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 out_dtype: tl.constexpr):
    """A packed tile ``[BLOCK_N, DC]`` -> values ``[BLOCK_N, DC * 8 // BITS]`` (``workbench.quant.pack``'s order:
    slice ``k`` of the channels in bits ``[k * BITS, (k + 1) * BITS)``)."""
    o_srow = i_pg * sc_blk + (o_tok // TG) * sc_tg + tl.zeros([BLOCK_N], tl.int64)  # [BLOCK_N]
    b_0 = _unpack_slice(b_c, sc_base, o_srow, m_n, z_off, 0, DC, BITS, TG, DG, PAGE, BLOCK_N, out_dtype)
    b_1 = _unpack_slice(b_c, sc_base, o_srow, m_n, z_off, 1, DC, BITS, TG, DG, PAGE, BLOCK_N, out_dtype)
    if BITS == 4:  # one return: the compiler types every return, pruned branch or not
        b_x = tl.reshape(tl.permute(tl.join(b_0, b_1), (0, 2, 1)), (BLOCK_N, 2 * DC))
    else:
        b_2 = _unpack_slice(b_c, sc_base, o_srow, m_n, z_off, 2, DC, BITS, TG, DG, PAGE, BLOCK_N, out_dtype)
        b_3 = _unpack_slice(b_c, sc_base, o_srow, m_n, z_off, 3, DC, BITS, TG, DG, PAGE, BLOCK_N, out_dtype)
        b_j = tl.join(tl.join(b_0, b_1), tl.join(b_2, b_3))  # [BLOCK_N, DC, 2, 2]: [n, j, w, u] = slice 2u + w
        b_x = tl.reshape(tl.permute(b_j, (0, 3, 2, 1)), (BLOCK_N, 4 * DC))
    return b_x
