//! A long outage leaves a large backlog in the outbox: when the hub is reachable again every
//! message arrives once, in the order it was stored, while the hub's acks flow back on the
//! same socket (neither side blocks on a full socket), and the outbox drains to nothing.

/// Printed straight to stderr, past the test harness's capture, so the figures show in every
/// run and not only in failing ones.
macro_rules! report {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

use std::time::{Duration, Instant};

use felhom_agent::hub::outbox::{now_timestamp, Outbox};
use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{AgentFiles, AgentOptions, FakePve};
use hub_protocol::{AgentMessage, Event, MessageId, Phase, TxnId, TxnKind};

const BACKLOG: usize = 10_000;
const WAIT: Duration = Duration::from_secs(120);

#[test]
fn a_large_backlog_is_delivered_in_order_and_drains() {
    let pve = FakePve::demo();
    let hub = DevHub::start(DevHubOptions::default());
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let stored: Vec<MessageId> = rt.block_on(async {
        let (outbox, _) = Outbox::open(&files.state_dir).expect("open");
        let txn = TxnId::from_ulid(ulid::Ulid::new());
        let mut ids = Vec::with_capacity(BACKLOG);
        for n in 0..BACKLOG {
            let id = outbox
                .push(AgentMessage::Event(Event {
                    txn,
                    kind: TxnKind::Provision,
                    vmid: Some(120),
                    phase: Phase::Bootstrapped,
                    at: now_timestamp().expect("now"),
                    detail: Some(format!("backlog entry {n} {}", "x".repeat(200))),
                    error: None,
                    guest: None,
                    backup: None,
                }))
                .await
                .expect("push");
            ids.push(id);
        }
        outbox.close().await;
        ids
    });

    let started = Instant::now();
    let agent = AgentDaemon::spawn(&files.config_path, FAST_TIMING, &[]);
    let state = hub.wait_for("the whole backlog", WAIT, |s| s.events.len() >= BACKLOG);
    let took = started.elapsed();
    let received: Vec<MessageId> = state.events.iter().map(|(id, _)| *id).collect();
    assert_eq!(received.len(), BACKLOG, "events applied twice or extra");
    assert_eq!(
        received, stored,
        "the backlog did not arrive in the order it was stored"
    );
    assert_eq!(state.sessions, 1, "the session broke under the backlog");
    report!(
        "{BACKLOG} stored events delivered in {:.1} s",
        took.as_secs_f32()
    );

    let log_path = files.state_dir.join("outbox").join("outbox.log");
    let deadline = Instant::now() + WAIT;
    while std::fs::metadata(&log_path).map(|m| m.len()).unwrap_or(0) > 0 {
        assert!(Instant::now() < deadline, "the outbox did not drain");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, log) = agent.terminate(Duration::from_secs(30));
    assert!(status.success(), "run exited {status}:\n{log}");
}
