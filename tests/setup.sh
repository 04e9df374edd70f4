#!/usr/bin/env bash
# Installs what the tests need on a fresh Debian machine with the Rust
# toolchain. Sourced by tests/run.sh (the demo sources only tests/setup-demo.sh); safe to run again (installs are
# skipped when present). Exports FELHOM_FAKEPVE_PYTHON.
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

_step() { printf '\n== %s\n' "$*" >&2; }

# What the demo needs (busybox-static, util-linux, python3-venv, fakepve; exports
# FELHOM_FAKEPVE_PYTHON), then promtool (checks the alert rules and every metrics file the agent
# writes) and what the package checks need.
source "$_root/tests/setup-demo.sh"
if ! command -v promtool >/dev/null 2>&1; then
  _step "apt-get install prometheus"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
fi
source "$_root/tests/setup-package.sh"

# The real guests of the test bed (tests/src/guestbed.rs `real_lxc`): LXC runs unprivileged
# containers of a Debian root filesystem that mmdebstrap builds once
# (tests/testbed/build-debian-rootfs.sh); uidmap's newuidmap/newgidmap and root's subordinate
# ids map them as PVE does (`lxc.idmap = u 0 100000 65536`).
_lxc_need=()
command -v lxc-start >/dev/null 2>&1 || _lxc_need+=(lxc)
command -v mmdebstrap >/dev/null 2>&1 || _lxc_need+=(mmdebstrap)
command -v newuidmap >/dev/null 2>&1 || _lxc_need+=(uidmap)
if [ ${#_lxc_need[@]} -gt 0 ]; then
  _step "apt-get install ${_lxc_need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${_lxc_need[@]}"
fi
for _ids in /etc/subuid /etc/subgid; do
  grep -q '^root:' "$_ids" 2>/dev/null || echo 'root:100000:65536' >>"$_ids"
done
# The package under a real systemd (tests/tests/package_systemd.rs): systemd-nspawn boots a
# Debian root built by mmdebstrap (tests/testbed/build-systemd-root.sh, cached under target/).
_sd_need=()
command -v systemd-nspawn >/dev/null 2>&1 || _sd_need+=(systemd-container)
command -v mmdebstrap >/dev/null 2>&1 || _sd_need+=(mmdebstrap)
if [ ${#_sd_need[@]} -gt 0 ]; then
  _step "apt-get install ${_sd_need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${_sd_need[@]}"
fi
# The real VMs of the test bed (tests/src/guestbed.rs `real_vm`): QEMU runs a Debian 12 disk
# that mmdebstrap builds once (tests/testbed/build-debian-vm.sh), under TCG, with a qcow2
# overlay per VM (qemu-img). Debian 12's QEMU is 7.2; a qemu-utils from backports (10.x) breaks
# its qemu-system-common, so qemu-utils is taken at the release's own version beside it.
if ! command -v qemu-system-x86_64 >/dev/null 2>&1 || ! command -v qemu-img >/dev/null 2>&1; then
  _step "apt-get install qemu-system-x86 qemu-utils"
  apt-get update -qq
  _qemu_version=$(apt-cache policy qemu-system-x86 | awk '/Candidate:/ {print $2}')
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends --allow-downgrades \
    qemu-system-x86 "qemu-utils=${_qemu_version}" qemu-block-extra-
fi
command -v mkfs.ext4 >/dev/null 2>&1 || {
  _step "apt-get install e2fsprogs"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends e2fsprogs
}
