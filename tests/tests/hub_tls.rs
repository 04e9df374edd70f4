//! `wss://` to the development hub with its self-signed certificate: trusted through the pinned
//! SHA-256 fingerprint or through a CA file, and refused (no session, `tls_pin_mismatch` in the
//! log, the token never sent) when the pin does not match.

use std::path::PathBuf;
use std::time::Duration;

use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{AgentFiles, AgentOptions, FakePve, HubOptions};
use hub_protocol::DispatchAction;

const WAIT: Duration = Duration::from_secs(30);

fn tls_hub() -> DevHub {
    DevHub::start(DevHubOptions {
        tls: true,
        ..DevHubOptions::default()
    })
}

fn files(
    pve: &FakePve,
    hub: &DevHub,
    fingerprint: Option<String>,
    ca: Option<PathBuf>,
) -> AgentFiles {
    AgentFiles::write(
        pve,
        &AgentOptions {
            hub: Some(HubOptions {
                url: hub.url(),
                token: hub.token().to_string(),
                tls_fingerprint: fingerprint,
                ca_file: ca,
            }),
            ..AgentOptions::default()
        },
    )
}

fn session_works(hub: &DevHub, files: &AgentFiles) {
    let agent = AgentDaemon::spawn(&files.config_path, FAST_TIMING, &[]);
    hub.wait_for("a session over TLS", WAIT, |s| s.sessions == 1);
    let txn = hub.dispatch(DispatchAction::InventoryRequest);
    hub.wait_for("the inventory over TLS", WAIT, |s| {
        s.inventory_replies(txn) == 1
    });
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
}

#[test]
fn a_pinned_certificate_is_trusted() {
    let pve = FakePve::demo();
    let hub = tls_hub();
    assert!(hub.url().starts_with("wss://"));
    let fp = hub.fingerprint().expect("fingerprint").to_string();
    session_works(&hub, &files(&pve, &hub, Some(fp), None));
}

#[test]
fn a_ca_file_is_trusted() {
    let pve = FakePve::demo();
    let hub = tls_hub();
    let ca = hub.cert_pem().expect("cert").to_path_buf();
    session_works(&hub, &files(&pve, &hub, None, Some(ca)));
}

#[test]
fn a_wrong_pin_is_refused_before_the_token_is_sent() {
    let pve = FakePve::demo();
    let mut hub = tls_hub();
    let files = files(&pve, &hub, Some("ab".repeat(32)), None);
    let mut agent = AgentDaemon::spawn(&files.config_path, FAST_TIMING, &[]);
    agent.wait_for_log("tls_pin_mismatch", WAIT);
    assert!(
        !agent.log().contains("cannot connect"),
        "only pin mismatches so far"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(agent.alive());
    let state = hub.snapshot();
    assert_eq!(state.sessions, 0);
    assert!(
        state.refused.is_empty(),
        "an upgrade request got through TLS"
    );
    let real = hub.fingerprint().expect("fingerprint").to_uppercase();
    let log = agent.log();
    assert!(
        log.replace(':', "").contains(&real),
        "the log does not name the certificate seen:\n{log}"
    );
    // The hub goes away: the next failure is a refused connection, reported as such and not
    // as the pin mismatch seen before it.
    hub.stop();
    agent.wait_for_log("cannot connect", WAIT);
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
    assert!(!log.contains(hub.token()));
}
