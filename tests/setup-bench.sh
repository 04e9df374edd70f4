#!/usr/bin/env bash
# Installs what the benchmarks need beyond the tests (tests/setup.sh): proxmoxer, the yardstick
# of the provision benchmark (tests/benches/proxmoxer_provision.py), into the fakepve venv.
# Sourced or run; safe to run again. Exports FELHOM_FAKEPVE_PYTHON.
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$_root/tests/setup-demo.sh"
if ! "$FELHOM_FAKEPVE_PYTHON" -c 'import proxmoxer' 2>/dev/null; then
  printf '\n== pip install proxmoxer (into %s)\n' "$(dirname "$FELHOM_FAKEPVE_PYTHON")" >&2
  "$FELHOM_FAKEPVE_PYTHON" -m pip install --quiet 'proxmoxer==2.3.0' 'requests>=2.31,<3'
fi
