//! systemd notifications from `felhom-agent run`, read from a real datagram socket named by
//! `NOTIFY_SOCKET`: READY=1 within seconds of the start, whatever the hub (down: its state is
//! in STATUS=) and whatever a previous run left open (a provision killed during a long restore
//! is resumed in the background after READY and ends ok), WATCHDOG=1 while the agent's own
//! loops turn, also while the hub is away (an outage is a STATUS= line, not a restart), and no
//! more once the hub loop hangs; STOPPING=1 at SIGTERM. Without a hub, reports wait in the
//! outbox.

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use felhom_agent::hub::outbox::Outbox;
use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{AgentFiles, AgentOptions, FakePve};
use felhom_tests::world::World;
use hub_protocol::{AgentMessage, Outcome, Phase, TxnId, TxnKind, TxnResult};

const WAIT: Duration = Duration::from_secs(20);
/// How soon after its start the daemon must have sent READY=1.
const READY_WITHIN: Duration = Duration::from_secs(10);
/// WATCHDOG_USEC for the agent (WatchdogSec=1s): it pings every half of it.
const WATCHDOG_USEC: &str = "1000000";
const WATCHDOG_SEC: Duration = Duration::from_secs(1);

/// The socket systemd would listen on, read by a thread that keeps every datagram with the
/// time it arrived (so the agent's queue never fills).
struct NotifySocket {
    path: String,
    received: Arc<Mutex<Vec<(Instant, String)>>>,
    stop: Arc<AtomicBool>,
    reader: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl NotifySocket {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("notify");
        let socket = UnixDatagram::bind(&path).expect("bind");
        socket
            .set_read_timeout(Some(Duration::from_millis(20)))
            .expect("timeout");
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (received, stop) = (received.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(n) = socket.recv(&mut buf) {
                        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                        received.lock().expect("lock").push((Instant::now(), text));
                    }
                }
            })
        };
        Self {
            path: path.to_string_lossy().into_owned(),
            received,
            stop,
            reader: Some(reader),
            _dir: dir,
        }
    }

    /// The datagrams that arrived in `[from, to)`.
    fn between(&self, from: Instant, to: Instant) -> Vec<String> {
        self.received
            .lock()
            .expect("lock")
            .iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|(_, m)| m.clone())
            .collect()
    }

    /// The datagrams that arrived since `from`.
    fn since(&self, from: Instant) -> Vec<String> {
        self.between(from, Instant::now() + Duration::from_secs(3600))
    }

    /// Wait until a datagram starting with `prefix` arrived after `from`; returns those since
    /// `from`.
    fn wait_for(&self, prefix: &str, from: Instant, timeout: Duration) -> Vec<String> {
        self.wait_for_count(prefix, 1, from, timeout)
    }

    /// Wait until `n` datagrams starting with `prefix` arrived after `from`; returns those
    /// since `from`.
    fn wait_for_count(
        &self,
        prefix: &str,
        n: usize,
        from: Instant,
        timeout: Duration,
    ) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.since(from);
            if count(&seen, prefix) >= n {
                return seen;
            }
            assert!(
                Instant::now() < deadline,
                "not {n} {prefix} within {timeout:?}; got {seen:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait until no datagram starting with `prefix` arrived for `quiet`, counting from
    /// `from`; returns when the quiet began.
    fn wait_for_quiet(
        &self,
        prefix: &str,
        quiet: Duration,
        from: Instant,
        timeout: Duration,
    ) -> Instant {
        let deadline = Instant::now() + timeout;
        loop {
            let last = self
                .received
                .lock()
                .expect("lock")
                .iter()
                .filter(|(at, m)| *at >= from && m.starts_with(prefix))
                .map(|(at, _)| *at)
                .max()
                .unwrap_or(from);
            if last.elapsed() >= quiet {
                return last;
            }
            assert!(
                Instant::now() < deadline,
                "{prefix} still arriving {timeout:?} after {from:?}: {:?}",
                self.since(from)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

fn count(messages: &[String], prefix: &str) -> usize {
    messages.iter().filter(|m| m.starts_with(prefix)).count()
}

/// The longest time in `[from, to)` without a datagram starting with `prefix` (the edges
/// count as datagrams).
fn longest_gap(socket: &NotifySocket, prefix: &str, from: Instant, to: Instant) -> Duration {
    let mut times: Vec<Instant> = socket
        .received
        .lock()
        .expect("lock")
        .iter()
        .filter(|(at, m)| *at >= from && *at < to && m.starts_with(prefix))
        .map(|(at, _)| *at)
        .collect();
    times.insert(0, from);
    times.push(to);
    times
        .windows(2)
        .map(|w| w[1].saturating_duration_since(w[0]))
        .max()
        .unwrap_or_default()
}

#[test]
fn ready_comes_at_once_with_the_hub_down_and_a_hub_outage_does_not_starve_the_watchdog() {
    let pve = FakePve::demo();
    let mut hub = DevHub::start(DevHubOptions::default());
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    hub.stop();
    let notify = NotifySocket::new();
    let t0 = Instant::now();
    let mut agent = AgentDaemon::spawn(
        &files.config_path,
        FAST_TIMING,
        &[
            ("NOTIFY_SOCKET", notify.path.as_str()),
            ("WATCHDOG_USEC", WATCHDOG_USEC),
        ],
    );
    // The hub is down from the start (its port closed): READY all the same once the local
    // start is done, within seconds, the hub's state in STATUS=; the pings go on.
    let seen = notify.wait_for("READY=1", t0, READY_WITHIN);
    assert!(
        t0.elapsed() < READY_WITHIN,
        "READY after {:?}",
        t0.elapsed()
    );
    let ready = seen
        .iter()
        .find(|m| m.starts_with("READY=1"))
        .expect("READY");
    assert!(
        ready.contains("STATUS=") && ready.contains("hub: connecting to"),
        "READY does not say the hub's state: {ready:?}"
    );
    notify.wait_for("STATUS=hub unreachable", t0, WAIT);
    notify.wait_for_count("WATCHDOG=1", 3, t0, WAIT);

    let t1 = Instant::now();
    hub.restart();
    notify.wait_for("STATUS=connected to the hub", t1, WAIT);
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);
    let t2 = Instant::now();
    notify.wait_for_count("WATCHDOG=1", 3, t2, WAIT);

    // The hub goes away for four times WatchdogSec (and longer than the agent's own silence
    // limit of three heartbeats): systemd would restart an agent that missed one ping for
    // WatchdogSec. The pings go on, never more than WatchdogSec apart, and the agent lives.
    hub.stop();
    let stopped = Instant::now();
    std::thread::sleep(WATCHDOG_SEC * 4);
    let back = Instant::now();
    let gap = longest_gap(&notify, "WATCHDOG=1", stopped, back);
    assert!(
        gap < WATCHDOG_SEC,
        "a watchdog gap of {gap:?} while the hub was away: systemd would have restarted the agent; {:?}",
        notify.since(stopped)
    );
    assert!(agent.alive(), "the agent exited while the hub was away");
    // The outage is reported: one status line, not one per reconnect attempt.
    let outage = notify.since(stopped);
    let statuses = count(&outage, "STATUS=hub unreachable");
    assert!((1..=2).contains(&statuses), "{outage:?}");
    assert!(
        agent.log().contains("reconnecting"),
        "the outage is not in the log:\n{}",
        agent.log()
    );

    // The same process reconnects when the hub is back: no restart was needed.
    hub.restart();
    hub.wait_for("the second session", WAIT, |s| s.sessions == 2);
    notify.wait_for("WATCHDOG=1", back, WAIT);

    let t4 = Instant::now();
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
    notify.wait_for("STOPPING=1", t4, WAIT);
    let all = notify.since(t0);
    let end = notify.since(t4);
    assert_eq!(count(&end, "STOPPING=1"), 1, "{end:?}");
    assert_eq!(
        count(&all, "READY=1"),
        1,
        "READY sent more than once: {all:?}"
    );
}

#[test]
fn a_hub_loop_that_stops_turning_starves_the_watchdog() {
    let pve = FakePve::demo();
    let hub = DevHub::start(DevHubOptions::default());
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    let notify = NotifySocket::new();
    let t0 = Instant::now();
    let t0_wall = std::time::SystemTime::now();
    // The test hook makes the session loop await forever 3 s after the start, while the rest
    // of the process (the runtime, the watchdog task) goes on.
    let timing = format!("{FAST_TIMING},hang_hub_loop_after_ms=3000");
    let agent = AgentDaemon::spawn(
        &files.config_path,
        &timing,
        &[
            ("NOTIFY_SOCKET", notify.path.as_str()),
            ("WATCHDOG_USEC", WATCHDOG_USEC),
        ],
    );
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);
    notify.wait_for_count("WATCHDOG=1", 2, t0, WAIT);
    // When the loop hung: the hook's log line, on the agent's own clock (3 s after the agent's
    // start, which a loaded machine may delay well past the test's), taken onto the test's.
    let needle = "the hub loop stops turning now";
    agent.wait_for_log(needle, WAIT);
    let log = agent.log();
    let stamp = log
        .lines()
        .find(|l| l.contains(needle))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_default()
        .to_string();
    let hung_wall =
        time::OffsetDateTime::parse(&stamp, &time::format_description::well_known::Rfc3339)
            .unwrap_or_else(|e| panic!("the hook's log line has no time ({stamp:?}: {e}):\n{log}"));
    let since_t0 =
        u64::try_from((hung_wall - time::OffsetDateTime::from(t0_wall)).whole_milliseconds())
            .unwrap_or(0);
    let hang_at = t0 + Duration::from_millis(since_t0);
    // Once the loop hangs, the pings stop for good (within the tolerance of WatchdogSec and
    // one ping interval): quiet for three times WatchdogSec.
    let quiet_from = notify.wait_for_quiet("WATCHDOG=1", WATCHDOG_SEC * 3, t0, WAIT);
    assert!(
        quiet_from < hang_at + WATCHDOG_SEC * 2,
        "the pings went on {:?} after the hang",
        quiet_from.saturating_duration_since(hang_at)
    );
    assert!(
        quiet_from + WATCHDOG_SEC * 2 > hang_at,
        "the pings stopped {:?} before the hang",
        hang_at.saturating_duration_since(quiet_from)
    );
    agent.wait_for_log("hub loop has not turned", WAIT);
    let log = agent.kill();
    assert!(log.contains("stops turning"), "{log}");
}

fn seed_result(state_dir: &Path) -> TxnId {
    let txn = TxnId::from_ulid(ulid::Ulid::new());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (outbox, _) = Outbox::open(state_dir).expect("open");
        outbox
            .push(AgentMessage::Result(TxnResult {
                txn,
                kind: TxnKind::SelftestRestore,
                vmid: None,
                outcome: Outcome::Skipped,
                phase: Phase::Skipped,
                destroy_armed: false,
                destroyed: false,
                checks: vec![],
                isolation: None,
                error: None,
                guest: None,
                backup: None,
                group: None,
            }))
            .await
            .expect("push");
        outbox.close().await;
    });
    txn
}

#[test]
fn without_a_hub_it_is_ready_at_once_and_reports_wait_in_the_outbox() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let txn = seed_result(&files.state_dir);
    let log_path = files.state_dir.join("outbox").join("outbox.log");
    let before = std::fs::read_to_string(&log_path).expect("outbox.log");
    assert!(before.contains(&txn.to_string()));

    let notify = NotifySocket::new();
    let t0 = Instant::now();
    let agent = AgentDaemon::spawn(
        &files.config_path,
        FAST_TIMING,
        &[
            ("NOTIFY_SOCKET", notify.path.as_str()),
            ("WATCHDOG_USEC", WATCHDOG_USEC),
        ],
    );
    let seen = notify.wait_for("READY=1", t0, WAIT);
    assert!(
        seen.iter().any(|m| m.contains("no hub configured")),
        "{seen:?}"
    );
    notify.wait_for("WATCHDOG=1", t0, WAIT);
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
    notify.wait_for("STOPPING=1", t0, WAIT);
    assert_eq!(count(&notify.since(t0), "STOPPING=1"), 1);
    assert!(log.contains("1 messages wait"), "{log}");
    let after = std::fs::read_to_string(&log_path).expect("outbox.log");
    assert_eq!(after, before, "the waiting report changed without a hub");
}

/// A provision killed (SIGKILL) while its restore of 60 PVE-seconds runs: the restarted daemon
/// is READY within seconds, while it still follows that task in the background, and the
/// provision ends `ok` (one result, one restore POST, no task stopped).
#[test]
fn a_crash_during_a_long_restore_is_ready_at_once_and_the_provision_ends_ok() {
    let hub = DevHub::start(DevHubOptions::default());
    let w = World::with_options(
        felhom_tests::fakepve::demo_scenario(),
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    // 60 PVE-seconds of restore, 12 real seconds.
    w.pve
        .set(serde_json::json!({"time_scale": 0.2, "ct_secs": {"create": 60}}));
    let path = w.path();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);
    let txn = hub.dispatch(hub_protocol::DispatchAction::Provision {
        vmid: 6500,
        from: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
        storage: "local-lvm".to_string(),
        keep: false,
        profile: None,
        isolate_network: None,
    });
    let deadline = Instant::now() + WAIT;
    let upid = loop {
        let journaled = felhom_agent::provision::Journal::open(&w.state_dir())
            .expect("journal")
            .get(txn.ulid())
            .expect("read");
        if let Some(u) = journaled.and_then(|t| t.state.upid().map(str::to_string)) {
            break u;
        }
        assert!(Instant::now() < deadline, "no UPID journaled for 6500");
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = agent.kill();

    let notify = NotifySocket::new();
    let t0 = Instant::now();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[
            ("PATH", path.as_str()),
            ("NOTIFY_SOCKET", notify.path.as_str()),
            ("WATCHDOG_USEC", WATCHDOG_USEC),
        ],
    );
    notify.wait_for("READY=1", t0, READY_WITHIN);
    assert!(
        t0.elapsed() < READY_WITHIN,
        "READY after {:?}",
        t0.elapsed()
    );
    let task_running = || {
        w.pve
            .tasks()
            .iter()
            .any(|t| t["upid"].as_str() == Some(upid.as_str()) && t["status"] == "running")
    };
    assert!(
        task_running(),
        "the restore ended before READY: the test proves nothing"
    );
    // The session serves other dispatches meanwhile: a destroy of a guest this agent never
    // created is answered (refused) while the resumed restore still runs.
    hub.wait_for("the session after the restart", WAIT, |s| s.sessions == 2);
    let other = hub.dispatch(hub_protocol::DispatchAction::Destroy { vmid: 101 });
    let served = hub.wait_for("the other dispatch's result", WAIT, |s| {
        s.results.contains_key(&other)
    });
    assert!(
        !served.results.contains_key(&txn) && task_running(),
        "the other dispatch waited for the resumed provision"
    );
    assert_eq!(served.results[&other][0].1.outcome, Outcome::Refused);
    assert!(w.pve.writes_for(101).is_empty(), "101 was written");
    let state = hub.wait_for(
        "the result after the restart",
        Duration::from_secs(90),
        |s| s.results.contains_key(&txn),
    );
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
    assert_eq!(state.results[&txn].len(), 1, "the result was applied twice");
    let result = &state.results[&txn][0].1;
    assert_eq!(result.outcome, Outcome::Ok, "{result:?}\n{log}");
    assert!(result.destroyed && result.error.is_none(), "{result:?}");
    let requests = w.pve.requests();
    assert_eq!(
        requests
            .iter()
            .filter(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/lxc")
            .count(),
        1,
        "the restore was sent again"
    );
    assert!(
        !requests
            .iter()
            .any(|r| r.method == "DELETE" && r.api_path().starts_with("/nodes/pve1/tasks/")),
        "a PVE task was stopped"
    );
}
