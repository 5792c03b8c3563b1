"""``python -m workbench whatif``: a serving what-if from a shell (``workbench.whatif.report.whatif``), a table out.

    python -m workbench whatif --model llama-3.1-8b --scheme int4/token --rate 8
    python -m workbench whatif --model my/config.json --trace my_trace.jsonl --kv-gib 20 --preemption swap \\
        --host-gib 64 --host-format int8/token
    python -m workbench whatif --keep 0.25 --policy h2o --json          # the whatif() dict as JSON
    python -m workbench whatif --sensitivity                            # which measured input moves what
    python -m workbench whatif --profile DIR --gpu h100-80gb-hbm3       # a profile `python -m workbench profile` made

The table: the summary numbers with their units, the "why" of one decode step (each part's time, share and
source) and of one prefill, and the quality column (each number with the study it comes from).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workbench import quant
from workbench.compress.policies import NAMES as POLICIES
from workbench.core.argtypes import nonneg_float, nonneg_int, positive_float, positive_int, share
from workbench.sim import traces
from workbench.whatif import models
from workbench.whatif.profile import GpuProfile
from workbench.whatif.report import OUTPUTS, default_profile, load_trace, sensitivity, whatif
from workbench.whatif.serve import PREEMPTION, RESERVE, Knobs
from workbench.whatif.step_time import decode_run, fit_layer_overhead

GIB = 1 << 30


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so main() can return 2 with one clear line."""

    def error(self, message: str):
        raise ValueError(message)


# ---- argparse types -------------------------------------------------------------------------------------------------
def model_arg(text: str) -> str:
    """A preset name or a config.json path that exists."""
    if text in models.PRESETS or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(models.PRESETS)} or a config.json path, "
                                     f"got {text!r}")


def trace_arg(text: str) -> str:
    """A preset trace name or a JSONL file that exists."""
    if text in traces.PRESETS or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"expected {' or '.join(traces.PRESETS)} or a JSONL file, got {text!r}")


def scheme_arg(text: str) -> str:
    """A K/V storage scheme ``workbench.quant`` knows, by its full name (``int4`` -> ``int4/kivi``)."""
    try:
        return quant.get(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m workbench whatif", description=__doc__.splitlines()[0],
                epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_arg, default="smollm2-135m",
                   help=f"a preset ({', '.join(models.PRESETS)}) or a llama-style config.json (default smollm2-135m)")
    p.add_argument("--scheme", type=scheme_arg, default="fp16", help="K/V storage scheme the profile timed "
                   "(default fp16)")
    p.add_argument("--trace", type=trace_arg, default="sharegpt",
                   help="sharegpt, alpaca (generated with --requests, --rate, --seed) or a JSONL file of "
                        "{arrival_s, prompt, output} (default sharegpt)")
    p.add_argument("--requests", type=positive_int, default=1000, help="requests (a file: its first N; default 1000)")
    p.add_argument("--rate", type=positive_float, default=None,
                   help="arrivals per second, Poisson (default: the preset's, or the file's own arrival times)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the trace (default 0)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens a KV block (default 16)")
    p.add_argument("--kv-gib", type=positive_float, default=None,
                   help="KV memory in GiB (default: HBM x 0.9 - weights - 1 GiB of activations)")
    p.add_argument("--max-batch", type=positive_int, default=256, help="sequences a step at most (default 256)")
    p.add_argument("--token-budget", type=positive_int, default=2048, help="tokens a step at most, decode and "
                   "prefill chunks (default 2048)")
    p.add_argument("--no-prefix-caching", action="store_true", help="prefill the shared prefix every time")
    p.add_argument("--shared-prefix", type=nonneg_int, default=0, help="tokens of a system prompt every request "
                   "starts with (default 0)")
    p.add_argument("--preemption", choices=PREEMPTION, default="recompute", help="when the KV memory runs out "
                   "(default recompute)")
    p.add_argument("--host-gib", type=nonneg_float, default=0.0, help="host tier for swapped blocks, GiB "
                   "(--preemption swap; default 0)")
    p.add_argument("--host-format", type=scheme_arg, default=None, help="scheme of the swapped blocks on the host "
                   "(default: the device's)")
    p.add_argument("--reserve", choices=RESERVE, default="paged", help="paged blocks on demand, or an Orca-style "
                   "reservation at admission: max (--max-len tokens), pow2 (the power of two above the request's "
                   "length), oracle (its exact length) (default paged)")
    p.add_argument("--max-len", type=positive_int, default=2048, help="the most tokens a request may hold (what "
                   "--reserve max reserves; default 2048)")
    p.add_argument("--keep", type=share, default=1.0, help="share of each prompt kept after prefill, an "
                   "eviction budget (default 1: none evicted)")
    p.add_argument("--policy", choices=POLICIES, default="full", help="the eviction policy of --keep (quality "
                   "column; default full)")
    p.add_argument("--frac", choices=("median", "min", "max"), default="median",
                   help="decode bandwidth of the scheme: median, min or max of the measured workloads W1-W5")
    p.add_argument("--profile", default=None, metavar="DIR", help="a folder of result files (`python -m workbench "
                   "profile --out DIR`; default: the committed H200 runs in data/results)")
    p.add_argument("--gpu", default="h200", help="the GPU name in the profile's file names (default h200)")
    p.add_argument("--sensitivity", action="store_true", help="also vary each measured input by its spread "
                   "(13 runs)")
    p.add_argument("--json", action="store_true", help="print the whatif() dict as JSON")
    return p


def load_profile(folder: str | None, gpu: str) -> GpuProfile:
    """The committed profile, or the one in ``folder`` with its per-layer floor fitted to its ``bench model_decode``
    run at batch 1 when it has one (else the assumed floor, which its sources say)."""
    if folder is None:
        return default_profile(gpu)
    d = Path(folder)
    if not d.is_dir():
        raise ValueError(f"argument --profile: {folder} is not a folder")
    try:
        prof = GpuProfile.from_results(d, name=gpu)
    except (ValueError, KeyError) as e:
        raise ValueError(f"argument --profile: {e}") from None
    run = decode_run(d, gpu)
    return fit_layer_overhead(prof, models.PRESETS["smollm2-135m"], run=run) if run else prof


def knobs_of(args: argparse.Namespace) -> Knobs:
    return Knobs(block_size=args.block_size, kv_gib=args.kv_gib, max_batch=args.max_batch,
                 token_budget=args.token_budget, prefix_caching=not args.no_prefix_caching,
                 shared_prefix=args.shared_prefix, preemption=args.preemption, host_gib=args.host_gib,
                 host_format=args.host_format, keep=args.keep, policy=args.policy, reserve=args.reserve,
                 max_len=args.max_len)


def main(argv: list[str] | None = None) -> int:
    """Run one what-if; returns the exit status (2 on bad input, with one line on stderr naming the flag)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        if args.max_len < 2:
            raise ValueError(f"argument --max-len: expected an integer >= 2, got {args.max_len}")
        if args.keep < 1 and args.policy == "full":
            raise ValueError(f"argument --policy: --keep {args.keep:g} evicts tokens: name the policy that picks "
                             f"them ({', '.join(p for p in POLICIES if p != 'full')})")
        for warning in _ignored(args):
            print(f"whatif: warning: {warning}", file=sys.stderr)
        prof = load_profile(args.profile, args.gpu)
        if args.scheme not in prof.schemes:
            raise ValueError(f"argument --scheme: {args.scheme!r} was not timed by the profile's run "
                             f"({prof.decode_source}); choose from {', '.join(prof.schemes)}")
        try:
            models.get(args.model)
        except ValueError as e:
            raise ValueError(f"argument --model: {e}") from None
        try:
            trace = load_trace(args.trace, args.requests, args.rate, args.seed)
        except ValueError as e:
            raise ValueError(f"argument --trace: {e}") from None
        kw = dict(scheme=args.scheme, trace=trace, n=args.requests, rate=args.rate, seed=args.seed,
                  knobs=knobs_of(args), profile=prof, frac=args.frac)
        try:
            out = whatif(args.model, **kw)
        except ValueError as e:
            raise ValueError(f"{e} (give --kv-gib)" if "KV budget" in str(e) else str(e)) from None
        if args.sensitivity:
            kw.pop("frac")
            out["sensitivity"] = sensitivity(args.model, **kw)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except ValueError as e:
        print(f"whatif: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(format_report(out))
        if args.sensitivity:
            print()
            print(format_sensitivity(out["sensitivity"]))
    if not out["summary"]["completed"]:
        print("whatif: warning: no request completed: raise --kv-gib or lower --block-size", file=sys.stderr)
    return 0


def _ignored(args: argparse.Namespace) -> list[str]:
    """Flags that change nothing with the others given."""
    out = []
    if args.preemption != "swap" and args.host_gib:
        out.append("--host-gib is used by --preemption swap only")
    if args.preemption != "swap" and args.host_format:
        out.append("--host-format is used by --preemption swap only")
    if args.preemption == "swap" and not args.host_gib:
        out.append("--preemption swap with --host-gib 0: every preemption recomputes")
    if args.policy != "full" and args.keep >= 1:
        out.append(f"--policy {args.policy} with --keep 1 evicts nothing")
    return out


# ---- the table ------------------------------------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    """A time in us, ms or s (3 significant digits)."""
    if seconds != seconds:
        return "-"
    if seconds == 0:
        return "0 s"
    return f"{seconds * 1e6:.3g} us" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms" if seconds < 1 \
        else f"{seconds:.3g} s"


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _parts(parts: list[dict]) -> list[str]:
    total = sum(p["seconds"] for p in parts)
    lines = [f"    {'part':<10} {'time':>10} {'share':>6}  source"]
    for p in parts:
        share = p["seconds"] / total if total else 0.0
        lines.append(f"    {p['name']:<10} {_ms(p['seconds']):>10} {share:>6.1%}  {p['source']}")
    return lines


def _quality(q: dict | None, absent: str) -> str:
    if q is None:
        return f"{'-':>9} {'-':>9} {'-':>10}  {absent}"
    ppl = q["ppl_change"]
    return f"{q['agreement']:>9.1%} {q['mean_kl']:>9.4f} {'-' if ppl != ppl else f'{ppl:+.2%}':>10}  {q['source']}"


def format_report(d: dict) -> str:
    """The what-if's dict (``whatif()``) as the command's table: summary with units, the why of a step, quality."""
    c, s, m, why = d["config"], d["summary"], d["memory"], d["why"]
    rate = f"{c['rate']:g} requests/s" if c["rate"] else "the trace's own arrival times"
    lines = [f"what-if: {c['model']} on {c['gpu']}, K/V {c['scheme']}, {c['requests']} requests of {c['trace']} at "
             f"{rate}",
             f"  blocks of {c['block_size']} tokens ({_size(m['block_bytes'])}), KV memory {m['kv_blocks']} blocks "
             f"({m['budget']}),",
             f"  max batch {c['max_batch']}, token budget {c['token_budget']}, prefix caching "
             f"{'on' if c['prefix_caching'] else 'off'}, shared prefix {c['shared_prefix']} tokens, preemption by "
             f"{c['preemption']}" + (f" (host {c['host_gib']:g} GiB in {c['host_format'] or c['scheme']})"
                                      if c["preemption"] == "swap" else "")
             + (f", keep {c['keep']:g} of each prompt ({c['policy']})" if c["keep"] < 1 else "")
             + (f", Orca-style reservation: {c['reserve']}" + (f" ({c['max_len']} tokens)" if c["reserve"] == "max"
                                                                else "") if c.get("reserve", "paged") != "paged"
                else ""),
             "", "summary"]
    peak = s.get("peak_blocks", 0)
    rows = [
        ("completed", f"{s['completed']} of {s['requests']} requests" + (f" ({s['rejected']} rejected: longer "
                                                                          f"than the whole KV memory)"
                                                                          if s.get("rejected") else "")),
        ("throughput", f"{s['throughput_tok_s']:,.0f} tokens/s ({s['requests_per_s']:.3g} requests/s)"),
        ("TTFT p50/p90/p99", " / ".join(_ms(s[f"ttft_p{q}_s"]) for q in (50, 90, 99))),
        ("TPOT p50/p90/p99", " / ".join(_ms(s[f"tpot_p{q}_s"]) for q in (50, 90, 99))),
        ("max concurrency", f"{s['max_concurrency']} sequences"),
        ("KV memory peak", f"{peak} of {s['kv_blocks']} blocks ({peak / s['kv_blocks']:.1%}; "
                           f"{_size(peak * m['block_bytes'])} of {s['kv_gib']:.3g} GiB)"),
        ("preemptions", f"{s.get('preemptions', 0)} ({s.get('swaps_out', 0)} swapped out, {s.get('swaps_in', 0)} "
                        f"in, {_size(s.get('swap_bytes', 0))} over the link in {_ms(s.get('swap_seconds', 0.0))}; "
                        f"{s.get('recomputed_tokens', 0)} tokens recomputed)"),
        ("prefix hits", f"{s.get('prefix_hits', 0)} admissions"),
        ("steps", f"{s['steps']}"),
    ]
    lines += [f"  {k:<18} {v}" for k, v in rows]
    at = why["decode_at"]
    dec = sum(p["seconds"] for p in why["decode"])
    lines += ["", f"why: one decode step of {at['batch']} sequences x {at['context_per_sequence']} tokens of context "
                  f"= {_ms(dec)}"] + _parts(why["decode"])
    pre = sum(p["seconds"] for p in why["prefill"])
    lines += [f"  a prefill of the mean prompt = {_ms(pre)}"] + _parts(why["prefill"])
    q = d["quality"]
    lines += ["", "quality (SmolLM2-135M on real text against the fp16 cache; each from its own study, not combined)",
              f"  {'what':<12} {'agreement':>9} {'mean KL':>9} {'ppl change':>10}  source",
              f"  {'K/V scheme':<12} {_quality(q['kv_scheme'], 'no committed run measured this scheme')}",
              f"  {'eviction':<12} {_quality(q['eviction'], 'no committed run measured this policy')}",
              f"  {'host format':<12} {_quality(q['host_format'], 'none: lossless, unused or not measured')}",
              "", "files: " + ", ".join(d["sources"]["files"])]
    assumed = [k for k, v in d["sources"].items() if k != "files" and str(v).startswith(("assumed", "fitted"))]
    if assumed:
        lines.append("not measured (assumed or fitted, see the why's sources): " + ", ".join(assumed))
    return "\n".join(lines)


def format_sensitivity(rows: list[dict], outputs=OUTPUTS) -> str:
    """``sensitivity()``'s rows as a table of relative changes (%), the largest effect first."""
    head = f"  {'input':<12} {'low':>13} {'high':>13}  " + "  ".join(f"{o:>20}" for o in outputs)
    lines = ["sensitivity: each output's change (low / high) when one input moves by its spread", head]
    for r in rows:
        cells = "  ".join(f"{_pct(r[f'{o}_low']):>9} /{_pct(r[f'{o}_high']):>9}" for o in outputs)
        lines.append(f"  {r['input']:<12} {r['low']:>13} {r['high']:>13}  {cells}")
    return "\n".join(lines)


def _pct(v: float) -> str:
    return "-" if v != v else f"{v:+.1%}"


if __name__ == "__main__":
    sys.exit(main())
