"""Quantized K/V caches against the fp16 cache on real text (issue 12): SmolLM2-135M decodes through a
:class:`~workbench.cache.PagedKVCache` of each scheme (``workbench.quant.SCHEMES``) and through an fp16 one.

- :func:`agreement`: greedy generation from the same prompts: the fraction of new tokens that are equal, and
  how many tokens pass before the first divergence.
- :func:`teacher_forced`: the text fed token by token through :meth:`Runner.step`, chunks of it batched as
  sequences: the log-prob of every next text token under both caches, hence perplexity, per-token log-prob
  drift and KL(fp16 || scheme) of the next-token distributions.
- :func:`evaluate_all`: one row per scheme, with its stored bytes per token, for memory-vs-quality plots.

What the numbers measure: prefill attends over the prompt's fresh K/V (as serving engines do), so only decode
steps read the quantized cache. Each chunk of ``chunk`` tokens is prefilled with its first ``prefill`` tokens
(written to the cache, quantized) and the rest are stepped and scored: a scored token attends over a quantized
context of ``prefill`` tokens or more. A short ``prefill`` measures a context the cache built itself (errors
compound through the layers' K/V); a long one, a long prompt then a short answer, the usual serving case, with
far fewer decode steps (each costs 0.3-1 s on a CPU with the torch ops). KIVI schemes keep the newest 128 tokens
(and an unfinished 32-token key group) in fp16, so they quantize nothing until a sequence is past 160 tokens.
A prefill is the same under every cache, so it is computed once (:func:`prefill_all`) and its K/V added to each
scheme's cache, exactly as :meth:`Runner.prefill` would add it.

Greedy agreement is a blunt measure: one near-tie in a prompt flips under any perturbation, and after the first
divergence the texts differ. Drift and KL on the same teacher-forced tokens rank schemes more steadily.

Static schemes (fp8 / int8 per ``tensor`` or ``head``) take their scales from a calibration pass
(:class:`~workbench.quant.Calibrator` over every layer's K/V of a calibration text), per cache or per layer
(``per_layer_scales``). Per cache, ONE ``k_scale`` and ONE ``v_scale`` (a scalar, or one per kv head) serve all
layers, so the scale fits the layer of widest range and layers of narrower range use only part of the codes
(:meth:`KVSample.layer_amax` shows how far the layers differ: SmolLM2's largest ``|V|`` spans 22x); per layer, each
layer's pair fits its own range. :func:`evaluate_all` gives a row of each (``scales``: ``"cache"`` / ``"layer"``).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import workbench.model as wm
from workbench import quant
from workbench.cache import PagedKVCache
from workbench.model.kv import PagedKV
from workbench.model.runner import Runner

TEXT_DIR = Path(__file__).resolve().parents[2] / "data" / "text"
EVAL_TEXTS = ("declaration_of_independence.txt", "pride_and_prejudice_ch1.txt")
CALIBRATION_TEXT = "gettysburg_address.txt"  # another text than the evaluated one: scales are fixed ahead
REFERENCE = "fp16"
PAGE_TOKENS = 32  # a multiple of KIVI's 32-token key group, as its blocks need
# evaluate_all's defaults: 8 chunks of 288 tokens, 256 prefilled (KIVI then holds 128 of them quantized), 31
# stepped and scored each; on 2 CPU cores the torch ops' decode costs 0.3-1 s a step, so steps are what we spend
CHUNK, PREFILL, BATCH = 288, 256, 8
SCALES_BY = ("cache", "layer")  # a static scheme's scales: one pair for all layers, or one pair per layer


@functools.lru_cache(maxsize=1)
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M (fp32 on the CPU), loaded once per process (about 10 s)."""
    return wm.load_smollm2()


def load_text(names: Sequence[str] = EVAL_TEXTS) -> str:
    """The shipped public-domain texts ``names`` (files of ``data/text``), joined by blank lines."""
    return "\n\n".join((TEXT_DIR / n).read_text(encoding="utf-8").strip() for n in names)


def get_scheme(scheme) -> quant.Scheme:
    """A :class:`~workbench.quant.Scheme` or a name of ``quant.SCHEMES`` (or an alias); ValueError otherwise."""
    if isinstance(scheme, quant.Scheme):
        return scheme
    if isinstance(scheme, str) and (scheme in quant.SCHEMES or scheme in quant.ALIASES):
        return quant.get(scheme)
    raise ValueError(f"scheme must be one of workbench.quant.SCHEMES {sorted(quant.SCHEMES)}, got {scheme!r}")


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _token_lists(name: str, seqs) -> list[list[int]]:
    if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence) or not seqs:
        raise ValueError(f"{name} must be a non-empty list of token-id lists")
    out = [[int(t) for t in s] for s in seqs]
    if not all(out):
        raise ValueError(f"{name} must not hold an empty token list")
    return out


# ---- prefill once ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prefilled:
    """A prompt's prefill: ``k`` (after RoPE: what a cache stores) and ``v`` ``[L, T, H, D]`` of every layer, and
    the next-token ``logits`` ``[vocab]``. Prefill attends over fresh K/V, so it is the same under every cache:
    computed once, it is added to each scheme's cache (``PagedKVCache.add``, as :meth:`Runner.prefill` does)."""

    tokens: list[int]
    k: torch.Tensor
    v: torch.Tensor
    logits: torch.Tensor


class _Recorder:
    """A K/V store that only keeps what :meth:`Runner.prefill` adds."""

    def __init__(self, num_layers: int):
        self.num_layers, self.kv = num_layers, {}

    def read_prefix(self, tokens):
        return None, None

    def add(self, seq_id, tokens, k, v) -> None:
        self.kv[seq_id] = (k, v)


def prefill_all(model, seqs) -> list[Prefilled]:
    """:class:`Prefilled` of each token list of ``seqs`` (one plain prefill each, nothing quantized)."""
    store = _Recorder(model.num_layers)
    runner, out = Runner(model, store), []
    for i, toks in enumerate(_token_lists("seqs", seqs)):
        logits, _ = runner.prefill(i, toks)
        k, v = store.kv.pop(i)
        out.append(Prefilled(toks, k, v, logits.float()))
    return out


def _start(model, scheme, prefilled: list[Prefilled], extra: int, calibration, ops: str,
           per_layer_scales: bool = False) -> Runner:
    """A runner over a fresh ``scheme`` cache holding ``prefilled`` as sequences 0, 1, ... (room for ``extra``
    more tokens each)."""
    cache = build_cache(model, scheme, [len(p.tokens) + extra for p in prefilled], calibration=calibration, ops=ops,
                        per_layer_scales=per_layer_scales)
    for i, p in enumerate(prefilled):
        cache.add(i, p.tokens, p.k, p.v)
    return Runner(model, PagedKV(cache))


# ---- calibration ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVSample:
    """Every layer's K (after RoPE: what the cache stores) and V over a calibration text, fp32 ``[L, T, H, D]``."""

    k: torch.Tensor
    v: torch.Tensor

    def layer_amax(self) -> dict[str, list[float]]:
        """Per layer, the largest |K| and |V| (the one shared static scale must cover the largest)."""
        return {n: t.abs().amax(dim=(1, 2, 3)).tolist() for n, t in (("k", self.k), ("v", self.v))}


def capture_kv(model, tokens: Sequence[int]) -> KVSample:
    """Every layer's K/V over ``tokens`` (one plain prefill)."""
    p = prefill_all(model, [tokens])[0]
    return KVSample(p.k.float().cpu(), p.v.float().cpu())


def static_scales(scheme, sample: KVSample, margin: float = 1.0, *,
                  per_layer: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_scale, v_scale)`` of a static scheme from ``sample``: one pair for ALL layers (``[1]`` or ``[H]``), or
    with ``per_layer`` one per layer (``[L]`` or ``[L, H]``)."""
    if not isinstance(per_layer, bool):
        raise ValueError(f"per_layer must be True or False, got {per_layer!r}")
    cal = quant.Calibrator(get_scheme(scheme), margin, num_layers=sample.k.shape[0] if per_layer else None)
    cal.observe(sample.k, sample.v)  # [L, T, H, D]: each layer's maximum, or the maximum over every layer
    return cal.scales()


def build_cache(model, scheme, seq_lens: Sequence[int], *, calibration: KVSample | None = None,
                page_tokens: int = PAGE_TOKENS, ops: str = "torch", per_layer_scales: bool = False) -> PagedKVCache:
    """A cache of ``scheme`` just big enough for sequences of ``seq_lens`` tokens (the torch ops dequantize the
    whole pool every layer, so spare pages cost time); static schemes are calibrated on ``calibration``, one pair of
    scales for all layers or (``per_layer_scales``) one per layer."""
    s, cfg = get_scheme(scheme), model.config
    kw = {}
    if s.needs_static_scales:
        if not isinstance(calibration, KVSample):
            raise ValueError(f"calibration must be a KVSample (capture_kv of a calibration text) for {s.name}, "
                             f"whose scales are static")
        kw["k_scale"], kw["v_scale"] = static_scales(s, calibration, per_layer=per_layer_scales)
    pages = sum(-(-n // page_tokens) for n in seq_lens)
    return PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max(pages, 1),
                        page_tokens=page_tokens, kv_dtype=s, device=model.device, ops=ops, prefix_caching=False,
                        **kw)


# ---- greedy agreement ---------------------------------------------------------------------------------------------
def generate(model, prompts, scheme, new_tokens: int, *, calibration: KVSample | None = None,
             prefilled: list[Prefilled] | None = None, ops: str = "torch",
             per_layer_scales: bool = False) -> list[list[int]]:
    """Greedy ``new_tokens`` for each prompt (one batch) with K/V in a ``scheme`` cache, as
    :meth:`Runner.generate` makes them; ``prefilled``: the prompts' :func:`prefill_all`, if already made."""
    _positive("new_tokens", new_tokens)
    pre = prefilled if prefilled is not None else prefill_all(model, prompts)
    runner = _start(model, scheme, pre, new_tokens, calibration, ops, per_layer_scales)
    ids = list(range(len(pre)))
    out = [[int(p.logits.argmax())] for p in pre]
    for _ in range(new_tokens - 1):
        logits = runner.step(ids, [o[-1] for o in out])
        for o, nxt in zip(out, logits.argmax(-1).tolist(), strict=True):
            o.append(int(nxt))
    return out


def agreement(model, prompts, scheme, new_tokens: int, *, calibration: KVSample | None = None,
              reference: list[list[int]] | None = None, prefilled: list[Prefilled] | None = None,
              ops: str = "torch", per_layer_scales: bool = False) -> dict:
    """Greedy generation under ``scheme`` against the fp16 cache's (``reference``: its tokens, if already known;
    ``prefilled``: the prompts' :func:`prefill_all`, if already made).

    ``agreement``: fraction of new tokens equal position by position (after a divergence the texts differ, so
    later positions mostly disagree); ``first_divergence``: new tokens before the first difference, per prompt
    (``new_tokens`` when none), with its mean and minimum."""
    s = get_scheme(scheme)
    _positive("new_tokens", new_tokens)
    pre = prefilled if prefilled is not None else prefill_all(model, prompts)
    got = generate(model, prompts, s, new_tokens, calibration=calibration, prefilled=pre, ops=ops,
                   per_layer_scales=per_layer_scales)
    ref = reference if reference is not None else generate(model, prompts, REFERENCE, new_tokens, prefilled=pre,
                                                           ops=ops)
    if [len(r) for r in ref] != [len(g) for g in got]:
        raise ValueError(f"reference must hold {len(got)} lists of {new_tokens} tokens")
    first = [next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), new_tokens)
             for g, r in zip(got, ref, strict=True)]
    same = sum(a == b for g, r in zip(got, ref, strict=True) for a, b in zip(g, r, strict=True))
    return {"scheme": s.name, "agreement": same / (len(got) * new_tokens), "first_divergence": first,
            "first_divergence_mean": sum(first) / len(first), "first_divergence_min": min(first), "tokens": got}


# ---- teacher forcing ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Forced:
    """One cache's view of the text: ``logprobs`` ``[N]`` of each scored text token, ``logdist`` ``[N, vocab]``
    the full next-token log-distributions (for KL), in the order of :func:`chunks`."""

    scheme: str
    logprobs: torch.Tensor
    logdist: torch.Tensor


def chunks(text_tokens: Sequence[int], chunk: int) -> list[list[int]]:
    """The text as consecutive, non-overlapping windows of ``chunk`` tokens (a short tail is dropped)."""
    _positive("chunk", chunk)
    toks = [int(t) for t in text_tokens]
    if len(toks) < chunk:
        raise ValueError(f"text_tokens must hold at least chunk={chunk} tokens, got {len(toks)}")
    return [toks[i:i + chunk] for i in range(0, len(toks) - chunk + 1, chunk)]


def _check_forced(chunk, batch, prefill) -> None:
    _positive("chunk", chunk)
    _positive("batch", batch)
    _positive("prefill", prefill)
    if chunk - prefill < 2:
        raise ValueError(f"prefill must leave at least 2 tokens of each chunk to step, got prefill={prefill!r} "
                         f"with chunk={chunk!r}")


def prefill_chunks(model, text_tokens, chunk: int, prefill: int) -> list[Prefilled]:
    """The first ``prefill`` tokens of every chunk, prefilled once for all schemes (see :class:`Prefilled`)."""
    _check_forced(chunk, 1, prefill)
    return prefill_all(model, [w[:prefill] for w in chunks(text_tokens, chunk)])


def forced_run(model, text_tokens, scheme, chunk: int, batch: int, *, prefill: int = 1,
               calibration: KVSample | None = None, prefilled: list[Prefilled] | None = None,
               ops: str = "torch", per_layer_scales: bool = False) -> Forced:
    """Prefill each chunk's first ``prefill`` tokens into a ``scheme`` cache (``prefilled``: made once by
    :func:`prefill_chunks`), then step the rest through it, ``batch`` chunks at a time. Scored: each token whose
    prediction came from a decode step (``chunk - prefill - 1`` a chunk; the prefill's own prediction never reads
    the quantized cache, so it is left out)."""
    s = get_scheme(scheme)
    _check_forced(chunk, batch, prefill)
    windows = chunks(text_tokens, chunk)
    pre = prefilled if prefilled is not None else prefill_chunks(model, text_tokens, chunk, prefill)
    if [p.tokens for p in pre] != [w[:prefill] for w in windows]:
        raise ValueError("prefilled must be prefill_chunks of the same text_tokens, chunk and prefill")
    logp, dist = [], []
    for g in range(0, len(windows), batch):
        group = windows[g:g + batch]
        runner = _start(model, s, pre[g:g + batch], chunk - prefill, calibration, ops, per_layer_scales)
        ids = list(range(len(group)))
        out = []  # per step [B, vocab] log-distributions of the next token
        for t in range(prefill, chunk - 1):
            out.append(torch.log_softmax(runner.step(ids, [w[t] for w in group]).float().cpu(), -1))
        d = torch.stack(out, 1)  # [B, steps, vocab]
        nxt = torch.tensor([w[prefill + 1:] for w in group])  # [B, steps]: the tokens each step predicts
        logp.append(d.gather(-1, nxt[..., None])[..., 0].reshape(-1))
        dist.append(d.reshape(-1, d.shape[-1]))
    return Forced(s.name, torch.cat(logp), torch.cat(dist))


@dataclass(frozen=True)
class TeacherForced:
    """A scheme's log-probs of the text beside the fp16 cache's, and what follows from them."""

    scheme: str
    logprobs: torch.Tensor  # [N] under the scheme
    ref_logprobs: torch.Tensor  # [N] under the fp16 cache
    kl: torch.Tensor  # [N] KL(fp16 || scheme) of the next-token distributions, nats

    @property
    def drift(self) -> torch.Tensor:
        """Per-token log-prob change, scheme minus fp16 (nats)."""
        return self.logprobs - self.ref_logprobs

    def summary(self) -> dict:
        d = self.drift.abs()
        return {"scheme": self.scheme, "scored_tokens": int(self.logprobs.numel()),
                "perplexity": math.exp(-float(self.logprobs.double().mean())),
                "ref_perplexity": math.exp(-float(self.ref_logprobs.double().mean())),
                "mean_abs_drift": float(d.mean()), "max_abs_drift": float(d.max()),
                "mean_kl": float(self.kl.double().mean()), "max_kl": float(self.kl.max())}


def compare(run: Forced, ref: Forced) -> TeacherForced:
    """:class:`TeacherForced` of ``run`` against ``ref`` (the fp16 cache's run on the same chunks)."""
    if run.logprobs.shape != ref.logprobs.shape:
        raise ValueError(f"reference must score the same tokens: {tuple(ref.logprobs.shape)} vs "
                         f"{tuple(run.logprobs.shape)}")
    p = ref.logdist.exp()
    kl = (p * (ref.logdist - run.logdist)).sum(-1).clamp_min(0)  # rounding can leave -1e-9 where equal
    return TeacherForced(run.scheme, run.logprobs, ref.logprobs, kl)


def teacher_forced(model, text_tokens, scheme, chunk: int, batch: int, *, prefill: int = 1,
                   calibration: KVSample | None = None, reference: Forced | None = None,
                   prefilled: list[Prefilled] | None = None, ops: str = "torch",
                   per_layer_scales: bool = False) -> TeacherForced:
    """The text through the ``scheme`` cache and the fp16 cache (``reference``: that run, if already made), as
    :func:`forced_run` feeds it; ``.summary()`` gives perplexity, log-prob drift and KL."""
    get_scheme(scheme)  # before any work
    pre = prefilled if prefilled is not None else prefill_chunks(model, text_tokens, chunk, prefill)
    run = forced_run(model, text_tokens, scheme, chunk, batch, prefill=prefill, calibration=calibration,
                     prefilled=pre, ops=ops, per_layer_scales=per_layer_scales)
    ref = reference or forced_run(model, text_tokens, REFERENCE, chunk, batch, prefill=prefill, prefilled=pre,
                                  ops=ops)
    return compare(run, ref)


# ---- every scheme -------------------------------------------------------------------------------------------------
def evaluate_all(model, text_tokens, prompts, *, calibration: Sequence[int] | KVSample, schemes=None,
                 new_tokens: int = 32, chunk: int = CHUNK, batch: int = BATCH, prefill: int = PREFILL,
                 ops: str = "torch", static_scales_by: Sequence[str] = SCALES_BY,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per scheme (default every name of ``quant.SCHEMES``; fp32, fp16 and bf16 are references):
    :func:`agreement` and :func:`teacher_forced` against fp16, with the stored bytes per token and layer
    (``bytes_per_token`` at a ``chunk``-token context, KIVI's fp16 residual counted; ``bytes_per_token_long``
    in the long-context limit) and the seconds it took. ``calibration``: token ids of the calibration text (or
    their :func:`capture_kv`) for the static schemes, which get a row for each of ``static_scales_by``
    (``"cache"``: one pair of scales for all layers, ``"layer"``: one per layer; the row's ``scales``, and its
    ``k_scale`` / ``v_scale``); ``progress(name)`` is called before each scheme."""
    if isinstance(schemes, (str, quant.Scheme)):
        schemes = [schemes]
    names = list(quant.SCHEMES) if schemes is None else [get_scheme(s).name for s in schemes]
    if not names:
        raise ValueError("schemes must name at least one scheme")
    by = list(static_scales_by) if isinstance(static_scales_by, (list, tuple)) else None
    if not by or any(b not in SCALES_BY for b in by) or len(set(by)) != len(by):
        raise ValueError(f"static_scales_by must list distinct entries of {SCALES_BY}, got {static_scales_by!r}")
    _positive("new_tokens", new_tokens)
    _check_forced(chunk, batch, prefill)
    prompts = _token_lists("prompts", prompts)
    sample = calibration if isinstance(calibration, KVSample) else capture_kv(model, calibration)
    pre_text, pre_prompts = prefill_chunks(model, text_tokens, chunk, prefill), prefill_all(model, prompts)
    ref_forced = forced_run(model, text_tokens, REFERENCE, chunk, batch, prefill=prefill, prefilled=pre_text,
                            ops=ops)
    ref_tokens = generate(model, prompts, REFERENCE, new_tokens, prefilled=pre_prompts, ops=ops)
    cfg = model.config
    H, D = cfg.num_key_value_heads, cfg.head_dim
    fp16_bytes = quant.get(REFERENCE).bytes_per_token(H, D)
    rows = []
    for name in names:
        if progress:
            progress(name)
        s = quant.get(name)
        for scales in by if s.needs_static_scales else [None]:
            rows.append(_row(model, s, scales, sample, prompts, text_tokens, pre_prompts, pre_text, ref_tokens,
                             ref_forced, new_tokens, chunk, batch, prefill, ops, fp16_bytes))
    return rows


def _row(model, s, scales, sample, prompts, text_tokens, pre_prompts, pre_text, ref_tokens, ref_forced, new_tokens,
         chunk, batch, prefill, ops, fp16_bytes) -> dict:
    """:func:`evaluate_all`'s row of scheme ``s`` (static: with scales by ``scales``, ``"cache"`` or ``"layer"``)."""
    t0 = time.perf_counter()
    cfg = model.config
    H, D = cfg.num_key_value_heads, cfg.head_dim
    cal = sample if s.needs_static_scales else None
    per_layer = scales == "layer"
    a = agreement(model, prompts, s, new_tokens, calibration=cal, reference=ref_tokens, prefilled=pre_prompts,
                  ops=ops, per_layer_scales=per_layer)
    run = ref_forced if s.name == REFERENCE else forced_run(model, text_tokens, s, chunk, batch, prefill=prefill,
                                                            calibration=cal, prefilled=pre_text, ops=ops,
                                                            per_layer_scales=per_layer)
    tf = compare(run, ref_forced).summary()
    row = {"scheme": s.name, "bits": s.bits, "granularity": s.granularity, "static": s.needs_static_scales,
           "bytes_per_token": s.bytes_per_token(H, D, chunk), "bytes_per_token_long": s.bytes_per_token(H, D),
           "agreement": a["agreement"], "first_divergence_mean": a["first_divergence_mean"],
           "first_divergence_min": a["first_divergence_min"], **{k: v for k, v in tf.items() if k != "scheme"}}
    row["fp16_bytes_fraction"] = row["bytes_per_token"] / fp16_bytes
    if s.needs_static_scales:  # which scales: one pair for all layers, or one per layer
        k_scale, v_scale = static_scales(s, sample, per_layer=per_layer)
        row["scales"], row["k_scale"], row["v_scale"] = scales, k_scale.tolist(), v_scale.tolist()
    row["seconds"] = time.perf_counter() - t0
    return row
