//! What the outbox keeps while no `[hub]` is configured, and the count of what it dropped.
//!
//! With a hub, every report stays in the outbox until the hub acknowledges it (DESIGN rule 8).
//! Without one nothing ever takes them, so the `run` daemon keeps the newest [`KEEP_MESSAGES`]
//! reports, none stored longer ago than [`KEEP_AGE`], and drops the oldest first (in the order
//! they were stored). How many it dropped, and since when, is kept in
//! `<state_dir>/outbox/dropped` ([`DROPPED_FILE`]: one line of JSON, replaced whole and synced
//! after the drop itself is synced), so a restart does not forget it: `doctor` warns with it
//! and the daemon writes it as `felhom_outbox_dropped_total`. The hub protocol has no message
//! for it, so a hub configured later is not told; removing the file (once noted) clears the
//! warning and starts the count again from 0.
//!
//! It may use std, small crates and `crate::timefmt`: the daemon (`hub`) and
//! `doctor` both read it.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

/// The outbox folder inside the state dir.
pub const OUTBOX_DIR: &str = "outbox";
/// The most reports the outbox keeps while no hub is configured.
pub const KEEP_MESSAGES: usize = 1000;
/// The longest a report stays in the outbox while no hub is configured.
pub const KEEP_AGE: Duration = Duration::from_secs(30 * 86_400);
/// The count of dropped reports, in the outbox folder.
pub const DROPPED_FILE: &str = "dropped";
/// The largest [`DROPPED_FILE`] read.
pub const MAX_DROPPED_FILE_BYTES: u64 = 4096;

/// What the outbox keeps: at most `max_messages` reports, none stored longer ago than
/// `max_age`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// The most reports kept.
    pub max_messages: usize,
    /// The longest one is kept.
    pub max_age: Duration,
}

impl Retention {
    /// While no hub is configured: [`KEEP_MESSAGES`], [`KEEP_AGE`].
    pub const WITHOUT_HUB: Retention = Retention {
        max_messages: KEEP_MESSAGES,
        max_age: KEEP_AGE,
    };

    /// `the newest 1000 reports, none older than 30 days`.
    pub fn describe(&self) -> String {
        let secs = self.max_age.as_secs();
        let age = if secs.is_multiple_of(86_400) {
            format!("{} days", secs / 86_400)
        } else {
            format!("{secs} s")
        };
        format!(
            "the newest {} reports, none older than {age}",
            self.max_messages
        )
    }
}

/// How many reports were dropped, since when (RFC 3339, the first drop counted) and the last
/// drop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dropped {
    /// Reports dropped.
    pub count: u64,
    /// When the first of them was dropped.
    pub since: String,
    /// When the last were dropped.
    pub last: String,
}

/// `<state_dir>/outbox/dropped`.
pub fn dropped_path(state_dir: &Path) -> PathBuf {
    state_dir.join(OUTBOX_DIR).join(DROPPED_FILE)
}

/// The count in `<outbox_dir>/dropped`: `None` when there is no such file (nothing dropped, or
/// the count was cleared). A file that is a link, too large or not the agent's JSON is an
/// error naming it.
pub fn read(outbox_dir: &Path) -> Result<Option<Dropped>, String> {
    let path = outbox_dir.join(DROPPED_FILE);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(&path);
    let file = match file {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let mut text = String::new();
    file.take(MAX_DROPPED_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let bad = |why: String| {
        format!(
            "{} is not the outbox's count of dropped reports ({why}); remove it (the count \
             starts again from 0)",
            path.display()
        )
    };
    if text.len() as u64 > MAX_DROPPED_FILE_BYTES {
        return Err(bad(format!("over {MAX_DROPPED_FILE_BYTES} bytes")));
    }
    let dropped: Dropped = serde_json::from_str(text.trim_end()).map_err(|e| bad(e.to_string()))?;
    for t in [&dropped.since, &dropped.last] {
        OffsetDateTime::parse(t, &Rfc3339)
            .map_err(|_| bad(format!("{t:?} is no RFC 3339 time")))?;
    }
    Ok(Some(dropped))
}

/// Add `n` dropped reports at `now` to `before` and store the new count in
/// `<outbox_dir>/dropped` (written beside, synced, renamed into place, the folder synced).
pub fn add(
    outbox_dir: &Path,
    before: Option<&Dropped>,
    n: u64,
    now: OffsetDateTime,
) -> io::Result<Dropped> {
    let at = crate::timefmt::rfc3339(now);
    let dropped = match before {
        Some(d) => Dropped {
            count: d.count.saturating_add(n),
            since: d.since.clone(),
            last: at,
        },
        None => Dropped {
            count: n,
            since: at.clone(),
            last: at,
        },
    };
    let line = serde_json::to_string(&dropped).map_err(io::Error::other)? + "\n";
    let tmp = outbox_dir.join(format!("{DROPPED_FILE}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)?;
    file.write_all(line.as_bytes())?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, outbox_dir.join(DROPPED_FILE))?;
    File::open(outbox_dir)?.sync_all()?;
    Ok(dropped)
}

/// `doctor`'s warning for reports dropped (`hub_configured`: a `[hub]` is configured now).
pub fn warning(dropped: &Dropped, path: &Path, hub_configured: bool) -> String {
    let keep = Retention::WITHOUT_HUB.describe();
    let now = if hub_configured {
        "A [hub] is configured now and every new report waits for it, but the hub was not told \
         of the dropped ones (the protocol has no message for it)"
            .to_string()
    } else {
        "Configure [hub] (url, token_file) so reports reach a hub and none is dropped".to_string()
    };
    format!(
        "{} reports were dropped from the outbox since {} (the last at {}): without a [hub] it \
         keeps {keep}, and nothing will ever receive the dropped ones. {now}; once noted, \
         remove {} to clear this warning (felhom_outbox_dropped_total starts again from 0)",
        dropped.count,
        dropped.since,
        dropped.last,
        path.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_adds_up_keeps_its_start_and_is_read_back() {
        let dir = tempfile::tempdir().expect("tmp");
        assert_eq!(read(dir.path()).expect("read"), None);
        let t1 = OffsetDateTime::from_unix_timestamp(1_767_225_600).expect("t1");
        let t2 = OffsetDateTime::from_unix_timestamp(1_767_312_000).expect("t2");
        let first = add(dir.path(), None, 3, t1).expect("add");
        let second = add(dir.path(), Some(&first), 4, t2).expect("add");
        assert_eq!(
            second,
            Dropped {
                count: 7,
                since: "2026-01-01T00:00:00Z".to_string(),
                last: "2026-01-02T00:00:00Z".to_string(),
            }
        );
        assert_eq!(read(dir.path()).expect("read"), Some(second));
        assert!(!dir.path().join("dropped.tmp").exists());
    }

    #[test]
    fn a_damaged_or_oversized_count_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().expect("tmp");
        std::fs::write(dir.path().join(DROPPED_FILE), "{\"count\":1}").expect("write");
        let err = read(dir.path()).unwrap_err();
        assert!(
            err.contains("/dropped") && err.contains("remove it"),
            "{err}"
        );
        std::fs::write(
            dir.path().join(DROPPED_FILE),
            " ".repeat(MAX_DROPPED_FILE_BYTES as usize + 10),
        )
        .expect("write");
        assert!(read(dir.path()).unwrap_err().contains("over 4096 bytes"));
    }

    #[test]
    fn the_warning_names_count_start_bounds_and_what_to_do() {
        let d = Dropped {
            count: 12,
            since: "2026-01-01T00:00:00Z".to_string(),
            last: "2026-01-02T00:00:00Z".to_string(),
        };
        let path = Path::new("/var/lib/felhom-agent/outbox/dropped");
        let w = warning(&d, path, false);
        for want in [
            "12 reports were dropped",
            "since 2026-01-01T00:00:00Z",
            "the newest 1000 reports, none older than 30 days",
            "Configure [hub]",
            "remove /var/lib/felhom-agent/outbox/dropped",
        ] {
            assert!(w.contains(want), "{want:?} not in {w}");
        }
        assert!(warning(&d, path, true).contains("the hub was not told"));
    }
}
