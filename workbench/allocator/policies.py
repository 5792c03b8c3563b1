"""Block-size policies: which size class a new sequence's blocks come from.

The pattern of every policy in the workbench (``workbench.core.policy_registry``): a frozen config with a
``label`` and ``build(ctx)``, which returns the state object that does the work. A block-size
state has ``choose(prompt_len, expected_len) -> block_size``, ``observe(final_len, prompt_len)``
(called when a sequence is freed, so a policy can learn output lengths) and ``copy()`` (a manager's
clone gets its own). Configs are kept by name in :data:`BLOCK_SIZE_POLICIES`; :func:`get` looks
one up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from workbench.allocator.errors import positive
from workbench.core.policy_registry import lookup


@dataclass(frozen=True)
class PolicyContext:
    """What a block-size policy is built against: the pool's size classes."""

    block_sizes: tuple[int, ...]

    def require(self, name: str, size: int) -> None:
        if size not in self.block_sizes:
            raise ValueError(f"{name}={size} is not a size class of the pool {self.block_sizes}")


class BlockSizeState(Protocol):
    def choose(self, prompt_len: int, expected_len: int | None) -> int: ...

    def observe(self, final_len: int, prompt_len: int) -> None: ...

    def copy(self) -> BlockSizeState: ...


@dataclass(frozen=True)
class FixedBlockSize:
    """Every sequence gets the same block size."""

    block_size: int = 16

    def __post_init__(self) -> None:
        positive("block_size", self.block_size)

    @property
    def label(self) -> str:
        return f"fixed {self.block_size}"

    def build(self, ctx: PolicyContext) -> _Fixed:
        ctx.require("block_size", self.block_size)
        return _Fixed(self.block_size)


class _Fixed:
    def __init__(self, block_size: int):
        self.block_size = block_size

    def choose(self, prompt_len: int, expected_len: int | None) -> int:
        return self.block_size

    def observe(self, final_len: int, prompt_len: int) -> None:
        pass

    def copy(self) -> _Fixed:
        return self


@dataclass(frozen=True)
class ByExpectedLength:
    """Small blocks for requests expected to stay short, large ones for long requests (seed 4.1).

    The expected length is the caller's (prompt + max new tokens, say) or, when unknown, the prompt
    length plus a running average of observed output lengths times ``safety``.
    """

    small: int = 16
    large: int = 64
    threshold: int = 512
    safety: float = 1.0

    def __post_init__(self) -> None:
        for name in ("small", "large", "threshold"):
            positive(name, getattr(self, name))
        if isinstance(self.safety, bool) or not isinstance(self.safety, (int, float)) or not self.safety > 0:
            raise ValueError(f"safety must be a number > 0, got {self.safety!r}")

    @property
    def label(self) -> str:
        return f"by expected length ({self.small}/{self.large} at {self.threshold})"

    def build(self, ctx: PolicyContext) -> ExpectedLengthState:
        ctx.require("small", self.small)
        ctx.require("large", self.large)
        return ExpectedLengthState(self)


class ExpectedLengthState:
    """The running average of output lengths behind :class:`ByExpectedLength`."""

    def __init__(self, config: ByExpectedLength):
        self.config = config
        self._outputs = 0
        self._finished = 0

    @property
    def average_output(self) -> float:
        return self._outputs / self._finished if self._finished else 0.0

    def choose(self, prompt_len: int, expected_len: int | None) -> int:
        cfg = self.config
        if expected_len is None:
            expected_len = prompt_len + cfg.safety * self.average_output
        return cfg.small if expected_len <= cfg.threshold else cfg.large

    def observe(self, final_len: int, prompt_len: int) -> None:
        self._outputs += final_len - prompt_len
        self._finished += 1

    def copy(self) -> ExpectedLengthState:
        new = ExpectedLengthState(self.config)
        new._outputs, new._finished = self._outputs, self._finished
        return new


BlockSizePolicy = FixedBlockSize | ByExpectedLength

BLOCK_SIZE_POLICIES: dict[str, BlockSizePolicy] = {
    "fixed": FixedBlockSize(),
    "by-expected-length": ByExpectedLength(),
}


def get(policy: str | BlockSizePolicy, **overrides) -> BlockSizePolicy:
    """A block-size policy config by name (or a config), with fields overridden."""
    return lookup(BLOCK_SIZE_POLICIES, "policy", policy, **overrides)
