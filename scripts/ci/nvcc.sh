#!/usr/bin/env bash
# nvcc from scripts/ci/install-cuda-toolchain.sh, set up for the PyPI layout: static cudart, and kernels
# embedded as compute_75 PTX only (no SASS), so that the fatbin holds PTX that Gleam's emu backend runs in its
# PTX interpreter (and a real GPU JIT-compiles). Extra arguments go to nvcc; a later -gencode/-arch replaces
# the default one.
#
#   bash scripts/ci/nvcc.sh -O2 -o prog prog.cu
#
# Env: GLEAM_CUDA_TOOLCHAIN (as for the installer), NVCC (an nvcc to use instead, e.g. on the GPU machine).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
if [ -n "${NVCC:-}" ]; then
    nvcc=$NVCC
else
    nvcc=$(bash "$ROOT/scripts/ci/install-cuda-toolchain.sh" 2>/dev/null | tail -n 1)
fi
cu=$(dirname "$(dirname "$nvcc")")

arch=(-gencode arch=compute_75,code=compute_75)
for a in "$@"; do
    case "$a" in
        -gencode | -gencode=* | --generate-code* | -arch | -arch=* | --gpu-architecture*) arch=() ;;
    esac
done

# The PyPI wheels put the libraries in lib/, where nvcc.profile expects lib64/: name it explicitly.
exec "$nvcc" -cudart static -L"$cu/lib" "${arch[@]}" "$@"
