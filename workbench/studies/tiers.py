"""The tiers studies: notebook 05 (prefetch and tiers), prefetch strategies on one sequence's decode, swap against
recompute of a preempted request, and a storage format per tier. ``PREFETCH``, ``PREEMPTION`` and
``FORMAT_PER_TIER`` are both the panels' controls (``workbench.ui.tier_panels``) and the sweeps;
:func:`replay_strategy`, :func:`preemption_curve` and :func:`formats_table` are what each computes. Transfer times
come from a ``LinkModel``: ``link=latest`` is the newest committed ``bench tiers`` run (``latest_link_model()``,
what the panels use), ``link=default`` the DESIGN.md figures (``LinkModel.default()``); the format study's
``link=host`` is the newest run too. All are fixed files or constants, so a point stays a pure function."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

from workbench.core import kv_spec as model_spec
from workbench.model import capture as saved_captures
from workbench.model.capture import PROMPTS, SAVED_LAYERS
from workbench.quant.names import TIER_FORMAT_GRID, TIER_FORMATS
from workbench.results import format_quality
from workbench.results import tiers as tier_runs
from workbench.sim import preemption_cost as pc
from workbench.studies.base import BLOCK_SIZES, Param, Study
from workbench.tiers import access, format_cost, prefetch
from workbench.tiers.link import LinkModel, latest_link_model
from workbench.tiers.replay import ReplayResult, replay

LINKS = ("latest", "default")
CAPTURES = tuple(p.name for p in PROMPTS)  # the SmolLM2 prompts whose attention data/activations holds
PATTERNS = {"full": "full attention", "sliding_window": "sliding window", "topk": "top-k sparse (Quest)",
            "capture": "SmolLM2 attention (Quest)"}
# every strategy of workbench.tiers.prefetch.PREFETCH, in its order, in words (test_tier_panels checks the names)
STRATEGIES = {"none": "no prefetch", "sequential": "sequential readahead", "window": "sliding window",
              "hot_lru": "hot set, LRU", "hot_lfu": "hot set, LFU", "score": "score-guided (Quest)"}
SHORT = {"none": "none", "sequential": "readahead", "window": "window", "hot_lru": "hot LRU", "hot_lfu": "hot LFU",
         "score": "score"}  # a strategy's name on the panel's bars
COPY_PATHS = {"dma": "DMA batch", "sm": "SM copy", "copy": "copy per block"}


def link_model(link: str) -> LinkModel:
    return latest_link_model() if link == "latest" else LinkModel.default()


# ---- prefetch ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _trace(pattern: str, prompt_tokens: int, steps: int, block_size: int, window: int, topk: int, drift: float,
           seed: int) -> access.AccessTrace:
    if pattern == "full":
        return access.full_trace(prompt_tokens, steps, block_size)
    if pattern == "sliding_window":
        return access.sliding_window_trace(prompt_tokens, steps, block_size, window)
    return access.topk_trace(prompt_tokens, steps, block_size, topk, drift=drift, seed=seed)


@functools.lru_cache(maxsize=8)
def captured_trace(capture: str, layer: int, block_size: int, topk: int) -> access.AccessTrace:
    """``access.trace_from_capture`` of the saved capture ``capture`` (a name: ``model.capture.find``;
    ``FileNotFoundError`` without the captures in ``data/activations``)."""
    return access.trace_from_capture(saved_captures.find(capture), layer, block_size, topk)


def trace(pattern: str, *, prompt_tokens: int, steps: int, block_size: int, window: int, topk: int, drift: float,
          seed: int, capture: str, capture_layer: int, capture_block_size: int, capture_topk: int
          ) -> access.AccessTrace:
    """The access trace of ``pattern`` (``access``'s generators; ``capture``: SmolLM2's attention), built once for
    the arguments its pattern reads (traces are frozen): a panel's redraw and a sweep's next point reuse it."""
    if pattern == "capture":
        return captured_trace(capture, capture_layer, capture_block_size, capture_topk)
    sliding, sparse = pattern == "sliding_window", pattern == "topk"
    return _trace(pattern, prompt_tokens, steps, block_size, window if sliding else 0, topk if sparse else 0,
                  drift if sparse else 0.0, seed if sparse else 0)


def replay_strategy(tr: access.AccessTrace, strategy: str, *, depth: int, window: int, device_blocks: int,
                    host_blocks: int, compute_us: int, path: str, token_bytes: int, link: LinkModel
                    ) -> tuple[ReplayResult, str]:
    """``tiers.replay.replay`` of ``strategy`` (configured by ``prefetch.strategies(depth, window)``) on ``tr``, and
    the strategy replayed: ``score`` on a trace without scores replays ``none``. ``host_blocks`` 0: every block fits
    on the host; ``path`` ``copy``: a DMA copy per block instead of batches."""
    configs = prefetch.strategies(depth=depth, window_tokens=window)
    shown = "none" if prefetch.needs_scores(configs[strategy]) and tr.scores is None else strategy
    result = replay(tr, configs[shown], device_blocks=device_blocks, host_blocks=host_blocks or None,
                    block_bytes=token_bytes * tr.block_size, compute_s=compute_us * 1e-6, link=link,
                    path="dma" if path == "copy" else path, batched=path != "copy")
    return result, shown


def prefetch_point(pattern: str, strategy: str, device_blocks: int, host_blocks: int, window: int, depth: int,
                   compute_us: int, path: str, prompt_tokens: int, steps: int, block_size: int, token_bytes: int,
                   topk: int, drift: float, seed: int, capture: str, capture_layer: int, capture_block_size: int,
                   capture_topk: int, link: str) -> dict:
    """:func:`replay_strategy` of one strategy on one trace (``replayed`` says which ran)."""
    tr = trace(pattern, prompt_tokens=prompt_tokens, steps=steps, block_size=block_size, window=window, topk=topk,
               drift=drift, seed=seed, capture=capture, capture_layer=capture_layer,
               capture_block_size=capture_block_size, capture_topk=capture_topk)
    model = link_model(link)
    result, shown = replay_strategy(tr, strategy, depth=depth, window=window, device_blocks=device_blocks,
                                    host_blocks=host_blocks, compute_us=compute_us, path=path,
                                    token_bytes=token_bytes, link=model)
    row = {k: v for k, v in result.row().items() if k not in ("strategy", "trace", "steps")}
    row.update(replayed=shown, trace_steps=len(tr), final_blocks=tr.num_blocks[-1],
               reads_per_step=tr.total_reads / len(tr), block_bytes=token_bytes * tr.block_size,
               link_source=model.source)
    return row


def draw_prefetch(result: dict):
    """The prefetch panel's page (``tier_figures.prefetch_overview``) of ``result``: rows, chosen, timeline, setup."""
    from workbench.figures import tiers as tier_figures  # plotly: an optional dependency, imported only to draw

    return tier_figures.prefetch_overview(result["rows"], result["chosen"], result["timeline"], result["setup"])


MIB = 1 / 2**20
# every column's label and unit on the panels' axes (workbench.studies.base.Column): times in ms, as the panels show
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

PREFETCH = Study(
    "prefetch", "prefetch strategies on one sequence's decode over device, host and disk tiers: hit rate and stall", (
        Param("pattern", "str", "topk", choices=tuple(PATTERNS), label="attention", labels=PATTERNS,
              help="capture: SmolLM2 attention from data/activations"),
        Param("strategy", "str", "score", choices=tuple(STRATEGIES), grid=tuple(STRATEGIES), label="strategy",
              labels=STRATEGIES),
        Param("device_blocks", "int", 48, choices=(4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160), grid=(16, 48, 128),
              label="device blocks"),
        # "all" (0) last: the slider runs from the fewest host blocks to no limit
        Param("host_blocks", "int", 0, choices=(16, 32, 64, 96, 128, 0), help="0: every block on the host",
              label="host blocks", labels={0: "all"}),
        Param("window", "int", 256, choices=(64, 128, 256, 512, 1024), help="tokens (sliding window pattern, window "
                                                                           "strategy)", label="window (tokens)"),
        Param("depth", "int", 24, choices=(4, 8, 16, 24, 32, 48, 64), help="blocks (sequential, score)",
              label="depth (blocks)"),
        Param("compute_us", "int", 100, choices=(10, 20, 50, 100, 200, 500, 1000), help="compute a step (us)",
              label="compute/step (us)"),
        Param("path", "str", "dma", choices=tuple(COPY_PATHS), help="DMA batch, SM copy, a copy per block",
              label="copies", labels=COPY_PATHS),
        Param("prompt_tokens", "int", 2048, minimum=0, maximum=1 << 20, help="synthetic traces"),
        Param("steps", "int", 128, minimum=1, maximum=1 << 16, help="decode steps of the synthetic traces"),
        Param("block_size", "int", 16, minimum=1, maximum=1024, help="tokens a block (synthetic traces)"),
        Param("token_bytes", "int", 16384, minimum=1, maximum=1 << 24, help="one token's K and V in the layer"),
        Param("topk", "int", 16, minimum=1, maximum=4096, help="blocks read a step (topk pattern)"),
        Param("drift", "float", 0.2, minimum=0.0, maximum=1.0, help="query drift a step (topk pattern)"),
        Param("seed", "int", 0, minimum=0),
        Param("capture", "str", "code", choices=CAPTURES, help="prompt (capture pattern)"),
        Param("capture_layer", "int", 18, choices=SAVED_LAYERS),
        Param("capture_block_size", "int", 8, minimum=1, maximum=256),
        Param("capture_topk", "int", 4, minimum=1, maximum=256),
        Param("link", "str", "latest", choices=LINKS, help="latest committed bench tiers run, or DESIGN.md")),
    prefetch_point, notebook="05_prefetch_and_tiers", panel="prefetch_panel", x="device_blocks", color="strategy",
    y=("hit_rate", "stall_s", "slowdown", "demand_stall_s", "prefetch_stall_s", "prefetch_wasted", "h2d_bytes"),
    columns=PREFETCH_COLUMNS, controls=("pattern", "strategy", "device_blocks", "host_blocks", "window", "depth",
                                        "compute_us", "path"),
    enabled={"depth": lambda pattern, **_: pattern in ("topk", "capture")}, draw=draw_prefetch)




# ---- preemption ----------------------------------------------------------------------------------------------
class Curve(NamedTuple):
    rows: list[dict]  # sim.preemption_cost.block_size_curve's, one per block size
    bytes_per_token: int  # K and V of a token, every layer
    transfers_per_block: int  # copies a block's swap takes each way
    prefill: pc.PrefillModel  # the recompute's assumed prefill rate


def preemption_curve(model: str, copies: str, path: str, tokens: int, block_sizes: Sequence[int], link: LinkModel
                     ) -> Curve:
    """``sim.preemption_cost.block_size_curve`` of a ``tokens`` request of ``model``: swap out and in (one copy per
    block, per layer's K and V (``copies="layer"``, vLLM) or whole, and batched) against recomputing its prefill."""
    bpt = pc.model_bytes_per_token(model)
    k = pc.per_layer_transfers(model) if copies == "layer" else 1
    prefill = pc.PrefillModel.for_model(model)
    rows = pc.block_size_curve(block_sizes, tokens, bpt, link, prefill, path=path, transfers_per_block=k)
    return Curve(rows, bpt, k, prefill)


def preemption_point(model: str, copies: str, path: str, tokens: int, block_size: int, link: str) -> dict:
    """:func:`preemption_curve` at one block size."""
    c = preemption_curve(model, copies, path, tokens, [block_size], link_model(link))
    row = {key: v for key, v in c.rows[0].items() if key != "block_size"}
    row.update(bytes_per_token=c.bytes_per_token, transfers_per_block=c.transfers_per_block,
               prefill_tokens_per_s=c.prefill.tokens_per_s, prefill_fixed_s=c.prefill.fixed_s)
    return row


def draw_preemption(result: dict):
    """The preemption panel's figure (``tier_figures.preemption_curve``) of ``result``: rows, setup."""
    from workbench.figures import tiers as tier_figures  # plotly: an optional dependency, imported only to draw

    return tier_figures.preemption_curve(**result)


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

PREEMPTION = Study(
    "preemption", "swap (per block, batched) against recompute of a preempted request by block size (vLLM Fig. 19a)", (
        Param("model", "str", "llama-7b", choices=tuple(sorted(model_spec.MODELS)), label="model"),
        Param("copies", "str", "layer", choices=("layer", "block"), grid=("layer", "block"),
              help="a block is one copy per layer's K and V (vLLM) or one copy", label="a block is",
              labels={"layer": "per layer (vLLM)", "block": "whole block"}),
        Param("path", "str", "dma", choices=("dma", "sm"), label="path", labels={"dma": "DMA", "sm": "SM copy"}),
        Param("tokens", "int", 1024, choices=(256, 512, 1024, 2048, 4096), help="the request's tokens",
              label="request tokens"),
        Param("block_size", "int", 16, choices=BLOCK_SIZES, grid=BLOCK_SIZES),
        Param("link", "str", "latest", choices=LINKS, help="latest committed bench tiers run, or DESIGN.md")),
    preemption_point, notebook="05_prefetch_and_tiers", panel="preemption_panel", x="block_size", color="copies",
    y=("swap_per_block_s", "swap_batched_s", "recompute_s", "per_block_vs_recompute"), columns=PREEMPTION_COLUMNS,
    controls=("model", "copies", "path", "tokens"), draw=draw_preemption)


# ---- a format per tier -------------------------------------------------------------------------------------------
FORMAT_LINKS = {"host": "host (measured)", "disk": "disk (assumed)", "flat": "flat (slider)"}  # the toggle's words
#: where the format panel's transcode throughput comes from, with the toggle's words
TRANSCODE_FROM = {"measured": "measured (run)", "assumed": "assumed (slider)"}
DEVICE_FORMAT = "fp16"  # what the device holds: the reference of every speed-up and of the quality rows
QUALITY_KEYS = ("agreement", "mean_kl", "ppl_change")


@functools.lru_cache(maxsize=1)
def quality_table() -> format_quality.QualityTable:
    """The committed quality rows per format (``format_quality.quality_costs``), read once."""
    return format_quality.quality_costs()


@functools.lru_cache(maxsize=1)
def measured_transcodes() -> dict[str, tuple[format_cost.Transcode, format_cost.Transcode]]:
    """The transcode throughput per format (a fraction of the same run's copy bandwidth) measured by the newest
    committed full ``bench tiers`` run with a ``formats`` section (``format_cost.measured_transcodes``): an H200's,
    else another GPU's (the source names it: the device lent since 2026-12-05 is an H100); empty while none is
    committed (then assumed)."""
    any_gpu = {k: v for k, v in tier_runs.H200.items() if k != "gpu"}
    for where in (None, any_gpu):
        for run in reversed(tier_runs.runs(where=where)):
            found = format_cost.measured_transcodes(run["rows"], tier_runs.run_name(run))
            if found:
                return found
    return {}


def formats_table(model: str, block_size: int, batch: int, link: str, bandwidth_gbps: int, transcode: float,
                  formats=TIER_FORMATS, transcode_from: str = "measured") -> tuple[format_cost.FormatTable, dict]:
    """``format_cost.format_table`` of ``formats`` for ``model``'s KV shape on ``link`` (``host``: the newest
    committed ``bench tiers`` run; ``disk``: its assumed NVMe curve; ``flat``: ``bandwidth_gbps``), the transcode as
    a committed run measured it (:func:`measured_transcodes`), else (or with ``transcode_from="assumed"``: what a
    faster kernel would buy) at ``transcode`` of the H200's copy bandwidth; each row with its quality cost
    (:data:`QUALITY_KEYS`, NaN where no committed row has the format).
    Also the sources, in words: ``link``, ``transcode``, ``quality``."""
    if transcode_from not in TRANSCODE_FROM:
        raise ValueError(f"transcode_from must be one of {tuple(TRANSCODE_FROM)}, got {transcode_from!r}")
    shape = model_spec.model(model)
    curves = link_model("latest")
    measured = measured_transcodes() if transcode_from == "measured" else {}
    assumed = format_cost.Transcode(transcode)
    table = format_cost.format_table(shape, block_size, formats, measured, batch=batch,
                                     link=float(bandwidth_gbps) if link == "flat" else curves, transcode=assumed,
                                     device=DEVICE_FORMAT, tier="disk" if link == "disk" else "host")
    quality = quality_table()
    for row in table.rows:
        q = quality.get(row["format"])
        row.update({k: getattr(q, k) if q else math.nan for k in QUALITY_KEYS})
        row["transcode_source"] = measured[row["format"]][0].source if row["format"] in measured else assumed.source
    sources = {"link": {"host": f"host link measured, {curves.source}", "disk": "disk, assumed NVMe curve",
                        "flat": f"flat {bandwidth_gbps} GB/s"}[link],
               "transcode": f"transcode at {assumed.fraction:g} of the H200's {assumed.copy_gbps:.0f} GB/s copy "
                            f"({assumed.source})" if not measured else
                            f"transcode measured, {next(iter(measured.values()))[0].source}",
               "quality": quality.describe()}
    return table, sources


def format_point(format: str, model: str, block_size: int, batch: int, link: str, bandwidth_gbps: int,
                 transcode: float, transcode_from: str = "measured") -> dict:
    """:func:`formats_table`'s row of one format (``ValueError`` where it cannot store the block size)."""
    table, sources = formats_table(model, block_size, batch, link, bandwidth_gbps, transcode, formats=(format,),
                                   transcode_from=transcode_from)
    if not table.rows:
        raise ValueError(f"format {format} cannot store {block_size}-token blocks of {model}: "
                         f"{table.skipped[format]}")
    row = {k: v for k, v in table.rows[0].items() if k != "format"}
    row.update(link_source=sources["link"], quality_source=quality_table().source, quality_kind=quality_table().kind)
    return row


def draw_formats(result: dict):
    """The format panel's figure (``tier_figures.format_overview``) of ``result``: rows, chosen, setup."""
    from workbench.figures import tiers as tier_figures  # plotly: an optional dependency, imported only to draw

    return tier_figures.format_overview(result["rows"], result["chosen"], result["setup"])


FORMAT_COLUMNS = {
    "format": ("host format",), "model": ("model",), "block_size": ("block size", "tokens"),
    "batch": ("blocks a batch",), "link": ("link",), "bandwidth_gbps": ("flat link", "GB/s"),
    "transcode": ("transcode throughput (of copy bandwidth)",), "transcode_from": ("transcode from",),
    "transcodes": ("transcoded",),
    "lossy": ("lossy",), "block_bytes": ("block in the format", "KiB", 1 / 1024),
    "bytes_per_token": ("bytes a token (all layers)", "B"), "ratio": ("device bytes / format bytes",),
    "batch_bytes": ("a batch in the format", "MiB", MIB),
    "down_transcode_s": ("transcode a batch down", "µs", 1e6), "up_transcode_s": ("transcode a batch up", "µs", 1e6),
    "down_copy_s": ("copy a batch down", "µs", 1e6), "up_copy_s": ("copy a batch up", "µs", 1e6),
    "down_s": ("a batch down, pipelined", "µs", 1e6), "up_s": ("a batch up, pipelined", "µs", 1e6),
    "down_tokens_per_s": ("tokens moved down", "M/s", 1e-6), "up_tokens_per_s": ("tokens moved up", "M/s", 1e-6),
    "down_speedup": ("tokens/s down / fp16's",), "up_speedup": ("tokens/s up / fp16's",),
    "down_hidden": ("transcode hidden behind the copy down (share)",),
    "up_hidden": ("transcode hidden behind the copy up (share)",),
    "down_link_gbps": ("link reached down", "GB/s"), "up_link_gbps": ("link reached up", "GB/s"),
    "down_pays_below_gbps": ("the format pays down below", "GB/s"),
    "up_pays_below_gbps": ("the format pays up below", "GB/s"),
    "down_hidden_below_gbps": ("transcode hidden down below", "GB/s"),
    "up_hidden_below_gbps": ("transcode hidden up below", "GB/s"),
    "agreement": ("greedy agreement with fp16",), "mean_kl": ("mean KL against fp16",),
    "ppl_change": ("perplexity change against fp16",),
}

FORMAT_PER_TIER = Study(
    "tier_formats", "a storage format per tier: tokens/s moved down and up, transcode hidden, break-even link, "
                    "quality cost", (
        Param("format", "str", "int4/token", choices=TIER_FORMATS,
              grid=TIER_FORMAT_GRID, label="host format"),
        Param("model", "str", "smollm2-135m", choices=tuple(sorted(model_spec.MODELS)), label="KV shape"),
        Param("block_size", "int", 16, choices=BLOCK_SIZES, grid=(16, 64, 256), label="block (tokens)"),
        Param("batch", "int", 64, choices=(1, 4, 16, 64, 256, 1024), label="blocks a batch"),
        Param("link", "str", "host", choices=tuple(FORMAT_LINKS), labels=FORMAT_LINKS, label="link",
              help="host: the newest bench tiers run; disk: assumed NVMe; flat: bandwidth_gbps"),
        Param("bandwidth_gbps", "int", 64, choices=(8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
              label="flat link (GB/s)", help="link=flat"),
        Param("transcode", "float", format_cost.ASSUMED_FRACTION, choices=(0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0),
              label="transcode / copy", help="of the device's copy bandwidth, assumed (transcode_from=assumed, or "
                                                   "where no committed bench tiers formats run measured it)"),
        Param("transcode_from", "str", "measured", choices=tuple(TRANSCODE_FROM), labels=TRANSCODE_FROM,
              label="transcode", help="measured: the newest committed run's; assumed: the transcode slider")),
    format_point, notebook="05_prefetch_and_tiers", panel="format_panel", x="block_size", color="format",
    y=("down_tokens_per_s", "down_speedup", "up_speedup", "down_hidden", "down_pays_below_gbps", "mean_kl",
       "agreement"),
    columns=FORMAT_COLUMNS, controls=("format", "model", "block_size", "batch", "link", "bandwidth_gbps",
                                      "transcode_from", "transcode"),
    enabled={"bandwidth_gbps": lambda link, **_: link == "flat",
             "transcode": lambda transcode_from, **_: transcode_from == "assumed" or not measured_transcodes()},
    draw=draw_formats)
STUDIES = (PREFETCH, PREEMPTION, FORMAT_PER_TIER)
