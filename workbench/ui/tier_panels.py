"""The panels of notebook 05: the measured host link, prefetch strategies on the tiers, swap against recompute.

Like ``workbench.ui.panels``, they hold no logic: ``workbench.bench.tier_results``, ``workbench.tiers.replay`` and
``workbench.sim.preemption_cost`` compute, ``tier_figures`` draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as W

from workbench.bench import tier_results as measured
from workbench.sim.preemption_cost import BLOCK_SIZES  # the block sizes of vLLM's Figure 19(a)
from workbench.tiers import access
from workbench.tiers.link import LinkModel, latest_link_model
from workbench.tiers.prefetch import strategies as prefetch_strategies
from workbench.tiers.replay import compare, replay
from workbench.ui import tier_figures
from workbench.ui.panels import Panel

TIMING = {"frac": "device time, CUDA graph", "frac_eager": "with the host's launches, eager"}


def bandwidth_panel(runs: Sequence[dict] | None = None, block_bytes: int = 32 << 10) -> Panel:
    """Path, direction, block size, timing and run -> the measured bandwidth map (block size x blocks per batch, as
    a fraction of the pinned bandwidth of the same run) and every path by batch size at the chosen block size.

    Args:
        runs: loaded ``bench tiers`` runs (default :func:`workbench.bench.tier_results.runs`: the committed H200 runs).
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


PATTERNS = {"full": "full attention", "sliding_window": "sliding window", "topk": "top-k sparse (Quest)",
            "capture": "SmolLM2 attention (Quest)"}
STRATEGIES = {"none": "no prefetch", "sequential": "sequential readahead", "window": "sliding window",
              "hot_lru": "hot set, LRU", "hot_lfu": "hot set, LFU", "score": "score-guided (Quest)"}
SHORT = {"none": "none", "sequential": "readahead", "window": "window", "hot_lru": "hot LRU", "hot_lfu": "hot LFU",
         "score": "score"}
COPY_PATHS = {"dma": "DMA batch", "sm": "SM copy", "copy": "copy per block"}
COPY_WORDS = {"dma": "DMA batches", "sm": "SM copy kernel", "copy": "a copy per block"}


def prefetch_panel(prompt_tokens: int = 2048, steps: int = 128, block_size: int = 16, token_bytes: int = 16384,
                   topk: int = 16, drift: float = 0.2, capture: tuple[str, int] = ("code", 18),
                   capture_block_size: int = 8, capture_topk: int = 4, link: LinkModel | None = None,
                   timeline_steps: int = 40, seed: int = 0) -> Panel:
    """Attention pattern, strategy, device and host blocks, window, depth, compute a step and copy path -> hit rate
    and stall of every prefetch strategy on one sequence's decode (``workbench.tiers.replay.compare``) and the
    chosen strategy's transfers against compute (the first ``timeline_steps`` steps).

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
    traces: dict[tuple, access.AccessTrace] = {}
    patterns = dict(PATTERNS)
    try:
        traces[("capture", None)] = access.trace_from_capture(capture[0], capture[1], capture_block_size,
                                                              capture_topk)
    except FileNotFoundError:
        del patterns["capture"]

    def trace(pattern: str, window: int) -> access.AccessTrace:
        key = (pattern, window if pattern == "sliding_window" else None)
        if key not in traces:
            if pattern == "full":
                traces[key] = access.full_trace(prompt_tokens, steps, block_size)
            elif pattern == "sliding_window":
                traces[key] = access.sliding_window_trace(prompt_tokens, steps, block_size, window)
            else:
                traces[key] = access.topk_trace(prompt_tokens, steps, block_size, topk, drift=drift, seed=seed)
        return traces[key]

    def describe(pattern: str, tr: access.AccessTrace, window: int) -> str:
        if pattern == "full":
            return "full attention"
        if pattern == "sliding_window":
            return f"sliding window of {window} tokens + 4 sinks"
        if pattern == "topk":
            return f"top-{topk} blocks by the Quest bound (synthetic keys, query drift {drift:g})"
        return f"SmolLM2-135M '{capture[0]}' layer {capture[1]}, top-{capture_topk} blocks per head"

    controls = {
        "pattern": W.Dropdown(options=[(v, k) for k, v in patterns.items()], value="topk", description="attention"),
        "strategy": W.Dropdown(options=[(v, k) for k, v in STRATEGIES.items()], value="score",
                               description="strategy"),
        "device_blocks": W.SelectionSlider(options=[4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160], value=48,
                                           description="device blocks"),
        # 0: every block fits on the host (no disk)
        "host_blocks": W.SelectionSlider(options=[(str(n), n) for n in (16, 32, 64, 96, 128)] + [("all", 0)], value=0,
                                         description="host blocks"),
        "window": W.SelectionSlider(options=[64, 128, 256, 512, 1024], value=256, description="window (tokens)"),
        "depth": W.SelectionSlider(options=[4, 8, 16, 24, 32, 48, 64], value=24, description="depth (blocks)"),
        "compute_us": W.SelectionSlider(options=[10, 20, 50, 100, 200, 500, 1000], value=100,
                                        description="compute/step (us)"),
        "path": W.ToggleButtons(options=[(v, k) for k, v in COPY_PATHS.items()], value="dma", description="copies"),
    }

    def compute(pattern, strategy, device_blocks, host_blocks, window, depth, compute_us, path):
        tr = trace(pattern, window)
        configs = prefetch_strategies(depth=depth, window_tokens=window)
        if tr.scores is None:
            del configs["score"]
        bb = token_bytes * tr.block_size
        config = dict(device_blocks=device_blocks, host_blocks=host_blocks or None, block_bytes=bb,
                      compute_s=compute_us * 1e-6, link=link, path="dma" if path == "copy" else path,
                      batched=path != "copy")
        rows = [{**row, "strategy": name, "name": SHORT[name]}
                for name, row in zip(configs, compare(tr, configs.values(), **config), strict=True)]
        shown = strategy if strategy in configs else "none"
        result = replay(tr, configs[shown], **config)
        n_show = min(timeline_steps, len(tr))
        host = "host: all blocks" if not host_blocks else f"host {host_blocks} blocks, the rest on disk"
        label = next(r["label"] for r in rows if r["strategy"] == shown)
        setup = {
            "title": describe(pattern, tr, window),
            "subtitle": f"{len(tr)} steps, {tr.num_blocks[-1]} blocks of {tr.block_size} tokens at the end, "
                        f"{tr.total_reads / len(tr):.1f} read a step; {tier_figures.size_label(bb)} a block, "
                        f"{compute_us} us compute a step<br>device {device_blocks} blocks (cold at step 0), {host}; "
                        f"{COPY_WORDS[path]}; link {link.source}",
            "timeline_title": f"{label}: the first {n_show} steps" if shown == strategy else
                              f"no prefetch shown (score-guided needs a trace with scores): the first {n_show} steps"}
        timeline = [i for i in result.timeline if i.step < n_show]
        # the bars ring the strategy chosen, or none when this trace cannot run it (not the 'none' replayed instead)
        return {"rows": rows, "chosen": strategy, "replayed": shown, "timeline": timeline, "setup": setup}

    return Panel(controls, compute, lambda r: tier_figures.prefetch_overview(
        r["rows"], r["chosen"], r["timeline"], r["setup"]), enabled={
        "depth": lambda pattern, **_: pattern in ("topk", "capture")})


def preemption_panel(link: LinkModel | None = None, block_sizes: Sequence[int] = BLOCK_SIZES,
                     tokens: int = 1024) -> Panel:
    """Model, copies per block, copy path and request length -> swap (per block, batched) against recompute by
    block size (``workbench.sim.preemption_cost.block_size_curve``), the vLLM paper's Figure 19(a).

    Args:
        link: default :func:`workbench.tiers.link.latest_link_model` (the committed H200 run).
        block_sizes: tokens per block on the x axis.
        tokens: the request length selected first.
    """
    from workbench import spec
    from workbench.sim import preemption_cost as pc

    link = latest_link_model() if link is None else link
    lengths = [256, 512, 1024, 2048, 4096]
    controls = {
        "model": W.Dropdown(options=sorted(spec.MODELS), value="llama-7b", description="model"),
        "copies": W.ToggleButtons(options=[("per layer (vLLM)", "layer"), ("whole block", "block")],
                                  value="layer", description="a block is"),
        "path": W.ToggleButtons(options=[("DMA", "dma"), ("SM copy", "sm")], value="dma", description="path"),
        "tokens": W.SelectionSlider(options=lengths, value=tokens if tokens in lengths else 1024,
                                    description="request tokens"),
    }

    def compute(model, copies, path, tokens):
        bpt = pc.model_bytes_per_token(model)
        k = pc.per_layer_transfers(model) if copies == "layer" else 1
        prefill = pc.PrefillModel.for_model(model)
        rows = pc.block_size_curve(block_sizes, tokens, bpt, link, prefill, path=path, transfers_per_block=k)
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

    return Panel(controls, compute, lambda r: tier_figures.preemption_curve(**r))
