"""Paged decode attention: one query token per sequence against its paged K/V (GQA, split-KV).

One program handles one (split, kv head, sequence) and ALL ``G = Hq // Hkv`` query heads
that share the kv head, so each K/V row is read from memory once. It walks its chunk of
the context in tiles of ``BLOCK_N`` tokens gathered through the block table (a tile may
span several pages or be part of one), keeping an online softmax in fp32 (``exp2``).

Split-KV (flash-decoding): when ``B * Hkv`` programs cannot fill the GPU, each
sequence's context is cut into chunks of ``chunk`` tokens (the same for every sequence,
so every program does about the same work; a ragged batch's short sequences simply
have fewer chunks and their extra programs exit at once). Each chunk writes its
normalized partial output and log2-sum-exp; a second small kernel combines them.

The vLLM split layout (key ``[blocks, heads, D // x, block_size, x]``, value ``[blocks, heads, D,
block_size]``): the key tile is read per d-group as runs of a page's tokens (x elements each, back to
back), so a warp reads whole runs, and permuted in registers to the ``[D, BLOCK_N]`` operand; the value
tile has tokens as its fast axis. The loop then takes whole tiles only: a mask along the value's vector
axis would break its 16-byte copies, so the partial last tile is done after the loop, masked.

A sequence of length 0 gives an output of zeros.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from workbench import formats
from workbench.layout import Layout, addressing, to_nhd

from . import common
from .validate import capturing, table_stats  # noqa: F401  (DecodePlan reads them here: tests patch them)

LOG2E = 1.4426950408889634
_FP8 = common.FP8_DTYPES
_LAUNCH_KEYS = ("BLOCK_N", "num_warps", "num_stages", "use_dot", "k3d")


@triton.jit
def _load_page(p, ASM: tl.constexpr):
    """Block-table entries at ``p`` (all in bounds). On the GPU through inline PTX: the compiler's
    software pipeliner cannot see this load, so it keeps K/V multi-buffered (a table load it can
    see turns the K/V loads into a dependent chain with a single buffer)."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [p], dtype=tl.int32, is_pure=True,
                                         pack=1)
    return tl.load(p)


@triton.jit
def _page_rows(bt_row, start, hi, s_blk_k, s_tok_k, s_blk_v, s_tok_v, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
               ASM: tl.constexpr):
    """Row offsets of the tile's tokens ``[start, start + BLOCK_N)`` in the K and V caches.

    Tokens past ``hi`` (the end) get a valid page of the sequence, so their rows are in bounds."""
    if PAGE % BLOCK_N == 0:
        # the tile sits inside one page: one table lookup per tile
        i_pg = _load_page(bt_row + start // PAGE, ASM).to(tl.int64)
        o_tok = (start % PAGE) + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    elif BLOCK_N % PAGE == 0:
        # the tile covers BLOCK_N // PAGE whole pages (start is a multiple of PAGE)
        o_n = tl.arange(0, BLOCK_N)
        i_pg = _load_page(bt_row + start // PAGE + tl.minimum(o_n, hi - 1 - start) // PAGE, ASM).to(tl.int64)
        o_tok = o_n % PAGE  # [BLOCK_N]
    else:
        o_n = start + tl.arange(0, BLOCK_N)
        i_pg = _load_page(bt_row + tl.minimum(o_n, hi - 1) // PAGE, ASM).to(tl.int64)
        o_tok = o_n % PAGE  # [BLOCK_N]
    o_krow = i_pg * s_blk_k + o_tok * s_tok_k  # [BLOCK_N] int64: pages can lie beyond 2**31 elements
    o_vrow = i_pg * s_blk_v + o_tok * s_tok_v  # [BLOCK_N]
    return o_krow, o_vrow


@triton.jit
def _attend_tile(b_q, b_m, b_l, b_acc, start, hi, bt_row, k_base, v_base, o_d, m_d, s_scale,
                 k_s_blk, k_s_tok, k_s_dgrp, v_s_blk, v_s_tok, v_s_d,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                 KX: tl.constexpr, V_TRANS: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
                 K3D: tl.constexpr, MASKED: tl.constexpr, V_ALIGN: tl.constexpr, G_PAD: tl.constexpr,
                 ASM: tl.constexpr):
    """One tile of tokens ``[start, start + BLOCK_N)``: scores, online-softmax update, ``acc += p @ v``.

    ``MASKED``: the tile may run past ``hi`` (otherwise every token is valid and nothing is masked).
    Returns the updated ``(b_m [G_PAD], b_l [G_PAD], b_acc [G_PAD, BLOCK_D])``."""
    o_n = start + tl.arange(0, BLOCK_N)
    m_n = o_n < hi  # [BLOCK_N]
    o_krow, o_vrow = _page_rows(bt_row, start, hi, k_s_blk, k_s_tok, v_s_blk, v_s_tok, PAGE, BLOCK_N, ASM)
    if K3D:
        # the split key, per d-group: a page's tokens are back-to-back x-element (16-byte) chunks, so
        # the tile is [D // x, pages, run] with runs of RUN tokens * x contiguous elements: lanes walk
        # the runs and a warp reads whole ones, whatever order the compiler gives the other two dims
        NPG: tl.constexpr = BLOCK_N // PAGE if BLOCK_N > PAGE else 1  # pages per tile
        RUN: tl.constexpr = BLOCK_N // NPG  # tokens per run
        o_g3 = tl.arange(0, BLOCK_D // KX)
        o_p3 = tl.arange(0, NPG)
        o_j3 = tl.arange(0, RUN * KX)  # token j // x of the run, element j % x
        if NPG == 1:
            i_pg3 = _load_page(bt_row + start // PAGE, ASM).to(tl.int64)
            o_run = i_pg3 * k_s_blk + (start % PAGE) * KX + tl.zeros([1], dtype=tl.int64)  # [1]
        else:
            i_pg3 = _load_page(bt_row + tl.minimum(start // PAGE + o_p3, (hi - 1) // PAGE), ASM).to(tl.int64)
            o_run = i_pg3 * k_s_blk  # [NPG] runs start at a page
        p_k3 = k_base + (o_g3 * k_s_dgrp)[:, None, None] + o_run[None, :, None] + o_j3[None, None, :]
        m_g3 = (o_g3 < HEAD_DIM // KX)[:, None, None]
        if MASKED:
            m_k3 = (start + o_p3 * RUN)[None, :, None] + (o_j3 // KX)[None, None, :] < hi
            if BLOCK_D != HEAD_DIM:
                m_k3 = m_k3 & m_g3
            b_k3 = tl.load(p_k3, mask=m_k3, other=0.0)  # [BLOCK_D // KX, NPG, RUN * KX]
        elif BLOCK_D == HEAD_DIM:
            b_k3 = tl.load(p_k3)
        else:
            b_k3 = tl.load(p_k3, mask=m_g3, other=0.0)
        b_k3 = tl.reshape(b_k3, (BLOCK_D // KX, BLOCK_N, KX))
        b_kt = tl.reshape(tl.permute(b_k3, (0, 2, 1)), (BLOCK_D, BLOCK_N))  # [BLOCK_D, BLOCK_N] (k transposed)
    else:
        o_kd = (o_d // KX) * k_s_dgrp + o_d % KX  # [BLOCK_D] 16-byte runs of x elements
        p_k = k_base + o_krow[:, None] + o_kd[None, :]
        if MASKED:
            b_k = tl.load(p_k, mask=m_n[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        elif BLOCK_D == HEAD_DIM:
            b_k = tl.load(p_k)
        else:
            b_k = tl.load(p_k, mask=m_d[None, :], other=0.0)
    if V_TRANS:
        # tokens run contiguously inside a page: dim 0 of the tile is the fast one
        o_v = o_vrow[:, None] + (o_d * v_s_d)[None, :]  # [BLOCK_N, BLOCK_D]
        # the compiler cannot see through the table lookup: say it. Runs of BLOCK_N (or PAGE) tokens
        # start at a multiple of BLOCK_N in a page (or at a page): aligned like the block and channel strides
        if PAGE % BLOCK_N == 0:
            o_v = tl.multiple_of(tl.max_contiguous(o_v, [BLOCK_N, 1]), [V_ALIGN, 1])
        elif BLOCK_N % PAGE == 0:
            o_v = tl.multiple_of(tl.max_contiguous(o_v, [PAGE, 1]), [V_ALIGN, 1])
        # a mask along the token (vector) dim would break 16-byte loads: rows past the end are
        # in bounds (see _page_rows) but may hold anything, so zero them after the load
        if BLOCK_D == HEAD_DIM:
            b_v = tl.load(v_base + o_v)
        else:
            b_v = tl.load(v_base + o_v, mask=m_d[None, :], other=0.0)
        if MASKED:
            b_v = tl.where(m_n[:, None], b_v, 0.0)  # [BLOCK_N, BLOCK_D]
    else:
        p_v = v_base + o_vrow[:, None] + o_d[None, :]
        if MASKED:
            b_v = tl.load(p_v, mask=m_n[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        elif BLOCK_D == HEAD_DIM:
            b_v = tl.load(p_v)
        else:
            b_v = tl.load(p_v, mask=m_d[None, :], other=0.0)

    if K3D:
        b_kt = b_kt.to(b_q.dtype)
        if IEEE:
            b_s = tl.dot(b_q, b_kt, input_precision="ieee")  # [G_PAD, BLOCK_N]
        else:
            b_s = tl.dot(b_q, b_kt)
    elif USE_DOT:
        b_k = b_k.to(b_q.dtype)
        if IEEE:
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")  # [G_PAD, BLOCK_N]
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
    elif G_PAD == 1:  # MHA: plain 2-D products, no 3-D broadcast
        b_s = tl.sum(b_q * b_k.to(tl.float32), axis=1)[None, :]  # [1, BLOCK_N]
    else:
        b_s = tl.sum(b_q[:, None, :] * b_k.to(tl.float32)[None, :, :], axis=2)  # [G_PAD, BLOCK_N]
    if MASKED:
        b_s = tl.where(m_n[None, :], b_s * s_scale, float("-inf"))
    else:
        b_s = b_s * s_scale
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # finite: every tile holds a valid token
    b_alpha = tl.exp2(b_m - b_m_new)  # [G_PAD]
    b_p = tl.exp2(b_s - b_m_new[:, None])  # [G_PAD, BLOCK_N]
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None]
    if USE_DOT:
        b_v = b_v.to(b_q.dtype)
        if IEEE:
            b_acc += tl.dot(b_p, b_v, input_precision="ieee")  # [G_PAD, BLOCK_D]
        else:
            b_acc += tl.dot(b_p.to(b_q.dtype), b_v)
    elif G_PAD == 1:
        b_acc += tl.sum(tl.trans(b_p) * b_v.to(tl.float32), axis=0)[None, :]
    else:
        b_acc += tl.sum(b_p[:, :, None] * b_v.to(tl.float32)[None, :, :], axis=1)
    return b_m_new, b_l, b_acc


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D] query, unit stride in D
    k_ptr,  # K cache, any layout, addressed as blk*s_blk + tok*s_tok + head*s_head + (d // KX)*s_dgrp + d % KX
    v_ptr,  # V cache: blk*s_blk + tok*s_tok + head*s_head + d (V_TRANS: + d*s_d, with s_tok == 1)
    bt_ptr,  # [B, max_blocks] int32 block table
    lens_ptr,  # [B] int32 context lengths
    out_ptr,  # [B, Hq, D] output (used when not SPLIT)
    o_part_ptr,  # [B, Hq, S, D] fp32 normalized partial outputs (SPLIT)
    lse_ptr,  # [B, Hq, S] fp32 log2-sum-exp of each partial (SPLIT)
    k_scale_ptr, v_scale_ptr,  # fp32 scalars (SCALE_PTR) ...
    k_scale, v_scale,  # ... or plain floats: read K = stored * k_scale
    qk_scale,  # sm_scale * log2(e)
    s_qb, s_qh,  # q strides
    s_ob, s_oh,  # out strides
    s_bt,  # block-table row stride
    k_s_blk, k_s_tok, k_s_head, k_s_dgrp,  # each in units of its K_*M elements (see _stride_split)
    v_s_blk, v_s_tok, v_s_head, v_s_d,  # each in units of its V_*M elements
    chunk,  # tokens per split, a multiple of BLOCK_N
    num_splits,
    G: tl.constexpr,  # query heads per kv head
    G_PAD: tl.constexpr,  # G rounded up (>= 16 for tl.dot)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_N: tl.constexpr,  # tokens per tile
    PAGE: tl.constexpr,  # tokens per cache block
    KX: tl.constexpr,  # key split x (BLOCK_D when K is not split)
    V_TRANS: tl.constexpr,  # V stored [D, tokens] per block (vLLM value layout): tokens are the fast dim
    USE_DOT: tl.constexpr,  # tensor cores (tl.dot) or broadcast-multiply + sum
    IEEE: tl.constexpr,  # dot in fp32 without TF32 (fp32 q; bf16 in the interpreter, whose bf16 dot is wrong)
    SPLIT: tl.constexpr,  # write partials for the reduce kernel
    SCALE_PTR: tl.constexpr,
    K_BM: tl.constexpr,  # k_s_blk was divided by this power of two (keeps 16-byte alignment visible)
    K_TM: tl.constexpr,  # ... k_s_tok by this one (the split key's token stride is x = 8: not "divisible by 16")
    K_HM: tl.constexpr,
    K_GM: tl.constexpr,
    V_BM: tl.constexpr,
    V_TM: tl.constexpr,
    V_HM: tl.constexpr,
    V_DM: tl.constexpr,  # v_s_d (the vLLM value's channel stride = block_size, 8 for 8-token pages)
    V_ALIGN: tl.constexpr,  # min(V_BM, V_DM): alignment of a page's V run (V_TRANS)
    ASM: tl.constexpr,  # block-table loads through inline PTX (GPU only)
    K3D: tl.constexpr,  # split key read as [D // x, pages, run * x] tiles (lanes along tokens), then permuted
):
    i_s = tl.program_id(0)
    i_hk = tl.program_id(1)
    i_b = tl.program_id(2)
    seq_len = tl.load(lens_ptr + i_b)
    lo = i_s * chunk
    if SPLIT:
        if lo >= seq_len:
            return  # a ragged batch's short sequence has fewer chunks; the reduce skips them
    # the last split takes the rest, so a too-small chunk is slow, never wrong
    hi = tl.where(i_s == num_splits - 1, seq_len, tl.minimum(lo + chunk, seq_len))

    o_g = tl.arange(0, G_PAD)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < G
    m_d = o_d < HEAD_DIM
    i_hq = i_hk * G + o_g  # [G_PAD] query heads of this kv head
    p_q = q_ptr + i_b.to(tl.int64) * s_qb + i_hq[:, None] * s_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)  # [G_PAD, BLOCK_D]
    if SCALE_PTR:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    s_scale = qk_scale * k_scale
    if IEEE or not USE_DOT:
        b_q = b_q.to(tl.float32)

    k_base = k_ptr + i_hk.to(tl.int64) * (k_s_head * K_HM)
    v_base = v_ptr + i_hk.to(tl.int64) * (v_s_head * V_HM)
    bt_row = bt_ptr + i_b.to(tl.int64) * s_bt

    b_m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([G_PAD], dtype=tl.float32)
    b_acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
    # V_TRANS: the loop takes whole tiles only (no token mask, so the V copies feed the dot straight
    # from shared memory); the partial last tile follows it, masked
    i_end = hi // BLOCK_N if V_TRANS else tl.cdiv(hi, BLOCK_N)
    for i_t in range(lo // BLOCK_N, i_end):
        b_m, b_l, b_acc = _attend_tile(
            b_q, b_m, b_l, b_acc, i_t * BLOCK_N, hi, bt_row, k_base, v_base, o_d, m_d, s_scale,
            k_s_blk * K_BM, k_s_tok * K_TM, k_s_dgrp * K_GM, v_s_blk * V_BM, v_s_tok * V_TM, v_s_d * V_DM,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, KX, V_TRANS, USE_DOT, IEEE, K3D, not V_TRANS, V_ALIGN, G_PAD, ASM)
    if V_TRANS:
        if hi % BLOCK_N != 0:
            b_m, b_l, b_acc = _attend_tile(
                b_q, b_m, b_l, b_acc, i_end * BLOCK_N, hi, bt_row, k_base, v_base, o_d, m_d, s_scale,
                k_s_blk * K_BM, k_s_tok * K_TM, k_s_dgrp * K_GM, v_s_blk * V_BM, v_s_tok * V_TM, v_s_d * V_DM,
                HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, KX, V_TRANS, USE_DOT, IEEE, K3D, True, V_ALIGN, G_PAD, ASM)

    b_l_safe = tl.where(b_l > 0, b_l, 1.0)  # an empty sequence keeps acc == 0
    b_o = b_acc * (v_scale / b_l_safe)[:, None]  # [G_PAD, BLOCK_D]
    m_o = m_g[:, None] & m_d[None, :]
    if SPLIT:
        row = (i_b.to(tl.int64) * (G * tl.num_programs(1)) + i_hq) * num_splits + i_s  # [G_PAD]
        tl.store(o_part_ptr + row[:, None] * HEAD_DIM + o_d[None, :], b_o, mask=m_o)
        tl.store(lse_ptr + row, b_m + tl.log2(b_l_safe), mask=m_g)
    else:
        p_o = out_ptr + i_b.to(tl.int64) * s_ob + i_hq[:, None] * s_oh + o_d[None, :]
        tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_o)


@triton.jit
def _decode_reduce_kernel(
    o_part_ptr,  # [B, Hq, S, D] fp32 normalized partials
    lse_ptr,  # [B, Hq, S] fp32 log2-sum-exp
    lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D]
    s_ob, s_oh,
    chunk,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits rounded up to a power of two
):
    i_h = tl.program_id(0)
    i_b = tl.program_id(1)
    seq_len = tl.load(lens_ptr + i_b)
    n_valid = tl.minimum(tl.cdiv(seq_len, chunk), num_splits)  # splits that wrote something
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_s = o_s < n_valid
    m_d = o_d < HEAD_DIM
    row = (i_b.to(tl.int64) * tl.num_programs(0) + i_h) * num_splits + o_s  # [BLOCK_S]
    b_lse = tl.load(lse_ptr + row, mask=m_s, other=float("-inf"))
    b_max = tl.max(b_lse, 0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)  # an empty sequence: no valid split
    b_w = tl.where(m_s, tl.exp2(b_lse - b_max), 0.0)  # [BLOCK_S]
    b_o = tl.load(o_part_ptr + row[:, None] * HEAD_DIM + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
    b_wsum = tl.sum(b_w, 0)
    b_out = tl.sum(b_w[:, None] * b_o, 0) / tl.where(b_wsum > 0, b_wsum, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + i_b.to(tl.int64) * s_ob + i_h * s_oh + o_d, b_out.to(out_ptr.dtype.element_ty), mask=m_d)


def _stride_split(stride: int) -> tuple[int, int]:
    """``(stride // f, f)`` with ``f = common.pow2_divisor(stride)``: the kernel multiplies ``f`` back as a
    constexpr, so the alignment it implies stays visible to Triton's vectorizer."""
    f = common.pow2_divisor(stride)
    return stride // f, f


def _cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` in plain Python (triton's goes through a constexpr-function wrapper: ~1 us a call)."""
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for ``n >= 1`` in plain Python."""
    return 1 << (n - 1).bit_length()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 0


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_config(
    batch: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_seq_len: int,
    *,
    mean_seq_len: float | None = None,
    kv_dtype: torch.dtype = torch.float16,
    num_sms: int = 0,
    layout: Layout | str = Layout.NHD,
) -> dict:
    """Launch parameters for :func:`paged_decode`, chosen from the problem's shape.

    Rules on a GPU (``num_sms > 0``), from H200 measurements and the compiled kernels'
    shared memory (docs/decode_tuning.md):

    - ``use_dot``: always tensor cores; the G query heads of a kv head are padded to 16 rows,
      which costs nothing in a memory-bound kernel (broadcast-multiply + sum ran 2-30x slower,
      even for MHA).
    - ``BLOCK_N``: the power of two giving about 8 KB of K per tile (32 tokens of fp16 at
      head_dim 128, 64 of fp8, 16 of fp32).
    - ``num_stages`` 4: three K/V tiles in flight per program (about 53 KB of shared memory at
      fp16, four programs per SM, ~190 KB in flight per SM); 3 when a chunk has at most 16
      tiles, where a deep pipeline's prologue costs more than it hides. ``num_warps`` 4.
    - ``num_splits``: a uniform batch gets about one wave of equal programs: ``slots`` =
      SMs x programs resident per SM (from the shared memory of the stages above, 4 at fp16),
      chunk ~ ``batch * kv_heads * mean_len / slots`` tokens, so W1 (512 kv-head sequences)
      is not split and W2 (64) is split 8 ways. A ragged batch (mean < 0.9 max) takes chunks
      4x smaller: its short sequences give short programs, and many programs even the load.
      Chunks keep at least ``4 * BLOCK_N`` tokens. On the H200 one split was 3.5% faster than
      two on W1 and 8 splits 1.5% faster than 16 on W2 (docs/decode_tuning.md).

    ``block_size`` (the page size) does not change the choice, except for the vLLM layout: a
    tile may span pages or sit inside one. The seed's ``block_size = L2 / (2 * head_dim * dtype_size)``
    is a page-size rule, not a tile rule; the benchmark sweeps page sizes instead.

    - vLLM layout, 2-byte K/V, pages of at least twice the tile, tiles of under 128 bytes per value
      row (head_dim > 64): ``BLOCK_N`` doubled (64 at head_dim 128) and 3 stages. Its value rows (one channel of a page) are ``block_size`` tokens
      long, so a 32-token tile reads 64-byte pieces of them: W1 read 0.91 / 0.76 of copy bandwidth
      at 64- / 128-token pages, and 0.98 / 0.97 with 128-byte pieces, although the kernel then takes
      200 registers (2 programs per SM). Splits are chosen as for the 32-token tile. 1-byte and
      4-byte caches keep the rule above (unmeasured).

    On the CPU interpreter (``num_sms == 0``) a fixed small configuration: ``BLOCK_N`` 32,
    at most 2 splits.

    Returns:
        dict with ``BLOCK_N``, ``num_splits``, ``num_warps``, ``num_stages``, ``use_dot``.
    """
    if num_sms <= 0:
        block_n = 32
        return {"BLOCK_N": block_n, "num_splits": min(2, max(1, _cdiv(max_seq_len, block_n))),
                "num_warps": 4, "num_stages": 1, "use_dot": True}
    elem = kv_dtype.itemsize
    tile = 8192 // (elem * _next_pow2(head_dim))  # tokens in 8 KB of K
    block_n = max(16, min(128, 1 << (tile.bit_length() - 1) if tile > 0 else 16))
    max_seq_len = max(1, max_seq_len)
    mean = min(float(mean_seq_len or max_seq_len), max_seq_len)
    work = batch * num_kv_heads * mean  # token-heads to read
    smem = 3 * block_n * _next_pow2(head_dim) * elem * 2 + 6144  # 3 K+V buffers at 4 stages
    slots = num_sms * max(1, min(8, (228 << 10) // (smem + 1024)))  # programs resident at once
    target = work / slots if mean >= 0.9 * max_seq_len else work / (4 * slots)  # tokens per program
    target = max(target, 4 * block_n)
    splits = max(1, round(max_seq_len / target))
    tiles = _cdiv(_cdiv(max_seq_len, splits), block_n)  # per program
    if Layout.parse(layout) is Layout.VLLM and elem == 2 and block_n * elem < 128 and block_size >= 2 * block_n:
        # value pieces of 128 bytes, not 64 (docs/decode_tuning.md, v4)
        return {"BLOCK_N": 2 * block_n, "num_splits": splits, "num_warps": 4, "num_stages": 3, "use_dot": True}
    return {"BLOCK_N": block_n, "num_splits": splits, "num_warps": 4, "num_stages": 4 if tiles > 16 else 3,
            "use_dot": True}


def _check_inputs(q, k_cache, v_cache, layout, block_table, seq_lens, out):
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if out is not None and not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a tensor or None, got {type(out).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be a [B, Hq, D] fp16/bf16/fp32 tensor, got {getattr(q, 'dtype', type(q))} "
                         f"{tuple(getattr(q, 'shape', ()))}")
    if q.stride(2) != 1:
        raise ValueError("q must have unit stride in its last dimension")
    B, Hq, D = q.shape
    hkv, block_size = _check_batch(k_cache, v_cache, layout, block_table, seq_lens, B, Hq, q.dtype, q.device, D)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1
                            or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} with unit last stride, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return B, Hq, D, hkv, block_size


def _format_of(dtype: torch.dtype) -> formats.KVFormat:
    try:
        return formats.get(dtype)
    except ValueError:
        raise ValueError(f"k_cache dtype {dtype} is not a kv format (workbench.formats)") from None


def _cache_geometry(k_cache, v_cache, layout, q_dtype, device) -> tuple[int, int, int]:
    """``(block_size, kv heads, head_dim)`` of a K/V cache pair in ``layout``, checked against the queries'
    dtype and device."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} and {v_cache.dtype}")
    fmt = _format_of(k_cache.dtype)
    if not fmt.decodable:
        readable = sorted(n for n, f in formats.FORMATS.items() if f.decodable)
        raise ValueError(f"k_cache stores kv format {fmt.name}, which paged decode cannot read (no decode kernel); "
                         f"it reads {readable}")
    if k_cache.dtype != q_dtype and not fmt.quantized:
        raise ValueError(f"k_cache dtype must be q's ({q_dtype}) or a quantized format (fp8), got {k_cache.dtype}")
    shapes = {}
    for name, cache, kind in (("k_cache", k_cache, "k"), ("v_cache", v_cache, "v")):
        want_dim = 5 if layout is Layout.VLLM and kind == "k" else 4
        if cache.dim() != want_dim:
            raise ValueError(f"{name} must be {want_dim}-D in the {layout.value} layout, got {tuple(cache.shape)}")
        shapes[name] = tuple(to_nhd(cache[:0], layout, kind).shape[1:])  # (block_size, heads, head_dim)
        if cache.device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {cache.device}")
    if shapes["k_cache"] != shapes["v_cache"]:
        raise ValueError(f"k_cache and v_cache disagree: (block_size, heads, head_dim) {shapes['k_cache']} "
                         f"vs {shapes['v_cache']}")
    return shapes["k_cache"]


def _check_batch(k_cache, v_cache, layout, block_table, seq_lens, B, Hq, q_dtype, device, D=None):
    """The caches against the queries (``Hq`` heads of ``D``, ``D=None``: the caches'), the block table and
    lengths against the batch of ``B``. Returns ``(kv heads, block_size)``."""
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    block_size, hkv, hd = _cache_geometry(k_cache, v_cache, layout, q_dtype, device)
    if D is not None and hd != D:
        raise ValueError(f"q head_dim {D} does not match the caches' head_dim {hd}")
    if hkv == 0 or Hq % hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the caches' kv heads ({hkv})")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be int32 of shape [{B}, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32 or seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must be int32 of shape [{B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table must be on q's device {device}, got {block_table.device}")
    if seq_lens.device != device:
        raise ValueError(f"seq_lens must be on q's device {device}, got {seq_lens.device}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must have unit stride in its last dimension, got strides {block_table.stride()}")
    if B > 1 and seq_lens.stride(0) != 1:
        raise ValueError(f"seq_lens must be contiguous, got stride {seq_lens.stride(0)}")
    return hkv, block_size


def _scale_arg(name, value, device):
    """(pointer or None, float) for a k/v scale given as a float or a one-element fp32 tensor."""
    if value is None:
        return None, 1.0
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32 or value.device != device:
            raise ValueError(f"{name} must be a float or a one-element fp32 tensor on {device} (decode reads one "
                             f"scale per tensor: workbench.formats, decode_scales), got {value.dtype} "
                             f"{tuple(value.shape)} on {value.device}")
        return value.reshape(1), 1.0
    return None, float(value)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: Layout | str,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    max_seq_len: int | None = None,
    mean_seq_len: float | None = None,
    validate: bool = True,
    **launch,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V cache.

    The one-shot shortcut of :class:`~workbench.kernels.decode_plan.DecodePlan`: it plans (checks,
    launch configuration, scratch) and runs once. A model step with many layers builds the plan once and
    calls ``plan.run`` per layer instead.

    Args:
        q: ``[B, Hq, D]`` fp16/bf16/fp32 queries (one token per sequence).
        k_cache: one layer's K cache in ``layout`` (``workbench.layout``), dtype q's or fp8
            (e4m3fn / e5m2); any block stride (padded blocks are fine), unit stride inside a row.
        v_cache: the V cache, same layout and dtype.
        layout: ``"nhd"``, ``"hnd"`` or ``"vllm"``.
        block_table: ``[B, max_blocks]`` int32, physical block of each logical block.
        seq_lens: ``[B]`` int32 context lengths (ragged; 0 gives zeros).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        num_splits: split-KV chunks per sequence; ``None`` asks :func:`decode_config`.
        out: optional ``[B, Hq, D]`` output buffer (q's dtype).
        k_scale, v_scale: dequantization scales (read = stored * scale), floats or one-element
            fp32 tensors (no host sync); default 1.
        max_seq_len: ``max(seq_lens)`` if the caller knows it. Without it the wrapper reads
            ``seq_lens`` on the host (a device sync, not allowed inside CUDA-graph capture) and
            also checks the lengths against the block table (and takes their mean).
        mean_seq_len: mean of ``seq_lens``, a hint for the split heuristic (ragged batches).
        validate: check every block id a sequence uses (the first ``ceil(seq_lens[b] / block_size)``
            entries of row ``b``; later ones are padding, never read) lies in ``[0, num_blocks)`` and the
            lengths in ``[0, max_blocks * block_size]``
            (:func:`~workbench.kernels.validate.check_block_table`): one reduction and one device sync,
            shared with the read of ``seq_lens`` when ``max_seq_len`` is None. Skipped while a CUDA graph is
            being captured. Benchmarks and graph-capture callers pass ``validate=False`` together with
            ``max_seq_len``: then the call does no device work besides the kernels. The kernel trusts the
            table: an out-of-range id reads outside the cache.
        **launch: overrides of :func:`decode_config`: ``BLOCK_N``, ``num_warps``, ``num_stages``,
            ``use_dot``; and ``k3d`` (default True): the vLLM split key read in page runs (see
            ``_attend_tile``), False reads ``[BLOCK_N, D]`` tiles (lanes along d, slower).

    Returns:
        ``[B, Hq, D]`` in q's dtype.
    """
    from .decode_plan import DecodePlan

    layout = Layout.parse(layout)
    B, Hq, D, hkv, block_size = _check_inputs(q, k_cache, v_cache, layout, block_table, seq_lens, out)
    key = None
    if max_seq_len is not None and not (validate and not capturing(q)):
        # nothing to read on the device: the plan depends on metadata only, so it is cached on it (the table and
        # lengths by address: the cached plan keeps them alive, so an address names the same memory)
        key = (layout, q.dtype, q.device, B, Hq, k_cache.dtype, tuple(k_cache.shape), k_cache.stride(),
               tuple(v_cache.shape), v_cache.stride(), block_table.data_ptr(), tuple(block_table.shape),
               block_table.stride(0), seq_lens.data_ptr(), max_seq_len, _mean_key(mean_seq_len), num_splits,
               _scale_key(k_scale), _scale_key(v_scale), sm_scale, tuple(sorted(launch.items())) if launch else ())
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan._launch(q, k_cache, v_cache, out, fresh_scratch=True)
    plan = DecodePlan._checked(layout, block_table, seq_lens, k_cache, v_cache, B, Hq, D, hkv, block_size, q.dtype,
                               q.device, max_seq_len, mean_seq_len, num_splits, k_scale, v_scale, sm_scale, validate,
                               launch, scratch=False)
    if key is not None:
        _PLANS[key] = plan
        if len(_PLANS) > _PLANS_MAX:
            _PLANS.popitem(last=False)
    return plan._launch(q, k_cache, v_cache, out, fresh_scratch=True)


_PLANS: OrderedDict = OrderedDict()  # paged_decode's plans without device reads, least recently used first
_PLANS_MAX = 64


def _mean_key(mean: float | None) -> int | None:
    """The split heuristic's mean length as it is used (an integer, see ``_launch_params``): a cache key."""
    return None if mean is None else max(1, round(float(mean)))


def _scale_key(value):
    return ("ptr", value.data_ptr(), value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else value


def _interpreted() -> bool:
    from workbench.backend import is_interpreted

    return is_interpreted()


class _Geometry(NamedTuple):
    """What a launch derives from shapes, strides and the launch configuration (cached per geometry)."""

    block_d: int
    k_strides: tuple
    v_strides: tuple
    constexprs: dict


def _launch_params(layout, B, Hq, D, hkv, block_size, q_dtype, k_cache, v_cache, max_seq_len, mean_seq_len,
                   num_splits, launch, interp, num_sms):
    """``(splits, chunk, geometry)`` of one launch. The split heuristic (:func:`decode_config`, plain arithmetic)
    runs every time, on ``mean_seq_len`` rounded to a whole token (so no float is ever a cache key); the stride and
    constexpr arithmetic is cached on integers only (shapes, strides, dtypes and the chosen configuration)."""
    # the mean as a whole number of tokens: plans cached on it (paged_decode's) give the same split as fresh ones
    cfg = decode_config(B, hkv, Hq // hkv, D, block_size, max(max_seq_len, 1), mean_seq_len=_mean_key(mean_seq_len),
                        kv_dtype=k_cache.dtype, num_sms=num_sms, layout=layout)
    cfg.update(launch)
    if num_splits is not None:
        if int(num_splits) < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        cfg["num_splits"] = int(num_splits)
    block_n = int(cfg["BLOCK_N"])
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"BLOCK_N must be a power of two >= 16, got {block_n}")
    chunk = _cdiv(_cdiv(max(max_seq_len, 1), cfg["num_splits"]), block_n) * block_n
    splits = max(1, _cdiv(max_seq_len, chunk))  # no split starts past the longest sequence
    geo = _launch_plan(layout, Hq, D, hkv, block_size, q_dtype, k_cache.dtype, tuple(k_cache.shape), k_cache.stride(),
                       tuple(v_cache.shape), v_cache.stride(), block_n, bool(cfg["use_dot"]), bool(cfg.get("k3d", True)),
                       int(cfg["num_warps"]), int(cfg["num_stages"]), interp)
    return splits, chunk, geo


@functools.lru_cache(maxsize=512)
def _launch_plan(layout, Hq, D, hkv, block_size, q_dtype, kv_dtype, k_shape, k_stride, v_shape, v_stride,
                 block_n, use_dot, k3d_ok, num_warps, num_stages, interp) -> _Geometry:
    """The stride arithmetic and constexprs of one geometry and configuration: computed once, then a dict
    lookup per plan (integers only in the key: the same across decode steps)."""
    k_cache = torch.empty_strided(k_shape, k_stride, dtype=kv_dtype, device="meta")
    v_cache = torch.empty_strided(v_shape, v_stride, dtype=kv_dtype, device="meta")
    group = Hq // hkv
    ka = addressing(k_cache, layout, "k")
    va = addressing(v_cache, layout, "v")
    v_trans = layout is Layout.VLLM
    if block_size == 1:  # the token stride of a size-1 dim is arbitrary (torch keeps the source's)
        ka, va = ka._replace(s_tok=0), va._replace(s_tok=1 if v_trans else 0)
    if ka.s_d != 1 or (va.s_tok if v_trans else va.s_d) != 1:
        raise ValueError("k_cache/v_cache rows must be contiguous (unit stride in the last dimension)")
    # every stride split into (stride / f, f) with f its power-of-two factor, f a constexpr
    k_split = [_stride_split(s) for s in (ka.s_blk, ka.s_tok, ka.s_head, ka.s_dgrp)]
    v_split = [_stride_split(s) for s in (va.s_blk, va.s_tok, va.s_head, va.s_d if v_trans else 1)]
    k_strides, k_mult = [s for s, _ in k_split], [f for _, f in k_split]
    v_strides, v_mult = [s for s, _ in v_split], [f for _, f in v_split]
    block_d = _next_pow2(D)
    kx = ka.x if layout is Layout.VLLM else block_d
    # [D // x, pages, run] key tiles need a page's x-chunks back to back and whole pages or whole tiles
    k3d = (k3d_ok and layout is Layout.VLLM and use_dot and (block_size == 1 or ka.s_tok == kx)
           and (block_size % block_n == 0 or block_n % block_size == 0))
    g_pad = max(16, _next_pow2(group)) if use_dot else _next_pow2(group)
    constexprs = dict(
        G=group, G_PAD=g_pad, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_N=block_n, PAGE=block_size, KX=kx,
        V_TRANS=v_trans, USE_DOT=use_dot, IEEE=q_dtype == torch.float32 or (interp and q_dtype == torch.bfloat16),
        K_BM=k_mult[0], K_TM=k_mult[1], K_HM=k_mult[2], K_GM=k_mult[3],
        V_BM=v_mult[0], V_TM=v_mult[1], V_HM=v_mult[2], V_DM=v_mult[3],
        V_ALIGN=min(v_mult[0], v_mult[3]), ASM=not interp, K3D=k3d,
        num_warps=num_warps, num_stages=num_stages,
    )
    return _Geometry(block_d, tuple(k_strides), tuple(v_strides), constexprs)
