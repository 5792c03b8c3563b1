"""Preemption by swap: a batch of sequences leaves the device for the tiers below, and comes back, sharing kept.

Keys. Each *device block* of a swap-out batch gets one key below, so a block that several sequences of the batch
share (an undiverged fork, beams, a common prompt prefix) travels once and each sharer lists the same key:

- the block's chain digest (``TieredCache.digests``) when it is the block the device's prefix map holds for that
  published prefix: a later prompt (promotion) or swap-in may find it, and a copy already below is reused;
- else a private random key: a partly filled tail, a block not yet published (KIVI's newest groups), a sequence
  that stopped publishing (its tokens were evicted), a second block holding content another block publishes.

A swapped sequence keeps its key per logical block; each entry is pinned once per sequence that lists it, and a
private one is dropped when its last holder comes back or is freed.

Swap-in rebuilds the tables on a clone of the allocator (as ``workbench.cache.compaction`` and
``workbench.compress.evict`` do) and swaps it in once every byte has landed: a key the batch shares gets one
device block, held by each sharer (reference counts as they were); a chain key whose block the device still
caches is taken as it is (shared with whoever holds it, as before the swap); the rest is filled from host and
disk in one batch each. Disk blocks are read and checked into a pinned buffer before the device changes, so a
corrupt block (:class:`~workbench.tiers.errors.CorruptBlock`), a full device (``OutOfBlocks``) or a full tier
leaves every sequence, table and entry as it was. A block shared with a sequence that stays on the device comes
back shared if it is published (a prefix hit), else as the swapped sequence's own copy; the same holds for a
sharer swapped in by a later call.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from workbench.allocator.errors import OutOfBlocks
from workbench.tiers.errors import CorruptBlock
from workbench.tiers.transfer import Transfer


@dataclass
class Swapped:
    """A sequence below the device: its tokens, and per logical block the key of its entry."""

    tokens: list[int]
    block_size: int
    extra_key: object
    prompt_len: int
    keys: list[bytes]
    quantized: int | None
    residual: tuple | None = None  # KIVI's fp16 residual, on the host
    priority: int = 0
    publishing: bool = True  # False: tokens were evicted, its blocks never join the prefix cache


def _private_key() -> bytes:
    return hashlib.blake2b(os.urandom(16), digest_size=16).digest()


def swap_out(tc, seq_ids: list) -> Transfer:
    """``TieredCache.swap_out`` (see there and the module docstring)."""
    cache, lower = tc.cache, tc.lower
    m = cache.manager
    pool = m.pool
    cache.flush_evictions()
    for s in seq_ids:
        if s in tc._swapped:
            raise ValueError(f"sequence {s!r} is swapped out already")
        m.num_tokens(s)  # UnknownSequence
    chained: dict[tuple[int, int], bytes] = {}  # (block size, device block) -> its chain digest
    for s in seq_ids:
        bs, table, entries = m.block_size(s), m.block_table(s), m.published(s)
        n = len(entries)
        if cache.scheme.keeps_residual:  # KIVI: only wholly quantized blocks are complete
            n = min(n, cache.quantized_tokens(s) // bs)
        for i, d in enumerate(tc.digests(m.tokens(s), bs, m.extra_key(s), n)):
            if pool.entry_id(bs, table[i]) == entries[i]:  # the block the prefix map holds for this prefix
                chained.setdefault((bs, table[i]), d)
    owner: dict[bytes, tuple[int, int]] = {}  # chain digest -> the one device block stored under it
    key_of: dict[tuple[int, int], bytes] = {}
    plans, copies = [], {}  # block size -> [(device block, key)] to copy below, each block once
    for s in seq_ids:
        bs = m.block_size(s)
        keys = []
        for b in m.block_table(s):
            k = key_of.get((bs, b))
            if k is None:
                d = chained.get((bs, b))
                k = d if d is not None and owner.setdefault(d, (bs, b)) == (bs, b) else _private_key()
                key_of[(bs, b)] = k
                e = lower.entries.get(k)
                if e is None or e.corrupt:
                    copies.setdefault(bs, []).append((b, k))
            keys.append(k)
        plans.append((s, bs, keys))
    protect = set(key_of.values())
    heal = {bs: [(b, k) for b, k in pairs if k in lower.entries] for bs, pairs in copies.items()}
    copies = {bs: [(b, k) for b, k in pairs if k not in lower.entries] for bs, pairs in copies.items()}
    push, to_disk = lower.plan_room({bs: p for bs, p in copies.items() if p}, protect)  # Host/DiskFull: no change
    transfer = Transfer("device", "host", 0, 0, lower.mover.path, 0)
    created = []
    try:
        lower.make_host_room(push, protect)
        for bs, pairs in copies.items():  # the overflow first: the disk write is what may fail
            cut = len(pairs) - to_disk.get(bs, 0)
            if cut < len(pairs):
                transfer = lower.store_disk(bs, pairs[cut:], protect)
                created += [k for _, k in pairs[cut:]]
        for bs, pairs in copies.items():
            host_part = pairs[:len(pairs) - to_disk.get(bs, 0)]
            if host_part:
                transfer = lower.store(bs, host_part)
                created += [k for _, k in host_part]
        for bs, pairs in heal.items():  # a corrupt copy below, superseded by the device's good one
            if pairs:
                lower.heal(bs, pairs, protect)
    except BaseException:
        lower.drop([k for k in created if k in lower.entries])
        raise
    # ---- nothing can fail below ----
    for k in created:
        lower.entries[k].private = k not in owner
    for s, bs, keys in plans:
        for k in keys:
            lower.entries[k].pins += 1
        quantized, residual = cache.residual_state(s)
        host_res = tuple(t.to("cpu") for t in residual) if residual is not None else None
        tc._swapped[s] = Swapped(m.tokens(s), bs, m.extra_key(s), m.prompt_len(s), keys,
                                 quantized, host_res, tc._priority.pop(s, 0), m.publishes(s))
        cache.free(s, observe=False)  # not finished: the block-size policy does not learn from it
        tc._chain.pop(s, None)
        tc._lossy_seqs.discard(s)  # it comes back lossy again (swap_in): its blocks below are the format's
        tc.counters.swapped_out += 1
    return transfer


def _device_hits(pool, sw: Swapped, chain: list[bytes]) -> dict[int, int]:
    """Logical block -> the device block the prefix map holds for it, where the sequence's key is that chain."""
    hits, parent, bs = {}, None, sw.block_size
    for i, d in enumerate(chain):
        b = pool.lookup(bs, pool.block_key(parent, sw.tokens[i * bs:(i + 1) * bs], sw.extra_key))
        if b is None:
            break
        if sw.keys[i] == d:
            hits[i] = b
        parent = pool.entry_id(bs, b)
    return hits


def swap_in(tc, seq_ids: list) -> Transfer:
    """``TieredCache.swap_in`` (see there and the module docstring)."""
    cache, lower = tc.cache, tc.lower
    m = cache.manager
    pool = m.pool
    for s in seq_ids:
        if s not in tc._swapped:
            raise ValueError(f"sequence {s!r} is not swapped out")
    recs = [(s, tc._swapped[s]) for s in seq_ids]
    for s, sw in recs:
        bad = next((i for i, k in enumerate(sw.keys) if lower.entries[k].corrupt), None)
        if bad is not None:
            raise CorruptBlock(f"sequence {s!r} cannot come back: its block {bad} failed its checksum on disk "
                               f"(free it and compute it again)", sw.keys[bad])
    # ---- the new tables, on a clone of the allocator (OutOfBlocks leaves the real one untouched) ----
    cache.flush_evictions()
    scratch = m.clone()
    sp = scratch.pool
    sp.evicted = [] if pool.evicted is not None else None
    at: dict[tuple[int, bytes], int] = {}  # (block size, key) -> its device block
    holders: dict[tuple[int, bytes], int] = {}
    fresh: dict[int, list[bytes]] = {}  # block size -> keys to fill, each once
    valid: dict[tuple[int, bytes], int] = {}
    lossy_now: set = set()  # sequences whose blocks come back from a lossy format
    for _s, sw in recs:
        bs, n = sw.block_size, len(sw.tokens)
        hits = _device_hits(sp, sw, tc.digests(sw.tokens, bs, sw.extra_key))
        for i, k in enumerate(sw.keys):
            holders[(bs, k)] = holders.get((bs, k), 0) + 1
            if (bs, k) in at or (bs, k) in valid:  # seen: a block the batch shares
                continue
            if i in hits:
                at[(bs, k)] = hits[i]
            else:
                fresh.setdefault(bs, []).append(k)
                valid[(bs, k)] = min(bs, n - i * bs)
    for (bs, k), b in at.items():  # prefix hits first: the allocation below must not evict them
        sp.incref(bs, [b] * holders[(bs, k)])
    for bs, keys in fresh.items():
        try:
            blocks = sp.allocate(bs, len(keys))
        except OutOfBlocks:
            raise OutOfBlocks(f"swapping in {seq_ids} needs {len(keys)} new blocks of {bs} tokens, "
                              f"{sp.free_blocks(bs)} available") from None
        for k, b in zip(keys, blocks, strict=True):
            at[(bs, k)] = b
            sp.set_valid(bs, b, valid[(bs, k)])
            if holders[(bs, k)] > 1:
                sp.incref(bs, [b] * (holders[(bs, k)] - 1))
    for s, sw in recs:
        table = [at[(sw.block_size, k)] for k in sw.keys]
        lossy = tc.lossy and any((sw.block_size, k) in valid for k in sw.keys)  # a block comes from below
        scratch.insert(s, sw.block_size, table, sw.tokens, prompt_len=sw.prompt_len, extra_key=sw.extra_key,
                       publishing=sw.publishing and (tc.accept_lossy or not lossy))
        if lossy:
            lossy_now.add(s)
        sp.touch(sw.block_size, table)
    # ---- disk blocks read and checked before the device changes ----
    fetched = {}
    for bs, keys in fresh.items():
        on_disk = [k for k in keys if lower.entries[k].tier == "disk"]
        try:
            fetched[bs] = (on_disk, lower.fetch(on_disk))
        except CorruptBlock as e:
            who = [s for s, sw in recs if e.key in sw.keys]
            raise CorruptBlock(f"sequences {who} cannot come back: a block of theirs failed its checksum on disk "
                               f"(free them and compute them again): {e}", e.key) from e
    # ---- blocks the allocation evicted go below, then the fills, then the new state ----
    evicted_now, sp.evicted = sp.evicted, pool.evicted
    if evicted_now:
        pool.evicted.extend(evicted_now)
    tc._protect = {k for keys in fresh.values() for k in keys}
    try:
        cache.flush_evictions()
    finally:
        tc._protect = set()
    transfer = Transfer("host", "device", 0, 0, lower.mover.path, 0)
    for bs, keys in fresh.items():
        transfer = lower.load(bs, [(at[(bs, k)], k) for k in keys], fetched[bs])
    m.adopt(scratch)  # the pool's state and the table of sequences, replaced whole (as compaction does)
    for s, sw in recs:
        del tc._swapped[s]
        residual = tuple(t.to(cache.device) for t in sw.residual) if sw.residual is not None else None
        cache.set_residual_state(s, sw.quantized, residual)
        m.publish(s, upto=cache.quantized_tokens(s))
        tc._priority[s] = sw.priority
        if s in lossy_now:
            tc._lossy_seqs.add(s)
            tc._lossy_entries.update(e for e, k in zip(m.published(s), sw.keys, strict=False)
                                     if (sw.block_size, k) in valid)
        lower.unpin(sw.keys)
        tc._note(s)
        tc.counters.swapped_in += 1
    return transfer


def check(tc) -> None:
    """Assert the tier state of ``tc`` (``TieredCache.check_invariants``)."""
    m, entries = tc.cache.manager, tc.lower.entries
    pins: dict[bytes, int] = {}
    for s, sw in tc._swapped.items():
        assert s not in m, f"sequence {s!r} is swapped out and on the device"
        assert len(sw.keys) == -(-len(sw.tokens) // sw.block_size), f"sequence {s!r}: keys per block"
        assert len(set(sw.keys)) == len(sw.keys), f"sequence {s!r} lists a key twice"
        for d in sw.keys:
            assert d in entries, f"swapped sequence {s!r} lost a block"
            assert entries[d].block_size == sw.block_size, f"sequence {s!r}: an entry of another size"
            pins[d] = pins.get(d, 0) + 1
    for d, e in entries.items():
        assert e.pins == pins.get(d, 0), f"entry {d.hex()}: pins {e.pins} != {pins.get(d, 0)}"
    live = set(m.seq_ids)
    assert set(tc._chain) <= live and set(tc._priority) <= live, "bookkeeping of a sequence that is gone"
    assert tc._lossy_seqs <= live, "a lossy mark of a sequence that is not resident"
    pool = m.pool
    alive = {pool.entry_id(bs, b) for bs in pool.block_sizes for b in range(pool.num_blocks(bs))}
    alive |= {e for _, _, e in pool.evicted or ()}  # evicted, not yet handed down
    assert set(tc._entry_digest) <= alive, "digests kept for device entries that are gone"
    assert tc._lossy_entries <= alive, "lossy marks kept for device entries that are gone"
