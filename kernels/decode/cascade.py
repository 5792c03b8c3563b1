"""Shared-prefix decode (cascade attention): a run of blocks held by several sequences is read once for all of them.

FlashInfer's cascade, built from our own pieces. A *segment* is a run of whole blocks ``[start, end)`` (logical
block indices) that the sequences ``rows`` hold in common: the same physical blocks at the same positions (a
system prompt, a parallel-sampling fork, a fork of a fork). Every sequence's context is cut into the segments it
belongs to, in order from block 0, and a private *suffix* (the rest of its table). Then:

1. **Shared pass.** The query heads of all a segment's sharers that read one kv head are stacked into a tile of
   ``rows_per_tile`` rows (``G = Hq // Hkv`` heads per sharer), so one program of the decode kernel reads each
   K/V block of the segment once for the whole tile, on the tensor cores. In the kernel's terms each tile is
   one "sequence" with ``rows_per_tile`` query heads per kv head; a segment of ``S`` sharers needs
   ``ceil(S * G / rows_per_tile)`` tiles, and that is how often its blocks are read (not ``S`` times).
2. **Suffix pass.** The ordinary paged decode of every sequence over its own blocks.
3. **Merge.** Each query head has the split partials of every segment it is in and of its suffix, as the two
   passes' decode kernels leave them (fp32, in their plans' scratch); they are merged by log-sum-exp (base 2, as
   the decode kernel writes them), reading the shared ones through an index: no copies, and not the passes' own
   merges (in eager timing the host's launches are most of a step).

The shared pass reads its stacked query rows straight from ``q`` through a row map (``cascade_kernels``), so a
step is three launches; where its tiles run the packed-code kernels (or ``fuse_gather=False``) a query gather
copies them first: four. Everything that depends only on the batch (tables, lengths, segments) is done
once in :class:`CascadePlan`; ``run`` launches with no host sync and no allocation, so a step's layers can share
the plan (and a CUDA graph). Which runs to treat as segments, and whether
the cascade is worth it at all, is ``workbench.shared_prefix``'s business; the plan takes any valid cut.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
import triton

from workbench.core.layout import Layout

from .. import common
from ..launch import PlannedLaunch
from . import checks as _checks
from . import kernel as _kernel
from .cascade_kernels import _merge_passes_kernel, _shared_pass_kernel
from .config import _num_sms
from .plan import DecodePlan, _values_head_dim

_describe = common.describe


class CascadePlan:
    """Decode of a batch whose sequences share runs of blocks, planned once and run per layer (module docstring).

    Args:
        block_table: ``[B, max_blocks]`` int32 (the caches' device), as for :class:`DecodePlan`.
        seq_lens: ``[B]`` int32 context lengths (read once here: one device sync).
        segments: ``(start, end, rows)`` triples (host ints): blocks ``[start, end)`` of the sequences ``rows``
            (distinct batch rows, at least one) hold the same physical blocks; a segment's tokens are whole
            blocks, all inside every sharer's length.
        suffix_start: per row, the first block of its private suffix. A row's segments must tile
            ``[0, suffix_start[row])`` exactly, in order (a row in no segment has ``suffix_start`` 0).
        layout, k_cache, v_cache, num_q_heads, q_dtype, k_scale, v_scale, sm_scale: as for :class:`DecodePlan`.
        rows_per_tile: query rows of a shared tile (a power of two >= 16; default 64): the tile's K/V is read
            once for this many stacked query heads.
        validate: check the segments against the table on the device (every sharer holds the segment's blocks;
            one device sync) and the block ids against the caches (the two passes' plans).
        return_lse: ``run`` also returns the merged log-sum-exps ``[B, Hq]`` (base 2).
        shared_launch: :func:`~workbench.kernels.decode_config` overrides for the shared pass only (it runs
            ``batch_fast``: a segment's tiles of one chunk side by side, so all but the first read it from L2).
        overlap: on a CUDA device, run the shared pass (query gather and decode) on a side stream beside the suffix
            pass, joined before the merge (also under CUDA-graph capture: the fork and join are captured). The shared
            pass is bound by the tensor cores and the suffixes by memory, but its one wave fills every SM: on an H100
            at 32k x 64 it gained 1-3% under a graph and lost up to 25% eager (the fork and join are host work;
            docs/shared_prefix.md), so it is off by default.
        fuse_gather: the shared pass reads its query rows from ``q`` itself (default), where its tiles run the
            decode kernel of float and 8-bit codes; False: a separate gather copies them first (to measure it).
        **launch: overrides for both passes (``quant`` included, as for ``paged_decode``).

    ``run(q, k_cache, v_cache, out=None)`` is then as :meth:`DecodePlan.run`.
    """

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, segments: Sequence, suffix_start: Sequence[int],
                 *, layout: Layout | str, k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int,
                 q_dtype: torch.dtype, rows_per_tile: int = 64, k_scale=None, v_scale=None, sm_scale: float | None = None,
                 validate: bool = True, return_lse: bool = False, shared_launch: dict | None = None,
                 overlap: bool = False, fuse_gather: bool = True, **launch) -> None:
        layout = Layout.parse(layout)
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise ValueError(f"block_table must be a [B, max_blocks] int32 tensor, got {_describe(block_table)}")
        B, M = block_table.shape
        if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < 1:
            raise ValueError(f"num_q_heads must be an int >= 1, got {num_q_heads!r}")
        hkv, block_size = _checks._check_batch(k_cache, v_cache, layout, block_table, seq_lens, B, num_q_heads,
                                               q_dtype, block_table.device)
        if isinstance(rows_per_tile, bool) or not isinstance(rows_per_tile, int) or rows_per_tile < 16 \
                or rows_per_tile & (rows_per_tile - 1):
            raise ValueError(f"rows_per_tile must be a power of two >= 16, got {rows_per_tile!r}")
        if shared_launch is not None and not isinstance(shared_launch, dict):
            raise ValueError(f"shared_launch must be a dict of launch options, got {type(shared_launch).__name__}")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be a bool, got {overlap!r}")
        if not isinstance(fuse_gather, bool):
            raise ValueError(f"fuse_gather must be a bool, got {fuse_gather!r}")
        lens = seq_lens.tolist()  # the one device sync of planning (the segments are checked against the lengths)
        segs = _check_segments(segments, suffix_start, lens, B, M, block_size)
        if validate and segs:
            _check_sharers(block_table, segs)
        device = block_table.device
        D = _values_head_dim(k_cache, v_cache, layout, q_dtype, device, launch.get("quant"))
        G, T = num_q_heads // hkv, rows_per_tile
        q_rows, state_idx, tables, n_states = _index_maps(segs, list(suffix_start), B, num_q_heads, hkv, G, T)
        V = len(tables)
        n_shared = V * hkv * T
        kw = dict(layout=layout, k_cache=k_cache, v_cache=v_cache, q_dtype=q_dtype, k_scale=k_scale, v_scale=v_scale,
                  sm_scale=sm_scale, validate=validate, return_lse=True)
        # the suffixes: each row's table from its suffix_start on, on the device
        starts = torch.tensor(list(suffix_start), dtype=torch.int64, device=device)
        width = max(1, max((-(-n // block_size) - s for n, s in zip(lens, suffix_start, strict=True)), default=1))
        cols = (starts[:, None] + torch.arange(width, device=device)[None, :]).clamp_(max=max(M - 1, 0))
        sfx_table = block_table.gather(1, cols).to(torch.int32) if M else block_table.new_zeros((B, width))
        sfx_lens = (seq_lens.to(torch.int64) - starts * block_size).clamp_(min=0).to(torch.int32)
        sfx_max = max((n - s * block_size for n, s in zip(lens, suffix_start, strict=True)), default=0)
        suffix_plan = DecodePlan(sfx_table, sfx_lens, num_q_heads=num_q_heads, max_seq_len=sfx_max,
                                  mean_seq_len=sum(lens) / B - sum(suffix_start) * block_size / B if B else None,
                                  **kw, **launch)
        shared_plan = None
        if V:
            w = max(e - s for s, e, _ in tables)
            rows = torch.tensor([r for _, _, r in tables], dtype=torch.int64, device=device)
            c0 = torch.tensor([s for s, _, _ in tables], dtype=torch.int64, device=device)
            c = (c0[:, None] + torch.arange(w, device=device)[None, :]).clamp_(max=M - 1)
            n_blk = torch.tensor([e - s for s, e, _ in tables], dtype=torch.int64, device=device)
            sh_table = torch.where(torch.arange(w, device=device)[None, :] < n_blk[:, None],
                                   block_table[rows[:, None], c], 0).to(torch.int32).contiguous()
            sh_lens = (n_blk * block_size).to(torch.int32)
            shared_plan = DecodePlan(sh_table, sh_lens, num_q_heads=hkv * T, max_seq_len=w * block_size, **kw,
                                      **{**launch, "batch_fast": True, **_shared_defaults(k_cache, D, T, launch),
                                         **(shared_launch or {})})
        gather_in_pass = (fuse_gather and shared_plan is not None
                          and shared_plan._decode_kernel is _kernel._paged_decode_kernel)
        self.__dict__.update(  # past __setattr__: the one place a plan is written
            _shared=shared_plan, _suffix=suffix_plan,
            _side=_side_stream(device) if overlap and shared_plan is not None and device.type == "cuda" else None,
            _shared_launch=PlannedLaunch(_shared_pass_kernel, shared_plan._constexprs) if gather_in_pass else None,
            _q_rows=q_rows.to(device=device, dtype=torch.int32) if gather_in_pass else None,
            _q_idx=None if gather_in_pass else q_rows.clamp(min=0).to(device),
            _q_v=None if gather_in_pass or not V else torch.empty((n_shared, D), dtype=q_dtype, device=device),
            _state_idx=state_idx.to(device=device, dtype=torch.int32).contiguous(),
            _merges=tuple(PlannedLaunch(_merge_passes_kernel, dict(HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
                                                                   HAS_LSE=has, num_warps=1)) for has in (False, True)),
            layout=layout, batch_size=B, num_q_heads=num_q_heads, num_kv_heads=hkv, head_dim=D, block_size=block_size,
            q_dtype=q_dtype, device=device, rows_per_tile=T, return_lse=bool(return_lse), num_tiles=V,
            num_states=n_states, segments=tuple(segs), suffix_start=tuple(int(s) for s in suffix_start),
            _n_shared=n_shared, _q_shape=(B, num_q_heads, D))

    @property
    def gathers_in_pass(self) -> bool:
        """Whether the shared pass reads its query rows from ``q`` itself (three launches a step, not four)."""
        return self._shared_launch is not None

    @property
    def plans(self) -> tuple[DecodePlan | None, DecodePlan]:
        """``(shared pass, suffix pass)``: the two decode plans (the shared one is None without segments)."""
        return self._shared, self._suffix

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None = None, *,
            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
        """Decode attention of one layer: ``q`` ``[B, Hq, D]`` -> ``out`` (and, ``return_lse``, ``lse`` ``[B, Hq]``);
        ``k_scale``, ``v_scale``: the layer's own static scales, as for :meth:`DecodePlan.run`."""
        if not isinstance(q, torch.Tensor) or q.shape != self._q_shape or q.dtype != self.q_dtype \
                or q.device != self.device or not q.is_contiguous():
            raise ValueError(f"q must be a contiguous {self.q_dtype} tensor of shape {self._q_shape} on {self.device}; "
                             f"got {_describe(q)}")
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != self._q_shape
                                or out.dtype != self.q_dtype or out.device != self.device or out.stride(2) != 1):
            raise ValueError(f"out must be a {self.q_dtype} tensor of shape {self._q_shape} on {self.device} with "
                             f"unit last stride; got {_describe(out)}")
        self._suffix.layer_scales(k_scale, v_scale)  # checked before either pass (both plans share the scales)
        sc = dict(k_scale=k_scale, v_scale=v_scale)
        B, Hq, D = self._q_shape
        n_sh = self._n_shared
        # the passes' plans check the caches' geometry (a ValueError naming k_cache / v_cache) before launching;
        # until the merge only the plan's own buffers are written
        if out is None:
            out = torch.empty(self._q_shape, dtype=self.q_dtype, device=self.device)
        lse = torch.empty((B, Hq), dtype=torch.float32, device=self.device) if self.return_lse else None
        if B == 0:
            return (out, lse) if self.return_lse else out
        # three launches (four with a separate query gather): each pass's decode kernel leaves its split partials in
        # its plan's scratch, and one merge reads them all (the passes' own merges would be two more launches)
        sh, sx = self._shared or self._suffix, self._suffix
        if self._shared is not None:
            side, main = self._side, None
            if side is not None:  # fork: the side stream starts after everything queued so far (q written)
                main = torch.cuda.current_stream(self.device)
                side.wait_stream(main)
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                if self._shared_launch is not None:  # the pass reads its query rows from q through the row map
                    sx._check_inputs(q, k_cache, v_cache)  # the plans' caches: one geometry, checked before a launch
                    _, args, _ = sh._decode_call(q, k_cache, v_cache, q, sh._o_part, sh._lse, sh.layer_scales(**sc))
                    self._shared_launch(sh._grid, *args, self._q_rows)
                    sh_o, sh_s = sh._o_part, sh._lse
                else:
                    torch.index_select(q.view(B * Hq, D), 0, self._q_idx, out=self._q_v)
                    V = self.num_tiles
                    sh_o, sh_s = sh.run_partials(self._q_v.view(V, n_sh // V, D), k_cache, v_cache, **sc)
            sx_o, sx_s = self._suffix.run_partials(q, k_cache, v_cache, **sc)
            if main is not None:  # join: the merge (and whatever the caller queues next) waits for the shared pass
                main.wait_stream(side)
        else:
            sx_o, sx_s = self._suffix.run_partials(q, k_cache, v_cache, **sc)
            sh_o, sh_s = sx_o, sx_s  # not read: no row has a segment
        self._merges[lse is not None](
            (B, Hq), sh_o, sh_s, sh.seq_lens, sx_o, sx_s, sx.seq_lens, self._state_idx, out,
            lse if lse is not None else sx_s, out.stride(0), out.stride(1), self.num_states - 1, Hq,
            self.num_kv_heads * self.rows_per_tile, sh.num_splits, max(sh.chunk, 1), sx.num_splits, max(sx.chunk, 1))
        return (out, lse) if self.return_lse else out

    def __repr__(self) -> str:
        return (f"CascadePlan(B={self.batch_size}, segments={len(self.segments)}, tiles={self.num_tiles}, "
                f"rows_per_tile={self.rows_per_tile}, states={self.num_states})")

    def __setattr__(self, name, value):
        raise AttributeError(f"CascadePlan is fixed once planned (setting {name!r}): build a new plan")


def _shared_defaults(k_cache: torch.Tensor, head_dim: int, rows: int, launch: dict) -> dict:
    """The shared pass's tile on a GPU, for fp16 / bf16 caches at 64 stacked rows (``tuning/shared_prefix.json``
    ``shared_pass``): its tiles are matmuls of ``rows`` query rows, bound by the tensor cores, so twice the plain
    decode's keys a tile and three stages (the H100 sweep: 102 against 116 us at 32k x 64, GQA 32/8). Other caches,
    tiles, the interpreter, or a caller's own ``BLOCK_N`` / ``num_stages``: the decode's own choice."""
    if k_cache.dtype not in (torch.float16, torch.bfloat16) or rows != 64 or launch.keys() & {"BLOCK_N", "num_stages"} \
            or _num_sms(k_cache.device) <= 0:
        return {}
    t = common.tuning_table("shared_prefix")[1].get("shared_pass")
    if not t:
        return {}
    tokens = t["tile_bytes"] // (k_cache.element_size() * common.next_pow2(head_dim))
    return {"BLOCK_N": max(16, min(128, 1 << (max(tokens, 1).bit_length() - 1))), "num_stages": t["num_stages"]}


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every plan's shared pass (plans of one step run one after another)."""
    return torch.cuda.Stream(device)


def _check_segments(segments, suffix_start, lens, B, M, block_size) -> list[tuple[int, int, tuple[int, ...]]]:
    """The segments as ``(start, end, rows)`` int tuples, checked against each other, the table and the lengths."""
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
        raise ValueError(f"segments must be a list of (start, end, rows), got {type(segments).__name__}")
    if isinstance(suffix_start, (str, bytes)) or not isinstance(suffix_start, Sequence) or len(suffix_start) != B \
            or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in suffix_start):
        raise ValueError(f"suffix_start must be a list of {B} ints >= 0 (one per row), got {suffix_start!r}")
    out, covered = [], [0] * B
    for i, seg in enumerate(segments):
        ok = isinstance(seg, Sequence) and len(seg) == 3
        start, end, rows = seg if ok else (None, None, None)
        ints = ok and all(not isinstance(x, bool) and isinstance(x, int) for x in (start, end))
        if not ints or not 0 <= start < end <= M or isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) \
                or not rows:
            raise ValueError(f"segments[{i}] must be (start, end, rows) with 0 <= start < end <= {M} (the table's "
                             f"width) and rows a non-empty list of batch rows, got {seg!r}")
        if any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < B for r in rows) or len(set(rows)) < len(rows):
            raise ValueError(f"segments[{i}] rows must be distinct ints in [0, {B}), got {list(rows)}")
        for r in rows:
            if covered[r] != start:
                raise ValueError(f"segments[{i}] starts at block {start} but row {r}'s segments so far end at block "
                                 f"{covered[r]}: a row's segments must tile its blocks from 0, in order")
            if end * block_size > lens[r]:
                raise ValueError(f"segments[{i}] ends at block {end} ({end * block_size} tokens) past row {r}'s length "
                                 f"{lens[r]}: a segment holds whole blocks inside every sharer")
            covered[r] = end
        out.append((start, end, tuple(rows)))
    for r in range(B):
        if covered[r] != suffix_start[r]:
            raise ValueError(f"suffix_start[{r}] = {suffix_start[r]} must be where row {r}'s segments end "
                             f"(block {covered[r]})")
    return out


def _check_sharers(block_table, segs) -> None:
    """Every sharer holds the segment's physical blocks (one device sync for all segments)."""
    first, other, cols = [], [], []
    for start, end, rows in segs:
        for r in rows[1:]:
            first += [rows[0]] * (end - start)
            other += [r] * (end - start)
            cols += range(start, end)
    if not cols:
        return
    dev = block_table.device
    f, o, c = (torch.tensor(x, dtype=torch.int64, device=dev) for x in (first, other, cols))
    bad = (block_table[f, c] != block_table[o, c]).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        raise ValueError(f"block_table rows {first[j]} and {other[j]} differ at block {cols[j]}, which a segment says "
                         f"they share")


def _stacked_rows(rows, Hq, hkv, G, T) -> list[torch.Tensor]:
    """The query heads of ``rows`` that read one kv head stacked into tiles of ``T`` rows: per tile, ``[hkv * T]``
    q rows (batch row * Hq + head), -1 past the last."""
    n = len(rows) * G  # stacked query rows of one kv head
    out = []
    for t in range(-(-n // T)):
        r = t * T + torch.arange(T)  # tile rows
        member = torch.tensor(rows)[(r // G).clamp(max=len(rows) - 1)]
        src = member[None, :] * Hq + torch.arange(hkv)[:, None] * G + (r % G)[None, :]  # [hkv, T]
        out.append(torch.where((r < n)[None, :], src, -1).flatten())
    return out


def _index_maps(segs, suffix_start, B, Hq, hkv, G, T):
    """The q rows the shared tiles read (batch row * Hq + head; -1 for a tile's padding), each (row, segment, query
    head)'s row of the shared pass (tile * Hkv * T + its row in the tile; -1 past the row's segments), the shared
    tiles' (start, end, source row), the number of states a row merges at most (its segments and its suffix)."""
    q_rows, tables = [], []
    state = [[] for _ in range(B)]  # per row: state-row offsets of its segments, per query head
    heads = torch.arange(Hq)
    for start, end, rows in segs:
        n = len(rows) * G  # stacked query rows of one kv head
        tiles = _stacked_rows(rows, Hq, hkv, G, T)
        q_rows += tiles
        tables += [(start, end, rows[0])] * len(tiles)
        for p, row in enumerate(rows):
            r = p * G + heads % G  # this row's stacked position, per query head
            v = len(tables) - (-(-n // T)) + r // T
            state[row].append(v * hkv * T + (heads // G) * T + r % T)
    L = 1 + max((len(s) for s in state), default=0)  # the segments of the row in most, and its suffix
    idx = torch.full((B, max(L - 1, 1), Hq), -1, dtype=torch.int64)  # -1: a row in fewer segments
    for b in range(B):
        for i, s in enumerate(state[b]):
            idx[b, i] = s
    q_idx = torch.cat(q_rows) if q_rows else torch.zeros(0, dtype=torch.int64)
    return q_idx, idx, tables, L

