#!/usr/bin/env bash
# Issue 9, items 3, 6 and 7 on the GPU machine: managed memory, host memory the device maps, arrays,
# textures and surfaces.
#
#   1. tools/gpu/mem_facts.c on NVIDIA's driver: what the driver answers where Gleam had to choose
#      (pointer attributes, alignments, flags, edge-case error codes) -> $OUT/mem-facts.txt.
#   2. tests/remote/driver_memory.c (every mode) on NVIDIA's driver, to check the test's own expectations
#      against real CUDA, then through `gleam serve --backend cuda` (and `--backend emu` for comparison).
#   3. The gleam-real unit tests that need a GPU, if carried (`WITH_TESTS=1 build-carry.sh`).
#
# Needs .carry/ from scripts/gpu/build-carry.sh (gleam, libgleamcuda.so), gcc and the driver. Run from the
# repo root: OUT=<folder> bash scripts/gpu/verify-mem.sh. Results: $OUT/verify-mem.log, mem-facts.txt,
# verify-mem.tgz (every program's output).
set -u -o pipefail
source "$(dirname "$0")/common.sh"
CARRY=${CARRY:-.carry}
LOG="$OUT/verify-mem.log"
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }
SYSTEM_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
RUNS="$WORK/verify-mem"
mkdir -p "$RUNS"

server_pids=()
cleanup() {
    for pid in "${server_pids[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${server_pids[@]}"; do wait "$pid" 2>/dev/null; done
    tar czf "$OUT/verify-mem.tgz" -C "$WORK" verify-mem 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

say "== verify-mem $(date -u +%Y-%m-%dT%H:%M:%SZ)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$LOG" 2>&1 || true

# The driver's own library (the link needs libcuda.so; the runtime finds libcuda.so.1).
LIBCUDA_DIR=""
for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda/lib64/stubs "$CUDA_HOME/lib64/stubs"; do
    if [ -e "$d/libcuda.so" ] || [ -e "$d/libcuda.so.1" ]; then LIBCUDA_DIR=$d; break; fi
done
link() {
    local src=$1 exe=$2
    mkdir -p "$WORK/link"
    [ -e "$WORK/link/libcuda.so" ] || ln -sf "$(ls "$LIBCUDA_DIR"/libcuda.so* | head -n 1)" "$WORK/link/libcuda.so"
    cc -O1 -o "$exe" "$src" -L"$WORK/link" -lcuda
}

say "-- 1. driver facts"
if link tools/gpu/mem_facts.c "$WORK/mem_facts" 2>> "$LOG"; then
    "$WORK/mem_facts" > "$OUT/mem-facts.txt" 2>&1
    say "mem_facts: exit $?, $(grep -c '' "$OUT/mem-facts.txt") facts in mem-facts.txt"
else
    say "mem_facts: did not build"
fi

MODES="managed host arrays textures"
PTX=tests/remote/mem_kernels.ptx
problems=0
say "-- 2a. driver_memory on NVIDIA's driver"
if link tests/remote/driver_memory.c "$WORK/driver_memory" 2>> "$LOG"; then
    for mode in $MODES; do
        timeout 120 "$WORK/driver_memory" "$mode" "$PTX" > "$RUNS/$mode.native.out" 2>&1
        rc=$?
        say "native $mode: exit $rc: $(tail -n 1 "$RUNS/$mode.native.out")"
        [ "$rc" -eq 0 ] || problems=$((problems + 1))
    done
else
    say "driver_memory: did not build"
    problems=$((problems + 1))
fi

start_server() {
    local backend=$1 cfg=$2
    PEER=""
    env -i PATH="$PATH" HOME="$HOME" ${SYSTEM_LD_LIBRARY_PATH:+LD_LIBRARY_PATH="$SYSTEM_LD_LIBRARY_PATH"} \
        GLEAM_LOG="${GLEAM_LOG:-info}" \
        "$CARRY/gleam" serve 127.0.0.1:0 --backend "$backend" --config-dir "$cfg" \
        > "$RUNS/serve-$backend.out" 2> "$RUNS/serve-$backend.err" &
    server_pids+=("$!")
    for _ in $(seq 1 300); do
        PEER=$(sed -n 's/^gleam serve: listening on \([^ ]*\) as \([^ ]*\).*/\2@\1/p' "$RUNS/serve-$backend.out" 2>/dev/null | head -n 1)
        [ -n "$PEER" ] && return 0
        sleep 0.1
    done
    return 1
}

for backend in cuda emu; do
    say "-- 2b. driver_memory through gleam serve --backend $backend"
    if [ ! -x "$CARRY/gleam" ] || [ ! -x "$WORK/driver_memory" ]; then
        say "skipped: $CARRY/gleam or driver_memory missing"
        problems=$((problems + 1))
        continue
    fi
    cfg="$WORK/config-$backend"
    if ! start_server "$backend" "$cfg"; then
        say "serve --backend $backend did not start:"
        tail -n 5 "$RUNS/serve-$backend.err" | tee -a "$LOG"
        problems=$((problems + 1))
        continue
    fi
    for mode in $MODES; do
        start=$(date +%s.%N)
        timeout 300 "$CARRY/gleam" run --peer "$PEER" --config-dir "$cfg" -- \
            "$WORK/driver_memory" "$mode" "$PTX" > "$RUNS/$mode.$backend.out" 2> "$RUNS/$mode.$backend.err"
        rc=$?
        secs=$(echo "$(date +%s.%N) - $start" | bc 2>/dev/null || echo "?")
        say "gleam/$backend $mode: exit $rc in ${secs}s: $(tail -n 1 "$RUNS/$mode.$backend.out")"
        [ "$rc" -eq 0 ] || { problems=$((problems + 1)); tail -n 5 "$RUNS/$mode.$backend.err" | tee -a "$LOG"; }
    done
done

say "-- 3. gleam-real tests that need a GPU"
for t in "$CARRY"/tests/gleam_real-*; do
    [ -x "$t" ] || { say "not carried (WITH_TESTS=1 bash scripts/gpu/build-carry.sh)"; break; }
    "$t" --ignored scenario 2>&1 | grep -E '^test |test result|panicked' | tee -a "$LOG"
done

say "== verify-mem: $problems problem(s)"
