//! The write-ahead journal of provision transactions, on disk in the state dir.
//!
//! One append-only file per transaction, `<state_dir>/journal/<txn>.log`, one record per line:
//!
//! ```text
//! {"v":1,"sha256":"<hex of the rec bytes>","rec":{"seq":0,"at":"2026-…Z","state":{…}}}
//! ```
//!
//! Every record holds the whole [`State`] after a transition; the executor writes it before the
//! PVE write that the transition asks for (intent) and after each outcome. Each append is
//! fsynced, and the directory is fsynced when a file is created. Records are versioned,
//! checksummed and size-capped (per record and per file); a write over a cap is refused.
//!
//! Replay reads every file: a torn last line (a partial write from a crash: no newline, or a
//! checksum that does not match) is ignored with a warning and cut off by the next append;
//! anything wrong before the last line is corruption, reported with the file and line, and the
//! journal is not guessed at.
//!
//! This module never decides anything about a transaction; it only stores and returns states.
//! It takes no lock: a transaction's file is written only by the process holding its vmid's
//! lock ([`super::lock`]).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use ulid::Ulid;

use super::machine::{OutcomeKind, Phase, State, Step, TxnKind};
use crate::error::{ErrorCode, Failure};
use crate::timefmt::now_rfc3339;

/// The record format version this agent writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Default cap on one encoded record line, in bytes.
pub const MAX_RECORD_BYTES: usize = 64 * 1024;
/// Default cap on one transaction's journal file, in bytes.
pub const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// The journal's folder inside the state dir.
pub const JOURNAL_DIR: &str = "journal";

const FILE_EXT: &str = "log";
const HASH_HEX_LEN: usize = 64;

/// Errors of the journal. Every message names the transaction or file and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The journal folder could not be created or synced.
    #[error(
        "cannot create the journal folder {path}: {source}; check that the state dir exists and \
         is writable by root"
    )]
    CreateDir {
        /// The folder.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A journal file could not be read, written or synced.
    #[error(
        "cannot read or write journal file {path}: {source}; check the state dir's disk and \
         permissions"
    )]
    Io {
        /// The file (or folder).
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A record before the last line is damaged (or the records do not follow each other).
    #[error(
        "journal file {path} is corrupt at line {line}: {reason}; the agent will not guess the \
         transaction's state: check the guest by hand, then move the file aside"
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
        "journal file {path} line {line} has format version {version}, which this agent \
         (version {FORMAT_VERSION}) does not understand; upgrade the agent"
    )]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The version found.
        version: u32,
    },
    /// A record is over the per-record cap; it was not written.
    #[error(
        "journal record {seq} of transaction {txn} is {size} bytes, over the cap of {max}; it \
         was not written and the transaction must not go on"
    )]
    RecordTooLarge {
        /// The transaction.
        txn: Ulid,
        /// The record's sequence number.
        seq: u64,
        /// Its encoded size.
        size: usize,
        /// The cap.
        max: usize,
    },
    /// The file would grow over the per-file cap; the record was not written.
    #[error(
        "journal file {path} of transaction {txn} would grow past the cap of {max} bytes; the \
         record was not written: settle the transaction by hand"
    )]
    FileFull {
        /// The transaction.
        txn: Ulid,
        /// The file.
        path: PathBuf,
        /// The cap.
        max: u64,
    },
    /// A file on disk is over the per-file cap; it is not read.
    #[error(
        "journal file {path} is {size} bytes, over the cap of {max}; it was not read: inspect \
         it by hand"
    )]
    FileTooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The cap.
        max: u64,
    },
    /// `begin` for a transaction that already has records.
    #[error(
        "transaction {txn} already has journal file {path}; a re-dispatch must return its state \
         instead of starting it again"
    )]
    AlreadyExists {
        /// The transaction.
        txn: Ulid,
        /// Its file.
        path: PathBuf,
    },
    /// `append` for a transaction that was never begun.
    #[error("transaction {txn} has no journal file under {dir}; begin it before appending")]
    NotFound {
        /// The transaction.
        txn: Ulid,
        /// The journal folder.
        dir: PathBuf,
    },
    /// A record could not be encoded.
    #[error("cannot encode journal record of transaction {txn}: {source}")]
    Encode {
        /// The transaction.
        txn: Ulid,
        /// The cause.
        source: serde_json::Error,
    },
}

impl JournalError {
    /// The stable code: the journal is part of the node's environment (state dir, disk).
    pub fn code(&self) -> ErrorCode {
        ErrorCode::ConfigInvalid
    }
}

/// Caps on what the journal writes and reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Cap on one encoded record line (with its newline), in bytes.
    pub max_record_bytes: usize,
    /// Cap on one transaction's file, in bytes.
    pub max_file_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_record_bytes: MAX_RECORD_BYTES,
            max_file_bytes: MAX_FILE_BYTES,
        }
    }
}

/// One record: the state after a transition, numbered and timestamped.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    seq: u64,
    at: String,
    state: State,
}

/// The last journaled state of one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnState {
    /// The state of the last valid record.
    pub state: State,
    /// When the first record was written (UTC, RFC 3339).
    pub started_at: String,
    /// When the last valid record was written (UTC, RFC 3339).
    pub updated_at: String,
    /// How many valid records the file holds.
    pub records: u64,
    /// Whether a torn last line was found (and ignored) when the file was read.
    pub torn_tail: bool,
    /// The file.
    pub path: PathBuf,
}

/// One row of `felhom-agent journal`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JournalRow {
    /// Transaction id.
    pub txn: Ulid,
    /// What started it.
    pub kind: TxnKind,
    /// Its vmid.
    pub vmid: Option<u32>,
    /// Current phase.
    pub phase: Phase,
    /// What it waits for (`done` once settled).
    pub step: Step,
    /// Whether destroy is armed.
    pub destroy_armed: bool,
    /// Whether the guest is confirmed destroyed.
    pub destroyed: bool,
    /// The UPID of its restore task, once recorded.
    pub upid: Option<String>,
    /// First record (UTC, RFC 3339).
    pub started_at: String,
    /// Last record (UTC, RFC 3339).
    pub updated_at: String,
    /// The outcome once settled, null while open.
    pub outcome: Option<OutcomeKind>,
    /// The error, if any.
    pub error: Option<Failure>,
}

impl From<&TxnState> for JournalRow {
    fn from(t: &TxnState) -> Self {
        let s = &t.state;
        JournalRow {
            txn: s.txn(),
            kind: s.kind(),
            vmid: s.vmid(),
            phase: s.phase(),
            step: s.step(),
            destroy_armed: s.destroy_armed(),
            destroyed: s.destroyed(),
            upid: s.upid().map(str::to_string),
            started_at: t.started_at.clone(),
            updated_at: t.updated_at.clone(),
            outcome: s.outcome_kind(),
            error: s.failure().cloned(),
        }
    }
}

/// The journal folder of one state dir.
#[derive(Debug, Clone)]
pub struct Journal {
    dir: PathBuf,
    limits: Limits,
}

/// What reading one file found.
struct FileRead {
    first_at: Option<String>,
    last: Option<Record>,
    records: u64,
    valid_len: u64,
    torn: bool,
}

enum LineError {
    /// Not a journal line, or its checksum does not match.
    Damaged(String),
    /// A version this agent does not know.
    Version(u32),
}

impl Journal {
    /// Open (creating it if needed) `<state_dir>/journal` with the default caps.
    pub fn open(state_dir: &Path) -> Result<Journal, JournalError> {
        Self::open_with_limits(state_dir, Limits::default())
    }

    /// Open with explicit caps.
    pub fn open_with_limits(state_dir: &Path, limits: Limits) -> Result<Journal, JournalError> {
        let dir = state_dir.join(JOURNAL_DIR);
        if !dir.is_dir() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(|source| JournalError::CreateDir {
                    path: dir.clone(),
                    source,
                })?;
            sync_dir(state_dir).map_err(|source| JournalError::CreateDir {
                path: state_dir.to_path_buf(),
                source,
            })?;
        }
        Ok(Journal { dir, limits })
    }

    /// The journal folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of transaction `txn`.
    pub fn path_of(&self, txn: Ulid) -> PathBuf {
        self.dir.join(format!("{txn}.{FILE_EXT}"))
    }

    /// Start the journal of a new transaction with its first state. Refused if the transaction
    /// already has records (a re-dispatch must use [`Journal::get`]).
    pub fn begin(&self, state: &State) -> Result<TxnState, JournalError> {
        let txn = state.txn();
        let path = self.path_of(txn);
        // Encode and check the caps before the file exists: a refused record leaves nothing.
        let line = self.encode(state, 0)?;
        self.check_file_cap(txn, &path, line.len() as u64)?;
        let created = match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(file) => Some(file),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => None,
            Err(source) => return Err(JournalError::Io { path, source }),
        };
        let (mut file, fresh) = match created {
            Some(file) => (file, true),
            None => {
                // A file whose first record was torn by a crash holds nothing: reuse it.
                let mut file = open_rw(&path)?;
                let read = self.read_file(&mut file, &path, txn)?;
                if read.records > 0 {
                    return Err(JournalError::AlreadyExists { txn, path });
                }
                (file, false)
            }
        };
        let io = |source| JournalError::Io {
            path: path.clone(),
            source,
        };
        file.set_len(0).map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&line).map_err(io)?;
        file.sync_all().map_err(io)?;
        if fresh {
            sync_dir(&self.dir).map_err(|source| JournalError::Io {
                path: self.dir.clone(),
                source,
            })?;
        }
        let record = decode_line(&line).map_err(|_| JournalError::Corrupt {
            path: path.clone(),
            line: 1,
            reason: "the record just written does not read back".to_string(),
        })?;
        Ok(TxnState {
            state: record.state,
            started_at: record.at.clone(),
            updated_at: record.at,
            records: 1,
            torn_tail: false,
            path,
        })
    }

    /// Append the next state of a begun transaction (fsynced before returning). A torn last
    /// line left by a crash is cut off first.
    pub fn append(&self, state: &State) -> Result<TxnState, JournalError> {
        let txn = state.txn();
        let path = self.path_of(txn);
        let mut file = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(JournalError::NotFound {
                    txn,
                    dir: self.dir.clone(),
                })
            }
            Err(source) => return Err(JournalError::Io { path, source }),
        };
        let read = self.read_file(&mut file, &path, txn)?;
        let Some(first_at) = read.first_at else {
            return Err(JournalError::NotFound {
                txn,
                dir: self.dir.clone(),
            });
        };
        let line = self.encode(state, read.records)?;
        self.check_file_cap(txn, &path, read.valid_len + line.len() as u64)?;
        let io = |source| JournalError::Io {
            path: path.clone(),
            source,
        };
        if read.torn {
            tracing::warn!(
                path = %path.display(),
                "cutting off the torn last line of journal file {} before appending",
                path.display()
            );
            file.set_len(read.valid_len).map_err(io)?;
        }
        file.seek(SeekFrom::Start(read.valid_len)).map_err(io)?;
        file.write_all(&line).map_err(io)?;
        file.sync_all().map_err(io)?;
        let record = decode_line(&line).map_err(|_| JournalError::Corrupt {
            path: path.clone(),
            line: (read.records + 1) as usize,
            reason: "the record just written does not read back".to_string(),
        })?;
        Ok(TxnState {
            state: record.state,
            started_at: first_at,
            updated_at: record.at,
            records: read.records + 1,
            torn_tail: false,
            path,
        })
    }

    /// Journal a state: [`Journal::begin`] for a transaction without records, else
    /// [`Journal::append`]. This is what the executor does for [`super::Effect::Journal`].
    pub fn record(&self, state: &State) -> Result<TxnState, JournalError> {
        match self.get(state.txn())? {
            Some(_) => self.append(state),
            None => self.begin(state),
        }
    }

    /// The last state of transaction `txn`, if it has a journal (a re-dispatch with the same id
    /// returns this instead of running again).
    pub fn get(&self, txn: Ulid) -> Result<Option<TxnState>, JournalError> {
        let path = self.path_of(txn);
        let mut file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(JournalError::Io { path, source }),
        };
        let read = self.read_file(&mut file, &path, txn)?;
        Ok(to_txn_state(read, path))
    }

    /// Every transaction's last state, oldest first (ULID order). Fails on the first corrupt
    /// file; torn last lines are ignored with a warning.
    pub fn replay(&self) -> Result<Vec<TxnState>, JournalError> {
        let entries = fs::read_dir(&self.dir).map_err(|source| JournalError::Io {
            path: self.dir.clone(),
            source,
        })?;
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| JournalError::Io {
                path: self.dir.clone(),
                source,
            })?;
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some(FILE_EXT) {
                continue;
            }
            let Some(txn) = path
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| Ulid::from_string(s).ok())
            else {
                tracing::warn!(
                    path = %path.display(),
                    "ignoring {}: its name is not a transaction id",
                    path.display()
                );
                continue;
            };
            let mut file = File::open(&path).map_err(|source| JournalError::Io {
                path: path.clone(),
                source,
            })?;
            let read = self.read_file(&mut file, &path, txn)?;
            if let Some(t) = to_txn_state(read, path) {
                out.push(t);
            }
        }
        out.sort_by_key(|t| t.state.txn());
        Ok(out)
    }

    /// The transactions that are not settled (a crashed run's, or a live one's: check the
    /// vmid lock before settling one).
    pub fn open_transactions(&self) -> Result<Vec<TxnState>, JournalError> {
        Ok(self
            .replay()?
            .into_iter()
            .filter(|t| !t.state.is_terminal())
            .collect())
    }

    /// The rows of `felhom-agent journal`, oldest first.
    pub fn list(&self) -> Result<Vec<JournalRow>, JournalError> {
        Ok(self.replay()?.iter().map(JournalRow::from).collect())
    }

    /// The latest transaction on `vmid` that recorded a UPID of its own: the one whose proof a
    /// gated destroy of that vmid must rest on (see [`State::for_destroy`]).
    pub fn last_owner_record(&self, vmid: u32) -> Result<Option<TxnState>, JournalError> {
        Ok(self
            .replay()?
            .into_iter()
            .filter(|t| t.state.vmid() == Some(vmid) && t.state.upid().is_some())
            .max_by_key(|t| t.state.txn()))
    }

    fn encode(&self, state: &State, seq: u64) -> Result<Vec<u8>, JournalError> {
        let txn = state.txn();
        let record = Record {
            seq,
            at: now_rfc3339(),
            state: state.clone(),
        };
        let rec = serde_json::to_string(&record)
            .map_err(|source| JournalError::Encode { txn, source })?;
        let line = format!(
            "{{\"v\":{FORMAT_VERSION},\"sha256\":\"{}\",\"rec\":{rec}}}\n",
            sha256_hex(rec.as_bytes())
        );
        if line.len() > self.limits.max_record_bytes {
            return Err(JournalError::RecordTooLarge {
                txn,
                seq,
                size: line.len(),
                max: self.limits.max_record_bytes,
            });
        }
        Ok(line.into_bytes())
    }

    fn check_file_cap(&self, txn: Ulid, path: &Path, new_len: u64) -> Result<(), JournalError> {
        if new_len > self.limits.max_file_bytes {
            return Err(JournalError::FileFull {
                txn,
                path: path.to_path_buf(),
                max: self.limits.max_file_bytes,
            });
        }
        Ok(())
    }

    fn read_file(&self, file: &mut File, path: &Path, txn: Ulid) -> Result<FileRead, JournalError> {
        let io = |source| JournalError::Io {
            path: path.to_path_buf(),
            source,
        };
        let size = file.metadata().map_err(io)?.len();
        if size > self.limits.max_file_bytes {
            return Err(JournalError::FileTooLarge {
                path: path.to_path_buf(),
                size,
                max: self.limits.max_file_bytes,
            });
        }
        let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.read_to_end(&mut bytes).map_err(io)?;
        parse_file(&bytes, path, txn)
    }
}

fn to_txn_state(read: FileRead, path: PathBuf) -> Option<TxnState> {
    match (read.first_at, read.last) {
        (Some(started_at), Some(last)) => Some(TxnState {
            state: last.state,
            started_at,
            updated_at: last.at,
            records: read.records,
            torn_tail: read.torn,
            path,
        }),
        _ => {
            tracing::warn!(
                path = %path.display(),
                "journal file {} holds no complete record (a crash while it was created); ignored",
                path.display()
            );
            None
        }
    }
}

/// Parse a whole file: every line but the last must be valid and follow the one before.
fn parse_file(bytes: &[u8], path: &Path, txn: Ulid) -> Result<FileRead, JournalError> {
    let mut read = FileRead {
        first_at: None,
        last: None,
        records: 0,
        valid_len: 0,
        torn: false,
    };
    let mut offset = 0usize;
    let mut line_no = 0usize;
    while offset < bytes.len() {
        line_no += 1;
        let rest = &bytes[offset..];
        let (line, complete) = match rest.iter().position(|b| *b == b'\n') {
            Some(i) => (&rest[..i], true),
            None => (rest, false),
        };
        let next = offset + line.len() + usize::from(complete);
        let is_last = next >= bytes.len();
        let corrupt = |reason: String| JournalError::Corrupt {
            path: path.to_path_buf(),
            line: line_no,
            reason,
        };
        if !complete {
            // Only the very last line can lack its newline: a torn write.
            tracing::warn!(
                path = %path.display(),
                line = line_no,
                "ignoring the torn last line {line_no} of journal file {} (no newline: a write \
                 cut short by a crash)",
                path.display()
            );
            read.torn = true;
            break;
        }
        let record = match decode_line(line) {
            Ok(record) => record,
            Err(LineError::Version(version)) => {
                return Err(JournalError::UnsupportedVersion {
                    path: path.to_path_buf(),
                    line: line_no,
                    version,
                })
            }
            Err(LineError::Damaged(reason)) if is_last => {
                tracing::warn!(
                    path = %path.display(),
                    line = line_no,
                    "ignoring the torn last line {line_no} of journal file {}: {reason}",
                    path.display()
                );
                read.torn = true;
                break;
            }
            Err(LineError::Damaged(reason)) => return Err(corrupt(reason)),
        };
        if record.seq != read.records {
            return Err(corrupt(format!(
                "record number {} where {} was expected",
                record.seq, read.records
            )));
        }
        if record.state.txn() != txn {
            return Err(corrupt(format!(
                "a record of transaction {} in the file of transaction {txn}",
                record.state.txn()
            )));
        }
        if read.first_at.is_none() {
            read.first_at = Some(record.at.clone());
        }
        read.records += 1;
        read.last = Some(record);
        read.valid_len = next as u64;
        offset = next;
    }
    Ok(read)
}

/// Decode one line (without its newline): version, checksum, then the record.
fn decode_line(line: &[u8]) -> Result<Record, LineError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let text =
        std::str::from_utf8(line).map_err(|_| LineError::Damaged("not UTF-8 text".to_string()))?;
    let damaged = |what: &str| LineError::Damaged(format!("not a journal record ({what})"));
    let rest = text
        .strip_prefix("{\"v\":")
        .ok_or_else(|| damaged("no version"))?;
    let (version, rest) = rest.split_once(',').ok_or_else(|| damaged("no version"))?;
    let version: u32 = version.parse().map_err(|_| damaged("bad version"))?;
    if version != FORMAT_VERSION {
        return Err(LineError::Version(version));
    }
    let rest = rest
        .strip_prefix("\"sha256\":\"")
        .ok_or_else(|| damaged("no checksum"))?;
    if rest.len() < HASH_HEX_LEN || !rest.is_char_boundary(HASH_HEX_LEN) {
        return Err(damaged("short checksum"));
    }
    let (hash, rest) = rest.split_at(HASH_HEX_LEN);
    let rec = rest
        .strip_prefix("\",\"rec\":")
        .and_then(|r| r.strip_suffix('}'))
        .ok_or_else(|| damaged("no record"))?;
    if sha256_hex(rec.as_bytes()) != hash {
        return Err(LineError::Damaged("checksum mismatch".to_string()));
    }
    serde_json::from_str(rec)
        .map_err(|e| LineError::Damaged(format!("record does not decode: {e}")))
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn open_rw(path: &Path) -> Result<File, JournalError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| JournalError::Io {
            path: path.to_path_buf(),
            source,
        })
}

/// fsync a folder, so a file created in it survives a crash.
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests;
