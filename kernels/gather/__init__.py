"""Paged gather: block table -> contiguous K or V, any layout. ``kernel.py`` holds the kernel and its wrapper
(``paged_gather``, and ``check_against_reference`` for the tour), ``reference.py`` the plain PyTorch version."""

from .kernel import check_against_reference, paged_gather

__all__ = ["check_against_reference", "paged_gather"]
