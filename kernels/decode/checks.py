"""The decode arguments' checks, shared by ``paged_decode`` and :class:`~workbench.kernels.decode.DecodePlan`:
host-side only (shapes, dtypes, strides, devices, the cache's format); the values are ``validate``'s."""

from __future__ import annotations

import torch

from workbench.core import kv_formats
from workbench.core.layout import Layout, to_nhd

from ..validate import check_table_tensors


def _check_inputs(q, k_cache, v_cache, layout, block_table, seq_lens, out, scheme=None):
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if out is not None and not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a tensor or None, got {type(out).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be a [B, Hq, D] fp16/bf16/fp32 tensor, got {getattr(q, 'dtype', type(q))} "
                         f"{tuple(getattr(q, 'shape', ()))}")
    if q.stride(2) != 1:
        raise ValueError("q must have unit stride in its last dimension")
    B, Hq, D = q.shape
    hkv, block_size = _check_batch(k_cache, v_cache, layout, block_table, seq_lens, B, Hq, q.dtype, q.device, D,
                                   scheme)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1
                            or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} with unit last stride, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return B, Hq, D, hkv, block_size


def _format_of(dtype: torch.dtype) -> kv_formats.KVFormat:
    try:
        return kv_formats.get(dtype)
    except ValueError:
        raise ValueError(f"k_cache dtype {dtype} is not a kv format (workbench.core.kv_formats)") from None


def _cache_geometry(k_cache, v_cache, layout, q_dtype, device) -> tuple[int, int, int]:
    """``(block_size, kv heads, head_dim)`` of a K/V cache pair in ``layout``, checked against the queries'
    dtype and device."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} and {v_cache.dtype}")
    fmt = _format_of(k_cache.dtype)
    if not fmt.decodable:
        readable = sorted(n for n, f in kv_formats.FORMATS.items() if f.decodable)
        raise ValueError(f"k_cache stores kv format {fmt.name}, which paged decode cannot read (no decode kernel); "
                         f"it reads {readable}")
    if k_cache.dtype != q_dtype and not fmt.quantized:
        raise ValueError(f"k_cache dtype must be q's ({q_dtype}) or a quantized format (fp8, int8, uint8 codes), got "
                         f"{k_cache.dtype}")
    shapes = {}
    for name, cache, kind in (("k_cache", k_cache, "k"), ("v_cache", v_cache, "v")):
        want_dim = 5 if layout is Layout.VLLM and kind == "k" else 4
        if cache.dim() != want_dim:
            raise ValueError(f"{name} must be {want_dim}-D in the {layout.value} layout, got {tuple(cache.shape)}")
        shapes[name] = tuple(to_nhd(cache[:0], layout, kind).shape[1:])  # (block_size, heads, head_dim)
        if cache.device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {cache.device}")
    if shapes["k_cache"] != shapes["v_cache"]:
        raise ValueError(f"k_cache and v_cache disagree: (block_size, heads, head_dim) {shapes['k_cache']} "
                         f"vs {shapes['v_cache']}")
    return shapes["k_cache"]


def _check_batch(k_cache, v_cache, layout, block_table, seq_lens, B, Hq, q_dtype, device, D=None, scheme=None):
    """The caches against the queries (``Hq`` heads of ``D``, ``D=None``: the caches'), the block table and
    lengths against the batch of ``B``. Returns ``(kv heads, block_size)``."""
    check_table_tensors(block_table, seq_lens, device, batch=B, owner="q")
    block_size, hkv, hd = _cache_geometry(k_cache, v_cache, layout, q_dtype, device)
    if D is not None:
        want = scheme.code_dim(D) if scheme is not None else D
        if hd != want:
            packed = f" ({scheme.name} packs head_dim {D} into {want} bytes)" if want != D else ""
            raise ValueError(f"q head_dim {D} does not match the caches' rows of {hd} elements{packed}")
    if hkv == 0 or Hq % hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the caches' kv heads ({hkv})")
    return hkv, block_size


def _scale_arg(name, value, device, num_kv_heads=1):
    """(pointer or None, float) for a static k/v scale: a float, or an fp32 tensor of one element or one per kv head."""
    if value is None:
        return None, 1.0
    if isinstance(value, torch.Tensor):
        if value.numel() not in (1, num_kv_heads) or value.dtype != torch.float32 or value.device != device \
                or (value.numel() > 1 and value.dim() != 1):
            raise ValueError(f"{name} must be a float or an fp32 tensor of 1 or {num_kv_heads} values (per kv head) "
                             f"on {device}, got {value.dtype} {tuple(value.shape)} on {value.device}")
        return value.reshape(-1).contiguous(), 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float or an fp32 tensor, got {type(value).__name__}")
    return None, float(value)
