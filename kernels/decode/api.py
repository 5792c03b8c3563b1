"""``paged_decode``, the one-shot entry point: plan-then-run, with a cache of plans that need no device read."""

from __future__ import annotations

from collections import OrderedDict

import torch

from workbench.core.layout import Layout

from .. import common
from ..validate import capturing
from . import config
from .checks import _check_inputs
from .plan import DecodePlan


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
        k_cache: one layer's K cache in ``layout`` (``workbench.core.layout``), dtype q's or fp8
            (e4m3fn / e5m2); any block stride (padded blocks are fine), unit stride inside a row.
        v_cache: the V cache, same layout and dtype.
        layout: ``"nhd"``, ``"hnd"`` or ``"vllm"``.
        block_table: ``[B, max_blocks]`` int32, physical block of each logical block.
        seq_lens: ``[B]`` int32 context lengths (ragged; 0 gives zeros).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        num_splits: split-KV chunks per sequence; ``None`` asks :func:`decode_config`.
        out: optional ``[B, Hq, D]`` output buffer (q's dtype).
        k_scale, v_scale: static dequantization scales (read = stored * scale) of fp8 / int8 caches: floats,
            or fp32 tensors of one value or one per kv head (no host sync); default 1.
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
        **launch: ``quant``: the ``workbench.quant`` scheme (name or object) of a cache whose scales live in its
            blocks (``"fp8_e4m3/token"``, ``"int8_asym/token"``, ``"int4/kivi"``, ...; the dtype alone says fp16 /
            bf16 / fp32 / static fp8 and int8); and overrides of :func:`decode_config`: ``BLOCK_N``, ``num_warps``, ``num_stages``,
            ``use_dot``; ``k3d`` (default True): the vLLM split key read in page runs (see
            ``_attend_tile``), False reads ``[BLOCK_N, D]`` tiles (lanes along d, slower); and ``planes``: packed int4 / int2
            group codes through the planes kernel (``kernels/decode/groups.py``) where it applies
            (``plan.config["kernel"]`` says which ran); default False, the generic kernel, until the H200 has timed
            both (``bench quant_decode`` runs them side by side).

    Returns:
        ``[B, Hq, D]`` in q's dtype.
    """
    layout = Layout.parse(layout)
    scheme = common.scheme_of(k_cache.dtype, launch.get("quant")) if isinstance(k_cache, torch.Tensor) else None
    B, Hq, D, hkv, block_size = _check_inputs(q, k_cache, v_cache, layout, block_table, seq_lens, out, scheme)
    key = None
    if max_seq_len is not None and not (validate and not capturing(q)):
        # nothing to read on the device: the plan depends on metadata only, so it is cached on it (the table and
        # lengths by address: the cached plan keeps them alive, so an address names the same memory)
        key = (layout, q.dtype, q.device, B, Hq, k_cache.dtype, tuple(k_cache.shape), k_cache.stride(),
               tuple(v_cache.shape), v_cache.stride(), block_table.data_ptr(), tuple(block_table.shape),
               block_table.stride(0), seq_lens.data_ptr(), max_seq_len, config.mean_key(mean_seq_len), num_splits,
               _scale_key(k_scale), _scale_key(v_scale), sm_scale,
               tuple(sorted((k, str(v)) for k, v in launch.items())) if launch else ())
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
