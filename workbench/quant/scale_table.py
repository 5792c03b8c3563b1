"""The static scales a cache holds: one pair for all layers (per cache) or one pair per layer, as one table.

A static scheme (fp8 / int8 per ``tensor`` or ``head``) reads ``code * scale``. The scales a
:class:`~workbench.cache.PagedKVCache` takes, each of ``k_scale`` / ``v_scale``:

- per cache: ``[]`` or one value (every layer and head), or ``[H]`` (one per kv head, every layer);
- per layer: ``[L, 1]`` or ``[L]`` (one per layer), ``[L, H]`` (one per layer and kv head), e.g.
  :meth:`Calibrator.scales` of a calibrator with ``num_layers``.

A 1-D scale of ``H == L`` values is read by the scheme: per layer for a ``tensor`` scheme, per head for a
``head`` scheme (each stores that granularity). Both scales become one fp32 table ``[2, L, S]`` (0: K, 1: V;
``S`` is 1, or ``H`` when either is per head: the kernels read K's and V's with one head stride), so each
layer's pair is a row view: the kernels take a layer's row, and a CUDA graph holds one address per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ScaleTable:
    """``table`` ``[2, L, S]`` fp32 on the cache's device (owned: a copy of what was given); ``per_layer``: the
    scales were given per layer (else every layer's row holds the same values)."""

    table: torch.Tensor
    per_layer: bool

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)`` of ``layer``: ``[S]`` views (unit stride, no copy)."""
        return self.table[0, layer], self.table[1, layer]

    @property
    def k_scale(self) -> torch.Tensor:
        """K's scales as given, fp32: ``[S]`` per cache, ``[L, S]`` per layer (views of the table)."""
        return self.table[0] if self.per_layer else self.table[0, 0]

    @property
    def v_scale(self) -> torch.Tensor:
        return self.table[1] if self.per_layer else self.table[1, 0]


def _parse(scheme, name: str, scale, num_layers: int, num_heads: int, device) -> tuple[torch.Tensor, bool]:
    """``(scales [L or 1, S], per layer)`` of one argument; ValueError naming ``name``."""
    try:
        t = torch.as_tensor(scale, dtype=torch.float32, device=device).detach()
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name} must be an fp32 tensor or a float, got {type(scale).__name__} ({e})") from None
    L, H = num_layers, num_heads
    want = (f"{name} of {scheme.name} must be per cache ([] / [1], or [{H}]: one per kv head) or per layer "
            f"([{L}] / [{L}, 1], or [{L}, {H}]: one per layer and kv head)")
    if t.dim() == 2 and t.shape[0] == L and t.shape[1] in (1, H):
        return t, True
    if t.dim() > 1:
        raise ValueError(f"{want}, got shape {tuple(t.shape)}")
    n = t.numel()
    if n == 1:
        return t.reshape(1, 1), False
    if n == H and (n != L or scheme.static_scale_count(H) == H):  # H == L: the scheme's granularity decides
        return t.reshape(1, H), False
    if n == L:
        return t.reshape(L, 1), True
    raise ValueError(f"{want}, got {n} values")


def scale_table(scheme, k_scale, v_scale, num_layers: int, num_heads: int, device) -> ScaleTable | None:
    """The :class:`ScaleTable` of a static ``scheme``'s ``k_scale`` / ``v_scale`` (None for a scheme without static
    scales, which must be given none). Everything is checked before anything is built: the shapes above, each
    value finite and > 0 (``Scheme.check_scale_values``) and the granularity the format's kernels take
    (``KVFormat.check_scale``); a ValueError names the argument."""
    static = scheme.needs_static_scales
    if static != (k_scale is not None) or static != (v_scale is not None):
        raise ValueError(f"k_scale and v_scale are needed exactly for static-scale schemes (fp8/int8 per tensor or "
                         f"head), got {scheme.name} with k_scale={k_scale is not None}, v_scale={v_scale is not None}")
    if not static:
        return None
    parsed = {n: _parse(scheme, n, s, num_layers, num_heads, device) for n, s in (("k_scale", k_scale),
                                                                                 ("v_scale", v_scale))}
    for n, (t, _) in parsed.items():
        scheme.format.check_scale(n, t[0], num_heads)
        scheme.check_scale_values(n, t)  # finite, > 0, a saturated code reads back finite
    S = max(t.shape[1] for t, _ in parsed.values())
    table = torch.stack([t.expand(num_layers, S) for t, _ in parsed.values()]).contiguous()  # a copy: the cache's own
    return ScaleTable(table, any(p for _, p in parsed.values()))
