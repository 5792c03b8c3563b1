"""The studies of the cache's memory: notebooks 00 (memory), 01 (sharing), 02 (coalescing) and 04 (fragmentation).
Each is both its panel's controls (``workbench.ui.panels``) and its sweep; the functions below are what each computes.
"""

from __future__ import annotations

from workbench.analysis import allocation_waste
from workbench.analysis.allocator_scenarios import SharingResult, shared_prompt
from workbench.analysis.coalescing import Coalescing, analyze
from workbench.core import kv_spec as model_spec
from workbench.sim import sweeps as sim_sweeps
from workbench.studies.base import BLOCK_SIZES, Param, Study

# by bytes per element: fp16 and bf16 take the same memory (as fp8 and int8), so each is one choice
DTYPE_WORDS = {"fp32": "fp32", "fp16": "fp16 / bf16", "fp8_e4m3": "fp8 / int8", "int4": "int4"}


def allocation(model: str, kv_dtype: str, block_size: int, max_len: int, num_requests: int, seed: int
               ) -> dict[str, dict[str, float]]:
    """``allocation_waste.compare_allocation`` of a random batch (``allocation_waste.random_batch``): where each
    scheme's bytes go."""
    current, final = allocation_waste.random_batch(num_requests, max_len, seed)
    bpt = model_spec.model(model).bytes_per_token(kv_dtype)
    return allocation_waste.compare_allocation(current, final, max_len, block_size, bpt)


def memory_point(model: str, kv_dtype: str, block_size: int, max_len: int, num_requests: int, seed: int) -> dict:
    """:func:`allocation` for one batch: GiB and token share of each scheme."""
    row = {}
    for label, parts in allocation(model, kv_dtype, block_size, max_len, num_requests, seed).items():
        scheme = "paged" if label.startswith("paged") else "contiguous"
        row[f"{scheme}_gib"] = parts["total"] / 2**30
        row[f"{scheme}_token_share"] = parts["token_share"]
        row[f"{scheme}_internal_gib"] = parts["internal_fragmentation"] / 2**30
        row[f"{scheme}_reservation_gib"] = parts["reservation"] / 2**30
    row["saving"] = 1 - row["paged_gib"] / row["contiguous_gib"]
    return row


def draw_memory(result: dict):
    """The memory panel's bars (``figures.breakdown_bars``) of :func:`allocation`'s result."""
    from workbench.figures import cache as figures  # plotly: an optional dependency, imported only to draw

    return figures.breakdown_bars(result)


# every column's label and unit on the panel's axes (workbench.studies.base.Column)
MEMORY_COLUMNS = {
    "model": ("model",), "kv_dtype": ("KV dtype",), "block_size": ("block size", "tokens"),
    "max_len": ("maximum length", "tokens"), "num_requests": ("requests",), "seed": ("seed",),
    "paged_token_share": ("paged: share of KV memory holding tokens",),
    "contiguous_token_share": ("contiguous: share of KV memory holding tokens",),
    "paged_gib": ("paged: KV memory", "GiB"), "contiguous_gib": ("contiguous: KV memory", "GiB"),
    "saving": ("paged saves (share of contiguous memory)",),
    "paged_internal_gib": ("paged: internal fragmentation", "GiB"),
    "contiguous_internal_gib": ("contiguous: internal fragmentation", "GiB"),
    "paged_reservation_gib": ("paged: reserved for future tokens", "GiB"),
    "contiguous_reservation_gib": ("contiguous: reserved for future tokens", "GiB"),
}

MEMORY = Study(
    "memory", "contiguous reservation vs paged blocks: where a batch's KV memory goes", (
        Param("model", "str", "llama-7b", choices=tuple(sorted(model_spec.MODELS)), label="model"),
        Param("kv_dtype", "str", "fp16", choices=("fp16", "fp8_e4m3", "int4"), help="bytes per element",
              label="dtype", labels=DTYPE_WORDS, widget="dropdown"),
        Param("block_size", "int", 16, choices=BLOCK_SIZES, grid=BLOCK_SIZES, label="block size"),
        Param("max_len", "int", 2048, minimum=256, maximum=65536, grid=(512, 2048, 8192), label="max len"),
        Param("num_requests", "int", 64, minimum=1, maximum=4096),
        Param("seed", "int", 0, minimum=0)),
    memory_point, notebook="00_tour", panel="memory_panel", x="block_size", color="max_len",
    y=("paged_token_share", "contiguous_token_share", "paged_gib", "contiguous_gib", "saving"), columns=MEMORY_COLUMNS,
    controls=("model", "kv_dtype", "block_size", "max_len"), draw=draw_memory)


USER_TOKENS = 5  # each request's own tokens after the system prompt


def sharing(num_requests: int, system_len: int, samples: int, gen_len: int, block_size: int, prefix_caching: bool
            ) -> SharingResult:
    """``sharing.shared_prompt`` of requests with a 5-token question after the shared system prompt."""
    return shared_prompt(num_requests=num_requests, system_len=system_len, user_len=USER_TOKENS, samples=samples,
                         gen_len=gen_len, block_size=block_size, prefix_caching=prefix_caching)


def sharing_point(num_requests: int, system_len: int, samples: int, gen_len: int, block_size: int,
                  prefix_caching: bool) -> dict:
    """:func:`sharing`: blocks used with and without sharing, copy-on-write copies, prefix hits."""
    r = sharing(num_requests, system_len, samples, gen_len, block_size, prefix_caching)
    return {"blocks_used": r.blocks_used, "blocks_unshared": r.blocks_unshared, "memory_saved": r.memory_saved,
            "tokens": r.tokens, "cow_copies": r.cow_copies, "prefix_hits": r.prefix_hits,
            "sequences": len(r.seq_ids)}


def draw_sharing(result: SharingResult):
    """The sharing panel's block tables and block counts (``figures.sharing_overview``)."""
    from workbench.figures import cache as figures  # plotly: an optional dependency, imported only to draw

    return figures.sharing_overview(result)


SHARING_COLUMNS = {
    "num_requests": ("requests",), "system_len": ("system prompt", "tokens"), "samples": ("samples per request",),
    "gen_len": ("generated", "tokens"), "block_size": ("block size", "tokens"), "prefix_caching": ("prefix caching",),
    "memory_saved": ("blocks saved by sharing (share)",), "blocks_used": ("blocks in use",),
    "blocks_unshared": ("blocks without sharing",), "cow_copies": ("copy-on-write copies",),
    "prefix_hits": ("blocks found in the prefix cache",), "tokens": ("token states, all sequences",),
    "sequences": ("sequences",),
}

SHARING = Study(
    "sharing", "a shared system prompt across requests that fork parallel samples: blocks saved", (
        Param("num_requests", "int", 4, minimum=1, maximum=256, grid=(1, 2, 4, 8, 12), label="requests"),
        Param("system_len", "int", 40, minimum=0, maximum=4096, grid=(0, 16, 40, 64, 128), label="system prompt"),
        Param("samples", "int", 2, minimum=1, maximum=16, label="samples"),
        Param("gen_len", "int", 12, minimum=0, maximum=4096, label="generated"),
        Param("block_size", "int", 16, choices=(1, 2, 4, 8, 16, 32, 64), grid=(4, 8, 16, 32), label="block size"),
        Param("prefix_caching", "bool", True, grid=(True, False), label="prefix caching")),
    sharing_point, notebook="01_allocator_and_sharing", panel="sharing_panel", x="system_len", color="block_size",
    y=("memory_saved", "blocks_used", "blocks_unshared", "cow_copies", "prefix_hits"), columns=SHARING_COLUMNS,
    controls=("num_requests", "system_len", "samples", "gen_len", "block_size", "prefix_caching"), draw=draw_sharing)


def coalescing(layout: str, kind: str, block_size: int, head_dim: int, kv_dtype: str, pad: int, block_n: int,
               num_kv_heads: int) -> Coalescing:
    """``coalescing.analyze`` of one kv head's reads, ``pad`` elements added to the block stride (only the element
    size of ``kv_dtype`` counts)."""
    elem = int(model_spec.dtype_size(kv_dtype))
    return analyze(layout, kind, block_size, num_kv_heads, head_dim, elem, pad_bytes=pad * elem, block_n=block_n)


def coalescing_point(layout: str, kind: str, block_size: int, head_dim: int, kv_dtype: str, pad: int, block_n: int,
                     num_kv_heads: int) -> dict:
    """:func:`coalescing`: lines and sectors one kv head's reads touch, per token and per tile."""
    row = coalescing(layout, kind, block_size, head_dim, kv_dtype, pad, block_n, num_kv_heads).row()
    return {k: v for k, v in row.items() if k not in ("layout", "kind", "block_size", "head_dim", "block_n")}


def draw_coalescing(result: Coalescing):
    """The coalescing panel's map of lines a warp touches (``figures.coalescing_map``)."""
    from workbench.figures import cache as figures  # plotly: an optional dependency, imported only to draw

    return figures.coalescing_map(result)


COALESCING_COLUMNS = {
    "layout": ("layout",), "kind": ("cache (K or V)",), "block_size": ("block size", "tokens"),
    "head_dim": ("head dim", "elements"), "kv_dtype": ("element type",), "pad": ("block stride padding", "elements"),
    "block_n": ("tile", "tokens"), "num_kv_heads": ("kv heads",),
    "tile_line_eff": ("tile read: useful share of its 128-byte lines",),
    "tile_sector_eff": ("tile read: useful share of its 32-byte sectors",),
    "token_line_eff": ("token read: useful share of its 128-byte lines",),
    "token_sector_eff": ("token read: useful share of its 32-byte sectors",),
    "tile_lane_bytes": ("tile read: bytes a lane loads", "B"),
    "token_lane_bytes": ("token read: bytes a lane loads", "B"),
    "tile_lines_per_request": ("tile read: lines per warp request",), "tile_lines": ("tile read: 128-byte lines",),
    "tile_sectors": ("tile read: 32-byte sectors",), "tile_requests": ("tile read: warp requests",),
    "token_lines": ("token read: 128-byte lines",), "token_sectors": ("token read: 32-byte sectors",),
    "elem_size": ("element size", "B"), "pad_bytes": ("block stride padding", "B"),
    "aligned": ("block stride 128-byte aligned",),
}

COALESCING = Study(
    "coalescing", "128-byte lines and 32-byte sectors a warp's reads touch, by layout, block size and padding", (
        Param("layout", "str", "nhd", choices=("nhd", "hnd", "vllm"), grid=("nhd", "hnd", "vllm"), label="layout",
              widget="dropdown"),
        Param("kind", "str", "k", choices=("k", "v"), grid=("k", "v"), label="cache"),
        Param("block_size", "int", 16, choices=BLOCK_SIZES, grid=(1, 4, 16, 64, 128), label="block size"),
        Param("head_dim", "int", 128, choices=(32, 64, 80, 96, 128, 256), label="head_dim"),
        Param("kv_dtype", "str", "fp16", choices=("fp32", "fp16", "fp8_e4m3"), help="only the element size counts",
              label="dtype", labels=DTYPE_WORDS, widget="dropdown"),
        Param("pad", "int", 0, minimum=0, maximum=1024, help="elements added to the block stride",
              label="pad (elems)"),
        Param("block_n", "int", 64, choices=(1, 8, 16, 32, 64, 128), help="tokens per tile", label="tile tokens"),
        Param("num_kv_heads", "int", 8, minimum=1, maximum=128)),
    coalescing_point, notebook="02_layouts_and_kernels", panel="coalescing_panel", x="block_size", color="layout",
    y=("tile_line_eff", "tile_sector_eff", "token_line_eff", "tile_lane_bytes", "tile_lines_per_request"),
    columns=COALESCING_COLUMNS,
    controls=("layout", "kind", "block_size", "head_dim", "kv_dtype", "pad", "block_n"), draw=draw_coalescing)


def fragmentation(trace: str, strategy: str, block_size: int, kv_gib: float, compact_every: int, num_requests: int,
                  model: str) -> dict:
    """``sim.sweeps.simulate``: one serving simulator run of the first ``num_requests`` requests of ``trace``."""
    return sim_sweeps.simulate(trace=trace, strategy=strategy, block_size=block_size, kv_gib=kv_gib,
                               compact_every=compact_every, n=num_requests, model=model)


def fragmentation_point(trace: str, strategy: str, block_size: int, kv_gib: float, compact_every: int,
                        num_requests: int, model: str) -> dict:
    """:func:`fragmentation`: the vLLM paper's four bars, batch size, throughput and preemptions of one run."""
    r = fragmentation(trace, strategy, block_size, kv_gib, compact_every, num_requests, model)
    row = {f"share_{k}": v for k, v in r["shares"].items()}
    row.update({f"detail_{k}": v for k, v in r["detail"].items()})
    row.update({k: r[k] for k in ("mean_batch", "throughput", "preemptions", "copied_tokens", "steps", "slots")})
    return row


def draw_fragmentation(result: dict):
    """The fragmentation panel's bars and steps (``figures.sim_run``) of one simulator run."""
    from workbench.figures import cache as figures  # plotly: an optional dependency, imported only to draw

    return figures.sim_run(result)


SHARE = "% of KV memory"  # the simulator's shares: percent of the KV budget
FRAGMENTATION_COLUMNS = {
    "trace": ("trace",), "strategy": ("strategy",), "block_size": ("block size", "tokens"),
    "kv_gib": ("KV budget", "GiB"), "compact_every": ("compaction period (0: never)", "steps"),
    "num_requests": ("requests",), "model": ("model",),
    "share_token_states": ("token states", SHARE), "share_internal": ("internal fragmentation", SHARE),
    "share_reservation": ("reservation", SHARE), "share_external": ("external fragmentation and free", SHARE),
    "detail_token": ("detail: token states", SHARE), "detail_reservation": ("detail: reservation", SHARE),
    "detail_internal": ("detail: internal fragmentation", SHARE), "detail_slack": ("detail: slack", SHARE),
    "detail_external": ("detail: external fragmentation", SHARE), "detail_free": ("detail: free", SHARE),
    "mean_batch": ("mean batch", "requests"), "throughput": ("throughput", "requests per step"),
    "preemptions": ("preemptions",), "copied_tokens": ("tokens copied by compaction",), "steps": ("steps",),
    "slots": ("KV slots", "tokens"),
}

FRAGMENTATION = Study(
    "fragmentation", "the serving simulator: where the memory goes per strategy and block size (vLLM Figure 2)", (
        Param("trace", "str", "sharegpt", choices=("sharegpt", "alpaca"), label="trace", widget="dropdown"),
        Param("strategy", "str", "paged", choices=sim_sweeps.SIM_STRATEGIES, grid=("paged", "paged-adaptive"),
              label="strategy"),
        Param("block_size", "int", 16, choices=BLOCK_SIZES, grid=(1, 4, 16, 64, 256), label="block size"),
        Param("kv_gib", "float", 12.0, minimum=0.5, maximum=1024, label="budget GiB"),
        Param("compact_every", "int", 0, minimum=0, maximum=100000, help="steps between compactions, 0 = never",
              label="compact every"),
        Param("num_requests", "int", 2000, minimum=1, maximum=1000000),
        Param("model", "str", "llama-13b", choices=tuple(sorted(model_spec.MODELS)))),
    fragmentation_point, notebook="04_fragmentation_and_compaction", panel="fragmentation_panel", x="block_size",
    color="strategy", y=("share_token_states", "share_internal", "share_reservation", "share_external",
                         "mean_batch", "throughput", "preemptions"), columns=FRAGMENTATION_COLUMNS,
    controls=("trace", "strategy", "block_size", "kv_gib", "compact_every"), draw=draw_fragmentation,
    enabled={"block_size": lambda strategy, **_: strategy in sim_sweeps.BLOCK_STRATEGIES,
             "compact_every": lambda strategy, **_: strategy in sim_sweeps.COMPACTING_STRATEGIES})
STUDIES = (MEMORY, SHARING, COALESCING, FRAGMENTATION)
