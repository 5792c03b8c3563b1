"""Memory accounting of contiguous vs paged allocation."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workbench.analysis import allocation_waste
from workbench.core import kv_spec


def test_paged_waste_is_last_block_tail():
    b = allocation_waste.paged_breakdown([1, 16, 17], block_size=16, bytes_per_token=1)
    assert b["token_states"] == 34 and b["internal_fragmentation"] == 15 + 0 + 15
    assert b["total"] == 64


def test_contiguous_reservation_and_fragmentation():
    b = allocation_waste.contiguous_breakdown([10, 5], [20, 5], max_len=32, bytes_per_token=2)
    assert b["token_states"] == 30 and b["reservation"] == 20 and b["internal_fragmentation"] == 2 * (12 + 27)


@given(st.lists(st.integers(0, 5000), max_size=50), st.integers(1, 256))
def test_paged_shares_add_up(lengths, block_size):
    b = allocation_waste.paged_breakdown(lengths, block_size, 1)
    assert b["token_states"] + b["internal_fragmentation"] == b["total"]
    assert 0 <= b["internal_fragmentation"] <= len(lengths) * (block_size - 1)


MAX_LENS = [256, 512, 1024, 2048, 4096, 8192]  # the tour panel's max_len slider range, doubling


@given(st.integers(0, 2**32 - 1), st.integers(16, 200), st.integers(1, 20000))
def test_random_batch_lengths_are_capped_by_max_len_and_independent_of_it(seed, num_requests, any_max_len):
    batches = {m: allocation_waste.random_batch(num_requests, m, seed) for m in [*MAX_LENS, any_max_len]}
    uncapped = allocation_waste.random_batch(num_requests, 10**9, seed)[1]
    for m, (current, final) in batches.items():
        assert len(current) == len(final) == num_requests
        assert all(1 <= c <= f <= m for c, f in zip(current, final, strict=True))
        assert final == [min(n, m) for n in uncapped]  # the workload's lengths, cut at the server's cap


@given(st.integers(0, 2**32 - 1), st.integers(32, 200), st.sampled_from([1, 16, 64]))
def test_contiguous_token_share_falls_as_max_len_grows(seed, num_requests, block_size):
    shares = []
    for m in MAX_LENS:
        current, final = allocation_waste.random_batch(num_requests, m, seed)
        contiguous = allocation_waste.compare_allocation(current, final, m, block_size, bytes_per_token=1)
        shares.append(contiguous["contiguous (reserve max_len)"]["token_share"])
    assert all(a > b for a, b in zip(shares[:-1], shares[1:], strict=True)), shares


def test_random_batch_median_is_in_the_hundreds():
    final = allocation_waste.random_batch(4001, max_len=10**9, seed=3)[1]
    assert 250 <= sorted(final)[2000] <= 350  # MEDIAN_LEN = 300, not tied to max_len
    assert max(final) > 10 * allocation_waste.MEDIAN_LEN  # heavy tail: some requests are very long


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="block_size"):
        allocation_waste.blocks_for(3, 0)
    with pytest.raises(ValueError, match="current <= final"):
        allocation_waste.contiguous_breakdown([5], [4], 10, 1)
    with pytest.raises(ValueError, match="max_len"):
        allocation_waste.random_batch(4, 0)
    with pytest.raises(ValueError, match="median"):
        allocation_waste.random_batch(4, 100, median=0)
    with pytest.raises(ValueError, match="kv_dtype"):
        kv_spec.dtype_size("fp7")
    with pytest.raises(ValueError, match="num_q_heads"):
        kv_spec.ModelSpec("x", 1, 3, 64, 4)


def test_llama13b_is_800kb_per_token():
    assert kv_spec.model("llama-13b").bytes_per_token("fp16") == 800 * 1024
