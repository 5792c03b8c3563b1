"""Where a result came from: GPU, versions, commit and date, stamped on every result file (benchmarks, sweeps,
conformance reports)."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_meta() -> dict[str, str]:
    """GPU, versions, commit and date: stamped on every result file and row; ``run`` identifies this run."""
    import triton  # here: triton adds ~0.2 s to importing this module, which every results loader does (ROOT)

    # The GPU machine gets the working tree without .git: pass WORKBENCH_COMMIT there.
    commit = os.environ.get("WORKBENCH_COMMIT") or _git("rev-parse", "--short=12", "HEAD") or "unknown"
    if "WORKBENCH_COMMIT" not in os.environ and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "none",
        "python": sys.version.split()[0],
        "commit": commit,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "run": uuid.uuid4().hex[:12],
    }
