//! The typed PVE API client.
//!
//! - [`request`]: requests built without IO (tested as strings);
//! - [`calendar`]: PVE's calendar events (backup job schedules) and their next start;
//! - [`client`]: the reqwest + rustls transport with token auth and read retries;
//! - [`error`]: errors with PVE's status and wording, classified;
//! - [`guest_config`]: stored guest configurations and their property strings, parsed;
//! - [`task`]: following a UPID to its end;
//! - [`types`], [`upid`]: what PVE answers, decoded leniently.
//!
//! Nothing here decides whether a write is allowed; the provision module does, and this
//! client never destroys anything on its own.

pub mod calendar;
pub mod client;
pub mod error;
pub mod guest_config;
pub mod request;
pub mod task;
pub mod types;
pub mod upid;

pub use client::{PveClient, RetryPolicy};
pub use error::{ApiError, ApiErrorKind, PveError};
pub use request::{LxcRestore, QemuRestore};
pub use task::{wait_task, TaskOutcome, WaitOptions};
pub use types::GuestKind;
pub use upid::Upid;
