"""How much KV memory a GPU leaves for the cache: a model spec, a GPU size, and what the weights take."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.core.kv_spec import model as model_spec

GIB = 2**30

# Parameter counts (billions) for the weight footprint; fp16/bf16 weights take 2 bytes each.
PARAMS_B: dict[str, float] = {"llama-7b": 6.74, "llama-13b": 13.02, "llama3-8b": 8.03, "smollm2-135m": 0.135}


@dataclass(frozen=True)
class Budget:
    """KV-cache memory in bytes and in token slots of one model.

    Attributes:
        kv_bytes: bytes given to the KV cache.
        bytes_per_token: K and V of one token across all layers.
        model: model name (``workbench.core.kv_spec.MODELS``).
        note: how the figure was obtained.
    """

    kv_bytes: int
    bytes_per_token: int
    model: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.bytes_per_token < 1:
            raise ValueError(f"bytes_per_token must be >= 1, got {self.bytes_per_token}")
        if self.kv_bytes < self.bytes_per_token:
            raise ValueError(f"kv_bytes must hold at least one token ({self.bytes_per_token} B), got {self.kv_bytes}")

    @property
    def slots(self) -> int:
        """Token slots: ``floor(kv_bytes / bytes_per_token)``."""
        return self.kv_bytes // self.bytes_per_token

    @property
    def kv_gib(self) -> float:
        return self.kv_bytes / GIB


def kv_budget(model: str = "llama-13b", gpu_gib: float = 80.0, *, kv_gib: float | None = None,
              utilization: float = 0.9, activation_gib: float = 1.0, kv_dtype: str = "fp16") -> Budget:
    """The KV budget of ``model`` on a GPU of ``gpu_gib`` GiB.

    ``kv = gpu_gib * utilization - weights - activation_gib`` (vLLM's ``gpu_memory_utilization`` is 0.9),
    weights = parameters x 2 bytes. Pass ``kv_gib`` to fix the KV memory directly (the vLLM paper's Table 1
    gives 12 GB for OPT-13B on an A100-40GB; OPT-13B has the KV shape of ``llama-13b``: 800 KiB a token).
    """
    spec = model_spec(model)
    bpt = int(spec.bytes_per_token(kv_dtype))
    if kv_gib is not None:
        if not kv_gib > 0:
            raise ValueError(f"kv_gib must be > 0, got {kv_gib}")
        return Budget(int(kv_gib * GIB), bpt, model, f"{kv_gib:g} GiB given")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if model not in PARAMS_B:
        raise ValueError(f"no parameter count for {model!r}; pass kv_gib")
    weights = PARAMS_B[model] * 1e9 * 2
    kv = gpu_gib * GIB * utilization - weights - activation_gib * GIB
    if kv < bpt:
        raise ValueError(f"gpu_gib={gpu_gib} leaves no KV memory for {model} (weights {weights / GIB:.1f} GiB)")
    note = (f"{gpu_gib:g} GiB x {utilization:g} - weights {weights / GIB:.1f} GiB - activations {activation_gib:g} GiB")
    return Budget(int(kv), bpt, model, note)


def slots_budget(slots: int, bytes_per_token: int = 1) -> Budget:
    """A budget of exactly ``slots`` token slots (for tests and toy examples)."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    return Budget(slots * bytes_per_token, bytes_per_token, "", f"{slots} slots")
