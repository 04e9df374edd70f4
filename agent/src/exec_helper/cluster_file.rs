//! A file of the cluster file system read by the root helper for the agent
//! ([`super::proto::ClusterFile`]: `.vmlist`, `datacenter.cfg`, `user.cfg`, `sdn/vnets.cfg`,
//! `jobs.cfg`): only from the path the helper's own config names ([`path_of`]), never one a
//! caller sends; of `jobs.cfg`, `user.cfg` and `datacenter.cfg` only the lines the agent reads
//! ([`what_crosses`]).
//!
//! The helper is root and the file's bytes go to the agent's user, so nothing on the way may
//! be one the agent's user (or a guest) could place or swap: the path is opened from `/` one
//! component at a time without following any link (`O_NOFOLLOW` on each), and on each opened
//! descriptor every folder must be root's and writable by nobody else (or sticky, as `/tmp`:
//! there only an entry's owner may rename or remove it, and the next entry down must be root's
//! too); the file must be a regular file of root's that neither group nor others may write,
//! and at most `max` bytes are read. pmxcfs passes: `/etc/pve` is a folder of root's, mode
//! 0755, and `.vmlist` a file of root's, mode 0440 (pve-cluster `src/pmxcfs/pmxcfs.c`
//! `cfs_fuse_getattr` and `create_symlinks`; tests/data/pve-api-facts.md §3.3).

use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::open;
use nix::sys::stat::{fstat, Mode, SFlag};

use super::proto::ClusterFile;
use crate::config::Config;
use crate::error::ErrorCode;
use crate::nofollow;

/// Why a file is not handed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileRefusal {
    /// `config_invalid`: not what it should be (a link, a path someone else could change, not
    /// a regular file of root's, too large); `pve_unreachable`: it cannot be read at all
    /// (pmxcfs down, an IO error).
    pub code: ErrorCode,
    /// Names the file and what to do.
    pub message: String,
}

fn untrusted(path: &Path, why: String) -> FileRefusal {
    FileRefusal {
        code: ErrorCode::ConfigInvalid,
        message: format!(
            "{}: {why}; the exec helper hands a file over only from a path nobody but root can \
             change. Point the key of the helper's config that names it (vmlist_path, \
             datacenter_cfg, user_cfg_path, jobs_cfg; sdn/vnets.cfg is beside .vmlist) at \
             pmxcfs's file under /etc/pve",
            path.display()
        ),
    }
}

fn unreadable(path: &Path, why: String) -> FileRefusal {
    FileRefusal {
        code: ErrorCode::PveUnreachable,
        message: format!(
            "{}: {why}; check that pve-cluster (pmxcfs) runs (`systemctl status pve-cluster`)",
            path.display()
        ),
    }
}

/// Where the helper reads `file`: the path its own config names (`vmlist_path`,
/// `datacenter_cfg`, `user_cfg_path`, `jobs_cfg`; `sdn/vnets.cfg` in the folder of
/// `vmlist_path`).
pub fn path_of(cfg: &Config, file: ClusterFile) -> PathBuf {
    match file {
        ClusterFile::Vmlist => cfg.vmlist_path.clone(),
        ClusterFile::DatacenterCfg => cfg.datacenter_cfg.clone(),
        ClusterFile::UserCfg => cfg.user_cfg_path.clone(),
        ClusterFile::JobsCfg => cfg.jobs_cfg.clone(),
        ClusterFile::VnetsCfg => cfg
            .vmlist_path
            .parent()
            .unwrap_or(Path::new("/etc/pve"))
            .join("sdn")
            .join("vnets.cfg"),
    }
}

/// What of `file`'s bytes (read from `path`) goes to the agent: of `.vmlist` and
/// `sdn/vnets.cfg` the whole file ([`ClusterFile::crosses_whole`]); of the others only the
/// lines the agent reads: of `jobs.cfg` each backup job's id and the keys of
/// [`super::jobs_cfg::NEEDED_KEYS`] (never a job's mail addresses, notes, storage or other
/// jobs), of `user.cfg` its token, group, role and ACL lines ([`super::user_cfg::needed_lines`]:
/// never a `user:` line, whose keys field may hold OATH secrets), of `datacenter.cfg` its tag
/// policy and `next-id` lines ([`super::datacenter_cfg::needed_lines`]: never `http_proxy`,
/// which may hold a password). At most `max` bytes.
pub fn what_crosses(
    file: ClusterFile,
    path: &Path,
    bytes: Vec<u8>,
    max: u64,
) -> Result<Vec<u8>, FileRefusal> {
    let cut: fn(&str) -> String = match file {
        ClusterFile::Vmlist | ClusterFile::VnetsCfg => return Ok(bytes),
        ClusterFile::JobsCfg => super::jobs_cfg::needed_lines,
        ClusterFile::UserCfg => super::user_cfg::needed_lines,
        ClusterFile::DatacenterCfg => super::datacenter_cfg::needed_lines,
    };
    let needed = cut(&String::from_utf8_lossy(&bytes)).into_bytes();
    if needed.len() as u64 > max {
        return Err(untrusted(
            path,
            format!("the lines the agent reads of it are larger than the {max} bytes the helper hands over"),
        ));
    }
    Ok(needed)
}

/// Read `path` (absolute) as described in the module docs, at most `max` bytes. `Ok(None)`:
/// it does not exist (the file, or a folder on the way: e.g. no `sdn` folder without SDN).
pub fn read_trusted(path: &Path, max: u64) -> Result<Option<Vec<u8>>, FileRefusal> {
    if !path.is_absolute() {
        return Err(untrusted(path, "not an absolute path".to_string()));
    }
    let mut names = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => names.push(n),
            Component::ParentDir => {
                return Err(untrusted(path, "the path goes through `..`".to_string()))
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    let Some((file_name, folders)) = names.split_last() else {
        return Err(untrusted(path, "the path names no file".to_string()));
    };
    // An open's result: the descriptor, `None` when the entry does not exist, or the refusal.
    let opened = |r: nix::Result<OwnedFd>, so_far: &Path| match r {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::ENOENT) => Ok(None),
        Err(Errno::ELOOP | Errno::ENOTDIR) => Err(untrusted(
            path,
            format!(
                "{} is a symbolic link or not a folder; the helper follows no link",
                so_far.display()
            ),
        )),
        Err(e) => Err(unreadable(
            path,
            format!("{} cannot be opened ({})", so_far.display(), e.desc()),
        )),
    };
    let mut so_far = PathBuf::from("/");
    let Some(mut dir) = opened(open("/", nofollow::FOLDER, Mode::empty()), &so_far)? else {
        return Ok(None);
    };
    check_folder(path, &so_far, &dir)?;
    for name in folders {
        so_far.push(name);
        let Some(next) = opened(nofollow::folder(dir.as_fd(), *name), &so_far)? else {
            return Ok(None);
        };
        dir = next;
        check_folder(path, &so_far, &dir)?;
    }
    let file = nofollow::file(dir.as_fd(), *file_name);
    if matches!(file, Err(Errno::ELOOP)) {
        return Err(untrusted(
            path,
            "the file is a symbolic link; the helper follows no link".to_string(),
        ));
    }
    let Some(fd) = opened(file, path)? else {
        return Ok(None);
    };
    let st = fstat(fd.as_fd()).map_err(|e| unreadable(path, format!("fstat: {}", e.desc())))?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return Err(untrusted(path, "not a regular file".to_string()));
    }
    let mode = st.st_mode & 0o7777;
    if st.st_uid != 0 || mode & 0o022 != 0 {
        return Err(untrusted(
            path,
            format!(
                "the file belongs to uid {} with mode {mode:o}; it must be root's and writable \
                 by nobody else",
                st.st_uid
            ),
        ));
    }
    let mut bytes = Vec::new();
    std::fs::File::from(fd)
        .take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| unreadable(path, format!("reading it failed: {e}")))?;
    if bytes.len() as u64 > max {
        return Err(untrusted(
            path,
            format!("larger than the {max} bytes the helper hands over"),
        ));
    }
    Ok(Some(bytes))
}

/// A folder on the way: root's, and writable by nobody else unless sticky.
fn check_folder(path: &Path, folder: &Path, fd: &OwnedFd) -> Result<(), FileRefusal> {
    let st = fstat(fd.as_fd()).map_err(|e| {
        unreadable(
            path,
            format!("cannot inspect {}: {}", folder.display(), e.desc()),
        )
    })?;
    let mode = st.st_mode & 0o7777;
    if st.st_uid != 0 || (mode & 0o022 != 0 && mode & 0o1000 == 0) {
        return Err(untrusted(
            path,
            format!(
                "the folder {} belongs to uid {} with mode {mode:o}; whoever can write there \
                 could swap what is below it",
                folder.display(),
                st.st_uid
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A folder of root's, mode 0755, under a fresh temporary folder (the tests run as root).
    fn root_dir() -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        d
    }

    fn write(path: &Path, bytes: &[u8], mode: u32) {
        std::fs::write(path, bytes).expect("write");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    #[test]
    fn a_root_file_in_root_folders_is_read_whole_and_within_the_limit() {
        let d = root_dir();
        let file = d.path().join(".vmlist");
        write(&file, b"{\"version\": 1}\n", 0o440);
        assert_eq!(
            read_trusted(&file, 64).expect("read").as_deref(),
            Some(&b"{\"version\": 1}\n"[..])
        );
        // One byte over the limit is refused, not cut.
        let r = read_trusted(&file, 14).expect_err("too large");
        assert_eq!(r.code, ErrorCode::ConfigInvalid);
        assert!(
            r.message.contains("larger than the 14 bytes"),
            "{}",
            r.message
        );
    }

    #[test]
    fn a_link_at_the_file_or_on_the_way_is_refused_unread() {
        let d = root_dir();
        let real = d.path().join("real");
        write(&real, b"{}", 0o440);
        let link = d.path().join(".vmlist");
        std::os::unix::fs::symlink(&real, &link).expect("symlink");
        let r = read_trusted(&link, 64).expect_err("link");
        assert_eq!(r.code, ErrorCode::ConfigInvalid);
        assert!(r.message.contains("symbolic link"), "{}", r.message);
        // A folder on the way that is a link.
        let sub = d.path().join("sub");
        std::fs::create_dir(&sub).expect("mkdir");
        write(&sub.join(".vmlist"), b"{}", 0o440);
        let via = d.path().join("via");
        std::os::unix::fs::symlink(&sub, &via).expect("symlink");
        assert_eq!(
            read_trusted(&sub.join(".vmlist"), 64)
                .expect("real")
                .as_deref(),
            Some(&b"{}"[..])
        );
        let r = read_trusted(&via.join(".vmlist"), 64).expect_err("linked folder");
        assert!(
            r.message.contains("symbolic link") && r.message.contains("via"),
            "{}",
            r.message
        );
    }

    #[test]
    fn a_path_someone_else_could_swap_is_refused() {
        let d = root_dir();
        let file = d.path().join(".vmlist");
        write(&file, b"{}", 0o440);
        // The file's folder writable by others (not sticky): its entries could be replaced.
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let r = read_trusted(&file, 64).expect_err("writable folder");
        assert_eq!(r.code, ErrorCode::ConfigInvalid);
        assert!(r.message.contains("mode 777"), "{}", r.message);
        // Sticky, as /tmp: only an entry's owner may replace it, and the file is root's.
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        assert!(read_trusted(&file, 64).is_ok());
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        // The folder of another user.
        nix::unistd::chown(d.path(), Some(nix::unistd::Uid::from_raw(65534)), None).expect("chown");
        let r = read_trusted(&file, 64).expect_err("foreign folder");
        assert!(r.message.contains("uid 65534"), "{}", r.message);
        nix::unistd::chown(d.path(), Some(nix::unistd::Uid::from_raw(0)), None).expect("chown");
        // The file replaced by one of another user, or one others may write.
        nix::unistd::chown(&file, Some(nix::unistd::Uid::from_raw(65534)), None).expect("chown");
        assert!(read_trusted(&file, 64)
            .expect_err("foreign file")
            .message
            .contains("uid 65534"));
        nix::unistd::chown(&file, Some(nix::unistd::Uid::from_raw(0)), None).expect("chown");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o646)).expect("chmod");
        assert!(read_trusted(&file, 64)
            .expect_err("writable file")
            .message
            .contains("mode 646"));
    }

    #[test]
    fn a_fifo_or_folder_in_its_place_is_refused_without_blocking() {
        let d = root_dir();
        let file = d.path().join(".vmlist");
        nix::unistd::mkfifo(&file, Mode::from_bits_truncate(0o600)).expect("mkfifo");
        let r = read_trusted(&file, 64).expect_err("fifo");
        assert!(r.message.contains("not a regular file"), "{}", r.message);
        std::fs::remove_file(&file).expect("rm");
        std::fs::create_dir(&file).expect("mkdir");
        assert!(read_trusted(&file, 64)
            .expect_err("folder")
            .message
            .contains("not a regular file"));
    }

    #[test]
    fn of_jobs_cfg_only_the_backup_jobs_needed_lines_cross() {
        let d = root_dir();
        let file = d.path().join("jobs.cfg");
        let text = "vzdump: backup-6f1a2b3c-1234\n\
            \tschedule 21:00\n\
            \tall 1\n\
            \tenabled 1\n\
            \texclude 990000,990001\n\
            \tmode snapshot\n\
            \tstorage local\n\
            \tnotes-template {{guestname}} MARKER-NOTES\n\
            \tmailto ops@MARKER.example\n\
            \tnode pve1\n\
            \n\
            # a comment MARKER-COMMENT\n\
            realm-sync: sync-ldap\n\
            \tschedule daily\n\
            \trealm ldap\n\
            \tcomment MARKER-REALM\n\
            \n\
            vzdump: backup-pool\n\
            \tpool felhom\n\
            \tschedule sat 02:00\n\
            \tcomment MARKER-COMMENT2\n\
            \tfleecing enabled=1,storage=MARKER-FLEECE\n";
        write(&file, text.as_bytes(), 0o640);
        let bytes = read_trusted(&file, 4096).expect("read").expect("exists");
        let crossed = what_crosses(ClusterFile::JobsCfg, &file, bytes.clone(), 4096).expect("cut");
        let crossed = String::from_utf8(crossed).expect("utf8");
        assert_eq!(
            crossed,
            "vzdump: backup-6f1a2b3c-1234\n\tschedule 21:00\n\tall 1\n\tenabled 1\n\
             \texclude 990000,990001\n\tnode pve1\n\n\
             vzdump: backup-pool\n\tpool felhom\n\tschedule sat 02:00\n\n"
        );
        assert!(!crossed.contains("MARKER"), "{crossed}");
        // .vmlist and sdn/vnets.cfg cross whole.
        for whole in [ClusterFile::Vmlist, ClusterFile::VnetsCfg] {
            assert!(whole.crosses_whole());
            assert_eq!(
                what_crosses(whole, &file, bytes.clone(), 4096).expect("whole"),
                bytes
            );
        }
        // Lines that would not fit are refused, not cut.
        let r = what_crosses(ClusterFile::JobsCfg, &file, bytes, 16).expect_err("too large");
        assert_eq!(r.code, ErrorCode::ConfigInvalid);
        assert!(
            r.message.contains("jobs.cfg") && r.message.contains("16 bytes"),
            "{}",
            r.message
        );
        assert!(!ClusterFile::JobsCfg.crosses_whole());
        // No jobs.cfg (no job was ever made): nothing to hand over, not an error.
        assert_eq!(read_trusted(&d.path().join("none/jobs.cfg"), 64), Ok(None));
        assert_eq!(read_trusted(&d.path().join("jobs.cfg.none"), 64), Ok(None));
    }

    #[test]
    fn of_user_cfg_and_datacenter_cfg_no_secret_crosses() {
        let d = root_dir();
        let user = d.path().join("user.cfg");
        let text = "user:alice@pve:1:0:Alice::alice@example.invalid::MARKERBASE32KEY:\n\
            token:alice@pve!ci:0:1::\n\
            pool:felhom:MARKER-POOL:100:local:\n\
            acl:1:/pool/felhom:alice@pve!ci:PVEVMAdmin:\n";
        write(&user, text.as_bytes(), 0o640);
        let bytes = read_trusted(&user, 4096).expect("read").expect("exists");
        let crossed = what_crosses(ClusterFile::UserCfg, &user, bytes, 4096).expect("cut");
        assert_eq!(
            String::from_utf8(crossed).expect("utf8"),
            "token:alice@pve!ci:0:1::\nacl:1:/pool/felhom:alice@pve!ci:PVEVMAdmin:\n"
        );
        let dc = d.path().join("datacenter.cfg");
        let text = "#MARKER description\nkeyboard: de\n\
            http_proxy: http://user:MARKER-PASSWORD@proxy.example.invalid:3128/\n\
            user-tag-access: user-allow=none\n";
        write(&dc, text.as_bytes(), 0o640);
        let bytes = read_trusted(&dc, 4096).expect("read").expect("exists");
        let crossed = what_crosses(ClusterFile::DatacenterCfg, &dc, bytes, 4096).expect("cut");
        assert_eq!(
            String::from_utf8(crossed).expect("utf8"),
            "user-tag-access: user-allow=none\n"
        );
        for cut in [ClusterFile::UserCfg, ClusterFile::DatacenterCfg] {
            assert!(!cut.crosses_whole());
        }
    }

    #[test]
    fn a_missing_file_or_folder_is_none_and_a_relative_path_untrusted() {
        let d = root_dir();
        assert_eq!(read_trusted(&d.path().join(".vmlist"), 64), Ok(None));
        assert_eq!(read_trusted(&d.path().join("sdn/vnets.cfg"), 64), Ok(None));
        let r = read_trusted(Path::new("etc/pve/.vmlist"), 64).expect_err("relative");
        assert_eq!(r.code, ErrorCode::ConfigInvalid);
        let r = read_trusted(Path::new("/etc/pve/../pve/.vmlist"), 64).expect_err("dotdot");
        assert!(r.message.contains(".."), "{}", r.message);
    }
}
