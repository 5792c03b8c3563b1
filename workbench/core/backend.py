"""The one place that decides how kernels run.

CUDA when a GPU is present (Triton compiles the kernels), otherwise the Triton
interpreter, which runs the same kernels in numpy on the CPU. The interpreter is chosen
by the environment variable ``TRITON_INTERPRET=1``, which Triton reads when a kernel is
*decorated*, so this module must run before any kernel module is imported:
``import workbench`` does that, and so do ``tests/conftest.py`` and every notebook's
first cell.

Override with ``WORKBENCH_BACKEND=interpreter`` (force the interpreter, even on a GPU)
or ``WORKBENCH_BACKEND=cuda`` (fail loudly if there is no GPU). ``WORKBENCH_BACKEND=compile`` decorates the
kernels for the compiler on any machine but launches nothing: plans are built as on a GPU and
``workbench.bench.anatomy`` compiles them ahead of time for a target (sm_90a) to read their registers and SASS.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

_CHOICES = ("auto", "cuda", "interpreter", "compile")


@dataclass(frozen=True)
class Backend:
    """What the kernels run on: ``name`` is ``"cuda"``, ``"interpreter"`` or ``"compile"`` (nothing runs)."""

    name: str
    device: torch.device

    @property
    def interpreted(self) -> bool:
        return self.name == "interpreter"


def _decide() -> Backend:
    wanted = os.environ.get("WORKBENCH_BACKEND", "auto").strip().lower() or "auto"
    if wanted not in _CHOICES:
        raise ValueError(f"WORKBENCH_BACKEND must be one of {_CHOICES}, got {wanted!r}")
    if wanted == "compile":  # ahead-of-time compilation only: the interpreter must not take the kernels
        os.environ.pop("TRITON_INTERPRET", None)
        _no_stale_kernels()
        return Backend("compile", torch.device("cpu"))
    has_cuda = torch.cuda.is_available()
    if wanted == "cuda" and not has_cuda:
        raise RuntimeError("WORKBENCH_BACKEND=cuda but torch sees no CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1" and wanted == "auto":
        wanted = "interpreter"  # the user already asked Triton for the interpreter
    if wanted == "interpreter" or not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"
        _no_stale_kernels()
        return Backend("interpreter", torch.device("cuda" if has_cuda else "cpu"))
    return Backend("cuda", torch.device("cuda"))


def compile_target_sms() -> int:
    """The SM count plans are built for under ``WORKBENCH_BACKEND=compile`` (there is no device to ask): the H200's
    132 unless ``WORKBENCH_COMPILE_SMS`` says otherwise."""
    value = os.environ.get("WORKBENCH_COMPILE_SMS", "132")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"WORKBENCH_COMPILE_SMS must be a positive integer, got {value!r}")
    return int(value)


def _no_stale_kernels() -> None:
    """Kernel modules decorated before the choice would run the other way: refuse them."""
    stale = [m for m in sys.modules if m.startswith("workbench.kernels.")]
    if stale:
        raise RuntimeError(f"kernel modules imported before the backend was chosen: {stale}")


BACKEND: Backend = _decide()


def device() -> torch.device:
    """The device the workbench puts tensors on by default."""
    return BACKEND.device


def is_interpreted() -> bool:
    return BACKEND.interpreted


def kernel_device_problem(devices, interpreted: bool | None = None) -> str | None:
    """Why tensors on ``devices`` (``{argument name: torch.device}``) cannot all go to one Triton launch, or None.

    Compiled kernels read GPU memory only (a CPU tensor fails inside Triton with "Pointer argument ... cannot be
    accessed from Triton (cpu tensor?)"), and one launch runs on one GPU; the interpreter (numpy) takes any device,
    but still one. ``interpreted``: the backend to judge for (default: this process's)."""
    interpreted = is_interpreted() if interpreted is None else interpreted
    devs = {name: torch.device(d) for name, d in devices.items()}
    if len({(d.type, d.index or 0) for d in devs.values()}) > 1:  # "cuda" is "cuda:0" (the current device)
        where = ", ".join(f"{n} on {d}" for n, d in devs.items())
        return f"one kernel launch needs its tensors on one device, got {where}"
    off = [n for n, d in devs.items() if d.type != "cuda"]
    if off and not interpreted:
        d = devs[off[0]]
        return (f"{', '.join(off)} on {d}: compiled Triton kernels read GPU memory only (device='cuda', "
                f"workbench.device(); or the PyTorch ops, ops='torch'; or WORKBENCH_BACKEND=interpreter)")
    return None


def check_kernel_devices(what: str, interpreted: bool | None = None, **tensors) -> None:
    """ValueError naming ``what`` and the arguments when ``tensors`` (tensors or devices) cannot be one Triton
    launch's arguments (:func:`kernel_device_problem`); None values are skipped."""
    devs = {n: t.device if isinstance(t, torch.Tensor) else t for n, t in tensors.items() if t is not None}
    why = kernel_device_problem(devs, interpreted)
    if why is not None:
        raise ValueError(f"{what}: {why}")


def describe() -> dict[str, str]:
    """Device, backend and versions, as printed by ``python -m workbench info``."""
    import triton  # after the decision above, so the interpreter setting holds

    info = {
        "backend": "triton interpreter (CPU)" if BACKEND.interpreted else "compiled (CUDA)",
        "device": str(BACKEND.device),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
    }
    return info
