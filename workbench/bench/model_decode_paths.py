"""The model runner's decode through the shared-prefix cascade and through Quest, timed: the sections ``cascade`` and
``quest`` of ``python -m workbench bench model_decode`` (issue 33), in the same run and results file as its plain
decode and transformers' ``generate``, on the same random fp16 weights.

- ``cascade``: ``samples`` greedy samples forked from one ``shared_prompt``-token prompt, decoded through
  ``PagedKV(shared_prefix="off")`` (plain paged decode, the reference), ``"auto"`` (the selector's pick, fitted for
  eager launches, as the runner launches) and ``"shared"`` (the cascade whenever a block is shared): tokens/s, how
  each (step, layer) was attended, and whether the tokens are plain decode's. Greedy: the samples decode identical
  tokens (no divergence is needed: the cascade reads the prompt's blocks, which every sample holds); a prompt that
  fills whole blocks (4096 = 256 x 16) leaves no partial block to copy on write.
- ``quest``: one ``long_prompt``-token prompt at batch ``b`` (``b`` copies of it, each with its own blocks), the full
  cache against ``QuestKV`` at each page budget (16-token pages): tokens/s, paths, and greedy agreement with the
  full cache's tokens (share before the first divergence, and position by position). The weights are random:
  agreement is a smoke figure (Quest runs and follows the full cache), not a quality claim.

Only the decode steps are timed (after ``warmup`` steps: kernels compile, plans warm); the argmax read back every
step synchronizes, so host time is step time. Each prompt is prefilled once, chunk by chunk
(:func:`prefill_chunked`: the causal mask and scores stay ``[chunk, tokens so far]``), and that prefill is added to
each configuration's fresh cache (``Runner.add_prefilled``), so no configuration pays or repeats a prefill. On a GPU
each row also times one layer's ``kv.attend`` alone (:func:`attend_us`): in the eager runner the model's other
launches and the host dominate a step, and this says what share the attention path is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from workbench.bench import harness
from workbench.cache import PagedKVCache
from workbench.compress.page_selection import check_page_budget
from workbench.compress.quest_kv import QuestKV
from workbench.core.argtypes import positive_int, positive_int_list
from workbench.model import PagedKV, Runner
from workbench.model.inspect import common_prefix
from workbench.model.quality import Prefilled

SECTIONS = ("cascade", "quest")
SHARED_MODES = ("off", "auto", "shared")  # "off" first: the reference the others are compared with
PAGE = 16  # tokens per block, as Quest's budgets count them
RANDOM_NOTE = ("random weights: agreement is a smoke figure (Quest runs and follows the full cache), not a quality "
               "claim; a batch holds copies of the one prompt, each in its own blocks")


def add_arguments(ap) -> None:
    """The sections' options on ``bench model_decode``'s parser."""
    ap.add_argument("--samples", type=positive_int, default=8, help="cascade: forked samples of the shared prompt")
    ap.add_argument("--shared-prompt", type=positive_int, default=4096, help="cascade: tokens of the shared prompt")
    ap.add_argument("--long-prompt", type=positive_int, default=32768, help="quest: tokens of the long prompt")
    ap.add_argument("--quest-budgets", type=positive_int_list, default=[64, 128],
                    help=f"quest: page budgets ({PAGE}-token pages), comma separated")
    ap.add_argument("--quest-batches", type=positive_int_list, default=[1, 4],
                    help="quest: batch sizes (copies of the long prompt), comma separated")


class _Chunks:
    """:meth:`Runner.prefill`'s K/V store for one prompt prefilled chunk by chunk: what it stored last is the next
    chunk's cached prefix."""

    def __init__(self, num_layers: int):
        self.num_layers, self.tokens, self.k, self.v = num_layers, [], None, None

    def read_prefix(self, tokens: Sequence[int]):
        n = len(self.tokens)
        return (self.k, self.v) if n and list(tokens[:n]) == self.tokens else (None, None)

    def add(self, seq_id, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        self.tokens, self.k, self.v = list(tokens), k, v


def prefill_chunked(model, tokens: Sequence[int], chunk: int = 4096) -> Prefilled:
    """``tokens``' prefill (K/V of every layer and the next-token logits) computed ``chunk`` tokens at a time, each
    chunk attending over the ones before as a cached prefix: the same K/V as one prefill up to the attention's
    summation order, with a causal mask of ``[chunk, tokens so far]`` rather than ``[T, T]`` (1 GB at 32k)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int (tokens per prefill chunk), got {chunk!r}")
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("tokens must hold at least one token id")
    store = _Chunks(model.num_layers)
    runner = Runner(model, store)
    for end in range(chunk, len(tokens) + chunk, chunk):
        logits, _ = runner.prefill(0, tokens[:end])
    return Prefilled(tokens, store.k, store.v, logits.float())


def greedy_decode(runner: Runner, seq_ids: Sequence, first: Sequence[int], steps: int,
                  warmup: int) -> tuple[list[list[int]], float]:
    """``steps`` greedy decode steps of ``seq_ids`` fed ``first`` first: each sequence's new tokens, and the seconds
    of the steps after the first ``warmup`` (each step reads its argmax back: host time is step time)."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= warmup:
        raise ValueError(f"steps must be an int above warmup ({warmup}), got {steps!r}")
    seq_ids, toks = list(seq_ids), [int(t) for t in first]
    if len(toks) != len(seq_ids):
        raise ValueError(f"first must hold one token per sequence ({len(seq_ids)}), got {len(toks)}")
    out: list[list[int]] = [[] for _ in seq_ids]
    t0 = time.perf_counter()
    for i in range(steps):
        if i == warmup:
            t0 = time.perf_counter()
        toks = runner.step(seq_ids, toks).argmax(-1).tolist()
        for o, t in zip(out, toks, strict=True):
            o.append(t)
    return out, time.perf_counter() - t0


def agreement(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> dict:
    """Two greedy runs of the same sequences (per sequence its tokens): ``agree_to_divergence`` (mean share of a
    sequence's tokens before its first differing one), ``agree_overall`` (mean share of equal tokens position by
    position) and ``tokens_equal`` (every token equal)."""
    if len(ref) != len(got) or not ref:
        raise ValueError(f"ref and got must hold the same sequences (at least one), got {len(ref)} and {len(got)}")
    if any(len(a) != len(b) or not a for a, b in zip(ref, got, strict=True)):
        raise ValueError("each sequence must hold the same number of tokens (at least one) in ref and got")
    before = [common_prefix(a, b) / len(a) for a, b in zip(ref, got, strict=True)]
    overall = [sum(x == y for x, y in zip(a, b, strict=True)) / len(a) for a, b in zip(ref, got, strict=True)]
    return {"agree_to_divergence": sum(before) / len(before), "agree_overall": sum(overall) / len(overall),
            "tokens_equal": all(x == 1 for x in before)}


def attend_us(runner: Runner, seq_ids: Sequence, tokens: Sequence[int]) -> float:
    """One layer's ``kv.attend`` (the new tokens' write, then attention: Quest's page scores and selection included,
    its per-step plan not) launched eagerly, timed by do_bench in an open step that is then aborted (the store's
    ``paths`` count these calls too: read them before)."""
    m, kv = runner.model, runner.kv
    seq_ids, tokens = list(seq_ids), [int(t) for t in tokens]
    pos = torch.tensor([kv.num_tokens(s) for s in seq_ids], device=m.device)
    with torch.no_grad():
        q, _, k, v = m.qkv(0, m.embed_tokens(torch.tensor(tokens, device=m.device)), pos)
    step = kv.begin(seq_ids, tokens)
    try:
        return harness.time_us(lambda: kv.attend(step, 0, q, k, v, m.sm_scale))
    finally:
        kv.abort(step)


def paged_cache(model, seqs: int, max_len: int, kv_dtype: str, key_bounds: bool = False) -> PagedKVCache:
    """A cache on the model's device with room for ``seqs`` sequences of ``max_len`` tokens (prefix cache off)."""
    pages = seqs * -(-max_len // PAGE) + 8
    cfg = model.config
    return PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, pages, page_tokens=PAGE,
                        kv_dtype=kv_dtype, device=model.device, prefix_caching=False, key_bounds=key_bounds)


def _timed(kv, runner: Runner, seq_ids: list, first: int, steps: int, warmup: int, time_attend: bool,
           ) -> tuple[dict, list[list[int]]]:
    """Decode ``seq_ids`` (stored already), the row's timing and paths, then free them."""
    toks, secs = greedy_decode(runner, seq_ids, [first] * len(seq_ids), steps, warmup)
    timed = steps - warmup
    row = {"steps": steps, "timed_steps": timed, "step_ms": 1e3 * secs / timed,
           "tokens_per_s": len(seq_ids) * timed / secs, "paths": dict(kv.paths)}
    if time_attend:
        row["attend_us"] = attend_us(runner, seq_ids, [t[-1] for t in toks])
        row["attend_share"] = runner.model.num_layers * row["attend_us"] / (1e3 * row["step_ms"])
    for s in seq_ids:
        kv.free(s)
    return row, toks


def cascade_rows(model, pre: Prefilled, samples: int, steps: int, warmup: int, kv_dtype: str,
                 time_attend: bool = False) -> list[dict]:
    """``samples`` forks of the prefilled prompt decoded greedily through each of :data:`SHARED_MODES`."""
    _at_least("samples", samples, 2, "forks that share the prompt")
    rows, ref = [], None
    for mode in SHARED_MODES:
        kv = PagedKV(paged_cache(model, samples, len(pre.tokens) + steps + 1, kv_dtype), shared_prefix=mode)
        runner = Runner(model, kv)
        runner.add_prefilled((0, 0), pre)
        ids = [(0, j) for j in range(samples)]
        for s in ids[1:]:
            kv.fork(ids[0], s)
        row, toks = _timed(kv, runner, ids, int(pre.logits.argmax()), steps, warmup, time_attend)
        ref = ref or (row, toks)
        same = agreement(ref[1], toks)
        rows.append({"section": "cascade", "shared_prefix": mode, "prompt": len(pre.tokens), "samples": samples,
                     **row, "speedup_vs_plain": row["tokens_per_s"] / ref[0]["tokens_per_s"],
                     "tokens_equal_plain": same["tokens_equal"], "agree_overall": same["agree_overall"],
                     "decode": "greedy (the samples decode identical tokens)"})
        del kv, runner
        _release(model)
    return rows


def quest_rows(model, pre: Prefilled, batches: Sequence[int], budgets: Sequence[int], steps: int, warmup: int,
               kv_dtype: str, time_attend: bool = False) -> list[dict]:
    """Per batch size, the prefilled prompt's copies decoded greedily with the full cache, then with ``QuestKV`` at
    each page budget; agreement against the full cache's tokens."""
    rows = []
    for b in batches:
        ids, ref = list(range(b)), None
        for budget in [None, *budgets]:
            cache = paged_cache(model, b, len(pre.tokens) + steps + 1, kv_dtype, key_bounds=budget is not None)
            kv = PagedKV(cache) if budget is None else QuestKV(cache, budget)
            runner = Runner(model, kv)
            for s in ids:
                runner.add_prefilled(s, pre)
            row, toks = _timed(kv, runner, ids, int(pre.logits.argmax()), steps, warmup, time_attend)
            ref = ref or (row, toks)
            rows.append({"section": "quest", "kv": "full" if budget is None else "quest", "batch": b,
                         "prompt": len(pre.tokens), "page_budget": budget, "page_tokens": PAGE,
                         "budget_tokens": None if budget is None else budget * PAGE, **row,
                         "speedup_vs_full": row["tokens_per_s"] / ref[0]["tokens_per_s"],
                         **agreement(ref[1], toks), "decode": "greedy", "note": RANDOM_NOTE})
            del kv, runner, cache
            _release(model)
    return rows


def _at_least(name: str, v, low: int, what: str = "") -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}{f' ({what})' if what else ''}, got {v!r}")


def _release(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def check_options(sections: Sequence[str] = SECTIONS, samples: int = 8, shared_prompt: int = 4096,
                  long_prompt: int = 32768, batches: Sequence[int] = (1, 4), budgets: Sequence[int] = (64, 128),
                  new_tokens: int = 256, warmup: int = 2, chunk: int = 4096) -> None:
    """ValueError naming the first of :func:`run`'s options that is out of range (before any work)."""
    if not sections or set(sections) - set(SECTIONS):
        raise ValueError(f"sections must be some of {SECTIONS}, got {sections!r}")
    _at_least("warmup", warmup, 0, "untimed decode steps")
    _at_least("new_tokens", new_tokens, warmup + 2, f"warmup {warmup} + a timed step + the prefill's token")
    for name, v, low in (("samples", samples, 2), ("shared_prompt", shared_prompt, 1),
                         ("long_prompt", long_prompt, 1), ("chunk", chunk, 1)):
        _at_least(name, v, low)
    if not batches or not budgets:
        raise ValueError(f"batches and budgets must be non-empty, got {batches!r} and {budgets!r}")
    for b in batches:
        _at_least("each of batches", b, 1)
    for b in budgets:
        check_page_budget(b, 1, 1)  # QuestKV's first and last pages are always read


def positions_needed(sections: Sequence[str], shared_prompt: int, long_prompt: int, new_tokens: int) -> int:
    """The longest sequence the sections grow: its prompt and its new tokens (the model's RoPE table must hold it)."""
    prompts = [shared_prompt] * ("cascade" in sections) + [long_prompt] * ("quest" in sections)
    return max(prompts, default=0) + new_tokens


def run(model, kv_dtype: str, *, sections: Sequence[str] = SECTIONS, samples: int = 8, shared_prompt: int = 4096,
        long_prompt: int = 32768, batches: Sequence[int] = (1, 4), budgets: Sequence[int] = (64, 128),
        new_tokens: int = 256, warmup: int = 2, chunk: int = 4096, seed: int = 0) -> Iterator[dict]:
    """The rows of ``sections`` (module docstring), yielded as each configuration is done: random prompts drawn from
    ``seed``, ``new_tokens`` per sequence (the first is the prefill's: ``new_tokens - 1`` decode steps); on a GPU
    each row also times ``kv.attend``. The options are checked (:func:`check_options`) before any work."""
    check_options(sections, samples, shared_prompt, long_prompt, batches, budgets, new_tokens, warmup, chunk)
    need = positions_needed(sections, shared_prompt, long_prompt, new_tokens)
    if need > model.config.max_position_embeddings:
        raise ValueError(f"the sections need {need} positions, past the model's max_position_embeddings "
                         f"{model.config.max_position_embeddings}: build it with a longer RoPE table "
                         f"(LlamaConfig.max_position_embeddings; bench model_decode does)")
    return _rows(model, kv_dtype, sections, samples, shared_prompt, long_prompt, batches, budgets, new_tokens,
                 warmup, chunk, seed)


def _rows(model, kv_dtype, sections, samples, shared_prompt, long_prompt, batches, budgets, new_tokens, warmup,
          chunk, seed) -> Iterator[dict]:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    time_attend = model.device.type == "cuda"
    if "cascade" in sections:
        pre = prefill_chunked(model, torch.randint(10, vocab, (shared_prompt,), generator=g).tolist(), chunk)
        yield from cascade_rows(model, pre, samples, new_tokens - 1, warmup, kv_dtype, time_attend)
    if "quest" in sections:
        pre = prefill_chunked(model, torch.randint(10, vocab, (long_prompt,), generator=g).tolist(), chunk)
        yield from quest_rows(model, pre, batches, budgets, new_tokens - 1, warmup, kv_dtype, time_attend)


def smoke_rows(model) -> list[dict]:
    """Both sections on tiny shapes (``model``: a 2-layer fp32 one on the CPU): a 40-token prompt (3 pages, the last
    partial: the forks copy it on write), 2 samples, batch 2, a budget of 2 pages, 2 decode steps (the interpreter
    runs every kernel: each configuration costs seconds)."""
    return list(run(model, "fp32", samples=2, shared_prompt=40, long_prompt=40, batches=(2,), budgets=(2,),
               new_tokens=3, warmup=1, chunk=32))
