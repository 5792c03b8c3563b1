"""Paged decode attention on the GPU: ours against SDPA, gather-then-SDPA and FlexAttention paged.

``python -m workbench bench decode [--smoke] [--quick] [--out DIR] [--impl NAME ...]``

(``--impl NAME``: any registered implementation beside ours and the peers; ``python -m workbench`` hands that run
to ``workbench/bench/byok_decode.py``. What both time, and how: ``workbench/bench/decode_timing.py``.)

Per workload W1-W5 (fp16, 16-token pages, NHD, fragmented pool): a few launch variants of
``paged_decode`` (the heuristic's pick first; timed as ``DecodePlan.run``, the per-layer path, with the plan
built once outside the timed call) and the peers the H200 image has:

- ``sdpa_contiguous``: ``scaled_dot_product_attention`` on a contiguous ``[B, Hkv, L, D]`` cache,
  ``enable_gqa=True``. The ragged W5 pads every sequence to the longest and passes a boolean
  mask, which rules out the flash backend: SDPA takes its slower masked path there
  (``docs/workloads.md`` defines W1-W5).
- ``gather_sdpa``: naive paging: index the pages into a contiguous tensor, then SDPA (timed together).
- ``flex_paged``: ``torch.compile(flex_attention)`` with a block mask converted by
  ``torch.nn.attention.experimental._paged_attention.PagedAttention`` from the page table,
  on the ``[1, Hkv, pages * page_size, D]`` cache that class expects.

A peer that fails becomes a row with an ``error`` field. Every row carries ``time_us`` (the lower of
two ``do_bench`` medians), ``time_us_graph`` (CUDA-graph replay), ``gbps`` and ``frac_copy_bw`` against the
copy bandwidth measured in the same run, and ``rel_err`` against a float32 reference computed on
the GPU from the contiguous cache; ours rows also carry ``x_<peer>`` = peer time / our time.
Then sweeps on W1 (layouts x page sizes x fp16/bf16; block-stride alignment) and W2
(``num_stages``). ``--smoke`` runs tiny workloads through the interpreter (correctness only).
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

import workbench  # noqa: F401  (backend first)
from workbench.bench import harness
from workbench.bench.command import SMOKE_HELP, BenchParser
from workbench.bench.decode_timing import (
    DTYPES,
    decode_row,
    free_memory,
    heuristic_config,
    ours_fn,
    peer_fns,
    print_row,
    ref_fp32,
    time_eager_and_graph,
)
from workbench.core.workloads import WORKLOADS, Workload, build_paged, bytes_moved, contiguous_kv
from workbench.kernels import decode_config, paged_decode
from workbench.kernels.decode.reference import paged_decode_ref
from workbench.results import provenance, run_files

COLUMNS = ["workload", "impl", "variant", "layout", "block_size", "kv_dtype", "time_us", "time_us_graph", "gbps",
           "frac_copy_bw", "frac_copy_bw_graph", "rel_err", "x_sdpa_contiguous", "x_gather_sdpa", "x_flex_paged"]


def variants(w: Workload, base: dict, tune: bool) -> list[tuple[str, dict]]:
    """(name, config) pairs to time: the heuristic's pick first, then single changes to it."""
    s = base["num_splits"]
    out = [("heuristic", dict(base))]
    alts = [("splits/2", {"num_splits": max(1, s // 2)}), ("splits*2", {"num_splits": s * 2}),
            ("BLOCK_N64-stages3", {"BLOCK_N": 64, "num_stages": 3})]
    if tune:
        alts += [("stages3", {"num_stages": 3}), ("stages4", {"num_stages": 4}), ("stages5", {"num_stages": 5}),
                 ("BLOCK_N64-stages4", {"BLOCK_N": 64, "num_stages": 4}), ("warps8", {"num_warps": 8})]
    seen = {tuple(sorted(base.items()))}
    for name, change in alts:
        cfg = {**base, **change}
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            seen.add(key)
            out.append((name, cfg))
    return out


def run_main(w: Workload, copy_gbps: float, tune: bool, rep_ms: float) -> list[dict]:
    """Peers and our variants on one workload (fp16, 16-token pages, NHD)."""
    p = build_paged(w, layout="nhd", block_size=16, kv_dtype=torch.float16, device="cuda")
    k, v = contiguous_kv(p)
    ref = ref_fp32(p.q, k, v, p.lens)
    nbytes = bytes_moved(w, 2, 2)
    rows, peer_t = [], {}
    out = torch.empty_like(p.q)
    base = heuristic_config(p, torch.float16)
    for name, cfg in variants(w, base, tune):  # ours first: a peer's compile must not disturb our timing
        try:
            fn = ours_fn(p, cfg, out)
            out.fill_(float("nan"))
            fn()
            err = harness.rel_err(out, ref)
            t, tg, _ = time_eager_and_graph(fn, rep_ms, graph=True)
            rows.append(decode_row(w, "ours", name, p, "fp16", nbytes, copy_gbps, t, tg, err, cfg))
        except Exception as e:  # noqa: BLE001  (e.g. a variant out of shared memory)
            rows.append(decode_row(w, "ours", name, p, "fp16", nbytes, copy_gbps, None, None, None, cfg,
                                   {"error": f"{type(e).__name__}: {str(e)[:200]}"}))
        print_row(rows[-1])
    ours_rows = list(rows)
    for name, fn in peer_fns(p, k, v).items():
        if isinstance(fn, Exception):
            rows.append(decode_row(w, name, "", p, "fp16", nbytes, copy_gbps, None, None, None,
                                   extra={"error": f"{type(fn).__name__}: {str(fn)[:200]}"}))
            continue
        try:
            got = fn().squeeze(2)
            err = harness.rel_err(got, ref)
            t, tg, gerr = time_eager_and_graph(fn, rep_ms, graph=True)
            peer_t[name] = t
            rows.append(decode_row(w, name, "", p, "fp16", nbytes, copy_gbps, t, tg, err,
                                   extra={"error": gerr} if gerr else None))
        except Exception as e:  # noqa: BLE001  (a peer failure is a row, not a crash)
            rows.append(decode_row(w, name, "", p, "fp16", nbytes, copy_gbps, None, None, None,
                                   extra={"error": f"{type(e).__name__}: {str(e)[:200]}"}))
        print_row(rows[-1])
        free_memory()
    for r in ours_rows:
        if r.get("time_us"):
            r.update({f"x_{peer}": pt / r["time_us"] for peer, pt in peer_t.items()})
    del p, k, v, ref, out
    free_memory()
    return rows


def run_sweep_point(w, copy_gbps, rep_ms, *, sweep, layout="nhd", block_size=16, kv="fp16", pad=0, change=None):
    """Our heuristic config (plus ``change``) on one cache variant; rel_err vs float32 on the contiguous cache."""
    kv_dtype = DTYPES[kv]
    p = build_paged(w, layout=layout, block_size=block_size, kv_dtype=kv_dtype, device="cuda", block_stride_pad=pad)
    out = torch.empty_like(p.q)
    cfg = {**heuristic_config(p, kv_dtype), **(change or {})}
    extra = {"sweep": sweep, "block_stride_pad": pad}
    try:
        fn = ours_fn(p, cfg, out)
        out.fill_(float("nan"))
        fn()
        k, v = contiguous_kv(p, dtype=torch.float16 if kv_dtype.itemsize == 1 else None)
        err = harness.rel_err(out, ref_fp32(p.q, k, v, p.lens))
        del k, v
        free_memory()
        t, tg, _ = time_eager_and_graph(fn, rep_ms, graph=True)
        nbytes = bytes_moved(w, kv_dtype.itemsize, p.q.element_size())
        row = decode_row(w, "ours", sweep, p, kv, nbytes, copy_gbps, t, tg, err, cfg, extra)
    except Exception as e:  # noqa: BLE001
        row = decode_row(w, "ours", sweep, p, kv, 0, copy_gbps, None, None, None, cfg,
                         {**extra, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    print_row(row)
    del p, out
    free_memory()
    return row


def run_gpu(quick: bool, tune: bool) -> tuple[list[dict], dict]:
    copy_gbps = harness.copy_bandwidth_gbps()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    rows = []
    for w in WORKLOADS.values():
        rows += run_main(w, copy_gbps, tune, rep_ms=100)
    w1, w2 = WORKLOADS["W1"], WORKLOADS["W2"]
    layouts = ["nhd", "hnd", "vllm"]
    sizes = [16, 64] if quick else [8, 16, 32, 64, 128]
    kvs = ["fp16"] if quick else ["fp16", "bf16"]
    for kv in kvs:
        for layout in layouts:
            for bs in sizes:
                rows.append(run_sweep_point(w1, copy_gbps, 50, sweep="layout", layout=layout, block_size=bs, kv=kv))
    for layout in ["nhd", "vllm"]:  # fp8 storage: half the bytes
        rows.append(run_sweep_point(w1, copy_gbps, 50, sweep="fp8", layout=layout, kv="fp8_e4m3"))
    for pad in [0, 1, 8, 64]:  # elements added to the 32 KB block stride: 128-byte aligned, 2-byte, 16-byte, 128-byte
        rows.append(run_sweep_point(w1, copy_gbps, 50, sweep="align", pad=pad))
    for stages in [1, 2, 3, 4] if not quick else [2, 4]:
        rows.append(run_sweep_point(w2, copy_gbps, 50, sweep="stages", change={"num_stages": stages}))
    return rows, {"copy_gbps": copy_gbps}


def run_smoke(progress: bool = False) -> list[dict]:
    """Tiny workloads through whatever backend is active (the interpreter on a CPU): correctness only.

    ``progress``: a tqdm bar over the workloads on stderr (~20 s in the interpreter, otherwise silent).
    """
    rows = []
    dev = workbench.device()
    for w in tqdm(WORKLOADS.values(), desc="decode smoke", unit="workload", file=sys.stderr, disable=not progress):
        s = w.smoke()
        for layout, bs in [("nhd", 16), ("vllm", 8)] if s.key == "W1" else [("nhd", 16)]:
            p = build_paged(s, layout=layout, block_size=bs, device=dev, seed=1)
            ref = paged_decode_ref(p.q, p.k_cache, p.v_cache, layout, p.block_table, p.seq_lens)
            for splits in (1, 2) if s.key == "W1" else (1,):  # the split path once: tests/test_decode* cover it
                got = paged_decode(p.q, p.k_cache, p.v_cache, layout, p.block_table, p.seq_lens, num_splits=splits)
                cfg = {**decode_config(1, 1, 1, 64, bs, p.max_seq_len), "num_splits": splits}
                rows.append(decode_row(s, "ours", f"splits{splits}", p, "fp16", bytes_moved(s, 2, 2), 0.0, None, None,
                                       harness.rel_err(got, ref), cfg, {"sweep": "smoke"}))
            if layout == "nhd":
                k, v = contiguous_kv(p)
                for name, fn in peer_fns(p, k, v).items():
                    if name == "flex_paged" or isinstance(fn, Exception):
                        continue  # flex needs torch.compile on a GPU
                    rows.append(decode_row(s, name, "", p, "fp16", bytes_moved(s, 2, 2), 0.0, None, None,
                                           harness.rel_err(fn().squeeze(2), ref), None, {"sweep": "smoke"}))
    return rows


def summary(rows: list[dict]) -> None:
    """Per workload: the heuristic's row, the best of ours, and each peer (fraction of copy bandwidth)."""
    main_rows = [r for r in rows if not r.get("sweep") and r.get("time_us")]
    for key in dict.fromkeys(r["workload"] for r in main_rows):
        rs = [r for r in main_rows if r["workload"] == key]
        ours = [r for r in rs if r["impl"] == "ours"]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["time_us"])
        heur = next((r for r in ours if r["variant"] == "heuristic"), best)
        peers = "  ".join(f"{r['impl']} {r['frac_copy_bw']:.3f}" for r in rs if r["impl"] != "ours")
        print(f"{key}: heuristic {heur['frac_copy_bw']:.3f} (graph {heur.get('frac_copy_bw_graph') or 0:.3f}), "
              f"best {best['variant']} {best['frac_copy_bw']:.3f} (graph {best.get('frac_copy_bw_graph') or 0:.3f}) "
              f"| {peers}")


def main(argv: list[str] | None = None) -> int:
    ap = BenchParser("decode", __doc__, smoke=SMOKE_HELP, gpu=True)
    ap.add_argument("--quick", action="store_true", help="fewer sweep points")
    ap.add_argument("--tune", action="store_true", help="time more launch variants per workload")
    ap.add_argument("--impl", action="append", default=[], metavar="NAME",
                    help="time a registered decode implementation beside ours and the installed peers instead "
                         "(repeatable; workbench.bench.byok_decode: bench decode --impl NAME --help for its options)")
    ap.add_argument("--load", action="append", default=[], metavar="MODULE",
                    help="with --impl: import a .py file or module first (its conformance.register calls run)")
    args = ap.parse_args(argv)
    if args.impl or args.load:  # python -m workbench hands these runs to byok_decode.main, with its own options
        ap.error("argument --impl/--load: run by workbench.bench.byok_decode.main (python -m workbench bench decode "
                 "--impl NAME)")
    out = ap.start(args)  # checked before the run, not after
    if out is None:
        return 2
    meta = provenance.machine_meta()
    if args.smoke:
        rows, extra = run_smoke(progress=True), {"mode": "smoke"}
    else:
        rows, extra = run_gpu(args.quick, args.tune)
        extra["mode"] = "quick" if args.quick else "full"
    run_files.print_table(rows, COLUMNS)
    summary(rows)
    path = run_files.write_results("decode", rows, meta, out, extra=extra)
    print(f"wrote {path}")
    bad = [r for r in rows if r["impl"] == "ours" and (r.get("rel_err") is None or r["rel_err"] > 2e-2)
           and not r.get("error")]
    return 1 if bad else 0

