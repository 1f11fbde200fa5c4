#!/usr/bin/env bash
# Build, on the development machine (x86-64), what compare-examples.sh runs on the GPU machine,
# and put it in .carry/ (git-ignored; pass `carry: [".carry"]` to the device run):
#   .carry/gleam, .carry/libgleamcuda.so, .carry/examples/{vector_add,matmul,streams,reduce}
#
#   bash scripts/gpu/build-carry.sh            # release build
#   PROFILE=dev bash scripts/gpu/build-carry.sh
set -euo pipefail
if [ ! -f Cargo.toml ] || [ ! -d remoting/shim ]; then
    echo "error: run from the Gleam repo root" >&2
    exit 1
fi
PROFILE=${PROFILE:-release}
case "$PROFILE" in
    release) flag=--release; dir=target/release ;;
    dev) flag=; dir=target/debug ;;
    *) echo "error: PROFILE must be release or dev" >&2; exit 1 ;;
esac
EXAMPLES="vector_add matmul streams reduce bench_driver bench_workloads quinn_floor"

# shellcheck disable=SC2086
cargo build $flag -p gleam --bin gleam
# shellcheck disable=SC2086
cargo build $flag -p gleam-shim
example_flags=""
for ex in $EXAMPLES; do
    example_flags="$example_flags --example $ex"
done
# shellcheck disable=SC2086
cargo build $flag -p gleam $example_flags

rm -rf .carry
mkdir -p .carry/examples
cp "$dir/gleam" "$dir/libgleamcuda.so" .carry/
for ex in $EXAMPLES; do
    cp "$dir/examples/$ex" .carry/examples/
done
# The examples need no debug info; keep the carried tree well under the 64 MiB limit.
strip .carry/examples/* 2>/dev/null || true
if [ "$(du -sm .carry | cut -f1)" -gt 48 ]; then
    strip --strip-debug .carry/gleam .carry/libgleamcuda.so 2>/dev/null || true
fi
# WITH_TESTS=1: also the unit-test binaries whose tests need a real GPU (marked #[ignore] here; verify-all.sh runs them with --include-ignored).
if [ "${WITH_TESTS:-0}" = 1 ]; then
    mkdir -p .carry/tests
    # shellcheck disable=SC2086
    cargo test $flag --no-run --message-format=json -p gleam-real -p gleam-facts --lib 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' |
        while read -r exe; do cp "$exe" .carry/tests/; done
    strip .carry/tests/* 2>/dev/null || true
fi
du -sh .carry
ls -l .carry .carry/examples
