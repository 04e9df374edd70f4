#!/usr/bin/env bash
# Benchmark (prints figures; not a test): the whole `felhom-agent vmid-check N` process against
# a 100,000-guest /etc/pve/.vmlist, release build, median of many runs. A free, reserved or
# invalid vmid needs no API call (the PVE URL points at a closed loopback port to prove it):
# the time is process start, config, the full list read and parsed, and the verdict.
#   tests/bench-vmid-check.sh [RUNS]   (default 100)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
runs=${1:-100}
cd "$root"
cargo build --release --quiet -p felhom-agent
# Not under /tmp: the agent refuses a state_dir that does not survive a reboot.
mkdir -p "$root/target/tmp"
work=$(mktemp -d "$root/target/tmp/vmid-check-bench.XXXXXX")
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
python3 - "$root/target/release/felhom-agent" "$work/agent.toml" "$runs" <<'PY'
import statistics, subprocess, sys, time
agent, config, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
def bench(vmid, want):
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
    print("  %-34s median %6.2f ms (min %.2f, max %.2f)" % (label, med, lo, hi))
PY
