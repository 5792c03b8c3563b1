"""The block allocator: unit cases, and hypothesis state machines checking its invariants
(ref counts = holders, nothing both free and used, free + used = total, every sequence's
tokens readable back through its block table) and that a failed operation changes nothing."""

import copy

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from workbench.allocator import (
    BlockManager,
    BlockPool,
    ByExpectedLength,
    FixedBlockSize,
    OutOfBlocks,
    SequenceExists,
    UnknownSequence,
)


def snapshot(m: BlockManager):
    """Everything the allocator holds, for 'a failed operation changed nothing' checks."""
    pool = m.pool
    classes = {
        bs: (list(c.ref), list(c.valid), list(c.key), list(c.entry), list(c.free), sorted(c.pages),
             dict(c.free_in_page), dict(c.cached), list(c.last_access))
        for bs, c in pool._classes.items()
    }
    return (classes, list(pool._uncarved), pool.hits, pool.misses, pool.evictions, pool._clock,
            pool._next_entry, copy.deepcopy(m._seqs))


def test_fork_shares_and_copy_on_write_copies_once():
    m = BlockManager(BlockPool(8, 4))
    p = m.add("a", [1, 2, 3, 4, 5, 6])
    assert p.slots == [0, 1, 2, 3, 4, 5] and p.copies == []
    m.fork("a", "b")
    assert m.block_table("b") == [0, 1] and m.pool.ref_count(4, 1) == 2
    pb = m.append("b", [7])  # shared, partly filled last block: copy first
    assert pb.copies == [(1, 2)] and m.block_table("b") == [0, 2] and pb.slots == [2 * 4 + 2]
    pa = m.append("a", [9])  # now a is the only holder of block 1: write in place
    assert pa.copies == [] and pa.slots == [1 * 4 + 2]
    assert m.pool.ref_count(4, 0) == 2  # the full block stays shared
    m.check_invariants()


def test_prefix_cache_reuses_full_blocks_until_evicted():
    pool = BlockPool(4, 4)
    m = BlockManager(pool)
    system = [7, 7, 7, 7, 8, 8, 8, 8]
    m.add("a", system + [1])
    m.free("a")
    p = m.add("b", system + [2, 3])
    assert p.first == 8 and m.block_table("b")[:2] == [0, 1] and pool.hits == 2
    m.free("b")
    # Fill the pool: the cached blocks are evicted oldest first, only when nothing clean is left.
    m.add("c", list(range(16)))
    assert pool.evictions == 2 and pool.cached_blocks() == 4  # c's own full blocks are cached now
    m.check_invariants()


def test_whole_prompt_cached_still_computes_last_block():
    m = BlockManager(BlockPool(8, 4))
    m.add("a", [1, 2, 3, 4, 5, 6, 7, 8])
    p = m.add("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert p.first == 4 and len(p.slots) == 4  # the block holding the last token is recomputed


def test_extra_key_separates_caches():
    m = BlockManager(BlockPool(8, 4))
    m.add("a", [1, 2, 3, 4, 5], extra_key="lora-1")
    assert m.add("b", [1, 2, 3, 4, 5], extra_key="lora-2").first == 0
    assert m.add("c", [1, 2, 3, 4, 5], extra_key="lora-1").first == 4


def test_adaptive_block_sizes_share_pages_exactly():
    pool = BlockPool(4, 16, block_sizes=[4, 16])
    m = BlockManager(pool, ByExpectedLength(small=4, large=16, threshold=8))
    m.add("short", [1, 2, 3], expected_len=6)
    m.add("long", list(range(20)), expected_len=100)
    assert m.block_size("short") == 4 and m.block_size("long") == 16
    assert pool.used_slots() == 4 + 32 and pool.free_slots() == 64 - 36
    m.free("short")
    m.check_invariants()
    # the small-block page is fully free again, so a large block can take it back
    m.add("long2", [9] * 32, expected_len=100)
    assert pool.free_slots() == 0
    m.check_invariants()


def test_running_average_policy_learns_output_length():
    policy = ByExpectedLength(small=4, large=16, threshold=20)
    m = BlockManager(BlockPool(16, 16, block_sizes=[4, 16]), policy)
    m.add("a", [1] * 5)
    assert m.block_size("a") == 4  # nothing observed yet: expected = prompt length
    m.append("a", [2] * 30)
    m.free("a")
    assert m.policy.average_output == 30
    m.add("b", [1] * 5)
    assert m.block_size("b") == 16


@pytest.mark.parametrize("bs", [1, 2, 3, 7, 16, 100, 256])
def test_any_block_size_works_with_fixed_policy(bs):
    m = BlockManager(BlockPool(6, bs), FixedBlockSize(bs))
    m.add("a", list(range(bs + 1)))
    m.fork("a", "b")
    m.append("b", [5] * bs)
    assert m.num_tokens("b") == 2 * bs + 1
    m.check_invariants()


def test_errors_are_specific_and_change_nothing():
    m = BlockManager(BlockPool(3, 4))
    m.add("a", [1, 2, 3, 4, 5])
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match="needs 2 new blocks"):
        m.add("b", list(range(8)))
    with pytest.raises(OutOfBlocks):
        m.append("a", list(range(8)))
    with pytest.raises(SequenceExists):
        m.add("a", [1])
    with pytest.raises(UnknownSequence, match="no sequence 'zz'"):
        m.append("zz", [1])
    with pytest.raises(UnknownSequence):
        m.free("zz")
    with pytest.raises(SequenceExists):
        m.fork("a", "a")
    with pytest.raises(ValueError, match="block_size must be one of"):
        m.pool.allocate(8, 1)
    with pytest.raises(ValueError, match="pos"):
        m.locate("a", 5)
    assert snapshot(m) == before
    for kwargs, match in [({"num_pages": 0, "page_tokens": 4}, "num_pages"),
                          ({"num_pages": 2, "page_tokens": 6, "block_sizes": [4]}, "divide")]:
        with pytest.raises(ValueError, match=match):
            BlockPool(**kwargs)


# ---- state machine ----------------------------------------------------------------------
VOCAB = st.integers(0, 3)  # a tiny vocabulary, so prefixes collide and the cache gets hits
SYSTEM = [3, 1, 2, 0, 1, 1, 3, 2, 0, 0, 2, 1, 3, 3, 0, 2]


class AllocatorMachine(RuleBasedStateMachine):
    """Random add / append / fork / free / evict; a model of every slot's content checks the tables."""

    config = {"num_pages": 6, "page_tokens": 4, "block_sizes": None, "policy": None}

    @initialize()
    def setup(self):
        cfg = self.config
        policy = cfg["policy"]() if cfg["policy"] else None
        self.m = BlockManager(BlockPool(cfg["num_pages"], cfg["page_tokens"], cfg["block_sizes"]), policy)
        self.content = {}  # (block_size, slot) -> token: what a KV write would have stored
        self.model = {}  # seq id -> tokens
        self.next_id = 0

    def _attempt(self, op, *args, **kwargs):
        before = snapshot(self.m)
        try:
            return op(*args, **kwargs)
        except OutOfBlocks:
            event("out of blocks")
            assert snapshot(self.m) == before, "a failed operation changed the allocator"
            return None

    @rule(prompt=st.lists(VOCAB, min_size=0, max_size=14), with_system=st.booleans(),
          expected=st.none() | st.integers(1, 40))
    def add(self, prompt, with_system, expected):
        tokens = (SYSTEM[:8] if with_system else []) + prompt
        sid = self.next_id
        self.next_id += 1
        if not tokens:
            before = snapshot(self.m)
            with pytest.raises(ValueError, match="prompt"):
                self.m.add(sid, tokens, expected_len=expected)
            assert snapshot(self.m) == before, "a refused add changed the allocator"
            return
        p = self._attempt(self.m.add, sid, tokens, expected_len=expected)
        if p is not None:
            self.model[sid] = tokens
            self._write(p, tokens[p.first:])
            if p.first:
                event("prefix hit")

    def _write(self, p, new_tokens):
        bs = p.block_size
        for src, dst in p.copies:
            for off in range(bs):
                if (bs, src * bs + off) in self.content:
                    self.content[(bs, dst * bs + off)] = self.content[(bs, src * bs + off)]
        assert len(p.slots) == len(new_tokens)
        for slot, tok in zip(p.slots, new_tokens, strict=True):
            self.content[(bs, slot)] = tok

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=st.lists(VOCAB, min_size=1, max_size=9))
    def append(self, data, tokens):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        p = self._attempt(self.m.append, sid, tokens)
        if p is not None:
            self.model[sid] = self.model[sid] + tokens
            self._write(p, tokens)
            if p.copies:
                event("copy on write")

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        child = self.next_id
        self.next_id += 1
        self.m.fork(sid, child)
        self.model[child] = list(self.model[sid])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.m.free(sid)
        del self.model[sid]

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        self.m.pool.evict(n)

    @rule()
    def unknown_sequence_fails_cleanly(self):
        before = snapshot(self.m)
        with pytest.raises(UnknownSequence):
            self.m.append(-1, [1])
        assert snapshot(self.m) == before

    @invariant()
    def invariants_hold(self):
        self.m.check_invariants()

    @invariant()
    def every_sequence_reads_back(self):
        for sid, tokens in self.model.items():
            assert self.m.tokens(sid) == tokens
            bs = self.m.block_size(sid)
            got = [self.content.get((bs, slot)) for slot in self.m.slot_mapping(sid)]
            assert got == tokens, f"sequence {sid} reads {got}, wrote {tokens}"


def _machine(name, **config):
    cls = type(name, (AllocatorMachine,), {"config": {**AllocatorMachine.config, **config}})
    cls.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,  # 150 before CI ran short
                                     suppress_health_check=[HealthCheck.too_slow])
    return cls.TestCase


TestFixed4 = _machine("Fixed4", num_pages=6, page_tokens=4)
TestFixed1 = _machine("Fixed1", num_pages=24, page_tokens=1)
TestFixed16 = _machine("Fixed16", num_pages=3, page_tokens=16)
TestAdaptive = _machine("Adaptive", num_pages=5, page_tokens=8, block_sizes=[2, 8],
                        policy=lambda: ByExpectedLength(small=2, large=8, threshold=12))


# ---- eviction order, asserted exactly (the order is stated in allocator/free_queue.py) ------------
def test_freed_blocks_queue_lru_and_cached_blocks_are_evicted_only_when_memory_is_full():
    m = BlockManager(BlockPool(6, 4))
    m.add("a", list(range(1, 9)))  # blocks 0, 1
    m.add("b", list(range(11, 19)))  # blocks 2, 3
    m.free("a")  # a sequence frees last-to-first: its prefix sits behind its tail
    m.free("b")
    view = m.pool.size_class(4)
    assert view.free_queue() == (1, 0, 3, 2)
    assert [view.is_cached(b) for b in (0, 1, 2, 3)] == [True, True, True, True]
    assert m.pool.allocate(4, 1) == [4]  # clean memory first: page 4 is carved, block 1 stays cached
    assert m.pool.allocate(4, 1) == [5]
    assert view.free_queue() == (1, 0, 3, 2) and m.pool.evictions == 0
    assert m.pool.allocate(4, 1) == [1]  # memory is full: the head is evicted
    assert m.pool.evictions == 1 and not view.is_cached(1)
    assert m.pool.allocate(4, 2) == [0, 3]
    assert view.free_queue() == (2,) and m.pool.evictions == 3


def test_carved_page_joins_the_head_in_ascending_ids():
    pool = BlockPool(3, 8, [4])  # two blocks per page
    assert pool.allocate(4, 1) == [0]
    assert pool.size_class(4).free_queue() == (1,)
    pool.decref(4, [0])
    assert pool.size_class(4).free_queue() == (1, 0)
    assert pool.allocate(4, 3) == [1, 0, 2]  # the queue's two, then page 1 carved at the head
    assert pool.size_class(4).free_queue() == (3,)


def test_prefix_hit_takes_its_block_out_of_the_middle_of_the_queue():
    m = BlockManager(BlockPool(8, 4))
    m.add("a", list(range(1, 13)))  # blocks 0, 1, 2
    m.add("b", [50, 51, 52, 53, 54])  # blocks 3, 4
    m.free("a")
    m.free("b")
    assert m.pool.size_class(4).free_queue() == (2, 1, 0, 4, 3)
    assert m.add("c", [1, 2, 3, 4, 99]).first == 4  # hits block 0 only
    assert m.block_table("c")[0] == 0
    assert m.pool.size_class(4).free_queue() == (2, 1, 4, 3)
    m.check_invariants()
