//! Protocol versions and their negotiation.
//!
//! - **Version 1**: `hello`, `heartbeat`, `inventory`, `event`, `result`, `ack`,
//!   `protocol_error` from the agent; `welcome`, `dispatch`, `ack`, `protocol_error` from the
//!   hub. Within it, results gained the optional `isolation`, and results and events of a
//!   restore-test copy the optional `guest` and `backup`, and results of a member of an
//!   application group the optional `group`.
//! - **Version 2**: everything of version 1, and the agent's `coverage` message (the restore
//!   test's coverage table, sent after every run that worked it out). An agent in a version 1
//!   session sends no `coverage`. Also the check status `skipped` (a version 1 frame carries
//!   `error` with the check's message) and the kind's name `restore-test` (version 1:
//!   `selftest-restore`). Within it, coverage rows gained the optional `group`.

/// The newest protocol version this crate speaks.
pub const PROTOCOL_VERSION: u32 = 2;

/// Every protocol version this crate speaks, oldest first. [`decode`](crate::decode) refuses
/// frames in any other version with `unsupported_version`.
pub const SUPPORTED_VERSIONS: &[u32] = &[1, 2];

/// The version the handshake frames are written in: `hello`, `welcome`, and a
/// `protocol_error` answering a hello. It never changes, so a peer of any later version can
/// always read a hello and answer it.
pub const HANDSHAKE_VERSION: u32 = 1;

/// The session's version: the highest version both sides speak, or `None` when they share
/// none (the hub then answers the hello with an `unsupported_version` protocol error and
/// closes). The lists need not be sorted and may repeat.
pub fn negotiate(agent_supported: &[u32], hub_supported: &[u32]) -> Option<u32> {
    agent_supported
        .iter()
        .copied()
        .filter(|v| hub_supported.contains(v))
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_highest_common_version() {
        let cases: &[(&[u32], &[u32], Option<u32>)] = &[
            (&[1], &[1], Some(1)),
            (&[1, 2, 3], &[2, 3, 4], Some(3)),
            (&[3, 1, 2], &[1, 2], Some(2)),
            (&[2, 2, 1], &[1, 1], Some(1)),
            (&[1, 2], &[3, 4], None),
            (&[], &[1], None),
            (&[1], &[], None),
            (&[], &[], None),
            (&[u32::MAX, 0], &[0, u32::MAX], Some(u32::MAX)),
        ];
        for &(agent, hub, want) in cases {
            assert_eq!(negotiate(agent, hub), want, "agent {agent:?} hub {hub:?}");
            assert_eq!(negotiate(hub, agent), want, "symmetric: {hub:?} {agent:?}");
        }
    }

    #[test]
    fn this_crate_speaks_its_own_versions() {
        assert!(SUPPORTED_VERSIONS.contains(&PROTOCOL_VERSION));
        assert!(SUPPORTED_VERSIONS.contains(&HANDSHAKE_VERSION));
        assert_eq!(
            negotiate(SUPPORTED_VERSIONS, SUPPORTED_VERSIONS),
            Some(PROTOCOL_VERSION)
        );
    }
}
