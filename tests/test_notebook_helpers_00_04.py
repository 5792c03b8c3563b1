"""The package functions notebooks 00, 01, 02 and 04 call instead of computing or formatting in their cells."""

import pytest
from workbench.kernels.gather import check_against_reference

from workbench.allocator import BlockManager, BlockPool
from workbench.analysis import allocation_waste, coalescing
from workbench.analysis.allocator_scenarios import (
    adaptive_blocks,
    fork_checks,
    format_adaptive,
    format_fork_checks,
    shared_prompt,
)
from workbench.core import kv_spec
from workbench.results import run_files
from workbench.sim import sweeps

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)


# ------------------------------------------------------------------------------------------------ 00: memory
def test_max_len_rows_are_the_contiguous_breakdown_of_the_same_requests():
    bpt = kv_spec.model("llama-7b").bytes_per_token("fp16")
    rows = allocation_waste.max_len_rows(64, [512, 2048, 8192], seed=0, bytes_per_token=bpt)
    assert [r["max_len"] for r in rows] == [512, 2048, 8192]
    for r in rows:
        current, final = allocation_waste.random_batch(64, r["max_len"], 0)
        contiguous = allocation_waste.contiguous_breakdown(current, final, r["max_len"], bpt)
        assert r["token_share"] == contiguous["token_share"]
        assert r["cut_off"] == sum(f == r["max_len"] for f in final) and r["num_requests"] == 64
    assert [r["cut_off"] for r in rows] == [20, 1, 0]  # what the tour quotes
    shares = [r["token_share"] for r in rows]
    assert shares == sorted(shares, reverse=True)  # a longer cap reserves more


def test_format_comparison_and_max_len_rows():
    current, final = allocation_waste.random_batch(64, 2048, 0)
    compared = allocation_waste.compare_allocation(current, final, 2048, 16, 2**19)
    assert allocation_waste.format_comparison(compared).splitlines() == [
        "contiguous (reserve max_len)    64.00 GiB, token states  10.0%",
        "paged (16-token blocks)          6.63 GiB, token states  96.5%"]
    rows = [{"max_len": 512, "token_share": 0.299, "cut_off": 20, "num_requests": 64}]
    assert allocation_waste.format_max_len_rows(rows) == ("max_len  512: contiguous token states 29.9%, 20 of 64 "
                                                          "requests cut off at max_len")
    assert allocation_waste.format_max_len_rows([]) == ""


# ------------------------------------------------------------------------------------------------ 00: gather
def test_gather_check_against_reference():
    assert check_against_reference(seq_lens=(9, 0, 20), block_size=8, head_dim=16, num_blocks=8) == {
        "nhd": True, "hnd": True, "vllm": True}
    assert check_against_reference(["vllm"], kind="v", block_size=4, head_dim=16, seq_lens=(5,), num_blocks=2) == {
        "vllm": True}
    with pytest.raises(ValueError, match="num_blocks"):
        check_against_reference(seq_lens=(40,), block_size=16, num_blocks=2)


# --------------------------------------------------------------------------------------- 01: allocator, cache
def test_ref_counts_follow_a_fork_and_copy_on_write():
    m = BlockManager(BlockPool(num_pages=8, page_tokens=4))
    m.add("parent", [11, 12, 13, 14, 15, 16])
    assert m.ref_counts("parent") == [1, 1]
    m.fork("parent", "child")
    assert m.ref_counts("parent") == m.ref_counts("child") == [2, 2]
    m.append("child", [17])  # the shared, partly filled block is copied
    assert m.ref_counts("parent") == [2, 1] and m.ref_counts("child") == [2, 1]


def test_sharing_summary():
    r = shared_prompt()
    assert r.summary() == "18 blocks for 8 sequences (unshared: 32), saved 44%, CoW copies 4, prefix hits 6"


def test_adaptive_blocks():
    result = adaptive_blocks([(30, 100), (700, 2000), (10, 50)], num_pages=64, page_tokens=64, small=16, large=64,
                             threshold=512)
    assert [(r["block_size"], r["blocks"], r["waste"]) for r in result["requests"]] == [(16, 2, 2), (64, 11, 4),
                                                                                         (16, 1, 6)]
    assert result["waste"] == 12
    s = result["stats"]
    assert s["used_slots"] == 740 + 12 and s["used_slots"] + s["free_slots"] == s["total_slots"] == 4096
    for r in result["requests"]:
        assert 0 <= r["waste"] < r["block_size"]
    text = format_adaptive(result).splitlines()
    assert text[0] == "request 0:    30 tokens -> 16-token blocks, 2 blocks, waste 2 slots"
    assert text[-1] == "used 752 free 3344 total 4096" and len(text) == 4


def test_fork_checks():
    checks = fork_checks(["nhd", "vllm"], num_layers=1, num_kv_heads=1, head_dim=16, prompt_len=5, new_tokens=2,
                         num_pages=4, page_tokens=4)
    assert list(checks) == ["nhd", "vllm"]
    for layout, c in checks.items():
        assert c.exact and c.copies == [(1, 2)] and c.layout == layout
        assert c.cache.manager.block_table("b") == [0, 2] and c.cache.manager.num_tokens("b") == 7
        assert c.total_bytes == c.cache.total_bytes
    lines = format_fork_checks(checks).splitlines()
    assert len(lines) == 2 and lines[0].startswith("nhd   CoW copies [(1, 2)], gathered K/V exact: True, pool ")


def test_pick():
    rows = [{"op": "a", "n": 1, "v": 1}, {"op": "a", "n": 2, "v": 2}, {"op": "a", "n": 2, "v": 3}]
    assert run_files.pick(rows, op="a", n=1)["v"] == 1
    assert run_files.pick(rows, n=2)["v"] == 3  # the last match: the newest run's
    assert run_files.pick(rows, n=lambda n: n > 1)["v"] == 3
    with pytest.raises(ValueError, match="no row matches"):
        run_files.pick(rows, op="b")


# ----------------------------------------------------------------------------------------------- 02: coalescing
def test_format_addressing():
    text = coalescing.format_addressing([("nhd", "k"), ("vllm", "v")], 16, 8, 128, 2).splitlines()
    assert text == ["nhd  k: s_blk=16384 s_tok=1024 s_head=128 s_dgrp=128 s_d=1 x=128",
                    "        token 0 bytes [0, 2, 4]..[16, 18], token 1 bytes [2048, 2050, 2052]",
                    "vllm v: s_blk=16384 s_tok=1 s_head=2048 s_dgrp=2048 s_d=16 x=128",
                    "        token 0 bytes [0, 32, 64]..[256, 288], token 1 bytes [2, 34, 66]"]


def test_analyze_configs_and_format_analyses():
    configs = [("nhd K fp16", "nhd", "k", 128, 2, 0), ("vllm V fp16", "vllm", "v", 128, 2, 0),
               ("nhd K fp16 +2 B", "nhd", "k", 128, 2, 2)]
    analyses = coalescing.analyze_configs(configs, block_size=16, num_kv_heads=8, block_n=64)
    assert list(analyses) == ["nhd K fp16", "vllm V fp16", "nhd K fp16 +2 B"]
    assert analyses["nhd K fp16"].token.line_efficiency == 1.0
    assert analyses["vllm V fp16"].token.line_efficiency == pytest.approx(1 / 16)
    assert analyses["nhd K fp16 +2 B"].tile.lane_bytes == 2 and not analyses["nhd K fp16 +2 B"].aligned
    same = coalescing.analyze("vllm", "v", 16, 8, 128, 2, block_n=64)
    assert analyses["vllm V fp16"].tile == same.tile
    lines = coalescing.format_analyses(analyses).splitlines()
    assert lines[0] == "16-token blocks, 8 kv heads; one token's read:"
    assert lines[3] == "vllm V fp16            True     32.00   128.00     0.062       0.062       2"
    assert lines[6] == "one 64-token tile's read:" and len(lines) == 11
    assert lines[-1] == "nhd K fp16 +2 B           0.670       0.895       2       256           1.48"


def test_seed_rule_rows():
    m = kv_spec.model("llama3-8b")
    rows = coalescing.seed_rule_rows(coalescing.H200_L2_BYTES, m, [("fp16", "fp16"), ("fp8", "fp8_e4m3")])
    assert [r["tokens"] for r in rows] == [102_400, 204_800]
    assert rows[0]["per_kv_head"] == 12_800 and rows[0]["per_layer"] == 400
    assert coalescing.format_seed_rule(rows[:1]) == ("fp16: L2 / (2 * 128 * 2) = 102,400 tokens; / 8 kv heads = "
                                                     "12,800; / 32 layers more = 400")


# ------------------------------------------------------------------------------------------- 04: the simulator
def test_format_run():
    r = {"label": "paged (B=16)", "shares": {"token_states": 97.0, "reservation": 1.6}, "mean_batch": 35.12,
         "copied_tokens": 0}
    assert sweeps.format_run(r) == ("paged (B=16)                       token_states  97.0 reservation   1.6 | "
                                    "batch  35.1, copied 0 tokens")
    live = sweeps.simulate("alpaca", "paged", 16, n=50)
    assert sweeps.format_run(live).startswith(f"{live['label']:34s} token_states ")


def test_format_block_size_sweep():
    sweep = {"sharegpt": {1: {"token_states": 98.61}, 16: {"token_states": 97.0}},
             "alpaca": {1: {"token_states": 88.5}, 16: {"token_states": 83.44}}}
    assert sweeps.format_block_size_sweep(sweep).splitlines() == [
        "token states (%) by block size",
        "                1     16",
        "sharegpt     98.6   97.0",
        "alpaca       88.5   83.4"]
    assert sweeps.format_block_size_sweep(sweep, "token_states") == sweeps.format_block_size_sweep(sweep)
