"""A readable paged decode kernel to copy and edit: one program per (sequence, query head), one pass over the
sequence (no split), an online softmax. It is correct on every case it claims (NHD and HND layouts, fp16 / bf16 /
fp32, any block size and head dim) and about as simple as a paged kernel gets; ``kernels/decode`` is the fast one.

``mistake`` switches on one of three classic bugs, so that the conformance suite's catching them is itself tested
(``tests/test_conformance.py``) and shown (``notebooks/09_write_your_own_kernel.ipynb``):

- ``"mask"``: keys masked at the end of the sequence's last *block*, not at its length (reads the block's tail);
- ``"gqa"``: query head ``h`` reads kv head ``h % Hkv`` instead of ``h // (Hq / Hkv)``;
- ``"block"``: the block table read without the sequence's row offset, so every sequence reads sequence 0's blocks.

(A bug that reads outside the tensors is not among them: the Triton interpreter has no memory protection, so such a
kernel can crash the Python process on a CPU, and on a GPU it can leave the CUDA context unusable for later cases:
``check(..., isolate=True)`` runs the cases in a worker process that is replaced after such a crash.)
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from workbench.conformance import implementations, suite
from workbench.core.backend import is_interpreted
from workbench.core.layout import Layout, addressing, to_nhd

MISTAKES = {"none": 0, "mask": 1, "gqa": 2, "block": 3}


@triton.jit
def starter_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr,
    sm_scale, num_kv_heads,
    stride_qb, stride_qh,  # q [B, Hq, D] (unit stride along D)
    stride_kb, stride_kt, stride_kh,  # element (block, token, head, d) of K: block * stride_kb + token * ...
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_oh,
    stride_table,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (tl.arange needs one)
    TILE: tl.constexpr,  # tokens per step of the loop
    MISTAKE: tl.constexpr,
):
    b = tl.program_id(0)  # the sequence
    h = tl.program_id(1)  # the query head
    kv_head = h // GROUP
    if MISTAKE == 2:
        kv_head = h % num_kv_heads
    seq_len = tl.load(lens_ptr + b)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)

    m = tl.full((), float("-inf"), tl.float32)  # running max of the scores
    l = tl.full((), 0.0, tl.float32)  # running sum of exp(score - m)  # noqa: E741
    acc = tl.zeros((D_PAD,), dtype=tl.float32)  # running sum of exp(score - m) * v
    for start in range(0, seq_len, TILE):
        pos = start + tl.arange(0, TILE)  # token positions of this step
        valid = pos < seq_len
        if MISTAKE == 1:
            valid = pos < tl.cdiv(seq_len, BLOCK_SIZE) * BLOCK_SIZE
        row = table_ptr + b * stride_table  # this sequence's row of the block table
        if MISTAKE == 3:
            row = table_ptr
        block = tl.load(row + pos // BLOCK_SIZE, mask=valid, other=0)  # the physical block of each token
        tok = pos % BLOCK_SIZE
        ld = valid[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + tok[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=ld, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + block[:, None] * stride_vb + tok[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=ld, other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], 1) * sm_scale, float("-inf"))  # [TILE] scores
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)  # rescales what was summed under the old max
        p = tl.exp(s - m_new)
        l = l * alpha + tl.sum(p, 0)  # noqa: E741
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)  # an empty sequence (l == 0, acc == 0) gives zeros
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def default_tile() -> int:
    """Tokens per loop step: 32 compiled; 128 under the Triton interpreter, which runs a step op by op in numpy, so
    four times fewer steps check the same cases about twice as fast (the same verdicts, outputs equal to fp32
    rounding)."""
    return 128 if is_interpreted() else 32


def starter_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, out, mistake: str = "none",
                   tile: int | None = None):
    """The starter kernel's launch (the decode op's arguments, by name; see the module docstring). ``tile``: tokens
    per loop step, a power of two (default :func:`default_tile`)."""
    layout = Layout.parse(layout).value
    if layout not in ("nhd", "hnd"):
        raise ValueError(f"layout must be nhd or hnd for the starter kernel, got {layout!r}")
    if mistake not in MISTAKES:
        raise ValueError(f"mistake must be one of {list(MISTAKES)}, got {mistake!r}")
    tile = default_tile() if tile is None else tile
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two (tokens per loop step), got {tile!r}")
    B, Hq, D = q.shape
    _, block_size, hkv, _ = to_nhd(k_cache[:0], layout, "k").shape
    starter_decode_kernel[(B, Hq)](
        q, k_cache, v_cache, out, block_table, seq_lens, sm_scale, hkv,
        # (block, token, head) strides: the first three of the layout's address formula
        q.stride(0), q.stride(1), *addressing(k_cache, layout, "k")[:3], *addressing(v_cache, layout, "v")[:3],
        out.stride(0), out.stride(1), block_table.stride(0),
        GROUP=Hq // hkv, BLOCK_SIZE=block_size, HEAD_DIM=D, D_PAD=triton.next_power_of_2(D), TILE=tile,
        MISTAKE=MISTAKES[mistake])
    return out


def check_mistakes(mistakes, level: str = "smoke", layouts=("nhd", "hnd"), formats=("fp16", "bf16", "fp32")) -> dict:
    """Each of ``mistakes`` (names of :data:`MISTAKES`; a mapping's keys) registered as the decode implementation
    ``broken_<mistake>`` (the starter with that bug, claiming ``layouts`` and ``formats``; registering it again
    replaces it) and checked at ``level`` with the interpreter's warnings silenced
    (``suite.check_quietly``): ``{"broken_<mistake>": Report}``, in the order given."""
    reports = {}
    for mistake in mistakes:
        if mistake not in MISTAKES or mistake == "none":
            raise ValueError(f"mistakes must be among {[m for m in MISTAKES if m != 'none']}, got {mistake!r}")
        name = f"broken_{mistake}"
        implementations.register("decode", name, functools.partial(starter_decode, mistake=mistake), layouts=layouts,
                                 formats=formats, description=f"the starter kernel with its {mistake!r} bug")
        reports[name] = suite.check_quietly(name, level=level)
    return reports
