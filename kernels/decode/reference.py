"""Plain PyTorch references of the decode kernels: slow, obvious, and the ground truth in tests.

Paged decode in float64 (:func:`paged_decode_ref`), the shared-prefix cascade's way of computing it
(:func:`cascade_decode_ref`), the merge of partial states by their log-sum-exps (:func:`merge_states_ref`),
and the decode of any scheme's cache in fp32 (:func:`decode_cache_ref`, on the write reference's values).
"""

from __future__ import annotations

import math

import torch

from workbench.core.layout import Layout

from ..gather.reference import paged_gather_ref
from ..write.reference import dequantize_cache_ref


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: Layout | str,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention in float64, one sequence at a time: ``[B, Hq, D]`` in float64.

    Each sequence's K and V come from :func:`paged_gather_ref`; the ``Hq // Hkv`` query heads
    of a kv head share it (``repeat_interleave``). Read values are ``stored * scale``. A
    sequence of length 0 gives zeros.
    """
    B, Hq, D = q.shape
    scale = D**-0.5 if sm_scale is None else sm_scale
    ks = 1.0 if k_scale is None else float(k_scale)
    vs = 1.0 if v_scale is None else float(v_scale)
    out = torch.zeros((B, Hq, D), dtype=torch.float64, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        one = seq_lens.new_tensor([n])
        k = paged_gather_ref(k_cache, layout, "k", block_table[b : b + 1], one).double() * ks  # [n, Hkv, D]
        v = paged_gather_ref(v_cache, layout, "v", block_table[b : b + 1], one).double() * vs
        g = Hq // k.shape[1]
        k = k.repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, n, D]
        v = v.repeat_interleave(g, dim=1).transpose(0, 1)
        s = torch.einsum("hd,hnd->hn", q[b].double(), k) * scale  # [Hq, n]
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(s, dim=-1), v)
    return out


def cascade_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: Layout | str,
                       block_table: torch.Tensor, seq_lens: torch.Tensor, segments, suffix_start, block_size: int,
                       sm_scale: float | None = None, k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared-prefix decode the cascade's way, in float64: each segment ``(start, end, rows)`` attended once for
    its rows' queries over the blocks of its first row, each row's suffix over its own blocks, the partial states
    merged by log-sum-exp (:func:`merge_states_ref`). ``(out [B, Hq, D], lse [B, Hq] base 2)``; the output must
    equal :func:`paged_decode_ref` whatever the segments."""
    B, Hq, D = q.shape
    scale = D**-0.5 if sm_scale is None else sm_scale
    ks = 1.0 if k_scale is None else float(k_scale)
    vs = 1.0 if v_scale is None else float(v_scale)

    def attend(b_rows, blocks, n):  # queries of b_rows over n tokens of these blocks: (o [R, Hq, D], lse [R, Hq])
        if n == 0:
            return (torch.zeros((len(b_rows), Hq, D), dtype=torch.float64),
                    torch.full((len(b_rows), Hq), float("-inf"), dtype=torch.float64))
        table = torch.tensor([blocks + [0]], dtype=torch.int32, device=block_table.device)
        one = seq_lens.new_tensor([n])
        k = paged_gather_ref(k_cache, layout, "k", table, one).double().cpu() * ks  # [n, Hkv, D]
        v = paged_gather_ref(v_cache, layout, "v", table, one).double().cpu() * vs
        g = Hq // k.shape[1]
        k = k.repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, n, D]
        v = v.repeat_interleave(g, dim=1).transpose(0, 1)
        s = torch.einsum("rhd,hnd->rhn", q[list(b_rows)].double().cpu(), k) * scale
        return torch.einsum("rhn,hnd->rhd", torch.softmax(s, -1), v), torch.logsumexp(s, -1) / math.log(2)

    states = [[] for _ in range(B)]
    tables = block_table.cpu().tolist()
    for start, end, rows in segments:
        o, lse = attend(rows, tables[rows[0]][start:end], (end - start) * block_size)
        for i, r in enumerate(rows):
            states[r].append((o[i], lse[i]))
    for b, n in enumerate(seq_lens.tolist()):
        s0 = suffix_start[b]
        o, lse = attend([b], tables[b][s0:], n - s0 * block_size)
        states[b].append((o[0], lse[0]))
    L = max(len(s) for s in states) if B else 1
    v = torch.zeros((B, L, Hq, D), dtype=torch.float64)
    lse = torch.full((B, L, Hq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for i, (o, s) in enumerate(states[b]):
            v[b, i], lse[b, i] = o, s
    return merge_states_ref(v, lse)


def merge_states_ref(
    v: torch.Tensor, s: torch.Tensor, num_valid: torch.Tensor | None = None, base: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged attention states in float64: ``v [N, S, H, D]``, ``s [N, S, H]`` (log-sum-exps in base ``base``)
    -> ``(v [N, H, D], s [N, H])``.

    State ``i`` of row ``n`` counts if ``s`` is finite-or-above ``-inf`` and (``num_valid``) ``i < num_valid[n]``;
    its weight is ``base ** s`` relative to the others, and the merged LSE is ``log_base`` of the weights' sum.
    A row with no valid state gives zeros and ``-inf``; an invalid state's ``v`` is never used.
    """
    N, S, H, _ = v.shape
    s2 = s.double() * math.log2(base)  # base 2
    valid = s2 > float("-inf")
    if num_valid is not None:
        valid &= torch.arange(S, device=s.device)[None, :, None] < num_valid.to(s.device)[:, None, None]
    m = torch.where(valid, s2, float("-inf")).amax(dim=1) if S else s2.new_full((N, H), float("-inf"))
    m = torch.where(m == float("-inf"), 0.0, m)  # [N, H]
    w = torch.where(valid, torch.exp2(s2 - m[:, None]), 0.0)  # [N, S, H]
    vv = torch.where(valid[..., None], v.double(), 0.0)
    total = w.sum(dim=1)  # [N, H]
    out = (w[..., None] * vv).sum(dim=1) / torch.where(total > 0, total, 1.0)[..., None]
    lse = torch.where(total > 0, m + torch.log2(torch.where(total > 0, total, 1.0)), float("-inf"))
    return out, lse / math.log2(base)


def decode_cache_ref(scheme, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: Layout | str,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, head_dim: int, *, k_scale=None, v_scale=None,
                     sm_scale: float | None = None, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged decode of any scheme's cache in PyTorch (fp32): ``q`` ``[B, Hq, D]`` -> ``(out [B, Hq, D] fp32,
    lse [B, Hq] fp32 base 2)``. Values are :func:`dequantize_cache_ref`'s (times static scales); ``residual``: per
    sequence ``(k, v)`` ``[n, H, D]`` or None, attended after the blocks (KIVI's fp16 tokens)."""
    B, Hq, D = q.shape
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    vals = []
    for cache, kind, st in ((k_cache, "k", k_scale), (v_cache, "v", v_scale)):
        x = dequantize_cache_ref(scheme, cache, layout, kind, head_dim)  # [nb, bs, H, D]
        if st is not None:
            x = x * torch.as_tensor(st, dtype=torch.float32, device=x.device).reshape(1, 1, -1, 1)
        vals.append(x)
    bs = vals[0].shape[1]
    out = torch.zeros((B, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=q.device)
        blocks = block_table[b, pos // bs].long()
        k, v = vals[0][blocks, pos % bs], vals[1][blocks, pos % bs]  # [n, H, D]
        if residual is not None and residual[b] is not None:
            k, v = torch.cat([k, residual[b][0].float()]), torch.cat([v, residual[b][1].float()])
        if k.shape[0] == 0:
            continue
        g = Hq // k.shape[1]
        k, v = k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1)  # [Hq, n, D]
        s = torch.einsum("hd,hnd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v)
        lse[b] = torch.logsumexp(s, -1) / math.log(2.0)
    return out, lse
