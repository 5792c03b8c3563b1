"""The vLLM paper's Figure 2 recomputed: where KV memory goes in Orca (Max / Pow2 / Oracle) and vLLM.

The paper's setup, as far as it is stated (SOSP'23, "Efficient Memory Management for Large Language Model
Serving with PagedAttention"): the caption says "average percentage of memory wastes ... during the experiment
in section 6.2" (basic sampling). Section 6.1: OPT-13B on one A100-40GB, 12 GB of KV cache = 15.7K slots
(Table 1; 800 KiB a token, the KV shape of ``llama-13b``), ShareGPT and Alpaca traces with Poisson arrivals,
Orca re-implemented by the authors with a *buddy allocator*, reserving ``max_len = 2048`` (Max), at most 2x the
output (Pow2: 32 slots for 25 tokens) or exactly the output (Oracle). vLLM uses 16-token blocks. Figure 13
gives the mean batch of the same systems: ShareGPT at 2 req/s 7.00 / 9.81 / 13.62 / 30.42, Alpaca at 30 req/s
7.00 / 43.24 / 72.75 / 132.44. The figure does not name its trace; it must be ShareGPT: on Alpaca, Orca (Max)
holds tokens in only ~3.5% of its memory (20.4% in the figure).

Our assumptions where the paper is silent (``sensitivity()`` varies each):
- the ShareGPT trace of ``workbench.sim.traces`` (lognormal lengths fitted to the stated means; output CV
  0.88 from the paper's own Max bar, prompt CV 1.3);
- a saturated server (every request queued at step 0, FCFS), the average taken over the steps where
  requests wait (memory is the limit; Figure 13 shows Orca (Max) at exactly 7.00, i.e. always full);
- a slot-granular binary buddy allocator, address-ordered, over 15728 slots;
- "external fragmentation & others" = buddy rounding + free memory that cannot take the next request +
  other free memory (the paper's Oracle bar has no internal fragmentation, so the buddy's rounding counts
  as external there);
- vLLM: blocks of 16, 1% free-block watermark at admission, preemption by recompute, at most 256 running.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from workbench.sim import engine
from workbench.sim import strategies as st
from workbench.sim import traces as tr
from workbench.sim.budget import Budget, kv_budget

# Figure 2 of the paper, percent of KV memory ("-" for Oracle's internal fragmentation is 0; the vLLM bar
# is labelled only with its token states).
PAPER: dict[str, dict[str, float | None]] = {
    "Orca (Max)": {"token_states": 20.4, "reservation": 13.3, "internal": 57.3, "external": 8.9},
    "Orca (Pow2)": {"token_states": 26.8, "reservation": 17.9, "internal": 13.6, "external": 41.6},
    "Orca (Oracle)": {"token_states": 38.2, "reservation": 25.2, "internal": 0.0, "external": 36.6},
    "vLLM": {"token_states": 96.3, "reservation": None, "internal": None, "external": None},
}
# Figure 13: mean number of batched requests, OPT-13B, ShareGPT at 2 req/s (a) and Alpaca at 30 req/s (b).
PAPER_BATCH = {"sharegpt": {"Orca (Max)": 7.00, "Orca (Pow2)": 9.81, "Orca (Oracle)": 13.62, "vLLM": 30.42},
               "alpaca": {"Orca (Max)": 7.00, "Orca (Pow2)": 43.24, "Orca (Oracle)": 72.75, "vLLM": 132.44}}
KEYS = ("token_states", "reservation", "internal", "external")


def systems(allocator: str = "buddy", block_size: int = 16, max_len: int = 2048) -> dict[str, st.Strategy]:
    """The four systems of the figure as strategy configs."""
    return {"Orca (Max)": st.Contiguous("max", allocator, max_len),
            "Orca (Pow2)": st.Contiguous("pow2", allocator, max_len),
            "Orca (Oracle)": st.Contiguous("oracle", allocator, max_len),
            "vLLM": st.Paged(block_size, max_len=max_len)}


def paper_budget() -> Budget:
    """12 GiB of KV at 800 KiB a token: 15728 slots (Table 1: "15.7K")."""
    return kv_budget("llama-13b", kv_gib=12)


def breakdown(trace: str | tr.Trace = "sharegpt", *, seed: int | None = None, n: int | None = None,
              budget: Budget | None = None, allocator: str = "buddy", block_size: int = 16,
              saturated: bool = True, step_s: float | None = None, preemption: str = "recompute",
              prompt_cv: float | None = None, output_cv: float | None = None, compare: bool | None = None) -> dict:
    """Figure 2 for the four systems: shares in percent, the paper's values and the differences.

    Args:
        trace: ``"sharegpt"``, ``"alpaca"``, a JSONL path or a ``Trace``.
        seed: regenerate a preset trace with this seed (default: the stored trace, seed 0).
        n: use only the first ``n`` requests.
        budget: KV budget (default: ``paper_budget()``).
        allocator: ``buddy``, ``buddy-lifo`` or ``first-fit`` for the Orca systems.
        block_size: vLLM's block size.
        saturated: average over steps with requests waiting (else over all steps).
        step_s: seconds per step for timed arrivals (None: all requests queued at step 0).
        preemption: ``recompute`` or ``swap`` (vLLM).
        prompt_cv, output_cv: regenerate a preset trace with another spread.
        compare: compare with the paper's bars; default only for a ShareGPT trace (the figure is ShareGPT
            only). Without it ``paper`` and ``max_abs_diff_pp``/``within_5pp`` are None, ``diff_pp`` empty.

    Returns:
        ``{"setup": {...}, "systems": {name: {token_states, reservation, internal, external, detail,
        mean_batch, paper, paper_batch, diff_pp}}, "max_abs_diff_pp": float, "within_5pp": bool}``.
    """
    trace_obj = _trace(trace, seed, n, prompt_cv, output_cv)
    budget = paper_budget() if budget is None else budget
    compare = trace_obj.name.startswith("sharegpt") if compare is None else compare
    out = {"setup": {"trace": trace_obj.name, "requests": len(trace_obj), "trace_stats": _round(trace_obj.stats()),
                     "model": budget.model, "kv_gib": round(budget.kv_gib, 3), "slots": budget.slots,
                     "allocator": allocator, "block_size": block_size, "saturated": saturated,
                     "step_s": step_s, "preemption": preemption, "compared_with_paper": compare},
           "systems": {}}
    worst = 0.0
    batches = next((v for k, v in PAPER_BATCH.items() if trace_obj.name.startswith(k)), {})
    for name, cfg in systems(allocator, block_size).items():
        res = engine.run(trace_obj, cfg, budget, preemption=preemption, step_s=step_s)
        avg = res.average(saturated=saturated)
        shares = avg.paper()
        row = {k: round(shares[k], 2) for k in KEYS}
        row["detail"] = {k: round(100 * v, 2) for k, v in avg.shares().items()}
        row["mean_batch"] = round(res.mean_batch(saturated), 2)
        row["completed"] = res.completed
        row["paper"] = PAPER[name] if compare else None
        row["paper_batch"] = batches.get(name)
        diff = {k: round(shares[k] - v, 2) for k, v in PAPER[name].items() if v is not None} if compare else {}
        row["diff_pp"] = diff
        worst = max([worst] + [abs(v) for v in diff.values()])
        out["systems"][name] = row
    out["max_abs_diff_pp"] = round(worst, 2) if compare else None
    out["within_5pp"] = worst <= 5.0 if compare else None
    return out


def _trace(trace, seed, n, prompt_cv, output_cv) -> tr.Trace:
    if isinstance(trace, tr.Trace):
        t = trace
    elif str(trace) in tr.PRESETS and (seed is not None or prompt_cv is not None or output_cv is not None):
        t = tr.generate(str(trace), seed=tr.DEFAULT_SEED if seed is None else seed,
                        prompt_cv=prompt_cv, output_cv=output_cv)
    else:
        t = tr.load(trace)
    return t.head(n) if n is not None and n < len(t) else t


def _round(d: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}


def sensitivity(n: int = 3000, progress: bool = False) -> list[dict]:
    """Figure 2 under each changed assumption (first ``n`` ShareGPT requests): one row per variant.

    ``progress``: a tqdm bar over the variants on stderr (the command line's; stdout may carry JSON).
    """
    variants: list[tuple[str, dict]] = [
        ("default", {}),
        ("buddy, most recently freed block first", {"allocator": "buddy-lifo"}),
        ("first-fit instead of buddy", {"allocator": "first-fit"}),
        ("prompt CV 0.7", {"prompt_cv": 0.7}),
        ("prompt CV 1.0", {"prompt_cv": 1.0}),
        ("output CV 0.7", {"output_cv": 0.7}),
        ("output CV 1.1", {"output_cv": 1.1}),
        ("trace seed 1", {"seed": 1}),
        ("KV 10 GiB", {"budget": kv_budget("llama-13b", kv_gib=10)}),
        ("KV 14 GiB", {"budget": kv_budget("llama-13b", kv_gib=14)}),
        ("average over all steps", {"saturated": False}),
        ("arrivals 2 req/s, 40 ms steps", {"step_s": 0.04, "saturated": False}),
        ("vLLM block 8", {"block_size": 8}),
        ("vLLM block 32", {"block_size": 32}),
        ("Alpaca trace", {"trace": "alpaca"}),
    ]
    rows = []
    bar = tqdm(variants, desc="sensitivity", unit="variant", file=sys.stderr, disable=not progress)
    for label, kw in bar:
        bar.set_postfix_str(label, refresh=False)
        kw = dict(kw)
        trace = kw.pop("trace", "sharegpt")
        d = breakdown(trace, n=n, compare=True, **kw)  # Alpaca too: its distance is the argument for ShareGPT
        row = {"variant": label, "max_abs_diff_pp": d["max_abs_diff_pp"]}
        for name, v in d["systems"].items():
            row[name] = {k: v[k] for k in KEYS} | {"mean_batch": v["mean_batch"]}
        rows.append(row)
    return rows


def format_table(d: dict) -> str:
    """A text table of ``breakdown()``: ours, the paper's, and the mean batch against Figure 13."""
    s = d["setup"]
    lines = [f"Figure 2 (vLLM paper), recomputed: {s['trace']} ({s['requests']} requests), {s['kv_gib']} GiB KV = "
             f"{s['slots']} slots of {s['model']}, Orca allocator {s['allocator']}, vLLM block {s['block_size']}",
             f"{'system':<14} {'token':>13} {'reservation':>13} {'internal':>13} {'external+':>13} {'batch':>13}",
             f"{'':<14} {'ours / paper':>13} {'ours / paper':>13} {'ours / paper':>13} {'ours / paper':>13}"
             f" {'ours / Fig13':>13}"]
    for name, v in d["systems"].items():
        cells = []
        for k in KEYS:
            p = (v["paper"] or {}).get(k)
            cells.append(f"{v[k]:5.1f} / {p:5.1f}" if p is not None else f"{v[k]:5.1f} /    - ")
        pb = v["paper_batch"]
        cells.append(f"{v['mean_batch']:5.1f} / " + (f"{pb:5.1f}" if pb is not None else "   - "))
        lines.append(f"{name:<14} " + " ".join(f"{c:>13}" for c in cells))
    if d["max_abs_diff_pp"] is None:
        lines.append(f"not compared with the paper's bars: the paper's Figure 2 is ShareGPT only (this is "
                     f"{s['trace']}); the batch column is Figure 13's where it has this trace")
    else:
        lines.append(f"largest difference: {d['max_abs_diff_pp']:.1f} percentage points "
                     f"({'within' if d['within_5pp'] else 'NOT within'} the 5-point target)")
    return "\n".join(lines)


def format_sensitivity(rows: list[dict]) -> str:
    names = list(PAPER)
    head = f"{'variant':<40} " + " ".join(f"{n:>24}" for n in names) + "  max|diff|"
    lines = ["token / reservation / internal / external+ in percent; max|diff| against the paper in points", head]
    for r in rows:
        cells = []
        for n in names:
            v = r[n]
            cells.append(f"{v['token_states']:4.1f}/{v['reservation']:4.1f}/{v['internal']:4.1f}/{v['external']:4.1f}")
        lines.append(f"{r['variant']:<40} " + " ".join(f"{c:>24}" for c in cells) + f"  {r['max_abs_diff_pp']:8.1f}")
    return "\n".join(lines)
