"""Paged decode attention on the GPU: ours against SDPA, gather-then-SDPA and FlexAttention paged.

``python -m workbench bench decode [--smoke] [--quick] [--out DIR] [--impl NAME ...]``

(``--impl NAME``: any registered implementation beside ours and the peers; ``python -m workbench`` hands that run
to ``workbench/bench/byok_decode.py``.)

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

import argparse
import gc
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import workbench  # noqa: F401  (backend first)
from workbench import formats
from workbench.bench import harness
from workbench.bench.workloads import WORKLOADS, PagedKV, Workload, build_paged, bytes_moved, contiguous_kv
from workbench.kernels import DecodePlan, decode_config, paged_decode
from workbench.kernels.decode.reference import paged_decode_ref

COLUMNS = ["workload", "impl", "variant", "layout", "block_size", "kv_dtype", "time_us", "time_us_graph", "gbps",
           "frac_copy_bw", "frac_copy_bw_graph", "rel_err", "x_sdpa_contiguous", "x_gather_sdpa", "x_flex_paged"]
PEERS = ("sdpa_contiguous", "gather_sdpa", "flex_paged")
DTYPES = {name: formats.get(name).storage for name in ("fp16", "bf16", "fp8_e4m3")}  # the formats timed


def ref_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], chunk: int = 8) -> torch.Tensor:
    """Float32 decode attention on a contiguous ``[B, Hkv, L, D]`` cache, a few sequences at a time."""
    B, Hq, D = q.shape
    hkv, L = k.shape[1], k.shape[2]
    out = torch.empty((B, Hq, D), dtype=torch.float32, device=q.device)
    pos = torch.arange(L, device=q.device)
    lens_t = torch.tensor(lens, device=q.device)
    for b0 in range(0, B, chunk):
        b1 = min(B, b0 + chunk)
        qq = q[b0:b1].float().view(b1 - b0, hkv, Hq // hkv, D)
        s = torch.einsum("bhgd,bhld->bhgl", qq, k[b0:b1].float()) / math.sqrt(D)
        s = s.masked_fill((pos[None, :] >= lens_t[b0:b1, None])[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # an empty sequence gives zeros
        out[b0:b1] = torch.einsum("bhgl,bhld->bhgd", p, v[b0:b1].float()).reshape(b1 - b0, Hq, D)
    return out


def _time(fn, rep_ms: float, graph: bool) -> tuple[float, float | None, str | None]:
    # the lower of two medians: a host-side hiccup was seen to inflate one eager median by up to 25%
    # while the CUDA-graph time of the same call stayed put (docs/decode_tuning.md)
    t = min(harness.time_us(fn, rep_ms=rep_ms) for _ in range(2))
    if not graph:
        return t, None, None
    try:
        return t, harness.time_us_graph(fn, rep_ms=rep_ms), None
    except Exception as err:  # noqa: BLE001  (a peer that cannot be captured keeps its eager time)
        return t, None, f"graph: {type(err).__name__}: {str(err)[:120]}"


def _sdpa_mask(p: PagedKV) -> torch.Tensor | None:
    if min(p.lens) == p.max_seq_len:
        return None
    pos = torch.arange(p.max_seq_len, device=p.q.device)
    return (pos[None, :] < p.seq_lens[:, None].long())[:, None, None, :]  # [B, 1, 1, L]


def peer_fns(p: PagedKV, k: torch.Tensor, v: torch.Tensor) -> dict:
    """name -> zero-argument callable returning ``[B, Hq, D]`` (or an Exception if it cannot be built)."""
    import torch.nn.functional as F

    qs = p.q.unsqueeze(2)  # [B, Hq, 1, D]
    mask = _sdpa_mask(p)
    fns = {"sdpa_contiguous": lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)}

    nblk = p.block_table.shape[1]
    idx = p.block_table.long()

    def gather_sdpa():
        B = idx.shape[0]
        kk = p.k_cache[idx].reshape(B, nblk * p.block_size, *p.k_cache.shape[2:])[:, : p.max_seq_len]
        vv = p.v_cache[idx].reshape(B, nblk * p.block_size, *p.v_cache.shape[2:])[:, : p.max_seq_len]
        return F.scaled_dot_product_attention(qs, kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask,
                                              enable_gqa=True)

    fns["gather_sdpa"] = gather_sdpa if p.layout.value == "nhd" else ValueError("gather_sdpa needs nhd")
    try:
        fns["flex_paged"] = _flex_fn(p)
    except Exception as err:  # noqa: BLE001
        fns["flex_paged"] = err
    return fns


def _flex_fn(p: PagedKV):
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = p.q.device
    B, nblk = p.block_table.shape
    n_pages = p.k_cache.shape[0]
    pa = PagedAttention(n_pages, p.block_size, B, device=str(dev))
    for b, n in enumerate(p.blocks_per_seq):
        pages = p.block_table[b, :n].long()
        pa.page_table[b, :n] = pages
        pa.physical_to_logical[b, pages] = torch.arange(n, device=dev)
        pa.capacity[b] = n * p.block_size
    lens = p.seq_lens.long()

    def logical(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    bm = create_block_mask(logical, B, None, 1, nblk * p.block_size, device=dev, BLOCK_SIZE=p.block_size)
    cbm = pa.convert_logical_block_mask(bm, kv_len=lens)
    kf = p.k_cache.permute(2, 0, 1, 3).reshape(1, p.k_cache.shape[2], -1, p.k_cache.shape[3])  # copy
    vf = p.v_cache.permute(2, 0, 1, 3).reshape(1, p.v_cache.shape[2], -1, p.v_cache.shape[3])
    torch._dynamo.reset()  # one static compile per workload: a dynamic recompile leaves the decode path
    flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    qs = p.q.unsqueeze(2)
    return lambda: flex(qs, kf, vf, block_mask=cbm, enable_gqa=True)


def ours_fn(p: PagedKV, cfg: dict, out: torch.Tensor):
    """The per-layer path: a :class:`DecodePlan` built once here (as once per decode step), and the timed
    callable only ``plan.run`` (metadata checks and the launches)."""
    launch = {k: cfg[k] for k in ("BLOCK_N", "num_warps", "num_stages", "use_dot") if k in cfg}
    mean = sum(p.lens) / max(1, len(p.lens))
    plan = DecodePlan(p.block_table, p.seq_lens, layout=p.layout, k_cache=p.k_cache, v_cache=p.v_cache,
                      num_q_heads=p.q.shape[1], q_dtype=p.q.dtype, num_splits=cfg.get("num_splits"),
                      max_seq_len=p.max_seq_len, mean_seq_len=mean, validate=False, **launch)
    return lambda: plan.run(p.q, p.k_cache, p.v_cache, out)


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


def _row(w, impl, variant, p, kv_dtype_name, nbytes, copy_gbps, t, tg, err, cfg=None, extra=None):
    row = {"workload": w.key, "workload_name": w.name, "impl": impl, "variant": variant, "layout": p.layout.value,
           "block_size": p.block_size, "kv_dtype": kv_dtype_name, "time_us": t, "time_us_graph": tg,
           "bytes": nbytes, "copy_gbps": copy_gbps, "rel_err": err}
    if t:
        row["gbps"] = nbytes / (t * 1e-6) / 1e9
        row["frac_copy_bw"] = row["gbps"] / copy_gbps if copy_gbps else None
    if tg:
        row["frac_copy_bw_graph"] = nbytes / (tg * 1e-6) / 1e9 / copy_gbps if copy_gbps else None
    if cfg:
        row.update({k: cfg[k] for k in ("BLOCK_N", "num_splits", "num_warps", "num_stages", "use_dot")})
    row.update(extra or {})
    return row


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def _num_sms(device: torch.device) -> int:
    """The GPU's SM count the launch heuristic sizes its splits by; 0 off a GPU (its interpreter configuration)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def _config(p: PagedKV, kv_dtype: torch.dtype) -> dict:
    sms = _num_sms(p.q.device)
    B, Hq, D = p.q.shape
    hkv = p.k_cache.shape[2] if p.layout.value == "nhd" else p.k_cache.shape[1]
    return decode_config(B, hkv, Hq // hkv, D, p.block_size, p.max_seq_len, mean_seq_len=sum(p.lens) / B,
                         kv_dtype=kv_dtype, num_sms=sms, layout=p.layout)


def run_main(w: Workload, copy_gbps: float, tune: bool, rep_ms: float) -> list[dict]:
    """Peers and our variants on one workload (fp16, 16-token pages, NHD)."""
    p = build_paged(w, layout="nhd", block_size=16, kv_dtype=torch.float16, device="cuda")
    k, v = contiguous_kv(p)
    ref = ref_fp32(p.q, k, v, p.lens)
    nbytes = bytes_moved(w, 2, 2)
    rows, peer_t = [], {}
    out = torch.empty_like(p.q)
    base = _config(p, torch.float16)
    for name, cfg in variants(w, base, tune):  # ours first: a peer's compile must not disturb our timing
        try:
            fn = ours_fn(p, cfg, out)
            out.fill_(float("nan"))
            fn()
            err = harness.rel_err(out, ref)
            t, tg, _ = _time(fn, rep_ms, graph=True)
            rows.append(_row(w, "ours", name, p, "fp16", nbytes, copy_gbps, t, tg, err, cfg))
        except Exception as e:  # noqa: BLE001  (e.g. a variant out of shared memory)
            rows.append(_row(w, "ours", name, p, "fp16", nbytes, copy_gbps, None, None, None, cfg,
                             {"error": f"{type(e).__name__}: {str(e)[:200]}"}))
        print_row(rows[-1])
    ours_rows = list(rows)
    for name, fn in peer_fns(p, k, v).items():
        if isinstance(fn, Exception):
            rows.append(_row(w, name, "", p, "fp16", nbytes, copy_gbps, None, None, None,
                             extra={"error": f"{type(fn).__name__}: {str(fn)[:200]}"}))
            continue
        try:
            got = fn().squeeze(2)
            err = harness.rel_err(got, ref)
            t, tg, gerr = _time(fn, rep_ms, graph=True)
            peer_t[name] = t
            rows.append(_row(w, name, "", p, "fp16", nbytes, copy_gbps, t, tg, err,
                             extra={"error": gerr} if gerr else None))
        except Exception as e:  # noqa: BLE001  (a peer failure is a row, not a crash)
            rows.append(_row(w, name, "", p, "fp16", nbytes, copy_gbps, None, None, None,
                             extra={"error": f"{type(e).__name__}: {str(e)[:200]}"}))
        print_row(rows[-1])
        _free()
    for r in ours_rows:
        if r.get("time_us"):
            r.update({f"x_{peer}": pt / r["time_us"] for peer, pt in peer_t.items()})
    del p, k, v, ref, out
    _free()
    return rows


def run_sweep_point(w, copy_gbps, rep_ms, *, sweep, layout="nhd", block_size=16, kv="fp16", pad=0, change=None):
    """Our heuristic config (plus ``change``) on one cache variant; rel_err vs float32 on the contiguous cache."""
    kv_dtype = DTYPES[kv]
    p = build_paged(w, layout=layout, block_size=block_size, kv_dtype=kv_dtype, device="cuda", block_stride_pad=pad)
    out = torch.empty_like(p.q)
    cfg = {**_config(p, kv_dtype), **(change or {})}
    extra = {"sweep": sweep, "block_stride_pad": pad}
    try:
        fn = ours_fn(p, cfg, out)
        out.fill_(float("nan"))
        fn()
        k, v = contiguous_kv(p, dtype=torch.float16 if kv_dtype.itemsize == 1 else None)
        err = harness.rel_err(out, ref_fp32(p.q, k, v, p.lens))
        del k, v
        _free()
        t, tg, _ = _time(fn, rep_ms, graph=True)
        row = _row(w, "ours", sweep, p, kv, bytes_moved(w, kv_dtype.itemsize, p.q.element_size()), copy_gbps, t, tg,
                   err, cfg, extra)
    except Exception as e:  # noqa: BLE001
        row = _row(w, "ours", sweep, p, kv, 0, copy_gbps, None, None, None, cfg,
                   {**extra, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    print_row(row)
    del p, out
    _free()
    return row


def print_row(row: dict) -> None:
    keys = ["workload", "impl", "status", "variant", "layout", "block_size", "kv_dtype", "block_stride_pad", "BLOCK_N",
            "num_splits", "num_warps", "num_stages", "use_dot", "time_us", "time_us_graph", "frac_copy_bw",
            "frac_copy_bw_graph", "rel_err", "error"]
    parts = []
    for k in keys:
        if row.get(k) is not None:
            v = row[k]
            parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    print(" ".join(parts), flush=True)


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
                rows.append(_row(s, "ours", f"splits{splits}", p, "fp16", bytes_moved(s, 2, 2), 0.0, None, None,
                                 harness.rel_err(got, ref), cfg, {"sweep": "smoke"}))
            if layout == "nhd":
                k, v = contiguous_kv(p)
                for name, fn in peer_fns(p, k, v).items():
                    if name == "flex_paged" or isinstance(fn, Exception):
                        continue  # flex needs torch.compile on a GPU
                    rows.append(_row(s, name, "", p, "fp16", bytes_moved(s, 2, 2), 0.0, None, None,
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
    ap = argparse.ArgumentParser(prog="python -m workbench bench decode", description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny workloads, correctness only (CPU interpreter)")
    ap.add_argument("--quick", action="store_true", help="fewer sweep points")
    ap.add_argument("--tune", action="store_true", help="time more launch variants per workload")
    ap.add_argument("--out", type=Path, default=None,
                    help="result folder (default results/, git-ignored; data/results holds the committed ones)")
    ap.add_argument("--impl", action="append", default=[], metavar="NAME",
                    help="time a registered decode implementation beside ours and the installed peers instead "
                         "(repeatable; workbench.bench.byok_decode: bench decode --impl NAME --help for its options)")
    ap.add_argument("--load", action="append", default=[], metavar="MODULE",
                    help="with --impl: import a .py file or module first (its conformance.register calls run)")
    args, _ = ap.parse_known_args(argv)
    if args.impl or args.load:  # bring your own kernel: its own run and options
        from workbench.bench import byok_decode

        return byok_decode.main(argv)
    args = ap.parse_args(argv)
    if not args.smoke and not harness.require_gpu("decode"):
        return 2
    out = harness.output_dir(ap, args.out)  # checked before the run, not after
    meta = harness.machine_meta()
    if args.smoke:
        rows, extra = run_smoke(progress=True), {"mode": "smoke"}
    else:
        rows, extra = run_gpu(args.quick, args.tune)
        extra["mode"] = "quick" if args.quick else "full"
    harness.print_table(rows, COLUMNS)
    summary(rows)
    path = harness.write_results("decode", rows, meta, out, extra=extra)
    print(f"wrote {path}")
    bad = [r for r in rows if r["impl"] == "ours" and (r.get("rel_err") is None or r["rel_err"] > 2e-2)
           and not r.get("error")]
    return 1 if bad else 0

