"""Which block leaves a lower tier first (host -> disk, disk -> dropped): LRU, LFU or priority.

One pattern for every policy (``workbench.core.policy_registry``): a frozen config with a ``label`` and one method, here
``rank(entry)``, the sort key of a victim (smallest leaves first), as kvpress's scorer presses implement one
``score``. The device tier's own order is the allocator's free queue (least recently freed first,
``workbench.allocator.free_queue``); these policies order what is below it.

An entry (``workbench.tiers.tiered.LowerEntry``) carries ``last_access`` (a clock of lookups and stores),
``hits`` (times a prefix hit or a swap-in read it) and ``priority`` (set by the caller: a system prompt that
must stay warm gets a higher one).
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.core.policy_registry import lookup


@dataclass(frozen=True)
class LRU:
    """Least recently used first."""

    @property
    def label(self) -> str:
        return "LRU"

    def rank(self, e) -> tuple:
        return (e.last_access,)


@dataclass(frozen=True)
class LFU:
    """Least frequently used first (ties: least recently used)."""

    @property
    def label(self) -> str:
        return "LFU"

    def rank(self, e) -> tuple:
        return (e.hits, e.last_access)


@dataclass(frozen=True)
class Priority:
    """Lowest priority first (ties: least recently used)."""

    @property
    def label(self) -> str:
        return "priority"

    def rank(self, e) -> tuple:
        return (e.priority, e.last_access)


EVICTION = {"lru": LRU(), "lfu": LFU(), "priority": Priority()}


def get(choice, **overrides):
    """An eviction policy by name (``"lru"``, ``"lfu"``, ``"priority"``) or a config of those types."""
    return lookup(EVICTION, "eviction", choice, **overrides)
