#!/usr/bin/env bash
# Runs the hub protocol decoder fuzz target on the stable toolchain.
#   hub-protocol/fuzz/run.sh [SECONDS]        (default 10)
# Needs cargo-fuzz (`cargo install cargo-fuzz`). RUSTC_BOOTSTRAP=1 lets stable rustc accept
# the nightly-only flags cargo-fuzz passes (-Zsanitizer=address and friends). The golden frames
# seed the corpus; new inputs go to fuzz/corpus/decode (ignored by git), crashes to
# fuzz/artifacts/decode.
set -euo pipefail
seconds=${1:-10}
cd "$(dirname "$0")/.."
mkdir -p fuzz/corpus/decode
RUSTC_BOOTSTRAP=1 exec cargo fuzz run decode fuzz/corpus/decode tests/golden -- \
  -max_total_time="$seconds" -dict=fuzz/decode.dict -max_len=65536
