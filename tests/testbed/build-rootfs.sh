#!/usr/bin/env bash
# Builds the guest root filesystem template the `pct` stand-in runs commands in: Debian's static
# busybox with its applet links (merged /usr, like Debian 12), a Debian 12 /etc/os-release, a
# hostname, the device nodes a shell needs, and the `osqueryi` stand-in at /usr/bin/osqueryi
# (a symlink to /opt/osquery/bin/osqueryd, the layout of osquery's own package).
#
# Usage: tests/testbed/build-rootfs.sh [TARGET]   (default: <repo>/.testbed/rootfs)
#
# Needs root (device nodes, chroot) and busybox-static (tests/run.sh installs it). Safe to run
# concurrently: the build happens in a scratch directory under a lock and is renamed into place,
# and a stamp (sha256 of this script and of the stand-in) makes an up-to-date template a no-op.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
target=${1:-$repo/.testbed/rootfs}
parent=$(dirname "$target")
mkdir -p "$parent"

busybox=${FELHOM_BUSYBOX:-/bin/busybox}
if [ ! -x "$busybox" ]; then
  echo "build-rootfs: $busybox not found; install Debian's busybox-static (tests/run.sh does)" >&2
  exit 1
fi

stamp_of() { cat "$here/build-rootfs.sh" "$here/osqueryi" | sha256sum | cut -d' ' -f1; }
want=$(stamp_of)

exec 9>"$parent/.build-rootfs.lock"
flock 9
if [ -f "$target/.testbed-stamp" ] && [ "$(cat "$target/.testbed-stamp")" = "$want" ]; then
  exit 0
fi

scratch=$(mktemp -d "$parent/.rootfs-build.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
r=$scratch/rootfs
mkdir -p "$r"

# Merged /usr: /bin, /sbin and /lib are links into /usr.
mkdir -p "$r/usr/bin" "$r/usr/sbin" "$r/usr/lib"
ln -s usr/bin "$r/bin"
ln -s usr/sbin "$r/sbin"
ln -s usr/lib "$r/lib"
cp "$busybox" "$r/usr/bin/busybox"
chmod 0755 "$r/usr/bin/busybox"
"$busybox" --list-full | while read -r applet; do
  name=${applet##*/}
  case $applet in
    sbin/* | usr/sbin/*) dir=usr/sbin ;;
    *) dir=usr/bin ;;
  esac
  [ "$name" = busybox ] && continue
  [ -e "$r/$dir/$name" ] || ln -s /usr/bin/busybox "$r/$dir/$name"
done

mkdir -p "$r/proc" "$r/sys" "$r/dev" "$r/root" "$r/run" "$r/var/lib" "$r/var/log" \
  "$r/etc" "$r/opt" "$r/home" "$r/mnt" "$r/usr/local/bin" "$r/usr/share"
install -d -m 1777 "$r/tmp" "$r/var/tmp"
# What sd_booted(3) looks for: the osqueryi stand-in answers systemd_units (from its file below)
# as osquery does in a guest whose init is systemd, and the checks ask for this folder before
# they trust that table. There is no systemctl: the boot wait sees no systemd to wait for.
mkdir -p "$r/run/systemd/system"
chmod 0700 "$r/root"

mknod -m 0666 "$r/dev/null" c 1 3
mknod -m 0666 "$r/dev/zero" c 1 5
mknod -m 0666 "$r/dev/full" c 1 7
mknod -m 0666 "$r/dev/random" c 1 8
mknod -m 0666 "$r/dev/urandom" c 1 9
mknod -m 0666 "$r/dev/tty" c 5 0
ln -s /proc/self/fd "$r/dev/fd"
ln -s /proc/self/fd/0 "$r/dev/stdin"
ln -s /proc/self/fd/1 "$r/dev/stdout"
ln -s /proc/self/fd/2 "$r/dev/stderr"

cat >"$r/usr/lib/os-release" <<'EOF'
PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"
NAME="Debian GNU/Linux"
VERSION_ID="12"
VERSION="12 (bookworm)"
VERSION_CODENAME=bookworm
ID=debian
HOME_URL="https://www.debian.org/"
SUPPORT_URL="https://www.debian.org/support"
BUG_REPORT_URL="https://bugs.debian.org/"
EOF
ln -s ../usr/lib/os-release "$r/etc/os-release"
echo 12.0 >"$r/etc/debian_version"
echo testbed >"$r/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\ttestbed\n' >"$r/etc/hosts"
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' >"$r/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$r/etc/group"
: >"$r/etc/fstab"

# osquery's package layout: the one real executable in /opt, links in /usr/bin.
mkdir -p "$r/opt/osquery/bin" "$r/etc/osquery" "$r/usr/share/osquery-standin"
install -m 0755 "$here/osqueryi" "$r/opt/osquery/bin/osqueryd"
ln -s /opt/osquery/bin/osqueryd "$r/usr/bin/osqueryi"
ln -s /opt/osquery/bin/osqueryd "$r/usr/bin/osqueryd"
# The units the stand-in's systemd_units table reports (tab separated: id, description,
# load_state, active_state, sub_state, unit_file_state). Tests append a failed unit.
printf '%s\t%s\t%s\t%s\t%s\t%s\n' \
  'systemd-journald.service' 'Journal Service' loaded active running static \
  'cron.service' 'Regular background program processing daemon' loaded active running enabled \
  'ssh.service' 'OpenBSD Secure Shell server' loaded active running enabled \
  >"$r/usr/share/osquery-standin/systemd_units"

# The template must run under chroot: a dynamically linked busybox would not.
if ! chroot "$r" /bin/sh -c 'test -x /usr/bin/env && /usr/bin/osqueryi --version' >/dev/null; then
  echo "build-rootfs: the built root filesystem does not run under chroot (is $busybox static?)" >&2
  exit 1
fi

echo "$want" >"$r/.testbed-stamp"
if [ -e "$target" ]; then
  old=$(mktemp -d "$parent/.rootfs-old.XXXXXX")
  mv "$target" "$old/rootfs"
  mv "$r" "$target"
  rm -rf "$old"
else
  mv "$r" "$target"
fi
