//! A container's own config in pmxcfs (`/etc/pve/nodes/<node>/lxc/<vmid>.conf`), read by the
//! exec helper before every request: it runs commands only in a container that cannot reach
//! the node as root.
//!
//! The file is PVE's `key: value` format (pve-container `src/PVE/LXC/Config.pm`,
//! `parse_pct_config`): the current config first, then one `[section]` per snapshot and
//! `[pve:pending]` for pending changes. Only the current config counts: reading stops at the
//! first section header. Lines are read as PVE reads them (anchored at the first byte, so an
//! indented line is skipped as PVE skips it; a header's name has at least two characters; white
//! space is ASCII only, since PVE matches `\s` on the file's bytes). Refused ([`check`]):
//!
//! - no `unprivileged: 1`: a privileged container's root is the node's root;
//! - any `lxc.` key (`lxc.key: v` or `lxc.key = v`) but `lxc.environment.runtime` (PVE's own
//!   spelling of the `env` option): raw LXC settings (capabilities, cgroup devices, mounts,
//!   AppArmor) can undo the isolation;
//! - a mount point or root filesystem whose volume is a path (`mpN: /srv/x,mp=/x`): a bind or
//!   device mount of the node's filesystem;
//! - any `devN` key: a device of the node passed through.
//!
//! The file is opened as root without following links: the node folder, `lxc` and the file
//! each with `O_NOFOLLOW`, the file must be a regular file, and at most
//! [`MAX_CT_CONF_BYTES`] are read.

use std::io::Read;
use std::os::fd::AsFd;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{open, OFlag};
use nix::sys::stat::{fstat, Mode, SFlag};

use crate::error::outside_text;
use crate::nofollow;

/// The most bytes of a container config read (pmxcfs caps a file far below this).
pub const MAX_CT_CONF_BYTES: u64 = 1024 * 1024;

/// Read `<nodes_dir>/<node>/lxc/<vmid>.conf` without following links, at most
/// [`MAX_CT_CONF_BYTES`]. `Err`: why not, for a message.
pub fn read(nodes_dir: &Path, node: &str, vmid: u32) -> Result<String, String> {
    let path = nodes_dir
        .join(node)
        .join("lxc")
        .join(format!("{vmid}.conf"));
    let show = path.display().to_string();
    if node.is_empty() || node.contains('/') || node == "." || node == ".." {
        return Err(format!("the node name {node:?} is not a folder name"));
    }
    let fail = |what: &str, e: Errno| -> String {
        match e {
            Errno::ELOOP | Errno::ENOTDIR => format!(
                "{show}: {what} is a symbolic link or not a folder; the helper follows no link there"
            ),
            Errno::ENOENT => format!("{show} does not exist ({what} is missing)"),
            e => format!("{show}: {what} cannot be opened ({})", e.desc()),
        }
    };
    let base = open(
        nodes_dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| fail("the nodes folder", e))?;
    let node_dir =
        nofollow::folder(base.as_fd(), node).map_err(|e| fail("the node's folder", e))?;
    let lxc_dir =
        nofollow::folder(node_dir.as_fd(), "lxc").map_err(|e| fail("the lxc folder", e))?;
    let fd = nofollow::file(lxc_dir.as_fd(), format!("{vmid}.conf").as_str())
        .map_err(|e| fail("the file", e))?;
    let meta = fstat(fd.as_fd()).map_err(|e| fail("the file", e))?;
    if SFlag::from_bits_truncate(meta.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return Err(format!("{show} is not a regular file"));
    }
    let mut bytes = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_CT_CONF_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{show} cannot be read ({e})"))?;
    if bytes.len() as u64 > MAX_CT_CONF_BYTES {
        return Err(format!(
            "{show} is larger than {MAX_CT_CONF_BYTES} bytes; it is no container config"
        ));
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Whether `key` is `<prefix>` followed by digits only.
fn numbered(key: &str, prefix: &str) -> bool {
    key.strip_prefix(prefix)
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The volume of a mount point value: the `volume=` part, or the first part without `=`.
fn volume_of(value: &str) -> &str {
    let parts = value.split(',').map(str::trim);
    for part in parts.clone() {
        if let Some(v) = part.strip_prefix("volume=") {
            return v;
        }
    }
    parts.into_iter().find(|p| !p.contains('=')).unwrap_or("")
}

/// One line of a container config as pve-container `PVE/LXC/Config.pm` `parse_pct_config`
/// reads it. Its patterns are anchored at the line's first byte, so an indented line matches
/// none of them and PVE ignores it (with a warning): it never reaches LXC.
#[derive(Debug, PartialEq, Eq)]
enum Line<'a> {
    /// Empty or blank.
    Blank,
    /// `[pve:pending]` or `[<snapshot>]`: the current config ends here.
    Section,
    /// `#…`: the description.
    Comment,
    /// `lxc.<key>: value` or `lxc.<key> = value`.
    Lxc(&'a str),
    /// `<key>: value` with PVE's key pattern `[a-z][a-z_]*\d*` and a non-empty value.
    Option(&'a str, &'a str),
    /// Anything else: PVE warns and skips it.
    Ignored,
}

/// Perl's `\s` on the bytes PVE reads (`file_get_contents` gives a byte string, so `\s` is
/// ASCII only: a no-break space or any other Unicode space is not white space to PVE).
fn perl_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0b' | '\x0c')
}

fn classify(line: &str) -> Line<'_> {
    if line.chars().all(perl_space) {
        return Line::Blank;
    }
    // `^\[pve:pending\]\s*$` (any case) and `^\[([a-z][a-z0-9_\-]+)\]\s*$` (any case): a
    // name of at least two characters.
    if let Some(inner) = line
        .trim_end_matches(perl_space)
        .strip_prefix('[')
        .and_then(|l| l.strip_suffix(']'))
    {
        let mut bytes = inner.bytes();
        let named = bytes.next().is_some_and(|b| b.is_ascii_alphabetic())
            && inner.len() >= 2
            && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if inner.eq_ignore_ascii_case("pve:pending") || named {
            return Line::Section;
        }
    }
    if line.starts_with('#') {
        return Line::Comment;
    }
    if line.starts_with("lxc.") {
        // `^(lxc\.[a-z0-9_\-\.]+)(:|\s*=)`
        let end = line
            .bytes()
            .position(|b| {
                !(b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-' | b'.'))
            })
            .unwrap_or(line.len());
        let rest = &line[end..];
        if end > 4
            && (rest.starts_with(':') || rest.trim_start_matches(perl_space).starts_with('='))
        {
            return Line::Lxc(&line[..end]);
        }
        return Line::Ignored;
    }
    // `^([a-z][a-z_]*\d*):\s*(.+?)\s*$`
    let Some((key, value)) = line.split_once(':') else {
        return Line::Ignored;
    };
    let letters = key.trim_end_matches(|c: char| c.is_ascii_digit());
    let valid = letters.starts_with(|c: char| c.is_ascii_lowercase())
        && letters.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
    let value = value.trim_matches(perl_space);
    if !valid || value.is_empty() {
        return Line::Ignored;
    }
    Line::Option(key, value)
}

/// Whether the current config (up to the first section header) is that of an unprivileged
/// container without host access, read line by line as PVE reads it (see [`Line`]).
/// `lxc.environment.runtime` lines are PVE's own spelling of the `env` option (PVE 9 writes
/// one per variable, `write_pct_config`) and pass; every other `lxc.` key is refused.
/// `Err`: every reason found, joined.
pub fn check(text: &str) -> Result<(), String> {
    let mut unprivileged = false;
    let mut reasons: Vec<String> = Vec::new();
    for line in text.split('\n') {
        let (key, value) = match classify(line) {
            Line::Section => break,
            Line::Blank | Line::Comment | Line::Ignored => continue,
            Line::Lxc("lxc.environment.runtime") => continue,
            Line::Lxc(key) => {
                reasons.push(format!("it sets the raw LXC key {}", outside_text(key)));
                continue;
            }
            Line::Option(key, value) => (key, value),
        };
        if key == "unprivileged" {
            unprivileged = value == "1";
        } else if numbered(key, "dev") {
            reasons.push(format!("it passes a device of the node through ({key})"));
        } else if numbered(key, "mp") || key == "rootfs" {
            let volume = volume_of(value);
            if volume.starts_with('/') {
                reasons.push(format!(
                    "{key} mounts the node's path {} (a bind or device mount)",
                    outside_text(volume)
                ));
            }
        }
    }
    if !unprivileged {
        reasons.insert(
            0,
            "it is not unprivileged (no `unprivileged: 1`)".to_string(),
        );
    }
    if reasons.is_empty() {
        Ok(())
    } else {
        Err(reasons.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAIN: &str = "arch: amd64\nhostname: ct\nmemory: 512\n\
        net0: name=eth0,bridge=vmbr0,ip=dhcp\nostype: debian\n\
        rootfs: local-lvm:vm-101-disk-0,size=8G\nmp0: local-lvm:vm-101-disk-1,mp=/data,size=2G\n\
        unprivileged: 1\n";

    #[test]
    fn an_unprivileged_container_on_volumes_passes() {
        assert_eq!(check(PLAIN), Ok(()));
        // Comments and a `volume=` spelling of a storage volume.
        let t = format!("#note: lxc.x\n{PLAIN}mp1: volume=local:101/vm-101-disk-2.raw,mp=/x\n");
        assert_eq!(check(&t), Ok(()));
    }

    #[test]
    fn what_reaches_the_node_is_refused() {
        let cases = [
            ("arch: amd64\nhostname: ct\n", "not unprivileged"),
            ("unprivileged: 0\n", "not unprivileged"),
            (&format!("{PLAIN}lxc.cap.drop:\n"), "lxc.cap.drop"),
            (
                &format!("{PLAIN}lxc.mount.entry: /srv x none bind 0 0\n"),
                "raw LXC key",
            ),
            (&format!("{PLAIN}mp1: /srv/share,mp=/share\n"), "/srv/share"),
            (
                &format!("{PLAIN}mp2: volume=/dev/sdb1,mp=/disk\n"),
                "/dev/sdb1",
            ),
            (&format!("{PLAIN}dev0: /dev/ttyUSB0\n"), "dev0"),
            ("rootfs: /srv/ct,size=0\nunprivileged: 1\n", "rootfs"),
        ];
        for (text, word) in cases {
            let why = check(text).expect_err(text);
            assert!(why.contains(word), "{why} / {text}");
        }
    }

    #[test]
    fn lines_are_read_as_pve_reads_them() {
        // `lxc.<key> = value` is a raw key too (parse_pct_config accepts `:` and `=`).
        let why = check(&format!("{PLAIN}lxc.idmap = u 0 100000 65536\n")).expect_err("idmap");
        assert!(why.contains("lxc.idmap"), "{why}");
        let why = check(&format!("{PLAIN}lxc.cap.drop=\n")).expect_err("cap");
        assert!(why.contains("lxc.cap.drop"), "{why}");
        // The `env` option as PVE 9 writes it is no raw key.
        let env = format!(
            "{PLAIN}lxc.environment.runtime: LANG=C.UTF-8\nlxc.environment.runtime: TZ=UTC\n"
        );
        assert_eq!(check(&env), Ok(()));
        // An indented line matches none of PVE's patterns: PVE skips it, so it neither makes
        // the container unprivileged nor is it a key LXC sees.
        assert!(check("arch: amd64\n unprivileged: 1\n").is_err());
        assert_eq!(check(&format!("{PLAIN} lxc.cap.drop: x\n")), Ok(()));
        // A bracketed line that is no section header does not end the current config.
        let why = check(&format!(
            "{PLAIN}[not a section]\nlxc.apparmor.profile: unconfined\n"
        ))
        .expect_err("after a non-section");
        assert!(why.contains("lxc.apparmor.profile"), "{why}");
        // An empty value is no option.
        assert!(check("unprivileged:\n").is_err());
    }

    #[test]
    fn section_headers_are_pves_and_no_other() {
        // `[a-z][a-z0-9_\-]+`: a one-letter name is no header, so what follows it is still the
        // current config.
        let why = check(&format!("{PLAIN}[a]\nlxc.apparmor.profile: unconfined\n"))
            .expect_err("after [a]");
        assert!(why.contains("lxc.apparmor.profile"), "{why}");
        assert_eq!(
            check(&format!("{PLAIN}[ab]\nlxc.apparmor.profile: unconfined\n")),
            Ok(())
        );
        // `\s*$` on the bytes PVE reads: a no-break space (0xC2 0xA0) is no white space, so a
        // header followed by one is no header either.
        let why = check(&format!(
            "{PLAIN}[snap1]\u{a0}\nlxc.apparmor.profile: unconfined\n"
        ))
        .expect_err("after [snap1] + NBSP");
        assert!(why.contains("lxc.apparmor.profile"), "{why}");
        let why = check(&format!(
            "{PLAIN}[pve:pending]\u{a0}\nlxc.apparmor.profile: unconfined\n"
        ))
        .expect_err("after [pve:pending] + NBSP");
        assert!(why.contains("lxc.apparmor.profile"), "{why}");
        // ASCII white space after a header is PVE's `\s`.
        assert_eq!(
            check(&format!(
                "{PLAIN}[snap1] \t\r\nlxc.apparmor.profile: unconfined\n"
            )),
            Ok(())
        );
    }

    #[test]
    fn values_are_trimmed_of_ascii_white_space_only() {
        // `^([a-z][a-z_]*\d*):\s*(.+?)\s*$`: a no-break space stays in the value, and
        // `1\u{a0}` is not PVE's `1` (check_type refuses it and PVE skips the line).
        assert!(check("arch: amd64\nunprivileged: 1\u{a0}\n").is_err());
        assert!(check("arch: amd64\nunprivileged:\u{a0}1\n").is_err());
        assert_eq!(check("arch: amd64\nunprivileged: \t1 \r\n"), Ok(()));
    }

    #[test]
    fn only_the_current_section_counts() {
        // A snapshot that was privileged, pending raw keys: the current config decides.
        let t = format!(
            "{PLAIN}\n[snap1]\nunprivileged: 0\nlxc.apparmor.profile: unconfined\n\
             [pve:pending]\nmp3: /srv,mp=/srv\n"
        );
        assert_eq!(check(&t), Ok(()));
        // A privileged current config with an unprivileged snapshot is refused.
        let t = "hostname: ct\n[snap1]\nunprivileged: 1\n";
        assert!(check(t).is_err());
    }

    #[test]
    fn the_file_is_read_without_links_and_bounded() {
        let d = tempfile::tempdir().expect("tmp");
        let lxc = d.path().join("pve1/lxc");
        std::fs::create_dir_all(&lxc).expect("mkdir");
        std::fs::write(lxc.join("101.conf"), PLAIN).expect("write");
        assert_eq!(read(d.path(), "pve1", 101).expect("read"), PLAIN);
        assert!(read(d.path(), "pve1", 102)
            .expect_err("missing")
            .contains("does not exist"));
        // A link as the file.
        std::os::unix::fs::symlink(lxc.join("101.conf"), lxc.join("103.conf")).expect("ln");
        assert!(read(d.path(), "pve1", 103)
            .expect_err("link")
            .contains("symbolic link"));
        // A link as the node's folder or as `lxc`.
        std::os::unix::fs::symlink(d.path().join("pve1"), d.path().join("pve2")).expect("ln");
        assert!(read(d.path(), "pve2", 101)
            .expect_err("link")
            .contains("symbolic link"));
        std::fs::create_dir(d.path().join("pve3")).expect("mkdir");
        std::os::unix::fs::symlink(&lxc, d.path().join("pve3/lxc")).expect("ln");
        assert!(read(d.path(), "pve3", 101)
            .expect_err("link")
            .contains("symbolic link"));
        assert!(read(d.path(), "../x", 101).is_err());
        // Too large.
        let f = std::fs::File::create(lxc.join("104.conf")).expect("create");
        f.set_len(MAX_CT_CONF_BYTES + 1).expect("grow");
        assert!(read(d.path(), "pve1", 104)
            .expect_err("large")
            .contains("larger"));
    }
}
