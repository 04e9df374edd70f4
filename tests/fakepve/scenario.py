#!/usr/bin/env python3
"""Serve fakepve from a scenario file, with a plain-HTTP control endpoint beside it.

    <venv>/bin/python tests/fakepve/scenario.py scenario.json

The scenario (JSON) sets up pools, guests, backup volumes, tokens, ACLs, extra catalogue
errors and initial faults, then the fake is served over HTTPS on the scenario's loopback
host with a certificate made for that host. Exactly one line goes to stdout, once both
servers listen:

    {"url": "https://H:P", "cafile": "...", "sha256": "<hex of the DER certificate>",
     "control": "http://H:Q", "pid": N}

Everything else (logging, warnings, errors) goes to stderr. The control endpoint (plain
HTTP, same host, its own free port) drives the running fake:

    POST /call     {"method": "fail", "args": [...], "kwargs": {...}}   any FakePve method
    POST /set      {"time_scale": 0.01, "ct_secs": {"create": 120}}    attributes, dicts merged
    POST /guest    {"vmid": 200, "set": {"status": "running"}}         guest attributes
    GET  /requests every request the fake received: method, path, query, body (redacted)
    GET  /tasks    every task, with its log
    POST /shutdown stop both servers and exit

SIGTERM and SIGINT stop it cleanly (exit status 0).

Beyond fakepve 0.5.0 the wrapper models, each with the PVE behaviour and its source in a
comment beside the code: QEMU restores (locked `create` outside the pool during the task, the
backup's stored config at the end) and LXC restores with their backup's config; vmid collisions
only as PVE's synchronous refusal; privilege-separated tokens (the intersection of token and
user ACLs); a live user.cfg; a create POST answered with a 5xx while its restore task runs on,
an LXC restore failing in its pool join with the container left behind, answers held back (a
client killed mid-request); and the guest bed, where restored guests have real root filesystems
and a VM's guest agent runs commands inside its own namespaces (tests/fakepve/README.md).
"""

import asyncio
import base64
import hashlib
import inspect
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid

REQUIRED_VERSION = '0.5.0'

try:
    import fakepve
    from aiohttp import web
    from fakepve import agent as fake_agent
    from fakepve import errors as fake_errors
    from fakepve import lxc as fake_lxc
    from fakepve import model as fake_model
    from fakepve import qemu as fake_qemu
    from fakepve import server as fake_server
    from fakepve import shapes
    from fakepve.certs import make_cert
except ImportError as exc:  # pragma: no cover - environment problem
    sys.stderr.write('scenario.py: cannot import fakepve ({0}); run tests/run.sh to install it\n'.format(exc))
    sys.exit(2)

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

BACKUP_FORMATS = ('tar.zst', 'tar.gz', 'tar.lzo', 'tar', 'vma.zst', 'vma.gz', 'vma.lzo', 'vma')
# 2026-01-01T00:00:00Z, the date in the demo backup's name.
DEFAULT_CTIME = 1767225600
# qemu-ga's environment for guest-exec: no `env` is passed by PVE, so the child has the agent
# service's PATH (systemd's default) and PATH search applies (guest-exec-facts.md §3.3).
QGA_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
# QEMU qga/commands.c GUEST_EXEC_MAX_OUTPUT: 16 MiB kept per stream (guest-exec-facts.md §3.4).
QGA_MAX_OUTPUT = 16 * 1024 * 1024
SIZE_UNITS = {'K': 1024, 'M': 1024 ** 2, 'G': 1024 ** 3, 'T': 1024 ** 4}


def parse_size(text):
    """Bytes of a PVE disk size ("8G", "512M", "4096"); 0 when absent."""
    found = re.fullmatch(r'(\d+(?:\.\d+)?)([KMGT]?)', str(text or '').strip())
    if not found:
        return 0
    return int(float(found.group(1)) * SIZE_UNITS.get(found.group(2), 1))


def agent_configured(config):
    """True when a VM config enables the guest agent (`agent: 1` or `agent: enabled=1,…`)."""
    first = str(config.get('agent', '0')).split(',')[0]
    return first.split('=')[-1] in ('1', 'yes', 'on', 'true')


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
    _vmlist_text = None
    _vmlist_version = 0

    def write_vmlist(self):
        """Rewrite the .vmlist file (atomically) when the guests changed."""
        self.write_user_cfg()
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
        owner = who.split('!')[0]
        privsep = int((self.token_privsep or {}).get(who, 1))
        held = {}
        for path, privs in self.acl.get(owner if not privsep else who, []):
            keep = set(p for p in privs if self._held_by(owner, path, p))
            if keep:
                held.setdefault(path, set()).update(keep)
        if v.get('path') is not None:
            held = dict((p, ps) for p, ps in held.items()
                        if v['path'] == p or p == '/' or v['path'].startswith(p + '/'))
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
    # AccessControl.pm lock_user_config: "can't add VM N to pool: <cfs lock error>"). One-shot.
    lxc_restore_fail = None
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

    def _restore_tags(self, user, vmid, v):
        # guest src/PVE/GuestHelpers.pm assert_tag_permissions, called by create_vm of both LXC and
        # QEMU with the pool undef (pve-api-facts.md §2.4): `tags` in a create or restore request
        # need VM.Config.Options on /vms/<vmid> itself (or /vms, /), never through a pool, so a
        # pool-scoped token gets a synchronous 403 before anything exists.
        if not v.get('tags') or self.acl is None or user.split('!')[0] == 'root@pam':
            return
        path = '/vms/{0}'.format(vmid)
        who = [user.split('!')[0]] + ([user] if '!' in user and int((self.token_privsep or {}).get(user, 1)) else [])

        def held(principal):
            return any('VM.Config.Options' in privs and granted in ('/', '/vms', path)
                       for granted, privs in self.acl.get(principal, []))
        if not all(held(p) for p in who):
            raise fake_model.PveError(403, 'Permission check failed ({0}, VM.Config.Options)'.format(path))

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
        self._restore_tags(user, vmid, v)
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

        async def body():
            await self.pause(self.qemu_restore_secs)
            if self.qemu_restore == 'leftover' or self.volume_exists(archive) is False:
                # PVE does not clean up a failed QEMU restore: only the create lock goes.
                fake_qemu.QemuApi._qm_lock(vm, None)
                raise fake_model.TaskError(failed)
            conf, made = {}, []
            try:
                for key in sorted(backup, key=fake_qemu.natural):
                    value = backup[key]
                    if key in ('lock', 'parent', 'digest', 'snaptime', 'vmstate') or re.fullmatch(r'unused\d+', key):
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
                for volid in made:
                    self._qm_free(volid)
                fake_qemu.QemuApi._qm_lock(vm, None)
                raise fake_model.TaskError('{0} {1}'.format(failed, getattr(e, 'message', None) or e)) from e
            vm.config = conf
            vm.name = conf.get('name') or 'VM {0}'.format(vmid)
            if bed is not None:
                await self.bed_create(vm, 'qemu', bed)
                # PVE seconds its start and stop tasks take (the guest's own pace).
                vm.start_secs = float(bed.get('start_secs', 0) or 0)
                vm.stop_secs = float(bed.get('stop_secs', 0) or 0)
            fake_qemu.QemuApi._qm_lock(vm, None)
            if pool:
                self._pool_join(pool, vmid)
            return None
        upid = await self.task(node, 'qmrestore', vmid, user, body, vm=vm)
        self._lost_create_answer(vmid)
        return upid

    async def _lxc_create(self, user, v):
        # PVE's LXC restore (pve-api-facts.md §4.3, container src/PVE/LXC/Create.pm recover_config):
        # the config recovered from the archive, merged with the given parameters (those win),
        # with new disks. fakepve 0.5.0 writes a synthetic config instead, so the backup's config
        # (scenario `volumes[].config`) is merged in at the end of the task. Collisions stay
        # fakepve's synchronous `check_vmid_unused` refusal, as PVE (§4.2).
        archive = v.get('ostemplate')
        vmid = int(v['vmid'])
        if v.get('restore'):
            self._restore_tags(user, vmid, v)
        if v.get('restore') and (archive in (self.backup_configs or {}) or archive in (self.backup_guests or {})):
            backup = dict((self.backup_configs or {}).get(archive) or {})
            bed = (self.backup_guests or {}).get(archive)
            given = set(k for k in v if k not in fake_lxc.CREATE_ONLY)

            async def hook(ct):
                merged = dict((k, x) for k, x in backup.items()
                              if not (fake_lxc.MOUNT_KEY.match(k) or k in ('lock', 'parent', 'digest')))
                for key, value in ct.config.items():
                    if key in given or fake_lxc.MOUNT_KEY.match(key) or key not in merged:
                        merged[key] = value
                for key in list(merged):
                    if re.fullmatch(r'net\d+', key) and key not in given:
                        value = str(merged[key])
                        if v.get('unique'):
                            value = ','.join(p for p in value.split(',') if not p.startswith('hwaddr='))
                        merged[key] = fake_lxc.normalise(key, value)
                ct.config = merged
                if bed is not None:
                    await self.bed_create(ct, 'lxc', bed)
            self._restore_hooks[vmid] = hook
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

    async def task(self, node, ttype, tid, user, body, vm=None, lock=True, log=()):
        hook = self._restore_hooks.get(int(tid)) if ttype == 'vzrestore' and str(tid).isdigit() else None
        if hook is not None:
            inner = body

            async def body():
                note = await inner()
                await hook(vm)
                return note
        failing = (self.lxc_restore_fail or {}).pop(str(tid), None) if ttype == 'vzrestore' else None
        if failing:
            restored = body
            message = failing if isinstance(failing, str) else (
                "can't add VM {0} to pool: cfs-lock 'file-user_cfg' error: got lock request timeout".format(tid))

            async def body():
                await restored()
                # The container is restored (config written, lock gone); the pool join failed,
                # so it is not in the pool and the task ends in error (see lxc_restore_fail).
                self._pool_leave(int(tid))
                raise fake_model.TaskError(message)
        return await super().task(node, ttype, tid, user, body, vm=vm, lock=lock, log=log)

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

    async def bed_create(self, guest, kind, spec):
        """Give a guest a root filesystem of its own (its disks, restored): a copy of the template,
        hostname from its config. A VM's spec says whether a guest agent runs inside (`agent`,
        default true) and how many PVE seconds it boots before the agent answers (`boot_secs`)."""
        if not self.guest_bed:
            raise fake_model.TaskError('the scenario has no guest_bed for a guest with a root filesystem')
        spec = dict(spec) if isinstance(spec, dict) else {}
        vmid = int(guest.vmid)
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
                shutil.rmtree(d, ignore_errors=True)
                del self.bed_owned[vmid]
                continue
            running = guest.status == 'running'
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
            elif running:
                self.bed_start(vmid)
            else:
                self.bed_stop(vmid)

    def bed_start(self, vmid):
        """Boot a bed VM: a PID, mount, UTS and IPC namespace whose init (a shell that reaps the
        orphans it adopts) lives chrooted in its root filesystem (/proc mounted for it); every
        agent exec joins it, as processes of one guest kernel do."""
        init = self.bed_inits.get(vmid)
        if init is not None and init['proc'].poll() is None:
            return init
        rootfs = os.path.join(self.bed_dir(vmid), 'rootfs')
        script = ('r=$1; mount --bind "$r" "$r" && mount -t proc proc "$r/proc" && '
                  'exec chroot "$r" /usr/bin/busybox sh -c '
                  '"/bin/hostname -F /etc/hostname 2>/dev/null; while :; do sleep 3600 & wait; done"')
        proc = subprocess.Popen(['unshare', '--fork', '--pid', '--mount', '--uts', '--ipc', '--kill-child', '--',
                                 '/bin/sh', '-c', script, 'felhom-vm-init', rootfs],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
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
        return await asyncio.create_subprocess_exec(
            *(enter + ['/usr/bin/env', '-i', 'PATH=' + QGA_PATH] + list(argv)),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    async def bed_run(self, vmid, argv, stdin=None):
        """Run argv in a bed VM to its end: (exit status, stdout, stderr)."""
        proc = await self.bed_spawn(vmid, argv, stdin)
        out, err = await proc.communicate(stdin)
        return proc.returncode, out, err

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

    def clear_violations(self):
        """Forget the recorded violations (a test that sent one on purpose)."""
        self.destroy_violations = ()

    async def _answer(self, request, handler, generic, path_node):
        # pmxcfs has the new config (the `lock: create` placeholder) in .vmlist before PVE
        # answers the create with its UPID: keep the file in step before every answer.
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
        return answer

    def _record(self, request, body):
        self.write_vmlist()
        self._check_destroy(request)
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
    pve = ScenarioPve(user=sc.get('user', 'root@pam'), password=sc.get('password', 'secret'),
                      host=host, port=int(sc.get('port', 0)))
    pve.time_scale = float(sc.get('time_scale', 0))
    live = sc.get('vmlist') or {}
    pve.vmlist_path = live.get('path')
    pve.vmlist_extra = list(live.get('extra', []))
    pve.qemu_restore = sc.get('qemu_restore')
    pve.backup_configs, pve.backup_guests, pve._restore_hooks = {}, {}, {}
    pve.bed_owned, pve.bed_inits, pve.bed_execs = {}, {}, {}
    pve.token_privsep = dict(sc.get('token_privsep', {}))
    pve.user_cfg_path = (sc.get('user_cfg') or {}).get('path')
    pve.ct_conf_dir = (sc.get('ct_conf') or {}).get('dir')
    pve.bed_pending = []
    bed = sc.get('guest_bed')
    if bed:
        if not (bed.get('state') and bed.get('template')):
            raise ScenarioError('guest_bed needs "state" (the pct stand-in state folder) and "template" (a rootfs)')
        pve.guest_bed = {'state': bed['state'], 'template': bed['template']}

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


class Control(object):
    """The plain-HTTP control endpoint of one fake."""

    def __init__(self, pve, stop):
        self.pve = pve
        self.stop = stop

    def app(self):
        app = web.Application()
        app.router.add_post('/call', self.call)
        app.router.add_post('/set', self.set)
        app.router.add_post('/guest', self.guest)
        app.router.add_get('/requests', self.requests)
        app.router.add_get('/tasks', self.tasks)
        app.router.add_post('/shutdown', self.shutdown)
        return app

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
        try:
            set_guest(self.pve, guest, data.get('set', {}))
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

    async def tasks(self, request):
        return reply(plain(self.pve.tasklog))

    async def shutdown(self, request):
        asyncio.get_running_loop().call_later(0.05, self.stop.set)
        return result('stopping')


# -------------------------------------------------------------------------- main

async def watch_parent(stop, every=1.0):
    """Stop when the process that started us is gone (a test runner killed hard leaves no orphan)."""
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
    os.makedirs(certdir, exist_ok=True)
    certfile, keyfile, der = make_cert(certdir, hosts=(pve.host,))
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
    control = web.AppRunner(Control(pve, stop).app(), access_log=None, shutdown_timeout=2.0)
    await control.setup()
    try:
        await web.TCPSite(control, pve.host, 0).start()
        ready = {'url': pve.url, 'cafile': os.path.abspath(certfile), 'sha256': hashlib.sha256(der).hexdigest(),
                 'control': 'http://{0}:{1}'.format(pve.host, control.addresses[0][1]), 'pid': os.getpid()}
        ready_out.write(json.dumps(ready) + '\n')
        ready_out.flush()
        log.info('serving %s, control %s', ready['url'], ready['control'])
        await stop.wait()
    finally:
        watcher.cancel()
        vmlist_writer.cancel()
        for vmid in list(pve.bed_inits or {}):
            pve.bed_stop(vmid)
        for step in (control.cleanup(), pve.stop()):
            try:
                await asyncio.wait_for(step, 5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - exiting anyway
                log.warning('shutdown step did not finish cleanly', exc_info=True)


def main(argv):
    # The ready line is the only thing that may reach stdout.
    ready_out = sys.stdout
    sys.stdout = sys.stderr
    logging.basicConfig(stream=sys.stderr, level=os.environ.get('FAKEPVE_LOG_LEVEL', 'WARNING'),
                        format='fakepve-scenario[%(process)d] %(levelname)s %(name)s: %(message)s')
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
