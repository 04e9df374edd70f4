//! Test bed for felhom-agent: the fakepve wrapper, the `pct` stand-in, the development hub.
//!
//! Everything here runs on loopback only and is shared by the integration tests in `tests/`.
//! [`fakepve`] starts a fake Proxmox VE API per test from a scenario and drives it; it needs the
//! fakepve venv that `tests/run.sh` installs.

pub mod agent;
pub mod devhub;
pub mod fakepve;
pub mod guestbed;
pub mod world;

/// Print a figure a test measured so that it shows in the test command's output even when the
/// test passes (cargo's test harness captures `print!`, not writes to the stderr handle).
pub fn report(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
