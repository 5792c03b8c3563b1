"""Storage layouts of one K or V cache tensor, and the address arithmetic kernels use.

Three layouts, each a tensor whose first dimension is the physical block:

- ``NHD``  ``[blocks, block_size, kv_heads, head_dim]`` (vLLM flash layout, FlashInfer NHD)
- ``HND``  ``[blocks, kv_heads, block_size, head_dim]`` (FlashInfer HND)
- ``VLLM`` vLLM's legacy split layout: key ``[blocks, kv_heads, head_dim // x, block_size, x]``
  with ``x = 16 // elem_size`` (16 bytes of one token's key together), value
  ``[blocks, kv_heads, head_dim, block_size]`` (tokens contiguous per channel).

Every kernel addresses element ``(block, token, head, d)`` of any layout as::

    block * s_blk + token * s_tok + head * s_head + (d // x) * s_dgrp + (d % x) * s_d

For NHD and HND ``x == head_dim`` (so ``d // x == 0``); for the split key ``x`` is the split.
:func:`addressing` reads these numbers off a tensor's real strides, so padded block
strides (128-byte alignment) come for free.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

import torch


class Layout(StrEnum):
    NHD = "nhd"
    HND = "hnd"
    VLLM = "vllm"

    @classmethod
    def parse(cls, value: Layout | str) -> Layout:
        try:
            return cls(value.value if isinstance(value, Layout) else str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"layout must be one of {names}, got {value!r}") from None


KINDS = ("k", "v")


class Addressing(NamedTuple):
    """Element strides of ``(block, token, head, d // x, d % x)``; see the module docstring."""

    s_blk: int
    s_tok: int
    s_head: int
    s_dgrp: int
    s_d: int
    x: int


def split_x(elem_size: int) -> int:
    """vLLM's key split: the number of elements in 16 bytes."""
    return max(1, 16 // elem_size)


def _check(layout: Layout, kind: str, head_dim: int, elem_size: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    if layout is Layout.VLLM and kind == "k" and head_dim % split_x(elem_size):
        raise ValueError(
            f"head_dim={head_dim} must be a multiple of x={split_x(elem_size)} for the vllm key layout"
        )


def block_shape(
    layout: Layout | str, kind: str, block_size: int, num_heads: int, head_dim: int, elem_size: int
) -> tuple[int, ...]:
    """Shape of one block (without the leading blocks dimension)."""
    layout = Layout.parse(layout)
    _check(layout, kind, head_dim, elem_size)
    if layout is Layout.NHD:
        return (block_size, num_heads, head_dim)
    if layout is Layout.HND:
        return (num_heads, block_size, head_dim)
    if kind == "k":
        x = split_x(elem_size)
        return (num_heads, head_dim // x, block_size, x)
    return (num_heads, head_dim, block_size)


def to_nhd(cache: torch.Tensor, layout: Layout | str, kind: str) -> torch.Tensor:
    """View (or, for the split key, copy) a cache as ``[blocks, block_size, heads, head_dim]``."""
    layout = Layout.parse(layout)
    if layout is Layout.NHD:
        return cache
    if layout is Layout.HND:
        return cache.permute(0, 2, 1, 3)
    if kind == "k":
        nb, h, dg, bs, x = cache.shape
        return cache.permute(0, 3, 1, 2, 4).reshape(nb, bs, h, dg * x)
    return cache.permute(0, 3, 1, 2)


def from_nhd(nhd: torch.Tensor, layout: Layout | str, kind: str) -> torch.Tensor:
    """A contiguous tensor in ``layout`` holding the same values as the NHD tensor ``nhd``."""
    layout = Layout.parse(layout)
    nb, bs, h, d = nhd.shape
    _check(layout, kind, d, nhd.element_size())
    if layout is Layout.NHD:
        return nhd.contiguous()
    if layout is Layout.HND:
        return nhd.permute(0, 2, 1, 3).contiguous()
    if kind == "k":
        x = split_x(nhd.element_size())
        return nhd.reshape(nb, bs, h, d // x, x).permute(0, 2, 3, 1, 4).contiguous()
    return nhd.permute(0, 2, 3, 1).contiguous()


def addressing(cache: torch.Tensor, layout: Layout | str, kind: str) -> Addressing:
    """Strides for the kernels' address formula, read off the tensor itself."""
    layout = Layout.parse(layout)
    st = cache.stride()
    if layout is Layout.NHD:
        d = cache.shape[3]
        return Addressing(st[0], st[1], st[2], d * st[3], st[3], d)
    if layout is Layout.HND:
        d = cache.shape[3]
        return Addressing(st[0], st[2], st[1], d * st[3], st[3], d)
    if kind == "k":
        return Addressing(st[0], st[3], st[1], st[2], st[4], cache.shape[4])
    d = cache.shape[2]
    return Addressing(st[0], st[3], st[1], d * st[2], st[2], d)


def block_view(
    plane: torch.Tensor, layout: Layout | str, kind: str, block_size: int, num_heads: int, head_dim: int
) -> torch.Tensor:
    """View a ``[num_blocks, block_stride]`` plane (each block contiguous, the stride possibly padded)
    as ``[num_blocks, *block_shape]`` in ``layout``: one layer's K (or V) cache, as kernels take it."""
    if plane.dim() != 2 or plane.stride(1) != 1:
        raise ValueError(f"plane must be a 2-D [num_blocks, block_stride] view with unit inner stride, "
                         f"got shape {tuple(plane.shape)} strides {plane.stride()}")
    shape = block_shape(layout, kind, block_size, num_heads, head_dim, plane.element_size())
    inner = torch.empty(shape, device="meta").stride()
    if plane.shape[1] < (shape[0] * inner[0] if shape else 1):
        raise ValueError(f"plane rows of {plane.shape[1]} elements cannot hold a block of shape {shape}")
    return plane.as_strided((plane.shape[0], *shape), (plane.stride(0), *inner), plane.storage_offset())
