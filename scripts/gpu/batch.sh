#!/usr/bin/env bash
# Runs several GPU scripts in one device call within a deadline: each phase gets its own $OUT/<phase>/ and
# is given the time left (minus a margin) so that the call always returns what it collected.
#   DEADLINE=580 OUT=... bash scripts/gpu/batch.sh pytorch driver-api tests peer bench lan upload
# $OUT afterwards: batch.tgz (every phase's folder) and summary.txt (each phase's stdout tail), since a
# device call hands back only a few files.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
START=$(date +%s)
DEADLINE=${DEADLINE:-580}
DEST=${OUT:-/tmp/gleam-batch}
mkdir -p "$DEST"
BASE=$(mktemp -d)
C=${CARRY:-.carry}
finish() {
    for d in "$BASE"/*/; do
        [ -d "$d" ] || continue
        echo "===== $(basename "$d")"
        tail -n 60 "$d/stdout" 2>/dev/null
    done > "$DEST/summary.txt"
    # Only the small files: a device call hands back files of limited size.
    (cd "$BASE" && find . -type f -size -2M -print0 | tar czf "$DEST/batch.tgz" --null -T - 2>/dev/null)
}
trap finish EXIT
left() { echo $((DEADLINE - ($(date +%s) - START) - 10)); }
for phase in "$@"; do
    t=$(left)
    [ "$t" -gt 20 ] || { echo "== $phase: skipped (no time left)"; continue; }
    mkdir -p "$BASE/$phase"
    echo "== $phase (up to ${t}s) at $(( $(date +%s) - START ))s"
    case $phase in
        pytorch) OUT="$BASE/$phase" LOCAL_RUNS=${LOCAL_RUNS:-1} RUN_TIMEOUT=${RUN_TIMEOUT:-120} \
            timeout -s INT "$t" bash scripts/gpu/compare-pytorch.sh > "$BASE/$phase/stdout" 2>&1 ;;
        # More PyTorch runs in the same call, e.g. an A/B of one setting: PT2_ENV / PT3_ENV ("VAR=VALUE ...",
        # for the peer and the clients alike), PT2_CASES / PT3_CASES (default: CASES).
        pytorch2|pytorch3) n=${phase#pytorch}; envs="PT${n}_ENV"; cases="PT${n}_CASES"
            # shellcheck disable=SC2086
            env ${!envs:-} SERVE_ENV="${!envs:-}" CASES="${!cases:-${CASES:-}}" OUT="$BASE/$phase" \
                LOCAL_RUNS=${LOCAL_RUNS:-1} RUN_TIMEOUT=${RUN_TIMEOUT:-120} \
                timeout -s INT "$t" bash scripts/gpu/compare-pytorch.sh > "$BASE/$phase/stdout" 2>&1 ;;
        driver-api) OUT="$BASE/$phase" timeout -s INT "$t" bash scripts/gpu/driver-api.sh > "$BASE/$phase/stdout" 2>&1 ;;
        tests)
            for tb in "$C"/tests/*; do
                echo "-- $(basename "$tb")"
                timeout "$(left)" "$tb" --include-ignored --test-threads 4 2>&1 | grep -E '^test |test result|panicked|FAILED' | tail -40
            done > "$BASE/$phase/stdout" 2>&1 ;;
        peer) OUT="$BASE/$phase" timeout "$t" bash -c '
            C='"$C"'; cfg=$(mktemp -d)
            env -i PATH="$PATH" HOME="$HOME" GLEAM_CONFIG_DIR="$cfg" "$C/gleam" mesh init >/dev/null 2>&1
            env -i PATH="$PATH" HOME="$HOME" GLEAM_CONFIG_DIR="$cfg" GLEAM_LOG=info \
                "$C/gleam" peer --no-mdns --listen 127.0.0.1:0 --backend cuda 2>"$OUT/peer.log" &
            peer=$!; sleep 4
            GLEAM_CONFIG_DIR="$cfg" "$C/gleam" peers list 2>&1
            echo "-- gleam run (daemon picks; direct path expected)"
            GLEAM_CONFIG_DIR="$cfg" GLEAM_LOG=info "$C/gleam" run -- "$C/examples/vector_add" 2>&1 | tail -6
            GLEAM_CONFIG_DIR="$cfg" "$C/gleam" peers list 2>&1
            echo "-- GLEAM_DIRECT=off"
            GLEAM_DIRECT=off GLEAM_CONFIG_DIR="$cfg" "$C/gleam" run -- "$C/examples/vector_add" 2>&1 | tail -4
            kill $peer; wait $peer' > "$BASE/$phase/stdout" 2>&1 ;;
        bench) OUT="$BASE/$phase" timeout -s INT "$t" bash scripts/gpu/bench.sh > "$BASE/$phase/stdout" 2>&1 ;;
        lan) OUT="$BASE/$phase" BIN="$C" BACKEND=cuda timeout -s INT "$t" bash scripts/bench/lan.sh > "$BASE/$phase/stdout" 2>&1 ;;
        # A second LAN run in the same call, e.g. an A/B of one setting: LAN2_WORKLOADS, LAN2_MODES,
        # LAN2_LINKS, and LAN2_ENV ("VAR=VALUE ...", for the peer and the clients alike).
        lan2) # shellcheck disable=SC2086
            env ${LAN2_ENV:-} WORKLOADS="${LAN2_WORKLOADS:-two-streams-down}" MODES="${LAN2_MODES:-nobulk gleam}" \
                LINKS="${LAN2_LINKS:-L1}" OUT="$BASE/$phase" BIN="$C" BACKEND=cuda \
                timeout -s INT "$t" bash scripts/bench/lan.sh > "$BASE/$phase/stdout" 2>&1 ;;
        upload) OUT="$BASE/$phase/run" timeout -s INT "$t" bash cache/bench/upload.sh "$C" ${UPLOAD_MIB:-256} ${UPLOAD_ROUNDS:-2} cuda > "$BASE/$phase/stdout" 2>&1 ;;
        v1) gcc -o "$BASE/$phase/v1_names" tools/gpu/v1_names.c -ldl && timeout 60 "$BASE/$phase/v1_names" > "$BASE/$phase/stdout" 2>&1 ;;
        spy) OUT="$BASE/$phase" timeout "$t" bash -c '
            real=/usr/local/nvidia/lib64/libcuda.so.1
            nm -D --defined-only "$real" | awk "\$3 ~ /^cu[A-Z]/ {print \$3}" | sort -u > "$OUT/exports.txt"
            bash tools/gpu/table_spy/gen.sh "$OUT/exports.txt" "$OUT/spy" > "$OUT/spy-build.log" 2>&1 || echo "spy build failed"
            for c in "resnet50.py --dtype fp16 --iters 3 --warmup 1" "gpt2.py --dtype fp16 --new-tokens 2"; do
                n=${c%%.py*}
                SPY_REAL=$real SPY_TABLES=${SPY_TABLES:-f8cff951,69a28e9f,da9151d3} SPY_LOG="$OUT/log-$n" \
                    LD_LIBRARY_PATH="$OUT/spy${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 120 python3 examples/pytorch/$c \
                    > "$OUT/$n.out" 2>&1
                echo "$n rc $?"
                cat "$OUT"/log-$n.* | grep -E "^table|^call" | sed "s/ #[0-9]*//; s/+0x[0-9a-f]*//" | sort | uniq -c | sort -rn | head -30
            done' > "$BASE/$phase/stdout" 2>&1 ;;
        diag) OUT="$BASE/$phase" timeout "$t" bash -c '
            C='"$C"'; cfg=$(mktemp -d)
            env -i PATH="$PATH" HOME="$HOME" ${LD_LIBRARY_PATH:+LD_LIBRARY_PATH="$LD_LIBRARY_PATH"} "$C/gleam" serve 127.0.0.1:0 \
                --backend cuda --config-dir "$cfg" > "$OUT/serve.out" 2> "$OUT/serve.err" &
            server=$!
            for _ in $(seq 100); do grep -q listening "$OUT/serve.out" && break; sleep 0.1; done
            peer=$(sed -n "s/^gleam serve: listening on \([^ ]*\) as \([^ ]*\).*/\2@\1/p" "$OUT/serve.out")
            for c in "item_latency.py --n 20" "gpt2.py --dtype fp16 --new-tokens 2"; do
                n=${c%%.py*}
                GLEAM_LOG=gleamcuda=trace timeout 120 "$C/gleam" run --peer "$peer" --config-dir "$cfg" -- \
                    python3 examples/pytorch/$c > "$OUT/$n.out" 2> "$OUT/$n.log"
                echo "== $n rc $?"
                grep -o "call=[A-Za-z_0-9]*.*" "$OUT/$n.log" | sed "s/ [a-z]*=.*//" | sort | uniq -c | sort -rn | head -25
                grep "context limit" "$OUT/$n.log" | sed "s/.*limit=/limit=/" | sort | uniq -c | head
                grep -o "call=[A-Za-z_0-9]*" "$OUT/$n.log" | tail -40 | uniq -c
            done
            kill $server' > "$BASE/$phase/stdout" 2>&1 ;;
        *) echo "unknown phase $phase" ;;
    esac
    echo "   rc $? after $(( $(date +%s) - START ))s"
done
