//! Who holds a container's LXC command socket, checked right before every `pct exec`.
//!
//! `pct exec` trusts whoever listens on the container's command socket: pve-container
//! (`src/PVE/LXC.pm` `check_running` → `list_active_containers`) takes a container for running
//! when the abstract name `@/var/lib/lxc/<vmid>/command` shows in `/proc/net/unix`, and
//! `lxc-attach` asks that listener for the init pid, the namespaces and the cgroup it enters
//! (lxc `src/lxc/commands.c` `lxc_cmd_connect`, `lxc_cmd_get_init_pid`). An abstract name belongs
//! to the network namespace and binding one needs no permission, so any local process of the
//! node's network namespace could bind the name of a *stopped* container and answer for it.
//!
//! The name (lxc `src/lxc/commands_utils.c` `lxc_make_abstract_socket_name`): `<lxcpath>/<name>/
//! command` after a leading NUL, and when that does not fit `sun_path` (108 bytes, a leading and
//! a trailing NUL: at most 105 bytes), `lxc/<16 hex digits>/command` with the FNV-1a 64 hash of
//! `<lxcpath>/<name>` (`fnv_64a_buf`, `src/lxc/utils.c`). PVE's lxcpath is LXC's default,
//! `/var/lib/lxc` (pve-container's `check_running` matches that literal).
//!
//! Root's monitor: LXC creates the socket in the process that starts the container, before it
//! runs the container (`lxc_server_init`, `src/lxc/commands.c`), and `listen()` records that
//! process's credentials on it, which `SO_PEERCRED` gives a client. On PVE that process is
//! `/usr/bin/lxc-start -F -n <vmid>`, run as root by `pve-container@<vmid>.service`
//! (pve-container `src/pve-container@.service` `ExecStart`; `-F` keeps it in the foreground, so
//! no fork comes between). A daemonized start's `[lxc monitor] <lxcpath> <name>` title is
//! never the listener: `do_lxcapi_start` (lxc `src/lxc/lxccontainer.c`) creates the socket in
//! `lxc_init_handler` → `lxc_server_init` before it forks, and only the child takes the title
//! (`setproctitle`), so the peer credentials name the parent; such a title is not accepted.
//!
//! [`check_monitor`] connects to the name without blocking (a listener that never accepts cannot
//! stall it; LXC's command handler takes a connection closed without a request as nothing,
//! `lxc_cmd_handler`), reads the listener's credentials and requires uid 0, a live process whose
//! real, effective, saved and filesystem uids are 0, and a command line that is that container's
//! monitor. That alone narrows the window, it does not close it: the monitor can end (the
//! container stops) and another process bind the name between this check and `lxc-attach`'s own
//! connect. So [`container_init`] also asks the verified monitor, on the same connection, for
//! the container's init and holds the init's namespaces open, and every `pct exec` proves that
//! what `lxc-attach` started runs in exactly those namespaces before the command is let run
//! (`super::lxc`, "the first stage").

use std::os::fd::AsRawFd;
use std::path::Path;

pub use crate::config::DEFAULT_LXC_PATH;

/// The most a command line is read.
const MAX_CMDLINE: usize = 4096;

/// The abstract name (without its leading NUL) of container `name`'s command socket under
/// `lxcpath`, as LXC makes it.
pub fn command_socket_name(lxcpath: &str, name: &str) -> String {
    let full = format!("{lxcpath}/{name}/command");
    // sun_path is 108 bytes; LXC keeps a leading and a trailing NUL.
    if full.len() <= 105 {
        return full;
    }
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in format!("{lxcpath}/{name}").bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("lxc/{hash:016x}/command")
}

/// Who holds a container's command socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Monitor {
    /// Nobody listens: the container does not run.
    Absent,
    /// Root's LXC monitor of this container (its pid).
    Trusted(u32),
    /// Someone else, or a listener that cannot be proven: why.
    Untrusted(String),
}

/// Who holds `@<lxcpath>/<vmid>/command` (see the module docs).
pub fn check_monitor(lxcpath: &Path, vmid: u32) -> Monitor {
    match connect_verified(lxcpath, vmid) {
        Ok((_, pid)) => Monitor::Trusted(pid),
        Err(m) => m,
    }
}

/// A connection to container `vmid`'s command socket whose listener was proven to be root's LXC
/// monitor of that container, and that monitor's pid; else what [`check_monitor`] says (never
/// `Trusted`).
fn connect_verified(lxcpath: &Path, vmid: u32) -> Result<(std::os::fd::OwnedFd, u32), Monitor> {
    use nix::sys::socket::{
        connect, getsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, UnixAddr,
    };
    let lxcpath = lxcpath.to_string_lossy();
    let name = command_socket_name(&lxcpath, &vmid.to_string());
    let shown = format!("@{name}");
    let addr = UnixAddr::new_abstract(name.as_bytes())
        .map_err(|e| Monitor::Untrusted(format!("cannot name {shown}: {e}")))?;
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| Monitor::Untrusted(format!("cannot open a socket to ask {shown}: {e}")))?;
    match connect(fd.as_raw_fd(), &addr) {
        Ok(()) => {}
        Err(nix::errno::Errno::ECONNREFUSED | nix::errno::Errno::ENOENT) => {
            return Err(Monitor::Absent)
        }
        Err(nix::errno::Errno::EAGAIN) => {
            return Err(Monitor::Untrusted(format!(
                "the listener of {shown} accepts no connection (its backlog is full)"
            )))
        }
        Err(e) => {
            return Err(Monitor::Untrusted(format!(
                "cannot connect to {shown}: {e}"
            )))
        }
    }
    let cred = getsockopt(&fd, sockopt::PeerCredentials).map_err(|e| {
        Monitor::Untrusted(format!(
            "cannot read the credentials of the listener of {shown}: {e}"
        ))
    })?;
    let (pid, uid) = (cred.pid(), cred.uid());
    if uid != 0 {
        return Err(Monitor::Untrusted(format!(
            "{shown} is held by uid {uid} (pid {pid}), not by root's LXC monitor"
        )));
    }
    let pid = u32::try_from(pid).ok().filter(|p| *p != 0).ok_or_else(|| {
        Monitor::Untrusted(format!(
            "{shown} is held by no process of this pid namespace"
        ))
    })?;
    let proc_dir = Path::new("/proc").join(pid.to_string());
    let status = std::fs::read_to_string(proc_dir.join("status")).unwrap_or_default();
    let root_only = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .is_some_and(|ids| {
            let ids: Vec<&str> = ids.split_whitespace().collect();
            ids.len() == 4 && ids.iter().all(|i| *i == "0")
        });
    if !root_only {
        return Err(Monitor::Untrusted(format!(
            "the process {pid} that listens on {shown} is gone or no longer root's"
        )));
    }
    let cmdline = read_cmdline(&proc_dir.join("cmdline"));
    if !is_monitor_cmdline(&cmdline, &lxcpath, vmid) {
        return Err(Monitor::Untrusted(format!(
            "the root process {pid} that listens on {shown} is not the LXC monitor of {vmid} (its command line: {})",
            crate::error::outside_text(&String::from_utf8_lossy(&cmdline))
        )));
    }
    Ok((fd, pid))
}

/// LXC's `LXC_CMD_GET_INIT_PID` (lxc `src/lxc/commands.h` `lxc_cmd_t`).
const LXC_CMD_GET_INIT_PID: i32 = 4;
/// How long root's monitor may take to answer.
const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The namespaces an attached process shares with the container's init (lxc `src/lxc/
/// namespace.c` `ns_info`; the time namespace is left out: LXC enters it only when the
/// container has one of its own, and PVE makes none).
pub const NAMESPACES: [&str; 7] = ["mnt", "pid", "user", "net", "uts", "ipc", "cgroup"];

/// One namespace of the container's init, held open: while the descriptor is open the
/// namespace lives, so no other namespace can get its inode number.
#[derive(Debug)]
pub struct HeldNamespace {
    /// Its name in `/proc/<pid>/ns/`.
    pub name: &'static str,
    /// The device of the namespace file system.
    pub dev: u64,
    /// The namespace's inode number.
    pub ino: u64,
    _file: std::fs::File,
}

impl HeldNamespace {
    /// The namespace's open file (root may name it to a child as `/proc/<pid>/fd/<n>`).
    pub fn file(&self) -> &std::fs::File {
        &self._file
    }
}

/// A running container's init as root's LXC monitor named it, with its namespaces held open
/// ([`container_init`]).
#[derive(Debug)]
pub struct ContainerInit {
    /// Root's LXC monitor of the container.
    pub monitor: u32,
    /// The init's pid (in this pid namespace).
    pub pid: u32,
    /// Its namespaces, [`NAMESPACES`] in order.
    pub namespaces: Vec<HeldNamespace>,
}

/// The init of container `vmid`, asked of root's LXC monitor on a connection whose listener was
/// proven to be that monitor ([`check_monitor`]'s checks, then `LXC_CMD_GET_INIT_PID` on the
/// same connection), with its namespaces opened through `/proc/<pid>/ns/*` and held. The monitor
/// is asked twice, the namespaces opened between the two answers: the same monitor naming the
/// same init after the opens means the init was not reaped in between (the monitor is its
/// parent and reaper, lxc `src/lxc/start.c`), so its pid could not be reused and what was
/// opened is the init's. `Err` says why not: [`Monitor::Absent`] when the container does not run
/// (or stops meanwhile), [`Monitor::Untrusted`] otherwise.
pub fn container_init(lxcpath: &Path, vmid: u32) -> Result<ContainerInit, Monitor> {
    use std::os::unix::fs::MetadataExt;
    let shown = format!(
        "@{}",
        command_socket_name(&lxcpath.to_string_lossy(), &vmid.to_string())
    );
    let (fd, monitor) = connect_verified(lxcpath, vmid)?;
    let pid = ask_init_pid(fd, &shown, monitor)?;
    let proc_dir = Path::new("/proc").join(pid.to_string());
    let mut namespaces = Vec::with_capacity(NAMESPACES.len());
    for name in NAMESPACES {
        let path = proc_dir.join("ns").join(name);
        let opened = std::fs::File::open(&path).and_then(|f| f.metadata().map(|m| (f, m)));
        match opened {
            Ok((file, meta)) => namespaces.push(HeldNamespace {
                name,
                dev: meta.dev(),
                ino: meta.ino(),
                _file: file,
            }),
            // The init ended: the container is stopping.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Monitor::Absent),
            Err(e) => {
                return Err(Monitor::Untrusted(format!(
                    "cannot open {} of the init {pid} that root's LXC monitor {monitor} named on {shown}: {e}",
                    path.display()
                )))
            }
        }
    }
    let (fd, again) = connect_verified(lxcpath, vmid)?;
    let pid_again = ask_init_pid(fd, &shown, again)?;
    if again != monitor || pid_again != pid {
        return Err(Monitor::Untrusted(format!(
            "the container restarted while its init was looked up (monitor {monitor}, init {pid}; then monitor {again}, init {pid_again}); retry"
        )));
    }
    Ok(ContainerInit {
        monitor,
        pid,
        namespaces,
    })
}

/// Send `LXC_CMD_GET_INIT_PID` on `fd` and read the answer (lxc `src/lxc/commands.c`
/// `lxc_cmd_send`, `lxc_cmd_rsp_recv`, `lxc_cmd_get_init_pid_callback`): the request is
/// `struct lxc_cmd_req { int cmd; int datalen; const void *data; }`, the answer `struct
/// lxc_cmd_rsp { int ret; int datalen; void *data; }` with the pid in `data`, both in the
/// machine's own layout.
fn ask_init_pid(fd: std::os::fd::OwnedFd, shown: &str, monitor: u32) -> Result<u32, Monitor> {
    use std::io::{Read, Write};
    const WORD: usize = std::mem::size_of::<usize>();
    let mut stream = std::os::unix::net::UnixStream::from(fd);
    let untrusted = |what: String| {
        Monitor::Untrusted(format!(
            "root's LXC monitor {monitor} on {shown} did not name the container's init: {what}"
        ))
    };
    // Our credentials go with the request whatever the monitor's socket says: LXC checks them
    // (`lxc_abstract_unix_rcv_credential`: uid 0 or its own) but turns on `SO_PASSCRED` on the
    // accepted connection only after `accept` (`lxc_cmd_accept`), and the kernel attaches
    // credentials to a message only when the sender's or the receiver's socket asks for them
    // (or the receiver is not accepted yet: `net/unix/af_unix.c` `unix_passcred_enabled`). A
    // request that lands in between arrives with the overflow uid (65534) and LXC answers
    // `-EPERM`. LXC's own clients send them explicitly (`lxc_abstract_unix_send_credential`).
    nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::PassCred, &true)
        .map_err(|e| untrusted(format!("cannot send our credentials: {e}")))?;
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(ANSWER_TIMEOUT)))
        .and_then(|()| stream.set_write_timeout(Some(ANSWER_TIMEOUT)))
        .map_err(|e| untrusted(e.to_string()))?;
    let mut request = Vec::with_capacity(8 + WORD);
    request.extend_from_slice(&LXC_CMD_GET_INIT_PID.to_ne_bytes());
    request.extend_from_slice(&0i32.to_ne_bytes());
    request.extend_from_slice(&[0u8; WORD]);
    match stream.write_all(&request) {
        Ok(()) => {}
        // The monitor closed the connection: the container stopped.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Err(Monitor::Absent),
        Err(e) => return Err(untrusted(format!("sending the request: {e}"))),
    }
    let mut answer = [0u8; 8 + WORD];
    match stream.read_exact(&mut answer) {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            return Err(Monitor::Absent)
        }
        Err(e) => return Err(untrusted(format!("reading the answer: {e}"))),
    }
    let ret = i32::from_ne_bytes([answer[0], answer[1], answer[2], answer[3]]);
    let datalen = i32::from_ne_bytes([answer[4], answer[5], answer[6], answer[7]]);
    let mut data = [0u8; WORD];
    data.copy_from_slice(&answer[8..]);
    let data = isize::from_ne_bytes(data);
    if ret != 0 || datalen != 0 {
        return Err(untrusted(format!(
            "it answered ret {ret}, {datalen} bytes of data"
        )));
    }
    // LXC's PTR_TO_PID: the pid is the pointer's value.
    match i32::try_from(data).ok().and_then(|p| u32::try_from(p).ok()) {
        Some(pid) if pid > 1 => Ok(pid),
        // -1: no init (yet, or any more).
        _ if data < 0 => Err(Monitor::Absent),
        _ => Err(untrusted(format!("it named pid {data}"))),
    }
}

fn read_cmdline(path: &Path) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    if let Ok(f) = std::fs::File::open(path) {
        let _ = f.take(MAX_CMDLINE as u64).read_to_end(&mut out);
    }
    out
}

/// Whether `cmdline` (`/proc/<pid>/cmdline`) is LXC's monitor of container `vmid`:
/// `lxc-start … -n <vmid>` (PVE's `lxc-start -F -n <vmid>`). A command line written over its
/// arguments shows as one string with spaces; it is split on them. The lxcpath is not in
/// PVE's command line: a start under another lxcpath binds another name.
pub fn is_monitor_cmdline(cmdline: &[u8], _lxcpath: &str, vmid: u32) -> bool {
    let text = String::from_utf8_lossy(cmdline);
    let mut args: Vec<&str> = text.split('\0').filter(|a| !a.is_empty()).collect();
    if args.len() == 1 {
        args = args[0].split_ascii_whitespace().collect();
    }
    let vmid = vmid.to_string();
    let Some(first) = args.first() else {
        return false;
    };
    if first.rsplit('/').next() != Some("lxc-start") {
        return false;
    }
    let mut names = Vec::new();
    let mut rest = args[1..].iter();
    while let Some(a) = rest.next() {
        match *a {
            "-n" | "--name" => names.extend(rest.next().copied()),
            _ => {
                if let Some(v) = a.strip_prefix("--name=") {
                    names.push(v);
                } else if let Some(v) = a.strip_prefix("-n").filter(|v| !v.is_empty()) {
                    names.push(v);
                }
            }
        }
    }
    names.len() == 1 && names[0] == vmid
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LXC's side of one command connection, in LXC's order (`lxc_cmd_accept`, then
    /// `lxc_cmd_handler`): `SO_PASSCRED` turned on only once the request is already queued (the
    /// window under load), the sender's credentials read as `lxc_abstract_unix_rcv_credential`
    /// reads them (a uid other than 0 and its own: `-EPERM`), else the init pid 4242 answered.
    fn lxc_monitor_late_passcred(server: std::os::unix::net::UnixStream) -> i32 {
        use nix::sys::socket::{recv, recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags};
        use std::io::Write;
        let mut server = server;
        // Wait until the request is queued (a blocking peek), then ask for credentials.
        let mut peek = [0u8; 1];
        recv(server.as_raw_fd(), &mut peek, MsgFlags::MSG_PEEK).expect("peek");
        setsockopt(&server, sockopt::PassCred, &true).expect("SO_PASSCRED");
        let mut req = [0u8; 16];
        let mut iov = [std::io::IoSliceMut::new(&mut req)];
        let mut space = nix::cmsg_space!(nix::sys::socket::UnixCredentials);
        let msg = recvmsg::<()>(
            server.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::empty(),
        )
        .expect("recvmsg");
        let uid = msg
            .cmsgs()
            .expect("cmsgs")
            .find_map(|c| match c {
                ControlMessageOwned::ScmCredentials(c) => Some(c.uid()),
                _ => None,
            })
            .expect("SCM_CREDENTIALS");
        let (ret, pid): (i32, isize) = if uid != 0 && uid != nix::unistd::getuid().as_raw() {
            (-1, 0)
        } else {
            (0, 4242)
        };
        let mut answer = Vec::new();
        answer.extend_from_slice(&ret.to_ne_bytes());
        answer.extend_from_slice(&0i32.to_ne_bytes());
        answer.extend_from_slice(&pid.to_ne_bytes());
        server.write_all(&answer).expect("answer");
        i32::try_from(uid).unwrap_or(-1)
    }

    #[test]
    fn a_request_sent_before_the_monitor_asks_for_credentials_still_carries_ours() {
        use std::os::fd::OwnedFd;
        let (client, server) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        let monitor = std::thread::spawn(move || lxc_monitor_late_passcred(server));
        let asked = ask_init_pid(OwnedFd::from(client), "@test/120/command", 1);
        let seen_uid = monitor.join().expect("monitor thread");
        let me = i32::try_from(nix::unistd::getuid().as_raw()).unwrap_or(-1);
        assert_eq!(seen_uid, me, "the monitor saw no credentials of ours");
        assert!(matches!(asked, Ok(4242)), "{asked:?}");
    }

    #[test]
    fn the_name_is_lxcs_and_is_hashed_when_it_does_not_fit() {
        assert_eq!(
            command_socket_name("/var/lib/lxc", "120"),
            "/var/lib/lxc/120/command"
        );
        // 105 bytes fit, 106 do not.
        let fits = format!("/{}", "a".repeat(105 - 1 - "/x/command".len()));
        assert_eq!(command_socket_name(&fits, "x").len(), 105);
        let long = format!("/{}", "a".repeat(106 - 1 - "/x/command".len()));
        let hashed = command_socket_name(&long, "x");
        assert!(
            hashed.starts_with("lxc/") && hashed.ends_with("/command"),
            "{hashed}"
        );
        assert_eq!(hashed.len(), "lxc/".len() + 16 + "/command".len());
        // FNV-1a 64 of "a": af63dc4c8601ec8c (the published test vector).
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        h ^= u64::from(b'a');
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        assert_eq!(h, 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn only_the_containers_own_monitor_command_line_counts() {
        let ok = |c: &[u8]| is_monitor_cmdline(c, "/var/lib/lxc", 120);
        assert!(ok(b"/usr/bin/lxc-start\x00-F\x00-n\x00120\x00"));
        assert!(ok(b"lxc-start\x00-F\x00-n120\x00"));
        assert!(ok(b"/usr/bin/lxc-start\x00-F\x00--name=120\x00"));
        assert!(ok(b"/usr/bin/lxc-start -F -n 120\x00\x00\x00"));
        // The title of a daemonized start's child, which never holds the socket.
        assert!(!ok(b"[lxc monitor] /var/lib/lxc 120\x00"));
        assert!(!ok(b"[lxc monitor] /tmp/lxc 120\x00"));
        assert!(!ok(b"/usr/bin/lxc-start\x00-F\x00-n\x00121\x00"));
        assert!(!ok(
            b"/usr/bin/lxc-start\x00-F\x00-n\x00120\x00-n\x00121\x00"
        ));
        assert!(!ok(b"/usr/bin/lxc-attach\x00-n\x00120\x00"));
        assert!(!ok(b"/usr/bin/perl\x00lxc-start\x00-n\x00120\x00"));
        assert!(!ok(b""));
    }

    #[test]
    fn nobody_listening_is_absent() {
        let path = format!("/nonexistent/felhom-{}", std::process::id());
        assert_eq!(check_monitor(Path::new(&path), 120), Monitor::Absent);
        assert!(matches!(
            container_init(Path::new(&path), 120),
            Err(Monitor::Absent)
        ));
    }
}
