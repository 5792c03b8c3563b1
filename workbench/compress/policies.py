"""KV sparsification policies behind one registry: which prompt tokens a sequence keeps in its paged cache.

The registry pattern of ``workbench.core.policy_registry`` (as ``workbench.sim.strategies``): a frozen, validated
config kept by name in :data:`POLICIES`, :func:`get` ``(name, **overrides)``, a ``label``. A policy sees one sequence
through an :class:`~workbench.compress.observation.Observation` and answers

- ``keep(obs) -> bool [T]``: ONE token set for every layer and head. A paged cache shares a block id across
  layers and heads (vLLM's block table), so only a token dropped everywhere can free its slot: this is the set
  that frees blocks (:func:`~workbench.compress.block_keep.block_keep` says how many);
- ``per_head_keep(obs) -> bool [L, Hkv, T]``: the kvpress-style choice, each (layer, kv head) its own tokens. It
  masks attention but frees nothing in a paged cache (a block holds every head); the study shows what sharing one
  set costs against it.

Scored policies implement only ``score(obs) -> [L, Hkv, T]`` (kvpress's ``ScorerPress``); :class:`Scored` does
the rest. Shared set: each (layer, head) row of scores is normalised to sum 1 over tokens (scores are attention
masses, or made non-negative), the rows are averaged, and the budget is filled in this order: the first
``sinks`` tokens, the last ``window`` tokens (newest first), then the highest averaged scores. The budget is
exact: when sinks and window alone exceed it, the sinks and the newest window tokens that fit are kept. Per head:
the same order on each row's own scores. ``keep_blocks(obs, block_size)``: the same choice made block by block
(whole blocks by their summed scores). :func:`~workbench.compress.block_keep.block_keep` says what a set costs in
blocks.

Policies (:data:`NAMES`):

- ``full``: every token (the baseline).
- ``streaming``: StreamingLLM, ``sinks`` first tokens + the newest ones (its window is what the budget leaves).
- ``h2o``: heavy hitters, attention accumulated over every observed query (causal: the query at position ``p``
  sees keys ``<= p``), summed over the group's query heads, + sinks + recent window. With the saved captures only
  the last 16 prompt queries are known, so the accumulation is over those 16, not the whole prompt as in H2O.
- ``snapkv``: attention of the last ``obs_window`` observed queries, summed, max-pooled along tokens (kernel 7,
  SnapKV's), per head.
- ``threshold``: the seed's rule, drop an entry whose attention score (the largest probability any observed query
  of the group gives it) falls under ``threshold``; its budget is the threshold, not a count. ``store(obs)`` holds
  the kept entries per (layer, head) in a :class:`~workbench.compress.csr.CSRStore`; the shared set is their
  union (a token any head keeps).
- ``quest``: query-dependent page selection (Quest): ``page_key_bounds`` / ``page_upper_bounds`` of
  :mod:`workbench.compress.page_selection` bound each page's ``q . k`` for the last ``obs_window`` queries; whole
  pages are kept (``ceil(budget / page_size)`` of them). It reads fewer pages per step but frees none: every page
  stays in the cache for the next query.

Budgets: an int is tokens, a float in ``(0, 1]`` a share of the sequence (:func:`resolve_budget`). ``window``: an
int is tokens, a float in ``[0, 1]`` a share of the resolved budget (H2O's paper splits 0.5 / 0.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.compress.csr import CSRStore
from workbench.compress.observation import Observation, attention_probs
from workbench.compress.page_selection import page_key_bounds, page_upper_bounds
from workbench.core.policy_registry import lookup

NAMES = ("full", "streaming", "h2o", "snapkv", "threshold", "quest")


# ---- budgets and validation ---------------------------------------------------------------------------------------


def _is_number(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, int | float)


def check_budget(budget: object, name: str = "budget") -> None:
    """ValueError naming ``name`` unless ``budget`` is an int >= 1 (tokens) or a float ratio in ``(0, 1]``."""
    ok = _is_number(budget) and (budget >= 1 if isinstance(budget, int) else 0 < budget <= 1)
    if not ok:
        raise ValueError(f"{name} must be an int number of tokens >= 1 or a float ratio in (0, 1], got {budget!r}")


def resolve_budget(budget: int | float, T: int) -> int:
    """Tokens a ``budget`` buys of a ``T``-token sequence: an int is tokens (at most ``T``), a float ratio ``r``
    is ``round(r * T)`` (half up), at least 1."""
    check_budget(budget)
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"T must be an int >= 1, got {T!r}")
    n = budget if isinstance(budget, int) else math.floor(budget * T + 0.5)
    return max(1, min(int(n), T))


def _check_int(name: str, x: object, low: int) -> None:
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise ValueError(f"{name} must be an int >= {low}, got {x!r}")


def _check_window(window: object) -> None:
    if not _is_number(window) or not (window >= 0 if isinstance(window, int) else 0 <= window <= 1):
        raise ValueError(f"window must be an int number of tokens >= 0 or a float share of the budget in "
                         f"[0, 1], got {window!r}")


def _window_tokens(window: int | float, n: int) -> int:
    return window if isinstance(window, int) else math.floor(window * n + 0.5)


# ---- selection -----------------------------------------------------------------------------------------------------


def normalise(scores: torch.Tensor) -> torch.Tensor:
    """Each row of ``scores`` ``[..., T]`` clamped at 0 and scaled to sum 1 (a zero row stays zero)."""
    s = scores.float().clamp_min(0)
    return s / s.sum(-1, keepdim=True).clamp_min(1e-30)


def select(scores: torch.Tensor, n: int, sinks: int, window: int) -> torch.Tensor:
    """Bool mask ``[R, U]`` of ``min(n, U)`` units per row of ``scores`` ``[R, U]``: the first ``sinks`` units, then
    the last ``window`` newest first, then the highest scores (ties: the earlier unit)."""
    R, U = scores.shape
    n = min(n, U)
    i_sink = torch.arange(min(sinks, U))
    i_win = torch.arange(max(min(sinks, U), U - window), U).flip(0)  # newest first
    rest = scores.float().clone()
    rest[:, i_sink], rest[:, i_win] = float("-inf"), float("-inf")
    by_score = rest.argsort(dim=-1, descending=True, stable=True)  # [R, U], the forced units last
    order = torch.cat([i_sink.expand(R, -1), i_win.expand(R, -1), by_score], 1)
    return torch.zeros(R, U, dtype=torch.bool).scatter_(1, order[:, :n], True)


# ---- policies ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Full:
    """Every token: the baseline each policy's error is measured against."""

    query_dependent = False  # class constant (not a field): its choice does not change with the decode query

    @property
    def label(self) -> str:
        return "full cache"

    def build(self, ctx=None) -> Full:
        """Policies hold no state: the config is its own state (the registries' ``build``)."""
        return self

    def keep(self, obs: Observation) -> torch.Tensor:
        return torch.ones(obs.num_tokens, dtype=torch.bool)

    def per_head_keep(self, obs: Observation) -> torch.Tensor:
        L, T, H, _ = obs.k.shape
        return torch.ones(L, H, T, dtype=torch.bool)


@dataclass(frozen=True)
class Scored(Full):
    """The base of scored policies: ``budget`` tokens (int) or share (float), ``sinks`` first tokens and ``window``
    last tokens always in it; subclasses implement :meth:`score`."""

    budget: int | float = 0.25
    sinks: int = 4
    window: int | float = 32

    def __post_init__(self) -> None:
        check_budget(self.budget)
        _check_int("sinks", self.sinks, 0)
        _check_window(self.window)

    @property
    def label(self) -> str:
        b = f"{self.budget:g} tokens" if isinstance(self.budget, int) else f"{self.budget:.0%}"
        w = f"{self.window:.0%} of it" if isinstance(self.window, float) else f"{self.window}"
        return f"{type(self).__name__.lower()} ({b}, {self.sinks} sinks + {w} recent)"

    def score(self, obs: Observation) -> torch.Tensor:
        """``[L, Hkv, T]`` how much each token is worth keeping, per (layer, kv head); higher is kept first."""
        raise NotImplementedError

    def _plan(self, obs: Observation) -> tuple[int, int]:
        n = resolve_budget(self.budget, obs.num_tokens)
        return n, _window_tokens(self.window, n)

    def keep(self, obs: Observation) -> torch.Tensor:
        n, w = self._plan(obs)
        if n >= obs.num_tokens:
            return torch.ones(obs.num_tokens, dtype=torch.bool)
        shared = normalise(self.score(obs)).mean((0, 1))  # [T] mean of per-head normalised scores
        return select(shared[None], n, self.sinks, w)[0]

    def per_head_keep(self, obs: Observation) -> torch.Tensor:
        n, w = self._plan(obs)
        s = self.score(obs)  # [L, Hkv, T]
        return select(s.reshape(-1, s.shape[-1]), n, self.sinks, w).reshape(s.shape)

    def keep_blocks(self, obs: Observation, block_size: int) -> torch.Tensor:
        """The shared set chosen block by block: ``ceil(budget / block_size)`` whole blocks, the blocks of the
        sinks and window first, then the blocks of the largest summed (normalised, averaged) scores. Nothing is
        partly dropped, so nothing is copied and nothing dropped is read."""
        _check_int("block_size", block_size, 1)
        T = obs.num_tokens
        shared = normalise(self.score(obs)).mean((0, 1))  # [T]
        pad = torch.zeros(-(-T // block_size) * block_size)
        pad[:T] = shared
        return self._pages(pad.reshape(1, -1, block_size).sum(-1), obs, block_size)[0]

    def _pages(self, scores: torch.Tensor, obs: Observation, page_size: int) -> torch.Tensor:
        """Page scores ``[R, P]`` -> token mask ``[R, T]`` of ``ceil(budget / page_size)`` whole pages per row."""
        T = obs.num_tokens
        n, w = self._plan(obs)
        P = scores.shape[-1]
        sink_pages = -(-self.sinks // page_size)
        win_pages = P - (T - w) // page_size if w > 0 else 0  # pages holding any of the last w tokens
        m = select(scores, -(-n // page_size), sink_pages, win_pages)  # [R, P]
        return m.repeat_interleave(page_size, -1)[:, :T]


@dataclass(frozen=True)
class Streaming(Scored):
    """StreamingLLM: ``sinks`` first tokens and the newest ones (its window is the budget's remainder)."""

    window: int | float = 0

    def score(self, obs: Observation) -> torch.Tensor:
        L, T, H, _ = obs.k.shape
        return torch.arange(1, T + 1, dtype=torch.float32).expand(L, H, T)  # newer is better

    @property
    def label(self) -> str:
        b = f"{self.budget:g} tokens" if isinstance(self.budget, int) else f"{self.budget:.0%}"
        return f"streaming ({b}, {self.sinks} sinks + recent)"


@dataclass(frozen=True)
class H2O(Scored):
    """Heavy hitters: attention accumulated over every observed query and the group's query heads."""

    def score(self, obs: Observation) -> torch.Tensor:
        return attention_probs(obs).sum((2, 3))  # [L, Hkv, T]


@dataclass(frozen=True)
class SnapKV(Scored):
    """SnapKV: attention of the last ``obs_window`` queries, summed, max-pooled along tokens (``kernel``)."""

    obs_window: int = 16
    kernel: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int("obs_window", self.obs_window, 1)
        _check_int("kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (a centred pooling window), got {self.kernel}")

    def score(self, obs: Observation) -> torch.Tensor:
        p = attention_probs(obs)[:, :, :, -self.obs_window:].sum((2, 3))  # [L, Hkv, T]
        L, H, T = p.shape
        pooled = F.max_pool1d(p.reshape(L * H, 1, T), self.kernel, stride=1, padding=self.kernel // 2)
        return pooled.reshape(L, H, T)


@dataclass(frozen=True)
class Threshold(Full):
    """The seed's rule: drop every entry whose score (the largest attention probability an observed query of its
    group gives it) is under ``threshold``; ``sinks`` and ``window`` are kept regardless."""

    threshold: float = 0.01
    sinks: int = 4
    window: int = 32

    def __post_init__(self) -> None:
        if not _is_number(self.threshold) or not 0 < self.threshold < 1:
            raise ValueError(f"threshold must be a number in (0, 1) (an attention probability), got "
                             f"{self.threshold!r}")
        _check_int("sinks", self.sinks, 0)
        _check_int("window", self.window, 0)

    @property
    def label(self) -> str:
        return f"threshold (p >= {self.threshold:g}, {self.sinks} sinks + {self.window} recent)"

    def score(self, obs: Observation) -> torch.Tensor:
        return attention_probs(obs).amax((2, 3))  # [L, Hkv, T]

    def per_head_keep(self, obs: Observation) -> torch.Tensor:
        T = obs.num_tokens
        forced = torch.zeros(T, dtype=torch.bool)
        forced[:self.sinks] = True
        forced[max(0, T - self.window):] = True
        return (self.score(obs) >= self.threshold) | forced

    def keep(self, obs: Observation) -> torch.Tensor:
        return self.per_head_keep(obs).any(0).any(0)  # a token stays if any (layer, head) keeps it

    def store(self, obs: Observation) -> CSRStore:
        """The kept entries per (layer, kv head), in CSR form."""
        return CSRStore.from_mask(obs.k, obs.v, self.per_head_keep(obs))


@dataclass(frozen=True)
class Quest(Scored):
    """Quest: whole pages of ``page_size`` tokens by their bound on ``q . k`` for the last ``obs_window``
    queries; ``ceil(budget / page_size)`` pages, the pages of the sinks and window first."""

    sinks: int = 1  # the sink's page (page_selection.select_pages' keep_first=1)
    window: int | float = 1  # the newest page (keep_last=1)
    page_size: int = 16
    obs_window: int = 1

    query_dependent = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int("page_size", self.page_size, 1)
        _check_int("obs_window", self.obs_window, 1)

    @property
    def label(self) -> str:
        b = f"{self.budget:g} tokens" if isinstance(self.budget, int) else f"{self.budget:.0%}"
        return f"quest ({b}, pages of {self.page_size})"

    def page_scores(self, obs: Observation) -> torch.Tensor:
        """``[L, Hkv, P]`` per page: ``exp(sm_scale * (bound - max bound))`` with the bound the largest over the last
        ``obs_window`` queries and the group's query heads (a bound on the page's unnormalised attention). Once
        :func:`normalise`-d it is each head's softmax over pages, so the shared set's mean over heads is
        ``page_upper_bounds(..., reduce="softmax")``'s vote."""
        L, T, H, D = obs.k.shape
        ub = torch.stack([page_upper_bounds(obs.q[i_l, -self.obs_window:], page_key_bounds(obs.k[i_l], self.page_size),
                                            "none") for i_l in range(L)])  # [L, w, Hq, P]
        ub = ub.reshape(L, ub.shape[1], H, -1, ub.shape[-1]).amax((1, 3)) * obs.sm_scale  # [L, Hkv, P]
        return (ub - ub.amax(-1, keepdim=True)).exp()

    def score(self, obs: Observation) -> torch.Tensor:
        return self.page_scores(obs).repeat_interleave(self.page_size, -1)[..., :obs.num_tokens]

    def keep(self, obs: Observation) -> torch.Tensor:
        shared = normalise(self.page_scores(obs)).mean((0, 1))  # [P]
        return self._pages(shared[None], obs, self.page_size)[0]

    def per_head_keep(self, obs: Observation) -> torch.Tensor:
        s = self.page_scores(obs)
        return self._pages(s.reshape(-1, s.shape[-1]), obs, self.page_size).reshape(*s.shape[:2], obs.num_tokens)

    def keep_blocks(self, obs: Observation, block_size: int) -> torch.Tensor:
        """Quest chooses whole pages already: its set when its pages are the cache's blocks."""
        if block_size != self.page_size:
            raise ValueError(f"block_size must be quest's page_size={self.page_size}, got {block_size}")
        return self.keep(obs)


Policy = Full | Streaming | H2O | SnapKV | Threshold | Quest

POLICIES: dict[str, Policy] = {
    "full": Full(),
    "streaming": Streaming(),
    "h2o": H2O(),
    "snapkv": SnapKV(),
    "threshold": Threshold(),
    "quest": Quest(),
}
assert tuple(POLICIES) == NAMES


def get(policy: str | Policy, **overrides) -> Policy:
    """A policy config from a name in :data:`NAMES` (or a config), with fields overridden:
    ``get("h2o", budget=0.25, sinks=4, window=32)``."""
    return lookup(POLICIES, "policy", policy, **overrides)
