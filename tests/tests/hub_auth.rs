//! The hub credential: sent as `Authorization: Bearer <token>` on the websocket upgrade; a
//! wrong one is refused by the hub (HTTP 401) and the agent keeps retrying with capped,
//! jittered backoff, without ever writing the token to its log.

/// Printed straight to stderr, past the test harness's capture, so the figures show in every
/// run and not only in failing ones.
macro_rules! report {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

use std::time::{Duration, Instant};

use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions};
use felhom_tests::fakepve::{AgentFiles, AgentOptions, FakePve, HubOptions};

const WRONG_TOKEN: &str = "wrong-token-7d41c9a0e2";
const BACKOFF_INITIAL_MS: u64 = 100;
const BACKOFF_CAP_MS: u64 = 800;
/// Refused attempts to wait for: four to reach the cap, then enough to judge the capped gaps.
const ATTEMPTS_WANTED: usize = 14;
/// How long the attempts may take at most (about 6 s on an idle machine).
const WATCH_DEADLINE: Duration = Duration::from_secs(60);

#[test]
fn a_wrong_token_is_refused_and_retried_with_backoff_without_logging_it() {
    let pve = FakePve::demo();
    let hub = DevHub::start(DevHubOptions::default());
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            hub: Some(HubOptions {
                url: hub.url(),
                token: WRONG_TOKEN.to_string(),
                tls_fingerprint: None,
                ca_file: None,
            }),
            ..AgentOptions::default()
        },
    );
    let timing = format!(
        "backoff_initial_ms={BACKOFF_INITIAL_MS},backoff_cap_ms={BACKOFF_CAP_MS},\
         inventory_poll_ms=300"
    );
    let started = Instant::now();
    let mut agent = AgentDaemon::spawn(&files.config_path, &timing, &[]);
    // Wait for enough attempts to see the window reach its cap; a loaded machine only makes
    // the attempts later, so the deadline is generous and nothing below bounds the total.
    let deadline = started + WATCH_DEADLINE;
    let state = loop {
        let state = hub.snapshot();
        if state.refused.len() >= ATTEMPTS_WANTED {
            break state;
        }
        assert!(
            Instant::now() < deadline,
            "only {} refused attempts in {WATCH_DEADLINE:?}",
            state.refused.len()
        );
        assert!(agent.alive(), "the agent gave up");
        std::thread::sleep(Duration::from_millis(50));
    };
    let elapsed = started.elapsed();
    assert!(agent.alive(), "the agent gave up");
    assert_eq!(state.sessions, 0, "a wrong token got a session");
    assert!(
        state.refused_header_was(&format!("Bearer {WRONG_TOKEN}")),
        "the credential was not sent as a bearer header"
    );

    // Retrying, but not in a hot loop: attempt n waits inside its window
    // min(cap, initial * 2^n), at least a tenth of it.
    let attempts = state.refused.len();
    let gaps: Vec<Duration> = state
        .refused
        .windows(2)
        .map(|w| w[1].duration_since(w[0]))
        .collect();
    report!(
        "{attempts} refused attempts in {:.1} s; gaps: {:?}",
        elapsed.as_secs_f32(),
        gaps.iter().map(|g| g.as_millis()).collect::<Vec<_>>()
    );
    let most = (elapsed.as_millis() as u64 / (BACKOFF_CAP_MS / 10)) as usize + 8;
    assert!(attempts <= most, "{attempts} attempts: no backoff");
    // Once the window reached the cap, no gap is shorter than a tenth of the cap (less a
    // little for scheduling): a delay can only grow under load, so this floor holds anywhere.
    let capped: Vec<Duration> = gaps.iter().skip(4).copied().collect();
    for gap in &capped {
        assert!(
            *gap >= Duration::from_millis(BACKOFF_CAP_MS / 10 - 10),
            "gap {gap:?} below the jitter floor"
        );
    }
    // The window stops growing at the cap. The median is taken so that a few attempts delayed
    // by a busy machine do not decide it; an uncapped doubling would put it far above the cap.
    let mut sorted = capped.clone();
    sorted.sort();
    let median = sorted[sorted.len() / 2];
    assert!(
        median <= Duration::from_millis(BACKOFF_CAP_MS),
        "median gap {median:?} beyond the cap: the window kept growing ({capped:?})"
    );
    // Not all the same: the delays are jittered.
    let distinct: std::collections::BTreeSet<u128> =
        gaps.iter().map(|g| g.as_millis() / 20).collect();
    assert!(distinct.len() >= 3, "no jitter in {gaps:?}");

    let (status, log) = agent.terminate(Duration::from_secs(20));
    assert!(status.success(), "run exited {status}:\n{log}");
    assert!(
        log.contains("refused the credential (HTTP 401)"),
        "the refusal is not explained:\n{log}"
    );
    assert!(
        !log.contains(WRONG_TOKEN),
        "the agent logged its hub token:\n{log}"
    );
    assert!(!log.contains(hub.token()));
    assert!(
        !log.contains(&pve.token_secret()),
        "the agent logged the PVE secret"
    );
}
