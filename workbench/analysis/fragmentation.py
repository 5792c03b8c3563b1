"""Where a live paged cache's memory goes: token states, reservation, fragmentation, free; a page map.

The simulator (``workbench.sim.metrics``) counts a modelled pool; these functions read a real
``BlockManager`` (or the ``PagedKVCache`` around it). Every token slot of the pool is in exactly one part:

    total = token + reservation + internal + external + free

- ``token``: slots holding a valid token, each physical block counted once however many sequences share
  it: ``sum over blocks in use of valid_tokens``.
- ``reservation``: unused slots of a block in use that its sequence will still fill. Only known from the
  caller's final lengths ``F``: for the last block ``i`` of a sequence, held by it alone,
  ``min(bs, F - i * bs) - valid``. Without ``final_lens`` it is 0.
- ``internal``: the other unused slots of blocks in use (internal fragmentation): the tail of a
  partly filled block that will never be filled (every partly filled block when final lengths are
  unknown; a shared partly filled block always, since the next append copies it first).
- ``external``: free slots a request of ``request_block_size`` (default: the largest size class) cannot
  use because of the slab structure: free blocks of another size class in pages that still hold a
  block in use. (Wholly free pages are re-carved on demand, so they count as free.)
- ``free``: uncarved pages, wholly free pages, free blocks of the request's own class.

Also reported: ``cached`` (free slots whose block is still in the prefix cache; part of external or free)
and ``stranded`` (free slots in pages that are not wholly free, of any class: what packing can turn into
whole pages). Block utilization = ``token / (token + reservation + internal)``. Bytes = slots x
``slot_bytes``, for a cache ``2 * num_layers * page_bytes / page_tokens`` (alignment padding included).

The vLLM paper's four bars (``LiveBreakdown.paper``): token states, reservation, internal, and
"external fragmentation & others" = external + free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
import torch

from workbench.allocator import BlockManager, OutOfBlocks

PARTS = ("token", "reservation", "internal", "external", "free")
STATES = ("uncarved", "free", "cached", "unused", "token")  # page-map codes 0..4
UNCARVED, FREE, CACHED, UNUSED, TOKEN = range(5)
SHARED, NOBODY = -2, -1  # page-map owners that are not a sequence index


@dataclass(frozen=True)
class LiveBreakdown:
    """Slots of a live pool by part (see the module docstring); ``slot_bytes`` converts to bytes."""

    token: int
    reservation: int
    internal: int
    external: int
    free: int
    total: int
    cached: int
    stranded: int
    request_block_size: int
    slot_bytes: float = 1.0

    def shares(self) -> dict[str, float]:
        """Each part as a fraction of the pool."""
        return {k: getattr(self, k) / self.total for k in PARTS}

    def bytes(self) -> dict[str, float]:
        return {k: getattr(self, k) * self.slot_bytes for k in (*PARTS, "total", "cached", "stranded")}

    def paper(self) -> dict[str, float]:
        """The vLLM paper's Figure-2 bars, percent of the pool."""
        s = self.shares()
        return {"token_states": 100 * s["token"], "reservation": 100 * s["reservation"],
                "internal": 100 * s["internal"], "external": 100 * (s["external"] + s["free"])}

    @property
    def block_utilization(self) -> float:
        held = self.token + self.reservation + self.internal
        return self.token / held if held else 1.0

    def residual(self) -> int:
        """``total - sum(parts)``: 0 when every slot is counted once."""
        return self.total - sum(getattr(self, k) for k in PARTS)

    def as_dict(self) -> dict:
        return asdict(self) | {"block_utilization": self.block_utilization}


def _unwrap(target) -> tuple[BlockManager, float]:
    if isinstance(target, BlockManager):
        return target, 1.0
    manager = getattr(target, "manager", None)
    if isinstance(manager, BlockManager) and hasattr(target, "page_bytes"):
        pool = manager.pool
        return manager, 2 * target.num_layers * target.page_bytes / pool.page_tokens
    raise ValueError(f"target must be a PagedKVCache or a BlockManager, got {type(target).__name__}")


def breakdown(target, final_lens: Mapping | None = None, request_block_size: int | None = None) -> LiveBreakdown:
    """Split the pool of a ``PagedKVCache`` or ``BlockManager`` into the parts of the module docstring.

    Args:
        target: the cache or its allocator.
        final_lens: sequence id -> final length (prompt + output), for the reservation; optional.
        request_block_size: the size class a new request would use (default: the largest).
    """
    manager, slot_bytes = _unwrap(target)
    pool = manager.pool
    rbs = pool.block_sizes[-1] if request_block_size is None else request_block_size
    pool.size_class(rbs)  # validates
    final_lens = final_lens or {}
    ahead = {}  # (size, last block) -> slots its only holder will still fill
    for sid in manager.seq_ids:
        if sid in final_lens:
            bs, table = manager.block_size(sid), manager.block_table(sid)
            if table:
                ahead[(bs, table[-1])] = max(0, min(bs, final_lens[sid] - (len(table) - 1) * bs))
    token = reservation = internal = external = free = cached = stranded = 0
    for bs in pool.block_sizes:
        c = pool.size_class(bs)
        for page in c.pages:
            whole = c.free_in_page(page) == c.blocks_per_page
            for b in range(page * c.blocks_per_page, (page + 1) * c.blocks_per_page):
                if c.ref(b):
                    v = c.valid(b)
                    res = max(0, ahead.get((bs, b), v) - v) if c.ref(b) == 1 else 0
                    token, reservation, internal = token + v, reservation + res, internal + bs - v - res
                    continue
                cached += bs if c.is_cached(b) else 0
                if whole:
                    free += bs
                else:
                    stranded += bs
                    if bs == rbs:
                        free += bs
                    else:
                        external += bs
    free += len(pool.uncarved_pages()) * pool.page_tokens
    return LiveBreakdown(token, reservation, internal, external, free, pool.num_pages * pool.page_tokens, cached,
                         stranded, rbs, slot_bytes)


@dataclass(frozen=True)
class PageMap:
    """Every token slot of the pool, page by page (for a heatmap).

    Attributes:
        state: ``[num_pages, page_tokens]`` int8, an index into ``STATES``.
        owner: ``[num_pages, page_tokens]`` int32, index into ``seq_ids`` of the block's holder,
            ``SHARED`` (-2) when several sequences hold it, ``NOBODY`` (-1) when none.
        block: ``[num_pages, page_tokens]`` int32, block id in the page's size class (-1 if uncarved).
        block_size: ``[num_pages]`` int32, the class the page is carved for (0 if uncarved).
        seq_ids: the live sequences, in the manager's order.
    """

    state: np.ndarray
    owner: np.ndarray
    block: np.ndarray
    block_size: np.ndarray
    seq_ids: tuple

    def counts(self) -> dict[str, int]:
        return {name: int((self.state == i).sum()) for i, name in enumerate(STATES)}


def page_map(target) -> PageMap:
    """The state and owner of every slot of a ``PagedKVCache``'s or ``BlockManager``'s pool."""
    manager, _ = _unwrap(target)
    pool = manager.pool
    shape = (pool.num_pages, pool.page_tokens)
    state = np.full(shape, UNCARVED, dtype=np.int8)  # [P, T]
    owner = np.full(shape, NOBODY, dtype=np.int32)  # [P, T]
    block = np.full(shape, -1, dtype=np.int32)  # [P, T]
    sizes = np.zeros(pool.num_pages, dtype=np.int32)  # [P]
    seq_ids = tuple(manager.seq_ids)
    holder: dict[tuple[int, int], int] = {}
    for i, sid in enumerate(seq_ids):
        bs = manager.block_size(sid)
        for b in manager.block_table(sid):
            holder[(bs, b)] = i if holder.get((bs, b), i) == i else SHARED
    for bs in pool.block_sizes:
        c = pool.size_class(bs)
        for page in c.pages:
            sizes[page] = bs
            for j in range(c.blocks_per_page):
                b = page * c.blocks_per_page + j
                row = slice(j * bs, (j + 1) * bs)
                block[page, row] = b
                if c.ref(b):
                    v = c.valid(b)
                    state[page, j * bs:j * bs + v] = TOKEN
                    state[page, j * bs + v:(j + 1) * bs] = UNUSED
                    owner[page, row] = holder.get((bs, b), SHARED) if c.ref(b) == 1 else SHARED
                else:
                    state[page, row] = CACHED if c.is_cached(b) else FREE
    return PageMap(state, owner, block, sizes, seq_ids)


_MIX = {False: [0.55, 0.3, 0.1, 0.05], True: [0.1, 0.2, 0.1, 0.6]}  # add, append, fork, free: below / above fill


def churn(cache, steps: int, seed: int = 0, *, max_prompt: int = 24, max_append: int = 8,
          long_every: int = 3, fill: float = 0.6, vocab: int = 4,
          system: tuple[int, ...] = (1, 2, 3, 0, 1, 2, 3, 0)) -> dict:
    """Drive a ``PagedKVCache`` with ``steps`` seeded random operations, to fragment it for a demo.

    Each step adds a sequence (half of them starting with ``system``; every ``long_every``-th one
    expecting a long output, so an adaptive policy gives it large blocks), appends to, forks or frees
    a live one; frees are frequent once ``fill`` of the pool is in use, so the pool stays partly
    used and gets holes. K/V are seeded random normals. An operation that finds no memory is skipped.

    Returns:
        ``{seq_id: tokens}`` of the live sequences.
    """
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)

    def kv(n):
        shape = (cache.num_layers, n, cache.num_kv_heads, cache.head_dim)
        return (torch.randn(shape, generator=g).to(cache.device), torch.randn(shape, generator=g).to(cache.device))

    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(steps):
        pool = cache.manager.pool
        full = 1 - pool.free_slots() / (pool.num_pages * pool.page_tokens) >= fill
        op = "add" if not live else rng.choice(["add", "append", "fork", "free"], p=_MIX[full])
        try:
            if op == "add":
                toks = (list(system) if rng.random() < 0.5 else []) + rng.integers(
                    0, vocab, rng.integers(1, max_prompt + 1)).tolist()
                expected = len(toks) + (10 * max_prompt if next_id % long_every == 0 else 1)
                cache.add(next_id, toks, *kv(len(toks)), expected_len=expected)
                live[next_id] = toks
                next_id += 1
            elif op == "append":
                sid = int(rng.choice(sorted(live)))
                toks = rng.integers(0, vocab, rng.integers(1, max_append + 1)).tolist()
                cache.append(sid, toks, *kv(len(toks)))
                live[sid] = live[sid] + toks
            elif op == "fork":
                sid = int(rng.choice(sorted(live)))
                cache.fork(sid, next_id)
                live[next_id] = list(live[sid])
                next_id += 1
            else:
                sid = int(rng.choice(sorted(live)))
                cache.free(sid)
                del live[sid]
        except OutOfBlocks:
            continue
    return live
