"""GPU: the host link for KV blocks: bandwidth by block size and batch for both copy paths and directions, what a
transfer costs a decode kernel running beside it, and how much of a prefetch hides behind decode.

    python -m workbench bench tiers [--out data/results] [--quick] [--only SECTION ...]
    python -m workbench bench tiers --smoke     # the formats section alone, tiny shapes on the CPU

Sections (every figure a ratio to something measured in the same run):

- ``pinned``: one 256 MiB pinned copy each way (the link's bandwidth, the denominator of every ``frac``), and a
  pageable one for reference.
- ``link``: blocks of 4 KiB .. 2 MiB scattered in a device pool, ``blocks`` per batch, moved to / from pinned
  host memory (device time from a CUDA graph; ``*_eager`` with the host's launches) by ``dma`` (gather into
  one staging buffer + one copy; the reverse for h2d: the mover's path), ``dma_per_block`` (one
  ``cudaMemcpyAsync`` per block: the baseline that batching replaces) and ``sm`` (the block-move kernel
  reading / writing pinned memory directly); ``gbps`` and ``frac`` of pinned.
- ``beside``: a paged decode (W1: 64 sequences x 4k tokens, 8 KV heads x 128, fp16, one layer) timed alone and
  with transfers running on a side stream all the while (dma 16 MiB batches; sm at several grid caps): the
  decode's slowdown and the bandwidth the transfers kept.
- ``overlap``: a prefetch (the :class:`~workbench.tiers.transfer.BlockMover`'s swap-in of 64 KiB cache blocks,
  batches of 1024) sized to ~0.8x the compute time of 20 decode steps, issued on the side stream while the steps
  run: the share of the transfer time hidden and the decode's slowdown.
- ``check``: a :class:`~workbench.tiers.TieredCache` on the GPU: swap out / in and prefix demotion / promotion by
  both paths, bit-exact; the disk pool's write / read bandwidth on this machine's disk.
- ``formats``: blocks demoted and promoted in another format than the device's (``host_format``): tokens/s per
  format against fp16's, the transcode's bandwidth, the break-even link bandwidth, a decode beside transcoding
  swaps (``workbench.bench.tier_formats``; ``--smoke`` runs it alone on the CPU).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from workbench.bench import harness, tier_formats
from workbench.bench.command import BenchParser
from workbench.cache import PagedKVCache
from workbench.kernels import DecodePlan, move_blocks
from workbench.quant.names import TIER_BENCH_SCHEMES
from workbench.results import provenance, run_files
from workbench.tiers import TieredCache
from workbench.tiers.disk import DiskPool
from workbench.tiers.host import HostPool
from workbench.tiers.transfer import BlockMover, block_bytes

SIZES_KIB = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
BATCHES = (1, 4, 16, 64, 256)
SM_CAPS = (8, 16, 32, 66, None)  # programs of the SM copy beside the decode (None: the default grid)
SECTIONS = ("link", "beside", "overlap", "check", "formats")


def _time_us(fn, reps: int = 10, rounds: int = 3) -> float:
    return harness.time_us_events(fn, reps, rounds)


def _time_graph_us(fn, per_graph: int, rounds: int = 3) -> float:
    """Like :func:`_time_us`, replayed from a CUDA graph of ``per_graph`` calls: the device's time, without the
    host's launch overhead (which a swap issued ahead of need hides anyway)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiled and warm before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    return _time_us(graph.replay, reps=1, rounds=rounds) / per_graph


def pinned_bandwidth(nbytes: int = 256 << 20) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pin = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    page = torch.empty(nbytes, dtype=torch.uint8)
    res = {}
    for name, host in (("pinned", pin), ("pageable", page)):
        reps = 5 if name == "pinned" else 2
        res[f"{name}_h2d"] = nbytes / _time_us(lambda h=host: dev.copy_(h, non_blocking=True), reps) / 1e3
        res[f"{name}_d2h"] = nbytes / _time_us(lambda h=host: h.copy_(dev, non_blocking=True), reps) / 1e3
    return res


def link_rows(pinned: dict, quick: bool) -> list[dict]:
    """The bandwidth map: every block size x batch x path x direction."""
    sizes = SIZES_KIB[::3] if quick else SIZES_KIB
    max_bytes = max(sizes) * 1024 * max(BATCHES)
    pool = torch.empty(2 * max_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    host = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True)
    staging = torch.empty(max_bytes, dtype=torch.uint8, device="cuda")
    rows = []
    g = torch.Generator().manual_seed(0)
    for kib in sizes:
        bb = kib * 1024
        for n in BATCHES:
            ids = torch.randperm(2 * max_bytes // bb, generator=g)[:n].to(torch.int64)
            rows += _link_case(pool, host, staging, bb, ids, pinned, move_blocks)
    return rows


def _link_case(pool, host, staging, bb: int, ids: torch.Tensor, pinned: dict, move_blocks) -> list[dict]:
    """One block size and batch: the three paths, both directions."""
    n = len(ids)
    dev_ids, seq = ids.cuda(), torch.arange(n, dtype=torch.int64, device="cuda")
    geo = dict(num_rows=1, row_bytes=bb, src_row_stride=0, dst_row_stride=0, src_block_stride=bb,
               dst_block_stride=bb)
    plain = ids.tolist()

    def dma(d2h):
        if d2h:
            move_blocks(pool, dev_ids, staging, seq, **geo)
            host[:n * bb].copy_(staging[:n * bb], non_blocking=True)
        else:
            staging[:n * bb].copy_(host[:n * bb], non_blocking=True)
            move_blocks(staging, seq, pool, dev_ids, **geo)

    def per_block(d2h):
        for i, b in enumerate(plain):
            d, h = pool[b * bb:(b + 1) * bb], host[i * bb:(i + 1) * bb]
            (h.copy_(d, non_blocking=True) if d2h else d.copy_(h, non_blocking=True))

    def sm(d2h):
        if d2h:
            move_blocks(pool, dev_ids, host, seq, **geo)
        else:
            move_blocks(host, seq, pool, dev_ids, **geo)

    rows = []
    for path, fn in (("dma", dma), ("dma_per_block", per_block), ("sm", sm)):
        for direction, d2h in (("d2h", True), ("h2d", False)):
            reps = max(2, min(20, (64 << 20) // (n * bb)))
            call = lambda f=fn, x=d2h: f(x)
            eager = _time_us(call, reps)
            t = _time_graph_us(call, per_graph=max(1, min(reps, 4096 // n)))
            gbps = n * bb / t / 1e3
            rows.append(dict(section="link", path=path, direction=direction, block_bytes=bb, blocks=n,
                             bytes=n * bb, time_us=round(t, 2), gbps=round(gbps, 2),
                             frac=round(gbps / pinned[f"pinned_{direction}"], 3), time_us_eager=round(eager, 2),
                             frac_eager=round(n * bb / eager / 1e3 / pinned[f"pinned_{direction}"], 3)))
    return rows


def _w1_cache(extra_blocks: int):
    B, ctx, hkv, hq, d = 64, 4096, 8, 32, 128
    bs = 16
    need = B * ctx // bs + extra_blocks
    cache = PagedKVCache(1, hkv, d, num_pages=need, page_tokens=bs, kv_dtype="fp16", device="cuda",
                         prefix_caching=False)
    k = torch.randn(1, ctx, hkv, d, dtype=torch.float16, device="cuda")
    for i in range(B):
        cache.add(i, list(range(i * ctx, (i + 1) * ctx)), k, k)
    q = torch.randn(B, hq, d, dtype=torch.float16, device="cuda")
    return cache, q, list(range(B))


def w1_decode():
    """One W1 decode step (64 sequences x 4k tokens, one layer) as a call: what ``beside`` rows run transfers by."""
    cache, q, seqs = _w1_cache(extra_blocks=16)
    meta = cache.vllm_metadata(seqs)
    kc, vc = cache.k_cache(0), cache.v_cache(0)
    plan = DecodePlan(meta.block_table, meta.seq_lens, layout=cache.layout, k_cache=kc, v_cache=vc, num_q_heads=32,
                      q_dtype=q.dtype)
    return lambda: plan.run(q, kc, vc)


def beside_rows(pinned: dict) -> list[dict]:
    """Decode alone vs decode with transfers queued on a side stream the whole time."""
    decode = w1_decode()
    steps = 100
    alone = _time_us(decode, reps=steps)
    chunk = 16 << 20
    src = torch.empty(64 * chunk, dtype=torch.uint8, device="cuda")
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    nb = chunk // (64 << 10)
    dev_ids = torch.randperm(64 * nb, device="cuda")[:nb].to(torch.int64)
    seq = torch.arange(nb, dtype=torch.int64, device="cuda")
    geo = dict(num_rows=1, row_bytes=64 << 10, src_row_stride=0, dst_row_stride=0, src_block_stride=64 << 10,
               dst_block_stride=64 << 10)
    variants = [("dma", None)] + [("sm", cap) for cap in SM_CAPS]
    rows = []
    side = torch.cuda.Stream()
    for path, cap in variants:
        if path == "dma":
            one = lambda: host.copy_(src[:chunk], non_blocking=True)
        else:
            one = lambda c=cap: move_blocks(src, dev_ids, host, seq, num_programs=c, **geo)
        with torch.cuda.stream(side):
            t_x = _time_us(one, reps=5)
        n_x = int(steps * alone / t_x) + 4  # enough transfers to outlast the decodes
        torch.cuda.synchronize()
        xs, xe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ds, de = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            xs.record()
            for _ in range(n_x):
                one()
            xe.record()
        ds.record()
        for _ in range(steps):
            decode()
        de.record()
        torch.cuda.synchronize()
        t_dec = ds.elapsed_time(de) * 1e3 / steps
        x_gbps = n_x * chunk / (xs.elapsed_time(xe) * 1e3) / 1e3
        rows.append(dict(section="beside", path=path, sm_programs=cap, decode_alone_us=round(alone, 2),
                         decode_beside_us=round(t_dec, 2), slowdown=round(t_dec / alone - 1, 4),
                         transfer_alone_gbps=round(chunk / t_x / 1e3, 2), transfer_beside_gbps=round(x_gbps, 2),
                         frac_beside=round(x_gbps / pinned["pinned_d2h"], 3)))
    return rows


def overlap_rows(pinned: dict) -> list[dict]:
    """A prefetch (BlockMover swap-in, batches of 1024 blocks) beside 20 decode steps: how much of it is hidden."""
    return [_overlap_case(path, pinned, programs) for path, programs in (("dma", None), ("dma", 32), ("dma", 8),
                                                                         ("sm", None), ("sm", 16))]


def _overlap_case(path: str, pinned: dict, programs: int | None, steps: int = 20, batch: int = 1024) -> dict:
    cache, q, seqs = _w1_cache(extra_blocks=4096)
    meta = cache.vllm_metadata(seqs)
    kc, vc = cache.k_cache(0), cache.v_cache(0)
    plan = DecodePlan(meta.block_table, meta.seq_lens, layout=cache.layout, k_cache=kc, v_cache=vc,
                      num_q_heads=32, q_dtype=q.dtype)
    bb = block_bytes(cache, 16)
    t_c = _time_us(lambda: [plan.run(q, kc, vc) for _ in range(steps)], reps=3)
    n_batches = max(1, int(0.8 * t_c * 1e-6 * pinned["pinned_h2d"] * 1e9 / (batch * bb)))
    host = HostPool(n_batches * batch * bb, bb, pin=True)
    host.buffer.random_(0, 255)
    mover = BlockMover(cache, host, path=path, **{f"{path}_programs": programs})
    free = cache.manager.pool.allocate(16, n_batches * batch)  # the prefetch's destination blocks
    starts = host.allocate([1] * (n_batches * batch))

    def prefetch():
        return [mover.to_device(16, starts[i * batch:(i + 1) * batch], free[i * batch:(i + 1) * batch],
                                ordered=False)  # the steps queued before never touch these (free) blocks
                for i in range(n_batches)]

    t_x = _time_us(lambda: [t.wait() for t in prefetch()], reps=3)
    torch.cuda.synchronize()
    s, d_end, e = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    times, dec, issue = [], [], []
    for _ in range(3):  # the steps are queued first, then the prefetch is issued while they run (as an engine would)
        s.record()
        for _ in range(steps):
            plan.run(q, kc, vc)
        d_end.record()
        t0 = time.perf_counter()
        moves = prefetch()
        issue.append((time.perf_counter() - t0) * 1e6)
        for t in moves:
            t.wait()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
        dec.append(s.elapsed_time(d_end) * 1e3)
    t_both, t_dec = statistics.median(times), statistics.median(dec)
    hidden = (t_c + t_x - t_both) / t_x
    return dict(section="overlap", path=path, programs=programs, block_bytes=bb, batch=batch, batches=n_batches,
                compute_us=round(t_c, 1), transfer_us=round(t_x, 1), both_us=round(t_both, 1),
                hidden=round(hidden, 3), decode_slowdown=round(t_dec / t_c - 1, 4),
                transfer_gbps=round(n_batches * batch * bb / t_x / 1e3, 2), issue_us=round(statistics.median(issue), 1))


def check_rows() -> list[dict]:
    """TieredCache on the GPU, both paths: swap round trip and prefix promotion bit-exact; disk bandwidth."""
    rows = []
    for path in ("dma", "sm"):
        for kv_dtype in TIER_BENCH_SCHEMES:
            cache = PagedKVCache(4, 8, 128, num_pages=64, page_tokens=16, kv_dtype=kv_dtype, device="cuda")
            with tempfile.TemporaryDirectory() as d:
                bb = block_bytes(cache, 16)
                tc = TieredCache(cache, host_bytes=8 * bb, disk_path=d, disk_bytes=256 * bb, path=path, fsync=False)
                k = torch.randn(4, 200, 8, 128, dtype=torch.float16, device="cuda")
                tc.add("a", list(range(200)), k, k * 0.5)
                raw = cache.blocks(16)[:, :, cache.manager.block_table("a")].view(torch.uint8).clone()
                tc.swap_out(["a"])
                tc.evict()
                tc.swap_in(["a"])
                ok_swap = torch.equal(cache.blocks(16)[:, :, cache.manager.block_table("a")].view(torch.uint8), raw)
                want = cache.read("a")
                tc.free("a")
                tc.evict()
                tc.add("b", list(range(200)), k * 3, k)  # hit: must come from below, not from these K/V
                got = cache.read("b")
                ok_prefix = torch.equal(got[0][:, :192], want[0][:, :192])
                st = tc.stats()
                rows.append(dict(section="check", path=path, kv_dtype=kv_dtype, swap_exact=ok_swap,
                                 prefix_exact=ok_prefix, promoted=st["promoted_host"] + st["promoted_disk"],
                                 to_disk=st["to_disk"], ok=bool(ok_swap and ok_prefix)))
                tc.close()
    with tempfile.TemporaryDirectory() as d:
        pool = DiskPool(d, 2 << 30, fsync=True)
        blocks = torch.empty((64, 2 << 20), dtype=torch.uint8).random_(0, 255)
        keys = [i.to_bytes(16, "little") for i in range(64)]
        t0 = time.perf_counter()
        pool.put(keys, blocks)
        tw = time.perf_counter() - t0
        out = torch.empty_like(blocks)
        t0 = time.perf_counter()
        pool.get_into(keys, out)
        tr = time.perf_counter() - t0
        rows.append(dict(section="disk", bytes=blocks.numel(), write_gbps=round(blocks.numel() / tw / 1e9, 2),
                         read_gbps=round(blocks.numel() / tr / 1e9, 2), exact=torch.equal(out, blocks),
                         note="fsync'd segment write; the read may come from the page cache"))
        pool.close()
    return rows


def _summary(rows: list[dict], pinned: dict | None) -> None:
    if pinned is None:  # --smoke: the formats section alone
        return
    print(f"pinned h2d {pinned['pinned_h2d']:.1f} GB/s, d2h {pinned['pinned_d2h']:.1f} GB/s; pageable "
          f"{pinned['pageable_h2d']:.1f} / {pinned['pageable_d2h']:.1f}")
    link = [r for r in rows if r["section"] == "link"]
    for path in ("dma", "dma_per_block", "sm"):
        for d in ("d2h", "h2d"):
            big = [r["frac"] for r in link if r["path"] == path and r["direction"] == d and r["bytes"] >= 2 << 20]
            b32 = [r["frac"] for r in link if r["path"] == path and r["direction"] == d
                   and r["block_bytes"] == 32 << 10 and r["blocks"] >= 64]
            if big:
                print(f"{path:>14} {d}: batches >= 2 MiB min frac {min(big):.3f}; 32 KiB blocks x >= 64: "
                      f"{', '.join(f'{f:.3f}' for f in b32) or '-'}")
    for r in rows:
        if r["section"] in ("beside", "overlap", "check", "disk"):
            print({k: v for k, v in r.items() if k not in ("gpu", "torch", "triton", "commit", "date")})


def main(argv: list[str] | None = None) -> int:
    parser = BenchParser("tiers", __doc__, smoke=tier_formats.SMOKE_HELP, gpu=True)
    parser.add_argument("--quick", action="store_true", help="every third block size only (formats: blocks of 16, "
                                                             "batches of 64 and 256)")
    parser.add_argument("--only", action="append", choices=SECTIONS, default=None)
    args = parser.parse_args(argv)
    if args.smoke and set(args.only or ["formats"]) != {"formats"}:
        parser.error(f"argument --smoke: runs the formats section alone, got --only {' '.join(args.only)}")
    out = parser.start(args)
    if out is None:
        return 2
    only = {"formats"} if args.smoke else set(args.only or SECTIONS)
    t0 = time.perf_counter()
    pinned = None if args.smoke else pinned_bandwidth()
    rows: list[dict] = []
    if "link" in only:
        rows += link_rows(pinned, args.quick)
    if "beside" in only:
        rows += beside_rows(pinned)
    if "overlap" in only:
        rows += overlap_rows(pinned)
    if "check" in only:
        rows += check_rows()
    if "formats" in only:
        rows += tier_formats.format_rows(pinned, smoke=args.smoke, quick=args.quick,
                                         decode=None if args.smoke else w1_decode())
    meta = provenance.machine_meta()
    link = [{k: r[k] for k in ("path", "direction", "bytes", "gbps", "block_bytes", "blocks")}
            for r in rows if r["section"] == "link" and r["path"] in ("dma", "sm")]
    extra = {"pinned_gbps": pinned and {"h2d": pinned["pinned_h2d"], "d2h": pinned["pinned_d2h"]},
             "pageable_gbps": pinned and {"h2d": pinned["pageable_h2d"], "d2h": pinned["pageable_d2h"]},
             "link": link, "quick": args.quick, "smoke": args.smoke, "sections": sorted(only),
             "wall_s": round(time.perf_counter() - t0, 1)}
    _summary(rows, pinned)
    if "formats" in only:
        tier_formats.summary(rows)
    path = run_files.write_results("tiers", rows, meta, out, extra=extra)
    print(f"results: {path}  ({extra['wall_s']} s)")
    bad = [r for r in rows if r.get("ok") is False or r.get("exact") is False]
    return 1 if bad else 0
