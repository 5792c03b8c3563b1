"""What the decode kernel needs to read a quantized cache: the scheme's mode, its scale arrays' addresses
(in the blocks, ``workbench.quant.blocks``) and static scales; checked against the caches before any launch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from workbench import quant
from workbench.quant import blocks as qblocks

from .. import common

QMODES = {"none": 0, "tensor": 0, "head": 0, "token": 2, "group": 4}  # token asymmetric: 3


class DecodeQuant(NamedTuple):
    scheme: quant.Scheme
    head_dim: int  # the values' head_dim (the caches hold code_dim(head_dim) elements a row)
    constexprs: dict
    args: tuple  # s_sc_h, ks_blk, ks_off, ks_tg, ks_h, kz_off, vs_blk, vs_off, vs_tg, vs_h, vz_off


def launch_defaults(scheme: quant.Scheme) -> dict:
    """Launch changes a quantized scheme gets on the GPU, measured on the H200 (docs/quant_tuning.md): 1-byte
    symmetric codes run two warps over 64-token tiles in three stages (fp8 per tensor, W4: 1.27x -> 1.47x our
    fp16), asymmetric int8 32-token tiles in three stages (its zero points need the registers: W1 0.73x -> 0.86x),
    packed codes 32-token tiles (the unpacked operands are the register cost)."""
    if not scheme.quantized:
        return {}
    if scheme.packed:
        return {"BLOCK_N": 32}
    if scheme.symmetric:
        return {"num_warps": 2, "BLOCK_N": 64, "num_stages": 3}
    return {"BLOCK_N": 32, "num_stages": 3}


def values_head_dim(scheme: quant.Scheme, code_dim: int) -> int:
    return code_dim * 8 // scheme.bits if scheme.packed else code_dim


def decode_quant(scheme: quant.Scheme, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, hkv: int,
                 head_dim: int, k_scale, v_scale, q_dtype: torch.dtype, interpreted: bool) -> DecodeQuant:
    """Check the scheme against the caches and scales; the kernel's quantization constexprs and arguments."""
    zero_args = (0,) * 11
    codes = {"int8": 1, "uint8": 2}.get(scheme.format_name, 0)
    fast = dict(CODES=codes, FAST_INT=codes != 0 and q_dtype == torch.float16 and not interpreted)
    if not scheme.quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are only for quantized caches; {scheme.name} stores plain values")
        return DecodeQuant(scheme, head_dim, dict(QMODE=0, DC=head_dim), zero_args)
    if scheme.static:
        return DecodeQuant(scheme, head_dim, dict(QMODE=0, DC=head_dim, **fast), zero_args)
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None:
            raise ValueError(f"{name} must be None for {scheme.name}: its scales live in the blocks")
    common.check_kernel_shape(scheme, head_dim)
    args = [0]
    consts = dict(QMODE=QMODES[scheme.granularity] + (1 if scheme.granularity == "token" and not scheme.symmetric
                                                      else 0),
                  QMAX=float(scheme.qmax), DC=qblocks.code_dim(scheme, head_dim), BITS=scheme.bits, **fast)
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
