//! The per-vmid lock: two agent processes on one node never run a transaction on the same
//! vmid at once (DESIGN rule 6).
//!
//! `<state_dir>/locks/vmid-<N>.lock`, an exclusive `flock` taken without waiting. The holder
//! writes its pid (and transaction) into the file so a refused process can say who holds it.
//! The guard releases the lock when dropped, and the kernel releases it when the holding
//! process dies, however it dies, so a crash never leaves a vmid locked.
//!
//! This module only excludes; it never reads or changes a transaction.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use ulid::Ulid;

use crate::error::ErrorCode;

/// The lock folder inside the state dir.
pub const LOCK_DIR: &str = "locks";

/// Who holds a lock, as the holder wrote it into the lock file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    /// The holder's process id.
    pub pid: u32,
    /// The transaction it runs, if it said.
    pub txn: Option<Ulid>,
}

fn holder_text(holder: &Option<Holder>) -> String {
    match holder {
        Some(Holder {
            pid,
            txn: Some(txn),
        }) => format!(" (pid {pid}, transaction {txn})"),
        Some(Holder { pid, txn: None }) => format!(" (pid {pid})"),
        None => String::new(),
    }
}

/// Errors of the per-vmid lock.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds the vmid's lock.
    #[error(
        "vmid {vmid} is busy: another agent process{} runs a transaction on it (lock {path}); \
         wait for it to finish, see `felhom-agent journal`",
        holder_text(.holder)
    )]
    Held {
        /// The vmid.
        vmid: u32,
        /// The lock file.
        path: PathBuf,
        /// Who holds it, if the file says.
        holder: Option<Holder>,
    },
    /// Another process runs an isolated VM copy on the lab bridge.
    #[error(
        "the lab bridge {bridge} is in use: another agent process{} runs an isolated VM copy on \
         it (lock {path}); VM copies on one lab bridge run one at a time (they would reach each \
         other there), so nothing was written; run this again once that one has ended (see \
         `felhom-agent journal`)",
        holder_text(.holder)
    )]
    BridgeHeld {
        /// The bridge.
        bridge: String,
        /// The lock file.
        path: PathBuf,
        /// Who holds it, if the file says.
        holder: Option<Holder>,
    },
    /// The lock folder could not be created.
    #[error(
        "cannot create the lock folder {path}: {source}; check that the state dir exists and is \
         writable by root"
    )]
    CreateDir {
        /// The folder.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The lock folder or a lock file is not what the agent made: a link, a file of another
    /// user, a folder others may write, a file with more than one name.
    #[error("refusing lock {path}: {why}; nothing was written")]
    Untrusted {
        /// The folder or file.
        path: PathBuf,
        /// What is wrong with it, and the fix.
        why: String,
    },
    /// The lock file could not be opened, locked or written.
    #[error("cannot use lock file {path} for vmid {vmid}: {source}; check the state dir")]
    Io {
        /// The vmid.
        vmid: u32,
        /// The lock file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

impl LockError {
    /// The stable code: a busy vmid is refused like one in use (nothing was written); a
    /// broken state dir is an environment problem.
    pub fn code(&self) -> ErrorCode {
        match self {
            LockError::Held { .. } | LockError::BridgeHeld { .. } => ErrorCode::VmidInUse,
            LockError::CreateDir { .. } | LockError::Io { .. } | LockError::Untrusted { .. } => {
                ErrorCode::ConfigInvalid
            }
        }
    }
}

/// A held vmid lock; dropping it releases the lock.
#[derive(Debug)]
pub struct VmidLock {
    _lock: Flock<File>,
    vmid: u32,
    path: PathBuf,
}

impl VmidLock {
    /// Take the lock of `vmid` under `state_dir` without waiting, recording this process (and
    /// `txn`) as the holder. Refused with [`LockError::Held`] if another open file holds it,
    /// in this process or another.
    pub fn try_acquire(state_dir: &Path, vmid: u32, txn: Option<Ulid>) -> Result<Self, LockError> {
        Self::acquire_at(state_dir, vmid, lock_path(state_dir, vmid), txn)
    }

    /// [`VmidLock::try_acquire`] of the lock file `path` under `state_dir`'s lock folder.
    fn acquire_at(
        state_dir: &Path,
        vmid: u32,
        path: PathBuf,
        txn: Option<Ulid>,
    ) -> Result<Self, LockError> {
        let io = |source| LockError::Io {
            vmid,
            path: path.clone(),
            source,
        };
        let file = open_lock_file(state_dir, &path).map_err(|e| match e {
            Opened::Io(source) => io(source),
            other => other.into_error(&path, state_dir),
        })?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((mut file, Errno::EWOULDBLOCK)) => {
                let holder = read_holder(&mut file);
                return Err(LockError::Held { vmid, path, holder });
            }
            Err((_, errno)) => return Err(io(io::Error::from(errno))),
        };
        let mut text = format!("pid {}\n", std::process::id());
        if let Some(txn) = txn {
            text.push_str(&format!("txn {txn}\n"));
        }
        lock.set_len(0).map_err(io)?;
        lock.seek(SeekFrom::Start(0)).map_err(io)?;
        lock.write_all(text.as_bytes()).map_err(io)?;
        Ok(VmidLock {
            _lock: lock,
            vmid,
            path,
        })
    }

    /// The locked vmid.
    pub fn vmid(&self) -> u32 {
        self.vmid
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A held lab bridge lock (`<state_dir>/locks/lab-bridge-<bridge>.lock`): one isolated VM
/// copy at a time on `[restore_test] lab_bridge`, whose ports all reach each other. Dropping
/// it (or the holder's death) releases it.
#[derive(Debug)]
pub struct LabBridgeLock {
    _lock: VmidLock,
}

impl LabBridgeLock {
    /// Take the lock of lab bridge `bridge` without waiting, as [`VmidLock::try_acquire`] does
    /// a vmid's. `bridge` is a checked bridge name (`config::valid_lab_bridge`).
    pub fn try_acquire(
        state_dir: &Path,
        bridge: &str,
        txn: Option<Ulid>,
    ) -> Result<Self, LockError> {
        let path = state_dir
            .join(LOCK_DIR)
            .join(format!("lab-bridge-{bridge}.lock"));
        match VmidLock::acquire_at(state_dir, 0, path, txn) {
            Ok(lock) => Ok(LabBridgeLock { _lock: lock }),
            Err(LockError::Held { path, holder, .. }) => Err(LockError::BridgeHeld {
                bridge: bridge.to_string(),
                path,
                holder,
            }),
            Err(e) => Err(e),
        }
    }
}

/// A held proof lock of one guest (`<state_dir>/locks/restore-guest-<vmid>.lock`): the timer's
/// run and a run started by hand never prove the same guest's backup at once. Dropping it (or
/// the holder's death) releases it.
#[derive(Debug)]
pub struct GuestProofLock {
    _lock: VmidLock,
}

impl GuestProofLock {
    /// Take the proof lock of guest `guest` without waiting; `Err(LockError::Held)` while
    /// another run proves it.
    pub fn try_acquire(state_dir: &Path, guest: u32, txn: Option<Ulid>) -> Result<Self, LockError> {
        let path = state_dir
            .join(LOCK_DIR)
            .join(format!("restore-guest-{guest}.lock"));
        VmidLock::acquire_at(state_dir, guest, path, txn).map(|lock| GuestProofLock { _lock: lock })
    }
}

/// Why a lock could not be opened.
enum Opened {
    /// The folder could not be made.
    CreateDir(io::Error),
    /// The folder (`true`) or the file (`false`) is not the agent's, and why.
    Untrusted(bool, String),
    /// The file could not be opened.
    Io(io::Error),
}

impl Opened {
    fn into_error(self, file: &Path, state_dir: &Path) -> LockError {
        let dir = state_dir.join(LOCK_DIR);
        match self {
            Opened::CreateDir(source) => LockError::CreateDir { path: dir, source },
            Opened::Untrusted(true, why) => LockError::Untrusted { path: dir, why },
            Opened::Untrusted(false, why) => LockError::Untrusted {
                path: file.to_path_buf(),
                why,
            },
            Opened::Io(source) => LockError::Io {
                vmid: 0,
                path: file.to_path_buf(),
                source,
            },
        }
    }
}

/// Open (creating it) the lock file `path` in `state_dir`'s lock folder, never through a link:
/// the folder is opened without following one and must be a folder of the state folder's
/// owner or of this process's user, writable by no one else; the file is opened in it without
/// following one, and must be a regular file of one of those users with one name only (a hard
/// link to another file has two). A root run in a state folder another user could write into
/// otherwise rewrites whatever a link there names.
fn open_lock_file(state_dir: &Path, path: &Path) -> Result<File, Opened> {
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::{fstat, mkdirat, Mode, SFlag};
    let name = path
        .file_name()
        .ok_or_else(|| Opened::Untrusted(false, "a lock file has a name".to_string()))?;
    let top = fs::File::open(state_dir).map_err(Opened::CreateDir)?;
    let top_owner = fstat(&top)
        .map_err(|e| Opened::CreateDir(io::Error::from(e)))?
        .st_uid;
    let me = nix::unistd::geteuid().as_raw();
    match mkdirat(&top, LOCK_DIR, Mode::from_bits_truncate(0o700)) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(e) => return Err(Opened::CreateDir(io::Error::from(e))),
    }
    let dir = match crate::nofollow::folder(&top, LOCK_DIR) {
        Ok(d) => d,
        Err(Errno::ELOOP | Errno::ENOTDIR) => {
            return Err(Opened::Untrusted(
                true,
                "it is a link or not a folder; remove it (the agent makes the folder again)"
                    .to_string(),
            ))
        }
        Err(e) => return Err(Opened::CreateDir(io::Error::from(e))),
    };
    let st = fstat(&dir).map_err(|e| Opened::CreateDir(io::Error::from(e)))?;
    if st.st_uid != me && st.st_uid != top_owner {
        return Err(Opened::Untrusted(
            true,
            format!(
                "it belongs to uid {}, neither the state folder's owner (uid {top_owner}) nor this process's user (uid {me}); remove it",
                st.st_uid
            ),
        ));
    }
    if st.st_mode & 0o022 != 0 {
        return Err(Opened::Untrusted(
            true,
            format!(
                "it has mode {:04o}, writable by group or others; run `chmod 700` on it",
                st.st_mode & 0o7777
            ),
        ));
    }
    let fd = openat(
        &dir,
        name,
        OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )
    .map_err(|e| match e {
        Errno::ELOOP => Opened::Untrusted(
            false,
            "it is a symbolic link; remove it (the agent makes the file again)".to_string(),
        ),
        e => Opened::Io(io::Error::from(e)),
    })?;
    let st = fstat(&fd).map_err(|e| Opened::Io(io::Error::from(e)))?;
    let regular = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFREG;
    if !regular || st.st_nlink != 1 || (st.st_uid != me && st.st_uid != top_owner) {
        return Err(Opened::Untrusted(
            false,
            format!(
                "it is not a lock file of the agent's (a regular file of uid {me} or {top_owner} with one name; found {} of uid {} with {} name(s)); remove it",
                if regular { "a regular file" } else { "no regular file" },
                st.st_uid,
                st.st_nlink
            ),
        ));
    }
    Ok(File::from(fd))
}

/// The lock file of `vmid` under `state_dir`.
pub fn lock_path(state_dir: &Path, vmid: u32) -> PathBuf {
    state_dir.join(LOCK_DIR).join(format!("vmid-{vmid}.lock"))
}

/// Whether a process holds the lock of `vmid` for transaction `txn`: the lock file names
/// `txn` (`pid N` and `txn ULID` lines) and the lock is held now, read without locking it:
/// what `journal` uses to tell a running transaction from an interrupted one. Read only;
/// never blocks another process.
///
/// Held is read from the kernel's table of locks (`/proc/locks`: a `FLOCK` on the lock file's
/// device and inode), so a transaction whose process let go of the lock shows as interrupted
/// at once, even while that process lives on (the daemon, after a restore test it ran was
/// stopped) or while another process has its pid (after a reboot). Only where that table
/// cannot be read is the named pid's being alive taken instead.
pub fn running_holder(state_dir: &Path, vmid: u32, txn: Ulid) -> Option<Holder> {
    // Read only, never through a link, never waiting for a FIFO's writer.
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags((nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK).bits())
        .open(lock_path(state_dir, vmid))
        .ok()?;
    let holder = read_holder(&mut file)?;
    if holder.txn != Some(txn) {
        return None;
    }
    let held = match flock_held(&file) {
        Some(held) => held,
        None => {
            holder.pid == std::process::id() || Path::new(&format!("/proc/{}", holder.pid)).exists()
        }
    };
    held.then_some(holder)
}

/// The most of `/proc/locks` read.
const PROC_LOCKS_MAX: u64 = 8 * 1024 * 1024;

/// Whether any open file holds a `flock` on `file`'s inode, from `/proc/locks`; `None` when
/// the table cannot be read.
fn flock_held(file: &File) -> Option<bool> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata().ok()?;
    let mut text = String::new();
    File::open("/proc/locks")
        .ok()?
        .take(PROC_LOCKS_MAX)
        .read_to_string(&mut text)
        .ok()?;
    let dev = meta.dev();
    Some(locks_table_holds(
        &text,
        nix::sys::stat::major(dev),
        nix::sys::stat::minor(dev),
        meta.ino(),
    ))
}

/// Whether `/proc/locks` text lists a granted `FLOCK` on the inode `ino` of device
/// `major:minor` (its lines: `N: FLOCK  ADVISORY  WRITE PID MAJ:MIN:INO 0 EOF`, the device
/// numbers in hex; a waiter's line has `->` after the number and holds nothing).
fn locks_table_holds(text: &str, major: u64, minor: u64, ino: u64) -> bool {
    text.lines().any(|line| {
        let mut words = line.split_whitespace().skip(1);
        if words.next() != Some("FLOCK") {
            return false;
        }
        let Some(id) = words.nth(3) else {
            return false;
        };
        let mut parts = id.split(':');
        let (Some(ma), Some(mi), Some(i), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return false;
        };
        u64::from_str_radix(ma, 16).ok() == Some(major)
            && u64::from_str_radix(mi, 16).ok() == Some(minor)
            && i.parse::<u64>().ok() == Some(ino)
    })
}

fn read_holder(file: &mut File) -> Option<Holder> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0)).ok()?;
    file.take(4096).read_to_string(&mut text).ok()?;
    parse_holder(&text)
}

fn parse_holder(text: &str) -> Option<Holder> {
    let mut pid = None;
    let mut txn = None;
    for line in text.lines() {
        match line.split_once(' ') {
            Some(("pid", v)) => pid = v.trim().parse().ok(),
            Some(("txn", v)) => txn = Ulid::from_string(v.trim()).ok(),
            _ => {}
        }
    }
    Some(Holder { pid: pid?, txn })
}

#[cfg(test)]
mod tests {

    #[test]
    fn one_isolated_vm_copy_at_a_time_holds_the_lab_bridge() {
        let dir = tempfile::tempdir().expect("tmp");
        let first = LabBridgeLock::try_acquire(dir.path(), "vmbr9", None).expect("free");
        let err = LabBridgeLock::try_acquire(dir.path(), "vmbr9", None).expect_err("held");
        assert_eq!(err.code(), ErrorCode::VmidInUse);
        let text = err.to_string();
        assert!(
            text.contains("lab bridge vmbr9 is in use")
                && text.contains(&format!("pid {}", std::process::id()))
                && text.contains("lab-bridge-vmbr9.lock"),
            "{text}"
        );
        // Another bridge, and the vmids, are locks of their own.
        let _other = LabBridgeLock::try_acquire(dir.path(), "vmbr8", None).expect("free");
        let _vmid = VmidLock::try_acquire(dir.path(), 990_000, None).expect("free");
        drop(first);
        LabBridgeLock::try_acquire(dir.path(), "vmbr9", None).expect("released");
    }

    use super::*;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    #[test]
    fn the_locks_table_is_read_for_granted_flocks_on_that_inode_only() {
        let table = "1: POSIX  ADVISORY  WRITE 900 fd:01:77 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 901 fd:01:55 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 902 fd:01:66 0 EOF\n\
                     3: FLOCK  ADVISORY  WRITE 903 08:02:66 0 EOF\n";
        assert!(locks_table_holds(table, 0xfd, 1, 55));
        // A POSIX lock, a waiter, another device: none is a held flock on fd:01:77 or :66.
        assert!(!locks_table_holds(table, 0xfd, 1, 77));
        assert!(!locks_table_holds(table, 0xfd, 1, 66));
        assert!(locks_table_holds(table, 8, 2, 66));
        assert!(!locks_table_holds("garbage\n1: FLOCK\n", 8, 2, 66));
    }

    #[test]
    fn running_holder_follows_the_lock_not_the_pid() {
        let dir = tempfile::tempdir().expect("tempdir");
        let txn = Ulid::from_parts(1_767_225_600_000, 9);
        let held = VmidLock::try_acquire(dir.path(), 990_001, Some(txn)).expect("lock");
        assert!(running_holder(dir.path(), 990_001, txn).is_some());
        assert!(running_holder(dir.path(), 990_001, Ulid::nil()).is_none());
        drop(held);
        // This process lives on and the file still names it: released is released.
        assert_eq!(
            read_holder(&mut File::open(lock_path(dir.path(), 990_001)).expect("open"))
                .map(|h| h.pid),
            Some(std::process::id())
        );
        assert!(running_holder(dir.path(), 990_001, txn).is_none());
    }

    #[test]
    fn a_second_lock_on_the_same_vmid_is_refused_with_the_holder() {
        let dir = tempfile::tempdir().expect("tempdir");
        let txn = Ulid::from_parts(1_767_225_600_000, 7);
        let held = VmidLock::try_acquire(dir.path(), 120, Some(txn)).expect("first lock");
        assert_eq!(held.vmid(), 120);
        assert_eq!(held.path(), lock_path(dir.path(), 120));
        let err = VmidLock::try_acquire(dir.path(), 120, None).expect_err("second lock refused");
        match &err {
            LockError::Held { vmid, holder, .. } => {
                assert_eq!(*vmid, 120);
                assert_eq!(
                    *holder,
                    Some(Holder {
                        pid: std::process::id(),
                        txn: Some(txn)
                    })
                );
            }
            other => panic!("expected Held, got {other}"),
        }
        assert_eq!(err.code(), ErrorCode::VmidInUse);
        let msg = err.to_string();
        assert!(msg.contains("vmid 120"), "{msg}");
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        assert!(msg.contains(&txn.to_string()), "{msg}");
        // Another vmid is independent.
        let other = VmidLock::try_acquire(dir.path(), 121, None);
        assert!(other.is_ok());
    }

    /// A link, a hard link, a folder others may write or a link for the folder: refused
    /// before anything is written, and what a link named is left as it was.
    #[test]
    fn a_lock_is_never_taken_through_a_link_or_in_a_folder_others_may_write() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tmp");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious\n").expect("victim");
        let locks = dir.path().join("state").join(LOCK_DIR);
        std::fs::create_dir_all(&locks).expect("locks");
        std::fs::set_permissions(&locks, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let state = dir.path().join("state");
        let refused = |e: Result<VmidLock, LockError>| match e {
            Err(LockError::Untrusted { why, .. }) => why,
            other => panic!("not refused as untrusted: {other:?}"),
        };
        // A symbolic link named as the lock file.
        std::os::unix::fs::symlink(&victim, locks.join("vmid-120.lock")).expect("symlink");
        let why = refused(VmidLock::try_acquire(&state, 120, None));
        assert!(why.contains("symbolic link"), "{why}");
        // A hard link to another file.
        std::fs::hard_link(&victim, locks.join("vmid-121.lock")).expect("hard link");
        let why = refused(VmidLock::try_acquire(&state, 121, None));
        assert!(why.contains("2 name(s)"), "{why}");
        assert_eq!(
            std::fs::read_to_string(&victim).expect("victim"),
            "precious\n"
        );
        // The folder writable by others.
        std::fs::set_permissions(&locks, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let why = refused(VmidLock::try_acquire(&state, 122, None));
        assert!(why.contains("writable by group or others"), "{why}");
        assert!(!locks.join("vmid-122.lock").exists());
        // The folder itself a link.
        let other = dir.path().join("elsewhere");
        std::fs::create_dir(&other).expect("elsewhere");
        let state2 = dir.path().join("state2");
        std::fs::create_dir(&state2).expect("state2");
        std::os::unix::fs::symlink(&other, state2.join(LOCK_DIR)).expect("symlink");
        let why = refused(VmidLock::try_acquire(&state2, 123, None));
        assert!(why.contains("link or not a folder"), "{why}");
        assert!(std::fs::read_dir(&other)
            .expect("elsewhere")
            .next()
            .is_none());
        // A proper folder: taken.
        std::fs::set_permissions(&locks, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        assert!(VmidLock::try_acquire(&state, 124, None).is_ok());
    }

    #[test]
    fn dropping_the_guard_releases_the_lock() {
        let dir = tempfile::tempdir().expect("tempdir");
        let held = VmidLock::try_acquire(dir.path(), 130, None).expect("first lock");
        assert!(VmidLock::try_acquire(dir.path(), 130, None).is_err());
        drop(held);
        assert!(VmidLock::try_acquire(dir.path(), 130, None).is_ok());
    }

    #[test]
    fn the_kernel_releases_the_lock_of_a_killed_holder() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Create the lock folder and file the way the agent does, then let a child process
        // take the lock on it (util-linux flock on an inherited descriptor, waiting while this
        // test's own probes hold it for a moment), record its pid, and stay alive holding it.
        drop(VmidLock::try_acquire(dir.path(), 140, None).expect("create the lock file"));
        let path = lock_path(dir.path(), 140);
        let script = format!(
            "exec 9<>'{}' && flock -x -w 10 9 && printf 'pid %s\\n' $$ >&9 && exec sleep 600",
            path.display()
        );
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(&script)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn the lock holder");
        let child_pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        let refused = loop {
            match VmidLock::try_acquire(dir.path(), 140, None) {
                Err(LockError::Held {
                    holder: Some(h), ..
                }) if h.pid == child_pid => break true,
                Err(LockError::Held { .. }) => {}
                Ok(lock) => drop(lock),
                Err(other) => panic!("unexpected error {other}"),
            }
            if Instant::now() > deadline {
                break false;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if !refused {
            let _ = child.kill();
            let _ = child.wait();
        }
        assert!(refused, "the child never held the lock");
        // SIGKILL: no chance to unlock; the kernel must release it.
        child.kill().expect("kill the holder");
        child.wait().expect("reap the holder");
        let lock = VmidLock::try_acquire(dir.path(), 140, None).expect("lock after the kill");
        assert_eq!(lock.vmid(), 140);
    }

    #[test]
    fn holder_text_is_parsed_leniently() {
        assert_eq!(
            parse_holder("pid 42\n"),
            Some(Holder { pid: 42, txn: None })
        );
        assert_eq!(parse_holder(""), None);
        assert_eq!(parse_holder("garbage"), None);
        let txn = Ulid::from_parts(1, 2);
        assert_eq!(
            parse_holder(&format!("pid 7\ntxn {txn}\n")),
            Some(Holder {
                pid: 7,
                txn: Some(txn)
            })
        );
    }
}
