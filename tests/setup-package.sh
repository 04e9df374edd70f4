#!/usr/bin/env bash
# Installs what tests/package.sh needs on a fresh Debian machine with the Rust toolchain; safe to
# run again (installs are skipped when present). Sourced by tests/setup.sh.
#
# Debian packages: dpkg-dev (dpkg-shlibdeps, for the package's libc dependency; binutils for
# strip), systemd (systemd-analyze, systemd-tmpfiles; no running systemd is needed), lintian,
# man-db (man, to render the man page as lintian does), bsdextrautils (col), openssh-server
# (tests/tests/agent_user.rs asks the real `sshd -T` whether the package's drop-in refuses the
# agent's user; where no systemd runs, policy-rc.d or its absence keeps sshd from starting).
# No cargo tool: packaging/build-deb.sh assembles the package with dpkg-deb.
set -euo pipefail

_pkg_step() { printf '\n== %s\n' "$*" >&2; }

_pkg_need=()
command -v dpkg-shlibdeps >/dev/null 2>&1 || _pkg_need+=(dpkg-dev)
command -v python3 >/dev/null 2>&1 || _pkg_need+=(python3)
command -v strip >/dev/null 2>&1 || _pkg_need+=(binutils)
command -v systemd-analyze >/dev/null 2>&1 || _pkg_need+=(systemd)
command -v lintian >/dev/null 2>&1 || _pkg_need+=(lintian)
command -v man >/dev/null 2>&1 || _pkg_need+=(man-db)
command -v col >/dev/null 2>&1 || _pkg_need+=(bsdextrautils)
[ -x /usr/sbin/sshd ] || _pkg_need+=(openssh-server)
if [ ${#_pkg_need[@]} -gt 0 ]; then
  _pkg_step "apt-get install ${_pkg_need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${_pkg_need[@]}"
fi
