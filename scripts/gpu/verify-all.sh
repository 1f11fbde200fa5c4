#!/usr/bin/env bash
# On the GPU machine, in one go: the examples locally vs through Gleam (cuda and emu backends), the driver
# benchmark (local / loopback / emulated 1 Gbit/s 1 ms link), the unit tests that need a real GPU, and a
# `gleam peer` daemon advertising the real GPU with a program run on the peer it picks.
# Needs .carry/ from scripts/gpu/build-carry.sh (WITH_TESTS=1 adds the test binaries).
set -u -o pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/gleam-verify}
mkdir -p "$OUT"
C=${CARRY:-.carry}

echo "== examples: local vs through Gleam"
bash scripts/gpu/compare-examples.sh 2>&1 | grep -v '^$' | tail -16

echo "== benchmark"
bash scripts/gpu/bench.sh 2>&1 | tail -12

echo "== unit tests that need a GPU"
for t in "$C"/tests/*; do
    [ -x "$t" ] || continue
    case "$(basename "$t")" in
        gleam_real-*) filter= ;;
        gleam_facts-*) filter= ;;
        *) filter= ;;
    esac
    echo "-- $(basename "$t") $filter"
    "$t" --include-ignored $filter 2>&1 | grep -E '^test |test result' | tail -25
done

echo "== gleam peer on the real GPU"
cfg=$(mktemp -d)
env -i PATH="$PATH" HOME="$HOME" GLEAM_CONFIG_DIR="$cfg" "$C/gleam" mesh init >/dev/null 2>&1
env -i PATH="$PATH" HOME="$HOME" GLEAM_CONFIG_DIR="$cfg" GLEAM_LOG=info \
    "$C/gleam" peer --no-mdns --listen 127.0.0.1:0 --backend cuda 2>"$OUT/peer.log" &
peer=$!
sleep 4
GLEAM_CONFIG_DIR="$cfg" "$C/gleam" peers list 2>&1
GLEAM_CONFIG_DIR="$cfg" "$C/gleam" peers list --json >"$OUT/peers.json" 2>&1
echo "-- gleam run (no --peer: the daemon picks)"
GLEAM_CONFIG_DIR="$cfg" "$C/gleam" run -- "$C/examples/vector_add" 2>&1 | tail -4
kill "$peer" 2>/dev/null
wait "$peer" 2>/dev/null
true
