#!/usr/bin/env bash
# Runs one fuzz target for a number of executions (default 10 million), at the lowest CPU priority, from
# the checked-in corpus into fuzz/work/<target>/ (new inputs) with crashes in fuzz/artifacts/<target>/.
#
#   fuzz/run.sh TARGET [RUNS] [extra libFuzzer flags...]   # TARGET: frames ptx fatbin shim gossip link control
#
# Builds first (nightly: cargo +nightly fuzz build). frames, ptx, gossip, link and control are safe Rust and run without a
# sanitizer (two to three times faster); fatbin (zstd's C code) runs under AddressSanitizer, and shim (unsafe
# code handling application pointers) behind guard pages, under AddressSanitizer with SHIM_ASAN=1. Every build has debug assertions (overflow checks) on. The log,
# with libFuzzer's final statistics, is fuzz/work/<target>.log.
set -euo pipefail
cd "$(dirname "$0")"
target=${1:?usage: fuzz/run.sh TARGET [RUNS] [libFuzzer flags...]}
runs=${2:-10000000}
shift $(( $# < 2 ? $# : 2 ))

case "$target" in
    frames | ptx | gossip | link | control) san=(-s none --target-dir target-nosan); bin=target-nosan ;;
    fatbin) san=(); bin=target ;;
    # The shim's host-memory handling is checked by guard pages (every buffer the harness passes is
    # followed by an inaccessible page), so its long runs go without AddressSanitizer and comparison
    # tracing (312 inputs/s with both, 2,068 without);
    # SHIM_ASAN=1 builds it with both.
    shim) if [ -n "${SHIM_ASAN:-}" ]; then san=(); bin=target
          else san=(-s none --no-trace-compares --target-dir target-fast); bin=target-fast; fi ;;
    *) echo "unknown target $target (frames ptx fatbin shim gossip link control)" >&2; exit 2 ;;
esac
case "$target" in
    frames) flags=(-max_len=8192 -timeout=20) ;;
    ptx) flags=(-max_len=8192 -timeout=20) ;;
    fatbin) flags=(-max_len=32768 -timeout=20) ;;
    gossip | link) flags=(-max_len=8192 -timeout=20) ;;
    control) flags=(-max_len=4096 -timeout=20) ;;
    # The shim's session keeps caches and background threads between inputs: leak checks per input would
    # report them. Its peer is the session engine in the fuzzing process (GLEAM_FUZZ_SHIM_PEER=in-process,
    # the default here: no network round trip per waited call), or with GLEAM_FUZZ_SHIM_PEER=server a real
    # `gleam serve --backend emu`: this workspace's gleam binary in release (or $GLEAM_BIN), since a
    # debug server interprets the harness's kernels and parses its modules several times slower (158 vs 94
    # inputs/s measured side by side).
    shim) flags=(-max_len=4096 -timeout=30 -detect_leaks=0)
          export GLEAM_FUZZ_SHIM_PEER=${GLEAM_FUZZ_SHIM_PEER:-in-process}
          if [ "$GLEAM_FUZZ_SHIM_PEER" = server ] && [ -z "${GLEAM_BIN:-}" ]; then
              (cd .. && nice -n 19 cargo build --release --bin gleam)
              export GLEAM_BIN=$PWD/../target/release/gleam
          fi ;;
esac

nice -n 19 cargo +nightly fuzz build -a "${san[@]}" "$target"
mkdir -p "work/$target" "artifacts/$target"
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_odr_violation=0} nice -n 19 "$bin/x86_64-unknown-linux-gnu/release/$target" "work/$target" "corpus/$target" \
    -runs="$runs" -rss_limit_mb=2048 -artifact_prefix="artifacts/$target/" -print_final_stats=1 \
    "${flags[@]}" "$@" 2>&1 | tee "work/$target.log" | grep --line-buffered -E 'pulse|DONE|INITED|ERROR|panicked|stat::'
