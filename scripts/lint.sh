#!/usr/bin/env bash
# Gleam's static checks (CI runs them before the tests): formatting, clippy with warnings as errors under
# the workspace's lint set, and the dependency check (crate graph along the data path, no unused deps).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
bash scripts/check-deps.sh
