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
//!
//! Each archived record keeps the transaction's phase durations, and `archive/totals.json`
//! ([`TOTALS_FILE`]) caches what every archive file holds in total (transactions by kind and
//! outcome, phase-duration buckets, sums and counts) with, per file, the byte offset up to which
//! it counted: the metrics add it to the journal folder's figures without re-reading the
//! archive. The cache is only ever ahead of nothing: a reader adds the records past each
//! counted offset (an append a crash left uncounted) and rebuilds it from the files when it is
//! missing, of another bucket layout, or counts more than a file holds. Compaction rewrites it
//! (temporary file, fsync, rename) after its appends and before it removes the moved
//! transactions' files, with their ids in `recent` until they are removed, so a transaction
//! in both places (a crash between) is counted once. Readers of the totals with the journal
//! folder (the metrics, `journal --stats`, the listing) hold the archive's lock shared, so
//! they never see a compaction half done.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::time::{Duration, Instant};

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
/// The cached totals of the archive, inside the archive folder.
pub const TOTALS_FILE: &str = "totals.json";
/// Upper bounds of the phase-duration buckets (seconds) the totals count in; the metrics'
/// histogram uses the same.
pub const PHASE_BUCKETS: [f64; 13] = [
    0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];
const TOTALS_VERSION: u32 = 1;
/// How long a reader waits for a running compaction before giving up.
const READ_LOCK_WAIT: Duration = Duration::from_secs(60);

/// One archived transaction.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Archived {
    archived_at: String,
    started_at: String,
    updated_at: String,
    records: u64,
    state: State,
    /// Its phase durations (absent in records archived before they were kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    phases: Vec<PhaseDone>,
}

/// Phase durations counted into [`PHASE_BUCKETS`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseBuckets {
    /// How many durations were at or below each bound of [`PHASE_BUCKETS`] (cumulative).
    pub le: Vec<u64>,
    /// How many durations.
    pub count: u64,
    /// Their sum, seconds.
    pub sum: f64,
}

impl PhaseBuckets {
    /// Count one duration.
    pub fn observe(&mut self, seconds: f64) {
        self.le.resize(PHASE_BUCKETS.len(), 0);
        for (n, bound) in self.le.iter_mut().zip(PHASE_BUCKETS) {
            if seconds <= bound {
                *n += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }
}

/// What the archive holds in total (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArchiveTotals {
    v: u32,
    bounds: Vec<f64>,
    /// Per archive file name, the offset up to which its records are counted.
    files: BTreeMap<String, u64>,
    /// Archived transactions.
    pub transactions: u64,
    /// Per kind, per outcome: archived transactions.
    pub outcomes: BTreeMap<String, BTreeMap<String, u64>>,
    /// Per kind, per phase: the archived phase durations.
    pub phases: BTreeMap<String, BTreeMap<Phase, PhaseBuckets>>,
    /// Transactions counted whose journal file a compaction may not have removed yet.
    recent: Vec<Ulid>,
}

impl Default for ArchiveTotals {
    fn default() -> Self {
        Self {
            v: TOTALS_VERSION,
            bounds: PHASE_BUCKETS.to_vec(),
            files: BTreeMap::new(),
            transactions: 0,
            outcomes: BTreeMap::new(),
            phases: BTreeMap::new(),
            recent: Vec::new(),
        }
    }
}

impl ArchiveTotals {
    fn add(&mut self, a: &Archived) {
        let kind = a.state.kind().as_str().to_string();
        let outcome = a.state.outcome_kind().map_or("open", |o| o.as_str());
        self.transactions += 1;
        *self
            .outcomes
            .entry(kind.clone())
            .or_default()
            .entry(outcome.to_string())
            .or_default() += 1;
        let phases = self.phases.entry(kind).or_default();
        for p in &a.phases {
            phases.entry(p.phase).or_default().observe(p.seconds);
        }
    }

    fn usable(&self) -> bool {
        self.v == TOTALS_VERSION && self.bounds == PHASE_BUCKETS
    }

    /// Every kind under the name this agent writes: totals an earlier version wrote name the
    /// restore test `selftest-restore`, whose counts join `restore-test`'s, so no counter of
    /// the metrics goes down (or is left out as an unknown kind) after an upgrade. A name that
    /// is no kind stays as it is.
    pub(super) fn kinds_renamed(mut self) -> Self {
        let renamed = |k: &str| {
            serde_json::from_value::<TxnKind>(serde_json::Value::from(k))
                .ok()
                .map(TxnKind::as_str)
                .filter(|now| *now != k)
        };
        let old: Vec<String> = self
            .outcomes
            .keys()
            .chain(self.phases.keys())
            .filter(|k| renamed(k).is_some())
            .cloned()
            .collect();
        for k in old {
            let Some(now) = renamed(&k) else { continue };
            if let Some(outcomes) = self.outcomes.remove(&k) {
                let into = self.outcomes.entry(now.to_string()).or_default();
                for (o, n) in outcomes {
                    *into.entry(o).or_default() += n;
                }
            }
            if let Some(phases) = self.phases.remove(&k) {
                let into = self.phases.entry(now.to_string()).or_default();
                for (p, b) in phases {
                    let h = into.entry(p).or_default();
                    h.le.resize(PHASE_BUCKETS.len(), 0);
                    for (n, add) in h.le.iter_mut().zip(&b.le) {
                        *n += add;
                    }
                    h.count += b.count;
                    h.sum += b.sum;
                }
            }
        }
        self
    }
}

/// The archive's totals next to the journal folder's own timings, read as one consistent view
/// (see [`Journal::timings_with_archive`]).
#[derive(Debug, Clone)]
pub struct TimingsView {
    /// The journal folder's transactions, without those the totals already count.
    pub live: Vec<TxnTimings>,
    /// The archive's totals.
    pub archived: ArchiveTotals,
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
            // Never through a link: a link there would make root create or open its target.
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        let Ok(_lock) = Flock::lock(lock_file, FlockArg::LockExclusiveNonblock) else {
            return Ok(Compacted::default());
        };

        // Count first what an earlier compaction appended but did not count (a crash).
        let mut totals = self.load_totals();
        let mut totals_changed = self.catch_up(&mut totals, &HashSet::new())?.changed;

        let live = self.replay_with_phases()?;
        // Per vmid, the oldest transaction that still concerns its guest: nothing newer on
        // that vmid is archived.
        let mut guard: HashMap<u32, Ulid> = HashMap::new();
        for (t, _) in live.iter().filter(|(t, _)| !archivable(&t.state)) {
            if let Some(v) = t.state.vmid() {
                let g = guard.entry(v).or_insert(t.state.txn());
                *g = (*g).min(t.state.txn());
            }
        }
        let cutoff = now - keep;
        let mut by_month: BTreeMap<String, Vec<&(TxnState, Vec<PhaseDone>)>> = BTreeMap::new();
        for entry in &live {
            let (t, _) = entry;
            let s = &t.state;
            let old = OffsetDateTime::parse(&t.updated_at, &Rfc3339).is_ok_and(|u| u < cutoff);
            let guarded = s
                .vmid()
                .and_then(|v| guard.get(&v))
                .is_some_and(|g| *g < s.txn());
            if archivable(s) && old && !guarded {
                if let Some(m) = month_of(&t.updated_at) {
                    by_month.entry(m.to_string()).or_default().push(entry);
                }
            }
        }

        let archived_at = crate::timefmt::rfc3339(now);
        let mut done = Compacted::default();
        let mut moved: Vec<&TxnState> = Vec::new();
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
            let mut month_moved = 0;
            for (t, phases) in txns {
                if !present.contains(&t.state.txn()) {
                    let rec = Archived {
                        archived_at: archived_at.clone(),
                        started_at: t.started_at.clone(),
                        updated_at: t.updated_at.clone(),
                        records: t.records,
                        state: t.state.clone(),
                        phases: phases.clone(),
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
                month_moved += 1;
            }
            if !lines.is_empty() {
                log.append(lines.as_bytes())
                    .map_err(log_error(Ulid::nil()))?;
            }
            if month_moved > 0 {
                done.archived += month_moved;
                done.files.push(path);
            }
        }
        // Count what was just appended, and name the transactions about to leave the folder:
        // until their files are gone, a reader counts them from the archive only.
        totals_changed |= self.catch_up(&mut totals, &HashSet::new())?.changed;
        totals.recent = moved.iter().map(|t| t.state.txn()).collect();
        if totals_changed || !totals.recent.is_empty() {
            self.write_totals(&totals)?;
        }
        for t in &moved {
            fs::remove_file(&t.path).map_err(io(&t.path))?;
        }
        if !moved.is_empty() {
            sync_dir(&self.dir).map_err(io(&self.dir))?;
            totals.recent.clear();
            self.write_totals(&totals)?;
        }
        if done.archived > 0 {
            tracing::info!(
                archived = done.archived,
                "settled transactions older than the journal's keep time moved to the archive"
            );
        }
        Ok(done)
    }

    /// The archive files, oldest month first.
    fn archive_files(&self) -> Vec<PathBuf> {
        let Ok(entries) = fs::read_dir(self.archive_dir()) else {
            return Vec::new();
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().and_then(|e| e.to_str()) == Some(FILE_EXT))
            .collect();
        files.sort();
        files
    }

    /// The cached totals as stored, or empty ones (to be rebuilt) when missing or unusable.
    fn load_totals(&self) -> ArchiveTotals {
        let path = self.archive_dir().join(TOTALS_FILE);
        let Ok(text) = fs::read_to_string(&path) else {
            return ArchiveTotals::default();
        };
        match serde_json::from_str::<ArchiveTotals>(&text) {
            Ok(t) if t.usable() => t.kinds_renamed(),
            _ => {
                tracing::warn!(path = %path.display(), "archive totals {} are unreadable or of another layout; counting the archive again", path.display());
                ArchiveTotals::default()
            }
        }
    }

    /// Write the totals whole: a temporary file, fsync, rename, folder fsync.
    fn write_totals(&self, totals: &ArchiveTotals) -> Result<(), JournalError> {
        let dir = self.archive_dir();
        let path = dir.join(TOTALS_FILE);
        let tmp = dir.join(format!("{TOTALS_FILE}.tmp"));
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| JournalError::Io { path: p, source }
        };
        let text = serde_json::to_string(totals).map_err(|source| JournalError::Encode {
            txn: Ulid::nil(),
            source,
        })?;
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io(&tmp))?;
        f.write_all(text.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(io(&tmp))?;
        fs::rename(&tmp, &path).map_err(io(&path))?;
        sync_dir(&dir).map_err(io(&dir))
    }

    /// Add to `totals` every archived record past its counted offset (all of them when a file
    /// holds less than was counted: the totals are rebuilt). Returns whether anything was
    /// added and which of `live` (transactions still in the journal folder) the totals count.
    fn catch_up(
        &self,
        totals: &mut ArchiveTotals,
        live: &HashSet<Ulid>,
    ) -> Result<CaughtUp, JournalError> {
        let files = self.archive_files();
        let sizes: HashMap<String, (PathBuf, u64)> = files
            .into_iter()
            .filter_map(|p| {
                let name = p.file_name()?.to_str()?.to_string();
                let len = fs::metadata(&p).ok()?.len();
                Some((name, (p, len)))
            })
            .collect();
        let shrunk = totals
            .files
            .iter()
            .any(|(name, off)| sizes.get(name).is_none_or(|(_, len)| len < off));
        let mut out = CaughtUp::default();
        if shrunk || !totals.usable() {
            tracing::warn!(dir = %self.archive_dir().display(), "the archive in {} holds less than its totals counted; counting it again", self.archive_dir().display());
            *totals = ArchiveTotals::default();
            out.changed = true;
        }
        out.twice = totals
            .recent
            .iter()
            .filter(|t| live.contains(t))
            .copied()
            .collect();
        let max_line = self.archive_limits().max_record_bytes as u64;
        let mut names: Vec<&String> = sizes.keys().collect();
        names.sort();
        for name in names {
            let (path, len) = &sizes[name];
            let from = totals.files.get(name).copied().unwrap_or(0);
            if *len <= from {
                continue;
            }
            let io = |source| JournalError::Io {
                path: path.clone(),
                source,
            };
            let mut f = File::open(path).map_err(io)?;
            f.seek(SeekFrom::Start(from)).map_err(io)?;
            let mut reader = BufReader::new(f.take(len - from));
            let mut at = from;
            let mut line = Vec::new();
            loop {
                line.clear();
                let n = (&mut reader)
                    .take(max_line + 1)
                    .read_until(b'\n', &mut line)
                    .map_err(io)?;
                if n == 0 || !line.ends_with(b"\n") {
                    // The end, or a torn last line (the next append cuts it off).
                    break;
                }
                let decoded = durable_log::decode_line(&line)
                    .map_err(|e| format!("{e:?}"))
                    .and_then(|(payload, _)| {
                        serde_json::from_str::<Archived>(payload).map_err(|e| e.to_string())
                    });
                let a = match decoded {
                    Ok(a) => a,
                    Err(why) => {
                        tracing::warn!(path = %path.display(), offset = at, "archive file {} has a record that does not read at byte {at} ({why}); the totals stop there", path.display());
                        break;
                    }
                };
                totals.add(&a);
                if live.contains(&a.state.txn()) {
                    out.twice.insert(a.state.txn());
                }
                at += n as u64;
                out.changed = true;
            }
            totals.files.insert(name.clone(), at);
        }
        Ok(out)
    }

    /// Take the archive's lock shared (a compaction holds it alone), waiting up to a minute
    /// for a running compaction. `None` when there is no archive yet.
    fn read_lock(&self) -> Result<Option<Flock<File>>, JournalError> {
        let dir = self.archive_dir();
        if !dir.is_dir() {
            return Ok(None);
        }
        let lock_path = dir.join(".lock");
        let io = |source| JournalError::Io {
            path: lock_path.clone(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            // Never through a link: a link there would make root create or open its target.
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&lock_path)
            .map_err(io)?;
        let start = Instant::now();
        loop {
            match Flock::lock(file, FlockArg::LockSharedNonblock) {
                Ok(l) => return Ok(Some(l)),
                Err((f, _)) if start.elapsed() < READ_LOCK_WAIT => {
                    file = f;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err((_, e)) => {
                    return Err(io(io::Error::new(
                        io::ErrorKind::WouldBlock,
                        format!("a compaction of the journal has held the archive's lock for over a minute ({e}); try again later"),
                    )))
                }
            }
        }
    }

    /// The journal folder's timings and the archive's totals, read as one view (under the
    /// archive's lock, so a compaction is not half seen): what the metrics count. A transaction
    /// both in the folder and in the archive (a compaction interrupted) is counted once.
    pub fn timings_with_archive(&self) -> Result<TimingsView, JournalError> {
        let _lock = self.read_lock()?;
        let mut live = self.timings()?;
        let mut archived = self.load_totals();
        let ids: HashSet<Ulid> = live.iter().map(|t| t.txn).collect();
        let caught = self.catch_up(&mut archived, &ids)?;
        live.retain(|t| !caught.twice.contains(&t.txn));
        Ok(TimingsView { live, archived })
    }

    /// Every transaction's timings, the archived ones included (read from the archive's
    /// records), oldest first: `journal --stats`.
    pub fn all_timings(&self) -> Result<Vec<TxnTimings>, JournalError> {
        let _lock = self.read_lock()?;
        let mut out: BTreeMap<Ulid, TxnTimings> = BTreeMap::new();
        for path in self.archive_files() {
            let Some(mut log) = LogFile::open(&path, self.archive_limits(), OpenMode::Read)
                .map_err(log_error(Ulid::nil()))?
            else {
                continue;
            };
            for a in read_archive(&mut log)? {
                let s = &a.state;
                out.insert(
                    s.txn(),
                    TxnTimings {
                        txn: s.txn(),
                        kind: s.kind(),
                        started_at: a.started_at.clone(),
                        outcome: s.outcome_kind(),
                        needs_human: false,
                        phases: a.phases.clone(),
                    },
                );
            }
        }
        for t in self.timings()? {
            out.insert(t.txn, t);
        }
        Ok(out.into_values().collect())
    }

    /// The `n` archived transactions appended last (newest month first, its last records
    /// first), leaving out `skip`: what the default `journal` listing shows when the folder
    /// holds fewer settled ones. Reads only the end of the newest files.
    pub fn archived_newest(
        &self,
        n: usize,
        skip: &HashSet<Ulid>,
    ) -> Result<Vec<TxnState>, JournalError> {
        let mut out: Vec<TxnState> = Vec::new();
        let mut seen: HashSet<Ulid> = HashSet::new();
        for path in self.archive_files().into_iter().rev() {
            if out.len() >= n {
                break;
            }
            let io = |source| JournalError::Io {
                path: path.clone(),
                source,
            };
            let mut f = File::open(&path).map_err(io)?;
            let len = f.metadata().map_err(io)?.len();
            let mut window: u64 = 256 * 1024;
            loop {
                let from = len.saturating_sub(window);
                f.seek(SeekFrom::Start(from)).map_err(io)?;
                let mut buf = Vec::new();
                (&mut f)
                    .take(len - from)
                    .read_to_end(&mut buf)
                    .map_err(io)?;
                // A window that starts inside a line drops that line.
                let body = if from == 0 {
                    &buf[..]
                } else {
                    match buf.iter().position(|b| *b == b'\n') {
                        Some(i) => &buf[i + 1..],
                        None => &[][..],
                    }
                };
                let found: Vec<TxnState> = body
                    .split_inclusive(|b| *b == b'\n')
                    .filter(|l| l.ends_with(b"\n"))
                    .filter_map(|l| {
                        let (payload, _) = durable_log::decode_line(l).ok()?;
                        serde_json::from_str::<Archived>(payload).ok()
                    })
                    .filter(|a| !skip.contains(&a.state.txn()))
                    .map(|a| TxnState {
                        state: a.state,
                        started_at: a.started_at,
                        updated_at: a.updated_at,
                        records: a.records,
                        torn_tail: false,
                        path: path.clone(),
                    })
                    .collect();
                if found.len() + out.len() >= n || from == 0 {
                    for t in found.into_iter().rev() {
                        if out.len() >= n {
                            break;
                        }
                        if seen.insert(t.state.txn()) {
                            out.push(t);
                        }
                    }
                    break;
                }
                window = window.saturating_mul(4);
            }
        }
        Ok(out)
    }

    /// The default listing of `felhom-agent journal`: every transaction that may still own or
    /// concern a guest (open, `needs_human`, kept with its claim) and the `others` settled ones
    /// written last (from the journal folder, then the archive), oldest first, with how many
    /// settled ones are left out.
    pub fn list_recent(&self, others: usize) -> Result<Listing, JournalError> {
        let live = self.replay()?;
        let (concern, mut settled): (Vec<&TxnState>, Vec<&TxnState>) =
            live.iter().partition(|t| !archivable(&t.state));
        // Newest first, by the instant (RFC 3339 texts of different precision do not sort).
        settled.sort_by_cached_key(|t| {
            let at = OffsetDateTime::parse(&t.updated_at, &Rfc3339)
                .unwrap_or(OffsetDateTime::UNIX_EPOCH);
            std::cmp::Reverse((at, t.state.txn()))
        });
        let live_hidden = settled.len().saturating_sub(others) as u64;
        settled.truncate(others);
        // Fewer settled ones in the folder than asked for: the rest from the archive.
        let want = others - settled.len();
        let mut shown: Vec<TxnState> = concern.into_iter().chain(settled).cloned().collect();
        let ids: HashSet<Ulid> = live.iter().map(|t| t.state.txn()).collect();
        let mut archive_hidden = 0;
        if self.archive_dir().is_dir() {
            let total = self.archived_count(&ids)?;
            let newest = if want > 0 {
                self.archived_newest(want, &ids)?
            } else {
                Vec::new()
            };
            archive_hidden = total.saturating_sub(newest.len() as u64);
            shown.extend(newest);
        }
        shown.sort_by_key(|t| t.state.txn());
        Ok(Listing {
            rows: shown.iter().map(JournalRow::from).collect(),
            not_shown: live_hidden + archive_hidden,
        })
    }

    /// How many transactions the archive holds (from its totals, counting what they miss),
    /// leaving out `live` (transactions also still in the journal folder).
    pub fn archived_count(&self, live: &HashSet<Ulid>) -> Result<u64, JournalError> {
        let _lock = self.read_lock()?;
        let mut totals = self.load_totals();
        let caught = self.catch_up(&mut totals, live)?;
        Ok(totals
            .transactions
            .saturating_sub(caught.twice.len() as u64))
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

/// The default listing of `felhom-agent journal`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Listing {
    /// The transactions shown, oldest first.
    pub rows: Vec<JournalRow>,
    /// Settled transactions (in the folder or the archive) left out; `--all` lists them.
    pub not_shown: u64,
}

/// What [`Journal::catch_up`] found.
#[derive(Debug, Default)]
struct CaughtUp {
    changed: bool,
    /// Transactions of the journal folder the totals count too.
    twice: HashSet<Ulid>,
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
