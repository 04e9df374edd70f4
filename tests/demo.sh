#!/usr/bin/env bash
# The demo: a fake Proxmox VE (fakepve) on loopback with pool guests, foreign guests and a
# backup; containers as real root filesystems behind the `pct` stand-in; the agent configured
# with a pinned certificate and a pool-scoped token. Then the operator's commands: doctor, the
# full guest list, vmid verdicts, a full `--selftest=provision` with its phases, a refused
# foreign vmid, a refused reserved vmid, a self-restore-test, and the journal. As on a node,
# the agent's execs into containers go through the root exec helper (`felhom-agent exec-helper`
# on its own socket), which alone runs `pct`, after reading the container's own config in the
# fake's live `nodes/<node>/lxc/<vmid>.conf` (`[exec] pve_nodes_dir`).
# Nothing outside 127.0.0.0/8 is touched.
#
# Where LXC runs (lxc-start and mmdebstrap installed; tests/setup.sh installs them), the
# containers are real: the fake restores each as an unprivileged LXC container of a Debian 12
# root filesystem with systemd (tests/testbed/build-debian-rootfs.sh, built once into
# target/testbed/), starts it with lxc-start, and `pct exec` is lxc-attach; the demo then also
# keeps one provision, shows its booted guest (systemd's state, its address on the bed's own
# bridge) and destroys it. Elsewhere it says why in one line and uses the busybox bed.
# FELHOM_DEMO_GUESTS=busybox forces the busybox bed.
#
# Needs root: the `pct` stand-in enters each guest's root filesystem with unshare + chroot, and
# the exec helper serves only callers it can check as root or the agent's user.
# Installs only what it needs (tests/setup-demo.sh: busybox-static, util-linux, python3-venv,
# fakepve into .fakepve-venv/).
# Exit status: 0 only when every step ended as it should (the provision and the restore test
# `ok`, the restore test having proven guest 200's backup, the refusals refused); 1 otherwise,
# with the steps that did not and the tails of the logs that can say why (show_logs).
# FELHOM_AGENT_BIN: an agent binary to run instead of building one. Otherwise cargo builds it:
# the cargo on PATH, or the checkout owner's rustup cargo (~/.cargo/bin, which sudo's
# secure_path drops), run as the checkout's owner; without either it says what to run.
#
# --playground: the same steps, then the fake node stays up: it prints the two variables to
# export (FELHOM_AGENT_CONFIG, and PATH with the agent and its `pct`; also written to
# <work>/env) so every operator command can be tried against it from another shell, until
# Ctrl-C (or SIGTERM), which removes the fake, the exec helper, the guests and the work folder
# (exit 0).
set -euo pipefail
playground=""
case "${1:-}" in
  "") ;;
  --playground) playground=1 ;;
  *)
    echo "usage: tests/demo.sh [--playground]" >&2
    exit 2
    ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ "$(id -u)" -ne 0 ]; then
  echo "tests/demo.sh needs root: the pct stand-in runs each guest under unshare + chroot; run it as root (sudo tests/demo.sh)" >&2
  exit 2
fi
# Run under sudo (or by root for a user's checkout), what the demo leaves in the checkout
# belongs to the checkout's owner: the build (cargo runs as the owner), .fakepve-venv/ and the
# work folder's parent. (.testbed/, the guests' root filesystem template, is root's: a guest's
# files are root's.)
owner=$(stat -c %U "$root")
as_owner() {
  if [ "$owner" = root ]; then "$@"; else runuser -u "$owner" -- "$@"; fi
}
[ -e .fakepve-venv ] && venv_was_there=1 || venv_was_there=""
source tests/setup-demo.sh
[ -n "$venv_was_there" ] || chown -R "$owner": .fakepve-venv 2>/dev/null || true

if [ -n "${FELHOM_AGENT_BIN:-}" ]; then
  agent=$FELHOM_AGENT_BIN
else
  # sudo's secure_path drops ~/.cargo/bin, and a rustup cargo run with root's HOME finds no
  # toolchain: the cargo on PATH, else the checkout owner's rustup cargo, run as the owner
  # with the owner's HOME.
  owner_home=$(getent passwd "$owner" | cut -d: -f6)
  cargo_bin=$(command -v cargo || true)
  if [ "$owner" != root ] || [ -z "$cargo_bin" ]; then
    [ -x "$owner_home/.cargo/bin/cargo" ] && cargo_bin="$owner_home/.cargo/bin/cargo"
  fi
  need_rust=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)
  if [ -z "$cargo_bin" ]; then
    echo "tests/demo.sh: no cargo on PATH or in $owner_home/.cargo/bin. Install Rust $need_rust or newer (https://rustup.rs) as $owner, then run: sudo tests/demo.sh" >&2
    exit 2
  fi
  printf '\n== building felhom-agent (%s, as %s)\n' "$cargo_bin" "$owner" >&2
  if ! as_owner env HOME="$owner_home" PATH="$(dirname "$cargo_bin"):$PATH" \
    "$cargo_bin" build --quiet -p felhom-agent; then
    echo "tests/demo.sh: the build failed (above); the workspace needs Rust $need_rust or newer ($("$cargo_bin" --version 2>/dev/null || echo 'cargo did not answer')). Build it as $owner (cargo build -p felhom-agent), then run: sudo FELHOM_AGENT_BIN=$root/target/debug/felhom-agent tests/demo.sh" >&2
    exit 2
  fi
  agent="$root/target/debug/felhom-agent"
fi

# Not under /tmp: the agent refuses a state_dir that does not survive a reboot.
# The agent refuses a state_dir under /tmp, /run or /dev/shm (or on tmpfs): a checkout there
# keeps its work folder in /var/tmp instead.
base=${FELHOM_TEST_STATE_BASE:-$root/target/tmp}
case "$base/" in /tmp/* | /run/* | /dev/shm/*) base=/var/tmp/felhom-agent-tests ;; esac
as_owner mkdir -p "$base"
# A real container's root (uid 100000) must pass through every folder above its root
# filesystem: a checkout below a folder others may not enter (a `mktemp -d` folder is 0700)
# keeps its work folder directly in /var/tmp (mode 1777: anyone may pass), where nothing of the
# demo stays once it ends.
if ! setpriv --reuid 100000 --regid 100000 --clear-groups test -x "$base" 2>/dev/null; then
  base=/var/tmp
fi
work=$(mktemp -d "$base/felhom-demo.XXXXXX")
fake_pid=""
helper_pid=""
net_prefix=""
sleep_pid=""
cleanup() {
  [ -n "$sleep_pid" ] && kill "$sleep_pid" 2>/dev/null || true
  [ -n "$helper_pid" ] && kill "$helper_pid" 2>/dev/null && wait "$helper_pid" 2>/dev/null || true
  [ -n "$fake_pid" ] && kill "$fake_pid" 2>/dev/null && wait "$fake_pid" 2>/dev/null || true
  # The fake stops its real containers and removes its bridges as it ends; what a killed fake
  # left goes here.
  if [ -n "$net_prefix" ]; then
    for d in "$work"/lxc/*/; do
      [ -d "$d" ] && lxc-stop -P "$work/lxc" -n "$(basename "$d")" --kill >/dev/null 2>&1 || true
    done
    for l in /sys/class/net/"$net_prefix"*; do
      [ -e "$l" ] && ip link del "$(basename "$l")" 2>/dev/null || true
    done
    for c in /sys/fs/cgroup/*/felhom-bed/"$net_prefix" /sys/fs/cgroup/felhom-bed/"$net_prefix"; do
      [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
  fi
  rm -rf "$work"
}
trap cleanup EXIT
# A real container's root (uid 100000) must be able to pass through the work folder.
chmod 0711 "$work"

host=127.0.0.77
# The agent refuses config, profile and check folders and a state dir that group or others may
# write, whatever the caller's umask.
umask 022
# certs/: the fake's TLS key and its control secret (tests/fakepve/README.md), root's alone.
mkdir -m 700 "$work/certs"
mkdir -p "$work/state" "$work/bootstrap.d" "$work/checks.d" "$work/bin" "$work/pct-state" "$work/metrics"
cp -a packaging/bootstrap.d/default "$work/bootstrap.d/"
cp -a packaging/checks.d/default.toml "$work/checks.d/"
chmod -R go-w "$work/bootstrap.d" "$work/checks.d"

printf '\n== building the guest root filesystem template\n' >&2
tests/testbed/build-rootfs.sh >&2
real_tarball=""
if [ "${FELHOM_DEMO_GUESTS:-real}" = busybox ]; then
  guests_line="guests: the busybox bed (FELHOM_DEMO_GUESTS=busybox)"
elif ! command -v lxc-start >/dev/null 2>&1 || ! command -v mmdebstrap >/dev/null 2>&1; then
  guests_line="guests: the busybox bed (lxc or mmdebstrap is not installed; tests/setup.sh installs them)"
else
  printf '\n== building the Debian root filesystem of the real guests (once)\n' >&2
  if real_tarball=$(tests/testbed/build-debian-rootfs.sh "$root/target/testbed"); then
    net_prefix=fhd$(printf '%04x' $(($$ % 65536)))
    guests_line="guests: real LXC containers (Debian 12 with systemd), links ${net_prefix}*"
  else
    real_tarball=""
    guests_line="guests: the busybox bed (tests/testbed/build-debian-rootfs.sh failed, above)"
  fi
fi
echo "$guests_line"
if [ -n "$real_tarball" ]; then
  printf '%s' "$work/lxc" >"$work/pct-state/lxc_path"
fi
# The agent runs `pct` with a cleared environment, so the stand-in's settings live in a wrapper.
cat >"$work/bin/pct" <<WRAP
#!/bin/sh
FELHOM_PCT_STATE='$work/pct-state' FELHOM_PCT_LXCPATH='$work/lxc' exec '$root/tests/pct/pct' "\$@"
WRAP
chmod 755 "$work/bin/pct"
export PATH="$work/bin:$PATH"
FELHOM_DEMO_REAL_TARBALL=$real_tarball FELHOM_DEMO_NET_PREFIX=$net_prefix \
  "$FELHOM_FAKEPVE_PYTHON" - "$root/tests/fakepve/scenarios/demo.json" "$work" "$host" "$root" <<'PY'
import json, os, sys
scenario, work, host, root = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3], sys.argv[4]
# The fake makes each restored guest's root filesystem where the pct stand-in looks for it, and
# keeps its state in step with PVE's (tests/fakepve/README.md, "Guest bed").
# Each running container gets a stand-in of root's LXC monitor holding its command socket under
# the bed's lxcpath, which the exec helper checks before every pct exec ([exec] lxc_path).
scenario["guest_bed"] = {"state": work + "/pct-state", "template": root + "/.testbed/rootfs",
                         "lxc_path": work + "/lxc", "monitor": root + "/tests/pct/lxc-monitor"}
real = os.environ.get("FELHOM_DEMO_REAL_TARBALL")
if real:
    scenario["guest_bed"]["real_lxc"] = {"tarball": real, "osqueryi": root + "/tests/testbed/osqueryi",
                                         "net_prefix": os.environ["FELHOM_DEMO_NET_PREFIX"]}
    # The backup of 200 as a Debian guest: its hostname, an address on vmbr0.
    for vols in scenario.get("volumes", {}).values():
        for vol in vols:
            if vol.get("vmid") == 200:
                vol["config"].update(arch="amd64", ostype="debian", hostname="web1",
                                     net0="name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:00,"
                                          "ip=10.20.0.31/24,gw=10.20.0.1,type=veth")
for vols in scenario.get("volumes", {}).values():
    for vol in vols:
        vol.setdefault("guest", {})
        # Made last night, as a node's nightly backup is (an older one is reported stale).
        vol["ctime"] = int(__import__("time").time()) - 6 * 3600
scenario["user_cfg"] = {"path": work + "/user.cfg"}
# The containers' own configs (`nodes/<node>/lxc/<vmid>.conf`), kept live as pmxcfs keeps
# /etc/pve/nodes: the exec helper reads a container's before every exec ([exec] pve_nodes_dir).
scenario["ct_conf"] = {"dir": work + "/nodes"}
scenario.update(host=host, port=0, certdir=work + "/certs")
# The node's full guest list: every scenario guest, plus one on another cluster node that
# only the local list knows about.
# fakepve keeps it live, as pmxcfs does on a node.
scenario["vmlist"] = {"path": work + "/vmlist", "extra": [{"vmid": 4100, "node": "pve2", "type": "lxc"}]}
# The scenario holds the token secrets, and the work folder lets everyone through (a real
# container's root must pass): it is root's alone from its creation on.
with os.fdopen(os.open(work + "/scenario.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
    json.dump(scenario, f)
tokens = scenario["tokens"]
token_id, secret = next(iter(tokens.items()))
with open(work + "/token-id", "w") as f:
    f.write(token_id)
fd = os.open(work + "/pve-token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, (secret + "\n").encode())
os.close(fd)
PY

printf '\n== starting fakepve on %s\n' "$host" >&2
mkfifo -m 600 "$work/ready"
# At INFO its log names every task it ran and how each ended (a failed one as a warning); at
# its default level (WARNING) a session where nothing went wrong leaves the log empty.
FAKEPVE_LOG_LEVEL=${FAKEPVE_LOG_LEVEL:-INFO} \
  "$FELHOM_FAKEPVE_PYTHON" tests/fakepve/scenario.py "$work/scenario.json" >"$work/ready" 2>"$work/fakepve.log" &
fake_pid=$!
read -r ready <"$work/ready"
url=$(printf '%s' "$ready" | "$FELHOM_FAKEPVE_PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["url"])')
pin=$(printf '%s' "$ready" | "$FELHOM_FAKEPVE_PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["sha256"])')
control=$(printf '%s' "$ready" | "$FELHOM_FAKEPVE_PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["control"])')
echo "fakepve at $url, certificate SHA-256 $pin" >&2

cat >"$work/agent.toml" <<TOML
node = "pve1"
pool = "felhom"
state_dir = "$work/state"
vmlist_path = "$work/vmlist"
datacenter_cfg = "$work/datacenter.cfg"
user_cfg_path = "$work/user.cfg"

[pve]
url = "$url"
token_id = "$(cat "$work/token-id")"
token_secret_file = "$work/pve-token"
tls_fingerprint = "$pin"

[provision]
storage = "local-lvm"
selftest_source = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst"
bootstrap_dir = "$work/bootstrap.d"
checks_dir = "$work/checks.d"

[metrics]
dir = "$work/metrics"

[exec]
helper_socket = "$work/exec.sock"
pve_nodes_dir = "$work/nodes"
lxc_path = "$work/lxc"
TOML
printf 'next-id: lower=100,upper=1000000\n' >"$work/datacenter.cfg"

printf '\n== starting the exec helper on %s\n' "$work/exec.sock" >&2
"$agent" exec-helper --config "$work/agent.toml" --socket "$work/exec.sock" 2>"$work/exec-helper.log" &
helper_pid=$!
for _ in $(seq 1 200); do
  [ -S "$work/exec.sock" ] && break
  kill -0 "$helper_pid" 2>/dev/null || { cat "$work/exec-helper.log" >&2; exit 1; }
  sleep 0.05
done
[ -S "$work/exec.sock" ] || { echo "the exec helper did not listen on $work/exec.sock" >&2; exit 1; }

# The last lines of a log that may hold why a step failed: 40 at most, each clipped to 300
# bytes, control characters but the tab left out (the fake's log quotes what a container
# wrote).
log_tail() {
  local title=$1 file=$2
  if [ ! -e "$file" ]; then
    printf '\n== %s: %s is missing\n' "$title" "$file" >&2
  elif [ ! -s "$file" ]; then
    printf '\n== %s: %s is empty\n' "$title" "$file" >&2
  else
    printf '\n== %s: %s (last 40 lines)\n' "$title" "$file" >&2
    tail -n 40 "$file" | LC_ALL=C tr -d '\000-\010\013-\037\177' | cut -b 1-300 >&2 || true
  fi
}
# Every log that can hold the cause of a failed step: the fake's (each PVE task's end, a
# container start that failed with its start log quoted), the exec helper's (each exec it
# refused or ran), and each real container's own start log (lxc-start's output and LXC's
# errors, kept beside the container's folder by the fake, so they outlive its destroy).
show_logs() {
  log_tail "the fake PVE's log" "$work/fakepve.log"
  log_tail "the exec helper's log" "$work/exec-helper.log"
  local found="" f
  for f in "$work"/pct-state/*.lxc-start.log "$work"/pct-state/*.lxc.log; do
    [ -e "$f" ] || continue
    found=1
    log_tail "container $(basename "$f" | cut -d. -f1)'s own start log" "$f"
  done
  [ -n "$found" ] || printf '\n== no container start log: no real LXC container was started (%s)\n' "$guests_line" >&2
}

# Each step with the exit status it must end with; any other status fails the demo.
failed=()
run() {
  local want=$1
  shift
  printf '\n$ felhom-agent %s\n' "$*"
  set +e
  "$agent" --config "$work/agent.toml" "$@"
  local rc=$?
  set -e
  printf '(exit %d)\n' "$rc"
  [ "$rc" -eq "$want" ] || failed+=("felhom-agent $* exited $rc, expected $want")
}

run 0 doctor
run 0 guests
run 0 vmid-check 120
run 3 vmid-check 4100
run 3 vmid-check 0120
run 0 vmid-check 120 --json
run 0 --selftest=provision -vmid 120
run 3 --selftest=provision -vmid 101
run 3 --selftest=provision -vmid 990003
run 0 --selftest=restore
printf '\n$ cat %s\n' "metrics/felhom_restore_test.prom"
cat "$work/metrics/felhom_restore_test.prom"
printf '\n$ grep status= %s\n' "metrics/felhom_backup_coverage.prom"
grep 'status=' "$work/metrics/felhom_backup_coverage.prom" || true
# Exit 0 is also a run that proved nothing (nothing due, or the band full), and its metrics
# then say `ok` or `skipped`: the demo's restore test must have ended `ok` and proven the
# newest backup of guest 200, the demo's one pool guest with a backup.
grep -qx 'felhom_restore_test_outcome{outcome="ok"} 1' "$work/metrics/felhom_restore_test.prom" ||
  failed+=("the restore test did not end ok (felhom_restore_test.prom)")
grep -qx 'felhom_backup_status{vmid="200",status="proven"} 1' "$work/metrics/felhom_backup_coverage.prom" ||
  failed+=("the restore test did not prove guest 200's backup (felhom_backup_coverage.prom)")
# The coverage: 200 proven; the demo pool's VM 300 has no backup at all, which the report
# names, and so it exits 5 as it would for a cron job or an auditor.
printf '\n# the demo pool'"'"'s VM 300 has no backup: restore-report names it and exits 5\n'
report_out=$("$agent" --config "$work/agent.toml" restore-report 2>&1) && report_rc=0 || report_rc=$?
printf '\n$ felhom-agent restore-report\n%s\n(exit %d)\n' "$report_out" "$report_rc"
[ "$report_rc" -eq 5 ] || failed+=("felhom-agent restore-report exited $report_rc, expected 5")
printf '%s\n' "$report_out" | grep -Eq '^ +200 .* proven ' ||
  failed+=("restore-report does not show guest 200 proven")
printf '%s\n' "$report_out" | grep -Eq '^ +300 .* no_backup ' ||
  failed+=("restore-report does not show guest 300 without a backup")
# On real guests: a provision kept with the stored network, its guest as it runs, then its
# destroy.
if [ -n "$real_tarball" ]; then
  run 0 --selftest=provision -vmid 121 --keep
  printf '\n$ pct exec 121 -- systemctl is-system-running --wait; cat /etc/os-release; ip -brief address\n'
  pct exec 121 --keep-env 0 -- sh -c 'timeout 60 systemctl is-system-running --wait; grep PRETTY /etc/os-release; ip -brief address' ||
    true
  [ "$(pct exec 121 --keep-env 0 -- ip -o -4 addr show dev eth0 2>/dev/null | grep -c 'inet 10.20.0.31/24')" = 1 ] ||
    failed+=("the kept guest 121 has no 10.20.0.31/24 on eth0")
  run 0 destroy -vmid 121
  if [ -e "$work/lxc/121/config" ] || [ -e "$work/pct-state/121" ] || grep -q " @$work/lxc/121/command\$" /proc/net/unix; then
    failed+=("the destroyed guest 121 is still there (its LXC config, root filesystem or monitor)")
  else
    echo "guest 121: its container, root filesystem and LXC config are gone"
  fi
fi
run 0 journal

if [ ${#failed[@]} -gt 0 ]; then
  printf '\ndemo FAILED: %d step(s) did not end as they should:\n' "${#failed[@]}" >&2
  printf '  %s\n' "${failed[@]}" >&2
  show_logs
  exit 1
fi
printf '\ndemo ok: the provision and the restore test ended ok, every refusal was refused\n' >&2
[ -n "$playground" ] || exit 0

# The playground: the node stays up. `felhom-agent` and the `pct` stand-in side by side on
# PATH, the config by its variable, as on a node.
ln -s "$(readlink -f "$agent")" "$work/bin/felhom-agent"
printf 'export FELHOM_AGENT_CONFIG=%q\nexport PATH=%q:"$PATH"\n' "$work/agent.toml" "$work/bin" >"$work/env"
cat <<EOF

== playground: the fake node ($url) stays up until Ctrl-C
In another shell, as root:
  export FELHOM_AGENT_CONFIG=$work/agent.toml
  export PATH=$work/bin:\$PATH
(or: source $work/env). Then any command of the README, e.g.:
  felhom-agent doctor
  felhom-agent guests
  felhom-agent --selftest=provision -vmid 130
  felhom-agent --selftest=provision -vmid 131 --keep
  felhom-agent journal
  felhom-agent destroy -vmid 131
Its check packs are in $work/checks.d, its bootstrap profiles in $work/bootstrap.d, its
state in $work/state, its metrics in $work/metrics, the fake's log in $work/fakepve.log.
What it exposes (README.md, "A playground"): any local user can connect to both ports
on $host; the fake's API answers only the pool token, its secret in $work/pve-token (root's),
and the fake's control endpoint only requests carrying its secret (root's):
control endpoint: $control (secret: $work/certs/control.secret)
Ctrl-C here removes all of it.
playground ready: $work/env
EOF
stop_playground() {
  printf '\n== playground: stopping the fake node and removing %s\n' "$work" >&2
  exit 0
}
trap stop_playground INT TERM
while kill -0 "$fake_pid" 2>/dev/null; do
  sleep 1 &
  sleep_pid=$!
  wait "$sleep_pid" || true
done
echo "playground: fakepve ended on its own (its log: $work/fakepve.log, removed now)" >&2
log_tail "the fake PVE's log" "$work/fakepve.log"
exit 1
