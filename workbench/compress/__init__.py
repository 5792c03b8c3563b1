"""KV compression on a real paged cache (seed part 6.2; StreamingLLM, H2O, SnapKV, Quest, CacheGen).

One concept per module, imported by name (nothing is imported here, so each stays cheap):

- ``policies``: sparsification policies behind one registry (sinks + window, heavy hitters, SnapKV, the seed's
  score threshold with its CSR store ``csr``), each with a budget in tokens or a ratio; ``observation`` what a
  policy sees (K/V and observed queries) and the attention it reads; ``block_keep`` what a token set costs in blocks.
- ``evict``: a policy's choice applied to a :class:`~workbench.cache.PagedKVCache`: dropped blocks go back to
  the pool, partly dropped ones are kept or compacted; ``evicting_kv`` the model's cache evicting as it decodes.
- ``page_selection``: Quest's per-page key bounds, page choice and recall (PyTorch); ``quest_decode`` Quest decode
  on the paged cache with the kernels.
- ``delta_quant``: the lossy variant of the lossless delta coding (``workbench.coding.delta``: quantized codes,
  delta-coded); ``delta_study`` the ratios, speeds and break-even against the tiers' links.
- ``sparsity_study``: scoring every policy (memory kept, attention-output error); ``recall_study`` Quest's recall
  on captured prompts; ``model_study`` next-token agreement and perplexity on the real model.
"""
