"""What the delta codec (:mod:`workbench.coding.delta`) and its lossy variant (:mod:`workbench.compress.delta_quant`)
take, and the checks that refuse anything else by name (``ValueError``): the dtypes, each with its integer view, numpy
unsigned type and wire code; the delta modes, byte orders and zstd levels.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import zstandard

# torch dtype -> (torch integer view of the same size, numpy unsigned type, wire code). Wire codes are stable.
DTYPE_VIEWS: dict[torch.dtype, tuple[torch.dtype, type, int]] = {
    torch.float16: (torch.int16, np.uint16, 1),
    torch.bfloat16: (torch.int16, np.uint16, 2),
    torch.float32: (torch.int32, np.uint32, 3),
    torch.float64: (torch.int64, np.uint64, 4),
    torch.int8: (torch.uint8, np.uint8, 5),
    torch.uint8: (torch.uint8, np.uint8, 6),
    torch.int16: (torch.int16, np.uint16, 7),
    torch.int32: (torch.int32, np.uint32, 8),
    torch.int64: (torch.int64, np.uint64, 9),
    torch.float8_e4m3fn: (torch.uint8, np.uint8, 10),
    torch.float8_e5m2: (torch.uint8, np.uint8, 11),
}
DTYPES = tuple(DTYPE_VIEWS)  # what delta.encode takes
DELTAS = ("sub", "xor", "none")  # ``delta=True`` means "sub" (measured better than "xor": delta's docstring)
ORDERS = ("token", "channel")
MIN_LEVEL, MAX_LEVEL = -7, zstandard.MAX_COMPRESSION_LEVEL  # zstd's fast levels -7 .. -1, then 1 .. 22


def dtype_name(dt) -> str:
    """``torch.float16`` -> ``"float16"`` (as messages name a dtype)."""
    return str(dt).replace("torch.", "")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_level(level) -> None:
    if isinstance(level, bool) or not isinstance(level, int) or not MIN_LEVEL <= level <= MAX_LEVEL:
        raise ValueError(f"level must be an int in [{MIN_LEVEL}, {MAX_LEVEL}] (zstd), got {level!r}")


def check_shape(name: str, shape: tuple) -> None:
    if len(shape) not in (2, 3) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
        raise ValueError(f"{name} must be [tokens, heads, head_dim] or [tokens, channels], got {list(shape)}")
    if math.prod(shape) == 0:
        raise ValueError(f"{name} must not be empty, got {list(shape)}")


def check_tensor(x, name: str = "x") -> torch.Tensor:
    """``x``, a tensor the codec takes: one of :data:`DTYPES`, ``[T, H, D]`` or ``[T, C]``, not empty."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPE_VIEWS:
        raise ValueError(f"{name} has dtype {dtype_name(x.dtype)}; encode takes "
                         f"{[dtype_name(d) for d in DTYPES]}")
    check_shape(f"{name} shape", tuple(x.shape))
    return x


def delta_mode(delta) -> str:
    """``delta`` as one of :data:`DELTAS` (``True``: ``"sub"``, ``False``: ``"none"``)."""
    if delta is True:
        return "sub"
    if delta is False:
        return "none"
    if not isinstance(delta, str) or delta not in DELTAS:
        raise ValueError(f"delta must be True, False or one of {list(DELTAS)}, got {delta!r}")
    return delta


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value
