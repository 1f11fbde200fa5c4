#!/usr/bin/env bash
# Build the runtime-API test programs (tests/cuda/*.cu) with the PyPI nvcc (static cudart, compute_75 PTX only),
# and, with --run, run each through Gleam on the emu backend (no GPU): a `gleam serve --backend emu` on
# loopback and `gleam run --peer ... -- PROGRAM`. Each program checks its own results (exit 0 = pass).
#
#   bash scripts/ci/cuda-tests.sh                       # build only, into target/cuda-tests/
#   bash scripts/ci/cuda-tests.sh --run [GLEAM_BINARY]  # build, then run (default target/debug/gleam)
#
# Env: CUDA_TESTS_OUT (build folder), CUDA_TEST_TIMEOUT (seconds per program, default 120), GLEAM_LOG.
# Prints one line per program and a closing `N passed, N failed`; exits 1 if any failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUTDIR=${CUDA_TESTS_OUT:-$ROOT/target/cuda-tests}
TIMEOUT=${CUDA_TEST_TIMEOUT:-120}
mkdir -p "$OUTDIR"

nvcc=$(bash "$ROOT/scripts/ci/install-cuda-toolchain.sh" | tail -n 1) || {
    echo "cuda-tests: no CUDA toolchain (scripts/ci/install-cuda-toolchain.sh failed)" >&2
    exit 1
}
programs=()
for src in "$ROOT"/tests/cuda/*.cu; do
    name=$(basename "$src" .cu)
    if ! NVCC=$nvcc bash "$ROOT/scripts/ci/nvcc.sh" -O2 -o "$OUTDIR/$name" "$src" 2> "$OUTDIR/$name.build.log"; then
        echo "cuda-tests: $name did not build:" >&2
        cat "$OUTDIR/$name.build.log" >&2
        exit 1
    fi
    programs+=("$name")
done
echo "cuda-tests: built ${programs[*]} in $OUTDIR"
[ "${1:-}" = --run ] || exit 0

GLEAM=${2:-$ROOT/target/debug/gleam}
if [ ! -x "$GLEAM" ] || [ ! -f "$(dirname "$GLEAM")/libgleamcuda.so" ]; then
    echo "cuda-tests: $GLEAM (with libgleamcuda.so beside it) is missing: cargo build -p gleam -p gleam-shim" >&2
    exit 1
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gleam-cuda-tests.XXXXXX")
server=""
cleanup() {
    [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

# The server gets a clean environment: it must never load the shim as its own libcuda.
env -i PATH="$PATH" HOME="$HOME" GLEAM_LOG="${GLEAM_LOG:-warn}" \
    "$GLEAM" serve 127.0.0.1:0 --backend emu --config-dir "$WORK/config" > "$WORK/serve.out" 2> "$WORK/serve.err" &
server=$!
peer=""
for _ in $(seq 1 300); do
    peer=$(sed -n 's/^gleam serve: listening on \([^ ]*\) as \([^ ]*\).*/\2@\1/p' "$WORK/serve.out" 2>/dev/null | head -n 1)
    [ -n "$peer" ] && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.1
done
if [ -z "$peer" ]; then
    echo "cuda-tests: gleam serve --backend emu did not start:" >&2
    cat "$WORK/serve.err" >&2
    exit 1
fi

passed=0
failed=0
for name in "${programs[@]}"; do
    timeout "$TIMEOUT" "$GLEAM" run --peer "$peer" --config-dir "$WORK/config" -- "$OUTDIR/$name" \
        > "$OUTDIR/$name.out" 2> "$OUTDIR/$name.err"
    rc=$?
    if [ "$rc" -eq 0 ] && grep -q "^PASS $name\$" "$OUTDIR/$name.out"; then
        passed=$((passed + 1))
        echo "cuda-tests: $name ok"
    else
        failed=$((failed + 1))
        echo "cuda-tests: $name FAILED (exit $rc)"
        sed 's/^/    /' "$OUTDIR/$name.out" | tail -n 15
        sed 's/^/    stderr: /' "$OUTDIR/$name.err" | tail -n 10
    fi
done
echo "cuda-tests: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
