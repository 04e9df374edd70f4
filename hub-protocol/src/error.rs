//! Protocol errors: why a frame was not accepted. The same value is the decoder's error and the
//! body of a `protocol_error` message, so a receiver answers a bad frame by sending what
//! [`decode`](crate::decode) returned.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::MessageId;

/// The stable code of a protocol error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProtocolErrorCode {
    /// The frame is larger than [`MAX_FRAME_BYTES`](crate::MAX_FRAME_BYTES).
    Oversized,
    /// The frame is not JSON, or not a JSON object.
    Malformed,
    /// The envelope's protocol version is not one this side speaks.
    UnsupportedVersion,
    /// The message type is not one this side accepts from its peer.
    UnknownType,
    /// A field of the envelope or the body is missing or has an invalid value.
    InvalidField,
    /// A well-formed message that is not allowed at this point of the session (for example a
    /// dispatch before the welcome). Never produced by the decoder; sessions send it.
    UnexpectedMessage,
}

impl ProtocolErrorCode {
    /// The code as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Oversized => "oversized",
            Self::Malformed => "malformed",
            Self::UnsupportedVersion => "unsupported_version",
            Self::UnknownType => "unknown_type",
            Self::InvalidField => "invalid_field",
            Self::UnexpectedMessage => "unexpected_message",
        }
    }
}

impl fmt::Display for ProtocolErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A frame that was not accepted, and the body of a `protocol_error` message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtocolError {
    /// The stable code.
    pub code: ProtocolErrorCode,
    /// What was wrong, for a human; bounded in length.
    pub message: String,
    /// The id of the offending message, when the frame carried a readable one.
    pub offending_id: Option<MessageId>,
}

/// The longest message a protocol error carries; longer text is clipped.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 512;

impl ProtocolError {
    /// A protocol error with no offending id. The message is clipped to
    /// [`MAX_ERROR_MESSAGE_BYTES`].
    pub fn new(code: ProtocolErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        let keep = crate::clip(&message, MAX_ERROR_MESSAGE_BYTES).len();
        message.truncate(keep);
        Self {
            code,
            message,
            offending_id: None,
        }
    }

    /// The same error naming the offending message.
    pub fn with_offending_id(mut self, id: Option<MessageId>) -> Self {
        self.offending_id = id;
        self
    }
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)?;
        if let Some(id) = self.offending_id {
            write!(f, " (message {id})")?;
        }
        Ok(())
    }
}

impl std::error::Error for ProtocolError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_strings_match_serde() {
        for code in [
            ProtocolErrorCode::Oversized,
            ProtocolErrorCode::Malformed,
            ProtocolErrorCode::UnsupportedVersion,
            ProtocolErrorCode::UnknownType,
            ProtocolErrorCode::InvalidField,
            ProtocolErrorCode::UnexpectedMessage,
        ] {
            assert_eq!(
                serde_json::to_value(code).unwrap(),
                serde_json::Value::String(code.as_str().to_owned())
            );
        }
    }

    #[test]
    fn long_messages_are_clipped_on_a_char_boundary() {
        let err = ProtocolError::new(ProtocolErrorCode::Malformed, "é".repeat(1000));
        assert!(err.message.len() <= MAX_ERROR_MESSAGE_BYTES);
        assert!(err.message.len() >= MAX_ERROR_MESSAGE_BYTES - 1);
        assert!(err.message.chars().all(|c| c == 'é'));
    }
}
