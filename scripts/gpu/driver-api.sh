#!/usr/bin/env bash
# Contexts, pools, virtual memory, streams and events (driver_api.c), stream capture, attributes and memory
# operations (driver_streams.c) on a real GPU, and cudarc 0.19.10's tests: each run
# on NVIDIA's driver directly and through Gleam (`gleam serve --backend cuda` on loopback), side by side.
#
# Here (the development machine):
#   bash scripts/gpu/driver-api.sh --prepare     # .carry/ (build-carry.sh) + .carry/cudarc-tests
# There (the GPU machine, repo root, `carry: [".carry"]`):
#   bash scripts/gpu/driver-api.sh               # results in $OUT/driver-api.log and $OUT/cudarc.tsv
# (BACKEND=emu tries the script out without a GPU: the "NVIDIA's driver" runs then fail.)
#
# The C program is tests/remote/driver_api.c, compiled there with gcc against the carried shim (its
# SONAME is libcuda.so.1, so run directly it loads NVIDIA's driver). cudarc's tests need NVRTC: the
# toolkit's libnvrtc.so.13 (CUDA_HOME/lib64 or the usual places) is put on LD_LIBRARY_PATH.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CARRY=${CARRY:-$ROOT/.carry}

if [ "${1:-}" = --prepare ]; then
    set -e
    cd "$ROOT"
    [ -x .carry/gleam ] || bash scripts/gpu/build-carry.sh
    # On the GPU machine the suite runs with cuBLAS, cuBLASLt and cuRAND too (issue 9's list).
    bin=$(CUDARC_FEATURES=${CUDARC_FEATURES:-std,driver,nvrtc,cublas,cublaslt,curand,f16,dynamic-loading,cuda-13000} \
        CUDARC_BUILD_ONLY=1 bash scripts/ci/cudarc-suite.sh "$ROOT/target/debug/gleam" | tail -n 1)
    cp "$bin" .carry/cudarc-tests
    strip .carry/cudarc-tests 2>/dev/null || true
    du -sh .carry
    exit 0
fi

OUT=${OUT:-/tmp/gleam-driver-api}
mkdir -p "$OUT"
LOG="$OUT/driver-api.log"
: > "$LOG"
W=$(mktemp -d)
cfg="$W/cfg"
mkdir -p "$cfg" "$W/link"
SYSTEM_LD=${LD_LIBRARY_PATH:-}
env -i PATH="$PATH" HOME="$HOME" ${SYSTEM_LD:+LD_LIBRARY_PATH="$SYSTEM_LD"} \
    "$CARRY/gleam" serve 127.0.0.1:0 --backend "${BACKEND:-cuda}" --config-dir "$cfg" > "$W/serve.out" 2> "$OUT/serve.err" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$W"' EXIT
for _ in $(seq 60); do grep -q listening "$W/serve.out" 2>/dev/null && break; sleep 0.5; done
PEER=$(sed -n 's/^gleam serve: listening on \(.*\) as \(.*\)$/\2@\1/p' "$W/serve.out")
echo "peer: $PEER" | tee -a "$LOG"
g="$W/g"  # `gleam run` with this server, as a file so that `timeout` can run it
printf '#!/bin/sh\nexec %s run --peer %s --config-dir %s -- "$@"\n' "$(readlink -f "$CARRY/gleam")" "$PEER" "$cfg" > "$g"
chmod +x "$g"

ln -s "$(readlink -f "$CARRY/libgleamcuda.so")" "$W/link/libcuda.so"
gcc -O1 -o "$W/driver_api" "$ROOT/tests/remote/driver_api.c" -L"$W/link" -lcuda 2>> "$LOG"
for mode in contexts pools vmm streams; do
    timeout 120 env ${SYSTEM_LD:+LD_LIBRARY_PATH="$SYSTEM_LD"} "$W/driver_api" "$mode" \
        > "$OUT/$mode.native.out" 2>&1
    native=$?
    timeout 120 "$g" "$W/driver_api" "$mode" > "$OUT/$mode.gleam.out" 2>&1
    gleam=$?
    echo "driver_api $mode: NVIDIA's driver exit $native, through Gleam exit $gleam" | tee -a "$LOG"
    [ "$native" -eq 0 ] || tail -n 5 "$OUT/$mode.native.out" | sed 's/^/    native: /' | tee -a "$LOG"
    [ "$gleam" -eq 0 ] || tail -n 5 "$OUT/$mode.gleam.out" | sed 's/^/    gleam: /' | tee -a "$LOG"
done

# Stream capture, stream attributes, stream memory operations, the CUDA 3.x names (tests/remote/driver_streams.c):
# `note:` lines are values the program reports without checking (defaults of the real driver), compare them.
gcc -O1 -o "$W/driver_streams" "$ROOT/tests/remote/driver_streams.c" -L"$W/link" -lcuda 2>> "$LOG"
for mode in capture attributes memops old-names; do
    timeout 120 env ${SYSTEM_LD:+LD_LIBRARY_PATH="$SYSTEM_LD"} "$W/driver_streams" "$mode" \
        > "$OUT/streams-$mode.native.out" 2>&1
    native=$?
    timeout 120 "$g" "$W/driver_streams" "$mode" > "$OUT/streams-$mode.gleam.out" 2>&1
    gleam=$?
    echo "driver_streams $mode: NVIDIA's driver exit $native, through Gleam exit $gleam" | tee -a "$LOG"
    [ "$native" -eq 0 ] || tail -n 5 "$OUT/streams-$mode.native.out" | sed 's/^/    native: /' | tee -a "$LOG"
    [ "$gleam" -eq 0 ] || tail -n 5 "$OUT/streams-$mode.gleam.out" | sed 's/^/    gleam: /' | tee -a "$LOG"
    grep -h '^note:' "$OUT/streams-$mode.native.out" 2>/dev/null | sed 's/^/    native /' | tee -a "$LOG"
done

# cudarc's tests: every one, alone, locally and through Gleam.
if [ -x "$CARRY/cudarc-tests" ]; then
    nvrtc=""
    for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
        ls "$d"/libnvrtc.so.13* >/dev/null 2>&1 && nvrtc=$d && break
    done
    [ -n "$nvrtc" ] || nvrtc=$(dirname "$(find / -name 'libnvrtc.so.13*' 2>/dev/null | head -n 1)")
    echo "nvrtc from: $nvrtc" | tee -a "$LOG"
    TSV="$OUT/cudarc.tsv"
    printf 'test\tlocal\tgleam\n' > "$TSV"
    both=0 local_only=0 total=0
    while read -r t; do
        total=$((total + 1))
        LD_LIBRARY_PATH="$nvrtc${SYSTEM_LD:+:$SYSTEM_LD}" timeout 300 "$CARRY/cudarc-tests" "$t" --exact \
            --include-ignored --test-threads 1 > "$W/local.out" 2>&1
        l=$?
        LD_LIBRARY_PATH="$nvrtc${SYSTEM_LD:+:$SYSTEM_LD}" timeout 300 "$g" "$CARRY/cudarc-tests" "$t" --exact \
            --include-ignored --test-threads 1 > "$W/gleam.out" 2>&1
        r=$?
        lr=$([ $l -eq 0 ] && echo pass || echo "FAIL($l)")
        gr=$([ $r -eq 0 ] && echo pass || echo "FAIL($r)")
        printf '%s\t%s\t%s\n' "$t" "$lr" "$gr" >> "$TSV"
        [ $l -eq 0 ] && [ $r -eq 0 ] && both=$((both + 1))
        if [ $l -eq 0 ] && [ $r -ne 0 ]; then
            local_only=$((local_only + 1))
            { echo "== $t passes locally, fails through Gleam"; grep -v '^$' "$W/gleam.out" | tail -n 8; } >> "$LOG"
        fi
    done < <("$CARRY/cudarc-tests" --list --include-ignored 2>/dev/null | sed -n 's/: test$//p' | sort)
    echo "cudarc: $total tests; $both pass locally and through Gleam; $local_only pass only locally" | tee -a "$LOG"
    # The table, aligned (`column` is not on every machine; the GPU machine lacks it).
    awk -F'\t' '{ printf "%-80s %-10s %s\n", $1, $2, $3 }' "$TSV" | tee -a "$LOG"
fi
