//! Messages the agent sends to the hub.

use serde::{Deserialize, Serialize};

use crate::ack::Ack;
use crate::coverage::{Coverage, MAX_BACKUP_BYTES};
use crate::error::ProtocolError;
use crate::ids::TxnId;
use crate::timestamp::Timestamp;
use crate::txn::{CheckReport, ErrorInfo, Outcome, Phase, TxnKind};

/// Capability names an agent announces in its hello. The set is open: a hub ignores names it
/// does not know, and must not dispatch an action whose capability the agent did not announce.
pub mod capability {
    /// Runs `provision` dispatches.
    pub const PROVISION: &str = "provision";
    /// Runs `destroy` dispatches.
    pub const DESTROY: &str = "destroy";
    /// Runs `restore_test` dispatches.
    pub const RESTORE_TEST: &str = "restore_test";
    /// Answers `inventory_request` dispatches.
    pub const INVENTORY: &str = "inventory";
}

/// The first message of a session: who the agent is and what it speaks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The agent's version (`0.1.0`).
    pub agent_version: String,
    /// The PVE node the agent runs on.
    pub node: String,
    /// The PVE pool the agent's token is scoped to.
    pub pool: String,
    /// Every protocol version the agent speaks; the hub picks one for the session.
    pub protocol_versions: Vec<u32>,
    /// What the agent can do, see [`capability`].
    pub capabilities: Vec<String>,
    /// Facts about the host.
    pub host: HostFacts,
}

/// Plain facts about the node's host, as the agent read them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostFacts {
    /// The host name.
    pub hostname: String,
    /// The kernel release (`6.8.12-4-pve`).
    pub kernel: String,
    /// The operating system (`Debian GNU/Linux 12 (bookworm)`).
    pub os: String,
    /// Logical CPUs.
    pub cpu_count: u32,
    /// Total memory in bytes.
    pub memory_total_bytes: u64,
    /// Seconds since the host booted.
    pub uptime_secs: u64,
}

/// A sign of life, sent on the interval the welcome set. Never acknowledged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Counts up by one per heartbeat within a session.
    pub seq: u64,
    /// Seconds since the agent process started.
    pub uptime_secs: u64,
    /// Transactions currently running.
    pub in_flight: u32,
    /// Messages in the outbox waiting for an ack.
    pub outbox_depth: u64,
}

/// The type of a guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuestType {
    /// An LXC container.
    Lxc,
    /// A QEMU virtual machine.
    Qemu,
}

/// The run state of a guest as PVE reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuestStatus {
    /// Running.
    Running,
    /// Stopped.
    Stopped,
    /// A VM paused or suspended by QEMU.
    Paused,
    /// PVE did not say (node offline, state unknown).
    Unknown,
}

/// A guest in the fleet's pool, visible to the hub.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolGuest {
    /// The vmid.
    pub vmid: u32,
    /// LXC or QEMU.
    #[serde(rename = "type")]
    pub guest_type: GuestType,
    /// The node the guest is on.
    pub node: String,
    /// The guest's name, when it has one.
    pub name: Option<String>,
    /// Its run state.
    pub status: GuestStatus,
}

/// The node's guests as the hub may see them: the pool's guests in full, and the vmids held by
/// guests outside the pool as bare numbers. A foreign guest has no field here that could carry
/// its name, type or node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    /// The `inventory_request` dispatch this answers; `None` when sent on connect or on change.
    pub request: Option<TxnId>,
    /// The pool's guests.
    pub guests: Vec<PoolGuest>,
    /// Vmids held by guests outside the pool (numbers only; the hub must not dispatch to them).
    pub foreign_vmids: Vec<u32>,
}

/// A transaction reached a phase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// The transaction.
    pub txn: TxnId,
    /// Its kind.
    pub kind: TxnKind,
    /// Its vmid, once it has one.
    pub vmid: Option<u32>,
    /// The phase reached.
    pub phase: Phase,
    /// When the phase was journaled (may be well before the message is sent).
    pub at: Timestamp,
    /// A short human note (UPID, profile, check name, ...).
    pub detail: Option<String>,
    /// The error, for a phase reached by failing; or code `interrupted` when the agent was
    /// stopped (Ctrl-C, SIGTERM) with the transaction open at this phase: no outcome yet, the
    /// result follows once a resume settles it.
    pub error: Option<ErrorInfo>,
    /// For a restore-test copy (kind `restore-test`): the guest whose backup it proves (the
    /// backup's owner); absent for other kinds and when the backup's name does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<u32>,
    /// For a restore-test copy: the backup volume id it restores and proves, at most
    /// [`MAX_BACKUP_BYTES`] (see [`backup_text`]); absent for other kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<String>,
}

/// The final state of a transaction: the same document `--json` prints (DESIGN section 3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxnResult {
    /// The transaction.
    pub txn: TxnId,
    /// Its kind.
    pub kind: TxnKind,
    /// Its vmid (`None` for a restore-test that found no free vmid in its band).
    pub vmid: Option<u32>,
    /// How it ended.
    pub outcome: Outcome,
    /// The last phase it reached.
    pub phase: Phase,
    /// Whether destroy was armed (proof of launch held).
    pub destroy_armed: bool,
    /// Whether the guest it created was destroyed.
    pub destroyed: bool,
    /// The osquery checks that ran.
    pub checks: Vec<CheckReport>,
    /// Why it did not end `ok`.
    pub error: Option<ErrorInfo>,
    /// What the isolation changed in an isolated copy (its stored interfaces given as
    /// unconnected pairs inside it, the units restarted), as the text output and `--json` say
    /// it; absent when nothing was changed. At most [`MAX_ISOLATION_BYTES`]
    /// (see [`TxnResult::isolation_text`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<String>,
    /// For a restore-test copy (kind `restore-test`): the guest whose backup it proves (the
    /// backup's owner); absent for other kinds, for a restore-test dispatch that started no
    /// copy, and when the backup's name does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<u32>,
    /// For a restore-test copy: the backup volume id it restored (proven when `outcome` is
    /// `ok`), at most [`MAX_BACKUP_BYTES`] (see [`backup_text`]); absent for other kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<String>,
    /// For a restore-test copy that is a member of an application group: the group, its run
    /// and the member's place in it; every member's result of one group run carries the same
    /// `name` and `run`. Absent for a copy proven alone, for other kinds, and from agents
    /// before groups (an optional field within versions 1 and 2: a peer that does not know it
    /// ignores it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<GroupInfo>,
}

/// The longest group name a result or a coverage row carries; a longer one is clipped.
pub const MAX_GROUP_NAME_BYTES: usize = 64;
/// The most members a result's [`GroupInfo`] lists; more are left out.
pub const MAX_GROUP_MEMBERS: usize = 64;

/// A restore-test copy's application group (`[[restore_test.group]]` on the agent): the hub
/// receives one result per member, each with this.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupInfo {
    /// The group's name (at most [`MAX_GROUP_NAME_BYTES`]).
    pub name: String,
    /// The group run's id: the same in the result of every member of one run of the group,
    /// and in no other run's (ULID text; not a transaction's id).
    pub run: TxnId,
    /// The member's place in the group's start order, from 1.
    pub member: u32,
    /// The group's members (their guests' vmids) in start order, at most
    /// [`MAX_GROUP_MEMBERS`]; empty when the agent did not record them.
    #[serde(default)]
    pub members: Vec<u32>,
}

impl GroupInfo {
    /// A group's info with its name clipped (on a char boundary) and its members bounded.
    pub fn new(name: &str, run: TxnId, member: u32, members: &[u32]) -> Self {
        Self {
            name: crate::clip(name, MAX_GROUP_NAME_BYTES).to_owned(),
            run,
            member,
            members: members.iter().copied().take(MAX_GROUP_MEMBERS).collect(),
        }
    }
}

/// The longest `isolation` note a result carries; longer text is clipped.
pub const MAX_ISOLATION_BYTES: usize = 1024;

/// `volid` clipped to [`MAX_BACKUP_BYTES`] (on a char boundary), for the `backup` field of a
/// result or an event.
pub fn backup_text(volid: &str) -> String {
    crate::clip(volid, MAX_BACKUP_BYTES).to_owned()
}

impl TxnResult {
    /// `text` clipped to [`MAX_ISOLATION_BYTES`] (on a char boundary), for the `isolation`
    /// field: the note names interfaces and units read from the guest's own config.
    pub fn isolation_text(text: &str) -> String {
        crate::clip(text, MAX_ISOLATION_BYTES).to_owned()
    }
}

/// A message from the agent to the hub. Its wire `type` is given with each variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentMessage {
    /// `hello`
    Hello(Hello),
    /// `heartbeat`
    Heartbeat(Heartbeat),
    /// `inventory`
    Inventory(Inventory),
    /// `event`
    Event(Event),
    /// `result`
    Result(TxnResult),
    /// `coverage` (protocol version 2)
    Coverage(Coverage),
    /// `ack`
    Ack(Ack),
    /// `protocol_error`
    ProtocolError(ProtocolError),
}

impl crate::codec::sealed::Codec for AgentMessage {
    fn serialize_body<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Hello(b) => b.serialize(s),
            Self::Heartbeat(b) => b.serialize(s),
            Self::Inventory(b) => b.serialize(s),
            Self::Event(b) => b.serialize(s),
            Self::Result(b) => b.serialize(s),
            Self::Coverage(b) => b.serialize(s),
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
            "hello" => from_value(body).map(Self::Hello),
            "heartbeat" => from_value(body).map(Self::Heartbeat),
            "inventory" => from_value(body).map(Self::Inventory),
            "event" => from_value(body).map(Self::Event),
            "result" => from_value(body).map(Self::Result),
            "coverage" => from_value(body).map(Self::Coverage),
            "ack" => from_value(body).map(Self::Ack),
            "protocol_error" => from_value(body).map(Self::ProtocolError),
            _ => return None,
        })
    }
}

impl crate::codec::Message for AgentMessage {
    const DIRECTION: &'static str = "agent-to-hub";
    const TYPES: &'static [&'static str] = &[
        "hello",
        "heartbeat",
        "inventory",
        "event",
        "result",
        "coverage",
        "ack",
        "protocol_error",
    ];

    fn type_since(type_name: &str) -> Option<u32> {
        match type_name {
            "coverage" => Some(2),
            other => Self::TYPES.contains(&other).then_some(1),
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            Self::Hello(_) => "hello",
            Self::Heartbeat(_) => "heartbeat",
            Self::Inventory(_) => "inventory",
            Self::Event(_) => "event",
            Self::Result(_) => "result",
            Self::Coverage(_) => "coverage",
            Self::Ack(_) => "ack",
            Self::ProtocolError(_) => "protocol_error",
        }
    }

    fn needs_ack(&self) -> bool {
        !matches!(self, Self::Ack(_) | Self::Heartbeat(_))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn guest_types_and_statuses_on_the_wire() {
        for (value, text) in [(GuestType::Lxc, "lxc"), (GuestType::Qemu, "qemu")] {
            assert_eq!(serde_json::to_value(value).unwrap(), json!(text));
        }
        for (value, text) in [
            (GuestStatus::Running, "running"),
            (GuestStatus::Stopped, "stopped"),
            (GuestStatus::Paused, "paused"),
            (GuestStatus::Unknown, "unknown"),
        ] {
            assert_eq!(serde_json::to_value(value).unwrap(), json!(text));
            assert_eq!(
                serde_json::from_value::<GuestStatus>(json!(text)).unwrap(),
                value
            );
        }
    }

    #[test]
    fn a_result_without_isolation_has_no_such_key_and_older_results_decode() {
        let body = json!({
            "txn": "01KJMMA6WMJMRNV7E9Z0C1HT0H", "kind": "restore-test", "vmid": 9001,
            "outcome": "ok", "phase": "destroyed", "destroy_armed": true, "destroyed": true,
            "checks": [], "error": null
        });
        let result: TxnResult = serde_json::from_value(body.clone()).unwrap();
        assert_eq!(result.isolation, None);
        assert_eq!(serde_json::to_value(&result).unwrap(), body);

        let with = TxnResult {
            isolation: Some("eth0 given as an unconnected veth pair".to_owned()),
            ..result
        };
        let wire = serde_json::to_value(&with).unwrap();
        assert_eq!(
            wire["isolation"],
            json!("eth0 given as an unconnected veth pair")
        );
        assert_eq!(serde_json::from_value::<TxnResult>(wire).unwrap(), with);
    }

    #[test]
    fn guest_and_backup_are_absent_unless_set_and_older_bodies_decode_without_them() {
        let result = json!({
            "txn": "01KJMMA6WMJMRNV7E9Z0C1HT0H", "kind": "provision", "vmid": 120,
            "outcome": "ok", "phase": "reported", "destroy_armed": true, "destroyed": false,
            "checks": [], "error": null
        });
        let r: TxnResult = serde_json::from_value(result.clone()).unwrap();
        assert_eq!((r.guest, r.backup.as_deref()), (None, None));
        assert_eq!(serde_json::to_value(&r).unwrap(), result);
        let event = json!({
            "txn": "01KJMMA6WMJMRNV7E9Z0C1HT0H", "kind": "restore-test", "vmid": 990000,
            "phase": "created", "at": "2026-03-01T12:00:00Z", "detail": null, "error": null
        });
        let e: Event = serde_json::from_value(event.clone()).unwrap();
        assert_eq!((e.guest, e.backup.as_deref()), (None, None));
        assert_eq!(serde_json::to_value(&e).unwrap(), event);

        let volid = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst";
        let e = Event {
            guest: Some(200),
            backup: Some(backup_text(volid)),
            ..e
        };
        let wire = serde_json::to_value(&e).unwrap();
        assert_eq!(
            (&wire["guest"], &wire["backup"]),
            (&json!(200), &json!(volid))
        );
        assert_eq!(serde_json::from_value::<Event>(wire).unwrap(), e);
    }

    #[test]
    fn group_is_absent_for_a_copy_alone_and_a_member_s_result_carries_it() {
        let alone = json!({
            "txn": "01KJMMA6WMJMRNV7E9Z0C1HT0H", "kind": "restore-test", "vmid": 990000,
            "outcome": "ok", "phase": "destroyed", "destroy_armed": true, "destroyed": true,
            "checks": [], "error": null, "guest": 200,
            "backup": "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst"
        });
        let r: TxnResult = serde_json::from_value(alone.clone()).unwrap();
        assert_eq!(r.group, None);
        assert_eq!(serde_json::to_value(&r).unwrap(), alone);

        let run = TxnId::parse("01KJMMB1F8D3N6R0S2V5Y7ZA9B").unwrap();
        let member = TxnResult {
            group: Some(GroupInfo::new("shop", run, 2, &[200, 201])),
            ..r
        };
        let wire = serde_json::to_value(&member).unwrap();
        assert_eq!(
            wire["group"],
            json!({"name": "shop", "run": "01KJMMB1F8D3N6R0S2V5Y7ZA9B", "member": 2, "members": [200, 201]})
        );
        assert_eq!(serde_json::from_value::<TxnResult>(wire).unwrap(), member);
        // A group of an agent that recorded no members still reads.
        let mut bare = serde_json::to_value(&member).unwrap();
        bare["group"].as_object_mut().unwrap().remove("members");
        let read: TxnResult = serde_json::from_value(bare).unwrap();
        assert_eq!(read.group.map(|g| (g.member, g.members)), Some((2, vec![])));
    }

    #[test]
    fn a_group_s_name_is_clipped_and_its_members_bounded() {
        let run = TxnId::parse("01KJMMB1F8D3N6R0S2V5Y7ZA9B").unwrap();
        let long = "é".repeat(MAX_GROUP_NAME_BYTES);
        let many: Vec<u32> = (0..1000).collect();
        let g = GroupInfo::new(&long, run, 1, &many);
        assert!(g.name.len() <= MAX_GROUP_NAME_BYTES && g.name.len() >= MAX_GROUP_NAME_BYTES - 1);
        assert!(long.starts_with(&g.name));
        assert_eq!(g.members, (0..MAX_GROUP_MEMBERS as u32).collect::<Vec<_>>());
        assert_eq!(GroupInfo::new("db", run, 1, &[7]).name, "db");
    }

    #[test]
    fn backup_text_is_clipped_on_a_char_boundary() {
        let long = format!("local:backup/{}", "é".repeat(MAX_BACKUP_BYTES));
        let clipped = backup_text(&long);
        assert!(clipped.len() <= MAX_BACKUP_BYTES && clipped.len() >= MAX_BACKUP_BYTES - 1);
        assert!(long.starts_with(&clipped));
        assert_eq!(backup_text("local:backup/a"), "local:backup/a");
    }

    #[test]
    fn isolation_text_is_clipped_on_a_char_boundary() {
        let short = "eth0 given as an unconnected veth pair";
        assert_eq!(TxnResult::isolation_text(short), short);
        let long = "é".repeat(MAX_ISOLATION_BYTES);
        let clipped = TxnResult::isolation_text(&long);
        assert!(clipped.len() <= MAX_ISOLATION_BYTES);
        assert!(clipped.len() >= MAX_ISOLATION_BYTES - 1);
        assert!(long.starts_with(&clipped));
    }

    #[test]
    fn a_pool_guest_names_its_type_in_a_field_called_type() {
        let guest = PoolGuest {
            vmid: 120,
            guest_type: GuestType::Qemu,
            node: "pve1".to_owned(),
            name: None,
            status: GuestStatus::Paused,
        };
        assert_eq!(
            serde_json::to_value(&guest).unwrap(),
            json!({"vmid": 120, "type": "qemu", "node": "pve1", "name": null, "status": "paused"})
        );
    }
}
