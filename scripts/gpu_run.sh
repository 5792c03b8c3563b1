#!/usr/bin/env bash
# One batched GPU session (run from the repo root on the GPU machine, which has no network and
# no .git): install the core offline, check every kernel compiled against its reference, then
# run the named benchmarks. Results and logs go to $OUT (default ./out).
#   WORKBENCH_COMMIT=$(git rev-parse --short=12 HEAD) scripts/gpu_run.sh tests cache_kernels decode
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v -i "warning" | tail -3
python -m workbench info | tee "$OUT/info.txt"
status=0
for step in "$@"; do
  echo "=== $step"
  case $step in
    tests) python -m pytest -q -x -p no:cacheprovider tests/test_gather.py tests/test_write_copy.py \
             tests/test_decode.py tests/test_cache.py tests/test_compaction.py \
             tests/test_kernel_validation.py tests/test_api_boundary.py tests/test_quant_kernels.py \
             tests/test_quant_cache.py tests/test_tiers_cache.py tests/test_tiers_disk.py tests/test_shared_prefix.py \
             tests/test_conformance_pytest.py \
             tests/test_bench_decode.py::test_vllm_probe_script_smoke 2>&1 | tail -5 \
             | tee "$OUT/gpu_tests.log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    *) python -m workbench bench "$step" --out "$OUT" 2>&1 | tee "$OUT/$step.log"
       [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
  esac
done
exit $status
