//! Properties of the codec: decoding never panics whatever the frame, its errors stay bounded,
//! and every message encodes and decodes back to itself.

// A test crate: its strategies panic to report a failure, like the tests that use them.
#![allow(clippy::unwrap_used)]

use std::num::NonZeroU32;

use hub_protocol::{
    decode, decode_value, encode, Ack, AgentMessage, BackupRef, BackupTest, CheckReport, CheckRow,
    CheckStatus, Coverage, CoverageRow, CoverageStatus, Dispatch, DispatchAction, Envelope,
    ErrorCode, ErrorInfo, Event, GroupInfo, GuestStatus, GuestType, Heartbeat, Hello, HostFacts,
    HubMessage, Inventory, Message, MessageId, Outcome, Phase, PoolGuest, ProtocolError,
    ProtocolErrorCode, ProvenPoint, TestVerdict, Timestamp, TxnId, TxnKind, TxnResult, Welcome,
    MAX_COVERAGE_ROWS, MAX_ERROR_MESSAGE_BYTES, MAX_FRAME_BYTES, SUPPORTED_VERSIONS,
};
use proptest::collection::{btree_map, vec};
use proptest::option;
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::Value;

/// Any text, control characters and astral planes included.
fn text() -> impl Strategy<Value = String> {
    vec(any::<char>(), 0..16).prop_map(String::from_iter)
}

fn message_id() -> impl Strategy<Value = MessageId> {
    any::<u128>().prop_map(|n| MessageId::from_ulid(n.into()))
}

fn txn_id() -> impl Strategy<Value = TxnId> {
    any::<u128>().prop_map(|n| TxnId::from_ulid(n.into()))
}

fn timestamp() -> impl Strategy<Value = Timestamp> {
    (
        (0u32..=9999, 1u32..=12, 1u32..=28),
        (0u32..24, 0u32..60, 0u32..60),
        option::of("[0-9]{1,9}"),
    )
        .prop_map(|((y, mo, d), (h, mi, s), fraction)| {
            let fraction = fraction.map(|f| format!(".{f}")).unwrap_or_default();
            Timestamp::parse(&format!(
                "{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}{fraction}Z"
            ))
            .unwrap()
        })
}

fn txn_kind() -> impl Strategy<Value = TxnKind> {
    select(vec![
        TxnKind::Provision,
        TxnKind::Destroy,
        TxnKind::SelftestProvision,
        TxnKind::SelftestRestore,
    ])
}

fn phase() -> impl Strategy<Value = Phase> {
    select(Phase::ALL.to_vec())
}

/// `env` as a peer of its version reads it: every error code and check status as that
/// version has it (a check given another status there says it was not judged when it said
/// nothing).
fn in_version(mut env: Envelope<AgentMessage>) -> Envelope<AgentMessage> {
    let v = env.v;
    let map = |e: &mut Option<ErrorInfo>| {
        if let Some(e) = e {
            e.code = e.code.in_version(v);
        }
    };
    match &mut env.message {
        AgentMessage::Result(r) => {
            map(&mut r.error);
            for c in &mut r.checks {
                if c.status.since() > v {
                    c.message.get_or_insert_with(|| {
                        format!("not judged (a check status of `{}`)", c.status)
                    });
                    c.status = c.status.in_version(v);
                }
            }
        }
        AgentMessage::Event(e) => map(&mut e.error),
        _ => {}
    }
    env
}

fn error_info() -> impl Strategy<Value = ErrorInfo> {
    let codes = ErrorCode::ALL.to_vec();
    (select(codes), text()).prop_map(|(code, message)| ErrorInfo { code, message })
}

fn check_report() -> impl Strategy<Value = CheckReport> {
    let row = btree_map(text(), text(), 0..4).prop_map(CheckRow::from_iter);
    (
        (
            text(),
            select(vec![
                CheckStatus::Pass,
                CheckStatus::Fail,
                CheckStatus::Error,
                CheckStatus::Skipped,
            ]),
            vec(row, 0..3),
        ),
        (
            any::<u64>(),
            any::<bool>(),
            option::of(text()),
            any::<u64>(),
        ),
    )
        .prop_map(
            |((name, status, rows), (row_count, rows_truncated, message, duration_ms))| {
                CheckReport {
                    name,
                    status,
                    rows,
                    row_count,
                    rows_truncated,
                    message,
                    duration_ms,
                }
            },
        )
}

fn protocol_error() -> impl Strategy<Value = ProtocolError> {
    let codes = vec![
        ProtocolErrorCode::Oversized,
        ProtocolErrorCode::Malformed,
        ProtocolErrorCode::UnsupportedVersion,
        ProtocolErrorCode::UnknownType,
        ProtocolErrorCode::InvalidField,
        ProtocolErrorCode::UnexpectedMessage,
    ];
    (select(codes), text(), option::of(message_id()))
        .prop_map(|(code, message, id)| ProtocolError::new(code, message).with_offending_id(id))
}

fn ack() -> impl Strategy<Value = Ack> {
    vec(message_id(), 0..4).prop_map(|ids| Ack { ids })
}

fn hello() -> impl Strategy<Value = Hello> {
    let host = (
        (text(), text(), text()),
        (any::<u32>(), any::<u64>(), any::<u64>()),
    )
        .prop_map(
            |((hostname, kernel, os), (cpu_count, memory_total_bytes, uptime_secs))| HostFacts {
                hostname,
                kernel,
                os,
                cpu_count,
                memory_total_bytes,
                uptime_secs,
            },
        );
    (
        (text(), text(), text()),
        vec(any::<u32>(), 0..4),
        vec(text(), 0..4),
        host,
    )
        .prop_map(
            |((agent_version, node, pool), protocol_versions, capabilities, host)| Hello {
                agent_version,
                node,
                pool,
                protocol_versions,
                capabilities,
                host,
            },
        )
}

fn inventory() -> impl Strategy<Value = Inventory> {
    let guest = (
        any::<u32>(),
        select(vec![GuestType::Lxc, GuestType::Qemu]),
        text(),
        option::of(text()),
        select(vec![
            GuestStatus::Running,
            GuestStatus::Stopped,
            GuestStatus::Paused,
            GuestStatus::Unknown,
        ]),
    )
        .prop_map(|(vmid, guest_type, node, name, status)| PoolGuest {
            vmid,
            guest_type,
            node,
            name,
            status,
        });
    (
        option::of(txn_id()),
        vec(guest, 0..4),
        vec(any::<u32>(), 0..6),
    )
        .prop_map(|(request, guests, foreign_vmids)| Inventory {
            request,
            guests,
            foreign_vmids,
        })
}

fn event() -> impl Strategy<Value = Event> {
    (
        (txn_id(), txn_kind(), option::of(any::<u32>()), phase()),
        (timestamp(), option::of(text()), option::of(error_info())),
        (option::of(any::<u32>()), option::of(text())),
    )
        .prop_map(
            |((txn, kind, vmid, phase), (at, detail, error), (guest, backup))| Event {
                txn,
                kind,
                vmid,
                phase,
                at,
                detail,
                error,
                guest,
                backup,
            },
        )
}

fn txn_result() -> impl Strategy<Value = TxnResult> {
    let outcome = select(vec![
        Outcome::Ok,
        Outcome::Refused,
        Outcome::Failed,
        Outcome::Skipped,
        Outcome::NeedsHuman,
    ]);
    (
        (
            txn_id(),
            txn_kind(),
            option::of(any::<u32>()),
            outcome,
            phase(),
        ),
        (any::<bool>(), any::<bool>()),
        (
            vec(check_report(), 0..3),
            option::of(error_info()),
            option::of(text()),
        ),
        (
            option::of(any::<u32>()),
            option::of(text()),
            option::of(group_info()),
        ),
    )
        .prop_map(
            |(
                (txn, kind, vmid, outcome, phase),
                (destroy_armed, destroyed),
                (checks, error, isolation),
                (guest, backup, group),
            )| {
                TxnResult {
                    txn,
                    kind,
                    vmid,
                    outcome,
                    phase,
                    destroy_armed,
                    destroyed,
                    checks,
                    error,
                    isolation,
                    guest,
                    backup,
                    group,
                }
            },
        )
}

fn group_info() -> impl Strategy<Value = GroupInfo> {
    (text(), txn_id(), any::<u32>(), vec(any::<u32>(), 0..4)).prop_map(
        |(name, run, member, members)| GroupInfo {
            name,
            run,
            member,
            members,
        },
    )
}

fn coverage_status() -> impl Strategy<Value = CoverageStatus> {
    select(CoverageStatus::ALL.to_vec())
}

fn backup_test() -> impl Strategy<Value = BackupTest> {
    (
        (text(), txn_id(), any::<u64>()),
        select(vec![
            TestVerdict::Ok,
            TestVerdict::Failed,
            TestVerdict::Unprovable,
        ]),
        (
            option::of(select(ErrorCode::ALL.to_vec())),
            option::of(text()),
            vec(text(), 0..3),
            option::of(any::<u32>()),
        ),
    )
        .prop_map(
            |((volid, txn, at), verdict, (code, message, failing, copy))| BackupTest {
                volid,
                txn,
                at,
                verdict,
                code,
                message,
                failing,
                copy,
            },
        )
}

fn coverage_row() -> impl Strategy<Value = CoverageRow> {
    let backup = (text(), any::<u64>(), option::of(any::<u64>()))
        .prop_map(|(volid, time, size)| BackupRef { volid, time, size });
    let proven = (text(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
        |(volid, backup_time, age_seconds, proven_at)| ProvenPoint {
            volid,
            backup_time,
            age_seconds,
            proven_at,
        },
    );
    (
        (any::<u32>(), text(), coverage_status(), any::<bool>()),
        (option::of(any::<u64>()), option::of(backup)),
        (option::of(backup_test()), option::of(backup_test())),
        (option::of(proven), option::of(text())),
        (
            option::of(any::<u64>()),
            any::<bool>(),
            option::of(any::<u64>()),
            option::of(text()),
        ),
    )
        .prop_map(
            |(
                (vmid, name, status, stale),
                (backup_age, newest_backup),
                (last_test, failed_test),
                (proven, proven_gone),
                (due_since, due, stale_after, group),
            )| CoverageRow {
                vmid,
                name,
                status,
                stale,
                stale_after,
                backup_age,
                newest_backup,
                last_test,
                failed_test,
                proven,
                proven_gone,
                due_since,
                due,
                group,
            },
        )
}

fn coverage() -> impl Strategy<Value = Coverage> {
    (text(), timestamp(), any::<u32>(), vec(coverage_row(), 0..4)).prop_map(
        |(node, at, guest_count, guests)| Coverage {
            node,
            at,
            guest_count,
            guests,
        },
    )
}

fn agent_message() -> impl Strategy<Value = AgentMessage> {
    prop_oneof![
        hello().prop_map(AgentMessage::Hello),
        (any::<u64>(), any::<u64>(), any::<u32>(), any::<u64>()).prop_map(
            |(seq, uptime_secs, in_flight, outbox_depth)| AgentMessage::Heartbeat(Heartbeat {
                seq,
                uptime_secs,
                in_flight,
                outbox_depth
            })
        ),
        inventory().prop_map(AgentMessage::Inventory),
        event().prop_map(AgentMessage::Event),
        txn_result().prop_map(AgentMessage::Result),
        coverage().prop_map(AgentMessage::Coverage),
        ack().prop_map(AgentMessage::Ack),
        protocol_error().prop_map(AgentMessage::ProtocolError),
    ]
}

fn dispatch_action() -> impl Strategy<Value = DispatchAction> {
    prop_oneof![
        (
            any::<u32>(),
            text(),
            text(),
            any::<bool>(),
            option::of(text())
        )
            .prop_map(
                |(vmid, from, storage, keep, profile)| DispatchAction::Provision {
                    vmid,
                    from,
                    storage,
                    keep,
                    profile,
                    isolate_network: None,
                }
            ),
        any::<u32>().prop_map(|vmid| DispatchAction::Destroy { vmid }),
        any::<bool>().prop_map(|dry_run| DispatchAction::RestoreTest { dry_run }),
        Just(DispatchAction::InventoryRequest),
    ]
}

fn hub_message() -> impl Strategy<Value = HubMessage> {
    prop_oneof![
        (any::<u32>(), text(), 1u32..).prop_map(|(version, session, secs)| {
            HubMessage::Welcome(Welcome {
                version,
                session,
                heartbeat_interval_secs: NonZeroU32::new(secs).unwrap(),
            })
        }),
        (txn_id(), dispatch_action())
            .prop_map(|(txn, action)| HubMessage::Dispatch(Dispatch { txn, action })),
        ack().prop_map(HubMessage::Ack),
        protocol_error().prop_map(HubMessage::ProtocolError),
    ]
}

/// An envelope in any version this crate speaks that has the message's type.
fn envelope<M: Message + std::fmt::Debug>(
    message: impl Strategy<Value = M>,
) -> impl Strategy<Value = Envelope<M>> {
    (
        any::<prop::sample::Index>(),
        message_id(),
        timestamp(),
        message,
    )
        .prop_map(|(pick, id, ts, message)| {
            let versions: Vec<u32> = SUPPORTED_VERSIONS
                .iter()
                .copied()
                .filter(|v| *v >= message.since())
                .collect();
            let v = versions[pick.index(versions.len())];
            Envelope { v, id, ts, message }
        })
}

/// Decoding must not panic, and an error must be one a peer can be sent.
fn decode_is_total<M: Message>(frame: &str) {
    if let Err(err) = decode::<M>(frame) {
        assert!(err.message.len() <= MAX_ERROR_MESSAGE_BYTES);
        assert!(!err.message.is_empty());
    }
}

/// A frame that decodes re-encodes to an equal envelope.
fn decoded_frames_round_trip<M: Message + PartialEq + std::fmt::Debug>(frame: &str) {
    if let Ok(env) = decode::<M>(frame) {
        if let Ok(again) = encode(&env) {
            assert_eq!(decode::<M>(&again), Ok(env));
        }
    }
}

/// JSON values that look a little like envelopes, to get past the syntax check.
fn envelope_like_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        text().prop_map(Value::from),
        Just(Value::from("01KJMMA2G04TFF59TDWH9EDD1R")),
        Just(Value::from("2026-03-01T12:00:00Z")),
        select(
            AgentMessage::TYPES
                .iter()
                .chain(HubMessage::TYPES)
                .copied()
                .collect::<Vec<_>>()
        )
        .prop_map(Value::from),
    ];
    let key = select(vec![
        "v", "id", "type", "ts", "body", "txn", "action", "vmid", "ids", "seq", "x",
    ])
    .prop_map(str::to_owned);
    leaf.prop_recursive(4, 32, 6, move |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::from),
            vec((key.clone(), inner), 0..6)
                .prop_map(|pairs| Value::Object(pairs.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decode_never_panics_on_arbitrary_text(frame in any::<String>()) {
        decode_is_total::<AgentMessage>(&frame);
        decode_is_total::<HubMessage>(&frame);
    }

    #[test]
    fn decode_never_panics_on_envelope_like_json(value in envelope_like_json()) {
        let frame = value.to_string();
        decode_is_total::<AgentMessage>(&frame);
        decode_is_total::<HubMessage>(&frame);
        decoded_frames_round_trip::<AgentMessage>(&frame);
        decoded_frames_round_trip::<HubMessage>(&frame);
    }

    #[test]
    fn decode_never_panics_on_damaged_frames(
        env in envelope(agent_message()),
        cut in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let frame = encode(&env).unwrap();
        let mut damaged = frame.clone().into_bytes();
        damaged.truncate(cut.index(frame.len() + 1));
        let at = at.index(damaged.len() + 1);
        damaged.insert(at, byte);
        let damaged = String::from_utf8_lossy(&damaged);
        decode_is_total::<AgentMessage>(&damaged);
        decode_is_total::<HubMessage>(&damaged);
        decoded_frames_round_trip::<AgentMessage>(&damaged);
    }

    #[test]
    fn agent_messages_round_trip(env in envelope(agent_message())) {
        let frame = encode(&env).unwrap();
        // An error code newer than the frame's version goes out as that version's.
        let expected = in_version(env.clone());
        prop_assert_eq!(decode::<AgentMessage>(&frame), Ok(expected.clone()));
        let value: Value = serde_json::from_str(&frame).unwrap();
        prop_assert_eq!(&value["type"], &Value::from(env.type_name()));
        prop_assert_eq!(decode_value::<AgentMessage>(value), Ok(expected));
    }

    #[test]
    fn hub_messages_round_trip(env in envelope(hub_message())) {
        let frame = encode(&env).unwrap();
        prop_assert_eq!(decode::<HubMessage>(&frame), Ok(env.clone()));
        let value: Value = serde_json::from_str(&frame).unwrap();
        prop_assert_eq!(&value["type"], &Value::from(env.type_name()));
        prop_assert_eq!(decode_value::<HubMessage>(value), Ok(env));
    }

    #[test]
    fn a_message_in_a_version_before_its_type_is_refused_both_ways(
        env in envelope(coverage().prop_map(AgentMessage::Coverage)),
    ) {
        let since = env.message.since();
        prop_assert_eq!(since, 2);
        let early = Envelope { v: since - 1, ..env.clone() };
        prop_assert!(encode(&early).is_err());
        let mut value: Value = serde_json::from_str(&encode(&env).unwrap()).unwrap();
        value["v"] = Value::from(since - 1);
        let err = decode::<AgentMessage>(&value.to_string()).unwrap_err();
        prop_assert_eq!(err.code, ProtocolErrorCode::UnknownType);
        prop_assert_eq!(err.offending_id, Some(env.id));
    }

    #[test]
    fn timestamps_round_trip(ts in timestamp()) {
        let text = serde_json::to_string(&ts).unwrap();
        prop_assert_eq!(serde_json::from_str::<Timestamp>(&text).unwrap(), ts);
    }

    #[test]
    fn ids_round_trip_as_canonical_text(n in any::<u128>()) {
        let id = MessageId::from_ulid(n.into());
        let text = id.to_string();
        prop_assert_eq!(text.len(), 26);
        prop_assert_eq!(MessageId::parse(&text), Ok(id));
        prop_assert_eq!(MessageId::parse(&text.to_lowercase()), Ok(id));
    }
}

proptest! {
    // Each case builds and encodes tables of up to a frame's size: fewer cases.
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn a_bounded_coverage_always_fits_a_frame(
        rows in vec(coverage_row(), 0..40),
        copies in 1usize..400,
        pad in 0usize..6000,
        at in timestamp(),
    ) {
        // Rows made large by long texts, repeated past what one frame holds.
        let long = "\u{1}é".repeat(pad);
        let rows: Vec<CoverageRow> = rows
            .into_iter()
            .cycle()
            .take(copies * 3)
            .map(|mut r| {
                r.name.push_str(&long);
                r.proven_gone = Some(long.clone());
                r
            })
            .collect();
        let n = rows.len();
        let coverage = Coverage::bounded(&long, at.clone(), rows);
        prop_assert_eq!(coverage.guest_count as usize, n);
        prop_assert!(coverage.guests.len() <= MAX_COVERAGE_ROWS.min(n));
        prop_assert!(coverage.guests.windows(2).all(|w| w[0].vmid <= w[1].vmid));
        let env = Envelope { v: 2, id: MessageId::from_ulid(1u128.into()), ts: at, message: AgentMessage::Coverage(coverage) };
        let frame = encode(&env).unwrap();
        prop_assert!(frame.len() <= MAX_FRAME_BYTES);
        prop_assert_eq!(decode::<AgentMessage>(&frame), Ok(env));
    }
}
