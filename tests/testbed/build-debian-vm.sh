#!/usr/bin/env bash
# Builds the disk of the test bed's real VMs: a Debian 12 (bookworm) made by mmdebstrap
# --variant=minbase with the Debian kernel (linux-image-amd64, its initramfs by initramfs-tools),
# systemd as init, udev (it starts qemu-guest-agent when the virtio port
# org.qemu.guest_agent.0 appears), the real qemu-guest-agent, ifupdown, iproute2 and
# isc-dhcp-client, plus busybox (the awk of the osqueryi stand-in the bed lays into each VM),
# as a raw ext4 image with no partition table (root=/dev/vda), plus the
# kernel and initramfs beside it for QEMU's direct kernel boot (-kernel/-initrd: no boot loader):
# the kernel as its uncompressed ELF (vmlinux, taken out of Debian's vmlinuz), which QEMU boots
# through its PVH entry point, skipping the real-mode set-up and the decompression (seconds
# under TCG). Units of a Debian install that only cost boot time here (each process costs a
# second or more under TCG on a busy machine) are masked: e2scrub_reap, getty-static, the
# gettys (no console is read), the modprobe@ units of modules nothing here uses (configfs,
# dm_mod, efi_pstore, fuse, loop, drm), kmod-static-nodes, and the hugepages, mqueue, debug and
# tracing mounts. What the agent looks at (systemd's state, failed units, ifupdown's
# networking.service, qemu-guest-agent) is Debian's own.
#
# /etc/network/interfaces is what Debian's installer leaves for a DHCP install on a PVE VM's
# first NIC (virtio at PCI slot 18: ens18): `allow-hotplug ens18` + `iface ens18 inet dhcp`.
# The bed writes other variants per VM at start time, as the files of an extra cpio archive it
# appends to the initramfs, which the initramfs copies from /felhom-bed-files/ onto the root
# before systemd starts.
#
# The initramfs QEMU boots is the bed's own, not the one initramfs-tools made: an uncompressed
# archive of the image's busybox (and the libraries it needs), the modules a virtio disk, the
# guest agent's port, virtio NICs and ext4 need (in `modprobe --show-depends` order), and an
# /init that loads them, mounts /dev/vda, lays the bed's files onto it and hands over to systemd.
# Measured under TCG: the kernel's start to systemd in 3.6 s instead of 4.8 s (initramfs-tools
# unpacks 18 MB and runs udev to find a disk that is always /dev/vda). A node's VM boots its own
# boot loader and initramfs; what the agent looks at starts with systemd.
#
# Usage: tests/testbed/build-debian-vm.sh [DIR]
#   DIR      default <repo>/target/testbed
# Prints the folder of the image (DIR/debian-vm-<key>, holding disk.raw, vmlinux, initrd.img)
# on stdout.
#
# Cached: the key is the sha256 of this script, so the image is built once per version of the
# script; the build runs under a lock (concurrent callers wait and then reuse it) and is renamed
# into place whole. Older keys are removed. Packages come from this machine's Debian mirror (the
# URI of its apt source that names bookworm), with its Acquire::Check-Valid-Until / Check-Date
# settings.
#
# Needs root, mmdebstrap and mkfs.ext4 (tests/setup.sh installs them). Takes 40-90 s.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:-$repo/target/testbed}
mkdir -p "$out"

key=$(sha256sum "$here/build-debian-vm.sh" | cut -c1-16)
dest=$out/debian-vm-$key

exec 9>"$out/.build-debian-vm.lock"
flock 9
if [ -f "$dest/.done" ]; then
  echo "$dest"
  exit 0
fi

for tool in mmdebstrap mkfs.ext4; do
  command -v "$tool" >/dev/null 2>&1 ||
    { echo "build-debian-vm: $tool is not installed (tests/setup.sh installs it)" >&2; exit 1; }
done

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

scratch=$(mktemp -d "$out/.debian-vm-build.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
root=$scratch/root

hooks=()
[ -d /usr/share/mmdebstrap/hooks/merged-usr ] && hooks+=(--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr)

# Modules for hardware of QEMU's pc machine that nothing in the guest uses (the floppy and IDE
# controllers, PS/2, the PC speaker, KVM: the guest's CPU model advertises no virtualisation)
# are not loaded: each costs a second of a boot under TCG.
# The initramfs: only what a virtio disk and ext4 need (MODULES=list: a small image that TCG
# unpacks fast), and the hook that lays the bed's per-VM files onto the root.
mmdebstrap --quiet --variant=minbase --mode=root "${hooks[@]}" \
  --include=linux-image-amd64,initramfs-tools,systemd-sysv,udev,qemu-guest-agent,ifupdown,iproute2,isc-dhcp-client,kmod,procps,hostname,busybox \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/lib/firmware/*' \
  --dpkgopt='path-exclude=/lib/modules/*/kernel/drivers/gpu/*' \
  --dpkgopt='path-exclude=/lib/modules/*/kernel/drivers/net/wireless/*' \
  --dpkgopt='path-exclude=/lib/modules/*/kernel/drivers/media/*' \
  --dpkgopt='path-exclude=/lib/modules/*/kernel/drivers/infiniband/*' \
  --dpkgopt='path-exclude=/lib/modules/*/kernel/drivers/staging/*' \
  --dpkgopt='path-exclude=/lib/modules/*/kernel/sound/*' \
  --essential-hook='mkdir -p "$1/etc/initramfs-tools/conf.d"; echo MODULES=list >"$1/etc/initramfs-tools/conf.d/felhom-bed.conf"' \
  --customize-hook='printf "blacklist %s\n" floppy pcspkr ata_piix ata_generic psmouse serio_raw joydev evdev powernow_k8 >"$1/etc/modprobe.d/felhom-bed.conf"' \
  --customize-hook='echo debian-vm >"$1/etc/hostname"' \
  --customize-hook='printf "127.0.0.1\tlocalhost\n127.0.1.1\tdebian-vm\n" >"$1/etc/hosts"' \
  --customize-hook='printf "source /etc/network/interfaces.d/*\n\nauto lo\niface lo inet loopback\n\nallow-hotplug ens18\niface ens18 inet dhcp\n" >"$1/etc/network/interfaces"' \
  --customize-hook='printf "/dev/vda / ext4 errors=remount-ro 0 1\n" >"$1/etc/fstab"' \
  --customize-hook='rm -f "$1/etc/machine-id" "$1/var/lib/dbus/machine-id"; : >"$1/etc/machine-id"' \
  --customize-hook='chroot "$1" systemctl mask getty@tty1.service serial-getty@ttyS0.service e2scrub_reap.service getty-static.service modprobe@configfs.service modprobe@dm_mod.service modprobe@efi_pstore.service modprobe@fuse.service modprobe@loop.service modprobe@drm.service kmod-static-nodes.service dev-hugepages.mount dev-mqueue.mount sys-kernel-debug.mount sys-kernel-tracing.mount' \
  "${aptopts[@]}" \
  bookworm "$root" "deb $mirror bookworm main" >&2

mkdir -p "$scratch/vm"
# vmlinux: the xz stream inside Debian's bzImage, decompressed (what the kernel's own
# scripts/extract-vmlinux does).
python3 - "$root"/boot/vmlinuz-* "$scratch/vm/vmlinux" <<'EOF'
import lzma, sys
data = open(sys.argv[1], 'rb').read()
at = data.find(b'\xfd7zXZ\x00')
if at < 0:
    sys.exit('build-debian-vm: no xz stream in ' + sys.argv[1])
out = lzma.LZMADecompressor().decompress(data[at:])
if out[:4] != b'\x7fELF':
    sys.exit('build-debian-vm: the xz stream in ' + sys.argv[1] + ' is not an ELF kernel')
open(sys.argv[2], 'wb').write(out)
EOF
# The bed's initramfs (above): busybox, its libraries, the modules and /init, as a newc archive.
kver=$(basename "$(ls -d "$root"/usr/lib/modules/*/ | head -n 1)")
for m in ext4 virtio_pci virtio_blk virtio_console virtio_net; do
  chroot "$root" modprobe --show-depends -S "$kver" "$m"
done | awk '$1 == "insmod" && !seen[$2]++ {print $2}' >"$scratch/modules"
chroot "$root" ldd /usr/bin/busybox | awk '$2 == "=>" {print $3} $1 ~ /^\// {print $1}' >"$scratch/libs"
cat >"$scratch/init" <<'EOF'
#!/bin/busybox sh
# The test bed's initramfs: mount the VM's disk, lay the bed's files onto it, start its systemd.
/bin/busybox mkdir -p /proc /dev /root
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t devtmpfs devtmpfs /dev
# crc32c-intel fails on a CPU without SSE4.2 (crc32c_generic serves instead): errors are quiet.
while read -r m; do /bin/busybox insmod "$m" 2>/dev/null; done </modules
n=0
while [ ! -b /dev/vda ] && [ "$n" -lt 1000 ]; do /bin/busybox usleep 10000; n=$((n + 1)); done
if ! /bin/busybox mount -t ext4 -o rw /dev/vda /root; then
  echo "felhom bed initramfs: /dev/vda does not mount" >/dev/console
  exec /bin/busybox sh
fi
[ -d /felhom-bed-files ] && /bin/busybox cp -a /felhom-bed-files/. /root/
/bin/busybox mount -o move /dev /root/dev
/bin/busybox umount /proc
exec /bin/busybox switch_root /root /sbin/init
EOF
python3 - "$root" "$scratch" "$scratch/vm/initrd.img" <<'EOF'
import os, sys
root, scratch, out_path = sys.argv[1:]
entries, folders = [], set()
def add(path, mode, data):
    parts = path.split('/')
    for i in range(1, len(parts)):
        folder = '/'.join(parts[:i])
        if folder not in folders:
            folders.add(folder)
            entries.append((folder, 0o40755, b''))
    entries.append((path, mode, data))
def read(path):
    # A path inside the image, its symbolic links followed inside the image.
    at = '/'
    for part in [p for p in path.split('/') if p]:
        at = os.path.join(at, part)
        for _ in range(40):
            full = os.path.join(root, at.lstrip('/'))
            if not os.path.islink(full):
                break
            target = os.readlink(full)
            at = os.path.normpath(target if target.startswith('/') else os.path.join(os.path.dirname(at), target))
    with open(os.path.join(root, at.lstrip('/')), 'rb') as fh:
        return fh.read()
with open(os.path.join(scratch, 'init'), 'rb') as fh:
    add('init', 0o100755, fh.read())
add('bin/busybox', 0o100755, read('/usr/bin/busybox'))
with open(os.path.join(scratch, 'libs'), encoding='utf-8') as fh:
    for lib in fh.read().split():
        add(lib.lstrip('/'), 0o100755, read(lib))
with open(os.path.join(scratch, 'modules'), encoding='utf-8') as fh:
    modules = fh.read().split()
if not any(m.endswith('/ext4.ko') for m in modules) or not any(m.endswith('/virtio_blk.ko') for m in modules):
    sys.exit('build-debian-vm: no ext4 or virtio_blk module among ' + ' '.join(modules))
for m in modules:
    add(m.lstrip('/'), 0o100644, read(m))
add('modules', 0o100644, ''.join(m + '\n' for m in modules).encode())
out = bytearray()
def pad():
    out.extend(b'\0' * (-len(out) % 4))
for ino, (name, mode, data) in enumerate(entries + [('TRAILER!!!', 0, b'')], start=1):
    raw = name.encode() + b'\0'
    fields = (ino, mode, 0, 0, 2 if mode & 0o40000 else 1, 0, len(data), 0, 0, 0, 0, len(raw), 0)
    out.extend(b'070701' + ''.join('%08X' % f for f in fields).encode() + raw)
    pad()
    out.extend(data)
    pad()
with open(out_path, 'wb') as fh:
    fh.write(bytes(out))
EOF
# The root: its size plus room for what the guests write (a sparse file).
size_mb=$(($(du -sm "$root" | cut -f1) + 512))
mkfs.ext4 -q -L root -d "$root" "$scratch/vm/disk.raw" "${size_mb}M" >&2
touch "$scratch/vm/.done"

for old in "$out"/debian-vm-*; do
  [ "$old" = "$dest" ] && continue
  [[ ${old##*/} =~ ^debian-vm-[0-9a-f]{16}$ ]] && rm -rf "$old"
done
mv "$scratch/vm" "$dest"
echo "$dest"
