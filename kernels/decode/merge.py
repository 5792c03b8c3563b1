"""Merging attention states: partial outputs combined by their log-sum-exps (the split-KV reduction,
generalised; FlashInfer's ``merge_state(s)``), the piece a shared-prefix decode (two plans) needs.

Log-sum-exp units: base 2 by default, as the decode kernel writes them (see :mod:`.plan`);
``base=math.e`` reads and writes natural logs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import common

_Q_DTYPES = common.Q_DTYPES
_describe = common.describe


@triton.jit
def _merge_states_kernel(
    v_ptr,  # [N, S, H, D] partial outputs (normalized), unit stride in D
    s_ptr,  # [N, S, H] fp32 log-sum-exps
    n_ptr,  # [N] int32 valid states per row (HAS_N), or sequence lengths (N_FROM_LEN)
    vo_ptr,  # [N, H, D] merged outputs
    so_ptr,  # [N, H] fp32 merged log-sum-exps
    s_vn, s_vs, s_vh,
    s_sn, s_ss, s_sh,
    s_on, s_oh,
    s_son, s_soh,
    num_states,
    s_mul,  # log2(base): the given LSEs times this are base 2
    chunk,  # N_FROM_LEN: tokens per state (split-KV partials: row n has ceil(len / chunk) of them)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_N: tl.constexpr,
    N_FROM_LEN: tl.constexpr = False,
):
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    n = num_states
    if HAS_N:
        if N_FROM_LEN:
            n = tl.minimum(tl.cdiv(tl.load(n_ptr + i_n), chunk), num_states)
        else:
            n = tl.minimum(tl.load(n_ptr + i_n), num_states)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    b_m = tl.zeros((), tl.float32) + float("-inf")  # running max (base 2)
    b_l = tl.zeros((), tl.float32)  # running sum of weights
    b_acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, n, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        b_s = tl.load(s_ptr + i_n * s_sn + o_s * s_ss + i_h * s_sh, mask=o_s < n, other=float("-inf")) * s_mul
        m_s = (o_s < n) & (b_s > float("-inf"))  # an empty state (-inf) adds nothing, and its v is not read
        b_m_new = tl.maximum(b_m, tl.max(tl.where(m_s, b_s, float("-inf")), 0))
        b_ref = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_ref)
        b_w = tl.where(m_s, tl.exp2(b_s - b_ref), 0.0)  # [BLOCK_S]
        p_v = v_ptr + i_n * s_vn + o_s[:, None] * s_vs + i_h * s_vh + o_d[None, :]
        b_v = tl.load(p_v, mask=m_s[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
        b_l = b_l * b_alpha + tl.sum(b_w, 0)
        b_acc = b_acc * b_alpha + tl.sum(b_w[:, None] * b_v, 0)
        b_m = b_m_new
    b_l_safe = tl.where(b_l > 0, b_l, 1.0)
    tl.store(vo_ptr + i_n * s_on + i_h * s_oh + o_d, (b_acc / b_l_safe).to(vo_ptr.dtype.element_ty), mask=m_d)
    b_lse = tl.where(b_l > 0, b_m + tl.log2(b_l_safe), float("-inf")) / s_mul
    tl.store(so_ptr + i_n * s_son + i_h * s_soh, b_lse)


def merge_states(v: torch.Tensor, s: torch.Tensor, *, num_valid: torch.Tensor | None = None, base: float = 2.0,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention states: partial outputs over disjoint KV segments, each normalized over its segment,
    with their log-sum-exps (FlashInfer's ``merge_states`` shapes).

    Args:
        v: ``[N, num_states, H, D]`` fp16/bf16/fp32 partial outputs (any strides, unit stride in ``D``).
        s: ``[N, num_states, H]`` fp32 log-sum-exps of the segments' scaled scores, in base ``base``
            (default 2, as the decode kernel and FlashInfer write them; see the module docstring). A state of
            ``-inf`` (an empty segment) adds nothing and its ``v`` is not read (it may hold anything).
        num_valid: optional ``[N]`` int32: only the first ``num_valid[n]`` states of row ``n`` are merged (the
            others are not read), e.g. a ragged batch's split-KV partials.
        base: the base of ``s`` and of the returned LSE (2, or ``math.e`` for natural logs).
        out: optional ``(v_merged, s_merged)`` buffers to write (any strides, unit stride in ``D``), e.g. to run
            inside a CUDA graph without allocating.

    Returns:
        ``(v_merged [N, H, D] in v's dtype, s_merged [N, H] fp32)``. A row with no valid state gives zeros and
        ``-inf``.
    """
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or v.dtype not in _Q_DTYPES:
        raise ValueError(f"v must be a [N, num_states, H, D] fp16/bf16/fp32 tensor, got {_describe(v)}")
    N, S, H, D = v.shape
    if D > 1 and v.stride(3) != 1:
        raise ValueError(f"v must have unit stride in its last dimension, got strides {v.stride()}")
    if not isinstance(s, torch.Tensor) or s.shape != (N, S, H) or s.dtype != torch.float32 or s.device != v.device:
        raise ValueError(f"s must be an fp32 tensor of shape {(N, S, H)} on {v.device}, got {_describe(s)}")
    if num_valid is not None and (not isinstance(num_valid, torch.Tensor) or num_valid.shape != (N,)
                                  or num_valid.dtype != torch.int32 or num_valid.device != v.device
                                  or (N > 1 and num_valid.stride(0) != 1)):
        raise ValueError(f"num_valid must be a contiguous int32 tensor of shape {(N,)} on {v.device}, got "
                         f"{_describe(num_valid)}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
        raise ValueError(f"base must be a number > 1 (2 or math.e), got {base!r}")
    if out is None:
        v_out = torch.empty((N, H, D), dtype=v.dtype, device=v.device)
        s_out = torch.empty((N, H), dtype=torch.float32, device=v.device)
    else:
        v_out, s_out = out if isinstance(out, (tuple, list)) and len(out) == 2 else (None, None)
        if not isinstance(v_out, torch.Tensor) or v_out.shape != (N, H, D) or v_out.dtype != v.dtype \
                or v_out.device != v.device or (D > 1 and v_out.stride(2) != 1):
            raise ValueError(f"out[0] (v_merged) must be a {v.dtype} tensor of shape {(N, H, D)} on {v.device} with unit "
                             f"last stride, got {_describe(v_out)}")
        if not isinstance(s_out, torch.Tensor) or s_out.shape != (N, H) or s_out.dtype != torch.float32 \
                or s_out.device != v.device:
            raise ValueError(f"out[1] (s_merged) must be an fp32 tensor of shape {(N, H)} on {v.device}, got "
                             f"{_describe(s_out)}")
    if N == 0 or H == 0 or D == 0:
        s_out.fill_(float("-inf"))
        return v_out, s_out
    _merge_states_kernel[(N, H)](
        v, s, s if num_valid is None else num_valid, v_out, s_out,
        v.stride(0), v.stride(1), v.stride(2), s.stride(0), s.stride(1), s.stride(2),
        v_out.stride(0), v_out.stride(1), s_out.stride(0), s_out.stride(1),
        S, math.log2(base), 1,
        HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_S=min(16, triton.next_power_of_2(max(1, S))),
        HAS_N=num_valid is not None, num_warps=4,
    )
    return v_out, s_out


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor, *,
                base: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states (``v [N, H, D]``, ``s [N, H]`` fp32 LSE in base ``base``): the attention over
    the union of their segments, ``(v_merged [N, H, D], s_merged [N, H])``. See :func:`merge_states` (this stacks
    the two states and calls it)."""
    for name, t in (("v_a", v_a), ("s_a", s_a), ("v_b", v_b), ("s_b", s_b)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if v_a.shape != v_b.shape or v_a.dtype != v_b.dtype or v_a.dim() != 3:
        raise ValueError(f"v_a and v_b must be [N, H, D] of one dtype, got {_describe(v_a)} and {_describe(v_b)}")
    if s_a.shape != v_a.shape[:2] or s_b.shape != v_a.shape[:2]:
        raise ValueError(f"s_a and s_b must be [N, H] = {tuple(v_a.shape[:2])}, got {_describe(s_a)} and "
                         f"{_describe(s_b)}")
    return merge_states(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1), base=base)
