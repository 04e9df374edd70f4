#!/usr/bin/env bash
# Builds the Debian package and checks it: tests/run.sh calls it after `cargo build`; it also
# runs alone (tests/setup.sh installs what it needs: dpkg-dev, systemd for
# systemd-analyze, lintian).
#
# 1. packaging/build-deb.sh --from-debug: the package from a debug build of the agent without
#    the test hooks (a release build takes minutes on two cores; the package's contents do not
#    depend on it). The packaged binary must not carry the test hooks' variable names.
# 2. dpkg-deb/dpkg -x: every expected file with its mode and nothing else, the conffiles, the
#    control fields, the maintainer scripts (and the postinst run against stubs), the
#    man page renders without warnings, the completions load, the binary runs, the tmpfiles
#    sysusers snippet creates the system user (in no group but its own, home /nonexistent), the tmpfiles
#    snippet creates the state directory 0700 owned by it, lets its group read agent.toml and
#    creates its metrics folder (nothing in node_exporter's textfile folder).
# 3. systemd-analyze verify on the unpacked units (any message fails), and
#    systemd-analyze security --offline=true: the exposure of each service, which must not
#    rise above the figure documented in systemd/README.md; the daemon and the restore test
#    run as a non-root User= with no capabilities.
# 4. the Prometheus alert rules: promtool check rules and promtool test rules (the rules'
#    unit tests) on the shipped files; the Grafana dashboard parses.
# 5. lintian: errors and warnings fail (deliberate exceptions are overridden in the package,
#    packaging/lintian-overrides); info tags are printed.
#
# Exits non-zero on the first failed check; prints one "ok:" line per passed check.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# The highest accepted exposure (systemd-analyze security) per service: systemd/README.md.
MAX_EXPOSURE_AGENT=2.5
MAX_EXPOSURE_RESTORE=2.5
# The root exec helper keeps the sandbox that `pct exec` into containers allows.
MAX_EXPOSURE_EXEC=5.3
# The root metrics publisher: one capability, no network.
MAX_EXPOSURE_METRICS=2.5
# A group lab's holder: a process that only waits, in a namespace of its own.
MAX_EXPOSURE_LAB=0.4

step() { printf '\n== package: %s\n' "$*" >&2; }
fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }

for tool in dpkg-deb dpkg systemd-analyze gzip man; do
  command -v "$tool" >/dev/null 2>&1 || fail "$tool is missing (tests/setup.sh installs it)"
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step "build the package (packaging/build-deb.sh --from-debug)"
started=$SECONDS
# FELHOM_PACKAGE_OUT: where the package is kept (tests/run.sh: for the tests that install it).
deb=$(packaging/build-deb.sh --from-debug --out "${FELHOM_PACKAGE_OUT:-$work/out}")
[ -f "$deb" ] || fail "build-deb.sh reported no package"
ok "built $(basename "$deb") in $((SECONDS - started)) s"

version=$(cargo metadata --format-version 1 --no-deps --locked |
  python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"]=="felhom-agent"))')

step "control fields"
dpkg-deb --field "$deb" >"$work/control"
field() { dpkg-deb --field "$deb" "$1"; }
[ "$(field Package)" = felhom-agent ] || fail "Package is $(field Package)"
[ "$(field Version)" = "$version-1" ] || fail "Version is $(field Version), want $version-1"
[ "$(field Section)" = admin ] || fail "Section is $(field Section), want admin"
[ "$(field Architecture)" = "$(dpkg --print-architecture)" ] || fail "Architecture is $(field Architecture)"
depends=$(field Depends)
for dep in libc6 init-system-helpers systemd pve-container qemu-server iproute2; do
  grep -qw -- "$dep" <<<"$depends" || fail "Depends lacks $dep: $depends"
done
grep -q '^Maintainer: .\+ <.\+@.\+>$' "$work/control" || fail "Maintainer is not 'Name <address>'"
head -1 packaging/changelog | grep -qF "felhom-agent ($version-1)" ||
  fail "packaging/changelog's first entry is not for $version-1: $(head -1 packaging/changelog)"
ok "control: felhom-agent $version-1, section admin, depends: $depends"

step "contents: files, modes, owners"
dpkg-deb --contents "$deb" >"$work/listing"
# Everything belongs to root (dpkg-deb --root-owner-group names it; a numeric 0/0 is root too).
if awk '$2 != "0/0" && $2 != "root/root" { bad = 1; print } END { exit !bad }' "$work/listing" >&2; then
  fail "files not owned by root/root (above)"
fi
# The regular files, exactly, with their modes.
expected_files="\
-rwxr-xr-x ./usr/bin/felhom-agent
-rw-r--r-- ./lib/systemd/system/felhom-agent.service
-rw-r--r-- ./lib/systemd/system/felhom-restore-test.service
-rw-r--r-- ./lib/systemd/system/felhom-restore-test.timer
-rw-r--r-- ./lib/systemd/system/felhom-agent-exec.socket
-rw-r--r-- ./lib/systemd/system/felhom-agent-metrics.path
-rw-r--r-- ./lib/systemd/system/felhom-agent-metrics.service
-rw-r--r-- ./lib/systemd/system/felhom-agent-exec.service
-rw-r--r-- ./lib/systemd/system/felhom-lab@.service
-rw-r--r-- ./usr/lib/tmpfiles.d/felhom-agent.conf
-rw-r--r-- ./usr/lib/sysusers.d/felhom-agent.conf
-rw-r--r-- ./etc/felhom-agent/agent.toml.example
-rw-r--r-- ./etc/felhom-agent/checks.d/default.toml
-rw-r--r-- ./etc/ssh/sshd_config.d/felhom-agent.conf
-rwxr-xr-x ./etc/felhom-agent/bootstrap.d/default/run
-rw-r--r-- ./usr/share/man/man1/felhom-agent.1.gz
-rw-r--r-- ./usr/share/bash-completion/completions/felhom-agent
-rw-r--r-- ./usr/share/zsh/vendor-completions/_felhom-agent
-rw-r--r-- ./usr/share/fish/vendor_completions.d/felhom-agent.fish
-rw-r--r-- ./usr/share/doc/felhom-agent/README.md
-rw-r--r-- ./usr/share/doc/felhom-agent/README.systemd.md
-rw-r--r-- ./usr/share/doc/felhom-agent/README.Debian
-rw-r--r-- ./usr/share/doc/felhom-agent/agent.toml.example
-rw-r--r-- ./usr/share/doc/felhom-agent/copyright
-rw-r--r-- ./usr/share/doc/felhom-agent/changelog.Debian.gz
-rw-r--r-- ./usr/share/lintian/overrides/felhom-agent
-rw-r--r-- ./usr/share/felhom-agent/prometheus/felhom-agent.rules.yml
-rw-r--r-- ./usr/share/felhom-agent/prometheus/felhom-agent.rules.test.yml
-rw-r--r-- ./usr/share/felhom-agent/grafana/felhom-agent.json"
awk '$1 !~ /^d/ { print $1, $6 }' "$work/listing" | sort >"$work/files.got"
sort <<<"$expected_files" >"$work/files.want"
if ! diff -u "$work/files.want" "$work/files.got" >&2; then
  fail "the package's files or modes differ from the expected list (- expected, + packaged)"
fi
ok "$(wc -l <"$work/files.got") files with the expected modes, nothing else"
grep -q ' \./etc/felhom-agent/agent\.toml$' "$work/listing" && fail "a live agent.toml is shipped"

mkdir "$work/root" "$work/DEBIAN"
dpkg -x "$deb" "$work/root"
dpkg-deb --control "$deb" "$work/DEBIAN"
r=$work/root

# Shipped files are byte for byte the sources.
for pair in \
  systemd/felhom-agent.service:lib/systemd/system/felhom-agent.service \
  systemd/felhom-restore-test.service:lib/systemd/system/felhom-restore-test.service \
  systemd/felhom-restore-test.timer:lib/systemd/system/felhom-restore-test.timer \
  systemd/felhom-agent-exec.socket:lib/systemd/system/felhom-agent-exec.socket \
  systemd/felhom-agent-metrics.path:lib/systemd/system/felhom-agent-metrics.path \
  systemd/felhom-agent-metrics.service:lib/systemd/system/felhom-agent-metrics.service \
  systemd/felhom-agent-exec.service:lib/systemd/system/felhom-agent-exec.service \
  systemd/felhom-lab@.service:lib/systemd/system/felhom-lab@.service \
  packaging/felhom-agent.sysusers:usr/lib/sysusers.d/felhom-agent.conf \
  packaging/agent.toml.example:etc/felhom-agent/agent.toml.example \
  packaging/checks.d/default.toml:etc/felhom-agent/checks.d/default.toml \
  packaging/bootstrap.d/default/run:etc/felhom-agent/bootstrap.d/default/run \
  packaging/felhom-agent.tmpfiles:usr/lib/tmpfiles.d/felhom-agent.conf \
  packaging/felhom-agent.sshd.conf:etc/ssh/sshd_config.d/felhom-agent.conf \
  systemd/README.md:usr/share/doc/felhom-agent/README.systemd.md \
  packaging/README.md:usr/share/doc/felhom-agent/README.Debian \
  packaging/prometheus/felhom-agent.rules.yml:usr/share/felhom-agent/prometheus/felhom-agent.rules.yml \
  packaging/prometheus/felhom-agent.rules.test.yml:usr/share/felhom-agent/prometheus/felhom-agent.rules.test.yml \
  packaging/grafana/felhom-agent.json:usr/share/felhom-agent/grafana/felhom-agent.json; do
  cmp -s "${pair%%:*}" "$r/${pair#*:}" || fail "/${pair#*:} differs from ${pair%%:*}"
done
ok "units, example config, check pack, bootstrap profile, sysusers, tmpfiles, READMEs, alert rules, dashboard are the sources"

step "alert rules (promtool)"
command -v promtool >/dev/null 2>&1 || fail "promtool is missing: tests/setup.sh installs it (Debian package prometheus)"
promtool check rules "$r/usr/share/felhom-agent/prometheus/felhom-agent.rules.yml" >&2 ||
  fail "promtool check rules failed on the shipped alert rules"
(cd "$r/usr/share/felhom-agent/prometheus" && promtool test rules felhom-agent.rules.test.yml) >&2 ||
  fail "promtool test rules failed: the shipped alert rules do not fire as their tests expect"
python3 -m json.tool "$r/usr/share/felhom-agent/grafana/felhom-agent.json" >/dev/null ||
  fail "the shipped Grafana dashboard is not valid JSON"
ok "alert rules pass promtool check rules and their unit tests; the dashboard parses"

step "conffiles"
printf '%s\n' /etc/felhom-agent/agent.toml.example /etc/felhom-agent/bootstrap.d/default/run \
  /etc/felhom-agent/checks.d/default.toml /etc/ssh/sshd_config.d/felhom-agent.conf >"$work/conffiles.want"
[ -f "$work/DEBIAN/conffiles" ] || fail "DEBIAN/conffiles is missing"
sort "$work/DEBIAN/conffiles" | diff -u "$work/conffiles.want" - >&2 ||
  fail "DEBIAN/conffiles is not exactly the four files under /etc"
ok "conffiles: $(tr '\n' ' ' <"$work/DEBIAN/conffiles")"

step "the binary"
"$r/usr/bin/felhom-agent" --version | grep -qx "felhom-agent $version" ||
  fail "the packaged binary does not report version $version"
ok "usr/bin/felhom-agent runs: $("$r/usr/bin/felhom-agent" --version)"

step "no test hooks in the packaged binary"
# The kill switch, the kernel root of the lab bridge checks, the hub timing override (with its loop-hang key), the task-search settle
# window, the journal refresh interval and the exec helper's idle time exist only with the
# `test-hooks` feature. The test build
# (target/debug/felhom-agent after build-deb.sh) must carry every name, which shows that the
# search finds them where they are.
hooks="FELHOM_AGENT_KILL_AT FELHOM_AGENT_KERNEL_ROOT FELHOM_AGENT_HUB_TIMING FELHOM_AGENT_SUBMIT_SETTLE_MS FELHOM_AGENT_REFRESH_MS FELHOM_AGENT_EXEC_IDLE_MS FELHOM_AGENT_BED_HOST_USERNS hang_hub_loop_after_ms"
for name in $hooks; do
  grep -qaF "$name" "$r/usr/bin/felhom-agent" && fail "the packaged binary carries the test hook $name"
  grep -qaF "$name" "${CARGO_TARGET_DIR:-$root/target}/debug/felhom-agent" ||
    fail "the test build lacks $name: the search for test hooks proves nothing"
done
ok "the packaged binary carries none of $hooks (the test build carries them all)"

step "man page and completions"
gzip -t "$r/usr/share/man/man1/felhom-agent.1.gz" || fail "the man page is not valid gzip"
# As lintian's manpage check: any warning of man/groff fails.
man_warnings=$(LC_ALL=C.UTF-8 MANWIDTH=80 man --warnings -E UTF-8 -l -Tutf8 -Z \
  "$r/usr/share/man/man1/felhom-agent.1.gz" 2>&1 >/dev/null || true)
[ -z "$man_warnings" ] || fail "man reports: $man_warnings"
man_text=$(MANWIDTH=100 man -l "$r/usr/share/man/man1/felhom-agent.1.gz" 2>/dev/null | col -b)
for want in "--selftest" "--config" "vmid-check" "doctor" "destroy --vmid N" "EXIT STATUS" \
  "/etc/felhom-agent/agent.toml" "felhom-restore-test.timer"; do
  grep -qF -- "$want" <<<"$man_text" || fail "the man page does not mention $want"
done
for want in "journal refresh" "journal resolve TXN --reason TEXT" "journal resume TXN" "journal cancel TXN"; do
  grep -qF -- "$want" <<<"$man_text" || fail "the man page lacks the journal verb: $want"
done
! grep -qE -- '--(all|stats|keep|dry-run) [A-Z_]+( |$)' <<<"$man_text" || fail "the man page shows a flag as taking a value"
ok "man page: renders without warnings, documents the options, commands, exit codes and files"
# bash: the script loads and registers the completion function.
bash -c 'set -e; source "$1"; complete -p felhom-agent' _ \
  "$r/usr/share/bash-completion/completions/felhom-agent" >"$work/bash-complete" ||
  fail "the bash completion does not load"
grep -q 'felhom-agent$' "$work/bash-complete" || fail "bash completion not registered: $(cat "$work/bash-complete")"
# bash: completion below the top level, driven as bash's completion calls the function.
complete_words() {
  bash -c 'source "$1"; shift; COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1));
    _felhom__agent felhom-agent "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"; echo "${COMPREPLY[*]}"' _ \
    "$r/usr/share/bash-completion/completions/felhom-agent" "$@"
}
[ "$(complete_words felhom-agent journal re)" = "refresh resolve resume" ] ||
  fail "bash does not complete journal's verbs: [$(complete_words felhom-agent journal re)]"
complete_words felhom-agent destroy --v | grep -qw -- --vmid ||
  fail "bash does not complete destroy's --vmid: [$(complete_words felhom-agent destroy --v)]"
head -1 "$r/usr/share/zsh/vendor-completions/_felhom-agent" | grep -qx '#compdef felhom-agent' ||
  fail "the zsh completion does not start with #compdef felhom-agent"
grep -q '^complete -c felhom-agent .*-l selftest' "$r/usr/share/fish/vendor_completions.d/felhom-agent.fish" ||
  fail "the fish completion does not complete --selftest"
ok "completions: bash loads, zsh #compdef, fish completes --selftest"

step "sysusers and tmpfiles: the user, the state directory, the config, the metrics folder and links"
# A scratch root with a base passwd/group (root, and www-data as on every Debian system).
tr=$work/tmpfiles-root
mkdir -p "$tr/etc/felhom-agent" "$tr/var/lib/prometheus/node-exporter"
printf 'root:x:0:0:root:/root:/bin/bash\n' >"$tr/etc/passwd"
printf 'root:x:0:\nwww-data:x:33:\n' >"$tr/etc/group"
: >"$tr/etc/shadow"
: >"$tr/etc/gshadow"
systemd-sysusers --root="$tr" "$r/usr/lib/sysusers.d/felhom-agent.conf" 2>"$work/sysusers.err" ||
  fail "systemd-sysusers failed on the shipped snippet: $(cat "$work/sysusers.err")"
agent_uid=$(awk -F: '$1 == "felhom-agent" { print $3 }' "$tr/etc/passwd")
agent_gid=$(awk -F: '$1 == "felhom-agent" { print $4 }' "$tr/etc/passwd")
[ -n "$agent_uid" ] && [ "$agent_uid" -ne 0 ] || fail "sysusers made no non-root felhom-agent: $(cat "$tr/etc/passwd")"
awk -F: -v u="$agent_uid" '$1 == "felhom-agent" && $3 == u && $6 == "/nonexistent" && $7 == "/usr/sbin/nologin" { f = 1 } END { exit !f }' \
  "$tr/etc/passwd" || fail "felhom-agent is not a nologin system user with home /nonexistent: $(cat "$tr/etc/passwd")"
# No pmxcfs group: www-data reads the node's TLS key in /etc/pve (the exec helper hands the
# agent its cluster files).
! grep -qE '^www-data:x:33:(.*,)?felhom-agent(,.*)?$' "$tr/etc/group" ||
  fail "felhom-agent is a member of www-data, which reads the node's TLS key: $(cat "$tr/etc/group")"
printf 'pool = "x"\n' >"$tr/etc/felhom-agent/agent.toml"
chmod 0600 "$tr/etc/felhom-agent/agent.toml"
systemd-tmpfiles --root="$tr" --create "$r/usr/lib/tmpfiles.d/felhom-agent.conf" 2>"$work/tmpfiles.err" ||
  fail "systemd-tmpfiles failed: $(cat "$work/tmpfiles.err")"
mode=$(stat -c '%a %u %g' "$tr/var/lib/felhom-agent")
[ "$mode" = "700 $agent_uid $agent_gid" ] ||
  fail "tmpfiles made /var/lib/felhom-agent $mode, want 700 $agent_uid $agent_gid (felhom-agent)"
mode=$(stat -c '%a %u %g' "$tr/etc/felhom-agent/agent.toml")
[ "$mode" = "640 0 $agent_gid" ] || fail "tmpfiles left agent.toml $mode, want 640 0 $agent_gid (root:felhom-agent)"
mode=$(stat -c '%a %u %g' "$tr/var/lib/felhom-agent-metrics")
[ "$mode" = "755 $agent_uid $agent_gid" ] ||
  fail "tmpfiles made /var/lib/felhom-agent-metrics $mode, want 755 $agent_uid $agent_gid (felhom-agent)"
[ -z "$(ls -A "$tr/var/lib/prometheus/node-exporter")" ] ||
  fail "tmpfiles put something into node_exporter's textfile folder: $(ls -la "$tr/var/lib/prometheus/node-exporter")"
mode=$(stat -c '%a %u %g' "$tr/var/lib/prometheus/node-exporter")
[ "$mode" = "755 0 0" ] || fail "the textfile folder is $mode after tmpfiles, want 755 0 0 (root's, untouched)"
ok "sysusers: felhom-agent uid $agent_uid (nologin, home /nonexistent, in no group but its own); tmpfiles: state dir 0700 felhom-agent, agent.toml 0640 root:felhom-agent, metrics folder 0755 felhom-agent, nothing in the textfile folder (root publishes the files)"

step "the agent's user may write only in its own folders"
# Every tmpfiles line and unit that gives felhom-agent write access must name one of the
# agent's own folders: root writes to no folder the agent's user may write (root's tools
# follow links such a user could plant).
"$root/tests/check-agent-grants.sh" "$r/usr/lib/tmpfiles.d/felhom-agent.conf" "$r"/lib/systemd/system/*.service ||
  fail "a tmpfiles line or unit gives the agent's user write access outside its own folders"
# The check can fail: the ACL line the package once shipped (rwx for the user on root's
# textfile folder), a unit that lets the user write there, a folder of root's made the user's.
# grant_refused FILE WHAT: the grant check must refuse FILE, which grants WHAT.
grant_refused() {
  ! "$root/tests/check-agent-grants.sh" "$1" 2>/dev/null || fail "the grant check passed $2"
}
# unit_writing PATHS OUT: the daemon's unit with ReadWritePaths=PATHS, written to OUT.
unit_writing() {
  sed "s|^ReadWritePaths=.*|ReadWritePaths=$1|" "$r/lib/systemd/system/felhom-agent.service" >"$2"
}
cp "$r/usr/lib/tmpfiles.d/felhom-agent.conf" "$work/grant.conf"
echo 'a+ /var/lib/prometheus/node-exporter - - - - u:felhom-agent:rwx' >>"$work/grant.conf"
grant_refused "$work/grant.conf" "an ACL giving felhom-agent rwx on /var/lib/prometheus/node-exporter"
printf 'd /etc/felhom-agent 0750 root felhom-agent -\nd /srv/x - felhom-agent felhom-agent -\n' >"$work/grant2.conf"
[ "$("$root/tests/check-agent-grants.sh" "$work/grant2.conf" 2>&1 | grep -c grants)" = 1 ] ||
  fail "the grant check missed /srv/x made the user's (or refused /etc/felhom-agent, group read only)"
unit_writing "/var/lib/felhom-agent-metrics -/var/lib/prometheus/node-exporter" "$work/grant.service"
grant_refused "$work/grant.service" "a unit giving felhom-agent /var/lib/prometheus/node-exporter"
# World-writable modes, a group the user is in (www-data), others in an ACL, `..` or `.` in a
# path: each is a grant to the user, and each line is named.
printf '%s\n' 'd /srv/w1 1777 root root -' 'd /srv/w2 0775 root www-data -' \
  'a+ /srv/w3 - - - - o::rwx' 'd /var/lib/felhom-agent/../../etc/w4 - felhom-agent felhom-agent -' \
  'd /var/lib/felhom-agent/./w5 0700 felhom-agent felhom-agent -' 'd /srv/w6 0755 root www-data -' \
  >"$work/grant3.conf"
[ "$("$root/tests/check-agent-grants.sh" "$work/grant3.conf" 2>&1 | grep -c grants)" = 5 ] ||
  fail "the grant check missed a world-writable mode, a www-data group grant, an ACL for others or a path with .. or . (or refused /srv/w6, group read only)"
unit_writing "/var/lib/felhom-agent/../../etc" "$work/grant4.service"
grant_refused "$work/grant4.service" "a unit giving felhom-agent /var/lib/felhom-agent/../../etc"
ok "tmpfiles and units give felhom-agent write access only to /var/lib/felhom-agent and /var/lib/felhom-agent-metrics"

step "maintainer scripts"
for s in postinst prerm postrm; do
  f=$work/DEBIAN/$s
  [ -x "$f" ] || fail "DEBIAN/$s is missing or not executable"
  sh -n "$f" || fail "DEBIAN/$s has a syntax error"
  grep -q '#DEBHELPER#' "$f" && fail "DEBIAN/$s still holds #DEBHELPER#"
done
# postinst against stubs, installing into a scratch DPKG_ROOT: it creates the user, enables the
# daemon, the exec helper's socket and the timer, creates the state directory 0700 and exits 0.
stubs=$work/stubs
mkdir -p "$stubs" "$work/dpkg-root"
for cmd in deb-systemd-helper deb-systemd-invoke systemctl systemd-tmpfiles systemd-sysusers; do
  printf '#!/bin/sh\necho "%s $*" >>"%s"\n' "$cmd" "$work/calls" >"$stubs/$cmd"
  chmod 755 "$stubs/$cmd"
done
: >"$work/calls"
DPKG_ROOT=$work/dpkg-root PATH="$stubs:$PATH" sh "$work/DEBIAN/postinst" configure "" ||
  fail "postinst configure failed"
for want in "deb-systemd-helper enable felhom-agent.service" \
  "deb-systemd-helper enable felhom-agent-exec.socket" \
  "deb-systemd-helper enable felhom-restore-test.timer" \
  "deb-systemd-helper enable felhom-agent-metrics.path" \
  "systemd-sysusers --root=$work/dpkg-root felhom-agent.conf" \
  "systemd-tmpfiles --root=$work/dpkg-root --create felhom-agent.conf"; do
  grep -qxF "$want" "$work/calls" || fail "postinst did not run: $want (ran: $(tr '\n' ';' <"$work/calls"))"
done
grep -q 'start felhom-agent.service\|restart felhom-agent.service' "$work/calls" &&
  fail "postinst into a DPKG_ROOT started the daemon: $(cat "$work/calls")"
[ "$(stat -c %a "$work/dpkg-root/var/lib/felhom-agent")" = 700 ] ||
  fail "postinst did not create the state directory 0700"
cp "$work/calls" "$work/calls.postinst"
: >"$work/calls"
PATH="$stubs:$PATH" sh "$work/DEBIAN/postrm" purge || fail "postrm purge failed"
grep -qxF "deb-systemd-helper purge felhom-agent.service felhom-agent-exec.socket felhom-restore-test.timer felhom-agent-metrics.path" "$work/calls" ||
  fail "postrm purge did not purge the units' state: $(cat "$work/calls")"
# sysusers runs before tmpfiles: the tmpfiles snippet names the user.
awk '/^systemd-sysusers /{ u = NR } /^systemd-tmpfiles /{ t = NR } END { exit !(u && t && u < t) }' \
  "$work/calls.postinst" || fail "postinst does not create the user before running tmpfiles"
ok "postinst creates the user, enables felhom-agent.service, felhom-agent-exec.socket, felhom-restore-test.timer and felhom-agent-metrics.path, makes the state dir 0700; postrm purges"

step "units: not before agent.toml exists"
for u in felhom-agent.service felhom-restore-test.service; do
  grep -qx 'ConditionPathExists=/etc/felhom-agent/agent.toml' "$r/lib/systemd/system/$u" ||
    fail "$u does not wait for /etc/felhom-agent/agent.toml"
done
ok "both services carry ConditionPathExists=/etc/felhom-agent/agent.toml"

step "systemd-analyze verify"
# A root with the host's units (for the targets they refer to) and the unpacked package on top.
vroot=$work/vroot
mkdir -p "$vroot/lib/systemd/system"
cp -a /lib/systemd/system/. "$vroot/lib/systemd/system/"
cp -a "$r/." "$vroot/"
# felhom-lab@.service runs coreutils' sleep (Essential on every Debian, so on every node).
mkdir -p "$vroot/bin"
cp -L /bin/sleep "$vroot/bin/sleep"
units=(felhom-agent.service felhom-restore-test.service felhom-restore-test.timer
  felhom-agent-exec.socket felhom-agent-exec.service felhom-agent-metrics.path
  felhom-agent-metrics.service felhom-lab@.service)
paths=()
for u in "${units[@]}"; do paths+=("$vroot/lib/systemd/system/$u"); done
set +e
verify_out=$(systemd-analyze verify --man=no --root="$vroot" "${paths[@]}" 2>&1)
verify_rc=$?
set -e
if [ "$verify_rc" -ne 0 ] || [ -n "$verify_out" ]; then
  printf '%s\n' "$verify_out" >&2
  fail "systemd-analyze verify: exit $verify_rc, messages above (unknown keys are only warnings, so any message fails)"
fi
ok "systemd-analyze verify: ${units[*]}: no message"

step "systemd-analyze security --offline=true"
exposure() {
  local unit=$1 max=$2 out level
  out=$(systemd-analyze security --offline=true --root="$vroot" --no-pager \
    "$vroot/lib/systemd/system/$unit" 2>&1) || { printf '%s\n' "$out" >&2; fail "security of $unit"; }
  # The options that count against the unit (a weight at the end of the line) and the total.
  printf '%s\n' "$out" | grep -E ' [0-9]+\.[0-9]+ *$|Overall exposure' || true
  level=$(printf '%s\n' "$out" | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
  [ -n "$level" ] || fail "no exposure level for $unit"
  awk -v l="$level" -v m="$max" 'BEGIN { exit !(l <= m) }' ||
    fail "$unit exposure $level is above $max (systemd/README.md): a hardening option was lost?"
  ok "$unit exposure $level (at most $max)"
}
exposure felhom-agent.service "$MAX_EXPOSURE_AGENT"
exposure felhom-restore-test.service "$MAX_EXPOSURE_RESTORE"
exposure felhom-agent-exec.service "$MAX_EXPOSURE_EXEC"
exposure felhom-agent-metrics.service "$MAX_EXPOSURE_METRICS"
exposure felhom-lab@.service "$MAX_EXPOSURE_LAB"

step "units: who runs as whom"
unit_key() { sed -n "s/^$2=//p" "$r/lib/systemd/system/$1" | tail -n 1; }
for u in felhom-agent.service felhom-restore-test.service; do
  user=$(unit_key "$u" User)
  [ -n "$user" ] && [ "$user" != root ] && [ "$user" != 0 ] || fail "$u has no non-root User= (User=$user)"
  [ "$user" = felhom-agent ] || fail "$u runs as $user, not the package's user felhom-agent"
  grep -qx 'CapabilityBoundingSet=' "$r/lib/systemd/system/$u" || fail "$u keeps capabilities"
  grep -qx 'Wants=felhom-agent-exec.socket' "$r/lib/systemd/system/$u" || fail "$u does not want the exec helper's socket"
  grep -qx 'LoadCredential=pve-token:/etc/felhom-agent/pve-token' "$r/lib/systemd/system/$u" ||
    fail "$u does not hand over the PVE token secret with LoadCredential="
  # A node without a hub has no hub-token file: SetCredential= is LoadCredential='s default.
  grep -qx 'SetCredential=hub-token:absent' "$r/lib/systemd/system/$u" ||
    fail "$u fails to start without /etc/felhom-agent/hub-token (no SetCredential=hub-token:absent)"
done
[ -z "$(unit_key felhom-agent-exec.service User)" ] || fail "the exec helper must run as root"
grep -qx 'ExecStart=/usr/bin/felhom-agent exec-helper' "$r/lib/systemd/system/felhom-agent-exec.service" ||
  fail "felhom-agent-exec.service does not run felhom-agent exec-helper"
for kv in ListenStream=/run/felhom-agent/exec.sock SocketUser=root SocketGroup=felhom-agent \
  SocketMode=0660 Accept=no; do
  grep -qx "$kv" "$r/lib/systemd/system/felhom-agent-exec.socket" || fail "felhom-agent-exec.socket lacks $kv"
done
ok "the daemon and the restore test run as felhom-agent with no capabilities, secrets by LoadCredential=; the helper as root on a 0660 root:felhom-agent socket"

step "lintian"
if command -v lintian >/dev/null 2>&1; then
  # Errors and warnings fail; deliberate exceptions are overrides shipped in the package.
  set +e
  lintian --fail-on error,warning --display-level '>=info' --tag-display-limit 0 "$deb" 2>&1 |
    grep -v '^running with root privileges is not recommended!$'
  lintian_rc=${PIPESTATUS[0]}
  set -e
  [ "$lintian_rc" -eq 0 ] || fail "lintian found errors or warnings (above), exit $lintian_rc"
  ok "lintian: no error, no warning (info tags above, if any)"
else
  echo "note: lintian is not installed; tests/setup.sh installs it" >&2
fi

echo "ok: package $(basename "$deb") checked in $SECONDS s"
