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
# Needs root: the `pct` stand-in enters each guest's root filesystem with unshare + chroot, and
# the exec helper serves only callers it can check as root or the agent's user.
# Installs only what it needs (tests/setup-demo.sh: busybox-static, util-linux, python3-venv,
# fakepve into .fakepve-venv/).
# Exit status: 0 only when every step ended as it should (the provision and the restore test
# `ok`, the refusals refused); 1 otherwise, with the steps that did not.
# FELHOM_AGENT_BIN: an agent binary to run instead of building one.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ "$(id -u)" -ne 0 ]; then
  echo "tests/demo.sh needs root: the pct stand-in runs each guest under unshare + chroot; run it as root (sudo tests/demo.sh)" >&2
  exit 2
fi
source tests/setup-demo.sh

if [ -n "${FELHOM_AGENT_BIN:-}" ]; then
  agent=$FELHOM_AGENT_BIN
else
  printf '\n== building felhom-agent\n' >&2
  cargo build --quiet -p felhom-agent
  agent="$root/target/debug/felhom-agent"
fi

# Not under /tmp: the agent refuses a state_dir that does not survive a reboot.
# The agent refuses a state_dir under /tmp, /run or /dev/shm (or on tmpfs): a checkout there
# keeps its work folder in /var/tmp instead.
base=${FELHOM_TEST_STATE_BASE:-$root/target/tmp}
case "$base/" in /tmp/* | /run/* | /dev/shm/*) base=/var/tmp/felhom-agent-tests ;; esac
mkdir -p "$base"
work=$(mktemp -d "$base/felhom-demo.XXXXXX")
fake_pid=""
helper_pid=""
cleanup() {
  [ -n "$helper_pid" ] && kill "$helper_pid" 2>/dev/null && wait "$helper_pid" 2>/dev/null || true
  [ -n "$fake_pid" ] && kill "$fake_pid" 2>/dev/null && wait "$fake_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

host=127.0.0.77
# The agent refuses config, profile and check folders and a state dir that group or others may
# write, whatever the caller's umask.
umask 022
mkdir -p "$work/certs" "$work/state" "$work/bootstrap.d" "$work/checks.d" "$work/bin" "$work/pct-state" "$work/metrics"
cp -a packaging/bootstrap.d/default "$work/bootstrap.d/"
cp -a packaging/checks.d/default.toml "$work/checks.d/"
chmod -R go-w "$work/bootstrap.d" "$work/checks.d"

printf '\n== building the guest root filesystem template\n' >&2
tests/testbed/build-rootfs.sh >&2
# The agent runs `pct` with a cleared environment, so the stand-in's settings live in a wrapper.
cat >"$work/bin/pct" <<WRAP
#!/bin/sh
FELHOM_PCT_STATE='$work/pct-state' FELHOM_PCT_LXCPATH='$work/lxc' exec '$root/tests/pct/pct' "\$@"
WRAP
chmod 755 "$work/bin/pct"
export PATH="$work/bin:$PATH"
"$FELHOM_FAKEPVE_PYTHON" - "$root/tests/fakepve/scenarios/demo.json" "$work" "$host" "$root" <<'PY'
import json, sys
scenario, work, host, root = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3], sys.argv[4]
# The fake makes each restored guest's root filesystem where the pct stand-in looks for it, and
# keeps its state in step with PVE's (tests/fakepve/README.md, "Guest bed").
# Each running container gets a stand-in of root's LXC monitor holding its command socket under
# the bed's lxcpath, which the exec helper checks before every pct exec ([exec] lxc_path).
scenario["guest_bed"] = {"state": work + "/pct-state", "template": root + "/.testbed/rootfs",
                         "lxc_path": work + "/lxc", "monitor": root + "/tests/pct/lxc-monitor"}
for vols in scenario.get("volumes", {}).values():
    for vol in vols:
        vol.setdefault("guest", {})
scenario["user_cfg"] = {"path": work + "/user.cfg"}
# The containers' own configs (`nodes/<node>/lxc/<vmid>.conf`), kept live as pmxcfs keeps
# /etc/pve/nodes: the exec helper reads a container's before every exec ([exec] pve_nodes_dir).
scenario["ct_conf"] = {"dir": work + "/nodes"}
scenario.update(host=host, port=0, certdir=work + "/certs")
json.dump(scenario, open(work + "/scenario.json", "w"))
# The node's full guest list: every scenario guest, plus one on another cluster node that
# only the local list knows about.
# fakepve keeps it live, as pmxcfs does on a node.
scenario["vmlist"] = {"path": work + "/vmlist", "extra": [{"vmid": 4100, "node": "pve2", "type": "lxc"}]}
json.dump(scenario, open(work + "/scenario.json", "w"))
tokens = scenario["tokens"]
token_id, secret = next(iter(tokens.items()))
with open(work + "/token-id", "w") as f:
    f.write(token_id)
import os
fd = os.open(work + "/pve-token", os.O_WRONLY | os.O_CREAT, 0o600)
os.write(fd, (secret + "\n").encode())
os.close(fd)
PY

printf '\n== starting fakepve on %s\n' "$host" >&2
mkfifo "$work/ready"
"$FELHOM_FAKEPVE_PYTHON" tests/fakepve/scenario.py "$work/scenario.json" >"$work/ready" 2>"$work/fakepve.log" &
fake_pid=$!
read -r ready <"$work/ready"
url=$(printf '%s' "$ready" | "$FELHOM_FAKEPVE_PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["url"])')
pin=$(printf '%s' "$ready" | "$FELHOM_FAKEPVE_PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["sha256"])')
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
# Exit 0 is also a skipped run (band full): the demo's restore test must have ended `ok`.
grep -qx 'felhom_restore_test_outcome{outcome="ok"} 1' "$work/metrics/felhom_restore_test.prom" ||
  failed+=("the restore test did not end ok (felhom_restore_test.prom)")
run 0 journal

if [ ${#failed[@]} -gt 0 ]; then
  printf '\ndemo FAILED: %d step(s) did not end as they should:\n' "${#failed[@]}" >&2
  printf '  %s\n' "${failed[@]}" >&2
  printf '\n== the exec helper log (last 20 lines)\n' >&2
  tail -n 20 "$work/exec-helper.log" >&2 || true
  exit 1
fi
printf '\ndemo ok: the provision and the restore test ended ok, every refusal was refused\n' >&2
