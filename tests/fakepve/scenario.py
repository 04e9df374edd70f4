#!/usr/bin/env python3
"""Serve fakepve from a scenario file, with a plain-HTTP control endpoint beside it.

    <venv>/bin/python tests/fakepve/scenario.py scenario.json

The scenario (JSON) sets up pools, guests, backup volumes, tokens, ACLs, extra catalogue
errors and initial faults, then the fake is served over HTTPS on the scenario's loopback
host with a certificate made for that host. Exactly one line goes to stdout, once both
servers listen:

    {"url": "https://H:P", "cafile": "...", "sha256": "<hex of the DER certificate>",
     "control": "http://H:Q", "control_secret_file": "...", "pid": N}

Everything else (logging, warnings, errors) goes to stderr. The control endpoint (plain
HTTP, same host, its own free port) drives the running fake. It answers only requests that
carry `Authorization: Bearer <secret>`, the secret this fake made at its start and wrote to
`control_secret_file` (mode 0600, in the certdir, which must be the fake's user's and writable
by no one else): the fake runs as root, and any local user can reach a loopback port. Every
other request is answered 401. What it may change is listed (CALLABLE, SETTABLE,
GUEST_SETTABLE): never a path or a program the fake runs or writes, which come from the
scenario file only.

    POST /call     {"method": "fail", "args": [...], "kwargs": {...}}   a FakePve method of CALLABLE
    POST /set      {"time_scale": 0.01, "ct_secs": {"create": 120}}    attributes of SETTABLE, dicts merged
    POST /guest    {"vmid": 200, "set": {"status": "running"}}         guest attributes of GUEST_SETTABLE
    GET  /requests every request the fake received: method, path, query, body (redacted)
    GET  /timings  when each API answer began and ended: method, path, start, end (seconds,
                   one monotonic clock), in the order the answers ended
    GET  /tasks    every task, with its log
    POST /shutdown stop both servers and exit

SIGTERM and SIGINT stop it cleanly (exit status 0).

Beyond fakepve 0.5.0 the wrapper models, each with the PVE behaviour and its source in a
comment beside the code: QEMU restores (locked `create` outside the pool during the task, PVE's
checks of bridges and host devices, the backup's stored config at the end) and LXC restores
(PVE's checks in the task, the backup's config merged as PVE merges it); bridge (SDN.Use) and
tag (datacenter.cfg) permissions; extractconfig; vmid collisions
only as PVE's synchronous refusal; privilege-separated tokens (the intersection of token and
user ACLs); a live user.cfg; a create POST answered with a 5xx while its restore task runs on,
an LXC restore failing in its pool join with the container left behind, answers held back (a
client killed mid-request); and the guest bed, where restored guests have real root filesystems
and a VM's guest agent runs commands inside its own namespaces (tests/fakepve/README.md).
"""

import asyncio
import base64
import glob
import hashlib
import hmac
import inspect
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
import traceback
import urllib.parse
import uuid

REQUIRED_VERSION = '0.5.0'

# aiohttp makes its TLS client contexts when it is imported, loading the system's CA store into
# the verifying one (aiohttp 3.14.5 aiohttp/connector.py: `_SSL_CONTEXT_VERIFIED =
# _make_ssl_context(True)`, ssl.create_default_context): about a tenth of a second of processor
# time in every fake's start, and this fake is a server only (it never opens an HTTPS
# connection). It is imported with no CA file to load (OpenSSL reads SSL_CERT_FILE when the
# context loads its default paths); the environment is put back right after, for the processes
# the fake starts.
_ca_env = dict((k, os.environ.get(k)) for k in ('SSL_CERT_FILE',))
os.environ['SSL_CERT_FILE'] = os.devnull
try:
    import fakepve
    from aiohttp import web
    from fakepve import agent as fake_agent
    from fakepve import errors as fake_errors
    from fakepve import lxc as fake_lxc
    from fakepve import model as fake_model
    from fakepve import qemu as fake_qemu
    from fakepve import schema as fake_schema
    from fakepve import server as fake_server
    from fakepve import shapes
    from fakepve.certs import make_cert
except ImportError as exc:  # pragma: no cover - environment problem
    sys.stderr.write('scenario.py: cannot import fakepve ({0}); run tests/run.sh to install it\n'.format(exc))
    sys.exit(2)
finally:
    for _k, _v in _ca_env.items():
        if _v is None:
            os.environ.pop(_k, None)
        else:
            os.environ[_k] = _v

log = logging.getLogger('fakepve-scenario')

# Built-in PVE roles, expanded to privileges. Only privileges this fake knows are kept, so a
# grant never silently carries a name the fake would not check.
_VM_PRIVS = tuple(p for p in shapes.PRIVILEGES if p.startswith('VM.'))
ROLES = {
    'Administrator': tuple(shapes.PRIVILEGES),
    'NoAccess': (),
    'PVEAuditor': ('Datastore.Audit', 'Mapping.Audit', 'Pool.Audit', 'SDN.Audit', 'Sys.Audit', 'VM.Audit',
                   'VM.GuestAgent.Audit'),
    'PVEVMAdmin': _VM_PRIVS,
    'PVEVMUser': ('VM.Audit', 'VM.Backup', 'VM.Config.CDROM', 'VM.Config.Cloudinit', 'VM.Console',
                  'VM.PowerMgmt', 'VM.GuestAgent.Audit'),
    'PVETemplateUser': ('VM.Audit', 'VM.Clone'),
    'PVEDatastoreAdmin': ('Datastore.Allocate', 'Datastore.AllocateSpace', 'Datastore.AllocateTemplate',
                          'Datastore.Audit'),
    'PVEDatastoreUser': ('Datastore.AllocateSpace', 'Datastore.Audit'),
    'PVEPoolAdmin': ('Pool.Allocate', 'Pool.Audit'),
    'PVEPoolUser': ('Pool.Audit',),
    'PVESDNUser': ('SDN.Audit', 'SDN.Use'),
    'PVEMappingUser': ('Mapping.Audit', 'Mapping.Use'),
}

# pve-container src/PVE/LXC/Config.pm, `ostype`'s enum (94f5585, 2026-06-16).
LXC_OSTYPES = ('debian', 'devuan', 'ubuntu', 'centos', 'fedora', 'opensuse', 'archlinux', 'alpine', 'gentoo',
               'nixos', 'unmanaged')

BACKUP_FORMATS = ('tar.zst', 'tar.gz', 'tar.lzo', 'tar', 'vma.zst', 'vma.gz', 'vma.lzo', 'vma')
# 2026-01-01T00:00:00Z, the date in the demo backup's name.
DEFAULT_CTIME = 1767225600
# qemu-ga's environment for guest-exec: no `env` is passed by PVE, so the child has the agent
# service's PATH (systemd's default) and PATH search applies (guest-exec-facts.md §3.3).
QGA_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
# QEMU qga/commands.c GUEST_EXEC_MAX_OUTPUT: 16 MiB kept per stream (guest-exec-facts.md §3.4).
QGA_MAX_OUTPUT = 16 * 1024 * 1024


def _die_with_parent():
    """In a child before exec: SIGKILL it when the fake ends, however it ends (prctl
    PR_SET_PDEATHSIG), so no QEMU outlives the fake that started it."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


SIZE_UNITS = {'K': 1024, 'M': 1024 ** 2, 'G': 1024 ** 3, 'T': 1024 ** 4}


def parse_size(text):
    """Bytes of a PVE disk size ("8G", "512M", "4096"); 0 when absent."""
    found = re.fullmatch(r'(\d+(?:\.\d+)?)([KMGT]?)', str(text or '').strip())
    if not found:
        return 0
    return int(float(found.group(1)) * SIZE_UNITS.get(found.group(2), 1))


def agent_configured(config):
    """True when a VM config enables the guest agent (`agent: 1` or `agent: enabled=1,…`)."""
    # qemu-server src/PVE/QemuServer/Agent.pm parse_guest_agent: `enabled` is the default key.
    first, props = fake_lxc.split_props(str(config.get('agent', '0')))
    return truthy(props.get('enabled', first))


def os_error_text(stderr):
    """The errno text of a busybox shell's redirection error ("…: No such file or directory")."""
    text = stderr.decode('utf-8', 'replace').strip().splitlines()
    word = text[-1].rsplit(': ', 1)[-1].lower() if text else ''
    # busybox spells errno texts its own way; qemu-ga reports strerror's.
    for short, errno_text in (('no such file', 'No such file or directory'), ('permission denied', 'Permission denied'),
                              ('is a directory', 'Is a directory'), ('not a directory', 'Not a directory'),
                              ('read-only file system', 'Read-only file system')):
        if word.startswith(short):
            return errno_text
    return 'Input/output error'


# A guest's own path (not its tasks, config or status): what a destroy DELETEs.
GUEST_PATH = re.compile(r'^/api2/json/nodes/[^/]+/(lxc|qemu)/\d+$')


# pve-storage src/PVE/Storage.pm archive_info: a `.tar` backup (plain or compressed, or `.tgz`).
TAR_ARCHIVE = re.compile(r'\.(tgz|tar(\.(gz|lzo|zst|bz2))?)$')


class TaskNotes(object):
    """Lines a task's worker prints while it runs, and its warnings. rpcenv->warn prints
    `WARN: <message>` and counts it; a task that ends well after warnings ends `TASK WARNINGS:
    <n>` (exit status `WARNINGS: <n>`, a success) instead of `TASK OK` (pve-common
    src/PVE/RESTEnvironment.pm warn, fork_worker). Perl's plain `warn` is just a line."""

    def __init__(self):
        self.record = None
        self.pending = []
        self.warnings = 0
        self.done = False

    def say(self, text, warn=False):
        if warn:
            self.warnings += 1
            text = 'WARN: ' + text
        lines = str(text).split('\n')
        if self.record is not None:
            self.record['log'].extend(lines)
        else:
            self.pending.extend(lines)

    def attach(self, record, base):
        """The task's record, once fakepve made it: lines said before (a task that ran to its end
        inside the request, time_scale 0) go after its first `base` lines."""
        self.record = record
        record['log'][base:base] = self.pending
        self.pending = []
        self.finish()

    def finish(self):
        rec = self.record
        if rec is None or self.done or rec.get('status') != 'stopped':
            return
        self.done = True
        if self.warnings and rec.get('exitstatus') == 'OK':
            rec['exitstatus'] = 'WARNINGS: {0}'.format(self.warnings)
            if rec['log'] and rec['log'][-1] == 'TASK OK':
                rec['log'][-1] = 'TASK WARNINGS: {0}'.format(self.warnings)


class ScenarioError(Exception):
    """The scenario file cannot be served as written."""


class ScenarioPve(fake_server.FakePve):
    """FakePve that also records each request's query string (secrets redacted as in bodies) and
    keeps a live `/etc/pve/.vmlist` file, as pmxcfs does on a real node."""

    # Where the live .vmlist is written (None: nowhere), extra entries only the local list
    # knows (guests on other cluster nodes), and whether the file is frozen (a guest created
    # after the list was read).
    vmlist_path = None
    vmlist_extra = ()
    vmlist_frozen = False
    # Milliseconds added before every API answer: the round trip to a real pveproxy (TLS,
    # proxying to pvedaemon, pmxcfs reads) is milliseconds, not the fake's microseconds.
    api_latency_ms = 0
    # (method, path, start, end) of every answer, bounded as the request log is.
    timings = ()
    _vmlist_text = None
    _vmlist_version = 0

    def write_vmlist(self):
        """Rewrite the .vmlist file (atomically) when the guests changed."""
        self.write_user_cfg()
        self.write_datacenter_cfg()
        self.write_ct_confs()
        if not self.vmlist_path or self.vmlist_frozen:
            return
        ids = {}
        for vm in list(self.vms) + list(getattr(self, 'cts', [])):
            ids[int(vm.vmid)] = (vm.node, vm.guest.split('/')[0])
        for extra in self.vmlist_extra:
            ids[int(extra['vmid'])] = (extra.get('node', 'pve1'), extra.get('type', 'lxc'))
        body = ',\n'.join('"{0}": {{ "node": "{1}", "type": "{2}", "version": 1 }}'.format(v, n, t)
                          for v, (n, t) in sorted(ids.items()))
        if body == self._vmlist_text:
            return
        self._vmlist_text = body
        self._vmlist_version += 1
        if ids:
            text = '{{\n"version": {0},\n"ids": {{\n{1}}}\n\n}}\n'.format(self._vmlist_version, body)
        else:
            text = '{{\n"version": {0}\n\n}}\n'.format(self._vmlist_version)
        tmp = self.vmlist_path + '.tmp'
        with open(tmp, 'w', encoding='utf-8') as fh:
            fh.write(text)
        os.replace(tmp, self.vmlist_path)

    # ------------------------------------------------------------- nodes/<node>/lxc/<vmid>.conf

    # Where the containers' configs are written as pmxcfs holds them (`/etc/pve/nodes`; None:
    # nowhere), and what was written last (path -> text).
    ct_conf_dir = None
    _ct_conf_texts = None

    def write_ct_confs(self):
        """Keep `<ct_conf_dir>/<node>/lxc/<vmid>.conf` for every container, in PVE's format
        (pve-container src/PVE/LXC/Config.pm write_pct_config: the description as leading `#`
        lines, then `key: value` lines), and remove the file of a container that is gone."""
        if not self.ct_conf_dir:
            return
        if self._ct_conf_texts is None:
            self._ct_conf_texts = {}
        wanted = {}
        for ct in list(getattr(self, 'cts', [])):
            config = dict(ct.config or {})
            lines = ['#' + line for line in str(config.pop('description', '') or '').splitlines()]
            for key in sorted(config):
                value = config[key]
                if value is None:
                    continue
                lines.append('{0}: {1}'.format(key, ' '.join(str(value).splitlines())))
            path = os.path.join(self.ct_conf_dir, str(ct.node), 'lxc', '{0}.conf'.format(int(ct.vmid)))
            wanted[path] = '\n'.join(lines) + '\n'
        for path in list(self._ct_conf_texts):
            if path not in wanted:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                del self._ct_conf_texts[path]
        for path, text in wanted.items():
            if self._ct_conf_texts.get(path) == text:
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + '.tmp'
            with open(tmp, 'w', encoding='utf-8') as fh:
                fh.write(text)
            os.replace(tmp, path)
            self._ct_conf_texts[path] = text

    # ------------------------------------------------------------- user.cfg

    # Where a `/etc/pve/user.cfg` is written (None: nowhere), and the scenario's grants as given
    # (role or privilege names), for its acl lines.
    user_cfg_path = None
    user_cfg_grants = ()
    _user_cfg_text = None

    def write_user_cfg(self):
        """Write user.cfg as pmxcfs holds it (pve-api-facts.md §3.4, acl src/PVE/AccessControl.pm
        write_user_config): users, each followed by its tokens (`token:<id>:<expire>:<privsep>:
        <comment>:`), pools (members and storages sorted as strings), roles, ACLs
        (`acl:<propagate>:<path>:<ugid>:<roles>:`). A grant of bare privileges gets a role of its
        own (`felhom-scenario-<n>`), as an ACL only ever names roles."""
        if not self.user_cfg_path:
            return
        users = {}
        for who in list(self.apitokens) + [g[0] for g in self.user_cfg_grants] + list(self.users):
            users.setdefault(who.split('!')[0], set())
            if '!' in who:
                users[who.split('!')[0]].add(who)
        lines = []
        for user in sorted(users):
            if user == 'root@pam':
                continue
            lines.append('user:{0}:1:0::::::'.format(user))
            for token in sorted(users[user]):
                lines.append('token:{0}:0:{1}::'.format(token, int((self.token_privsep or {}).get(token, 1))))
        lines.append('')
        for name in sorted(self.pools):
            meta = self.pool_info.get(name, {})
            storages = sorted(meta.get('storage', ()))
            lines.append('pool:{0}:{1}:{2}:{3}:'.format(name, encode_cfg_text(meta.get('comment') or ''),
                                                         ','.join(sorted(str(v) for v in self.pools[name])),
                                                         ','.join(storages)))
        lines.append('')
        roles, acls = [], []
        for n, (who, path, names) in enumerate(self.user_cfg_grants):
            named = [x for x in names if x in ROLES]
            privs = [x for x in names if x not in ROLES]
            if privs:
                role = 'felhom-scenario-{0}'.format(n)
                roles.append('role:{0}:{1}:'.format(role, ','.join(privs)))
                named.append(role)
            acls.append('acl:1:{0}:{1}:{2}:'.format(path, who, ','.join(named)))
        text = '\n'.join(lines + roles + ([''] if roles else []) + acls) + '\n'
        if text == self._user_cfg_text:
            return
        self._user_cfg_text = text
        tmp = self.user_cfg_path + '.tmp'
        with open(tmp, 'w', encoding='utf-8') as fh:
            fh.write(text)
        os.replace(tmp, self.user_cfg_path)

    def _sync_pools(self):
        # pmxcfs has the new user.cfg as soon as PVE wrote it (the pool join of a restore, a pool
        # member removed, a destroyed guest leaving its pool): the live file follows at once,
        # not at the next tick of the .vmlist keeper.
        super()._sync_pools()
        if self.user_cfg_path:
            self.write_user_cfg()

    # ------------------------------------------------------------- permissions

    # token id -> privsep (0 or 1); PVE creates tokens with privsep 1 unless told otherwise.
    token_privsep = None

    def _held_by(self, who, path, priv):
        """True if exactly `who` (no owner fallback) holds priv on path, pools included (fakepve's
        own rule, per principal)."""
        paths = [path]
        if path.startswith('/vms/'):
            vmid = int(path.split('/')[2])
            paths += ['/vms'] + ['/pool/' + name for name, ids in self.pools.items() if vmid in ids]
        elif path.startswith('/storage/'):
            sid = path.split('/')[2]
            paths += ['/pool/' + name for name, meta in self.pool_info.items() if sid in meta['storage']]
        for granted, privs in self.acl.get(who, []):
            if priv in privs and (granted == '/' or any(p == granted or p.startswith(granted + '/') for p in paths)):
                return True
        return False

    def allowed(self, user, path, priv):
        # PVE (pve-api-facts.md §2.2; acl src/PVE/RPCEnvironment.pm `permissions`): a token with
        # privsep=1 (the default) holds on every path the intersection of its own privileges and
        # its user's; privsep=0 exactly its user's. fakepve 0.5.0 gives the union.
        if self.acl is None or '!' not in user or user.split('!')[0] == 'root@pam':
            return super().allowed(user, path, priv)
        owner = user.split('!')[0]
        if not int((self.token_privsep or {}).get(user, 1)):
            return self._held_by(owner, path, priv)
        return self._held_by(owner, path, priv) and self._held_by(user, path, priv)

    async def _permissions(self, v, user):
        # GET /access/permissions for a privilege-separated token: per path, what the token holds
        # there that its user holds too (same rule as allowed() above).
        who = v.get('userid') or user
        if self.acl is None or '!' not in who or who.split('!')[0] == 'root@pam':
            return await super()._permissions(v, user)
        if v.get('path') is not None:
            # pve-access-control src/PVE/API2/AccessControl.pm `permissions`: with a path, only
            # that path, with what RPCEnvironment `permissions` computes there (inherited
            # grants and the pools the guest or storage is in included).
            path = v['path']
            privs = sorted(p for p in shapes.PRIVILEGES if self.allowed(who, path, p))
            return {path: dict.fromkeys(privs, 1)} if privs else {}
        owner = who.split('!')[0]
        privsep = int((self.token_privsep or {}).get(who, 1))
        held = {}
        for path, privs in self.acl.get(owner if not privsep else who, []):
            keep = set(p for p in privs if self._held_by(owner, path, p))
            if keep:
                held.setdefault(path, set()).update(keep)
        return dict((path, dict.fromkeys(sorted(privs), 1)) for path, privs in sorted(held.items()))

    # ------------------------------------------------------- backups, restores

    # volid -> the guest config stored with that backup (scenario `volumes[].config`), and
    # volid -> what the guest bed makes of a guest restored from it (`volumes[].guest`).
    backup_configs = None
    backup_guests = None
    # How a QEMU restore (`archive=`) behaves: None, it succeeds; "leftover", PVE's failure mode:
    # the task fails and the VM's config stays behind, outside the pool.
    qemu_restore = None
    # PVE seconds a QEMU restore task takes (scaled by time_scale).
    qemu_restore_secs = 30
    # vmid -> a coroutine function run at the end of a successful vzrestore task (the backup's
    # config merged in, the guest bed's root filesystem made).
    _restore_hooks = None
    # "5xx but created" (`/set {"create_answer": {"140": 596}}`, or `{"140": {"status": 500,
    # "message": "..."}}`): the next create POST for that vmid answers with that error while its
    # restore task starts and runs to its end (the guest created, in the pool). pveproxy proxies
    # the create to pvedaemon and answers a 59x of AnyEvent::HTTP (pve-api-facts.md §1.4) or a
    # 500 when that leg breaks, while pvedaemon's worker goes on: the create is reserved and the
    # task forked before any answer (§4.2 step 8, §5.2 step 7). One-shot per vmid.
    create_answer = None
    # "LXC restore fails after create" (`/set {"lxc_restore_fail": {"140": true}}`, or a
    # message instead of true): the vzrestore task of that vmid restores the container, then
    # fails in the pool join, which pve-container runs after the restore and outside its cleanup
    # (pve-api-facts.md §4.3: `add_vm_to_pool` only then), so the task ends `TASK ERROR: ...`
    # with the container present, unlocked and NOT in the pool. The default message is
    # add_vm_to_pool's when user.cfg's cluster lock times out (pve-access-control
    # AccessControl.pm add_vm_to_pool → lock_user_config: "can't add VM N to pool 'P': <cfs lock
    # error>"). One-shot.
    lxc_restore_fail = None
    # `/set {"restore_outside_pool": {"140": true}}`: that vmid's `vzrestore` ends OK with the
    # container outside the pool (taken out of it the moment the task ends, as a person or
    # another tool could). One-shot per vmid.
    restore_outside_pool = None
    # `/set {"backup_lock_after_start": {"990000": 4}}`: once that vmid's start task has ended
    # OK, the guest is locked `backup` for that many real seconds, as while a backup job of the
    # node backs it up (pve-manager PVE/VZDump.pm: vzdump locks each guest's config `backup`
    # for its backup, pve-container/qemu-server `lock_config`, and unlocks it after), then the
    # lock goes. One-shot per vmid.
    backup_lock_after_start = None
    # `/set {"answer_delay": {"POST /nodes/pve1/lxc": 1.5}}`: hold the answer to requests with
    # exactly this method and path for that many real seconds after the handler ran (the task
    # started), so a test can kill the client in the middle of a request.
    answer_delay = None

    def _lost_create_answer(self, vmid):
        """Raise the error the create POST of vmid is set to answer with (see create_answer)."""
        rule = (self.create_answer or {}).pop(str(vmid), None)
        if rule is None:
            return
        if isinstance(rule, dict):
            status, message = int(rule.get('status', 500)), rule.get('message')
        else:
            status, message = int(rule), None
        if message is None:
            message = 'Connection timed out' if status >= 590 else 'Internal Server Error'
        raise fake_model.PveError(status, message)

    @staticmethod
    def _check_protection(ct, message):
        # pve-guest-common src/PVE/AbstractConfig.pm check_protection: the config value's Perl
        # truth ("0" is false), "<message> - protection mode enabled" (500). fakepve 0.5.0 takes
        # a stored "0" for true.
        if truthy(ct.config.get('protection')):
            raise fake_model.PveError(500, '{0} - protection mode enabled'.format(message))

    def _vnet_access(self, user, value):
        # pve-guest-common src/PVE/GuestHelpers.pm check_vnet_access, reached from pve-container
        # src/PVE/LXC.pm check_bridge_access and qemu-server src/PVE/QemuServer.pm
        # check_bridge_access (both skip root@pam and a NIC without a bridge): SDN.Use on
        # /sdn/zones/<zone>/<bridge>/<tag> for a `tag`, on the same path for each VLAN of
        # `trunks`, and on /sdn/zones/<zone>/<bridge> only when there is neither; the zone of a
        # plain Linux bridge (no SDN vnet of that name) is `localnetwork`. A refusal is rpcenv's
        # check: 403 "Permission check failed (<path>, SDN.Use)".
        if user == 'root@pam':
            return
        for path in vnet_paths(value):
            self.require(user, path, 'SDN.Use')

    def _check_bridge(self, user, net):
        # fakepve 0.5.0 checks only /sdn/zones/localnetwork/<bridge>; PVE's rule has the VLANs.
        self._vnet_access(user, net)

    # The live /etc/pve/datacenter.cfg: its keys (scenario `datacenter_cfg`, `/set` merges) and
    # where it is written (None: nowhere, the policy still applies).
    datacenter_cfg = None
    datacenter_cfg_path = None
    _datacenter_cfg_text = None

    def write_datacenter_cfg(self):
        """Write datacenter.cfg as pmxcfs holds it: `key: value` lines (pve-cluster
        src/PVE/DataCenterConfig.pm write_datacenter_config, through JSONSchema dump_config)."""
        if not self.datacenter_cfg_path:
            return
        text = ''.join('{0}: {1}\n'.format(k, v) for k, v in sorted((self.datacenter_cfg or {}).items())
                       if k != 'path' and v is not None)
        if text == self._datacenter_cfg_text:
            return
        self._datacenter_cfg_text = text
        tmp = self.datacenter_cfg_path + '.tmp'
        with open(tmp, 'w', encoding='utf-8') as fh:
            fh.write(text)
        os.replace(tmp, self.datacenter_cfg_path)

    def _assert_tag_permissions(self, user, vmid, old, new):
        # pve-guest-common src/PVE/GuestHelpers.pm assert_tag_permissions: VM.Config.Options on
        # /vms/<vmid> (check_vm_perm with the pool undef: a pool's roles reach /vms/<vmid> only
        # once the guest is a member, so never at create or restore); then every tag whose count
        # differs between old and new is checked, unless the user holds Sys.Modify on `/`:
        # get_allowed_tags reads datacenter.cfg `user-tag-access` (`user-allow`: free (default),
        # existing, list, none; `user-allow-list`) and `registered-tags`: with `free` any tag
        # but a registered one; `existing` the list plus the tags of every guest the user may
        # VM.Audit; `list` the list; `none` nothing. A registered tag always needs Sys.Modify.
        # Refusal: raise_perm_exc, 403 "Permission check failed (/, Sys.Modify for modifying
        # tag '<tag>')".
        if self.acl is None or user == 'root@pam':
            return
        self.require(user, '/vms/{0}'.format(vmid), 'VM.Config.Options')
        if self.allowed(user, '/', 'Sys.Modify'):
            return
        before, after = tag_counts(old), tag_counts(new)
        changed = [t for t in sorted(set(before) | set(after)) if before.get(t, 0) != after.get(t, 0)]
        if not changed:
            return
        dc = self.datacenter_cfg or {}
        access = dict(p.split('=', 1) for p in str(dc.get('user-tag-access') or '').split(',') if '=' in p)
        user_allow = access.get('user-allow', 'free')
        registered = set(t for t in str(dc.get('registered-tags') or '').split(';') if t)
        allowed = set()
        if user_allow != 'none':
            allowed.update(t for t in str(access.get('user-allow-list') or '').split(';') if t)
        if user_allow in ('free', 'existing'):
            for guest in list(self.vms) + list(getattr(self, 'cts', [])):
                if self.allowed(user, '/vms/{0}'.format(guest.vmid), 'VM.Audit'):
                    allowed.update(tag_counts(guest.config.get('tags')))
        allowed -= registered
        for tag in changed:
            if (tag not in allowed and user_allow != 'free') or tag in registered:
                raise fake_model.PveError(403, "Permission check failed (/, Sys.Modify for modifying tag '{0}')"
                                          .format(tag))

    def _check_modify_perm(self, user, vmid, pool, old, new, deletes, unprivileged):
        # pve-container src/PVE/LXC.pm check_ct_modify_config_perm: `tags` (set or deleted, at
        # create, restore and config PUT) go to assert_tag_permissions (above) instead of the
        # VM.Config.Options-through-the-pool fakepve 0.5.0 checks.
        if 'tags' in new or 'tags' in deletes:
            if self.acl is not None and user != 'root@pam':
                self._assert_tag_permissions(user, vmid, (old or {}).get('tags'),
                                             new.get('tags') if 'tags' in new else '')
            new = dict((k, x) for k, x in new.items() if k != 'tags')
            deletes = [k for k in deletes if k != 'tags']
        return super()._check_modify_perm(user, vmid, pool, old, new, deletes, unprivileged)

    async def _apply_config(self, vm, user, p):
        # qemu-server src/PVE/API2/Qemu.pm update_vm_api: a deleted or set `tags` goes through
        # assert_tag_permissions (old: the config's tags) before the change is written.
        deletes = [k for k in re.split(r'[,;\s]+', str(p.get('delete') or '')) if k]
        if 'tags' in deletes:
            self._assert_tag_permissions(user, vm.vmid, vm.config.get('tags'), '')
        if 'tags' in p:
            self._assert_tag_permissions(user, vm.vmid, vm.config.get('tags'), p['tags'])
        return await super()._apply_config(vm, user, p)

    # ------------------------------------------------------------ vzdump

    def stored_config(self, volid):
        """The guest config stored in backup `volid`: the scenario's `volumes[].config`; for an LXC
        backup the scenario gives none for, that of an unprivileged container without NICs
        (vzdump always stores the config, and `unprivileged: 1` is what PVE creates by default);
        None for another backup without one."""
        config = (self.backup_configs or {}).get(volid)
        if config is None and re.search(r'vzdump-lxc-\d+-', volid):
            config = {'unprivileged': '1'}
        return config


    def _routes_vzdump(self):
        return [('GET', '/nodes/{node}/vzdump/extractconfig', self._extractconfig)]

    async def _extractconfig(self, v, user):
        # pve-manager PVE/API2/VZDump.pm extractconfig: check_volume_access (pve-storage
        # src/PVE/Storage.pm) with no target vmid, so Datastore.Allocate on the storage, or
        # Datastore.AllocateSpace there plus VM.Backup on the owner vmid of the backup's name (the
        # "same owner" case needs a vmid and never applies); then, for a storage volume,
        # VM.Backup on /vms/<owner> always, Datastore.Allocate or not. The answer is the config
        # text stored in the archive (Storage.pm extract_vzdump_config), see backup_config_text.
        volid = str(v['volume'])
        sid, colon, volname = volid.partition(':')
        if not colon:
            if user != 'root@pam':
                raise fake_model.PveError(500, 'Only root can pass arbitrary filesystem paths.')
            raise fake_model.PveError(500, "unable to parse volume ID '{0}'".format(volid))
        store = self.storages.get(sid)
        if store is None:
            raise fake_model.PveError(500, "storage '{0}' does not exist".format(sid))
        vtype, owner, _ = self._parse_volname(store, volname)
        if vtype != 'backup':
            raise fake_model.PveError(500, "unable to use volume {0} - content type needs to be 'backup'".format(volid))
        self._check_access(user, sid, vtype, owner, volid)
        self.require(user, '/vms/{0}'.format(owner), 'VM.Backup')
        kind = 'lxc' if re.search(r'vzdump-(lxc|openvz)-', volname) else 'qemu'
        if volname not in self._volumes(sid):
            # extract_vzdump_config_tar: the archive file is missing (for a .vma the
            # decompressor's own error; the bed answers the same).
            raise fake_model.PveError(500, "ERROR: file '{0}' does not exist".format(
                self._volume_path(sid, volname, 'backup')))
        config = self.stored_config(volid)
        if config is None:
            raise fake_model.PveError(500, 'ERROR: archive contains no configuration file')
        return backup_config_text(config, kind)

    def _archive_access(self, user, vmid, volid):
        # storage src/PVE/Storage.pm check_volume_access (pve-api-facts.md §2.4): Datastore.Allocate
        # on the backup's storage, or the backup's owner vmid is the target, or
        # Datastore.AllocateSpace there plus VM.Backup on the owner.
        sid = volid.partition(':')[0]
        found = re.search(r'vzdump-(?:openvz|lxc|qemu)-(\d+)-', volid)
        owner = int(found.group(1)) if found else None
        if self.allowed(user, '/storage/' + sid, 'Datastore.Allocate') or owner in (None, vmid):
            return
        if not (self.allowed(user, '/storage/' + sid, 'Datastore.AllocateSpace')
                and self.allowed(user, '/vms/{0}'.format(owner), 'VM.Backup')):
            raise fake_model.PveError(403, 'Permission check failed (/vms/{0}, VM.Backup)'.format(owner))

    async def _qm_create(self, v, user):
        if not v.get('archive'):
            return await super()._qm_create(v, user)
        # qemu-server src/PVE/API2/Qemu.pm create_vm with `archive` (pve-api-facts.md §5.2). Before
        # the task, in this order: quorum, the pool exists, Datastore.AllocateSpace on `storage`,
        # VM.PowerMgmt for start=1, VM.Allocate (bare 403), archive access, then
        # create_and_lock_config, whose refusal is a synchronous 500 "unable to restore VM N - VM N
        # already exists on node 'X'" (never a task). The VM then exists locked `create`, outside
        # the pool, until the task ends; the pool is joined at the end of a successful restore.
        node, vmid, archive = v['node'], int(v['vmid']), v['archive']
        pool, storage = v.get('pool'), v.get('storage')
        self.need_quorum()
        self._qm_check_pool(pool)
        if storage:
            self.require(user, '/storage/' + storage, 'Datastore.AllocateSpace')
        if v.get('start'):
            self._qm_perm(user, vmid, pool, 'VM.PowerMgmt')
        if not (self.allowed(user, '/vms/{0}'.format(vmid), 'VM.Allocate')
                or (pool and self.allowed(user, '/pool/' + pool, 'VM.Allocate'))):
            raise fake_model.PveError(403, 'Permission check failed')
        self._archive_access(user, vmid, archive)
        # The request's own NICs: qemu-server src/PVE/API2/Qemu.pm create_vm calls check_bridge_access
        # on the parameters before the task (403). `tags` in a restore request are not checked at
        # all: check_vm_modify_config_perm skips them and only the create path (no archive)
        # calls assert_tag_permissions.
        for key in sorted(v, key=fake_qemu.natural):
            if NET_KEY.match(key):
                self._vnet_access(user, v[key])
        if self._qm_taken(vmid):
            other = self.guest(vmid)
            kind = 'VM' if self.vm(vmid) else 'CT'
            raise fake_model.PveError(500, "unable to restore VM {0} - {1} {0} already exists on node '{2}'".format(
                vmid, kind, other.node))
        vm = fake_model.FakeVm(vmid, 'VM {0}'.format(vmid), node=node)
        vm.config = {}
        fake_qemu.QemuApi._qm_lock(vm, 'create')
        self.vms.append(vm)
        self.nodes.setdefault(node, {'online': True})
        backup = dict((self.backup_configs or {}).get(archive) or {})
        bed = (self.backup_guests or {}).get(archive)
        given = dict((k, x) for k, x in v.items() if k not in fake_qemu.CREATE_ONLY)
        failed = ('unable to restore VM {0} - error before or during data restore, some or all disks were '
                  'not completely restored. VM {0} state is NOT cleaned up.'.format(vmid))

        notes = TaskNotes()

        async def body():
            # qemu-server src/PVE/API2/Qemu.pm create_vm, the restore worker: before any data is
            # restored, the backup's config (extract_vzdump_config) merged with the request's
            # keys (QemuServer.pm restore_merge_config: the request's win) goes through
            # check_restore_permissions: check_bridge_access for every netN (so the backup's NICs
            # the request does not replace), then check_mapping_access: `usbN` with a host other
            # than `spice` "only root can set 'usbN' config for real devices", `hostpciN` with a
            # host "only root can set 'hostpciN' config for non-mapped devices", a `mapping`
            # needs Mapping.Use on /mapping/usb|pci/<name>. Then restore_file_archive: a `.tar`
            # archive refuses any option (restore_tar_archive: "cannot pass along options (<keys>)
            # when restoring from tar archive", keys in Perl hash order, here sorted). A failure
            # there removes only the create lock, warns that the state is NOT cleaned up and ends
            # the task with the error itself (no "unable to restore" prefix): the config stays,
            # empty, outside the pool.
            try:
                if archive in (self.backup_configs or {}):
                    self._restore_permissions(user, dict(backup, **given))
                if TAR_ARCHIVE.search(archive) and given:
                    raise fake_model.TaskError('cannot pass along options ({0}) when restoring from tar archive'
                                               .format(' '.join(sorted(given))))
            except (fake_model.PveError, fake_model.TaskError) as e:
                fake_qemu.QemuApi._qm_lock(vm, None)
                notes.say('error before or during data restore, some or all disks were not completely restored. '
                          'VM {0} state is NOT cleaned up.'.format(vmid))
                raise fake_model.TaskError(getattr(e, 'message', None) or str(e)) from e
            await self.pause(self.qemu_restore_secs)
            if self.qemu_restore == 'leftover' or self.volume_exists(archive) is False:
                # PVE does not clean up a failed QEMU restore: only the create lock goes.
                fake_qemu.QemuApi._qm_lock(vm, None)
                raise fake_model.TaskError(failed)
            conf, made = {}, []
            try:
                for key in sorted(backup, key=fake_qemu.natural):
                    value = backup[key]
                    # restore_update_config_line drops lock, parent and unusedN lines (digest and
                    # snaptime are no lines of a stored config); everything else, `vmstate`,
                    # `args`, devices and ports included, is restored verbatim.
                    if key in ('lock', 'parent', 'digest', 'snaptime') or re.fullmatch(r'unused\d+', key):
                        continue
                    if fake_qemu.DRIVE_KEY.match(key):
                        volume, props = fake_qemu.split_drive(value)
                        sid = fake_qemu.volume_ref(volume)[0]
                        if fake_qemu.is_cdrom(volume, props) or sid is None:
                            conf[key] = value
                            continue
                        target = storage or sid
                        self._qm_image_store(target, user)
                        volid, _ = self._qm_alloc(target, vmid, None, parse_size(props.get('size')))
                        made.append(volid)
                        conf[key] = fake_qemu.join_drive(volid, props)
                    else:
                        conf[key] = value
                conf.update((k, str(x)) for k, x in given.items())
                for key in list(conf):
                    if re.fullmatch(r'net\d+', key):
                        fresh = bool(v.get('unique')) and key not in given
                        conf[key] = fake_qemu.with_mac(conf[key], fresh=fresh)
                # qemu-server src/PVE/QemuServer.pm restore_update_config_line: every restore
                # writes a new vmgenid (unless the backup's is 0), and with `unique` a new
                # smbios1 uuid (and new MACs, above), so a restored copy never repeats them.
                if 'vmgenid' in conf and str(conf['vmgenid']) != '0' and 'vmgenid' not in given:
                    conf['vmgenid'] = str(uuid.uuid4())
                if v.get('unique') and 'smbios1' in conf and 'smbios1' not in given:
                    props = [p for p in str(conf['smbios1']).split(',') if p and not p.startswith('uuid=')]
                    conf['smbios1'] = ','.join(['uuid=' + str(uuid.uuid4())] + props)
            except (fake_model.PveError, fake_model.TaskError) as e:
                # restore_vma_archive: an allocation that fails frees what was allocated
                # ($restore_destroy_volumes) and dies with the storage's error; create_vm removes
                # the create lock, warns that the state is NOT cleaned up and ends the task with
                # that error: the config stays, empty, outside the pool (the stub).
                for volid in made:
                    self._qm_free(volid)
                fake_qemu.QemuApi._qm_lock(vm, None)
                notes.say('error before or during data restore, some or all disks were not completely restored. '
                          'VM {0} state is NOT cleaned up.'.format(vmid))
                raise fake_model.TaskError(getattr(e, 'message', None) or str(e)) from e
            vm.config = conf
            vm.name = conf.get('name') or 'VM {0}'.format(vmid)
            # qemu-server src/PVE/API2/Qemu.pm create_vm: a restored config that is a template
            # is converted to one again ("Convert to template."): it never starts.
            if truthy(conf.get('template')):
                notes.say('Convert to template.')
                vm.template = True
            if bed is not None:
                await self.bed_create(vm, 'qemu', bed)
                # PVE seconds its start and stop tasks take (the guest's own pace).
                vm.start_secs = float(bed.get('start_secs', 0) or 0)
                vm.stop_secs = float(bed.get('stop_secs', 0) or 0)
            fake_qemu.QemuApi._qm_lock(vm, None)
            if pool:
                self._pool_join(pool, vmid)
            return None
        upid = await self.task(node, 'qmrestore', vmid, user, body, vm=vm, notes=notes)
        self._lost_create_answer(vmid)
        return upid

    def _restore_permissions(self, user, conf):
        """qemu-server src/PVE/QemuServer.pm check_restore_permissions (check_bridge_access, then
        check_mapping_access) of a merged restore config; root@pam passes."""
        if user == 'root@pam':
            return
        for key in sorted(conf, key=fake_qemu.natural):
            if NET_KEY.match(key):
                self._vnet_access(user, conf[key])
        for key in sorted(conf, key=fake_qemu.natural):
            # check_mapping_access, its other arms: an rngN whose source is /dev/hwrng needs
            # Mapping.Use on /mapping/hwrng; a virtiofsN (one digit, as PVE's pattern) on
            # /mapping/dir/<dirid>.
            if re.fullmatch(r'rng\d+', key):
                first, props = fake_lxc.split_props(str(conf[key]))
                if (props.get('source') or first) == '/dev/hwrng':
                    self.require(user, '/mapping/hwrng', 'Mapping.Use')
                continue
            if re.fullmatch(r'virtiofs\d', key):
                first, props = fake_lxc.split_props(str(conf[key]))
                self.require(user, '/mapping/dir/{0}'.format(props.get('dirid') or first), 'Mapping.Use')
                continue
            kind = re.match(r'^(usb|hostpci)\d+$', key)
            if not kind:
                continue
            first, props = fake_lxc.split_props(str(conf[key]))
            host, mapping = props.get('host') or first, props.get('mapping')
            if kind.group(1) == 'usb' and host:
                if host.lower() != 'spice':
                    raise fake_model.TaskError("only root can set '{0}' config for real devices".format(key))
            elif kind.group(1) == 'hostpci' and host:
                raise fake_model.TaskError("only root can set '{0}' config for non-mapped devices".format(key))
            elif mapping:
                self.require(user, '/mapping/{0}/{1}'.format('usb' if kind.group(1) == 'usb' else 'pci', mapping),
                             'Mapping.Use')
            else:
                raise fake_model.TaskError("either 'host' or 'mapping' must be set.")

    async def _lxc_create(self, user, v):
        # PVE's LXC restore (pve-container src/PVE/API2/LXC.pm create_vm, src/PVE/LXC/Create.pm).
        # fakepve 0.5.0 writes a synthetic config; the wrapper runs PVE's checks at the start of
        # the task and merges the backup's config (scenario `volumes[].config`) at its end.
        # Collisions stay fakepve's synchronous `check_vmid_unused` refusal, as PVE (§4.2).
        archive = v.get('ostemplate')
        vmid = int(v['vmid'])
        if v.get('restore') and (archive in (self.backup_configs or {}) or archive in (self.backup_guests or {})):
            backup = dict(self.stored_config(archive) or {})
            bed = (self.backup_guests or {}).get(archive)
            given = dict((k, x) for k, x in v.items() if k not in fake_lxc.CREATE_ONLY)
            is_root = user == 'root@pam'
            storage = v.get('storage') or 'local'
            # create_vm: no rootfs/mpN in the request = "storage only mode": the backup's mount
            # points are recreated on `storage` at their stored sizes.
            storage_only = not any(k == 'rootfs' or re.fullmatch(r'mp\d+', k) for k in given)
            # create_vm: the request's `unprivileged` if given (only a true one is written), else
            # the backup's; a backup without it is a privileged container.
            if v.get('unprivileged') is not None:
                unprivileged = 1 if truthy(v['unprivileged']) else None
            else:
                unprivileged = backup.get('unprivileged')
            stored_mounts = sorted((k for k in backup if k == 'rootfs' or re.fullmatch(r'mp\d+', k)),
                                   key=lambda k: (k != 'rootfs', fake_qemu.natural(k)))

            async def pre(ct, notes):
                # create_vm's worker, in its order, before any disk exists: (1) for every netN of
                # the backup the request does not give, check_bridge_access (SDN.Use, see
                # _vnet_access); (2) a privileged result (`unprivileged` neither given true nor
                # stored true) needs Sys.Modify on `/` for a new container; (3) in storage only
                # mode a stored bind or device mount point: rootfs "restoring rootfs to <type>
                # mount is only possible by specifying -rootfs manually!", an mpN "restoring
                # '<mpN>' to <type> mount is only possible for root"; a volume one without a size
                # "unable to detect disk size - please specify <mpN> (size)". A failure ends the
                # task "unable to restore CT <vmid> - <error>" and, the container being new
                # (destroy_config_on_error), removes its config: nothing is left.
                if self.volume_exists(archive) is False:
                    return  # fakepve's body reports the missing archive
                notes.say("recovering backed-up configuration from '{0}'".format(archive))
                try:
                    for key in sorted(backup, key=fake_qemu.natural):
                        if NET_KEY.match(key) and key not in given:
                            self._vnet_access(user, backup[key])
                    if not truthy(unprivileged) and not is_root:
                        self.require(user, '/', 'Sys.Modify')
                    for key in stored_mounts if storage_only else ():
                        mount = fake_lxc.parse_mount(backup[key])
                        kind = fake_lxc.mount_type(mount.get('volume', ''))
                        if kind != 'volume':
                            if key == 'rootfs':
                                raise fake_model.TaskError('restoring rootfs to {0} mount is only possible by '
                                                           'specifying -rootfs manually!'.format(kind))
                            if not is_root:
                                raise fake_model.TaskError("restoring '{0}' to {1} mount is only possible for root"
                                                           .format(key, kind))
                        elif not parse_size(mount.get('size')):
                            raise fake_model.TaskError('unable to detect disk size - please specify {0} (size)'
                                                       .format(key))
                except (fake_model.PveError, fake_model.TaskError) as e:
                    self._drop(ct)
                    raise fake_model.TaskError('unable to restore CT {0} - {1}'.format(
                        vmid, getattr(e, 'message', None) or str(e))) from e

            async def post(ct, notes):
                # Create.pm sanitize_and_merge_config (through restore_configuration), on the
                # config create_vm built from the request: every key of the backup except digest,
                # rootfs, snapshots, unprivileged, parent, template, mpN and unusedN; raw `lxc.*`
                # keys only for root@pam (anyone else gets rpcenv's warning, so the task ends
                # "TASK WARNINGS: 1"); `features` skipped (a plain warning) for a non-root
                # restore turning an unprivileged backup privileged; with `unique` a stored netN
                # is written OVER the request's with a new random hwaddr (same bridge, ip, all
                # else); otherwise the request's key wins and the stored value (hwaddr verbatim)
                # fills in. A netN of the request without hwaddr got a random one when create_vm
                # parsed it (src/PVE/LXC/Config.pm parse_lxc_network). Then hostname ||= CT<vmid>,
                # memory ||= 512, swap //= 512; storage-only mount points: new volumes of the
                # stored sizes, bind/device ones (root) restored verbatim after the extraction.
                notes.say('merging backed-up and given configuration..')
                built = ct.config
                conf = dict((k, x) for k, x in built.items() if k in given or k == 'rootfs')
                if unprivileged is not None:
                    conf['unprivileged'] = unprivileged
                raw = []
                for key in sorted(backup, key=fake_qemu.natural):
                    value = backup[key]
                    if key in ('digest', 'rootfs', 'snapshots', 'unprivileged', 'parent', 'template', 'lock') \
                            or re.fullmatch(r'(mp|unused)\d+', key):
                        continue
                    if key.startswith('lxc.'):
                        raw.append((key, value))
                        continue
                    if key == 'features' and not is_root and not truthy(conf.get('unprivileged')) \
                            and truthy(backup.get('unprivileged')):
                        notes.say('changing from unprivileged to privileged, skipping features')
                        continue
                    if NET_KEY.match(key) and v.get('unique'):
                        bare = ','.join(p for p in str(value).split(',') if not p.startswith('hwaddr='))
                        conf[key] = fake_lxc.normalise(key, bare)
                        continue
                    conf.setdefault(key, value)
                if raw and not is_root:
                    notes.say('\n'.join(['skipping custom lxc options, restore manually as root:',
                                         '--------------------------------']
                                        + ['{0}: {1}'.format(k, x) for k, x in raw]
                                        + ['--------------------------------']), warn=True)
                elif raw:
                    conf.update(raw)
                for key in ('ostype', 'arch'):
                    if key in built:
                        conf.setdefault(key, built[key])
                # create_vm: `$was_template = delete $orig_conf->{template}`, and after the
                # restore "Convert restored container to template..." (template_create): a
                # template's backup comes back a template, which never starts.
                if truthy(backup.get('template')):
                    notes.say('Convert restored container to template...')
                    conf['template'] = 1
                conf['hostname'] = conf.get('hostname') or 'CT{0}'.format(vmid)
                conf['memory'] = conf.get('memory') or 512
                conf.setdefault('swap', 512)
                if storage_only:
                    taken = self._taken_volumes()
                    for key in stored_mounts:
                        mount = fake_lxc.parse_mount(backup[key])
                        if fake_lxc.mount_type(mount.get('volume', '')) != 'volume':
                            conf[key] = backup[key]
                            continue
                        size = parse_size(mount.pop('size', None))
                        if key == 'rootfs':
                            # create_vm prints the stored mount point again with only its
                            # volume and size replaced (print_ct_mountpoint): every other
                            # option (quota, acl, mountoptions, ro, …) comes back.
                            mine = fake_lxc.parse_mount(conf['rootfs'])
                            mine.update((k, x) for k, x in mount.items() if k != 'volume')
                            mine['size'] = fake_lxc.format_size(size)
                            conf['rootfs'] = fake_lxc.print_mount(mine, True)
                            continue
                        mount['volume'] = '{0}:{1}'.format(storage, size / float(SIZE_UNITS['G']))
                        conf[key] = self._realise(vmid, key, fake_lxc.print_mount(mount, False), taken)
                ct.config = conf
                if bed is not None:
                    await self.bed_create(ct, 'lxc', bed, stored=backup)
            self._restore_hooks[vmid] = (pre, post)
        try:
            upid = await super()._lxc_create(user, v)
        finally:
            self._restore_hooks.pop(vmid, None)
        self._lost_create_answer(vmid)
        return upid

    # ------------------------------------------- what an operator does behind the agent's back

    def remove_guest(self, vmid):
        """`pct destroy` / `qm destroy` run as root outside the agent: the guest and its pool
        membership go at once (no task, no API request the agent could see)."""
        guest = self.guest(int(vmid))
        if guest is None:
            raise ValueError('no guest {0}'.format(vmid))
        if guest in getattr(self, 'cts', []):
            self.cts.remove(guest)
        if guest in getattr(self, 'vms', []):
            self.vms.remove(guest)
        self._pool_leave(int(vmid))
        self.write_vmlist()
        return None

    def backup_guest(self, vmid, volname):
        """vzdump of a guest onto `local`: a backup volume whose stored config is the guest's config
        now (tags, description, MACs, vmgenid), as the archive records it."""
        guest = self.guest(int(vmid))
        if guest is None:
            raise ValueError('no guest {0}'.format(vmid))
        store = self.storages['local'].setdefault('volumes', {})
        store[volname] = {'content': 'backup', 'format': backup_format(volname), 'size': 1 << 20,
                          'ctime': int(time.time()), 'vmid': int(vmid)}
        volid = 'local:' + volname
        self.backup_configs[volid] = dict((k, str(x)) for k, x in (guest.config or {}).items()
                                          if k not in ('lock', 'digest'))
        return volid

    async def task(self, node, ttype, tid, user, body, vm=None, lock=True, log=(), notes=None):
        notes = notes or TaskNotes()
        hooks = self._restore_hooks.get(int(tid)) if ttype == 'vzrestore' and str(tid).isdigit() else None
        if hooks is not None:
            inner = body
            pre, post = hooks

            async def body():
                await pre(vm, notes)
                note = await inner()
                await post(vm, notes)
                return note
        ran = body

        async def body():
            note = await ran()
            # The worker's last words come after the body (fakepve writes them at once).
            asyncio.get_running_loop().call_soon(notes.finish)
            return note
        outside = (self.restore_outside_pool or {}).pop(str(tid), None) if ttype == 'vzrestore' else None
        if outside:
            joined = body

            async def body():
                note = await joined()
                # The task ends OK, and the container is no longer in the pool the moment it
                # ends (see restore_outside_pool).
                self._pool_leave(int(tid))
                return note
        backed_up = (self.backup_lock_after_start or {}).pop(str(tid), None) \
            if ttype in ('vzstart', 'qmstart') else None
        if backed_up:
            started = body

            async def body():
                note = await started()
                vmid = int(tid)
                self.snapshot_lock(vmid, 'backup')

                def unlock():
                    guest = self.guest(vmid)
                    if guest is not None and guest.lock == 'backup':
                        self.unlock(vmid)
                asyncio.get_running_loop().call_later(float(backed_up), unlock)
                return note
        failing = (self.lxc_restore_fail or {}).pop(str(tid), None) if ttype == 'vzrestore' else None
        if failing:
            restored = body

            async def body():
                await restored()
                # The container is restored (config written, lock gone); the pool join failed,
                # so it is not in the pool and the task ends in error (see lxc_restore_fail).
                pool = next((p for p, members in self.pools.items() if int(tid) in members), '')
                message = failing if isinstance(failing, str) else (
                    "can't add VM {0} to pool '{1}': cfs-lock 'file-user_cfg' error: got lock request timeout"
                    .format(tid, pool))
                self._pool_leave(int(tid))
                raise fake_model.TaskError(message)
        logged = body
        # (`log` here is the task's first lines, not the fake's logger.)
        fake_log = logging.getLogger('fakepve-scenario')

        async def body():
            # fakepve writes a task's end only into the task's own log: the fake's log names
            # each one too (a failed one as a warning), so a failed step can be traced there.
            try:
                note = await logged()
            except fake_model.TaskError as e:
                fake_log.warning('task %s %s by %s failed: %s', ttype, tid, user, e)
                raise
            fake_log.info('task %s %s by %s ended OK', ttype, tid, user)
            return note
        upid = await super().task(node, ttype, tid, user, body, vm=vm, lock=lock, log=log)
        notes.attach(self.tasks[upid], len(log))
        return upid

    # ------------------------------------------------------------ the guest bed

    # {"state": dir, "template": rootfs}: guests with a real root filesystem live in
    # <state>/<vmid>/rootfs (the `pct` stand-in's layout), copied from the template.
    guest_bed = None
    # vmid -> {"kind": lxc|qemu, ...the guest spec}: the guests whose root filesystems this
    # wrapper made (and removes once PVE no longer has the guest).
    bed_owned = None
    # vmid -> the running "VM" (its PID namespace's init, under unshare) of a bed VM.
    bed_inits = None
    # vmid -> {pid: exec record} of a bed VM's guest agent.
    bed_execs = None
    _bed_pid = 1000

    def bed_dir(self, vmid):
        return os.path.join(self.guest_bed['state'], str(vmid))

    async def bed_create(self, guest, kind, spec, stored=None):
        """Give a guest a root filesystem of its own (its disks, restored): a copy of the template,
        hostname from its config. A VM's spec says whether a guest agent runs inside (`agent`,
        default true) and how many PVE seconds it boots before the agent answers (`boot_secs`).
        A container of a real bed (`real_lxc`) is a real LXC container: see bed_lxc_create;
        `stored` is the config of the backup it is restored from."""
        if not self.guest_bed:
            raise fake_model.TaskError('the scenario has no guest_bed for a guest with a root filesystem')
        spec = dict(spec) if isinstance(spec, dict) else {}
        vmid = int(guest.vmid)
        if kind == 'qemu' and spec.get('real'):
            if not self.guest_bed.get('real_qemu'):
                raise fake_model.TaskError('unable to restore VM {0} - the test bed: a real VM needs guest_bed '
                                           'real_qemu (GuestBed::new_real_vm)'.format(guest.vmid))
            try:
                await self.bed_qemu_create(guest, spec)
            except (OSError, ValueError) as e:
                log.warning('real VM %s could not be made', guest.vmid, exc_info=True)
                raise fake_model.TaskError('unable to restore VM {0} - the test bed: {1}'.format(
                    guest.vmid, e)) from e
            return
        if kind == 'lxc' and self.bed_real():
            try:
                await self.bed_lxc_create(guest, spec, stored)
            except (OSError, ValueError) as e:
                # A bed failure ends the restore task in error (never a task that hangs).
                log.warning('real container %s could not be made', guest.vmid, exc_info=True)
                raise fake_model.TaskError('unable to restore CT {0} - the test bed: {1}'.format(
                    guest.vmid, e)) from e
            return
        d = self.bed_dir(vmid)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        proc = await asyncio.create_subprocess_exec('cp', '-a', self.guest_bed['template'], os.path.join(d, 'rootfs.tmp'))
        if await proc.wait() != 0:
            raise fake_model.TaskError('could not copy the guest bed template')
        name = guest.config.get('hostname' if kind == 'lxc' else 'name') or '{0}{1}'.format(
            'CT' if kind == 'lxc' else 'vm', vmid)
        with open(os.path.join(d, 'rootfs.tmp', 'etc', 'hostname'), 'w', encoding='utf-8') as fh:
            fh.write(str(name) + '\n')
        # `files`: {guest path: text} written into the restored root filesystem (the backup's own
        # files: a stand-in `systemctl`, a unit's state); a text starting with `#!` is executable.
        # A path ending in `/` is a folder.
        for path, text in sorted((spec.get('files') or {}).items()):
            rel = str(path).lstrip('/')
            if not rel or '..' in rel.split('/'):
                raise ScenarioError('guest file {0!r} is not a plain absolute path'.format(path))
            full = os.path.join(d, 'rootfs.tmp', rel)
            if str(path).endswith('/'):
                os.makedirs(full, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, 'w', encoding='utf-8') as fh:
                fh.write(str(text))
            os.chmod(full, 0o755 if str(text).startswith('#!') else 0o644)
        os.rename(os.path.join(d, 'rootfs.tmp'), os.path.join(d, 'rootfs'))
        with open(os.path.join(d, 'kind'), 'w', encoding='utf-8') as fh:
            fh.write(kind + '\n')
        spec['kind'] = kind
        self.bed_owned[vmid] = spec
        self.bed_sync()

    def bed_sync(self):
        """Keep the guest bed in step with PVE's state: a container's `status` file for the `pct`
        stand-in, a VM's namespace running while the VM runs, and a guest's root filesystem removed
        once PVE no longer has the guest (destroyed: its disks are gone)."""
        if not self.bed_owned:
            return
        for vmid, spec in list(self.bed_owned.items()):
            guest = self.vm(vmid) if spec['kind'] == 'qemu' else self.ct(vmid)
            d = self.bed_dir(vmid)
            if guest is None:
                self.bed_stop(vmid)
                self.bed_monitor(vmid, False)
                if spec.get('real') and spec['kind'] == 'qemu':
                    self.bed_qemu_stop(vmid)
                elif spec.get('real'):
                    self.bed_lxc_stop(vmid)
                    shutil.rmtree(os.path.join(self.guest_bed['lxc_path'], str(vmid)), ignore_errors=True)
                shutil.rmtree(d, ignore_errors=True)
                del self.bed_owned[vmid]
                continue
            running = guest.status == 'running'
            if spec.get('real') and spec['kind'] == 'qemu':
                self.bed_qemu_sync(guest, running)
                continue
            if spec.get('real'):
                self.bed_lxc_sync(guest, running)
                continue
            if spec['kind'] == 'lxc':
                want = 'running\n' if running else 'stopped\n'
                path = os.path.join(d, 'status')
                try:
                    with open(path, encoding='utf-8') as fh:
                        same = fh.read() == want
                except OSError:
                    same = False
                if not same:
                    with open(path + '.tmp', 'w', encoding='utf-8') as fh:
                        fh.write(want)
                    os.replace(path + '.tmp', path)
                self.bed_monitor(vmid, running)
            elif running:
                self.bed_start(vmid)
            else:
                self.bed_stop(vmid)

    # vmid -> the stand-in of root's LXC monitor of a running bed container.
    bed_monitors = None

    def bed_monitor(self, vmid, running):
        """Keep a running bed container's LXC monitor stand-in (`tests/pct/lxc-monitor`, root's,
        holding `@<lxc_path>/<vmid>/command`, which the agent checks before every `pct exec`, and
        running the container's init, whose namespaces every `pct exec` enters) and
        none for a stopped or gone one. Started before the answer that shows the container
        running; one that died is not started again until the container stops and starts."""
        if not self.guest_bed or not self.guest_bed.get('lxc_path'):
            return
        if self.bed_monitors is None:
            self.bed_monitors = {}
        mon = self.bed_monitors.get(vmid)
        if running:
            if mon is not None:
                return
            rootfs = os.path.join(self.bed_dir(vmid), 'rootfs')
            proc = subprocess.Popen(['perl', self.guest_bed['monitor'], self.guest_bed['lxc_path'], str(vmid), rootfs],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
            line = proc.stdout.readline().strip()
            if line != b'ready':
                log.warning('the LXC monitor stand-in of %s did not start: %r', vmid, line)
            self.bed_monitors[vmid] = proc
        elif mon is not None:
            del self.bed_monitors[vmid]
            try:
                mon.kill()
                mon.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    def bed_start(self, vmid):
        """Boot a bed VM: a PID, mount, UTS and IPC namespace whose init (a shell that reaps the
        orphans it adopts) lives chrooted in its root filesystem (/proc mounted for it); every
        agent exec joins it, as processes of one guest kernel do."""
        init = self.bed_inits.get(vmid)
        if init is not None and init['proc'].poll() is None:
            return init
        rootfs = os.path.join(self.bed_dir(vmid), 'rootfs')
        # The init ends when its root is gone (a test's folder removed under a VM left running):
        # without the guard its loop, whose `sleep` no longer exists, forks without pause.
        script = ('r=$1; mount --bind "$r" "$r" && mount -t proc proc "$r/proc" && '
                  'exec chroot "$r" /usr/bin/busybox sh -c '
                  '"/bin/hostname -F /etc/hostname 2>/dev/null; '
                  'while [ -e /usr/bin/busybox ]; do sleep 3600 & wait; done"')
        # unshare dies with the fake however the fake ends (SIGKILL included), and takes the
        # VM's init with it (--kill-child): no VM outlives the fake that started it.
        proc = subprocess.Popen(['unshare', '--fork', '--pid', '--mount', '--uts', '--ipc', '--kill-child', '--',
                                 '/bin/sh', '-c', script, 'felhom-vm-init', rootfs],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)
        init = {'proc': proc, 'rootfs': os.path.realpath(rootfs), 'started': time.time()}
        self.bed_inits[vmid] = init
        self.bed_execs.setdefault(vmid, {})
        return init

    def bed_stop(self, vmid):
        """Power a bed VM off: its namespace dies with everything in it."""
        init = self.bed_inits.pop(vmid, None)
        for rec in (self.bed_execs.pop(vmid, None) or {}).values():
            if rec['proc'] is not None and rec['proc'].returncode is None:
                try:
                    rec['proc'].kill()
                except ProcessLookupError:
                    pass
        if init is None:
            return
        try:
            init['proc'].kill()
            init['proc'].wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass

    async def bed_init_pid(self, vmid):
        """The host pid of a bed VM's init once it runs chrooted in the guest (None: it died)."""
        init = self.bed_start(vmid)
        deadline = time.time() + 10
        outer = init['proc'].pid
        while time.time() < deadline:
            if init['proc'].poll() is not None:
                return None
            try:
                with open('/proc/{0}/task/{0}/children'.format(outer), encoding='ascii') as fh:
                    kids = fh.read().split()
                if kids and os.readlink('/proc/{0}/root'.format(kids[0])) == init['rootfs']:
                    with open('/proc/{0}/comm'.format(kids[0]), encoding='ascii') as fh:
                        if fh.read().strip() in ('sleep', 'busybox'):
                            return int(kids[0])
            except OSError:
                pass
            await asyncio.sleep(0.01)
        return None

    async def bed_spawn(self, vmid, argv, stdin):
        """Run argv inside a bed VM (its namespaces and root) as qemu-ga runs a guest-exec: the
        agent's environment (PATH only), stdin the given bytes or /dev/null."""
        pid = await self.bed_init_pid(vmid)
        if pid is None:
            raise fake_model.PveError(500, 'VM {0} qga command failed - got timeout'.format(vmid))
        enter = ['nsenter', '-t', str(pid), '-p', '-m', '-u', '-i', '-r', '-w', '--']
        # The init sets the VM's hostname from its /etc/hostname right after it starts, but an
        # exec may come before it did: the first exec sets it first (the same value, once), as
        # a VM's kernel has its name before any guest-exec can run.
        init = self.bed_inits.get(vmid)
        if init is not None and not init.get('named'):
            named = await asyncio.create_subprocess_exec(
                *(enter + ['/usr/bin/busybox', 'hostname', '-F', '/etc/hostname']),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            await named.wait()
            init['named'] = True
        return await asyncio.create_subprocess_exec(
            *(enter + ['/usr/bin/env', '-i', 'PATH=' + QGA_PATH] + list(argv)),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    async def bed_run(self, vmid, argv, stdin=None):
        """Run argv in a bed VM to its end: (exit status, stdout, stderr)."""
        proc = await self.bed_spawn(vmid, argv, stdin)
        out, err = await proc.communicate(stdin)
        return proc.returncode, out, err

    # ------------------------------------------------ real LXC containers (guest_bed.real_lxc)

    # guest_bed['real_lxc'] = {"tarball": the Debian root filesystem with owners shifted by
    # 100000 (tests/testbed/build-debian-rootfs.sh), "releases": {Debian suite: its tarball} for
    # the guests whose backup names a `release`, "osqueryi": the stand-in installed into
    # each guest, "net_prefix": the prefix of every bridge and veth this bed makes}.
    # vmid -> {"proc": the `lxc-start -F` process (root's LXC monitor), "log": its output}.
    bed_lxc = None
    # PVE bridge name -> the bed bridge standing in for it (made on first use, removed at the end).
    bed_bridges = None
    _bed_veth = 0
    # The idmap pve-container writes for an unprivileged container (LXC.pm update_lxc_config).
    LXC_SHIFT = 100000

    def bed_real(self):
        return bool(self.guest_bed and self.guest_bed.get('real_lxc'))

    def _guest_file(self, rootfs, path, text, mode=0o644, link=None):
        """Write a file of a real container's root filesystem, owned by the container's root
        (`link`: a symbolic link to that target instead, as `systemctl enable` and `mask` make
        them). The fake runs as root and a guest that ran may have replaced any folder or file
        with a link: every component is opened without following links (a link where a folder
        should be fails the write; a link at the file's own name is removed first)."""
        parts = [p for p in path.split('/') if p]
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        fd = os.open(rootfs, flags)
        try:
            for part in parts[:-1]:
                try:
                    nxt = os.open(part, flags, dir_fd=fd)
                except FileNotFoundError:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    os.chown(part, self.LXC_SHIFT, self.LXC_SHIFT, dir_fd=fd, follow_symlinks=False)
                    nxt = os.open(part, flags, dir_fd=fd)
                os.close(fd)
                fd = nxt
            name = parts[-1]
            try:
                os.unlink(name, dir_fd=fd)  # a file or a link, never followed
            except FileNotFoundError:
                pass
            if link is not None:
                os.symlink(link, name, dir_fd=fd)
                os.chown(name, self.LXC_SHIFT, self.LXC_SHIFT, dir_fd=fd, follow_symlinks=False)
                return
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=fd)
            try:
                os.fchown(out, self.LXC_SHIFT, self.LXC_SHIFT)
                os.fchmod(out, mode)
                data = text.encode('utf-8')
                while data:
                    data = data[os.write(out, data):]
            finally:
                os.close(out)
        finally:
            os.close(fd)

    def _guest_read(self, rootfs, path):
        """The text of a real container's file, every component opened without following links
        (a guest that ran may have made any of them a link); None when it cannot be read so."""
        parts = [p for p in path.split('/') if p]
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        try:
            fd = os.open(rootfs, flags)
        except OSError:
            return None
        try:
            for part in parts[:-1]:
                nxt = os.open(part, flags, dir_fd=fd)
                os.close(fd)
                fd = nxt
            f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
            with os.fdopen(f, 'rb') as fh:
                return fh.read(1 << 20).decode('utf-8', 'replace')
        except OSError:
            return None
        finally:
            os.close(fd)

    def _etc_hosts(self, rootfs, config):
        """/etc/hosts as pve-container's pre-start hook leaves it (src/PVE/LXC/Setup/Base.pm
        set_hostname -> update_etc_hosts, written with ct_modify_file): PVE's section, between
        `# --- BEGIN PVE ---` and `# --- END PVE ---`, holds `127.0.0.1 localhost.localnet
        localhost` and `::1 localhost.localnet localhost` unless the guest's own lines (outside
        PVE's sections) have such an entry, then `<ip> <names>` with the address of net0 only
        (src/PVE/LXC.pm get_primary_ips: ip= unless dhcp/manual, else ip6= unless
        auto/dhcp/manual, the prefix length cut off), or `127.0.1.1 <names>` without one; the
        names `<fqdn> <first label>` for a hostname with a dot, else `<hostname>.<domain> …
        <hostname>` for each search domain (the config's searchdomain, else the node's
        resolv.conf `search`: the bed's node has none). The first section found is replaced
        (its BEGIN matched case-sensitively, its END not), else the section is appended. A
        file PVE is told to leave alone (/etc/.pve-ignore.hosts) is left alone."""
        if self._guest_read(rootfs, '/etc/.pve-ignore.hosts') is not None:
            return
        hostname = (config or {}).get('hostname') or 'localhost'
        namepart = hostname.split('.', 1)[0]
        if '.' in hostname:
            names = '{0} {1}'.format(hostname, namepart)
        else:
            domains = str((config or {}).get('searchdomain') or '').replace(',', ' ').replace(';', ' ').split()
            names = ' '.join(['{0}.{1}'.format(hostname, d) for d in domains] + [hostname])
        hostip = None
        if (config or {}).get('net0'):
            _, props = fake_lxc.split_props(str(config['net0']))
            v4, v6 = props.get('ip'), props.get('ip6')
            v4 = None if not v4 or v4 in ('dhcp', 'manual') else v4.split('/', 1)[0]
            v6 = None if not v6 or v6 in ('auto', 'dhcp', 'manual') else v6.split('/', 1)[0]
            hostip = v4 or v6
        old = self._guest_read(rootfs, '/etc/hosts')
        section = ''
        if old is None:
            section = '127.0.0.1 localhost.localnet localhost\n::1 localhost.localnet localhost\n'
        else:
            # remove_pve_sections: from the first BEGIN to the last END (a greedy match).
            outside = re.sub(r'^[ \t]*# --- BEGIN PVE ---.*^[ \t]*# --- END PVE ---.*?$', '', old,
                             flags=re.M | re.S)
            if not re.search(r'^[ \t]*127\.0\.0\.1[ \t]+', outside, re.M):
                section += '127.0.0.1 localhost.localnet localhost\n'
            if not re.search(r'^[ \t]*::1[ \t]+', outside, re.M):
                section += '::1 localhost.localnet localhost\n'
        if hostip:
            section += '{0} {1}\n'.format(hostip, names)
        elif namepart != 'localhost':
            section += '127.0.1.1 {0}\n'.format(names)
        else:
            section += '127.0.1.1 {0}\n'.format(namepart)
        head, tail = '# --- BEGIN PVE ---', '# --- END PVE ---'
        if old is None:
            self._guest_file(rootfs, '/etc/hosts', head + '\n' + section + tail + '\n')
            return
        lines = old.split('\n')
        while lines and lines[-1] == '':
            lines.pop()  # Perl's split drops trailing empty fields
        beg = end = None
        for i, line in enumerate(lines):
            if beg is None and re.match(r'#\s*---\s*BEGIN\s*PVE\s*', line):
                beg = i
            elif beg is not None and end is None and re.match(r'#\s*---\s*END\s*PVE\s*', line, re.I):
                end = i
                break
        if beg is not None and end is not None:
            lines[beg:end + 1] = [head + '\n' + section + tail]
            text = '\n'.join(lines) + '\n'
        else:
            text = '\n'.join(lines).rstrip('\n') + '\n' + head + '\n' + section + tail + '\n'
        self._guest_file(rootfs, '/etc/hosts', text)

    @staticmethod
    def _debian_interfaces(config):
        """/etc/network/interfaces as pve-container writes it for a Debian >= 10 guest with these
        NICs (src/PVE/LXC/Setup/Debian.pm setup_network: `auto <name>`, `iface <name> inet
        static` with `address <cidr>` and `gateway <gw>`, or `inet dhcp|manual`; likewise for
        `ip6`/`gw6`: `iface <name> inet6 static|dhcp|auto|manual`, no option lines); None when no
        NIC has a name and an address, where setup_network returns without touching the file
        (`return if !scalar(keys %$networks)`). The merge with sections already in the file is
        left out: the bed's root filesystem holds only `lo`."""
        out = []
        for key in sorted(config, key=fake_qemu.natural):
            if not NET_KEY.match(key):
                continue
            _, props = fake_lxc.split_props(str(config[key]))
            name, ip, gw = props.get('name'), props.get('ip'), props.get('gw')
            if not name or not (ip or gw or props.get('ip6')):
                continue
            out.append('auto {0}\n'.format(name))
            for family, addr, gateway, methods in (('inet', ip, gw, ('dhcp', 'manual')),
                                                   ('inet6', props.get('ip6'), props.get('gw6'),
                                                    ('dhcp', 'auto', 'manual'))):
                if addr in methods:
                    out.append('iface {0} {1} {2}\n\n'.format(name, family, addr))
                elif addr:
                    out.append('iface {0} {1} static\n\taddress {2}\n'.format(name, family, addr))
                    if gateway:
                        out.append('\tgateway {0}\n'.format(gateway))
                    out.append('\n')
        if not out:
            return None
        return 'auto lo\niface lo inet loopback\n\n' + ''.join(out)

    async def bed_lxc_create(self, guest, spec, stored):
        """A restored unprivileged container: the bed's Debian tarball extracted with its owners
        shifted by 100000 (as PVE restores an unprivileged backup), the osqueryi stand-in
        installed as osquery's package lays it out, the hostname, and /etc/network/interfaces as
        the backup's guest last ran with it (written by pve-container at its last start from its
        NICs: `stored`). `spec["files"]` ({guest path: text}) adds files, `spec["links"]`
        ({guest path: target}) symbolic links, `spec["release"]` picks the Debian release
        (a key of real_lxc["releases"]; the default tarball without)."""
        real = self.guest_bed['real_lxc']
        tarball = real['tarball']
        release = spec.get('release')
        if release is not None:
            tarball = (real.get('releases') or {}).get(release)
            if not tarball:
                raise fake_model.TaskError('the bed has no Debian release {0!r} (it has: {1})'.format(
                    release, ', '.join(sorted(real.get('releases') or {}))))
        vmid = int(guest.vmid)
        d = self.bed_dir(vmid)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        # Every folder above the root filesystem must be traversable by the container's root.
        os.chmod(d, 0o711)
        tmp = os.path.join(d, 'rootfs.tmp')
        os.makedirs(tmp)
        proc = await asyncio.create_subprocess_exec(
            'tar', '--numeric-owner', '--warning=no-unknown-keyword', '-xpf', tarball, '-C', tmp,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise fake_model.TaskError('could not extract the bed\'s Debian root filesystem: {0}'.format(
                err.decode('utf-8', 'replace').strip()))
        os.chown(tmp, self.LXC_SHIFT, self.LXC_SHIFT)
        os.chmod(tmp, 0o755)
        with open(real['osqueryi'], encoding='utf-8') as fh:
            standin = fh.read()
        self._guest_file(tmp, '/opt/osquery/bin/osqueryd', standin, 0o755)
        for link in ('/usr/bin/osqueryi', '/usr/bin/osqueryd'):
            full = os.path.join(tmp, link.lstrip('/'))
            os.symlink('/opt/osquery/bin/osqueryd', full)
            os.lchown(full, self.LXC_SHIFT, self.LXC_SHIFT)
        name = guest.config.get('hostname') or 'CT{0}'.format(vmid)
        self._guest_file(tmp, '/etc/hostname', '{0}\n'.format(name))
        self._etc_hosts(tmp, stored or {})
        interfaces = self._debian_interfaces(stored or {})
        if interfaces:
            self._guest_file(tmp, '/etc/network/interfaces', interfaces)
        for path, text in sorted((spec.get('files') or {}).items()):
            self._guest_file(tmp, str(path), str(text))
        for path, target in sorted((spec.get('links') or {}).items()):
            self._guest_file(tmp, str(path), '', link=str(target))
        os.rename(tmp, os.path.join(d, 'rootfs'))
        for fname, text in (('kind', 'lxc\n'), ('real', 'lxc\n'), ('status', 'stopped\n')):
            with open(os.path.join(d, fname), 'w', encoding='utf-8') as fh:
                fh.write(text)
        spec['kind'] = 'lxc'
        spec['real'] = True
        self.bed_owned[vmid] = spec
        self.bed_sync()

    def _bed_link(self, kind):
        """A new link name of this bed: <prefix><kind><n>, at most 15 characters (IFNAMSIZ)."""
        self._bed_veth += 1
        name = '{0}{1}{2}'.format(self.guest_bed['real_lxc']['net_prefix'], kind, self._bed_veth)
        if len(name) > 15:
            raise fake_model.TaskError('bed link name {0} is too long'.format(name))
        return name

    def _bed_bridge(self, bridge):
        """The bed bridge standing in for PVE bridge `bridge`: no uplink, no address, up."""
        if self.bed_bridges is None:
            self.bed_bridges = {}
        name = self.bed_bridges.get(bridge)
        if name is not None:
            return name
        name = self._bed_link('b')
        # addrgenmode none: not even an IPv6 link-local address.
        for argv in (['ip', 'link', 'add', name, 'type', 'bridge'],
                     ['ip', 'link', 'set', name, 'addrgenmode', 'none'],
                     ['ip', 'link', 'set', name, 'up']):
            run = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if run.returncode != 0:
                raise fake_model.TaskError('cannot make bed bridge {0} for {1}: {2}'.format(
                    name, bridge, run.stderr.decode('utf-8', 'replace').strip()))
        self.bed_bridges[bridge] = name
        return name

    def bed_lxc_config(self, ct):
        """The LXC config of a real container, as pve-container's update_lxc_config
        (src/PVE/LXC.pm) writes it, for what this bed needs: the cgroup layout, arch, the
        includes of its ostype (and userns for an unprivileged one), `lxc.mount.auto =
        sys:mixed`, `lxc.monitor.unshare`, the idmap, the console, ttys, TERM, the hostname, the
        root filesystem, and one veth per netN (name, hwaddr, mtu). Left out: seccomp and AppArmor
        (PVE's own profiles), cgroup limits, and lxcnetaddbr: the veth's host end is attached by
        LXC (`lxc.net.N.link`) to a bed bridge, named by the bed so it cannot clash with a link
        of the machine. A container is unprivileged here whatever its config says (the shifted
        tarball): a privileged one is not part of the bed."""
        vmid = int(ct.vmid)
        conf = ct.config or {}
        cfgpath = '/usr/share/lxc/config'
        ostype = str(conf.get('ostype') or 'debian')
        # The include is a path root's lxc-start reads: PVE's schema allows only its enum
        # (pve-container src/PVE/LXC/Config.pm `ostype`), so a config value such as
        # `../../../tmp/x` never names a file of someone else's.
        if ostype not in LXC_OSTYPES:
            raise fake_model.TaskError('ostype {0!r} is not one of {1}'.format(ostype, ', '.join(LXC_OSTYPES)))
        inc = os.path.join(cfgpath, ostype + '.common.conf')
        if not os.path.isfile(inc):
            inc = os.path.join(cfgpath, 'common.conf')
        userns = os.path.join(cfgpath, ostype + '.userns.conf')
        if not os.path.isfile(userns):
            userns = os.path.join(cfgpath, 'userns.conf')
        # PVE's cgroup layout (lxc.monitor/<vmid>, lxc/<vmid>) below a folder of this bed
        # (felhom-bed/<net_prefix>/), so that beds running side by side with the same vmids do
        # not share a cgroup, and the bed can find and remove all of it.
        top = 'felhom-bed/{0}'.format(self.guest_bed['real_lxc']['net_prefix'])
        lines = [
            'lxc.cgroup.relative = 0',
            'lxc.cgroup.dir.monitor = {0}/lxc.monitor/{1}'.format(top, vmid),
            'lxc.cgroup.dir.container = {0}/lxc/{1}'.format(top, vmid),
            'lxc.cgroup.dir.container.inner = ns',
            'lxc.arch = {0}'.format(conf.get('arch') or 'amd64'),
            'lxc.include = {0}'.format(inc),
            'lxc.include = {0}'.format(userns),
            'lxc.mount.auto = sys:mixed',
            'lxc.monitor.unshare = 1',
            'lxc.idmap = u 0 {0} 65536'.format(self.LXC_SHIFT),
            'lxc.idmap = g 0 {0} 65536'.format(self.LXC_SHIFT),
            'lxc.console.path = none',
            'lxc.tty.max = {0}'.format(int(conf.get('tty') or 2)),
            'lxc.environment = TERM=linux',
            'lxc.uts.name = {0}'.format(conf.get('hostname') or 'CT{0}'.format(vmid)),
            'lxc.rootfs.path = {0}'.format(os.path.join(self.bed_dir(vmid), 'rootfs')),
            # The bed's own: LXC's errors about this container, for the fake's log (beside the
            # container's folder: it outlives a destroy, as the start log does).
            'lxc.log.file = {0}'.format(self.bed_dir(vmid) + '.lxc.log'),
            'lxc.log.level = ERROR',
        ]
        for key in sorted(conf, key=fake_qemu.natural):
            m = NET_KEY.match(key)
            if not m:
                continue
            ind = key[3:]
            _, props = fake_lxc.split_props(str(conf[key]))
            bridge = props.get('bridge')
            mtu = int(props.get('mtu') or self._bridge_mtu(bridge))
            lines.append('lxc.net.{0}.type = veth'.format(ind))
            lines.append('lxc.net.{0}.veth.pair = {1}'.format(ind, self._bed_link('v')))
            if props.get('hwaddr'):
                lines.append('lxc.net.{0}.hwaddr = {1}'.format(ind, props['hwaddr']))
            if props.get('name'):
                lines.append('lxc.net.{0}.name = {1}'.format(ind, props['name']))
            lines.append('lxc.net.{0}.mtu = {1}'.format(ind, mtu))
            if not truthy(props.get('link_down')):
                lines.append('lxc.net.{0}.link = {1}'.format(ind, self._bed_bridge(bridge)))
        # A config value with a line break would add LXC keys of its own (a hook root runs):
        # PVE's formats have none.
        for line in lines:
            if any(c in line for c in '\n\r\0'):
                raise fake_model.TaskError('a config value of CT {0} holds a line break: {1!r}'.format(vmid, line))
        return '\n'.join(lines) + '\n'

    def _bed_lxc_prepare(self, ct):
        """What happens at a real container's start before LXC runs it: update_lxc_config writes
        its config, and pve-container's pre-start hook (Setup pre_start_hook) sets the hostname,
        /etc/hosts (`_etc_hosts`) and, when it has NICs, its network config (Debian.pm
        setup_network)."""
        vmid = int(ct.vmid)
        rootfs = os.path.join(self.bed_dir(vmid), 'rootfs')
        lxcdir = os.path.join(self.guest_bed['lxc_path'], str(vmid))
        os.makedirs(lxcdir, exist_ok=True)
        with open(os.path.join(lxcdir, 'config'), 'w', encoding='utf-8') as fh:
            fh.write(self.bed_lxc_config(ct))
        name = (ct.config or {}).get('hostname') or 'CT{0}'.format(vmid)
        self._guest_file(rootfs, '/etc/hostname', '{0}\n'.format(name))
        self._etc_hosts(rootfs, ct.config or {})
        interfaces = self._debian_interfaces(ct.config or {})
        if interfaces:
            self._guest_file(rootfs, '/etc/network/interfaces', interfaces)
        self._bed_lxc_cleanup_cgroups(vmid)
        # Beside the container's folder, which a destroy removes: a start that failed is still
        # explained once the agent destroyed the guest (its gate destroys a failed provision).
        log_path = self.bed_dir(vmid) + '.lxc-start.log'
        logf = open(log_path, 'ab')
        # pve-container@.service runs `/usr/bin/lxc-start -F -n <vmid>`; the bed's lxcpath is
        # not LXC's default, so `-P <lxcpath>` comes first.
        proc = subprocess.Popen(['lxc-start', '-P', self.guest_bed['lxc_path'], '-F', '-n', str(vmid)],
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
        logf.close()
        if self.bed_lxc is None:
            self.bed_lxc = {}
        self.bed_lxc[vmid] = {'proc': proc, 'log': log_path}
        return proc

    def _bed_lxc_cleanup_cgroups(self, vmid):
        """pve-container's pre-start hook (src/lxc-pve-prestart-hook `cleanup_cgroups`) removes
        the cgroups a previous run of the container left (`lxc/<vmid>`, `lxc.monitor/<vmid>`),
        depth first, and dies when one cannot go: LXC's monitor often fails to remove them at
        stop (its rmdir meets processes still exiting), and with `lxc.cgroup.dir.container` set
        lxc-start then fails with ERANGE (lxc src/lxc/cgroups/cgfsng.c `cgfsng_payload_create`
        tries no suffix). The hook runs inside lxc-start, a moment after the start request; the
        bed, whose tests start a copy right after its stop, gives killed processes 5 s to leave
        a folder before it fails the start as the hook would."""
        top = os.path.join('felhom-bed', self.guest_bed['real_lxc']['net_prefix'])
        deadline = time.monotonic() + 5
        for hier in glob.glob('/sys/fs/cgroup/*/') + ['/sys/fs/cgroup/']:
            for kind in ('lxc', 'lxc.monitor'):
                base = os.path.join(hier, top, kind, str(vmid))
                while os.path.isdir(base):
                    left = []
                    for root, _, _ in sorted(os.walk(base), key=lambda x: -len(x[0])):
                        try:
                            os.rmdir(root)
                        except FileNotFoundError:
                            pass
                        except OSError as e:
                            left.append('{0}: {1}'.format(root, e.strerror))
                    if not left:
                        break
                    if time.monotonic() > deadline:
                        raise fake_model.TaskError("failed to remove directory '{0}'".format(left[0]))
                    time.sleep(0.05)

    def _bed_lxc_failed(self, vmid, proc):
        tail = ''
        for name in ('.lxc-start.log', '.lxc.log'):
            try:
                with open(self.bed_dir(vmid) + name, encoding='utf-8', errors='replace') as fh:
                    tail += fh.read()[-2000:]
            except OSError:
                pass
        log.warning('real container %s did not start: %s', vmid, tail)
        self.bed_lxc_stop(vmid)
        return fake_model.TaskError("startup for container '{0}' failed".format(vmid))

    async def bed_lxc_start(self, ct):
        """Start a real container and wait until LXC says RUNNING (pve-container vm_start:
        `systemctl start pve-container@<vmid>`, whose ExecStart is `lxc-start -F -n <vmid>`,
        then it waits for the container to run); "startup for container '<vmid>' failed" else."""
        vmid = int(ct.vmid)
        old = (self.bed_lxc or {}).get(vmid)
        if old is not None and old['proc'].poll() is None:
            return
        proc = self._bed_lxc_prepare(ct)
        # PVE says stopped until the start task ends: bed_sync must not stop it meanwhile.
        self.bed_lxc[vmid]['starting'] = True
        wait = await asyncio.create_subprocess_exec(
            'lxc-wait', '-P', self.guest_bed['lxc_path'], '-n', str(vmid), '-s', 'RUNNING', '-t', '30',
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        code = await wait.wait()
        self.bed_lxc[vmid]['starting'] = False
        if code != 0 or proc.poll() is not None:
            raise self._bed_lxc_failed(vmid, proc)
        self._bed_lxc_status(vmid, True)

    def _bed_lxc_status(self, vmid, running):
        path = os.path.join(self.bed_dir(vmid), 'status')
        with open(path + '.tmp', 'w', encoding='utf-8') as fh:
            fh.write('running\n' if running else 'stopped\n')
        os.replace(path + '.tmp', path)

    def bed_lxc_sync(self, ct, running):
        """Keep a real container in step with PVE: stopped through LXC when PVE stopped it;
        started (waiting for RUNNING) when PVE says it runs and no start task started it; and a
        container whose monitor ended by itself (a poweroff inside) is stopped for PVE too, as
        pvestatd would see it."""
        vmid = int(ct.vmid)
        rec = (self.bed_lxc or {}).get(vmid)
        if rec is not None and rec.get('starting'):
            return
        if not running:
            if rec is not None:
                self.bed_lxc_stop(vmid)
            return
        if rec is None:
            proc = self._bed_lxc_prepare(ct)
            ok = subprocess.run(['lxc-wait', '-P', self.guest_bed['lxc_path'], '-n', str(vmid), '-s', 'RUNNING',
                                 '-t', '30'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
            if not ok or proc.poll() is not None:
                self._bed_lxc_failed(vmid, proc)
                ct.status = 'stopped'
                ct.pid = None
                return
            self._bed_lxc_status(vmid, True)
        elif rec['proc'].poll() is not None:
            del self.bed_lxc[vmid]
            self._bed_lxc_status(vmid, False)
            ct.status = 'stopped'
            ct.pid = None

    def bed_lxc_stop(self, vmid):
        """Stop a real container as PVE's vm_stop does without a timeout (`lxc-stop -n <vmid>
        --kill`), and wait for its monitor to end."""
        rec = (self.bed_lxc or {}).pop(int(vmid), None)
        subprocess.run(['lxc-stop', '-P', self.guest_bed['lxc_path'], '-n', str(vmid), '--kill'],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        if rec is not None:
            try:
                rec['proc'].wait(timeout=20)
            except subprocess.TimeoutExpired:
                rec['proc'].kill()
                rec['proc'].wait(timeout=5)
        try:
            self._bed_lxc_status(int(vmid), False)
        except OSError:
            pass

    def bed_lxc_teardown(self):
        """Stop every real container and remove every bridge this bed made (the fake ends)."""
        if not self.bed_real():
            return
        for vmid in list(self.bed_lxc or {}):
            try:
                self.bed_lxc_stop(vmid)
            except Exception:  # noqa: BLE001 - the rest must go too
                log.warning('stopping real container %s failed', vmid, exc_info=True)
        for name in list((self.bed_bridges or {}).values()):
            subprocess.run(['ip', 'link', 'del', name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.bed_bridges = {}
        # The bed's cgroup folders LXC leaves (the parents of its containers' cgroups).
        top = os.path.join('felhom-bed', self.guest_bed['real_lxc']['net_prefix'])
        for hier in glob.glob('/sys/fs/cgroup/*/') + ['/sys/fs/cgroup/']:
            base = os.path.join(hier, top)
            for root, dirs, _ in sorted(os.walk(base), key=lambda x: -len(x[0])):
                try:
                    os.rmdir(root)
                except OSError:
                    pass

    # ------------------------------------------------ the guest agent of a bed VM

    async def _agent_call(self, match, values):
        # qemu-server src/PVE/QemuServer/Agent.pm assert_agent_available (guest-exec-facts.md
        # §3.1), in this order, all HTTP 500: "No QEMU guest agent configured" (no `agent: 1`),
        # "VM <vmid> is not running", "QEMU guest agent is not running" (a guest-ping with a 3 s
        # timeout failed). fakepve 0.5.0 answers all three with the last one.
        vm = self.find(values['node'], values['vmid'])
        command = match.template.rsplit('/', 1)[1]
        if not agent_configured(vm.config):
            raise fake_model.PveError(500, 'No QEMU guest agent configured')
        if vm.status != 'running':
            raise fake_model.PveError(500, 'VM {0} is not running'.format(vm.vmid))
        spec = (self.bed_owned or {}).get(int(vm.vmid))
        if spec is None or spec['kind'] != 'qemu':
            return await super()._agent_call(match, values)
        if spec.get('real'):
            fake_agent.record(vm, command, values)
            return await self.real_agent_call(vm, command, values)
        booted = (time.time() - (vm.started_at or time.time())) >= float(spec.get('boot_secs', 0)) * self.time_scale
        if not spec.get('agent', True) or not booted:
            await self.pause(3)
            raise fake_model.PveError(500, 'QEMU guest agent is not running')
        fake_agent.record(vm, command, values)
        if command == 'exec':
            return await self.bed_exec(vm, values)
        if command == 'exec-status':
            return self.bed_exec_status(vm, values)
        if command == 'file-write':
            return await self.bed_file_write(vm, values)
        if command == 'file-read':
            return await self.bed_file_read(vm, values)
        if command == 'ping':
            return {'result': {}}
        return fake_agent.result(vm, command, values)

    async def bed_exec(self, vm, values):
        # PVE agent/exec (guest-exec-facts.md §3.3): `command` is the argv (program first, PATH
        # search, no shell); `input-data` (at most 65536 characters, checked by the schema) is
        # written to stdin, which is /dev/null without it. A program that cannot be spawned gets
        # no pid: "Agent error: Guest agent command failed, error was '<glib message>'".
        argv = values.get('command')
        if isinstance(argv, str):
            argv = [argv]
        argv = [str(a) for a in (argv or [])]
        data = values.get('input-data')
        if not argv and data is None:
            raise fake_model.PveError(500, 'command or input-data (or both) required')
        if not argv:
            raise fake_model.PveError(500, "Agent error: Invalid parameter 'path'")
        found, _, _ = await self.bed_run(vm.vmid, ['/bin/sh', '-c', 'command -v -- "$1" >/dev/null', 'which',
                                                   argv[0]])
        if found != 0:
            raise fake_model.PveError(500, "Agent error: Guest agent command failed, error was 'Failed to execute "
                                      "child process \"{0}\" (No such file or directory)'".format(argv[0]))
        stdin = None if data is None else str(data).encode('utf-8')
        proc = await self.bed_spawn(vm.vmid, argv, stdin)
        self._bed_pid += 1
        pid = self._bed_pid
        rec = {'proc': proc, 'done': False, 'out': bytearray(), 'err': bytearray(),
               'out_cut': False, 'err_cut': False}

        async def drain(stream, key):
            while True:
                chunk = await stream.read(65536)
                if not chunk:
                    return
                room = QGA_MAX_OUTPUT - len(rec[key])
                if len(chunk) > room:
                    rec[key + '_cut'] = True
                rec[key] += chunk[:max(room, 0)]

        async def feed():
            if stdin is None:
                return
            try:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                proc.stdin.close()

        async def run():
            await asyncio.gather(feed(), drain(proc.stdout, 'out'), drain(proc.stderr, 'err'))
            await proc.wait()
            rec['done'] = True
        rec['task'] = asyncio.ensure_future(run())
        self.bed_execs.setdefault(vm.vmid, {})[pid] = rec
        return {'pid': pid}

    def bed_exec_status(self, vm, values):
        # PVE agent/exec-status (guest-exec-facts.md §3.4): {"exited": 0} while the command runs
        # or a pipe is open; then, once only (qemu-ga forgets the pid), `exited` 1 with `exitcode`
        # or `signal`, `out-data`/`err-data` when the stream had output (PVE has base64-decoded it
        # and its JSON encoder writes each byte as one character), `out-truncated`/`err-truncated`
        # 1 past 16 MiB per stream. Asking again: "Agent error: Invalid parameter 'pid'".
        try:
            pid = int(values.get('pid'))
        except (TypeError, ValueError):
            pid = None
        rec = self.bed_execs.get(vm.vmid, {}).get(pid)
        if rec is None:
            raise fake_model.PveError(500, "Agent error: Invalid parameter 'pid'")
        if not rec['done']:
            return {'exited': 0}
        del self.bed_execs[vm.vmid][pid]
        out = {'exited': 1}
        code = rec['proc'].returncode
        if code < 0:
            out['signal'] = -code
        else:
            out['exitcode'] = code
        for key, name in (('out', 'out'), ('err', 'err')):
            if rec[key]:
                out[name + '-data'] = bytes(rec[key]).decode('latin-1')
                if rec[key + '_cut']:
                    out[name + '-truncated'] = 1
        return out

    async def bed_file_write(self, vm, values):
        # PVE agent/file-write (guest-exec-facts.md §3.5): `content` (at most 61440 characters,
        # checked by the schema), base64-encoded by PVE unless encode=0 (then it already is);
        # the file is opened "wb" (created or truncated), written once; answers null.
        content = str(values.get('content', ''))
        encode = str(values.get('encode', '1')) not in ('0', 'false')
        try:
            data = content.encode('utf-8') if encode else base64.b64decode(content, validate=True)
        except ValueError:
            raise fake_model.PveError(500, 'Agent error: Guest agent command failed, error was \'invalid base64\'')
        path = str(values.get('file', ''))
        code, _, err = await self.bed_run(vm.vmid, ['/bin/sh', '-c', 'cat > "$1"', 'file-write', path], data)
        if code != 0:
            raise fake_model.PveError(500, "Agent error: failed to open file '{0}' (mode: 'wb'): {1}".format(
                path, os_error_text(err)))
        return None

    async def bed_file_read(self, vm, values):
        # PVE agent/file-read: {"content", "bytes-read"[, "truncated": 1]}, at most 16 MiB.
        path = str(values.get('file', ''))
        code, out, err = await self.bed_run(vm.vmid, ['/bin/sh', '-c', 'cat < "$1"', 'file-read', path])
        if code != 0:
            raise fake_model.PveError(500, "Agent error: failed to open file '{0}' (mode: 'r'): {1}".format(
                path, os_error_text(err)))
        answer = {'content': out[:QGA_MAX_OUTPUT].decode('latin-1'), 'bytes-read': min(len(out), QGA_MAX_OUTPUT)}
        if len(out) > QGA_MAX_OUTPUT:
            answer['truncated'] = 1
        return answer

    # ------------------------------------------------ real VMs (guest_bed.real_qemu)

    # guest_bed['real_qemu'] = {"image": the folder tests/testbed/build-debian-vm.sh prints
    # (disk.raw, vmlinux, initrd.img), "osqueryi": the stand-in laid into each VM}.
    # vmid -> {"proc": its QEMU, "socket": its guest-agent socket, "lock": one QGA client at a time}.
    bed_qemu = None
    _qga_seq = 0
    # QEMU's NIC models for PVE's (qemu-server src/PVE/QemuServer.pm print_netdevice_full: the
    # model is the device, virtio as virtio-net-pci).
    QEMU_NIC_MODELS = {'virtio': 'virtio-net-pci', 'e1000': 'e1000', 'e1000e': 'e1000e', 'rtl8139': 'rtl8139',
                       'vmxnet3': 'vmxnet3'}
    # The largest QGA answer read: exec-status with both streams at 16 MiB, base64 (4/3), and room.
    QGA_MAX_ANSWER = 48 * 1024 * 1024
    # The guest's kernel command line (direct kernel boot: no boot loader reads the disk's).
    # No PS/2 mouse port (i8042.noaux): its probe costs seconds of the kernel's start under TCG.
    # No self-test of each crypto algorithm the kernel registers (cryptomgr.notests; Debian's
    # kernel runs them): about 0.6 s of its start under TCG, measured with systemd-analyze.
    QEMU_CMDLINE = 'root=/dev/vda rw console=ttyS0 quiet mitigations=off i8042.noaux cryptomgr.notests'

    @staticmethod
    def _newc(entries):
        """A cpio archive in the kernel's initramfs format (newc): entries of (name, mode, bytes),
        a folder with mode 0o40755, a symbolic link 0o120777 with its target as the bytes."""
        out = bytearray()

        def pad():
            out.extend(b'\0' * (-len(out) % 4))
        for ino, (name, mode, data) in enumerate(list(entries) + [('TRAILER!!!', 0, b'')], start=1):
            raw = name.encode('utf-8') + b'\0'
            fields = (ino, mode, 0, 0, 2 if mode & 0o40000 else 1, 0, len(data), 0, 0, 0, 0, len(raw), 0)
            out.extend(b'070701' + ''.join('{0:08X}'.format(f) for f in fields).encode('ascii') + raw)
            pad()
            out.extend(data)
            pad()
        return bytes(out)

    async def bed_qemu_create(self, guest, spec):
        """A restored VM of the real bed: a qcow2 overlay of the bed's Debian 12 disk (its disks,
        restored), and the initramfs QEMU boots it with: the image's own, followed by an archive
        of the files this VM's disk holds beyond the image (the image's initramfs lays them
        onto the root before systemd starts): the osqueryi stand-in where osquery's package puts
        it, and `spec["files"]` ({guest path: text}) / `spec["links"]` ({guest path: target}),
        e.g. its /etc/hostname and /etc/network/interfaces. PVE writes nothing into a VM: a VM
        keeps the image's hostname (`debian-vm`) unless its files say otherwise."""
        real = self.guest_bed['real_qemu']
        vmid = int(guest.vmid)
        d = self.bed_dir(vmid)
        self.bed_qemu_stop(vmid)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        proc = await asyncio.create_subprocess_exec(
            'qemu-img', 'create', '-q', '-f', 'qcow2', '-b', os.path.join(os.path.abspath(real['image']), 'disk.raw'),
            '-F', 'raw', os.path.join(d, 'disk.qcow2'), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise ValueError('qemu-img create failed: {0}'.format(err.decode('utf-8', 'replace').strip()))
        with open(real['osqueryi'], 'rb') as fh:
            standin = fh.read()
        files = {'/opt/osquery/bin/osqueryd': (0o100755, standin),
                 '/usr/bin/osqueryi': (0o120777, b'/opt/osquery/bin/osqueryd'),
                 '/usr/bin/osqueryd': (0o120777, b'/opt/osquery/bin/osqueryd')}
        for path, text in sorted((spec.get('files') or {}).items()):
            text = str(text)
            files[str(path)] = (0o100755 if text.startswith('#!') else 0o100644, text.encode('utf-8'))
        for path, target in sorted((spec.get('links') or {}).items()):
            files[str(path)] = (0o120777, str(target).encode('utf-8'))
        entries, folders = [], {'felhom-bed-files'}
        entries.append(('felhom-bed-files', 0o40755, b''))
        for path, (mode, data) in sorted(files.items()):
            parts = [x for x in path.split('/') if x]
            if not parts or '..' in parts:
                raise ValueError('guest file {0!r} is not a plain absolute path'.format(path))
            for i in range(1, len(parts)):
                folder = '/'.join(['felhom-bed-files'] + parts[:i])
                if folder not in folders:
                    folders.add(folder)
                    entries.append((folder, 0o40755, b''))
            entries.append(('/'.join(['felhom-bed-files'] + parts), mode, data))
        with open(os.path.join(real['image'], 'initrd.img'), 'rb') as fh:
            initrd = fh.read()
        initrd += b'\0' * (-len(initrd) % 4)
        with open(os.path.join(d, 'initrd.img'), 'wb') as fh:
            fh.write(initrd + self._newc(entries))
        for fname, text in (('kind', 'qemu\n'), ('real', 'qemu\n')):
            with open(os.path.join(d, fname), 'w', encoding='utf-8') as fh:
                fh.write(text)
        spec['kind'] = 'qemu'
        spec['real'] = True
        self.bed_owned[vmid] = spec
        self.bed_sync()

    def bed_qemu_argv(self, vm, spec):
        """QEMU's command line for a VM of the real bed, as qemu-server's config_to_command makes
        what matters here (src/PVE/QemuServer.pm; PCI slots from src/PVE/QemuServer/PCI.pm):
        `-nodefaults`; the guest-agent channel only with `agent` enabled (a unix socket chardev
        `server=on,wait=off` id qga0, `virtio-serial` at slot 8, a `virtserialport` named
        org.qemu.guest_agent.0); one NIC per `netN` with its model and MAC at slot 18 + N
        (net0..net5), so a Debian guest names net0 `ens18`, and no NIC device without a `netN`.
        Where the bed differs from a node: TCG on one vCPU (KVM does not run guests on this kind
        of machine), at most 1024 MB, the disk a virtio-blk /dev/vda with direct kernel boot, a
        NIC's network QEMU's user networking with `restrict=on` (it answers DHCP and routes
        nothing; a node's tap on a bridge is the operator's network), or, on a bridge with no
        ports and no node address (`lab_bridges`), an isolated QEMU hub (`-netdev hubport`: no
        other port, no DHCP, nothing reached), and `agent` false in the
        guest spec masks qemu-guest-agent.service inside (the guest runs no agent)."""
        d = self.bed_dir(int(vm.vmid))
        image = self.guest_bed['real_qemu']['image']
        conf = vm.config
        try:
            memory = int(str(conf.get('memory', '512')).split(',')[0].split('=')[-1])
        except ValueError:
            memory = 512
        cmdline = self.QEMU_CMDLINE
        if spec.get('agent', True) is False:
            cmdline += ' systemd.mask=qemu-guest-agent.service'
        argv = ['qemu-system-x86_64', '-name', 'felhom-bed-vm-{0},debug-threads=off'.format(vm.vmid),
                '-accel', 'tcg', '-cpu', 'qemu64,-svm', '-smp', '1', '-m', str(max(256, min(memory, 1024))),
                '-nodefaults', '-no-user-config', '-display', 'none',
                '-kernel', os.path.join(image, 'vmlinux'), '-initrd', os.path.join(d, 'initrd.img'),
                '-append', cmdline,
                '-drive', 'file={0},if=none,id=drive-disk0,format=qcow2'.format(os.path.join(d, 'disk.qcow2')),
                '-device', 'virtio-blk-pci,drive=drive-disk0,bus=pci.0,addr=0xa',
                '-serial', 'file:' + os.path.join(d, 'serial.log')]
        if agent_configured(conf):
            argv += ['-chardev', 'socket,path={0},server=on,wait=off,id=qga0'.format(os.path.join(d, 'qga.sock')),
                     '-device', 'virtio-serial,id=qga0,bus=pci.0,addr=0x8',
                     '-device', 'virtserialport,chardev=qga0,name=org.qemu.guest_agent.0']
        for key in sorted(conf, key=fake_qemu.natural):
            found = re.fullmatch(r'net(\d+)', key)
            if not found:
                continue
            n = int(found.group(1))
            first, props = fake_lxc.split_props(str(conf[key]))
            model, mac = None, None
            for part in str(conf[key]).split(','):
                k, _, v = part.partition('=')
                if k in self.QEMU_NIC_MODELS:
                    model, mac = k, v
            if model is None:
                model = props.get('model')
                mac = props.get('macaddr')
            if model not in self.QEMU_NIC_MODELS or n > 5:
                raise fake_model.TaskError('the test bed runs no NIC {0}: {1}'.format(key, conf[key]))
            device = '{0},netdev={1},id={1},bus=pci.0,addr={2}'.format(self.QEMU_NIC_MODELS[model], key, hex(18 + n))
            if mac:
                device += ',mac=' + mac
            bridge = props.get('bridge')
            labs = sorted(self.lab_bridges())
            if bridge in labs and os.path.isdir('/sys/class/net/{0}/bridge'.format(bridge)):
                # A lab bridge the test made in the kernel: a tap on it, as on a node
                # (print_netdev_full's `ifname=tap<vmid>i<N>`; pve-bridge's tap_plug puts it on
                # the bridge once QEMU made it: bed_qemu_plug).
                argv += ['-netdev', 'tap,id={0},ifname=tap{1}i{2},script=no,downscript=no'.format(key, vm.vmid, n),
                         '-device', device]
            elif bridge in labs:
                # A bridge with no ports and no node address: a QEMU hub of its own (one per
                # bridge, shared by this VM's NICs on it), with no other port, so a frame reaches
                # nothing and nothing answers DHCP, as on such a bridge of a node.
                argv += ['-netdev', 'hubport,id={0},hubid={1}'.format(key, 10 + labs.index(bridge)),
                         '-device', device]
            else:
                argv += ['-netdev', 'user,id={0},restrict=on'.format(key), '-device', device]
        return argv

    def bed_qemu_sync(self, vm, running):
        """Keep a real VM's QEMU in step with PVE's state: started when PVE says running (a
        node's start task ends once QEMU runs, long before the guest has booted), killed when
        stopped; a QEMU that ended by itself (the guest powered off) is stopped for PVE too."""
        vmid = int(vm.vmid)
        rec = self.bed_qemu.get(vmid)
        if not running:
            if rec is not None:
                self.bed_qemu_stop(vmid)
            return
        if rec is not None:
            if rec['proc'].poll() is not None:
                log.warning('the QEMU of VM %s ended by itself (exit %s)', vmid, rec['proc'].returncode)
                self.bed_qemu_stop(vmid)
                vm.status = 'stopped'
            return
        d = self.bed_dir(vmid)
        sock = os.path.join(d, 'qga.sock')
        try:
            os.unlink(sock)
        except FileNotFoundError:
            pass
        argv = self.bed_qemu_argv(vm, self.bed_owned[vmid])
        with open(os.path.join(d, 'qemu.log'), 'ab') as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        # Its vCPU gets a core's worth of time however busy the machine is: QEMU runs in a
        # session of its own, so the kernel schedules it as its own autogroup, whose weight is
        # raised (nice -10, /proc/<pid>/autogroup; root only). With KVM a node's VM runs at
        # near-native speed; under TCG on a machine whose two cores serve other builds and tests
        # the same boot took more than a minute (about 22 s of processor time).
        try:
            with open('/proc/{0}/autogroup'.format(proc.pid), 'w', encoding='ascii') as fh:
                fh.write('-10')
        except OSError:
            log.info('VM %s: the QEMU autogroup keeps its weight', vmid)
        self.bed_qemu_plug(vm, argv, proc)
        self.bed_qemu[vmid] = {'proc': proc, 'socket': sock, 'lock': asyncio.Lock(), 'started': time.time()}
        # With the network backend of each NIC QEMU got (`-netdev` values): what a test reads to
        # know, from the host side, where a VM's NICs were.
        netdevs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == '-netdev']
        self._qga_log(vmid, {'event': 'qemu-start', 'pid': proc.pid, 'netdevs': netdevs})
        log.info('VM %s: QEMU %s started', vmid, proc.pid)

    def bed_qemu_plug(self, vm, argv, proc):
        """Put each tap QEMU made onto its lab bridge, as pve-bridge does (pve-common
        src/PVE/Network.pm `tap_create`: IPv6 off on the tap, `tap_plug`: `ip link set <tap>
        master <bridge>`, up). QEMU makes the tap at its start (`-netdev tap`, script=no), so it
        is waited for (5 s at most); the tap goes with QEMU."""
        for i, a in enumerate(argv[:-1]):
            if a != '-netdev' or not argv[i + 1].startswith('tap,'):
                continue
            opts = dict(p.partition('=')[::2] for p in argv[i + 1].split(',')[1:])
            tap = opts['ifname']
            n = int(tap.rsplit('i', 1)[1])
            conf = fake_lxc.split_props(str(vm.config['net{0}'.format(n)]))[1].get('bridge')
            deadline = time.time() + 5
            while not os.path.exists('/sys/class/net/' + tap) and time.time() < deadline and proc.poll() is None:
                time.sleep(0.02)
            try:
                with open('/proc/sys/net/ipv6/conf/{0}/disable_ipv6'.format(tap), 'w', encoding='ascii') as fh:
                    fh.write('1')
                subprocess.run(['ip', 'link', 'set', tap, 'master', conf], check=True, capture_output=True)
                subprocess.run(['ip', 'link', 'set', tap, 'up'], check=True, capture_output=True)
            except (OSError, subprocess.CalledProcessError) as e:
                log.warning('VM %s: tap %s not put on bridge %s: %s', vm.vmid, tap, conf, e)

    def bed_qemu_stop(self, vmid):
        """Power a real VM off: its QEMU ends (SIGTERM, then SIGKILL), and its guest-agent socket
        goes with it; its disk (the overlay) stays until the VM is destroyed."""
        rec = (self.bed_qemu or {}).pop(int(vmid), None)
        if rec is None:
            return
        proc = rec['proc']
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        try:
            os.unlink(rec['socket'])
        except FileNotFoundError:
            pass

    def _qga_log(self, vmid, entry):
        """One line per QGA command forwarded to a real VM's guest agent, and per QEMU start
        (<state>/<vmid>.qga.log, beside the VM's folder: it outlives a destroy): what the tests
        count at the source."""
        entry = dict(entry, t=round(time.time(), 3))
        try:
            with open(self.bed_dir(vmid) + '.qga.log', 'a', encoding='utf-8') as fh:
                fh.write(json.dumps(entry, sort_keys=True) + '\n')
        except OSError:
            pass

    async def qga(self, vmid, execute, arguments=None, timeout=5):
        """One QGA command to a real VM's guest agent, as qemu-server's QMPClient sends it
        (src/PVE/QMPClient.pm): a new connection to the VM's qga socket, `guest-sync-delimited`
        with a fresh id and the command written together, the answer taken after the last 0xFF
        as two lines (the sync's `{"return": id}`, then the command's), answers to older ids
        skipped, one timeout for the whole exchange (5 s unless given; guest-ping 3 s from
        qga_check_running). Answers `return`, or `{"error": …}` as QMPClient's callback does; a
        transport failure raises "VM <vmid> qga command '<cmd>' failed - <reason>". QEMU's
        chardev takes one client at a time: callers are serialised per VM."""
        name = 'VM {0}'.format(vmid)
        rec = (self.bed_qemu or {}).get(int(vmid))
        if rec is None or rec['proc'].poll() is not None:
            raise fake_model.PveError(500, '{0} not running'.format(name))
        if not os.path.exists(rec['socket']):
            raise fake_model.PveError(500, 'unable to open monitor socket')
        failed = "{0} qga command '{1}' failed - ".format(name, execute)
        async with rec['lock']:
            self._qga_seq += 1
            cid = int('{0}0{1}'.format(os.getpid(), self._qga_seq))
            started = time.monotonic()
            entry = {'execute': execute, 'arguments': arguments or {}}
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(rec['socket']), timeout)
            except asyncio.TimeoutError:
                self._qga_log(vmid, dict(entry, error='connect timeout'))
                raise fake_model.PveError(500, failed + 'unable to connect to {0} qga socket - timeout'.format(name))
            except OSError as e:
                self._qga_log(vmid, dict(entry, error=str(e)))
                raise fake_model.PveError(500, failed + 'unable to connect to {0} qga socket - {1}'.format(
                    name, e.strerror or e))
            try:
                writer.write((json.dumps({'execute': 'guest-sync-delimited', 'arguments': {'id': cid}}) + '\n' +
                              json.dumps({'execute': execute, 'arguments': arguments or {}}) + '\n').encode('utf-8'))
                buf = b''
                while True:
                    left = timeout - (time.monotonic() - started)
                    if left <= 0:
                        raise asyncio.TimeoutError()
                    chunk = await asyncio.wait_for(reader.read(1 << 20), left)
                    if not chunk:
                        raise ConnectionError('the guest agent\'s socket closed')
                    buf += chunk
                    if len(buf) > self.QGA_MAX_ANSWER:
                        raise ConnectionError('an answer of more than {0} bytes'.format(self.QGA_MAX_ANSWER))
                    if b'\n' not in chunk:
                        continue
                    found = re.match(rb'^.*\xff([^\n]+}\r?\n[^\n]+})\r?\n(.*)$', buf, re.S)
                    if not found:
                        continue
                    sync_line, answer_line = found.group(1).split(b'\n', 1)
                    got = json.loads(sync_line).get('return')
                    if not isinstance(got, int):
                        raise ConnectionError('received response without command id')
                    if got < cid:
                        buf = found.group(2)
                        continue
                    if got != cid:
                        raise ConnectionError("got wrong command id '{0}' (expected {1})".format(got, cid))
                    answer = json.loads(answer_line)
                    break
            except asyncio.TimeoutError:
                self._qga_log(vmid, dict(entry, error='got timeout', secs=round(time.monotonic() - started, 2)))
                raise fake_model.PveError(500, failed + 'got timeout')
            except (ConnectionError, OSError, ValueError) as e:
                self._qga_log(vmid, dict(entry, error=str(e)))
                raise fake_model.PveError(500, failed + str(e))
            finally:
                writer.close()
        if 'return' in answer:
            result = answer['return']
        else:
            result = {'error': answer.get('error')}
        self._qga_log(vmid, dict(entry, answer=result if execute != 'guest-exec-status' else
                                 dict((k, v) for k, v in result.items() if not k.endswith('-data'))
                                 if isinstance(result, dict) else result,
                                 secs=round(time.monotonic() - started, 2)))
        return result

    async def _real_agent_cmd(self, vmid, command, arguments, errmsg):
        """qemu-server src/PVE/QemuServer/Agent.pm agent_cmd (after assert_agent_available):
        the command, then check_agent_error: an error object dies "Agent error: <desc>", no
        result at all "Agent error: <errmsg>"."""
        await self._real_agent_available(vmid)
        res = await self.qga(vmid, 'guest-' + command, arguments)
        if isinstance(res, dict) and isinstance(res.get('error'), dict) and res['error'].get('desc'):
            raise fake_model.PveError(500, 'Agent error: {0}'.format(res['error']['desc']))
        if res is None:
            raise fake_model.PveError(500, 'Agent error: {0}'.format(errmsg))
        return res

    async def _real_agent_available(self, vmid):
        # Agent.pm assert_agent_available, its last step: qga_check_running, a guest-ping with a
        # 3 s timeout; any failure is "QEMU guest agent is not running".
        try:
            await self.qga(vmid, 'guest-ping', timeout=3)
        except fake_model.PveError:
            raise fake_model.PveError(500, 'QEMU guest agent is not running')

    async def real_agent_call(self, vm, command, values):
        """The agent endpoints of a real VM, as qemu-server's src/PVE/API2/Qemu/Agent.pm serves
        them over the VM's real guest agent (tests/data/real-vm-facts.md)."""
        vmid = int(vm.vmid)
        if command == 'exec':
            # Agent.pm qemu_exec: path = the first element, arg = the rest, capture-output,
            # input-data base64-encoded; neither: "command or input-data (or both) required".
            argv = values.get('command')
            if isinstance(argv, str):
                argv = [argv]
            argv = [str(a) for a in (argv or [])]
            data = values.get('input-data')
            args = {'capture-output': True}
            if argv:
                args['path'] = argv[0]
                args['arg'] = argv[1:]
            if data is not None:
                args['input-data'] = base64.b64encode(str(data).encode('utf-8')).decode('ascii')
            if 'path' not in args and 'input-data' not in args:
                raise fake_model.PveError(500, 'command or input-data (or both) required')
            errmsg = "can't execute command"
            if argv:
                errmsg += ' ({0} {1})'.format(argv[0], argv[1:])
            if data is not None:
                errmsg += ' (input-data given)'
            return await self._real_agent_cmd(vmid, 'exec', args, errmsg)
        if command == 'exec-status':
            # Agent.pm qemu_exec_status: out-data/err-data base64-decoded (the bytes, which PVE's
            # JSON encoder writes one character each), JSON booleans as 1/0.
            try:
                pid = int(values.get('pid'))
            except (TypeError, ValueError):
                raise fake_model.PveError(400, "Parameter verification failed. pid: type check ('integer') failed")
            res = await self._real_agent_cmd(vmid, 'exec-status', {'pid': pid},
                                             "can't get exec status for '{0}'".format(pid))
            res = dict(res)
            for key in ('out-data', 'err-data'):
                if res.get(key):
                    try:
                        res[key] = base64.b64decode(res[key]).decode('latin-1')
                    except ValueError:
                        pass
            for key, value in list(res.items()):
                if isinstance(value, bool):
                    res[key] = 1 if value else 0
            return res
        if command == 'file-write':
            # Agent.pm file-write: file-open (mode wb), file-write (buf-b64), file-close, each
            # through agent_cmd; answers null.
            content = str(values.get('content', ''))
            encode = str(values.get('encode', '1')) not in ('0', 'false')
            buf = base64.b64encode(content.encode('latin-1', 'replace')).decode('ascii') if encode else content
            handle = await self._real_agent_cmd(vmid, 'file-open', {'path': str(values.get('file', '')), 'mode': 'wb'},
                                                "can't open file")
            await self._real_agent_cmd(vmid, 'file-write', {'handle': handle, 'buf-b64': buf}, "can't write to file")
            await self._real_agent_cmd(vmid, 'file-close', {'handle': handle}, "can't close file")
            return None
        if command == 'file-read':
            # Agent.pm file-read: file-open, guest-file-read in 1 MiB chunks up to `count`
            # (default 16 MiB), file-close; {"content", "bytes-read"[, "truncated": 1]}.
            count = int(values.get('count') or QGA_MAX_OUTPUT)
            handle = await self._real_agent_cmd(vmid, 'file-open', {'path': str(values.get('file', ''))},
                                                "can't open file")
            content, done, eof = bytearray(), 0, False
            while done < count and not eof:
                read = await self.qga(vmid, 'guest-file-read', {'handle': handle,
                                                                 'count': min(count - done, 1024 * 1024)})
                if isinstance(read, dict) and read.get('error'):
                    raise fake_model.PveError(500, 'Agent error: {0}'.format(read['error'].get('desc')))
                content += base64.b64decode(read.get('buf-b64', ''))
                done += int(read.get('count', 0))
                eof = bool(read.get('eof'))
            await self.qga(vmid, 'guest-file-close', {'handle': handle})
            answer = {'content': bytes(content).decode('latin-1'), 'bytes-read': done}
            if not eof:
                answer['truncated'] = 1
            return answer
        # The simple commands (ping, info, get-osinfo, get-host-name, …): assert_agent_available,
        # then mon_cmd "guest-<command>" with no error check: {"result": <QGA return or its error
        # object>}.
        await self._real_agent_available(vmid)
        return {'result': await self.qga(vmid, 'guest-' + command)}

    # Every guest DELETE the agent sends must free only what the guest's config references:
    # `destroy-unreferenced-disks=1` frees every volume of the vmid on every storage (orphans of
    # an earlier holder of the vmid; on shared storage another cluster's disk) and `purge=1`
    # edits backup, replication and HA jobs (pve-api-facts §7). PVE would obey either; the bed
    # records each such request so that every test can fail on it (tests/src/fakepve.rs checks
    # the list when the fake is dropped).
    destroy_violations = ()

    def _check_destroy(self, request):
        if request.method != 'DELETE' or not GUEST_PATH.match(request.path):
            return
        query = dict(p.split('=', 1) if '=' in p else (p, '') for p in request.query_string.split('&') if p)
        bad = [k for k in ('destroy-unreferenced-disks', 'purge') if query.get(k, '0') not in ('0', '')]
        missing = [k for k in ('destroy-unreferenced-disks', 'purge') if k not in query]
        if bad or missing:
            self.destroy_violations = tuple(self.destroy_violations) + (
                '{0} {1}?{2}: {3}'.format(request.method, request.path, request.query_string,
                                          ', '.join(['{0} set'.format(k) for k in bad]
                                                    + ['{0} not said (0)'.format(k) for k in missing])),)

    def violations(self):
        """The guest DELETEs that asked PVE to free more than the guest's config references."""
        return list(self.destroy_violations)

    # PVE mounts a storage's content with fragmentDelimiter '' (pve-storage
    # `src/PVE/API2/Storage/Status.pm`; pve-common `RESTHandler.pm` `map_path_to_methods` joins
    # the rest of the URI into one fragment): the {volume} of
    # `/nodes/{node}/storage/{storage}/content/{volume}` is everything after `content/`,
    # slashes included (a volid such as `local:backup/vzdump-…`, percent-encoded or not).
    # fakepve splits it into segments and finds no path; resolve it as PVE does.
    _CONTENT_REST = re.compile(r'^(/nodes/[^/]+/storage/[^/]+/content)/(.+)$')

    def resolve(self, request, prefix):
        raw = request.rel_url.raw_path
        if raw.startswith(prefix + '/'):
            found = self._CONTENT_REST.match(raw[len(prefix):])
            if found:
                base = '/'.join(urllib.parse.unquote(seg) for seg in found.group(1).split('/'))
                match = fake_schema.load().match(base + '/volume')
                if match is not None:
                    match.params = dict(match.params, volume=urllib.parse.unquote(found.group(2)))
                return match
        return super().resolve(request, prefix)

    # Every request under /api2/json is checked against PVE's API schema as fakepve ships it
    # (fakepve/data/pve-api.json.gz, PVE's apidoc): the path and the method exist, and every
    # parameter (query, form or JSON body, path) is known, of its type and format, within its
    # lengths and range, with every required one given: what PVE's RESTHandler checks before
    # a handler runs (a 400 "Parameter verification failed."). A request the schema rejects is
    # recorded with the parameter names and PVE's reasons (never a value), and
    # tests/src/fakepve.rs fails the test that sent it when the fake is dropped.
    schema_violations = ()

    _skip_schema = False

    def _check_schema(self, request, body):
        api = fake_server.API
        if self._skip_schema or (request.path != api and not request.path.startswith(api + '/')):
            return
        # A body that was never read (refused at authentication, too large, too slow): PVE
        # checked no parameter of it either.
        if not body and (request.content_length or 0) > 0:
            return
        match = self.resolve(request, api)
        problems = []
        if match is None:
            problems.append("no such path in PVE's API schema")
        else:
            info = (match.methods or {}).get(request.method)
            if info is None:
                problems.append("PVE's API schema has no {0} on {1}".format(request.method, match.template))
            else:
                values = fake_server.collect(request.query.items())
                try:
                    if body and request.content_type == 'application/json':
                        data = json.loads(body)
                        if isinstance(data, dict):
                            values.update(data)
                    elif body:
                        values.update(fake_server.collect(urllib.parse.parse_qsl(
                            body.decode('utf-8', 'replace'), keep_blank_values=True)))
                except ValueError:
                    problems.append('the body is not readable')
                values.update(match.params)
                _, errors = fake_schema.validate(info.get('parameters'), values)
                problems.extend('{0}: {1}'.format(k, self._without_value(v, values.get(k)))
                                for k, v in sorted(errors.items()))
        if problems:
            self.schema_violations = tuple(self.schema_violations) + (
                '{0} {1}: {2}'.format(request.method, request.path, '; '.join(problems)),)

    @staticmethod
    def _without_value(reason, value):
        """PVE's reason with the value sent left out (it may be a secret)."""
        reason = re.sub(r" - got .*$", ' - got (value not shown)', str(reason))
        for v in value if isinstance(value, list) else [value]:
            if v is not None and len(str(v)) >= 4:
                reason = reason.replace(str(v), '(value not shown)')
        return reason

    def schema_violation_list(self):
        """The requests PVE's API schema rejects, as recorded."""
        return list(self.schema_violations)

    def clear_schema_violations(self):
        """Forget the recorded schema violations (a test that sent one on purpose)."""
        self.schema_violations = ()

    def clear_violations(self):
        """Forget the recorded violations (a test that sent one on purpose)."""
        self.destroy_violations = ()

    # ---- task endpoints as pve-manager `PVE/API2/Tasks.pm` serves them

    @staticmethod
    def _status_type(status):
        # pve-common `src/PVE/UPID.pm` `normalize_status_type`.
        if not status or status == 'unexpected status':
            return 'unknown'
        if status == 'OK':
            return 'ok'
        if re.fullmatch(r'WARNINGS: \d+', status):
            return 'warning'
        return 'error'

    async def _task_list(self, request):
        """`GET /nodes/{node}/tasks` as pve-manager `PVE/API2/Tasks.pm` `node_tasks`: `source`
        (`archive`, the default: finished tasks only; `active`: running ones; `all`),
        `userfilter` (a case-insensitive substring of the task's user, the token part split
        off), `typefilter` (exact type), `vmid`, `since`/`until` (start time), `errors` and
        `statusfilter` (ok, warning, error, unknown), `start`/`limit` counted over the
        matching tasks, running ones first, then the archive newest first; `total` (every
        matching task) beside `data`. A token sees its own tasks, a user its own and its
        tokens', `Sys.Audit` on the node every task. Rows as PVE lists them: `user` without
        the token, `tokenid` beside it, a finished task's exit status in `status`."""
        node = request.match_info['node']
        user = request[fake_server.USER]
        p = self._verify(request, await fake_server.params(request))
        start = int(p.get('start', 0))
        remaining = [int(p.get('limit', 50))]
        userfilter = p.get('userfilter')
        typefilter = p.get('typefilter')
        errors = truthy(p.get('errors', 0))
        source = p.get('source', 'archive')
        since, until = p.get('since'), p.get('until')
        wanted = {'ok', 'warning', 'error', 'unknown'}
        if p.get('statusfilter') is not None and not errors:
            wanted = set(x.strip().lower() for x in re.split(r'[;, ]+', str(p['statusfilter'])) if x.strip())
        elif errors:
            wanted.discard('ok')
        auditor = self.allowed(user, '/nodes/' + node, 'Sys.Audit')
        count = [0]

        def skip(task, status):
            task_user = task['user'].split('!')[0]
            if userfilter and userfilter.lower() not in task_user.lower():
                return True
            if not (auditor or self._task_owner(user, task)):
                return True
            if typefilter and task['type'] != typefilter:
                return True
            if p.get('vmid') and task['id'] != str(p['vmid']):
                return True
            if since is not None and task['starttime'] < int(since):
                return True
            if until is not None and task['starttime'] > int(until):
                return True
            if self._status_type(status) not in wanted:
                return True
            count[0] += 1
            if count[0] <= start:
                return True
            return remaining[0] <= 0

        def row(task, status):
            data = dict((k, v) for k, v in task.items() if k not in ('log', 'exitstatus', 'status'))
            name, _, token = task['user'].partition('!')
            data['user'] = name
            if token:
                data['tokenid'] = token
            data['status'] = status
            return data

        mine = [t for t in self.tasklog if t['node'] == node]
        running = [t for t in mine if t.get('status') == 'running']
        finished = sorted((t for t in mine if t.get('status') != 'running'),
                          key=lambda t: (-(t.get('endtime') or t['starttime']), -t['starttime']))
        data = []
        if source in ('active', 'all'):
            for task in sorted(running, key=lambda t: -t['starttime']):
                if not skip(task, None):
                    data.append(row(task, 'RUNNING'))
                    remaining[0] -= 1
        if source != 'active':
            for task in finished:
                status = task.get('exitstatus')
                if not skip(task, status):
                    data.append(row(task, status))
                    remaining[0] -= 1
        return web.json_response({'data': data, 'total': count[0]})

    async def _task_log(self, request):
        """`GET /nodes/{node}/tasks/{upid}/log` as pve-manager `PVE/API2/Tasks.pm`
        `read_task_log` with pve-common `src/PVE/Tools.pm` `dump_logfile`: lines `{n, t}` from
        `start` (0-based), at most `limit` (50 by default; 0: to the end), and `total`, the
        number of lines of the whole log, beside `data`; an empty log is one line "no
        content"."""
        p = self._verify(request, await fake_server.params(request))
        lines = list(self._get_task(request)['log']) or ['no content']
        start, limit = int(p.get('start', 0)), int(p.get('limit', 50))
        numbered = [{'n': n + 1, 't': t} for n, t in enumerate(lines)]
        chosen = numbered[start:] if limit == 0 else numbered[start:start + limit]
        return web.json_response({'data': chosen, 'total': len(lines)})

    # The largest POST/PUT body accepted (`/set {"post_limit": 65536}`; None: fakepve's own
    # limit). pve-http-server `src/PVE/APIServer/AnyEvent.pm` `authenticate_and_handle_request`,
    # after authentication: a Content-Length over `$limit_max_post` (64 KiB until
    # libpve-http-server-perl 5.2.1, 512 KiB since) answers `501 for data too large`, the
    # reason phrase also being the plain-text body, and the handler never runs.
    post_limit = None

    @web.middleware
    async def _middleware(self, request, handler):
        limit = self.post_limit
        if limit and request.method in ('POST', 'PUT') and (request.content_length or 0) > int(limit):
            try:
                self._authenticate(request)
            except fake_model.PveError:
                return await super()._middleware(request, handler)
            # Refused before any parameter was read: nothing for the schema check.
            self._skip_schema = True
            try:
                self._record(request, b'')
            finally:
                self._skip_schema = False
            response = web.Response(status=501, reason='for data too large', text='for data too large')
            response.force_close()
            return response
        return await super()._middleware(request, handler)

    async def _answer(self, request, handler, generic, path_node):
        # pmxcfs has the new config (the `lock: create` placeholder) in .vmlist before PVE
        # answers the create with its UPID: keep the file in step before every answer.
        started = time.monotonic()
        try:
            if self.api_latency_ms:
                await asyncio.sleep(self.api_latency_ms / 1000)
            answer = await super()._answer(request, handler, generic, path_node)
        finally:
            self.write_vmlist()
            self.bed_sync()
        delay = (self.answer_delay or {}).get('{0} {1}'.format(request.method, request.path))
        if delay:
            await asyncio.sleep(float(delay))
        if not isinstance(self.timings, list):
            self.timings = []
        self.timings.append((request.method, request.path, started, time.monotonic()))
        del self.timings[:max(0, len(self.timings) - self.max_requests)]
        return answer

    # ------------------------------------------- NICs as PVE wires them at config writes and starts

    # The node's bridges (`/sys/class/net/<name>/mtu`); None: every non-empty name is one.
    bridges = None
    # The node's /etc/network/interfaces as pve-manager's GET /nodes/{node}/network answers it
    # (scenario `node_network`: a list of interfaces with PVE's fields); None: fakepve's own
    # answer (vmbr0 on eno1). When given, its bridges are the node's `bridges`.
    node_network = None

    def _routes_network(self):
        return [('GET', '/nodes/{node}/network', self._node_network)]

    async def _node_network(self, v, user):
        # pve-manager PVE/API2/Network.pm index: `permissions => { user => 'all' }`; the
        # interfaces of /etc/network/interfaces (pve-common src/PVE/Network/Interfaces.pm
        # __read_etc_network_interfaces: `bridge_ports` is '' for `bridge-ports none`, `active`
        # when the kernel has it up, addresses as `address`/`cidr`, `address6`/`cidr6`, methods
        # `method`/`method6`, other lines in `options`/`options6`), lo left out; with `type`,
        # only that type (`any_bridge`/`any_local_bridge`: bridges and OVS bridges); then every
        # bridge the user holds neither SDN.Audit nor SDN.Use on /sdn/zones/localnetwork/<name>
        # for is left out ("always check bridge access": rpcenv check_sdn_bridge), root@pam
        # sees all.
        if self.node_network is None:
            return shapes.networks({'_nodes': [v.get('node')]})
        want = v.get('type')
        out = []
        for iface in self.node_network:
            kind = iface.get('type')
            is_bridge = kind in ('bridge', 'OVSBridge')
            if want and not (want == kind or (is_bridge and want in ('any_bridge', 'any_local_bridge'))):
                continue
            if is_bridge and user != 'root@pam':
                path = '/sdn/zones/localnetwork/{0}'.format(iface.get('iface'))
                if not (self.allowed(user, path, 'SDN.Audit') or self.allowed(user, path, 'SDN.Use')):
                    continue
            out.append(dict(iface))
        return out

    def _qemu_missing_bridge(self, vm):
        """The first bridge a NIC of `vm` is on that the node does not have, else None: QEMU's
        start runs qemu-server's network script for each NIC on a bridge (src/PVE/QemuServer.pm
        print_netdev_full: `-netdev type=tap,...,script=/usr/libexec/qemu-server/pve-bridge`),
        whose tap_create reads the bridge's MTU (pve-common src/PVE/Network.pm tap_create →
        read_bridge_mtu: die "bridge '<name>' does not exist"); a NIC without a bridge is user
        networking and needs none."""
        if self.bridges is None:
            return None
        for key in sorted(vm.config, key=fake_qemu.natural):
            if NET_KEY.match(key):
                _, props = fake_lxc.split_props(str(vm.config[key]))
                bridge = props.get('bridge')
                if bridge and bridge not in self.bridges:
                    return key, bridge
        return None

    async def _do_start(self, vm, user, p):
        missing = None if vm.template else self._qemu_missing_bridge(vm)
        if missing is None:
            return await super()._do_start(vm, user, p)
        key, bridge = missing
        notes = TaskNotes()

        async def body():
            # qemu-server src/PVE/QemuServer.pm vm_start: the template, lock and running checks,
            # then config_to_command and QEMU itself (vm_start_nolock → run_command): the network
            # script dies, QEMU refuses the netdev and exits 1, and the task ends with
            # "start failed: QEMU exited with code 1".
            if vm.lock and vm.lock != 'suspended':
                raise fake_model.TaskError('VM is locked ({0})'.format(vm.lock))
            if vm.status == 'running':
                raise fake_model.TaskError('VM {0} already running'.format(vm.vmid))
            notes.say("bridge '{0}' does not exist".format(bridge))
            notes.say('kvm: -netdev type=tap,id={0},ifname=tap{1}i{2},script=/usr/libexec/qemu-server/pve-bridge,'
                      'downscript=/usr/libexec/qemu-server/pve-bridgedown: network script '
                      '/usr/libexec/qemu-server/pve-bridge failed with status 512'.format(key, vm.vmid, key[3:]))
            raise fake_model.TaskError('start failed: QEMU exited with code 1')
        return await self.task(vm.node, 'qmstart', vm.vmid, user, body, vm=vm, notes=notes)

    def _bridge_mtu(self, bridge):
        # pve-common src/PVE/Network.pm read_bridge_mtu: the first line of
        # /sys/class/net/<bridge>/mtu, else die "bridge '<bridge>' does not exist" (a NIC without
        # a bridge reads /sys/class/net//mtu).
        if not bridge or (self.bridges is not None and bridge not in self.bridges):
            raise fake_model.TaskError("bridge '{0}' does not exist".format(bridge or ''))
        return 1500

    def _update_lxc_config(self, ct):
        # pve-container src/PVE/LXC.pm update_lxc_config: for every netN of the current config,
        # read_bridge_mtu of its bridge (before lxcnetaddbr, which would die "missing bridge
        # configuration" anyway). Runs after every config PUT (src/PVE/API2/LXC/Config.pm
        # update_vm: write_config, load_config, then update_lxc_config, so the write is already
        # on disk when it dies) and at every start (vm_start).
        for key in sorted(ct.config, key=fake_qemu.natural):
            if NET_KEY.match(key):
                _, props = fake_lxc.split_props(str(ct.config[key]))
                self._bridge_mtu(props.get('bridge'))

    async def _lxc_config_put(self, user, v):
        answer = await super()._lxc_config_put(user, v)
        ct = self._here(v)
        if ct is not None:
            try:
                self._update_lxc_config(ct)
            except fake_model.TaskError as e:
                raise fake_model.PveError(500, str(e)) from e
        return answer

    async def _start_steps(self, ct, user, skiplock=False):
        if not ct.template:
            # pve-container src/PVE/API2/LXC/Status.pm vm_start, inside the vzstart worker: an
            # unprivileged container with `quota` on any mount point (rootfs, mpN) dies
            # "Quotas are not supported by unprivileged containers." before PVE::LXC::vm_start
            # (whose update_lxc_config reads the bridges).
            if truthy(ct.config.get('unprivileged')):
                for key in sorted(ct.config, key=fake_qemu.natural):
                    if key == 'rootfs' or re.fullmatch(r'mp\d+', key):
                        if truthy(fake_lxc.parse_mount(str(ct.config[key])).get('quota')):
                            raise fake_model.TaskError('Quotas are not supported by unprivileged containers.')
            self._update_lxc_config(ct)
        if not (self.bed_owned or {}).get(int(ct.vmid), {}).get('real'):
            return await super()._start_steps(ct, user, skiplock)
        # fakepve's vzstart steps, with the real container started (and RUNNING for LXC) before
        # PVE says it runs: an answer that shows it running comes after LXC's RUNNING.
        if ct.template:
            raise fake_model.TaskError("you can't start a CT if it's a template")
        if not skiplock:
            self._task_lock(ct, allow=('mounted',))
        await self.ceph_io(ct, [k for k in ct.config if fake_lxc.MOUNT_KEY.match(k)])
        await self.pause(ct.start_secs)
        if ct.start_error:
            raise fake_model.TaskError(ct.start_error)
        self._apply(ct)
        await self.bed_lxc_start(ct)
        ct.status = 'running'
        ct.started_at = time.time()
        ct.pid = next(self._ct_pids)

    def lab_bridges(self):
        """The bridges of `node_network` that reach nothing: no ports (`bridge-ports none`), no
        address of the node configured (no `address`/`cidr`/`address6`/`cidr6`/gateways, methods
        `manual`). The bed runs a real VM's NIC on such a bridge on an isolated QEMU hub
        (bed_qemu_argv)."""
        out = set()
        for iface in self.node_network or ():
            if iface.get('type') != 'bridge' or str(iface.get('bridge_ports') or '').strip():
                continue
            if any(iface.get(k) for k in ('address', 'cidr', 'address6', 'cidr6', 'gateway', 'gateway6')):
                continue
            if iface.get('method', 'manual') != 'manual' or iface.get('method6', 'manual') != 'manual':
                continue
            out.add(str(iface['iface']))
        return out

    def _exposure(self, kind, config):
        """How each NIC of a guest started with `config` reaches a network, as PVE wires it:
        - a container NIC on a bridge is a veth pair whose host end lxcnetaddbr plugs into that
          bridge, unless `link_down` is set (pve-container src/PVE/LXC.pm net_tap_plug then
          leaves the host end down and off the bridge);
        - a VM NIC without a bridge is QEMU's user-mode network, NAT through the node's own
          sockets (qemu-server src/PVE/QemuServer.pm print_netdev_full: `-netdev type=user`);
        - a VM NIC on a bridge with no ports and no node address (`lab_bridges`) reaches nothing;
        - a VM NIC on another bridge is up from QEMU's start: `link_down` is no command-line option
          but a QMP `set_link` after QEMU runs (vm_start_nolock → qemu_set_link_status), so the
          link is up until the start task ends, and stays up if that call fails."""
        out = []
        for key in sorted(config, key=fake_qemu.natural):
            if not NET_KEY.match(key):
                continue
            _, props = fake_lxc.split_props(str(config[key]))
            bridge = props.get('bridge')
            if kind == 'lxc' and bridge and not truthy(props.get('link_down')):
                out.append('{0} on bridge {1}: plugged into it'.format(key, bridge))
            elif kind == 'qemu' and not bridge:
                out.append('{0} without a bridge: user-mode NAT through the node'.format(key))
            elif kind == 'qemu' and bridge in self.lab_bridges():
                continue
            elif kind == 'qemu':
                out.append('{0} on bridge {1}: link up until the start task sets it down'.format(key, bridge))
        return out

    # Every guest start request with the guest's config as it was when the request came in:
    # what the guest booted with (a restore-test copy's NICs, onboot, protection), and how it
    # reached a network (`exposed`, see _exposure).
    _start_configs = ()
    START_PATH = re.compile(r'^/api2/json/nodes/[^/]+/(lxc|qemu)/(\d+)/status/start$')

    def start_configs(self):
        """[{vmid, type, config}] of every start request received, in order."""
        return [dict(x) for x in self._start_configs]

    def _record(self, request, body):
        self.write_vmlist()
        self._check_destroy(request)
        try:
            self._check_schema(request, body)
        except Exception:  # noqa: BLE001 - a checker bug must not take the request down
            log.warning('schema check failed', exc_info=True)
            self.schema_violations = tuple(self.schema_violations) + (
                '{0} {1}: the schema check itself failed (see the fake\'s log)'.format(request.method, request.path),)
        start = self.START_PATH.match(request.path) if request.method == 'POST' else None
        if start:
            guest = self.guest(int(start.group(2)))
            config = dict((k, str(x)) for k, x in ((guest.config or {}) if guest else {}).items())
            self._start_configs = tuple(self._start_configs) + (
                {'vmid': int(start.group(2)), 'type': start.group(1), 'config': config,
                 'exposed': self._exposure(start.group(1), config)},)
        query = request.query_string.encode()
        query = fake_server.SECRET_FORM.sub(rb'\g<1>***', query)
        self.requests.append((request.method, request.path, fake_server.redact(body, request.content_type),
                              query))
        excess = len(self.requests) - self.max_requests
        if excess > 0:
            del self.requests[:excess]


# ------------------------------------------------------------------------ values

def plain(obj, depth=0):
    """obj as JSON-ready data: sets become sorted lists, bytes text, a guest its public fields."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, bytes):
        return obj.decode('utf-8', 'replace')
    if isinstance(obj, dict):
        return dict((k if isinstance(k, str) else ' '.join(map(str, k)) if isinstance(k, tuple) else str(k),
                     plain(v, depth + 1)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return [plain(v, depth + 1) for v in obj]
    if isinstance(obj, (set, frozenset)):
        items = [plain(v, depth + 1) for v in obj]
        try:
            return sorted(items)
        except TypeError:
            return sorted(items, key=repr)
    if depth == 0 and hasattr(obj, 'vmid') and hasattr(obj, 'config'):
        return guest_view(obj)
    return repr(obj)


def guest_view(guest):
    """The public state of a guest (VM or container)."""
    out = {}
    for key, value in vars(guest).items():
        if key.startswith('_') or key in ('lock_released',) or callable(value):
            continue
        out[key] = plain(value, 1)
    out['type'] = guest.guest.split('/')[0]
    out['name'] = guest.name
    out['lock'] = guest.lock
    return out


def merged(current, new):
    """new, merged into current when both are dicts; a list given for a set becomes a set."""
    if isinstance(current, dict) and isinstance(new, dict):
        out = dict(current)
        holds_sets = any(isinstance(v, (set, frozenset)) for v in current.values())
        for key, value in new.items():
            if key in current:
                out[key] = merged(current[key], value)
            else:
                out[key] = set(value) if holds_sets and isinstance(value, list) else value
        return out
    if isinstance(current, (set, frozenset)) and isinstance(new, list):
        return set(new)
    return new


def set_attrs(target, values):
    """Set attributes of target; dicts are merged into the dicts already there (in place)."""
    for key, value in values.items():
        current = getattr(target, key, None)
        if isinstance(current, dict) and isinstance(value, dict):
            current.update(merged(current, value))
        else:
            setattr(target, key, merged(current, value))


def set_guest(pve, guest, values):
    """Set guest attributes; pool and status keep the fake's bookkeeping in step."""
    values = dict(values)
    if 'pool' in values:
        pool = values.pop('pool')
        pve._pool_leave(guest.vmid)
        if pool:
            pve._pool_join(pool, guest.vmid)
    if 'lock' in values:
        lock = values.pop('lock')
        if lock:
            pve.snapshot_lock(guest.vmid, lock)
        else:
            pve.unlock(guest.vmid)
    status = values.pop('status', None)
    set_attrs(guest, values)
    if status is not None:
        guest.status = status
        running = status == 'running'
        guest.started_at = (guest.started_at or time.time()) if running else None
        if hasattr(guest, 'qmpstatus'):
            guest.qmpstatus = status
        if hasattr(guest, 'pid') and guest.guest.startswith('lxc/'):
            guest.pid = (guest.pid or next(pve._ct_pids)) if running else None


def expand_privs(names):
    """Role names expanded to privileges; privilege names kept. Unknown names are an error."""
    known = set(shapes.PRIVILEGES) | {'VM.Monitor'}
    out = []
    for name in names:
        if name in ROLES:
            out.extend(ROLES[name])
        elif name in known:
            out.append(name)
        else:
            raise ScenarioError('grant names {0!r}, which is neither a role ({1}) nor a privilege'.format(
                name, ', '.join(sorted(ROLES))))
    return list(dict.fromkeys(out))


def backup_format(volname):
    for fmt in BACKUP_FORMATS:
        if volname.endswith('.' + fmt):
            return fmt
    return volname.rsplit('.', 1)[-1]


def truthy(value):
    """A PVE boolean given as 1/0, "1"/"0" or JSON true/false."""
    return str(value).strip().lower() in ('1', 'true', 'yes', 'on')


def tag_counts(text):
    """{tag: count} of a tag list as pve-common src/PVE/ParseUtils.pm split_list splits it
    (`,` and `;` are white space), as assert_tag_permissions counts them."""
    out = {}
    for tag in re.sub(r'[,;]', ' ', str(text or '')).split():
        out[tag] = out.get(tag, 0) + 1
    return out


NET_KEY = re.compile(r'^net\d+$')


def vnet_paths(value):
    """The paths check_vnet_access (pve-guest-common src/PVE/GuestHelpers.pm) checks SDN.Use on
    for a NIC value: none without a bridge; /sdn/zones/localnetwork/<bridge>/<tag> with a
    `tag`; one such path per VLAN of `trunks` (`10;20-30`, ranges expanded, sorted as strings,
    get_tags_from_trunk); the bridge's own path when there is neither."""
    _, props = fake_lxc.split_props(str(value))
    bridge = props.get('bridge')
    if not bridge:
        return []
    base = '/sdn/zones/localnetwork/{0}'.format(bridge)
    tag, trunks = props.get('tag'), props.get('trunks')
    paths = []
    if tag and tag != '0':
        paths.append('{0}/{1}'.format(base, tag))
    if trunks:
        vlans = set()
        for trunk in trunks.split(';'):
            first, _, last = trunk.partition('-')
            if last and last.isdigit() and first.isdigit() and int(last) > int(first):
                vlans.update(str(n) for n in range(int(first), int(last) + 1))
            else:
                vlans.add(first)
        paths.extend('{0}/{1}'.format(base, n) for n in sorted(vlans))
    if not ((tag and tag != '0') or trunks):
        paths.append(base)
    return paths


def encode_conf_text(text):
    """A description line as a guest config file stores it (pve-common src/PVE/ParseUtils.pm
    encode_text): control and high-bit characters, `:` and `%` percent-encoded (UTF-8 bytes)."""
    out = []
    for c in text:
        if ' ' <= c <= '~' and c not in ':%':
            out.append(c)
        else:
            out.extend('%{0:02X}'.format(b) for b in c.encode('utf-8'))
    return ''.join(out)


def backup_config_text(config, kind):
    """The guest config stored in a backup archive, as extractconfig answers it: the description
    as leading `#` lines, then `key: value` lines sorted by key, then raw `lxc.*` lines
    (pve-container src/PVE/LXC/Config.pm write_pct_config; qemu-server write_vm_config), one
    `\n` after each line (pve-storage src/PVE/Storage.pm extract_vzdump_config_tar and _vma
    collect the output line by line). A VM's archive also has a `#qmdump#map:<dev>:drive-<dev>:
    <storage>:<format>:` line per backed-up disk after the config (qemu-server
    src/PVE/VZDump/QemuServer.pm assemble, which also drops `lock:` and `parent:` lines)."""
    lines = ['#' + encode_conf_text(line) for line in str(config.get('description') or '').split('\n')
             if config.get('description')]
    keys = [k for k in config if k not in ('description', 'digest', 'lock', 'parent') and not k.startswith('lxc.')]
    lines.extend('{0}: {1}'.format(k, config[k]) for k in sorted(keys))
    lines.extend('{0}: {1}'.format(k, config[k]) for k in config if k.startswith('lxc.'))
    if kind == 'qemu':
        for key in sorted(keys, key=fake_qemu.natural):
            if not fake_qemu.DRIVE_KEY.match(key):
                continue
            volume, props = fake_qemu.split_drive(config[key])
            if fake_qemu.is_cdrom(volume, props) or volume == 'none' or props.get('backup') == '0':
                continue
            sid, _, volname = volume.partition(':')
            ext = volname.rsplit('.', 1)[-1] if '.' in volname.rsplit('/', 1)[-1] else ''
            fmt = ext if ext in ('raw', 'qcow2', 'vmdk') else 'raw'
            lines.append('#qmdump#map:{0}:drive-{0}:{1}:{2}:'.format(key, sid, fmt))
    return ''.join(line + '\n' for line in lines)


def encode_cfg_text(text):
    """A free-text field of user.cfg (a pool's comment) as PVE writes it: percent-encoded, so a
    `:` or a newline never splits the record (pve-api-facts.md §3.4: `Some%20comment`)."""
    return ''.join(c if c.isascii() and (c.isalnum() or c in '._-') else
                   ''.join('%{0:02X}'.format(b) for b in c.encode('utf-8')) for c in text)


# ---------------------------------------------------------------------- scenario

def check_host(host):
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ScenarioError('host {0!r} is not a loopback address (127.0.0.0/8)'.format(host))


def build(sc):
    """A ScenarioPve set up as the scenario says (not yet listening)."""
    host = sc.get('host')
    if not host:
        raise ScenarioError('the scenario needs "host" (a 127.x.y.z address)')
    check_host(host)
    # fakepve's own default root password is the word `secret`: anyone on the machine could
    # log in to this root-run fake with it and drive everything the API does (restores, guest
    # agent execs in the bed's guests). Without a scenario `password`, the root login has one
    # nobody is told.
    password = sc.get('password')
    if password is None:
        password = secrets.token_urlsafe(32)
    pve = ScenarioPve(user=sc.get('user', 'root@pam'), password=password, host=host, port=int(sc.get('port', 0)))
    pve.time_scale = float(sc.get('time_scale', 0))
    live = sc.get('vmlist') or {}
    pve.vmlist_path = live.get('path')
    pve.vmlist_extra = list(live.get('extra', []))
    pve.qemu_restore = sc.get('qemu_restore')
    pve.backup_configs, pve.backup_guests, pve._restore_hooks = {}, {}, {}
    pve.bed_owned, pve.bed_inits, pve.bed_execs, pve.bed_qemu = {}, {}, {}, {}
    pve.token_privsep = dict(sc.get('token_privsep', {}))
    pve.user_cfg_path = (sc.get('user_cfg') or {}).get('path')
    dc = sc.get('datacenter_cfg')
    if dc is not None:
        if not isinstance(dc, dict):
            raise ScenarioError('datacenter_cfg must be an object of datacenter.cfg keys (and "path")')
        pve.datacenter_cfg_path = dc.get('path')
        pve.datacenter_cfg = dict((k, str(x)) for k, x in dc.items() if k != 'path' and x is not None)
        access = dict(p.split('=', 1) for p in pve.datacenter_cfg.get('user-tag-access', '').split(',') if '=' in p)
        if access.get('user-allow', 'free') not in ('none', 'list', 'existing', 'free'):
            raise ScenarioError("datacenter_cfg user-tag-access: user-allow must be none, list, existing or free")
    network = sc.get('node_network')
    if network is not None:
        if not (isinstance(network, list) and all(isinstance(i, dict) and i.get('iface') and i.get('type')
                                                  for i in network)):
            raise ScenarioError('node_network must be a list of interfaces, each with "iface" and "type"')
        pve.node_network = [dict(i) for i in network]
        pve.bridges = set(str(i['iface']) for i in network if i['type'] in ('bridge', 'OVSBridge'))
    pve.ct_conf_dir = (sc.get('ct_conf') or {}).get('dir')
    pve.bed_pending = []
    bed = sc.get('guest_bed')
    if bed:
        if not (bed.get('state') and bed.get('template')):
            raise ScenarioError('guest_bed needs "state" (the pct stand-in state folder) and "template" (a rootfs)')
        pve.guest_bed = {'state': bed['state'], 'template': bed['template']}
        bed_monitor_setup(pve, bed)
        real = bed.get('real_lxc')
        if real:
            if not (isinstance(real, dict) and real.get('tarball') and real.get('osqueryi')
                    and re.fullmatch(r'[a-z][a-z0-9]{2,7}', str(real.get('net_prefix', ''))) and bed.get('lxc_path')):
                raise ScenarioError('guest_bed real_lxc needs "tarball", "osqueryi", "net_prefix" (3-8 of a-z0-9) '
                                    'and the bed\'s "lxc_path"')
            pve.guest_bed['real_lxc'] = dict(real)
        real_vm = bed.get('real_qemu')
        if real_vm:
            if not (isinstance(real_vm, dict) and real_vm.get('image') and real_vm.get('osqueryi')):
                raise ScenarioError('guest_bed real_qemu needs "image" (the folder tests/testbed/build-debian-vm.sh '
                                    'prints) and "osqueryi"')
            for name in ('disk.raw', 'vmlinux', 'initrd.img'):
                if not os.path.isfile(os.path.join(real_vm['image'], name)):
                    raise ScenarioError('guest_bed real_qemu: {0} has no {1}'.format(real_vm['image'], name))
            pve.guest_bed['real_qemu'] = dict(real_vm)

    for node in sc.get('nodes', []):
        if isinstance(node, str):
            pve.add_node(node)
        else:
            pve.add_node(node['name'], online=node.get('online', True))

    for sid, options in sc.get('storages', {}).items():
        store = pve.storages.setdefault(sid, {'active': 1, 'files': set()})
        store.update(options)
        store.setdefault('files', set())

    pools = sc.get('pools', [])
    if isinstance(pools, list):
        pools = dict((name, {}) for name in pools)
    for name, meta in pools.items():
        pve.pools.setdefault(name, set())
        info = pve._pool_meta(name)
        if meta.get('comment') is not None:
            info['comment'] = meta['comment']
        info['storage'].update(meta.get('storage', ()))

    seen = set()
    for g in sc.get('guests', []):
        vmid = int(g['vmid'])
        if vmid in seen:
            raise ScenarioError('guest {0} is listed twice'.format(vmid))
        seen.add(vmid)
        kind = g.get('type', 'qemu')
        common = dict(node=g.get('node', 'pve1'), status=g.get('status', 'stopped'), config=g.get('config', {}),
                      template=g.get('template', False))
        if kind == 'lxc':
            guest = pve.add_ct(vmid, g.get('name'), pool=g.get('pool'), ostemplate=g.get('ostemplate'), **common)
        elif kind == 'qemu':
            guest = pve.add_vm(vmid, g.get('name') or 'vm{0}'.format(vmid), **common)
            if g.get('pool'):
                pve._pool_join(g['pool'], vmid)
        else:
            raise ScenarioError('guest {0}: type must be lxc or qemu, not {1!r}'.format(vmid, kind))
        extra = {'lock': g['lock']} if g.get('lock') else {}
        extra.update(g.get('set', {}))
        set_guest(pve, guest, extra)
        if g.get('bed'):
            pve.bed_pending.append((guest, kind, g['bed']))

    for sid, vols in sc.get('volumes', {}).items():
        if sid not in pve.storages:
            raise ScenarioError('volumes for storage {0!r}, which the scenario does not define'.format(sid))
        store = pve.storages[sid].setdefault('volumes', {})
        for v in vols:
            volname = v['volname']
            content = v.get('content', 'backup')
            entry = {'content': content, 'format': v.get('format', backup_format(volname)),
                     'size': int(v.get('size', 1 << 20)), 'ctime': int(v.get('ctime', DEFAULT_CTIME))}
            if v.get('vmid') is not None:
                entry['vmid'] = int(v['vmid'])
            for key in ('notes', 'protected', 'used'):
                if key in v:
                    entry[key] = v[key]
            store[volname] = entry
            volid = '{0}:{1}'.format(sid, volname)
            if v.get('config') is not None:
                if not isinstance(v['config'], dict):
                    raise ScenarioError('volume {0}: config must be an object of config keys'.format(volid))
                pve.backup_configs[volid] = dict((k, str(x) if not isinstance(x, str) else x)
                                                 for k, x in v['config'].items())
            if v.get('guest') not in (None, False):
                if not pve.guest_bed:
                    raise ScenarioError('volume {0} has a guest, but the scenario has no guest_bed'.format(volid))
                pve.backup_guests[volid] = v['guest'] if isinstance(v['guest'], dict) else {}

    pve.users.update(sc.get('users', {}))
    pve.apitokens.update(sc.get('tokens', {}))
    for grant in sc.get('grants', []):
        if isinstance(grant, dict):
            who, path, privs = grant['who'], grant['path'], grant['privs']
        else:
            who, path, privs = grant
        pve.grant(who, path, *expand_privs(privs))
        pve.user_cfg_grants = list(pve.user_cfg_grants) + [(who, path, list(privs))]

    catalogue = fake_errors.load()['errors']
    for extra in sc.get('extra_errors', []):
        entry = dict(extra)
        key = entry.pop('key')
        entry.setdefault('in_task', False)
        entry.setdefault('source', 'scenario')
        entries = catalogue.setdefault(key, [])
        entries[:] = [e for e in entries if e.get('name') != entry['name']]
        entries.append(entry)

    set_attrs(pve, sc.get('attrs', {}))

    for fault in sc.get('fail', []):
        pve.fail(**fault)
    return pve


# ----------------------------------------------------------------------- control

def reply(data):
    return web.json_response(data, dumps=lambda d: json.dumps(d, allow_nan=False))


def result(value):
    """The answer of /call, /set and /guest: {"result": value as JSON}."""
    return reply({'result': plain(value)})


def refuse(status, message):
    return web.json_response({'error': message}, status=status)


# The FakePve methods `/call` runs: what the tests drive beside the API (faults, the request
# and violation records, root's own restores and removals, a guest's state). Each one does
# what a scenario or an API request with the scenario's tokens could make the fake do; none
# takes a path or a program. Any other method (the guest bed's `bed_monitor`, `bed_create`,
# the servers' `start`/`stop`, ...) is refused: the fake runs as root.
CALLABLE = frozenset((
    '_extractconfig', '_lxc_create', '_qm_create', 'add_ct', 'backup_guest', 'clear_schema_violations',
    'clear_violations', 'fail', 'flaky_network', 'grant', 'guest', 'remove_guest', 'schema_violation_list',
    'snapshot_lock', 'start_configs', 'unlock', 'violations', 'write_vmlist',
))

# The FakePve attributes `/set` changes: timings, answers and faults of the model. A guest
# spec of `backup_guests` only names files inside the restored guest's own root filesystem.
SETTABLE = frozenset((
    'answer_delay', 'api_latency_ms', 'backup_guests', 'backup_lock_after_start', 'create_answer', 'ct_secs', 'datacenter_cfg',
    'lxc_restore_fail', 'post_limit', 'release_version', 'restore_outside_pool', 'time_scale', 'version',
    'vmlist_extra', 'vmlist_frozen',
))

# Attributes that name programs the fake runs as root or files and folders it writes: set from
# the scenario file only, whoever asks (the scenario is root's, in a folder only root enters).
SCENARIO_ONLY = frozenset((
    'guest_bed', 'vmlist_path', 'user_cfg_path', 'datacenter_cfg_path', 'ct_conf_dir', 'qemu_restore',
    'bed_pending', 'bed_owned', 'bed_inits', 'bed_execs', 'bed_qemu', 'bed_monitors', 'bed_bridges',
))

# The guest attributes `/guest` sets: PVE's view of a guest (its state, config, pool, lock, its
# scripted guest agent and task timings).
GUEST_SETTABLE = frozenset((
    'status', 'pool', 'lock', 'config', 'agent', 'name', 'template', 'start_error', 'shutdown_secs',
    'start_secs', 'stop_secs', 'ha_state',
))

# The header every control request carries: `Bearer <the fake's control secret>`.
CONTROL_AUTH = 'Authorization'


def write_control_secret(certdir):
    """Make this fake's control secret and write it to `<certdir>/control.secret`, mode 0600
    from its creation (O_EXCL: never into a file someone else made; O_NOFOLLOW: never through
    a link). The folder must be this user's and writable by no one else, or another user could
    put their own file in its place before the client reads it. Returns (path, secret)."""
    st = os.stat(certdir)
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ScenarioError('certdir {0} must be owned by uid {1} and writable by no one else (it holds the '
                            'control secret)'.format(certdir, os.geteuid()))
    path = os.path.join(os.path.abspath(certdir), 'control.secret')
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    secret = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        data = (secret + '\n').encode('ascii')
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)
    return path, secret


class Control(object):
    """The plain-HTTP control endpoint of one fake: answers only requests that carry its secret."""

    def __init__(self, pve, stop, secret):
        self.pve = pve
        self.stop = stop
        self.expected = 'Bearer {0}'.format(secret).encode('ascii')

    def app(self):
        app = web.Application(middlewares=[self.authenticate])
        app.router.add_post('/call', self.call)
        app.router.add_post('/set', self.set)
        app.router.add_post('/guest', self.guest)
        app.router.add_get('/requests', self.requests)
        app.router.add_get('/timings', self.timings)
        app.router.add_get('/tasks', self.tasks)
        app.router.add_post('/shutdown', self.shutdown)
        return app

    @web.middleware
    async def authenticate(self, request, handler):
        """Refuse (401) every request without this fake's secret, before its body is read or
        its route looked up; compared in constant time. The refusal is logged without what
        was sent."""
        given = request.headers.get(CONTROL_AUTH, '').encode('utf-8', 'surrogateescape')
        if not hmac.compare_digest(given, self.expected):
            log.warning('control request %s %s refused: no valid control secret', request.method, request.path)
            return refuse(401, 'control requests need "Authorization: Bearer <secret>", the secret in the '
                               'fake\'s control_secret_file')
        return await handler(request)

    @staticmethod
    async def body(request):
        try:
            data = await request.json()
        except ValueError as exc:
            raise web.HTTPBadRequest(text=json.dumps({'error': 'body is not JSON: {0}'.format(exc)}),
                                     content_type='application/json') from None
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(text=json.dumps({'error': 'body must be a JSON object'}),
                                     content_type='application/json')
        return data

    async def call(self, request):
        data = await self.body(request)
        name = data.get('method')
        target = getattr(self.pve, name, None) if isinstance(name, str) else None
        if not callable(target):
            return refuse(404, 'FakePve has no method {0!r}'.format(name))
        if name not in CALLABLE:
            return refuse(403, 'FakePve method {0} is not callable through the control endpoint (callable: '
                               '{1})'.format(name, ', '.join(sorted(CALLABLE))))
        try:
            value = target(*data.get('args', []), **data.get('kwargs', {}))
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            log.warning('call %s failed: %s', name, traceback.format_exc())
            return refuse(400, '{0}: {1}'.format(type(exc).__name__, exc))
        return result(value)

    async def set(self, request):
        data = await self.body(request)
        unknown = [k for k in data if not hasattr(self.pve, k)]
        if unknown:
            return refuse(400, 'FakePve has no attribute {0}'.format(', '.join(sorted(unknown))))
        # Nothing is set unless every attribute may be.
        scenario_only = sorted(k for k in data if k in SCENARIO_ONLY)
        if scenario_only:
            return refuse(403, '{0} names programs or paths the fake runs or writes as root: set by the '
                               'scenario file only'.format(', '.join(scenario_only)))
        refused = sorted(k for k in data if k not in SETTABLE)
        if refused:
            return refuse(403, 'FakePve attribute {0} cannot be set through the control endpoint (settable: '
                               '{1})'.format(', '.join(refused), ', '.join(sorted(SETTABLE))))
        set_attrs(self.pve, data)
        return result(None)

    async def guest(self, request):
        data = await self.body(request)
        try:
            vmid = int(data['vmid'])
        except (KeyError, TypeError, ValueError):
            return refuse(400, 'guest needs an integer "vmid"')
        guest = self.pve.guest(vmid)
        if guest is None:
            return refuse(404, 'no guest {0}'.format(vmid))
        values = data.get('set', {})
        if not isinstance(values, dict):
            return refuse(400, 'guest "set" must be an object of guest attributes')
        refused = sorted(str(k) for k in values if k not in GUEST_SETTABLE)
        if refused:
            return refuse(403, 'guest attribute {0} cannot be set through the control endpoint (settable: '
                               '{1})'.format(', '.join(refused), ', '.join(sorted(GUEST_SETTABLE))))
        try:
            set_guest(self.pve, guest, values)
            # A status set here is a finished stop or start, as PVE's task is once it ends: the
            # bed's real container is stopped (its monitor gone) or running before the answer.
            self.pve.bed_sync()
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            return refuse(400, '{0}: {1}'.format(type(exc).__name__, exc))
        return result(guest)

    async def requests(self, request):
        out = []
        for item in self.pve.requests:
            method, path, body = item[:3]
            query = item[3] if len(item) > 3 else b''
            out.append({'method': method, 'path': path, 'query': query.decode('utf-8', 'replace'),
                        'body': body.decode('utf-8', 'replace')})
        return reply(out)

    async def timings(self, request):
        return reply([{'method': m, 'path': p, 'start': a, 'end': b}
                      for m, p, a, b in self.pve.timings])

    async def tasks(self, request):
        return reply(plain(self.pve.tasklog))

    async def shutdown(self, request):
        asyncio.get_running_loop().call_later(0.05, self.stop.set)
        return result('stopping')


# -------------------------------------------------------------------------- main

# The process whose end ends this fake: its parent, or for a fake forked by zygote.py the
# process that asked for it.
WATCH_PID = None


async def watch_parent(stop, every=1.0):
    """Stop when the process that started us is gone (a test runner killed hard leaves no orphan)."""
    if WATCH_PID is not None:
        while not stop.is_set():
            await asyncio.sleep(every)
            try:
                os.kill(WATCH_PID, 0)
            except ProcessLookupError:
                log.warning('process %d that asked for this fake is gone; stopping', WATCH_PID)
                stop.set()
            except PermissionError:
                pass
        return
    parent = os.getppid()
    while not stop.is_set():
        await asyncio.sleep(every)
        if os.getppid() != parent:
            log.warning('parent %d is gone; stopping', parent)
            stop.set()


async def keep_vmlist(pve, stop, every=0.02):
    """Keep the live .vmlist in step with the guests between requests (tasks end in between)."""
    while not stop.is_set():
        pve.write_vmlist()
        try:
            pve.bed_sync()
        except Exception:  # noqa: BLE001 - logged, the loop goes on
            log.warning('guest bed sync failed', exc_info=True)
        await asyncio.sleep(every)


async def serve(sc, ready_out):
    pve = build(sc)
    certdir = sc.get('certdir')
    if not certdir:
        raise ScenarioError('the scenario needs "certdir" (a directory for the certificate and key)')
    # The folder of the key and the control secret: the fake's own (0700 when it makes it).
    os.makedirs(certdir, mode=0o700, exist_ok=True)
    certfile, keyfile, der = make_cert(certdir, hosts=(pve.host,))
    secret_file, secret = write_control_secret(certdir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.ensure_future(watch_parent(stop))
    for guest, kind, spec in pve.bed_pending:
        await pve.bed_create(guest, kind, spec)
    pve.write_vmlist()
    vmlist_writer = asyncio.ensure_future(keep_vmlist(pve, stop))
    await pve.start(certfile, keyfile)
    control = web.AppRunner(Control(pve, stop, secret).app(), access_log=None, shutdown_timeout=2.0)
    await control.setup()
    try:
        await web.TCPSite(control, pve.host, 0).start()
        ready = {'url': pve.url, 'cafile': os.path.abspath(certfile), 'sha256': hashlib.sha256(der).hexdigest(),
                 'control': 'http://{0}:{1}'.format(pve.host, control.addresses[0][1]),
                 'control_secret_file': secret_file, 'pid': os.getpid()}
        ready_out.write(json.dumps(ready) + '\n')
        ready_out.flush()
        log.info('serving %s, control %s', ready['url'], ready['control'])
        await stop.wait()
    finally:
        watcher.cancel()
        vmlist_writer.cancel()
        for vmid in list(pve.bed_inits or {}):
            pve.bed_stop(vmid)
        for vmid in list(pve.bed_qemu or {}):
            pve.bed_qemu_stop(vmid)
        for vmid in list(pve.bed_monitors or {}):
            pve.bed_monitor(vmid, False)
        pve.bed_lxc_teardown()
        for step in (control.cleanup(), pve.stop()):
            try:
                await asyncio.wait_for(step, 5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - exiting anyway
                log.warning('shutdown step did not finish cleanly', exc_info=True)


def bed_monitor_setup(pve, bed):
    """A guest bed's `lxc_path` and `monitor` (the stand-in script): running containers get an
    LXC monitor stand-in (`bed_monitor`)."""
    if bed.get('lxc_path'):
        if not bed.get('monitor'):
            raise ScenarioError('guest_bed with "lxc_path" needs "monitor" (tests/pct/lxc-monitor)')
        pve.guest_bed['lxc_path'] = bed['lxc_path']
        pve.guest_bed['monitor'] = bed['monitor']


def main(argv):
    # The ready line is the only thing that may reach stdout.
    ready_out = sys.stdout
    sys.stdout = sys.stderr
    logging.basicConfig(stream=sys.stderr, level=os.environ.get('FAKEPVE_LOG_LEVEL', 'WARNING'),
                        format='fakepve-scenario[%(process)d] %(levelname)s %(name)s: %(message)s')
    # aiohttp's access log (a line per request at INFO) only at DEBUG: at INFO the log says what
    # the fake did (each task's end), which a line per status poll would bury; every request is
    # in the request log (`GET /requests` of the control endpoint) anyway.
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger('aiohttp.access').setLevel(logging.WARNING)
    if len(argv) != 2:
        sys.stderr.write('usage: scenario.py SCENARIO.json\n')
        return 2
    if fakepve.__version__ != REQUIRED_VERSION:
        sys.stderr.write('scenario.py: fakepve {0} is installed, {1} is required; run tests/run.sh\n'.format(
            fakepve.__version__, REQUIRED_VERSION))
        return 2
    try:
        with open(argv[1], encoding='utf-8') as fh:
            sc = json.load(fh)
        asyncio.run(serve(sc, ready_out))
    except (ScenarioError, ValueError, KeyError, TypeError, OSError) as exc:
        sys.stderr.write('scenario.py: {0}: {1}\n'.format(type(exc).__name__, exc))
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
