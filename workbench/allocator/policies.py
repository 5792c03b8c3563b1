"""Block-size policies: which size class a new sequence's blocks come from.

A policy has ``choose(prompt_len, expected_len) -> block_size`` and ``observe(final_len,
prompt_len)`` (called when a sequence is freed, so a policy can learn output lengths).
"""

from __future__ import annotations

from workbench.allocator.errors import positive


class FixedBlockSize:
    """Every sequence gets the same block size."""

    def __init__(self, block_size: int):
        self.block_size = positive("block_size", block_size)

    def choose(self, prompt_len: int, expected_len: int | None) -> int:
        return self.block_size

    def observe(self, final_len: int, prompt_len: int) -> None:
        pass


class ByExpectedLength:
    """Small blocks for requests expected to stay short, large ones for long requests (seed 4.1).

    The expected length is the caller's (prompt + max new tokens, say) or, when unknown,
    the prompt length plus a running average of observed output lengths times ``safety``.
    """

    def __init__(self, small: int = 16, large: int = 64, threshold: int = 512, safety: float = 1.0):
        self.small, self.large = positive("small", small), positive("large", large)
        self.threshold = positive("threshold", threshold)
        if not safety > 0:
            raise ValueError(f"safety must be > 0, got {safety}")
        self.safety = safety
        self._outputs = 0
        self._finished = 0

    @property
    def average_output(self) -> float:
        return self._outputs / self._finished if self._finished else 0.0

    def choose(self, prompt_len: int, expected_len: int | None) -> int:
        if expected_len is None:
            expected_len = prompt_len + self.safety * self.average_output
        return self.small if expected_len <= self.threshold else self.large

    def observe(self, final_len: int, prompt_len: int) -> None:
        self._outputs += final_len - prompt_len
        self._finished += 1
