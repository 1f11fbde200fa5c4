#!/usr/bin/env bash
# Record PTX-interpreter conformance data on a machine with a real GPU.
#
#   OUT=/some/folder bash scripts/gpu/record-conformance.sh
#   OUT=/some/folder CASES='tex* tld4* surf*' bash scripts/gpu/record-conformance.sh
#
#   OUT=/some/folder KEEP_PTX=1 CASES='tex2d_u8_norm_border tex3d_linear_ties' bash scripts/gpu/record-conformance.sh
#
# CASES (optional): space-separated case names or shell patterns; only those cases are recorded, only their
# data folders replaced, and only their data folders go into the bundle (default: every case, with the data
# folder rebuilt from scratch).
# KEEP_PTX=1 (optional): skip step 1 and record with the PTX committed in remoting/ptx/conformance/ptx/ (the
# PTX the interpreter replays and the other cases were recorded with); the bundle then holds no PTX.
#
# 1. nvcc -ptx every kernel: remoting/ptx/conformance/kernels/*.cu -> remoting/ptx/conformance/ptx/
#    and examples/kernels/*.cu -> examples/kernels/ (same base name, .ptx).
# 2. Builds remoting/ptx/conformance/harness.c against the driver API.
# 3. Runs every remoting/ptx/conformance/cases/*.case (or those CASES selects), writing
#    remoting/ptx/conformance/data/<case>/p<i>.{in,out} and, for cases with texture or surface
#    resources, <resource>.{in,out}. A failing case is reported and its data folder removed; the
#    others go on.
# 4. $OUT/conformance.tgz: the PTX files and the data folder, paths relative to the repo root
#    (untar in place: tar xzf conformance.tgz). $OUT/conformance.log: the full log.
# Exit status: 0 if everything compiled and every case ran, 1 otherwise.
set -u -o pipefail
. "$(dirname "$0")/common.sh"

CONF=remoting/ptx/conformance
LOG="$OUT/conformance.log"
: > "$LOG"
log() { echo "$@" | tee -a "$LOG"; }

log "== record-conformance $(date -u +%Y-%m-%dT%H:%M:%SZ)"
if [ -z "$NVCC" ]; then
    log "error: nvcc not found (set NVCC=/path/to/nvcc)"
    exit 1
fi
log "nvcc: $NVCC"
"$NVCC" --version >> "$LOG" 2>&1
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader >> "$LOG" 2>&1 || true

failures=0
failed_list=""

# ---- 1. PTX ----
mkdir -p "$CONF/ptx"
if [ "${KEEP_PTX:-0}" = 1 ]; then
    log "ptx  kept: recording with the committed $CONF/ptx/*.ptx (KEEP_PTX=1)"
fi
compile() {
    local src=$1 dst=$2
    if "$NVCC" -ptx -arch=compute_75 -lineinfo -O3 -o "$dst" "$src" > "$WORK/nvcc.log" 2>&1; then
        log "ptx  ok    $src -> $dst"
        if [ -s "$WORK/nvcc.log" ]; then
            sed 's/^/      /' "$WORK/nvcc.log" >> "$LOG"
        fi
    else
        log "ptx  FAIL  $src"
        sed 's/^/      /' "$WORK/nvcc.log" | tee -a "$LOG"
        rm -f "$dst"
        failures=$((failures + 1))
        failed_list="$failed_list nvcc:$(basename "$src")"
    fi
}
if [ "${KEEP_PTX:-0}" != 1 ]; then
    for src in "$CONF"/kernels/*.cu; do
        compile "$src" "$CONF/ptx/$(basename "$src" .cu).ptx"
    done
    for src in examples/kernels/*.cu; do
        compile "$src" "examples/kernels/$(basename "$src" .cu).ptx"
    done
fi

# ---- 2. harness ----
HARNESS="$WORK/harness"
stubs=""
for d in "$CUDA_HOME/lib64/stubs" "$CUDA_HOME/targets/x86_64-linux/lib/stubs"; do
    [ -d "$d" ] && stubs="$stubs -L$d"
done
# shellcheck disable=SC2086
if "$NVCC" -O2 -o "$HARNESS" "$CONF/harness.c" -lcuda > "$WORK/build.log" 2>&1; then
    log "harness built with nvcc"
elif gcc -O2 -std=gnu11 -I"$CUDA_HOME/include" -o "$HARNESS" "$CONF/harness.c" $stubs -lcuda >> "$WORK/build.log" 2>&1; then
    log "harness built with gcc"
else
    log "harness BUILD FAILED:"
    sed 's/^/      /' "$WORK/build.log" | tee -a "$LOG"
    exit 1
fi

# ---- 3. cases ----
selected() {
    [ -z "${CASES:-}" ] && return 0
    local pattern
    for pattern in $CASES; do
        # shellcheck disable=SC2053
        [[ $1 == $pattern ]] && return 0
    done
    return 1
}
if [ -z "${CASES:-}" ]; then
    rm -rf "$CONF/data"
else
    log "recording only: $CASES"
fi
mkdir -p "$CONF/data"
total=0
passed=0
recorded=""
for case in "$CONF"/cases/*.case; do
    name=$(basename "$case" .case)
    selected "$name" || continue
    rm -rf "${CONF:?}/data/$name"
    total=$((total + 1))
    if timeout 300 "$HARNESS" "$case" "$CONF/ptx" "$CONF/data/$name" > "$WORK/case.log" 2>&1; then
        passed=$((passed + 1))
        recorded="$recorded $CONF/data/$name"
        log "case PASS  $name"
        sed 's/^/      /' "$WORK/case.log" >> "$LOG"
    else
        rc=$?
        log "case FAIL  $name (exit $rc): $(grep -v '^$' "$WORK/case.log" | tail -n 1)"
        sed 's/^/      /' "$WORK/case.log" >> "$LOG"
        rm -rf "${CONF:?}/data/$name"
        failures=$((failures + 1))
        failed_list="$failed_list case:$name"
    fi
done

# ---- 4. bundle ----
# A selective run bundles only what it recorded, so untarring it touches nothing else.
if [ -n "${CASES:-}" ]; then
    data_paths=$recorded
else
    data_paths="$CONF/data"
fi
ptx_paths=""
if [ "${KEEP_PTX:-0}" != 1 ]; then
    ptx_paths="$CONF/ptx $(ls examples/kernels/*.ptx 2>/dev/null)"
fi
if [ -z "$total" ] || [ "$total" -eq 0 ]; then
    log "error: CASES='${CASES:-}' selects no case in $CONF/cases"
    failures=$((failures + 1))
fi
log "== conformance: $passed/$total cases passed; $failures failure(s)${failed_list:+:$failed_list}"
if [ -n "${data_paths// /}${ptx_paths// /}" ]; then
    # shellcheck disable=SC2086
    tar czf "$OUT/conformance.tgz" $ptx_paths $data_paths
    log "== bundle: $OUT/conformance.tgz ($(du -h "$OUT/conformance.tgz" | cut -f1)):"
    tar tzf "$OUT/conformance.tgz" | sed 's/^/      /' >> "$LOG"
else
    log "== bundle: nothing recorded, no $OUT/conformance.tgz"
fi
[ "$failures" -eq 0 ]
