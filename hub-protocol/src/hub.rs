//! Messages the hub sends to the agent.

use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};

use crate::ack::Ack;
use crate::error::ProtocolError;
use crate::ids::TxnId;
use crate::txn::TxnKind;

/// The hub's answer to a hello: the session is open.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The protocol version chosen from the hello's list; every later frame carries it.
    pub version: u32,
    /// The hub's id for this session (opaque; for logs).
    pub session: String,
    /// Seconds between the agent's heartbeats (never zero).
    pub heartbeat_interval_secs: NonZeroU32,
}

/// Work for the agent, keyed by a transaction id.
///
/// The transaction id is the idempotency key: a dispatch whose `txn` the agent has seen before
/// is not run again; the agent answers with the state that transaction already has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dispatch {
    /// The transaction id the agent must use for this work.
    pub txn: TxnId,
    /// What to do. On the wire its fields sit beside `txn`, named by `action`.
    #[serde(flatten)]
    pub action: DispatchAction,
}

/// What a dispatch asks for; the wire field `action` names the variant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum DispatchAction {
    /// Provision a guest into `vmid` from a backup, bootstrap and verify it (`provision`).
    Provision {
        /// The vmid to provision into; the agent validates it and never picks another.
        vmid: u32,
        /// The backup volume id to restore (`local:backup/vzdump-lxc-…`).
        from: String,
        /// The target storage id.
        storage: String,
        /// Keep the guest after the checks instead of the gated destroy.
        keep: bool,
        /// The bootstrap profile to run; `None` runs the agent's `default` profile.
        #[serde(default)]
        profile: Option<String>,
        /// `Some(true)`: the guest starts isolated, as a restore-test copy (a container with
        /// no NIC on any bridge of the node, a VM with its stored NICs on a lab bridge of the
        /// node when one is configured, else with none), and with `onboot=0` and
        /// `protection=0`; `Some(false)` or absent: with its stored NICs. A kept VM is never
        /// isolated onto a lab bridge: such a dispatch is refused (`policy_denied`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        isolate_network: Option<bool>,
    },
    /// Destroy a guest this agent created, subject to the ownership gate (`destroy`).
    Destroy {
        /// The guest's vmid.
        vmid: u32,
    },
    /// Run one self-restore-test (`restore_test`).
    RestoreTest {
        /// Validate and report without writing anything.
        #[serde(default)]
        dry_run: bool,
    },
    /// Send an inventory now (`inventory_request`), answered by an `inventory` message whose
    /// `request` is this dispatch's `txn`.
    InventoryRequest,
}

impl DispatchAction {
    /// The kind of the transaction this action runs; `None` for an inventory request, which is
    /// answered by an `inventory` message rather than events and a result.
    pub fn txn_kind(&self) -> Option<TxnKind> {
        match self {
            Self::Provision { .. } => Some(TxnKind::Provision),
            Self::Destroy { .. } => Some(TxnKind::Destroy),
            Self::RestoreTest { .. } => Some(TxnKind::SelftestRestore),
            Self::InventoryRequest => None,
        }
    }
}

/// A message from the hub to the agent. Its wire `type` is given with each variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HubMessage {
    /// `welcome`
    Welcome(Welcome),
    /// `dispatch`
    Dispatch(Dispatch),
    /// `ack`
    Ack(Ack),
    /// `protocol_error`
    ProtocolError(ProtocolError),
}

impl crate::codec::sealed::Codec for HubMessage {
    fn serialize_body<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Welcome(b) => b.serialize(s),
            Self::Dispatch(b) => b.serialize(s),
            Self::Ack(b) => b.serialize(s),
            Self::ProtocolError(b) => b.serialize(s),
        }
    }

    fn deserialize_body(
        type_name: &str,
        body: serde_json::Value,
    ) -> Option<Result<Self, serde_json::Error>> {
        use serde_json::from_value;
        Some(match type_name {
            "welcome" => from_value(body).map(Self::Welcome),
            "dispatch" => from_value(body).map(Self::Dispatch),
            "ack" => from_value(body).map(Self::Ack),
            "protocol_error" => from_value(body).map(Self::ProtocolError),
            _ => return None,
        })
    }
}

impl crate::codec::Message for HubMessage {
    const DIRECTION: &'static str = "hub-to-agent";
    const TYPES: &'static [&'static str] = &["welcome", "dispatch", "ack", "protocol_error"];

    fn type_since(type_name: &str) -> Option<u32> {
        Self::TYPES.contains(&type_name).then_some(1)
    }

    fn type_name(&self) -> &'static str {
        match self {
            Self::Welcome(_) => "welcome",
            Self::Dispatch(_) => "dispatch",
            Self::Ack(_) => "ack",
            Self::ProtocolError(_) => "protocol_error",
        }
    }

    fn needs_ack(&self) -> bool {
        !matches!(self, Self::Ack(_))
    }
}
