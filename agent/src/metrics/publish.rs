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
//! agent's folder changes) does, for each of the three known names only: open it in the agent's
//! folder (opened `O_DIRECTORY|O_NOFOLLOW`) with `O_NOFOLLOW|O_NONBLOCK` (a link is refused, a
//! FIFO never blocks), require a regular file of root or the agent's user of at most
//! [`MAX_FILE_BYTES`], read it, and require the text to be what the agent writes: `# HELP` /
//! `# TYPE` lines and samples of `felhom_` metrics without timestamps. What passes is written
//! into node_exporter's folder the way the agent writes (random exclusive temporary name,
//! `renameat`, [`super::textfile::write`]); a name whose source is missing or refused is
//! removed there (`unlinkat`), so node_exporter gets nothing rather than something else, and
//! no file at all until the agent wrote one (no scrape error on a fresh install).

use std::fs::File;
use std::io::Read;
use std::os::fd::AsFd;
use std::path::Path;

use nix::fcntl::{openat, OFlag};
use nix::sys::stat::{fstat, Mode, SFlag};

use super::{HUB_FILE, RESTORE_TEST_FILE, TRANSACTIONS_FILE};

/// The files published, by name; nothing else in the agent's folder is looked at.
pub const FILES: [&str; 3] = [TRANSACTIONS_FILE, HUB_FILE, RESTORE_TEST_FILE];
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

/// Read `name` from the agent's folder `dir` as the module docs say: `Ok(None)` when it is not
/// there.
pub fn read_source(dir: &File, name: &str, owners: &[u32]) -> Result<Option<String>, String> {
    let fd = match openat(
        dir.as_fd(),
        name,
        OFlag::O_RDONLY
            | OFlag::O_NOFOLLOW
            | OFlag::O_NONBLOCK
            | OFlag::O_NOCTTY
            | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
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
    validate(&text)?;
    Ok(Some(text))
}

fn metric_name_ok(name: &str) -> bool {
    name.starts_with("felhom_")
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Whether `text` is what the agent writes: `# HELP felhom_…` and `# TYPE felhom_… <type>`
/// lines, and samples `felhom_…[{labels}] <value>` without a timestamp. `Err`: the first line
/// that is not (1-based).
pub fn validate(text: &str) -> Result<(), String> {
    for (i, line) in text.lines().enumerate() {
        let bad = |why: &str| Err(format!("line {} {why}", i + 1));
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or("");
            if !metric_name_ok(name) {
                return bad("is a HELP line for another metric");
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut f = rest.split(' ');
            let (name, kind) = (f.next().unwrap_or(""), f.next().unwrap_or(""));
            if !metric_name_ok(name)
                || !matches!(
                    kind,
                    "counter" | "gauge" | "histogram" | "summary" | "untyped"
                )
                || f.next().is_some()
            {
                return bad("is not a TYPE line of a felhom_ metric");
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
        if !metric_name_ok(name) {
            return bad("is not a sample of a felhom_ metric");
        }
        let value_part = if after.starts_with('{') {
            match after.rfind('}') {
                Some(end) => &after[end + 1..],
                None => return bad("has unclosed labels"),
            }
        } else {
            after
        };
        let fields: Vec<&str> = value_part.split_whitespace().collect();
        match fields.as_slice() {
            [v] if v.parse::<f64>().is_ok() || matches!(*v, "+Inf" | "-Inf" | "NaN") => {}
            [_] => return bad("has a value that is not a number"),
            [] => return bad("has no value"),
            _ => return bad("has a timestamp or more after its value"),
        }
    }
    Ok(())
}

/// Publish [`FILES`] from the agent's folder `from` into node_exporter's folder `to`: each
/// name copied, absent or refused (see the module docs). `Err` when a folder cannot be opened
/// as the agent's writer requires.
pub fn publish(
    from: &Path,
    to: &Path,
    owners: &[u32],
) -> Result<Vec<(&'static str, Published)>, String> {
    let src = super::textfile::open_dir(from).map_err(|e| e.to_string())?;
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
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_the_agent_writes_passes() {
        let ok = "# HELP felhom_hub_connected 1 while connected\n# TYPE felhom_hub_connected gauge\n\
                  felhom_hub_connected 1\nfelhom_phase_duration_seconds_bucket{kind=\"a\",le=\"+Inf\"} 3\n\
                  felhom_x{l=\"a } b\"} NaN\n\n";
        assert_eq!(validate(ok), Ok(()));
        for bad in [
            "node_load1 3\n",
            "felhom_x 1 1700000000000\n",
            "felhom_x abc\n",
            "felhom_x\n",
            "# HELP node_x y\n",
            "# TYPE felhom_x weird\n",
            "# a comment\n",
            "felhom_x{a=\"b\" 1\n",
        ] {
            assert!(validate(bad).is_err(), "{bad:?}");
        }
    }
}
