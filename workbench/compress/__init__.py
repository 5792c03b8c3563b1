"""KV compression on a real paged cache (seed part 6.2; StreamingLLM, H2O, SnapKV, Quest, CacheGen).

One concept per module, imported by name (nothing is imported here, so each stays cheap):

- ``policies``: sparsification policies behind one registry (sinks + window, heavy hitters, SnapKV, the seed's
  score threshold with its CSR store), each with a budget in tokens or a ratio; block-granular selection.
- ``evict``: a policy's choice applied to a :class:`~workbench.cache.PagedKVCache`: dropped blocks go back to
  the pool, partly dropped ones are kept or compacted.
- ``quest``: per-block key bounds and page selection for decode (Quest).
- ``delta``: lossless delta + entropy coding of K/V; ``delta_quant`` its lossy variant (quantized codes,
  delta-coded); ``delta_options`` what both take; ``delta_study`` the ratios, speeds and break-even against the
  tiers' links.
- ``study``: scoring every policy (memory kept, attention-output error, recall; next-token agreement and
  perplexity on the real model).
"""
