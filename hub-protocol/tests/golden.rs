//! The golden files in `tests/golden/` pin the wire format: one frame per message type (and
//! per dispatch action). Each file must decode to the value built here, and that value must
//! encode to the same JSON, so any change to the wire shows up as a failing test.

// A test crate: its helpers panic to report a failure, like the tests that call them.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};

use hub_protocol::{
    decode, encode, Ack, AgentEnvelope, AgentMessage, BackupRef, BackupTest, CheckReport,
    CheckStatus, Coverage, CoverageRow, CoverageStatus, Dispatch, DispatchAction, Envelope,
    ErrorCode, ErrorInfo, Event, GroupInfo, GuestStatus, GuestType, Heartbeat, Hello, HostFacts,
    HubEnvelope, HubMessage, Inventory, Message, MessageId, Outcome, Phase, PoolGuest,
    ProtocolError, ProtocolErrorCode, ProvenPoint, TestVerdict, Timestamp, TxnId, TxnKind,
    TxnResult, Welcome, HANDSHAKE_VERSION,
};
use serde_json::Value;

const PROVISION_TXN: &str = "01KJMMA6WMJMRNV7E9Z0C1HT0H";
const INVENTORY_TXN: &str = "01KJMMAE70TEP0Y8EXPSPATJH6";
const RESTORE_TEST_TXN: &str = "01KJMMB1F8D3N6R0S2V5Y7ZA9B";
const COPY_TXN: &str = "01KJGX8M5R3Q7T1V9W2Y4Z6A8C";
const FAILED_COPY_TXN: &str = "01KJGXA2B4C6D8E0F2G4H6J8K0";
const CT_120_BACKUP: &str = "local:backup/vzdump-lxc-120-2026_02_28-02_00_00.tar.zst";
const VM_121_BACKUP: &str = "local:backup/vzdump-qemu-121-2026_02_28-02_00_00.vma.zst";

fn mid(text: &str) -> MessageId {
    MessageId::parse(text).unwrap()
}

fn txn(text: &str) -> TxnId {
    TxnId::parse(text).unwrap()
}

fn ts(text: &str) -> Timestamp {
    Timestamp::parse(text).unwrap()
}

fn s(text: &str) -> String {
    text.to_owned()
}

fn agent(id: &str, at: &str, message: AgentMessage) -> Expected {
    Expected::Agent(Envelope::new(1, mid(id), ts(at), message))
}

/// A frame in version `v`, later than its type's: for values that came with `v`.
fn agent_in(v: u32, id: &str, at: &str, message: AgentMessage) -> Expected {
    Expected::Agent(Envelope::new(v, mid(id), ts(at), message))
}

/// A frame in the version that brought its type.
fn agent_since(id: &str, at: &str, message: AgentMessage) -> Expected {
    Expected::Agent(Envelope::new(message.since(), mid(id), ts(at), message))
}

fn failed_test_of_121() -> BackupTest {
    BackupTest {
        volid: s(VM_121_BACKUP),
        txn: txn(FAILED_COPY_TXN),
        at: 1_772_248_350,
        verdict: TestVerdict::Failed,
        code: Some(ErrorCode::CheckFailed),
        message: Some(s(
            "check no-other-failed-units failed in VM 990001 on pve1: 1 row where none were expected",
        )),
        failing: vec![s("no-other-failed-units")],
        copy: Some(990_001),
    }
}

fn coverage() -> Coverage {
    Coverage {
        node: s("pve1"),
        at: ts("2026-03-01T12:00:00Z"),
        guest_count: 3,
        guests: vec![
            CoverageRow {
                vmid: 120,
                name: s("shop-frontend"),
                status: CoverageStatus::Proven,
                stale: false,
                stale_after: Some(172_800),
                backup_age: Some(122_400),
                newest_backup: Some(BackupRef {
                    volid: s(CT_120_BACKUP),
                    time: 1_772_244_000,
                    size: Some(734_003_200),
                }),
                last_test: Some(BackupTest {
                    volid: s(CT_120_BACKUP),
                    txn: txn(COPY_TXN),
                    at: 1_772_248_200,
                    verdict: TestVerdict::Ok,
                    code: None,
                    message: None,
                    failing: vec![],
                    copy: Some(990_000),
                }),
                failed_test: None,
                proven: Some(ProvenPoint {
                    volid: s(CT_120_BACKUP),
                    backup_time: 1_772_244_000,
                    age_seconds: 122_400,
                    proven_at: 1_772_248_200,
                }),
                proven_gone: None,
                due_since: None,
                due: false,
                group: None,
            },
            CoverageRow {
                vmid: 121,
                name: s("billing"),
                status: CoverageStatus::Failed,
                stale: false,
                stale_after: None,
                backup_age: Some(122_400),
                newest_backup: Some(BackupRef {
                    volid: s(VM_121_BACKUP),
                    time: 1_772_244_000,
                    size: Some(2_147_483_648),
                }),
                last_test: Some(failed_test_of_121()),
                failed_test: Some(failed_test_of_121()),
                proven: Some(ProvenPoint {
                    volid: s("local:backup/vzdump-qemu-121-2026_02_27-02_00_00.vma.zst"),
                    backup_time: 1_772_157_600,
                    age_seconds: 208_800,
                    proven_at: 1_772_161_500,
                }),
                proven_gone: None,
                due_since: Some(1_772_244_000),
                due: true,
                group: None,
            },
            CoverageRow {
                vmid: 122,
                name: s(""),
                status: CoverageStatus::NoBackup,
                stale: false,
                stale_after: None,
                backup_age: None,
                newest_backup: None,
                last_test: None,
                failed_test: None,
                proven: None,
                proven_gone: None,
                due_since: None,
                due: false,
                group: None,
            },
        ],
    }
}

const DB_BACKUP: &str = "local:backup/vzdump-lxc-200-2026_02_28-02_00_00.tar.zst";
const SHOP_BACKUP: &str = "local:backup/vzdump-lxc-201-2026_02_28-02_00_00.tar.zst";
/// The shop group's run: the same in both members' results.
const SHOP_GROUP_RUN: &str = "01KJGXC7D9F1H3K5M7P9R1T3V5";

/// The shop's result in its group's run: its order page failed, the database member before it
/// having failed first.
fn shop_member_result() -> TxnResult {
    TxnResult {
        txn: txn("01KJGXC8E0G2J4M6N8Q0S2T4W6"),
        kind: TxnKind::SelftestRestore,
        vmid: Some(990_001),
        outcome: Outcome::Failed,
        phase: Phase::Destroyed,
        destroy_armed: true,
        destroyed: true,
        checks: vec![CheckReport {
            name: s("order-page"),
            status: CheckStatus::Fail,
            rows: vec![[(s("response_code"), s("502"))].into()],
            row_count: 1,
            rows_truncated: false,
            message: Some(s(
                "failed; member 200 (db) of group shop failed before it: unit db.service failed",
            )),
            duration_ms: 212,
        }],
        error: Some(ErrorInfo {
            code: ErrorCode::CheckFailed,
            message: s("check order-page failed in container 990001 on pve1"),
        }),
        isolation: None,
        guest: Some(201),
        backup: Some(s(SHOP_BACKUP)),
        group: Some(GroupInfo {
            name: s("shop"),
            run: txn(SHOP_GROUP_RUN),
            member: 2,
            members: vec![200, 201],
        }),
    }
}

/// A table with the shop group's two members (the database failed, the shop failed) and a
/// guest proven alone.
fn coverage_with_a_group() -> Coverage {
    let failed = |volid: &str, copy: u32, t: &str, failing: &str| BackupTest {
        volid: s(volid),
        txn: txn(t),
        at: 1_772_248_400,
        verdict: TestVerdict::Failed,
        code: Some(ErrorCode::CheckFailed),
        message: Some(format!(
            "check {failing} failed in container {copy} on pve1"
        )),
        failing: vec![s(failing)],
        copy: Some(copy),
    };
    let member = |vmid: u32, name: &str, volid: &str, test: BackupTest| CoverageRow {
        vmid,
        name: s(name),
        status: CoverageStatus::Failed,
        stale: false,
        stale_after: Some(691_200),
        backup_age: Some(122_400),
        newest_backup: Some(BackupRef {
            volid: s(volid),
            time: 1_772_244_000,
            size: Some(123_456_789),
        }),
        last_test: Some(test.clone()),
        failed_test: Some(test),
        proven: None,
        proven_gone: None,
        due_since: Some(1_772_244_000),
        due: true,
        group: Some(s("shop")),
    };
    let mut alone = coverage().guests.remove(0);
    alone.vmid = 120;
    Coverage {
        node: s("pve1"),
        at: ts("2026-03-01T12:00:00Z"),
        guest_count: 3,
        guests: vec![
            alone,
            member(
                200,
                "db",
                DB_BACKUP,
                failed(
                    DB_BACKUP,
                    990_000,
                    "01KJGXC8D0F2H4K6M8P0R2T4V6",
                    "database-serves",
                ),
            ),
            member(
                201,
                "shop",
                SHOP_BACKUP,
                failed(
                    SHOP_BACKUP,
                    990_001,
                    "01KJGXC8E0G2J4M6N8Q0S2T4W6",
                    "order-page",
                ),
            ),
        ],
    }
}

fn hub(id: &str, at: &str, message: HubMessage) -> Expected {
    Expected::Hub(Envelope::new(1, mid(id), ts(at), message))
}

enum Expected {
    Agent(AgentEnvelope),
    Hub(HubEnvelope),
}

fn cases() -> Vec<(&'static str, Expected)> {
    vec![
        (
            "agent_hello.json",
            agent(
                "01KJMMA2G04TFF59TDWH9EDD1R",
                "2026-03-01T12:00:00Z",
                AgentMessage::Hello(Hello {
                    agent_version: s("0.1.0"),
                    node: s("pve1"),
                    pool: s("felhom"),
                    protocol_versions: vec![1],
                    capabilities: vec![
                        s(hub_protocol::capability::PROVISION),
                        s(hub_protocol::capability::DESTROY),
                        s(hub_protocol::capability::RESTORE_TEST),
                        s(hub_protocol::capability::INVENTORY),
                    ],
                    host: HostFacts {
                        hostname: s("pve1"),
                        kernel: s("6.8.12-4-pve"),
                        os: s("Debian GNU/Linux 12 (bookworm)"),
                        cpu_count: 16,
                        memory_total_bytes: 67_430_006_784,
                        uptime_secs: 864_000,
                    },
                }),
            ),
        ),
        (
            "agent_heartbeat.json",
            agent(
                "01KJMMAB9827H6P3AMKDQG6STT",
                "2026-03-01T12:10:30Z",
                AgentMessage::Heartbeat(Heartbeat {
                    seq: 42,
                    uptime_secs: 630,
                    in_flight: 1,
                    outbox_depth: 3,
                }),
            ),
        ),
        (
            "agent_inventory.json",
            agent(
                "01KJMMACR4HM8HEE7QV4YSR5S4",
                "2026-03-01T12:11:00.750Z",
                AgentMessage::Inventory(Inventory {
                    request: Some(txn(INVENTORY_TXN)),
                    guests: vec![
                        PoolGuest {
                            vmid: 120,
                            guest_type: GuestType::Lxc,
                            node: s("pve1"),
                            name: Some(s("shop-frontend")),
                            status: GuestStatus::Running,
                        },
                        PoolGuest {
                            vmid: 121,
                            guest_type: GuestType::Qemu,
                            node: s("pve2"),
                            name: None,
                            status: GuestStatus::Stopped,
                        },
                    ],
                    foreign_vmids: vec![100, 101, 990_003],
                }),
            ),
        ),
        (
            "agent_event.json",
            agent(
                "01KJMMA8BGG7KYHRJXJG7DJ13N",
                "2026-03-01T12:00:04.500Z",
                AgentMessage::Event(Event {
                    txn: txn(PROVISION_TXN),
                    kind: TxnKind::Provision,
                    vmid: Some(120),
                    phase: Phase::Submitted,
                    at: ts("2026-03-01T12:00:04.250Z"),
                    detail: Some(s(
                        "UPID:pve1:000A1B2C:0F3E4D5A:67C2F0A4:vzrestore:120:felhom@pve!agent:",
                    )),
                    error: None,
                    guest: None,
                    backup: None,
                }),
            ),
        ),
        (
            "agent_event_restore_test.json",
            agent(
                "01KJGX8Q1B3D5F7H9K1M3N5P7R",
                "2026-02-28T03:06:12Z",
                AgentMessage::Event(Event {
                    txn: txn(COPY_TXN),
                    kind: TxnKind::SelftestRestore,
                    vmid: Some(990_000),
                    phase: Phase::Created,
                    at: ts("2026-02-28T03:06:11.750Z"),
                    detail: Some(s("step start")),
                    error: None,
                    guest: Some(120),
                    backup: Some(s(CT_120_BACKUP)),
                }),
            ),
        ),
        (
            "agent_result_restore_test.json",
            agent(
                "01KJGX9P3D5F7H9K1M3N5Q7S9V",
                "2026-02-28T03:10:00.250Z",
                AgentMessage::Result(TxnResult {
                    txn: txn(COPY_TXN),
                    kind: TxnKind::SelftestRestore,
                    vmid: Some(990_000),
                    outcome: Outcome::Ok,
                    phase: Phase::Destroyed,
                    destroy_armed: true,
                    destroyed: true,
                    checks: vec![],
                    error: None,
                    isolation: None,
                    guest: Some(120),
                    backup: Some(s(CT_120_BACKUP)),
                    group: None,
                }),
            ),
        ),
        (
            // Version 2's name of the kind and its `skipped` check status.
            "agent_result_restore_test_v2.json",
            agent_in(
                2,
                "01KJGX9S2C4E6G8J0M2N4P6R8T",
                "2026-02-28T03:12:00.500Z",
                AgentMessage::Result(TxnResult {
                    txn: txn("01KJGXB3C5D7E9F1G3H5J7K9M1"),
                    kind: TxnKind::SelftestRestore,
                    vmid: Some(990_001),
                    outcome: Outcome::Ok,
                    phase: Phase::Destroyed,
                    destroy_armed: true,
                    destroyed: true,
                    checks: vec![
                        CheckReport {
                            name: s("osquery-version"),
                            status: CheckStatus::Pass,
                            rows: vec![[(s("version"), s("5.12.1"))].into()],
                            row_count: 1,
                            rows_truncated: false,
                            message: None,
                            duration_ms: 41,
                        },
                        CheckReport {
                            name: s("hostname"),
                            status: CheckStatus::Skipped,
                            rows: vec![[(s("hostname"), s("billing.example.com"))].into()],
                            row_count: 1,
                            rows_truncated: false,
                            message: Some(s(
                                "not judged: PVE keeps no hostname for a VM (its name in PVE, \
                                 'billing', is never written into the guest), and the guest calls \
                                 itself 'billing.example.com'; a VM's own name is the guest's to set",
                            )),
                            duration_ms: 37,
                        },
                    ],
                    error: None,
                    isolation: None,
                    guest: Some(121),
                    backup: Some(s(VM_121_BACKUP)),
                    group: None,
                }),
            ),
        ),
        (
            // A member of an application group: the optional `group` of results.
            "agent_result_restore_test_group_v2.json",
            agent_in(
                2,
                "01KJGXC9F1H3K5M7P9R1T3V5X7",
                "2026-02-28T03:14:00.250Z",
                AgentMessage::Result(shop_member_result()),
            ),
        ),
        (
            // Coverage rows naming their guest's group.
            "agent_coverage_group_v2.json",
            agent_since(
                "01KJGXCA02J4M6N8Q0S2T4W6Y8",
                "2026-03-01T12:00:00.750Z",
                AgentMessage::Coverage(coverage_with_a_group()),
            ),
        ),
        (
            "agent_coverage.json",
            agent_since(
                "01KJGX9R7T9V1X3Z5B7D9F1H3K",
                "2026-03-01T12:00:00.500Z",
                AgentMessage::Coverage(coverage()),
            ),
        ),
        (
            "agent_result_isolated.json",
            agent(
                "01KJMMB3J0Q5V8M2C6T4W9XK7D",
                "2026-03-01T12:10:04.500Z",
                AgentMessage::Result(TxnResult {
                    txn: txn(RESTORE_TEST_TXN),
                    kind: TxnKind::SelftestRestore,
                    vmid: Some(9001),
                    outcome: Outcome::Ok,
                    phase: Phase::Destroyed,
                    destroy_armed: true,
                    destroyed: true,
                    checks: vec![],
                    error: None,
                    isolation: Some(s(
                        "eth0 given as an unconnected veth pair (peer felab0 inside the copy); \
                         restarted networking.service (active)",
                    )),
                    guest: None,
                    backup: None,
                    group: None,
                }),
            ),
        ),
        (
            "agent_result.json",
            agent(
                "01KJMMA9TC2R00K6AGV0VFCXEC",
                "2026-03-01T12:02:31.125Z",
                AgentMessage::Result(TxnResult {
                    txn: txn(PROVISION_TXN),
                    kind: TxnKind::Provision,
                    vmid: Some(120),
                    outcome: Outcome::Failed,
                    phase: Phase::Destroyed,
                    destroy_armed: true,
                    destroyed: true,
                    checks: vec![
                        CheckReport {
                            name: s("sshd_listening"),
                            status: CheckStatus::Pass,
                            rows: vec![[(s("address"), s("0.0.0.0")), (s("port"), s("22"))].into()],
                            row_count: 1,
                            rows_truncated: false,
                            message: None,
                            duration_ms: 38,
                        },
                        CheckReport {
                            name: s("no_world_writable_etc"),
                            status: CheckStatus::Fail,
                            rows: vec![
                                [(s("mode"), s("0666")), (s("path"), s("/etc/app.conf"))].into()
                            ],
                            row_count: 1,
                            rows_truncated: false,
                            message: Some(s("expected no rows, found 1")),
                            duration_ms: 52,
                        },
                        CheckReport {
                            name: s("disk_encryption"),
                            status: CheckStatus::Error,
                            rows: vec![],
                            row_count: 0,
                            rows_truncated: false,
                            message: Some(s("osqueryi timed out after 30 s in CT 120")),
                            duration_ms: 30_000,
                        },
                    ],
                    error: Some(ErrorInfo {
                        code: ErrorCode::CheckFailed,
                        message: s("check no_world_writable_etc failed in CT 120 on pve1: 1 row where none were expected; the guest was destroyed"),
                    }),
                    isolation: None,
                    guest: None,
                    backup: None,
                    group: None,
                }),
            ),
        ),
        (
            "agent_ack.json",
            agent(
                "01KJMMARYR2Q70PD8GP2T6XRET",
                "2026-03-01T12:13:00.100Z",
                AgentMessage::Ack(Ack {
                    ids: vec![
                        mid("01KJMMA3YW1HEAD8X4A1JH69RE"),
                        mid("01KJMMA5DRH4QX4FR84G98PBSK"),
                    ],
                }),
            ),
        ),
        (
            "agent_protocol_error.json",
            agent(
                "01KJMMAVWG6PDR386NPFZWDRTW",
                "2026-03-01T12:14:00Z",
                AgentMessage::ProtocolError(
                    ProtocolError::new(
                        ProtocolErrorCode::UnknownType,
                        "unknown hub-to-agent message type `reboot` (known: welcome, dispatch, ack, protocol_error)",
                    )
                    .with_offending_id(Some(mid("01KJMMAXBC0Z0T8MBXDHK99WH9"))),
                ),
            ),
        ),
        (
            "hub_welcome.json",
            hub(
                "01KJMMA3YW1HEAD8X4A1JH69RE",
                "2026-03-01T12:00:01.500Z",
                HubMessage::Welcome(Welcome {
                    version: 1,
                    session: s("sess-0042"),
                    heartbeat_interval_secs: NonZeroU32::new(15).unwrap(),
                }),
            ),
        ),
        (
            "hub_dispatch_provision.json",
            hub(
                "01KJMMA5DRH4QX4FR84G98PBSK",
                "2026-03-01T12:00:03Z",
                HubMessage::Dispatch(Dispatch {
                    txn: txn(PROVISION_TXN),
                    action: DispatchAction::Provision {
                        vmid: 120,
                        from: s("local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst"),
                        storage: s("local-lvm"),
                        keep: false,
                        profile: Some(s("web")),
                        isolate_network: None,
                    },
                }),
            ),
        ),
        (
            "hub_dispatch_destroy.json",
            hub(
                "01KJMMAH4RM2FT2W5K70WJCC2S",
                "2026-03-01T12:12:00Z",
                HubMessage::Dispatch(Dispatch {
                    txn: txn("01KJMMAJKM1ZBF578DN6AKYJ7H"),
                    action: DispatchAction::Destroy { vmid: 121 },
                }),
            ),
        ),
        (
            "hub_dispatch_restore_test.json",
            hub(
                "01KJMMAP10YSC5XMTFWMX0JS9K",
                "2026-03-01T12:13:00Z",
                HubMessage::Dispatch(Dispatch {
                    txn: txn("01KJMMAQFW65R20NSRT5G1GDKC"),
                    action: DispatchAction::RestoreTest { dry_run: true },
                }),
            ),
        ),
        (
            "hub_dispatch_inventory_request.json",
            hub(
                "01KJMMAFNWYA61ZCBW4E8C34PF",
                "2026-03-01T12:11:00Z",
                HubMessage::Dispatch(Dispatch {
                    txn: txn(INVENTORY_TXN),
                    action: DispatchAction::InventoryRequest,
                }),
            ),
        ),
        (
            "hub_ack.json",
            hub(
                "01KJMMATDMSYQKYP2ATGHGG96J",
                "2026-03-01T12:13:01Z",
                HubMessage::Ack(Ack {
                    ids: vec![
                        mid("01KJMMA8BGG7KYHRJXJG7DJ13N"),
                        mid("01KJMMA9TC2R00K6AGV0VFCXEC"),
                    ],
                }),
            ),
        ),
        (
            "hub_protocol_error.json",
            hub(
                "01KJMMAYT8EG07SHK1X5TRKJJA",
                "2026-03-01T12:15:00Z",
                HubMessage::ProtocolError(ProtocolError::new(
                    ProtocolErrorCode::Oversized,
                    "frame of 2097152 bytes exceeds the limit of 1048576 bytes",
                )),
            ),
        ),
    ]
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn read_golden(name: &str) -> String {
    let path = golden_dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_golden_file_decodes_to_its_value() {
    for (name, expected) in cases() {
        let frame = read_golden(name);
        match expected {
            Expected::Agent(want) => {
                assert_eq!(decode::<AgentMessage>(&frame), Ok(want), "{name}");
            }
            Expected::Hub(want) => {
                assert_eq!(decode::<HubMessage>(&frame), Ok(want), "{name}");
            }
        }
    }
}

#[test]
fn every_value_encodes_to_its_golden_file() {
    for (name, expected) in cases() {
        let golden: Value = serde_json::from_str(&read_golden(name)).unwrap();
        let encoded = match &expected {
            Expected::Agent(env) => encode(env).unwrap(),
            Expected::Hub(env) => encode(env).unwrap(),
        };
        let encoded: Value = serde_json::from_str(&encoded).unwrap();
        assert_eq!(
            encoded,
            golden,
            "{name}: encoded\n{}\n",
            serde_json::to_string_pretty(&encoded).unwrap()
        );
    }
}

#[test]
fn every_golden_file_has_a_case_and_every_type_a_golden_file() {
    let on_disk: BTreeSet<String> = std::fs::read_dir(golden_dir())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let cases = cases();
    let covered: BTreeSet<String> = cases.iter().map(|(name, _)| s(name)).collect();
    assert_eq!(on_disk, covered, "golden files and test cases differ");

    let mut agent_types = BTreeSet::new();
    let mut hub_types = BTreeSet::new();
    let mut dispatch_actions = BTreeSet::new();
    for (name, expected) in &cases {
        match expected {
            Expected::Agent(env) => {
                assert!(name.starts_with("agent_"), "{name}");
                agent_types.insert(env.type_name());
            }
            Expected::Hub(env) => {
                assert!(name.starts_with("hub_"), "{name}");
                hub_types.insert(env.type_name());
                if let HubMessage::Dispatch(d) = &env.message {
                    let wire = serde_json::to_value(d).unwrap();
                    dispatch_actions.insert(wire["action"].as_str().unwrap().to_owned());
                }
            }
        }
    }
    assert_eq!(
        agent_types,
        AgentMessage::TYPES.iter().copied().collect::<BTreeSet<_>>()
    );
    assert_eq!(
        hub_types,
        HubMessage::TYPES.iter().copied().collect::<BTreeSet<_>>()
    );
    assert_eq!(
        dispatch_actions,
        ["destroy", "inventory_request", "provision", "restore_test"]
            .map(s)
            .into_iter()
            .collect::<BTreeSet<_>>()
    );
}

#[test]
fn golden_frames_are_in_the_version_of_their_type_and_fit_a_frame() {
    // The goldens pin version 1; a type a later version brought is pinned in that version,
    // and so are values a later version brought (`_v2` files).
    assert!(hub_protocol::SUPPORTED_VERSIONS.contains(&1));
    assert_eq!(HANDSHAKE_VERSION, 1);
    for (name, expected) in cases() {
        let frame = read_golden(name);
        assert!(frame.len() <= hub_protocol::MAX_FRAME_BYTES, "{name}");
        let value: Value = serde_json::from_str(&frame).unwrap();
        let since = match &expected {
            Expected::Agent(env) => env.message.since(),
            Expected::Hub(env) => env.message.since(),
        };
        let since = if name.ends_with("_v2.json") {
            since.max(2)
        } else {
            since
        };
        assert_eq!(value["v"], Value::from(since), "{name}");
    }
}

/// The version 2 restore-test result sent in a version 1 frame: the kind's version 1 name,
/// the skipped check as `error` with its message (never `pass`), the rest as it is; the
/// version 1 golden of a restore-test result, read in version 2, has the same kind.
#[test]
fn the_version_2_result_in_a_version_1_frame() {
    let Some((_, Expected::Agent(env))) = cases()
        .into_iter()
        .find(|(name, _)| *name == "agent_result_restore_test_v2.json")
    else {
        panic!("no v2 result golden");
    };
    let mut want: Value =
        serde_json::from_str(&read_golden("agent_result_restore_test_v2.json")).unwrap();
    want["v"] = Value::from(1);
    want["body"]["kind"] = Value::from("selftest-restore");
    want["body"]["checks"][1]["status"] = Value::from("error");
    let old = encode(&Envelope { v: 1, ..env }).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&old).unwrap(), want, "{old}");

    let AgentMessage::Result(v1) =
        decode::<AgentMessage>(&read_golden("agent_result_restore_test.json"))
            .unwrap()
            .message
    else {
        panic!("not a result");
    };
    assert_eq!(v1.kind, TxnKind::SelftestRestore);
    assert_eq!(v1.kind.as_str(), "restore-test");
}

#[test]
fn the_coverage_golden_is_refused_in_version_1_and_every_version_1_golden_decodes_in_2() {
    let mut coverage: Value = serde_json::from_str(&read_golden("agent_coverage.json")).unwrap();
    coverage["v"] = Value::from(1);
    let err = decode::<AgentMessage>(&coverage.to_string()).unwrap_err();
    assert_eq!(err.code, ProtocolErrorCode::UnknownType, "{err}");
    assert_eq!(
        err.offending_id,
        Some(mid("01KJGX9R7T9V1X3Z5B7D9F1H3K")),
        "{err}"
    );
    for (name, expected) in cases() {
        let mut value: Value = serde_json::from_str(&read_golden(name)).unwrap();
        if value["v"] != 1 {
            continue;
        }
        value["v"] = Value::from(2);
        let frame = value.to_string();
        match expected {
            Expected::Agent(want) => assert_eq!(
                decode::<AgentMessage>(&frame),
                Ok(Envelope { v: 2, ..want }),
                "{name}"
            ),
            Expected::Hub(want) => assert_eq!(
                decode::<HubMessage>(&frame),
                Ok(Envelope { v: 2, ..want }),
                "{name}"
            ),
        }
    }
}

#[test]
fn golden_frames_sent_the_wrong_way_are_unknown_types() {
    for (name, expected) in cases() {
        let frame = read_golden(name);
        let (type_name, other_side) = match expected {
            Expected::Agent(env) => (env.type_name(), decode::<HubMessage>(&frame).err()),
            Expected::Hub(env) => (env.type_name(), decode::<AgentMessage>(&frame).err()),
        };
        // `ack` and `protocol_error` travel both ways with the same body.
        if matches!(type_name, "ack" | "protocol_error") {
            assert_eq!(other_side, None, "{name}");
        } else {
            let err = other_side.unwrap_or_else(|| panic!("{name} decoded the wrong way"));
            assert_eq!(err.code, ProtocolErrorCode::UnknownType, "{name}");
        }
    }
}

/// A group member's result in either version: a version 1 frame carries the same `group` (an
/// optional field of version 1, as `guest` and `backup` are) with the kind's version 1 name,
/// and decodes; the frame with its `group` left out (an agent before groups) decodes as a
/// copy proven alone, the rest the same. So do coverage rows with and without `group`.
#[test]
fn a_group_member_s_result_and_rows_in_either_version_and_without_the_group() {
    let golden: Value =
        serde_json::from_str(&read_golden("agent_result_restore_test_group_v2.json")).unwrap();
    let env = Envelope::new(
        1,
        mid("01KJGXC9F1H3K5M7P9R1T3V5X7"),
        ts("2026-02-28T03:14:00.250Z"),
        AgentMessage::Result(shop_member_result()),
    );
    let old: Value = serde_json::from_str(&encode(&env).unwrap()).unwrap();
    let mut want = golden.clone();
    want["v"] = Value::from(1);
    want["body"]["kind"] = Value::from("selftest-restore");
    assert_eq!(old, want);
    assert_eq!(old["body"]["group"]["run"], Value::from(SHOP_GROUP_RUN));
    assert_eq!(decode::<AgentMessage>(&old.to_string()), Ok(env));

    for v in [1, 2] {
        let mut bare = golden.clone();
        bare["v"] = Value::from(v);
        bare["body"].as_object_mut().unwrap().remove("group");
        let AgentMessage::Result(r) = decode::<AgentMessage>(&bare.to_string()).unwrap().message
        else {
            panic!("not a result");
        };
        assert_eq!(
            r,
            TxnResult {
                group: None,
                ..shop_member_result()
            }
        );
    }

    let mut rows: Value =
        serde_json::from_str(&read_golden("agent_coverage_group_v2.json")).unwrap();
    for row in rows["body"]["guests"].as_array_mut().unwrap() {
        row.as_object_mut().unwrap().remove("group");
    }
    let AgentMessage::Coverage(table) = decode::<AgentMessage>(&rows.to_string()).unwrap().message
    else {
        panic!("not a coverage table");
    };
    let mut want = coverage_with_a_group();
    for row in &mut want.guests {
        row.group = None;
    }
    assert_eq!(table, want);
    assert_eq!(
        coverage_with_a_group()
            .guests
            .iter()
            .map(|r| r.group.as_deref())
            .collect::<Vec<_>>(),
        [None, Some("shop"), Some("shop")]
    );
}
