# A serving peer for the benchmark scripts (sourced, not run): scripts/gpu/ab.sh, scripts/gpu/bench.sh,
# scripts/bench/lan.sh.
# shellcheck shell=bash

# start_serving_peer WHAT GLEAM BACKEND CONFIG_DIR STDOUT STDERR [VAR=VALUE...]
# Starts `GLEAM serve 127.0.0.1:0 --backend BACKEND --config-dir CONFIG_DIR` in the background with a clean
# environment (env -i: PATH and HOME, then the given VAR=VALUE settings in order, so a later one wins), so
# that it loads NVIDIA's driver and never the shim; its stdout goes to the file STDOUT, its stderr to STDERR.
# Appends its process id to the array `pids` at once (the caller's exit trap stops those), then waits up to
# 30 s for its "listening on ADDR as ID" line. Sets peer_line (that line), peer_addr (ADDR), peer_port
# (ADDR's port) and peer_id (ID). If the line never comes: prints "WHAT did not start" and STDERR, and exits 1.
# shellcheck disable=SC2034 # peer_addr, peer_port and peer_id are for the caller
start_serving_peer() {
    local what=$1 gleam=$2 backend=$3 config_dir=$4 stdout=$5 stderr=$6
    shift 6
    env -i PATH="$PATH" HOME="$HOME" "$@" "$gleam" serve 127.0.0.1:0 --backend "$backend" \
        --config-dir "$config_dir" > "$stdout" 2> "$stderr" &
    pids+=($!)
    for _ in $(seq 300); do grep -q "listening on" "$stdout" 2>/dev/null && break; sleep 0.1; done
    peer_line=$(grep "listening on" "$stdout") || { echo "$what did not start"; cat "$stderr"; exit 1; }
    peer_addr=$(sed -E 's/.*listening on ([^ ]+) as .*/\1/' <<<"$peer_line")
    peer_port=$(sed -nE 's/.*listening on [^ ]+:([0-9]+) as .*/\1/p' <<<"$peer_line")
    peer_id=$(sed -E 's/.* as ([^ ]+).*/\1/' <<<"$peer_line")
}
