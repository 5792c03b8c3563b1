"""The compression studies: notebook 07 (compression), the sparsification policies and Quest's page choice on the
committed SmolLM2-135M activations (``data/activations``: 5 prompts, 6 of its 30 layers, the last 16 queries).
``sparsification`` scores one setting as its panel does (``sparsity_study.score_rows``: the policy decides 8 tokens
before the end of the prompt, those 8 queries are scored as decode steps); ``quest`` is Quest's recall at one page size
and budget (``recall_study.quest_recall_curves``) beside the speedup a committed H200 run measured (``bench quest``;
read from the file, nothing is timed here). A point runs on one torch thread, as notebook 07 does, and puts it back
after. ``SPARSIFICATION`` and ``QUEST`` are both the panels' controls (``workbench.ui.compress_panels``) and the
sweeps."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import NamedTuple

import torch

from workbench.compress import policies, recall_study, sparsity_study
from workbench.compress.block_keep import BlockKeep
from workbench.model import capture
from workbench.results import compress as measured
from workbench.studies.base import Param, Study, one_thread

POLICIES = tuple(n for n in policies.NAMES if n != "full")  # "full" is the reference point (1, 0)
BUDGETS = tuple(round(0.05 * i, 2) for i in range(1, 21))  # 5% .. 100% of the prompt (threshold: p = budget / 10)
PROMPTS = tuple(p.name for p in capture.PROMPTS)
QUEST_PAGE_SIZES = (8, 16, 32, 64)
QUEST_SHARES = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)


@functools.cache
def _captures() -> dict:
    """The committed captures by prompt name, loaded once a process (``capture.load()``, as the panels get them)."""
    return {c.name: c for c in capture.load()}


class Chosen(NamedTuple):
    """One policy setting on one capture, as scored (``sparsity_study.score_rows``) and applied
    (``sparsity_study.kept_tokens``)."""

    current: dict  # the score over the saved layers (the row of layer "all")
    at_layer: dict  # the score of the chosen layer
    keep: torch.Tensor  # [T] the tokens the policy chose
    blocks: BlockKeep  # the block rule's result: the blocks held (Quest: read), its mask over the tokens
    attention_read: float  # the last prompt token's attention inside the blocks read, mean over heads


def chosen(rows: list[dict], cap, policy: str, budget: float, window: int, sinks: int, block_size: int, partial: str,
           layer: int) -> Chosen:
    """The setting's ``rows`` (``sparsity_study.score_rows`` of it: every layer's and ``"all"``) at the chosen layer,
    and what it keeps (``sparsity_study.kept_tokens``): the sweep's point and the panel's chosen setting."""
    keep, bk = sparsity_study.kept_tokens(cap, policy, budget, block_size, partial, sinks, window)
    read = float((cap.attn_last[layer] * bk.mask).sum(-1).mean())
    return Chosen(next(r for r in rows if r["layer"] == "all"), next(r for r in rows if r["layer"] == layer), keep,
                  bk, read)


def sparsification_point(policy: str, budget: float, window: int, sinks: int, block_size: int, partial: str,
                         prompt: str, layer: int) -> dict:
    """:func:`chosen` of one policy setting on one prompt: its error over the 6 saved layers and blocks held (Quest:
    read a step) against the full cache's, ``layer_error`` and ``attention_read`` of the chosen layer.
    ``applied_budget`` is the policy's own (threshold: its probability)."""
    cap = _captures()[prompt]
    with one_thread():
        rows = sparsity_study.score_rows(cap, policy, (budget,), block_size, partial, sinks, window)
        c = chosen(rows, cap, policy, budget, window, sinks, block_size, partial, layer)
    current = c.current
    row = {k: current[k] for k in ("label", "error", "tokens", "tokens_kept", "blocks_full", "blocks_kept", "freed",
                                   "moved", "frees", "bytes_full", "bytes_kept", "held_out")}
    row.update(applied_budget=current["budget"], memory=current["blocks_kept"] / current["blocks_full"],
               layer_error=c.at_layer["error"], attention_read=c.attention_read, chosen_tokens=int(c.keep.sum()),
               blocks_read=c.blocks.blocks)
    return row


def draw_sparsification(result: dict):
    """The sparsification panel's page (``compress_figures.sparsification_overview``) of ``result``."""
    from workbench.figures import compress as compress_figures  # plotly: optional, imported only to draw

    return compress_figures.sparsification_overview(**result)


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
        Param("policy", "str", "h2o", choices=POLICIES, grid=POLICIES, label="policy"),
        Param("budget", "float", 0.25, choices=BUDGETS, grid=(0.1, 0.25, 0.5), help="share of the prompt (threshold: p "
              "= budget / 10)", label="budget (threshold: p = budget / 10)", labels={b: f"{b:.0%}" for b in BUDGETS}),
        Param("window", "int", 16, choices=tuple(range(0, 65, 4)), help="recent tokens (h2o, snapkv, threshold)",
              label="window (tokens)"),
        Param("sinks", "int", 4, minimum=0, maximum=16, help="first tokens always kept (not quest)", label="sinks"),
        Param("block_size", "int", 16, choices=(8, 16, 32, 64), label="block size"),
        Param("partial", "str", "keep", choices=("keep", "compact"), label="partial blocks",
              labels={"keep": "keep whole", "compact": "compact"},
              help="partly dropped blocks kept whole or compacted (not quest)"),
        Param("prompt", "str", "chat_question", choices=PROMPTS, label="prompt"),
        Param("layer", "int", 18, choices=capture.SAVED_LAYERS, help="the layer of layer_error and attention_read",
              label="layer")),
    sparsification_point, notebook="07_compression", panel="sparsification_panel", x="budget", color="policy",
    y=("error", "memory", "blocks_kept", "layer_error", "attention_read"), columns=SPARSIFICATION_COLUMNS,
    controls=("policy", "budget", "window", "sinks", "block_size", "partial", "prompt", "layer"), enabled={
        "window": lambda policy, **_: policy in ("h2o", "snapkv", "threshold"),
        "sinks": lambda policy, **_: policy != "quest"}, draw=draw_sparsification)


def _quest_run(run: str) -> dict:
    """The committed H200 Quest run named ``run`` (a file name in ``data/results``), or the newest (``latest``)."""
    runs = measured.runs("quest")
    if not runs:
        raise ValueError("no bench quest runs: run `python -m workbench bench quest --out data/results` on a GPU")
    if run == "latest":
        return runs[-1]
    names = [measured.run_name(r) for r in runs]
    if run not in names:
        raise ValueError(f"quest_run: expected latest or one of {', '.join(names)}, got {run!r}")
    return runs[names.index(run)]


class Timed(NamedTuple):
    page_size: int  # the page size the run timed nearest the chosen one (the smaller of two)
    rows: list[dict]  # measured.quest_speedups at it, by ascending budget
    best: dict  # the row of the best CUDA-graph speedup


def timed_speedups(doc: Mapping, batch: int, page_size: int) -> Timed:
    """A committed H200 run's Quest speedups at ``batch`` for ``page_size``, else the nearest page size it timed."""
    timed = min(measured.quest_page_sizes(doc), key=lambda p: (abs(p - page_size), p))
    rows = measured.quest_speedups(doc, batch, timed)
    return Timed(timed, rows, max(rows, key=lambda r: r["speedup_graph"]))


def quest_point(page_size: int, share: float, batch: int, quest_run: str) -> dict:
    """``recall_study.quest_recall_curves`` of every capture at one page size and page budget (what the quest panel
    draws on the left), and :func:`timed_speedups` of the committed run: the best (the panel's title) and at the timed
    budget nearest ``share``."""
    with one_thread():
        (cur,) = recall_study.quest_recall_curves(list(_captures().values()), (page_size,), (share,))
    doc = _quest_run(quest_run)
    t = timed_speedups(doc, batch, page_size)
    near = min(t.rows, key=lambda r: (abs(math.log(r["share"] / share)), r["share"]))
    row = {k: cur[k] for k in ("recall", "recall_per_head", "recall_oracle", "pages", "read", "samples")}
    row.update(timed_page_size=t.page_size, context=near["context"], timed_budget_tokens=near["budget_tokens"],
               timed_share=near["share"], speedup_graph=near["speedup_graph"], speedup=near["speedup"],
               bytes_ratio=near["bytes_ratio"], best_speedup_graph=t.best["speedup_graph"],
               best_budget_tokens=t.best["budget_tokens"], run_name=measured.run_name(doc))
    return row


def draw_quest(result: dict):
    """The quest panel's page (``compress_figures.quest_overview``) of ``result``."""
    from workbench.figures import compress as compress_figures  # plotly: optional, imported only to draw

    return compress_figures.quest_overview(**result)


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
        Param("page_size", "int", 16, choices=QUEST_PAGE_SIZES, grid=QUEST_PAGE_SIZES, label="page size"),
        Param("share", "float", 0.2, choices=QUEST_SHARES, grid=(0.05, 0.1, 0.2, 0.3, 0.5), label="page budget",
              labels={s: f"{s:.0%}" for s in QUEST_SHARES}, help="page budget, a share of the pages"),
        Param("batch", "int", 8, choices=(1, 8), help="the H200 run's batch", label="H200",
              labels={1: "batch 1", 8: "batch 8"}, widget="toggle"),
        # not "run": every row is stamped with the sweep's run id under that name (store.META_KEYS)
        Param("quest_run", "str", "latest", help="latest, or a committed quest-*.json file name in data/results")),
    quest_point, notebook="07_compression", panel="quest_panel", x="share", color="page_size",
    y=("recall", "recall_per_head", "recall_oracle", "read", "speedup_graph", "best_speedup_graph"),
    columns=QUEST_COLUMNS, controls=("page_size", "share", "batch"), draw=draw_quest)
STUDIES = (SPARSIFICATION, QUEST)
