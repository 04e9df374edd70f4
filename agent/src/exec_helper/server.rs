//! `felhom-agent exec-helper`: the root helper's server.
//!
//! It takes its listening socket from systemd socket activation (`LISTEN_FDS`/`LISTEN_PID`,
//! one socket, fd 3; `felhom-agent-exec.socket`) and exits after [`IDLE_EXIT`] without a
//! connection (systemd starts it again on the next one), or binds `--socket PATH` itself and runs
//! until SIGTERM: only in a folder of root's that group and others cannot write, reached from
//! `/` through folders of root's that nobody else can write either (or sticky, as `/tmp`), bound
//! in a private folder inside it, given mode 0660 and the group of `[agent] user` there, then
//! renamed into place (`bind_socket`), so no name is ever changed by path where someone else
//! could swap it. At exit it removes the socket only if the name still holds the socket it
//! bound (the same inode).
//!
//! Each connection: the peer's uid (`SO_PEERCRED`) must be 0 or the uid of `[agent] user`
//! (resolved at start), else `exec_caller_refused` before anything is read. Then one request
//! frame is read (within [`READ_TIMEOUT`] and [`MAX_REQUEST_FRAME`]), decoded, authorized
//! ([`super::authorize`], fresh files each time), run with [`LxcExec`] (caller timeouts and
//! output caps clamped to [`MAX_TIMEOUT`] and [`MAX_OUTPUT_CAP`]; a push is a `pct exec` whose
//! stdin is the file's bytes, written by a shell inside the container: nothing is staged on the
//! node and `pct push` is never run) and answered in one frame. At most
//! [`MAX_CONNECTIONS`] connections are served at once; more wait in the socket's backlog.
//!
//! A caller that closes the connection before the answer (the agent killed, its transaction
//! dropped) has its request stopped: a command as at its timeout (SIGTERM to its `pct`'s process
//! group, the grace, SIGKILL, then the sweep of its tag inside the container), a push with its
//! `pct` killed; nothing runs on for a transaction nobody drives, even a command that escaped
//! the group.
//!
//! A `read` request (the caller's uid checked as above; it names no guest and no path) is
//! answered with the bytes of the cluster file it names, read from the path of this helper's
//! config through nothing anyone but root could change ([`super::cluster_file`]); a `status`
//! request with where `pct` resolves on this helper's `PATH`.
//!
//! Each request is logged with the caller's uid, the vmid, the transaction, the op, the argv
//! (or the pushed path, mode and size), the names of the env variables, the size of stdin and
//! the result. Env values, stdin and pushed bytes are never logged.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::authorize::{authorize, Owners, Refusal};
use super::cluster_file::{path_of, read_trusted, what_crosses, FileRefusal};
use super::proto::{
    decode_incoming, read_frame, write_frame, ClusterFile, Incoming, Op, ProtoError, Request,
    Response, WireError, WireFile, WireStatus, MAX_CLUSTER_FILE_BYTES, MAX_OUTPUT_CAP,
    MAX_REQUEST_FRAME, MAX_RESPONSE_FRAME, MAX_STATUS_PATH_BYTES, MAX_TIMEOUT, PROBE_VERSION,
};
use crate::config::Config;
use crate::error::{outside_text, outside_text_max, ErrorCode, ExitStatus};
use crate::guest::exec::{GuestExec, PushSource};
use crate::guest::lxc::{LxcExec, PctConfig};
use crate::nofollow;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;

/// How many connections are served at once. Each may hold a request frame of 24 MiB, its
/// decoded stdin, two 8 MiB output buffers and their encoded answer at once (about 70 MiB at the
/// limits): 8 stay inside the unit's `MemoryMax=1G` (640 MiB peak, measured by
/// `tests/tests/exec_helper.rs`; 16 went over it). The agent runs at most a few transactions at
/// once, each one exec at a time; more connections wait in the socket's backlog.
pub const MAX_CONNECTIONS: usize = 8;
/// How long a caller may take to send its request.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long writing the response may take.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a request whose caller went away may take to stop (the exec's SIGTERM grace and the
/// sweep inside the container).
pub const STOP_WAIT: Duration = Duration::from_secs(30);
/// A socket-activated helper exits after this long without a connection.
pub const IDLE_EXIT: Duration = Duration::from_secs(120);

/// The environment variable that shortens [`IDLE_EXIT`] in tests (milliseconds; only in a
/// build with the `test-hooks` feature).
#[cfg(feature = "test-hooks")]
pub const IDLE_ENV: &str = "FELHOM_AGENT_EXEC_IDLE_MS";

/// The idle time before a socket-activated helper exits: [`IDLE_EXIT`], or the test build's
/// override.
fn idle_exit() -> Duration {
    #[cfg(feature = "test-hooks")]
    if let Some(ms) = std::env::var(IDLE_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        return Duration::from_millis(ms.max(10));
    }
    IDLE_EXIT
}

/// What the helper needs for every request.
struct Ctx {
    cfg: Config,
    owners: Owners,
    pct: PctConfig,
}

/// Where the listening socket comes from.
enum Source {
    /// Passed by systemd.
    Activated(std::os::unix::net::UnixListener),
    /// Bound by the helper at this path.
    Bound(std::os::unix::net::UnixListener, BoundName),
}

/// Where `--socket` put the socket: the folder (held open), the name in it and the socket
/// file's identity, so that the helper removes at exit the socket it bound and nothing else.
struct BoundName {
    path: PathBuf,
    dir: std::os::fd::OwnedFd,
    name: std::ffi::OsString,
    /// `(st_dev, st_ino)` of the socket file.
    id: (u64, u64),
}

impl BoundName {
    /// Remove the socket if the name still holds the one the helper bound. The folder is
    /// root's and writable by nobody else, so the name cannot change between the look and the
    /// removal but by root.
    fn remove(&self) {
        use nix::fcntl::AtFlags;
        match nix::sys::stat::fstatat(
            &self.dir,
            self.name.as_os_str(),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        ) {
            Ok(st) if (st.st_dev, st.st_ino) == self.id => {
                if let Err(e) = nix::unistd::unlinkat(
                    &self.dir,
                    self.name.as_os_str(),
                    nix::unistd::UnlinkatFlags::NoRemoveDir,
                ) {
                    tracing::warn!("cannot remove the socket {}: {e}", self.path.display());
                }
            }
            Ok(_) => tracing::warn!(
                "{} is no longer the socket this helper bound (replaced meanwhile); left in place",
                self.path.display()
            ),
            Err(_) => {}
        }
    }
}

/// Open the folder `folder` (absolute) one component at a time from `/`, following no link,
/// and check each on the open descriptor: every folder above it root's and writable by nobody
/// else, or sticky (as `/tmp`: there only an entry's owner may rename or remove it, and the
/// next folder down is root's); `folder` itself root's and writable by neither group nor
/// others. `Err`: which folder fails and what to do.
fn open_trusted_folder(folder: &Path) -> Result<std::os::fd::OwnedFd, String> {
    use nix::fcntl::open;
    use nix::sys::stat::{fstat, Mode};
    use std::path::Component;
    if !folder.is_absolute() {
        return Err(format!(
            "--socket names a folder by a relative path ({}); pass the socket's full path, e.g. /run/felhom-agent/exec.sock",
            folder.display()
        ));
    }
    let names: Vec<&std::ffi::OsStr> = folder
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(Ok(n)),
            Component::ParentDir => Some(Err(())),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect::<Result<_, ()>>()
        .map_err(|()| {
            format!(
                "--socket {} goes through `..`; pass the socket's path without it",
                folder.display()
            )
        })?;
    let mut so_far = PathBuf::from("/");
    let mut fd =
        open("/", nofollow::FOLDER, Mode::empty()).map_err(|e| format!("cannot open /: {e}"))?;
    for (i, name) in std::iter::once(None)
        .chain(names.iter().map(Some))
        .enumerate()
    {
        if let Some(name) = name {
            so_far.push(name);
            fd = nofollow::folder(&fd, *name).map_err(|e| {
                format!(
                    "cannot open the socket's folder {} (a folder, not a link): {e}; create it as root with mode 0755, or pass a path without links",
                    so_far.display()
                )
            })?;
        }
        let st = fstat(&fd).map_err(|e| format!("cannot inspect {}: {e}", so_far.display()))?;
        let mode = st.st_mode & 0o7777;
        if i == names.len() {
            if st.st_uid != 0 || mode & 0o022 != 0 {
                return Err(format!(
                    "the socket's folder {} belongs to uid {} with mode {mode:o}: the exec helper binds only in a folder of root's that group and others cannot write (anyone who can write there could swap the socket's name for a link). Use /run/felhom-agent (the packaged socket unit), or `chown root:root` and `chmod go-w` the folder",
                    so_far.display(),
                    st.st_uid,
                ));
            }
        } else if st.st_uid != 0 || (mode & 0o022 != 0 && mode & 0o1000 == 0) {
            return Err(format!(
                "the socket's path {} goes through {}, which belongs to uid {} with mode {mode:o}: every folder from / down to the socket's must be root's and writable by nobody else (or sticky, as /tmp), else whoever can write there could swap the folders below for their own. Use /run/felhom-agent (the packaged socket unit), or `chown root:root` and `chmod go-w` {}",
                folder.display(),
                so_far.display(),
                st.st_uid,
                so_far.display()
            ));
        }
    }
    Ok(fd)
}

fn fail(code: ErrorCode, message: String) -> ExitStatus {
    tracing::error!(code = %code, "{message}");
    crate::error::exit_status(code)
}

/// The socket systemd passed, if this process was socket-activated (`LISTEN_PID` is this
/// process and `LISTEN_FDS` is 1). Must run before any other thread starts.
fn activated_socket() -> Result<Option<std::os::unix::net::UnixListener>, String> {
    let pid_ok = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
        == Some(std::process::id());
    let fds = std::env::var("LISTEN_FDS").ok();
    if !pid_ok || fds.is_none() {
        return Ok(None);
    }
    if fds.as_deref().map(str::trim) != Some("1") {
        return Err(format!(
            "systemd passed {} sockets (LISTEN_FDS); felhom-agent-exec.socket must have exactly one ListenStream",
            outside_text(fds.as_deref().unwrap_or(""))
        ));
    }
    let mut fds = listenfd::ListenFd::from_env();
    fds.take_unix_listener(0)
        .map_err(|e| format!("the socket systemd passed (fd 3) is not a Unix stream socket: {e}"))
}

/// Bind `path` without a path race. Its folder, opened from `/` one component at a time without
/// following a link ([`open_trusted_folder`]), must be a folder of root's that neither group nor
/// others may write (else anyone who can write there could swap names under the helper's
/// `chmod`/`chown`), reached through folders nobody but root can change; the socket is bound
/// in a fresh 0700 folder of root's made inside it (reached through the opened folder's
/// descriptor, `/proc/self/fd/N/...`), given mode 0660 and group `gid` there, then renamed over
/// `path`. At `path`, a stale socket is replaced; anything else is refused.
fn bind_socket(
    path: &Path,
    gid: Option<u32>,
) -> Result<(std::os::unix::net::UnixListener, BoundName), String> {
    use nix::fcntl::{renameat, AtFlags};
    use nix::sys::stat::{fchmodat, fstatat, mkdirat, FchmodatFlags, Mode, SFlag};
    use std::os::fd::AsRawFd;
    let shown = path.display();
    let (Some(folder), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(format!(
            "--socket {shown} names no file in a folder; pass the socket's full path, e.g. /run/felhom-agent/exec.sock"
        ));
    };
    let dir = open_trusted_folder(folder)?;
    match fstatat(&dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(m) if SFlag::from_bits_truncate(m.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFSOCK => {}
        Ok(_) => {
            return Err(format!(
                "{shown} exists and is not a socket; the helper will not remove it. Remove it by hand or pass another --socket"
            ))
        }
        Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => return Err(format!("cannot inspect {shown}: {e}")),
    }
    // A private folder of root's beside the final name: nobody else can reach the socket's
    // name there while it gets its mode and group.
    let private = format!(".{}.{}", name.to_string_lossy(), ulid::Ulid::new());
    mkdirat(&dir, private.as_str(), Mode::from_bits_truncate(0o700)).map_err(|e| {
        format!(
            "cannot create a private folder in {}: {e}",
            folder.display()
        )
    })?;
    let cleanup = |dir: &std::os::fd::OwnedFd| {
        let _ = nix::unistd::unlinkat(dir, private.as_str(), nix::unistd::UnlinkatFlags::RemoveDir);
    };
    let result = (|| {
        let sub = nofollow::folder(&dir, private.as_str()).map_err(|e| {
            format!(
                "cannot open the private folder in {}: {e}",
                folder.display()
            )
        })?;
        let through = PathBuf::from(format!("/proc/self/fd/{}", sub.as_raw_fd())).join(name);
        let listener = std::os::unix::net::UnixListener::bind(&through)
            .map_err(|e| format!("cannot bind {shown}: {e}"))?;
        let bound: Result<(u64, u64), String> = (|| {
            fchmodat(
                &sub,
                name,
                Mode::from_bits_truncate(0o660),
                FchmodatFlags::FollowSymlink,
            )
            .map_err(|e| format!("cannot chmod {shown}: {e}"))?;
            if let Some(gid) = gid {
                nix::unistd::fchownat(
                    &sub,
                    name,
                    None,
                    Some(nix::unistd::Gid::from_raw(gid)),
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(|e| format!("cannot give {shown} to group {gid}: {e}"))?;
            }
            // The socket file's identity, taken where nobody else can reach it; a rename
            // keeps it.
            let st = fstatat(&sub, name, AtFlags::AT_SYMLINK_NOFOLLOW)
                .map_err(|e| format!("cannot inspect {shown}: {e}"))?;
            renameat(&sub, name, &dir, name)
                .map_err(|e| format!("cannot move the socket to {shown}: {e}"))?;
            Ok((st.st_dev, st.st_ino))
        })();
        if bound.is_err() {
            let _ = nix::unistd::unlinkat(&sub, name, nix::unistd::UnlinkatFlags::NoRemoveDir);
        }
        bound.map(|id| (listener, id))
    })();
    cleanup(&dir);
    let (listener, id) = result?;
    Ok((
        listener,
        BoundName {
            path: path.to_path_buf(),
            dir,
            name: name.to_os_string(),
            id,
        },
    ))
}

/// Run the helper: `felhom-agent exec-helper [--config PATH] [--socket PATH]`.
pub fn main(config_path: &Path, socket: Option<&Path>) -> ExitStatus {
    // First, while this is the only thread: the activation variables are read and removed.
    let activated = match socket {
        Some(_) => None,
        None => match activated_socket() {
            Ok(s) => s,
            Err(msg) => return fail(ErrorCode::ConfigInvalid, msg),
        },
    };
    // The helper talks to neither PVE nor the hub: it never reads their secrets.
    let cfg = match Config::load_without_secrets(config_path) {
        Ok(c) => c,
        Err(f) => return fail(f.code, f.message),
    };
    let (agent_uid, agent_gid) = match &cfg.agent_user {
        None => (None, None),
        Some(name) => match nix::unistd::User::from_name(name) {
            Ok(Some(u)) => (Some(u.uid.as_raw()), Some(u.gid.as_raw())),
            Ok(None) => {
                return fail(
                    ErrorCode::ConfigInvalid,
                    format!(
                        "[agent] user {name:?} in {} does not exist on this node; create it (`adduser --system {name}`) or fix the setting",
                        cfg.path.display()
                    ),
                )
            }
            Err(e) => {
                return fail(
                    ErrorCode::ConfigInvalid,
                    format!("cannot look up [agent] user {name:?}: {e}"),
                )
            }
        },
    };
    let source = match (activated, socket) {
        (Some(l), _) => Source::Activated(l),
        (None, Some(path)) => match bind_socket(path, agent_gid) {
            Ok((l, name)) => Source::Bound(l, name),
            Err(msg) => return fail(ErrorCode::ConfigInvalid, msg),
        },
        (None, None) => {
            return fail(
                ErrorCode::ConfigInvalid,
                "no socket to serve: start the helper through felhom-agent-exec.socket (systemd socket activation) or pass --socket PATH".to_string(),
            )
        }
    };
    let pct = PctConfig {
        lxc_path: cfg.exec.lxc_path.clone(),
        ..PctConfig::default()
    };
    let ctx = Arc::new(Ctx {
        cfg,
        owners: Owners { agent_uid },
        pct,
    });
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            return fail(
                ErrorCode::ConfigInvalid,
                format!("cannot start the async runtime: {e}"),
            )
        }
    };
    let status = runtime.block_on(serve(source, ctx));
    runtime.shutdown_timeout(Duration::from_secs(5));
    status
}

async fn serve(source: Source, ctx: Arc<Ctx>) -> ExitStatus {
    let (std_listener, bound, activated) = match source {
        Source::Activated(l) => (l, None, true),
        Source::Bound(l, p) => (l, Some(p), false),
    };
    let listener = match std_listener
        .set_nonblocking(true)
        .and_then(|()| UnixListener::from_std(std_listener))
    {
        Ok(l) => l,
        Err(e) => {
            return fail(
                ErrorCode::ConfigInvalid,
                format!("cannot listen on the socket: {e}"),
            )
        }
    };
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            return fail(
                ErrorCode::ConfigInvalid,
                format!("cannot watch SIGTERM: {e}"),
            )
        }
    };
    tracing::info!(
        socket = %bound.as_ref().map_or_else(|| "from systemd".to_string(), |b| b.path.display().to_string()),
        agent_uid = ?ctx.owners.agent_uid,
        "exec helper ready: callers root{}",
        ctx.owners
            .agent_uid
            .map_or_else(String::new, |u| format!(" and uid {u}"))
    );
    let idle = idle_exit();
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let active = Arc::new(AtomicUsize::new(0));
    // When the last connection was accepted or ended.
    let last_activity = Arc::new(std::sync::Mutex::new(Instant::now()));
    let idle_for =
        |last: &std::sync::Mutex<Instant>| last.lock().map_or(Duration::ZERO, |t| t.elapsed());
    let touch = |last: &std::sync::Mutex<Instant>| {
        if let Ok(mut t) = last.lock() {
            *t = Instant::now();
        }
    };
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            () = tokio::time::sleep(idle.min(Duration::from_secs(1))), if activated => {
                if active.load(Ordering::SeqCst) == 0 && idle_for(&last_activity) >= idle {
                    tracing::info!("no connection for {:.1}s: exiting until the next one", idle.as_secs_f64());
                    break;
                }
                continue;
            }
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        touch(&last_activity);
        active.fetch_add(1, Ordering::SeqCst);
        let ctx = ctx.clone();
        let active = active.clone();
        let last = last_activity.clone();
        tokio::spawn(async move {
            handle(stream, &ctx).await;
            touch(&last);
            active.fetch_sub(1, Ordering::SeqCst);
            drop(permit);
        });
    }
    if let Some(name) = bound {
        name.remove();
    }
    ExitStatus::Ok
}

async fn respond(stream: &mut UnixStream, response: &Response) {
    let body = response.encode();
    match tokio::time::timeout(
        WRITE_TIMEOUT,
        write_frame(stream, &body, MAX_RESPONSE_FRAME),
    )
    .await
    {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("could not send the response: {e}"),
        Err(_) => tracing::warn!(
            "could not send the response within {}s",
            WRITE_TIMEOUT.as_secs()
        ),
    }
}

/// One connection: caller check, one request, one response.
async fn handle(mut stream: UnixStream, ctx: &Ctx) {
    let uid = match stream.peer_cred() {
        Ok(c) => c.uid(),
        Err(e) => {
            tracing::warn!("cannot read the caller's credentials: {e}; connection dropped");
            return;
        }
    };
    if !(uid == 0 || Some(uid) == ctx.owners.agent_uid) {
        tracing::warn!(
            uid,
            code = %ErrorCode::ExecCallerRefused,
            "refused a caller with uid {uid}: only root and the agent's user may call the exec helper"
        );
        let msg = format!(
            "uid {uid} may not use the exec helper; only root{} may. Run the agent as that user, or set [agent] user in {}",
            ctx.owners
                .agent_uid
                .map_or_else(String::new, |u| format!(" and the agent's user (uid {u})")),
            ctx.cfg.path.display()
        );
        respond(
            &mut stream,
            &Response::Error(WireError::refused(ErrorCode::ExecCallerRefused, msg)),
        )
        .await;
        return;
    }
    let body = match tokio::time::timeout(READ_TIMEOUT, read_frame(&mut stream, MAX_REQUEST_FRAME))
        .await
    {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return refuse_malformed(&mut stream, uid, &e).await,
        Err(_) => {
            let e = ProtoError::Invalid(format!(
                "no complete request within {}s",
                READ_TIMEOUT.as_secs()
            ));
            return refuse_malformed(&mut stream, uid, &e).await;
        }
    };
    let request = match decode_incoming(&body) {
        Ok(Incoming::Guest(r)) => r,
        Ok(Incoming::Read(file)) => {
            drop(body);
            let response = hand_over(ctx, uid, file).await;
            return respond(&mut stream, &response).await;
        }
        Ok(Incoming::Status) => {
            let response = status(ctx, uid);
            return respond(&mut stream, &response).await;
        }
        Ok(Incoming::LabProbe) => {
            let response = lab_probe(uid).await;
            return respond(&mut stream, &response).await;
        }
        Err(e) => return refuse_malformed(&mut stream, uid, &e).await,
    };
    drop(body);
    let (vmid, txn) = (request.vmid, request.txn);
    let what = describe(&request.op);
    let stop = CancellationToken::new();
    let response = {
        let (mut from_caller, _) = stream.split();
        let run = run_request(ctx, uid, request, &stop);
        tokio::pin!(run);
        tokio::select! {
            response = &mut run => Some(response),
            () = caller_gone(&mut from_caller) => {
                tracing::warn!(uid, vmid, txn = %txn, "the caller went away during {what}: stopping it");
                stop.cancel();
                // The exec ends as at its timeout; a push is dropped (its pct killed) if it
                // does not end by then.
                let stopped = tokio::time::timeout(STOP_WAIT, run).await.is_ok();
                tracing::warn!(uid, vmid, txn = %txn, "the request of the caller that went away was {}", if stopped { "stopped and swept" } else { "killed" });
                None
            }
        }
    };
    if let Some(response) = response {
        respond(&mut stream, &response).await;
    }
}

/// A `read` request: the file from the path of the helper's own config, read as root through
/// nothing anyone else could change ([`read_trusted`]), at most [`MAX_CLUSTER_FILE_BYTES`];
/// of `jobs.cfg`, `user.cfg` and `datacenter.cfg` only the lines the agent reads
/// ([`what_crosses`]).
async fn hand_over(ctx: &Ctx, uid: u32, file: ClusterFile) -> Response {
    let path = path_of(&ctx.cfg, file);
    let shown = path.display().to_string();
    let read = tokio::task::spawn_blocking(move || {
        let max = MAX_CLUSTER_FILE_BYTES as u64;
        read_trusted(&path, max)?
            .map(|bytes| what_crosses(file, &path, bytes, max))
            .transpose()
    })
    .await
    .unwrap_or_else(|e| {
        Err(FileRefusal {
            code: ErrorCode::PveUnreachable,
            message: format!("reading {shown} stopped: {e}"),
        })
    });
    match read {
        Ok(bytes) => {
            match &bytes {
                Some(b) => tracing::info!(
                    uid,
                    file = file.name(),
                    "handed over {shown} ({} bytes{})",
                    b.len(),
                    if file.crosses_whole() {
                        ""
                    } else {
                        ": only the lines the agent reads"
                    }
                ),
                None => tracing::info!(
                    uid,
                    file = file.name(),
                    "answered that {shown} does not exist"
                ),
            }
            Response::File(WireFile {
                name: file.name().to_string(),
                data: bytes.map(|b| B64.encode(&b)),
            })
        }
        Err(r) => {
            tracing::warn!(uid, file = file.name(), code = %r.code, "refused to hand over {shown}: {}", r.message);
            Response::Error(WireError::refused(r.code, r.message))
        }
    }
}

/// A `status` request: where `pct` resolves for this helper, and its `PATH`.
fn status(ctx: &Ctx, uid: u32) -> Response {
    let path = std::env::var_os("PATH");
    let program = &ctx.pct.program;
    let pct = if program.components().count() > 1 {
        super::is_executable_file(program).then(|| program.clone())
    } else {
        super::resolve_on_path(&program.to_string_lossy(), path.as_deref())
    };
    let clip = |p: &Path| outside_text_max(&p.to_string_lossy(), MAX_STATUS_PATH_BYTES - 64);
    tracing::info!(uid, pct = ?pct, "answered a status request (`felhom-agent doctor`)");
    Response::Status(WireStatus {
        pct: pct.as_deref().map(clip),
        path: path.as_deref().map(|p| clip(Path::new(p))),
    })
}

/// Resolves once the caller closed its side of the connection (or it failed): a caller sends
/// nothing after its request and keeps the connection open until the answer (see the proto
/// docs). Stray bytes are read and ignored.
async fn caller_gone<R: tokio::io::AsyncRead + Unpin>(from_caller: &mut R) {
    let mut buf = [0u8; 256];
    loop {
        match from_caller.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

async fn refuse_malformed(stream: &mut UnixStream, uid: u32, e: &ProtoError) {
    match e {
        // A connection closed before its first byte (a readiness check) sent no request.
        ProtoError::Truncated { got: 0, want: 4 } => {
            tracing::debug!(uid, "a connection closed without a request");
        }
        // `doctor`'s probe (see the proto docs): answered with the refusal, which is the point.
        ProtoError::Version(PROBE_VERSION) => {
            tracing::info!(uid, "answered a probe (`felhom-agent doctor`)");
        }
        _ => tracing::warn!(uid, code = %e.code(), "refused a malformed request: {e}"),
    }
    if matches!(e, ProtoError::Io(_) | ProtoError::Truncated { .. }) {
        // Nobody is left to read an answer.
        return;
    }
    let msg = format!(
        "{e}; the request was not run. The agent and the helper must be the same felhom-agent version"
    );
    respond(stream, &Response::Error(WireError::refused(e.code(), msg))).await;
}

/// What a request is, for the log: never env values, stdin or pushed bytes.
fn describe(op: &Op) -> String {
    match op {
        Op::Exec(r) => format!(
            "exec argv={} env_keys=[{}] stdin_bytes={} timeout={}s output_cap={}",
            outside_text(&format!("{:?}", r.argv)),
            outside_text(
                &r.env
                    .iter()
                    .map(|(k, _)| k.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            r.stdin.as_ref().map_or(0, Vec::len),
            r.timeout.as_secs(),
            r.output_cap
        ),
        Op::Push { path, mode, data } => format!(
            "push path={} mode={mode:o} bytes={}",
            outside_text(path),
            data.len()
        ),
        Op::LabJoin { lab, names } => format!("lab_join lab={lab} names={}", names.join(",")),
        Op::LabRemove { lab } => format!("lab_remove lab={lab}"),
    }
}

async fn run_request(ctx: &Ctx, uid: u32, request: Request, stop: &CancellationToken) -> Response {
    let Request { vmid, txn, op } = request;
    let what = describe(&op);
    if let Op::LabJoin { lab, .. } | Op::LabRemove { lab } = &op {
        return lab_request(ctx, uid, vmid, txn, *lab, op.clone(), &what).await;
    }
    let verdict = {
        let cfg = ctx.cfg.clone();
        let owners = ctx.owners;
        tokio::task::spawn_blocking(move || authorize(&cfg, owners, vmid, txn))
            .await
            .unwrap_or_else(|e| {
                Err(Refusal {
                    code: ErrorCode::ExecNotOwned,
                    message: format!("the authorization of {vmid} failed: {e}; nothing was run"),
                })
            })
    };
    if let Err(r) = verdict {
        tracing::warn!(uid, vmid, txn = %txn, code = %r.code, "refused {what}: {}", r.message);
        return Response::Error(WireError::refused(r.code, r.message));
    }
    let lxc = LxcExec::new(vmid, ctx.pct.clone());
    let started = Instant::now();
    let response = match op {
        Op::LabJoin { .. } | Op::LabRemove { .. } => Response::Error(WireError::refused(
            ErrorCode::ExecRequestInvalid,
            "a lab request reached the exec path".to_string(),
        )),
        Op::Exec(mut r) => {
            r.timeout = r.timeout.min(MAX_TIMEOUT);
            r.output_cap = r.output_cap.min(MAX_OUTPUT_CAP);
            match lxc.exec_until(&r, stop).await {
                Ok(o) => {
                    tracing::info!(uid, vmid, txn = %txn, "ran {what}: {}", o.summary());
                    Response::from_outcome(&o)
                }
                Err(e) => {
                    tracing::warn!(uid, vmid, txn = %txn, code = %e.code(), "{what} failed: {e}");
                    Response::Error(WireError::from_exec_error(&e))
                }
            }
        }
        Op::Push { path, mode, data } => {
            match lxc.push_file(&PushSource::Bytes(data), &path, mode).await {
                Ok(receipt) => {
                    tracing::info!(uid, vmid, txn = %txn, "ran {what}: sha256 {}", receipt.sha256);
                    Response::from_receipt(&receipt)
                }
                Err(e) => {
                    tracing::warn!(uid, vmid, txn = %txn, code = %e.code(), "{what} failed: {e}");
                    Response::Error(WireError::from_exec_error(&e))
                }
            }
        }
    };
    tracing::debug!(vmid, txn = %txn, "request took {:.3}s", started.elapsed().as_secs_f64());
    response
}

/// A lab request: only for the lab transaction `txn` journaled as its group's. A join needs
/// the whole claim on the running container (as an exec does); a removal only the journaled
/// lab (the members may be gone).
/// A `lab_probe` request: a lab of a fresh id made and removed at once
/// ([`crate::guest::group_lab::probe`]). It names no guest and touches nothing but what it makes;
/// labs are made one at a time in this process, so a flood of probes waits in line.
async fn lab_probe(uid: u32) -> Response {
    let done = tokio::task::spawn_blocking(crate::guest::group_lab::probe)
        .await
        .unwrap_or_else(|e| Err(format!("the lab probe failed: {e}")));
    match done {
        Ok(note) => {
            tracing::info!(uid, "lab probe: {note}");
            Response::Lab(note)
        }
        Err(m) => {
            tracing::warn!(uid, code = %ErrorCode::GroupLabFailed, "lab probe: {m}");
            Response::Error(WireError::refused(ErrorCode::GroupLabFailed, m))
        }
    }
}

async fn lab_request(
    ctx: &Ctx,
    uid: u32,
    vmid: u32,
    txn: hub_protocol::TxnId,
    lab: ulid::Ulid,
    op: Op,
    what: &str,
) -> Response {
    let cfg = ctx.cfg.clone();
    let owners = ctx.owners;
    let lxc_path = ctx.pct.lxc_path.clone();
    let done = tokio::task::spawn_blocking(move || -> Result<String, Refusal> {
        let state = super::authorize::read_claim(&cfg.state_dir, owners, vmid, txn)?;
        let named = state.request().group.as_ref().map(|g| g.lab);
        if named != Some(lab) {
            return Err(Refusal {
                code: ErrorCode::ExecNotOwned,
                message: format!(
                    "transaction {txn} names no group lab {lab} (container {vmid}); nothing was done"
                ),
            });
        }
        match op {
            Op::LabJoin { names, .. } => {
                authorize(&cfg, owners, vmid, txn)?;
                // The lab bridge to link to: the journaled request's, and only one of the
                // config's lab bridges.
                let group = state.request().group.clone();
                let link = group.as_ref().and_then(|g| g.link_bridge.clone());
                if let (Some(b), Some(g)) = (link.as_deref(), group.as_ref()) {
                    if !cfg.restore_test.lab_bridges.iter().any(|l| l == b) {
                        return Err(Refusal {
                            code: ErrorCode::ExecNotOwned,
                            message: format!(
                                "transaction {txn} names {}, not one of [restore_test] lab_bridges in {}; nothing was joined",
                                crate::error::outside_text_max(b, 20),
                                cfg.path.display()
                            ),
                        });
                    }
                    // Root reads the bridge in the kernel itself before linking the lab to
                    // it: no address, no port but the group's VM copies' taps and this lab's
                    // link, IPv6 off, nothing forwarded.
                    let faults = crate::lab_kernel::faults_now(
                        b,
                        crate::lab_kernel::Ports::TapsOfAny(
                            g.bridge_peers.clone(),
                            Some(crate::guest::group_lab::link_port_name(lab)),
                        ),
                    );
                    if !faults.is_empty() {
                        return Err(Refusal {
                            code: ErrorCode::LabBridgeOpen,
                            message: format!(
                                "the group's lab bridge {b} is not isolated, so the lab was not linked to it: {}",
                                faults.join("; ")
                            ),
                        });
                    }
                }
                crate::guest::group_lab::join_and_link(&lxc_path, lab, vmid, &names, link.as_deref())
                    .map_err(|m| Refusal {
                        code: ErrorCode::GroupLabFailed,
                        message: m,
                    })
            }
            _ => crate::guest::group_lab::remove(lab)
                .map(|had| {
                    if had {
                        format!("the group lab {} was removed", crate::guest::group_lab::lab_name(lab))
                    } else {
                        format!("the group lab {} was already gone", crate::guest::group_lab::lab_name(lab))
                    }
                })
                .map_err(|m| Refusal {
                    code: ErrorCode::GroupLabFailed,
                    message: m,
                }),
        }
    })
    .await
    .unwrap_or_else(|e| {
        Err(Refusal {
            code: ErrorCode::GroupLabFailed,
            message: format!("the lab request for {vmid} failed: {e}"),
        })
    });
    match done {
        Ok(note) => {
            tracing::info!(uid, vmid, txn = %txn, "ran {what}: {note}");
            Response::Lab(note)
        }
        Err(r) => {
            tracing::warn!(uid, vmid, txn = %txn, code = %r.code, "refused {what}: {}", r.message);
            Response::Error(WireError::refused(r.code, r.message))
        }
    }
}
