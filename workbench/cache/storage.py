"""The cache's storage: one buffer holding K and V of every layer, and how a block of each size class is addressed.

The buffer is viewed as ``pool`` ``[num_layers, 2, num_pages, page_elems]`` (dim 1: 0 = K, 1 = V). A page of
``page_tokens`` token slots is carved into blocks of one size class (``workbench.allocator``); block ``b`` of size
class ``bs`` starts at element ``b * block_stride(bs)`` of a layer's K (or V) *plane*, and :meth:`Storage.k_cache`
views that plane in the chosen layout (``workbench.core.layout``) for the kernels.

Alignment: the pool starts on a 128-byte boundary and every block's stride is a multiple of 128 bytes, so each
block begins on its own L2 line / 128-byte transaction boundary. ``page_bytes`` is ``page_tokens * heads *
head_dim * elem_size`` rounded up to a multiple of ``128 * lcm(blocks per page)``; :attr:`Storage.padding_bytes`
says what that costs (zero for the usual shapes, where a token's K row is already a multiple of 128 bytes).
"""

from __future__ import annotations

import math

import torch

from workbench.allocator import BlockPool
from workbench.core.layout import Layout, block_shape, block_view
from workbench.kernels.common import check_kernel_shape
from workbench.quant import blocks as qblocks

ALIGN = 128  # bytes: one L2 line, one full coalesced warp transaction


class Storage:
    """The buffer and its addressing. Knows the allocator's pool (page tokens, size classes), not the cache.

    Args:
        block_pool: the allocator's pool: its pages, page tokens and block sizes are this buffer's.
        num_layers, num_kv_heads, head_dim: the model's KV shape.
        scheme: the ``workbench.quant`` scheme (codes and in-block scales per token).
        layout: the layout of every block.
        device: where the buffer lives.
        zero: fill it with zeros instead of ``torch.empty``.

    Raises ValueError naming the scheme, layout, shape and block size when a block cannot hold them.

    Attributes (elements are the storage dtype's): ``flat`` (the whole 1-D buffer, a few elements of alignment
    slack included), ``base`` (its first 128-byte aligned element: where ``pool`` starts), ``plane`` (elements of
    one layer's K or V: the stride between planes), ``pool``, ``code_dim``, ``token_bytes``, ``page_bytes``,
    ``page_elems``.
    """

    def __init__(self, block_pool: BlockPool, num_layers: int, num_kv_heads: int, head_dim: int, scheme,
                 layout: Layout, device: torch.device, zero: bool = False):
        self.block_pool = block_pool
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.scheme, self.layout = scheme, layout
        self.dtype = scheme.format.storage
        elem = self.dtype.itemsize
        sizes, page_tokens = block_pool.block_sizes, block_pool.page_tokens
        self.code_dim = qblocks.code_dim(scheme, head_dim)  # elements a row (packed codes: bytes)
        for bs in sizes:  # validates the scheme and layout against the shape early, naming both
            try:
                scheme.check_shape(num_kv_heads, head_dim)
                check_kernel_shape(scheme, head_dim)
                block_shape(layout, "k", bs, num_kv_heads, self.code_dim, elem)
                qblocks.block_bytes(scheme, bs, num_kv_heads, head_dim)
            except ValueError as e:
                raise ValueError(f"kv_dtype {scheme.name} cannot be stored in the {layout.value} layout with "
                                 f"{num_kv_heads} heads x {head_dim} dims, block size {bs}: {e}") from None
        self.token_bytes = num_kv_heads * self.code_dim * elem  # one token's K (or V) codes in one layer
        step = ALIGN * math.lcm(*(page_tokens // bs for bs in sizes))
        need = max(page_tokens // bs * qblocks.block_bytes(scheme, bs, num_kv_heads, head_dim)
                   for bs in sizes)  # codes and the blocks' scales
        self.page_bytes = -(-need // step) * step
        if self.page_bytes % elem:
            raise ValueError(f"page of {self.page_bytes} bytes is not a whole number of {self.dtype} elements")
        self.page_elems = self.page_bytes // elem
        num_pages = block_pool.num_pages
        self.plane = num_pages * self.page_elems  # one layer's K (or V)
        alloc = torch.zeros if zero else torch.empty
        self.flat = alloc(num_layers * 2 * self.plane + ALIGN // elem, dtype=self.dtype, device=device)
        self.base = (-self.flat.data_ptr() % ALIGN) // elem  # first 128-byte aligned element
        self.pool = self.flat.as_strided((num_layers, 2, num_pages, self.page_elems),
                                         (2 * self.plane, self.plane, self.page_elems, 1), self.base)

    def block_stride(self, block_size: int) -> int:
        """Elements from one block of this size class to the next (a multiple of 128 bytes)."""
        return self.page_elems // self.block_pool.blocks_per_page(block_size)

    @property
    def padding_bytes(self) -> dict[int, int]:
        """Per size class: bytes of alignment padding per block (K or V plane, one layer; scales not counted)."""
        return {bs: self.block_stride(bs) * self.dtype.itemsize
                - qblocks.block_bytes(self.scheme, bs, self.num_kv_heads, self.head_dim)
                for bs in self.block_pool.block_sizes}

    @property
    def total_bytes(self) -> int:
        return self.pool.numel() * self.dtype.itemsize

    def blocks(self, block_size: int) -> torch.Tensor:
        """The pool as ``[num_layers, 2, num_blocks, block_stride]`` for this size class (for block copies)."""
        stride = self.block_stride(block_size)
        n = self.block_pool.num_blocks(block_size)
        return self.flat.as_strided((self.num_layers, 2, n, stride), (2 * self.plane, self.plane, stride, 1),
                                    self.base)

    def plane_view(self, layer: int, kind: int, block_size: int) -> torch.Tensor:
        """Layer ``layer``'s K (``kind`` 0) or V (1) for one size class, in the layout: ``[num_blocks, *block]``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return block_view(self.blocks(block_size)[layer, kind], self.layout, "kv"[kind], block_size,
                          self.num_kv_heads, self.code_dim)

    def scales(self, layer: int, kind: str, block_size: int):
        """``(scale, zero)`` views ``[num_blocks, token groups, heads, channel groups]`` of the scales kept in the
        blocks of one layer and kind (``workbench.quant.blocks``); ``(None, None)`` for schemes without any."""
        if kind not in ("k", "v"):
            raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
        sc = qblocks.block_scales(self.scheme, kind, block_size, self.num_kv_heads, self.head_dim)
        if sc is None:
            return None, None
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return qblocks.scale_views(self.blocks(block_size)[layer, "kv".index(kind)], sc)
