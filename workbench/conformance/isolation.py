"""Run calls in a spawned worker process that is replaced when it dies or its CUDA context is lost.

A kernel that faults on a GPU (``misaligned address``, ``illegal memory access``) leaves a *sticky* error: every
later CUDA call of that process fails, so the next case would fail too, under the wrong name. The suite and
``bench decode --impl`` therefore run each case in a :class:`Worker`: a fresh process that loads the implementation's
modules once and runs call after call. It is forked from multiprocessing's forkserver, a clean interpreter that has
imported torch and triton but never asked CUDA anything (a fork of a process that did cannot use CUDA), so a
replacement starts in a fraction of a second instead of importing torch again (seconds). After
each call it probes its context (``torch.cuda.synchronize()``); a worker that died, timed out, or reports a lost
context is retired, and the next call starts a fresh one. The call that broke it is the one reported.

Implementations travel as an :func:`impl_ref`: a registered built-in or peer by name (the worker registers its own),
a user's function pickled by reference (a module-level function, or a ``functools.partial`` of one) together with the
files that define it. A function that cannot be pickled (defined in a notebook cell, a closure) has no ref; on a CPU
the suite then forks a child per case instead (:func:`run_forked`).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from workbench.conformance.implementations import get, make_impl
from workbench.conformance.judge import CaseResult, run_case
from workbench.conformance.loading import LOADED, SOURCES, load_module
from workbench.conformance.suite_formats import SUITE_FORMATS

#: error texts that mean the CUDA context is gone (CUDA's own wording, as torch and the libraries repeat it)
STICKY = ("misaligned address", "illegal memory access", "unspecified launch failure", "device-side assert",
          "illegal instruction", "an illegal", "launch timed out", "uncorrectable ecc", "context is destroyed",
          "unrecoverable", "hardware stack error", "cuda error: unknown error")


def sticky(text: str) -> bool:
    """Whether an error message says the CUDA context is no longer usable."""
    low = (text or "").lower()
    return any(s in low for s in STICKY)


def context_lost() -> str:
    """"" while this process's CUDA context works (or CUDA was never used), else the error a sync raises."""
    if not torch.cuda.is_initialized():
        return ""
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (any failure of a bare sync means the context is gone)
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return ""


def impl_ref(impl) -> tuple | None:
    """How a worker rebuilds ``impl`` (a :class:`~workbench.conformance.implementations.Impl`), or None when it cannot:
    ours, a reference or a peer by name; one a file registered (``check FILE.py:NAME``) by that file and its name;
    another user's function pickled by reference, with the loaded file or module that defines it."""
    if impl.origin != "user":
        return ("name", impl.op, impl.name, ())
    if (impl.op, impl.name) in SOURCES:  # the worker imports the file and it registers the name, as here
        return ("name", impl.op, impl.name, (SOURCES[(impl.op, impl.name)],))
    fn = getattr(impl.fn, "func", impl.fn)  # a functools.partial: where its function lives
    module = getattr(fn, "__module__", None) or ""
    if module == "__main__" and not getattr(sys.modules.get(module), "__file__", None):
        return None  # a notebook cell's function: a fresh process has no such __main__
    try:
        blob = pickle.dumps(impl.fn)
    except Exception:  # noqa: BLE001  (a closure, a lambda: no way into a fresh process)
        return None
    claims = {k: v for k, v in asdict(impl).items() if k in ("layouts", "formats", "block_sizes", "head_dims",
                                                              "groups", "row_align", "description")}
    loads = tuple(s for s in LOADED if s == module or (s.endswith(".py") and Path(s).stem == module))
    return ("fn", impl.op, impl.name, loads, blob, claims)


_IMPLS: dict = {}
#: what the forkserver imports once, for every worker forked from it (seconds each). Not workbench: its import asks
#: CUDA for devices (cuInit), after which a forked child cannot use CUDA; each worker imports it (~0.1 s).
PRELOAD = ["torch", "triton"]


def resolve(ref: tuple):
    """The implementation of an :func:`impl_ref`, in a worker (built once)."""
    if ref[:3] in _IMPLS:
        return _IMPLS[ref[:3]]
    for spec in ref[3]:
        if spec not in LOADED:
            load_module(spec)
    if ref[0] == "name":
        impl = get(ref[2], ref[1])
    else:
        impl = make_impl(ref[1], ref[2], pickle.loads(ref[4]), **ref[5])
    _IMPLS[ref[:3]] = impl
    return impl


def run_ref(ref: tuple, case, device=None):
    """:func:`~workbench.conformance.judge.run_case` of an :func:`impl_ref`: what an isolated worker runs per case."""
    return run_case(resolve(ref), case, device)


def _serve(conn, threads: int) -> None:
    """The worker's loop: ``(fn, args)`` in, ``(status, value, lost)`` out; it exits after a lost context. (Its
    import of this module imported workbench first: the backend is decided as in the parent, same environment.)"""
    faulthandler.disable()  # a crash here is the call's verdict, reported by the parent
    torch.set_num_threads(threads)  # the parent's: a case measures the same in either process

    conn.send(("ready", os.getpid(), ""))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn, args = msg
        try:
            out: tuple = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001  (reported to the parent, which names the call)
            out = ("raised", f"{type(e).__name__}: {str(e)[:400]}")
        lost = context_lost()
        conn.send((*out, lost))
        if lost:
            return


class Worker:
    """One worker process at a time for :meth:`call`; a new one after a death, a timeout or a lost context.

    ``call(fn, *args)`` returns ``(status, value)``: ``("ok", result)``, ``("raised", "Type: message")`` (``fn``
    raised), ``("died", why)`` (the process ended: a crash, ``os._exit``) or ``("timeout", why)``. ``lost`` (the
    last call's context error, "" if none) and ``replaced`` (workers retired so far) say what happened to the worker.
    ``fn`` must be a module-level function (it is pickled by reference). The forkserver takes this process's
    environment when its first worker starts; later changes to ``os.environ`` do not reach the workers.
    """

    def __init__(self, timeout_s: float = 600.0, start_timeout_s: float = 300.0):
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.proc = self.conn = None
        self.lost = ""
        self.replaced = 0

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (its first worker), once per process
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_serve, args=(child, torch.get_num_threads()), daemon=True,
                                name="workbench-isolated")
        self.proc.start()
        child.close()
        if not self.conn.poll(self.start_timeout_s):
            self.retire()
            raise RuntimeError(f"the isolated worker did not start within {self.start_timeout_s:.0f} s")
        self.conn.recv()

    def call(self, fn: Callable, *args: Any) -> tuple[str, Any]:
        if self.proc is None:
            self._start()
        self.lost = ""
        try:
            self.conn.send((fn, args))
        except (BrokenPipeError, OSError):
            return self._died()
        if not self.conn.poll(self.timeout_s):
            self.retire()
            return "timeout", f"timed out after {self.timeout_s:.0f} s (the worker was stopped)"
        try:
            status, value, lost = self.conn.recv()
        except (EOFError, OSError):
            return self._died()
        if lost or (status == "raised" and sticky(value)):
            self.lost = lost or value
            self.retire()
        return status, value

    def _died(self) -> tuple[str, str]:
        self.proc.join(10)
        code = self.proc.exitcode
        self.retire()
        how = (f"signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit status {code}")
        return "died", f"crashed the worker process ({how})"

    def retire(self) -> None:
        """Stop the current process (if any); the next call starts a fresh one."""
        if self.proc is None:
            return
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
        self.proc = self.conn = None
        self.replaced += 1

    def close(self) -> None:
        self.retire()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_forked(impl, case, device=None, timeout_s: float = 600.0):
    """:func:`~workbench.conformance.judge.run_case` in a forked child (CPU only): a crash or a hang (past
    ``timeout_s``) is a failed case, not a dead process. The child inherits the registry, so an implementation
    defined in a notebook cell works too."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, impl, case, device), daemon=True)
    t0 = time.perf_counter()
    child.start()
    send.close()
    got = None
    if recv.poll(timeout_s):  # a result, or the end of the pipe when the child died
        try:
            got = recv.recv()
        except EOFError:
            got = None
    child.join(5)
    tol = SUITE_FORMATS[case.kv_format].tol if case.op in ("decode", "shared_prefix") else 0.0
    if got is not None:
        return got
    if child.is_alive():
        child.kill()
        return CaseResult(case, False, None, tol, f"timed out after {timeout_s:.0f} s", time.perf_counter() - t0)
    code = child.exitcode
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
    return CaseResult(case, False, None, tol, f"crashed the process ({how}): a read or write outside its tensors?",
                      time.perf_counter() - t0)


def _child(send, impl, case, device) -> None:
    faulthandler.disable()  # a crash here is the case's verdict, reported by the parent (replay it to debug)
    try:
        send.send(run_case(impl, case, device))
    finally:
        send.close()
