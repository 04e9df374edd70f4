//! The journal's archive: settled transactions older than `[journal] keep_days` leave the
//! journal folder for one append-only file per month, `<state_dir>/journal/archive/YYYY-MM.log`
//! (the month the transaction was last written), one [`crate::durable_log`] record per
//! transaction holding its last state and times. `journal --all` and a re-dispatch of an old
//! transaction id still find them.
//!
//! Never archived: an open transaction, a `needs_human` nobody closed, a claim (armed, not
//! withdrawn, not destroyed); nor any transaction on a vmid newer than such a one there, so the
//! journal's answer to "which transaction owns this vmid" ([`Journal::last_owner_record`]) is
//! the same before and after. A transaction is appended (fsynced) before its own file is
//! removed; a crash in between leaves both, and the next compaction removes the file without
//! appending it again. One compaction runs at a time (a lock file in the archive folder).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::*;

/// The archive's folder inside the journal folder.
pub const ARCHIVE_DIR: &str = "archive";
/// Cap on one month's archive file, in bytes. A month that reaches it stops being compacted
/// (its transactions stay in the journal folder) with a warning.
pub const ARCHIVE_MAX_FILE_BYTES: u64 = 256 * 1024 * 1024;

/// One archived transaction.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Archived {
    archived_at: String,
    started_at: String,
    updated_at: String,
    records: u64,
    state: State,
}

/// What one compaction did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Compacted {
    /// Transactions moved into the archive.
    pub archived: usize,
    /// Archive files written to.
    pub files: Vec<PathBuf>,
}

/// Whether a settled transaction no longer concerns a guest: not open, not an unclosed
/// `needs_human`, not a claim.
fn archivable(s: &State) -> bool {
    s.is_terminal() && !s.awaits_human() && !s.holds_claim()
}

/// `YYYY-MM` of an RFC 3339 time, when it is one.
fn month_of(at: &str) -> Option<&str> {
    let m = at.get(..7)?;
    let b = m.as_bytes();
    (b[..4].iter().all(u8::is_ascii_digit) && b[4] == b'-' && b[5..].iter().all(u8::is_ascii_digit))
        .then_some(m)
}

impl Journal {
    /// The archive folder.
    pub fn archive_dir(&self) -> PathBuf {
        self.dir.join(ARCHIVE_DIR)
    }

    fn archive_limits(&self) -> durable_log::Limits {
        durable_log::Limits {
            // An archived record is a journal record plus three timestamps.
            max_record_bytes: self.limits.max_record_bytes + 1024,
            max_file_bytes: ARCHIVE_MAX_FILE_BYTES,
        }
    }

    /// Move the settled transactions last written more than `keep` before `now` into the
    /// month's archive file (see the module docs for what is never moved). Returns what moved;
    /// another compaction running meanwhile makes this one do nothing.
    pub fn compact(&self, keep: Duration, now: OffsetDateTime) -> Result<Compacted, JournalError> {
        let dir = self.archive_dir();
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| JournalError::Io { path, source }
        };
        if !dir.is_dir() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(|source| JournalError::CreateDir {
                    path: dir.clone(),
                    source,
                })?;
            sync_dir(&self.dir).map_err(io(&self.dir))?;
        }
        let lock_path = dir.join(".lock");
        let lock_file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        let Ok(_lock) = Flock::lock(lock_file, FlockArg::LockExclusiveNonblock) else {
            return Ok(Compacted::default());
        };

        let live = self.replay()?;
        // Per vmid, the oldest transaction that still concerns its guest: nothing newer on
        // that vmid is archived.
        let mut guard: HashMap<u32, Ulid> = HashMap::new();
        for t in live.iter().filter(|t| !archivable(&t.state)) {
            if let Some(v) = t.state.vmid() {
                let g = guard.entry(v).or_insert(t.state.txn());
                *g = (*g).min(t.state.txn());
            }
        }
        let cutoff = now - keep;
        let mut by_month: BTreeMap<String, Vec<&TxnState>> = BTreeMap::new();
        for t in &live {
            let s = &t.state;
            let old = OffsetDateTime::parse(&t.updated_at, &Rfc3339).is_ok_and(|u| u < cutoff);
            let guarded = s
                .vmid()
                .and_then(|v| guard.get(&v))
                .is_some_and(|g| *g < s.txn());
            if archivable(s) && old && !guarded {
                if let Some(m) = month_of(&t.updated_at) {
                    by_month.entry(m.to_string()).or_default().push(t);
                }
            }
        }

        let archived_at = crate::timefmt::rfc3339(now);
        let mut done = Compacted::default();
        for (month, txns) in by_month {
            let path = dir.join(format!("{month}.{FILE_EXT}"));
            let mut log = LogFile::open(&path, self.archive_limits(), OpenMode::Create)
                .map_err(log_error(Ulid::nil()))?
                .ok_or_else(|| JournalError::Io {
                    path: path.clone(),
                    source: io::Error::new(io::ErrorKind::NotFound, "archive file vanished"),
                })?;
            let present: HashSet<Ulid> = read_archive(&mut log)?
                .into_iter()
                .map(|a| a.state.txn())
                .collect();
            let mut lines = String::new();
            let mut moved = Vec::new();
            for t in txns {
                if !present.contains(&t.state.txn()) {
                    let rec = Archived {
                        archived_at: archived_at.clone(),
                        started_at: t.started_at.clone(),
                        updated_at: t.updated_at.clone(),
                        records: t.records,
                        state: t.state.clone(),
                    };
                    let payload =
                        serde_json::to_string(&rec).map_err(|source| JournalError::Encode {
                            txn: t.state.txn(),
                            source,
                        })?;
                    let Ok(line) = self.archive_limits().encode(&payload) else {
                        tracing::warn!(txn = %t.state.txn(), "transaction {} is too large for the archive; it stays in the journal folder", t.state.txn());
                        continue;
                    };
                    if !log.fits((lines.len() + line.len()) as u64) {
                        tracing::warn!(path = %path.display(), "archive file {} is full; the rest of {month} stays in the journal folder", path.display());
                        break;
                    }
                    lines.push_str(&line);
                }
                moved.push(t);
            }
            if !lines.is_empty() {
                log.append(lines.as_bytes())
                    .map_err(log_error(Ulid::nil()))?;
            }
            for t in &moved {
                fs::remove_file(&t.path).map_err(io(&t.path))?;
            }
            if !moved.is_empty() {
                sync_dir(&self.dir).map_err(io(&self.dir))?;
                done.archived += moved.len();
                done.files.push(path);
            }
        }
        if done.archived > 0 {
            tracing::info!(
                archived = done.archived,
                "settled transactions older than the journal's keep time moved to the archive"
            );
        }
        Ok(done)
    }

    /// Every archived transaction's last state, oldest first (one per transaction).
    pub fn archived(&self) -> Result<Vec<TxnState>, JournalError> {
        let dir = self.archive_dir();
        let Ok(entries) = fs::read_dir(&dir) else {
            return Ok(Vec::new());
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().and_then(|e| e.to_str()) == Some(FILE_EXT))
            .collect();
        files.sort();
        let mut out: BTreeMap<Ulid, TxnState> = BTreeMap::new();
        for path in files {
            let Some(mut log) = LogFile::open(&path, self.archive_limits(), OpenMode::Read)
                .map_err(log_error(Ulid::nil()))?
            else {
                continue;
            };
            for a in read_archive(&mut log)? {
                out.insert(
                    a.state.txn(),
                    TxnState {
                        state: a.state,
                        started_at: a.started_at,
                        updated_at: a.updated_at,
                        records: a.records,
                        torn_tail: false,
                        path: path.clone(),
                    },
                );
            }
        }
        Ok(out.into_values().collect())
    }

    /// [`Journal::get`], else the archive: what a re-dispatch of an old transaction id answers.
    pub fn get_any(&self, txn: Ulid) -> Result<Option<TxnState>, JournalError> {
        match self.get(txn)? {
            Some(t) => Ok(Some(t)),
            None => Ok(self.archived()?.into_iter().find(|t| t.state.txn() == txn)),
        }
    }
}

fn read_archive(log: &mut LogFile) -> Result<Vec<Archived>, JournalError> {
    let contents = log
        .read(|payload| {
            serde_json::from_str::<Archived>(payload)
                .map_err(|e| Reject::Damaged(format!("archived record does not decode: {e}")))
        })
        .map_err(log_error(Ulid::nil()))?;
    if let Some(torn) = &contents.torn {
        tracing::warn!(path = %log.path().display(), line = torn.line, "ignoring the torn last line {} of archive file {}: {}", torn.line, log.path().display(), torn.reason);
    }
    Ok(contents.entries.into_iter().map(|e| e.value).collect())
}
