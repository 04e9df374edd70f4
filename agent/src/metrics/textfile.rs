//! The safe write of one file into the metrics folder (`[metrics] dir`).
//!
//! The package's folder is the agent's own (`/var/lib/felhom-agent-metrics`); root copies the
//! files, checked, into node_exporter's textfile folder ([`super::publish`], which writes there
//! with this same writer). An operator may point
//! `[metrics] dir` elsewhere, where others may put anything at any name at any time, including
//! a symlink to a file only root may write; a command-line run may be root. So no name in the
//! folder is trusted:
//!
//! 1. the folder is opened once with `O_DIRECTORY|O_NOFOLLOW` (a symlink in its place is
//!    refused) and every later step goes through that descriptor (`openat`, `renameat`);
//! 2. it must be a directory that is not writable by everyone without the sticky bit (then any
//!    local user could swap the files: refused). Its owner may be anyone (root, the agent's
//!    user or `prometheus`): no step below depends on the owner's good will;
//! 3. the new content goes to a temporary name with 128 random bits
//!    (`.<name>.<random>.tmp`, ignored by node_exporter, which reads only `*.prom`), created
//!    with `O_CREAT|O_EXCL|O_NOFOLLOW` and mode 0644: an existing name or a symlink there makes
//!    the create fail instead of being followed;
//! 4. it is written and mode-fixed through that descriptor (`fchmod`, never `chmod` by path,
//!    never `chown`), fsynced, then `renameat` over the final name: a symlink at the final name
//!    is replaced as a name, its target is never opened; the folder is fsynced;
//! 5. on any failure the temporary name is removed (`unlinkat`, which never follows a link);
//!    after a success, temporary names of the same file older than [`STALE_TMP`] (left by a
//!    process killed mid-write) are removed the same way.
//!
//! The folder is never created: the package's tmpfiles snippet creates it (the write fails
//! with a message saying so when it is missing).

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{openat, renameat, OFlag};
use nix::sys::stat::{fchmod, Mode};
use nix::unistd::{unlinkat, UnlinkatFlags};

/// Age after which a temporary name of ours is a leftover of a killed writer.
pub const STALE_TMP: std::time::Duration = std::time::Duration::from_secs(600);

/// Why a metrics file was not written. Every message names the folder or file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum TextfileError {
    /// The folder cannot be opened (missing, not a folder, a symlink, no permission).
    #[error(
        "cannot open the metrics folder {dir}: {source}; it must be a real folder (not a \
         symlink), made by the package (/var/lib/felhom-agent-metrics, owned by felhom-agent); \
         check [metrics] dir in the config"
    )]
    OpenDir {
        /// The folder.
        dir: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The folder is writable by everyone without the sticky bit.
    #[error(
        "the metrics folder {dir} is writable by every user (mode {mode:o}) without the sticky \
         bit; nothing was written: `chmod o-w {dir}`"
    )]
    Unsafe {
        /// The folder.
        dir: PathBuf,
        /// Its mode bits.
        mode: u32,
    },
    /// The name is not a plain `*.prom` file name.
    #[error("{name:?} is not a plain *.prom file name; nothing was written")]
    BadName {
        /// The name.
        name: String,
    },
    /// Creating, writing, syncing or renaming failed.
    #[error(
        "cannot write the metrics file {path}: {source}; check the folder's disk and \
         permissions (the previous file, if any, is unchanged)"
    )]
    Write {
        /// The final path.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

/// Open the folder as the agent writes into it, with the checks of step 1 and 2; also what
/// `doctor` checks.
pub fn open_dir(dir: &Path) -> Result<File, TextfileError> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_flags(
            OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        ))
        .open(dir)
        .map_err(|source| TextfileError::OpenDir {
            dir: dir.to_path_buf(),
            source,
        })?;
    let meta = f.metadata().map_err(|source| TextfileError::OpenDir {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o002 != 0 && mode & 0o1000 == 0 {
        return Err(TextfileError::Unsafe {
            dir: dir.to_path_buf(),
            mode,
        });
    }
    Ok(f)
}

fn libc_flags(f: OFlag) -> i32 {
    f.bits()
}

/// Whether `name` is a plain `*.prom` file name.
fn plain_prom_name(name: &str) -> bool {
    name.ends_with(".prom")
        && name.len() > ".prom".len()
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

/// Write `text` as `<dir>/<name>` (see the module docs for how).
pub fn write(dir: &Path, name: &str, text: &str) -> Result<(), TextfileError> {
    if !plain_prom_name(name) {
        return Err(TextfileError::BadName {
            name: name.to_string(),
        });
    }
    let dirf = open_dir(dir)?;
    let path = dir.join(name);
    let werr = |source: io::Error| TextfileError::Write {
        path: path.clone(),
        source,
    };
    let mut last_err = None;
    for _ in 0..4 {
        let tmp = format!(".{name}.{:032x}.tmp", rand::random::<u128>());
        let fd = match openat(
            &dirf,
            tmp.as_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o644),
        ) {
            Ok(fd) => fd,
            Err(nix::errno::Errno::EEXIST) => {
                last_err = Some(io::Error::from(io::ErrorKind::AlreadyExists));
                continue;
            }
            Err(e) => return Err(werr(e.into())),
        };
        let mut file = File::from(fd);
        let done = (|| -> io::Result<()> {
            file.write_all(text.as_bytes())?;
            // The umask may have narrowed the mode at creation; node_exporter reads the file
            // as another user. Through the descriptor, never by path.
            fchmod(&file, Mode::from_bits_truncate(0o644)).map_err(io::Error::from)?;
            file.sync_all()?;
            renameat(&dirf, tmp.as_str(), &dirf, name).map_err(io::Error::from)?;
            Ok(())
        })();
        if let Err(e) = done {
            let _ = unlinkat(&dirf, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
            return Err(werr(e));
        }
        nix::unistd::fsync(&dirf).map_err(|e| werr(e.into()))?;
        remove_stale(&dirf, name, &tmp);
        return Ok(());
    }
    Err(werr(last_err.unwrap_or_else(|| {
        io::Error::other("no free temporary name")
    })))
}

/// Remove `.<name>.<32 hex>.tmp` entries of the folder older than [`STALE_TMP`], except
/// `keep`. Names are listed through the folder's descriptor, looked at without following and
/// removed with `unlinkat`; any error just leaves the entry.
fn remove_stale(dirf: &File, name: &str, keep: &str) {
    use nix::fcntl::AtFlags;
    use std::os::fd::AsRawFd;
    let prefix = format!(".{name}.");
    let Ok(entries) = std::fs::read_dir(format!("/proc/self/fd/{}", dirf.as_raw_fd())) else {
        return;
    };
    let now = std::time::SystemTime::now();
    for entry in entries.flatten() {
        let Some(n) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let ours = n
            .strip_prefix(&prefix)
            .and_then(|r| r.strip_suffix(".tmp"))
            .is_some_and(|hex| hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()));
        if !ours || n == keep {
            continue;
        }
        let Ok(st) = nix::sys::stat::fstatat(dirf, n.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) else {
            continue;
        };
        let mtime = std::time::UNIX_EPOCH
            + std::time::Duration::from_secs(u64::try_from(st.st_mtime).unwrap_or(0));
        if now.duration_since(mtime).is_ok_and(|age| age > STALE_TMP) {
            let _ = unlinkat(dirf, n.as_str(), UnlinkatFlags::NoRemoveDir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn names_must_be_plain_prom_files() {
        assert!(plain_prom_name("felhom_hub.prom"));
        for bad in [
            "../x.prom",
            "a/b.prom",
            ".prom",
            ".x.prom",
            "x.txt",
            "x prom.prom",
        ] {
            assert!(!plain_prom_name(bad), "{bad}");
        }
    }

    #[test]
    fn writes_0644_and_replaces_a_symlink_without_touching_its_target() {
        let d = tempfile::tempdir().expect("tmp");
        let target = d.path().join("target");
        std::fs::write(&target, "precious").expect("write");
        let metrics = d.path().join("m");
        std::fs::create_dir(&metrics).expect("mkdir");
        std::os::unix::fs::symlink(&target, metrics.join("a.prom")).expect("symlink");
        write(&metrics, "a.prom", "x 1\n").expect("written");
        assert_eq!(std::fs::read_to_string(&target).expect("read"), "precious");
        let meta = std::fs::symlink_metadata(metrics.join("a.prom")).expect("meta");
        assert!(meta.file_type().is_file());
        assert_eq!(meta.permissions().mode() & 0o777, 0o644);
        assert_eq!(
            std::fs::read_to_string(metrics.join("a.prom")).expect("read"),
            "x 1\n"
        );
        let left: Vec<_> = std::fs::read_dir(&metrics)
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(left.len(), 1, "no temporary file left: {left:?}");
    }

    #[test]
    fn stale_temporary_names_of_the_same_file_are_removed_fresh_ones_kept() {
        let d = tempfile::tempdir().expect("tmp");
        let old = std::time::SystemTime::now() - STALE_TMP - std::time::Duration::from_secs(60);
        let stale = format!(".a.prom.{:032x}.tmp", 1u128);
        let fresh = format!(".a.prom.{:032x}.tmp", 2u128);
        let other = format!(".b.prom.{:032x}.tmp", 3u128);
        for n in [&stale, &fresh, &other] {
            std::fs::write(d.path().join(n), "x").expect("write");
        }
        for n in [&stale, &other] {
            std::fs::File::options()
                .write(true)
                .open(d.path().join(n))
                .and_then(|f| f.set_modified(old))
                .expect("age");
        }
        write(d.path(), "a.prom", "x 1\n").expect("written");
        let mut left: Vec<String> = std::fs::read_dir(d.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().to_string())
            .collect();
        left.sort();
        let mut want = vec!["a.prom".to_string(), fresh, other];
        want.sort();
        assert_eq!(left, want);
    }

    #[test]
    fn a_symlinked_or_world_writable_folder_is_refused() {
        let d = tempfile::tempdir().expect("tmp");
        let real = d.path().join("real");
        std::fs::create_dir(&real).expect("mkdir");
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&real, &link).expect("symlink");
        assert!(matches!(
            write(&link, "a.prom", "x 1\n"),
            Err(TextfileError::OpenDir { .. })
        ));
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        assert!(matches!(
            write(&real, "a.prom", "x 1\n"),
            Err(TextfileError::Unsafe { .. })
        ));
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        write(&real, "a.prom", "x 1\n").expect("sticky is accepted");
        assert!(std::fs::read_dir(&real).expect("ls").count() == 1);
    }
}
