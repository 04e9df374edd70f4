//! No secret in any output at any log level: the daemon runs with `FELHOM_AGENT_LOG=trace`
//! against the development hub (a provision dispatched, a reconnect after a hub restart) and
//! a command-line provision runs against fakepve at trace as well, their execs through the exec
//! helper, itself at trace; neither the hub token nor the PVE token secret appears in what any
//! of them prints. The websocket and HTTP libraries log the
//! raw upgrade request (its `Authorization` header included) at trace unless capped.

use std::time::Duration;

use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::AgentOptions;
use felhom_tests::world::World;
use hub_protocol::{DispatchAction, Outcome};

const WAIT: Duration = Duration::from_secs(60);

/// Panics without printing `text` (it may hold the secret).
fn assert_absent(text: &str, secret: &str, what: &str) {
    assert!(!secret.is_empty());
    assert!(
        !text.contains(secret),
        "{what} appears in the output at trace level ({} bytes of output, not shown)",
        text.len()
    );
}

#[test]
fn no_token_is_printed_even_at_trace_level() {
    let mut hub = DevHub::start(DevHubOptions::default());
    let opts = AgentOptions {
        hub: Some(hub.hub_options()),
        ..AgentOptions::default()
    };
    let mut w = World::with_options(felhom_tests::fakepve::demo_scenario(), &opts);
    w.restart_helper_env(&[("FELHOM_AGENT_LOG", "trace")]);
    let path = w.path();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str()), ("FELHOM_AGENT_LOG", "trace")],
    );
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);
    let txn = hub.dispatch(DispatchAction::Provision {
        vmid: 6300,
        from: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
        storage: "local-lvm".to_string(),
        keep: false,
        profile: None,
        isolate_network: None,
    });
    let state = hub.wait_for("the provision's result", WAIT, |s| {
        s.results.contains_key(&txn)
    });
    assert_eq!(state.results[&txn][0].1.outcome, Outcome::Ok);
    // A reconnect sends the upgrade request, credential included, once more.
    hub.stop();
    hub.restart();
    hub.wait_for("the second session", WAIT, |s| s.sessions >= 2);
    let (_, log) = agent.terminate(WAIT);
    assert!(
        log.contains("TRACE") || log.contains("DEBUG"),
        "the daemon logged below info: FELHOM_AGENT_LOG=trace was in effect"
    );
    assert_absent(&log, hub.token(), "the hub token");
    assert_absent(&log, &w.pve.token_secret(), "the PVE token secret");

    // A command-line provision at trace.
    let out = w
        .command()
        .env("FELHOM_AGENT_LOG", "trace")
        .args(["--selftest=provision", "-vmid", "6301", "--json"])
        .output()
        .expect("run the agent");
    assert_eq!(out.status.code(), Some(0));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("DEBUG") || text.contains("TRACE"));
    assert_absent(&text, &w.pve.token_secret(), "the PVE token secret");
    assert_absent(&text, hub.token(), "the hub token");

    // The exec helper ran every exec of both provisions, at trace.
    assert!(w.assert_pct_only_from_helper() >= 2);
    // Stopped first: a helper dropped during a panic prints its log.
    let helper_log = w.helper.take().expect("the exec helper").kill();
    assert!(
        helper_log.contains("DEBUG") || helper_log.contains("TRACE"),
        "the helper logged below info"
    );
    assert_absent(&helper_log, &w.pve.token_secret(), "the PVE token secret");
    assert_absent(&helper_log, hub.token(), "the hub token");
}
