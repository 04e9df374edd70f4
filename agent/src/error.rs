//! Stable error codes and process exit codes (DESIGN section 3).
//!
//! Every error an operator can see carries one of these codes beside its message. Module error
//! enums map themselves to a code with a `code()` method; `main.rs` maps the code to an exit
//! status. Nothing here ever formats a secret.

use serde::{Deserialize, Serialize};

/// The stable, machine-readable code of an operator-visible error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The vmid is outside PVE's range or not in PVE's format.
    VmidInvalid,
    /// The vmid is in a reserved band (9999, 990000..=990009).
    VmidReserved,
    /// The vmid is held by a guest in the full guest list.
    VmidInUse,
    /// PVE refused a request (permission, already exists, bad parameter).
    PveRefused,
    /// PVE could not be reached (connection refused, reset, timeout, proxy error).
    PveUnreachable,
    /// PVE did not accept the API token.
    PveAuth,
    /// The server certificate does not match the configured SHA-256 pin.
    TlsPinMismatch,
    /// A PVE task ended with an error.
    TaskFailed,
    /// A PVE task did not end in time.
    TaskTimeout,
    /// The guest is locked (backup, create, migrate, ...).
    GuestLocked,
    /// The guest did not prove it launched (not running or no exec answer).
    LaunchUnproven,
    /// The bootstrap profile failed inside the guest.
    BootstrapFailed,
    /// An osquery check failed or could not run.
    CheckFailed,
    /// The restore-test band is full.
    BandFull,
    /// The configuration or a file it names is invalid.
    ConfigInvalid,
    /// The agent cannot prove it created the guest, so it will not destroy it.
    OwnershipUnproven,
    /// Preflight: the backup volume does not exist, is not readable with this token, or is
    /// not the kind of guest the request implies.
    BackupMissing,
    /// Preflight: the target storage does not exist on this node, is disabled or inactive, or
    /// lacks the content type the guest needs.
    StorageInvalid,
    /// Preflight: the bootstrap profile does not load (name, `run`, size limits).
    ProfileInvalid,
    /// Preflight: a check pack does not parse or uses an unknown placeholder.
    ChecksInvalid,
    /// Preflight: the request is outside the node's `[policy]`.
    PolicyDenied,
}

impl ErrorCode {
    /// The code as it appears in JSON output and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::VmidInvalid => "vmid_invalid",
            Self::VmidReserved => "vmid_reserved",
            Self::VmidInUse => "vmid_in_use",
            Self::PveRefused => "pve_refused",
            Self::PveUnreachable => "pve_unreachable",
            Self::PveAuth => "pve_auth",
            Self::TlsPinMismatch => "tls_pin_mismatch",
            Self::TaskFailed => "task_failed",
            Self::TaskTimeout => "task_timeout",
            Self::GuestLocked => "guest_locked",
            Self::LaunchUnproven => "launch_unproven",
            Self::BootstrapFailed => "bootstrap_failed",
            Self::CheckFailed => "check_failed",
            Self::BandFull => "band_full",
            Self::ConfigInvalid => "config_invalid",
            Self::OwnershipUnproven => "ownership_unproven",
            Self::BackupMissing => "backup_missing",
            Self::StorageInvalid => "storage_invalid",
            Self::ProfileInvalid => "profile_invalid",
            Self::ChecksInvalid => "checks_invalid",
            Self::PolicyDenied => "policy_denied",
        }
    }

    /// The exit status a command ends with when this error ends it.
    pub fn exit_status(self) -> ExitStatus {
        match self {
            Self::VmidInvalid
            | Self::VmidReserved
            | Self::VmidInUse
            | Self::BackupMissing
            | Self::StorageInvalid
            | Self::ProfileInvalid
            | Self::ChecksInvalid
            | Self::PolicyDenied => ExitStatus::Refused,
            Self::PveRefused | Self::TaskFailed | Self::TaskTimeout | Self::GuestLocked => {
                ExitStatus::PveFailed
            }
            Self::LaunchUnproven | Self::BootstrapFailed | Self::CheckFailed => {
                ExitStatus::GuestFailed
            }
            Self::PveUnreachable | Self::PveAuth | Self::TlsPinMismatch | Self::ConfigInvalid => {
                ExitStatus::Environment
            }
            Self::OwnershipUnproven => ExitStatus::NeedsHuman,
            // A full band is a skip, not a failure.
            Self::BandFull => ExitStatus::Ok,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Process exit statuses (DESIGN section 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ExitStatus {
    /// Done (also: restore-test skipped because the band is full).
    Ok = 0,
    /// Command-line usage error.
    Usage = 2,
    /// Refused before any write: vmid invalid, reserved or in use, or another preflight
    /// refusal (backup, storage, profile, check packs, policy).
    Refused = 3,
    /// PVE refused or failed the create; nothing destroyed.
    PveFailed = 4,
    /// Launched, but bootstrap or checks failed.
    GuestFailed = 5,
    /// Environment: config, PVE unreachable, auth, TLS pin mismatch.
    Environment = 6,
    /// Ownership unprovable or another condition needing a human.
    NeedsHuman = 7,
}

impl ExitStatus {
    /// The numeric status.
    pub fn code(self) -> u8 {
        self as u8
    }
}

/// An operator-facing failure: a stable code and a message that names what it concerns and
/// says what to do next.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    /// The stable code.
    pub code: ErrorCode,
    /// The message for the operator.
    pub message: String,
}

impl Failure {
    /// A failure with this code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_design_exit_statuses() {
        assert_eq!(ErrorCode::VmidReserved.exit_status().code(), 3);
        assert_eq!(ErrorCode::PveRefused.exit_status().code(), 4);
        assert_eq!(ErrorCode::CheckFailed.exit_status().code(), 5);
        assert_eq!(ErrorCode::TlsPinMismatch.exit_status().code(), 6);
        assert_eq!(ErrorCode::ConfigInvalid.exit_status().code(), 6);
        assert_eq!(ErrorCode::OwnershipUnproven.exit_status().code(), 7);
        assert_eq!(ErrorCode::BandFull.exit_status().code(), 0);
        for c in [
            ErrorCode::BackupMissing,
            ErrorCode::StorageInvalid,
            ErrorCode::ProfileInvalid,
            ErrorCode::ChecksInvalid,
            ErrorCode::PolicyDenied,
        ] {
            assert_eq!(c.exit_status().code(), 3, "{c}");
            let wire = serde_json::to_value(c).unwrap_or_default();
            assert_eq!(wire, serde_json::Value::String(c.as_str().to_string()));
        }
    }

    #[test]
    fn codes_serialize_as_snake_case() {
        let s = serde_json::to_string(&ErrorCode::TlsPinMismatch).unwrap_or_default();
        assert_eq!(s, "\"tls_pin_mismatch\"");
        assert_eq!(ErrorCode::TlsPinMismatch.as_str(), "tls_pin_mismatch");
    }
}
