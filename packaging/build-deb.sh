#!/usr/bin/env bash
# Builds the Debian package of felhom-agent with dpkg-deb (metadata: [package.metadata.deb] in
# agent/Cargo.toml, assembled by packaging/assemble-deb.py). See packaging/README.md.
#
#   packaging/build-deb.sh [--out DIR]               release build: the package to ship
#   packaging/build-deb.sh --from-debug [--out DIR]  packages a debug build of the agent
#                                                    (without test hooks): quick, for checking
#                                                    the package's contents (tests/package.sh),
#                                                    not to ship
#
# Both generate the man page and the shell completions from the clap definitions
# (packaging/gen-docs) into <target>/release/felhom-docs/, where the assets expect
# them, then assemble the package (packaging/assemble-deb.py). Prints the path of the .deb on
# stdout. Needs python3, binutils (strip) and dpkg-dev (dpkg-shlibdeps computes the libc
# dependency); no cargo tool beyond the toolchain.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

from_debug=false
out="$root/target/debian"
while [ $# -gt 0 ]; do
  case "$1" in
    --from-debug) from_debug=true ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    --out=*) out=${1#--out=} ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "build-deb.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

target=${CARGO_TARGET_DIR:-$root/target}
mkdir -p "$out"

if $from_debug; then
  # A target folder of our own whose release/ holds the debug binary: the "target/release/"
  # asset paths resolve there, and the shared target folder keeps its real release
  # build (if any) untouched.
  # The agent alone, so the tests crate's `test-hooks` feature is not unified in: the package
  # never carries the test hooks. That build swaps a hook-free binary into target/debug; the
  # workspace build after it (tests/run.sh's command) swaps the test build back. Both builds
  # stay cached, so each swap is a copy.
  # A plain build at the root: the workspace's default-members leave the tests crate out.
  cargo build --locked -q --bin felhom-agent >&2
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage/release"
  cp "$target/debug/felhom-agent" "$stage/release/felhom-agent"
  cargo build --locked -q --workspace >&2
  docs=$stage/release/felhom-docs
  deb_target=$stage
  compress=(--fast)
else
  # A plain release build at the root, as an operator would run it: the workspace's
  # default-members leave the tests crate (and its test hooks) out; tests/package.sh checks
  # that the packaged binary carries no hook.
  cargo build --locked --release --bin felhom-agent >&2
  docs=$target/release/felhom-docs
  deb_target=$target
  compress=()
fi

cargo run --locked -q -p felhom-gen-docs -- "$docs" >/dev/null
# Debian policy wants man pages gzip -9, with no name and no time stamp in the header (so the
# bytes are reproducible).
gzip -9nf "$docs/felhom-agent.1"

meta=$(mktemp)
cargo metadata --locked --format-version 1 --no-deps >"$meta"
set +e
deb=$(python3 "$root/packaging/assemble-deb.py" --metadata "$meta" --target "$deb_target" \
  --out "$out" "${compress[@]}")
rc=$?
set -e
rm -f "$meta"
if [ "$rc" -ne 0 ] || [ ! -f "$deb" ]; then
  echo "build-deb.sh: assembling the package failed (exit $rc, got: $deb)" >&2
  exit 1
fi
printf '%s\n' "$deb"
