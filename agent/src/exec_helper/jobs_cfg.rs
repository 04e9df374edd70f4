//! The cluster's backup jobs, from `/etc/pve/jobs.cfg` read the way PVE reads it
//! (tests/data/pve-jobs-facts.md).
//!
//! The file is a section config (pve-common `src/PVE/SectionConfig.pm` `parse_config`, through
//! `src/PVE/Job/Registry.pm` as pve-manager `PVE/Jobs.pm` registers it): a section starts at a
//! line `<type>: <id>` outside a section and holds the indented `<key> <value>` lines after it
//! up to the next empty line; lines starting with `#` (after blanks) are skipped anywhere, and
//! other lines are ignored. Backup jobs are the sections of type `vzdump`; other job types
//! (`realm-sync`, …) live in the same file.
//!
//! Two sides, one reading of the file:
//! - the root exec helper hands the agent [`needed_lines`]: of each `vzdump` section its id and
//!   the keys of [`NEEDED_KEYS`], in their order, and nothing else: no other job type, no
//!   comment, none of the job's other keys (mail addresses, notes templates, storage, a backup
//!   provider's options…);
//! - the agent reads that into [`BackupJob`]s ([`parse`]), each value decided as PVE decides
//!   it (an invalid value is dropped as PVE drops it, the first valid one of a repeated key
//!   counts), and [`BackupJob::runs_on`] and [`BackupJob::selection`] say whether and what the
//!   job backs up, as pve-manager does when the job starts.
//!
//! Both are pure, take any text and never panic; [`parse`] reads the helper's answer and the
//! whole file alike (the property tests below hold them equal).

use std::collections::BTreeSet;

/// The keys of a backup job the agent needs: when and where it runs, and which guests it
/// selects (pve-guest-common `src/PVE/VZDump/Common.pm` `$confdesc`; `enabled` and
/// `schedule` from pve-common `src/PVE/Job/Registry.pm`).
pub const NEEDED_KEYS: [&str; 7] = [
    "schedule", "all", "enabled", "exclude", "pool", "node", "vmid",
];

/// The longest schedule PVE accepts (`schedule`'s `maxLength`, pve-common
/// `src/PVE/Job/Registry.pm`).
const SCHEDULE_MAX_BYTES: usize = 128;

/// Perl's `\s` on PVE's byte strings: space, tab, line feed, carriage return, vertical tab,
/// form feed.
fn is_ws(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0B' | '\x0C')
}

/// One section as `parse_config` walks it: its type, its id and its key lines (a key without
/// a value has `None`), in the file's order.
#[derive(Debug)]
struct Section<'a> {
    kind: &'a str,
    id: &'a str,
    keys: Vec<(&'a str, Option<&'a str>)>,
}

/// A line Perl takes for false ends a section (`while ($line = $nextline->())`) and is skipped
/// outside one: the empty line and `0`.
fn perl_false(line: &str) -> bool {
    line.is_empty() || line == "0"
}

/// `^\s*#`: skipped wherever it is, without ending a section.
fn is_comment(line: &str) -> bool {
    line.trim_start_matches(is_ws).starts_with('#')
}

/// `parse_section_header`: `^(\S+):\s*(\S+)\s*$`, the type taking the last `:` that leaves
/// an id.
fn header(line: &str) -> Option<(&str, &str)> {
    let line = line.trim_end_matches(is_ws);
    if line.is_empty() || line.starts_with(is_ws) {
        return None;
    }
    match line.find(is_ws) {
        None => {
            // One word: the type is everything up to the last `:` that is not its last
            // character.
            let last = line.chars().next_back()?;
            let head = &line[..line.len() - last.len_utf8()];
            let at = head.rfind(':')?;
            (at > 0).then(|| (&line[..at], &line[at + 1..]))
        }
        Some(gap) => {
            let id = line[gap..].trim_start_matches(is_ws);
            if id.contains(is_ws) {
                return None;
            }
            let kind = line[..gap].strip_suffix(':')?;
            (!kind.is_empty()).then_some((kind, id))
        }
    }
}

/// A key line: `^\s+(\S+)(\s+(.*\S))?\s*$`.
fn key_line(line: &str) -> Option<(&str, Option<&str>)> {
    if !line.starts_with(is_ws) {
        return None;
    }
    let rest = line.trim_matches(is_ws);
    if rest.is_empty() {
        return None;
    }
    Some(match rest.find(is_ws) {
        None => (rest, None),
        Some(gap) => (&rest[..gap], Some(rest[gap..].trim_start_matches(is_ws))),
    })
}

/// The sections of `text`, as pve-common `SectionConfig::parse_config` finds them.
fn sections(text: &str) -> Vec<Section<'_>> {
    let mut lines = text.split('\n').filter(|l| !is_comment(l));
    let mut out = Vec::new();
    while let Some(line) = lines.next() {
        if perl_false(line) {
            continue;
        }
        let Some((kind, id)) = header(line) else {
            continue;
        };
        let mut keys = Vec::new();
        for line in lines.by_ref() {
            if perl_false(line) {
                break;
            }
            keys.extend(key_line(line));
        }
        out.push(Section { kind, id, keys });
    }
    out
}

/// What the root helper hands over of `text` (the whole `jobs.cfg`): each `vzdump` section's
/// header and its key lines of [`NEEDED_KEYS`] (in their order, repeats too), one empty line
/// after each section; nothing else. [`parse`] reads it as it reads the whole file.
pub fn needed_lines(text: &str) -> String {
    let mut out = String::new();
    for s in sections(text) {
        if s.kind != "vzdump" {
            continue;
        }
        out.push_str("vzdump: ");
        out.push_str(s.id);
        out.push('\n');
        for (key, value) in s.keys {
            if !NEEDED_KEYS.contains(&key) {
                continue;
            }
            out.push('\t');
            out.push_str(key);
            if let Some(v) = value {
                out.push(' ');
                out.push_str(v);
            }
            out.push('\n');
        }
        out.push('\n');
    }
    out
}

/// One backup job (a `vzdump` section), its values as PVE reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupJob {
    /// The section id (`pvesh … /cluster/backup/<id>`). Outside text: escape it to show it.
    pub id: String,
    /// `schedule`; `None`: none valid, and PVE drops the job (it is required).
    pub schedule: Option<String>,
    /// `all 1`.
    pub all: bool,
    /// `enabled` (default 1).
    pub enabled: bool,
    /// `exclude`, when valid (`None`: no valid `exclude`).
    pub exclude: Option<BTreeSet<u32>>,
    /// `pool`.
    pub pool: Option<String>,
    /// `node` (`None`: it runs on every node), when a valid node name.
    pub node: Option<String>,
    /// `vmid`, when valid.
    pub vmid: Option<BTreeSet<u32>>,
}

/// Which guests a job backs up when it starts ([`BackupJob::selection`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection<'a> {
    /// The members of this pool.
    Pool(&'a str),
    /// These vmids.
    Vmids(&'a BTreeSet<u32>),
    /// Every guest on the node but these.
    All {
        /// Left out.
        exclude: BTreeSet<u32>,
    },
    /// None: PVE refuses the job's keys when it starts (why).
    Refused(&'static str),
}

impl BackupJob {
    /// Whether the job runs on `node`: enabled, with a schedule, and for every node or this
    /// one (pve-manager `PVE/Jobs.pm` `run_jobs`).
    pub fn runs_on(&self, node: &str) -> bool {
        self.enabled && self.schedule.is_some() && self.node.as_deref().is_none_or(|n| n == node)
    }

    /// Which guests it backs up when it starts: pve-manager `PVE/VZDump.pm`
    /// `verify_vzdump_parameters` (`vmid` conflicts with `all`, `exclude` and `pool`; an
    /// `exclude` without `pool` makes the job an `all` job), then `get_included_guests` (a
    /// `pool` first, then `vmid`, then `all` less `exclude`).
    pub fn selection(&self) -> Selection<'_> {
        // Perl's truth: a pool named `0` counts as none.
        let pool = self.pool.as_deref().filter(|p| *p != "0");
        if self.vmid.is_some() {
            if self.all {
                return Selection::Refused("all conflicts with vmid");
            }
            if self.exclude.is_some() {
                return Selection::Refused("exclude conflicts with vmid");
            }
            if pool.is_some() {
                return Selection::Refused("pool conflicts with vmid");
            }
        }
        if let Some(pool) = pool {
            return Selection::Pool(pool);
        }
        if let Some(vmids) = &self.vmid {
            return Selection::Vmids(vmids);
        }
        if self.all || self.exclude.is_some() {
            return Selection::All {
                exclude: self.exclude.clone().unwrap_or_default(),
            };
        }
        Selection::Refused("it selects no guest (no vmid, all or pool)")
    }
}

/// A value as pve-common `SectionConfig::check_value` takes it (`None`: refused, the key is
/// dropped). A key without a value is `1` for a boolean and refused otherwise; a carriage
/// return inside a value is refused.
fn checked(value: Option<&str>, boolean: bool) -> Option<&str> {
    let v = match value {
        None if boolean => "1",
        None => return None,
        Some(v) => v,
    };
    (!v.contains('\r')).then_some(v)
}

/// A boolean: exactly `1` or `0` (pve-common `JSONSchema::check_type`).
fn boolean(value: Option<&str>) -> Option<bool> {
    match checked(value, true)? {
        "1" => Some(true),
        "0" => Some(false),
        _ => None,
    }
}

/// A `pve-vmid-list`: pve-common `ParseUtils::split_list` (NUL-separated when it holds a
/// NUL, else `,`, `;` and blanks), each entry `^[1-9][0-9]{2,8}$` (`pve_verify_vmid`); one
/// bad entry refuses the whole value. An empty list is valid.
fn vmid_list(value: Option<&str>) -> Option<BTreeSet<u32>> {
    let v = checked(value, false)?;
    let items: Vec<&str> = if v.contains('\0') {
        let mut parts: Vec<&str> = v.split('\0').collect();
        while parts.last() == Some(&"") {
            parts.pop();
        }
        parts
    } else {
        v.split(|c| is_ws(c) || c == ',' || c == ';')
            .filter(|s| !s.is_empty())
            .collect()
    };
    items
        .into_iter()
        .map(|item| {
            let b = item.as_bytes();
            let valid = (3..=9).contains(&b.len())
                && matches!(b[0], b'1'..=b'9')
                && b.iter().all(u8::is_ascii_digit);
            if valid {
                item.parse().ok()
            } else {
                None
            }
        })
        .collect()
}

/// A node name (`pve-node`, pve-common `pve_verify_node_name`):
/// `^[a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?$`.
fn node_name(value: Option<&str>) -> Option<String> {
    let v = checked(value, false)?;
    let b = v.as_bytes();
    let ok = !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-');
    ok.then(|| v.to_string())
}

/// The backup jobs of `text` (the helper's answer, or the whole file): every `vzdump`
/// section, in the file's order; a later section with the id of an earlier one takes its
/// place, as PVE keeps the later one.
pub fn parse(text: &str) -> Vec<BackupJob> {
    let mut jobs: Vec<BackupJob> = Vec::new();
    for s in sections(text) {
        if s.kind != "vzdump" {
            continue;
        }
        let mut job = BackupJob {
            id: s.id.to_string(),
            schedule: None,
            all: false,
            enabled: true,
            exclude: None,
            pool: None,
            node: None,
            vmid: None,
        };
        // A repeated key is refused once the key holds a value: the first valid one counts.
        let mut set: BTreeSet<&str> = BTreeSet::new();
        for (key, value) in s.keys {
            if set.contains(key) {
                continue;
            }
            let taken = match key {
                "schedule" => checked(value, false)
                    .filter(|v| v.len() <= SCHEDULE_MAX_BYTES)
                    .map(|v| job.schedule = Some(v.to_string()))
                    .is_some(),
                "all" => boolean(value).map(|b| job.all = b).is_some(),
                "enabled" => boolean(value).map(|b| job.enabled = b).is_some(),
                "exclude" => vmid_list(value).map(|l| job.exclude = Some(l)).is_some(),
                "pool" => checked(value, false)
                    .map(|v| job.pool = Some(v.to_string()))
                    .is_some(),
                "node" => node_name(value).map(|n| job.node = Some(n)).is_some(),
                "vmid" => vmid_list(value).map(|l| job.vmid = Some(l)).is_some(),
                _ => false,
            };
            if taken {
                set.insert(key);
            }
        }
        match jobs.iter_mut().find(|j| j.id == job.id) {
            Some(earlier) => *earlier = job,
            None => jobs.push(job),
        }
    }
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The brief's example, with another job type and the keys the agent must never see.
    const SAMPLE: &str = "vzdump: backup-6f1a2b3c-1234\n\
        \tschedule 21:00\n\
        \tall 1\n\
        \tenabled 1\n\
        \texclude 990000,990001\n\
        \tmode snapshot\n\
        \tstorage local\n\
        \tnotes-template {{guestname}} SECRET-NOTES\n\
        \tmailto root@secret.example\n\
        \tnode pve1\n\
        \n\
        realm-sync: sync-ldap\n\
        \tschedule daily\n\
        \trealm ldap\n\
        \tcomment SECRET-REALM\n";

    fn set(v: &[u32]) -> BTreeSet<u32> {
        v.iter().copied().collect()
    }

    #[test]
    fn only_the_backup_jobs_needed_lines_cross() {
        let out = needed_lines(SAMPLE);
        assert_eq!(
            out,
            "vzdump: backup-6f1a2b3c-1234\n\tschedule 21:00\n\tall 1\n\tenabled 1\n\
             \texclude 990000,990001\n\tnode pve1\n\n"
        );
        for secret in [
            "SECRET", "mailto", "notes", "storage", "realm", "ldap", "mode",
        ] {
            assert!(!out.contains(secret), "{secret} crossed: {out}");
        }
        // Comments, other keys, ignored lines and a section of another type with every
        // needed key: none of it crosses.
        let text = "# vzdump: commented-out\n\
            realm-sync: r1\n\tpool felhom\n\tall 1\n\n\
            vzdump: b1\n\
            \t# exclude 990000 (a comment inside)\n\
            \tprune-backups keep-last=3\n\
            \tfleecing enabled=1,storage=SECRET\n\
            stray line SECRET\n\
            \tvmid 100\n\
            \tperformance max-workers=2\n";
        assert_eq!(needed_lines(text), "vzdump: b1\n\tvmid 100\n\n");
        assert_eq!(needed_lines(""), "");
        assert_eq!(needed_lines("realm-sync: r\n\tschedule daily\n"), "");
    }

    #[test]
    fn a_job_reads_as_pve_reads_it() {
        let jobs = parse(SAMPLE);
        assert_eq!(
            jobs,
            vec![BackupJob {
                id: "backup-6f1a2b3c-1234".into(),
                schedule: Some("21:00".into()),
                all: true,
                enabled: true,
                exclude: Some(set(&[990000, 990001])),
                pool: None,
                node: Some("pve1".into()),
                vmid: None,
            }]
        );
        assert_eq!(parse(&needed_lines(SAMPLE)), jobs);
        assert!(jobs[0].runs_on("pve1") && !jobs[0].runs_on("pve2"));
        assert_eq!(
            jobs[0].selection(),
            Selection::All {
                exclude: set(&[990000, 990001])
            }
        );
    }

    #[test]
    fn keys_indented_by_spaces_crlf_and_headers_without_a_blank() {
        let text = "vzdump:b1\r\n    schedule  mon..fri 21:00  \r\n  all\r\n \texclude 990000; 990001 990002\r\n\r\n\
                    vzdump: b2 \n\tvmid 100,101\n";
        let jobs = parse(text);
        assert_eq!(jobs.len(), 1, "the line \"\\r\" does not end b1: {jobs:?}");
        // `vzdump: b2` inside b1 is an ignored line, and b2's vmid is b1's key.
        let b1 = &jobs[0];
        assert_eq!(b1.id, "b1");
        assert_eq!(b1.schedule.as_deref(), Some("mon..fri 21:00"));
        assert!(b1.all, "a boolean without a value is 1");
        assert_eq!(b1.exclude, Some(set(&[990000, 990001, 990002])));
        assert_eq!(b1.vmid, Some(set(&[100, 101])));
        assert_eq!(
            b1.selection(),
            Selection::Refused("all conflicts with vmid")
        );
        let text = "vzdump: b1\n\tschedule daily\n\tall 1\n\nvzdump: b2\n\tschedule daily\n\tvmid 100,101\n";
        let jobs = parse(text);
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[1].selection(), Selection::Vmids(&set(&[100, 101])));
        // A line `0` ends a section as an empty one does.
        let jobs = parse("vzdump: a\n\tschedule daily\n0\n\tall 1\n");
        assert!(!jobs[0].all);
    }

    #[test]
    fn invalid_values_are_dropped_and_the_first_valid_one_counts() {
        let text = "vzdump: j\n\
            \tschedule daily\n\
            \tenabled yes\n\
            \tall true\n\
            \texclude 990000-990009\n\
            \texclude 990000,0990001\n\
            \texclude 990002 990003\n\
            \texclude 990004\n\
            \tnode pve_1\n\
            \tpool\n\
            \tpool felhom\n\
            \tpool other\n";
        let j = &parse(text)[0];
        // `yes`, `true` are not booleans PVE reads: enabled keeps its default, all is unset.
        assert!(j.enabled && !j.all);
        // A range or a leading zero refuses the whole value; the first valid one counts.
        assert_eq!(j.exclude, Some(set(&[990002, 990003])));
        // Not a node name: dropped, so the job runs on every node.
        assert_eq!(j.node, None);
        assert!(j.runs_on("pve7"));
        assert_eq!(j.pool.as_deref(), Some("felhom"));
        assert_eq!(j.selection(), Selection::Pool("felhom"));
        // A schedule over 128 bytes, or none: PVE drops the job, which runs nowhere.
        let long = format!("vzdump: j\n\tschedule {}\n\tall 1\n", "x".repeat(129));
        assert!(!parse(&long)[0].runs_on("pve1"));
        assert!(!parse("vzdump: j\n\tall 1\n")[0].runs_on("pve1"));
        assert!(!parse("vzdump: j\n\tschedule daily\n\tenabled 0\n")[0].runs_on("pve1"));
        // An exclude without all (a hand edit) is an all job; with a pool it is ignored.
        assert_eq!(
            parse("vzdump: j\n\tschedule daily\n\texclude 100\n")[0].selection(),
            Selection::All {
                exclude: set(&[100])
            }
        );
        assert_eq!(
            parse("vzdump: j\n\tschedule daily\n\texclude 100\n\tpool felhom\n\tall 1\n")[0]
                .selection(),
            Selection::Pool("felhom")
        );
        assert_eq!(
            parse("vzdump: j\n\tschedule daily\n")[0].selection(),
            Selection::Refused("it selects no guest (no vmid, all or pool)")
        );
        // The later of two sections with one id counts.
        let twice =
            "vzdump: j\n\tschedule daily\n\tall 1\n\nvzdump: j\n\tschedule daily\n\tvmid 100\n";
        let jobs = parse(twice);
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].vmid, Some(set(&[100])));
    }

    #[test]
    fn headers_as_pve_parses_them() {
        assert_eq!(header("vzdump: b1"), Some(("vzdump", "b1")));
        assert_eq!(header("vzdump:b1  "), Some(("vzdump", "b1")));
        assert_eq!(header("a:b:c"), Some(("a:b", "c")));
        assert_eq!(header("a:b:"), Some(("a", "b:")));
        assert_eq!(header("a::"), Some(("a", ":")));
        assert_eq!(header("a:: b"), Some(("a:", "b")));
        assert_eq!(header(":b"), None);
        assert_eq!(header("vzdump:"), None);
        assert_eq!(header("vzdump: b1 b2"), None);
        assert_eq!(header("vzdump b1"), None);
        assert_eq!(header(" vzdump: b1"), None);
        assert_eq!(header("é:ü"), Some(("é", "ü")));
    }

    proptest::proptest! {
        #[test]
        fn any_text_never_panics_and_the_needed_lines_read_as_the_whole(text in "[\\PC\t\n\r\u{0}\u{b}\u{c}]*") {
            let jobs = parse(&text);
            let crossed = needed_lines(&text);
            proptest::prop_assert_eq!(parse(&crossed), jobs);
            proptest::prop_assert_eq!(needed_lines(&crossed), crossed);
        }

        #[test]
        fn section_shaped_text_reads_the_same_through_the_helper(
            lines in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::strategy::Just(String::new()),
                    "(vzdump|realm-sync|#|0|x):[ \t]?[a-z0-9#-]{0,6}[ \r]?",
                    "[ \t]{1,2}(schedule|all|enabled|exclude|pool|node|vmid|mailto|notes-template|#x)([ \t]{1,2}[0-9a-z,; \r\u{0}-]{0,14})?",
                    "[ \t\r0#]{0,2}",
                ],
                0..24,
            )
        ) {
            let text = lines.join("\n");
            let jobs = parse(&text);
            let crossed = needed_lines(&text);
            proptest::prop_assert_eq!(parse(&crossed), jobs);
            // Only a backup job's header, a needed key's line, or the empty line after a job.
            for line in crossed.split('\n') {
                let needed = NEEDED_KEYS.iter().any(|k| {
                    line.strip_prefix('\t')
                        .and_then(|l| l.strip_prefix(k))
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with(' '))
                });
                proptest::prop_assert!(
                    line.is_empty() || line.starts_with("vzdump: ") || needed,
                    "{:?} crossed: {:?}", line, crossed
                );
            }
        }
    }
}
