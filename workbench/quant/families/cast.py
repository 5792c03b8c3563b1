"""The cast family: fp32, fp16, bf16 stored as they are (no codes, no scales)."""

from __future__ import annotations

import math

import torch

from .base import Scheme
from .common import Quantized


class CastScheme(Scheme):
    """Values cast to the storage dtype; NaN/Inf pass through, as the cast does."""

    family = "cast"
    granularities = ("none",)
    quantized = False

    @property
    def input_limit(self) -> float:
        """The storage range (fp32: inf): a larger finite value would become Inf."""
        storage = self.format.storage
        return math.inf if storage == torch.float32 else float(torch.finfo(storage).max)

    def scales_label(self) -> str:
        return "a cast, no scales"

    def bytes_per_token(self, num_heads: int, head_dim: int, context: int | None = None) -> float:
        return 2 * num_heads * head_dim * self.bits / 8

    def _quantize(self, x: torch.Tensor, kind: str, scale: torch.Tensor | None) -> Quantized:
        return Quantized(x.to(self.format.storage))

    def dequantize(self, qz: Quantized, kind: str = "k") -> torch.Tensor:
        return qz.codes.float()
