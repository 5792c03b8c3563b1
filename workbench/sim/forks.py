"""Request groups that share KV blocks: parallel sampling and beam search, with copy-on-write (issue 15).

The vLLM paper (Kwon et al., SOSP'23, section 6.3) serves OPT-13B with ``n`` parallel samples or a beam of
width ``k`` per request and reports, in its Figure 15, "the amount of memory saving, computed by the number
of blocks we saved by sharing divided by the number of total blocks without sharing": 6.1%-9.8% (parallel)
and 37.6%-55.2% (beam) on Alpaca, 16.2%-30.5% and 44.3%-66.3% on ShareGPT (:data:`PAPER`).

What is modelled here (block size 16 unless told):

- every request of a trace is a *group* of ``n`` sequences. Its prompt is stored once (``ceil(p / B)`` blocks,
  reference count ``n``); at local step ``t`` (``0 <= t < output``) every sequence stores ``p + t + 1`` tokens
  (the engine's convention: step 0 stores the prompt and the first token). Every sequence generates exactly
  the request's output length (vLLM's benchmark sets ``ignore_eos=True, max_tokens=output_len``).
- appending to a sequence whose last block is partly filled and shared copies that block first (copy-on-write,
  counted in ``cow``); the last holder writes in place, so a block shared ``m`` ways costs ``m - 1`` copies.
  A full last block means a fresh private block, no copy.
- ``parallel``: the samples share the prompt's full blocks for their whole life; the partial prompt block is
  copied by ``n - 1`` samples at step 0; generated tokens are private.
- ``beam``: at step 0 every beam forks from the prompt (as above). At each later step child ``i`` of the ``k``
  new beams takes the current best beam (rank 0) as its parent with probability ``p_top``, else continues its
  own beam ``i`` (child 0 always continues beam 0). A beam no child continues dies and its blocks are released;
  a parent with ``m`` children is forked ``m - 1`` times (its block table shared, reference counts up). So
  ``p_top = 0`` is ``k`` independent beams (parallel sampling), ``p_top = 1`` is every beam a child of the
  best one at every step. The default :data:`DEFAULT_P_TOP` = 0.25 is a round value chosen before any run,
  not fitted to the paper; :func:`sensitivity` shows the saving over ``p_top`` and the value each paper figure
  implies. The draws are ``rng.random((output - 1, k)) < p_top`` per group (a generator seeded by the run's
  seed and the request id), so a run is reproducible.
- *blocks with sharing* = distinct physical blocks the group holds (a real per-block reference count,
  :class:`RefPool`); *blocks without sharing* = ``sum over sequences of ceil(len / B)`` (each sequence its own
  copy). Both are recorded at every step.
- :func:`serve` runs the groups through a server: FCFS admission of whole groups into a KV budget (default the
  paper's 12 GiB of OPT-13B = 983 blocks of 16, at most 256 sequences, 1% watermark), every running group one
  step per step, and when the next step does not fit, the most recently admitted group is swapped out (vLLM
  swaps multi-sequence groups) and resumes later at the step it left.

The saving reported is the paper's ratio of time-averages: ``1 - sum(shared) / sum(unshared)`` over the steps of
the run. Because a swapped group resumes where it left, every group's whole lifetime is counted exactly once,
so this number does not depend on the request rate or the budget (``lifetime_saving`` computes it without a
server); ``saving(saturated=True)`` keeps only steps with requests waiting, the memory-bound operating point.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from workbench.sim import traces as tr
from workbench.sim.budget import Budget, kv_budget

MODES = ("parallel", "beam")
WIDTHS = (2, 4, 6)
DEFAULT_P_TOP = 0.25
# Section 6.3 of the paper, percent: (smallest, largest) saving over n / beam width 2, 4, 6. The text gives only
# the range; we read its ends as n = 2 and n = 6 (sharing grows with n). The n = 4 bars are not stated.
PAPER: dict[tuple[str, str], tuple[float, float]] = {
    ("alpaca", "parallel"): (6.1, 9.8),
    ("alpaca", "beam"): (37.6, 55.2),
    ("sharegpt", "parallel"): (16.2, 30.5),
    ("sharegpt", "beam"): (44.3, 66.3),
}
PAPER_SOURCE = (
    "Kwon et al., Efficient Memory Management for Large Language Model Serving with PagedAttention, "
    "SOSP'23 (arXiv 2309.06180), section 6.3: 'Fig. 15 plots the amount of memory saving, computed by the "
    "number of blocks we saved by sharing divided by the number of total blocks without sharing. We show "
    "6.1% - 9.8% memory saving on parallel sampling and 37.6% - 55.2% on beam search. In the same "
    "experiments with the ShareGPT dataset, we saw 16.2% - 30.5% memory saving on parallel sampling and "
    "44.3% - 66.3% on beam search.' (OPT-13B, Alpaca first)"
)
SERIES = ("step", "groups", "seqs", "waiting", "shared", "unshared")


def _int(name: str, v: object, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _prob(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not 0 <= v <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
    return float(v)


def _mode(v: object) -> str:
    if v not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {v!r}")
    return str(v)


class RefPool:
    """Physical blocks with reference counts; ``ref[b]`` = block tables holding block ``b`` (0: free).

    A block table is a list of block ids. ``in_use`` counts blocks with ``ref > 0``; ``copies`` counts
    copy-on-write copies. Every method checks before it changes anything: a reference count never goes
    below zero, a free block is never referenced.
    """

    def __init__(self, block_size: int = 16):
        self.B = _int("block_size", block_size)
        self.ref: list[int] = []
        self.free: list[int] = []
        self.in_use = 0
        self.copies = 0

    def alloc(self) -> int:
        """A fresh block with reference count 1."""
        if self.free:
            b = self.free.pop()
        else:
            b = len(self.ref)
            self.ref.append(0)
        self.ref[b] = 1
        self.in_use += 1
        return b

    def new_table(self, tokens: int) -> list[int]:
        """A private table for ``tokens`` tokens (``ceil(tokens / B)`` fresh blocks)."""
        return [self.alloc() for _ in range(-(-_int("tokens", tokens) // self.B))]

    def fork(self, table: list[int]) -> list[int]:
        """A second table holding the same blocks (every reference count + 1)."""
        self._held(table)
        return self._fork(table)

    def release(self, table: list[int]) -> None:
        """Drop a table's references (and empty it); blocks nobody holds any more become free."""
        self._held(table)
        self._release(table)

    def append(self, table: list[int], length: int, m: int = 1) -> int:
        """Room for ``m`` more tokens after ``length`` in ``table`` (copy-on-write first); returns the new length."""
        length, m = _int("length", length, 0), _int("m", m)
        self._held(table)
        if len(table) != -(-length // self.B):
            raise ValueError(
                f"table must hold ceil(length / {self.B}) = {-(-length // self.B)} blocks, got {len(table)}"
            )
        self._append(table, length, m)
        return length + m

    def _held(self, table: list[int]) -> None:
        if (
            not isinstance(table, list)
            or len(set(table)) != len(table)
            or any(not isinstance(b, int) or not 0 <= b < len(self.ref) or self.ref[b] < 1 for b in table)
        ):
            raise ValueError("table must be a list of distinct blocks in use")

    # unchecked versions (the simulation's tables are valid by construction)
    def _fork(self, table: list[int]) -> list[int]:
        ref = self.ref
        for b in table:
            ref[b] += 1
        return list(table)

    def _release(self, table: list[int]) -> None:
        ref, free = self.ref, self.free
        for b in table:
            r = ref[b] - 1
            if r <= 0:
                if r < 0:
                    raise AssertionError(f"block {b}: reference count below zero")
                free.append(b)
                self.in_use -= 1
            ref[b] = r
        table.clear()

    def _append(self, table: list[int], length: int, m: int) -> None:
        B = self.B
        if length % B and self.ref[table[-1]] > 1:  # the shared, partly filled last block: copy it, then write
            self.ref[table[-1]] -= 1
            table[-1] = self.alloc()
            self.copies += 1
        for _ in range(-(-(length + m) // B) - len(table)):
            table.append(self.alloc())

    def check(self, tables: list[list[int]]) -> None:
        """Assert every reference count equals the tables holding the block, and ``in_use`` agrees."""
        count = [0] * len(self.ref)
        for t in tables:
            for b in t:
                count[b] += 1
        assert count == self.ref, "reference counts differ from the block tables"
        assert min(self.ref, default=0) >= 0, "negative reference count"
        assert self.in_use == sum(r > 0 for r in self.ref) == len(self.ref) - len(self.free)


@dataclass(frozen=True)
class GroupCurve:
    """One request group over its life: per local step ``t`` (``[output]`` int64 arrays).

    Attributes:
        shared: distinct physical blocks the group holds after step ``t``.
        unshared: blocks its sequences would hold with no sharing (``n * ceil((p + t + 1) / B)``).
        cow: copy-on-write copies over its life.
        leaked: blocks still referenced after every sequence was released (0 unless there is a bug).
    """

    shared: np.ndarray
    unshared: np.ndarray
    cow: int
    leaked: int = 0


def simulate_group(
    prompt: int,
    output: int,
    mode: str = "parallel",
    n: int = 2,
    *,
    block_size: int = 16,
    p_top: float = DEFAULT_P_TOP,
    rng: np.random.Generator | int | None = 0,
    check: bool = False,
) -> GroupCurve:
    """One group of ``n`` sequences (samples or beams) of a ``prompt``-token request generating ``output`` tokens.

    ``rng``: the generator of the beam draws (or a seed); unused by ``parallel``. ``check``: verify every
    reference count against the block tables at every step (slow; for tests).
    """
    prompt, output, n = _int("prompt", prompt), _int("output", output), _int("n", n)
    mode, p_top = _mode(mode), _prob("p_top", p_top)
    B = _int("block_size", block_size)
    if not isinstance(rng, np.random.Generator):
        if rng is not None and (isinstance(rng, bool) or not isinstance(rng, (int, np.integer))):
            raise ValueError(f"rng must be a numpy Generator, an int seed or None, got {rng!r}")
        rng = np.random.default_rng(rng)
    # ---- arguments checked; state changes below ----
    pool = RefPool(B)
    shared = np.empty(output, dtype=np.int64)
    unshared = np.empty(output, dtype=np.int64)
    first = pool.new_table(prompt)
    tables = [first] + [pool._fork(first) for _ in range(n - 1)]
    length = prompt
    for t in tables:  # step 0: every sequence writes its first token (copy-on-write of a partial prompt block)
        pool._append(t, length, 1)
    length += 1
    shared[0], unshared[0] = pool.in_use, sum(map(len, tables))
    if check:
        pool.check(tables)
    if mode == "parallel" or n == 1:
        t0 = 1
        while t0 < output:  # jump block boundary to block boundary: nothing changes in between
            t1 = min(output, t0 + B - length % B)
            for t in tables:
                pool._append(t, length, t1 - t0)
            length += t1 - t0
            shared[t0:t1], unshared[t0:t1] = pool.in_use, sum(map(len, tables))
            if check:
                pool.check(tables)
            t0 = t1
    else:
        top = (rng.random((output - 1, n)) < p_top).tolist()  # [output - 1][n]: child i is a child of beam 0
        for step in range(1, output):
            row = top[step - 1]
            for i in range(1, n):
                if row[i]:  # beam i dies, its slot goes to another child of the best beam
                    pool._release(tables[i])
                    tables[i] = pool._fork(tables[0])
            for t in tables:
                pool._append(t, length, 1)
            length += 1
            shared[step], unshared[step] = pool.in_use, sum(map(len, tables))
            if check:
                pool.check(tables)
    for t in tables:
        pool._release(t)
    leaked = pool.in_use + sum(r != 0 for r in pool.ref)
    return GroupCurve(shared, unshared, pool.copies, leaked)


def _groups(
    trace: tr.Trace, mode: str, n: int, block_size: int, p_top: float, seed: int, check: bool
) -> list[GroupCurve]:
    return [
        simulate_group(
            r.prompt,
            r.output,
            mode,
            n,
            block_size=block_size,
            p_top=p_top,
            rng=np.random.default_rng([seed, r.id]),
            check=check,
        )
        for r in trace.requests
    ]


def _trace(trace: str | tr.Trace, requests: int | None) -> tr.Trace:
    if requests is not None:
        requests = _int("requests", requests)
    if isinstance(trace, tr.Trace):
        t = trace
    elif isinstance(trace, str):
        t = tr.load(trace)
    else:
        raise ValueError(f"trace must be a preset name, a JSONL path or a Trace, got {trace!r}")
    if len(t) == 0:
        raise ValueError("trace must hold at least one request")
    return t.head(requests) if requests is not None and requests < len(t) else t


def lifetime_saving(
    trace: str | tr.Trace,
    mode: str = "parallel",
    n: int = 2,
    *,
    block_size: int = 16,
    p_top: float = DEFAULT_P_TOP,
    seed: int = 0,
    requests: int | None = None,
) -> float:
    """``1 - sum(shared) / sum(unshared)`` over every group's whole life (what :func:`serve` reports, without
    a server: swapped groups resume, so the schedule does not change it)."""
    mode, n, p_top = _mode(mode), _int("n", n), _prob("p_top", p_top)
    seed, block_size = _int("seed", seed, 0), _int("block_size", block_size)
    g = _groups(_trace(trace, requests), mode, n, block_size, p_top, seed, False)
    return 1 - sum(int(c.shared.sum()) for c in g) / sum(int(c.unshared.sum()) for c in g)


@dataclass
class ForkResult:
    """What :func:`serve` produced. ``rows``: per step, ``SERIES`` -> int64 arrays ``[steps]``."""

    mode: str
    n: int
    trace: str
    block_size: int
    p_top: float | None
    budget_blocks: int
    requests: int
    completed: int = 0
    rejected: int = 0
    preemptions: int = 0
    cow: int = 0
    leaked: int = 0
    rows: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def series(self, name: str) -> np.ndarray:
        if name not in SERIES:
            raise ValueError(f"name must be one of {SERIES}, got {name!r}")
        return self.rows[name]

    def saving(self, saturated: bool = False) -> float:
        """Blocks saved by sharing over blocks needed without it, time-averaged (``saturated``: only steps with
        requests waiting)."""
        keep = self.rows["waiting"] > 0 if saturated else slice(None)
        sh, un = self.rows["shared"][keep].sum(), self.rows["unshared"][keep].sum()
        return float(1 - sh / un) if un else 0.0

    def summary(self) -> dict:
        steps = len(self.rows["step"])
        busy = self.rows["groups"] > 0
        sat = self.saving(saturated=True) if steps and (self.rows["waiting"] > 0).any() else None
        return {
            "trace": self.trace,
            "mode": self.mode,
            "n": self.n,
            "p_top": self.p_top,
            "block_size": self.block_size,
            "budget_blocks": self.budget_blocks,
            "requests": self.requests,
            "completed": self.completed,
            "rejected": self.rejected,
            "steps": steps,
            "preemptions": self.preemptions,
            "saving_pct": round(100 * self.saving(), 2),
            "saving_saturated_pct": None if sat is None else round(100 * sat, 2),
            "blocks_shared_mean": round(float(self.rows["shared"].mean()), 2) if steps else 0.0,
            "blocks_unshared_mean": round(float(self.rows["unshared"].mean()), 2) if steps else 0.0,
            "mean_groups": round(float(self.rows["groups"][busy].mean()), 2) if busy.any() else 0.0,
            "mean_seqs": round(float(self.rows["seqs"][busy].mean()), 2) if busy.any() else 0.0,
            "cow_copies": self.cow,
            "cow_per_request": round(self.cow / self.requests, 3),
        }


def serve(
    trace: str | tr.Trace = "alpaca",
    mode: str = "parallel",
    n: int = 2,
    *,
    block_size: int = 16,
    p_top: float = DEFAULT_P_TOP,
    budget: Budget | None = None,
    max_seqs: int = 256,
    watermark: float = 0.01,
    step_s: float | None = None,
    seed: int = 0,
    requests: int | None = None,
    check: bool = False,
) -> ForkResult:
    """Serve every request of ``trace`` as a group of ``n`` sharing sequences and record blocks at every step.

    Args:
        trace: ``"alpaca"``, ``"sharegpt"``, a JSONL path or a ``Trace``.
        mode: ``"parallel"`` (``n`` samples) or ``"beam"`` (width ``n``).
        block_size: tokens per block.
        p_top: beam search's chance that a beam slot goes to a child of the best beam (ignored by parallel).
        budget: KV memory (default: 12 GiB of OPT-13B / ``llama-13b``, the paper's A100-40GB: 983 blocks of 16).
        max_seqs: most sequences running at once (vLLM's ``max_num_seqs``).
        watermark: share of blocks kept free at admission.
        step_s: seconds per step to place arrivals in time; None queues every request at step 0 (saturated).
        seed: seed of the beam draws.
        requests: use the first ``requests`` requests.
        check: verify reference counts at every step of every group.
    """
    mode, n, p_top = _mode(mode), _int("n", n), _prob("p_top", p_top)
    block_size, max_seqs, seed = _int("block_size", block_size), _int("max_seqs", max_seqs), _int("seed", seed, 0)
    if budget is not None and not isinstance(budget, Budget):
        raise ValueError(f"budget must be a workbench.sim.budget.Budget or None, got {budget!r}")
    budget = kv_budget("llama-13b", kv_gib=12) if budget is None else budget
    total = budget.slots // block_size
    if total < 1:
        raise ValueError(f"budget must hold at least one block of {block_size} tokens, got {budget.slots} slots")
    if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a number in [0, 1), got {watermark!r}")
    if step_s is not None and (isinstance(step_s, bool) or not isinstance(step_s, (int, float)) or not step_s > 0):
        raise ValueError(f"step_s must be a number > 0 or None, got {step_s!r}")
    if n > max_seqs:
        raise ValueError(f"n must be <= max_seqs={max_seqs}, got {n}")
    t = _trace(trace, requests)
    # ---- arguments checked ----
    curves = _groups(t, mode, n, block_size, p_top, seed, check)
    sh = [c.shared.tolist() for c in curves]
    un = [c.unshared.tolist() for c in curves]
    out = [len(s) for s in sh]
    G = len(curves)
    arrive = [0] * G if step_s is None else [int(r.arrival_s // step_s) for r in t.requests]
    wm = int(watermark * total)
    res = ForkResult(
        mode,
        n,
        t.name,
        block_size,
        p_top if mode == "beam" else None,
        total,
        G,
        cow=sum(c.cow for c in curves),
        leaked=sum(c.leaked for c in curves),
    )
    pos = [0] * G  # local step of each group
    waiting: deque[int] = deque()
    running: list[int] = []  # admission order
    rows: dict[str, list[int]] = {k: [] for k in SERIES}
    nxt, s = 0, arrive[0]
    while True:
        while nxt < G and arrive[nxt] <= s:
            if max(sh[nxt]) > total:
                res.rejected += 1
            else:
                waiting.append(nxt)
            nxt += 1
        used = sum(sh[g][pos[g]] for g in running)
        while used > total:  # the step does not fit: swap out the group admitted last (it resumes where it left)
            g = running.pop()
            used -= sh[g][pos[g]]
            waiting.appendleft(g)
            res.preemptions += 1
        while waiting and (len(running) + 1) * n <= max_seqs:  # FCFS: the head blocks the queue
            g = waiting[0]
            if running and used + sh[g][pos[g]] > total - wm:
                break
            waiting.popleft()
            running.append(g)
            used += sh[g][pos[g]]
        for key, val in zip(
            SERIES,
            (s, len(running), len(running) * n, len(waiting), used, sum(un[g][pos[g]] for g in running)),
            strict=True,
        ):
            rows[key].append(val)
        still = []
        for g in running:
            pos[g] += 1
            if pos[g] == out[g]:
                res.completed += 1
            else:
                still.append(g)
        running = still
        if not running and not waiting:
            if nxt >= G:
                break
            s = arrive[nxt]  # idle until the next arrival (no blocks held: nothing to record)
        else:
            s += 1
    res.rows = {k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}
    return res


def _paper(trace_name: str, mode: str, n: int) -> float | None:
    key = next((k for k in PAPER if trace_name.startswith(k[0]) and k[1] == mode), None)
    if key is None:
        return None
    return {2: PAPER[key][0], 6: PAPER[key][1]}.get(n)


def table(
    traces: tuple[str | tr.Trace, ...] = ("alpaca", "sharegpt"),
    modes: tuple[str, ...] = MODES,
    ns: tuple[int, ...] = WIDTHS,
    *,
    requests: int | None = None,
    **kw,
) -> list[dict]:
    """Tidy rows, one per trace x mode x n: :meth:`ForkResult.summary` plus the paper's figure and the gap.

    ``paper_pct`` is the end of the paper's range that ``n`` stands for (n = 2: low end, n = 6: high end; None
    otherwise, or for a trace the paper did not run); ``gap_pp`` = ours - paper in percentage points.
    ``kw`` goes to :func:`serve`.
    """
    for m in modes:
        _mode(m)
    for v in ns:
        _int("n", v)
    loaded = [_trace(trace, requests) for trace in traces]  # every argument checked before the first run
    rows = []
    for t in loaded:
        for m in modes:
            for v in ns:
                row = serve(t, m, v, **kw).summary()
                row["paper_pct"] = _paper(t.name, m, v)
                row["paper_range_pct"] = next(
                    (list(p) for k, p in PAPER.items() if t.name.startswith(k[0]) and k[1] == m), None
                )
                row["gap_pp"] = None if row["paper_pct"] is None else round(row["saving_pct"] - row["paper_pct"], 2)
                rows.append(row)
    return rows


def sensitivity(
    traces: tuple[str | tr.Trace, ...] = ("alpaca", "sharegpt"),
    ns: tuple[int, ...] = WIDTHS,
    p_tops: tuple[float, ...] = (0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
    *,
    requests: int | None = 1000,
    block_size: int = 16,
    seed: int = 0,
) -> list[dict]:
    """Beam search's saving (percent, :func:`lifetime_saving`) over ``p_top``; one row per trace x width, with the
    ``p_top`` the paper's figure implies (linear interpolation on the grid; None outside it or when not stated)."""
    p_tops = tuple(sorted(_prob("p_tops entry", p) for p in p_tops))
    for v in ns:
        _int("n", v)
    loaded = [_trace(trace, requests) for trace in traces]
    rows = []
    for t in loaded:
        for v in ns:
            sav = [
                round(100 * lifetime_saving(t, "beam", v, block_size=block_size, p_top=p, seed=seed), 2) for p in p_tops
            ]
            paper = _paper(t.name, "beam", v)
            rows.append(
                {
                    "trace": t.name,
                    "n": v,
                    "p_top": list(p_tops),
                    "saving_pct": sav,
                    "paper_pct": paper,
                    "implied_p_top": _invert(p_tops, sav, paper),
                }
            )
    return rows


def _invert(xs, ys, y) -> float | None:
    if y is None:
        return None
    for i in range(len(xs) - 1):
        (x0, x1), (y0, y1) = xs[i : i + 2], ys[i : i + 2]
        if y0 != y1 and min(y0, y1) <= y <= max(y0, y1):
            return round(x0 + (y - y0) * (x1 - x0) / (y1 - y0), 3)
    return None


def format_table(rows: list[dict]) -> str:
    """A text table of :func:`table`: our saving against the paper's, blocks with / without sharing, CoW copies."""
    lines = [
        "Memory saved by sharing (vLLM paper, section 6.3 / Figure 15): blocks saved / blocks without sharing, "
        "time-averaged over the run",
        f"{'trace':<14} {'mode':<9} {'n':>2} {'ours %':>7} {'paper %':>8} {'gap pp':>7} {'saturated %':>12} "
        f"{'blocks shared / not':>20} {'CoW/req':>8} {'groups':>7} {'preempt':>8}",
    ]
    for r in rows:
        paper = "-" if r["paper_pct"] is None else f"{r['paper_pct']:.1f}"
        gap = "-" if r["gap_pp"] is None else f"{r['gap_pp']:+.1f}"
        sat = "-" if r["saving_saturated_pct"] is None else f"{r['saving_saturated_pct']:.1f}"
        blocks = f"{r['blocks_shared_mean']:.0f} / {r['blocks_unshared_mean']:.0f}"
        lines.append(
            f"{r['trace']:<14} {r['mode']:<9} {r['n']:>2} {r['saving_pct']:>7.1f} {paper:>8} {gap:>7} "
            f"{sat:>12} {blocks:>20} {r['cow_per_request']:>8.2f} {r['mean_groups']:>7.1f} "
            f"{r['preemptions']:>8}"
        )
    beams = {r["p_top"] for r in rows if r["mode"] == "beam"}
    if beams:
        lines.append(
            f"beam model: p_top = {', '.join(str(p) for p in sorted(beams))} (chance a beam slot goes to a "
            f"child of the best beam; not fitted, see --sensitivity)"
        )
    lines.append("paper: the text states only each range; its ends are read as n = 2 and n = 6, n = 4 is not stated")
    return "\n".join(lines)


def format_against_paper(rows: list[dict]) -> str:
    """Rows of :func:`table` (or a committed ``sim_forks-*.json``'s) as one short line each: the saving against
    the paper's figure for that width and the gap in points, or that the paper gives none."""
    lines = []
    for r in rows:
        given = r["paper_pct"] is not None
        paper = f"paper {r['paper_pct']:.1f}% (gap {r['gap_pp']:+.1f})" if given else "paper: not given"
        lines.append(f"{r['trace']:>14} {r['mode']:>8} n={r['n']}: saves {r['saving_pct']:5.1f}%  {paper}")
    return "\n".join(lines)


def format_sensitivity(rows: list[dict]) -> str:
    if not rows:
        return ""
    grid = rows[0]["p_top"]
    lines = [
        "beam search saving (%) over p_top (lifetime ratio, first requests of each trace)",
        f"{'trace':<14} {'width':>5} " + " ".join(f"{p:>6g}" for p in grid) + f" {'paper':>6} {'implied':>8}",
    ]
    for r in rows:
        paper = "-" if r["paper_pct"] is None else f"{r['paper_pct']:.1f}"
        imp = "-" if r["implied_p_top"] is None else f"{r['implied_p_top']:.3f}"
        lines.append(
            f"{r['trace']:<14} {r['n']:>5} " + " ".join(f"{v:>6.1f}" for v in r["saving_pct"]) + f" {paper:>6} {imp:>8}"
        )
    return "\n".join(lines)


def theory_parallel(prompt: int, output: int, n: int, block_size: int = 16) -> float:
    """Closed form of one parallel group's lifetime saving: ``(n - 1) floor(p / B) o / (n sum_t ceil((p+t+1)/B))``."""
    p, o, n, B = _int("prompt", prompt), _int("output", output), _int("n", n), _int("block_size", block_size)
    blocks = sum(math.ceil((p + t + 1) / B) for t in range(o))
    return (n - 1) * (p // B) * o / (n * blocks)
