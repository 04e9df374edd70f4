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
//! monitor. It narrows the window, it does not close it: the monitor can end (the container
//! stops) and another process bind the name between this check and `lxc-attach`'s own connect.
//! The units close it for the agent's user (`systemd/README.md`: no abstract socket in the
//! node's network namespace).

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
    use nix::sys::socket::{
        connect, getsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, UnixAddr,
    };
    let lxcpath = lxcpath.to_string_lossy();
    let name = command_socket_name(&lxcpath, &vmid.to_string());
    let shown = format!("@{name}");
    let addr = match UnixAddr::new_abstract(name.as_bytes()) {
        Ok(a) => a,
        Err(e) => return Monitor::Untrusted(format!("cannot name {shown}: {e}")),
    };
    let fd = match socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    ) {
        Ok(fd) => fd,
        Err(e) => return Monitor::Untrusted(format!("cannot open a socket to ask {shown}: {e}")),
    };
    match connect(fd.as_raw_fd(), &addr) {
        Ok(()) => {}
        Err(nix::errno::Errno::ECONNREFUSED | nix::errno::Errno::ENOENT) => return Monitor::Absent,
        Err(nix::errno::Errno::EAGAIN) => {
            return Monitor::Untrusted(format!(
                "the listener of {shown} accepts no connection (its backlog is full)"
            ))
        }
        Err(e) => return Monitor::Untrusted(format!("cannot connect to {shown}: {e}")),
    }
    let cred = match getsockopt(&fd, sockopt::PeerCredentials) {
        Ok(c) => c,
        Err(e) => {
            return Monitor::Untrusted(format!(
                "cannot read the credentials of the listener of {shown}: {e}"
            ))
        }
    };
    drop(fd);
    let (pid, uid) = (cred.pid(), cred.uid());
    if uid != 0 {
        return Monitor::Untrusted(format!(
            "{shown} is held by uid {uid} (pid {pid}), not by root's LXC monitor"
        ));
    }
    let Ok(pid) = u32::try_from(pid) else {
        return Monitor::Untrusted(format!(
            "{shown} is held by no process of this pid namespace"
        ));
    };
    if pid == 0 {
        return Monitor::Untrusted(format!(
            "{shown} is held by no process of this pid namespace"
        ));
    }
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
        return Monitor::Untrusted(format!(
            "the process {pid} that listens on {shown} is gone or no longer root's"
        ));
    }
    let cmdline = read_cmdline(&proc_dir.join("cmdline"));
    if !is_monitor_cmdline(&cmdline, &lxcpath, vmid) {
        return Monitor::Untrusted(format!(
            "the root process {pid} that listens on {shown} is not the LXC monitor of {vmid} (its command line: {})",
            crate::error::outside_text(&String::from_utf8_lossy(&cmdline))
        ));
    }
    Monitor::Trusted(pid)
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
    }
}
