"""Static scales from a calibration pass: the running absolute maximum of K and V over many batches.

A static scheme (fp8 / int8 per tensor or per head) reads ``stored * scale``; :class:`Calibrator` observes
batches of K/V (prefill activations, say) and gives the scales a ``PagedKVCache`` takes, ``amax * margin / qmax``:
what :meth:`Scheme.calibrate` computes on one tensor, over all of them. Values beyond the observed range saturate
when written (``Scheme.quantize``, ``write_kv``).

Per cache (one pair for every layer) or per layer: layers' ranges differ (SmolLM2-135M's largest ``|V|`` grows
22x from layer 0 to the widest), and one scale for all of them fits the widest, so a narrow layer uses a few of
int8's 255 levels. With ``num_layers`` the calibrator keeps each layer's maxima and gives ``[L]`` (per tensor) or
``[L, H]`` (per head) scales, one per layer, and still the per-cache pair (``scales(per_layer=False)``) to compare.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .families import Scheme, check_finite


@dataclass
class Calibrator:
    """Running per-head (and, with ``num_layers``, per-layer) absolute maxima of K and V for a static ``scheme``.

    Attributes:
        scheme: a ``tensor`` or ``head`` scheme (``workbench.quant.get("fp8_e4m3/head")``).
        margin: headroom above the observed maximum (1.0: none; 1.25 keeps a quarter of the range spare).
        num_layers: keep each layer's maxima (``observe`` takes a leading layer axis, or one ``layer``); None: one
            maximum over whatever is observed (leading dims, layers included, are reduced).
    """

    scheme: Scheme
    margin: float = 1.0
    num_layers: int | None = None
    batches: int = field(default=0, init=False)
    _amax: dict = field(default_factory=dict, init=False, repr=False)  # "k"/"v" -> [H] or [L, H] fp32
    _seen: torch.Tensor | None = field(default=None, init=False, repr=False)  # [L] bool: layers observed

    def __post_init__(self) -> None:
        if not self.scheme.needs_static_scales:
            raise ValueError(f"scheme must have static scales (per tensor or head), got {self.scheme.name}, whose "
                             f"scales are computed on write")
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) or not self.margin >= 1.0:
            raise ValueError(f"margin must be a number >= 1, got {self.margin!r}")
        L = self.num_layers
        if L is not None and (isinstance(L, bool) or not isinstance(L, int) or L < 1):
            raise ValueError(f"num_layers must be a positive int or None, got {L!r}")
        if L is not None:
            self._seen = torch.zeros(L, dtype=torch.bool)

    def observe(self, k: torch.Tensor, v: torch.Tensor, layer: int | None = None) -> None:
        """Take one batch: ``k``, ``v`` ``[..., tokens, heads, head_dim]``. Per layer (``num_layers``): a leading
        layer axis ``[num_layers, ..., tokens, heads, head_dim]``, or one layer's K/V with ``layer`` its index.
        Bad input (shapes, NaN/Inf, a layer out of range) raises ValueError naming it before anything changes."""
        L = self.num_layers
        if layer is not None and (L is None or isinstance(layer, bool) or not isinstance(layer, int)
                                  or not 0 <= layer < L):
            raise ValueError(f"layer must be None or an int in [0, num_layers) of a calibrator with num_layers, got "
                             f"{layer!r} (num_layers={L})")
        axis = L is not None and layer is None  # a leading layer axis
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() < 3 + axis:
                want = "[num_layers, ..., tokens, heads, head_dim]" if axis else "[..., tokens, heads, head_dim]"
                raise ValueError(f"{name} must be a {want} tensor, got {getattr(t, 'shape', type(t).__name__)}")
            if axis and t.shape[0] != L:
                raise ValueError(f"{name} must hold num_layers={L} layers on its leading axis, got {t.shape[0]} (shape "
                                 f"{tuple(t.shape)}); observe one layer with layer=")
            if not t.numel():
                raise ValueError(f"{name} holds no values (shape {tuple(t.shape)}): observe at least one token")
            check_finite(name, t.reshape(-1, *t.shape[-2:]))
        if k.shape[-2:] != v.shape[-2:]:
            raise ValueError(f"k and v must share [heads, head_dim], got {tuple(k.shape[-2:])} and "
                             f"{tuple(v.shape[-2:])}")
        new = {}
        for name, t in (("k", k), ("v", v)):
            a = t.detach().float().abs()
            rows = a.reshape(L if axis else 1, -1, *t.shape[-2:]).amax(dim=(1, 3)).cpu()  # [L or 1, heads]
            old = self._amax.get(name)
            if old is not None and old.shape[-1] != rows.shape[-1]:
                raise ValueError(f"{name} has {rows.shape[-1]} heads, earlier batches had {old.shape[-1]}")
            if L is None:
                rows = rows[0]  # [heads]
            elif not axis:
                rows = torch.zeros(L, rows.shape[-1]).index_copy(0, torch.tensor([layer]), rows)  # 0: not seen here
            new[name] = rows if old is None else torch.maximum(old, rows)
        self._amax.update(new)  # only now: every check has passed
        if L is not None:
            seen = self._seen.clone()
            seen[slice(None) if axis else layer] = True
            self._seen = seen
        self.batches += 1

    def scales(self, per_layer: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)``, fp32. Per cache: one value (``tensor``) or one per head (``head``), over every
        layer observed. Per layer (default when ``num_layers`` is set): ``[num_layers]`` (``tensor``) or
        ``[num_layers, H]`` (``head``); every layer must have been observed."""
        per_layer = self.num_layers is not None if per_layer is None else per_layer
        if not isinstance(per_layer, bool):
            raise ValueError(f"per_layer must be True, False or None, got {per_layer!r}")
        if per_layer and self.num_layers is None:
            raise ValueError("per_layer scales need a calibrator built with num_layers")
        if not self.batches:
            raise ValueError("observe at least one batch before asking for scales")
        if self._seen is not None and not bool(self._seen.all()):
            missing = (~self._seen).nonzero().flatten().tolist()
            raise ValueError(f"layers {missing} were never observed (of num_layers={self.num_layers}): observe every "
                             f"layer before asking for scales")
        out = []
        for name in ("k", "v"):
            amax = self._amax[name]
            if not per_layer:
                out.append(self.scheme.scales_from_amax(amax if amax.dim() == 1 else amax.amax(0), self.margin))
                continue
            out.append(self.scheme.layer_scales_from_amax(amax, self.margin))  # [L] or [L, H]
        return out[0], out[1]
