"""Adapters that put installed peers behind the decode op's contract, each checked by the same suite.

Each entry of :data:`PEERS` imports its library and returns ``(fn, claims)``; an ImportError means the peer is
absent (``builtin.ABSENT`` says so). Neither library is on the H200 image or the CI machine (``../shared/peers``
brings them to a GPU run). The claims state what the library supports, so the suite runs an adapter on those cases
only and lists the rest as unsupported by the adapter (docs/byo_kernel.md):

- FlashInfer 0.7.4: ``BatchDecodeWithPagedKVCacheWrapper`` (its CUDA decode kernel, ``use_tensor_cores=False``)
  planned on our CSR export (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``). See :data:`FLASHINFER_CLAIMS`.
  :func:`flashinfer_plan` plans it once (the adapter per call, ``bench quant_decode``'s peers section once per
  workload) for each of :data:`FLASHINFER_FP8_BACKENDS`.
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


# FlashInfer's decode paths for a paged e4m3 cache with one scale per tensor read by fp16 queries on the H200 (SM90),
# from flashinfer/decode.py, xqa.py and utils.py (0.7.4); name -> whether q stays fp16 (accurate):
# - "cuda_core": the wrapper with use_tensor_cores=False (decode.cuh's CUDA-core kernel, what the adapter runs): the
#   codes converted after the load, fp32 softmax, q in fp16.
# - "tensor_core": the wrapper with use_tensor_cores=True, backend "fa2" (its prefill kernel on one query row; "auto"
#   resolves to fa2 too, since is_fa3_backend_supported refuses an fp8 cache with fp16 queries).
# - "xqa": xqa_batch_decode_with_kv_cache; on SM90 an e4m3 cache runs its Hopper fp8 kernel (xqa: run_sm90_fp8_mha),
#   which casts q and the probabilities to e4m3 (issue 31 measured relative error 3.6e-2): not accurate.
# trtllm-gen and cute-dsl are SM100 kernels; cudnn reads no fp8. The wrapper folds k_scale into sm_scale and
# multiplies the output by v_scale after its kernel; XQA takes them as bmm1_scale (sm_scale * k_scale) and bmm2_scale.
FLASHINFER_FP8_BACKENDS = {"cuda_core": True, "tensor_core": True, "xqa": False}


def flashinfer_plan(fi, q, k_cache, v_cache, layout, kv_indptr, kv_indices, kv_last_page_len, block_size, sm_scale,
                    k_scale=None, v_scale=None, *, workspace, backend="cuda_core", out=None, cuda_graph=False,
                    block_table=None, seq_lens=None):
    """``(run, resolved)``: FlashInfer's decode ``backend`` (:data:`FLASHINFER_FP8_BACKENDS`) planned here, once, on our
    CSR export, and ``run()`` computing it (into ``out`` when given; returns ``[B, Hq, D]``); ``resolved`` is the
    kernel FlashInfer picked. ``workspace``: a zeroed uint8 buffer (128 MiB; XQA reserves its first 8 MiB as
    semaphores). ``cuda_graph``: the wrapper in FlashInfer's CUDA-graph mode (its own copies of the CSR), so that
    ``run`` can be captured. ``xqa`` reads ``block_table`` [B, pages] and ``seq_lens`` [B] (int32) instead of the CSR.
    The scales (one-element tensors or None) are read on the host here, not in ``run``."""
    if backend not in FLASHINFER_FP8_BACKENDS:
        raise ValueError(f"backend must be one of {sorted(FLASHINFER_FP8_BACKENDS)}, got {backend!r}")
    ks = 1.0 if k_scale is None else float(k_scale.reshape(-1)[0])
    vs = None if v_scale is None else float(v_scale.reshape(-1)[0])
    if backend == "xqa":
        if block_table is None or seq_lens is None:
            raise ValueError("backend 'xqa' needs block_table [B, pages] and seq_lens [B] (int32)")
        xqa = importlib.import_module(f"{fi.__name__}.decode").xqa_batch_decode_with_kv_cache
        table = block_table.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous().view(torch.uint32).reshape(-1)  # XQA's dtype, same bits
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
        return (lambda: xqa(q, (k_cache, v_cache), workspace, table, lens, max_len, bmm1_scale=sm_scale * ks,
                            bmm2_scale=1.0 if vs is None else vs, kv_layout=layout.upper(), out=out)), "xqa"
    bufs = {}
    if cuda_graph:
        bufs = dict(use_cuda_graph=True, paged_kv_indptr_buffer=kv_indptr.clone(),
                    paged_kv_indices_buffer=kv_indices.clone(), paged_kv_last_page_len_buffer=kv_last_page_len.clone())
    tc = backend == "tensor_core"
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout=layout.upper(), use_tensor_cores=tc,
                                                    backend="fa2" if tc else "auto", **bufs)
    hkv = k_cache.shape[2] if layout == "nhd" else k_cache.shape[1]
    wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, q.shape[1], hkv, q.shape[2], block_size,
                 q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=sm_scale)
    resolved = str(getattr(wrapper, "resolved_backend", backend))
    kw = dict(k_scale=None if k_scale is None else ks, v_scale=vs, **({"out": out} if out is not None else {}))
    return (lambda: wrapper.run(q, (k_cache, v_cache), **kw)), resolved


def _flashinfer():
    fi = importlib.import_module("flashinfer")
    workspaces: dict = {}

    def flashinfer_decode(q, k_cache, v_cache, layout, kv_indptr, kv_indices, kv_last_page_len, block_size,
                          sm_scale, k_scale, v_scale, out):
        ws = workspaces.get(q.device)
        if ws is None:
            ws = workspaces[q.device] = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
        run, _ = flashinfer_plan(fi, q, k_cache, v_cache, layout, kv_indptr, kv_indices, kv_last_page_len,
                                 block_size, sm_scale, k_scale, v_scale, workspace=ws)
        got = run()
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
