#!/usr/bin/env bash
# On the GPU machine (or here, BACKEND=emu): an A/B comparison of the driver micro-benchmark
# (examples/bench_driver.rs) through Gleam on loopback, the two settings alternating round by round against
# one serving peer, with NVIDIA's driver locally before and after (cuda only), so every figure comes from
# the same run:
#   A="GLEAM_SPIN_US=0" B="" ROUNDS=3 bash scripts/gpu/ab.sh
# A and B are client environment settings (VAR=VALUE ..., empty for none); SERVE_ENV sets the peer's.
# Prints one line per run: setting, then the benchmark's JSON. Needs gleam, libgleamcuda.so and
# examples/bench_driver in $CARRY (.carry; target/release works too).
set -uo pipefail
cd "$(dirname "$0")/../.."
C=${CARRY:-.carry}
BACKEND=${BACKEND:-cuda}
ROUNDS=${ROUNDS:-3}
cfg=$(mktemp -d)
out=$(mktemp)
cleanup() { [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null; rm -rf "$cfg" "$out"; }
trap cleanup EXIT
# shellcheck disable=SC2086
env -i PATH="$PATH" HOME="$HOME" GLEAM_LOG=warn ${SERVE_ENV:-} "$C/gleam" serve 127.0.0.1:0 --backend "$BACKEND" \
    --config-dir "$cfg" > "$out" 2>/dev/null &
pid=$!
for _ in $(seq 300); do grep -q "listening on" "$out" && break; sleep 0.1; done
line=$(grep "listening on" "$out") || { echo "the peer did not start"; exit 1; }
addr=$(sed -E 's/.*listening on ([^ ]+) as .*/\1/' <<<"$line")
id=$(sed -E 's/.* as ([^ ]+).*/\1/' <<<"$line")
local_run() { [ "$BACKEND" = cuda ] && echo "local $("$C/examples/bench_driver")"; }
local_run
for _ in $(seq "$ROUNDS"); do
    for side in A B; do
        setting=${!side:-}
        # shellcheck disable=SC2086
        echo "$side(${setting:-default}) $(env $setting "$C/gleam" run --peer "$id@$addr" --config-dir "$cfg" -- \
            "$C/examples/bench_driver")"
    done
done
local_run
