# Shared setup for scripts/gpu/*.sh (sourced, not run). Run the scripts from the repo root.
# Sets: ROOT, OUT (must be given), NVCC, CUDA_HOME, WORK (scratch folder, removed on exit).

ROOT=$(pwd)
if [ ! -f "$ROOT/Cargo.toml" ] || [ ! -d "$ROOT/remoting/ptx" ]; then
    echo "error: run from the Gleam repo root (bash scripts/gpu/<name>.sh)" >&2
    exit 1
fi
if [ -z "${OUT:-}" ]; then
    echo "error: OUT must name the folder whose files come back" >&2
    exit 1
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

find_nvcc() {
    if [ -n "${NVCC:-}" ] && [ -x "$NVCC" ]; then
        echo "$NVCC"
        return
    fi
    if command -v nvcc >/dev/null 2>&1; then
        command -v nvcc
        return
    fi
    for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-13*/bin/nvcc /usr/local/cuda-1*/bin/nvcc /opt/cuda/bin/nvcc; do
        if [ -x "$c" ]; then
            echo "$c"
            return
        fi
    done
    echo ""
}

NVCC=$(find_nvcc)
if [ -n "$NVCC" ]; then
    CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
else
    CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gleam-gpu.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
