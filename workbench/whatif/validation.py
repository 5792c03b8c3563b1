"""How far the what-if can be trusted, checked against what was measured and what was published (issue 35).

- :func:`step_vs_measured`: the step model's decode step of SmolLM2-135M against ``bench model_decode``'s CUDA-graph
  step at each measured batch (the per-layer floor is fitted at batch 1 only, so the other batches validate).
- :func:`paged_vs_reservation`: throughput at saturation of paged blocks against Orca's reservations (Max, Pow2,
  Oracle) on the ShareGPT-like trace with the vLLM paper's setting (OPT-13B's KV shape, 12 GiB of KV), next to the
  paper's ranges: a comparison of direction and order of magnitude, not a fit (the paper ran an A100 and
  OPT-13B's weights; this is the H200 profile and a llama-13B-shaped model).

- :func:`figure2_shares`: where the used KV slots go under each allocation (token states, reserved, fragmentation),
  time-averaged over the same saturated runs, beside the paper's Figure 2. The what-if reserves in blocks, so it
  has no external fragmentation: the paper's bars are compared with their external share left out.

``workbench.sim.fig2`` recomputes Figure 2 with contiguous allocators (external fragmentation included, within
3.7 points). The trace replayed through the real runner: ``workbench.whatif.replay`` (``bench whatif_replay``).
"""

from __future__ import annotations

import json
from pathlib import Path

from workbench.sim.fig2 import PAPER
from workbench.whatif import models
from workbench.whatif.profile import RESULTS, GpuProfile
from workbench.whatif.report import whatif
from workbench.whatif.serve import Knobs
from workbench.whatif.step_time import StepModel, decode_run, fit_layer_overhead, step_seconds

# vLLM paper (Kwon et al., SOSP'23), section 6.2, ShareGPT on OPT-13B: the request rate vLLM sustains over Orca's
PAPER_RATE_RATIOS = {"oracle": (1.7, 2.7), "max": (2.7, 8.0)}


def step_vs_measured(column: str = "compiled_replay_ms", results_dir: Path | str | None = None,
                     gpu: str = "h200") -> list[dict]:
    """Rows ``{batch, predicted_ms, measured_ms, error, fitted}`` for every decode batch of the newest ``bench
    model_decode`` run of ``gpu`` in ``results_dir`` (default the committed runs), the profile made from the same
    folder (``python -m workbench profile --out DIR`` writes one: the step check in the profile's own GPU run)."""
    cfg = models.PRESETS["smollm2-135m"]
    folder = Path(results_dir) if results_dir is not None else RESULTS
    run = decode_run(folder, gpu)
    if run is None:
        raise ValueError(f"no model-decode-{gpu}-*.json with decode rows under {folder}")
    prof = fit_layer_overhead(GpuProfile.from_results(folder, name=gpu), cfg, run=run, column=column)
    sm = StepModel(prof, cfg)
    rows = []
    for r in sorted((r for r in json.loads(run.read_text())["rows"] if r.get("section") == "decode"),
                    key=lambda r: r["batch"]):
        pred = step_seconds(sm.decode(r["batch"], r["batch"] * int(r["context_end"]))) * 1e3
        rows.append({"batch": r["batch"], "predicted_ms": pred, "measured_ms": r[column],
                     "error": pred / r[column] - 1, "fitted": r["batch"] == 1, "source": run.name})
    return rows


NAMES = {"paged": "vLLM", "oracle": "Orca (Oracle)", "pow2": "Orca (Pow2)", "max": "Orca (Max)"}


def _saturated(reserve: str, n: int, rate: float, kv_gib: float) -> dict:
    return whatif("llama-13b", trace="sharegpt", n=n, rate=rate, knobs=Knobs(kv_gib=kv_gib, reserve=reserve))["summary"]


def figure2_shares(n: int = 1000, rate: float = 1000.0, kv_gib: float = 12.0) -> list[dict]:
    """Rows per allocation: the what-if's shares of used slots (token states, reserved, fragmentation) and the
    paper's Figure 2 bar renormalized without its external fragmentation (vLLM's bar gives token states only)."""
    rows = []
    for reserve, name in NAMES.items():
        s = _saturated(reserve, n, rate, kv_gib)
        p = PAPER[name]
        if p["reservation"] is None:
            paper = {"token_states": p["token_states"] / 100, "reserved": None, "fragmentation": None}
        else:
            inside = p["token_states"] + p["reservation"] + p["internal"]
            paper = {"token_states": p["token_states"] / inside, "reserved": p["reservation"] / inside,
                     "fragmentation": p["internal"] / inside}
        rows.append({"allocation": reserve, "paper_name": name,
                     **{k: s[f"share_{k}"] for k in ("token_states", "reserved", "fragmentation")},
                     **{f"paper_{k}": v for k, v in paper.items()}})
    return rows


def paged_vs_reservation(n: int = 1000, rate: float = 1000.0, kv_gib: float = 12.0) -> list[dict]:
    """Rows per allocation (``paged`` and Orca's ``oracle`` / ``pow2`` / ``max``): requests/s and tokens/s at
    saturation, the most sequences held at once, preemptions, and paged's throughput over each, with the paper's
    range where it gives one."""
    out = {reserve: _saturated(reserve, n, rate, kv_gib) for reserve in NAMES}
    paged = out["paged"]["requests_per_s"]
    return [{"allocation": k, "requests_per_s": s["requests_per_s"], "tokens_per_s": s["throughput_tok_s"],
             "max_concurrency": s["max_concurrency"], "preemptions": s["preemptions"],
             "paged_over_this": paged / s["requests_per_s"], "paper_range": PAPER_RATE_RATIOS.get(k)}
            for k, s in out.items()]
