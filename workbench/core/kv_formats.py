"""KV storage formats: the one place that says what each ``kv_dtype`` is and which kernels handle it.

A :class:`KVFormat` is data: the storage element dtype, bits per value, how values become codes
(``cast``: a plain conversion; ``fp8``: ``x / scale`` saturated at the format's max; ``int``:
``x / scale`` rounded half-to-even and clamped), the code range, which scale granularities the
write kernel and the decode kernel accept, and whether each kernel exists for it. The cache, the
kernels' wrappers, the references and the benchmarks ask this module; a new format (INT4 packing,
per-block scales) is one entry here plus the kernel code that reads it.

Scale granularities: ``tensor`` (one fp32 value), ``head`` (``[num_kv_heads]`` fp32 values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_GRANULARITIES = ("tensor", "head")  # static scales (workbench.quant adds "token" and "group")


@dataclass(frozen=True)
class KVFormat:
    """One storage format of K/V values.

    Attributes:
        name: the ``kv_dtype`` name (``"fp16"``, ``"fp8_e4m3"``, ...).
        storage: torch dtype of the cache tensor's elements.
        bits: bits per stored value (4 for int4: two codes per byte).
        codes: ``"cast"``, ``"fp8"`` or ``"int"`` (see the module docstring).
        qmin, qmax: the code range of a quantized format (0, 0 for ``cast``).
        write_scales: scale granularities ``write_kv`` accepts (empty: no scales; None: no write kernel).
        decode_scales: scale granularities ``paged_decode`` accepts (empty: no scales; None: decode cannot read it).
    """

    name: str
    storage: torch.dtype
    bits: int
    codes: str
    qmin: float = 0.0
    qmax: float = 0.0
    write_scales: tuple[str, ...] | None = ()
    decode_scales: tuple[str, ...] | None = ()

    @property
    def quantized(self) -> bool:
        """Stored as codes that need a scale to read back."""
        return self.codes != "cast"

    @property
    def bytes_per_value(self) -> float:
        return self.bits / 8

    @property
    def writable(self) -> bool:
        return self.write_scales is not None

    @property
    def decodable(self) -> bool:
        return self.decode_scales is not None

    def check_scale(self, name: str, scale: torch.Tensor | None, num_heads: int, *,
                    kernel: str = "write") -> str | None:
        """The granularity of ``scale`` for this format (None when unscaled); ValueError naming ``name`` otherwise."""
        allowed = self.write_scales if kernel == "write" else self.decode_scales
        if allowed is None:
            raise ValueError(f"kv format {self.name} has no {kernel} kernel")
        if not self.quantized:
            if scale is not None:
                raise ValueError(f"{name} is only for quantized formats; {self.name} stores values as they are")
            return None
        if scale is None:
            raise ValueError(f"{name} is required: kv format {self.name} stores scaled codes")
        n = scale.numel()
        granularity = "tensor" if n == 1 else "head" if n == num_heads else None
        if granularity is None or granularity not in allowed:
            want = " or ".join({"tensor": "1 value", "head": f"{num_heads} values (one per kv head)"}[g]
                               for g in allowed)
            raise ValueError(f"{name} for kv format {self.name} must hold {want} for the {kernel} kernel, "
                             f"got {n} values")
        return granularity


def _fp8(name: str, dtype: torch.dtype) -> KVFormat:
    qmax = float(torch.finfo(dtype).max)
    return KVFormat(name, dtype, 8, "fp8", -qmax, qmax, write_scales=SCALE_GRANULARITIES,
                    decode_scales=SCALE_GRANULARITIES)


FORMATS: dict[str, KVFormat] = {f.name: f for f in [
    KVFormat("fp32", torch.float32, 32, "cast"),
    KVFormat("fp16", torch.float16, 16, "cast"),
    KVFormat("bf16", torch.bfloat16, 16, "cast"),
    _fp8("fp8_e4m3", torch.float8_e4m3fn),
    _fp8("fp8_e5m2", torch.float8_e5m2),
    KVFormat("int8", torch.int8, 8, "int", -128.0, 127.0, write_scales=SCALE_GRANULARITIES,
             decode_scales=SCALE_GRANULARITIES),
    # asymmetric codes, their scales and zero points in the blocks (workbench.quant): no static scales
    KVFormat("uint8", torch.uint8, 8, "int", 0.0, 255.0),
    KVFormat("int4", torch.uint8, 4, "int", 0.0, 15.0),  # two codes a byte
    KVFormat("int2", torch.uint8, 2, "int", 0.0, 3.0),  # four codes a byte
]}

ALIASES = {"fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2", "float16": "fp16", "half": "fp16",
           "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}

_BY_STORAGE = {f.storage: f for f in FORMATS.values() if f.bits == 8 * f.storage.itemsize}  # int4 is not a dtype


def get(kv_dtype: str | torch.dtype | KVFormat) -> KVFormat:
    """The format of a ``kv_dtype`` name (or alias), a torch storage dtype, or a format."""
    if isinstance(kv_dtype, KVFormat):
        return kv_dtype
    if isinstance(kv_dtype, torch.dtype):
        if kv_dtype not in _BY_STORAGE:
            raise ValueError(f"kv_dtype must be one of {sorted(map(str, _BY_STORAGE))} as a torch dtype, "
                             f"got {kv_dtype}")
        return _BY_STORAGE[kv_dtype]
    name = ALIASES.get(kv_dtype, kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
    if name not in FORMATS:
        raise ValueError(f"kv_dtype must be a torch dtype or one of {sorted(FORMATS)} (or the aliases "
                         f"{sorted(ALIASES)}), got {kv_dtype!r}")
    return FORMATS[name]


def of_tensor(t: torch.Tensor) -> KVFormat:
    """The format a cache tensor's dtype stores (ValueError naming it if none)."""
    return get(t.dtype)
