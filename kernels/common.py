"""Helpers every kernel wrapper shares (fla's ``ops/common``): alignment arithmetic, the formats' dtype
lists, and the per-geometry cache of launch plans."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from workbench import formats

FP8_DTYPES = tuple(f.storage for f in formats.FORMATS.values() if f.codes == "fp8")

T = TypeVar("T")


def pow2_divisor(n: int, cap: int = 16) -> int:
    """The largest power of two <= ``cap`` dividing ``n`` (``n == 0`` counts as divisible). Triton only
    knows "divisible by 16", so strides of 16 * k + 8 elements would otherwise load 2 bytes at a time."""
    a = 1
    while a < cap and n % (2 * a) == 0:
        a *= 2
    return a


class PlanCache(Generic[T]):
    """Launch plans by geometry key: a repeated call's host work is one dict lookup. Bounded, least
    recently used out first (geometries are few in practice: one per layer and batch shape)."""

    def __init__(self, max_entries: int = 256):
        self.max_entries = max_entries
        self._plans: OrderedDict[Hashable, T] = OrderedDict()

    def get(self, key: Hashable | None, make: Callable[[], T]) -> T:
        """The plan for ``key``, made by ``make()`` on a miss (``key=None``: never cached)."""
        if key is None:
            return make()
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
            if len(self._plans) > self.max_entries:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
