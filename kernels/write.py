"""Write-to-cache: new tokens' K and V into one layer's paged cache, with optional quantization.

``slot_mapping[t] = block * block_size + offset`` says where token ``t`` goes (``-1``: a
padding token, skipped). One launch writes K and V. Each program moves ``BLOCK_T`` tokens x
one head x the whole ``head_dim`` row, for both K and V.

Storage conventions (the same as :func:`workbench.kernels.reference.write_kv_ref`):

- fp32 / fp16 / bf16 caches: a plain cast (round to nearest even).
- fp8 (e4m3fn / e5m2) caches, vLLM's convention: ``stored = fp8(clamp(x / scale, -max, max))``
  with ``scale`` fp32, per tensor (one element) or per KV head (``[H]``). Saturating, as the
  hardware conversion on Hopper does.
- int8 caches: ``stored = clamp(round_half_even(x / scale), -128, 127)``.

The division is IEEE (``div_rn``) and the fp8 rounding is done in fp32 arithmetic (round half to
even onto the fp8 grid) before an exact cast, so the codes do not depend on the converter's
rounding (the interpreter's fp32 -> fp8 cast rounds ties up and drops carries into the exponent,
DESIGN section 6). Tests still allow one code at exact midpoints.

Access pattern: in every layout the source is read as ``[BLOCK_T, D]`` rows, 16 bytes a lane.
NHD, HND and the vLLM split key keep ``head_dim`` (or 16-byte groups of it) innermost, so stores
vectorize along ``d``. The vLLM value layout keeps *tokens* innermost (``[H, D, block_size]``):
when a program's tokens are a run of consecutive slots inside one block (prefill), it stores the
tile transposed, vectorized along the token axis; otherwise (decode) it scatters along ``d``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from workbench.layout import Layout, addressing, to_nhd

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SOURCE_DTYPES = CAST_DTYPES
FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # mantissa bits, smallest normal exponent
QUANT_NONE, QUANT_FP8, QUANT_INT8 = 0, 1, 2


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
    MANT: tl.constexpr, EMIN: tl.constexpr,
):
    """Source tile -> storage codes (see the module docstring)."""
    if QUANT == 0:
        b_q = b_x.to(out_dtype)
        if out_dtype == tl.bfloat16:
            if b_x.dtype != tl.bfloat16:  # round to nearest even first: the interpreter's fp32 -> bf16 cast truncates
                b_q = _round_to_grid(b_x.to(tl.float32), 7, -126).to(out_dtype)
    else:
        b_f = tl.math.div_rn(b_x.to(tl.float32), b_scale)  # IEEE division, as torch does
        b_f = tl.maximum(b_f, QMIN, propagate_nan=tl.PropagateNan.ALL)
        b_f = tl.minimum(b_f, QMAX, propagate_nan=tl.PropagateNan.ALL)
        if QUANT == 2:
            b_f = (b_f + 12582912.0) - 12582912.0  # round half to even (|b_f| <= 128 here)
        else:
            b_f = _round_to_grid(b_f, MANT, EMIN)
        b_q = b_f.to(out_dtype)
    return b_q


@triton.jit
def _write_one(
    src_ptr, cache_ptr, scale_ptr,
    o_t, m_t, i_blk, i_off, i_h, is_run, i_blk0, i_off0,
    s_st, s_sh, s_scale_h, head_dim,
    s_blk, s_tok, s_head, s_dgrp,
    S_D: tl.constexpr, X: tl.constexpr, SPLIT: tl.constexpr, RUN: tl.constexpr,
    A_SRC: tl.constexpr, A_ROW: tl.constexpr, A_RUN: tl.constexpr,
    QUANT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
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
    b_q = _quantize(b_x, b_scale, cache_ptr.dtype.element_ty, QUANT, QMIN, QMAX, MANT, EMIN)  # [BLOCK_T, BLOCK_D]
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
        KS_D, KX, K_SPLIT, K_RUN, A_SRC, KA_ROW, KA_RUN, QUANT, QMIN, QMAX, MANT, EMIN, BLOCK_T, BLOCK_D,
    )
    _write_one(
        value_ptr, v_cache_ptr, v_scale_ptr, o_t, m_t, i_blk, i_off, i_h, is_run, i_blk0, i_off0,
        s_vt, s_vh, s_scale_h, head_dim, vs_blk, vs_tok, vs_head, vs_dgrp,
        VS_D, VX, V_SPLIT, V_RUN, A_SRC, VA_ROW, VA_RUN, QUANT, QMIN, QMAX, MANT, EMIN, BLOCK_T, BLOCK_D,
    )


def quant_mode(dtype: torch.dtype) -> tuple[int, float, float]:
    """``(QUANT, QMIN, QMAX)`` for a cache dtype: cast, fp8 (saturating at +-max) or int8 ([-128, 127])."""
    if dtype in FP8_DTYPES:
        qmax = float(torch.finfo(dtype).max)
        return QUANT_FP8, -qmax, qmax
    if dtype == torch.int8:
        return QUANT_INT8, -128.0, 127.0
    return QUANT_NONE, 0.0, 0.0


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides ``n`` and is at most ``cap`` (``n == 0`` counts as divisible)."""
    a = 1
    while a < cap and n % (2 * a) == 0:
        a *= 2
    return a


def default_launch(num_tokens: int, num_heads: int, head_dim: int, block_size: int, layout: Layout | str):
    """Heuristic ``(tokens_per_program, num_warps)``.

    Big batches (prefill): 16 tokens x one head x D per program (8 KB of fp16 K+V read at D=128),
    enough programs to fill the GPU. Small batches (decode): one token per program, so the few
    rows spread over many SMs. For the vLLM value layout the tile must fit a block to be stored
    as a run, so tokens per program also divides the block size.
    """
    bt = 1
    while bt < 16 and num_tokens * num_heads >= 2048 * (2 * bt):
        bt *= 2
    if Layout.parse(layout) is Layout.VLLM and block_size > 1:
        bt = min(bt, _pow2_divisor(block_size, 16))
    tile = bt * triton.next_power_of_2(head_dim)
    num_warps = min(8, max(1, tile // 512))
    return bt, num_warps


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
    return _pow2_divisor(g, max(1, 16 // elem_size))


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
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    if k_cache.dtype not in (*CAST_DTYPES, *FP8_DTYPES, torch.int8):
        raise ValueError(f"k_cache dtype must be fp32/fp16/bf16/fp8/int8, got {k_cache.dtype}")
    shapes = {}
    for name, cache, kind in (("k_cache", k_cache, "k"), ("v_cache", v_cache, "v")):
        want = 5 if (layout is Layout.VLLM and kind == "k") else 4
        if cache.dim() != want:
            raise ValueError(f"{name} must be a {want}-D {layout.value} cache, got shape {tuple(cache.shape)}")
        nb, bs, h, d = to_nhd(cache[:0], layout, kind).shape
        if (h, d) != (num_heads, head_dim):
            raise ValueError(
                f"key has {num_heads} heads x {head_dim} dims but {name} holds {h} x {d} ({layout.value} layout)"
            )
        shapes[name] = (cache.shape[0], bs)
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
        tokens_per_program: tokens each program writes (power of two); default from :func:`default_launch`.
        num_warps: warps per program; default from :func:`default_launch`.
        validate: check that every slot is ``-1`` or inside the cache (one device sync). Skipped while a
            CUDA graph is being captured. The kernel never writes an out-of-range slot either way.
    """
    layout = Layout.parse(layout)
    block_size, num_blocks = _checked_shapes(key, value, k_cache, v_cache, layout, slot_mapping)
    num_tokens, num_heads, head_dim = key.shape
    quant, qmin, qmax = quant_mode(k_cache.dtype)
    if quant == QUANT_NONE:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise ValueError(f"{name} is only for fp8/int8 caches; this cache stores {k_cache.dtype}")
        s_scale_h, k_scale, v_scale = 0, k_cache, v_cache  # placeholders: never read
    else:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is None:
                raise ValueError(f"{name} is required: the cache stores {k_cache.dtype} (quantized)")
        s_k = _check_scale("k_scale", k_scale, num_heads, k_cache.device)
        s_v = _check_scale("v_scale", v_scale, num_heads, k_cache.device)
        if s_k != s_v:
            raise ValueError("k_scale and v_scale must both be per tensor or both per head, with the same stride")
        s_scale_h = s_k
    bt_auto, warps_auto = default_launch(num_tokens, num_heads, head_dim, block_size, layout)
    bt = bt_auto if tokens_per_program is None else tokens_per_program
    warps = warps_auto if num_warps is None else num_warps
    if bt < 1 or bt & (bt - 1):
        raise ValueError(f"tokens_per_program must be a power of two, got {bt}")
    if warps < 1 or warps & (warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {warps}")
    num_slots = num_blocks * block_size
    if validate and num_tokens and not (k_cache.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = (int(v) for v in torch.aminmax(slot_mapping))
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"slot_mapping values must be -1 or in [0, {num_slots}), got range [{lo}, {hi}]")
    if num_tokens == 0 or num_heads == 0:
        return
    ka, va = addressing(k_cache, layout, "k"), addressing(v_cache, layout, "v")
    elem = k_cache.element_size()
    src_align = _pow2_divisor(
        math.gcd(key.stride(0), key.stride(1), value.stride(0), value.stride(1)), max(1, 16 // key.element_size())
    )
    # runs are stored along the token axis only where tokens are innermost and a run fits one block
    run_ok = bt > 1 and block_size % bt == 0
    k_run, v_run = run_ok and ka.s_tok == 1, run_ok and va.s_tok == 1

    def run_align(a) -> int:
        return _pow2_divisor(math.gcd(a.s_blk, a.s_head, a.s_dgrp, a.s_d, bt), max(1, 16 // elem))

    mant, emin = FP8_GRID.get(k_cache.dtype, (0, 0))
    grid = (triton.cdiv(num_tokens, bt), num_heads)
    _write_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        num_tokens, head_dim, block_size, num_slots,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), s_scale_h,
        ka.s_blk, ka.s_tok, ka.s_head, ka.s_dgrp,
        va.s_blk, va.s_tok, va.s_head, va.s_dgrp,
        KS_D=ka.s_d, VS_D=va.s_d, KX=ka.x, VX=va.x, K_SPLIT=ka.x != head_dim, V_SPLIT=va.x != head_dim,
        K_RUN=k_run, V_RUN=v_run, A_SRC=src_align,
        KA_ROW=_row_align(ka, elem), VA_ROW=_row_align(va, elem),
        KA_RUN=run_align(ka), VA_RUN=run_align(va),
        QUANT=quant, QMIN=qmin, QMAX=qmax, MANT=mant, EMIN=emin,
        BLOCK_T=bt, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=warps,
    )
