"""Moving a batch of cache blocks between the device pool and host memory: two paths, one accounting.

A cache block of size class ``bs`` is ``layers * 2`` rows (every layer's K and V plane) of
``block_stride(bs)`` elements, scales included, scattered over the pool. Host copies are block-major: a
block's rows lie together, and a batch placed in one host run (``workbench.tiers.host``) is one range.

- ``"dma"``: gather the batch's scattered blocks into one contiguous device staging buffer (one kernel), then
  one ``cudaMemcpyAsync`` per contiguous host run (one for a batch the host allocator placed together), on a
  side stream; swap-in is the reverse (copy in, then scatter). The copy engine reaches the link's bandwidth
  only for large copies, which is why the batch goes as one.
- ``"sm"``: one launch of the block-move kernel (``workbench.kernels.swap``) whose threads read or write
  pinned host memory directly: no staging, no per-run copy call; best for small batches. ``sm_programs``
  caps its grid (it shares the SMs with whatever runs beside it).
- ``"auto"``: ``"sm"`` for batches below :data:`SM_BELOW_BYTES`, else ``"dma"``.

Ordering (CUDA): a swap-out reads the device blocks on the *current* stream (the gather, or the SM kernel), so
a later write into those blocks (their next owner's K/V) is ordered after it; only the device-to-host copy runs
on the side stream. A swap-in runs wholly on the side stream after waiting for the current one, and returns a
:class:`Transfer` whose :meth:`Transfer.wait` makes the current stream wait for it (no host sync): a prefetch
issued early overlaps the decode running meanwhile. On a CPU every move is a plain synchronous copy.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from workbench.tiers import formats, pipeline
from workbench.tiers.host import HostPool, contiguous_runs

PATHS = ("dma", "sm", "auto")
# "auto": batches below this take the SM path. On the H200 (bench tiers) the copy engine reaches 0.60 of the link
# at 1 MiB batches and 0.74 at 2 MiB (gather + copy), the SM copy 0.90-0.94 from 256 KiB; but an SM copy beside a
# decode slows it 30-77%, a DMA 1%. Below 1 MiB the copy engine is too slow to be worth the SMs it saves.
SM_BELOW_BYTES = 1 << 20


@dataclass
class Transfer:
    """One batched move in flight. ``wait()`` orders the current stream after it (CUDA) and returns self."""

    src: str
    dst: str
    nbytes: int
    blocks: int
    path: str
    copies: int  # copy-engine calls (dma) or kernel launches (sm)
    event: object = None  # torch.cuda.Event recorded on the side stream after the move, None on a CPU
    _keep: list = field(default_factory=list)  # staging buffers alive until the move completes

    def wait(self) -> Transfer:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return self

    def synchronize(self) -> Transfer:
        """Block the host until the move is done (before the CPU reads host memory it wrote, say)."""
        if self.event is not None:
            self.event.synchronize()
        return self


class TransferStats:
    """Bytes, blocks, batches, copy calls and seconds per ``(src tier, dst tier)``.

    Seconds are the moves' own time: CUDA events around each move on its stream (read when asked, which
    synchronizes), host wall time on a CPU."""

    def __init__(self):
        self._rows: dict = defaultdict(lambda: {"bytes": 0, "blocks": 0, "batches": 0, "copies": 0, "seconds": 0.0})
        self._pending: list = []  # (key, start event, end event)

    def add(self, src: str, dst: str, nbytes: int, blocks: int, copies: int, seconds: float = 0.0,
            events: tuple | None = None, batches: int = 1) -> None:
        row = self._rows[(src, dst)]
        row["bytes"] += nbytes
        row["blocks"] += blocks
        row["batches"] += batches
        row["copies"] += copies
        row["seconds"] += seconds
        if events is not None:
            self._pending.append(((src, dst), *events))

    def as_dict(self) -> dict[str, dict]:
        """``{"device->host": {"bytes", "blocks", "batches", "copies", "seconds", "gbps"}, ...}``."""
        for key, start, end in self._pending:
            end.synchronize()
            self._rows[key]["seconds"] += start.elapsed_time(end) / 1e3
        self._pending.clear()
        out = {}
        for (src, dst), row in sorted(self._rows.items()):
            r = dict(row)
            r["gbps"] = r["bytes"] / r["seconds"] / 1e9 if r["seconds"] > 0 else None
            out[f"{src}->{dst}"] = r
        return out

    def merge(self, other: dict[str, dict]) -> None:
        """Add rows reported elsewhere (the disk pool's) in :meth:`as_dict` form."""
        for name, r in other.items():
            src, dst = name.split("->")
            self.add(src, dst, r["bytes"], r.get("blocks", 0), r.get("copies", 0), r.get("seconds", 0.0),
                     batches=r.get("batches", 1))


class BlockMover:
    """Batched moves of one cache's blocks to and from host memory (see the module docstring).

    Args:
        cache: the :class:`~workbench.cache.PagedKVCache` whose pool is the device tier.
        host: the host tier (its ``unit_bytes`` must be the cache's smallest block, all rows).
        path: ``"dma"``, ``"sm"`` or ``"auto"``.
        sm_programs: grid cap of the SM path (default: one program per 16 KiB piece, at most 4096).
        dma_programs: grid cap of the DMA path's gather / scatter kernels (a prefetch beside a decode: fewer
            programs take fewer SMs from it).
        fmt: what the blocks are below the device (``workbench.tiers.formats``): the device's bytes, or another
            scheme, transcoded on the device between the gather and the copy (and between the copy and the
            scatter); such moves always stage (``"dma"``), and a block takes ``units`` of the format's size.
        chunk_bytes: a transcoding move is cut into chunks of at least this many wire bytes, each chunk's transcode
            beside the previous one's copy (``workbench.tiers.pipeline``); None: the batch at once.
    """

    def __init__(self, cache, host: HostPool, *, path: str = "auto", sm_programs: int | None = None,
                 dma_programs: int | None = None, fmt: formats.TierFormat = formats.DEVICE,
                 chunk_bytes: int | None = pipeline.CHUNK_BYTES):
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        self.fmt = fmt
        unit = formats.block_bytes(cache, fmt, min(cache.pool_sizes))
        if host.unit_bytes != unit:
            raise ValueError(f"host unit_bytes must be the cache's smallest block, {unit} bytes, got {host.unit_bytes}")
        for name, v in (("sm_programs", sm_programs), ("dma_programs", dma_programs)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or a positive int, got {v!r}")
        self.cache, self.host, self.path, self.sm_programs = cache, host, path, sm_programs
        self.dma_programs = dma_programs
        self.cuda = cache.device.type == "cuda"
        self.side = torch.cuda.Stream(cache.device) if self.cuda else None
        self.ids = PinnedIds() if self.cuda else None
        self.stats = TransferStats()
        self.nonfinite = torch.zeros(1, dtype=torch.int32, device=cache.device)  # NaN/Inf a transcode stored as 0
        self._chunk_bytes = pipeline.CHUNK_BYTES
        self.chunk_bytes = chunk_bytes
        self._xcode_stream = None  # a transcode's stream, made at the first one (pipeline.py)

    @property
    def chunk_bytes(self) -> int | None:
        """Wire bytes a chunk of a transcoding move takes at least (``pipeline.chunk_ranges``); None: one chunk."""
        return self._chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, v: int | None) -> None:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"chunk_bytes must be None or a positive int, got {v!r}")
        self._chunk_bytes = v

    # ---- geometry ------------------------------------------------------------------
    def units(self, block_size: int) -> int:
        """Host units a block of this size class takes (the format's bytes, rounded up to whole units)."""
        return -(-formats.block_bytes(self.cache, self.fmt, block_size) // self.host.unit_bytes)

    def wire_bytes(self, block_size: int) -> int:
        """Bytes a block of this size class takes below the device (and on the link): whole units."""
        return self.units(block_size) * self.host.unit_bytes

    def _space(self, block_size: int) -> dict:
        c = self.cache
        elem = c.dtype.itemsize
        row = c.block_stride(block_size) * elem
        return dict(num_rows=c.num_layers * 2, row_bytes=row, plane=c.storage.plane * elem, base=c.storage.base * elem)

    def _choose(self, nbytes: int) -> str:
        if self.path != "auto":
            return self.path
        return "sm" if nbytes < SM_BELOW_BYTES else "dma"

    # ---- moves ---------------------------------------------------------------------
    def to_host(self, block_size: int, device_ids: Sequence[int], host_starts: Sequence[int],
                path: str | None = None) -> Transfer:
        """Copy device blocks ``device_ids`` of one size class to host units ``host_starts`` (one batch)."""
        return self._move("device", "host", block_size, device_ids, host_starts, None, path)

    def to_device(self, block_size: int, host_starts: Sequence[int], device_ids: Sequence[int],
                  path: str | None = None, *, ordered: bool = True) -> Transfer:
        """Copy host units ``host_starts`` into device blocks ``device_ids`` (one batch, on the side stream).

        ``ordered=False``: do not wait for the work already queued on the current stream (a prefetch issued
        while decode steps run). Only when none of that work touches ``device_ids``: blocks that were free
        before it was queued."""
        return self._move("host", "device", block_size, device_ids, host_starts, None, path, ordered=ordered)

    def from_buffer(self, block_size: int, buffer: torch.Tensor, device_ids: Sequence[int], src: str = "disk",
                    path: str | None = None) -> Transfer:
        """Copy blocks laid out one after another in a (pinned) host ``buffer`` ``[n, block bytes]`` into device
        blocks ``device_ids`` (what a read from the disk tier lands in)."""
        return self._move(src, "device", block_size, device_ids, None, buffer, path)

    def to_buffer(self, block_size: int, device_ids: Sequence[int], buffer: torch.Tensor, dst: str = "disk",
                  path: str | None = None) -> Transfer:
        """Copy device blocks one after another into a (pinned) host ``buffer`` ``[n, block bytes]`` (what a write
        to the disk tier is made from)."""
        return self._move("device", dst, block_size, device_ids, None, buffer, path)

    def _move(self, src_tier: str, dst_tier: str, bs: int, dev: list[int], starts, buffer, path,
              ordered: bool = True) -> Transfer:
        c, g = self.cache, self._space(bs)
        dev = np.asarray(dev, dtype=np.int64).reshape(-1)
        n = len(dev)
        nblk = c.manager.pool.num_blocks(bs)
        if n and (dev.min() < 0 or dev.max() >= nblk or np.unique(dev).size != n):
            raise ValueError(f"device_ids must be distinct block ids in [0, {nblk}) of size {bs}, got {dev.tolist()}")
        bb = self.wire_bytes(bs)
        units = self.units(bs)
        if buffer is None:
            if len(starts) != n:
                raise ValueError(f"host_starts must hold one start per block ({n}), got {len(starts)}")
            runs = [(first, self.host.view(s, u), u // units) for first, s, u in contiguous_runs(starts, units)]
        else:
            if buffer.numel() * buffer.element_size() != n * bb:
                raise ValueError(f"buffer must hold {n} blocks of {bb} bytes, got {buffer.numel()} elements")
            runs = [(0, buffer.reshape(-1).view(torch.uint8), n)]
        path = self._choose(n * bb) if path is None else path
        if path not in ("dma", "sm"):
            raise ValueError(f"path must be 'dma' or 'sm', got {path!r}")
        if n == 0:
            return Transfer(src_tier, dst_tier, 0, 0, path, 0)
        to_host = dst_tier != "device"
        if path == "sm" and (buffer is not None or self.fmt.transcodes):
            path = "dma"  # a foreign buffer is not a host-tier space with unit strides, a transcode needs staging
        t0 = time.perf_counter()
        events = None
        both = np.concatenate((dev, np.asarray(starts, dtype=np.int64))) if path == "sm" else dev
        ids = self.ids.put(both) if self.cuda else torch.from_numpy(both.copy())
        dev_t, ids_h = ids[:n], (ids[n:] if path == "sm" else None)
        if self.cuda:
            main = torch.cuda.current_stream(c.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if ordered or to_host:
                self.side.wait_stream(main)
            if to_host and path == "sm":
                main.wait_stream(self.side)  # host units it writes may still be read by an earlier swap-in
            # swap-out: the device reads on the current stream (ordered before any reuse of the blocks)
            (main if to_host else self.side).record_event(start)
            with torch.cuda.stream(main if (to_host and path == "sm") else self.side):
                keep = self._run(path, to_host, g, dev_t, ids_h, runs, bb, main, bs)
                torch.cuda.current_stream().record_event(end)
            events = (start, end)
            event = end
            self.ids.done(end)
        else:
            keep = self._run(path, to_host, g, dev_t, ids_h, runs, bb, None, bs)
            event = None
        copies = 1 if path == "sm" else len(runs)
        self.stats.add(src_tier, dst_tier, n * bb, n, copies, 0.0 if self.cuda else time.perf_counter() - t0, events)
        return Transfer(src_tier, dst_tier, n * bb, n, path, copies, event, keep)

    def _run(self, path, to_host, g, dev_t, ids_h, runs, bb, main, bs) -> list:
        from workbench.kernels import move_blocks  # here: importing workbench.tiers stays free of Triton (+0.25 s)

        c = self.cache
        n = len(dev_t)
        pool_space = dict(buffer=c.storage.flat, row=g["plane"], blk=g["row_bytes"], off=g["base"])
        if path == "sm":
            host_units = self.host.unit_bytes
            host_space = dict(buffer=self.host.buffer, row=g["row_bytes"], blk=host_units, off=0)
            a, b = (pool_space, host_space) if to_host else (host_space, pool_space)
            ia, ib = (dev_t, ids_h) if to_host else (ids_h, dev_t)
            move_blocks(a["buffer"], ia, b["buffer"], ib, num_rows=g["num_rows"],
                        row_bytes=g["row_bytes"], src_row_stride=a["row"], src_block_stride=a["blk"],
                        dst_row_stride=b["row"], dst_block_stride=b["blk"], src_offset=a["off"],
                        dst_offset=b["off"], num_programs=self.sm_programs)
            return []
        # dma: a contiguous staging buffer on the device, one copy per host run. The staging buffer and the ids
        # are made on the stream whose kernel uses them: a swap-out's gather runs on the current stream, and an
        # arange queued on the side stream could still be unwritten when it read it (blocks gathered to the wrong
        # place: the H200 run lost a block's bytes on a round trip through the disk).
        # A format below the device: the batch is transcoded on a stream of its own between the gather and the
        # copies (after the copies, before the scatter, on the way back), in chunks (``_run_transcoded``), so a
        # decode on the current stream overlaps it and each chunk's transcode overlaps the previous chunk's copy.
        dev_bb = g["num_rows"] * g["row_bytes"]
        stage_space = dict(row=g["row_bytes"], blk=dev_bb)
        geometry = dict(num_rows=g["num_rows"], row_bytes=g["row_bytes"])
        if self.fmt.transcodes and not to_host:  # no staging of the whole batch: each chunk decodes into its own
            return self._run_transcoded(False, None, dev_t, runs, bb, bs, main,
                                        lambda st, sq, ids: self._scatter(st, sq, ids, stage_space, pool_space,
                                                                          geometry))
        with torch.cuda.stream(main) if (to_host and main is not None) else contextlib.nullcontext():
            staging = torch.empty(n * dev_bb, dtype=torch.uint8, device=c.device)
            if self.fmt.transcodes:  # gathered a chunk at a time, each chunk's encode right behind its gather
                def gather(lo: int, hi: int) -> None:  # on the current stream (``pipeline.transcode_out``)
                    seq_c = torch.arange(hi - lo, dtype=torch.int64, device=c.device)
                    self._gather(staging[lo * dev_bb:hi * dev_bb], dev_t[lo:hi], seq_c, pool_space, stage_space,
                                 geometry)

                return [staging] + self._run_transcoded(True, staging.view(n, dev_bb), dev_t, runs, bb, bs, main,
                                                        gather)
            seq = torch.arange(n, dtype=torch.int64, device=c.device)
            if to_host:
                self._gather(staging, dev_t, seq, pool_space, stage_space, geometry)
        keep = [staging]
        if to_host:
            if main is not None:
                self.side.wait_stream(main)  # the copies read what the gather wrote
            for first, host_run, count in runs:
                host_run.copy_(staging[first * bb:(first + count) * bb], non_blocking=self.cuda)
        else:
            for first, host_run, count in runs:
                staging[first * bb:(first + count) * bb].copy_(host_run[:count * bb], non_blocking=self.cuda)
            self._scatter(staging, seq, dev_t, stage_space, pool_space, geometry)
        if self.cuda:
            keep[0].record_stream(self.side)
        return keep

    def chunks(self, n: int, block_size: int) -> list[tuple[int, int]]:
        """How a transcoding move of ``n`` blocks of ``block_size`` is cut (``pipeline.chunk_ranges`` with this
        mover's ``chunk_bytes``); one chunk where the format is the device's."""
        if not self.fmt.transcodes:
            return pipeline.chunk_ranges(n, self.wire_bytes(block_size), None)
        return pipeline.chunk_ranges(n, self.wire_bytes(block_size), self.chunk_bytes)

    def _run_transcoded(self, to_host, staging, dev_t, runs, bb, bs, main, move) -> list:
        """A transcoding move in chunks (``pipeline``): gathers on the current stream (``move(lo, hi)`` a chunk's),
        encodes and decodes on the ``xcode`` stream, copies on ``side``, scatters on ``xcode`` (``move(staging,
        seq, ids)``); on a CPU the same chunks in turn."""
        n = len(dev_t)
        chunks = self.chunks(n, bs)
        xcode, side = (self._xcode(), self.side) if self.cuda else (None, None)
        if to_host:
            if xcode is not None:
                staging.record_stream(xcode)
            return pipeline.transcode_out(self, staging, runs, bb, bs, chunks, move, main, xcode, side)
        wire = torch.empty(n * bb, dtype=torch.uint8, device=self.cache.device)  # on side (a CUDA move)
        if xcode is not None:
            xcode.wait_stream(side)  # a swap-in's scatters come after what side waited for (ordered moves)
        return [wire] + pipeline.transcode_in(self, wire, runs, bb, bs, chunks, dev_t, move, xcode, side)

    def _xcode(self):
        if self._xcode_stream is None:
            self._xcode_stream = torch.cuda.Stream(self.cache.device)
        return self._xcode_stream

    def _encode(self, staged: torch.Tensor, bs: int, wire_bytes: int) -> torch.Tensor:
        """Device-format blocks ``[n, device block bytes]`` -> what goes on the link ``[n, wire_bytes]``."""
        if not self.fmt.transcodes:
            return staged
        packed = formats.encode(self.cache, self.fmt, bs, staged, self.nonfinite)
        if packed.shape[1] == wire_bytes:
            return packed
        wire = torch.zeros((packed.shape[0], wire_bytes), dtype=torch.uint8, device=packed.device)
        wire[:, :packed.shape[1]] = packed
        return wire

    def _decode(self, wire: torch.Tensor, bs: int) -> torch.Tensor:
        """What came over the link ``[n, wire bytes]`` -> device-format blocks ``[n, device block bytes]``."""
        fmt_bytes = formats.block_bytes(self.cache, self.fmt, bs)
        packed = wire if wire.shape[1] == fmt_bytes else wire[:, :fmt_bytes].contiguous()
        return formats.decode(self.cache, self.fmt, bs, packed)

    def _gather(self, staging, dev_t, seq, pool_space, stage_space, geometry) -> None:
        """Scattered device blocks -> staging (block-major)."""
        if not self.cuda:  # a CPU "DMA": torch indexing (the kernel would run under the interpreter)
            blocks = self._blocks_view(pool_space, geometry)  # [rows, num_blocks, row_bytes]
            staging.view(len(dev_t), geometry["num_rows"], -1).copy_(blocks[:, dev_t].transpose(0, 1))
            return
        from workbench.kernels import move_blocks  # (as in _run: workbench.tiers stays free of Triton)

        move_blocks(pool_space["buffer"], dev_t, staging, seq, **geometry, num_programs=self.dma_programs,
                    src_row_stride=pool_space["row"], src_block_stride=pool_space["blk"],
                    dst_row_stride=stage_space["row"], dst_block_stride=stage_space["blk"],
                    src_offset=pool_space["off"])

    def _scatter(self, staging, seq, dev_t, stage_space, pool_space, geometry) -> None:
        """Staging (block-major) -> scattered device blocks."""
        if not self.cuda:
            blocks = self._blocks_view(pool_space, geometry)
            blocks[:, dev_t] = staging.view(len(dev_t), geometry["num_rows"], -1).transpose(0, 1)
            return
        from workbench.kernels import move_blocks  # (as in _run: workbench.tiers stays free of Triton)

        move_blocks(staging, seq, pool_space["buffer"], dev_t, **geometry, num_programs=self.dma_programs,
                    src_row_stride=stage_space["row"], src_block_stride=stage_space["blk"],
                    dst_row_stride=pool_space["row"], dst_block_stride=pool_space["blk"],
                    dst_offset=pool_space["off"])

    def _blocks_view(self, pool_space, geometry) -> torch.Tensor:
        """The pool's bytes as ``[rows, num_blocks, row_bytes]`` (a view)."""
        c = self.cache
        flat = c.storage.flat.view(torch.uint8)
        rows, row = geometry["num_rows"], geometry["row_bytes"]
        nblk = pool_space["row"] // row
        return flat.as_strided((rows, nblk, row), (pool_space["row"], row, 1), pool_space["off"])


class PinnedIds:
    """Block ids for the copy kernels, in a ring of pinned host memory that the kernels read directly (mapped).

    Uploading them instead would go through the host-to-device copy engine, whose queue holds the swap-ins in
    flight: the upload, and the host with it, would wait until those finish (measured: 13 prefetches took as long
    to *issue* as to run, and nothing overlapped). A range of the ring is reused once the move that read it has
    completed (its event); the ring is large, so that wait is rare."""

    def __init__(self, capacity: int = 1 << 16):
        self.buf = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.head = 0
        self.inflight: list = []  # (start, end, event of the move reading it)
        self._last = (0, 0)

    def put(self, ids) -> torch.Tensor:
        n, cap = len(ids), self.buf.numel()
        if n > cap:  # a huge batch: its own pinned tensor (allocating page-locked memory synchronizes, once)
            self._last = (0, 0)
            return torch.as_tensor(np.asarray(ids, dtype=np.int64)).pin_memory()
        if self.head + n > cap:
            self.head = 0
        start, end = self.head, self.head + n
        keep = []
        for s, e, event in self.inflight:
            if s < end and start < e:
                event.synchronize()  # that move still reads this range
            elif not event.query():
                keep.append((s, e, event))
        self.inflight = keep
        view = self.buf[start:end]
        view.numpy()[:] = ids
        self.head = end
        self._last = (start, end)
        return view

    def done(self, event) -> None:
        """The last :meth:`put` range is read by the move that ``event`` follows."""
        if self._last[1] > self._last[0]:
            self.inflight.append((*self._last, event))


def block_bytes(cache, block_size: int) -> int:
    """Bytes one block of this size class takes in every layer's K and V (codes, scales, padding)."""
    return cache.num_layers * 2 * cache.block_stride(block_size) * cache.dtype.itemsize
