//! Stable error codes and process exit codes (DESIGN section 3).
//!
//! Every error an operator can see carries one of these codes beside its message. Module error
//! enums map themselves to a code with a `code()` method; [`exit_status`] maps the code to an
//! exit status. Nothing here ever formats a secret.

use serde::{Deserialize, Serialize};

/// The stable, machine-readable code of an operator-visible error: the wire protocol's own
/// enum, so a code added on one side is a code on both.
pub use hub_protocol::ErrorCode;

/// The exit status a command ends with when an error with this code ends it (DESIGN section
/// 3). The mapping is the agent's: the hub sees codes, never exit statuses.
pub fn exit_status(code: ErrorCode) -> ExitStatus {
    match code {
        // Refused before any write: the vmid, or the preflight.
        ErrorCode::VmidInvalid
        | ErrorCode::VmidReserved
        | ErrorCode::VmidInUse
        | ErrorCode::BackupMissing
        | ErrorCode::StorageInvalid
        | ErrorCode::ProfileInvalid
        | ErrorCode::ChecksInvalid
        | ErrorCode::PolicyDenied
        | ErrorCode::SdnDenied
        | ErrorCode::BackupPrivileged
        | ErrorCode::BackupMounts
        | ErrorCode::BackupDevices
        | ErrorCode::BackupHookscript
        | ErrorCode::BackupAccess
        | ErrorCode::BackupArgs
        | ErrorCode::BackupHostDir
        | ErrorCode::BackupSharedMemory
        | ErrorCode::BackupHostPort
        | ErrorCode::BackupVmstate
        | ErrorCode::BackupTemplate
        | ErrorCode::BackupQuota
        | ErrorCode::GuestAgentOff
        | ErrorCode::GuestOsUnjudged
        | ErrorCode::StorageFull
        | ErrorCode::TagPolicy
        // A journal verb on a transaction in the wrong state: nothing was written.
        | ErrorCode::NotNeedsHuman
        | ErrorCode::TxnNotOpen
        | ErrorCode::TxnUnknown
        // The exec helper refused a request: nothing ran in the guest.
        | ErrorCode::ExecCallerRefused
        | ErrorCode::ExecNotOwned
        | ErrorCode::ExecNotInPool
        | ErrorCode::ExecGuestPrivileged
        | ErrorCode::ExecWrongPhase
        | ErrorCode::ExecMonitorUntrusted
        | ErrorCode::ExecAttachMismatch
        | ErrorCode::ExecRequestInvalid => ExitStatus::Refused,
        ErrorCode::PveRefused
        | ErrorCode::GuestOutsidePool
        | ErrorCode::TaskFailed
        | ErrorCode::TaskTimeout
        | ErrorCode::GuestLocked => ExitStatus::PveFailed,
        ErrorCode::LaunchUnproven
        | ErrorCode::BootUnfinished
        | ErrorCode::GuestExecBlocked
        | ErrorCode::BootstrapFailed
        | ErrorCode::CheckFailed => {
            ExitStatus::GuestFailed
        }
        ErrorCode::PveUnreachable
        | ErrorCode::PveAuth
        | ErrorCode::TlsPinMismatch
        | ErrorCode::ConfigInvalid
        | ErrorCode::LabBridgeOpen
        | ErrorCode::GroupLabFailed
        | ErrorCode::PoolMissing
        | ErrorCode::PveUnsupported
        | ErrorCode::ExecHelperUnavailable
        | ErrorCode::StateDirFull
        | ErrorCode::TokenFileInvalid
        | ErrorCode::AgentUserUnconfined => ExitStatus::Environment,
        ErrorCode::OwnershipUnproven => ExitStatus::NeedsHuman,
        // The operator stopped the run: its own status, never a PVE or guest failure.
        ErrorCode::Interrupted => ExitStatus::Interrupted,
        // A full band is a skip, not a failure.
        ErrorCode::BandFull => ExitStatus::Ok,
    }
}

/// How much of a string from outside (hub, guest) goes into a log line or a message.
pub const OUTSIDE_TEXT_MAX_BYTES: usize = 256;

/// `text` from outside made safe for one log line or message: control characters (newlines
/// included) escaped as `\n`, `\u{1b}`, …, and the result clipped to about
/// [`OUTSIDE_TEXT_MAX_BYTES`] on a character boundary, saying how much was cut.
pub fn outside_text(text: &str) -> String {
    outside_text_max(text, OUTSIDE_TEXT_MAX_BYTES)
}

/// Whether outside text shows `c` escaped: control characters; every format character
/// (Unicode category Cf: bidirectional embeddings, overrides and isolates, zero-width
/// characters, the soft hyphen, the byte order mark, interlinear annotation, the Arabic,
/// Syriac, Egyptian and shorthand format controls, musical formatting, the invisible tag
/// characters); line and paragraph separators; and the other characters that show as nothing
/// (the combining grapheme joiner, Hangul fillers, Khmer inherent vowels, Mongolian and other
/// variation selectors).
pub fn must_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00AD}'
                | '\u{034F}'
                | '\u{0600}'..='\u{0605}'
                | '\u{061C}'
                | '\u{06DD}'
                | '\u{070F}'
                | '\u{0890}'..='\u{0891}'
                | '\u{08E2}'
                | '\u{115F}'..='\u{1160}'
                | '\u{17B4}'..='\u{17B5}'
                | '\u{180B}'..='\u{180F}'
                | '\u{200B}'..='\u{200F}'
                | '\u{2028}'..='\u{202E}'
                | '\u{2060}'..='\u{206F}'
                | '\u{3164}'
                | '\u{FE00}'..='\u{FE0F}'
                | '\u{FEFF}'
                | '\u{FFA0}'
                | '\u{FFF9}'..='\u{FFFB}'
                | '\u{110BD}'
                | '\u{110CD}'
                | '\u{13430}'..='\u{1343F}'
                | '\u{1BCA0}'..='\u{1BCA3}'
                | '\u{1D173}'..='\u{1D17A}'
                | '\u{E0000}'..='\u{E007F}'
                | '\u{E0100}'..='\u{E01EF}'
        )
}

/// [`outside_text`] with another limit.
pub fn outside_text_max(text: &str, max_bytes: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max_bytes) + 32);
    let mut used = 0;
    for c in text.chars() {
        if out.len() >= max_bytes {
            out.push_str(&format!(" … ({} more bytes clipped)", text.len() - used));
            return out;
        }
        if must_escape(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
        used += c.len_utf8();
    }
    out
}

/// Process exit statuses (DESIGN section 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ExitStatus {
    /// Done (also: restore-test skipped because the band is full).
    Ok = 0,
    /// Command-line usage error.
    Usage = 2,
    /// Refused before any write: vmid invalid, reserved or in use.
    Refused = 3,
    /// PVE refused or failed the create; nothing destroyed.
    PveFailed = 4,
    /// Launched, but bootstrap or checks failed.
    GuestFailed = 5,
    /// Environment: config, PVE unreachable, auth, TLS pin mismatch.
    Environment = 6,
    /// Ownership unprovable or another condition needing a human.
    NeedsHuman = 7,
    /// Interrupted by the operator (Ctrl-C, SIGTERM): 128 + SIGINT, as a shell reports it.
    Interrupted = 130,
}

impl ExitStatus {
    /// Every status, in numeric order (the README's exit-code table and `--help` list these).
    pub const ALL: [ExitStatus; 8] = [
        ExitStatus::Ok,
        ExitStatus::Usage,
        ExitStatus::Refused,
        ExitStatus::PveFailed,
        ExitStatus::GuestFailed,
        ExitStatus::Environment,
        ExitStatus::NeedsHuman,
        ExitStatus::Interrupted,
    ];

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
    fn all_holds_every_exit_status_once() {
        // No wildcard: a new status does not compile until it is placed here and in ALL.
        let index = |s: ExitStatus| match s {
            ExitStatus::Ok => 0,
            ExitStatus::Usage => 1,
            ExitStatus::Refused => 2,
            ExitStatus::PveFailed => 3,
            ExitStatus::GuestFailed => 4,
            ExitStatus::Environment => 5,
            ExitStatus::NeedsHuman => 6,
            ExitStatus::Interrupted => 7,
        };
        for (i, s) in ExitStatus::ALL.iter().enumerate() {
            assert_eq!(index(*s), i, "{s:?}");
        }
    }

    #[test]
    fn outside_text_is_one_clipped_line() {
        let t = outside_text("a\nb\r\u{1b}[31mc");
        assert_eq!(t, "a\\nb\\r\\u{1b}[31mc");
        let big = "é".repeat(1 << 19);
        let t = outside_text(&big);
        assert!(t.len() < OUTSIDE_TEXT_MAX_BYTES + 64, "{}", t.len());
        assert!(t.ends_with("more bytes clipped)"), "{t}");
        assert_eq!(outside_text("plain"), "plain");
    }

    #[test]
    fn bidi_and_zero_width_characters_are_escaped() {
        let t = outside_text(
            "ok\u{202E}gnp.exe\u{2066}x\u{2069}\u{200B}\u{200F}\u{2028}\u{2029}\u{FEFF}é",
        );
        assert_eq!(
            t,
            "ok\\u{202e}gnp.exe\\u{2066}x\\u{2069}\\u{200b}\\u{200f}\\u{2028}\\u{2029}\\u{feff}é"
        );
        for c in [
            '\u{202A}',
            '\u{202B}',
            '\u{202C}',
            '\u{202D}',
            '\u{2067}',
            '\u{2068}',
            '\u{200C}',
            '\u{200D}',
            '\u{200E}',
            // Invisible too: the soft hyphen, the combining grapheme joiner, Hangul fillers,
            // Khmer inherent vowels, the Mongolian vowel separator and variation selectors,
            // other variation selectors, Arabic and Syriac format marks, word joiner and the
            // invisible operators, the deprecated format characters, the Egyptian and
            // shorthand format controls, musical formatting, the tag characters.
            '\u{00AD}',
            '\u{034F}',
            '\u{115F}',
            '\u{1160}',
            '\u{3164}',
            '\u{FFA0}',
            '\u{17B4}',
            '\u{17B5}',
            '\u{180B}',
            '\u{180E}',
            '\u{FE0F}',
            '\u{E0100}',
            '\u{0600}',
            '\u{06DD}',
            '\u{070F}',
            '\u{08E2}',
            '\u{2060}',
            '\u{2064}',
            '\u{206A}',
            '\u{206F}',
            '\u{13430}',
            '\u{1BCA0}',
            '\u{1D173}',
            '\u{E0001}',
            '\u{E0041}',
            '\u{E007F}',
        ] {
            assert!(!outside_text(&c.to_string()).contains(c), "{:?}", c);
        }
    }

    #[test]
    fn codes_map_to_design_exit_statuses() {
        assert_eq!(exit_status(ErrorCode::VmidReserved).code(), 3);
        for code in [
            ErrorCode::BackupMissing,
            ErrorCode::StorageInvalid,
            ErrorCode::ProfileInvalid,
            ErrorCode::ChecksInvalid,
            ErrorCode::PolicyDenied,
            ErrorCode::SdnDenied,
            ErrorCode::BackupPrivileged,
            ErrorCode::BackupMounts,
            ErrorCode::BackupDevices,
            ErrorCode::BackupHookscript,
            ErrorCode::BackupAccess,
            ErrorCode::TagPolicy,
            ErrorCode::NotNeedsHuman,
            ErrorCode::TxnNotOpen,
            ErrorCode::TxnUnknown,
            ErrorCode::ExecCallerRefused,
            ErrorCode::ExecNotOwned,
            ErrorCode::ExecNotInPool,
            ErrorCode::ExecGuestPrivileged,
            ErrorCode::ExecWrongPhase,
            ErrorCode::ExecMonitorUntrusted,
            ErrorCode::ExecAttachMismatch,
            ErrorCode::ExecRequestInvalid,
        ] {
            assert_eq!(exit_status(code), ExitStatus::Refused, "{code}");
        }
        assert_eq!(exit_status(ErrorCode::PveRefused).code(), 4);
        assert_eq!(exit_status(ErrorCode::CheckFailed).code(), 5);
        // Restored, started and its guest agent answered: a guest that was not judged, as
        // one whose launch was not proven.
        assert_eq!(exit_status(ErrorCode::GuestExecBlocked).code(), 5);
        // Judged from the stored config before any write.
        assert_eq!(exit_status(ErrorCode::GuestOsUnjudged).code(), 3);
        assert_eq!(exit_status(ErrorCode::TlsPinMismatch).code(), 6);
        assert_eq!(exit_status(ErrorCode::ConfigInvalid).code(), 6);
        // The node's lab bridge, not the backup: its guest is left due, as for config_invalid.
        assert_eq!(exit_status(ErrorCode::LabBridgeOpen).code(), 6);
        assert_eq!(exit_status(ErrorCode::PoolMissing).code(), 6);
        assert_eq!(exit_status(ErrorCode::PveUnsupported).code(), 6);
        assert_eq!(exit_status(ErrorCode::StateDirFull).code(), 6);
        assert_eq!(exit_status(ErrorCode::TokenFileInvalid).code(), 6);
        assert_eq!(exit_status(ErrorCode::AgentUserUnconfined).code(), 6);
        assert_eq!(exit_status(ErrorCode::Interrupted).code(), 130);
        assert_eq!(exit_status(ErrorCode::OwnershipUnproven).code(), 7);
        assert_eq!(exit_status(ErrorCode::BandFull).code(), 0);
    }

    #[test]
    fn every_code_has_an_exit_status_and_only_a_full_band_exits_0() {
        for code in ErrorCode::ALL {
            let status = exit_status(code);
            assert_eq!(
                status == ExitStatus::Ok,
                code == ErrorCode::BandFull,
                "{code}"
            );
            assert_ne!(status, ExitStatus::Usage, "{code}");
        }
    }

    #[test]
    fn codes_serialize_as_snake_case() {
        let s = serde_json::to_string(&ErrorCode::TlsPinMismatch).unwrap_or_default();
        assert_eq!(s, "\"tls_pin_mismatch\"");
        assert_eq!(ErrorCode::TlsPinMismatch.as_str(), "tls_pin_mismatch");
    }
}
