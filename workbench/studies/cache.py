"""Sweeps of the cache's memory: notebooks 00 (memory), 01 (sharing), 02 (coalescing) and 04 (fragmentation)."""

from __future__ import annotations

from workbench import spec as model_spec
from workbench.studies.base import BLOCK_SIZES, Param, Study


def memory_point(model: str, kv_dtype: str, block_size: int, max_len: int, num_requests: int, seed: int) -> dict:
    """``memory.compare_allocation`` for one batch: GiB and token share of each scheme."""
    from workbench import memory

    current, final = memory.random_batch(num_requests, max_len, seed)
    bpt = model_spec.model(model).bytes_per_token(kv_dtype)
    row = {}
    for label, parts in memory.compare_allocation(current, final, max_len, block_size, bpt).items():
        scheme = "paged" if label.startswith("paged") else "contiguous"
        row[f"{scheme}_gib"] = parts["total"] / 2**30
        row[f"{scheme}_token_share"] = parts["token_share"]
        row[f"{scheme}_internal_gib"] = parts["internal_fragmentation"] / 2**30
        row[f"{scheme}_reservation_gib"] = parts["reservation"] / 2**30
    row["saving"] = 1 - row["paged_gib"] / row["contiguous_gib"]
    return row


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
        Param("model", "str", "llama-7b", choices=tuple(sorted(model_spec.MODELS))),
        Param("kv_dtype", "str", "fp16", choices=("fp16", "fp8_e4m3", "int4"), help="bytes per element"),
        Param("block_size", "int", 16, choices=BLOCK_SIZES, grid=BLOCK_SIZES),
        Param("max_len", "int", 2048, minimum=256, maximum=65536, grid=(512, 2048, 8192)),
        Param("num_requests", "int", 64, minimum=1, maximum=4096),
        Param("seed", "int", 0, minimum=0)),
    memory_point, notebook="00_tour", panel="memory_panel", x="block_size", color="max_len",
    y=("paged_token_share", "contiguous_token_share", "paged_gib", "contiguous_gib", "saving"), columns=MEMORY_COLUMNS)


def sharing_point(num_requests: int, system_len: int, samples: int, gen_len: int, block_size: int,
                  prefix_caching: bool) -> dict:
    """``sharing.shared_prompt``: blocks used with and without sharing, copy-on-write copies, prefix hits."""
    from workbench.sharing import shared_prompt

    r = shared_prompt(num_requests=num_requests, system_len=system_len, user_len=5, samples=samples,
                      gen_len=gen_len, block_size=block_size, prefix_caching=prefix_caching)
    return {"blocks_used": r.blocks_used, "blocks_unshared": r.blocks_unshared, "memory_saved": r.memory_saved,
            "tokens": r.tokens, "cow_copies": r.cow_copies, "prefix_hits": r.prefix_hits,
            "sequences": len(r.seq_ids)}


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
        Param("num_requests", "int", 4, minimum=1, maximum=256, grid=(1, 2, 4, 8, 12)),
        Param("system_len", "int", 40, minimum=0, maximum=4096, grid=(0, 16, 40, 64, 128)),
        Param("samples", "int", 2, minimum=1, maximum=16),
        Param("gen_len", "int", 12, minimum=0, maximum=4096),
        Param("block_size", "int", 16, choices=(1, 2, 4, 8, 16, 32, 64), grid=(4, 8, 16, 32)),
        Param("prefix_caching", "bool", True, grid=(True, False))),
    sharing_point, notebook="01_allocator_and_sharing", panel="sharing_panel", x="system_len", color="block_size",
    y=("memory_saved", "blocks_used", "blocks_unshared", "cow_copies", "prefix_hits"), columns=SHARING_COLUMNS)


def coalescing_point(layout: str, kind: str, block_size: int, head_dim: int, kv_dtype: str, pad: int, block_n: int,
                     num_kv_heads: int) -> dict:
    """``coalescing.analyze``: lines and sectors one kv head's reads touch, per token and per tile."""
    from workbench.coalescing import analyze

    elem = int(model_spec.dtype_size(kv_dtype))
    row = analyze(layout, kind, block_size, num_kv_heads, head_dim, elem, pad_bytes=pad * elem, block_n=block_n).row()
    return {k: v for k, v in row.items() if k not in ("layout", "kind", "block_size", "head_dim", "block_n")}


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
        Param("layout", "str", "nhd", choices=("nhd", "hnd", "vllm"), grid=("nhd", "hnd", "vllm")),
        Param("kind", "str", "k", choices=("k", "v"), grid=("k", "v")),
        Param("block_size", "int", 16, choices=(1, 2, 4, 8, 16, 32, 64, 128, 256), grid=(1, 4, 16, 64, 128)),
        Param("head_dim", "int", 128, choices=(32, 64, 80, 96, 128, 256)),
        Param("kv_dtype", "str", "fp16", choices=("fp32", "fp16", "fp8_e4m3"), help="only the element size counts"),
        Param("pad", "int", 0, minimum=0, maximum=1024, help="elements added to the block stride"),
        Param("block_n", "int", 64, choices=(1, 8, 16, 32, 64, 128), help="tokens per tile"),
        Param("num_kv_heads", "int", 8, minimum=1, maximum=128)),
    coalescing_point, notebook="02_layouts_and_kernels", panel="coalescing_panel", x="block_size", color="layout",
    y=("tile_line_eff", "tile_sector_eff", "token_line_eff", "tile_lane_bytes", "tile_lines_per_request"),
    columns=COALESCING_COLUMNS)


def fragmentation_point(trace: str, strategy: str, block_size: int, kv_gib: float, compact_every: int,
                        num_requests: int, model: str) -> dict:
    """``sim.sweeps.simulate``: the vLLM paper's four bars, batch size, throughput and preemptions of one run."""
    from workbench.sim import sweeps

    r = sweeps.simulate(trace=trace, strategy=strategy, block_size=block_size, kv_gib=kv_gib,
                        compact_every=compact_every, n=num_requests, model=model)
    row = {f"share_{k}": v for k, v in r["shares"].items()}
    row.update({f"detail_{k}": v for k, v in r["detail"].items()})
    row.update({k: r[k] for k in ("mean_batch", "throughput", "preemptions", "copied_tokens", "steps", "slots")})
    return row


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
        Param("trace", "str", "sharegpt", choices=("sharegpt", "alpaca")),
        Param("strategy", "str", "paged", choices=("paged", "paged-prealloc", "paged-adaptive", "orca-max",
                                                   "orca-pow2", "orca-oracle"), grid=("paged", "paged-adaptive")),
        Param("block_size", "int", 16, choices=BLOCK_SIZES, grid=(1, 4, 16, 64, 256)),
        Param("kv_gib", "float", 12.0, minimum=0.5, maximum=1024),
        Param("compact_every", "int", 0, minimum=0, maximum=100000, help="steps between compactions, 0 = never"),
        Param("num_requests", "int", 2000, minimum=1, maximum=1000000),
        Param("model", "str", "llama-13b", choices=tuple(sorted(model_spec.MODELS)))),
    fragmentation_point, notebook="04_fragmentation_and_compaction", panel="fragmentation_panel", x="block_size",
    color="strategy", y=("share_token_states", "share_internal", "share_reservation", "share_external",
                         "mean_batch", "throughput", "preemptions"), columns=FRAGMENTATION_COLUMNS)
STUDIES = (MEMORY, SHARING, COALESCING, FRAGMENTATION)
