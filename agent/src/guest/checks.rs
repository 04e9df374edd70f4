//! osquery checks: named SQL queries from check packs (`checks.d/*.toml`), run inside the guest
//! with `osqueryi --json`, each judged against its expectation.
//!
//! A pack:
//!
//! ```toml
//! [[check]]
//! name = "hostname"                       # unique across all packs
//! description = "the guest has its name"  # optional
//! sql = "SELECT hostname FROM system_info"
//! expect = "hostname == '{hostname}'"     # optional, default "rows >= 1"
//! timeout_secs = 30                       # optional, default 30
//! ```
//!
//! Expectations: `rows <op> N` with `<op>` one of `==`, `!=`, `>=`, `>`, `<=`, `<`; or
//! `<column> == '<value>'`: at least one row, and the column equals the value in every row.
//! Values may hold placeholders the agent fills in per guest: `{hostname}`, `{vmid}`, `{node}`,
//! `{txn}` (`{{` and `}}` for literal braces). Placeholders are never put into SQL.
//!
//! Status: `pass` (ran, expectation holds), `fail` (ran, expectation false) or `error` (could
//! not run: osquery missing, timeout, an osquery error such as an unknown table, unreadable
//! output). osquery is found at `/usr/bin/osqueryi`, else `/opt/osquery/bin/osqueryd -S`,
//! tested with `test -x` in the guest; `PATH` is never relied on.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::exec::{Captured, ExecOutcome, ExecRequest, GuestExec, GuestExit, GuestRef};
use crate::error::ErrorCode;

/// The default timeout of one check.
pub const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(30);
/// The placeholders an expectation value may use.
pub const PLACEHOLDERS: [&str; 4] = ["hostname", "vmid", "node", "txn"];
/// The flags every osquery run gets (osquery's shell flags, as of 5.23.1): no
/// guest-local config or flag file, no extensions, no events.
pub const OSQUERY_FLAGS: [&str; 5] = [
    "--json",
    "--config_path=/dev/null",
    "--flagfile=/dev/null",
    "--disable_extensions=true",
    "--disable_events=true",
];
/// Where osquery's shell is looked for, in order.
pub const OSQUERYI_PATH: &str = "/usr/bin/osqueryi";
/// The fallback: the one real binary of osquery's package, run with `-S`.
pub const OSQUERYD_PATH: &str = "/opt/osquery/bin/osqueryd";

/// A comparison of the row count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountOp {
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `>=`
    Ge,
    /// `>`
    Gt,
    /// `<=`
    Le,
    /// `<`
    Lt,
}

impl CountOp {
    fn symbol(self) -> &'static str {
        match self {
            Self::Eq => "==",
            Self::Ne => "!=",
            Self::Ge => ">=",
            Self::Gt => ">",
            Self::Le => "<=",
            Self::Lt => "<",
        }
    }

    fn holds(self, left: u64, right: u64) -> bool {
        match self {
            Self::Eq => left == right,
            Self::Ne => left != right,
            Self::Ge => left >= right,
            Self::Gt => left > right,
            Self::Le => left <= right,
            Self::Lt => left < right,
        }
    }
}

/// One piece of an expected value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValuePart {
    /// Literal text.
    Text(String),
    /// A placeholder, filled from the [`CheckContext`].
    Placeholder(String),
}

/// What a check's result must satisfy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expectation {
    /// The number of rows compares to `count`.
    Rows {
        /// The comparison.
        op: CountOp,
        /// The right-hand side.
        count: u64,
    },
    /// At least one row, and `column` equals the value in every row.
    ColumnEquals {
        /// The result column (its key in osquery's JSON).
        column: String,
        /// The expected value.
        value: Vec<ValuePart>,
    },
}

impl Default for Expectation {
    fn default() -> Self {
        Self::Rows {
            op: CountOp::Ge,
            count: 1,
        }
    }
}

impl fmt::Display for Expectation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rows { op, count } => write!(f, "rows {} {count}", op.symbol()),
            Self::ColumnEquals { column, value } => {
                write!(f, "{column} == '")?;
                for part in value {
                    match part {
                        ValuePart::Text(t) => {
                            f.write_str(&t.replace('{', "{{").replace('}', "}}"))?
                        }
                        ValuePart::Placeholder(p) => write!(f, "{{{p}}}")?,
                    }
                }
                f.write_str("'")
            }
        }
    }
}

fn parse_value(text: &str) -> Result<Vec<ValuePart>, String> {
    let mut parts = Vec::new();
    let mut literal = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                literal.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                literal.push('}');
            }
            '{' => {
                let mut name = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) => name.push(c),
                        None => return Err(format!("unclosed placeholder {{{name}")),
                    }
                }
                if !PLACEHOLDERS.contains(&name.as_str()) {
                    return Err(format!(
                        "unknown placeholder {{{name}}} (known: {})",
                        PLACEHOLDERS.map(|p| format!("{{{p}}}")).join(", ")
                    ));
                }
                if !literal.is_empty() {
                    parts.push(ValuePart::Text(std::mem::take(&mut literal)));
                }
                parts.push(ValuePart::Placeholder(name));
            }
            '}' => return Err("a single '}' in a value; write '}}'".to_owned()),
            c => literal.push(c),
        }
    }
    if !literal.is_empty() || parts.is_empty() {
        parts.push(ValuePart::Text(literal));
    }
    Ok(parts)
}

impl FromStr for Expectation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let lhs_end = s
            .find(|c: char| c.is_whitespace() || "=!<>".contains(c))
            .ok_or_else(|| format!("expectation {s:?} has no comparison"))?;
        let (lhs, rest) = s.split_at(lhs_end);
        let rest = rest.trim_start();
        let op_len = if rest.starts_with("==")
            || rest.starts_with("!=")
            || rest.starts_with(">=")
            || rest.starts_with("<=")
        {
            2
        } else if rest.starts_with('>') || rest.starts_with('<') {
            1
        } else {
            return Err(format!(
                "expectation {s:?}: expected one of == != >= > <= < after {lhs:?}"
            ));
        };
        let (op_text, rhs) = rest.split_at(op_len);
        let rhs = rhs.trim();
        if lhs.is_empty() {
            return Err(format!("expectation {s:?} has nothing left of {op_text}"));
        }
        if lhs == "rows" {
            let op = match op_text {
                "==" => CountOp::Eq,
                "!=" => CountOp::Ne,
                ">=" => CountOp::Ge,
                ">" => CountOp::Gt,
                "<=" => CountOp::Le,
                _ => CountOp::Lt,
            };
            let count = rhs
                .parse::<u64>()
                .map_err(|_| format!("expectation {s:?}: {rhs:?} is not a row count"))?;
            return Ok(Self::Rows { op, count });
        }
        if op_text != "==" {
            return Err(format!(
                "expectation {s:?}: a column can only be compared with =="
            ));
        }
        let quote = rhs.chars().next().filter(|q| *q == '\'' || *q == '"');
        let value = match quote {
            Some(q) if rhs.len() >= 2 && rhs.ends_with(q) && !rhs[1..rhs.len() - 1].contains(q) => {
                &rhs[1..rhs.len() - 1]
            }
            _ => {
                return Err(format!(
                    "expectation {s:?}: quote the expected value, e.g. {lhs} == 'value'"
                ))
            }
        };
        Ok(Self::ColumnEquals {
            column: lhs.to_owned(),
            value: parse_value(value).map_err(|e| format!("expectation {s:?}: {e}"))?,
        })
    }
}

/// One check from a pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Unique name.
    pub name: String,
    /// What it proves, for operators.
    pub description: Option<String>,
    /// The query.
    pub sql: String,
    /// What the result must satisfy.
    pub expect: Expectation,
    /// How long osquery may take.
    pub timeout: Duration,
    /// The pack it came from.
    pub pack: PathBuf,
    /// The guests whose copies it runs in (`guests`: the backup's guest vmids; `guest_tags`:
    /// a PVE tag of the guest); empty both: every guest.
    pub scope: CheckScope,
}

/// Which guests a check applies to: an application check for chosen guests only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckScope {
    /// The vmids of the guests whose backups restore the copies it runs in.
    pub guests: Vec<u32>,
    /// PVE tags (lowercase); a guest carrying any of them is in scope.
    pub tags: Vec<String>,
    /// `in_group = true`: it needs the guest's application group (another member's service),
    /// so it runs only in a group's run (`[[restore_test.group]]`), never in a copy alone.
    pub in_group: bool,
}

impl CheckScope {
    /// Whether a check of this scope runs for the copy of guest `source` (the backup's vmid,
    /// when known) carrying `tags` (the restored config's `tags`).
    pub fn applies(&self, source: Option<u32>, tags: &[String]) -> bool {
        if self.guests.is_empty() && self.tags.is_empty() {
            return true;
        }
        source.is_some_and(|v| self.guests.contains(&v))
            || tags
                .iter()
                .any(|t| self.tags.iter().any(|s| s.eq_ignore_ascii_case(t)))
    }

    /// Whether this scope asks for the guest's tags.
    pub fn needs_tags(&self) -> bool {
        !self.tags.is_empty()
    }
}

/// The tags of a PVE `tags` value (`a;b`, also `,` or space separated), lowercase.
pub fn split_tags(value: &str) -> Vec<String> {
    value
        .split([';', ',', ' '])
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_lowercase)
        .collect()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPack {
    #[serde(default)]
    check: Vec<RawCheck>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheck {
    name: String,
    #[serde(default)]
    description: Option<String>,
    sql: String,
    #[serde(default)]
    expect: Option<String>,
    #[serde(default)]
    timeout_secs: Option<u64>,
    #[serde(default)]
    guests: Vec<u32>,
    #[serde(default)]
    guest_tags: Vec<String>,
    #[serde(default)]
    in_group: bool,
}

fn valid_check_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Parse one pack's text; `origin` names it in errors.
pub fn parse_pack(text: &str, origin: &Path) -> Result<Vec<Check>, CheckError> {
    let raw: RawPack = toml::from_str(text).map_err(|e| CheckError::Parse {
        path: origin.to_owned(),
        // Where in the file: the line and column of the error's start (1-based).
        message: match e.span() {
            Some(span) => {
                let before = text.get(..span.start).unwrap_or(text);
                let line = before.matches('\n').count() + 1;
                let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
                format!("line {line}, column {column}: {}", e.message())
            }
            None => e.message().to_owned(),
        },
    })?;
    let mut seen = HashSet::new();
    let mut checks = Vec::with_capacity(raw.check.len());
    for c in raw.check {
        let invalid = |reason: String| CheckError::Invalid {
            path: origin.to_owned(),
            check: c.name.clone(),
            reason,
        };
        if !valid_check_name(&c.name) {
            return Err(invalid(
                "names use letters, digits, '-', '_' and '.' (at most 64)".to_owned(),
            ));
        }
        if !seen.insert(c.name.clone()) {
            return Err(invalid("the name is used twice in this pack".to_owned()));
        }
        let sql = c.sql.trim().to_owned();
        if sql.is_empty() {
            return Err(invalid("sql is empty".to_owned()));
        }
        if sql.starts_with('-') || sql.contains('\0') {
            return Err(invalid(
                "sql must not start with '-' or contain NUL bytes".to_owned(),
            ));
        }
        let expect = match &c.expect {
            None => Expectation::default(),
            Some(e) => e.parse().map_err(invalid)?,
        };
        let timeout = match c.timeout_secs {
            None => DEFAULT_CHECK_TIMEOUT,
            Some(0) => return Err(invalid("timeout_secs must be at least 1".to_owned())),
            Some(s) if s > 3600 => {
                return Err(invalid("timeout_secs must be at most 3600".to_owned()))
            }
            Some(s) => Duration::from_secs(s),
        };
        if let Some(t) = c.guest_tags.iter().find(|t| {
            t.is_empty()
                || !t
                    .chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '-' | '_' | '.' | '+'))
        }) {
            return Err(invalid(format!(
                "guest_tags holds {t:?}, which is not a PVE tag (letters, digits, '-', '_', '.', '+')"
            )));
        }
        checks.push(Check {
            name: c.name,
            description: c.description,
            sql,
            expect,
            timeout,
            pack: origin.to_owned(),
            scope: CheckScope {
                guests: c.guests,
                tags: c.guest_tags.iter().map(|t| t.to_lowercase()).collect(),
                in_group: c.in_group,
            },
        });
    }
    Ok(checks)
}

/// Read every `*.toml` pack in `dir`, in file-name order. Check names must be unique across
/// packs; a folder without packs is an error (a guest cannot be verified without checks).
pub fn load_packs(dir: &Path) -> Result<Vec<Check>, CheckError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| CheckError::Read { path, source }
    };
    crate::config::check_trusted_dir(dir, "checks_dir")
        .map_err(|reason| CheckError::Untrusted { reason })?;
    let mut packs: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(io(dir))?;
    packs.retain(|p| p.extension().is_some_and(|e| e == "toml") && p.is_file());
    packs.sort();
    if packs.is_empty() {
        return Err(CheckError::NoPacks {
            dir: dir.to_owned(),
        });
    }
    let mut all: Vec<Check> = Vec::new();
    for pack in packs {
        let text = read_trusted(&pack).map_err(|e| match e {
            Ok(reason) => CheckError::Untrusted { reason },
            Err(source) => CheckError::Read {
                path: pack.clone(),
                source,
            },
        })?;
        for check in parse_pack(&text, &pack)? {
            if let Some(first) = all.iter().find(|c| c.name == check.name) {
                return Err(CheckError::Duplicate {
                    name: check.name,
                    first: first.pack.clone(),
                    second: pack,
                });
            }
            all.push(check);
        }
    }
    Ok(all)
}

/// Read a pack, checked on the open file (owner root or the agent's user, not writable by group
/// or others). `Err(Ok(reason))` when it is not trusted.
fn read_trusted(path: &Path) -> Result<String, Result<String, std::io::Error>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(Err)?;
    let meta = file.metadata().map_err(Err)?;
    if let Some(why) = crate::config::untrusted_reason(path, &meta, "check pack") {
        return Err(Ok(why));
    }
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(Err)?;
    Ok(text)
}

/// The values placeholders are filled with for one guest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckContext {
    values: BTreeMap<String, String>,
}

impl CheckContext {
    /// No values.
    pub fn new() -> Self {
        Self::default()
    }

    /// Set a placeholder's value.
    pub fn with(mut self, name: &str, value: impl Into<String>) -> Self {
        self.values.insert(name.to_owned(), value.into());
        self
    }

    fn render(&self, parts: &[ValuePart]) -> Result<String, String> {
        let mut out = String::new();
        for part in parts {
            match part {
                ValuePart::Text(t) => out.push_str(t),
                ValuePart::Placeholder(p) => out.push_str(
                    self.values
                        .get(p)
                        .ok_or_else(|| format!("no value for {{{p}}} was given to the checks"))?,
                ),
            }
        }
        Ok(out)
    }
}

/// A check's result, as reported (`{"name", "status", "rows", …}`): the wire protocol's own
/// record, so the hub receives exactly what the operator sees.
pub use hub_protocol::CheckReport as CheckResult;
/// One row of osquery's output: column to value (osquery prints every value as a string).
pub use hub_protocol::CheckRow as Row;
/// A check's verdict (pass, fail, error, skipped): the wire protocol's own enum.
pub use hub_protocol::CheckStatus;

/// Limits for running checks.
#[derive(Debug, Clone)]
pub struct CheckSettings {
    /// Rows kept per result.
    pub max_rows: usize,
    /// Bytes of osquery output read per check.
    pub output_cap: usize,
}

impl Default for CheckSettings {
    fn default() -> Self {
        Self {
            max_rows: 20,
            output_cap: 4 * 1024 * 1024,
        }
    }
}

/// Check packs could not be read, or checks did not pass.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// A pack or the folder could not be read.
    #[error("could not read check pack {path}: {source}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The folder or a pack may be changed by someone other than root.
    #[error("check packs are not trusted: {reason}")]
    Untrusted {
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// A pack is not valid TOML of the pack format.
    #[error("check pack {path} is invalid: {message}")]
    Parse {
        /// The pack.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// A check is invalid.
    #[error("check {check:?} in {path} is invalid: {reason}")]
    Invalid {
        /// The pack.
        path: PathBuf,
        /// The check.
        check: String,
        /// What is wrong.
        reason: String,
    },
    /// Two packs define the same check name.
    #[error("check {name:?} is defined in {first} and again in {second}; rename one")]
    Duplicate {
        /// The name.
        name: String,
        /// Where it is defined first.
        first: PathBuf,
        /// Where again.
        second: PathBuf,
    },
    /// The folder holds no pack.
    #[error(
        "no check packs (*.toml) in {dir}; install the default pack or point checks_dir elsewhere"
    )]
    NoPacks {
        /// The folder.
        dir: PathBuf,
    },
    /// Checks ran and did not all pass.
    #[error("osquery checks did not pass in {guest}: {summary}; see the check results for the rows and messages")]
    NotPassed {
        /// The guest.
        guest: GuestRef,
        /// Which failed and which could not run.
        summary: String,
    },
}

impl CheckError {
    /// The stable code.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::NotPassed { .. } => ErrorCode::CheckFailed,
            _ => ErrorCode::ConfigInvalid,
        }
    }
}

/// Whether `check` compares a result column to a value holding `{placeholder}`.
pub fn compares_to(check: &Check, placeholder: &str) -> bool {
    matches!(&check.expect, Expectation::ColumnEquals { value, .. }
        if value.iter().any(|p| matches!(p, ValuePart::Placeholder(n) if n == placeholder)))
}

/// A VM's `{hostname}`: PVE keeps no hostname for a VM. Its `name` (what `{hostname}` is
/// filled with) is only the name in PVE's interface (qemu-server `PVE/QemuServer.pm`
/// `$confdesc` `name`: "Set a name for the VM. Only used on the configuration web
/// interface."), and nothing of PVE writes it into the guest. So a check of a VM that compares
/// a column to `{hostname}` and fails (the guest's own hostname differs from its PVE name:
/// `web-01` in PVE, `web01.example.com` inside) did not find a fault of the guest: it is
/// `skipped`, never a pass, its message saying plainly it could not judge the name, with what
/// the guest calls itself. A check that passes (the guest runs under its PVE name) stays as it
/// is; a check that errors (it could not run) stays an error.
pub fn vm_hostname_unjudged(checks: &[Check], results: &mut [CheckResult], pve_name: &str) {
    for result in results.iter_mut() {
        if result.status != CheckStatus::Fail {
            continue;
        }
        let Some(check) = checks.iter().find(|c| c.name == result.name) else {
            continue;
        };
        if !compares_to(check, "hostname") {
            continue;
        }
        let column = match &check.expect {
            Expectation::ColumnEquals { column, .. } => column.as_str(),
            Expectation::Rows { .. } => continue,
        };
        let seen: Vec<String> = result
            .rows
            .iter()
            .filter_map(|r| r.get(column))
            .take(4)
            .map(|v| format!("'{}'", crate::error::outside_text_max(v, 128)))
            .collect();
        result.status = CheckStatus::Skipped;
        result.message = Some(format!(
            "not judged: PVE keeps no hostname for a VM (its name in PVE, '{}', is never written into the guest), and the guest calls itself {}; a VM's own name is the guest's to set",
            crate::error::outside_text_max(pve_name, 128),
            if seen.is_empty() { "nothing".to_string() } else { seen.join(", ") }
        ));
    }
}

/// A VM with a cloud-init drive: PVE writes its hostname into the guest (`names`: the short
/// name and the FQDN of [`crate::pve::guest_config::cloudinit_name`]), and cloud-init sets
/// one of them as the guest's, which one being the distribution's choice. So a check comparing
/// a column to `{hostname}` that fails is judged against both: when every value it saw is one
/// of them it passes, saying so; otherwise it stays a fail whose message names what PVE wrote
/// and what the guest calls itself.
pub fn vm_hostname_cloudinit(
    checks: &[Check],
    results: &mut [CheckResult],
    names: &crate::pve::guest_config::CloudInitName,
) {
    let clip = crate::error::outside_text_max;
    for result in results.iter_mut() {
        if result.status != CheckStatus::Fail {
            continue;
        }
        let Some(check) = checks.iter().find(|c| c.name == result.name) else {
            continue;
        };
        let column = match &check.expect {
            Expectation::ColumnEquals { column, .. } if compares_to(check, "hostname") => {
                column.as_str()
            }
            _ => continue,
        };
        let values: Vec<&String> = result.rows.iter().filter_map(|r| r.get(column)).collect();
        let wrote = format!(
            "PVE's cloud-init drive names this VM '{}' (FQDN '{}', from its name and searchdomain)",
            clip(&names.hostname, 128),
            clip(&names.fqdn, 255)
        );
        if !values.is_empty()
            && values
                .iter()
                .all(|v| **v == names.hostname || **v == names.fqdn)
        {
            result.status = CheckStatus::Pass;
            result.message = Some(format!(
                "{wrote}, and the guest calls itself '{}' as cloud-init set it",
                clip(values[0], 255)
            ));
            continue;
        }
        let seen: Vec<String> = values
            .iter()
            .take(4)
            .map(|v| format!("'{}'", clip(v, 128)))
            .collect();
        result.message = Some(format!(
            "{wrote}, but the guest calls itself {}: cloud-init did not set it (see \
             /var/log/cloud-init.log in the guest: `preserve_hostname: true`, its \
             set_hostname module left out, or cloud-init not run)",
            if seen.is_empty() {
                "nothing".to_string()
            } else {
                seen.join(", ")
            }
        ));
    }
}

/// A failing check whose rows name a unit the isolation left failed on purpose (`kept`: the
/// unit and why, [`crate::guest::lab::LabDone::kept`]) says why in its message, so the red
/// verdict names what failed inside the unit (a stanza's interface) and what to do. A row
/// names the unit when one of its values is the unit's name.
pub fn say_why_kept(results: &mut [CheckResult], kept: &[(String, String)]) {
    for result in results.iter_mut() {
        if result.status != CheckStatus::Fail {
            continue;
        }
        for (unit, why) in kept {
            if result.rows.iter().any(|r| r.values().any(|v| v == unit)) {
                let said = result.message.take().unwrap_or_default();
                let sep = if said.is_empty() { "" } else { "; " };
                // Both parts are bounded already (the message by the check's run, `why` built
                // by the agent from clipped names): joined as they are, escaped once.
                result.message = Some(format!("{said}{sep}{unit}: {why}"));
            }
        }
    }
}

/// `Ok(())` when every result passed or was skipped (not judged: no fault found), else
/// [`CheckError::NotPassed`] naming the checks that failed or could not run.
pub fn verdict(guest: GuestRef, results: &[CheckResult]) -> Result<(), CheckError> {
    let names = |status| {
        results
            .iter()
            .filter(|r| r.status == status)
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>()
    };
    let failed = names(CheckStatus::Fail);
    let errored = names(CheckStatus::Error);
    if failed.is_empty() && errored.is_empty() {
        return Ok(());
    }
    let mut parts = Vec::new();
    if !failed.is_empty() {
        parts.push(format!("failed: {}", failed.join(", ")));
    }
    if !errored.is_empty() {
        parts.push(format!("could not run: {}", errored.join(", ")));
    }
    Err(CheckError::NotPassed {
        guest,
        summary: parts.join("; "),
    })
}

/// Parse `osqueryi --json` output exactly: an array of objects whose values are all strings.
/// Invalid UTF-8 in values is replaced (osquery passes such bytes through).
pub fn parse_osquery_json(stdout: &[u8]) -> Result<Vec<Row>, String> {
    let text = String::from_utf8_lossy(stdout);
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("osquery output is not JSON: {e}"))?;
    let items = value
        .as_array()
        .ok_or_else(|| "osquery output is not a JSON array".to_owned())?;
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let obj = item
                .as_object()
                .ok_or_else(|| format!("row {i} of osquery's output is not an object"))?;
            obj.iter()
                .map(|(k, v)| match v {
                    serde_json::Value::String(s) => Ok((k.clone(), s.clone())),
                    other => Err(format!(
                        "row {i} column {k:?} is {other}, but osquery prints every value as a string"
                    )),
                })
                .collect()
        })
        .collect()
}

/// The most checks of one guest running at once (each its own `osqueryi` process in the guest).
pub const CHECKS_AT_ONCE: usize = 4;
/// The bytes of a check's stderr kept (its error line is what is read).
const CHECK_STDERR_CAP: usize = 64 * 1024;
/// The time the run's own work (finding osquery, the frames) may take beside the checks'.
const RUN_SLACK: Duration = Duration::from_secs(30);

/// The run of every check in one exec (`/bin/sh -c <this> felhom-checks CAP ERRCAP AT_ONCE
/// SECS1 SQL1 SECS2 SQL2 …`): osquery is found with `test -x` (`felhom-osquery osqueryi`,
/// `osqueryd` or `none`), whether systemd is the guest's init is said (`felhom-init systemd`
/// or `other`: sd_booted(3)'s `/run/systemd/system`, or PID 1's own binary), each check runs
/// as its own process (`felhom_watched` of [`super::frames::RUN_FNS`]: in a session of its own
/// where the guest has `setsid`, so what it started is stopped with it), AT_ONCE at a time, its stdout and
/// stderr caught in a private folder, with a watchdog that kills it after its own SECS (a flag
/// file says the watchdog did it). Then, for each check in order, `felhom-check <i> <status>
/// <killed> <ms>` and its stdout and stderr as frames (`crate::guest::frames`). A check that never
/// returns is killed at its own timeout while the others go on.
const RUN_SCRIPT: &str = r#"
cap=$1 ecap=$2 at=$3; shift 3
if test -x @OSQUERYI@; then o=@OSQUERYI@ s=; echo "felhom-osquery osqueryi"
elif test -x @OSQUERYD@; then o=@OSQUERYD@ s=-S; echo "felhom-osquery osqueryd"
else echo "felhom-osquery none"; exit 0; fi
if [ -d /run/systemd/system ] || case "$(readlink /proc/1/exe 2>/dev/null) $(cat /proc/1/comm 2>/dev/null)" in
  */systemd\ *|*\ systemd) true;; *) false;; esac; then echo "felhom-init systemd"; else echo "felhom-init other"; fi
d=
for t in /tmp /run /dev/shm /var/tmp; do
  d=$(mktemp -d "$t/felhom-checks.XXXXXX" 2>/dev/null) && break
  d=
done
[ -n "$d" ] || { echo "felhom-nofolder"; exit 0; }
one() {
  t0=$(felhom_ms)
  felhom_watched "$2" "$d/$1.o" "$d/$1.e" "$d/$1.t" "$o" $s @FLAGS@ "$3"
  echo "$felhom_rc $(( $(felhom_ms) - t0 ))" >"$d/$1.r"
}
i=0
while [ $# -ge 2 ]; do
  i=$((i+1)); one "$i" "$1" "$2" & shift 2
  [ $((i % at)) -ne 0 ] || wait
done
wait
j=1
while [ "$j" -le "$i" ]; do
  rc=none ms=0; [ -f "$d/$j.r" ] && read -r rc ms <"$d/$j.r"
  k=0; [ -e "$d/$j.t" ] && k=1
  echo "felhom-check $j $rc $k $ms"
  felhom_frame o "$d/$j.o" "$cap"
  felhom_frame e "$d/$j.e" "$ecap"
  j=$((j+1))
done
rm -rf "$d"
"#;

/// [`RUN_SCRIPT`] with osquery's paths and flags, after the frame function.
fn run_script() -> String {
    let script = RUN_SCRIPT
        .replace("@OSQUERYI@", OSQUERYI_PATH)
        .replace("@OSQUERYD@", OSQUERYD_PATH)
        .replace("@FLAGS@", &OSQUERY_FLAGS.join(" "));
    format!(
        "{}{}{script}",
        super::frames::FRAME_FN,
        super::frames::RUN_FNS
    )
}

/// Run `checks` in the guest, all in one exec ([`RUN_SCRIPT`]), up to [`CHECKS_AT_ONCE`] at a
/// time, each with its own timeout, the results in the checks' order. Never fails as a whole:
/// what could not run is a result with status `error`.
pub async fn run_checks<E: GuestExec>(
    exec: &E,
    checks: &[Check],
    ctx: &CheckContext,
    settings: &CheckSettings,
) -> Vec<CheckResult> {
    if checks.is_empty() {
        return Vec::new();
    }
    let guest = exec.guest();
    let started = Instant::now();
    let mut systemd = true;
    let ran = run_all(exec, checks, settings, &mut systemd).await;
    let whole = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let mut results: Vec<CheckResult> = checks
        .iter()
        .enumerate()
        .map(|(i, check)| {
            let (result, ms) = match &ran {
                Err(e) => (Err(e.clone()), whole),
                Ok(None) => (
                    Err(format!(
                        "osquery is not installed in {guest} (looked for {OSQUERYI_PATH} and {OSQUERYD_PATH})"
                    )),
                    whole,
                ),
                Ok(Some(_)) if !systemd && reads_systemd_units(&check.sql) => (
                    Err(format!(
                        "could not run: systemd is not the init of {guest} (no /run/systemd/system), \
                         so systemd_units has nothing to show and this check cannot judge the guest"
                    )),
                    0,
                ),
                Ok(Some(outcomes)) => match outcomes.get(i).and_then(Option::as_ref) {
                    Some((outcome, ms)) => (judge(check, outcome, ctx, settings), *ms),
                    None => (
                        Err("no answer from the guest for this check (the run of the checks ended before it)".to_owned()),
                        whole,
                    ),
                },
            };
            let result = match result {
                Ok(mut r) => {
                    r.duration_ms = ms;
                    r
                }
                Err(message) => CheckResult {
                    name: check.name.clone(),
                    status: CheckStatus::Error,
                    rows: Vec::new(),
                    row_count: 0,
                    rows_truncated: false,
                    message: Some(message),
                    duration_ms: ms,
                },
            };
            tracing::info!(vmid = guest.vmid, check = %result.name, status = result.status.as_str(), "osquery check");
            result
        })
        .collect();
    bound_results(&mut results);
    results
}

/// One check's outcome as the run reported it, and its time in the guest.
type Ran = Option<(ExecOutcome, u64)>;

/// Run every check in one exec: `Ok(None)` when osquery is not installed; else each check's
/// outcome (`None`: the run said nothing of it).
async fn run_all<E: GuestExec>(
    exec: &E,
    checks: &[Check],
    settings: &CheckSettings,
    systemd: &mut bool,
) -> Result<Option<Vec<Ran>>, String> {
    let mut argv = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        run_script(),
        "felhom-checks".to_owned(),
        settings.output_cap.to_string(),
        CHECK_STDERR_CAP.to_string(),
        CHECKS_AT_ONCE.to_string(),
    ];
    // The checks run AT_ONCE at a time, each batch as long as its slowest.
    let mut budget = RUN_SLACK;
    for batch in checks.chunks(CHECKS_AT_ONCE) {
        budget +=
            batch.iter().map(|c| c.timeout).max().unwrap_or_default() + Duration::from_secs(2);
    }
    for check in checks {
        argv.push(check.timeout.as_secs().max(1).to_string());
        argv.push(check.sql.clone());
    }
    let per_check = settings.output_cap + CHECK_STDERR_CAP + 256;
    let request = ExecRequest::new(argv)
        .timeout(budget)
        .output_cap(per_check.saturating_mul(checks.len()) + 1024);
    let outcome = exec.exec(&request).await.map_err(|e| e.to_string())?;
    let items = super::frames::parse(&outcome.stdout.bytes);
    let mut located = None;
    let mut ran: Vec<Ran> = vec![None; checks.len()];
    let mut current: Option<(usize, GuestExit, u64)> = None;
    let mut stdout: Option<Captured> = None;
    for item in items {
        match item {
            super::frames::Item::Line(line) => {
                let mut w = line.split(' ');
                match (w.next(), w.next(), w.next(), w.next(), w.next()) {
                    (Some("felhom-osquery"), Some(which), None, _, _) => {
                        located = Some(which.to_owned())
                    }
                    (Some("felhom-init"), Some(init), None, _, _) => *systemd = init == "systemd",
                    (Some("felhom-nofolder"), None, _, _, _) => {
                        // Nowhere to write (a read-only root without a tmpfs): one exec a check.
                        let Some(which) = located.as_deref() else {
                            break;
                        };
                        return Ok(Some(one_by_one(exec, which, checks, settings).await));
                    }
                    (Some("felhom-check"), Some(i), Some(rc), Some(killed), Some(ms)) => {
                        stdout = None;
                        current = check_line(i, rc, killed, ms, checks.len());
                    }
                    _ => {}
                }
            }
            super::frames::Item::Frame {
                name,
                bytes,
                truncated,
            } => {
                let Some((i, exit, ms)) = current else {
                    continue;
                };
                let captured = Captured::capped(bytes.to_vec(), usize::MAX, truncated);
                match (name, stdout.take()) {
                    ("o", _) => stdout = Some(captured),
                    ("e", Some(out)) => {
                        ran[i] = Some((
                            ExecOutcome {
                                exit,
                                stdout: out,
                                stderr: captured,
                                duration: Duration::from_millis(ms),
                            },
                            ms,
                        ));
                        current = None;
                    }
                    _ => {}
                }
            }
        }
    }
    match located.as_deref() {
        Some("none") => Ok(None),
        Some("osqueryi" | "osqueryd") => Ok(Some(ran)),
        _ if outcome.exit == GuestExit::TimedOut => Err(format!(
            "the run of the checks did not end within {}s and was stopped",
            budget.as_secs()
        )),
        _ => Err(format!("looking for osquery failed: {}", outcome.summary())),
    }
}

/// Run each check in an exec of its own, one after the other: for a guest where the run of
/// all checks has no folder to write to.
async fn one_by_one<E: GuestExec>(
    exec: &E,
    which: &str,
    checks: &[Check],
    settings: &CheckSettings,
) -> Vec<Ran> {
    let mut ran = Vec::new();
    for check in checks {
        let mut argv = match which {
            "osqueryd" => vec![OSQUERYD_PATH.to_owned(), "-S".to_owned()],
            _ => vec![OSQUERYI_PATH.to_owned()],
        };
        argv.extend(OSQUERY_FLAGS.iter().map(|f| (*f).to_owned()));
        argv.push(check.sql.clone());
        let request = ExecRequest::new(argv)
            .timeout(check.timeout)
            .output_cap(settings.output_cap);
        ran.push(exec.exec(&request).await.ok().map(|outcome| {
            let ms = u64::try_from(outcome.duration.as_millis()).unwrap_or(u64::MAX);
            (outcome, ms)
        }));
    }
    ran
}

/// Whether a check's query reads osquery's `systemd_units` table: in a guest whose init is not
/// systemd that table is empty, and a check on it would pass or fail for nothing it saw.
fn reads_systemd_units(sql: &str) -> bool {
    let sql = sql.to_ascii_lowercase();
    sql.match_indices("systemd_units").any(|(at, word)| {
        let before = sql[..at].chars().next_back();
        let after = sql[at + word.len()..].chars().next();
        let ident = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        !ident(before) && !ident(after)
    })
}

/// A `felhom-check <i> <status> <killed> <ms>` line: the check (0-based), how it ended (the
/// watchdog's kill is a timeout), its time.
fn check_line(
    i: &str,
    rc: &str,
    killed: &str,
    ms: &str,
    len: usize,
) -> Option<(usize, GuestExit, u64)> {
    let i = i.parse::<usize>().ok().filter(|i| (1..=len).contains(i))? - 1;
    let ms = ms.parse::<u64>().unwrap_or(0);
    let rc = rc.parse::<i64>().ok()?;
    let exit = match rc {
        137 if killed == "1" => GuestExit::TimedOut,
        129..=255 => GuestExit::Signaled(i32::try_from(rc - 128).unwrap_or(0)),
        _ => GuestExit::Exited(rc),
    };
    Some((i, exit, ms))
}

/// The longest column name kept in a reported row.
pub const MAX_COLUMN_BYTES: usize = 64;
/// The longest value kept in a reported row; longer values are clipped, saying how much.
pub const MAX_VALUE_BYTES: usize = 256;
/// The most columns kept in a reported row.
pub const MAX_COLUMNS: usize = 16;
/// The most bytes of one reported row (names and values).
pub const MAX_ROW_BYTES: usize = 2048;
/// The most bytes of rows reported for all checks of one guest together: the results go into
/// the outbox and to the hub, whose records and frames are capped.
pub const MAX_REPORTED_ROW_BYTES: usize = 32 * 1024;
/// The longest message of a check result.
pub const MAX_RESULT_MESSAGE_BYTES: usize = 1024;

/// Bound what the guest said in `results`: values, column names and messages escaped and
/// clipped, at most [`MAX_COLUMNS`] columns and [`MAX_ROW_BYTES`] per row, and rows dropped
/// once all results together hold [`MAX_REPORTED_ROW_BYTES`]. A result that lost rows says so
/// (`rows_truncated`); `row_count` stays what the query returned.
pub fn bound_results(results: &mut [CheckResult]) {
    let mut budget = MAX_REPORTED_ROW_BYTES;
    for result in results.iter_mut() {
        if let Some(m) = &result.message {
            result.message = Some(crate::error::outside_text_max(m, MAX_RESULT_MESSAGE_BYTES));
        }
        let rows = std::mem::take(&mut result.rows);
        for row in rows {
            let mut kept = Row::new();
            let mut size = 0;
            let columns = row.len();
            for (column, value) in row {
                let column = crate::error::outside_text_max(&column, MAX_COLUMN_BYTES);
                let value = crate::error::outside_text_max(&value, MAX_VALUE_BYTES);
                let entry = column.len() + value.len();
                if kept.len() >= MAX_COLUMNS || size + entry > MAX_ROW_BYTES {
                    break;
                }
                size += entry;
                kept.insert(column, value);
            }
            if kept.len() < columns {
                kept.insert(
                    "_clipped".to_owned(),
                    format!("{} of {columns} columns kept", kept.len()),
                );
            }
            // What the row costs on the wire, JSON escapes included.
            let size = serde_json::to_string(&kept).map_or(MAX_ROW_BYTES * 2, |t| t.len() + 1);
            if size > budget {
                result.rows_truncated = true;
                break;
            }
            budget -= size;
            result.rows.push(kept);
        }
    }
}

/// The most rows a failed check names in its message.
const NAMED_ROWS: usize = 5;

/// The first column a query selects, when it is a plain name (`SELECT id, active_state …`
/// gives `id`): the column that names a row in a failed check's message.
fn first_column(sql: &str) -> Option<String> {
    let rest = sql.trim_start();
    let rest = rest
        .get(..6)
        .filter(|w| w.eq_ignore_ascii_case("select"))
        .map(|_| &rest[6..])?;
    let col = rest.split([',', ' ', '\n', '\t']).find(|w| !w.is_empty())?;
    col.chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
        .then(|| col.to_string())
}

/// `: a, b (and N more)`: what names each returned row (its first selected column, else `id`,
/// `name` or `path`, else its first column), for the message of a failed row count, so a red
/// `no-failed-units` names the units. Guest text: escaped and clipped.
fn name_rows(rows: &[Row], first: Option<String>) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let label = |row: &Row| -> String {
        let v = first
            .as_deref()
            .and_then(|c| row.get(c))
            .or_else(|| ["id", "name", "path"].iter().find_map(|c| row.get(*c)))
            .or_else(|| row.values().next())
            .map_or("", String::as_str);
        crate::error::outside_text_max(v, 128)
    };
    let named: Vec<String> = rows.iter().take(NAMED_ROWS).map(label).collect();
    let more = rows.len().saturating_sub(NAMED_ROWS);
    if more > 0 {
        format!(": {} (and {more} more)", named.join(", "))
    } else {
        format!(": {}", named.join(", "))
    }
}

/// Judge one check from its run's outcome; `Err` is an `error` result with this message.
fn judge(
    check: &Check,
    outcome: &ExecOutcome,
    ctx: &CheckContext,
    settings: &CheckSettings,
) -> Result<CheckResult, String> {
    let expected = match &check.expect {
        Expectation::ColumnEquals { column, value } => Some((column, ctx.render(value)?)),
        Expectation::Rows { .. } => None,
    };
    let rows = osquery_rows(outcome, check.timeout, settings.output_cap)?;
    let row_count = rows.len() as u64;
    let (status, message) = match (&check.expect, expected) {
        (Expectation::Rows { op, count }, _) => {
            if op.holds(row_count, *count) {
                (CheckStatus::Pass, None)
            } else {
                (
                    CheckStatus::Fail,
                    Some(format!(
                        "expected rows {} {count}, the query returned {row_count}{}",
                        op.symbol(),
                        name_rows(&rows, first_column(&check.sql))
                    )),
                )
            }
        }
        (Expectation::ColumnEquals { .. }, Some((column, value))) => {
            judge_column(&rows, column, &value)?
        }
        (Expectation::ColumnEquals { .. }, None) => {
            return Err("internal: expectation without a value".to_owned())
        }
    };
    let mut rows = rows;
    let rows_truncated = rows.len() > settings.max_rows;
    rows.truncate(settings.max_rows);
    Ok(CheckResult {
        name: check.name.clone(),
        status,
        rows,
        row_count,
        rows_truncated,
        message,
        duration_ms: 0,
    })
}

fn judge_column(
    rows: &[Row],
    column: &str,
    value: &str,
) -> Result<(CheckStatus, Option<String>), String> {
    if rows.is_empty() {
        return Ok((
            CheckStatus::Fail,
            Some(format!(
                "expected {column} == {value:?}, the query returned no rows"
            )),
        ));
    }
    for row in rows {
        let found = row.get(column).ok_or_else(|| {
            format!("the result has no column {column:?}; select it in the check's SQL")
        })?;
        if found != value {
            return Ok((
                CheckStatus::Fail,
                Some(format!(
                    "expected {column} == {value:?}, found {:?}",
                    crate::error::outside_text(found)
                )),
            ));
        }
    }
    Ok((CheckStatus::Pass, None))
}

/// The rows of a finished osquery run, or why it could not run.
fn osquery_rows(outcome: &ExecOutcome, timeout: Duration, cap: usize) -> Result<Vec<Row>, String> {
    let stderr = outcome.stderr.text();
    let error_line = stderr
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("Error:") || l.starts_with("ERROR:"))
        .map(crate::error::outside_text);
    match outcome.exit {
        GuestExit::TimedOut => {
            return Err(format!(
                "osquery did not answer within {}s and was killed",
                timeout.as_secs()
            ))
        }
        GuestExit::Signaled(sig) => return Err(format!("osquery was killed by signal {sig}")),
        GuestExit::Exited(code @ (126 | 127)) => {
            return Err(format!(
                "osquery could not be started (exit status {code}): {}",
                outcome.summary()
            ))
        }
        GuestExit::Exited(0) => {}
        GuestExit::Exited(code) => {
            return Err(match error_line {
                Some(line) => format!("osquery exited with status {code}: {line}"),
                None => format!("osquery exited with status {code}: {}", outcome.summary()),
            })
        }
    }
    if let Some(line) = error_line {
        return Err(format!("osquery reported: {line}"));
    }
    if outcome.stdout.truncated {
        return Err(format!(
            "osquery printed more than {cap} bytes; narrow the check's query"
        ));
    }
    parse_osquery_json(&outcome.stdout.bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pack that is no TOML says where: the file, the line and the column.
    #[test]
    fn a_broken_pack_names_the_line_and_column() {
        let pack = "[[check]]\nname = \"a\"\nsql = \"SELECT 1\"\n\n[[check]]\nname = b\n";
        let err = parse_pack(pack, Path::new("/etc/felhom-agent/checks.d/web.toml"))
            .expect_err("no TOML");
        let text = err.to_string();
        assert!(
            text.contains("/etc/felhom-agent/checks.d/web.toml")
                && text.contains("line 6, column 8"),
            "{text}"
        );
    }

    #[test]
    fn a_scoped_check_runs_only_for_its_guests_or_tags() {
        let pack = "[[check]]\nname = \"shop\"\nsql = \"SELECT 1\"\nguests = [200]\nguest_tags = [\"Web\"]\n\n[[check]]\nname = \"all\"\nsql = \"SELECT 1\"\n";
        let checks = parse_pack(pack, Path::new("/p.toml")).expect("valid");
        let shop = &checks[0].scope;
        assert!(shop.applies(Some(200), &[]));
        assert!(shop.applies(Some(300), &split_tags("customer;web")));
        assert!(!shop.applies(Some(300), &split_tags("customer;prod")));
        assert!(!shop.applies(None, &[]));
        assert!(checks[1].scope.applies(None, &[]));
        let bad = "[[check]]\nname = \"x\"\nsql = \"SELECT 1\"\nguest_tags = [\"a;b\"]\n";
        assert!(parse_pack(bad, Path::new("/p.toml")).is_err());
    }

    #[test]
    fn a_failed_row_count_names_the_rows_by_their_first_selected_column() {
        let row = |id: &str| -> Row {
            [
                ("active_state", "failed"),
                ("id", id),
                ("sub_state", "failed"),
            ]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
        };
        let sql =
            "SELECT id, active_state, sub_state FROM systemd_units WHERE active_state = 'failed'";
        assert_eq!(first_column(sql).as_deref(), Some("id"));
        assert_eq!(
            name_rows(
                &[row("late.service"), row("nginx.service")],
                first_column(sql)
            ),
            ": late.service, nginx.service"
        );
        let many: Vec<Row> = (0..7).map(|i| row(&format!("u{i}.service"))).collect();
        assert!(name_rows(&many, Some("id".into())).ends_with("u4.service (and 2 more)"));
        assert_eq!(first_column("SELECT count(*) FROM x"), None);
        // Without a plain first column: the row's `id`.
        assert_eq!(name_rows(&[row("x.service")], None), ": x.service");
        assert_eq!(name_rows(&[], None), "");
        // Guest text is escaped.
        assert_eq!(
            name_rows(&[row("evil\u{1b}[31m.service")], Some("id".into())),
            format!(": {}", crate::error::outside_text("evil\u{1b}[31m.service"))
        );
    }
    use crate::guest::exec::Captured;

    #[test]
    fn reported_rows_are_bounded_whatever_the_guest_prints() {
        let huge = "v\n".repeat(4 * 1024);
        let row: Row = (0..40)
            .map(|i| (format!("col{i:02}"), huge.clone()))
            .chain([("x".repeat(10_000), "short".to_owned())])
            .collect();
        let mut results: Vec<CheckResult> = (0..5)
            .map(|i| CheckResult {
                name: format!("c{i}"),
                status: CheckStatus::Fail,
                rows: vec![row.clone(); 20],
                row_count: 20,
                rows_truncated: false,
                message: Some(format!("found {huge}")),
                duration_ms: 1,
            })
            .collect();
        bound_results(&mut results);
        let wire = serde_json::to_string(&results).unwrap();
        assert!(
            wire.len() < MAX_REPORTED_ROW_BYTES + 5 * (MAX_RESULT_MESSAGE_BYTES + 1024),
            "{} bytes",
            wire.len()
        );
        for r in &results {
            assert!(r.message.as_deref().unwrap().len() <= MAX_RESULT_MESSAGE_BYTES + 64);
            assert!(!r.message.as_deref().unwrap().contains('\n'));
            assert_eq!(r.row_count, 20);
            for row in &r.rows {
                assert!(row.len() <= MAX_COLUMNS + 1);
                assert!(row
                    .values()
                    .all(|v| v.len() <= MAX_VALUE_BYTES + 64 && !v.contains('\n')));
                assert!(
                    row.contains_key("_clipped"),
                    "the row says columns were cut"
                );
            }
        }
        assert!(results[0].rows.len() > 1, "the first result keeps rows");
        assert!(
            results[4].rows_truncated && results[4].rows.len() < 20,
            "later ones are cut"
        );
    }

    #[test]
    fn expectations_parse_and_print() {
        let cases = [
            ("rows >= 1", "rows >= 1"),
            ("rows==0", "rows == 0"),
            ("  rows  <  3 ", "rows < 3"),
            ("rows != 2", "rows != 2"),
            ("hostname == '{hostname}'", "hostname == '{hostname}'"),
            ("version == \"5.23.1\"", "version == '5.23.1'"),
            ("name == 'ct-{vmid}.{node}'", "name == 'ct-{vmid}.{node}'"),
            ("v == 'a{{b}}'", "v == 'a{{b}}'"),
        ];
        for (text, shown) in cases {
            let e: Expectation = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(e.to_string(), shown);
        }
        assert_eq!(
            "name == 'ct-{vmid}'".parse::<Expectation>().unwrap(),
            Expectation::ColumnEquals {
                column: "name".into(),
                value: vec![
                    ValuePart::Text("ct-".into()),
                    ValuePart::Placeholder("vmid".into())
                ]
            }
        );
    }

    #[test]
    fn bad_expectations_are_refused() {
        for bad in [
            "",
            "rows",
            "rows >= x",
            "rows >= -1",
            "rows => 1",
            "== 1",
            "hostname == web1",
            "hostname >= 'a'",
            "hostname == '{nope}'",
            "hostname == '{hostname'",
            "hostname == 'a}b'",
            "hostname == 'it's'",
        ] {
            assert!(bad.parse::<Expectation>().is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn packs_parse_with_defaults_and_refuse_mistakes() {
        let pack = r#"
            [[check]]
            name = "os"
            sql = "SELECT name FROM os_version"

            [[check]]
            name = "no-failed-units"
            sql = "SELECT id FROM systemd_units WHERE active_state = 'failed'"
            expect = "rows == 0"
            timeout_secs = 5
        "#;
        let checks = parse_pack(pack, Path::new("p.toml")).unwrap();
        assert_eq!(checks.len(), 2);
        assert_eq!(checks[0].expect, Expectation::default());
        assert_eq!(checks[0].timeout, DEFAULT_CHECK_TIMEOUT);
        assert_eq!(checks[1].timeout, Duration::from_secs(5));

        for bad in [
            "[[check]]\nname = \"a\"\nsql = \"SELECT 1\"\nbogus = 1\n",
            "[[check]]\nname = \"a b\"\nsql = \"SELECT 1\"\n",
            "[[check]]\nname = \"a\"\nsql = \"  \"\n",
            "[[check]]\nname = \"a\"\nsql = \"--help\"\n",
            "[[check]]\nname = \"a\"\nsql = \"SELECT 1\"\ntimeout_secs = 0\n",
            "[[check]]\nname = \"a\"\nsql = \"SELECT 1\"\n[[check]]\nname = \"a\"\nsql = \"SELECT 2\"\n",
            "[[check]]\nname = \"a\"\nsql = \"SELECT 1\"\nexpect = \"rows ~ 1\"\n",
        ] {
            let err = parse_pack(bad, Path::new("bad.toml")).unwrap_err();
            assert_eq!(err.code(), ErrorCode::ConfigInvalid);
            assert!(err.to_string().contains("bad.toml"), "{err}");
        }
    }

    #[test]
    fn packs_in_a_folder_load_in_order_and_names_stay_unique() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("b.toml"),
            "[[check]]\nname = \"two\"\nsql = \"SELECT 2\"\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("a.toml"),
            "[[check]]\nname = \"one\"\nsql = \"SELECT 1\"\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();
        let names: Vec<_> = load_packs(dir.path())
            .unwrap()
            .into_iter()
            .map(|c| c.name)
            .collect();
        assert_eq!(names, ["one", "two"]);
        std::fs::write(
            dir.path().join("c.toml"),
            "[[check]]\nname = \"one\"\nsql = \"SELECT 3\"\n",
        )
        .unwrap();
        assert!(matches!(
            load_packs(dir.path()),
            Err(CheckError::Duplicate { .. })
        ));
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            load_packs(empty.path()),
            Err(CheckError::NoPacks { .. })
        ));
    }

    #[test]
    fn osquery_json_is_parsed_exactly() {
        let rows =
            parse_osquery_json(b"[\n  {\"a\":\"1\",\"b\":\"\"},\n  {\"a\":\"2\",\"b\":\"x\"}\n]\n")
                .unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1]["b"], "x");
        assert!(parse_osquery_json(b"[\n\n]\n").unwrap().is_empty());
        // Values are always strings in osquery's output; anything else is not osquery's format.
        assert!(parse_osquery_json(b"[{\"a\":1}]").is_err());
        assert!(parse_osquery_json(b"[{\"a\":null}]").is_err());
        assert!(parse_osquery_json(b"{\"a\":\"1\"}").is_err());
        assert!(parse_osquery_json(b"").is_err());
        // Invalid UTF-8 inside a value is tolerated.
        let rows = parse_osquery_json(b"[{\"a\":\"\xff\"}]").unwrap();
        assert_eq!(rows[0]["a"], "\u{fffd}");
    }

    fn ran(code: i32, stdout: &str, stderr: &str) -> ExecOutcome {
        ExecOutcome {
            exit: GuestExit::Exited(i64::from(code)),
            stdout: Captured::capped(stdout.as_bytes().to_vec(), 1 << 20, false),
            stderr: Captured::capped(stderr.as_bytes().to_vec(), 1 << 20, false),
            duration: Duration::ZERO,
        }
    }

    #[test]
    fn osquery_errors_are_recognised() {
        let t = Duration::from_secs(30);
        let e =
            osquery_rows(&ran(1, "[\n\n]\n", "Error: no such table: nope\n"), t, 100).unwrap_err();
        assert!(e.contains("no such table: nope"), "{e}");
        // Exit 0 with an error line (old osquery's stdin form) is still an error.
        let e = osquery_rows(&ran(0, "", "Error: incomplete SQL: SELECT 1\n"), t, 100).unwrap_err();
        assert!(e.contains("incomplete SQL"), "{e}");
        let e = osquery_rows(&ran(127, "", "env: can't execute\n"), t, 100).unwrap_err();
        assert!(e.contains("could not be started"), "{e}");
        let mut timed_out = ran(0, "", "");
        timed_out.exit = GuestExit::TimedOut;
        assert!(osquery_rows(&timed_out, t, 100)
            .unwrap_err()
            .contains("30s"));
        let mut big = ran(0, "[", "");
        big.stdout.truncated = true;
        assert!(osquery_rows(&big, t, 100).unwrap_err().contains("narrow"));
        // Warnings alone do not make an error.
        let rows = osquery_rows(
            &ran(
                0,
                "[\n  {\"a\":\"b\"}\n]\n",
                "W0101 00:00:00.000000 1 virtual_table.cpp:1] warn\n",
            ),
            t,
            100,
        )
        .unwrap();
        assert_eq!(rows.len(), 1);
    }

    #[test]
    fn column_expectations_need_rows_and_every_row_to_match() {
        let row = |v: &str| Row::from([("hostname".to_owned(), v.to_owned())]);
        assert_eq!(
            judge_column(&[row("web1")], "hostname", "web1").unwrap().0,
            CheckStatus::Pass
        );
        assert_eq!(
            judge_column(&[row("web1"), row("web2")], "hostname", "web1")
                .unwrap()
                .0,
            CheckStatus::Fail
        );
        assert_eq!(
            judge_column(&[], "hostname", "web1").unwrap().0,
            CheckStatus::Fail
        );
        assert!(judge_column(&[row("web1")], "other", "web1").is_err());
    }

    #[test]
    fn placeholders_render_from_the_context_only() {
        let ctx = CheckContext::new()
            .with("hostname", "web1")
            .with("vmid", "120");
        let e: Expectation = "h == '{hostname}-{vmid}'".parse().unwrap();
        let Expectation::ColumnEquals { value, .. } = e else {
            panic!("not a column expectation")
        };
        assert_eq!(ctx.render(&value).unwrap(), "web1-120");
        assert!(CheckContext::new().render(&value).is_err());
    }

    #[test]
    fn a_failing_check_naming_a_unit_the_isolation_kept_failed_says_why() {
        let unit_row = |id: &str| Row::from([("id".to_owned(), id.to_owned())]);
        let result = |status, id: &str| CheckResult {
            name: "no-failed-units".into(),
            status,
            rows: vec![unit_row(id)],
            row_count: 1,
            rows_truncated: false,
            message: Some(format!("expected rows == 0, the query returned 1: {id}")),
            duration_ms: 0,
        };
        let kept = vec![(
            "networking.service".to_string(),
            "the stanza of eth0.5 did not come up".to_string(),
        )];
        let mut results = vec![
            result(CheckStatus::Fail, "networking.service"),
            result(CheckStatus::Fail, "cron.service"),
            result(CheckStatus::Pass, "networking.service"),
        ];
        say_why_kept(&mut results, &kept);
        assert_eq!(
            results[0].message.as_deref(),
            Some(
                "expected rows == 0, the query returned 1: networking.service; \
                 networking.service: the stanza of eth0.5 did not come up"
            )
        );
        // A check that does not name the unit, or passed, says nothing more.
        assert_eq!(
            results[1].message.as_deref(),
            Some("expected rows == 0, the query returned 1: cron.service")
        );
        assert!(!results[2]
            .message
            .as_deref()
            .unwrap_or("")
            .contains("eth0.5"));
    }

    #[test]
    fn results_serialize_as_the_report_expects() {
        let r = CheckResult {
            name: "os".into(),
            status: CheckStatus::Fail,
            rows: vec![Row::from([("name".to_owned(), "Debian".to_owned())])],
            row_count: 1,
            rows_truncated: false,
            message: Some("m".into()),
            duration_ms: 3,
        };
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["name"], "os");
        assert_eq!(v["status"], "fail");
        assert_eq!(v["rows"][0]["name"], "Debian");
        let guest = GuestRef {
            kind: crate::pve::GuestKind::Lxc,
            vmid: 120,
        };
        let err = verdict(guest, &[r]).unwrap_err();
        assert_eq!(err.code(), ErrorCode::CheckFailed);
        assert!(err.to_string().contains("CT 120") && err.to_string().contains("failed: os"));
    }

    #[test]
    fn the_run_uses_absolute_paths_and_one_shot_flags_and_reads_its_lines_strictly() {
        let script = run_script();
        assert!(script.contains("test -x /usr/bin/osqueryi; then o=/usr/bin/osqueryi s=;"));
        assert!(script.contains("o=/opt/osquery/bin/osqueryd s=-S;"));
        assert!(script.contains(&format!("\"$o\" $s {} \"$3\"", OSQUERY_FLAGS.join(" "))));
        assert!(
            !script.contains("@OSQUERY") && !script.contains("@FLAGS@"),
            "{script}"
        );
        // A check line: 1-based index within the run, status, the watchdog's flag, time.
        assert_eq!(
            check_line("2", "0", "0", "15", 3),
            Some((1, GuestExit::Exited(0), 15))
        );
        assert_eq!(
            check_line("1", "137", "1", "1000", 1),
            Some((0, GuestExit::TimedOut, 1000))
        );
        assert_eq!(
            check_line("1", "137", "0", "9", 1),
            Some((0, GuestExit::Signaled(9), 9))
        );
        assert_eq!(
            check_line("1", "127", "0", "9", 1),
            Some((0, GuestExit::Exited(127), 9))
        );
        assert_eq!(check_line("0", "0", "0", "1", 3), None);
        assert_eq!(check_line("4", "0", "0", "1", 3), None);
        assert_eq!(check_line("1", "none", "0", "1", 3), None);
    }

    #[test]
    fn a_check_reads_systemd_units_by_the_table_name_as_a_word() {
        assert!(reads_systemd_units("SELECT id FROM systemd_units WHERE x"));
        assert!(reads_systemd_units("select * from SYSTEMD_UNITS"));
        assert!(reads_systemd_units(
            "SELECT count(*) FROM (SELECT id FROM systemd_units)"
        ));
        assert!(!reads_systemd_units("SELECT hostname FROM system_info"));
        assert!(!reads_systemd_units("SELECT * FROM my_systemd_units_copy"));
    }

    /// The two VM hostname checks both hostname tests read: one against `{hostname}`, one
    /// naming a literal host.
    const VM_HOSTNAME_PACK: &str = r#"
[[check]]
name = "hostname"
sql = "SELECT hostname FROM system_info"
expect = "hostname == '{hostname}'"

[[check]]
name = "named-vm"
sql = "SELECT hostname FROM system_info"
expect = "hostname == 'web01.example.com'"
"#;

    /// A check's result with one `hostname` row for each of `hosts`; any status but a pass
    /// carries the message "why".
    fn hostname_result(name: &str, status: CheckStatus, hosts: &[&str]) -> CheckResult {
        CheckResult {
            name: name.to_string(),
            status,
            rows: hosts
                .iter()
                .map(|h| Row::from([("hostname".to_string(), h.to_string())]))
                .collect(),
            row_count: hosts.len() as u64,
            rows_truncated: false,
            message: (status != CheckStatus::Pass).then(|| "why".to_string()),
            duration_ms: 1,
        }
    }

    #[test]
    fn a_vm_hostname_check_that_fails_says_it_cannot_judge_and_nothing_else_changes() {
        let pack = format!(
            "{VM_HOSTNAME_PACK}
[[check]]
name = \"no-failed-units\"
sql = \"SELECT id FROM systemd_units WHERE active_state = 'failed'\"
expect = \"rows == 0\"
"
        );
        let checks = parse_pack(&pack, Path::new("/p.toml")).expect("pack");
        assert!(compares_to(&checks[0], "hostname"));
        assert!(!compares_to(&checks[1], "hostname") && !compares_to(&checks[2], "hostname"));
        let result =
            |name: &str, status: CheckStatus, host: &str| hostname_result(name, status, &[host]);
        let mut results = vec![
            result("hostname", CheckStatus::Fail, "web01.example.com"),
            result("named-vm", CheckStatus::Fail, "web01"),
            result("no-failed-units", CheckStatus::Fail, "x"),
        ];
        vm_hostname_unjudged(&checks, &mut results, "web-01");
        // Not judged is not a pass: skipped, and the verdict stays ok for it alone.
        assert_eq!(results[0].status, CheckStatus::Skipped);
        let vm = GuestRef {
            kind: crate::pve::GuestKind::Qemu,
            vmid: 120,
        };
        assert!(verdict(vm, &results[..1]).is_ok());
        let m = results[0].message.as_deref().unwrap_or("");
        assert!(
            m.starts_with("not judged")
                && m.contains("'web-01'")
                && m.contains("calls itself 'web01.example.com'"),
            "{m}"
        );
        // A literal name and any other check keep their failure.
        assert_eq!(results[1].status, CheckStatus::Fail);
        assert_eq!(results[2].status, CheckStatus::Fail);
        // An error (osquery could not run) stays an error; a pass stays a plain pass.
        let mut results = vec![result("hostname", CheckStatus::Error, "")];
        vm_hostname_unjudged(&checks, &mut results, "web-01");
        assert_eq!(results[0].status, CheckStatus::Error);
        let mut results = vec![result("hostname", CheckStatus::Pass, "web-01")];
        vm_hostname_unjudged(&checks, &mut results, "web-01");
        assert_eq!(results[0].message, None);
    }

    #[test]
    fn a_cloud_init_vm_hostname_check_is_judged_against_what_pve_wrote() {
        let checks = parse_pack(VM_HOSTNAME_PACK, Path::new("/p.toml")).expect("pack");
        // PVE's `name: web01`, `searchdomain: example.com`.
        let names = crate::pve::guest_config::CloudInitName {
            hostname: "web01".to_string(),
            fqdn: "web01.example.com".to_string(),
        };
        // A distribution that prefers the FQDN: `{hostname}` (the PVE name, `web01`) fails,
        // the guest's name is what cloud-init was given: a pass that says so.
        let mut results = vec![
            hostname_result("hostname", CheckStatus::Fail, &["web01.example.com"]),
            hostname_result("named-vm", CheckStatus::Fail, &["web01"]),
        ];
        vm_hostname_cloudinit(&checks, &mut results, &names);
        assert_eq!(results[0].status, CheckStatus::Pass);
        let m = results[0].message.as_deref().unwrap_or("");
        assert!(
            m.contains("names this VM 'web01' (FQDN 'web01.example.com'")
                && m.contains("calls itself 'web01.example.com' as cloud-init set it"),
            "{m}"
        );
        // A check with a literal name is the operator's own: untouched.
        assert_eq!(results[1].status, CheckStatus::Fail);
        assert_eq!(results[1].message.as_deref(), Some("why"));
        // Another name, no row, or a second row with another name: a fail naming both.
        for hosts in [&["localhost"][..], &[], &["web01", "debian"]] {
            let mut results = vec![hostname_result("hostname", CheckStatus::Fail, hosts)];
            vm_hostname_cloudinit(&checks, &mut results, &names);
            assert_eq!(results[0].status, CheckStatus::Fail, "{hosts:?}");
            let m = results[0].message.as_deref().unwrap_or("");
            assert!(
                m.contains("names this VM 'web01'")
                    && m.contains("cloud-init did not set it")
                    && m.contains(if hosts.is_empty() {
                        "calls itself nothing"
                    } else {
                        "calls itself '"
                    }),
                "{hosts:?}: {m}"
            );
        }
        // An error stays an error; a pass stays a plain pass.
        let mut results = vec![
            hostname_result("hostname", CheckStatus::Error, &[]),
            hostname_result("hostname", CheckStatus::Pass, &["web01"]),
        ];
        vm_hostname_cloudinit(&checks, &mut results, &names);
        assert_eq!(results[0].status, CheckStatus::Error);
        assert_eq!(results[1].message, None);
    }
}
