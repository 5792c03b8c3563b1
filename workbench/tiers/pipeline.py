"""A transcoding move in chunks: the transcode of one chunk runs beside the host link's copy of the one before.

A format below the device (``workbench.tiers.formats``) puts a transcode between the gather and the copy of a
swap-out (between the copy and the scatter of a swap-in). Done for the whole batch and then copied, the two add up:
on an H100 (``bench tiers``, 2026-12-05) int4 per token moved 2.0-2.3x fp16's tokens a second at 1024 blocks, where
its bytes (0.31 of fp16's) allow 3.2x, because the transcode of the batch (0.27 of copy bandwidth) ran before its
DMA began. Cut into chunks, the transcode of chunk ``i + 1`` (on the mover's ``xcode`` stream) runs while the copy
engine moves chunk ``i`` (on its ``side`` stream), and on the way down each chunk is gathered just before its encode
(the whole batch's gather, ~1 ms at 1024 blocks of 64, ran in front of everything when it was one launch): what is
left is the first chunk's gather and transcode, and the link moves the format's bytes at its own speed. A chunk must
stay large: issuing its transcode costs the host ~0.9 ms whatever its size (four Triton launches and their checks:
``scripts/probe_transcode_host.py``, H100, 2026-12-05: encode 910-950 us, decode 850-880 us, at 32 and 128 blocks of
64 tokens), and a move whose chunks copy faster than the host issues them is host-bound (the same H100 with 8 MiB
chunks: int4 at 16-token blocks 1.2x fp16's tokens a second against 2.2x in one piece). So a chunk's copy outlasts
that issue time: 48 MiB at the link's ~55 GB/s is 0.9 ms. With the gather per chunk, 48 MiB chunks moved the most
(``scripts/probe_tier_chunks.py``, H100, 2026-12-05, 1024 blocks of 64: int4 2.86 / 2.92x fp16's tokens down / up,
96 MiB 2.77 / 2.83x, 24 MiB 2.70 / 2.89x; int2 3.99 / 4.40x at 48 MiB).

On a CPU the same chunks run one after another (no streams): the tests cover the splitting there.
"""

from __future__ import annotations

import contextlib

import torch

#: A chunk's wire bytes at least (its copy outlasts the host's issue of the next chunk's transcode, see above),
#: and at most this many chunks a batch.
CHUNK_BYTES = 48 << 20
MAX_CHUNKS = 8


def chunk_ranges(n: int, block_bytes: int, chunk_bytes: int | None = CHUNK_BYTES,
                 max_chunks: int = MAX_CHUNKS) -> list[tuple[int, int]]:
    """Block ranges ``[(lo, hi), ...]`` that cut a batch of ``n`` blocks of ``block_bytes`` (wire bytes) into chunks of
    at least ``chunk_bytes`` each, at most ``max_chunks``, as equal as whole blocks allow; ``chunk_bytes=None``: one
    chunk (the whole batch, no pipeline)."""
    for name, v in (("n", n), ("block_bytes", block_bytes), ("max_chunks", max_chunks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "n" else 1):
            raise ValueError(f"{name} must be an int >= {0 if name == 'n' else 1}, got {v!r}")
    if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)
                                    or chunk_bytes < 1):
        raise ValueError(f"chunk_bytes must be None or a positive int, got {chunk_bytes!r}")
    if n == 0:
        return []
    k = 1 if chunk_bytes is None else max(1, min(max_chunks, n // -(-chunk_bytes // block_bytes)))
    bounds = [n * i // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def run_pieces(runs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The parts of host runs ``[(first block, blocks), ...]`` (a batch's blocks in host order) that fall in the chunk
    ``[lo, hi)``: ``(run index, first block, last block + 1)`` in batch order."""
    out = []
    for i, (first, count) in enumerate(runs):
        a, b = max(lo, first), min(hi, first + count)
        if a < b:
            out.append((i, a, b))
    return out


def _stream(s):
    return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()


def _record(s) -> torch.cuda.Event | None:
    """An event marking what ``s`` has queued so far (None without streams: a CPU runs everything in turn)."""
    if s is None:
        return None
    event = torch.cuda.Event()
    s.record_event(event)
    return event


def _after(s, event) -> None:
    """``s`` waits for ``event`` (:func:`_record`'s) before what it queues next."""
    if s is not None and event is not None:
        s.wait_event(event)


def transcode_out(mover, staging: torch.Tensor, runs, bb: int, bs: int, chunks: list[tuple[int, int]], gather,
                  main, xcode, side) -> list[torch.Tensor]:
    """Swap-out: device blocks -> the host runs, a chunk at a time: ``gather(lo, hi)`` the chunk's blocks into
    ``staging`` ``[n, device block bytes]`` on ``main`` (the current stream: ordered before any reuse of the blocks),
    encode on ``xcode`` once they are in, copy on ``side`` after that (``None`` streams: a CPU, one after another).
    Only the first chunk's gather and encode wait in front of the copies. Returns the buffers to keep alive until
    the move completes."""
    keep = []
    spans = [(first, count) for first, _, count in runs]
    for lo, hi in chunks:
        with _stream(main):
            gather(lo, hi)
            gathered = _record(main)
        with _stream(xcode):
            _after(xcode, gathered)
            wire = mover._encode(staging[lo:hi], bs, bb).reshape(-1)
            done = _record(xcode)
            if xcode is not None:
                wire.record_stream(side)
        keep.append(wire)
        with _stream(side):
            _after(side, done)
            for i, a, b in run_pieces(spans, lo, hi):
                first, host_run, _ = runs[i]
                host_run[(a - first) * bb:(b - first) * bb].copy_(wire[(a - lo) * bb:(b - lo) * bb],
                                                                  non_blocking=xcode is not None)
    return keep


def transcode_in(mover, wire: torch.Tensor, runs, bb: int, bs: int, chunks: list[tuple[int, int]], dev_t,
                 scatter, xcode, side) -> list[torch.Tensor]:
    """Swap-in: the host runs -> ``wire`` ``[n * bb]`` a chunk at a time on ``side``, each chunk decoded and scattered
    (``scatter(staging, seq, ids)``) on ``xcode`` once its copy is in; ``side`` then waits for ``xcode`` (the move's
    end event, recorded on ``side``, covers the scatters). Returns the buffers to keep alive."""
    keep = []
    spans = [(first, count) for first, _, count in runs]
    if xcode is not None:
        wire.record_stream(xcode)
    for lo, hi in chunks:
        with _stream(side):
            for i, a, b in run_pieces(spans, lo, hi):
                first, host_run, _ = runs[i]
                wire[a * bb:b * bb].copy_(host_run[(a - first) * bb:(b - first) * bb], non_blocking=side is not None)
            arrived = _record(side)
        with _stream(xcode):
            _after(xcode, arrived)
            staging = mover._decode(wire.view(-1, bb)[lo:hi], bs).reshape(-1)
            seq = torch.arange(hi - lo, dtype=torch.int64, device=wire.device)
            scatter(staging, seq, dev_t[lo:hi])
        keep.append(staging)
    if side is not None:
        side.wait_stream(xcode)
    return keep
