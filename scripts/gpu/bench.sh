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
# shellcheck source=scripts/lib/peer.sh
source scripts/lib/peer.sh

# Starts `gleam serve` as NAME (output in $OUT/NAME.out and .log) with a clean environment (so it loads
# NVIDIA's driver and never the shim) plus the given VAR=VALUE settings; sets peer_addr, peer_port, peer_id.
start_server() {
    local name=$1; shift
    start_serving_peer "$name" "$C/gleam" "${BACKEND:-cuda}" "$cfg" "$OUT/$name.out" "$OUT/$name.log" \
        GLEAM_LOG="${SERVE_LOG:-info}" "$@"
}
# An emulated 1 Gbit/s link with 1 ms round trips from LISTEN to TO.
link() {
    "$C/gleam" linkemu --listen "$1" --to "$2" --rate 1gbit --delay 0.5ms 2>"$OUT/$3.log" &
    pids+=($!)
}

start_server serve
addr=$peer_addr
id=$peer_id
echo "server: $id at $addr"

# The link: a second server whose session processes listen on port 47100 only (GLEAM_SESSION_PORTS), and two
# emulated links on 127.0.0.2 (all of 127/8 is loopback): one to the server's port (authentication, the
# session's lifeline), one to the session port (every CUDA call), so the session's traffic crosses the link.
# Behind the emulator both ends treat the path as the LAN it stands for (GLEAM_LOOPBACK_PATH=lan: Ethernet-sized
# datagrams, the LAN's bulk controller; they would otherwise take it for loopback and send 6000-byte datagrams).
ETHERNET=GLEAM_LOOPBACK_PATH=lan
start_server serve-link GLEAM_SESSION_PORTS=47100 "$ETHERNET"
link_port=$peer_port
link 127.0.0.2:47000 "127.0.0.1:$link_port" linkemu
link 127.0.0.2:47100 127.0.0.1:47100 linkemu-session
sleep 0.5

# CLIENT_LOG: the Gleam runs' GLEAM_LOG (e.g. warn,gleam_client::upload=debug: each upload's timings), into
# bench-NAME.log; SERVE_LOG likewise for the servers (default info).
run() { # name, then the command
    local name=$1; shift
    if env ${CLIENT_LOG:+GLEAM_LOG="$CLIENT_LOG"} "$@" >"$OUT/bench-$name.json" 2>"$OUT/bench-$name.log"; then
        echo "$name: $(cat "$OUT/bench-$name.json")"
    else
        echo "$name: FAILED (see bench-$name.log)"; tail -5 "$OUT/bench-$name.log"
    fi
}
run local "$C/examples/bench_driver"
run loopback env GLEAM_STATS="$OUT/wire-loopback.json" "$C/gleam" run --peer "$id@$addr" --config-dir "$cfg" -- "$C/examples/bench_driver"
run link env "$ETHERNET" GLEAM_STATS="$OUT/wire-link.json" "$C/gleam" run --peer "$id@127.0.0.2:47000" --config-dir "$cfg" -- "$C/examples/bench_driver"
# The bare quinn floor (examples/quinn_floor.rs) as LABEL, with the given VAR=VALUE settings on both ends.
floor() {
    local label=$1; shift
    [ -x "$C/examples/quinn_floor" ] || return 0
    local served
    served="$OUT/floor-$(tr -c 'A-Za-z0-9\n' - <<<"$label")-serve.out"
    env "$@" "$C/examples/quinn_floor" serve 127.0.0.1:0 > "$served" 2>&1 &
    local fp=$!; pids+=($fp)
    for _ in $(seq 100); do [ -s "$served" ] && break; sleep 0.1; done
    read -r _ faddr fpeer < "$served"
    echo "quinn floor, $label: $(env "$@" timeout 60 "$C/examples/quinn_floor" connect "$faddr" "$fpeer" 256 2>&1 | tail -3)"
    kill $fp 2>/dev/null
}
floor default
# Other datagram sizes on loopback (GLEAM_LOOPBACK_UDP_PAYLOAD on both ends), each with the bare quinn floor
# at the same size: MTUS="1452 6550".
for mtu in ${MTUS:-}; do
    start_server "serve-mtu$mtu" GLEAM_LOOPBACK_UDP_PAYLOAD="$mtu"
    maddr=$peer_addr
    mid=$peer_id
    run "loopback-mtu$mtu" env GLEAM_LOOPBACK_UDP_PAYLOAD="$mtu" GLEAM_STATS="$OUT/wire-loopback-mtu$mtu.json" \
        "$C/gleam" run --peer "$mid@$maddr" --config-dir "$cfg" -- "$C/examples/bench_driver"
    floor "datagrams of $mtu" GLEAM_LOOPBACK_UDP_PAYLOAD="$mtu"
done
# Other settings on loopback, each VAR=VALUE (several joined by commas) on both ends, each with the floor
# under the same setting: SETTINGS="GLEAM_SPIN_US=0 GLEAM_BUSY_POLL=off" (nothing spins or polls; threads
# spin but do not poll), SETTINGS="GLEAM_BULK_STRIPES=2,GLEAM_LOOPBACK_UDP_PAYLOAD=1452".
for setting in ${SETTINGS:-}; do
    name=loopback-$(tr -c 'A-Za-z0-9\n' - <<<"${setting//GLEAM_/}" | tr 'A-Z' 'a-z')
    IFS=, read -r -a vars <<<"$setting"
    start_server "serve-$name" "${vars[@]}"
    run "$name" env "${vars[@]}" GLEAM_STATS="$OUT/wire-$name.json" \
        "$C/gleam" run --peer "$peer_id@$peer_addr" --config-dir "$cfg" -- "$C/examples/bench_driver"
    floor "$setting" "${vars[@]}"
done

python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
res = {}
names = ["local", "loopback", "link"] + sorted(f[6:-5] for f in os.listdir(out)
                                                if f.startswith("bench-loopback-") and f.endswith(".json"))
for name in names:
    try:
        res[name] = json.load(open(os.path.join(out, f"bench-{name}.json")))
    except Exception:
        pass
if "local" not in res:
    sys.exit("no local result")
loc = res["local"]
link_mib_s = 1e9 / 8 / 2**20
print()
others = [n for n in names[1:] if n in res]
print(f"{'metric':28} {'local':>12}" + "".join(f" {n[:12]:>12} {'ratio':>8}" for n in others))
for key, better in (("sync_rtt_us", "lower"), ("sync_rtt_median_us", "lower"), ("launches_per_s", "higher"),
                    ("htod_mib_s", "higher"), ("dtoh_mib_s", "higher"), ("htod_cold_mib_s", "higher")):
    if key not in loc:
        continue
    row = f"{key:28} {loc[key]:12.1f}"
    for name in others:
        if name in res and key in res[name]:
            v = res[name][key]
            row += f" {v:12.1f} {v / loc[key]:8.3f}"
    print(row)
for burst in loc.get("launch_cpu_us", {}):
    row = f"{'launch_cpu_us ' + burst:28} {loc['launch_cpu_us'][burst]:12.3f}"
    for name in others:
        if name in res and burst in res[name].get("launch_cpu_us", {}):
            row += f" {res[name]['launch_cpu_us'][burst]:12.3f} {'':8}"
    print(row)
for call in loc.get("query_ns", {}):
    row = f"{'query_ns ' + call:28} {loc['query_ns'][call]:12.1f}"
    for name in others:
        if name in res and call in res[name].get("query_ns", {}):
            v = res[name]["query_ns"][call]
            row += f" {v:12.1f} {v / loc['query_ns'][call]:8.3f}"
    print(row)
if "link" in res:
    for key in ("htod_mib_s", "dtoh_mib_s", "htod_cold_mib_s"):
        if key not in res["link"]:
            continue
        print(f"{key} over the emulated link vs the link rate ({link_mib_s:.1f} MiB/s): "
              f"{res['link'][key] / link_mib_s:.3f}")
PY
for name in loopback link $(cd "$OUT" && ls bench-loopback-*.json 2>/dev/null | sed 's/^bench-//; s/\.json$//'); do
    [ -f "$OUT/wire-$name.json" ] && echo "wire bytes, $name: $(cat "$OUT/wire-$name.json")"
done
