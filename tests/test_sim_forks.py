"""Request groups sharing blocks (workbench.sim.forks): hand-worked copy-on-write counts, reference counts
against the block allocator, invariants on random small traces, argument checks, the command line."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from workbench.allocator import BlockManager, BlockPool
from workbench.commands import sim as sim_command
from workbench.sim import forks, forks_report, forks_serving
from workbench.sim import traces as tr
from workbench.sim.budget import slots_budget


def trace_of(pairs, name="small"):
    return tr.Trace(name, tuple(tr.Request(i, 0.0, p, o) for i, (p, o) in enumerate(pairs)))


# ------------------------------------------------------------------------------------------ hand-worked examples
def test_parallel_copies_the_partial_prompt_block_n_minus_1_times():
    # 20-token prompt = one full block A + a 4-token block P, held by 3 samples (ref 3). Step 0: sample 0 finds
    # P shared -> copy (P ref 2); sample 1 -> copy (P ref 1); sample 2 writes in place. Blocks: A, P, 2 copies.
    g = forks.simulate_group(20, 3, "parallel", 3, check=True)
    assert g.cow == 2 and g.leaked == 0
    assert g.shared.tolist() == [4, 4, 4] and g.unshared.tolist() == [6, 6, 6]


def test_parallel_prompt_of_whole_blocks_needs_no_copy():
    # 32 tokens = 2 full blocks shared by 3; each sample's first token opens a private block: 2 + 3 in use
    g = forks.simulate_group(32, 2, "parallel", 3, check=True)
    assert g.cow == 0 and g.shared.tolist() == [5, 5] and g.unshared.tolist() == [9, 9]


def test_beam_always_from_the_best_copies_its_partial_tail_every_step():
    # p_top = 1: at every step t >= 1 both beams are children of beam 0, sharing its tail; the first writer copies
    # it unless the tail is full (length 16 + t a multiple of 16: t = 16), so 18 tokens cost 16 copies.
    g = forks.simulate_group(16, 18, "beam", 2, p_top=1.0, check=True)
    assert g.cow == 16 and g.leaked == 0
    assert g.shared[:4].tolist() == [3, 3, 3, 3] and g.unshared[:4].tolist() == [4, 4, 4, 4]


def test_beam_that_never_switches_is_parallel_sampling():
    a = forks.simulate_group(37, 50, "beam", 4, p_top=0.0, check=True)
    b = forks.simulate_group(37, 50, "parallel", 4, check=True)
    assert a.cow == b.cow == 3
    assert np.array_equal(a.shared, b.shared) and np.array_equal(a.unshared, b.unshared)


@pytest.mark.parametrize("mode", forks.MODES)
def test_one_sequence_saves_nothing(mode):
    res = forks_serving.serve(trace_of([(5, 9), (40, 30), (16, 17)]), mode, 1, check=True)
    assert res.saving() == 0.0 and res.cow == 0 and res.completed == 3
    assert np.array_equal(res.rows["shared"], res.rows["unshared"])


def test_parallel_saving_scales_exactly_as_n_minus_1_over_n():
    # saved = (n - 1) floor(p / B) per step, unshared = n ceil(len / B): saving(n) = (n - 1) / n x a trace constant
    t = tr.load("sharegpt").head(50)
    s2, s4, s6 = (forks.lifetime_saving(t, "parallel", n) for n in (2, 4, 6))
    assert s4 / s2 == pytest.approx(1.5) and s6 / s2 == pytest.approx(5 / 3)


def test_parallel_matches_its_closed_form():
    for p, o, n in [(20, 3, 3), (5, 40, 2), (100, 77, 6), (16, 1, 4)]:
        g = forks.simulate_group(p, o, "parallel", n)
        assert 1 - g.shared.sum() / g.unshared.sum() == pytest.approx(forks.theory_parallel(p, o, n))


# ------------------------------------------------------------------------------- against the real block allocator
def replay_on_block_manager(p, o, mode, n, p_top, bs, seed):
    """The same forks, frees and appends on workbench.allocator.BlockManager: blocks in use per step, copies."""
    pool = BlockPool(n * (-(-(p + o) // bs) + 1) + 2, bs)
    m = BlockManager(pool, prefix_caching=False)
    m.add(0, list(range(p)))
    ids, nxt, cow, used = list(range(n)), n, 0, []
    for i in ids[1:]:
        m.fork(0, i)
    top = (np.random.default_rng(seed).random((o - 1, n)) < p_top).tolist() if mode == "beam" and n > 1 else None
    for t in range(o):
        for i in range(1, n):
            if t and top and top[t - 1][i]:
                m.free(ids[i])
                m.fork(ids[0], nxt)
                ids[i], nxt = nxt, nxt + 1
        for sid in ids:
            cow += len(m.append(sid, [7]).copies)
        m.check_invariants()
        used.append(pool.num_blocks(bs) - pool.free_blocks(bs))
    for sid in ids:
        m.free(sid)
    assert pool.free_blocks(bs) == pool.num_blocks(bs)
    return used, cow


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=hs.integers(1, 70),
    o=hs.integers(1, 40),
    mode=hs.sampled_from(forks.MODES),
    n=hs.integers(1, 5),
    p_top=hs.sampled_from([0.0, 0.3, 0.7, 1.0]),
    bs=hs.sampled_from([1, 4, 16]),
    seed=hs.integers(0, 99),
)
def test_reference_counts_agree_with_the_block_allocator(p, o, mode, n, p_top, bs, seed):
    g = forks.simulate_group(p, o, mode, n, block_size=bs, p_top=p_top, rng=seed, check=True)
    used, cow = replay_on_block_manager(p, o, mode, n, p_top, bs, seed)
    assert g.shared.tolist() == used and g.cow == cow and g.leaked == 0


# ------------------------------------------------------------------------------------- invariants, random traces
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pairs=hs.lists(hs.tuples(hs.integers(1, 60), hs.integers(1, 30)), min_size=1, max_size=6),
    mode=hs.sampled_from(forks.MODES),
    n=hs.integers(1, 4),
    p_top=hs.floats(0, 1),
    bs=hs.sampled_from([1, 3, 16]),
    slots=hs.integers(16, 400),
)
def test_server_invariants_on_random_small_traces(pairs, mode, n, p_top, bs, slots):
    t = trace_of(pairs)
    res = forks_serving.serve(t, mode, n, block_size=bs, p_top=p_top, budget=slots_budget(slots), check=True)
    sh, un = res.rows["shared"], res.rows["unshared"]
    assert res.leaked == 0 and (sh >= 0).all()
    assert (sh <= un).all() and (sh <= res.budget_blocks).all()
    assert res.completed + res.rejected == len(pairs)
    assert (res.rows["seqs"] <= 256).all() and 0 <= res.saving() <= 1
    if not res.rejected:  # whole lifetimes, counted once whatever the schedule
        curves = [
            forks.simulate_group(p, o, mode, n, block_size=bs, p_top=p_top, rng=np.random.default_rng([0, i]))
            for i, (p, o) in enumerate(pairs)
        ]
        assert sh.sum() == sum(c.shared.sum() for c in curves) and un.sum() == sum(c.unshared.sum() for c in curves)
        assert res.saving() == pytest.approx(forks.lifetime_saving(t, mode, n, block_size=bs, p_top=p_top))
    if n == 1:
        assert res.saving() == 0


def test_saving_grows_with_n_and_beam_saves_more_than_parallel():
    t = tr.load("alpaca").head(300)
    par = [forks_serving.serve(t, "parallel", n).saving() for n in (1, 2, 4, 6)]
    beam = [forks_serving.serve(t, "beam", n).saving() for n in (1, 2, 4, 6)]
    assert par[0] == beam[0] == 0 and par == sorted(par) and beam == sorted(beam)
    assert all(b > p for b, p in zip(beam[1:], par[1:], strict=True))


def test_a_tight_budget_swaps_groups_out_and_the_saving_does_not_change():
    t = tr.load("alpaca").head(200)
    loose = forks_serving.serve(t, "beam", 4)
    tight = forks_serving.serve(t, "beam", 4, budget=slots_budget(16 * 120))
    timed = forks_serving.serve(t, "beam", 4, step_s=0.04)
    assert tight.preemptions > 0 and tight.completed == loose.completed == 200
    assert tight.saving() == pytest.approx(loose.saving()) == pytest.approx(timed.saving())


# -------------------------------------------------------------------------------------------------- bad arguments
def pool_state(pool):
    return list(pool.ref), list(pool.free), pool.in_use, pool.copies


def test_ref_pool_refuses_bad_tables_without_changing_anything():
    pool = forks.RefPool(4)
    a = pool.new_table(6)
    b = pool.fork(a)
    before = pool_state(pool)
    for call, arg in [
        (pool.fork, [a[0], 99]),
        (pool.release, [a[0], a[0]]),
        (pool.release, "ab"),
        (pool.fork, [a[0], 1.0]),
    ]:
        with pytest.raises(ValueError, match="table"):
            call(arg)
    with pytest.raises(ValueError, match="table"):
        pool.append(a, 9)  # 9 tokens do not fit 2 blocks of 4
    with pytest.raises(ValueError, match="length"):
        pool.append(a, -1)
    with pytest.raises(ValueError, match="block_size"):
        forks.RefPool(0)
    assert pool_state(pool) == before
    pool.release(a)
    pool.release(b)
    assert pool.in_use == 0 and set(pool.ref) == {0}
    with pytest.raises(ValueError, match="table"):  # released: its blocks are free now
        pool.release([0])


BAD = [
    ({"mode": "greedy"}, "mode"),
    ({"mode": None}, "mode"),
    ({"n": 0}, "n"),
    ({"n": 2.0}, "n"),
    ({"n": True}, "n"),
    ({"n": "2"}, "n"),
    ({"p_top": 1.5}, "p_top"),
    ({"p_top": "0.3"}, "p_top"),
    ({"p_top": float("nan")}, "p_top"),
    ({"block_size": 0}, "block_size"),
    ({"max_seqs": 0}, "max_seqs"),
    ({"n": 8, "max_seqs": 4}, "n"),
    ({"watermark": 1.0}, "watermark"),
    ({"step_s": 0}, "step_s"),
    ({"seed": -1}, "seed"),
    ({"requests": 0}, "requests"),
    ({"budget": "12"}, "budget"),
    ({"trace": 5}, "trace"),
    ({"trace": "no/such.jsonl"}, "trace"),
]


@pytest.mark.parametrize("kw, name", BAD)
def test_serve_names_the_bad_argument(kw, name):
    kw = {"trace": trace_of([(3, 4)]), **kw}
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        forks_serving.serve(**kw)


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"prompt": 0}, "prompt"),
        ({"output": 1.5}, "output"),
        ({"n": -1}, "n"),
        ({"mode": "Beam"}, "mode"),
        ({"p_top": -0.1}, "p_top"),
        ({"block_size": True}, "block_size"),
        ({"rng": "x"}, "rng"),
    ],
)
def test_simulate_group_checks_before_drawing(kw, name):
    rng = np.random.default_rng(3)
    state = rng.bit_generator.state
    args = {"prompt": 10, "output": 5, "mode": "beam", "n": 2, "rng": rng} | kw
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        forks.simulate_group(**args)
    assert rng.bit_generator.state == state


def test_table_checks_every_argument_before_the_first_run():
    with pytest.raises(ValueError, match="mode"):
        forks_report.table((trace_of([(3, 4)]),), ("parallel", "sample"))
    with pytest.raises(ValueError, match="trace"):
        forks_report.table((trace_of([(3, 4)]), 7))
    with pytest.raises(ValueError, match="p_tops"):
        forks_report.sensitivity((trace_of([(3, 4)]),), p_tops=(0.1, 2.0))


# -------------------------------------------------------------------------------------------------- table and CLI
def test_table_rows_compare_with_the_paper():
    rows = forks_report.table(("alpaca",), ns=(2, 4, 6), requests=100)
    assert [(r["mode"], r["n"]) for r in rows] == [(m, n) for m in forks.MODES for n in (2, 4, 6)]
    by = {(r["mode"], r["n"]): r for r in rows}
    assert by["parallel", 2]["paper_pct"] == 6.1 and by["beam", 6]["paper_pct"] == 55.2
    assert by["beam", 4]["paper_pct"] is None and by["beam", 4]["paper_range_pct"] == [37.6, 55.2]
    assert by["beam", 2]["gap_pp"] == pytest.approx(by["beam", 2]["saving_pct"] - 37.6, abs=0.011)
    assert by["parallel", 2]["p_top"] is None and by["beam", 2]["p_top"] == forks.DEFAULT_P_TOP
    text = forks_report.format_table(rows)
    assert "paper %" in text and "6.1" in text and "55.2" in text
    mine = forks_report.table((trace_of([(3, 4)], "mine"),), ("beam",), (2,))
    assert mine[0]["paper_pct"] is None and mine[0]["gap_pp"] is None


def test_sensitivity_implies_a_p_top_on_its_grid():
    rows = forks_report.sensitivity(("alpaca",), (2,), p_tops=(0.0, 0.1, 1.0), requests=100)
    (r,) = rows
    assert r["saving_pct"] == sorted(r["saving_pct"]) and r["paper_pct"] == 37.6
    assert 0 < r["implied_p_top"] < 1
    assert "implied" in forks_report.format_sensitivity(rows)


def test_cli_prints_the_table_and_writes_a_results_file(tmp_path, capsys):
    argv = ["forks", "--trace", "alpaca", "--requests", "40", "--n", "2", "--mode", "beam", "--out", str(tmp_path)]
    assert sim_command.main(argv) == 0
    out, err = capsys.readouterr()
    assert "paper %" in out and "wrote" in err
    (path,) = tmp_path.glob("sim_forks-*.json")
    doc = json.loads(path.read_text())
    assert doc["meta"]["command"] == "python -m workbench sim " + " ".join(argv)
    assert doc["rows"][0]["mode"] == "beam" and doc["rows"][0]["paper_pct"] == 37.6
    assert "6.1%" in doc["paper"]["source"] and doc["setup"]["p_top"] == forks.DEFAULT_P_TOP


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--p-top", "2"], "--p-top"),
        (["--n", "0"], "--n"),
        (["--mode", "greedy"], "--mode"),
        (["--seed", "-3"], "--seed"),
    ],
)
def test_cli_refuses_bad_input(tmp_path, capsys, extra, needle):
    assert sim_command.main(["forks", "--requests", "5", "--out", str(tmp_path), *extra]) == 2
    assert needle in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_cli_refuses_an_out_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert sim_command.main(["forks", "--requests", "5", "--out", str(f)]) == 2
    assert "--out" in capsys.readouterr().err
