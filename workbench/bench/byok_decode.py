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

Each implementation on each problem is a unit (:func:`units`), written to a journal before it runs and with its rows
after (``OUT/byok-decode.journal.jsonl``; ``--resume`` reuses the finished units and reports the one a dead process
was in). On a GPU each unit runs in a worker process (``--isolate``, the default there), replaced after a crash or a
lost CUDA context: a peer that faults is an ``error`` row naming it, and the run goes on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

import workbench
from workbench.bench import harness
from workbench.bench.command import SMOKE_HELP, BenchParser
from workbench.bench.decode_timing import (
    decode_row,
    free_memory,
    heuristic_config,
    ours_fn,
    peer_fns,
    print_row,
    ref_fp32,
    time_eager_and_graph,
)
from workbench.conformance.implementations import ABSENT, Impl, available, get
from workbench.conformance.isolation import Worker, context_lost, impl_ref, resolve, sticky
from workbench.conformance.journal import Journal, digest
from workbench.conformance.loading import load_module
from workbench.conformance.problems import csr_export
from workbench.core.argtypes import positive_float, writable_dir
from workbench.core.layout import Layout
from workbench.core.workloads import WORKLOADS, PagedKV, build_paged, bytes_moved, contiguous_kv
from workbench.results import provenance, run_files

TOL = 2e-2  # rel_err a row must reach against the float32 reference before it is timed


def op_inputs(p: PagedKV, out: torch.Tensor) -> dict:
    """The decode op's inputs (``workbench.conformance.ops.OPS``) for a benchmark cache (fp16, default scale)."""
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
        t, tg, gerr = time_eager_and_graph(fn, rep_ms, graph=True)
        return _row(w, p, name, origin, "ok", nbytes, copy_gbps, t, tg, err, {**(extra or {}),
                                                                          **({"error": gerr} if gerr else {})})
    except Exception as e:  # noqa: BLE001  (a failing implementation is a row, not a crash)
        return _row(w, p, name, origin, "error", nbytes, copy_gbps,
                    extra={**(extra or {}), "error": f"{type(e).__name__}: {str(e)[:200]}"})


def units(impls: list[Impl], smoke: bool) -> list[dict]:
    """What the run measures, one unit per implementation and problem (its own process when isolated): per workload
    ``ours``, each implementation that claims the problem and ``torch`` (the torch peers); then (timed runs) W1 by
    layout x page size for ours and each implementation that claims it."""
    out = []

    def add(w, layout, bs, names, sweep=""):
        for name in names:
            out.append({"key": f"{w.key}/{layout}/bs{bs}/{name}" + ("/sweep" if sweep else ""), "workload": w.key,
                        "layout": layout, "block_size": bs, "impl": name, "sweep": sweep})

    def claiming(w, layout, bs):
        w = w.smoke() if smoke else w
        g = w.num_q_heads // w.num_kv_heads
        return [i.name for i in impls if i.supports(layout, "fp16", bs, w.head_dim, g)]

    for w in WORKLOADS.values():
        add(w, "nhd", 16, ["ours", *claiming(w, "nhd", 16), "torch"])
    if not smoke:
        for layout in ("nhd", "hnd", "vllm"):
            for bs in (8, 16, 32, 64, 128):
                add(WORKLOADS["W1"], layout, bs, ["ours", *claiming(WORKLOADS["W1"], layout, bs)], "layout")
    return out


def measure_unit(unit: dict, ref: tuple | None, smoke: bool, copy_gbps: float) -> list[dict]:
    """The rows of one unit (:func:`units`), measured where it is called: this process or an isolated worker (a
    registered implementation comes as its ``impl_ref``)."""
    w = WORKLOADS[unit["workload"]]
    w = w.smoke() if smoke else w
    timed, rep_ms = not smoke, (50 if unit["sweep"] else 100)
    p = build_paged(w, layout=unit["layout"], block_size=unit["block_size"], kv_dtype=torch.float16,
                    device=workbench.device())
    k, v = contiguous_kv(p)
    ref_out = ref_fp32(p.q, k, v, p.lens)
    nbytes = bytes_moved(w, 2, 2)
    out = torch.empty_like(p.q)
    extra = {"sweep": unit["sweep"]} if unit["sweep"] else None
    name = unit["impl"]
    if name == "ours":
        cfg = heuristic_config(p, torch.float16) if timed else {}
        rows = [_measure(w, p, "ours", "ours", ours_fn(p, cfg, out), out, ref_out, nbytes, copy_gbps, rep_ms, timed,
                         extra)]
    elif name == "torch":
        rows = []
        for peer, fn in peer_fns(p, k, v).items():
            if peer == "flex_paged" and not timed:
                continue  # torch.compile of flex needs a GPU
            if isinstance(fn, Exception):
                rows.append(_row(w, p, peer, "peer", "error", nbytes, copy_gbps,
                                 extra={"error": f"{type(fn).__name__}: {str(fn)[:200]}"}))
                continue
            rows.append(_measure(w, p, peer, "peer", lambda fn=fn: fn().squeeze(2), out, ref_out, nbytes, copy_gbps,
                                 rep_ms, timed))
            free_memory() if timed else None
    else:
        impl = resolve(ref) if ref is not None else get(name, "decode")
        rows = [_measure(w, p, impl.name, impl.origin, bind(impl, op_inputs(p, out)), out, ref_out, nbytes,
                         copy_gbps, rep_ms, timed, extra)]
    del p, k, v, ref_out, out
    if timed:
        free_memory()
    return rows


def _failed_row(unit: dict, origin: str, smoke: bool, copy_gbps: float, error: str) -> dict:
    """The row of a unit that never returned one (its worker died, or the journal says its process did)."""
    w = WORKLOADS[unit["workload"]]
    w = w.smoke() if smoke else w
    stub = SimpleNamespace(layout=Layout.parse(unit["layout"]), block_size=unit["block_size"])
    extra = {"error": error, **({"sweep": unit["sweep"]} if unit["sweep"] else {})}
    return _row(w, stub, unit["impl"], origin, "error", bytes_moved(w, 2, 2), copy_gbps, extra=extra)


def _lost(rows: list[dict]) -> str:
    """The error that says this process's CUDA context is gone, if any ("" otherwise)."""
    return context_lost() or next((r["error"] for r in rows if sticky(r.get("error", ""))), "")


def run(names: list[str], smoke: bool, *, isolate: bool = False, journal: Path | str | None = None,
        resume: bool = False, timeout_s: float = 600.0) -> tuple[list[dict], dict]:
    """Every unit (:func:`units`) of ours, ``names`` and the installed peers; rows and the run's metadata.

    ``isolate``: each unit in a spawned worker, replaced after a crash or a lost CUDA context (that unit's row says
    so, the run goes on). Without it, a unit that loses the CUDA context ends the run (``extra["stopped"]``).
    ``journal``: each unit written down before it runs and its rows after; ``resume`` reuses finished units and
    reports the one the process died in."""
    impls = implementations(names)
    origin = {i.name: i.origin for i in impls} | {"ours": "ours", "torch": "peer"}
    refs = {i.name: impl_ref(i) for i in impls} if isolate else {}
    unportable = [n for n, r in refs.items() if r is None]
    if unportable:
        raise ValueError(f"--isolate: {unportable} cannot be rebuilt in a fresh process (define them in a .py file "
                         f"and pass --load FILE.py)")
    todo = units(impls, smoke)
    copy_gbps = 0.0 if smoke else harness.copy_bandwidth_gbps()
    if not smoke:
        print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    header = {"run": "bench decode --impl", "impls": [i.name for i in impls], "smoke": smoke,
              "digest": digest(u["key"] for u in todo)}
    log = Journal(journal, header, resume=resume) if journal is not None else None
    worker = Worker(timeout_s) if isolate else None
    rows: list[dict] = []
    stopped = ""
    try:
        for n, unit in enumerate(tqdm(todo, desc="byok decode", unit="unit", file=sys.stderr)):
            key = unit["key"]
            if log is not None and key in log.done:
                rows += log.done[key]["rows"]
                continue
            if log is not None and key in log.crashed:
                got = [_failed_row(unit, origin[unit["impl"]], smoke, copy_gbps,
                                   f"crashed the process while it ran (started in the journal {log.path}, never "
                                   "finished)")]
            else:
                log.start(key) if log is not None else None
                got = _run_unit(unit, worker, refs.get(unit["impl"]), smoke, copy_gbps, origin)
                if worker is None and (lost := _lost(got)):
                    stopped = (f"{key} left the CUDA context unusable ({lost}); {len(todo) - n - 1} units not run: "
                               "rerun with --isolate, or with --resume to continue after it")
            log.finish(key, {"rows": got}) if log is not None else None
            for r in got:
                print_row(r)
            rows += got
            if stopped:
                print(f"stopped: {stopped}", file=sys.stderr)
                break
    finally:
        if worker is not None:
            worker.close()
        if log is not None:
            log.close()
    for w in WORKLOADS.values():  # the peers that are not importable: a row each, no unit
        w = w.smoke() if smoke else w
        stub = SimpleNamespace(layout=Layout.parse("nhd"), block_size=16)
        rows += [_row(w, stub, name, "peer", "absent", bytes_moved(w, 2, 2), copy_gbps, extra={"error": why})
                 for name, why in sorted(ABSENT.items())]
    extra = {"mode": "smoke" if smoke else "full", "impls": [i.name for i in impls], "absent": dict(ABSENT),
             "isolated": isolate, **({"copy_gbps": copy_gbps} if not smoke else {}),
             **({"stopped": stopped} if stopped else {}),
             **({"workers_replaced": worker.replaced} if worker is not None else {})}
    return rows, extra


def implementations(names: list[str]) -> list[Impl]:
    """The named implementations (``ours`` is always timed first; a name twice counts once), then every peer."""
    impls = [get(n, "decode") for n in dict.fromkeys(names) if n != "ours"]
    peers = [i for i in available("decode", origin="peer") if i.name not in {x.name for x in impls}]
    return impls + peers


def _run_unit(unit, worker, ref, smoke, copy_gbps, origin) -> list[dict]:
    if worker is None:
        try:
            return measure_unit(unit, None, smoke, copy_gbps)
        except Exception as e:  # noqa: BLE001  (building the problem failed: this unit's row, not a crash)
            return [_failed_row(unit, origin[unit["impl"]], smoke, copy_gbps, f"{type(e).__name__}: {str(e)[:200]}")]
    status, value = worker.call(measure_unit, unit, ref, smoke, copy_gbps)
    if status == "ok":
        if not worker.lost and any(sticky(r.get("error", "")) for r in value):
            worker.lost = "sticky"
            worker.retire()  # the kernel's own error said the context is gone: the next unit gets a fresh worker
        return value
    return [_failed_row(unit, origin[unit["impl"]], smoke, copy_gbps, value)]


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
    ap = BenchParser("decode", __doc__, smoke=SMOKE_HELP, gpu=True)
    ap.add_argument("--impl", action="append", default=[], metavar="NAME",
                    help="a registered decode implementation to time beside ours and the installed peers (repeatable)")
    ap.add_argument("--load", action="append", default=[], metavar="MODULE",
                    help="import a .py file or module first (its conformance.register calls run)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="measure each implementation and workload in a worker process replaced after a crash or a "
                         "lost CUDA context (default: on with a GPU)")
    ap.add_argument("--timeout", type=positive_float, default=600.0, metavar="SECONDS",
                    help="with --isolate: a unit running longer is an error row and its worker is replaced")
    ap.add_argument("--journal", type=Path, default=None, metavar="PATH",
                    help="each unit written before it runs and its rows after (default OUT/byok-decode.journal.jsonl)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the journaled run: reuse finished units, report the one it died in, run the rest")
    args = ap.parse_args(argv)
    out = ap.start(args)
    if out is None:
        return 2
    journal = args.journal or out / "byok-decode.journal.jsonl"
    if journal.is_dir():
        ap.error(f"argument --journal: {journal} is a folder; name a file")
    writable_dir(ap, journal.parent, "--journal")
    meta = provenance.machine_meta()
    isolate = torch.cuda.is_available() if args.isolate is None else args.isolate
    try:
        for m in args.load:
            load_module(m)
        rows, extra = run(args.impl or ["ours"], args.smoke, isolate=isolate, journal=journal, resume=args.resume,
                          timeout_s=args.timeout)
    except ValueError as e:
        ap.error(str(e))
    summary(rows)
    path = run_files.write_results("byok-decode", rows, meta, out, extra=extra)
    print(f"wrote {path} (journal {journal})")
    failed = [r for r in rows if r["status"] in ("check_failed", "error") and r["origin"] == "ours"]
    return 1 if failed or extra.get("stopped") else 0
