"""The seed's sparse KV store: the entries a score threshold keeps, per (layer, kv head), in CSR form.

Row ``r = layer * Hkv + head`` holds the entries ``indptr[r] .. indptr[r + 1] - 1``: their token positions in
``indices`` (increasing within a row) and their key / value vectors in ``k`` / ``v``. This is FlashInfer's page-table
convention (``kv_indptr``, ``kv_indices``, int32) at token granularity. The store is not paged: an entry is a
``[D]`` vector, so memory is freed per entry, at the price of the indices (:meth:`CSRStore.nbytes` counts them).

    store = CSRStore.from_mask(k, v, mask)        # mask [L, Hkv, T]: the entries kept
    out = store.attention(q, sm_scale)            # [L, W, Hq, D], the queries at positions T-W .. T-1
    store.nbytes("fp16")                          # values + indices + indptr
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.core import kv_formats


@dataclass(frozen=True)
class CSRStore:
    """Kept K/V entries of one sequence, row ``layer * num_kv_heads + head``.

    Attributes:
        indptr: ``[L * Hkv + 1]`` int32, ``indptr[0] == 0``, non-decreasing, ``indptr[-1] == nnz``.
        indices: ``[nnz]`` int32 token positions in ``[0, num_tokens)``, increasing within a row.
        k, v: ``[nnz, D]`` the entries' key / value vectors (the dtype they were given in).
        num_tokens: ``T``, the dense sequence length.
        num_kv_heads: ``Hkv`` (``num_layers = (len(indptr) - 1) / Hkv``).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    num_tokens: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        nnz = self.indices.numel()
        if self.indptr.dim() != 1 or (self.indptr.numel() - 1) % self.num_kv_heads or self.indptr.numel() < 2:
            raise ValueError(f"indptr must be [L * Hkv + 1] with Hkv={self.num_kv_heads}, "
                             f"got {tuple(self.indptr.shape)}")
        if self.k.shape != self.v.shape or self.k.dim() != 2 or self.k.shape[0] != nnz:
            raise ValueError(f"k and v must be [nnz={nnz}, D], got {tuple(self.k.shape)} and {tuple(self.v.shape)}")
        if int(self.indptr[0]) != 0 or int(self.indptr[-1]) != nnz or bool((self.indptr.diff() < 0).any()):
            raise ValueError(f"indptr must start at 0, never decrease and end at nnz={nnz}")
        if nnz and (int(self.indices.min()) < 0 or int(self.indices.max()) >= self.num_tokens):
            raise ValueError(f"indices must be token positions in [0, {self.num_tokens})")

    @classmethod
    def from_mask(cls, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> CSRStore:
        """The entries of ``k``, ``v`` ``[L, T, Hkv, D]`` where ``mask`` ``[L, Hkv, T]`` (bool) is set."""
        L, T, H, _ = k.shape
        if v.shape != k.shape or mask.shape != (L, H, T) or mask.dtype != torch.bool:
            raise ValueError(f"need k, v [L, T, Hkv, D] and a bool mask [L, Hkv, T]; got {tuple(k.shape)}, "
                             f"{tuple(v.shape)}, {tuple(mask.shape)} {mask.dtype}")
        i_l, i_h, i_t = mask.nonzero(as_tuple=True)  # row-major: rows in order, tokens increasing within a row
        counts = mask.reshape(L * H, T).sum(-1)  # [L * Hkv]
        indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        return cls(indptr, i_t.to(torch.int32), k[i_l, i_t, i_h], v[i_l, i_t, i_h], T, H)

    @property
    def num_layers(self) -> int:
        return (self.indptr.numel() - 1) // self.num_kv_heads

    @property
    def nnz(self) -> int:
        return self.indices.numel()

    def mask(self) -> torch.Tensor:
        """``[L, Hkv, T]`` bool: which entries the store holds."""
        rows = self.indptr.numel() - 1
        i_r = torch.repeat_interleave(torch.arange(rows), self.indptr.diff().long())  # [nnz] row of each entry
        out = torch.zeros(rows, self.num_tokens, dtype=torch.bool)
        out[i_r, self.indices.long()] = True
        return out.reshape(self.num_layers, self.num_kv_heads, self.num_tokens)

    def to_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` ``[L, T, Hkv, D]`` with the held entries in place and zeros elsewhere."""
        L, H, T, D = self.num_layers, self.num_kv_heads, self.num_tokens, self.k.shape[1]
        rows = self.indptr.numel() - 1
        i_r = torch.repeat_interleave(torch.arange(rows), self.indptr.diff().long())
        k = self.k.new_zeros(L, T, H, D)
        v = self.v.new_zeros(L, T, H, D)
        k[i_r // H, self.indices.long(), i_r % H] = self.k
        v[i_r // H, self.indices.long(), i_r % H] = self.v
        return k, v

    def nbytes(self, kv_dtype: str = "fp16", index_bytes: int = 4) -> int:
        """Bytes of the store as a cache would hold it: K and V values in ``kv_dtype`` plus the int32 (by default)
        ``indices`` and ``indptr``."""
        return csr_nbytes(self.nnz, self.indptr.numel() - 1, self.k.shape[1], kv_dtype, index_bytes)

    def attention(self, q: torch.Tensor, sm_scale: float, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Softmax attention over the held entries only, row by row, in fp32.

        Args:
            q: ``[L, W, Hq, D]`` queries (query head ``i`` reads kv head ``i // (Hq / Hkv)``).
            sm_scale: the softmax scale.
            positions: ``[W]`` the queries' positions; a query sees entries at positions ``<= `` its own
                (default ``T - W .. T - 1``, the decode-like queries of an ``Observation``).

        Returns:
            ``[L, W, Hq, D]`` fp32; a query that sees no entry gets zeros.
        """
        L, W, Hq, D = q.shape
        H = self.num_kv_heads
        if L != self.num_layers or Hq % H or D != self.k.shape[1]:
            raise ValueError(f"q must be [L={self.num_layers}, W, Hkv * group, D={self.k.shape[1]}] with "
                             f"Hkv={H}, got {tuple(q.shape)}")
        G = Hq // H
        pos = torch.arange(self.num_tokens - W, self.num_tokens) if positions is None else positions
        out = torch.zeros(L, W, H, G, D)
        qg = q.float().reshape(L, W, H, G, D)
        ptr = self.indptr.tolist()
        for r in range(L * H):
            lo, hi = ptr[r], ptr[r + 1]
            if lo == hi:
                continue
            i_l, i_h = divmod(r, H)
            b_k, b_v = self.k[lo:hi].float(), self.v[lo:hi].float()  # [n, D]
            m_see = self.indices[lo:hi].long()[None, :] <= pos[:, None]  # [W, n] causal
            s = torch.einsum("wgd,nd->wgn", qg[i_l, :, i_h], b_k) * sm_scale  # [W, G, n]
            p = s.masked_fill(~m_see[:, None, :], float("-inf")).softmax(-1).nan_to_num(0.0)
            out[i_l, :, i_h] = torch.einsum("wgn,nd->wgd", p, b_v)
        return out.reshape(L, W, Hq, D)


def csr_nbytes(nnz: int, rows: int, head_dim: int, kv_dtype: str = "fp16", index_bytes: int = 4) -> int:
    """Bytes of a CSR store of ``nnz`` entries in ``rows`` rows: K and V values (``2 * nnz * head_dim`` in
    ``kv_dtype``), one index per entry and ``rows + 1`` row pointers (``index_bytes`` each)."""
    value = kv_formats.get(kv_dtype).bytes_per_value
    return int(2 * nnz * head_dim * value) + index_bytes * (nnz + rows + 1)
