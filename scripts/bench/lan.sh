#!/usr/bin/env bash
# The LAN benchmark (issue 12), side by side in one run: workloads x links x modes, with bytes on the wire,
# the ratio to the classic-remoting baseline and to the ideal, and the bare-quinn floor.
#
#   cargo build --release --bins --example bench_workloads --example quinn_floor -p gleam -p gleam-shim
#   bash scripts/bench/lan.sh                    # BACKEND=emu here (scaled-down sizes), cuda on a GPU machine
#
# Workloads (examples/bench_workloads.rs): launch-storm (10,000 small launches, a sync every 100), weights
# (512 MiB uploaded, then 50 matmuls; cold = content the peer never saw, warm = the same content again),
# two-streams (a 1 GiB upload on one stream beside a launch-and-sync loop on another: the loop's p99 during
# the upload against its idle p99), two-streams-down (the same beside a 1 GiB download; not run unless
# WORKLOADS names it).
# Links: L0 loopback; L1 1 Gbit/s, 1 ms RTT; L2 300 Mbit/s, 5 ms RTT, 2 ms jitter, 0.5% loss (`gleam linkemu`,
# relaying both the peer's port and its session port, GLEAM_SESSION_PORTS).
# Modes: local (NVIDIA's driver directly; cuda only), sync (CUDA_LAUNCH_BLOCKING=1 and GLEAM_CACHE=off: every
# call waited for and every byte sent, the classic remoting baseline), gleam (everything on); MODES picks
# the remote ones ("sync gleam"; add nobulk for gleam with GLEAM_BULK_CONNECTION=off, uploads sharing the
# session connection).
# Ideal = local time (emu: Gleam's loopback time, the nearest thing to a local run) + bytes that must cross /
# link rate + synchronisations x link RTT.
# Env: BACKEND (emu|cuda), BIN (folder with gleam, libgleamcuda.so, examples/; default target/release),
# LINKS ("L0 L1 L2"), WORKLOADS ("launch-storm weights-cold weights-warm two-streams"), OUT (results folder),
# GLEAM_CONGESTION (cubic|bbr, for the peer and the clients), LINK_QUEUE (the emulated links' queue, e.g. 256KiB).
# SERVE_LOG: the peer's GLEAM_LOG (warn; warn,gleam_host=debug logs each request that held the executor 2 ms+).
# CLIENT_LOG: the clients' GLEAM_LOG, into $OUT/<run>.log (warn,gleam_client::upload=debug: each upload's timings).
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release}
BACKEND=${BACKEND:-$(command -v nvidia-smi >/dev/null && echo cuda || echo emu)}
LINKS=${LINKS:-L0 L1 L2}
WORKLOADS=${WORKLOADS:-launch-storm weights-cold weights-warm two-streams}
MODES=${MODES:-sync gleam}
OUT=${OUT:-$(mktemp -d /tmp/gleam-lan-bench.XXXXXX)}
mkdir -p "$OUT"
for f in gleam libgleamcuda.so examples/bench_workloads examples/quinn_floor; do
    [ -e "$BIN/$f" ] || { echo "missing $BIN/$f: build first (see the top of this script)" >&2; exit 1; }
done
if [ "$BACKEND" = emu ]; then
    # The emu backend interprets kernels on the CPU: the same shapes, scaled to finish in minutes.
    export BENCH_LAUNCHES=${BENCH_LAUNCHES:-2000} BENCH_WEIGHTS_MIB=${BENCH_WEIGHTS_MIB:-64}
    export BENCH_MATMULS=${BENCH_MATMULS:-5} BENCH_MATMUL_N=${BENCH_MATMUL_N:-32}
    export BENCH_UPLOAD_MIB=${BENCH_UPLOAD_MIB:-128} BENCH_LOOP_ITERS=${BENCH_LOOP_ITERS:-100}
fi
cfg=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$cfg"; }
trap cleanup EXIT
# shellcheck source=scripts/lib/peer.sh
source scripts/lib/peer.sh

# start_peer NAME PORTS [VAR=VALUE...]: a peer (output in $OUT/NAME.out and .log) whose session processes
# listen on a few fixed ports PORTS (LO-HI: one per session; a session that just ended may still hold its
# port while the next starts), so that an emulated link can carry them too; sets peer_port and id.
start_peer() {
    local name=$1 ports=$2
    shift 2
    start_serving_peer "the peer" "$BIN/gleam" "$BACKEND" "$cfg" "$OUT/$name.out" "$OUT/$name.log" \
        ${LD_LIBRARY_PATH:+LD_LIBRARY_PATH="$LD_LIBRARY_PATH"} GLEAM_LOG="${SERVE_LOG:-warn}" \
        ${GLEAM_CONGESTION:+GLEAM_CONGESTION="$GLEAM_CONGESTION"} "$@" GLEAM_SESSION_PORTS="$ports"
    id=$peer_id
}
# L0's peer, and the peer behind the emulated links. Behind the emulator both ends treat the path as the LAN
# it stands for (GLEAM_LOOPBACK_PATH=lan: Ethernet-sized datagrams, the LAN's bulk controller); they would
# otherwise take it for loopback (all of 127/8 is) and send 6000-byte datagrams.
ETHERNET=GLEAM_LOOPBACK_PATH=lan
start_peer serve 47300-47307
port=$peer_port
SESSION_PORTS=$(seq 47310 47317)
start_peer serve-lan 47310-47317 "$ETHERNET"
lan_port=$peer_port

# Each link: relays on its own loopback address (the peer's port and the session ports).
declare -A LINK_ADDR=([L0]=127.0.0.1 [L1]=127.0.0.2 [L2]=127.0.0.3)
declare -A LINK_ARGS=([L1]="--rate 1gbit --delay 0.5ms" [L2]="--rate 300mbit --delay 2.5ms --jitter 2ms --loss 0.5%")
# The bottleneck's queue (drop-tail; `gleam linkemu`'s default is 1.5 MB, netem's 1000 packets): LINK_QUEUE.
if [ -n "${LINK_QUEUE:-}" ]; then for l in L1 L2; do LINK_ARGS[$l]+=" --queue $LINK_QUEUE"; done; fi
for l in $LINKS; do
    [ "$l" = L0 ] && continue
    for p in "$lan_port" $SESSION_PORTS; do
        # shellcheck disable=SC2086
        "$BIN/gleam" linkemu --listen "${LINK_ADDR[$l]}:$p" --to "127.0.0.1:$p" ${LINK_ARGS[$l]} 2>>"$OUT/linkemu-$l.log" &
        pids+=($!)
    done
done
sleep 0.5

# The floor: a bare quinn connection with Gleam's TLS between two processes, on loopback.
"$BIN/examples/quinn_floor" serve 127.0.0.1:0 > "$OUT/floor-serve.out" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$OUT/floor-serve.out" ] && break; sleep 0.1; done
read -r _ faddr fpeer < "$OUT/floor-serve.out"
"$BIN/examples/quinn_floor" connect "$faddr" "$fpeer" 256 > "$OUT/floor.json" 2> "$OUT/floor.log" ||
    echo '{}' > "$OUT/floor.json"
echo "floor (bare quinn, loopback): $(cat "$OUT/floor.json")"

seed=$(( $(date +%s) % 100000 + 2 ))
run() { # workload link mode
    local w=$1 l=$2 m=$3 prog=$1 name="$1.$2.$3"
    local envs=(BENCH_SEED=1)
    case "$w" in
        weights-cold) prog=weights; envs=(BENCH_SEED=$seed); seed=$((seed + 1)) ;;
        weights-warm) prog=weights ;;
        two-streams-down) prog=two-streams; envs+=(BENCH_DIRECTION=down) ;;
    esac
    [ "$m" = sync ] && envs+=(CUDA_LAUNCH_BLOCKING=1 GLEAM_CACHE=off)
    [ -n "${CLIENT_LOG:-}" ] && envs+=(GLEAM_LOG="$CLIENT_LOG")
    [ "$m" = nobulk ] && envs+=(GLEAM_BULK_CONNECTION=off)
    local p=$port
    [ "$l" != L0 ] && p=$lan_port && envs+=("$ETHERNET")
    if [ "$w" = weights-warm ] && [ "$m" != local ]; then
        # The content once, so that this run is the warm one.
        env "${envs[@]}" "$BIN/gleam" run --peer "$id@${LINK_ADDR[$l]}:$p" --config-dir "$cfg" -- \
            "$BIN/examples/bench_workloads" weights > /dev/null 2>> "$OUT/$name.log"
    fi
    if [ "$m" = local ]; then
        env "${envs[@]}" timeout 900 "$BIN/examples/bench_workloads" "$prog" > "$OUT/$name.json" 2> "$OUT/$name.log"
    else
        env "${envs[@]}" GLEAM_STATS="$OUT/$name.wire.json" timeout 900 "$BIN/gleam" run \
            --peer "$id@${LINK_ADDR[$l]}:$p" --config-dir "$cfg" -- "$BIN/examples/bench_workloads" "$prog" \
            > "$OUT/$name.json" 2> "$OUT/$name.log"
    fi || { echo "$name: FAILED"; tail -3 "$OUT/$name.log"; rm -f "$OUT/$name.json"; return; }
    echo "$name: $(cat "$OUT/$name.json")"
}
for w in $WORKLOADS; do
    [ "$BACKEND" = cuda ] && run "$w" L0 local
    for l in $LINKS; do
        for m in $MODES; do run "$w" "$l" "$m"; done
    done
done

python3 - "$OUT" "$BACKEND" "$LINKS" "$WORKLOADS" "$MODES" <<'PY'
import json, os, sys
out, backend, links, workloads, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split(), sys.argv[5].split()
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception:
        return None
RATE = {"L0": None, "L1": 1e9 / 8, "L2": 300e6 / 8}   # bytes/s
RTT = {"L0": 0.0, "L1": 1e-3, "L2": 5e-3}             # s
floor = load("floor.json") or {}
print()
print(f"backend {backend}; floor (bare quinn on loopback): RTT {floor.get('rtt_median_us', '?')} us, "
      f"upload {floor.get('upload_mib_s', '?')} MiB/s, download {floor.get('download_mib_s', '?')} MiB/s")
print(f"{'workload':16} {'link':4} {'mode':6} {'time s':>9} {'wire MB':>9} {'vs sync':>8} {'vs ideal':>8}  notes")
for w in workloads:
    local = load(f"{w}.L0.local.json")
    base = local or load(f"{w}.L0.gleam.json")
    for l in links:
        for m in (["local"] if l == "L0" and local else []) + modes:
            r = load(f"{w}.{l}.{m}.json")
            if not r:
                print(f"{w:16} {l:4} {m:6} {'failed':>9}")
                continue
            wire = load(f"{w}.{l}.{m}.wire.json") or {}
            mb = (wire.get("sent_bytes", 0) + wire.get("received_bytes", 0)) / 1e6
            sync = load(f"{w}.{l}.sync.json")
            vs_sync = sync["time_s"] / r["time_s"] if sync else float("nan")
            ideal = None
            # A warm run's weights are on the peer already: only what the cache cannot hold must cross.
            must_cross = r["must_cross_bytes"] - (r.get("weights_bytes", 0) if w == "weights-warm" else 0)
            if base:
                ideal = base["time_s"] + r["syncs"] * RTT[l]
                if RATE[l]:
                    ideal += must_cross / RATE[l]
            vs_ideal = r["time_s"] / ideal if ideal else float("nan")
            notes = ""
            if "busy_p99_us" in r:
                idle = r["idle_p99_us"] or float("nan")
                copy = "download" if r.get("direction") == "down" else "upload"
                notes = f"loop p99 idle {r['idle_p99_us']:.0f} us, during {copy} {r['busy_p99_us']:.0f} us ({r['busy_p99_us'] / idle:.1f}x)"
            if "upload_s" in r and "weights_bytes" in r:
                notes = f"upload {r['weights_bytes'] / 2**20 / r['upload_s']:.0f} MiB/s"
                if RATE[l]:
                    notes += f" ({r['weights_bytes'] / r['upload_s'] / RATE[l]:.0%} of the link)"
            print(f"{w:16} {l:4} {m:6} {r['time_s']:9.3f} {mb:9.1f} {vs_sync:8.2f} {vs_ideal:8.2f}  {notes}")
PY
echo "results: $OUT"
