#!/usr/bin/env bash
# Checks the systemd units as installed by scripts/install.sh: `systemd-analyze verify` must be clean and
# `systemd-analyze security` must rate each at most 4.0 (OK; its --threshold counts tenths, so 40). Needs systemd-analyze (Debian: systemd), not a
# running systemd. Uses an existing build (target/release or target/debug, or the directory given).
set -euo pipefail
cd "$(dirname "$0")/.."
from=${1:-}
if [ -z "$from" ]; then
    for dir in target/release target/debug; do
        if [ -f "$dir/gleam" ] && [ -f "$dir/libgleamcuda.so" ]; then from=$dir; break; fi
    done
fi
[ -n "$from" ] || { echo "check-units.sh: build gleam and gleam-shim first" >&2; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
scripts/install.sh --destdir "$stage" --from "$from" --systemd >/dev/null
# verify resolves the units' dependencies (network-online.target...) inside the root.
mkdir -p "$stage/usr/lib/systemd"
cp -a /usr/lib/systemd/system "$stage/usr/lib/systemd/"
status=0
for unit in gleam-peer gleam-borrow; do
    if ! out=$(systemd-analyze verify --root="$stage" "/etc/systemd/system/$unit.service" 2>&1) || [ -n "$out" ]; then
        echo "$unit.service: systemd-analyze verify: ${out:-failed}"
        status=1
    fi
    line=$(systemd-analyze security --offline=yes --root="$stage" --threshold=40 \
        "/etc/systemd/system/$unit.service" 2>&1 | tail -1) || status=1
    echo "$unit.service: verify clean; ${line#→ }"
done
exit $status
