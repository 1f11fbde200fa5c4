#!/usr/bin/env bash
# Walks through the README's service set-up without touching this system: in private mount and network
# namespaces (a copy of /etc; empty /usr/local, /var/lib, /run, /home), it runs scripts/install.sh
# --systemd --init, starts the daemon as gleam-peer.service would (its User=, UMask=, RuntimeDirectory= and
# ExecStart=; systemd itself does not run here, so its sandbox is not applied), then checks that a user in
# group `gleam` can list the mesh and `gleam run` through the daemon, and that another user is told why not.
# Needs root. Usage: contrib/try-service.sh [BUILD_DIR]   (default target/debug)
set -euo pipefail
if [ "${1:-}" != --inside ]; then
    exec unshare -m -n "$0" --inside "${1:-target/debug}"
fi
from=$(realpath "$2")
repo=$(realpath "$(dirname "$0")/..")
mount --make-rprivate /
etc=$(mktemp -d)
cp -a /etc/. "$etc"
mount --bind "$etc" /etc
for dir in /usr/local /var/lib /run /home; do mount -t tmpfs tmpfs "$dir"; done
mkdir -p /run/lock
ip link set lo up
cd "$repo"
echo "## scripts/install.sh --systemd --init"
scripts/install.sh --from "$from" --systemd --init
ls -ld /var/lib/gleam
echo "## gleam-peer.service's ExecStart, as its User= with its UMask= and RuntimeDirectory="
install -d -o gleam -g gleam -m 0750 /run/gleam
exec_start=$(sed -n 's/^ExecStart=//p' /etc/systemd/system/gleam-peer.service)
(umask 077; runuser -u gleam -- env GLEAM_CONFIG_DIR=/var/lib/gleam GLEAM_LOG=info $exec_start --backend emu \
    >/run/daemon.log 2>&1 </dev/null) >/dev/null 2>&1 &
daemon=$!
# Stops the daemon: the subshell's descendants (runuser, then gleam), deepest first.
descendants() { local child; for child in $(pgrep -P "$1"); do descendants "$child"; echo "$child"; done; }
trap 'kill $(descendants $daemon) 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S /run/gleam/daemon.sock ] && break; sleep 0.1; done
ls -l /run/gleam/daemon.sock
code=$(runuser -u gleam -- gleam mesh show --code --json --config-dir /var/lib/gleam |
    sed -n 's/.*"join_code": "\(.*\)".*/\1/p')
useradd -m -G gleam alice
useradd -m bob
echo "## alice, in group gleam, with no daemon of her own"
runuser -u alice -- gleam peers list
runuser -u alice -- gleam mesh join "$code"
runuser -u alice -- gleam run -- /bin/true
echo "alice: gleam run -- /bin/true succeeded"
echo "## bob, not in group gleam"
if runuser -u bob -- gleam peers list; then echo "bob reached the daemon" >&2; exit 1; fi
echo "ok"
