"""Write-to-cache with scales computed on write: the ``token`` family (fp8 / int8 / asymmetric int8, one scale per
token and kv head) and the ``groups`` family (KIVI int4 / int2, packed, fp16 scale and zero point per group).

Each family has its own kernel (:data:`FAMILY_KERNELS`: ``kernels/write/token.py``, ``kernels/write/groups.py``):
one pass over the fp16 source, the reductions for its scales in registers, the division as three FMAs from a
reciprocal per row or group (IEEE's quotient), packed codes as sums of shifted words over the source's planes,
tiles sized by bytes. The generic kernel below (one kernel of modes; :data:`WRITE_MODES` maps a family to the
``MODE`` of each kind) writes the shapes a family's kernel does not take, and is the plain reference beside them
(``dynamic_launches(..., generic=True)``):

- ``MODE 1`` symmetric per token: ``scale = amax / QMAX`` (1 if ``amax == 0``), codes as the static write's.
- ``MODE 2`` asymmetric per token: ``scale = (max - min) / QMAX``, ``code = round((x - min) / scale)``.
- ``MODE 3`` groups of ``DG`` channels per token (values; keys with ``key_mode="token"``), packed.
- ``MODE 4`` keys per channel over the program's ``BLOCK_T`` tokens, one group (``key_mode="channel"``): the
  tokens must be one whole group of consecutive slots (the wrapper checks).

The codes go where the layout says (``workbench.core.layout``'s address formula, over ``code_dim`` elements a row);
the scales go into the same block, after its codes (``workbench.quant.blocks``), so they travel with it.
Non-finite inputs are counted into ``bad_ptr`` (one int32 per call), never silently spread: their rows
get NaN scales, and the count says how many values were bad.

Every kernel here reads its source through :class:`Source`: ``[T, H, D]`` rows (``write_kv``), or blocks of a cache
where they lie (``write_kv_blocks``: a tier's demotion reads the staged device blocks, no values tensor in between),
whose NaN/Inf it stores as 0 and counts (``ZERO_NONFINITE``).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from workbench.core.layout import Layout, addressing
from workbench.quant import Scheme
from workbench.quant import blocks as qblocks

from .. import common
from .config import Launch
from .groups import groups_kernel
from .kernel import FP8_GRID, QUANT_FP8, QUANT_INT8, SOFT_ROUND, _quantize
from .qmath import _fp16_params, _int_codes, _src_cols, _src_rows, _zero_nonfinite, block_shift
from .token import token_kernel


@triton.jit
def _pack(b_c, BLOCK_T: tl.constexpr, DC: tl.constexpr, BITS: tl.constexpr):
    """Codes ``[BLOCK_T, DC * 8 // BITS]`` (< 2**BITS) -> bytes ``[BLOCK_T, DC]``: slice k in bits [k*BITS, ...)."""
    PER: tl.constexpr = 8 // BITS
    b_c3 = tl.reshape(b_c.to(tl.int32), (BLOCK_T, PER, DC))
    o_k = tl.arange(0, PER)
    return tl.sum(b_c3 << (o_k * BITS)[None, :, None], axis=1).to(tl.uint8)  # disjoint bits: the sum is an or


@triton.jit
def _write_dynamic_kernel(
    src_ptr,  # K or V of the new tokens: [T, H, D] rows, unit stride in D, or blocks (SRC_BS)
    cache_ptr,  # one layer's K or V codes, any layout (1-byte elements)
    slot_ptr,  # [T] int32/int64 slots, -1 = padding
    bad_ptr,  # [1] int32: non-finite inputs seen
    num_tokens, block_size, num_slots,
    s_st, s_sh,  # source strides (token, head)
    s_sblk, s_sdgrp,  # a source in blocks: block stride, vLLM key group stride (qmath._src_rows, _src_cols)
    s_blk, s_tok, s_head, s_dgrp,  # code element (blk, tok, h, c) at blk*s_blk + tok*s_tok + h*s_head + (c // X)*s_dgrp
    sc_blk, sc_off, sc_tg, sc_h, z_off,  # scale arrays in blocks, in scale elements (workbench.quant.blocks)
    S_D: tl.constexpr, X: tl.constexpr,  # stride of c inside a 16-byte group, and the group (X == DC: unsplit)
    MODE: tl.constexpr,  # 1 symmetric per token, 2 asymmetric per token, 3 packed per token groups, 4 per channel
    QUANT: tl.constexpr,  # fp8 (1) or int (2) codes for MODE 1
    QMIN: tl.constexpr, QMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, SOFT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DC: tl.constexpr,  # stored elements a row (packed: HEAD_DIM * BITS // 8)
    BITS: tl.constexpr,
    DG: tl.constexpr,  # MODE 3: channels per group
    SC_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program (MODE 4: the key group)
    SRC_BS: tl.constexpr, SS_D: tl.constexpr, SX: tl.constexpr,  # the source's tokens a block (0: rows), channels
    ZERO_NONFINITE: tl.constexpr,  # NaN/Inf inputs stored as 0 (and counted, as always)
):
    i_tb = tl.program_id(0)
    i_h = tl.program_id(1)
    o_t = i_tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    m_t = o_t < num_tokens
    b_slot = tl.load(slot_ptr + o_t, mask=m_t, other=-1).to(tl.int64)
    m_t = m_t & (b_slot >= 0) & (b_slot < num_slots)  # padding and out-of-range slots write nothing
    b_slot = tl.where(m_t, b_slot, 0)
    i_blk = b_slot // block_size  # [BLOCK_T]
    i_off = b_slot % block_size
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    m = m_t[:, None] & m_d[None, :]
    p_x = src_ptr + _src_rows(o_t, i_h, s_st, s_sh, s_sblk, SRC_BS)[:, None] + _src_cols(o_d, s_sdgrp, SS_D, SX)[None, :]
    b_x = tl.load(p_x, mask=m, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_D]
    n_bad = tl.sum(tl.sum((m & ((b_x != b_x) | (tl.abs(b_x) == float("inf")))).to(tl.int32), 1), 0)
    if n_bad > 0:
        tl.atomic_add(bad_ptr, n_bad)
    if ZERO_NONFINITE:  # counted above; as 0 they cannot reach a scale
        b_x, _ = _zero_nonfinite(b_x, m)
    p_sc = cache_ptr.to(tl.pointer_type(SC_DTYPE)) + sc_off + i_h.to(tl.int64) * sc_h  # this head's scales
    o_srow = i_blk * sc_blk + i_off * sc_tg  # [BLOCK_T] scale row of each token (token-group size 1)
    if MODE == 1:
        b_amax = tl.max(tl.abs(b_x), 1)  # [BLOCK_T]
        b_s = tl.math.div_rn(b_amax, tl.full(b_amax.shape, QMAX, tl.float32))
        b_s = tl.where(b_s > 0, b_s, 1.0)  # amax == 0, or amax / QMAX underflowing: never a division by 0
        b_s = tl.where(b_amax == b_amax, b_s, b_amax)  # a NaN row keeps a NaN scale (counted above)
        b_q = _quantize(b_x, b_s[:, None], cache_ptr.dtype.element_ty, QUANT, QMIN, QMAX, MANT, EMIN, 0, SOFT)
        tl.store(p_sc + o_srow, b_s, mask=m_t)
    elif MODE == 2:
        b_lo = tl.min(tl.where(m, b_x, float("inf")), 1)
        b_hi = tl.max(tl.where(m, b_x, float("-inf")), 1)
        b_s = tl.math.div_rn(b_hi - b_lo, tl.full(b_hi.shape, QMAX, tl.float32))
        b_s = tl.where(b_s > 0, b_s, 1.0)  # a constant row or an underflow (NaN rows too: counted above)
        b_y = tl.math.div_rn(b_x - b_lo[:, None], b_s[:, None] + tl.zeros_like(b_x))
        b_q = _int_codes(b_y, QMAX).to(cache_ptr.dtype.element_ty)
        tl.store(p_sc + o_srow, b_s, mask=m_t)
        tl.store(p_sc + z_off + o_srow, b_lo, mask=m_t)
    elif MODE == 3:
        NG: tl.constexpr = HEAD_DIM // DG
        b_x3 = tl.reshape(b_x, (BLOCK_T, NG, DG))
        b_s, b_z = _fp16_params(tl.min(b_x3, 2), tl.max(b_x3, 2), QMAX)  # [BLOCK_T, NG] fp16
        b_y = tl.math.div_rn(b_x3 - b_z.to(tl.float32)[:, :, None], b_s.to(tl.float32)[:, :, None] + tl.zeros_like(b_x3))
        b_q = _pack(tl.reshape(_int_codes(b_y, QMAX), (BLOCK_T, HEAD_DIM)), BLOCK_T, DC, BITS)
        o_g = tl.arange(0, NG)
        p_g = p_sc + o_srow[:, None] + o_g[None, :]  # [BLOCK_T, NG]
        tl.store(p_g, b_s, mask=m_t[:, None])
        tl.store(p_g + z_off, b_z, mask=m_t[:, None])
    else:  # MODE 4: one group of BLOCK_T tokens, parameters per channel
        b_s, b_z = _fp16_params(tl.min(b_x, 0), tl.max(b_x, 0), QMAX)  # [HEAD_DIM] fp16
        b_y = tl.math.div_rn(b_x - b_z.to(tl.float32)[None, :], b_s.to(tl.float32)[None, :] + tl.zeros_like(b_x))
        b_q = _pack(_int_codes(b_y, QMAX), BLOCK_T, DC, BITS)
        slot0 = tl.load(slot_ptr + i_tb.to(tl.int64) * BLOCK_T).to(tl.int64)  # the group's first slot
        p_g = p_sc + (slot0 // block_size) * sc_blk + ((slot0 % block_size) // BLOCK_T) * sc_tg + o_d
        if slot0 >= 0:  # a padding group writes nothing
            tl.store(p_g, b_s)
            tl.store(p_g + z_off, b_z)
    # the codes: [BLOCK_T, DC] rows at the layout's addresses
    o_c = tl.arange(0, BLOCK_D if MODE <= 2 else DC)
    o_col = (o_c // X).to(tl.int64) * s_dgrp + (o_c % X) * S_D
    p_c = cache_ptr + (i_blk * s_blk + i_off * s_tok + i_h.to(tl.int64) * s_head)[:, None] + o_col[None, :]
    tl.store(p_c, b_q, mask=m_t[:, None] & (o_c < DC)[None, :])


# ----------------------------------------------------------------------------- the launch
TOKENS_PER_PROGRAM = 16  # the generic kernel's


# the generic kernel's MODE for one kind (K or V) of a scheme, by storage family: the families whose scales are
# computed on write; a new one adds its entry (docs/quant_families.md)
WRITE_MODES = {
    "token": lambda scheme, kind: 1 if scheme.symmetric else 2,
    "groups": lambda scheme, kind: 4 if kind == "k" and scheme.write_group > 1 else 3,  # per-channel keys: one group
}


# each family's own kernel: ``(kernel, tokens a program, constexprs)`` for one kind, or None where its shape is not
# one the family's kernel takes (the generic kernel then writes it)
FAMILY_KERNELS = {"token": token_kernel, "groups": groups_kernel}


def _mode(scheme: Scheme, kind: str) -> int:
    mode = WRITE_MODES.get(scheme.family)
    if mode is None:
        raise ValueError(f"the dynamic write kernel has no entry for {scheme.name}'s storage family {scheme.family!r} "
                         f"(kernels/write/dynamic.py WRITE_MODES: {sorted(WRITE_MODES)})")
    return mode(scheme, kind)


def check_dynamic(scheme: Scheme, key, k_cache, v_cache, layout: Layout, block_size: int) -> None:
    """What only a dynamic scheme asks of the caches: room for its scales in every block, and whole key groups."""
    num_tokens, num_heads, head_dim = key.shape
    scheme.check_shape(num_heads, head_dim)
    common.check_kernel_shape(scheme, head_dim)
    for kind, cache in (("k", k_cache), ("v", v_cache)):
        common.block_scales_in(cache, f"{kind}_cache", scheme, kind, block_size, num_heads, head_dim)
    if num_tokens % scheme.write_group:
        raise ValueError(f"{scheme.name} quantizes keys per channel over groups of {scheme.write_group} tokens: key must "
                         f"hold whole groups, got {num_tokens} tokens (the cache keeps the rest in its fp16 residual)")


def check_group_slots(scheme: Scheme, slot_mapping: torch.Tensor, block_size: int) -> None:
    """Key groups must be runs of consecutive slots starting at a multiple of the group (one device sync)."""
    g = scheme.group
    s = slot_mapping.long().reshape(-1, g)
    ok = (s == s[:, :1] + torch.arange(g, device=s.device)).all(1) & (s[:, 0] % g == 0)
    ok |= (s == -1).all(1)  # a whole padding group writes nothing
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        raise ValueError(f"slot_mapping group {i} (tokens {i * g}..{i * g + g - 1}) must be {g} consecutive slots "
                         f"from a multiple of {g} for {scheme.name}'s per-channel keys, got {s[i].tolist()}")


class Source(NamedTuple):
    """Where a write kernel reads K or V: the tensor, its runtime strides ``(token, head, block, vLLM key group)``
    and the constexprs of ``qmath._src_rows`` / ``_src_cols`` (and whether NaN/Inf are stored as 0)."""

    tensor: torch.Tensor
    strides: tuple[int, int, int, int]
    consts: dict


def rows_source(x: torch.Tensor) -> Source:
    """``[T, H, D]`` rows with unit stride in ``D``: ``write_kv``'s key or value, as the kernels always read it."""
    return Source(x, (x.stride(0), x.stride(1), 0, 0), dict(SRC_BS=0, SS_D=1, SX=0, ZERO_NONFINITE=False))


def blocks_source(blocks: torch.Tensor, layout: Layout, kind: str, head_dim: int) -> Source:
    """Blocks of one kind ``[nb, *block_shape]`` in ``layout`` (a block view), read where they lie: token ``t`` is
    slot ``t % block_size`` of block ``t // block_size``; NaN/Inf stored as 0 and counted (``write_kv_blocks``)."""
    a = addressing(blocks, layout, kind)
    bs = blocks.shape[1] if layout is Layout.NHD else blocks.shape[2] if layout is Layout.HND else blocks.shape[3]
    split = a.x < head_dim  # vLLM's key: 16-byte groups of channels (a kernel's plane is a whole number of them)
    return Source(blocks, (a.s_tok, a.s_head, a.s_blk, a.s_dgrp),
                  dict(SRC_BS=bs, SS_D=a.s_d, SX=a.x if split else 0, ZERO_NONFINITE=True))


def dynamic_launches(key, value, k_cache, v_cache, layout: Layout, slot_mapping, scheme: Scheme, block_size: int,
                     num_blocks: int, counter: torch.Tensor, tokens_per_program: int | None = None,
                     num_warps: int | None = None, generic: bool = False,
                     sources: tuple[Source, Source] | None = None) -> list[Launch]:
    """The launches that quantize ``key``/``value`` ``[T, H, D]`` with scales computed now and write codes and
    scales (checked already by ``write_kv``), counting non-finite inputs into ``counter`` (int32 ``[1]``): the
    family's kernel (:data:`FAMILY_KERNELS`) where it takes the shape, else (or ``generic``) the generic one.
    ``sources``: K's and V's :class:`Source` when they are not ``key``'s and ``value``'s rows (``write_kv_blocks``);
    ``key`` then gives only the shape ``[T, H, D]``."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0 or num_heads == 0:
        return []
    if sources is None:
        sources = (rows_source(key), rows_source(value))
    out = []
    for kind, src, cache in (("k", sources[0], k_cache), ("v", sources[1], v_cache)):
        a = addressing(cache, layout, kind)
        sc = qblocks.block_scales(scheme, kind, block_size, num_heads, head_dim)
        item = sc.dtype.itemsize
        s_tg, s_h, _ = sc.strides
        args = (src.tensor, cache, slot_mapping, counter, num_tokens, block_size, num_blocks * block_size,
                *src.strides, a.s_blk, a.s_tok, a.s_head, a.s_dgrp,
                cache.stride(0) * cache.element_size() // item, sc.offset // item, s_tg, s_h, sc.count)
        family = None if generic else FAMILY_KERNELS.get(scheme.family)
        made = family(scheme, kind, head_dim, sc, tokens_per_program, num_warps) if family else None
        kernel, bt, consts = made or _generic_kernel(scheme, kind, head_dim, sc, tokens_per_program, num_warps)
        consts.update(S_D=a.s_d, X=a.x, **src.consts)
        if made:
            consts["SHIFT"] = block_shift(block_size)
        out.append(Launch(kernel, (triton.cdiv(num_tokens, bt), num_heads), args, consts))
    return out


def _generic_kernel(scheme: Scheme, kind: str, head_dim: int, sc, tokens_per_program, num_warps):
    fmt = scheme.format
    mant, emin = FP8_GRID.get(fmt.storage, (0, 0))
    mode = _mode(scheme, kind)
    bt = scheme.group if mode == 4 else (tokens_per_program or TOKENS_PER_PROGRAM)
    consts = dict(MODE=mode, QUANT=QUANT_FP8 if fmt.codes == "fp8" else QUANT_INT8, QMIN=fmt.qmin, QMAX=fmt.qmax,
                  MANT=mant, EMIN=emin, SOFT=SOFT_ROUND, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                  DC=scheme.code_dim(head_dim), BITS=scheme.bits, DG=sc.channels_per_group if mode == 3 else 1,
                  SC_DTYPE=common.SCALE_DTYPES[sc.dtype], BLOCK_T=bt, num_warps=num_warps or 4)
    return _write_dynamic_kernel, bt, consts


def write_dynamic(key, value, k_cache, v_cache, layout: Layout, slot_mapping, scheme: Scheme, block_size: int,
                  num_blocks: int, nonfinite: torch.Tensor | None = None, validate: bool = True,
                  tokens_per_program: int | None = None, num_warps: int | None = None) -> None:
    """Quantize ``key``/``value`` ``[T, H, D]`` with scales computed now and write codes and scales (checked
    already by ``write_kv``). Non-finite inputs are counted into ``nonfinite`` (int32 ``[1]``); without one,
    a validated call warns when it saw any."""
    counter = nonfinite if nonfinite is not None else torch.zeros(1, dtype=torch.int32, device=k_cache.device)
    launches = dynamic_launches(key, value, k_cache, v_cache, layout, slot_mapping, scheme, block_size, num_blocks,
                                counter, tokens_per_program, num_warps)
    for launch in launches:
        launch()
    if launches and nonfinite is None and validate and not (k_cache.is_cuda and
                                                             torch.cuda.is_current_stream_capturing()):
        n = int(counter)
        if n:
            warnings.warn(f"write_kv ({scheme.name}): {n} NaN/Inf values in key/value were written; their rows hold "
                          f"NaN scales. Pass nonfinite= to count them without this warning.", stacklevel=3)
