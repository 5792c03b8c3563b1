"""The ops an implementation can implement, as contracts: the arguments it may ask for (by parameter name: it is handed
only the ones its signature names, so a CSR kernel asks for ``kv_indptr`` and never sees the block table), the ones it
must take, and what it must give back. :mod:`workbench.conformance.implementations` checks a signature against them,
:mod:`workbench.conformance.problems` builds every argument of a case.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One op's contract: ``arguments`` an implementation may take (by name), ``required`` the ones it must."""

    name: str
    arguments: dict[str, str]  # name -> what it is
    required: tuple[str, ...]
    returns: str


_DECODE_ARGS = {
    "q": "[B, Hq, D] queries, one token per sequence (fp16 / bf16 / fp32)",
    "k_cache": "one layer's K cache in `layout`: [blocks, ...] (padded block strides possible)",
    "v_cache": "one layer's V cache, same layout and blocks",
    "layout": "'nhd', 'hnd' or 'vllm' (workbench.core.layout)",
    "block_size": "tokens per block",
    "block_table": "[B, max_blocks] int32 physical block ids; entries past a sequence's blocks are padding",
    "seq_lens": "[B] int32 context lengths (0 allowed)",
    "kv_indptr": "[B + 1] int32, FlashInfer's CSR: sequence b's blocks are kv_indices[kv_indptr[b]:kv_indptr[b+1]]",
    "kv_indices": "[nnz] int32 block ids of all sequences, in order",
    "kv_last_page_len": "[B] int32 tokens in each sequence's last block (0 for an empty sequence)",
    "max_seq_len": "max(seq_lens) as a Python int",
    "sm_scale": "softmax scale (the suite passes a value that is not 1/sqrt(D))",
    "k_scale": "None, or an fp32 tensor of 1 or Hkv values: read = stored * scale (fp8 / int8 caches)",
    "v_scale": "like k_scale",
    "quant": "None, or the workbench.quant scheme name of a cache whose scales live in its blocks",
    "kv_format": "the format name of the case ('fp16', 'fp8_e4m3', 'int8_asym/token', ...)",
    "out": "[B, Hq, D] output buffer in q's dtype, pre-filled with NaN",
}

OPS: dict[str, Op] = {
    "decode": Op("decode", _DECODE_ARGS, ("sm_scale",), "out [B, Hq, D] in q's dtype (written into out, or returned)"),
    "shared_prefix": Op("shared_prefix", {**_DECODE_ARGS, "ref_counts": "[blocks] int32 holders of each block"},
                        ("sm_scale",), "as decode; the batch's block tables share leading blocks"),
    "write": Op("write", {
        "key": "[T, Hkv, D] new keys (fp16 / bf16 / fp32)", "value": "[T, Hkv, D] new values",
        "k_cache": "one layer's K cache in `layout` (written in place)", "v_cache": "the V cache",
        "layout": "'nhd', 'hnd' or 'vllm'", "block_size": "tokens per block",
        "slot_mapping": "[T] int64 slots: block * block_size + offset", "k_scale": "None or fp32 [1] / [Hkv]",
        "v_scale": "like k_scale", "kv_format": "the format name of the case"},
        ("slot_mapping",), "nothing: the caches hold the tokens, every other byte untouched"),
    "copy": Op("copy", {
        "pool": "[layers, 2, blocks, block_stride] every layer's K and V blocks (any dtype)",
        "src": "[n] int32 source blocks (may repeat: a fork)", "dst": "[n] int32 destinations, distinct, not sources"},
        ("pool", "src", "dst"), "nothing: pool[:, :, dst] equals the old pool[:, :, src], every other byte untouched"),
}
