//! The provision transaction: the pure state machine ([`machine`]), the write-ahead journal
//! on disk ([`journal`]) and the per-vmid lock ([`lock`]).
//!
//! The machine decides, the journal remembers, the lock excludes; none of them talks to PVE
//! or a guest. The executor performs the machine's effects through the PVE and guest seams,
//! journals each state before the write that follows it, and holds the vmid's lock for the
//! whole transaction.

pub mod effects;
pub mod group;
pub mod identity;
pub mod journal;
pub mod lock;
pub mod machine;

pub use identity::BirthIdentity;
pub use journal::{Journal, JournalError, JournalRow, TxnState};
pub use lock::{GuestProofLock, LabBridgeLock, LockError, VmidLock};
pub use machine::{
    recover, step, Disallowed, Effect, Event, GroupMember, GuestView, Marker, Outcome, OutcomeKind,
    Phase, RecoveryObservation, Request, State, Step, TaskExit, TaskObservation, TxnKind,
};
