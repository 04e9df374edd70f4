#!/usr/bin/env python3
"""Start fakes without paying Python's imports each time: one process imports scenario.py (and
with it fakepve, aiohttp, the PVE schema and the routes' compiled patterns: `warm_up`) once, then
forks one fake per request.

    <venv>/bin/python tests/fakepve/zygote.py SOCKET

tests/run.sh starts it and exports FELHOM_FAKEPVE_ZYGOTE=SOCKET; the tests' FakePve::start uses
it when it answers and starts `scenario.py` itself otherwise. Measured on the 2-core machine: a
fake started from scratch costs about 0.4 s of processor time before its ready line; most of it
is imports.

One request per connection on the unix stream socket (mode 0600; a peer of another uid than
the zygote's is refused):
  - the client sends one JSON line {"scenario": PATH, "cwd": DIR, "env": {NAME: VALUE}} with two
    descriptors attached (SCM_RIGHTS): the fake's stdout (where its ready line goes) and stderr;
  - the zygote forks; the fake runs `scenario.py PATH` in DIR with exactly that environment and
    those descriptors, and watches the requesting process (its peer credentials) where a fake
    started directly watches its parent;
  - the zygote answers {"pid": N}, and once the fake has ended {"status": S} (S as waitpid gives
    it), then closes the connection;
  - once a Python file of tests/fakepve changed after the zygote imported it, every request is
    answered {"error": ...} and the asker starts its fake from scratch (the fork would run the
    code as it was).

The zygote ends when the process that started it is gone, or on SIGTERM/SIGINT; the fakes it
started run on (each ends with its own requester).
"""

import array
import json
import os
import selectors
import signal
import socket
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import scenario  # noqa: E402 - the point of this process: the imports, once

# What a fake imports only as it starts its servers (fakepve's server builds its aiohttp app
# then), taken once here too.
import aiohttp  # noqa: E402,F401
import aiohttp.web_runner  # noqa: E402,F401
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import fakepve.schema  # noqa: E402


def warm_up():
    """Do once here what every fake does the same way as it starts, so each fork finds it done.
    Measured on the 2-core machine (the demo scenario, processor time from fork to ready line):
    0.10-0.11 s without, 0.01-0.02 s with; over a suite's 460 fakes about 40 s of a core.
    - fakepve's PVE schema (a gzipped JSON of the whole API, cached by fakepve once loaded);
    - the certificate a fake makes (the `cryptography` modules it imports then);
    - the compiled patterns of the aiohttp routes a fake registers: one app is built here. The
      `re` module's cache holds 512 patterns by default and drops the oldest first; the routes
      are more than that, registered in the same order by every fake, so each one missed the
      cache and was compiled again. The cache is made large enough to keep them all."""
    if getattr(re, '_MAXCACHE', None) is not None:
        re._MAXCACHE = max(re._MAXCACHE, 8192)
    fakepve.schema.load()
    scratch = tempfile.mkdtemp(prefix='felhom-zygote-')
    try:
        scenario.make_cert(scratch, hosts=('127.0.0.1',))
        scenario.build({'host': '127.0.0.1', 'certdir': scratch})._build_app()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

MAX_REQUEST = 1 << 20


def source_stamps():
    """The modification time and size of each Python file beside this one (scenario.py and what
    it imports from here): what the forks run is what was imported at the start."""
    stamps = {}
    for name in sorted(os.listdir(HERE)):
        if name.endswith('.py'):
            try:
                st = os.stat(os.path.join(HERE, name))
            except OSError:
                continue
            stamps[name] = (st.st_mtime_ns, st.st_size)
    return stamps


IMPORTED = source_stamps()


def serve_request(conn, peer_pid):
    """Read one request and fork its fake; the child never returns."""
    fds = array.array('i')
    data = b''
    conn.settimeout(10)
    while not data.endswith(b'\n'):
        msg, anc, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(2 * fds.itemsize))
        if not msg:
            break
        data += msg
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - (len(payload) % fds.itemsize)])
        if len(data) > MAX_REQUEST:
            break
    try:
        req = json.loads(data)
        path, cwd, env = req['scenario'], req['cwd'], req['env']
        if len(fds) != 2 or not isinstance(env, dict):
            raise ValueError('a request needs two descriptors and an environment')
        if source_stamps() != IMPORTED:
            # A fork would run the fake as it was when this process started: the asker starts
            # the fake itself instead (restart the zygote to fork again).
            raise ValueError('tests/fakepve changed since the zygote imported it')
    except (ValueError, KeyError, TypeError) as exc:
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({'error': str(exc)}).encode() + b'\n')
        return None
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            os.closerange(3, 1 << 16)
            sys.stdout = os.fdopen(1, 'w', encoding='utf-8', errors='replace')
            sys.stderr = os.fdopen(2, 'w', encoding='utf-8', errors='replace', buffering=1)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update({str(k): str(v) for k, v in env.items()})
            scenario.WATCH_PID = peer_pid
            code = scenario.main(['scenario.py', path])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - the fake's own end, reported on its stderr
            import traceback
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code or 0)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({'pid': pid}).encode() + b'\n')
    return pid


def main(argv):
    if len(argv) != 2:
        sys.stderr.write('usage: zygote.py SOCKET\n')
        return 2
    path = argv[1]
    parent = os.getppid()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    old = os.umask(0o177)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.umask(old)
    listener.listen(64)
    listener.setblocking(False)
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    running = {}  # pid -> the connection that asked for it
    warm_up()
    sys.stdout.write('ready\n')
    sys.stdout.flush()
    while not stopping and os.getppid() == parent:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is wake_r:
                try:
                    while wake_r.recv(512):
                        pass
                except BlockingIOError:
                    pass
                continue
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                continue
            try:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize('3i'))
                peer_pid, peer_uid = struct.unpack('3i', creds)[:2]
                # A fork runs any scenario with any environment as this process's user: only
                # that user may ask (the socket's mode 0600 says so too).
                if peer_uid != os.geteuid():
                    sys.stderr.write('zygote.py: refused a request of uid {0}\n'.format(peer_uid))
                    pid = None
                else:
                    pid = serve_request(conn, peer_pid)
            except OSError:
                pid = None
            if pid is None:
                conn.close()
            else:
                running[pid] = conn
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                try:
                    conn.setblocking(True)
                    conn.settimeout(1)
                    conn.sendall(json.dumps({'status': status}).encode() + b'\n')
                except OSError:
                    pass
                conn.close()
    try:
        os.unlink(path)
    except OSError:
        pass
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
