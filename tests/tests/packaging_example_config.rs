//! The example configuration the Debian package ships (`packaging/agent.toml.example`, installed
//! as `/etc/felhom-agent/agent.toml.example`) is what an operator copies to `agent.toml`: it
//! must load as it is, its commented `[hub]` block must load when uncommented, and every key it
//! mentions in a comment must be a key the agent knows (unknown keys are errors).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use felhom_agent::config::Config;

fn example_text() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/agent.toml.example");
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The example with its secret file paths moved into `dir`, where they exist with mode 0600.
fn with_secrets_in(dir: &Path, text: &str) -> String {
    for name in ["pve-token", "hub-token"] {
        let path = dir.join(name);
        fs::write(&path, "11111111-2222-4333-8444-000000000000\n").expect("write secret");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).expect("chmod secret");
    }
    text.replace("/etc/felhom-agent/", &format!("{}/", dir.display()))
}

fn parse(dir: &Path, text: &str) -> Result<Config, String> {
    let path: PathBuf = dir.join("agent.toml");
    Config::parse(&path, text).map_err(|f| format!("{f:?}"))
}

#[test]
fn example_loads_as_shipped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = with_secrets_in(dir.path(), &example_text());
    let cfg = parse(dir.path(), &text).unwrap_or_else(|e| panic!("the example does not load: {e}"));
    assert_eq!(cfg.pool, "felhom");
    assert_eq!(cfg.pve.url, "https://127.0.0.1:8006");
    assert_eq!(cfg.pve.token_id, "felhom@pve!agent");
    assert!(cfg.hub.is_none(), "the shipped example has no hub");
    assert_eq!(cfg.state_dir, Path::new("/var/lib/felhom-agent"));
    assert_eq!(cfg.provision.storage, "local-lvm");
    assert_eq!(
        cfg.provision.checks_dir,
        Path::new("/etc/felhom-agent/checks.d"),
        "the default check pack folder is where the package installs default.toml"
    );
    assert_eq!(
        cfg.provision.bootstrap_dir,
        Path::new("/etc/felhom-agent/bootstrap.d"),
        "the default profile folder is where the package installs default/run"
    );
    assert_eq!(
        cfg.metrics.dir,
        Path::new("/var/lib/felhom-agent-metrics"),
        "the systemd units allow writes to this folder only (the agent's own; root copies its files into node_exporter's textfile folder)"
    );
}

#[test]
fn example_hub_block_loads_when_uncommented() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut out = Vec::new();
    let mut in_hub = false;
    for line in example_text().lines() {
        if line == "# [hub]" {
            in_hub = true;
            out.push("[hub]".to_owned());
            continue;
        }
        if in_hub && line.trim().is_empty() {
            in_hub = false;
        }
        if in_hub {
            let bare = line.trim_start_matches('#').trim_start();
            if bare.starts_with("tls_fingerprint") {
                // The example's placeholder; the system roots are the default.
                continue;
            }
            out.push(bare.to_owned());
        } else {
            out.push(line.to_owned());
        }
    }
    let text = with_secrets_in(dir.path(), &out.join("\n"));
    let cfg = parse(dir.path(), &text)
        .unwrap_or_else(|e| panic!("the example with [hub] uncommented does not load: {e}"));
    let hub = cfg.hub.expect("a hub");
    assert_eq!(hub.url, "wss://hub.example.net/agent");
    assert_eq!(hub.token_file, dir.path().join("hub-token"));
}

#[test]
fn every_commented_key_is_a_known_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = example_text();
    let lines: Vec<&str> = text.lines().collect();
    let mut checked = 0;
    let mut under_commented_section = false;
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("# [") {
            under_commented_section = true;
            continue;
        }
        if line.starts_with('[') {
            under_commented_section = false;
            continue;
        }
        // "# key = value": a commented setting (prose lines have no " = " after one word).
        let Some(bare) = line.strip_prefix("# ") else {
            continue;
        };
        let Some((key, _)) = bare.split_once(" = ") else {
            continue;
        };
        if under_commented_section
            || key.is_empty()
            || !key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        {
            continue;
        }
        let mut variant: Vec<String> = lines.iter().map(|l| (*l).to_owned()).collect();
        variant[i] = bare.to_owned();
        let result = parse(
            dir.path(),
            &with_secrets_in(dir.path(), &variant.join("\n")),
        );
        if let Err(e) = result {
            assert!(
                !e.contains("unknown field"),
                "line {} of agent.toml.example names a key the agent does not know: {line}\n{e}",
                i + 1
            );
        }
        checked += 1;
    }
    assert!(
        checked >= 10,
        "only {checked} commented keys found: the example's format changed?"
    );
}
