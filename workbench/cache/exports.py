"""What the cache hands out: vLLM's and FlashInfer's page tables for a batch of sequences (from the allocator's
tables), and K/V read back out of the storage, contiguous (the gather kernel) or as attention reads it
(dequantized by the PyTorch references, for checks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workbench.allocator import BlockManager
from workbench.cache.storage import Storage
from workbench.kernels import paged_gather
from workbench.kernels.gather.reference import paged_gather_ref
from workbench.kernels.write.reference import dequantize_cache_ref


@dataclass(frozen=True)
class VllmMetadata:
    """vLLM's paged-attention inputs for a batch of sequences (all int32)."""

    block_table: torch.Tensor  # [B, max_blocks + pad_blocks], padded with 0 (a valid id, never read past seq_lens)
    seq_lens: torch.Tensor  # [B]
    block_size: int


@dataclass(frozen=True)
class FlashInferMetadata:
    """FlashInfer's CSR page table for a batch of sequences (all int32)."""

    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [nnz] physical pages of every sequence, in order
    kv_last_page_len: torch.Tensor  # [B] tokens in each sequence's last page (1..page_size)
    page_size: int


def batch_block_size(manager: BlockManager, seq_ids: Sequence) -> int:
    """The one block size of a batch's sequences (ValueError for an empty batch or two sizes)."""
    if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence) or not seq_ids:
        raise ValueError(f"seq_ids must be a non-empty list of sequence ids, got {seq_ids!r}")
    sizes = {manager.block_size(s) for s in seq_ids}
    if len(sizes) > 1:
        raise ValueError(f"seq_ids must share one block size for a single batch, got sizes {sorted(sizes)}")
    return sizes.pop()


def vllm_metadata(manager: BlockManager, seq_ids: Sequence, device, pad_blocks: int = 0) -> VllmMetadata:
    """Block table and lengths; ``pad_blocks`` extra zero columns on the right, as vLLM's own tables carry (its
    unified Triton kernel reads table entries a tile past a sequence's end)."""
    if isinstance(pad_blocks, bool) or not isinstance(pad_blocks, int) or pad_blocks < 0:
        raise ValueError(f"pad_blocks must be an int >= 0, got {pad_blocks!r}")
    bs = batch_block_size(manager, seq_ids)
    tables = [manager.block_table(s) for s in seq_ids]
    width = max(1, max(len(t) for t in tables)) + pad_blocks
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # one host->tensor copy
    lens = torch.tensor([manager.num_tokens(s) for s in seq_ids], dtype=torch.int32)
    return VllmMetadata(table.to(device), lens.to(device), bs)


def flashinfer_metadata(manager: BlockManager, seq_ids: Sequence, device) -> FlashInferMetadata:
    bs = batch_block_size(manager, seq_ids)
    tables = [manager.block_table(s) for s in seq_ids]
    indptr = torch.tensor([0, *torch.tensor([len(t) for t in tables]).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.tensor([b for t in tables for b in t], dtype=torch.int32)
    last = torch.tensor([(n - 1) % bs + 1 for n in map(manager.num_tokens, seq_ids)],
                        dtype=torch.int32)  # 1..page_size: a sequence holds at least one token
    return FlashInferMetadata(indptr.to(device), indices.to(device), last.to(device), bs)


def gather_kv(st: Storage, block_size: int, blocks: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of ``num_tokens`` tokens in ``blocks``, contiguous: each ``[num_layers, tokens, heads, D]``
    (the gather kernel: codes as stored)."""
    dev = st.flat.device
    table = torch.tensor([blocks], dtype=torch.int32, device=dev)
    if table.shape[1] == 0:
        table = torch.zeros((1, 1), dtype=torch.int32, device=dev)
    lens = torch.tensor([num_tokens], dtype=torch.int32, device=dev)
    layers = range(st.num_layers)
    ks = [paged_gather(st.plane_view(layer, 0, block_size), st.layout, "k", table, lens) for layer in layers]
    vs = [paged_gather(st.plane_view(layer, 1, block_size), st.layout, "v", table, lens) for layer in layers]
    return torch.stack(ks), torch.stack(vs)


def read_kv(st: Storage, layer_scales: Callable[[int], tuple], block_size: int, blocks: list[int], num_tokens: int,
            residual) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as attention reads them, fp32 ``[num_layers, tokens, heads, head_dim]``: the codes of the first
    ``num_tokens`` tokens in ``blocks`` dequantized with the blocks' scales, times each layer's static scales
    (``layer_scales(layer)``), then the fp16 ``residual`` ``(k, v)`` if any (PyTorch, for checks)."""
    dev = st.flat.device
    table = torch.tensor([blocks or [0]], dtype=torch.int32, device=dev)
    lens = torch.tensor([num_tokens], dtype=torch.int32, device=dev)
    out = []
    for i, kind in enumerate("kv"):
        layers = []
        for layer in range(st.num_layers):
            vals = dequantize_cache_ref(st.scheme, st.plane_view(layer, i, block_size), st.layout, kind, st.head_dim)
            x = paged_gather_ref(vals, "nhd", kind, table, lens)  # [n, H, D]
            scale = layer_scales(layer)[i]
            if scale is not None:
                x = x * scale.reshape(1, -1, 1)
            layers.append(x)
        x = torch.stack(layers)
        if residual is not None:
            x = torch.cat([x, residual[i].float()], 1)
        out.append(x)
    return out[0], out[1]
