"""A planned launch: one Triton kernel launched again and again with the constexprs of a plan, without Triton's
per-launch path after the first.

Triton's ``kernel[grid](*args, **constexprs)`` binds every argument, builds the specialization key (a string of
every argument's properties) and looks the compiled kernel up, each launch: 30-70 us of host time for a decode
kernel of ~50 arguments on the bench's hosts (``scripts/probe_cascade_host.py``, H100, 2026-12-05), more than the
GPU time of a small decode. In eager timing a step's kernels wait for that host time; under a CUDA graph it is paid
once. :class:`PlannedLaunch` takes Triton's path once per specialization, keeps the compiled kernel, and then calls
its launcher with the arguments in the kernel's order (``CompiledKernel[grid](*args)``, Triton's own runner).

A launch reuses a compiled kernel only for arguments of the same specialization: the key is every argument's own
value where Triton specializes on it (ints exactly, tensors by dtype and 16-byte alignment), so a call that Triton
would compile otherwise takes Triton's path again. Under the interpreter every call is Triton's, and so is every
call with ``WORKBENCH_PLANNED_LAUNCH=0`` in the environment (to compare, or to rule the runner out).
"""

from __future__ import annotations

import os

import torch

from workbench.core.backend import is_interpreted


def _spec(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, float):
        return float
    return a  # ints, bools, None: exactly


class PlannedLaunch:
    """``launch(grid, *args)``: ``fn[grid](*args, **constexprs)`` (``constexprs`` with the launch options, e.g.
    ``num_warps``), fixed when the plan is made."""

    def __init__(self, fn, constexprs: dict):
        self.fn, self.constexprs = fn, dict(constexprs)
        self._runners: dict = {}
        self._direct = not is_interpreted() and os.environ.get("WORKBENCH_PLANNED_LAUNCH", "1") != "0"

    def __call__(self, grid, *args) -> None:
        if not self._direct:
            self.fn[grid](*args, **self.constexprs)
            return
        key = (grid, tuple(_spec(a) for a in args))
        hit = self._runners.get(key)
        if hit is not None:
            runner, tail = hit
            runner(*args, *tail)
            return
        compiled = self.fn[grid](*args, **self.constexprs)  # Triton's path: compiles if it must, launches
        if compiled is None or not hasattr(compiled, "__getitem__"):
            self._direct = False  # not a compiled kernel (a wrapper): Triton's path from now on
            return
        names = self.fn.arg_names[len(args):]  # the constexpr parameters after the positional ones, in order
        params = {p.name: p for p in self.fn.params}
        tail = tuple(self.constexprs[n] if n in self.constexprs else params[n].default for n in names)
        g = tuple(grid) + (1,) * (3 - len(grid))
        self._runners[key] = (compiled[g], tail)
