"""Plain PyTorch references for the kernels: slow, obvious, and the ground truth in tests."""

from __future__ import annotations

import math

import torch

from workbench import formats
from workbench.layout import Layout, to_nhd


def paged_gather_ref(
    cache: torch.Tensor, layout: Layout | str, kind: str, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """Tokens of every sequence, packed: ``[sum(seq_lens), heads, head_dim]``.

    Token ``p`` of sequence ``b`` lives in block ``block_table[b, p // block_size]`` at
    offset ``p % block_size``.
    """
    nhd = to_nhd(cache, layout, kind)
    block_size = nhd.shape[1]
    rows = []
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=cache.device)
        blocks = block_table[b, pos // block_size].long()
        rows.append(nhd[blocks, pos % block_size])
    return torch.cat(rows) if rows else nhd.new_empty((0, *nhd.shape[2:]))


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


def quantize_ref(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Storage codes of ``x`` ``[T, H, D]`` in ``dtype``, as :func:`write_kv_ref` stores them.

    fp32/fp16/bf16: a plain cast. fp8: ``fp8(clamp(x / scale, -max, max))`` (vLLM's convention,
    saturating). int8: ``clamp(round_half_even(x / scale), -128, 127)``. ``scale`` is fp32 with one
    element (per tensor) or ``[H]`` (per kv head).
    """
    fmt = formats.get(dtype)
    if not fmt.quantized:
        return x.to(dtype)
    s = scale.reshape(()) if scale.numel() == 1 else scale.reshape(1, -1, 1)
    q = x.float() / s
    if fmt.codes == "int":
        return q.clamp(fmt.qmin, fmt.qmax).round().to(dtype)
    return q.clamp(fmt.qmin, fmt.qmax).to(dtype)


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: Layout | str,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write token ``t`` of ``key``/``value`` ``[T, H, D]`` to slot ``slot_mapping[t]``, in place.

    Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; ``-1`` skips the token.
    Values are stored as :func:`quantize_ref` gives them.
    """
    layout = Layout.parse(layout)
    block_size = to_nhd(v_cache[:0], layout, "v").shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    for src, cache, kind, scale in ((key, k_cache, "k", k_scale), (value, v_cache, "v", v_scale)):
        _place_rows(cache, layout, kind, blk, off, quantize_ref(src[keep], cache.dtype, scale))


def _place_rows(cache: torch.Tensor, layout: Layout, kind: str, blk, off, q: torch.Tensor) -> None:
    """Store rows ``q`` ``[T, H, DC]`` (codes) at blocks ``blk``, offsets ``off`` of a cache in ``layout``."""
    if layout is Layout.NHD:
        cache[blk, off] = q
    elif layout is Layout.HND:
        cache[blk, :, off] = q  # advanced indices first: [T', H, D]
    elif kind == "k":
        cache[blk, :, :, off] = q.reshape(*q.shape[:2], cache.shape[2], cache.shape[4])  # [T', H, D/x, x]
    else:
        cache[blk, :, :, off] = q  # [T', H, D]


def write_cache_ref(scheme, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    layout: Layout | str, slot_mapping: torch.Tensor, k_scale=None, v_scale=None) -> None:
    """``write_kv(..., quant=scheme)`` in PyTorch: the codes of ``key``/``value`` ``[T, H, D]`` and (``token`` and
    ``group`` schemes) their scales into the blocks (``workbench.quant.blocks``), as ``scheme.quantize`` gives
    them. A group of keys quantized per channel must lie in consecutive slots of one block, as for the kernel."""
    from workbench.quant import blocks as qblocks

    if not scheme.scales_on_write:
        write_kv_ref(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale)
        return
    layout = Layout.parse(layout)
    bs = to_nhd(v_cache[:0], layout, "v").shape[1]
    slots = slot_mapping.long()
    blk, off = slots // bs, slots % bs
    whole = scheme.without_residual()  # the caller chose the tokens to store
    D = key.shape[-1]
    for src, cache, kind in ((key, k_cache, "k"), (value, v_cache, "v")):
        qz = whole.quantize(src, kind)
        _place_rows(cache, layout, kind, blk, off, qz.codes.to(cache.dtype) if qz.codes.dtype != cache.dtype
                    else qz.codes)
        sc = qblocks.block_scales(scheme, kind, bs, src.shape[1], D)
        scale, zero = qblocks.scale_views(qblocks.plane_of(cache), sc)  # [nb, token groups, H, channel groups]
        g = sc.tokens_per_group
        b_g, t_g = blk[::g], off[::g] // g  # one scale row per group of g tokens (its first slot)
        rows = qz.scale.reshape(b_g.shape[0], src.shape[1], -1)  # [groups, H, channel groups]
        scale[b_g, t_g] = rows.to(scale.dtype)
        if zero is not None:
            zero[b_g, t_g] = qz.zero.reshape(rows.shape).to(zero.dtype)


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


def quant_code_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in codes between two 1-byte tensors (fp8 or int8) of the same shape, as int32.

    fp8 codes are sign-magnitude, so they are mapped to ordered integers first (+0 and -0 coincide).
    """

    def ordered(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.int8:
            return t.to(torch.int32)
        u = t.view(torch.uint8).to(torch.int32)
        mag = u & 0x7F
        return torch.where(u >= 0x80, -mag, mag)

    return (ordered(a) - ordered(b)).abs()


def copy_blocks_ref(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``pool[:, :, dst[i]] = pool[:, :, src[i]]`` for every pair, every layer, K and V; in place.

    ``pool`` is ``[num_layers, 2, num_blocks, block_stride]``; a block is its whole row.
    """
    pool[:, :, dst.long()] = pool[:, :, src.long()].clone()


def quantize_rcp_ref(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """Codes of ``x`` ``[T, H, D]`` as ``write_kv(..., quant_math="rcp")`` stores them: like
    :func:`quantize_ref` but ``x * (1 / scale)`` (the reciprocal rounded to fp32 once) instead of
    ``x / scale``, so a code can differ from :func:`quantize_ref`'s by one near a midpoint."""
    s = scale.reshape(()) if scale.numel() == 1 else scale.reshape(1, -1, 1)
    q = x.float() * (1.0 / s.float())
    fmt = formats.get(dtype)
    if fmt.codes == "int":
        return q.clamp(fmt.qmin, fmt.qmax).round().to(dtype)
    return q.clamp(fmt.qmin, fmt.qmax).to(dtype)


def dequantize_cache_ref(scheme, cache: torch.Tensor, layout: Layout | str, kind: str, head_dim: int) -> torch.Tensor:
    """Values of every slot of a quantized cache as fp32 NHD ``[num_blocks, block_size, heads, head_dim]``:
    codes read in ``layout`` and scales from the blocks (``workbench.quant.blocks``), ``scheme``'s arithmetic."""
    from workbench.quant import blocks as qblocks

    nhd = to_nhd(cache, layout, kind)  # [nb, bs, H, DC]
    nb, bs, h, _ = nhd.shape
    sc = scheme.block_scales(kind, bs, h, head_dim)
    if sc is None:  # plain values, or codes whose static scales the caller applies
        return nhd.float()
    scale, zero = qblocks.scale_views(qblocks.plane_of(cache), sc)  # [nb, token groups, H, channel groups]
    codes = scheme.code_values(nhd).float()  # [nb, bs, H, D]
    tok = torch.arange(bs, device=cache.device) // sc.tokens_per_group
    ch = torch.arange(head_dim, device=cache.device) // sc.channels_per_group
    s = scale.float()[:, tok][..., ch]  # [nb, bs, H, D]
    out = codes * s
    if zero is not None:
        out = out + zero.float()[:, tok][..., ch]
    return out


def move_blocks_ref(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor, *,
                    num_rows: int, row_bytes: int, src_row_stride: int, src_block_stride: int, dst_row_stride: int,
                    dst_block_stride: int, src_offset: int = 0, dst_offset: int = 0, **_launch) -> None:
    """``workbench.kernels.swap.move_blocks`` in PyTorch: block ``src_ids[i]`` of one byte space to block
    ``dst_ids[i]`` of another, row by row (strides in bytes; see that module)."""
    s = src.reshape(-1).view(torch.uint8)[src_offset:]
    d = dst.reshape(-1).view(torch.uint8)[dst_offset:]
    rows = torch.arange(num_rows, dtype=torch.int64)
    cols = torch.arange(row_bytes, dtype=torch.int64)
    for i_s, i_d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        o_s = (rows * src_row_stride + i_s * src_block_stride)[:, None] + cols  # [rows, row_bytes]
        o_d = (rows * dst_row_stride + i_d * dst_block_stride)[:, None] + cols
        d[o_d.reshape(-1).to(d.device)] = s[o_s.reshape(-1).to(s.device)].to(d.device)


def round_outward_fp16(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 bounds rounded outward to fp16 as ``kernels/quest.py`` rounds them: ``lo - |lo| 2**-10 - 2**-24`` and
    ``hi + |hi| 2**-10 + 2**-24`` rounded to nearest (so still below / above the fp32 value), saturated at fp16's max
    where the fp32 bound lies inside its range, infinities kept."""
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
    table (``workbench.compress.quest.page_upper_bounds`` on the gathered bounds), padding ``-inf``, forced pages
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
