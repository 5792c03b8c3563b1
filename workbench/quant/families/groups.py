"""The groups family: KIVI (Liu et al., 2024), asymmetric ``2**bits`` levels (int4, int2) with an fp16 scale and
zero point per group, codes packed ``8 // bits`` to a byte, the newest tokens kept in fp16.

Keys per channel over groups of ``group`` tokens (``key_mode="channel"``) or per token over groups of
``value_group`` channels (``key_mode="token"``); values always per token over groups of ``value_group`` channels.
The newest ``residual`` tokens (and those of an unfinished key group) stay in fp16.

Exact arithmetic (the kernels reproduce it bit for bit; fp32, IEEE division): ``zero = clamp(min, +-65504)`` and
``scale = clamp((max - zero) / qmax, 0, 65504)`` (fp32, then rounded to fp16: saturated, never Inf; a zero fp16
scale becomes 1), ``code = round_half_even(clamp((x - zero) / scale, 0, qmax))`` with the rounded values, read
back as ``code * scale + zero``; the fp16 residual saturates at +-65504 too, and the cache quantizes K/V as that
residual holds them (fp16, saturated), whether a token waited there or not.

Packing: byte ``j`` of a token-head row (``0 <= j < D * bits / 8``) holds channel ``j + k * D * bits / 8`` in bits
``[k * bits, (k + 1) * bits)``, so each ``k`` is a contiguous slice of channels (the decode kernel unpacks a slice
with one shift and one mask).
"""

from __future__ import annotations

import torch

from .base import Scheme
from .common import F16_MAX, BlockScales, Quantized, div, round_even, scales_start, to_fp16


class GroupScheme(Scheme):
    """Packed group codes with fp16 scales and zero points in the blocks, and an fp16 residual in the cache."""

    family = "groups"
    granularities = ("group",)
    param_names = ("group", "value_group", "residual", "key_mode")
    scales_on_write = True
    keeps_residual = True
    supports_key_bounds = False  # keys packed in groups, the newest tokens outside the blocks

    @property
    def write_group(self) -> int:
        return self.group if self.key_mode == "channel" else 1

    def check(self) -> None:
        for n in ("group", "value_group"):
            v = getattr(self, n)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"{n} of {self.name} must be a power of two >= 1, got {v!r}")
        if not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"residual of {self.name} must be an int >= 0, got {self.residual!r}")
        if self.key_mode not in ("channel", "token"):
            raise ValueError(f"key_mode of {self.name} must be 'channel' or 'token', got {self.key_mode!r}")

    def check_shape(self, num_heads: int, head_dim: int) -> None:
        per = 8 // self.bits
        if head_dim % per:
            raise ValueError(f"{self.name} packs {per} channels a byte: head_dim must be a multiple of {per}, "
                             f"got {head_dim}")
        if head_dim % self.value_group:
            raise ValueError(f"value_group {self.value_group} of {self.name} must divide head_dim {head_dim}")

    def title(self) -> str:
        if self.label:
            return self.label
        keys = f"K/ch G{self.group}" if self.key_mode == "channel" else f"K/tok g{self.value_group}"
        return f"{self.format_name} {keys} V g{self.value_group} R{self.residual}"

    def scales_label(self) -> str:
        return "scales per group"

    def without_residual(self) -> Scheme:
        return self.with_params(residual=0)

    # ---- accounting and block layout -----------------------------------------------------------------------
    def bytes_per_token(self, num_heads: int, head_dim: int, context: int | None = None) -> float:
        n = num_heads * head_dim
        code = n * self.bits / 8
        params = 2 * 2  # fp16 scale and zero point
        v = code + params * n / self.value_group
        k = code + params * (n / self.group if self.key_mode == "channel" else n / self.value_group)
        if context is None or context <= 0:
            return k + v
        tq = self.quantized_tokens(context)
        return ((k + v) * tq + 2 * n * 2 * (context - tq)) / context

    def quantized_tokens(self, num_tokens: int) -> int:
        g = self.write_group
        return max(0, (num_tokens - self.residual) // g * g)

    def code_dim(self, head_dim: int) -> int:
        return head_dim * self.bits // 8

    def head_dim_of(self, code_dim: int) -> int:
        return code_dim * 8 // self.bits

    def code_values(self, stored: torch.Tensor) -> torch.Tensor:
        return unpack(stored, self.bits)

    def store_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return pack(codes, self.bits)

    def block_scales(self, kind: str, block_size: int, num_heads: int, head_dim: int) -> BlockScales:
        start = scales_start(block_size * num_heads * self.code_dim(head_dim) * self.format.storage.itemsize)
        self.check_shape(num_heads, head_dim)
        if kind == "k" and self.key_mode == "channel":
            if block_size % self.group:
                raise ValueError(f"{self.name} groups keys over {self.group} tokens: the block size must be a "
                                 f"multiple of it, got {block_size}")
            return BlockScales(start, torch.float16, self.group, 1, (block_size // self.group, num_heads, head_dim),
                               True)
        g = self.value_group
        return BlockScales(start, torch.float16, 1, g, (block_size, num_heads, head_dim // g), True)

    # ---- quantize / dequantize -----------------------------------------------------------------------------
    def _quantize(self, x: torch.Tensor, kind: str, scale: torch.Tensor | None) -> Quantized:
        xf = x.float()
        T, H, D = xf.shape
        self.check_shape(H, D)
        tq = self.quantized_tokens(T)
        body, residual = xf[:tq], to_fp16(xf[tq:])
        if kind == "k" and self.key_mode == "channel":
            g = body.reshape(tq // self.group, self.group, H, D)
            lo, hi = g.amin(dim=1), g.amax(dim=1)  # [Tq // G, H, D]
            s16, z16 = fp16_params(lo, hi, self.qmax)
            y = (g - z16.float()[:, None]) / s16.float()[:, None]
        else:
            g = body.reshape(tq, H, D // self.value_group, self.value_group)
            lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [Tq, H, D // Gv]
            s16, z16 = fp16_params(lo, hi, self.qmax)
            y = (g - z16.float()[..., None]) / s16.float()[..., None]
        codes = round_even(y.clamp(0, self.qmax)).reshape(tq, H, D)
        return Quantized(pack(codes.to(torch.uint8), self.bits), s16, z16, residual)

    def dequantize(self, qz: Quantized, kind: str = "k") -> torch.Tensor:
        codes = unpack(qz.codes, self.bits).float()  # [Tq, H, D]
        tq, H, D = codes.shape
        s, z = qz.scale.float(), qz.zero.float()
        if kind == "k" and self.key_mode == "channel":
            out = codes.reshape(tq // self.group, self.group, H, D) * s[:, None] + z[:, None]
        else:
            out = codes.reshape(tq, H, D // self.value_group, self.value_group) * s[..., None] + z[..., None]
        out = out.reshape(tq, H, D)
        return torch.cat([out, qz.residual.float()]) if qz.residual is not None else out


def fp16_params(lo: torch.Tensor, hi: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's fp16 scale and zero point, saturated (module docstring); equal to a plain fp16 rounding of
    ``((hi - lo) / qmax, lo)`` wherever that is finite."""
    z = lo.clamp(-F16_MAX, F16_MAX)
    s16 = div(hi - z, qmax).clamp(0, F16_MAX).to(torch.float16)
    s16 = torch.where(s16 > 0, s16, torch.ones_like(s16))  # a constant group (or an fp16 underflow)
    return s16, z.to(torch.float16)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` uint8 codes < ``2**bits`` -> ``[..., D * bits // 8]`` bytes (the module docstring's order)."""
    per = 8 // bits
    d = codes.shape[-1] // per
    out = torch.zeros((*codes.shape[:-1], d), dtype=torch.uint8, device=codes.device)
    for k in range(per):
        out |= codes[..., k * d:(k + 1) * d] << (k * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., Dp]`` bytes -> ``[..., Dp * 8 // bits]`` uint8 codes."""
    per = 8 // bits
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (k * bits)) & mask for k in range(per)], dim=-1)
