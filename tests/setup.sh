#!/usr/bin/env bash
# Installs what the tests and the demo need on a fresh Debian machine with the Rust
# toolchain. Sourced by tests/run.sh and tests/demo.sh; safe to run again (installs are
# skipped when present). Exports FELHOM_FAKEPVE_PYTHON.
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

_step() { printf '\n== %s\n' "$*" >&2; }

# Debian packages: busybox for the guest root filesystem of the pct stand-in, util-linux for
# unshare and script, prometheus for promtool. apt-get update only when something is missing.
_need=()
[ -x /bin/busybox ] || command -v busybox >/dev/null 2>&1 || _need+=(busybox-static)
command -v unshare >/dev/null 2>&1 || _need+=(util-linux)
command -v python3 >/dev/null 2>&1 || _need+=(python3 python3-venv)
# promtool (checks the alert rules and every metrics file the agent writes).
command -v promtool >/dev/null 2>&1 || _need+=(prometheus)
if [ ${#_need[@]} -gt 0 ]; then
  _step "apt-get install ${_need[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${_need[@]}"
fi

# fakepve, pinned, in a venv inside the repo's ignored files.
FAKEPVE_VERSION=0.5.0
_venv="$_root/.fakepve-venv"
if ! "$_venv/bin/python" -c "import fakepve, sys; sys.exit(0 if fakepve.__version__ == '$FAKEPVE_VERSION' else 1)" 2>/dev/null; then
  _step "fakepve $FAKEPVE_VERSION into $_venv"
  python3 -m venv "$_venv"
  "$_venv/bin/pip" install --quiet --no-cache-dir "fakepve[crypto]==$FAKEPVE_VERSION"
fi
export FELHOM_FAKEPVE_PYTHON="$_venv/bin/python"
source "$_root/tests/setup-package.sh"
