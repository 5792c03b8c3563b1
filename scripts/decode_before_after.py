"""Paged decode of two checkouts, timed in one GPU session: a restructuring's before/after check.

    git archive REV workbench kernels | tar -x -C .before                      # here, once
    python scripts/decode_before_after.py --before .before --after . [--out DIR]   # on the GPU, nothing installed

Each round starts one child process per checkout (``PYTHONPATH=<checkout>``, so each imports its own
``workbench`` and kernels, whatever the package layout of that commit), alternating before/after. A child
builds W1-W5 (16-token pages, fp16, NHD and vLLM layouts) with its checkout's own ``build_paged`` and times
``DecodePlan.run`` eager and under a CUDA graph (``triton.testing`` medians); it saves its outputs, and the
parent checks that both checkouts' outputs are bit-identical. Prints after/before time ratios per case
(medians over rounds) and writes ``decode-before-after-<gpu>-<date>.json`` to ``--out`` (default ``results/``).
Only the public API that every commit since the decode plan has kept is used (the workloads from either of the
two places they have lived), so an older checkout runs as is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

CASES = [(w, layout) for layout in ("nhd", "vllm") for w in ("W1", "W2", "W3", "W4", "W5")]


def time_case(key: str, layout: str) -> tuple:
    """One case with this checkout's code: its output (poisoned buffer first) and eager / CUDA-graph medians (ms)."""
    # imports here: only a child imports workbench, from the checkout on its PYTHONPATH
    import torch
    import triton.testing as tt
    from workbench.kernels import DecodePlan

    try:  # the workloads moved from workbench.bench to workbench.core (issue 32): each checkout has one of them
        from workbench.core.workloads import WORKLOADS, build_paged
    except ImportError:
        from workbench.bench.workloads import WORKLOADS, build_paged

    p = build_paged(WORKLOADS[key], layout=layout, block_size=16, kv_dtype=torch.float16, q_dtype=torch.float16)
    plan = DecodePlan(p.block_table, p.seq_lens, layout=p.layout, k_cache=p.k_cache, v_cache=p.v_cache,
                      num_q_heads=p.q.shape[1], q_dtype=p.q.dtype, max_seq_len=p.max_seq_len,
                      mean_seq_len=sum(p.lens) / len(p.lens), validate=False)
    out = torch.full_like(p.q, float("nan"))  # poisoned: a program that writes nothing shows

    def run():
        plan.run(p.q, p.k_cache, p.v_cache, out=out)

    run()
    torch.cuda.synchronize()
    times = {"eager": tt.do_bench(run, return_mode="median"), "graph": tt.do_bench_cudagraph(run, return_mode="median")}
    return out.cpu().clone(), times


def child(out_file: str) -> None:
    """In a child: time every case with this checkout's code, save outputs and times to ``out_file``."""
    # an editable install of either checkout would map workbench.kernels to its own kernels/: drop its finder,
    # so workbench's own checkout finder maps the kernels beside the workbench/ on PYTHONPATH
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    import torch
    import triton
    import workbench.kernels

    import workbench

    times, outs = {}, {}
    for key, layout in CASES:
        outs[f"{key}-{layout}"], times[f"{key}-{layout}"] = time_case(key, layout)
        torch.cuda.empty_cache()
    torch.save({"times": times, "outs": outs, "workbench": workbench.__file__, "kernels": workbench.kernels.__file__,
                "gpu": torch.cuda.get_device_name(), "torch": str(torch.__version__),  # strings: a weights-only load
                "triton": str(triton.__version__)}, out_file)


def run_child(checkout: Path, out_file: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}  # absolute: the child runs in the checkout
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(out_file)], env=env,
                   cwd=str(checkout), check=True)
    import torch
    got = torch.load(out_file)
    for name in ("workbench", "kernels"):
        if not Path(got[name]).resolve().is_relative_to(checkout.resolve()):
            raise SystemExit(f"the child for {checkout} imported {name} from {got[name]}")
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="the older checkout (holds workbench/ and kernels/)")
    ap.add_argument("--after", type=Path, default=Path("."), help="the newer checkout (default: here)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    if args.before is None or args.rounds < 1:
        ap.error("--before DIR is required and --rounds must be >= 1")
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("before", "after"):
                runs[side].append(run_child(getattr(args, side), Path(tmp) / f"{side}{r}.pt"))
    import torch
    first = runs["before"][0]
    rows = []
    for key, layout in CASES:
        case = f"{key}-{layout}"
        same = all(torch.equal(first["outs"][case], g["outs"][case]) for side in runs.values() for g in side)
        finite = bool(torch.isfinite(first["outs"][case]).all())
        row = {"workload": key, "layout": layout, "kv_dtype": "float16", "bit_identical": same, "finite": finite}
        for side, got in runs.items():
            for mode in ("eager", "graph"):
                row[f"time_us_{side}_{mode}"] = 1e3 * statistics.median(g["times"][case][mode] for g in got)
        for mode in ("eager", "graph"):
            row[f"ratio_after_before_{mode}"] = row[f"time_us_after_{mode}"] / row[f"time_us_before_{mode}"]
        rows.append(row)
        print(f"{key} {layout:4} identical={same} finite={finite}  after/before eager "
              f"{row['ratio_after_before_eager']:.3f}  graph {row['ratio_after_before_graph']:.3f}", flush=True)
    ratios = [r["ratio_after_before_graph"] for r in rows]
    print(f"CUDA-graph after/before: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")
    meta = {"gpu": first["gpu"], "torch": first["torch"], "triton": first["triton"], "rounds": args.rounds,
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "before": os.environ.get("BEFORE_COMMIT", str(args.before)),
            "after": os.environ.get("WORKBENCH_COMMIT", str(args.after))}
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    name = f"decode-before-after-{first['gpu'].split()[-1].lower()}-{stamp}.json"
    (args.out / name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(args.out / name)
    return 0 if all(r["bit_identical"] and r["finite"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
