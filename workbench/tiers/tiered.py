"""A paged KV cache over three tiers: the device pool (HBM), a pinned host pool (DDR) and a disk pool (SSD).

    tc = TieredCache(cache, host_bytes=2 << 30, disk_path="/nvme/kv", disk_bytes=64 << 30, eviction="lru")
    tc.add("a", prompt, k, v)          # a prompt whose prefix was demoted is promoted back first (a prefix hit)
    tc.swap_out(["a"])                  # preemption by swap: the sequence's blocks go down in one batch
    tc.decode(q, ["a"], layer)          # a swapped sequence comes back first (or NotResident, on_miss="raise")

What lives where:

- *device*: the :class:`~workbench.cache.PagedKVCache`, unchanged. Its allocator evicts cached prefix blocks
  (free, ref count 0) when it needs memory; the cache hands them to :meth:`TieredCache._on_evict` before their
  bytes are overwritten (``PagedKVCache.flush_evictions``), and they are *demoted* in one batch instead of
  dropped: to the host, and what the host cannot hold straight to disk.
- *host* and *disk* (``workbench.tiers.host_disk_store``): a :class:`~workbench.tiers.host_disk_store.LowerEntry` per
  block, keyed by its *digest*, a chained BLAKE2b hash of the tokens of every block up to it (and the sequence's
  ``extra_key``, salted with the cache's geometry), so a block's identity does not depend on the device allocator's
  entry ids, which die with the device copy. A host tier that is full pushes entries to disk by the eviction policy
  (``workbench.tiers.eviction``: LRU, LFU, priority); a full disk drops them. Entries are *inclusive*: a promoted block
  keeps its lower copy, so evicting it again costs no copy. A disk block that fails its checksum is dropped and counted
  (``stats()["corrupt"]``): the prompt is computed again.
- A *swapped-out* sequence (:meth:`TieredCache.swap_out`, ``workbench.tiers.swap``) keeps its tokens and, per
  block, a key; a block shared by sequences swapped together travels once and comes back shared. Its entries
  are *pinned* (moved to disk if need be, never dropped). :meth:`TieredCache.block_table` gives every block's
  tier and place.

Promotion (``workbench.tiers.promote``) reuses the allocator: the promoted blocks are allocated as a short-lived
sequence holding just that prefix, filled from host or disk in one batch, published (so the device prefix map knows
them) and released, so the following :meth:`PagedKVCache.add` finds them as ordinary device hits and computes
nothing for them.

Every method checks its arguments and the room it needs before it changes anything; a move that fails (a tier
full, a corrupt disk block) raises and leaves every sequence where it was. Not supported with tiers: compaction
(it renames device blocks under the digests; ``workbench.cache.compaction`` refuses a cache with a tier below).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from workbench.allocator.errors import SequenceExists, hashable, positive, token_ids
from workbench.tiers import formats, promote, swap
from workbench.tiers.disk_coding import CODINGS
from workbench.tiers.errors import NotResident
from workbench.tiers.host_disk_store import LowerEntry, LowerTiers
from workbench.tiers.transfer import Transfer

ON_MISS = ("fetch", "raise")


@dataclass(frozen=True)
class BlockRef:
    """Where one logical block of a sequence is: ``tier`` ``"device"`` (``index`` = device block id), ``"host"``
    (``index`` = first host unit) or ``"disk"`` (``index`` None; ``digest`` names it in the disk pool)."""

    tier: str
    index: int | None
    digest: bytes | None = None


@dataclass
class _Counters:
    demoted: int = 0  # device -> below blocks (prefix evictions)
    demote_skipped: int = 0  # evicted blocks already below (inclusive copies)
    dropped: int = 0  # evicted blocks with nowhere to go
    swapped_out: int = 0  # sequences
    swapped_in: int = 0
    extra: dict = field(default_factory=dict)


class TieredCache:
    """See the module docstring.

    Args:
        cache: the device tier.
        host_bytes: size of the pinned host pool (at least one block of the cache).
        disk_path: a directory for the disk pool (None: no disk tier).
        disk_bytes: the disk pool's capacity (with a ``disk_path`` only).
        eviction: ``"lru"``, ``"lfu"``, ``"priority"`` (or a config): which lower entry moves down first.
        path: ``"dma"``, ``"sm"`` or ``"auto"`` (``workbench.tiers.transfer``).
        sm_programs: grid cap of the SM copy.
        on_miss: ``"fetch"`` (a decode of a swapped-out sequence swaps it in first) or ``"raise"`` (NotResident).
        fsync: the disk pool's durability (False: faster, for tests and benchmarks of the link).
        host_format: what blocks are below the device (``workbench.tiers.formats``): None keeps the device's bytes;
            a scheme name (``"int4/token"``, ``"fp8_e4m3/token"``, ``"int4/kivi"``, ...) transcodes each batch on
            the device on its way down and back, so the link and the tiers carry fewer bytes per token.
        disk_format: the disk's format: None (or the host's) keeps what the host holds; ``"zstd"`` codes it
            losslessly on its way to disk (``workbench.tiers.disk_coding``: byte-plane shuffle + zstd, bit-exact).
            Another scheme is refused for now: a push from host to disk would cross the link twice to be
            transcoded.
        accept_lossy: whether a prompt may reuse prefix blocks that come back from a lossy format (they are not
            the bytes the prefix was computed with). False: such a prefix is computed again, and a sequence
            swapped back from a lossy tier does not publish its blocks.
    """

    def __init__(self, cache, *, host_bytes: int, disk_path: str | os.PathLike | None = None, disk_bytes: int = 0,
                 eviction="lru", path: str = "auto", sm_programs: int | None = None, on_miss: str = "fetch",
                 fsync: bool = True, host_format=None, disk_format=None, accept_lossy: bool = True):
        from workbench.cache import PagedKVCache  # here: importing workbench.tiers (its simulators) stays kernel-free

        if not isinstance(cache, PagedKVCache):
            raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        if cache.on_evict is not None or cache.manager.pool.evicted is not None:
            raise ValueError("cache already has a tier below it (one TieredCache per PagedKVCache)")
        if on_miss not in ON_MISS:
            raise ValueError(f"on_miss must be one of {ON_MISS}, got {on_miss!r}")
        if disk_path is not None and not isinstance(disk_path, (str, os.PathLike)):
            raise ValueError(f"disk_path must be None or a directory path, got {type(disk_path).__name__}")
        if disk_path is not None:
            positive("disk_bytes", disk_bytes)
        elif disk_bytes != 0:
            raise ValueError(f"disk_bytes needs a disk_path (no disk tier without one), got disk_bytes={disk_bytes!r}")
        if not isinstance(fsync, bool):
            raise ValueError(f"fsync must be a bool, got {fsync!r}")
        if not isinstance(accept_lossy, bool):
            raise ValueError(f"accept_lossy must be a bool, got {accept_lossy!r}")
        fmt = formats.tier_format(cache, host_format, "host_format")
        coding = disk_format if disk_format in CODINGS else None
        disk_fmt = formats.tier_format(cache, disk_format, "disk_format") if disk_format not in (None, *CODINGS) \
            else fmt
        if disk_fmt != fmt:
            raise ValueError(f"disk_format must be None, the host's format {fmt.name!r} or a lossless coding "
                             f"{CODINGS}, got {disk_fmt.name!r}: the disk holds what the host pushes down")
        if disk_format is not None and disk_path is None:
            raise ValueError("disk_format needs a disk_path (no disk tier without one)")
        self.cache, self.on_miss, self.accept_lossy = cache, on_miss, accept_lossy
        self.format = fmt
        self.lossy = fmt.lossy(cache.scheme)  # blocks that come back may differ from what went down
        self.lower = LowerTiers(cache, host_bytes=host_bytes, disk_path=disk_path, disk_bytes=disk_bytes,
                                eviction=eviction, path=path, sm_programs=sm_programs, fsync=fsync, fmt=fmt,
                                disk_coding=coding)
        self._swapped: dict[object, swap.Swapped] = {}
        self._chain: dict[object, list[bytes]] = {}  # seq -> digests of its published blocks, in order
        self._entry_digest: dict[int, tuple[bytes, int]] = {}  # device entry id -> (digest, priority), for eviction
        self._priority: dict[object, int] = {}
        self._protect: set = set()  # keys an operation in flight reads: a demotion meanwhile leaves them be
        self._temp_ids = itertools.count()
        self._lossy_entries: set[int] = set()  # device prefix entries whose bytes came back from a lossy format
        self._lossy_seqs: set = set()  # sequences swapped back in from a lossy format
        self.counters = _Counters()
        c = cache
        self._salt = hashlib.blake2b(repr((c.num_layers, c.num_kv_heads, c.head_dim, c.scheme.name, c.layout.value,
                                           c.manager.pool.page_tokens, fmt.name)).encode(), digest_size=16).digest()
        cache.manager.pool.evicted = []
        cache.on_evict = self._on_evict

    @property
    def entries(self) -> dict[bytes, LowerEntry]:
        """The blocks below the device, by digest (``self.lower.entries``)."""
        return self.lower.entries

    # ---- digests ---------------------------------------------------------------------
    def digests(self, tokens: Sequence[int], block_size: int, extra_key: object = None,
                n: int | None = None) -> list[bytes]:
        """Chain digests of the first ``n`` (default all) full blocks of ``tokens``."""
        tokens = token_ids("tokens", tokens)
        if block_size not in self.cache.pool_sizes:
            raise ValueError(f"block_size must be one of the cache's {self.cache.pool_sizes}, got {block_size!r}")
        hashable("extra_key", extra_key)
        full = len(tokens) // block_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= full):
            raise ValueError(f"n must be None or an int in [0, {full}] (the full blocks of tokens), got {n!r}")
        out, prev = [], self._salt + block_size.to_bytes(4, "little")
        extra = repr(extra_key).encode()
        for i in range(full if n is None else n):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(torch.tensor(tokens[i * block_size:(i + 1) * block_size], dtype=torch.int64).numpy().tobytes())
            h.update(extra)
            prev = h.digest()
            out.append(prev)
        return out

    def _note(self, seq_id) -> None:
        """Record the digests of the sequence's newly published blocks (what their eviction is stored under)."""
        m = self.cache.manager
        entries = m.published(seq_id)
        chain = self._chain.setdefault(seq_id, [])
        if len(entries) > len(chain):
            bs = m.block_size(seq_id)
            tokens = m.tokens(seq_id)
            chain[:] = self.digests(tokens, bs, m.extra_key(seq_id), len(entries))
            priority = self._priority.get(seq_id, 0)
            for e, d in zip(entries, chain, strict=True):
                old = self._entry_digest.get(e)
                self._entry_digest[e] = (d, max(priority, old[1]) if old else priority)

    # ---- checks before anything changes ---------------------------------------------------
    def _new_id(self, name: str, seq_id) -> None:
        hashable(name, seq_id)
        if seq_id in self._swapped:
            raise SequenceExists(f"sequence {seq_id!r} already exists (swapped out: swap_in it, or free it)")
        if seq_id in self.cache.manager:
            raise SequenceExists(f"sequence {seq_id!r} already exists")

    def _known(self, seq_ids: Sequence) -> None:
        for s in seq_ids:
            if hashable("seq_id", s) not in self._swapped:
                self.cache.manager.num_tokens(s)  # UnknownSequence

    @staticmethod
    def _check_prompt(tokens, expected_len) -> list[int]:
        tokens = token_ids("tokens", tokens)
        if not tokens:
            raise ValueError("tokens must hold at least one token")
        if expected_len is not None and (isinstance(expected_len, bool) or not isinstance(expected_len, int)
                                         or expected_len < 1):
            raise ValueError(f"expected_len must be None or a positive int (prompt plus expected new tokens), "
                             f"got {expected_len!r}")
        return tokens

    # ---- the cache's operations, with the tiers' bookkeeping ---------------------------
    def add(self, seq_id, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor, *, expected_len: int | None = None,
            extra_key: object = None, priority: int = 0):
        """:meth:`PagedKVCache.add`, after promoting the longest run of the prompt's prefix found below the
        device (host or disk) back into device blocks; ``priority`` marks its blocks for the priority policy."""
        self._new_id("seq_id", seq_id)
        tokens = self._check_prompt(tokens, expected_len)
        hashable("extra_key", extra_key)
        self._check_priority(priority)
        self.cache.check_kv(k, v, len(tokens))
        self.promote_prefix(tokens, expected_len=expected_len, extra_key=extra_key)
        placement = self.cache.add(seq_id, tokens, k, v, expected_len=expected_len, extra_key=extra_key)
        self._priority[seq_id] = priority
        self._note(seq_id)
        for d in self._chain.get(seq_id, []):  # a prompt that reuses blocks below raises their priority
            if d in self.lower.entries:
                self.lower.entries[d].priority = max(self.lower.entries[d].priority, priority)
        return placement

    def append(self, seq_id, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor):
        self._known([seq_id])
        self.cache.check_kv(k, v, len(token_ids("tokens", tokens)))
        self._resident([seq_id])
        placement = self.cache.append(seq_id, tokens, k, v)
        self._note(seq_id)
        return placement

    def append_batch(self, seq_ids: Sequence, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor):
        seq_ids = self._distinct("seq_ids", seq_ids)
        self._known(seq_ids)
        tokens = token_ids("tokens", tokens)
        if len(tokens) != len(seq_ids):
            raise ValueError(f"tokens must hold one token per sequence ({len(seq_ids)}), got {len(tokens)}")
        self.cache.check_kv(k, v, len(seq_ids))
        self._resident(seq_ids)
        placements = self.cache.append_batch(seq_ids, tokens, k, v)
        for s in seq_ids:
            self._note(s)
        return placements

    def decode(self, q: torch.Tensor, seq_ids: Sequence, layer: int, **kw):
        """:meth:`PagedKVCache.decode`; every sequence must be resident (swapped ones come back, or NotResident)."""
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence) or not seq_ids:
            raise ValueError(f"seq_ids must be a non-empty list of sequence ids, got {seq_ids!r}")
        self._known(seq_ids)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.cache.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.cache.num_layers}), got {layer!r}")
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] != len(seq_ids) \
                or q.shape[2] != self.cache.head_dim:
            got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q must be a tensor [{len(seq_ids)} sequences, heads, {self.cache.head_dim}], got {got}")
        self._resident(list(dict.fromkeys(seq_ids)))
        return self.cache.decode(q, seq_ids, layer, **kw)

    def read_prefix(self, tokens: Sequence[int], *, expected_len: int | None = None, extra_key: object = None):
        """:meth:`PagedKVCache.read_prefix` after promoting the lower tiers' part of the prefix."""
        tokens = self._check_prompt(tokens, expected_len)
        self.promote_prefix(tokens, expected_len=expected_len, extra_key=extra_key)
        return self.cache.read_prefix(tokens, expected_len=expected_len, extra_key=extra_key)

    def fork(self, parent_id, child_id) -> None:
        self._known([parent_id])
        self._new_id("child_id", child_id)
        self._resident([parent_id])
        self.cache.fork(parent_id, child_id)
        if parent_id in self._lossy_seqs:
            self._lossy_seqs.add(child_id)
        self._chain[child_id] = list(self._chain.get(parent_id, []))
        self._priority[child_id] = self._priority.get(parent_id, 0)

    def free(self, seq_id) -> None:
        """Release a sequence, resident or swapped out (its private lower blocks are dropped, the rest unpinned)."""
        if hashable("seq_id", seq_id) in self._swapped:
            self.lower.unpin(self._swapped.pop(seq_id).keys)
            self.counters.extra["freed_swapped"] = self.counters.extra.get("freed_swapped", 0) + 1
            return
        self.cache.free(seq_id)
        self._lossy_seqs.discard(seq_id)
        self._chain.pop(seq_id, None)
        self._priority.pop(seq_id, None)

    def evict(self, n: int | None = None) -> int:
        """Demote up to ``n`` (default all) of the device's cached free prefix blocks now, oldest first (the
        allocator's order); returns how many left the device."""
        done = self.cache.manager.pool.evict(n)
        self.cache.flush_evictions()
        return done

    def is_lossy(self, seq_id) -> bool:
        """Whether a resident sequence reads blocks that came back from a lossy format (a promoted prefix, or its
        own blocks swapped back in): its K/V are that format's roundtrip of what was computed."""
        if hashable("seq_id", seq_id) in self._swapped:
            raise NotResident(f"sequence {seq_id!r} is swapped out")
        if seq_id in self._lossy_seqs:
            return True
        return any(e in self._lossy_entries for e in self.cache.manager.published(seq_id))

    # ---- residency -------------------------------------------------------------------
    def is_resident(self, seq_id) -> bool:
        if hashable("seq_id", seq_id) in self._swapped:
            return False
        self.cache.manager.num_tokens(seq_id)  # validates
        return True

    def block_table(self, seq_id) -> list[BlockRef]:
        """Every logical block's tier and place (device ids for a resident sequence)."""
        if hashable("seq_id", seq_id) not in self._swapped:
            return [BlockRef("device", b) for b in self.cache.manager.block_table(seq_id)]
        out = []
        for d in self._swapped[seq_id].keys:
            e = self.lower.entries[d]
            out.append(BlockRef(e.tier, e.host_start if e.tier == "host" else None, d))
        return out

    def _resident(self, seq_ids: Sequence) -> None:
        missing = [s for s in seq_ids if s in self._swapped]
        if not missing:
            return
        if self.on_miss == "raise":
            where = []
            for s in missing:
                tiers = [r.tier for r in self.block_table(s)]
                where.append(f"sequence {s!r}: {tiers.count('host')} blocks on host, {tiers.count('disk')} on disk")
            raise NotResident("a decode step needs blocks that are not in device memory (swap_in them first): "
                              + "; ".join(where))
        self.swap_in(missing).wait()

    # ---- swapping (preemption): workbench.tiers.swap ----------------------------------------
    def swap_out(self, seq_ids: Sequence) -> Transfer:
        """Move sequences' blocks below the device in one batch per size class and free their device blocks.

        A block several of them share goes once and comes back shared; blocks already below (inclusive copies of
        published prefix blocks) are not copied again; what the host cannot take goes straight to disk. All or
        nothing: :class:`HostFull` / :class:`DiskFull` (or an I/O error) leave the sequences resident and nothing
        of theirs below."""
        return swap.swap_out(self, self._distinct("seq_ids", seq_ids))

    def swap_in(self, seq_ids: Sequence) -> Transfer:
        """Bring swapped-out sequences back: device prefix hits where their published blocks are still cached,
        the rest filled from host or disk in one batch each, the blocks they shared shared again. All or nothing
        (``OutOfBlocks`` when the device is short, :class:`CorruptBlock` when a block of theirs failed its
        checksum: free those and compute them again)."""
        return swap.swap_in(self, self._distinct("seq_ids", seq_ids))

    # ---- prefix promotion --------------------------------------------------------------
    def promote_prefix(self, tokens: Sequence[int], *, expected_len: int | None = None,
                       extra_key: object = None) -> int:
        """Bring the part of ``tokens``' cached prefix that lies below the device back into device blocks (one
        batch from host, one from disk) and make it findable there. Returns the blocks promoted (0 when the
        device lacks free blocks for them: the prompt is then computed, as on a miss). A disk block that fails
        its checksum is dropped (counted in ``stats()["corrupt"]``) and the run stops before it."""
        tokens = self._check_prompt(tokens, expected_len)
        return promote.promote_prefix(self, tokens, expected_len, extra_key)

    # ---- moves between tiers ---------------------------------------------------------------
    def _on_evict(self, batch: list[tuple[int, int, int]]) -> None:
        """The allocator evicted these cached device blocks: demote the ones not below yet, in one batch per size
        (the host's share, and what it cannot hold straight to disk); a corrupt copy below is replaced."""
        todo: dict[int, list[tuple[int, bytes]]] = {}
        heal: dict[int, list[tuple[int, bytes]]] = {}
        priorities = {}
        for bs, bid, entry in batch:
            self._lossy_entries.discard(entry)
            d, priorities[bid] = self._entry_digest.pop(entry, (None, 0))
            e = self.lower.entries.get(d) if d is not None else None
            if d is None:
                self.counters.dropped += 1  # published outside this TieredCache: no digest to keep it under
            elif e is not None and e.corrupt:
                heal.setdefault(bs, []).append((bid, d))
            elif e is not None:
                e.last_access = next(self.lower.clock)
                self.counters.demote_skipped += 1
            else:
                todo.setdefault(bs, []).append((bid, d))
        for bs, pairs in heal.items():
            self.lower.heal(bs, pairs, self._protect)
        for bs, pairs in todo.items():
            stored = self.lower.demote(bs, pairs, self._protect)
            for bid, d in stored:
                self.lower.entries[d].priority = priorities[bid]
            self.counters.demoted += len(stored)
            self.counters.dropped += len(pairs) - len(stored)  # nowhere to go: this prefix is forgotten

    # ---- reports -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Occupancy per tier, the moves (bytes, blocks, batches, copy calls, seconds per direction) and counters
        (``corrupt``: disk blocks that failed their checksum, dropped)."""
        self.cache.flush_evictions()
        pool = self.cache.manager.pool
        c, low = self.counters, self.lower.counters
        return {
            "device": {"used_slots": pool.used_slots(), "free_slots": pool.free_slots(),
                       "cached_blocks": pool.cached_blocks()},
            **self.lower.occupancy(),
            "moves": self.lower.moves(),
            "demoted": c.demoted, "demote_skipped": c.demote_skipped, "dropped": c.dropped, "to_disk": low.to_disk,
            "disk_dropped": low.disk_dropped, "promoted_host": low.promoted_host, "promoted_disk": low.promoted_disk,
            "corrupt": low.corrupt, "swapped_out": c.swapped_out, "swapped_in": c.swapped_in,
            "swapped_now": len(self._swapped), "format": self.format.name, "lossy": self.lossy,
            "lossy_entries": len(self._lossy_entries), "lossy_sequences": len(self._lossy_seqs),
            "nonfinite": int(self.lower.mover.nonfinite),
        }

    def close(self) -> None:
        """Detach from the cache (it forgets evicted blocks again) and close the disk pool."""
        self.cache.on_evict = None
        self.cache.manager.pool.evicted = None
        if self.lower.disk is not None:
            self.lower.disk.close()

    # ---- checks ------------------------------------------------------------------------
    @staticmethod
    def _distinct(name: str, ids) -> list:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids:
            raise ValueError(f"{name} must be a non-empty list of sequence ids, got {ids!r}")
        ids = list(ids)
        for s in ids:
            hashable(f"{name} entry", s)
        if len(set(map(repr, ids))) != len(ids):
            raise ValueError(f"{name} must not repeat a sequence, got {ids!r}")
        return ids

    @staticmethod
    def _check_priority(priority) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")

    def check_invariants(self) -> None:
        """The allocator's invariants, the lower tiers' accounting and the tier state (``swap.check``): a
        swapped-out sequence is not on the device and its blocks have entries pinned once per holder, a private
        entry is held, bookkeeping names only live sequences and device entries."""
        self.cache.manager.check_invariants()
        self.lower.check()
        swap.check(self)
        assert not self._protect, "an operation left keys protected"


def describe_stats(stats: dict) -> str:
    """One line of :meth:`TieredCache.stats`: the device's slots in use and cached prefix blocks, the host's blocks
    and how many blocks were demoted and promoted back from the host."""
    d = stats["device"]
    return (f"device: {d['used_slots']:3d} slots in use, {d['cached_blocks']} cached blocks | host: "
            f"{stats['host']['blocks']} blocks | demoted {stats['demoted']}, promoted from host "
            f"{stats['promoted_host']}")


def move_rows(stats: dict) -> list[dict]:
    """The moves of :meth:`TieredCache.stats` as table rows, per direction: ``{direction, bytes, blocks,
    batches}``."""
    return [{"direction": d, **{k: m[k] for k in ("bytes", "blocks", "batches")}} for d, m in stats["moves"].items()]

