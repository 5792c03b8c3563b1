"""Sweeps of tiered KV storage: notebook 05 (prefetch and tiers), prefetch strategies on one sequence's decode and
swap against recompute of a preempted request. Transfer times come from a ``LinkModel``: ``link=latest`` is the
newest committed ``bench tiers`` run (``latest_link_model()``, what the panels use), ``link=default`` the
DESIGN.md figures (``LinkModel.default()``); both are fixed files or constants, so a point stays a pure function."""

from __future__ import annotations

from workbench import spec as model_spec
from workbench.sweeps.catalog import BLOCK_SIZES
from workbench.sweeps.spec import Param, Sweep, register

LINKS = ("latest", "default")
# workbench.model.capture.PROMPTS and SAVED_LAYERS (not imported here: it imports torch)
CAPTURES = ("chat_question", "code", "prose", "numbers", "chat_instructions")
CAPTURE_LAYERS = (0, 6, 12, 18, 24, 29)
STRATEGIES = ("none", "sequential", "window", "hot_lru", "hot_lfu", "score")


def _link(link: str):
    from workbench.tiers.link import LinkModel, latest_link_model

    return latest_link_model() if link == "latest" else LinkModel.default()


def prefetch_point(pattern: str, strategy: str, device_blocks: int, host_blocks: int, window: int, depth: int,
                   compute_us: int, path: str, prompt_tokens: int, steps: int, block_size: int, token_bytes: int,
                   topk: int, drift: float, seed: int, capture: str, capture_layer: int, capture_block_size: int,
                   capture_topk: int, link: str) -> dict:
    """``tiers.replay.replay`` of one strategy on one trace, configured as ``prefetch_panel`` does (``score``
    on a trace without scores replays ``none``, as the panel shows; ``replayed`` says which ran)."""
    from workbench.tiers import access
    from workbench.tiers.prefetch import needs_scores, strategies
    from workbench.tiers.replay import replay

    if pattern == "full":
        tr = access.full_trace(prompt_tokens, steps, block_size)
    elif pattern == "sliding_window":
        tr = access.sliding_window_trace(prompt_tokens, steps, block_size, window)
    elif pattern == "topk":
        tr = access.topk_trace(prompt_tokens, steps, block_size, topk, drift=drift, seed=seed)
    else:
        tr = access.trace_from_capture(capture, capture_layer, capture_block_size, capture_topk)
    configs = strategies(depth=depth, window_tokens=window)  # the panel's own configurations
    shown = "none" if needs_scores(configs[strategy]) and tr.scores is None else strategy
    model = _link(link)
    bb = token_bytes * tr.block_size
    r = replay(tr, configs[shown], device_blocks=device_blocks, host_blocks=host_blocks or None, block_bytes=bb,
               compute_s=compute_us * 1e-6, link=model, path="dma" if path == "copy" else path,
               batched=path != "copy").row()
    row = {k: v for k, v in r.items() if k not in ("strategy", "trace", "steps")}
    row.update(replayed=shown, trace_steps=len(tr), final_blocks=tr.num_blocks[-1],
               reads_per_step=tr.total_reads / len(tr), block_bytes=bb, link_source=model.source)
    return row


MIB = 1 / 2**20
# every column's label and unit on the panels' axes (workbench.sweeps.spec.Column): times in ms, as the panels show
PREFETCH_COLUMNS = {
    "pattern": ("attention pattern",), "strategy": ("prefetch strategy",),
    "device_blocks": ("device capacity", "blocks"),
    "host_blocks": ("host (0: every block)", "blocks"), "window": ("window", "tokens"),
    "depth": ("prefetch depth", "blocks"), "compute_us": ("compute a step", "µs"), "path": ("copy path",),
    "prompt_tokens": ("prompt", "tokens"), "steps": ("decode steps",), "block_size": ("block size", "tokens"),
    "token_bytes": ("K+V of a token (one layer)", "B"), "topk": ("blocks read a step (top-k)",),
    "drift": ("query drift a step",), "seed": ("seed",), "capture": ("captured prompt",),
    "capture_layer": ("captured layer",), "capture_block_size": ("captured trace's block size", "tokens"),
    "capture_topk": ("captured trace's top-k", "blocks"), "link": ("link model",),
    "hit_rate": ("reads found on the device (share)",), "stall_s": ("stall", "ms", 1e3),
    "demand_stall_s": ("stall on demand fetches", "ms", 1e3), "prefetch_stall_s": ("stall on prefetches", "ms", 1e3),
    "total_s": ("run time", "ms", 1e3), "slowdown": ("run time / compute time",),
    "prefetch_wasted": ("prefetched blocks never read",), "prefetched": ("blocks prefetched",),
    "prefetch_used": ("prefetched blocks read",), "h2d_bytes": ("host to device", "MiB", MIB),
    "d2h_bytes": ("device to host", "MiB", MIB), "disk_read_bytes": ("read from disk", "MiB", MIB),
    "disk_write_bytes": ("written to disk", "MiB", MIB), "reads": ("block reads",),
    "hits": ("reads found on the device",), "misses": ("reads missed",), "born": ("blocks born on the device",),
    "trace_steps": ("steps replayed",), "final_blocks": ("blocks at the end",),
    "reads_per_step": ("block reads a step",), "block_bytes": ("block", "KiB", 1 / 1024),
}

register(Sweep(
    "prefetch", "prefetch strategies on one sequence's decode over device, host and disk tiers: hit rate and stall", (
        Param("pattern", "str", "topk", choices=("full", "sliding_window", "topk", "capture"),
              help="capture: SmolLM2 attention from data/activations"),
        Param("strategy", "str", "score", choices=STRATEGIES, grid=STRATEGIES),
        Param("device_blocks", "int", 48, choices=(4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160), grid=(16, 48, 128)),
        Param("host_blocks", "int", 0, choices=(0, 16, 32, 64, 96, 128), help="0: every block on the host"),
        Param("window", "int", 256, choices=(64, 128, 256, 512, 1024), help="tokens (sliding window pattern, window "
                                                                           "strategy)"),
        Param("depth", "int", 24, choices=(4, 8, 16, 24, 32, 48, 64), help="blocks (sequential, score)"),
        Param("compute_us", "int", 100, choices=(10, 20, 50, 100, 200, 500, 1000), help="compute a step (us)"),
        Param("path", "str", "dma", choices=("dma", "sm", "copy"), help="DMA batch, SM copy, a copy per block"),
        Param("prompt_tokens", "int", 2048, minimum=0, maximum=1 << 20, help="synthetic traces"),
        Param("steps", "int", 128, minimum=1, maximum=1 << 16, help="decode steps of the synthetic traces"),
        Param("block_size", "int", 16, minimum=1, maximum=1024, help="tokens a block (synthetic traces)"),
        Param("token_bytes", "int", 16384, minimum=1, maximum=1 << 24, help="one token's K and V in the layer"),
        Param("topk", "int", 16, minimum=1, maximum=4096, help="blocks read a step (topk pattern)"),
        Param("drift", "float", 0.2, minimum=0.0, maximum=1.0, help="query drift a step (topk pattern)"),
        Param("seed", "int", 0, minimum=0),
        Param("capture", "str", "code", choices=CAPTURES, help="prompt (capture pattern)"),
        Param("capture_layer", "int", 18, choices=CAPTURE_LAYERS),
        Param("capture_block_size", "int", 8, minimum=1, maximum=256),
        Param("capture_topk", "int", 4, minimum=1, maximum=256),
        Param("link", "str", "latest", choices=LINKS, help="latest committed bench tiers run, or DESIGN.md")),
    prefetch_point, notebook="05_prefetch_and_tiers", panel="prefetch_panel", x="device_blocks", color="strategy",
    y=("hit_rate", "stall_s", "slowdown", "demand_stall_s", "prefetch_stall_s", "prefetch_wasted", "h2d_bytes"),
    columns=PREFETCH_COLUMNS))


def preemption_point(model: str, copies: str, path: str, tokens: int, block_size: int, link: str) -> dict:
    """``sim.preemption_cost.block_size_curve`` at one block size, as ``preemption_panel`` configures it: swap out
    and in (one copy per block, per layer or whole, and batched) against recomputing the request's prefill."""
    from workbench.sim import preemption_cost as pc

    bpt = pc.model_bytes_per_token(model)
    k = pc.per_layer_transfers(model) if copies == "layer" else 1
    prefill = pc.PrefillModel.for_model(model)
    r = pc.block_size_curve([block_size], tokens, bpt, _link(link), prefill, path=path, transfers_per_block=k)[0]
    row = {key: v for key, v in r.items() if key != "block_size"}
    row.update(bytes_per_token=bpt, transfers_per_block=k, prefill_tokens_per_s=prefill.tokens_per_s,
               prefill_fixed_s=prefill.fixed_s)
    return row


PREEMPTION_COLUMNS = {
    "model": ("model",), "copies": ("a block's copies",), "path": ("copy path",), "tokens": ("request", "tokens"),
    "block_size": ("block size", "tokens"), "link": ("link model",),
    "swap_per_block_s": ("swap out + in, copy by copy", "ms", 1e3),
    "swap_batched_s": ("swap out + in, batched", "ms", 1e3), "recompute_s": ("recompute (prefill)", "ms", 1e3),
    "per_block_vs_recompute": ("swap copy by copy / recompute",), "blocks": ("blocks",),
    "block_bytes": ("block", "MiB", MIB), "transfer_bytes": ("one copy", "KiB", 1 / 1024),
    "bytes_per_token": ("K+V of a token, all layers", "KiB", 1 / 1024), "transfers_per_block": ("copies per block",),
    "prefill_tokens_per_s": ("prefill rate (assumed)", "tokens/s"),
    "prefill_fixed_s": ("prefill fixed cost (assumed)", "ms", 1e3),
}

register(Sweep(
    "preemption", "swap (per block, batched) against recompute of a preempted request by block size (vLLM Fig. 19a)", (
        Param("model", "str", "llama-7b", choices=tuple(sorted(model_spec.MODELS))),
        Param("copies", "str", "layer", choices=("layer", "block"), grid=("layer", "block"),
              help="a block is one copy per layer's K and V (vLLM) or one copy"),
        Param("path", "str", "dma", choices=("dma", "sm")),
        Param("tokens", "int", 1024, choices=(256, 512, 1024, 2048, 4096), help="the request's tokens"),
        Param("block_size", "int", 16, choices=BLOCK_SIZES, grid=BLOCK_SIZES),
        Param("link", "str", "latest", choices=LINKS, help="latest committed bench tiers run, or DESIGN.md")),
    preemption_point, notebook="05_prefetch_and_tiers", panel="preemption_panel", x="block_size", color="copies",
    y=("swap_per_block_s", "swap_batched_s", "recompute_s", "per_block_vs_recompute"), columns=PREEMPTION_COLUMNS))
