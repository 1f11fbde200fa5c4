#!/usr/bin/env bash
# On the GPU machine: what cuBLAS needs of the driver's private tables. Runs streams_cublas and a torch
# matmul (1) on NVIDIA's driver through the table spy (tools/gpu/table_spy: every slot call of the tables
# in SPY_TABLES logged with arguments and results) and (2) through Gleam with every shim call logged in
# order (GLEAM_LOG=gleamcuda=trace): the two logs side by side show where Gleam's answers differ.
#   OUT=/some/folder bash scripts/gpu/cublas-probe.sh      (carrying .carry)
set -u -o pipefail
. "$(dirname "$0")/common.sh"
CARRY=${CARRY:-.carry}
GLEAM=$(readlink -f "$CARRY/gleam")
PYTHON=${PYTHON:-python3}
real=$(ldconfig -p | sed -n 's/.*libcuda.so.1 .*=> //p' | head -n 1)
[ -e /usr/local/nvidia/lib64/libcuda.so.1 ] && real=/usr/local/nvidia/lib64/libcuda.so.1
echo "real driver: $real"
nm -D --defined-only "$real" | awk '$3 ~ /^cu[A-Z]/ {print $3}' | sort -u > "$WORK/exports.txt"
bash tools/gpu/table_spy/gen.sh "$WORK/exports.txt" "$WORK/spy" > "$OUT/spy-build.log" 2>&1 || { echo "spy build failed"; cat "$OUT/spy-build.log"; }
wheel=$("$PYTHON" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null)
mkdir -p "$WORK/bin"
"$NVCC" -O2 -gencode arch=compute_90,code=[sm_90,compute_90] -o "$WORK/bin/streams_cublas" examples/cuda/streams_cublas.cu -lcublas \
    > "$OUT/build.log" 2>&1 ||
    "$NVCC" -O2 -gencode arch=compute_90,code=[sm_90,compute_90] -I"$wheel/include" -o "$WORK/bin/streams_cublas" \
        examples/cuda/streams_cublas.cu -L"$wheel/lib" -l:libcublas.so.13 -Xlinker -rpath="$wheel/lib" >> "$OUT/build.log" 2>&1
cat > "$WORK/mm.py" <<'PY'
import torch
torch.manual_seed(0)
a = torch.randn(256, 256, device="cuda")
print("fp32", (a @ a).sum().item())
h = a.half()
print("fp16", (h @ h).float().sum().item())
PY
export SPY_REAL="$real"
spy() { # name tables cmd...
    local name=$1 tables=$2; shift 2
    SPY_TABLES=$tables SPY_LOG="$OUT/spy-$name" LD_LIBRARY_PATH="$WORK/spy${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        timeout 120 "$@" > "$OUT/spy-$name.out" 2>&1
    echo "spy $name ($tables): rc $?"; tail -2 "$OUT/spy-$name.out"
}
spy cublas-a f8cff951,21318c60,1734dc26 "$WORK/bin/streams_cublas"
spy cublas-b 263e8860,42d85a81,a094798c "$WORK/bin/streams_cublas"
spy torch-a f8cff951,21318c60,1734dc26 "$PYTHON" "$WORK/mm.py"
"$PYTHON" "$WORK/mm.py" > "$OUT/local-torch.out" 2>&1; cat "$OUT/local-torch.out"

cfg="$WORK/config"; mkdir -p "$cfg"
env -i PATH="$PATH" HOME="$HOME" ${LD_LIBRARY_PATH:+LD_LIBRARY_PATH="$LD_LIBRARY_PATH"} \
    GLEAM_LOG=info "$GLEAM" serve 127.0.0.1:0 --backend cuda --config-dir "$cfg" > "$OUT/serve.out" 2> "$OUT/serve.err" &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 1 300); do
    PEER=$(sed -n 's/^gleam serve: listening on \([^ ]*\) as \([^ ]*\).*/\2@\1/p' "$OUT/serve.out" | head -n 1)
    [ -n "$PEER" ] && break; sleep 0.1
done
for prog in cublas torch; do
    case $prog in cublas) cmd=("$WORK/bin/streams_cublas") ;; torch) cmd=("$PYTHON" "$WORK/mm.py") ;; esac
    GLEAM_LOG=gleamcuda=trace timeout 120 "$GLEAM" run --peer "$PEER" --config-dir "$cfg" -- "${cmd[@]}" \
        > "$OUT/gleam-$prog.out" 2> "$OUT/gleam-$prog.log"
    echo "gleam $prog: rc $?"; tail -2 "$OUT/gleam-$prog.out"; grep -i "call failed\|slot" "$OUT/gleam-$prog.log" | head -8
done
