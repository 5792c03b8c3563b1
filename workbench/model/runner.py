"""Serving a :class:`~workbench.model.llama.Llama` through a K/V store: prefill, then decode token by token,
batched over sequences of different lengths, with prefix reuse and forked samples.

    runner = Runner(model, PagedKV(PagedKVCache(...)))
    out = runner.generate([prompt_a, prompt_b], max_new_tokens=32)

Prefill runs one prompt at a time: the store's cached prefix (``read_prefix``) is attended as context and only
the rest of the prompt is computed, in plain PyTorch attention; then ``add`` stores the prompt's K/V (the paged
cache skips the hit blocks). Decode runs all live sequences as one batch per step: ``begin`` reserves the new
tokens' slots, ``attend`` writes and attends per layer, ``commit`` publishes (``abort`` on any failure).
``n > 1`` forks each prompt after its prefill: the samples share its blocks (copy-on-write on the first
divergent write).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from workbench.core.backend import kernel_device_problem
from workbench.model.llama import Llama, causal_attention


@dataclass
class Generation:
    """What :meth:`Runner.generate` produced, per sequence id ``(prompt index, sample index)``."""

    prompts: list[list[int]]
    tokens: dict = field(default_factory=dict)  # seq_id -> new token ids
    logprobs: dict = field(default_factory=dict)  # seq_id -> log-prob of each chosen token (fp32 list)
    logits: dict = field(default_factory=dict)  # seq_id -> [steps, vocab] fp32 (keep_logits=True)
    prefix_hit_tokens: dict = field(default_factory=dict)  # prompt index -> prompt tokens reused from the cache

    def text(self, tokenizer, seq_id=(0, 0)) -> str:
        return tokenizer.decode(self.tokens[seq_id])


class Runner:
    """Prefill and batched decode of ``model`` with K/V in ``kv`` (a ``workbench.model.kv`` store).

    ``observe(event, runner, seq_ids)`` is called after every prefill (``"prefill"``) and decode step
    (``"step"``): a notebook draws the block table growing from it. ``capture(layer, q, k_pre, k, v)`` sees every
    layer's projections (prefill and decode), for activation studies."""

    def __init__(self, model: Llama, kv, *, observe: Callable | None = None, capture: Callable | None = None):
        if kv.num_layers != model.num_layers:
            raise ValueError(f"kv stores {kv.num_layers} layers, the model has {model.num_layers}")
        kv_device = getattr(kv, "device", None)
        if kv_device is not None and kernel_device_problem({"kv": kv_device, "model": model.device},
                                                           interpreted=True):  # one device (any: torch ops run)
            raise ValueError(f"kv keeps K/V on {kv_device} but the model computes on {model.device}: one device for "
                             f"both (Llama(..., device=cache.device)), so every tensor a kernel sees is on it")
        self.model, self.kv = model, kv
        self.observe, self.capture = observe, capture

    # ---- one prompt, one step ------------------------------------------------------
    @torch.no_grad()
    def prefill(self, seq_id, tokens: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Compute and store ``tokens``' K/V; returns ``(logits of the last token [vocab], reused prefix tokens)``."""
        m = self.model
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("tokens must hold at least one token id")
        if max(tokens) >= m.config.vocab_size or min(tokens) < 0:
            raise ValueError(f"tokens must be ids in [0, {m.config.vocab_size}), got {min(tokens)}..{max(tokens)}")
        _check_positions(m, "tokens", len(tokens))
        pk, pv = self.kv.read_prefix(tokens)
        hit = 0 if pk is None else pk.shape[1]
        ids = torch.tensor(tokens[hit:], device=m.device)
        pos = torch.arange(hit, len(tokens), device=m.device)
        x = m.embed_tokens(ids)
        ks, vs = [], []
        for layer in range(m.num_layers):
            q, k_pre, k, v = m.qkv(layer, x, pos)
            if self.capture:
                self.capture(layer, q, k_pre, k, v)
            if hit:
                k = torch.cat([pk[layer].to(m.device, k.dtype), k])
                v = torch.cat([pv[layer].to(m.device, v.dtype), v])
            ks.append(k)
            vs.append(v)
            x = m.finish_layer(layer, x, causal_attention(q, k, v, m.sm_scale))
        self.kv.add(seq_id, tokens, torch.stack(ks), torch.stack(vs))
        if self.observe:
            self.observe("prefill", self, [seq_id])
        return m.logits(x[-1:])[0], hit

    def add_prefilled(self, seq_id, prefilled) -> torch.Tensor:
        """Store a prefill made before (``workbench.model.quality.Prefilled``: its tokens, K/V and next-token
        logits) as :meth:`prefill` would have made it: prefill attends over fresh K/V, so it is the same whatever the
        store (a quantized cache stores the same K/V in its own format). Returns the logits."""
        self.kv.add(seq_id, prefilled.tokens, prefilled.k, prefilled.v)
        if self.observe:
            self.observe("prefill", self, [seq_id])
        return prefilled.logits

    @torch.no_grad()
    def step(self, seq_ids: Sequence, tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token to each sequence: returns next-token logits ``[B, vocab]`` fp32."""
        m = self.model
        seq_ids = list(seq_ids)
        ids = torch.tensor([int(t) for t in tokens], device=m.device)
        lens = [self.kv.num_tokens(s) for s in seq_ids]
        _check_positions(m, "seq_ids", max(lens, default=0) + 1)
        pos = torch.tensor(lens, device=m.device)
        x = m.embed_tokens(ids)
        step = self.kv.begin(seq_ids, ids.tolist())
        try:
            for layer in range(m.num_layers):
                q, k_pre, k, v = m.qkv(layer, x, pos)
                if self.capture:
                    self.capture(layer, q, k_pre, k, v)
                x = m.finish_layer(layer, x, self.kv.attend(step, layer, q, k, v, m.sm_scale))
            self.kv.commit(step)
        except BaseException:
            self.kv.abort(step)
            raise
        if self.observe:
            self.observe("step", self, seq_ids)
        return m.logits(x)

    # ---- generation ----------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, n: int = 1,
                 temperature: float = 0.0, seed: int = 0, stop_at_eos: bool = False, keep_logits: bool = False,
                 free: bool = True, progress: bool = False, prefilled: Sequence | None = None) -> Generation:
        """Greedy (``temperature=0``) or sampled generation of ``max_new_tokens`` per sequence; ``n`` samples
        per prompt (forked after the prefill). Sequence ids are ``(prompt index, sample index)``; ``free=False``
        keeps them in the store (to look at its blocks afterwards). ``prefilled``: per prompt, its prefill made
        before (``workbench.model.quality.prefill_all``; stored with :meth:`add_prefilled`, no prefix reuse), or
        None to prefill it here."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int (samples per prompt), got {n!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts:
            raise ValueError("prompts must hold at least one prompt")
        if prefilled is not None and (len(prefilled) != len(prompts) or any(
                pre is not None and list(pre.tokens) != p for pre, p in zip(prefilled, prompts, strict=False))):
            raise ValueError("prefilled must hold, for each prompt, None or a prefill of exactly its tokens")
        _check_positions(self.model, "prompts and max_new_tokens", max(map(len, prompts)) + max_new_tokens - 1)
        g = torch.Generator(device="cpu").manual_seed(seed)
        out = Generation(prompts)
        nxt, live = {}, []
        for i, p in enumerate(prompts):
            if prefilled is not None and prefilled[i] is not None:
                logits, hit = self.add_prefilled((i, 0), prefilled[i]), 0
            else:
                logits, hit = self.prefill((i, 0), p)
            out.prefix_hit_tokens[i] = hit
            for j in range(1, n):
                self.kv.fork((i, 0), (i, j))
            for j in range(n):
                s = (i, j)
                live.append(s)
                out.tokens[s], out.logprobs[s] = [], []
                if keep_logits:
                    out.logits[s] = []
                nxt[s] = self._choose(s, logits, temperature, g, out, keep_logits)
        steps = range(max_new_tokens - 1)
        if progress:
            steps = tqdm(steps, desc=f"decode ({len(live)} sequences)", unit="step")
        for _ in steps:
            if stop_at_eos:
                live = [s for s in live if out.tokens[s][-1] != self.model.config.eos_token_id]
            if not live:
                break
            logits = self.step(live, [nxt[s] for s in live])
            for b, s in enumerate(live):
                nxt[s] = self._choose(s, logits[b], temperature, g, out, keep_logits)
        if free:
            for s in out.tokens:
                self.kv.free(s)
        return out

    @staticmethod
    def _choose(s, logits: torch.Tensor, temperature: float, g, out: Generation, keep: bool) -> int:
        logits = logits.float().cpu()
        logp = torch.log_softmax(logits, -1)
        if temperature == 0:
            t = int(logits.argmax())
        else:
            t = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))
        out.tokens[s].append(t)
        out.logprobs[s].append(float(logp[t]))
        if keep:
            out.logits[s].append(logits)
        return t


def _check_positions(model, name: str, n: int) -> None:
    """``n`` positions fit the model's RoPE table (``max_position_embeddings``): checked on the host before anything
    is stored (past it, the table's gather fails on the device, and on a GPU that ends the process's CUDA context)."""
    if n > model.config.max_position_embeddings:
        raise ValueError(f"{name}: {n} positions pass the model's max_position_embeddings "
                         f"{model.config.max_position_embeddings} (its RoPE table)")
