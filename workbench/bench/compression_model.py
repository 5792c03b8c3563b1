"""The real-model compression study as a command: ``python -m workbench bench compression_model [--smoke] [--out DIR]``.

SmolLM2-135M on the CPU (``ops="torch"``): each policy and budget, teacher-forced against the full cache, through an
``EvictingKV`` that frees real blocks (``workbench.compress.model_study`` holds the study; this module the command:
arguments, progress, metadata and the results file).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

from workbench.bench.command import BenchParser
from workbench.compress import model_study as study
from workbench.core.argtypes import positive_int
from workbench.model import gguf_weights, load_smollm2
from workbench.results import provenance, run_files


def _floats(name: str):
    def parse(text: str) -> tuple[float, ...]:
        try:
            out = tuple(float(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be comma separated numbers, got {text!r}") from None
        if not out:
            raise argparse.ArgumentTypeError(f"{name} must name at least one number")
        return out
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = BenchParser("compression_model", __doc__, smoke="a tiny study.run (~10 s after loading the model)")
    ap.add_argument("--policies", default=None, help=f"comma separated (default {','.join(study.DEFAULT_POLICIES)}; "
                                                     "--smoke: streaming,h2o)")
    ap.add_argument("--budgets", type=_floats("--budgets"), default=None,
                    help="shares of the prompt (default 0.1,0.25,0.5; --smoke 0.25)")
    ap.add_argument("--thresholds", type=_floats("--thresholds"), default=study.DEFAULT_THRESHOLDS,
                    help="attention-probability thresholds of the threshold policy (default 0.02,0.005)")
    ap.add_argument("--partials", default=",".join(study.PARTIALS), help="keep,compact (default both)")
    ap.add_argument("--prompts", type=positive_int, default=None,
                    help="the first N of workbench.model.capture.PROMPTS (default all 5; --smoke 1)")
    ap.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                    help="cut each prompt to this many tokens (default none; --smoke 64)")
    ap.add_argument("--new-tokens", type=positive_int, default=None,
                    help="greedy tokens of the reference continuation (default 32; --smoke 4)")
    ap.add_argument("--obs-window", type=positive_int, default=32, help="queries the policies see")
    ap.add_argument("--every", type=positive_int, default=None,
                    help="also re-evict every N decode steps (default: only after the prefill)")
    ap.add_argument("--kv-dtype", default="fp32", help="cache storage (default fp32: only eviction differs)")
    ap.add_argument("--threads", type=positive_int, default=1,
                    help="torch CPU threads (default 1: on a busy 2-core CPU more threads stall each other)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    pick = lambda v, full, tiny: v if v is not None else (tiny if smoke else full)  # noqa: E731
    names = args.policies.split(",") if args.policies else (["streaming", "h2o"] if smoke else study.DEFAULT_POLICIES)
    partials = [p.strip() for p in args.partials.split(",") if p.strip()]
    if not partials or any(p not in study.PARTIALS for p in partials):
        ap.error(f"argument --partials: must be among {study.PARTIALS}, got {args.partials!r}")
    try:
        cfgs = study.configs([n.strip() for n in names], pick(args.budgets, study.DEFAULT_BUDGETS, (0.25,)),
                       args.thresholds, partials)
    except ValueError as e:
        ap.error(f"argument --policies/--budgets/--thresholds: {e}")
    new_tokens = pick(args.new_tokens, 32, 4)
    if new_tokens < 2:
        ap.error("argument --new-tokens: must be >= 2 (the first token comes before any eviction)")
    out = ap.start(args)
    if (why := gguf_weights.model_available()) is not None:
        print(f"the model study needs SmolLM2-135M: {why}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tok = load_smollm2()
    load_s = time.perf_counter() - start

    def progress(i, name, n):
        print(f"[{i + 1}] {name} ({n} tokens, {len(cfgs)} configurations): {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)

    rows = study.run(model, tok, prompts=pick(args.prompts, None, 1), max_prompt_tokens=pick(args.max_prompt_tokens,
               None, 64), progress=progress, cfgs=cfgs, new_tokens=new_tokens, kv_dtype=args.kv_dtype,
               obs_window=args.obs_window, every=args.every)
    summary = study.summarize(rows)
    total_s = time.perf_counter() - start
    run_files.print_table(summary, study.SUMMARY_COLUMNS, study.HEADERS)
    meta = provenance.machine_meta()
    meta["gpu"] = "cpu-" + (platform.machine() or "unknown")  # ops="torch": no GPU involved
    meta["command"] = " ".join(["python -m workbench bench compression_model",
                                *(argv if argv is not None else sys.argv[1:])])
    extra = {"mode": "smoke" if smoke else "full", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, fp32 on the CPU)",
             "ops": "torch", "threads": torch.get_num_threads(), "kv_dtype": args.kv_dtype,
             "page_tokens": study.PAGE_TOKENS, "new_tokens": new_tokens, "scored_tokens": new_tokens - 1,
             "obs_window": args.obs_window, "every": args.every, "overrides": study.OVERRIDES,
             "teacher_forcing": "every sequence is fed the full cache's greedy token; scored from the 2nd token",
             "load_seconds": load_s, "total_seconds": total_s, "summary": summary}
    path = run_files.write_results("compression-model", rows, meta, out, extra=extra)
    print(f"{len(rows)} rows in {total_s:.0f} s; wrote {path}")
    return 0


