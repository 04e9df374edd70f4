//! The transaction vocabulary shared by `event` and `result`: kinds, phases, outcomes, error
//! codes and osquery check reports (DESIGN sections 3 and 5).
//!
//! Every enumerated value here is closed within a protocol version: a receiver rejects a value
//! it does not know (`invalid_field`), so adding one is a protocol version change.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What a transaction does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TxnKind {
    /// A provision dispatched by the hub.
    #[serde(rename = "provision")]
    Provision,
    /// A gated destroy (dispatched by the hub or run with `destroy -vmid N`).
    #[serde(rename = "destroy")]
    Destroy,
    /// `--selftest=provision` run by an operator.
    #[serde(rename = "selftest-provision")]
    SelftestProvision,
    /// A self-restore-test run: started by the systemd timer, by `--selftest=restore` or by a
    /// `restore_test` dispatch. `restore-test`, as `--kind` and the README name it; journals
    /// and frames of earlier versions spell it `selftest-restore`, read as this kind too, and a
    /// version 1 frame still carries that name ([`TxnKind::name_in_version`]).
    #[serde(rename = "restore-test", alias = "selftest-restore")]
    SelftestRestore,
}

impl TxnKind {
    /// The value as it appears on the wire, in the journal and in JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            TxnKind::Provision => "provision",
            TxnKind::Destroy => "destroy",
            TxnKind::SelftestProvision => "selftest-provision",
            TxnKind::SelftestRestore => "restore-test",
        }
    }

    /// The name a frame of protocol version `v` carries: version 1 names the restore test
    /// `selftest-restore` (a version 1 peer refuses `restore-test`, a value it does not know).
    pub fn name_in_version(self, v: u32) -> &'static str {
        match self {
            TxnKind::SelftestRestore if v < 2 => "selftest-restore",
            other => other.as_str(),
        }
    }
}

impl std::fmt::Display for TxnKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A journaled phase of a transaction (DESIGN section 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Accepted but not yet validated (a transaction refused at once reports this phase).
    Planned,
    /// The vmid passed the full guest list, the reserved bands and the range.
    Validated,
    /// The create/restore request was sent and its UPID recorded.
    Submitted,
    /// The task ended OK, the marker is written and destroy is armed.
    Created,
    /// The guest was started.
    Started,
    /// The guest is running and answers an exec.
    Launched,
    /// The guest's boot has ended: its systemd answered `running` or `degraded` (a guest
    /// without systemd: the launch proof's exec is all there is to wait for).
    Booted,
    /// The bootstrap profile ran successfully inside the guest.
    Bootstrapped,
    /// The osquery checks passed.
    Verified,
    /// The result was handed to the outbox.
    Reported,
    /// The transaction failed.
    Failed,
    /// The guest this transaction created was destroyed.
    Destroyed,
    /// The transaction was skipped (for example the restore-test band was full).
    Skipped,
    /// A condition only an operator can settle (ownership unprovable); nothing more is done
    /// automatically.
    NeedsHuman,
}

impl Phase {
    /// Every phase: the forward path in order, then the other outcomes.
    pub const ALL: [Phase; 14] = [
        Phase::Planned,
        Phase::Validated,
        Phase::Submitted,
        Phase::Created,
        Phase::Started,
        Phase::Launched,
        Phase::Booted,
        Phase::Bootstrapped,
        Phase::Verified,
        Phase::Reported,
        Phase::Failed,
        Phase::Destroyed,
        Phase::Skipped,
        Phase::NeedsHuman,
    ];

    /// The value as it appears on the wire, in the journal and in JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Planned => "planned",
            Phase::Validated => "validated",
            Phase::Submitted => "submitted",
            Phase::Created => "created",
            Phase::Started => "started",
            Phase::Launched => "launched",
            Phase::Booted => "booted",
            Phase::Bootstrapped => "bootstrapped",
            Phase::Verified => "verified",
            Phase::Reported => "reported",
            Phase::Failed => "failed",
            Phase::Destroyed => "destroyed",
            Phase::Skipped => "skipped",
            Phase::NeedsHuman => "needs_human",
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a transaction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Done, and the guest proved live (or the destroy was confirmed).
    Ok,
    /// Refused before any write (vmid invalid, reserved or in use).
    Refused,
    /// PVE, the bootstrap or the checks failed.
    Failed,
    /// Not run, and that is not a failure (restore-test band full).
    Skipped,
    /// Ownership could not be proven or another condition needs an operator.
    NeedsHuman,
}

impl Outcome {
    /// The value as it appears on the wire, in the journal and in JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Refused => "refused",
            Outcome::Failed => "failed",
            Outcome::Skipped => "skipped",
            Outcome::NeedsHuman => "needs_human",
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The stable code of a transaction error (DESIGN section 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The vmid is outside PVE's range or not in PVE's format.
    VmidInvalid,
    /// The vmid is in a reserved band.
    VmidReserved,
    /// The vmid is held by a guest in the full guest list.
    VmidInUse,
    /// PVE refused a request.
    PveRefused,
    /// PVE could not be reached.
    PveUnreachable,
    /// PVE did not accept the API token.
    PveAuth,
    /// A server certificate did not match its pin.
    TlsPinMismatch,
    /// A PVE task ended with an error.
    TaskFailed,
    /// A PVE task did not end in time.
    TaskTimeout,
    /// The guest is locked.
    GuestLocked,
    /// The guest did not prove it launched.
    LaunchUnproven,
    /// The bootstrap profile failed inside the guest.
    BootstrapFailed,
    /// An osquery check failed or could not run.
    CheckFailed,
    /// The restore-test band is full.
    BandFull,
    /// The agent's configuration or a file it names is invalid.
    ConfigInvalid,
    /// The agent cannot prove it created the guest, so it will not destroy it.
    OwnershipUnproven,
    /// Preflight: the backup volume is missing, unreadable or of the wrong guest type.
    BackupMissing,
    /// Preflight: the target storage is missing, disabled, inactive or lacks the content type.
    StorageInvalid,
    /// Preflight: the bootstrap profile does not load.
    ProfileInvalid,
    /// Preflight: a check pack does not parse or uses an unknown placeholder.
    ChecksInvalid,
    /// Preflight: the request is outside the node's `[policy]`.
    PolicyDenied,
    /// Preflight: the token lacks `SDN.Use` on a bridge (or VLAN) a NIC of the backup is plugged into.
    SdnDenied,
    /// Preflight (the node's set-up, exit 6): the kernel shows the lab bridge of an isolated VM copy open (a port, a
    /// device on top, an address, IPv6 on, no strict IPv4 reverse-path filter, or forwarding
    /// on), or one of these changed right after the copy's start (which then stops it).
    LabBridgeOpen,
    /// The node's set-up (exit 6): an application group's lab (a network namespace of its
    /// own with a bridge, the members' copies joined to it by the root helper) could not be
    /// made or joined.
    GroupLabFailed,
    /// Preflight: the backup is of a privileged container.
    BackupPrivileged,
    /// Preflight: the backup carries bind or device mount points, device passthrough or raw `lxc.*` keys (root only).
    BackupMounts,
    /// Preflight: the backup passes host devices to the VM (root only), or mapped ones the token may not use.
    BackupDevices,
    /// Preflight: the backup carries a hookscript.
    BackupHookscript,
    /// Preflight: the token may not restore another guest's backup (`VM.Backup` on its owner, `Datastore.AllocateSpace` on its storage).
    BackupAccess,
    /// Preflight: the backup carries `args` (raw QEMU arguments, root's to set, that can reach the host or a network without any NIC); refused for every VM restore.
    BackupArgs,
    /// Preflight: the backup shares a host directory with the VM (`virtiofsN`); refused for an isolated copy.
    BackupHostDir,
    /// Preflight: the backup shares memory with another VM (`ivshmem` with a name); refused for an isolated copy.
    BackupSharedMemory,
    /// Preflight: the backup connects a serial or parallel port to a host device; refused for an isolated copy.
    BackupHostPort,
    /// Preflight: the backup carries saved RAM (`vmstate`), which the copy would resume (and then free the production VM's state volume); refused for every VM restore.
    BackupVmstate,
    /// Preflight: the backup is of a template, which PVE restores as a template that never starts.
    BackupTemplate,
    /// Preflight: a mount point of the container backup has `quota`, which the restore keeps and
    /// an unprivileged container never starts with.
    BackupQuota,
    /// Preflight: the VM backup has no QEMU guest agent configured (`agent: 1`), through which
    /// every command in the VM runs.
    GuestAgentOff,
    /// Preflight: the target storage has less free space than the backup's disks need.
    StorageFull,
    /// Preflight: the cluster's tag policy refuses the marker's tags to the token.
    TagPolicy,
    /// `journal resolve`: the transaction is not awaiting a human (settled otherwise, already
    /// closed, or still open).
    NotNeedsHuman,
    /// `journal cancel`: the transaction is already settled.
    TxnNotOpen,
    /// The journal has no transaction with that id.
    TxnUnknown,
    /// The exec helper: the connecting process is neither root nor the agent's user.
    ExecCallerRefused,
    /// The exec helper: no open (or kept) transaction of the journal holds an armed claim on
    /// the vmid, or the vmid is not an LXC container on this node.
    ExecNotOwned,
    /// The exec helper: the vmid is not in the agent's pool in `user.cfg`.
    ExecNotInPool,
    /// The exec helper: the request is malformed, too large or of another version.
    ExecRequestInvalid,
    /// The exec helper cannot be reached (its socket is missing or refuses connections).
    ExecHelperUnavailable,
    /// The exec helper: the container's config is not that of an unprivileged container
    /// without host access (`unprivileged: 1`, no `lxc.` keys, no host-path mount point, no
    /// device), or cannot be read.
    ExecGuestPrivileged,
    /// The exec helper: the transaction is not open in a step that runs commands in the guest
    /// (launch proof, bootstrap, checks); kept and settled transactions never are.
    ExecWrongPhase,
    /// The container's LXC command socket is held by someone other than root's LXC monitor of
    /// that container: `pct exec` was not run.
    ExecMonitorUntrusted,
    /// What `pct exec` started was not proven to run in the namespaces of the container's init
    /// that root's LXC monitor named (the container stopped or restarted meanwhile, or another
    /// process answered on its command socket): it was killed before the command ran.
    ExecAttachMismatch,
    /// The agent's pool does not exist on the cluster (PVE: `pool '<id>' does not exist`);
    /// `pveum pool add <id>` creates it.
    PoolMissing,
    /// The node runs a PVE older than the agent supports (`doctor` names the version found and
    /// the floor).
    PveUnsupported,
    /// A restore task ended OK but the guest is not in the agent's pool, where the token can
    /// neither mark nor remove it.
    GuestOutsidePool,
    /// The agent's state folder (journal, outbox, locks) has too little free space for the
    /// journal's write-ahead records; nothing was written.
    StateDirFull,
    /// A secret file (the PVE token, the hub token) is not one line of printable text.
    TokenFileInvalid,
    /// The operator interrupted the run (Ctrl-C, SIGTERM) while it ran in a guest.
    Interrupted,
    /// `doctor`: the agent's system user could run something outside the agent's units (a
    /// home it can write, a login sshd would accept, a user manager systemd would start).
    AgentUserUnconfined,
    /// The guest's boot did not end within the boot timeout (its systemd still `starting`,
    /// or in a state that is not `running` or `degraded`); the message names the state seen.
    BootUnfinished,
    /// The VM booted and its QEMU guest agent answers, but refuses `guest-exec` (blocked by
    /// its `--block-rpcs`/`--allow-rpcs`, as RHEL, Rocky and Alma ship it): nothing inside it
    /// can be judged; the message names the guest's setting that allows it.
    GuestExecBlocked,
    /// Preflight: the VM backup is of a guest whose inside the agent cannot judge (`ostype:
    /// win*`: no `/bin/sh`, no systemd, no osquery in the shape the checks read).
    GuestOsUnjudged,
}

impl ErrorCode {
    /// Every code.
    pub const ALL: [ErrorCode; 61] = [
        ErrorCode::VmidInvalid,
        ErrorCode::VmidReserved,
        ErrorCode::VmidInUse,
        ErrorCode::PveRefused,
        ErrorCode::PveUnreachable,
        ErrorCode::PveAuth,
        ErrorCode::TlsPinMismatch,
        ErrorCode::TaskFailed,
        ErrorCode::TaskTimeout,
        ErrorCode::GuestLocked,
        ErrorCode::LaunchUnproven,
        ErrorCode::BootstrapFailed,
        ErrorCode::CheckFailed,
        ErrorCode::BandFull,
        ErrorCode::ConfigInvalid,
        ErrorCode::OwnershipUnproven,
        ErrorCode::BackupMissing,
        ErrorCode::StorageInvalid,
        ErrorCode::ProfileInvalid,
        ErrorCode::ChecksInvalid,
        ErrorCode::PolicyDenied,
        ErrorCode::SdnDenied,
        ErrorCode::LabBridgeOpen,
        ErrorCode::GroupLabFailed,
        ErrorCode::BackupPrivileged,
        ErrorCode::BackupMounts,
        ErrorCode::BackupDevices,
        ErrorCode::BackupHookscript,
        ErrorCode::BackupAccess,
        ErrorCode::BackupArgs,
        ErrorCode::BackupHostDir,
        ErrorCode::BackupSharedMemory,
        ErrorCode::BackupHostPort,
        ErrorCode::BackupVmstate,
        ErrorCode::BackupTemplate,
        ErrorCode::BackupQuota,
        ErrorCode::GuestAgentOff,
        ErrorCode::StorageFull,
        ErrorCode::TagPolicy,
        ErrorCode::NotNeedsHuman,
        ErrorCode::TxnNotOpen,
        ErrorCode::TxnUnknown,
        ErrorCode::ExecCallerRefused,
        ErrorCode::ExecNotOwned,
        ErrorCode::ExecNotInPool,
        ErrorCode::ExecRequestInvalid,
        ErrorCode::ExecHelperUnavailable,
        ErrorCode::ExecGuestPrivileged,
        ErrorCode::ExecWrongPhase,
        ErrorCode::ExecMonitorUntrusted,
        ErrorCode::ExecAttachMismatch,
        ErrorCode::PoolMissing,
        ErrorCode::PveUnsupported,
        ErrorCode::GuestOutsidePool,
        ErrorCode::StateDirFull,
        ErrorCode::TokenFileInvalid,
        ErrorCode::Interrupted,
        ErrorCode::AgentUserUnconfined,
        ErrorCode::BootUnfinished,
        ErrorCode::GuestExecBlocked,
        ErrorCode::GuestOsUnjudged,
    ];

    /// The protocol version the code came with: a frame of an earlier version carries
    /// [`ErrorCode::in_version`] instead (a peer of that version refuses a code it does not
    /// know).
    pub fn since(self) -> u32 {
        match self {
            ErrorCode::LabBridgeOpen
            | ErrorCode::GroupLabFailed
            | ErrorCode::GuestExecBlocked
            | ErrorCode::GuestOsUnjudged => 2,
            _ => 1,
        }
    }

    /// The code a frame of version `v` carries for this one: itself when `v` has it, else the
    /// nearest code of `v` (of the same exit status; the message says what happened).
    pub fn in_version(self, v: u32) -> ErrorCode {
        if self.since() <= v {
            return self;
        }
        match self {
            // The node's set-up: an environment fault, as a wrong config is.
            ErrorCode::LabBridgeOpen | ErrorCode::GroupLabFailed => ErrorCode::ConfigInvalid,
            // Started but nothing inside could be judged.
            ErrorCode::GuestExecBlocked => ErrorCode::LaunchUnproven,
            // A backup refused before any write because the agent cannot look inside the
            // guest, as one without a guest agent is.
            ErrorCode::GuestOsUnjudged => ErrorCode::GuestAgentOff,
            other => other,
        }
    }

    /// The value as it appears on the wire, in the journal and in JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::VmidInvalid => "vmid_invalid",
            ErrorCode::VmidReserved => "vmid_reserved",
            ErrorCode::VmidInUse => "vmid_in_use",
            ErrorCode::PveRefused => "pve_refused",
            ErrorCode::PveUnreachable => "pve_unreachable",
            ErrorCode::PveAuth => "pve_auth",
            ErrorCode::TlsPinMismatch => "tls_pin_mismatch",
            ErrorCode::TaskFailed => "task_failed",
            ErrorCode::TaskTimeout => "task_timeout",
            ErrorCode::GuestLocked => "guest_locked",
            ErrorCode::LaunchUnproven => "launch_unproven",
            ErrorCode::BootstrapFailed => "bootstrap_failed",
            ErrorCode::CheckFailed => "check_failed",
            ErrorCode::BandFull => "band_full",
            ErrorCode::ConfigInvalid => "config_invalid",
            ErrorCode::OwnershipUnproven => "ownership_unproven",
            ErrorCode::BackupMissing => "backup_missing",
            ErrorCode::StorageInvalid => "storage_invalid",
            ErrorCode::ProfileInvalid => "profile_invalid",
            ErrorCode::ChecksInvalid => "checks_invalid",
            ErrorCode::PolicyDenied => "policy_denied",
            ErrorCode::SdnDenied => "sdn_denied",
            ErrorCode::LabBridgeOpen => "lab_bridge_open",
            ErrorCode::GroupLabFailed => "group_lab_failed",
            ErrorCode::BackupPrivileged => "backup_privileged",
            ErrorCode::BackupMounts => "backup_mounts",
            ErrorCode::BackupDevices => "backup_devices",
            ErrorCode::BackupHookscript => "backup_hookscript",
            ErrorCode::BackupAccess => "backup_access",
            ErrorCode::BackupArgs => "backup_args",
            ErrorCode::BackupHostDir => "backup_host_dir",
            ErrorCode::BackupSharedMemory => "backup_shared_memory",
            ErrorCode::BackupHostPort => "backup_host_port",
            ErrorCode::BackupVmstate => "backup_vmstate",
            ErrorCode::BackupTemplate => "backup_template",
            ErrorCode::BackupQuota => "backup_quota",
            ErrorCode::GuestAgentOff => "guest_agent_off",
            ErrorCode::StorageFull => "storage_full",
            ErrorCode::TagPolicy => "tag_policy",
            ErrorCode::NotNeedsHuman => "not_needs_human",
            ErrorCode::TxnNotOpen => "txn_not_open",
            ErrorCode::TxnUnknown => "txn_unknown",
            ErrorCode::ExecCallerRefused => "exec_caller_refused",
            ErrorCode::ExecNotOwned => "exec_not_owned",
            ErrorCode::ExecNotInPool => "exec_not_in_pool",
            ErrorCode::ExecRequestInvalid => "exec_request_invalid",
            ErrorCode::ExecHelperUnavailable => "exec_helper_unavailable",
            ErrorCode::ExecGuestPrivileged => "exec_guest_privileged",
            ErrorCode::ExecWrongPhase => "exec_wrong_phase",
            ErrorCode::ExecMonitorUntrusted => "exec_monitor_untrusted",
            ErrorCode::ExecAttachMismatch => "exec_attach_mismatch",
            ErrorCode::PoolMissing => "pool_missing",
            ErrorCode::PveUnsupported => "pve_unsupported",
            ErrorCode::GuestOutsidePool => "guest_outside_pool",
            ErrorCode::StateDirFull => "state_dir_full",
            ErrorCode::TokenFileInvalid => "token_file_invalid",
            ErrorCode::Interrupted => "interrupted",
            ErrorCode::AgentUserUnconfined => "agent_user_unconfined",
            ErrorCode::BootUnfinished => "boot_unfinished",
            ErrorCode::GuestExecBlocked => "guest_exec_blocked",
            ErrorCode::GuestOsUnjudged => "guest_os_unjudged",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error with its stable code and a message for an operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorInfo {
    /// The stable code.
    pub code: ErrorCode,
    /// What happened, naming the vmid, node, UPID or path concerned. Never a secret.
    pub message: String,
}

/// The verdict of one osquery check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckStatus {
    /// The expectation held.
    Pass,
    /// The query ran and the expectation did not hold.
    Fail,
    /// The query could not run (osqueryi missing, timeout, SQL error).
    Error,
    /// The check could not judge this guest, and its message says why (a VM's hostname: PVE
    /// keeps none for a VM). Not a pass: never counted as one. Not a fault either: a verdict
    /// of passes and skips is ok, and says how many were not judged. Since protocol version 2
    /// ([`CheckStatus::in_version`]).
    Skipped,
}

impl CheckStatus {
    /// The value as it appears on the wire, in the journal and in JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            CheckStatus::Pass => "pass",
            CheckStatus::Fail => "fail",
            CheckStatus::Error => "error",
            CheckStatus::Skipped => "skipped",
        }
    }

    /// The protocol version the status came with: a frame of an earlier version carries
    /// [`CheckStatus::in_version`] instead (a peer of that version refuses a status it does
    /// not know).
    pub fn since(self) -> u32 {
        match self {
            CheckStatus::Skipped => 2,
            _ => 1,
        }
    }

    /// The status a frame of version `v` carries for this one: itself when `v` has it, else
    /// the nearest status of `v`. A skip goes out as `error` ("the query could not run"):
    /// like it, the check gave no verdict on the guest, and the message says why. Never as
    /// `pass`, which would tell an older hub the guest was judged and found good; nor as
    /// `fail`, which would say the guest was found at fault.
    pub fn in_version(self, v: u32) -> CheckStatus {
        if self.since() <= v {
            return self;
        }
        match self {
            CheckStatus::Skipped => CheckStatus::Error,
            other => other,
        }
    }
}

impl std::fmt::Display for CheckStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One row printed by `osqueryi --json`: column name to value. osqueryi renders every value as
/// a string.
pub type CheckRow = BTreeMap<String, String>;

/// One osquery check and the rows it saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckReport {
    /// The check's name from its check pack.
    pub name: String,
    /// The verdict.
    pub status: CheckStatus,
    /// The rows seen, at most the agent's row limit.
    pub rows: Vec<CheckRow>,
    /// How many rows the query returned.
    pub row_count: u64,
    /// Whether `rows` holds fewer rows than the query returned.
    pub rows_truncated: bool,
    /// Why the check failed or errored; `None` when it passed.
    pub message: Option<String>,
    /// How long the query took, in milliseconds.
    pub duration_ms: u64,
}

#[cfg(test)]
mod tests {
    use serde::de::DeserializeOwned;
    use serde_json::{json, Value};

    use super::*;

    /// Every value's wire text, both ways: these strings are part of the protocol.
    fn pins<T>(table: &[(T, &str)])
    where
        T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug + std::fmt::Display,
    {
        for (value, text) in table {
            assert_eq!(serde_json::to_value(value).unwrap(), json!(text));
            assert_eq!(
                &value.to_string(),
                text,
                "as_str differs from the wire text"
            );
            assert_eq!(&serde_json::from_value::<T>(json!(text)).unwrap(), value);
        }
    }

    #[test]
    fn kinds_on_the_wire() {
        pins(&[
            (TxnKind::Provision, "provision"),
            (TxnKind::Destroy, "destroy"),
            (TxnKind::SelftestProvision, "selftest-provision"),
            (TxnKind::SelftestRestore, "restore-test"),
        ]);
        // The name journals and frames of earlier versions wrote reads as the same kind.
        assert_eq!(
            serde_json::from_value::<TxnKind>(json!("selftest-restore")).unwrap(),
            TxnKind::SelftestRestore
        );
        assert!(serde_json::from_value::<TxnKind>(json!("selftest_restore")).is_err());
        assert!(serde_json::from_value::<TxnKind>(json!("restore_test")).is_err());
        assert_eq!(
            TxnKind::SelftestRestore.name_in_version(1),
            "selftest-restore"
        );
        assert_eq!(TxnKind::SelftestRestore.name_in_version(2), "restore-test");
        assert_eq!(TxnKind::Provision.name_in_version(1), "provision");
    }

    #[test]
    fn phases_on_the_wire() {
        pins(&[
            (Phase::Planned, "planned"),
            (Phase::Validated, "validated"),
            (Phase::Submitted, "submitted"),
            (Phase::Created, "created"),
            (Phase::Started, "started"),
            (Phase::Launched, "launched"),
            (Phase::Booted, "booted"),
            (Phase::Bootstrapped, "bootstrapped"),
            (Phase::Verified, "verified"),
            (Phase::Reported, "reported"),
            (Phase::Failed, "failed"),
            (Phase::Destroyed, "destroyed"),
            (Phase::Skipped, "skipped"),
            (Phase::NeedsHuman, "needs_human"),
        ]);
    }

    #[test]
    fn outcomes_and_check_statuses_on_the_wire() {
        pins(&[
            (Outcome::Ok, "ok"),
            (Outcome::Refused, "refused"),
            (Outcome::Failed, "failed"),
            (Outcome::Skipped, "skipped"),
            (Outcome::NeedsHuman, "needs_human"),
        ]);
        pins(&[
            (CheckStatus::Pass, "pass"),
            (CheckStatus::Fail, "fail"),
            (CheckStatus::Error, "error"),
            (CheckStatus::Skipped, "skipped"),
        ]);
        // Version 1 has no `skipped`: its frames carry `error`, never `pass`.
        for status in [CheckStatus::Pass, CheckStatus::Fail, CheckStatus::Error] {
            assert_eq!(status.since(), 1);
            assert_eq!(status.in_version(1), status);
        }
        assert_eq!(CheckStatus::Skipped.since(), 2);
        assert_eq!(CheckStatus::Skipped.in_version(1), CheckStatus::Error);
        assert_eq!(CheckStatus::Skipped.in_version(2), CheckStatus::Skipped);
    }

    #[test]
    fn error_codes_on_the_wire() {
        pins(&[
            (ErrorCode::VmidInvalid, "vmid_invalid"),
            (ErrorCode::VmidReserved, "vmid_reserved"),
            (ErrorCode::VmidInUse, "vmid_in_use"),
            (ErrorCode::PveRefused, "pve_refused"),
            (ErrorCode::PveUnreachable, "pve_unreachable"),
            (ErrorCode::PveAuth, "pve_auth"),
            (ErrorCode::TlsPinMismatch, "tls_pin_mismatch"),
            (ErrorCode::TaskFailed, "task_failed"),
            (ErrorCode::TaskTimeout, "task_timeout"),
            (ErrorCode::GuestLocked, "guest_locked"),
            (ErrorCode::LaunchUnproven, "launch_unproven"),
            (ErrorCode::BootstrapFailed, "bootstrap_failed"),
            (ErrorCode::CheckFailed, "check_failed"),
            (ErrorCode::BandFull, "band_full"),
            (ErrorCode::ConfigInvalid, "config_invalid"),
            (ErrorCode::OwnershipUnproven, "ownership_unproven"),
            (ErrorCode::BackupMissing, "backup_missing"),
            (ErrorCode::StorageInvalid, "storage_invalid"),
            (ErrorCode::ProfileInvalid, "profile_invalid"),
            (ErrorCode::ChecksInvalid, "checks_invalid"),
            (ErrorCode::PolicyDenied, "policy_denied"),
            (ErrorCode::SdnDenied, "sdn_denied"),
            (ErrorCode::LabBridgeOpen, "lab_bridge_open"),
            (ErrorCode::GroupLabFailed, "group_lab_failed"),
            (ErrorCode::BackupPrivileged, "backup_privileged"),
            (ErrorCode::BackupMounts, "backup_mounts"),
            (ErrorCode::BackupDevices, "backup_devices"),
            (ErrorCode::BackupHookscript, "backup_hookscript"),
            (ErrorCode::BackupAccess, "backup_access"),
            (ErrorCode::BackupArgs, "backup_args"),
            (ErrorCode::BackupHostDir, "backup_host_dir"),
            (ErrorCode::BackupSharedMemory, "backup_shared_memory"),
            (ErrorCode::BackupHostPort, "backup_host_port"),
            (ErrorCode::BackupVmstate, "backup_vmstate"),
            (ErrorCode::BackupTemplate, "backup_template"),
            (ErrorCode::BackupQuota, "backup_quota"),
            (ErrorCode::GuestAgentOff, "guest_agent_off"),
            (ErrorCode::StorageFull, "storage_full"),
            (ErrorCode::TagPolicy, "tag_policy"),
            (ErrorCode::NotNeedsHuman, "not_needs_human"),
            (ErrorCode::TxnNotOpen, "txn_not_open"),
            (ErrorCode::TxnUnknown, "txn_unknown"),
            (ErrorCode::PoolMissing, "pool_missing"),
            (ErrorCode::PveUnsupported, "pve_unsupported"),
            (ErrorCode::GuestOutsidePool, "guest_outside_pool"),
            (ErrorCode::ExecMonitorUntrusted, "exec_monitor_untrusted"),
            (ErrorCode::ExecAttachMismatch, "exec_attach_mismatch"),
            (ErrorCode::StateDirFull, "state_dir_full"),
            (ErrorCode::TokenFileInvalid, "token_file_invalid"),
            (ErrorCode::Interrupted, "interrupted"),
            (ErrorCode::AgentUserUnconfined, "agent_user_unconfined"),
            (ErrorCode::BootUnfinished, "boot_unfinished"),
            (ErrorCode::GuestExecBlocked, "guest_exec_blocked"),
            (ErrorCode::GuestOsUnjudged, "guest_os_unjudged"),
        ]);
        assert_eq!(ErrorCode::ALL.len(), 61);
    }

    #[test]
    fn check_rows_are_string_maps() {
        let report: CheckReport = serde_json::from_value(json!({
            "name": "users", "status": "fail", "rows": [{"uid": "0", "username": "root"}],
            "row_count": 1, "rows_truncated": false, "message": "root may log in",
            "duration_ms": 41
        }))
        .unwrap();
        assert_eq!(report.rows[0]["uid"], "0");
        // osqueryi prints every value as a string; a number is not a row osqueryi wrote.
        let numeric: Value = json!({
            "name": "users", "status": "fail", "rows": [{"uid": 0}],
            "row_count": 1, "rows_truncated": false, "message": null, "duration_ms": 41
        });
        assert!(serde_json::from_value::<CheckReport>(numeric).is_err());
    }
}
