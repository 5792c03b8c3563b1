"""A serving run predicted from measurements: a trace through continuous batching over a paged KV cache, each
step's time from a :class:`~workbench.whatif.step_time.StepModel`.

    res = simulate(trace, StepModel(profile, cfg, "int4/token"), Knobs(block_size=16, host_gib=64))
    res.summary()      # throughput, TTFT / TPOT percentiles, max concurrency, swaps, prefix hits, memory

A step (vLLM's scheduler in outline, chunked prefill on):

1. requests that have arrived join the queue; a swapped-out request comes back first when its blocks fit;
2. every running request past its prefill decodes one token; a request whose last block is full needs a new
   one, and when none is free the running request that arrived last is preempted: by *swap* (its own blocks go
   to the host tier, in ``host_format``, over the measured link; when the host is full, by recompute) or by
   *recompute* (its blocks are freed; it prefills its prompt and the tokens it generated again);
3. the rest of the step's ``token_budget`` goes to prefill chunks: the running requests still prefilling, then
   new requests while the batch has room (``max_batch``) and the pool has the blocks for their chunk (none in a
   step that preempted: what it freed goes to the running requests, as vLLM's scheduler does);
4. the step takes ``decode(batch, context) + prefill(chunk tokens, context) + swap`` seconds; a request's first
   token comes at the end of the step that finishes its prefill, the others one a step.

Memory is counted in blocks of ``block_size`` tokens of the scheme's bytes: a request holds ``ceil(tokens /
block_size)`` blocks. ``shared_prefix`` tokens (a system prompt) precede every request's own prompt; with
``prefix_caching`` their full blocks are held once and never prefilled again (the last prompt token always is).
With ``keep`` < 1 a request keeps that share of its own prompt's tokens after prefill (an eviction budget,
``policy`` naming the policy for the quality column).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from workbench import quant
from workbench.sim.traces import Trace
from workbench.whatif import models
from workbench.whatif.step_time import StepModel

PREEMPTION = ("recompute", "swap")
RESERVE = ("paged", "max", "pow2", "oracle")  # paged blocks on demand, or Orca's reservations (vLLM paper, Fig. 2)
SHARES = ("token_states", "reserved", "fragmentation")  # where the used KV slots go (time-averaged)
GIB = 1 << 30


@dataclass(frozen=True)
class Knobs:
    """What a what-if varies besides the model, GPU and scheme (the step model's); see the module docstring."""

    block_size: int = 16
    kv_gib: float | None = None  # KV memory; None: HBM x utilization - weights - activations
    utilization: float = 0.9
    activation_gib: float = 1.0
    max_batch: int = 256
    token_budget: int = 2048
    prefix_caching: bool = True
    shared_prefix: int = 0
    preemption: str = "recompute"
    host_gib: float = 0.0
    host_format: str | None = None
    keep: float = 1.0
    policy: str = "full"
    watermark: float = 0.01  # share of the blocks a new admission leaves free (vLLM's block-manager watermark)
    reserve: str = "paged"  # "max" / "pow2" / "oracle": Orca-style, a request reserves its slots at admission
    max_len: int = 2048  # the most tokens a request may hold (what "max" reserves)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_batch", "token_budget"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(self.shared_prefix, bool) or not isinstance(self.shared_prefix, int) or self.shared_prefix < 0:
            raise ValueError(f"shared_prefix must be an int >= 0, got {self.shared_prefix!r}")
        if self.reserve not in RESERVE:
            raise ValueError(f"reserve must be one of {RESERVE}, got {self.reserve!r}")
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 2:
            raise ValueError(f"max_len must be an int >= 2, got {self.max_len!r}")
        if self.preemption not in PREEMPTION:
            raise ValueError(f"preemption must be one of {PREEMPTION}, got {self.preemption!r}")
        if not (isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 1):
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        for name, lo, hi in (("utilization", 0.0, 1.0), ("keep", 0.0, 1.0)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and lo < v <= hi):
                raise ValueError(f"{name} must be in ({lo}, {hi}], got {v!r}")
        for name in ("activation_gib", "host_gib"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if self.kv_gib is not None and not (isinstance(self.kv_gib, (int, float)) and self.kv_gib > 0):
            raise ValueError(f"kv_gib must be None or a number > 0, got {self.kv_gib!r}")
        if self.host_format is not None:
            quant.get(self.host_format)


@dataclass(eq=False)  # compared by identity: list.remove on the running batch is hot
class _Req:
    idx: int
    arrival: float
    prompt: int  # prompt tokens (the shared prefix included)
    output: int
    skip: int = 0  # prompt tokens that are prefix-cache hits (full blocks of the shared prefix, never the last token)
    own: int = 0  # prompt tokens it computes itself
    to_prefill: int = 0  # tokens this admission prefills: its own prompt, or all it held before a recompute
    done_prefill: int = 0
    generated: int = 0  # output tokens so far (the newest one's K/V is written by the next decode step)
    held: int = 0  # tokens whose K/V it holds in its own blocks
    reserved: int = 0  # blocks reserved at admission (Orca-style ``reserve``; 0 when paged)
    first_token: float = -1.0


@dataclass
class Result:
    """A simulated run: per request arrival, first token and finish times (NaN if unfinished), the memory timeline
    ``(time, blocks in use)`` and counters."""

    trace: str
    scheme: str
    knobs: Knobs
    kv_blocks: int
    block_bytes: int
    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    output: np.ndarray
    timeline: tuple[np.ndarray, np.ndarray]
    counters: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """Throughput, TTFT / TPOT percentiles (seconds), max concurrency and the counters, as plain numbers."""
        done = ~np.isnan(self.finish)
        span = float(np.nanmax(self.finish) - self.arrival.min()) if done.any() else float("nan")
        ttft = (self.first_token - self.arrival)[done]
        multi = done & (self.output > 1)
        tpot = ((self.finish - self.first_token) / np.maximum(self.output - 1, 1))[multi]

        def pct(x, q):
            return float(np.percentile(x, q)) if len(x) else float("nan")

        return {
            "requests": len(self.arrival), "completed": int(done.sum()),
            "throughput_tok_s": float(self.output[done].sum() / span) if done.any() else 0.0,
            "requests_per_s": float(done.sum() / span) if done.any() else 0.0,
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p90_s": pct(tpot, 90), "tpot_p99_s": pct(tpot, 99),
            "kv_blocks": self.kv_blocks, "kv_gib": self.kv_blocks * self.block_bytes / GIB,
            "peak_blocks": int(self.timeline[1].max()) if len(self.timeline[1]) else 0, **self.counters,
        }


def kv_blocks(sm: StepModel, knobs: Knobs) -> tuple[int, int, str]:
    """``(blocks, bytes a block, how the budget was found)`` of the KV memory the knobs and the GPU leave."""
    block_bytes = int(math.ceil(sm.kv_bytes_per_token * knobs.block_size))
    if knobs.kv_gib is not None:
        kv, note = knobs.kv_gib * GIB, f"{knobs.kv_gib:g} GiB given"
    else:
        hbm = sm.profile.hbm_gib.value
        weights = models.params(sm.cfg) * sm.weight_bytes
        kv = hbm * GIB * knobs.utilization - weights - knobs.activation_gib * GIB
        note = (f"{hbm:g} GiB ({sm.profile.hbm_gib.source}) x {knobs.utilization:g} - weights "
                f"{weights / GIB:.1f} GiB - activations {knobs.activation_gib:g} GiB")
    blocks = int(kv // block_bytes)
    if blocks < 1:
        raise ValueError(f"the KV budget ({note}) holds no block of {block_bytes} bytes")
    return blocks, block_bytes, note


def simulate(trace: Trace, sm: StepModel, knobs: Knobs = Knobs(), *, max_steps: int = 2_000_000) -> Result:
    """Run ``trace`` (see the module docstring); ``max_steps`` guards against a configuration that never drains.

    The shared prefix is cached from the start (a warm server with a fixed system prompt): its blocks are held
    once and every request's prefill skips it. A request that could not fit in the whole pool even alone is
    rejected at arrival (``counters["rejected"]``)."""
    if not isinstance(trace, Trace) or not len(trace):
        raise ValueError(f"trace must be a non-empty workbench.sim.traces.Trace, got {trace!r:.80}")
    if not isinstance(sm, StepModel):
        raise ValueError(f"sm must be a StepModel, got {type(sm).__name__}")
    bs = knobs.block_size
    total, block_bytes, _ = kv_blocks(sm, knobs)
    # the host tier stores blocks in host_format (issue 34: fewer bytes a token cross the link)
    c = sm.cfg
    host_fmt = quant.get(knobs.host_format or sm.scheme)
    host_block_bytes = int(math.ceil(host_fmt.bytes_per_token(c.num_key_value_heads, c.head_dim)
                                     * c.num_hidden_layers * bs))
    host_free = int(knobs.host_gib * GIB // host_block_bytes) if knobs.preemption == "swap" else 0
    link = sm.profile.link
    skip = (knobs.shared_prefix // bs) * bs if knobs.prefix_caching else 0  # full blocks of the prefix: hits
    shared_blocks = skip // bs
    free = total - shared_blocks
    if free < 1:
        raise ValueError(f"the shared prefix's {shared_blocks} blocks fill the KV budget of {total} blocks")
    reqs = []
    for i, q in enumerate(trace.requests):
        prompt = knobs.shared_prefix + q.prompt  # the system prompt, then the trace's own prompt
        hit = min(skip, (prompt - 1) // bs * bs)
        r = _Req(i, q.arrival_s, prompt, q.output, skip=hit, own=prompt - hit)
        r.to_prefill = r.own
        reqs.append(r)
    n = len(reqs)
    first, finish = np.full(n, np.nan), np.full(n, np.nan)
    pending = deque(reqs)  # not arrived yet, in arrival order
    waiting: deque[_Req] = deque()
    swapped: deque[_Req] = deque()
    running: list[_Req] = []
    cnt = dict(preemptions=0, swaps_out=0, swaps_in=0, swap_bytes=0, recomputed_tokens=0, prefix_hits=0,
               max_concurrency=0, steps=0, swap_seconds=0.0, rejected=0)  # prefix_hits: admissions that hit
    times, used = [reqs[0].arrival], [shared_blocks]
    shares = dict.fromkeys(SHARES, 0.0)  # slot-seconds of the pool in use, by what fills them
    now = reqs[0].arrival
    while pending or waiting or running or swapped:
        cnt["steps"] += 1
        if cnt["steps"] > max_steps:
            raise RuntimeError(f"no progress after {max_steps} steps")
        while pending and pending[0].arrival <= now:
            r = pending.popleft()
            peak = max(r.own, _kept(r, knobs) + r.output - 1, _reservation(r, knobs))
            too_long = knobs.reserve == "max" and r.prompt + r.output > knobs.max_len
            if -(-peak // bs) > total - shared_blocks or too_long:
                cnt["rejected"] += 1  # alone it would outgrow the pool
            else:
                waiting.append(r)
        if not running and not swapped and not waiting:
            if pending:
                now = pending[0].arrival
            continue
        swap_s = 0.0
        while swapped and len(running) < knobs.max_batch and _blocks(swapped[0], bs) <= free:
            r = swapped.popleft()  # a swapped request comes back first, oldest first, when its blocks fit
            k = _blocks(r, bs)
            free, host_free = free - k, host_free + k
            swap_s += link.batch_seconds(host_block_bytes, k, "dma", "h2d")
            running.append(r)
            cnt["swaps_in"] += 1
        decoding = [r for r in running if r.done_prefill >= r.to_prefill]
        need = sum(1 for r in decoding if r.held % bs == 0 and r.held // bs >= r.reserved)  # last block full
        preempted = need > free
        while need > free:
            victim = max(running, key=lambda r: (r.arrival, r.idx))
            running.remove(victim)
            cnt["preemptions"] += 1
            k = _blocks(victim, bs)
            free += k
            if victim in decoding:
                decoding.remove(victim)
                need -= victim.held % bs == 0 and victim.held // bs >= victim.reserved
            if knobs.preemption == "swap" and k <= host_free and victim.done_prefill >= victim.to_prefill:
                host_free -= k
                swap_s += link.batch_seconds(host_block_bytes, k, "dma", "d2h")
                cnt["swaps_out"] += 1
                cnt["swap_bytes"] += 2 * k * host_block_bytes  # out, and back later
                swapped.append(victim)
            else:  # recompute: what it held is prefilled again at re-admission
                cnt["recomputed_tokens"] += victim.done_prefill if victim.done_prefill < victim.to_prefill \
                    else victim.held
                if victim.done_prefill >= victim.to_prefill:
                    victim.to_prefill = victim.own + victim.generated - 1
                victim.done_prefill, victim.held, victim.reserved = 0, 0, 0
                waiting.appendleft(victim)
        free -= need
        ctx = 0
        for r in decoding:
            r.held += 1
            r.generated += 1
            ctx += r.held + r.skip
        budget = knobs.token_budget - len(decoding)
        chunks = []  # (request, tokens, its context before them)
        for r in running:
            if budget > 0 and r.done_prefill < r.to_prefill:
                budget, free = _chunk(r, budget, bs, free, chunks)
        spare = int(knobs.watermark * total)
        while budget > 0 and waiting and len(running) < knobs.max_batch and not preempted \
                and free - _admission_blocks(waiting[0], budget, bs, knobs) >= spare:
            r = waiting.popleft()
            running.append(r)
            r.reserved = -(-_reservation(r, knobs) // bs)
            free -= r.reserved
            cnt["prefix_hits"] += r.skip > 0 and r.generated == 0
            budget, free = _chunk(r, budget, bs, free, chunks)
        cnt["max_concurrency"] = max(cnt["max_concurrency"], len(running))
        if not decoding and not chunks and not swap_s:
            if pending:
                now = max(now, pending[0].arrival)
                continue
            raise RuntimeError("waiting or swapped requests can never run: the KV budget is too small for them")
        step = sm.decode_seconds(len(decoding), ctx) if decoding else 0.0
        step += sum(sm.prefill_seconds(tokens, before) for _, tokens, before in chunks) + swap_s
        cnt["swap_seconds"] += swap_s
        _account(shares, running, total - free, skip and shared_blocks * bs, bs, step)
        now += step
        for r, _, _ in chunks:
            if r.done_prefill >= r.to_prefill:  # its prefill is done: the next token (the first, or after a recompute)
                before = _blocks(r, bs)
                r.held = _kept(r, knobs) + (r.to_prefill - r.own)
                free += before - _blocks(r, bs)  # an eviction budget drops prompt tokens now
                r.generated += 1
                if r.first_token < 0:
                    r.first_token = first[r.idx] = now
        for r in [r for r in running if r.generated >= r.output and r.done_prefill >= r.to_prefill]:
            running.remove(r)
            free += _blocks(r, bs)
            finish[r.idx] = now
        times.append(now)
        used.append(total - free)
    arrival = np.array([r.arrival for r in reqs])
    in_use = sum(shares.values())
    cnt.update({f"share_{k}": v / in_use if in_use else 0.0 for k, v in shares.items()})
    return Result(trace.name, sm.scheme, knobs, total, block_bytes, arrival, first, finish,
                  np.array([r.output for r in reqs]), (np.array(times), np.array(used)), cnt)


def _account(shares: dict, running: list, used_blocks: int, shared_tokens: int, bs: int, dt: float) -> None:
    """Add ``dt`` seconds of the pool's used slots to ``shares``: token states (K/V of tokens held), reserved
    (slots a reservation holds for tokens still to come), and fragmentation (the rest: the unused tails of
    blocks, and reserved slots no token will ever fill) — the vLLM paper's Figure 2 categories."""
    held = shared_tokens + sum(r.held for r in running)
    future = sum(max(0, min(r.reserved * bs, r.own + r.output) - r.held) for r in running if r.reserved)
    slots = used_blocks * bs
    shares["token_states"] += held * dt
    shares["reserved"] += future * dt
    shares["fragmentation"] += max(0, slots - held - future) * dt


def _blocks(r: _Req, bs: int) -> int:
    return max(-(-r.held // bs), r.reserved)


def _reservation(r: _Req, knobs: Knobs) -> int:
    """Tokens an Orca-style request reserves at admission (0 when paged): ``max_len``, the power of two above its
    final length, or its final length (the oracle)."""
    final = r.own + r.output
    return {"paged": 0, "max": knobs.max_len, "pow2": 1 << (final - 1).bit_length(), "oracle": final}[knobs.reserve]


def _admission_blocks(r: _Req, budget: int, bs: int, knobs: Knobs) -> int:
    """Blocks admitting ``r`` takes now: its first chunk's, or its whole reservation."""
    return max(-(-min(budget, r.to_prefill) // bs), -(-_reservation(r, knobs) // bs))


def _chunk(r: _Req, budget: int, bs: int, free: int, chunks: list) -> tuple[int, int]:
    """Give ``r`` a prefill chunk from ``budget``, as many tokens as its last block and the free blocks take;
    returns ``(budget left, free blocks left)``."""
    want = min(budget, r.to_prefill - r.done_prefill)
    room = _blocks(r, bs) * bs - r.held + free * bs
    fit = min(want, room)
    if fit <= 0:
        return budget, free
    before = _blocks(r, bs)
    chunks.append((r, fit, r.held + r.skip))
    r.held += fit
    r.done_prefill += fit
    return budget - fit, free - (_blocks(r, bs) - before)  # a reservation already holds these blocks


def _kept(r: _Req, knobs: Knobs) -> int:
    """Own prompt tokens a request keeps after its prefill (``keep`` of them)."""
    return r.own if knobs.keep >= 1 else max(1, math.ceil(r.own * knobs.keep))
