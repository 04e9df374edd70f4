//! systemd notifications: `READY=1`, `WATCHDOG=1`, `STOPPING=1`, `STATUS=…`.
//!
//! A datagram to the socket named by `$NOTIFY_SOCKET` (a path, or an abstract name written
//! with a leading `@`), sent without blocking: when systemd's queue is full the notification
//! is dropped rather than stalling the agent. Without the variable (not started by systemd with `Type=notify`) every
//! call does nothing. The watchdog interval is half of `$WATCHDOG_USEC`, and only when
//! `$WATCHDOG_PID` is unset or names this process.
//!
//! This module only sends; when to send is the session's decision ([`WatchdogPolicy`]): the
//! agent pings the watchdog only while the hub was heard from recently, so systemd restarts an
//! agent whose session is stuck.

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The systemd notification socket of this process, if any.
#[derive(Debug)]
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
    watchdog: Option<Duration>,
    stopping_sent: AtomicBool,
}

impl Notifier {
    /// From `$NOTIFY_SOCKET`, `$WATCHDOG_USEC` and `$WATCHDOG_PID`.
    pub fn from_env() -> Self {
        let socket = std::env::var_os("NOTIFY_SOCKET");
        let usec = std::env::var("WATCHDOG_USEC").ok();
        let pid = std::env::var("WATCHDOG_PID").ok();
        let mut notifier = match socket {
            Some(s) if !s.is_empty() => {
                match Self::to_socket(&s.to_string_lossy()) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::warn!("NOTIFY_SOCKET is set but cannot be used ({e}); no systemd notifications");
                        Self::disabled()
                    }
                }
            }
            _ => Self::disabled(),
        };
        notifier.watchdog = watchdog_interval(usec.as_deref(), pid.as_deref(), std::process::id());
        notifier
    }

    /// A notifier that sends nothing.
    pub fn disabled() -> Self {
        Self {
            target: None,
            watchdog: None,
            stopping_sent: AtomicBool::new(false),
        }
    }

    /// A notifier for this socket name (`/run/systemd/notify` or `@abstract`).
    pub fn to_socket(name: &str) -> io::Result<Self> {
        let addr = socket_addr(name)?;
        let socket = UnixDatagram::unbound()?;
        // Never block the runtime on a full queue: a notification that does not fit is dropped.
        socket.set_nonblocking(true)?;
        Ok(Self {
            target: Some((socket, addr)),
            watchdog: None,
            stopping_sent: AtomicBool::new(false),
        })
    }

    /// Whether notifications go anywhere.
    pub fn enabled(&self) -> bool {
        self.target.is_some()
    }

    /// How often to ping the watchdog (half of `WATCHDOG_USEC`), if systemd watches.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog
    }

    /// Set the watchdog interval (tests; the environment sets it otherwise).
    pub fn with_watchdog(mut self, interval: Option<Duration>) -> Self {
        self.watchdog = interval;
        self
    }

    /// `READY=1` with a status line.
    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={}", one_line(status)));
    }

    /// `WATCHDOG=1`.
    pub fn watchdog(&self) {
        self.send("WATCHDOG=1");
    }

    /// `STOPPING=1` with a status line; only the first call sends.
    pub fn stopping(&self, status: &str) {
        if self.stopping_sent.swap(true, Ordering::SeqCst) {
            return;
        }
        self.send(&format!("STOPPING=1\nSTATUS={}", one_line(status)));
    }

    /// `STATUS=…`.
    pub fn status(&self, status: &str) {
        self.send(&format!("STATUS={}", one_line(status)));
    }

    fn send(&self, text: &str) {
        if let Some((socket, addr)) = &self.target {
            if let Err(e) = socket.send_to_addr(text.as_bytes(), addr) {
                tracing::debug!("cannot notify systemd: {e}");
            }
        }
    }
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

/// The address of a notification socket name: a path, or `@name` for an abstract socket.
pub fn socket_addr(name: &str) -> io::Result<SocketAddr> {
    if let Some(abstract_name) = name.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        SocketAddr::from_abstract_name(abstract_name.as_bytes())
    } else if name.starts_with('/') {
        SocketAddr::from_pathname(name)
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is neither an absolute path nor an @abstract name"),
        ))
    }
}

/// Half of `WATCHDOG_USEC`, when it is set, positive, and `WATCHDOG_PID` (if set) is `pid`.
pub fn watchdog_interval(
    usec: Option<&str>,
    watchdog_pid: Option<&str>,
    pid: u32,
) -> Option<Duration> {
    if let Some(p) = watchdog_pid {
        if p.trim().parse::<u32>().ok() != Some(pid) {
            return None;
        }
    }
    let usec: u64 = usec?.trim().parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// When the agent may tell systemd it is alive: always without a hub, and with a hub only
/// while the hub was heard from within twice its heartbeat interval.
#[derive(Debug, Clone)]
pub struct WatchdogPolicy {
    hub_configured: bool,
    last_heard: Option<Instant>,
    heartbeat: Duration,
}

/// How many heartbeat intervals of silence the watchdog tolerates.
pub const WATCHDOG_SILENCE_FACTOR: u32 = 2;

impl WatchdogPolicy {
    /// A policy; `heartbeat` is replaced by the welcome's interval once a session is up.
    pub fn new(hub_configured: bool, heartbeat: Duration) -> Self {
        Self {
            hub_configured,
            last_heard: None,
            heartbeat,
        }
    }

    /// Something arrived from the hub at `at`.
    pub fn heard(&mut self, at: Instant) {
        self.last_heard = Some(at);
    }

    /// The heartbeat interval of the current session.
    pub fn set_heartbeat(&mut self, heartbeat: Duration) {
        self.heartbeat = heartbeat;
    }

    /// When the hub was last heard from.
    pub fn last_heard(&self) -> Option<Instant> {
        self.last_heard
    }

    /// Whether to ping the watchdog at `now`.
    pub fn healthy(&self, now: Instant) -> bool {
        if !self.hub_configured {
            return true;
        }
        match self.last_heard {
            Some(at) => {
                now.saturating_duration_since(at) <= self.heartbeat * WATCHDOG_SILENCE_FACTOR
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv_all(socket: &UnixDatagram) -> Vec<String> {
        socket.set_nonblocking(true).expect("nonblocking");
        let mut out = Vec::new();
        let mut buf = [0u8; 512];
        while let Ok(n) = socket.recv(&mut buf) {
            out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        out
    }

    #[test]
    fn sends_to_a_path_socket() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("notify");
        let server = UnixDatagram::bind(&path).expect("bind");
        let n = Notifier::to_socket(path.to_str().expect("utf8")).expect("notifier");
        assert!(n.enabled());
        n.ready("connected to hub\nsecond line");
        n.watchdog();
        n.stopping("stopping");
        n.stopping("stopping again");
        assert_eq!(
            recv_all(&server),
            vec![
                "READY=1\nSTATUS=connected to hub second line",
                "WATCHDOG=1",
                "STOPPING=1\nSTATUS=stopping"
            ]
        );
    }

    #[test]
    fn sends_to_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!(
            "felhom-agent-test-{}-{:?}",
            std::process::id(),
            Instant::now()
        );
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("addr");
        let server = UnixDatagram::bind_addr(&addr).expect("bind");
        let n = Notifier::to_socket(&format!("@{name}")).expect("notifier");
        n.watchdog();
        assert_eq!(recv_all(&server), vec!["WATCHDOG=1"]);
    }

    #[test]
    fn relative_names_are_refused_and_disabled_sends_nothing() {
        assert!(Notifier::to_socket("run/notify").is_err());
        let n = Notifier::disabled();
        assert!(!n.enabled());
        n.ready("nothing happens");
    }

    #[test]
    fn watchdog_interval_is_half_and_only_for_this_pid() {
        assert_eq!(
            watchdog_interval(Some("30000000"), None, 7),
            Some(Duration::from_secs(15))
        );
        assert_eq!(
            watchdog_interval(Some("30000000"), Some("7"), 7),
            Some(Duration::from_secs(15))
        );
        assert_eq!(watchdog_interval(Some("30000000"), Some("8"), 7), None);
        assert_eq!(watchdog_interval(Some("0"), None, 7), None);
        assert_eq!(watchdog_interval(Some("soon"), None, 7), None);
        assert_eq!(watchdog_interval(None, None, 7), None);
    }

    #[test]
    fn the_watchdog_is_fed_only_while_the_hub_was_heard_recently() {
        let t0 = Instant::now();
        let beat = Duration::from_secs(10);
        let without_hub = WatchdogPolicy::new(false, beat);
        assert!(without_hub.healthy(t0 + Duration::from_secs(3600)));

        let mut p = WatchdogPolicy::new(true, beat);
        assert!(!p.healthy(t0), "never heard: not healthy");
        p.heard(t0);
        assert!(p.healthy(t0 + Duration::from_secs(20)));
        assert!(!p.healthy(t0 + Duration::from_secs(21)));
        p.set_heartbeat(Duration::from_secs(30));
        assert!(p.healthy(t0 + Duration::from_secs(60)));
        assert!(!p.healthy(t0 + Duration::from_secs(61)));
        p.heard(t0 + Duration::from_secs(100));
        assert!(p.healthy(t0 + Duration::from_secs(110)));
    }
}
