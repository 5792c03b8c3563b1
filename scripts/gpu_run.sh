#!/usr/bin/env bash
# One batched GPU session (run from the repo root on the GPU machine, which has no network and
# no .git): install the core offline, run every test that launches a kernel, compiled, then the
# named benchmarks. Results and logs go to $OUT (default ./out).
#   WORKBENCH_COMMIT=$(git rev-parse --short=12 HEAD) scripts/gpu_run.sh tests cache_kernels decode
# tests: every test marked `kernels` (pytest -m kernels: tests/kernel_launches.py fails any unmarked
# test that launches a kernel, so the list is complete by rule), no -x, in the files that carry the
# marker; $OUT/gpu_tests.json holds the counts and the failures' ids, stamped (workbench.results.gpu_tests).
# GPU_TESTS="tests/test_a.py ..." runs those files only (a run split over calls: give every
# call's gpu_tests*.xml to python -m workbench.results.gpu_tests); GPU_TEST_WORKERS=N uses pytest-xdist
# where it is installed (Triton compiles on the CPU: N processes compile N kernels at once).
# A test module needing a package the machine lacks is reported skipped (WORKBENCH_SKIP_MISSING).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The same interpreter's pip; a failed install stops the run, its whole output shown (scripts/ and subprocesses
# import workbench from the install: only the repo root's own `python -m ...` would find it without one).
if ! python -m pip install --no-deps --no-build-isolation -q -e . >"$OUT/pip_install.log" 2>&1; then
  cat "$OUT/pip_install.log"
  echo "gpu_run.sh: pip install -e . failed (above, and in $OUT/pip_install.log)" >&2
  exit 1
fi
if ! (cd / && python -c "import workbench, workbench.kernels"); then  # from /: the repo root would mask it
  cat "$OUT/pip_install.log"
  echo "gpu_run.sh: after pip install -e ., python ($(command -v python)) cannot import workbench outside" \
       "the repo root" >&2
  exit 1
fi
python -m workbench info | tee "$OUT/info.txt"
status=0
for step in "$@"; do
  echo "=== $step"
  case $step in
    tests) files=${GPU_TESTS:-$(grep -l "pytest.mark.kernels" tests/test_*.py | tr '\n' ' ')}
           workers=()
           if [ -n "${GPU_TEST_WORKERS:-}" ] && python -c "import xdist" 2>/dev/null; then
             workers=(-n "$GPU_TEST_WORKERS")
           fi
           tag=${GPU_TESTS_TAG:-}
           WORKBENCH_SKIP_MISSING=1 python -m pytest -q -m kernels -p no:cacheprovider -o junit_family=xunit1 \
             "${workers[@]}" --junitxml="$OUT/gpu_tests$tag.xml" $files 2>&1 | tee "$OUT/gpu_tests$tag.log" | tail -40
           [ "${PIPESTATUS[0]}" = 0 ] || status=1
           python -m workbench.results.gpu_tests "$OUT/gpu_tests$tag.json" "$OUT/gpu_tests$tag.xml" \
             --command "pytest -m kernels ${GPU_TESTS:-(every marked file)}" || status=1 ;;
    *) python -m workbench bench "$step" --out "$OUT" 2>&1 | tee "$OUT/$step.log"
       [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
  esac
done
exit $status
