#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer) of every target in fuzz/: the guest
# channel's framing and messages, the host's session rules, both configuration loaders.
# Usage: scripts/fuzz.sh SECONDS_PER_TARGET [TARGET...]. Runs from the committed corpus
# (fuzz/corpus/<target>/, grown in place: commit what a long run adds after
# `cargo fuzz cmin`), fails on the first crash, and prints each target's executions.
# FUZZ_SCRATCH=1 (`make fuzz-smoke`, CI) writes new inputs to a scratch directory and
# reads the committed corpus only, so that a smoke run leaves the work tree clean.
# Debug assertions are on (integer overflow panics); no sanitizer: the code under test
# is safe Rust, and libFuzzer's coverage instrumentation builds on the stable toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(frame session guest_config agent_config)

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz"
    cargo install cargo-fuzz --locked --version 0.13.2
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t"
    # libFuzzer writes what it finds to the first corpus directory and reads the others.
    corpora=("fuzz/corpus/$t")
    if [ "${FUZZ_SCRATCH:-0}" = 1 ]; then
        mkdir -p "$scratch/$t"
        corpora=("$scratch/$t" "fuzz/corpus/$t")
    fi
    log=$(mktemp)
    echo "fuzz: $t for ${secs}s"
    # Stable rustc: cargo-fuzz passes one unstable flag even without a sanitizer.
    if ! RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer none --debug-assertions "$t" \
        "${corpora[@]}" -- -max_total_time="$secs" -print_final_stats=1 >"$log" 2>&1; then
        tail -40 "$log"
        echo "fuzz: $t FAILED (crash input under fuzz/artifacts/$t/)"
        exit 1
    fi
    execs=$(awk '/stat::number_of_executed_units/ { print $2 }' "$log")
    echo "fuzz: $t ok: ${execs:-?} executions in ${secs}s, no crash"
    rm -f "$log"
done
