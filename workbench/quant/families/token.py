"""The token family: one scale (and zero point, if asymmetric) per token and kv head, computed on write and kept
in the block beside its codes (fp32), so a copied, forked or swapped block carries them.

- symmetric (fp8, int8): ``scale = amax / qmax`` (1 where that is 0: ``amax == 0`` or an underflow), codes as the
  static family's.
- asymmetric (``int8_asym``, uint8 codes): ``scale = (max - min) / qmax`` (1 where 0), ``code =
  round_half_even(clamp((x - min) / scale, 0, qmax))``, read back as ``code * scale + min``; finite inputs up to
  ``2**126`` (fp32 ``max - min`` and the read-back must not overflow).
"""

from __future__ import annotations

import torch

from .base import Scheme
from .common import ASYM_LIMIT, FP32_MAX, BlockScales, Quantized, div, nonzero, scales_start, to_codes


class TokenScheme(Scheme):
    """Per-token scales: fp32 ``[block_size, heads]`` after the codes (zero points after the scales)."""

    family = "token"
    granularities = ("token",)
    scales_on_write = True

    @property
    def input_limit(self) -> float:
        return FP32_MAX if self.symmetric else ASYM_LIMIT

    def bytes_per_token(self, num_heads: int, head_dim: int, context: int | None = None) -> float:
        code = num_heads * head_dim * self.bits / 8
        return 2 * (code + num_heads * 4 * (1 if self.symmetric else 2))

    def block_scales(self, kind: str, block_size: int, num_heads: int, head_dim: int) -> BlockScales:
        start = scales_start(block_size * num_heads * head_dim * self.format.storage.itemsize)
        return BlockScales(start, torch.float32, 1, head_dim, (block_size, num_heads, 1), not self.symmetric)

    def _quantize(self, x: torch.Tensor, kind: str, scale: torch.Tensor | None) -> Quantized:
        xf = x.float()
        if self.symmetric:
            s = nonzero(div(xf.abs().amax(dim=-1), self.qmax))  # [T, H]
            return Quantized(to_codes(self.format, xf / s[..., None]), s)
        lo, hi = xf.amin(dim=-1), xf.amax(dim=-1)
        s = nonzero(div(hi - lo, self.qmax))
        return Quantized(to_codes(self.format, (xf - lo[..., None]) / s[..., None]), s, lo)

    def dequantize(self, qz: Quantized, kind: str = "k") -> torch.Tensor:
        out = qz.codes.float() * qz.scale[..., None]
        return out if qz.zero is None else out + qz.zero[..., None]
