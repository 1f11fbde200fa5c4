#!/usr/bin/env bash
# Run the cudarc examples on the real driver, then through Gleam (a local `gleam serve` with the
# real backend, and one with the emu backend), and compare their stdout.
#
#   OUT=/some/folder bash scripts/gpu/compare-examples.sh
#
# Needs built x86-64 binaries in $CARRY (default .carry/):
#   $CARRY/gleam, $CARRY/libgleamcuda.so (beside gleam: `gleam run` finds the shim there),
#   $CARRY/examples/{vector_add,matmul,streams,reduce}
# Env: EXAMPLES (space-separated names), BACKENDS (default "cuda emu"), EXAMPLE_TIMEOUT (s, default 300).
# $OUT afterwards: compare-examples.log (summary) and compare-examples.tgz (every output and log).
# Prints per example and backend `same` or `DIFFERENT`; exits 1 if anything differs or fails.
set -u -o pipefail
. "$(dirname "$0")/common.sh"

CARRY=${CARRY:-.carry}
EXAMPLES=${EXAMPLES:-"vector_add matmul streams reduce"}
BACKENDS=${BACKENDS:-"cuda emu"}
EXAMPLE_TIMEOUT=${EXAMPLE_TIMEOUT:-300}
LOGS="$WORK/compare-examples"
mkdir -p "$LOGS"
SUMMARY="$OUT/compare-examples.log"
: > "$SUMMARY"
say() { echo "$@" | tee -a "$SUMMARY"; }

# The machine's own library path, captured before anything else: the server must load NVIDIA's
# libcuda.so.1 (never the shim), and on some machines the driver is only found through it.
SYSTEM_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}

server_pids=()
cleanup() {
    for pid in "${server_pids[@]}"; do
        kill "$pid" 2>/dev/null
    done
    for pid in "${server_pids[@]}"; do
        wait "$pid" 2>/dev/null
    done
    tar czf "$OUT/compare-examples.tgz" -C "$WORK" compare-examples 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

say "== compare-examples $(date -u +%Y-%m-%dT%H:%M:%SZ) carry=$CARRY backends=[$BACKENDS]"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$SUMMARY" 2>&1 || true

GLEAM="$CARRY/gleam"
if [ ! -x "$GLEAM" ] || [ ! -f "$CARRY/libgleamcuda.so" ]; then
    say "warning: $GLEAM or $CARRY/libgleamcuda.so missing: only the local runs will happen"
    BACKENDS=""
fi
GLEAM=$(readlink -f "$GLEAM" 2>/dev/null || echo "$GLEAM")

problems=0

# ---- local runs (NVIDIA's driver) ----
for ex in $EXAMPLES; do
    bin="$CARRY/examples/$ex"
    if [ ! -x "$bin" ]; then
        say "local   $ex: MISSING ($bin)"
        problems=$((problems + 1))
        continue
    fi
    timeout "$EXAMPLE_TIMEOUT" "$bin" > "$LOGS/$ex.local.out" 2> "$LOGS/$ex.local.err"
    rc=$?
    echo "$rc" > "$LOGS/$ex.local.rc"
    say "local   $ex: exit $rc, $(grep -c '' "$LOGS/$ex.local.out") lines"
    [ "$rc" -eq 0 ] || problems=$((problems + 1))
done

# ---- one server per backend ----
# (Checked against src/cmd/serve.rs and src/cmd/run.rs at 15:05 UTC.)
# `gleam serve ADDR --backend auto|cuda|emu --config-dir DIR` prints exactly one stdout line:
#   gleam serve: listening on <addr> as <peer-id>
# and clients connect with `gleam run --peer <peer-id>@<addr> --config-dir DIR -- CMD...`.
# Client and server share one config dir (one device: the same identity and mesh secret).
# Sets PEER to <peer-id>@<addr>; returns 1 if the server does not come up within 30 s.
start_server() {
    local backend=$1 cfg=$2 out=$3 err=$4
    PEER=""
    env -i PATH="$PATH" HOME="$HOME" ${SYSTEM_LD_LIBRARY_PATH:+LD_LIBRARY_PATH="$SYSTEM_LD_LIBRARY_PATH"} \
        GLEAM_LOG="${GLEAM_LOG:-info}" \
        "$GLEAM" serve 127.0.0.1:0 --backend "$backend" --config-dir "$cfg" > "$out" 2> "$err" &
    local pid=$!
    server_pids+=("$pid")
    for _ in $(seq 1 300); do
        if grep -q '^gleam serve: listening on ' "$out" 2>/dev/null; then
            PEER=$(sed -n 's/^gleam serve: listening on \([^ ]*\) as \([^ ]*\).*/\2@\1/p' "$out" | head -n 1)
            [ -n "$PEER" ]
            return
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            return 1
        fi
        sleep 0.1
    done
    return 1
}

for backend in $BACKENDS; do
    cfg="$WORK/config-$backend"
    mkdir -p "$cfg"
    if ! start_server "$backend" "$cfg" "$LOGS/serve-$backend.out" "$LOGS/serve-$backend.err"; then
        say "serve --backend $backend: did not start (see serve-$backend.err):"
        tail -n 5 "$LOGS/serve-$backend.err" | sed 's/^/    /' | tee -a "$SUMMARY"
        problems=$((problems + 1))
        continue
    fi
    say "serve --backend $backend: $PEER"
    for ex in $EXAMPLES; do
        bin="$CARRY/examples/$ex"
        [ -x "$bin" ] || continue
        timeout "$EXAMPLE_TIMEOUT" "$GLEAM" run --peer "$PEER" --config-dir "$cfg" -- "$bin" \
            > "$LOGS/$ex.$backend.out" 2> "$LOGS/$ex.$backend.err"
        rc=$?
        echo "$rc" > "$LOGS/$ex.$backend.rc"
        local_rc=$(cat "$LOGS/$ex.local.rc" 2>/dev/null || echo "?")
        if [ "$rc" = "$local_rc" ] && diff -q "$LOGS/$ex.local.out" "$LOGS/$ex.$backend.out" > /dev/null 2>&1; then
            verdict=same
        else
            verdict=DIFFERENT
            problems=$((problems + 1))
            diff "$LOGS/$ex.local.out" "$LOGS/$ex.$backend.out" > "$LOGS/$ex.$backend.diff" 2>&1
        fi
        say "$(printf '%-7s %-10s %-9s' "$backend" "$ex" "$verdict") (exit $rc, local exit $local_rc)"
        if [ "$verdict" = DIFFERENT ]; then
            head -n 10 "$LOGS/$ex.$backend.diff" | sed 's/^/    /' | tee -a "$SUMMARY"
            tail -n 3 "$LOGS/$ex.$backend.err" | sed 's/^/    stderr: /' | tee -a "$SUMMARY"
        fi
    done
done

say "== compare-examples: $problems problem(s)"
[ "$problems" -eq 0 ]
