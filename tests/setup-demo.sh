#!/usr/bin/env bash
# Installs what the demo (and the guest test bed) needs on a fresh Debian machine with the Rust
# toolchain, and nothing else: busybox-static for the guests' root filesystem, util-linux for
# unshare, python3 + python3-venv for fakepve, and fakepve itself (pinned, from PyPI) into
# .fakepve-venv/. Sourced by tests/demo.sh and tests/setup.sh; safe to run again (installs are
# skipped when present). Exports FELHOM_FAKEPVE_PYTHON: a python that already has this fakepve
# (FELHOM_FAKEPVE_PYTHON set by the caller) is kept.
set -euo pipefail
_demo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

_demo_step() { printf '\n== %s\n' "$*" >&2; }

_demo_need=()
[ -x /bin/busybox ] || command -v busybox >/dev/null 2>&1 || _demo_need+=(busybox-static)
command -v unshare >/dev/null 2>&1 || _demo_need+=(util-linux)
command -v python3 >/dev/null 2>&1 || _demo_need+=(python3)
python3 -c 'import ensurepip' >/dev/null 2>&1 || _demo_need+=(python3-venv)
if [ ${#_demo_need[@]} -gt 0 ]; then
  _demo_step "apt-get install ${_demo_need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${_demo_need[@]}"
fi

FAKEPVE_VERSION=0.5.0
_fakepve_ok() {
  "$1" -c "import fakepve, sys; sys.exit(0 if fakepve.__version__ == '$FAKEPVE_VERSION' else 1)" 2>/dev/null
}
if [ -n "${FELHOM_FAKEPVE_PYTHON:-}" ] && _fakepve_ok "$FELHOM_FAKEPVE_PYTHON"; then
  :
else
  _venv="$_demo_root/.fakepve-venv"
  if ! _fakepve_ok "$_venv/bin/python"; then
    _demo_step "fakepve $FAKEPVE_VERSION into $_venv"
    python3 -m venv "$_venv"
    "$_venv/bin/pip" install --quiet --no-cache-dir "fakepve[crypto]==$FAKEPVE_VERSION"
  fi
  FELHOM_FAKEPVE_PYTHON="$_venv/bin/python"
fi
export FELHOM_FAKEPVE_PYTHON
