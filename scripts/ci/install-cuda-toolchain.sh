#!/usr/bin/env bash
# Install NVIDIA's CUDA 13.0 compiler (nvcc, cicc, ptxas, fatbinary, nvlink), the static CUDA runtime
# (libcudart_static.a), the runtime headers and CCCL (needed by cuda_fp16.h and friends) from PyPI, on a machine with no GPU and no driver.
# Idempotent: a complete install is reused. Prints the path of nvcc on its last line (stdout).
#
#   bash scripts/ci/install-cuda-toolchain.sh [DIR]
#   GLEAM_CUDA_TOOLCHAIN=DIR bash scripts/ci/install-cuda-toolchain.sh
#
# DIR defaults to target/cuda-toolchain (relative to the repo root). The toolkit lands in
# DIR/nvidia/cu13/{bin,include,lib,nvvm}. Pinned to 13.0: the GPU machine's driver (580) is CUDA 13.0, and
# PTX or cubins from a newer toolkit would not load there. Use scripts/ci/nvcc.sh to compile with it.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${1:-${GLEAM_CUDA_TOOLCHAIN:-$ROOT/target/cuda-toolchain}}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
CU=$DIR/nvidia/cu13
PYTHON=${PYTHON:-python3}

complete() {
    [ -x "$CU/bin/nvcc" ] && [ -x "$CU/bin/ptxas" ] && [ -x "$CU/nvvm/bin/cicc" ] &&
        [ -f "$CU/lib/libcudart_static.a" ] && [ -f "$CU/include/cuda_runtime.h" ] &&
        [ -f "$CU/include/crt/host_config.h" ] && [ -e "$CU/include/nv/target" ] &&
        [ -f "$DIR/.gleam-complete-v2" ]
}

if ! complete; then
    echo "install-cuda-toolchain: installing CUDA 13.0 nvcc and static cudart into $DIR" >&2
    # One pip call, into a fresh folder: every wheel puts its files under nvidia/cu13/, and `pip --target`
    # would refuse to merge into a folder an earlier call created.
    STAGE=$(mktemp -d "$DIR/.stage.XXXXXX")
    trap 'rm -rf "$STAGE"' EXIT
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --target "$STAGE" \
        "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*" \
        "nvidia-nvvm==13.0.*" "nvidia-cuda-cccl==13.0.*" >&2
    rm -rf "$DIR/nvidia"
    mv "$STAGE/nvidia" "$DIR/nvidia"
    touch "$DIR/.gleam-complete-v2"
    if ! complete; then
        echo "install-cuda-toolchain: the install in $DIR is incomplete (missing nvcc, cicc, ptxas or cudart)" >&2
        exit 1
    fi
fi
"$CU/bin/nvcc" --version | tail -n 2 >&2
echo "$CU/bin/nvcc"
