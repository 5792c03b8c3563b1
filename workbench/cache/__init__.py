"""The paged KV cache: K/V of every layer in paged storage, placed by the allocator (``workbench.allocator``).

:class:`PagedKVCache` (``paged.py``) is what users build; its parts sit below it and do not know it:

- ``storage.py``: the one buffer of every layer's K and V, 128-byte aligned, and each size class's block views.
- ``ops.py``: the ops backends, the Triton kernels or their PyTorch references (``ops="kernels"`` / ``"torch"``):
  one object each with the same methods (write, block copy, key bounds, decode, a step's plan), chosen once.
- ``write_checks.py``: what a K/V write must satisfy, checked before the tables change.
- ``residual.py``: KIVI's fp16 residual (each sequence's newest tokens, outside the blocks).
- ``bounds.py``: per-block key bounds for Quest page selection (``key_bounds=True``).
- ``exports.py``: vLLM's and FlashInfer's page tables for a batch, K/V read back out.
- ``step.py``: :class:`DecodeStep`, one decode step of a batch layer by layer (``PagedKVCache.begin_step``).
- ``compaction.py``: compaction of a live cache (block moves planned on a clone of the allocator, K/V copied, the
  tables swapped in atomically): it takes a cache and is imported by no part of it.
"""

from workbench.cache.exports import FlashInferMetadata, VllmMetadata
from workbench.cache.paged import PagedKVCache
from workbench.cache.step import DecodeStep
from workbench.cache.storage import ALIGN

__all__ = ["ALIGN", "DecodeStep", "FlashInferMetadata", "PagedKVCache", "VllmMetadata"]
