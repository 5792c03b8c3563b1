#!/usr/bin/env bash
# The bring-your-own-kernel loop on a GPU, in one call: the conformance suite compiled (every op, ours at the full
# level, the starter and its three deliberately broken versions at pairwise), then bench decode with the starter
# beside ours and the installed peers. Reports go to $OUT (default results/byok).
#   OUT=data/results scripts/byok_gpu.sh
set -uo pipefail
out=${OUT:-results/byok}
mkdir -p "$out"
py=${PYTHON:-python}
gpu=$($py -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower())")
stamp=$(date -u +%Y%m%dT%H%M%S)
check() {  # name op level
  local start=$SECONDS
  $py -m workbench check "$1" --op "$2" --level "$3" -q --load scripts/broken_starters.py \
      --json "$out/byok-check-$1-$2-$3-$gpu-$stamp.json" | tail -n 25
  echo "[byok] check $1 $2 $3: $((SECONDS - start)) s wall (compiles included)"
}
$py -m workbench check --list --load scripts/broken_starters.py
for op in decode shared_prefix write copy; do check ours $op full; done
for impl in starter broken_mask broken_gqa broken_block; do check $impl decode pairwise; done
check ours decode pairwise  # again, now compiled: the suite's own time without first compiles
$py -m workbench bench decode --impl starter --out "$out"
