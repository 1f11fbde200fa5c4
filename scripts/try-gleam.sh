#!/usr/bin/env bash
# Gleam's main job on this machine, end to end: start a local serving peer (NVIDIA's driver if this machine has
# a GPU, else the `emu` backend, whose kernels run in Gleam's PTX interpreter), then run the example CUDA
# programs through Gleam's libcuda.so.1, unmodified.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace --lib --bins --examples
bin=target/release
cfg=$(mktemp -d)
log=$(mktemp -t gleam-serve.XXXXXX.log)
trap 'kill $server 2>/dev/null; rm -rf "$cfg"' EXIT
# A clean environment: the server must load NVIDIA's driver, never the shim.
env -i PATH="$PATH" HOME="$HOME" "$bin/gleam" serve 127.0.0.1:0 --config-dir "$cfg" >"$cfg/serve.out" 2>"$log" &
server=$!
for _ in $(seq 100); do grep -q "listening on" "$cfg/serve.out" 2>/dev/null && break; sleep 0.1; done
line=$(grep "listening on" "$cfg/serve.out") || { echo "the peer did not start:"; cat "$log"; exit 1; }
addr=$(sed -E 's/.*listening on ([^ ]+) as .*/\1/' <<<"$line")
id=$(sed -E 's/.* as ([^ ]+).*/\1/' <<<"$line")
echo "local peer $id serving on $addr (its log: $log)"
for ex in vector_add matmul streams reduce; do
    echo "== $ex (through Gleam)"
    "$bin/gleam" run --peer "$id@$addr" --config-dir "$cfg" -- "$bin/examples/$ex"
done
