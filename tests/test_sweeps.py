"""Sweeps: grids checked before anything runs, tidy rows, resume by parameters, a pool gives the same rows."""

from __future__ import annotations

import json
import random

import pytest

from workbench import sweeps
from workbench.__main__ import main
from workbench.studies import Param, Study
from workbench.sweeps import grid, store

NUMBERS = ("tile_line_eff", "tile_sector_eff", "token_line_eff")


def numbers(rows):
    return [{k: r[k] for k in ("layout", "block_size", *NUMBERS)} for r in rows]


def test_every_sweep_lists_and_runs_its_default_point():
    text = sweeps.listing()
    for name in sweeps.names():
        s = sweeps.get(name)
        assert s.name in text and all(p.name in text for p in s.params)
        assert set(s.default_grid()) <= {p.name for p in s.params}
    row = sweeps.get("memory").point(**sweeps.get("memory").defaults())
    assert 0 < row["saving"] < 1 and row["paged_gib"] < row["contiguous_gib"]


def test_grid_parse_and_points():
    s = sweeps.get("coalescing")
    values = grid.parse(s, ["layout=vllm"], ["block_size=8,16", "kind=k,v"])
    pts = grid.points(values)
    assert len(pts) == 4 and {p["layout"] for p in pts} == {"vllm"}
    assert len({grid.point_key(p) for p in pts}) == 4
    assert grid.point_key({"b": 1, "a": 2}) == grid.point_key({"a": 2, "b": 1})


@pytest.mark.parametrize("params,grids,match", [
    (["nope=1"], [], "no parameter 'nope'"),
    (["block_size"], [], "KEY=VALUE"),
    (["block_size=7"], [], "block_size: expected one of"),
    (["block_size=x"], [], "expected an int"),
    ([], ["block_size=8,,16"], "empty value"),
    ([], ["block_size=8,8"], "repeats"),
    (["layout=nhd"], ["layout=nhd,hnd"], "given twice"),
    (["pad=-1"], [], "pad: expected >= 0"),
])
def test_bad_grids_name_the_argument(params, grids, match):
    with pytest.raises(ValueError, match=match):
        grid.parse(sweeps.get("coalescing"), params, grids)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_a_float_parameter_must_be_finite(text):  # every bound comparison is False for NaN: checked on its own
    with pytest.raises(ValueError, match="kv_gib: expected a finite number"):
        grid.parse(sweeps.get("fragmentation"), [f"kv_gib={text}"], [])


def test_random_bad_values_are_refused_before_anything_is_written(tmp_path):
    rng = random.Random(0)
    s = sweeps.get("coalescing")
    for _ in range(40):
        p = rng.choice(s.params)
        bad = rng.choice(["", "x", "-5", "1e9", "2.5", "None"])
        try:
            p.parse(bad)
        except ValueError as e:
            assert p.name in str(e)
            with pytest.raises(ValueError):
                sweeps.run(s, {p.name: [bad]}, out=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_resume_skips_finished_points_and_keeps_rows(tmp_path):
    values = {"layout": ["nhd", "vllm"], "block_size": [8, 16], "kind": ["k"]}
    first = sweeps.run("coalescing", values, out=tmp_path, progress=False)
    assert (first.ran, first.reused) == (4, 0)
    again = sweeps.run("coalescing", {**values, "block_size": [8, 16, 32]}, out=tmp_path, progress=False)
    assert (again.ran, again.reused) == (2, 4)
    assert numbers(again.rows)[:2] == numbers(first.rows)[:2]
    loaded = sweeps.load(again.json_path)
    assert loaded.sweep == "coalescing" and len(loaded.rows) == 6
    csv_rows = sweeps.load(again.csv_path).rows
    assert numbers(csv_rows) == numbers(loaded.rows)
    assert [r["aligned"] for r in csv_rows] == [r["aligned"] for r in loaded.rows]  # bools come back as bools
    for r in loaded.rows:
        assert r["gpu"] and r["torch"] and r["commit"] and r["date"] and r["seconds"] >= 0
    fresh = sweeps.run("coalescing", values, out=tmp_path, fresh=True, progress=False)
    assert (fresh.ran, fresh.reused) == (4, 0)


def test_a_killed_run_loses_no_finished_point(tmp_path):
    """A torn last journal line (killed while writing) is ignored: that point runs again, the others do not."""
    values = {"layout": ["nhd", "hnd", "vllm"], "kind": ["k"], "block_size": [16]}
    run = sweeps.run("coalescing", values, out=tmp_path, progress=False)
    text = run.journal_path.read_text().splitlines()
    run.journal_path.write_text("\n".join(text[:2]) + "\n" + text[2][: len(text[2]) // 2])
    again = sweeps.run("coalescing", values, out=tmp_path, progress=False)
    assert (again.ran, again.reused) == (1, 2)
    assert numbers(again.rows) == numbers(run.rows)
    assert len(store.Journal(run.journal_path).records) == 3


def test_a_failing_point_is_reported_not_journaled(tmp_path):
    def point(x: int) -> dict:
        if x == 2:
            raise RuntimeError("boom")
        return {"y": x * x}

    s = sweeps.register(Study("_square", "test", (Param("x", "int", 1, grid=(1, 2, 3)),), point, notebook="-",
                              panel="-", y=("y",)))
    run = sweeps.run(s, out=tmp_path, progress=False)
    assert run.ran == 2 and [f["params"] for f in run.failed] == [{"x": 2}] and "boom" in run.failed[0]["error"]
    assert [r["y"] for r in run.rows] == [1, 9]


def test_process_pool_gives_the_same_rows(tmp_path):
    values = {"layout": ["nhd", "vllm"], "kind": ["k", "v"], "block_size": [16]}
    serial = sweeps.run("coalescing", values, out=tmp_path / "a", progress=False)
    pool = sweeps.run("coalescing", values, out=tmp_path / "b", workers=2, progress=False)
    assert numbers(pool.rows) == numbers(serial.rows)
    # one run id a run, whichever process ran the point (it names the run, as a bench file's does)
    assert len({r["run"] for r in pool.rows}) == 1 and {r["run"] for r in pool.rows} != {r["run"] for r in serial.rows}


def test_cli_runs_lists_and_refuses(tmp_path, capsys):
    assert main(["sweep", "--list"]) == 0 and "coalescing" in capsys.readouterr().out
    assert main(["sweep", "sharing", "--grid", "block_size=4,16", "--param", "prefix_caching=false",
                 "--param", "system_len=32", "--param", "num_requests=2", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    doc = json.loads((tmp_path / "sharing.json").read_text())
    assert [r["block_size"] for r in doc["rows"]] == [4, 16] and not any(r["prefix_caching"] for r in doc["rows"])
    assert main(["sweep", "sharing", "--param", "samples=0", "--out", str(tmp_path / "x")]) == 2
    assert "samples: expected >= 1" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["sweep", "nope"]) == 2 and "unknown sweep" in capsys.readouterr().err
    assert main(["sweep", "memory", "--dry-run", "--param", "max_len=512"]) == 0
    assert "9 points" in capsys.readouterr().out


def test_gpu_points_refused_without_a_gpu(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    s = sweeps.register(Study("_gpu", "test", (Param("x", "int", 1),), lambda x: {"y": x}, notebook="-", panel="-",
                              y=("y",), needs_gpu=lambda p: True))
    with pytest.raises(RuntimeError, match="need a GPU"):
        sweeps.run(s, out=tmp_path, progress=False)
    with pytest.raises(ValueError, match="executor"):
        sweeps.run("memory", executor="slurm", out=tmp_path)
    with pytest.raises(ValueError, match="tag"):
        sweeps.run("memory", tag="../x", out=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_parameter_may_not_shadow_a_rows_own_column():
    # a parameter named "run" was overwritten in every tidy row by the point's run stamp
    for name in ("run", "commit", "sweep"):
        with pytest.raises(ValueError, match="clash with a tidy row's own columns"):
            Study("bad", "", (Param(name, "str", "x"),), lambda **_: {}, notebook="", panel="", y=())


def test_points_added_to_a_committed_sweep_keep_its_rows(tmp_path):
    # a committed sweep has its tidy files and no journal (*.jsonl is not committed): adding a point must not drop
    # the rows it holds, and --fresh forgets them only once a new point has finished
    fixed = {"kind": ["k"], "block_size": [16]}
    first = sweeps.run("coalescing", {"layout": ["nhd", "vllm"], **fixed}, out=tmp_path, progress=False)
    first.journal_path.unlink()
    more = sweeps.run("coalescing", {"layout": ["nhd", "vllm", "hnd"], **fixed}, out=tmp_path, progress=False)
    assert (more.ran, more.reused) == (1, 2) and len(store.load(more.json_path).rows) == 3
    before = more.journal_path.read_text()
    fresh = store.Journal(more.journal_path, fresh=True)  # a run refused after this point (Ray: no GPU) ...
    assert not fresh.records and more.journal_path.read_text() == before  # ... leaves the file as it was
    fresh.add({"key": "k", "sweep": "coalescing", "params": {}, "row": {}, "meta": {}})
    assert list(store.Journal(more.journal_path).records) == ["k"]


def test_dry_run_checks_every_option_and_says_what_is_done(tmp_path, capsys):
    args = ["sweep", "coalescing", "--grid", "layout=nhd,vllm", "--param", "kind=k", "--param", "block_size=16",
            "--out", str(tmp_path)]
    assert main([*args, "--dry-run"]) == 0 and "2 points, 0 already done" in capsys.readouterr().out
    assert main([*args, "--param", "layout=nhd", "--no-progress"]) == 2  # layout given twice: refused
    assert main(["sweep", "coalescing", "--param", "layout=nhd", "--param", "kind=k", "--param", "block_size=16",
                 "--out", str(tmp_path), "--no-progress"]) == 0
    capsys.readouterr()
    assert main([*args, "--dry-run"]) == 0 and "2 points, 1 already done" in capsys.readouterr().out
    (tmp_path / "coalescing.jsonl").unlink()  # a committed sweep: the tidy file alone says what is done
    assert main([*args, "--dry-run"]) == 0 and "1 already done" in capsys.readouterr().out
    for bad, match in ((["--workers", "0"], "workers: expected an int >= 1"), (["--tag", "a b"], "tag:"),
                       (["--executor", "ray", "--workers", "2"], "workers: only with executor 'local'"),
                       (["--address", "x:1"], "address: only with executor 'ray'")):
        assert main([*args, "--dry-run", *bad]) == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "coalescing.jsonl").exists()  # a dry run writes nothing


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # a port the OS just handed out and nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_ray_address_is_an_error_in_seconds(tmp_path, capsys):
    """``sweep memory --executor ray --address 127.0.0.1:1`` (no cluster) hung for ever in Ray's reconnects; the
    address is now probed first: one line naming it, exit 2, nothing written."""
    import time

    pytest.importorskip("ray")
    port = _closed_port()
    start = time.perf_counter()
    assert main(["sweep", "memory", "--executor", "ray", "--address", f"127.0.0.1:{port}", "--out", str(tmp_path),
                 "--no-progress"]) == 2
    assert time.perf_counter() - start < 120  # Ray's import on a busy CPU; the probe itself takes < 3 s
    err = capsys.readouterr().err
    assert f"address: no Ray cluster at 127.0.0.1:{port}" in err and "Traceback" not in err
    assert not list(tmp_path.glob("memory*.json*"))


@pytest.mark.parametrize("address, env, message", [
    ("127.0.0.1:{port}", None, "address: no Ray cluster at 127.0.0.1:{port}"),
    ("ray://127.0.0.1:{port}", None, "no Ray cluster at ray://127.0.0.1:{port}"),
    (None, "127.0.0.1:{port}", "RAY_ADDRESS: no Ray cluster"),
    ("nohostport", None, "address: expected HOST:PORT"),
    ("host:notaport", None, "address: expected HOST:PORT"),
])
def test_probe_address_refuses_what_nothing_listens_on(monkeypatch, address, env, message):
    import time

    from workbench.sweeps.executors import PROBE_S, probe_address

    port = _closed_port()
    fill = (lambda s: None if s is None else s.format(port=port))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if env is not None:
        monkeypatch.setenv("RAY_ADDRESS", fill(env))
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=fill(message).replace("?", r"\?")):
        probe_address(fill(address))
    assert time.perf_counter() - start < PROBE_S + 1


def test_probe_address_lets_ray_handle_auto_local_and_a_listening_port(monkeypatch):
    import socket

    from workbench.sweeps.executors import probe_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for address in (None, "auto", "local"):
        probe_address(address)  # Ray starts or finds a local cluster for these: not refused here
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        probe_address(f"127.0.0.1:{server.getsockname()[1]}")
