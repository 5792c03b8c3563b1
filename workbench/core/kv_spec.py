"""What is cached: a model's KV shape and the storage dtype, and the bytes that follow."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.core.kv_formats import FORMATS
from workbench.core.kv_formats import get as get_format

# Storage dtypes by name and their size in bytes (int4 packs two values a byte): views of workbench.core.kv_formats.
KV_DTYPES: dict[str, float] = {name: f.bytes_per_value for name, f in FORMATS.items()}
TORCH_DTYPES: dict[str, torch.dtype] = {name: f.storage for name, f in FORMATS.items()}


def dtype_size(kv_dtype: str) -> float:
    """Bytes per stored element of ``kv_dtype`` (a key of ``KV_DTYPES``)."""
    return get_format(kv_dtype).bytes_per_value


@dataclass(frozen=True)
class ModelSpec:
    """The KV-relevant shape of a decoder: layers, KV heads, head dim, query heads."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "num_q_heads"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    def bytes_per_token(self, kv_dtype: str = "fp16") -> float:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size(kv_dtype)


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("llama-7b", 32, 32, 128, 32),
        ModelSpec("llama-13b", 40, 40, 128, 40),  # 800 KB per token in fp16, as in the vLLM paper
        ModelSpec("llama3-8b", 32, 8, 128, 32),
        ModelSpec("smollm2-135m", 30, 3, 64, 9),
    ]
}


def model(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name]
