"""What every storage family shares: the stored record (:class:`Quantized`), the scale array of a block
(:class:`BlockScales`), the finite-value checks and the fp32/fp16 helpers of the reference arithmetic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

F16_MAX = 65504.0  # fp16's largest finite value: group scales, zero points and the residual saturate there
FP32_MAX = float(torch.finfo(torch.float32).max)
ASYM_LIMIT = 2.0**126  # asymmetric fp32 scales: max - min and code * scale + min stay finite below it
SCALE_ALIGN = 16  # bytes: a block's scale array starts on a 16-byte boundary after its codes


class NonFiniteError(ValueError):
    """K/V to quantize holds NaN or Inf (the Python path refuses to spread it)."""


@dataclass(frozen=True)
class Quantized:
    """What a scheme stores for ``[T, H, D]`` values of one kind (K or V).

    Attributes:
        codes: ``[Tq, H, D]`` (1- and 2-byte formats) or ``[Tq, H, D * bits // 8]`` packed bytes (groups family).
        scale: ``None`` (cast), ``[]`` / ``[H]`` (static), ``[Tq, H]`` fp32 (token), ``[Tq, H, D // value_group]``
            or ``[Tq // group, H, D]`` fp16 (groups, per token or per channel).
        zero: like ``scale`` for asymmetric schemes (the group's minimum), else ``None``.
        residual: ``[T - Tq, H, D]`` fp16: the newest tokens, kept unquantized (groups family only).
    """

    codes: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    residual: torch.Tensor | None = None


class BlockScales(NamedTuple):
    """The scale array of one block of one kind (K or V); element strides in units of ``dtype``
    (``workbench.quant.blocks`` says where it sits in the block)."""

    offset: int  # bytes from the block's start to its first scale
    dtype: torch.dtype  # fp32 (token family) or fp16 (groups family)
    tokens_per_group: int  # TG: 1 (one scale per token) or the key group (KIVI keys per channel)
    channels_per_group: int  # DG: head_dim (one scale per token-head), value_group, or 1 (per channel)
    groups: tuple[int, int, int]  # (token groups, heads, channel groups)
    has_zero: bool  # asymmetric: zero points follow the scales, same shape

    @property
    def count(self) -> int:
        n_tg, h, n_dg = self.groups
        return n_tg * h * n_dg

    @property
    def strides(self) -> tuple[int, int, int]:
        """Element strides of (token group, head, channel group): head-major, so the scales of one head's tokens
        are contiguous (a decode program reads one head)."""
        n_tg, _, n_dg = self.groups
        return n_dg, n_tg * n_dg, 1

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize * (2 if self.has_zero else 1)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def scales_start(code_bytes: int) -> int:
    """Where a block's scale array starts: after its ``code_bytes``, rounded up to :data:`SCALE_ALIGN`."""
    return -(-code_bytes // SCALE_ALIGN) * SCALE_ALIGN


def first_bad(x: torch.Tensor, bad: torch.Tensor) -> str:
    """Where the first bad element is, its index named by the axes ``[(layer,) token, head, dim]``."""
    where = tuple(int(i) for i in bad.nonzero()[0])
    axes = ["layer", "token", "head", "dim"][-x.dim():] if 0 < x.dim() <= 4 else ["index"] * x.dim()
    return f"first at [{', '.join(axes)}] = {list(where)}: {float(x[where])}"


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise :class:`NonFiniteError` naming ``name`` and the first bad element."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        raise NonFiniteError(f"{name} holds {int(bad.sum())} NaN/Inf values ({first_bad(x, bad)}); quantizing would "
                             f"spread them")


def to_fp16(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp16, saturated at +-65504 (a plain cast makes Inf of anything beyond); NaN stays NaN."""
    return x.float().clamp(-F16_MAX, F16_MAX).to(torch.float16)


def round_even(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # torch rounds half to even


def div(x: torch.Tensor, q: float) -> torch.Tensor:
    """``x / q`` rounded as IEEE division on every device, as the write kernels divide (``div_rn``): torch's CUDA
    division by a Python number multiplies by its rounded reciprocal instead, which is one bit off for some ``x``
    (a scale 1 ulp from the kernel's, and its codes with it)."""
    return x / torch.tensor(q, dtype=x.dtype, device=x.device)


def nonzero(s: torch.Tensor) -> torch.Tensor:
    """A computed scale, 1 where it is 0 (a constant row, or ``amax / qmax`` underflowing): never a division by 0."""
    return torch.where(s > 0, s, torch.ones_like(s))


def to_codes(fmt, y: torch.Tensor) -> torch.Tensor:
    """``y`` (values over their scale) as codes of format ``fmt``: clamped to its range, integer codes rounded
    half to even, fp8 codes by the cast's round to nearest even."""
    y = y.clamp(fmt.qmin, fmt.qmax)
    return (round_even(y) if fmt.codes == "int" else y).to(fmt.storage)
