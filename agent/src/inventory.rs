//! The node's full guest list (`/etc/pve/.vmlist`, or `pct list` + `qm list`) joined with the
//! pool view of the API token. Foreign guests' names never leave this node.
