"""Quantization schemes of K/V: the names of before the storage families, kept for old imports.

A scheme is an object of its family's class (``workbench.quant.families``: cast, static, token, groups), which
owns its arithmetic, block layout and bytes; the exact arithmetic is written down in each family's module.
"""

from __future__ import annotations

from .families import (
                       ASYM_LIMIT,
                       F16_MAX,
                       FP32_MAX,
                       NonFiniteError,
                       Quantized,
                       Scheme,
                       check_finite,
                       pack,
                       to_fp16,
                       unpack,
)

__all__ = ["ASYM_LIMIT", "F16_MAX", "FP32_MAX", "NonFiniteError", "Quantized", "Scheme", "check_finite", "pack",
           "to_fp16", "unpack"]
