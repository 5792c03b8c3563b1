"""Helpers every kernel wrapper shares (fla's ``ops/common``): alignment arithmetic, the formats' dtype
lists, and the per-geometry cache of launch plans."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Generic, TypeVar

import torch

from workbench import formats

TUNING = Path(__file__).resolve().parent / "tuning"  # measured launch tables, one JSON file per kernel

FP8_DTYPES = tuple(f.storage for f in formats.FORMATS.values() if f.codes == "fp8")
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the attention kernels take as queries

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


def tuning_table(name: str, gpu: str | None = None) -> tuple[str, list[dict]]:
    """``(gpu, entries)`` of ``tuning/<name>.json`` for ``gpu`` (default: this machine's GPU name), or the
    file's ``default`` GPU when that one was not measured. Entries are the file's dicts, as written."""
    doc = json.loads((TUNING / f"{name}.json").read_text())
    if gpu is None:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    chosen = gpu if gpu in doc["gpus"] else doc["default"]
    return chosen, doc["gpus"][chosen]["entries"]


def describe(t) -> str:
    """A tensor's dtype, shape, strides and device for an error message (or the type of a non-tensor)."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}"
