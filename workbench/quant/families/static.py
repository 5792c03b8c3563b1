"""The static family: fp8 / int8 codes with scales given ahead, one per tensor (``tensor``) or per kv head
(``head``), calibrated (:class:`~workbench.quant.Calibrator`) or set by hand; nothing but codes in the blocks.

``code = fp8(clamp(x / scale, -max, max))`` (vLLM's convention, saturating, round to nearest even) or
``round_half_even(clamp(x / scale, qmin, qmax))`` for int8; read back as ``code * scale``.
"""

from __future__ import annotations

import torch

from .base import Scheme
from .common import Quantized, check_finite, div, nonzero, to_codes


class StaticScheme(Scheme):
    """Static scales: a few bytes per layer, not per token; the caller gives them to the cache and kernels."""

    family = "static"
    granularities = ("tensor", "head")
    needs_static_scales = True

    def bytes_per_token(self, num_heads: int, head_dim: int, context: int | None = None) -> float:
        return 2 * num_heads * head_dim * self.bits / 8  # static scales: a few bytes per layer, not per token

    def calibrate(self, x: torch.Tensor) -> torch.Tensor:
        """``amax / qmax`` of ``x`` ``[T, H, D]`` over the tensor (``[]``) or per head (``[H]``), fp32."""
        check_finite("x", x)
        a = x.float().abs()
        amax = a.amax() if self.granularity == "tensor" else a.amax(dim=(0, 2))
        return nonzero(div(amax, self.qmax))

    def scales_from_amax(self, amax: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
        """``amax * margin / qmax`` of per-head maxima ``[H]``: one value (``tensor``: the largest) or ``[H]``;
        1 where the maximum is 0."""
        amax = (amax if self.granularity == "head" else amax.amax().reshape(1)) * margin
        return torch.where(amax > 0, div(amax, self.qmax), torch.ones_like(amax))

    def layer_scales_from_amax(self, amax: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
        """:meth:`scales_from_amax` of each layer's maxima ``[L, H]``: ``[L]`` (``tensor``) or ``[L, H]``."""
        rows = torch.stack([self.scales_from_amax(a, margin) for a in amax])
        return rows if self.granularity == "head" else rows.reshape(-1)

    def static_scale_count(self, num_heads: int) -> int:
        return num_heads if self.granularity == "head" else 1

    def _quantize(self, x: torch.Tensor, kind: str, scale: torch.Tensor | None) -> Quantized:
        xf = x.float()
        s = self.calibrate(x) if scale is None else scale.float().reshape(-1)
        if s.numel() not in (1, x.shape[1]):
            raise ValueError(f"scale of {self.name} must hold 1 or {x.shape[1]} values, got {s.numel()}")
        self.check_scale_values("scale", s)
        per_tensor = self.granularity == "tensor"
        sb = s.reshape(()) if per_tensor or s.numel() == 1 else s.reshape(1, -1, 1)
        return Quantized(to_codes(self.format, xf / sb), s.reshape(()) if per_tensor else s)

    def dequantize(self, qz: Quantized, kind: str = "k") -> torch.Tensor:
        s = qz.scale.float()
        s = s.reshape(()) if s.numel() == 1 else s.reshape(1, -1, 1)
        return qz.codes.float() * s
