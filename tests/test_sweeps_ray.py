"""Sweeps on a Ray cluster: a local one started here (two CPU workers, loopback only) gives the local executor's
rows, a worker killed mid-sweep loses no point, GPU points are refused on a cluster without GPUs.

One cluster for the whole file (starting one takes ~7 s of a 2-core machine; the whole file ~20 s) and one driver
connection for the tests that run points: Ray's workers belong to a driver's job, so the tests after the first
reuse warm workers (each imports torch and the studies once)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from workbench import sweeps
from workbench.studies import Param, Study
from workbench.sweeps import grid, store

ray = pytest.importorskip("ray", reason="Ray is an optional extra (pip install -e '.[ray]'): the Ray executor's "
                                        "tests need it")

# Ray otherwise swaps 127.0.0.1 for the machine's outward address (so that other nodes could reach it): this
# cluster stays on the loopback interface. The variable is read when ray is imported; the driver here imported it
# already, so its constant is set below as well.
# RAY_AUTH_MODE: Ray turns token authentication on for a `ray start` that finds ~/.ray/auth_token (any earlier
# `ray.init()` writes one), and the driver here would then be refused; the mode is set on both sides instead.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
CORE = ("sweep", "params", "row")  # what a point computed; "meta" (host, pid, seconds, date) differs by run

# GPU points, refused before any task is sent, so Ray's workers never need to find this sweep
GPU_SWEEP = Study("_ray_gpu", "test", (Param("x", "int", 1, grid=(1, 2)),), lambda x: {"y": x}, notebook="-",
                  panel="-", y=("y",), needs_gpu=lambda p: True)


def _session(sid: int) -> list[int]:
    """The processes of session ``sid``: the cluster's daemons and workers (``ray start`` ran in a new one)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def _stop(sid: int) -> None:
    """This cluster's processes only (``ray stop`` would end every Ray on the machine): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 2.0)):
        for pid in _session(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while _session(sid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _session(sid):
            return


class Cluster(NamedTuple):
    address: str
    session: int  # the id of the session its processes run in (``ray start`` was its leader)


@pytest.fixture(scope="module")
def cluster():
    """``ray start --head`` on 127.0.0.1 with two CPUs and no GPU (on a GPU machine too), its ports the OS's
    choice. Its temp dir sits right under /tmp: Ray's socket paths must stay under the 107 characters a Unix
    socket's path may have."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="wbray", dir="/tmp")
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--num-cpus", "2", "--num-gpus", "0",
           "--node-ip-address", "127.0.0.1", "--port", str(port), "--include-dashboard=false",
           "--disable-usage-stats", "--temp-dir", temp, "--min-worker-port", "0", "--max-worker-port", "0"]
    log = Path(temp) / "start.log"  # a file, not a pipe: the daemons it starts must not hold our end open
    with open(log, "w") as f:
        start = subprocess.Popen(cmd, env={**os.environ, **LOOPBACK}, start_new_session=True, stdout=f,
                                 stderr=subprocess.STDOUT)
    try:
        start.wait(timeout=120)  # returns once the head is up
    except subprocess.TimeoutExpired:
        _stop(start.pid)
        raise
    if start.returncode != 0:
        _stop(start.pid)
        pytest.fail(f"ray start failed ({start.returncode}):\n{log.read_text()[-3000:]}")
    mp = pytest.MonkeyPatch()
    for k, v in LOOPBACK.items():
        mp.setenv(k, v)
    mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)  # the driver's side of LOOPBACK
    try:
        yield Cluster(f"127.0.0.1:{port}", start.pid)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        mp.undo()
        _stop(start.pid)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def driver(cluster):
    """One connection for the tests that run points: ``run_ray`` then uses it and leaves it open."""
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    yield cluster
    ray.shutdown()


def _journal(run) -> dict[str, dict]:
    return {k: {f: r[f] for f in CORE} for k, r in store.Journal(run.journal_path).records.items()}


def test_gpu_points_are_refused_on_a_cluster_without_gpus(cluster, tmp_path, monkeypatch):
    """Refused before any task is sent, nothing written. No driver yet: ``run_ray`` connects to ``address``
    itself, and closes only the connection it opened. The test's sweep is registered for this test only: a sweep
    left in the registry would be one of every catalog test that follows in the same process."""
    from workbench.sweeps import catalog

    monkeypatch.setitem(catalog._STUDIES, GPU_SWEEP.name, GPU_SWEEP)
    connected = ray.is_initialized()
    with pytest.raises(RuntimeError, match=r"need a GPU \(num_gpus=1\) and the Ray cluster at 127.0.0.1:\d+ has none"):
        sweeps.run(GPU_SWEEP, executor="ray", address=cluster.address, out=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []
    assert ray.is_initialized() == connected


def test_ray_gives_the_local_executors_rows(driver, tmp_path):
    values = {"layout": ["nhd", "vllm"], "kind": ["k"], "block_size": [1, 16, 128]}
    on_ray = sweeps.run("coalescing", values, executor="ray", address=driver.address, out=tmp_path / "ray",
                        progress=False)
    local = sweeps.run("coalescing", values, out=tmp_path / "local", progress=False)
    assert (on_ray.ran, on_ray.reused, on_ray.failed) == (6, 0, [])
    assert _journal(on_ray) == _journal(local) and len(_journal(local)) == 6
    same = lambda rows: [{k: v for k, v in r.items() if k not in ("host", "seconds", "date", "run")} for r in rows]
    assert same(on_ray.rows) == same(local.rows)  # the commit too: the driver's, whichever process ran the point
    assert ray.is_initialized()  # run_ray used the driver's connection and left it open


def _kill_first_task(prefix: str, sid: int, killed: dict, stop: threading.Event) -> None:
    """SIGKILL the first process of session ``sid`` seen running a task ``prefix:<i>`` (a Ray worker's process
    title is ``ray::<task name>`` while it runs a task, ``ray::IDLE`` between tasks)."""
    while not stop.is_set():
        for pid in _session(sid):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            except (OSError, UnicodeDecodeError):
                continue
            if title.startswith(f"ray::{prefix}:"):
                os.kill(pid, signal.SIGKILL)
                killed.update(pid=pid, task=int(title.rsplit(":", 1)[1]))
                return
        time.sleep(0.02)


def test_a_killed_worker_loses_no_point(driver, tmp_path):
    """Points of ~0.5 s on the two warm workers; the first worker seen running one is SIGKILLed mid-point. Ray runs
    that task again (``max_retries``) on another worker: the sweep finishes with every point journaled once, and a
    rerun reuses them all."""
    values = {"strategy": ["paged"], "block_size": [1], "num_requests": [500, 600, 700, 800]}
    points = sweeps.plan("fragmentation", values)[1]  # the order run_ray numbers its tasks in
    killed, stop = {}, threading.Event()
    killer = threading.Thread(target=_kill_first_task, args=("fragmentation", driver.session, killed, stop))
    killer.start()
    try:
        run = sweeps.run("fragmentation", values, executor="ray", address=driver.address, out=tmp_path,
                         progress=False)
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was seen running a point: nothing was killed"
    assert (run.ran, run.reused, run.failed) == (4, 0, [])
    lines = [json.loads(line) for line in run.journal_path.read_text().splitlines()]
    assert sorted(r["key"] for r in lines) == sorted(grid.point_key(p) for p in points)  # each point exactly once
    retried = next(r for r in lines if r["params"] == points[killed["task"]])
    assert retried["meta"]["pid"] != killed["pid"]  # finished by another worker
    again = sweeps.run("fragmentation", values, executor="ray", address=driver.address, out=tmp_path, progress=False)
    assert (again.ran, again.reused, again.failed) == (0, 4, []) and _journal(again) == _journal(run)
