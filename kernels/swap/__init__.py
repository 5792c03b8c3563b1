"""Block moves between block spaces (device pool, staging, pinned host tier): ``kernel.py`` holds the kernel and its
wrapper (``move_blocks``), ``reference.py`` the plain PyTorch version."""

from .kernel import move_blocks

__all__ = ["move_blocks"]
