"""``bench tiers`` section ``formats`` (issue 34): blocks demoted and promoted in another format than the device's
(``TieredCache(host_format=...)``), what the host link then carries, what the transcode costs and when it pays.

    python -m workbench bench tiers --only formats [--quick] [--out data/results]
    python -m workbench bench tiers --smoke            # this section alone, tiny shapes on the CPU, no timings

An fp16 :class:`~workbench.cache.PagedKVCache` of SmolLM2-135M's K/V shape (30 layers, 3 kv heads of 64), blocks
of 16 and 64 tokens filled with normal values, under a :class:`~workbench.tiers.TieredCache` per format of
:data:`~workbench.quant.names.TIER_FORMATS` (``fsync=False``, the copy-engine path); a batch of ``blocks`` device
blocks goes down and comes back through the cache's own mover (``tc.lower.mover.to_host`` / ``to_device``: gather,
transcode, one DMA; one DMA, transcode, scatter). Every row carries ``format``, ``block_size``, ``blocks`` (the
batch), ``device_block_bytes`` (fp16), ``format_block_bytes`` (what the host holds and the link carries: codes,
scales, zero points) and ``bytes_fraction`` (their ratio). ``kind``:

- ``move``: ``direction`` ``d2h`` (demote, swap out) / ``h2d`` (promote, swap in), one batch at a time, timed with
  CUDA events around the call on the current stream (eager: the host's launches included, as a swap issues them);
  a transcoding format twice: in ``chunks`` (the mover's default, ``workbench.tiers.pipeline``: a chunk's transcode
  beside the previous chunk's copy) and the batch at once (``serial`` True, one chunk: transcode, then copy):
  ``time_us``, ``tokens_per_s``, ``wire_gbps`` (format bytes / time), ``frac_pinned`` (of the run's pinned copy in
  that direction) and ``tokens_ratio``: tokens/s over fp16's at the same block size, batch and direction (the
  issue's target: int4 on the host >= 3x).
- ``transcode``: ``op`` ``encode`` (device blocks -> format, what a demotion adds) / ``decode`` (the reverse) on a
  batch staged on the device: ``gbps`` = (bytes read + bytes written) / time and ``frac_copy`` of the device copy
  bandwidth measured in the same run (the issue's target: >= 0.8); the break-even against the link
  (:func:`break_even`): ``hide_gbps`` (the link bandwidth at which the transcode takes as long as the DMA of the
  format's bytes: on a slower link, batches pipelined, it hides behind the DMA), ``pays_serial_gbps`` (below it,
  transcode then DMA beats fp16's DMA alone) and ``pays_pipelined_gbps``; ``hidden_at_pinned``: the run's pinned
  bandwidth is below ``hide_gbps``; ``read_us``: the read half alone (``formats.read_values``: the blocks
  dequantized), so ``time_us - read_us`` is the write half's (None for a promotion in place, which has no read
  half: ``formats.decodes_in_place``).
- ``beside``: a decode (``bench tiers``' W1 step) timed alone and with transcoding swaps of a batch running on a
  side stream all the while (the decode steps queued first, the swaps issued while they run): ``slowdown``,
  ``overlap`` (share of the decode span with swaps in flight; a slowdown is only as full as it) and the swaps'
  ``wire_gbps`` beside it.
- ``check``: one round trip of the batch through the mover: the device blocks' values equal
  :func:`workbench.tiers.formats.roundtrip_values` of what went down (``ok``).
- ``skipped``: a format that cannot store blocks of that size (``reason``: int4/kivi's 32-token key groups do not
  tile a 16-token block).

``--smoke`` (CPU): 2 layers x 2 heads x 32, blocks of 16 and 32, batches of 2 and 3: every path runs once, the
``check`` rows hold, and the timing columns are None (no claim from a CPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from workbench.bench import harness
from workbench.bench.harness import copy_bandwidth_gbps
from workbench.cache import PagedKVCache
from workbench.model.config import SMOLLM2_135M
from workbench.quant.names import TIER_FORMATS
from workbench.results.run_files import print_table
from workbench.tiers import TieredCache, formats, pipeline

SMOKE_HELP = "the formats section alone on tiny shapes on the CPU: round trips checked, no timings"
SHAPE = (SMOLLM2_135M.num_hidden_layers, SMOLLM2_135M.num_key_value_heads, SMOLLM2_135M.head_dim)
SMOKE_SHAPE = (2, 2, 32)
BLOCK_SIZES, SMOKE_BLOCK_SIZES = (16, 64), (16, 32)
BATCHES, QUICK_BATCHES, SMOKE_BATCHES = (64, 256, 1024), (64, 256), (2, 3)
BESIDE_BS, BESIDE_BATCH = 64, 64  # a swap beside the decode: 64 blocks of 64 tokens (90 MiB in fp16; every format)
TIMING = ("time_us", "read_us", "tokens_per_s", "wire_gbps", "frac_pinned", "tokens_ratio", "gbps", "frac_copy",
          "hide_gbps", "pays_serial_gbps", "pays_pipelined_gbps", "hidden_at_pinned")


# ---- what follows from measured times (pure) ---------------------------------------------------------------------
def break_even(device_bytes: int, format_bytes: int, transcode_s: float | None) -> dict:
    """Link bandwidths (GB/s) at which a transcode of ``transcode_s`` seconds for a batch of ``device_bytes`` (fp16)
    that is ``format_bytes`` in the format stops paying: ``hide_gbps``, where the transcode takes as long as the
    format's DMA (a slower link hides it behind the DMA when batches are pipelined); ``pays_serial_gbps``, below
    which transcode + the format's DMA in series take less than fp16's DMA; ``pays_pipelined_gbps``, the same with
    the transcode of one batch beside the DMA of the previous one. None without a time."""
    for name, v in (("device_bytes", device_bytes), ("format_bytes", format_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if transcode_s is not None and not transcode_s > 0:
        raise ValueError(f"transcode_s must be None or a positive number of seconds, got {transcode_s!r}")
    if transcode_s is None:
        return {"hide_gbps": None, "pays_serial_gbps": None, "pays_pipelined_gbps": None}
    return {"hide_gbps": format_bytes / transcode_s / 1e9,
            "pays_serial_gbps": max(device_bytes - format_bytes, 0) / transcode_s / 1e9,
            "pays_pipelined_gbps": device_bytes / transcode_s / 1e9}


def add_ratios(rows: list[dict], reference: str = TIER_FORMATS[0]) -> list[dict]:
    """Set each ``move`` row's ``tokens_ratio``: its tokens/s over the ``reference`` format's at the same block size,
    batch and direction (None where either is missing). Returns ``rows``."""
    ref = {(r["block_size"], r["blocks"], r["direction"]): r.get("tokens_per_s") for r in rows
           if r.get("kind") == "move" and r["format"] == reference and not r.get("serial")}
    for r in rows:
        if r.get("kind") == "move":
            base = ref.get((r["block_size"], r["blocks"], r["direction"]))
            r["tokens_ratio"] = r["tokens_per_s"] / base if base and r.get("tokens_per_s") else None
    return rows


def beside_figures(alone_us: float, decode_span: tuple[float, float], transfer_span: tuple[float, float],
                   steps: int, nbytes: int) -> dict:
    """A decode's figures beside transfers from event times (microseconds from one origin): ``decode_span`` of
    ``steps`` steps queued back to back, ``transfer_span`` of ``nbytes`` moved. ``overlap``: share of the decode
    span with transfers in flight."""
    (d0, d1), (x0, x1) = decode_span, transfer_span
    if not (d1 > d0 and x1 > x0 and steps >= 1 and alone_us > 0):
        raise ValueError(f"spans must be (start, end) with end > start, steps >= 1 and alone_us > 0, got "
                         f"{decode_span}, {transfer_span}, {steps}, {alone_us}")
    per_step = (d1 - d0) / steps
    return {"decode_alone_us": alone_us, "decode_beside_us": per_step, "slowdown": per_step / alone_us - 1,
            "overlap": max(0.0, min(d1, x1) - max(d0, x0)) / (d1 - d0), "wire_gbps": nbytes / (x1 - x0) / 1e3}


# ---- timing ------------------------------------------------------------------------------------------------------
class Timer:
    """Mean device time of ``reps`` back-to-back calls, median of ``rounds`` (CUDA events on the current stream);
    ``timed=False`` (the CPU smoke) calls once and returns None: no claim."""

    def __init__(self, timed: bool, reps: int = 5, rounds: int = 3):
        self.timed, self.reps, self.rounds = timed, reps, rounds

    def __call__(self, fn: Callable[[], object], reps: int | None = None) -> float | None:
        if not self.timed:
            fn()
            return None
        return harness.time_us_events(fn, reps or self.reps, self.rounds)


# ---- one block size ----------------------------------------------------------------------------------------------
def filled_cache(shape, bs: int, blocks: int, device: str, ops: str) -> PagedKVCache:
    """An fp16 cache of ``shape`` (layers, kv heads, head dim) with ``blocks`` blocks of ``bs`` tokens, all filled."""
    L, H, D = shape
    cache = PagedKVCache(L, H, D, num_pages=blocks, page_tokens=bs, kv_dtype="fp16", device=device, ops=ops,
                         prefix_caching=False)
    cache.blocks(bs).normal_()  # every block: K/V values of unit scale
    return cache


def staged_blocks(cache, bs: int, ids: list[int]) -> torch.Tensor:
    """Device blocks ``ids`` as the mover gathers them: ``[n, block bytes]`` (every layer's K row, then V row)."""
    blk = cache.blocks(bs)[:, :, ids]  # [L, 2, n, stride]
    return blk.permute(2, 0, 1, 3).contiguous().view(torch.uint8).reshape(len(ids), -1)


def swap(mover, bs: int, ids: list[int], starts: list[int], direction: str) -> Callable[[], object]:
    """One batch through ``mover`` as a call: ``d2h`` device blocks ``ids`` to host units ``starts``, ``h2d`` back;
    the current stream waits for it (timed end to end on that stream)."""
    if direction == "d2h":
        return lambda: mover.to_host(bs, ids, starts).wait()
    return lambda: mover.to_device(bs, starts, ids).wait()


def _base(name: str, bs: int, n: int, dev_bb: int, fmt_bb: int) -> dict:
    return dict(section="formats", format=name, block_size=bs, blocks=n, device_block_bytes=dev_bb,
                format_block_bytes=fmt_bb, bytes_fraction=round(fmt_bb / dev_bb, 4))


def format_case(cache, name: str, bs: int, batches, timer: Timer, pinned: dict | None,
                copy_gbps: float | None) -> list[dict]:
    """Rows of one format at one block size: a round-trip check on the smallest batch, then each batch moved both
    ways and (a transcoding format) encoded and decoded alone."""
    dev_bb = formats.block_bytes(cache, formats.DEVICE, bs)
    try:
        fmt = formats.tier_format(cache, name)
    except ValueError as e:
        return [dict(_base(name, bs, 0, dev_bb, dev_bb), kind="skipped", reason=str(e))]
    fmt_bb = formats.block_bytes(cache, fmt, bs)
    tc = TieredCache(cache, host_bytes=max(batches) * fmt_bb, host_format=name, fsync=False, path="dma")
    mover, host = tc.lower.mover, tc.lower.host
    rows = []
    try:
        for n in batches:
            ids = list(range(n))
            starts = host.allocate([mover.units(bs)] * n)
            base = _base(name, bs, n, dev_bb, mover.wire_bytes(bs))
            if n == min(batches):  # first, on fresh values: the round trip equals the format's reference one
                before = staged_blocks(cache, bs, ids)
                want = formats.roundtrip_values(cache, fmt, bs, before)
                mover.to_host(bs, ids, starts).synchronize()
                mover.to_device(bs, starts, ids).synchronize()
                got = formats.roundtrip_values(cache, formats.DEVICE, bs, staged_blocks(cache, bs, ids))
                ok = torch.equal(got, want)
                rows.append(dict(base, kind="check", lossy=fmt.lossy(cache.scheme), ok=ok,
                                 max_abs_change=float((got - formats.roundtrip_values(
                                     cache, formats.DEVICE, bs, before)).abs().max())))
            # a transcoding format twice: in chunks (the mover's default) and the batch at once (``serial``)
            for chunk_bytes in ((mover.chunk_bytes, None) if fmt.transcodes else (mover.chunk_bytes,)):
                mover.chunk_bytes = chunk_bytes
                for direction in ("d2h", "h2d"):
                    t = timer(swap(mover, bs, ids, starts, direction))
                    wire = n * mover.wire_bytes(bs)
                    rows.append(dict(base, kind="move", direction=direction, chunks=len(mover.chunks(n, bs)),
                                     serial=fmt.transcodes and chunk_bytes is None, time_us=t,
                                     tokens_per_s=n * bs / t * 1e6 if t else None,
                                     wire_gbps=wire / t / 1e3 if t else None,
                                     frac_pinned=wire / t / 1e3 / pinned[f"pinned_{direction}"] if t and pinned
                                     else None))
            mover.chunk_bytes = pipeline.CHUNK_BYTES
            if fmt.transcodes:
                rows += _transcode_rows(cache, fmt, bs, ids, base, timer, pinned, copy_gbps)
            host.free(starts, [mover.units(bs)] * n)
    finally:
        tc.close()
    return rows


def _transcode_rows(cache, fmt, bs, ids, base, timer, pinned, copy_gbps) -> list[dict]:
    """A staged batch encoded and decoded alone, on the device: bandwidth and the break-even against the link."""
    n = len(ids)
    staged = staged_blocks(cache, bs, ids)
    packed = formats.encode(cache, fmt, bs, staged)
    dev_bytes, fmt_bytes = staged.numel(), packed.numel()
    rows = []
    nonfinite = torch.zeros(1, dtype=torch.int32, device=staged.device)
    for op, fn, read, direction in (
            ("encode", lambda: formats.encode(cache, fmt, bs, staged),
             lambda: formats.read_values(cache, formats.DEVICE, bs, staged, nonfinite), "d2h"),
            ("decode", lambda: formats.decode(cache, fmt, bs, packed),
             None if formats.decodes_in_place(cache, bs) else lambda: formats.read_values(cache, fmt, bs, packed),
             "h2d")):
        reps = max(2, min(10, (1 << 30) // (dev_bytes + fmt_bytes)))
        t = timer(fn, reps=reps)
        t_read = timer(read, reps=reps) if read else None  # the read half alone: the rest of t is the write
        gbps = (dev_bytes + fmt_bytes) / t / 1e3 if t else None
        be = break_even(dev_bytes, fmt_bytes, t * 1e-6 if t else None)
        link = pinned[f"pinned_{direction}"] if pinned else None
        rows.append(dict(base, kind="transcode", op=op, direction=direction, time_us=t, read_us=t_read,
                         bytes=dev_bytes + fmt_bytes,
                         gbps=gbps, frac_copy=gbps / copy_gbps if gbps and copy_gbps else None, **be,
                         hidden_at_pinned=bool(link < be["hide_gbps"]) if link and be["hide_gbps"] else None,
                         tokens_per_s=n * bs / t * 1e6 if t else None))
    return rows


# ---- beside a decode (GPU) ---------------------------------------------------------------------------------------
def beside_rows(decode: Callable[[], object], names=TIER_FORMATS, steps: int = 200, bs: int = BESIDE_BS,
                batch: int = BESIDE_BATCH) -> list[dict]:
    """A decode step (``decode``: one launch sequence on the current stream) alone and beside transcoding swaps of
    ``batch`` blocks (each format, both directions) issued on another stream while the queued steps run."""
    timer = Timer(True, reps=steps)
    alone = timer(decode)
    cache = filled_cache(SHAPE, bs, batch, "cuda", "kernels")
    dev_bb = formats.block_bytes(cache, formats.DEVICE, bs)
    issue = torch.cuda.Stream()
    rows = []
    for name in names:
        fmt = formats.tier_format(cache, name)
        tc = TieredCache(cache, host_bytes=batch * formats.block_bytes(cache, fmt, bs), host_format=name,
                         fsync=False, path="dma")
        mover, ids = tc.lower.mover, list(range(batch))
        starts = tc.lower.host.allocate([mover.units(bs)] * batch)
        for direction in ("d2h", "h2d"):
            one = swap(mover, bs, ids, starts, direction)
            with torch.cuda.stream(issue):
                t_x = Timer(True, reps=3)(one)
            n_x = int(steps * alone / t_x) + 3  # enough swaps to outlast the queued steps
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            torch.cuda.synchronize()
            ev[0].record()
            for _ in range(steps):
                decode()
            ev[1].record()
            t0 = time.perf_counter()
            with torch.cuda.stream(issue):
                ev[2].record()
                for _ in range(n_x):
                    one()
                ev[3].record()
            issue_us = (time.perf_counter() - t0) * 1e6 / n_x
            torch.cuda.synchronize()
            at = [0.0] + [ev[0].elapsed_time(e) * 1e3 for e in ev[1:]]
            fig = beside_figures(alone, (at[0], at[1]), (at[2], at[3]), steps, n_x * batch * mover.wire_bytes(bs))
            rows.append(dict(_base(name, bs, batch, dev_bb, mover.wire_bytes(bs)),
                             kind="beside", direction=direction, swap_alone_us=t_x, swaps=n_x, issue_us=issue_us,
                             **fig))
        tc.close()
    return rows


# ---- the section -------------------------------------------------------------------------------------------------
def format_rows(pinned: dict | None = None, *, smoke: bool = False, quick: bool = False,
                decode: Callable[[], object] | None = None, names=TIER_FORMATS) -> list[dict]:
    """Every row of the section (see the module docstring). ``pinned``: the run's pinned bandwidths
    (``bench tiers``' ``pinned_bandwidth``); ``decode``: the W1 decode step for the ``beside`` rows (GPU only);
    ``smoke``: tiny shapes on the CPU, every path once, no timings."""
    if not smoke and not torch.cuda.is_available():
        raise ValueError("smoke must be True without a CUDA GPU (the section times with CUDA events)")
    shape = SMOKE_SHAPE if smoke else SHAPE
    sizes = SMOKE_BLOCK_SIZES if smoke else BLOCK_SIZES[:1] if quick else BLOCK_SIZES
    batches = SMOKE_BATCHES if smoke else QUICK_BATCHES if quick else BATCHES
    device, ops = ("cpu", "torch") if smoke else ("cuda", "kernels")
    timer = Timer(not smoke)
    copy_gbps = None if smoke else copy_bandwidth_gbps()
    rows = []
    for bs in sizes:
        cache = filled_cache(shape, bs, max(batches), device, ops)
        for name in names:
            cache.blocks(bs).normal_()  # fresh values for the check (the last format's round trips changed them)
            rows += format_case(cache, name, bs, batches, timer, pinned, copy_gbps)
        del cache
    add_ratios(rows, names[0])
    if decode is not None and not smoke:
        rows += beside_rows(decode, names)
    for r in rows:
        r["smoke"] = smoke
        if smoke:
            r.update({k: None for k in TIMING if k in r})
        for k, v in r.items():
            if isinstance(v, float):
                r[k] = round(v, 4)
    return rows


def summary(rows: list[dict]) -> None:
    """Print the section's rows: moves (tokens/s and the ratio to fp16), transcodes, beside, checks (a smoke run:
    the checks alone)."""
    def pick(kind):
        return [r for r in rows if r.get("section") == "formats" and r.get("kind") == kind]

    if any(r.get("smoke") for r in pick("check")):  # no timings to show
        print_table(pick("check") + pick("skipped"), ["format", "block_size", "blocks", "kind", "ok", "reason"])
        return
    print_table(pick("move"), ["format", "block_size", "blocks", "direction", "chunks", "serial", "bytes_fraction",
                               "tokens_per_s", "tokens_ratio", "frac_pinned"])
    print_table(pick("transcode"), ["format", "block_size", "blocks", "op", "gbps", "frac_copy", "hide_gbps",
                                    "pays_serial_gbps", "hidden_at_pinned"])
    if pick("beside"):
        print_table(pick("beside"), ["format", "direction", "slowdown", "overlap", "wire_gbps", "issue_us"])
    print_table(pick("check") + pick("skipped"), ["format", "block_size", "blocks", "kind", "ok", "max_abs_change"])
