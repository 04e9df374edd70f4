#!/usr/bin/env bash
# Builds the Debian bookworm root that tests/tests/package_systemd.rs boots with systemd-nspawn,
# so the package's units run under a real systemd 252 (PVE 8's) as PID 1.
#
# Usage: tests/testbed/build-systemd-root.sh [TARGET]
#        (default: <repo>/target/felhom-systemd-root/<sha256 of this script>; prints TARGET)
#
# mmdebstrap --variant=minbase with systemd, systemd-sysv and dbus (systemd as PID 1, systemctl
# over the bus), plus what the package's Depends need: libc6, init-system-helpers and util-linux come with
# minbase, iproute2 (the `ip` a group lab is made with) is included; pve-container and qemu-server are empty stand-in packages of those names made here
# with dpkg-deb (the package only needs them installed; nothing in the units runs them), so dpkg
# installs the real .deb without --force-depends. node_exporter's textfile folder
# (/var/lib/prometheus/node-exporter, root 0755 as Debian's prometheus-node-exporter makes it)
# exists; node_exporter itself is not installed (it would listen on the host's :9100, the
# machine shares the host's network).
#
# Needs root, mmdebstrap and network access to Debian's mirror (tests/setup.sh installs
# mmdebstrap). Built once per version of this script: the folder's name is the script's hash,
# the build runs under a lock in a scratch folder and is renamed into place, so concurrent
# tests wait for one build and an interrupted build leaves nothing half made. Takes about 30 s.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
key=$(sha256sum "$here/build-systemd-root.sh" | cut -c1-16)
base=${CARGO_TARGET_DIR:-$repo/target}/felhom-systemd-root
target=${1:-$base/$key}
parent=$(dirname "$target")
mkdir -p "$parent"

exec 9>"$parent/.build.lock"
flock 9
if [ -f "$target/.felhom-root-done" ]; then
  printf '%s\n' "$target"
  exit 0
fi
command -v mmdebstrap >/dev/null 2>&1 ||
  { echo "build-systemd-root: mmdebstrap is missing (tests/setup.sh installs it)" >&2; exit 1; }

scratch=$(mktemp -d "$parent/.build.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
r=$scratch/root

mmdebstrap --quiet --variant=minbase --include=systemd,systemd-sysv,dbus,libc6,init-system-helpers,iproute2 \
  bookworm "$r" >&2

# The stand-ins for the PVE packages the package depends on.
for pkg in pve-container qemu-server; do
  d=$scratch/$pkg
  mkdir -p "$d/DEBIAN"
  cat >"$d/DEBIAN/control" <<EOF
Package: $pkg
Version: 0.0-felhom-test
Architecture: all
Maintainer: felhom-agent tests <felhom-agent@example.net>
Description: empty stand-in for the test bed's systemd root
EOF
  dpkg-deb --root-owner-group --build "$d" "$r/tmp/$pkg.deb" >/dev/null
done
chroot "$r" dpkg -i /tmp/pve-container.deb /tmp/qemu-server.deb >/dev/null
rm -f "$r"/tmp/*.deb

install -d -m 0755 "$r/var/lib/prometheus" "$r/var/lib/prometheus/node-exporter"
# The machine's own name; no getty on the console nspawn gives it (nothing reads it).
echo felhom-systemd-test >"$r/etc/hostname"
ln -sf /dev/null "$r/etc/systemd/system/console-getty.service"
# An empty machine id: systemd makes a transient one at boot (FixedRandomDelay= hashes it).
: >"$r/etc/machine-id"
# apt's lists and caches are not needed in the machine.
rm -rf "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/*.bin

touch "$r/.felhom-root-done"
if [ -e "$target" ]; then
  old=$(mktemp -d "$parent/.old.XXXXXX")
  mv "$target" "$old/"
  mv "$r" "$target"
  rm -rf "$old"
else
  mv "$r" "$target"
fi
# Roots of older versions of this script (default place only).
if [ $# -eq 0 ]; then
  for d in "$base"/*; do
    [ "$d" = "$target" ] || [ ! -f "$d/.felhom-root-done" ] || rm -rf "$d"
  done
fi
printf '%s\n' "$target"
