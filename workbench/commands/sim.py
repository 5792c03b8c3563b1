"""Command line of the simulator: ``python -m workbench sim {fig2,seed-table,run,forks} ...``.

  fig2 [--json] [--trace T] [--seed N] [--requests N] [--allocator A] [--block-size B] [--sensitivity]
      the vLLM paper's Figure 2 for Orca (Max/Pow2/Oracle) and vLLM, against the paper's numbers (ShareGPT
      only: other traces are not compared); warns when a system completes nothing
  seed-table [--json] [--batch N] [--gpu-gib G] [--block-size B]
      the seed's Table 5.1 recomputed, with verdicts
  run [--strategy S] [--trace T] [--requests N] [--model M] [--kv-gib G | --gpu-gib G] [--preemption P]
      [--max-steps N] [--step-s S] [--max-batch N] [--json]
      one strategy on one trace: throughput, completion rate, batch, memory shares; warns when nothing completes
  forks [--trace T ...] [--mode M ...] [--n N ...] [--requests N] [--p-top P] [--block-size B] [--step-s S]
      [--seed N] [--sensitivity] [--json] [--out DIR]
      parallel sampling and beam search sharing blocks (copy-on-write): the memory saved against the vLLM paper's
      section 6.3; writes a JSON results file to results/ (git-ignored) unless --out DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from workbench.core.argtypes import ensure_writable_dir, positive_float, positive_int
from workbench.results import provenance, run_files
from workbench.sim import engine, fig2, forks, forks_report, seed_table, traces
from workbench.sim import strategies as st
from workbench.sim.budget import kv_budget

# The subcommands, each with the line `python -m workbench sim --help` shows for it.
COMMANDS = {
    "fig2": "the vLLM paper's Figure 2 (memory breakdown of four systems) against the paper's ShareGPT bars",
    "seed-table": "the seed's Table 5.1 (LLaMA-7B, 80 GB) recomputed, with verdicts",
    "run": "one strategy on one trace: throughput, completion rate, batch, memory shares",
    "forks": "parallel sampling and beam search sharing blocks: memory saved against the vLLM paper's section 6.3",
}


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so main() can return 2 with a clear message."""

    def error(self, message: str):
        raise ValueError(message)


def _unit(text: str) -> float:
    """A number in [0, 1] (argparse type)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m workbench sim", description="Serving simulator of KV-cache allocation")
    sub = p.add_subparsers(dest="command", metavar="command", parser_class=_Parser)
    sub.required = True

    f = sub.add_parser("fig2", help=COMMANDS["fig2"])
    f.add_argument("--json", action="store_true", help="print JSON")
    f.add_argument("--trace", default="sharegpt", help="sharegpt, alpaca or a JSONL path (default sharegpt)")
    f.add_argument("--seed", type=int, default=None, help="regenerate the preset trace with this seed")
    f.add_argument("--requests", type=positive_int, default=None, help="use the first N requests")
    f.add_argument("--allocator", choices=st.ALLOCATORS, default="buddy", help="Orca's allocator")
    f.add_argument("--block-size", type=positive_int, default=16, help="vLLM block size (tokens)")
    f.add_argument("--all-steps", action="store_true", help="average over all steps, not only saturated ones")
    f.add_argument("--sensitivity", action="store_true", help="also vary each assumption (slower)")

    s = sub.add_parser("seed-table", help=COMMANDS["seed-table"])
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--batch", type=positive_int, default=16, help="sequences in the cache (default 16)")
    s.add_argument("--gpu-gib", type=positive_float, default=80.0, help="GPU memory in GiB (default 80)")
    s.add_argument("--block-size", type=positive_int, default=16, help="paged block size (default 16)")

    r = sub.add_parser("run", help=COMMANDS["run"])
    r.add_argument("--strategy", default="vllm", help=f"one of {', '.join(st.STRATEGIES)}")
    r.add_argument("--block-size", type=positive_int, default=None, help="override the block size (paged)")
    r.add_argument("--allocator", choices=st.ALLOCATORS, default=None, help="override the allocator (Orca)")
    r.add_argument("--trace", default="sharegpt", help="sharegpt, alpaca or a JSONL path")
    r.add_argument("--requests", type=positive_int, default=None, help="use the first N requests")
    r.add_argument("--model", default="llama-13b", help="model spec for bytes per token and weights")
    r.add_argument("--kv-gib", type=positive_float, default=None, help="KV memory in GiB (default 12)")
    r.add_argument("--gpu-gib", type=positive_float, default=None, help="derive the KV budget from a GPU size")
    r.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    r.add_argument("--max-steps", type=positive_int, default=None, help="step budget (completion rate)")
    r.add_argument("--step-s", type=positive_float, default=None, help="seconds per step (timed arrivals)")
    r.add_argument("--max-batch", type=positive_int, default=256)
    r.add_argument("--json", action="store_true", help="print JSON")

    k = sub.add_parser("forks", help=COMMANDS["forks"])
    k.add_argument("--trace", nargs="+", default=["alpaca", "sharegpt"], help="presets or JSONL paths (default both)")
    k.add_argument("--mode", nargs="+", choices=("parallel", "beam"), default=["parallel", "beam"])
    k.add_argument("--n", nargs="+", type=positive_int, default=[2, 4, 6], help="samples / beam widths (default 2 4 6)")
    k.add_argument("--requests", type=positive_int, default=3000, help="use the first N requests (default 3000)")
    k.add_argument("--p-top", type=_unit, default=None, help="beam model: P(a slot goes to the best beam) (0.25)")
    k.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (default 16)")
    k.add_argument("--step-s", type=positive_float, default=None, help="seconds per step (default: all queued at 0)")
    k.add_argument("--seed", type=int, default=0, help="seed of the beam draws")
    k.add_argument("--sensitivity", action="store_true", help="also the beam saving over p_top (~1 min)")
    k.add_argument("--json", action="store_true", help="print JSON")
    k.add_argument("--out", default=None, help="results folder (default results/, git-ignored; or data/results)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run a simulator command; returns the exit status (2 on bad input, with a message on stderr)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        return {"fig2": _fig2, "seed-table": _seed_table, "run": _run, "forks": _forks}[args.command](args)
    except SystemExit as e:  # --help prints and exits 0
        return int(e.code or 0)
    except ValueError as e:
        print(f"sim: {e}", file=sys.stderr)
        return 2


def _fig2(args) -> int:
    d = fig2.breakdown(args.trace, seed=args.seed, n=args.requests, allocator=args.allocator,
                       block_size=args.block_size, saturated=not args.all_steps)
    if args.sensitivity:
        d["sensitivity"] = fig2.sensitivity(progress=True)  # ~15 s: a bar on stderr; stdout may be JSON
    if args.json:
        print(json.dumps(d, indent=1))
    else:
        print(fig2.format_table(d))
        if args.sensitivity:
            print()
            print(fig2.format_sensitivity(d["sensitivity"]))
    n = d["setup"]["requests"]
    for name, v in d["systems"].items():
        if not v["completed"]:
            blocks = f" with {args.block_size}-token blocks" if name == "vLLM" else ""
            print(f"warning: nothing fit: {name} completed none of the {n} requests in {d['setup']['slots']} "
                  f"slots{blocks}; its bars are empty, not a result", file=sys.stderr)
    return 0


def _seed_table(args) -> int:
    d = seed_table.table(args.batch, gpu_gib=args.gpu_gib, block_size=args.block_size)
    print(json.dumps(d, indent=1) if args.json else seed_table.format_table(d))
    return 0


def _run(args) -> int:
    overrides = {}
    if args.block_size is not None:
        cfg = st.get(args.strategy)
        overrides["small" if isinstance(cfg, st.PagedAdaptive) else "block_size"] = args.block_size
    if args.allocator is not None:
        overrides["allocator"] = args.allocator
    cfg = st.get(args.strategy, **overrides)  # ValueError: an unknown strategy, option or value
    if args.kv_gib is not None and args.gpu_gib is not None:
        raise ValueError("give --kv-gib or --gpu-gib, not both")
    if args.gpu_gib is not None:
        budget = kv_budget(args.model, args.gpu_gib)
    else:
        budget = kv_budget(args.model, kv_gib=12 if args.kv_gib is None else args.kv_gib)
    trace = traces.load(args.trace)
    if args.requests is not None and args.requests < len(trace):
        trace = trace.head(args.requests)
    res = engine.run(trace, cfg, budget, preemption=args.preemption, max_batch=args.max_batch,
                     max_steps=args.max_steps, step_s=args.step_s)
    summary = res.summary()
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for k, v in summary.items():
            print(f"{k:>24}: {v}")
    if not summary.get("completed"):
        n, rejected = summary.get("requests", len(trace)), summary.get("rejected", 0)
        if rejected:
            print(f"warning: nothing fit: no request completed ({rejected} of {n} rejected) in a KV budget of "
                  f"{summary.get('slots')} slots; raise --kv-gib/--gpu-gib or lower --block-size", file=sys.stderr)
        else:
            print(f"warning: no request completed in {summary.get('steps')} steps (of {n}); raise --max-steps",
                  file=sys.stderr)
    return 0


def _forks(args) -> int:
    if args.seed < 0:
        raise ValueError(f"argument --seed: must be >= 0, got {args.seed}")
    p_top = forks.DEFAULT_P_TOP if args.p_top is None else args.p_top
    try:
        out = ensure_writable_dir(run_files.DEFAULT_OUT if args.out is None else args.out)
    except ValueError as e:  # before the work, not after
        raise ValueError(f"argument --out: {e}") from None
    start = time.perf_counter()
    rows = forks_report.table(
        tuple(args.trace),
        tuple(args.mode),
        tuple(args.n),
        requests=args.requests,
        p_top=p_top,
        block_size=args.block_size,
        step_s=args.step_s,
        seed=args.seed,
    )
    sens = None
    if args.sensitivity:
        sens = forks_report.sensitivity(
            tuple(args.trace),
            tuple(args.n),
            requests=min(args.requests, 1000),
            block_size=args.block_size,
            seed=args.seed,
        )
    seconds = time.perf_counter() - start
    meta = provenance.machine_meta()
    meta["gpu"] = "cpu-" + (platform.machine() or "unknown")  # a pure-Python simulation: no GPU involved
    meta["command"] = " ".join(["python -m workbench sim", *args.argv])
    extra = {
        "paper": {
            "source": forks_report.PAPER_SOURCE,
            "range_pct": {f"{t}/{m}": list(v) for (t, m), v in forks_report.PAPER.items()},
        },
        "setup": {
            "requests": args.requests,
            "block_size": args.block_size,
            "p_top": p_top,
            "step_s": args.step_s,
            "seed": args.seed,
            "budget": "12 GiB of llama-13b (OPT-13B's KV shape), max 256 sequences, 1% watermark",
            "preemption": "the group admitted last is swapped out and resumes at the step it left",
            "arrivals": "all queued at step 0 (saturated)" if args.step_s is None else "trace arrival times",
            "output_lengths": "every sample / beam generates the request's output length",
            "beam_model": "child i of the k new beams is a child of the best beam with probability p_top, else "
            "continues beam i",
            "saving": "1 - sum(shared) / sum(unshared) over the run's steps",
        },
        "sensitivity": sens,
        "seconds": round(seconds, 2),
    }
    path = run_files.write_results("sim_forks", rows, meta, out, extra=extra)
    if args.json:
        print(json.dumps({"rows": rows, "sensitivity": sens}, indent=1))
    else:
        print(forks_report.format_table(rows))
        if sens:
            print()
            print(forks_report.format_sensitivity(sens))
    sys.stdout.flush()
    print(f"{len(rows)} rows in {seconds:.1f} s; wrote {path}", file=sys.stderr)
    return 0
