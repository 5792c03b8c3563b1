"""Where a quantized block keeps its scales: inside the block, after its codes.

A block of a scheme whose scales are computed on write (the ``token`` and ``groups`` families) is
``[codes][pad to 16 bytes][scales][zero points]``: the codes in the cache's layout (``workbench.core.layout``,
``head_dim`` replaced by :func:`code_dim` bytes for packed codes), then the scale array, indexed ``[groups of
tokens, kv heads, groups of channels]`` and stored head-major (``[heads, token groups, channel groups]`` in memory,
:attr:`BlockScales.strides`), and, for asymmetric schemes, the zero points in the same shape. The family says
which array a block of each kind holds (:meth:`Scheme.block_scales`). Every copy of a block (copy-on-write,
compaction, a swap to another tier) moves whole blocks, so the scales travel with their codes without anyone asking.

Scale element ``(token t, head h, channel d)`` of block ``b`` sits at scale-element index
``b * block_stride / itemsize + offset / itemsize + (t // tokens_per_group) * s_tg + h * s_h + d // channels_per_group``
with ``(s_tg, s_h) = (channel groups, token groups * channel groups)``.
"""

from __future__ import annotations

import torch

from workbench.core.layout import block_view

from .families import SCALE_ALIGN, BlockScales, Scheme

__all__ = ["SCALE_ALIGN", "BlockScales", "block_bytes", "block_scales", "block_stride_bytes", "code_bytes", "code_dim",
           "empty_cache", "plane_of", "scale_views"]


def code_dim(scheme: Scheme, head_dim: int) -> int:
    """Stored elements per token-head row: ``head_dim``, or its packed bytes (:meth:`Scheme.code_dim`)."""
    return scheme.code_dim(head_dim)


def code_bytes(scheme: Scheme, block_size: int, num_heads: int, head_dim: int) -> int:
    return block_size * num_heads * scheme.code_dim(head_dim) * scheme.format.storage.itemsize


def block_scales(scheme: Scheme, kind: str, block_size: int, num_heads: int, head_dim: int) -> BlockScales | None:
    """The scale array of a block of ``block_size`` tokens, or None when the scheme keeps none in blocks
    (:meth:`Scheme.block_scales`: the family's layout)."""
    return scheme.block_scales(kind, block_size, num_heads, head_dim)


def block_bytes(scheme: Scheme, block_size: int, num_heads: int, head_dim: int) -> int:
    """Bytes a block of either kind needs, codes and scales (the larger of K's and V's)."""
    out = code_bytes(scheme, block_size, num_heads, head_dim)
    for kind in ("k", "v"):
        sc = block_scales(scheme, kind, block_size, num_heads, head_dim)
        if sc is not None:
            out = max(out, sc.end)
    return out


def scale_views(blocks: torch.Tensor, scales: BlockScales) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scale, zero)`` views ``[num_blocks, token groups, heads, channel groups]`` of a ``[num_blocks,
    block_stride]`` plane of one kind (the cache's ``blocks(bs)[layer, kind]``), for tests and exports."""
    raw = blocks.view(torch.uint8) if blocks.dtype != torch.uint8 else blocks
    if raw.stride(1) != 1:
        raise ValueError("blocks must be a [num_blocks, block_stride] plane with unit inner stride")
    stride_bytes = raw.stride(0)
    item = scales.dtype.itemsize
    if stride_bytes % item or scales.offset % item or raw.storage_offset() % item:
        raise ValueError(f"blocks are not aligned to {item}-byte scales")
    typed = torch.empty(0, dtype=scales.dtype, device=raw.device).set_(raw.untyped_storage())
    n = raw.shape[0]
    shape = (n, *scales.groups)
    strides = (stride_bytes // item, *scales.strides)
    base = (raw.storage_offset() + scales.offset) // item
    scale = typed.as_strided(shape, strides, base)
    zero = typed.as_strided(shape, strides, base + scales.count) if scales.has_zero else None
    return scale, zero


def block_stride_bytes(scheme: Scheme, block_size: int, num_heads: int, head_dim: int, align: int = 128) -> int:
    """A block's stride when it is allocated on its own: its bytes, codes and scales, rounded up to ``align``."""
    return -(-block_bytes(scheme, block_size, num_heads, head_dim) // align) * align


def empty_cache(scheme: Scheme, layout, kind: str, num_blocks: int, block_size: int, num_heads: int, head_dim: int,
                device=None, fill: int | None = None) -> torch.Tensor:
    """One layer's K (or V) cache for ``scheme`` outside a ``PagedKVCache``: ``[num_blocks, *block_shape]`` in
    ``layout`` over blocks with room for their scales (benchmarks, tests). ``fill``: every byte set to it (a
    poisoned pool); default uninitialised."""
    dtype = scheme.format.storage
    stride = block_stride_bytes(scheme, block_size, num_heads, head_dim) // dtype.itemsize
    plane = torch.empty((num_blocks, stride), dtype=dtype, device=device)
    if fill is not None:
        plane.view(torch.uint8).fill_(fill)
    return block_view(plane, layout, kind, block_size, num_heads, code_dim(scheme, head_dim))


def plane_of(cache: torch.Tensor) -> torch.Tensor:
    """The ``[num_blocks, block_stride]`` plane under a layout view of blocks (``empty_cache``, ``k_cache``). Rows
    of planes that interleave (a tier's staging: block ``i``'s K row, then its V row) are cut where the storage
    ends: only their starts and the stride matter to the scale views."""
    n, stride = cache.shape[0], cache.stride(0)
    room = cache.untyped_storage().nbytes() // cache.element_size() - cache.storage_offset() - (n - 1) * stride
    return cache.as_strided((n, min(stride, room)), (stride, 1))
