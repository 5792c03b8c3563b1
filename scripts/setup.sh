#!/usr/bin/env bash
# Set up the workbench's Python environment and print the interpreter to use.
#
# Default: a virtual environment in .venv. Set WORKBENCH_PYTHON to use an existing
# interpreter instead (a conda env, the GPU machine's image): its torch is left alone.
#
# Torch: an existing torch is never replaced. Otherwise, on a machine with an NVIDIA GPU
# plain `torch` (a CUDA build) is installed; without one, the CPU build
# torch==$WORKBENCH_CPU_TORCH (2.13.0 by default), with $WORKBENCH_TORCH_PIP_ARGS passed
# to pip (for example an index that serves CPU wheels).
#
# Re-running is cheap: a stamp keyed on pyproject.toml skips pip when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[setup] $*" >&2; }

if [ -n "${WORKBENCH_PYTHON:-}" ]; then
  py=$WORKBENCH_PYTHON
else
  venv=.venv
  if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    "${PYTHON:-python3}" -m venv "$venv" >&2
  fi
  py=$venv/bin/python
fi

stamp_dir=$("$py" -c 'import sys; print(sys.prefix)')
stamp="$stamp_dir/.kv-workbench-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ] && "$py" -c 'import torch, triton, workbench' 2>/dev/null; then
  echo "$py"
  exit 0
fi

pip=("$py" -m pip install --disable-pip-version-check -q)
if "$py" -c 'import torch' 2>/dev/null; then
  log "keeping installed torch $("$py" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  log "GPU found: installing torch (CUDA build)"
  "${pip[@]}" torch >&2
else
  log "no GPU: installing CPU torch==${WORKBENCH_CPU_TORCH:-2.13.0}"
  # shellcheck disable=SC2086
  "${pip[@]}" "torch==${WORKBENCH_CPU_TORCH:-2.13.0}" ${WORKBENCH_TORCH_PIP_ARGS:-} >&2
fi

log "installing the workbench (editable) with its dev tools"
"${pip[@]}" -e ".[dev]" >&2
rm -f "$stamp_dir"/.kv-workbench-*
touch "$stamp"
echo "$py"
