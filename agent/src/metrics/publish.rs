//! `felhom-agent metrics-publish`: root copies the agent's metrics files, checked, into
//! node_exporter's textfile folder, so node_exporter reads only regular files root wrote from
//! what the agent wrote, or nothing.
//!
//! Why not links from node_exporter's folder to the agent's files: node_exporter's textfile
//! collector (prometheus/node_exporter `collector/textfile.go`, `Update` and `processFile`)
//! lists its folder with `os.ReadDir`, and for every name ending in `.prom` calls `os.Open`,
//! which follows links and opens whatever is there: a FIFO blocks the open (every scrape hangs),
//! a link to another file it may read serves that file's lines or puts them in its log, and a
//! link whose target does not exist yet (a fresh install) fails the open and sets
//! `node_textfile_scrape_error 1`. The agent's user controls what is behind such a link.
//!
//! So root (`felhom-agent-metrics.service`, started by `felhom-agent-metrics.path` when the
//! agent's folder changes) does, for each of the four known names only: open it in the agent's
//! folder (opened `O_DIRECTORY|O_NOFOLLOW`) with `O_NOFOLLOW|O_NONBLOCK` (a link is refused, a
//! FIFO never blocks), require a regular file of root or the agent's user of at most
//! [`MAX_FILE_BYTES`], read it, and require the text to be what the agent writes: `# HELP` /
//! `# TYPE` lines and samples of `felhom_` metrics without timestamps. What passes is written
//! into node_exporter's folder the way the agent writes (random exclusive temporary name,
//! `renameat`, [`super::textfile::write`]); a name whose source is missing or refused is
//! removed there (`unlinkat`), so node_exporter gets nothing rather than something else, and
//! no file at all until the agent wrote one (no scrape error on a fresh install).
//!
//! What the agent writes, exactly ([`validate`]): each file holds only its own metric families
//! ([`families`]: names, types and label keys as `super` writes them); every sample's label
//! set is parsed (quoted values with `\\`, `\"`, `\n` escapes), must hold exactly the
//! family's keys once each (so no `__name__`, `instance`, `job`), and each value must be one
//! the agent writes for that key ([`label_value_ok`]: a transaction kind, a phase, an outcome,
//! a bucket bound, a coverage status, a vmid in PVE's range, a guest's name), so a file holds
//! at most the few hundred series the agent can write, never series made up by whoever wrote
//! the file; no series twice; at most [`max_samples`] samples per file ([`MAX_SAMPLES`], or
//! for the coverage file, whose series are per guest, what [`MAX_COVERAGE_GUESTS`] guests
//! make). A refused agent folder removes the published copies too.
//!
//! Every pass ends by writing [`STATUS_FILE`] into node_exporter's folder:
//! `felhom_metrics_published{file}` is 1 for each name copied and 0 for one missing or
//! refused (also when the agent's folder is refused). A missing series matches no alert rule,
//! so this is what lets `FelhomAgentMetricsMissing` fire when the agent's files are gone, and
//! its mtime (`node_textfile_mtime_seconds`, moving at every pass, so every 15 s while the
//! daemon runs) what lets `FelhomAgentMetricsStale` fire when the publishing stopped.
//!
//! `--idle-exit SECS` ([`follow`]; the packaged unit): after the first pass it stays, watching
//! the agent's folder with inotify, and publishes again at every change (changes within
//! [`DEBOUNCE`] count as one), until the folder has been still for that long. systemd's path
//! unit stops watching while the service it started runs (systemd `src/core/path.c`
//! `path_enter_running` calls `path_unwatch`), so a oneshot publisher missed every write made
//! while it ran, and a start per change hit the default start limit (5 in 10 s,
//! `src/core/unit.c` `unit_test_start_limit`), which fails the path unit for good
//! (`unit-start-limit-hit`, `path_trigger_notify_impl`). The watch is set before the first
//! pass, so no write between the trigger and the watch is missed; see systemd/README.md.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsFd;
use std::path::Path;

use nix::sys::stat::{fstat, SFlag};

use super::{COVERAGE_FILE, HUB_FILE, RESTORE_TEST_FILE, TRANSACTIONS_FILE};

/// The files published, by name; nothing else in the agent's folder is looked at.
pub const FILES: [&str; 4] = [
    TRANSACTIONS_FILE,
    HUB_FILE,
    RESTORE_TEST_FILE,
    COVERAGE_FILE,
];
/// The publisher's own file in node_exporter's folder: what each pass published (module docs).
pub const STATUS_FILE: &str = "felhom_metrics_publish.prom";
/// The largest metrics file published.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;
/// node_exporter's textfile folder on Debian.
pub const DEFAULT_TARGET: &str = "/var/lib/prometheus/node-exporter";

/// What happened to one name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// Copied into node_exporter's folder.
    Copied,
    /// The agent has not written it: nothing in node_exporter's folder.
    Absent,
    /// Refused (why): nothing in node_exporter's folder.
    Refused(String),
}

/// The most samples one file may hold. The label values are bounded ([`label_value_ok`]), so
/// the agent writes at most [`most_series`] of a file (about 900: the phase histogram of every
/// kind and phase); this is a second bound.
pub const MAX_SAMPLES: usize = 1000;
/// The most pool guests the coverage file is published for: its series are per guest (11 at
/// most each), so its bound on samples is theirs ([`max_samples`]); at 1000 guests with
/// 9-digit vmids and the longest names it stays under [`MAX_FILE_BYTES`]. A node with more has
/// the file refused, and `FelhomBackupCoverageMissing` says so.
pub const MAX_COVERAGE_GUESTS: usize = 1000;
/// The longest label value published, bytes (the agent's are its own short names and numbers,
/// and guests' names clipped to it: [`super::guest_name_label`]).
pub const MAX_LABEL_VALUE: usize = 64;

/// The most samples `file` may hold: [`MAX_SAMPLES`], or for [`COVERAGE_FILE`] the most the
/// agent writes for [`MAX_COVERAGE_GUESTS`] guests.
pub fn max_samples(file: &str) -> usize {
    if file == COVERAGE_FILE {
        most_series(COVERAGE_FILE)
    } else {
        MAX_SAMPLES
    }
}

/// The text of [`STATUS_FILE`]: 1 for each of [`FILES`] in `copied`, 0 for the others.
pub fn status_text(copied: &[&str]) -> String {
    let mut s = String::new();
    s.push_str(
        "# HELP felhom_metrics_published 1 when root published the agent's metrics file at its \
         last pass, 0 when the file was missing or refused (journalctl -u \
         felhom-agent-metrics.service says why).\n# TYPE felhom_metrics_published gauge\n",
    );
    for name in FILES {
        s.push_str(&format!(
            "felhom_metrics_published{{file=\"{name}\"}} {}\n",
            u8::from(copied.contains(&name))
        ));
    }
    s
}

/// Write [`STATUS_FILE`] into `to`; a failure is logged (the alert on its age then fires).
fn write_status(to: &Path, copied: &[&str]) {
    if let Err(e) = super::textfile::write(to, STATUS_FILE, &status_text(copied)) {
        tracing::warn!(file = STATUS_FILE, dir = %to.display(), "cannot write the publisher's status: {e}");
    }
}
/// How long `--idle-exit` gathers changes before publishing them.
pub const DEBOUNCE: std::time::Duration = std::time::Duration::from_millis(100);

/// One metric family the agent writes.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    /// Its name.
    pub name: &'static str,
    /// Its `# TYPE`.
    pub kind: &'static str,
    /// The label keys of every sample (a histogram's `_bucket` adds `le`).
    pub labels: &'static [&'static str],
}

const fn fam(name: &'static str, kind: &'static str, labels: &'static [&'static str]) -> Family {
    Family { name, kind, labels }
}

const TRANSACTIONS_FAMILIES: &[Family] = &[
    fam(
        "felhom_phase_duration_seconds",
        "histogram",
        &["kind", "phase"],
    ),
    fam("felhom_transactions_total", "counter", &["kind", "outcome"]),
    fam("felhom_needs_human", "gauge", &[]),
];
const HUB_FAMILIES: &[Family] = &[
    fam("felhom_hub_configured", "gauge", &[]),
    fam("felhom_hub_connected", "gauge", &[]),
    fam("felhom_outbox_depth", "gauge", &[]),
    fam("felhom_outbox_dropped_total", "counter", &[]),
];
const RESTORE_TEST_FAMILIES: &[Family] = &[
    fam(
        "felhom_restore_test_last_run_timestamp_seconds",
        "gauge",
        &[],
    ),
    fam(
        "felhom_restore_test_last_success_timestamp_seconds",
        "gauge",
        &[],
    ),
    fam("felhom_restore_test_duration_seconds", "gauge", &[]),
    fam("felhom_restore_test_outcome", "gauge", &["outcome"]),
    fam("felhom_restore_test_skipped_total", "counter", &[]),
    fam("felhom_restore_test_runs_total", "counter", &[]),
    fam("felhom_restore_test_checks", "gauge", &["status"]),
];
const COVERAGE_FAMILIES: &[Family] = &[
    fam("felhom_backup_status", "gauge", &["vmid", "status"]),
    fam("felhom_backup_proven", "gauge", &["vmid"]),
    fam("felhom_backup_proven_age_seconds", "gauge", &["vmid"]),
    fam("felhom_backup_stale", "gauge", &["vmid"]),
    fam("felhom_backup_newest_age_seconds", "gauge", &["vmid"]),
    fam("felhom_guest_info", "gauge", &["vmid", "name"]),
    fam("felhom_backup_guests", "gauge", &["status"]),
    fam("felhom_backup_guests_stale", "gauge", &[]),
];

/// Whether `value` is one the agent writes for label `key` of family `family`: a transaction
/// kind, a phase, an outcome (the restore test's own list for its gauge), a histogram bucket's
/// bound as the agent prints it, one of [`FILES`] (the publisher's own status), a coverage
/// status, a vmid as PVE writes it (100 to 999999999, no leading zero), or the name of
/// `felhom_guest_info`: any text without a control character but the line break (the length
/// is [`validate`]'s to check).
pub fn label_value_ok(family: &str, key: &str, value: &str) -> bool {
    use crate::provision::machine::Phase;
    match key {
        // Or the restore test's name before it became `restore-test`: a file an earlier
        // version wrote is published until the agent rewrites it (it writes one name only, so
        // the bound of `most_series` holds).
        "kind" => super::KINDS.iter().any(|k| k.as_str() == value) || value == "selftest-restore",
        "phase" => Phase::ALL.iter().any(|p| p.as_str() == value),
        "outcome" if family == "felhom_restore_test_outcome" => {
            super::RESTORE_TEST_OUTCOMES.contains(&value)
        }
        "outcome" => super::OUTCOMES.iter().any(|o| o.as_str() == value),
        "le" => value == "+Inf" || super::BUCKETS.iter().any(|b| super::num(*b) == value),
        "file" => FILES.contains(&value),
        "status" if family == "felhom_restore_test_checks" => {
            super::CHECK_STATUSES.iter().any(|s| s.as_str() == value)
        }
        "status" => super::COVERAGE_STATUSES.contains(&value),
        "vmid" => crate::vmid::parse_vmid(value).is_ok(),
        "name" if family == "felhom_guest_info" => {
            !value.chars().any(|c| c.is_control() && c != '\n')
        }
        _ => false,
    }
}

/// How many values label `key` of `family` can take ([`label_value_ok`]).
fn label_value_count(family: &str, key: &str) -> usize {
    use crate::provision::machine::Phase;
    match key {
        "kind" => super::KINDS.len(),
        "phase" => Phase::ALL.len(),
        "outcome" if family == "felhom_restore_test_outcome" => super::RESTORE_TEST_OUTCOMES.len(),
        "outcome" => super::OUTCOMES.len(),
        "le" => super::BUCKETS.len() + 1,
        "file" => FILES.len(),
        "status" if family == "felhom_restore_test_checks" => super::CHECK_STATUSES.len(),
        "status" => super::COVERAGE_STATUSES.len(),
        "vmid" => MAX_COVERAGE_GUESTS,
        // One name per guest.
        "name" => 1,
        _ => 0,
    }
}

/// The most series a file of the agent's may hold with the label values it writes.
pub fn most_series(file: &str) -> usize {
    families(file)
        .iter()
        .map(|f| {
            let per: usize = f
                .labels
                .iter()
                .map(|k| label_value_count(f.name, k))
                .product();
            if f.kind == "histogram" {
                per * (label_value_count(f.name, "le") + 2)
            } else {
                per
            }
        })
        .sum()
}

/// The metric families `file` may hold (what `super` writes into it); none for another name.
pub fn families(file: &str) -> &'static [Family] {
    match file {
        TRANSACTIONS_FILE => TRANSACTIONS_FAMILIES,
        HUB_FILE => HUB_FAMILIES,
        RESTORE_TEST_FILE => RESTORE_TEST_FAMILIES,
        COVERAGE_FILE => COVERAGE_FAMILIES,
        _ => &[],
    }
}

/// Read `name` from the agent's folder `dir` as the module docs say: `Ok(None)` when it is not
/// there.
pub fn read_source(dir: &File, name: &str, owners: &[u32]) -> Result<Option<String>, String> {
    let fd = match crate::nofollow::file(dir.as_fd(), name) {
        Ok(fd) => fd,
        Err(nix::errno::Errno::ENOENT) => return Ok(None),
        Err(nix::errno::Errno::ELOOP) => return Err("it is a symbolic link".to_string()),
        Err(e) => return Err(format!("cannot open it: {e}")),
    };
    let st = fstat(&fd).map_err(|e| format!("cannot inspect it: {e}"))?;
    if SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) != SFlag::S_IFREG {
        return Err("it is not a regular file (a FIFO, socket or device?)".to_string());
    }
    if !owners.contains(&st.st_uid) {
        return Err(format!(
            "it belongs to uid {}, not to root or the agent's user",
            st.st_uid
        ));
    }
    let size = u64::try_from(st.st_size).unwrap_or(u64::MAX);
    if size > MAX_FILE_BYTES {
        return Err(format!("it holds {size} bytes, more than {MAX_FILE_BYTES}"));
    }
    let mut bytes = Vec::new();
    File::from(fd)
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read it: {e}"))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!("it grew past {MAX_FILE_BYTES} bytes while read"));
    }
    let text = String::from_utf8(bytes).map_err(|_| "it is not UTF-8".to_string())?;
    validate(name, &text)?;
    Ok(Some(text))
}

/// The family of sample name `name` in `fams` and the label keys its samples carry.
fn sample_family(fams: &[Family], name: &str) -> Option<(Family, Vec<&'static str>)> {
    for f in fams {
        if f.name == name && f.kind != "histogram" {
            return Some((*f, f.labels.to_vec()));
        }
        if f.kind == "histogram" {
            if let Some(suffix) = name.strip_prefix(f.name) {
                match suffix {
                    "_bucket" => {
                        let mut keys = f.labels.to_vec();
                        keys.push("le");
                        return Some((*f, keys));
                    }
                    "_sum" | "_count" => return Some((*f, f.labels.to_vec())),
                    _ => {}
                }
            }
        }
    }
    None
}

fn label_name_ok(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A sample's labels, as parsed: (key, unescaped value) in their order.
type Labels = Vec<(String, String)>;

/// Parse a label set `{k="v",...}` at the start of `s`: the pairs and the rest after `}`.
fn parse_labels(s: &str) -> Result<(Labels, &str), String> {
    let mut rest = s
        .strip_prefix('{')
        .ok_or_else(|| "has no label set".to_string())?;
    let mut pairs = Vec::new();
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            return Ok((pairs, after));
        }
        let eq = rest
            .find('=')
            .ok_or_else(|| "has a label without a value".to_string())?;
        let key = &rest[..eq];
        if !label_name_ok(key) {
            return Err(format!("has a label name that is not one: {key:?}"));
        }
        let mut chars = rest[eq + 1..].char_indices();
        if chars.next().map(|(_, c)| c) != Some('"') {
            return Err(format!("has label {key} without a quoted value"));
        }
        let mut value = String::new();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '"' => {
                    end = Some(eq + 1 + i + 1);
                    break;
                }
                '\\' => match chars.next().map(|(_, c)| c) {
                    Some('\\') => value.push('\\'),
                    Some('"') => value.push('"'),
                    Some('n') => value.push('\n'),
                    _ => return Err(format!("has a bad escape in label {key}")),
                },
                '\n' => return Err(format!("has a line break in label {key}")),
                c => value.push(c),
            }
        }
        let end = end.ok_or_else(|| format!("has an unclosed value of label {key}"))?;
        pairs.push((key.to_string(), value));
        rest = &rest[end..];
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        } else if !rest.starts_with('}') {
            return Err("has labels not separated by commas".to_string());
        }
    }
}

/// Whether `text` is what the agent writes into `file` (see the module docs). `Err`: the
/// first line that is not (1-based), or the count of samples over [`max_samples`].
pub fn validate(file: &str, text: &str) -> Result<(), String> {
    let fams = families(file);
    let max = max_samples(file);
    let mut series = std::collections::HashSet::new();
    for (i, line) in text.lines().enumerate() {
        let bad = |why: &str| Err(format!("line {} {why}", i + 1));
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or("");
            if !fams.iter().any(|f| f.name == name) {
                return bad("is a HELP line for a metric the agent does not write here");
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut f = rest.split(' ');
            let (name, kind) = (f.next().unwrap_or(""), f.next().unwrap_or(""));
            if !fams.iter().any(|x| x.name == name && x.kind == kind) || f.next().is_some() {
                return bad("is not a TYPE line of a metric the agent writes here");
            }
            continue;
        }
        if line.starts_with('#') {
            return bad("is a comment the agent does not write");
        }
        let (name, after) = match line.find(['{', ' ']) {
            Some(at) => line.split_at(at),
            None => return bad("has no value"),
        };
        let Some((family, keys)) = sample_family(fams, name) else {
            return bad("is not a sample of a metric the agent writes here");
        };
        let (labels, value_part) = if after.starts_with('{') {
            match parse_labels(after) {
                Ok(x) => x,
                Err(why) => return bad(&why),
            }
        } else {
            (Vec::new(), after)
        };
        for (k, v) in &labels {
            if k.starts_with("__") {
                return bad(&format!("has the reserved label {k}"));
            }
            if !keys.contains(&k.as_str()) {
                return bad(&format!("has label {k}, which the agent does not write"));
            }
            if v.is_empty() || v.len() > MAX_LABEL_VALUE || !label_value_ok(family.name, k, v) {
                return bad(&format!(
                    "has a value of label {k} the agent does not write"
                ));
            }
        }
        let mut got: Vec<&str> = labels.iter().map(|(k, _)| k.as_str()).collect();
        got.sort_unstable();
        let before = got.len();
        got.dedup();
        if got.len() != before {
            return bad("has a label twice");
        }
        let mut want = keys.clone();
        want.sort_unstable();
        if got != want {
            return bad(&format!(
                "does not have exactly the labels {}",
                keys.join(",")
            ));
        }
        if !value_part.starts_with(' ') {
            return bad("has no space before its value");
        }
        let fields: Vec<&str> = value_part.split_whitespace().collect();
        match fields.as_slice() {
            [v] if v.parse::<f64>().is_ok() || matches!(*v, "+Inf" | "-Inf" | "NaN") => {}
            [_] => return bad("has a value that is not a number"),
            [] => return bad("has no value"),
            _ => return bad("has a timestamp or more after its value"),
        }
        let mut key: Labels = labels;
        key.sort();
        if !series.insert((name.to_string(), key)) {
            return bad("repeats a series");
        }
        if series.len() > max {
            return Err(format!("it holds more than {max} samples"));
        }
    }
    Ok(())
}

/// Remove the published copies of [`FILES`] from node_exporter's folder `to` (each name
/// `unlinkat` in the folder opened without following links). Returns what could not be
/// removed.
pub fn remove_published(to: &Path) -> Vec<String> {
    let dst = match super::textfile::open_dir(to) {
        Ok(d) => d,
        Err(e) => return vec![e.to_string()],
    };
    let mut failed = Vec::new();
    for name in FILES {
        match nix::unistd::unlinkat(&dst, name, nix::unistd::UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => failed.push(format!("{}: {e}", to.join(name).display())),
        }
    }
    failed
}

/// Publish [`FILES`] from the agent's folder `from` into node_exporter's folder `to`: each
/// name copied, absent or refused (see the module docs). `Err` when a folder cannot be opened
/// as the agent's writer requires; a refused agent folder also removes the published copies.
pub fn publish(
    from: &Path,
    to: &Path,
    owners: &[u32],
) -> Result<Vec<(&'static str, Published)>, String> {
    let src = match super::textfile::open_dir(from) {
        Ok(s) => s,
        Err(e) => {
            let left = remove_published(to);
            write_status(to, &[]);
            return Err(if left.is_empty() {
                format!(
                    "{e}; the published copies were removed from {}",
                    to.display()
                )
            } else {
                format!(
                    "{e}; removing the published copies failed: {}",
                    left.join("; ")
                )
            });
        }
    };
    let dst = super::textfile::open_dir(to).map_err(|e| match e {
        super::textfile::TextfileError::OpenDir { source, .. } => format!(
            "cannot open node_exporter's textfile folder {} (--to): {source}; create it \
             (`install -d -m 0755 {}`; prometheus-node-exporter's package makes it) or fix --to \
             in felhom-agent-metrics.service",
            to.display(),
            to.display()
        ),
        other => format!(
            "node_exporter's textfile folder {} (--to): {other}",
            to.display()
        ),
    })?;
    let mut out = Vec::new();
    for name in FILES {
        let verdict = match read_source(&src, name, owners) {
            Ok(Some(text)) => match super::textfile::write(to, name, &text) {
                Ok(()) => Published::Copied,
                Err(e) => Published::Refused(format!("cannot write it into {}: {e}", to.display())),
            },
            Ok(None) => Published::Absent,
            Err(why) => Published::Refused(why),
        };
        if verdict != Published::Copied {
            match nix::unistd::unlinkat(&dst, name, nix::unistd::UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
                Err(e) => {
                    tracing::warn!(file = name, dir = %to.display(), "cannot remove the published copy: {e}");
                }
            }
        }
        out.push((name, verdict));
    }
    let copied: Vec<&str> = out
        .iter()
        .filter(|(_, v)| *v == Published::Copied)
        .map(|(n, _)| *n)
        .collect();
    write_status(to, &copied);
    Ok(out)
}

/// Publish now, then at every change of the agent's folder `from` (changes within [`DEBOUNCE`]
/// count as one) until it has been still for `idle`; `each` gets every pass's result. The
/// inotify watch is set before the first pass (see the module docs). Returns the passes made,
/// or the first `Err` of [`publish`] (the folder is refused: stop, systemd starts a new
/// publisher at the next change).
pub fn follow(
    from: &Path,
    to: &Path,
    owners: &[u32],
    idle: std::time::Duration,
    mut each: impl FnMut(&[(&'static str, Published)]),
) -> Result<u64, String> {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
        .map_err(|e| format!("cannot watch {}: inotify: {e}", from.display()))?;
    let flags = AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
        | AddWatchFlags::IN_DONT_FOLLOW;
    if let Err(e) = inotify.add_watch(from, flags) {
        // Not a folder, a link, missing: publish says so (and removes the copies).
        publish(from, to, owners)?;
        return Err(format!("cannot watch {}: {e}", from.display()));
    }
    let mut passes = 1u64;
    each(&publish(from, to, owners)?);
    let mut still = std::time::Duration::ZERO;
    loop {
        std::thread::sleep(DEBOUNCE);
        match inotify.read_events() {
            Ok(events) if !events.is_empty() => {
                // Gather what follows at once (a write is a create, a write and a rename).
                std::thread::sleep(DEBOUNCE);
                let _ = inotify.read_events();
                still = std::time::Duration::ZERO;
                passes += 1;
                each(&publish(from, to, owners)?);
            }
            Ok(_) | Err(nix::errno::Errno::EAGAIN) => {
                still += DEBOUNCE;
                if still >= idle {
                    return Ok(passes);
                }
            }
            Err(e) => return Err(format!("cannot watch {}: {e}", from.display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_the_agent_writes_passes() {
        let ok =
            "# HELP felhom_hub_connected 1 while connected\n# TYPE felhom_hub_connected gauge\n\
                  felhom_hub_connected 1\nfelhom_outbox_depth 3\n\n";
        assert_eq!(validate(HUB_FILE, ok), Ok(()));
        let tx = "# TYPE felhom_phase_duration_seconds histogram\n\
                  felhom_phase_duration_seconds_bucket{kind=\"provision\",phase=\"submitted\",le=\"+Inf\"} 3\n\
                  felhom_phase_duration_seconds_bucket{le=\"0.5\",phase=\"submitted\",kind=\"provision\"} 3\n\
                  felhom_phase_duration_seconds_sum{kind=\"provision\",phase=\"submitted\"} 40.3\n\
                  felhom_transactions_total{kind=\"destroy\",outcome=\"ok\"} 0\nfelhom_needs_human NaN\n";
        assert_eq!(validate(TRANSACTIONS_FILE, tx), Ok(()));
        for bad in [
            "node_load1 3\n",
            "felhom_hub_connected 1 1700000000000\n",
            "felhom_hub_connected abc\n",
            "felhom_hub_connected\n",
            "# HELP node_x y\n",
            "# TYPE felhom_hub_connected counter\n",
            "# a comment\n",
            // Another file's metric, and a felhom_ name the agent does not write.
            "felhom_needs_human 1\n",
            "felhom_x 1\n",
        ] {
            assert!(validate(HUB_FILE, bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn label_sets_are_parsed_and_only_the_agents_own_keys_pass() {
        let line = |labels: &str| format!("felhom_transactions_total{labels} 1\n");
        for bad in [
            // __name__, another key, a key too many or too few, a key twice.
            r#"{__name__="felhom_transactions_total",kind="a",outcome="ok"}"#,
            r#"{kind="a",outcome="ok",instance="node9"}"#,
            r#"{kind="a"}"#,
            r#"{kind="a",kind="b",outcome="ok"}"#,
            // Broken label sets.
            r#"{kind="a",outcome="ok""#,
            r#"{kind="a" outcome="ok"}"#,
            r#"{kind=a,outcome="ok"}"#,
            r#"{kind="a\q",outcome="ok"}"#,
            r#"{kind="a",outcome="ok"}1"#,
            r#"{kind="a } b",outcome="ok"}"#,
            r#"{1kind="a",outcome="ok"}"#,
            r#"{kind="",outcome="ok"}"#,
        ] {
            assert!(
                validate(TRANSACTIONS_FILE, &line(bad)).is_err(),
                "{bad} passed"
            );
        }
        for kind in ["restore-test", "selftest-restore"] {
            assert_eq!(
                validate(
                    TRANSACTIONS_FILE,
                    &line(&format!(r#"{{outcome="ok",kind="{kind}"}}"#))
                ),
                Ok(()),
                "{kind}"
            );
        }
        // The same series twice.
        let twice = format!("{0}{0}", line(r#"{kind="provision",outcome="ok"}"#));
        assert!(validate(TRANSACTIONS_FILE, &twice)
            .unwrap_err()
            .contains("repeats"));
    }

    #[test]
    fn label_values_are_the_agents_own_so_the_series_are_bounded() {
        // Made-up values of every labelled family are refused, each on its first line.
        for (file, line) in [
            (
                TRANSACTIONS_FILE,
                "felhom_transactions_total{kind=\"k1\",outcome=\"ok\"} 1",
            ),
            (
                TRANSACTIONS_FILE,
                "felhom_transactions_total{kind=\"provision\",outcome=\"interrupted\"} 1",
            ),
            (
                TRANSACTIONS_FILE,
                "felhom_phase_duration_seconds_count{kind=\"provision\",phase=\"p7\"} 1",
            ),
            (
                TRANSACTIONS_FILE,
                "felhom_phase_duration_seconds_bucket{kind=\"provision\",phase=\"created\",le=\"7\"} 1",
            ),
            (
                RESTORE_TEST_FILE,
                "felhom_restore_test_outcome{outcome=\"made_up\"} 1",
            ),
            // A coverage status is no check status.
            (
                RESTORE_TEST_FILE,
                "felhom_restore_test_checks{status=\"proven\"} 1",
            ),
        ] {
            let err = validate(file, &format!("{line}\n")).unwrap_err();
            assert!(err.contains("line 1") && err.contains("label"), "{line}: {err}");
        }
        for (file, line) in [
            (
                RESTORE_TEST_FILE,
                "felhom_restore_test_outcome{outcome=\"error\"} 1",
            ),
            (
                RESTORE_TEST_FILE,
                "felhom_restore_test_checks{status=\"skipped\"} 1",
            ),
            (
                TRANSACTIONS_FILE,
                "felhom_phase_duration_seconds_bucket{kind=\"destroy\",phase=\"needs_human\",le=\"0.1\"} 1",
            ),
        ] {
            assert_eq!(validate(file, &format!("{line}\n")), Ok(()), "{line}");
        }
        // What the agent can write fits under the second bound.
        for f in FILES {
            assert!(most_series(f) <= max_samples(f), "{f}: {}", most_series(f));
        }
        assert_eq!(most_series(COVERAGE_FILE), 11 * MAX_COVERAGE_GUESTS + 7);
        assert!(most_series(TRANSACTIONS_FILE) > 800);
    }

    #[test]
    fn coverage_labels_are_vmids_statuses_and_names() {
        for bad in [
            // vmids outside PVE's range or not as PVE writes them.
            "felhom_backup_stale{vmid=\"99\"} 1",
            "felhom_backup_stale{vmid=\"0100\"} 1",
            "felhom_backup_stale{vmid=\"1000000000\"} 1",
            "felhom_backup_stale{vmid=\"web\"} 1",
            "felhom_backup_status{vmid=\"100\",status=\"fine\"} 1",
            "felhom_backup_guests{status=\"ok\"} 1",
            // A name on another family, a control character in one, a name too long.
            "felhom_backup_stale{vmid=\"100\",name=\"x\"} 1",
            "felhom_guest_info{vmid=\"100\",name=\"a\rb\"} 1",
            "felhom_guest_info{vmid=\"100\",name=\"a\u{1b}b\"} 1",
            "felhom_guest_info{vmid=\"100\",name=\"\"} 1",
        ] {
            let err = validate(COVERAGE_FILE, &format!("{bad}\n")).unwrap_err();
            assert!(err.contains("line 1"), "{bad}: {err}");
        }
        let long = format!(
            "felhom_guest_info{{vmid=\"100\",name=\"{}\"}} 1\n",
            "n".repeat(65)
        );
        assert!(validate(COVERAGE_FILE, &long).is_err());
        // Another file's metric, and a coverage metric in another file.
        assert!(validate(COVERAGE_FILE, "felhom_needs_human 1\n").is_err());
        assert!(validate(RESTORE_TEST_FILE, "felhom_backup_guests_stale 1\n").is_err());
        for good in [
            "felhom_backup_stale{vmid=\"999999999\"} 1".to_string(),
            "felhom_backup_status{status=\"no_backup\",vmid=\"100\"} 1".to_string(),
            format!(
                "felhom_guest_info{{vmid=\"100\",name=\"{}\\\"\\n\\\\\"}} 1",
                "é".repeat(30)
            ),
        ] {
            assert_eq!(
                validate(COVERAGE_FILE, &format!("{good}\n")),
                Ok(()),
                "{good}"
            );
        }
    }

    #[test]
    fn the_largest_coverage_the_agent_writes_is_published_and_one_guest_more_is_not() {
        let name = "\"".repeat(200);
        let rows: Vec<super::super::CoverageRow<'_>> = (0..=MAX_COVERAGE_GUESTS as u32)
            .map(|i| super::super::CoverageRow {
                vmid: 999_000_000 + i,
                name: &name,
                status: "overdue",
                stale: true,
                proven_backup_time: Some(1),
                newest_backup_time: Some(2),
            })
            .collect();
        let most = super::super::coverage_text(&rows[..MAX_COVERAGE_GUESTS], 1_999_999_999);
        assert!(
            most.len() as u64 <= MAX_FILE_BYTES,
            "{} bytes for {MAX_COVERAGE_GUESTS} guests",
            most.len()
        );
        assert_eq!(validate(COVERAGE_FILE, &most), Ok(()));
        let more = super::super::coverage_text(&rows, 1_999_999_999);
        assert!(validate(COVERAGE_FILE, &more)
            .unwrap_err()
            .contains("more than"));
    }

    #[test]
    fn the_status_names_each_file_once() {
        let t = status_text(&[HUB_FILE]);
        assert!(
            t.contains("felhom_metrics_published{file=\"felhom_hub.prom\"} 1\n"),
            "{t}"
        );
        assert!(
            t.contains("felhom_metrics_published{file=\"felhom_transactions.prom\"} 0\n"),
            "{t}"
        );
        assert_eq!(t.matches("felhom_metrics_published{").count(), FILES.len());
    }

    #[test]
    fn everything_the_agent_writes_passes() {
        use crate::provision::journal::{ArchiveTotals, PhaseDone, TxnTimings};
        use crate::provision::machine::{OutcomeKind, Phase, TxnKind};
        let timings: Vec<TxnTimings> = [TxnKind::Provision, TxnKind::SelftestRestore]
            .into_iter()
            .map(|kind| TxnTimings {
                txn: ulid::Ulid::new(),
                kind,
                started_at: "2026-01-01T00:00:00Z".into(),
                outcome: Some(OutcomeKind::NeedsHuman),
                needs_human: true,
                phases: vec![
                    PhaseDone {
                        phase: Phase::Submitted,
                        seconds: 0.3,
                    },
                    PhaseDone {
                        phase: Phase::Created,
                        seconds: 7.25,
                    },
                ],
            })
            .collect();
        let tx = super::super::transactions_text(&timings, &ArchiveTotals::default());
        assert!(tx.contains("_bucket{"), "{tx}");
        assert_eq!(validate(TRANSACTIONS_FILE, &tx), Ok(()));
        assert_eq!(
            validate(HUB_FILE, &super::super::hub_text(true, true, 7)),
            Ok(())
        );
        assert_eq!(
            validate(
                HUB_FILE,
                &(super::super::hub_text(false, false, 7) + &super::super::outbox_dropped_text(3))
            ),
            Ok(())
        );
        for outcome in super::super::RESTORE_TEST_OUTCOMES {
            let rt = super::super::restore_test_text(&super::super::RestoreTestFigures {
                outcome,
                duration_s: 1.0,
                now: 1,
                last_success: None,
                skipped_total: 0,
                runs_total: 1,
            });
            assert_eq!(validate(RESTORE_TEST_FILE, &rt), Ok(()), "{outcome}");
        }
        let rt = super::super::restore_test_text(&super::super::RestoreTestFigures {
            outcome: "needs_human",
            duration_s: 12.5,
            now: 1_700_000_000,
            last_success: None,
            skipped_total: 1,
            runs_total: 9,
        });
        assert_eq!(validate(RESTORE_TEST_FILE, &rt), Ok(()));
        let names = ["web", "", "a\"b\\c\nd\r\u{1b}", "\u{fffd}"];
        let rows: Vec<super::super::CoverageRow<'_>> = super::super::COVERAGE_STATUSES
            .iter()
            .enumerate()
            .map(|(i, status)| super::super::CoverageRow {
                vmid: 100 + i as u32,
                name: names[i % names.len()],
                status,
                stale: i % 2 == 1,
                proven_backup_time: (i % 3 != 0).then_some(5),
                newest_backup_time: (i % 4 != 0).then_some(7),
            })
            .collect();
        let cov = super::super::coverage_text(&rows, 1_700_000_000);
        assert_eq!(validate(COVERAGE_FILE, &cov), Ok(()));
        // The name, as the publisher reads it back, is the name clipped and cleaned.
        let line = cov
            .lines()
            .find(|l| l.starts_with("felhom_guest_info{vmid=\"102\""))
            .expect("info");
        let (labels, _) = parse_labels(&line["felhom_guest_info".len()..]).expect("labels");
        assert_eq!(
            labels[1],
            ("name".into(), "a\"b\\c\nd\u{fffd}\u{fffd}".into())
        );
    }
}
