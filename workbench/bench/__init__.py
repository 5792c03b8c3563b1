"""Benchmarks: one module per benchmark, each with ``main(argv)`` run by
``python -m workbench bench <name>``; ``command`` holds the command line they share (``--out``, ``--smoke``, the
GPU check), ``harness`` timing, bandwidth and accuracy, ``decode_timing`` what the decode benchmarks and the decode
study time. They write through ``workbench.results.run_files``; the decode workloads W1-W5 are
``workbench.core.workloads``, and ``workbench.results`` shapes the committed runs for the notebooks."""

# The modules `python -m workbench bench NAME` runs (the others are helpers), each with the line
# `python -m workbench bench --help` shows for it. Runs write to results/ (git-ignored) unless --out DIR.
BENCHMARKS = {
    "allocator": "allocator operations per second on this CPU (allocate+free, fork, prefix lookup)",
    "cache_kernels": "GPU: write-to-cache and block-copy kernels vs torch (--smoke: tiny CPU check)",
    "decode": "GPU: paged decode attention on W1-W5 vs SDPA, gather+SDPA, FlexAttention (--smoke: tiny CPU check)",
    "model_quality": "CPU: every quantized cache vs the fp16 cache on SmolLM2-135M and real text (agreement, KL, ppl)",
    "quant_decode": "GPU: paged decode of every quantization scheme on W1-W5 beside fp16, quantize-on-write, fp8 "
                    "codes vs torch (--tune; --smoke: tiny CPU check)",
    "model_decode": "GPU: SmolLM2-135M decode tokens/s, our runner (eager, CUDA graph) vs transformers' static-cache "
                    "generate; where the step goes (--check: logits vs transformers); the runner through the "
                    "shared-prefix cascade and Quest (--smoke: tiny CPU check of those)",
    "tiers": "GPU: the host link for KV blocks: bandwidth by block size x batch for the copy-engine and SM-copy paths, "
             "the slowdown of a decode beside transfers, prefetch overlap, TieredCache checks",
    "quest": "GPU: Quest page selection (scores + top-k + compacted table + decode) vs full paged decode at 32k, "
             "speedup, bytes, recall on real activations (--smoke: tiny CPU check)",
    "compression_delta": "CPU: delta + zstd coding of real K/V (ratios per layer, keys vs values, pre/post RoPE), "
                         "codec speed, and the break-even of a compressed swap on the measured links",
    "compression_model": "CPU: every sparsification policy through a cache that frees real blocks, on SmolLM2-135M "
                         "(agreement, log-prob drift, perplexity vs memory kept)",
    "shared_prefix": "GPU: shared-prefix decode (cascade) vs plain paged decode vs SDPA, prefix x sharers x suffix x "
                     "GQA: the crossover map, the tile sweep, fp8, nested prefixes, overlap-aware batching, the fitted "
                     "selector (--smoke: tiny CPU check)",
    "whatif_replay": "GPU: a trace replayed through the real runner in real time vs the what-if's prediction of it "
                     "(throughput, TTFT; --smoke: tiny CPU check)",
    "results": "print the newest timed decode run of a result folder (no GPU needed)",
    "anatomy": "no GPU needed: each decode kernel compiled for sm_90a; registers, spills and its main loop's SASS per "
               "stored byte against the issue budget (what limits a scheme that is not at copy bandwidth); "
               "--kernel write: the quantize-on-write kernels, their programs' SASS per byte moved",
}
