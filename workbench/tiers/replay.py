"""Replay an access trace against a tier configuration (device HBM, pinned host memory, disk) and a prefetch
strategy: hits, misses, bytes moved per direction, stall, and a timeline of transfers against compute.

The model (deterministic, pure Python; one sequence, one layer's blocks, ``block_bytes`` each):

- Tiers. The device holds ``device_blocks`` blocks. The host holds copies of up to ``host_blocks`` blocks
  (``None``: all), least recently used dropped first; a block the host drops goes to the disk (written once:
  ``disk_write`` bytes; the disk keeps it). Copies are kept where they came from: bringing a block to the device
  leaves its host copy, so evicting it from the device costs nothing, except for a block the decode wrote on the
  device, which is written back to the host the first time it is evicted (``d2h`` bytes).
- Start. The device is empty (cold). The prompt's blocks are on the host; when they do not fit ``host_blocks``
  the host holds the newest of them (as an LRU host would after offloading them in order), the rest are on disk.
  A block first appearing during the trace (decode opening a new block) is born on the device, no transfer.
- A step ``t``: (1) it waits for what is left of the prefetch issued after step ``t - 1`` (the transfer beyond
  that step's compute, ``compute_s``: transfers run one after another on one link, and the step waits for a
  prefetch to complete); (2) reads resident blocks (hits) and demand-fetches the rest (misses) in one transfer,
  stalling for it; (3) computes for ``compute_s``; meanwhile (4) the device is trimmed to its capacity (the
  strategy's eviction order; a step reading more blocks than the device holds streams the excess: fetched, used,
  dropped) and the strategy's prefetch for step ``t + 1`` is fetched, overlapping the compute.
- A transfer of ``n`` blocks from the host costs ``link.batch_seconds(block_bytes, n, path, "h2d", batched)``;
  from disk, the disk read of those blocks (``"disk"``, ``"read"``) is added and they land on the host too
  (disk, then host, then device). Write-backs (``d2h``, ``disk_write``) use the other direction of the
  full-duplex link or the disk's idle time and are counted in bytes only, never in stall.
- Waste: a prefetched block evicted, or left at the end, before any step read it.

So ``total_s = steps * compute_s + stall_s``, ``stall_s = demand_stall_s + prefetch_stall_s``, ``hits + misses
== reads`` and ``h2d == (misses + prefetched) * block_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

from workbench.tiers.access import AccessTrace, _non_negative, _positive
from workbench.tiers.link import LinkModel, latest_link_model
from workbench.tiers.prefetch import PREFETCH, PrefetchContext, PrefetchState, TraceView, needs_scores
from workbench.tiers.prefetch import get as get_prefetch

#: bytes_moved keys: host -> device, device -> host (write-back), disk -> host (read), host -> disk (write)
DIRECTIONS = ("h2d", "d2h", "disk_read", "disk_write")


class Interval(NamedTuple):
    """One bar of the timeline: ``kind`` ``"compute"``, ``"demand"`` (a stall) or ``"prefetch"`` (overlapped)."""

    step: int
    kind: str
    start_s: float
    end_s: float
    blocks: int


@dataclass(frozen=True)
class StepRecord:
    """One step of a replay. ``prefetched`` / ``prefetch_s``: the prefetch issued after this step (for the next);
    ``overhang_s``: this step's wait for the previous step's prefetch; ``disk_blocks``: blocks read from disk by
    this step's demand fetch and prefetch."""

    step: int
    reads: int
    hits: int
    misses: int
    born: int
    prefetch_used: int
    prefetch_wasted: int
    prefetched: int
    disk_blocks: int
    overhang_s: float
    demand_s: float
    prefetch_s: float
    start_s: float
    end_s: float

    @property
    def stall_s(self) -> float:
        return self.overhang_s + self.demand_s


@dataclass(frozen=True)
class ReplayResult:
    """Totals of a replay, per-step records and the timeline (see the module docstring for the model)."""

    trace: str
    strategy: str
    label: str
    steps: int
    compute_s: float
    reads: int
    hits: int
    misses: int
    born: int
    prefetched: int
    prefetch_used: int
    prefetch_wasted: int
    bytes_moved: Mapping[str, int]
    demand_stall_s: float
    prefetch_stall_s: float
    per_step: tuple[StepRecord, ...]
    timeline: tuple[Interval, ...]
    config: Mapping[str, object]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.reads if self.reads else 1.0

    @property
    def stall_s(self) -> float:
        return self.demand_stall_s + self.prefetch_stall_s

    @property
    def total_s(self) -> float:
        return self.steps * self.compute_s + self.stall_s

    def column(self, name: str) -> np.ndarray:
        """One :class:`StepRecord` field (or ``stall_s``) over the steps."""
        if name != "stall_s" and name not in {f.name for f in fields(StepRecord)}:
            raise ValueError(f"name must be a StepRecord field, got {name!r}")
        return np.array([getattr(r, name) for r in self.per_step])

    def row(self) -> dict:
        """The totals as one flat table row."""
        compute_total = self.steps * self.compute_s
        return {"strategy": self.strategy, "label": self.label, "trace": self.trace, "steps": self.steps,
                "reads": self.reads, "hits": self.hits, "misses": self.misses, "hit_rate": self.hit_rate,
                "born": self.born, "prefetched": self.prefetched, "prefetch_used": self.prefetch_used,
                "prefetch_wasted": self.prefetch_wasted, **{f"{k}_bytes": v for k, v in self.bytes_moved.items()},
                "demand_stall_s": self.demand_stall_s, "prefetch_stall_s": self.prefetch_stall_s,
                "stall_s": self.stall_s, "total_s": self.total_s,
                "slowdown": self.total_s / compute_total if compute_total else math.inf}


def replay(trace: AccessTrace, strategy, *, device_blocks: int, host_blocks: int | None = None, block_bytes: int,
           compute_s: float, link: LinkModel | None = None, path: str = "dma", batched: bool = True,
           disk: bool = True) -> ReplayResult:
    """Simulate ``trace`` under ``strategy`` (a name in ``PREFETCH``, a config, or a built ``PrefetchState``, used
    as is) with a device of ``device_blocks`` blocks of ``block_bytes`` and ``compute_s`` of compute a step.

    ``host_blocks``: the host's capacity (``None``: every block); the rest spill to disk, which needs ``disk``.
    ``link``: transfer times (default ``latest_link_model()``); ``path``: the host link's copy path (``"dma"``,
    ``"sm"``); ``batched``: one transfer per fetch (``False``: one per block).
    """
    if not isinstance(trace, AccessTrace):
        raise ValueError(f"trace must be an AccessTrace, got {type(trace).__name__}")
    _positive("device_blocks", device_blocks)
    _positive("block_bytes", block_bytes)
    if host_blocks is not None:
        _non_negative("host_blocks", host_blocks)
    if isinstance(compute_s, bool) or not isinstance(compute_s, (int, float)) or not 0 <= compute_s < math.inf:
        raise ValueError(f"compute_s must be a finite number >= 0, got {compute_s!r}")
    if path not in ("dma", "sm"):
        raise ValueError(f"path must be 'dma' or 'sm', got {path!r}")
    for name, flag in (("batched", batched), ("disk", disk)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    if not disk and host_blocks is not None and host_blocks < trace.num_blocks[-1]:
        raise ValueError(f"host_blocks={host_blocks} cannot hold the trace's {trace.num_blocks[-1]} blocks "
                         "without a disk: pass disk=True or host_blocks=None")
    link = latest_link_model() if link is None else link
    if not isinstance(link, LinkModel):
        raise ValueError(f"link must be a LinkModel, got {type(link).__name__}")
    name, label, state = _build(strategy, PrefetchContext(trace.block_size, device_blocks, trace.scores is not None))
    tiers = _Tiers(trace.prompt_blocks, host_blocks, block_bytes)
    cost = _TransferCost(link, block_bytes, path, batched)
    device = tiers.device
    records, timeline = [], []
    clock = prev_prefetch_s = 0.0  # clock: when the previous step's compute ended
    existing = trace.prompt_blocks
    last = len(trace) - 1
    for t, reads in enumerate(trace.steps):
        overhang = max(0.0, prev_prefetch_s - compute_s)
        born = max(0, trace.num_blocks[t] - existing)
        for b in range(existing, existing + born):  # decode opened a block: written on the device, no copy yet
            device[b] = None
            tiers.dirty.add(b)
        existing += born
        misses = [b for b in reads if b not in device]
        used = len(tiers.unused.intersection(reads))
        tiers.unused.difference_update(reads)
        wasted_before = tiers.wasted
        host_demand, disk_demand = tiers.fetch(misses) if misses else (0, 0)
        demand_s = cost.seconds(host_demand, disk_demand) if misses else 0.0
        for b in reads:  # most recently used last; within a step, in block order
            del device[b]
            device[b] = None
        state.observe(t, reads)
        demand_start = clock + overhang
        compute_start = demand_start + demand_s
        if misses:
            timeline.append(Interval(t, "demand", demand_start, compute_start, len(misses)))
        timeline.append(Interval(t, "compute", compute_start, compute_start + compute_s, len(reads)))
        prefetch_s, wanted, disk_prefetch = 0.0, [], 0
        if t < last:
            view = TraceView(trace, t)
            if len(device) > device_blocks:
                tiers.evict(_victims(state, label, device, len(device) - device_blocks, view, ()))
            plan = state.plan(t, view)
            wanted = _wanted(plan, label, device, existing, trace.num_blocks[t + 1], device_blocks)
            if wanted:
                room = len(device) + len(wanted) - device_blocks
                if room > 0:
                    tiers.evict(_victims(state, label, device, room, view, set(wanted) | set(plan)))
                n_host, disk_prefetch = tiers.fetch(wanted)
                prefetch_s = cost.seconds(n_host, disk_prefetch)
                tiers.unused.update(wanted)
                timeline.append(Interval(t, "prefetch", compute_start, compute_start + prefetch_s, len(wanted)))
        else:  # the run ends: what was prefetched and never read is waste
            tiers.wasted += len(tiers.unused)
            tiers.unused.clear()
        records.append(StepRecord(t, len(reads), len(reads) - len(misses), len(misses), born, used,
                                  tiers.wasted - wasted_before, len(wanted), disk_demand + disk_prefetch,
                                  overhang, demand_s, prefetch_s, clock, compute_start + compute_s))
        clock = compute_start + compute_s
        prev_prefetch_s = prefetch_s
    return ReplayResult(
        trace.name, name, label, len(trace), float(compute_s), trace.total_reads,
        sum(r.hits for r in records), sum(r.misses for r in records), sum(r.born for r in records),
        sum(r.prefetched for r in records), sum(r.prefetch_used for r in records), tiers.wasted,
        dict(tiers.bytes), sum(r.demand_s for r in records), sum(r.overhang_s for r in records),
        tuple(records), tuple(timeline),
        {"device_blocks": device_blocks, "host_blocks": host_blocks, "block_bytes": block_bytes,
         "compute_s": compute_s, "path": path, "batched": batched, "disk": disk, "link": link.source})


def compare(trace: AccessTrace, strategies: Iterable | str | None = None, **config) -> list[dict]:
    """One :meth:`ReplayResult.row` per strategy (``None``: every name in ``PREFETCH``, ``score`` only when the
    trace has scores), replayed with the same ``config`` (``replay``'s keyword arguments)."""
    if strategies is None:
        strategies = [n for n in PREFETCH if n != "score" or trace.scores is not None]
    elif isinstance(strategies, str):
        strategies = [strategies]
    elif not isinstance(strategies, Iterable):
        raise ValueError(f"strategies must be None, a name or an iterable of strategies, got {strategies!r}")
    return [replay(trace, s, **config).row() for s in strategies]


def compare_traces(traces: Mapping[str, AccessTrace], strategies: Mapping[str, object], *, token_bytes: int,
                   **config) -> list[dict]:
    """Every strategy on every trace, in one table: :func:`compare`'s rows led by ``pattern`` (the key of
    ``traces``) and ``strategy`` (the key of ``strategies``), plus ``stall_ms``. A block is ``token_bytes`` times
    the trace's block size; a strategy that needs scores (``score``) is left out on a trace without them;
    ``config``: the other keyword arguments of :func:`replay` (``device_blocks``, ``compute_s``, ``link``...)."""
    for name, v in (("traces", traces), ("strategies", strategies)):
        if not isinstance(v, Mapping):
            raise ValueError(f"{name} must be a mapping (label -> value), got {type(v).__name__}")
    if isinstance(token_bytes, bool) or not isinstance(token_bytes, int) or token_bytes < 1:
        raise ValueError(f"token_bytes must be an int >= 1, got {token_bytes!r}")
    rows = []
    for pattern, tr in traces.items():
        use = {n: s for n, s in strategies.items() if tr.scores is not None or not needs_scores(s)}
        got = compare(tr, use.values(), block_bytes=token_bytes * tr.block_size, **config)
        rows += [{"pattern": pattern, **r, "strategy": n, "stall_ms": 1e3 * r["stall_s"]}
                 for n, r in zip(use, got, strict=True)]
    return rows


class _TransferCost:
    """Seconds of one fetch of ``n_host`` blocks from the host and ``n_disk`` from disk (memoized: a replay asks
    for the same few sizes thousands of times)."""

    def __init__(self, link: LinkModel, block_bytes: int, path: str, batched: bool):
        self.link, self.block_bytes, self.path, self.batched = link, block_bytes, path, batched
        self._memo: dict[tuple[int, int], float] = {}

    def seconds(self, n_host: int, n_disk: int) -> float:
        key = (n_host, n_disk)
        if key not in self._memo:
            s = self.link.batch_seconds(self.block_bytes, n_disk, "disk", "read", self.batched) if n_disk else 0.0
            s += self.link.batch_seconds(self.block_bytes, n_host + n_disk, self.path, "h2d", self.batched)
            self._memo[key] = s
        return self._memo[key]


class _Tiers:
    """Where each block is: device (LRU order), host copies (LRU order, bounded), disk copies."""

    def __init__(self, prompt_blocks: int, host_blocks: int | None, block_bytes: int):
        self.host_blocks, self.block_bytes = host_blocks, block_bytes
        on_host = prompt_blocks if host_blocks is None else min(host_blocks, prompt_blocks)
        self.device: dict[int, None] = {}
        self.host: dict[int, None] = dict.fromkeys(range(prompt_blocks - on_host, prompt_blocks))
        self.on_disk: set[int] = set(range(prompt_blocks - on_host))
        self.dirty: set[int] = set()  # on the device only: written there, never evicted
        self.unused: set[int] = set()  # prefetched, not read yet
        self.wasted = 0
        self.bytes = dict.fromkeys(DIRECTIONS, 0)

    def fetch(self, blocks: list[int]) -> tuple[int, int]:
        """Bring ``blocks`` (not resident) to the device; returns how many came from the host and from disk."""
        from_disk = [b for b in blocks if b not in self.host]
        for b in blocks:
            if b in self.host:  # touched before the disk blocks land, so they cannot push it out first
                del self.host[b]
                self.host[b] = None
        for b in from_disk:
            assert b in self.on_disk, f"block {b} is on no tier"
            self.bytes["disk_read"] += self.block_bytes
            self._host_insert(b)
        for b in blocks:
            self.device[b] = None
        self.bytes["h2d"] += len(blocks) * self.block_bytes
        return len(blocks) - len(from_disk), len(from_disk)

    def evict(self, blocks: list[int]) -> None:
        for b in blocks:
            del self.device[b]
            if b in self.dirty:
                self.dirty.discard(b)
                self.bytes["d2h"] += self.block_bytes
                self._host_insert(b)
            if b in self.unused:
                self.unused.discard(b)
                self.wasted += 1

    def _host_insert(self, b: int) -> None:
        self.host.pop(b, None)
        self.host[b] = None
        while self.host_blocks is not None and len(self.host) > self.host_blocks:
            old = next(iter(self.host))
            del self.host[old]
            if old not in self.on_disk:
                self.on_disk.add(old)
                self.bytes["disk_write"] += self.block_bytes


def _build(strategy, ctx: PrefetchContext) -> tuple[str, str, PrefetchState]:
    if isinstance(strategy, PrefetchState):
        name = getattr(strategy, "label", type(strategy).__name__)
        return name, name, strategy
    cfg = get_prefetch(strategy)
    return (strategy if isinstance(strategy, str) else cfg.label), cfg.label, cfg.build(ctx)


def _wanted(plan, label: str, device: dict, existing: int, n_next: int, limit: int) -> list[int]:
    """The plan's blocks to fetch: validated, first occurrence only, not resident, not opened by the next step
    (born on the device), at most ``limit``."""
    out, seen = [], set()
    for b in plan:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < n_next:
            raise ValueError(f"{label}: plan must list block indices in [0, {n_next}), got {b!r}")
        b = int(b)
        if b in seen or b >= existing or b in device:
            continue
        seen.add(b)
        out.append(b)
        if len(out) == limit:
            break
    return out


def _victims(state: PrefetchState, label: str, device: dict, count: int, view: TraceView, keep) -> list[int]:
    resident = list(device)
    order = state.eviction_order(resident, view)
    if order is not resident and (len(order) != len(resident) or set(order) != device.keys()):
        raise ValueError(f"{label}: eviction_order must return the resident blocks, reordered")
    if keep:  # a prefetch never pushes out a block its own plan asks for while another can go
        order = [b for b in order if b not in keep] + [b for b in order if b in keep]
    return order[:count]

