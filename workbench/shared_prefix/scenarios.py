"""Pure functions behind notebook 08's panels: a shared-prefix batch described by a few numbers, what each path
reads, which blocks each program reads, and the bytes of batching by overlap (no tensors, no GPU).

:func:`scenario` builds the batch's block tables (one prompt of ``prefix`` tokens, ``groups`` forks of it that share
``fork`` more tokens, every sequence ``suffix`` private tokens), finds the runs (``find_shared_runs``), lets the
cost model choose (``choose``) and returns the bytes and predicted times of both paths. :func:`program_reads` lists,
for the plan of either path, which blocks every program reads: the picture of why the cascade reads less.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from workbench.shared_prefix.batching import group_by_overlap, step_bytes_of_batches
from workbench.shared_prefix.cost import Choice, CostModel, Geometry, choose
from workbench.shared_prefix.decode import cost_model
from workbench.shared_prefix.runs import SharedRun, find_shared_runs


@dataclass(frozen=True)
class Scenario:
    tables: list[list[int]]
    lens: list[int]
    geo: Geometry
    runs: list[SharedRun]
    choice: Choice
    num_blocks: int

    @property
    def speedup(self) -> float:
        return self.choice.predicted_speedup


def build_tables(prefix: int, sharers: int, suffix: int, block_size: int, groups: int = 1,
                 fork: int = 0) -> tuple[list[list[int]], list[int], int]:
    """Block tables (ids in order of allocation) of ``sharers`` sequences over one ``prefix``-token prompt, split into
    ``groups`` forks that each share ``fork`` more tokens, each sequence ``suffix`` private tokens. Partial blocks
    are private (a prompt's partly filled last block is copied on write by every fork)."""
    for name, v in (("prefix", prefix), ("suffix", suffix), ("fork", fork)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    for name, v in (("sharers", sharers), ("block_size", block_size), ("groups", groups)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if groups > sharers:
        raise ValueError(f"groups ({groups}) must be <= sharers ({sharers})")
    nxt = 0

    def take(n):
        nonlocal nxt
        nxt += n
        return list(range(nxt - n, nxt))

    shared = take(prefix // block_size)
    rest_prefix = prefix % block_size
    tables, lens = [], []
    for g in range(groups):
        members = sharers // groups + (1 if g < sharers % groups else 0)
        fork_blocks = take((rest_prefix + fork) // block_size)
        for _ in range(members):
            private = (rest_prefix + fork) % block_size + suffix
            tables.append(shared + fork_blocks + take(-(-private // block_size)))
            lens.append(prefix + fork + suffix)
    return tables, lens, nxt


def scenario(prefix: int, sharers: int, suffix: int, *, num_q_heads: int = 32, num_kv_heads: int = 8,
             head_dim: int = 128, block_size: int = 16, rows_per_tile: int = 64, elem_bytes: float = 2.0,
             groups: int = 1, fork: int = 0, model: CostModel | None = None) -> Scenario:
    """The batch of :func:`build_tables` and the selector's view of it (default model: the H200's, CUDA graphs)."""
    tables, lens, n = build_tables(prefix, sharers, suffix, block_size, groups, fork)
    geo = Geometry(num_q_heads, num_kv_heads, head_dim, block_size, elem_bytes, rows_per_tile)
    runs = find_shared_runs(tables, lens, block_size)
    choice = choose(runs, lens, geo, model or cost_model("NVIDIA H200"))
    return Scenario(tables, lens, geo, runs, choice, n)


def program_reads(sc: Scenario, path: str, max_programs: int = 48) -> list[dict]:
    """Which physical blocks each program of ``path`` ("plain" or "shared") reads, one kv head's worth:
    ``[{"program", "kind", "blocks", "rows"}]`` (``rows``: query heads the program serves). Plain decode: one
    program per sequence (its whole table); the cascade: one per shared tile (the segment's blocks, for up to
    ``rows_per_tile`` stacked heads), then one per sequence for its suffix. At most ``max_programs`` listed (the
    rest summed in the last entry: ``more`` blocks read by ``programs`` programs)."""
    if path not in ("plain", "shared"):
        raise ValueError(f"path must be 'plain' or 'shared', got {path!r}")
    bs, G = sc.geo.block_size, sc.geo.group
    out = []
    if path == "plain":
        for i, (t, n) in enumerate(zip(sc.tables, sc.lens, strict=True)):
            out.append({"program": f"seq {i}", "kind": "plain", "blocks": t[: -(-n // bs)], "rows": G})
    else:
        for s, e, rows in sc.choice.segments:
            tiles = sc.geo.tiles(len(rows))
            for t in range(tiles):
                served = min(sc.geo.rows_per_tile, len(rows) * G - t * sc.geo.rows_per_tile)
                out.append({"program": f"tile {len(out)}", "kind": "shared", "blocks": sc.tables[rows[0]][s:e],
                            "rows": served})
        for i, (t, n) in enumerate(zip(sc.tables, sc.lens, strict=True)):
            s0 = sc.choice.suffix_start[i]
            out.append({"program": f"seq {i}", "kind": "suffix", "blocks": t[s0: -(-n // bs)], "rows": G})
    if len(out) > max_programs:
        more = sum(len(p["blocks"]) for p in out[max_programs - 1:])
        rest = len(out) - max_programs + 1
        out = out[: max_programs - 1] + [{"program": f"+{rest} more", "kind": "more", "blocks": [], "rows": 0,
                                          "more": more, "programs": rest}]
    return out


def batching_study(prompts: int, samples: int, prefix: int, suffix: int, max_batch: int, *, seed: int = 0,
                   num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128, block_size: int = 16,
                   rows_per_tile: int = 64) -> dict:
    """``prompts`` requests of ``prefix`` tokens, each forked into ``samples`` (``suffix`` own tokens each), arriving
    shuffled: bytes of one step run as batches of ``max_batch`` in arrival order, grouped by
    :func:`group_by_overlap`, and with no sharing at all. ``{"arrival", "grouped", "plain", "batches"}``."""
    for name, v in (("prompts", prompts), ("samples", samples), ("max_batch", max_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    tables, lens, base = [], [], 0
    for _ in range(prompts):
        t, n, used = build_tables(prefix, samples, suffix, block_size)
        tables += [[b + base for b in row] for row in t]
        lens += n
        base += used
    order = list(range(len(tables)))
    random.Random(seed).shuffle(order)
    tables, lens = [tables[i] for i in order], [lens[i] for i in order]
    geo = Geometry(num_q_heads, num_kv_heads, head_dim, block_size, 2.0, rows_per_tile)
    arrival = [list(range(i, min(i + max_batch, len(tables)))) for i in range(0, len(tables), max_batch)]
    grouped = group_by_overlap(tables, lens, block_size, max_batch)
    a = step_bytes_of_batches(arrival, tables, lens, geo)
    g = step_bytes_of_batches(grouped, tables, lens, geo)
    return {"arrival": a["cascade"], "grouped": g["cascade"], "plain": a["plain"],
            "batches": {"arrival": len(arrival), "grouped": len(grouped)}, "grouping": grouped}
