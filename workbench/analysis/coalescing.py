"""Which 128-byte lines and 32-byte sectors a warp touches when it reads K or V, from the real strides.

A model of the memory transactions of one read, computed from a layout's address formula
(:class:`workbench.core.layout.Addressing`, read off a tensor with the exact block stride), so it
runs anywhere. Two reads of one kv head (the unit a decode program works on):

- a **token read**: one token's ``head_dim`` values (what the seed's "coalesced access" means);
- a **tile read**: ``BLOCK_N`` consecutive tokens x ``head_dim``, the ``[BLOCK_N, D]`` tile the
  decode kernel (``kernels/decode.py``) loads for K and for V. Its pages lie on different
  physical blocks (a fragmented pool), never adjacent ones.

Counted per read: distinct 128-byte lines (L2 lines, the unit of a fully coalesced warp
transaction) and 32-byte sectors (the unit DRAM and L2 move), and the coalescing efficiency
``useful bytes / bytes of the lines (sectors) fetched``. Lanes: 32 per warp, each loading up to
16 contiguous bytes that are aligned to their size in every block of the pool (what a compiler can
prove from the strides); lanes walk the tile's contiguous axis first, the way Triton's blocked
layout orders a 2-D load, so ``requests`` is the number of warp-wide load instructions.

Statistics are exact means over the pool: a block's address mod 128 repeats every
``128 / gcd(block stride bytes, 128)`` blocks, so averaging over that many blocks, every kv head
and every tile position covers every case with its true frequency. The model counts one
program's reads; the program of a neighbouring kv head may find a straddled line already in L2,
so DRAM traffic can be lower than the line count says, while the extra requests stay.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from workbench.core import kv_spec
from workbench.core.layout import Addressing, Layout, addressing, block_shape

LINE = 128  # bytes: an L2 line, one fully coalesced warp transaction
SECTOR = 32  # bytes: what DRAM and L2 move
WARP = 32  # lanes
LANE_BYTES = 16  # widest load of one lane (ld.global.v4.b32)

# L2 of the H100 SXM5 / H200: 50 MiB = 52,428,800 bytes (NVIDIA, "NVIDIA Hopper Architecture In-Depth":
# "a 50 MB L2 cache in H100"; the full GH100 die has 60 MB, 50 of them enabled on the 132-SM parts, and
# the H200 is the same GH100 configuration with HBM3e). cudaDeviceProp.l2CacheSize reports the bytes:
# check with torch.cuda.get_device_properties(0).L2_cache_size on the machine.
H200_L2_BYTES = 50 * 2**20

_META_DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.float32}


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CacheGeometry:
    """One K or V cache tensor: layout, shape, element size and where its blocks start.

    Block ``b`` starts at byte ``base_offset + b * (block_bytes + pad_bytes)``.

    Attributes:
        layout: ``"nhd"``, ``"hnd"`` or ``"vllm"`` (``workbench.core.layout``).
        kind: ``"k"`` or ``"v"`` (differs only for ``vllm``).
        block_size: tokens per block.
        num_kv_heads: kv heads stored in a block.
        head_dim: values per head and token.
        elem_size: bytes per element (1, 2 or 4).
        pad_bytes: bytes added to each block's stride (a multiple of ``elem_size``).
        base_offset: byte address of block 0 (a multiple of ``elem_size``).
    """

    layout: str
    kind: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    elem_size: int = 2
    pad_bytes: int = 0
    base_offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", Layout.parse(self.layout).value)
        for name in ("block_size", "num_kv_heads", "head_dim"):
            _positive(name, getattr(self, name))
        if self.elem_size not in _META_DTYPES:
            raise ValueError(f"elem_size must be 1, 2 or 4 bytes, got {self.elem_size!r}")
        for name in ("pad_bytes", "base_offset"):
            v = getattr(self, name)
            if not isinstance(v, int | np.integer) or v < 0 or v % self.elem_size:
                raise ValueError(f"{name} must be a non-negative multiple of elem_size={self.elem_size}, got {v!r}")
        block_shape(self.layout, self.kind, self.block_size, self.num_kv_heads, self.head_dim, self.elem_size)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's data (without padding)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.elem_size

    @property
    def block_stride_bytes(self) -> int:
        return self.block_bytes + self.pad_bytes

    @cached_property
    def addressing(self) -> Addressing:
        """Element strides of the address formula, read off a (meta) tensor with this block stride."""
        shape = block_shape(self.layout, self.kind, self.block_size, self.num_kv_heads, self.head_dim, self.elem_size)
        inner = torch.empty(shape, device="meta").stride()
        stride0 = (self.block_bytes + self.pad_bytes) // self.elem_size
        t = torch.empty_strided((2, *shape), (stride0, *inner), dtype=_META_DTYPES[self.elem_size], device="meta")
        return addressing(t, self.layout, self.kind)

    @property
    def blocks_aligned(self) -> bool:
        """Whether every block starts on a 128-byte boundary."""
        return self.base_offset % LINE == 0 and self.block_stride_bytes % LINE == 0

    @property
    def alignment_period(self) -> int:
        """Blocks after which block start addresses repeat mod 128."""
        return LINE // math.gcd(self.block_stride_bytes, LINE)

    def block_misalignments(self) -> list[int]:
        """Distinct ``block start mod 128`` over the pool, sorted."""
        starts = self.base_offset + np.arange(self.alignment_period) * self.block_stride_bytes
        return sorted({int(s) for s in starts % LINE})

    def addresses(self, block, token, head, d) -> np.ndarray:
        """Byte address of element ``(block, token, head, d)``; arguments broadcast like numpy arrays."""
        a = self.addressing
        d = np.asarray(d, dtype=np.int64)
        elems = (np.asarray(block, dtype=np.int64) * a.s_blk + np.asarray(token, dtype=np.int64) * a.s_tok
                 + np.asarray(head, dtype=np.int64) * a.s_head + (d // a.x) * a.s_dgrp + (d % a.x) * a.s_d)
        return self.base_offset + self.elem_size * elems


@dataclass(frozen=True)
class AccessStats:
    """Transactions of one read of one kv head (means over the pool).

    Attributes:
        tokens: tokens per read (1 for a token read, ``BLOCK_N`` for a tile).
        useful_bytes: bytes the read needs.
        lines: distinct 128-byte lines touched.
        sectors: distinct 32-byte sectors touched.
        lane_bytes: bytes one lane loads at once (16: fully vectorized).
        requests: warp-wide load instructions (32 lanes each).
        lines_per_request: distinct lines one warp instruction touches.
        fast_axis: the axis lanes walk along (``"d"`` or ``"token"``): the contiguous one.
    """

    tokens: int
    useful_bytes: int
    lines: float
    sectors: float
    lane_bytes: int
    requests: float
    lines_per_request: float
    fast_axis: str

    @property
    def line_efficiency(self) -> float:
        return self.useful_bytes / (self.lines * LINE)

    @property
    def sector_efficiency(self) -> float:
        return self.useful_bytes / (self.sectors * SECTOR)


def _distinct(a: np.ndarray, unit: int) -> np.ndarray:
    """Distinct ``a // unit`` per row of a 2-D array."""
    s = np.sort(a // unit, axis=1)
    return 1 + (np.diff(s, axis=1) != 0).sum(axis=1)


def _origins(geom: CacheGeometry, heads) -> Counter:
    """``(base + block * stride + head * head offset) mod 128`` over one alignment period and the heads."""
    heads = range(geom.num_kv_heads) if heads is None else list(heads)
    if not heads or any(not 0 <= h < geom.num_kv_heads for h in heads):
        raise ValueError(f"heads must be kv head indices in [0, {geom.num_kv_heads}), got {heads!r}")
    blocks = np.arange(geom.alignment_period)[:, None]
    head_off = np.asarray(list(heads), dtype=np.int64)[None, :] * geom.addressing.s_head * geom.elem_size
    o = (geom.base_offset + blocks * geom.block_stride_bytes + head_off) % LINE
    return Counter(o.ravel().tolist())


def _tile_addresses(geom: CacheGeometry, n_tok: int) -> np.ndarray:
    """``[T, n_tok, D]`` byte addresses (block origin 0 mod 128) of every tile position in one period.

    Tile ``i`` holds logical tokens ``[i * n_tok, (i + 1) * n_tok)``; page ``j`` lies on block
    ``2 * period * j``: same address mod 128 as block 0, never adjacent to another page."""
    P = geom.block_size
    T = math.lcm(n_tok, P) // n_tok
    pos = np.arange(T)[:, None] * n_tok + np.arange(n_tok)[None, :]  # [T, n_tok] logical positions
    blocks = 2 * geom.alignment_period * (pos // P)
    d = np.arange(geom.head_dim)
    return geom.addresses(blocks[..., None], (pos % P)[..., None], 0, d) - geom.base_offset  # [T, n_tok, D]


def _lane_elems(a: np.ndarray, fast: int, elem: int, origins) -> int:
    """Widest power-of-two group of elements along ``fast`` that is contiguous and size-aligned in every case."""
    p = max(1, LANE_BYTES // elem)
    n = a.shape[fast]
    while p > 1:
        if n % p == 0:
            g = np.moveaxis(a, fast, -1)
            g = g.reshape(*g.shape[:-1], n // p, p)
            contiguous = bool((g - g[..., :1] == elem * np.arange(p)).all())
            starts = g[..., 0]
            if contiguous and all(((starts + o) % (p * elem) == 0).all() for o in origins):
                return p
        p //= 2
    return 1


def read_stats(geom: CacheGeometry, n_tok: int, heads=None) -> AccessStats:
    """Transactions of reading ``n_tok`` consecutive tokens x ``head_dim`` of one kv head.

    Args:
        geom: the cache tensor.
        n_tok: tokens per read (1: a token read; ``BLOCK_N``: a decode tile).
        heads: kv heads to average over (default all).

    Returns:
        :class:`AccessStats`, exact means over tile positions, blocks of the pool and heads.
    """
    _positive("n_tok", n_tok)
    origins = _origins(geom, heads)
    base = _tile_addresses(geom, n_tok)  # [T, n_tok, D]
    T, elem = base.shape[0], geom.elem_size
    a = geom.addressing
    if geom.head_dim > 1 and a.s_d == 1 and a.x > 1:
        fast = 2
    elif n_tok > 1 and geom.block_size > 1 and a.s_tok == 1:
        fast = 1
    else:
        fast = 2  # nothing contiguous: one element per lane
    p = _lane_elems(base, fast, elem, origins)
    order = base if fast == 2 else base.transpose(0, 2, 1)  # contiguous axis last
    flat = order.reshape(T, -1)  # [T, n_tok * D] in lane order
    per_req = WARP * p
    n_req = -(-flat.shape[1] // per_req)
    padded = np.pad(flat, ((0, 0), (0, n_req * per_req - flat.shape[1])), mode="edge")  # repeats: no new lines
    reqs = padded.reshape(T * n_req, per_req)
    total = sum(origins.values())
    lines = sectors = lpr = 0.0
    for o, weight in origins.items():
        lines += weight * _distinct(flat + o, LINE).mean()
        sectors += weight * _distinct(flat + o, SECTOR).mean()
        lpr += weight * _distinct(reqs + o, LINE).mean()
    return AccessStats(tokens=n_tok, useful_bytes=n_tok * geom.head_dim * elem, lines=float(lines / total),
                       sectors=float(sectors / total), lane_bytes=p * elem, requests=float(n_req),
                       lines_per_request=float(lpr / total), fast_axis="d" if fast == 2 else "token")


@dataclass(frozen=True)
class LineMap:
    """Bytes of each token of one tile in each 128-byte line it touches (block 1, head 0, first tile).

    Attributes:
        tokens: token indices (rows).
        line_offsets: byte offset of each touched line from the first one (columns).
        bytes: ``[tokens, lines]`` useful bytes.
        block_start_mod_line: where block 1 starts within its line.
    """

    tokens: list[int]
    line_offsets: list[int]
    bytes: list[list[int]]
    block_start_mod_line: int


def line_map(geom: CacheGeometry, n_tok: int, max_tokens: int = 16) -> LineMap:
    """The lines the first ``min(n_tok, max_tokens)`` tokens of a tile touch, for a picture."""
    n = min(n_tok, max_tokens)
    pos = np.arange(n)
    P = geom.block_size
    blocks = 1 + 2 * geom.alignment_period * (pos // P)  # block 1 shows a misaligned stride
    addr = geom.addresses(blocks[:, None], (pos % P)[:, None], 0, np.arange(geom.head_dim))  # [n, D]
    line = addr // LINE
    cols = np.unique(line)
    z = np.zeros((n, cols.size), dtype=np.int64)
    np.add.at(z, (np.repeat(pos, geom.head_dim), np.searchsorted(cols, line.ravel())), geom.elem_size)
    start = geom.base_offset + geom.block_stride_bytes
    return LineMap(pos.tolist(), ((cols - cols[0]) * LINE).tolist(), z.tolist(), start % LINE)


@dataclass(frozen=True)
class Coalescing:
    """A cache tensor's token and tile reads, and its alignment."""

    geometry: CacheGeometry
    block_n: int
    token: AccessStats
    tile: AccessStats
    line_map: LineMap

    @property
    def aligned(self) -> bool:
        return self.geometry.blocks_aligned

    def row(self) -> dict:
        """A flat dict for tables."""
        g, t, s = self.geometry, self.token, self.tile
        return {"layout": g.layout, "kind": g.kind, "block_size": g.block_size, "head_dim": g.head_dim,
                "elem_size": g.elem_size, "pad_bytes": g.pad_bytes, "aligned": self.aligned,
                "token_lines": t.lines, "token_sectors": t.sectors, "token_line_eff": t.line_efficiency,
                "token_sector_eff": t.sector_efficiency, "token_lane_bytes": t.lane_bytes,
                "block_n": self.block_n, "tile_lines": s.lines, "tile_sectors": s.sectors,
                "tile_line_eff": s.line_efficiency, "tile_sector_eff": s.sector_efficiency,
                "tile_lane_bytes": s.lane_bytes, "tile_requests": s.requests,
                "tile_lines_per_request": s.lines_per_request}


def analyze(
    layout: str,
    kind: str = "k",
    block_size: int = 16,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    elem_size: int = 2,
    pad_bytes: int = 0,
    base_offset: int = 0,
    block_n: int = 64,
    heads=None,
) -> Coalescing:
    """Token read and ``block_n``-token tile read of one cache tensor (see the module docstring).

    Example: NHD, fp16, head_dim 128: a token's K row is 256 contiguous bytes, 2 lines, efficiency 1.0.
    """
    geom = CacheGeometry(layout, kind, block_size, num_kv_heads, head_dim, elem_size, pad_bytes, base_offset)
    _positive("block_n", block_n)
    return Coalescing(geom, block_n, read_stats(geom, 1, heads), read_stats(geom, block_n, heads),
                      line_map(geom, block_n))


def seed_block_size(l2_bytes: float, head_dim: int, dtype_size: float) -> float:
    """The seed's tuning rule ``block_size = L2 / (2 * head_dim * dtype_size)`` (tokens).

    It is the number of tokens whose K and V of ONE kv head of ONE layer fill the L2 cache.
    """
    if l2_bytes <= 0 or head_dim <= 0 or dtype_size <= 0:
        raise ValueError(f"l2_bytes, head_dim and dtype_size must be positive, got {l2_bytes}, {head_dim}, "
                         f"{dtype_size}")
    return l2_bytes / (2 * head_dim * dtype_size)


# ------------------------------------------------------------------------------------------ notebook tables
def format_addressing(tensors, block_size: int = 16, num_kv_heads: int = 8, head_dim: int = 128,
                      elem_size: int = 2) -> str:
    """For each ``(layout, kind)`` of ``tensors``: the address formula's element strides, then the byte offsets of
    the first values of tokens 0 and 1 of kv head 0 in block 0 (two lines each)."""
    lines = []
    for layout, kind in tensors:
        g = CacheGeometry(layout, kind, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          elem_size=elem_size)
        a = g.addressing
        t0 = g.addresses(0, 0, 0, range(min(10, head_dim))).tolist()
        t1 = g.addresses(0, 1 % block_size, 0, range(min(3, head_dim))).tolist()
        lines.append(f"{layout:4s} {kind}: s_blk={a.s_blk} s_tok={a.s_tok} s_head={a.s_head} s_dgrp={a.s_dgrp} "
                     f"s_d={a.s_d} x={a.x}")
        lines.append(f"{'':8s}token 0 bytes {t0[:3]}..{t0[8:10]}, token 1 bytes {t1}")
    return "\n".join(lines)


def analyze_configs(configs, block_size: int = 16, num_kv_heads: int = 8, block_n: int = 64) -> dict[str, Coalescing]:
    """:func:`analyze` for each ``(label, layout, kind, head_dim, elem_size, pad_bytes)`` of ``configs``, all in
    ``block_size``-token blocks of ``num_kv_heads`` kv heads with ``block_n``-token tiles: ``{label: Coalescing}``."""
    return {label: analyze(layout, kind, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=d,
                           elem_size=elem, pad_bytes=pad, block_n=block_n)
            for label, layout, kind, d, elem, pad in configs}


def format_analyses(analyses: dict[str, Coalescing]) -> str:
    """Two tables of :func:`analyze_configs`' result: one token's read (alignment, lines, sectors, efficiencies,
    bytes a lane loads), then one tile's (efficiencies, lane bytes, warp requests, lines per request)."""
    first = next(iter(analyses.values()), None)
    shape = (f"{first.geometry.block_size}-token blocks, {first.geometry.num_kv_heads} kv heads; "
             if first is not None else "")
    lines = [f"{shape}one token's read:", f"{'':22s} aligned  lines  sectors  line_eff  sector_eff  lane_B"]
    for label, a in analyses.items():
        t = a.token
        lines.append(f"{label:22s} {a.aligned!s:7s} {t.lines:6.2f} {t.sectors:8.2f} {t.line_efficiency:9.3f} "
                     f"{t.sector_efficiency:11.3f} {t.lane_bytes:7d}")
    tile = f"one {first.block_n}-token tile's read:" if first is not None else "one tile's read:"
    lines += ["", tile, f"{'':22s} line_eff  sector_eff  lane_B  requests  lines/request"]
    for label, a in analyses.items():
        s = a.tile
        lines.append(f"{label:22s} {s.line_efficiency:8.3f} {s.sector_efficiency:11.3f} {s.lane_bytes:7d} "
                     f"{s.requests:9.0f} {s.lines_per_request:14.2f}")
    return "\n".join(lines)


def seed_rule_rows(l2_bytes: float, model, kv_dtypes) -> list[dict]:
    """The seed's block-size rule (:func:`seed_block_size`) for ``model`` (a ``workbench.core.kv_spec`` model) in each
    ``(name, kv_dtype)`` of ``kv_dtypes``: the tokens it gives, then per kv head and per layer as well."""
    rows = []
    for name, dtype in kv_dtypes:
        size = kv_spec.dtype_size(dtype)
        tokens = seed_block_size(l2_bytes, model.head_dim, size)
        rows.append({"name": name, "kv_dtype": dtype, "dtype_size": size, "head_dim": model.head_dim,
                     "tokens": tokens, "num_kv_heads": model.num_kv_heads, "per_kv_head": tokens / model.num_kv_heads,
                     "num_layers": model.num_layers,
                     "per_layer": tokens / model.num_kv_heads / model.num_layers})
    return rows


def format_seed_rule(rows) -> str:
    """One line per row of :func:`seed_rule_rows`: the rule's tokens, divided by the kv heads, then the layers."""
    return "\n".join(f"{r['name']}: L2 / (2 * {r['head_dim']} * {r['dtype_size']:g}) = {r['tokens']:,.0f} tokens; "
                     f"/ {r['num_kv_heads']} kv heads = {r['per_kv_head']:,.0f}; "
                     f"/ {r['num_layers']} layers more = {r['per_layer']:,.0f}" for r in rows)
