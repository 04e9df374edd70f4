//! Bad frames from the hub: malformed JSON, a frame over the protocol's size limit, an unknown
//! message type, a wrong version (one nobody speaks, or one the session did not choose), a bad
//! body and a binary message are each answered with a
//! `protocol_error` carrying the right code, and the session goes on. A websocket message too
//! large to read at all ends the session, and the agent reconnects. The agent process never
//! dies, and it still answers real work afterwards.

use std::time::Duration;

use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{AgentFiles, AgentOptions, FakePve};
use hub_protocol::{DispatchAction, ProtocolErrorCode, MAX_FRAME_BYTES, PROTOCOL_VERSION};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);
const ID: &str = "01JQ3V6B4TN3R5W9X0Y2Z4A6C8";

/// A frame in the session's version (the dev hub picks the newest, which the agent speaks).
fn frame(type_name: &str, body: serde_json::Value) -> String {
    json!({"v": PROTOCOL_VERSION, "id": ID, "type": type_name, "ts": "2026-03-01T12:00:00Z", "body": body})
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
        (
            "a frame of version 1 in a session of version 2",
            json!({"v": 1, "id": ID, "type": "ack", "ts": "2026-03-01T12:00:00Z", "body": {"ids": []}})
                .to_string(),
            ProtocolErrorCode::UnsupportedVersion,
        ),
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

/// Text from the hub reaches the log as one escaped, clipped line: a `protocol_error` whose
/// message holds a newline cannot forge a log line of its own, and a dispatch naming a huge
/// backup volume id is refused as malformed before anything is stored or run.
#[test]
fn hub_text_cannot_forge_log_lines_or_grow_the_journal() {
    let pve = FakePve::demo();
    let hub = DevHub::start(DevHubOptions::default());
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    let agent = AgentDaemon::spawn(&files.config_path, FAST_TIMING, &[]);
    hub.wait_for("the session", WAIT, |s| {
        s.sessions == 1 && !s.inventories.is_empty()
    });
    let forged = "2026-03-01T12:00:00Z ERROR FORGED-LINE the agent destroyed vmid 100";
    let message = format!("a bad frame\n{forged}\r\n\u{1b}[2K{}", "z".repeat(400));
    assert_eq!(
        hub.send_raw(frame(
            "protocol_error",
            json!({"code": "malformed", "message": message})
        )),
        1
    );
    agent.wait_for_log("did not accept one of our messages", WAIT);
    let log = agent.log();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("FORGED-LINE")).collect();
    assert_eq!(lines.len(), 1, "one line holds the hub's text: {lines:#?}");
    assert!(
        lines[0].contains("did not accept one of our messages") && lines[0].contains("\\n"),
        "the newline is escaped inside the agent's own line: {}",
        lines[0]
    );
    assert!(
        !log.contains('\u{1b}'),
        "no raw escape sequence reaches the log"
    );
    assert!(
        lines[0].len() < 1024 && lines[0].contains("more bytes clipped"),
        "the hub's text is clipped: {} bytes",
        lines[0].len()
    );

    // A provision naming a 512 KiB backup volume id: refused as malformed, never run.
    let before = hub.snapshot().protocol_errors.len();
    let txn = "01JQ3V6B4TN3R5W9X0Y2Z4A6D9";
    let dispatch = frame(
        "dispatch",
        json!({"txn": txn, "action": "provision", "vmid": 140, "from": format!("local:backup/{}", "v".repeat(512 * 1024)), "storage": "local-lvm", "keep": false}),
    );
    assert_eq!(hub.send_raw(dispatch), 1);
    let state = hub.wait_for(
        "the protocol error answering the huge dispatch",
        WAIT,
        |s| s.protocol_errors.len() > before,
    );
    let error = &state.protocol_errors[before];
    assert_eq!(error.code, ProtocolErrorCode::Malformed, "{error}");
    assert!(error.message.contains("`from`"), "{error}");
    assert!(
        pve.writes().is_empty(),
        "nothing was provisioned: {:?}",
        pve.writes()
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(hub.snapshot().results.is_empty(), "no transaction ran");
    let journal = std::fs::read(files.state_dir.join("journal")).unwrap_or_default();
    assert!(
        journal.len() < 64 * 1024,
        "the journal did not take the hub's string: {} bytes",
        journal.len()
    );
}

/// A welcome whose session name is 900 KiB with a newline in it: the agent logs it as part of
/// one line, escaped and clipped, and the session works.
#[test]
fn a_huge_session_name_is_logged_clipped_on_one_line() {
    let pve = FakePve::demo();
    let name = format!("evil\nFORGED-SESSION {}", "s".repeat(900 * 1024));
    let hub = DevHub::start(DevHubOptions {
        session_name: Some(name),
        ..DevHubOptions::default()
    });
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    let agent = AgentDaemon::spawn(&files.config_path, FAST_TIMING, &[]);
    hub.wait_for("the session", WAIT, |s| {
        s.sessions == 1 && !s.inventories.is_empty()
    });
    agent.wait_for_log("connected to the hub", WAIT);
    let log = agent.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("FORGED-SESSION"))
        .collect();
    assert!(!lines.is_empty(), "the session name is logged");
    for line in &lines {
        assert!(
            line.contains("connected to the hub"),
            "a line of its own: {line:.200}"
        );
        assert!(line.len() < 2048, "clipped: {} bytes", line.len());
    }
}
