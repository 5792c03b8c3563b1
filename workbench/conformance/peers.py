"""Adapters that put installed peers behind the decode op's contract, each checked by the same suite.

Each entry of :data:`PEERS` imports its library and returns ``(fn, claims)``; an ImportError means the peer is
absent (``builtin.ABSENT`` says so). Neither library is on the H200 image or the CI machine (``../shared/peers``
brings them to a GPU run). The claims state what the library supports, so the suite runs an adapter on those cases
only and lists the rest as unsupported by the adapter (docs/byo_kernel.md):

- FlashInfer 0.7.4: ``BatchDecodeWithPagedKVCacheWrapper`` (its CUDA decode kernel, ``use_tensor_cores=False``)
  planned on our CSR export (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``). See :data:`FLASHINFER_CLAIMS`.
- vLLM 0.26: ``unified_attention`` (its Triton attention, the V1 engine's) with our block table, one query token
  per sequence. See :data:`VLLM_CLAIMS`.
"""

from __future__ import annotations

import importlib

import torch

# What FlashInfer's batch decode supports, from its sources (flashinfer-ai/flashinfer):
# - head dims 64, 128, 256: include/flashinfer/attention/decode.cuh picks vec_size = max(16 / sizeof(DTypeKV),
#   HEAD_DIM / 32) and bdx = HEAD_DIM / vec_size threads per row, reduced by shfl_xor over bdx / 2, bdx / 4, ... (a
#   power of two); include/flashinfer/utils.cuh DISPATCH_HEAD_DIM lists 64, 128, 256, 512, and vLLM's FlashInfer
#   backend (vllm/v1/attention/backends/flashinfer.py, get_supported_head_sizes) allows 64, 128, 256. Head dim 80
#   (bdx = 10) is outside it: the suite's d80 case is where the H200 run died.
# - 16-byte aligned rows: every K/V row is loaded with cp_async::pred_load<vec_bits = 128> (decode.cuh), which needs
#   16-byte aligned addresses; a block stride padded by 3 elements gives "CUDA error: misaligned address" (sticky).
# - GQA group sizes 1, 2, 3, 4, 8: DISPATCH_GQA_GROUP_SIZE in utils.cuh.
# - fp16 / bf16 queries and caches (fp8 e4m3 / e5m2 caches with one scalar k_scale / v_scale, which the suite's
#   per-head fp8 formats are not); page size any (paged_kv.page_size is a runtime divisor); layouts NHD and HND
#   (kv_layout), strides read from the tensors.
FLASHINFER_CLAIMS = dict(layouts=("nhd", "hnd"), formats=("fp16", "bf16"), head_dims=(64, 128, 256),
                         groups=(1, 2, 3, 4, 8), row_align=16)

# What vLLM's Triton unified attention supports, from vllm/v1/attention/ops/triton_unified_attention.py
# (vllm-project/vllm): the cache is [num_blocks, block_size, num_kv_heads, head_size] (NHD) and addressed through
# its runtime strides (stride_k_cache_0..2, int64: padded block strides are fine); any head size (loads masked to
# HEAD_SIZE within HEAD_SIZE_PADDED = next power of two); any block size (seq_offset // BLOCK_SIZE, tiles of
# TILE_SIZE apart from it); any group (num_queries_per_kv); fp16 / bf16 (fp8 with one per-tensor scale, or the
# per-token-head scale caches of its own, neither the suite's formats).
VLLM_CLAIMS = dict(layouts=("nhd",), formats=("fp16", "bf16"))


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

    return flashinfer_decode, dict(**FLASHINFER_CLAIMS,
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

    return vllm_triton_decode, dict(**VLLM_CLAIMS, description="vLLM unified_attention (Triton), block table")


PEERS = {"flashinfer": _flashinfer, "vllm_triton": _vllm}
