"""Memory accounting of contiguous vs paged allocation."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workbench import memory, spec


def test_paged_waste_is_last_block_tail():
    b = memory.paged_breakdown([1, 16, 17], block_size=16, bytes_per_token=1)
    assert b["token_states"] == 34 and b["internal_fragmentation"] == 15 + 0 + 15
    assert b["total"] == 64


def test_contiguous_reservation_and_fragmentation():
    b = memory.contiguous_breakdown([10, 5], [20, 5], max_len=32, bytes_per_token=2)
    assert b["token_states"] == 30 and b["reservation"] == 20 and b["internal_fragmentation"] == 2 * (12 + 27)


@given(st.lists(st.integers(0, 5000), max_size=50), st.integers(1, 256))
def test_paged_shares_add_up(lengths, block_size):
    b = memory.paged_breakdown(lengths, block_size, 1)
    assert b["token_states"] + b["internal_fragmentation"] == b["total"]
    assert 0 <= b["internal_fragmentation"] <= len(lengths) * (block_size - 1)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="block_size"):
        memory.blocks_for(3, 0)
    with pytest.raises(ValueError, match="current <= final"):
        memory.contiguous_breakdown([5], [4], 10, 1)
    with pytest.raises(ValueError, match="kv_dtype"):
        spec.dtype_size("fp7")
    with pytest.raises(ValueError, match="num_q_heads"):
        spec.ModelSpec("x", 1, 3, 64, 4)


def test_llama13b_is_800kb_per_token():
    assert spec.model("llama-13b").bytes_per_token("fp16") == 800 * 1024
