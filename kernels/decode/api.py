"""``paged_decode``, the one-shot entry point, and the argument checks the plan shares."""

from __future__ import annotations

from collections import OrderedDict

import torch

from workbench import formats
from workbench.layout import Layout, to_nhd

from .. import common
from ..validate import capturing
from . import config

_FP8 = common.FP8_DTYPES


def _check_inputs(q, k_cache, v_cache, layout, block_table, seq_lens, out):
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
    hkv, block_size = _check_batch(k_cache, v_cache, layout, block_table, seq_lens, B, Hq, q.dtype, q.device, D)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1
                            or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} with unit last stride, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return B, Hq, D, hkv, block_size


def _format_of(dtype: torch.dtype) -> formats.KVFormat:
    try:
        return formats.get(dtype)
    except ValueError:
        raise ValueError(f"k_cache dtype {dtype} is not a kv format (workbench.formats)") from None


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
        readable = sorted(n for n, f in formats.FORMATS.items() if f.decodable)
        raise ValueError(f"k_cache stores kv format {fmt.name}, which paged decode cannot read (no decode kernel); "
                         f"it reads {readable}")
    if k_cache.dtype != q_dtype and not fmt.quantized:
        raise ValueError(f"k_cache dtype must be q's ({q_dtype}) or a quantized format (fp8), got {k_cache.dtype}")
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


def _check_batch(k_cache, v_cache, layout, block_table, seq_lens, B, Hq, q_dtype, device, D=None):
    """The caches against the queries (``Hq`` heads of ``D``, ``D=None``: the caches'), the block table and
    lengths against the batch of ``B``. Returns ``(kv heads, block_size)``."""
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    block_size, hkv, hd = _cache_geometry(k_cache, v_cache, layout, q_dtype, device)
    if D is not None and hd != D:
        raise ValueError(f"q head_dim {D} does not match the caches' head_dim {hd}")
    if hkv == 0 or Hq % hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the caches' kv heads ({hkv})")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be int32 of shape [{B}, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32 or seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must be int32 of shape [{B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table must be on q's device {device}, got {block_table.device}")
    if seq_lens.device != device:
        raise ValueError(f"seq_lens must be on q's device {device}, got {seq_lens.device}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must have unit stride in its last dimension, got strides {block_table.stride()}")
    if B > 1 and seq_lens.stride(0) != 1:
        raise ValueError(f"seq_lens must be contiguous, got stride {seq_lens.stride(0)}")
    return hkv, block_size


def _scale_arg(name, value, device):
    """(pointer or None, float) for a k/v scale given as a float or a one-element fp32 tensor."""
    if value is None:
        return None, 1.0
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32 or value.device != device:
            raise ValueError(f"{name} must be a float or a one-element fp32 tensor on {device} (decode reads one "
                             f"scale per tensor: workbench.formats, decode_scales), got {value.dtype} "
                             f"{tuple(value.shape)} on {value.device}")
        return value.reshape(1), 1.0
    return None, float(value)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: Layout | str,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    max_seq_len: int | None = None,
    mean_seq_len: float | None = None,
    validate: bool = True,
    **launch,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V cache.

    The one-shot shortcut of :class:`~workbench.kernels.decode.DecodePlan`: it plans (checks,
    launch configuration, scratch) and runs once. A model step with many layers builds the plan once and
    calls ``plan.run`` per layer instead.

    Args:
        q: ``[B, Hq, D]`` fp16/bf16/fp32 queries (one token per sequence).
        k_cache: one layer's K cache in ``layout`` (``workbench.layout``), dtype q's or fp8
            (e4m3fn / e5m2); any block stride (padded blocks are fine), unit stride inside a row.
        v_cache: the V cache, same layout and dtype.
        layout: ``"nhd"``, ``"hnd"`` or ``"vllm"``.
        block_table: ``[B, max_blocks]`` int32, physical block of each logical block.
        seq_lens: ``[B]`` int32 context lengths (ragged; 0 gives zeros).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        num_splits: split-KV chunks per sequence; ``None`` asks :func:`decode_config`.
        out: optional ``[B, Hq, D]`` output buffer (q's dtype).
        k_scale, v_scale: dequantization scales (read = stored * scale), floats or one-element
            fp32 tensors (no host sync); default 1.
        max_seq_len: ``max(seq_lens)`` if the caller knows it. Without it the wrapper reads
            ``seq_lens`` on the host (a device sync, not allowed inside CUDA-graph capture) and
            also checks the lengths against the block table (and takes their mean).
        mean_seq_len: mean of ``seq_lens``, a hint for the split heuristic (ragged batches).
        validate: check every block id a sequence uses (the first ``ceil(seq_lens[b] / block_size)``
            entries of row ``b``; later ones are padding, never read) lies in ``[0, num_blocks)`` and the
            lengths in ``[0, max_blocks * block_size]``
            (:func:`~workbench.kernels.validate.check_block_table`): one reduction and one device sync,
            shared with the read of ``seq_lens`` when ``max_seq_len`` is None. Skipped while a CUDA graph is
            being captured. Benchmarks and graph-capture callers pass ``validate=False`` together with
            ``max_seq_len``: then the call does no device work besides the kernels. The kernel trusts the
            table: an out-of-range id reads outside the cache.
        **launch: overrides of :func:`decode_config`: ``BLOCK_N``, ``num_warps``, ``num_stages``,
            ``use_dot``; and ``k3d`` (default True): the vLLM split key read in page runs (see
            ``_attend_tile``), False reads ``[BLOCK_N, D]`` tiles (lanes along d, slower).

    Returns:
        ``[B, Hq, D]`` in q's dtype.
    """
    from .plan import DecodePlan

    layout = Layout.parse(layout)
    B, Hq, D, hkv, block_size = _check_inputs(q, k_cache, v_cache, layout, block_table, seq_lens, out)
    key = None
    if max_seq_len is not None and not (validate and not capturing(q)):
        # nothing to read on the device: the plan depends on metadata only, so it is cached on it (the table and
        # lengths by address: the cached plan keeps them alive, so an address names the same memory)
        key = (layout, q.dtype, q.device, B, Hq, k_cache.dtype, tuple(k_cache.shape), k_cache.stride(),
               tuple(v_cache.shape), v_cache.stride(), block_table.data_ptr(), tuple(block_table.shape),
               block_table.stride(0), seq_lens.data_ptr(), max_seq_len, config.mean_key(mean_seq_len), num_splits,
               _scale_key(k_scale), _scale_key(v_scale), sm_scale, tuple(sorted(launch.items())) if launch else ())
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan._launch(q, k_cache, v_cache, out, fresh_scratch=True)
    plan = DecodePlan._checked(layout, block_table, seq_lens, k_cache, v_cache, B, Hq, D, hkv, block_size, q.dtype,
                               q.device, max_seq_len, mean_seq_len, num_splits, k_scale, v_scale, sm_scale, validate,
                               launch, scratch=False)
    if key is not None:
        _PLANS[key] = plan
        if len(_PLANS) > _PLANS_MAX:
            _PLANS.popitem(last=False)
    return plan._launch(q, k_cache, v_cache, out, fresh_scratch=True)


_PLANS: OrderedDict = OrderedDict()  # paged_decode's plans without device reads, least recently used first
_PLANS_MAX = 64


def _scale_key(value):
    return ("ptr", value.data_ptr(), value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else value
