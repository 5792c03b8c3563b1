"""Where a runner keeps K/V: the workbench's :class:`~workbench.cache.PagedKVCache` or, as its baseline, plain
contiguous tensors per sequence. Both offer the same five calls to :class:`~workbench.model.runner.Runner`.

A decode step is ``begin`` (reserve), ``attend`` per layer, ``commit`` (or ``abort``). The paged store runs
it as a serving engine does (:class:`~workbench.cache.DecodeStep`): each layer writes the new tokens' K/V into
their slots, then the paged decode kernel attends over the blocks, the new tokens included (read back quantized
if the cache is). KIVI schemes, whose newest tokens live in an fp16 residual, attend over the cache with its
log-sum-exp, merge the new token's own K/V in (:func:`merge_own_token`) and append at commit.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch

from workbench.model.llama import causal_attention
from workbench.shared_prefix.decode import cost_model

LOG2E = 1.0 / math.log(2.0)


def merge_own_token(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    sm_scale: float) -> torch.Tensor:
    """Attention over (cached keys, own key): ``o``/``lse`` ``[B, Hq, D]``/``[B, Hq]`` (base 2) over the cache,
    ``q`` ``[B, Hq, D]``, own ``k``/``v`` ``[B, Hkv, D]`` -> ``[B, Hq, D]`` in q's dtype."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    s_own = (q.float() * kk).sum(-1) * (sm_scale * LOG2E)  # [B, Hq]
    m = torch.maximum(lse, s_own)
    a, b = torch.exp2(lse - m), torch.exp2(s_own - m)
    return ((o.float() * a[..., None] + vv * b[..., None]) / (a + b)[..., None]).to(q.dtype)


class ContiguousKV:
    """Each sequence's K/V as one growing tensor per layer, attention in plain PyTorch: the baseline."""

    name = "contiguous"
    device = None  # follows its inputs

    def __init__(self, num_layers: int, dtype: torch.dtype = torch.float32):
        self.num_layers, self.dtype = num_layers, dtype
        self._k: dict = {}
        self._v: dict = {}

    def read_prefix(self, tokens: Sequence[int]):
        return None, None  # no prefix cache

    def add(self, seq_id, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        if seq_id in self._k:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self._k[seq_id], self._v[seq_id] = k.to(self.dtype), v.to(self.dtype)

    def begin(self, seq_ids: Sequence, tokens: Sequence[int]):
        return _Pending(list(seq_ids), [int(t) for t in tokens], self.num_layers)

    def attend(self, step, layer: int, q, k, v, sm_scale: float) -> torch.Tensor:
        step.keep(layer, k, v)
        out = []
        for i, s in enumerate(step.seq_ids):
            kk = torch.cat([self._k[s][layer], k[i:i + 1].to(self.dtype)])
            vv = torch.cat([self._v[s][layer], v[i:i + 1].to(self.dtype)])
            out.append(causal_attention(q[i:i + 1], kk, vv, sm_scale))
        return torch.cat(out)

    def commit(self, step) -> None:
        k, v = step.stacked()
        for i, s in enumerate(step.seq_ids):  # k, v: [L, B, H, D]
            self._k[s] = torch.cat([self._k[s], k[:, i:i + 1].to(self.dtype)], 1)
            self._v[s] = torch.cat([self._v[s], v[:, i:i + 1].to(self.dtype)], 1)

    def abort(self, step) -> None:
        pass

    def fork(self, parent, child) -> None:
        self._k[child], self._v[child] = self._k[parent], self._v[parent]  # never written in place

    def free(self, seq_id) -> None:
        self._k.pop(seq_id), self._v.pop(seq_id)

    def num_tokens(self, seq_id) -> int:
        return self._k[seq_id].shape[1]


class PagedKV:
    """K/V in a :class:`~workbench.cache.PagedKVCache` (any scheme); attention by its paged decode kernel.

    ``q_dtype``: the queries' dtype for the kernel (fp32 with an fp32 cache, for exact comparisons; fp16 for
    quantized caches, which the kernels dequantize to). ``shared_prefix``: ``"off"`` (plain paged decode),
    ``"auto"`` (the blocks a step's sequences share, e.g. forked samples of one prompt, read once by the cascade
    where the fitted selector says it wins) or ``"shared"`` (the cascade whenever a block is shared):
    :meth:`~workbench.cache.DecodeStep.attend`'s; ``timing``: how the caller launches steps, which the selector's
    fitted model must match (``"eager"``: one launch at a time, as :class:`~workbench.model.runner.Runner` does,
    where the cascade's extra launches cost most; ``"graph"``: steps replayed as CUDA graphs).
    ``paths`` counts how each (step, layer) was attended."""

    name = "paged"

    def __init__(self, cache, q_dtype: torch.dtype | None = None, *, shared_prefix: str = "off",
                 timing: str = "eager"):
        if shared_prefix not in ("off", "auto", "shared"):
            raise ValueError(f"shared_prefix must be 'off', 'auto' or 'shared', got {shared_prefix!r}")
        if timing not in ("eager", "graph"):
            raise ValueError(f"timing must be 'eager' or 'graph', got {timing!r}")
        if shared_prefix != "off" and cache.scheme.keeps_residual:
            raise ValueError(f"shared_prefix={shared_prefix!r} needs a per-layer decode step, which kv_dtype "
                             f"{cache.scheme.name} (newest tokens in an fp16 residual) has not: use 'off'")
        self.shared_prefix = shared_prefix
        self._select = {"model": cost_model(mode=timing)} if shared_prefix == "auto" else {}  # the selector's fit
        self.paths: Counter = Counter()
        self.cache = cache
        self.device = cache.device  # where the runner's model must compute K/V and queries
        self.num_layers = cache.num_layers
        self.q_dtype = q_dtype or (torch.float32 if cache.dtype == torch.float32 else
                                   cache.dtype if cache.dtype in (torch.float16, torch.bfloat16) else torch.float16)

    def read_prefix(self, tokens: Sequence[int]):
        k, v = self.cache.read_prefix(tokens)
        return (k, v) if k.shape[1] else (None, None)

    def add(self, seq_id, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.add(seq_id, tokens, k, v)

    def begin(self, seq_ids: Sequence, tokens: Sequence[int]):
        if self.cache.scheme.keeps_residual:  # KIVI: attend, merge the own token, append at commit
            return _Pending(list(seq_ids), [int(t) for t in tokens], self.num_layers)
        return self.cache.begin_step(list(seq_ids), [int(t) for t in tokens])

    def attend(self, step, layer: int, q, k, v, sm_scale: float) -> torch.Tensor:
        if isinstance(step, _Pending):
            step.keep(layer, k, v)
            o, lse = self.cache.decode(q.to(self.q_dtype), step.seq_ids, layer, sm_scale=sm_scale, return_lse=True)
            self.paths["plain"] += 1
            return merge_own_token(o, lse, q, k, v, sm_scale)
        step.write(layer, k, v)
        out = step.attend(q.to(self.q_dtype), layer, sm_scale=sm_scale, shared_prefix=self.shared_prefix,
                          **self._select)
        self.paths[step.paths[layer]] += 1
        return out.to(q.dtype)

    def commit(self, step) -> None:
        if isinstance(step, _Pending):
            k, v = step.stacked()
            self.cache.append_batch(step.seq_ids, step.tokens, k, v)
        else:
            step.commit()

    def abort(self, step) -> None:
        if not isinstance(step, _Pending):
            step.abort()

    def fork(self, parent, child) -> None:
        self.cache.fork(parent, child)

    def free(self, seq_id) -> None:
        self.cache.free(seq_id)

    def num_tokens(self, seq_id) -> int:
        return self.cache.manager.num_tokens(seq_id)


class _Pending:
    """A step whose K/V is kept until commit (the contiguous store, KIVI caches)."""

    def __init__(self, seq_ids: list, tokens: list[int], num_layers: int):
        self.seq_ids, self.tokens = seq_ids, tokens
        self._k: list = [None] * num_layers
        self._v: list = [None] * num_layers

    def keep(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._k[layer], self._v[layer] = k, v

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[L, B, H, D]`` K and V of every layer."""
        return torch.stack(self._k), torch.stack(self._v)
