#!/usr/bin/env bash
# Benchmark (prints figures; not a test): the whole `felhom-agent vmid-check N` process against
# a 100,000-guest /etc/pve/.vmlist, release build, median of many runs. A free, reserved or
# invalid vmid needs no API call (the PVE URL points at a closed loopback port to prove it):
# the time is process start, config, the full list read and parsed, and the verdict.
# An in-use vmid also reads the pool view once (to tell a pool guest from a foreign one): that
# case runs against fakepve (FELHOM_FAKEPVE_PYTHON, as for the tests) answering every API call
# 10 ms late, a round trip to a real pveproxy.
#   tests/bench-vmid-check.sh [RUNS]   (default 100)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
runs=${1:-100}
cd "$root"
cargo build --release --quiet -p felhom-agent
# Not under /tmp: the agent refuses a state_dir that does not survive a reboot.
# The agent refuses a state_dir under /tmp, /run or /dev/shm (or on tmpfs): a checkout there
# keeps its work folder in /var/tmp instead.
base=${FELHOM_TEST_STATE_BASE:-$root/target/tmp}
case "$base/" in /tmp/* | /run/* | /dev/shm/*) base=/var/tmp/felhom-agent-tests ;; esac
mkdir -p "$base"
work=$(mktemp -d "$base/vmid-check-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 - "$work" <<'PY'
import os, random, sys
work = sys.argv[1]
random.seed(7)
ids = list(range(100, 100100))
random.shuffle(ids)  # pmxcfs writes hash order
with open(os.path.join(work, "vmlist"), "w") as f:
    f.write('{\n"version": 100004,\n"ids": {\n')
    f.write(",\n".join('"%d": { "node": "pve%d", "type": "%s", "version": %d }'
                       % (v, v % 16 + 1, "lxc" if v % 3 else "qemu", v % 97 + 1) for v in ids))
    f.write("}\n\n}\n")
fd = os.open(os.path.join(work, "token"), os.O_WRONLY | os.O_CREAT, 0o600)
os.write(fd, b"00000000-0000-4000-8000-000000000000\n")
os.close(fd)
with open(os.path.join(work, "agent.toml"), "w") as f:
    f.write('node = "pve1"\npool = "felhom"\nstate_dir = "%s/state"\nvmlist_path = "%s/vmlist"\n'
            '[pve]\nurl = "https://127.0.0.1:9"\ntoken_id = "felhom@pve!agent"\n'
            'token_secret_file = "%s/token"\ntls_fingerprint = "%s"\n' % (work, work, work, "ab" * 32))
PY
if [ -n "${FELHOM_FAKEPVE_PYTHON:-}" ]; then
  "$FELHOM_FAKEPVE_PYTHON" - "$root/tests/fakepve/scenarios/demo.json" "$work" <<'PY'
import json, os, sys
scenario, work = json.load(open(sys.argv[1])), sys.argv[2]
scenario.update(host="127.0.0.78", port=0, certdir=work + "/certs")
scenario["attrs"] = {"api_latency_ms": 10}
os.makedirs(work + "/certs", mode=0o700, exist_ok=True)
# The scenario holds the token secrets: only root reads it, from its creation on.
with os.fdopen(os.open(work + "/scenario.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
    json.dump(scenario, f)
token_id, secret = next(iter(scenario["tokens"].items()))
fd = os.open(work + "/pve-token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.write(fd, (secret + "\n").encode())
os.close(fd)
open(work + "/token-id", "w").write(token_id)
PY
  mkfifo -m 600 "$work/ready"
  "$FELHOM_FAKEPVE_PYTHON" tests/fakepve/scenario.py "$work/scenario.json" >"$work/ready" 2>"$work/fakepve.log" &
  fake_pid=$!
  trap 'kill "$fake_pid" 2>/dev/null; rm -rf "$work"' EXIT
  read -r ready <"$work/ready"
  url=$(printf '%s' "$ready" | python3 -c 'import json,sys; print(json.load(sys.stdin)["url"])')
  pin=$(printf '%s' "$ready" | python3 -c 'import json,sys; print(json.load(sys.stdin)["sha256"])')
  sed -e "s|^url = .*|url = \"$url\"|" -e "s|^tls_fingerprint = .*|tls_fingerprint = \"$pin\"|" \
      -e "s|^token_id = .*|token_id = \"$(cat "$work/token-id")\"|" \
      -e "s|^token_secret_file = .*|token_secret_file = \"$work/pve-token\"|" \
      "$work/agent.toml" >"$work/agent-fake.toml"
fi
python3 - "$root/target/release/felhom-agent" "$work/agent.toml" "$runs" "$work/agent-fake.toml" <<'PY'
import os, statistics, subprocess, sys, time
agent, config, runs, fake_config = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def bench(vmid, want, config=config):
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        rc = subprocess.run([agent, "--config", config, "vmid-check", str(vmid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        times.append((time.perf_counter() - t) * 1000)
        assert rc == want, (vmid, rc)
    return statistics.median(times), min(times), max(times)
print("vmid-check against a 100,000-guest .vmlist (release build, %d runs each)" % runs)
for label, vmid, want in (("free vmid 100200 (no API call)", 100200, 0),
                          ("reserved vmid 990005", 990005, 3),
                          ("invalid vmid 0120", "0120", 3)):
    med, lo, hi = bench(vmid, want)
    print("  %-38s median %6.2f ms (min %.2f, max %.2f)" % (label, med, lo, hi))
if os.path.exists(fake_config):
    # 200 is a pool guest of the demo scenario and is in the list: the pool view names it ours.
    med, lo, hi = bench(200, 3, fake_config)
    print("  %-38s median %6.2f ms (min %.2f, max %.2f)" % ("in-use vmid 200 (1 API read, +10 ms)", med, lo, hi))
else:
    print("  in-use vmid: not measured; set FELHOM_FAKEPVE_PYTHON to run it against fakepve")
PY
