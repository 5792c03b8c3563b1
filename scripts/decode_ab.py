"""The decode kernels of an older commit against the working tree's, in one process (restructuring check).

    git archive REV kernels | tar -x -C .ab && mv .ab/kernels .ab/old_kernels   # once, here
    python scripts/decode_ab.py --old .ab [--out DIR]                           # on the GPU

For W1-W5 in NHD and vLLM layouts (16-token pages, fp16) and W1 in fp8: the old ``paged_decode``
(``validate=False``, lengths given: the benchmark's path), the new ``paged_decode`` one-shot and the new
``DecodePlan.run`` (planned once), timed eager and with CUDA graphs by do_bench medians, interleaved in
rounds; outputs must be bit-identical. Prints new/old time ratios; writes ``decode_ab-<gpu>-<date>.json``
(default ``results/``).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path

import torch
from workbench.kernels import DecodePlan, paged_decode

from workbench.bench import harness
from workbench.core.argtypes import ensure_writable_dir
from workbench.core.workloads import WORKLOADS, build_paged
from workbench.results import provenance, run_files


def measure_case(old, key: str, layout: str, kv_dtype: torch.dtype, rounds: int) -> dict:
    """One workload: the three paths timed in interleaved rounds, medians and new/old ratios."""
    w = WORKLOADS[key]
    p = build_paged(w, layout=layout, block_size=16, kv_dtype=kv_dtype, q_dtype=torch.float16)
    mean = sum(p.lens) / len(p.lens)
    scale = {"k_scale": 1.0, "v_scale": 1.0} if kv_dtype != torch.float16 else {}
    outs = {name: torch.empty_like(p.q) for name in ("old", "new", "plan")}
    args_ = (p.q, p.k_cache, p.v_cache, p.layout, p.block_table, p.seq_lens)
    kw = dict(max_seq_len=p.max_seq_len, mean_seq_len=mean, validate=False, **scale)
    plan = DecodePlan(p.block_table, p.seq_lens, layout=p.layout, k_cache=p.k_cache, v_cache=p.v_cache,
                      num_q_heads=p.q.shape[1], q_dtype=p.q.dtype, max_seq_len=p.max_seq_len, mean_seq_len=mean,
                      validate=False, **scale)
    fns = {"old": lambda: old.paged_decode(*args_, out=outs["old"], **kw),
           "new": lambda: paged_decode(*args_, out=outs["new"], **kw),
           "plan": lambda: plan.run(p.q, p.k_cache, p.v_cache, out=outs["plan"])}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    same = torch.equal(outs["old"], outs["new"]) and torch.equal(outs["old"], outs["plan"])
    t = {name: {"eager": [], "graph": []} for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t[name]["eager"].append(harness.time_us(fn))
            t[name]["graph"].append(harness.time_us_graph(fn))
    med = {name: {m: statistics.median(v) for m, v in d.items()} for name, d in t.items()}
    row = {"workload": key, "layout": layout, "kv_dtype": str(kv_dtype).replace("torch.", ""),
           "bit_identical": same, **{f"time_us_{n}_{m}": med[n][m] for n in fns for m in ("eager", "graph")}}
    for n in ("new", "plan"):
        for m in ("eager", "graph"):
            row[f"ratio_{n}_{m}"] = med[n][m] / med["old"][m]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="folder holding the old kernels as a package named old_kernels")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out_dir = ensure_writable_dir(args.out or run_files.DEFAULT_OUT)
    sys.path.insert(0, str(Path(args.old).resolve()))
    old = importlib.import_module("old_kernels")
    cases = [(k, "nhd", torch.float16) for k in WORKLOADS] + [(k, "vllm", torch.float16) for k in WORKLOADS]
    cases.append(("W1", "nhd", torch.float8_e4m3fn))
    rows = []
    for key, layout, kv_dtype in cases:
        row = measure_case(old, key, layout, kv_dtype, args.rounds)
        rows.append(row)
        print(f"{key} {layout:4} {row['kv_dtype']:14} identical={row['bit_identical']}  new/old eager "
              f"{row['ratio_new_eager']:.3f} graph {row['ratio_new_graph']:.3f}   plan.run/old eager "
              f"{row['ratio_plan_eager']:.3f} graph {row['ratio_plan_graph']:.3f}", flush=True)
    print(run_files.write_results("decode_ab", rows, provenance.machine_meta(), out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
