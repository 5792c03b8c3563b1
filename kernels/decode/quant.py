"""What the decode kernel needs to read a quantized cache, per storage family (``workbench.quant.families``): the
family's mode, its scale arrays' addresses (in the blocks, ``workbench.quant.blocks``) and static scales; checked
against the caches before any launch. :data:`DECODE_FAMILIES` maps a family's name to its builder and launch
defaults; a new family adds its entry (docs/quant_families.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from workbench import quant

from .. import common

# the generic kernel's QMODE: 0 plain values (cast, or static scales applied outside the loop), 2 symmetric per-token
# scales, 3 asymmetric per-token scales and zero points, 4 packed group codes with fp16 scales and zero points
ZERO_ARGS = (0,) * 11


class DecodeQuant(NamedTuple):
    scheme: quant.Scheme
    head_dim: int  # the values' head_dim (the caches hold scheme.code_dim(head_dim) elements a row)
    constexprs: dict
    args: tuple  # s_sc_h, ks_blk, ks_off, ks_tg, ks_h, kz_off, vs_blk, vs_off, vs_tg, vs_h, vz_off
    fixed: dict = {}  # launch options the family's codes fix (they override the caller's and the heuristic's)


class DecodeFamily(NamedTuple):
    build: Callable[..., DecodeQuant]  # (scheme, k_cache, v_cache, block_size, hkv, head_dim, k_scale, v_scale, fast)
    launch_defaults: Callable[[quant.Scheme, int], dict]  # GPU launch changes by head_dim (docs/quant_tuning.md)
    fixed: dict  # launch options the family's codes need, e.g. packed keys read as rows


def _no_static_scales(scheme, k_scale, v_scale, why: str) -> None:
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None:
            raise ValueError(f"{name} must be None for {scheme.name}: {why}")


def _cast(scheme, k_cache, v_cache, block_size, hkv, head_dim, k_scale, v_scale, fast) -> DecodeQuant:
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale/v_scale are only for quantized caches; {scheme.name} stores plain values")
    return DecodeQuant(scheme, head_dim, dict(QMODE=0, DC=head_dim), ZERO_ARGS)


def _static(scheme, k_cache, v_cache, block_size, hkv, head_dim, k_scale, v_scale, fast) -> DecodeQuant:
    return DecodeQuant(scheme, head_dim, dict(QMODE=0, DC=head_dim, **fast), ZERO_ARGS)  # scales: the plan's


def _in_blocks(qmode: int):
    """The builder of a family whose scales live in the blocks; its QMODE from ``qmode(scheme)``."""

    def build(scheme, k_cache, v_cache, block_size, hkv, head_dim, k_scale, v_scale, fast) -> DecodeQuant:
        _no_static_scales(scheme, k_scale, v_scale, "its scales live in the blocks")
        common.check_kernel_shape(scheme, head_dim)
        args = [0]
        consts = dict(QMODE=qmode(scheme), QMAX=float(scheme.qmax), DC=scheme.code_dim(head_dim), BITS=scheme.bits,
                      **fast)
        consts["BLOCK_DC"] = max(16, 1 << (consts["DC"] - 1).bit_length())
        for kind, cache in (("k", k_cache), ("v", v_cache)):
            sc = common.block_scales_in(cache, f"{kind}_cache", scheme, kind, block_size, hkv, head_dim)
            item = sc.dtype.itemsize
            s_tg, s_h, _ = sc.strides
            args += [cache.stride(0) * cache.element_size() // item, sc.offset // item, s_tg, s_h, sc.count]
            consts[f"{kind.upper()}_TG"] = sc.tokens_per_group
            consts[f"{kind.upper()}_DG"] = sc.channels_per_group
            consts["SC_DTYPE"] = common.SCALE_DTYPES[sc.dtype]
        return DecodeQuant(scheme, head_dim, consts, tuple(args))

    return build


def _one_byte_defaults(scheme) -> dict:
    """1-byte codes run two warps over 64-token tiles in three stages (fp8 per tensor, W4: 1.27x -> 1.47x our fp16).
    Asymmetric int8 ran 32-token tiles at four warps (its zero points spilled at two: W1 0.73x -> 0.86x); with the
    loop peeled (kernels/decode/kernel.py) two warps hold 253 registers without spills: H200, 2026-12-05, 1.04-1.29x
    against the old launch's 0.63-0.81x in the same run (bench quant_decode times both)."""
    return {"num_warps": 2, "BLOCK_N": 64, "num_stages": 3}


def _packed_defaults(scheme, head_dim: int) -> dict:
    """Packed codes: the generic kernel on 32-token tiles (the unpacked operands are the register cost), except where
    a token-head has one scale and zero point (keys per token, ``value_group >= head_dim``): int4 there runs the
    streams kernel (H200, 2026-12-05: 1.15-1.58x fp16 against the generic kernel's 0.67-0.78x; its tile by context,
    ``streams.streams_tile``), int2 the planes kernel at 128-token tiles (1.08-1.39x against 0.66-0.77x; the streams
    kernel spills there)."""
    if scheme.key_mode != "token" or scheme.value_group < head_dim:
        return {"BLOCK_N": 32}
    if scheme.bits == 4:
        return {"planes": True, "num_warps": 4}
    return {"planes": True, "streams": 0, "BLOCK_N": 128}


DECODE_FAMILIES: dict[str, DecodeFamily] = {
    "cast": DecodeFamily(_cast, lambda s, d: {}, {}),
    "static": DecodeFamily(_static, lambda s, d: _one_byte_defaults(s), {}),
    "token": DecodeFamily(_in_blocks(lambda s: 2 if s.symmetric else 3), lambda s, d: _one_byte_defaults(s), {}),
    # keys read as [BLOCK_N, bytes] rows, then unpacked
    "groups": DecodeFamily(_in_blocks(lambda s: 4), _packed_defaults, {"k3d": False}),
}


def decode_family(scheme: quant.Scheme) -> DecodeFamily:
    entry = DECODE_FAMILIES.get(scheme.family)
    if entry is None:
        raise ValueError(f"the paged decode kernel has no entry for {scheme.name}'s storage family "
                         f"{scheme.family!r} (kernels/decode/quant.py DECODE_FAMILIES: {sorted(DECODE_FAMILIES)})")
    return entry


def launch_defaults(scheme: quant.Scheme, head_dim: int) -> dict:
    """Launch changes a scheme gets on the GPU for ``head_dim``-channel heads, measured on the H200 and H100
    (docs/quant_tuning.md), by its family."""
    return decode_family(scheme).launch_defaults(scheme, head_dim)


def values_head_dim(scheme: quant.Scheme, code_dim: int) -> int:
    return scheme.head_dim_of(code_dim)


def decode_quant(scheme: quant.Scheme, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, hkv: int,
                 head_dim: int, k_scale, v_scale, q_dtype: torch.dtype, interpreted: bool) -> DecodeQuant:
    """Check the scheme against the caches and scales; the kernel's quantization constexprs and arguments."""
    codes = {"int8": 1, "uint8": 2}.get(scheme.format_name, 0)
    fast = dict(CODES=codes, FAST_INT=codes != 0 and q_dtype == torch.float16 and not interpreted)
    family = decode_family(scheme)
    dq = family.build(scheme, k_cache, v_cache, block_size, hkv, head_dim, k_scale, v_scale, fast)
    return dq._replace(fixed=dict(family.fixed)) if family.fixed else dq
