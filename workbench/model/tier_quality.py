"""What a lossy tier costs the real model (issue 34): a long prompt whose prefix was demoted to a host tier in
another format (``TieredCache(host_format=...)``) and promoted back, then decoded, against the same run through a
lossless tier (fp16: the device's own bytes go down and come back).

It goes through the real :class:`~workbench.tiers.TieredCache`, not a simulation of it. Per format, an fp16
:class:`~workbench.cache.PagedKVCache` (prefix caching on, the torch ops) under a TieredCache in that format:

1. each prompt's K/V, prefilled once with fresh K/V (:func:`workbench.model.quality.prefill_all`), is added as a
   warm sequence, freed (its full blocks stay as cached prefix blocks) and evicted: demoted to the host, transcoded
   on the way into the format;
2. the :class:`~workbench.model.runner.Runner` prefills the prompt again through :class:`TierKV`, whose
   ``read_prefix`` promotes the prefix from the host (transcoded back: the format's roundtrip of the values); the
   rest of the prompt (from the block holding its last token) is computed attending over that prefix;
3. two sequences decode from there in one batch: one teacher-forced on the text that follows the prompt (log-probs
   and next-token distributions), one greedy (its tokens).

Every row compares with the first format's run (``fp16``: a lossless tier, so the all-fp16 run through the same
path; its own row is exact by construction): greedy ``agreement`` and ``first_divergence``, and on the forced text
``perplexity`` (``ref_perplexity``: fp16's), log-prob drift and KL(fp16 || format)
(:func:`workbench.model.quality.compare`). Scored: each prompt's ``new_tokens`` next tokens, the prefill's
prediction included (its tail attended over the promoted prefix). ``roundtrip_equal``: the promoted prefix's K/V
equal :func:`workbench.tiers.formats.roundtrip_values` of what was demoted, value for value.

Unlike ``bench model_quality``'s per-scheme rows (the whole cache in a scheme, every step reading it), only the
prompt's prefix is rounded, once; the tail, the new tokens' K/V and everything the decode writes stay fp16.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workbench.cache import PagedKVCache
from workbench.model import quality
from workbench.model.kv import PagedKV
from workbench.model.runner import Runner
from workbench.quant.names import TIER_FORMATS
from workbench.tiers import TieredCache, formats

PAGE_TOKENS = quality.PAGE_TOKENS  # 32: int4/kivi's 32-token key groups tile a block
PROMPT_TOKENS, NEW_TOKENS, PROMPTS = 1024, 32, 4  # evaluate_tiers' defaults (bench model_quality --sections tiers)
HOW = ("through TieredCache(host_format=...): each prompt's prefix blocks demoted (transcoded on the way down), "
       "promoted back by the runner's prefill (read_prefix), the rest of the prompt computed over them, then a "
       "teacher-forced and a greedy sequence decoded; against the same through the fp16 tier")


class TierKV(PagedKV):
    """A runner's K/V in a :class:`~workbench.tiers.TieredCache`'s device cache: a prompt's prefix found below the
    device is promoted before it is read (``read_prefix``); adds, forks and frees keep the tiers' bookkeeping."""

    def __init__(self, tiered: TieredCache, q_dtype: torch.dtype | None = None):
        if not isinstance(tiered, TieredCache):
            raise ValueError(f"tiered must be a TieredCache, got {type(tiered).__name__}")
        super().__init__(tiered.cache, q_dtype)
        self.tiered = tiered

    def read_prefix(self, tokens: Sequence[int]):
        k, v = self.tiered.read_prefix(tokens)
        return (k, v) if k.shape[1] else (None, None)

    def add(self, seq_id, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        self.tiered.add(seq_id, tokens, k, v)

    def fork(self, parent, child) -> None:
        self.tiered.fork(parent, child)

    def free(self, seq_id) -> None:
        self.tiered.free(seq_id)


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def windows(text_tokens: Sequence[int], n: int, prompt_tokens: int, new_tokens: int) -> list[list[int]]:
    """``n`` windows of ``prompt_tokens + new_tokens`` tokens from evenly spaced places of the text (a prompt and
    the text that follows it)."""
    for name, v in (("n", n), ("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        _positive(name, v)
    toks, length = [int(t) for t in text_tokens], prompt_tokens + new_tokens
    if len(toks) < length:
        raise ValueError(f"text_tokens must hold prompt_tokens + new_tokens = {length} tokens, got {len(toks)}")
    step = (len(toks) - length) // max(n - 1, 1)
    return [toks[i * step:i * step + length] for i in range(n)]


def device_blocks(cache: PagedKVCache, bs: int, ids: Sequence[int]) -> torch.Tensor:
    """Device blocks ``ids`` as a tier's mover gathers them: ``[n, block bytes]`` (each layer's K row, V row)."""
    blk = cache.blocks(bs)[:, :, list(ids)]  # [L, 2, n, stride]
    return blk.permute(2, 0, 1, 3).contiguous().view(torch.uint8).reshape(len(ids), -1)


@dataclass(frozen=True)
class TierRun:
    """One format's run: ``forced`` (log-probs and distributions of every scored token, prompt by prompt),
    ``greedy`` (each prompt's new tokens), ``prefix_tokens`` (each prompt's tokens promoted from the host),
    ``roundtrip_equal``, ``lossy`` (the tier's mark on the sequences), ``block_bytes`` (a block in the format;
    ``device_block_bytes``: in fp16), ``stats`` (the TieredCache's)."""

    host_format: str
    forced: quality.Forced
    greedy: list[list[int]]
    prefix_tokens: list[int]
    roundtrip_equal: bool
    lossy: bool
    block_bytes: int
    device_block_bytes: int
    stats: dict


def tier_run(model, wins: Sequence[Sequence[int]], prompt_tokens: int, host_format,
             prefilled: list[quality.Prefilled] | None = None, page_tokens: int = PAGE_TOKENS) -> TierRun:
    """Steps 1-3 of the module docstring for each window of ``wins`` (its first ``prompt_tokens`` the prompt, the
    rest the text that follows), through a TieredCache with ``host_format``; ``prefilled``: the prompts'
    :func:`~workbench.model.quality.prefill_all`, if already made."""
    if isinstance(wins, (str, bytes)) or not isinstance(wins, Sequence) or not wins:
        raise ValueError("wins must be a non-empty list of token-id lists")
    wins = [[int(t) for t in w] for w in wins]
    _positive("prompt_tokens", prompt_tokens)
    _positive("page_tokens", page_tokens)
    if any(len(w) < prompt_tokens + 1 for w in wins):
        raise ValueError(f"each window must hold prompt_tokens={prompt_tokens} and at least one more token")
    prompts = [w[:prompt_tokens] for w in wins]
    pre = prefilled if prefilled is not None else quality.prefill_all(model, prompts)
    if [p.tokens for p in pre] != prompts:
        raise ValueError("prefilled must be prefill_all of the windows' prompts")
    cfg, bs = model.config, page_tokens
    span = max(len(w) for w in wins)
    pages = len(wins) * (2 * -(-span // bs) + 2)  # each prompt, its forced and greedy continuations, spare
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, pages, page_tokens=bs,
                         kv_dtype=quality.REFERENCE, device=model.device, ops="torch")
    fp16_block = formats.block_bytes(cache, formats.DEVICE, bs)
    tc = TieredCache(cache, host_bytes=(len(wins) * -(-prompt_tokens // bs) + 1) * fp16_block,
                     host_format=host_format, fsync=False, path="dma")  # dma: on a CPU, torch's indexing
    try:
        want = []  # per prompt: the format's roundtrip of the blocks that come back, K then V [L, tokens, H, D]
        for i, p in enumerate(pre):
            tc.add(("warm", i), p.tokens, p.k, p.v)
            eligible = (len(p.tokens) - 1) // bs  # the block with the last prompt token is never a prefix hit
            table = cache.manager.block_table(("warm", i))[:eligible]
            want.append(formats.roundtrip_values(cache, tc.format, bs, device_blocks(cache, bs, table)))
        for i in range(len(pre)):
            tc.free(("warm", i))
        tc.evict()  # every cached prefix block goes down, transcoded
        runner = Runner(model, TierKV(tc))
        forced, greedy, hits, same = _decode(runner, cache, wins, prompt_tokens, want)
        lossy = all(tc.is_lossy(s) for i in range(len(wins)) for s in (("f", i), ("g", i)))
        stats = tc.stats()
    finally:
        tc.close()
    return TierRun(str(host_format), quality.Forced(str(host_format), *forced), greedy, hits, same, lossy,
                   formats.block_bytes(cache, tc.format, bs), fp16_block, stats)


def _decode(runner: Runner, cache, wins, prompt_tokens: int, want) -> tuple:
    """Prefill each prompt (its prefix promoted), fork a greedy twin, step both ``len(w) - prompt_tokens - 1``
    times in one batch. Returns ((logprobs [N], logdist [N, vocab]), greedy tokens, hit tokens, roundtrip_equal)."""
    first, hits, same = [], [], True
    for i, w in enumerate(wins):
        logits, hit = runner.prefill(("f", i), w[:prompt_tokens])
        k, v = cache.read(("f", i))
        ref = want[i]  # [n, L, 2, bs, H, D]
        ref_k, ref_v = (ref[:, :, kind].permute(1, 0, 2, 3, 4).reshape(k.shape[0], -1, *k.shape[2:])
                        for kind in (0, 1))
        same = same and hit == ref_k.shape[1] and torch.equal(k[:, :hit], ref_k) and torch.equal(v[:, :hit], ref_v)
        runner.kv.fork(("f", i), ("g", i))
        hits.append(hit)
        first.append(torch.log_softmax(logits.float().cpu(), -1))
    steps = min(len(w) for w in wins) - prompt_tokens - 1
    greedy = [[int(d.argmax())] for d in first]
    dists = [[d] for d in first]  # per prompt: the forced sequence's next-token log-distributions
    ids = [s for i in range(len(wins)) for s in (("f", i), ("g", i))]
    for t in range(steps):
        toks = [x for i, w in enumerate(wins) for x in (w[prompt_tokens + t], greedy[i][-1])]
        out = torch.log_softmax(runner.step(ids, toks).float().cpu(), -1)
        for i in range(len(wins)):
            dists[i].append(out[2 * i])
            greedy[i].append(int(out[2 * i + 1].argmax()))
    logdist = torch.stack([d for ds in dists for d in ds])  # [N, vocab]
    nxt = torch.tensor([x for w in wins for x in w[prompt_tokens:prompt_tokens + steps + 1]])
    return (logdist.gather(-1, nxt[:, None])[:, 0], logdist), greedy, hits, same


def agreement(got: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> dict:
    """Greedy tokens against the reference's, prompt by prompt: the share equal position by position and the
    tokens before the first difference (the length when none)."""
    if len(got) != len(ref) or any(len(g) != len(r) or not r for g, r in zip(got, ref, strict=False)):
        raise ValueError("got and ref must hold the same number of non-empty token lists of equal lengths")
    first = [next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), len(r))
             for g, r in zip(got, ref, strict=True)]
    same = sum(a == b for g, r in zip(got, ref, strict=True) for a, b in zip(g, r, strict=True))
    return {"agreement": same / sum(len(r) for r in ref), "first_divergence_mean": sum(first) / len(first),
            "first_divergence_min": min(first)}


def evaluate_tiers(model, text_tokens: Sequence[int], *, host_formats: Sequence[str] = TIER_FORMATS,
                   prompts: int = PROMPTS, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS,
                   page_tokens: int = PAGE_TOKENS, progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per host format (the first, fp16 by default, is the reference every row compares with): ``prompts``
    windows of the text, each a ``prompt_tokens`` prompt and ``new_tokens`` scored tokens after it (see the module
    docstring). ``progress(name)`` is called before each format."""
    names = [str(f) for f in host_formats] if not isinstance(host_formats, str) else [host_formats]
    if not names:
        raise ValueError("host_formats must name at least one format")
    wins = windows(text_tokens, prompts, prompt_tokens, new_tokens)
    if prompt_tokens <= page_tokens:
        raise ValueError(f"prompt_tokens must exceed page_tokens={page_tokens} (a prefix of at least one full block "
                         f"to demote), got {prompt_tokens}")
    pre = quality.prefill_all(model, [w[:prompt_tokens] for w in wins])
    cfg = model.config
    rows, ref = [], None
    for name in names:
        if progress:
            progress(name)
        t0 = time.perf_counter()
        run = tier_run(model, wins, prompt_tokens, name, prefilled=pre, page_tokens=page_tokens)
        ref = run if ref is None else ref
        tf = quality.compare(run.forced, ref.forced).summary()
        per_token = run.block_bytes / page_tokens / cfg.num_hidden_layers  # one layer's K and V, as the scheme rows
        rows.append({"section": "tier", "host_format": name, "reference": names[0], "lossy": run.lossy,
                     "bytes_per_token": per_token, "fp16_bytes_fraction": run.block_bytes / run.device_block_bytes,
                     "prompt_tokens": prompt_tokens, "prefix_tokens": min(run.prefix_tokens),
                     "page_tokens": page_tokens, **agreement(run.greedy, ref.greedy),
                     **{k: v for k, v in tf.items() if k != "scheme"}, "roundtrip_equal": run.roundtrip_equal,
                     "promoted_blocks": run.stats["promoted_host"], "seconds": time.perf_counter() - t0})
    return rows
