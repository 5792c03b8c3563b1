"""Benchmark of quantized K/V on the GPU: paged decode of every scheme on W1-W5 beside our own fp16 in the
same run (fp32 storage included: the seed's "FP32 costs twice FP16's bytes"), the quantize-on-write of a 32k-token
prefill chunk, a count of the fp8 write's codes that differ from torch's (and whether each one is an exact rounding
midpoint), and FlashInfer's fp8 decode backends on our own fp8 cache (``workbench.bench.quant_peers``).

Rows (``python -m workbench bench quant_decode --out data/results``): ``section`` ``decode`` (``workload``,
``scheme``, ``variant``, ``q_dtype`` (a cast cache is read by queries of its dtype: the plan's rule, so fp32 storage
has fp32 queries), ``time_us``, ``time_us_graph``, ``speedup_vs_fp16``, ``bw_fraction`` (stored bytes with
scales over the time, as a fraction of the copy bandwidth measured in the run), ``bytes_per_token``,
``rel_err`` (against the dequantized reference), ``quant_err`` (against fp32 on the unquantized values)),
``write``, ``midpoints`` and ``peers`` (``impl``, ``backend``, ``accurate``, ``ours_speedup``: the peer's time
over ours). ``--smoke`` runs tiny shapes through the interpreter (correctness only; the peers need a GPU).
"""

from __future__ import annotations

import functools
import gc
import math
import sys
from dataclasses import replace

import torch
from tqdm.auto import tqdm

import workbench
from workbench import quant
from workbench.bench import harness, quant_peers
from workbench.bench.command import SMOKE_HELP, BenchParser
from workbench.bench.decode_timing import ref_fp32
from workbench.core.workloads import WORKLOADS, PagedKV, build_paged, contiguous_kv
from workbench.kernels import DecodePlan, decode_config, write_kv
from workbench.kernels.write.reference import dequantize_cache_ref, quant_code_distance, quantize_ref
from workbench.quant import blocks as qblocks
from workbench.quant.names import DECODE_BENCH_SCHEMES as DECODE_SCHEMES
from workbench.quant.names import DECODE_SMOKE_SCHEMES as SMOKE_SCHEMES
from workbench.quant.names import WRITE_BENCH_SCHEMES as WRITE_SCHEMES
from workbench.results import provenance, run_files

PAGE = 16
SECTIONS = ("decode", "write", "midpoints", "peers")


def bench_scheme(name: str, head_dim: int | None = None) -> quant.Scheme:
    """The scheme as benchmarked: KIVI key groups of one 16-token page (the group must divide the page). A name
    ``<scheme>@head`` (``names.ONE_GROUP_A_HEAD``) is the per-token groups scheme with one group a head
    (``value_group = head_dim``): one scale and zero point a token and head, the bytes issue 31 states its limits in."""
    s = quant.one_group_a_head(name, head_dim) if "@" in name else quant.get(name)
    return s.with_params(group=PAGE, residual=0) if "group" in s.param_names else s


def quantized_paged(p: PagedKV, scheme: quant.Scheme):
    """``(k_cache, v_cache, k_scale, v_scale)``: ``p``'s fp16 NHD cache written through ``write_kv`` in ``scheme``."""
    nb, bs, H, D = p.k_cache.shape
    src_k, src_v = (c.reshape(nb * bs, H, D) for c in (p.k_cache, p.v_cache))
    if scheme.name in ("fp16",):
        return p.k_cache, p.v_cache, None, None
    caches = [qblocks.empty_cache(scheme, "nhd", kind, nb, bs, H, D, p.q.device) for kind in "kv"]
    ks = vs = None
    if scheme.needs_static_scales:
        ks, vs = scheme.calibrate(src_k[: 1 << 16]), scheme.calibrate(src_v[: 1 << 16])  # a calibration sample
    slots = torch.arange(nb * bs, device=p.q.device)
    step = 1 << 18  # tokens a call: bounded temporaries
    for i in range(0, nb * bs, step):
        sl = slice(i, min(nb * bs, i + step))
        kw = (dict(k_scale=ks, v_scale=vs) if scheme.needs_static_scales else dict(quant=scheme) if scheme.quantized
              else {})
        src = (src_k[sl], src_v[sl]) if scheme.family != "cast" else (src_k[sl].to(scheme.format.storage),
                                                                        src_v[sl].to(scheme.format.storage))
        write_kv(*src, caches[0], caches[1], "nhd", slots[sl], validate=False, **kw)
    return caches[0], caches[1], ks, vs


def _plan(p: PagedKV, scheme, k_cache, v_cache, ks, vs, q, cfg: dict | None):
    mean = sum(p.lens) / max(1, len(p.lens))
    kw = dict(k_scale=ks, v_scale=vs) if scheme.needs_static_scales else {}
    if scheme.scales_on_write:
        kw["quant"] = scheme
    return DecodePlan(p.block_table, p.seq_lens, layout="nhd", k_cache=k_cache, v_cache=v_cache,
                      num_q_heads=q.shape[1], q_dtype=q.dtype, max_seq_len=p.max_seq_len, mean_seq_len=mean,
                      validate=False, **kw, **(cfg or {}))


def _dequantized(p: PagedKV, scheme, k_cache, v_cache, ks, vs) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantized cache as contiguous fp32 ``[B, Hkv, L, D]`` (the reference's input)."""
    D = p.q.shape[2]
    kd = dequantize_cache_ref(scheme, k_cache, "nhd", "k", D)
    vd = dequantize_cache_ref(scheme, v_cache, "nhd", "v", D)
    if ks is not None:
        kd, vd = kd * ks.reshape(1, 1, -1, 1), vd * vs.reshape(1, 1, -1, 1)
    return contiguous_kv(replace(p, k_cache=kd, v_cache=vd), torch.float32)


def tune_variants(scheme: quant.Scheme, base: dict, quick: bool = False) -> list[tuple[str, dict]]:
    """Launch changes worth timing when bytes per token shrink: tile sizes, splits, stages, warps."""
    s = base["num_splits"]
    out = [("heuristic", {})]
    for bn in (32, 64, 128):
        out += [(f"BLOCK_N{bn}", {"BLOCK_N": bn}), (f"BLOCK_N{bn}-splits*2", {"BLOCK_N": bn, "num_splits": s * 2}),
                (f"BLOCK_N{bn}-stages3", {"BLOCK_N": bn, "num_stages": 3})]
    out += [("splits/2", {"num_splits": max(1, s // 2)}), ("splits*4", {"num_splits": s * 4}),
            ("warps8", {"num_warps": 8}), ("stages2", {"num_stages": 2})]
    for bn in (32, 64, 128):  # two warps: half the threads share a tile (fp8 at 64: 1.11x -> 1.41x on W1)
        out += [(f"w2-BLOCK_N{bn}", {"num_warps": 2, "BLOCK_N": bn}),
                (f"w2-BLOCK_N{bn}-stages3", {"num_warps": 2, "BLOCK_N": bn, "num_stages": 3}),
                (f"w2-BLOCK_N{bn}-splits*2", {"num_warps": 2, "BLOCK_N": bn, "num_splits": s * 2})]
    return out


def decode_variants(scheme: quant.Scheme, base: dict, tune: bool = False,
                    head_dim: int | None = None) -> list[tuple[str, dict]]:
    """The launches timed for ``scheme``: the heuristic (what the kernels choose), with ``tune`` its variants, and for
    packed groups the planes kernel beside it, for keys per token with one group a head (``head_dim``) also the
    streams kernel (same run, same rows)."""
    variants = tune_variants(scheme, base) if tune else [("heuristic", {})]
    if scheme.family in ("static", "token") and not tune:
        # four warps on 128-token tiles beside the two-warp default: fewer registers since the fp8 convert stays in
        # place (bench anatomy), yet slower on the H200 (2026-12-05: fp8 per tensor 1.37-1.58x against 1.49-1.73x)
        variants.append(("w4-BLOCK_N128", {"num_warps": 4, "BLOCK_N": 128}))
        if not scheme.symmetric:  # its launch before the loop was peeled (kernels/decode/quant.py)
            variants.append(("w4-BLOCK_N32", {"num_warps": 4, "BLOCK_N": 32}))
    if scheme.family == "groups":
        # the planes kernel's 32- and 64-token tiles were slower on the H200 (2026-12-05); 8 warps for the streams
        # cost more instructions a byte (bench anatomy)
        variants[1:1] = [("planes-BLOCK_N128", {"planes": True, "streams": 0, "BLOCK_N": 128})]
        # the streams kernel spills with groups narrower than a head and with int2's eight planes a chunk (H100,
        # 2026-12-05: 144-500 spills, 0.13-0.38x; int2 one group a head 0.75-0.89x)
        one_group = head_dim is None or scheme.value_group >= head_dim
        if scheme.key_mode == "token" and one_group:  # keys per token: the streams kernel (kernels/decode/streams.py)
            variants[1:1] = [(f"streams-BLOCK_N{bn}", {"planes": True, "BLOCK_N": bn, "num_warps": 4})
                             for bn in ((128, 256) if scheme.bits == 4 else ())]
            # one scale a token-head: the heuristic is the streams or planes kernel (kernels/decode/quant.py), so
            # the generic kernel is timed beside it
            variants.append(("generic-BLOCK_N32", {"planes": False, "BLOCK_N": 32}))
    return variants


def rates(nbytes: int, t_us: float | None, copy_gbps: float | None, t_fp16: float | None = None, *,
          speedup: bool = False) -> dict:
    """``bw_fraction`` (bytes over ``t_us`` as a fraction of the copy bandwidth) and, with ``speedup``,
    ``speedup_vs_fp16`` (``t_fp16 / t_us``) of a row. A ratio whose denominator is 0, missing or not finite (a tiny
    smoke case's time rounds to 0 on the GPU; a smoke run measures no copy bandwidth) is None, and ``note`` says why:
    a row, never a ZeroDivisionError."""
    def ok(x) -> bool:
        return x is not None and math.isfinite(x) and x > 0

    out, notes = {}, []
    gbps = nbytes / (t_us * 1e-6) / 1e9 if ok(t_us) else None
    if gbps is None:
        notes.append(f"time {t_us} us not measurable: no rates")
    elif not ok(copy_gbps):
        notes.append(f"copy bandwidth {copy_gbps} GB/s not measured: no bw_fraction")
    out["bw_fraction"] = gbps / copy_gbps if gbps is not None and ok(copy_gbps) else None
    if speedup:
        out["speedup_vs_fp16"] = t_fp16 / t_us if gbps is not None and ok(t_fp16) else None
        if gbps is not None and t_fp16 is not None and not ok(t_fp16):
            notes.append(f"fp16 time {t_fp16} us not measurable: no speedup")
    if notes:
        out["note"] = "; ".join(notes)
    return out


def run_decode(w, copy_gbps: float, schemes, rep_ms: float, tune: bool, device, only: tuple = (),
               timed: bool | None = None) -> list[dict]:
    """Decode rows of workload ``w`` for each scheme (and launch variant); timed on the GPU (``timed``: default
    ``device == "cuda"``; a test times on the CPU with fake timers)."""
    timed = device == "cuda" if timed is None else timed
    rows = []
    p = build_paged(w, layout="nhd", block_size=PAGE, kv_dtype=torch.float16, device=device)
    k32, v32 = contiguous_kv(p, torch.float32)
    truth = ref_fp32(p.q, k32, v32, p.lens)
    del k32, v32
    t_fp16 = None
    tokens = sum(p.lens)
    for name in schemes:
        scheme = bench_scheme(name, w.head_dim)
        q = p.q.to(scheme.format.storage) if scheme.family == "cast" else p.q  # a cast cache: queries of its dtype
        qo_bytes = 2 * q.numel() * q.element_size()
        k_cache, v_cache, ks, vs = quantized_paged(p, scheme)
        kd, vd = _dequantized(p, scheme, k_cache, v_cache, ks, vs)
        ref = ref_fp32(q, kd, vd, p.lens)
        del kd, vd
        nbytes = int(scheme.bytes_per_token(w.num_kv_heads, w.head_dim) * tokens + qo_bytes)
        base = decode_config(w.batch, w.num_kv_heads, w.num_q_heads // w.num_kv_heads, w.head_dim, PAGE,
                             p.max_seq_len, mean_seq_len=tokens / w.batch, kv_dtype=k_cache.dtype,
                             num_sms=torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda"
                             else 0)
        variants = decode_variants(scheme, base, tune, w.head_dim)
        variants = [(n, c) for n, c in variants if n == "heuristic" or not only or n.startswith(only)]
        for variant, cfg in variants:
            row = {"section": "decode", "workload": w.key, "scheme": name, "variant": variant,
                   "q_dtype": str(q.dtype).removeprefix("torch."),
                   "bytes_per_token": scheme.bytes_per_token(w.num_kv_heads, w.head_dim), "bytes": nbytes,
                   "copy_gbps": copy_gbps, **{f"cfg_{k}": v for k, v in cfg.items()}}
            try:
                out = torch.full_like(q, float("nan"))
                plan = _plan(p, scheme, k_cache, v_cache, ks, vs, q, cfg)
                row.update({f"launch_{k}": v for k, v in plan.config.items()})
                before = _compiled_kernels()
                plan.run(q, k_cache, v_cache, out)
                row.update(kernel_stats(before))
                row["rel_err"] = harness.rel_err(out, ref)
                row["quant_err"] = harness.rel_err(out, truth)
                if timed:
                    fn = functools.partial(plan.run, q, k_cache, v_cache, out)
                    row["time_us"] = min(harness.time_us(fn, rep_ms=rep_ms) for _ in range(2))
                    row["time_us_graph"] = harness.time_us_graph(fn, rep_ms=rep_ms)
                    t = row["time_us_graph"]
                    if scheme.name == "fp16" and variant == "heuristic":
                        t_fp16 = t
                    row.update(rates(nbytes, t, copy_gbps, t_fp16, speedup=True))
            except Exception as e:  # noqa: BLE001  (a variant out of shared memory is a row, not a crash)
                root = e  # Triton wraps a compile error in several layers: the innermost one says what broke
                while root.__cause__ is not None or root.__context__ is not None:
                    root = root.__cause__ or root.__context__
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                if root is not e:
                    row["error_cause"] = f"{type(root).__name__}: {str(root)[-300:]}"
            rows.append(row)
            tqdm.write(_fmt(row))
        del k_cache, v_cache, ref
        _free(device)
    return rows


WRITE_VARIANTS = [("default", {})] + [(f"bt{bt}-w{w}", {"tokens_per_program": bt, "num_warps": w})
                                        for bt in (8, 32, 64) for w in (2, 4, 8)]


def run_write(copy_gbps: float, schemes, rep_ms: float, device, tokens: int = 32768, heads: int = 8,
              head_dim: int = 128, tune: bool = False, timed: bool | None = None) -> list[dict]:
    """Quantize-on-write of one prefill chunk (``tokens`` tokens, 16-token pages, fp16 source); ``tune``: every
    program shape of :data:`WRITE_VARIANTS` for the schemes whose scales are computed on write; ``timed`` as
    :func:`run_decode`."""
    timed = device == "cuda" if timed is None else timed
    rows = []
    nb = tokens // PAGE
    g = torch.Generator(device=device).manual_seed(3)
    key = torch.randn(tokens, heads, head_dim, generator=g, device=device).half()
    value = torch.randn(tokens, heads, head_dim, generator=g, device=device).half()
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(4)).to(device)
    slots = (perm[:, None] * PAGE + torch.arange(PAGE, device=device)).reshape(-1)
    for name in schemes:
        scheme = bench_scheme(name)
        caches = [qblocks.empty_cache(scheme, "nhd", kind, nb, PAGE, heads, head_dim, device) for kind in "kv"]
        kw = {}
        if scheme.needs_static_scales:
            kw = dict(k_scale=scheme.calibrate(key), v_scale=scheme.calibrate(value))
        elif scheme.quantized:
            kw = dict(quant=scheme)
        stored = scheme.bytes_per_token(heads, head_dim) * tokens
        nbytes = int(2 * key.numel() * 2 + stored)  # fp16 source read + codes and scales written
        for variant, cfg in (WRITE_VARIANTS if tune and scheme.scales_on_write else [("default", {})]):
            fn = functools.partial(write_kv, key, value, caches[0], caches[1], "nhd", slots, validate=False, **kw,
                                   **cfg)
            for c in caches:
                qblocks.plane_of(c).view(torch.uint8).fill_(0xEE)  # poisoned: every variant writes it all again
            fn()
            written = [qblocks.plane_of(c).view(torch.uint8).clone() for c in caches]
            if variant == "default":
                reference = written
            row = {"section": "write", "scheme": scheme.name, "variant": variant, "tokens": tokens, "bytes": nbytes,
                   "copy_gbps": copy_gbps,
                   "identical": all(torch.equal(a, b) for a, b in zip(written, reference, strict=True))}
            if timed:
                t = harness.time_us_graph(fn, rep_ms=rep_ms)
                row.update(time_us_graph=t, **rates(nbytes, t, copy_gbps))
            rows.append(row)
            tqdm.write(_fmt(row))
        del caches
        _free(device)
    return rows


def run_midpoints(device, rep: int = 2) -> list[dict]:
    """The static fp8 write against torch's codes, at W3's and W5's sizes: every code that differs, and whether
    ``x / scale`` (fp32, as both compute it) lies exactly halfway between the two codes."""
    rows = []
    for key in ("W3", "W5"):
        w = WORKLOADS[key]
        tokens = sum(w.seq_lens()) if device == "cuda" else 64  # the interpreter: a check, not a count
        H, D = (w.num_kv_heads, w.head_dim) if device == "cuda" else (2, 64)
        for seed in range(rep):
            g = torch.Generator(device=device).manual_seed(10 + seed)
            x = torch.randn(tokens, H, D, generator=g, device=device).half()
            scale = (x.float().abs().amax() / 448.0).reshape(1)
            nb = -(-tokens // PAGE)
            for qm in ("exact", "cast", "rcp"):
                kc = torch.empty((nb, PAGE, H, D), dtype=torch.float8_e4m3fn, device=device)
                vc = torch.empty_like(kc)
                slots = torch.arange(tokens, device=device)
                write_kv(x, x, kc, vc, "nhd", slots, k_scale=scale, v_scale=scale, quant_math=qm, validate=False)
                got = kc.reshape(-1, H, D)[:tokens]
                want = quantize_ref(x, torch.float8_e4m3fn, scale)
                diff = quant_code_distance(got, want)
                bad = diff > 0
                y = x.float() / scale  # fp32 division, as both compute it
                a, b = got[bad].float(), want[bad].float()
                midpoint = (y[bad] == (a + b) / 2)
                rows.append({"section": "midpoints", "workload": key, "seed": seed, "quant_math": qm,
                             "codes": got.numel(), "differ": int(bad.sum()), "max_code_distance": int(diff.max()),
                             "exact_midpoints": int(midpoint.sum()), "not_midpoints": int((~midpoint).sum())})
                tqdm.write(_fmt(rows[-1]))
    return rows


def run_peers(w, copy_gbps: float, rep_ms: float, device, fi, timed: bool | None = None) -> list[dict]:
    """Section ``peers`` on workload ``w``: ours and FlashInfer's decode backends (``fi``: the flashinfer module) on
    one fp8_e4m3/tensor cache, judged against one dequantized reference and timed alike
    (``workbench.bench.quant_peers``); ``timed`` as :func:`run_decode`."""
    timed = device == "cuda" if timed is None else timed
    p = build_paged(w, layout="nhd", block_size=PAGE, kv_dtype=torch.float16, device=device)
    scheme = bench_scheme(quant_peers.PEER_SCHEME)
    k_cache, v_cache, ks, vs = quantized_paged(p, scheme)
    kd, vd = _dequantized(p, scheme, k_cache, v_cache, ks, vs)
    ref = ref_fp32(p.q, kd, vd, p.lens)
    del kd, vd
    nbytes = int(scheme.bytes_per_token(w.num_kv_heads, w.head_dim) * sum(p.lens) + 2 * p.q.numel() * 2)
    base = {"section": "peers", "workload": w.key, "scheme": scheme.name, "q_dtype": "float16", "bytes": nbytes,
            "copy_gbps": copy_gbps}
    out = torch.full_like(p.q, float("nan"))
    plan = _plan(p, scheme, k_cache, v_cache, ks, vs, p.q, None)
    entries = {"heuristic": {"impl": "ours", "fn": functools.partial(plan.run, p.q, k_cache, v_cache, out),
                             "accurate": True, "resolved": plan.config.get("kernel")}}
    entries.update(quant_peers.flashinfer_fns(fi, p, k_cache, v_cache, ks, vs, out))
    rows = quant_peers.peer_rows(entries, out, ref, rep_ms, timed, base)
    for r in rows:
        if timed:
            r.update(rates(nbytes, r.get("time_us_graph") or r.get("time_us"), copy_gbps))
        tqdm.write(_fmt(r))
    del p, k_cache, v_cache, ref, out, entries, plan
    _free(device)
    return rows


def summary(rows: list[dict]) -> list[str]:
    """The lines the command prints at its end: per workload fp32 storage against fp16 (speed-up, bytes, rel_err of
    the heuristic's rows), then ``quant_peers.summary_lines`` (fp8 ours against the best accurate FlashInfer)."""
    lines = []
    dec = {(r["workload"], r["scheme"]): r for r in rows
           if r.get("section") == "decode" and r["variant"] == "heuristic"}
    for key in dict.fromkeys(k for k, _ in dec):
        a, b = dec.get((key, "fp32")), dec.get((key, "fp16"))
        if a is None or b is None:
            continue
        speed = f"{a['speedup_vs_fp16']:.3f}" if a.get("speedup_vs_fp16") else "not timed"
        lines.append(f"{key}: fp32 vs fp16 storage: speed-up {speed}, bytes per token {a['bytes_per_token']} vs "
                     f"{b['bytes_per_token']}, rel_err {a.get('rel_err', float('nan')):.2g} vs "
                     f"{b.get('rel_err', float('nan')):.2g}" + (f" ({a['error']})" if a.get("error") else ""))
    return lines + quant_peers.summary_lines(rows)


def _compiled_kernels() -> dict:
    """Compiled decode kernels Triton holds now, by id (introspection: empty where its cache is not reachable)."""
    from workbench.kernels.decode import groups, kernel, streams  # here: the kernels' jit functions, for their caches

    out = {}
    try:
        for fn in (kernel._paged_decode_kernel, groups._groups_decode_kernel, streams._streams_decode_kernel):
            for cache in getattr(fn, "device_caches", {}).values():
                kc = cache[0] if isinstance(cache, tuple) else cache
                if isinstance(kc, dict):
                    out.update({id(k): k for k in kc.values()})
    except Exception:  # noqa: BLE001  (Triton's cache layout differs by version)
        pass
    return out


PTX_OPS = ("cvt", "prmt", "mma", "ld.global", "ex2", "fma", "lop3", "shr", "and.b32", "sub.f16x2")


def kernel_stats(before: dict) -> dict:
    """Registers, spills, shared memory and a PTX instruction count of the kernel compiled since ``before``."""
    new = [k for i, k in _compiled_kernels().items() if i not in before]
    if len(new) != 1:
        return {}
    k = new[0]
    info = {f"k_{n}": int(getattr(k, n)) for n in ("n_regs", "n_spills") if getattr(k, n, None) is not None}
    shared = getattr(getattr(k, "metadata", None), "shared", None)
    if shared is not None:
        info["k_smem"] = int(shared)
    ptx = getattr(k, "asm", {}).get("ptx", "")
    lines = [ln.strip() for ln in ptx.splitlines()]
    for op in PTX_OPS:
        info[f"ptx_{op}"] = sum(1 for ln in lines if ln.startswith(op))
    return info


def _fmt(row: dict) -> str:
    keep = ("section", "workload", "scheme", "variant", "impl", "backend", "resolved", "accurate", "q_dtype",
            "quant_math", "time_us_graph", "speedup_vs_fp16", "ours_speedup",
            "bw_fraction", "rel_err", "quant_err", "k_n_regs", "k_n_spills", "identical", "differ", "exact_midpoints",
            "not_midpoints", "note", "error", "error_cause")
    return "  ".join(f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row[k]}"
                     for k in keep if row.get(k) is not None)


def _free(device) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = BenchParser("quant_decode", __doc__, smoke=SMOKE_HELP, gpu=True)
    ap.add_argument("--tune", action="store_true", help="time launch variants per scheme (tiles, splits, warps)")
    ap.add_argument("--only", default="", help="with --tune: variant-name prefixes to time (comma separated)")
    ap.add_argument("--workloads", default=None, help="comma separated (default W1-W5; --smoke: W1)")
    ap.add_argument("--schemes", default=None,
                    help=f"comma separated (default every scheme timed: {','.join(DECODE_SCHEMES)}; --smoke: one of "
                         f"each decode mode)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma separated, of " + ", ".join(SECTIONS) + " (peers: FlashInfer's fp8 decode, when it "
                         "imports and a GPU runs it)")
    args = ap.parse_args(argv)
    out = ap.start(args)
    if out is None:
        return 2
    device = "cuda" if not args.smoke else str(workbench.device())
    copy_gbps = harness.copy_bandwidth_gbps() if device == "cuda" else 0.0
    schemes = (args.schemes or ",".join(SMOKE_SCHEMES if args.smoke else DECODE_SCHEMES)).split(",")
    sections = args.sections.split(",")
    if set(sections) - set(SECTIONS):
        ap.error(f"argument --sections: {sorted(set(sections) - set(SECTIONS))} not among {', '.join(SECTIONS)}")
    keys = (args.workloads or ("W1" if args.smoke else "W1,W2,W3,W4,W5")).split(",")
    rows = []
    for key in tqdm(keys, desc="workloads", file=sys.stderr):
        w = WORKLOADS[key].smoke() if args.smoke else WORKLOADS[key]
        if "decode" in sections:
            rows += run_decode(w, copy_gbps, schemes, 100, args.tune, device,
                               tuple(p for p in args.only.split(",") if p))
    if "write" in sections:
        gpu = device == "cuda"
        rows += run_write(copy_gbps, WRITE_SCHEMES, 100, device, tokens=32768 if gpu else 64, heads=8 if gpu else 2,
                          head_dim=128 if gpu else 64, tune=args.tune)
    if "midpoints" in sections:
        rows += run_midpoints(device, rep=2 if device == "cuda" else 1)
    if "peers" in sections:  # last: a peer that loses the CUDA context costs its own section only
        fi, skipped = quant_peers.load_flashinfer(device)
        if skipped:
            print(skipped)
        for key in keys if fi is not None else ():
            rows += run_peers(WORKLOADS[key].smoke() if args.smoke else WORKLOADS[key], copy_gbps, 100, device, fi)
    path = run_files.write_results("quant-decode", rows, provenance.machine_meta(), out,
                                   extra={"copy_gbps": copy_gbps, "mode": "smoke" if args.smoke else "gpu",
                                          "page_size": PAGE, "tune": bool(args.tune),
                                          # a run of some schemes only (notebook 03 lays it over the last full run)
                                          **({"schemes": schemes} if args.schemes else {})})
    for line in summary(rows):
        print(line)
    print(f"wrote {path}")
    bad = [r for r in rows if (r.get("section") == "decode" or r.get("impl") == "ours") and (
        r.get("error") or (r.get("rel_err") or 0) > (1e-2 if r["scheme"] == "bf16" else 1e-3))]  # bf16: 2**-9
    for r in bad:
        print("FAILED:", _fmt(r))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
