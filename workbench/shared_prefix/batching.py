"""Overlap-aware batching (the seed's ``cluster_by_block_overlap``): sequences that share blocks run together.

A shared block is read once per batch that holds it (by the cascade), so a step that cuts a group of sharers
across batches reads its prefix once per piece. :func:`group_by_overlap` orders the sequences by their block
lists (the prefix tree's depth-first order: sharers are neighbours) and cuts that order into batches of at most
``max_batch``, preferring cuts where neighbours share the least. :func:`step_bytes_of_batches` is the measure:
K/V bytes a step reads when every batch runs the cascade on what it shares.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workbench.shared_prefix.cost import Geometry, step_bytes
from workbench.shared_prefix.runs import cut, find_shared_runs, host_table


def group_by_overlap(block_table, seq_lens, block_size: int, max_batch: int) -> list[list[int]]:
    """Batches (lists of row indices, every row once) of at most ``max_batch`` rows, sharers kept together.

    Rows are taken in the prefix tree's order (sorted block lists); each batch is filled to ``max_batch`` unless
    a cut up to a quarter batch earlier separates rows that share fewer blocks (so a group that fits is not
    split for the sake of a full batch). ``O(B log B)`` list comparisons on the shared heads of the tables."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    table, lens = host_table(block_table, seq_lens)
    B = table.shape[0]
    full = [min(n // block_size, table.shape[1]) for n in lens]
    keys = [tuple(table[b, : full[b]].tolist()) for b in range(B)]
    order = sorted(range(B), key=keys.__getitem__)
    lcp = [0] + [_common(keys[order[i - 1]], keys[order[i]]) for i in range(1, B)]
    batches, i = [], 0
    while i < B:
        end = min(B, i + max_batch)
        if end < B:  # the cheapest cut in the last quarter of the batch
            lo = max(i + 1, end - max_batch // 4)
            end = min(range(lo, end + 1), key=lambda j: (lcp[j], -j))
        batches.append(order[i:end])
        i = end
    return batches


def _common(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def step_bytes_of_batches(batches: Sequence[Sequence[int]], block_table, seq_lens, geo: Geometry) -> dict:
    """K/V bytes of one step run as these batches, each through the cascade on every run it shares:
    ``{"plain", "cascade", "batches"}``."""
    table, lens = host_table(block_table, seq_lens)
    plain = cascade = 0.0
    for rows in batches:
        idx = torch.tensor(list(rows), dtype=torch.int64)
        sub_lens = [lens[r] for r in rows]
        runs = find_shared_runs(table[idx], sub_lens, geo.block_size)
        segments, suffix = cut(runs, range(len(runs)), len(rows))
        b = step_bytes(segments, sub_lens, suffix, geo)
        plain += b["plain"]
        cascade += b["cascade"]
    return {"plain": plain, "cascade": cascade, "batches": len(batches)}
