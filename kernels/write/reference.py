"""Plain PyTorch references of the write kernels: slow, obvious, and the ground truth in tests.

The codes ``write_kv`` stores (:func:`quantize_ref`, :func:`quantize_rcp_ref`, :func:`write_kv_ref`) and, for
schemes with scales computed on write, their scales in the blocks (:func:`write_cache_ref`); and the inverse,
the values a cache's blocks hold (:func:`dequantize_cache_ref`). That one lives here, with the storage it reads,
though the decode and Quest key-bounds references build on it: what a block holds is the write's convention.
:func:`quant_code_distance` compares two writes' codes.
"""

from __future__ import annotations

import torch

from workbench.core import kv_formats
from workbench.core.layout import Layout, to_nhd
from workbench.quant import blocks as qblocks


def quantize_ref(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Storage codes of ``x`` ``[T, H, D]`` in ``dtype``, as :func:`write_kv_ref` stores them.

    fp32/fp16/bf16: a plain cast. fp8: ``fp8(clamp(x / scale, -max, max))`` (vLLM's convention,
    saturating). int8: ``clamp(round_half_even(x / scale), -128, 127)``. ``scale`` is fp32 with one
    element (per tensor) or ``[H]`` (per kv head).
    """
    fmt = kv_formats.get(dtype)
    if not fmt.quantized:
        return x.to(dtype)
    # on x's device: a GPU divides by a CPU scalar as a multiply by its reciprocal (quant.families.common.div)
    s = (scale.reshape(()) if scale.numel() == 1 else scale.reshape(1, -1, 1)).to(x.device)
    q = x.float() / s
    if fmt.codes == "int":
        return q.clamp(fmt.qmin, fmt.qmax).round().to(dtype)
    return q.clamp(fmt.qmin, fmt.qmax).to(dtype)


def quantize_rcp_ref(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """Codes of ``x`` ``[T, H, D]`` as ``write_kv(..., quant_math="rcp")`` stores them: like
    :func:`quantize_ref` but ``x * (1 / scale)`` (the reciprocal rounded to fp32 once) instead of
    ``x / scale``, so a code can differ from :func:`quantize_ref`'s by one near a midpoint."""
    s = scale.reshape(()) if scale.numel() == 1 else scale.reshape(1, -1, 1)
    q = x.float() * (1.0 / s.float())
    fmt = kv_formats.get(dtype)
    if fmt.codes == "int":
        return q.clamp(fmt.qmin, fmt.qmax).round().to(dtype)
    return q.clamp(fmt.qmin, fmt.qmax).to(dtype)


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: Layout | str,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write token ``t`` of ``key``/``value`` ``[T, H, D]`` to slot ``slot_mapping[t]``, in place.

    Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; ``-1`` skips the token.
    Values are stored as :func:`quantize_ref` gives them.
    """
    layout = Layout.parse(layout)
    block_size = to_nhd(v_cache[:0], layout, "v").shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    for src, cache, kind, scale in ((key, k_cache, "k", k_scale), (value, v_cache, "v", v_scale)):
        _place_rows(cache, layout, kind, blk, off, quantize_ref(src[keep], cache.dtype, scale))


def _place_rows(cache: torch.Tensor, layout: Layout, kind: str, blk, off, q: torch.Tensor) -> None:
    """Store rows ``q`` ``[T, H, DC]`` (codes) at blocks ``blk``, offsets ``off`` of a cache in ``layout``."""
    if layout is Layout.NHD:
        cache[blk, off] = q
    elif layout is Layout.HND:
        cache[blk, :, off] = q  # advanced indices first: [T', H, D]
    elif kind == "k":
        cache[blk, :, :, off] = q.reshape(*q.shape[:2], cache.shape[2], cache.shape[4])  # [T', H, D/x, x]
    else:
        cache[blk, :, :, off] = q  # [T', H, D]


def write_cache_ref(scheme, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    layout: Layout | str, slot_mapping: torch.Tensor, k_scale=None, v_scale=None) -> None:
    """``write_kv(..., quant=scheme)`` in PyTorch: the codes of ``key``/``value`` ``[T, H, D]`` and (``token`` and
    ``group`` schemes) their scales into the blocks (``workbench.quant.blocks``), as ``scheme.quantize`` gives
    them. A group of keys quantized per channel must lie in consecutive slots of one block, as for the kernel."""
    if not scheme.scales_on_write:
        write_kv_ref(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale)
        return
    layout = Layout.parse(layout)
    bs = to_nhd(v_cache[:0], layout, "v").shape[1]
    slots = slot_mapping.long()
    blk, off = slots // bs, slots % bs
    whole = scheme.without_residual()  # the caller chose the tokens to store
    D = key.shape[-1]
    for src, cache, kind in ((key, k_cache, "k"), (value, v_cache, "v")):
        qz = whole.quantize(src, kind)
        _place_rows(cache, layout, kind, blk, off, qz.codes.to(cache.dtype) if qz.codes.dtype != cache.dtype
                    else qz.codes)
        sc = qblocks.block_scales(scheme, kind, bs, src.shape[1], D)
        scale, zero = qblocks.scale_views(qblocks.plane_of(cache), sc)  # [nb, token groups, H, channel groups]
        g = sc.tokens_per_group
        b_g, t_g = blk[::g], off[::g] // g  # one scale row per group of g tokens (its first slot)
        rows = qz.scale.reshape(b_g.shape[0], src.shape[1], -1)  # [groups, H, channel groups]
        scale[b_g, t_g] = rows.to(scale.dtype)
        if zero is not None:
            zero[b_g, t_g] = qz.zero.reshape(rows.shape).to(zero.dtype)


def dequantize_cache_ref(scheme, cache: torch.Tensor, layout: Layout | str, kind: str, head_dim: int) -> torch.Tensor:
    """Values of every slot of a quantized cache as fp32 NHD ``[num_blocks, block_size, heads, head_dim]``:
    codes read in ``layout`` and scales from the blocks (``workbench.quant.blocks``), ``scheme``'s arithmetic."""
    nhd = to_nhd(cache, layout, kind)  # [nb, bs, H, DC]
    nb, bs, h, _ = nhd.shape
    sc = scheme.block_scales(kind, bs, h, head_dim)
    if sc is None:  # plain values, or codes whose static scales the caller applies
        return nhd.float()
    scale, zero = qblocks.scale_views(qblocks.plane_of(cache), sc)  # [nb, token groups, H, channel groups]
    codes = scheme.code_values(nhd).float()  # [nb, bs, H, D]
    tok = torch.arange(bs, device=cache.device) // sc.tokens_per_group
    ch = torch.arange(head_dim, device=cache.device) // sc.channels_per_group
    s = scale.float()[:, tok][..., ch]  # [nb, bs, H, D]
    out = codes * s
    if zero is not None:
        out = out + zero.float()[:, tok][..., ch]
    return out


def quant_code_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in codes between two 1-byte tensors (fp8 or int8) of the same shape, as int32.

    fp8 codes are sign-magnitude, so they are mapped to ordered integers first (+0 and -0 coincide).
    """

    def ordered(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.int8:
            return t.to(torch.int32)
        u = t.view(torch.uint8).to(torch.int32)
        mag = u & 0x7F
        return torch.where(u >= 0x80, -mag, mag)

    return (ordered(a) - ordered(b)).abs()
