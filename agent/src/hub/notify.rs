//! systemd notifications: `READY=1`, `WATCHDOG=1`, `STOPPING=1`, `STATUS=…`.
//!
//! A datagram to the socket named by `$NOTIFY_SOCKET` (a path, or an abstract name written
//! with a leading `@`), sent without blocking: when systemd's queue is full the notification
//! is dropped rather than stalling the agent. Without the variable (not started by systemd with `Type=notify`) every
//! call does nothing. The watchdog interval is half of `$WATCHDOG_USEC`, and only when
//! `$WATCHDOG_PID` is unset or names this process.
//!
//! This module only sends; when to ping the watchdog is [`Liveness`]'s decision: the agent
//! pings while its own loops (the hub loop, the spool ingester) keep turning, whether or not
//! the hub answers. A hub outage is reported (`STATUS=`, the log), never punished with a
//! restart: a restart cannot bring a hub back, and it would interrupt running transactions.

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

/// The daemon's loops whose turning the watchdog vouches for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DaemonLoop {
    /// The hub loop: the session, or the reconnect wait between sessions, or the idle wait
    /// without a hub.
    Hub,
    /// The loop moving spooled reports into the outbox.
    Spool,
}

impl DaemonLoop {
    const ALL: [DaemonLoop; 2] = [DaemonLoop::Hub, DaemonLoop::Spool];

    /// The loop's name in the log and the status line.
    pub fn as_str(self) -> &'static str {
        match self {
            DaemonLoop::Hub => "hub loop",
            DaemonLoop::Spool => "spool ingester",
        }
    }
}

/// How often a live loop says so: far more often than any watchdog interval.
pub const LIVENESS_TICK: Duration = Duration::from_millis(100);

/// When the agent may tell systemd it is alive: while every [`DaemonLoop`] turned within
/// `tolerance`. The hub's silence plays no part: the hub loop turns while it reconnects.
#[derive(Debug)]
pub struct Liveness {
    beats: std::sync::Mutex<[Option<Instant>; 2]>,
    tolerance: Duration,
}

impl Liveness {
    /// A tracker; a loop that never beat counts as alive for `tolerance` from now (the start).
    pub fn new(tolerance: Duration) -> Self {
        let now = Instant::now();
        Self {
            beats: std::sync::Mutex::new([Some(now); 2]),
            tolerance,
        }
    }

    /// `lp` turned at `at`.
    pub fn beat_at(&self, lp: DaemonLoop, at: Instant) {
        if let Ok(mut b) = self.beats.lock() {
            b[lp as usize] = Some(at);
        }
    }

    /// `lp` turned now.
    pub fn beat(&self, lp: DaemonLoop) {
        self.beat_at(lp, Instant::now());
    }

    /// `Ok` when every loop turned within the tolerance at `now`, else the first loop that
    /// did not and how long it has been still.
    pub fn check(&self, now: Instant) -> Result<(), (DaemonLoop, Duration)> {
        let Ok(b) = self.beats.lock() else {
            return Err((DaemonLoop::Hub, Duration::MAX));
        };
        for lp in DaemonLoop::ALL {
            let still =
                b[lp as usize].map_or(Duration::MAX, |at| now.saturating_duration_since(at));
            if still > self.tolerance {
                return Err((lp, still));
            }
        }
        Ok(())
    }

    /// Await `fut` while beating for `lp` every [`LIVENESS_TICK`]: for waits that are bounded
    /// by their own timeouts (connect, handshake, the reconnect delay, the idle wait).
    pub async fn beat_while<F: std::future::Future>(&self, lp: DaemonLoop, fut: F) -> F::Output {
        let mut tick = tokio::time::interval(LIVENESS_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(fut);
        loop {
            tokio::select! {
                out = &mut fut => return out,
                _ = tick.tick() => self.beat(lp),
            }
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
    fn the_watchdog_is_fed_while_every_loop_turns() {
        let t0 = Instant::now();
        let l = Liveness::new(Duration::from_secs(10));
        assert_eq!(l.check(t0 + Duration::from_secs(5)), Ok(()));
        l.beat_at(DaemonLoop::Hub, t0 + Duration::from_secs(8));
        // The spool ingester has been still since the start.
        assert_eq!(
            l.check(t0 + Duration::from_secs(12)).map_err(|(lp, _)| lp),
            Err(DaemonLoop::Spool)
        );
        l.beat_at(DaemonLoop::Spool, t0 + Duration::from_secs(12));
        assert_eq!(l.check(t0 + Duration::from_secs(12)), Ok(()));
        // The hub loop stopped turning: no ping, whatever the hub does.
        assert_eq!(
            l.check(t0 + Duration::from_secs(19)).map_err(|(lp, _)| lp),
            Err(DaemonLoop::Hub)
        );
    }

    #[tokio::test]
    async fn beat_while_beats_until_the_wait_ends() {
        let l = Liveness::new(Duration::from_millis(200));
        let last = |lp: DaemonLoop| l.beats.lock().expect("beats")[lp as usize].expect("beat");
        let started = last(DaemonLoop::Spool);
        // The wait ends on an event, not a timer: once the hub loop has beaten a tick after
        // the wait began (a loaded machine only makes that later).
        let out = l
            .beat_while(DaemonLoop::Hub, async {
                while last(DaemonLoop::Hub) < started + LIVENESS_TICK {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                7
            })
            .await;
        assert_eq!(out, 7);
        // The hub loop beat during the wait; the spool ingester did not. Checked at instants
        // derived from the beats, so the scheduler's delays play no part.
        let hub = last(DaemonLoop::Hub);
        assert_eq!(last(DaemonLoop::Spool), started);
        let at = hub + Duration::from_millis(150);
        assert_eq!(l.check(at).map_err(|(lp, _)| lp), Err(DaemonLoop::Spool));
        l.beat_at(DaemonLoop::Spool, hub);
        assert_eq!(l.check(at), Ok(()));
    }
}
