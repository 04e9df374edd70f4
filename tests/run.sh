#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh machine, then runs the format
# check, clippy and the whole test suite. Safe to run again; installs are skipped when present.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

step() { printf '\n== %s\n' "$*" >&2; }

# Debian packages the test bed uses (busybox for the guest root filesystem, util-linux for
# unshare). apt-get update only when something is missing.
need_pkgs=()
command -v busybox >/dev/null 2>&1 || [ -x /bin/busybox ] || need_pkgs+=(busybox-static)
command -v unshare >/dev/null 2>&1 || need_pkgs+=(util-linux)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  step "apt-get install ${need_pkgs[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}"
fi

# fakepve, pinned, in a venv inside the repo's ignored files.
FAKEPVE_VERSION=0.5.0
venv="$here/.fakepve-venv"
if ! "$venv/bin/python" -c "import fakepve, sys; sys.exit(0 if fakepve.__version__ == '$FAKEPVE_VERSION' else 1)" 2>/dev/null; then
  step "fakepve $FAKEPVE_VERSION into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --no-cache-dir "fakepve[crypto]==$FAKEPVE_VERSION"
fi
export FELHOM_FAKEPVE_PYTHON="$venv/bin/python"

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo build (the binary the end-to-end tests run)"
cargo build --workspace --locked
export FELHOM_AGENT_BIN="$here/target/debug/felhom-agent"

step "cargo test"
cargo test --workspace --locked
