"""The what-if study: notebook 10 (serving what-if), one serving configuration (a model, a GPU profile, a trace at an
arrival rate, the block size, the K/V scheme and the memory knobs) through ``workbench.whatif.whatif``: throughput,
TTFT and TPOT percentiles, capacity and preemptions, one decode step's parts and the quality column, as one flat row.
``WHATIF`` is both the panels' controls (``workbench.ui.whatif_panels``) and the sweep::

    python -m workbench sweep whatif --grid scheme=fp16,int4/token --grid rate=2,8,32

Every number of a row comes from the committed runs the GPU profile was made from (measured), the per-layer floor
fitted to the real model's step, or a named assumption; :func:`inputs` lists them with their kind and file, and
:func:`step_validation` sets the step model beside the real model's measured step. A point is a pure function of its
parameters (the trace is generated from ``seed``), so runs are kept (:func:`run`) for a panel's redraws."""

from __future__ import annotations

import copy
import dataclasses
import functools
import re

from workbench.publish.notebook import format_value
from workbench.quant.names import TIER_FORMATS, WHATIF_GRID, WHATIF_SCHEMES
from workbench.sim import traces
from workbench.studies.base import Param, Study
from workbench.whatif import models, report, validation
from workbench.whatif.profile import GpuProfile, Measured
from workbench.whatif.serve import PREEMPTION, Knobs
from workbench.whatif.why import bench_of, files_of, kind_of, why_table  # noqa: F401  (the study's names too)

GPUS = {"h200": "H200 (committed runs)"}  # a profile per GPU whose runs are committed (GpuProfile.from_results)
SCHEMES = WHATIF_SCHEMES  # the K/V schemes the H200 profile's bench quant_decode run timed (tests check each)
TRACES = {"sharegpt": "ShareGPT-like", "alpaca": "Alpaca-like"}
RATES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)  # requests a second
AUTO = 0.0  # kv_gib: what the GPU leaves (HBM x utilization - weights - activations)
KV_GIBS = (AUTO, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
HOST_GIBS = (0.0, 4.0, 16.0, 64.0, 256.0)
SAME = "same"  # host_format: the device's own scheme
KEEPS = (1.0, 0.5, 0.25, 0.1)  # the budgets the committed compression run measured (and all of the prompt)
POLICIES = ("h2o", "snapkv", "streaming")
PARTS = ("weights", "attention", "write", "overhead")  # a decode step's parts (workbench.whatif.step_time)


def knobs(block_size: int, kv_gib: float, preemption: str, host_gib: float, host_format: str, keep: float,
          policy: str) -> Knobs:
    """The simulator's :class:`Knobs` of the controls: ``kv_gib`` 0 is auto, ``host_format`` ``same`` the device's
    scheme, the host tier only with ``preemption="swap"`` and the policy only with ``keep`` < 1."""
    swap = preemption == "swap"
    return Knobs(block_size=block_size, kv_gib=kv_gib or None, preemption=preemption,
                 host_gib=host_gib if swap else 0.0, host_format=None if host_format == SAME or not swap
                 else host_format, keep=keep, policy=policy if keep < 1 else "full")


@functools.lru_cache(maxsize=32)
def _trace(trace: str, n: int, rate: float, seed: int) -> traces.Trace:
    """The trace of a preset at a rate (frozen): generating it is half of a 200-request point, and a frontier's
    schemes share it."""
    return report.load_trace(trace, n, rate, seed)


@functools.lru_cache(maxsize=128)
def _run(model: str, profile: str, trace: str, rate: float, block_size: int, scheme: str, kv_gib: float,
         preemption: str, host_gib: float, host_format: str, keep: float, policy: str, n: int, seed: int) -> dict:
    if profile not in GPUS:
        raise ValueError(f"profile must be one of {sorted(GPUS)}, got {profile!r}")
    k = knobs(block_size, kv_gib, preemption, host_gib, host_format, keep, policy)
    if trace not in TRACES:
        raise ValueError(f"trace must be one of {sorted(TRACES)}, got {trace!r}")
    return report.whatif(model, scheme=scheme, trace=_trace(trace, n, rate, seed), n=n, rate=rate, seed=seed, knobs=k,
                         profile=report.default_profile(profile))


def run(model: str, profile: str, trace: str, rate: float, block_size: int, scheme: str, kv_gib: float, preemption: str,
        host_gib: float, host_format: str, keep: float, policy: str, n: int, seed: int) -> dict:
    """``workbench.whatif.whatif`` of the study's parameters (a copy of a kept run: a point is pure, and a panel
    redraws the same configurations as its controls go back and forth)."""
    return copy.deepcopy(_run(model, profile, trace, float(rate), block_size, scheme, float(kv_gib), preemption,
                              float(host_gib), host_format, float(keep), policy, n, seed))


def trace_label(name: str) -> str:
    """A trace's name in words: ``sharegpt_synth`` (``traces.generate``'s) -> ``ShareGPT-like``; others as they are."""
    return TRACES.get(name.removesuffix("_synth"), name)


def whatif_point(model: str, profile: str, trace: str, rate: float, block_size: int, scheme: str, kv_gib: float,
                 preemption: str, host_gib: float, host_format: str, keep: float, policy: str, n: int,
                 seed: int) -> dict:
    """One what-if as a flat row: the summary's throughput, latency percentiles (seconds), capacity and counters;
    the decode step of the run's mean batch and context by part (``step_<part>_s``); the quality column (the
    K/V scheme's agreement, mean KL and perplexity change, the eviction's and the host format's beside it, each
    with its source: NaN and ``-`` where none applies)."""
    out = run(model, profile, trace, rate, block_size, scheme, kv_gib, preemption, host_gib, host_format, keep, policy,
              n, seed)
    s, mem = out["summary"], out["memory"]
    row = {k: s[k] for k in ("completed", "rejected", "throughput_tok_s", "requests_per_s", "ttft_p50_s",
                             "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "max_concurrency",
                             "preemptions", "swaps_out", "recomputed_tokens", "prefix_hits", "peak_blocks")}
    row.update(kv_blocks=s["kv_blocks"], kv_budget_gib=s["kv_gib"], block_bytes=mem["block_bytes"],
               peak_share=s["peak_blocks"] / s["kv_blocks"], budget=mem["budget"])
    parts = {p["name"]: p["seconds"] for p in out["why"]["decode"]}
    row.update({f"step_{p}_s": parts[p] for p in PARTS})
    row.update(step_s=sum(parts.values()), step_batch=out["why"]["decode_at"]["batch"],
               step_context=out["why"]["decode_at"]["context_per_sequence"])
    c, nan = out["config"], float("nan")
    host = out["quality"]["host_format"]
    if host is None:  # nothing lossy below the device: no cost, or (a format no run measured) unknown
        free = c["preemption"] != "swap" or not c["host_gib"] or c["host_format"] in (None, c["scheme"])
        host = ({"agreement": 1.0, "mean_kl": 0.0, "ppl_change": 0.0, "source": "no host tier" if c["host_gib"] == 0
                 or c["preemption"] != "swap" else "the device's own bytes on the host"} if free else
                {"agreement": nan, "mean_kl": nan, "ppl_change": nan, "source": f"{c['host_format']}: not measured"})
    for prefix, q in (("", out["quality"]["kv_scheme"]), ("eviction_", out["quality"]["eviction"]),
                      ("host_", host)):
        q = q or {"agreement": nan, "mean_kl": nan, "ppl_change": nan, "source": "not measured"}
        row.update({f"{prefix}agreement": q["agreement"], f"{prefix}mean_kl": q["mean_kl"],
                    f"{prefix}ppl_change": q["ppl_change"], f"{prefix}quality_source": q["source"]})
    row["profile_files"] = ", ".join(out["sources"]["files"])
    return row


def frontier(schemes, rates, **params) -> list[dict]:
    """The sweep's points over ``schemes`` x ``rates`` at the other ``params`` (every parameter but scheme and rate):
    rows ``{scheme, rate, **whatif_point(...)}``, scheme by scheme, rates in the order given."""
    schemes, rates = tuple(schemes), tuple(rates)
    if not schemes or not rates:
        raise ValueError(f"schemes and rates must be non-empty, got {schemes!r} and {rates!r}")
    return [{"scheme": s, "rate": float(r), **whatif_point(scheme=s, rate=float(r), **params)}
            for s in schemes for r in rates]


# ---- where the numbers come from --------------------------------------------------------------------------------
INPUT_WORDS = {"copy_gbps": "copy bandwidth (GB/s)", "launch_us": "kernel floor a layer (µs)",
               "gemv_frac": "weight reads (of copy)", "peak_tflops": "tensor peak (TFLOP/s)",
               "prefill_mfu": "prefill (of the peak)", "hbm_gib": "HBM (GiB)",
               "seq_us": "host a sequence a step (µs)", "prefill_us": "host a prefill (µs)"}


def inputs(profile: str = "h200", schemes=("fp16",)) -> list[dict]:
    """The numbers a step is built from, each with its kind (:func:`kind_of`) and source: the profile's measured
    values, each of ``schemes``' decode and write fractions of copy bandwidth, and the host link. Rows ``{input,
    words, value, kind, source, note}`` (``note``: the source in a few words, its files by benchmark)."""
    prof = report.default_profile(profile)
    rows = []
    for f in dataclasses.fields(GpuProfile):
        m = getattr(prof, f.name)
        if isinstance(m, Measured):
            fitted = re.search(r"fitted: (\S+) batch (\d+)", m.source)
            note = (f"to {bench_of(fitted.group(1))}'s CUDA-graph step at batch {fitted.group(2)}" if fitted
                    else bench_of(m.source.removeprefix("assumed: ")))
            rows.append({"input": f.name, "words": INPUT_WORDS.get(f.name, f.name), "value": m.value,
                         "kind": kind_of(m.source), "source": m.source, "note": note})
    for scheme in schemes:
        med, lo, hi, src = prof.decode_frac(scheme)
        points = [w for w, _ in prof.decode[scheme]]
        rows.append({"input": f"decode_frac {scheme}", "words": f"decode {scheme} (of copy)", "value": med,
                     "kind": "measured", "source": src, "note": f"{bench_of(prof.decode_source)}, median of "
                     f"{points[0]}-{points[-1]} ({format_value(lo)} to {format_value(hi)})"})
    for scheme in schemes:
        wf, wsrc = prof.write_frac(scheme)
        near = re.search(r": (\S+) write", wsrc).group(1)
        rows.append({"input": f"write_frac {scheme}", "words": f"write {scheme} (of copy)", "value": wf,
                     "kind": "measured", "source": wsrc, "note": f"{bench_of(prof.decode_source)}, 32k tokens"
                     + (f", {near}'s (nearest)" if near != scheme else "")})
    rows.append({"input": "host link", "words": "host link", "value": float("nan"), "kind": "measured",
                 "source": prof.link.source, "note": f"{bench_of(prof.link.source)}: by transfer size, both ways"})
    return rows


def inputs_text(profile: str = "h200", schemes=("fp16",)) -> str:
    """:func:`inputs` as lines under ~105 characters: the profile's files, then a line an input: what, its value (3
    significant digits), its kind and its source in a few words."""
    prof = report.default_profile(profile)
    lines = [f"profile {prof.name}, from data/results/:", *(f"  {name}" for name in prof.files)]
    for r in inputs(profile, schemes):
        value = "-" if r["value"] != r["value"] else format_value(r["value"])
        lines.append(f"{r['words']:<30} {value:>6}  {r['kind']:<8}  {r['note']}")
    return "\n".join(lines)


def validation_text(n: int = 1000) -> str:
    """What the what-if has been checked against, as lines under ~100 characters (``workbench.whatif.validation``):
    the step model against the real model's measured CUDA-graph step per batch (the floor fitted at batch 1), and
    paged blocks against Orca's reservations at saturation (``n`` requests) beside the vLLM paper's ranges."""
    f = format_value
    steps = validation.step_vs_measured()
    lines = [f"SmolLM2-135M's decode step, model against bench model_decode ({steps[0]['source']}):"]
    for r in steps:
        how = "fitted here" if r["fitted"] else f"error {f(100 * r['error'])}%"
        lines.append(f"  batch {r['batch']:>3}: predicted {f(r['predicted_ms'])}, measured {f(r['measured_ms'])} "
                     f"(ms), {how}")
    rows = validation.paged_vs_reservation(n=n)
    lines.append(f"paged blocks against Orca's reservations: requests/s at saturation, {n} ShareGPT-like requests")
    for r in rows[1:]:
        paper = f"paper {f(r['paper_range'][0])}-{f(r['paper_range'][1])}x" if r["paper_range"] else "paper: -"
        lines.append(f"  paged / {r['allocation']:<6} {f(r['paged_over_this'])}x ({paper}); {r['allocation']} holds "
                     f"{r['max_concurrency']} at most, paged {rows[0]['max_concurrency']}")
    return "\n".join(lines)


# ---- the plain-text summary a check cell prints ------------------------------------------------------------------
def summary(out: dict) -> str:
    """Lines under ~100 characters of one what-if (:func:`run`): the configuration, throughput and latency (ms), the
    memory, one decode step's parts and the quality column, every float to 3 significant digits (``format_value``):
    the simulator is plain Python arithmetic on a seeded trace, so these digits are the same on every machine."""
    c, s, m = out["config"], out["summary"], out["memory"]
    f = format_value
    at = out["why"]["decode_at"]
    parts = {p["part"]: p["ms"] for p in why_table(out)}
    peak = 100 * s["peak_blocks"] / m["kv_blocks"]
    kv = f"{f(c['kv_gib'])} GiB given" if c["kv_gib"] is not None else "auto"
    swap = (f", swap to {f(c['host_gib'])} GiB of host in {c['host_format'] or c['scheme']}"
            if c["preemption"] == "swap" else ", recompute")
    keep = f", {c['policy']} keeps {c['keep']:.0%} of a prompt" if c["keep"] < 1 else ""
    lines = [f"{c['model']} on {c['gpu']}, {c['scheme']} K/V, {c['trace']} x {c['requests']} at {f(c['rate'])}/s, "
             f"{c['block_size']}-token blocks",
             f"  KV {kv}{swap}{keep}",
             f"  throughput {f(s['throughput_tok_s'])} tokens/s ({f(s['requests_per_s'])} requests/s), "
             f"{s['completed']} done, {s['rejected']} rejected",
             f"  TTFT in ms: p50 {f(s['ttft_p50_s'] * 1e3)}, p90 {f(s['ttft_p90_s'] * 1e3)}, "
             f"p99 {f(s['ttft_p99_s'] * 1e3)} | TPOT in ms: p50 {f(s['tpot_p50_s'] * 1e3)}, "
             f"p90 {f(s['tpot_p90_s'] * 1e3)}",
             f"  memory: peak {s['peak_blocks']:,} of {m['kv_blocks']:,} blocks ({f(peak)}%), "
             f"max {s['max_concurrency']} running, {s['preemptions']} preemptions, {s['swaps_out']} swaps",
             f"  decode step in ms (batch {at['batch']}, {at['context_per_sequence']} tokens each): "
             f"{f(sum(parts.values()))}", "    = " + " + ".join(f"{p} {f(parts[p])}" for p in PARTS)]
    words = {"kv_scheme": f"{c['scheme']} K/V", "eviction": f"{c['policy']} keeping {c['keep']:.0%}",
             "host_format": f"{c['host_format']} on the host"}
    for what, q in out["quality"].items():
        if q is None or q["source"] == "no eviction":
            continue
        where = ", ".join(files_of(q["source"])) or q["source"]
        sign = "+" if q["ppl_change"] > 0 else ""
        lines += [f"  quality, {words.get(what, what)}: greedy agreement {f(q['agreement'])}, mean KL "
                  f"{f(q['mean_kl'])}, perplexity {sign}{f(100 * q['ppl_change'])}%", f"    from {where}"]
    return "\n".join(lines)


def brief(out: dict) -> str:
    """Two lines (under 100 characters each) of a what-if: throughput, TTFT and TPOT p50 (ms), the peak share of the
    KV budget and preemptions; then the greedy agreement with fp16 of each quality source that applies (the K/V
    scheme, the evicted prompts, the host copies)."""
    s, f = out["summary"], format_value
    swapped = f" ({s['swaps_out']} by swap)" if s["swaps_out"] else ""
    words = {"kv_scheme": "K/V", "eviction": "evicted prompts", "host_format": "host copies"}
    quality = ", ".join(f"{words[k]} {f(q['agreement'])}" for k, q in out["quality"].items()
                        if q is not None and q["source"] != "no eviction")
    return (f"{f(s['throughput_tok_s'])} tokens/s; TTFT {f(1e3 * s['ttft_p50_s'])}, TPOT "
            f"{f(1e3 * s['tpot_p50_s'])} (ms, p50); KV peak {f(100 * s['peak_blocks'] / s['kv_blocks'])}%, "
            f"{s['preemptions']} preempted{swapped}\n    greedy agreement with fp16: {quality or '-'}")


def frontier_table(rows: list[dict]) -> str:
    """:func:`frontier` rows as a table under 100 characters wide: a line a scheme, its throughput, TTFT p50, TPOT
    p50 (ms) and preemptions at each rate (3 significant digits)."""
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    f = format_value

    def cells(pts, key, scale=1.0):
        return " ".join(f"{f(scale * p[key]):>5}" for p in pts)

    w = 6 * len(rates) - 1
    lines = [f"{'at ' + ', '.join(f(r) for r in rates) + ' requests/s':<{15 + w}}",
             f"{'':14} {'tokens/s':<{w}} | {'TTFT p50 (ms)':<{w}} | {'TPOT p50 (ms)':<{w}} | preempted"]
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        pts = sorted((r for r in rows if r["scheme"] == scheme), key=lambda r: r["rate"])
        lines.append(f"{scheme:<14} {cells(pts, 'throughput_tok_s')} | {cells(pts, 'ttft_p50_s', 1e3)} | "
                     f"{cells(pts, 'tpot_p50_s', 1e3)} | " + " ".join(str(p["preemptions"]) for p in pts))
    return "\n".join(line.rstrip() for line in lines)


def draw_run(result: dict):
    """The run panel's figure (``whatif_figures.run_figure``): out, setup."""
    from workbench.figures import whatif as whatif_figures  # plotly: optional, imported to draw

    return whatif_figures.run_figure(result["out"], result["setup"])


MS = ("ms", 1e3)
COLUMNS = {
    "model": ("model",), "profile": ("GPU profile",), "trace": ("trace",), "rate": ("arrival rate", "requests/s"),
    "block_size": ("block size", "tokens"), "scheme": ("K/V scheme",), "kv_gib": ("KV memory given (0: auto)", "GiB"),
    "preemption": ("preemption",), "host_gib": ("host tier", "GiB"), "host_format": ("host format",),
    "keep": ("prompt kept (eviction budget)",), "policy": ("eviction policy",), "n": ("requests",),
    "seed": ("seed",), "completed": ("requests completed",), "rejected": ("requests rejected",),
    "throughput_tok_s": ("throughput", "tokens/s"), "requests_per_s": ("requests completed a second", "/s"),
    "ttft_p50_s": ("TTFT p50", *MS), "ttft_p90_s": ("TTFT p90", *MS), "ttft_p99_s": ("TTFT p99", *MS),
    "tpot_p50_s": ("TPOT p50", *MS), "tpot_p90_s": ("TPOT p90", *MS), "tpot_p99_s": ("TPOT p99", *MS),
    "max_concurrency": ("most requests running",), "preemptions": ("preemptions",), "swaps_out": ("swaps out",),
    "recomputed_tokens": ("tokens prefilled again",), "prefix_hits": ("prefix-cache hits",),
    "peak_blocks": ("peak blocks in use",), "kv_blocks": ("KV budget", "blocks"),
    "kv_budget_gib": ("KV budget", "GiB"), "block_bytes": ("a block", "bytes"),
    "peak_share": ("peak share of the KV budget",), "step_s": ("decode step", *MS),
    "step_*_s": ("decode step: {}", *MS), "step_batch": ("decode step's batch",),
    "step_context": ("decode step's context a sequence", "tokens"), "agreement": ("greedy agreement with fp16",),
    "mean_kl": ("mean KL against fp16",), "ppl_change": ("perplexity change against fp16",),
    "eviction_agreement": ("eviction: greedy agreement",), "eviction_mean_kl": ("eviction: mean KL",),
    "eviction_ppl_change": ("eviction: perplexity change",), "host_agreement": ("host format: greedy agreement",),
    "host_mean_kl": ("host format: mean KL",), "host_ppl_change": ("host format: perplexity change",),
}

WHATIF = Study(
    "whatif", "a serving what-if: throughput, TTFT / TPOT, capacity, a step's parts and quality of one configuration", (
        Param("model", "str", "llama-3.1-8b", choices=tuple(models.PRESETS), label="model", widget="dropdown"),
        Param("profile", "str", "h200", choices=tuple(GPUS), labels=GPUS, label="GPU profile", widget="dropdown"),
        Param("trace", "str", "sharegpt", choices=tuple(TRACES), labels=TRACES, label="trace"),
        Param("rate", "float", 8.0, choices=RATES, grid=(2.0, 8.0, 32.0, 128.0), label="requests/s",
              help="Poisson arrivals a second"),
        Param("block_size", "int", 16, choices=(8, 16, 32, 64, 128), label="block (tokens)"),
        Param("scheme", "str", "fp16", choices=SCHEMES, grid=WHATIF_GRID,
              label="K/V scheme", widget="dropdown"),
        Param("kv_gib", "float", AUTO, choices=KV_GIBS, labels={AUTO: "auto"}, label="KV GiB",
              help="0: auto (HBM x 0.9 - weights - 1 GiB of activations)"),
        Param("preemption", "str", "recompute", choices=PREEMPTION, label="preemption"),
        Param("host_gib", "float", 16.0, choices=HOST_GIBS, label="host GiB", help="preemption=swap"),
        Param("host_format", "str", SAME, choices=(SAME, *TIER_FORMATS), labels={SAME: "as on the device"},
              label="host format", widget="dropdown", help="preemption=swap, host_gib > 0"),
        Param("keep", "float", 1.0, choices=KEEPS, labels={1.0: "all"}, label="prompt kept",
              help="an eviction budget: the share of each prompt's tokens kept after prefill"),
        Param("policy", "str", "h2o", choices=POLICIES, label="eviction policy", help="keep < 1"),
        Param("n", "int", 1000, minimum=1, maximum=100000, help="requests of the trace"),
        Param("seed", "int", 0, minimum=0, maximum=2**31 - 1, help="the trace's seed")),
    whatif_point, notebook="10_serving_whatif", panel="run_panel", x="rate", color="scheme",
    y=("throughput_tok_s", "ttft_p50_s", "tpot_p50_s", "max_concurrency", "preemptions", "peak_share", "step_s",
       "agreement"),
    columns=COLUMNS, controls=("model", "profile", "trace", "rate", "block_size", "scheme", "kv_gib", "preemption",
                               "host_gib", "host_format", "keep", "policy"),
    enabled={"host_gib": lambda preemption, **_: preemption == "swap",
             "host_format": lambda preemption, host_gib, **_: preemption == "swap" and host_gib > 0,
             "policy": lambda keep, **_: keep < 1},
    draw=draw_run)
STUDIES = (WHATIF,)
