#!/usr/bin/env bash
# The unit tests of cudarc 0.19.10 (a widely used Rust CUDA crate), run through Gleam on the emu backend:
# no GPU, NVIDIA's runtime compiler from PyPI (it runs on the CPU), every test in its own process through
# `gleam run --peer ... -- <test binary> <test> --exact`.
#
#   bash scripts/ci/cudarc-suite.sh [GLEAM_BINARY]     # default target/debug/gleam (libgleamcuda.so beside it)
#
# Steps: cargo fetches cudarc's source from crates.io (a throwaway crate depending on `cudarc = "=0.19.10"`),
# copies it out of the registry and builds its test binary with `--features std,driver,nvrtc,f16,
# dynamic-loading,cuda-13000`; pip installs `nvidia-cuda-nvrtc==13.0.*` into the build folder; a
# `gleam serve --backend emu` listens on loopback; then each test runs alone (the two that cudarc marks
# "must be executed by itself" included, since each runs in its own process anyway).
#
# Prints one line per test (`ok`, `FAILED`, or `skipped` with the reason for those listed below: they need
# two GPUs, PCIe timings or a GPU's throughput, or fail without Gleam too) and a summary with the suite's
# wall time. Exits 1 if any other test failed, or if a test listed in EXPECTED_FAIL (what Gleam does not
# implement yet, each named with the reason) passed: it then belongs to the suite, so take it off the list.
# CI (.ci/run) runs it after the test suite, with the same build.
#
# Env: CUDARC_SUITE_OUT (build folder, default target/cudarc-suite), CUDARC_TEST_TIMEOUT (seconds per test,
# default 120), CUDARC_FILTER (run only tests whose name contains it), CUDARC_INCLUDE_SLOW=1 (also the
# tests that need a GPU's throughput), CUDARC_BUILD_ONLY=1 (build, print the test binary's path, stop),
# GLEAM_EMU_KERNEL_TIMEOUT (passed to the server), GLEAM_LOG.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUTDIR=${CUDARC_SUITE_OUT:-$ROOT/target/cudarc-suite}
TIMEOUT=${CUDARC_TEST_TIMEOUT:-120}
FILTER=${CUDARC_FILTER:-}
VERSION=0.19.10
FEATURES=${CUDARC_FEATURES:-std,driver,nvrtc,f16,dynamic-loading,cuda-13000}
GLEAM=${1:-$ROOT/target/debug/gleam}
mkdir -p "$OUTDIR"
started=$(date +%s)

# Tests that cannot pass here, each with the reason; every other test must pass on the emu backend.
declare -A NEEDS_GPU=(
    [driver::result::tests::peer_transfer_contexts]="needs two GPUs (cudarc: must be executed with multiple gpus)"
    [driver::result::tests::re_associate_context_for_memory_op]="needs two GPUs (cudarc: must be executed with multiple gpus)"
    [driver::safe::launch::tests::test_peer_memcpy_waits_for_src_stream]="needs two GPUs (cudarc: must be executed with multiple gpus)"
    [driver::safe::core::tests::test_pinned_copy_is_faster]="times pinned against pageable copies over PCIe; across a network both travel the same way"
    [driver::safe::core::tests::test_default_pinned_host_reads_are_faster_than_write_combined]="times CPU reads of write-combined memory, which only a PCIe mapping makes slow"
)
# Tests whose kernels need a GPU's throughput: 1024 threads x 1M loop trips (12 G thread-instructions) per
# launch, two to four launches each, over a minute per launch in the interpreter. Run them with
# CUDARC_INCLUDE_SLOW=1 (the emu's kernel watchdog is then turned off).
declare -A TOO_SLOW=(
    [driver::safe::launch::tests::test_par_launch]="4 launches of the slow_worker kernel (12 G thread-instructions each)"
    [driver::safe::launch::tests::test_multi_stream_concurrent_reads]="2 launches of slow_worker"
    [driver::safe::launch::tests::test_multi_stream_writes_block]="2 launches of slow_worker"
)
# Tests that fail without Gleam too, against CUDA 13.0.
declare -A UPSTREAM=(
    [driver::safe::launch::tests::test_launch_with_half]="compiles for compute_53, which NVRTC 13 no longer accepts (and includes cuda_fp16.h from /usr/include)"
)
# Tests that fail through Gleam today, each named with what is missing. Nothing else may fail; each leaves
# this list in the change that makes it pass (the run fails while a listed test passes).
declare -A EXPECTED_FAIL=(
)
if [ "${CUDARC_INCLUDE_SLOW:-0}" = 1 ]; then
    TOO_SLOW=()
    GLEAM_EMU_KERNEL_TIMEOUT=0
    TIMEOUT=${CUDARC_TEST_TIMEOUT:-1800}
fi

# 1. cudarc's source, as crates.io publishes it.
fetch="$OUTDIR/fetch"
mkdir -p "$fetch/src"
cat > "$fetch/Cargo.toml" <<EOF
[package]
name = "cudarc-suite-fetch"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
cudarc = { version = "=$VERSION", default-features = false }

[workspace]
EOF
echo 'fn main() {}' > "$fetch/src/main.rs"
manifest=$(cd "$fetch" && cargo metadata --format-version 1 2>"$OUTDIR/fetch.log" |
    python3 -c 'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"))') || {
    echo "cudarc-suite: cannot fetch cudarc $VERSION from crates.io:" >&2
    cat "$OUTDIR/fetch.log" >&2
    exit 1
}
src="$OUTDIR/cudarc-$VERSION"
rm -rf "$src"
cp -r "$(dirname "$manifest")" "$src"
chmod -R u+w "$src"
# Its own workspace, whatever folder it is built in.
printf '\n[workspace]\n' >> "$src/Cargo.toml"

# 2. Its test binary.
echo "cudarc-suite: building cudarc $VERSION's tests (features $FEATURES)"
bin=$(cd "$src" && CARGO_TARGET_DIR="$OUTDIR/target" cargo test --lib --no-run --no-default-features \
    --features "$FEATURES" --message-format json 2>"$OUTDIR/build.log" |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])
' | tail -n 1)
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    echo "cudarc-suite: cudarc's tests did not build:" >&2
    tail -n 40 "$OUTDIR/build.log" >&2
    exit 1
fi

if [ "${CUDARC_BUILD_ONLY:-0}" = 1 ]; then
    echo "$bin"
    exit 0
fi

if [ ! -x "$GLEAM" ] || [ ! -f "$(dirname "$GLEAM")/libgleamcuda.so" ]; then
    echo "cudarc-suite: $GLEAM (with libgleamcuda.so beside it) is missing: cargo build -p gleam -p gleam-shim" >&2
    exit 1
fi

# 3. NVIDIA's runtime compiler (a CPU library) from PyPI.
nvrtc="$OUTDIR/nvrtc"
if ! ls "$nvrtc"/nvidia/*/lib/libnvrtc.so.13 >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$nvrtc" 'nvidia-cuda-nvrtc==13.0.*' \
        > "$OUTDIR/pip.log" 2>&1 || {
        echo "cudarc-suite: pip could not install nvidia-cuda-nvrtc==13.0.*:" >&2
        tail -n 20 "$OUTDIR/pip.log" >&2
        exit 1
    }
fi
nvrtc_lib=$(dirname "$(ls "$nvrtc"/nvidia/*/lib/libnvrtc.so.13 | head -n 1)")

# 4. A GPU-less peer on loopback, with a clean environment (it must never load the shim as its libcuda).
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gleam-cudarc.XXXXXX")
server=""
cleanup() {
    [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
env -i PATH="$PATH" HOME="$HOME" GLEAM_LOG="${GLEAM_LOG:-warn}" \
    ${GLEAM_EMU_KERNEL_TIMEOUT:+GLEAM_EMU_KERNEL_TIMEOUT=$GLEAM_EMU_KERNEL_TIMEOUT} \
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
    echo "cudarc-suite: gleam serve --backend emu did not start:" >&2
    cat "$WORK/serve.err" >&2
    exit 1
fi

# 5. Every test, alone.
mapfile -t tests < <("$bin" --list --include-ignored 2>/dev/null | sed -n 's/: test$//p' | sort)
logs="$OUTDIR/logs"
rm -rf "$logs"
mkdir -p "$logs"
passed=0
failed=0
skipped=0
expected=0
failures=()
unexpected_passes=()
for t in "${tests[@]}"; do
    [ -n "$FILTER" ] && [[ "$t" != *"$FILTER"* ]] && continue
    why=""
    [ -n "${NEEDS_GPU[$t]:-}" ] && why="needs a GPU: ${NEEDS_GPU[$t]}"
    [ -n "${TOO_SLOW[$t]:-}" ] && why="needs a GPU's throughput: ${TOO_SLOW[$t]}"
    [ -n "${UPSTREAM[$t]:-}" ] && why="fails without Gleam too: ${UPSTREAM[$t]}"
    if [ -n "$why" ]; then
        skipped=$((skipped + 1))
        echo "cudarc-suite: $t: skipped ($why)"
        continue
    fi
    t0=$(date +%s.%N)
    LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout "$TIMEOUT" \
        "$GLEAM" run --peer "$peer" --config-dir "$WORK/config" -- \
        "$bin" "$t" --exact --include-ignored --test-threads 1 > "$logs/$t.log" 2>&1
    rc=$?
    secs=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$(date +%s.%N)")
    known=${EXPECTED_FAIL[$t]:-}
    if [ "$rc" -eq 0 ] && grep -q '^test result: ok. 1 passed' "$logs/$t.log"; then
        passed=$((passed + 1))
        if [ -n "$known" ]; then
            unexpected_passes+=("$t")
            echo "cudarc-suite: $t: ok (${secs}s), but listed as an expected failure ($known): take it off EXPECTED_FAIL"
        else
            echo "cudarc-suite: $t: ok (${secs}s)"
        fi
    elif [ -n "$known" ]; then
        expected=$((expected + 1))
        echo "cudarc-suite: $t: FAILED as expected (exit $rc, ${secs}s): $known"
    else
        failed=$((failed + 1))
        failures+=("$t")
        echo "cudarc-suite: $t: FAILED (exit $rc, ${secs}s)"
        grep -v '^$' "$logs/$t.log" | tail -n 12 | sed 's/^/    /'
    fi
done
elapsed=$(($(date +%s) - started))
echo "cudarc-suite: $passed passed, $failed failed, $expected failed as expected, $skipped skipped;" \
    "${elapsed}s in all (logs in $logs)"
for t in "${failures[@]}"; do
    echo "cudarc-suite: failed: $t"
done
for t in "${unexpected_passes[@]}"; do
    echo "cudarc-suite: passed but listed in EXPECTED_FAIL (take it off the list): $t"
done
[ "$failed" -eq 0 ] && [ "${#unexpected_passes[@]}" -eq 0 ]
