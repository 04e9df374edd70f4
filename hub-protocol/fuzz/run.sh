#!/usr/bin/env bash
# Runs the hub protocol decoder fuzz target on the stable toolchain with plain cargo and
# libfuzzer-sys (tests/fuzz.sh: the flags, the profile, the golden frames and the dictionary,
# where crashes go). New inputs go to fuzz/corpus/decode (ignored by git), crashes to
# fuzz/artifacts/decode.
#   hub-protocol/fuzz/run.sh [SECONDS]        (default 10)
set -euo pipefail
FELHOM_FUZZ_SECONDS=${1:-10} FELHOM_FUZZ_TARGETS=decode exec "$(dirname "$0")/../../tests/fuzz.sh"
