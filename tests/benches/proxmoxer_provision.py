#!/usr/bin/env python3
"""The provision of `felhom-agent --selftest=provision`, written as a short proxmoxer script: the
yardstick of the provision benchmark (tests/benches/provision.rs), which runs it against the
same fake PVE and guest bed as the agent and prints the agent's wall time over this script's.

It does what the agent's throwaway self-test does, the way a script does it with proxmoxer's own
tools: the vmid looked up in the cluster's guest list, the restore (no NIC at the start), the
description written, the start, the default bootstrap profile run in the container with
`pct exec`, the default osquery checks, the stop and the destroy, each task followed with
`proxmoxer.tools.Tasks.blocking_status` (its default 1 s between polls). It proves nothing the
agent proves (no full guest list, no proof-of-launch, no journal): a yardstick for time only.

Usage: proxmoxer_provision.py PLAN.json
PLAN: {"host", "port", "cafile", "token_id", "token_secret_file", "node", "vmid", "archive",
       "storage", "pool", "profile_dir", "checks_file"} (the agent's default profile and check
      pack, packaging/bootstrap.d/default and packaging/checks.d/default.toml)
Needs proxmoxer (tests/setup-bench.sh installs it into the fakepve venv). Prints one JSON line:
{"wall": seconds}.
"""

import json
import subprocess
import sys
import time
import tomllib

from proxmoxer import ProxmoxAPI
from proxmoxer.tools import Tasks


def main():
    with open(sys.argv[1], encoding='utf-8') as f:
        plan = json.load(f)
    with open(plan['token_secret_file'], encoding='utf-8') as f:
        secret = f.read().strip()
    user, token_name = plan['token_id'].split('!', 1)
    started = time.monotonic()
    px = ProxmoxAPI(plan['host'], port=plan['port'], user=user, token_name=token_name,
                    token_value=secret, verify_ssl=plan['cafile'], service='PVE', timeout=60)
    node, vmid = plan['node'], int(plan['vmid'])
    node_api = px.nodes(node)

    def wait(upid, what):
        status = Tasks.blocking_status(px, upid)
        if not status or status.get('exitstatus') != 'OK':
            sys.exit(f'{what} of {vmid}: {status}')

    if any(g.get('vmid') == vmid for g in px.cluster.resources.get(type='vm')):
        sys.exit(f'vmid {vmid} is taken')
    wait(node_api.lxc.post(vmid=vmid, ostemplate=plan['archive'], restore=1,
                           storage=plan['storage'], pool=plan['pool'], unprivileged=1),
         'restore')
    ct = node_api.lxc(vmid)
    ct.config.put(description=f'provisioned by a script as {vmid}', delete='net0')
    wait(ct.status.start.post(), 'start')

    def pct_exec(args, stdin=None):
        return subprocess.run(['pct', 'exec', str(vmid), '--'] + args, input=stdin,
                              capture_output=True, check=True, timeout=60)

    with open(f"{plan['profile_dir']}/run", 'rb') as f:
        profile = f.read()
    pct_exec(['env', 'FELHOM_TXN=script', f'FELHOM_VMID={vmid}', 'FELHOM_PROFILE=default',
              'sh', '-s'], stdin=profile)
    hostname = ct.config.get().get('hostname', f'CT{vmid}')
    with open(plan['checks_file'], 'rb') as f:
        checks = tomllib.load(f)['check']
    for check in checks:
        rows = json.loads(pct_exec(['osqueryi', '--json', check['sql']]).stdout or b'[]')
        expect = check.get('expect', 'rows >= 1').replace('{hostname}', hostname)
        if expect == 'rows >= 1':
            ok = len(rows) >= 1
        elif expect == 'rows == 0':
            ok = not rows
        else:
            column, value = (p.strip() for p in expect.split('=='))
            ok = bool(rows) and all(str(r.get(column)) == value.strip("'") for r in rows)
        if not ok:
            sys.exit(f"check {check['name']} failed in {vmid}: {rows}")
    wait(ct.status.stop.post(), 'stop')
    wait(ct.delete(purge=0, **{'destroy-unreferenced-disks': 0}), 'destroy')
    print(json.dumps({'wall': time.monotonic() - started}))


if __name__ == '__main__':
    main()
