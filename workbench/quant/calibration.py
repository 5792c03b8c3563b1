"""Static scales from a calibration pass: the running absolute maximum of K and V over many batches.

A static scheme (fp8 / int8 per tensor or per head) reads ``stored * scale`` with one scale for the whole cache;
:class:`Calibrator` observes batches of K/V (prefill activations, say) and gives the scales a
``PagedKVCache`` takes, ``amax * margin / qmax``: what :meth:`Scheme.calibrate` computes on one tensor, over
all of them. Values beyond the observed range saturate when written (``Scheme.quantize``, ``write_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .families import Scheme, check_finite


@dataclass
class Calibrator:
    """Running per-head absolute maxima of K and V for a static ``scheme``.

    Attributes:
        scheme: a ``tensor`` or ``head`` scheme (``workbench.quant.get("fp8_e4m3/head")``).
        margin: headroom above the observed maximum (1.0: none; 1.25 keeps a quarter of the range spare).
    """

    scheme: Scheme
    margin: float = 1.0
    batches: int = field(default=0, init=False)
    _amax: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.scheme.needs_static_scales:
            raise ValueError(f"scheme must have static scales (per tensor or head), got {self.scheme.name}, whose "
                             f"scales are computed on write")
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) or not self.margin >= 1.0:
            raise ValueError(f"margin must be a number >= 1, got {self.margin!r}")

    def observe(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Take one batch: ``k``, ``v`` ``[..., tokens, heads, head_dim]`` (any leading dims, e.g. layers)."""
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() < 3:
                raise ValueError(f"{name} must be a [..., tokens, heads, head_dim] tensor, got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
            check_finite(name, t.reshape(-1, *t.shape[-2:]))
        if k.shape[-2:] != v.shape[-2:]:
            raise ValueError(f"k and v must share [heads, head_dim], got {tuple(k.shape[-2:])} and "
                             f"{tuple(v.shape[-2:])}")
        for name, t in (("k", k), ("v", v)):
            amax = t.detach().float().abs().reshape(-1, *t.shape[-2:]).amax(dim=(0, 2)).cpu()  # [heads]
            old = self._amax.get(name)
            if old is not None and old.shape != amax.shape:
                raise ValueError(f"{name} has {amax.numel()} heads, earlier batches had {old.numel()}")
            self._amax[name] = amax if old is None else torch.maximum(old, amax)
        self.batches += 1

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)``, fp32: one value (``tensor``) or one per head (``head``)."""
        if not self.batches:
            raise ValueError("observe at least one batch before asking for scales")
        return (self.scheme.scales_from_amax(self._amax["k"], self.margin),
                self.scheme.scales_from_amax(self._amax["v"], self.margin))
