//! Pool membership from PVE's `/etc/pve/user.cfg`, read the way PVE reads it (pve-access-control
//! `src/PVE/AccessControl.pm`, `parse_user_config`; tests/data/pve-api-facts.md §3.4).
//!
//! A pool line is `pool:<poolid>:<comment(encoded)>:<vmid,vmid,...>:<storeid,...>:`. When read,
//! `,`, `;` and whitespace all separate list entries; an entry that is not a number is skipped;
//! a vmid listed by two pool lines belongs to the first only (PVE warns and ignores the second);
//! a line whose pool id is not valid is skipped whole. Several lines of one pool add up.
//!
//! The file is read with a size cap ([`MAX_USER_CFG_BYTES`]).
//!
//! The helper reads the whole file for its own pool check, as root. What it hands the agent's
//! user ([`needed_lines`]) is only the lines the agent reads (doctor's grants,
//! [`crate::doctor::UserCfg`]): `token:`, `group:`, `role:` and `acl:`. No `user:` line crosses
//! (its keys field holds the old base32 OATH secrets PVE still reads), nor `pool:` lines (only
//! the helper's own check reads them) or anything PVE ignores.

use std::io::Read;
use std::path::Path;

/// The largest `user.cfg` read. pmxcfs keeps every file in memory and caps a file well
/// below this.
pub const MAX_USER_CFG_BYTES: u64 = 8 * 1024 * 1024;

/// Why `user.cfg` could not be read.
#[derive(Debug, thiserror::Error)]
pub enum UserCfgError {
    /// Opening or reading failed.
    #[error("cannot read {path}: {source}; check user_cfg_path in the config (default /etc/pve/user.cfg) and that pmxcfs (pve-cluster) runs")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is over the cap.
    #[error("{path} is larger than {max} bytes; it is not PVE's user.cfg")]
    TooLarge {
        /// The file.
        path: String,
        /// The cap.
        max: u64,
    },
}

/// Read `user.cfg` (at most [`MAX_USER_CFG_BYTES`]); invalid UTF-8 is replaced.
pub fn read(path: &Path) -> Result<String, UserCfgError> {
    let io = |source| UserCfgError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    file.take(MAX_USER_CFG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > MAX_USER_CFG_BYTES {
        return Err(UserCfgError::TooLarge {
            path: path.display().to_string(),
            max: MAX_USER_CFG_BYTES,
        });
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The line types of `user.cfg` the agent reads ([`crate::doctor::UserCfg::parse`]): a token's
/// privilege separation, groups, roles and ACLs (pve-access-control `src/PVE/AccessControl.pm`
/// `parse_user_config`).
pub const NEEDED_TYPES: [&str; 4] = ["token", "group", "role", "acl"];

/// Perl's `\s` on PVE's byte strings: space, tab, line feed, carriage return, vertical tab,
/// form feed.
fn is_perl_ws(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0B' | '\x0C')
}

/// A line's type as `parse_user_config` takes it: its first `:`-separated field, blanks
/// trimmed.
fn line_type(line: &str) -> &str {
    line.split(':')
        .next()
        .unwrap_or("")
        .trim_matches(is_perl_ws)
}

/// What the root helper hands over of `text` (the whole `user.cfg`): the lines whose type is
/// one of [`NEEDED_TYPES`], byte for byte with their own line ends and in their order; nothing
/// else. Lines end where PVE and the agent's reader end them (at `\n` only), so a line PVE
/// reads as a `user:` line never crosses. [`crate::doctor::UserCfg::parse`] reads the answer
/// as it reads the whole file.
pub fn needed_lines(text: &str) -> String {
    text.split_inclusive('\n')
        .filter(|line| NEEDED_TYPES.contains(&line_type(line.trim_end_matches('\n'))))
        .collect()
}

/// Whether `id` is a pool id PVE accepts when reading: `[A-Za-z0-9.\-_]+` in one to three
/// `/`-separated parts.
pub fn valid_pool_id(id: &str) -> bool {
    let parts: Vec<&str> = id.split('/').collect();
    parts.len() <= 3
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        })
}

/// The pool `vmid` belongs to: the first valid pool line that lists it. `None`: no pool.
pub fn pool_of(text: &str, vmid: u32) -> Option<&str> {
    for line in text.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("pool:") else {
            continue;
        };
        let mut fields = rest.split(':');
        let Some(pool) = fields.next() else { continue };
        if !valid_pool_id(pool) {
            continue;
        }
        let _comment = fields.next();
        let Some(members) = fields.next() else {
            continue;
        };
        let listed = members
            .split(|c: char| c == ',' || c == ';' || c.is_whitespace())
            .filter(|e| !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()))
            .any(|e| e.trim_start_matches('0').parse::<u32>().ok() == Some(vmid));
        if listed {
            return Some(pool);
        }
    }
    None
}

/// Whether `vmid` is a member of `pool`.
pub fn in_pool(text: &str, pool: &str, vmid: u32) -> bool {
    pool_of(text, vmid) == Some(pool)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: &str = "user:agent@pve:1:0::::::\n\
        token:agent@pve!prov:0:1::\n\
        \n\
        pool:felhom:Fleet%20guests:100,1000,101:local-lvm,backups:\n\
        pool:other::205;206 207\t208:local:\n\
        \n\
        acl:1:/pool/felhom:agent@pve!prov:PVEVMAdmin:\n";

    #[test]
    fn members_split_on_commas_semicolons_and_whitespace() {
        for vmid in [100, 1000, 101] {
            assert!(in_pool(CFG, "felhom", vmid), "{vmid}");
        }
        for vmid in [205, 206, 207, 208] {
            assert_eq!(pool_of(CFG, vmid), Some("other"), "{vmid}");
            assert!(!in_pool(CFG, "felhom", vmid));
        }
        // 10 is a prefix of 100 and 1000, not a member.
        assert_eq!(pool_of(CFG, 10), None);
        assert_eq!(pool_of(CFG, 102), None);
    }

    #[test]
    fn a_vmid_of_two_pools_belongs_to_the_first() {
        let text = "pool:a::300:\npool:felhom::300,301:\n";
        assert!(!in_pool(text, "felhom", 300));
        assert!(in_pool(text, "a", 300));
        assert!(in_pool(text, "felhom", 301));
    }

    #[test]
    fn lines_of_one_pool_add_up() {
        let text = "pool:felhom::300:\npool:felhom::301:\n";
        assert!(in_pool(text, "felhom", 300) && in_pool(text, "felhom", 301));
    }

    #[test]
    fn other_lines_and_fields_never_count() {
        // The vmid in the comment, the storage list, an ACL path or a user line is no member.
        let text = "user:300@pve:1:0::::::\n\
            pool:felhom:300:local:300:\n\
            acl:1:/vms/301:agent@pve:PVEVMAdmin:\n\
            pool:felhom\n\
            pool:felhom:\n\
            #pool:felhom::302:\n\
            xpool:felhom::303:\n";
        for vmid in [300, 301, 302, 303] {
            assert!(!in_pool(text, "felhom", vmid), "{vmid}");
        }
    }

    #[test]
    fn invalid_pool_ids_and_entries_are_skipped() {
        let text = "pool:bad pool::400:\npool:a/b/c/d::401:\npool:felhom::x402,402a,+403,0404:\n";
        assert_eq!(pool_of(text, 400), None);
        assert_eq!(pool_of(text, 401), None);
        assert_eq!(pool_of(text, 402), None);
        assert_eq!(pool_of(text, 403), None);
        // PVE takes `int($vmid)` of a number with leading zeros.
        assert!(in_pool(text, "felhom", 404));
        assert!(valid_pool_id("tenant-a/sub.1/x_y"));
        assert!(!valid_pool_id(""));
        assert!(!valid_pool_id("a//b"));
    }

    #[test]
    fn a_huge_number_is_no_vmid() {
        let text = "pool:felhom::99999999999999999999999,500:\n";
        assert!(in_pool(text, "felhom", 500));
        assert_eq!(pool_of(text, u32::MAX), None);
    }

    /// A `user.cfg` as PVE writes it, with a user's old OATH secret in the keys field and the
    /// other lines the agent must not see.
    const WITH_SECRETS: &str = "user:root@pam:1:0:::root@example.invalid:::\n\
        user:alice@pve:1:0:Alice:Smith:alice@example.invalid:ops%20lead:SECRETBASE32OATHKEYAAAA:\n\
        token:alice@pve!ci:0:1:ci%20runs:\n\
        user:felhom@pve:1:0::::::\n\
        token:felhom@pve!agent:0:1::\n\
        \n\
        group:ops:alice@pve,felhom@pve:on%20call:\n\
        \n\
        pool:felhom:Fleet%20guests:100,101:local-lvm:\n\
        \n\
        role:felhom-audit:VM.Audit,Pool.Audit:\n\
        \n\
        acl:1:/pool/felhom:felhom@pve!agent:PVEVMAdmin:\n\
        acl:1:/storage:@ops:PVEDatastoreUser:\n\
        # a comment\n\
        domain:old-realm:SECRETREALM:\n";

    #[test]
    fn only_the_lines_the_agent_reads_cross() {
        let out = needed_lines(WITH_SECRETS);
        assert_eq!(
            out,
            "token:alice@pve!ci:0:1:ci%20runs:\n\
             token:felhom@pve!agent:0:1::\n\
             group:ops:alice@pve,felhom@pve:on%20call:\n\
             role:felhom-audit:VM.Audit,Pool.Audit:\n\
             acl:1:/pool/felhom:felhom@pve!agent:PVEVMAdmin:\n\
             acl:1:/storage:@ops:PVEDatastoreUser:\n"
        );
        for secret in ["SECRET", "user:", "pool:", "example.invalid", "#"] {
            assert!(!out.contains(secret), "{secret} crossed: {out}");
        }
        assert_eq!(
            crate::doctor::UserCfg::parse(&out),
            crate::doctor::UserCfg::parse(WITH_SECRETS)
        );
        // PVE trims each field: an indented user line, or one with blanks around its type,
        // is a user line, and stays; an indented ACL crosses.
        let text = "  user:bob@pve:1:0::::::SECRET:\n user :bob@pve:1:0::::::SECRET:\n\
                    \tacl:1:/:bob@pve:PVEAuditor:\r\nuser:c@pve:1:0::::::SECRET:\racl:1:/:x:y:\n";
        assert_eq!(needed_lines(text), "\tacl:1:/:bob@pve:PVEAuditor:\r\n");
        // The last line keeps its own end, or none.
        assert_eq!(
            needed_lines("user:a@pve:1\nacl:1:/:a@pve:X:\r"),
            "acl:1:/:a@pve:X:\r"
        );
        assert_eq!(needed_lines(""), "");
    }

    proptest::proptest! {
        #[test]
        fn any_text_never_panics_and_the_needed_lines_read_as_the_whole(text in "[\\PC\t\n\r\u{0}\u{b}\u{c}]*") {
            let crossed = needed_lines(&text);
            proptest::prop_assert_eq!(
                crate::doctor::UserCfg::parse(&crossed),
                crate::doctor::UserCfg::parse(&text)
            );
            proptest::prop_assert_eq!(needed_lines(&crossed), crossed);
        }

        #[test]
        fn user_cfg_shaped_text_reads_the_same_and_no_user_line_crosses(
            lines in proptest::collection::vec(
                (
                    "[ \t]{0,2}(user|token|group|role|acl|pool|domain|#|x|)[ \t]{0,2}",
                    proptest::collection::vec("[ \t]?[a-z0-9@!/,;.%-]{0,6}[ \t\r]?", 0..7),
                    "\r?",
                ),
                0..16,
            )
        ) {
            let text: String = lines
                .iter()
                .map(|(kind, fields, cr)| format!("{kind}:{}{cr}\n", fields.join(":")))
                .collect();
            let crossed = needed_lines(&text);
            proptest::prop_assert_eq!(
                crate::doctor::UserCfg::parse(&crossed),
                crate::doctor::UserCfg::parse(&text)
            );
            for line in crossed.lines() {
                // PVE's reading of the line's type (`split(/:/, $line)`, each field trimmed).
                let kind = line.split(':').next().unwrap_or("").trim_matches(|c: char| " \t\r\n\x0B\x0C".contains(c));
                proptest::prop_assert!(["token", "group", "role", "acl"].contains(&kind), "{:?} crossed: {:?}", line, crossed);
            }
            // Every token, group, role and ACL line crosses, in its order.
            let wanted: Vec<&str> = text.lines().filter(|l| NEEDED_TYPES.contains(&line_type(l))).collect();
            proptest::prop_assert_eq!(crossed.lines().collect::<Vec<_>>(), wanted);
        }
    }

    #[test]
    fn reading_is_capped() {
        let d = tempfile::tempdir().expect("tmp");
        let p = d.path().join("user.cfg");
        std::fs::write(&p, CFG).expect("write");
        assert_eq!(read(&p).expect("read"), CFG);
        let f = std::fs::File::create(&p).expect("create");
        f.set_len(MAX_USER_CFG_BYTES + 1).expect("grow");
        assert!(matches!(read(&p), Err(UserCfgError::TooLarge { .. })));
        assert!(matches!(
            read(&d.path().join("missing")),
            Err(UserCfgError::Io { .. })
        ));
    }
}
