//! The durable outbox: every event, result and inventory meant for the hub, stored on disk
//! before it counts as sent, and kept until the hub acknowledges it (DESIGN rule 8). Beside it,
//! the inbox: the dispatches the agent accepted (and acknowledged to the hub) but has not
//! finished, so a crash never loses one.
//!
//! Both live in `<state_dir>/outbox/` as [`RecordLog`]s (`outbox.log` + `outbox.done`,
//! `inbox.log` + `inbox.done`). One writer thread owns them and serves every request in
//! arrival order; requests that arrive together are written together: all their records in one
//! `write` and one `fdatasync` (a group commit), so many producers share the cost of a sync.
//! [`Outbox::push`] returns only once its message is synced.
//!
//! Ids: an outbox entry is a whole frame ([`hub_protocol::encode`]) under its message id. The
//! result of a transaction and the inventory answering an `inventory_request` get an id
//! derived from the transaction id ([`derived_message_id`]): however often the agent reports
//! that transaction again (a re-dispatch, a restart), the hub sees the same message id and
//! applies it once. A newer unsolicited inventory supersedes an older one still waiting, and a
//! newer restore-test coverage table (`coverage`, protocol version 2) an older one.
//!
//! Frames are stored in [`PROTOCOL_VERSION`]; the session re-writes them in its own version,
//! and drops (marks done) a `coverage` waiting while the session is of version 1, whose hub
//! has no such message.
//!
//! The spool: the outbox belongs to the `run` daemon (it holds the folder's lock). Another
//! command that has something to report (the restore-test that the systemd timer starts) calls
//! [`spool`]: the message is written to `<state_dir>/outbox/spool/<id>.msg` (synced, renamed
//! into place) and the daemon moves it into the outbox ([`Outbox::ingest_spool`]) at start and
//! every [`SPOOL_POLL_INTERVAL`], keeping its id and timestamp. A coverage table is spooled as
//! `<id>.coverage.msg`, and spooling one removes the older tables still in the spool.
//!
//! Without a hub ([`Outbox::open_keeping`]) nothing ever acknowledges a message, so the outbox
//! keeps only what [`Retention`] allows (the newest [`crate::outbox_keep::KEEP_MESSAGES`], none
//! stored longer ago than [`crate::outbox_keep::KEEP_AGE`]): after every append, at open and
//! every [`TRIM_INTERVAL`] the oldest beyond it are marked done (the marks synced), then the
//! count of dropped messages in `<state_dir>/outbox/dropped` grows by as many
//! ([`crate::outbox_keep`]). The age is the frame's `ts` (when it was stored, or spooled).
//!
//! This module never talks to the hub; the session reads pending frames with
//! [`Outbox::pending_after`] and reports acknowledgements with [`Outbox::ack`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use hub_protocol::{
    encode, AgentEnvelope, AgentMessage, Dispatch, Envelope, MessageId, Timestamp, TxnId,
    PROTOCOL_VERSION,
};
use sha2::{Digest, Sha256};
use tokio::sync::{oneshot, watch};
use ulid::Ulid;

use super::store::{Limits, NewRecord, OpenReport, RecordLog, Slot, StoreError};
use crate::error::ErrorCode;
pub use crate::outbox_keep::Retention;
use crate::outbox_keep::{self, Dropped};

/// The outbox folder inside the state dir.
pub const OUTBOX_DIR: &str = outbox_keep::OUTBOX_DIR;
/// How often an outbox that keeps a [`Retention`] drops what aged past it, besides after
/// every append.
pub const TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);
/// The most frames [`Outbox::pending_after`] returns at once.
pub const MAX_READ_BATCH: usize = 256;
/// The most frame bytes [`Outbox::pending_after`] returns at once.
pub const MAX_READ_BATCH_BYTES: usize = 4 * 1024 * 1024;
/// The most requests the writer takes into one group commit.
pub const MAX_GROUP_REQUESTS: usize = 4096;
/// The spool folder inside the outbox folder.
pub const SPOOL_DIR: &str = "spool";
/// How often the daemon moves spooled messages into the outbox.
pub const SPOOL_POLL_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);
/// The largest spool file read.
pub const MAX_SPOOL_FILE_BYTES: u64 = hub_protocol::MAX_FRAME_BYTES as u64;

const OUTBOX_LOG: &str = "outbox";
const INBOX_LOG: &str = "inbox";

/// Record kinds in the outbox log.
pub mod kind {
    /// An `event`.
    pub const EVENT: &str = "event";
    /// A `result`.
    pub const RESULT: &str = "result";
    /// An `inventory` sent on connect or on change; a newer one supersedes it.
    pub const INVENTORY: &str = "inventory";
    /// An `inventory` answering an `inventory_request`; never superseded.
    pub const INVENTORY_REPLY: &str = "inventory_reply";
    /// A `coverage` table (protocol version 2); a newer one supersedes it.
    pub const COVERAGE: &str = "coverage";
    /// A dispatch in the inbox.
    pub const DISPATCH: &str = "dispatch";
}

/// Errors of the outbox.
#[derive(Debug, Clone, thiserror::Error)]
pub enum OutboxError {
    /// The store refused or failed.
    #[error("{0}")]
    Store(Arc<StoreError>),
    /// The message could not be encoded as a frame.
    #[error("cannot store the `{type_name}` message {id}: {detail}")]
    Encode {
        /// The message type.
        type_name: &'static str,
        /// Its id.
        id: MessageId,
        /// Why.
        detail: String,
    },
    /// The message belongs to one session (hello, heartbeat, ack, protocol error) and is
    /// never stored.
    #[error("a `{type_name}` message belongs to its session and is never stored in the outbox")]
    NotStorable {
        /// The message type.
        type_name: &'static str,
    },
    /// The writer has stopped (the daemon is shutting down).
    #[error("the outbox has been closed; the message was not stored")]
    Closed,
}

impl OutboxError {
    /// The stable code (state dir and disk are the node's environment).
    pub fn code(&self) -> ErrorCode {
        ErrorCode::ConfigInvalid
    }
}

impl From<StoreError> for OutboxError {
    fn from(e: StoreError) -> Self {
        Self::Store(Arc::new(e))
    }
}

/// A frame waiting for the hub's ack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// Its place in the order of appends.
    pub seq: u64,
    /// The message id.
    pub id: MessageId,
    /// The frame as stored (written in [`PROTOCOL_VERSION`]).
    pub frame: String,
}

/// What was found when the outbox was opened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenSummary {
    /// Messages waiting for the hub.
    pub pending_messages: usize,
    /// Dispatches accepted but not finished.
    pub open_dispatches: usize,
    /// A torn last record was cut off in either log.
    pub torn_tail: bool,
}

/// The id of a message that reports on transaction `txn` for `purpose` (`result`,
/// `inventory`): the same for every report of that transaction, so the hub applies it once.
/// It keeps the transaction's timestamp, and its random part is taken from a SHA-256 of the
/// purpose and the transaction id.
pub fn derived_message_id(txn: TxnId, purpose: &str) -> MessageId {
    let mut h = Sha256::new();
    h.update(b"felhom-agent derived message id\n");
    h.update(purpose.as_bytes());
    h.update(b"\n");
    h.update(txn.to_string().as_bytes());
    let digest = h.finalize();
    let mut random = [0u8; 16];
    random[6..].copy_from_slice(&digest[..10]);
    let ulid = Ulid::from_parts(txn.ulid().timestamp_ms(), u128::from_be_bytes(random));
    MessageId::from_ulid(ulid)
}

/// The id of the event that reports a transaction's `record`-th journal record: the same for
/// every report of that record, so an event reported again after a crash is applied once.
pub fn event_message_id(txn: TxnId, record: u64) -> MessageId {
    derived_message_id(txn, &format!("event {record}"))
}

/// The current time as a protocol timestamp (UTC, millisecond precision). Fails only if the
/// clock gives a year the protocol cannot write.
pub fn now_timestamp() -> Result<Timestamp, hub_protocol::InvalidTimestamp> {
    let now = time::OffsetDateTime::now_utc();
    Timestamp::parse(&format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second(),
        now.millisecond()
    ))
}

/// The store kind of a message that already has its id.
fn kind_of(message: &AgentMessage) -> Result<&'static str, OutboxError> {
    classify(message).map(|(kind, _)| kind)
}

/// `message` stamped now and wrapped in an envelope under `id`, as the frame text the outbox
/// stores and sends.
fn envelope_frame(id: MessageId, message: AgentMessage) -> Result<AgentEnvelope, OutboxError> {
    let ts = now_timestamp().map_err(|e| OutboxError::Encode {
        type_name: other_type_name(&message),
        id,
        detail: e.to_string(),
    })?;
    Ok(Envelope::new(PROTOCOL_VERSION, id, ts, message))
}

/// Encode `envelope` for the store.
fn encoded(envelope: &AgentEnvelope) -> Result<String, OutboxError> {
    encode(envelope).map_err(|e| OutboxError::Encode {
        type_name: envelope.type_name(),
        id: envelope.id,
        detail: e.to_string(),
    })
}

/// Leave `message` for the `run` daemon to move into the outbox (see the module docs), from a
/// process that does not own the outbox. Returns once the spool file is synced.
pub fn spool(state_dir: &Path, message: AgentMessage) -> Result<MessageId, OutboxError> {
    let (_, id) = classify(&message)?;
    spool_as(state_dir, id, message)
}

/// [`spool`] under the id `id` (an event's id derived from its journal record, so the same
/// record spooled again is applied once by the hub).
pub fn spool_as(
    state_dir: &Path,
    id: MessageId,
    message: AgentMessage,
) -> Result<MessageId, OutboxError> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let (kind, _) = classify(&message)?;
    let envelope = envelope_frame(id, message)?;
    let frame = encoded(&envelope)?;
    let dir = state_dir.join(OUTBOX_DIR).join(SPOOL_DIR);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| OutboxError::from(StoreError::Io { path, source })
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|source| {
            OutboxError::from(StoreError::CreateDir {
                path: dir.clone(),
                source,
            })
        })?;
    let superseding = kind == kind::COVERAGE;
    let name = if superseding {
        format!("{id}{COVERAGE_SPOOL_SUFFIX}")
    } else {
        format!("{id}.msg")
    };
    let tmp = dir.join(format!("{id}.tmp"));
    let done = dir.join(&name);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io(&tmp))?;
    file.write_all(frame.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(io(&tmp))?;
    std::fs::rename(&tmp, &done).map_err(io(&done))?;
    if superseding {
        remove_older_coverage(&dir, &name);
    }
    std::fs::File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(io(&dir))?;
    Ok(id)
}

/// How a spooled coverage table's file name ends.
const COVERAGE_SPOOL_SUFFIX: &str = ".coverage.msg";

/// Remove the coverage tables spooled before `newest` (their names sort before it): the newest
/// table supersedes them. One the daemon is moving into the outbox meanwhile is superseded
/// there.
fn remove_older_coverage(dir: &Path, newest: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.ends_with(COVERAGE_SPOOL_SUFFIX) && name < newest {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The spooled frames, oldest first: (file, frame text). Unreadable files are set aside as
/// `.bad` with an error in the log.
fn read_spool(dir: &Path) -> Vec<(PathBuf, String)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "msg"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for path in files {
        let text = std::fs::metadata(&path)
            .map_err(|e| e.to_string())
            .and_then(|m| {
                if m.len() > MAX_SPOOL_FILE_BYTES {
                    Err(format!("{} bytes, over {MAX_SPOOL_FILE_BYTES}", m.len()))
                } else {
                    std::fs::read_to_string(&path).map_err(|e| e.to_string())
                }
            });
        match text {
            Ok(t) => out.push((path, t)),
            Err(why) => set_aside(&path, &why),
        }
    }
    out
}

fn set_aside(path: &Path, why: &str) {
    let bad = path.with_extension("bad");
    tracing::error!(
        path = %path.display(),
        "spooled message {} cannot be used ({why}); moved to {} for a human",
        path.display(),
        bad.display()
    );
    let _ = std::fs::rename(path, &bad);
}

/// The store kind and the message id a message is stored under.
fn classify(message: &AgentMessage) -> Result<(&'static str, MessageId), OutboxError> {
    let fresh = || MessageId::from_ulid(Ulid::new());
    match message {
        AgentMessage::Event(_) => Ok((kind::EVENT, fresh())),
        AgentMessage::Result(r) => Ok((kind::RESULT, derived_message_id(r.txn, "result"))),
        AgentMessage::Inventory(inv) => match inv.request {
            Some(txn) => Ok((kind::INVENTORY_REPLY, derived_message_id(txn, "inventory"))),
            None => Ok((kind::INVENTORY, fresh())),
        },
        AgentMessage::Coverage(_) => Ok((kind::COVERAGE, fresh())),
        other => Err(OutboxError::NotStorable {
            type_name: other_type_name(other),
        }),
    }
}

fn other_type_name(message: &AgentMessage) -> &'static str {
    use hub_protocol::Message;
    message.type_name()
}

type Reply<T> = oneshot::Sender<Result<T, OutboxError>>;

/// Where an append's answer goes: an awaiting task, or a caller blocked on a std channel
/// (a journal record that may not count as done before its event is stored).
enum AppendReply {
    Async(Reply<u64>),
    Blocking(std::sync::mpsc::SyncSender<Result<u64, OutboxError>>),
}

impl AppendReply {
    fn send(self, result: Result<u64, OutboxError>) {
        match self {
            AppendReply::Async(tx) => {
                let _ = tx.send(result);
            }
            AppendReply::Blocking(tx) => {
                let _ = tx.send(result);
            }
        }
    }
}

enum Request {
    Append {
        id: MessageId,
        kind: &'static str,
        frame: String,
        reply: AppendReply,
    },
    Ack(Vec<MessageId>),
    PendingAfter {
        after: u64,
        reply: Reply<Vec<Outgoing>>,
    },
    Accept {
        txn: TxnId,
        body: String,
        reply: Reply<()>,
    },
    Finished(TxnId),
    OpenDispatches {
        reply: Reply<Vec<Dispatch>>,
    },
    Close,
}

#[derive(Debug)]
struct Shared {
    depth: AtomicU64,
    open_dispatches: AtomicU64,
    dropped: AtomicU64,
    last_seq: watch::Sender<u64>,
}

/// The handle to the outbox and inbox; cheap to clone. See the module docs.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: mpsc::Sender<Request>,
    shared: Arc<Shared>,
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
    dir: PathBuf,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Request::Append { .. } => "Append",
            Request::Ack(_) => "Ack",
            Request::PendingAfter { .. } => "PendingAfter",
            Request::Accept { .. } => "Accept",
            Request::Finished(_) => "Finished",
            Request::OpenDispatches { .. } => "OpenDispatches",
            Request::Close => "Close",
        })
    }
}

impl Outbox {
    /// Open `<state_dir>/outbox/` with the default limits and start the writer thread.
    pub fn open(state_dir: &Path) -> Result<(Outbox, OpenSummary), OutboxError> {
        Self::open_with_limits(state_dir, Limits::default())
    }

    /// Open `<state_dir>/outbox/` with these limits for the outbox log.
    pub fn open_with_limits(
        state_dir: &Path,
        limits: Limits,
    ) -> Result<(Outbox, OpenSummary), OutboxError> {
        Self::open_inner(state_dir, limits, None)
    }

    /// Open `<state_dir>/outbox/` for a daemon without a hub: it keeps only what `keep`
    /// allows, the oldest dropped first and counted (see the module docs). What is over the
    /// bounds already is dropped before it returns.
    pub fn open_keeping(
        state_dir: &Path,
        keep: Retention,
    ) -> Result<(Outbox, OpenSummary), OutboxError> {
        Self::open_inner(state_dir, Limits::default(), Some(keep))
    }

    fn open_inner(
        state_dir: &Path,
        limits: Limits,
        keep: Option<Retention>,
    ) -> Result<(Outbox, OpenSummary), OutboxError> {
        let dir = state_dir.join(OUTBOX_DIR);
        let (outbox, out_report) = RecordLog::open_with_limits(&dir, OUTBOX_LOG, limits)?;
        let (inbox, in_report) = RecordLog::open(&dir, INBOX_LOG)?;
        let summary = OpenSummary {
            pending_messages: outbox.pending_count(),
            open_dispatches: inbox.pending_count(),
            torn_tail: report_torn(&out_report) || report_torn(&in_report),
        };
        let dropped = match outbox_keep::read(&dir) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("{e}; the count of dropped reports starts again from 0");
                None
            }
        };
        let (last_seq, _) = watch::channel(outbox.last_seq());
        let shared = Arc::new(Shared {
            depth: AtomicU64::new(outbox.pending_count() as u64),
            open_dispatches: AtomicU64::new(inbox.pending_count() as u64),
            dropped: AtomicU64::new(dropped.as_ref().map_or(0, |d| d.count)),
            last_seq,
        });
        let (tx, rx) = mpsc::channel();
        let writer_shared = shared.clone();
        let mut writer = Writer {
            outbox,
            inbox,
            shared: writer_shared,
            keep,
            dropped,
            dir: dir.clone(),
        };
        // What is over the bounds already goes before the outbox is handed out.
        writer.trim();
        let thread = std::thread::Builder::new()
            .name("felhom-outbox".to_string())
            .spawn(move || writer.run(rx))
            .map_err(|source| StoreError::Io {
                path: dir.clone(),
                source,
            })?;
        Ok((
            Outbox {
                tx,
                shared,
                thread: Arc::new(Mutex::new(Some(thread))),
                dir,
            },
            summary,
        ))
    }

    /// The outbox folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Store a message for the hub and return its id once it is synced to disk. Only events,
    /// results, inventories and coverage tables are stored (the other types belong to one
    /// session).
    pub async fn push(&self, message: AgentMessage) -> Result<MessageId, OutboxError> {
        let (kind, id) = classify(&message)?;
        let envelope = envelope_frame(id, message)?;
        self.push_envelope(kind, envelope).await
    }

    async fn push_envelope(
        &self,
        kind: &'static str,
        envelope: AgentEnvelope,
    ) -> Result<MessageId, OutboxError> {
        let id = envelope.id;
        let frame = encoded(&envelope)?;
        let (reply, rx) = oneshot::channel();
        self.send(Request::Append {
            id,
            kind,
            frame,
            reply: AppendReply::Async(reply),
        })?;
        rx.await.map_err(|_| OutboxError::Closed)??;
        Ok(id)
    }

    /// [`Outbox::push`] from synchronous code: store `message` and return its id once it is
    /// synced to disk, blocking the calling thread (the writer is a thread of its own, so this
    /// never waits for the caller's runtime). A result is stored under the id derived from its
    /// transaction, so the same result stored again is applied once by the hub.
    pub fn push_blocking(&self, message: AgentMessage) -> Result<MessageId, OutboxError> {
        let (kind, id) = classify(&message)?;
        let frame = encoded(&envelope_frame(id, message)?)?;
        let (reply, rx) = std::sync::mpsc::sync_channel(1);
        self.send(Request::Append {
            id,
            kind,
            frame,
            reply: AppendReply::Blocking(reply),
        })?;
        rx.recv().map_err(|_| OutboxError::Closed)??;
        Ok(id)
    }

    /// Store an event under `id` and return once it is synced to disk, blocking the calling
    /// thread (the writer is a thread of its own, so this never waits for the caller's
    /// runtime). The same `id` stored again is applied once by the hub.
    pub fn push_event_blocking(
        &self,
        id: MessageId,
        event: hub_protocol::Event,
    ) -> Result<(), OutboxError> {
        let message = AgentMessage::Event(event);
        let ts = now_timestamp().map_err(|e| OutboxError::Encode {
            type_name: "event",
            id,
            detail: e.to_string(),
        })?;
        let envelope = Envelope::new(PROTOCOL_VERSION, id, ts, message);
        let frame = encode(&envelope).map_err(|e| OutboxError::Encode {
            type_name: envelope.type_name(),
            id,
            detail: e.to_string(),
        })?;
        let (reply, rx) = std::sync::mpsc::sync_channel(1);
        self.send(Request::Append {
            id,
            kind: kind::EVENT,
            frame,
            reply: AppendReply::Blocking(reply),
        })?;
        rx.recv().map_err(|_| OutboxError::Closed)??;
        Ok(())
    }

    /// Move the spooled messages into the outbox, oldest first, keeping their ids and
    /// timestamps; each spool file is removed once its message is stored. Returns how many
    /// were moved.
    pub async fn ingest_spool(&self) -> Result<usize, OutboxError> {
        let dir = self.dir.join(SPOOL_DIR);
        let spooled = tokio::task::spawn_blocking(move || read_spool(&dir))
            .await
            .unwrap_or_default();
        let mut moved = 0;
        for (path, frame) in spooled {
            let frame = frame.trim_end().to_string();
            let (id, kind) = match hub_protocol::decode::<AgentMessage>(&frame) {
                Ok(env) => match kind_of(&env.message) {
                    Ok(kind) => (env.id, kind),
                    Err(e) => {
                        set_aside(&path, &e.to_string());
                        continue;
                    }
                },
                Err(e) => {
                    set_aside(&path, &e.to_string());
                    continue;
                }
            };
            let (reply, rx) = oneshot::channel();
            self.send(Request::Append {
                id,
                kind,
                frame,
                reply: AppendReply::Async(reply),
            })?;
            rx.await.map_err(|_| OutboxError::Closed)??;
            let _ = std::fs::remove_file(&path);
            moved += 1;
        }
        Ok(moved)
    }

    /// The hub acknowledged these messages: they are done (ids not waiting are ignored).
    pub fn ack(&self, ids: Vec<MessageId>) {
        if !ids.is_empty() {
            let _ = self.tx.send(Request::Ack(ids));
        }
    }

    /// Up to [`MAX_READ_BATCH`] frames (and [`MAX_READ_BATCH_BYTES`]) still waiting for an ack
    /// that were appended after `after`, in order. `0` starts from the oldest.
    pub async fn pending_after(&self, after: u64) -> Result<Vec<Outgoing>, OutboxError> {
        let (reply, rx) = oneshot::channel();
        self.send(Request::PendingAfter { after, reply })?;
        rx.await.map_err(|_| OutboxError::Closed)?
    }

    /// Messages waiting for an ack.
    pub fn depth(&self) -> u64 {
        self.shared.depth.load(Ordering::Relaxed)
    }

    /// Messages dropped unsent while no hub was configured (the count kept in
    /// `<state_dir>/outbox/dropped`, across restarts).
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Dispatches accepted and not finished.
    pub fn open_dispatch_count(&self) -> u64 {
        self.shared.open_dispatches.load(Ordering::Relaxed)
    }

    /// The seq of the newest stored message; changes whenever one is stored.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.shared.last_seq.subscribe()
    }

    /// Store a dispatch in the inbox, synced, before it is acknowledged to the hub. A dispatch
    /// whose transaction is already in the inbox is not stored twice.
    pub async fn accept_dispatch(&self, dispatch: &Dispatch) -> Result<(), OutboxError> {
        let body = serde_json::to_string(dispatch).map_err(|e| OutboxError::Encode {
            type_name: "dispatch",
            id: MessageId::from_ulid(dispatch.txn.ulid()),
            detail: e.to_string(),
        })?;
        let (reply, rx) = oneshot::channel();
        self.send(Request::Accept {
            txn: dispatch.txn,
            body,
            reply,
        })?;
        rx.await.map_err(|_| OutboxError::Closed)?
    }

    /// The dispatch of `txn` is finished (its result is in the outbox).
    pub fn dispatch_finished(&self, txn: TxnId) {
        let _ = self.tx.send(Request::Finished(txn));
    }

    /// The dispatches accepted and not finished, in the order they were accepted.
    pub async fn open_dispatches(&self) -> Result<Vec<Dispatch>, OutboxError> {
        let (reply, rx) = oneshot::channel();
        self.send(Request::OpenDispatches { reply })?;
        rx.await.map_err(|_| OutboxError::Closed)?
    }

    /// Finish every request already sent, stop the writer and wait for it. Later calls on any
    /// clone fail with [`OutboxError::Closed`].
    pub async fn close(&self) {
        let _ = self.tx.send(Request::Close);
        let handle = self.thread.lock().ok().and_then(|mut g| g.take());
        if let Some(handle) = handle {
            let _ = tokio::task::spawn_blocking(move || handle.join()).await;
        }
    }

    fn send(&self, request: Request) -> Result<(), OutboxError> {
        self.tx.send(request).map_err(|_| OutboxError::Closed)
    }
}

fn report_torn(report: &OpenReport) -> bool {
    report.torn_tail
}

struct Writer {
    outbox: RecordLog,
    inbox: RecordLog,
    shared: Arc<Shared>,
    /// What an outbox without a hub keeps; `None`: everything until acknowledged.
    keep: Option<Retention>,
    /// The count of dropped messages as stored.
    dropped: Option<Dropped>,
    /// The outbox folder.
    dir: PathBuf,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Request>) {
        loop {
            let first = match self.keep {
                None => match rx.recv() {
                    Ok(r) => r,
                    Err(_) => break,
                },
                Some(_) => match rx.recv_timeout(TRIM_INTERVAL) {
                    Ok(r) => r,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        self.trim();
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                },
            };
            let mut group = vec![first];
            while group.len() < MAX_GROUP_REQUESTS {
                match rx.try_recv() {
                    Ok(r) => group.push(r),
                    Err(_) => break,
                }
            }
            let close = self.serve(group);
            self.publish();
            if close {
                break;
            }
        }
    }

    /// Make the counters and the newest seq visible to the handles. Called before replying to
    /// writes, so a caller whose write returned sees its effect.
    fn publish(&self) {
        self.shared
            .depth
            .store(self.outbox.pending_count() as u64, Ordering::Relaxed);
        self.shared
            .open_dispatches
            .store(self.inbox.pending_count() as u64, Ordering::Relaxed);
        let last = self.outbox.last_seq();
        self.shared.last_seq.send_if_modified(|seq| {
            let changed = *seq != last;
            *seq = last;
            changed
        });
    }

    /// Serve one group: writes first (appends, accepts, acks), then reads. Returns true when
    /// the group asked to close.
    fn serve(&mut self, group: Vec<Request>) -> bool {
        let mut appends = Vec::new();
        let mut accepts = Vec::new();
        let mut acks: Vec<Ulid> = Vec::new();
        let mut finished: Vec<Ulid> = Vec::new();
        let mut reads = Vec::new();
        let mut close = false;
        for request in group {
            match request {
                Request::Append {
                    id,
                    kind,
                    frame,
                    reply,
                } => appends.push((id, kind, frame, reply)),
                Request::Accept { txn, body, reply } => accepts.push((txn, body, reply)),
                Request::Ack(ids) => acks.extend(ids.into_iter().map(MessageId::ulid)),
                Request::Finished(txn) => finished.push(txn.ulid()),
                Request::Close => close = true,
                other => reads.push(other),
            }
        }
        if !appends.is_empty() {
            self.append_group(appends);
        }
        if !accepts.is_empty() {
            self.accept_group(accepts);
        }
        if !acks.is_empty() {
            if let Err(e) = self.outbox.mark_done(&acks) {
                tracing::warn!("cannot record acknowledgements in the outbox: {e}");
            }
        }
        if !finished.is_empty() {
            if let Err(e) = self.inbox.mark_done(&finished) {
                tracing::warn!("cannot record finished dispatches in the inbox: {e}");
            }
        }
        self.publish();
        for request in reads {
            match request {
                Request::PendingAfter { after, reply } => {
                    let _ = reply.send(self.pending_after(after));
                }
                Request::OpenDispatches { reply } => {
                    let _ = reply.send(self.open_dispatches());
                }
                _ => {}
            }
        }
        close
    }

    fn append_group(&mut self, appends: Vec<(MessageId, &'static str, String, AppendReply)>) {
        // A newer unsolicited inventory supersedes the older ones still waiting; so does a
        // newer coverage table.
        for superseding in [kind::INVENTORY, kind::COVERAGE] {
            if !appends.iter().any(|(_, k, _, _)| *k == superseding) {
                continue;
            }
            let stale: Vec<Ulid> = self
                .outbox
                .pending()
                .filter(|s| s.kind == superseding)
                .map(|s| s.id)
                .collect();
            if !stale.is_empty() {
                if let Err(e) = self.outbox.mark_done(&stale) {
                    tracing::warn!(
                        "cannot drop superseded `{superseding}` messages from the outbox: {e}"
                    );
                }
            }
        }
        let records: Vec<NewRecord<'_>> = appends
            .iter()
            .map(|(id, kind, frame, _)| NewRecord {
                id: id.ulid(),
                kind,
                body: frame,
            })
            .collect();
        match self.outbox.append(&records) {
            Ok(seqs) => {
                drop(records);
                // Within the bounds before the callers hear back.
                self.trim();
                self.publish();
                for ((_, _, _, reply), seq) in appends.into_iter().zip(seqs) {
                    reply.send(Ok(seq));
                }
            }
            Err(StoreError::BadRecord { .. }) if appends.len() > 1 => {
                // One bad record must not fail the others: store them one by one.
                drop(records);
                for (id, kind, frame, reply) in appends {
                    let one = [NewRecord {
                        id: id.ulid(),
                        kind,
                        body: &frame,
                    }];
                    let result = self
                        .outbox
                        .append(&one)
                        .map(|s| s.first().copied().unwrap_or(0))
                        .map_err(OutboxError::from);
                    self.trim();
                    self.publish();
                    reply.send(result);
                }
            }
            Err(e) => {
                drop(records);
                let e = OutboxError::from(e);
                for (_, _, _, reply) in appends {
                    reply.send(Err(e.clone()));
                }
            }
        }
    }

    /// Drop what is beyond [`Writer::keep`], oldest first: the messages over the count, then
    /// from the oldest on each stored longer ago than the age (up to the first that is not).
    /// The marks are synced before the count of dropped messages grows.
    fn trim(&mut self) {
        let Some(keep) = self.keep else { return };
        let now = time::OffsetDateTime::now_utc();
        let over = self
            .outbox
            .pending_count()
            .saturating_sub(keep.max_messages);
        let max_age = time::Duration::try_from(keep.max_age).unwrap_or(time::Duration::MAX);
        let mut drop: Vec<Ulid> = Vec::new();
        for (i, slot) in self.outbox.pending().enumerate() {
            if i < over {
                drop.push(slot.id);
                continue;
            }
            if now - self.stored_at(slot) <= max_age {
                break;
            }
            drop.push(slot.id);
        }
        if drop.is_empty() {
            return;
        }
        let marked = self
            .outbox
            .mark_done(&drop)
            .and_then(|n| self.outbox.sync_marks().map(|()| n));
        let n = match marked {
            Ok(n) => n as u64,
            Err(e) => {
                tracing::warn!(
                    "cannot drop the {} oldest reports from the outbox: {e}",
                    drop.len()
                );
                return;
            }
        };
        match outbox_keep::add(&self.dir, self.dropped.as_ref(), n, now) {
            Ok(d) => {
                self.shared.dropped.store(d.count, Ordering::Relaxed);
                tracing::warn!(
                    path = %self.dir.display(),
                    "no [hub] configured: dropped the {n} oldest reports from the outbox {} \
                     (it keeps {}); {} dropped since {}, counted in {}",
                    self.dir.display(),
                    keep.describe(),
                    d.count,
                    d.since,
                    self.dir.join(outbox_keep::DROPPED_FILE).display()
                );
                self.dropped = Some(d);
            }
            Err(e) => tracing::warn!(
                path = %self.dir.display(),
                "no [hub] configured: dropped the {n} oldest reports from the outbox {}, but \
                 cannot count them in {}: {e}",
                self.dir.display(),
                self.dir.join(outbox_keep::DROPPED_FILE).display()
            ),
        }
        self.publish();
    }

    /// When the message in `slot` was stored: its frame's `ts`, else its id's time.
    fn stored_at(&self, slot: &Slot) -> time::OffsetDateTime {
        #[derive(serde::Deserialize)]
        struct Ts {
            ts: String,
        }
        let from_frame = self.outbox.read_body(slot).ok().and_then(|body| {
            let ts = serde_json::from_str::<Ts>(&body).ok()?.ts;
            time::OffsetDateTime::parse(&ts, &time::format_description::well_known::Rfc3339).ok()
        });
        from_frame.unwrap_or_else(|| {
            let ms = i128::from(slot.id.timestamp_ms());
            time::OffsetDateTime::from_unix_timestamp_nanos(ms * 1_000_000)
                .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
        })
    }

    fn accept_group(&mut self, accepts: Vec<(TxnId, String, Reply<()>)>) {
        let records: Vec<NewRecord<'_>> = accepts
            .iter()
            .map(|(txn, body, _)| NewRecord {
                id: txn.ulid(),
                kind: kind::DISPATCH,
                body,
            })
            .collect();
        let result = self.inbox.append(&records).map_err(OutboxError::from);
        drop(records);
        self.publish();
        for (_, _, reply) in accepts {
            let _ = reply.send(result.clone().map(|_| ()));
        }
    }

    fn pending_after(&self, after: u64) -> Result<Vec<Outgoing>, OutboxError> {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        for slot in self.outbox.pending_after(after) {
            if out.len() >= MAX_READ_BATCH || (bytes >= MAX_READ_BATCH_BYTES && !out.is_empty()) {
                break;
            }
            let frame = self.outbox.read_body(slot)?;
            bytes += frame.len();
            out.push(Outgoing {
                seq: slot.seq,
                id: MessageId::from_ulid(slot.id),
                frame,
            });
        }
        Ok(out)
    }

    fn open_dispatches(&self) -> Result<Vec<Dispatch>, OutboxError> {
        let mut out = Vec::new();
        for slot in self.inbox.pending() {
            let body = self.inbox.read_body(slot)?;
            match serde_json::from_str::<Dispatch>(&body) {
                Ok(d) => out.push(d),
                Err(e) => tracing::error!(
                    path = %self.inbox.path().display(),
                    "dispatch {} in {} cannot be read back ({e}); it is left there for a human",
                    slot.id,
                    self.inbox.path().display()
                ),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use hub_protocol::{
        decode, DispatchAction, Event, Inventory, Outcome, Phase, TxnKind, TxnResult,
    };

    use super::*;

    fn txn(n: u128) -> TxnId {
        TxnId::from_ulid(Ulid::from_parts(1_767_225_600_000, n))
    }

    fn event(n: u128) -> AgentMessage {
        AgentMessage::Event(Event {
            txn: txn(n),
            kind: TxnKind::Provision,
            vmid: Some(120),
            phase: Phase::Validated,
            at: now_timestamp().expect("now"),
            detail: Some(format!("event {n}")),
            error: None,
            guest: None,
            backup: None,
        })
    }

    fn result(n: u128) -> AgentMessage {
        AgentMessage::Result(TxnResult {
            txn: txn(n),
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
        })
    }

    fn coverage(guest_count: u32) -> AgentMessage {
        AgentMessage::Coverage(hub_protocol::Coverage {
            node: "pve1".to_string(),
            at: now_timestamp().expect("now"),
            guest_count,
            guests: vec![],
        })
    }

    fn inventory(request: Option<TxnId>, foreign: u32) -> AgentMessage {
        AgentMessage::Inventory(Inventory {
            request,
            guests: vec![],
            foreign_vmids: vec![foreign],
        })
    }

    async fn all_pending(outbox: &Outbox) -> Vec<Outgoing> {
        let mut out = Vec::new();
        let mut after = 0;
        for _ in 0..1000 {
            let batch = outbox.pending_after(after).await.expect("read");
            let Some(last) = batch.last() else { break };
            after = last.seq;
            out.extend(batch);
        }
        out
    }

    #[tokio::test]
    async fn pushed_messages_wait_until_acked_and_survive_reopen() {
        let dir = tempfile::tempdir().expect("tmp");
        let ids = {
            let (outbox, summary) = Outbox::open(dir.path()).expect("open");
            assert_eq!(summary, OpenSummary::default());
            let mut ids = Vec::new();
            for n in 1..=5 {
                ids.push(outbox.push(event(n)).await.expect("push"));
            }
            assert_eq!(outbox.depth(), 5);
            outbox.ack(vec![ids[0], ids[2]]);
            let pending = all_pending(&outbox).await;
            assert_eq!(
                pending.iter().map(|o| o.id).collect::<Vec<_>>(),
                vec![ids[1], ids[3], ids[4]]
            );
            for o in &pending {
                let env: AgentEnvelope = decode(&o.frame).expect("a stored frame decodes");
                assert_eq!(env.id, o.id);
                assert_eq!(env.type_name(), "event");
            }
            outbox.close().await;
            assert!(matches!(
                outbox.push(event(9)).await,
                Err(OutboxError::Closed)
            ));
            ids
        };
        let (outbox, summary) = Outbox::open(dir.path()).expect("reopen");
        assert_eq!(summary.pending_messages, 3);
        let pending = all_pending(&outbox).await;
        assert_eq!(
            pending.iter().map(|o| o.id).collect::<Vec<_>>(),
            vec![ids[1], ids[3], ids[4]]
        );
        outbox.close().await;
    }

    #[tokio::test]
    async fn a_blocking_event_is_synced_on_return_and_stored_once_per_record() {
        let dir = tempfile::tempdir().expect("tmp");
        let AgentMessage::Event(ev) = event(1) else {
            unreachable!()
        };
        let id3 = event_message_id(ev.txn, 3);
        assert_eq!(id3, event_message_id(ev.txn, 3), "the id is stable");
        assert_ne!(id3, event_message_id(ev.txn, 4));
        assert_ne!(id3, event_message_id(txn(2), 3));
        {
            let (outbox, _) = Outbox::open(dir.path()).expect("open");
            outbox.push_event_blocking(id3, ev.clone()).expect("push");
            // The same record reported again (after a crash) is stored once.
            outbox.push_event_blocking(id3, ev.clone()).expect("again");
            outbox
                .push_event_blocking(event_message_id(ev.txn, 4), ev.clone())
                .expect("next record");
            assert_eq!(outbox.depth(), 2);
            // Dropped without close: what returned is on disk.
            drop(outbox);
        }
        let mut tries = 0;
        let (outbox, summary) = loop {
            // The writer thread of the dropped handle ends once its channel is gone.
            match Outbox::open(dir.path()) {
                Ok(o) => break o,
                Err(e) if tries < 250 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => panic!("the outbox stayed locked after its handle was dropped: {e}"),
            }
        };
        assert_eq!(summary.pending_messages, 2);
        let pending = all_pending(&outbox).await;
        assert_eq!(pending[0].id, id3);
        outbox.close().await;
    }

    #[tokio::test]
    async fn a_result_is_stored_once_under_an_id_derived_from_its_transaction() {
        let dir = tempfile::tempdir().expect("tmp");
        let (outbox, _) = Outbox::open(dir.path()).expect("open");
        let a = outbox.push(result(7)).await.expect("push");
        let b = outbox.push(result(7)).await.expect("push again");
        assert_eq!(a, b);
        // Stored from synchronous code (a copy's result as it settles): the same id.
        assert_eq!(outbox.push_blocking(result(7)).expect("push blocking"), a);
        assert_eq!(a, derived_message_id(txn(7), "result"));
        assert_ne!(a, derived_message_id(txn(7), "inventory"));
        assert_ne!(a, derived_message_id(txn(8), "result"));
        assert_eq!(
            a.ulid().timestamp_ms(),
            txn(7).ulid().timestamp_ms(),
            "keeps the transaction's time"
        );
        assert_eq!(outbox.depth(), 1);
        outbox.close().await;
    }

    #[tokio::test]
    async fn a_newer_inventory_supersedes_an_unacked_one_but_never_a_reply() {
        let dir = tempfile::tempdir().expect("tmp");
        let (outbox, _) = Outbox::open(dir.path()).expect("open");
        outbox.push(inventory(None, 1)).await.expect("push");
        let reply = outbox.push(inventory(Some(txn(3)), 2)).await.expect("push");
        let newest = outbox.push(inventory(None, 3)).await.expect("push");
        let pending = all_pending(&outbox).await;
        assert_eq!(
            pending.iter().map(|o| o.id).collect::<Vec<_>>(),
            vec![reply, newest]
        );
        outbox.close().await;
    }

    #[tokio::test]
    async fn a_newer_coverage_supersedes_an_unacked_one_in_the_outbox_and_the_spool() {
        let dir = tempfile::tempdir().expect("tmp");
        let (outbox, _) = Outbox::open(dir.path()).expect("open");
        let ev = outbox.push(event(1)).await.expect("push");
        outbox.push(coverage(1)).await.expect("push");
        let newest = outbox.push(coverage(2)).await.expect("push");
        let pending = all_pending(&outbox).await;
        assert_eq!(
            pending.iter().map(|o| o.id).collect::<Vec<_>>(),
            vec![ev, newest]
        );
        let env: AgentEnvelope = decode(&pending[1].frame).expect("decodes");
        assert_eq!(env.v, PROTOCOL_VERSION);
        assert_eq!(env.type_name(), "coverage");
        outbox.close().await;

        let spool_dir = dir.path().join(OUTBOX_DIR).join(SPOOL_DIR);
        let result = spool(dir.path(), result(3)).expect("spool");
        spool(dir.path(), coverage(1)).expect("spool");
        std::thread::sleep(std::time::Duration::from_millis(2));
        let table = spool(dir.path(), coverage(2)).expect("spool");
        let mut left: Vec<String> = std::fs::read_dir(&spool_dir)
            .expect("read")
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        left.sort();
        assert_eq!(
            left,
            vec![format!("{result}.msg"), format!("{table}.coverage.msg")]
        );
        let (outbox, _) = Outbox::open(dir.path()).expect("reopen");
        assert_eq!(outbox.ingest_spool().await.expect("ingest"), 2);
        let ids: Vec<MessageId> = all_pending(&outbox).await.iter().map(|o| o.id).collect();
        assert_eq!(ids, vec![ev, result, table]);
        outbox.close().await;
    }

    #[tokio::test]
    async fn session_messages_are_not_stored() {
        let dir = tempfile::tempdir().expect("tmp");
        let (outbox, _) = Outbox::open(dir.path()).expect("open");
        let err = outbox
            .push(AgentMessage::Ack(hub_protocol::Ack { ids: vec![] }))
            .await
            .unwrap_err();
        assert!(matches!(err, OutboxError::NotStorable { type_name: "ack" }));
        outbox.close().await;
    }

    #[tokio::test]
    async fn dispatches_stay_open_until_finished_across_reopen() {
        let dir = tempfile::tempdir().expect("tmp");
        let d = |n: u128, vmid: u32| Dispatch {
            txn: txn(n),
            action: DispatchAction::Destroy { vmid },
        };
        {
            let (outbox, _) = Outbox::open(dir.path()).expect("open");
            outbox.accept_dispatch(&d(1, 101)).await.expect("accept");
            outbox.accept_dispatch(&d(2, 102)).await.expect("accept");
            outbox.accept_dispatch(&d(1, 101)).await.expect("again");
            outbox.dispatch_finished(txn(1));
            assert_eq!(
                outbox.open_dispatches().await.expect("read"),
                vec![d(2, 102)]
            );
            outbox.close().await;
        }
        let (outbox, summary) = Outbox::open(dir.path()).expect("reopen");
        assert_eq!(summary.open_dispatches, 1);
        assert_eq!(
            outbox.open_dispatches().await.expect("read"),
            vec![d(2, 102)]
        );
        outbox.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_pushes_share_syncs_and_keep_every_message() {
        let dir = tempfile::tempdir().expect("tmp");
        let (outbox, _) = Outbox::open(dir.path()).expect("open");
        let mut tasks = Vec::new();
        for t in 0..16u128 {
            let outbox = outbox.clone();
            tasks.push(tokio::spawn(async move {
                let mut ids = Vec::new();
                for n in 0..50u128 {
                    ids.push(outbox.push(event(t * 1000 + n)).await.expect("push"));
                }
                ids
            }));
        }
        let mut all = std::collections::HashSet::new();
        for t in tasks {
            for id in t.await.expect("task") {
                assert!(all.insert(id));
            }
        }
        assert_eq!(all.len(), 800);
        let pending = all_pending(&outbox).await;
        assert_eq!(pending.len(), 800);
        let seqs: Vec<u64> = pending.iter().map(|o| o.seq).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "in append order");
        outbox.close().await;
    }

    #[tokio::test]
    async fn spooled_messages_move_into_the_outbox_with_their_ids() {
        let dir = tempfile::tempdir().expect("tmp");
        let a = spool(dir.path(), event(1)).expect("spool");
        let b = spool(dir.path(), result(2)).expect("spool");
        assert_eq!(b, derived_message_id(txn(2), "result"));
        let spool_dir = dir.path().join(OUTBOX_DIR).join(SPOOL_DIR);
        std::fs::write(
            spool_dir.join("00000000000000000000000000.msg"),
            "not a frame",
        )
        .expect("write");
        assert!(matches!(
            spool(
                dir.path(),
                AgentMessage::Ack(hub_protocol::Ack { ids: vec![] })
            ),
            Err(OutboxError::NotStorable { .. })
        ));
        let (outbox, _) = Outbox::open(dir.path()).expect("open");
        assert_eq!(outbox.ingest_spool().await.expect("ingest"), 2);
        let pending = all_pending(&outbox).await;
        let mut ids: Vec<MessageId> = pending.iter().map(|o| o.id).collect();
        ids.sort();
        let mut want = vec![a, b];
        want.sort();
        assert_eq!(ids, want);
        let left: Vec<String> = std::fs::read_dir(&spool_dir)
            .expect("read")
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        assert_eq!(left, vec!["00000000000000000000000000.bad".to_string()]);
        assert_eq!(outbox.ingest_spool().await.expect("again"), 0);
        outbox.close().await;
    }

    /// The ids pending in the outbox log, read from its files by the store itself (the outbox
    /// closed).
    fn stored_ids(state_dir: &Path) -> Vec<MessageId> {
        let (log, _) = RecordLog::open(&state_dir.join(OUTBOX_DIR), OUTBOX_LOG).expect("open");
        log.pending().map(|s| MessageId::from_ulid(s.id)).collect()
    }

    fn keep(max_messages: usize, days: u64) -> Retention {
        Retention {
            max_messages,
            max_age: std::time::Duration::from_secs(days * 86_400),
        }
    }

    #[tokio::test]
    async fn without_a_hub_the_oldest_go_past_the_count_and_the_count_survives_reopen() {
        let dir = tempfile::tempdir().expect("tmp");
        let outbox_dir = dir.path().join(OUTBOX_DIR);
        let mut ids = Vec::new();
        {
            let (outbox, _) = Outbox::open_keeping(dir.path(), keep(3, 30)).expect("open");
            for n in 1..=5 {
                ids.push(outbox.push(event(n)).await.expect("push"));
            }
            assert_eq!(outbox.depth(), 3);
            assert_eq!(outbox.dropped(), 2);
            outbox.close().await;
        }
        assert_eq!(stored_ids(dir.path()), ids[2..].to_vec());
        let first = outbox_keep::read(&outbox_dir)
            .expect("read")
            .expect("count");
        assert_eq!(first.count, 2);
        {
            // Reopened, with a smaller bound: what is over it goes at once, counted on top.
            let (outbox, summary) = Outbox::open_keeping(dir.path(), keep(2, 30)).expect("open");
            assert_eq!(summary.pending_messages, 3, "as found on disk");
            assert_eq!(outbox.dropped(), 3);
            ids.push(outbox.push(event(6)).await.expect("push"));
            assert_eq!(outbox.dropped(), 4);
            outbox.close().await;
        }
        assert_eq!(stored_ids(dir.path()), vec![ids[4], ids[5]]);
        let second = outbox_keep::read(&outbox_dir)
            .expect("read")
            .expect("count");
        assert_eq!(second.count, 4);
        assert_eq!(second.since, first.since);
        // With a hub nothing is dropped, and the count is still known.
        let (outbox, _) = Outbox::open(dir.path()).expect("open");
        assert_eq!(outbox.dropped(), 4);
        for n in 7..=9 {
            outbox.push(event(n)).await.expect("push");
        }
        assert_eq!(outbox.depth(), 5);
        outbox.close().await;
        assert_eq!(stored_ids(dir.path()).len(), 5);
        assert_eq!(
            outbox_keep::read(&outbox_dir)
                .expect("read")
                .expect("count")
                .count,
            4
        );
    }

    #[tokio::test]
    async fn without_a_hub_a_report_stored_longer_ago_than_the_age_goes() {
        let dir = tempfile::tempdir().expect("tmp");
        // A report spooled 31 days ago keeps its timestamp into the outbox.
        let old_id = MessageId::from_ulid(Ulid::new());
        let old = Envelope::new(
            PROTOCOL_VERSION,
            old_id,
            Timestamp::parse(&crate::timefmt::rfc3339(
                time::OffsetDateTime::now_utc() - time::Duration::days(31),
            ))
            .expect("ts"),
            event(1),
        );
        let spool_dir = dir.path().join(OUTBOX_DIR).join(SPOOL_DIR);
        std::fs::create_dir_all(&spool_dir).expect("mkdir");
        std::fs::write(
            spool_dir.join(format!("{old_id}.msg")),
            encoded(&old).expect("encode"),
        )
        .expect("write");
        std::thread::sleep(std::time::Duration::from_millis(2));
        let fresh = spool(dir.path(), event(2)).expect("spool");
        let (outbox, _) = Outbox::open_keeping(dir.path(), keep(1000, 30)).expect("open");
        assert_eq!(outbox.ingest_spool().await.expect("ingest"), 2);
        assert_eq!(outbox.dropped(), 1);
        outbox.close().await;
        assert_eq!(stored_ids(dir.path()), vec![fresh]);
        // A bound of 32 days would have kept it: the age decides, not the count.
        let dir2 = tempfile::tempdir().expect("tmp");
        let spool2 = dir2.path().join(OUTBOX_DIR).join(SPOOL_DIR);
        std::fs::create_dir_all(&spool2).expect("mkdir");
        std::fs::write(
            spool2.join(format!("{old_id}.msg")),
            encoded(&old).expect("encode"),
        )
        .expect("write");
        let (outbox, _) = Outbox::open_keeping(dir2.path(), keep(1000, 32)).expect("open");
        assert_eq!(outbox.ingest_spool().await.expect("ingest"), 1);
        assert_eq!(outbox.dropped(), 0);
        outbox.close().await;
        assert_eq!(stored_ids(dir2.path()), vec![old_id]);
        assert_eq!(
            outbox_keep::read(&dir2.path().join(OUTBOX_DIR)).expect("read"),
            None
        );
    }

    #[test]
    fn timestamps_have_the_protocol_shape() {
        let ts = now_timestamp().expect("now");
        assert!(ts.as_str().ends_with('Z'), "{ts}");
        assert_eq!(ts.as_str().len(), 24, "{ts}");
        assert!(!ts.as_str().starts_with("1970"), "{ts}");
    }
}
