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
# shellcheck source=scripts/lib/peer.sh
source scripts/lib/peer.sh
cfg=$(mktemp -d)
out=$(mktemp)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$cfg" "$out"; }
trap cleanup EXIT
# shellcheck disable=SC2086
start_serving_peer "the peer" "$C/gleam" "$BACKEND" "$cfg" "$out" /dev/null GLEAM_LOG=warn ${SERVE_ENV:-}
addr=$peer_addr
id=$peer_id
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
