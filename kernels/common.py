"""Helpers every kernel wrapper shares (fla's ``ops/common``): alignment arithmetic, the formats' dtype
lists, the per-geometry cache of launch plans, and what a quantized cache must offer any kernel (its scheme,
rows the kernels can tile, room for the scales in its blocks)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Generic, TypeVar

import torch
import triton.language as tl

from workbench import quant
from workbench.core import kv_formats
from workbench.quant import blocks as qblocks

TUNING = Path(__file__).resolve().parent / "tuning"  # measured launch tables, one JSON file per kernel

FP8_DTYPES = tuple(f.storage for f in kv_formats.FORMATS.values() if f.codes == "fp8")
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the attention kernels take as queries

SCALE_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16}  # the blocks' scale arrays, for the kernels

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
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    chosen = gpu if gpu in doc["gpus"] else doc["default"]
    return chosen, doc["gpus"][chosen]["entries"]


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for ``n >= 1`` in plain Python (triton's goes through a constexpr-function wrapper:
    ~1 us a call, on the per-call path)."""
    return 1 << (n - 1).bit_length()


def describe(t) -> str:
    """A tensor's dtype, shape, strides and device for an error message (or the type of a non-tensor)."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}"


def output_buffer(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, dev) -> torch.Tensor:
    """A caller's output buffer after its checks (shape, dtype, device, unit last stride), or a new one."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=dev)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype or t.device != dev \
            or (len(shape) > 1 and shape[-1] and t.stride(-1) != 1):
        kind = {torch.float32: "fp32", torch.int32: "int32"}.get(dtype, str(dtype))
        raise ValueError(f"{name} must be an {kind} {list(shape)} tensor on {dev} with unit last stride, got "
                         f"{describe(t)}")
    return t


# ---- quantized caches (workbench.quant) -------------------------------------------------
def scheme_of(k_dtype: torch.dtype, quant_arg) -> quant.Scheme:
    """The scheme a kernel reads or writes: ``quant_arg`` (a name or scheme, checked against the cache's dtype) or,
    without one, the plain reading of the dtype (a cast, or fp8 / int8 with static scales; uint8 is refused)."""
    if quant_arg is not None:
        scheme = quant.get(quant_arg)
        if scheme.format.storage != k_dtype:
            raise ValueError(f"quant {scheme.name} stores {scheme.format.storage}, but k_cache holds {k_dtype}")
        return scheme
    return quant.resolve(k_dtype, "k_cache")


def _packed_rows(scheme: quant.Scheme, head_dim: int) -> None:
    """Packed rows: a power-of-two head_dim and at least 16 bytes a row (the smallest tile Triton's dot and loads
    take)."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"{scheme.name} needs a power-of-two head_dim in the kernels, got {head_dim}")
    if scheme.code_dim(head_dim) < 16:
        raise ValueError(f"{scheme.name} packs head_dim {head_dim} into {scheme.code_dim(head_dim)} bytes; "
                         f"the kernels need at least 16 (head_dim >= {16 * 8 // scheme.bits})")


# what the kernels ask of a family's rows beyond the family's own check_shape, by storage family (none: nothing)
KERNEL_SHAPE_CHECKS: dict[str, Callable[[quant.Scheme, int], None]] = {"groups": _packed_rows}


def check_kernel_shape(scheme: quant.Scheme, head_dim: int) -> None:
    """ValueError when the kernels cannot tile ``scheme``'s rows of ``head_dim`` values (:data:`KERNEL_SHAPE_CHECKS`)."""
    check = KERNEL_SHAPE_CHECKS.get(scheme.family)
    if check is not None:
        check(scheme, head_dim)


def block_scales_in(cache: torch.Tensor, name: str, scheme: quant.Scheme, kind: str, block_size: int,
                    num_heads: int, head_dim: int) -> qblocks.BlockScales:
    """The scale array of ``cache``'s blocks (``workbench.quant.blocks``), after checking that each block has room for
    it and that the arrays are aligned for the kernels' scale loads (ValueError naming ``name`` otherwise)."""
    sc = qblocks.block_scales(scheme, kind, block_size, num_heads, head_dim)
    stride_bytes = cache.stride(0) * cache.element_size()
    if stride_bytes < sc.end or stride_bytes % sc.dtype.itemsize or cache.data_ptr() % 16:
        raise ValueError(f"{name} blocks of {stride_bytes} bytes cannot hold {scheme.name}'s codes and scales "
                         f"({sc.end} bytes a block, 16-byte aligned): build it with workbench's PagedKVCache or "
                         f"workbench.quant.blocks.empty_cache")
    return sc
