"""What the notebooks share: the ``SMOKE`` switch, its sizes, and plain-text summaries (no plotly, no widgets).

``SMOKE`` is on under CI (nbval, ``scripts/execute_notebooks.py``) and on any machine without a GPU: the
notebooks then use the small sizes that keep their stored outputs reproducible on a CPU.
"""

from __future__ import annotations

import os
from typing import TypeVar

import torch

T = TypeVar("T")

#: Small sizes: under CI or without a GPU.
SMOKE: bool = "CI" in os.environ or not torch.cuda.is_available()


def smoke_size(full: T, smoke: T, on: bool | None = None) -> T:
    """``smoke`` when :data:`SMOKE` (or ``on``) is set, else ``full``."""
    return smoke if (SMOKE if on is None else on) else full


def format_breakdown(b) -> str:
    """Two indented lines for a :class:`workbench.fragmentation.LiveBreakdown`: its slots by part with the cached,
    stranded and utilization figures, then the vLLM paper's bars (percent of the pool)."""
    from workbench.fragmentation import PARTS

    parts = ", ".join(f"{k} {getattr(b, k)}" for k in PARTS)
    return (f"  {parts} slots | cached {b.cached}, stranded {b.stranded} | utilization {b.block_utilization:.2f}\n"
            "  paper's bars (%): " + ", ".join(f"{k} {v:.1f}" for k, v in b.paper().items()))
