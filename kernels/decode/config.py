"""The decode launch: the split heuristic (:func:`decode_config`) and the stride / constexpr arithmetic of a
geometry (cached on integers only, so the same across decode steps)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from workbench.core import backend
from workbench.core.layout import Layout, addressing

from .. import common

LAUNCH_KEYS = ("BLOCK_N", "num_warps", "num_stages", "use_dot", "k3d", "batch_fast", "planes", "streams")  # see DecodePlan


def _stride_split(stride: int) -> tuple[int, int]:
    """``(stride // f, f)`` with ``f = common.pow2_divisor(stride)``: the kernel multiplies ``f`` back as a
    constexpr, so the alignment it implies stays visible to Triton's vectorizer."""
    f = common.pow2_divisor(stride)
    return stride // f, f


def _cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` in plain Python (triton's goes through a constexpr-function wrapper: ~1 us a call)."""
    return -(-a // b)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return backend.compile_target_sms() if backend.BACKEND.name == "compile" else 0  # compile-only: plan as for the target GPU


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_config(
    batch: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_seq_len: int,
    *,
    mean_seq_len: float | None = None,
    kv_dtype: torch.dtype = torch.float16,
    num_sms: int = 0,
    layout: Layout | str = Layout.NHD,
) -> dict:
    """Launch parameters for :func:`paged_decode`, chosen from the problem's shape.

    On a GPU (``num_sms > 0``) the rules use this GPU's numbers from ``kernels/tuning/decode.json``
    (measured on the H200, the default for an unmeasured GPU; what each number means is in the file,
    how it was measured in docs/decode_tuning.md): a tile of about 8 KB of K, tensor cores, four stages
    unless a chunk is short, splits for about one wave of equal programs (finer for ragged batches),
    and 128-byte value pieces in the vLLM layout. ``block_size`` (the page size) changes the choice
    only in the vLLM layout, where a tile may span pages or sit inside one.

    On the CPU interpreter (``num_sms == 0``) a fixed small configuration: ``BLOCK_N`` 32,
    at most 2 splits.

    Returns:
        dict with ``BLOCK_N``, ``num_splits``, ``num_warps``, ``num_stages``, ``use_dot``.
    """
    if num_sms <= 0:
        block_n = 32
        return {"BLOCK_N": block_n, "num_splits": min(2, max(1, _cdiv(max_seq_len, block_n))),
                "num_warps": 4, "num_stages": 1, "use_dot": True}
    t = _tuning()
    elem = kv_dtype.itemsize
    tile = t["tile_bytes"] // (elem * common.next_pow2(head_dim))  # tokens in one tile's bytes of K
    block_n = max(t["min_block_n"], min(t["max_block_n"], 1 << (tile.bit_length() - 1) if tile > 0 else 16))
    max_seq_len = max(1, max_seq_len)
    mean = min(float(mean_seq_len or max_seq_len), max_seq_len)
    work = batch * num_kv_heads * mean  # token-heads to read
    smem = 3 * block_n * common.next_pow2(head_dim) * elem * 2 + 6144  # 3 K+V buffers at 4 stages
    slots = num_sms * max(1, min(t["max_programs_per_sm"], t["smem_per_sm"] // (smem + 1024)))  # resident programs
    ragged = mean < t["ragged_below"] * max_seq_len
    target = work / (t["ragged_factor"] * slots) if ragged else work / slots  # tokens per program
    target = max(target, t["min_chunk_tiles"] * block_n)
    splits = max(1, round(max_seq_len / target))
    tiles = _cdiv(_cdiv(max_seq_len, splits), block_n)  # per program
    if (Layout.parse(layout) is Layout.VLLM and elem == 2 and block_n * elem < t["vllm_value_piece_bytes"]
            and block_size >= 2 * block_n):
        # value pieces of 128 bytes, not 64 (docs/decode_tuning.md, v4)
        return {"BLOCK_N": 2 * block_n, "num_splits": splits, "num_warps": t["num_warps"],
                "num_stages": t["stages_short"], "use_dot": True}
    stages = t["stages_deep"] if tiles > t["deep_min_tiles"] else t["stages_short"]
    return {"BLOCK_N": block_n, "num_splits": splits, "num_warps": t["num_warps"], "num_stages": stages,
            "use_dot": True}


@functools.cache
def _tuning(gpu: str | None = None) -> dict:
    """This GPU's numbers from tuning/decode.json (read once)."""
    return common.tuning_table("decode", gpu)[1]


def _interpreted() -> bool:
    return backend.is_interpreted()  # looked up at each call: tests swap it (tests/test_kernel_devices.py)


class _Geometry(NamedTuple):
    """What a launch derives from shapes, strides and the launch configuration (cached per geometry)."""

    block_d: int
    k_strides: tuple
    v_strides: tuple
    constexprs: dict


def _launch_params(layout, B, Hq, D, hkv, block_size, q_dtype, k_cache, v_cache, max_seq_len, mean_seq_len,
                   num_splits, launch, interp, num_sms):
    """``(splits, chunk, geometry)`` of one launch. The split heuristic (:func:`decode_config`, plain arithmetic)
    runs every time, on ``mean_seq_len`` rounded to a whole token (so no float is ever a cache key); the stride and
    constexpr arithmetic is cached on integers only (shapes, strides, dtypes and the chosen configuration)."""
    # the mean as a whole number of tokens: plans cached on it (paged_decode's) give the same split as fresh ones
    cfg = decode_config(B, hkv, Hq // hkv, D, block_size, max(max_seq_len, 1), mean_seq_len=mean_key(mean_seq_len),
                        kv_dtype=k_cache.dtype, num_sms=num_sms, layout=layout)
    cfg.update(launch)
    if num_splits is not None:
        if int(num_splits) < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        cfg["num_splits"] = int(num_splits)
    block_n = int(cfg["BLOCK_N"])
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"BLOCK_N must be a power of two >= 16, got {block_n}")
    chunk = _cdiv(_cdiv(max(max_seq_len, 1), cfg["num_splits"]), block_n) * block_n
    splits = max(1, _cdiv(max_seq_len, chunk))  # no split starts past the longest sequence
    geo = _launch_plan(layout, Hq, D, hkv, block_size, q_dtype, k_cache.dtype, tuple(k_cache.shape), k_cache.stride(),
                       tuple(v_cache.shape), v_cache.stride(), block_n, bool(cfg["use_dot"]), bool(cfg.get("k3d", True)),
                       int(cfg["num_warps"]), int(cfg["num_stages"]), interp)
    return splits, chunk, geo


@functools.lru_cache(maxsize=512)
def _launch_plan(layout, Hq, D, hkv, block_size, q_dtype, kv_dtype, k_shape, k_stride, v_shape, v_stride,
                 block_n, use_dot, k3d_ok, num_warps, num_stages, interp) -> _Geometry:
    """The stride arithmetic and constexprs of one geometry and configuration: computed once, then a dict
    lookup per plan (integers only in the key: the same across decode steps)."""
    k_cache = torch.empty_strided(k_shape, k_stride, dtype=kv_dtype, device="meta")
    v_cache = torch.empty_strided(v_shape, v_stride, dtype=kv_dtype, device="meta")
    group = Hq // hkv
    ka = addressing(k_cache, layout, "k")
    va = addressing(v_cache, layout, "v")
    v_trans = layout is Layout.VLLM
    if block_size == 1:  # the token stride of a size-1 dim is arbitrary (torch keeps the source's)
        ka, va = ka._replace(s_tok=0), va._replace(s_tok=1 if v_trans else 0)
    if ka.s_d != 1 or (va.s_tok if v_trans else va.s_d) != 1:
        raise ValueError("k_cache/v_cache rows must be contiguous (unit stride in the last dimension)")
    # every stride split into (stride / f, f) with f its power-of-two factor, f a constexpr
    k_split = [_stride_split(s) for s in (ka.s_blk, ka.s_tok, ka.s_head, ka.s_dgrp)]
    v_split = [_stride_split(s) for s in (va.s_blk, va.s_tok, va.s_head, va.s_d if v_trans else 1)]
    k_strides, k_mult = [s for s, _ in k_split], [f for _, f in k_split]
    v_strides, v_mult = [s for s, _ in v_split], [f for _, f in v_split]
    block_d = common.next_pow2(D)
    kx = ka.x if layout is Layout.VLLM else block_d
    # [D // x, pages, run] key tiles need a page's x-chunks back to back and whole pages or whole tiles
    k3d = (k3d_ok and layout is Layout.VLLM and use_dot and (block_size == 1 or ka.s_tok == kx)
           and (block_size % block_n == 0 or block_n % block_size == 0))
    g_pad = max(16, common.next_pow2(group)) if use_dot else common.next_pow2(group)
    constexprs = dict(
        G=group, G_PAD=g_pad, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_N=block_n, PAGE=block_size, KX=kx,
        V_TRANS=v_trans, USE_DOT=use_dot, IEEE=q_dtype == torch.float32 or (interp and q_dtype == torch.bfloat16),
        K_BM=k_mult[0], K_TM=k_mult[1], K_HM=k_mult[2], K_GM=k_mult[3],
        V_BM=v_mult[0], V_TM=v_mult[1], V_HM=v_mult[2], V_DM=v_mult[3],
        V_ALIGN=min(v_mult[0], v_mult[3]), ASM=not interp, K3D=k3d,
        num_warps=num_warps, num_stages=num_stages,
    )
    return _Geometry(block_d, tuple(k_strides), tuple(v_strides), constexprs)


def mean_key(mean: float | None) -> int | None:
    """The split heuristic's mean length as it is used (an integer, see ``_launch_params``): a cache key."""
    return None if mean is None else max(1, round(float(mean)))
