#!/usr/bin/env bash
# What the browser test (tests/browser) needs beyond the Python environment: Debian's Chromium and a font.
# playwright (a dev dependency) drives that Chromium; it never downloads a browser of its own.
#
# Installs with apt when Chromium is missing (as root, or through sudo); set WORKBENCH_CHROMIUM to use
# another Chromium binary instead. Prints nothing on stdout; fast when everything is present.
set -euo pipefail

chromium=${WORKBENCH_CHROMIUM:-/usr/bin/chromium}
log() { echo "[setup-browser] $*" >&2; }

if [ -x "$chromium" ]; then
  exit 0
fi
if [ -n "${WORKBENCH_CHROMIUM:-}" ]; then
  log "WORKBENCH_CHROMIUM=$chromium is not an executable"; exit 1
fi
if [ "$(id -u)" = 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
else
  log "Chromium is missing and this user cannot run apt: install Debian's 'chromium' package, or set WORKBENCH_CHROMIUM"
  exit 1
fi
start=$SECONDS
log "installing Debian's chromium with apt (about 30 s)..."
"${sudo[@]}" apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
  chromium fonts-dejavu-core >/dev/null  # errors still reach stderr
log "chromium $("$chromium" --version 2>/dev/null | awk '{print $2}') installed in $((SECONDS - start)) s"
