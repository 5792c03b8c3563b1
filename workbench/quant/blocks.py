"""Where a quantized block keeps its scales: inside the block, after its codes.

A block of a ``token`` or ``group`` scheme is ``[codes][pad to 16 bytes][scales][zero points]``: the codes
in the cache's layout (``workbench.layout``, ``head_dim`` replaced by :func:`code_dim` bytes for packed
codes), then the scale array, indexed ``[groups of tokens, kv heads, groups of channels]`` and stored
head-major (``[heads, token groups, channel groups]`` in memory, :attr:`BlockScales.strides`), and, for asymmetric
schemes, the zero points in the same shape. Every copy of a block (copy-on-write, compaction, a swap to
another tier) moves whole blocks, so the scales travel with their codes without anyone asking.

Scale element ``(token t, head h, channel d)`` of block ``b`` sits at scale-element index
``b * block_stride / itemsize + offset / itemsize + (t // tokens_per_group) * s_tg + h * s_h + d // channels_per_group``
with ``(s_tg, s_h) = (channel groups, token groups * channel groups)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .schemes import Scheme

SCALE_ALIGN = 16  # bytes: the scale array starts on a 16-byte boundary after the codes


class BlockScales(NamedTuple):
    """The scale array of one block of one kind (K or V); element strides in units of ``dtype``."""

    offset: int  # bytes from the block's start to its first scale
    dtype: torch.dtype  # fp32 (token schemes) or fp16 (group schemes)
    tokens_per_group: int  # TG: 1 (one scale per token) or the key group (KIVI keys per channel)
    channels_per_group: int  # DG: head_dim (one scale per token-head), value_group, or 1 (per channel)
    groups: tuple[int, int, int]  # (token groups, heads, channel groups)
    has_zero: bool  # asymmetric: zero points follow the scales, same shape

    @property
    def count(self) -> int:
        n_tg, h, n_dg = self.groups
        return n_tg * h * n_dg

    @property
    def strides(self) -> tuple[int, int, int]:
        """Element strides of (token group, head, channel group): head-major, so the scales of one head's tokens
        are contiguous (a decode program reads one head)."""
        n_tg, _, n_dg = self.groups
        return n_dg, n_tg * n_dg, 1

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize * (2 if self.has_zero else 1)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def code_dim(scheme: Scheme, head_dim: int) -> int:
    """Stored elements per token-head row: ``head_dim``, or its packed bytes (``head_dim * bits // 8``)."""
    return head_dim * scheme.bits // 8 if scheme.packed else head_dim


def code_bytes(scheme: Scheme, block_size: int, num_heads: int, head_dim: int) -> int:
    return block_size * num_heads * code_dim(scheme, head_dim) * scheme.format.storage.itemsize


def block_scales(scheme: Scheme, kind: str, block_size: int, num_heads: int, head_dim: int) -> BlockScales | None:
    """The scale array of a block of ``block_size`` tokens, or None when the scheme keeps none in blocks."""
    if not scheme.scales_in_blocks:
        return None
    start = -(-code_bytes(scheme, block_size, num_heads, head_dim) // SCALE_ALIGN) * SCALE_ALIGN
    if scheme.granularity == "token":
        return BlockScales(start, torch.float32, 1, head_dim, (block_size, num_heads, 1), not scheme.symmetric)
    scheme.check_shape(num_heads, head_dim)
    if kind == "k" and scheme.key_mode == "channel":
        if block_size % scheme.group:
            raise ValueError(f"{scheme.name} groups keys over {scheme.group} tokens: the block size must be a "
                             f"multiple of it, got {block_size}")
        return BlockScales(start, torch.float16, scheme.group, 1, (block_size // scheme.group, num_heads, head_dim),
                           True)
    g = scheme.value_group
    return BlockScales(start, torch.float16, 1, g, (block_size, num_heads, head_dim // g), True)


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
    from workbench.layout import block_view

    dtype = scheme.format.storage
    stride = block_stride_bytes(scheme, block_size, num_heads, head_dim) // dtype.itemsize
    plane = torch.empty((num_blocks, stride), dtype=dtype, device=device)
    if fill is not None:
        plane.view(torch.uint8).fill_(fill)
    return block_view(plane, layout, kind, block_size, num_heads, code_dim(scheme, head_dim))


def plane_of(cache: torch.Tensor) -> torch.Tensor:
    """The ``[num_blocks, block_stride]`` plane under a layout view of blocks (``empty_cache``, ``k_cache``)."""
    return cache.as_strided((cache.shape[0], cache.stride(0)), (cache.stride(0), 1))
