"""The committed compression results as plain tables, for notebook 07:

- the real-model eviction study (``python -m workbench bench compression_model``, ``compression-model-*.json``): one row
  per prompt and (policy, budget, partial) configuration with ``memory_kept`` (blocks held after the eviction / the
  full cache's), ``agreement``, ``mean_abs_drift`` / ``max_abs_drift`` (log-prob of the reference token), ``mean_kl``
  and ``perplexity`` (``ref_perplexity``: the full cache's); the file's ``summary`` averages them over prompts;
- the delta-coding study (``python -m workbench bench compression_delta``, ``compression-delta-*.json``): ``ratio``
  rows (lossless ratio per prompt, layer, kind ``k_pre`` / ``k`` / ``v``, dtype and stage combination, with the
  order-0 entropy bound), ``quant`` rows (quantized codes coded), ``throughput`` / ``level`` rows (codec speed on
  a CPU per chunk) and ``break_even`` rows (a compressed swap against a raw one on every measured link);
- the H200 Quest runs (``python -m workbench bench quest``, ``quest-h200-*.json``): ``timing`` rows (``impl``
  ``full`` / ``quest`` and its parts ``quest_scores``, ``quest_select``, ``quest_attend``, per batch, page size and
  token budget; ``time_us`` eager and ``time_us_graph`` replayed from a CUDA graph; ``quest`` rows carry ``speedup``
  / ``speedup_graph`` against ``full``; newer runs time ``quest`` / ``quest_select`` per select kernel and mark the
  rule's choice ``select_default``, the one read here), ``sweep`` rows (launch settings tried; not read here) and
  ``recall_real`` rows (Quest's recall on the captured SmolLM2-135M activations per ``reduce`` and page budget).

Pure functions of a loaded run (``{"path", "info", "rows"}`` from :func:`workbench.results.run_files.load_runs`): no
plotly, no widgets, no model. ``tests/test_compress_panels.py`` checks them against the files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from workbench.results import run_files

PATTERNS = {"model": "compression-model-*.json", "delta": "compression-delta-*.json", "quest": "quest-*.json"}
#: which files count, per kind: full runs (``--quick`` / ``--smoke`` ones left out); Quest on the H200 only
WHERE: dict[str, dict] = {"model": {"mode": "full"}, "delta": {"mode": "full"},
                          "quest": {"gpu": "NVIDIA H200", "mode": "full"}}
KINDS = {"k_pre": "keys before RoPE", "k": "keys after RoPE (cached)", "v": "values"}
#: the stage combinations notebook 07 compares (names of ``workbench.compress.delta_study.CONFIGS``)
STAGES = {"delta+shuffle": "delta + byte shuffle + zstd", "shuffle": "byte shuffle + zstd", "zstd": "zstd only"}
QUEST_PARTS = ("quest_scores", "quest_select", "quest_attend")
MODEL_METRICS = ("memory_kept", "kept_share", "agreement", "mean_abs_drift", "max_abs_drift", "mean_kl", "perplexity",
                 "ref_perplexity")


def _kind(kind: str) -> str:
    if kind not in PATTERNS:
        raise ValueError(f"kind must be one of {list(PATTERNS)}, got {kind!r}")
    return kind


def runs(kind: str, results_dir: Path | str | None = None, where: Mapping | None = None) -> list[dict]:
    """The committed runs of one kind (``"model"``, ``"delta"``, ``"quest"``; default folder ``data/results``,
    filtered by :data:`WHERE` unless ``where`` is given), oldest first."""
    return run_files.load_runs(PATTERNS[_kind(kind)], results_dir, WHERE[kind] if where is None else where)


def latest(kind: str, results_dir: Path | str | None = None, where: Mapping | None = None) -> dict | None:
    """The newest of :func:`runs`, or None when there is none."""
    found = runs(kind, results_dir, where)
    return found[-1] if found else None


run_name = run_files.run_name  # the run's file name: what the notebook quotes


def section(run: Mapping, name: str) -> list[dict]:
    """The run's rows of one section, in file order."""
    return [r for r in run["rows"] if r.get("section") == name]


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


# ---- the real-model eviction study -----------------------------------------------------------------------------
def model_prompts(run: Mapping) -> list[str]:
    """The prompts of a model-study run, in file order."""
    return list(dict.fromkeys(r["prompt"] for r in run["rows"]))


def _model_row(r: Mapping) -> dict:
    share = r.get("kept_share")
    if share is None:
        share = r["kept_tokens"] / r["prompt_tokens"]
    return {"policy": r["policy"], "budget": r["budget"], "partial": r["partial"], "kept_share": share,
            **{k: r[k] for k in MODEL_METRICS if k != "kept_share"}}


def model_rows(run: Mapping, prompt: str | None = None) -> list[dict]:
    """One row per (policy, budget, partial) of a model-study run, the full cache first: the file's ``summary``
    (means over its prompts) when ``prompt`` is None, else that prompt's rows. Columns: ``policy, budget, partial``
    (``"-"`` for the full cache) and :data:`MODEL_METRICS`."""
    if prompt is None:
        summary = run["info"].get("summary")
        if not summary:
            raise ValueError(f"run {run_name(run)} has no summary")
        return [_model_row(r) for r in summary]
    _choice("prompt", prompt, model_prompts(run))
    return [_model_row(r) for r in run["rows"] if r["prompt"] == prompt]


def model_curves(rows: Sequence[Mapping]) -> dict[tuple[str, str], list[dict]]:
    """:func:`model_rows` grouped into curves: ``{(policy, partial): rows by ascending memory_kept}`` (the full
    cache left out: it is every curve's end point)."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["policy"] != "full":
            out.setdefault((r["policy"], r["partial"]), []).append(dict(r))
    return {k: sorted(v, key=lambda r: (r["memory_kept"], r["budget"])) for k, v in out.items()}


# ---- the delta-coding study --------------------------------------------------------------------------------------
def delta_layers(run: Mapping) -> list[int]:
    """The model layers of the ratio rows, ascending."""
    return sorted({int(r["layer"]) for r in section(run, "ratio")})


def delta_prompts(run: Mapping) -> list[str]:
    return list(dict.fromkeys(r["prompt"] for r in section(run, "ratio")))


def _ratio_rows(run: Mapping, dtype: str, config: str) -> list[dict]:
    rows = section(run, "ratio")
    _choice("dtype", dtype, sorted({r["dtype"] for r in rows}))
    _choice("config", config, list(dict.fromkeys(r["config"] for r in rows)))
    return [r for r in rows if r["dtype"] == dtype and r["config"] == config]


def _weighted(rows: Sequence[Mapping]) -> dict:
    raw = sum(r["raw_bytes"] for r in rows)
    out = {"ratio": raw / sum(r["bytes"] for r in rows), "min": min(r["ratio"] for r in rows),
           "max": max(r["ratio"] for r in rows), "raw_bytes": raw, "n": len(rows)}
    if all(r.get("entropy_ratio") for r in rows):
        out["entropy_ratio"] = raw / sum(r["raw_bytes"] / r["entropy_ratio"] for r in rows)
    return out


def ratio_by_layer(run: Mapping, dtype: str = "fp16", config: str = "delta+shuffle") -> dict[int, dict[str, dict]]:
    """Lossless ratio per layer and kind, bytes-weighted over the prompts (all raw bytes / all stored bytes):
    ``{layer: {kind: {"ratio", "min", "max", "entropy_ratio", "raw_bytes", "n"}}}``, layers ascending, kinds in
    :data:`KINDS` order."""
    rows = _ratio_rows(run, dtype, config)
    return {layer: {kind: _weighted([r for r in rows if r["layer"] == layer and r["kind"] == kind]) for kind in KINDS}
            for layer in delta_layers(run)}


def ratio_by_prompt(run: Mapping, layer: int, dtype: str = "fp16",
                    config: str = "delta+shuffle") -> dict[str, dict[str, dict]]:
    """One layer's ratio per prompt and kind: ``{prompt: {kind: {"ratio", "entropy_ratio", "tokens"}}}``."""
    _choice("layer", layer, delta_layers(run))
    rows = [r for r in _ratio_rows(run, dtype, config) if r["layer"] == layer]
    return {p: {r["kind"]: {"ratio": r["ratio"], "entropy_ratio": r["entropy_ratio"], "tokens": r["tokens"]}
                for r in rows if r["prompt"] == p} for p in delta_prompts(run)}


def ratio_summary(run: Mapping, dtype: str = "fp16", configs: Sequence[str] = tuple(STAGES)) -> list[dict]:
    """Per stage combination and kind, the ratio over every prompt and layer (bytes-weighted), its min and max over
    the (prompt, layer) tensors and the entropy bound: ``{config, kind, dtype, ratio, min, max, entropy_ratio,
    n}`` rows, ``configs`` x :data:`KINDS` in order."""
    out = []
    for config in configs:
        rows = _ratio_rows(run, dtype, config)
        for kind in KINDS:
            out.append({"config": config, "kind": kind, "dtype": dtype,
                        **_weighted([r for r in rows if r["kind"] == kind])})
    return out


def quant_summary(run: Mapping, delta: bool = True) -> list[dict]:
    """The lossy path, per scheme and kind over every prompt and layer: ``{scheme, kind, ratio (against fp16,
    entropy-coded codes), plain_ratio (the scheme's own bytes), rel_err (mean)}``."""
    rows = [r for r in section(run, "quant") if r["delta"] == delta]
    out = []
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        for kind in KINDS:
            rs = [r for r in rows if r["scheme"] == scheme and r["kind"] == kind]
            raw = sum(r["raw_bytes"] for r in rs)
            out.append({"scheme": scheme, "kind": kind, "ratio": raw / sum(r["bytes"] for r in rs),
                        "plain_ratio": raw / sum(r["plain_bytes"] for r in rs),
                        "rel_err": sum(r["rel_err"] for r in rs) / len(rs)})
    return out


def delta_chunks(run: Mapping) -> dict[str, dict]:
    """The swap units the codec was timed on: ``{chunk: {"what", "raw_bytes"}}``, in file order."""
    out: dict[str, dict] = {}
    for r in section(run, "throughput"):
        out.setdefault(r["chunk"], {"what": r["what"], "raw_bytes": r["raw_bytes"]})
    return out


def throughput(run: Mapping, chunk: str | None = None, dtype: str | None = None, config: str | None = None,
               level: int | None = 3) -> list[dict]:
    """Codec speed rows (``throughput`` and ``level`` sections) matching the filters (None: any)."""
    rows = section(run, "throughput") + section(run, "level")
    return [r for r in rows if (chunk is None or r["chunk"] == chunk) and (dtype is None or r["dtype"] == dtype)
            and (config is None or r["config"] == config) and (level is None or r["level"] == level)]


def links(run: Mapping) -> dict[str, dict]:
    """The links the break-even used: ``{name: {"stage" (the codec stage a tier pays on it), "codec_side",
    "source"}}``."""
    return dict(run["info"].get("links") or {})


def fold_break_even(rows: Sequence[Mapping], mode: str = "one-way") -> list[dict]:
    """Break-even rows (the study's ``break_even`` section, or ``delta_study.break_even_rows``) of one ``mode``
    folded to one row per link: ``{link, link_gbps, ratio, cpu_gbps, cpu_best_gbps, codec_side, needed_serial,
    needed_overlap, speedup_serial, speedup_overlap, wins}``, links in file order; ``needed_*`` is the codec speed
    (GB/s) at which the compressed transfer ties the raw one (``inf``: no codec speed suffices)."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["mode"] != mode:
            continue
        row = out.setdefault(r["link"], {"link": r["link"], "link_gbps": r["link_gbps"], "ratio": r["ratio"],
                                         "cpu_gbps": r["cpu_gbps"], "cpu_best_gbps": r["cpu_best_gbps"],
                                         "codec_side": r["codec_side"], "wins": False})
        tag = "overlap" if r["overlap"] else "serial"
        needed = r["needed_gbps"]
        row[f"needed_{tag}"] = math.inf if needed is None else float(needed)
        row[f"speedup_{tag}"] = r["speedup"]
        row["wins"] = row["wins"] or bool(r["wins"])
    return list(out.values())


def break_even(run: Mapping, chunk: str, dtype: str = "fp16", config: str = "delta+shuffle", mode: str = "one-way",
               level: int = 3) -> list[dict]:
    """The committed break-even of one chunk, dtype, stage combination and level (:func:`fold_break_even`); empty
    when the study did not compute it (it did for ``delta+shuffle`` and ``shuffle``)."""
    _choice("chunk", chunk, list(delta_chunks(run)))
    _choice("mode", mode, ("one-way", "both"))
    rows = [r for r in section(run, "break_even") if r["chunk"] == chunk and r["dtype"] == dtype
            and r["config"] == config and r["level"] == level]
    return fold_break_even(rows, mode)


# ---- the H200 Quest runs -----------------------------------------------------------------------------------------
def quest_batches(run: Mapping) -> list[int]:
    """The batch sizes timed, descending (8, 1)."""
    return sorted({int(r["batch"]) for r in section(run, "timing")}, reverse=True)


def quest_page_sizes(run: Mapping) -> list[int]:
    """The page sizes (tokens per block) timed, ascending (older runs: 16 only)."""
    return sorted({int(r.get("page_size") or 16) for r in section(run, "timing")})


def quest_speedups(run: Mapping, batch: int, page_size: int = 16) -> list[dict]:
    """Quest against full paged decode at one batch size and page size, by ascending token budget: ``{budget_tokens,
    context, page_size, share (budget / context), speedup, speedup_graph (full's time over quest's, eager / CUDA
    graph), time_us, time_us_graph, full_us, full_us_graph, bytes_ratio (bytes full / quest), parts: {impl:
    time_us_graph}}``."""
    _choice("batch", batch, quest_batches(run))
    _choice("page_size", page_size, quest_page_sizes(run))
    rows = [r for r in section(run, "timing") if r["batch"] == batch and int(r.get("page_size") or 16) == page_size
            and r.get("select_default", True)]  # newer runs time both select kernels: the rule's choice only
    full = next(r for r in rows if r["impl"] == "full")
    out = []
    for r in sorted((r for r in rows if r["impl"] == "quest"), key=lambda r: r["budget_tokens"]):
        parts = {x["impl"]: x["time_us_graph"] for x in rows
                 if x["impl"] in QUEST_PARTS and x["budget_tokens"] == r["budget_tokens"]}
        out.append({"budget_tokens": r["budget_tokens"], "context": r["context"], "page_size": page_size,
                    "share": r["budget_tokens"] / r["context"], "speedup": r["speedup"],
                    "speedup_graph": r["speedup_graph"], "time_us": r["time_us"], "time_us_graph": r["time_us_graph"],
                    "full_us": full["time_us"], "full_us_graph": full["time_us_graph"],
                    "bytes_ratio": r["bytes_ratio"], "parts": parts})
    return out


def quest_recall_real(run: Mapping, reduce: str = "sum") -> list[dict]:
    """The run's recall on the captured SmolLM2-135M activations for one ``reduce``, by ascending page budget:
    ``{budget_pages, budget_tokens, page_size, recall (one page set for all heads), recall_per_head,
    recall_oracle, mean_context, samples}``; empty when the run has none (``--no-real``)."""
    rows = [r for r in section(run, "recall_real") if r["reduce"] == reduce]
    keys = ("budget_pages", "budget_tokens", "page_size", "recall", "recall_per_head", "recall_oracle",
            "mean_context", "samples")
    return sorted(({k: r[k] for k in keys} for r in rows), key=lambda r: r["budget_pages"])


def latest_quest_recall(quest_runs: Sequence[Mapping], reduce: str = "sum") -> list[dict]:
    """:func:`quest_recall_real` of the newest run that has recall rows (runs oldest first); empty when none."""
    for run in reversed(quest_runs):
        rows = quest_recall_real(run, reduce)
        if rows:
            return rows
    return []


def format_recall_check(here: Sequence[Mapping], committed: Sequence[Mapping]) -> str:
    """Quest's recall recomputed here (``bench.quest.real_recall_rows``, one ``reduce``) beside a committed
    run's (:func:`quest_recall_real`), one line per page budget: the shared set here | there, per head, oracle."""
    lines = [f"{here[0]['page_size']}-token pages, heads' bounds summed: recall here | in the committed run"]
    for a, b in zip(here, committed, strict=True):
        lines.append(f"  {a['budget_pages']} pages ({a['budget_tokens']} of ~{a['mean_context']:.0f} keys): shared "
                     f"{a['recall']:.3f} | {b['recall']:.3f}, per head {a['recall_per_head']:.3f}, oracle set "
                     f"{a['recall_oracle']:.3f}")
    return "\n".join(lines)


def format_quest_timings(quest_runs: Sequence[Mapping]) -> str:
    """Every run's timings, a line per batch and page size: full decode's time, then per token budget Quest's time
    and speedup, CUDA graph | eager (µs)."""
    lines = []
    for run in quest_runs:
        for batch in quest_batches(run):
            for ps in quest_page_sizes(run):
                rs = quest_speedups(run, batch, ps)
                lines.append(f"{run_name(run)[11:26]} b{batch} p{ps}: full {rs[0]['full_us_graph']:.0f} | "
                             f"{rs[0]['full_us']:.0f}; " + "; ".join(
                                 f"{r['budget_tokens']}: {r['time_us_graph']:.0f} ({r['speedup_graph']:.2f}x) | "
                                 f"{r['time_us']:.0f} ({r['speedup']:.2f}x)" for r in rs))
    return "\n".join(lines)


def format_quest_parts(run: Mapping, batch: int = 8, budget_tokens: int = 2048) -> str:
    """Quest's parts (scores, select, attend; CUDA graph, µs) at one batch and token budget, a line per page size."""
    lines = []
    for ps in quest_page_sizes(run):
        parts = next(r for r in quest_speedups(run, batch, ps) if r["budget_tokens"] == budget_tokens)["parts"]
        lines.append(f"its parts at batch {batch}, {budget_tokens} tokens, pages of {ps} (graph): "
                     + ", ".join(f"{k.removeprefix('quest_')} {v:.1f} us" for k, v in parts.items()))
    return "\n".join(lines)


def format_ratio_by_layer(run: Mapping, dtype: str = "fp16", config: str = "shuffle") -> str:
    """:func:`ratio_by_layer` on one line: ``layer: k_pre / k / v`` ratios."""
    by_layer = ratio_by_layer(run, dtype, config)
    return f"{dtype}, {STAGES.get(config, config)}, per layer (k_pre / k / v): " + "; ".join(
        f"{layer}: {d['k_pre']['ratio']:.2f} / {d['k']['ratio']:.2f} / {d['v']['ratio']:.2f}"
        for layer, d in by_layer.items())


def format_break_even(run: Mapping, dtype: str = "fp16", config: str = "delta+shuffle") -> str:
    """The one-way break-even of a compressed swap for every chunk the codec was timed on: per link the codec
    speed it needs (GB/s, serial | pipelined) against this CPU's, and the links where it wins."""
    lines = [f"break-even of a compressed swap, {dtype}, {STAGES.get(config, config)}, one-way "
             "(codec GB/s needed: serial | pipelined):"]
    for chunk, about in delta_chunks(run).items():
        be = break_even(run, chunk, dtype, config)
        lines.append(f"  {about['what']} ({be[0]['ratio']:.2f}x):\n    " + "; ".join(
            f"{r['link']} {r['link_gbps']:.3g} GB/s needs {r['needed_serial']:.3g} | {r['needed_overlap']:.3g}, "
            f"CPU {r['cpu_gbps']:.2g}" for r in be))
        lines.append(f"    wins on: {[r['link'] for r in be if r['wins']] or 'no link'}")
    return "\n".join(lines)
