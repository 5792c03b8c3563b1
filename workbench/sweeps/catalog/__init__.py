"""The sweeps, one module per notebook group; each module registers its sweeps when imported."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # tokens a block: the panels' block-size choices


@contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread while a point runs: the small tensors of the compression, model and conformance points
    (two threads stall each other on a shared 2-core CPU: a smoke check of ``reference`` took 0.4 s on one thread,
    6 to 10 s on two), and a row that does not depend on the caller's thread count."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
