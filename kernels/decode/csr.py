"""FlashInfer's CSR page table turned into a decode plan's padded block table and lengths, on the device.

Sequence ``b`` holds pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``, the last one ``kv_last_page_len[b]``
tokens full; :class:`~workbench.kernels.decode.DecodePlan.from_csr` plans on the ``[B, max_pages]`` table (padding 0)
and the lengths made here. One device -> host read at most (the widths, the lengths and the checks together).
"""

from __future__ import annotations

import torch

from ..validate import LenStats, capturing


def padded_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, device,
                 block_size: int, num_blocks: int, max_seq_len: int | None,
                 validate: bool) -> tuple[torch.Tensor, torch.Tensor, LenStats | None]:
    """``(block_table [B, width] int32, seq_lens [B] int32, stats)`` of a CSR table, after the checks of its
    tensors (1-D int32 on ``device``, ``[B + 1]`` and ``[B]``). The table is ``max(1, max pages)`` wide when the
    lengths are read (``max_seq_len`` unknown, or ``validate``: then the ids and last-page lengths are checked in the
    same read, ``stats`` their lengths' statistics), else ``ceil(max_seq_len / block_size)`` wide and ``stats`` None
    (no host read: a CUDA graph can capture it)."""
    for name, t in (("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
        if t.dim() != 1 or t.dtype != torch.int32 or t.device != device:
            raise ValueError(f"{name} must be a 1-D int32 tensor on {device}, got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")
    if kv_indptr.shape[0] < 1 or kv_last_page_len.shape[0] != kv_indptr.shape[0] - 1:
        raise ValueError(f"kv_indptr must be [B + 1] and kv_last_page_len [B], got {tuple(kv_indptr.shape)} and "
                         f"{tuple(kv_last_page_len.shape)}")
    if max_seq_len is not None and max_seq_len < 0:
        raise ValueError(f"max_seq_len must be >= 0, got {max_seq_len}")
    B = kv_last_page_len.shape[0]
    n_pages = kv_indptr[1:] - kv_indptr[:-1]  # [B]
    seq_lens = torch.where(n_pages > 0, (n_pages - 1) * block_size + kv_last_page_len, 0).to(torch.int32)
    stats = None
    read = B > 0 and (max_seq_len is None or validate) and not capturing(kv_indptr)
    if max_seq_len is None and not read and B > 0:
        raise ValueError("max_seq_len is required while a CUDA graph is being captured (no host reads then)")
    if read:
        max_pages, stats = _csr_stats(kv_indptr, kv_indices, kv_last_page_len, n_pages, seq_lens, block_size,
                                      num_blocks, validate)
        width = max(1, max_pages)
    else:
        width = max(1, -(-(max_seq_len or 0) // block_size))
    return _csr_to_table(kv_indptr, kv_indices, n_pages, width), seq_lens, stats


def _csr_stats(indptr, indices, last, n_pages, seq_lens, block_size, num_blocks, validate):
    """``(max pages, LenStats)`` of a CSR table, and (``validate``) its checks, in one device -> host read."""
    nnz = indices.shape[0]
    pos = torch.arange(nnz, device=indices.device)
    used = (pos >= indptr[0]) & (pos < indptr[-1])
    bad = used & ((indices < 0) | (indices >= num_blocks))
    lens = seq_lens.to(torch.int64)
    vals = torch.stack([
        n_pages.max().long(), lens.min(), lens.max(), lens.sum(),
        (n_pages < 0).sum(), indptr[-1].long(),
        ((n_pages > 0) & ((last < 1) | (last > block_size))).sum(),
        bad.sum(), torch.where(bad, pos, nnz).min() if nnz else pos.new_tensor(0).long(),
    ]).tolist()  # the one device -> host sync
    max_pages, lo, hi, total, n_neg, end, n_last, n_bad, first = vals
    if validate:
        if n_neg or end > nnz:
            raise ValueError(f"kv_indptr must be non-decreasing and end within kv_indices ({nnz} entries), got "
                             f"{indptr.tolist()}")
        if n_last:
            b = int(((n_pages > 0) & ((last < 1) | (last > block_size))).nonzero()[0, 0])  # the error path
            raise ValueError(f"kv_last_page_len[{b}] = {int(last[b])} must be in [1, {block_size}] (the page size) for "
                             f"a sequence with pages")
        if n_bad:
            raise ValueError(f"kv_indices[{first}] = {int(indices[first])} is out of range: page ids must be in "
                             f"[0, {num_blocks}) (the cache's blocks)")
    return max(0, max_pages), LenStats(lo, hi, total)


def _csr_to_table(indptr, indices, n_pages, width):
    """``[B, width]`` int32 padded block table (padding 0) from a CSR table, on the device."""
    B = n_pages.shape[0]
    cols = torch.arange(width, device=indptr.device)
    if indices.shape[0] == 0:
        return torch.zeros((B, width), dtype=torch.int32, device=indptr.device)
    pos = (indptr[:-1].long()[:, None] + cols[None, :]).clamp_(0, indices.shape[0] - 1)
    return torch.where(cols[None, :] < n_pages[:, None], indices[pos], 0).to(torch.int32).contiguous()
