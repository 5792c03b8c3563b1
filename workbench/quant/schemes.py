"""Quantization schemes of K/V: small objects that say how values become stored codes and back.

A :class:`Scheme` is the plain PyTorch definition (the reference the kernels are tested against, code by
code) and the accounting (bytes per token, scales and zero points counted). The storage codes themselves
(dtype, bits, range) are ``workbench.formats``'s; a scheme adds where the scales live:

- ``none``: a plain cast (fp32, fp16, bf16).
- ``tensor`` / ``head``: static scales (one, or one per kv head), given or calibrated; not stored in blocks.
- ``token``: one scale (and zero point, if asymmetric) per token and kv head, computed on write and stored
  in the block beside its codes (fp32), so a copied, forked or swapped block carries them.
- ``group``: KIVI (Liu et al., 2024), asymmetric ``2**bits`` levels with fp16 scale and zero point per group,
  codes packed ``8 // bits`` to a byte. Keys per channel over groups of ``group`` tokens (``key_mode="channel"``)
  or per token over groups of ``value_group`` channels (``key_mode="token"``); values always per token over
  groups of ``value_group`` channels. The newest ``residual`` tokens (and those of an unfinished key group)
  stay in fp16.

Exact arithmetic (the kernels reproduce it bit for bit; all fp32, IEEE division):

- symmetric: ``scale = amax / qmax`` (1 where that is 0: ``amax == 0`` or an underflow); fp8
  ``code = fp8(clamp(x / scale, -max, max))`` (vLLM's convention, saturating, round to nearest even); int
  ``code = round_half_even(clamp(x / scale, qmin, qmax))``.
- asymmetric: ``scale = (max - min) / qmax`` (1 where that is 0), ``code = round_half_even(clamp((x - min)
  / scale, 0, qmax))``, read back as ``code * scale + min``. Groups (KIVI) store ``zero = clamp(min, +-65504)`` and
  ``scale = clamp((max - zero) / qmax, 0, 65504)`` (fp32, then rounded to fp16: saturated, never Inf; a zero fp16
  scale becomes 1) and quantize with the rounded values; the fp16 residual saturates at +-65504 too, and the cache
  quantizes K/V as that residual holds them (fp16, saturated), whether a token waited there or not.

What a scheme cannot store is refused before anything is written (:meth:`Scheme.check_input`): NaN/Inf in a
quantized scheme, finite values beyond :attr:`Scheme.input_limit` (a cast's storage range; ``2**126`` for the
asymmetric per-token scheme, whose fp32 ``max - min`` and ``code * scale + min`` must not overflow). Every other
finite input quantizes to finite codes and scales and reads back finite.
- packing (``group``): byte ``j`` of a token-head row (``0 <= j < D * bits / 8``) holds channel
  ``j + k * D * bits / 8`` in bits ``[k * bits, (k + 1) * bits)``, so each ``k`` is a contiguous slice of
  channels (the decode kernel unpacks a slice with one shift and one mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from workbench import formats

F16_MAX = 65504.0  # fp16's largest finite value: group scales, zero points and the residual saturate there
FP32_MAX = float(torch.finfo(torch.float32).max)
ASYM_LIMIT = 2.0**126  # asymmetric fp32 scales: max - min and code * scale + min stay finite below it


class NonFiniteError(ValueError):
    """K/V to quantize holds NaN or Inf (the Python path refuses to spread it)."""


@dataclass(frozen=True)
class Quantized:
    """What a scheme stores for ``[T, H, D]`` values of one kind (K or V).

    Attributes:
        codes: ``[Tq, H, D]`` (1- and 2-byte formats) or ``[Tq, H, D * bits // 8]`` packed bytes (``group``).
        scale: ``None`` (cast), ``[]`` / ``[H]`` (static), ``[Tq, H]`` fp32 (``token``), ``[Tq, H, D // value_group]``
            or ``[Tq // group, H, D]`` fp16 (``group``, per token or per channel).
        zero: like ``scale`` for asymmetric schemes (the group's minimum), else ``None``.
        residual: ``[T - Tq, H, D]`` fp16: the newest tokens, kept unquantized (``group`` only).
    """

    codes: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    residual: torch.Tensor | None = None


def _first(x: torch.Tensor, bad: torch.Tensor) -> str:
    """Where the first bad element is, its index named by the axes ``[(layer,) token, head, dim]``."""
    where = tuple(int(i) for i in bad.nonzero()[0])
    axes = ["layer", "token", "head", "dim"][-x.dim():] if 0 < x.dim() <= 4 else ["index"] * x.dim()
    return f"first at [{', '.join(axes)}] = {list(where)}: {float(x[where])}"


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise :class:`NonFiniteError` naming ``name`` and the first bad element."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        raise NonFiniteError(f"{name} holds {int(bad.sum())} NaN/Inf values ({_first(x, bad)}); quantizing would "
                             f"spread them")


def to_fp16(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp16, saturated at +-65504 (a plain cast makes Inf of anything beyond); NaN stays NaN."""
    return x.float().clamp(-F16_MAX, F16_MAX).to(torch.float16)


def _round_even(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # torch rounds half to even


@dataclass(frozen=True)
class Scheme:
    """One way to store K/V.

    Attributes:
        name: the registry name (``workbench.quant.get``), e.g. ``"fp8_e4m3/token"``, ``"int4/kivi"``.
        format_name: the storage format in ``workbench.formats``.
        granularity: ``"none"``, ``"tensor"``, ``"head"``, ``"token"`` or ``"group"`` (module docstring).
        symmetric: codes centred on zero (no zero point).
        group: ``group`` schemes with ``key_mode="channel"``: tokens per key group.
        value_group: ``group`` schemes: channels per value group (and per key group with ``key_mode="token"``).
        residual: ``group`` schemes: newest tokens kept in fp16.
        key_mode: ``group`` schemes: ``"channel"`` (KIVI's keys) or ``"token"``.
    """

    name: str
    format_name: str
    granularity: str
    symmetric: bool = True
    group: int = 0
    value_group: int = 0
    residual: int = 0
    key_mode: str = "token"
    label: str = field(default="", compare=False)

    # ---- what it is -----------------------------------------------------------------
    @property
    def format(self) -> formats.KVFormat:
        return formats.get(self.format_name)

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def quantized(self) -> bool:
        return self.granularity != "none"

    @property
    def packed(self) -> bool:
        return self.granularity == "group"

    @property
    def scales_in_blocks(self) -> bool:
        """Scales computed on write and kept in the blocks beside their codes (``token`` and ``group``)."""
        return self.granularity in ("token", "group")

    @property
    def static(self) -> bool:
        """Scales given or calibrated ahead (per tensor / head), not computed on write."""
        return self.granularity in ("tensor", "head")

    @property
    def qmax(self) -> float:
        return self.format.qmax

    @property
    def input_limit(self) -> float:
        """The largest ``|x|`` stored with finite codes, scales and read-back (module docstring): a cast's storage
        range (fp32: inf), ``2**126`` for the asymmetric per-token scheme, else any finite fp32 (saturating)."""
        if not self.quantized:
            return math.inf if self.format.storage == torch.float32 else float(torch.finfo(self.format.storage).max)
        return ASYM_LIMIT if self.granularity == "token" and not self.symmetric else FP32_MAX

    def check_input(self, name: str, x: torch.Tensor, *, allow_nonfinite: bool = False) -> None:
        """Raise ValueError naming ``name`` if ``x`` holds values this scheme cannot store: NaN/Inf in a quantized
        scheme (:class:`NonFiniteError`; a cast passes them through, as the cast does, and so does any scheme with
        ``allow_nonfinite``: the write kernels count them) and finite values beyond :attr:`input_limit`. One
        reduction (one device sync) when all is well; nothing where no finite value can be beyond the limit."""
        limit = self.input_limit
        if self.quantized and not allow_nonfinite:
            over = ~(x.abs().float() <= limit)  # NaN, Inf and too large, in one pass (fp32: limit exact)
        elif limit >= FP32_MAX or not x.is_floating_point() or float(torch.finfo(x.dtype).max) <= limit:
            return
        else:
            a = x.abs().float()
            over = (a > limit) & (a != math.inf)
        if not bool(over.any()):
            return
        if self.quantized and not allow_nonfinite:
            check_finite(name, x)
        why = (f"{self.format_name} holds |x| <= {limit:g}" if not self.quantized else
               "its fp32 range max - min and read-back code * scale + min must stay finite: |x| <= 2**126")
        raise ValueError(f"{name} holds {int(over.sum())} values {self.name} cannot store ({why}); {_first(x, over)}")

    def check_scale_values(self, name: str, scale) -> None:
        """A static scale must be finite and > 0, with ``qmax * scale`` finite (what a saturated code reads back)."""
        s = torch.as_tensor(scale, dtype=torch.float32)
        if not bool(((s > 0) & torch.isfinite(s * self.qmax)).all()):
            raise ValueError(f"{name} of {self.name} must hold finite values > 0 whose {self.qmax:g}-fold is finite "
                             f"(fp32), got {s.flatten()[:8].tolist()}")

    def title(self) -> str:
        """A short name for plots."""
        if self.label:
            return self.label
        if self.packed:
            keys = f"K/ch G{self.group}" if self.key_mode == "channel" else f"K/tok g{self.value_group}"
            return f"{self.format_name} {keys} V g{self.value_group} R{self.residual}"
        return self.name

    def with_params(self, **params) -> Scheme:
        """The same scheme with other group / value_group / residual / key_mode (checked)."""
        new = replace(self, **params)
        new.check()
        return new

    def check(self) -> None:
        if self.packed:
            for n in ("group", "value_group"):
                v = getattr(self, n)
                if not isinstance(v, int) or v < 1 or v & (v - 1):
                    raise ValueError(f"{n} of {self.name} must be a power of two >= 1, got {v!r}")
            if not isinstance(self.residual, int) or self.residual < 0:
                raise ValueError(f"residual of {self.name} must be an int >= 0, got {self.residual!r}")
            if self.key_mode not in ("channel", "token"):
                raise ValueError(f"key_mode of {self.name} must be 'channel' or 'token', got {self.key_mode!r}")

    def check_shape(self, num_heads: int, head_dim: int) -> None:
        """ValueError when this scheme cannot hold heads of ``head_dim`` channels."""
        if self.packed:
            per = 8 // self.bits
            if head_dim % per:
                raise ValueError(f"{self.name} packs {per} channels a byte: head_dim must be a multiple of {per}, "
                                 f"got {head_dim}")
            if head_dim % self.value_group:
                raise ValueError(f"value_group {self.value_group} of {self.name} must divide head_dim {head_dim}")

    # ---- accounting -----------------------------------------------------------------
    def bytes_per_token(self, num_heads: int, head_dim: int, context: int | None = None) -> float:
        """Stored bytes of one token's K and V in one layer, scales and zero points counted.

        ``context``: the sequence length, for schemes that keep the newest tokens in fp16 (their share of the
        residual counted); ``None`` is the long-context limit.
        """
        n = num_heads * head_dim
        code = n * self.bits / 8
        if self.granularity == "token":
            return 2 * (code + num_heads * 4 * (1 if self.symmetric else 2))
        if not self.packed:
            return 2 * code  # static scales: a few bytes per layer, not per token
        params = 2 * 2  # fp16 scale and zero point
        v = code + params * n / self.value_group
        k = code + params * (n / self.group if self.key_mode == "channel" else n / self.value_group)
        if context is None or context <= 0:
            return k + v
        tq = self.quantized_tokens(context)
        return ((k + v) * tq + 2 * n * 2 * (context - tq)) / context

    def quantized_tokens(self, num_tokens: int) -> int:
        """How many of a sequence's oldest tokens are stored quantized (the rest are the fp16 residual)."""
        if not self.packed:
            return num_tokens
        g = self.group if self.key_mode == "channel" else 1
        return max(0, (num_tokens - self.residual) // g * g)

    # ---- static scales --------------------------------------------------------------
    def calibrate(self, x: torch.Tensor) -> torch.Tensor | None:
        """Static scale of ``x`` ``[T, H, D]`` (a calibration pass): ``amax / qmax`` over the tensor (``[]``)
        or per head (``[H]``), fp32; ``None`` for schemes whose scales are computed on write."""
        if not self.static:
            return None
        check_finite("x", x)
        a = x.float().abs()
        amax = a.amax() if self.granularity == "tensor" else a.amax(dim=(0, 2))
        return _nonzero(amax / self.qmax)

    # ---- quantize / dequantize ------------------------------------------------------
    def quantize(self, x: torch.Tensor, kind: str = "k", scale: torch.Tensor | None = None) -> Quantized:
        """Codes (and scales) of ``x`` ``[T, H, D]`` as K (``kind="k"``) or V.

        ``scale``: the static scale of a ``tensor`` / ``head`` scheme (default: :meth:`calibrate` on ``x``).
        What the scheme cannot store raises ValueError (:meth:`check_input`: NaN/Inf in a quantized scheme,
        finite values beyond :attr:`input_limit`); values beyond a static scale's range saturate.
        """
        if kind not in ("k", "v"):
            raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"x must be a [tokens, heads, head_dim] tensor, got {getattr(x, 'shape', type(x))}")
        fmt = self.format
        self.check_input("x", x)
        if not self.quantized:
            return Quantized(x.to(fmt.storage))
        xf = x.float()
        if self.static:
            s = self.calibrate(x) if scale is None else scale.float().reshape(-1)
            if s.numel() not in (1, x.shape[1]):
                raise ValueError(f"scale of {self.name} must hold 1 or {x.shape[1]} values, got {s.numel()}")
            self.check_scale_values("scale", s)
            sb = s.reshape(()) if self.granularity == "tensor" or s.numel() == 1 else s.reshape(1, -1, 1)
            return Quantized(self._codes(xf / sb), s.reshape(()) if self.granularity == "tensor" else s)
        if self.granularity == "token":
            if self.symmetric:
                s = _nonzero(xf.abs().amax(dim=-1) / self.qmax)  # [T, H]
                return Quantized(self._codes(xf / s[..., None]), s)
            lo, hi = xf.amin(dim=-1), xf.amax(dim=-1)
            s = _nonzero((hi - lo) / self.qmax)
            return Quantized(self._codes((xf - lo[..., None]) / s[..., None]), s, lo)
        return self._quantize_groups(xf, kind)

    def _codes(self, y: torch.Tensor) -> torch.Tensor:
        fmt = self.format
        y = y.clamp(fmt.qmin, fmt.qmax)
        return (_round_even(y) if fmt.codes == "int" else y).to(fmt.storage)

    def _quantize_groups(self, xf: torch.Tensor, kind: str) -> Quantized:
        T, H, D = xf.shape
        self.check_shape(H, D)
        tq = self.quantized_tokens(T)
        body, residual = xf[:tq], to_fp16(xf[tq:])
        if kind == "k" and self.key_mode == "channel":
            g = body.reshape(tq // self.group, self.group, H, D)
            lo, hi = g.amin(dim=1), g.amax(dim=1)  # [Tq // G, H, D]
            s16, z16 = _fp16_params(lo, hi, self.qmax)
            y = (g - z16.float()[:, None]) / s16.float()[:, None]
            codes = _round_even(y.clamp(0, self.qmax)).reshape(tq, H, D)
        else:
            g = body.reshape(tq, H, D // self.value_group, self.value_group)
            lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [Tq, H, D // Gv]
            s16, z16 = _fp16_params(lo, hi, self.qmax)
            y = (g - z16.float()[..., None]) / s16.float()[..., None]
            codes = _round_even(y.clamp(0, self.qmax)).reshape(tq, H, D)
        return Quantized(pack(codes.to(torch.uint8), self.bits), s16, z16, residual)

    def dequantize(self, qz: Quantized, kind: str = "k") -> torch.Tensor:
        """Values read back, fp32 ``[T, H, D]`` (the residual appended after the quantized tokens)."""
        if not self.quantized:
            return qz.codes.float()
        if self.static:
            s = qz.scale.float()
            s = s.reshape(()) if s.numel() == 1 else s.reshape(1, -1, 1)
            return qz.codes.float() * s
        if self.granularity == "token":
            out = qz.codes.float() * qz.scale[..., None]
            return out if qz.zero is None else out + qz.zero[..., None]
        codes = unpack(qz.codes, self.bits).float()  # [Tq, H, D]
        tq, H, D = codes.shape
        s, z = qz.scale.float(), qz.zero.float()
        if kind == "k" and self.key_mode == "channel":
            out = codes.reshape(tq // self.group, self.group, H, D) * s[:, None] + z[:, None]
        else:
            out = codes.reshape(tq, H, D // self.value_group, self.value_group) * s[..., None] + z[..., None]
        out = out.reshape(tq, H, D)
        return torch.cat([out, qz.residual.float()]) if qz.residual is not None else out

    def roundtrip(self, x: torch.Tensor, kind: str = "k", scale: torch.Tensor | None = None) -> torch.Tensor:
        """``dequantize(quantize(x))``: what attention reads for ``x``, fp32."""
        return self.dequantize(self.quantize(x, kind, scale), kind)


def _nonzero(s: torch.Tensor) -> torch.Tensor:
    """A computed scale, 1 where it is 0 (a constant row, or ``amax / qmax`` underflowing): never a division by 0."""
    return torch.where(s > 0, s, torch.ones_like(s))


def _fp16_params(lo: torch.Tensor, hi: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's fp16 scale and zero point, saturated (module docstring); equal to a plain fp16 rounding of
    ``((hi - lo) / qmax, lo)`` wherever that is finite."""
    z = lo.clamp(-F16_MAX, F16_MAX)
    s16 = ((hi - z) / qmax).clamp(0, F16_MAX).to(torch.float16)
    s16 = torch.where(s16 > 0, s16, torch.ones_like(s16))  # a constant group (or an fp16 underflow)
    return s16, z.to(torch.float16)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` uint8 codes < ``2**bits`` -> ``[..., D * bits // 8]`` bytes (the module docstring's order)."""
    per = 8 // bits
    d = codes.shape[-1] // per
    out = torch.zeros((*codes.shape[:-1], d), dtype=torch.uint8, device=codes.device)
    for k in range(per):
        out |= codes[..., k * d:(k + 1) * d] << (k * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., Dp]`` bytes -> ``[..., Dp * 8 // bits]`` uint8 codes."""
    per = 8 // bits
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (k * bits)) & mask for k in range(per)], dim=-1)
