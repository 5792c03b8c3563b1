"""Prefix promotion: the part of a prompt's cached prefix that lies below the device (host or disk) comes back
into device blocks before the prompt is added, so the cache finds it as ordinary device hits.

The promoted blocks are allocated as a short-lived sequence holding just that prefix, filled from host or disk in
one batch each, published (so the device prefix map knows them) and released. ``TieredCache.promote_prefix`` (see
there) checks the arguments and calls :func:`promote_prefix`.
"""

from __future__ import annotations

from workbench.tiers.errors import CorruptBlock


def promote_prefix(tc, tokens: list[int], expected_len: int | None, extra_key: object) -> int:
    """``TieredCache.promote_prefix`` of checked ``tokens``: the blocks promoted (0 when none, or when the device
    lacks free blocks for them)."""
    m = tc.cache.manager
    pool = m.pool
    tc.cache.flush_evictions()  # blocks evicted since the last write (PagedKVCache.evict, say) go down first
    if tc.lossy and not tc.accept_lossy:
        return 0  # everything below is another format's roundtrip: the prompt is computed again
    bs, hits = m.cached_prefix(tokens, expected_len=expected_len, extra_key=extra_key)
    eligible = (len(tokens) - 1) // bs  # the block with the last prompt token is never a hit
    if eligible <= len(hits):
        return 0
    digests = tc.digests(tokens, bs, extra_key, eligible)
    room = pool.free_blocks(bs) - sum(1 for b in hits if pool.ref_count(bs, b) == 0)
    while True:
        run = 0
        for d in digests[len(hits):]:
            e = tc.lower.entries.get(d)
            if e is None or e.corrupt or run >= room:
                break
            run += 1
        if not run:
            return 0
        keys = digests[len(hits):len(hits) + run]
        on_disk = [d for d in keys if tc.lower.entries[d].tier == "disk"]
        try:
            fetched = (on_disk, tc.lower.fetch(on_disk))  # read and checked before the device changes
            break
        except CorruptBlock:
            continue  # that entry is gone (or marked): the run now stops before it
    temp = ("__tiers_promote__", next(tc._temp_ids))
    placement = m.add(temp, tokens[:(len(hits) + run) * bs], extra_key=extra_key, publish=False, block_size=bs)
    try:
        table = m.block_table(temp)
        first = placement.first // bs
        tc._protect = set(keys)
        try:
            tc.cache.flush_evictions()
        finally:
            tc._protect = set()
        tc.lower.load(bs, list(zip(table[first:], keys, strict=True)), fetched)
        m.publish(temp)
        published = m.published(temp)
        for e, d in zip(published, digests, strict=False):
            tc._entry_digest[e] = (d, tc.lower.entries[d].priority if d in tc.lower.entries else 0)
        if tc.lossy:
            tc._lossy_entries.update(published[first:])
    finally:
        m.free(temp, observe=False)
    return len(table) - first
