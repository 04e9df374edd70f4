//! The write-ahead journal of provision transactions, on disk in the state dir.
//!
//! One append-only file per transaction, `<state_dir>/journal/<txn>.log`, one record per line:
//!
//! ```text
//! {"v":1,"sum":"<hex of the rec bytes>","rec":{"seq":0,"at":"2026-…Z","state":{…}}}
//! ```
//!
//! Each file is a [`crate::durable_log`] file (that module owns the line format, the
//! checksums, the caps and the fsyncs); this module owns what a record means: the `rec` payload
//! `{"seq":…,"at":…,"state":…}`, numbered from 0, every record of one transaction.
//!
//! Every record holds the whole [`State`] after a transition; the executor writes it before the
//! PVE write that the transition asks for (intent) and after each outcome. Each append is
//! fsynced, and the directory is fsynced when a file is created. Records are versioned,
//! checksummed and size-capped (per record and per file); a write over a cap is refused.
//!
//! Replay reads every file: a torn last line (a partial write from a crash: no newline, or a
//! checksum that does not match) is ignored with a warning and cut off by the next append;
//! anything wrong before the last line (or a record out of sequence, or of another
//! transaction) is corruption, reported with the file and line, and the journal is not guessed
//! at.
//!
//! This module never decides anything about a transaction; it only stores and returns states.
//! It takes no lock: a transaction's file is written only by the process holding its vmid's
//! lock ([`super::lock`]). It may use `crate::durable_log`, `crate::error`, `crate::timefmt`
//! and the machine's types ([`super::machine`]).

use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use ulid::Ulid;

use super::machine::{OutcomeKind, Phase, Resolution, State, Step, TxnKind};
use crate::durable_log::{self, sync_dir, EncodeError, LogError, LogFile, OpenMode, Reject};
use crate::error::{ErrorCode, Failure};
use crate::timefmt::rfc3339;

/// The record format version this agent writes and reads.
pub const FORMAT_VERSION: u32 = durable_log::FORMAT_VERSION;
/// Default cap on one encoded record line, in bytes.
pub const MAX_RECORD_BYTES: usize = 64 * 1024;
/// Default cap on one transaction's journal file, in bytes.
pub const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// The journal's folder inside the state dir.
pub const JOURNAL_DIR: &str = "journal";

const FILE_EXT: &str = "log";

/// The name of transaction `txn`'s file in the journal folder.
pub fn file_name(txn: Ulid) -> String {
    format!("{txn}.{FILE_EXT}")
}

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
    /// The stable code: the journal is part of the node's environment (state dir, disk); a
    /// full disk (ENOSPC, EDQUOT) is `state_dir_full`, not a configuration error.
    pub fn code(&self) -> ErrorCode {
        let source = match self {
            JournalError::CreateDir { source, .. } | JournalError::Io { source, .. } => {
                Some(source)
            }
            _ => None,
        };
        match source.and_then(io::Error::raw_os_error) {
            Some(nix::libc::ENOSPC | nix::libc::EDQUOT) => ErrorCode::StateDirFull,
            _ => ErrorCode::ConfigInvalid,
        }
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

/// One record: the state after a transition, numbered and timestamped. The first record of a
/// new phase also says how long the phase before it lasted.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    seq: u64,
    at: String,
    state: State,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    phase_done: Option<PhaseDone>,
}

/// How long one phase lasted: from the first record in that phase to the first record of the
/// next one (journaled in that next record).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PhaseDone {
    /// The phase that ended.
    pub phase: Phase,
    /// How long it lasted, in seconds (clock time between the two records).
    pub seconds: f64,
}

/// The phase timings of one transaction, for `journal --stats` and the metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct TxnTimings {
    /// Transaction id.
    pub txn: Ulid,
    /// What started it.
    pub kind: TxnKind,
    /// First record (UTC, RFC 3339).
    pub started_at: String,
    /// The outcome once settled, `None` while open.
    pub outcome: Option<OutcomeKind>,
    /// Whether it is settled `needs_human` and not closed, or open and waiting for a person.
    pub needs_human: bool,
    /// Each phase that ended, in order, with its duration.
    pub phases: Vec<PhaseDone>,
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
    /// Why destroy was withdrawn (the guest was seen gone or without its proof), if it was.
    pub disarmed: Option<String>,
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
    /// How a `needs_human` outcome was closed (who, why, when), if it was.
    pub resolution: Option<Resolution>,
    /// Open, and no live process runs it: a stopped run's, waiting to be resumed.
    pub interrupted: bool,
    /// For an interrupted transaction, the command that resumes it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resume: Option<String>,
    /// For a restore test: the guest whose backup it proves.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guest: Option<u32>,
    /// For a restore test: the backup it proves.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backup: Option<String>,
}

impl JournalRow {
    /// Mark this row `interrupted` when it is open and no live process holds its vmid's lock
    /// for it (see [`crate::provision::lock::running_holder`]).
    pub fn note_interrupted(&mut self, state_dir: &Path) {
        if self.outcome.is_some() {
            return;
        }
        let running = self
            .vmid
            .and_then(|v| super::lock::running_holder(state_dir, v, self.txn))
            .is_some();
        if !running {
            self.interrupted = true;
            self.resume = Some(format!("felhom-agent journal resume {}", self.txn));
        }
    }
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
            disarmed: s.disarmed().map(str::to_string),
            destroyed: s.destroyed(),
            upid: s.upid().map(str::to_string),
            started_at: t.started_at.clone(),
            updated_at: t.updated_at.clone(),
            outcome: s.outcome_kind(),
            error: s.failure().cloned(),
            resolution: s.resolution().cloned(),
            interrupted: false,
            resume: None,
            guest: (s.kind() == TxnKind::SelftestRestore)
                .then(|| crate::pve::types::backup_guest(&s.request().volid))
                .flatten(),
            backup: (s.kind() == TxnKind::SelftestRestore).then(|| s.request().volid.clone()),
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
    /// When the last record's phase began (the first record in that phase).
    phase_since: Option<String>,
    /// Every phase duration the records hold, in order.
    phases: Vec<PhaseDone>,
    records: u64,
    torn: bool,
}

impl Journal {
    /// Open (creating it if needed) `<state_dir>/journal` with the default caps.
    pub fn open(state_dir: &Path) -> Result<Journal, JournalError> {
        Self::open_with_limits(state_dir, Limits::default())
    }

    /// The journal under `state_dir` for reading only (a dry run): nothing is created; a
    /// folder that does not exist reads as an empty journal.
    pub fn at_read_only(state_dir: &Path) -> Journal {
        Journal {
            dir: state_dir.join(JOURNAL_DIR),
            limits: Limits::default(),
        }
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
        self.dir.join(file_name(txn))
    }

    /// Start the journal of a new transaction with its first state. Refused if the transaction
    /// already has records (a re-dispatch must use [`Journal::get`]).
    pub fn begin(&self, state: &State) -> Result<TxnState, JournalError> {
        let txn = state.txn();
        let path = self.path_of(txn);
        // Encode and check the caps before the file exists: a refused record leaves nothing.
        let line = self.encode(state, 0, None)?;
        if line.len() as u64 > self.limits.max_file_bytes {
            return Err(self.file_full(txn, &path));
        }
        let (mut log, fresh) = match self.open_log(&path, OpenMode::CreateNew)? {
            Some(log) => (log, true),
            None => {
                // A file whose first record was torn by a crash holds nothing: reuse it.
                let mut log = self.open_existing(txn, &path, OpenMode::Write)?;
                if self.read_file(&mut log, txn)?.records > 0 {
                    return Err(JournalError::AlreadyExists { txn, path });
                }
                (log, false)
            }
        };
        log.append(line.as_bytes()).map_err(log_error(txn))?;
        if fresh {
            sync_dir(&self.dir).map_err(|source| JournalError::Io {
                path: self.dir.clone(),
                source,
            })?;
        }
        let record = read_back(&line, &path, 1)?;
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
        let not_found = || JournalError::NotFound {
            txn,
            dir: self.dir.clone(),
        };
        let mut log = self
            .open_log(&path, OpenMode::Write)?
            .ok_or_else(not_found)?;
        let read = self.read_file(&mut log, txn)?;
        let first_at = read.first_at.ok_or_else(not_found)?;
        let now = time::OffsetDateTime::now_utc();
        let phase_done = match (&read.last, &read.phase_since) {
            (Some(last), Some(since)) if last.state.phase() != state.phase() => Some(PhaseDone {
                phase: last.state.phase(),
                seconds: seconds_since(since, now),
            }),
            _ => None,
        };
        let line = self.encode_reduced_if_needed(state, read.records, phase_done, now)?;
        if !log.fits(line.len() as u64) {
            return Err(self.file_full(txn, &path));
        }
        if read.torn {
            tracing::warn!(
                path = %path.display(),
                "cutting off the torn last line of journal file {} before appending",
                path.display()
            );
        }
        log.append(line.as_bytes()).map_err(log_error(txn))?;
        let record = read_back(&line, &path, (read.records + 1) as usize)?;
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
        let Some(mut log) = self.open_log(&path, OpenMode::Read)? else {
            return Ok(None);
        };
        let read = self.read_file(&mut log, txn)?;
        Ok(to_txn_state(read, path))
    }

    /// Every transaction's last state, oldest first (ULID order). Fails on the first corrupt
    /// file; torn last lines are ignored with a warning.
    pub fn replay(&self) -> Result<Vec<TxnState>, JournalError> {
        Ok(self
            .replay_with_phases()?
            .into_iter()
            .map(|(t, _)| t)
            .collect())
    }

    /// [`Journal::replay`] with each transaction's phase durations (what the archive keeps).
    fn replay_with_phases(&self) -> Result<Vec<(TxnState, Vec<PhaseDone>)>, JournalError> {
        let mut out = Vec::new();
        for (txn, path) in self.files()? {
            let mut log = self.open_existing(txn, &path, OpenMode::Read)?;
            let mut read = self.read_file(&mut log, txn)?;
            let phases = std::mem::take(&mut read.phases);
            if let Some(t) = to_txn_state(read, path) {
                out.push((t, phases));
            }
        }
        out.sort_by_key(|(t, _)| t.state.txn());
        Ok(out)
    }

    /// Every transaction file of the folder, with its transaction id; other names are ignored
    /// with a warning.
    fn files(&self) -> Result<Vec<(Ulid, PathBuf)>, JournalError> {
        let entries = match fs::read_dir(&self.dir) {
            // Only a read-only journal ([`Journal::at_read_only`]) may lack its folder.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            r => r.map_err(|source| JournalError::Io {
                path: self.dir.clone(),
                source,
            })?,
        };
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
            out.push((txn, path));
        }
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

    /// Every transaction of the journal folder as rows, oldest first (`journal --all`).
    pub fn list(&self) -> Result<Vec<JournalRow>, JournalError> {
        Ok(self.replay()?.iter().map(JournalRow::from).collect())
    }

    /// The phase timings of every transaction, oldest first (`journal --stats`, the metrics).
    /// Fails on the first corrupt file, like [`Journal::replay`].
    pub fn timings(&self) -> Result<Vec<TxnTimings>, JournalError> {
        let mut out = Vec::new();
        for (txn, path) in self.files()? {
            let mut log = self.open_existing(txn, &path, OpenMode::Read)?;
            let read = self.read_file(&mut log, txn)?;
            let (Some(started_at), Some(last)) = (read.first_at, read.last) else {
                continue;
            };
            let s = &last.state;
            out.push(TxnTimings {
                txn,
                kind: s.kind(),
                started_at,
                outcome: s.outcome_kind(),
                // A `needs_human` an operator closed (`journal resolve`) or a refresh saw gone
                // no longer waits for a person.
                needs_human: s.awaits_human()
                    || (s.outcome_kind().is_none() && s.phase() == Phase::NeedsHuman),
                phases: read.phases,
            });
        }
        out.sort_by_key(|t| t.txn);
        Ok(out)
    }

    /// The latest transaction on `vmid` that recorded a UPID of its own or, not being a
    /// destroy, found the vmid free in the full guest list: the one a gated destroy of that
    /// vmid must rest on (see [`State::for_destroy`]). A later transaction that found the vmid
    /// free voids every earlier claim on it: the destroy is then refused.
    pub fn last_owner_record(&self, vmid: u32) -> Result<Option<TxnState>, JournalError> {
        Ok(self
            .replay()?
            .into_iter()
            .filter(|t| {
                let s = &t.state;
                s.vmid() == Some(vmid)
                    && (s.upid().is_some()
                        || (s.kind() != TxnKind::Destroy && s.reached() >= Phase::Validated))
            })
            .max_by_key(|t| t.state.txn()))
    }

    fn log_limits(&self) -> durable_log::Limits {
        durable_log::Limits {
            max_record_bytes: self.limits.max_record_bytes,
            max_file_bytes: self.limits.max_file_bytes,
        }
    }

    /// One record line: the state, numbered and timestamped, within the per-record cap. A
    /// state over the cap is stored reduced (its failure message clipped) rather than refused:
    /// a refused record would stop the transaction before its cleanup.
    fn encode(
        &self,
        state: &State,
        seq: u64,
        phase_done: Option<PhaseDone>,
    ) -> Result<String, JournalError> {
        self.encode_reduced_if_needed(state, seq, phase_done, time::OffsetDateTime::now_utc())
    }

    fn encode_reduced_if_needed(
        &self,
        state: &State,
        seq: u64,
        phase_done: Option<PhaseDone>,
        at: time::OffsetDateTime,
    ) -> Result<String, JournalError> {
        match self.encode_at(state, seq, phase_done, at) {
            Err(JournalError::RecordTooLarge { size, .. }) => {
                let reduced = state.reduced();
                let line = self.encode_at(&reduced, seq, phase_done, at)?;
                tracing::warn!(
                    txn = %state.txn(),
                    "journal record {seq} of transaction {} was {size} bytes, over the cap; it is stored with its failure message clipped ({} bytes)",
                    state.txn(),
                    line.len()
                );
                Ok(line)
            }
            other => other,
        }
    }

    fn encode_at(
        &self,
        state: &State,
        seq: u64,
        phase_done: Option<PhaseDone>,
        at: time::OffsetDateTime,
    ) -> Result<String, JournalError> {
        let txn = state.txn();
        let record = Record {
            seq,
            at: rfc3339(at),
            state: state.clone(),
            phase_done,
        };
        let rec = serde_json::to_string(&record)
            .map_err(|source| JournalError::Encode { txn, source })?;
        self.log_limits().encode(&rec).map_err(|e| match e {
            EncodeError::TooLarge { size, max } => JournalError::RecordTooLarge {
                txn,
                seq,
                size,
                max,
            },
            EncodeError::NotOneLine => JournalError::Encode {
                txn,
                source: serde::ser::Error::custom("the record is not one line"),
            },
        })
    }

    fn file_full(&self, txn: Ulid, path: &Path) -> JournalError {
        JournalError::FileFull {
            txn,
            path: path.to_path_buf(),
            max: self.limits.max_file_bytes,
        }
    }

    fn open_log(&self, path: &Path, mode: OpenMode) -> Result<Option<LogFile>, JournalError> {
        LogFile::open(path, self.log_limits(), mode).map_err(log_error(Ulid::nil()))
    }

    /// Open a file that was just seen to exist (gone meanwhile: an I/O error).
    fn open_existing(
        &self,
        txn: Ulid,
        path: &Path,
        mode: OpenMode,
    ) -> Result<LogFile, JournalError> {
        self.open_log(path, mode)?.ok_or_else(|| JournalError::Io {
            path: path.to_path_buf(),
            source: io::Error::new(io::ErrorKind::NotFound, format!("{txn} vanished")),
        })
    }

    /// Read a transaction's file: every record must follow the one before and belong to
    /// `txn`; a torn last line is left out with a warning.
    fn read_file(&self, log: &mut LogFile, txn: Ulid) -> Result<FileRead, JournalError> {
        let mut expected = 0u64;
        let contents = log
            .read(|payload| {
                let record: Record = serde_json::from_str(payload)
                    .map_err(|e| Reject::Damaged(format!("record does not decode: {e}")))?;
                if record.seq != expected {
                    return Err(Reject::Corrupt(format!(
                        "record number {} where {expected} was expected",
                        record.seq
                    )));
                }
                if record.state.txn() != txn {
                    return Err(Reject::Corrupt(format!(
                        "a record of transaction {} in the file of transaction {txn}",
                        record.state.txn()
                    )));
                }
                expected += 1;
                Ok(record)
            })
            .map_err(log_error(txn))?;
        if let Some(torn) = &contents.torn {
            tracing::warn!(
                path = %log.path().display(),
                line = torn.line,
                "ignoring the torn last line {} of journal file {}: {}",
                torn.line,
                log.path().display(),
                torn.reason
            );
        }
        let first_at = contents.entries.first().map(|e| e.value.at.clone());
        let mut phase_since: Option<(Phase, String)> = None;
        let mut phases = Vec::new();
        for e in &contents.entries {
            let r = &e.value;
            if let Some(done) = r.phase_done {
                phases.push(done);
            }
            if phase_since
                .as_ref()
                .is_none_or(|(p, _)| *p != r.state.phase())
            {
                phase_since = Some((r.state.phase(), r.at.clone()));
            }
        }
        Ok(FileRead {
            first_at,
            phase_since: phase_since.map(|(_, at)| at),
            phases,
            records: contents.entries.len() as u64,
            torn: contents.torn.is_some(),
            last: contents.entries.into_iter().next_back().map(|e| e.value),
        })
    }
}

/// The journal's error for a durable-log error of transaction `txn`'s file.
fn log_error(txn: Ulid) -> impl Fn(LogError) -> JournalError {
    move |e| {
        durable_log::owner_error!(JournalError, e,
            Full { path, max } => JournalError::FileFull { txn, path, max },
            TooLarge { path, size, max } => JournalError::FileTooLarge { path, size, max },
        )
    }
}

/// Seconds from the RFC 3339 instant `since` to `now` (0 when `since` does not parse or lies
/// in the future).
fn seconds_since(since: &str, now: time::OffsetDateTime) -> f64 {
    time::OffsetDateTime::parse(since, &time::format_description::well_known::Rfc3339)
        .map_or(0.0, |t| (now - t).as_seconds_f64().max(0.0))
}

/// Decode the line just written, as a replay will read it.
fn read_back(line: &str, path: &Path, line_no: usize) -> Result<Record, JournalError> {
    durable_log::decode_line(line.as_bytes())
        .ok()
        .and_then(|(rec, _)| serde_json::from_str(rec).ok())
        .ok_or_else(|| JournalError::Corrupt {
            path: path.to_path_buf(),
            line: line_no,
            reason: "the record just written does not read back".to_string(),
        })
}

/// The last state of transaction `txn` from its journal file, which the caller opened itself
/// (read-only; the exec helper opens it without following links and checks its owner). The
/// same caps and checks as [`Journal::get`]: at most [`MAX_FILE_BYTES`], every record in
/// sequence and of `txn`. `None`: the file holds no valid record.
pub fn read_opened(
    file: fs::File,
    path: &Path,
    txn: Ulid,
) -> Result<Option<TxnState>, JournalError> {
    let journal = Journal {
        dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
        limits: Limits::default(),
    };
    let mut log = LogFile::from_opened(path, file, journal.log_limits()).map_err(log_error(txn))?;
    let read = journal.read_file(&mut log, txn)?;
    Ok(to_txn_state(read, path.to_path_buf()))
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

mod archive;
pub use archive::{
    ArchiveTotals, Compacted, Listing, PhaseBuckets, TimingsView, ARCHIVE_DIR,
    ARCHIVE_MAX_FILE_BYTES, PHASE_BUCKETS, TOTALS_FILE,
};

#[cfg(test)]
mod tests;
