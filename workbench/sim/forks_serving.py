"""Request groups that share blocks served through a KV budget (the vLLM paper, section 6.3): :func:`serve`.

FCFS admission of whole groups into a KV budget (default the paper's 12 GiB of OPT-13B = 983 blocks of 16, at most
256 sequences, 1% watermark), every running group one step per step, and when the next step does not fit, the most
recently admitted group is swapped out (vLLM swaps multi-sequence groups) and resumes later at the step it left.
Each group's blocks over its life are :func:`workbench.sim.forks.simulate_group`'s.

The saving reported is the paper's ratio of time-averages: ``1 - sum(shared) / sum(unshared)`` over the steps of
the run. Because a swapped group resumes where it left, every group's whole lifetime is counted exactly once,
so this number does not depend on the request rate or the budget (``forks.lifetime_saving`` computes it without a
server); ``saving(saturated=True)`` keeps only steps with requests waiting, the memory-bound operating point.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from workbench.sim import traces as tr
from workbench.sim.budget import Budget, kv_budget
from workbench.sim.forks import DEFAULT_P_TOP, check_int, check_mode, check_prob, group_curves, load_trace

SERIES = ("step", "groups", "seqs", "waiting", "shared", "unshared")


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
    mode, n, p_top = check_mode(mode), check_int("n", n), check_prob("p_top", p_top)
    block_size, max_seqs = check_int("block_size", block_size), check_int("max_seqs", max_seqs)
    seed = check_int("seed", seed, 0)
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
    t = load_trace(trace, requests)
    # ---- arguments checked ----
    curves = group_curves(t, mode, n, block_size, p_top, seed, check)
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
