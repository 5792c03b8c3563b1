"""Storage families of quantized K/V: one class per family, each owning its behaviour (docs/quant_families.md).

- :class:`CastScheme` (``cast``): fp32 / fp16 / bf16 as they are.
- :class:`StaticScheme` (``static``): fp8 / int8 codes, scales per tensor or kv head given ahead.
- :class:`TokenScheme` (``token``): fp8 / int8 / uint8 codes, a scale (and zero point) per token in the blocks.
- :class:`GroupScheme` (``groups``): KIVI's packed int4 / int2 codes, fp16 group scales and zero points in the
  blocks, an fp16 residual of the newest tokens.

:data:`FAMILY_CLASSES` maps each family's name (``workbench.quant.names``) to its class.
"""

from __future__ import annotations

from .base import Scheme, family_class
from .cast import CastScheme
from .common import (
                     ASYM_LIMIT,
                     F16_MAX,
                     FP32_MAX,
                     SCALE_ALIGN,
                     BlockScales,
                     NonFiniteError,
                     Quantized,
                     check_finite,
                     to_fp16,
)
from .groups import GroupScheme, pack, unpack
from .static import StaticScheme
from .token import TokenScheme

FAMILY_CLASSES: dict[str, type[Scheme]] = {c.family: c for c in (CastScheme, StaticScheme, TokenScheme, GroupScheme)}

__all__ = ["ASYM_LIMIT", "F16_MAX", "FAMILY_CLASSES", "FP32_MAX", "SCALE_ALIGN", "BlockScales", "CastScheme",
           "GroupScheme", "NonFiniteError", "Quantized", "Scheme", "StaticScheme", "TokenScheme", "check_finite",
           "family_class", "pack", "to_fp16", "unpack"]
