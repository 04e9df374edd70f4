//! `tests/demo.sh` run by root for a checkout whose owner has no cargo (sudo's `secure_path`,
//! or `env -i` as in the README): it says what to install and the one command to run, exits
//! 2, and leaves nothing of root's in the checkout. (With cargo it builds as the checkout's
//! owner: `tests/tests/demo.rs` runs the whole demo.)
//!
//! Run as root; `nobody` (uid 65534, home /nonexistent) stands for a user without Rust.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use felhom_tests::fakepve::{fakepve_python, state_base};
use felhom_tests::guestbed::repo_root;

const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let p = e.path();
        if p.symlink_metadata().expect("lstat").is_dir() {
            walk(&p, out);
        }
        out.push(p);
    }
}

#[test]
fn without_cargo_the_demo_names_the_one_command_and_leaves_no_root_file() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the demo needs root; so does this test"
    );
    for d in PATH.split(':') {
        assert!(
            !Path::new(d).join("cargo").exists(),
            "{d}/cargo exists: this machine cannot show a checkout without cargo"
        );
    }
    let tmp = tempfile::Builder::new()
        .prefix("demo-cargo")
        .tempdir_in(state_base())
        .expect("tempdir");
    let co = tmp.path().join("checkout");
    std::fs::create_dir_all(co.join("tests")).expect("mkdir");
    for f in ["tests/demo.sh", "tests/setup-demo.sh", "Cargo.toml"] {
        std::fs::copy(repo_root().join(f), co.join(f)).expect("copy");
    }
    let mut all = vec![co.clone()];
    walk(&co, &mut all);
    for p in &all {
        nix::unistd::chown(
            p,
            Some(nix::unistd::Uid::from_raw(65534)),
            Some(nix::unistd::Gid::from_raw(65534)),
        )
        .expect("chown");
    }
    let out = Command::new("env")
        .arg("-i")
        .arg("HOME=/root")
        .arg(format!("PATH={PATH}"))
        .arg(format!(
            "FELHOM_FAKEPVE_PYTHON={}",
            fakepve_python().display()
        ))
        .arg(co.join("tests/demo.sh"))
        .output()
        .expect("demo.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let rust = std::fs::read_to_string(repo_root().join("Cargo.toml"))
        .expect("Cargo.toml")
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .map(|v| v.trim_matches('"').to_string())
        .expect("rust-version");
    for part in [
        "https://rustup.rs",
        &format!("Rust {rust} or newer"),
        "then run: sudo tests/demo.sh",
    ] {
        assert!(stderr.contains(part), "no {part:?} in: {stderr}");
    }
    let mut left = Vec::new();
    walk(&co, &mut left);
    for p in left {
        let uid = p.symlink_metadata().expect("lstat").uid();
        assert_eq!(uid, 65534, "{} belongs to uid {uid}", p.display());
    }
}
