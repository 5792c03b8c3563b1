"""What a sparsification policy sees of one sequence (:class:`Observation`: its K/V and the queries observed), and
the attention those queries read over a kept set of keys: probabilities, output, and its error against the full
cache.

An observation comes from a captured prompt (``workbench.model.capture``: :meth:`Observation.from_capture`) or
from synthetic K/V with real K/V's statistics (:func:`synthetic_observation`). The policies
(``workbench.compress.policies``) choose from it; the studies and ``workbench.compress.evict`` score what they keep
with :func:`attention_error`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workbench.quant.synthetic import apply_rope, synthetic_kv, synthetic_queries


@dataclass(frozen=True)
class Observation:
    """What a policy sees of one sequence when it decides.

    Attributes:
        k: ``[L, T, Hkv, D]`` keys as cached (post-RoPE).
        v: ``[L, T, Hkv, D]`` values.
        q: ``[L, W, Hq, D]`` post-RoPE queries of the last ``W`` positions ``T - W .. T - 1`` (``1 <= W <= T``;
            query head ``i`` reads kv head ``i // (Hq / Hkv)``).
        sm_scale: the softmax scale (``1 / sqrt(D)`` usually).
    """

    k: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor
    sm_scale: float

    def __post_init__(self) -> None:
        if self.k.dim() != 4 or self.v.shape != self.k.shape:
            raise ValueError(f"k and v must be [L, T, Hkv, D] of one shape, got {tuple(self.k.shape)} and "
                             f"{tuple(self.v.shape)}")
        L, T, H, D = self.k.shape
        if self.q.dim() != 4 or self.q.shape[0] != L or self.q.shape[3] != D or self.q.shape[2] % H:
            raise ValueError(f"q must be [L={L}, W, Hkv * group, D={D}] with Hkv={H}, got {tuple(self.q.shape)}")
        if not 1 <= self.q.shape[1] <= T:
            raise ValueError(f"q must hold 1 .. T={T} queries (the last positions), got {self.q.shape[1]}")
        if isinstance(self.sm_scale, bool) or not isinstance(self.sm_scale, int | float) or not (
                math.isfinite(self.sm_scale) and self.sm_scale > 0):
            raise ValueError(f"sm_scale must be a finite number > 0, got {self.sm_scale!r}")

    @classmethod
    def from_capture(cls, cap) -> Observation:
        """A :class:`workbench.model.capture.Capture`'s saved layers: its K/V and its last 16 queries."""
        return cls(cap.k, cap.v, cap.q_last, float(cap.sm_scale))

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def num_queries(self) -> int:
        return self.q.shape[1]

    def prefix(self, n: int) -> Observation:
        """The observation a policy would have had ``n`` tokens earlier (``n < W``): the first ``T - n`` tokens and
        the queries at positions ``T - W .. T - n - 1``. The study compresses it and evaluates the last ``n``
        queries, decode steps the policy did not see."""
        if not 0 <= n < self.num_queries:
            raise ValueError(f"n must be in [0, W={self.num_queries}), got {n!r}")
        T = self.num_tokens
        return self if n == 0 else Observation(self.k[:, :T - n], self.v[:, :T - n], self.q[:, :-n], self.sm_scale)


def as_observation(obs_or_capture) -> Observation:
    """An :class:`Observation` as is, or a ``Capture``'s (``Observation.from_capture``)."""
    return obs_or_capture if isinstance(obs_or_capture, Observation) else Observation.from_capture(obs_or_capture)


def observations(captures: Sequence):
    """``(prompt name, layer numbers, Observation)`` of each capture (or Observation)."""
    for i_c, cap in enumerate(captures):
        obs = as_observation(cap)
        yield (getattr(cap, "name", "") or f"obs{i_c}", list(getattr(cap, "layers", None) or range(obs.k.shape[0])),
               obs)


def synthetic_observation(num_layers: int = 2, num_tokens: int = 96, num_kv_heads: int = 2, head_dim: int = 16,
                          num_queries: int = 8, group: int = 2, seed: int = 0) -> Observation:
    """An :class:`Observation` from ``workbench.quant.synthetic``'s synthetic K/V (outlier channels, a sink on token 0)
    and queries correlated with the keys (peaked attention), post-RoPE; ``sm_scale = 1 / sqrt(head_dim)``."""
    k_pre, v = synthetic_kv(num_layers, num_tokens, num_kv_heads, head_dim, seed=seed)
    k = apply_rope(k_pre)
    q = synthetic_queries(k, num_queries, group, seed=seed + 1)
    return Observation(k, v, q, 1.0 / math.sqrt(head_dim))


def attention_probs(obs: Observation, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention of the observed queries, fp32 ``[L, Hkv, G, W, T]``.

    Args:
        obs: the observation (query ``w`` sits at position ``T - W + w`` and sees keys ``<= `` it).
        mask: keys kept, bool ``[T]`` (one set) or ``[L, Hkv, T]`` (per head); dropped keys get no weight. A query
            that sees no kept key gets zeros.
    """
    L, T, H, D = obs.k.shape
    W = obs.num_queries
    qg = obs.q.float().reshape(L, W, H, -1, D)  # [L, W, Hkv, G, D]
    s = torch.einsum("lwhgd,lthd->lhgwt", qg, obs.k.float()) * obs.sm_scale  # [L, Hkv, G, W, T]
    m_see = torch.arange(T)[None, :] <= torch.arange(T - W, T)[:, None]  # [W, T] causal
    if mask is not None:
        if mask.shape not in ((T,), (L, H, T)) or mask.dtype != torch.bool:
            raise ValueError(f"mask must be bool [T={T}] or [L={L}, Hkv={H}, T], got {tuple(mask.shape)} {mask.dtype}")
        m_see = m_see & (mask if mask.dim() == 1 else mask[:, :, None, None, :])
    return s.masked_fill(~m_see, float("-inf")).softmax(-1).nan_to_num(0.0)


def attention_output(obs: Observation, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[L, W, Hq, D]`` fp32: the observed queries' attention output over the kept keys (:func:`attention_probs`)."""
    p = attention_probs(obs, mask)
    out = torch.einsum("lhgwt,lthd->lwhgd", p, obs.v.float())
    return out.reshape(*out.shape[:2], -1, out.shape[-1])


def relative_error(x: torch.Tensor, ref: torch.Tensor, dims) -> torch.Tensor:
    """``||x - ref|| / ||ref||`` over ``dims``, float64."""
    num = torch.linalg.vector_norm((x - ref).double(), dim=dims)
    return num / torch.linalg.vector_norm(ref.double(), dim=dims).clamp_min(1e-300)


def attention_error(obs_or_capture, keep: torch.Tensor, *, last: int | None = None,
                    by_layer: bool = False) -> float | list[float]:
    """Relative L2 error of the observed queries' attention output over the kept keys against the full cache.

    Args:
        obs_or_capture: an :class:`Observation` or a ``Capture``.
        keep: bool ``[T]`` (one set) or ``[L, Hkv, T]`` (per head), the keys attention reads.
        last: score only the last ``last`` queries (default all ``W``).
        by_layer: one error per layer instead of one over all layers.

    Returns:
        ``||o_kept - o_full|| / ||o_full||`` over (queries, heads, D) [and layers].
    """
    obs = as_observation(obs_or_capture)
    if last is not None:
        if isinstance(last, bool) or not isinstance(last, int) or not 1 <= last <= obs.num_queries:
            raise ValueError(f"last must be an int in [1, W={obs.num_queries}], got {last!r}")
        obs = Observation(obs.k, obs.v, obs.q[:, -last:], obs.sm_scale)
    full, kept = attention_output(obs), attention_output(obs, keep)
    if by_layer:
        return relative_error(kept, full, (1, 2, 3)).tolist()
    return float(relative_error(kept, full, (0, 1, 2, 3)))
