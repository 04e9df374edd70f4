//! Running the `felhom-agent` binary under test.
//!
//! The binary is `$FELHOM_AGENT_BIN` (tests/run.sh builds it and sets it) or
//! `<target dir>/debug/felhom-agent`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// The agent binary.
pub fn agent_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("FELHOM_AGENT_BIN") {
        return PathBuf::from(p);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::fakepve::workspace_root().join("target"));
    let p = target.join("debug").join("felhom-agent");
    assert!(
        p.exists(),
        "{} is missing: build it first (`cargo build -p felhom-agent`; tests/run.sh does)",
        p.display()
    );
    p
}

/// What one run of the agent produced.
#[derive(Debug)]
pub struct AgentRun {
    /// Exit code (`None`: killed by a signal).
    pub code: Option<i32>,
    /// stdout.
    pub stdout: String,
    /// stderr.
    pub stderr: String,
}

impl AgentRun {
    /// stdout parsed as the one JSON document of `--json`.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not one JSON document ({e}):\n{}\nstderr:\n{}",
                self.stdout, self.stderr
            )
        })
    }
}

impl From<Output> for AgentRun {
    fn from(o: Output) -> Self {
        AgentRun {
            code: o.status.code(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

/// A command for the agent with `--config config` and a clean environment.
pub fn agent_command(config: &Path) -> Command {
    let mut cmd = Command::new(agent_bin());
    cmd.env_remove("FELHOM_AGENT_CONFIG")
        .env_remove("FELHOM_AGENT_LOG")
        .arg("--config")
        .arg(config);
    cmd
}

/// Run the agent with `--config config` and `args`.
pub fn run_agent(config: &Path, args: &[&str]) -> AgentRun {
    let out = agent_command(config)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", agent_bin().display()));
    out.into()
}
