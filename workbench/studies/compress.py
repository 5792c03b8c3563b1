"""Sweeps of K/V compression: notebook 07 (compression), the sparsification policies and Quest's page choice on the
committed SmolLM2-135M activations (``data/activations``: 5 prompts, 6 of its 30 layers, the last 16 queries).
``sparsification`` scores one setting as its panel does (``study.score_rows``: the policy decides 8 tokens before
the end of the prompt, those 8 queries are scored as decode steps); ``quest`` is Quest's recall at one page size and
budget (``study.quest_recall_curves``) beside the speedup a committed H200 run measured (``bench quest``; read from
the file, nothing is timed here). A point runs on one torch thread, as notebook 07 does, and puts it back after."""

from __future__ import annotations

import functools
import math

from workbench.studies.base import Param, Study, one_thread

# workbench.compress.policies.NAMES less "full", workbench.model.capture.PROMPTS and SAVED_LAYERS, and the sliders
# of workbench.ui.compress_panels (not imported here: they import torch, the panels widgets)
POLICIES = ("streaming", "h2o", "snapkv", "threshold", "quest")
BUDGETS = tuple(round(0.05 * i, 2) for i in range(1, 21))  # 5% .. 100% of the prompt (threshold: p = budget / 10)
PROMPTS = ("chat_question", "code", "prose", "numbers", "chat_instructions")
LAYERS = (0, 6, 12, 18, 24, 29)
QUEST_PAGE_SIZES = (8, 16, 32, 64)
QUEST_SHARES = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)


@functools.cache
def _captures() -> dict:
    """The committed captures by prompt name, loaded once a process (``capture.load()``, as the panels get them)."""
    from workbench.model import capture

    return {c.name: c for c in capture.load()}


def sparsification_point(policy: str, budget: float, window: int, sinks: int, block_size: int, partial: str,
                         prompt: str, layer: int) -> dict:
    """``study.score_rows`` of one policy setting on one prompt, as ``sparsification_panel`` scores the chosen
    setting: its error over the 6 saved layers and blocks held (Quest: read a step) against the full cache's,
    ``layer_error`` and ``attention_read`` (the last prompt token's attention inside the blocks read, mean over
    heads) of the chosen layer. ``applied_budget`` is the policy's own (threshold: its probability)."""
    from workbench.compress import study

    cap = _captures()[prompt]
    with one_thread():
        rows = study.score_rows(cap, policy, (budget,), block_size, partial, sinks, window)
        keep, bk = study.kept_tokens(cap, policy, budget, block_size, partial, sinks, window)
        read = float((cap.attn_last[layer] * bk.mask).sum(-1).mean())
    current = next(r for r in rows if r["layer"] == "all")
    at_layer = next(r for r in rows if r["layer"] == layer)
    row = {k: current[k] for k in ("label", "error", "tokens", "tokens_kept", "blocks_full", "blocks_kept", "freed",
                                   "moved", "frees", "bytes_full", "bytes_kept", "held_out")}
    row.update(applied_budget=current["budget"], memory=current["blocks_kept"] / current["blocks_full"],
               layer_error=at_layer["error"], attention_read=read, chosen_tokens=int(keep.sum()),
               blocks_read=bk.blocks)
    return row


ERR = "relative L2"
# every column's label and unit on the panels' axes (workbench.studies.base.Column)
SPARSIFICATION_COLUMNS = {
    "policy": ("policy",), "budget": ("budget (share of the prompt)",), "window": ("window", "tokens"),
    "sinks": ("sink tokens",), "block_size": ("block size", "tokens"), "partial": ("partly dropped blocks",),
    "prompt": ("prompt",), "layer": ("layer",),
    "error": ("attention-output error, saved layers", ERR),
    "layer_error": ("attention-output error, chosen layer", ERR),
    "memory": ("memory kept (blocks held / full)",), "blocks_kept": ("blocks held",),
    "attention_read": ("attention in the blocks read (share)",), "tokens": ("prompt", "tokens"),
    "tokens_kept": ("tokens kept",), "chosen_tokens": ("tokens chosen",), "blocks_full": ("blocks of the full cache",),
    "blocks_read": ("blocks read",), "freed": ("blocks freed",), "moved": ("tokens copied by compaction",),
    "frees": ("frees real blocks",), "bytes_full": ("full cache", "KiB", 1 / 1024),
    "bytes_kept": ("kept", "KiB", 1 / 1024), "held_out": ("queries scored as decode steps",),
    "applied_budget": ("the policy's own budget",),
}

SPARSIFICATION = Study(
    "sparsification", "one sparsification policy on the real K/V: attention-output error against the blocks kept", (
        Param("policy", "str", "h2o", choices=POLICIES, grid=POLICIES),
        Param("budget", "float", 0.25, choices=BUDGETS, grid=(0.1, 0.25, 0.5),
              help="share of the prompt (threshold: p = budget / 10)"),
        Param("window", "int", 16, choices=tuple(range(0, 65, 4)), help="recent tokens (h2o, snapkv, threshold)"),
        Param("sinks", "int", 4, minimum=0, maximum=16, help="first tokens always kept (not quest)"),
        Param("block_size", "int", 16, choices=(8, 16, 32, 64)),
        Param("partial", "str", "keep", choices=("keep", "compact"),
              help="partly dropped blocks kept whole or compacted (not quest)"),
        Param("prompt", "str", "chat_question", choices=PROMPTS),
        Param("layer", "int", 18, choices=LAYERS, help="the layer of layer_error and attention_read")),
    sparsification_point, notebook="07_compression", panel="sparsification_panel", x="budget", color="policy",
    y=("error", "memory", "blocks_kept", "layer_error", "attention_read"), columns=SPARSIFICATION_COLUMNS)


def _quest_run(run: str) -> dict:
    """The committed H200 Quest run named ``run`` (a file name in ``data/results``), or the newest (``latest``)."""
    from workbench.bench import compress_results as measured

    runs = measured.runs("quest")
    if not runs:
        raise ValueError("no bench quest runs: run `python -m workbench bench quest --out data/results` on a GPU")
    if run == "latest":
        return runs[-1]
    names = [measured.run_name(r) for r in runs]
    if run not in names:
        raise ValueError(f"quest_run: expected latest or one of {', '.join(names)}, got {run!r}")
    return runs[names.index(run)]


def quest_point(page_size: int, share: float, batch: int, quest_run: str) -> dict:
    """``study.quest_recall_curves`` of every capture at one page size and page budget (what ``quest_panel``
    draws on the left), and the committed H200 run's speedups at ``batch`` for the nearest page size it timed (the
    smaller of two, as the panel): the best (the panel's title) and at the timed budget nearest ``share``."""
    from workbench.bench import compress_results as measured
    from workbench.compress import study

    with one_thread():
        (cur,) = study.quest_recall_curves(list(_captures().values()), (page_size,), (share,))
    doc = _quest_run(quest_run)
    timed = min(measured.quest_page_sizes(doc), key=lambda p: (abs(p - page_size), p))
    rows = measured.quest_speedups(doc, batch, timed)
    best = max(rows, key=lambda r: r["speedup_graph"])
    near = min(rows, key=lambda r: (abs(math.log(r["share"] / share)), r["share"]))
    row = {k: cur[k] for k in ("recall", "recall_per_head", "recall_oracle", "pages", "read", "samples")}
    row.update(timed_page_size=timed, context=near["context"], timed_budget_tokens=near["budget_tokens"],
               timed_share=near["share"], speedup_graph=near["speedup_graph"], speedup=near["speedup"],
               bytes_ratio=near["bytes_ratio"], best_speedup_graph=best["speedup_graph"],
               best_budget_tokens=best["budget_tokens"], run_name=measured.run_name(doc))
    return row


QUEST_COLUMNS = {
    "page_size": ("page size", "tokens"), "share": ("page budget (share of pages)",),
    "batch": ("H200 run's batch",),
    "quest_run": ("H200 run",), "recall": ("recall, one page set for all heads",),
    "recall_per_head": ("recall, a page set per head",), "recall_oracle": ("recall of the best pages",),
    "read": ("share of the keys read",), "pages": ("pages read",), "samples": ("(prompt, layer) samples",),
    "speedup_graph": ("measured speedup over full decode, CUDA graph",),
    "best_speedup_graph": ("best measured speedup, CUDA graph",), "speedup": ("measured speedup, eager",),
    "bytes_ratio": ("bytes read: full / Quest",), "timed_page_size": ("timed page size", "tokens"),
    "context": ("timed context", "tokens"), "timed_budget_tokens": ("timed budget", "tokens"),
    "timed_share": ("timed budget (share)",), "best_budget_tokens": ("budget of the best speedup", "tokens"),
}

QUEST = Study(
    "quest", "Quest's recall on the real activations by page size and budget, beside the H200's measured speedup", (
        Param("page_size", "int", 16, choices=QUEST_PAGE_SIZES, grid=QUEST_PAGE_SIZES),
        Param("share", "float", 0.2, choices=QUEST_SHARES, grid=(0.05, 0.1, 0.2, 0.3, 0.5),
              help="page budget, a share of the pages"),
        Param("batch", "int", 8, choices=(1, 8), help="the H200 run's batch"),
        # not "run": every row is stamped with the sweep's run id under that name (store.META_KEYS)
        Param("quest_run", "str", "latest", help="latest, or a committed quest-*.json file name in data/results")),
    quest_point, notebook="07_compression", panel="quest_panel", x="share", color="page_size",
    y=("recall", "recall_per_head", "recall_oracle", "read", "speedup_graph", "best_speedup_graph"),
    columns=QUEST_COLUMNS)
STUDIES = (SPARSIFICATION, QUEST)
