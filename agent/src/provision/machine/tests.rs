//! Tests of the provision state machine: the full (step, event) table, every allowed
//! transition, the proof-of-launch gate, recovery, and a property test of the gate.

use super::*;
use proptest::prelude::*;

const UPID: &str = "UPID:pve1:0003A2F1:01B7E4C0:6650C0DE:vzrestore:120:felhom@pve!agent:";
const OTHER_UPID: &str = "UPID:pve1:0003A2F2:01B7E4C0:6650C0DF:vzrestore:120:other@pve:";
const VMID: u32 = 120;

fn txn() -> Ulid {
    Ulid::from_parts(1_767_225_600_000, 0x1234_5678_9abc)
}

fn other_txn() -> Ulid {
    Ulid::from_parts(1_767_225_700_000, 0x4321)
}

fn request(guest: GuestKind, keep: bool, dry_run: bool) -> Request {
    Request {
        txn: txn(),
        kind: TxnKind::SelftestProvision,
        vmid: Some(VMID),
        guest,
        volid: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
        storage: "local-lvm".to_string(),
        pool: "felhom".to_string(),
        isolate_network: false,
        keep,
        dry_run,
        profile: None,
        lab_bridge: None,
        group: None,
    }
}

/// The birth identity every test guest of this transaction was given at its restore.
fn born() -> BirthIdentity {
    let mut id = BirthIdentity::default();
    id.nics
        .insert("net0".to_string(), "BC:24:11:12:34:56".to_string());
    id
}

fn ours(marker: &Marker) -> GuestView {
    GuestView::Present {
        tags: marker.tags().join(";"),
        description: format!("customer notes\n{}", marker.description_line()),
        lock: None,
        identity: born(),
    }
}

fn ours_locked(marker: &Marker, lock: &str) -> GuestView {
    GuestView::Present {
        tags: marker.tags().join(";"),
        description: marker.description_line(),
        lock: Some(lock.to_string()),
        identity: born(),
    }
}

/// The marker with another birth identity: a backup of the guest restored, or a clone.
fn copy_of(marker: &Marker) -> GuestView {
    let mut id = born();
    id.nics
        .insert("net0".to_string(), "BC:24:11:65:43:21".to_string());
    id.vmgenid = Some("5b2e0c55-0000-4000-8000-000000000001".to_string());
    GuestView::Present {
        tags: marker.tags().join(";"),
        description: marker.description_line(),
        lock: None,
        identity: id,
    }
}

/// What the restore request leaves: the marker's description line, no tags yet.
fn described(marker: &Marker) -> GuestView {
    GuestView::Present {
        tags: String::new(),
        description: marker.description_line(),
        lock: None,
        identity: born(),
    }
}

fn not_ours() -> GuestView {
    let other = Marker::new(other_txn());
    GuestView::Present {
        tags: other.tags().join(";"),
        description: other.description_line(),
        lock: None,
        identity: born(),
    }
}

fn unreadable() -> GuestView {
    GuestView::Unreadable {
        reason: "Permission check failed (/vms/120, VM.Audit)".to_string(),
    }
}

fn failure(code: ErrorCode, msg: &str) -> Failure {
    Failure::new(code, msg)
}

fn apply(s: &State, e: Event) -> (State, Vec<Effect>) {
    match step(s, e) {
        Ok(r) => r,
        Err(d) => panic!("expected an allowed transition: {d}"),
    }
}

fn names(effects: &[Effect]) -> Vec<&'static str> {
    effects.iter().map(Effect::name).collect()
}

/// The event that moves `s` one step towards `target` along allowed transitions.
fn towards(s: &State, target: Step) -> Event {
    let m = s.marker();
    match s.step() {
        Step::Validate => Event::VmidAccepted,
        Step::Submit if target == Step::ProbeSubmit => {
            Event::SubmitUnknown(failure(ErrorCode::PveUnreachable, "connection reset"))
        }
        Step::Submit => Event::Submitted {
            upid: UPID.to_string(),
        },
        Step::Task if target == Step::StopTask => Event::TaskWaitTimedOut {
            upid: UPID.to_string(),
        },
        Step::Task if target == Step::ProbeLeftover => Event::TaskEnded {
            upid: UPID.to_string(),
            exit: TaskExit::Error {
                message: "unable to restore VM 120 - storage full".to_string(),
            },
        },
        Step::Task | Step::StopTask => Event::TaskEnded {
            upid: UPID.to_string(),
            exit: TaskExit::Ok,
        },
        Step::WriteMarker => Event::MarkerWritten,
        Step::VerifyMarker | Step::Recheck => Event::GuestObserved(ours(&m)),
        Step::Start => Event::Started,
        Step::ProveLaunch => Event::LaunchProven,
        Step::WaitBoot => Event::BootEnded {
            seen: "systemd: running after 1.0s".to_string(),
        },
        Step::Bootstrap => Event::Bootstrapped,
        Step::Checks => Event::ChecksPassed,
        Step::Report => Event::ReportQueued,
        Step::Destroy => Event::DestroyEnded(TaskExit::Ok),
        Step::ConfirmDestroyed => Event::GuestObserved(GuestView::Absent),
        other => panic!("no path from {other} to {target}"),
    }
}

fn drive(mut s: State, target: Step) -> State {
    for _ in 0..40 {
        if s.step() == target {
            return s;
        }
        let e = towards(&s, target);
        s = apply(&s, e).0;
    }
    panic!("step {target} not reached");
}

fn at_with(target: Step, guest: GuestKind, keep: bool) -> State {
    drive(State::new(request(guest, keep, false)), target)
}

/// A state at `target` (QEMU where only a VM restore reaches it).
fn at(target: Step) -> State {
    let guest = if target == Step::ProbeLeftover {
        GuestKind::Qemu
    } else {
        GuestKind::Lxc
    };
    at_with(target, guest, false)
}

/// A plausible event of each kind for state `s` (our UPID, our marker).
fn sample(kind: EventKind, s: &State) -> Event {
    let upid = s.upid().unwrap_or(UPID).to_string();
    match kind {
        EventKind::VmidAccepted => Event::VmidAccepted,
        EventKind::VmidRefused => {
            Event::VmidRefused(failure(ErrorCode::VmidInUse, "vmid 120 is in use"))
        }
        EventKind::BandFull => Event::BandFull {
            message: "band full".to_string(),
        },
        EventKind::Submitted => Event::Submitted { upid },
        EventKind::SubmitRefused => Event::SubmitRefused(failure(
            ErrorCode::PveRefused,
            "CT 120 already exists on node 'pve1'",
        )),
        EventKind::SubmitUnknown => {
            Event::SubmitUnknown(failure(ErrorCode::PveUnreachable, "connection reset"))
        }
        EventKind::SubmitProbed => Event::SubmitProbed(SubmitProbe::OwnTask {
            upid: UPID.to_string(),
        }),
        EventKind::TaskEnded => Event::TaskEnded {
            upid,
            exit: TaskExit::Ok,
        },
        EventKind::TaskWaitTimedOut => Event::TaskWaitTimedOut { upid },
        EventKind::MarkerWritten => Event::MarkerWritten,
        EventKind::MarkerWriteFailed => {
            Event::MarkerWriteFailed(failure(ErrorCode::GuestLocked, "CT is locked (backup)"))
        }
        EventKind::GuestObserved => Event::GuestObserved(ours(&s.marker())),
        EventKind::Started => Event::Started,
        EventKind::StartFailed => Event::StartFailed {
            message: "CT is locked (create)".to_string(),
        },
        EventKind::LaunchProven => Event::LaunchProven,
        EventKind::LaunchUnproven => Event::LaunchUnproven {
            message: "no exec answer".to_string(),
        },
        EventKind::GuestExecBlocked => Event::GuestExecBlocked {
            message: "its guest-info: guest-exec disabled".to_string(),
        },
        EventKind::BootEnded => Event::BootEnded {
            seen: "systemd: degraded after 2.0s".to_string(),
        },
        EventKind::BootUnfinished => Event::BootUnfinished {
            message: "its systemd is starting; jobs still running: slow.service".to_string(),
        },
        EventKind::GroupLabFailed => Event::GroupLabFailed {
            message: "the copy 990000 could not be joined to its group's lab".to_string(),
        },
        EventKind::Bootstrapped => Event::Bootstrapped,
        EventKind::BootstrapFailed => Event::BootstrapFailed {
            message: "exit status 1".to_string(),
        },
        EventKind::ChecksPassed => Event::ChecksPassed,
        EventKind::ChecksFailed => Event::ChecksFailed {
            message: "sshd not listening".to_string(),
        },
        EventKind::ReportQueued => Event::ReportQueued,
        EventKind::DestroyEnded => Event::DestroyEnded(TaskExit::Ok),
    }
}

/// The transition table: every (step, event kind) pair the machine accepts.
const ALLOWED: &[(Step, EventKind)] = &[
    (Step::Validate, EventKind::VmidAccepted),
    (Step::Validate, EventKind::VmidRefused),
    (Step::Validate, EventKind::BandFull),
    (Step::Submit, EventKind::Submitted),
    (Step::Submit, EventKind::SubmitRefused),
    (Step::Submit, EventKind::SubmitUnknown),
    (Step::ProbeSubmit, EventKind::SubmitProbed),
    (Step::Task, EventKind::TaskEnded),
    (Step::Task, EventKind::TaskWaitTimedOut),
    (Step::StopTask, EventKind::TaskEnded),
    (Step::StopTask, EventKind::TaskWaitTimedOut),
    (Step::ProbeLeftover, EventKind::GuestObserved),
    (Step::WriteMarker, EventKind::MarkerWritten),
    (Step::WriteMarker, EventKind::MarkerWriteFailed),
    (Step::VerifyMarker, EventKind::GuestObserved),
    (Step::Start, EventKind::Started),
    (Step::Start, EventKind::StartFailed),
    (Step::ProveLaunch, EventKind::LaunchProven),
    (Step::ProveLaunch, EventKind::LaunchUnproven),
    (Step::ProveLaunch, EventKind::GuestExecBlocked),
    (Step::WaitBoot, EventKind::BootEnded),
    (Step::WaitBoot, EventKind::BootUnfinished),
    (Step::WaitBoot, EventKind::GroupLabFailed),
    (Step::Bootstrap, EventKind::Bootstrapped),
    (Step::Bootstrap, EventKind::BootstrapFailed),
    (Step::Checks, EventKind::ChecksPassed),
    (Step::Checks, EventKind::ChecksFailed),
    (Step::Report, EventKind::ReportQueued),
    (Step::Recheck, EventKind::GuestObserved),
    (Step::Destroy, EventKind::DestroyEnded),
    (Step::Destroy, EventKind::GuestObserved),
    (Step::ConfirmDestroyed, EventKind::GuestObserved),
];

#[test]
fn every_step_is_reachable_and_every_pair_outside_the_table_is_disallowed() {
    let mut disallowed = 0;
    let mut allowed = 0;
    for st in Step::ALL {
        let s = at(st);
        assert_eq!(s.step(), st);
        for kind in EventKind::ALL {
            let listed = ALLOWED.contains(&(st, kind));
            match step(&s, sample(kind, &s)) {
                Ok(_) => {
                    assert!(
                        listed,
                        "({st}, {kind}) was accepted but is not in the table"
                    );
                    allowed += 1;
                }
                Err(d) => {
                    assert!(
                        !listed,
                        "({st}, {kind}) is in the table but was refused: {d}"
                    );
                    assert_eq!((d.step, d.event, d.txn), (st, kind, txn()));
                    assert_eq!(d.code(), ErrorCode::OwnershipUnproven);
                    disallowed += 1;
                }
            }
        }
    }
    assert_eq!(allowed, ALLOWED.len());
    // The table the machine publishes agrees with the one tested here.
    for st in Step::ALL {
        let listed: Vec<EventKind> = ALLOWED
            .iter()
            .filter(|(s, _)| *s == st)
            .map(|(_, k)| *k)
            .collect();
        assert_eq!(st.accepts(), listed.as_slice(), "{st}");
    }
    assert_eq!(
        disallowed,
        Step::ALL.len() * EventKind::ALL.len() - ALLOWED.len()
    );
}

#[test]
fn task_events_naming_another_upid_are_disallowed() {
    for st in [Step::Task, Step::StopTask] {
        let s = at(st);
        let ended = Event::TaskEnded {
            upid: OTHER_UPID.to_string(),
            exit: TaskExit::Ok,
        };
        let timed_out = Event::TaskWaitTimedOut {
            upid: OTHER_UPID.to_string(),
        };
        for e in [ended, timed_out] {
            let err = step(&s, e).err().map(|d| d.detail);
            assert!(
                err.as_deref().is_some_and(|d| d.contains(OTHER_UPID)),
                "{st}: {err:?}"
            );
        }
    }
}

#[test]
fn an_empty_upid_or_a_missing_vmid_is_disallowed() {
    let s = at(Step::Submit);
    assert!(step(
        &s,
        Event::Submitted {
            upid: String::new()
        }
    )
    .is_err());
    let mut req = request(GuestKind::Lxc, false, false);
    req.vmid = None;
    assert!(step(&State::new(req), Event::VmidAccepted).is_err());
}

/// One row of the transition table test.
struct Row {
    name: &'static str,
    from: State,
    event: Event,
    phase: Phase,
    step: Step,
    outcome: Option<OutcomeKind>,
    armed: bool,
    effects: &'static [&'static str],
    code: Option<ErrorCode>,
}

fn check(row: Row) {
    let (s, effects) = apply(&row.from, row.event);
    let n = row.name;
    assert_eq!(s.phase(), row.phase, "{n}: phase");
    assert_eq!(s.step(), row.step, "{n}: step");
    assert_eq!(s.outcome_kind(), row.outcome, "{n}: outcome");
    assert_eq!(s.destroy_armed(), row.armed, "{n}: destroy_armed");
    assert_eq!(names(&effects), row.effects, "{n}: effects");
    assert_eq!(s.failure().map(|f| f.code), row.code, "{n}: error code");
    assert_eq!(s.is_terminal(), row.outcome.is_some(), "{n}: terminal");
    // A journal effect carries exactly the new state, and always comes first.
    for (i, e) in effects.iter().enumerate() {
        if let Effect::Journal(j) = e {
            assert_eq!(i, 0, "{n}: journal must come first");
            assert_eq!(**j, s, "{n}: journaled state");
        }
    }
}

#[test]
fn every_allowed_transition_does_what_the_table_says() {
    use ErrorCode as C;
    use OutcomeKind as O;
    let lxc = GuestKind::Lxc;
    let qemu = GuestKind::Qemu;
    let m = Marker::new(txn());
    let rows = vec![
        Row {
            name: "vmid accepted",
            from: at(Step::Validate),
            event: Event::VmidAccepted,
            phase: Phase::Validated,
            step: Step::Submit,
            outcome: None,
            armed: false,
            effects: &["journal", "submit_restore"],
            code: None,
        },
        Row {
            name: "vmid accepted, dry run",
            from: State::new(request(lxc, false, true)),
            event: Event::VmidAccepted,
            phase: Phase::Validated,
            step: Step::Done,
            outcome: Some(O::Ok),
            armed: false,
            effects: &["plan"],
            code: None,
        },
        Row {
            name: "vmid refused",
            from: at(Step::Validate),
            event: Event::VmidRefused(failure(C::VmidReserved, "vmid 9999 is reserved")),
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Refused),
            armed: false,
            effects: &["journal"],
            code: Some(C::VmidReserved),
        },
        Row {
            name: "band full",
            from: at(Step::Validate),
            event: Event::BandFull {
                message: "990000..=990009 all taken".to_string(),
            },
            phase: Phase::Skipped,
            step: Step::Done,
            outcome: Some(O::Skipped),
            armed: false,
            effects: &["journal"],
            code: Some(C::BandFull),
        },
        Row {
            name: "submitted",
            from: at(Step::Submit),
            event: Event::Submitted {
                upid: UPID.to_string(),
            },
            phase: Phase::Submitted,
            step: Step::Task,
            outcome: None,
            armed: false,
            effects: &["journal", "wait_task"],
            code: None,
        },
        Row {
            name: "collision refused by PVE",
            from: at(Step::Submit),
            event: Event::SubmitRefused(failure(
                C::PveRefused,
                "CT 120 already exists on node 'pve1'",
            )),
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: false,
            effects: &["journal"],
            code: Some(C::PveRefused),
        },
        Row {
            name: "submit answer lost",
            from: at(Step::Submit),
            event: Event::SubmitUnknown(failure(C::PveUnreachable, "connection reset")),
            phase: Phase::Failed,
            step: Step::ProbeSubmit,
            outcome: None,
            armed: false,
            effects: &["journal", "find_own_task"],
            code: Some(C::PveUnreachable),
        },
        Row {
            name: "search after lost answer: own task found and followed",
            from: at(Step::ProbeSubmit),
            event: Event::SubmitProbed(SubmitProbe::OwnTask {
                upid: UPID.to_string(),
            }),
            phase: Phase::Failed,
            step: Step::Task,
            outcome: None,
            armed: false,
            effects: &["journal", "wait_task"],
            code: Some(C::PveUnreachable),
        },
        Row {
            name: "search after lost answer: nothing for the whole window",
            from: at(Step::ProbeSubmit),
            event: Event::SubmitProbed(SubmitProbe::Nothing { waited_secs: 30 }),
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: false,
            effects: &["journal"],
            code: Some(C::PveUnreachable),
        },
        Row {
            name: "search after lost answer: task list unreadable, no guest",
            from: at(Step::ProbeSubmit),
            event: Event::SubmitProbed(SubmitProbe::Unproven {
                guest: GuestView::Absent,
                detail: "the task list could not be read".to_string(),
            }),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::PveUnreachable),
        },
        Row {
            name: "search after lost answer: a guest without our task",
            from: at(Step::ProbeSubmit),
            event: Event::SubmitProbed(SubmitProbe::Unproven {
                guest: not_ours(),
                detail: "no task".to_string(),
            }),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::OwnershipUnproven),
        },
        Row {
            name: "search after lost answer: an unreadable guest without our task",
            from: at(Step::ProbeSubmit),
            event: Event::SubmitProbed(SubmitProbe::Unproven {
                guest: unreadable(),
                detail: "no task".to_string(),
            }),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::OwnershipUnproven),
        },
        Row {
            name: "task ok",
            from: at(Step::Task),
            event: Event::TaskEnded {
                upid: UPID.to_string(),
                exit: TaskExit::Ok,
            },
            phase: Phase::Submitted,
            step: Step::WriteMarker,
            outcome: None,
            armed: false,
            effects: &["journal", "write_marker"],
            code: None,
        },
        Row {
            name: "lxc task error: look for a leftover before settling",
            from: at(Step::Task),
            event: Event::TaskEnded {
                upid: UPID.to_string(),
                exit: TaskExit::Error {
                    message: "unable to restore CT 120 - ERROR: file does not exist".to_string(),
                },
            },
            phase: Phase::Failed,
            step: Step::ProbeLeftover,
            outcome: None,
            armed: false,
            effects: &["journal", "probe_guest"],
            code: Some(C::TaskFailed),
        },
        Row {
            name: "qemu task error",
            from: at_with(Step::Task, qemu, false),
            event: Event::TaskEnded {
                upid: UPID.to_string(),
                exit: TaskExit::Error {
                    message: "unable to restore VM 120 - storage full".to_string(),
                },
            },
            phase: Phase::Failed,
            step: Step::ProbeLeftover,
            outcome: None,
            armed: false,
            effects: &["journal", "probe_guest"],
            code: Some(C::TaskFailed),
        },
        Row {
            name: "task timeout",
            from: at(Step::Task),
            event: Event::TaskWaitTimedOut {
                upid: UPID.to_string(),
            },
            phase: Phase::Failed,
            step: Step::StopTask,
            outcome: None,
            armed: false,
            effects: &["journal", "stop_task", "wait_task"],
            code: Some(C::TaskTimeout),
        },
        Row {
            name: "stopped task ended ok anyway",
            from: at(Step::StopTask),
            event: Event::TaskEnded {
                upid: UPID.to_string(),
                exit: TaskExit::Ok,
            },
            phase: Phase::Failed,
            step: Step::WriteMarker,
            outcome: None,
            armed: false,
            effects: &["journal", "write_marker"],
            code: Some(C::TaskTimeout),
        },
        Row {
            name: "stopped lxc task ended in error",
            from: at(Step::StopTask),
            event: Event::TaskEnded {
                upid: UPID.to_string(),
                exit: TaskExit::Error {
                    message: "interrupted by signal".to_string(),
                },
            },
            phase: Phase::Failed,
            step: Step::ProbeLeftover,
            outcome: None,
            armed: false,
            effects: &["journal", "probe_guest"],
            code: Some(C::TaskTimeout),
        },
        Row {
            name: "task does not stop",
            from: at(Step::StopTask),
            event: Event::TaskWaitTimedOut {
                upid: UPID.to_string(),
            },
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::TaskTimeout),
        },
        Row {
            name: "qemu leftover absent",
            from: at(Step::ProbeLeftover),
            event: Event::GuestObserved(GuestView::Absent),
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: false,
            effects: &["journal"],
            code: Some(C::TaskFailed),
        },
        Row {
            name: "qemu leftover present",
            from: at(Step::ProbeLeftover),
            event: Event::GuestObserved(unreadable()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::TaskFailed),
        },
        Row {
            name: "lxc leftover present (failed after the create, outside the pool)",
            from: at_with(Step::ProbeLeftover, lxc, false),
            event: Event::GuestObserved(unreadable()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::TaskFailed),
        },
        Row {
            name: "marker written",
            from: at(Step::WriteMarker),
            event: Event::MarkerWritten,
            phase: Phase::Submitted,
            step: Step::VerifyMarker,
            outcome: None,
            armed: false,
            effects: &["journal", "verify_marker"],
            code: None,
        },
        Row {
            name: "marker write failed",
            from: at(Step::WriteMarker),
            event: Event::MarkerWriteFailed(failure(C::GuestLocked, "CT is locked (backup)")),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::GuestLocked),
        },
        Row {
            name: "marker read back: armed",
            from: at(Step::VerifyMarker),
            event: Event::GuestObserved(ours(&m)),
            phase: Phase::Created,
            step: Step::Start,
            outcome: None,
            armed: true,
            effects: &["journal", "start"],
            code: None,
        },
        Row {
            name: "marker read back: another marker",
            from: at(Step::VerifyMarker),
            event: Event::GuestObserved(not_ours()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::OwnershipUnproven),
        },
        Row {
            name: "marker read back: tags without the description line",
            from: at(Step::VerifyMarker),
            event: Event::GuestObserved(GuestView::Present {
                tags: m.tags().join(";"),
                description: String::new(),
                lock: None,
                identity: born(),
            }),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::OwnershipUnproven),
        },
        Row {
            name: "marker read back: guest gone",
            from: at(Step::VerifyMarker),
            event: Event::GuestObserved(GuestView::Absent),
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: false,
            effects: &["journal"],
            code: Some(C::TaskFailed),
        },
        Row {
            name: "marker read back: unreadable",
            from: at(Step::VerifyMarker),
            event: Event::GuestObserved(unreadable()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::OwnershipUnproven),
        },
        Row {
            name: "timed-out task, then marker read back: armed for cleanup",
            from: drive(at(Step::StopTask), Step::VerifyMarker),
            event: Event::GuestObserved(ours(&m)),
            phase: Phase::Failed,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
            code: Some(C::TaskTimeout),
        },
        Row {
            name: "started",
            from: at(Step::Start),
            event: Event::Started,
            phase: Phase::Started,
            step: Step::ProveLaunch,
            outcome: None,
            armed: true,
            effects: &["journal", "prove_launch"],
            code: None,
        },
        Row {
            name: "start failed",
            from: at(Step::Start),
            event: Event::StartFailed {
                message: "CT 120 already running".to_string(),
            },
            phase: Phase::Failed,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
            code: Some(C::LaunchUnproven),
        },
        Row {
            name: "start failed, keep",
            from: at_with(Step::Start, lxc, true),
            event: Event::StartFailed {
                message: "CT is locked (create)".to_string(),
            },
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: true,
            effects: &["journal"],
            code: Some(C::LaunchUnproven),
        },
        Row {
            name: "launch proven",
            from: at(Step::ProveLaunch),
            event: Event::LaunchProven,
            phase: Phase::Launched,
            step: Step::WaitBoot,
            outcome: None,
            armed: true,
            effects: &["journal", "wait_boot"],
            code: None,
        },
        Row {
            name: "boot ended",
            from: at(Step::WaitBoot),
            event: Event::BootEnded {
                seen: "systemd: degraded after 3.0s".to_string(),
            },
            phase: Phase::Booted,
            step: Step::Bootstrap,
            outcome: None,
            armed: true,
            effects: &["journal", "bootstrap"],
            code: None,
        },
        Row {
            name: "boot unfinished",
            from: at(Step::WaitBoot),
            event: Event::BootUnfinished {
                message: "its systemd is starting".to_string(),
            },
            phase: Phase::Failed,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
            code: Some(C::BootUnfinished),
        },
        Row {
            name: "group lab failed: the copy is destroyed through the gate",
            from: at(Step::WaitBoot),
            event: Event::GroupLabFailed {
                message: "the copy could not be joined to its group's lab".to_string(),
            },
            phase: Phase::Failed,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
            code: Some(C::GroupLabFailed),
        },
        Row {
            name: "launch unproven",
            from: at(Step::ProveLaunch),
            event: Event::LaunchUnproven {
                message: "pct exec timed out".to_string(),
            },
            phase: Phase::Failed,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
            code: Some(C::LaunchUnproven),
        },
        Row {
            name: "guest exec blocked",
            from: at(Step::ProveLaunch),
            event: Event::GuestExecBlocked {
                message:
                    "VM 120 booted and its QEMU guest agent answers, but it refuses guest-exec"
                        .to_string(),
            },
            phase: Phase::Failed,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
            code: Some(C::GuestExecBlocked),
        },
        Row {
            name: "guest exec blocked, keep",
            from: at_with(Step::ProveLaunch, GuestKind::Qemu, true),
            event: Event::GuestExecBlocked {
                message: "its guest-info: guest-exec disabled".to_string(),
            },
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: true,
            effects: &["journal"],
            code: Some(C::GuestExecBlocked),
        },
        Row {
            name: "bootstrapped",
            from: at(Step::Bootstrap),
            event: Event::Bootstrapped,
            phase: Phase::Bootstrapped,
            step: Step::Checks,
            outcome: None,
            armed: true,
            effects: &["journal", "run_checks"],
            code: None,
        },
        Row {
            name: "bootstrap failed",
            from: at(Step::Bootstrap),
            event: Event::BootstrapFailed {
                message: "exit status 2".to_string(),
            },
            phase: Phase::Failed,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
            code: Some(C::BootstrapFailed),
        },
        Row {
            name: "checks passed",
            from: at(Step::Checks),
            event: Event::ChecksPassed,
            phase: Phase::Verified,
            step: Step::Report,
            outcome: None,
            armed: true,
            effects: &["journal", "report"],
            code: None,
        },
        Row {
            name: "checks failed",
            from: at(Step::Checks),
            event: Event::ChecksFailed {
                message: "listening_ports: no row for 22".to_string(),
            },
            phase: Phase::Failed,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
            code: Some(C::CheckFailed),
        },
        Row {
            name: "checks failed, keep",
            from: at_with(Step::Checks, lxc, true),
            event: Event::ChecksFailed {
                message: "osqueryi missing".to_string(),
            },
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: true,
            effects: &["journal"],
            code: Some(C::CheckFailed),
        },
        Row {
            name: "reported",
            from: at(Step::Report),
            event: Event::ReportQueued,
            phase: Phase::Reported,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
            code: None,
        },
        Row {
            name: "reported, keep",
            from: at_with(Step::Report, lxc, true),
            event: Event::ReportQueued,
            phase: Phase::Reported,
            step: Step::Done,
            outcome: Some(O::Ok),
            armed: true,
            effects: &["journal"],
            code: None,
        },
        Row {
            name: "recheck: ours",
            from: at(Step::Recheck),
            event: Event::GuestObserved(ours(&m)),
            phase: Phase::Reported,
            step: Step::Destroy,
            outcome: None,
            armed: true,
            effects: &["journal", "destroy"],
            code: None,
        },
        Row {
            name: "recheck: ours but locked",
            from: at(Step::Recheck),
            event: Event::GuestObserved(ours_locked(&m, "backup")),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: true,
            effects: &["journal"],
            code: Some(C::GuestLocked),
        },
        Row {
            name: "recheck: ownership lost",
            from: at(Step::Recheck),
            event: Event::GuestObserved(not_ours()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::OwnershipUnproven),
        },
        Row {
            name: "recheck: unreadable",
            from: at(Step::Recheck),
            event: Event::GuestObserved(unreadable()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::OwnershipUnproven),
        },
        Row {
            name: "recheck: already gone",
            from: at(Step::Recheck),
            event: Event::GuestObserved(GuestView::Absent),
            phase: Phase::Reported,
            step: Step::Done,
            outcome: Some(O::Ok),
            armed: false,
            effects: &["journal"],
            code: None,
        },
        Row {
            name: "destroy ended ok",
            from: at(Step::Destroy),
            event: Event::DestroyEnded(TaskExit::Ok),
            phase: Phase::Reported,
            step: Step::ConfirmDestroyed,
            outcome: None,
            armed: true,
            effects: &["journal", "confirm_destroyed"],
            code: None,
        },
        Row {
            name: "destroy: the re-read after the stop shows a copy",
            from: at(Step::Destroy),
            event: Event::GuestObserved(copy_of(&m)),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
            code: Some(C::OwnershipUnproven),
        },
        Row {
            name: "destroy failed",
            from: at(Step::Destroy),
            event: Event::DestroyEnded(TaskExit::Error {
                message: "can't remove CT 120 - protection mode enabled".to_string(),
            }),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: true,
            effects: &["journal"],
            code: Some(C::TaskFailed),
        },
        Row {
            name: "destroy confirmed: absent",
            from: at(Step::ConfirmDestroyed),
            event: Event::GuestObserved(GuestView::Absent),
            phase: Phase::Destroyed,
            step: Step::Done,
            outcome: Some(O::Ok),
            armed: true,
            effects: &["journal"],
            code: None,
        },
        Row {
            name: "destroy confirmed: vmid already reused by another guest",
            from: at(Step::ConfirmDestroyed),
            event: Event::GuestObserved(not_ours()),
            phase: Phase::Destroyed,
            step: Step::Done,
            outcome: Some(O::Ok),
            armed: true,
            effects: &["journal"],
            code: None,
        },
        Row {
            name: "destroy unconfirmed: still ours",
            from: at(Step::ConfirmDestroyed),
            event: Event::GuestObserved(ours(&m)),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: true,
            effects: &["journal"],
            code: Some(C::TaskFailed),
        },
        Row {
            name: "destroy unconfirmed: unreadable",
            from: at(Step::ConfirmDestroyed),
            event: Event::GuestObserved(unreadable()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: true,
            effects: &["journal"],
            code: Some(C::OwnershipUnproven),
        },
    ];
    // Every allowed (step, event kind) pair has at least one row.
    for (st, kind) in ALLOWED {
        assert!(
            rows.iter()
                .any(|r| r.from.step() == *st && r.event.kind() == *kind),
            "no row for ({st}, {kind})"
        );
    }
    for row in rows {
        check(row);
    }
}

#[test]
fn happy_path_emits_the_effects_in_order_and_ends_destroyed_ok() {
    let mut s = State::new(request(GuestKind::Lxc, false, false));
    let mut all = Vec::new();
    while !s.is_terminal() {
        let e = towards(&s, Step::Done);
        let (next, effects) = apply(&s, e);
        all.extend(names(&effects).into_iter().filter(|n| *n != "journal"));
        s = next;
    }
    assert_eq!(
        all,
        [
            "submit_restore",
            "wait_task",
            "write_marker",
            "verify_marker",
            "start",
            "prove_launch",
            "wait_boot",
            "bootstrap",
            "run_checks",
            "report",
            "recheck_ownership",
            "destroy",
            "confirm_destroyed",
        ]
    );
    let out = s.outcome().expect("settled");
    assert_eq!(out.outcome, OutcomeKind::Ok);
    assert_eq!(out.phase, Phase::Destroyed);
    assert_eq!(out.reached, Phase::Reported);
    assert!(out.destroy_armed && out.destroyed);
    assert_eq!(out.exit_status(), ExitStatus::Ok);
    assert_eq!(out.error, None);
}

#[test]
fn an_isolated_container_is_restored_without_unique_everything_else_with_it() {
    for (guest, isolate, unique) in [
        (GuestKind::Lxc, true, false),
        (GuestKind::Lxc, false, true),
        (GuestKind::Qemu, true, true),
        (GuestKind::Qemu, false, true),
    ] {
        let mut req = request(guest, false, false);
        req.isolate_network = isolate;
        let (_, effects) = apply(&State::new(req), Event::VmidAccepted);
        assert!(
            matches!(&effects[1], Effect::SubmitRestore { unique: u, isolate_network: i, .. } if *u == unique && *i == isolate),
            "{guest:?} isolate={isolate}: {:?}",
            effects[1]
        );
    }
}

#[test]
fn submit_effect_carries_the_request_and_is_unique_for_a_vm() {
    let mut req = request(GuestKind::Qemu, false, false);
    req.kind = TxnKind::SelftestRestore;
    req.isolate_network = true;
    let (_, effects) = apply(&State::new(req), Event::VmidAccepted);
    assert_eq!(
        effects[1],
        Effect::SubmitRestore {
            vmid: VMID,
            guest: GuestKind::Qemu,
            volid: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
            storage: "local-lvm".to_string(),
            pool: "felhom".to_string(),
            unique: true,
            isolate_network: true,
        }
    );
}

#[test]
fn the_upid_is_journaled_before_the_task_is_waited_for() {
    let (s, effects) = apply(
        &at(Step::Submit),
        Event::Submitted {
            upid: UPID.to_string(),
        },
    );
    assert_eq!(s.upid(), Some(UPID));
    match (&effects[0], &effects[1]) {
        (Effect::Journal(j), Effect::WaitTask { upid }) => {
            assert_eq!(j.upid(), Some(UPID));
            assert!(!j.task_ok());
            assert_eq!(upid, UPID);
        }
        other => panic!("unexpected effects {other:?}"),
    }
}

#[test]
fn failing_checks_destroy_the_own_guest_and_exit_5() {
    let s = at(Step::Checks);
    let m = s.marker();
    let (s, _) = apply(
        &s,
        Event::ChecksFailed {
            message: "nginx not running".to_string(),
        },
    );
    let (s, effects) = apply(&s, Event::GuestObserved(ours(&m)));
    assert_eq!(
        effects[1],
        Effect::Destroy {
            vmid: VMID,
            guest: GuestKind::Lxc
        }
    );
    let (s, _) = apply(&s, Event::DestroyEnded(TaskExit::Ok));
    let (s, _) = apply(&s, Event::GuestObserved(GuestView::Absent));
    let out = s.outcome().expect("settled");
    assert_eq!(out.outcome, OutcomeKind::Failed);
    assert_eq!(out.phase, Phase::Destroyed);
    assert_eq!(out.reached, Phase::Bootstrapped);
    assert!(out.destroyed);
    assert_eq!(
        out.error.as_ref().map(|e| e.code),
        Some(ErrorCode::CheckFailed)
    );
    assert_eq!(out.exit_status().code(), 5);
}

#[test]
fn a_collision_arms_nothing_and_exits_4() {
    let (s, effects) = apply(
        &at(Step::Submit),
        Event::SubmitRefused(failure(
            ErrorCode::PveRefused,
            "CT 120 already exists on node 'pve1'",
        )),
    );
    assert!(!effects.iter().any(|e| matches!(e, Effect::Destroy { .. })));
    let out = s.outcome().expect("settled");
    assert_eq!(out.outcome, OutcomeKind::Failed);
    assert!(!out.destroy_armed && !out.destroyed);
    assert_eq!(s.upid(), None);
    assert_eq!(out.exit_status().code(), 4);
}

#[test]
fn outcomes_map_to_the_design_exit_statuses() {
    let refused = apply(
        &at(Step::Validate),
        Event::VmidRefused(failure(ErrorCode::VmidInUse, "vmid 120 is in use")),
    )
    .0;
    assert_eq!(refused.outcome().map(|o| o.exit_status().code()), Some(3));
    let skipped = apply(
        &at(Step::Validate),
        Event::BandFull {
            message: "full".to_string(),
        },
    )
    .0;
    assert_eq!(skipped.outcome().map(|o| o.exit_status().code()), Some(0));
    let human = apply(
        &at(Step::Recheck),
        Event::GuestObserved(ours_locked(&Marker::new(txn()), "backup")),
    )
    .0;
    // guest_locked alone would be 4; needs_human wins.
    assert_eq!(human.outcome().map(|o| o.exit_status().code()), Some(7));
    let launch = apply(
        &at_with(Step::ProveLaunch, GuestKind::Lxc, true),
        Event::LaunchUnproven {
            message: "not running".to_string(),
        },
    )
    .0;
    assert_eq!(launch.outcome().map(|o| o.exit_status().code()), Some(5));
}

#[test]
fn dry_run_plans_every_call_and_writes_nothing() {
    for keep in [false, true] {
        let (s, effects) = apply(
            &State::new(request(GuestKind::Lxc, keep, true)),
            Event::VmidAccepted,
        );
        assert_eq!(effects.len(), 1);
        let json = serde_json::to_value(&effects[0]).expect("plan serializes");
        assert_eq!(json["effect"], "plan");
        assert_eq!(json["steps"][0]["call"], "restore");
        let Effect::Plan { steps: plan } = &effects[0] else {
            panic!("expected a plan, got {effects:?}");
        };
        assert!(matches!(plan[0], PlanStep::Restore { unique: true, .. }));
        let last = plan.last().cloned();
        let expected = if keep {
            PlanStep::KeepGuest
        } else {
            PlanStep::GatedDestroy
        };
        assert_eq!(last, Some(expected));
        assert_eq!(s.outcome_kind(), Some(OutcomeKind::Ok));
        assert!(s.upid().is_none());
    }
}

#[test]
fn needs_human_messages_name_the_vmid_and_the_command() {
    let (s, _) = apply(&at(Step::ProbeLeftover), Event::GuestObserved(unreadable()));
    let msg = s.failure().map(|f| f.message.clone()).unwrap_or_default();
    assert!(
        msg.contains("qm destroy 120 --destroy-unreferenced-disks 0"),
        "{msg}"
    );
    assert!(msg.contains(&txn().to_string()), "{msg}");
    let (s, _) = apply(&at(Step::Recheck), Event::GuestObserved(not_ours()));
    let msg = s.failure().map(|f| f.message.clone()).unwrap_or_default();
    assert!(msg.contains("guest 120"), "{msg}");
    assert!(msg.contains("pct config 120"), "{msg}");
    // A failed container restore that left the container behind.
    let (s, _) = apply(
        &at_with(Step::ProbeLeftover, GuestKind::Lxc, false),
        Event::GuestObserved(unreadable()),
    );
    let msg = s.failure().map(|f| f.message.clone()).unwrap_or_default();
    assert!(msg.contains("left CT 120 behind"), "{msg}");
    assert!(
        msg.contains("pct destroy 120 --destroy-unreferenced-disks 0"),
        "{msg}"
    );
    // An unknown answer: a guest without our task, and no guest but no readable task list.
    for guest in [unreadable(), not_ours(), GuestView::Absent] {
        let (s, _) = apply(
            &at(Step::ProbeSubmit),
            Event::SubmitProbed(SubmitProbe::Unproven {
                guest: guest.clone(),
                detail: "no task".to_string(),
            }),
        );
        assert_eq!(s.outcome_kind(), Some(OutcomeKind::NeedsHuman), "{guest:?}");
        let msg = s.failure().map(|f| f.message.clone()).unwrap_or_default();
        assert!(msg.contains("pvenode task list --vmid 120"), "{msg}");
        assert!(msg.contains("pct config 120"), "{msg}");
        assert!(
            msg.contains("pct destroy 120 --destroy-unreferenced-disks 0"),
            "{msg}"
        );
        assert!(msg.contains(&txn().to_string()), "{msg}");
    }
}

// ----- the marker -----

#[test]
fn marker_tags_are_lowercase_and_match_case_insensitively() {
    let m = Marker::new(txn());
    let tag = m.txn_tag();
    assert!(tag.starts_with("felhom-"));
    assert_eq!(tag, tag.to_ascii_lowercase());
    let line = m.description_line();
    assert!(m.is_carried_by(&format!("FELHOM,{}", tag.to_uppercase()), &line));
    assert!(m.is_carried_by(&format!("web {tag};felhom"), &format!("a\n  {line}  \nb")));
    assert!(!m.is_carried_by(&tag, &line), "fleet tag missing");
    assert!(!m.is_carried_by("felhom", &line), "txn tag missing");
    assert!(!m.is_carried_by(&format!("felhom;{tag}"), "someone else"));
    let other = Marker::new(other_txn());
    assert!(!other.is_carried_by(&format!("felhom;{tag}"), &line));
    assert!(!m.is_carried_by(&format!("felhom;{tag}x"), &line));
}

#[test]
fn merged_tags_and_description_keep_what_was_there() {
    let m = Marker::new(txn());
    let tags = m.merged_tags("web;FELHOM");
    assert_eq!(tags, format!("web;FELHOM;{}", m.txn_tag()));
    let desc = m.merged_description("customer notes");
    assert!(m.is_carried_by(&tags, &desc));
    assert!(desc.ends_with("customer notes"));
    assert_eq!(m.merged_description(&desc), desc, "idempotent");
    let long = "x".repeat(DESCRIPTION_MAX_CHARS * 2);
    let cut = m.merged_description(&long);
    assert_eq!(cut.chars().count(), DESCRIPTION_MAX_CHARS);
    assert!(m.is_carried_by(&tags, &cut));
}

// ----- the gated destroy command -----

fn settled_kept() -> State {
    let s = at_with(Step::Report, GuestKind::Lxc, true);
    apply(&s, Event::ReportQueued).0
}

#[test]
fn destroy_command_inherits_the_proof_and_rechecks_first() {
    let origin = settled_kept();
    let new_txn = other_txn();
    let (s, effects) = State::for_destroy(new_txn, VMID, GuestKind::Qemu, Some(&origin));
    assert_eq!(names(&effects), ["journal", "recheck_ownership"]);
    assert_eq!(s.kind(), TxnKind::Destroy);
    assert_eq!(s.txn(), new_txn);
    assert_eq!(s.marker(), origin.marker());
    assert_eq!(s.request().guest, GuestKind::Lxc, "the origin's type wins");
    let (s, effects) = apply(&s, Event::GuestObserved(ours(&origin.marker())));
    assert_eq!(names(&effects), ["journal", "destroy"]);
    let (s, _) = apply(&s, Event::DestroyEnded(TaskExit::Ok));
    let (s, _) = apply(&s, Event::GuestObserved(GuestView::Absent));
    assert_eq!(s.outcome_kind(), Some(OutcomeKind::Ok));
    assert!(s.destroyed());
}

#[test]
fn destroy_command_without_proof_is_refused_with_exit_7_and_sends_nothing() {
    let unproven = apply(
        &at(Step::Submit),
        Event::SubmitRefused(failure(ErrorCode::PveRefused, "CT 120 already exists")),
    )
    .0;
    let destroyed = drive(at(Step::Report), Step::Done);
    assert!(destroyed.destroyed());
    let open = at(Step::Checks);
    let cases: Vec<(&str, Option<&State>, u32)> = vec![
        ("no journal entry", None, VMID),
        ("never armed", Some(&unproven), VMID),
        ("already destroyed", Some(&destroyed), VMID),
        ("still open", Some(&open), VMID),
        ("other vmid", Some(&open), 121),
    ];
    for (name, origin, vmid) in cases {
        let (s, effects) = State::for_destroy(other_txn(), vmid, GuestKind::Lxc, origin);
        // The refusal is journaled; nothing else is done.
        assert!(
            effects.len() == 1 && matches!(effects[0], Effect::Journal(_)),
            "{name}: {effects:?}"
        );
        let out = s.outcome().expect("settled");
        assert_eq!(out.outcome, OutcomeKind::Refused, "{name}");
        assert_eq!(
            out.error.as_ref().map(|e| e.code),
            Some(ErrorCode::OwnershipUnproven),
            "{name}"
        );
        assert_eq!(out.exit_status().code(), 7, "{name}");
    }
}

// ----- recovery -----

fn obs(task: TaskObservation, guest: GuestView) -> RecoveryObservation {
    RecoveryObservation { task, guest }
}

fn running() -> TaskObservation {
    TaskObservation::Running
}

struct RecoveryRow {
    name: &'static str,
    from: State,
    observed: RecoveryObservation,
    phase: Phase,
    step: Step,
    outcome: Option<OutcomeKind>,
    armed: bool,
    effects: &'static [&'static str],
}

#[test]
fn recovery_settles_every_open_step() {
    use OutcomeKind as O;
    let m = Marker::new(txn());
    let qemu_task = at_with(Step::Task, GuestKind::Qemu, false);
    let task_err = || TaskObservation::Error {
        message: "unable to restore".to_string(),
    };
    let rows = vec![
        RecoveryRow {
            // The full list alone never says nothing was created: the task list is searched.
            name: "before submit answer, nothing there: search the task list",
            from: at(Step::Submit),
            observed: obs(running(), GuestView::Absent),
            phase: Phase::Failed,
            step: Step::ProbeSubmit,
            outcome: None,
            armed: false,
            effects: &["journal", "find_own_task"],
        },
        RecoveryRow {
            name: "before submit answer, a guest there: search the task list",
            from: at(Step::Submit),
            observed: obs(running(), ours(&m)),
            phase: Phase::Failed,
            step: Step::ProbeSubmit,
            outcome: None,
            armed: false,
            effects: &["journal", "find_own_task"],
        },
        RecoveryRow {
            name: "lost answer search interrupted: search again",
            from: at(Step::ProbeSubmit),
            observed: obs(running(), unreadable()),
            phase: Phase::Failed,
            step: Step::ProbeSubmit,
            outcome: None,
            armed: false,
            effects: &["journal", "find_own_task"],
        },
        RecoveryRow {
            name: "task still running: follow it",
            from: at(Step::Task),
            observed: obs(running(), unreadable()),
            phase: Phase::Failed,
            step: Step::Task,
            outcome: None,
            armed: false,
            effects: &["journal", "wait_task"],
        },
        RecoveryRow {
            name: "task ended ok while stopped, the restore's description line there",
            from: at(Step::Task),
            observed: obs(TaskObservation::Ok, described(&m)),
            phase: Phase::Failed,
            step: Step::WriteMarker,
            outcome: None,
            armed: false,
            effects: &["journal", "write_marker"],
        },
        RecoveryRow {
            name: "task ended ok while stopped: unproven",
            from: at(Step::Task),
            observed: obs(TaskObservation::Ok, not_ours()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "task ended ok while stopped, guest gone",
            from: at(Step::StopTask),
            observed: obs(TaskObservation::Ok, GuestView::Absent),
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: false,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "lxc task error",
            from: at(Step::Task),
            observed: obs(task_err(), GuestView::Absent),
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: false,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "lxc task error with the container left outside the pool",
            from: at(Step::Task),
            observed: obs(task_err(), unreadable()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "qemu task error with a leftover",
            from: qemu_task.clone(),
            observed: obs(task_err(), unreadable()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "qemu task error, nothing left",
            from: qemu_task,
            observed: obs(task_err(), GuestView::Absent),
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: false,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "task status unknown, guest there",
            from: at(Step::Task),
            observed: obs(
                TaskObservation::Unknown {
                    message: "no such task".to_string(),
                },
                not_ours(),
            ),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "leftover probe, leftover there",
            from: at(Step::ProbeLeftover),
            observed: obs(task_err(), not_ours()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "task ok journaled, marker not written",
            from: at(Step::WriteMarker),
            observed: obs(TaskObservation::Ok, not_ours()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "task ok journaled, marker present: arm and clean up",
            from: at(Step::VerifyMarker),
            observed: obs(TaskObservation::Ok, ours(&m)),
            phase: Phase::Failed,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
        },
        RecoveryRow {
            name: "armed, ours: clean up through a recheck",
            from: at(Step::Bootstrap),
            observed: obs(TaskObservation::Ok, ours(&m)),
            phase: Phase::Failed,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
        },
        RecoveryRow {
            name: "armed, keep: kept",
            from: at_with(Step::Checks, GuestKind::Lxc, true),
            observed: obs(TaskObservation::Ok, ours(&m)),
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: true,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "armed, marker gone: never destroyed",
            from: at(Step::Start),
            observed: obs(TaskObservation::Ok, not_ours()),
            phase: Phase::NeedsHuman,
            step: Step::Done,
            outcome: Some(O::NeedsHuman),
            armed: false,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "armed, guest gone",
            from: at(Step::ProveLaunch),
            observed: obs(TaskObservation::Ok, GuestView::Absent),
            phase: Phase::Failed,
            step: Step::Done,
            outcome: Some(O::Failed),
            armed: false,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "verified, not reported",
            from: at(Step::Report),
            observed: obs(TaskObservation::Ok, ours(&m)),
            phase: Phase::Verified,
            step: Step::Report,
            outcome: None,
            armed: true,
            effects: &["journal", "report"],
        },
        RecoveryRow {
            name: "cleanup pending: fresh recheck",
            from: at(Step::Recheck),
            observed: obs(TaskObservation::Ok, ours(&m)),
            phase: Phase::Reported,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
        },
        RecoveryRow {
            name: "destroy sent, guest gone",
            from: at(Step::Destroy),
            observed: obs(TaskObservation::Ok, GuestView::Absent),
            phase: Phase::Destroyed,
            step: Step::Done,
            outcome: Some(O::Ok),
            armed: true,
            effects: &["journal"],
        },
        RecoveryRow {
            name: "destroy task still running",
            from: at(Step::Destroy),
            observed: obs(TaskObservation::Ok, ours_locked(&m, "destroyed")),
            phase: Phase::Reported,
            step: Step::ConfirmDestroyed,
            outcome: None,
            armed: true,
            effects: &["journal", "confirm_destroyed"],
        },
        RecoveryRow {
            name: "destroy not done: recheck again",
            from: at(Step::Destroy),
            observed: obs(TaskObservation::Ok, ours(&m)),
            phase: Phase::Reported,
            step: Step::Recheck,
            outcome: None,
            armed: true,
            effects: &["journal", "recheck_ownership"],
        },
        // Mid-destroy the guest has left the pool before its config goes: it is read again
        // until gone (the confirmation's own deadline hands it to a person after that).
        RecoveryRow {
            name: "confirming, unreadable",
            from: at(Step::ConfirmDestroyed),
            observed: obs(TaskObservation::Ok, unreadable()),
            phase: Phase::Reported,
            step: Step::ConfirmDestroyed,
            outcome: None,
            armed: true,
            effects: &["journal", "confirm_destroyed"],
        },
        RecoveryRow {
            name: "destroying, unreadable",
            from: at(Step::Destroy),
            observed: obs(TaskObservation::Ok, unreadable()),
            phase: Phase::Reported,
            step: Step::ConfirmDestroyed,
            outcome: None,
            armed: true,
            effects: &["journal", "confirm_destroyed"],
        },
    ];
    for row in rows {
        let n = row.name;
        let (s, effects) = recover(&row.from, &row.observed);
        assert_eq!(s.phase(), row.phase, "{n}: phase");
        assert_eq!(s.step(), row.step, "{n}: step");
        assert_eq!(s.outcome_kind(), row.outcome, "{n}: outcome");
        assert_eq!(s.destroy_armed(), row.armed, "{n}: armed");
        assert_eq!(names(&effects), row.effects, "{n}: effects");
        assert!(s.recovered(), "{n}: recovered flag");
        if s.outcome_kind() == Some(O::NeedsHuman) {
            let msg = s.failure().map(|f| f.message.clone()).unwrap_or_default();
            assert!(msg.contains("120"), "{n}: message names the vmid: {msg}");
        }
    }
}

#[test]
fn recovery_leaves_a_settled_transaction_alone() {
    let done = drive(at(Step::Report), Step::Done);
    let (s, effects) = recover(&done, &obs(TaskObservation::Ok, not_ours()));
    assert_eq!(s, done);
    assert!(effects.is_empty());
}

#[test]
fn a_followed_task_after_a_crash_ends_in_a_gated_cleanup() {
    let m = Marker::new(txn());
    let (s, _) = recover(&at(Step::Task), &obs(running(), unreadable()));
    let (s, effects) = apply(
        &s,
        Event::TaskEnded {
            upid: UPID.to_string(),
            exit: TaskExit::Ok,
        },
    );
    assert_eq!(names(&effects), ["journal", "write_marker"]);
    let (s, _) = apply(&s, Event::MarkerWritten);
    let (s, effects) = apply(&s, Event::GuestObserved(ours(&m)));
    assert_eq!(names(&effects), ["journal", "recheck_ownership"]);
    let (s, effects) = apply(&s, Event::GuestObserved(ours(&m)));
    assert_eq!(names(&effects), ["journal", "destroy"]);
    let (s, _) = apply(&s, Event::DestroyEnded(TaskExit::Ok));
    let (s, _) = apply(&s, Event::GuestObserved(GuestView::Absent));
    let out = s.outcome().expect("settled");
    assert_eq!(
        (out.outcome, out.phase),
        (OutcomeKind::Failed, Phase::Destroyed)
    );
    assert_eq!(out.error.map(|e| e.code), Some(ErrorCode::TaskFailed));
}

#[test]
fn journaled_state_round_trips_through_json() {
    let s = at(Step::Checks);
    let text = serde_json::to_string(&s).expect("serialize");
    let back: State = serde_json::from_str(&text).expect("deserialize");
    assert_eq!(back, s);
    assert!(text.contains("\"phase\":\"bootstrapped\""), "{text}");
    assert!(text.contains("\"kind\":\"selftest-provision\""), "{text}");
}

#[test]
fn effects_and_the_outcome_serialize_for_json_output() {
    let mut s = State::new(request(GuestKind::Lxc, false, false));
    let mut seen = Vec::new();
    while !s.is_terminal() {
        let (next, effects) = apply(&s, towards(&s, Step::Done));
        for e in &effects {
            let v = serde_json::to_value(e).expect("effect serializes");
            seen.push(v["effect"].as_str().map(str::to_string));
        }
        s = next;
    }
    assert!(seen.contains(&Some("destroy".to_string())));
    assert!(seen.contains(&Some("journal".to_string())));
    let out = serde_json::to_value(s.outcome().expect("settled")).expect("outcome json");
    assert_eq!(out["outcome"], "ok");
    assert_eq!(out["phase"], "destroyed");
    assert_eq!(out["destroy_armed"], true);
    assert_eq!(out["destroyed"], true);
    assert_eq!(out["vmid"], VMID);
    assert_eq!(out["kind"], "selftest-provision");
    assert_eq!(out["txn"], txn().to_string());
    assert!(out["error"].is_null());
    let refused = apply(
        &at(Step::Validate),
        Event::VmidRefused(failure(ErrorCode::VmidInUse, "vmid 120 is in use")),
    )
    .0;
    let out = serde_json::to_value(refused.outcome().expect("settled")).expect("json");
    assert_eq!(out["outcome"], "refused");
    assert_eq!(out["error"]["code"], "vmid_in_use");
}

// ----- property: the gate -----

#[derive(Debug, Clone)]
struct Data {
    view: usize,
    ours_upid: bool,
    exit_ok: bool,
    task: usize,
}

#[derive(Debug, Clone)]
enum Action {
    /// An event the current step accepts (index into its allowed kinds).
    Guided(usize, Data),
    /// Any event kind.
    Random(usize, Data),
    /// A crash, then recovery with this observation.
    Crash(Data),
}

fn view_for(i: usize, m: &Marker) -> GuestView {
    match i % 8 {
        0 => ours(m),
        1 => ours_locked(m, "backup"),
        2 => ours_locked(m, "destroyed"),
        3 => GuestView::Absent,
        4 => not_ours(),
        5 => GuestView::Present {
            tags: "felhom".to_string(),
            description: m.description_line(),
            lock: None,
            identity: born(),
        },
        6 => GuestView::Present {
            tags: m.tags().join(";"),
            description: String::new(),
            lock: None,
            identity: born(),
        },
        _ => unreadable(),
    }
}

fn build(kind: EventKind, d: &Data, s: &State) -> Event {
    let upid = if d.ours_upid {
        s.upid().unwrap_or(UPID).to_string()
    } else {
        OTHER_UPID.to_string()
    };
    let exit = if d.exit_ok {
        TaskExit::Ok
    } else {
        TaskExit::Error {
            message: "failed".to_string(),
        }
    };
    match kind {
        EventKind::Submitted => Event::Submitted { upid },
        EventKind::TaskEnded => Event::TaskEnded { upid, exit },
        EventKind::TaskWaitTimedOut => Event::TaskWaitTimedOut { upid },
        EventKind::GuestObserved => Event::GuestObserved(view_for(d.view, &s.marker())),
        EventKind::DestroyEnded => Event::DestroyEnded(exit),
        EventKind::SubmitProbed => Event::SubmitProbed(match d.task % 3 {
            0 => SubmitProbe::OwnTask { upid },
            1 => SubmitProbe::Nothing { waited_secs: 30 },
            _ => SubmitProbe::Unproven {
                guest: view_for(d.view, &s.marker()),
                detail: "no task".to_string(),
            },
        }),
        other => sample(other, s),
    }
}

fn task_obs(i: usize) -> TaskObservation {
    match i % 4 {
        0 => TaskObservation::Running,
        1 => TaskObservation::Ok,
        2 => TaskObservation::Error {
            message: "failed".to_string(),
        },
        _ => TaskObservation::Unknown {
            message: "no such task".to_string(),
        },
    }
}

fn arb_data() -> impl Strategy<Value = Data> {
    (0usize..8, any::<bool>(), any::<bool>(), 0usize..4).prop_map(
        |(view, ours_upid, exit_ok, task)| Data {
            view,
            ours_upid,
            exit_ok,
            task,
        },
    )
}

fn arb_action() -> impl Strategy<Value = Action> {
    prop_oneof![
        8 => (0usize..4, arb_data()).prop_map(|(i, d)| Action::Guided(i, d)),
        2 => (0usize..EventKind::ALL.len(), arb_data()).prop_map(|(i, d)| Action::Random(i, d)),
        1 => arb_data().prop_map(Action::Crash),
    ]
}

/// What the test itself saw happen, independent of the machine's own flags.
#[derive(Default)]
struct History {
    submitted: Option<String>,
    own_task_ok: bool,
    marker_read_after_ok: bool,
}

fn run(req: Request, actions: &[Action]) -> Result<(), TestCaseError> {
    let mut s = State::new(req);
    let mut h = History::default();
    for action in actions {
        let invariant =
            !s.destroy_armed() || (s.task_ok() && s.marker_confirmed() && s.upid().is_some());
        prop_assert!(invariant, "armed without proof: {s:?}");
        match action {
            Action::Crash(d) => {
                let observed = obs(task_obs(d.task), view_for(d.view, &s.marker()));
                let (next, effects) = recover(&s, &observed);
                prop_assert!(
                    !effects.iter().any(|e| matches!(e, Effect::Destroy { .. })),
                    "recover emitted a destroy"
                );
                // The observed status is that of the UPID this transaction recorded.
                if observed.task == TaskObservation::Ok
                    && matches!(s.step(), Step::Task | Step::StopTask)
                    && s.upid().is_some()
                    && h.submitted.as_deref() == s.upid()
                {
                    h.own_task_ok = true;
                }
                if observed.guest.carries(&s.marker()) && h.own_task_ok {
                    h.marker_read_after_ok = true;
                }
                s = next;
            }
            Action::Guided(_, d) | Action::Random(_, d) => {
                let kind = match action {
                    Action::Guided(i, _) => {
                        let allowed: Vec<EventKind> = ALLOWED
                            .iter()
                            .filter(|(st, _)| *st == s.step())
                            .map(|(_, k)| *k)
                            .collect();
                        if allowed.is_empty() {
                            continue;
                        }
                        allowed[i % allowed.len()]
                    }
                    Action::Random(i, _) => EventKind::ALL[i % EventKind::ALL.len()],
                    Action::Crash(_) => continue,
                };
                let event = build(kind, d, &s);
                let Ok((next, effects)) = step(&s, event.clone()) else {
                    continue;
                };
                if effects.iter().any(|e| matches!(e, Effect::Destroy { .. })) {
                    let fresh_recheck = matches!(
                        &event,
                        Event::GuestObserved(GuestView::Present { lock: None, .. })
                    ) && matches!(&event, Event::GuestObserved(v) if s.proves(v));
                    // A re-check, or the re-read after the stop that precedes the DELETE.
                    prop_assert!(
                        matches!(s.step(), Step::Recheck | Step::Destroy),
                        "destroy from step {}",
                        s.step()
                    );
                    prop_assert!(fresh_recheck, "destroy without a fresh recheck: {event:?}");
                    prop_assert!(h.submitted.is_some(), "destroy without own UPID");
                    prop_assert!(h.own_task_ok, "destroy without own task OK");
                    prop_assert!(h.marker_read_after_ok, "destroy without marker read back");
                    prop_assert!(s.destroy_armed() && !s.request().keep);
                    for e in &effects {
                        if let Effect::Destroy { vmid, .. } = e {
                            prop_assert_eq!(Some(*vmid), s.vmid());
                        }
                    }
                }
                match &event {
                    Event::Submitted { upid }
                    | Event::SubmitProbed(SubmitProbe::OwnTask { upid }) => {
                        h.submitted = Some(upid.clone());
                    }
                    Event::TaskEnded {
                        upid,
                        exit: TaskExit::Ok,
                    } if h.submitted.as_deref() == Some(upid.as_str()) => h.own_task_ok = true,
                    Event::GuestObserved(v) if v.carries(&s.marker()) && h.own_task_ok => {
                        h.marker_read_after_ok = true;
                    }
                    _ => {}
                }
                s = next;
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn destroy_needs_own_upid_task_ok_marker_and_a_fresh_recheck(
        keep in any::<bool>(),
        qemu in any::<bool>(),
        actions in proptest::collection::vec(arb_action(), 0..60),
    ) {
        let guest = if qemu { GuestKind::Qemu } else { GuestKind::Lxc };
        run(request(guest, keep, false), &actions)?;
    }
}

#[test]
fn the_property_harness_reaches_destroy() {
    // Guard against a harness that never exercises the gate: the guided path with our UPID,
    // OK exits and our marker reaches a destroy.
    let d = Data {
        view: 0,
        ours_upid: true,
        exit_ok: true,
        task: 0,
    };
    let mut s = State::new(request(GuestKind::Lxc, false, false));
    let mut destroyed = false;
    for _ in 0..30 {
        let allowed: Vec<EventKind> = ALLOWED
            .iter()
            .filter(|(st, _)| *st == s.step())
            .map(|(_, k)| *k)
            .collect();
        let Some(kind) = allowed.first() else { break };
        let (next, effects) = apply(&s, build(*kind, &d, &s));
        destroyed |= effects.iter().any(|e| matches!(e, Effect::Destroy { .. }));
        s = next;
    }
    assert!(destroyed);
    assert!(run(
        request(GuestKind::Lxc, false, false),
        &vec![Action::Guided(0, d); 30]
    )
    .is_ok());
}

#[test]
fn failure_messages_are_clipped_on_a_character_boundary() {
    let short = "short".to_string();
    assert_eq!(clip_message(short.clone()), short);
    // One megabyte of guest output, in multi-byte characters.
    let long = "é".repeat(512 * 1024);
    let clipped = clip_message(long.clone());
    assert!(
        clipped.len() <= FAILURE_MESSAGE_MAX_BYTES,
        "{}",
        clipped.len()
    );
    assert!(clipped.starts_with("éé"));
    assert!(
        clipped.ends_with("more bytes clipped)"),
        "{}",
        &clipped[clipped.len() - 60..]
    );
}

#[test]
fn a_megabyte_of_check_output_is_clipped_and_the_cleanup_still_runs() {
    let s = at(Step::Checks);
    let m = s.marker();
    let (s, effects) = apply(
        &s,
        Event::ChecksFailed {
            message: format!("rows: {}", "x".repeat(1024 * 1024)),
        },
    );
    // The failure a journal record will carry is bounded, and the gated cleanup goes on.
    let message = &s.failure().expect("a failure").message;
    assert!(
        message.len() <= FAILURE_MESSAGE_MAX_BYTES,
        "{}",
        message.len()
    );
    assert!(
        matches!(&effects[0], Effect::Journal(j) if serde_json::to_vec(j).map(|b| b.len()).unwrap_or(usize::MAX) < 16 * 1024),
        "the journaled state stays small"
    );
    assert!(effects
        .iter()
        .any(|e| matches!(e, Effect::RecheckOwnership { .. })));
    let (s, effects) = apply(&s, Event::GuestObserved(ours(&m)));
    assert!(effects.iter().any(|e| matches!(e, Effect::Destroy { .. })));
    // A later failure appended to the first stays bounded too.
    let (s, _) = apply(
        &s,
        Event::DestroyEnded(TaskExit::Error {
            message: "y".repeat(1024 * 1024),
        }),
    );
    let message = &s.failure().expect("a failure").message;
    assert!(
        message.len() <= FAILURE_MESSAGE_MAX_BYTES,
        "{}",
        message.len()
    );
}

#[test]
fn a_dry_run_refusal_journals_nothing() {
    let lxc = GuestKind::Lxc;
    let (s, effects) = apply(
        &State::new(request(lxc, false, true)),
        Event::VmidRefused(failure(ErrorCode::VmidInUse, "vmid 120 is in use")),
    );
    assert!(effects.is_empty(), "{effects:?}");
    assert_eq!(s.outcome().map(|o| o.outcome), Some(OutcomeKind::Refused));
}

// ----- birth identity and disarm -----

/// A kept guest's settled, armed transaction (what `destroy -vmid` finds as its origin).
fn kept_origin() -> State {
    let s = drive(at_with(Step::Report, GuestKind::Lxc, true), Step::Done);
    assert!(s.destroy_armed() && s.is_terminal(), "{s:?}");
    s
}

fn destroy_from(origin: &State) -> (State, Vec<Effect>) {
    State::for_destroy(other_txn(), VMID, GuestKind::Lxc, Some(origin))
}

#[test]
fn the_marker_read_back_records_the_birth_identity_and_arms() {
    let s = at(Step::VerifyMarker);
    assert_eq!(s.identity(), None);
    let (s, effects) = apply(&s, Event::GuestObserved(ours(&s.marker())));
    assert_eq!(s.identity(), Some(&born()));
    assert!(s.destroy_armed());
    assert_eq!(names(&effects), ["journal", "start"]);
}

#[test]
fn only_the_identical_identity_proves_ownership() {
    let s = at(Step::Recheck);
    let m = s.marker();
    assert!(s.proves(&ours(&m)));
    assert!(!s.proves(&copy_of(&m)), "another MAC and vmgenid");
    // One NIC more (a hand-edited copy) is not the guest either.
    let mut extra = born();
    extra
        .nics
        .insert("net1".to_string(), "BC:24:11:00:00:99".to_string());
    let with_extra = GuestView::Present {
        tags: m.tags().join(";"),
        description: m.description_line(),
        lock: None,
        identity: extra,
    };
    assert!(!s.proves(&with_extra));
    // The identity without the marker is not the proof either.
    let bare = GuestView::Present {
        tags: String::new(),
        description: String::new(),
        lock: None,
        identity: born(),
    };
    assert!(!s.proves(&bare));
    assert!(!s.proves(&ours_locked(&m, "backup")));
}

#[test]
fn a_copy_at_the_recheck_disarms_and_destroys_nothing() {
    let s = at(Step::Recheck);
    let (s, effects) = apply(&s, Event::GuestObserved(copy_of(&s.marker())));
    assert_eq!(names(&effects), ["journal"]);
    assert_eq!(s.outcome_kind(), Some(OutcomeKind::NeedsHuman));
    assert!(!s.destroy_armed());
    let why = s.disarmed().expect("disarmed");
    assert!(why.contains("copy") && why.contains("vmgenid"), "{why}");
    let msg = &s.failure().expect("failure").message;
    assert!(
        msg.contains("120") && msg.contains("pct config 120"),
        "{msg}"
    );
}

#[test]
fn a_guest_gone_at_the_recheck_disarms() {
    let s = at(Step::Recheck);
    let (s, _) = apply(&s, Event::GuestObserved(GuestView::Absent));
    assert!(!s.destroy_armed());
    assert!(s.disarmed().is_some_and(|r| r.contains("gone")));
}

#[test]
fn destroy_of_a_kept_guest_needs_the_same_identity() {
    let origin = kept_origin();
    let (d, effects) = destroy_from(&origin);
    assert_eq!(names(&effects), ["journal", "recheck_ownership"]);
    assert_eq!(d.identity(), Some(&born()));
    let m = origin.marker();
    // The very guest: destroyed.
    let (_, effects) = apply(&d, Event::GuestObserved(ours(&m)));
    assert_eq!(names(&effects), ["journal", "destroy"]);
    // A copy carrying the marker: refused, exit 7, disarmed.
    let (after, effects) = apply(&d, Event::GuestObserved(copy_of(&m)));
    assert_eq!(names(&effects), ["journal"]);
    let out = after.outcome().expect("settled");
    assert_eq!(out.exit_status(), ExitStatus::NeedsHuman);
    assert!(after.disarmed().is_some());
    // Gone: refused with exit 7 (not "ok, nothing to do"), disarmed.
    let (gone, _) = apply(&d, Event::GuestObserved(GuestView::Absent));
    let out = gone.outcome().expect("settled");
    assert_eq!(out.outcome, OutcomeKind::Refused);
    assert_eq!(out.exit_status(), ExitStatus::NeedsHuman);
    assert!(gone.disarmed().is_some_and(|r| r.contains("gone")));
    // The origin, disarmed with that reason, proves nothing any more.
    let withdrawn = origin.disarmed_by(gone.disarmed().unwrap_or_default());
    assert!(!withdrawn.destroy_armed());
    let (refused, effects) = destroy_from(&withdrawn);
    assert_eq!(names(&effects), ["journal"]);
    assert_eq!(refused.outcome_kind(), Some(OutcomeKind::Refused));
    // So does the destroy transaction itself, the next one's origin.
    let (refused, effects) = destroy_from(&gone);
    assert_eq!(names(&effects), ["journal"]);
    assert_eq!(refused.outcome_kind(), Some(OutcomeKind::Refused));
}

#[test]
fn destroy_refuses_an_origin_with_an_empty_or_no_identity() {
    let origin = kept_origin();
    let mut json = serde_json::to_value(&origin).expect("serialize");
    json["identity"] = serde_json::json!({"nics": {}});
    let empty: State = serde_json::from_value(json.clone()).expect("deserialize");
    let (s, effects) = destroy_from(&empty);
    assert_eq!(names(&effects), ["journal"]);
    let msg = &s.failure().expect("failure").message;
    assert!(
        msg.contains("empty birth identity") && msg.contains("pct destroy 120"),
        "{msg}"
    );
    // A journal written before birth identities were recorded.
    json.as_object_mut().expect("object").remove("identity");
    let old: State = serde_json::from_value(json).expect("deserialize");
    assert_eq!(old.identity(), None);
    let (s, effects) = destroy_from(&old);
    assert_eq!(names(&effects), ["journal"]);
    assert_eq!(
        s.outcome().expect("settled").exit_status(),
        ExitStatus::NeedsHuman
    );
}

#[test]
fn a_later_free_verdict_voids_the_claim() {
    // A later transaction that found the vmid free (then PVE refused its restore).
    let later = drive(at(Step::Submit), Step::Submit);
    let (later, _) = apply(
        &later,
        Event::SubmitRefused(failure(ErrorCode::PveRefused, "storage full")),
    );
    assert!(later.upid().is_none());
    let (s, effects) = destroy_from(&later);
    assert_eq!(names(&effects), ["journal"]);
    let msg = &s.failure().expect("failure").message;
    assert!(msg.contains("free"), "{msg}");
}

#[test]
fn settling_an_armed_transaction_whose_guest_is_a_copy_disarms_it() {
    let s = at(Step::ProveLaunch);
    assert!(s.destroy_armed());
    let (s, effects) = recover(&s, &obs(TaskObservation::Ok, copy_of(&s.marker())));
    assert_eq!(names(&effects), ["journal"]);
    assert_eq!(s.outcome_kind(), Some(OutcomeKind::NeedsHuman));
    assert!(!s.destroy_armed());
    assert!(s.disarmed().is_some_and(|r| r.contains("copy")));
}

#[test]
fn a_crash_before_the_marker_write_settles_through_the_gate_on_the_description_line() {
    let s = at(Step::WriteMarker);
    let (s, effects) = recover(&s, &obs(TaskObservation::Ok, described(&s.marker())));
    assert_eq!(names(&effects), ["journal", "write_marker"]);
    let (s, _) = apply(&s, Event::MarkerWritten);
    let (s, effects) = apply(&s, Event::GuestObserved(ours(&s.marker())));
    // Armed with the identity read back, then the gated cleanup.
    assert_eq!(s.identity(), Some(&born()));
    assert_eq!(names(&effects), ["journal", "recheck_ownership"]);
    let (_, effects) = apply(&s, Event::GuestObserved(ours(&s.marker())));
    assert_eq!(names(&effects), ["journal", "destroy"]);
    // A guest without the description line there stays a human's call.
    let s = at(Step::WriteMarker);
    let (s, effects) = recover(&s, &obs(TaskObservation::Ok, not_ours()));
    assert_eq!(names(&effects), ["journal"]);
    assert_eq!(s.outcome_kind(), Some(OutcomeKind::NeedsHuman));
}

// ----- after the fact: journal refresh and resolve -----

/// A transaction settled `needs_human`: a leftover at the vmid it cannot prove is its own.
fn settled_needs_human() -> State {
    let (s, _) = recover(&at(Step::ProbeLeftover), &obs(running(), not_ours()));
    assert_eq!(s.outcome_kind(), Some(OutcomeKind::NeedsHuman));
    s
}

#[test]
fn a_refresh_withdraws_a_kept_claim_only_when_the_proof_is_gone() {
    let origin = settled_kept();
    let m = origin.marker();
    assert!(origin.holds_claim());
    assert_eq!(origin.finding(&ours(&m)), Finding::PresentWithProof);
    assert!(origin.refreshed(&ours(&m), "t".into()).is_none());
    assert!(origin
        .refreshed(&ours_locked(&m, "backup"), "t".into())
        .is_none());
    for (view, says, finding) in [
        (
            GuestView::Absent,
            "not in the full guest list",
            Finding::Absent,
        ),
        (copy_of(&m), "a copy", Finding::PresentWithoutProof),
        (
            not_ours(),
            "no longer showed marker",
            Finding::PresentWithoutProof,
        ),
        (
            unreadable(),
            "could not be read",
            Finding::PresentWithoutProof,
        ),
    ] {
        assert_eq!(origin.finding(&view), finding, "{view:?}");
        let next = origin
            .refreshed(&view, "2026-11-30T00:00:00Z".into())
            .unwrap_or_else(|| panic!("{view:?} withdraws the claim"));
        assert!(!next.destroy_armed() && !next.holds_claim(), "{view:?}");
        let why = next.disarmed().unwrap_or_default();
        assert!(
            why.contains(says) && why.contains("journal refresh"),
            "{why}"
        );
        assert!(
            next.resolution().is_none(),
            "a kept guest is not a needs_human"
        );
        // Withdrawn for good: a later refresh changes nothing, a destroy is refused.
        assert!(next.refreshed(&ours(&m), "t".into()).is_none());
        let (d, effects) = State::for_destroy(other_txn(), VMID, GuestKind::Lxc, Some(&next));
        assert_eq!(d.outcome_kind(), Some(OutcomeKind::Refused));
        assert!(!names(&effects).contains(&"destroy"), "{effects:?}");
    }
}

#[test]
fn a_refresh_never_changes_an_open_transaction() {
    for target in [Step::Task, Step::WriteMarker, Step::Start, Step::Checks] {
        let s = at(target);
        for view in [GuestView::Absent, not_ours(), unreadable()] {
            assert!(
                s.refreshed(&view, "t".into()).is_none(),
                "{target:?} {view:?}"
            );
        }
    }
}

#[test]
fn a_needs_human_is_closed_once_by_an_operator_or_by_a_refresh_that_sees_it_gone() {
    let s = settled_needs_human();
    assert!(s.awaits_human());
    // Still there: a refresh leaves it to the human.
    assert!(s.refreshed(&not_ours(), "t".into()).is_none());

    let closed = s
        .resolved(
            ResolvedBy::Operator,
            "removed by hand\n",
            "2026-11-30T00:00:00Z".into(),
        )
        .expect("closes");
    let r = closed.resolution().expect("resolution");
    assert_eq!(r.by, ResolvedBy::Operator);
    assert_eq!(r.reason, "removed by hand");
    assert_eq!(r.at, "2026-11-30T00:00:00Z");
    assert_eq!(closed.outcome_kind(), Some(OutcomeKind::NeedsHuman));
    assert!(!closed.awaits_human());
    assert!(closed
        .resolved(ResolvedBy::Operator, "again", "t".into())
        .is_none());
    assert!(closed.refreshed(&GuestView::Absent, "t".into()).is_none());
    // Only a needs_human can be closed.
    assert!(settled_kept()
        .resolved(ResolvedBy::Operator, "x", "t".into())
        .is_none());
    assert!(at(Step::Task)
        .resolved(ResolvedBy::Operator, "x", "t".into())
        .is_none());

    let gone = s
        .refreshed(&GuestView::Absent, "t".into())
        .expect("a refresh closes it");
    let r = gone.resolution().expect("resolution");
    assert_eq!(r.by, ResolvedBy::Refresh);
    assert!(r.reason.contains("guest gone"), "{}", r.reason);

    // A resolution survives the journal's round trip; older records without one still read.
    let json = serde_json::to_value(&closed).expect("encode");
    let back: State = serde_json::from_value(json.clone()).expect("decode");
    assert_eq!(back, closed);
    let mut old = serde_json::to_value(&s).expect("encode");
    old.as_object_mut().expect("object").remove("resolution");
    assert_eq!(serde_json::from_value::<State>(old).expect("decode"), s);
}

// ----- what the root exec helper accepts as an armed claim -----

#[test]
fn the_exec_helper_accepts_every_step_that_runs_commands_in_the_guest_and_nothing_before_the_arm() {
    use crate::exec_helper::authorize::check_claim;
    let id = hub_protocol::TxnId::from_ulid(txn());
    // The launch proof, bootstrap and checks exec into the guest; the executor journals the
    // state of each step before it runs the step.
    for step in [
        Step::ProveLaunch,
        Step::WaitBoot,
        Step::Bootstrap,
        Step::Checks,
    ] {
        for keep in [false, true] {
            let s = at_with(step, GuestKind::Lxc, keep);
            assert!(
                check_claim(&s, VMID, "felhom", id).is_ok(),
                "{step} keep={keep}: {:?}",
                check_claim(&s, VMID, "felhom", id)
            );
            // Another vmid, another pool, a VM: never.
            assert!(check_claim(&s, VMID + 1, "felhom", id).is_err());
            assert!(check_claim(&s, VMID, "other", id).is_err());
        }
        let vm = at_with(step, GuestKind::Qemu, false);
        assert!(check_claim(&vm, VMID, "felhom", id).is_err(), "{step}");
    }
    // Armed, but in a step that runs nothing in the guest: refused as the wrong phase.
    for step in [Step::Start, Step::Report] {
        for keep in [false, true] {
            let s = at_with(step, GuestKind::Lxc, keep);
            let refused = check_claim(&s, VMID, "felhom", id).expect_err("wrong phase");
            assert_eq!(refused.code, ErrorCode::ExecWrongPhase, "{step}");
            assert!(
                refused.message.contains(step.as_str()),
                "{}",
                refused.message
            );
        }
    }
    // Before the marker is read back, nothing is armed.
    for step in [
        Step::Validate,
        Step::Submit,
        Step::Task,
        Step::WriteMarker,
        Step::VerifyMarker,
    ] {
        let s = at_with(step, GuestKind::Lxc, false);
        let refused = check_claim(&s, VMID, "felhom", id).expect_err("not armed");
        assert_eq!(refused.code, ErrorCode::ExecNotOwned, "{step}");
        assert!(
            refused.message.contains(&VMID.to_string()),
            "{}",
            refused.message
        );
    }
    // Settled and kept: its claim holds, but it runs nothing any more. Settled and destroyed
    // (the test guest's end): none.
    let kept = check_claim(&settled_kept(), VMID, "felhom", id).expect_err("kept");
    assert_eq!(kept.code, ErrorCode::ExecWrongPhase);
    assert!(kept.message.contains("keeps its guest"), "{}", kept.message);
    let mut s = at_with(Step::Recheck, GuestKind::Lxc, false);
    for _ in 0..10 {
        if s.is_terminal() {
            break;
        }
        let e = towards(&s, Step::Done);
        s = apply(&s, e).0;
    }
    assert!(s.is_terminal());
    assert!(check_claim(&s, VMID, "felhom", id).is_err(), "{s:?}");
    // Withdrawn by a refresh that saw the guest gone.
    let gone = settled_kept().disarmed_by("guest 120 was not in the full guest list");
    assert!(check_claim(&gone, VMID, "felhom", id).is_err());
}

// ----- resume after a stop -----

/// Every open step a journal can hold, each as the normal path reaches it.
fn open_steps() -> Vec<State> {
    let mut states = vec![State::new(request(GuestKind::Lxc, false, false))];
    for target in [
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
    ] {
        states.push(at(target));
    }
    // A failure already recorded before the stop (failed checks, cleanup under way).
    let failed = apply(
        &at(Step::Checks),
        Event::ChecksFailed {
            message: "port 80 closed".to_string(),
        },
    )
    .0;
    assert_eq!(failed.step(), Step::Recheck);
    states.push(failed);
    states
}

fn task_observations() -> Vec<(&'static str, TaskObservation)> {
    vec![
        ("running", running()),
        ("ok", TaskObservation::Ok),
        (
            "error",
            TaskObservation::Error {
                message: "unable to restore CT 120".to_string(),
            },
        ),
        (
            "unknown",
            TaskObservation::Unknown {
                message: "no such task".to_string(),
            },
        ),
    ]
}

fn guest_views(m: &Marker) -> Vec<(&'static str, GuestView)> {
    vec![
        ("absent", GuestView::Absent),
        ("ours", ours(m)),
        ("ours locked", ours_locked(m, "backup")),
        ("copy", copy_of(m)),
        ("described", described(m)),
        ("not ours", not_ours()),
        ("unreadable", unreadable()),
    ]
}

/// Where [`resume`] must go on (step after it, effects), written out pair by pair; every other
/// pair must be settled exactly as [`recover`] settles it.
fn resumes_to(s: &State, task: &str, view: &str) -> Option<(Step, &'static [&'static str])> {
    if s.failure().is_some() {
        return None;
    }
    let marked = ["ours", "ours locked", "copy", "described"];
    match (s.step(), task, view) {
        (Step::Submit, _, _) => Some((Step::ProbeSubmit, &["journal", "find_own_task"])),
        (Step::Task, "running", _) => Some((Step::Task, &["journal", "wait_task"])),
        (Step::Task, "ok", v) if marked.contains(&v) => {
            Some((Step::WriteMarker, &["journal", "write_marker"]))
        }
        // Before the identity is recorded, any guest with the marker and no lock is read back.
        (Step::WriteMarker | Step::VerifyMarker, _, "ours" | "copy") => {
            Some((Step::VerifyMarker, &["journal", "verify_marker"]))
        }
        (Step::WriteMarker | Step::VerifyMarker, _, "ours locked" | "described") => {
            Some((Step::WriteMarker, &["journal", "write_marker"]))
        }
        (Step::Start | Step::ProveLaunch, _, "ours") => Some((Step::Start, &["journal", "start"])),
        (Step::WaitBoot, _, "ours") => Some((Step::WaitBoot, &["journal", "wait_boot"])),
        (Step::Bootstrap, _, "ours") => Some((Step::Bootstrap, &["journal", "bootstrap"])),
        (Step::Checks, _, "ours") => Some((Step::Checks, &["journal", "run_checks"])),
        _ => None,
    }
}

#[test]
fn resume_goes_on_where_it_can_and_settles_every_other_pair_as_recovery_does() {
    let m = Marker::new(txn());
    let mut resumed = 0;
    let mut settled = 0;
    for from in open_steps() {
        for (task_name, task) in task_observations() {
            for (view_name, view) in guest_views(&m) {
                let n = format!("{} / task {task_name} / guest {view_name}", from.step());
                let observed = obs(task.clone(), view);
                let (s, effects) = resume(&from, &observed);
                assert!(s.recovered(), "{n}: recovered flag");
                match resumes_to(&from, task_name, view_name) {
                    Some((step, want)) => {
                        resumed += 1;
                        assert_eq!(s.step(), step, "{n}: step");
                        assert_eq!(names(&effects), want, "{n}: effects");
                        assert!(s.failure().is_none(), "{n}: a failure was recorded");
                        assert!(s.outcome_kind().is_none(), "{n}: settled");
                        assert_eq!(s.phase(), from.phase(), "{n}: phase");
                        assert_eq!(s.destroy_armed(), from.destroy_armed(), "{n}: armed");
                    }
                    None => {
                        settled += 1;
                        assert_eq!(
                            (s, effects),
                            recover(&from, &observed),
                            "{n}: not settled as recovery settles it"
                        );
                    }
                }
            }
        }
    }
    assert!(
        resumed > 40 && settled > 300,
        "{resumed} resumed, {settled} settled"
    );
}

#[test]
fn resume_leaves_a_settled_transaction_alone() {
    let done = drive(at(Step::Report), Step::Done);
    let (s, effects) = resume(&done, &obs(TaskObservation::Ok, ours(&done.marker())));
    assert_eq!(s, done);
    assert!(effects.is_empty());
}

#[test]
fn a_task_followed_after_a_stop_runs_to_the_real_end_ok_and_destroyed() {
    let m = Marker::new(txn());
    let (mut s, effects) = resume(&at(Step::Task), &obs(running(), described(&m)));
    assert_eq!(names(&effects), ["journal", "wait_task"]);
    // The rest is the normal path, event by event, with nothing failed.
    for _ in 0..20 {
        if s.is_terminal() {
            break;
        }
        let e = towards(&s, Step::Done);
        s = apply(&s, e).0;
    }
    let o = s.outcome().expect("settled");
    assert_eq!(o.outcome, OutcomeKind::Ok, "{o:?}");
    assert!(o.destroyed && o.error.is_none(), "{o:?}");
    assert_eq!(s.phase(), Phase::Destroyed);
    assert_eq!(s.reached(), Phase::Reported);
}

#[test]
fn a_bootstrap_cut_by_a_stop_runs_again_and_a_kept_guest_stays_kept() {
    let from = at_with(Step::Bootstrap, GuestKind::Lxc, true);
    let (s, effects) = resume(&from, &obs(TaskObservation::Ok, ours(&from.marker())));
    assert_eq!(names(&effects), ["journal", "bootstrap"]);
    let (s, _) = apply(&s, Event::Bootstrapped);
    let (s, _) = apply(&s, Event::ChecksPassed);
    let (s, effects) = apply(&s, Event::ReportQueued);
    assert_eq!(names(&effects), ["journal"]);
    assert_eq!(s.outcome_kind(), Some(OutcomeKind::Ok));
    assert!(s.destroy_armed() && !s.destroyed());
}

#[test]
fn a_resumed_launch_proof_starts_again_first() {
    let from = at(Step::ProveLaunch);
    let (s, effects) = resume(&from, &obs(TaskObservation::Ok, ours(&from.marker())));
    assert_eq!(names(&effects), ["journal", "start"]);
    assert_eq!(s.step(), Step::Start);
    let (s, effects) = apply(&s, Event::Started);
    assert_eq!(names(&effects), ["journal", "prove_launch"]);
    assert_eq!(s.phase(), Phase::Started);
}

#[test]
fn an_isolated_vm_copy_proves_itself_by_vmgenid_and_uuid_never_by_its_stored_macs() {
    // A VM copy on the lab bridge keeps its stored MACs, which every restore of the backup
    // repeats: its birth identity is its fresh vmgenid and smbios1 uuid alone.
    // Kept (`--keep --network=isolated`), so a later `destroy -vmid` takes it as its origin.
    let mut req = request(GuestKind::Qemu, true, false);
    req.isolate_network = true;
    let s = drive(State::new(req), Step::VerifyMarker);
    let fresh = |vmgenid: &str| {
        let mut id = born();
        id.vmgenid = Some(vmgenid.to_string());
        id.smbios_uuid = Some("5e1f0000-0000-4000-8000-000000000001".to_string());
        id
    };
    let view = |id: BirthIdentity| GuestView::Present {
        tags: s.marker().tags().join(";"),
        description: format!("customer notes\n{}", s.marker().description_line()),
        lock: None,
        identity: id,
    };
    let (armed, _) = apply(&s, Event::GuestObserved(view(fresh("aaaa"))));
    let recorded = armed.identity().expect("recorded").clone();
    assert!(recorded.nics.is_empty(), "{recorded:?}");
    assert_eq!(recorded.vmgenid.as_deref(), Some("aaaa"));
    assert!(armed.destroy_armed());
    // Seen again with the same MACs and the same fresh values: ours; with the stored MACs but
    // another vmgenid (another restore of the same backup): a copy, never destroyed.
    assert!(armed.shows_proof(&view(fresh("aaaa"))));
    assert!(!armed.shows_proof(&view(fresh("bbbb"))));
    // A later `destroy -vmid` judges it the same way.
    let settled = drive(armed, Step::Done);
    assert!(
        settled.destroy_armed() && !settled.destroyed(),
        "{settled:?}"
    );
    let (d, _) = State::for_destroy(other_txn(), VMID, GuestKind::Qemu, Some(&settled));
    assert!(d.shows_proof(&view(fresh("aaaa"))));
    assert!(!d.shows_proof(&view(fresh("bbbb"))));
    // A container's NICs still count: its MACs are fresh (`unique`).
    let lxc = drive(
        State::new(request(GuestKind::Lxc, false, false)),
        Step::VerifyMarker,
    );
    let (armed, _) = apply(&lxc, Event::GuestObserved(ours(&lxc.marker())));
    assert_eq!(armed.identity(), Some(&born()));
}
