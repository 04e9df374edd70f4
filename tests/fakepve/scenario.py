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
"""

import asyncio
import hashlib
import inspect
import ipaddress
import json
import logging
import os
import signal
import sys
import time
import traceback

REQUIRED_VERSION = '0.5.0'

try:
    import fakepve
    from aiohttp import web
    from fakepve import errors as fake_errors
    from fakepve import model as fake_model
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
    _vmlist_text = None
    _vmlist_version = 0

    def write_vmlist(self):
        """Rewrite the .vmlist file (atomically) when the guests changed."""
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

    # How a QEMU restore (`archive=`) behaves: None, fakepve's own refusal ("restoring an
    # archive is not supported"); "leftover", PVE's failure mode: the task fails and the VM's
    # config stays behind, outside the pool, where a pool token cannot delete it.
    qemu_restore = None

    async def _qm_create(self, v, user):
        if not (v.get('archive') and self.qemu_restore == 'leftover'):
            return await super()._qm_create(v, user)
        node, vmid = v['node'], int(v['vmid'])
        pool = v.get('pool')
        self._qm_check_pool(pool)
        if not (self.allowed(user, '/vms/{0}'.format(vmid), 'VM.Allocate')
                or (pool and self.allowed(user, '/pool/' + pool, 'VM.Allocate'))):
            raise fake_model.PveError(403, 'Permission check failed')
        if self._qm_taken(vmid):
            other = self.guest(vmid)
            kind = 'VM' if self.vm(vmid) else 'CT'
            raise fake_model.PveError(500, "unable to restore VM {0} - {1} {0} already exists on node '{2}'".format(
                vmid, kind, other.node))
        vm = fake_model.FakeVm(vmid, 'VM {0}'.format(vmid), node=node)
        self.vms.append(vm)
        self.nodes.setdefault(node, {'online': True})

        async def body():
            raise fake_model.TaskError(
                'unable to restore VM {0} - error before or during data restore, some or all disks were '
                'not completely restored. VM {0} state is NOT cleaned up.'.format(vmid))
        return await self.task(node, 'qmrestore', vmid, user, body, vm=vm)

    async def _answer(self, request, handler, generic, path_node):
        # pmxcfs has the new config (the `lock: create` placeholder) in .vmlist before PVE
        # answers the create with its UPID: keep the file in step before every answer.
        try:
            return await super()._answer(request, handler, generic, path_node)
        finally:
            self.write_vmlist()

    def _record(self, request, body):
        self.write_vmlist()
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

    pve.users.update(sc.get('users', {}))
    pve.apitokens.update(sc.get('tokens', {}))
    for grant in sc.get('grants', []):
        if isinstance(grant, dict):
            who, path, privs = grant['who'], grant['path'], grant['privs']
        else:
            who, path, privs = grant
        pve.grant(who, path, *expand_privs(privs))

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
