"""What the host-side argument checks cost on a GPU: decode and gather with ``validate`` on and off.

    python scripts/probe_validation_cost.py [--out DIR]

For each workload W1-W5 (NHD, 16-token pages, fp16): eager time of ``paged_decode`` with
``validate=True`` (one device->host sync: lengths and block ids checked) against
``validate=False`` with ``max_seq_len`` given (no sync), as do_bench medians in one run;
the same for ``paged_gather`` of W3, and that CUDA-graph capture of a validating call works
(the check is skipped while capturing). Writes ``validation-<gpu>-<date>.json`` (default
``results/``, git-ignored).
"""

from __future__ import annotations

import argparse

import torch
from workbench.kernels import paged_decode, paged_gather

from workbench.bench import harness
from workbench.core.argtypes import ensure_writable_dir
from workbench.core.workloads import WORKLOADS, build_paged
from workbench.results import provenance, run_files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default results/, git-ignored)")
    args = ap.parse_args(argv)
    out_dir = ensure_writable_dir(args.out or run_files.DEFAULT_OUT)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    rows = []
    for key, w in WORKLOADS.items():
        p = build_paged(w, layout="nhd", block_size=16, kv_dtype=torch.float16)
        out = torch.empty_like(p.q)

        def checked(p=p, out=out):
            return paged_decode(p.q, p.k_cache, p.v_cache, p.layout, p.block_table, p.seq_lens, out=out)

        def unchecked(p=p, out=out):
            return paged_decode(p.q, p.k_cache, p.v_cache, p.layout, p.block_table, p.seq_lens, out=out,
                                max_seq_len=p.max_seq_len, validate=False)

        def lengths_only(p=p, out=out):  # no id check, but the lengths are read on the host: one sync
            return paged_decode(p.q, p.k_cache, p.v_cache, p.layout, p.block_table, p.seq_lens, out=out,
                                validate=False)

        t_on, t_off, t_sync = harness.time_us(checked), harness.time_us(unchecked), harness.time_us(lengths_only)
        same = torch.equal(checked(), unchecked())
        rows.append({"op": "paged_decode", "workload": key, "time_us_validate": t_on, "time_us_no_validate": t_off,
                     "time_us_lengths_sync_only": t_sync, "overhead_us": t_on - t_off,
                     "overhead_us_beyond_sync": t_on - t_sync, "ratio": t_on / t_off, "same_output": same})
        print(f"{key} decode: validate {t_on:8.1f} us, lengths read only {t_sync:8.1f} us, no validate "
              f"{t_off:8.1f} us, ratio {t_on / t_off:.3f}")
        if key == "W3":
            def g_on(p=p):
                return paged_gather(p.k_cache, p.layout, "k", p.block_table, p.seq_lens)

            def g_off(p=p):
                return paged_gather(p.k_cache, p.layout, "k", p.block_table, p.seq_lens, validate=False)

            t_on, t_off = harness.time_us(g_on), harness.time_us(g_off)
            rows.append({"op": "paged_gather", "workload": key, "time_us_validate": t_on,
                         "time_us_no_validate": t_off, "overhead_us": t_on - t_off, "ratio": t_on / t_off})
            print(f"{key} gather: validate {t_on:8.1f} us, no validate {t_off:8.1f} us")
            # a validating call inside graph capture: the check is skipped, the kernel is captured
            g = torch.cuda.CUDAGraph()
            unchecked()
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                paged_decode(p.q, p.k_cache, p.v_cache, p.layout, p.block_table, p.seq_lens, out=out,
                             max_seq_len=p.max_seq_len)
            ref = unchecked().clone()
            out.zero_()
            g.replay()
            torch.cuda.synchronize()
            rows.append({"op": "graph_capture_validate_default", "workload": key, "same_output": torch.equal(out, ref)})
            print(f"{key} graph capture with validate=True: replay matches eager = {torch.equal(out, ref)}")
    path = run_files.write_results("validation", rows, provenance.machine_meta(), out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
