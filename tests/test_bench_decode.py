"""The decode benchmark's smoke mode: tiny workloads, every row correct, a tidy result file."""

import json

import pytest
import torch

from workbench.bench import decode
from workbench.core.workloads import WORKLOADS, build_paged, bytes_moved

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)


def test_bench_decode_smoke(tmp_path):
    assert decode.main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("decode-*.json")
    data = json.loads(path.read_text())
    rows = data["rows"]
    assert {r["workload"] for r in rows} == set(WORKLOADS)
    assert {"ours", "sdpa_contiguous", "gather_sdpa"} <= {r["impl"] for r in rows}
    for r in rows:
        for col in ("workload", "impl", "layout", "block_size", "kv_dtype", "time_us", "time_us_graph", "rel_err",
                    "gpu", "commit"):
            assert col in r, col
        assert r["rel_err"] < 1e-2, r


def test_workloads_match_design():
    w1, w5 = WORKLOADS["W1"], WORKLOADS["W5"]
    assert (w1.batch, w1.context, w1.num_q_heads, w1.num_kv_heads, w1.head_dim) == (64, 4096, 32, 8, 128)
    lens = w5.seq_lens()
    assert lens == w5.seq_lens() and min(lens) >= 128 and max(lens) <= 8192 and len(set(lens)) > 32
    assert bytes_moved(w1, 2, 2) == 64 * 4096 * 8 * 128 * 2 * 2 + 2 * 64 * 32 * 128 * 2


def test_build_paged_padded_stride():
    p = build_paged(WORKLOADS["W4"].smoke(), layout="hnd", block_size=8, device="cpu", block_stride_pad=3)
    per = p.k_cache[0].numel()
    assert p.k_cache.stride(0) == per + 3
    used = [x for b, n in enumerate(p.blocks_per_seq) for x in p.block_table[b, :n].tolist()]
    assert len(set(used)) == len(used) and max(used) < p.k_cache.shape[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the vLLM launch-config probe is a GPU tool: "
                    "scripts/gpu_run.sh runs it (under the Triton interpreter its smoke took 22 s of the 10-minute "
                    "CPU test command)")
def test_vllm_probe_script_smoke(tmp_path):
    """scripts/probe_vllm_decode.py (the launch-config probe behind docs/decode_tuning.md v4.1) still runs."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    # a script's sys.path[0] is scripts/: import this checkout, installed or not (the H200 run found no install)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, str(root / "scripts" / "probe_vllm_decode.py"), "--smoke", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    (path,) = tmp_path.glob("vllm-decode-probe-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert rows and all(r["rel_err"] < 1e-2 for r in rows)
