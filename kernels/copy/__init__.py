"""Block copy (copy-on-write, compaction): ``kernel.py`` holds the kernel and its wrapper (``copy_blocks``),
``reference.py`` the plain PyTorch version."""

from .kernel import copy_blocks

__all__ = ["copy_blocks"]
