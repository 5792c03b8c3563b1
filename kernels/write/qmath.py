"""Arithmetic the write kernels share: slots to rows, NaN-propagating reductions, division by a row's scale at the
cost of three FMAs, integer codes as the low bits of one add.

Division (:func:`_div_rcp`): with ``r = 1 / b`` rounded to nearest (once per row, group or program), ``q = a * r``,
``e = fma(-q, b, a)`` (exact), ``q + e * r`` rounded once is ``a / b`` rounded to nearest even, IEEE's quotient
(Markstein's theorem; the GPU's own ``div.rn`` is this after its reciprocal and a range check, FCHK, whose slow
path is a call). It holds while nothing under- or overflows: callers take it where ``b >= 2**-80`` and ``a / b``
is finite, and keep ``div_rn`` on a rare path for the rest (non-finite inputs, tiny scales).

Integer codes (:func:`_int_bits`): adding ``1.5 * 2**23`` to ``y`` (``|y| < 2**22``) rounds it half to even and
leaves the integer in the low bits of the fp32 word (two's complement), so a code is that word's low byte (or
``BITS`` bits) with no convert; packed codes add their shifted words, the constant's zero low bits adding nothing.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from workbench.core.backend import is_interpreted

__all__ = ["ROUND_MAGIC", "TINY_SCALE", "block_shift", "rcp32"]

TINY_SCALE = 2.0**-80  # below it the fast division's residual could lose bits: the rare path divides
ROUND_MAGIC = 12582912.0  # 1.5 * 2**23


@triton.jit
def _max_nan(a, b):
    # in the operands' dtype: a bf16 maximum comes back fp32 (Triton 3.6), which a reduction's combine refuses
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL).to(a.dtype)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL).to(a.dtype)


if is_interpreted():  # its max/min ignore NaN (numpy's nanmax), and a combine function runs element by element

    @triton.jit
    def _rmax(b_x, AXIS: tl.constexpr, KEEP: tl.constexpr):
        n_nan = tl.sum((b_x != b_x).to(tl.int32), AXIS, keep_dims=KEEP)
        return tl.where(n_nan > 0, float("nan"), tl.max(b_x, AXIS, keep_dims=KEEP))

    @triton.jit
    def _rmin(b_x, AXIS: tl.constexpr, KEEP: tl.constexpr):
        n_nan = tl.sum((b_x != b_x).to(tl.int32), AXIS, keep_dims=KEEP)
        return tl.where(n_nan > 0, float("nan"), tl.min(b_x, AXIS, keep_dims=KEEP))

else:  # tl.max ignores NaN on the GPU (max.f32): a bad row must be seen

    @triton.jit
    def _rmax(b_x, AXIS: tl.constexpr, KEEP: tl.constexpr):
        """Max over ``AXIS``, NaN-propagating."""
        return tl.reduce(b_x, AXIS, _max_nan, keep_dims=KEEP)

    @triton.jit
    def _rmin(b_x, AXIS: tl.constexpr, KEEP: tl.constexpr):
        """Min over ``AXIS``, NaN-propagating."""
        return tl.reduce(b_x, AXIS, _min_nan, keep_dims=KEEP)


@triton.jit
def _div_rcp(b_a, b_b, b_r):
    """``a / b`` rounded as IEEE division, from ``r = 1 / b`` rounded (module docstring: where it holds), but for the
    sign of a zero: ``-0 / b`` gives ``+0`` (the residual's ``+0`` added to ``-0``), which integer codes do not see."""
    b_q = b_a * b_r
    b_e = tl.fma(b_q, -b_b, b_a)  # -b, not -q: a negated q becomes a second multiply (Triton 3.6)
    return tl.fma(b_e, b_r, b_q)


@triton.jit
def _div_rcp_signed(b_a, b_b, b_r):
    """:func:`_div_rcp` with the sign of ``a`` on the result (``b > 0``: the quotient's sign), so ``-0 / b`` is
    ``-0`` as IEEE's (an fp8 code keeps its sign bit): one more instruction (LOP3)."""
    b_y = _div_rcp(b_a, b_b, b_r).to(tl.int32, bitcast=True)
    return (b_y | (b_a.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _rcp(b_s):
    """``1 / s`` rounded to nearest (IEEE): once per row, group or program."""
    return tl.math.div_rn(tl.full(b_s.shape, 1.0, tl.float32), b_s)


@triton.jit
def _int_bits(b_y):
    """``round_half_even(y)`` in the low bits of an int32 (``|y| < 2**22``): the code is its low byte."""
    return (b_y + 12582912.0).to(tl.int32, bitcast=True)


@triton.jit
def _int_codes(b_y, QMAX: tl.constexpr):
    """Clamp to ``[0, QMAX]`` and round half to even (``|y| < 2**22``), as fp32."""
    b_y = tl.minimum(tl.maximum(b_y, 0.0, propagate_nan=tl.PropagateNan.ALL), QMAX,
                     propagate_nan=tl.PropagateNan.ALL)
    return (b_y + 12582912.0) - 12582912.0


@triton.jit
def _fp16_params(b_lo, b_hi, QMAX: tl.constexpr):
    """Group scale and zero point, saturated and rounded to fp16 as they are stored (``workbench.quant.schemes``:
    ``zero = clamp(lo, +-65504)``, ``scale = clamp((hi - zero) / QMAX, 0, 65504)``, 1 where 0); NaN stays NaN."""
    b_z = tl.minimum(tl.maximum(b_lo, -65504.0, propagate_nan=tl.PropagateNan.ALL), 65504.0,
                     propagate_nan=tl.PropagateNan.ALL)
    b_s = tl.math.div_rn(b_hi - b_z, tl.full(b_hi.shape, QMAX, tl.float32))
    b_s = tl.minimum(tl.maximum(b_s, 0.0, propagate_nan=tl.PropagateNan.ALL), 65504.0,
                     propagate_nan=tl.PropagateNan.ALL).to(tl.float16)  # <= 0 becomes 1 below
    b_s = tl.where(b_s > 0, b_s, tl.full(b_s.shape, 1.0, tl.float16))
    return b_s, b_z.to(tl.float16)


@triton.jit
def _fp16_params_fast(b_lo, b_hi, QMAX: tl.constexpr, RQ: tl.constexpr):
    """:func:`_fp16_params` with the division by ``QMAX`` as :func:`_div_rcp` by ``RQ = 1 / QMAX`` rounded (the same
    fp32 quotient where ``hi - zero`` is finite and normal; a subnormal one is below fp16's range either way)."""
    b_z = tl.minimum(tl.maximum(b_lo, -65504.0, propagate_nan=tl.PropagateNan.ALL), 65504.0,
                     propagate_nan=tl.PropagateNan.ALL)
    b_s = _div_rcp(b_hi - b_z, QMAX, RQ)
    b_s = tl.minimum(tl.maximum(b_s, 0.0, propagate_nan=tl.PropagateNan.ALL), 65504.0,
                     propagate_nan=tl.PropagateNan.ALL).to(tl.float16)  # <= 0 becomes 1 below
    b_s = tl.where(b_s > 0, b_s, tl.full(b_s.shape, 1.0, tl.float16))
    return b_s, b_z.to(tl.float16)


@triton.jit
def _slot_rows(slot_ptr, o_t, num_tokens, block_size, num_slots, SHIFT: tl.constexpr):
    """``(m_w, i_blk, i_off)`` of tokens ``o_t``: which write (in range, slot not -1 nor past the cache) and where.
    ``SHIFT``: log2 of the block size when it is a power of two (a shift, not a 64-bit division), else -1."""
    m_t = o_t < num_tokens
    b_slot = tl.load(slot_ptr + o_t, mask=m_t, other=-1).to(tl.int64)
    m_w = m_t & (b_slot >= 0) & (b_slot < num_slots)  # padding and out-of-range slots write nothing
    b_slot = tl.where(m_w, b_slot, 0)
    if SHIFT >= 0:
        i_blk = b_slot >> SHIFT
        i_off = b_slot & ((1 << SHIFT) - 1)
    else:
        i_blk = b_slot // block_size
        i_off = b_slot % block_size
    return m_w, i_blk, i_off


@triton.jit
def _columns(o_j, s_dgrp, S_D: tl.constexpr, X: tl.constexpr, DC: tl.constexpr):
    """Offsets of bytes ``o_j`` of a row in the layout (``workbench.core.layout``); no division where a row is one
    group (``X >= DC``), which keeps the stores' vectors (and the loads' layout) what the loads proved."""
    if X >= DC:
        o_col = o_j.to(tl.int64) * S_D
    else:
        o_col = (o_j // X).to(tl.int64) * s_dgrp + (o_j % X) * S_D
    return o_col


@triton.jit
def _n_nonfinite(b_x, m):
    """How many of ``b_x`` where ``m`` are NaN or Inf (a scalar int32)."""
    b_bad = (m & ((b_x != b_x) | (tl.abs(b_x) == float("inf")))).to(tl.int32)
    return tl.sum(b_bad)


@triton.jit
def _zero_nonfinite(b_x, m):
    """``(b_x with its NaN/Inf as 0 in its own dtype, how many of them lie where m)``: what a tier stores of a device
    block's unwritten slots, which must not spread through a scale (``write_kv_blocks``)."""
    b_f = b_x.to(tl.float32)  # tested in fp32: the interpreter's bf16 NaN compares equal to itself
    m_bad = (b_f != b_f) | (tl.abs(b_f) == float("inf"))
    return tl.where(m_bad, tl.zeros_like(b_x), b_x), tl.sum((m & m_bad).to(tl.int32))


# A write's source: ``[T, H, D]`` rows (``write_kv``'s key and value), or blocks of a cache read where they lie
# (``write_kv_blocks``: a tier's staged device blocks), so a transcode needs no values tensor in between. The
# ``[T, H, D]`` case keeps the expressions the kernels had before (the constexpr branches fold away).
@triton.jit
def _src_rows(o_t, i_h, s_st, s_sh, s_sblk, SRC_BS: tl.constexpr):
    """Offsets (int64) of the rows of tokens ``o_t`` (int64) of head ``i_h``: ``t * s_st`` (``SRC_BS`` 0), or slot
    ``t % SRC_BS`` of block ``t // SRC_BS`` (two strides a token: a block view's)."""
    if SRC_BS == 0:
        o_row = o_t * s_st
    else:
        o_row = (o_t // SRC_BS) * s_sblk + (o_t % SRC_BS) * s_st
    return o_row + i_h.to(tl.int64) * s_sh


@triton.jit
def _src_cols(o_c, s_sdgrp, SS_D: tl.constexpr, SX: tl.constexpr):
    """Offsets of channels ``o_c`` in a source row (a tensor, or a plane's first channel as a constexpr: planes are
    whole 16-byte groups): the channels themselves (rows, NHD and HND blocks), ``SS_D`` apart (vLLM's values: a
    block's tokens between channels) or vLLM's split key (``SX`` channels a group, groups ``s_sdgrp`` apart).
    Within one block, so small: int32 is enough."""
    if SX == 0 and SS_D == 1:
        o_col = o_c
    elif SX == 0:
        o_col = o_c * SS_D
    else:
        o_col = (o_c // SX) * s_sdgrp + (o_c % SX) * SS_D
    return o_col


def rcp32(q: float) -> float:
    """``1 / q`` rounded to the nearest fp32 (a kernel's constexpr reciprocal of ``QMAX``)."""
    return float(np.float32(1.0) / np.float32(q))


def block_shift(block_size: int) -> int:
    """``SHIFT`` of :func:`_slot_rows`: log2 of a power-of-two block size, else -1."""
    return block_size.bit_length() - 1 if block_size > 0 and not block_size & (block_size - 1) else -1

