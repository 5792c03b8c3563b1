"""KIVI's fp16 residual: a sequence's newest tokens wait in fp16 outside the blocks until they fill whole
quantization groups (``Scheme.quantized_tokens``); each write then sends the oldest whole groups to the blocks.

:class:`ResidualWindow` keeps, per sequence, how many of its tokens the blocks hold and the fp16 tokens after them.
Only schemes that keep a residual (``Scheme.keeps_residual``) record anything; for the others the blocks hold
every token. A residual is never written in place (each write makes new tensors), so forks share it safely.
"""

from __future__ import annotations

import torch

from workbench import quant


class ResidualWindow:
    """Per sequence: tokens stored as codes in its blocks, and ``(k, v)`` ``[num_layers, n, heads, head_dim]`` fp16,
    the ``n`` newest tokens (absent when there are none)."""

    def __init__(self):
        self._quantized: dict = {}  # seq_id -> tokens in the blocks (the rest is the fp16 residual)
        self._residual: dict = {}  # seq_id -> (k, v), the newest tokens

    def in_blocks(self, seq_id, num_tokens: int) -> int:
        """Tokens of the sequence in its blocks (``num_tokens``, all of them, when nothing is recorded)."""
        return self._quantized.get(seq_id, num_tokens)

    def get(self, seq_id) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._residual.get(seq_id)

    def state(self, seq_id) -> tuple[int | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """``(tokens in the blocks, residual)`` as recorded, None for what is not."""
        return self._quantized.get(seq_id), self._residual.get(seq_id)

    def set(self, seq_id, quantized: int | None, residual: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Record both (None forgets one)."""
        for table, value in ((self._quantized, quantized), (self._residual, residual)):
            if value is None:
                table.pop(seq_id, None)
            else:
                table[seq_id] = value

    def fork(self, parent_id, child_id) -> None:
        if parent_id in self._quantized:
            self._quantized[child_id] = self._quantized[parent_id]
        if parent_id in self._residual:
            self._residual[child_id] = self._residual[parent_id]  # never written in place: sharing is safe

    def drop(self, seq_id) -> None:
        self._quantized.pop(seq_id, None)
        self._residual.pop(seq_id, None)

    def pending(self, scheme, seq_id, new_k: torch.Tensor, new_v: torch.Tensor, done: int, total: int):
        """What a write of ``new_k``/``new_v`` (``[num_layers, n, heads, head_dim]``, the sequence's tokens up to
        ``total``) sends to the blocks, the ``done`` tokens there before it: ``(tokens in the blocks after it, K
        and V to write there, the new residual or None)``. Changes nothing."""
        old = self._residual.get(seq_id)
        # the fp16 values, saturated at +-65504 (a plain cast made Inf, then NaN groups), as the residual holds
        # them: a token is quantized from the same values whether it waited in the residual or not
        new_k, new_v = quant.to_fp16(new_k), quant.to_fp16(new_v)
        pend_k = torch.cat([old[0], new_k], 1) if old is not None else new_k  # tokens [done, total)
        pend_v = torch.cat([old[1], new_v], 1) if old is not None else new_v
        target = max(done, scheme.quantized_tokens(total))
        n = target - done
        residual = (pend_k[:, n:].contiguous(), pend_v[:, n:].contiguous()) if target < total else None
        return target, pend_k[:, :n], pend_v[:, :n], residual
