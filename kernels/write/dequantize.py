"""Blocks back to values: every slot of ``nb`` blocks of one kind (K or V) in any layout and scheme, dequantized to
``[nb, block_size, heads, head_dim]`` in one launch (the inverse of the write kernels; a tier's transcode reads
a batch of blocks with it, ``workbench.tiers.formats``).

The value of code ``c`` of token ``t``, head ``h``, channel ``d`` is the reference's
(``kernels/write/reference.py: dequantize_cache_ref``) bit for bit:

- cast (fp16 / bf16 / fp32): the code itself;
- static scales (fp8 / int8 per tensor, head, layer): ``float(c) * s[layer, h]``, one rounding;
- scales in the block (``token`` and ``groups`` families, ``workbench.quant.blocks``): ``float(c) * scale`` then
  ``+ zero``, two roundings: the launch turns off Triton's fusion of a multiply and an add into an FMA (one
  rounding), which would differ from torch's two operations in the last bit.

Packed codes (int4 / int2: ``8 / bits`` channels a byte, channel ``k * DC + j`` in bits ``[k bits, (k + 1) bits)`` of
byte ``j``, ``workbench.quant.families.groups.pack``) are unpacked per bit field: each field is a plane of channels
stored with one strided store. Scales and zero points are gathered per element through the scale view's strides
(``[blocks, token groups, heads, channel groups]``): small, and read from L1.

``ZERO_NONFINITE``: NaN and Inf values (an unwritten slot's poison, a NaN scale) are stored as 0 and counted into
``bad_ptr``: what a tier stores of a block's unwritten slots (its scales must not be spread by them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.core.layout import Layout, addressing
from workbench.quant import blocks as qblocks

from .qmath import _columns


@triton.jit
def _dequantize_blocks_kernel(
    cache_ptr,  # [nb, ...] codes of one kind, any layout (the scheme's storage dtype)
    sc_ptr,  # the scale view's first element (HAS_SCALE), else any pointer
    z_ptr,  # the zero point view's first element (HAS_ZERO), else any pointer
    st_ptr,  # [static_layers * static_heads] fp32 static scales (STATIC), else any pointer
    out_ptr,  # [nb, bs, H, HEAD_DIM] values, unit stride in HEAD_DIM
    bad_ptr,  # [1] int32: non-finite values seen (ZERO_NONFINITE)
    bs, num_slots,  # tokens a block, blocks * bs
    s_blk, s_tok, s_head, s_dgrp,  # code (blk, tok, h, c): blk*s_blk + tok*s_tok + h*s_head + (c // X)*s_dgrp + ...
    sc_blk, sc_tg, sc_h, sc_cg,  # scale (and zero point) view strides: [blocks, token groups, heads, channel groups]
    static_layers, static_heads,  # the static table's rows (block b is layer b % static_layers) and heads (1 or H)
    so_blk, so_tok, so_head,  # out (blk, tok, h): the values of a dense buffer, or a device block view in place
    S_D: tl.constexpr, X: tl.constexpr,  # ... + (c % X)*S_D
    HEAD_DIM: tl.constexpr,
    DC: tl.constexpr,  # stored elements a row (HEAD_DIM, or HEAD_DIM * BITS / 8 packed bytes)
    BLOCK_DC: tl.constexpr,
    BITS: tl.constexpr,  # packed code bits (4, 2), or 0: one code an element
    E4M3: tl.constexpr,  # fp8 e4m3fn codes
    TG: tl.constexpr, CG: tl.constexpr,  # tokens and channels a scale covers
    HAS_SCALE: tl.constexpr, HAS_ZERO: tl.constexpr, STATIC: tl.constexpr,
    ZERO_NONFINITE: tl.constexpr,
    BLOCK_U: tl.constexpr,
):
    i_u = tl.program_id(0)
    i_h = tl.program_id(1)
    o_u = i_u * BLOCK_U + tl.arange(0, BLOCK_U)  # [BLOCK_U] slots (block * bs + token): small blocks, many a program
    o_b = (o_u // bs).to(tl.int64)
    o_t = o_u % bs
    o_j = tl.arange(0, BLOCK_DC)  # [BLOCK_DC] stored element of the row
    m = (o_u < num_slots)[:, None] & (o_j < DC)[None, :]
    p_c = cache_ptr + (o_b * s_blk + o_t.to(tl.int64) * s_tok + i_h * s_head)[:, None] \
        + _columns(o_j, s_dgrp, S_D, X, DC)[None, :]
    b_raw = tl.load(p_c, mask=m)  # masked lanes are never stored (no `other`: fp8 takes no constant)
    if STATIC:
        b_st = tl.load(st_ptr + ((o_b % static_layers) * static_heads + i_h % static_heads)[:, None], mask=m)
    p_out = out_ptr + (o_b * so_blk + o_t.to(tl.int64) * so_tok + i_h * so_head)[:, None]
    for k in tl.static_range(8 // BITS if BITS else 1):
        if BITS:
            b_x = ((b_raw.to(tl.int32) >> (k * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        else:
            b_x = b_raw.to(tl.float32)
            if E4M3:  # e4m3fn's NaN (S.1111.111): the interpreter's converter reads it as 480
                b_x = tl.where((b_raw.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), b_x)
        o_c = k * DC + o_j  # [BLOCK_DC] the channel of each element of this plane
        if HAS_SCALE:
            o_s = (o_b * sc_blk + (o_t // TG).to(tl.int64) * sc_tg + i_h * sc_h)[:, None] + (o_c // CG)[None, :] * sc_cg
            b_x = b_x * tl.load(sc_ptr + o_s, mask=m, other=1.0).to(tl.float32)
            if HAS_ZERO:
                b_x = b_x + tl.load(z_ptr + o_s, mask=m, other=0.0).to(tl.float32)
        elif STATIC:
            b_x = b_x * b_st
        if ZERO_NONFINITE:
            m_bad = m & ((b_x != b_x) | (tl.abs(b_x) == float("inf")))
            n_bad = tl.sum(tl.sum(m_bad.to(tl.int32), 1), 0)
            if n_bad > 0:
                tl.atomic_add(bad_ptr, n_bad)
            b_x = tl.where(m_bad, 0.0, b_x)
        tl.store(p_out + o_c[None, :], b_x.to(out_ptr.dtype.element_ty), mask=m)


def dequantize_blocks(scheme, cache: torch.Tensor, layout: Layout | str, kind: str, head_dim: int, *,
                      static_scale: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                      nonfinite: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Values of every slot of ``cache`` (``nb`` blocks of one kind in ``layout``, e.g. a ``block_view``; packed or
    not) as ``[nb, block_size, heads, head_dim]`` in ``out_dtype`` (fp32; a cast scheme's own dtype holds its values
    exactly): :func:`~workbench.kernels.write.reference.dequantize_cache_ref` times ``static_scale`` in one launch.

    ``static_scale``: ``[layers or 1, heads or 1]`` fp32 on the cache's device, block ``b``'s row ``b % layers``
    (a tier's staging holds block ``i``'s layers ``l`` as ``i * layers + l``). ``nonfinite``: an int32 ``[1]``
    tensor: NaN/Inf values become 0 and are counted into it (no sync). ``out``: a tensor of that shape and dtype to
    write into (else a new one), any strides but a unit one in ``head_dim``: a view of device blocks (NHD, or HND
    permuted to ``[nb, bs, H, D]``) takes the values in place, cast once, which is a cast device's whole write (a
    tier's promotion, ``workbench.tiers.formats.decode``). Arguments are the caller's to check."""
    layout = Layout.parse(layout)
    nb = cache.shape[0]
    a = addressing(cache, layout, kind)
    bs = cache.shape[1] if layout is Layout.NHD else cache.shape[2] if layout is Layout.HND else cache.shape[3]
    H = cache.shape[2] if layout is Layout.NHD else cache.shape[1]
    dc = scheme.code_dim(head_dim)
    if out is None:
        out = torch.empty((nb, bs, H, head_dim), dtype=out_dtype, device=cache.device)
    sc = scheme.block_scales(kind, bs, H, head_dim)
    dummy = out
    scale = zero = dummy
    sc_strides, tg, cg = (0, 0, 0, 0), 1, 1
    if sc is not None:
        scale, z = qblocks.scale_views(qblocks.plane_of(cache), sc)
        zero = z if z is not None else dummy
        sc_strides, tg, cg = scale.stride(), sc.tokens_per_group, sc.channels_per_group
    static = static_scale.reshape(-1).float() if static_scale is not None else dummy
    st_layers, st_heads = (static_scale.shape[0], static_scale.shape[-1]) if static_scale is not None else (1, 1)
    bad = nonfinite if nonfinite is not None else torch.zeros(1, dtype=torch.int32, device=cache.device)
    block_dc = triton.next_power_of_2(dc)
    block_u = min(256, max(16, 8192 // block_dc), triton.next_power_of_2(max(nb * bs, 1)))  # ~8k elements a program
    if nb and bs and H:
        _dequantize_blocks_kernel[(triton.cdiv(nb * bs, block_u), H)](
            cache, scale, zero, static, out, bad, bs, nb * bs, a.s_blk, a.s_tok, a.s_head, a.s_dgrp, *sc_strides,
            st_layers, st_heads, out.stride(0), out.stride(1), out.stride(2), S_D=a.s_d, X=a.x, HEAD_DIM=head_dim, DC=dc, BLOCK_DC=block_dc,
            BITS=scheme.bits if dc != head_dim else 0, E4M3=cache.dtype == torch.float8_e4m3fn, TG=tg, CG=cg, HAS_SCALE=sc is not None,
            HAS_ZERO=sc is not None and sc.has_zero, STATIC=static_scale is not None,
            ZERO_NONFINITE=nonfinite is not None, BLOCK_U=block_u, num_warps=4, enable_fp_fusion=False,
        )
    return out
