#!/usr/bin/env bash
# Builds the root filesystem of the test bed's real containers: a Debian release made by
# mmdebstrap --variant=minbase with systemd as init and what every real container template
# carries (ifupdown, iproute2, procps, kmod, isc-dhcp-client: a root without kmod fails
# systemd-modules-load for a reason no real template has), plus busybox (the osqueryi stand-in's
# awk, and the wget of its `curl` table), as a tarball, and a copy of it whose owners are
# shifted by 100000: what an unprivileged container of PVE holds on disk (pve-container
# `update_lxc_config`: `lxc.idmap = u 0 100000 65536`). The bed extracts the shifted one
# (`tar --numeric-owner -xpf`) into each container it restores.
#
# Usage: tests/testbed/build-debian-rootfs.sh [DIR [FLAVOUR]]
#   DIR      default <repo>/target/testbed
#   FLAVOUR  bookworm (Debian 12, systemd 252; the default), bullseye (Debian 11, systemd 247) or
#            trixie (Debian 13, systemd 257): the releases whose differences the bed shows; or
#            bullseye-ifupdown2, bookworm-ifupdown2, trixie-ifupdown2 (ifupdown2 in place of
#            ifupdown): the other network stack PVE's /etc/network/interfaces is read by; or bullseye-nm, bookworm-nm, trixie-nm
#            (network-manager beside ifupdown, as a Debian desktop install has it: Debian's
#            NetworkManager.conf leaves every interface with an `iface` stanza to ifupdown)
# Prints the path of the shifted tarball (DIR/debian-<flavour>-<key>.shifted.tar) on stdout.
#
# Cached: the key is the sha256 of this script, so a tarball is built once per version of the
# script and flavour; the build runs under a lock (concurrent callers wait and then reuse it) and
# is renamed into place whole. Older keys of the same flavour are removed. Packages come from
# this machine's Debian mirror (the URIs of its apt sources that name bookworm), with its
# Acquire::Check-Valid-Until / Check-Date settings (a snapshot mirror needs them off).
#
# Needs root, mmdebstrap and python3 (tests/setup.sh installs mmdebstrap). Takes 20-60 s.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:-$repo/target/testbed}
flavour=${2:-bookworm}
network=ifupdown
case $flavour in
  bullseye | bookworm | trixie) suite=$flavour ;;
  bullseye-ifupdown2 | bookworm-ifupdown2 | trixie-ifupdown2) suite=${flavour%-ifupdown2} network=ifupdown2 ;;
  bullseye-nm | bookworm-nm | trixie-nm) suite=${flavour%-nm} network=ifupdown,network-manager ;;
  *)
    echo "build-debian-rootfs: unknown flavour '$flavour' (bullseye, bookworm, trixie, bullseye-ifupdown2, bookworm-ifupdown2, trixie-ifupdown2, bullseye-nm, bookworm-nm, trixie-nm)" >&2
    exit 2
    ;;
esac
mkdir -p "$out"

key=$(sha256sum "$here/build-debian-rootfs.sh" | cut -c1-16)
plain=$out/debian-$flavour-$key.tar
shifted=$out/debian-$flavour-$key.shifted.tar

exec 9>"$out/.build-debian-rootfs-$flavour.lock"
flock 9
if [ -s "$plain" ] && [ -s "$shifted" ]; then
  echo "$shifted"
  exit 0
fi

if ! command -v mmdebstrap >/dev/null 2>&1; then
  echo "build-debian-rootfs: mmdebstrap is not installed (tests/setup.sh installs it)" >&2
  exit 1
fi

# The machine's Debian mirror: the first URI of an apt source that names a bookworm suite
# (the security archive left aside); each release is taken from it by its own suite name.
mirror=""
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] || continue
  grep -qE '^[^#]*\bbookworm' "$f" || continue
  uri=$(awk '/^[[:space:]]*#/ {next}
    /^URIs:/ {print $2; exit}
    /^deb[[:space:]]/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' "$f")
  case $uri in */debian-security* | "") continue ;; esac
  mirror=$uri
  break
done
mirror=${mirror:-http://deb.debian.org/debian}

aptopts=()
eval "$(apt-config shell valid Acquire::Check-Valid-Until date Acquire::Check-Date)"
[ "${valid:-}" = false ] && aptopts+=(--aptopt='Acquire::Check-Valid-Until "false"')
[ "${date:-}" = false ] && aptopts+=(--aptopt='Acquire::Check-Date "false"')

scratch=$(mktemp -d "$out/.debian-build.XXXXXX")
trap 'rm -rf "$scratch"' EXIT

# Documentation, manual pages and translations are left out (a smaller tarball, a faster copy
# per container); nothing the guest runs reads them. The merged /usr is laid out by mmdebstrap's
# own hook instead of the usrmerge package, which would pull in perl (46 MB).
# bullseye has no usr-is-merged package for the hook to install; its root keeps its own layout.
hooks=()
if [ "$suite" != bullseye ] && [ -d /usr/share/mmdebstrap/hooks/merged-usr ]; then
  hooks+=(--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr)
fi
mmdebstrap --quiet --variant=minbase --mode=root --format=tar "${hooks[@]}" \
  --include=systemd-sysv,"$network",iproute2,procps,busybox,hostname,kmod,isc-dhcp-client \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --customize-hook='echo debian-bed >"$1/etc/hostname"' \
  --customize-hook='printf "auto lo\niface lo inet loopback\n" >"$1/etc/network/interfaces"' \
  --customize-hook='rm -f "$1/etc/machine-id" "$1/var/lib/dbus/machine-id"; : >"$1/etc/machine-id"' \
  "${aptopts[@]}" \
  "$suite" "$scratch/debian.tar" "deb $mirror $suite main" >&2

# The shifted copy: every owner + 100000, names dropped (extracted with --numeric-owner).
python3 - "$scratch/debian.tar" "$scratch/debian.shifted.tar" <<'EOF'
import sys, tarfile
src, dst = sys.argv[1], sys.argv[2]
with tarfile.open(src, 'r:') as tin, tarfile.open(dst, 'w:', format=tarfile.PAX_FORMAT) as tout:
    for m in tin:
        m.uid += 100000
        m.gid += 100000
        m.uname = m.gname = ''
        tout.addfile(m, tin.extractfile(m) if m.isreg() else None)
EOF

# Older keys of this flavour, and the tarballs of before the flavour was in the name.
for old in "$out"/debian-*.tar; do
  [ "$old" = "$plain" ] || [ "$old" = "$shifted" ] && continue
  name=${old##*/}
  if [[ $name =~ ^debian-($flavour-)?[0-9a-f]{16}(\.shifted)?\.tar$ ]]; then
    rm -f "$old"
  fi
done
mv "$scratch/debian.tar" "$plain"
mv "$scratch/debian.shifted.tar" "$shifted"
echo "$shifted"
