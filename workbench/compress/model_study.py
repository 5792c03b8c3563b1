"""Eviction on the real SmolLM2-135M: ``python -m workbench bench compression_model [--smoke] [--out data/results]``
(``workbench.bench.compression_model``).

For each prompt (``workbench.model.capture.PROMPTS``) the model (fp32, CPU, a ``PagedKVCache`` with
``ops="torch"``) prefills once; the prompt's K/V and its last ``obs_window`` queries are then stored under every
(policy, budget, partial) configuration as its own sequence of one :class:`~workbench.compress.evicting_kv.
EvictingKV` (evicted at once), beside a full-cache sequence (policy ``full``, the reference). All of them decode as
one batch, teacher-forced: every step feeds each sequence the full cache's greedy token, so the reference
continuation is the same for all. Scored: the ``new_tokens - 1`` tokens after the first (the first comes from the
prefill, before any eviction), per row

- ``agreement``: the share of positions where the evicted cache's argmax is the reference token;
- ``mean_abs_drift`` / ``max_abs_drift``: ``|log p_full(t) - log p_evicted(t)|`` of the reference tokens;
- ``mean_kl``: KL(full || evicted) of the next-token distributions, nats;
- ``perplexity`` of the reference continuation under the evicted cache (``ref_perplexity``: under the full one);
- memory: ``kept_tokens`` of the prompt, ``blocks_kept`` / ``blocks_full`` and ``bytes_kept`` / ``bytes_full`` held
  after the eviction (every layer, K and V, padding included), ``memory_kept`` their ratio, ``tokens_moved`` by
  compaction.

Budgets are shares of the prompt (``policies.resolve_budget``); ``threshold``'s budget is its probability
threshold. ``quest`` chooses pages per query and frees none by design, so it is not run unless named. Rows are
tidy (one per prompt x configuration); ``summary`` in the file averages them over prompts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from workbench.cache import PagedKVCache
from workbench.compress import policies
from workbench.compress.block_keep import PARTIAL
from workbench.compress.evicting_kv import EvictingKV
from workbench.model.capture import PROMPTS, prompt_tokens
from workbench.model.runner import Runner

DEFAULT_POLICIES = ("streaming", "h2o", "snapkv", "threshold")
DEFAULT_BUDGETS = (0.1, 0.25, 0.5)
DEFAULT_THRESHOLDS = (0.02, 0.005)
PARTIALS = PARTIAL  # both partial-block rules
# overrides of the registry's defaults: H2O's paper splits the budget half heavy hitters, half recent; SnapKV
# always keeps its observation window (16)
OVERRIDES = {"h2o": {"window": 0.5}, "snapkv": {"window": 16}}
PAGE_TOKENS = 16
COLUMNS = ["prompt", "policy", "budget", "partial", "kept_tokens", "blocks_kept", "blocks_full", "memory_kept",
           "tokens_moved", "agreement", "mean_abs_drift", "max_abs_drift", "mean_kl", "perplexity", "ref_perplexity"]
SUMMARY_COLUMNS = ["policy", "budget", "partial", "prompts", "kept_share", "memory_kept", "agreement",
                   "mean_abs_drift", "mean_kl", "perplexity", "ref_perplexity"]
HEADERS = {"kept_tokens": "kept", "blocks_kept": "blk", "blocks_full": "blk_full", "memory_kept": "mem",
           "tokens_moved": "moved", "agreement": "agree", "mean_abs_drift": "|drift|", "max_abs_drift": "max|drift|",
           "mean_kl": "KL", "perplexity": "ppl", "ref_perplexity": "ppl_full", "kept_share": "kept"}


@dataclass(frozen=True)
class Config:
    """One evicting configuration: a policy name, its budget (a share of the prompt; a threshold for
    ``threshold``) and the partial-block mode."""

    policy: str
    budget: float
    partial: str

    def build(self):
        if self.policy == "threshold":
            return policies.get("threshold", threshold=self.budget)
        return policies.get(self.policy, budget=self.budget, **OVERRIDES.get(self.policy, {}))


def configs(names=DEFAULT_POLICIES, budgets=DEFAULT_BUDGETS, thresholds=DEFAULT_THRESHOLDS,
            partials=PARTIALS) -> list[Config]:
    """Every (policy, budget, partial): ``budgets`` for the budgeted policies, ``thresholds`` for ``threshold``."""
    out = []
    for name in names:
        if name not in policies.NAMES or name == "full":
            raise ValueError(f"policy names must be among {tuple(n for n in policies.NAMES if n != 'full')} (full "
                             f"is the reference, always run), got {name!r}")
        for b in thresholds if name == "threshold" else budgets:
            out += [Config(name, float(b), p) for p in partials]
    for c in out:
        c.build()  # validates the budget now, not after the prefill
    return out


def _cache(model, num_pages: int, kv_dtype: str, page_tokens: int):
    cfg = model.config
    return PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_pages,
                        page_tokens=page_tokens, kv_dtype=kv_dtype, device="cpu", ops="torch",
                        prefix_caching=False)  # each configuration is its own copy of the prompt


@torch.no_grad()
def study_prompt(model, tokens: list[int], cfgs: list[Config], *, new_tokens: int = 32, kv_dtype: str = "fp32",
                 page_tokens: int = PAGE_TOKENS, obs_window: int = 32, every: int | None = None,
                 name: str = "") -> list[dict]:
    """The rows of one prompt (see the module docstring): the reference (``policy="full"``) first."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (the first token comes before any eviction), got {new_tokens}")
    T = len(tokens)
    per_seq = -(-(T + new_tokens) // page_tokens)
    cache = _cache(model, per_seq * (len(cfgs) + 1) + 1, kv_dtype, page_tokens)
    kv = EvictingKV(cache, policies.get("full"), obs_window=obs_window, every=every, sm_scale=model.sm_scale)
    got: dict[int, tuple] = {}

    def hook(layer, q, k_pre, k, v):
        if not kv.decoding:  # the prefill: keep the prompt's projections to store them again
            got[layer] = (q[-obs_window:], k, v)
        kv.capture(layer, q, k_pre, k, v)

    runner = Runner(model, kv, capture=hook)
    t0 = time.perf_counter()
    first, _ = runner.prefill("full", tokens)
    q, k, v = (torch.stack([got[i][j] for i in range(model.num_layers)]) for j in range(3))
    ids = ["full", *range(len(cfgs))]
    for i, c in enumerate(cfgs):
        kv.assign(i, c.build(), partial=c.partial)
        kv.add(i, tokens, k, v, queries=q)
    after = {s: len(cache.manager.block_table(s)) for s in ids}
    moved = {r.seq_id: r.tokens_moved for r in kv.reports}
    logits = {s: [] for s in ids}
    ref = [int(first.argmax())]
    for _ in range(new_tokens - 1):
        out = runner.step(ids, [ref[-1]] * len(ids))
        for b, s in enumerate(ids):
            logits[s].append(out[b].float())
        ref.append(int(out[0].argmax()))
    seconds = time.perf_counter() - t0
    target = torch.tensor(ref[1:])  # [new_tokens - 1] scored tokens
    lp_full = torch.stack(logits["full"]).log_softmax(-1)  # [N - 1, vocab]
    block_bytes = 2 * cache.num_layers * cache.block_stride(page_tokens) * cache.dtype.itemsize
    rows = []
    for s in ids:
        c = Config("full", 1.0, "-") if s == "full" else cfgs[s]
        lp = torch.stack(logits[s]).log_softmax(-1)
        lt, lt_full = lp.gather(1, target[:, None])[:, 0], lp_full.gather(1, target[:, None])[:, 0]
        drift = (lt - lt_full).abs()
        kl = (lp_full.exp() * (lp_full - lp)).sum(-1)
        agree = lp.argmax(-1) == target
        kept = T - (kv.evicted_tokens(s) if s != "full" else 0)
        rows.append({
            "prompt": name, "prompt_tokens": T, "policy": c.policy, "label": c.build().label if s != "full" else
            "full cache", "budget": c.budget, "partial": c.partial, "kept_tokens": kept,
            "blocks_kept": after[s], "blocks_full": after["full"], "bytes_kept": after[s] * block_bytes,
            "bytes_full": after["full"] * block_bytes, "memory_kept": after[s] / after["full"],
            "tokens_moved": moved.get(s, 0), "scored_tokens": len(ref) - 1, "agreement": float(agree.float().mean()),
            "first_divergence": int(agree.logical_not().nonzero()[0, 0]) + 1 if not bool(agree.all()) else None,
            "mean_abs_drift": float(drift.mean()), "max_abs_drift": float(drift.max()), "mean_kl": float(kl.mean()),
            "perplexity": math.exp(-float(lt.mean())), "ref_perplexity": math.exp(-float(lt_full.mean())),
            "kv_dtype": kv_dtype, "page_tokens": page_tokens, "obs_window": obs_window, "every": every,
            "seconds": seconds,
        })
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (policy, budget, partial): means over prompts (``kept_share`` = kept tokens / prompt tokens)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["budget"], r["partial"]), []).append(r)
    mean = lambda g, key: sum(r[key] for r in g) / len(g)  # noqa: E731
    return [{"policy": p, "budget": b, "partial": part, "prompts": len(g),
             "kept_share": sum(r["kept_tokens"] / r["prompt_tokens"] for r in g) / len(g),
             **{k: mean(g, k) for k in ("memory_kept", "agreement", "mean_abs_drift", "max_abs_drift", "mean_kl",
                                        "perplexity", "ref_perplexity")}}
            for (p, b, part), g in groups.items()]


def run(model, tok, *, prompts: int | None = None, max_prompt_tokens: int | None = None, progress=None,
        **kw) -> list[dict]:
    """:func:`study_prompt` over the first ``prompts`` of ``capture.PROMPTS`` (each cut to ``max_prompt_tokens``)."""
    rows = []
    for i, p in enumerate(PROMPTS[:prompts]):
        tokens = prompt_tokens(tok, p)[:max_prompt_tokens]
        rows += study_prompt(model, tokens, name=p.name, **kw)
        if progress:
            progress(i, p.name, len(tokens))
    return rows
