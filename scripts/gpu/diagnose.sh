#!/usr/bin/env bash
# On the GPU machine: the failing PyTorch/cuBLAS cases once more, with every shim call logged in order
# (GLEAM_LOG=gleamcuda=trace) and, for a crash, gdb's backtrace. For finding what a workload needs.
#   OUT=/some/folder bash scripts/gpu/diagnose.sh      (carrying .carry, as compare-pytorch.sh)
# Env: DIAG_CASES (default "streams_cublas cuda_async_pinned"), CRASH_CMD (default: ResNet-50 fp16).
set -u -o pipefail
. "$(dirname "$0")/common.sh"
CARRY=${CARRY:-.carry}
GLEAM=$(readlink -f "$CARRY/gleam")
PYTHON=${PYTHON:-python3}
KEEP_ENV=(NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1)
export "${KEEP_ENV[@]}"
cfg="$WORK/config"; mkdir -p "$cfg" "$WORK/bin"
env -i PATH="$PATH" HOME="$HOME" "${KEEP_ENV[@]}" ${LD_LIBRARY_PATH:+LD_LIBRARY_PATH="$LD_LIBRARY_PATH"} \
    GLEAM_LOG=info "$GLEAM" serve 127.0.0.1:0 --backend cuda --config-dir "$cfg" > "$OUT/diag-serve.out" 2> "$OUT/diag-serve.err" &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 1 300); do
    PEER=$(sed -n 's/^gleam serve: listening on \([^ ]*\) as \([^ ]*\).*/\2@\1/p' "$OUT/diag-serve.out" | head -n 1)
    [ -n "$PEER" ] && break; sleep 0.1
done
echo "peer: $PEER"
wheel=$("$PYTHON" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null)
"$NVCC" -O2 -gencode arch=compute_90,code=[sm_90,compute_90] -o "$WORK/bin/streams_cublas" examples/cuda/streams_cublas.cu -lcublas \
    > "$OUT/diag-build.log" 2>&1 ||
    "$NVCC" -O2 -gencode arch=compute_90,code=[sm_90,compute_90] -I"$wheel/include" -o "$WORK/bin/streams_cublas" \
        examples/cuda/streams_cublas.cu -L"$wheel/lib" -l:libcublas.so.13 -Xlinker -rpath="$wheel/lib" >> "$OUT/diag-build.log" 2>&1
"$NVCC" -O2 -gencode arch=compute_75,code=compute_75 -o "$WORK/bin/async_pinned" tests/cuda/async_pinned.cu >> "$OUT/diag-build.log" 2>&1
for c in ${DIAG_CASES:-streams_cublas async_pinned}; do
    GLEAM_LOG=gleamcuda=trace timeout 120 "$GLEAM" run --peer "$PEER" --config-dir "$cfg" -- "$WORK/bin/$c" \
        > "$OUT/diag-$c.out" 2> "$OUT/diag-$c.log"
    echo "$c: rc $? ($(wc -l < "$OUT/diag-$c.log") log lines)"
    tail -3 "$OUT/diag-$c.out"
done
crash=${CRASH_CMD:-$PYTHON examples/pytorch/resnet50.py --dtype fp16}
if command -v gdb >/dev/null; then
    # shellcheck disable=SC2086
    timeout 200 "$GLEAM" run --peer "$PEER" --config-dir "$cfg" -- gdb -q -batch -ex run -ex "thread apply all bt 25" \
        --args $crash > "$OUT/diag-crash.out" 2> "$OUT/diag-crash.err"
    echo "crash run: rc $?"; grep -n "SIGSEGV\|^#" "$OUT/diag-crash.out" | head -40
else
    # shellcheck disable=SC2086
    PYTHONFAULTHANDLER=1 timeout 200 "$GLEAM" run --peer "$PEER" --config-dir "$cfg" -- $crash > "$OUT/diag-crash.out" 2> "$OUT/diag-crash.err"
    echo "crash run (no gdb): rc $?"; tail -30 "$OUT/diag-crash.err"
fi
