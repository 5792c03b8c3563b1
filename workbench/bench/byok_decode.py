"""Any registered decode implementation beside ours and the installed peers, on W1-W5 and a layout x page sweep.

``python -m workbench bench decode --impl mine [--impl starter] [--load mykernels.py] [--smoke] [--out DIR]``

Per workload (fp16, 16-token pages, NHD, fragmented pool; ``docs/workloads.md``) one row per implementation:

- ``ours`` (the heuristic's launch, timed as ``DecodePlan.run``, the plan built outside the timed call);
- every ``--impl`` (a registered name; ``--load`` imports a file or module that registers it), called with the
  inputs its signature names, bound once outside the timed call;
- every registered peer (FlashInfer, vLLM's Triton attention: those importable here) and the torch peers of
  ``bench decode`` (SDPA on a contiguous copy, gather-then-SDPA, FlexAttention paged);
- the peers that are not importable, as rows with ``status: "absent"`` and the import error.

Each is first checked on the workload against the float32 reference (``rel_err`` at most 2e-2): one that fails is a
``check_failed`` row, not timed. Timed rows carry ``time_us`` (lower of two medians), ``time_us_graph`` (CUDA-graph
replay), ``gbps`` and ``frac_copy_bw`` against the copy bandwidth measured in the same run. Then W1 at pages
8/16/32/64/128 in every layout each implementation claims (``sweep: "layout"``). Rows go to
``byok-decode-<gpu>-<date>.json``. ``--smoke``: tiny workloads through the interpreter, correctness only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import workbench
from workbench.bench import harness
from workbench.bench.decode import _config, _free, _time, ours_fn, peer_fns, print_row, ref_fp32
from workbench.bench.decode import _row as decode_row
from workbench.bench.workloads import WORKLOADS, PagedKV, build_paged, bytes_moved, contiguous_kv
from workbench.conformance.problems import csr_export
from workbench.conformance.registry import ABSENT, Impl, available, get

TOL = 2e-2  # rel_err a row must reach against the float32 reference before it is timed


def op_inputs(p: PagedKV, out: torch.Tensor) -> dict:
    """The decode op's inputs (``workbench.conformance.registry.OPS``) for a benchmark cache (fp16, default scale)."""
    lists = [p.block_table[b, :n].tolist() for b, n in enumerate(p.blocks_per_seq)]
    return {"q": p.q, "k_cache": p.k_cache, "v_cache": p.v_cache, "layout": p.layout.value,
            "block_size": p.block_size, "block_table": p.block_table, "seq_lens": p.seq_lens,
            **csr_export(lists, p.lens, p.block_size, p.q.device), "max_seq_len": p.max_seq_len,
            "sm_scale": p.q.shape[-1] ** -0.5, "k_scale": None, "v_scale": None, "quant": None, "kv_format": "fp16",
            "ref_counts": None, "out": out}


def bind(impl: Impl, inputs: dict):
    """A zero-argument call of ``impl`` on ``inputs`` (the argument selection done once, not per timed call)."""
    kw = dict(inputs) if impl.takes_all else {k: v for k, v in inputs.items() if k in impl.takes}
    fn = impl.fn
    return lambda: fn(**kw)


def _row(w, p, impl, origin, status, nbytes, copy_gbps, t=None, tg=None, err=None, extra=None) -> dict:
    """``bench decode``'s row, with who the implementation is and whether it was timed."""
    return decode_row(w, impl, "", p, "fp16", nbytes, copy_gbps, t, tg, err, None,
                      {"origin": origin, "status": status, **(extra or {})})


def _measure(w, p, name, origin, fn, out, ref, nbytes, copy_gbps, rep_ms, timed, extra=None) -> dict:
    try:
        out.fill_(float("nan"))
        got = fn()
        got = out if got is None else got
        err = harness.rel_err(got.reshape(ref.shape), ref)
        if not err <= TOL:
            return _row(w, p, name, origin, "check_failed", nbytes, copy_gbps, err=err, extra=extra)
        if not timed:
            return _row(w, p, name, origin, "ok", nbytes, copy_gbps, err=err, extra=extra)
        t, tg, gerr = _time(fn, rep_ms, graph=True)
        return _row(w, p, name, origin, "ok", nbytes, copy_gbps, t, tg, err, {**(extra or {}),
                                                                          **({"error": gerr} if gerr else {})})
    except Exception as e:  # noqa: BLE001  (a failing implementation is a row, not a crash)
        return _row(w, p, name, origin, "error", nbytes, copy_gbps,
                    extra={**(extra or {}), "error": f"{type(e).__name__}: {str(e)[:200]}"})


def run_workload(w, impls: list[Impl], copy_gbps: float, rep_ms: float, *, timed: bool, device,
                 layout: str = "nhd", block_size: int = 16, torch_peers: bool = True, sweep: str = "") -> list[dict]:
    """Ours, ``impls`` and (``torch_peers``) the torch peers on one workload; absent peers as rows."""
    p = build_paged(w, layout=layout, block_size=block_size, kv_dtype=torch.float16, device=device)
    k, v = contiguous_kv(p)
    ref = ref_fp32(p.q, k, v, p.lens)
    nbytes = bytes_moved(w, 2, 2)
    out = torch.empty_like(p.q)
    extra = {"sweep": sweep} if sweep else None
    rows = []
    cfg = _config(p, torch.float16) if timed else {}
    rows.append(_measure(w, p, "ours", "ours", ours_fn(p, cfg, out), out, ref, nbytes, copy_gbps, rep_ms, timed, extra))
    inputs = op_inputs(p, out)
    for impl in impls:
        if not impl.supports(layout, "fp16", block_size, p.q.shape[-1]):
            continue
        rows.append(_measure(w, p, impl.name, impl.origin, bind(impl, inputs), out, ref, nbytes, copy_gbps, rep_ms,
                             timed, extra))
    if torch_peers:
        for name, fn in peer_fns(p, k, v).items():
            if name == "flex_paged" and not timed:
                continue  # torch.compile of flex needs a GPU
            if isinstance(fn, Exception):
                rows.append(_row(w, p, name, "peer", "error", nbytes, copy_gbps,
                                 extra={"error": f"{type(fn).__name__}: {str(fn)[:200]}"}))
                continue
            rows.append(_measure(w, p, name, "peer", lambda fn=fn: fn().squeeze(2), out, ref, nbytes, copy_gbps,
                                 rep_ms, timed))
            _free() if timed else None
        for name, why in sorted(ABSENT.items()):
            rows.append(_row(w, p, name, "peer", "absent", nbytes, copy_gbps, extra={"error": why}))
    for r in rows:
        print_row(r)
    del p, k, v, ref, out, inputs
    if timed:
        _free()
    return rows


def implementations(names: list[str]) -> list[Impl]:
    """The named implementations (``ours`` is always timed first; a name twice counts once), then every peer."""
    impls = [get(n, "decode") for n in dict.fromkeys(names) if n != "ours"]
    peers = [i for i in available("decode", origin="peer") if i.name not in {x.name for x in impls}]
    return impls + peers


def run(names: list[str], smoke: bool) -> tuple[list[dict], dict]:
    impls = implementations(names)
    dev = workbench.device()
    rows: list[dict] = []
    if smoke:
        for w in tqdm(WORKLOADS.values(), desc="byok smoke", unit="workload", file=sys.stderr):
            rows += run_workload(w.smoke(), impls, 0.0, 0.0, timed=False, device=dev)
        return rows, {"mode": "smoke", "impls": [i.name for i in impls], "absent": dict(ABSENT)}
    copy_gbps = harness.copy_bandwidth_gbps()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    for w in WORKLOADS.values():
        rows += run_workload(w, impls, copy_gbps, 100, timed=True, device=dev)
    for layout in ("nhd", "hnd", "vllm"):
        for bs in (8, 16, 32, 64, 128):
            rows += run_workload(WORKLOADS["W1"], impls, copy_gbps, 50, timed=True, device=dev, layout=layout,
                                 block_size=bs, torch_peers=False, sweep="layout")
    return rows, {"mode": "full", "copy_gbps": copy_gbps, "impls": [i.name for i in impls],
                  "absent": dict(ABSENT)}


def summary(rows: list[dict]) -> None:
    """Per workload: each implementation's fraction of the copy bandwidth (or why it has none)."""
    main_rows = [r for r in rows if not r.get("sweep")]
    for key in dict.fromkeys(r["workload"] for r in main_rows):
        parts = []
        for r in (r for r in main_rows if r["workload"] == key):
            val = f"{r['frac_copy_bw']:.3f}" if r.get("frac_copy_bw") else r["status"]
            parts.append(f"{r['impl']} {val}")
        print(f"{key}: " + "  ".join(parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench bench decode", description=__doc__.splitlines()[0])
    ap.add_argument("--impl", action="append", default=[], metavar="NAME",
                    help="a registered decode implementation to time beside ours and the installed peers (repeatable)")
    ap.add_argument("--load", action="append", default=[], metavar="MODULE",
                    help="import a .py file or module first (its conformance.register calls run)")
    ap.add_argument("--smoke", action="store_true", help="tiny workloads, correctness only (CPU interpreter)")
    ap.add_argument("--out", type=Path, default=None,
                    help="result folder (default results/, git-ignored; data/results holds the committed ones)")
    args = ap.parse_args(argv)
    if not args.smoke and not harness.require_gpu("decode"):
        return 2
    out = harness.output_dir(ap, args.out)
    meta = harness.machine_meta()
    from workbench.conformance.cli import load_module

    try:
        for m in args.load:
            load_module(m)
        rows, extra = run(args.impl or ["ours"], args.smoke)
    except ValueError as e:
        ap.error(str(e))
    summary(rows)
    path = harness.write_results("byok-decode", rows, meta, out, extra=extra)
    print(f"wrote {path}")
    return 1 if any(r["status"] == "check_failed" and r["origin"] == "ours" for r in rows) else 0
