//! The configuration file (`/etc/felhom-agent/agent.toml`) and the secrets it points to,
//! validated into a [`Config`].
//!
//! Unknown keys are errors. The PVE token secret file must be mode 0600 or stricter. The secret
//! itself is kept in a [`Secret`], whose `Debug` never shows it; this module never puts a secret
//! into an error message.

use std::fmt;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{ErrorCode, Failure};

/// The default bound of the wait for a guest's boot (`[provision] boot_timeout_secs`).
pub const BOOT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);
/// Bounds of `[provision] boot_timeout_secs`.
pub const BOOT_TIMEOUT_SECS: std::ops::RangeInclusive<u64> = 5..=3600;

/// A secret value (token secret, hub credential). `Debug` and `Display` never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wrap a secret.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }
    /// The secret, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// How the server certificate of PVE or the hub is trusted. There is no insecure mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsTrust {
    /// The SHA-256 fingerprint of the server certificate (DER), 32 bytes.
    Pin([u8; 32]),
    /// A PEM file of CA certificates.
    CaFile(PathBuf),
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from.
    pub path: PathBuf,
    /// This node's name (default: short hostname).
    pub node: String,
    /// The fleet's pool.
    pub pool: String,
    /// Journal, outbox, locks.
    pub state_dir: PathBuf,
    /// The cluster-wide guest list.
    pub vmlist_path: PathBuf,
    /// PVE's users, groups, pools and ACLs (`/etc/pve/user.cfg`): the exec helper reads the
    /// agent's pool's members from it.
    pub user_cfg_path: PathBuf,
    /// `datacenter.cfg`, read by `doctor` for the `next-id` lint.
    pub datacenter_cfg: PathBuf,
    /// `jobs.cfg`, the cluster's scheduled jobs: `doctor` reads its backup jobs (through the
    /// exec helper, which hands over only their guest selection and schedule).
    pub jobs_cfg: PathBuf,
    /// PVE's state of each scheduled job (`vzdump-<id>.json`, pve-manager `PVE/Jobs.pm`):
    /// a restore run starts no copy while a backup job of this node runs.
    pub jobs_state_dir: PathBuf,
    /// The PVE API.
    pub pve: PveConfig,
    /// The hub, if configured.
    pub hub: Option<HubConfig>,
    /// Provision defaults.
    pub provision: ProvisionConfig,
    /// The self-restore-test.
    pub restore_test: RestoreTestConfig,
    /// `[metrics]`: node_exporter's textfile collector folder.
    pub metrics: MetricsConfig,
    /// `[policy]`: what a provision may use at most, whoever asks (command line or hub).
    pub policy: Policy,
    /// `[journal] keep_days`: settled transactions older than this move to the archive.
    pub journal_keep_days: u32,
    /// `[agent] user`: the system user the agent runs as, if not root. The exec helper accepts
    /// callers with this user's uid (and root); a command-line run started as root switches to
    /// it for good after reading the config and the secrets ([`crate::privdrop`]).
    pub agent_user: Option<String>,
    /// `[exec]`: how the agent runs commands in LXC containers.
    pub exec: ExecConfig,
}

/// The default socket of the root exec helper.
pub const DEFAULT_EXEC_HELPER_SOCKET: &str = "/run/felhom-agent/exec.sock";

/// The default folder of the nodes' configs in pmxcfs (`nodes/<node>/lxc/<vmid>.conf`).
pub const DEFAULT_PVE_NODES_DIR: &str = "/etc/pve/nodes";

/// LXC's default lxcpath, the one PVE uses (pve-container `check_running` matches it).
pub const DEFAULT_LXC_PATH: &str = "/var/lib/lxc";

/// `[exec]`.
#[derive(Debug, Clone)]
pub struct ExecConfig {
    /// `helper_socket`: the root exec helper's socket (absolute). `None`: the default
    /// ([`DEFAULT_EXEC_HELPER_SOCKET`]) is used when the agent does not run as root.
    pub helper_socket: Option<PathBuf>,
    /// `pve_nodes_dir`: where the exec helper reads a container's config
    /// (`<pve_nodes_dir>/<node>/lxc/<vmid>.conf`) before every request (absolute; default
    /// [`DEFAULT_PVE_NODES_DIR`]).
    pub pve_nodes_dir: PathBuf,
    /// `lxc_path`: LXC's lxcpath (absolute; default `/var/lib/lxc`, PVE's): the container's
    /// command socket `@<lxc_path>/<vmid>/command` must be held by root's LXC monitor before
    /// every `pct exec` (`guest::lxc_monitor`).
    pub lxc_path: PathBuf,
}

impl Default for ExecConfig {
    fn default() -> Self {
        Self {
            helper_socket: None,
            pve_nodes_dir: PathBuf::from(DEFAULT_PVE_NODES_DIR),
            lxc_path: PathBuf::from(DEFAULT_LXC_PATH),
        }
    }
}

/// Bounds of `[journal] keep_days` (0: archive every settled transaction at once).
pub const JOURNAL_KEEP_DAYS: std::ops::RangeInclusive<u32> = 0..=36500;

/// `[policy]`: the node's limits, which no request (the hub's included) can exceed. Each list
/// is optional; `None` is no limit, an empty list allows nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    /// Target storages a provision may use.
    pub storages: Option<Vec<String>>,
    /// Glob patterns (`*` any run of characters, `?` one character) of backup volids.
    pub sources: Option<Vec<String>>,
    /// Bootstrap profiles a provision may run.
    pub profiles: Option<Vec<String>>,
}

impl Policy {
    /// Whether no key is set.
    pub fn is_unlimited(&self) -> bool {
        self.storages.is_none() && self.sources.is_none() && self.profiles.is_none()
    }

    /// Whether a provision may use target storage `sid`.
    pub fn allows_storage(&self, sid: &str) -> bool {
        self.storages
            .as_ref()
            .is_none_or(|l| l.iter().any(|s| s == sid))
    }

    /// Whether a provision may restore backup `volid`.
    pub fn allows_source(&self, volid: &str) -> bool {
        self.sources
            .as_ref()
            .is_none_or(|l| l.iter().any(|p| glob_match(p, volid)))
    }

    /// Whether a provision may run bootstrap profile `name`.
    pub fn allows_profile(&self, name: &str) -> bool {
        self.profiles
            .as_ref()
            .is_none_or(|l| l.iter().any(|p| p == name))
    }

    /// One line per key, for `doctor` and messages.
    pub fn describe(&self) -> String {
        fn one(key: &str, v: &Option<Vec<String>>) -> String {
            match v {
                None => format!("{key}: any"),
                Some(l) if l.is_empty() => format!("{key}: none"),
                Some(l) => format!("{key}: {}", l.join(", ")),
            }
        }
        [
            one("storages", &self.storages),
            one("sources", &self.sources),
            one("profiles", &self.profiles),
        ]
        .join("; ")
    }
}

/// Match `text` against a glob `pattern`: `*` is any run of characters (`/` included), `?` is
/// exactly one character, everything else stands for itself.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    // Iterative matching with one backtrack point: the last `*` seen.
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == '?' || c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    pi = sp + 1;
                    ti = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// `[restore_test]`.
#[derive(Debug, Clone)]
pub struct RestoreTestConfig {
    /// Storages whose backups are tested (default: the storage of `provision.selftest_source`,
    /// else `local`).
    pub backup_storages: Vec<String>,
    /// A fixed list of backup volids to prove, instead of the newest backup of each
    /// pool guest.
    pub sources: Vec<String>,
    /// Target storage of the restored copy (default: `provision.storage`).
    pub storage: String,
    /// The check pack folder for restored copies (default: `provision.checks_dir`).
    pub checks_dir: PathBuf,
    /// The operator-made bridges the NICs of an isolated VM copy are restored onto, with their
    /// stored models and MACs, one VM copy per bridge at a time: no ports, no address of the
    /// node (IPv4 or IPv6). `lab_bridge` first, then `lab_bridges`. Empty: an isolated VM copy
    /// starts with no NIC.
    pub lab_bridges: Vec<String>,
    /// Every guest's newest backup is proven within this many seconds (`prove_within`,
    /// default 7 days): due for longer, a guest is `overdue`.
    pub prove_within: u64,
    /// Re-test a proven backup after this many seconds (`reprove_after`; `None`: never).
    pub reprove_after: Option<u64>,
    /// A run starts no new copy after this many seconds (`run_budget`, default 4 hours).
    pub run_budget: u64,
    /// How many copies run at once (`at_once`, default 2).
    pub at_once: AtOnce,
    /// A guest whose newest backup is older than this many seconds is stale (`backup_max_age`;
    /// `None`: from the schedule of the backup job that backs the guest up, else 8 days, so a
    /// weekly backup is not stale).
    pub backup_max_age: Option<u64>,
    /// No copy starts within this many seconds of a backup job's next start on this node
    /// (`backup_guard`, default 1 hour; 0: only while a job runs).
    pub backup_guard: u64,
    /// The share of the node's memory no copy may take, in percent (`memory_reserve`,
    /// default `"10%"`).
    pub memory_reserve_percent: u8,
    /// The restore's `bwlimit` in KiB/s (`bwlimit`; `None`: PVE's default).
    pub bwlimit: Option<u64>,
    /// Write each verdict into the backup's notes (`note_backups`, default off).
    pub note_backups: bool,
    /// Application groups (`[[restore_test.group]]`): guests proven together, in a lab of
    /// their own, started in the order given.
    pub groups: Vec<RestoreGroup>,
}

/// An application group: its members' copies are restored together, started one after the
/// other in `guests`' order, checked while every member is up, and destroyed together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreGroup {
    /// Its name (letters, digits, `-`, `_`; 1 to 32 characters).
    pub name: String,
    /// Its members, in start order (1 to [`GROUP_MEMBERS_MAX`], each once).
    pub guests: Vec<u32>,
    /// Seconds to wait after a member's boot ended before the next member starts.
    pub boot_delay: u64,
}

/// The most members of a group: the restore-test band's vmids.
pub const GROUP_MEMBERS_MAX: usize = 10;
/// The longest `boot_delay` (seconds).
pub const GROUP_BOOT_DELAY_MAX: u64 = 600;

impl RestoreTestConfig {
    /// The group `guest` belongs to.
    pub fn group_of(&self, guest: u32) -> Option<&RestoreGroup> {
        self.groups.iter().find(|g| g.guests.contains(&guest))
    }
    /// The first lab bridge (`lab_bridge`, else the first of `lab_bridges`): the one a check
    /// names when it speaks of one.
    pub fn lab_bridge(&self) -> Option<&str> {
        self.lab_bridges.first().map(String::as_str)
    }
}

/// `[restore_test] at_once`: a number of copies, or what the node's means allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtOnce {
    /// At most this many (1 to 10).
    Fixed(u8),
    /// What the node's free memory and the band's free vmids allow (at most 10).
    Auto,
}

impl AtOnce {
    /// The most copies this setting ever runs at once.
    pub fn ceiling(self) -> usize {
        match self {
            AtOnce::Fixed(n) => usize::from(n),
            AtOnce::Auto => AT_ONCE_MAX,
        }
    }
}

/// The most copies at once: the restore-test band has ten vmids.
pub const AT_ONCE_MAX: usize = 10;
/// `prove_within`, `backup_max_age` and `reprove_after` may be from an hour to a year and a day.
const COVERAGE_SECS: std::ops::RangeInclusive<u64> = 3600..=366 * 86_400;
/// `backup_guard`: none to a day.
const BACKUP_GUARD_SECS: std::ops::RangeInclusive<u64> = 0..=86_400;
/// `run_budget`: from a minute to a week.
const RUN_BUDGET_SECS: std::ops::RangeInclusive<u64> = 60..=7 * 86_400;

/// Parse a duration of the config (`"7d"`, `"12h"`, `"30m"`, `"90s"`) into seconds.
pub fn parse_duration(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = t.split_at(split);
    let n: u64 = n.parse().ok()?;
    let mul = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return None,
    };
    n.checked_mul(mul)
}

/// A duration key of `[restore_test]` (`"7d"`, `"12h"`, `"30m"`) in seconds, within `range`;
/// `default` when the key is absent.
fn coverage_secs(
    path: &Path,
    key: &str,
    text: Option<&str>,
    default: &str,
    range: &std::ops::RangeInclusive<u64>,
) -> Result<u64, Failure> {
    let text = text.unwrap_or(default);
    match parse_duration(text) {
        Some(s) if range.contains(&s) => Ok(s),
        _ => Err(invalid(format!(
            "{}: [restore_test] {key} = {:?} is not a duration from {} to {}; write a number and a unit: \"7d\" (days), \"12h\" (hours), \"30m\" (minutes){}",
            path.display(),
            crate::error::outside_text(text),
            human_secs(*range.start()),
            human_secs(*range.end()),
            if default.is_empty() { String::new() } else { format!(" (default {default:?})") }
        ))),
    }
}

/// `3600` as `1h`, `86400` as `1d`, `90` as `90s`: a duration as the config writes it.
pub fn human_secs(s: u64) -> String {
    if s == 0 {
        "0m".to_string()
    } else if s.is_multiple_of(86_400) {
        format!("{}d", s / 86_400)
    } else if s.is_multiple_of(3600) {
        format!("{}h", s / 3600)
    } else if s.is_multiple_of(60) {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

/// Whether `name` can be `[restore_test] lab_bridge`: a Linux bridge name as PVE's
/// `pve-iface` format takes it without a VLAN suffix (pve-common `PVE/JSONSchema.pm`
/// `pve_verify_iface`: a letter, then letters, digits or `_`), within IFNAMSIZ (15).
pub fn valid_lab_bridge(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && name.len() <= 15
        && name.len() >= 2
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The credential names under `$CREDENTIALS_DIRECTORY` (systemd's `LoadCredential=`), read
/// instead of the configured secret files when present: `pve-token` for `[pve]
/// token_secret_file`, `hub-token` for `[hub] token_file`.
pub const CREDENTIAL_PVE_TOKEN: &str = "pve-token";
/// See [`CREDENTIAL_PVE_TOKEN`].
pub const CREDENTIAL_HUB_TOKEN: &str = "hub-token";

/// The default `[metrics] dir`: the agent's own folder (the package makes it, owned by the
/// agent's user; `felhom-agent metrics-publish` copies its files, checked, into node_exporter's
/// textfile folder).
pub const DEFAULT_METRICS_DIR: &str = "/var/lib/felhom-agent-metrics";

/// `[metrics]`.
#[derive(Debug, Clone)]
pub struct MetricsConfig {
    /// Where the `.prom` files are written (node_exporter reads them through the package's links
    /// in its textfile folder); default [`DEFAULT_METRICS_DIR`]. `[restore_test] metrics_dir` is the older spelling.
    pub dir: PathBuf,
}

/// `[pve]`.
#[derive(Debug, Clone)]
pub struct PveConfig {
    /// Base URL, e.g. `https://127.0.0.1:8006`.
    pub url: String,
    /// `user@realm!tokenname`.
    pub token_id: String,
    /// Where the secret came from.
    pub token_secret_file: PathBuf,
    /// The secret.
    pub token_secret: Secret,
    /// How the certificate is trusted.
    pub tls: TlsTrust,
}

/// `[hub]`.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// `wss://…` URL.
    pub url: String,
    /// Where the credential came from.
    pub token_file: PathBuf,
    /// The credential.
    pub token: Secret,
    /// How the certificate is trusted (`None`: the system roots).
    pub tls: Option<TlsTrust>,
}

/// `[provision]`.
#[derive(Debug, Clone)]
pub struct ProvisionConfig {
    /// Target storage for guest disks.
    pub storage: String,
    /// The backup the selftest restores from.
    pub selftest_source: Option<String>,
    /// One folder per bootstrap profile.
    pub bootstrap_dir: PathBuf,
    /// `*.toml` check packs.
    pub checks_dir: PathBuf,
    /// How long a started guest may take to answer its first exec (the proof of launch).
    pub launch_timeout: std::time::Duration,
    /// How long a launched guest's boot may take to end (systemd `is-system-running` answering running or degraded),
    /// for provisions and restore tests alike.
    pub boot_timeout: std::time::Duration,
}

/// Bounds of `[provision] launch_timeout_secs`.
pub const LAUNCH_TIMEOUT_SECS: std::ops::RangeInclusive<u64> = 5..=3600;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    node: Option<String>,
    pool: String,
    state_dir: Option<PathBuf>,
    vmlist_path: Option<PathBuf>,
    user_cfg_path: Option<PathBuf>,
    datacenter_cfg: Option<PathBuf>,
    jobs_cfg: Option<PathBuf>,
    jobs_state_dir: Option<PathBuf>,
    agent: Option<RawAgent>,
    exec: Option<RawExec>,
    pve: RawPve,
    hub: Option<RawHub>,
    provision: Option<RawProvision>,
    restore_test: Option<RawRestoreTest>,
    metrics: Option<RawMetrics>,
    policy: Option<RawPolicy>,
    journal: Option<RawJournal>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAgent {
    user: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawExec {
    helper_socket: Option<PathBuf>,
    pve_nodes_dir: Option<PathBuf>,
    lxc_path: Option<PathBuf>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawJournal {
    keep_days: Option<u32>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    dir: Option<PathBuf>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    storages: Option<Vec<String>>,
    sources: Option<Vec<String>>,
    profiles: Option<Vec<String>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawRestoreTest {
    backup_storages: Option<Vec<String>>,
    sources: Option<Vec<String>>,
    storage: Option<String>,
    checks_dir: Option<PathBuf>,
    metrics_dir: Option<PathBuf>,
    lab_bridge: Option<String>,
    lab_bridges: Option<Vec<String>>,
    prove_within: Option<String>,
    reprove_after: Option<String>,
    run_budget: Option<String>,
    at_once: Option<RawAtOnce>,
    backup_max_age: Option<String>,
    backup_guard: Option<String>,
    memory_reserve: Option<String>,
    bwlimit: Option<u64>,
    note_backups: Option<bool>,
    group: Option<Vec<RawGroup>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGroup {
    name: String,
    guests: Vec<i64>,
    boot_delay: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawAtOnce {
    Number(i64),
    Word(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPve {
    url: String,
    token_id: String,
    token_secret_file: PathBuf,
    tls_fingerprint: Option<String>,
    ca_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHub {
    url: String,
    token_file: PathBuf,
    tls_fingerprint: Option<String>,
    ca_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawProvision {
    storage: Option<String>,
    selftest_source: Option<String>,
    bootstrap_dir: Option<PathBuf>,
    checks_dir: Option<PathBuf>,
    launch_timeout_secs: Option<u64>,
    boot_timeout_secs: Option<u64>,
}

/// `[[restore_test.group]]`, checked: a name of its own, 1 to [`GROUP_MEMBERS_MAX`] guests,
/// each in one group only, and a boot delay within bounds (whether each is a pool guest with
/// a backup is judged by the run and by `doctor`).
fn groups_of(path: &Path, raw: Vec<RawGroup>) -> Result<Vec<RestoreGroup>, Failure> {
    let mut groups: Vec<RestoreGroup> = Vec::new();
    for g in raw {
        let shown = crate::error::outside_text(&g.name);
        let name_ok = !g.name.is_empty()
            && g.name.len() <= 32
            && g.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !name_ok {
            return Err(invalid(format!(
                "{}: a [[restore_test.group]] is named {shown:?}; a group's name is 1 to 32 letters, digits, '-' or '_' (e.g. \"shop\")",
                path.display()
            )));
        }
        if groups.iter().any(|o| o.name == g.name) {
            return Err(invalid(format!(
                "{}: two [[restore_test.group]] are named {shown:?}; give each group a name of its own",
                path.display()
            )));
        }
        if g.guests.is_empty() || g.guests.len() > GROUP_MEMBERS_MAX {
            return Err(invalid(format!(
                "{}: [[restore_test.group]] {shown:?} lists {} guests; a group has 1 to {GROUP_MEMBERS_MAX} (the restore-test band's vmids)",
                path.display(),
                g.guests.len()
            )));
        }
        let mut guests: Vec<u32> = Vec::new();
        for v in g.guests {
            let Some(vmid) = u32::try_from(v).ok().filter(|v| *v > 0) else {
                return Err(invalid(format!(
                    "{}: [[restore_test.group]] {shown:?} lists {v}, which is no guest's vmid; list the vmids of pool guests",
                    path.display()
                )));
            };
            if guests.contains(&vmid) {
                return Err(invalid(format!(
                    "{}: [[restore_test.group]] {shown:?} lists guest {vmid} twice; list each member once, in start order",
                    path.display()
                )));
            }
            if let Some(other) = groups.iter().find(|o| o.guests.contains(&vmid)) {
                return Err(invalid(format!(
                    "{}: guest {vmid} is in two [[restore_test.group]]s, {:?} and {shown:?}; a guest belongs to at most one group: remove it from one of them",
                    path.display(),
                    other.name
                )));
            }
            guests.push(vmid);
        }
        let boot_delay = match g.boot_delay {
            None => 0,
            Some(d) if (0..=GROUP_BOOT_DELAY_MAX as i64).contains(&d) => d.unsigned_abs(),
            Some(d) => {
                return Err(invalid(format!(
                    "{}: [[restore_test.group]] {shown:?} has boot_delay = {d}; give 0 to {GROUP_BOOT_DELAY_MAX} seconds",
                    path.display()
                )));
            }
        };
        groups.push(RestoreGroup {
            name: g.name,
            guests,
            boot_delay,
        });
    }
    Ok(groups)
}

fn invalid(msg: String) -> Failure {
    Failure::new(ErrorCode::ConfigInvalid, msg)
}

impl Config {
    /// Read and validate the configuration at `path`, including the secret files it names.
    pub fn load(path: &Path) -> Result<Self, Failure> {
        Self::load_with(path, true)
    }

    fn load_with(path: &Path, read_secrets: bool) -> Result<Self, Failure> {
        use std::io::Read;
        let cannot = |e: std::io::Error| {
            invalid(format!(
                "cannot read config {}: {e}; create it (see /usr/share/doc/felhom-agent/agent.toml.example) or pass --config",
                path.display()
            ))
        };
        // O_NONBLOCK: a FIFO (or a device) named as the config opens at once instead of
        // waiting for a writer, and is refused below; a regular file reads as usual.
        let mut file = {
            use std::os::unix::fs::OpenOptionsExt;
            fs::OpenOptions::new()
                .read(true)
                .custom_flags((nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_NOCTTY).bits())
                .open(path)
                .map_err(cannot)?
        };
        // Checked on the open file: the file read is the file checked.
        let meta = file.metadata().map_err(cannot)?;
        if !meta.is_file() {
            return Err(invalid(format!(
                "config {} is not a regular file; --config must name the agent.toml file itself",
                path.display()
            )));
        }
        if let Some(why) = untrusted_reason(path, &meta, "config") {
            return Err(invalid(why));
        }
        let mut text = String::new();
        file.read_to_string(&mut text).map_err(cannot)?;
        Self::parse_with(path, &text, read_secrets)
    }

    /// [`Config::load`] without reading the secret files (their paths are still validated;
    /// the secrets are empty): for the root exec helper, which talks to neither PVE nor the
    /// hub, and must start whoever owns those files (the agent's user may own them).
    pub fn load_without_secrets(path: &Path) -> Result<Self, Failure> {
        Self::load_with(path, false)
    }

    /// Validate configuration text that was read from `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Self, Failure> {
        Self::parse_with(path, text, true)
    }

    fn parse_with(path: &Path, text: &str, read_secrets: bool) -> Result<Self, Failure> {
        let creds = credentials_dir();
        let secret_of = |p: &Path, name: &str| {
            if read_secrets {
                read_secret(p, name, creds.as_deref())
            } else {
                Ok((p.to_path_buf(), Secret::new(String::new())))
            }
        };
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            invalid(format!(
                "config {} is invalid: {}",
                path.display(),
                e.to_string().trim_end()
            ))
        })?;
        let node = match raw.node {
            Some(n) => n,
            None => short_hostname().map_err(|e| {
                invalid(format!(
                    "config {}: node is not set and the hostname cannot be read ({e}); set node = \"<name>\"",
                    path.display()
                ))
            })?,
        };
        if node.is_empty() {
            return Err(invalid(format!(
                "config {}: node must not be empty",
                path.display()
            )));
        }
        if raw.pool.is_empty() {
            return Err(invalid(format!(
                "config {}: pool must not be empty",
                path.display()
            )));
        }
        let pve_tls = tls_trust(path, "pve", raw.pve.tls_fingerprint.as_deref(), raw.pve.ca_file.as_ref())?
            .ok_or_else(|| {
                invalid(format!(
                    "config {}: [pve] needs tls_fingerprint (SHA-256 of the certificate, `pvenode cert info`) or ca_file; there is no insecure mode",
                    path.display()
                ))
            })?;
        if !raw.pve.url.starts_with("https://") {
            return Err(invalid(format!(
                "config {}: [pve] url {:?} must start with https://",
                path.display(),
                raw.pve.url
            )));
        }
        validate_token_id(&raw.pve.token_id).map_err(|why| {
            invalid(format!(
                "config {}: [pve] token_id {:?} {why}",
                path.display(),
                raw.pve.token_id
            ))
        })?;
        let (token_secret_file, token_secret) =
            secret_of(&raw.pve.token_secret_file, CREDENTIAL_PVE_TOKEN)?;
        let pve = PveConfig {
            url: raw.pve.url.trim_end_matches('/').to_string(),
            token_id: raw.pve.token_id,
            token_secret_file,
            token_secret,
            tls: pve_tls,
        };
        let hub = match raw.hub {
            None => None,
            Some(h) => {
                if !(h.url.starts_with("wss://") || h.url.starts_with("ws://")) {
                    return Err(invalid(format!(
                        "config {}: [hub] url {:?} must start with wss://",
                        path.display(),
                        h.url
                    )));
                }
                let tls = tls_trust(
                    path,
                    "hub",
                    h.tls_fingerprint.as_deref(),
                    h.ca_file.as_ref(),
                )?;
                let (token_file, token) = secret_of(&h.token_file, CREDENTIAL_HUB_TOKEN)?;
                Some(HubConfig {
                    url: h.url,
                    token_file,
                    token,
                    tls,
                })
            }
        };
        let journal_keep_days = raw.journal.unwrap_or_default().keep_days.unwrap_or(90);
        if !JOURNAL_KEEP_DAYS.contains(&journal_keep_days) {
            return Err(invalid(format!(
                "{}: [journal] keep_days = {journal_keep_days} is out of range; use {} to {} days (default 90)",
                path.display(),
                JOURNAL_KEEP_DAYS.start(),
                JOURNAL_KEEP_DAYS.end()
            )));
        }
        let p = raw.provision.unwrap_or_default();
        let rt = raw.restore_test.unwrap_or_default();
        let launch_timeout_secs = p.launch_timeout_secs.unwrap_or(180);
        if !LAUNCH_TIMEOUT_SECS.contains(&launch_timeout_secs) {
            return Err(invalid(format!(
                "{}: [provision] launch_timeout_secs = {launch_timeout_secs} is out of range; use {} to {} seconds (default 180)",
                path.display(),
                LAUNCH_TIMEOUT_SECS.start(),
                LAUNCH_TIMEOUT_SECS.end()
            )));
        }
        let boot_timeout_secs = p.boot_timeout_secs.unwrap_or(BOOT_TIMEOUT.as_secs());
        if !BOOT_TIMEOUT_SECS.contains(&boot_timeout_secs) {
            return Err(invalid(format!(
                "{}: [provision] boot_timeout_secs = {boot_timeout_secs} is out of range; use {} to {} seconds (default {})",
                path.display(),
                BOOT_TIMEOUT_SECS.start(),
                BOOT_TIMEOUT_SECS.end(),
                BOOT_TIMEOUT.as_secs()
            )));
        }
        let provision = ProvisionConfig {
            storage: p.storage.unwrap_or_else(|| "local-lvm".to_string()),
            selftest_source: p.selftest_source,
            bootstrap_dir: p
                .bootstrap_dir
                .unwrap_or_else(|| PathBuf::from("/etc/felhom-agent/bootstrap.d")),
            checks_dir: p
                .checks_dir
                .unwrap_or_else(|| PathBuf::from("/etc/felhom-agent/checks.d")),
            launch_timeout: std::time::Duration::from_secs(launch_timeout_secs),
            boot_timeout: std::time::Duration::from_secs(boot_timeout_secs),
        };
        let restore_test = RestoreTestConfig {
            backup_storages: rt.backup_storages.unwrap_or_else(|| {
                vec![provision
                    .selftest_source
                    .as_deref()
                    .and_then(|s| s.split_once(':'))
                    .map_or("local", |(sid, _)| sid)
                    .to_string()]
            }),
            sources: rt.sources.unwrap_or_default(),
            storage: rt.storage.unwrap_or_else(|| provision.storage.clone()),
            checks_dir: rt
                .checks_dir
                .unwrap_or_else(|| provision.checks_dir.clone()),
            lab_bridges: {
                let mut bridges: Vec<String> = Vec::new();
                let given = rt
                    .lab_bridge
                    .map(|b| ("lab_bridge", b))
                    .into_iter()
                    .chain(rt.lab_bridges.unwrap_or_default().into_iter().map(|b| ("lab_bridges", b)));
                for (key, b) in given {
                    if !valid_lab_bridge(&b) {
                        return Err(invalid(format!(
                            "{}: [restore_test] {key} names {:?}, not a bridge name (a letter, then letters, digits or '_', 2 to 15 characters, no VLAN suffix); name the bridges made for isolated VM copies in /etc/network/interfaces, e.g. \"vmbr9\"",
                            path.display(),
                            crate::error::outside_text(&b)
                        )));
                    }
                    if !bridges.contains(&b) {
                        bridges.push(b);
                    }
                }
                if bridges.len() > AT_ONCE_MAX {
                    return Err(invalid(format!(
                        "{}: [restore_test] lab_bridge and lab_bridges name {} bridges; at most {AT_ONCE_MAX} VM copies run at once (the restore-test band has {AT_ONCE_MAX} vmids): name at most {AT_ONCE_MAX}",
                        path.display(),
                        bridges.len()
                    )));
                }
                bridges
            },
            prove_within: coverage_secs(path, "prove_within", rt.prove_within.as_deref(), "7d", &COVERAGE_SECS)?,
            reprove_after: match rt.reprove_after.as_deref() {
                None => None,
                Some(t) => Some(coverage_secs(path, "reprove_after", Some(t), "", &COVERAGE_SECS)?),
            },
            run_budget: coverage_secs(path, "run_budget", rt.run_budget.as_deref(), "4h", &RUN_BUDGET_SECS)?,
            at_once: match rt.at_once {
                None => AtOnce::Fixed(2),
                Some(RawAtOnce::Word(w)) if w == "auto" => AtOnce::Auto,
                Some(RawAtOnce::Number(n)) if (1..=AT_ONCE_MAX as i64).contains(&n) => {
                    AtOnce::Fixed(u8::try_from(n).unwrap_or(2))
                }
                Some(other) => {
                    let shown = match other {
                        RawAtOnce::Number(n) => n.to_string(),
                        RawAtOnce::Word(w) => format!("{:?}", crate::error::outside_text(&w)),
                    };
                    return Err(invalid(format!(
                        "{}: [restore_test] at_once = {shown} is out of range; give 1 to {AT_ONCE_MAX} copies at once (the restore-test band has {AT_ONCE_MAX} vmids), or \"auto\" for what the node's free memory and the band allow (default 2)",
                        path.display()
                    )));
                }
            },
            backup_max_age: match rt.backup_max_age.as_deref() {
                None => None,
                Some(t) => Some(coverage_secs(path, "backup_max_age", Some(t), "", &COVERAGE_SECS)?),
            },
            backup_guard: coverage_secs(path, "backup_guard", rt.backup_guard.as_deref(), "1h", &BACKUP_GUARD_SECS)?,
            memory_reserve_percent: match rt.memory_reserve.as_deref() {
                None => 10,
                Some(t) => match t.trim().strip_suffix('%').and_then(|n| n.trim().parse::<u8>().ok()) {
                    Some(n) if n <= 90 => n,
                    _ => {
                        return Err(invalid(format!(
                            "{}: [restore_test] memory_reserve = {:?} is not a share of the node's memory; give a percentage from \"0%\" to \"90%\" (default \"10%\")",
                            path.display(),
                            crate::error::outside_text(t)
                        )))
                    }
                },
            },
            bwlimit: match rt.bwlimit {
                Some(0) => {
                    return Err(invalid(format!(
                        "{}: [restore_test] bwlimit = 0 is not a limit; give KiB/s (e.g. 102400 for 100 MiB/s) or leave it out for PVE's default",
                        path.display()
                    )))
                }
                b => b,
            },
            note_backups: rt.note_backups.unwrap_or(false),
            groups: groups_of(path, rt.group.unwrap_or_default())?,
        };
        let metrics_dir = match (raw.metrics.and_then(|m| m.dir), rt.metrics_dir) {
            (Some(_), Some(_)) => {
                return Err(invalid(format!(
                    "config {}: both [metrics] dir and [restore_test] metrics_dir are set; keep \
                     only [metrics] dir",
                    path.display()
                )))
            }
            (Some(d), None) | (None, Some(d)) => d,
            (None, None) => PathBuf::from(DEFAULT_METRICS_DIR),
        };
        if !metrics_dir.is_absolute() {
            return Err(invalid(format!(
                "config {}: [metrics] dir {} is relative; give the absolute path of \
                 node_exporter's textfile collector folder",
                path.display(),
                metrics_dir.display()
            )));
        }
        let metrics = MetricsConfig { dir: metrics_dir };
        let rp = raw.policy.unwrap_or_default();
        for (key, list) in [
            ("storages", &rp.storages),
            ("sources", &rp.sources),
            ("profiles", &rp.profiles),
        ] {
            if list.iter().flatten().any(|e| e.trim().is_empty()) {
                return Err(invalid(format!(
                    "config {}: [policy] {key} holds an empty entry; remove it (an empty list allows nothing, a missing key allows anything)",
                    path.display()
                )));
            }
        }
        let policy = Policy {
            storages: rp.storages,
            sources: rp.sources,
            profiles: rp.profiles,
        };
        let state_dir = raw
            .state_dir
            .unwrap_or_else(|| PathBuf::from("/var/lib/felhom-agent"));
        // The journal there is what proves which guests this agent created: a relative folder
        // would move with the working directory of whoever starts the agent.
        if !state_dir.is_absolute() {
            return Err(invalid(format!(
                "config {}: state_dir {:?} is relative; give an absolute, persistent folder (default /var/lib/felhom-agent): its journal decides which guests this agent may destroy",
                path.display(),
                state_dir.display().to_string()
            )));
        }
        // And a folder emptied at boot or kept in memory would forget, after a reboot, the
        // guests this agent created (and the PVE tasks it was following).
        if let Some(why) = state_dir_volatility(&state_dir) {
            return Err(invalid(format!(
                "config {}: state_dir {:?} {why}; its journal decides which guests this agent may destroy and must survive a reboot: set state_dir to a folder on persistent disk, e.g. /var/lib/felhom-agent (the default)",
                path.display(),
                state_dir.display().to_string()
            )));
        }
        let agent_user = raw.agent.unwrap_or_default().user;
        if let Some(user) = &agent_user {
            if !valid_user_name(user) {
                return Err(invalid(format!(
                    "config {}: [agent] user {:?} is not a system user name (lowercase letters, digits, `_`, `-`, at most 32, not starting with a digit or `-`); set the user the agent runs as, e.g. felhom-agent",
                    path.display(),
                    user
                )));
            }
        }
        let raw_exec = raw.exec.unwrap_or_default();
        let exec = ExecConfig {
            helper_socket: raw_exec.helper_socket,
            pve_nodes_dir: raw_exec
                .pve_nodes_dir
                .unwrap_or_else(|| PathBuf::from(DEFAULT_PVE_NODES_DIR)),
            lxc_path: raw_exec
                .lxc_path
                .unwrap_or_else(|| PathBuf::from(DEFAULT_LXC_PATH)),
        };
        if !exec.lxc_path.is_absolute()
            || exec
                .lxc_path
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(invalid(format!(
                "config {}: [exec] lxc_path {:?} must be an absolute path without `..` (default {})",
                path.display(),
                exec.lxc_path.display().to_string(),
                DEFAULT_LXC_PATH
            )));
        }
        if !exec.pve_nodes_dir.is_absolute()
            || exec
                .pve_nodes_dir
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(invalid(format!(
                "config {}: [exec] pve_nodes_dir {:?} must be an absolute path without `..` (default {DEFAULT_PVE_NODES_DIR})",
                path.display(),
                exec.pve_nodes_dir.display().to_string()
            )));
        }
        if let Some(sock) = &exec.helper_socket {
            if !sock.is_absolute()
                || sock
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir))
            {
                return Err(invalid(format!(
                    "config {}: [exec] helper_socket {:?} must be an absolute path without `..` (default {DEFAULT_EXEC_HELPER_SOCKET})",
                    path.display(),
                    sock.display().to_string()
                )));
            }
        }
        let user_cfg_path = raw
            .user_cfg_path
            .unwrap_or_else(|| PathBuf::from("/etc/pve/user.cfg"));
        if !user_cfg_path.is_absolute() {
            return Err(invalid(format!(
                "config {}: user_cfg_path {:?} is relative; give the absolute path (default /etc/pve/user.cfg)",
                path.display(),
                user_cfg_path.display().to_string()
            )));
        }
        Ok(Config {
            path: path.to_path_buf(),
            node,
            pool: raw.pool,
            state_dir,
            vmlist_path: raw
                .vmlist_path
                .unwrap_or_else(|| PathBuf::from("/etc/pve/.vmlist")),
            user_cfg_path,
            datacenter_cfg: raw
                .datacenter_cfg
                .unwrap_or_else(|| PathBuf::from("/etc/pve/datacenter.cfg")),
            jobs_cfg: raw
                .jobs_cfg
                .unwrap_or_else(|| PathBuf::from("/etc/pve/jobs.cfg")),
            jobs_state_dir: raw
                .jobs_state_dir
                .unwrap_or_else(|| PathBuf::from("/var/lib/pve-manager/jobs")),
            pve,
            hub,
            provision,
            restore_test,
            metrics,
            policy,
            journal_keep_days,
            agent_user,
            exec,
        })
    }
}

fn tls_trust(
    path: &Path,
    section: &str,
    fingerprint: Option<&str>,
    ca_file: Option<&PathBuf>,
) -> Result<Option<TlsTrust>, Failure> {
    match (fingerprint, ca_file) {
        (Some(_), Some(_)) => Err(invalid(format!(
            "config {}: [{section}] sets both tls_fingerprint and ca_file; keep one",
            path.display()
        ))),
        (Some(fp), None) => parse_fingerprint(fp)
            .map(|b| Some(TlsTrust::Pin(b)))
            .map_err(|why| {
                invalid(format!(
                    "config {}: [{section}] tls_fingerprint {why}",
                    path.display()
                ))
            }),
        (None, Some(ca)) => Ok(Some(TlsTrust::CaFile(ca.clone()))),
        (None, None) => Ok(None),
    }
}

/// Folders that do not survive a reboot on a Proxmox VE node (Debian: `/tmp` may be tmpfs or
/// cleaned at boot, `/run` and `/dev/shm` are tmpfs).
pub const VOLATILE_PREFIXES: [&str; 3] = ["/tmp", "/run", "/dev/shm"];

/// `RAMFS_MAGIC` of `linux/magic.h` (nix names tmpfs but not ramfs).
const RAMFS_MAGIC: u32 = 0x8584_58f6;

/// Why `state_dir` would not survive a reboot, or `None`: it is in memory (tmpfs, ramfs:
/// `statfs` of the folder, or of its nearest existing parent when it does not exist yet), it
/// lies under one of [`VOLATILE_PREFIXES`], or it names a parent (`..`), which would make the
/// prefix check meaningless. A folder whose file system cannot be read is not refused here
/// (`doctor` reports it).
pub fn state_dir_volatility(state_dir: &Path) -> Option<String> {
    if state_dir
        .components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Some("contains `..`".to_string());
    }
    if let Some(fs) = memory_file_system(state_dir) {
        return Some(format!("is on {fs}, which lives in memory"));
    }
    VOLATILE_PREFIXES
        .iter()
        .find(|p| state_dir.starts_with(p))
        .map(|p| format!("is under {p}, which does not survive a reboot"))
}

/// `tmpfs` or `ramfs` when the file system holding `path` (or its nearest existing parent)
/// is one of them.
pub fn memory_file_system(path: &Path) -> Option<&'static str> {
    let probe = path.ancestors().find(|p| p.exists())?;
    let fs = nix::sys::statfs::statfs(probe).ok()?;
    let ty = fs.filesystem_type();
    if ty == nix::sys::statfs::TMPFS_MAGIC {
        return Some("tmpfs");
    }
    // The magic is a 32-bit value; the C type is wider on 64-bit targets.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let magic = ty.0 as u32;
    (magic == RAMFS_MAGIC).then_some("ramfs")
}

/// Parse a SHA-256 fingerprint: 64 hex digits, colons optional, any case.
pub fn parse_fingerprint(s: &str) -> Result<[u8; 32], String> {
    let hex: String = s.chars().filter(|c| *c != ':').collect();
    let bytes = hex::decode(hex.trim())
        .map_err(|_| format!("{s:?} is not hex (expected 64 hex digits, colons optional)"))?;
    bytes
        .try_into()
        .map_err(|b: Vec<u8>| format!("has {} bytes, a SHA-256 fingerprint has 32", b.len()))
}

/// Format a fingerprint as PVE shows it (`AB:CD:…`).
pub fn format_fingerprint(fp: &[u8; 32]) -> String {
    fp.iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A system user name as Debian's `adduser --system` accepts it: lowercase letters, digits,
/// `_` and `-`, 1 to 32 characters, not starting with a digit or `-`.
pub fn valid_user_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && !name.starts_with(|c: char| c.is_ascii_digit() || c == '-')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

fn validate_token_id(id: &str) -> Result<(), &'static str> {
    let (user, token) = id
        .split_once('!')
        .ok_or("must look like user@realm!tokenname")?;
    let (name, realm) = user
        .split_once('@')
        .ok_or("must look like user@realm!tokenname")?;
    if name.is_empty() || realm.is_empty() || token.len() < 2 {
        return Err("must look like user@realm!tokenname");
    }
    if id.contains(char::is_whitespace) || id.contains('=') {
        return Err("must not contain spaces or '='");
    }
    Ok(())
}

/// Whether `uid` may own a file the agent trusts: root, or the user the agent runs as.
fn trusted_owner(uid: u32) -> bool {
    uid == 0 || uid == nix::unistd::geteuid().as_raw()
}

/// Why `meta` (of `path`, a `what`) cannot be trusted: owned by someone else than root (or
/// the agent's own user), or writable by group or others. `None` when it can.
pub fn untrusted_reason(path: &Path, meta: &fs::Metadata, what: &str) -> Option<String> {
    let mode = meta.mode() & 0o7777;
    if !trusted_owner(meta.uid()) {
        return Some(format!(
            "{what} {} is owned by uid {}, not root; whoever owns it could change what the agent does: `chown root:root {}`",
            path.display(),
            meta.uid(),
            path.display()
        ));
    }
    if mode & 0o022 != 0 {
        return Some(format!(
            "{what} {} has mode {mode:04o}, writable by group or others; run `chmod go-w {}`",
            path.display(),
            path.display()
        ));
    }
    None
}

/// Check that the folder `path` (a `what`: `checks_dir`, `bootstrap_dir`, `state_dir`) is a
/// folder owned by root (or the agent's own user) and not writable by group or others.
pub fn check_trusted_dir(path: &Path, what: &str) -> Result<(), String> {
    let meta =
        fs::metadata(path).map_err(|e| format!("cannot read {what} {}: {e}", path.display()))?;
    if !meta.is_dir() {
        return Err(format!("{what} {} is not a folder", path.display()));
    }
    match untrusted_reason(path, &meta, what) {
        Some(why) => Err(why),
        None => Ok(()),
    }
}

/// `$CREDENTIALS_DIRECTORY` when systemd set it (an absolute path), else `None`.
pub fn credentials_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("CREDENTIALS_DIRECTORY")?);
    dir.is_absolute().then_some(dir)
}

/// The value the units give a credential whose file systemd could not read
/// (`SetCredential=<name>:absent` beside `LoadCredential=`).
pub const CREDENTIAL_ABSENT: &str = "absent";

/// Read the secret configured at `configured`, or, when `creds` (systemd's credentials folder)
/// holds a credential named `name`, that one instead. Returns the file read and the secret;
/// both go through [`read_secret_file`]'s checks (a credential is owned by the service's user,
/// mode 0400).
pub fn read_secret(
    configured: &Path,
    name: &str,
    creds: Option<&Path>,
) -> Result<(PathBuf, Secret), Failure> {
    if let Some(dir) = creds {
        let cred = dir.join(name);
        if fs::symlink_metadata(&cred).is_ok() {
            let secret = read_secret_file(&cred)?;
            // The units' `SetCredential=<name>:absent`: systemd's default when the
            // LoadCredential= file could not be read (a node without a hub has no hub-token).
            if secret.expose() == CREDENTIAL_ABSENT {
                return Err(invalid(format!(
                    "the service found no {} when it started (its credential {name} is the unit's default {CREDENTIAL_ABSENT:?}); create the file (mode 0600, owned by root) and restart the unit, or remove the section that names it from the config",
                    configured.display()
                )));
            }
            return Ok((cred, secret));
        }
    }
    match read_secret_file(configured) {
        Ok(s) => Ok((configured.to_path_buf(), s)),
        Err(f) if creds.is_none() && !nix::unistd::geteuid().is_root() => Err(Failure::new(
            f.code,
            format!(
                "{}; the agent runs as uid {} and the secret files are root's: start it through its systemd unit, which hands them over with LoadCredential={name}:{} (or run the command as root)",
                f.message,
                nix::unistd::geteuid(),
                configured.display()
            ),
        )),
        Err(f) => Err(f),
    }
}

/// The uid of the `[agent] user`, when it is set and exists.
pub fn agent_user_uid(user: Option<&str>) -> Option<u32> {
    let name = user?;
    nix::unistd::User::from_name(name)
        .ok()
        .flatten()
        .map(|u| u.uid.as_raw())
}

/// Why the state folder (`path`, `meta`) cannot be trusted, or `None`: as [`untrusted_reason`],
/// except that a folder owned by the `[agent] user` is accepted too (a run as root, before or
/// without switching to that user, finds the folder the user owns). Never writable by group
/// or others.
pub fn untrusted_state_dir_reason(
    path: &Path,
    meta: &fs::Metadata,
    agent_user: Option<&str>,
) -> Option<String> {
    if agent_user_uid(agent_user) == Some(meta.uid()) {
        let mode = meta.mode() & 0o7777;
        return (mode & 0o022 != 0).then(|| {
            format!(
                "state_dir {} has mode {mode:04o}, writable by group or others; run `chmod 700 {}`",
                path.display(),
                path.display()
            )
        });
    }
    untrusted_reason(path, meta, "state_dir").map(|why| match agent_user {
        Some(u) => format!("{why} (or `chown {u}:{u}`, the agent's user)"),
        None => why,
    })
}

/// [`untrusted_state_dir_reason`] for `cfg.state_dir`, which must be a folder.
pub fn check_trusted_state_dir(cfg: &Config) -> Result<(), String> {
    let path = &cfg.state_dir;
    let meta =
        fs::metadata(path).map_err(|e| format!("cannot read state_dir {}: {e}", path.display()))?;
    if !meta.is_dir() {
        return Err(format!("state_dir {} is not a folder", path.display()));
    }
    match untrusted_state_dir_reason(path, &meta, cfg.agent_user.as_deref()) {
        Some(why) => Err(why),
        None => Ok(()),
    }
}

/// The largest secret file read.
const MAX_SECRET_BYTES: u64 = 64 * 1024;

/// Read a secret file: opened without following a symlink, then checked on the open file (a
/// regular file, owned by root or the agent's own user, no access for group or others).
pub fn read_secret_file(path: &Path) -> Result<Secret, Failure> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(nix::libc::ELOOP) {
                invalid(format!(
                    "secret file {} is a symbolic link; a secret file must be a regular file owned by root with mode 0600: replace the link with the file",
                    path.display()
                ))
            } else {
                invalid(format!(
                    "cannot read secret file {}: {e}; create it owned by root with mode 0600",
                    path.display()
                ))
            }
        })?;
    let meta = file
        .metadata()
        .map_err(|e| invalid(format!("cannot read secret file {}: {e}", path.display())))?;
    if !meta.is_file() {
        return Err(invalid(format!(
            "secret file {} is not a regular file; put the secret in a regular file owned by root with mode 0600",
            path.display()
        )));
    }
    if !trusted_owner(meta.uid()) {
        return Err(invalid(format!(
            "secret file {} is owned by uid {}, not root; run `chown root:root {}` (and rotate the secret if others could read it)",
            path.display(),
            meta.uid(),
            path.display()
        )));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(invalid(format!(
            "secret file {} has mode {mode:04o}, group or others can read or change it; run `chmod 600 {}` (and rotate the secret if others could read it)",
            path.display(),
            path.display()
        )));
    }
    let mut bytes = Vec::new();
    file.take(MAX_SECRET_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| invalid(format!("cannot read secret file {}: {e}", path.display())))?;
    if bytes.len() as u64 > MAX_SECRET_BYTES {
        return Err(invalid(format!(
            "secret file {} is larger than {MAX_SECRET_BYTES} bytes; it must hold only the secret",
            path.display()
        )));
    }
    let text = String::from_utf8(bytes)
        .map_err(|_| invalid(format!("secret file {} is not UTF-8 text", path.display())))?;
    let secret = text.trim();
    if secret.is_empty() {
        return Err(invalid(format!("secret file {} is empty", path.display())));
    }
    // One line of printable ASCII: it goes into an HTTP header, where a second line or a
    // control character would otherwise surface later as a failed TLS or HTTP request. What
    // is wrong is said by position, never by showing the text.
    if let Some(why) = secret_shape_problem(secret) {
        return Err(Failure::new(
            ErrorCode::TokenFileInvalid,
            format!(
                "secret file {} {why}; it must hold the secret alone on one line (printable ASCII, no spaces; a final newline is fine): write it again with `install -m 600 /dev/stdin {}` and paste the secret",
                path.display(),
                path.display()
            ),
        ));
    }
    Ok(Secret::new(secret))
}

/// What is wrong with a trimmed secret's shape, never quoting it: several lines, a control
/// character, a space or a non-ASCII character.
fn secret_shape_problem(secret: &str) -> Option<String> {
    let lines = secret.lines().count();
    if lines > 1 {
        return Some(format!("holds {lines} lines"));
    }
    secret
        .char_indices()
        .find(|(_, c)| !c.is_ascii_graphic())
        .map(|(i, c)| {
            let what = if c.is_control() {
                "a control character"
            } else if c.is_whitespace() {
                "a space"
            } else {
                "a non-ASCII character"
            };
            format!("holds {what} at byte {i}")
        })
}

/// The node name PVE uses: `uname -n` up to the first `.`.
pub fn short_hostname() -> Result<String, String> {
    let h = nix::unistd::gethostname().map_err(|e| e.to_string())?;
    let h = h.to_string_lossy();
    Ok(h.split('.').next().unwrap_or("").to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    fn secret_file(dir: &Path, mode: u32) -> PathBuf {
        let p = dir.join("token");
        let mut f = fs::File::create(&p).expect("create");
        f.write_all(b"11111111-2222-4333-8444-555555555555\n")
            .expect("write");
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).expect("chmod");
        p
    }

    fn sample(token: &Path, extra: &str) -> String {
        format!(
            "node = \"pve1\"\npool = \"felhom\"\n{extra}\n[pve]\nurl = \"https://127.0.0.1:8006\"\ntoken_id = \"felhom@pve!agent\"\ntoken_secret_file = \"{}\"\ntls_fingerprint = \"{}\"\n",
            token.display(),
            ["AB"; 32].join(":")
        )
    }

    #[test]
    fn valid_config_loads_and_hides_secret() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let c = Config::parse(Path::new("/x.toml"), &sample(&t, "")).expect("valid");
        assert_eq!(c.node, "pve1");
        assert_eq!(c.pve.tls, TlsTrust::Pin([0xAB; 32]));
        assert_eq!(c.provision.storage, "local-lvm");
        let dbg = format!("{c:?}");
        assert!(
            !dbg.contains("11111111-2222"),
            "secret leaked into Debug: {dbg}"
        );
    }

    #[test]
    fn the_exec_helper_loads_the_config_without_reading_secret_files() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o644);
        let path = d.path().join("agent.toml");
        fs::write(&path, sample(&t, "")).expect("write");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).expect("chmod");
        // A secret file the agent would refuse (readable by others) does not stop the helper,
        // and nothing of it is read.
        assert!(Config::load(&path).is_err());
        let c = Config::load_without_secrets(&path).expect("loads");
        assert_eq!(c.pve.token_secret.expose(), "");
        assert_eq!(c.pve.token_secret_file, t);
    }

    #[test]
    fn exec_helper_keys_default_and_are_checked() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let c = Config::parse(Path::new("/x.toml"), &sample(&t, "")).expect("valid");
        assert_eq!(c.user_cfg_path, PathBuf::from("/etc/pve/user.cfg"));
        assert_eq!(c.jobs_cfg, PathBuf::from("/etc/pve/jobs.cfg"));
        assert_eq!(c.agent_user, None);
        assert_eq!(c.exec.helper_socket, None);
        assert_eq!(c.exec.pve_nodes_dir, PathBuf::from("/etc/pve/nodes"));
        let with = |top: &str, tail: &str| {
            Config::parse(
                Path::new("/x.toml"),
                &format!("{}\n{tail}\n", sample(&t, top)),
            )
        };
        let c = with(
            "user_cfg_path = \"/srv/user.cfg\"\njobs_cfg = \"/srv/jobs.cfg\"",
            "[agent]\nuser = \"felhom-agent\"\n[exec]\nhelper_socket = \"/run/x/exec.sock\"\npve_nodes_dir = \"/srv/pve/nodes\"",
        )
        .expect("valid");
        assert_eq!(c.exec.pve_nodes_dir, PathBuf::from("/srv/pve/nodes"));
        assert_eq!(c.user_cfg_path, PathBuf::from("/srv/user.cfg"));
        assert_eq!(c.jobs_cfg, PathBuf::from("/srv/jobs.cfg"));
        assert_eq!(c.agent_user.as_deref(), Some("felhom-agent"));
        assert_eq!(
            c.exec.helper_socket.as_deref(),
            Some(Path::new("/run/x/exec.sock"))
        );
        for (top, tail, key) in [
            ("user_cfg_path = \"user.cfg\"", "", "user_cfg_path"),
            ("", "[agent]\nuser = \"Bad User\"", "[agent] user"),
            ("", "[agent]\nuser = \"\"", "[agent] user"),
            ("", "[exec]\nhelper_socket = \"exec.sock\"", "helper_socket"),
            (
                "",
                "[exec]\nhelper_socket = \"/run/../etc/x\"",
                "helper_socket",
            ),
            ("", "[exec]\nsocket = \"/x\"", "socket"),
            ("", "[exec]\npve_nodes_dir = \"nodes\"", "pve_nodes_dir"),
        ] {
            let err = with(top, tail).expect_err(key);
            assert_eq!(err.code, ErrorCode::ConfigInvalid);
            assert!(err.message.contains(key), "{key}: {}", err.message);
        }
    }

    #[test]
    fn journal_keep_days_defaults_to_90_and_is_bounded() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let c = Config::parse(Path::new("/x.toml"), &sample(&t, "")).expect("valid");
        assert_eq!(c.journal_keep_days, 90);
        let with = |text: &str| {
            Config::parse(
                Path::new("/x.toml"),
                &format!("{}\n[journal]\n{text}\n", sample(&t, "")),
            )
        };
        assert_eq!(with("keep_days = 0").expect("0").journal_keep_days, 0);
        let err = with("keep_days = 36501").expect_err("out of range");
        assert!(err.message.contains("keep_days"), "{}", err.message);
        assert_eq!(
            with("keep = 3").expect_err("unknown key").code,
            ErrorCode::ConfigInvalid
        );
    }

    #[test]
    fn launch_timeout_defaults_to_180_s_and_is_bounded() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let c = Config::parse(Path::new("/x.toml"), &sample(&t, "")).expect("valid");
        assert_eq!(
            c.provision.launch_timeout,
            std::time::Duration::from_secs(180)
        );
        let with = |secs: u64| {
            let text = format!(
                "{}\n[provision]\nlaunch_timeout_secs = {secs}\n",
                sample(&t, "")
            );
            Config::parse(Path::new("/x.toml"), &text)
        };
        assert_eq!(
            with(30).expect("30 s").provision.launch_timeout,
            std::time::Duration::from_secs(30)
        );
        for bad in [0, 4, 3601] {
            let err = with(bad).expect_err("out of range");
            assert_eq!(err.code, ErrorCode::ConfigInvalid);
            assert!(
                err.message.contains("launch_timeout_secs") && err.message.contains("/x.toml"),
                "{}",
                err.message
            );
        }
    }

    #[test]
    fn lab_bridge_is_a_plain_bridge_name_or_absent() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let load = |extra: &str| Config::parse(Path::new("/x.toml"), &sample(&t, extra));
        assert_eq!(load("").expect("default").restore_test.lab_bridge(), None);
        assert_eq!(
            load("[restore_test]\nlab_bridge = \"vmbr9\"")
                .expect("vmbr9")
                .restore_test
                .lab_bridge(),
            Some("vmbr9")
        );
        // lab_bridge first, then lab_bridges, each once.
        assert_eq!(
            load("[restore_test]\nlab_bridge = \"vmbr9\"\nlab_bridges = [\"vmbr10\", \"vmbr9\", \"vmbr11\"]")
                .expect("three")
                .restore_test
                .lab_bridges,
            vec!["vmbr9", "vmbr10", "vmbr11"]
        );
        let eleven: Vec<String> = (10..21).map(|n| format!("\"vmbr{n}\"")).collect();
        let err = load(&format!(
            "[restore_test]\nlab_bridges = [{}]",
            eleven.join(",")
        ))
        .expect_err("eleven refused");
        assert!(err.message.contains("at most 10"), "{}", err.message);
        let err =
            load("[restore_test]\nlab_bridges = [\"vmbr9\", \"vmbr0.20\"]").expect_err("refused");
        assert!(
            err.message.contains("lab_bridges names \"vmbr0.20\""),
            "{}",
            err.message
        );
        for bad in [
            "",
            "9lab",
            "vmbr0.20",
            "vmbr0:1",
            "a/b",
            "averyveryverylongbridge",
        ] {
            let err = load(&format!("[restore_test]\nlab_bridge = {bad:?}")).expect_err("refused");
            assert_eq!(err.code, ErrorCode::ConfigInvalid, "{bad}");
            assert!(err.message.contains("lab_bridge"), "{}", err.message);
        }
    }

    #[test]
    fn metrics_dir_default_new_key_old_key_and_both() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let load = |extra: &str| Config::parse(Path::new("/x.toml"), &sample(&t, extra));
        assert_eq!(
            load("").expect("default").metrics.dir,
            PathBuf::from(DEFAULT_METRICS_DIR)
        );
        assert_eq!(
            load("[metrics]\ndir = \"/srv/ne\"")
                .expect("new key")
                .metrics
                .dir,
            PathBuf::from("/srv/ne")
        );
        assert_eq!(
            load("[restore_test]\nmetrics_dir = \"/srv/old\"")
                .expect("older spelling")
                .metrics
                .dir,
            PathBuf::from("/srv/old")
        );
        let both = load("[metrics]\ndir = \"/a\"\n[restore_test]\nmetrics_dir = \"/b\"")
            .expect_err("both");
        assert!(both.message.contains("[metrics] dir"), "{}", both.message);
        let rel = load("[metrics]\ndir = \"ne\"").expect_err("relative");
        assert!(rel.message.contains("relative"), "{}", rel.message);
    }

    #[test]
    fn a_relative_state_dir_is_refused() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let err = Config::parse(
            Path::new("/x.toml"),
            &sample(&t, "state_dir = \"var/lib/felhom-agent\""),
        )
        .expect_err("relative");
        assert_eq!(err.code, ErrorCode::ConfigInvalid);
        assert!(
            err.message.contains("state_dir") && err.message.contains("relative"),
            "{}",
            err.message
        );
        let ok = Config::parse(
            Path::new("/x.toml"),
            &sample(&t, "state_dir = \"/var/lib/felhom-agent\""),
        )
        .expect("absolute");
        assert_eq!(ok.state_dir, PathBuf::from("/var/lib/felhom-agent"));
    }

    #[test]
    fn a_state_dir_that_does_not_survive_a_reboot_is_refused() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let load = |dir: &str| {
            Config::parse(
                Path::new("/etc/felhom-agent/agent.toml"),
                &sample(&t, &format!("state_dir = \"{dir}\"")),
            )
        };
        // Under a prefix emptied at boot (on this machine /tmp is on the root file system, so
        // the prefix alone refuses it).
        for dir in [
            "/tmp/felhom-agent",
            "/run/felhom-agent",
            "/tmp",
            "/var/lib/../../tmp/x",
        ] {
            let err = load(dir).expect_err(dir);
            assert_eq!(err.code, ErrorCode::ConfigInvalid);
            for part in [
                "/etc/felhom-agent/agent.toml",
                "state_dir",
                dir,
                "/var/lib/felhom-agent",
            ] {
                assert!(err.message.contains(part), "{dir}: {part}: {}", err.message);
            }
        }
        assert!(load("/tmp/x")
            .expect_err("tmp")
            .message
            .contains("is under /tmp"));
        // On tmpfs: /dev/shm is tmpfs here; the file system check speaks first.
        let err = load("/dev/shm/felhom-agent/state").expect_err("tmpfs");
        assert!(err.message.contains("is on tmpfs"), "{}", err.message);
        // Look-alikes of the prefixes are fine.
        for dir in ["/var/lib/felhom-agent", "/tmpfoo/felhom", "/srv/run/felhom"] {
            let c = load(dir).unwrap_or_else(|e| panic!("{dir}: {}", e.message));
            assert_eq!(c.state_dir, PathBuf::from(dir));
        }
    }

    #[test]
    fn the_file_system_check_reads_the_nearest_existing_parent() {
        assert_eq!(memory_file_system(Path::new("/dev/shm")), Some("tmpfs"));
        assert_eq!(
            memory_file_system(Path::new("/dev/shm/not/yet/made")),
            Some("tmpfs")
        );
        assert_eq!(
            memory_file_system(Path::new(env!("CARGO_MANIFEST_DIR"))),
            None
        );
        // A tmpfs found through the file system, not the name.
        assert!(state_dir_volatility(Path::new("/dev/shm/a")).is_some_and(|w| w.contains("tmpfs")));
    }

    #[test]
    fn policy_keys_are_optional_and_limit_what_they_name() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let c = Config::parse(Path::new("/x.toml"), &sample(&t, "")).expect("valid");
        assert!(c.policy.is_unlimited());
        assert!(c.policy.allows_storage("anything"));
        let extra = "[policy]\nstorages = [\"local-lvm\"]\nsources = [\"local:backup/vzdump-*\"]\nprofiles = [\"default\", \"web\"]\n";
        let c = Config::parse(Path::new("/x.toml"), &sample(&t, extra)).expect("valid");
        assert!(c.policy.allows_storage("local-lvm"));
        assert!(!c.policy.allows_storage("local"));
        assert!(c
            .policy
            .allows_source("local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst"));
        assert!(!c
            .policy
            .allows_source("nfs:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst"));
        assert!(c.policy.allows_profile("web"));
        assert!(!c.policy.allows_profile("../../etc"));
        assert_eq!(
            c.policy.describe(),
            "storages: local-lvm; sources: local:backup/vzdump-*; profiles: default, web"
        );
        let only = "[policy]\nprofiles = []\n";
        let c = Config::parse(Path::new("/x.toml"), &sample(&t, only)).expect("valid");
        assert!(
            !c.policy.allows_profile("default"),
            "an empty list allows nothing"
        );
        assert!(
            c.policy.allows_storage("local"),
            "a missing key allows anything"
        );
        let bad = "[policy]\nstorages = [\"\"]\n";
        let e = Config::parse(Path::new("/x.toml"), &sample(&t, bad)).unwrap_err();
        assert!(e.message.contains("[policy] storages"), "{}", e.message);
        let unknown = "[policy]\nnodes = [\"pve1\"]\n";
        assert!(Config::parse(Path::new("/x.toml"), &sample(&t, unknown)).is_err());
    }

    #[test]
    fn glob_patterns() {
        for (p, t, want) in [
            (
                "local:backup/vzdump-*",
                "local:backup/vzdump-lxc-1.tar",
                true,
            ),
            ("local:backup/vzdump-*", "local:backup/other", false),
            ("*", "", true),
            ("", "", true),
            ("", "x", false),
            ("a?c", "abc", true),
            ("a?c", "ac", false),
            (
                "*-lxc-*.tar.zst",
                "local:backup/vzdump-lxc-200-x.tar.zst",
                true,
            ),
            (
                "*-lxc-*.tar.zst",
                "local:backup/vzdump-qemu-200-x.vma.zst",
                false,
            ),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "axxbyy", false),
            ("exact", "exact", true),
            ("exact", "exactly", false),
        ] {
            assert_eq!(glob_match(p, t), want, "{p:?} vs {t:?}");
        }
    }

    #[test]
    fn unknown_key_is_refused() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let e = Config::parse(Path::new("/x.toml"), &sample(&t, "colour = \"blue\"")).unwrap_err();
        assert_eq!(e.code, ErrorCode::ConfigInvalid);
        assert!(e.message.contains("colour"), "{}", e.message);
    }

    #[test]
    fn world_readable_secret_is_refused_without_leaking_it() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o644);
        let e = Config::parse(Path::new("/x.toml"), &sample(&t, "")).unwrap_err();
        assert_eq!(e.code, ErrorCode::ConfigInvalid);
        assert!(
            e.message.contains("0644") && e.message.contains("chmod 600"),
            "{}",
            e.message
        );
        assert!(!e.message.contains("11111111"));
    }

    #[test]
    fn stricter_modes_are_accepted() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o400);
        assert!(Config::parse(Path::new("/x.toml"), &sample(&t, "")).is_ok());
    }

    #[test]
    fn fingerprint_parsing() {
        let colons = ["0a"; 32].join(":");
        assert_eq!(parse_fingerprint(&colons), Ok([0x0a; 32]));
        assert_eq!(parse_fingerprint(&"0A".repeat(32)), Ok([0x0a; 32]));
        assert!(parse_fingerprint("AB:CD").is_err());
        assert!(parse_fingerprint(&"zz".repeat(32)).is_err());
        assert_eq!(format_fingerprint(&[0xab; 32]).len(), 95);
    }

    #[test]
    fn token_id_shape() {
        assert!(validate_token_id("felhom@pve!agent").is_ok());
        assert!(validate_token_id("felhom@pve").is_err());
        assert!(validate_token_id("felhom!agent").is_err());
    }
    #[test]
    fn a_secret_file_that_is_a_symlink_is_refused() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&t, &link).expect("symlink");
        let err = read_secret_file(&link).expect_err("a symlink must be refused");
        assert!(err.message.contains("symbolic link"), "{}", err.message);
        assert!(!err.message.contains("11111111"), "{}", err.message);
        read_secret_file(&t).expect("the file itself is accepted");
    }

    #[test]
    fn a_credential_is_read_instead_of_the_configured_file_and_checked_the_same() {
        let d = tempfile::tempdir().expect("tmp");
        let configured = secret_file(d.path(), 0o600);
        let creds = d.path().join("creds");
        fs::create_dir(&creds).expect("mkdir");
        let cred = creds.join(CREDENTIAL_PVE_TOKEN);
        fs::write(&cred, "from-the-credential\n").expect("write");
        fs::set_permissions(&cred, fs::Permissions::from_mode(0o400)).expect("chmod");
        let (from, secret) =
            read_secret(&configured, CREDENTIAL_PVE_TOKEN, Some(&creds)).expect("credential");
        assert_eq!(
            (from.as_path(), secret.expose()),
            (cred.as_path(), "from-the-credential")
        );
        // Another name is not there: the configured file.
        let (from, secret) =
            read_secret(&configured, CREDENTIAL_HUB_TOKEN, Some(&creds)).expect("configured");
        assert_eq!(from, configured);
        assert_eq!(secret.expose(), "11111111-2222-4333-8444-555555555555");
        // Without a credentials folder: the configured file.
        let (from, _) = read_secret(&configured, CREDENTIAL_PVE_TOKEN, None).expect("configured");
        assert_eq!(from, configured);
        // A credential others may read is refused like a secret file.
        fs::set_permissions(&cred, fs::Permissions::from_mode(0o644)).expect("chmod");
        let err = read_secret(&configured, CREDENTIAL_PVE_TOKEN, Some(&creds)).expect_err("0644");
        assert!(
            err.message.contains(&cred.display().to_string()),
            "{}",
            err.message
        );
        assert!(
            !err.message.contains("from-the-credential"),
            "{}",
            err.message
        );
    }

    #[test]
    fn a_state_dir_of_the_agent_user_is_trusted_only_for_that_user() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test must run as root");
        }
        let d = tempfile::tempdir().expect("tmp");
        let state = d.path().join("state");
        fs::create_dir(&state).expect("mkdir");
        fs::set_permissions(&state, fs::Permissions::from_mode(0o700)).expect("chmod");
        nix::unistd::chown(&state, Some(nix::unistd::Uid::from_raw(65534)), None).expect("chown");
        let meta = fs::metadata(&state).expect("stat");
        assert_eq!(
            untrusted_state_dir_reason(&state, &meta, Some("nobody")),
            None
        );
        let why = untrusted_state_dir_reason(&state, &meta, None).expect("not trusted without it");
        assert!(why.contains("uid 65534"), "{why}");
        let why = untrusted_state_dir_reason(&state, &meta, Some("root")).expect("another user");
        assert!(
            why.contains("chown root:root") && why.contains("chown root:root"),
            "{why}"
        );
        fs::set_permissions(&state, fs::Permissions::from_mode(0o770)).expect("chmod");
        let meta = fs::metadata(&state).expect("stat");
        let why =
            untrusted_state_dir_reason(&state, &meta, Some("nobody")).expect("group-writable");
        assert!(why.contains("0770"), "{why}");
    }

    #[test]
    fn a_secret_file_of_another_owner_is_refused() {
        if !nix::unistd::geteuid().is_root() {
            // chown needs root; the suite runs as root (tests/run.sh).
            panic!("this test must run as root");
        }
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        nix::unistd::chown(&t, Some(nix::unistd::Uid::from_raw(65534)), None).expect("chown");
        let err = read_secret_file(&t).expect_err("owned by nobody");
        assert!(err.message.contains("uid 65534"), "{}", err.message);
        assert!(err.message.contains("chown root:root"), "{}", err.message);
        assert!(!err.message.contains("11111111"), "{}", err.message);
    }

    #[test]
    fn a_group_writable_folder_or_config_is_refused() {
        let d = tempfile::tempdir().expect("tmp");
        let checks = d.path().join("checks.d");
        fs::create_dir(&checks).expect("mkdir");
        fs::set_permissions(&checks, fs::Permissions::from_mode(0o755)).expect("chmod");
        check_trusted_dir(&checks, "checks_dir").expect("0755 is trusted");
        fs::set_permissions(&checks, fs::Permissions::from_mode(0o775)).expect("chmod");
        let err = check_trusted_dir(&checks, "checks_dir").expect_err("group-writable");
        assert!(err.contains("0775") && err.contains("chmod go-w"), "{err}");
        let t = secret_file(d.path(), 0o600);
        let cfg = d.path().join("agent.toml");
        fs::write(&cfg, sample(&t, "")).expect("write");
        fs::set_permissions(&cfg, fs::Permissions::from_mode(0o644)).expect("chmod");
        Config::load(&cfg).expect("a 0644 config loads");
        fs::set_permissions(&cfg, fs::Permissions::from_mode(0o666)).expect("chmod");
        let err = Config::load(&cfg).expect_err("a world-writable config");
        assert!(
            err.message.contains("writable by group or others"),
            "{}",
            err.message
        );
    }

    #[test]
    fn a_secret_file_of_two_lines_or_with_spaces_is_token_file_invalid() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("token");
        for (bytes, says) in [
            (&b"11111111-2222\n4333-8444\n"[..], "holds 2 lines"),
            (&b"1111 2222\n"[..], "a space at byte 4"),
            (&b"11\x0722\n"[..], "a control character at byte 2"),
        ] {
            fs::write(&p, bytes).expect("write");
            fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).expect("chmod");
            let f = read_secret_file(&p).expect_err("refused");
            assert_eq!(f.code, ErrorCode::TokenFileInvalid, "{f:?}");
            assert!(f.message.contains(says), "{}", f.message);
            assert!(
                !f.message.contains("1111"),
                "the secret is never shown: {}",
                f.message
            );
        }
        fs::write(&p, b"11111111-2222-4333-8444-555555555555\n").expect("write");
        assert!(read_secret_file(&p).is_ok());
    }

    #[test]
    fn the_units_default_credential_names_the_missing_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let creds = dir.path().join("creds");
        fs::create_dir(&creds).expect("mkdir");
        let cred = creds.join("hub-token");
        fs::write(&cred, "absent").expect("write");
        fs::set_permissions(&cred, fs::Permissions::from_mode(0o400)).expect("chmod");
        let configured = dir.path().join("hub-token");
        let f = read_secret(&configured, "hub-token", Some(&creds)).expect_err("refused");
        assert_eq!(f.code, ErrorCode::ConfigInvalid, "{f:?}");
        assert!(
            f.message.contains(&configured.display().to_string()),
            "{}",
            f.message
        );
    }

    #[test]
    fn groups_are_read_in_start_order_and_a_guest_is_in_one_group_only() {
        let d = tempfile::tempdir().expect("tmp");
        let t = secret_file(d.path(), 0o600);
        let load = |extra: &str| Config::parse(Path::new("/x.toml"), &sample(&t, extra));
        let cfg = load(
            "[[restore_test.group]]\nname = \"shop\"\nguests = [200, 201]\nboot_delay = 30\n\n[[restore_test.group]]\nname = \"mail\"\nguests = [210]\n",
        )
        .expect("two groups");
        let g = &cfg.restore_test.groups;
        assert_eq!(g.len(), 2);
        assert_eq!(
            (g[0].name.as_str(), g[0].guests.as_slice(), g[0].boot_delay),
            ("shop", &[200, 201][..], 30)
        );
        assert_eq!((g[1].name.as_str(), g[1].boot_delay), ("mail", 0));
        assert_eq!(
            cfg.restore_test.group_of(201).map(|g| g.name.as_str()),
            Some("shop")
        );
        assert!(cfg.restore_test.group_of(300).is_none());
        let err = load(
            "[[restore_test.group]]\nname = \"shop\"\nguests = [200, 201]\n[[restore_test.group]]\nname = \"db\"\nguests = [201]\n",
        )
        .expect_err("a guest in two groups");
        assert!(
            err.message
                .contains("guest 201 is in two [[restore_test.group]]s, \"shop\" and \"db\""),
            "{}",
            err.message
        );
        for (bad, said) in [
            ("name = \"a b\"\nguests = [200]", "is named"),
            ("name = \"x\"\nguests = []", "lists 0 guests"),
            ("name = \"x\"\nguests = [200, 200]", "twice"),
            ("name = \"x\"\nguests = [-1]", "no guest's vmid"),
            (
                "name = \"x\"\nguests = [200]\nboot_delay = 601",
                "boot_delay = 601",
            ),
        ] {
            let err = load(&format!("[[restore_test.group]]\n{bad}\n")).expect_err(bad);
            assert!(err.message.contains(said), "{bad}: {}", err.message);
        }
    }
}
