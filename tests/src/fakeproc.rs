//! The process of one fake PVE: forked by `tests/fakepve/zygote.py` when `tests/run.sh` started
//! one (`FELHOM_FAKEPVE_ZYGOTE` names its socket; a fake then costs a fork instead of Python's
//! imports), else spawned as `scenario.py` itself. Either way the fake runs with this process's
//! environment and working folder, writes its ready line to a pipe read here and its log to the
//! given file, and ends when this process ends.

use std::fs::File;
use std::io::{self, BufRead, BufReader, IoSlice, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};
use nix::unistd::Pid;
use serde_json::{json, Value};

/// The variable that names the zygote's socket.
pub const ZYGOTE_ENV: &str = "FELHOM_FAKEPVE_ZYGOTE";

std::thread_local! {
    /// Fakes started on this thread are spawned here, never forked by the zygote.
    static SPAWN_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Spawn the fakes this thread starts from this thread, not through the zygote: a thread in
/// network namespaces of its own (a test's node) needs its fake there, where the agent it
/// starts connects; the zygote's forks live in the namespaces `tests/run.sh` started it in.
pub fn spawn_fakes_on_this_thread() {
    SPAWN_HERE.set(true);
}

/// A running fake's process.
pub enum FakeProc {
    /// Spawned here: its parent is this process.
    Child(Child),
    /// Forked by the zygote, which tells its exit status on `conn`.
    Forked {
        /// Its process id.
        pid: Pid,
        /// The request's connection, where the zygote writes the exit status.
        conn: BufReader<UnixStream>,
        /// The exit status, once read.
        status: Option<ExitStatus>,
    },
}

impl FakeProc {
    /// Start `python script scenario` in `cwd` (through the zygote when one answers); returns the
    /// process and the read end of its stdout.
    pub fn start(
        python: &Path,
        script: &Path,
        scenario: &Path,
        cwd: &Path,
        log: File,
    ) -> io::Result<(FakeProc, File)> {
        if let Some(socket) = std::env::var_os(ZYGOTE_ENV).filter(|_| !SPAWN_HERE.get()) {
            if let Ok(conn) = UnixStream::connect(&socket) {
                if let Ok(started) = forked(conn, scenario, cwd, &log) {
                    return Ok(started);
                }
            }
        }
        let mut child = Command::new(python)
            .arg(script)
            .arg(scenario)
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()?;
        let stdout = child
            .stdout
            .take()
            .map(|s| File::from(OwnedFd::from(s)))
            .ok_or_else(|| io::Error::other("no stdout pipe"))?;
        Ok((FakeProc::Child(child), stdout))
    }

    /// The process id.
    pub fn pid(&self) -> Pid {
        match self {
            FakeProc::Child(c) => Pid::from_raw(i32::try_from(c.id()).unwrap_or(i32::MAX)),
            FakeProc::Forked { pid, .. } => *pid,
        }
    }

    /// How it ended, waiting at most `wait` (zero: only look).
    pub fn wait_for(&mut self, wait: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + wait;
        match self {
            FakeProc::Child(c) => loop {
                match c.try_wait() {
                    Ok(Some(s)) => return Some(s),
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    _ => return None,
                }
            },
            FakeProc::Forked { conn, status, .. } => {
                if status.is_none() {
                    *status = read_status(conn, deadline);
                }
                *status
            }
        }
    }

    /// SIGTERM.
    pub fn terminate(&self) {
        let _ = kill(self.pid(), Signal::SIGTERM);
    }

    /// SIGKILL, then how it ended (a forked fake's status as the zygote saw it; `None` when the
    /// zygote is gone).
    pub fn kill_and_wait(&mut self) -> Option<ExitStatus> {
        match self {
            FakeProc::Child(c) => {
                let _ = c.kill();
                c.wait().ok()
            }
            FakeProc::Forked { .. } => {
                if let Some(s) = self.wait_for(Duration::ZERO) {
                    return Some(s);
                }
                let _ = kill(self.pid(), Signal::SIGKILL);
                self.wait_for(Duration::from_secs(10))
            }
        }
    }
}

/// Ask the zygote for a fake.
fn forked(
    conn: UnixStream,
    scenario: &Path,
    cwd: &Path,
    log: &File,
) -> io::Result<(FakeProc, File)> {
    let (out_r, out_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let env: serde_json::Map<String, Value> = std::env::vars_os()
        .map(|(k, v)| (k.to_string_lossy().into_owned(), json!(v.to_string_lossy())))
        .collect();
    let mut request = serde_json::to_vec(&json!({
        "scenario": scenario,
        "cwd": cwd,
        "env": env,
    }))
    .map_err(io::Error::other)?;
    request.push(b'\n');
    let fds = [out_w.as_raw_fd(), log.as_raw_fd()];
    let first = sendmsg::<UnixAddr>(
        conn.as_raw_fd(),
        &[IoSlice::new(&request)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )?;
    (&conn).write_all(&request[first..])?;
    drop(out_w);
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut conn = BufReader::new(conn);
    let mut line = String::new();
    conn.read_line(&mut line)?;
    let answer: Value = serde_json::from_str(&line).map_err(io::Error::other)?;
    let pid = answer["pid"]
        .as_i64()
        .and_then(|p| i32::try_from(p).ok())
        .filter(|p| *p > 1)
        .ok_or_else(|| io::Error::other(format!("the zygote answered {line:?}")))?;
    Ok((
        FakeProc::Forked {
            pid: Pid::from_raw(pid),
            conn,
            status: None,
        },
        File::from(out_r),
    ))
}

/// The zygote's `{"status": S}` line, read until `deadline`.
fn read_status(conn: &mut BufReader<UnixStream>, deadline: Instant) -> Option<ExitStatus> {
    let mut line = String::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let _ = conn
            .get_ref()
            .set_read_timeout(Some(left.max(Duration::from_millis(1))));
        match conn.read_line(&mut line) {
            Ok(0) => return None,
            Ok(_) if line.ends_with('\n') => {
                let v: Value = serde_json::from_str(&line).ok()?;
                return v["status"]
                    .as_i64()
                    .and_then(|s| i32::try_from(s).ok())
                    .map(ExitStatus::from_raw);
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if Instant::now() >= deadline {
                    return None;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}
