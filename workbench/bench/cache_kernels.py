"""Benchmark of the cache-side kernels: write-to-cache (prefill, decode step, fp8) and block copy.

``python -m workbench bench cache_kernels [--smoke] [--only prefill|decode|copy ...] [--out DIR]``. On
CUDA: the copy bandwidth first, then (a) a prefill write (64 x 512 tokens, 8 kv heads, head_dim 128,
fp16, 16-token blocks on a randomly permuted pool) in every layout: our kernel in both schemes
(``"head"``: one head per program; ``"rows"``: all heads, loads before stores, optionally K and V in
separate programs) over a few launch shapes, vs torch indexing and vs a plain ``copy_`` of the same
bytes (the ceiling at this size under the same timing), plus an fp8 write with each ``quant_math``
(``exact``, ``cast``, ``rcp``); (b) decode-step writes of 64/128/256 tokens timed plain and from a
CUDA graph; (c) block copies (4096 pairs in a 4 GiB pool, and a 64-pair copy-on-write) vs torch
indexing. Each of ours is checked against the reference on the same data before it is timed.
``--smoke`` runs tiny shapes (interpreter on a CPU, compiled on a GPU), correctness only; times are
the wall-clock of one call, flagged ``timing="wall"``, with no bandwidth figures.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

import workbench
from workbench.bench import harness
from workbench.bench.command import SMOKE_HELP, BenchParser
from workbench.core.layout import Layout, block_shape, block_view
from workbench.kernels import copy_blocks, write_kv
from workbench.kernels.copy.reference import copy_blocks_ref
from workbench.kernels.write import WriteConfig, launch_config
from workbench.kernels.write.reference import quant_code_distance, write_kv_ref
from workbench.results import provenance, run_files

COLUMNS = [
    "workload", "impl", "variant", "layout", "block_size", "kv_dtype", "tokens", "time_us", "time_us_graph",
    "gbps", "frac_copy_bw", "frac_peer_copy", "rel_err", "ok",
]
REP_MS = 100  # per timing (plain and graph); medians of ~700 calls of a 70 us kernel
KV_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
            torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.int8: "int8"}


# ----------------------------------------------------------------------------- the storage model
def block_stride(layout: Layout | str, block_size: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Elements from one block to the next: the block's elements rounded up to 128 bytes."""
    elem = dtype.itemsize
    numel = math.prod(block_shape(layout, "k", block_size, num_heads, head_dim, elem))
    return -(-numel * elem // 128) * 128 // elem


def make_pool(
    num_layers: int, num_blocks: int, layout: Layout | str, block_size: int, num_heads: int, head_dim: int,
    dtype: torch.dtype, device, seed: int = 0,
) -> torch.Tensor:
    """The cache's one buffer ``[num_layers, 2, num_blocks, block_stride]``, filled with random bytes (poison)."""
    stride = block_stride(layout, block_size, num_heads, head_dim, dtype)
    pool = torch.empty((num_layers, 2, num_blocks, stride), dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    raw = pool.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=device, generator=g))
    return pool


def layer_views(
    pool: torch.Tensor, layer: int, layout: Layout | str, block_size: int, num_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches: ``as_strided`` views of ``pool[layer, 0]`` and ``pool[layer, 1]``
    in the layout's block shape, block stride = the pool's (padded) stride, inner dims contiguous."""
    k, v = (block_view(pool[layer, i], layout, kind, block_size, num_heads, head_dim) for i, kind in enumerate("kv"))
    return k, v


# ----------------------------------------------------------------------------- measuring
@dataclass
class Ctx:
    timed: bool  # compiled on a GPU and not --smoke: time with CUDA events (else one wall-clock call)
    copy_bw: float | None


def _checked_time(ctx: Ctx, fn: Callable[[], object], check: Callable[[], tuple[float, bool]], graph: bool):
    """Run ``fn`` once, ``check`` its output, then time it: ``(rel_err, ok, time_us, time_us_graph)``.

    Untimed (``--smoke``, or the interpreter) the time is the wall-clock of that one checked call.
    """
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = 1e6 * (time.perf_counter() - t0)
    err, ok = check()
    if not ctx.timed:
        return err, ok, wall, None
    t, tg = harness.time_us(fn, rep_ms=REP_MS), None
    if graph:
        try:
            tg = harness.time_us_graph(fn, rep_ms=REP_MS)
        except Exception as e:  # noqa: BLE001  (an implementation that cannot be captured still gets its plain time)
            tqdm.write(f"cache_kernels: CUDA graph timing failed: {type(e).__name__}: {e}")  # above the bar
    return err, ok, t, tg


def _row(ctx: Ctx, nbytes: int, t: float, tg: float | None, **cols) -> dict:
    gbps = nbytes / (t * 1e-6) / 1e9 if ctx.timed else None
    gbps_graph = nbytes / (tg * 1e-6) / 1e9 if (ctx.timed and tg) else None
    return {
        **cols, "time_us": t, "time_us_graph": tg, "bytes": nbytes, "gbps": gbps, "gbps_graph": gbps_graph,
        "frac_copy_bw": gbps / ctx.copy_bw if (gbps and ctx.copy_bw) else None,
        "timing": "cuda-events" if ctx.timed else "wall",
    }


def _compare(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    """(rel_err, ok) of two pools: 0.0 when bit-exact; for 1-byte quantized codes the max code distance
    (ok up to 1: a midpoint rounded the other way); otherwise harness.rel_err of the values."""
    if torch.equal(got.view(torch.uint8), ref.view(torch.uint8)):
        return 0.0, True
    if got.element_size() == 1 and got.dtype != torch.uint8:
        d = int(quant_code_distance(got, ref).max())
        return float(d), d <= 1
    return harness.rel_err(got.float(), ref.float()), False


# ----------------------------------------------------------------------------- (a), (b) writes
def _slots_prefill(num_seqs: int, seq_len: int, block_size: int, num_blocks: int, device, seed: int):
    """Slot mapping of ``num_seqs`` sequences of ``seq_len`` tokens, pages from a random permutation."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-seq_len // block_size)
    pages = torch.randperm(num_blocks, generator=g)[: num_seqs * per_seq].view(num_seqs, per_seq)
    pos = torch.arange(seq_len)
    slots = pages[:, pos // block_size] * block_size + pos % block_size  # [num_seqs, seq_len]
    return slots.reshape(-1).to(torch.int32).to(device)


def _slots_decode(tokens: int, block_size: int, num_blocks: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(torch.int32).to(device)


def variant_name(cfg: WriteConfig) -> str:
    """A short label: ``bt16-w4`` (head scheme), ``rows-bt8-h8-w4[-kv2]``; ``-rcp``/``-cast`` for quant_math."""
    if cfg.scheme == "head":
        name = f"bt{cfg.tokens_per_program}-w{cfg.num_warps}"
    else:
        name = f"rows-bt{cfg.tokens_per_program}-h{cfg.heads_per_program}-w{cfg.num_warps}"
        name += "-kv2" if cfg.kv_split else ""
    return name + ("" if cfg.quant_math == "exact" else f"-{cfg.quant_math}")


def _write_rows(ctx: Ctx, workload: str, layout: Layout, kv_dtype: torch.dtype, slots: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, num_blocks: int, block_size: int,
                variants: list[dict], graph: bool, torch_peer: bool, copy_peer: torch.Tensor | None = None
                ) -> list[dict]:
    """Our kernel with its default launch and each of ``variants`` (write_kv keywords), then peers.

    ``copy_peer``: the source tensor holding K and V; a ``copy_`` of it into a fresh tensor of the
    cache dtype moves the same bytes as the write (its row is the ceiling at this size).
    """
    tokens, heads, head_dim = key.shape
    dev = key.device
    pool0 = make_pool(1, num_blocks, layout, block_size, heads, head_dim, kv_dtype, dev, seed=1)
    quant = kv_dtype.itemsize == 1
    scale = torch.tensor([0.02], dtype=torch.float32, device=dev) if quant else None
    ref = pool0.clone()
    write_kv_ref(key, value, *layer_views(ref, 0, layout, block_size, heads, head_dim), layout, slots, scale, scale)
    n_valid = int((slots >= 0).sum())
    nbytes = n_valid * heads * head_dim * 2 * (key.element_size() + kv_dtype.itemsize) + slots.numel() * 4
    base = {"workload": workload, "layout": layout.value, "block_size": block_size,
            "kv_dtype": KV_NAMES[kv_dtype], "tokens": tokens, "heads": heads, "head_dim": head_dim}
    rows = []
    shape = (tokens, heads, head_dim, block_size, layout, quant)
    auto = launch_config(*shape)
    configs = [auto] + [c for c in dict.fromkeys(launch_config(*shape, **v) for v in variants) if c != auto]
    for cfg in configs:
        pool = pool0.clone()
        kc, vc = layer_views(pool, 0, layout, block_size, heads, head_dim)
        kw = cfg._asdict()

        def fn(kc=kc, vc=vc, kw=kw):
            write_kv(key, value, kc, vc, layout, slots, scale, scale, validate=False, **kw)

        err, ok, t, tg = _checked_time(ctx, fn, lambda pool=pool: _compare(pool, ref), graph)
        variant = variant_name(cfg) + ("-auto" if cfg == auto else "")
        rows.append(_row(ctx, nbytes, t, tg, **base, impl="triton", variant=variant, **kw, rel_err=err, ok=ok))
        del pool
    if torch_peer and layout is Layout.NHD:
        pool = pool0.clone()
        flat = layer_views(pool, 0, layout, block_size, heads, head_dim)
        flat = [c.view(-1, heads, head_dim) for c in flat]  # the bench geometry has unpadded blocks
        idx = slots.long()
        if quant:
            qmax = torch.finfo(kv_dtype).max

            def peer():
                flat[0][idx] = (key.float() / scale).clamp(-qmax, qmax).to(kv_dtype)
                flat[1][idx] = (value.float() / scale).clamp(-qmax, qmax).to(kv_dtype)
        else:

            def peer():
                flat[0][idx] = key
                flat[1][idx] = value

        err, ok, t, tg = _checked_time(ctx, peer, lambda: _compare(pool, ref), graph)
        rows.append(_row(ctx, nbytes, t, tg, **base, impl="torch-index", variant="view(-1,H,D)[slots]=x",
                         rel_err=err, ok=ok))
        del pool
    if copy_peer is not None and layout is Layout.NHD:
        dst = torch.empty(copy_peer.shape, dtype=kv_dtype, device=dev)
        src = copy_peer
        copy_bytes = src.numel() * (src.element_size() + kv_dtype.itemsize)

        def copy():
            dst.copy_(src)

        _, _, t, tg = _checked_time(ctx, copy, lambda: (0.0, True), graph)
        what = "dst.copy_(kv)" if kv_dtype == src.dtype else f"dst.copy_(kv) to {KV_NAMES[kv_dtype]} (no scale)"
        rows.append(_row(ctx, copy_bytes, t, tg, **base, impl="torch-copy", variant=what, rel_err=0.0, ok=True))
        del dst
    return rows


# ----------------------------------------------------------------------------- (c) block copy
def _copy_rows(ctx: Ctx, workload: str, pool0: torch.Tensor, block_size: int, pairs: int, variants: list,
               graph: bool, seed: int) -> list[dict]:
    num_layers, _, num_blocks, _ = pool0.shape
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g)
    src, dst = perm[:pairs].to(pool0.device), perm[pairs : 2 * pairs].to(pool0.device)  # distinct sets
    ref = pool0.clone()
    copy_blocks_ref(ref, src, dst)
    block_bytes = pool0.shape[3] * pool0.element_size()
    nbytes = 2 * pairs * num_layers * 2 * block_bytes
    base = {"workload": workload, "layout": "any", "block_size": block_size, "kv_dtype": KV_NAMES[pool0.dtype],
            "tokens": None, "pairs": pairs, "num_layers": num_layers, "block_bytes": block_bytes}
    rows = []
    pool = pool0.clone()
    for variant in [None, *variants]:
        kw = {} if variant is None else dict(zip(("rows_per_program", "step_bytes", "num_warps"), variant,
                                                  strict=True))
        pool.copy_(pool0)

        def fn(kw=kw):
            copy_blocks(pool, src, dst, validate=False, **kw)

        err, ok, t, tg = _checked_time(ctx, fn, lambda: _compare(pool, ref), graph)
        name = "auto" if variant is None else "r{}-s{}-w{}".format(*variant)
        rows.append(_row(ctx, nbytes, t, tg, **base, impl="triton", variant=name, rel_err=err, ok=ok, **kw))
    src_l, dst_l = src.long(), dst.long()
    peers = {
        "torch-index": lambda: pool.__setitem__((slice(None), slice(None), dst_l), pool[:, :, src_l]),
        "torch-index_copy_": lambda: pool.index_copy_(2, dst_l, pool.index_select(2, src_l)),
    }
    for name, peer in peers.items():
        pool.copy_(pool0)
        err, ok, t, tg = _checked_time(ctx, peer, lambda: _compare(pool, ref), graph)
        rows.append(_row(ctx, nbytes, t, tg, **base, impl=name, variant="", rel_err=err, ok=ok))
    return rows


# ----------------------------------------------------------------------------- driver
@dataclass
class Sizes:
    num_seqs: int
    seq_len: int
    heads: int
    head_dim: int
    block_size: int
    decode_tokens: tuple[int, ...]
    copy_layers: int
    copy_blocks: int
    copy_pairs: tuple[int, ...]
    variants: int | None = None  # launch variants tried beside the default (None: all of them)


FULL = Sizes(64, 512, 8, 128, 16, (64, 128, 256), 8, 8192, (4096, 64))
SMOKE = Sizes(2, 12, 2, 64, 16, (3,), 2, 16, (4, 2), variants=2)  # each variant compiles anew in the interpreter
# write_kv keywords of each variant; the default launch (launch_config) is always measured first
WRITE_VARIANTS = [
    *(dict(scheme="head", tokens_per_program=bt, num_warps=w) for bt, w in [(8, 2), (16, 4), (16, 8), (32, 8)]),
    *(dict(scheme="rows", tokens_per_program=bt, num_warps=w) for bt, w in [(4, 2), (8, 4), (16, 8)]),
    dict(scheme="rows", tokens_per_program=8, num_warps=4, kv_split=True),
    dict(scheme="rows", tokens_per_program=16, num_warps=4, heads_per_program=2),
    dict(scheme="rows", tokens_per_program=16, num_warps=4, heads_per_program=1),
]
FP8_VARIANTS = [
    dict(scheme="head", quant_math="cast"),
    dict(scheme="head", quant_math="rcp"),
    dict(scheme="rows", tokens_per_program=8, num_warps=4),
    dict(scheme="rows", tokens_per_program=8, num_warps=4, quant_math="rcp"),
    dict(scheme="rows", tokens_per_program=16, num_warps=8, quant_math="rcp"),
]
DECODE_VARIANTS = [
    dict(scheme="head", tokens_per_program=1, num_warps=1),
    dict(scheme="head", tokens_per_program=4, num_warps=2),
    dict(scheme="rows", tokens_per_program=1, num_warps=4),
]
COPY_VARIANTS = [(1, 4096, 4), (1, 16384, 8), (2, 8192, 4)]
SECTIONS = ("prefill", "decode", "copy")


def _peer_fractions(rows: list[dict]) -> None:
    """``frac_peer_copy``: a row's bandwidth over the same-size ``copy_`` of its workload (the ceiling)."""
    peers = {r["workload"]: r["gbps"] for r in rows if r["impl"] == "torch-copy" and r["gbps"]}
    for r in rows:
        peer = peers.get(r["workload"])
        r["frac_peer_copy"] = r["gbps"] / peer if (peer and r.get("gbps")) else None


def steps(sizes: Sizes, sections=SECTIONS) -> int:
    """How many (workload, layout) groups :func:`run` measures: its progress bar's total."""
    n = len(Layout)
    return ((2 * n if "prefill" in sections else 0) + (len(sizes.decode_tokens) * n if "decode" in sections else 0)
            + (len(sizes.copy_pairs) if "copy" in sections else 0))


def run(sizes: Sizes, ctx: Ctx, device, sections=SECTIONS, progress: bool = False) -> list[dict]:
    """Every row of the selected sections; ``progress``: a tqdm bar on stderr, one step per workload and layout
    (minutes on a GPU: each launch variant compiles, then is timed plain and graph-replayed)."""
    rows: list[dict] = []
    bar = tqdm(total=steps(sizes, sections), desc="cache_kernels", unit="step", file=sys.stderr,
               disable=not progress)

    def step(label: str, measure: Callable[..., list[dict]], *args, **kwargs) -> None:
        bar.set_postfix_str(label)
        rows.extend(measure(*args, **kwargs))
        bar.update()

    s = sizes
    cap = lambda variants: variants[:s.variants] if s.variants is not None else variants
    tokens = s.num_seqs * s.seq_len
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(tokens, 2, s.heads, s.head_dim, generator=g).to(torch.float16).to(device)
    key, value = kv[:, 0], kv[:, 1]  # non-contiguous in T, as a fused projection's output would be
    blocks_needed = s.num_seqs * -(-s.seq_len // s.block_size)
    num_blocks = blocks_needed + blocks_needed // 4  # a pool somewhat larger than needed
    slots = _slots_prefill(s.num_seqs, s.seq_len, s.block_size, num_blocks, device, seed=2)
    if "prefill" in sections:
        for layout in Layout:  # (a) prefill
            step(f"prefill {layout}", _write_rows, ctx, "prefill", layout, torch.float16, slots, key, value,
                 num_blocks, s.block_size, cap(WRITE_VARIANTS), graph=True, torch_peer=True, copy_peer=kv)
            step(f"prefill-fp8 {layout}", _write_rows, ctx, "prefill-fp8", layout, torch.float8_e4m3fn, slots, key,
                 value, num_blocks, s.block_size, cap(FP8_VARIANTS), graph=True, torch_peer=True, copy_peer=kv)
    if "decode" in sections:
        for n in s.decode_tokens:  # (b) decode step: one token per sequence, random slots
            dslots = _slots_decode(n, s.block_size, num_blocks, device, seed=n)
            for layout in Layout:
                step(f"decode-{n} {layout}", _write_rows, ctx, f"decode-{n}", layout, torch.float16, dslots, key[:n],
                     value[:n], num_blocks, s.block_size, cap(DECODE_VARIANTS), graph=True, torch_peer=True)
    if "copy" in sections:
        pool = make_pool(s.copy_layers, s.copy_blocks, "nhd", s.block_size, s.heads, s.head_dim, torch.float16,
                         device, seed=3)
        for pairs in s.copy_pairs:  # (c) block copy
            # graph replay only for the small (copy-on-write sized) copy: the big one is not launch-bound
            step(f"copy-{pairs}", _copy_rows, ctx, f"copy-{pairs}", pool, s.block_size, pairs, cap(COPY_VARIANTS),
                 graph=pairs < 1024, seed=pairs)
    bar.close()
    _peer_fractions(rows)
    return rows


def _summary(rows: list[dict]) -> None:
    """The fastest of ours per (workload, layout), plain and graph-replayed, with its fractions."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if r["impl"] != "triton" or not r.get("gbps"):
            continue
        k = (r["workload"], r["layout"])
        if k not in best or r["time_us"] < best[k]["time_us"]:
            best[k] = r
    if best:
        print("\nfastest triton variant per workload and layout (plain median):")
        for (w, lay), r in best.items():
            tg = r["time_us_graph"]
            peer = r.get("frac_peer_copy")
            print(f"  {w:12s} {lay:5s} {r['variant']:28s} {r['time_us']:8.1f} us  graph {tg or float('nan'):8.1f} us"
                  f"  frac_copy_bw {r['frac_copy_bw']:.3f}" + (f"  frac_peer_copy {peer:.3f}" if peer else ""))


def main(argv: list[str] | None = None) -> int:
    parser = BenchParser("cache_kernels", __doc__, smoke=SMOKE_HELP, gpu=True)
    parser.add_argument("--only", action="append", choices=SECTIONS, default=None,
                        help="run only these sections (repeatable; default all)")
    args = parser.parse_args(argv)
    device = workbench.device()
    on_gpu = device.type == "cuda" and not workbench.is_interpreted()
    out = parser.start(args)  # checked before the run, not after
    if out is None:
        return 2
    timed = on_gpu and not args.smoke
    ctx = Ctx(timed=timed, copy_bw=harness.copy_bandwidth_gbps() if timed else None)
    if ctx.copy_bw:
        print(f"copy bandwidth: {ctx.copy_bw:.0f} GB/s")
    t0 = time.perf_counter()
    rows = run(SMOKE if args.smoke else FULL, ctx, device, tuple(args.only or SECTIONS), progress=True)
    meta = provenance.machine_meta()
    extra = {"copy_bw_gbps": ctx.copy_bw, "smoke": args.smoke, "backend": "interpreter" if not on_gpu else "cuda",
             "sections": list(args.only or SECTIONS), "wall_s": round(time.perf_counter() - t0, 1)}
    run_files.print_table(rows, COLUMNS)
    _summary(rows)
    path = run_files.write_results("cache_kernels", rows, meta, out, extra=extra)
    print(f"results: {path}  ({extra['wall_s']} s)")
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        print(f"MISMATCH: {r['workload']} {r['impl']} {r['variant']} {r['layout']} rel_err={r['rel_err']}")
    return 1 if bad else 0
