"""Quest page selection with a row's scores counted by many programs: the table of :mod:`.select`, bit for bit, in
one launch that uses the GPU when the batch is small.

:func:`~workbench.kernels.quest.quest_select`'s one-program kernel runs ``B`` programs: at batch 8 it leaves 124 of an
H200's 132 SMs idle while each program walks its row through up to eight serial radix passes. This kernel splits a
row of ``W`` pages over ``ceil(W / BLOCK_S)`` programs (grid ``(B, P)``). Each program turns its slice's scores into
the same order-preserving int32 keys and counts them, with global atomics, in two histograms of the row: by the top
8 key bits (256 bins) and by the top 16 (65536 bins). The row's last program to finish (an atomic ticket, acquire /
release; no program ever waits for another, so nothing spins and the interpreter runs it too) reads the 256 coarse
bins, then the 256 fine bins under the chosen coarse one: that is the 16-bit bucket holding the budget-th largest
key, and the count of keys above it. Only that bucket's keys, compacted to a scratch row (in registers when they fit
one tile), go through the remaining radix passes (16 bits, 4 a pass), and the one-program kernel's prefix-sum emit
then writes the table and the lengths: the same threshold and tie rule, so the same table.

The scratch (histograms, tickets) is the caller's, zero before a launch, and the launch leaves it zero: the last
program clears the bins its row's keys touched and its ticket. A plan owns it, so runs of one plan must be ordered
(one stream), as the layers of a step are. :func:`split_select` says when this kernel is the one to use: a few long
rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import common
from .select import INT_MAX, _emit_tile, _emit_tiles, _finish_row, _page_keys, _radix_step

FINE_BINS = 65536  # the row histogram of the top 16 key bits (256 KiB of int32 a sequence)
COARSE_BINS = 256  # the row histogram of the top 8 key bits


@triton.jit
def _split_select_kernel(
    sc_ptr,  # [B, W] fp32 page scores (padding past a sequence's pages is not read; forced pages +inf)
    bt_ptr,  # [B, W] int32 block table
    lens_ptr,  # [B] int32 context lengths
    out_bt_ptr,  # [B, K] int32 compacted table: the chosen pages' blocks in page order, then the first block
    out_lens_ptr,  # [B] int32 lengths over the compacted table
    h8_ptr,  # [B, 256] int32 scratch, zero: each row's keys by their top 8 bits
    h16_ptr,  # [B, 65536] int32 scratch, zero: each row's keys by their top 16 bits
    done_ptr,  # [B] int32 scratch, zero: each row's programs done (the ticket)
    cand_ptr,  # [B, W] int32 scratch: the keys of a row's 16-bit bucket, compacted
    W,  # table width (pages per row)
    K,  # pages chosen per sequence (min(page_budget, W))
    s_sc, s_bt, s_obt,  # row strides
    PAGE: tl.constexpr,  # tokens per page
    BLOCK_S: tl.constexpr,  # pages counted per program (a power of two)
    BLOCK_W: tl.constexpr,  # pages per tile of the last program's passes over the row (a power of two, < 2**15)
    ONE_TILE: tl.constexpr,  # W <= BLOCK_W: the row's keys stay in registers across the last program's passes
    BLOCK_C: tl.constexpr,  # candidate keys per tile of the radix passes (a power of two)
    RADIX: tl.constexpr,  # key bits resolved per pass below the 16-bit bucket (2 or 4)
):
    i_b = tl.program_id(0)
    i_s = tl.program_id(1)
    seq_len = tl.load(lens_ptr + i_b)
    n_pages = tl.cdiv(seq_len, PAGE)
    n_valid = tl.minimum(n_pages, W)
    sc_row = sc_ptr + i_b.to(tl.int64) * s_sc
    h8_row = h8_ptr + i_b.to(tl.int64) * 256
    h16_row = h16_ptr + i_b.to(tl.int64) * 65536
    o_8 = tl.arange(0, 256)
    # this program's slice, counted: scattered atomics into the fine bins, a local histogram into the coarse ones
    # (all of a row's keys may share one coarse bin: one atomic per bin and program, not per key)
    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    m_s = o_s < n_valid
    b_fine = (_page_keys(sc_row, o_s, n_valid) >> 16) + 32768  # [BLOCK_S] in [0, 65536)
    tl.atomic_add(h16_row + b_fine, 1, mask=m_s, sem="relaxed")
    b_h8 = tl.histogram(b_fine >> 8, 256, mask=m_s)
    tl.atomic_add(h8_row + o_8, b_h8, mask=b_h8 > 0, sem="relaxed")
    tl.debug_barrier()  # every thread's atomics before the ticket, whose release orders them for the last program
    ticket = tl.atomic_add(done_ptr + i_b, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(1) - 1:  # the row's last program: every count is in
        kk = tl.minimum(K, n_valid)  # pages this sequence keeps
        # the coarse bin holding the kk-th largest key: n_ge keys in bins >= each bin (a prefix of them >= kk)
        b_h8 = tl.load(h8_row + o_8, cache_modifier=".cg")
        b_ge8 = tl.sum(b_h8, 0) - tl.cumsum(b_h8, 0) + b_h8
        m_ok8 = b_ge8 >= kk
        d8 = tl.sum(m_ok8.to(tl.int32), 0) - 1
        n_hi = tl.max(tl.where(m_ok8, 0, b_ge8), 0)  # keys in the bins above it
        # the fine bin under it
        b_h16 = tl.load(h16_row + d8 * 256 + o_8, cache_modifier=".cg")
        b_ge16 = n_hi + tl.sum(b_h16, 0) - tl.cumsum(b_h16, 0) + b_h16
        m_ok16 = b_ge16 >= kk
        d16 = d8 * 256 + tl.sum(m_ok16.to(tl.int32), 0) - 1
        n_ge = tl.min(tl.where(m_ok16, b_ge16, INT_MAX), 0)
        n_hi = tl.maximum(n_hi, tl.max(tl.where(m_ok16, 0, b_ge16), 0))
        # the bucket [t_lo, t_hi] of keys sharing the top 16 bits: n_ge keys >= t_lo (>= kk), n_hi > t_hi (< kk)
        t_lo = (d16 - 32768) << 16
        t_hi = t_lo + 0xFFFF
        tl.debug_barrier()  # the bins read before they are cleared
        # one pass over the row: its fine bins back to zero; the bucket's keys compacted to the scratch row
        cand_row = cand_ptr + i_b.to(tl.int64) * W
        o_w = tl.arange(0, BLOCK_W)
        if ONE_TILE:
            b_key = _page_keys(sc_row, o_w, n_valid)  # [BLOCK_W]
            m_w = o_w < n_valid
            tl.store(h16_row + (b_key >> 16) + 32768, tl.zeros([BLOCK_W], dtype=tl.int32), mask=m_w)
            if n_ge > kk:  # the bucket is not all chosen: its keys go on to the passes below
                m_c = m_w & (b_key >= t_lo) & (b_key <= t_hi)
                tl.store(cand_row + tl.cumsum(m_c.to(tl.int32), 0) - 1, b_key, mask=m_c)
        else:
            n_c = tl.zeros([], dtype=tl.int32)
            for i_t in range(0, tl.cdiv(n_valid, BLOCK_W)):
                o_t = i_t * BLOCK_W + o_w
                b_kt = _page_keys(sc_row, o_t, n_valid)
                m_t = o_t < n_valid
                tl.store(h16_row + (b_kt >> 16) + 32768, tl.zeros([BLOCK_W], dtype=tl.int32), mask=m_t)
                if n_ge > kk:
                    m_c = m_t & (b_kt >= t_lo) & (b_kt <= t_hi)
                    tl.store(cand_row + n_c + tl.cumsum(m_c.to(tl.int32), 0) - 1, b_kt, mask=m_c)
                    n_c += tl.sum(m_c.to(tl.int32), 0)
        tl.store(h8_row + o_8, tl.zeros([256], dtype=tl.int32))
        tl.store(done_ptr + i_b, 0)
        tl.debug_barrier()  # the candidates written before any thread reads them
        # the radix search of select.py over the bucket's keys only, from bit 15 down (the same invariant: the
        # bucket holds the kk-th largest key; it stops once exactly kk keys are >= t_lo)
        n_cand = n_ge - n_hi
        n_out = n_hi  # keys above the 16-bit bucket: every count below is theirs plus the candidates'
        o_c = tl.arange(0, BLOCK_C)
        shift = tl.full([], 16 - RADIX, tl.int32)
        if n_cand <= BLOCK_C:  # one tile (the usual case): the candidates stay in registers across the passes
            m_c1 = o_c < n_cand
            b_c1 = tl.load(cand_row + o_c, mask=m_c1, other=0)
            while (n_ge > kk) & (shift >= 0):
                b_cand = t_lo + (tl.arange(0, 2**RADIX) << shift)  # [2**RADIX] inside the bucket: no wrap
                b_cnt = n_out + tl.sum(((b_c1[None, :] >= b_cand[:, None]) & m_c1[None, :]).to(tl.int32), 1)
                n_ge, n_hi, t_lo, t_hi = _radix_step(b_cnt, kk, n_hi, t_lo, shift)
                shift -= RADIX
        else:
            while (n_ge > kk) & (shift >= 0):
                b_cand = t_lo + (tl.arange(0, 2**RADIX) << shift)
                b_cnt = tl.zeros([2**RADIX], dtype=tl.int32) + n_out
                for i_t in range(0, tl.cdiv(n_cand, BLOCK_C)):
                    o_t = i_t * BLOCK_C + o_c
                    m_t = o_t < n_cand
                    b_ck = tl.load(cand_row + o_t, mask=m_t, other=0)
                    b_cnt += tl.sum(((b_ck[None, :] >= b_cand[:, None]) & m_t[None, :]).to(tl.int32), 1)
                n_ge, n_hi, t_lo, t_hi = _radix_step(b_cnt, kk, n_hi, t_lo, shift)
                shift -= RADIX
        # the emit of select.py: the chosen pages in page order, the padding, the new length
        need = kk - n_hi
        last_page = n_pages - 1
        bt_row = bt_ptr + i_b.to(tl.int64) * s_bt
        out_row = out_bt_ptr + i_b.to(tl.int64) * s_obt
        n_above = tl.zeros([], dtype=tl.int32)
        n_bucket = tl.zeros([], dtype=tl.int32)
        if ONE_TILE:  # the keys still in registers
            _, _, has_last = _emit_tile(b_key, o_w, o_w < n_valid, t_lo, t_hi, need, n_above, n_bucket, bt_row,
                                        out_row, last_page)
        else:
            has_last = _emit_tiles(sc_row, bt_row, out_row, o_w, n_valid, t_lo, t_hi, need, last_page, BLOCK_W)
        _finish_row(bt_row, out_row, out_lens_ptr, i_b, o_w, kk, K, seq_len, n_pages, has_last, PAGE, BLOCK_W)


def split_select(batch: int, width: int, num_sms: int) -> bool:
    """Whether a select of ``batch`` rows of ``width`` pages takes the multi-program kernel on a GPU of ``num_sms``
    SMs (0: unknown, as under the interpreter: the one-program kernel).

    The one-program kernel's time is one row's serial radix passes (up to eight over the whole row), whatever the
    batch: short rows make them short. The multi-program kernel spreads the counting over the GPU and leaves each
    row's last program two histogram reads, the passes over one 16-bit bucket's keys and the emit; its atomics and
    scratch grow with the batch's pages. On an H100 (the two kernels alone in a CUDA graph, scores like ``bench
    quest``'s, a budget of 1/16 of the row, 2026-12-05: the sweep its ``select_rule`` rows now run) it was 1.1-1.4x
    faster from 1024 pages a row up to about 1024 pages a SM in all
    (8 x 2048: 15.1 -> 11.3 us in a CUDA graph; 1 x 8192: 38.2 -> 30.0; 32 x 4096: 22.9 -> 20.4) and slower at 512
    pages a row (7.9 -> 8.9 us at batch 8) and past that total (32 x 8192: 38.3 -> 43.1; 128 x 2048: 16.8 -> 19.1).
    So: multi-program for rows of 1024+ pages while ``batch * width <= 1024 * num_sms``."""
    return num_sms > 0 and width >= 1024 and batch * width <= 1024 * num_sms


def _split_config(B: int, W: int, page_size: int, num_sms: int, block_s: int | None = None,
                  block_w: int | None = None, block_c: int | None = None, num_warps: int | None = None,
                  radix: int = 4, prefix: str = "") -> tuple[tuple[int, int], dict]:
    """``(grid, constexprs and warps)`` of the multi-program kernel: slices of 64 to 1024 pages, as many programs
    as SMs for the whole batch (``B * P ~ num_sms``); the last program's row tiles as the one-program kernel's, and
    candidate tiles of 256 keys (a 16-bit bucket of a 32k-token row holds tens to a few hundred); 4 warps.
    ``prefix``: of the argument names errors give (a plan's ``select_block_s``, ``select_warps``, ...)."""
    if radix not in (2, 4):
        raise ValueError(f"{prefix}radix must be 2 or 4 key bits a pass, got {radix!r}")
    for name, v in ((prefix + "block_s", block_s), ("block_w", block_w), ("block_c", block_c)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1) or v >= 2**15):
            raise ValueError(f"{name} must be a power of two in [16, 2**15), got {v!r}")
    if num_warps is not None and (isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8, 16)):
        raise ValueError(f"{prefix + 'warps' if prefix else 'num_warps'} must be 1, 2, 4, 8 or 16, got {num_warps!r}")
    if block_s is None:
        block_s = min(1024, max(64, common.next_pow2(max(1, -(-B * W // max(num_sms, 1))))))
    if block_w is None:
        block_w = min(2048, max(16, common.next_pow2(max(W, 1))))
    if block_c is None:
        block_c = min(512, block_w)
    ce = dict(PAGE=page_size, BLOCK_S=block_s, BLOCK_W=block_w, ONE_TILE=W <= block_w, BLOCK_C=block_c, RADIX=radix,
              num_warps=8 if num_warps is None else num_warps)
    return (B, -(-W // block_s)), ce


def split_scratch(B: int, W: int, device) -> tuple[torch.Tensor, ...]:
    """The multi-program kernel's scratch for ``B`` rows of ``W`` pages, zero: ``(coarse [B, 256], fine [B, 65536],
    tickets [B], candidates [B, W])`` int32 (each launch leaves the first three zero again)."""
    z = dict(dtype=torch.int32, device=device)
    return (torch.zeros((B, COARSE_BINS), **z), torch.zeros((B, FINE_BINS), **z), torch.zeros((B,), **z),
            torch.empty((B, max(W, 1)), **z))
