"""Compaction of a live paged cache: plan block moves, then copy K/V and rewrite the tables atomically.

The seed (part 4.1) proposes periodic compaction: blocks with ``ref_count == 1`` that are less than
half full are copied into a smaller block, the block table is updated and the old block freed. Here a
sequence has *one* block size for its whole table (the kernels batch sequences by block size and
address a token as ``table[pos // bs] * bs + pos % bs``), so a table cannot hold one small block among
large ones. The planner therefore works at two levels:

1. **Re-home** (the seed's rule, per sequence): a sequence in a size class larger than the smallest,
   every block of it held only by it (ref count 1), whose held slots are less than half used, moves
   whole into the smallest class: new small blocks, token by token, the old blocks freed. Since only
   the last block of a table is partly filled, this fires for one-block sequences under half full, the
   case the rule targets; re-homing a longer table to trim its last block would copy every token to
   save less than one block.
2. **Pack** (per size class, slab packing): live blocks (and, with ``cached="move"``, free blocks still
   in the prefix cache) are moved out of the emptiest pages of their class into free blocks of the
   fullest ones (``pack="dense"``, the fewest bytes copied), or into the lowest-numbered pages
   (``pack="low"``, pulling in clean pages from the uncarved stock, so the pool's tail empties and can
   be released or offloaded). Blocks move within their class, so every table keeps one block size;
   shared blocks move too (every holder's table follows; ref counts move with the block).

Then every wholly free page goes back to the uncarved stock (``BlockPool.release_pages``), where any
size class (or an offload tier) can take it. With ``cached="evict"`` cached free blocks are not moved
and are dropped when their page is released; with ``cached="move"`` (default) no prefix is lost.

Safety. The plan is made on a clone of the allocator and records its state's fingerprint.
:func:`apply` refuses a plan made for another state (:class:`StalePlan`), replays the plan on a fresh
clone (any invalid move raises before anything changes), checks that every copy writes only memory
that held nothing (no block in use, none cached) when the plan was made, copies the K/V (re-homed
tokens with a layout-aware indexed copy; packed blocks with the block-copy kernel,
``PagedKVCache.copy_blocks``, one launch per size class), and only then swaps the clone's descriptors
in. A failure at any point leaves the tables, ref counts, prefix map, free queues and pages exactly as
they were, and the old tables still read the same K/V (nothing they point to was written).

Cost: ``Plan.bytes_copied`` counts bytes written (each is read once too): a packed block is copied
whole, ``2 * num_layers * block_stride * elem_size`` bytes (padding and unused slots included); a
re-homed token costs ``2 * num_layers * heads * head_dim * elem_size`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

import torch

from workbench.allocator import AllocatorError, BlockManager, BlockPool
from workbench.core.layout import Layout

PACK_MODES = ("dense", "low")
CACHED_MODES = ("move", "evict")


class StalePlan(AllocatorError):
    """The allocator changed since the plan was made."""


@dataclass(frozen=True)
class Rehome:
    """One sequence moved into another size class; token ``p`` goes from the old table to the new."""

    seq_id: object
    src_size: int
    src_blocks: tuple[int, ...]
    dst_size: int
    dst_blocks: tuple[int, ...]
    tokens: int


@dataclass(frozen=True)
class Plan:
    """What one compaction does, planned for one allocator state.

    Attributes:
        rehomes: sequences moved into the smallest size class (step 1).
        moves: per size class, ``(src, dst)`` block moves (step 2), in the order they are applied.
        release: pages returned to the uncarved stock at the end.
        evicted: cached free blocks dropped by the release.
        copied_tokens: token slots written (re-homed tokens plus every slot of every moved block).
        bytes_copied: bytes written (``slot_bytes``-based for a bare ``BlockManager``).
        slots_saved: held slots given back by re-homing (old blocks minus new blocks, in slots).
        uncarved_before, uncarved_after: pages in the uncarved stock before and after.
        tail_before, tail_after: pages after the highest page holding anything (the releasable tail).
        fingerprint: the allocator state the plan is for.
    """

    rehomes: tuple[Rehome, ...]
    moves: dict[int, tuple[tuple[int, int], ...]]
    release: tuple[int, ...]
    evicted: int
    copied_tokens: int
    bytes_copied: int
    slots_saved: int
    uncarved_before: int
    uncarved_after: int
    tail_before: int
    tail_after: int
    fingerprint: int = field(repr=False)

    @property
    def pages_freed(self) -> int:
        """Net pages returned to the uncarved stock."""
        return self.uncarved_after - self.uncarved_before

    @property
    def num_moves(self) -> int:
        return sum(len(m) for m in self.moves.values())

    @property
    def empty(self) -> bool:
        return not (self.rehomes or self.num_moves or self.release)

    def summary(self) -> dict:
        return {"rehomed_sequences": len(self.rehomes), "moved_blocks": self.num_moves,
                "released_pages": len(self.release), "pages_freed": self.pages_freed, "evicted": self.evicted,
                "copied_tokens": self.copied_tokens, "bytes_copied": self.bytes_copied,
                "slots_saved": self.slots_saved, "tail_before": self.tail_before, "tail_after": self.tail_after}


# ---- planning -------------------------------------------------------------------------
def plan(target, *, rehome: bool = True, pack: str | None = "dense", cached: str = "move",
         slot_bytes: int = 1) -> Plan:
    """Plan a compaction of a ``PagedKVCache`` or a bare ``BlockManager`` (nothing is changed).

    Args:
        target: the cache (bytes from its geometry) or its allocator.
        rehome: apply the seed's rule (step 1 in the module docstring).
        pack: ``"dense"`` (fewest copies), ``"low"`` (toward low page ids) or None (no packing).
        cached: ``"move"`` keeps cached free blocks (packed like live ones) or ``"evict"`` drops them
            where their page is released.
        slot_bytes: bytes per token slot for a bare ``BlockManager`` (default 1: bytes = slots).

    Returns:
        A :class:`Plan` for :func:`apply`.
    """
    manager, cache = _unwrap(target)
    if pack not in (None, *PACK_MODES):
        raise ValueError(f"pack must be None or one of {PACK_MODES}, got {pack!r}")
    if cached not in CACHED_MODES:
        raise ValueError(f"cached must be one of {CACHED_MODES}, got {cached!r}")
    if not isinstance(slot_bytes, int) or slot_bytes < 1:
        raise ValueError(f"slot_bytes must be a positive int, got {slot_bytes!r}")
    pool = manager.pool
    dirty = _content_masks(pool)
    scratch = manager.clone()
    rehomes = _plan_rehomes(scratch, dirty) if rehome else []
    moves: dict[int, tuple[tuple[int, int], ...]] = {}
    if pack is not None:
        for bs in pool.block_sizes:
            mv = _plan_pack(scratch, bs, dirty, pack, cached)
            if mv:
                scratch.move_blocks(bs, mv)
                moves[bs] = tuple(mv)
    release = _releasable(scratch.pool, cached)
    sp = scratch.pool
    evicted = sp.evictions
    sp.release_pages(release)
    evicted = sp.evictions - evicted
    rehomed_tokens = sum(r.tokens for r in rehomes)
    moved_slots = sum(bs * len(m) for bs, m in moves.items())
    bytes_copied = _bytes(cache, slot_bytes, rehomed_tokens, {bs: len(m) for bs, m in moves.items()})
    saved = sum(len(r.src_blocks) * r.src_size - len(r.dst_blocks) * r.dst_size for r in rehomes)
    return Plan(tuple(rehomes), moves, tuple(release), evicted, rehomed_tokens + moved_slots, bytes_copied, saved,
                len(pool.uncarved_pages()), len(sp.uncarved_pages()), _tail(pool), _tail(sp), manager.fingerprint())


def _unwrap(target) -> tuple[BlockManager, object]:
    target = getattr(target, "cache", target)  # a TieredCache: its device tier, refused below
    manager, cache = (target, None) if isinstance(target, BlockManager) else (getattr(target, "manager", None), target)
    if not isinstance(manager, BlockManager) or not (cache is None or hasattr(cache, "copy_blocks")):
        raise ValueError(f"target must be a PagedKVCache or a BlockManager, got {type(target).__name__}")
    if manager.pool.evicted is not None:  # a tier below keys its blocks by the ids compaction would rename
        raise ValueError("target has a tier below it (workbench.tiers.TieredCache): compaction is not supported "
                         "there; close() the TieredCache first")
    return manager, cache


def _page_blocks(pool: BlockPool, bs: int, page: int) -> range:
    bpp = pool.page_tokens // bs
    return range(page * bpp, (page + 1) * bpp)


def _block_mask(pool: BlockPool, bs: int, bid: int) -> tuple[int, int]:
    """(page, bitmask of the page's token slots) covered by block ``bid`` of size ``bs``."""
    bpp = pool.page_tokens // bs
    return bid // bpp, ((1 << bs) - 1) << ((bid % bpp) * bs)


def _content_masks(pool: BlockPool) -> dict[int, int]:
    """Page -> bitmask of its slots that hold something now (a block in use or a cached block)."""
    masks: dict[int, int] = {}
    for bs in pool.block_sizes:
        c = pool.size_class(bs)
        for page in c.pages:
            for b in _page_blocks(pool, bs, page):
                if c.ref(b) or c.is_cached(b):
                    p, m = _block_mask(pool, bs, b)
                    masks[p] = masks.get(p, 0) | m
    return masks


def _clean(pool: BlockPool, dirty: dict[int, int], bs: int, bid: int) -> bool:
    """A free block, not cached, whose memory held nothing when planning began."""
    c = pool.size_class(bs)
    p, m = _block_mask(pool, bs, bid)
    return c.ref(bid) == 0 and not c.is_cached(bid) and c.is_free(bid) and not dirty.get(p, 0) & m


def _open_pages(pool: BlockPool, dirty: dict[int, int], bs: int) -> list[int]:
    """Pages not carved for ``bs`` that it could take: uncarved, or wholly free and clean in another
    class, and holding nothing when planning began; ascending."""
    out = []
    for page in range(pool.num_pages):
        if dirty.get(page, 0):
            continue
        owner = pool.page_block_size(page)
        if owner is None:
            out.append(page)
        elif owner != bs:
            o = pool.size_class(owner)
            if o.free_in_page(page) == o.blocks_per_page and all(
                    not o.is_cached(b) for b in _page_blocks(pool, owner, page)):
                out.append(page)
    return out


def _targets(pool: BlockPool, dirty: dict[int, int], bs: int, k: int) -> list[int]:
    """Up to ``k`` clean blocks of size ``bs``: the fullest carved pages first, then open pages."""
    c = pool.size_class(bs)
    pages = sorted((p for p in c.pages if c.free_in_page(p)), key=lambda p: (c.free_in_page(p), p))
    carved = (b for p in pages for b in _page_blocks(pool, bs, p) if _clean(pool, dirty, bs, b))
    out = list(islice(carved, k))
    if len(out) < k:
        out += [b for page in _open_pages(pool, dirty, bs) for b in _page_blocks(pool, bs, page)][:k - len(out)]
    return out


def _plan_rehomes(scratch: BlockManager, dirty: dict[int, int]) -> list[Rehome]:
    """Step 1 on the scratch allocator: one-size re-homing of under-half-used private sequences."""
    pool = scratch.pool
    small = pool.block_sizes[0]
    out = []
    for sid in scratch.seq_ids:
        bs, table, n = scratch.block_size(sid), scratch.block_table(sid), scratch.num_tokens(sid)
        if bs == small or not table or 2 * n >= len(table) * bs:
            continue
        if any(pool.ref_count(bs, b) != 1 for b in table):
            continue  # shared: the seed's rule is for blocks with one holder
        k = -(-n // small)
        if k * small >= len(table) * bs:
            continue  # saves nothing
        dst = _targets(pool, dirty, small, k)
        if len(dst) < k:
            continue
        scratch.rehome(sid, small, dst)
        out.append(Rehome(sid, bs, tuple(table), small, tuple(dst), n))
    return out


def _plan_pack(scratch: BlockManager, bs: int, dirty: dict[int, int], mode: str, cached: str) -> list[tuple]:
    """Step 2 for one size class: keep pages (fullest or lowest first) until their clean free blocks can
    take every block to move out of the others."""
    pool = scratch.pool
    c = pool.size_class(bs)
    content, targets = {}, {}
    for p in c.pages:
        blocks = _page_blocks(pool, bs, p)
        content[p] = [b for b in blocks if c.ref(b) or (cached == "move" and c.is_cached(b))]
        targets[p] = [b for b in blocks if _clean(pool, dirty, bs, b)]
    if mode == "dense":
        order = sorted(c.pages, key=lambda p: (-len(content[p]), p))
    else:
        for p in _open_pages(pool, dirty, bs):
            content[p], targets[p] = [], list(_page_blocks(pool, bs, p))
        order = sorted(content)
    remaining = sum(len(content[p]) for p in c.pages)
    kept, capacity = set(), 0
    for p in order:
        if capacity >= remaining:
            break
        kept.add(p)
        remaining -= len(content[p])
        capacity += len(targets[p])
    movers = sorted(b for p in c.pages if p not in kept for b in content[p])
    dst = [b for p in order if p in kept for b in targets[p]]
    return list(zip(movers, dst[:len(movers)], strict=True))


def _releasable(pool: BlockPool, cached: str) -> list[int]:
    out = []
    for bs in pool.block_sizes:
        c = pool.size_class(bs)
        for p in c.pages:
            if c.free_in_page(p) == c.blocks_per_page and (
                    cached == "evict" or all(not c.is_cached(b) for b in _page_blocks(pool, bs, p))):
                out.append(p)
    return sorted(out)


def _tail(pool: BlockPool) -> int:
    """Pages after the highest page that holds a block in use or cached."""
    top = max(_content_masks(pool), default=-1)
    return pool.num_pages - 1 - top


def _bytes(cache, slot_bytes: int, rehomed_tokens: int, moved: dict[int, int]) -> int:
    if cache is None:
        return slot_bytes * (rehomed_tokens + sum(bs * n for bs, n in moved.items()))
    rows = 2 * cache.num_layers  # (layer, K/V) rows
    per_block = {bs: rows * cache.block_stride(bs) * cache.dtype.itemsize for bs in moved}
    return rows * cache.token_bytes * rehomed_tokens + sum(per_block[bs] * n for bs, n in moved.items())


# ---- applying -------------------------------------------------------------------------
def apply(target, p: Plan) -> int:
    """Carry out plan ``p`` on the cache (K/V copied) or bare allocator it was made for; atomic.

    Returns:
        Bytes written by the copies (equal to ``p.bytes_copied``; 0 copies for a bare allocator,
        whose ``bytes_copied`` is what a cache of that geometry would copy).

    Raises:
        StalePlan: the allocator changed since the plan was made (nothing is changed).
        AllocatorError, ValueError: an invalid plan (nothing is changed).
    """
    manager, cache = _unwrap(target)
    if not isinstance(p, Plan):
        raise ValueError(f"p must be a compaction Plan, got {type(p).__name__}")
    if manager.fingerprint() != p.fingerprint:
        raise StalePlan("the allocator changed since this plan was made; plan again")
    dirty = _content_masks(manager.pool)
    pool = manager.pool
    for r in p.rehomes:
        if any(not _was_clean(pool, dirty, r.dst_size, b) for b in r.dst_blocks):
            raise ValueError(f"re-home of {r.seq_id!r} writes memory that holds data")
    for bs, mv in p.moves.items():
        if any(not _was_clean(pool, dirty, bs, d) for _, d in mv):
            raise ValueError(f"moves of size class {bs} write memory that holds data")
    scratch = manager.clone()
    for r in p.rehomes:
        if scratch.block_size(r.seq_id) != r.src_size or tuple(scratch.block_table(r.seq_id)) != r.src_blocks:
            raise ValueError(f"re-home of {r.seq_id!r} does not match its block table")
        scratch.rehome(r.seq_id, r.dst_size, r.dst_blocks)
    for bs, mv in p.moves.items():
        scratch.move_blocks(bs, mv)
    scratch.pool.release_pages(p.release)
    # ---- validated: copy K/V (only into memory nobody references yet), then swap the state in ----
    written = 0
    if cache is not None:
        written += _copy_rehomed(cache, p.rehomes)
        for bs, mv in p.moves.items():
            cache.copy_blocks(bs, list(mv))
            written += _bytes(cache, 1, 0, {bs: len(mv)})
    manager.adopt(scratch)  # the pool's state and the table of sequences, replaced whole
    return written


def compact(target, **kwargs) -> Plan:
    """Plan and apply in one call; returns the plan that was applied."""
    p = plan(target, **kwargs)
    apply(target, p)
    return p


def _was_clean(pool: BlockPool, dirty: dict[int, int], bs: int, bid: int) -> bool:
    if not isinstance(bid, int) or not 0 <= bid < pool.num_blocks(bs):
        raise ValueError(f"block id must be in [0, {pool.num_blocks(bs)}) for size {bs}, got {bid!r}")
    page, m = _block_mask(pool, bs, bid)
    return not dirty.get(page, 0) & m


def _token_axis(layout: Layout, kind: str) -> int:
    """Axis of the token within one block of ``layout`` (see ``workbench.core.layout.block_shape``)."""
    return {Layout.NHD: 0, Layout.HND: 1}.get(layout, 2)  # vLLM: key [H, D/x, bs, x], value [H, D, bs]


def _copy_rehomed(cache, rehomes: tuple[Rehome, ...]) -> int:
    """Copy re-homed tokens' K/V, every layer, through views that put the token axis second: exact
    for any layout and dtype. One indexed copy per (layer, K/V, pair of size classes)."""
    groups: dict[tuple[int, int], list[list[int]]] = {}
    for r in rehomes:
        g = groups.setdefault((r.src_size, r.dst_size), [[], [], [], []])
        for pos in range(r.tokens):
            g[0].append(r.src_blocks[pos // r.src_size])
            g[1].append(pos % r.src_size)
            g[2].append(r.dst_blocks[pos // r.dst_size])
            g[3].append(pos % r.dst_size)
    written = 0
    for (sbs, dbs), idx in groups.items():
        sb, st, db, dt = (torch.tensor(i, dtype=torch.int64, device=cache.device) for i in idx)
        for layer in range(cache.num_layers):
            for kind, view in (("k", cache.k_cache), ("v", cache.v_cache)):
                ax = _token_axis(cache.layout, kind) + 1
                src = view(layer, sbs).movedim(ax, 1)  # [blocks, block_size, ...]
                dst = view(layer, dbs).movedim(ax, 1)
                dst[db, dt] = src[sb, st]  # in place through the view
                _copy_token_scales(cache, layer, kind, sbs, dbs, sb, st, db, dt)
        written += 2 * cache.num_layers * cache.token_bytes * len(idx[0])
    return written


def _copy_token_scales(cache, layer, kind, sbs, dbs, sb, st, db, dt) -> None:
    """The scales kept in blocks (``workbench.quant.blocks``) follow their tokens: per token, or per key group
    (both size classes hold whole groups, so a group's first token carries its row)."""
    s_src, z_src = cache.scales(layer, kind, sbs)
    if s_src is None:
        return
    s_dst, z_dst = cache.scales(layer, kind, dbs)
    tg = sbs // s_src.shape[1]  # tokens per scale row
    first = st % tg == 0
    rows = (sb[first], st[first] // tg), (db[first], dt[first] // tg)
    s_dst[rows[1]] = s_src[rows[0]]
    if z_src is not None:
        z_dst[rows[1]] = z_src[rows[0]]


def kv_snapshot(cache) -> dict:
    """Every live sequence's gathered K and V, ``{seq_id: (k, v)}``: what a compaction must leave unchanged."""
    return {sid: cache.gather(sid) for sid in cache.manager.seq_ids}


def kv_identical(before: dict, after) -> bool:
    """Do ``after`` (a :func:`kv_snapshot`, or a cache to snapshot) and ``before`` hold the same sequences with
    bit-identical K and V? Compared as bytes, so NaNs and signed zeros count too."""
    if not isinstance(after, dict):
        after = kv_snapshot(after)
    if set(before) != set(after):
        return False

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8)

    return all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))
               for sid in before for a, b in zip(before[sid], after[sid], strict=True))
