"""The write launch: which program shape and tile a ``write_kv`` call gets (explicit keywords, then the
measured prefill table in ``kernels/tuning/write_prefill.json``, then the scheme's heuristic)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

import workbench
from workbench.core import kv_formats
from workbench.core.layout import Layout

from .. import common
from .kernel import QUANT_FP8, QUANT_INT8, QUANT_MATHS, QUANT_NONE, SCHEMES


def quant_mode(dtype: torch.dtype) -> tuple[int, float, float]:
    """``(QUANT, QMIN, QMAX)`` for a cache dtype, from its format (``workbench.core.kv_formats``): cast, fp8
    (saturating at +-max) or int (rounded, clamped to the code range)."""
    fmt = kv_formats.get(dtype)
    return {"cast": QUANT_NONE, "fp8": QUANT_FP8, "int": QUANT_INT8}[fmt.codes], fmt.qmin, fmt.qmax


def default_launch(num_tokens: int, num_heads: int, head_dim: int, block_size: int, layout: Layout | str):
    """Heuristic ``(tokens_per_program, num_warps)`` of the ``"head"`` scheme.

    Big batches (prefill): 16 tokens x one head x D per program (8 KB of fp16 K+V read at D=128),
    enough programs to fill the GPU. Small batches (decode): one token per program, so the few
    rows spread over many SMs. For the vLLM value layout the tile must fit a block to be stored
    as a run, so tokens per program also divides the block size.
    """
    bt = 1
    while bt < 16 and num_tokens * num_heads >= 2048 * (2 * bt):
        bt *= 2
    if Layout.parse(layout) is Layout.VLLM and block_size > 1:
        bt = min(bt, common.pow2_divisor(block_size, 16))
    tile = bt * triton.next_power_of_2(head_dim)
    num_warps = min(8, max(1, tile // 512))
    return bt, num_warps


def rows_launch(
    num_tokens: int, num_heads: int, head_dim: int, block_size: int, layout: Layout | str,
    heads_per_program: int | None = None, kv_split: bool = False,
) -> tuple[int, int]:
    """Heuristic ``(tokens_per_program, num_warps)`` of the ``"rows"`` scheme.

    Tiles of up to 8192 elements per tensor (16 KB of fp16 K and as much V in flight per
    program at 4 warps, 64 elements a thread), while the grid keeps >= 1024 programs; for the
    vLLM value layout the tokens per program also divide the block size (runs).
    """
    bh = triton.next_power_of_2(max(1, min(heads_per_program or num_heads, num_heads)))
    bd = triton.next_power_of_2(head_dim)
    n_sub = -(-num_heads // bh) * (2 if kv_split else 1)
    bt = 1
    while bt < 16 and 2 * bt * bh * bd <= 8192 and -(-num_tokens // (2 * bt)) * n_sub >= 1024:
        bt *= 2
    if Layout.parse(layout) is Layout.VLLM and block_size > 1:
        bt = min(bt, common.pow2_divisor(block_size, 16))
    num_warps = min(8, max(1, bt * bh * bd // 2048))
    return bt, num_warps


class Launch(NamedTuple):
    """One kernel launch of a write, resolved but not made: ``kernel[grid](*args, **consts)``
    (``consts``: constexprs and launch options, as Triton takes them). ``write_launches`` gives a write's list, so
    tools compile them ahead of time (``workbench.bench.anatomy --kernel write``)."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    consts: dict

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.consts)


class WriteConfig(NamedTuple):
    """One launch of :func:`write_kv`, resolved (every field is a ``write_kv`` keyword)."""

    scheme: str
    tokens_per_program: int
    num_warps: int
    heads_per_program: int  # 1 for "head"; BLOCK_H (a power of two) for "rows"
    kv_split: bool
    quant_math: str


# Batches this big are "prefill": the head scheme's heuristic is at its largest tile there.
PREFILL_MIN_ROWS = 2048 * 16  # num_tokens * num_heads
# THE TABLE: launch defaults for prefill-sized batches, per GPU and (layout, quantized cache), measured and kept
# as data in tuning/write_prefill.json (what each entry means and where it was measured is written there).
# Launch plans are cached per geometry: edit PREFILL_DEFAULTS before the first write_kv call (or clear _PLANS).
_QUANT_MATH = "exact" if workbench.is_interpreted() else "cast"  # see tuning/write_prefill.json's "about"


def prefill_defaults(gpu: str | None = None) -> dict[tuple[Layout, bool], dict]:
    """The write_kv keywords for prefill-sized batches on ``gpu`` (default: this machine's), from the table."""
    _, entries = common.tuning_table("write_prefill", gpu)
    table = {}
    for e in entries:
        cfg = dict(e["config"])
        if e["quantized"]:
            cfg.setdefault("quant_math", _QUANT_MATH)
        table[(Layout.parse(e["layout"]), bool(e["quantized"]))] = cfg
    return table


PREFILL_DEFAULTS: dict[tuple[Layout, bool], dict] = prefill_defaults()


def _is_pow2(n) -> bool:
    return isinstance(n, int) and n >= 1 and not n & (n - 1)


def interpreter_launch(num_tokens: int, block_size: int, layout: Layout | str) -> dict:
    """``write_kv`` keywords for the Triton interpreter, where a program costs milliseconds whatever its size: the
    fewest programs (all heads, up to 16 tokens each; a divisor of the block for the vLLM value layout)."""
    layout = Layout.parse(layout)
    bt = min(16, triton.next_power_of_2(max(1, num_tokens)))
    if layout is Layout.VLLM and block_size > 1:
        bt = min(bt, common.pow2_divisor(block_size, 16))
    return {"scheme": "rows", "tokens_per_program": bt}


def launch_config(
    num_tokens: int, num_heads: int, head_dim: int, block_size: int, layout: Layout | str, quantized: bool = False,
    *, scheme: str | None = None, tokens_per_program: int | None = None, num_warps: int | None = None,
    heads_per_program: int | None = None, kv_split: bool | None = None, quant_math: str | None = None,
) -> WriteConfig:
    """The launch :func:`write_kv` uses: explicit keywords first, then PREFILL_DEFAULTS (prefill-sized
    batches), then the scheme's heuristic. Raises ValueError for a bad keyword."""
    layout = Layout.parse(layout)
    table = PREFILL_DEFAULTS.get((layout, quantized), {}) if num_tokens * num_heads >= PREFILL_MIN_ROWS else {}
    pick = lambda name, given: table.get(name) if given is None else given  # noqa: E731
    scheme = pick("scheme", scheme) or "head"
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    quant_math = pick("quant_math", quant_math) or "exact"
    if quant_math not in QUANT_MATHS:
        raise ValueError(f"quant_math must be one of {QUANT_MATHS}, got {quant_math!r}")
    bt, warps = pick("tokens_per_program", tokens_per_program), pick("num_warps", num_warps)
    split, hpp = bool(pick("kv_split", kv_split)), pick("heads_per_program", heads_per_program)
    if hpp is not None and not _is_pow2(hpp):
        raise ValueError(f"heads_per_program must be a power of two, got {hpp}")
    if scheme == "head":
        if split or (hpp or 1) != 1:
            raise ValueError("kv_split and heads_per_program > 1 need scheme='rows' (the head scheme does one head, K+V)")
        bt_auto, warps_auto = default_launch(num_tokens, num_heads, head_dim, block_size, layout)
        bh = 1
    else:
        bh = min(hpp or num_heads, num_heads)  # all heads by default
        bh = triton.next_power_of_2(max(bh, 1))
        bt_auto, warps_auto = rows_launch(num_tokens, num_heads, head_dim, block_size, layout, bh, split)
    bt = bt_auto if bt is None else bt
    warps = warps_auto if warps is None else warps
    if not _is_pow2(bt):
        raise ValueError(f"tokens_per_program must be a power of two, got {bt}")
    if not _is_pow2(warps):
        raise ValueError(f"num_warps must be a power of two, got {warps}")
    return WriteConfig(scheme, bt, warps, bh, split, quant_math)
