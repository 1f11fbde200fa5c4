#!/usr/bin/env bash
# Gleam's test suite: builds the workspace (the `gleam` binary, the shim, the examples) and runs every test.
# No GPU needed: CUDA work runs on the `emu` backend, kernels in the PTX interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --all-targets --locked
cargo test --workspace --locked --no-fail-fast 2>&1
