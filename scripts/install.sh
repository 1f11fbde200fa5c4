#!/usr/bin/env bash
# Installs Gleam: `gleam` in PREFIX/bin (and `gleam-peer`, the same binary), Gleam's libcuda
# (libgleamcuda.so) in PREFIX/lib/gleam, where `gleam run` looks for it; with --systemd, the services
# (contrib/gleam-peer.service to lend this device's GPU, contrib/gleam-borrow.service to only borrow),
# the `gleam` user and /var/lib/gleam.
#
#   scripts/install.sh                         # build (release) and install under /usr/local
#   sudo scripts/install.sh --systemd --lend --join CODE     # ... and run the lending service
#   sudo scripts/install.sh --systemd --borrow --join CODE   # ... or the borrow-only one (a laptop)
#
# Options:
#   --prefix DIR     install under DIR (default /usr/local); the units are adjusted to it
#   --destdir DIR    stage everything under DIR (packaging); nothing is started or created on this system
#   --from DIR       take gleam and libgleamcuda.so from DIR instead of building (e.g. target/release)
#   --systemd        also install the units, the sysusers and tmpfiles entries
#   --lend | --borrow   enable and start gleam-peer.service or gleam-borrow.service (implies --systemd)
#   --join CODE      join the mesh as the service's user, before starting it
#   --init           create a new mesh as the service's user (the first device), before starting it
set -euo pipefail
cd "$(dirname "$0")/.."

prefix=/usr/local
destdir=
from=
systemd=false
enable=
join=
init=false
while (($#)); do
    case "$1" in
        --prefix) prefix=$2; shift 2 ;;
        --destdir) destdir=$2; shift 2 ;;
        --from) from=$2; shift 2 ;;
        --systemd) systemd=true; shift ;;
        --lend) systemd=true; enable=gleam-peer; shift ;;
        --borrow) systemd=true; enable=gleam-borrow; shift ;;
        --join) join=$2; shift 2 ;;
        --init) init=true; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$prefix" in /*) ;; *) echo "install.sh: --prefix must be an absolute path" >&2; exit 2 ;; esac

if [ -z "$from" ]; then
    echo "install.sh: building gleam and libgleamcuda.so (release)"
    cargo build --release --locked -p gleam -p gleam-shim
    from=target/release
fi
for file in gleam libgleamcuda.so; do
    [ -f "$from/$file" ] || { echo "install.sh: $from/$file is missing" >&2; exit 1; }
done

root=$destdir
install -d "$root$prefix/bin" "$root$prefix/lib/gleam" "$root$prefix/share/doc/gleam"
install -m 0755 "$from/gleam" "$root$prefix/bin/gleam"
install -m 0644 README.md "$root$prefix/share/doc/gleam/README.md"
ln -sf gleam "$root$prefix/bin/gleam-peer"
install -m 0755 "$from/libgleamcuda.so" "$root$prefix/lib/gleam/libgleamcuda.so"
echo "install.sh: installed $prefix/bin/gleam and $prefix/lib/gleam/libgleamcuda.so"

$systemd || exit 0

install -d "$root/etc/systemd/system" "$root/etc/sysusers.d" "$root/etc/tmpfiles.d"
for unit in gleam-peer gleam-borrow; do
    sed -e "s|/usr/local/bin/gleam|$prefix/bin/gleam|g" -e "s|/usr/local/share/doc/gleam|$prefix/share/doc/gleam|g" \
        "contrib/$unit.service" >"$root/etc/systemd/system/$unit.service"
    chmod 0644 "$root/etc/systemd/system/$unit.service"
done
install -m 0644 contrib/gleam.sysusers "$root/etc/sysusers.d/gleam.conf"
install -m 0644 contrib/gleam.tmpfiles "$root/etc/tmpfiles.d/gleam.conf"
echo "install.sh: installed gleam-peer.service, gleam-borrow.service, the gleam user and /var/lib/gleam entries"

if [ -n "$destdir" ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install.sh: run as root to create the gleam user and start a service" >&2
    exit 1
fi
systemd-sysusers /etc/sysusers.d/gleam.conf
systemd-tmpfiles --create /etc/tmpfiles.d/gleam.conf
as_gleam() { runuser -u gleam -- "$prefix/bin/gleam" "$@"; }
if $init; then
    as_gleam mesh init --config-dir /var/lib/gleam
elif [ -n "$join" ]; then
    as_gleam mesh join "$join" --config-dir /var/lib/gleam
fi
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    if [ -n "$enable" ]; then
        systemctl enable --now "$enable.service"
        echo "install.sh: $enable.service is running; \`journalctl -u $enable\` shows its log"
    fi
else
    echo "install.sh: systemd is not running here: units installed but not started"
fi
echo "install.sh: to use the daemon as yourself: sudo usermod -aG gleam \$USER (log in again), then gleam mesh join CODE"
