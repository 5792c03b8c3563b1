"""The quantization panel of notebook 03: pick a scheme and its knobs, see its memory and error against every
other scheme's, per layer, and its measured decode speed.

Like ``workbench.ui.panels``, it holds no logic: ``workbench.quant.study`` computes, ``quant_figures`` draws.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import ipywidgets as W
import torch

from workbench.quant import study
from workbench.ui import quant_figures
from workbench.ui.panels import Panel

DECODE_PATTERN = "quant-decode-*.json"


def h200_decode_run(results_dir=None, where: Mapping | None = None) -> dict | None:
    """The newest committed H200 run of the quantized decode benchmark (``data/results/quant-decode-*.json``,
    smoke and ``--tune`` runs left out): ``{"path", "info", "rows"}`` (``harness.load_runs``), None when there is
    none yet. Its ``path`` is what a notebook cites for the decode numbers."""
    from workbench.bench import harness

    want = {"gpu": "NVIDIA H200", "smoke": lambda s: not s, "tune": lambda t: not t} if where is None else where
    runs = harness.load_runs(DECODE_PATTERN, results_dir, want)
    return runs[-1] if runs else None


def h200_decode_rows(results_dir=None, where: Mapping | None = None) -> list[dict]:
    """The rows of :func:`h200_decode_run` as :func:`best_decode_rows`; ``[]`` when there is no run yet."""
    run = h200_decode_run(results_dir, where)
    return best_decode_rows(run["rows"]) if run else []


def best_decode_rows(rows: list[dict]) -> list[dict]:
    """One row per (workload, scheme) of the benchmark's ``decode`` section, as the kernels ship: the
    ``heuristic`` launch (a ``--tune`` run's other variants left out, and rows of other sections or without a
    time), the fastest if a file holds several, in the order first seen."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if r.get("section", "decode") != "decode" or not {"workload", "scheme", "time_us"} <= r.keys():
            continue
        if r.get("variant", "heuristic") != "heuristic":
            continue
        key = (r["workload"], r["scheme"])
        if key not in best or r["time_us"] < best[key]["time_us"]:
            best[key] = r
    return list(best.values())


def measured_scheme(scheme, names) -> str | None:
    """The name among ``names`` (a benchmark's schemes) of the registry scheme that is ``scheme`` in every parameter
    (format, scales, symmetry, groups, fp16 residual, key mode), None when none is: a KIVI scheme with a residual
    or a group size the benchmark did not time has no row to stand for it (int2 K/tok R128 is not int2/token, R0)."""
    from workbench import quant

    def params(s) -> dict:
        return {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name not in ("name", "label")}

    want = params(scheme)
    return next((n for n in names if n in quant.SCHEMES and params(quant.get(n)) == want), None)


def quant_panel(num_layers: int = 6, num_tokens: int = 512, num_kv_heads: int = 3, head_dim: int = 64,
                group: int = 3, num_queries: int = 64, seed: int = 0,
                kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                decode_rows: list[dict] | None = None) -> Panel:
    """Scheme, scales, group size, residual window, key mode and the keys' outlier strength -> (a) bytes per token
    against attention error for every scheme, (b) the choice's errors per layer, (c) measured decode speed.

    Args:
        num_layers, num_tokens, num_kv_heads, head_dim, group, num_queries, seed: the synthetic data
            (``study.synthetic_kv`` keys, post-RoPE, and ``study.synthetic_queries``).
        kv: ``(q, k, v)`` to study instead (post-RoPE, shapes as ``study.evaluate``); the outlier slider is then
            greyed out.
        decode_rows: the measured decode rows (default: :func:`h200_decode_rows`).
    """
    decode = h200_decode_rows() if decode_rows is None else decode_rows
    studied: dict[float, tuple] = {}

    def data(outlier: float):
        if outlier not in studied:
            if kv is None:
                k, v = study.synthetic_kv(num_layers, num_tokens, num_kv_heads, head_dim, outlier_scale=outlier,
                                          seed=seed)
                k = study.apply_rope(k)
                q = study.synthetic_queries(k, num_queries, group, seed=seed + 1)
            else:
                q, k, v = kv
            rows = [r for r in study.summarize(study.evaluate_all(None, q, k, v)) if r["scheme"] != "fp32"]
            studied[outlier] = (q, k, v, rows)
        return studied[outlier]

    controls = {
        "family": W.Dropdown(options=list(study.FAMILIES), value="int4", description="scheme"),
        # ordered coarse to fine; a slider so that, greyed out, it is plainly not in play
        "granularity": W.SelectionSlider(options=["tensor", "head", "token"], value="tensor", description="scales"),
        "group": W.SelectionSlider(options=[8, 16, 32, 64, 128], value=32, description="group size"),
        "residual": W.IntSlider(value=128, min=0, max=256, step=32, description="fp16 residual"),
        "outlier": W.IntSlider(value=8, min=1, max=10, description="key outliers (x)"),
        "key_mode": W.ToggleButtons(options=[("per channel", "channel"), ("per token", "token")], value="channel",
                                    description="keys"),
    }

    def compute(family, granularity, group, residual, key_mode, outlier):
        q, k, v, rows = data(float(outlier))
        L, T, H, D = k.shape
        s = study.scheme_for(family, granularity, group, residual, key_mode, head_dim=D)
        layers = study.evaluate(s, q, k, v)
        selected = study.summarize(layers)[0]
        front = study.pareto_front([*rows, selected] if selected["title"] not in {r["title"] for r in rows}
                                   else rows)
        decode_scheme = measured_scheme(s, dict.fromkeys(r["scheme"] for r in decode))
        note = ""
        if family in study.GROUP_FAMILIES:
            vg = s.value_group
            note = (f"keys per channel in groups of {group} tokens, values per token in groups of {vg} channels"
                    if key_mode == "channel" else f"keys and values per token in groups of {vg} channels")
            if vg < group:
                note += f" (G{group} capped at head_dim {D})"
            note += f"; newest {residual} tokens kept fp16"
        stored = (f"{selected['quantized_tokens']} of {T} tokens quantized" if s.quantized
                  else f"every token cast to {s.format_name}, no scales")
        setup = {"layers": L, "tokens": T, "heads": H, "head_dim": D, "stored": stored, "note": note,
                 "data": f"synthetic K/V (key outliers x{outlier})" if kv is None else "captured K/V"}
        return {"selected": selected, "layers": layers, "schemes": rows, "front": front, "decode": decode,
                "decode_scheme": decode_scheme, "setup": setup}

    def draw(r):
        return quant_figures.quant_overview(**r)

    return Panel(controls, compute, draw, live=False, enabled={
        "granularity": lambda family, **_: family in study.SCALED_FAMILIES,
        "group": lambda family, **_: family in study.GROUP_FAMILIES,
        "residual": lambda family, **_: family in study.GROUP_FAMILIES,
        "key_mode": lambda family, **_: family in study.GROUP_FAMILIES,
        "outlier": lambda **_: kv is None,
    })
