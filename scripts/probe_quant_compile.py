"""Compile every decode scheme once on the GPU at a small shape and print full errors (a probe, not a benchmark)."""
import traceback

import torch
from workbench.kernels import paged_decode

from workbench import quant
from workbench.bench.quant_decode import bench_scheme, quantized_paged
from workbench.bench.workloads import Workload, build_paged

w = Workload("P", "probe", 4, 300, 32, 8)
p = build_paged(w, layout="nhd", block_size=16, device="cuda")
for name in ("int4/token", "int4/kivi", "int2/kivi", "int8/token"):
    s = bench_scheme(name)
    try:
        kc, vc, ks, vs = quantized_paged(p, s)
        out = paged_decode(p.q, kc, vc, "nhd", p.block_table, p.seq_lens, quant=s)
        torch.cuda.synchronize()
        print(name, "ok", float(out.float().abs().mean()))
    except Exception:  # noqa: BLE001
        print(name, "FAILED")
        print("\n".join(traceback.format_exc().splitlines()[-25:]))
_ = quant
