"""What a storage format per tier buys on the link, as a pure model: bytes per token, tokens/s moved down and up,
the transcode's time against the copy's, and the link bandwidth below which a format pays.

    table = format_table(kv_spec.model("smollm2-135m"), block_size=16, batch=64, link=latest_link_model())
    table.rows[i]["down_speedup"]      # tokens/s moved to the host in that format / in the device's bytes

Per batch of ``batch`` blocks of ``block_size`` tokens (a swap or a prefetch moves blocks in such batches,
``workbench.tiers.transfer``):

- bytes: a block in a tier format is every layer's K and V as ``workbench.tiers.formats`` stores it (codes, then
  scales and zero points, a row rounded up to 16 bytes); in the device's format, the cache's block stride (rounded
  up to 128 bytes). Both come from the shape alone (``workbench.quant.blocks``), no cache needed;
- the copy: one transfer of the batch's bytes, on a measured curve (:class:`~workbench.tiers.link.LinkModel`: a
  smaller transfer gets less of the link, so int4's ~3.4x fewer bytes move less than 3.4x faster in small batches)
  or at a flat bandwidth;
- the transcode (a format other than the device's): one pass on the device that reads the device's bytes and
  writes the format's (down) or the reverse (up), at :class:`Transcode` ``fraction`` of the device's copy bandwidth
  (bytes read + written per second, as ``bench`` measures it), and never under its ``floor_s`` (the host's issue of
  its launches: a small batch's transcode takes that, not its bytes' time). Until a ``bench tiers`` run of section
  ``formats`` is committed the fraction is an assumption (``source="assumed"``, no floor); :func:`measured_transcodes`
  reads one;
- pipelined over batches on two streams (batch i+1's transcode beside batch i's copy), a batch takes
  ``max(copy, transcode)`` in the steady state (the pipeline's fill, one transcode, is not counted), and the share
  of the transcode hidden behind the copy is ``min(transcode, copy) / transcode``;
- the break-even: on a flat link of B bytes/s the format beats the device's bytes while ``transcode < device bytes
  / B``, i.e. below ``B* = device bytes of the batch / transcode``; its transcode is wholly hidden below ``format
  bytes of the batch / transcode``.

The measured ``dma`` curves time a gather into the staging buffer and the copy (``bench tiers``); a format's rows
count its transcode in place of that gather on top of the same curve, a small overcount of the format's time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from workbench import quant
from workbench.core.kv_spec import ModelSpec
from workbench.quant import blocks as qblocks
from workbench.quant.names import TIER_FORMATS
from workbench.tiers.formats import ROW_ALIGN, TierFormat, check_storable
from workbench.tiers.link import LinkModel

DEVICE_ALIGN = 128  # bytes: a device block's stride (workbench.cache.storage)
#: Device-to-device copy bandwidth of the H200, GB/s (bytes read + written), measured by the bench harness in
#: data/results/quant-decode-h200-20261205T021116.json (copy_gbps 4273.8; every H200 run 4248-4275).
H200_COPY_GBPS = 4274.0
ASSUMED_FRACTION = 0.5  # of the copy bandwidth the transcode kernels reach: assumed (issue 34's target is >= 0.8)
# TIER_FORMATS (workbench.quant.names): the formats shown, benchmarked and quality-tested; any cast or token / groups
# scheme is a format a tier may take (static scales need a calibration a tier does not have)
TIERS = {"host": ("dma", "d2h", "h2d"), "disk": ("disk", "write", "read")}  # tier -> (link path, down, up)


@dataclass(frozen=True)
class Transcode:
    """The transcode kernels' throughput: ``fraction`` of the device's copy bandwidth ``copy_gbps`` (bytes read +
    written per second), and ``floor_s``, the least a batch's transcode takes whatever its size (the host's issue of
    its launches and their checks, as the mover makes them; measured: ~0.5-0.8 ms on the H100's host, 2026-12-05,
    where a small batch's kernels take microseconds); ``source`` says where they come from (``"assumed"``: no floor,
    until a run measures them)."""

    fraction: float = ASSUMED_FRACTION
    copy_gbps: float = H200_COPY_GBPS
    source: str = "assumed"
    floor_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fraction", "copy_gbps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        v = self.floor_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
            raise ValueError(f"floor_s must be a finite number >= 0 (seconds), got {v!r}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"source must be a non-empty string, got {self.source!r}")

    def seconds(self, read_bytes: int, written_bytes: int) -> float:
        """One pass that reads ``read_bytes`` and writes ``written_bytes`` on the device, ``floor_s`` at least."""
        return max(self.floor_s, (read_bytes + written_bytes) / (self.fraction * self.copy_gbps * 1e9))


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return v


def _check_shape(shape) -> ModelSpec:
    if not isinstance(shape, ModelSpec):
        raise ValueError(f"shape must be a workbench.core.kv_spec.ModelSpec (kv_spec.model(name)), got "
                         f"{type(shape).__name__}")
    return shape


def device_scheme(device) -> quant.Scheme:
    """The scheme the device's blocks are stored in (a name of ``workbench.quant.SCHEMES`` or a Scheme)."""
    try:
        return quant.get(device).without_residual()
    except (ValueError, TypeError) as e:
        raise ValueError(f"device: {e}") from None


def tier_format(fmt, shape: ModelSpec, block_size: int, device="fp16") -> TierFormat:
    """The :class:`~workbench.tiers.formats.TierFormat` format name ``fmt`` gives blocks of ``block_size`` tokens
    of ``shape`` under a ``device`` cache, as ``workbench.tiers.formats.tier_format`` decides it for a live cache:
    the device's own scheme keeps its bytes; static-scale schemes and shapes the scheme cannot store are refused
    (``ValueError`` naming ``format``)."""
    shape, block_size = _check_shape(shape), _positive_int("block_size", block_size)
    dev = device_scheme(device)
    if not isinstance(fmt, (str, quant.Scheme)):
        raise ValueError(f"format must be a scheme name of workbench.quant.SCHEMES, got {type(fmt).__name__}")
    try:
        scheme = quant.get(fmt).without_residual()
    except ValueError as e:
        raise ValueError(f"format: {e}") from None
    if scheme == dev:  # before the static check: a static device's own scheme is its bytes, no scales to find
        return TierFormat()
    if scheme.needs_static_scales:
        raise ValueError(f"format must be a cast or a scheme whose scales are computed on write "
                         f"({', '.join(TIER_FORMATS)}); {scheme.name} needs static scales calibrated ahead, which a "
                         f"tier does not have")
    check_storable(scheme, block_size, shape.num_kv_heads, shape.head_dim)
    return TierFormat(scheme)


def block_bytes(shape: ModelSpec, block_size: int, fmt: TierFormat, device="fp16") -> int:
    """Bytes of one block of ``block_size`` tokens (every layer's K and V) in ``fmt``: what
    ``workbench.tiers.formats.block_bytes`` gives for a cache of this shape, without one."""
    shape, block_size = _check_shape(shape), _positive_int("block_size", block_size)
    if not isinstance(fmt, TierFormat):
        raise ValueError(f"fmt must be a TierFormat (tier_format(...)), got {type(fmt).__name__}")
    H, D = shape.num_kv_heads, shape.head_dim
    if fmt.scheme is None:
        row = qblocks.block_stride_bytes(device_scheme(device), block_size, H, D, DEVICE_ALIGN)
    else:
        row = qblocks.block_stride_bytes(fmt.scheme, block_size, H, D, ROW_ALIGN)
    return shape.num_layers * 2 * row


def _copy_seconds(link: LinkModel | float, nbytes: int, path: str, direction: str) -> float:
    if isinstance(link, LinkModel):
        return link.seconds(nbytes, path, direction)
    return nbytes / (link * 1e9)


def _check_link(link) -> None:
    if isinstance(link, LinkModel):
        return
    if isinstance(link, bool) or not isinstance(link, (int, float)) or not (math.isfinite(link) and link > 0):
        raise ValueError(f"link must be a LinkModel or a bandwidth in GB/s (a finite number > 0), got {link!r}")


def format_cost(shape: ModelSpec, block_size: int, fmt, *, batch: int, link: LinkModel | float,
                transcode: Transcode | tuple[Transcode, Transcode] = Transcode(), device="fp16",
                tier: str = "host") -> dict:
    """One format's row: what a batch of ``batch`` blocks of ``block_size`` tokens costs in it on ``link``.

    Args:
        shape: the model's KV shape (``workbench.core.kv_spec.model(name)``: layers, kv heads, head dim).
        block_size: tokens a block.
        fmt: a format name (:data:`TIER_FORMATS`, or any cast / token / groups scheme of ``workbench.quant``).
        batch: blocks per transfer.
        link: a :class:`LinkModel` (its ``tier`` curves: ``dma`` d2h / h2d for the host, ``disk`` write / read) or a
            flat bandwidth in GB/s.
        transcode: the transcode kernels' throughput, or a pair ``(down, up)`` (encode, decode).
        device: the device's scheme (the reference the speed-ups are over).
        tier: ``"host"`` or ``"disk"`` (which curves of a LinkModel; a flat link ignores it).

    Returns:
        ``format``, ``transcodes``, ``lossy``, ``block_bytes``, ``bytes_per_token``, ``ratio`` (device bytes /
        format bytes), ``batch_bytes``, and per direction ``d`` in ``down`` / ``up``: ``d_transcode_s`` and
        ``d_copy_s`` (a batch), ``d_s`` (a batch, pipelined), ``d_tokens_per_s``, ``d_speedup`` (over the device's
        bytes), ``d_hidden`` (share of the transcode hidden behind the copy; 1 without one), ``d_link_gbps`` (what
        the copy reached), ``d_pays_below_gbps`` (0 when nothing is gained: the device's bytes, or a format no
        smaller) and ``d_hidden_below_gbps`` (0 without a transcode).
    """
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {sorted(TIERS)}, got {tier!r}")
    batch = _positive_int("batch", batch)
    _check_link(link)
    pair = transcode if isinstance(transcode, tuple) else (transcode, transcode)
    if len(pair) != 2 or not all(isinstance(t, Transcode) for t in pair):
        raise ValueError(f"transcode must be a Transcode or a (down, up) pair of them, got {transcode!r}")
    tf = tier_format(fmt, shape, block_size, device)
    dev_scheme = device_scheme(device)
    dev_bytes = block_bytes(shape, block_size, TierFormat(), device) * batch
    fmt_block = block_bytes(shape, block_size, tf, device)
    fmt_bytes = fmt_block * batch
    tokens = batch * block_size
    path, down, up = TIERS[tier]
    row = {"format": tf.scheme.name if tf.transcodes else dev_scheme.name, "transcodes": tf.transcodes,
           "lossy": tf.lossy(dev_scheme), "block_bytes": fmt_block, "bytes_per_token": fmt_block / block_size,
           "ratio": dev_bytes / fmt_bytes, "batch_bytes": fmt_bytes}
    pays = tf.transcodes and fmt_bytes < dev_bytes
    for name, direction, t in (("down", down, pair[0]), ("up", up, pair[1])):
        code = t.seconds(dev_bytes, fmt_bytes) if tf.transcodes else 0.0  # read one side, write the other
        copy = _copy_seconds(link, fmt_bytes, path, direction)
        ref = _copy_seconds(link, dev_bytes, path, direction)
        step = max(copy, code)
        row.update({f"{name}_transcode_s": code, f"{name}_copy_s": copy, f"{name}_s": step,
                    f"{name}_tokens_per_s": tokens / step, f"{name}_speedup": ref / step,
                    f"{name}_hidden": min(code, copy) / code if code else 1.0,
                    f"{name}_link_gbps": fmt_bytes / copy / 1e9,
                    f"{name}_pays_below_gbps": dev_bytes / code / 1e9 if pays else 0.0,
                    f"{name}_hidden_below_gbps": fmt_bytes / code / 1e9 if tf.transcodes else 0.0})
    return row


@dataclass(frozen=True)
class FormatTable:
    """:func:`format_table`'s answer: ``rows`` (:func:`format_cost`, in the order asked) and ``skipped`` (format ->
    why it cannot store this shape and block size)."""

    rows: list[dict]
    skipped: dict[str, str]

    def row(self, fmt: str) -> dict | None:
        return next((r for r in self.rows if r["format"] == fmt), None)


def format_table(shape: ModelSpec, block_size: int, formats: Sequence[str] = TIER_FORMATS,
                 measured: Mapping[str, tuple[Transcode, Transcode]] | None = None, **kw) -> FormatTable:
    """:func:`format_cost` of every format of ``formats`` that can store blocks of ``block_size`` tokens of
    ``shape`` (the others in ``skipped``, with the reason); ``kw``: :func:`format_cost`'s keyword arguments, with
    ``measured[format]`` (:func:`measured_transcodes`) in place of ``transcode`` for the formats it holds."""
    if isinstance(formats, str) or not isinstance(formats, Sequence) or not formats:
        raise ValueError(f"formats must be a non-empty sequence of format names, got {formats!r}")
    if measured is not None and not isinstance(measured, Mapping):
        raise ValueError(f"measured must be None or a mapping format -> (down, up) Transcode, got {measured!r}")
    _check_shape(shape)
    _positive_int("block_size", block_size)
    rows, skipped = [], {}
    for fmt in formats:
        try:
            tier_format(fmt, shape, block_size, kw.get("device", "fp16"))
        except ValueError as e:
            if "cannot store" not in str(e):
                raise
            skipped[str(fmt)] = str(e).split(": ", 1)[1]
            continue
        mine = {**kw, "transcode": measured[fmt]} if measured and fmt in measured else kw
        rows.append(format_cost(shape, block_size, fmt, **mine))
    return FormatTable(rows, skipped)


def measured_transcodes(rows: Sequence[Mapping], source: str) -> dict[str, tuple[Transcode, Transcode]]:
    """Per format, ``(down, up)`` :class:`Transcode` from a ``bench tiers`` run's ``formats`` section, its
    ``transcode`` rows (``op`` ``encode`` / ``decode``, ``bytes``, ``time_us``, ``frac_copy`` of the copy bandwidth
    measured in the same run, ``gbps``): the fraction of the row that moved the most bytes (the kernels' bandwidth;
    a small batch's time is its launches'), the floor the least time of any row (``floor_s``; 0 for rows without a
    time). ``source`` names the run. Formats with either op unmeasured (a ``--smoke`` run's None) are left out: an
    empty dict means nothing was measured."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"source must be a non-empty string (the run's file name), got {source!r}")
    seen: dict[tuple[str, str], list[Mapping]] = {}
    for r in rows:
        if r.get("section") != "formats" or r.get("kind") != "transcode" or not r.get("frac_copy"):
            continue
        if r.get("op") not in ("encode", "decode") or not r.get("gbps"):
            continue
        seen.setdefault((str(r["format"]), r["op"]), []).append(r)
    out = {}
    for fmt in dict.fromkeys(f for f, _ in seen):
        if (fmt, "encode") in seen and (fmt, "decode") in seen:
            pair = []
            for op in ("encode", "decode"):
                got = seen[(fmt, op)]
                big = max(got, key=lambda r: r.get("bytes") or 0)
                times = [float(r["time_us"]) for r in got if r.get("time_us")]
                pair.append(Transcode(float(big["frac_copy"]), float(big["gbps"]) / float(big["frac_copy"]), source,
                                      floor_s=min(times) * 1e-6 if times else 0.0))
            out[fmt] = tuple(pair)
    return out
