#!/usr/bin/env bash
# The dependency check CI runs: the crate graph follows the data path (app -> shim -> client -> protocol
# <- server <- backends), no crate imports one beside or above it, the shim does not link the mesh's
# discovery, the protocol crate does no IO, and no crate declares a dependency it does not use.
set -euo pipefail
cd "$(dirname "$0")/.."

fail=0

# Normal (non-dev) dependencies of a package, as crate names, one per line.
deps_of() {
    cargo tree --locked -p "$1" -e normal --prefix none --format '{p}' 2>/dev/null |
        awk '{print $1}' | sort -u
}

# must_not PACKAGE CRATE...: none of CRATE may be in PACKAGE's dependency tree.
must_not() {
    local pkg=$1
    shift
    local tree
    tree=$(deps_of "$pkg")
    for crate in "$@"; do
        if grep -qx "$crate" <<<"$tree"; then
            echo "check-deps: $pkg depends on $crate, which it must not (see the README's crate table)"
            fail=1
        fi
    done
}

# Nothing below the shim on the data path knows the network daemon; the protocol does no IO.
must_not gleam-shim mdns-sd foca gleam-mesh gleam-host gleam-server gleam-real gleam-emu
must_not gleam-protocol quinn tokio gleam-client gleam-server gleam-host gleam-auth
must_not gleam-client gleam-server gleam-host gleam-real gleam-emu gleam-mesh mdns-sd foca
must_not gleam-server quinn tokio gleam-client gleam-host gleam-real gleam-emu gleam-mesh
must_not gleam-host gleam-client gleam-real gleam-emu gleam-mesh mdns-sd foca
must_not gleam-real gleam-client gleam-host gleam-emu gleam-mesh quinn tokio
must_not gleam-emu gleam-client gleam-host gleam-real gleam-mesh quinn tokio cudarc
must_not gleam-ptx gleam-protocol gleam-server quinn tokio
must_not gleam-fatbin gleam-protocol quinn tokio
must_not gleam-auth gleam-mesh gleam-protocol mdns-sd foca
must_not gleam-mesh gleam-client gleam-server gleam-host gleam-real gleam-emu gleam-shim

# Declared but unused dependencies (cargo-machete: installed by .ci/run when missing).
if command -v cargo-machete >/dev/null 2>&1; then
    if ! cargo machete --with-metadata; then
        echo "check-deps: unused dependencies (above); remove them from the Cargo.toml files"
        fail=1
    fi
else
    echo "check-deps: cargo-machete is not installed; skipping the unused-dependency check"
    fail=1
fi

if [ "$fail" = 0 ]; then
    echo "check-deps: the crate graph follows the data path; no unused dependencies"
fi
exit "$fail"
