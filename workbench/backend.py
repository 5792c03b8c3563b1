"""The one place that decides how kernels run.

CUDA when a GPU is present (Triton compiles the kernels), otherwise the Triton
interpreter, which runs the same kernels in numpy on the CPU. The interpreter is chosen
by the environment variable ``TRITON_INTERPRET=1``, which Triton reads when a kernel is
*decorated*, so this module must run before any kernel module is imported:
``import workbench`` does that, and so do ``tests/conftest.py`` and every notebook's
first cell.

Override with ``WORKBENCH_BACKEND=interpreter`` (force the interpreter, even on a GPU)
or ``WORKBENCH_BACKEND=cuda`` (fail loudly if there is no GPU).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

_CHOICES = ("auto", "cuda", "interpreter")


@dataclass(frozen=True)
class Backend:
    """What the kernels run on: ``name`` is ``"cuda"`` or ``"interpreter"``."""

    name: str
    device: torch.device

    @property
    def interpreted(self) -> bool:
        return self.name == "interpreter"


def _decide() -> Backend:
    wanted = os.environ.get("WORKBENCH_BACKEND", "auto").strip().lower() or "auto"
    if wanted not in _CHOICES:
        raise ValueError(f"WORKBENCH_BACKEND must be one of {_CHOICES}, got {wanted!r}")
    has_cuda = torch.cuda.is_available()
    if wanted == "cuda" and not has_cuda:
        raise RuntimeError("WORKBENCH_BACKEND=cuda but torch sees no CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1" and wanted == "auto":
        wanted = "interpreter"  # the user already asked Triton for the interpreter
    if wanted == "interpreter" or not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"
        # Kernel modules decorated before this point would be compiled, not interpreted.
        stale = [m for m in sys.modules if m.startswith("workbench.kernels.")]
        if stale:
            raise RuntimeError(f"kernel modules imported before the backend was chosen: {stale}")
        return Backend("interpreter", torch.device("cuda" if has_cuda else "cpu"))
    return Backend("cuda", torch.device("cuda"))


BACKEND: Backend = _decide()


def device() -> torch.device:
    """The device the workbench puts tensors on by default."""
    return BACKEND.device


def is_interpreted() -> bool:
    return BACKEND.interpreted


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
