"""The panels of notebook 07: sparsification policies on real K/V, Quest's page choice, the real model with an
evicted cache, delta coding of K/V.

The sparsification and Quest panels are the controls, computation and figures of their studies
(``workbench.studies.compress``), which the ``sparsification`` and ``quest`` sweeps run too;
``workbench.compress.sparsity_study`` scores the policies, ``recall_study`` measures Quest's recall,
``workbench.results.compress`` reads the committed runs, ``compress_figures`` draws. What a redraw needs again is
cached per prompt (the policies' rows by what they depend on), so a change redraws in well under a second on a shared
2-core CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as W

from workbench.bench.compression_delta import measured_links
from workbench.compress import delta_study, policies, recall_study
from workbench.compress.sparsity_study import (  # noqa: F401  (the panel's settings, importable from here too)
    HELD_OUT,
    THRESHOLD_SCALE,
    kept_tokens,
    policy_options,
    score_rows,
    threshold_of,
)
from workbench.figures import compress as cf
from workbench.model import capture
from workbench.results import compress as measured
from workbench.studies.compress import QUEST, QUEST_PAGE_SIZES, QUEST_SHARES, SPARSIFICATION, chosen, timed_speedups
from workbench.ui.controls import controls_for
from workbench.ui.panels import Panel

SHOWN_POLICIES = SPARSIFICATION.param("policy").choices  # every policy but "full", the reference point (1, 0)
CURVE_BUDGETS = (0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.7)  # the points of every policy's curve
QUEST_BUDGETS = (0.05, 0.1, 0.25, 0.5)  # Quest's: it scores every held-out query on its own pages (~4x the cost)
DEFAULT_SINKS, DEFAULT_WINDOW = 4, 16  # the other policies' settings on the chart
PARTIAL_WORDS = {"keep": "partly dropped blocks kept whole", "compact": "kept tokens compacted into fresh blocks"}


def _point(r: dict) -> str:
    name = cf.POLICY_NAMES[r["policy"]]
    what = f"p >= {r['budget']:g}" if r["policy"] == "threshold" else f"budget {r['slider_budget']:.0%}"
    held = "reads" if not r["frees"] else "holds"
    return (f"{name}, {what}: {held} {r['blocks_kept']:.3g} of {r['blocks_full']} blocks, error {r['error']:.3f}"
            f" ({r['tokens_kept']:.0f} of {r['tokens']} tokens attended)")


def sparsification_panel(captures: Sequence | None = None, prompt: str | None = None, policy: str = "h2o",
                         budget: float = 0.25, sinks: int = DEFAULT_SINKS, window: int = DEFAULT_WINDOW,
                         block_size: int = 16, partial: str = "keep", layer: int | None = None) -> Panel:
    """Policy, budget, window, sinks, block size, partial blocks, prompt and layer -> the attention-output error
    against the blocks kept for every policy (each policy's curve over budgets on the chosen prompt, block size
    and partial rule; the chosen policy at the chosen sinks and window, the others at 4 sinks + 16 recent), the
    chosen setting ringed, and the chosen layer's attention of the last prompt token with what the setting keeps.

    Errors as ``sparsity_study.score_policies(..., held_out=8)``: the policy decides 8 tokens before the end of the
    prompt, and those 8 tokens' queries, decode steps it did not see, are scored over the 6 saved layers.

    Args:
        captures: ``workbench.model.capture.load()`` (default: loaded here).
        prompt, layer: selected first (default the first capture, its middle saved layer).
        policy, budget, sinks, window, block_size, partial: the setting selected first.
    """
    if captures is None:
        captures = capture.load()
    caps = {c.name: c for c in captures}
    names = list(caps)
    prompt = names[0] if prompt is None else prompt
    saved = list(captures[0].layers)
    layer = saved[len(saved) // 2] if layer is None else layer
    cache: dict[tuple, list[dict]] = {}

    def rows_for(name, budgets, prompt, block_size, partial, sinks, window):
        key = (name, tuple(budgets), prompt, block_size, "keep" if name == "quest" else partial,
               *policy_options(name, block_size, sinks, window).values())
        if key not in cache:
            cache[key] = score_rows(caps[prompt], name, budgets, block_size, partial, sinks, window)
        return cache[key]

    values = {"policy": policy, "budget": budget, "window": window, "sinks": sinks, "block_size": block_size,
              "partial": partial, "prompt": prompt, "layer": layer}
    controls = controls_for(SPARSIFICATION, values, options={"prompt": names, "layer": saved},
                              labels={"policy": cf.POLICY_NAMES})

    def compute(policy, budget, window, sinks, block_size, partial, prompt, layer):
        cap = caps[prompt]
        curves = {}
        for name in SHOWN_POLICIES:
            s, w = (sinks, window) if name == policy else (DEFAULT_SINKS, DEFAULT_WINDOW)
            budgets = QUEST_BUDGETS if name == "quest" else CURVE_BUDGETS
            curves[name] = [{**r, "point": _point(r)} for r in
                            rows_for(name, budgets, prompt, block_size, partial, s, w) if r["layer"] == "all"]
        c = chosen(rows_for(policy, (budget,), prompt, block_size, partial, sinks, window), cap, policy, budget, window,
                   sinks, block_size, partial, layer)
        current, at_layer, keep, bk = {**c.current, "point": _point(c.current)}, c.at_layer, c.keep, c.blocks
        quest = policy == "quest"
        if quest:  # Quest frees nothing: unread pages stay in the cache
            states = [2 if m else 1 for m in bk.mask.tolist()]
            words = ("", "held, not read this step", "read (whole pages)")
        elif partial == "keep":
            states = [2 if k else 1 if m else 0 for k, m in zip(keep.tolist(), bk.mask.tolist(), strict=True)]
            words = ("dropped: its block freed", "not chosen, its block kept (still attended)", "chosen")
        else:
            states = [2 if k else 0 for k in keep.tolist()]
            words = ("dropped", "", f"kept, packed into {bk.blocks} blocks ({bk.moved} tokens copied)")
        attention = cap.attn_last[layer]  # [Hq, T]: the last prompt token's query, every layer captured
        T, full = cap.k.shape[1], -(-cap.k.shape[1] // block_size)
        pol = policies.get(policy, **policy_options(policy, block_size, sinks, window),
                           **({"threshold": threshold_of(budget)} if policy == "threshold" else {"budget": budget}))
        if quest:
            verdict = f"reads {current['blocks_kept']:.3g} of {full} blocks a step (frees none)"
        else:
            verdict = f"holds {current['blocks_kept']} of {full} blocks of {block_size}"
        setup = {
            "title": f"{pol.label}, '{prompt}': {verdict}, error {current['error']:.3f}",
            "subtitle": f"error: relative L2 of the attention output over {len(saved)} layers, for the last {HELD_OUT} "
                        "prompt tokens as decode steps the policy never saw<br>"
                        f"curves: budgets {CURVE_BUDGETS[0]:.0%}-{CURVE_BUDGETS[-1]:.0%} (threshold: p = budget / "
                        f"{THRESHOLD_SCALE}); the other policies at {DEFAULT_SINKS} sinks + {DEFAULT_WINDOW} recent; "
                        f"{T} tokens<br>"
                        + ("Quest chooses whole pages for each query (sinks, window and partial rule do not apply)"
                           if quest else PARTIAL_WORDS[partial]),
            "map_title": f"layer {layer} (error {at_layer['error']:.3f}): the last token's attention, "
                         f"{c.attention_read:.0%} of it read",
            "state_words": words, "held_attended": not quest}
        return {"curves": curves, "chosen": policy, "current": current, "attention": attention.tolist(),
                "states": states, "block_size": block_size, "setup": setup}

    panel = Panel(controls, compute, SPARSIFICATION.draw, live=False, enabled=SPARSIFICATION.enabled)
    controls["budget"].layout.width = "470px"  # its label says what it means for the threshold policy
    return panel


# ---- Quest -------------------------------------------------------------------------------------------------------


def quest_panel(captures: Sequence | None = None, runs: Sequence[dict] | None = None,
                recall: Sequence[dict] | None = None, page_size: int = 16, share: float = 0.2) -> Panel:
    """Page size, page budget, batch and run -> Quest's recall on the real activations by page size (one page set
    for all heads; for the chosen size also each head its own and the best single set) and the measured H200
    speedup of Quest against full paged decode by budget (CUDA graph and eager) at the chosen page size (the nearest
    one the run timed), the chosen budget marked.

    Args:
        captures: ``workbench.model.capture.load()`` (default: loaded here); recall:
            :func:`workbench.compress.recall_study.quest_recall_curves`
            of them, if already computed.
        runs: the committed H200 Quest runs (default ``results.compress.runs("quest")``), oldest first.
    """
    runs = list(measured.runs("quest") if runs is None else runs)
    if not runs:
        raise ValueError("no bench quest runs: run `python -m workbench bench quest --out data/results` on a GPU")
    if recall is None:
        if captures is None:
                captures = capture.load()
        recall = recall_study.quest_recall_curves(captures, QUEST_PAGE_SIZES, QUEST_SHARES)
    recall = list(recall)
    names = [measured.run_name(r) for r in runs]
    sizes = sorted({r["page_size"] for r in recall})
    shares = sorted({r["share"] for r in recall})
    batches = measured.quest_batches(runs[-1])
    controls = controls_for(QUEST, {"page_size": page_size, "share": share, "batch": batches[0]},
                              options={"page_size": sizes, "share": shares, "batch": batches})
    controls["run"] = W.Dropdown(options=names, value=names[-1], description="run")  # the panel's own: which run

    def compute(page_size, share, batch, run):
        doc = runs[names.index(run)]
        t = timed_speedups(doc, batch, page_size)
        ps, rows, best = t.page_size, t.rows, t.best
        order = [n for n in names if n != run] + [run]  # the shown run last
        speed = {n: measured.quest_speedups(runs[names.index(n)], batch, ps) for n in order
                 if ps in measured.quest_page_sizes(runs[names.index(n)])}
        cur = next(r for r in recall if r["page_size"] == page_size and r["share"] == share)
        timed_words = "" if ps == page_size else f" ({page_size} not timed)"
        setup = {
            "title": f"Quest, {page_size}-token pages at {share:.0%} of the pages: {cur['read']:.2f} of the keys read "
                     f"hold {cur['recall']:.3f} of the attention",
            "subtitle": f"left: SmolLM2-135M, {cur['samples']} prompt-layers x 16 queries over the keys before them; "
                        "one page set for all heads, their bounds summed<br>"
                        f"right: {run}: {rows[0]['context']} tokens a sequence, 32 / 8 heads x 128, fp16; the whole "
                        "path vs full decode",
            "speed_title": f"H200 batch {batch}, pages of {ps}{timed_words}: up to {best['speedup_graph']:.2f}x"}
        return {"recall": recall, "page_size": page_size, "share": share, "speedups": speed, "batch": batch,
                "setup": setup}

    return Panel(controls, compute, QUEST.draw)


# ---- the real model --------------------------------------------------------------------------------------------
DRIFTS = {"mean_abs_drift": "mean |log-prob drift|", "max_abs_drift": "max |log-prob drift|",
          "mean_kl": "KL(full || evicted), nats"}


def _committed(kind: str) -> dict:
    """The newest committed ``compression-<kind>-*.json`` run, or a ValueError saying how to make one."""
    run = measured.latest(kind)
    if run is None:
        raise ValueError(f"no compression-{kind} run: run `python -m workbench bench compression_{kind} "
                         "--out data/results`")
    return run


def model_panel(run: dict | None = None, partial: str = "both") -> Panel:
    """Prompt, partial rule and drift measure -> the committed real-model study (``compression-model-*.json``):
    next-token agreement, log-prob drift and perplexity of SmolLM2-135M with its cache evicted, against the memory
    each policy kept.

    Args:
        run: a loaded run (default ``results.compress.latest("model")``).
    """
    run = _committed("model") if run is None else run
    prompts = measured.model_prompts(run)
    info = run["info"]
    controls = {
        "prompt": W.Dropdown(options=[(f"mean of the {len(prompts)} prompts", "")] + [(p, p) for p in prompts],
                             value="", description="prompt"),
        "partial": W.ToggleButtons(options=[("both", "both"), ("keep whole", "keep"), ("compact", "compact")],
                                   value=partial, description="partial blocks"),
        "drift": W.Dropdown(options=[(v, k) for k, v in DRIFTS.items()], value="mean_abs_drift",
                            description="drift"),
    }

    def compute(prompt, partial, drift):
        rows = measured.model_rows(run, prompt or None)
        full = next(r for r in rows if r["policy"] == "full")
        curves = {k: v for k, v in measured.model_curves(rows).items() if partial in ("both", k[1])}
        what = f"'{prompt}'" if prompt else f"{len(prompts)} prompts"
        best = max((r for v in curves.values() for r in v if r["memory_kept"] <= 0.55),
                   key=lambda r: r["agreement"], default=None)
        verdict = "" if best is None else (
            f": best at <= 55% memory: {cf.POLICY_NAMES[best['policy']]} {best['budget']:.0%} {best['partial']}, "
            f"agreement {best['agreement']:.2f}")
        setup = {
            "title": f"Evicted cache, {what}{verdict}",
            "subtitle": f"{info.get('model')}, {info.get('page_tokens')}-token blocks, {info.get('scored_tokens')} "
                        "teacher-forced decode steps against the full cache<br>"
                        f"{measured.run_name(run)}; solid: compacted, dotted: partial blocks kept whole<br>"
                        f"memory: blocks held / the full cache's; threshold's budget is its p; full cache perplexity "
                        f"{full['perplexity']:.2f}",
            "drift_title": DRIFTS[drift]}
        return {"curves": curves, "full": full, "drift": drift, "setup": setup}

    return Panel(controls, compute, lambda r: cf.model_overview(**r))


# ---- delta coding ----------------------------------------------------------------------------------------------
CHUNK_WORDS = {"block16/1layer": "a block, 1 layer's keys (6 KiB)", "block16/30layers": "a block, 30 layers (360 KiB)",
               "seq/30layers": "151 tokens, 30 layers (3.3 MiB)"}
def delta_panel(run: dict | None = None, layer: int | None = None, chunk: str = "block16/30layers") -> Panel:
    """Dtype, stages, layer and swap unit -> the committed delta-coding study (``compression-delta-*.json``): the
    lossless ratio per layer for keys before RoPE, cached keys and values, the chosen layer per prompt, and the
    codec speed a compressed swap needs to beat a raw one on every measured link, against the measured codec.

    The study computed the break-even for ``delta+shuffle`` and ``shuffle``; for ``zstd`` it is computed here by
    ``workbench.compress.delta_study.break_even_rows`` from the committed codec speeds, on the newest measured links
    (``workbench.bench.compression_delta.measured_links``).

    Args:
        run: a loaded run (default ``results.compress.latest("delta")``).
    """
    run = _committed("delta") if run is None else run
    layers = measured.delta_layers(run)
    chunks = measured.delta_chunks(run)
    cache: dict[tuple, tuple[list[dict], str]] = {}

    def break_even(chunk, dtype, stages) -> tuple[list[dict], str]:
        key = (chunk, dtype, stages)
        if key not in cache:
            rows, src = measured.break_even(run, chunk, dtype, stages), "the study's rows"
            if not rows:  # not in the study: from its codec speeds, by the study's own function
                rows = measured.fold_break_even(delta_study.break_even_rows(
                    measured.throughput(run, chunk, dtype, stages), links=measured_links(), config=stages, level=3))
                src = "computed here from the committed codec speeds"
            cache[key] = rows, src
        return cache[key]

    controls = {
        "dtype": W.ToggleButtons(options=["fp16", "bf16"], value="fp16", description="dtype"),
        "stages": W.Dropdown(options=[(v, k) for k, v in measured.STAGES.items()], value="delta+shuffle",
                             description="stages"),
        "layer": W.SelectionSlider(options=layers, value=layers[len(layers) // 2] if layer is None else layer,
                                   description="layer"),
        "chunk": W.Dropdown(options=[(CHUNK_WORDS.get(k, k), k) for k in chunks], value=chunk,
                            description="swap unit"),
    }

    def compute(dtype, stages, layer, chunk):
        by_layer = measured.ratio_by_layer(run, dtype, stages)
        total = next(r for r in measured.ratio_summary(run, dtype, [stages]) if r["kind"] == "k")
        values = next(r for r in measured.ratio_summary(run, dtype, [stages]) if r["kind"] == "v")
        be, src = break_even(chunk, dtype, stages)
        wins = [r["link"] for r in be if r["wins"]]
        verdict = f"wins on {', '.join(wins)}" if wins else "no link breaks even"
        pre = next(r for r in measured.ratio_summary(run, dtype, [stages]) if r["kind"] == "k_pre")
        setup = {
            "title": f"{cf.stage_words(stages)}, {dtype}: cached keys {total['ratio']:.3f}x (before RoPE "
                     f"{pre['ratio']:.3f}x), values {values['ratio']:.3f}x",
            "subtitle": f"{measured.run_name(run)}: a [tokens, 3 kv heads, 64] tensor per prompt, layer and kind, "
                        "zstd level 3<br>right: a tier storing the swap unit compressed "
                        f"encodes on the way out, decodes on the way in ({src})",
            "ratio_title": f"ratio per layer; dots: layer {layer}, each prompt",
            "break_even_title": f"{CHUNK_WORDS.get(chunk, chunk)}: {verdict}"}
        return {"by_layer": by_layer, "layer": layer, "by_prompt": measured.ratio_by_prompt(run, layer, dtype, stages),
                "break_even": be, "setup": setup}

    return Panel(controls, compute, lambda r: cf.delta_overview(**r))
