#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh machine (tests/setup.sh), then
# runs the format check, clippy and the whole test suite, and finally checks that no test
# printed the test token secret.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# No incremental compilation: a run builds everything once, and the incremental caches took
# 1.9 GB of a fresh clone's 5.6 GB target/debug for nothing (a linker that ran out of disk
# died of SIGBUS mid-build in one CI run). Set CARGO_INCREMENTAL=1 to keep them.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
# Each step's wall time, printed at the end of the run (also when a step fails).
step_names=()
step_secs=()
step_started=$SECONDS
step_current=""
step() {
  step_end
  step_current=$*
  step_started=$SECONDS
  printf '\n== %s\n' "$*" >&2
}
step_end() {
  if [ -n "$step_current" ]; then
    step_names+=("$step_current")
    step_secs+=($((SECONDS - step_started)))
  fi
  step_current=""
}
cleanup=()
roots_pid=""
print_times() {
  local rc=$1
  # A run that ends early stops the roots' build it started (each root is renamed into place
  # whole, so nothing half made is kept).
  [ -z "$roots_pid" ] || kill -- "-$roots_pid" 2>/dev/null || true
  [ ${#cleanup[@]} -eq 0 ] || rm -rf "${cleanup[@]}"
  step_end
  printf '\n== step times (%s, %s cores, load %s)\n' "$([ "$rc" -eq 0 ] && echo ok || echo "failed, exit $rc")" \
    "$(nproc)" "$(cut -d' ' -f1-3 /proc/loadavg)" >&2
  local i
  for i in "${!step_names[@]}"; do
    printf '%6d s  %s\n' "${step_secs[$i]}" "${step_names[$i]}" >&2
  done
  printf '%6d s  total\n' "$SECONDS" >&2
}
trap 'print_times $?' EXIT

step "setup (tests/setup.sh)"
source tests/setup.sh

# The roots the tests boot, built beside the checks and builds below and waited for before the
# tests (cached under target/; a fresh clone builds them, mostly downloads, dpkg and disk): the
# real guests' Debian root filesystems, one per release the bed runs (Debian 11, 12 and 13),
# ifupdown2 in place of ifupdown and NetworkManager beside ifupdown, on each release
# (tests/testbed/build-debian-rootfs.sh), and the Debian root
# with systemd that the package's units run under (tests/testbed/build-systemd-root.sh, else
# built by the first test that needs it), and the disk, kernel and initramfs of the real VMs
# (tests/testbed/build-debian-vm.sh; first: the longest). Two are built at a time: one's downloads and disk
# waits leave the CPU to the other. mmdebstrap makes each root in a scratch folder under TMPDIR
# (thousands of files, removed after): on /dev/shm when that is a tmpfs fit for it, as the guest
# bed's scratch files are (tests/src/lib.rs `memory_scratch_base`).
roots_log=$(mktemp -d)
cleanup+=("$roots_log")
roots_tmp=${TMPDIR:-/tmp}
if awk '$5 == "/dev/shm" {
    fit = 1; n = split($6, o, ",")
    for (i = 1; i <= n; i++) if (o[i] == "nodev" || o[i] == "noexec" || o[i] == "ro") fit = 0
    for (i = 7; i < NF; i++) if ($i == "-") { if ($(i + 1) != "tmpfs") fit = 0; break }
  } END { exit !fit }' /proc/self/mountinfo; then
  roots_tmp=/dev/shm
fi
printf '\n== the roots the tests boot: built beside the steps below, two at a time\n' >&2
build_root() {
  case $1 in
    systemd) tests/testbed/build-systemd-root.sh ;;
    vm) tests/testbed/build-debian-vm.sh ;;
    *) tests/testbed/build-debian-rootfs.sh "" "$1" ;;
  esac >"$2/$1.log" 2>&1 || { echo "$1" >>"$2/failed"; return 1; }
}
export -f build_root
# Its own process group (setsid), so that a run ending early stops the whole build.
printf '%s\n' vm bookworm-ifupdown2 bookworm bullseye trixie bookworm-nm bullseye-nm trixie-nm bullseye-ifupdown2 trixie-ifupdown2 systemd |
  TMPDIR=$roots_tmp setsid nice -n 5 xargs -P 2 -I'{}' bash -c 'build_root "$1" "$2"' _ '{}' "$roots_log" &
roots_pid=$!

step "cargo fmt --check"
cargo fmt --all -- --check

# Clippy's lints run in the build itself: clippy-driver compiles the workspace's crates as rustc
# does, with its lints (-D warnings), as `cargo clippy` runs it, so the dependencies are compiled
# once instead of once checked for clippy and once built (a separate `cargo clippy` step took
# 135-175 s of a fresh clone's run). Every cargo command below runs under it (the fuzz targets'
# build aside): one without it would compile the workspace again.
clippy_driver=$(dirname "$(rustup which cargo 2>/dev/null || command -v cargo)")/clippy-driver
[ -x "$clippy_driver" ] || clippy_driver=$(command -v clippy-driver || true)
[ -n "$clippy_driver" ] || { echo "clippy-driver not found beside cargo: install clippy (rustup component add clippy)" >&2; exit 1; }
export RUSTC_WORKSPACE_WRAPPER=$clippy_driver
export CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__

# Everything is built here, before the package and the wait for the roots: the agent as
# packaged (a plain build at the root: without the test hooks), then every target of the
# workspace (the binary the tests run, the tests, the benches), so that the package step only
# packages (its builds are cached: each is a copy) and the test step's time is the tests' own.
step "cargo build with clippy's lints, -D warnings (the agent as packaged, every target of the workspace)"
cargo build --locked --bin felhom-agent
cargo build --workspace --all-targets --locked
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --config-file tests/nextest.toml --no-run
else
  cargo test --workspace --locked --lib --bins --tests --no-run
fi
export FELHOM_AGENT_BIN="$here/target/debug/felhom-agent"

step "Debian package: build and check (tests/package.sh)"
# The package it builds is kept for the tests that install it under a real systemd
# (tests/tests/package_systemd.rs reads FELHOM_TEST_DEB).
rm -rf "$here/target/debian-test"
FELHOM_PACKAGE_OUT="$here/target/debian-test" tests/package.sh
debs=("$here"/target/debian-test/felhom-agent_*.deb)
[ ${#debs[@]} -eq 1 ] && [ -f "${debs[0]}" ] || { echo "tests/package.sh left no single package in target/debian-test" >&2; exit 1; }
export FELHOM_TEST_DEB=${debs[0]}
# The tests under a real systemd (systemd-nspawn) fail, rather than report and skip, where
# systemd cannot boot here: this command must run them.
export FELHOM_REQUIRE_REAL_SYSTEMD=1

# The fuzz targets' build (their own target folder, sanitizer flags: nothing to share with the
# builds above) goes on beside the test run, at the lowest CPU priority: the end-to-end tests
# spend much of their time waiting for the fake's tasks and the guests, and the build takes
# that time instead of its own step. FELHOM_CI_SERIAL=1 builds them in the fuzz step instead.
fuzz_log=$(mktemp)
cleanup+=("$fuzz_log")
fuzz_pid=""
if [ "${FELHOM_CI_SERIAL:-0}" != 1 ]; then
  printf '\n== fuzz targets: build beside the test run (nice 19; output at the fuzz step)\n' >&2
  # Its own process group (setsid), so a failed test run stops the whole build. A session of
  # its own is also an autogroup of its own, which the kernel weighs like the whole test run's
  # (a process's nice counts only inside its autogroup): without the autogroup's own nice 19
  # the build (about 200 s of processor time, measured alone) got as large a share as all the
  # tests together; with it, it takes what the tests leave.
  setsid sh -c 'echo 19 >/proc/self/autogroup 2>/dev/null || true; exec nice -n 19 "$@"' fuzz-build \
    env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS tests/fuzz.sh build >"$fuzz_log" 2>&1 &
  fuzz_pid=$!
fi

step "the roots the tests boot (wait for their build)"
roots_status=0
wait "$roots_pid" || roots_status=$?
roots_pid=""
if [ "$roots_status" -ne 0 ]; then
  for failed in $(cat "$roots_log/failed" 2>/dev/null); do
    cat "$roots_log/$failed.log" >&2
    echo "building the root $failed failed (above)" >&2
  done
  exit 1
fi

# The tests: cargo-nextest (it comes with the machine's toolchain) runs each test in its own
# process and several at once (tests/nextest.toml); without it, `cargo test` runs them one test
# binary after the other. The doc tests run with `cargo test --doc` (nextest does not run them).
log=$(mktemp)
reports=$(mktemp)
cleanup+=("$log" "$reports")
export FELHOM_TEST_REPORTS=$reports
# The tests that ask for real guests (LXC containers running Debian) fail when this machine
# cannot run them, instead of falling back to the busybox bed.
export FELHOM_REQUIRE_REAL_GUESTS=${FELHOM_REQUIRE_REAL_GUESTS:-1}
# One process imports the fake PVE's Python once and forks each test's fake from it
# (tests/fakepve/zygote.py): a fake started from scratch costs about 0.4 s of processor time in
# imports, and most tests start one. (A plain `cargo nextest run` without it starts each fake
# from scratch.)
zygote_dir=$(mktemp -d)
cleanup+=("$zygote_dir")
zygote_pid=""
exec {zygote_out}< <(exec "$FELHOM_FAKEPVE_PYTHON" tests/fakepve/zygote.py "$zygote_dir/sock" 2>"$zygote_dir/log")
zygote_pid=$!
if read -r -t 30 -u "$zygote_out" zygote_ready && [ "$zygote_ready" = ready ]; then
  export FELHOM_FAKEPVE_ZYGOTE="$zygote_dir/sock"
else
  cat "$zygote_dir/log" >&2
  echo "tests/fakepve/zygote.py did not start (its output above)" >&2
  exit 1
fi
trap 'rc=$?; [ -z "$zygote_pid" ] || kill "$zygote_pid" 2>/dev/null || true; print_times $rc' EXIT
junit=""
set +e
if cargo nextest --version >/dev/null 2>&1; then
  step "cargo nextest run (tests/nextest.toml)"
  junit="$here/target/nextest/default/junit.xml"
  rm -f "$junit"
  cargo nextest run --workspace --locked --config-file tests/nextest.toml 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
else
  step "cargo test (cargo-nextest is not installed)"
  cargo test --workspace --locked --lib --bins --tests 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
fi
if [ "$status" -eq 0 ]; then
  step "cargo test --doc"
  cargo test --workspace --locked --doc 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
fi
set -e
if [ -s "$reports" ]; then
  printf '\n== figures the tests measured\n' >&2
  grep -v -e '^real guests: ' -e '^real systemd: ' "$reports" >&2 || true
fi
real_count=$(grep -c '^real guests: [a-z_0-9:]*$' "$reports" || true)
printf '\n== %s tests ran on real guests (LXC containers running Debian with systemd)\n' "$real_count" >&2
if [ "$status" -eq 0 ] && [ "$real_count" -eq 0 ] && [ "$FELHOM_REQUIRE_REAL_GUESTS" = 1 ]; then
  echo "no test ran on real guests: the real bed is missing from this run" >&2
  status=1
fi
printf '\n== tests under a real systemd 252 (systemd-nspawn): %s ran, %s not run\n' \
  "$(grep -c '^real systemd: ran ' "$reports" || true)" "$(grep -c '^real systemd: .* NOT RUN: ' "$reports" || true)" >&2
if [ "$status" -ne 0 ]; then
  [ -z "$fuzz_pid" ] || kill -- "-$fuzz_pid" 2>/dev/null || true
  exit "$status"
fi

step "fuzz targets: build and run briefly (tests/fuzz.sh)"
if [ -n "$fuzz_pid" ]; then
  set +e
  wait "$fuzz_pid"
  fuzz_status=$?
  set -e
  grep -v '^ *\(Compiling\|Downloaded\|Downloading\|Updating\)' "$fuzz_log" >&2 || true
  [ "$fuzz_status" -eq 0 ] || { echo "building the fuzz targets failed (above)" >&2; exit 1; }
  env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS tests/fuzz.sh run
else
  env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS tests/fuzz.sh
fi

step "no secret in the test output"
# The token secrets of the test scenarios must never be printed by the agent or a test.
# (tests/tests/secrets_at_trace.rs runs the agent at FELHOM_AGENT_LOG=trace for the same.)
# With nextest, a passing test's output is in the JUnit report (target/nextest/default/junit.xml),
# not the console log: both are searched.
scanned=("$log")
[ -z "$junit" ] || scanned+=("$junit")
[ -z "$junit" ] || [ -s "$junit" ] || { echo "nextest wrote no JUnit report at $junit" >&2; exit 1; }
if grep -q -e '11111111-2222-4333-8444-555555555555' -e '99999999-2222-4333-8444-555555555555' \
  -e 'devhub-test-token-3f6b1c2e' "${scanned[@]}"; then
  echo "a test token secret or hub token appears in the test output (${scanned[*]})" >&2
  exit 1
fi
echo "ok: no test token secret in $(cat "${scanned[@]}" | wc -l) lines of test output"
