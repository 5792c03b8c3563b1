"""Quest key bounds: per block and kv head, the elementwise min and max of the block's keys as attention reads them.

:func:`key_bounds` recomputes the bounds ``[num_blocks, Hkv, 2, D]`` (fp16) of the blocks a write touched, from the
keys *as stored*: read in any layout (nhd, hnd, vllm split key) and dequantized as the decode kernel dequantizes them
(static fp8/int8 scales, per-token scales kept in the blocks). Why a separate pass after each write kernel rather
than a min/max fused into the write: the bounds are then exact bounds of what attention reads (after fp8/int8
rounding, whatever the write kernel's rounding mode); a block's bound is one program's reduction over the block's
stored tokens, so no atomics are needed even when one write puts many tokens into a block (a fused running min/max
would need atomic min/max across the write kernel's programs, and fp32 atomics on fp16 bounds); and it is idempotent
(a repeated or undone write leaves nothing stale, and a block newly handed to a sequence never keeps its previous
owner's keys). It is cheap at decode: one block per sequence per layer (``block_size`` tokens' K), against a decode
that reads the whole context. Reference: ``reference.key_bounds_ref``. Index arithmetic is int64 (pools beyond 2**31
elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench import quant
from workbench.core.backend import is_interpreted
from workbench.core.layout import Layout, addressing

from .. import common

FP16_MAX = 65504.0  # the bounds saturate here when the true bound lies inside fp16's range


@triton.jit
def _key_bounds_kernel(
    k_ptr,  # one layer's K cache, any layout: blk*s_blk + tok*s_tok + head*s_head + (d // KX)*s_dgrp + (d % KX)*s_d
    blk_ptr,  # [N] block ids to recompute (distinct: one program per block and head group writes each bound)
    cnt_ptr,  # [N] tokens stored in each block, 0..PAGE (0: reset to the empty bound +inf / -inf)
    out_ptr,  # [num_blocks, Hkv, 2, D] fp16 bounds of this layer: [.., 0, :] min, [.., 1, :] max
    ks_ptr,  # fp32 static key scale, one or [Hkv] (SCALE_PTR)
    s_sc_h,  # head stride of ks_ptr (0: per tensor)
    num_heads,
    s_blk, s_tok, s_head, s_dgrp, s_d,  # K cache element strides (workbench.core.layout.addressing)
    s_ob, s_oh,  # bounds strides of a block and a head (min at +0, max at +HEAD_DIM)
    sc_blk, sc_off, sc_tg, sc_h, z_off,  # per-token scales in the blocks (QMODE 2, 3), in scale elements
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_T: tl.constexpr,  # tokens per block (PAGE) rounded up to a power of two
    BLOCK_H: tl.constexpr,  # kv heads per program (a power of two)
    KX: tl.constexpr,  # the vLLM key split x (HEAD_DIM for nhd / hnd)
    QMODE: tl.constexpr,  # 0 plain or static scale, 2 per-token scale, 3 per-token scale and zero point
    SCALE_PTR: tl.constexpr,
    SC_DTYPE: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_hg = tl.program_id(1)
    i_blk = tl.load(blk_ptr + i_n).to(tl.int64)
    n_tok = tl.load(cnt_ptr + i_n).to(tl.int32)

    o_t = tl.arange(0, BLOCK_T)
    o_h = i_hg * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_t = o_t < n_tok
    m_h = o_h < num_heads
    m_d = o_d < HEAD_DIM
    m_th = m_t[:, None] & m_h[None, :]  # [BLOCK_T, BLOCK_H]
    m_thd = m_th[:, :, None] & m_d[None, None, :]  # [BLOCK_T, BLOCK_H, BLOCK_D]
    o_row = (o_t * s_tok)[:, None] + (o_h.to(tl.int64) * s_head)[None, :]  # [BLOCK_T, BLOCK_H]
    o_col = (o_d // KX) * s_dgrp + (o_d % KX) * s_d  # [BLOCK_D]
    p_k = k_ptr + i_blk * s_blk + o_row[:, :, None] + o_col[None, None, :]
    b_k = tl.load(p_k, mask=m_thd, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_H, BLOCK_D] keys as stored (codes)
    if QMODE == 2 or QMODE == 3:  # per-token scales after the block's codes (workbench.quant.blocks)
        sc_base = k_ptr.to(tl.pointer_type(SC_DTYPE)) + sc_off
        o_s = i_blk * sc_blk + (o_t * sc_tg)[:, None] + (o_h.to(tl.int64) * sc_h)[None, :]  # [BLOCK_T, BLOCK_H]
        b_sc = tl.load(sc_base + o_s, mask=m_th, other=0.0).to(tl.float32)
        b_k = b_k * b_sc[:, :, None]
        if QMODE == 3:
            b_z = tl.load(sc_base + z_off + o_s, mask=m_th, other=0.0).to(tl.float32)
            b_k = b_k + b_z[:, :, None]
    if SCALE_PTR:
        b_ks = tl.load(ks_ptr + o_h * s_sc_h, mask=m_h, other=1.0)  # [BLOCK_H]
        b_k = b_k * b_ks[None, :, None]
    b_lo = tl.min(tl.where(m_thd, b_k, float("inf")), 0)  # [BLOCK_H, BLOCK_D] the keys as attention reads them
    b_hi = tl.max(tl.where(m_thd, b_k, float("-inf")), 0)
    # outward to fp16: a margin of 2**-10 relative (fp16's whole ulp, twice its rounding error) plus 2**-24 (its
    # smallest subnormal) keeps the rounded value a true bound; inf (an empty block) stays as it is; a bound inside
    # fp16's range saturates at its max instead of overflowing
    m_lo = tl.abs(b_lo) < float("inf")
    m_hi = tl.abs(b_hi) < float("inf")
    b_lo_f = tl.where(m_lo, b_lo, 0.0)  # no inf - inf on the discarded lanes
    b_hi_f = tl.where(m_hi, b_hi, 0.0)
    b_lo_w = b_lo_f - tl.abs(b_lo_f) * 0.0009765625 - 5.960464477539063e-08
    b_hi_w = b_hi_f + tl.abs(b_hi_f) * 0.0009765625 + 5.960464477539063e-08
    b_lo_w = tl.where(b_lo >= -65504.0, tl.maximum(b_lo_w, -65504.0), b_lo_w)
    b_hi_w = tl.where(b_hi <= 65504.0, tl.minimum(b_hi_w, 65504.0), b_hi_w)
    b_lo = tl.where(m_lo, b_lo_w, b_lo)
    b_hi = tl.where(m_hi, b_hi_w, b_hi)
    p_o = out_ptr + i_blk * s_ob + (o_h.to(tl.int64) * s_oh)[:, None] + o_d[None, :]  # [BLOCK_H, BLOCK_D]
    m_o = m_h[:, None] & m_d[None, :]
    tl.store(p_o, b_lo.to(tl.float16), mask=m_o)
    tl.store(p_o + HEAD_DIM, b_hi.to(tl.float16), mask=m_o)


def _cast_args(scheme, k_cache, block_size, hkv, head_dim, k_scale):
    if k_scale is not None:
        raise ValueError(f"k_scale is only for static-scale schemes; {scheme.name} has none")
    return 0, False, tl.float32, None, 0, (0, 0, 0, 0, 0)


def _static_args(scheme, k_cache, block_size, hkv, head_dim, k_scale):
    if not isinstance(k_scale, torch.Tensor) or k_scale.dtype != torch.float32 or k_scale.numel() not in (1, hkv):
        raise ValueError(f"k_scale must be an fp32 tensor of one element or [{hkv}] for {scheme.name}, got "
                         f"{common.describe(k_scale)}")
    if k_scale.device != k_cache.device:
        raise ValueError(f"k_scale must be on the cache's device {k_cache.device}, got {k_scale.device}")
    k_scale = k_scale.reshape(-1)
    return 0, True, tl.float32, k_scale, int(k_scale.numel() > 1), (0, 0, 0, 0, 0)


def _token_args(scheme, k_cache, block_size, hkv, head_dim, k_scale):
    if k_scale is not None:
        raise ValueError(f"k_scale is only for static-scale schemes; {scheme.name} has none")
    sc = common.block_scales_in(k_cache, "k_cache", scheme, "k", block_size, hkv, head_dim)
    item = sc.dtype.itemsize
    s_tg, s_h, _ = sc.strides
    qmode = 3 if sc.has_zero else 2
    args = (k_cache.stride(0) * k_cache.element_size() // item, sc.offset // item, s_tg, s_h, sc.count)
    return qmode, False, common.SCALE_DTYPES[sc.dtype], None, 0, args


# the bounds kernel's arguments by storage family (workbench.quant.families); a family without an entry has no
# key bounds (the groups family: its packed key groups and fp16 residual are not read per block)
BOUNDS_FAMILIES = {"cast": _cast_args, "static": _static_args, "token": _token_args}


def _scheme_args(scheme: quant.Scheme, k_cache: torch.Tensor, block_size: int, hkv: int, head_dim: int, k_scale):
    """``(QMODE, SCALE_PTR, SC_DTYPE, ks_ptr, s_sc_h, (sc_blk, sc_off, sc_tg, sc_h, z_off))`` for the bounds kernel."""
    build = BOUNDS_FAMILIES.get(scheme.family) if scheme.supports_key_bounds else None
    if build is None:
        raise ValueError(f"key bounds do not support {scheme.name}: its packed key groups (and its fp16 residual of "
                         "newest tokens) are not read per block")
    return build(scheme, k_cache, block_size, hkv, head_dim, k_scale)


def _k_geometry(k_cache: torch.Tensor, layout: Layout) -> tuple[int, int, int]:
    """``(block_size, kv heads, code_dim)`` of a K cache in ``layout``."""
    s = k_cache.shape
    if layout is Layout.NHD:
        return s[1], s[2], s[3]
    if layout is Layout.HND:
        return s[2], s[1], s[3]
    return s[3], s[1], s[2] * s[4]


def key_bounds(k_cache: torch.Tensor, layout: Layout | str, bounds: torch.Tensor, blocks: torch.Tensor,
               counts: torch.Tensor, *, quant=None, k_scale: torch.Tensor | None = None) -> None:
    """Recompute the key bounds of ``blocks`` from the keys stored in them, in place.

    Args:
        k_cache: one layer's K cache in ``layout`` (``[num_blocks, *block_shape]``; a quantized scheme's codes).
        layout: ``"nhd"``, ``"hnd"`` or ``"vllm"``.
        bounds: ``[num_blocks, Hkv, 2, head_dim]`` fp16, unit stride in ``head_dim``: ``[.., 0, :]`` the
            elementwise min, ``[.., 1, :]`` the max of the block's keys, rounded outward to fp16.
        blocks: ``[N]`` int32/int64 distinct block ids (the kernel does not check them).
        counts: ``[N]`` tokens stored in each block (its slots ``0 .. count - 1``); 0 resets the block's bound to
            the empty one (min ``+inf``, max ``-inf``: its pages score ``-inf``).
        quant: the cache's ``workbench.quant`` scheme (name or object) when its dtype alone does not say it.
        k_scale: fp32 static key scale (one element or ``[Hkv]``) of fp8/int8 per-tensor / per-head schemes.
    """
    layout = Layout.parse(layout)
    scheme = common.scheme_of(k_cache.dtype, quant)
    for name, t in (("bounds", bounds), ("blocks", blocks), ("counts", counts)):
        if not isinstance(t, torch.Tensor) or t.device != k_cache.device:
            raise ValueError(f"{name} must be a tensor on the cache's device {k_cache.device}, got "
                             f"{common.describe(t)}")
    block_size, hkv, code_dim = _k_geometry(k_cache, layout)
    head_dim = code_dim
    if bounds.dtype != torch.float16 or bounds.dim() != 4 or tuple(bounds.shape[1:]) != (hkv, 2, head_dim) \
            or bounds.shape[0] != k_cache.shape[0] or bounds.stride(3) != 1:
        raise ValueError(f"bounds must be fp16 [{k_cache.shape[0]}, {hkv}, 2, {head_dim}] with unit last stride, got "
                         f"{common.describe(bounds)}")
    if blocks.dim() != 1 or counts.shape != blocks.shape:
        raise ValueError(f"blocks and counts must be 1-D of one length, got {tuple(blocks.shape)} and "
                         f"{tuple(counts.shape)}")
    qmode, scale_ptr, sc_dtype, ks, s_sc_h, sc_args = _scheme_args(scheme, k_cache, block_size, hkv, head_dim,
                                                                    k_scale)
    n = blocks.shape[0]
    if n == 0:
        return
    blocks, counts = blocks.contiguous(), counts.contiguous()  # no-ops for the cache's own
    a = addressing(k_cache, layout, "k")
    block_t, block_d = triton.next_power_of_2(block_size), triton.next_power_of_2(head_dim)
    # kv heads per program: a [BLOCK_T, BLOCK_H, BLOCK_D] tile of <= 4k values on the GPU (registers; more programs
    # for a decode step's few blocks), <= 16k under the interpreter (fewer programs, each numpy op bigger)
    cap = 16384 if is_interpreted() else 4096
    block_h = min(triton.next_power_of_2(hkv), max(1, cap // (block_t * block_d)))
    _key_bounds_kernel[(n, triton.cdiv(hkv, block_h))](
        k_cache, blocks, counts, bounds, ks if ks is not None else bounds, s_sc_h, hkv,
        a.s_blk, a.s_tok, a.s_head, a.s_dgrp, a.s_d, bounds.stride(0), bounds.stride(1), *sc_args,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_T=block_t, BLOCK_H=block_h, KX=a.x, QMODE=qmode,
        SCALE_PTR=scale_ptr, SC_DTYPE=sc_dtype, num_warps=8,
    )
