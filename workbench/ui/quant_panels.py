"""The quantization panel of notebook 03: pick a scheme and its knobs, see its memory and error against every
other scheme's, per layer, and its measured decode speed.

Its controls, computation and figure are the ``quant`` study's (``workbench.studies.quant``), which the ``quant``
sweep runs too; the measured decode rows are the panel's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from workbench import quant
from workbench.quant.names import REFERENCE, STUDY_GROUP_FAMILIES
from workbench.results import run_files
from workbench.studies.quant import QUANT, data_for, evaluate, synthetic
from workbench.ui.controls import controls_for
from workbench.ui.panels import Panel

DECODE_PATTERN = "quant-decode-*.json"


H200_RUNS = {"gpu": "NVIDIA H200", "smoke": lambda s: not s, "tune": lambda t: not t}


def h200_decode_run(results_dir=None, where: Mapping | None = None) -> dict | None:
    """The newest committed whole H200 run of the quantized decode benchmark (``data/results/quant-decode-*.json``;
    smoke, ``--tune`` and ``--schemes`` runs left out; ``where``: other conditions, ``run_files.matches``):
    ``{"path", "info", "rows"}`` (``run_files.load_runs``), None when there is none yet. Its ``path`` is what a
    notebook cites for the decode numbers."""
    if where is not None:
        runs = run_files.load_runs(DECODE_PATTERN, results_dir, where)
        return runs[-1] if runs else None
    return run_files.latest_with_updates(DECODE_PATTERN, results_dir, H200_RUNS)[0]


def h200_decode_updates(results_dir=None) -> list[dict]:
    """The committed H200 runs of some schemes only (``--schemes``) after :func:`h200_decode_run`, oldest first: each
    re-measures its schemes after a kernel change (``[]`` when there is none)."""
    return run_files.latest_with_updates(DECODE_PATTERN, results_dir, H200_RUNS)[1]


def h200_decode_rows(results_dir=None, where: Mapping | None = None) -> list[dict]:
    """The rows of :func:`h200_decode_run` as :func:`best_decode_rows`, each (workload, scheme) a later
    :func:`h200_decode_updates` run measured replaced by its row (the rows keep their own commit); ``[]`` when
    there is no run yet."""
    run = h200_decode_run(results_dir, where)
    if run is None:
        return []
    rows = best_decode_rows(run["rows"])
    if where is None:
        for update in h200_decode_updates(results_dir):
            newer = {(r["workload"], r["scheme"]): r for r in best_decode_rows(update["rows"])
                     if r["scheme"] != REFERENCE}  # the baseline each speed-up is over stays the full run's
            rows = [newer.pop((r["workload"], r["scheme"]), r) for r in rows] + list(newer.values())
    return rows


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

    def params(s) -> dict:
        return {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name not in ("name", "label")}

    want = params(scheme)
    return next((n for n in names if n in quant.SCHEMES and params(quant.get(n)) == want), None)


def quant_panel(num_layers: int = 6, num_tokens: int = 512, num_kv_heads: int = 3, head_dim: int = 64,
                group: int = 3, num_queries: int = 64, seed: int = 0,
                kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                decode_rows: list[dict] | None = None) -> Panel:
    """Scheme, scales, group size, residual window, key mode and the keys' outlier strength (the controls of
    ``QUANT``) -> (a) bytes per token against attention error for every scheme, (b) the choice's errors per layer,
    (c) measured decode speed.

    Args:
        num_layers, num_tokens, num_kv_heads, head_dim, group, num_queries, seed: the synthetic data
            (``workbench.studies.quant.synthetic``: ``study.synthetic_kv`` keys, post-RoPE, and
            ``study.synthetic_queries``).
        kv: ``(q, k, v)`` to study instead (post-RoPE, shapes as ``study.evaluate``); the outlier slider is then
            greyed out.
        decode_rows: the measured decode rows (default: :func:`h200_decode_rows`).
    """
    decode = h200_decode_rows() if decode_rows is None else decode_rows
    captured = None if kv is None else data_for(*kv)
    gqa = group  # the synthetic queries' GQA group; the control "group" is KIVI's group size

    def compute(family, granularity, group, residual, outlier, key_mode):
        data = captured or synthetic(num_layers, num_tokens, num_kv_heads, head_dim, gqa, num_queries, float(outlier),
                                     seed)
        e = evaluate(data, family, granularity, group, residual, key_mode)
        L, T, H, D = data.k.shape
        s, selected = e.scheme, e.selected
        note = ""
        if family in STUDY_GROUP_FAMILIES:
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
        return {"selected": selected, "layers": e.layers, "schemes": data.schemes, "front": e.front,
                "decode": decode, "decode_scheme": measured_scheme(s, dict.fromkeys(r["scheme"] for r in decode)),
                "setup": setup}

    enabled = {**QUANT.enabled, "outlier": lambda **_: kv is None}
    return Panel(controls_for(QUANT), compute, QUANT.draw, live=False, enabled=enabled)
