"""Model shapes for the what-if: the real SmolLM2-135M and presets of public llama-style shapes, or a user's
``config.json`` (Hugging Face names), as :class:`~workbench.model.config.LlamaConfig`.

What the time model needs of a model is its shape: the weights each decode step reads (the linear layers'
bytes), the FLOPs a prefill token costs, and the KV bytes per token (``workbench.core.kv_spec`` per scheme).
The presets are the published configs' numbers (layers, heads, kv heads, head dim, hidden, intermediate,
vocabulary); Qwen2.5's q/k/v biases and Mistral's sliding window are not modelled (a few hundred bytes a layer,
and a window the what-if does not use).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from workbench.model.config import SMOLLM2_135M, LlamaConfig

PRESETS: dict[str, LlamaConfig] = {
    "smollm2-135m": SMOLLM2_135M,
    # the vLLM paper's OPT-13B has this KV shape (40 layers x 40 heads x 128: 800 KiB a token in fp16)
    "llama-13b": LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                             num_attention_heads=40, num_key_value_heads=40, rope_theta=10000.0,
                             tie_word_embeddings=False),
    "llama-3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                                tie_word_embeddings=False),
    "llama-3.1-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                 num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                 rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2.5-7b": LlamaConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                              num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0,
                              tie_word_embeddings=False),
    "mistral-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, rope_theta=1000000.0,
                              tie_word_embeddings=False),
}

_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads")


def get(name_or_path: str | Path) -> tuple[str, LlamaConfig]:
    """``(name, config)`` of a preset name or a ``config.json`` path (a llama-style decoder)."""
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        return name_or_path, PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"model must be one of {sorted(PRESETS)} or a config.json path, got {name_or_path!r}")
    return path.stem if path.name != "config.json" else path.parent.name or "config", load_config(path)


def load_config(path: str | Path) -> LlamaConfig:
    """A llama-style ``config.json`` (Hugging Face names; ``num_key_value_heads`` defaults to the query heads)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"config {path}: cannot read a JSON object ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"config {path}: expected a JSON object, got {type(doc).__name__}")
    doc.setdefault("num_key_value_heads", doc.get("num_attention_heads"))
    missing = [f for f in _HF_FIELDS if f not in doc]
    if missing:
        raise ValueError(f"config {path}: missing {missing} (a llama-style decoder's shape)")
    kw = {f: doc[f] for f in _HF_FIELDS}
    if "head_dim" in doc and doc["head_dim"] != doc["hidden_size"] // doc["num_attention_heads"]:
        raise ValueError(f"config {path}: head_dim {doc['head_dim']} != hidden_size / num_attention_heads "
                         f"(a decoupled head_dim is not modelled)")
    return replace(LlamaConfig(), **kw, tie_word_embeddings=bool(doc.get("tie_word_embeddings", False)))


def linear_params(cfg: LlamaConfig) -> int:
    """Parameters of the linear layers one decode step multiplies (q, k, v, o, gate, up, down per layer, and the
    LM head): what a step reads from memory at small batches."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkvo = h * (cfg.num_attention_heads * d) * 2 + h * (cfg.num_key_value_heads * d) * 2
    return cfg.num_hidden_layers * (qkvo + 3 * h * i) + h * cfg.vocab_size


def params(cfg: LlamaConfig) -> int:
    """All parameters (the linear layers, the embedding unless tied, the norms): the weights' memory."""
    norms = cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return linear_params(cfg) + embed + norms


def flops_per_token(cfg: LlamaConfig, context: int = 0) -> float:
    """FLOPs of one token through the model: ``2 x`` the linear parameters, plus attention over ``context``
    earlier tokens (QK^T and PV: ``4 x heads x head_dim`` a context token a layer)."""
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * context * cfg.num_hidden_layers
    return 2.0 * linear_params(cfg) + attn
