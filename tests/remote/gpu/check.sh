#!/usr/bin/env bash
# On the GPU machine (no Rust there): the C driver-API test program and a static-cudart program, run on
# NVIDIA's driver and through Gleam (`gleam serve --backend cuda` on loopback). Needs .carry/ from
# scripts/gpu/build-carry.sh. Results in $OUT: gpu-check.log plus each run's output.
set -u
CARRY=${CARRY:-.carry}
W=$(mktemp -d)
SYSTEM_LD=${LD_LIBRARY_PATH:-}
LOG="$OUT/gpu-check.log"
: > "$LOG"
cfg="$W/cfg"; mkdir -p "$cfg"
env -i PATH="$PATH" HOME="$HOME" ${SYSTEM_LD:+LD_LIBRARY_PATH="$SYSTEM_LD"} \
    "$CARRY/gleam" serve 127.0.0.1:0 --backend cuda --config-dir "$cfg" > "$W/serve.out" 2> "$OUT/serve.err" &
server=$!
for _ in $(seq 60); do grep -q listening "$W/serve.out" 2>/dev/null && break; sleep 0.5; done
PEER=$(sed -n 's/^gleam serve: listening on \(.*\) as \(.*\)$/\2@\1/p' "$W/serve.out")
echo "peer: $PEER" | tee -a "$LOG"
mkdir -p "$W/link"; ln -s "$(readlink -f "$CARRY/libgleamcuda.so")" "$W/link/libcuda.so"
gcc -O1 -o "$W/driver_basic" tests/remote/driver_basic.c -L"$W/link" -lcuda 2>> "$LOG"
run() { # name, then the command
    local name=$1; shift
    timeout 120 "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
    echo "$name: exit $?" | tee -a "$LOG"
}
g="$W/g"  # `gleam run` with this server, as a file so that `timeout` can run it
printf '#!/bin/sh\nexec %s run --peer %s --config-dir %s -- "$@"\n' "$(readlink -f "$CARRY/gleam")" "$PEER" "$cfg" > "$g"
chmod +x "$g"
GLEAM_TEST_NO_BOGUS_MODULE=1 run driver-gleam "$g" "$W/driver_basic" kernel
GLEAM_TEST_NO_BOGUS_MODULE=1 CUDA_LAUNCH_BLOCKING=1 run driver-blocking "$g" "$W/driver_basic" kernel
nvcc -O2 -arch=sm_90 -o "$W/cudart_add" tests/remote/gpu/cudart_vector_add.cu 2>> "$LOG"
run cudart-local "$W/cudart_add"
GLEAM_LOG=gleamcuda=debug,gleam_client=debug run cudart-gleam "$g" "$W/cudart_add"
kill $server; wait $server 2>/dev/null
for f in driver-gleam driver-blocking cudart-local cudart-gleam; do echo "== $f"; cat "$OUT/$f.out"; tail -n 15 "$OUT/$f.err"; done >> "$LOG"
