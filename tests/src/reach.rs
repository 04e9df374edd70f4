//! Folders that other users can reach.
//!
//! Some tests run a program as another uid: the agent after it switched to its user (`nobody`,
//! uid 65534, stands for it), a squatter of a socket name, a real container's root (uid
//! 100000). Such a program must pass through every folder above what it executes, reads or
//! connects to. A checkout below a folder only root may enter (`d=$(mktemp -d); git clone …
//! $d/p`: `mktemp -d` makes a folder of mode 0700) keeps them out of its `target/`, and of
//! its `tests/` too. [`reachable_tempdir`] makes such a test's folder in the test state base
//! when others can enter it, else directly in `/var/tmp` (mode 1777, survives a reboot, so
//! the agent accepts a `state_dir` there); [`ReachableCopy`] copies a file of the checkout
//! into a folder of that kind. Each is removed when its value is dropped, also when the test
//! panics: nothing stays in `/var/tmp`.

use std::path::{Path, PathBuf};

use tempfile::TempDir;

/// The uids the bed runs programs as besides root: `nobody` and a real container's root.
/// Neither owns a folder of a checkout, and [`can_enter`] drops every supplementary group, so
/// what lets them through is what lets anyone through.
pub const OTHER_UIDS: [u32; 2] = [65534, 100_000];

/// Where a test's folder goes when others cannot enter the test state base.
pub const FALLBACK_BASE: &str = "/var/tmp";

/// Whether `uid` (with the gid of the same number, no supplementary group) may pass through
/// every folder down to `dir` and into it. The kernel answers: `test -x` runs as that user
/// (util-linux's `setpriv`); when it cannot be run the answer is no, so the caller takes the
/// folder everyone can enter.
pub fn can_enter(uid: u32, dir: &Path) -> bool {
    std::process::Command::new("setpriv")
        .args(["--reuid", &uid.to_string(), "--regid", &uid.to_string()])
        .args(["--clear-groups", "test", "-x"])
        .arg(dir)
        .current_dir("/")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether every uid of [`OTHER_UIDS`] may enter `dir`.
pub fn others_can_enter(dir: &Path) -> bool {
    OTHER_UIDS.iter().all(|&uid| can_enter(uid, dir))
}

/// A new folder named `<prefix>XXXXXX`, of mode 0755, that the uids of [`OTHER_UIDS`] can
/// enter: in `base` when they can enter `base`, else in [`FALLBACK_BASE`] (panics when they
/// cannot enter that either, or when it does not survive a reboot: the agent would refuse a
/// `state_dir` there). Removed with all it holds when dropped.
pub fn reachable_tempdir(prefix: &str, base: &Path) -> TempDir {
    let base = if others_can_enter(base) {
        base.to_path_buf()
    } else {
        let fallback = PathBuf::from(FALLBACK_BASE);
        assert!(
            others_can_enter(&fallback),
            "neither {} nor {} lets uids {OTHER_UIDS:?} in: a test that runs a program as \
             another user needs a folder it can reach (chmod o+x the folders above the checkout)",
            base.display(),
            fallback.display()
        );
        if let Some(why) = felhom_agent::config::state_dir_volatility(&fallback) {
            panic!(
                "{} is not reachable by uids {OTHER_UIDS:?} and {} {why}: the agent would \
                 refuse a state_dir there; chmod o+x the folders above {}",
                base.display(),
                fallback.display(),
                base.display()
            );
        }
        fallback
    };
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(&base)
        .unwrap_or_else(|e| panic!("cannot make a folder in {}: {e}", base.display()));
    set_mode(dir.path(), 0o755);
    dir
}

/// A copy of a file (of the checkout) in a folder of its own that the uids of [`OTHER_UIDS`]
/// can reach ([`reachable_tempdir`] below the system's temporary folder): mode 0755 when the
/// original is executable, else 0644. Removed when dropped.
#[derive(Debug)]
pub struct ReachableCopy {
    path: PathBuf,
    _dir: TempDir,
}

impl ReachableCopy {
    /// Copy `file` (panics when it cannot be read).
    pub fn new(file: &Path) -> ReachableCopy {
        use std::os::unix::fs::PermissionsExt;
        let dir = reachable_tempdir("felhom-copy-", &std::env::temp_dir());
        let name = file
            .file_name()
            .unwrap_or_else(|| panic!("{} names no file", file.display()));
        let path = dir.path().join(name);
        let mode = std::fs::copy(file, &path)
            .and_then(|_| std::fs::metadata(file))
            .map(|m| m.permissions().mode())
            .unwrap_or_else(|e| {
                panic!("cannot copy {} to {}: {e}", file.display(), path.display())
            });
        set_mode(&path, if mode & 0o111 != 0 { 0o755 } else { 0o644 });
        ReachableCopy { path, _dir: dir }
    }

    /// The copy.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// `program args…` run as `uid` (with the gid of the same number, no supplementary group:
/// util-linux's `setpriv`), from `/`, stdin empty: its exit status (`None`: killed), stdout
/// and stderr. Panics when `setpriv` cannot be started.
pub fn run_as_uid(uid: u32, program: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let id = uid.to_string();
    let out = std::process::Command::new("setpriv")
        .args(["--reuid", &id, "--regid", &id, "--clear-groups", program])
        .args(args)
        .current_dir("/")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run setpriv: {e}"));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// One plain HTTP/1.1 request sent by `uid` to `addr` (`host:port`, loopback) through bash's
/// `/dev/tcp`, with `Connection: close` and, when given, `Authorization: <auth>`: the answer's
/// status line and its last line (a JSON body). Panics when that uid could not connect at all.
pub fn http_as_uid(
    uid: u32,
    addr: &str,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: &str,
) -> (String, String) {
    let (host, port) = addr
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("{addr} is not host:port"));
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(auth) = auth {
        request.push_str(&format!("Authorization: {auth}\r\n"));
    }
    request.push_str(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    ));
    let script = r#"exec 3<>"/dev/tcp/$1/$2" || exit 9
printf '%s' "$3" >&3
answer=$(cat <&3)
printf '%s\n' "$answer" | head -n 1
printf '%s\n' "$answer" | tail -n 1"#;
    let (code, out, err) = run_as_uid(
        uid,
        "bash",
        &["-c", script, "http-as-uid", host, port, &request],
    );
    assert_eq!(
        code,
        Some(0),
        "uid {uid} could not talk to {addr} at all: {err}"
    );
    let mut lines = out.lines();
    let status = lines.next().unwrap_or("").trim().to_string();
    let last = lines.next().unwrap_or("").trim().to_string();
    (status, last)
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("cannot chmod {}: {e}", path.display()));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> bool {
        nix::unistd::geteuid().is_root()
    }

    /// Below a folder of mode 0700 the folder moves to /var/tmp, where nobody reaches a copy
    /// and reads it; both go when dropped.
    #[test]
    fn below_a_closed_folder_the_folder_moves_where_others_can_enter_and_goes_when_dropped() {
        assert!(root(), "these tests switch users and must run as root");
        let closed = reachable_tempdir("felhom-reach-test-", &std::env::temp_dir());
        set_mode(closed.path(), 0o700);
        let inner = closed.path().join("target");
        std::fs::create_dir(&inner).expect("mkdir");
        set_mode(&inner, 0o755);
        assert!(!others_can_enter(&inner), "{} is open", inner.display());
        set_mode(closed.path(), 0o755);
        assert!(others_can_enter(&inner), "{} is closed", inner.display());
        set_mode(closed.path(), 0o700);

        let dir = reachable_tempdir("felhom-reach-test-", &inner);
        let path = dir.path().to_path_buf();
        assert!(path.starts_with(FALLBACK_BASE), "{}", path.display());
        for uid in OTHER_UIDS {
            assert!(
                can_enter(uid, &path),
                "uid {uid} cannot enter {}",
                path.display()
            );
        }
        drop(dir);
        assert!(!path.exists(), "{} left behind", path.display());
        // A test that panics leaves nothing behind either.
        let (tx, rx) = std::sync::mpsc::channel();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let dir = reachable_tempdir("felhom-reach-test-", &inner);
            tx.send(dir.path().to_path_buf()).expect("send");
            panic!("a failing test");
        }));
        let path = rx.recv().expect("the folder's path");
        assert!(panicked.is_err() && path.starts_with(FALLBACK_BASE));
        assert!(!path.exists(), "{} left behind", path.display());

        // Once others may pass, the folder stays where it was asked for.
        set_mode(closed.path(), 0o755);
        let kept = reachable_tempdir("felhom-reach-test-", &inner);
        assert_eq!(kept.path().parent(), Some(inner.as_path()));
        drop(kept);
        set_mode(closed.path(), 0o700);

        let original = closed.path().join("script");
        std::fs::write(&original, "the original\n").expect("write");
        let copy = ReachableCopy::new(&original);
        let cat_as_nobody = |file: &Path| {
            std::process::Command::new("setpriv")
                .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
                .arg("cat")
                .arg(file)
                .current_dir("/")
                .output()
                .expect("setpriv")
        };
        let read = cat_as_nobody(&original);
        assert!(!read.status.success(), "nobody read {}", original.display());
        let read = cat_as_nobody(copy.path());
        assert_eq!(
            String::from_utf8_lossy(&read.stdout),
            "the original\n",
            "{read:?}"
        );
        let copied = copy.path().to_path_buf();
        drop(copy);
        assert!(!copied.exists(), "{} left behind", copied.display());
    }
}
