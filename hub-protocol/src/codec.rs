//! The envelope and the frame codec.
//!
//! A frame is one websocket text message holding one JSON object:
//! `{"v":1,"id":"<ULID>","type":"<type>","ts":"<RFC 3339 UTC>","body":{…}}`. The decoder reads
//! it in stages so each way a frame can be wrong gets its own [`ProtocolErrorCode`]: size, JSON
//! syntax, version, message type, then the fields. Unknown fields anywhere are ignored.

use std::fmt;

use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::error::{ProtocolError, ProtocolErrorCode};
use crate::ids::MessageId;
use crate::timestamp::Timestamp;
use crate::version::SUPPORTED_VERSIONS;
use crate::{clip, AgentMessage, HubMessage};

/// The largest frame either side sends or accepts, in bytes (1 MiB). Checked before parsing.
pub const MAX_FRAME_BYTES: usize = 1024 * 1024;

pub(crate) mod sealed {
    /// How a message set maps its variants to and from wire bodies. Private: only the crate's
    /// two message sets implement it.
    pub trait Codec: Sized {
        /// Serializes the body of this message (without type or envelope).
        fn serialize_body<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error>;
        /// Builds a message from its wire type and body; `None` when the type is unknown.
        fn deserialize_body(
            type_name: &str,
            body: serde_json::Value,
        ) -> Option<Result<Self, serde_json::Error>>;
    }
}

/// The messages one side sends: [`AgentMessage`] (agent to hub) or [`HubMessage`] (hub to
/// agent). Sealed.
pub trait Message: sealed::Codec {
    /// The direction, as error messages name it (`agent-to-hub`).
    const DIRECTION: &'static str;
    /// Every wire type of this direction, in every version this crate speaks.
    const TYPES: &'static [&'static str];

    /// The protocol version that brought the wire type `type_name` (1 for the types of the
    /// first version); `None` when it is not a type of this direction. A frame of an earlier
    /// version cannot carry it.
    fn type_since(type_name: &str) -> Option<u32>;

    /// The wire `type` of this message.
    fn type_name(&self) -> &'static str;

    /// The protocol version that brought this message's type: an envelope of an earlier
    /// version cannot carry it.
    fn since(&self) -> u32 {
        Self::type_since(self.type_name()).unwrap_or(1)
    }

    /// Whether the receiver must acknowledge this message by id: everything except `ack` and
    /// `heartbeat`.
    fn needs_ack(&self) -> bool;
}

/// One message with its envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope<M> {
    /// The protocol version the frame is written in.
    pub v: u32,
    /// The message id; receivers de-duplicate and acknowledge by it.
    pub id: MessageId,
    /// When the message was created (UTC). A re-sent message keeps its id and its timestamp.
    pub ts: Timestamp,
    /// The message; it gives the envelope's `type` and `body`.
    pub message: M,
}

/// An envelope sent by the agent.
pub type AgentEnvelope = Envelope<AgentMessage>;
/// An envelope sent by the hub.
pub type HubEnvelope = Envelope<HubMessage>;

impl<M: Message> Envelope<M> {
    /// Wraps a message.
    pub fn new(v: u32, id: MessageId, ts: Timestamp, message: M) -> Self {
        Self { v, id, ts, message }
    }

    /// The wire `type` of the message inside.
    pub fn type_name(&self) -> &'static str {
        self.message.type_name()
    }
}

struct BodyOf<'a, M>(&'a M);

impl<M: Message> Serialize for BodyOf<'_, M> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize_body(s)
    }
}

impl<M: Message> Serialize for Envelope<M> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(5))?;
        map.serialize_entry("v", &self.v)?;
        map.serialize_entry("id", &self.id)?;
        map.serialize_entry("type", self.message.type_name())?;
        map.serialize_entry("ts", &self.ts)?;
        map.serialize_entry("body", &BodyOf(&self.message))?;
        map.end()
    }
}

impl<'de, M: Message> Deserialize<'de> for Envelope<M> {
    /// Applies the same checks as [`decode_value`] (all but the frame size).
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        decode_value(value).map_err(serde::de::Error::custom)
    }
}

/// Decodes one frame.
///
/// Checks, in order: the size (`oversized`, before any parsing), JSON syntax and that the frame
/// is an object (`malformed`), `v` (`invalid_field`, or `unsupported_version` when it is not in
/// [`SUPPORTED_VERSIONS`]), `id` (`invalid_field`), `type` (`invalid_field`, or `unknown_type`
/// when it is not a type of this direction in the frame's version: a `coverage` frame of
/// version 1 is an unknown type), `ts` and then the body (`invalid_field`). The
/// error carries the frame's id whenever it had a readable one, so it can be sent back as a
/// `protocol_error` as it is. Never panics.
pub fn decode<M: Message>(frame: &str) -> Result<Envelope<M>, ProtocolError> {
    if frame.len() > MAX_FRAME_BYTES {
        return Err(ProtocolError::new(
            ProtocolErrorCode::Oversized,
            format!(
                "frame of {} bytes exceeds the limit of {MAX_FRAME_BYTES} bytes",
                frame.len()
            ),
        ));
    }
    let value: Value = serde_json::from_str(frame).map_err(|e| {
        ProtocolError::new(
            ProtocolErrorCode::Malformed,
            format!("frame is not valid JSON: {e}"),
        )
    })?;
    decode_value(value)
}

/// Decodes an envelope that is already parsed JSON (for example one read back from a store).
/// The same checks as [`decode`] except the frame size.
pub fn decode_value<M: Message>(value: Value) -> Result<Envelope<M>, ProtocolError> {
    let Value::Object(mut object) = value else {
        return Err(ProtocolError::new(
            ProtocolErrorCode::Malformed,
            format!("frame is JSON {} instead of an object", kind_of(&value)),
        ));
    };
    // Read the id leniently first, so every later error can name the offending message.
    let readable_id = object
        .get("id")
        .and_then(Value::as_str)
        .and_then(|s| MessageId::parse(s).ok());
    let invalid = |field: &str, why: String| {
        ProtocolError::new(
            ProtocolErrorCode::InvalidField,
            format!("invalid field `{field}`: {why}"),
        )
        .with_offending_id(readable_id)
    };

    let v = match object.get("v") {
        None => return Err(invalid("v", "missing".to_owned())),
        Some(raw) => raw
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                invalid(
                    "v",
                    format!(
                        "expected the protocol version as an unsigned integer, found {}",
                        describe(raw)
                    ),
                )
            })?,
    };
    if !SUPPORTED_VERSIONS.contains(&v) {
        return Err(ProtocolError::new(
            ProtocolErrorCode::UnsupportedVersion,
            format!("protocol version {v} is not supported (supported: {SUPPORTED_VERSIONS:?})"),
        )
        .with_offending_id(readable_id));
    }

    let id = match object.get("id") {
        None => return Err(invalid("id", "missing".to_owned())),
        Some(Value::String(text)) => {
            MessageId::parse(text).map_err(|e| invalid("id", e.to_string()))?
        }
        Some(other) => {
            return Err(invalid(
                "id",
                format!("expected ULID text, found {}", describe(other)),
            ))
        }
    };

    let type_name = match object.remove("type") {
        None => return Err(invalid("type", "missing".to_owned())),
        Some(Value::String(text)) => text,
        Some(other) => {
            return Err(invalid(
                "type",
                format!("expected a string, found {}", describe(&other)),
            ))
        }
    };
    match M::type_since(&type_name) {
        None => return Err(unknown_type::<M>(&type_name, id)),
        Some(since) if since > v => {
            return Err(ProtocolError::new(
                ProtocolErrorCode::UnknownType,
                format!(
                    "{} message type `{type_name}` is not part of protocol version {v} (it came \
                     with version {since})",
                    M::DIRECTION
                ),
            )
            .with_offending_id(Some(id)))
        }
        Some(_) => {}
    }

    let ts = match object.get("ts") {
        None => return Err(invalid("ts", "missing".to_owned())),
        Some(Value::String(text)) => {
            Timestamp::parse(text).map_err(|e| invalid("ts", e.to_string()))?
        }
        Some(other) => {
            return Err(invalid(
                "ts",
                format!("expected RFC 3339 UTC text, found {}", describe(other)),
            ))
        }
    };

    let Some(body) = object.remove("body") else {
        return Err(invalid("body", "missing".to_owned()));
    };
    let message = match M::deserialize_body(&type_name, body) {
        None => return Err(unknown_type::<M>(&type_name, id)),
        Some(Err(e)) => {
            return Err(invalid(
                "body",
                format!("not a valid `{type_name}` body: {e}"),
            ))
        }
        Some(Ok(message)) => message,
    };
    Ok(Envelope { v, id, ts, message })
}

fn unknown_type<M: Message>(type_name: &str, id: MessageId) -> ProtocolError {
    ProtocolError::new(
        ProtocolErrorCode::UnknownType,
        format!(
            "unknown {} message type `{}` (known: {})",
            M::DIRECTION,
            clip(type_name, 64),
            M::TYPES.join(", ")
        ),
    )
    .with_offending_id(Some(id))
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A short description of a JSON value for an error message.
fn describe(value: &Value) -> String {
    match value {
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string `{}`", clip(s, 40)),
        other => kind_of(other).to_owned(),
    }
}

/// An envelope that cannot be sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodeError {
    /// The encoded frame would exceed [`MAX_FRAME_BYTES`]; the peer would refuse it. The sender
    /// must shrink the message (for example bound the check rows) instead of sending it.
    Oversized {
        /// The message type.
        type_name: &'static str,
        /// The encoded length in bytes.
        len: usize,
    },
    /// The message's type is not part of the envelope's protocol version (a `coverage` in a
    /// version 1 envelope); the peer would refuse it as an unknown type.
    NotInVersion {
        /// The message type.
        type_name: &'static str,
        /// The envelope's version.
        version: u32,
        /// The version that brought the type.
        since: u32,
    },
    /// The message could not be serialized.
    Json(String),
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Oversized { type_name, len } => write!(
                f,
                "encoded `{type_name}` frame of {len} bytes exceeds the limit of {MAX_FRAME_BYTES} bytes"
            ),
            Self::NotInVersion {
                type_name,
                version,
                since,
            } => write!(
                f,
                "a `{type_name}` message cannot be sent in protocol version {version}; it came with version {since}"
            ),
            Self::Json(e) => write!(f, "cannot encode frame: {e}"),
        }
    }
}

impl std::error::Error for EncodeError {}

/// Encodes an envelope as one text frame, refusing frames the peer would reject: oversized,
/// or of a message type the envelope's version does not have.
pub fn encode<M: Message>(envelope: &Envelope<M>) -> Result<String, EncodeError> {
    let since = envelope.message.since();
    if since > envelope.v {
        return Err(EncodeError::NotInVersion {
            type_name: envelope.type_name(),
            version: envelope.v,
            since,
        });
    }
    let frame = if envelope.v < crate::PROTOCOL_VERSION {
        // An earlier version's frame carries only that version's error codes, check statuses
        // and kind names.
        let mut value =
            serde_json::to_value(envelope).map_err(|e| EncodeError::Json(e.to_string()))?;
        codes_in_version(&mut value, envelope.v);
        if let Some(body) = value.get_mut("body") {
            body_in_version(body, envelope.v);
        }
        serde_json::to_string(&value)
    } else {
        serde_json::to_string(envelope)
    }
    .map_err(|e| EncodeError::Json(e.to_string()))?;
    if frame.len() > MAX_FRAME_BYTES {
        return Err(EncodeError::Oversized {
            type_name: envelope.type_name(),
            len: frame.len(),
        });
    }
    Ok(frame)
}

/// Every `code` of the frame that is an [`ErrorCode`] newer than `v`, replaced by the code
/// `v` has for it ([`ErrorCode::in_version`]).
fn codes_in_version(value: &mut Value, v: u32) {
    match value {
        Value::Object(map) => {
            for (k, item) in map.iter_mut() {
                if k == "code" {
                    if let Ok(code) = serde_json::from_value::<crate::ErrorCode>(item.clone()) {
                        if code.since() > v {
                            *item = Value::String(code.in_version(v).as_str().to_string());
                        }
                        continue;
                    }
                }
                codes_in_version(item, v);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|i| codes_in_version(i, v)),
        _ => {}
    }
}

/// The `kind` of an `event` or `result` body as version `v` names it
/// ([`TxnKind::name_in_version`](crate::TxnKind::name_in_version)), and each of its `checks`
/// whose status is newer than `v` given the status `v` has for it
/// ([`CheckStatus::in_version`](crate::CheckStatus::in_version)); a check that had no message
/// gets one, so the older peer still reads that it was not judged.
fn body_in_version(body: &mut Value, v: u32) {
    if let Some(kind) = body.get_mut("kind") {
        if let Ok(k) = serde_json::from_value::<crate::TxnKind>(kind.clone()) {
            *kind = Value::String(k.name_in_version(v).to_string());
        }
    }
    let Some(Value::Array(checks)) = body.get_mut("checks") else {
        return;
    };
    for check in checks.iter_mut().filter_map(Value::as_object_mut) {
        let Some(status) = check
            .get("status")
            .and_then(|s| serde_json::from_value::<crate::CheckStatus>(s.clone()).ok())
        else {
            continue;
        };
        if status.since() <= v {
            continue;
        }
        check.insert(
            "status".to_string(),
            Value::String(status.in_version(v).as_str().to_string()),
        );
        if check.get("message").is_none_or(Value::is_null) {
            check.insert(
                "message".to_string(),
                Value::String(format!("not judged (a check status of `{status}`)")),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;
    use crate::{
        Ack, CheckReport, CheckStatus, Coverage, CoverageRow, CoverageStatus, Dispatch,
        DispatchAction, Event, Heartbeat, Hello, HostFacts, Inventory, Outcome, Phase, TxnId,
        TxnKind, TxnResult, Welcome,
    };

    const ID: &str = "01JQ3V6B4TN3R5W9X0Y2Z4A6C8";
    const TXN: &str = "01JQ3V6B4TN3R5W9X0Y2Z4A6C9";
    const TS: &str = "2026-03-01T12:00:00Z";

    fn frame(type_name: &str, body: Value) -> Value {
        json!({"v": 1, "id": ID, "type": type_name, "ts": TS, "body": body})
    }

    fn heartbeat_body() -> Value {
        json!({"seq": 1, "uptime_secs": 2, "in_flight": 3, "outbox_depth": 4})
    }

    fn event_body() -> Value {
        json!({"txn": TXN, "kind": "provision", "vmid": 120, "phase": "created",
               "at": TS, "detail": null, "error": null})
    }

    fn agent_err(frame: &Value) -> ProtocolError {
        decode::<AgentMessage>(&frame.to_string()).unwrap_err()
    }

    fn hub_err(frame: &Value) -> ProtocolError {
        decode::<HubMessage>(&frame.to_string()).unwrap_err()
    }

    fn id() -> MessageId {
        MessageId::parse(ID).unwrap()
    }

    #[test]
    fn decodes_a_heartbeat() {
        let env: AgentEnvelope = decode(&frame("heartbeat", heartbeat_body()).to_string()).unwrap();
        assert_eq!(env.v, 1);
        assert_eq!(env.id, id());
        assert_eq!(env.ts.as_str(), TS);
        assert_eq!(
            env.message,
            AgentMessage::Heartbeat(Heartbeat {
                seq: 1,
                uptime_secs: 2,
                in_flight: 3,
                outbox_depth: 4
            })
        );
    }

    /// A heartbeat frame padded (through an ignored field) to exactly `len` bytes.
    fn padded_frame(len: usize) -> String {
        let mut body = heartbeat_body();
        body["pad"] = json!("");
        let base = frame("heartbeat", body).to_string().len();
        let mut body = heartbeat_body();
        body["pad"] = json!("x".repeat(len - base));
        let text = frame("heartbeat", body).to_string();
        assert_eq!(text.len(), len);
        text
    }

    #[test]
    fn a_frame_at_the_limit_decodes_and_one_byte_more_is_oversized() {
        assert!(decode::<AgentMessage>(&padded_frame(MAX_FRAME_BYTES)).is_ok());
        let err = decode::<AgentMessage>(&padded_frame(MAX_FRAME_BYTES + 1)).unwrap_err();
        assert_eq!(err.code, ProtocolErrorCode::Oversized);
        assert!(
            err.message.contains(&(MAX_FRAME_BYTES + 1).to_string()),
            "{err}"
        );
        assert_eq!(err.offending_id, None);
    }

    #[test]
    fn oversized_is_checked_before_parsing() {
        // Not JSON at all, but too long: the size is what is reported.
        let err = decode::<HubMessage>(&"{".repeat(MAX_FRAME_BYTES + 1)).unwrap_err();
        assert_eq!(err.code, ProtocolErrorCode::Oversized);
    }

    #[test]
    fn malformed_frames() {
        let deep = "[".repeat(100_000);
        for text in [
            "",
            " ",
            "{",
            "hello",
            "{\"v\":1,}",
            "{\"v\":1} {\"v\":1}",
            "[1,2]",
            "\"a string\"",
            "42",
            "null",
            deep.as_str(),
        ] {
            let err = decode::<AgentMessage>(text).unwrap_err();
            assert_eq!(err.code, ProtocolErrorCode::Malformed, "{text:.20}: {err}");
            assert_eq!(err.offending_id, None);
            assert!(err.message.len() <= crate::MAX_ERROR_MESSAGE_BYTES);
        }
    }

    #[test]
    fn unsupported_version_names_the_version_and_the_message() {
        for v in [0u64, 3, 99, u64::from(u32::MAX)] {
            let mut f = frame("heartbeat", heartbeat_body());
            f["v"] = json!(v);
            let err = agent_err(&f);
            assert_eq!(err.code, ProtocolErrorCode::UnsupportedVersion, "{err}");
            assert!(err.message.contains(&format!("version {v} ")), "{err}");
            assert_eq!(err.offending_id, Some(id()));
        }
    }

    #[test]
    fn a_version_that_is_not_an_unsigned_32_bit_integer_is_invalid() {
        for v in [
            json!("1"),
            json!(-1),
            json!(1.5),
            json!(u64::from(u32::MAX) + 1),
            json!(null),
        ] {
            let mut f = frame("heartbeat", heartbeat_body());
            f["v"] = v.clone();
            let err = agent_err(&f);
            assert_eq!(err.code, ProtocolErrorCode::InvalidField, "{v}: {err}");
            assert!(err.message.contains("`v`"), "{err}");
        }
        let mut f = frame("heartbeat", heartbeat_body());
        f.as_object_mut().unwrap().remove("v");
        assert_eq!(agent_err(&f).code, ProtocolErrorCode::InvalidField);
    }

    #[test]
    fn unknown_type_is_reported_with_the_offending_id() {
        let err = agent_err(&frame("selfdestruct", json!({})));
        assert_eq!(err.code, ProtocolErrorCode::UnknownType);
        assert_eq!(err.offending_id, Some(id()));
        assert!(err.message.contains("`selfdestruct`"), "{err}");
        assert!(err.message.contains("agent-to-hub"), "{err}");
    }

    #[test]
    fn a_type_of_the_other_direction_is_unknown() {
        let welcome = frame(
            "welcome",
            json!({"version": 1, "session": "s", "heartbeat_interval_secs": 15}),
        );
        assert!(decode::<HubMessage>(&welcome.to_string()).is_ok());
        assert_eq!(agent_err(&welcome).code, ProtocolErrorCode::UnknownType);

        let heartbeat = frame("heartbeat", heartbeat_body());
        assert_eq!(hub_err(&heartbeat).code, ProtocolErrorCode::UnknownType);
    }

    #[test]
    fn a_huge_unknown_type_is_clipped_in_the_message() {
        let err = agent_err(&frame(&"t".repeat(100_000), json!({})));
        assert_eq!(err.code, ProtocolErrorCode::UnknownType);
        assert!(err.message.len() <= crate::MAX_ERROR_MESSAGE_BYTES);
    }

    #[test]
    fn missing_or_non_string_type_is_invalid() {
        let mut f = frame("heartbeat", heartbeat_body());
        f["type"] = json!(3);
        let err = agent_err(&f);
        assert_eq!(err.code, ProtocolErrorCode::InvalidField);
        assert!(err.message.contains("`type`"), "{err}");
        f.as_object_mut().unwrap().remove("type");
        assert_eq!(agent_err(&f).code, ProtocolErrorCode::InvalidField);
    }

    #[test]
    fn bad_message_ulid_is_an_invalid_id_without_offending_id() {
        for bad in [
            json!("not-a-ulid"),
            json!("01JQ3V6B4TN3R5W9X0Y2Z4A6C"),
            json!(7),
            json!(null),
        ] {
            let mut f = frame("heartbeat", heartbeat_body());
            f["id"] = bad.clone();
            let err = agent_err(&f);
            assert_eq!(err.code, ProtocolErrorCode::InvalidField, "{bad}: {err}");
            assert!(err.message.contains("`id`"), "{err}");
            assert_eq!(err.offending_id, None);
        }
        let mut f = frame("heartbeat", heartbeat_body());
        f.as_object_mut().unwrap().remove("id");
        assert!(agent_err(&f).message.contains("`id`: missing"));
    }

    #[test]
    fn bad_transaction_ulid_in_a_body_is_invalid() {
        let mut body = event_body();
        body["txn"] = json!("01JQ3V6B4TN3R5W9X0Y2Z4A6CU");
        let err = agent_err(&frame("event", body));
        assert_eq!(err.code, ProtocolErrorCode::InvalidField);
        assert!(err.message.contains("`body`"), "{err}");
        assert!(err.message.contains("invalid ULID"), "{err}");
        assert_eq!(err.offending_id, Some(id()));

        let dispatch = frame(
            "dispatch",
            json!({"txn": "x", "action": "destroy", "vmid": 120}),
        );
        assert_eq!(hub_err(&dispatch).code, ProtocolErrorCode::InvalidField);
    }

    #[test]
    fn bad_timestamps_are_invalid() {
        for bad in [
            json!("2026-03-01T12:00:00+01:00"),
            json!("yesterday"),
            json!(1_767_225_600),
        ] {
            let mut f = frame("heartbeat", heartbeat_body());
            f["ts"] = bad.clone();
            let err = agent_err(&f);
            assert_eq!(err.code, ProtocolErrorCode::InvalidField, "{bad}: {err}");
            assert!(err.message.contains("`ts`"), "{err}");
        }
        let mut body = event_body();
        body["at"] = json!("2026-02-30T00:00:00Z");
        assert_eq!(
            agent_err(&frame("event", body)).code,
            ProtocolErrorCode::InvalidField
        );
    }

    #[test]
    fn missing_or_wrong_bodies_are_invalid() {
        let mut f = frame("heartbeat", heartbeat_body());
        f.as_object_mut().unwrap().remove("body");
        let err = agent_err(&f);
        assert_eq!(err.code, ProtocolErrorCode::InvalidField);
        assert!(err.message.contains("`body`: missing"), "{err}");

        for body in [
            json!(null),
            json!([]),
            json!({"seq": 1}),
            json!({"seq": -1, "uptime_secs": 2, "in_flight": 3, "outbox_depth": 4}),
        ] {
            let err = agent_err(&frame("heartbeat", body.clone()));
            assert_eq!(err.code, ProtocolErrorCode::InvalidField, "{body}: {err}");
            assert!(err.message.contains("`heartbeat`"), "{err}");
        }
    }

    #[test]
    fn unknown_enum_values_are_invalid() {
        let mut body = event_body();
        body["phase"] = json!("teleported");
        assert_eq!(
            agent_err(&frame("event", body)).code,
            ProtocolErrorCode::InvalidField
        );

        let dispatch = frame(
            "dispatch",
            json!({"txn": TXN, "action": "reboot", "vmid": 120}),
        );
        let err = hub_err(&dispatch);
        assert_eq!(err.code, ProtocolErrorCode::InvalidField);
        assert!(err.message.contains("reboot"), "{err}");
    }

    #[test]
    fn a_foreign_guest_cannot_carry_a_name() {
        let ok = frame(
            "inventory",
            json!({"request": null, "guests": [], "foreign_vmids": [101, 102]}),
        );
        let env: AgentEnvelope = decode(&ok.to_string()).unwrap();
        let AgentMessage::Inventory(inv) = env.message else {
            panic!("not an inventory");
        };
        assert_eq!(inv.foreign_vmids, vec![101, 102]);

        let leaky = frame(
            "inventory",
            json!({"request": null, "guests": [], "foreign_vmids": [{"vmid": 101, "name": "payroll"}]}),
        );
        assert_eq!(agent_err(&leaky).code, ProtocolErrorCode::InvalidField);
    }

    #[test]
    fn a_zero_heartbeat_interval_is_invalid() {
        let welcome = frame(
            "welcome",
            json!({"version": 1, "session": "s", "heartbeat_interval_secs": 0}),
        );
        assert_eq!(hub_err(&welcome).code, ProtocolErrorCode::InvalidField);
    }

    #[test]
    fn unknown_fields_are_ignored_everywhere() {
        let mut f = frame(
            "dispatch",
            json!({"txn": TXN, "action": "provision", "vmid": 120, "from": "local:backup/a.tar.zst",
                   "storage": "local-lvm", "keep": false, "priority": "high"}),
        );
        f["trace"] = json!({"span": 1});
        let env: HubEnvelope = decode(&f.to_string()).unwrap();
        assert_eq!(
            env.message,
            HubMessage::Dispatch(Dispatch {
                txn: TxnId::parse(TXN).unwrap(),
                action: DispatchAction::Provision {
                    vmid: 120,
                    from: "local:backup/a.tar.zst".to_owned(),
                    storage: "local-lvm".to_owned(),
                    keep: false,
                    profile: None,
                    isolate_network: None,
                },
            })
        );
        for action in [
            json!({"txn": TXN, "action": "inventory_request", "extra": [1]}),
            json!({"txn": TXN, "action": "restore_test", "extra": true}),
            json!({"txn": TXN, "action": "destroy", "vmid": 5, "extra": null}),
        ] {
            assert!(
                decode::<HubMessage>(&frame("dispatch", action.clone()).to_string()).is_ok(),
                "{action}"
            );
        }
    }

    #[test]
    fn optional_dispatch_fields_default() {
        let f = frame("dispatch", json!({"txn": TXN, "action": "restore_test"}));
        let env: HubEnvelope = decode(&f.to_string()).unwrap();
        let HubMessage::Dispatch(d) = env.message else {
            panic!("not a dispatch");
        };
        assert_eq!(d.action, DispatchAction::RestoreTest { dry_run: false });
        assert_eq!(d.action.txn_kind(), Some(TxnKind::SelftestRestore));

        let missing_keep = frame(
            "dispatch",
            json!({"txn": TXN, "action": "provision", "vmid": 120, "from": "f", "storage": "s"}),
        );
        assert_eq!(hub_err(&missing_keep).code, ProtocolErrorCode::InvalidField);
    }

    #[test]
    fn a_decode_error_is_sendable_as_a_protocol_error() {
        let err = agent_err(&frame("selfdestruct", json!({})));
        let reply = Envelope::new(
            1,
            MessageId::parse(TXN).unwrap(),
            Timestamp::parse(TS).unwrap(),
            HubMessage::ProtocolError(err.clone()),
        );
        let text = encode(&reply).unwrap();
        let back: HubEnvelope = decode(&text).unwrap();
        assert_eq!(back.message, HubMessage::ProtocolError(err));
        let wire: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(wire["body"]["code"], json!("unknown_type"));
        assert_eq!(wire["body"]["offending_id"], json!(ID));
    }

    fn one_of_each_agent_message() -> Vec<AgentMessage> {
        let txn = TxnId::parse(TXN).unwrap();
        vec![
            AgentMessage::Hello(Hello {
                agent_version: "0.1.0".to_owned(),
                node: "pve1".to_owned(),
                pool: "felhom".to_owned(),
                protocol_versions: vec![1],
                capabilities: vec![],
                host: HostFacts {
                    hostname: "pve1".to_owned(),
                    kernel: "6.8".to_owned(),
                    os: "Debian".to_owned(),
                    cpu_count: 1,
                    memory_total_bytes: 1,
                    uptime_secs: 1,
                },
            }),
            AgentMessage::Heartbeat(Heartbeat {
                seq: 0,
                uptime_secs: 0,
                in_flight: 0,
                outbox_depth: 0,
            }),
            AgentMessage::Inventory(Inventory {
                request: None,
                guests: vec![],
                foreign_vmids: vec![],
            }),
            AgentMessage::Event(Event {
                txn,
                kind: TxnKind::Destroy,
                vmid: None,
                phase: Phase::Destroyed,
                at: Timestamp::parse(TS).unwrap(),
                detail: None,
                error: None,
                guest: None,
                backup: None,
            }),
            AgentMessage::Result(TxnResult {
                txn,
                kind: TxnKind::Provision,
                vmid: Some(120),
                outcome: Outcome::Ok,
                phase: Phase::Reported,
                destroy_armed: true,
                destroyed: false,
                checks: vec![],
                isolation: None,
                error: None,
                guest: None,
                backup: None,
                group: None,
            }),
            coverage(),
            AgentMessage::Ack(Ack { ids: vec![id()] }),
            AgentMessage::ProtocolError(ProtocolError::new(ProtocolErrorCode::Malformed, "x")),
        ]
    }

    fn coverage() -> AgentMessage {
        AgentMessage::Coverage(Coverage {
            node: "pve1".to_owned(),
            at: Timestamp::parse(TS).unwrap(),
            guest_count: 1,
            guests: vec![CoverageRow {
                vmid: 200,
                name: "shop".to_owned(),
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
            }],
        })
    }

    fn coverage_body() -> Value {
        json!({"node": "pve1", "at": TS, "guest_count": 0, "guests": []})
    }

    #[test]
    fn a_coverage_frame_of_version_1_is_an_unknown_type() {
        let mut f = frame("coverage", coverage_body());
        let err = agent_err(&f);
        assert_eq!(err.code, ProtocolErrorCode::UnknownType, "{err}");
        assert_eq!(err.offending_id, Some(id()));
        assert!(err.message.contains("protocol version 1"), "{err}");
        assert!(err.message.contains("version 2"), "{err}");
        f["v"] = json!(2);
        let env: AgentEnvelope = decode(&f.to_string()).unwrap();
        assert_eq!(env.type_name(), "coverage");
        assert_eq!(env.message.since(), 2);
        f["v"] = json!(3);
        assert_eq!(agent_err(&f).code, ProtocolErrorCode::UnsupportedVersion);
    }

    #[test]
    fn version_1_types_are_frames_of_version_2_too() {
        let mut f = frame("heartbeat", heartbeat_body());
        f["v"] = json!(2);
        let env: AgentEnvelope = decode(&f.to_string()).unwrap();
        assert_eq!(env.v, 2);
        assert_eq!(env.message.since(), 1);
        let mut d = frame("dispatch", json!({"txn": TXN, "action": "restore_test"}));
        d["v"] = json!(2);
        assert!(decode::<HubMessage>(&d.to_string()).is_ok());
    }

    #[test]
    fn encode_refuses_a_type_the_envelope_version_lacks() {
        let env = Envelope::new(1, id(), Timestamp::parse(TS).unwrap(), coverage());
        assert_eq!(
            encode(&env),
            Err(EncodeError::NotInVersion {
                type_name: "coverage",
                version: 1,
                since: 2
            })
        );
        let env = Envelope { v: 2, ..env };
        assert!(encode(&env).is_ok());
    }

    #[test]
    fn each_type_came_with_a_version_this_crate_speaks() {
        for t in AgentMessage::TYPES {
            let since = AgentMessage::type_since(t).unwrap();
            assert!(SUPPORTED_VERSIONS.contains(&since), "{t}");
            assert_eq!(since, u32::from(*t == "coverage") + 1, "{t}");
        }
        for t in HubMessage::TYPES {
            assert_eq!(HubMessage::type_since(t), Some(1), "{t}");
        }
        assert_eq!(AgentMessage::type_since("welcome"), None);
        assert_eq!(HubMessage::type_since("coverage"), None);
    }

    fn one_of_each_hub_message() -> Vec<HubMessage> {
        vec![
            HubMessage::Welcome(Welcome {
                version: 1,
                session: "s".to_owned(),
                heartbeat_interval_secs: std::num::NonZeroU32::MIN,
            }),
            HubMessage::Dispatch(Dispatch {
                txn: TxnId::parse(TXN).unwrap(),
                action: DispatchAction::InventoryRequest,
            }),
            HubMessage::Ack(Ack { ids: vec![] }),
            HubMessage::ProtocolError(ProtocolError::new(ProtocolErrorCode::UnknownType, "y")),
        ]
    }

    /// Encodes each message, checks its wire type and that it decodes back; returns the types.
    fn wire_types<M: Message + Clone + PartialEq + fmt::Debug>(
        messages: Vec<M>,
    ) -> Vec<&'static str> {
        messages
            .into_iter()
            .map(|m| {
                let env = Envelope::new(m.since(), id(), Timestamp::parse(TS).unwrap(), m);
                let text = encode(&env).unwrap();
                let wire: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(wire["type"], json!(env.type_name()));
                assert_eq!(decode::<M>(&text).unwrap(), env);
                env.type_name()
            })
            .collect()
    }

    #[test]
    fn the_type_lists_match_the_variants() {
        assert_eq!(wire_types(one_of_each_agent_message()), AgentMessage::TYPES);
        assert_eq!(wire_types(one_of_each_hub_message()), HubMessage::TYPES);
    }

    #[test]
    fn everything_but_ack_and_heartbeat_needs_an_ack() {
        let agent: Vec<(&str, bool)> = one_of_each_agent_message()
            .iter()
            .map(|m| (m.type_name(), m.needs_ack()))
            .collect();
        assert_eq!(
            agent,
            [
                ("hello", true),
                ("heartbeat", false),
                ("inventory", true),
                ("event", true),
                ("result", true),
                ("coverage", true),
                ("ack", false),
                ("protocol_error", true)
            ]
        );
        let hub: Vec<(&str, bool)> = one_of_each_hub_message()
            .iter()
            .map(|m| (m.type_name(), m.needs_ack()))
            .collect();
        assert_eq!(
            hub,
            [
                ("welcome", true),
                ("dispatch", true),
                ("ack", false),
                ("protocol_error", true)
            ]
        );
    }

    /// A code that came with version 2 goes out in a version 1 frame as the code version 1
    /// has for it (a v1 hub refuses a code it does not know, and the message would stay
    /// unacknowledged for ever); a version 2 frame carries it as it is.
    #[test]
    fn a_newer_error_code_goes_out_as_its_older_version_in_an_older_frame() {
        let result = |code: crate::ErrorCode| {
            AgentMessage::Result(TxnResult {
                txn: TxnId::parse(TXN).unwrap(),
                kind: TxnKind::SelftestRestore,
                vmid: Some(990_002),
                outcome: Outcome::Failed,
                phase: Phase::Failed,
                destroy_armed: true,
                destroyed: true,
                checks: vec![],
                isolation: None,
                error: Some(crate::ErrorInfo {
                    code,
                    message: "m".to_owned(),
                }),
                guest: None,
                backup: None,
                group: None,
            })
        };
        for (code, v1) in [
            (crate::ErrorCode::GuestExecBlocked, "launch_unproven"),
            (crate::ErrorCode::LabBridgeOpen, "config_invalid"),
            (crate::ErrorCode::GroupLabFailed, "config_invalid"),
            (crate::ErrorCode::GuestOsUnjudged, "guest_agent_off"),
            (crate::ErrorCode::CheckFailed, "check_failed"),
        ] {
            let ts = Timestamp::parse(TS).unwrap();
            let old = encode(&Envelope::new(1, id(), ts, result(code))).unwrap();
            let frame: Value = serde_json::from_str(&old).unwrap();
            assert_eq!(frame["body"]["error"]["code"], v1, "{old}");
            // Decodable by a peer of version 1: a code it knows.
            assert!(decode::<AgentMessage>(&old).is_ok(), "{old}");
            let ts = Timestamp::parse(TS).unwrap();
            let new = encode(&Envelope::new(2, id(), ts, result(code))).unwrap();
            let frame: Value = serde_json::from_str(&new).unwrap();
            assert_eq!(frame["body"]["error"]["code"], code.as_str(), "{new}");
        }
        for code in crate::ErrorCode::ALL {
            assert!(code.in_version(1).since() <= 1, "{code:?}");
            assert_eq!(code.in_version(2), code);
        }
    }

    /// A skipped check and the restore-test kind, both of version 2: a version 1 frame
    /// carries the check as `error` (never `pass`) with its message, and the kind as
    /// `selftest-restore`, and a peer of version 1 decodes it; a version 2 frame carries both
    /// as they are and decodes back to the same result. A frame an older agent wrote
    /// (`selftest-restore` in version 2) still reads.
    #[test]
    fn a_skipped_check_and_the_restore_test_kind_in_either_version() {
        let check = |name: &str, status: CheckStatus, message: Option<&str>| CheckReport {
            name: name.to_owned(),
            status,
            rows: vec![],
            row_count: 0,
            rows_truncated: false,
            message: message.map(str::to_owned),
            duration_ms: 3,
        };
        let result = AgentMessage::Result(TxnResult {
            txn: TxnId::parse(TXN).unwrap(),
            kind: TxnKind::SelftestRestore,
            vmid: Some(990_002),
            outcome: Outcome::Ok,
            phase: Phase::Destroyed,
            destroy_armed: true,
            destroyed: true,
            checks: vec![
                check("osquery-version", CheckStatus::Pass, None),
                check(
                    "hostname",
                    CheckStatus::Skipped,
                    Some("not judged: PVE keeps no hostname for a VM"),
                ),
                check("bare", CheckStatus::Skipped, None),
            ],
            isolation: None,
            error: None,
            guest: Some(300),
            backup: None,
            group: None,
        });
        let ts = || Timestamp::parse(TS).unwrap();

        let old = encode(&Envelope::new(1, id(), ts(), result.clone())).unwrap();
        let frame: Value = serde_json::from_str(&old).unwrap();
        assert_eq!(frame["body"]["kind"], "selftest-restore", "{old}");
        let statuses: Vec<&Value> = frame["body"]["checks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| &c["status"])
            .collect();
        assert_eq!(statuses, [&json!("pass"), &json!("error"), &json!("error")]);
        assert_eq!(
            frame["body"]["checks"][1]["message"],
            "not judged: PVE keeps no hostname for a VM"
        );
        assert_eq!(
            frame["body"]["checks"][2]["message"],
            "not judged (a check status of `skipped`)"
        );
        assert!(!old.contains("skipped\""), "{old}");
        assert!(!old.contains("\"restore-test\""), "{old}");
        // A peer of version 1 decodes it: values it knows.
        let read: AgentEnvelope = decode(&old).unwrap();
        let AgentMessage::Result(r) = read.message else {
            panic!("not a result");
        };
        assert_eq!(r.kind, TxnKind::SelftestRestore);
        assert_eq!(r.checks[1].status, CheckStatus::Error);

        let new = encode(&Envelope::new(2, id(), ts(), result.clone())).unwrap();
        let frame: Value = serde_json::from_str(&new).unwrap();
        assert_eq!(frame["body"]["kind"], "restore-test", "{new}");
        assert_eq!(frame["body"]["checks"][1]["status"], "skipped", "{new}");
        assert_eq!(frame["body"]["checks"][2]["message"], Value::Null, "{new}");
        let read: AgentEnvelope = decode(&new).unwrap();
        assert_eq!(read.message, result);
        // The kind's older name in a version 2 frame (an agent before the rename) reads.
        let mut older = frame;
        older["body"]["kind"] = json!("selftest-restore");
        let read: AgentEnvelope = decode(&older.to_string()).unwrap();
        assert_eq!(read.message, result);

        // An event names its kind as the frame's version does, too.
        let event = AgentMessage::Event(Event {
            txn: TxnId::parse(TXN).unwrap(),
            kind: TxnKind::SelftestRestore,
            vmid: Some(990_002),
            phase: Phase::Created,
            at: ts(),
            detail: None,
            error: None,
            guest: None,
            backup: None,
        });
        for (v, name) in [(1, "selftest-restore"), (2, "restore-test")] {
            let text = encode(&Envelope::new(v, id(), ts(), event.clone())).unwrap();
            let frame: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(frame["body"]["kind"], name, "{text}");
            let read: AgentEnvelope = decode(&text).unwrap();
            assert_eq!(read.message, event);
        }
    }

    #[test]
    fn encode_refuses_a_frame_the_peer_would_refuse() {
        let row: BTreeMap<String, String> = [("path".to_owned(), "p".repeat(1024))].into();
        let result = TxnResult {
            txn: TxnId::parse(TXN).unwrap(),
            kind: TxnKind::SelftestProvision,
            vmid: Some(120),
            outcome: Outcome::Failed,
            phase: Phase::Failed,
            destroy_armed: true,
            destroyed: true,
            checks: vec![CheckReport {
                name: "files".to_owned(),
                status: CheckStatus::Fail,
                rows: vec![row; 1100],
                row_count: 1100,
                rows_truncated: false,
                message: None,
                duration_ms: 1,
            }],
            isolation: None,
            error: None,
            guest: None,
            backup: None,
            group: None,
        };
        let env = Envelope::new(
            1,
            id(),
            Timestamp::parse(TS).unwrap(),
            AgentMessage::Result(result),
        );
        match encode(&env) {
            Err(EncodeError::Oversized { type_name, len }) => {
                assert_eq!(type_name, "result");
                assert!(len > MAX_FRAME_BYTES);
            }
            other => panic!("expected oversized, got {other:?}"),
        }
    }

    #[test]
    fn serde_deserialize_applies_the_same_checks() {
        let good = frame("heartbeat", heartbeat_body()).to_string();
        let env: AgentEnvelope = serde_json::from_str(&good).unwrap();
        assert_eq!(env.type_name(), "heartbeat");
        let bad = frame("nope", json!({})).to_string();
        let err = serde_json::from_str::<AgentEnvelope>(&bad).unwrap_err();
        assert!(err.to_string().contains("unknown_type"), "{err}");
    }
}
