"""A whole decode step of a fixed batch (30 layers: projections, RoPE, the write-to-cache kernel, the paged decode
kernel, MLP, logits) captured once in a CUDA graph and replayed every step, as vLLM and SGLang run decode.

    dec = GraphDecoder(model, cache, batch_size=16, max_seq_len=768)   # captures on first use
    logits = dec.step(seq_ids, tokens)                                 # [B, vocab]

Per step the host reserves the new tokens' slots (:meth:`PagedKVCache.begin_step`: block tables, copy-on-write),
copies slots, block table and lengths into the graph's static buffers, replays, and commits the step. Each layer
writes the token's K/V first and then reads it back from the cache (vLLM's order). ``use_graph=False`` runs the
same code eagerly: how tests check it on a CPU, and the "eager" column of ``bench model_decode``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workbench.kernels import DecodePlan
from workbench.model.llama import Llama


class GraphDecoder:
    """See the module docstring.

    Args:
        model: fp16/bf16 on a GPU for graphs (any dtype eagerly).
        cache: a :class:`~workbench.cache.PagedKVCache` on the model's device, one block size, a scheme without
            an fp16 residual (not KIVI).
        batch_size: sequences per step (exactly this many: a serving engine pads; this benchmark does not).
        max_seq_len: the longest a sequence may grow to (sizes the block table and the decode plan's splits).
        use_graph: capture and replay a CUDA graph (needs CUDA).
        compile: :meth:`Llama.compile` first (fuses the small ops between the matmuls and the cache kernels).
    """

    def __init__(self, model: Llama, cache, batch_size: int, max_seq_len: int, *, use_graph: bool = True,
                 compile: bool = False, **launch):
        if cache.scheme.keeps_residual:
            raise ValueError(f"kv_dtype {cache.scheme.name} keeps an fp16 residual outside the blocks: not graphable")
        if use_graph and model.device.type != "cuda":
            raise ValueError("use_graph needs the model and cache on a CUDA device")
        if max_seq_len > model.config.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} passes the model's max_position_embeddings "
                             f"{model.config.max_position_embeddings} (its RoPE table)")
        if compile:
            model.compile()
        self.model, self.cache, self.B = model, cache, batch_size
        self.block_size = cache.pool_sizes[0]
        dev = model.device
        width = -(-max_seq_len // self.block_size)
        self.ids = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.slots = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.table = torch.zeros(batch_size, width, dtype=torch.int32, device=dev)
        self.lens = torch.ones(batch_size, dtype=torch.int32, device=dev)
        self.q_dtype = model.dtype if model.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float16
        kw = dict(quant=cache.scheme, **launch)
        if cache.scheme.needs_static_scales:  # planned with layer 0's; each layer's run passes its own (row views)
            kw.update(zip(("k_scale", "v_scale"), cache.layer_scales(0), strict=True))
        self.plan = DecodePlan(self.table, self.lens, layout=cache.layout, k_cache=cache.k_cache(0, self.block_size),
                               v_cache=cache.v_cache(0, self.block_size), num_q_heads=model.config.num_attention_heads,
                               q_dtype=self.q_dtype, max_seq_len=max_seq_len, validate=False, **kw)
        self.max_seq_len = max_seq_len
        self.use_graph = use_graph
        self.graph = None
        self.logits = None

    # ---- what the graph holds ------------------------------------------------------
    def _forward(self) -> torch.Tensor:
        m, c, bs = self.model, self.cache, self.block_size
        pos = self.lens.long() - 1  # the new token's position (the lengths count it)
        x = m.embed_tokens(self.ids)
        for layer in range(m.num_layers):
            q, _, k, v = m.qkv(layer, x, pos)
            c.write_layer(layer, bs, self.slots, k, v)  # unchecked: the step checked the batch
            if c.ops == "torch":
                attn = c.decode_torch(q, layer, bs, self.table, self.lens)[0].to(q.dtype)
            else:
                attn = self.plan.run(q.to(self.q_dtype), c.k_cache(layer, bs), c.v_cache(layer, bs),
                                     **self._scales(layer))
            x = m.finish_layer(layer, x, attn)
        return m.logits(x)

    def attention_only(self) -> None:
        """The step's cache kernels alone (write + paged decode in every layer, on fixed q/k/v): timed against the
        whole step to say what share of it attention is."""
        m, c, bs = self.model, self.cache, self.block_size
        cfg = m.config
        if not hasattr(self, "_qkv"):
            g = torch.Generator(device=m.device).manual_seed(0)
            self._qkv = (torch.randn(self.B, cfg.num_attention_heads, cfg.head_dim, device=m.device, generator=g,
                                     dtype=self.q_dtype),
                         torch.randn(self.B, cfg.num_key_value_heads, cfg.head_dim, device=m.device, generator=g,
                                     dtype=self.q_dtype))
        q, k = self._qkv
        for layer in range(m.num_layers):
            c.write_layer(layer, bs, self.slots, k, k)
            self.plan.run(q, c.k_cache(layer, bs), c.v_cache(layer, bs), **self._scales(layer))

    def _scales(self, layer: int) -> dict:
        """The layer's static scales for the plan's run (views: a captured graph holds each layer's address)."""
        k_scale, v_scale = self.cache.layer_scales(layer)
        return {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}

    def capture(self) -> None:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up: compile the kernels, allocate outside the capture
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()

    # ---- a step --------------------------------------------------------------------
    def load(self, step) -> None:
        """Copy a reserved step's slots, block table and lengths into the static buffers (host -> device)."""
        n = len(step.seq_ids)
        if n != self.B:
            raise ValueError(f"seq_ids must hold exactly batch_size={self.B} sequences, got {n}")
        if step.block_size != self.block_size:
            raise ValueError(f"the sequences' block size {step.block_size} is not the decoder's {self.block_size}")
        if step.max_seq_len > self.max_seq_len:
            raise ValueError(f"a sequence reached {step.max_seq_len} tokens, past max_seq_len={self.max_seq_len}")
        w = step.block_table.shape[1]
        self.table[:, :w].copy_(step.block_table, non_blocking=True)
        self.lens.copy_(step.seq_lens, non_blocking=True)
        self.slots.copy_(step.slots, non_blocking=True)
        self.ids.copy_(torch.tensor(step.tokens, dtype=torch.long), non_blocking=True)

    @torch.no_grad()
    def step(self, seq_ids: Sequence, tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token to each of the ``batch_size`` sequences; next-token logits ``[B, vocab]`` fp32."""
        with self.cache.begin_step(seq_ids, tokens) as step:  # commits on return, aborts on an exception
            self.load(step)
            if not self.use_graph:
                return self._forward()
            if self.graph is None:
                self.capture()
            self.graph.replay()
            return self.logits
