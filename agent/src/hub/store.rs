//! The outbox's and inbox's storage: a [`DurableLog`](crate::durable_log) of records by id
//! and kind, with completion marks and compaction. Under the outbox (messages waiting for the
//! hub's ack) and the inbox (dispatches accepted but not finished). It may use std, nix (the
//! folder's lock), ulid, `crate::durable_log` and `crate::error`; it knows nothing about the
//! hub protocol and stores bodies by id.
//!
//! A log named `outbox` lives in two files of its folder:
//!
//! - `outbox.log`: a [`crate::durable_log`] file (versioned, checksummed, size-capped, torn
//!   tail cut at open) whose record payloads are
//!   `{"id":"<ULID>","kind":"<kind>","body":<one-line JSON>}`. Appends are written in one
//!   `write` and made durable with one `fdatasync` per batch (a group commit), before they
//!   count as stored.
//! - `outbox.done`: one mark per line, `<ULID> <first 16 hex of the record's sum>`, appended
//!   when a record is finished with (acknowledged by the hub, dispatch settled). Marks are not
//!   synced: a mark lost in a crash only means the record is sent or settled again, which the
//!   receiver de-duplicates.
//!
//! Opening reads both files. A torn last record (a write cut short by a crash: no newline, or
//! a checksum that does not match) is cut off with a warning; a damaged record before the last
//! line is corruption and the log is not opened (a human must look). Damaged marks are ignored.
//! The records not marked done are the pending ones, in the order they were appended.
//!
//! Compaction: when every record is done both files are truncated; when most of the record
//! file is done it is rewritten with only the pending records ([`LogFile::rewrite`]) and the
//! marks are cleared. A crash at any point leaves either the old or the new file, never a mix.
//! The record file is capped ([`Limits::max_log_bytes`]); an append over the cap is refused
//! with [`StoreError::Full`] instead of growing without bound.
//!
//! One process owns a folder: the log takes an exclusive `flock` on `<name>.lock` for as long
//! as it is open.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use ulid::Ulid;

use crate::durable_log::{self, EncodeError, LogError, LogFile, OpenMode, Reject};
use crate::error::ErrorCode;

/// The record format version this agent writes and reads.
pub const FORMAT_VERSION: u32 = durable_log::FORMAT_VERSION;
/// Default cap on one record line, in bytes (a frame of the protocol's maximum size fits).
pub const MAX_RECORD_BYTES: usize = hub_protocol::MAX_FRAME_BYTES + 4096;
/// Default cap on the record file, in bytes.
pub const MAX_LOG_BYTES: u64 = 64 * 1024 * 1024;
/// The record file is rewritten once at least this many bytes of it are done records and they
/// are more than half of it.
pub const COMPACT_MIN_DONE_BYTES: u64 = 1024 * 1024;
/// The longest record kind.
pub const MAX_KIND_LEN: usize = 32;

const MARK_SUM_HEX_LEN: usize = 16;
const MARK_LINE_LEN: usize = ulid::ULID_LEN + 1 + MARK_SUM_HEX_LEN + 1;

/// Errors of a record log. Every message names the file and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The folder could not be created or synced.
    #[error(
        "cannot create the folder {path}: {source}; check that the state dir exists and is \
         writable by root"
    )]
    CreateDir {
        /// The folder.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A file could not be read, written or synced.
    #[error("cannot read or write {path}: {source}; check the state dir's disk and permissions")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// Another process has the log open.
    #[error(
        "{path} is locked by another felhom-agent process (is `felhom-agent run` already \
         running? see `systemctl status felhom-agent`); only one process may own it"
    )]
    Busy {
        /// The lock file.
        path: PathBuf,
    },
    /// A record before the last line is damaged.
    #[error(
        "{path} is corrupt at line {line}: {reason}; the agent will not guess what it held: \
         move the file aside (the records in it were not delivered) and start again"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A record was written by a newer agent.
    #[error(
        "{path} line {line} has format version {version}, which this agent (version \
         {FORMAT_VERSION}) does not understand; upgrade the agent"
    )]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The version found.
        version: u32,
    },
    /// A record cannot be stored as it is (too large, a body that is not one line, a bad
    /// kind). Nothing was written.
    #[error("record {id} cannot be stored in {path}: {reason}")]
    BadRecord {
        /// The record's id.
        id: Ulid,
        /// The record file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The record file would grow past its cap; nothing was written.
    #[error(
        "{path} would grow past its cap of {max} bytes ({pending} records are waiting): the \
         hub has not acknowledged them for a long time; check the hub connection with \
         `felhom-agent doctor`. Nothing was written"
    )]
    Full {
        /// The record file.
        path: PathBuf,
        /// The cap.
        max: u64,
        /// Records waiting.
        pending: usize,
    },
    /// The record file on disk is over its cap; it was not read.
    #[error("{path} is {size} bytes, over the cap of {max}; it was not read: inspect it by hand")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The cap.
        max: u64,
    },
}

impl StoreError {
    /// The stable code: the outbox is part of the node's environment (state dir, disk).
    pub fn code(&self) -> ErrorCode {
        ErrorCode::ConfigInvalid
    }
}

/// Caps on a record log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Cap on one record line (with its newline), in bytes.
    pub max_record_bytes: usize,
    /// Cap on the record file, in bytes.
    pub max_log_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_record_bytes: MAX_RECORD_BYTES,
            max_log_bytes: MAX_LOG_BYTES,
        }
    }
}

/// A pending record: where it is in the record file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// Its position in the order of appends (grows by one per record, survives compaction
    /// within one process; restarts at 1 when the log is opened).
    pub seq: u64,
    /// The record's id.
    pub id: Ulid,
    /// Its kind.
    pub kind: String,
    offset: u64,
    len: u32,
    sum_prefix: [u8; MARK_SUM_HEX_LEN],
}

/// A record to append.
#[derive(Debug, Clone, Copy)]
pub struct NewRecord<'a> {
    /// Its id.
    pub id: Ulid,
    /// Its kind: lowercase ASCII letters and `_`, at most [`MAX_KIND_LEN`].
    pub kind: &'a str,
    /// Its body: JSON on one line.
    pub body: &'a str,
}

/// What [`RecordLog::open`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// A torn last record was cut off.
    pub torn_tail: bool,
    /// Damaged marks that were ignored.
    pub damaged_marks: usize,
}

/// One durable record log in a folder. See the module docs.
#[derive(Debug)]
pub struct RecordLog {
    records: LogFile,
    marks_path: PathBuf,
    marks: File,
    _lock: Flock<File>,
    limits: Limits,
    /// Bytes of the record file held by done records.
    done_bytes: u64,
    /// Length of the marks file.
    marks_len: u64,
    pending: BTreeMap<u64, Slot>,
    by_id: HashMap<Ulid, u64>,
    next_seq: u64,
}

fn io_err(path: &Path) -> impl Fn(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl From<LogError> for StoreError {
    fn from(e: LogError) -> Self {
        // `append` checks the room itself and reports `Full` with the pending count.
        durable_log::owner_error!(StoreError, e,
            Full { path, max } => StoreError::Full { path, max, pending: 0 },
            TooLarge { path, size, max } => StoreError::TooLarge { path, size, max },
        )
    }
}

fn valid_kind(kind: &str) -> bool {
    !kind.is_empty()
        && kind.len() <= MAX_KIND_LEN
        && kind.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
}

/// The payload of a record: its id, kind and body.
fn encode_payload(rec: &NewRecord<'_>) -> String {
    format!(
        "{{\"id\":\"{}\",\"kind\":\"{}\",\"body\":{}}}",
        rec.id, rec.kind, rec.body
    )
}

/// Decode a payload into its id, kind and body.
fn decode_payload(payload: &str) -> Result<(Ulid, &str, &str), Reject> {
    let damaged = |what: &str| Reject::Damaged(format!("not an outbox record ({what})"));
    let rest = payload
        .strip_prefix("{\"id\":\"")
        .ok_or_else(|| damaged("no id"))?;
    if rest.len() < ulid::ULID_LEN || !rest.is_char_boundary(ulid::ULID_LEN) {
        return Err(damaged("short id"));
    }
    let (id, rest) = rest.split_at(ulid::ULID_LEN);
    let rest = rest
        .strip_prefix("\",\"kind\":\"")
        .ok_or_else(|| damaged("no kind"))?;
    let (kind, rest) = rest.split_once('"').ok_or_else(|| damaged("no kind"))?;
    let body = rest
        .strip_prefix(",\"body\":")
        .and_then(|r| r.strip_suffix('}'))
        .ok_or_else(|| damaged("no body"))?;
    let id = Ulid::from_string(id).map_err(|_| damaged("bad id"))?;
    Ok((id, kind, body))
}

fn sum_prefix(sum: &str) -> [u8; MARK_SUM_HEX_LEN] {
    let mut out = [b'0'; MARK_SUM_HEX_LEN];
    for (o, b) in out.iter_mut().zip(sum.bytes()) {
        *o = b;
    }
    out
}

fn mark_line(id: Ulid, prefix: &[u8; MARK_SUM_HEX_LEN]) -> String {
    format!("{id} {}\n", String::from_utf8_lossy(prefix))
}

fn decode_mark(line: &[u8]) -> Option<(Ulid, [u8; MARK_SUM_HEX_LEN])> {
    if line.len() != MARK_LINE_LEN - 1 || line.get(ulid::ULID_LEN) != Some(&b' ') {
        return None;
    }
    let id = std::str::from_utf8(&line[..ulid::ULID_LEN]).ok()?;
    let id = Ulid::from_string(id).ok()?;
    let hex = &line[ulid::ULID_LEN + 1..];
    if !hex.iter().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut prefix = [0u8; MARK_SUM_HEX_LEN];
    prefix.copy_from_slice(hex);
    Some((id, prefix))
}

fn open_file(path: &Path) -> Result<File, StoreError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        // Never through a link: a root run would write where a link of the agent's user
        // points.
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_err(path))
}

impl RecordLog {
    /// Open (or create) the log `name` in `dir` with the default limits.
    pub fn open(dir: &Path, name: &str) -> Result<(Self, OpenReport), StoreError> {
        Self::open_with_limits(dir, name, Limits::default())
    }

    /// Open (or create) the log `name` in `dir`: take the folder's lock, read the records and
    /// marks, cut off a torn last record.
    pub fn open_with_limits(
        dir: &Path,
        name: &str,
        limits: Limits,
    ) -> Result<(Self, OpenReport), StoreError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| StoreError::CreateDir {
                path: dir.to_path_buf(),
                source,
            })?;
        let lock_path = dir.join(format!("{name}.lock"));
        let lock_file = open_file(&lock_path)?;
        let lock =
            Flock::lock(lock_file, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| {
                match errno {
                    nix::errno::Errno::EWOULDBLOCK => StoreError::Busy {
                        path: lock_path.clone(),
                    },
                    other => StoreError::Io {
                        path: lock_path.clone(),
                        source: io::Error::from(other),
                    },
                }
            })?;
        let records_path = dir.join(format!("{name}.log"));
        let marks_path = dir.join(format!("{name}.done"));
        let existed = records_path.exists();
        let log_limits = durable_log::Limits {
            max_record_bytes: limits.max_record_bytes,
            max_file_bytes: limits.max_log_bytes,
        };
        let records =
            LogFile::open(&records_path, log_limits, OpenMode::Create)?.ok_or_else(|| {
                StoreError::Io {
                    path: records_path.clone(),
                    source: io::ErrorKind::NotFound.into(),
                }
            })?;
        let mut marks = open_file(&marks_path)?;
        if !existed {
            durable_log::sync_dir(dir).map_err(io_err(dir))?;
        }
        let mut log = RecordLog {
            records,
            marks_path,
            marks: marks.try_clone().map_err(io_err(dir))?,
            _lock: lock,
            limits,
            done_bytes: 0,
            marks_len: 0,
            pending: BTreeMap::new(),
            by_id: HashMap::new(),
            next_seq: 1,
        };
        let report = log.load(&mut marks)?;
        Ok((log, report))
    }

    fn load(&mut self, marks: &mut File) -> Result<OpenReport, StoreError> {
        let mut report = OpenReport::default();
        // The marks first: the set of finished records.
        let mut mark_bytes = Vec::new();
        marks
            .read_to_end(&mut mark_bytes)
            .map_err(io_err(&self.marks_path))?;
        let mut done: HashSet<(Ulid, [u8; MARK_SUM_HEX_LEN])> = HashSet::new();
        let mut marks_valid = 0usize;
        for chunk in mark_bytes.split_inclusive(|b| *b == b'\n') {
            let Some(line) = chunk.strip_suffix(b"\n") else {
                // A torn last mark: dropped below by truncating to the last full line.
                break;
            };
            marks_valid += chunk.len();
            match decode_mark(line) {
                Some(mark) => {
                    done.insert(mark);
                }
                None => report.damaged_marks += 1,
            }
        }
        if marks_valid < mark_bytes.len() {
            marks
                .set_len(marks_valid as u64)
                .map_err(io_err(&self.marks_path))?;
        }
        self.marks_len = marks_valid as u64;
        if report.damaged_marks > 0 {
            tracing::warn!(
                path = %self.marks_path.display(),
                "ignored {} damaged marks in {} (their records will be sent or settled again)",
                report.damaged_marks,
                self.marks_path.display()
            );
        }

        let contents = self
            .records
            .read(|payload| decode_payload(payload).map(|(id, kind, _)| (id, kind.to_string())))?;
        for entry in contents.entries {
            let (id, kind) = entry.value;
            let prefix = sum_prefix(&entry.sum);
            if done.contains(&(id, prefix)) || self.by_id.contains_key(&id) {
                // Finished, or a second copy of a pending record: not pending.
                self.done_bytes += u64::from(entry.len);
                continue;
            }
            self.insert_pending(id, kind, entry.offset, entry.len, prefix);
        }
        if let Some(torn) = contents.torn {
            report.torn_tail = true;
            tracing::warn!(
                path = %self.records.path().display(),
                "cutting off the torn last record (line {}) of {}: a write cut short by \
                 a crash, never acknowledged as stored",
                torn.line,
                self.records.path().display()
            );
            self.records.cut_tail()?;
        }
        Ok(report)
    }

    /// The record file.
    pub fn path(&self) -> &Path {
        self.records.path()
    }

    /// Records not yet done.
    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// The length of the record file in bytes.
    pub fn log_bytes(&self) -> u64 {
        self.records.len()
    }

    /// The pending records, in append order.
    pub fn pending(&self) -> impl Iterator<Item = &Slot> {
        self.pending.values()
    }

    /// The pending records appended after `seq`, in order.
    pub fn pending_after(&self, seq: u64) -> impl Iterator<Item = &Slot> {
        self.pending
            .range(seq.saturating_add(1)..)
            .map(|(_, slot)| slot)
    }

    /// The pending record with this id.
    pub fn get(&self, id: Ulid) -> Option<&Slot> {
        self.by_id.get(&id).and_then(|seq| self.pending.get(seq))
    }

    /// The seq of the last record appended (0 before any).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// Read a pending record's body back from the file, checking its checksum again.
    pub fn read_body(&self, slot: &Slot) -> Result<String, StoreError> {
        let payload = self.records.read_at(slot.offset, slot.len)?;
        let corrupt = |reason: String| StoreError::Corrupt {
            path: self.records.path().to_path_buf(),
            line: 0,
            reason,
        };
        match decode_payload(&payload) {
            Ok((id, _, body)) if id == slot.id => Ok(body.to_string()),
            Ok(_) => Err(corrupt(format!(
                "the record at byte {} is not {}",
                slot.offset, slot.id
            ))),
            Err(Reject::Damaged(reason) | Reject::Corrupt(reason)) => Err(corrupt(format!(
                "record {} at byte {}: {reason}",
                slot.id, slot.offset
            ))),
        }
    }

    /// Append records durably, in order, with one write and one `fdatasync`. A record whose id
    /// is already pending is skipped (its seq is returned). Either every new record is stored
    /// or none is.
    pub fn append(&mut self, batch: &[NewRecord<'_>]) -> Result<Vec<u64>, StoreError> {
        let mut buf = String::new();
        let mut staged: Vec<(Ulid, &str, u32, [u8; MARK_SUM_HEX_LEN])> = Vec::new();
        let mut seen_in_batch: HashMap<Ulid, usize> = HashMap::new();
        let mut result: Vec<Option<u64>> = Vec::with_capacity(batch.len());
        let mut refs: Vec<Option<usize>> = Vec::with_capacity(batch.len());
        for rec in batch {
            if let Some(seq) = self.by_id.get(&rec.id) {
                result.push(Some(*seq));
                refs.push(None);
                continue;
            }
            if let Some(i) = seen_in_batch.get(&rec.id) {
                result.push(None);
                refs.push(Some(*i));
                continue;
            }
            let bad = |reason: String| StoreError::BadRecord {
                id: rec.id,
                path: self.records.path().to_path_buf(),
                reason,
            };
            if !valid_kind(rec.kind) {
                return Err(bad(format!(
                    "kind {:?} is not lowercase letters and `_` (at most {MAX_KIND_LEN})",
                    rec.kind
                )));
            }
            if rec.body.contains('\n') || rec.body.is_empty() {
                return Err(bad("the body is not JSON on one line".to_string()));
            }
            let line = match self.log_limits().encode(&encode_payload(rec)) {
                Ok(line) => line,
                Err(EncodeError::NotOneLine) => {
                    return Err(bad("the body is not JSON on one line".to_string()))
                }
                Err(e @ EncodeError::TooLarge { .. }) => return Err(bad(e.to_string())),
            };
            let sum = durable_log::line_sum(&line);
            seen_in_batch.insert(rec.id, staged.len());
            refs.push(Some(staged.len()));
            result.push(None);
            staged.push((
                rec.id,
                rec.kind,
                u32::try_from(line.len()).unwrap_or(u32::MAX),
                sum_prefix(sum),
            ));
            buf.push_str(&line);
        }
        if staged.is_empty() {
            return Ok(result.into_iter().map(|s| s.unwrap_or(0)).collect());
        }
        let add = buf.len() as u64;
        if !self.records.fits(add) {
            self.compact()?;
            if !self.records.fits(add) {
                return Err(StoreError::Full {
                    path: self.records.path().to_path_buf(),
                    max: self.limits.max_log_bytes,
                    pending: self.pending.len(),
                });
            }
        }
        let mut offset = self.records.append(buf.as_bytes())?;
        let mut seqs = Vec::with_capacity(staged.len());
        for (id, kind, len, prefix) in staged {
            seqs.push(self.insert_pending(id, kind.to_string(), offset, len, prefix));
            offset += u64::from(len);
        }
        Ok(result
            .into_iter()
            .zip(refs)
            .map(|(known, staged_ref)| match (known, staged_ref) {
                (Some(seq), _) => seq,
                (None, Some(i)) => seqs.get(i).copied().unwrap_or(0),
                (None, None) => 0,
            })
            .collect())
    }

    /// Add a pending record under the next seq; returns the seq.
    fn insert_pending(
        &mut self,
        id: Ulid,
        kind: String,
        offset: u64,
        len: u32,
        sum_prefix: [u8; MARK_SUM_HEX_LEN],
    ) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.by_id.insert(id, seq);
        self.pending.insert(
            seq,
            Slot {
                seq,
                id,
                kind,
                offset,
                len,
                sum_prefix,
            },
        );
        seq
    }

    fn log_limits(&self) -> durable_log::Limits {
        durable_log::Limits {
            max_record_bytes: self.limits.max_record_bytes,
            max_file_bytes: self.limits.max_log_bytes,
        }
    }

    /// Mark records done (ids that are not pending are ignored) and compact when that frees
    /// enough. Returns how many were pending.
    pub fn mark_done(&mut self, ids: &[Ulid]) -> Result<usize, StoreError> {
        let mut lines = String::new();
        let mut count = 0;
        for id in ids {
            let Some(seq) = self.by_id.remove(id) else {
                continue;
            };
            let Some(slot) = self.pending.remove(&seq) else {
                continue;
            };
            lines.push_str(&mark_line(slot.id, &slot.sum_prefix));
            self.done_bytes += u64::from(slot.len);
            count += 1;
        }
        if count == 0 {
            return Ok(0);
        }
        if self.pending.is_empty() {
            // Everything is done: nothing to mark, the files are emptied.
            self.compact()?;
            return Ok(count);
        }
        self.marks
            .write_all_at(lines.as_bytes(), self.marks_len)
            .map_err(io_err(&self.marks_path))?;
        self.marks_len += lines.len() as u64;
        if self.done_bytes >= COMPACT_MIN_DONE_BYTES && self.done_bytes * 2 > self.records.len() {
            self.compact()?;
        }
        Ok(count)
    }

    /// Make the marks written so far durable (they are not synced as they are written: see the
    /// module docs), for a caller that must not count a record as gone before it is.
    pub fn sync_marks(&self) -> Result<(), StoreError> {
        self.marks.sync_data().map_err(io_err(&self.marks_path))
    }

    /// Drop the done records from the files: truncate both when nothing is pending, else
    /// rewrite the record file with only the pending records.
    pub fn compact(&mut self) -> Result<(), StoreError> {
        if self.pending.is_empty() {
            self.records.truncate()?;
            self.marks.set_len(0).map_err(io_err(&self.marks_path))?;
            self.marks_len = 0;
            self.done_bytes = 0;
            return Ok(());
        }
        if self.done_bytes == 0 {
            return Ok(());
        }
        let keep: Vec<(u64, u32)> = self.pending.values().map(|s| (s.offset, s.len)).collect();
        let new_offsets = self.records.rewrite(&keep)?;
        // The marks name only records that are no longer in the file.
        self.marks.set_len(0).map_err(io_err(&self.marks_path))?;
        for (slot, new_offset) in self.pending.values_mut().zip(new_offsets) {
            slot.offset = new_offset;
        }
        self.marks_len = 0;
        self.done_bytes = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> Ulid {
        Ulid::from_parts(1_767_225_600_000, n)
    }

    fn rec(n: u128, body: &str) -> (Ulid, String) {
        (id(n), body.to_string())
    }

    fn append_all(log: &mut RecordLog, items: &[(Ulid, String)]) -> Vec<u64> {
        let batch: Vec<NewRecord<'_>> = items
            .iter()
            .map(|(id, body)| NewRecord {
                id: *id,
                kind: "event",
                body,
            })
            .collect();
        log.append(&batch).expect("append")
    }

    fn pending_bodies(log: &RecordLog) -> Vec<String> {
        log.pending()
            .map(|s| log.read_body(s).expect("read"))
            .collect()
    }

    #[test]
    fn appends_survive_reopen_in_order() {
        let dir = tempfile::tempdir().expect("tmp");
        {
            let (mut log, report) = RecordLog::open(dir.path(), "outbox").expect("open");
            assert_eq!(report, OpenReport::default());
            let seqs = append_all(
                &mut log,
                &[
                    rec(1, "{\"a\":1}"),
                    rec(2, "{\"a\":2}"),
                    rec(3, "{\"a\":3}"),
                ],
            );
            assert_eq!(seqs, vec![1, 2, 3]);
            append_all(&mut log, &[rec(4, "{\"a\":4}")]);
        }
        let (log, report) = RecordLog::open(dir.path(), "outbox").expect("reopen");
        assert!(!report.torn_tail);
        assert_eq!(
            pending_bodies(&log),
            vec!["{\"a\":1}", "{\"a\":2}", "{\"a\":3}", "{\"a\":4}"]
        );
        let text = fs::read_to_string(dir.path().join("outbox.log")).expect("read");
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("each record is JSON");
            assert_eq!(v["v"], 1);
            assert_eq!(v["rec"]["kind"], "event");
        }
    }

    #[test]
    fn done_records_stay_done_after_reopen_and_everything_done_empties_the_files() {
        let dir = tempfile::tempdir().expect("tmp");
        {
            let (mut log, _) = RecordLog::open(dir.path(), "outbox").expect("open");
            append_all(&mut log, &[rec(1, "1"), rec(2, "2"), rec(3, "3")]);
            assert_eq!(log.mark_done(&[id(2), id(99)]).expect("done"), 1);
            assert_eq!(log.pending_count(), 2);
        }
        {
            let (mut log, _) = RecordLog::open(dir.path(), "outbox").expect("reopen");
            assert_eq!(pending_bodies(&log), vec!["1", "3"]);
            log.mark_done(&[id(1), id(3)]).expect("done");
            assert_eq!(log.pending_count(), 0);
            assert_eq!(log.log_bytes(), 0);
        }
        for name in ["outbox.log", "outbox.done"] {
            let meta = fs::metadata(dir.path().join(name)).expect("stat");
            assert_eq!(meta.len(), 0, "{name} was not emptied");
        }
        let (log, _) = RecordLog::open(dir.path(), "outbox").expect("reopen");
        assert_eq!(log.pending_count(), 0);
    }

    #[test]
    fn a_record_torn_mid_line_is_cut_off_and_the_rest_is_kept() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("outbox.log");
        {
            let (mut log, _) = RecordLog::open(dir.path(), "outbox").expect("open");
            append_all(&mut log, &[rec(1, "{\"n\":1}"), rec(2, "{\"n\":2}")]);
        }
        let full = fs::metadata(&path).expect("stat").len();
        // Simulate a crash in the middle of writing the second record.
        for cut in [full - 1, full - 10, full - 40] {
            let copy = tempfile::tempdir().expect("tmp");
            fs::copy(&path, copy.path().join("outbox.log")).expect("copy");
            let f = OpenOptions::new()
                .write(true)
                .open(copy.path().join("outbox.log"))
                .expect("open");
            f.set_len(cut).expect("truncate");
            let (mut log, report) = RecordLog::open(copy.path(), "outbox").expect("reopen");
            assert!(report.torn_tail, "cut at {cut}");
            assert_eq!(pending_bodies(&log), vec!["{\"n\":1}"], "cut at {cut}");
            // The next append goes right after the last whole record.
            append_all(&mut log, &[rec(3, "{\"n\":3}")]);
            drop(log);
            let (log, report) = RecordLog::open(copy.path(), "outbox").expect("reopen");
            assert!(!report.torn_tail);
            assert_eq!(pending_bodies(&log), vec!["{\"n\":1}", "{\"n\":3}"]);
        }
    }

    #[test]
    fn a_flipped_byte_in_the_last_record_is_a_torn_tail_but_earlier_is_corruption() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("outbox.log");
        {
            let (mut log, _) = RecordLog::open(dir.path(), "outbox").expect("open");
            append_all(&mut log, &[rec(1, "{\"n\":111}"), rec(2, "{\"n\":222}")]);
        }
        let original = fs::read(&path).expect("read");
        let mut last = original.clone();
        let at = last.len() - 5;
        last[at] = b'9';
        fs::write(&path, &last).expect("write");
        let (log, report) = RecordLog::open(dir.path(), "outbox").expect("open");
        assert!(report.torn_tail);
        assert_eq!(pending_bodies(&log), vec!["{\"n\":111}"]);
        drop(log);

        let mut first = original;
        let at = first.iter().position(|b| *b == b'\n').expect("newline") - 5;
        first[at] = b'9';
        fs::write(&path, &first).expect("write");
        let err = RecordLog::open(dir.path(), "outbox").unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { line: 1, .. }), "{err}");
        assert!(err.to_string().contains("outbox.log"), "{err}");
    }

    #[test]
    fn a_torn_mark_is_dropped_and_the_record_is_pending_again() {
        let dir = tempfile::tempdir().expect("tmp");
        {
            let (mut log, _) = RecordLog::open(dir.path(), "outbox").expect("open");
            append_all(&mut log, &[rec(1, "1"), rec(2, "2"), rec(3, "3")]);
            log.mark_done(&[id(1)]).expect("done");
            log.mark_done(&[id(2)]).expect("done");
        }
        let marks = dir.path().join("outbox.done");
        let len = fs::metadata(&marks).expect("stat").len();
        OpenOptions::new()
            .write(true)
            .open(&marks)
            .expect("open")
            .set_len(len - 3)
            .expect("truncate");
        let (log, _) = RecordLog::open(dir.path(), "outbox").expect("open");
        assert_eq!(pending_bodies(&log), vec!["2", "3"]);
    }

    #[test]
    fn the_size_cap_refuses_with_a_clear_error_and_writes_nothing() {
        let dir = tempfile::tempdir().expect("tmp");
        let limits = Limits {
            max_record_bytes: 512,
            max_log_bytes: 1000,
        };
        let (mut log, _) = RecordLog::open_with_limits(dir.path(), "outbox", limits).expect("open");
        let body = format!("\"{}\"", "x".repeat(200));
        let mut n = 0;
        let err = loop {
            n += 1;
            assert!(n < 100, "the cap never refused");
            match log.append(&[NewRecord {
                id: id(n),
                kind: "event",
                body: &body,
            }]) {
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert!(matches!(err, StoreError::Full { max: 1000, .. }), "{err}");
        assert!(err.to_string().contains("acknowledged"), "{err}");
        let before = log.log_bytes();
        assert_eq!(fs::metadata(log.path()).expect("stat").len(), before);
        // Acknowledging frees room again (the file is compacted).
        let ids: Vec<Ulid> = log.pending().map(|s| s.id).collect();
        log.mark_done(&ids[..1]).expect("done");
        log.compact().expect("compact");
        assert!(log
            .append(&[NewRecord {
                id: id(500),
                kind: "event",
                body: &body
            }])
            .is_ok());

        let huge = format!("\"{}\"", "y".repeat(600));
        let err = log
            .append(&[NewRecord {
                id: id(501),
                kind: "event",
                body: &huge,
            }])
            .unwrap_err();
        assert!(matches!(err, StoreError::BadRecord { .. }), "{err}");
    }

    #[test]
    fn compaction_rewrites_and_keeps_order_across_reopen() {
        let dir = tempfile::tempdir().expect("tmp");
        let body = format!("\"{}\"", "z".repeat(1000));
        {
            let (mut log, _) = RecordLog::open(dir.path(), "outbox").expect("open");
            let items: Vec<(Ulid, String)> = (1..=3000).map(|n| (id(n), body.clone())).collect();
            for chunk in items.chunks(100) {
                append_all(&mut log, chunk);
            }
            let before = log.log_bytes();
            // Everything but the last 10 is done: the file is rewritten.
            let done: Vec<Ulid> = (1..=2990).map(id).collect();
            log.mark_done(&done).expect("done");
            assert!(log.log_bytes() < before / 100, "not compacted");
            assert_eq!(
                fs::metadata(dir.path().join("outbox.done"))
                    .expect("stat")
                    .len(),
                0
            );
            assert_eq!(log.pending().count(), 10);
            let after: Vec<u64> = log.pending_after(2995).map(|s| s.seq).collect();
            assert_eq!(after, vec![2996, 2997, 2998, 2999, 3000]);
            log.mark_done(&[id(2991)]).expect("done");
        }
        let (log, _) = RecordLog::open(dir.path(), "outbox").expect("reopen");
        let ids: Vec<Ulid> = log.pending().map(|s| s.id).collect();
        assert_eq!(ids, (2992..=3000).map(id).collect::<Vec<_>>());
        assert!(pending_bodies(&log).iter().all(|b| *b == body));
    }

    #[test]
    fn duplicate_ids_are_stored_once() {
        let dir = tempfile::tempdir().expect("tmp");
        let (mut log, _) = RecordLog::open(dir.path(), "outbox").expect("open");
        let a = append_all(&mut log, &[rec(1, "1"), rec(1, "1"), rec(2, "2")]);
        assert_eq!(a, vec![1, 1, 2]);
        let b = append_all(&mut log, &[rec(2, "2")]);
        assert_eq!(b, vec![2]);
        assert_eq!(log.pending_count(), 2);
    }

    #[test]
    fn a_second_owner_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let (_log, _) = RecordLog::open(dir.path(), "outbox").expect("open");
        let err = RecordLog::open(dir.path(), "outbox").unwrap_err();
        assert!(matches!(err, StoreError::Busy { .. }), "{err}");
    }

    #[test]
    fn bad_records_are_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().expect("tmp");
        let (mut log, _) = RecordLog::open(dir.path(), "outbox").expect("open");
        for (kind, body) in [("Event", "1"), ("event", "{\n}"), ("event", ""), ("", "1")] {
            let err = log
                .append(&[
                    NewRecord {
                        id: id(1),
                        kind: "event",
                        body: "1",
                    },
                    NewRecord {
                        id: id(2),
                        kind,
                        body,
                    },
                ])
                .unwrap_err();
            assert!(matches!(err, StoreError::BadRecord { .. }), "{err}");
        }
        assert_eq!(log.log_bytes(), 0);
        assert_eq!(log.pending_count(), 0);
    }
}
