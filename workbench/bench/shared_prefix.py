"""Shared-prefix decode on the GPU: plain paged decode, the cascade and SDPA on a contiguous cache, in one run.

``python -m workbench bench shared_prefix [--smoke] [--prefixes 128,1024,8192,32768] [--sharers 1,4,16,64,256]
[--suffixes 128,1024] [--gqa 32/8,32/32] [--rep-ms 50] [--no-sweep] [--out DIR]``

Workload: ``sharers`` sequences hold one ``prefix``-token prompt (the same physical blocks) and ``suffix`` tokens of
their own; head_dim 128, 16-token pages handed out by a random permutation of the pool, fp16, random normal K/V and
queries. Per point (prefix x sharers x suffix x GQA ratio):

- ``plain``: our paged decode (:class:`~workbench.kernels.DecodePlan`): every sharer reads the prefix;
- ``cascade``: :class:`~workbench.kernels.CascadePlan` on the runs :func:`~workbench.shared_prefix.find_shared_runs`
  finds in the table (the prefix read once per tile of ``rows_per_tile`` stacked query heads);
- ``sdpa``: ``scaled_dot_product_attention`` over a contiguous ``[B, Hkv, L, D]`` copy of every sequence's K/V
  (skipped, and said so, where that copy would not fit in 40 GB).

Every row: ``time_us`` (eager, ``do_bench`` median), ``time_us_graph`` (CUDA-graph replay: what the cost model is
fitted on, as serving engines replay decode steps), ``bytes`` (K/V the path reads), ``gbps``; cascade rows
``speedup`` / ``speedup_graph`` over plain and ``rel_err`` against plain's output. Sections:

- ``tile_sweep``: ``rows_per_tile`` x ``num_warps`` of the shared pass at three points; the best per GQA ratio is
  used for the rest of the run;
- ``map``: the crossover map above;
- ``fp8``, ``nested``: fp8 KV (per-tensor scales) and a two-level tree (a system prompt shared by all, forks of
  eight requests below it);
- ``batching``: 256 sequences (16 prompts of 2k tokens, 16 samples each, arriving shuffled) run as batches of 32 in
  arrival order or as :func:`~workbench.shared_prefix.group_by_overlap` groups them: bytes and time of a step.

The run ends with the cost model fitted on the map (``extra["fitted_model"]``) and the selector's pick per map point
under it (``auto_path``, and whether the pick was right: ``auto_ok``).

``--smoke`` runs tiny shapes through the interpreter on a CPU: correctness only (no times).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random

import torch
import torch.nn.functional as F

import workbench  # noqa: F401  (backend first)
from workbench.bench import harness
from workbench.bench.command import SMOKE_HELP, BenchParser
from workbench.core.argtypes import positive_float, positive_int_list
from workbench.kernels import CascadePlan, DecodePlan
from workbench.kernels.decode.reference import paged_decode_ref
from workbench.results import provenance, run_files
from workbench.shared_prefix import (
    Geometry,
    choose,
    cost_model,
    cut,
    find_shared_runs,
    fit,
    group_by_overlap,
    step_bytes,
)
from workbench.shared_prefix.batching import step_bytes_of_batches

COLUMNS = ["section", "gqa", "prefix", "sharers", "suffix", "impl", "launch", "time_us", "time_us_graph", "gbps",
           "speedup", "speedup_graph", "rel_err", "auto_path", "auto_ok"]
BLOCK = 16
HEAD_DIM = 128
SDPA_LIMIT = 40e9


class Point:
    """One batch: ``sharers`` sequences over a ``prefix``-token shared prompt (or a tree, ``groups``) + private
    suffixes, its caches, queries and both plans."""

    def __init__(self, prefix, sharers, suffix, hq, hkv, *, kv_dtype=torch.float16, groups=None, seed=0,
                 device="cuda", block=BLOCK, head_dim=HEAD_DIM):
        rng = random.Random(seed)
        tables, nxt = [], 0
        groups = groups or [(0, sharers)]  # (extra shared blocks of a fork group, members)
        shared = list(range(prefix // block))
        nxt = len(shared)
        for extra, members in groups:
            fork = list(range(nxt, nxt + extra))
            nxt += extra
            for _ in range(members):
                own = list(range(nxt, nxt + -(-suffix // block)))
                nxt += len(own)
                tables.append(shared + fork + own)
        perm = list(range(nxt))
        rng.shuffle(perm)
        width = max(len(t) for t in tables)
        self.lens = [prefix // block * block + extra * block + suffix for extra, m in groups for _ in range(m)]
        table = torch.tensor([[perm[b] for b in t] + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        g = torch.Generator(device=device).manual_seed(seed)
        shape = (nxt, block, hkv, head_dim)
        self.k = torch.randn(shape, generator=g, device=device).to(kv_dtype)
        self.v = torch.randn(shape, generator=g, device=device).to(kv_dtype)
        self.q = torch.randn((len(tables), hq, head_dim), generator=g, device=device).to(torch.float16)
        self.table = table.to(device)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32, device=device)
        self.scales = dict(k_scale=0.5, v_scale=0.5) if kv_dtype != torch.float16 else {}
        self.geo = Geometry(hq, hkv, head_dim, block, float(self.k.element_size()))
        self.runs = find_shared_runs(self.table, self.lens, block)
        self.segments, self.suffix_start = cut(self.runs, range(len(self.runs)), len(tables))

    def plain(self):
        return DecodePlan(self.table, self.seq_lens, layout="nhd", k_cache=self.k, v_cache=self.v,
                          num_q_heads=self.q.shape[1], q_dtype=self.q.dtype, max_seq_len=max(self.lens), **self.scales)

    def cascade(self, rows_per_tile, plan_kw: dict | None = None, **shared_launch):
        """The cascade plan at ``rows_per_tile`` with ``shared_launch`` for its shared pass; ``plan_kw``: other
        :class:`CascadePlan` options (``overlap``, ``fuse_gather``)."""
        return CascadePlan(self.table, self.seq_lens, self.segments, self.suffix_start, layout="nhd", k_cache=self.k,
                           v_cache=self.v, num_q_heads=self.q.shape[1], q_dtype=self.q.dtype,
                           rows_per_tile=rows_per_tile, shared_launch=shared_launch or None, **self.scales,
                           **(plan_kw or {}))

    def bytes(self, rows_per_tile) -> dict:
        geo = dataclasses.replace(self.geo, rows_per_tile=rows_per_tile)
        return step_bytes(self.segments, self.lens, self.suffix_start, geo)


def _times(fn, rep_ms) -> tuple[float, float]:
    return harness.time_us(fn, rep_ms=rep_ms), harness.time_us_graph(fn, rep_ms=rep_ms)


def _row(section, p: Point, impl, t, tg, nbytes, **kw) -> dict:
    return {"section": section, "gqa": f"{p.q.shape[1]}/{p.k.shape[2]}", "prefix": kw.pop("prefix"),
            "sharers": kw.pop("sharers"), "suffix": kw.pop("suffix"), "impl": impl, "time_us": t, "time_us_graph": tg,
            "bytes": nbytes, "gbps": nbytes / (tg * 1e3) if tg else None, **kw}


def measure(section, p: Point, rows_per_tile, rep_ms, where: dict, sdpa=True) -> list[dict]:
    """Plain, cascade (and SDPA) at one point, checked against each other first."""
    plain = p.plain()
    ref = plain.run(p.q, p.k, p.v)
    b = p.bytes(rows_per_tile)
    t_p, tg_p = _times(lambda: plain.run(p.q, p.k, p.v), rep_ms)
    rows = [_row(section, p, "plain", t_p, tg_p, b["plain"], **where)]
    if p.segments:
        casc = p.cascade(rows_per_tile)
        err = harness.rel_err(casc.run(p.q, p.k, p.v).float(), ref.float())
        t_c, tg_c = _times(lambda: casc.run(p.q, p.k, p.v), rep_ms)
        rows.append(_row(section, p, "cascade", t_c, tg_c, b["cascade"], rel_err=err, speedup=t_p / t_c,
                         speedup_graph=tg_p / tg_c, rows_per_tile=rows_per_tile, shared_bytes=b["shared"],
                         suffix_bytes=b["suffix"], plain_bytes=b["plain"], plain_us_graph=tg_p, plain_us_eager=t_p,
                         **where))
    contiguous = b["plain"]  # K and V of every sequence, copied out
    if sdpa and contiguous <= SDPA_LIMIT:
        rows.append(_sdpa_row(section, p, ref, tg_p, rep_ms, where))
    elif sdpa:
        rows.append(_row(section, p, "sdpa", None, None, contiguous,
                         skipped=f"contiguous copy {contiguous / 1e9:.0f} GB", **where))
    return rows


def _sdpa_row(section, p: Point, ref, tg_plain, rep_ms, where) -> dict:
    B, n = len(p.lens), max(p.lens)
    hkv = p.k.shape[2]
    k = torch.zeros((B, hkv, n, p.k.shape[3]), dtype=torch.float16, device=p.q.device)
    v = torch.zeros_like(k)
    for i, length in enumerate(p.lens):
        blocks = p.table[i, : -(-length // BLOCK)].long()
        k[i, :, :length] = p.k[blocks].reshape(-1, hkv, p.k.shape[3])[:length].transpose(0, 1).half()
        v[i, :, :length] = p.v[blocks].reshape(-1, hkv, p.k.shape[3])[:length].transpose(0, 1).half()
    q = p.q[:, :, None, :]
    mask = None
    if min(p.lens) != n:
        mask = (torch.arange(n, device=q.device)[None, :] < p.seq_lens[:, None])[:, None, None, :]
    fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
    err = harness.rel_err(fn()[:, :, 0].float(), ref.float())
    t, tg = _times(fn, rep_ms)
    nbytes = 2 * k.numel() * 2
    return _row(section, p, "sdpa", t, tg, nbytes, rel_err=err, speedup=None, speedup_graph=tg_plain / tg, **where)


SWEEP_POINTS = [(32768, 64, 1024), (8192, 16, 512), (1024, 256, 128)]


def tile_sweep(gqa, rep_ms) -> tuple[list[dict], int]:
    """Graph times of the cascade per ``rows_per_tile`` x ``num_warps`` at :data:`SWEEP_POINTS`; the best tile."""
    hq, hkv = gqa
    rows, score = [], {}
    for prefix, sharers, suffix in SWEEP_POINTS:
        p = Point(prefix, sharers, suffix, hq, hkv)
        ref = p.plain().run(p.q, p.k, p.v)
        for tile in (16, 32, 64, 128):
            for warps in (4, 8):
                try:
                    casc = p.cascade(tile, num_warps=warps)
                    err = harness.rel_err(casc.run(p.q, p.k, p.v).float(), ref.float())
                    tg = harness.time_us_graph(lambda c=casc, p=p: c.run(p.q, p.k, p.v), rep_ms=rep_ms)
                except Exception as e:  # noqa: BLE001  (a tile too large for the registers: say so, go on)
                    rows.append({"section": "tile_sweep", "gqa": f"{hq}/{hkv}", "prefix": prefix, "sharers": sharers,
                                 "suffix": suffix, "impl": "cascade", "launch": f"T{tile}-w{warps}",
                                 "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                rows.append({"section": "tile_sweep", "gqa": f"{hq}/{hkv}", "prefix": prefix, "sharers": sharers,
                             "suffix": suffix, "impl": "cascade", "launch": f"T{tile}-w{warps}", "rows_per_tile": tile,
                             "num_warps": warps, "time_us_graph": tg, "rel_err": err})
                score.setdefault((tile, warps), []).append(math.log(tg))
    full = {k: sum(v) for k, v in score.items() if len(v) == len(SWEEP_POINTS)}
    best = min(full, key=full.get) if full else (64, 4)
    return rows, best


def run_gpu(prefixes, sharers, suffixes, gqas, rep_ms, sweep=True, checkpoint=None) -> tuple[list[dict], dict]:
    """Every section on this GPU; ``checkpoint(rows)`` after each GQA ratio's map (a long run keeps what it did)."""
    copy_gbps = harness.copy_bandwidth_gbps()
    rows, tiles = [], {}
    for gqa in gqas:
        if sweep:
            r, best = tile_sweep(gqa, rep_ms)
            rows += r
        else:
            best = (64, 4)
        tiles[f"{gqa[0]}/{gqa[1]}"] = best
        print(f"gqa {gqa}: rows_per_tile {best[0]}, num_warps {best[1]}", flush=True)
    for gqa in gqas:
        tile = tiles[f"{gqa[0]}/{gqa[1]}"][0]
        for prefix in prefixes:
            for n in sharers:
                for suffix in suffixes:
                    p = Point(prefix, n, suffix, *gqa, seed=prefix + n + suffix)
                    rows += measure("map", p, tile, rep_ms, dict(prefix=prefix, sharers=n, suffix=suffix))
                    print(rows[-2] if len(rows) > 1 else rows[-1], flush=True)
        if checkpoint:
            checkpoint(rows)
    gqa0, tile0 = gqas[0], tiles[f"{gqas[0][0]}/{gqas[0][1]}"][0]
    for prefix, n, suffix in ((32768, 64, 1024), (8192, 16, 512)):
        p = Point(prefix, n, suffix, *gqa0, kv_dtype=torch.float8_e4m3fn, seed=7)
        rows += measure("fp8", p, tile0, rep_ms, dict(prefix=prefix, sharers=n, suffix=suffix), sdpa=False)
    p = Point(4096, 64, 256, *gqa0, groups=[(64, 8)] * 8, seed=8)  # 4k system prompt, 8 requests x 8 samples
    rows += measure("nested", p, tile0, rep_ms, dict(prefix=4096, sharers=64, suffix=256, levels=2), sdpa=False)
    rows += batching_rows(gqa0, tile0, rep_ms)
    casc = [r for r in rows if r["section"] == "map" and r["impl"] == "cascade"]
    model = fit([{**r, "plain_us": r["plain_us_graph"], "cascade_us": r["time_us_graph"]} for r in casc])
    eager = fit([{**r, "plain_us": r["plain_us_eager"], "cascade_us": r["time_us"]} for r in casc])
    for r in rows:
        if r["section"] == "map" and r["impl"] == "cascade":
            b = {"plain": r["plain_bytes"], "shared": r["shared_bytes"], "suffix": r["suffix_bytes"]}
            pick = "shared" if model.plain(b) > model.margin * model.cascade(b) else "plain"
            pick_e = "shared" if eager.plain(b) > eager.margin * eager.cascade(b) else "plain"
            r.update(auto_path=pick, auto_ok=pick == "plain" or r["speedup_graph"] > 1,
                     predicted_speedup=model.plain(b) / model.cascade(b),
                     auto_path_eager=pick_e, auto_ok_eager=pick_e == "plain" or r["speedup"] > 1)
    return rows, {"copy_gbps": copy_gbps, "rows_per_tile": {k: list(v) for k, v in tiles.items()},
                  "fitted_model": model.to_dict(), "fitted_model_eager": eager.to_dict()}


def batching_rows(gqa, tile, rep_ms) -> list[dict]:
    """One step of 256 sequences as batches of 32: arrival order against overlap-aware groups."""
    hq, hkv = gqa
    p = Point(2048, 256, 256, hq, hkv, groups=[(0, 16)] * 16, seed=9)
    # 16 prompts of their own: give each group its own prefix blocks by rebuilding the tables
    rng = random.Random(9)
    tables = p.table.tolist()
    n_pre = 2048 // BLOCK
    fresh = p.k.shape[0]
    for g in range(1, 16):
        for i in range(16 * g, 16 * (g + 1)):
            tables[i][:n_pre] = list(range(fresh + (g - 1) * n_pre, fresh + g * n_pre))
    extra = 15 * n_pre
    p.k = torch.cat([p.k, torch.randn((extra, *p.k.shape[1:]), device=p.k.device).half()])
    p.v = torch.cat([p.v, torch.randn((extra, *p.v.shape[1:]), device=p.v.device).half()])
    order = list(range(256))
    rng.shuffle(order)
    tables = [tables[i] for i in order]
    lens = [p.lens[i] for i in order]
    geo = Geometry(hq, hkv, HEAD_DIM, BLOCK, 2.0, tile)
    plans = {"arrival": [list(range(i, i + 32)) for i in range(0, 256, 32)],
             "grouped": group_by_overlap(tables, lens, BLOCK, 32)}
    q = p.q
    rows = []
    for name, batches in plans.items():
        steps = []
        for rows_b in batches:
            t = torch.tensor([tables[i] for i in rows_b], dtype=torch.int32, device=q.device)
            ln = torch.tensor([lens[i] for i in rows_b], dtype=torch.int32, device=q.device)
            runs = find_shared_runs(t, ln, BLOCK)
            segs, sfx = cut(runs, range(len(runs)), len(rows_b))
            pick = choose(runs, [lens[i] for i in rows_b], geo, cost_model())
            plan = (CascadePlan(t, ln, segs, sfx, layout="nhd", k_cache=p.k, v_cache=p.v, num_q_heads=hq,
                                q_dtype=q.dtype, rows_per_tile=tile) if pick.path == "shared" else
                    DecodePlan(t, ln, layout="nhd", k_cache=p.k, v_cache=p.v, num_q_heads=hq, q_dtype=q.dtype))
            qb = q[torch.tensor(rows_b, device=q.device)].contiguous()
            steps.append((plan, qb))

        def step(steps=steps):
            for plan, qb in steps:
                plan.run(qb, p.k, p.v)
        t, tg = _times(step, rep_ms)
        b = step_bytes_of_batches(batches, tables, lens, geo)
        rows.append({"section": "batching", "gqa": f"{hq}/{hkv}", "prefix": 2048, "sharers": 16, "suffix": 256,
                     "impl": name, "batches": len(batches), "time_us": t, "time_us_graph": tg, "bytes": b["cascade"],
                     "plain_bytes": b["plain"], "gbps": b["cascade"] / (tg * 1e3)})
    return rows


def run_smoke() -> list[dict]:
    """Tiny shapes through the interpreter: the cascade against the float64 reference (no times)."""
    dev = workbench.device()
    rows = []
    for prefix, n, suffix, hq, hkv, kv in ((64, 3, 20, 4, 2, torch.float16), (32, 2, 5, 2, 2, torch.float8_e4m3fn)):
        p = Point(prefix, n, suffix, hq, hkv, kv_dtype=kv, device=dev, block=8, head_dim=32, seed=1)
        out = p.cascade(16).run(p.q, p.k, p.v)
        ref = paged_decode_ref(p.q, p.k, p.v, "nhd", p.table, p.seq_lens, **p.scales)
        rows.append({"section": "smoke", "gqa": f"{hq}/{hkv}", "prefix": prefix, "sharers": n, "suffix": suffix,
                     "impl": "cascade", "rel_err": harness.rel_err(out.cpu(), ref.cpu())})
    return rows


def _gqas(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(x) for x in g.split("/")) for g in text.split(",") if g.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ratios like 32/8,32/32, got {text!r}") from None
    if not out or any(len(g) != 2 or g[1] < 1 or g[0] % g[1] for g in out):
        raise argparse.ArgumentTypeError(f"expected ratios like 32/8,32/32 (q heads a multiple of kv), got {text!r}")
    return out


def parser() -> BenchParser:
    ap = BenchParser("shared_prefix", __doc__, smoke=SMOKE_HELP, gpu=True)
    ap.add_argument("--prefixes", type=positive_int_list, default=[128, 1024, 8192, 32768], help="shared prefix tokens")
    ap.add_argument("--sharers", type=positive_int_list, default=[1, 4, 16, 64, 256], help="sequences sharing it")
    ap.add_argument("--suffixes", type=positive_int_list, default=[128, 1024], help="private tokens per sequence")
    ap.add_argument("--gqa", type=_gqas, default=[(32, 8), (32, 32)], help="query/kv heads, comma-separated")
    ap.add_argument("--rep-ms", type=positive_float, default=50.0, help="do_bench repetition time")
    ap.add_argument("--no-sweep", action="store_true", help="skip the rows_per_tile sweep (64 rows, 4 warps)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    out = ap.start(args)
    if out is None:
        return 2
    meta = provenance.machine_meta()
    if args.smoke:
        rows, extra = run_smoke(), {"mode": "smoke"}
    else:
        def checkpoint(rows):
            run_files.write_results("shared-prefix", rows, meta, out, extra={"mode": "partial"})

        rows, extra = run_gpu(args.prefixes, args.sharers, args.suffixes, args.gqa, args.rep_ms, not args.no_sweep,
                              checkpoint)
        extra["mode"] = "full"
    run_files.print_table(rows, COLUMNS)
    path = run_files.write_results("shared-prefix", rows, meta, out, extra=extra)
    print(f"wrote {path}")
    bad = [r for r in rows if r.get("impl") == "cascade" and (r.get("rel_err") is None or r["rel_err"] > 2e-2)
           and "error" not in r]
    return 1 if bad else 0
