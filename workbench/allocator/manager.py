"""Sequences and their block tables over a :class:`~workbench.allocator.pool.BlockPool`.

A sequence owns a block table (logical -> physical block id). ``fork`` shares every block
(ref counts go up); appending into a shared, partly filled last block first copies it
(copy-on-write) and reports the ``(src, dst)`` copy for the cache to apply. Every operation
checks everything it needs before it changes anything: a failure raises a specific
exception and leaves tables, counts, queues and the prefix map exactly as they were.

Prefix publishing. Full blocks join the prefix cache when they are filled (``publish=True``,
the default) or later through :meth:`BlockManager.publish`, which a cache calls only once
their K/V is written: a prompt must never hit a block whose bytes are not there yet. A sequence whose
tokens were evicted (``workbench.compress.evict``) stops publishing (:meth:`BlockManager.stop_publishing`): its
kept tokens are no longer a prefix, so no block of it may join the cache under their hash chain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from workbench.allocator.errors import (
    OutOfBlocks,
    SequenceExists,
    UnknownSequence,
    as_index,
    hashable,
    token_ids,
)
from workbench.allocator.policies import FixedBlockSize, PolicyContext
from workbench.allocator.pool import BlockPool


@dataclass
class _Seq:
    block_size: int
    table: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)  # prefix-cache entry id of each published full block
    prompt_len: int = 0
    extra_key: object = None
    publishing: bool = True  # False once tokens were evicted: its blocks never join the prefix cache again

    def copy(self) -> _Seq:
        return _Seq(self.block_size, list(self.table), list(self.tokens), list(self.entries), self.prompt_len,
                    self.extra_key, self.publishing)


@dataclass(frozen=True)
class Placement:
    """What an add/append did: where the new tokens go and which blocks must be copied first.

    ``slots[i]`` is the slot (``block_id * block_size + offset``) of token ``first + i``;
    tokens before ``first`` were found in the prefix cache and need no write. ``copies`` are
    ``(src, dst)`` block ids to copy before writing (copy-on-write), in the sequence's size class.
    """

    seq_id: object
    block_size: int
    first: int
    slots: list[int]
    copies: list[tuple[int, int]]


@dataclass(frozen=True)
class Checkpoint:
    """What :meth:`BlockManager.restore` needs to undo one add/append of ``seq_id`` (see there). O(1): an add or
    append only appends tokens and blocks and may replace the last block (copy-on-write), so the lengths and the
    old last block say what the sequence was."""

    seq_id: object
    existed: bool  # False: the sequence did not exist (an add)
    num_tokens: int
    table_len: int
    last_block: int  # -1 without blocks
    tail_valid: int
    tail_access: int  # the LRU clock value of the old last block
    hits: int
    misses: int
    clock: int


class BlockManager:
    """Sequences and their block tables over a :class:`BlockPool`.

    Args:
        pool: the physical blocks.
        policy: a block-size policy config (``workbench.allocator.policies``; default: a fixed block
            of the pool's smallest size); the manager builds its own state from it (``self.policy``).
        prefix_caching: reuse full blocks whose chained content matches.
    """

    def __init__(self, pool: BlockPool, policy=None, prefix_caching: bool = True):
        if not isinstance(pool, BlockPool):
            raise ValueError(f"pool must be a BlockPool, got {type(pool).__name__}")
        self.pool = pool
        config = policy if policy is not None else FixedBlockSize(pool.block_sizes[0])
        if not callable(getattr(config, "build", None)):
            raise ValueError(f"policy must be a block-size policy config (FixedBlockSize, ByExpectedLength, ...: "
                             f"see workbench.allocator.policies), got {type(config).__name__}")
        self.policy_config = config
        self.policy = config.build(PolicyContext(pool.block_sizes))
        self.prefix_caching = bool(prefix_caching)
        self._seqs: dict[object, _Seq] = {}

    # ---- queries -------------------------------------------------------------------
    def __contains__(self, seq_id: object) -> bool:
        try:
            return seq_id in self._seqs
        except TypeError:
            return False

    @property
    def seq_ids(self) -> list:
        return list(self._seqs)

    def block_table(self, seq_id) -> list[int]:
        return list(self._get(seq_id).table)

    def block_size(self, seq_id) -> int:
        return self._get(seq_id).block_size

    def ref_counts(self, seq_id) -> list[int]:
        """The reference count of each block in the sequence's table, in table order (2 or more: shared)."""
        s = self._get(seq_id)
        return [self.pool.ref_count(s.block_size, b) for b in s.table]

    def num_tokens(self, seq_id) -> int:
        return len(self._get(seq_id).tokens)

    def tokens(self, seq_id) -> list[int]:
        return list(self._get(seq_id).tokens)

    def locate(self, seq_id, pos: int) -> tuple[int, int]:
        """(physical block, offset in block) of token ``pos``."""
        s = self._get(seq_id)
        pos = as_index("pos", pos)
        if not 0 <= pos < len(s.tokens):
            raise ValueError(f"pos must be in [0, {len(s.tokens)}), got {pos}")
        return s.table[pos // s.block_size], pos % s.block_size

    def slot_mapping(self, seq_id, start: int = 0, end: int | None = None) -> list[int]:
        """Slots (``block * block_size + offset``) of tokens ``start:end``, ``0 <= start <= end <= num_tokens``."""
        s = self._get(seq_id)
        n = len(s.tokens)
        start = as_index("start", start)
        end = n if end is None else as_index("end", end)
        if not 0 <= start <= end <= n:
            raise ValueError(f"start and end must satisfy 0 <= start <= end <= {n} (the sequence's tokens), "
                             f"got start={start}, end={end}")
        bs, table = s.block_size, s.table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- operations ----------------------------------------------------------------
    def add(self, seq_id, prompt: Sequence[int], *, expected_len: int | None = None,
            extra_key: object = None, publish: bool = True, block_size: int | None = None) -> Placement:
        """Start a sequence with ``prompt`` tokens, reusing cached full blocks of the same prefix.

        Args:
            seq_id: any hashable id not in use.
            prompt: at least one integer token id (a list, tuple, 1-D integer tensor or array).
            expected_len: the sequence's expected final length (prompt + new tokens), for the policy.
            extra_key: hashable; blocks are shared only between prompts with equal ``extra_key``
                (a LoRA id, an image hash, a cache salt).
            publish: make the new full blocks findable now; False defers it to :meth:`publish`.
            block_size: this size class instead of the policy's choice (a sequence coming back from a lower
                tier, whose stored blocks have the size it had).
        """
        hashable("seq_id", seq_id)
        if seq_id in self._seqs:
            raise SequenceExists(f"sequence {seq_id!r} already exists")
        prompt = token_ids("prompt", prompt)
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if expected_len is not None:
            if isinstance(expected_len, bool) or not isinstance(expected_len, int) or expected_len < 1:
                raise ValueError(f"expected_len must be None or a positive int (prompt plus expected new tokens), "
                                 f"got {expected_len!r}")
        hashable("extra_key", extra_key)
        bs = self.policy.choose(len(prompt), expected_len) if block_size is None else block_size
        pool = self.pool
        hits, entries = self._prefix_hits(prompt, bs, extra_key)  # validates the policy's choice
        need = -(-len(prompt) // bs) - len(hits)
        available = pool.free_blocks(bs) - pool.count_free(bs, hits)  # free hits leave the queue: not allocatable
        if need > available:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} new blocks of {bs} tokens, {available} available")
        # ---- nothing can fail below ----
        if self.prefix_caching:
            pool.record_lookups(len(hits), len(prompt) // bs - len(hits))
        pool.incref_unchecked(bs, hits)
        pool.touch_unchecked(bs, hits)
        s = _Seq(bs, table=hits + pool.allocate(bs, need), prompt_len=len(prompt), extra_key=extra_key)
        self._seqs[seq_id] = s
        first = len(hits) * bs
        s.tokens = prompt[:first]
        s.entries = entries
        return self._fill(seq_id, s, prompt[first:], first, [], publish)

    def cached_prefix(self, prompt: Sequence[int], *, expected_len: int | None = None,
                      extra_key: object = None) -> tuple[int, list[int]]:
        """What :meth:`add` of ``prompt`` would find in the prefix cache, changing nothing (no hit statistics):
        ``(block_size, hit block ids)``. A runner reads those blocks' K/V and computes only the rest."""
        prompt = token_ids("prompt", prompt)
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        hashable("extra_key", extra_key)
        bs = self.policy.choose(len(prompt), expected_len)
        return bs, self._prefix_hits(prompt, bs, extra_key)[0]  # validates the policy's choice

    def _prefix_hits(self, prompt: list[int], bs: int, extra_key) -> tuple[list[int], list[int]]:
        """Prefix hits and their entry ids: leading full blocks whose chained key is cached. A block holding the
        last prompt token is never a hit, so at least one token is computed (as engines do)."""
        return self.pool.cached_chain(bs, prompt, extra_key, end=len(prompt) - 1 if self.prefix_caching else 0)

    def append(self, seq_id, tokens: Sequence[int], *, publish: bool = True) -> Placement:
        """Append generated tokens; copy-on-write a shared, partly filled last block first."""
        s = self._get(seq_id)
        tokens = token_ids("tokens", tokens)
        bs, n = s.block_size, len(s.tokens)
        pool = self.pool
        tail_shared = bool(tokens) and n % bs != 0 and pool.ref_count(bs, s.table[-1]) > 1
        need = -(-(n + len(tokens)) // bs) - len(s.table) + (1 if tail_shared else 0)
        if need > pool.free_blocks(bs):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} new blocks of {bs} tokens, "
                              f"{pool.free_blocks(bs)} available")
        # ---- nothing can fail below ----
        copies = []
        if tail_shared:
            (dst,) = pool.allocate(bs, 1)
            src = s.table[-1]
            pool.set_valid(bs, dst, pool.valid_tokens(bs, src))
            pool.decref(bs, [src])
            s.table[-1] = dst
            copies.append((src, dst))
        s.table.extend(pool.allocate(bs, need - len(copies)))
        return self._fill(seq_id, s, tokens, n, copies, publish)

    def publish(self, seq_id, upto: int | None = None) -> int:
        """Make the sequence's full blocks findable by later prompts; returns how many joined the cache.

        ``upto``: only blocks wholly inside the first ``upto`` tokens (those whose K/V is written; a quantized
        cache keeps its newest tokens elsewhere until they are)."""
        s = self._get(seq_id)
        if not self.prefix_caching or not s.publishing:
            return 0
        bs, pool = s.block_size, self.pool
        before = pool.cached_blocks(bs)
        done = len(s.tokens) if upto is None else min(upto, len(s.tokens))
        for i in range(len(s.entries), done // bs):  # completed blocks not yet published
            key = pool.block_key(s.entries[-1] if s.entries else None, s.tokens[i * bs:(i + 1) * bs], s.extra_key)
            entry = pool.register(bs, s.table[i], key)
            if entry is None:  # the block caches other content (cannot happen for a filled table): stop the chain
                break
            s.entries.append(entry)
        return pool.cached_blocks(bs) - before

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent (parallel sampling, beam search)."""
        p = self._get(parent_id)
        hashable("child_id", child_id)
        if child_id in self._seqs:
            raise SequenceExists(f"sequence {child_id!r} already exists")
        self.pool.incref_unchecked(p.block_size, p.table)
        self._seqs[child_id] = p.copy()

    def free(self, seq_id, *, observe: bool = True) -> None:
        """Release the sequence; its blocks go back in reverse order, so shared prefixes are evicted last.
        ``observe=False``: the block-size policy does not learn from it (a sequence swapped out, not finished)."""
        s = self._get(seq_id)
        self.pool.decref_unchecked(s.block_size, reversed(s.table))
        if observe:
            self.policy.observe(len(s.tokens), s.prompt_len)
        del self._seqs[seq_id]

    def stop_publishing(self, seq_id) -> None:
        """The sequence's blocks never join the prefix cache from now on (its tokens were evicted, so they are no
        longer the prefix its K/V was computed with); forks inherit this. Blocks published before stay cached."""
        self._get(seq_id).publishing = False

    def publishes(self, seq_id) -> bool:
        """False once :meth:`stop_publishing` was called for the sequence (or a sequence it was forked from)."""
        return self._get(seq_id).publishing

    def published(self, seq_id) -> list[int]:
        """Prefix-cache entry ids of the sequence's published full blocks, in order (one per leading full block)."""
        return list(self._get(seq_id).entries)

    def extra_key(self, seq_id) -> object:
        return self._get(seq_id).extra_key

    def prompt_len(self, seq_id) -> int:
        return self._get(seq_id).prompt_len

    # ---- undo (for a cache whose K/V write failed after the tables changed) ----------
    def checkpoint(self, seq_id) -> Checkpoint:
        """What :meth:`restore` needs to undo the next unpublished add or append of ``seq_id`` (constant time)."""
        pool = self.pool
        s = self._seqs.get(seq_id) if seq_id in self else None
        if s is None or not s.table:
            return Checkpoint(seq_id, s is not None, len(s.tokens) if s else 0, 0, -1, 0, 0, pool.hits, pool.misses,
                              pool.clock)
        last = s.table[-1]
        return Checkpoint(seq_id, True, len(s.tokens), len(s.table), last,
                          *pool.block_state_unchecked(s.block_size, last), pool.hits, pool.misses, pool.clock)

    def restore(self, cp: Checkpoint, placement: Placement) -> None:
        """Undo the ``add``/``append(..., publish=False)`` that returned ``placement`` after ``cp`` was taken.

        Blocks it allocated go back to the head of the free queue (where allocation took them),
        prefix hits and a copy-on-write source get their references back, tokens and hit
        counters and the LRU clock (with the sequence's blocks' access times) are as before. Not undone: the
        access time of the free blocks it took (they go back uncached: no eviction order reads it), cached
        blocks that its allocation evicted stay evicted
        (their bytes may have been overwritten), pages it carved stay carved (and free), hit blocks
        that were free rejoin the queue's tail. This is the safety net for a write that fails after
        validation (a device error); bad arguments are refused before anything changes.
        """
        pool, s = self.pool, self._get(cp.seq_id)
        old_table = s.table[:cp.table_len - 1] + [cp.last_block] if cp.table_len else []
        bs = s.block_size
        changed = [i for i, b in enumerate(s.table) if i >= len(old_table) or old_table[i] != b]
        hits = placement.first // bs if not cp.existed else 0  # an add's leading prefix hits were not allocated
        allocated = [s.table[i] for i in changed if i >= hits]
        pool.incref(bs, [b for i, b in enumerate(old_table) if s.table[i] != b])  # copy-on-write sources
        pool.decref(bs, [s.table[i] for i in changed])
        pool.return_to_head(bs, allocated)  # back where allocation found them
        pool.hits, pool.misses = cp.hits, cp.misses
        pool.rewind_clock(cp.clock)
        if not cp.existed:
            del self._seqs[cp.seq_id]
            return
        if old_table:  # the old tail's valid tokens, and the LRU order as it was
            pool.set_block_state_unchecked(bs, cp.last_block, cp.tail_valid, cp.tail_access)
        s.table[:] = old_table
        del s.tokens[cp.num_tokens:]

    # ---- internals -----------------------------------------------------------------
    def _get(self, seq_id) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(f"no sequence {seq_id!r}") from None

    def _fill(self, seq_id, s: _Seq, new: list[int], first: int, copies: list, publish: bool) -> Placement:
        """Record ``new`` tokens at positions ``first...`` (blocks already allocated); publish full blocks."""
        bs, pool = s.block_size, self.pool
        s.tokens.extend(new)
        end = len(s.tokens)
        slots = [s.table[p // bs] * bs + p % bs for p in range(first, end)]
        i = first // bs  # the blocks from here on hold the new tokens (the table ends with them)
        pool.fill_unchecked(bs, s.table[i:], end - i * bs)
        if publish:
            self.publish(seq_id)
        return Placement(seq_id, bs, first, slots, copies)

    def check_invariants(self) -> None:
        """Assert the allocator's invariants (tests call this after every step)."""
        self.pool.check_invariants((s.block_size, s.table) for s in self._seqs.values())
        for sid, s in self._seqs.items():
            assert len(s.table) == math.ceil(len(s.tokens) / s.block_size), f"{sid}: table length"
            assert len(s.entries) <= len(s.tokens) // s.block_size, f"{sid}: entries past the full blocks"

    # ---- plans made on a clone (compaction, eviction, a swap-in), then adopted ------------
    def clone(self) -> BlockManager:
        """An independent copy of the pool, the sequences and the policy's state."""
        new = object.__new__(BlockManager)
        new.pool, new.prefix_caching = self.pool.clone(), self.prefix_caching
        new.policy_config, new.policy = self.policy_config, self.policy.copy()
        new._seqs = {sid: s.copy() for sid, s in self._seqs.items()}
        return new

    def adopt(self, clone: BlockManager) -> None:
        """Make a :meth:`clone`'s pool state and sequences this manager's, once the plan made on it can no longer
        fail. The pool object stays (the cache and a tier below hold it); the policy's state is this manager's."""
        self.pool.adopt(clone.pool)
        self._seqs = clone._seqs

    def insert(self, seq_id, block_size: int, table: Sequence[int], tokens: Sequence[int], *, prompt_len: int,
               extra_key: object = None, publishing: bool = True) -> None:
        """A sequence over ``table``, whose blocks already count it as a holder (the caller took the references: a
        swap-in rebuilding tables on a clone). Unchecked; nothing is published."""
        self._seqs[seq_id] = _Seq(block_size, list(table), list(tokens), [], prompt_len, extra_key, publishing)

    def rewrite(self, seq_id, table: list[int], tokens: list[int], keep_published: int) -> None:
        """The sequence's table and tokens replaced (an eviction planned on a clone: the caller moved the
        references), its first ``keep_published`` published entries kept. Unchecked."""
        s = self._get(seq_id)
        s.table, s.tokens, s.entries = table, tokens, s.entries[:keep_published]

    def fingerprint(self) -> int:
        """A hash of the pool's state and every sequence's block size, table and length."""
        seqs = tuple((sid, s.block_size, tuple(s.table), len(s.tokens), tuple(s.entries), s.publishing)
                     for sid, s in self._seqs.items())
        return hash((self.pool.fingerprint(), seqs))

    def move_blocks(self, block_size: int, moves: Sequence[tuple[int, int]]) -> None:
        """:meth:`BlockPool.move_blocks`, then every block table of this size class follows the moves."""
        moves = list(moves)
        self.pool.move_blocks(block_size, moves)
        rename = {int(s): int(d) for s, d in moves}
        for s in self._seqs.values():
            if s.block_size == block_size:
                s.table = [rename.get(b, b) for b in s.table]

    def rehome(self, seq_id, block_size: int, blocks: Sequence[int]) -> list[int]:
        """Move a sequence into another size class; returns its old block table.

        ``blocks`` (``ceil(num_tokens / block_size)`` of them, takeable as in :meth:`BlockPool.take`)
        become its table, its old blocks are released (a ref count down each, so shared blocks stay
        with their other holders), and its full new blocks join the prefix cache. The K/V of token
        ``p`` must be copied by the caller from ``old_table[p // old_bs] * old_bs + p % old_bs`` to
        the new slot mapping. All or nothing.
        """
        s = self._get(seq_id)
        pool = self.pool
        pool.check_block_size(block_size)
        blocks = list(blocks)
        n = len(s.tokens)
        if len(blocks) != -(-n // block_size):
            raise ValueError(f"blocks must hold {n} tokens in blocks of {block_size}: "
                             f"{-(-n // block_size)} blocks, got {len(blocks)}")
        pool.take(block_size, blocks)  # validates before it changes anything
        # ---- nothing can fail below ----
        blocks = [int(b) for b in blocks]
        old, old_bs = s.table, s.block_size
        s.block_size, s.table, s.entries = block_size, blocks, []
        for i, bid in enumerate(blocks):
            pool.set_valid(block_size, bid, min(block_size, n - i * block_size))
        self.publish(seq_id)
        pool.decref(old_bs, reversed(old))
        return old
