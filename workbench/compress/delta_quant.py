"""The lossy variant of :mod:`workbench.coding.delta`: quantize K/V with a ``workbench.quant`` scheme, then
delta-code the codes losslessly (scales, zero points raw; a KIVI residual coded losslessly).

    qe = encode_quantized(k, "int4/kivi", kind="k")   # or a Scheme with its own group / residual / key_mode
    decode_quantized(qe)                               # scheme.roundtrip(k), bit for bit

The encoding carries every field of its scheme (:attr:`QuantEncoded.params`), so it decodes with the scheme it was
made with, whatever its parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from workbench import quant
from workbench.coding.delta import Encoded, decode, encode
from workbench.coding.delta_options import check_choice, check_tensor, dtype_name


@dataclass(frozen=True)
class QuantEncoded:
    """``x`` quantized with a ``workbench.quant`` scheme, its codes delta-coded, scales and zero points raw.

    Attributes:
        scheme: the scheme's name; ``kind``: ``"k"`` or ``"v"``.
        shape: ``x``'s shape ``[T, H, D]``.
        codes: the codes, :class:`Encoded` (packed ``group`` codes unpacked to one byte per channel first, so the
            delta runs per channel); ``None`` when every token is in the residual.
        scale, zero: the scheme's scales / zero points as stored (raw; ``None`` where it has none).
        residual: the ``group`` schemes' fp16 newest tokens, :class:`Encoded` losslessly (``None``: none).
        params: every field of the scheme (format, granularity, symmetric, group, value_group, residual, key_mode,
            ``(name, value)`` pairs): decoding rebuilds it from them (:attr:`spec`), so an encoding made with
            non-default parameters, or with a scheme outside the registry, decodes as it was made.
    """

    scheme: str
    kind: str
    shape: tuple[int, ...]
    codes: Encoded | None
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    residual: Encoded | None
    params: tuple[tuple[str, object], ...] = ()

    @property
    def spec(self):
        """The :class:`~workbench.quant.Scheme` the values were quantized with (ValueError if ``params`` is not one)."""
        p = dict(self.params)
        if not p:  # made by hand without parameters: the registry's scheme of that name
            return quant.get(self.scheme)
        try:
            s = quant.Scheme(**p)  # the family class that stores its granularity (ValueError for none)
            s.check()
            _ = s.format  # a format that exists
        except (TypeError, ValueError) as e:
            raise ValueError(f"qe is inconsistent: params {p} are not a quantization scheme ({e})") from None
        if s.name != self.scheme:
            raise ValueError(f"qe is inconsistent: params name scheme {s.name!r}, the encoding says {self.scheme!r}")
        return s

    @property
    def nbytes(self) -> int:
        """Stored bytes: coded codes, raw scales and zero points, coded residual."""
        raw = sum(t.numel() * t.element_size() for t in (self.scale, self.zero) if t is not None)
        return sum(e.nbytes for e in (self.codes, self.residual) if e is not None) + raw

    @property
    def ratio(self) -> float:
        """fp16 bytes of the original over :attr:`nbytes`."""
        return 2 * math.prod(self.shape) / self.nbytes


def encode_quantized(x: torch.Tensor, scheme="int8/token", *, kind: str = "k", scale: torch.Tensor | None = None,
                     delta: bool | str = True, shuffle: bool = True, order: str = "token", rle: bool = False,
                     level: int = 3) -> QuantEncoded:
    """Quantize ``x`` ``[T, H, D]`` with ``scheme`` (``workbench.quant.resolve``: ``"int8/token"``,
    ``"int4/token"``, ``"int4/kivi"``, ``"fp8_e4m3/token"``, ...), then :func:`encode` the codes.

    Args:
        x: ``[T, H, D]`` finite values (a quantized scheme refuses NaN/Inf).
        scheme: a scheme name or :class:`~workbench.quant.Scheme`.
        kind: ``"k"`` or ``"v"`` (KIVI quantizes keys per channel).
        scale: a static scheme's scale (default: calibrated on ``x``).
        delta, shuffle, order, rle, level: as :func:`encode`, for the codes.
    """
    s = quant.resolve(scheme, "scheme")
    x = check_tensor(x)
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [tokens, heads, head_dim] tensor, got {dtype_name(x.dtype)} "
                         f"{list(x.shape)}")
    check_choice("kind", kind, ("k", "v"))
    qz = s.quantize(x.detach().cpu(), kind, scale)
    codes = s.code_values(qz.codes)
    opts = dict(delta=delta, shuffle=shuffle, order=order, rle=rle, level=level)
    res = qz.residual if qz.residual is not None and qz.residual.numel() else None
    params = tuple((f.name, getattr(s, f.name)) for f in fields(s) if f.compare)  # every field but the label
    return QuantEncoded(s.name, kind, tuple(x.shape), encode(codes, **opts) if codes.numel() else None, qz.scale,
                        qz.zero, encode(res, **opts) if res is not None else None, params)


def decode_codes(qe: QuantEncoded):
    """The scheme's :class:`~workbench.quant.Quantized` (codes re-packed), exactly as it quantized them."""
    if not isinstance(qe, QuantEncoded):
        raise ValueError(f"qe must be a QuantEncoded (from encode_quantized()), got {type(qe).__name__}")
    s = qe.spec
    T, H, D = qe.shape
    tq = s.quantized_tokens(T)
    if qe.codes is None:
        codes = torch.zeros(0, H, s.code_dim(D), dtype=s.format.storage)
    else:
        codes = s.store_codes(decode(qe.codes))
    residual = decode(qe.residual) if qe.residual is not None else None
    if residual is None and s.keeps_residual:
        residual = torch.zeros(0, H, D, dtype=torch.float16)
    if (residual.shape[0] if residual is not None else 0) + tq != T:
        raise ValueError(f"qe is inconsistent: {tq} quantized + residual tokens do not make {T}")
    return quant.Quantized(codes, qe.scale, qe.zero, residual)


def decode_quantized(qe: QuantEncoded) -> torch.Tensor:
    """The dequantized values, fp32 ``[T, H, D]``: ``scheme.roundtrip(x)``, bit for bit."""
    qz = decode_codes(qe)
    return qe.spec.dequantize(qz, qe.kind)


__all__ = ["QuantEncoded", "decode_codes", "decode_quantized", "encode_quantized"]
