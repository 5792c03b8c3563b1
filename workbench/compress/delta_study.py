"""What delta coding (``workbench.coding.delta``) buys on real K/V, how fast it runs here, and whether a compressed
swap beats a raw one on the measured links.

    caps = capture.load()                                  # SmolLM2-135M, 5 prompts, 6 saved layers, fp32
    rows = layer_ratios(caps)                              # per prompt, layer, kind (k_pre / k / v), dtype, stages
    summarize(rows)                                        # one ratio per kind, dtype and stages (bytes-weighted)
    tp = throughput(caps)                                  # encode / decode GB/s on this CPU, per chunk size
    break_even(raw_bytes, ratio, enc_gbps, dec_gbps, link_gbps)   # one transfer, raw vs compressed
    break_even_rows(tp, links=links)                       # every link, both ways

``python -m workbench bench compression_delta [--out data/results]`` (``workbench.bench.compression_delta``, which
also reads the links the tiers benchmark measured) prints the tables and writes the rows
(``compression-delta-cpu-<arch>-<stamp>.json``; default folder the git-ignored ``results/``).

The lossless study casts the fp32 captures to fp16 and bf16 (the stored K/V are fp16-exact: the capture files are
fp16) and codes one ``[T, Hkv, D]`` tensor per (prompt, layer, kind): ``k_pre`` (keys before RoPE), ``k`` (after
RoPE, what a cache stores), ``v``. The entropy bound is :func:`~workbench.coding.delta.entropy_ratio`: the order-0
entropy of each byte plane after the same delta.

Break-even (:func:`break_even`): raw ``t = B / link``; compressed ``t = B / enc + B / (ratio * link_c) + B / dec``
(``link_c``: the link's bandwidth at the compressed size, lower for small transfers), or with ``overlap`` (chunks
pipelined through codec and link) ``max`` of the three. A tier that keeps blocks compressed pays one codec stage per
direction: encode before a swap out (device -> host, or a disk write), decode after a swap in; ``mode="both"``
charges both stages to one transfer. For the host link the codec must run on the GPU before the copy (a CPU codec
sees the bytes only after they crossed raw), so those rows ask what GPU codec speed would be needed; the disk rows
are a CPU codec's real case.

What it found (``data/results/compression-delta-cpu-*.json``; a shared 2-core CPU, one thread, so the speeds are
floors and vary ~2x between runs with the other load): a 16-token block of 30 layers (360 KiB) encodes at 0.1-0.2
GB/s at level 3 and 0.45-0.65 GB/s at level 1 (same ratio), decodes at 0.4-0.9 GB/s; one layer's 6 KiB block only at
0.03-0.1 GB/s (per-call overhead: batch blocks before coding). No measured link breaks even. The host links need a
codec of 65-350 GB/s serially, or faster than the link itself (14-46 GB/s) pipelined: a GPU codec's job (nvCOMP),
and even then the gain is bounded by the ratio, 1.2-1.5x; a single 6 KiB copy is latency-bound (~0.6 GB/s), so
shrinking it saves almost nothing (h2d: nothing at any codec speed). The disk (1.19 GB/s write, 1.57 read) needs
5-15 GB/s serially, or 1.2-1.6 GB/s pipelined, about twice the best single-thread level-1 speed measured: only a
pipelined codec on 2-3 cores (if it scaled perfectly) would approach it, and its gain is bounded by the ratio (~1.2x
in fp16).

On a shared CPU set ``torch.set_num_threads(1)`` (``main`` does): the quantized study ran ~50x slower with two
torch threads fighting other work.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence

import torch

from workbench import quant
from workbench.coding import delta as dz
from workbench.compress import delta_quant as dq
from workbench.quant.names import DELTA_SCHEMES as SCHEMES

KINDS = ("k_pre", "k", "v")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: stage combinations compared (name -> encode() keywords); "delta+shuffle" is encode()'s default
CONFIGS: dict[str, dict] = {
    "zstd": dict(delta=False, shuffle=False),
    "shuffle": dict(delta=False),
    "delta": dict(delta="sub", shuffle=False),
    "delta+shuffle": dict(delta="sub"),
    "xor+shuffle": dict(delta="xor"),
    "shuffle/channel": dict(delta=False, order="channel"),
    "delta+shuffle/channel": dict(delta="sub", order="channel"),
    "delta+shuffle+rle": dict(delta="sub", rle=True),
}
DEFAULT = "delta+shuffle"
BEST = "shuffle"  # the best on the real K/V over all kinds and layers (layer 0 repeats rows; values dislike deltas)
BLOCK_TOKENS = 16


def _check_captures(captures) -> list:
    caps = list(captures) if captures is not None else []
    if not caps or not all(hasattr(c, "k_pre") and hasattr(c, "v") for c in caps):
        raise ValueError("captures must be a non-empty list of workbench.model.capture.Capture "
                         "(workbench.model.capture.load())")
    return caps


def _configs(configs) -> dict[str, dict]:
    names = list(CONFIGS) if configs is None else list(configs)
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        raise ValueError(f"configs must name some of {list(CONFIGS)}, got {configs!r}")
    return {n: CONFIGS[n] for n in names}


def _dtypes(dtypes) -> dict[str, torch.dtype]:
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"dtypes must name some of {list(DTYPES)}, got {dtypes!r}")
    return {d: DTYPES[d] for d in dtypes}


# ---- ratios ------------------------------------------------------------------------------------------------------
def layer_ratios(captures, *, dtypes: Sequence[str] = ("fp16", "bf16"), configs: Iterable[str] | None = None,
                 level: int = 3) -> list[dict]:
    """Lossless ratio of every (prompt, layer, kind, dtype, stages), with the order-0 entropy bound.

    Args:
        captures: :class:`~workbench.model.capture.Capture` list (``capture.load()``).
        dtypes: ``"fp16"`` / ``"bf16"``: what the fp32 captures are cast to before coding.
        configs: names of :data:`CONFIGS` (default all).
        level: zstd level.

    Returns:
        Rows ``{section: "ratio", prompt, layer, kind, dtype, config, stages, tokens, raw_bytes, bytes, ratio,
        entropy_ratio, plane_bits}`` (``plane_bits``: order-0 bits per byte of each plane after the delta, high
        byte first).
    """
    caps, cfg, dts = _check_captures(captures), _configs(configs), _dtypes(dtypes)
    rows = []
    for cap in caps:
        for i, layer in enumerate(cap.layers):
            for kind in KINDS:
                for dname, dt in dts.items():
                    x = getattr(cap, kind)[i].to(dt).contiguous()  # [T, Hkv, D]
                    bound: dict[str, tuple[float, list[float]]] = {}
                    for name, kw in cfg.items():
                        enc = dz.encode(x, level=level, **kw)
                        if enc.delta not in bound:
                            bits = dz.plane_entropy(x, delta=enc.delta)
                            bound[enc.delta] = (8 * x.element_size() / sum(bits) if sum(bits) else math.inf, bits)
                        rows.append({"section": "ratio", "prompt": cap.name, "layer": int(layer), "kind": kind,
                                     "dtype": dname, "config": name, "stages": "+".join(enc.stages),
                                     "tokens": int(x.shape[0]), "raw_bytes": enc.raw_nbytes, "bytes": enc.nbytes,
                                     "ratio": enc.ratio, "entropy_ratio": bound[enc.delta][0],
                                     "plane_bits": [round(b, 3) for b in bound[enc.delta][1]]})
    return rows


def summarize(rows: Iterable[dict], by: Sequence[str] = ("kind", "dtype", "config")) -> list[dict]:
    """Bytes-weighted ratios of :func:`layer_ratios` / :func:`quantized_ratios` rows grouped by ``by``: ``ratio``
    = all raw bytes / all stored bytes, ``min`` / ``max`` over the group's rows, ``entropy_ratio`` likewise
    (where the rows have one), ``n`` rows."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[c] for c in by), []).append(r)
    out = []
    for key, rs in groups.items():
        raw = sum(r["raw_bytes"] for r in rs)
        row = {**dict(zip(by, key, strict=True)), "n": len(rs), "ratio": raw / sum(r["bytes"] for r in rs),
               "min": min(r["ratio"] for r in rs), "max": max(r["ratio"] for r in rs)}
        if all(math.isfinite(r.get("entropy_ratio", math.nan)) for r in rs):
            row["entropy_ratio"] = raw / sum(r["raw_bytes"] / r["entropy_ratio"] for r in rs)
        if all("rel_err" in r for r in rs):
            row["rel_err"] = statistics.fmean(r["rel_err"] for r in rs)
            row["plain_ratio"] = raw / sum(r["plain_bytes"] for r in rs)
        out.append(row)
    return out


def quantized_ratios(captures, *, schemes: Sequence[str] = SCHEMES, deltas: Sequence[bool] = (False, True),
                     level: int = 3) -> list[dict]:
    """The lossy path: each (prompt, layer, kind) quantized with each scheme, its codes coded with and without
    the delta; ratio against the fp16 tensor, the scheme's own (uncoded) ratio and the relative error.

    Returns:
        Rows ``{section: "quant", prompt, layer, kind, scheme, delta, raw_bytes (fp16), bytes, ratio, plain_bytes,
        plain_ratio, rel_err}``: ``plain_bytes`` = codes + scales + zero points + fp16 residual as the scheme
        stores them; ``rel_err`` = ``||dequantized - x|| / ||x||`` against the fp32 capture.
    """
    caps = _check_captures(captures)
    rows = []
    for cap in caps:
        for i, layer in enumerate(cap.layers):
            for kind in KINDS:
                x = getattr(cap, kind)[i].contiguous()
                qk = "v" if kind == "v" else "k"
                for name in schemes:
                    s = quant.resolve(name, "schemes")
                    qz = s.quantize(x, qk)
                    plain = sum(t.numel() * t.element_size() for t in (qz.codes, qz.scale, qz.zero, qz.residual)
                                if t is not None)
                    err = None
                    for d in deltas:
                        qe = dq.encode_quantized(x, s, kind=qk, delta=d, level=level)
                        if err is None:
                            err = float((dq.decode_quantized(qe).float() - x).norm() / x.norm())
                        rows.append({"section": "quant", "prompt": cap.name, "layer": int(layer), "kind": kind,
                                     "scheme": s.name, "delta": bool(d), "raw_bytes": 2 * x.numel(),
                                     "bytes": qe.nbytes, "ratio": qe.ratio, "plain_bytes": plain,
                                     "plain_ratio": 2 * x.numel() / plain, "rel_err": err})
    return rows


# ---- throughput --------------------------------------------------------------------------------------------------
def chunks(captures, dtype: str = "fp16") -> dict[str, tuple[torch.Tensor, str]]:
    """Realistic units of a swap, real K/V: ``{name: (tensor, what it is)}``.

    - ``block16/1layer``: one 16-token block of one layer's keys, ``[16, Hkv, D]`` (6 KiB in fp16);
    - ``block16/30layers``: one 16-token block of K and V of 30 layers, ``[16, 30 * 2 * Hkv * D]`` (360 KiB);
    - ``seq/30layers``: a whole sequence (the shortest prompt's tokens) of K and V of 30 layers (3.5 MB).

    The 30 layers are the 6 saved layers of the 5 prompts (30 distinct tensors, none repeated, so zstd finds no
    copies); the captures need 5 prompts and 32 tokens (fewer prompts: their layers are tiled, which flatters the
    30-layer ratios, noted in the description).
    """
    caps = _check_captures(captures)
    dt = _dtypes([dtype])[dtype]
    T = min(c.k.shape[1] for c in caps)
    if T < 2 * BLOCK_TOKENS:
        raise ValueError(f"captures must hold at least {2 * BLOCK_TOKENS} tokens each, the shortest has {T}")
    parts = [(c, i) for c in caps for i in range(len(c.layers))]
    tiled = len(parts) < 30
    parts = (parts * math.ceil(30 / len(parts)))[:30]

    def stack(lo: int, hi: int) -> torch.Tensor:  # [hi - lo, 30 * 2 * Hkv * D]
        return torch.cat([getattr(c, kind)[i, lo:hi].reshape(hi - lo, -1) for c, i in parts for kind in ("k", "v")],
                         dim=1).to(dt).contiguous()

    note = " (layers tiled: fewer than 30 distinct)" if tiled else ""
    b = BLOCK_TOKENS
    return {
        "block16/1layer": (caps[0].k[len(caps[0].layers) // 2, b:2 * b].to(dt).contiguous(),
                           "one 16-token block of one layer's post-RoPE keys"),
        "block16/30layers": (stack(b, 2 * b), "one 16-token block, K and V, 30 layers" + note),
        "seq/30layers": (stack(0, T), f"{T} tokens, K and V, 30 layers" + note),
    }


def _gbps(fn, nbytes: int, reps: int, min_seconds: float) -> tuple[float, float, float]:
    """GB/s of ``fn`` over ``reps`` timed repetitions of enough calls to last ``min_seconds``: the median, the best
    (the least disturbed by other work on a shared CPU) and the spread (max / min - 1)."""
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    n = max(1, math.ceil(min_seconds / once))
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rates.append(nbytes * n / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates), max(rates), max(rates) / min(rates) - 1


def throughput(captures, *, dtypes: Sequence[str] = ("fp16",), configs: Iterable[str] = (DEFAULT, "shuffle", "zstd"),
               levels: Sequence[int] = (3,), chunk_names: Iterable[str] | None = None, reps: int = 5,
               min_seconds: float = 0.1) -> list[dict]:
    """Encode / decode throughput on this CPU (one thread: numpy + zstd's C), GB/s of raw bytes, per chunk.

    Returns:
        Rows ``{section: "throughput", chunk, what, shape, dtype, config, stages, level, raw_bytes, bytes, ratio,
        encode_gbps, decode_gbps, encode_best_gbps, decode_best_gbps, encode_spread, decode_spread, reps}``
        (``*_gbps``: median of ``reps``; ``*_best_gbps``: the fastest repetition; spread = max/min - 1).
    """
    caps, cfg = _check_captures(captures), _configs(configs)
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")
    rows = []
    for dname in dtypes:
        all_chunks = chunks(caps, dname)
        names = list(all_chunks) if chunk_names is None else list(chunk_names)
        for cname in names:
            if cname not in all_chunks:
                raise ValueError(f"chunk_names must name some of {list(all_chunks)}, got {cname!r}")
            x, what = all_chunks[cname]
            for name, kw in cfg.items():
                for level in levels:
                    enc = dz.encode(x, level=level, **kw)
                    if not torch.equal(dz.decode(enc).view(torch.int16), x.view(torch.int16)):
                        raise AssertionError(f"round trip of {cname} {name} level {level} is not bit-exact")
                    e, eb, es = _gbps(lambda x=x, kw=kw, level=level: dz.encode(x, level=level, **kw), enc.raw_nbytes,
                                  reps, min_seconds)
                    d, db, ds = _gbps(lambda enc=enc: dz.decode(enc), enc.raw_nbytes, reps, min_seconds)
                    rows.append({"section": "throughput", "chunk": cname, "what": what, "shape": list(x.shape),
                                 "dtype": dname, "config": name, "stages": "+".join(enc.stages), "level": level,
                                 "raw_bytes": enc.raw_nbytes, "bytes": enc.nbytes, "ratio": enc.ratio,
                                 "encode_gbps": e, "decode_gbps": d, "encode_best_gbps": eb,
                                 "decode_best_gbps": db, "encode_spread": es, "decode_spread": ds, "reps": reps})
    return rows


# ---- break-even --------------------------------------------------------------------------------------------------
def _rate(name: str, v, *, absent_ok: bool) -> float:
    if v is None and absent_ok:
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or (math.isinf(v) and not absent_ok):
        what = "a number > 0 (inf or None: not on this path)" if absent_ok else "a finite number > 0"
        raise ValueError(f"{name} must be {what}, got {v!r}")
    return float(v)


def break_even(raw_bytes: int, ratio: float, encode_gbps: float | None, decode_gbps: float | None,
               link_gbps: float, *, overlap: bool = False, compressed_link_gbps: float | None = None) -> dict:
    """Whether one compressed transfer of ``raw_bytes`` beats the raw one, and by how much.

    Args:
        raw_bytes: bytes to move uncompressed.
        ratio: raw / compressed bytes.
        encode_gbps, decode_gbps: codec throughput in GB/s of raw bytes; ``None`` / ``inf``: that stage is not on
            this path (a tier storing blocks compressed encodes on the way out and decodes on the way in).
        link_gbps: the link's bandwidth for the raw transfer.
        overlap: codec and link pipelined over chunks (``max`` of the stage times instead of their sum).
        compressed_link_gbps: the link's bandwidth for the smaller compressed transfer (default ``link_gbps``).

    Returns:
        ``{time_raw_us, time_compressed_us, speedup (raw / compressed time), wins, saved_us, needed_gbps}``:
        ``needed_gbps`` is the codec speed (every present stage equally fast) at which the two times are equal,
        ``inf`` when no codec speed suffices (the compressed transfer alone is no faster).
    """
    if isinstance(raw_bytes, bool) or not isinstance(raw_bytes, int) or raw_bytes <= 0:
        raise ValueError(f"raw_bytes must be an int > 0, got {raw_bytes!r}")
    r = _rate("ratio", ratio, absent_ok=False)
    e = _rate("encode_gbps", encode_gbps, absent_ok=True)
    d = _rate("decode_gbps", decode_gbps, absent_ok=True)
    link = _rate("link_gbps", link_gbps, absent_ok=False)
    lc = link if compressed_link_gbps is None else _rate("compressed_link_gbps", compressed_link_gbps,
                                                          absent_ok=False)
    gb = raw_bytes / 1e9
    t_raw = gb / link
    stages = [gb / e, gb / r / lc, gb / d]
    t_comp = max(stages) if overlap else sum(stages)
    n = sum(math.isfinite(v) for v in (e, d))
    if overlap:  # every stage must be faster than the raw transfer on its own
        needed = link if r * lc > link else math.inf
    else:
        slack = 1 / link - 1 / (r * lc)  # seconds per GB the smaller transfer saves
        needed = (n / slack if n else 0.0) if slack > 0 else math.inf
    return {"raw_bytes": raw_bytes, "ratio": r, "link_gbps": link, "compressed_link_gbps": lc, "encode_gbps": e,
            "decode_gbps": d, "overlap": overlap, "time_raw_us": 1e6 * t_raw, "time_compressed_us": 1e6 * t_comp,
            "speedup": t_raw / t_comp, "wins": t_comp < t_raw, "saved_us": 1e6 * (t_raw - t_comp),
            "needed_gbps": needed}


def break_even_rows(throughput_rows: Iterable[dict], *, links: Mapping, config: str = DEFAULT,
                    level: int | None = 3, overlaps: Sequence[bool] = (False, True)) -> list[dict]:
    """:func:`break_even` for every link of ``links`` (``{name: (GB/s or a function of the transfer size, the codec
    stage a tier pays, codec side, source)}``: ``workbench.bench.compression_delta.measured_links`` reads the measured
    ones) and chunk of ``throughput_rows`` (the
    ``config`` at ``level``; ``None``: every level), at the median codec speed, in two modes: ``one-way`` (a tier
    stores the chunk compressed: the swap out encodes, the swap in decodes) and ``both`` (one transfer pays encode
    and decode).

    Returns:
        Rows ``{section: "break_even", chunk, level, link, mode, overlap, codec_side, ...break_even(...),
        cpu_gbps, cpu_best_gbps, cpu_shortfall}``: ``cpu_gbps`` the measured (median) CPU speed of the stages the
        path pays (the slower one), ``cpu_best_gbps`` the same from the fastest repetitions, ``cpu_shortfall`` =
        ``needed_gbps / cpu_gbps`` (> 1: the CPU codec is that many times too slow).
    """
    rows = []
    for t in throughput_rows:
        if t.get("section") not in ("throughput", "level") or t["config"] != config or (
                level is not None and t["level"] != level):
            continue
        raw, ratio = int(t["raw_bytes"]), float(t["ratio"])
        for name, (bw, stage, side, source) in links.items():
            gbps = (lambda b, bw=bw: bw) if not callable(bw) else bw
            for mode in ("one-way", "both"):
                e = t["encode_gbps"] if mode == "both" or stage == "encode" else None
                d = t["decode_gbps"] if mode == "both" or stage == "decode" else None
                for ov in overlaps:
                    be = break_even(raw, ratio, e, d, gbps(raw), overlap=ov,
                                    compressed_link_gbps=gbps(max(1, round(raw / ratio))))
                    cpu = min(v for v in (e, d) if v is not None)
                    best = min(t.get(f"{k}_best_gbps", t[f"{k}_gbps"]) for k, v in (("encode", e), ("decode", d))
                               if v is not None)
                    rows.append({"section": "break_even", "chunk": t["chunk"], "dtype": t["dtype"],
                                 "config": config, "level": t["level"], "link": name, "link_source": source,
                                 "mode": mode, "codec_side": side, **be, "cpu_gbps": cpu, "cpu_best_gbps": best,
                                 "cpu_shortfall": be["needed_gbps"] / cpu})
    return rows


# ---- the command -------------------------------------------------------------------------------------------------
def _json_safe(rows: list[dict], digits: int = 5) -> list[dict]:
    """Floats to ``digits`` significant digits (the measurements hold no more), inf (no codec speed suffices; a
    stage not on the path) as None: JSON has no infinity."""

    def fix(v):
        if isinstance(v, float):
            return float(f"{v:.{digits}g}") if math.isfinite(v) else None
        return [fix(u) for u in v] if isinstance(v, list) else v

    return [{k: fix(v) for k, v in r.items()} for r in rows]


def verdicts(be_rows: Iterable[dict], mode: str = "one-way", dtype: str = "fp16") -> list[dict]:
    """:func:`break_even_rows` folded to one row per (chunk, config, level, link): the serial and pipelined needed codec
    speed and speedup side by side, ``wins`` if either beats the raw transfer."""
    out: dict[tuple, dict] = {}
    for r in be_rows:
        if r["mode"] != mode or r["dtype"] != dtype:
            continue
        key = (r["chunk"], r["config"], r["level"], r["link"])
        row = out.setdefault(key, {"chunk": r["chunk"], "config": r["config"], "level": r["level"], "link": r["link"],
                                   "link_gbps": r["link_gbps"], "ratio": r["ratio"], "cpu_gbps": r["cpu_gbps"],
                                   "cpu_best_gbps": r["cpu_best_gbps"], "codec_side": r["codec_side"],
                                   "wins": False})
        tag = "overlap" if r["overlap"] else "serial"
        row[f"needed_{tag}"] = r["needed_gbps"]
        row[f"speedup_{tag}"] = r["speedup"]
        row["wins"] = row["wins"] or r["wins"]
    return list(out.values())


def default_choice(ratio_rows: Sequence[dict]) -> dict:
    """From :func:`layer_ratios` rows: for each dtype and kind, the config with the best bytes-weighted ratio,
    and how each candidate default (delta vs xor vs none; token vs channel order; rle) does over all kinds."""
    by_kind = summarize(ratio_rows, ("dtype", "kind", "config"))
    best = {}
    for r in by_kind:
        key = f"{r['dtype']}/{r['kind']}"
        if key not in best or r["ratio"] > best[key][1]:
            best[key] = (r["config"], r["ratio"])
    overall = {f"{r['dtype']}/{r['config']}": r["ratio"] for r in summarize(ratio_rows, ("dtype", "config"))}
    return {"best_per_kind": best, "overall": overall}
