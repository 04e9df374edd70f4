//! Bad frames from the hub: malformed JSON, a frame over the protocol's size limit, an unknown
//! message type, a wrong version, a bad body and a binary message are each answered with a
//! `protocol_error` carrying the right code, and the session goes on. A websocket message too
//! large to read at all ends the session, and the agent reconnects. The agent process never
//! dies, and it still answers real work afterwards.

use std::time::Duration;

use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{AgentFiles, AgentOptions, FakePve};
use hub_protocol::{DispatchAction, ProtocolErrorCode, MAX_FRAME_BYTES};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);
const ID: &str = "01JQ3V6B4TN3R5W9X0Y2Z4A6C8";

fn frame(type_name: &str, body: serde_json::Value) -> String {
    json!({"v": 1, "id": ID, "type": type_name, "ts": "2026-03-01T12:00:00Z", "body": body})
        .to_string()
}

#[test]
fn bad_frames_get_protocol_errors_and_never_kill_the_agent() {
    let pve = FakePve::demo();
    let hub = DevHub::start(DevHubOptions::default());
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    let mut agent = AgentDaemon::spawn(&files.config_path, FAST_TIMING, &[]);
    hub.wait_for("the session", WAIT, |s| {
        s.sessions == 1 && !s.inventories.is_empty()
    });

    let oversized = frame(
        "dispatch",
        json!({"txn": ID, "action": "inventory_request", "pad": "x".repeat(MAX_FRAME_BYTES)}),
    );
    let cases: Vec<(&str, String, ProtocolErrorCode)> = vec![
        ("not JSON", "{\"v\":1,".to_string(), ProtocolErrorCode::Malformed),
        ("a JSON array", "[1,2,3]".to_string(), ProtocolErrorCode::Malformed),
        (
            "an unknown type",
            frame("reboot_everything", json!({})),
            ProtocolErrorCode::UnknownType,
        ),
        (
            "an agent-only type",
            frame("heartbeat", json!({"seq": 1, "uptime_secs": 1, "in_flight": 0, "outbox_depth": 0})),
            ProtocolErrorCode::UnknownType,
        ),
        (
            "a version nobody speaks",
            json!({"v": 99, "id": ID, "type": "ack", "ts": "2026-03-01T12:00:00Z", "body": {"ids": []}})
                .to_string(),
            ProtocolErrorCode::UnsupportedVersion,
        ),
        (
            "a dispatch with a bad body",
            frame("dispatch", json!({"txn": "not-a-ulid", "action": "destroy", "vmid": 120})),
            ProtocolErrorCode::InvalidField,
        ),
        ("an oversized frame", oversized, ProtocolErrorCode::Oversized),
    ];
    for (what, text, code) in &cases {
        let before = hub.snapshot().protocol_errors.len();
        assert_eq!(hub.send_raw(text.clone()), 1, "{what}: no open session");
        let state = hub.wait_for(&format!("the protocol error answering {what}"), WAIT, |s| {
            s.protocol_errors.len() > before
        });
        let error = &state.protocol_errors[before];
        assert_eq!(error.code, *code, "{what}: {error}");
        assert!(error.message.len() <= 512, "{what}: unbounded message");
        assert!(agent.alive(), "the agent died on {what}");
        assert_eq!(state.sessions, 1, "{what} cost the session");
    }
    // The offending id is named when the frame had a readable one.
    let state = hub.snapshot();
    assert!(state.protocol_errors[2..6]
        .iter()
        .all(|e| e.offending_id.map(|i| i.to_string()) == Some(ID.to_string())));

    // A binary message is not part of the protocol.
    let before = hub.snapshot().protocol_errors.len();
    assert_eq!(hub.send_binary(vec![0xff, 0x00, 0x13]), 1);
    let state = hub.wait_for("the protocol error answering a binary message", WAIT, |s| {
        s.protocol_errors.len() > before
    });
    assert_eq!(
        state.protocol_errors[before].code,
        ProtocolErrorCode::Malformed
    );
    assert_eq!(state.sessions, 1);

    // A message far beyond what the agent reads at all ends the session; it reconnects.
    let huge = frame(
        "ack",
        json!({"ids": [], "pad": "y".repeat(5 * MAX_FRAME_BYTES)}),
    );
    assert_eq!(hub.send_raw(huge), 1);
    hub.wait_for("a new session after the huge message", WAIT, |s| {
        s.sessions == 2
    });
    assert!(agent.alive(), "the agent died on the huge message");

    // The agent still works: an inventory request is answered.
    let txn = hub.dispatch(DispatchAction::InventoryRequest);
    hub.wait_for("the inventory", WAIT, |s| s.inventory_replies(txn) == 1);

    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
    assert!(!log.contains("panicked"), "the agent panicked:\n{log}");
}
