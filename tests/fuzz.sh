#!/usr/bin/env bash
# Builds every cargo-fuzz target in agent/fuzz and runs each one briefly: the parsers of
# /etc/pve/.vmlist, `pct list` and `qm list`, the vmid policy and the exec helper's request
# decoder (what an unprivileged caller sends the root helper); then the hub protocol's
# frame decoder (hub-protocol/fuzz).
#
# cargo-fuzz passes nightly-only flags to rustc (-Zsanitizer=address and the sanitizer-coverage
# options). Only the stable toolchain is on these machines, so RUSTC_BOOTSTRAP=1 lets the stable
# compiler accept them; its AddressSanitizer runtime ships with the standard library.
#
# Environment:
#   FELHOM_FUZZ_SECONDS  seconds per target (default 10)
#   FELHOM_FUZZ_CORPUS   where each target's growing corpus lives (default agent/fuzz/corpus)
# A crash leaves its input in agent/fuzz/artifacts/<target>/ and makes this script fail.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
seconds=${FELHOM_FUZZ_SECONDS:-10}
corpus_root=${FELHOM_FUZZ_CORPUS:-$here/agent/fuzz/corpus}
CARGO_FUZZ_VERSION=0.13.2

step() { printf '\n== %s\n' "$*" >&2; }

if ! cargo fuzz --version 2>/dev/null | grep -q " $CARGO_FUZZ_VERSION\$"; then
  step "cargo install cargo-fuzz $CARGO_FUZZ_VERSION"
  cargo install --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi

export RUSTC_BOOTSTRAP=1
cd "$here/agent"

step "cargo fuzz build"
cargo fuzz build

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
failed=0
for target in $(cargo fuzz list); do
  step "cargo fuzz run $target (${seconds}s)"
  mkdir -p "$corpus_root/$target"
  seeds=()
  [ -d "fuzz/seeds/$target" ] && seeds=("fuzz/seeds/$target")
  if cargo fuzz run "$target" "$corpus_root/$target" "${seeds[@]}" -- \
      -max_total_time="$seconds" >"$logs/$target.log" 2>&1; then
    grep -E '^Done [0-9]+ runs' "$logs/$target.log" >&2 || true
  else
    failed=1
    echo "fuzz target $target failed; its output ends with:" >&2
    tail -n 40 "$logs/$target.log" >&2
  fi
done

step "hub-protocol: cargo fuzz run decode (${seconds}s)"
if ! "$here/hub-protocol/fuzz/run.sh" "$seconds" >"$logs/hub-decode.log" 2>&1; then
  failed=1
  echo "fuzz target hub-protocol/decode failed; its output ends with:" >&2
  tail -n 40 "$logs/hub-decode.log" >&2
else
  grep -E '^Done [0-9]+ runs' "$logs/hub-decode.log" >&2 || true
fi
exit "$failed"
