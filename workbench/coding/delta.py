"""Lossless delta + entropy coding of K/V (CacheGen's observation; the seed's part 6.2), and a lossy variant that
delta-codes quantized codes.

    enc = encode(k)                      # [T, H, D] or [T, C]; fp16 / bf16 / fp32 / fp8 / int8 / uint8 ...
    assert torch.equal(decode(enc).view(torch.int16), k.view(torch.int16))   # bit for bit, NaN payloads too
    enc.ratio, enc.nbytes, enc.stages    # raw bytes / stored bytes; ("delta:sub", "shuffle:token", "zstd:3")
    blob = enc.to_bytes(); Encoded.from_bytes(blob)                          # self-describing, checked on read

The lossy variant (quantize, then delta-code the codes) is :mod:`workbench.compress.delta_quant`; what both take,
and the checks that refuse the rest, are in :mod:`workbench.coding.delta_options`.

Stages of the lossless path (each optional, recorded in :class:`Encoded`):

1. **integer view**: the tensor's raw bits as unsigned integers of its item size (fp16/bf16 -> 16 bits, fp32 ->
   32, fp8/int8/uint8 -> 8), rows = tokens, columns = channels (``H * D`` flattened).
2. **delta** along the token axis, per channel: row ``t`` minus row ``t - 1`` in wrapping (mod ``2**bits``)
   integer arithmetic, row 0 raw (``"sub"``), or Gorilla-style XOR with the previous row (``"xor"``). Both are
   exact inverses on any bit pattern (NaN payloads, -0.0, subnormals, Inf). ``"sub"`` is the default: it beat
   ``"xor"`` on real fp16 K/V (1.168x vs 1.161x over every layer and kind; equal in bf16).
3. **byte-plane shuffle**: all high bytes, then the next, ... down to the low bytes (a small delta's high byte is
   mostly 0x00 / 0xFF), each plane row by row (``order="channel"``: one channel's tokens side by side; better on
   some single layers in bf16, worse overall, and slower). Each plane is its own zstd *frame*: zstd Huffman-codes a
   block's literals with one table, so planes sharing a block (both fit in 128 KiB for one layer) share a table and
   the shuffle buys nothing (fp16 keys of one layer: 1.07x in one frame, 1.15x with a frame per plane, measured).
4. **zero-run-length coding** (``rle=True``): each run of zero bytes kept as one 0x00 marker per 256 zeros in a
   literal stream plus a stream of run lengths (``len - 1``, one byte each); decoded by one ``np.repeat``. Off by
   default, kept as an option with its measurement: zstd's LZ already codes a run as one match at offset 1, and on
   the real K/V the run stream costs more than it saves (fp16 1.164x with RLE vs 1.168x without, bf16 1.399x vs
   1.414x) while encoding 3-5x slower.
5. **zstd** (``level`` -7..22), one frame per segment with its content size; an xxh3_64 checksum of the header
   (every byte but the checksum: dtype, shape, delta, flags, level) and the whole payload (``xxhash``, at memory
   speed) is checked before decoding, and every frame's size against the shape, so a corrupted or truncated
   encoding fails loudly (:class:`ValueError`), never as garbage: a flipped delta or order bit too.

Why zstandard: a well-kept library (python-zstandard over Meta's reference C zstd; wheels everywhere; already a
dependency) that is fast C on both sides, streams, and trades speed for ratio with one ``level`` (levels 1 and 3
gave the same ratio on real K/V, level 1 about 3x faster; ``--levels`` of ``delta_study``). Its Huffman literal
coding lands within ~0.5% (fp16) to ~4% (bf16) of the order-0 entropy of the byte planes (:func:`entropy_bits`:
the bound of an order-0 coder over the shuffled planes) and passes it where LZ finds repeated rows (layer 0, whose
K/V depend on the token alone). bf16's high plane holds ~2.8 bits a byte, where Huffman's whole-bit code lengths
lose most: an ANS / arithmetic coder such as ``constriction`` (Rust, numpy in and out) with one table per plane
would close those few percent, and context models (the high byte per channel, the low byte given the high one)
could go further, which zstd cannot do; not installed and not measured here. nvCOMP (GPU ANS / zstd /
bitcomp) is what could save host-link bytes, since a CPU codec sees the bytes only after they crossed the link
raw; it is on PyPI (``nvidia-libnvcomp-cu13``) but not installed, and untested here.

What the real K/V give (SmolLM2-135M, 5 prompts x 6 layers, ``delta_study``; bytes-weighted): the low mantissa
byte stays at ~8 bits of entropy, so lossless ratios are ~1.15-1.25x in fp16 and ~1.4-1.55x in bf16. The delta
helps keys a little in deeper layers (fp16 layer 18: 1.15x -> 1.18x) and hurts values (1.17x -> 1.12-1.13x),
CacheGen's "keys much more than values"; at layer 0 rows repeat with their tokens and the delta hides the repeats
(2.15x -> 1.31x). Over all layers and kinds ``delta=False`` is better (fp16 1.23x vs 1.17x, bf16 1.50x vs
1.41x): the default follows the issue (delta on, for keys); pass ``delta=False`` for values and layer 0. The large
ratios come after quantization (``delta_quant.encode_quantized``): int8/token keys 2.40x against fp16 with the delta
(the codes alone 1.88x), int4/token keys 3.46x (alone 3.2x), near CacheGen's 3.5-4.3x.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass, replace

import numpy as np
import torch
import xxhash
import zstandard

from .delta_options import (
    DELTAS,
    DTYPE_VIEWS,
    DTYPES,
    MAX_LEVEL,
    MIN_LEVEL,
    ORDERS,
    check_choice,
    check_flag,
    check_level,
    check_shape,
    check_tensor,
    delta_mode,
    dtype_name,
)

_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # numpy types torch.from_numpy takes
_BY_CODE = {code: dt for dt, (_, _, code) in DTYPE_VIEWS.items()}
RUN = 256  # zeros per RLE marker at most (the run-length byte holds ``len - 1``)

_MAGIC = b"KVDZ"
_VERSION = 2  # 1: the checksum covered the payload only (no committed data holds version 1)
_META = struct.Struct("<4sBBBBbB")  # magic, version, dtype code, delta, flags (shuffle, rle, order), level, ndim
_HEAD = struct.Struct("<4sBBBBbBQ")  # _META, then the xxh3_64 of _META + shape + payload
_DELTA_CODE = {"none": 0, "sub": 1, "xor": 2}
_CODE_DELTA = {v: k for k, v in _DELTA_CODE.items()}


@dataclass(frozen=True)
class Encoded:
    """One tensor, delta-coded and compressed.

    Attributes:
        dtype: the original dtype (decoded back to it).
        shape: the original shape, ``(T, H, D)`` or ``(T, C)``.
        delta: ``"sub"``, ``"xor"`` or ``"none"`` (along the token axis, per channel).
        shuffle: byte planes split (each its own zstd frame).
        order: ``"channel"`` (a plane's bytes channel by channel) or ``"token"`` (row by row); only with ``shuffle``.
        rle: zero runs coded (module docstring, stage 4).
        level: the zstd level it was compressed at.
        payload: zstd frames, one per segment (a byte plane; with ``rle`` its literals, then its run lengths),
            each with its content size.
        checksum: xxh3_64 of the header (every field above, as :meth:`to_bytes` writes them) and ``payload``
            (:meth:`digest`), checked before decoding (:func:`decode`).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    delta: str
    shuffle: bool
    order: str
    rle: bool
    level: int
    payload: bytes
    checksum: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_VIEWS:
            raise ValueError(f"dtype must be one of {[dtype_name(d) for d in DTYPES]}, got {self.dtype!r}")
        check_shape("shape", tuple(self.shape))
        check_choice("delta", self.delta, DELTAS)
        check_choice("order", self.order, ORDERS)
        check_level(self.level)
        if not isinstance(self.payload, (bytes, bytearray, memoryview)):
            raise ValueError(f"payload must be bytes, got {type(self.payload).__name__}")
        if isinstance(self.checksum, bool) or not isinstance(self.checksum, int) or not 0 <= self.checksum < 1 << 64:
            raise ValueError(f"checksum must be a 64-bit unsigned int (xxh3_64 of payload), got {self.checksum!r}")

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages applied, in order, e.g. ``("delta:sub", "shuffle:token", "zstd:3")``."""
        out = [] if self.delta == "none" else [f"delta:{self.delta}"]
        if self.shuffle:
            out.append(f"shuffle:{self.order}")
        if self.rle:
            out.append("rle")
        return (*out, f"zstd:{self.level}")

    @property
    def itemsize(self) -> int:
        return DTYPE_VIEWS[self.dtype][0].itemsize

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the original tensor."""
        return math.prod(self.shape) * self.itemsize

    @property
    def header_nbytes(self) -> int:
        return _HEAD.size + 8 * len(self.shape)

    def _meta(self) -> bytes:
        """The header's bytes but the checksum: what decoding depends on, besides the payload."""
        flags = int(self.shuffle) | int(self.rle) << 1 | (self.order == "channel") << 2
        meta = _META.pack(_MAGIC, _VERSION, DTYPE_VIEWS[self.dtype][2], _DELTA_CODE[self.delta], flags, self.level,
                          len(self.shape))
        return meta + struct.pack(f"<{len(self.shape)}Q", *self.shape)

    def digest(self) -> int:
        """xxh3_64 of the header (but the checksum) and the payload: what :attr:`checksum` must be."""
        h = xxhash.xxh3_64()
        h.update(self._meta())
        h.update(self.payload)
        return h.intdigest()

    @property
    def nbytes(self) -> int:
        """Stored bytes: the payload plus the header :meth:`to_bytes` writes (dtype, shape, stages)."""
        return self.header_nbytes + len(self.payload)

    @property
    def ratio(self) -> float:
        """``raw_nbytes / nbytes`` (> 1: smaller than the original)."""
        return self.raw_nbytes / self.nbytes

    def to_bytes(self) -> bytes:
        """A self-describing blob (header + payload) that :meth:`from_bytes` reads back; ``len() == nbytes``."""
        meta = self._meta()
        return meta[:_META.size] + struct.pack("<Q", self.checksum) + meta[_META.size:] + bytes(self.payload)

    @classmethod
    def from_bytes(cls, blob: bytes) -> Encoded:
        """Parse :meth:`to_bytes`; a ValueError naming ``blob`` when it is not one (the payload is checked by
        :func:`decode`)."""
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise ValueError(f"blob must be bytes, got {type(blob).__name__}")
        blob = bytes(blob)
        if len(blob) < _HEAD.size:
            raise ValueError(f"blob is truncated: {len(blob)} bytes, a header takes {_HEAD.size}")
        magic, version, dcode, delta, flags, level, ndim, checksum = _HEAD.unpack_from(blob)
        if magic != _MAGIC:
            raise ValueError(f"blob is not an encoded tensor (magic {magic!r}, expected {_MAGIC!r})")
        if version != _VERSION:
            raise ValueError(f"blob has format version {version}, this reader knows {_VERSION}")
        if dcode not in _BY_CODE or delta not in _CODE_DELTA or flags >> 3 or ndim not in (2, 3) or not (
                MIN_LEVEL <= level <= MAX_LEVEL):
            raise ValueError(f"blob has a corrupted header (dtype code {dcode}, delta {delta}, flags {flags}, "
                             f"ndim {ndim})")
        end = _HEAD.size + 8 * ndim
        if len(blob) < end:
            raise ValueError(f"blob is truncated: {len(blob)} bytes, its header takes {end}")
        shape = struct.unpack_from(f"<{ndim}Q", blob, _HEAD.size)
        try:
            return cls(_BY_CODE[dcode], tuple(int(s) for s in shape), _CODE_DELTA[delta], bool(flags & 1),
                       "channel" if flags & 4 else "token", bool(flags & 2), level, blob[end:], checksum)
        except ValueError as e:  # an empty shape, ...
            raise ValueError(f"blob has a corrupted header: {e}") from None


# ---- the stages (numpy, unsigned integers) -----------------------------------------------------------------------
def _as_uint(x: torch.Tensor) -> np.ndarray:
    """``x``'s bits as a ``[T, C]`` unsigned numpy array (no copy when ``x`` is contiguous on the CPU)."""
    iview, utype, _ = DTYPE_VIEWS[x.dtype]
    x = x.detach().cpu().contiguous()
    return x.view(iview).numpy().view(utype).reshape(x.shape[0], -1)


def _delta(u: np.ndarray, mode: str) -> np.ndarray:
    if mode == "none":
        return u
    d = np.empty_like(u)  # [T, C]
    d[:1] = u[:1]
    if mode == "sub":
        np.subtract(u[1:], u[:-1], out=d[1:])  # unsigned: wraps mod 2**bits
    else:
        np.bitwise_xor(u[1:], u[:-1], out=d[1:])
    return d


def _undelta(d: np.ndarray, mode: str) -> np.ndarray:
    """Inverse of :func:`_delta`, in place on ``d`` (``[T, C]``, writable): a running sum (wrapping) or XOR."""
    if mode == "none":
        return d
    op = np.add if mode == "sub" else np.bitwise_xor
    if d.shape[1] >= 256:  # row by row: each step vectorized over channels (5 GB/s; np.cumsum(axis=0) ~0.6)
        for t in range(1, d.shape[0]):
            op(d[t - 1], d[t], out=d[t])
        return d
    return op.accumulate(d, axis=0, dtype=d.dtype, out=d)  # unsigned: wraps mod 2**bits, the exact inverse


def _planes(d: np.ndarray, order: str) -> list[np.ndarray]:
    """``[T, C]`` items -> ``itemsize`` byte planes ``[T * C]``, high byte first; a plane channel- or token-major."""
    if order == "channel":
        d = np.ascontiguousarray(d.T)  # [C, T]
    b = d.view(np.uint8).reshape(d.size, d.itemsize)  # little endian: column itemsize - 1 is the high byte
    return [np.ascontiguousarray(b[:, k]) for k in range(d.itemsize - 1, -1, -1)]


def _unplanes(planes: list[np.ndarray], T: int, C: int, utype, order: str) -> np.ndarray:
    """Inverse of :func:`_planes`: a new writable ``[T, C]`` array."""
    n = len(planes)
    b = np.empty((T * C, n), np.uint8)
    for k, p in enumerate(planes):
        b[:, n - 1 - k] = p
    u = b.view(utype).reshape((C, T) if order == "channel" else (T, C))
    return np.ascontiguousarray(u.T) if order == "channel" else u


def rle_encode(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Zero runs of bytes ``p`` ``[N]`` -> ``(literals, runs)``: each run of ``L`` zeros kept as
    ``ceil(L / 256)`` zero markers in ``literals``, with ``runs`` holding one ``chunk - 1`` byte per marker."""
    z = p == 0
    if not z.any():
        return p, np.zeros(0, np.uint8)
    edge = np.diff(np.concatenate(([False], z, [False])).astype(np.int8))
    starts, ends = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)  # run i covers [starts[i], ends[i])
    lengths = ends - starts
    markers = -(-lengths // RUN)  # per run
    rid = np.maximum(np.cumsum(edge[:-1] == 1) - 1, 0)  # [N]: the run a zero belongs to
    keep = ~z | (np.arange(p.size) - starts[rid] < markers[rid])  # a run keeps its first `markers` zeros
    chunks = np.full(int(markers.sum()), RUN, np.int64)  # every marker a full 256 but each run's last
    chunks[np.cumsum(markers) - 1] = lengths - RUN * (markers - 1)
    return p[keep], (chunks - 1).astype(np.uint8)


def rle_decode(lits: np.ndarray, runs: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`rle_encode`; a ValueError when the streams do not make ``n`` bytes."""
    counts = np.ones(lits.size, np.int64)
    zeros = lits == 0
    if int(zeros.sum()) != runs.size:
        raise ValueError(f"enc payload is corrupted: {int(zeros.sum())} zero-run markers, {runs.size} run lengths")
    counts[zeros] = runs.astype(np.int64) + 1
    if int(counts.sum()) != n:
        raise ValueError(f"enc payload is corrupted: zero runs decode to {int(counts.sum())} bytes, expected {n}")
    return np.repeat(lits, counts)


# ---- encode / decode ---------------------------------------------------------------------------------------------
_LOCAL = threading.local()  # zstd contexts are not thread-safe: one compressor per level and thread


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _LOCAL.__dict__.setdefault("compressors", {})
    if level not in cache:
        # no per-frame checksum: one xxh3_64 over the whole payload (Encoded.checksum) covers every frame
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    return cache[level]


def encode(x: torch.Tensor, *, delta: bool | str = True, shuffle: bool = True, order: str = "token",
           rle: bool = False, level: int = 3) -> Encoded:
    """Compress ``x`` losslessly (module docstring for the stages).

    Args:
        x: ``[T, H, D]`` or ``[T, C]``, any dtype of ``delta_options.DTYPES``, on any device (coded on the CPU).
        delta: ``True`` / ``"sub"`` (wrapping integer difference with the previous token), ``"xor"``, or
            ``False`` / ``"none"``.
        shuffle: split the byte planes (high bytes first), each its own zstd frame.
        order: ``"token"`` or ``"channel"``: the byte order inside a plane.
        rle: code zero runs before zstd.
        level: zstd level, -7 (fastest) .. 22; 0 is zstd's default (3).

    Returns:
        An :class:`Encoded`; :func:`decode` gives ``x`` back bit for bit.
    """
    x = check_tensor(x)
    mode = delta_mode(delta)
    shuffle, rle = check_flag("shuffle", shuffle), check_flag("rle", rle)
    check_choice("order", order, ORDERS)
    check_level(level)
    d = _delta(_as_uint(x), mode)  # [T, C]
    segments = _planes(d, order) if shuffle else [d.reshape(-1).view(np.uint8)]
    if rle:
        coded = [rle_encode(s) for s in segments]
        segments = [c[0] for c in coded] + [c[1] for c in coded]  # literals of every plane, then their runs
    cctx = _compressor(level)
    payload = b"".join(cctx.compress(s.data) for s in segments)  # one frame (its own Huffman table) per segment
    enc = Encoded(x.dtype, tuple(x.shape), mode, shuffle, order, rle, level, payload, 0)
    return replace(enc, checksum=enc.digest())


def _frames(enc: Encoded, sizes: list[int | None], at_most: int) -> list[np.ndarray]:
    """The payload's frames (checksum verified): ``len(sizes)`` of them, frame ``i`` holding ``sizes[i]`` bytes
    (``None``: any number up to ``at_most`` in all)."""
    rest = bytes(enc.payload)
    got = enc.digest()
    if got != enc.checksum:
        raise ValueError(f"enc payload or header is corrupted: their xxh3_64 is {got:#018x}, the encoder recorded "
                         f"{enc.checksum:#018x} ({len(rest)} payload bytes, {enc.stages}, {list(enc.shape)})")
    out, total = [], 0
    for i, want in enumerate(sizes):
        try:
            size = zstandard.frame_content_size(rest)
        except zstandard.ZstdError as e:
            got = "ends" if not rest else f"is not a zstd frame ({e})"
            raise ValueError(f"enc payload is corrupted: frame {i + 1} of {len(sizes)} {got}") from None
        total += size
        if (want is not None and size != want) or size < 0 or total > at_most:
            need = want if want is not None else f"at most {at_most} in all"
            raise ValueError(f"enc payload is corrupted: frame {i + 1} holds {size} bytes, the tensor needs {need}")
        obj = zstandard.ZstdDecompressor().decompressobj()
        try:
            data = obj.decompress(rest)
        except zstandard.ZstdError as e:
            raise ValueError(f"enc payload is corrupted: frame {i + 1} ({e})") from None
        if not obj.eof:
            raise ValueError(f"enc payload is truncated: frame {i + 1} of {len(sizes)} ends early")
        if len(data) != size:
            raise ValueError(f"enc payload is corrupted: frame {i + 1} decoded {len(data)} bytes, it says {size}")
        out.append(np.frombuffer(data, np.uint8))
        rest = obj.unused_data
    if rest:
        raise ValueError(f"enc payload has {len(rest)} bytes after its {len(sizes)} zstd frames")
    return out


def decode(enc: Encoded, device: torch.device | str | None = None) -> torch.Tensor:
    """The tensor :func:`encode` coded, bit for bit (same dtype and shape; on ``device``, default the CPU).

    Raises:
        ValueError: naming ``enc`` when it is not an :class:`Encoded` or its payload is corrupted or truncated.
    """
    if not isinstance(enc, Encoded):
        raise ValueError(f"enc must be an Encoded (from encode()), got {type(enc).__name__}")
    iview, utype, _ = DTYPE_VIEWS[enc.dtype]
    T, C, isz = enc.shape[0], math.prod(enc.shape[1:]), iview.itemsize
    segs = isz if enc.shuffle else 1
    per = T * C * isz // segs  # bytes of one segment (a plane, or everything)
    if enc.rle:  # a zero costs at most 2 bytes coded (marker + run): the bound stops a forged size early
        raw = _frames(enc, [None] * (2 * segs), 2 * per * segs)
        segments = [rle_decode(raw[i], raw[segs + i], per) for i in range(segs)]
    else:
        segments = _frames(enc, [per] * segs, per * segs)
    if enc.shuffle:
        d = _unplanes(segments, T, C, utype, enc.order)
    else:
        d = segments[0].view(utype).reshape(T, C).copy()  # frombuffer is read-only; undelta works in place
    u = _undelta(d, enc.delta)
    out = torch.from_numpy(u.view(_SIGNED[isz])).view(enc.dtype).reshape(enc.shape)
    return out if device is None else out.to(device)


# ---- the bound -------------------------------------------------------------------------------------------------
def plane_entropy(x: torch.Tensor, *, delta: bool | str = True) -> list[float]:
    """Order-0 entropy (bits per byte) of each byte plane of ``x`` after the delta, high byte first."""
    x = check_tensor(x)
    d = _delta(_as_uint(x), delta_mode(delta))
    out = []
    for plane in _planes(d, "token"):
        counts = np.bincount(plane, minlength=256)
        p = counts[counts > 0] / plane.size
        out.append(float(-(p * np.log2(p)).sum()))
    return out


def entropy_bits(x: torch.Tensor, *, delta: bool | str = True) -> float:
    """Bits per value an order-0 entropy coder of each byte plane (after the delta) needs: the sum of
    :func:`plane_entropy`. ``8 * itemsize / entropy_bits(x)`` is the bound ratio (:func:`entropy_ratio`) that
    zstd's Huffman stage is measured against; coders with context (LZ matches, models across planes) can pass it."""
    return sum(plane_entropy(x, delta=delta))


def entropy_ratio(x: torch.Tensor, *, delta: bool | str = True) -> float:
    """``8 * itemsize / entropy_bits(x)`` (inf for a constant tensor)."""
    bits = entropy_bits(x, delta=delta)
    return math.inf if bits == 0 else 8 * DTYPE_VIEWS[x.dtype][0].itemsize / bits


__all__ = ["Encoded", "decode", "encode", "entropy_bits", "entropy_ratio", "plane_entropy", "rle_decode", "rle_encode"]
