"""Adapters that put installed peers behind the decode op's contract, each checked by the same suite.

Each entry of :data:`PEERS` imports its library and returns ``(fn, claims)``; an ImportError means the peer is
absent (``builtin.ABSENT`` says so). Neither library is on the H200 image or the CI machine, so these adapters are
written from the libraries' documented APIs and run only where a user has them installed; their first run through
``python -m workbench check flashinfer`` is the check that they are right.

- FlashInfer: ``BatchDecodeWithPagedKVCacheWrapper`` planned on our CSR export (``kv_indptr``, ``kv_indices``,
  ``kv_last_page_len``), NHD or HND.
- vLLM: ``unified_attention`` (its Triton attention, the V1 engine's) with our block table, NHD, one query token per
  sequence.
"""

from __future__ import annotations

import importlib

import torch


def _flashinfer():
    fi = importlib.import_module("flashinfer")
    workspaces: dict = {}

    def flashinfer_decode(q, k_cache, v_cache, layout, kv_indptr, kv_indices, kv_last_page_len, block_size,
                          sm_scale, k_scale, v_scale, out):
        ws = workspaces.get(q.device)
        if ws is None:
            ws = workspaces[q.device] = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout=layout.upper())
        hkv = k_cache.shape[2] if layout == "nhd" else k_cache.shape[1]
        wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, q.shape[1], hkv, q.shape[2], block_size,
                     q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=sm_scale)
        got = wrapper.run(q, (k_cache, v_cache),
                          k_scale=None if k_scale is None else float(k_scale.reshape(-1)[0]),
                          v_scale=None if v_scale is None else float(v_scale.reshape(-1)[0]))
        empty = (kv_indptr[1:] == kv_indptr[:-1])  # no pages: the contract says zeros
        return out.copy_(got.masked_fill(empty[:, None, None], 0))

    return flashinfer_decode, dict(layouts=("nhd", "hnd"), formats=("fp16", "bf16"),
                                   description=f"FlashInfer {getattr(fi, '__version__', '?')} batch decode (CSR)")


def _vllm():
    try:
        mod = importlib.import_module("vllm.v1.attention.ops.triton_unified_attention")
    except ImportError:
        mod = importlib.import_module("vllm.attention.ops.triton_unified_attention")

    def vllm_triton_decode(q, k_cache, v_cache, block_table, seq_lens, max_seq_len, sm_scale, out):
        B = q.shape[0]
        cu_q = torch.arange(B + 1, dtype=torch.int32, device=q.device)
        mod.unified_attention(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1,
                              seqused_k=seq_lens, max_seqlen_k=max(1, max_seq_len), softmax_scale=sm_scale,
                              causal=True, window_size=(-1, -1), block_table=block_table, softcap=0,
                              q_descale=None, k_descale=None, v_descale=None)
        return out.masked_fill_((seq_lens == 0)[:, None, None], 0)

    return vllm_triton_decode, dict(layouts=("nhd",), formats=("fp16", "bf16"),
                                    description="vLLM unified_attention (Triton), block table")


PEERS = {"flashinfer": _flashinfer, "vllm_triton": _vllm}
