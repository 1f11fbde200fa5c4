#!/usr/bin/env bash
# On the GPU machine: run the driver micro-benchmark (examples/bench_driver.rs) three ways, side by side in
# one run, and print the ratios:
#   local     - NVIDIA's driver directly;
#   loopback  - through Gleam: shim -> QUIC on loopback -> `gleam serve --backend "${BACKEND:-cuda}"` on the same machine;
#   link      - the same, through `gleam linkemu` emulating a 1 Gbit/s link with 1 ms RTT (0.5 ms each way).
# Needs the binaries built on the dev machine and carried in .carry/ (gleam, libgleamcuda.so,
# examples/bench_driver). Results go to $OUT (bench-*.json, logs).
set -uo pipefail
cd "$(dirname "$0")/../.."
C=${CARRY:-.carry}
OUT=${OUT:-/tmp/gleam-bench}
mkdir -p "$OUT"
cfg=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT

# The server gets a clean environment, so it loads NVIDIA's driver and never the shim.
env -i PATH="$PATH" HOME="$HOME" GLEAM_LOG=info "$C/gleam" serve 127.0.0.1:0 --backend "${BACKEND:-cuda}" --config-dir "$cfg" \
    >"$OUT/serve.out" 2>"$OUT/serve.log" &
pids+=($!)
for _ in $(seq 300); do grep -q "listening on" "$OUT/serve.out" 2>/dev/null && break; sleep 0.1; done
line=$(grep "listening on" "$OUT/serve.out") || { echo "server did not start"; cat "$OUT/serve.log"; exit 1; }
addr=$(sed -E 's/.*listening on ([^ ]+) as .*/\1/' <<<"$line")
id=$(sed -E 's/.* as ([^ ]+).*/\1/' <<<"$line")
port=${addr##*:}
echo "server: $id at $addr"

# The link: a second server whose session processes listen on port 47100 only (GLEAM_SESSION_PORTS), and two
# emulated links on 127.0.0.2 (all of 127/8 is loopback): one to the server's port (authentication, the
# session's lifeline), one to the session port (every CUDA call), so the session's traffic crosses the link.
env -i PATH="$PATH" HOME="$HOME" GLEAM_LOG=info GLEAM_SESSION_PORTS=47100 "$C/gleam" serve 127.0.0.1:0 \
    --backend "${BACKEND:-cuda}" --config-dir "$cfg" >"$OUT/serve-link.out" 2>"$OUT/serve-link.log" &
pids+=($!)
for _ in $(seq 300); do grep -q "listening on" "$OUT/serve-link.out" 2>/dev/null && break; sleep 0.1; done
link_port=$(sed -nE 's/.*listening on [^ ]+:([0-9]+) as .*/\1/p' "$OUT/serve-link.out")
"$C/gleam" linkemu --listen 127.0.0.2:47000 --to "127.0.0.1:$link_port" --rate 1gbit --delay 0.5ms \
    2>"$OUT/linkemu.log" &
pids+=($!)
"$C/gleam" linkemu --listen 127.0.0.2:47100 --to 127.0.0.1:47100 --rate 1gbit --delay 0.5ms \
    2>"$OUT/linkemu-session.log" &
pids+=($!)
sleep 0.5

run() { # name, then the command
    local name=$1; shift
    if "$@" >"$OUT/bench-$name.json" 2>"$OUT/bench-$name.log"; then
        echo "$name: $(cat "$OUT/bench-$name.json")"
    else
        echo "$name: FAILED (see bench-$name.log)"; tail -5 "$OUT/bench-$name.log"
    fi
}
run local "$C/examples/bench_driver"
run loopback env GLEAM_STATS="$OUT/wire-loopback.json" "$C/gleam" run --peer "$id@$addr" --config-dir "$cfg" -- "$C/examples/bench_driver"
run link env GLEAM_STATS="$OUT/wire-link.json" "$C/gleam" run --peer "$id@127.0.0.2:47000" --config-dir "$cfg" -- "$C/examples/bench_driver"

python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
res = {}
for name in ("local", "loopback", "link"):
    try:
        res[name] = json.load(open(os.path.join(out, f"bench-{name}.json")))
    except Exception:
        pass
if "local" not in res:
    sys.exit("no local result")
loc = res["local"]
link_mib_s = 1e9 / 8 / 2**20
print()
print(f"{'metric':28} {'local':>12} {'loopback':>12} {'ratio':>8} {'1Gb/1ms':>12} {'ratio':>8}")
for key, better in (("sync_rtt_us", "lower"), ("sync_rtt_median_us", "lower"), ("launches_per_s", "higher"),
                    ("htod_mib_s", "higher"), ("dtoh_mib_s", "higher")):
    row = f"{key:28} {loc[key]:12.1f}"
    for name in ("loopback", "link"):
        if name in res:
            v = res[name][key]
            row += f" {v:12.1f} {v / loc[key]:8.3f}"
    print(row)
if "link" in res:
    for key in ("htod_mib_s", "dtoh_mib_s"):
        print(f"{key} over the emulated link vs the link rate ({link_mib_s:.1f} MiB/s): "
              f"{res['link'][key] / link_mib_s:.3f}")
PY
for name in loopback link; do
    [ -f "$OUT/wire-$name.json" ] && echo "wire bytes, $name: $(cat "$OUT/wire-$name.json")"
done
