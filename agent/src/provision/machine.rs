//! The provision transaction as a pure state machine.
//!
//! [`step`] takes the current [`State`] and one [`Event`] (what the executor observed) and returns
//! the next state and the [`Effect`]s to perform, in order. [`recover`] does the same for a
//! transaction left open by a crashed run (DESIGN rule 6). This module owns the proof-of-launch
//! gate (DESIGN rule 5): destroy is armed only when the create/restore task this transaction
//! submitted (its own UPID, journaled at `submitted` before the outcome is known) ended OK *and*
//! the guest carries this transaction's marker, read back after writing it; the birth identity
//! read with it (MACs, vmgenid, smbios1 uuid: see [`BirthIdentity`]) is recorded then. An
//! [`Effect::Destroy`] is emitted only while armed and only in answer to a fresh ownership
//! re-check ([`Effect::RecheckOwnership`] answered by [`Event::GuestObserved`] showing the
//! marker and the identical identity, [`State::proves`]); the executor asks [`State::proves`]
//! once more on its last read, after the stop and right before the DELETE.
//!
//! It never performs IO, never reads a clock and never sleeps. The executor performs the effects
//! in the order given; a [`Effect::Journal`] always comes first and must be on disk (fsynced)
//! before the PVE write that follows it (write-ahead).
//!
//! The machine is keyed by [`Step`] (what it waits for); [`Phase`] is the operator-visible
//! phase of DESIGN section 5 that the journal and the final JSON show.

use std::fmt;

use serde::{Deserialize, Serialize};
use ulid::Ulid;

use super::identity::BirthIdentity;
use crate::error::{ErrorCode, ExitStatus, Failure};
use crate::pve::GuestKind;

/// How a transaction ended (`ok`, `refused`, `failed`, `skipped`, `needs_human`). The wire
/// protocol's own enum (`hub_protocol::Outcome`); [`Outcome`] here is the whole final record.
pub use hub_protocol::Outcome as OutcomeKind;
/// The operator-visible phase of a transaction (DESIGN section 5), as journaled and reported;
/// ordered along the forward path. The wire protocol's own enum.
pub use hub_protocol::Phase;
/// What started the transaction (the `kind` of the final JSON). The wire protocol's own enum.
pub use hub_protocol::TxnKind;

/// PVE's limit on a guest description, in characters.
pub const DESCRIPTION_MAX_CHARS: usize = 8192;

/// The most bytes of a transaction's failure message. Messages carry text from outside (a
/// guest's bootstrap or check output, PVE's task logs); clipped here, a journal record can
/// never outgrow its cap and stop a cleanup.
pub const FAILURE_MESSAGE_MAX_BYTES: usize = 4096;

/// `message` cut to [`FAILURE_MESSAGE_MAX_BYTES`] on a character boundary, saying how much
/// was cut.
pub fn clip_message(message: String) -> String {
    if message.len() <= FAILURE_MESSAGE_MAX_BYTES {
        return message;
    }
    let marker_room = 64;
    let mut end = FAILURE_MESSAGE_MAX_BYTES - marker_room;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{} … ({} more bytes clipped)",
        &message[..end],
        message.len() - end
    )
}

/// What the machine waits for next. The transition table is keyed by (step, event).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Waiting for the vmid verdict: [`Event::VmidAccepted`], [`Event::VmidRefused`],
    /// [`Event::BandFull`].
    Validate,
    /// Waiting for PVE's answer to the restore request.
    Submit,
    /// The restore request's answer is unknown (a 5xx that is not a certain refusal, a lost
    /// connection, a run killed mid-request); waiting for the search of the node's task list
    /// and the full guest list ([`Effect::FindOwnTask`]).
    ProbeSubmit,
    /// Waiting for the restore task (our UPID) to end.
    Task,
    /// The restore task overran its timeout and was asked to stop; waiting for it to end.
    StopTask,
    /// The restore task failed; waiting for a read of the vmid (a failed QEMU restore leaves
    /// its config behind, and so does an LXC restore that failed after the create, e.g. in the
    /// pool join).
    ProbeLeftover,
    /// Waiting for the marker write (config PUT) to be done.
    WriteMarker,
    /// Waiting for the marker to be read back.
    VerifyMarker,
    /// Waiting for the guest start to finish.
    Start,
    /// Waiting for the proof of launch (running and answers an exec).
    ProveLaunch,
    /// Waiting for the guest's boot to end (systemd's `is-system-running`), so the
    /// bootstrap and the checks judge a booted guest, not one whose units have not run yet.
    WaitBoot,
    /// Waiting for the bootstrap profile to finish.
    Bootstrap,
    /// Waiting for the osquery checks.
    Checks,
    /// Waiting for the result to be in the outbox.
    Report,
    /// Waiting for the fresh ownership re-check that must precede any destroy.
    Recheck,
    /// Waiting for the destroy (and its task) to end.
    Destroy,
    /// Waiting for a re-read confirming the guest is gone.
    ConfirmDestroyed,
    /// The transaction is settled; no event is accepted.
    Done,
}

impl Step {
    /// Every step.
    pub const ALL: [Step; 18] = [
        Step::Validate,
        Step::Submit,
        Step::ProbeSubmit,
        Step::Task,
        Step::StopTask,
        Step::ProbeLeftover,
        Step::WriteMarker,
        Step::VerifyMarker,
        Step::Start,
        Step::ProveLaunch,
        Step::WaitBoot,
        Step::Bootstrap,
        Step::Checks,
        Step::Report,
        Step::Recheck,
        Step::Destroy,
        Step::ConfirmDestroyed,
        Step::Done,
    ];

    /// The event kinds this step accepts (the transition table's rows for this step).
    pub fn accepts(self) -> &'static [EventKind] {
        use EventKind as E;
        match self {
            Step::Validate => &[E::VmidAccepted, E::VmidRefused, E::BandFull],
            Step::Submit => &[E::Submitted, E::SubmitRefused, E::SubmitUnknown],
            Step::ProbeSubmit => &[E::SubmitProbed],
            Step::Task | Step::StopTask => &[E::TaskEnded, E::TaskWaitTimedOut],
            Step::WriteMarker => &[E::MarkerWritten, E::MarkerWriteFailed],
            Step::ProbeLeftover | Step::VerifyMarker | Step::Recheck | Step::ConfirmDestroyed => {
                &[E::GuestObserved]
            }
            Step::Start => &[E::Started, E::StartFailed],
            Step::ProveLaunch => &[E::LaunchProven, E::LaunchUnproven, E::GuestExecBlocked],
            Step::WaitBoot => &[E::BootEnded, E::BootUnfinished, E::GroupLabFailed],
            Step::Bootstrap => &[E::Bootstrapped, E::BootstrapFailed],
            Step::Checks => &[E::ChecksPassed, E::ChecksFailed],
            Step::Report => &[E::ReportQueued],
            Step::Destroy => &[E::DestroyEnded, E::GuestObserved],
            Step::Done => &[],
        }
    }

    /// The step's name in logs and the journal.
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Validate => "validate",
            Step::Submit => "submit",
            Step::ProbeSubmit => "probe_submit",
            Step::Task => "task",
            Step::StopTask => "stop_task",
            Step::ProbeLeftover => "probe_leftover",
            Step::WriteMarker => "write_marker",
            Step::VerifyMarker => "verify_marker",
            Step::Start => "start",
            Step::ProveLaunch => "prove_launch",
            Step::WaitBoot => "wait_boot",
            Step::Bootstrap => "bootstrap",
            Step::Checks => "checks",
            Step::Report => "report",
            Step::Recheck => "recheck",
            Step::Destroy => "destroy",
            Step::ConfirmDestroyed => "confirm_destroyed",
            Step::Done => "done",
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The ownership marker a transaction puts on the guest it created: the tags `felhom` and
/// `felhom-<txn>` (lowercase: PVE lowercases tags) and one description line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    txn: Ulid,
}

impl Marker {
    /// The fleet tag every guest of this agent carries.
    pub const FLEET_TAG: &'static str = "felhom";

    /// The marker of transaction `txn`.
    pub fn new(txn: Ulid) -> Self {
        Self { txn }
    }

    /// The transaction whose marker this is.
    pub fn txn(&self) -> Ulid {
        self.txn
    }

    /// `felhom-<txn>` in lowercase.
    pub fn txn_tag(&self) -> String {
        format!(
            "{}-{}",
            Self::FLEET_TAG,
            self.txn.to_string().to_ascii_lowercase()
        )
    }

    /// Both tags of the marker.
    pub fn tags(&self) -> Vec<String> {
        vec![Self::FLEET_TAG.to_string(), self.txn_tag()]
    }

    /// The description line of the marker.
    pub fn description_line(&self) -> String {
        format!("felhom-agent transaction {} created this guest", self.txn)
    }

    /// Whether a guest with these tags (as PVE returns them: separated by `;`, `,` or
    /// whitespace, in any case) and this description carries the marker.
    pub fn is_carried_by(&self, tags: &str, description: &str) -> bool {
        let txn_tag = self.txn_tag();
        let tags: Vec<String> = split_tags(tags).map(str::to_ascii_lowercase).collect();
        let has_tags = tags.iter().any(|t| t == Self::FLEET_TAG) && tags.contains(&txn_tag);
        let line = self.description_line();
        has_tags && description.lines().any(|l| l.trim() == line)
    }

    /// Whether this description holds the marker's line (the restore request writes it, before
    /// the tags are added).
    pub fn description_carried(&self, description: &str) -> bool {
        let line = self.description_line();
        description.lines().any(|l| l.trim() == line)
    }

    /// The tags to PUT: the guest's existing tags plus the marker's, de-duplicated, joined
    /// with `;`.
    pub fn merged_tags(&self, existing: &str) -> String {
        let mut out: Vec<String> = Vec::new();
        for tag in split_tags(existing).map(str::to_string).chain(self.tags()) {
            if !out.iter().any(|t| t.eq_ignore_ascii_case(&tag)) {
                out.push(tag);
            }
        }
        out.join(";")
    }

    /// The description to PUT: the marker line first, then the existing description, cut to
    /// PVE's limit of [`DESCRIPTION_MAX_CHARS`] characters.
    pub fn merged_description(&self, existing: &str) -> String {
        let line = self.description_line();
        if existing.lines().any(|l| l.trim() == line) {
            return existing.chars().take(DESCRIPTION_MAX_CHARS).collect();
        }
        let mut out = line;
        if !existing.is_empty() {
            out.push('\n');
            out.push_str(existing);
        }
        out.chars().take(DESCRIPTION_MAX_CHARS).collect()
    }
}

fn split_tags(tags: &str) -> impl Iterator<Item = &str> {
    tags.split(|c: char| c == ';' || c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
}

/// What the executor saw when it read the guest at the transaction's vmid: the full guest list
/// (`.vmlist`, DESIGN rule 2) for presence, the API config for tags, description and lock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum GuestView {
    /// The vmid is not in the full guest list.
    Absent,
    /// The vmid is in the full guest list and its config was read.
    Present {
        /// The `tags` config value as PVE returned it (empty when unset).
        tags: String,
        /// The `description` config value (empty when unset).
        description: String,
        /// The config lock (`backup`, `create`, `destroyed`, ...), if any.
        lock: Option<String>,
        /// The values PVE generated for it (MACs, vmgenid, smbios1 uuid).
        #[serde(default)]
        identity: BirthIdentity,
    },
    /// The vmid is in the full guest list but its config could not be read with the
    /// pool-scoped token (outside the pool, or the read failed).
    Unreadable {
        /// Why, for the operator (e.g. PVE's answer).
        reason: String,
    },
}

/// A [`GuestView`] judged against a marker (and, once recorded, the birth identity).
enum Seen<'a> {
    Absent,
    Ours {
        lock: Option<&'a str>,
    },
    NotOurs {
        tags: &'a str,
    },
    /// The marker is there but the birth identity is not: a copy (a backup restored, a clone,
    /// a hand edit), never this transaction's guest.
    Copy {
        differs: String,
    },
    Unreadable {
        reason: &'a str,
    },
}

impl GuestView {
    /// Whether the guest is present and carries `marker`.
    pub fn carries(&self, marker: &Marker) -> bool {
        matches!(self.judge(marker), Seen::Ours { .. })
    }

    fn judge(&self, marker: &Marker) -> Seen<'_> {
        match self {
            GuestView::Absent => Seen::Absent,
            GuestView::Present {
                tags,
                description,
                lock,
                ..
            } => {
                if marker.is_carried_by(tags, description) {
                    Seen::Ours {
                        lock: lock.as_deref(),
                    }
                } else {
                    Seen::NotOurs { tags }
                }
            }
            GuestView::Unreadable { reason } => Seen::Unreadable { reason },
        }
    }

    /// A present guest as its config reads (`GET .../config`): tags, description, lock and
    /// birth identity.
    pub fn from_config(config: &std::collections::BTreeMap<String, serde_json::Value>) -> Self {
        let text = |k: &str| config.get(k).and_then(|v| v.as_str()).map(str::to_string);
        GuestView::Present {
            tags: text("tags").unwrap_or_default(),
            description: text("description").unwrap_or_default(),
            lock: text("lock"),
            identity: BirthIdentity::from_config(config),
        }
    }

    /// The birth identity seen, when the guest is present and was read.
    pub fn identity(&self) -> Option<&BirthIdentity> {
        match self {
            GuestView::Present { identity, .. } => Some(identity),
            _ => None,
        }
    }

    /// Whether the guest is present and its description holds `marker`'s line.
    fn description_carries(&self, marker: &Marker) -> bool {
        match self {
            GuestView::Present { description, .. } => marker.description_carried(description),
            _ => false,
        }
    }
}

/// How a PVE task (the restore, or a destroy) ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum TaskExit {
    /// `TASK OK` (or `WARNINGS: N`, which PVE counts as success).
    Ok,
    /// The task ended with an error, or PVE refused the request synchronously.
    Error {
        /// PVE's exit status or refusal, verbatim.
        message: String,
    },
}

/// What PVE says now about the restore task a crashed run recorded (its UPID).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum TaskObservation {
    /// The task is still running.
    Running,
    /// The task ended OK.
    Ok,
    /// The task ended with an error.
    Error {
        /// PVE's exit status, verbatim.
        message: String,
    },
    /// The task's status could not be read (e.g. `no such task`), or no UPID was recorded.
    Unknown {
        /// Why.
        message: String,
    },
}

/// What the executor observed for [`recover`]: the recorded task's status and the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryObservation {
    /// Status of the UPID the journal recorded (ignored when none was recorded).
    pub task: TaskObservation,
    /// The guest at the transaction's vmid now.
    pub guest: GuestView,
}

/// What the executor found after a restore request whose answer is unknown: the node's task
/// list for this token and vmid, and the full guest list (DESIGN rule 2), searched until a
/// task shows or a settle window passed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "found", rename_all = "snake_case")]
pub enum SubmitProbe {
    /// Exactly one restore task of the guest's type (`vzrestore`/`qmrestore`) for this vmid,
    /// started by this agent's token at or after the transaction's intent was journaled: this
    /// transaction's own task.
    OwnTask {
        /// Its UPID.
        upid: String,
    },
    /// The task list was read and showed no such task, and the full guest list had no guest at
    /// the vmid, for the whole settle window: the request created nothing.
    Nothing {
        /// How long the search went on, in seconds.
        waited_secs: u64,
    },
    /// Anything else: a guest at the vmid without a task of ours, a task list that could not
    /// be read, or more than one candidate task.
    Unproven {
        /// The guest at the vmid, as last seen.
        guest: GuestView,
        /// What the search saw, for the operator.
        detail: String,
    },
}

/// What the executor reports back to the machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The vmid is valid, not reserved and free in the full guest list.
    VmidAccepted,
    /// The vmid is refused (`vmid_invalid`, `vmid_reserved`, `vmid_in_use`); nothing was written.
    VmidRefused(Failure),
    /// The restore-test band is full: the run is skipped.
    BandFull {
        /// What holds the band, for the operator.
        message: String,
    },
    /// PVE accepted the restore request and answered with the task's UPID.
    Submitted {
        /// The UPID PVE returned.
        upid: String,
    },
    /// PVE refused the restore request synchronously (e.g. `CT 101 already exists on node
    /// 'pve1'`), or it could not be sent: no task exists.
    SubmitRefused(Failure),
    /// The restore request may have reached PVE but its answer is unknown (timeout, reset, a
    /// 5xx that is not a certain refusal).
    SubmitUnknown(Failure),
    /// The answer to [`Effect::FindOwnTask`].
    SubmitProbed(SubmitProbe),
    /// A task this transaction follows ended.
    TaskEnded {
        /// The task's UPID (must be the one this transaction recorded).
        upid: String,
        /// How it ended.
        exit: TaskExit,
    },
    /// Waiting for the task went past its timeout; the task may still run.
    TaskWaitTimedOut {
        /// The task's UPID (must be the one this transaction recorded).
        upid: String,
    },
    /// The marker config PUT succeeded.
    MarkerWritten,
    /// The marker config PUT failed.
    MarkerWriteFailed(Failure),
    /// The guest at the vmid was read (answer to [`Effect::ProbeGuest`],
    /// [`Effect::VerifyMarker`], [`Effect::RecheckOwnership`], [`Effect::ConfirmDestroyed`]).
    GuestObserved(GuestView),
    /// The guest start (and its task) ended OK.
    Started,
    /// The guest start was refused or its task failed.
    StartFailed {
        /// PVE's message.
        message: String,
    },
    /// The guest is running and answered an exec.
    LaunchProven,
    /// The guest did not prove its launch.
    LaunchUnproven {
        /// What was seen.
        message: String,
    },
    /// The VM's guest agent answered, but refuses the exec every command in a VM needs: the
    /// guest cannot be judged.
    GuestExecBlocked {
        /// What the guest agent said, and how to allow it.
        message: String,
    },
    /// The guest's boot ended (or there is no boot state to wait for).
    BootEnded {
        /// What was waited for and seen, for the report.
        seen: String,
    },
    /// The guest's boot did not end within the boot timeout.
    BootUnfinished {
        /// The boot state seen, and what still ran.
        message: String,
    },
    /// A member of an application group could not be joined to its group's lab (the node's
    /// doing, not the backup's).
    GroupLabFailed {
        /// Why, naming the lab.
        message: String,
    },
    /// The bootstrap profile ran successfully.
    Bootstrapped,
    /// The bootstrap profile failed (exit status, timeout, push error).
    BootstrapFailed {
        /// What failed.
        message: String,
    },
    /// Every osquery check passed.
    ChecksPassed,
    /// A check failed or could not run.
    ChecksFailed {
        /// Which checks, and how.
        message: String,
    },
    /// The result is in the durable outbox.
    ReportQueued,
    /// The destroy request and its task ended (a synchronous refusal is an error too).
    DestroyEnded(TaskExit),
}

/// The kind of an [`Event`], without its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// [`Event::VmidAccepted`].
    VmidAccepted,
    /// [`Event::VmidRefused`].
    VmidRefused,
    /// [`Event::BandFull`].
    BandFull,
    /// [`Event::Submitted`].
    Submitted,
    /// [`Event::SubmitRefused`].
    SubmitRefused,
    /// [`Event::SubmitUnknown`].
    SubmitUnknown,
    /// [`Event::SubmitProbed`].
    SubmitProbed,
    /// [`Event::TaskEnded`].
    TaskEnded,
    /// [`Event::TaskWaitTimedOut`].
    TaskWaitTimedOut,
    /// [`Event::MarkerWritten`].
    MarkerWritten,
    /// [`Event::MarkerWriteFailed`].
    MarkerWriteFailed,
    /// [`Event::GuestObserved`].
    GuestObserved,
    /// [`Event::Started`].
    Started,
    /// [`Event::StartFailed`].
    StartFailed,
    /// [`Event::LaunchProven`].
    LaunchProven,
    /// [`Event::LaunchUnproven`].
    LaunchUnproven,
    /// [`Event::GuestExecBlocked`].
    GuestExecBlocked,
    /// [`Event::BootEnded`].
    BootEnded,
    /// [`Event::BootUnfinished`].
    BootUnfinished,
    /// [`Event::GroupLabFailed`].
    GroupLabFailed,
    /// [`Event::Bootstrapped`].
    Bootstrapped,
    /// [`Event::BootstrapFailed`].
    BootstrapFailed,
    /// [`Event::ChecksPassed`].
    ChecksPassed,
    /// [`Event::ChecksFailed`].
    ChecksFailed,
    /// [`Event::ReportQueued`].
    ReportQueued,
    /// [`Event::DestroyEnded`].
    DestroyEnded,
}

impl EventKind {
    /// Every event kind.
    pub const ALL: [EventKind; 26] = [
        EventKind::VmidAccepted,
        EventKind::VmidRefused,
        EventKind::BandFull,
        EventKind::Submitted,
        EventKind::SubmitRefused,
        EventKind::SubmitUnknown,
        EventKind::SubmitProbed,
        EventKind::TaskEnded,
        EventKind::TaskWaitTimedOut,
        EventKind::MarkerWritten,
        EventKind::MarkerWriteFailed,
        EventKind::GuestObserved,
        EventKind::Started,
        EventKind::StartFailed,
        EventKind::LaunchProven,
        EventKind::LaunchUnproven,
        EventKind::GuestExecBlocked,
        EventKind::BootEnded,
        EventKind::BootUnfinished,
        EventKind::GroupLabFailed,
        EventKind::Bootstrapped,
        EventKind::BootstrapFailed,
        EventKind::ChecksPassed,
        EventKind::ChecksFailed,
        EventKind::ReportQueued,
        EventKind::DestroyEnded,
    ];

    /// The kind's name in logs and errors.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::VmidAccepted => "vmid_accepted",
            EventKind::VmidRefused => "vmid_refused",
            EventKind::BandFull => "band_full",
            EventKind::Submitted => "submitted",
            EventKind::SubmitRefused => "submit_refused",
            EventKind::SubmitUnknown => "submit_unknown",
            EventKind::SubmitProbed => "submit_probed",
            EventKind::TaskEnded => "task_ended",
            EventKind::TaskWaitTimedOut => "task_wait_timed_out",
            EventKind::MarkerWritten => "marker_written",
            EventKind::MarkerWriteFailed => "marker_write_failed",
            EventKind::GuestObserved => "guest_observed",
            EventKind::Started => "started",
            EventKind::StartFailed => "start_failed",
            EventKind::LaunchProven => "launch_proven",
            EventKind::LaunchUnproven => "launch_unproven",
            EventKind::GuestExecBlocked => "guest_exec_blocked",
            EventKind::BootEnded => "boot_ended",
            EventKind::BootUnfinished => "boot_unfinished",
            EventKind::GroupLabFailed => "group_lab_failed",
            EventKind::Bootstrapped => "bootstrapped",
            EventKind::BootstrapFailed => "bootstrap_failed",
            EventKind::ChecksPassed => "checks_passed",
            EventKind::ChecksFailed => "checks_failed",
            EventKind::ReportQueued => "report_queued",
            EventKind::DestroyEnded => "destroy_ended",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Event {
    /// This event's kind.
    pub fn kind(&self) -> EventKind {
        match self {
            Event::VmidAccepted => EventKind::VmidAccepted,
            Event::VmidRefused(_) => EventKind::VmidRefused,
            Event::BandFull { .. } => EventKind::BandFull,
            Event::Submitted { .. } => EventKind::Submitted,
            Event::SubmitRefused(_) => EventKind::SubmitRefused,
            Event::SubmitUnknown(_) => EventKind::SubmitUnknown,
            Event::SubmitProbed(_) => EventKind::SubmitProbed,
            Event::TaskEnded { .. } => EventKind::TaskEnded,
            Event::TaskWaitTimedOut { .. } => EventKind::TaskWaitTimedOut,
            Event::MarkerWritten => EventKind::MarkerWritten,
            Event::MarkerWriteFailed(_) => EventKind::MarkerWriteFailed,
            Event::GuestObserved(_) => EventKind::GuestObserved,
            Event::Started => EventKind::Started,
            Event::StartFailed { .. } => EventKind::StartFailed,
            Event::LaunchProven => EventKind::LaunchProven,
            Event::LaunchUnproven { .. } => EventKind::LaunchUnproven,
            Event::GuestExecBlocked { .. } => EventKind::GuestExecBlocked,
            Event::BootEnded { .. } => EventKind::BootEnded,
            Event::BootUnfinished { .. } => EventKind::BootUnfinished,
            Event::GroupLabFailed { .. } => EventKind::GroupLabFailed,
            Event::Bootstrapped => EventKind::Bootstrapped,
            Event::BootstrapFailed { .. } => EventKind::BootstrapFailed,
            Event::ChecksPassed => EventKind::ChecksPassed,
            Event::ChecksFailed { .. } => EventKind::ChecksFailed,
            Event::ReportQueued => EventKind::ReportQueued,
            Event::DestroyEnded(_) => EventKind::DestroyEnded,
        }
    }
}

/// One call a dry run would make (printed, never performed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum PlanStep {
    /// The restore request.
    Restore {
        /// Target vmid.
        vmid: u32,
        /// LXC or QEMU.
        guest: GuestKind,
        /// Backup volid.
        volid: String,
        /// Target storage.
        storage: String,
        /// Target pool.
        pool: String,
        /// New MAC addresses (always true).
        unique: bool,
        /// Network links down / removed (restore-test).
        isolate_network: bool,
    },
    /// Follow the restore task to its end.
    WaitTask,
    /// Put the marker on the guest (config PUT of tags and description).
    WriteMarker {
        /// Tags that would be added.
        tags: Vec<String>,
        /// Description line that would be added.
        description_line: String,
    },
    /// Read the marker back.
    VerifyMarker,
    /// Start the guest.
    Start,
    /// Prove the launch (running, answers an exec).
    ProveLaunch,
    /// Wait for the guest's boot to end.
    WaitBoot,
    /// Run the bootstrap profile.
    Bootstrap,
    /// Run the osquery checks.
    RunChecks,
    /// Put the result in the outbox.
    Report,
    /// Re-check ownership, destroy, confirm by re-reading.
    GatedDestroy,
    /// Keep the guest (`--keep`).
    KeepGuest,
}

/// What the executor must do, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "effect", rename_all = "snake_case")]
pub enum Effect {
    /// Persist this state to the journal (append + fsync) before doing anything after it.
    Journal(Box<State>),
    /// POST the restore (`restore=1`, into `pool`, on `storage`); answer with
    /// [`Event::Submitted`], [`Event::SubmitRefused`] or [`Event::SubmitUnknown`].
    SubmitRestore {
        /// Target vmid.
        vmid: u32,
        /// LXC (`ostemplate`) or QEMU (`archive`).
        guest: GuestKind,
        /// Backup volid.
        volid: String,
        /// Target storage (always passed explicitly).
        storage: String,
        /// Target pool.
        pool: String,
        /// `unique=1`: PVE gives the backup's NICs new MAC addresses (and a VM a new SMBIOS
        /// uuid). True, except for an isolated container: with `unique`, pve-container writes
        /// every NIC stored in the backup over the request's own (`PVE/LXC/Create.pm`
        /// `sanitize_and_merge_config`), so its copy is restored with `unique=0` and every
        /// stored NIC given, each of which PVE gives a new MAC (`parse_lxc_network`).
        unique: bool,
        /// Restore with every NIC isolated (restore-test): no bridge, link down.
        isolate_network: bool,
    },
    /// Follow the task to its end; answer [`Event::TaskEnded`] or [`Event::TaskWaitTimedOut`].
    WaitTask {
        /// The task to follow.
        upid: String,
    },
    /// Ask PVE to stop the task (DELETE on the task); then a [`Effect::WaitTask`] follows.
    StopTask {
        /// The task to stop.
        upid: String,
    },
    /// Read the guest at the vmid (full list + config); answer [`Event::GuestObserved`].
    ProbeGuest {
        /// The vmid to read.
        vmid: u32,
    },
    /// After a restore request whose answer is unknown: search the node's task list for this
    /// token's restore task for `vmid` started since the transaction's intent, and the full
    /// guest list, until a task shows or a settle window passes (a create may still land);
    /// answer [`Event::SubmitProbed`].
    FindOwnTask {
        /// The vmid.
        vmid: u32,
        /// Its type (the task type to look for: `vzrestore` or `qmrestore`).
        guest: GuestKind,
    },
    /// Write the marker with one config PUT: add [`Marker::tags`] to the guest's tags and
    /// [`Marker::description_line`] to its description (see [`Marker::merged_tags`],
    /// [`Marker::merged_description`]); answer [`Event::MarkerWritten`] or
    /// [`Event::MarkerWriteFailed`].
    WriteMarker {
        /// The guest.
        vmid: u32,
        /// Its type.
        guest: GuestKind,
        /// The marker to write.
        marker: Marker,
    },
    /// Read the guest back (full list + config); answer [`Event::GuestObserved`].
    VerifyMarker {
        /// The guest.
        vmid: u32,
        /// Its type.
        guest: GuestKind,
    },
    /// Start the guest and follow the start task; answer [`Event::Started`] or
    /// [`Event::StartFailed`].
    Start {
        /// The guest.
        vmid: u32,
        /// Its type.
        guest: GuestKind,
    },
    /// Check the guest is running and answers an exec; answer [`Event::LaunchProven`],
    /// [`Event::LaunchUnproven`] or [`Event::GuestExecBlocked`].
    ProveLaunch {
        /// The guest.
        vmid: u32,
        /// Its type.
        guest: GuestKind,
    },
    /// Wait until the guest's boot has ended (bounded by the boot timeout); answer
    /// [`Event::BootEnded`] or [`Event::BootUnfinished`].
    WaitBoot {
        /// The guest.
        vmid: u32,
        /// Its type.
        guest: GuestKind,
    },
    /// Push and run the bootstrap profile; answer [`Event::Bootstrapped`] or
    /// [`Event::BootstrapFailed`].
    Bootstrap {
        /// The guest.
        vmid: u32,
        /// Its type.
        guest: GuestKind,
    },
    /// Run the osquery checks; answer [`Event::ChecksPassed`] or [`Event::ChecksFailed`].
    RunChecks {
        /// The guest.
        vmid: u32,
        /// Its type.
        guest: GuestKind,
    },
    /// Put the result in the durable outbox; answer [`Event::ReportQueued`].
    Report,
    /// Re-read config and status of the guest (full list + config) right now, for the marker
    /// re-check that must precede a destroy; answer [`Event::GuestObserved`].
    RecheckOwnership {
        /// The guest.
        vmid: u32,
        /// Its type.
        guest: GuestKind,
    },
    /// Destroy the guest: stop it if it runs, then re-read it (full list + config) and send the
    /// DELETE (only what its config references: no purge, no unreferenced disks) right after
    /// that read, with nothing in between, only while [`State::proves`] holds for it; follow the
    /// destroy task and answer [`Event::DestroyEnded`]. When the re-read no longer proves
    /// ownership, nothing is deleted and the answer is [`Event::GuestObserved`] with that read.
    /// Only ever emitted while armed, right after a re-check that proved ownership.
    Destroy {
        /// The guest.
        vmid: u32,
        /// Its type.
        guest: GuestKind,
    },
    /// Re-read the guest until it is gone or a timeout passes; answer [`Event::GuestObserved`]
    /// with the last read.
    ConfirmDestroyed {
        /// The guest.
        vmid: u32,
        /// Its type.
        guest: GuestKind,
    },
    /// Dry run: print these calls; nothing is performed or written.
    Plan {
        /// The calls, in order.
        steps: Vec<PlanStep>,
    },
}

impl Effect {
    /// The effect's name in logs.
    pub fn name(&self) -> &'static str {
        match self {
            Effect::Journal(_) => "journal",
            Effect::SubmitRestore { .. } => "submit_restore",
            Effect::WaitTask { .. } => "wait_task",
            Effect::StopTask { .. } => "stop_task",
            Effect::ProbeGuest { .. } => "probe_guest",
            Effect::FindOwnTask { .. } => "find_own_task",
            Effect::WriteMarker { .. } => "write_marker",
            Effect::VerifyMarker { .. } => "verify_marker",
            Effect::Start { .. } => "start",
            Effect::ProveLaunch { .. } => "prove_launch",
            Effect::WaitBoot { .. } => "wait_boot",
            Effect::Bootstrap { .. } => "bootstrap",
            Effect::RunChecks { .. } => "run_checks",
            Effect::Report => "report",
            Effect::RecheckOwnership { .. } => "recheck_ownership",
            Effect::Destroy { .. } => "destroy",
            Effect::ConfirmDestroyed { .. } => "confirm_destroyed",
            Effect::Plan { .. } => "plan",
        }
    }
}

/// The fields of the final JSON that come from the transaction (DESIGN section 3); the
/// executor adds `checks`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Outcome {
    /// Transaction id.
    pub txn: Ulid,
    /// What started it.
    pub kind: TxnKind,
    /// The vmid (null for a skipped restore-test).
    pub vmid: Option<u32>,
    /// ok | refused | failed | skipped | needs_human.
    pub outcome: OutcomeKind,
    /// The phase the transaction ended in.
    pub phase: Phase,
    /// The furthest phase of the forward path it reached.
    pub reached: Phase,
    /// Whether destroy was armed (own task OK and marker confirmed) and not withdrawn.
    pub destroy_armed: bool,
    /// Whether the guest is confirmed gone after this transaction's destroy.
    pub destroyed: bool,
    /// The error, with its stable code.
    pub error: Option<Failure>,
}

impl Outcome {
    /// The process exit status for this outcome: 0 ok/skipped, 7 needs_human, otherwise the
    /// status of the error code (3 refused, 4 PVE create failed, 5 guest failed, 6
    /// environment, 7 ownership).
    pub fn exit_status(&self) -> ExitStatus {
        match self.outcome {
            OutcomeKind::Ok | OutcomeKind::Skipped => ExitStatus::Ok,
            OutcomeKind::NeedsHuman => ExitStatus::NeedsHuman,
            OutcomeKind::Refused | OutcomeKind::Failed => match &self.error {
                Some(e) => crate::error::exit_status(e.code),
                None => ExitStatus::NeedsHuman,
            },
        }
    }
}

/// An event the machine does not accept in the current step. The state is unchanged; this is
/// a bug in the caller, and the journal lets the next start settle the transaction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "transaction {txn}: event {event} is not allowed in step {step} (phase {phase}): {detail}; \
     the transaction was left unchanged and the next agent start settles it from the journal"
)]
pub struct Disallowed {
    /// The transaction.
    pub txn: Ulid,
    /// Its phase.
    pub phase: Phase,
    /// Its step.
    pub step: Step,
    /// The rejected event.
    pub event: EventKind,
    /// Why.
    pub detail: String,
}

impl Disallowed {
    /// The stable code: a transaction the executor cannot drive needs a human.
    pub fn code(&self) -> ErrorCode {
        ErrorCode::OwnershipUnproven
    }
}

/// What a transaction is asked to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Transaction id (a ULID; the hub's idempotency key for dispatches).
    pub txn: Ulid,
    /// What started it.
    pub kind: TxnKind,
    /// The vmid the operator or hub supplied (or the restore-test picked from its band); None
    /// only for a restore-test whose band is full.
    pub vmid: Option<u32>,
    /// LXC or QEMU (from the backup).
    pub guest: GuestKind,
    /// Backup volid to restore from.
    pub volid: String,
    /// Target storage.
    pub storage: String,
    /// Target pool.
    pub pool: String,
    /// Restore with the network isolated (restore-test).
    pub isolate_network: bool,
    /// Keep the guest at the end (no destroy on success or failure).
    pub keep: bool,
    /// Print the plan, write nothing.
    pub dry_run: bool,
    /// The bootstrap profile to run (`None`: the agent's `default` profile).
    #[serde(default)]
    pub profile: Option<String>,
    /// The lab bridge an isolated VM copy's NICs go onto, picked among `[restore_test]
    /// lab_bridges` when the transaction began (one VM copy per bridge at a time); `None` for
    /// anything else (and in transactions journaled before it was recorded: the first
    /// configured one then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lab_bridge: Option<String>,
    /// The application group this copy is a member of (`[[restore_test.group]]`): its name,
    /// its lab and the member's place in the start order. `None` for a copy alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<GroupMember>,
}

/// A restore-test copy's place in its application group, journaled with the transaction (the
/// root helper joins a copy only to the lab its transaction names, and a killed run's lab is
/// found and removed from it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupMember {
    /// The group's name.
    pub name: String,
    /// The group run's lab: its network namespace is held by `felhom-lab@<lab>.service` where systemd runs, named `felhom-g-<lab>` elsewhere ([`crate::guest::group_lab`]).
    pub lab: Ulid,
    /// The member's place in the start order (0: first).
    pub index: u32,
    /// The vmids of the group's VM copies that share the group's lab bridge (this one's
    /// among them): the only taps allowed on it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bridge_peers: Vec<u32>,
    /// The group's members (their guests) in start order, as the run began; empty in
    /// transactions journaled before they were recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guests: Vec<u32>,
    /// What the group's stored addresses cannot do in its lab (no static address, no shared
    /// subnet), said in each member's `isolation` (at most 8, each clipped).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// A container member of a group that also holds VMs: the group's lab bridge (one of
    /// `[restore_test] lab_bridges`, held by the group), which root links to the containers'
    /// lab with one veth pair ([`crate::guest::group_lab::link`]). `None` otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_bridge: Option<String>,
}

/// The state of one transaction; what the journal stores after every transition.
///
/// Fields are private: only [`step`], [`recover`] and the constructors change them, so
/// `destroy_armed` cannot be set without the proof.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    request: Request,
    marker: Marker,
    phase: Phase,
    reached: Phase,
    step: Step,
    upid: Option<String>,
    task_ok: bool,
    marker_confirmed: bool,
    destroy_armed: bool,
    destroyed: bool,
    recovered: bool,
    failure: Option<Failure>,
    outcome: Option<OutcomeKind>,
    /// The birth identity read with the confirmed marker; required again before any destroy.
    #[serde(default)]
    identity: Option<BirthIdentity>,
    /// Why destroy was withdrawn (the guest was seen gone, or without its proof).
    #[serde(default)]
    disarmed: Option<String>,
    /// How a `needs_human` outcome was closed after it was handled outside the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    resolution: Option<Resolution>,
}

impl State {
    /// The same state with its failure message cut to a few hundred bytes: what the journal
    /// stores when the whole record would be over its cap, so a cap never stops a cleanup.
    pub fn reduced(&self) -> State {
        let mut reduced = self.clone();
        if let Some(f) = &mut reduced.failure {
            f.message = crate::error::outside_text(&f.message);
        }
        reduced
    }

    /// A new transaction, waiting for its vmid verdict.
    pub fn new(request: Request) -> State {
        State {
            marker: Marker::new(request.txn),
            request,
            phase: Phase::Planned,
            reached: Phase::Planned,
            step: Step::Validate,
            upid: None,
            task_ok: false,
            marker_confirmed: false,
            destroy_armed: false,
            destroyed: false,
            recovered: false,
            failure: None,
            outcome: None,
            identity: None,
            disarmed: None,
            resolution: None,
        }
    }

    /// A gated destroy (`destroy -vmid N`) of the guest that `origin` created.
    ///
    /// `origin` is the journal's last transaction on `vmid` that recorded a UPID or found the
    /// vmid free (see [`crate::provision::Journal::last_owner_record`]). Unless it is settled,
    /// armed (own task OK, marker confirmed, a non-empty birth identity recorded), not disarmed
    /// and not destroyed, the destroy is refused with `ownership_unproven`: nothing is sent to
    /// PVE and the refusal is journaled. Otherwise the new transaction inherits the proof (the
    /// origin's marker and birth identity) and starts with a fresh ownership re-check.
    pub fn for_destroy(
        txn: Ulid,
        vmid: u32,
        guest: GuestKind,
        origin: Option<&State>,
    ) -> (State, Vec<Effect>) {
        let request = Request {
            txn,
            kind: TxnKind::Destroy,
            vmid: Some(vmid),
            guest: origin.map_or(guest, |o| o.request.guest),
            volid: origin.map(|o| o.request.volid.clone()).unwrap_or_default(),
            storage: origin
                .map(|o| o.request.storage.clone())
                .unwrap_or_default(),
            pool: origin.map(|o| o.request.pool.clone()).unwrap_or_default(),
            isolate_network: false,
            keep: false,
            dry_run: false,
            profile: None,
            lab_bridge: None,
            group: None,
        };
        let mut s = State::new(request);
        let refusal = match origin {
            None => Some(format!(
                "the journal has no transaction that created vmid {vmid}, so this agent cannot \
                 prove the guest is its own; it was not touched (remove it by hand if it must go)"
            )),
            Some(o) if o.request.vmid != Some(vmid) => Some(format!(
                "journal transaction {} concerns vmid {:?}, not {vmid}; nothing was touched",
                o.request.txn, o.request.vmid
            )),
            Some(o) if !o.is_terminal() => Some(format!(
                "transaction {} on vmid {vmid} is still open; let the agent settle it first \
                 (any writing command does), then retry",
                o.request.txn
            )),
            Some(o) if o.destroyed => Some(format!(
                "transaction {} already destroyed its guest at vmid {vmid}; a guest there now is \
                 not this agent's and was not touched",
                o.request.txn
            )),
            Some(o) if o.upid.is_none() && o.request.kind != TxnKind::Destroy => Some(format!(
                "transaction {} found vmid {vmid} free in the full guest list, later than any \
                 guest this agent created there, so no claim on it is left; the guest there now \
                 was not touched (remove it by hand if it must go)",
                o.request.txn
            )),
            Some(o) if o.disarmed.is_some() => Some(format!(
                "transaction {} no longer holds proof of vmid {vmid}: {}; the guest there now was \
                 not touched (check it with `{}` and remove it by hand if it must go)",
                o.request.txn,
                o.disarmed.as_deref().unwrap_or_default(),
                o.cmd_config(vmid)
            )),
            Some(o)
                if !(o.destroy_armed && o.task_ok && o.marker_confirmed && o.upid.is_some()) =>
            {
                Some(format!(
                    "transaction {} never proved it created vmid {vmid} (its own task OK and its \
                     marker read back), so the guest there was not touched",
                    o.request.txn
                ))
            }
            Some(o) if o.identity.is_none() => Some(format!(
                "transaction {} recorded no birth identity (MACs, vmgenid) for vmid {vmid}, so a \
                 copy of its guest cannot be told from the guest itself; nothing was touched. \
                 Verify the guest with `{}` and remove it by hand with `{}` if it must go",
                o.request.txn,
                o.cmd_config(vmid),
                o.cmd_destroy(vmid)
            )),
            Some(o) if o.identity.as_ref().is_some_and(BirthIdentity::is_empty) => Some(format!(
                "the guest transaction {} created at vmid {vmid} has an empty birth identity (no \
                 NIC, no vmgenid, no smbios1 uuid), so a copy of it carrying its marker cannot be \
                 told from it; nothing was touched. Verify the guest with `{}` and remove it by \
                 hand with `{}` if it must go",
                o.request.txn,
                o.cmd_config(vmid),
                o.cmd_destroy(vmid)
            )),
            Some(_) => None,
        };
        if let Some(message) = refusal {
            s.phase = Phase::Failed;
            s.failure = Some(Failure::new(ErrorCode::OwnershipUnproven, message));
            s.finish(OutcomeKind::Refused);
            // Journaled like any refusal, so `journal` shows it; nothing is sent to PVE.
            let effects = vec![s.journal()];
            return (s, effects);
        }
        if let Some(o) = origin {
            s.marker = o.marker;
            s.upid.clone_from(&o.upid);
            s.task_ok = o.task_ok;
            s.marker_confirmed = o.marker_confirmed;
            s.destroy_armed = o.destroy_armed;
            s.identity.clone_from(&o.identity);
        }
        s.phase = Phase::Validated;
        s.reached = Phase::Validated;
        s.step = Step::Recheck;
        let effects = vec![s.journal(), s.recheck_effect(vmid)];
        (s, effects)
    }

    /// What the transaction was asked to do.
    pub fn request(&self) -> &Request {
        &self.request
    }
    /// Transaction id.
    pub fn txn(&self) -> Ulid {
        self.request.txn
    }
    /// What started it.
    pub fn kind(&self) -> TxnKind {
        self.request.kind
    }
    /// The vmid, once known.
    pub fn vmid(&self) -> Option<u32> {
        self.request.vmid
    }
    /// The marker that proves ownership (this transaction's, or for a destroy the creating
    /// transaction's).
    pub fn marker(&self) -> Marker {
        self.marker
    }
    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }
    /// The furthest phase of the forward path reached.
    pub fn reached(&self) -> Phase {
        self.reached
    }
    /// What the machine waits for.
    pub fn step(&self) -> Step {
        self.step
    }
    /// The UPID of the restore task this transaction submitted, once PVE answered.
    pub fn upid(&self) -> Option<&str> {
        self.upid.as_deref()
    }
    /// Whether that task was seen ending OK.
    pub fn task_ok(&self) -> bool {
        self.task_ok
    }
    /// Whether the marker was read back on the guest.
    pub fn marker_confirmed(&self) -> bool {
        self.marker_confirmed
    }
    /// Whether destroy is armed.
    pub fn destroy_armed(&self) -> bool {
        self.destroy_armed
    }
    /// Whether the guest is confirmed gone after this transaction's destroy.
    pub fn destroyed(&self) -> bool {
        self.destroyed
    }
    /// The birth identity recorded with the confirmed marker.
    pub fn identity(&self) -> Option<&BirthIdentity> {
        self.identity.as_ref()
    }
    /// Why destroy was withdrawn, if it was.
    pub fn disarmed(&self) -> Option<&str> {
        self.disarmed.as_deref()
    }

    /// This (settled) state with destroy withdrawn for `reason`: what the journal records for a
    /// transaction whose guest a later transaction saw gone or without its proof.
    pub fn disarmed_by(&self, reason: &str) -> State {
        let mut s = self.clone();
        s.disarm(reason.to_string());
        s
    }

    /// This (settled) state of a kept guest that `destroy` transaction `by` destroyed: what the
    /// journal records for it, so its row says destroyed and a journal refresh no longer looks
    /// for the guest.
    pub fn destroyed_by(&self, by: Ulid) -> State {
        let mut s = self.clone();
        s.destroyed = true;
        if s.disarmed.is_none() {
            s.disarmed = Some(format!("its guest was destroyed by transaction {by}"));
        }
        s
    }

    /// Whether `view` is this transaction's guest, destroyable now: present, unlocked, carrying
    /// the marker and the recorded birth identity, while armed (for a `destroy -vmid` of an
    /// earlier transaction's guest, the identity must not be empty). The executor asks this
    /// again right before the DELETE.
    pub fn proves(&self, view: &GuestView) -> bool {
        let identity_ok = match &self.identity {
            None => false,
            Some(id) => self.request.kind != TxnKind::Destroy || !id.is_empty(),
        };
        self.destroy_armed
            && self.disarmed.is_none()
            && identity_ok
            && matches!(self.seen(view), Seen::Ours { lock: None })
    }

    /// Whether `view` shows this transaction's marker and, once recorded, its birth identity.
    pub fn shows_proof(&self, view: &GuestView) -> bool {
        matches!(self.seen(view), Seen::Ours { .. })
    }

    /// Whether `view` shows this transaction's guest locked by a backup (`lock: backup`, a
    /// vzdump under way): a lock that goes by itself, so it is waited for before the destroy.
    pub fn held_by_backup(&self, view: &GuestView) -> bool {
        matches!(
            self.seen(view),
            Seen::Ours {
                lock: Some("backup")
            }
        )
    }

    /// Whether this state was taken up after a stop or crash, by [`recover`] or [`resume`].
    pub fn recovered(&self) -> bool {
        self.recovered
    }
    /// The failure, once one happened.
    pub fn failure(&self) -> Option<&Failure> {
        self.failure.as_ref()
    }
    /// The outcome, once settled.
    pub fn outcome_kind(&self) -> Option<OutcomeKind> {
        self.outcome
    }
    /// Whether the transaction is settled.
    pub fn is_terminal(&self) -> bool {
        self.step == Step::Done
    }

    /// The final outcome, once settled.
    pub fn outcome(&self) -> Option<Outcome> {
        let outcome = self.outcome?;
        Some(Outcome {
            txn: self.request.txn,
            kind: self.request.kind,
            vmid: self.request.vmid,
            outcome,
            phase: self.phase,
            reached: self.reached,
            destroy_armed: self.destroy_armed,
            destroyed: self.destroyed,
            error: self.failure.clone(),
        })
    }

    // ----- helpers used by the transitions -----

    fn journal(&self) -> Effect {
        Effect::Journal(Box::new(self.clone()))
    }

    /// The part of `id` that PVE generated for this transaction's guest: an isolated VM copy's
    /// NICs carry no fresh MAC (with `[restore_test] lab_bridge` they carry the stored ones,
    /// which every restore of the backup repeats; without, the marker write removed them), so
    /// only its `vmgenid` and `smbios1` uuid count.
    fn birth_part(&self, id: &BirthIdentity) -> BirthIdentity {
        if self.request.isolate_network && self.guest() == GuestKind::Qemu {
            BirthIdentity {
                nics: Default::default(),
                ..id.clone()
            }
        } else {
            id.clone()
        }
    }

    /// `view` judged against the marker and, once recorded, the birth identity. A VM whose
    /// recorded identity holds no NIC (an isolated copy's, [`State::birth_part`], also when a
    /// later `destroy -vmid` judges it) is judged without the NICs seen now.
    fn seen<'a>(&self, view: &'a GuestView) -> Seen<'a> {
        let now = view.identity().map(|id| match &self.identity {
            Some(recorded) if recorded.nics.is_empty() && self.guest() == GuestKind::Qemu => {
                BirthIdentity {
                    nics: Default::default(),
                    ..id.clone()
                }
            }
            _ => id.clone(),
        });
        match (view.judge(&self.marker), &self.identity, now.as_ref()) {
            (Seen::Ours { lock }, Some(recorded), Some(now)) => match recorded.differences(now) {
                None => Seen::Ours { lock },
                Some(differs) => Seen::Copy { differs },
            },
            (seen, _, _) => seen,
        }
    }

    /// Withdraw destroy for good, saying why (the first reason stays).
    fn disarm(&mut self, reason: String) {
        self.destroy_armed = false;
        if self.disarmed.is_none() {
            self.disarmed = Some(clip_message(reason));
        }
    }

    fn guest(&self) -> GuestKind {
        self.request.guest
    }

    /// Whether the restore asks for `unique=1` (see [`Effect::SubmitRestore`]).
    fn unique_restore(&self) -> bool {
        !(self.request.isolate_network && self.request.guest == GuestKind::Lxc)
    }

    fn recheck_effect(&self, vmid: u32) -> Effect {
        Effect::RecheckOwnership {
            vmid,
            guest: self.guest(),
        }
    }

    fn upid_text(&self) -> &str {
        self.upid.as_deref().unwrap_or("(none recorded)")
    }

    fn advance(&mut self, phase: Phase, step: Step) {
        self.phase = phase;
        self.reached = phase;
        self.step = step;
    }

    fn finish(&mut self, outcome: OutcomeKind) {
        self.step = Step::Done;
        self.outcome = Some(outcome);
        self.disarm_if_kept_unprovable();
    }

    /// A guest kept (`--keep`) with an empty birth identity (an isolated container has every
    /// NIC removed before its start; a guest without NIC, vmgenid and smbios1 uuid): a later
    /// `destroy -vmid N` must refuse it (a copy carrying its marker cannot be told from it), so
    /// its claim is withdrawn as it settles, and the result, the journal and `journal
    /// refresh` never call it destroyable. Its own run's cleanup is not affected: a kept guest
    /// has none.
    fn disarm_if_kept_unprovable(&mut self) {
        let Some(vmid) = self.request.vmid else {
            return;
        };
        if self.request.keep
            && self.request.kind != TxnKind::Destroy
            && self.destroy_armed
            && !self.destroyed
            && self.identity.as_ref().is_some_and(BirthIdentity::is_empty)
        {
            let why = format!(
                "kept with an empty birth identity (no NIC, no vmgenid, no smbios1 uuid{}), so \
                 the agent cannot tell guest {vmid} from a copy of it later and will not destroy \
                 it; check it with `{}` and remove it by hand with `{}` when done",
                if self.request.isolate_network && self.guest() == GuestKind::Lxc {
                    ": an isolated container has every NIC removed before its start"
                } else {
                    ""
                },
                self.cmd_config(vmid),
                self.cmd_destroy(vmid)
            );
            self.disarm(why);
        }
    }

    /// The journal record of a transaction settled before any write; none for a dry run.
    fn journal_unless_dry_run(&self) -> Vec<Effect> {
        if self.request.dry_run {
            Vec::new()
        } else {
            vec![self.journal()]
        }
    }

    /// Record a failure; the first one stays the headline, later ones are appended.
    fn note_failure(&mut self, failure: Failure) {
        self.phase = Phase::Failed;
        match &mut self.failure {
            None => self.failure = Some(Failure::new(failure.code, clip_message(failure.message))),
            Some(first) => {
                first.message =
                    clip_message(format!("{}; then: {}", first.message, failure.message));
            }
        }
    }

    /// Fail: a gated cleanup when armed (unless kept), else settle as failed.
    fn fail(&mut self, failure: Failure, vmid: u32) -> Vec<Effect> {
        self.note_failure(failure);
        self.cleanup_or_settle(vmid)
    }

    /// After a failure: re-check and destroy when armed and not kept, else settle as failed.
    fn cleanup_or_settle(&mut self, vmid: u32) -> Vec<Effect> {
        self.phase = Phase::Failed;
        if self.destroy_armed && !self.request.keep {
            self.step = Step::Recheck;
            vec![self.journal(), self.recheck_effect(vmid)]
        } else {
            self.finish(OutcomeKind::Failed);
            vec![self.journal()]
        }
    }

    /// Settle as needing a human; any earlier failure is kept in the message.
    fn needs_human(&mut self, code: ErrorCode, message: String) -> Vec<Effect> {
        let message = match &self.failure {
            Some(earlier) => format!("{message} (before that: {})", earlier.message),
            None => message,
        };
        self.failure = Some(Failure::new(code, clip_message(message)));
        self.phase = Phase::NeedsHuman;
        self.finish(OutcomeKind::NeedsHuman);
        vec![self.journal()]
    }

    /// Settle a cleanup that found nothing (left) to destroy.
    fn settle_after_cleanup(&mut self) -> Vec<Effect> {
        let outcome = if self.failure.is_some() {
            OutcomeKind::Failed
        } else {
            OutcomeKind::Ok
        };
        self.finish(outcome);
        vec![self.journal()]
    }

    fn confirmed_destroyed(&mut self) -> Vec<Effect> {
        self.destroyed = true;
        self.phase = Phase::Destroyed;
        self.settle_after_cleanup()
    }

    fn cmd_config(&self, vmid: u32) -> String {
        match self.guest() {
            GuestKind::Lxc => format!("pct config {vmid}"),
            GuestKind::Qemu => format!("qm config {vmid}"),
        }
    }

    fn cmd_destroy(&self, vmid: u32) -> String {
        match self.guest() {
            GuestKind::Lxc => format!("pct destroy {vmid} --destroy-unreferenced-disks 0"),
            GuestKind::Qemu => format!("qm destroy {vmid} --destroy-unreferenced-disks 0"),
        }
    }

    fn txn_tag(&self) -> String {
        self.marker.txn_tag()
    }

    /// The failure recorded when a crashed run is settled, coded by how far it had got.
    fn interrupted(&self, vmid: u32, detail: &str) -> Failure {
        let code = match self.reached {
            Phase::Created | Phase::Started => ErrorCode::LaunchUnproven,
            Phase::Launched => ErrorCode::BootUnfinished,
            Phase::Booted => ErrorCode::BootstrapFailed,
            Phase::Bootstrapped => ErrorCode::CheckFailed,
            _ => ErrorCode::TaskFailed,
        };
        Failure::new(
            code,
            format!(
                "the agent stopped during phase {} of transaction {} on vmid {vmid}; {detail}",
                self.reached, self.request.txn
            ),
        )
    }

    fn disallowed(&self, event: EventKind, detail: impl Into<String>) -> Disallowed {
        Disallowed {
            txn: self.request.txn,
            phase: self.phase,
            step: self.step,
            event,
            detail: detail.into(),
        }
    }

    fn require_vmid(&self, event: EventKind) -> Result<u32, Disallowed> {
        self.request
            .vmid
            .ok_or_else(|| self.disallowed(event, "the transaction has no vmid"))
    }

    fn is_our_upid(&self, upid: &str) -> bool {
        self.upid.as_deref() == Some(upid)
    }

    // ----- transitions -----

    fn on_vmid_accepted(&mut self, vmid: u32) -> Vec<Effect> {
        self.advance(Phase::Validated, Step::Submit);
        let guest = self.guest();
        if self.request.dry_run {
            self.finish(OutcomeKind::Ok);
            let mut plan = vec![
                PlanStep::Restore {
                    vmid,
                    guest,
                    volid: self.request.volid.clone(),
                    storage: self.request.storage.clone(),
                    pool: self.request.pool.clone(),
                    unique: self.unique_restore(),
                    isolate_network: self.request.isolate_network,
                },
                PlanStep::WaitTask,
                PlanStep::WriteMarker {
                    tags: self.marker.tags(),
                    description_line: self.marker.description_line(),
                },
                PlanStep::VerifyMarker,
                PlanStep::Start,
                PlanStep::ProveLaunch,
                PlanStep::WaitBoot,
                PlanStep::Bootstrap,
                PlanStep::RunChecks,
                PlanStep::Report,
            ];
            plan.push(if self.request.keep {
                PlanStep::KeepGuest
            } else {
                PlanStep::GatedDestroy
            });
            return vec![Effect::Plan { steps: plan }];
        }
        vec![
            self.journal(),
            Effect::SubmitRestore {
                vmid,
                guest,
                volid: self.request.volid.clone(),
                storage: self.request.storage.clone(),
                pool: self.request.pool.clone(),
                unique: self.unique_restore(),
                isolate_network: self.request.isolate_network,
            },
        ]
    }

    fn on_task_ok(&mut self, vmid: u32) -> Vec<Effect> {
        self.task_ok = true;
        self.step = Step::WriteMarker;
        vec![
            self.journal(),
            Effect::WriteMarker {
                vmid,
                guest: self.guest(),
                marker: self.marker,
            },
        ]
    }

    fn on_task_error(&mut self, vmid: u32, message: &str) -> Vec<Effect> {
        let failure = Failure::new(
            ErrorCode::TaskFailed,
            format!(
                "restore task {} for vmid {vmid} failed: {message}",
                self.upid_text()
            ),
        );
        // Look before settling, for both kinds: PVE leaves a failed VM restore's config behind
        // (facts §5.2), and a container restore that fails after its create (in the pool join,
        // which runs after the restore, facts §4.3) leaves the container outside the pool.
        self.note_failure(failure);
        self.step = Step::ProbeLeftover;
        vec![self.journal(), Effect::ProbeGuest { vmid }]
    }

    fn on_task_timeout(&mut self, vmid: u32) -> Vec<Effect> {
        let upid = self.upid_text().to_string();
        if self.step == Step::StopTask {
            return self.needs_human(
                ErrorCode::TaskTimeout,
                format!(
                    "restore task {upid} for vmid {vmid} did not end even after it was asked to \
                     stop; the guest was not touched. Check the task with `pvenode task status \
                     {upid}`, and once it has ended inspect vmid {vmid} with `{}`",
                    self.cmd_config(vmid)
                ),
            );
        }
        self.note_failure(Failure::new(
            ErrorCode::TaskTimeout,
            format!(
                "restore task {upid} for vmid {vmid} did not end in time; it was asked to stop"
            ),
        ));
        self.step = Step::StopTask;
        vec![
            self.journal(),
            Effect::StopTask { upid: upid.clone() },
            Effect::WaitTask { upid },
        ]
    }

    fn leftover_needs_human(&mut self, vmid: u32) -> Vec<Effect> {
        if self.task_ok {
            let msg = format!(
                "restore task {} of transaction {} ended OK, but {} {vmid} is not in pool {} \
                 (taken out of it, or never joined), where the agent's token can neither mark \
                 nor remove it, so nothing proves it is this transaction's and it was not \
                 touched; inspect it with `{}`, then put it back with `pvesh set /pools/{} \
                 --vms {vmid}` or remove it as root with `{}` if it is this restore's",
                self.upid_text(),
                self.request.txn,
                self.guest().pve_word(),
                self.request.pool,
                self.cmd_config(vmid),
                self.request.pool,
                self.cmd_destroy(vmid)
            );
            return self.needs_human(ErrorCode::GuestOutsidePool, msg);
        }
        let msg = format!(
            "the failed restore task {} of transaction {} left {} {vmid} behind (outside the \
             pool, where the agent's token cannot remove it, and without the marker, so nothing \
             proves it is this transaction's); inspect it with `{}` and remove it as root with \
             `{}` if it is this restore's leftover",
            self.upid_text(),
            self.request.txn,
            self.guest().pve_word(),
            self.cmd_config(vmid),
            self.cmd_destroy(vmid)
        );
        let code = self
            .failure
            .as_ref()
            .map_or(ErrorCode::TaskFailed, |f| f.code);
        self.needs_human(code, msg)
    }

    fn on_marker_observed(&mut self, vmid: u32, view: &GuestView) -> Vec<Effect> {
        match self.seen(view) {
            Seen::Ours { .. } => self.arm(vmid, view),
            Seen::Copy { differs } => {
                let msg = format!(
                    "guest {vmid} carries the marker of transaction {} but not the identity PVE \
                     gave it at its restore ({differs}), so its ownership is unproven and it was \
                     not touched; inspect it with `{}`",
                    self.request.txn,
                    self.cmd_config(vmid)
                );
                self.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
            Seen::Absent => self.fail(
                Failure::new(
                    ErrorCode::TaskFailed,
                    format!(
                        "guest {vmid} disappeared after restore task {} ended OK; nothing is left \
                         to clean up",
                        self.upid_text()
                    ),
                ),
                vmid,
            ),
            Seen::NotOurs { tags } => {
                let msg = format!(
                    "guest {vmid} does not carry the marker of transaction {} after it was \
                     written (tags now: '{tags}'), so its ownership is unproven and it was not \
                     touched; inspect it with `{}` and remove it by hand if it is this \
                     transaction's restore",
                    self.request.txn,
                    self.cmd_config(vmid)
                );
                self.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
            Seen::Unreadable { reason } => {
                let msg = format!(
                    "guest {vmid} could not be read back to confirm the marker of transaction \
                     {} ({reason}), so its ownership is unproven and it was not touched; inspect \
                     it with `{}`",
                    self.request.txn,
                    self.cmd_config(vmid)
                );
                self.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
        }
    }

    /// The marker was read back: record the birth identity seen with it, arm destroy (our task
    /// OK + marker), then go on or clean up.
    fn arm(&mut self, vmid: u32, view: &GuestView) -> Vec<Effect> {
        self.marker_confirmed = true;
        if self.identity.is_none() {
            self.identity = view.identity().map(|id| self.birth_part(id));
        }
        self.destroy_armed = self.task_ok && self.upid.is_some() && self.identity.is_some();
        if !self.destroy_armed {
            let msg = format!(
                "guest {vmid} carries the marker of transaction {} but the transaction holds no \
                 OK result of its own restore task, so destroy stays unarmed; inspect it with `{}`",
                self.request.txn,
                self.cmd_config(vmid)
            );
            return self.needs_human(ErrorCode::OwnershipUnproven, msg);
        }
        if self.failure.is_some() {
            self.reached = Phase::Created;
            return self.cleanup_or_settle(vmid);
        }
        self.advance(Phase::Created, Step::Start);
        vec![
            self.journal(),
            Effect::Start {
                vmid,
                guest: self.guest(),
            },
        ]
    }

    fn on_recheck_observed(&mut self, vmid: u32, view: &GuestView) -> Vec<Effect> {
        let txn_tag = self.txn_tag();
        if self.proves(view) {
            self.step = Step::Destroy;
            return vec![
                self.journal(),
                Effect::Destroy {
                    vmid,
                    guest: self.guest(),
                },
            ];
        }
        match self.seen(view) {
            Seen::Ours { lock: None } if self.destroy_armed && self.disarmed.is_none() => {
                let msg = format!(
                    "guest {vmid} carries marker {txn_tag} but transaction {} holds no usable \
                     birth identity for it ({}), so a copy cannot be told from it and it was not \
                     destroyed; verify it with `{}` and remove it by hand with `{}` if it must go",
                    self.request.txn,
                    self.identity
                        .as_ref()
                        .map_or_else(|| "none recorded".to_string(), ToString::to_string),
                    self.cmd_config(vmid),
                    self.cmd_destroy(vmid)
                );
                self.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
            Seen::Ours { lock: None } => {
                let msg = format!(
                    "guest {vmid} carries marker {txn_tag} but destroy was never armed for it, so \
                     it was not destroyed; inspect it with `{}`",
                    self.cmd_config(vmid)
                );
                self.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
            Seen::Ours { lock: Some(lock) } => {
                let msg = format!(
                    "guest {vmid} is this agent's (marker {txn_tag}) but is locked ({lock}), so \
                     it was not destroyed; once the lock is gone remove it with `{}`",
                    self.cmd_destroy(vmid)
                );
                self.needs_human(ErrorCode::GuestLocked, msg)
            }
            Seen::Absent => {
                self.disarm(format!(
                    "guest {vmid} was gone at the re-check before the destroy (transaction {})",
                    self.request.txn
                ));
                if self.request.kind == TxnKind::Destroy {
                    // A destroy of a guest that is not there any more is refused: whatever
                    // appears at the vmid later is not this agent's.
                    self.phase = Phase::Failed;
                    self.failure = Some(Failure::new(
                        ErrorCode::OwnershipUnproven,
                        format!(
                            "guest {vmid} is gone: it was removed outside the agent, so the claim \
                             of transaction {} on it is withdrawn and nothing was destroyed; any \
                             guest at vmid {vmid} later is not this agent's",
                            self.marker.txn()
                        ),
                    ));
                    self.finish(OutcomeKind::Refused);
                    vec![self.journal()]
                } else {
                    self.settle_after_cleanup()
                }
            }
            Seen::NotOurs { tags } => {
                self.disarm(format!(
                    "guest {vmid} no longer carried marker {txn_tag} at the re-check before the \
                     destroy"
                ));
                let msg = format!(
                    "ownership lost: guest {vmid} no longer carries marker {txn_tag} (tags now: \
                     '{tags}'); PVE may have reused the vmid, so nothing was destroyed; check it \
                     with `{}`",
                    self.cmd_config(vmid)
                );
                self.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
            Seen::Copy { differs } => {
                self.disarm(format!(
                    "guest {vmid} carried marker {txn_tag} but not the identity PVE gave it at its \
                     restore ({differs}): a copy (a backup restored, a clone or a hand edit)"
                ));
                let msg = format!(
                    "ownership lost: guest {vmid} carries marker {txn_tag} but not the identity \
                     PVE gave this transaction's guest at its restore ({differs}); it is a copy \
                     (a backup restored, a clone or a hand edit), so nothing was destroyed; check \
                     it with `{}`",
                    self.cmd_config(vmid)
                );
                self.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
            Seen::Unreadable { reason } => {
                self.disarm(format!(
                    "guest {vmid} could not be read at the re-check before the destroy ({reason})"
                ));
                let msg = format!(
                    "guest {vmid} could not be re-read before the destroy ({reason}), so its \
                     ownership is unproven and nothing was destroyed; check it with `{}`",
                    self.cmd_config(vmid)
                );
                self.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
        }
    }

    fn on_destroy_ended(&mut self, vmid: u32, exit: &TaskExit) -> Vec<Effect> {
        match exit {
            TaskExit::Ok => {
                self.step = Step::ConfirmDestroyed;
                vec![
                    self.journal(),
                    Effect::ConfirmDestroyed {
                        vmid,
                        guest: self.guest(),
                    },
                ]
            }
            TaskExit::Error { message } => {
                let msg = format!(
                    "the destroy of guest {vmid} (marker {}) failed: {message}; the guest is still \
                     there, remove it with `{}`",
                    self.txn_tag(),
                    self.cmd_destroy(vmid)
                );
                self.needs_human(ErrorCode::TaskFailed, msg)
            }
        }
    }

    fn on_destroy_confirm_observed(&mut self, vmid: u32, view: &GuestView) -> Vec<Effect> {
        match self.seen(view) {
            // Gone, or the vmid already holds a different guest: ours is gone either way.
            Seen::Absent | Seen::NotOurs { .. } | Seen::Copy { .. } => self.confirmed_destroyed(),
            Seen::Ours { .. } => {
                let msg = format!(
                    "guest {vmid} (marker {}) is still there after its destroy task ended OK; \
                     check it with `{}` and remove it with `{}`",
                    self.txn_tag(),
                    self.cmd_config(vmid),
                    self.cmd_destroy(vmid)
                );
                self.needs_human(ErrorCode::TaskFailed, msg)
            }
            Seen::Unreadable { reason } => {
                let msg = format!(
                    "guest {vmid} could not be re-read after its destroy ({reason}), so the \
                     destroy is unconfirmed; check it with `{}`",
                    self.cmd_config(vmid)
                );
                self.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
        }
    }

    /// Search the task list for this transaction's restore task (answer unknown).
    fn find_own_task(&mut self, vmid: u32) -> Vec<Effect> {
        self.step = Step::ProbeSubmit;
        vec![
            self.journal(),
            Effect::FindOwnTask {
                vmid,
                guest: self.guest(),
            },
        ]
    }

    fn cmd_tasks(&self, vmid: u32) -> String {
        format!("pvenode task list --vmid {vmid} --source all")
    }

    fn on_submit_probed(&mut self, vmid: u32, probe: SubmitProbe) -> Vec<Effect> {
        match probe {
            // Our own task: follow it as if PVE had answered with its UPID. The transaction
            // stays failed, so a guest it proves to be its own (task OK, marker read back) is
            // cleaned up through the gate.
            SubmitProbe::OwnTask { upid } => {
                self.upid = Some(upid.clone());
                self.reached = self.reached.max(Phase::Submitted);
                self.step = Step::Task;
                vec![self.journal(), Effect::WaitTask { upid }]
            }
            SubmitProbe::Nothing { waited_secs } => {
                self.note_failure(Failure::new(
                    ErrorCode::PveUnreachable,
                    format!(
                        "for {waited_secs}s after it, the node's task list showed no restore task \
                         of this agent for vmid {vmid} and the full guest list no guest at vmid \
                         {vmid}: nothing was created"
                    ),
                ));
                self.cleanup_or_settle(vmid)
            }
            SubmitProbe::Unproven {
                guest: GuestView::Absent,
                detail,
            } => {
                let msg = format!(
                    "the answer to transaction {}'s restore request for vmid {vmid} is unknown and \
                     {detail}; no guest is at vmid {vmid} now, but the create may still land. \
                     Check the node's tasks with `{}` and the vmid with `{}`; if this \
                     transaction's restore created a guest there, remove it as root with `{}`",
                    self.request.txn,
                    self.cmd_tasks(vmid),
                    self.cmd_config(vmid),
                    self.cmd_destroy(vmid)
                );
                let code = self
                    .failure
                    .as_ref()
                    .map_or(ErrorCode::PveUnreachable, |f| f.code);
                self.needs_human(code, msg)
            }
            SubmitProbe::Unproven { guest, detail } => {
                let seen = match &guest {
                    GuestView::Unreadable { reason } => {
                        format!("it cannot be read with the agent's token ({reason})")
                    }
                    _ => "it does not carry this transaction's marker".to_string(),
                };
                let msg = format!(
                    "vmid {vmid} holds a guest after transaction {}'s restore request got no \
                     certain answer, but nothing proves this transaction created it ({detail}; \
                     {seen}), so it was not touched. Inspect it with `{}` and the node's tasks \
                     with `{}`; if it is this transaction's restore, remove it as root with `{}`",
                    self.request.txn,
                    self.cmd_config(vmid),
                    self.cmd_tasks(vmid),
                    self.cmd_destroy(vmid)
                );
                self.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
        }
    }
}

/// One transition: the state after `event` and the effects to perform, in order.
///
/// Returns [`Disallowed`] (state unchanged) for an event the current [`Step`] does not accept,
/// including a task event naming a UPID other than the one this transaction recorded.
pub fn step(state: &State, event: Event) -> Result<(State, Vec<Effect>), Disallowed> {
    let kind = event.kind();
    let mut s = state.clone();
    let effects = match (state.step, event) {
        (Step::Validate, Event::VmidAccepted) => {
            let vmid = s.require_vmid(kind)?;
            s.on_vmid_accepted(vmid)
        }
        // A refusal or a skip is journaled (never for a dry run), so a re-dispatch of the same
        // transaction answers with it instead of running again once the vmid looks free.
        (Step::Validate, Event::VmidRefused(failure)) => {
            s.phase = Phase::Failed;
            s.failure = Some(Failure::new(failure.code, clip_message(failure.message)));
            s.finish(OutcomeKind::Refused);
            s.journal_unless_dry_run()
        }
        (Step::Validate, Event::BandFull { message }) => {
            s.phase = Phase::Skipped;
            s.failure = Some(Failure::new(ErrorCode::BandFull, message));
            s.finish(OutcomeKind::Skipped);
            s.journal_unless_dry_run()
        }
        (Step::Submit, Event::Submitted { upid }) => {
            s.require_vmid(kind)?;
            if upid.is_empty() {
                return Err(state.disallowed(kind, "PVE answered with an empty UPID"));
            }
            s.upid = Some(upid.clone());
            s.advance(Phase::Submitted, Step::Task);
            vec![s.journal(), Effect::WaitTask { upid }]
        }
        (Step::Submit, Event::SubmitRefused(failure)) => {
            // A refusal (e.g. "CT 101 already exists on node 'pve1'") has no UPID: nothing is
            // armed and nothing is touched.
            let vmid = s.require_vmid(kind)?;
            s.fail(failure, vmid)
        }
        (Step::Submit, Event::SubmitUnknown(failure)) => {
            // No answer is not a refusal: PVE may have created the guest (pveproxy can answer
            // 5xx while pvedaemon goes on). Look for our task before deciding anything.
            let vmid = s.require_vmid(kind)?;
            s.note_failure(failure);
            s.find_own_task(vmid)
        }
        (Step::ProbeSubmit, Event::SubmitProbed(probe)) => {
            let vmid = s.require_vmid(kind)?;
            if matches!(&probe, SubmitProbe::OwnTask { upid } if upid.is_empty()) {
                return Err(state.disallowed(kind, "the task search returned an empty UPID"));
            }
            s.on_submit_probed(vmid, probe)
        }
        (Step::Task | Step::StopTask, Event::TaskEnded { upid, exit }) => {
            if !state.is_our_upid(&upid) {
                return Err(state.disallowed(
                    kind,
                    format!(
                        "UPID {upid} is not the task this transaction submitted ({})",
                        state.upid_text()
                    ),
                ));
            }
            let vmid = s.require_vmid(kind)?;
            match exit {
                TaskExit::Ok => s.on_task_ok(vmid),
                TaskExit::Error { message } => s.on_task_error(vmid, &message),
            }
        }
        (Step::Task | Step::StopTask, Event::TaskWaitTimedOut { upid }) => {
            if !state.is_our_upid(&upid) {
                return Err(state.disallowed(
                    kind,
                    format!(
                        "UPID {upid} is not the task this transaction submitted ({})",
                        state.upid_text()
                    ),
                ));
            }
            let vmid = s.require_vmid(kind)?;
            s.on_task_timeout(vmid)
        }
        (Step::ProbeLeftover, Event::GuestObserved(view)) => {
            let vmid = s.require_vmid(kind)?;
            match view {
                GuestView::Absent => s.cleanup_or_settle(vmid),
                GuestView::Present { .. } | GuestView::Unreadable { .. } => {
                    s.leftover_needs_human(vmid)
                }
            }
        }
        (Step::WriteMarker, Event::MarkerWritten) => {
            let vmid = s.require_vmid(kind)?;
            s.step = Step::VerifyMarker;
            vec![
                s.journal(),
                Effect::VerifyMarker {
                    vmid,
                    guest: s.guest(),
                },
            ]
        }
        // The restore ended OK but the guest is outside the pool: a failed restore, settled as
        // one (the probe, then nothing left or a leftover for a person), never a destroy.
        (Step::WriteMarker, Event::MarkerWriteFailed(failure))
            if failure.code == ErrorCode::GuestOutsidePool =>
        {
            let vmid = s.require_vmid(kind)?;
            s.note_failure(failure);
            s.step = Step::ProbeLeftover;
            vec![s.journal(), Effect::ProbeGuest { vmid }]
        }
        (Step::WriteMarker, Event::MarkerWriteFailed(failure)) => {
            let vmid = s.require_vmid(kind)?;
            let msg = format!(
                "guest {vmid} was restored by task {} of transaction {} but its marker could not \
                 be written ({}), so destroy is not armed and the guest was kept; inspect it with \
                 `{}` and remove it with `{}` if it must go",
                s.upid_text(),
                s.request.txn,
                failure.message,
                s.cmd_config(vmid),
                s.cmd_destroy(vmid)
            );
            s.needs_human(failure.code, msg)
        }
        (Step::VerifyMarker, Event::GuestObserved(view)) => {
            let vmid = s.require_vmid(kind)?;
            s.on_marker_observed(vmid, &view)
        }
        (Step::Start, Event::Started) => {
            let vmid = s.require_vmid(kind)?;
            s.advance(Phase::Started, Step::ProveLaunch);
            vec![
                s.journal(),
                Effect::ProveLaunch {
                    vmid,
                    guest: s.guest(),
                },
            ]
        }
        (Step::Start, Event::StartFailed { message }) => {
            let vmid = s.require_vmid(kind)?;
            let f = Failure::new(
                ErrorCode::LaunchUnproven,
                format!("guest {vmid} did not start: {message}"),
            );
            s.fail(f, vmid)
        }
        (Step::ProveLaunch, Event::LaunchProven) => {
            let vmid = s.require_vmid(kind)?;
            s.advance(Phase::Launched, Step::WaitBoot);
            vec![
                s.journal(),
                Effect::WaitBoot {
                    vmid,
                    guest: s.guest(),
                },
            ]
        }
        (Step::WaitBoot, Event::BootEnded { .. }) => {
            let vmid = s.require_vmid(kind)?;
            s.advance(Phase::Booted, Step::Bootstrap);
            vec![
                s.journal(),
                Effect::Bootstrap {
                    vmid,
                    guest: s.guest(),
                },
            ]
        }
        (Step::WaitBoot, Event::BootUnfinished { message }) => {
            let vmid = s.require_vmid(kind)?;
            let f = Failure::new(
                ErrorCode::BootUnfinished,
                format!("the boot of guest {vmid} did not end: {message}"),
            );
            s.fail(f, vmid)
        }
        (Step::WaitBoot, Event::GroupLabFailed { message }) => {
            let vmid = s.require_vmid(kind)?;
            s.fail(Failure::new(ErrorCode::GroupLabFailed, message), vmid)
        }
        (Step::ProveLaunch, Event::LaunchUnproven { message }) => {
            let vmid = s.require_vmid(kind)?;
            let f = Failure::new(
                ErrorCode::LaunchUnproven,
                format!("guest {vmid} did not prove its launch: {message}"),
            );
            s.fail(f, vmid)
        }
        // The copy goes as after any other failure (through the ownership recheck, or kept
        // when asked); the message already names the VM and the guest's setting.
        (Step::ProveLaunch, Event::GuestExecBlocked { message }) => {
            let vmid = s.require_vmid(kind)?;
            s.fail(Failure::new(ErrorCode::GuestExecBlocked, message), vmid)
        }
        (Step::Bootstrap, Event::Bootstrapped) => {
            let vmid = s.require_vmid(kind)?;
            s.advance(Phase::Bootstrapped, Step::Checks);
            vec![
                s.journal(),
                Effect::RunChecks {
                    vmid,
                    guest: s.guest(),
                },
            ]
        }
        (Step::Bootstrap, Event::BootstrapFailed { message }) => {
            let vmid = s.require_vmid(kind)?;
            let f = Failure::new(
                ErrorCode::BootstrapFailed,
                format!("the bootstrap of guest {vmid} failed: {message}"),
            );
            s.fail(f, vmid)
        }
        (Step::Checks, Event::ChecksPassed) => {
            s.advance(Phase::Verified, Step::Report);
            vec![s.journal(), Effect::Report]
        }
        (Step::Checks, Event::ChecksFailed { message }) => {
            let vmid = s.require_vmid(kind)?;
            let f = Failure::new(
                ErrorCode::CheckFailed,
                format!("the checks of guest {vmid} failed: {message}"),
            );
            s.fail(f, vmid)
        }
        (Step::Report, Event::ReportQueued) => {
            let vmid = s.require_vmid(kind)?;
            s.advance(Phase::Reported, Step::Recheck);
            if s.request.keep || !s.destroy_armed {
                s.finish(OutcomeKind::Ok);
                vec![s.journal()]
            } else {
                vec![s.journal(), s.recheck_effect(vmid)]
            }
        }
        (Step::Recheck, Event::GuestObserved(view)) => {
            let vmid = s.require_vmid(kind)?;
            s.on_recheck_observed(vmid, &view)
        }
        (Step::Destroy, Event::DestroyEnded(exit)) => {
            let vmid = s.require_vmid(kind)?;
            s.on_destroy_ended(vmid, &exit)
        }
        // The re-read after the stop, right before the DELETE, no longer proved ownership.
        (Step::Destroy, Event::GuestObserved(view)) => {
            let vmid = s.require_vmid(kind)?;
            s.on_recheck_observed(vmid, &view)
        }
        (Step::ConfirmDestroyed, Event::GuestObserved(view)) => {
            let vmid = s.require_vmid(kind)?;
            s.on_destroy_confirm_observed(vmid, &view)
        }
        (step, _) => {
            let detail = if step == Step::Done {
                "the transaction is settled".to_string()
            } else {
                let expected: Vec<&str> = step.accepts().iter().map(|k| k.as_str()).collect();
                format!("step {step} expects {}", expected.join(" or "))
            };
            return Err(state.disallowed(kind, detail));
        }
    };
    Ok((s, effects))
}

/// Settle a transaction a crashed run left open (DESIGN rule 6), from its last journaled state
/// and what PVE says now. Finishes an armed cleanup (always through a fresh
/// [`Effect::RecheckOwnership`], never a direct destroy), follows a restore task that still
/// runs, or settles as `failed` (nothing left) or `needs_human` with the reason. A guest whose
/// ownership cannot be proven is reported, never destroyed. A settled state is returned
/// unchanged with no effects.
///
/// A restore task that ended OK while the agent was stopped (before its result or the marker
/// was journaled) arms destroy only through the normal path: the guest must hold the marker's
/// description line, which only this transaction's restore request wrote; the marker is then
/// completed and read back (recording the birth identity) before the gated cleanup. Without
/// that line the guest is left to a human. A guest seen gone, or without its proof, disarms the
/// transaction for good (see [`State::disarmed`]).
pub fn recover(state: &State, observed: &RecoveryObservation) -> (State, Vec<Effect>) {
    if state.is_terminal() {
        return (state.clone(), Vec::new());
    }
    let mut s = state.clone();
    s.recovered = true;
    let Some(vmid) = s.request.vmid else {
        let msg = format!(
            "the journal of transaction {} has no vmid although it is open; nothing was touched",
            s.request.txn
        );
        let effects = s.needs_human(ErrorCode::OwnershipUnproven, msg);
        return (s, effects);
    };
    let seen = s.seen(&observed.guest);
    let effects = match s.step {
        Step::Done => Vec::new(),
        Step::Validate => {
            let f = s.interrupted(vmid, "nothing had been written");
            s.fail(f, vmid)
        }
        // The request may have reached PVE (killed mid-request, or while searching): the
        // full guest list alone cannot say nothing was created; search the task list.
        Step::Submit | Step::ProbeSubmit => {
            if s.step == Step::Submit {
                let f = s.interrupted(
                    vmid,
                    "PVE's answer to the restore request was never recorded; the node's task \
                     list is searched for its task",
                );
                s.note_failure(f);
            }
            s.find_own_task(vmid)
        }
        Step::Task | Step::StopTask => {
            let described = observed.guest.description_carries(&s.marker);
            recover_task(&mut s, vmid, &observed.task, &seen, described)
        }
        Step::ProbeLeftover => match seen {
            Seen::Absent => s.cleanup_or_settle(vmid),
            _ => s.leftover_needs_human(vmid),
        },
        Step::WriteMarker | Step::VerifyMarker => match seen {
            Seen::Ours { .. } if s.task_ok => {
                let f = s.interrupted(vmid, "the guest is cleaned up");
                s.note_failure(f);
                s.arm(vmid, &observed.guest)
            }
            // The restore request wrote the marker's description line: with our own task OK
            // this is our guest; complete the marker, read it back (recording the birth
            // identity), then clean up through the gate.
            _ if s.task_ok && observed.guest.description_carries(&s.marker) => {
                recover_marker_write(&mut s, vmid)
            }
            Seen::Absent => {
                let f = s.interrupted(vmid, "the guest is gone; nothing to clean up");
                s.fail(f, vmid)
            }
            _ => {
                let msg = format!(
                    "restore task {} of transaction {} ended OK but the agent stopped before it \
                     had read back its marker on guest {vmid}; the guest's ownership is unproven \
                     and it was not touched. Inspect it with `{}` and remove it with `{}` if it is \
                     this transaction's restore",
                    s.upid_text(),
                    s.request.txn,
                    s.cmd_config(vmid),
                    s.cmd_destroy(vmid)
                );
                s.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
        },
        Step::Start | Step::ProveLaunch | Step::WaitBoot | Step::Bootstrap | Step::Checks => {
            match seen {
                Seen::Ours { .. } if s.destroy_armed => {
                    let detail = if s.request.keep {
                        "the guest is kept (--keep)"
                    } else {
                        "the guest is cleaned up after a fresh ownership re-check"
                    };
                    let f = s.interrupted(vmid, detail);
                    s.fail(f, vmid)
                }
                Seen::Absent => {
                    if s.destroy_armed {
                        s.disarm(format!(
                            "guest {vmid} was gone when the agent settled the transaction"
                        ));
                    }
                    let f = s.interrupted(vmid, "the guest is gone; nothing to clean up");
                    s.note_failure(f);
                    s.finish(OutcomeKind::Failed);
                    vec![s.journal()]
                }
                other => {
                    let what = match other {
                        Seen::Copy { differs } => format!(
                            "carries marker {} but not the identity PVE gave it at its restore \
                         ({differs}): it is a copy",
                            s.txn_tag()
                        ),
                        Seen::Unreadable { reason } => format!("cannot be read ({reason})"),
                        _ => format!("no longer shows marker {}", s.txn_tag()),
                    };
                    if s.destroy_armed {
                        s.disarm(format!(
                            "guest {vmid} {what} when the agent settled the transaction"
                        ));
                    }
                    s.destroy_armed = false;
                    let msg = format!(
                    "the agent stopped during phase {} of transaction {}; guest {vmid} {what}, so \
                     its ownership is unproven and it was not touched; check it with `{}`",
                    s.reached,
                    s.request.txn,
                    s.cmd_config(vmid)
                );
                    s.needs_human(ErrorCode::OwnershipUnproven, msg)
                }
            }
        }
        // Verified but not yet in the outbox: report, then the normal end.
        Step::Report => vec![s.journal(), Effect::Report],
        // A cleanup was under way: start it again with a fresh re-check.
        Step::Recheck => vec![s.journal(), s.recheck_effect(vmid)],
        Step::Destroy | Step::ConfirmDestroyed => match seen {
            Seen::Absent | Seen::NotOurs { .. } | Seen::Copy { .. } => s.confirmed_destroyed(),
            Seen::Ours {
                lock: Some("destroyed"),
            } => {
                s.step = Step::ConfirmDestroyed;
                vec![
                    s.journal(),
                    Effect::ConfirmDestroyed {
                        vmid,
                        guest: s.guest(),
                    },
                ]
            }
            Seen::Ours { .. } => {
                s.step = Step::Recheck;
                vec![s.journal(), s.recheck_effect(vmid)]
            }
            // Unreadable mid-destroy (it left the pool before its config went): read it again
            // until it is gone or the confirmation's deadline passes; only then a person.
            Seen::Unreadable { .. } => {
                s.step = Step::ConfirmDestroyed;
                vec![
                    s.journal(),
                    Effect::ConfirmDestroyed {
                        vmid,
                        guest: s.guest(),
                    },
                ]
            }
        },
    };
    (s, effects)
}

/// Take up a transaction a stopped run left open (SIGTERM, a kill, a crash) and go on from its
/// last journaled step as if it had not been stopped, from what PVE says now. The transaction
/// keeps no failure for the stop: it ends with its real outcome.
///
/// It resumes only while nothing has failed yet and the proof holds:
/// - the restore request whose answer was never recorded: the node's task list is searched
///   for its own task, which is then followed (nothing found: `failed`, nothing was created);
/// - the recorded restore task still running: it is followed; ended OK with the guest holding
///   the restore request's description line: the marker is written and read back;
/// - the marker written (own task OK) and read back now: destroy is armed and the guest started;
/// - a start, launch proof, bootstrap or checks under way (destroy armed, the guest carrying its
///   marker and birth identity, unlocked): the start is sent again unless the guest already runs
///   (a launch proof restarts there too), a bootstrap or the checks run again from their start
///   (bootstrap profiles and check packs are idempotent);
/// - the report and the gated cleanup already go on in [`recover`].
///
/// Everything else (a failure already recorded, a task that ended in error or cannot be read,
/// a guest gone, locked, unreadable or without its proof) cannot be resumed and is settled by
/// [`recover`], through the gate as after any crash. A settled state is returned unchanged.
pub fn resume(state: &State, observed: &RecoveryObservation) -> (State, Vec<Effect>) {
    match resumable(state, observed) {
        Some(how) => {
            let mut s = state.clone();
            s.recovered = true;
            let effects = how.apply(&mut s);
            (s, effects)
        }
        None => recover(state, observed),
    }
}

/// How [`resume`] goes on from a journaled step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resumption {
    /// Search the task list for the restore request's own task.
    FindTask,
    /// Follow the recorded restore task.
    FollowTask,
    /// The task ended OK meanwhile: write and read back the marker.
    WriteMarker,
    /// The marker was read back now: arm and start.
    Arm,
    /// Start (again, unless it runs), then prove the launch.
    Start,
    /// Wait for the guest's boot again (it may have ended meanwhile).
    WaitBoot,
    /// Run the bootstrap again from its start.
    Bootstrap,
    /// Run the checks again from their start.
    Checks,
}

/// Whether `state` can go on from its journaled step, and how (see [`resume`]).
fn resumable(state: &State, observed: &RecoveryObservation) -> Option<Resumption> {
    if state.is_terminal() || state.failure.is_some() || state.request.dry_run {
        return None;
    }
    state.request.vmid?;
    let seen = state.seen(&observed.guest);
    let described = observed.guest.description_carries(&state.marker);
    let proven = state.destroy_armed
        && state.disarmed.is_none()
        && state.identity.is_some()
        && matches!(seen, Seen::Ours { lock: None });
    match state.step {
        Step::Submit | Step::ProbeSubmit => Some(Resumption::FindTask),
        Step::Task if state.upid.is_some() => match observed.task {
            TaskObservation::Running => Some(Resumption::FollowTask),
            TaskObservation::Ok if described && !matches!(seen, Seen::Absent) => {
                Some(Resumption::WriteMarker)
            }
            _ => None,
        },
        Step::WriteMarker | Step::VerifyMarker if state.task_ok && state.upid.is_some() => {
            match seen {
                Seen::Ours { lock: None } => Some(Resumption::Arm),
                _ if described => Some(Resumption::WriteMarker),
                _ => None,
            }
        }
        Step::Start | Step::ProveLaunch if proven => Some(Resumption::Start),
        Step::WaitBoot if proven => Some(Resumption::WaitBoot),
        Step::Bootstrap if proven => Some(Resumption::Bootstrap),
        Step::Checks if proven => Some(Resumption::Checks),
        _ => None,
    }
}

impl Resumption {
    fn apply(self, s: &mut State) -> Vec<Effect> {
        let vmid = s.request.vmid.unwrap_or_default();
        let guest = s.guest();
        match self {
            Resumption::FindTask => s.find_own_task(vmid),
            Resumption::FollowTask => {
                let upid = s.upid.clone().unwrap_or_default();
                s.step = Step::Task;
                vec![s.journal(), Effect::WaitTask { upid }]
            }
            Resumption::WriteMarker => {
                s.task_ok = true;
                s.step = Step::WriteMarker;
                vec![
                    s.journal(),
                    Effect::WriteMarker {
                        vmid,
                        guest,
                        marker: s.marker,
                    },
                ]
            }
            Resumption::Arm => {
                s.step = Step::VerifyMarker;
                vec![s.journal(), Effect::VerifyMarker { vmid, guest }]
            }
            Resumption::Start => {
                s.step = Step::Start;
                vec![s.journal(), Effect::Start { vmid, guest }]
            }
            Resumption::WaitBoot => {
                s.step = Step::WaitBoot;
                vec![s.journal(), Effect::WaitBoot { vmid, guest }]
            }
            Resumption::Bootstrap => {
                s.step = Step::Bootstrap;
                vec![s.journal(), Effect::Bootstrap { vmid, guest }]
            }
            Resumption::Checks => {
                s.step = Step::Checks;
                vec![s.journal(), Effect::RunChecks { vmid, guest }]
            }
        }
    }
}

/// Settle a restore whose task ended OK and whose guest holds the marker's description line
/// (written by the restore request) but not yet the whole marker: write the marker, read it
/// back (the birth identity is recorded then), then the gated cleanup.
fn recover_marker_write(s: &mut State, vmid: u32) -> Vec<Effect> {
    let f = s.interrupted(
        vmid,
        "its restore task had ended OK and the guest carries the description line of its \
         restore request; the marker is completed and the guest cleaned up through the gate",
    );
    s.note_failure(f);
    s.step = Step::WriteMarker;
    vec![
        s.journal(),
        Effect::WriteMarker {
            vmid,
            guest: s.guest(),
            marker: s.marker,
        },
    ]
}

/// Recovery of a transaction whose restore task (UPID recorded) had no journaled result.
/// `described`: the guest holds the marker's description line.
fn recover_task(
    s: &mut State,
    vmid: u32,
    task: &TaskObservation,
    seen: &Seen,
    described: bool,
) -> Vec<Effect> {
    let Some(upid) = s.upid.clone() else {
        let msg = format!(
            "the journal of transaction {} waits for a restore task but holds no UPID; the guest \
             at vmid {vmid} was not touched; inspect it with `{}`",
            s.request.txn,
            s.cmd_config(vmid)
        );
        return s.needs_human(ErrorCode::OwnershipUnproven, msg);
    };
    match task {
        TaskObservation::Running => {
            // Still our task: follow it; the normal path marks and arms, then cleans up.
            let f = s.interrupted(
                vmid,
                "its restore task still runs and is followed to its end, then cleaned up",
            );
            s.note_failure(f);
            s.step = Step::Task;
            vec![s.journal(), Effect::WaitTask { upid }]
        }
        TaskObservation::Ok => match seen {
            Seen::Absent => {
                let f = s.interrupted(vmid, "the guest is gone; nothing to clean up");
                s.fail(f, vmid)
            }
            // Our own task ended OK and the guest holds the description line our restore
            // request wrote: complete the marker and clean up through the gate.
            _ if described => {
                s.task_ok = true;
                recover_marker_write(s, vmid)
            }
            _ => {
                let msg = format!(
                    "restore task {upid} of transaction {} ended OK while the agent was stopped, \
                     before it could mark guest {vmid}; ownership cannot be proven now, so the \
                     guest was not touched. Inspect it with `{}` and remove it with `{}` if it is \
                     this transaction's restore",
                    s.request.txn,
                    s.cmd_config(vmid),
                    s.cmd_destroy(vmid)
                );
                s.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
        },
        // A failed restore can leave its guest behind, of either kind (facts §4.3, §5.2).
        TaskObservation::Error { message } => match seen {
            Seen::Absent => {
                let f = Failure::new(
                    ErrorCode::TaskFailed,
                    format!("restore task {upid} for vmid {vmid} failed: {message}"),
                );
                s.fail(f, vmid)
            }
            _ => {
                let f = Failure::new(
                    ErrorCode::TaskFailed,
                    format!("restore task {upid} for vmid {vmid} failed: {message}"),
                );
                s.note_failure(f);
                s.leftover_needs_human(vmid)
            }
        },
        TaskObservation::Unknown { message } => match seen {
            Seen::Absent => {
                let f = s.interrupted(
                    vmid,
                    &format!(
                        "the status of restore task {upid} is unknown ({message}) and no guest \
                         exists at the vmid; nothing to clean up"
                    ),
                );
                s.fail(f, vmid)
            }
            _ => {
                let msg = format!(
                    "the status of restore task {upid} of transaction {} is unknown ({message}); \
                     guest {vmid} exists but its ownership cannot be proven, so it was not \
                     touched; inspect it with `{}`",
                    s.request.txn,
                    s.cmd_config(vmid)
                );
                s.needs_human(ErrorCode::OwnershipUnproven, msg)
            }
        },
    }
}

mod aftercare;
pub use aftercare::{Finding, Resolution, ResolvedBy, RESOLUTION_REASON_MAX_BYTES};

#[cfg(test)]
mod tests;
