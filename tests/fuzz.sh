#!/usr/bin/env bash
# Builds every fuzz target and runs each one briefly: the parsers of /etc/pve/.vmlist,
# `pct list` and `qm list`, the vmid policy and the exec helper's request decoder (what an
# unprivileged caller sends the root helper) in agent/fuzz; the hub protocol's frame decoder in
# hub-protocol/fuzz.
#
# The targets are libfuzzer-sys binaries built with plain cargo (no cargo-fuzz to compile on a
# fresh machine), with the instrumentation cargo-fuzz gives them: sanitizer coverage (inline
# 8-bit counters, PC table, compare tracing, stack depth), AddressSanitizer, debug assertions
# and `--cfg fuzzing`. What differs is the profile: cargo's dev profile without debug info
# (opt-level 0, parallel codegen) instead of an optimised release build with one codegen unit,
# which takes several times longer to compile and only makes each run faster; every seed and
# corpus input still runs, then libFuzzer mutates for the time given. Both fuzz workspaces
# share one target folder (target/fuzz), so the dependencies they share compile once.
# -Zsanitizer is nightly-only: RUSTC_BOOTSTRAP=1 lets the stable compiler accept it; its
# AddressSanitizer runtime ships with the standard library. `--target` keeps the flags off
# build scripts and proc macros, as cargo-fuzz does.
#
#   tests/fuzz.sh          build, then run every target
#   tests/fuzz.sh build    only build them (tests/run.sh builds them beside the test run)
#   tests/fuzz.sh run      only run them (built before)
#
# Environment:
#   FELHOM_FUZZ_SECONDS  seconds per target (default 10; as many targets run at once as there
#                        are cores)
#   FELHOM_FUZZ_CORPUS   where each target's growing corpus lives (default agent/fuzz/corpus;
#                        the hub decoder's: hub-protocol/fuzz/corpus)
#   FELHOM_FUZZ_TARGETS  run only these targets (names, space-separated; default all)
# A crash leaves its input in <fuzz folder>/artifacts/<target>/ and makes this script fail.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
seconds=${FELHOM_FUZZ_SECONDS:-10}
corpus_root=${FELHOM_FUZZ_CORPUS:-$here/agent/fuzz/corpus}

step() { printf '\n== %s\n' "$*" >&2; }

phase=${1:-all}
case "$phase" in
  all|build|run) ;;
  *) echo "fuzz.sh: unknown argument $phase (build, run or nothing)" >&2; exit 2 ;;
esac

triple=$(rustc -vV | sed -n 's/^host: //p')
export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR="$here/target/fuzz"
export CARGO_PROFILE_DEV_DEBUG=false
export CARGO_PROFILE_DEV_OPT_LEVEL=0
export CARGO_PROFILE_DEV_DEBUG_ASSERTIONS=true
export CARGO_PROFILE_DEV_OVERFLOW_CHECKS=true
export CARGO_PROFILE_DEV_INCREMENTAL=false
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cllvm-args=-sanitizer-coverage-stack-depth \
--cfg fuzzing -Zsanitizer=address -Cdebug-assertions -Cforce-frame-pointers"
bin_dir=$CARGO_TARGET_DIR/$triple/debug

# The fuzz targets of a fuzz crate: its [[bin]] names.
targets_of() {
  cargo metadata --format-version 1 --no-deps --manifest-path "$1" |
    python3 -c 'import json,sys
for p in json.load(sys.stdin)["packages"]:
    for t in p["targets"]:
        if "bin" in t["kind"]: print(t["name"])'
}

if [ "$phase" != run ]; then
  step "build the fuzz targets (agent/fuzz, hub-protocol/fuzz)"
  started=$SECONDS
  cargo build --manifest-path "$here/agent/fuzz/Cargo.toml" --target "$triple" --bins
  cargo build --manifest-path "$here/hub-protocol/fuzz/Cargo.toml" --target "$triple" --bins
  echo "built in $((SECONDS - started)) s" >&2
fi
[ "$phase" != build ] || exit 0

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
failed=0
# Targets run side by side, as many as the machine has cores (each libFuzzer run is one process).
at_once=$(nproc)
names=()
pids=()
# run NAME FUZZ_DIR CORPUS [SEED_DIR...] [-- LIBFUZZER_ARGS...]: start the target in the
# background (waiting first while `at_once` targets run).
run() {
  local name=$1 fuzz_dir=$2 corpus=$3
  shift 3
  local inputs=() extra=()
  if [ -n "${FELHOM_FUZZ_TARGETS:-}" ] && ! grep -qw -- "$name" <<<"$FELHOM_FUZZ_TARGETS"; then
    return 0
  fi
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    [ -d "$1" ] && inputs+=("$1")
    shift
  done
  [ $# -gt 0 ] && shift && extra=("$@")
  while [ "$(jobs -rp | wc -l)" -ge "$at_once" ]; do wait -n || true; done
  step "fuzz $name (${seconds}s)"
  mkdir -p "$corpus" "$fuzz_dir/artifacts/$name"
  "$bin_dir/$name" -artifact_prefix="$fuzz_dir/artifacts/$name/" \
    -max_total_time="$seconds" "${extra[@]}" "$corpus" "${inputs[@]}" \
    >"$logs/$name.log" 2>&1 &
  names+=("$name")
  pids+=($!)
}

for target in $(targets_of "$here/agent/fuzz/Cargo.toml"); do
  run "$target" "$here/agent/fuzz" "$corpus_root/$target" "$here/agent/fuzz/seeds/$target"
done
hp=$here/hub-protocol
run decode "$hp/fuzz" "$hp/fuzz/corpus/decode" "$hp/tests/golden" -- \
  -dict="$hp/fuzz/decode.dict" -max_len=65536

# Each target's end, in the order they were started.
for i in "${!pids[@]}"; do
  name=${names[$i]}
  if wait "${pids[$i]}"; then
    printf '%s: ' "$name" >&2
    grep -E '^Done [0-9]+ runs|INITED' "$logs/$name.log" | tail -n 2 | tr '\n' ' ' >&2 || true
    echo >&2
  else
    failed=1
    echo "fuzz target $name failed; its output ends with:" >&2
    tail -n 40 "$logs/$name.log" >&2
  fi
done
exit "$failed"
