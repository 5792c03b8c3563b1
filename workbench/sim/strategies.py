"""Allocation strategies: where each running request's KV slots come from.

Contiguous (Orca-style) strategies reserve one range per request in a single address space of token slots,
managed by a real allocator: a binary buddy allocator (what the vLLM paper assumes for Orca) or first-fit
over a sorted list of holes. The reservation size is ``max_len`` (Orca Max), ``prompt + pow2(output)``
(Orca Pow2: at most 2x the output, e.g. 32 slots for 25 tokens) or ``prompt + output`` (Orca Oracle).

Paged strategies are an abstract model (counts of blocks, no addresses; independent of
``workbench.allocator``): fixed blocks of ``block_size`` tokens allocated on demand (vLLM), the same with the
seed's preallocation (``running_avg(request lengths) * safety / block_size`` blocks at admission), and the
seed's adaptive scheme (16-token blocks while a request is short, 64-token blocks after ``switch_at``
tokens; 16-token blocks are carved four to a 64-slot page, a slab) with optional periodic compaction.

A manager (``workbench.sim.managers``) holds the runtime state; a frozen config (``Contiguous``, ``Paged``,
``PagedAdaptive``, kept by name in ``STRATEGIES``) builds one per run, so ``workbench.sim.run`` stays a pure
function of its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.core.policy_registry import lookup
from workbench.sim.managers import AdaptiveManager, ContiguousManager, Manager, PagedManager, Seq  # noqa: F401

ALLOCATORS = ("buddy", "buddy-lifo", "first-fit")


@dataclass(frozen=True)
class Contiguous:
    """One contiguous range per request.

    ``reserve``: ``max`` (``max_len`` slots), ``pow2`` (``prompt + pow2ceil(output)``, at most ``max_len``) or
    ``oracle`` (``prompt + output``). ``allocator``: ``buddy`` (address-ordered), ``buddy-lifo`` (most recently
    freed block first) or ``first-fit``.
    """

    reserve: str = "max"
    allocator: str = "buddy"
    max_len: int = 2048

    def __post_init__(self) -> None:
        if self.reserve not in ("max", "pow2", "oracle"):
            raise ValueError(f"reserve must be 'max', 'pow2' or 'oracle', got {self.reserve!r}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")
        _check_pos("max_len", self.max_len)

    @property
    def label(self) -> str:
        name = {"max": "Max", "pow2": "Pow2", "oracle": "Oracle"}[self.reserve]
        return f"Orca ({name}, {self.allocator})"

    def build(self, slots: int) -> Manager:
        return ContiguousManager(slots, self.reserve, self.allocator, self.max_len)


@dataclass(frozen=True)
class Paged:
    """Fixed blocks of ``block_size`` tokens, on demand; ``prealloc=True`` adds the seed's preallocation."""

    block_size: int = 16
    watermark: float = 0.01
    prealloc: bool = False
    safety: float = 1.2
    max_prealloc: int = 2048
    alpha: float = 0.05
    max_len: int = 2048

    def __post_init__(self) -> None:
        _check_pos("block_size", self.block_size)
        _check_pos("max_len", self.max_len)
        _check_pos("max_prealloc", self.max_prealloc)
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if not self.safety > 0 or not 0 < self.alpha <= 1:
            raise ValueError(f"need safety > 0 and 0 < alpha <= 1, got {self.safety}, {self.alpha}")

    @property
    def label(self) -> str:
        pre = f", prealloc x{self.safety:g}" if self.prealloc else ""
        return f"paged (B={self.block_size}{pre})"

    def build(self, slots: int) -> Manager:
        pre = (self.safety, self.max_prealloc, self.alpha) if self.prealloc else None
        return PagedManager(slots, self.block_size, self.watermark, pre)


@dataclass(frozen=True)
class PagedAdaptive:
    """The seed's adaptive blocks: ``small`` until ``switch_at`` tokens, then ``large``; optional compaction."""

    small: int = 16
    large: int = 64
    switch_at: int = 128
    compact_every: int | None = None
    watermark: float = 0.01
    max_len: int = 2048

    def __post_init__(self) -> None:
        _check_pos("small", self.small)
        _check_pos("large", self.large)
        _check_pos("max_len", self.max_len)
        if self.large % self.small:
            raise ValueError(f"large ({self.large}) must be a multiple of small ({self.small})")
        if self.switch_at < 0 or self.switch_at % self.small:
            raise ValueError(f"switch_at must be a non-negative multiple of small, got {self.switch_at}")
        if self.compact_every is not None:
            _check_pos("compact_every", self.compact_every)
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")

    @property
    def label(self) -> str:
        comp = f", compact/{self.compact_every}" if self.compact_every else ""
        return f"paged adaptive ({self.small}/{self.large}{comp})"

    def build(self, slots: int) -> Manager:
        return AdaptiveManager(slots, self.small, self.large, self.switch_at, self.watermark, self.compact_every)


def _check_pos(name: str, v: int) -> None:
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


Strategy = Contiguous | Paged | PagedAdaptive

STRATEGIES: dict[str, Strategy] = {
    "orca-max": Contiguous("max"),
    "orca-pow2": Contiguous("pow2"),
    "orca-oracle": Contiguous("oracle"),
    "vllm": Paged(16),
    "paged": Paged(16),
    "paged-prealloc": Paged(16, prealloc=True),
    "paged-adaptive": PagedAdaptive(),
    "paged-compact": PagedAdaptive(compact_every=64),
}


def get(strategy: str | Strategy, **overrides) -> Strategy:
    """A strategy config from a name in ``STRATEGIES`` (or a config), with fields overridden."""
    return lookup(STRATEGIES, "strategy", strategy, **overrides)
