"""Synthetic K/V and decode queries with the statistics quantization is sensitive to, and RoPE.

Shapes: keys and values ``[layers, tokens, kv_heads, head_dim]``, queries ``[layers, queries, kv_heads * group,
head_dim]`` (grouped-query attention: query head ``i`` reads kv head ``i // group``), all fp32.

:func:`synthetic_kv` carries what makes real K/V hard to quantize: a few key channels per head with
``outlier_scale`` times the magnitude of the others and a consistent sign (why KIVI quantizes keys per channel),
an attention-sink token 0 with a large key along the direction typical queries share (:func:`synthetic_queries`),
and values whose scale grows with depth. Keys are pre-RoPE; ``apply_rope(k)`` gives the post-RoPE keys a cache
normally stores. ``workbench.model.capture.real_kv`` gives K/V and queries captured from SmolLM2-135M
(``python -m workbench capture``) in the same layout (``docs/real_kv_findings.md``); the error study
(:mod:`workbench.quant.error_study`) takes either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def synthetic_kv(num_layers: int = 6, num_tokens: int = 512, num_kv_heads: int = 3, head_dim: int = 64, *,
                 outlier_channels: int = 4, outlier_scale: float = 8.0, sink: bool = True, sink_scale: float = 4.0,
                 value_growth: float = 4.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys and values with the statistics of real K/V.

    - keys: each channel ``N(mu_c, 1)`` with a small per-channel mean ``mu_c ~ N(0, 0.5)``; in ``outlier_channels``
      channels per (layer, head), fixed over tokens, ``outlier_scale * (sign + N(0, 0.5))`` (a large value of
      consistent sign, as in real models' key outlier channels, 5-10x the others).
    - sink (``sink=True``): token 0's key is ``sink_scale`` times a typical key's norm along a random unit
      direction per (layer, head), the direction every query of :func:`synthetic_queries` leans towards; its
      value is small (0.1x), as real sinks' are.
    - values: ``N(0, s_l)`` with ``s_l = value_growth ** (l / (layers - 1))``: the last layer's values are
      ``value_growth`` times the first's.

    Args:
        num_layers, num_tokens, num_kv_heads, head_dim: the shape (``head_dim`` even, for RoPE).
        outlier_channels: key outlier channels per head (0: none).
        outlier_scale: their magnitude over the other channels'.
        sink: give token 0 a sink key.
        sink_scale: the sink key's norm over a typical key's.
        value_growth: the last layer's value scale over the first's (1: constant).
        seed: the generator's seed (the data are a pure function of the arguments).

    Returns:
        ``(k, v)``, each ``[num_layers, num_tokens, num_kv_heads, head_dim]`` fp32.
    """
    if min(num_layers, num_tokens, num_kv_heads, head_dim) < 1 or head_dim % 2:
        raise ValueError(f"sizes must be >= 1 and head_dim even, got layers={num_layers} tokens={num_tokens} "
                         f"heads={num_kv_heads} head_dim={head_dim}")
    if not 0 <= outlier_channels <= head_dim:
        raise ValueError(f"outlier_channels must be in [0, head_dim={head_dim}], got {outlier_channels}")
    if outlier_scale <= 0 or value_growth <= 0 or sink_scale <= 0:
        raise ValueError(f"outlier_scale, sink_scale and value_growth must be > 0, got {outlier_scale}, "
                         f"{sink_scale}, {value_growth}")
    g = torch.Generator().manual_seed(seed)
    L, T, H, D = num_layers, num_tokens, num_kv_heads, head_dim
    mu = 0.5 * torch.randn(L, 1, H, D, generator=g)
    k = torch.randn(L, T, H, D, generator=g) + mu
    if outlier_channels:
        idx = torch.rand(L, H, D, generator=g).argsort(dim=-1)[..., :outlier_channels]  # [L, H, n]
        sign = torch.randint(0, 2, (L, 1, H, outlier_channels), generator=g).float() * 2 - 1
        big = outlier_scale * (sign + 0.5 * torch.randn(L, T, H, outlier_channels, generator=g))
        k.scatter_(-1, idx[:, None].expand(L, T, H, outlier_channels), big)
    if sink:
        u = torch.randn(L, H, D, generator=g)
        u = u / u.norm(dim=-1, keepdim=True)
        typical = k.norm(dim=-1).median(dim=1).values  # [L, H]
        k[:, 0] = sink_scale * typical[..., None] * u
    growth = value_growth ** (torch.arange(L) / max(1, L - 1))
    v = torch.randn(L, T, H, D, generator=g) * growth[:, None, None, None]
    if sink:
        v[:, 0] *= 0.1
    return k, v


def synthetic_queries(k: torch.Tensor, num_queries: int = 64, group: int = 3, *, sink_logit: float = 9.0,
                      focus_logit: float = 8.0, noise: float = 0.3, seed: int = 1) -> torch.Tensor:
    """Decode queries correlated with the keys ``k`` they will attend to, so attention is peaked, not uniform.

    Each query of each query head is ``a * d_0 + b * d_j + noise``, where ``d_t = (k_t - mean_k) / |k_t - mean_k|``
    is a centred key direction, ``j`` a random token (what this query looks up), and ``a``, ``b`` put about
    ``sink_logit`` and ``focus_logit`` between the scores of token 0 (the sink) and token ``j`` and those of a
    typical token. Pass the keys attention sees (post-RoPE, ``apply_rope(k)``). With K/V captured from a model,
    pass its captured queries to the study instead.

    Args:
        k: ``[layers, tokens, kv_heads, head_dim]``.
        num_queries: queries per layer (decode steps).
        group: query heads per kv head (GQA).
        sink_logit, focus_logit: score gaps (in units of the softmax's input) of the sink and the looked-up
            token over a typical token (0: no such component).
        noise: isotropic noise, relative to the query's norm.
        seed: the generator's seed.

    Returns:
        ``[layers, num_queries, kv_heads * group, head_dim]`` fp32.
    """
    if k.dim() != 4:
        raise ValueError(f"k must be [layers, tokens, kv_heads, head_dim], got {tuple(k.shape)}")
    if num_queries < 1 or group < 1:
        raise ValueError(f"num_queries and group must be >= 1, got {num_queries}, {group}")
    g = torch.Generator().manual_seed(seed)
    L, T, H, D = k.shape
    kf = k.float()
    centred = kf - kf.mean(dim=1, keepdim=True)
    norm = centred.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # [L, T, H, 1]
    # q = s * sqrt(D) * c_t / |c_t|^2 (c_t = k_t - mean) scores s more on token t than on a token whose centred
    # key is orthogonal to c_t: q . c_t / sqrt(D) = s (the mean's share of q . k is the same for every token)
    scaled = centred / norm**2
    j = torch.randint(1 if T > 1 else 0, T, (L, num_queries, H, group), generator=g)
    picked = torch.gather(scaled[:, :, :, None].expand(L, T, H, group, D), 1,
                          j[..., None].expand(L, num_queries, H, group, D))
    q = focus_logit * math.sqrt(D) * picked + sink_logit * math.sqrt(D) * scaled[:, :1, :, None]
    scale = q.norm(dim=-1, keepdim=True).mean()
    q = q + noise * scale / math.sqrt(D) * torch.randn(q.shape, generator=g)
    return q.reshape(L, num_queries, H * group, D)


def apply_rope(x: torch.Tensor, positions: torch.Tensor | Sequence[int] | None = None,
               base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding, rotate-half convention (Llama, SmolLM2): channel ``i`` pairs with ``i + D/2``,
    rotated by ``position * base ** (-2 i / D)``.

    Args:
        x: ``[..., tokens, heads, head_dim]`` (``head_dim`` even).
        positions: ``[tokens]`` token positions (default ``0 .. tokens - 1``).
        base: RoPE's base (``rope_theta``).

    Returns:
        Like ``x``, fp32.
    """
    if x.dim() < 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., tokens, heads, head_dim] with head_dim even, got {tuple(x.shape)}")
    T, D = x.shape[-3], x.shape[-1]
    pos = torch.arange(T) if positions is None else torch.as_tensor(positions)
    if pos.shape != (T,):
        raise ValueError(f"positions must hold {T} values (one per token), got shape {tuple(pos.shape)}")
    half = D // 2
    inv = base ** (-2 * torch.arange(half, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv  # [T, D/2]
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]  # [T, 1, D/2]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
