//! The daemon's idle memory: `felhom-agent run` connected to the development hub (and
//! fakepve for its inventory polls) for 30 s, then its resident set size from
//! `/proc/<pid>/status`, once over plain `ws://` and once over `wss://` with the whole system
//! root store loaded (no pin, no ca_file). The goal is under 10 MiB.
//!
//! `cargo build --release -p felhom-agent && cargo bench -p felhom-tests --bench hub_idle_rss`
//! measures the release binary (`target/release/felhom-agent`, or `$FELHOM_AGENT_BIN`);
//! without a release build it measures the debug one and says so.

use std::path::PathBuf;
use std::time::Duration;

use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions};
use felhom_tests::fakepve::{workspace_root, AgentFiles, AgentOptions, FakePve};

const IDLE: Duration = Duration::from_secs(30);

fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("cannot read /proc/{pid}/status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| format!("({field} missing)"))
}

/// One idle measurement: the daemon connected to a dev hub for [`IDLE`].
fn measure(binary: &std::path::Path, tls: bool, bundle_dir: &std::path::Path) {
    let pve = FakePve::demo();
    let hub = DevHub::start(DevHubOptions {
        heartbeat_interval_secs: 5,
        tls,
        ..DevHubOptions::default()
    });
    let mut env: Vec<(&str, String)> = Vec::new();
    if tls {
        // No pin and no ca_file: the agent trusts the system roots, the configuration most
        // nodes use with a hub behind a public certificate. The bundle holds the system's
        // roots plus the dev hub's certificate (rustls-native-certs reads SSL_CERT_FILE), so
        // the whole root store is loaded and the handshake still succeeds.
        let system = std::fs::read_to_string("/etc/ssl/certs/ca-certificates.crt")
            .expect("the system root bundle (package ca-certificates)");
        let hub_cert =
            std::fs::read_to_string(hub.cert_pem().expect("tls hub cert")).expect("hub cert");
        let bundle = bundle_dir.join("roots-and-dev-hub.pem");
        std::fs::write(&bundle, format!("{system}\n{hub_cert}")).expect("write bundle");
        let roots = system.matches("BEGIN CERTIFICATE").count();
        println!("  (wss:// trusting the system roots: {roots} certificates + the dev hub's)");
        env.push(("SSL_CERT_FILE", bundle.display().to_string()));
    }
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    let env_refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    // Default timing except a 10 s inventory poll, so the idle time includes polls.
    let agent = AgentDaemon::spawn(&files.config_path, "inventory_poll_ms=10000", &env_refs);
    hub.wait_for("the session", Duration::from_secs(30), |s| {
        s.sessions == 1 && !s.inventories.is_empty()
    });
    std::thread::sleep(IDLE);
    let pid = agent.pid();
    let rss = status_field(pid, "VmRSS");
    let hwm = status_field(pid, "VmHWM");
    let anon = status_field(pid, "RssAnon");
    let file = status_field(pid, "RssFile");
    let threads = status_field(pid, "Threads");
    let state = hub.snapshot();
    let (status, log) = agent.terminate(Duration::from_secs(30));
    assert!(status.success(), "run exited {status}:\n{log}");
    assert_eq!(state.sessions, 1, "the session dropped while idle");
    println!(
        "felhom-agent run over {}, idle {} s connected to the dev hub ({})",
        if tls { "wss://" } else { "ws://" },
        IDLE.as_secs(),
        binary.display()
    );
    println!("  VmRSS {rss} (RssAnon {anon}, RssFile {file}), VmHWM {hwm}, threads {threads}");
    println!(
        "  heard by the hub: {} heartbeats, {} inventories",
        state.heartbeats,
        state.inventories.len()
    );
}

fn main() {
    let release = workspace_root().join("target/release/felhom-agent");
    let binary: PathBuf = match std::env::var_os("FELHOM_AGENT_BIN") {
        Some(p) => PathBuf::from(p),
        None if release.exists() => release,
        None => felhom_tests::agent::agent_bin(),
    };
    // AgentDaemon runs whatever FELHOM_AGENT_BIN names.
    std::env::set_var("FELHOM_AGENT_BIN", &binary);
    let dir = tempfile::tempdir().expect("tmp");
    measure(&binary, false, dir.path());
    measure(&binary, true, dir.path());
}
