"""Which blocks a batch shares: the prefix tree of its block tables, read from the tables (and ref counts).

Two sequences share a run of blocks when their tables hold the same physical blocks at the same logical
positions. Sharing in a paged cache is prefix-shaped (a prefix-cache hit or a fork copies a table's head), so
the shared runs of a batch form a tree: a system prompt held by all, a fork of one request below it, a fork of the
fork below that. :func:`find_shared_runs` builds that tree exactly (no assumption about how the tables were
made): the rows sorted by their block lists, the longest common prefix of neighbours, and the nested intervals of
those prefixes (the LCP-interval tree of a suffix array, here over block tables). Only whole blocks inside a
sequence's length count (a partly filled last block is read by its own sequence); with ``ref_counts`` only a
row's head of blocks held more than once is looked at (a block held once cannot be shared), which keeps the work
to the shared blocks.

:func:`cut` turns a chosen subset of the tree's runs into the segments and suffix starts
:class:`~workbench.kernels.CascadePlan` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedRun:
    """Blocks ``[start, end)`` held in common by ``rows`` (batch rows, sorted); ``parent`` the index of the run
    they also share the blocks before ``start`` with (None: ``start`` is 0)."""

    start: int
    end: int
    rows: tuple[int, ...]
    parent: int | None

    @property
    def blocks(self) -> int:
        return self.end - self.start

    @property
    def sharers(self) -> int:
        return len(self.rows)


def host_table(block_table, seq_lens) -> tuple[torch.Tensor, list[int]]:
    """``(table [B, M] int64 on the CPU, lengths as ints)`` from tensors or lists (ragged lists padded)."""
    if isinstance(block_table, torch.Tensor):
        if block_table.dim() != 2:
            raise ValueError(f"block_table must be [B, max_blocks], got shape {tuple(block_table.shape)}")
        table = block_table.detach().to("cpu", torch.int64)
    elif isinstance(block_table, Sequence) and not isinstance(block_table, (str, bytes)):
        rows = [list(r) for r in block_table]
        width = max((len(r) for r in rows), default=0)
        table = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), width)
    else:
        raise ValueError(f"block_table must be a tensor or a list of block lists, got {type(block_table).__name__}")
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    if len(lens) != table.shape[0] or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lens):
        raise ValueError(f"seq_lens must hold {table.shape[0]} ints >= 0 (one per row), got {lens!r}")
    return table, lens


def find_shared_runs(block_table, seq_lens, block_size: int, *, ref_counts=None) -> list[SharedRun]:
    """The batch's shared runs, outermost first (module docstring).

    Args:
        block_table: ``[B, max_blocks]`` tensor or a list of block lists (any device: read to the host once).
        seq_lens: ``[B]`` lengths (tensor or ints).
        block_size: tokens per block.
        ref_counts: optional ``[num_blocks]`` holders per physical block (e.g. the allocator's): blocks held once
            end a row's search. Any over-count (a prefix cache's own reference) is harmless: the tables decide.

    Returns:
        Runs of >= 2 rows and >= 1 block; a run's ``parent`` indexes this list.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    table, lens = host_table(block_table, seq_lens)
    B, M = table.shape
    full = torch.tensor([min(n // block_size, M) for n in lens], dtype=torch.int64).reshape(B)
    if ref_counts is not None:
        refs = torch.as_tensor(ref_counts).to("cpu", torch.int64)
        ok = (table >= 0) & (table < refs.numel())
        held = torch.where(ok, refs[table.clamp(0, max(refs.numel() - 1, 0))], 0) >= 2 if refs.numel() else ok & False
        held &= torch.arange(M)[None, :] < full[:, None]
        full = held.to(torch.int64).cumprod(1).sum(1)  # a row's head of blocks held more than once
    cand = full.tolist()
    if B < 2 or max(cand, default=0) == 0:
        return []
    keys = [tuple(table[b, : cand[b]].tolist()) for b in range(B)]
    order = sorted(range(B), key=keys.__getitem__)
    o = torch.tensor(order)
    width = int(max(cand))
    a, b = table[o[:-1], :width], table[o[1:], :width]
    lim = torch.minimum(full[o[:-1]], full[o[1:]])
    eq = (a == b) & (torch.arange(width)[None, :] < lim[:, None])
    lcp = [0] + eq.to(torch.int64).cumprod(1).sum(1).tolist()  # lcp[i]: rows order[i - 1] and order[i]
    return _lcp_tree(order, lcp)


def _lcp_tree(order: list[int], lcp: list[int]) -> list[SharedRun]:
    """The nested LCP intervals (Abouelhoda et al.'s bottom-up traversal) as runs, outermost first."""
    B = len(order)
    found = []  # (depth, left, right, parent depth)
    stack = [(0, 0)]  # (depth, left)
    for i in range(1, B + 1):
        h = lcp[i] if i < B else 0
        left = i - 1
        while h < stack[-1][0]:
            depth, left = stack.pop()
            found.append((depth, left, i - 1, max(h, stack[-1][0])))
        if h > stack[-1][0]:
            stack.append((h, left))
    runs, index = [], {}
    for depth, left, right, pdepth in sorted(found, key=lambda f: (f[0], f[1])):  # parents first
        parent = None
        if pdepth > 0:  # the enclosing interval of depth pdepth
            parent = next(index[k] for k in index if k[0] == pdepth and k[1] <= left and right <= k[2])
        index[(depth, left, right)] = len(runs)
        runs.append(SharedRun(pdepth, depth, tuple(sorted(order[left:right + 1])), parent))
    return runs


def cut(runs: Sequence[SharedRun], chosen: Sequence[int], batch_size: int) -> tuple[list, list[int]]:
    """``(segments, suffix_start)`` for :class:`~workbench.kernels.CascadePlan` from the chosen runs (indices into
    ``runs``): a chosen run's segment starts where its nearest chosen ancestor ends, so an unchosen run's blocks
    are read with its chosen descendants (or privately)."""
    chosen_set = set(chosen)
    segments, suffix = [], [0] * batch_size
    for i in sorted(chosen_set, key=lambda i: runs[i].end):
        run, p = runs[i], runs[i].parent
        while p is not None and p not in chosen_set:
            p = runs[p].parent
        start = runs[p].end if p is not None else 0
        segments.append((start, run.end, run.rows))
        for r in run.rows:
            suffix[r] = max(suffix[r], run.end)
    segments.sort(key=lambda s: (s[0], s[1]))
    return segments, suffix
