"""A llama model in plain PyTorch (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention), split into the
pieces a serving runner calls layer by layer, so that the attention and the K/V storage are the runner's
(``workbench.model.runner``) and not the model's.

Conventions are Hugging Face's ``LlamaForCausalLM`` (the tests compare logits with it): half-dim RoPE
(``rotate_half``), query head ``h`` reads kv head ``h // (Hq / Hkv)``, norms computed in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workbench.model.config import LlamaConfig


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def random_weights(cfg: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights of the right shapes and scales (std 0.02 as initialisers use; norms 1): for timing, where values
    do not matter, and for small CPU tests of the plumbing."""
    g = torch.Generator().manual_seed(seed)
    d, f, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    w = {"embed": torch.randn(cfg.vocab_size, d, generator=g) * 0.02, "norm": torch.ones(d)}
    if not cfg.tie_word_embeddings:
        w["lm_head"] = torch.randn(cfg.vocab_size, d, generator=g) * 0.02
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        w[p + "input_norm"], w[p + "post_norm"] = torch.ones(d), torch.ones(d)
        for name, shape in (("q", (cfg.num_attention_heads * D, d)), ("k", (cfg.num_key_value_heads * D, d)),
                            ("v", (cfg.num_key_value_heads * D, d)), ("o", (d, cfg.num_attention_heads * D)),
                            ("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
            w[p + name] = torch.randn(*shape, generator=g) * 0.02
    return w


class Llama:
    """The model's weights on one device and dtype, and its per-layer pieces.

    Args:
        config: the shape.
        weights: names as :func:`random_weights` / :func:`workbench.model.gguf_weights.read_gguf` give them
            (Hugging Face row order), fp32 on the host.
        dtype, device: where the model runs (fp32 on the CPU for exact comparisons, fp16 on a GPU).

    Q, K and V are one fused matmul, gate and up another (fewer kernels per layer; the same arithmetic).
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device=None):
        cfg = self.config = config
        missing = [k for k in ("embed", "norm") if k not in weights]
        missing += [f"layers.{i}.{n}" for i in range(cfg.num_hidden_layers)
                    for n in ("input_norm", "post_norm", "q", "k", "v", "o", "gate", "up", "down")
                    if f"layers.{i}.{n}" not in weights]
        if missing:
            raise ValueError(f"weights is missing {len(missing)} tensors, e.g. {missing[:3]}")
        self.dtype, self.device = dtype, torch.device(device or "cpu")
        put = lambda t: t.to(device=self.device, dtype=dtype).contiguous()
        self.embed = put(weights["embed"])
        self.lm_head = put(weights["lm_head"]) if "lm_head" in weights else self.embed
        self.norm = put(weights["norm"])
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = lambda n, i=i: weights[f"layers.{i}.{n}"]
            self.layers.append(dict(
                input_norm=put(p("input_norm")), post_norm=put(p("post_norm")),
                qkv=put(torch.cat([p("q"), p("k"), p("v")])), o=put(p("o")),
                gate_up=put(torch.cat([p("gate"), p("up")])), down=put(p("down"))))
        D = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], -1)
        self.cos, self.sin = emb.cos().to(self.device, dtype), emb.sin().to(self.device, dtype)  # [P, D]
        self.sm_scale = 1.0 / math.sqrt(D)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, d]`` hidden states."""
        return self.embed[ids]

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        """``x`` ``[T, d]`` at ``positions`` ``[T]`` -> ``(q, k_pre, k, v)``: q ``[T, Hq, D]`` after RoPE, keys
        before and after RoPE ``[T, Hkv, D]``, values ``[T, Hkv, D]``."""
        cfg, L = self.config, self.layers[layer]
        return self._qkv(x, positions, L["input_norm"], L["qkv"], self.cos, self.sin, cfg.rms_norm_eps,
                         cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of a layer after attention: ``attn`` ``[T, Hq, D]`` -> the layer's output ``[T, d]``."""
        L = self.layers[layer]
        return self._mlp(x, attn, L["o"], L["post_norm"], L["gate_up"], L["down"], self.config.rms_norm_eps)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, d]`` -> ``[T, vocab]`` fp32."""
        return self._logits(x, self.norm, self.lm_head, self.config.rms_norm_eps)

    def compile(self) -> Llama:
        """Fuse each layer's small ops (norms, RoPE, SiLU, residuals) with ``torch.compile``: one compiled function
        for every layer (weights are arguments), so a decode step launches a few kernels per layer instead of
        dozens. Shapes are static: a new batch size compiles again (a few seconds)."""
        self._qkv = torch.compile(qkv_rope, dynamic=False, fullgraph=True)
        self._mlp = torch.compile(attn_out_mlp, dynamic=False, fullgraph=True)
        self._logits = torch.compile(final_logits, dynamic=False, fullgraph=True)
        return self

    # the plain functions (defined below) until compile() replaces them on the instance
    _qkv = staticmethod(lambda *a: qkv_rope(*a))
    _mlp = staticmethod(lambda *a: attn_out_mlp(*a))
    _logits = staticmethod(lambda *a: final_logits(*a))


def qkv_rope(x, positions, norm_w, qkv_w, cos_table, sin_table, eps: float, Hq: int, Hkv: int, D: int):
    """A layer's input norm, fused Q/K/V projection and RoPE: see :meth:`Llama.qkv`."""
    h = rms_norm(x, norm_w, eps)
    qkv = h @ qkv_w.T
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], -1)
    q, k_pre, v = q.view(-1, Hq, D), k.view(-1, Hkv, D), v.view(-1, Hkv, D)
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]  # [T, 1, D]
    q = q * cos + rotate_half(q) * sin
    k = k_pre * cos + rotate_half(k_pre) * sin
    return q, k_pre, k, v.contiguous()


def attn_out_mlp(x, attn, o_w, norm_w, gate_up_w, down_w, eps: float):
    """Output projection and residual, post-attention norm, SwiGLU MLP and residual: see :meth:`Llama.finish_layer`."""
    x = x + attn.reshape(x.shape[0], -1).to(x.dtype) @ o_w.T
    h = rms_norm(x, norm_w, eps)
    gate, up = (h @ gate_up_w.T).chunk(2, -1)
    return x + (F.silu(gate) * up) @ down_w.T


def final_logits(x, norm_w, lm_head, eps: float):
    return (rms_norm(x, norm_w, eps) @ lm_head.T).float()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Plain attention of ``q`` ``[T, Hq, D]`` (the last T positions) over ``k``/``v`` ``[P + T, Hkv, D]``, causal:
    query ``i`` sees keys ``0 .. P + i``. The reference for prefill (and the contiguous cache's decode)."""
    T, Hq, _ = q.shape
    n, Hkv = k.shape[0], k.shape[1]
    rep = Hq // Hkv
    kk = k.repeat_interleave(rep, 1).transpose(0, 1).to(q.dtype)  # [Hq, n, D]
    vv = v.repeat_interleave(rep, 1).transpose(0, 1).to(q.dtype)
    mask = torch.ones(T, n, dtype=torch.bool, device=q.device).tril(n - T)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=sm_scale)
    return out.transpose(0, 1)  # [T, Hq, D]
