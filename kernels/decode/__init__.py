"""Paged decode attention, arranged as fla's ``ops/<op>/``: ``kernel`` (the Triton kernels), ``dequant`` (a tile's
codes turned into the MMA operand in registers), ``groups`` (the kernel of packed group codes), ``quant`` (what
each storage family needs read), ``config`` (the split heuristic and launch arithmetic), ``plan``
(:class:`DecodePlan`: plan once per step, run per layer), ``csr`` (FlashInfer's CSR page table as a plan's padded
table), ``merge`` (merging attention states), ``cascade`` (shared-prefix decode: :class:`CascadePlan`), ``checks``
(the arguments' host-side checks), ``api`` (``paged_decode``, the one-shot entry point), ``reference`` (the plain
PyTorch versions)."""

from .api import paged_decode
from .cascade import CascadePlan
from .config import decode_config
from .merge import merge_state, merge_states
from .plan import DecodePlan

__all__ = ["CascadePlan", "DecodePlan", "decode_config", "merge_state", "merge_states", "paged_decode"]
