"""Where points run: in this process, in a process pool, or as Ray tasks. Each yields finished records in the
order they finish; the runner journals every one before counting it.

A record is ``{"key", "sweep", "params", "row", "meta"}``, or, for a point that raised, ``{"key", "params",
"error"}``: a failed point is reported and never journaled, so the next run tries it again.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from workbench.results.provenance import machine_meta
from workbench.sweeps.catalog import get
from workbench.sweeps.grid import point_key

EXECUTORS = ("local", "ray")
RAY_RETRIES = 3  # a task whose worker dies (killed, lost node) runs again, up to this many times


def execute_point(sweep_name: str, params: dict[str, Any], stamp: dict[str, str]) -> dict:
    """Run one point where this function is called (the driver, a pool process, a Ray worker) and stamp it with
    the machine it ran on and the driver's ``stamp`` (``commit``, and the ``run`` id every point of one run
    shares). A worker whose own checkout is at another commit (a Ray node) says so in ``worker_commit``."""
    key = point_key(params)
    start = time.perf_counter()
    try:
        sweep = get(sweep_name)  # a sweep registered only in the driver is not known to a spawned worker
        row = dict(sweep.point(**params))
    except Exception as e:  # noqa: BLE001  (one bad point is reported, the sweep goes on)
        return {"key": key, "sweep": sweep_name, "params": params, "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=6)}
    clash = set(row) & set(params)
    if clash:
        return {"key": key, "sweep": sweep_name, "params": params,
                "error": f"point returned keys that are parameters: {sorted(clash)}"}
    here = machine_meta()
    meta = {**here, **stamp, "host": socket.gethostname(), "pid": os.getpid(),
            "seconds": round(time.perf_counter() - start, 4)}
    if here["commit"] != stamp["commit"]:
        meta["worker_commit"] = here["commit"]
    return {"key": key, "sweep": sweep_name, "params": params, "row": row, "meta": meta}


def run_local(sweep_name: str, todo: Sequence[dict], stamp: dict[str, str], workers: int = 1) -> Iterator[dict]:
    """In this process (``workers=1``: a notebook, a debugger) or in a pool of ``workers`` fresh processes."""
    if workers == 1:
        for params in todo:
            yield execute_point(sweep_name, params, stamp)
        return
    # spawn: a fresh interpreter per worker; fork after torch has started its threads can hang
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(execute_point, sweep_name, params, stamp) for params in todo]
        try:
            for f in as_completed(futures):
                yield f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def ray_available() -> str | None:
    """None when Ray imports, else why not (the message a user sees)."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        return f"Ray is not installed ({e}): pip install -e '.[ray]'"
    return None


PROBE_S = 3.0  # seconds a TCP connect to a cluster's address may take before it counts as unreachable


def probe_address(address: str | None, timeout_s: float = PROBE_S) -> None:
    """RuntimeError naming ``address`` (or ``RAY_ADDRESS``) when nothing accepts a TCP connection there within
    ``timeout_s``. ``auto``, ``local`` and no address at all are left to Ray (they start or find a local cluster)."""
    given = address if address is not None else os.environ.get("RAY_ADDRESS")
    where = "address" if address is not None else "RAY_ADDRESS"
    if not given or given in ("auto", "local"):
        return
    hostport = given.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise RuntimeError(f"{where}: expected HOST:PORT (or ray://HOST:PORT, auto), got {given!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise RuntimeError(f"{where}: no Ray cluster at {given}: nothing accepts connections there "
                           f"({e.strerror or e}); start one with `ray start --head --port {port}`") from None


def run_ray(sweep_name: str, todo: Sequence[dict], stamp: dict[str, str], gpu: Sequence[bool],
            address: str | None = None, retries: int = RAY_RETRIES) -> Iterator[dict]:
    """Each point a Ray task (``num_gpus=1`` where the point needs a GPU), gathered as they finish. ``address``:
    an existing cluster (``ray start --head`` printed it; ``auto`` finds the one started on this machine); None is
    Ray's default (``RAY_ADDRESS``, else a cluster started here, else a private local one). A driver that called
    ``ray.init`` already keeps its connection (``address`` is then unused). A task whose worker process dies is
    retried by Ray (``max_retries``); a point that raised is reported, not retried."""
    if not todo:  # every point reused: no cluster to reach
        return
    import ray

    if not ray.is_initialized():
        probe_address(address)  # ray.init retries an unreachable address for ever: seconds here instead

    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
        except (ConnectionError, OSError) as e:  # no cluster there: a message naming the argument
            raise RuntimeError(f"address: no Ray cluster at {address or 'RAY_ADDRESS / this machine'}: {e}") from None
    pending: dict = {}
    try:
        resources = ray.cluster_resources()
        if any(gpu) and resources.get("GPU", 0) < 1:
            raise RuntimeError(f"sweep {sweep_name}: its points need a GPU (num_gpus=1) and the Ray cluster at "
                               f"{address or 'local'} has none: {resources}")
        task = ray.remote(execute_point)
        pending = {task.options(num_gpus=1 if g else 0, num_cpus=1, max_retries=retries, retry_exceptions=False,
                                name=f"{sweep_name}:{i}").remote(sweep_name, params, stamp): params
                   for i, (params, g) in enumerate(zip(todo, gpu, strict=True))}
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            params = pending.pop(ref)
            try:
                record = ray.get(ref)
            except ray.exceptions.RayError as e:  # retries spent (or the task lost): report this point, go on
                first = str(e).splitlines()[0] if str(e) else ""
                record = {"key": point_key(params), "sweep": sweep_name, "params": params,
                          "error": f"{type(e).__name__}: {first}"}
            yield record
    finally:
        for ref in pending:  # stopped early (Ctrl-C, an error): the cluster's remaining tasks are not wanted
            ray.cancel(ref)
        if started:
            ray.shutdown()
