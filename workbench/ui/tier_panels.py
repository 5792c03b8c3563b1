"""The panels of notebook 05: the measured host link, prefetch strategies on the tiers, swap against recompute, a
storage format per tier.

The prefetch, preemption and format panels are the controls, computation and figures of their studies
(``workbench.studies.tiers``), which the ``prefetch``, ``preemption`` and ``tier_formats`` sweeps run too; the
bandwidth panel reads the committed ``bench tiers`` runs (``workbench.results.tiers``). ``tier_figures`` draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as W

from workbench.core import kv_spec as model_spec
from workbench.figures import tiers as tier_figures
from workbench.quant.names import TIER_FORMATS
from workbench.results import tiers as measured
from workbench.sim.preemption_cost import BLOCK_SIZES  # the block sizes of vLLM's Figure 19(a)
from workbench.studies import tiers
from workbench.tiers.link import LinkModel, latest_link_model
from workbench.tiers.prefetch import needs_scores
from workbench.ui.controls import controls_for
from workbench.ui.panels import Panel

TIMING = {"frac": "device time, CUDA graph", "frac_eager": "with the host's launches, eager"}


def bandwidth_panel(runs: Sequence[dict] | None = None, block_bytes: int = 32 << 10) -> Panel:
    """Path, direction, block size, timing and run -> the measured bandwidth map (block size x blocks per batch, as
    a fraction of the pinned bandwidth of the same run) and every path by batch size at the chosen block size.

    Args:
        runs: loaded ``bench tiers`` runs (default :func:`workbench.results.tiers.runs`: the committed H200 runs).
        block_bytes: the block size selected first.
    """
    runs = list(measured.runs() if runs is None else runs)
    if not runs:
        raise ValueError("no bench tiers runs: run `python -m workbench bench tiers --out data/results` on a GPU")
    names = [measured.run_name(r) for r in runs]
    sizes = measured.bandwidth_map(runs[-1]).block_bytes
    controls = {
        "path": W.Dropdown(options=[(tier_figures.PATH_SHORT[p], p) for p in measured.PATHS], value="dma",
                           description="path"),
        "direction": W.Dropdown(options=[("host -> device", "h2d"), ("device -> host", "d2h")], value="h2d",
                                description="direction"),
        "block_bytes": W.SelectionSlider(options=[(tier_figures.size_label(b), b) for b in sizes],
                                         value=block_bytes if block_bytes in sizes else sizes[0],
                                         description="block size"),
        "timing": W.ToggleButtons(options=[("CUDA graph", "frac"), ("with launches", "frac_eager")],
                                  value="frac", description="timing"),
        "run": W.Dropdown(options=names, value=names[-1], description="run"),
    }

    def compute(path, direction, block_bytes, timing, run):
        doc = runs[names.index(run)]
        return {"grid": measured.bandwidth_map(doc, path, direction, timing),
                "curves": measured.batch_curves(doc, block_bytes, direction, timing), "block_bytes": block_bytes,
                "timing": TIMING[timing]}

    return Panel(controls, compute, lambda r: tier_figures.bandwidth_overview(**r))


COPY_WORDS = {"dma": "DMA batches", "sm": "SM copy kernel", "copy": "a copy per block"}


def prefetch_panel(prompt_tokens: int = 2048, steps: int = 128, block_size: int = 16, token_bytes: int = 16384,
                   topk: int = 16, drift: float = 0.2, capture: tuple[str, int] = ("code", 18),
                   capture_block_size: int = 8, capture_topk: int = 4, link: LinkModel | None = None,
                   timeline_steps: int = 40, seed: int = 0) -> Panel:
    """Attention pattern, strategy, device and host blocks, window, depth, compute a step and copy path (the
    controls of the ``prefetch`` study) -> hit rate and stall of every prefetch strategy on one sequence's decode
    (``tiers.replay_strategy`` of each) and the chosen strategy's transfers against compute (the first
    ``timeline_steps`` steps).

    Args:
        prompt_tokens, steps, block_size: the synthetic traces (full, sliding window, top-k): a prompt of
            ``prompt_tokens`` then ``steps`` decode steps, blocks of ``block_size`` tokens.
        token_bytes: one token's K and V in the layer replayed (a block is ``token_bytes * block_size`` bytes;
            LLaMA-7B fp16: 16 KiB a layer).
        topk, drift, seed: the top-k trace (``access.topk_trace``).
        capture, capture_block_size, capture_topk: the SmolLM2 trace (``access.trace_from_capture``: prompt name
            and layer); the pattern is left out when the captures are not in ``data/activations``.
        link: transfer times (default :func:`workbench.tiers.link.latest_link_model`, the committed H200 run).
        timeline_steps: steps shown on the timeline.
    """
    link = latest_link_model() if link is None else link
    fixed = dict(prompt_tokens=prompt_tokens, steps=steps, block_size=block_size, topk=topk, drift=drift, seed=seed,
                 capture=capture[0], capture_layer=capture[1], capture_block_size=capture_block_size,
                 capture_topk=capture_topk)
    patterns = list(tiers.PATTERNS)
    try:
        tiers.captured_trace(capture[0], capture[1], capture_block_size, capture_topk)
    except FileNotFoundError:
        patterns.remove("capture")

    def describe(pattern: str, window: int) -> str:
        if pattern == "full":
            return "full attention"
        if pattern == "sliding_window":
            return f"sliding window of {window} tokens + 4 sinks"
        if pattern == "topk":
            return f"top-{topk} blocks by the Quest bound (synthetic keys, query drift {drift:g})"
        return f"SmolLM2-135M '{capture[0]}' layer {capture[1]}, top-{capture_topk} blocks per head"

    def compute(pattern, strategy, device_blocks, host_blocks, window, depth, compute_us, path):
        tr = tiers.trace(pattern, window=window, **fixed)
        config = dict(depth=depth, window=window, device_blocks=device_blocks, host_blocks=host_blocks,
                      compute_us=compute_us, path=path, token_bytes=token_bytes, link=link)
        # every strategy the trace can run (score-guided needs one with scores), each as the sweep's point runs it
        results = {name: tiers.replay_strategy(tr, name, **config)[0] for name in tiers.STRATEGIES
                   if tr.scores is not None or not needs_scores(name)}
        rows = [{**r.row(), "strategy": name, "name": tiers.SHORT[name]} for name, r in results.items()]
        shown = strategy if strategy in results else "none"
        n_show = min(timeline_steps, len(tr))
        host = "host: all blocks" if not host_blocks else f"host {host_blocks} blocks, the rest on disk"
        bb = token_bytes * tr.block_size
        setup = {
            "title": describe(pattern, window),
            "subtitle": f"{len(tr)} steps, {tr.num_blocks[-1]} blocks of {tr.block_size} tokens at the end, "
                        f"{tr.total_reads / len(tr):.1f} read a step; {tier_figures.size_label(bb)} a block, "
                        f"{compute_us} us compute a step<br>device {device_blocks} blocks (cold at step 0), {host}; "
                        f"{COPY_WORDS[path]}; link {link.source}",
            "timeline_title": f"{results[shown].label}: the first {n_show} steps" if shown == strategy else
                              f"no prefetch shown (score-guided needs a trace with scores): the first {n_show} steps"}
        timeline = [i for i in results[shown].timeline if i.step < n_show]
        # the bars ring the strategy chosen, or none when this trace cannot run it (not the 'none' replayed instead)
        return {"rows": rows, "chosen": strategy, "replayed": shown, "timeline": timeline, "setup": setup}

    return Panel(controls_for(tiers.PREFETCH, options={"pattern": patterns}), compute, tiers.PREFETCH.draw,
                 enabled=tiers.PREFETCH.enabled)


def preemption_panel(link: LinkModel | None = None, block_sizes: Sequence[int] = BLOCK_SIZES,
                     tokens: int = 1024) -> Panel:
    """Model, copies per block, copy path and request length (the controls of the ``preemption`` study) -> swap (per
    block, batched) against recompute by block size (``tiers.preemption_curve``), the vLLM paper's Figure 19(a).

    Args:
        link: default :func:`workbench.tiers.link.latest_link_model` (the committed H200 run).
        block_sizes: tokens per block on the x axis.
        tokens: the request length selected first.
    """
    link = latest_link_model() if link is None else link
    lengths = tiers.PREEMPTION.param("tokens").choices

    def compute(model, copies, path, tokens):
        c = tiers.preemption_curve(model, copies, path, tokens, block_sizes, link)
        rows, bpt, k, prefill = c.rows, c.bytes_per_token, c.transfers_per_block, c.prefill
        faster = [r["faster"] for r in rows]
        if len(set(faster)) == 1:
            verdict = f"{faster[0]} is faster at every block size"
        else:
            first = next(r["block_size"] for r in rows if r["faster"] != faster[0])
            verdict = f"{faster[0]} is faster below {first} tokens a block, {faster[-1]} from {first}"
        what = (f"{k} copies of {tier_figures.size_label(bpt // k)} per token of block" if k > 1
                else "one copy per block")
        setup = {"title": f"{model}, a {tokens}-token request: {verdict}",
                 "subtitle": f"{tier_figures.size_label(bpt)} of K/V a token; swap: out + in, {what} "
                             f"({'SM copy' if path == 'sm' else 'copy engine'}), link {link.source}<br>recompute: "
                             f"prefill at {prefill.tokens_per_s:,.0f} tokens/s + {1e3 * prefill.fixed_s:.1f} ms "
                             f"(assumed, {prefill.source})"}
        return {"rows": rows, "setup": setup}

    return Panel(controls_for(tiers.PREEMPTION, {"tokens": tokens if tokens in lengths else 1024}), compute,
                 tiers.PREEMPTION.draw)


def format_panel(formats: Sequence[str] = TIER_FORMATS, **values) -> Panel:
    """Format, KV shape, block size, blocks a batch, link, flat bandwidth and transcode throughput, measured or
    assumed (the controls of the ``tier_formats`` study) -> tokens/s moved down and up in every format
    (``tiers.formats_table``), a batch's copy against its transcode, and each format's quality cost from the
    committed ``bench model_quality`` run.

    Args:
        formats: the formats shown (default ``workbench.quant.names.TIER_FORMATS``, fp16 first: the reference).
        values: the controls' first values (default the study's), e.g. ``block_size=64``.
    """
    formats = tuple(formats)

    def compute(format, model, block_size, batch, link, bandwidth_gbps, transcode, transcode_from):
        table, sources = tiers.formats_table(model, block_size, batch, link, bandwidth_gbps, transcode, formats,
                                             transcode_from)
        shape = model_spec.model(model)
        ref = next(r for r in table.rows if not r["transcodes"])
        row = table.row(format)
        if row is None:
            title = f"{format} cannot store {block_size}-token blocks: {table.skipped.get(format, 'not shown')}"
        elif not row["transcodes"]:
            title = (f"{format}, the device's own bytes: {ref['down_tokens_per_s'] / 1e6:.3g} M tokens/s down, "
                     f"{ref['up_tokens_per_s'] / 1e6:.3g} M up")
        else:
            title = (f"{format}: {row['down_speedup']:.2f}x fp16 down, {row['up_speedup']:.2f}x up, transcode "
                     f"{row['down_hidden']:.0%} hidden, mean KL {row['mean_kl']:.2g}")
        left = f"; left out: {', '.join(table.skipped)}" if table.skipped else ""
        setup = {"title": title, "subtitle": (
            f"{model} ({shape.num_layers} layers x {shape.num_kv_heads} kv heads x {shape.head_dim}), "
            f"{block_size}-token blocks, {batch} a batch ({tier_figures.size_label(ref['batch_bytes'])} in fp16)"
            f"{left}<br>{sources['link']}; {sources['transcode']}<br>quality: {sources['quality']}")}
        return {"rows": table.rows, "chosen": format, "skipped": table.skipped, "setup": setup}

    return Panel(controls_for(tiers.FORMAT_PER_TIER, values), compute, tiers.FORMAT_PER_TIER.draw,
                 enabled=tiers.FORMAT_PER_TIER.enabled)
