//! Test bed for felhom-agent: the fakepve wrapper, the `pct` stand-in, the development hub.
//!
//! Everything here runs on loopback only and is shared by the integration tests in `tests/`.
//! [`fakepve`] starts a fake Proxmox VE API per test from a scenario and drives it; it needs the
//! fakepve venv that `tests/run.sh` installs.

pub mod agent;
pub mod crashwalk;
pub mod devhub;
pub mod fakeproc;
pub mod fakepve;
pub mod groups;
pub mod guestbed;
pub mod nspawn;
pub mod reach;
pub mod restore_bench;
pub mod verdict;
pub mod world;

/// Print a figure a test measured so that it shows in the test command's output even when the
/// test passes: on the stderr handle (cargo's test harness captures `print!`, not that), and
/// appended to the file `FELHOM_TEST_REPORTS` names, if any (`tests/run.sh` prints that file
/// after the run: nextest keeps a passing test's output to itself).
pub fn report(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
    if let Some(path) = std::env::var_os("FELHOM_TEST_REPORTS") {
        // One write of a short line to a file opened for appending: lines of tests running at
        // once do not interleave.
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(format!("{line}\n").as_bytes());
        }
    }
}

/// The memory-backed folder the bed's throwaway files go to when this machine has one fit for
/// them: `/dev/shm` when it is a tmpfs mounted without `nodev` and `noexec` (a busybox guest's
/// root filesystem holds device nodes and runs its programs from there). `None`: use the
/// system's temporary folder.
///
/// Why: every guest the fake restores is a copy of the template root filesystem (about 300
/// files), removed again at its destroy, and the fake rewrites its `.vmlist` and `user.cfg` by
/// rename on every change. On an ext4 `/tmp` each of those files is an inode allocation (seen
/// on the 2-core CI machine: `cp -a` of the template spending its time in ext4's
/// `find_inode_bit`, a third of a provision's CPU time); on tmpfs none is.
pub fn memory_scratch_base() -> Option<&'static std::path::Path> {
    static BASE: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    BASE.get_or_init(|| {
        let shm = std::path::Path::new("/dev/shm");
        // /proc/self/mountinfo: "id parent major:minor root mount-point mount-options
        // optional-fields... - fstype source super-options" (proc(5)); the last line for a
        // mount point is the mount on top.
        let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let line = info
            .lines()
            .rfind(|l| l.split(' ').nth(4) == Some("/dev/shm"))?;
        let options: Vec<&str> = line.split(' ').nth(5)?.split(',').collect();
        let fstype = line.split(" - ").nth(1)?.split(' ').next()?;
        let fit = fstype == "tmpfs"
            && !options.contains(&"nodev")
            && !options.contains(&"noexec")
            && !options.contains(&"ro");
        fit.then(|| shm.to_path_buf())
    })
    .as_deref()
}

/// A temporary folder named `<prefix>…` for files no test needs on disk: in
/// [`memory_scratch_base`] when there is one, else in the system's temporary folder. Removed
/// when dropped.
pub fn scratch_tempdir(prefix: &str) -> tempfile::TempDir {
    let builder = {
        let mut b = tempfile::Builder::new();
        b.prefix(prefix);
        b
    };
    if let Some(base) = memory_scratch_base() {
        if let Ok(dir) = builder.tempdir_in(base) {
            return dir;
        }
    }
    builder
        .tempdir()
        .unwrap_or_else(|e| panic!("cannot make a temporary folder {prefix}…: {e}"))
}

/// Every `.rs` file below `dir`, in path order (panics when a folder cannot be read): what the
/// source-reading tests (module dependencies, the PVE call map) walk.
pub fn rust_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut entries: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            e.unwrap_or_else(|e| panic!("entry of {}: {e}", dir.display()))
                .path()
        })
        .collect();
    entries.sort();
    let mut out = Vec::new();
    for p in entries {
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}
