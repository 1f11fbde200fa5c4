#!/usr/bin/env bash
# Two builds of Gleam side by side, runs alternating, each build with its own serving peer on loopback:
# the warm 512 MiB upload (bench_workloads weights, after one cold run) and bench_driver's figures.
#
#   git worktree add /tmp/old <commit>; (cd /tmp/old && CARGO_TARGET_DIR=/tmp/old-target \
#       cargo build --release -p gleam --bin gleam && cargo build --release -p gleam-shim)
#   OLD=/tmp/old-target/release NEW=target/release bash scripts/bench/ab-builds.sh
#
# Env: OLD, NEW (folders with gleam and libgleamcuda.so), EXAMPLES (bench_workloads and bench_driver;
# default $NEW/examples), BACKEND (emu here, cuda on a GPU machine; emu scales the weights down: MIB, 256),
# ROUNDS (4).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OLD=${OLD:?OLD must name the old build folder} NEW=${NEW:-target/release}
EXAMPLES=${EXAMPLES:-$NEW/examples}
BACKEND=${BACKEND:-$(command -v nvidia-smi >/dev/null && echo cuda || echo emu)}
# shellcheck source=scripts/lib/peer.sh
source scripts/lib/peer.sh
pids=()
dirs=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "${dirs[@]}"; }
trap cleanup EXIT
if [ "$BACKEND" = emu ]; then
    export BENCH_WEIGHTS_MIB=${MIB:-256} BENCH_MATMULS=5 BENCH_MATMUL_N=32
fi
declare -A PEER CFG
for side in OLD NEW; do
    bin=${!side}
    CFG[$side]=$(mktemp -d)
    dirs+=("${CFG[$side]}")
    start_serving_peer "the $side peer" "$bin/gleam" "$BACKEND" "${CFG[$side]}" "${CFG[$side]}/out" /dev/null GLEAM_LOG=warn
    PEER[$side]="$peer_id@127.0.0.1:$peer_port"
done
run() {
    local side=$1 bin=${!1}
    shift
    "$bin/gleam" run --peer "${PEER[$side]}" --config-dir "${CFG[$side]}" -- "$@" 2>/dev/null
}
for side in OLD NEW; do
    echo "$side weights cold $(run "$side" "$EXAMPLES/bench_workloads" weights | grep -o '"time_s": [0-9.]*')"
done
for _ in $(seq "${ROUNDS:-4}"); do
    for side in OLD NEW; do
        echo "$side weights warm $(run "$side" "$EXAMPLES/bench_workloads" weights | grep -o '"time_s": [0-9.]*')"
    done
done
for _ in $(seq "${ROUNDS:-4}"); do
    for side in OLD NEW; do
        echo "$side driver $(GLEAM_BENCH_BURSTS=1000 run "$side" "$EXAMPLES/bench_driver")"
    done
done
