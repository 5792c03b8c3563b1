"""Quest page selection: the top ``page_budget`` pages of every sequence and the compacted block table, in one launch.

The one-program kernel (:func:`~.api.quest_select` chooses it or :mod:`.select_split`'s) runs one program per
sequence: a radix search over order-preserving int32 keys of the scores (:mod:`.scores`) finds the budget-th largest, a prefix sum places the chosen pages in page order, their block ids and
the new lengths are written (every chosen page full but the sequence's last, which keeps its partial length). Ties go
to the lower page index, as in the reference (``workbench.compress.page_selection.select_pages``), so the tables match bit for
bit. No host sync anywhere: the tables feed :class:`~workbench.kernels.decode.DecodePlan` built once on these buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.core.backend import is_interpreted

from .. import common

INT_MIN = tl.constexpr(-(2**31))  # a padding lane's key: below every score's (-inf's is -2139095041)
INT_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _page_keys(sc_row, o_w, n_valid):
    """``[BLOCK_W]`` int32 keys of the page scores at ``o_w``, ordered as the scores: NaN counts as ``+inf`` (keep),
    ``-0.0`` as ``+0.0`` (equal scores, equal keys), the lanes past ``n_valid`` (padding) ``INT_MIN``."""
    m_w = o_w < n_valid
    b_s = tl.load(sc_row + o_w, mask=m_w, other=0.0)
    b_s = tl.where(b_s != b_s, float("inf"), b_s)
    b_s = tl.where(b_s == 0.0, 0.0, b_s)
    b_bits = b_s.to(tl.int32, bitcast=True)
    b_key = tl.where(b_bits < 0, b_bits ^ INT_MAX, b_bits)  # negatives: larger magnitude, smaller key
    return tl.where(m_w, b_key, INT_MIN)


@triton.jit
def _radix_step(b_cnt, kk, n_hi, t_lo, shift):
    """One pass of the radix search: ``b_cnt`` keys >= each candidate ``t_lo + (i << shift)``
    (falling with i; the first >= kk) narrows the bucket to the last candidate still counting kk. Returns ``(n_ge,
    n_hi, t_lo, t_hi)``: keys >= the new ``t_lo``, keys above the new ``t_hi``, the bucket."""
    m_ok = b_cnt >= kk
    d = tl.sum(m_ok.to(tl.int32), 0) - 1
    n_ge = tl.min(tl.where(m_ok, b_cnt, INT_MAX), 0)
    n_hi = tl.maximum(n_hi, tl.max(tl.where(m_ok, 0, b_cnt), 0))
    t_lo = t_lo + (d << shift)
    return n_ge, n_hi, t_lo, t_lo + ((1 << shift) - 1)


@triton.jit
def _emit_tile(b_key, o_w, m_w, t_lo, t_hi, need, n_above, n_bucket, bt_row, out_row, last_page):
    """Write the chosen pages of one tile of keys to the compacted row, in page order. A page is chosen when its key
    is above the bucket ``[t_lo, t_hi]`` or it is one of the bucket's first ``need`` pages (lowest index first);
    ``n_above`` / ``n_bucket``: pages of each kind in the tiles before. Returns the updated counts and whether the
    sequence's last page is in this tile's choice."""
    m_above = m_w & (b_key > t_hi)
    m_bucket = m_w & (b_key >= t_lo) & (b_key <= t_hi)
    # one scan for both prefix counts: above in the low 16 bits, bucket in the high ones (a tile < 2**15 pages)
    b_cnt = tl.cumsum(m_above.to(tl.int32) + (m_bucket.to(tl.int32) << 16), 0)  # [BLOCK_W] inclusive
    b_above = n_above + (b_cnt & 0xFFFF)
    b_bucket = n_bucket + (b_cnt >> 16)
    m_sel = m_above | (m_bucket & (b_bucket <= need))
    b_pos = b_above + tl.minimum(b_bucket, need) - 1  # [BLOCK_W] this page's place in the compacted row
    b_blk = tl.load(bt_row + o_w, mask=m_sel, other=0)
    tl.store(out_row + b_pos, b_blk, mask=m_sel)
    n_tot = tl.sum(m_above.to(tl.int32) + (m_bucket.to(tl.int32) << 16), 0)
    has_last = tl.sum((m_sel & (o_w == last_page)).to(tl.int32), 0) > 0
    return n_above + (n_tot & 0xFFFF), n_bucket + (n_tot >> 16), has_last


@triton.jit
def _emit_tiles(sc_row, bt_row, out_row, o_w, n_valid, t_lo, t_hi, need, last_page, BLOCK_W: tl.constexpr):
    """:func:`_emit_tile` over a row's tiles, its keys read again from the scores; whether the sequence's last page
    was chosen."""
    n_above = tl.zeros([], dtype=tl.int32)
    n_bucket = tl.zeros([], dtype=tl.int32)
    has_last = n_valid < 0
    for i_t in range(0, tl.cdiv(n_valid, BLOCK_W)):
        o_t = i_t * BLOCK_W + o_w
        n_above, n_bucket, h = _emit_tile(_page_keys(sc_row, o_t, n_valid), o_t, o_t < n_valid, t_lo, t_hi, need,
                                          n_above, n_bucket, bt_row, out_row, last_page)
        has_last = has_last | h
    return has_last


@triton.jit
def _finish_row(bt_row, out_row, out_lens_ptr, i_b, o_w, kk, K, seq_len, n_pages, has_last, PAGE: tl.constexpr,
                BLOCK_W: tl.constexpr):
    """The compacted row's padding past its ``kk`` chosen pages (the sequence's first block, never read) and its
    length (every chosen page full but the sequence's last, if chosen)."""
    first = tl.load(bt_row)
    for i_t in range(0, tl.cdiv(K, BLOCK_W)):
        o_t = i_t * BLOCK_W + o_w
        tl.store(out_row + o_t, tl.zeros([BLOCK_W], dtype=tl.int32) + first, mask=(o_t >= kk) & (o_t < K))
    last_len = seq_len - (n_pages - 1) * PAGE  # 1..PAGE tokens in the sequence's last page
    new_len = kk * PAGE - tl.where(has_last, PAGE - last_len, 0)
    tl.store(out_lens_ptr + i_b, tl.where(seq_len > 0, new_len, 0))


@triton.jit
def _select_pages_kernel(
    sc_ptr,  # [B, W] fp32 page scores (padding past a sequence's pages is not read; forced pages +inf)
    bt_ptr,  # [B, W] int32 block table
    lens_ptr,  # [B] int32 context lengths
    out_bt_ptr,  # [B, K] int32 compacted table: the chosen pages' blocks in page order, then the first block
    out_lens_ptr,  # [B] int32 lengths over the compacted table
    W,  # table width (pages per row)
    K,  # pages chosen per sequence (min(page_budget, W))
    s_sc, s_bt, s_obt,  # row strides
    PAGE: tl.constexpr,  # tokens per page
    BLOCK_W: tl.constexpr,  # pages per tile (a power of two, < 2**15)
    ONE_TILE: tl.constexpr,  # W <= BLOCK_W: the row's keys stay in registers across the passes
    RADIX: tl.constexpr,  # key bits resolved per pass (2**RADIX candidates counted at once)
):
    i_b = tl.program_id(0)
    seq_len = tl.load(lens_ptr + i_b)
    n_pages = tl.cdiv(seq_len, PAGE)
    n_valid = tl.minimum(n_pages, W)
    kk = tl.minimum(K, n_valid)  # pages this sequence keeps
    sc_row = sc_ptr + i_b.to(tl.int64) * s_sc
    bt_row = bt_ptr + i_b.to(tl.int64) * s_bt
    out_row = out_bt_ptr + i_b.to(tl.int64) * s_obt
    o_w = tl.arange(0, BLOCK_W)
    o_r = tl.arange(0, 2**RADIX)
    n_tiles = tl.cdiv(n_valid, BLOCK_W)
    n_pad = n_tiles * BLOCK_W - n_valid  # padding lanes of the tiles read (key INT_MIN)
    if ONE_TILE:
        n_pad = BLOCK_W - n_valid
        b_key = _page_keys(sc_row, o_w, n_valid)  # [BLOCK_W]
    # radix search for the kk-th largest key, RADIX bits a pass from the top. Invariant: the bucket [t_lo, t_hi]
    # holds the kk-th largest key; n_ge keys are >= t_lo (>= kk), n_hi keys > t_hi (< kk). It stops early once
    # exactly kk keys are >= t_lo (then the whole bucket is chosen), after 32 / RADIX passes at most (then the
    # bucket is one key value: ties, the lowest pages first).
    t_lo = tl.full([], INT_MIN, tl.int32)
    t_hi = tl.full([], INT_MAX, tl.int32)
    n_ge = n_valid
    n_hi = tl.zeros([], dtype=tl.int32)
    shift = tl.full([], 32 - RADIX, tl.int32)
    while (n_ge > kk) & (shift >= 0):
        # [2**RADIX] each candidate's true value lies in [t_lo, t_hi] (int32); in the first pass o_r << shift wraps,
        # and the two's complement sum is still that value (no nsw: Triton's adds wrap, as numpy's)
        b_cand = t_lo + (o_r << shift)
        # [2**RADIX] keys >= each candidate: one reduction of a [2**RADIX, BLOCK_W] comparison for all of them
        if ONE_TILE:
            b_cnt = tl.sum((b_key[None, :] >= b_cand[:, None]).to(tl.int32), 1)
        else:
            b_cnt = tl.zeros([2**RADIX], dtype=tl.int32)
            for i_t in range(0, n_tiles):
                b_kt = _page_keys(sc_row, i_t * BLOCK_W + o_w, n_valid)
                b_cnt += tl.sum((b_kt[None, :] >= b_cand[:, None]).to(tl.int32), 1)
        b_cnt -= tl.where((o_r == 0) & (t_lo == INT_MIN), n_pad, 0)  # padding lanes pass only the INT_MIN candidate
        n_ge, n_hi, t_lo, t_hi = _radix_step(b_cnt, kk, n_hi, t_lo, shift)  # counts fall as the candidate grows
        shift -= RADIX
    need = kk - n_hi  # bucket pages to take (all of it when the search stopped early)
    last_page = n_pages - 1
    n_above = tl.zeros([], dtype=tl.int32)
    n_bucket = tl.zeros([], dtype=tl.int32)
    if ONE_TILE:
        _, _, has_last = _emit_tile(b_key, o_w, o_w < n_valid, t_lo, t_hi, need, n_above, n_bucket, bt_row,
                                    out_row, last_page)
    else:
        has_last = _emit_tiles(sc_row, bt_row, out_row, o_w, n_valid, t_lo, t_hi, need, last_page, BLOCK_W)
    _finish_row(bt_row, out_row, out_lens_ptr, i_b, o_w, kk, K, seq_len, n_pages, has_last, PAGE, BLOCK_W)


def _select_config(W: int, page_size: int, block_w: int | None, num_warps: int | None = None, radix: int = 4) -> dict:
    """The select kernel's constexprs and warps: the whole row in one tile up to 8192 pages (4096 under the
    interpreter), else tiles of that; 4 key bits a pass (16 candidates)."""
    if radix not in (2, 4):
        raise ValueError(f"radix must be 2 or 4 key bits a pass, got {radix!r}")
    if block_w is None:
        block_w = min(4096 if is_interpreted() else 8192, max(16, common.next_pow2(max(W, 1))))
    elif isinstance(block_w, bool) or not isinstance(block_w, int) or block_w < 16 or block_w & (block_w - 1) \
            or block_w >= 2**15:
        raise ValueError(f"block_w must be a power of two in [16, 2**15), got {block_w!r}")
    if num_warps is None:  # 64+ keys a warp, 4 warps (one a scheduler) to 16 (four: the passes are issue-bound)
        num_warps = min(16, max(4, block_w // 64))
    return dict(PAGE=page_size, BLOCK_W=block_w, ONE_TILE=W <= block_w, RADIX=radix, num_warps=num_warps)


def _check_select_inputs(block_table, seq_lens, page_budget, page_size, out_table, out_lens):
    """``(B, W, k, out_table, out_lens)`` (the buffers made when not given) after the checks."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or (block_table.shape[1] and block_table.stride(1) != 1):
        raise ValueError(f"block_table must be an int32 [B, max_blocks] tensor with unit last stride, got "
                         f"{common.describe(block_table)}")
    B, W = block_table.shape
    dev = block_table.device
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32 or seq_lens.shape != (B,) \
            or seq_lens.device != dev:
        raise ValueError(f"seq_lens must be an int32 [{B}] tensor on {dev}, got {common.describe(seq_lens)}")
    if isinstance(page_budget, bool) or not isinstance(page_budget, int) or page_budget < 1:
        raise ValueError(f"page_budget must be an int >= 1, got {page_budget!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    k = min(page_budget, W)
    out_table = common.output_buffer("out_table", out_table, (B, k), torch.int32, dev)
    out_lens = common.output_buffer("out_lens", out_lens, (B,), torch.int32, dev)
    return B, W, k, out_table, out_lens
