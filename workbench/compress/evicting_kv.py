"""A K/V store for :class:`~workbench.model.runner.Runner` that evicts: after a prefill (and every ``every`` decode
steps) a policy chooses the tokens to keep and :func:`~workbench.compress.evict.evict` frees the rest's blocks.

    kv = EvictingKV(cache, policies.get("h2o", budget=0.25))
    runner = Runner(model, kv, capture=kv.capture)   # the hook hands the store the queries the policy reads
    out = runner.generate([prompt], max_new_tokens=32)

Logical positions. After an eviction a sequence stores fewer tokens than it has seen; :meth:`EvictingKV.num_tokens`
answers the LOGICAL length (stored + evicted), so the runner ropes a new token at its true position, while the
cache attends over the stored ones (their keys were roped at their own positions when they were computed).

Observation. After ``add`` the policy sees the prompt's K/V as the model computed them and the post-RoPE queries
of its last ``obs_window`` positions; a re-eviction during decode sees the stored K/V as attention reads them
(``PagedKVCache.read``) and the newest ``obs_window`` queries of the sequence (the prompt's, then the decode
steps'). Queries come through :meth:`EvictingKV.capture`, passed to the Runner as ``capture=``; without them a
policy that reads attention fails, so :meth:`add` refuses to go on without queries.

Prefix reuse stays on and is correct: an evicted sequence stops publishing (``BlockManager.stop_publishing``), so
a later prompt only ever hits blocks whose bytes are exactly what a prefill of that prefix computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from workbench.compress.evict import PARTIAL, EvictionReport, check_evictable, evict
from workbench.compress.observation import Observation
from workbench.model.kv import PagedKV


class EvictingKV(PagedKV):
    """:class:`~workbench.model.kv.PagedKV` whose sequences are cut down by ``policy`` (see the module docstring).

    Args:
        cache: a :class:`~workbench.cache.PagedKVCache` whose scheme :func:`evict` supports.
        policy: anything with ``keep(Observation) -> bool [T]`` (``workbench.compress.policies.get(...)``).
        partial: ``"compact"`` or ``"keep"`` (partly dropped blocks), as in :func:`evict`.
        every: re-evict a sequence after every ``every`` decode steps of it (H2O / streaming style); None: only
            after the prefill.
        obs_window: queries the policy sees (the newest ``obs_window`` positions).
        sm_scale: the softmax scale for the observation (default ``head_dim ** -0.5``; a decode step's own
            ``sm_scale`` replaces it).
        q_dtype: as :class:`PagedKV`.

    Attributes:
        reports: every :class:`EvictionReport`, in order; :attr:`events` holds ``(seq_id, event, position)`` for
            each (``"prefill"`` or ``"step"``; the sequence's logical length when it was decided).
    """

    name = "evicting"

    def __init__(self, cache, policy, *, partial: str = "compact", every: int | None = None, obs_window: int = 32,
                 sm_scale: float | None = None, q_dtype: torch.dtype | None = None):
        check_evictable(cache)
        if not callable(getattr(policy, "keep", None)):
            raise ValueError(f"policy must have keep(observation) -> bool [T] (workbench.compress.policies.get), "
                             f"got {type(policy).__name__}")
        if partial not in PARTIAL:
            raise ValueError(f"partial must be one of {PARTIAL}, got {partial!r}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be None or a positive int (decode steps between evictions), got {every!r}")
        if isinstance(obs_window, bool) or not isinstance(obs_window, int) or obs_window < 1:
            raise ValueError(f"obs_window must be a positive int (queries the policy sees), got {obs_window!r}")
        if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, int | float)
                                     or not 0 < sm_scale < math.inf):
            raise ValueError(f"sm_scale must be None or a finite number > 0, got {sm_scale!r}")
        super().__init__(cache, q_dtype)
        self.policy, self.partial, self.every, self.obs_window = policy, partial, every, obs_window
        self.sm_scale = float(sm_scale) if sm_scale is not None else cache.head_dim ** -0.5
        self.reports: list[EvictionReport] = []
        self.events: list[tuple[object, str, int]] = []
        self._assigned: dict = {}  # seq_id -> (policy, partial) where not the store's own
        self._evicted: dict = {}  # seq_id -> tokens evicted so far (logical length - stored)
        self._queries: dict = {}  # seq_id -> per layer, the newest queries [<= obs_window, Hq, D]
        self._since: dict = {}  # seq_id -> decode steps since its last eviction
        self._prefill_q: dict[int, torch.Tensor] = {}  # layer -> the prompt's last queries, until add
        self._step_ids: list | None = None  # the open decode step's sequences
        self._step_q: dict[int, torch.Tensor] = {}  # layer -> [B, Hq, D] of the open step

    @property
    def decoding(self) -> bool:
        """A decode step is open (between :meth:`begin` and :meth:`commit` / :meth:`abort`)."""
        return self._step_ids is not None

    # ---- the Runner's capture hook -------------------------------------------------
    def capture(self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``Runner(model, kv, capture=kv.capture)``: keeps the post-RoPE queries (prefill: the last ``obs_window``
        positions, until :meth:`add`; decode: the step's, until :meth:`commit`)."""
        if self._step_ids is not None:
            self._step_q[layer] = q.detach()
        else:
            self._prefill_q[layer] = q.detach()[-self.obs_window:]

    # ---- the store's calls (workbench.model.kv) ------------------------------------
    def assign(self, seq_id, policy=None, *, partial: str | None = None) -> None:
        """Give the sequence ``seq_id`` (before its :meth:`add`) its own policy and/or partial mode, so one batch
        can decode sequences under different policies (the model study does)."""
        if policy is not None and not callable(getattr(policy, "keep", None)):
            raise ValueError(f"policy must have keep(observation) -> bool [T], got {type(policy).__name__}")
        if partial is not None and partial not in PARTIAL:
            raise ValueError(f"partial must be one of {PARTIAL}, got {partial!r}")
        self._assigned[seq_id] = (policy or self.policy, partial or self.partial)

    def add(self, seq_id, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor, *,
            queries: torch.Tensor | None = None) -> None:
        """Store the prompt's K/V and evict. ``queries``: ``[L, W, Hq, D]`` post-RoPE queries of the prompt's last
        positions, instead of those the capture hook kept (K/V computed once, stored under several policies)."""
        L = self.num_layers
        if queries is None:
            if sorted(self._prefill_q) != list(range(L)):
                self._prefill_q = {}
                raise ValueError("EvictingKV needs the prompt's queries: build the runner with capture=kv.capture "
                                 "(Runner(model, kv, capture=kv.capture))")
            queries = torch.stack([self._prefill_q[i] for i in range(L)])  # [L, W, Hq, D]
        elif not isinstance(queries, torch.Tensor) or queries.dim() != 4 or queries.shape[0] != L:
            raise ValueError(f"queries must be a [L={L}, W, Hq, D] tensor, got "
                             f"{tuple(queries.shape) if isinstance(queries, torch.Tensor) else type(queries).__name__}")
        q = queries[:, -self.obs_window:]
        self._prefill_q = {}
        super().add(seq_id, tokens, k, v)
        self._evicted[seq_id] = 0
        self._since[seq_id] = 0
        self._queries[seq_id] = list(q.unbind(0))
        self._evict(seq_id, k, v, "prefill")

    def begin(self, seq_ids: Sequence, tokens: Sequence[int]):
        step = super().begin(seq_ids, tokens)
        self._step_ids, self._step_q = list(seq_ids), {}
        return step

    def attend(self, step, layer: int, q, k, v, sm_scale: float) -> torch.Tensor:
        self.sm_scale = float(sm_scale)
        return super().attend(step, layer, q, k, v, sm_scale)

    def commit(self, step) -> None:
        super().commit(step)
        ids, step_q = self._step_ids or [], self._step_q
        self._step_ids, self._step_q = None, {}
        for b, s in enumerate(ids):
            if len(step_q) == self.num_layers:
                win = self._queries[s]
                self._queries[s] = [torch.cat([win[i], step_q[i][b:b + 1]])[-self.obs_window:]
                                    for i in range(self.num_layers)]
            self._since[s] += 1
            if self.every is not None and self._since[s] >= self.every:
                kk, vv = self.cache.read(s)
                self._evict(s, kk, vv, "step")

    def abort(self, step) -> None:
        self._step_ids, self._step_q = None, {}
        super().abort(step)

    def fork(self, parent, child) -> None:
        super().fork(parent, child)
        self._evicted[child], self._since[child] = self._evicted[parent], self._since[parent]
        self._queries[child] = list(self._queries[parent])  # tensors are never written in place
        if parent in self._assigned:
            self._assigned[child] = self._assigned[parent]

    def free(self, seq_id) -> None:
        super().free(seq_id)
        for d in (self._evicted, self._queries, self._since, self._assigned):
            d.pop(seq_id, None)

    def num_tokens(self, seq_id) -> int:
        """The LOGICAL length: tokens stored plus tokens evicted (the position of the next token)."""
        return self.cache.manager.num_tokens(seq_id) + self._evicted.get(seq_id, 0)

    def stored_tokens(self, seq_id) -> int:
        return self.cache.manager.num_tokens(seq_id)

    def evicted_tokens(self, seq_id) -> int:
        return self._evicted[seq_id]

    # ---- internals -----------------------------------------------------------------
    def _evict(self, seq_id, k: torch.Tensor, v: torch.Tensor, event: str) -> EvictionReport:
        """One policy decision over the sequence's stored tokens (``k``, ``v`` ``[L, T, Hkv, D]``), applied."""
        T, position = k.shape[1], self.num_tokens(seq_id)
        q = torch.stack(self._queries[seq_id])[:, -T:]  # a window never longer than what is stored
        obs = Observation(k.float(), v.float(), q.float(), self.sm_scale)
        policy, partial = self._assigned.get(seq_id, (self.policy, self.partial))
        keep = policy.keep(obs)
        if not isinstance(keep, torch.Tensor):
            raise ValueError(f"policy.keep must return a bool tensor [{T}], got {type(keep).__name__}")
        report = evict(self.cache, seq_id, keep.to("cpu"), partial=partial)
        self._evicted[seq_id] += report.tokens_before - report.tokens_kept
        self._since[seq_id] = 0
        self.reports.append(report)
        self.events.append((seq_id, event, position))
        return report
