//! The agent's system user runs nothing outside the agent's units: the package gives it a home
//! it cannot write or create (sshd's `~/.ssh/authorized_keys`, pam_env's `~/.pam_environment`
//! and a user manager's `~/.config/systemd/user` are read from there), expires its account
//! (PAM's account check refuses it whatever its keys), masks its user manager and ships
//! `DenyUsers` for sshd; `doctor` checks each on the node.
//!
//! The package's own files do the work: the sysusers and tmpfiles snippets and the postinst run
//! (real `systemd-sysusers`, `systemd-tmpfiles` and `usermod`, systemd's own commands stubbed)
//! against a scratch root, a fresh install and an upgrade from a version whose home was the
//! state directory. Then, as the uid the package created (`setpriv`), the test plants an
//! `authorized_keys`, a user unit and a `.pam_environment` where that root's passwd puts the
//! home. `doctor` runs in a private mount namespace whose `/etc/passwd`, `/etc/group`,
//! `/etc/shadow`, `/etc/ssh/sshd_config.d` and `/etc/systemd/system` are the scratch root's,
//! with the real `sshd -T` (Debian's openssh-server, `tests/setup-package.sh`) and the real
//! `systemctl is-enabled`.
//!
//! Run as root (the switch of users and the mounts need it).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use felhom_tests::guestbed::repo_root;
use felhom_tests::world::World;

/// A scratch node root with the base passwd and group of every Debian system and the package's
/// snippets where `systemd-sysusers --root` and `systemd-tmpfiles --root` look for them.
fn scratch_root() -> tempfile::TempDir {
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests switch users and mount, and must run as root"
    );
    let root = tempfile::Builder::new()
        .prefix("felhom-node-")
        .tempdir()
        .expect("tempdir");
    let r = root.path();
    for d in ["etc", "usr/lib/sysusers.d", "usr/lib/tmpfiles.d", "var/lib"] {
        std::fs::create_dir_all(r.join(d)).expect("mkdir");
    }
    std::fs::write(
        r.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/bash\nwww-data:x:33:33:www-data:/var/www:/usr/sbin/nologin\n",
    )
    .expect("passwd");
    std::fs::write(r.join("etc/group"), "root:x:0:\nwww-data:x:33:\n").expect("group");
    std::fs::write(
        r.join("etc/shadow"),
        "root:*:19000:0:99999:7:::\nwww-data:*:19000:0:99999:7:::\n",
    )
    .expect("shadow");
    std::fs::write(r.join("etc/gshadow"), "root:*::\nwww-data:*::\n").expect("gshadow");
    std::fs::set_permissions(r.join("etc/shadow"), std::fs::Permissions::from_mode(0o640))
        .expect("chmod");
    std::fs::copy(
        repo_root().join("packaging/felhom-agent.tmpfiles"),
        r.join("usr/lib/tmpfiles.d/felhom-agent.conf"),
    )
    .expect("tmpfiles snippet");
    // The user may traverse down to where its home would be.
    for d in [r.to_path_buf(), r.join("var"), r.join("var/lib")] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    root
}

/// Stubs of the systemd commands the postinst calls (no systemd runs here), first on `PATH`.
fn stubs(r: &Path) -> PathBuf {
    let dir = r.join("stubs");
    std::fs::create_dir_all(&dir).expect("mkdir");
    for cmd in ["deb-systemd-helper", "deb-systemd-invoke", "systemctl"] {
        let p = dir.join(cmd);
        std::fs::write(&p, "#!/bin/sh\nexit 0\n").expect("stub");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    dir
}

/// Run the package's postinst `configure <from>` into the scratch root `r`.
/// Whether felhom-agent is listed in www-data's line of `r`'s group file.
fn in_www_data(r: &Path) -> bool {
    let group = std::fs::read_to_string(r.join("etc/group")).expect("group");
    group
        .lines()
        .find(|l| l.starts_with("www-data:"))
        .and_then(|l| l.split(':').nth(3))
        .is_some_and(|members| members.split(',').any(|m| m == "felhom-agent"))
}

/// [`postinst`]'s output (stdout, then stderr).
fn postinst(r: &Path, from: &str) -> String {
    std::fs::copy(
        repo_root().join("packaging/felhom-agent.sysusers"),
        r.join("usr/lib/sysusers.d/felhom-agent.conf"),
    )
    .expect("sysusers snippet");
    let path = format!(
        "{}:{}",
        stubs(r).display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("sh")
        .arg(repo_root().join("packaging/maintainer-scripts/postinst"))
        .args(["configure", from])
        .env("DPKG_ROOT", r)
        .env("PATH", path)
        .output()
        .expect("postinst");
    assert!(
        out.status.success(),
        "postinst failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// felhom-agent's passwd line in `r`: uid, gid, home.
fn agent_entry(r: &Path) -> (u32, u32, PathBuf) {
    let passwd = std::fs::read_to_string(r.join("etc/passwd")).expect("passwd");
    let line = passwd
        .lines()
        .find(|l| l.starts_with("felhom-agent:"))
        .unwrap_or_else(|| panic!("no felhom-agent in {passwd}"));
    let f: Vec<&str> = line.split(':').collect();
    (
        f[2].parse().expect("uid"),
        f[3].parse().expect("gid"),
        PathBuf::from(f[5]),
    )
}

/// As `uid:gid` (no supplementary groups), try to create each of the files sshd, PAM and a
/// user manager read from the home `home` of the scratch root `r`: the ones that were written.
fn plant(r: &Path, uid: u32, gid: u32, home: &Path) -> Vec<String> {
    let home = r.join(home.strip_prefix("/").unwrap_or(home));
    let mut written = Vec::new();
    for (folder, file, text) in [
        (
            ".ssh",
            "authorized_keys",
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIP planted\n",
        ),
        (
            ".config/systemd/user",
            "planted.service",
            "[Service]\nExecStart=/bin/sh -c 'id > /tmp/planted'\n",
        ),
        (
            "",
            ".pam_environment",
            "LD_PRELOAD DEFAULT=/tmp/planted.so\n",
        ),
    ] {
        let status = Command::new("setpriv")
            .args([
                &format!("--reuid={uid}"),
                &format!("--regid={gid}"),
                "--clear-groups",
                "--",
                "sh",
                "-c",
                "{ mkdir -p \"$1/$2\"; printf '%s' \"$4\" > \"$1/$2/$3\"; } 2>/dev/null",
                "sh",
            ])
            .arg(&home)
            .args([folder, file, text])
            .status()
            .expect("setpriv");
        let path = home.join(folder).join(file);
        if status.success() || path.exists() {
            written.push(path.display().to_string());
        }
    }
    written
}

#[test]
fn the_agents_user_finds_nothing_it_can_write_where_its_home_would_be() {
    // A fresh install.
    let root = scratch_root();
    let r = root.path();
    let said = postinst(r, "");
    let (uid, gid, home) = agent_entry(r);
    assert_ne!(uid, 0);
    // In no pmxcfs group: www-data reads the node's TLS key in /etc/pve.
    assert!(
        !in_www_data(r),
        "{}",
        std::fs::read_to_string(r.join("etc/group")).unwrap_or_default()
    );
    assert!(!said.contains("www-data"), "{said}");
    let written = plant(r, uid, gid, &home);
    assert!(
        written.is_empty(),
        "the agent's user (uid {uid}, home {}) planted {written:?}",
        home.display()
    );
    // Its account is expired and its user manager masked.
    let shadow = std::fs::read_to_string(r.join("etc/shadow")).expect("shadow");
    let line = shadow
        .lines()
        .find(|l| l.starts_with("felhom-agent:"))
        .unwrap_or_else(|| panic!("{shadow}"));
    assert_eq!(line.split(':').nth(7), Some("1"), "{line}");
    let mask = r.join(format!("etc/systemd/system/user@{uid}.service"));
    assert_eq!(
        std::fs::read_link(&mask).ok(),
        Some(PathBuf::from("/dev/null")),
        "{}",
        mask.display()
    );
}

#[test]
fn an_upgrade_moves_the_home_off_the_state_directory() {
    let root = scratch_root();
    let r = root.path();
    // What an older package made: the user's home is its state directory, which it owns.
    std::fs::write(
        r.join("usr/lib/sysusers.d/felhom-agent.conf"),
        "u felhom-agent - \"felhom agent\" /var/lib/felhom-agent /usr/sbin/nologin\nm felhom-agent www-data\n",
    )
    .expect("old snippet");
    let out = Command::new("systemd-sysusers")
        .arg(format!("--root={}", r.display()))
        .arg("felhom-agent.conf")
        .output()
        .expect("sysusers");
    assert!(out.status.success(), "{out:?}");
    let out = Command::new("systemd-tmpfiles")
        .arg(format!("--root={}", r.display()))
        .args(["--create", "felhom-agent.conf"])
        .output()
        .expect("tmpfiles");
    assert!(out.status.success(), "{out:?}");
    let (uid, gid, old_home) = agent_entry(r);
    assert_eq!(old_home, Path::new("/var/lib/felhom-agent"));
    assert!(in_www_data(r), "the older snippet's membership");
    // The upgrade.
    let said = postinst(r, "0.1.0");
    // The older membership (which reads the node's TLS key in /etc/pve) is removed, and
    // the script says so.
    assert!(
        !in_www_data(r),
        "{said}\n{}",
        std::fs::read_to_string(r.join("etc/group")).unwrap_or_default()
    );
    assert!(
        said.contains("removed the user felhom-agent from group www-data")
            && !said.contains("could not"),
        "{said}"
    );
    let (_, _, home) = agent_entry(r);
    assert_eq!(home, Path::new("/nonexistent"), "the home was not moved");
    let written = plant(r, uid, gid, &home);
    assert!(written.is_empty(), "planted {written:?}");
    // The state directory stays the user's.
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        std::fs::metadata(r.join("var/lib/felhom-agent"))
            .expect("state dir")
            .uid(),
        uid
    );
}

/// Run `felhom-agent doctor --json` for `w` in a private mount namespace whose passwd, group,
/// shadow, sshd drop-ins, systemd unit folder and `/run` are the scratch root's: the checks'
/// JSON.
fn doctor_on_node(w: &World, r: &Path) -> serde_json::Value {
    for d in ["etc/ssh/sshd_config.d", "etc/systemd/system", "run"] {
        std::fs::create_dir_all(r.join(d)).expect("mkdir");
    }
    let agent = w.command();
    let script = r#"set -e
r=$1; shift
for f in etc/passwd etc/group etc/shadow etc/ssh/sshd_config.d etc/systemd/system; do
  mount --bind "$r/$f" "/$f"
done
mount -t tmpfs tmpfs /run
mkdir -m 0755 /run/sshd
exec "$@"
"#;
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        script,
        "sh",
    ])
    .arg(r)
    .arg(agent.get_program())
    .args(agent.get_args())
    .args(["doctor", "--json"]);
    for (k, v) in agent.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let out = cmd.output().expect("unshare");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor printed no JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn check<'a>(doc: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    doc["checks"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no check {name} in {doc:#}"))
}

#[test]
fn doctor_fails_where_the_agents_user_could_log_in_and_passes_the_packaged_node() {
    assert!(
        Path::new("/usr/sbin/sshd").is_file(),
        "sshd is missing: tests/setup-package.sh installs openssh-server"
    );
    let w = World::demo();
    // A node as the old package left it: the home is the user's state directory (here the
    // scratch root's, which the user owns), the account not expired, nothing masked, no sshd
    // drop-in.
    let root = scratch_root();
    let r = root.path();
    // sshd -T needs its privilege separation user.
    let passwd = std::fs::read_to_string("/etc/passwd").expect("passwd");
    let sshd_line = passwd
        .lines()
        .find(|l| l.starts_with("sshd:"))
        .expect("the user sshd (openssh-server)");
    let mut scratch = std::fs::read_to_string(r.join("etc/passwd")).expect("scratch passwd");
    scratch.push_str(sshd_line);
    scratch.push('\n');
    std::fs::write(r.join("etc/passwd"), scratch).expect("scratch passwd");
    std::fs::write(
        r.join("usr/lib/sysusers.d/felhom-agent.conf"),
        format!(
            "u felhom-agent - \"felhom agent\" {}/var/lib/felhom-agent /usr/sbin/nologin\nm felhom-agent www-data\n",
            r.display()
        ),
    )
    .expect("old snippet");
    let out = Command::new("systemd-sysusers")
        .arg(format!("--root={}", r.display()))
        .arg("felhom-agent.conf")
        .output()
        .expect("sysusers");
    assert!(out.status.success(), "{out:?}");
    let (uid, gid, _) = agent_entry(r);
    let state = r.join("var/lib/felhom-agent");
    std::fs::create_dir_all(&state).expect("mkdir");
    nix::unistd::chown(&state, Some(uid.into()), Some(gid.into())).expect("chown");
    let doc = doctor_on_node(&w, r);
    assert_eq!(doc["ok"], false, "{doc:#}");
    for name in ["agent_user_home", "agent_user_login", "agent_user_manager"] {
        let c = check(&doc, name);
        assert_eq!(c["status"], "fail", "{name}: {c:#}");
        assert_eq!(c["code"], "agent_user_unconfined", "{name}: {c:#}");
    }
    let login = check(&doc, "agent_user_login")["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        login.contains("sshd would accept felhom-agent")
            && login.contains("DenyUsers felhom-agent"),
        "{login}"
    );
    assert!(check(&doc, "agent_user_home")["message"]
        .as_str()
        .unwrap_or_default()
        .contains("usermod -d /nonexistent felhom-agent"));
    assert!(check(&doc, "agent_user_manager")["message"]
        .as_str()
        .unwrap_or_default()
        .contains(&format!("systemctl mask user@{uid}.service")));

    // The same node after the package's upgrade, with the drop-in the package ships where dpkg
    // puts it.
    postinst(r, "0.1.0");
    std::fs::copy(
        repo_root().join("packaging/felhom-agent.sshd.conf"),
        r.join("etc/ssh/sshd_config.d/felhom-agent.conf"),
    )
    .expect("drop-in");
    let doc = doctor_on_node(&w, r);
    for name in ["agent_user_home", "agent_user_login", "agent_user_manager"] {
        let c = check(&doc, name);
        assert_eq!(c["status"], "pass", "{name}: {c:#}");
    }
    let login = check(&doc, "agent_user_login")["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        login.contains("DenyUsers felhom-agent") && login.contains("expired"),
        "{login}"
    );
}
