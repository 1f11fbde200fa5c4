#!/usr/bin/env bash
# Issue 8's GPU-machine comparison: every PyTorch example (examples/pytorch/) and the cuBLAS C++ example
# (examples/cuda/streams_cublas.cu) run twice locally on NVIDIA's driver (to show whether a workload is
# deterministic there) and once through Gleam (`gleam serve --backend cuda` over loopback, started with a clean
# environment, and `gleam run --peer ... -- CMD`), in one run. Compares the result lines (stdout without the
# `perf:` lines), prints the latencies side by side, and checks from /proc/self/maps (GLEAM_PRINT_MAPS=1, see
# examples/pytorch/common.py) that the Gleam runs mapped Gleam's libcuda only, never NVIDIA's.
#
#   bash scripts/gpu/build-carry.sh                       # on the development machine: .carry/{gleam,libgleamcuda.so}
#   OUT=/some/folder bash scripts/gpu/compare-pytorch.sh  # on the GPU machine, carrying .carry
#
# Also runs the CI runtime-API programs (tests/cuda/*.cu, cases cuda_NAME), whose local output shows what
# NVIDIA's driver answers to the error cases they check, and examples/cuda/launch_errors.cu (what the driver
# answers an impossible launch, to a driver-API caller and to the runtime).
# Every Gleam run goes through `gleam trace` (report in the tgz: CASE.trace.tsv): the summary lists, per
# case, the entry points Gleam does not implement that were reached, the export tables and slots it does
# not serve, and the module bytes sent; the first case runs a second time at the end, against the same
# peer (a new session: its images come from the peer's content cache), for module bytes on a second run.
# Env: CASES (space-separated case names, default all; see `cases` below), CARRY (default .carry),
# RUN_TIMEOUT (s per run, default 300), LOCAL_RUNS (default 2), PYTHON (default python3),
# BACKEND (default cuda; emu checks the script itself on a machine without a GPU), SERVE_ENV ("VAR=VALUE ..."
# for the server's clean environment).
# $OUT afterwards: compare-pytorch.log (summary) and compare-pytorch.tgz (every output and log).
# Exit 1 if any result differs from the local one, a run fails, or a Gleam run mapped NVIDIA's libcuda.
set -u -o pipefail
. "$(dirname "$0")/common.sh"

CARRY=${CARRY:-.carry}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
BACKEND=${BACKEND:-cuda}
LOCAL_RUNS=${LOCAL_RUNS:-2}
PYTHON=${PYTHON:-python3}
LOGS="$WORK/compare-pytorch"
mkdir -p "$LOGS"
SUMMARY="$OUT/compare-pytorch.log"
: > "$SUMMARY"
say() { echo "$@" | tee -a "$SUMMARY"; }

SYSTEM_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
# Kept in every environment, the server's clean one included (the GPU machines require them).
KEEP_ENV=(NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1)
export "${KEEP_ENV[@]}"

# name | command (run from the repo root)
cases() {
    cat <<'CASES'
resnet50_fp32|PY examples/pytorch/resnet50.py --dtype fp32
resnet50_fp16|PY examples/pytorch/resnet50.py --dtype fp16
resnet50_graph_fp16|PY examples/pytorch/resnet50_graph.py --dtype fp16
resnet50_graph_fp32|PY examples/pytorch/resnet50_graph.py --dtype fp32
gpt2_fp32|PY examples/pytorch/gpt2.py --dtype fp32 --new-tokens 16
gpt2_fp16|PY examples/pytorch/gpt2.py --dtype fp16 --new-tokens 16
item_latency|PY examples/pytorch/item_latency.py --n 1000
streams_cublas|BIN/streams_cublas
launch_errors|BIN/launch_errors
CASES
    # The CI runtime-API programs: their local output is the ground truth for the error codes they check.
    for src in tests/cuda/*.cu; do
        n=$(basename "$src" .cu)
        echo "cuda_$n|BIN/$n"
    done
}

server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid" 2>/dev/null
        wait "$server_pid" 2>/dev/null
    fi
    tar czf "$OUT/compare-pytorch.tgz" -C "$WORK" compare-pytorch 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

say "== compare-pytorch $(date -u +%Y-%m-%dT%H:%M:%SZ) carry=$CARRY"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$SUMMARY" 2>&1 || true
"$PYTHON" -c 'import torch, torchvision, transformers; print("torch", torch.__version__, "torchvision", torchvision.__version__, "transformers", transformers.__version__)' 2>&1 | tee -a "$SUMMARY"

# The cuBLAS example, built here (this machine has nvcc and cuBLAS): SASS for the H200 plus PTX.
BIN="$WORK/bin"
mkdir -p "$BIN"
cublas_flags=(-lcublas)
if ! "$NVCC" -O2 -gencode arch=compute_90,code=[sm_90,compute_90] -o "$BIN/streams_cublas" \
    examples/cuda/streams_cublas.cu "${cublas_flags[@]}" > "$LOGS/streams_cublas.build.log" 2>&1; then
    # cuBLAS from the Python wheels when the toolkit has none.
    wheel=$("$PYTHON" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null)
    "$NVCC" -O2 -gencode arch=compute_90,code=[sm_90,compute_90] -I"$wheel/include" -o "$BIN/streams_cublas" \
        examples/cuda/streams_cublas.cu -L"$wheel/lib" -l:libcublas.so.13 -Xlinker -rpath="$wheel/lib" \
        >> "$LOGS/streams_cublas.build.log" 2>&1 || say "streams_cublas: did not build (see the tgz)"
fi

# What the driver answers an impossible launch (driver API and runtime).
"$NVCC" -O2 -gencode arch=compute_90,code=[sm_90,compute_90] -o "$BIN/launch_errors" examples/cuda/launch_errors.cu \
    -L"$CUDA_HOME/lib64/stubs" -lcuda > "$LOGS/launch_errors.build.log" 2>&1 ||
    say "launch_errors: did not build (see the tgz)"

# The CI programs (tests/cuda), as CI builds them (PTX only: the driver JIT-compiles it) and natively.
for src in tests/cuda/*.cu; do
    n=$(basename "$src" .cu)
    "$NVCC" -O2 -gencode arch=compute_75,code=compute_75 -L"$CUDA_HOME/lib" -o "$BIN/$n" "$src" \
        > "$LOGS/$n.build.log" 2>&1 ||
        say "$n: did not build (see the tgz)"
done

command_of() { # expands PY and BIN in a case's command
    local cmd=$1
    cmd=${cmd//PY/$PYTHON}
    cmd=${cmd//BIN/$BIN}
    echo "$cmd"
}

selected() {
    [ -z "${CASES:-}" ] && return 0
    case " $CASES " in *" $1 "*) return 0 ;; esac
    return 1
}

results() { grep -v '^perf:' "$1" 2>/dev/null; }
perf_lines() { grep '^perf:' "$1" 2>/dev/null | sed 's/^perf: //'; }

problems=0

# ---- local runs ----
while IFS='|' read -r name cmd; do
    selected "$name" || continue
    for i in $(seq 1 "$LOCAL_RUNS"); do
        # shellcheck disable=SC2046
        GLEAM_PRINT_MAPS=1 timeout "$RUN_TIMEOUT" $(command_of "$cmd") \
            > "$LOGS/$name.local$i.out" 2> "$LOGS/$name.local$i.err"
        echo $? > "$LOGS/$name.local$i.rc"
    done
done < <(cases)

# ---- one Gleam server, real backend, clean environment ----
GLEAM=$(readlink -f "$CARRY/gleam" 2>/dev/null || echo "$CARRY/gleam")
PEER=""
if [ -x "$GLEAM" ] && [ -f "$(dirname "$GLEAM")/libgleamcuda.so" ]; then
    cfg="$WORK/config"
    mkdir -p "$cfg"
    # shellcheck disable=SC2086
    env -i PATH="$PATH" HOME="$HOME" "${KEEP_ENV[@]}" \
        ${SYSTEM_LD_LIBRARY_PATH:+LD_LIBRARY_PATH="$SYSTEM_LD_LIBRARY_PATH"} GLEAM_LOG="${GLEAM_LOG:-info}" ${SERVE_ENV:-} \
        "$GLEAM" serve 127.0.0.1:0 --backend "$BACKEND" --config-dir "$cfg" > "$LOGS/serve.out" 2> "$LOGS/serve.err" &
    server_pid=$!
    for _ in $(seq 1 300); do
        PEER=$(sed -n 's/^gleam serve: listening on \([^ ]*\) as \([^ ]*\).*/\2@\1/p' "$LOGS/serve.out" 2>/dev/null | head -n 1)
        [ -n "$PEER" ] && break
        kill -0 "$server_pid" 2>/dev/null || break
        sleep 0.1
    done
    if [ -z "$PEER" ]; then
        say "gleam serve --backend $BACKEND did not start:"
        tail -n 5 "$LOGS/serve.err" | sed 's/^/    /' | tee -a "$SUMMARY"
        problems=$((problems + 1))
    else
        say "gleam serve --backend $BACKEND: $PEER"
    fi
else
    say "warning: $CARRY/gleam or $CARRY/libgleamcuda.so missing: local runs only"
    problems=$((problems + 1))
fi

if [ -n "$PEER" ]; then
    while IFS='|' read -r name cmd; do
        selected "$name" || continue
        # shellcheck disable=SC2046
        GLEAM_PRINT_MAPS=1 timeout "$RUN_TIMEOUT" "$GLEAM" trace --report "$LOGS/$name.trace.tsv" --peer "$PEER" \
            --config-dir "$WORK/config" -- $(command_of "$cmd") > "$LOGS/$name.gleam.out" 2> "$LOGS/$name.gleam.err"
        echo $? > "$LOGS/$name.gleam.rc"
        [ -n "${FIRST_CASE:-}" ] || FIRST_CASE=$name
    done < <(cases)
    # The first case again: a new session of the same peer, whose content cache has its module images.
    if [ -n "${FIRST_CASE:-}" ]; then
        cmd=$(cases | sed -n "s/^$FIRST_CASE|//p")
        # shellcheck disable=SC2046
        timeout "$RUN_TIMEOUT" "$GLEAM" trace --report "$LOGS/$FIRST_CASE.second.trace.tsv" --peer "$PEER" \
            --config-dir "$WORK/config" -- $(command_of "$cmd") > "$LOGS/$FIRST_CASE.second.out" \
            2> "$LOGS/$FIRST_CASE.second.err"
    fi
fi

# ---- verdicts ----
say ""
say "$(printf '%-20s %-14s %-10s %s' case local-vs-local gleam maps)"
while IFS='|' read -r name cmd; do
    selected "$name" || continue
    l1="$LOGS/$name.local1"
    rc1=$(cat "$l1.rc" 2>/dev/null || echo '?')
    det="single"
    if [ "$LOCAL_RUNS" -ge 2 ]; then
        if diff -q <(results "$l1.out") <(results "$LOGS/$name.local2.out") > /dev/null; then det="same"; else det="DIFFERENT"; fi
    fi
    verdict="not-run"
    maps="-"
    if [ -f "$LOGS/$name.gleam.rc" ]; then
        grc=$(cat "$LOGS/$name.gleam.rc")
        if [ "$grc" = "$rc1" ] && diff -q <(results "$l1.out") <(results "$LOGS/$name.gleam.out") > /dev/null; then
            verdict="same"
        else
            verdict="DIFFERENT(rc $grc vs $rc1)"
            problems=$((problems + 1))
            diff <(results "$l1.out") <(results "$LOGS/$name.gleam.out") > "$LOGS/$name.gleam.diff" 2>&1
        fi
        # Python cases print their mapped driver libraries; the C++ one is checked by its process's libs.
        # NVIDIA's driver is libcuda plus the libnvidia-* parts it loads (PTX JIT, ...). NVML
        # (libnvidia-ml, which torch loads itself when the machine has one) is not the driver: it talks to
        # the local kernel module, asks libcuda (here Gleam's, which refuses its table) nothing it needs,
        # and a borrowing laptop without NVIDIA's driver has none; it is reported, not counted.
        if grep -q '^maps: ' "$LOGS/$name.gleam.err"; then
            driver_maps=$(grep '^maps: ' "$LOGS/$name.gleam.err" | grep -v '/libnvidia-ml\.so')
            if grep -q 'libgleamcuda' <<< "$driver_maps" &&
                ! grep -Eq '/libcuda\.so[^ ]*$|libnvidia-' <<< "$driver_maps"; then
                maps="gleam-only"
                grep -q '/libnvidia-ml\.so' "$LOGS/$name.gleam.err" && maps="gleam-only(+NVML)"
            else
                maps="NVIDIA-MAPPED"
                problems=$((problems + 1))
            fi
        fi
    else
        problems=$((problems + 1))
    fi
    [ "$rc1" = 0 ] || problems=$((problems + 1))
    say "$(printf '%-20s %-14s %-10s %s' "$name" "$det" "$verdict" "$maps") (local exit $rc1)"
    if [ -f "$LOGS/$name.gleam.diff" ]; then
        head -n 8 "$LOGS/$name.gleam.diff" | sed 's/^/    /' | tee -a "$SUMMARY"
        tail -n 4 "$LOGS/$name.gleam.err" | sed 's/^/    stderr: /' | tee -a "$SUMMARY"
    fi
done < <(cases)

say ""
say "latencies (local run 1 | gleam):"
while IFS='|' read -r name cmd; do
    selected "$name" || continue
    paste -d'|' <(perf_lines "$LOGS/$name.local1.out") <(perf_lines "$LOGS/$name.gleam.out" 2>/dev/null) |
        sed "s/^/  $name: /; s/|/   |   /" | tee -a "$SUMMARY"
    grep -h '^time:' "$LOGS/$name.local1.err" "$LOGS/$name.gleam.err" 2>/dev/null | sed "s/^/  $name: /" | tee -a "$SUMMARY"
done < <(cases)
say ""
say "gleam trace (per case: unimplemented entry points reached | export tables not served | table slots not"
say "implemented that were called | module images sent, bytes, found on the peer):"
trace_summary() { # $1: a trace report
    local f=$1
    [ -f "$f" ] || { echo "no report"; return; }
    local calls tables slots modules
    calls=$(awk -F'\t' '$1=="call" && $7>0 {printf "%s(%s) ", $2, $7}' "$f")
    tables=$(awk -F'\t' '$1=="table" {printf "%s ", $2}' "$f")
    slots=$(awk -F'\t' '$1=="slot" {printf "%s/%s(%s) ", substr($2,1,8), $3, $4}' "$f")
    modules=$(awk -F'\t' '$1=="modules" {printf "%s sent, %s bytes, %s found", $2, $3, $4}' "$f")
    echo "${calls:-none} | ${tables:-none} | ${slots:-none} | $modules"
}
while IFS='|' read -r name cmd; do
    selected "$name" || continue
    say "  $name: $(trace_summary "$LOGS/$name.trace.tsv")"
done < <(cases)
if [ -n "${FIRST_CASE:-}" ]; then
    say "module images, $FIRST_CASE: first run: $(awk -F'\t' '$1=="modules" {print $3 " bytes sent (" $2 " images), " $4 " found"}' "$LOGS/$FIRST_CASE.trace.tsv" 2>/dev/null)"
    say "module images, $FIRST_CASE: second run: $(awk -F'\t' '$1=="modules" {print $3 " bytes sent (" $2 " images), " $4 " found"}' "$LOGS/$FIRST_CASE.second.trace.tsv" 2>/dev/null)"
    grep -h '^time:' "$LOGS/$FIRST_CASE.second.err" 2>/dev/null | sed "s/^/  $FIRST_CASE second run: /" | tee -a "$SUMMARY"
fi

say ""
say "maps of one local run (NVIDIA's driver expected):"
grep -h '^maps: ' "$LOGS"/resnet50_fp32.local1.err 2>/dev/null | sed 's/^/  /' | tee -a "$SUMMARY"
say "maps of one Gleam run (libgleamcuda only expected):"
grep -h '^maps: ' "$LOGS"/resnet50_fp32.gleam.err 2>/dev/null | sed 's/^/  /' | tee -a "$SUMMARY"
say "== compare-pytorch: $problems problem(s)"
[ "$problems" -eq 0 ]
