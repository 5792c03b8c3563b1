"""What a tier below the device stores a block as: the device's own bytes, or another K/V scheme of the registry
(``workbench.quant``), transcoded on the cache's device as blocks go down and come back.

    fmt = tier_format(cache, "int4/token")       # TieredCache(..., host_format="int4/token")
    packed = encode(cache, fmt, 16, staged)      # [n, device block bytes] -> [n, format block bytes]
    staged = decode(cache, fmt, 16, packed)      # and back: device codes of fmt's roundtrip of the values

Why: the host link is the bottleneck of swaps and prefetch (~54 GB/s pinned on the H200, and only for large
batches: docs/tiers.md) while the device reads its own memory ~80x faster, so a block that crosses the link in
int4/token instead of fp16 moves ~3.2x more tokens per second (its scales and zero points included) for the price
of two passes over device memory. Lossless coding of real fp16 K/V gains only ~1.17x (docs/compression.md), and a
CPU codec sees the bytes only after they crossed the link, so the lever is fewer bytes per token before the copy:
a lossy format, chosen per tier.

A block in a tier format is ``[layers, 2 (K, V), row]``: each layer's K (then V) of the block as a block of the
format's scheme would hold it in the NHD layout, codes then scales and zero points (``workbench.quant.blocks``),
the row rounded up to 16 bytes. Transcoding treats the ``n * layers`` rows of a batch as one set of blocks, so
each direction is one dequantization and one quantize-on-write for the whole batch (per layer only where the
device's static scales differ by layer), through the cache's own ops backend: the write kernel
(``workbench.kernels.write_kv``) or its PyTorch reference, whichever the cache writes with. A demoted block holds
the format's codes of the device block's values, code for code what the format's write would store; a promoted
block holds the device scheme's codes of those codes' values (the format's roundtrip, then the device's). Where the
device stores values as they are (a cast) and writes with the kernels, a direction has no read half: a demotion's
write kernels read the staged device blocks where they lie (:func:`encodes_in_place`), a promotion's read kernel
writes the device blocks (:func:`decodes_in_place`).

Formats a tier may take: a cast (fp16, bf16, fp32) or a scheme whose scales are computed on write (``token``
and ``groups`` families: fp8 / int8 / int8_asym per token, int4 / int2 per token or KIVI). Static-scale schemes
(fp8 / int8 per tensor or head) are refused: their scales come from a calibration the tier does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench import quant
from workbench.core.layout import Layout, block_view, to_nhd
from workbench.kernels.common import check_kernel_shape
from workbench.kernels.write import write_kv_blocks
from workbench.kernels.write.dequantize import dequantize_blocks
from workbench.kernels.write.reference import dequantize_cache_ref
from workbench.quant import blocks as qblocks

ROW_ALIGN = 16  # bytes: a format row starts where its scales' alignment (SCALE_ALIGN) holds


@dataclass(frozen=True)
class TierFormat:
    """How a tier stores a block: ``scheme`` None keeps the device's bytes (no transcoding)."""

    scheme: quant.Scheme | None = None

    @property
    def name(self) -> str:
        return "device" if self.scheme is None else self.scheme.name

    @property
    def transcodes(self) -> bool:
        return self.scheme is not None

    def lossy(self, device_scheme: quant.Scheme) -> bool:
        """Whether a block that went down and came back may differ from the device's (an fp32 tier under an fp16
        or bf16 cache holds every value exactly; any other scheme may round)."""
        if self.scheme is None:
            return False
        exact = (self.scheme.family == "cast" and device_scheme.family == "cast"
                 and self.scheme.format.storage.itemsize >= 4)
        return not exact


DEVICE = TierFormat()


def tier_format(cache, value, name: str = "host_format") -> TierFormat:
    """The :class:`TierFormat` a ``host_format`` / ``disk_format`` argument names: None (the device's bytes), a
    scheme name or alias of ``workbench.quant`` or a :class:`~workbench.quant.Scheme`. The cache's own scheme is
    its bytes. Raises ValueError naming ``name`` for static-scale schemes and for shapes the scheme cannot store."""
    if value is None or isinstance(value, TierFormat):
        return value or DEVICE
    if not isinstance(value, (str, quant.Scheme)):
        raise ValueError(f"{name} must be None, a scheme name of workbench.quant.SCHEMES or a Scheme, "
                         f"got {type(value).__name__}")
    try:
        scheme = quant.get(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    scheme = scheme.without_residual()  # a tier holds whole blocks: no fp16 window of newest tokens
    if scheme == cache.scheme.without_residual():
        return DEVICE  # before the static check: a static cache's own scheme is its bytes, no scales to find
    if scheme.needs_static_scales:
        raise ValueError(f"{name} must be a cast or a scheme whose scales are computed on write (token or groups "
                         f"family: fp8_e4m3/token, int8/token, int4/token, int4/kivi, ...); {scheme.name} needs "
                         f"static scales calibrated ahead, which a tier does not have")
    H, D = cache.num_kv_heads, cache.head_dim
    for bs in cache.pool_sizes:
        check_storable(scheme, bs, H, D, name, kernels=cache.ops == "kernels")
    return TierFormat(scheme)


def check_storable(scheme: quant.Scheme, block_size: int, H: int, D: int, name: str = "format",
                   kernels: bool = False) -> None:
    """ValueError naming ``name`` unless ``scheme`` can store a block of ``block_size`` tokens x ``H`` heads x ``D``
    dims in a tier (``kernels``: written by the write kernel, which must tile the rows)."""
    try:
        scheme.check_shape(H, D)
        if kernels:
            check_kernel_shape(scheme, D)
        if block_size % scheme.write_group:
            raise ValueError(f"its groups of {scheme.write_group} tokens do not tile a block of {block_size}")
        qblocks.block_bytes(scheme, block_size, H, D)
    except ValueError as e:
        raise ValueError(f"{name} {scheme.name} cannot store blocks of {block_size} tokens x {H} heads x {D} dims: "
                         f"{e}") from None


# ---- geometry --------------------------------------------------------------------------------
def row_bytes(cache, fmt: TierFormat, block_size: int) -> int:
    """Bytes of one layer's K (or V) of one block in ``fmt``: the device's block stride, or the format's codes and
    scales rounded up to :data:`ROW_ALIGN`."""
    if fmt.scheme is None:
        return cache.block_stride(block_size) * cache.dtype.itemsize
    return qblocks.block_stride_bytes(fmt.scheme, block_size, cache.num_kv_heads, cache.head_dim, ROW_ALIGN)


def block_bytes(cache, fmt: TierFormat, block_size: int) -> int:
    """Bytes of one block of ``block_size`` tokens in ``fmt``: every layer's K and V."""
    return cache.num_layers * 2 * row_bytes(cache, fmt, block_size)


# ---- transcoding -----------------------------------------------------------------------------
class _Staged:
    """``n`` blocks laid out ``[n, layers, 2, row]`` in one buffer, as the cache's ops backend writes them: a
    ``Storage`` look-alike whose layer ``None`` is every layer at once (``n * layers`` blocks)."""

    def __init__(self, buf: torch.Tensor, n: int, num_layers: int, row: int, scheme, layout: Layout, H: int, D: int):
        self.buf, self.n, self.num_layers, self.row = buf, n, num_layers, row
        self.scheme, self.layout, self.num_kv_heads, self.head_dim = scheme, layout, H, D
        self.code_dim = qblocks.code_dim(scheme, D)

    def plane_view(self, layer: int | None, kind: int, block_size: int) -> torch.Tensor:
        L, row = self.num_layers, self.row
        if layer is None:  # blocks (i, l) -> i * L + l, one stride of 2 rows
            plane = self.buf.as_strided((self.n * L, row), (2 * row, 1), self.buf.storage_offset() + kind * row)
        else:
            plane = self.buf.as_strided((self.n, row), (L * 2 * row, 1),
                                        self.buf.storage_offset() + (layer * 2 + kind) * row)
        return block_view(plane, self.layout, "kv"[kind], block_size, self.num_kv_heads, self.code_dim)


def _staged(cache, scheme, layout, buf_bytes: torch.Tensor, n: int, row_bytes_: int) -> _Staged:
    dtype = scheme.format.storage
    typed = buf_bytes.view(torch.uint8).reshape(-1).view(dtype)
    return _Staged(typed, n, cache.num_layers, row_bytes_ // dtype.itemsize, scheme, layout, cache.num_kv_heads,
                   cache.head_dim)


def _static_scales(cache, kind: str) -> torch.Tensor | None:
    """The device's static scales of ``kind`` as ``[1, L or 1, 1, H or 1, 1]`` (None without)."""
    s = cache.k_scale if kind == "k" else cache.v_scale
    if s is None:
        return None
    s = s.float().reshape(-1 if s.dim() == 2 else 1, s.shape[-1])  # [L or 1, S]
    return s[None, :, None, :, None]


def _values(cache, st: _Staged, kind: int, static: torch.Tensor | None, block_size: int,
            nonfinite: torch.Tensor | None = None) -> torch.Tensor:
    """Values ``[n, L, bs, H, D]`` of every block of ``st``: fp32 (static scales applied), or a cast's own dtype;
    with ``nonfinite`` (int32 ``[1]``), NaN/Inf ones as 0, counted into it. A cache that writes with the kernels
    reads with one too (``dequantize_blocks``: one launch, one pass); else the PyTorch reference."""
    planes = st.plane_view(None, kind, block_size)
    cast = st.scheme.family == "cast"  # the values themselves: no fp32 copy (the write upcasts in registers)
    if cache.ops == "kernels":
        x = dequantize_blocks(st.scheme, planes, st.layout, "kv"[kind], st.head_dim,
                              static_scale=static.reshape(static.shape[1], static.shape[3]) if static is not None
                              else None, out_dtype=st.scheme.format.storage if cast else torch.float32,
                              nonfinite=nonfinite)
        return x.view(st.n, st.num_layers, *x.shape[1:])
    if cast:
        x = to_nhd(planes, st.layout, "kv"[kind])
        x = x.reshape(st.n, st.num_layers, *x.shape[1:])
    else:
        x = dequantize_cache_ref(st.scheme, planes, st.layout, "kv"[kind], st.head_dim)  # [n*L, bs, H, D]
        x = x.view(st.n, st.num_layers, *x.shape[1:])
        x = x * static if static is not None else x
    if nonfinite is not None:
        nonfinite += (~torch.isfinite(x)).sum()
        x = torch.nan_to_num(x, 0.0, 0.0, 0.0)
    return x


def _write(cache, st: _Staged, block_size: int, k: torch.Tensor, v: torch.Tensor, per_layer: bool) -> None:
    """Values ``[n, L, bs, H, D]`` into every block of ``st`` through the cache's ops backend (its write kernel
    or its reference): one write for the batch, or one per layer where the device's static scales differ."""
    n, L, bs, H, D = k.shape
    nonfinite = torch.zeros(1, dtype=torch.int32, device=k.device)
    if not per_layer:
        slots = torch.arange(n * L * bs, dtype=torch.int64, device=k.device)
        scale_k, scale_v = cache.layer_scales(0) if st.scheme.needs_static_scales else (None, None)
        cache.write_staged(_AllLayers(st), 0, block_size, slots, k.reshape(-1, H, D), v.reshape(-1, H, D),
                           scale_k, scale_v, nonfinite)
        return
    slots = torch.arange(n * bs, dtype=torch.int64, device=k.device)
    for layer in range(L):
        scale_k, scale_v = cache.layer_scales(layer)
        cache.write_staged(st, layer, block_size, slots, k[:, layer].reshape(-1, H, D),
                           v[:, layer].reshape(-1, H, D), scale_k, scale_v, nonfinite)


class _AllLayers:
    """``st`` with layer 0 standing for all layers (what ``ops.write`` asks for by index)."""

    def __init__(self, st: _Staged):
        self.st = st
        self.scheme, self.layout = st.scheme, st.layout
        self.num_kv_heads, self.head_dim = st.num_kv_heads, st.head_dim

    def plane_view(self, layer: int, kind: int, block_size: int) -> torch.Tensor:
        return self.st.plane_view(None, kind, block_size)


def _check_batch(cache, name: str, buf: torch.Tensor, want_row: int) -> int:
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 2 or not buf.is_contiguous():
        raise ValueError(f"{name} must be a contiguous uint8 tensor [n blocks, block bytes], got "
                         f"{getattr(buf, 'dtype', type(buf).__name__)} {tuple(getattr(buf, 'shape', ()))}")
    if buf.shape[1] != cache.num_layers * 2 * want_row:
        raise ValueError(f"{name} rows must be {cache.num_layers * 2 * want_row} bytes (a block of every layer's "
                         f"K and V), got {buf.shape[1]}")
    if buf.device != cache.device:
        raise ValueError(f"{name} must be on the cache's device {cache.device}, got {buf.device}")
    return buf.shape[0]


def read_values(cache, fmt: TierFormat, block_size: int, buf: torch.Tensor,
                nonfinite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The read half of a transcode: K and V ``[n, L, bs, H, D]`` of a batch ``buf`` of blocks in ``fmt`` (``DEVICE``:
    the device's staged blocks, static scales applied) as the write half takes them (``encode`` and ``decode`` are
    this, then the other side's write); with ``nonfinite``, NaN/Inf as 0 and counted (what ``encode`` does)."""
    row = row_bytes(cache, fmt, block_size)
    n = _check_batch(cache, "buf", buf, row)
    if fmt.scheme is None:
        src, static = _staged(cache, cache.scheme, cache.layout, buf, n, row), _static_scales
        return tuple(_values(cache, src, kind, static(cache, "kv"[kind]), block_size, nonfinite) for kind in (0, 1))
    src = _staged(cache, fmt.scheme, Layout.NHD, buf, n, row)
    return tuple(_values(cache, src, kind, None, block_size, nonfinite) for kind in (0, 1))


def encode(cache, fmt: TierFormat, block_size: int, staged: torch.Tensor,
           nonfinite: torch.Tensor | None = None) -> torch.Tensor:
    """Device blocks ``staged`` ``[n, block bytes]`` (as gathered: every layer's K and V rows in the cache's
    layout) -> the same blocks in ``fmt`` ``[n, block_bytes(fmt)]``: dequantized to fp32, quantized by
    ``fmt.scheme`` on write (a cast device's values read in place: :func:`encodes_in_place`). NaN and Inf are
    stored as 0 and counted into ``nonfinite`` (an int32 one-element tensor on the device, no sync): a swapped
    block's unwritten slots hold whatever the pool held, and a scale must not be spread by them (its written
    tokens are still coded as they are)."""
    if fmt.scheme is None:
        return staged
    dev_row, row = row_bytes(cache, DEVICE, block_size), row_bytes(cache, fmt, block_size)
    n = _check_batch(cache, "staged", staged, dev_row)
    if nonfinite is None:
        nonfinite = torch.zeros(1, dtype=torch.int32, device=staged.device)
    elif not (isinstance(nonfinite, torch.Tensor) and nonfinite.dtype == torch.int32 and nonfinite.numel() == 1
              and nonfinite.device == cache.device):
        raise ValueError(f"nonfinite must be an int32 tensor of one element on the cache's device {cache.device}, "
                         f"got {getattr(nonfinite, 'dtype', type(nonfinite).__name__)} "
                         f"{tuple(getattr(nonfinite, 'shape', ()))}")
    if encodes_in_place(cache, fmt):
        return _encode_in_place(cache, fmt, block_size, staged, n, row, dev_row, nonfinite)
    out = torch.zeros((n, cache.num_layers * 2 * row), dtype=torch.uint8, device=staged.device)
    dst = _staged(cache, fmt.scheme, Layout.NHD, out, n, row)
    k, v = read_values(cache, DEVICE, block_size, staged, nonfinite)
    _write(cache, dst, block_size, k, v, per_layer=False)
    return out


def encodes_in_place(cache, fmt: TierFormat) -> bool:
    """Whether :func:`encode` is one write a batch, with no read half: the device stores values as they are (a
    cast), it writes with the kernels, and ``fmt``'s scales are computed on write (the write kernels then read the
    staged device blocks where they lie, ``write_kv_blocks``). A cast format keeps the general path: it moves as
    many bytes as the device's or more, and the plain write kernels count no NaN/Inf."""
    return (cache.ops == "kernels" and cache.scheme.family == "cast" and fmt.scheme is not None
            and fmt.scheme.scales_on_write)


def _encode_in_place(cache, fmt: TierFormat, block_size: int, staged: torch.Tensor, n: int, row: int, dev_row: int,
                     nonfinite: torch.Tensor) -> torch.Tensor:
    """:func:`encode` for a cast device (:func:`encodes_in_place`): the format's write kernels read the device
    blocks in ``staged`` where they lie, NaN/Inf zeroed and counted as they are loaded, where the general path copies
    the values out (``read_values``) and writes from the copy. The same values, so the same bytes, with the device
    bytes read once; the output is written once too (not zero-filled first: only its padding is zeroed)."""
    out = torch.empty((n, cache.num_layers * 2 * row), dtype=torch.uint8, device=staged.device)
    rows = out.view(n * cache.num_layers, 2, row)
    for kind, lo, hi in _unwritten(cache, fmt, block_size):  # zeros there, as the general path's buffer holds
        rows[:, kind, lo:hi].zero_()
    src = _staged(cache, cache.scheme, cache.layout, staged, n, dev_row)
    dst = _staged(cache, fmt.scheme, Layout.NHD, out, n, row)
    write_kv_blocks(src.plane_view(None, 0, block_size), src.plane_view(None, 1, block_size), cache.layout,
                    dst.plane_view(None, 0, block_size), dst.plane_view(None, 1, block_size), Layout.NHD,
                    quant=fmt.scheme, nonfinite=nonfinite)
    return out


def _unwritten(cache, fmt: TierFormat, block_size: int) -> list[tuple[int, int, int]]:
    """``(kind, start, end)``: the byte ranges of a format row of each kind that no write covers, the padding before
    its scales (to ``SCALE_ALIGN``) and after them (to :data:`ROW_ALIGN`, or to the other kind's larger scales).
    Most shapes have none."""
    s, H, D = fmt.scheme, cache.num_kv_heads, cache.head_dim
    codes, row = qblocks.code_bytes(s, block_size, H, D), row_bytes(cache, fmt, block_size)
    gaps = []
    for kind in (0, 1):
        sc = qblocks.block_scales(s, "kv"[kind], block_size, H, D)
        spans = ((codes, row),) if sc is None else ((codes, sc.offset), (sc.end, row))
        gaps += [(kind, lo, hi) for lo, hi in spans if hi > lo]
    return gaps


def decode(cache, fmt: TierFormat, block_size: int, packed: torch.Tensor) -> torch.Tensor:
    """Blocks in ``fmt`` ``[n, block_bytes(fmt)]`` -> device blocks ``[n, device block bytes]`` in the cache's
    scheme and layout (its static scales, per layer if it has them), ready to scatter into the pool."""
    if fmt.scheme is None:
        return packed
    dev_row, row = row_bytes(cache, DEVICE, block_size), row_bytes(cache, fmt, block_size)
    n = _check_batch(cache, "packed", packed, row)
    if decodes_in_place(cache, block_size):
        return _decode_in_place(cache, fmt, block_size, packed, n, row, dev_row)
    out = torch.zeros((n, cache.num_layers * 2 * dev_row), dtype=torch.uint8, device=packed.device)
    dst = _staged(cache, cache.scheme, cache.layout, out, n, dev_row)
    k, v = read_values(cache, fmt, block_size, packed)
    _write(cache, dst, block_size, k, v, per_layer=cache.scheme.needs_static_scales and cache.per_layer_scales)
    return out


def decodes_in_place(cache, block_size: int) -> bool:
    """Whether :func:`decode` is one launch a kind, with no read half of its own: the device stores values as they
    are (fp16 or fp32: bf16's rounding is the write kernel's own under the interpreter) with a channel's tokens and
    heads on two strides (NHD, HND), its rows hold nothing else, and it writes with the kernels."""
    dev_row = row_bytes(cache, DEVICE, block_size)
    return (cache.ops == "kernels" and cache.scheme.family == "cast" and cache.layout in (Layout.NHD, Layout.HND)
            and cache.scheme.format.storage in (torch.float16, torch.float32)
            and dev_row == block_size * cache.num_kv_heads * cache.head_dim * cache.scheme.format.storage.itemsize)


def _decode_in_place(cache, fmt: TierFormat, block_size: int, packed: torch.Tensor, n: int, row: int,
                     dev_row: int) -> torch.Tensor:
    """:func:`decode` for a cast device (:func:`decodes_in_place`): the format's codes dequantized straight into the
    device blocks' values, cast once, where the general path writes fp32 values out and casts them in a second
    kernel (the same rounding, so the same bytes; a fifth of the bytes moved)."""
    out = torch.empty((n, cache.num_layers * 2 * dev_row), dtype=torch.uint8, device=packed.device)
    src = _staged(cache, fmt.scheme, Layout.NHD, packed, n, row)
    dst = _staged(cache, cache.scheme, cache.layout, out, n, dev_row)
    for kind in (0, 1):
        planes = dst.plane_view(None, kind, block_size)  # [n * L, bs, H, D] (NHD) or [n * L, H, bs, D] (HND)
        view = planes if cache.layout is Layout.NHD else planes.transpose(1, 2)
        dequantize_blocks(fmt.scheme, src.plane_view(None, kind, block_size), Layout.NHD, "kv"[kind],
                          cache.head_dim, out_dtype=view.dtype, out=view)
    return out


def roundtrip_values(cache, fmt: TierFormat, block_size: int, staged: torch.Tensor) -> torch.Tensor:
    """What a block's values become below and back (fp32 ``[n, L, 2, bs, H, D]``): the reference the tests and
    the quality study compare with (``fmt``'s reference quantize of the device values, then the device's)."""
    back = decode(cache, fmt, block_size, encode(cache, fmt, block_size, staged))
    n, dev_row = back.shape[0], row_bytes(cache, DEVICE, block_size)
    st = _staged(cache, cache.scheme, cache.layout, back, n, dev_row)
    return torch.stack([_values(cache, st, kind, _static_scales(cache, "kv"[kind]), block_size).float()
                        for kind in (0, 1)], dim=2)
