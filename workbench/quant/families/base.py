"""The base of every storage family: a :class:`Scheme` is one way to store K/V, an object of its family's class.

A family (``cast``, ``static``, ``token``, ``groups``: one module each in this package) owns its reference
quantize / dequantize, its block layout (codes, scales, zero points), its bytes per token and its answers to
the questions callers ask (:attr:`Scheme.needs_static_scales`, :attr:`Scheme.keeps_residual`, ...). Callers
ask; they never test which family a scheme is. The kernels' arguments for each family live in ``kernels/``,
in tables keyed by :attr:`Scheme.family` (docs/quant_families.md).

``Scheme(name, format_name, granularity, ...)`` builds the family's class that stores ``granularity``
(``"none"`` cast, ``"tensor"`` / ``"head"`` static, ``"token"``, ``"group"``), so a scheme rebuilt from its
fields (``dataclasses.fields``) is the same object as the registry's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from workbench.core import kv_formats

from .common import FP32_MAX, BlockScales, Quantized, check_finite, first_bad

_BY_GRANULARITY: dict[str, type[Scheme]] = {}  # filled by each family class as it is defined


def family_class(granularity) -> type[Scheme]:
    """The family class that stores ``granularity`` (ValueError naming the known ones otherwise)."""
    cls = _BY_GRANULARITY.get(granularity) if isinstance(granularity, str) else None
    if cls is None:
        raise ValueError(f"granularity must be one of {sorted(_BY_GRANULARITY)}, got {granularity!r}")
    return cls


@dataclass(frozen=True)
class Scheme:
    """One way to store K/V (the base of the family classes; ``Scheme(...)`` builds the right one).

    Attributes (data: rows, labels and the registry print them; behaviour is the family's):
        name: the registry name (``workbench.quant.get``), e.g. ``"fp8_e4m3/token"``, ``"int4/kivi"``.
        format_name: the storage format in ``workbench.core.kv_formats``.
        granularity: ``"none"``, ``"tensor"``, ``"head"``, ``"token"`` or ``"group"``: where the scales live.
        symmetric: codes centred on zero (no zero point).
        group: groups family with ``key_mode="channel"``: tokens per key group.
        value_group: groups family: channels per value group (and per key group with ``key_mode="token"``).
        residual: groups family: newest tokens kept in fp16.
        key_mode: groups family: ``"channel"`` (KIVI's keys) or ``"token"``.
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

    # ---- the family and the questions callers ask (class constants, set by each family) ----------------------
    family: ClassVar[str] = ""  #: the family's name (``workbench.quant.names``; the kernels' tables key on it)
    granularities: ClassVar[tuple[str, ...]] = ()  #: the granularities this family stores
    param_names: ClassVar[tuple[str, ...]] = ()  #: what :meth:`with_params` and ``quant.get(name, **params)`` take
    quantized: ClassVar[bool] = True  #: codes and scales (False: a plain cast)
    needs_static_scales: ClassVar[bool] = False  #: the caller gives ``k_scale`` / ``v_scale`` (given or calibrated)
    scales_on_write: ClassVar[bool] = False  #: scales computed on write and kept in the blocks (:meth:`block_scales`)
    keeps_residual: ClassVar[bool] = False
    """A cache keeps each sequence's newest tokens out of the blocks, in fp16 (:meth:`residual_tokens`), and
    quantizes a token from those fp16 values; such a cache has no per-layer decode step and no CUDA graph."""
    supports_key_bounds: ClassVar[bool] = True  #: Quest's per-block key bounds can be read from the blocks

    def __new__(cls, *args, **kwargs):
        if cls is Scheme:  # the base names no family: the granularity picks it
            cls = family_class(args[2] if len(args) > 2 else kwargs.get("granularity"))
        return object.__new__(cls)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for g in cls.granularities:
            _BY_GRANULARITY[g] = cls

    def __post_init__(self) -> None:
        if self.granularity not in self.granularities:
            raise ValueError(f"granularity of a {self.family or 'base'} scheme must be one of {self.granularities}, "
                             f"got {self.granularity!r}")

    # ---- what it is ----------------------------------------------------------------------------------------
    @property
    def format(self) -> kv_formats.KVFormat:
        return kv_formats.get(self.format_name)

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def qmax(self) -> float:
        return self.format.qmax

    @property
    def input_limit(self) -> float:
        """The largest ``|x|`` stored with finite codes, scales and read-back: any finite fp32 (saturating) unless
        the family says less (a cast: its storage range; the asymmetric per-token scheme: ``2**126``)."""
        return FP32_MAX

    @property
    def write_group(self) -> int:
        """Tokens of keys one write must cover at once, as whole groups of consecutive slots (1: any)."""
        return 1

    # ---- checks --------------------------------------------------------------------------------------------
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
        raise ValueError(f"{name} holds {int(over.sum())} values {self.name} cannot store ({why}); "
                         f"{first_bad(x, over)}")

    def check_scale_values(self, name: str, scale) -> None:
        """A static scale must be finite and > 0, with ``qmax * scale`` finite (what a saturated code reads back)."""
        s = torch.as_tensor(scale, dtype=torch.float32)
        if not bool(((s > 0) & torch.isfinite(s * self.qmax)).all()):
            raise ValueError(f"{name} of {self.name} must hold finite values > 0 whose {self.qmax:g}-fold is finite "
                             f"(fp32), got {s.flatten()[:8].tolist()}")

    def check(self) -> None:
        """ValueError when the scheme's parameters are not ones its family stores (the groups' sizes, ...)."""

    def check_shape(self, num_heads: int, head_dim: int) -> None:
        """ValueError when this scheme cannot hold heads of ``head_dim`` channels."""

    # ---- names ---------------------------------------------------------------------------------------------
    def title(self) -> str:
        """A short name for plots."""
        return self.label or self.name

    def scales_label(self) -> str:
        """Where the scales live, in words (``"token scales"``)."""
        return f"{self.granularity} scales"

    def with_params(self, **params) -> Scheme:
        """The same scheme with other parameters (:attr:`param_names`; checked)."""
        new = replace(self, **params)
        new.check()
        return new

    def without_residual(self) -> Scheme:
        """The same scheme storing every token it is given (no fp16 residual): what a write of chosen tokens uses."""
        return self

    # ---- accounting and block layout -----------------------------------------------------------------------
    def bytes_per_token(self, num_heads: int, head_dim: int, context: int | None = None) -> float:
        """Stored bytes of one token's K and V in one layer, scales and zero points counted.

        ``context``: the sequence length, for schemes that keep the newest tokens in fp16 (their share of the
        residual counted); ``None`` is the long-context limit.
        """
        raise NotImplementedError(f"{type(self).__name__} must say its bytes per token")

    def quantized_tokens(self, num_tokens: int) -> int:
        """How many of a sequence's oldest tokens are stored quantized (the rest are the fp16 residual)."""
        return num_tokens

    def residual_tokens(self, num_tokens: int) -> int:
        """How many of a sequence's newest tokens stay in fp16 outside the blocks."""
        return num_tokens - self.quantized_tokens(num_tokens)

    def code_dim(self, head_dim: int) -> int:
        """Stored elements per token-head row: ``head_dim``, or fewer when codes are packed."""
        return head_dim

    def head_dim_of(self, code_dim: int) -> int:
        """The values' head_dim of rows of ``code_dim`` stored elements (inverse of :meth:`code_dim`)."""
        return code_dim

    def code_values(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[..., code_dim]`` -> one code per channel ``[..., head_dim]`` (unpacked)."""
        return stored

    def store_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """One code per channel ``[..., head_dim]`` -> stored rows ``[..., code_dim]`` (inverse of
        :meth:`code_values`)."""
        return codes

    def block_scales(self, kind: str, block_size: int, num_heads: int, head_dim: int) -> BlockScales | None:
        """The scale array of a block of ``block_size`` tokens of ``kind``, or None when the scheme keeps none in
        blocks (``workbench.quant.blocks``)."""
        return None

    # ---- static scales -------------------------------------------------------------------------------------
    def calibrate(self, x: torch.Tensor) -> torch.Tensor | None:
        """Static scale of ``x`` ``[T, H, D]`` (a calibration pass); ``None`` where no scale is given ahead."""
        return None

    def scales_from_amax(self, amax: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
        """Static scales from per-head absolute maxima ``[H]`` (:class:`~workbench.quant.Calibrator`)."""
        raise ValueError(f"{self.name} takes no static scales: its scales are computed on write or it has none")

    def layer_scales_from_amax(self, amax: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
        """Per-layer static scales from per-layer, per-head maxima ``[L, H]`` (``Calibrator(num_layers=L)``)."""
        raise ValueError(f"{self.name} takes no static scales: its scales are computed on write or it has none")

    def static_scale_count(self, num_heads: int) -> int:
        """Static scales one layer's K (or V) takes: 1 (per tensor), ``num_heads`` (per head), 0 (none)."""
        return 0

    # ---- quantize / dequantize -----------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, kind: str = "k", scale: torch.Tensor | None = None) -> Quantized:
        """Codes (and scales) of ``x`` ``[T, H, D]`` as K (``kind="k"``) or V.

        ``scale``: the static scale of a static scheme (default: :meth:`calibrate` on ``x``).
        What the scheme cannot store raises ValueError (:meth:`check_input`: NaN/Inf in a quantized scheme,
        finite values beyond :attr:`input_limit`); values beyond a static scale's range saturate.
        """
        if kind not in ("k", "v"):
            raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"x must be a [tokens, heads, head_dim] tensor, got {getattr(x, 'shape', type(x))}")
        self.check_input("x", x)
        return self._quantize(x, kind, scale)

    def _quantize(self, x: torch.Tensor, kind: str, scale: torch.Tensor | None) -> Quantized:
        """:meth:`quantize` after its checks (the family's arithmetic)."""
        raise NotImplementedError(f"{type(self).__name__} must quantize")

    def dequantize(self, qz: Quantized, kind: str = "k") -> torch.Tensor:
        """Values read back, fp32 ``[T, H, D]`` (the residual appended after the quantized tokens)."""
        raise NotImplementedError(f"{type(self).__name__} must dequantize")

    def roundtrip(self, x: torch.Tensor, kind: str = "k", scale: torch.Tensor | None = None) -> torch.Tensor:
        """``dequantize(quantize(x))``: what attention reads for ``x``, fp32."""
        return self.dequantize(self.quantize(x, kind, scale), kind)

    # ---- the flags of before the families: tests and notebooks read them; code in workbench/ and kernels/ asks
    # the questions above instead (tests/test_quant_families.py holds it to that) -------------------------------
    @property
    def packed(self) -> bool:
        return self.code_dim(8) != 8

    @property
    def static(self) -> bool:
        return self.needs_static_scales

    @property
    def scales_in_blocks(self) -> bool:
        return self.scales_on_write
