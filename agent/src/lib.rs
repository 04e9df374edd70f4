//! felhom-agent: provisions Proxmox VE guests from backups with a pool-scoped API token,
//! validates every vmid against the node's full guest list, proves a guest launched before
//! it may ever destroy it, verifies the guest from inside and reports to a hub.
//!
//! The binary (`src/main.rs`) only parses, runs and maps errors to exit codes; everything
//! else lives in this library so the test crate can drive it directly.

// Output goes through `cli::sink`, where a closed pipe stops the output and never the work
// (`println!` and `eprintln!` panic on it).
#![cfg_attr(not(test), deny(clippy::print_stdout, clippy::print_stderr))]

pub mod cli;
pub mod config;
pub mod doctor;
pub mod durable_log;
pub mod error;
pub mod exec_helper;
pub mod guest;
pub mod hub;
pub mod inventory;
pub mod lab_kernel;
pub mod metrics;
pub mod nofollow;
pub mod outbox_keep;
pub mod preflight;
pub mod privdrop;
pub mod provision;
pub mod pve;
pub mod service;
pub mod timefmt;
pub mod tls;
pub mod vmid;
