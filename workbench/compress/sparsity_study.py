"""Scoring the sparsification policies of :mod:`workbench.compress.policies`: memory kept, attention-output error
against the full cache, the cost of one shared token set against per-head masks; and the settings and tables of
notebook 07's sparsification panel. Quest's recall is :mod:`workbench.compress.recall_study`'s.

Pure functions returning tidy rows (one dict per prompt, policy, budget, block rule and layer); no plots.

    caps = workbench.model.capture.load()           # 5 prompts of SmolLM2-135M, 6 of its 30 layers
    rows = score_policies(caps, ["streaming", "h2o", "snapkv", "quest"], [0.1, 0.25, 0.5], held_out=8)
    table = summarize(rows)                         # mean over prompts, layer "all"

Block rules (:data:`RULES`): ``keep`` and ``compact`` of :func:`~workbench.compress.block_keep.block_keep`, and to
compare them at equal memory ``keep-equal`` (the ``keep`` rule with the token budget cut until it holds no more
blocks than ``compact`` does) and ``blocks`` (the policy scores whole blocks, ``Scored.keep_blocks``).

What the captures allow: only the last 16 prompt queries were saved (``Capture.q_last``), so H2O accumulates the
attention of those 16 queries, not of the whole prompt as in the paper, and every policy decides from at most 16
queries. Errors are measured two ways:

- ``held_out=0`` (in sample): the policy sees all ``W`` queries and is scored on the same ``W`` queries (causal:
  query ``p`` reads keys ``<= p``). This flatters H2O and SnapKV, which chose the tokens those queries attend to.
- ``held_out=h`` (decode-like): the policy sees the first ``T - h`` tokens and the queries before them; the cache
  is compressed there, the ``h`` later tokens are appended whole, and the ``h`` later queries, which the policy
  never saw, are scored.

Quest is query-dependent: each scored query chooses its own pages from what precedes it (a decode step), so its
rows report the tokens and blocks read per step (means), and ``frees`` is False: every page stays in the cache.
Memory is counted per layer as the paged cache holds it (``block_size * Hkv * D`` K and V values a block, fp16 by
default); the per-head masks free nothing in a paged cache, so their column ``bytes_csr`` is what the seed's CSR
store of the same entries would take (values plus int32 indices).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from workbench.compress import policies
from workbench.compress.block_keep import PARTIAL, BlockKeep, block_keep
from workbench.compress.csr import CSRStore, csr_nbytes
from workbench.compress.observation import Observation, attention_output, observations, relative_error
from workbench.core import kv_formats

THRESHOLDS = (0.001, 0.003, 0.01, 0.03)  # the threshold policy's "budgets": attention probabilities
# options of each policy in the study (a share of the budget for the recent window: a fixed 32-token window would
# be the whole budget of a 150-token prompt at 10% and every policy would be streaming)
STUDY_OPTIONS: dict[str, dict] = {"h2o": {"window": 0.5}, "snapkv": {"window": 0.25}}
# block rules the study compares: block_keep's two partial-block rules, and two that need a token budget:
# "keep-equal" (keep, with the budget cut until it holds no more blocks than "compact") and "blocks" (the policy
# chooses whole blocks, ``keep_blocks``: nothing partly dropped, nothing copied)
RULES = (*PARTIAL, "keep-equal", "blocks")


def _per_query_outputs(policy, obs: Observation, last: int, per_head: bool,
                       block_size: int) -> tuple[torch.Tensor, float, float]:
    """A query-dependent policy, one decode step per query: query ``w`` of the last ``last`` chooses from (and
    reads) the tokens up to its own position. Returns the outputs ``[L, last, Hq, D]``, the mean tokens read (per
    head when ``per_head``) and the mean blocks of ``block_size`` read (shared set)."""
    T, W = obs.num_tokens, obs.num_queries
    outs, read, blocks = [], [], []
    for i_w in range(W - last, W):
        p = T - W + i_w  # the query's position
        seen = Observation(obs.k[:, :p + 1], obs.v[:, :p + 1], obs.q[:, :i_w + 1], obs.sm_scale)
        m = policy.per_head_keep(seen) if per_head else policy.keep(seen)  # [..., p + 1]
        read.append(float(m.float().sum(-1).mean()))
        blocks.append(0 if per_head else block_keep(m, block_size, "keep").blocks)
        step = Observation(seen.k, seen.v, obs.q[:, i_w:i_w + 1], obs.sm_scale)  # the one query, at position p
        outs.append(attention_output(step, m))
    return torch.cat(outs, 1), sum(read) / len(read), sum(blocks) / len(blocks)


def _csr_bytes_by_layer(mask: torch.Tensor, head_dim: int, kv_dtype: str) -> list[int]:
    """Bytes of each layer's CSR store of ``mask`` ``[L, Hkv, T]``."""
    return [csr_nbytes(int(m.sum()), m.shape[0], head_dim, kv_dtype) for m in mask]


def _block_rule(pol, seen: Observation, keep: torch.Tensor, tail: torch.Tensor, block_size: int,
                rule: str) -> BlockKeep | None:
    """``keep`` (the policy's set on ``seen``, ``tail`` appended) under a block rule of :data:`RULES`; None where
    the rule needs a token budget the policy has not (``threshold``, ``full``)."""
    if rule in PARTIAL:
        return block_keep(keep, block_size, rule)
    if not hasattr(pol, "budget"):
        return None
    if rule == "blocks":
        return block_keep(torch.cat([pol.keep_blocks(seen, block_size), tail]), block_size, "keep")
    target = block_keep(keep, block_size, "compact").blocks  # "keep-equal": compaction's memory

    def held(n: int) -> BlockKeep:
        return block_keep(torch.cat([replace(pol, budget=n).keep(seen), tail]), block_size, "keep")

    lo, hi = 1, seen.num_tokens  # the largest token budget whose rounded-up blocks fit (blocks grow with n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if held(mid).blocks <= target else (lo, mid - 1)
    return held(lo)


def score_policies(captures: Sequence, names: Iterable[str] = policies.NAMES,
                   budgets: Iterable[int | float] = (0.1, 0.25, 0.5), block_size: int = 16,
                   partial: str | Iterable[str] = RULES, *, held_out: int = 0,
                   thresholds: Iterable[float] = THRESHOLDS, options: dict[str, dict] | None = None,
                   kv_dtype: str = "fp16", per_head: bool = True) -> list[dict]:
    """Every policy at every budget on every capture: tidy rows.

    Args:
        captures: ``Capture``s or :class:`Observation`s.
        names: policy names (``policies.NAMES``); ``full`` is scored once (budget 1.0).
        budgets: token counts or ratios; the ``threshold`` policy uses ``thresholds`` instead.
        block_size: tokens per block.
        partial: block rules of :data:`RULES`: ``"keep"``, ``"compact"``
            (:func:`~workbench.compress.block_keep.block_keep`), ``"keep-equal"``, ``"blocks"``.
        held_out: decode steps scored that the policy did not see (0: in sample; see the module docstring).
        options: per policy name, fields to override (default :data:`STUDY_OPTIONS`).
        kv_dtype: the cache's storage format (bytes per value).
        per_head: also score the per-head masks (False: their columns are None, for about half the work; what a
            chart of the shared sets needs, such as notebook 07's sparsification panel).

    Returns:
        One dict per (prompt, policy, budget, partial, layer) with ``layer`` a model layer or ``"all"``:
        ``prompt, policy, label, budget, partial, held_out, layer, tokens`` (T), ``tokens_kept`` (attended after
        block rounding), ``blocks_full, blocks_kept, freed, moved`` (tokens compaction copies), ``frees``,
        ``bytes_full, bytes_kept, error`` (the shared set), ``tokens_per_head`` (mean per head),
        ``bytes_csr`` (the per-head entries in CSR), ``error_per_head``.
    """
    partials = [partial] if isinstance(partial, str) else list(partial)
    if not partials or any(p not in RULES for p in partials):
        raise ValueError(f"partial must be among {RULES}, got {partial!r}")
    opts = STUDY_OPTIONS if options is None else options
    value = kv_formats.get(kv_dtype).bytes_per_value
    rows = []
    for prompt, layers, obs in observations(captures):
        L, T, H, D = obs.k.shape
        last = held_out or obs.num_queries
        ev = Observation(obs.k, obs.v, obs.q[:, -last:], obs.sm_scale)  # the scored queries
        full = attention_output(ev)  # [L, last, Hq, D]
        block_bytes = block_size * H * D * 2 * value  # one layer's K and V of a block
        blocks_full = -(-T // block_size)
        for name in names:
            extra = opts.get(name, {})
            choices = [None] if name == "full" else thresholds if name == "threshold" else budgets
            for b in choices:
                over = {} if b is None else {"threshold" if name == "threshold" else "budget": b}
                pol = policies.get(name, **extra, **over)
                if getattr(pol, "query_dependent", False):
                    out, read, read_blocks = _per_query_outputs(pol, obs, last, False, block_size)
                    shared = {p: (out, read, read_blocks, 0, False) for p in partials if p in PARTIAL}
                    heads, ph_tokens, ph_bytes, ph_all = None, None, None, None
                    if per_head:
                        heads, ph_tokens, _ = _per_query_outputs(pol, obs, last, True, block_size)
                else:
                    seen = obs.prefix(held_out)
                    tail = torch.ones(held_out, dtype=torch.bool)
                    keep = torch.cat([pol.keep(seen), tail])  # the new tokens are appended whole
                    shared = {}
                    for p in partials:
                        bk = _block_rule(pol, seen, keep, tail, block_size, p)
                        if bk is not None:
                            shared[p] = (attention_output(ev, bk.mask), int(bk.mask.sum()), bk.blocks, bk.moved, True)
                    heads, ph_tokens, ph_bytes, ph_all = None, None, None, None
                    if per_head:
                        ph = pol.per_head_keep(seen)
                        ph = torch.cat([ph, tail.expand(*ph.shape[:2], -1)], -1)  # [L, Hkv, T]
                        if name == "threshold":  # the seed's store, scored through its own attention
                            heads = CSRStore.from_mask(obs.k, obs.v, ph).attention(ev.q, obs.sm_scale)
                        else:
                            heads = attention_output(ev, ph)
                        ph_tokens, ph_bytes = float(ph.float().sum(-1).mean()), _csr_bytes_by_layer(ph, D, kv_dtype)
                        ph_all = csr_nbytes(int(ph.sum()), L * H, D, kv_dtype)
                err_h = [None] * L if heads is None else relative_error(heads, full, (1, 2, 3)).tolist()
                err_h_all = None if heads is None else float(relative_error(heads, full, (0, 1, 2, 3)))
                for p, (out, tokens_kept, blocks, moved, frees) in shared.items():
                    err = relative_error(out, full, (1, 2, 3)).tolist()
                    kept_b = blocks * block_bytes if frees else blocks_full * block_bytes
                    base = {"prompt": prompt, "policy": name, "label": pol.label, "budget": 1.0 if b is None else b,
                            "partial": p, "held_out": held_out, "tokens": T, "tokens_kept": tokens_kept,
                            "blocks_full": blocks_full, "blocks_kept": blocks, "freed": blocks_full - blocks
                            if frees else 0, "moved": moved, "frees": frees, "tokens_per_head": ph_tokens}
                    for i_l in range(L):
                        rows.append({**base, "layer": layers[i_l], "bytes_full": blocks_full * block_bytes,
                                     "bytes_kept": kept_b, "error": err[i_l],
                                     "bytes_csr": None if ph_bytes is None else ph_bytes[i_l],
                                     "error_per_head": err_h[i_l]})
                    rows.append({**base, "layer": "all", "bytes_full": L * blocks_full * block_bytes,
                                 "bytes_kept": L * kept_b, "error": float(relative_error(out, full, (0, 1, 2, 3))),
                                 "bytes_csr": None if ph_bytes is None else ph_all,
                                 "error_per_head": err_h_all})
    return rows


def summarize(rows: Sequence[dict], by: Sequence[str] = ("policy", "budget", "partial", "held_out"),
              layer: object = "all") -> list[dict]:
    """Means over the other keys (prompts) of every numeric column, for rows of ``layer`` (None: all rows), one
    dict per distinct ``by`` tuple in first-seen order; ``n`` counts the rows averaged."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if layer is None or r["layer"] == layer:
            groups.setdefault(tuple(r[k] for k in by), []).append(r)
    out = []
    for key, rs in groups.items():
        d = dict(zip(by, key, strict=True))
        for col, x in rs[0].items():
            if col not in d and not isinstance(x, bool) and isinstance(x, int | float):
                vals = [r[col] for r in rs if r[col] is not None]
                d[col] = sum(vals) / len(vals) if vals else None
        d["n"] = len(rs)
        out.append(d)
    return out


# ---- the settings of notebook 07's sparsification panel --------------------------------------------------------
# (here, not in workbench.ui.compress_panels: the panel and the ``sparsification`` sweep score the same setting)
THRESHOLD_SCALE = 10  # the threshold policy's budget is its probability threshold: p = budget / 10
HELD_OUT = 8  # the last prompt tokens scored as decode steps the policy did not see


def threshold_of(budget: float) -> float:
    """The threshold policy's attention-probability threshold for a budget of the slider."""
    return round(budget / THRESHOLD_SCALE, 6)


def policy_options(name: str, block_size: int, sinks: int, window: int) -> dict:
    """The fields of policy ``name`` the panel sets: Quest's pages are the cache's blocks (its sink and newest
    pages fixed), StreamingLLM's recent part is what its budget leaves, the others take sinks and a window."""
    if name == "quest":
        return {"page_size": block_size}
    if name == "streaming":
        return {"sinks": sinks}
    return {"sinks": sinks, "window": window}


def score_rows(capture, name: str, budgets: Sequence[float], block_size: int, partial: str, sinks: int,
               window: int, held_out: int = HELD_OUT) -> list[dict]:
    """:func:`score_policies` of one policy on one capture, at the slider's ``budgets`` (the threshold policy at
    :func:`threshold_of` them), without the per-head masks: rows of every layer and ``"all"``, each with
    ``slider_budget``."""
    rows = score_policies([capture], [name], budgets, block_size, ["keep" if name == "quest" else partial],
                          held_out=held_out, thresholds=[threshold_of(b) for b in budgets],
                          options={name: policy_options(name, block_size, sinks, window)},
                          per_head=False)  # the panel draws the shared sets only: half the work
    per = len(rows) // len(budgets)  # score_policies' order: budget by budget, then its layers and "all"
    for i, r in enumerate(rows):
        r["slider_budget"] = budgets[i // per]
    return rows


def kept_tokens(capture, name: str, budget: float, block_size: int, partial: str, sinks: int, window: int,
                held_out: int = HELD_OUT) -> tuple[torch.Tensor, BlockKeep]:
    """What the scored setting keeps, as :func:`score_policies` applies it: the policy chooses on the prompt
    without its last ``held_out`` tokens, which are appended whole, and the block rule rounds (``keep``) or packs
    (``compact``) the set; Quest chooses whole pages for the last token's query. Returns ``(selected [T], block
    rule)``."""
    obs = Observation.from_capture(capture)
    over = policy_options(name, block_size, sinks, window)
    over["threshold" if name == "threshold" else "budget"] = threshold_of(budget) if name == "threshold" else budget
    pol = policies.get(name, **over)
    if pol.query_dependent:
        keep = pol.keep(obs)
        return keep, block_keep(keep, block_size, "keep")
    keep = torch.cat([pol.keep(obs.prefix(held_out)), torch.ones(held_out, dtype=torch.bool)])
    return keep, block_keep(keep, block_size, partial)


# ---- notebook 07's tables ---------------------------------------------------------------------------------------
def capture_named(captures: Sequence, name: str):
    """The capture of prompt ``name`` among ``captures``; ``ValueError`` listing their names otherwise."""
    for c in captures:
        if c.name == name:
            return c
    raise ValueError(f"name: expected one of {[c.name for c in captures]}, got {name!r}")


def describe_captures(captures: Sequence) -> str:
    """One line: how many prompts, each with its tokens, and the layers saved."""
    names = ", ".join(f"{c.name} {c.k.shape[1]}" for c in captures)
    return f"{len(captures)} prompts ({names} tokens), layers {captures[0].layers}"


def score_settings(captures: Sequence, names: Sequence[str], budgets: Sequence[float], block_size: int, sinks: int,
                   window: int, partial: Sequence[str] = PARTIAL, held_out: int = HELD_OUT) -> list[dict]:
    """:func:`score_policies` of each policy as the sparsification panel sets it (:func:`policy_options`; the
    threshold policy at :func:`threshold_of` the budgets) on every capture, decode-like (``held_out``), with
    ``memory``: blocks held (Quest: read a step) over the full cache's."""
    rows = score_policies(captures, names, budgets, block_size, partial, held_out=held_out,
                          thresholds=[threshold_of(b) for b in budgets],
                          options={n: policy_options(n, block_size, sinks, window) for n in names})
    for r in rows:
        r["memory"] = r["blocks_kept"] / r["blocks_full"]
    return rows


#: short titles of :func:`policy_table`'s columns, for ``run_files.print_table``
POLICY_TABLE_HEADERS = {"mem_keep": "keep: memory", "err_keep": "error", "mem_compact": "compact: memory",
                        "err_compact": "error", "moved": "tokens copied", "err_per_head": "per-head mask"}


def policy_table(mean: Sequence[dict], names: Sequence[str], budgets: Sequence[float]) -> list[dict]:
    """One row per policy and budget of :func:`summarize`'d :func:`score_settings` rows, both block rules side
    by side: ``policy, budget`` (a share, the threshold policy's ``p>=...``), ``mem_keep, err_keep, mem_compact,
    err_compact, moved`` (tokens compaction copies) and ``err_per_head`` (the per-head masks, compacted budget)."""
    table = []
    for name in names:
        for b in budgets:
            key = threshold_of(b) if name == "threshold" else b
            got = {r["partial"]: r for r in mean if r["policy"] == name and r["budget"] == key}
            table.append({"policy": name, "budget": f"p>={key:g}" if name == "threshold" else f"{b:.0%}",
                          "mem_keep": got["keep"]["memory"], "err_keep": got["keep"]["error"],
                          "mem_compact": got["compact"]["memory"], "err_compact": got["compact"]["error"],
                          "moved": got["compact"]["moved"], "err_per_head": got["compact"]["error_per_head"]})
    return table
