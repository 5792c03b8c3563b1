"""The cache-kernel benchmark's smoke run: correct on tiny shapes, tidy rows in a result file."""

import json

import pytest

from workbench.bench import cache_kernels

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

REQUIRED = ["workload", "impl", "layout", "block_size", "kv_dtype", "time_us", "time_us_graph", "gbps",
            "frac_copy_bw", "rel_err", "ok", "variant", "gpu", "commit"]


def test_smoke_writes_tidy_rows(tmp_path, capsys):
    assert cache_kernels.main(["--smoke", "--out", str(tmp_path)]) == 0
    files = list(tmp_path.glob("cache_kernels-*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    rows = data["rows"]
    assert data["smoke"] is True and "meta" in data
    for row in rows:
        missing = [c for c in REQUIRED if c not in row]
        assert not missing, f"row {row.get('workload')} {row.get('impl')} lacks {missing}"
        quantized = row["kv_dtype"].startswith(("fp8", "int8"))
        assert row["ok"] and (row["rel_err"] == 0.0 or (quantized and row["rel_err"] <= 1)), row
        assert row["timing"] == "wall" and row["gbps"] is None  # smoke: correctness only
    workloads = {r["workload"] for r in rows}
    assert {"prefill", "prefill-fp8", "copy-4"} <= workloads and any(w.startswith("decode-") for w in workloads)
    assert {r["layout"] for r in rows if r["workload"] == "prefill"} == {"nhd", "hnd", "vllm"}
    assert {"triton", "torch-index"} <= {r["impl"] for r in rows}
    assert len({r["variant"] for r in rows if r["workload"] == "prefill" and r["impl"] == "triton"}) >= 3
    assert "kv_dtype" in capsys.readouterr().out  # the table was printed


def test_fastest_row_per_key():
    from workbench.results.decode import fastest

    rows = [{"workload": "w", "layout": "nhd", "impl": "a", "time_us": 3.0},
            {"workload": "w", "layout": "nhd", "impl": "a", "time_us": 2.0},
            {"workload": "w", "layout": "hnd", "impl": "a", "time_us": 5.0, "time_us_graph": 1.0},
            {"workload": "w", "layout": "hnd", "impl": "b", "time_us": None}]
    assert [r["time_us"] for r in fastest(rows)] == [5.0, 2.0]
    assert [r["layout"] for r in fastest(rows, graph=True)] == ["hnd"]
