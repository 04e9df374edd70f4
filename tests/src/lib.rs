//! Test bed for felhom-agent: the fakepve wrapper, the `pct` stand-in, the development hub.
//!
//! Everything here runs on loopback only and is shared by the integration tests in `tests/`.
//! [`fakepve`] starts a fake Proxmox VE API per test from a scenario and drives it; it needs the
//! fakepve venv that `tests/run.sh` installs.

pub mod agent;
pub mod devhub;
pub mod fakepve;
pub mod guestbed;
