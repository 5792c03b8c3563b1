"""Access traces: which KV blocks each decode step reads, for the prefetch replay (``workbench.tiers.replay``).

The KV cache is paged: block ``b`` holds tokens ``b * block_size .. (b + 1) * block_size - 1`` of one sequence
(all heads of one layer; a block is the unit a tier moves). A trace is one sequence's decode: at step ``t`` the
context holds ``prompt_tokens + t + 1`` tokens (the token being decoded writes its K/V, then attends to every
position up to and including its own, as causal attention does), so ``num_blocks`` grows by one block every
``block_size`` steps, and ``steps[t]`` lists the blocks step ``t`` reads.

Generators (pure functions of their arguments; the random ones seeded with ``numpy.random.default_rng(seed)``):

- :func:`full_trace`: dense attention reads every block every step;
- :func:`sliding_window_trace`: StreamingLLM, the sink tokens' blocks plus the blocks overlapping the last
  ``window_tokens`` tokens;
- :func:`topk_trace`: Quest-like sparse decode on synthetic keys: per-block min/max keys, the page bound
  ``sum_i max(q_i * min_i, q_i * max_i)`` (an upper bound of ``q . k`` for every key in the page), the top-``k``
  pages by it plus forced sink / recent blocks; the query drifts slowly (a random walk), so consecutive steps
  select overlapping sets, the temporal locality real attention shows;
- :func:`trace_from_capture`: the same selection on real SmolLM2-135M queries and keys
  (``workbench.model.capture``), with the blocks the true softmax needs recorded beside it (:func:`recall`).

``scores`` (when present) is what a score-guided prefetcher may look at after a step: the per-block bounds that
step computed. ``needed`` (capture traces) is the ground truth a test compares the selection with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

PATTERNS = ("custom", "full", "sliding_window", "topk", "capture")


@dataclass(frozen=True)
class AccessTrace:
    """The blocks one sequence's decode steps read.

    Attributes:
        name: a label for tables and plots.
        block_size: tokens per block.
        steps: per decode step, the logical block indices it reads (sorted, distinct, ``< num_blocks[t]``).
        num_blocks: per step, the sequence's block count (non-decreasing: the context grows a token a step).
        scores: optional, per step one score per block (``len == num_blocks[t]``): what that step's selection
            looked at (the Quest bound), visible to a prefetcher only after the step.
        pattern: which generator made it (one of :data:`PATTERNS`).
        prompt_tokens: the context before step 0 (step ``t`` then holds ``prompt_tokens + t + 1`` tokens);
            ``None`` for a hand-written trace: every block of step 0 then exists before the trace and a step's
            context is taken as ``num_blocks[t] * block_size`` tokens.
        needed: optional, per step the blocks the true attention needs (capture traces, :func:`recall`).
        covered: optional, per step the share of the true attention mass (mean over query heads) that lies in
            the blocks the step reads (capture traces; a random choice of as many blocks covers, on average, the
            share of blocks it reads).
    """

    name: str
    block_size: int
    steps: tuple[tuple[int, ...], ...]
    num_blocks: tuple[int, ...]
    scores: tuple[tuple[float, ...], ...] | None = None
    pattern: str = "custom"
    prompt_tokens: int | None = None
    needed: tuple[tuple[int, ...], ...] | None = None
    covered: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        # hand-written traces come as lists: store tuples (hashable, immutable)
        object.__setattr__(self, "steps", tuple(tuple(int(b) for b in s) for s in self.steps))
        object.__setattr__(self, "num_blocks", tuple(int(n) for n in self.num_blocks))
        if not self.steps:
            raise ValueError("steps must hold at least one step")
        if len(self.num_blocks) != len(self.steps):
            raise ValueError(f"num_blocks must have one entry per step ({len(self.steps)}), got {len(self.num_blocks)}")
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {self.pattern!r}")
        prev = 1
        for t, (reads, n) in enumerate(zip(self.steps, self.num_blocks, strict=True)):
            if n < prev:
                raise ValueError(f"num_blocks must be >= 1 and non-decreasing, got {n} at step {t}")
            prev = n
            if any(a >= b for a, b in pairwise(reads)) or (reads and not 0 <= reads[0] <= reads[-1] < n):
                raise ValueError(f"steps[{t}] must be sorted distinct block indices in [0, {n}), got {reads}")
        if self.prompt_tokens is not None:
            _non_negative("prompt_tokens", self.prompt_tokens)
            for t, n in enumerate(self.num_blocks):
                if n != -(-(self.prompt_tokens + t + 1) // self.block_size):
                    raise ValueError(f"num_blocks[{t}] = {n} does not hold prompt_tokens + {t + 1} tokens "
                                     f"({self.prompt_tokens} + {t + 1}) in blocks of {self.block_size}")
        for field in ("scores", "needed"):
            rows = getattr(self, field)
            if rows is None:
                continue
            cast = float if field == "scores" else int
            object.__setattr__(self, field, rows := tuple(tuple(cast(x) for x in r) for r in rows))
            if len(rows) != len(self.steps):
                raise ValueError(f"{field} must have one row per step ({len(self.steps)}), got {len(rows)}")
        if self.covered is not None:
            object.__setattr__(self, "covered", tuple(float(c) for c in self.covered))
            if len(self.covered) != len(self.steps):
                raise ValueError(f"covered must have one value per step ({len(self.steps)}), got {len(self.covered)}")
        if self.scores is not None:
            for t, (row, n) in enumerate(zip(self.scores, self.num_blocks, strict=True)):
                if len(row) != n:
                    raise ValueError(f"scores[{t}] must hold one score per block ({n}), got {len(row)}")

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def prompt_blocks(self) -> int:
        """Blocks that exist before step 0 (they start off the device); later ones are written during decode."""
        if self.prompt_tokens is None:
            return self.num_blocks[0]
        return -(-self.prompt_tokens // self.block_size)

    def tokens(self, step: int) -> int:
        """The context length (tokens) at ``step``."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step < len(self.steps):
            raise ValueError(f"step must be an int in [0, {len(self.steps)}), got {step!r}")
        if self.prompt_tokens is None:
            return self.num_blocks[step] * self.block_size
        return self.prompt_tokens + step + 1

    @property
    def total_reads(self) -> int:
        return sum(len(s) for s in self.steps)


def window_blocks(tokens: int, block_size: int, window_tokens: int, sink_tokens: int) -> list[int]:
    """StreamingLLM's blocks for a context of ``tokens`` tokens: those holding the first ``sink_tokens`` tokens
    and those overlapping the last ``window_tokens`` (sorted). Shared by the trace and the ``window`` prefetcher."""
    _non_negative("tokens", tokens)
    _positive("block_size", block_size)
    _positive("window_tokens", window_tokens)
    _non_negative("sink_tokens", sink_tokens)
    n_blocks = -(-tokens // block_size)
    sinks = range(min(-(-sink_tokens // block_size), n_blocks))
    recent = range(max(0, tokens - window_tokens) // block_size, n_blocks)
    return sorted(set(sinks) | set(recent))


def full_trace(prompt_tokens: int, steps: int, block_size: int) -> AccessTrace:
    """Dense decode: every step reads every block of its context."""
    counts = _decode_blocks(prompt_tokens, steps, block_size)
    return AccessTrace(f"full (B={block_size})", block_size, tuple(tuple(range(n)) for n in counts), counts,
                       pattern="full", prompt_tokens=prompt_tokens)


def sliding_window_trace(prompt_tokens: int, steps: int, block_size: int, window_tokens: int,
                         sink_tokens: int = 4) -> AccessTrace:
    """StreamingLLM decode: the blocks of the ``sink_tokens`` first tokens plus those overlapping the last
    ``window_tokens`` tokens of the context (which include the token being decoded)."""
    counts = _decode_blocks(prompt_tokens, steps, block_size)
    _positive("window_tokens", window_tokens)
    _non_negative("sink_tokens", sink_tokens)
    reads = tuple(tuple(window_blocks(prompt_tokens + t + 1, block_size, window_tokens, sink_tokens))
                  for t in range(steps))
    return AccessTrace(f"window {window_tokens}+{sink_tokens} sinks (B={block_size})", block_size, reads, counts,
                       pattern="sliding_window", prompt_tokens=prompt_tokens)


def topk_trace(prompt_tokens: int, steps: int, block_size: int, k: int, *, sink: bool = True, recent: int = 1,
               drift: float = 0.05, dim: int = 32, seed: int = 0) -> AccessTrace:
    """Quest-like sparse decode on synthetic keys: the top-``k`` blocks by the page bound, plus block 0
    (``sink``) and the last ``recent`` blocks, which are always read.

    Keys: each block has a random "topic" direction and its tokens are the topic plus smaller noise (nearby
    tokens are alike, which is what makes per-page min/max informative). The query does a random walk on the
    scale of a key: ``q_t = sqrt(1 - drift^2) q_{t-1} + drift * noise``, so ``drift=0`` keeps one query (the same
    top-k every step) and ``drift=1`` draws a fresh one each step (no locality). ``scores[t]`` holds the bounds
    step ``t`` ranked (the partial last block's from the tokens it holds so far).
    """
    counts = _decode_blocks(prompt_tokens, steps, block_size)
    _positive("k", k)
    _non_negative("recent", recent)
    _positive("dim", dim)
    if not isinstance(sink, bool):
        raise ValueError(f"sink must be a bool, got {sink!r}")
    if isinstance(drift, bool) or not isinstance(drift, (int, float)) or not 0 <= drift <= 1:
        raise ValueError(f"drift must be a number in [0, 1], got {drift!r}")
    rng = np.random.default_rng(seed)
    max_blocks = counts[-1]
    topics = rng.standard_normal((max_blocks, 1, dim))
    keys = topics + 0.5 * rng.standard_normal((max_blocks, block_size, dim))
    # running min/max along each block's tokens: entry [b, j] is the bound of block b holding j + 1 tokens
    run_min = np.minimum.accumulate(keys, axis=1)
    run_max = np.maximum.accumulate(keys, axis=1)
    q = rng.standard_normal(dim)
    keep = math.sqrt(1.0 - drift * drift)
    reads, scores = [], []
    for t, n_blocks in enumerate(counts):
        if t:
            q = keep * q + drift * rng.standard_normal(dim)
        last_fill = (prompt_tokens + t) % block_size  # index of the newest token inside the last block
        kmin, kmax = run_min[:n_blocks, -1].copy(), run_max[:n_blocks, -1].copy()
        kmin[-1], kmax[-1] = run_min[n_blocks - 1, last_fill], run_max[n_blocks - 1, last_fill]
        bound = np.maximum(q * kmin, q * kmax).sum(axis=1)
        forced = set(range(max(0, n_blocks - recent), n_blocks)) | ({0} if sink else set())
        reads.append(tuple(sorted(forced | set(_top(bound, k, exclude=forced)))))
        scores.append(tuple(bound.tolist()))
    return AccessTrace(f"top-{k} (B={block_size}, drift {drift:g})", block_size, tuple(reads), counts,
                       tuple(scores), pattern="topk", prompt_tokens=prompt_tokens)


def trace_from_capture(capture, layer: int, block_size: int, k: int, *, mass: float = 0.9) -> AccessTrace:
    """Quest on real attention: SmolLM2-135M's last 16 prompt queries of one layer, each one decode step.

    ``capture``: a ``workbench.model.capture.Capture`` (``capture.find(name or index)`` reads one of the saved
    ones; the tiers do not read model files themselves). Query ``i`` (position ``p = T - 16 + i``) reads keys
    ``0 .. p``: the trace's ``prompt_tokens`` is ``T - 16``.

    Selection: per query head, the top-``k`` blocks by the Quest bound of that head's kv head (``h // (Hq /
    Hkv)``), then the union over heads, since a block holds every head and is moved whole. ``scores``: per block
    the largest over heads of ``sm_scale * (bound - that head's best bound)`` (0 for a head's top block), one
    scale for all heads. ``needed``: per head the fewest blocks holding ``mass`` of that head's true softmax
    (largest first), union over heads; :func:`recall` compares the two. ``covered``: per step the mean over
    query heads of the true softmax mass inside the blocks read.
    """
    if not (hasattr(capture, "q_last") and hasattr(capture, "k") and hasattr(capture, "layers")):
        raise ValueError(f"capture must be a workbench.model.capture.Capture (capture.find reads a saved one by name "
                         f"or index), got {type(capture).__name__}")
    cap = capture
    if layer not in cap.layers:
        raise ValueError(f"layer must be one of the capture's stored layers {cap.layers}, got {layer!r}")
    _positive("block_size", block_size)
    _positive("k", k)
    if isinstance(mass, bool) or not isinstance(mass, (int, float)) or not 0 < mass <= 1:
        raise ValueError(f"mass must be a number in (0, 1], got {mass!r}")
    row = cap.layers.index(layer)
    queries = cap.q_last[row].double().numpy()  # [Nq, Hq, D]
    keys = cap.k[row].double().numpy()  # [T, Hkv, D]
    n_q, n_heads = queries.shape[:2]
    keys = keys[:, np.arange(n_heads) // (n_heads // keys.shape[1])]  # [T, Hq, D]: each query head's kv head
    prompt = keys.shape[0] - n_q
    if prompt < 0:
        raise ValueError(f"capture {cap.name!r} has fewer tokens than queries")
    reads, scores, needed, counts, covered = [], [], [], [], []
    for i in range(n_q):
        n_tokens = prompt + i + 1
        starts = np.arange(0, n_tokens, block_size)
        seen = keys[:n_tokens]
        kmin = np.minimum.reduceat(seen, starts, axis=0)  # [blocks, Hq, D]
        kmax = np.maximum.reduceat(seen, starts, axis=0)
        q = queries[i]
        bound = np.maximum(q * kmin, q * kmax).sum(-1).T  # [Hq, blocks]
        logits = np.einsum("thd,hd->ht", seen, q) * cap.sm_scale
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        block_mass = np.add.reduceat(probs, starts, axis=1)  # [Hq, blocks]
        chosen, need = set(), set()
        for h in range(n_heads):
            chosen.update(_top(bound[h], k))
            order = _top(block_mass[h], len(starts))
            # the smallest prefix (largest blocks first) reaching `mass`; the tolerance absorbs rounding at mass=1
            cover = int(np.searchsorted(np.cumsum(block_mass[h][order]), mass - 1e-9)) + 1
            need.update(order[:cover])
        reads.append(tuple(sorted(chosen)))
        covered.append(float(block_mass[:, list(reads[-1])].sum(1).mean()))
        needed.append(tuple(sorted(need)))
        scores.append(tuple((cap.sm_scale * (bound - bound.max(1, keepdims=True))).max(0).tolist()))
        counts.append(len(starts))
    return AccessTrace(f"{cap.name} L{layer} top-{k} (B={block_size})", block_size, tuple(reads), tuple(counts),
                       tuple(scores), pattern="capture", prompt_tokens=prompt, needed=tuple(needed),
                       covered=tuple(covered))


def recall(trace: AccessTrace) -> np.ndarray:
    """Per step, the share of the ``needed`` blocks (true attention) that the step reads (1.0 when none needed)."""
    _check_trace(trace)
    if trace.needed is None:
        raise ValueError(f"trace {trace.name!r} has no needed blocks (only capture traces record them)")
    pairs = zip(trace.steps, trace.needed, strict=True)
    return np.array([len(set(r) & set(n)) / len(n) if n else 1.0 for r, n in pairs])


def pattern_traces(prompt_tokens: int, steps: int, block_size: int = 16, *, window_tokens: int = 256, topk: int = 16,
                   drift: float = 0.2, capture: tuple | None = None, capture_block_size: int = 8,
                   capture_topk: int = 4) -> dict[str, AccessTrace]:
    """The access patterns notebook 05 replays, by label: ``full`` (:func:`full_trace`), ``sliding window``
    (``window_tokens`` + 4 sinks), ``top-k`` (``topk`` blocks, query ``drift``) and ``SmolLM2`` (``capture``: a
    ``(Capture, layer)`` pair, top-``capture_topk`` blocks of ``capture_block_size``; left out when None)."""
    for name, v in (("topk", topk), ("capture_block_size", capture_block_size), ("capture_topk", capture_topk)):
        _positive(name, v)  # named here: the traces call them k and block_size
    traces = {"full": full_trace(prompt_tokens, steps, block_size),
              "sliding window": sliding_window_trace(prompt_tokens, steps, block_size, window_tokens=window_tokens),
              "top-k": topk_trace(prompt_tokens, steps, block_size, topk, drift=drift)}
    if capture is not None:
        traces["SmolLM2"] = trace_from_capture(capture[0], capture[1], block_size=capture_block_size, k=capture_topk)
    return traces


def trace_rows(traces: Mapping[str, AccessTrace]) -> list[dict]:
    """One table row per trace: ``{pattern (the key), trace (its name), steps, reads_per_step, blocks (at the
    end), block_size}``."""
    if not isinstance(traces, Mapping):
        raise ValueError(f"traces must be a mapping of labels to AccessTrace, got {type(traces).__name__}")
    for tr in traces.values():
        _check_trace(tr)
    return [{"pattern": label, "trace": tr.name, "steps": len(tr), "reads_per_step": tr.total_reads / len(tr),
             "blocks": tr.num_blocks[-1], "block_size": tr.block_size} for label, tr in traces.items()]


def capture_summary(trace: AccessTrace) -> dict[str, float]:
    """How well a capture trace's selection matches the true attention (means over steps): ``covered`` (the share
    of the attention mass in the blocks read), ``block_share`` (the share of the blocks read) and ``recall`` (of
    the blocks holding ``mass`` of it, :func:`recall`). ``ValueError`` for a trace without them."""
    _check_trace(trace)
    if trace.covered is None or trace.needed is None:
        raise ValueError(f"trace {trace.name!r} has no true attention (only capture traces record it)")
    return {"covered": sum(trace.covered) / len(trace), "block_share": trace.total_reads / sum(trace.num_blocks),
            "recall": float(recall(trace).mean())}


def _top(values: np.ndarray, k: int, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Indices of the ``k`` largest ``values`` outside ``exclude``, largest first (ties: lower index first)."""
    order = np.lexsort((np.arange(len(values)), -values))
    return [int(b) for b in order if b not in exclude][:k]



def _decode_blocks(prompt_tokens: int, steps: int, block_size: int) -> tuple[int, ...]:
    _non_negative("prompt_tokens", prompt_tokens)
    _positive("steps", steps)
    _positive("block_size", block_size)
    return tuple(-(-(prompt_tokens + t + 1) // block_size) for t in range(steps))


def _check_trace(trace: object) -> None:
    if not isinstance(trace, AccessTrace):
        raise ValueError(f"trace must be an AccessTrace, got {type(trace).__name__}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
