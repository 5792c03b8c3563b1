"""Prefetch strategies for tiered KV storage: which blocks to bring to the device before the next decode step
reads them, and which resident blocks to give up for them.

The registry pattern of ``workbench.core.policy_registry``: a frozen, validated config (kept by name in
:data:`PREFETCH`, :func:`get`) whose ``build(ctx)`` returns the state object the replay drives. A state has

- ``observe(step, reads)``: step ``step`` has read ``reads`` (called once per step, after its reads);
- ``plan(step, view) -> list[int]``: after step ``step``, the blocks to prefetch for step ``step + 1``, most
  wanted first (the replay skips resident ones and keeps at most the device's capacity);
- ``eviction_order(resident, view) -> list[int]``: the resident blocks, first to go first (``resident`` comes
  least recently used first; the base class keeps that order: LRU).

A strategy sees the trace only through a :class:`TraceView` bound to the step it plans after: reads and scores
of steps ``<= step``, the context length of steps ``<= step + 1`` (decode adds one token a step, so the next
step's length is known, not guessed). Anything later raises :class:`FutureAccessError`.

Strategies (names in :data:`PREFETCH`):

- ``none``: prefetch nothing; LRU eviction. The baseline: every block not resident is a demand miss.
- ``sequential``: readahead, the ``depth`` blocks after the highest block the step read. For a scan; in decode
  the highest block read is usually the newest, so there is little ahead to fetch (an honest baseline).
- ``window``: StreamingLLM's rule (``window_tokens``, ``sink_tokens``): fetch the next step's sink and window
  blocks that are not resident and evict blocks that left the window first. The blocks the window enters next
  are the ones decode writes, born on the device, so the rule mostly restores what eviction took.
- ``hot_lru`` / ``hot_lfu``: hot-set caches that prefetch nothing: keep the most recently / most frequently
  read blocks. ``hot_lru`` is the replay's default order (it behaves as ``none``; it is the named twin of
  ``hot_lfu``). Under LFU a block just read for the first time is the first to go, so a cold block never
  pushes out a hot one (the replay trims the device after the step, the new block included).
- ``score``: score-guided (Quest-like): after step ``t`` prefetch the ``depth`` highest blocks by step ``t``'s
  scores, the only scores known before step ``t + 1``; evict blocks the last step did not read, lowest score
  first. Needs a trace with ``scores``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workbench.core.policy_registry import lookup
from workbench.tiers.access import AccessTrace, window_blocks


class FutureAccessError(LookupError):
    """A strategy asked the trace for something a real system would not know yet."""


@dataclass(frozen=True)
class PrefetchContext:
    """What a strategy is built against: the trace's block size, the device's capacity in blocks and whether
    the trace carries per-block scores."""

    block_size: int
    device_blocks: int
    has_scores: bool = False


class TraceView:
    """The part of a trace known after step ``step``: its reads and scores up to ``step``, its context length up
    to ``step + 1``."""

    __slots__ = ("_trace", "_step")

    def __init__(self, trace: AccessTrace, step: int):
        self._trace = trace
        self._step = step

    @property
    def step(self) -> int:
        return self._step

    @property
    def block_size(self) -> int:
        return self._trace.block_size

    @property
    def has_scores(self) -> bool:
        return self._trace.scores is not None

    def reads(self, step: int) -> tuple[int, ...]:
        return self._trace.steps[self._known(step, self._step, "reads")]

    def scores(self, step: int) -> tuple[float, ...]:
        if self._trace.scores is None:
            raise ValueError(f"trace {self._trace.name!r} has no scores")
        return self._trace.scores[self._known(step, self._step, "scores")]

    def num_blocks(self, step: int) -> int:
        return self._trace.num_blocks[self._known(step, self._step + 1, "num_blocks")]

    def tokens(self, step: int) -> int:
        return self._trace.tokens(self._known(step, self._step + 1, "tokens"))

    def existing_blocks(self) -> int:
        """Blocks that exist after this step, the ones a prefetch can fetch (a block the next step opens is
        written on the device, not fetched)."""
        return max(self._trace.prompt_blocks, self._trace.num_blocks[self._step])

    def _known(self, step: int, last: int, what: str) -> int:
        if not 0 <= step <= last:
            raise FutureAccessError(f"{what}({step}) is not known after step {self._step} (known: 0 .. {last})")
        if step >= len(self._trace):
            raise FutureAccessError(f"{what}({step}): the trace ends at step {len(self._trace) - 1}")
        return step


class PrefetchState:
    """The base state: prefetch nothing, evict least recently used first."""

    def observe(self, step: int, reads: Sequence[int]) -> None:
        pass

    def plan(self, step: int, view: TraceView) -> list[int]:
        return []

    def eviction_order(self, resident: list[int], view: TraceView) -> list[int]:
        return resident


@dataclass(frozen=True)
class NoPrefetch:
    """No prefetch: blocks come to the device only when a step misses them (LRU eviction)."""

    @property
    def label(self) -> str:
        return "no prefetch"

    def build(self, ctx: PrefetchContext) -> PrefetchState:
        return PrefetchState()


@dataclass(frozen=True)
class Sequential:
    """Readahead: the ``depth`` blocks after the highest one the step read."""

    depth: int = 4

    def __post_init__(self) -> None:
        _positive("depth", self.depth)

    @property
    def label(self) -> str:
        return f"sequential (depth {self.depth})"

    def build(self, ctx: PrefetchContext) -> SequentialState:
        return SequentialState(self.depth)


class SequentialState(PrefetchState):
    def __init__(self, depth: int):
        self.depth = depth

    def plan(self, step: int, view: TraceView) -> list[int]:
        reads = view.reads(step)
        if not reads:
            return []
        return list(range(reads[-1] + 1, min(reads[-1] + 1 + self.depth, view.num_blocks(step + 1))))


@dataclass(frozen=True)
class Window:
    """StreamingLLM's blocks: the first ``sink_tokens`` tokens' and those overlapping the last ``window_tokens``."""

    window_tokens: int = 256
    sink_tokens: int = 4

    def __post_init__(self) -> None:
        _positive("window_tokens", self.window_tokens)
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {self.sink_tokens!r}")

    @property
    def label(self) -> str:
        return f"window ({self.window_tokens} + {self.sink_tokens} sinks)"

    def build(self, ctx: PrefetchContext) -> WindowState:
        return WindowState(self.window_tokens, self.sink_tokens)


class WindowState(PrefetchState):
    def __init__(self, window_tokens: int, sink_tokens: int):
        self.window_tokens, self.sink_tokens = window_tokens, sink_tokens

    def _next_window(self, view: TraceView) -> list[int]:
        return window_blocks(view.tokens(view.step + 1), view.block_size, self.window_tokens, self.sink_tokens)

    def plan(self, step: int, view: TraceView) -> list[int]:
        blocks = self._next_window(view)
        n_sinks = min(-(-self.sink_tokens // view.block_size), len(blocks))
        # sinks first (every later step reads them), then the window newest first (it stays in the window longest)
        return blocks[:n_sinks] + blocks[n_sinks:][::-1]

    def eviction_order(self, resident: list[int], view: TraceView) -> list[int]:
        window = set(self._next_window(view))
        return [b for b in resident if b not in window] + [b for b in resident if b in window]


@dataclass(frozen=True)
class HotSet:
    """A hot-set cache that prefetches nothing: ``policy`` ``"lru"`` keeps the most recently read blocks,
    ``"lfu"`` the most often read (ties: least recently used goes first)."""

    policy: str = "lru"

    def __post_init__(self) -> None:
        if self.policy not in ("lru", "lfu"):
            raise ValueError(f"policy must be 'lru' or 'lfu', got {self.policy!r}")

    @property
    def label(self) -> str:
        return f"hot set ({self.policy.upper()})"

    def build(self, ctx: PrefetchContext) -> PrefetchState:
        return PrefetchState() if self.policy == "lru" else LFUState()


class LFUState(PrefetchState):
    def __init__(self) -> None:
        self.reads: dict[int, int] = {}

    def observe(self, step: int, reads: Sequence[int]) -> None:
        for b in reads:
            self.reads[b] = self.reads.get(b, 0) + 1

    def eviction_order(self, resident: list[int], view: TraceView) -> list[int]:
        counts = self.reads
        return sorted(resident, key=lambda b: counts.get(b, 0))  # stable: equal counts stay in LRU order


@dataclass(frozen=True)
class ScoreGuided:
    """Prefetch the ``depth`` best blocks by the last step's scores (Quest's page bounds)."""

    depth: int = 16

    def __post_init__(self) -> None:
        _positive("depth", self.depth)

    @property
    def label(self) -> str:
        return f"score-guided (depth {self.depth})"

    def build(self, ctx: PrefetchContext) -> ScoreState:
        if not ctx.has_scores:
            raise ValueError("strategy 'score' needs a trace with per-block scores (topk_trace, trace_from_capture)")
        return ScoreState(self.depth)


class ScoreState(PrefetchState):
    def __init__(self, depth: int):
        self.depth = depth
        self.last_reads: frozenset[int] = frozenset()

    def observe(self, step: int, reads: Sequence[int]) -> None:
        self.last_reads = frozenset(reads)

    def plan(self, step: int, view: TraceView) -> list[int]:
        scores = np.asarray(view.scores(step))
        return [int(b) for b in np.lexsort((np.arange(len(scores)), -scores))[: self.depth]]

    def eviction_order(self, resident: list[int], view: TraceView) -> list[int]:
        scores = view.scores(view.step)
        # blocks the last step skipped go first, lowest bound first; a block newer than the scores stays
        key = lambda b: (b in self.last_reads, scores[b] if b < len(scores) else float("inf"))
        return sorted(resident, key=key)


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


Prefetch = NoPrefetch | Sequential | Window | HotSet | ScoreGuided

PREFETCH: dict[str, Prefetch] = {
    "none": NoPrefetch(),
    "sequential": Sequential(),
    "window": Window(),
    "hot_lru": HotSet("lru"),
    "hot_lfu": HotSet("lfu"),
    "score": ScoreGuided(),
}


def get(prefetch: str | Prefetch, **overrides) -> Prefetch:
    """A prefetch strategy config from a name in :data:`PREFETCH` (or a config), with fields overridden."""
    return lookup(PREFETCH, "prefetch", prefetch, **overrides)


def strategies(depth: int = 24, window_tokens: int = 256) -> dict[str, Prefetch | str]:
    """Every strategy of :data:`PREFETCH` by name, configured as notebook 05 and its panel replay them:
    ``sequential`` and ``score`` reading ``depth`` blocks ahead, ``window`` keeping ``window_tokens``; the
    strategies without a knob by name."""
    return {"none": "none", "sequential": get("sequential", depth=depth),
            "window": get("window", window_tokens=window_tokens), "hot_lru": "hot_lru", "hot_lfu": "hot_lfu",
            "score": get("score", depth=depth)}


def needs_scores(strategy: str | Prefetch) -> bool:
    """Whether a strategy reads the trace's per-block scores (``score``): it replays only traces that have them."""
    return isinstance(get(strategy), ScoreGuided)
