"""Out-of-bounds check of the decode and cascade kernels (run under compute-sanitizer with
PYTORCH_NO_CUDA_MEMORY_CACHING=1, so every tensor is its own allocation): small points of each layout."""
import torch
from workbench.kernels import DecodePlan

import workbench  # noqa: F401
from workbench.bench import shared_prefix as sp
from workbench.core.layout import from_nhd

for prefix, n, suffix, hq, hkv in [(128, 4, 128, 32, 8), (1024, 16, 100, 32, 32), (128, 1, 77, 32, 8)]:
    p = sp.Point(prefix, n, suffix, hq, hkv)
    ref = p.plain().run(p.q, p.k, p.v)
    if p.segments:
        out = p.cascade(64).run(p.q, p.k, p.v)
    for layout in ("hnd", "vllm"):
        k, v = from_nhd(p.k, layout, "k").contiguous(), from_nhd(p.v, layout, "v").contiguous()
        DecodePlan(p.table, p.seq_lens, layout=layout, k_cache=k, v_cache=v, num_q_heads=hq,
                   q_dtype=p.q.dtype).run(p.q, k, v)
    torch.cuda.synchronize()
    print("ok", prefix, n, suffix, hq, hkv, flush=True)
