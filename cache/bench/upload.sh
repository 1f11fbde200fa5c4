#!/usr/bin/env bash
# Host-to-device upload throughput through Gleam, the content cache off (the classic path: every byte
# sent) against on (cold: every chunk sent, hashed and checked on both sides; warm: the same bytes
# again, only ids sent), over loopback and over an emulated 1 Gbit/s link with 1 ms round trips.
#
#   cache/bench/upload.sh BIN_DIR [MIB] [ROUNDS] [BACKEND]
#
# BIN_DIR holds `gleam` and `libgleamcuda.so` (e.g. target/release, or .carry on the GPU machine);
# the upload program is built from tests/remote/upload.c with cc. MIB: payload size (default 256);
# ROUNDS: rounds of (off, cold, warm) per link, interleaved (default 3); BACKEND: emu (default) or cuda.
# Prints one line per upload; wire byte counts (GLEAM_STATS) go to $OUT (default ./upload-bench), which is
# emptied first. SERVE_LOG and CLIENT_LOG set the servers' and the clients' GLEAM_LOG (default warn): the
# servers log to $OUT/<link>.err, each upload to $OUT/<link>-<round>-<run>.log (with
# SERVE_LOG=gleam_server=debug,gleam_host=trace and CLIENT_LOG=gleam_client=debug, a timeline of each
# upload on both sides). LINKS: which of `loopback link` to run (default both).
set -euo pipefail
BIN=$(cd "$1" && pwd)
MIB=${2:-256}
ROUNDS=${3:-3}
BACKEND=${4:-emu}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$PWD/upload-bench}
rm -rf "$OUT" && mkdir -p "$OUT/link"
ln -sf "$BIN/libgleamcuda.so" "$OUT/link/libcuda.so"
cc -O2 -o "$OUT/upload" "$ROOT/tests/remote/upload.c" -L"$OUT/link" -lcuda
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT

# serve NAME [ENV...]: a server with its own config dir; sets $target.
serve() {
    local dir="$OUT/$1"
    shift
    mkdir -p "$dir"
    env GLEAM_LOG="${SERVE_LOG:-warn}" "$@" "$BIN/gleam" serve 127.0.0.1:0 --backend "$BACKEND" --config-dir "$dir" \
        >"$dir.out" 2>"$dir.err" &
    pids+=($!)
    for _ in $(seq 100); do [ -s "$dir.out" ] && break; sleep 0.1; done
    local line addr
    line=$(head -1 "$dir.out")
    addr=${line#gleam serve: listening on }
    addr=${addr% as *}
    target="${line##* as }@$addr"
}

serve loopback
loopback=$target
# The link: session processes on port 47100 only, and both of the peer's ports behind the emulator on
# 127.0.0.2 (all of 127/8 is loopback).
# Behind the emulator both ends treat the path as the LAN it stands for (GLEAM_LOOPBACK_PATH=lan: Ethernet-sized
# datagrams, the LAN's bulk controller; they would otherwise take it for loopback and send 6000-byte ones).
ETHERNET=GLEAM_LOOPBACK_PATH=lan
serve link GLEAM_SESSION_PORTS=47100 "$ETHERNET"
port=${target##*:}
link="${target%@*}@127.0.0.2:47000"
"$BIN/gleam" linkemu --listen 127.0.0.2:47000 --to "127.0.0.1:$port" --rate 1gbit --delay 0.5ms \
    2>"$OUT/linkemu.log" &
pids+=($!)
"$BIN/gleam" linkemu --listen 127.0.0.2:47100 --to 127.0.0.1:47100 --rate 1gbit --delay 0.5ms \
    2>"$OUT/linkemu-session.log" &
pids+=($!)
sleep 1

seed=$((RANDOM * 1000))
for round in $(seq "$ROUNDS"); do
    for where in ${LINKS:-loopback link}; do
        peer=$loopback datagrams=
        [ "$where" = link ] && peer=$link datagrams=$ETHERNET
        for run in off cold warm; do
            [ "$run" != warm ] && seed=$((seed + 1))
            cache=on
            [ "$run" = off ] && cache=off
            stats="$OUT/$where-$round-$run.json"
            line=$(env ${datagrams:+"$datagrams"} GLEAM_CACHE=$cache GLEAM_SHIM="$BIN/libgleamcuda.so" GLEAM_STATS="$stats" \
                GLEAM_LOG="${CLIENT_LOG:-warn}" "$BIN/gleam" run --peer "$peer" --config-dir "$OUT/$where" -- \
                "$OUT/upload" "$MIB" "$seed" sync 2>"$OUT/$where-$round-$run.log" | grep 'upload sync')
            sent=$(sed -E 's/.*"sent_bytes":([0-9]+).*/\1/' "$stats")
            echo "$where round $round cache-$run: ${line#upload sync: }, $sent bytes sent"
        done
    done
done
