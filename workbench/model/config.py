"""A llama-architecture model's shape (what the KV cache and the kernels need to know of it)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a llama model (names as in Hugging Face's ``LlamaConfig``)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """fp16 K+V bytes one token occupies in every layer."""
        return 2 * 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    def with_layers(self, n: int) -> LlamaConfig:
        """The same shape with ``n`` layers (small models for tests)."""
        return replace(self, num_hidden_layers=n)


SMOLLM2_135M = LlamaConfig()  # SmolLM2-135M(-Instruct): 30 layers, d 576, 9 q / 3 kv heads of 64, RoPE base 1e5
