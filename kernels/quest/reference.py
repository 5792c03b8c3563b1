"""Plain PyTorch references of the Quest kernels (key bounds and page scores): slow, obvious, and the ground truth
in tests. The page selection's reference is ``workbench.compress.page_selection.select_pages``.
"""

from __future__ import annotations

import torch

from workbench.core.layout import Layout

from ..write.reference import dequantize_cache_ref


def round_outward_fp16(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 bounds rounded outward to fp16 as :func:`~workbench.kernels.quest.key_bounds` rounds them:
    ``lo - |lo| 2**-10 - 2**-24`` and ``hi + |hi| 2**-10 + 2**-24`` rounded to nearest (so still below / above the
    fp32 value), saturated at fp16's max where the fp32 bound lies inside its range, infinities kept."""
    lo, hi = lo.float(), hi.float()
    lo_w = lo - lo.abs() * 2.0**-10 - 2.0**-24
    hi_w = hi + hi.abs() * 2.0**-10 + 2.0**-24
    lo_w = torch.where(lo >= -65504.0, lo_w.clamp_min(-65504.0), lo_w)
    hi_w = torch.where(hi <= 65504.0, hi_w.clamp_max(65504.0), hi_w)
    lo = torch.where(lo.isinf(), lo, lo_w)
    hi = torch.where(hi.isinf(), hi, hi_w)
    return lo.to(torch.float16), hi.to(torch.float16)


def key_bounds_ref(scheme, k_cache: torch.Tensor, layout: Layout | str, head_dim: int, blocks: torch.Tensor,
                   counts: torch.Tensor, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``workbench.kernels.quest.key_bounds`` in PyTorch: ``[N, H, 2, head_dim]`` fp16 bounds (min, max) of the first
    ``counts[i]`` keys of block ``blocks[i]``, as attention reads them (:func:`dequantize_cache_ref` times the
    static scale), rounded outward (:func:`round_outward_fp16`); a count of 0 gives ``(+inf, -inf)``."""
    vals = dequantize_cache_ref(scheme, k_cache, layout, "k", head_dim)  # [nb, bs, H, D] fp32
    if k_scale is not None:
        vals = vals * k_scale.float().reshape(1, 1, -1, 1)
    x = vals[blocks.long()]  # [N, bs, H, D]
    m = (torch.arange(x.shape[1], device=x.device)[None, :] < counts.to(x.device)[:, None])[:, :, None, None]
    lo = torch.where(m, x, float("inf")).amin(1)  # [N, H, D]
    hi = torch.where(m, x, float("-inf")).amax(1)
    lo, hi = round_outward_fp16(lo, hi)
    return torch.stack([lo, hi], dim=2)


def quest_page_scores_ref(q: torch.Tensor, bounds: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          page_size: int, reduce: str = "sum", sm_scale: float | None = None, keep_first: int = 0,
                          keep_last: int = 0) -> torch.Tensor:
    """``workbench.kernels.quest.quest_page_scores`` in float64: per sequence the Quest bound of each page of its
    table (``workbench.compress.page_selection.page_upper_bounds`` on the gathered bounds), padding ``-inf``, forced pages
    ``+inf``. ``[B, max_blocks]`` (``[B, Hq, max_blocks]`` for ``reduce="none"``)."""
    B, Hq, D = q.shape
    W = block_table.shape[1]
    hkv = bounds.shape[1]
    scale = D**-0.5 if sm_scale is None else sm_scale
    out = torch.full((B, Hq, W) if reduce == "none" else (B, W), float("-inf"), dtype=torch.float64,
                     device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        p = -(-n // page_size)
        if p == 0:
            continue
        bd = bounds[block_table[b, :p].long()].double().repeat_interleave(Hq // hkv, dim=1)  # [p, Hq, 2, D]
        qq = q[b].double()[None]  # [1, Hq, D]
        ub = torch.where(qq > 0, qq * bd[:, :, 1], torch.where(qq < 0, qq * bd[:, :, 0], 0.0)).sum(-1)  # [p, Hq]
        s = ub.T if reduce == "none" else ub.amax(1) if reduce == "max" else (ub * scale).sum(1)
        pos = torch.arange(p, device=q.device)
        s = torch.where((pos < keep_first) | (pos >= p - keep_last), float("inf"), s)
        out[b, ..., :p] = s
    return out
