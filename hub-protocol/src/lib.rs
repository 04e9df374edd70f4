//! Wire types of the felhom agent ↔ hub websocket protocol. No IO lives here: no sockets, no
//! clock, no files. Both ends (the agent's session in `felhom-agent run` and any hub) share
//! these types, and the golden files in `tests/golden/` pin their JSON.
//!
//! # Frames
//!
//! One websocket text message is one frame, one JSON object of at most [`MAX_FRAME_BYTES`]:
//!
//! ```json
//! {"v":1,"id":"01JQ3V6B4TN3R5W9X0Y2Z4A6C8","type":"heartbeat","ts":"2026-03-01T12:00:00Z",
//!  "body":{"seq":7,"uptime_secs":3600,"in_flight":1,"outbox_depth":0}}
//! ```
//!
//! `v` is the protocol version, `id` the message id (a ULID), `type` names the body's shape,
//! `ts` is when the message was created (UTC, RFC 3339) and `body` is the message. The agent
//! sends [`AgentMessage`]s (`hello`, `heartbeat`, `inventory`, `event`, `result`, `ack`,
//! `protocol_error`, and from version 2 on `coverage`); the hub sends [`HubMessage`]s
//! (`welcome`, `dispatch`, `ack`, `protocol_error`). [`decode`] and [`encode`] turn frames into
//! [`Envelope`]s and back.
//!
//! # Versions
//!
//! - **1**: the messages above but `coverage`. Results and events of a restore-test copy
//!   (kind `selftest-restore` in this version) name the guest whose backup it proves and that
//!   backup (`guest`, `backup`; optional fields, absent for other kinds). The result of a
//!   copy that is a member of an application group carries [`GroupInfo`] (`group`: the
//!   group's name, its run's id shared by every member's result of that run, the member's
//!   place and the members; an optional field, added within the version, that an older peer
//!   ignores and whose absence means a copy proven alone).
//! - **2**: adds the agent's [`Coverage`] message (`coverage`): after every restore-test run
//!   that worked it out, the table of the node's pool guests and whether each one's newest
//!   backup is proven, as `felhom-agent restore-report --json` shows it (bounded: at most
//!   [`MAX_COVERAGE_ROWS`] rows, texts clipped, one frame). It is stored, re-sent and
//!   acknowledged like a result; a newer table supersedes an older one not yet acknowledged.
//!   An agent whose session negotiated version 1 sends no `coverage` (it drops the tables
//!   waiting for such a hub: a table is a snapshot and the next run makes a new one).
//!   A check that could not judge its guest has the status `skipped` ([`CheckStatus`]; a
//!   version 1 frame carries it as `error`, its message saying why: never as `pass`), and
//!   the restore test's kind is named `restore-test` (a version 1 frame: `selftest-restore`;
//!   either name decodes in either version). A coverage row names the application group
//!   its guest is proven with (`group`, optional, added within the version; absent for a
//!   guest proven alone).
//!
//! ```
//! use hub_protocol::{decode, encode, AgentMessage, Envelope, Heartbeat, MessageId, Timestamp};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let frame = encode(&Envelope::new(
//!     1,
//!     MessageId::parse("01JQ3V6B4TN3R5W9X0Y2Z4A6C8")?,
//!     Timestamp::parse("2026-03-01T12:00:00Z")?,
//!     AgentMessage::Heartbeat(Heartbeat { seq: 7, uptime_secs: 3600, in_flight: 1, outbox_depth: 0 }),
//! ))?;
//! let back: Envelope<AgentMessage> = decode(&frame)?;
//! assert_eq!(back.type_name(), "heartbeat");
//! # Ok(())
//! # }
//! ```
//!
//! # Delivery rules
//!
//! - **At least once, both ways.** Every message except `ack` and `heartbeat` must be
//!   acknowledged by its id in an `ack` ([`Message::needs_ack`]). The receiver acks once it has
//!   acted on the message or stored it durably (the hub: the event, result or coverage is
//!   recorded; the agent: the dispatch is journaled).
//! - **Nothing lost.** The sender keeps every unacknowledged `event`, `result`, `inventory` and
//!   `coverage` (the agent, in its durable outbox) and every unacknowledged `dispatch` (the
//!   hub), and sends it again after a reconnect until it is acknowledged (the one exception: a
//!   `coverage` waiting while the session is of version 1, see *Versions*). The other messages
//!   belong to their session (`hello`, `welcome`, `heartbeat`, `ack`, `protocol_error`) and are
//!   never re-sent in a later one; a new session starts with a new hello.
//! - **Re-send in order.** After a reconnect and the new welcome, a sender first re-sends its
//!   unacknowledged messages in the order they were first queued, unchanged (same `id`, same
//!   `ts`; only `v` follows the new session), then goes on with new ones.
//! - **De-duplicate by id.** A receiver may see a message twice. It applies a message id at
//!   most once and acks a duplicate again. The agent also de-duplicates dispatches by their
//!   transaction id: a dispatch whose `txn` it already knows is not run again; the agent
//!   re-reports that transaction's state (its result, once it has one).
//! - **Heartbeats** are neither acknowledged, stored nor re-sent. A newer `inventory` sent on
//!   connect or change, and a newer `coverage`, supersede an older one of their kind that is
//!   not yet acknowledged; the sender may drop the older.
//! - **Protocol errors.** A frame that cannot be decoded is answered with a `protocol_error`
//!   (what [`decode`] returned, naming the offending id when the frame had a readable one) and
//!   is not acknowledged; the session goes on. Decoding never panics. A sender told that one of
//!   its messages was refused keeps it (it is not acknowledged) and reports it; it never drops
//!   it silently. A receiver may close a session that keeps sending bad frames.
//!
//! # Versioning rules
//!
//! - **Negotiated in the handshake.** The agent's first frame is a `hello` listing every
//!   version it speaks (`protocol_versions`); it sends nothing else before the welcome. The hub picks the highest common one
//!   ([`negotiate`]) and answers with a `welcome` naming it (`version`), or with a
//!   `protocol_error` `unsupported_version` and closes when there is none. Handshake frames are
//!   always written in [`HANDSHAKE_VERSION`] so any later peer can read them; every frame after
//!   the welcome carries the chosen version. A frame in another version is answered with
//!   `unsupported_version`.
//! - **Additive within a version.** A version may gain fields, never lose or retype them; a new
//!   field is optional and its absence means what the version meant before. Receivers ignore
//!   fields they do not know, in the envelope and in every body.
//! - **New types are a new version.** New message types, dispatch actions and enumerated values
//!   (phases, outcomes, codes) need a new version. A message type the receiver does not know is
//!   answered with a `protocol_error` `unknown_type`, never a crash or a dropped session; so is
//!   a type the frame's version does not have (a `coverage` frame of version 1), see
//!   [`Message::type_since`]. A sender never writes a type into an earlier version's frame
//!   ([`encode`] refuses it). An error code newer than the frame's version goes out as the
//!   code that version has for it ([`ErrorCode::since`], [`ErrorCode::in_version`]; [`encode`]
//!   maps it), the message still saying what happened; so does a check status
//!   ([`CheckStatus::since`], [`CheckStatus::in_version`]) and a kind's name
//!   ([`TxnKind::name_in_version`]).
//! - **Capabilities** (in the hello) are an open list of names; unknown names are ignored, and
//!   the hub dispatches only actions whose capability the agent announced.

mod ack;
mod agent;
mod codec;
mod coverage;
mod error;
mod hub;
mod ids;
mod timestamp;
mod txn;
mod version;

pub use ack::Ack;
pub use agent::{
    backup_text, capability, AgentMessage, Event, GroupInfo, GuestStatus, GuestType, Heartbeat,
    Hello, HostFacts, Inventory, PoolGuest, TxnResult, MAX_GROUP_MEMBERS, MAX_GROUP_NAME_BYTES,
    MAX_ISOLATION_BYTES,
};
pub use codec::{
    decode, decode_value, encode, AgentEnvelope, EncodeError, Envelope, HubEnvelope, Message,
    MAX_FRAME_BYTES,
};
pub use coverage::{
    BackupRef, BackupTest, Coverage, CoverageRow, CoverageStatus, ProvenPoint, TestVerdict,
    MAX_BACKUP_BYTES, MAX_CHECK_NAME_BYTES, MAX_COVERAGE_ROWS, MAX_FAILING_CHECKS,
    MAX_GUEST_NAME_BYTES, MAX_NODE_BYTES, MAX_TEST_MESSAGE_BYTES,
};
pub use error::{ProtocolError, ProtocolErrorCode, MAX_ERROR_MESSAGE_BYTES};
pub use hub::{Dispatch, DispatchAction, HubMessage, Welcome};
pub use ids::{InvalidUlid, MessageId, TxnId};
pub use timestamp::{InvalidTimestamp, Timestamp};
pub use txn::{CheckReport, CheckRow, CheckStatus, ErrorCode, ErrorInfo, Outcome, Phase, TxnKind};
pub use version::{negotiate, HANDSHAKE_VERSION, PROTOCOL_VERSION, SUPPORTED_VERSIONS};

/// The longest prefix of `text` that fits in `max_bytes` and ends on a char boundary.
pub(crate) fn clip(text: &str, max_bytes: usize) -> &str {
    if text.len() <= max_bytes {
        return text;
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}
