"""The step loop: admission, growth by one token per running request per step, preemption, completion.

One step is one decoding iteration (iteration-level scheduling, as in Orca and vLLM):

1. requests that have arrived join the waiting queue (FCFS by arrival; all at step 0 when ``step_s`` is None,
   a saturated server);
2. admission: while the head of the queue gets memory and the batch is below ``max_batch``, it starts
   running; its prompt (plus tokens generated before a preemption) is stored at once;
3. growth: every running request stores one more token. A paged request that outgrows its blocks asks for
   another; if none is free, the running request that arrived last is preempted (its memory freed, it goes
   back to the queue's front): by *recompute* (its prompt and generated tokens are prefilled again at
   re-admission) or *swap* (its token states go to host memory and come back); memory is the same either
   way, the cost counters differ;
4. the memory breakdown is recorded (``workbench.sim.metrics``);
5. requests that have stored ``prompt + output`` tokens complete and free their memory.

The loop jumps from event to event (arrival, block needed, completion, compaction, a step after memory was
freed); between events the state moves linearly, so a 10k-request trace runs in about a second.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from workbench.sim import metrics
from workbench.sim import strategies as st
from workbench.sim.budget import Budget, kv_budget
from workbench.sim.traces import Trace

_NEED, _FINISH = 0, 1


@dataclass
class Result:
    """What one run produced.

    Attributes:
        strategy: the strategy's label.
        budget: the KV budget.
        trace: the trace's name.
        n_requests: requests in the trace.
        completed, rejected: requests that finished / could never run (longer than ``max_len`` or the pool).
        steps: simulated steps (one past the last).
        preemptions: times a running request was preempted.
        recomputed_tokens: prompt + generated tokens prefilled again after preemptions (recompute).
        swapped_bytes: bytes of token state moved to host and back (swap).
        copied_tokens: tokens copied by compaction.
        conversions: requests whose large tail block compaction moved into small blocks.
        rows: event rows, ``metrics.ROW_FIELDS`` -> int64 arrays ``[R]`` (slots).
        finish_step: ``[n_requests]`` step each request completed at, -1 if it did not.
        preemption: the preemption mode of the run, ``"recompute"`` or ``"swap"``.
        block_size: tokens per block of a fixed-block paged strategy (``Paged``), None for contiguous and
            adaptive strategies (no single block size).
        preempted_tokens: ``[preemptions]`` tokens each preempted request held when it was preempted (what a
            swap moves to the host), in order; the same in both modes.
        resumed_tokens: ``[resumes]`` tokens each preempted request brought back when it was re-admitted (what
            a swap moves back, what a recompute prefills again), in order; fewer than ``preemptions`` when a
            run stops (``max_steps``) or rejects a request while it is preempted. ``recomputed_tokens`` is
            their sum (recompute); ``swapped_bytes`` is ``(preempted_tokens.sum() + resumed_tokens.sum()) *
            bytes_per_token`` (swap).
    """

    strategy: str
    budget: Budget
    trace: str
    n_requests: int
    completed: int = 0
    rejected: int = 0
    steps: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    swapped_bytes: int = 0
    copied_tokens: int = 0
    conversions: int = 0
    rows: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    finish_step: np.ndarray = field(default=None, repr=False)
    preemption: str = "recompute"
    block_size: int | None = None
    preempted_tokens: np.ndarray = field(default=None, repr=False)
    resumed_tokens: np.ndarray = field(default=None, repr=False)

    def series(self, name: str) -> np.ndarray:
        """Per-step series ``[steps]`` of a row field (``batch``, ``token``, ``free``, ...), in slots."""
        if name not in metrics.ROW_FIELDS:
            raise ValueError(f"name must be one of {metrics.ROW_FIELDS}, got {name!r}")
        if name == "step":
            return np.arange(self.steps)
        return metrics.expand(self.rows, name, self.steps)

    def average(self, saturated: bool = False) -> metrics.Breakdown:
        """Time-averaged breakdown (slots); ``saturated`` keeps only steps with requests waiting."""
        return metrics.time_average(self.rows, self.steps, self.budget.slots, saturated)

    def mean_batch(self, saturated: bool = False) -> float:
        lengths = metrics.segment_lengths(self.rows["step"], self.steps).astype(np.float64)
        if saturated:
            lengths = lengths * (self.rows["waiting"] > 0)
        return float((self.rows["batch"] * lengths).sum() / lengths.sum()) if lengths.sum() else 0.0

    def summary(self) -> dict:
        """Counts, throughput (requests per step), completion rate, mean batch and time-averaged shares.

        ``shares_pct`` averages all steps, ``shares_pct_saturated`` only steps with requests waiting; ``detail_pct``
        splits the pool into the six parts of ``workbench.sim.metrics`` (all steps).
        """
        avg, sat = self.average(), self.average(saturated=True)
        return {
            "strategy": self.strategy, "trace": self.trace, "requests": self.n_requests,
            "kv_gib": round(self.budget.kv_gib, 3), "slots": self.budget.slots,
            "completed": self.completed, "rejected": self.rejected, "steps": self.steps,
            "throughput_req_per_step": self.completed / self.steps if self.steps else 0.0,
            "completion_rate": self.completed / self.n_requests,
            "mean_batch": round(self.mean_batch(), 3), "peak_batch": int(self.rows["batch"].max(initial=0)),
            "preemptions": self.preemptions, "recomputed_tokens": self.recomputed_tokens,
            "swapped_bytes": self.swapped_bytes, "copied_tokens": self.copied_tokens,
            "conversions": self.conversions,
            "shares_pct": {k: round(v, 2) for k, v in avg.paper().items()},
            "shares_pct_saturated": {k: round(v, 2) for k, v in sat.paper().items()},
            "detail_pct": {k: round(100 * v, 2) for k, v in avg.shares().items()},
            "block_utilization": round(avg.block_utilization, 4),
        }


def run(trace: Trace, strategy: str | st.Strategy = "vllm", budget: Budget | None = None, *,
        preemption: str = "recompute", max_batch: int = 256, max_steps: int | None = None,
        step_s: float | None = None, check: bool = False) -> Result:
    """Serve ``trace`` with ``strategy`` in ``budget`` and record memory at every step.

    Args:
        trace: requests (``workbench.sim.traces``).
        strategy: a name of ``strategies.STRATEGIES`` or a config.
        budget: KV memory (default: 12 GiB at 800 KiB a token, the vLLM paper's OPT-13B on an A100-40GB).
        preemption: ``"recompute"`` or ``"swap"``.
        max_batch: most requests running at once.
        max_steps: stop after this many steps (completion rate within a step budget).
        step_s: seconds per step to place arrivals in time; None puts every request in the queue at step 0.
        check: verify the invariants at every event (slow; for tests).

    Returns:
        A ``Result``.
    """
    cfg = st.get(strategy)
    budget = kv_budget("llama-13b", kv_gib=12) if budget is None else budget
    if preemption not in ("recompute", "swap"):
        raise ValueError(f"preemption must be 'recompute' or 'swap', got {preemption!r}")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps must be an integer >= 1 or None, got {max_steps!r}")
    if step_s is not None and not step_s > 0:
        raise ValueError(f"step_s must be > 0 or None, got {step_s}")
    if not isinstance(trace, Trace) or len(trace) == 0:
        raise ValueError("trace must be a non-empty workbench.sim.traces.Trace")

    mgr = cfg.build(budget.slots)
    reqs = trace.requests
    n = len(reqs)
    arrive = [0] * n if step_s is None else [int(r.arrival_s // step_s) for r in reqs]
    res = Result(cfg.label, budget, trace.name, n, preemption=preemption,
                 block_size=cfg.block_size if isinstance(cfg, st.Paged) else None)
    preempted_tokens: list[int] = []  # per preemption / re-admission event (Result.preempted/resumed_tokens)
    resumed_tokens: list[int] = []
    finish = np.full(n, -1, dtype=np.int64)
    rows: dict[str, list[int]] = {k: [] for k in metrics.ROW_FIELDS}
    bpt = budget.bytes_per_token
    swap = preemption == "swap"

    waiting: list[int] = []  # heap of request indices (FCFS)
    parked: dict[int, st.Seq] = {}  # preempted requests keep their progress
    running: dict[int, st.Seq] = {}
    events: list[tuple[int, int, int, int]] = []  # (step, kind, idx, version)
    tok = mincf = over = 0  # sum c, sum min(cap, F), sum max(cap - F, 0) over running
    nxt = 0
    s = arrive[0]
    prev = s

    def account(q: st.Seq, sign: int) -> None:
        nonlocal mincf, over
        mincf += sign * min(q.cap, q.F)
        over += sign * max(q.cap - q.F, 0)

    def schedule_need(q: st.Seq, c: int, step: int) -> None:
        if q.cap < q.F:  # the step at which c reaches cap + 1
            heapq.heappush(events, (step + q.cap - c + 1, _NEED, q.idx, q.ver))

    def preempt(q: st.Seq, step: int) -> None:
        nonlocal tok
        tok -= q.p + q.g + 1 + (step - q.a)  # its token of this step is not produced
        q.g += step - q.a
        account(q, -1)
        mgr.release(q)
        del running[q.idx]
        q.ver += 1
        parked[q.idx] = q
        heapq.heappush(waiting, q.idx)
        res.preemptions += 1
        preempted_tokens.append(q.p + q.g)
        if swap:
            res.swapped_bytes += (q.p + q.g) * bpt

    while True:
        tok += len(running) * (s - prev)  # every running request stored one token per step since `prev`
        prev = s
        while nxt < n and arrive[nxt] <= s:
            r = reqs[nxt]
            if r.total > cfg.max_len:
                res.rejected += 1
            else:
                heapq.heappush(waiting, nxt)
            nxt += 1
        # admission (FCFS; the head blocks the queue)
        while waiting and len(running) < max_batch:
            i = waiting[0]
            q = parked.get(i) or st.Seq(i, reqs[i].prompt, reqs[i].output)
            c0 = q.p + q.g + 1
            if not mgr.fits_ever(q, c0):
                heapq.heappop(waiting)
                parked.pop(i, None)
                res.rejected += 1
                continue
            if not mgr.admit(q, c0):
                if not running:  # an empty pool that cannot take it: it never will
                    heapq.heappop(waiting)
                    parked.pop(i, None)
                    res.rejected += 1
                    continue
                break
            heapq.heappop(waiting)
            if parked.pop(i, None) is not None:
                resumed_tokens.append(q.p + q.g)
                if swap:
                    res.swapped_bytes += (q.p + q.g) * bpt
                else:
                    res.recomputed_tokens += q.p + q.g
            q.a = s
            running[i] = q
            tok += c0
            account(q, +1)
            heapq.heappush(events, (s + q.o - q.g - 1, _FINISH, i, q.ver))
            schedule_need(q, c0, s)
        freed = False
        # growth: requests that outgrow their blocks at this step
        while events and events[0][0] == s and events[0][1] == _NEED:
            _, _, i, ver = heapq.heappop(events)
            q = running.get(i)
            if q is None or q.ver != ver:
                continue
            c = q.p + q.g + 1 + (s - q.a)
            while True:
                account(q, -1)
                ok = mgr.grow(q, c)
                account(q, +1)
                if ok:
                    schedule_need(q, c, s)
                    break
                victim = running[max(running)]  # the request that arrived last
                preempt(victim, s)
                freed = True
                if victim is q:
                    break
        if mgr.compact_every and s % mgr.compact_every == 0 and running:
            seqs = [(q, q.p + q.g + 1 + (s - q.a)) for q in running.values()]
            for q, _ in seqs:
                account(q, -1)
            copied, changed = mgr.compact(seqs)
            for q, _ in seqs:
                account(q, +1)
            res.copied_tokens += copied
            res.conversions += len(changed)
            for q, _old in changed:
                q.ver += 1  # reschedule its events with the new cap
                c = q.p + q.g + 1 + (s - q.a)
                heapq.heappush(events, (s + q.o - q.g - 1 - (s - q.a), _FINISH, q.idx, q.ver))
                schedule_need(q, c, s)
        # record the step
        head = None
        if waiting:
            i = waiting[0]
            head = parked.get(i) or st.Seq(i, reqs[i].prompt, reqs[i].output)
        ext = mgr.external(head)
        held = mincf + over
        row = (s, len(running), len(waiting), tok, mincf - tok, over, mgr.allocated - held, ext,
               budget.slots - mgr.allocated - ext)
        for key, val in zip(metrics.ROW_FIELDS, row, strict=True):
            rows[key].append(val)
        if check:
            _check(running, mgr, s, tok, budget.slots, ext, cfg)
        # completion
        while events and events[0][0] == s:
            _, kind, i, ver = heapq.heappop(events)
            q = running.get(i)
            if q is None or q.ver != ver:
                continue
            if kind == _NEED:  # a need pushed at this step after growth ran (cannot happen: cap >= c)
                raise AssertionError("block need scheduled in the past")
            tok -= q.F
            account(q, -1)
            mgr.release(q)
            mgr.on_finish(q.F)
            del running[i]
            finish[i] = s
            res.completed += 1
            freed = True
        # next event
        cands = []
        if events:
            cands.append(events[0][0])
        if nxt < n:
            cands.append(max(arrive[nxt], s + 1))
        if freed and (running or waiting or nxt < n):  # record the post-completion state (and admit) next
            cands.append(s + 1)
        if mgr.compact_every and running:
            cands.append((s // mgr.compact_every + 1) * mgr.compact_every)
        if not cands:
            res.steps = s + 1
            break
        nxt_s = min(cands)
        if max_steps is not None and nxt_s >= max_steps:
            res.steps = max(max_steps, s + 1)
            break
        s = nxt_s

    res.rows = {k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}
    res.finish_step = finish
    res.preempted_tokens = np.asarray(preempted_tokens, dtype=np.int64)
    res.resumed_tokens = np.asarray(resumed_tokens, dtype=np.int64)
    return res


def _check(running: dict[int, st.Seq], mgr: st.Manager, s: int, tok: int, slots: int, ext: int, cfg) -> None:
    """Invariants at an event step (recomputed from scratch)."""
    total = 0
    for q in running.values():
        c = q.p + q.g + 1 + (s - q.a)
        gen = c - q.p
        assert 1 <= gen <= q.o, f"request {q.idx}: generated {gen} of {q.o} at step {s}"
        assert c <= q.cap, f"request {q.idx}: {c} tokens in {q.cap} slots at step {s}"
        if mgr.block_size is not None:
            assert q.cap - c < mgr.block_size, f"request {q.idx}: waste {q.cap - c} >= block {mgr.block_size}"
        total += c
    assert total == tok, f"token sum {tok} != {total} at step {s}"
    free = mgr.count_free()
    assert free + mgr.allocated == slots, f"free {free} + allocated {mgr.allocated} != budget {slots} at step {s}"
    assert 0 <= ext <= free, f"external {ext} outside [0, free={free}] at step {s}"
