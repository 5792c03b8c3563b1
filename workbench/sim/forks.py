"""Request groups that share KV blocks: parallel sampling and beam search, with copy-on-write (issue 15).

The vLLM paper (Kwon et al., SOSP'23, section 6.3) serves OPT-13B with ``n`` parallel samples or a beam of
width ``k`` per request and reports, in its Figure 15, "the amount of memory saving, computed by the number
of blocks we saved by sharing divided by the number of total blocks without sharing": 6.1%-9.8% (parallel)
and 37.6%-55.2% (beam) on Alpaca, 16.2%-30.5% and 44.3%-66.3% on ShareGPT (``forks_report.PAPER``).

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
  not fitted to the paper; ``forks_report.sensitivity`` shows the saving over ``p_top`` and the value each paper
  figure implies. The draws are ``rng.random((output - 1, k)) < p_top`` per group (a generator seeded by the run's
  seed and the request id), so a run is reproducible.
- *blocks with sharing* = distinct physical blocks the group holds (a real per-block reference count,
  :class:`RefPool`); *blocks without sharing* = ``sum over sequences of ceil(len / B)`` (each sequence its own
  copy). Both are recorded at every step.

The server (``workbench.sim.forks_serving.serve``) runs the groups through a KV budget; the paper's figures, the
table against them and the sensitivity to ``p_top`` are ``workbench.sim.forks_report``'s. The saving is the
paper's ratio of time-averages, ``1 - sum(shared) / sum(unshared)``; :func:`lifetime_saving` computes it over every
group's whole life without a server (a swapped group resumes where it left, so the schedule does not change it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workbench.sim import traces as tr

MODES = ("parallel", "beam")
WIDTHS = (2, 4, 6)
DEFAULT_P_TOP = 0.25


def check_int(name: str, v: object, lo: int = 1) -> int:
    """``v`` as an int, or a ValueError naming ``name`` unless it is an integer >= ``lo``."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def check_prob(name: str, v: object) -> float:
    """``v`` as a float, or a ValueError naming ``name`` unless it is a number in [0, 1]."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not 0 <= v <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
    return float(v)


def check_mode(v: object) -> str:
    """``v``, or a ValueError unless it is one of :data:`MODES`."""
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
        self.B = check_int("block_size", block_size)
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
        return [self.alloc() for _ in range(-(-check_int("tokens", tokens) // self.B))]

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
        length, m = check_int("length", length, 0), check_int("m", m)
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
    prompt, output, n = check_int("prompt", prompt), check_int("output", output), check_int("n", n)
    mode, p_top = check_mode(mode), check_prob("p_top", p_top)
    B = check_int("block_size", block_size)
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


def group_curves(
    trace: tr.Trace, mode: str, n: int, block_size: int, p_top: float, seed: int, check: bool
) -> list[GroupCurve]:
    """:func:`simulate_group` of every request of ``trace`` (each group's beam draws seeded by ``seed`` and its id)."""
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


def load_trace(trace: str | tr.Trace, requests: int | None) -> tr.Trace:
    """A preset name, a JSONL path or a Trace, as a non-empty Trace of its first ``requests`` requests."""
    if requests is not None:
        requests = check_int("requests", requests)
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
    """``1 - sum(shared) / sum(unshared)`` over every group's whole life (what ``forks_serving.serve`` reports,
    without a server: swapped groups resume, so the schedule does not change it)."""
    mode, n, p_top = check_mode(mode), check_int("n", n), check_prob("p_top", p_top)
    seed, block_size = check_int("seed", seed, 0), check_int("block_size", block_size)
    g = group_curves(load_trace(trace, requests), mode, n, block_size, p_top, seed, False)
    return 1 - sum(int(c.shared.sum()) for c in g) / sum(int(c.unshared.sum()) for c in g)


def theory_parallel(prompt: int, output: int, n: int, block_size: int = 16) -> float:
    """Closed form of one parallel group's lifetime saving: ``(n - 1) floor(p / B) o / (n sum_t ceil((p+t+1)/B))``."""
    p, o, n = check_int("prompt", prompt), check_int("output", output), check_int("n", n)
    B = check_int("block_size", block_size)
    blocks = sum(math.ceil((p + t + 1) / B) for t in range(o))
    return (n - 1) * (p // B) * o / (n * blocks)
