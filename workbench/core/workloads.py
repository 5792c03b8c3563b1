"""Decode-attention workloads W1-W5 (``docs/workloads.md``) and the fragmented paged caches they run on.

A :class:`Workload` is data: batch, context (fixed, or seeded uniform lengths for a ragged
batch), heads and head_dim. :func:`build_paged` turns one into a paged K/V cache in any
layout, page size and dtype, with pages handed out by a random permutation of the pool
(a fragmented pool) and an optional padded or misaligned block stride;
:func:`contiguous_kv` gathers the same values into the "traditional" ``[B, Hkv, L, D]``
layout for peers and references; :func:`bytes_moved` is the traffic a decode step cannot
avoid. Reusable by any benchmark that needs a paged cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from workbench.core.layout import Layout, block_shape, to_nhd


@dataclass(frozen=True)
class Workload:
    """One decode step: ``batch`` sequences, one query token each.

    Attributes:
        key: short id (``W1``..``W5``).
        name: descriptive name.
        batch: sequences.
        context: tokens per sequence, or the largest length of a ragged batch.
        num_q_heads, num_kv_heads, head_dim: attention shape (GQA when q heads > kv heads).
        min_context: ragged batch: lengths uniform in ``[min_context, context]`` (seeded).
        seed: seed of the ragged lengths.
    """

    key: str
    name: str
    batch: int
    context: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int = 128
    min_context: int | None = None
    seed: int = 0

    @property
    def ragged(self) -> bool:
        return self.min_context is not None

    def seq_lens(self) -> list[int]:
        """Context length of every sequence."""
        if not self.ragged:
            return [self.context] * self.batch
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(self.min_context, self.context + 1, (self.batch,), generator=g).tolist()

    def smoke(self) -> Workload:
        """A tiny version with the same character (GQA or MHA, fixed or ragged), for the interpreter."""
        heads_kv = 2
        group = self.num_q_heads // self.num_kv_heads
        return replace(self, batch=min(self.batch, 3), context=max(8, min(self.context // 64 + 5, 70)),
                       min_context=None if not self.ragged else 1, num_kv_heads=heads_kv,
                       num_q_heads=heads_kv * group, head_dim=64)


WORKLOADS: dict[str, Workload] = {
    w.key: w
    for w in [
        Workload("W1", "gqa-b64-l4k", 64, 4096, 32, 8),
        Workload("W2", "gqa-b8-l32k", 8, 32768, 32, 8),
        Workload("W3", "gqa-b256-l512", 256, 512, 32, 8),
        Workload("W4", "mha-b32-l2k", 32, 2048, 32, 32),
        Workload("W5", "gqa-b64-mixed", 64, 8192, 32, 8, min_context=128, seed=5),
    ]
}


@dataclass
class PagedKV:
    """A decode problem on a paged cache (all tensors on one device)."""

    q: torch.Tensor  # [B, Hq, D]
    k_cache: torch.Tensor  # layout-shaped, possibly with a padded block stride
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks] int32; unused entries 0
    seq_lens: torch.Tensor  # [B] int32
    lens: list[int]
    layout: Layout
    block_size: int
    blocks_per_seq: list[int]

    @property
    def max_seq_len(self) -> int:
        return max(self.lens, default=0)


def _strided_cache(num_blocks: int, shape: tuple[int, ...], dtype, device, pad: int, g) -> torch.Tensor:
    """Random normal blocks of ``shape``, consecutive blocks ``prod(shape) + pad`` elements apart."""
    per = math.prod(shape)
    stride0 = per + pad
    store = torch.empty(num_blocks * stride0, dtype=dtype, device=device)
    if dtype.itemsize == 1:  # fp8 has no normal_: draw in fp16, convert in slices to bound memory
        step = 1 << 26
        for i in range(0, store.numel(), step):
            n = min(step, store.numel() - i)
            store[i : i + n] = torch.randn(n, generator=g, device=device, dtype=torch.float16).to(dtype)
    else:
        store.normal_(generator=g)
    inner = torch.empty(shape, device="meta").stride()
    return store.as_strided((num_blocks, *shape), (stride0, *inner))


def build_paged(
    w: Workload,
    *,
    layout: Layout | str = "nhd",
    block_size: int = 16,
    kv_dtype: torch.dtype = torch.float16,
    q_dtype: torch.dtype | None = None,
    device: torch.device | str = "cuda",
    block_stride_pad: int = 0,
    spare_blocks: int = 0,
    seed: int = 0,
) -> PagedKV:
    """A fragmented paged K/V cache for ``w``, random normal data.

    Args:
        w: the workload.
        layout: storage layout (``workbench.core.layout``).
        block_size: tokens per block.
        kv_dtype: storage dtype (fp8 allowed; its values are then normal draws rounded to fp8).
        q_dtype: query dtype, default ``kv_dtype`` (fp16 for 1-byte caches).
        device: where to put everything.
        block_stride_pad: extra elements between consecutive blocks (0: packed; 64 keeps fp16
            blocks 128-byte aligned; 1 or 8 misalign them).
        spare_blocks: unused blocks in the pool besides the ones the sequences need.
        seed: data and permutation seed.
    """
    layout = Layout.parse(layout)
    device = torch.device(device)
    q_dtype = q_dtype or (torch.float16 if kv_dtype.itemsize == 1 else kv_dtype)
    lens = w.seq_lens()
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + spare_blocks
    g_cpu = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g_cpu).to(torch.int32)
    table = torch.zeros((w.batch, max(per_seq, default=0)), dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[used : used + n]
        used += n
    g = torch.Generator(device=device).manual_seed(seed + 1)
    caches = []
    for kind in ("k", "v"):
        shape = block_shape(layout, kind, block_size, w.num_kv_heads, w.head_dim, kv_dtype.itemsize)
        caches.append(_strided_cache(num_blocks, shape, kv_dtype, device, block_stride_pad, g))
    q = torch.randn(w.batch, w.num_q_heads, w.head_dim, generator=g, device=device).to(q_dtype)
    return PagedKV(q, caches[0], caches[1], table.to(device), torch.tensor(lens, dtype=torch.int32, device=device),
                   lens, layout, block_size, per_seq)


def contiguous_kv(p: PagedKV, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K and V as ``[B, Hkv, max_len, D]`` contiguous tensors (zeros past each length)."""
    out = []
    for cache, kind in ((p.k_cache, "k"), (p.v_cache, "v")):
        nhd = to_nhd(cache, p.layout, kind)  # [blocks, bs, H, D] (a copy for the split key)
        B, nblk = p.block_table.shape
        x = nhd[p.block_table.long()]  # [B, nblk, bs, H, D]
        x = x.reshape(B, nblk * p.block_size, *x.shape[3:])[:, : p.max_seq_len]
        x = x.to(dtype or p.q.dtype).permute(0, 2, 1, 3).contiguous()  # [B, H, L, D]
        for b, n in enumerate(p.lens):
            if n < p.max_seq_len:
                x[b, :, n:] = 0
        out.append(x)
    return out[0], out[1]


def bytes_moved(w: Workload, kv_elem: float, q_elem: float = 2) -> int:
    """Bytes a decode step must move: every cached K and V element once, plus q and out."""
    kv = sum(w.seq_lens()) * w.num_kv_heads * w.head_dim * 2 * kv_elem
    return int(kv + 2 * w.batch * w.num_q_heads * w.head_dim * q_elem)
