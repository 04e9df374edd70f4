//! The acknowledgement, sent in both directions.

use serde::{Deserialize, Serialize};

use crate::ids::MessageId;

/// Acknowledges messages by id: the receiver has processed them (or stored them durably) and
/// the sender may drop them from its outbox. An ack is never acknowledged itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    /// The ids acknowledged, in any order.
    pub ids: Vec<MessageId>,
}
