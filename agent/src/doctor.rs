//! `felhom-agent doctor`: the node's preflight. It writes nothing, anywhere: only reads of
//! local files and GET requests to PVE.
//!
//! Checks: config (unknown keys, secret file mode), PVE TLS (pin or CA), the token, the
//! token's effective privileges on the pool and storages, the pool, `.vmlist`, the `next-id`
//! range (and how `.vmlist` is read: through the exec helper or directly), the backup jobs of
//! `jobs.cfg` that would back up restore-test copies (`backup_jobs`), whether the agent's
//! user can read the node's TLS keys (`node_keys`), the state dir, how LXC exec is done (the
//! exec helper answers and its `pct` resolves, or `pct` resolves here), whether the token holds
//! more than the agent's role on the pool (`least_privilege`) or more than `VM.Backup` on a
//! guest (`guest_grants`), whether the units of the agent's
//! user refuse `bind(2)`/`listen(2)` and other architectures' calls as systemd loaded them
//! (`abstract_sockets`), whether that user can run anything outside those units (a home it may
//! write, a login sshd would accept, a user manager: `agent_user_home`, `agent_user_login`,
//! `agent_user_manager`) and the hub. Each check passes, warns or fails with a message saying
//! what to fix; the command exits 0 when nothing failed and 6 otherwise.
//!
//! It returns a [`DoctorReport`]; the command line prints it. It may use `config`, `pve`, the exec
//! helper's client,
//! `inventory`, `vmid` and `error`, never a front end.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use crate::config::{Config, TlsTrust};
use crate::error::ErrorCode;
use crate::exec_helper::client::{helper_status, probe, ExecMode, StatusAnswer};
use crate::exec_helper::proto::WireStatus;
use crate::pve::types::{held_on, Permissions};
use crate::pve::{PveClient, PveError};

/// The role the README creates for the agent's token and user on the pool
/// (`pveum role add FelhomAgent -privs "…"`): exactly what the agent's requests need there, each
/// privilege tied to its request and PVE's check in `tests/data/pve-api-facts.md` §2.6.
pub const ROLE_NAME: &str = "FelhomAgent";
/// [`ROLE_NAME`]'s privileges on PVE 9.
pub const ROLE_PRIVS_PVE9: &[&str] = &role_privs("VM.GuestAgent.Unrestricted");
/// [`ROLE_NAME`]'s privileges on PVE 8 (`VM.Monitor` before `VM.GuestAgent.*`).
pub const ROLE_PRIVS_PVE8: &[&str] = &role_privs("VM.Monitor");

/// [`ROLE_NAME`]'s privileges with the release's privilege for guest agent exec.
const fn role_privs(guest_agent: &'static str) -> [&'static str; 8] {
    [
        "VM.Allocate",
        "VM.Audit",
        "VM.Backup",
        "VM.Config.Network",
        "VM.Config.Options",
        "VM.PowerMgmt",
        guest_agent,
        "Pool.Audit",
    ]
}
/// The privileges the pool token needs on `/pool/<pool>` (or above it), beside one of
/// [`AGENT_PRIVS_ANY`]. `Pool.Audit`: without it `/cluster/resources` drops each guest's
/// `pool` (pve-manager `PVE/API2/Cluster.pm` `resources`), and the inventory cannot tell the
/// pool's guests.
pub const POOL_PRIVS: &[&str] = &[
    "VM.Allocate",
    "VM.Audit",
    "VM.Backup",
    "VM.PowerMgmt",
    "VM.Config.Options",
    "VM.Config.Network",
    "Pool.Audit",
];
/// Guest agent exec: PVE 9 privilege, and the PVE 8 one it replaced.
pub const AGENT_PRIVS_ANY: &[&str] = &["VM.GuestAgent.Unrestricted", "VM.Monitor"];
/// On the target storage.
pub const STORAGE_PRIVS: &[&str] = &["Datastore.AllocateSpace"];
/// On the backup storage (to list backups): any of these.
pub const BACKUP_STORAGE_PRIVS_ANY: &[&str] = &["Datastore.Audit", "Datastore.AllocateSpace"];

/// One feature of PVE the agent relies on that bounds the versions it supports from below:
/// what, since which PVE release, and where PVE's source shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionFeature {
    /// What the agent uses.
    pub what: &'static str,
    /// The first PVE release (major, minor) that has it.
    pub since: (u32, u32),
    /// Where in PVE's source.
    pub source: &'static str,
}

/// The features that set the floor of supported PVE versions (the highest `since` wins).
pub const VERSION_FEATURES: &[VersionFeature] = &[
    VersionFeature {
        what: "`GET /pools?poolid=` (the pool read by id)",
        since: (8, 1),
        source: "pve-manager PVE/API2/Pool.pm index, \"fix #1148: api: pools: support nested pools\", pve-manager 8.1.0",
    },
    VersionFeature {
        what: "`destroy-unreferenced-disks=0` on a guest DELETE",
        since: (7, 0),
        source: "qemu-server PVE/API2/Qemu.pm destroy_vm and pve-container src/PVE/API2/LXC.pm destroy_vm, January 2021",
    },
    VersionFeature {
        what: "`source=all` in the node's task list",
        since: (6, 0),
        source: "pve-manager PVE/API2/Tasks.pm node_tasks, \"task index: allow selection of task source(s)\", 2019",
    },
];

/// Features the agent uses where present, with what it does on an older PVE (not a floor).
pub const VERSION_NOTES: &[&str] = &[
    "`VM.GuestAgent.*` privileges for guest agent exec since PVE 9.0 (pve-access-control \
     \"add VM.GuestAgent privileges\", libpve-access-control 9.0.2; qemu-server \
     PVE/API2/Qemu/Agent.pm, July 2025); `VM.Monitor` before",
    "POST bodies up to 512 KiB since libpve-http-server-perl 5.2.1 (pve-http-server \
     src/PVE/APIServer/AnyEvent.pm); the agent keeps every request within 64 KiB",
];

/// The oldest PVE release the agent supports: the newest `since` of [`VERSION_FEATURES`].
pub fn version_floor() -> (u32, u32) {
    VERSION_FEATURES
        .iter()
        .map(|f| f.since)
        .max()
        .unwrap_or((0, 0))
}

/// `(major, minor)` of a pve-manager version such as `8.2.4` or `9.1`.
pub fn parse_release(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.trim().split(['.', '-', '~']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next().and_then(|m| m.parse().ok()).unwrap_or(0);
    Some((major, minor))
}

/// The verdict on the node's PVE version: pass within the supported range, fail below the floor
/// (naming the version found, the floor and the feature that sets it), warn when unreadable.
pub fn version_verdict(version: &str) -> (CheckStatus, String) {
    let floor = version_floor();
    let needs: Vec<String> = VERSION_FEATURES
        .iter()
        .filter(|f| f.since == floor)
        .map(|f| {
            format!(
                "{} (since PVE {}.{}; {})",
                f.what, f.since.0, f.since.1, f.source
            )
        })
        .collect();
    match parse_release(version) {
        Some(found) if found >= floor => (
            CheckStatus::Pass,
            format!(
                "PVE {version} is supported (PVE {}.{} or newer: {}; {})",
                floor.0,
                floor.1,
                needs.join("; "),
                VERSION_NOTES.join("; ")
            ),
        ),
        Some(_) => (
            CheckStatus::Fail,
            format!(
                "PVE {version} is older than the oldest supported, PVE {}.{}: the agent uses {}; upgrade the node",
                floor.0,
                floor.1,
                needs.join("; ")
            ),
        ),
        None => (
            CheckStatus::Warn,
            format!(
                "PVE answered version {version:?}, which is not a version number; supported: PVE {}.{} or newer",
                floor.0, floor.1
            ),
        ),
    }
}

/// The verdict of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckStatus {
    /// Fine.
    Pass,
    /// Works, but something deserves attention.
    Warn,
    /// Broken: the agent cannot work like this.
    Fail,
    /// Not run: it depends on a check that failed (named in the message).
    Skipped,
}

/// One line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct DoctorCheck {
    /// Check name.
    pub name: &'static str,
    /// Verdict.
    pub status: CheckStatus,
    /// Stable error code of a failure.
    pub code: Option<ErrorCode>,
    /// What was found, and what to fix.
    pub message: String,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct DoctorReport {
    /// No check failed.
    pub ok: bool,
    /// The checks, in order.
    pub checks: Vec<DoctorCheck>,
}

impl DoctorReport {
    fn push(
        &mut self,
        name: &'static str,
        status: CheckStatus,
        code: Option<ErrorCode>,
        message: impl Into<String>,
    ) {
        self.checks.push(DoctorCheck {
            name,
            status,
            code,
            message: message.into(),
        });
    }
    fn pass(&mut self, name: &'static str, message: impl Into<String>) {
        self.push(name, CheckStatus::Pass, None, message);
    }
    fn warn(&mut self, name: &'static str, message: impl Into<String>) {
        self.push(name, CheckStatus::Warn, None, message);
    }
    fn fail(&mut self, name: &'static str, code: ErrorCode, message: impl Into<String>) {
        self.push(name, CheckStatus::Fail, Some(code), message);
    }
    /// Each of `names` listed as not run because `because` failed: a dependent check is never
    /// dropped silently.
    fn skipped(&mut self, names: &[&'static str], because: &str) {
        for name in names {
            self.push(
                name,
                CheckStatus::Skipped,
                None,
                format!("not checked: it needs {because}, which failed"),
            );
        }
    }
}

/// The checks that need PVE to answer over a trusted connection.
const NEEDS_PVE: [&str; 6] = [
    "pve_token",
    "pve_version",
    "pool",
    "privileges",
    "lab_bridge",
    "guest_backups",
];

/// The checks, as a report.
pub async fn check_all(config_path: &Path) -> DoctorReport {
    let mut r = DoctorReport {
        ok: true,
        checks: Vec::new(),
    };
    let cfg = match Config::load(config_path) {
        Ok(c) => {
            r.pass(
                "config",
                format!(
                    "{} is valid and writable by root only (node {}, pool {}); token secret file {} is a regular file owned by root, mode 0600 or stricter",
                    c.path.display(),
                    c.node,
                    c.pool,
                    c.pve.token_secret_file.display()
                ),
            );
            c
        }
        Err(f) => {
            r.fail("config", f.code, f.message);
            r.ok = false;
            return r;
        }
    };
    // Read as root, before the switch below: /etc/shadow, `sshd -T`, the unit folders.
    check_agent_user_confinement(&cfg, &mut r);
    drop_to_agent_user(&cfg, &mut r);
    if cfg.policy.is_unlimited() {
        r.pass(
            "policy",
            "no [policy]: a provision may use any storage, backup and profile the token allows",
        );
    } else {
        r.pass(
            "policy",
            format!(
                "[policy] limits every provision, the hub's included: {}",
                cfg.policy.describe()
            ),
        );
    }
    check_pve(&cfg, &mut r).await;
    if !cfg.restore_test.groups.is_empty() && !r.checks.iter().any(|c| c.name == GROUP_CHECK) {
        r.skipped(&[GROUP_CHECK], "PVE over a trusted connection");
    }
    check_local_files(&cfg, &mut r);
    check_packs_and_profiles(&cfg, &mut r);
    let space = crate::preflight::state_dir_space(&cfg.state_dir);
    match space.code {
        Some(code) => r.fail("state_space", code, space.message),
        None => r.pass("state_space", space.message),
    }
    check_metrics(&cfg, &mut r);
    check_abstract_sockets(&mut r);
    check_exec(&cfg, &mut r).await;
    check_hub(&cfg, &mut r).await;
    check_outbox_dropped(&cfg, &mut r);
    r.ok = r.checks.iter().all(|c| c.status != CheckStatus::Fail);
    r
}

/// `[agent] user`: every other command started as root reads the config and the secrets, then
/// switches to that user for good ([`crate::privdrop`]); `doctor` does the same here, so each
/// check below is judged by the process that will act: the files it can read and write, and
/// how it reaches into containers (the exec helper, probed as that user).
fn drop_to_agent_user(cfg: &Config, r: &mut DoctorReport) {
    use crate::privdrop::{drop_to, Dropped};
    let Some(user) = &cfg.agent_user else {
        return;
    };
    match drop_to(user) {
        Ok(Dropped::To { user, uid, .. }) => r.pass(
            "agent_user",
            format!(
                "the checks below run as [agent] user {user} (uid {uid}), as every other command does once it has read the config"
            ),
        ),
        Ok(Dropped::NotRoot) => r.pass(
            "agent_user",
            format!(
                "not started as root: the checks below run as uid {}, as the commands would",
                nix::unistd::geteuid()
            ),
        ),
        Err(f) => r.fail(
            "agent_user",
            f.code,
            format!(
                "{}; every other command stops there (exit 6); the checks below run as root",
                f.message
            ),
        ),
    }
}

async fn check_pve(cfg: &Config, r: &mut DoctorReport) {
    let client = match PveClient::new(&cfg.pve) {
        Ok(c) => c,
        Err(e) => {
            r.fail("pve_tls", e.code(), e.to_string());
            r.skipped(&NEEDS_PVE, "pve_tls");
            return;
        }
    };
    let trust = match &cfg.pve.tls {
        TlsTrust::Pin(_) => "pinned certificate fingerprint",
        TlsTrust::CaFile(p) => {
            return check_pve_with(cfg, &client, r, &format!("CA file {}", p.display())).await
        }
    };
    check_pve_with(cfg, &client, r, trust).await;
}

async fn check_pve_with(cfg: &Config, client: &PveClient, r: &mut DoctorReport, trust: &str) {
    match client.version().await {
        Ok(v) => {
            r.pass(
                "pve_tls",
                format!("{} answered over TLS trusted by the {trust}", cfg.pve.url),
            );
            r.pass(
                "pve_token",
                format!("token {} accepted by PVE {}", cfg.pve.token_id, v.version),
            );
            match version_verdict(&v.version) {
                (CheckStatus::Pass, m) => r.pass("pve_version", m),
                (CheckStatus::Fail, m) => r.fail("pve_version", ErrorCode::PveUnsupported, m),
                (CheckStatus::Warn | CheckStatus::Skipped, m) => r.warn("pve_version", m),
            }
        }
        Err(e @ PveError::Api(_)) if e.code() == ErrorCode::PveAuth => {
            r.pass(
                "pve_tls",
                format!("{} answered over TLS trusted by the {trust}", cfg.pve.url),
            );
            r.fail(
                "pve_token",
                ErrorCode::PveAuth,
                format!("PVE did not accept token {}: {e}", cfg.pve.token_id),
            );
            r.skipped(&NEEDS_PVE[1..], "pve_token");
            return;
        }
        Err(e @ PveError::Api(_)) => {
            r.pass(
                "pve_tls",
                format!("{} answered over TLS trusted by the {trust}", cfg.pve.url),
            );
            r.fail("pve_token", e.code(), e.to_string());
            r.skipped(&NEEDS_PVE[1..], "pve_token");
            return;
        }
        Err(e) => {
            r.fail("pve_tls", e.code(), e.to_string());
            r.skipped(&NEEDS_PVE, "pve_tls");
            return;
        }
    }
    // The pool first: with a mistyped pool, a recipe of grants on it would only mislead.
    let pool_missing = match client.pool(&cfg.pool).await {
        Ok(Some(_)) => {
            r.pass("pool", format!("pool {} exists", cfg.pool));
            false
        }
        Ok(None) => {
            r.fail("pool", ErrorCode::PoolMissing, format!("pool {} does not exist or the token cannot see it; create it (`pveum pool add {}`) or fix `pool` in {}", cfg.pool, cfg.pool, cfg.path.display()));
            true
        }
        Err(e) if e.code() == ErrorCode::PoolMissing => {
            r.fail("pool", ErrorCode::PoolMissing, format!("pool {} does not exist (PVE: {e}); create it (`pveum pool add {}`) or fix `pool` in {}", cfg.pool, cfg.pool, cfg.path.display()));
            true
        }
        Err(e) => {
            r.fail(
                "pool",
                e.code(),
                format!("cannot read pool {}: {e}", cfg.pool),
            );
            false
        }
    };
    if pool_missing {
        r.skipped(&["privileges"], "pool");
    } else {
        match client.permissions(None, None).await {
            Ok(perms) => check_privileges(cfg, &perms, r),
            Err(e) => r.fail(
                "privileges",
                e.code(),
                format!("cannot read the token's privileges (GET /access/permissions): {e}"),
            ),
        }
    }
    check_backups(cfg, client, r).await;
    check_lab_bridge(cfg, client, r).await;
    check_guest_backups(cfg, client, r).await;
    check_groups(cfg, client, r).await;
}

/// The doctor line of `[[restore_test.group]]`s: one for each thing that stops or weakens a
/// group's run, each naming the group (and the member), or one pass per group.
const GROUP_CHECK: &str = "restore_group";

/// `[[restore_test.group]]`: what would stop each group's run, as the run would refuse it,
/// and what its members' stored addresses cannot do in the group's lab. Fails: a member in a
/// reserved band, one that is not a pool guest of this node, VM members without `[restore_test]
/// lab_bridges` (they share a lab bridge of the group's own), members whose stored memory
/// together is more than the node can ever give copies; with a container member, a lab that
/// cannot be made here ([`check_group_lab`]). Warns: a member without a backup, a group larger than the band's free vmids,
/// or than the node's memory for copies now; a member without a static stored address, two
/// members that share no subnet ([`crate::guest::group_net::address_warnings`]). Reads only
/// (the members' stored configs through `vzdump/extractconfig`).
async fn check_groups(cfg: &Config, client: &PveClient, r: &mut DoctorReport) {
    use crate::guest::group_net::{address_warnings, nic_addresses, reserved_member, Member};
    use crate::pve::guest_config::{StoredConfig, StoredConfigText};
    use crate::pve::types::backup_kind_from_volid;
    use crate::pve::GuestKind;
    let groups = &cfg.restore_test.groups;
    if groups.is_empty() {
        return;
    }
    let guests = match client.cluster_vms().await {
        Ok(rows) => rows,
        Err(e) => {
            return r.warn(
                GROUP_CHECK,
                format!("cannot read the pool's guests (GET /cluster/resources): {e}; the members of the [[restore_test.group]]s were not judged"),
            )
        }
    };
    // The newest backup of each guest, as a run picks it.
    let mut newest: BTreeMap<u32, (String, u64)> = BTreeMap::new();
    let mut keep = |owner: u32, volid: &str, time: u64| {
        if newest.get(&owner).is_none_or(|(_, t)| time >= *t) {
            newest.insert(owner, (volid.to_string(), time));
        }
    };
    if cfg.restore_test.sources.is_empty() {
        for sid in &cfg.restore_test.backup_storages {
            match client.backups(&cfg.node, sid, None).await {
                Ok(v) => {
                    for b in v.iter().filter(|b| backup_kind_from_volid(&b.volid).is_some()) {
                        if let Some(owner) = b.vmid.and_then(|o| u32::try_from(o).ok()) {
                            keep(owner, &b.volid, b.ctime.unwrap_or(0));
                        }
                    }
                }
                Err(e) => {
                    return r.warn(
                        GROUP_CHECK,
                        format!("cannot list the backups on storage {sid} of node {}: {e}; the members of the [[restore_test.group]]s were not judged", cfg.node),
                    )
                }
            }
        }
    } else {
        for (i, volid) in cfg.restore_test.sources.iter().enumerate() {
            if let Some(owner) = crate::pve::types::backup_guest(volid) {
                keep(owner, volid, i as u64);
            }
        }
    }
    let storages = if cfg.restore_test.sources.is_empty() {
        format!(
            "the backup storage(s) {}",
            cfg.restore_test.backup_storages.join(", ")
        )
    } else {
        "[restore_test] sources".to_string()
    };
    let band = crate::vmid::RESTORE_TEST_BAND;
    let band_free = crate::exec_helper::client::full_guest_list(cfg)
        .ok()
        .map(|full| band.clone().filter(|v| full.lookup(*v).is_none()).count());
    let memory = crate::preflight::memory::node_memory_for_copies(cfg);
    let fix = format!("fix [[restore_test.group]] in {}", cfg.path.display());
    let mut containers = false;
    for g in groups {
        let before = r.checks.len();
        let gn = &g.name;
        let mut members: Vec<Member> = Vec::new();
        let mut memories: Vec<String> = Vec::new();
        let mut memory_sum = 0u64;
        let mut kinds: Vec<GuestKind> = Vec::new();
        for &m in &g.guests {
            if let Some(band) = reserved_member(m) {
                r.fail(
                    GROUP_CHECK,
                    ErrorCode::ConfigInvalid,
                    format!("group {gn}: member {m} is {band}, never a guest whose backups are proven; the group is refused: {fix}"),
                );
                continue;
            }
            let row = guests.iter().find(|x| x.vmid == m);
            let shown = match row
                .and_then(|x| x.name.as_deref())
                .filter(|n| !n.is_empty())
            {
                Some(n) => format!("{m} ({})", crate::error::outside_text_max(n, 64)),
                None => m.to_string(),
            };
            let refused = match row {
                None => Some(format!(
                    "is not a guest token {} sees (GET /cluster/resources): not a guest of pool {} on node {}",
                    cfg.pve.token_id, cfg.pool, cfg.node
                )),
                Some(x) if x.pool.as_deref() != Some(cfg.pool.as_str()) => Some(format!(
                    "is not in pool {} (add it: `pveum pool modify {} -vms {m}`)",
                    cfg.pool, cfg.pool
                )),
                Some(x) if x.node != cfg.node => Some(format!(
                    "is on node {}, and this node ({}) proves only the pool guests it holds; a group's members are proven on one node",
                    crate::error::outside_text_max(&x.node, 64),
                    cfg.node
                )),
                Some(_) => None,
            };
            if let Some(why) = refused {
                r.fail(
                    GROUP_CHECK,
                    ErrorCode::ConfigInvalid,
                    format!("group {gn}: member {shown} {why}; the group is refused: {fix}"),
                );
                continue;
            }
            let Some((volid, _)) = newest.get(&m) else {
                r.warn(
                    GROUP_CHECK,
                    format!("group {gn}: member {shown} has no backup on {storages}; the group is proven once every member has one: back it up (a backup job that includes it)"),
                );
                continue;
            };
            let is_vm = backup_kind_from_volid(volid) == Some(GuestKind::Qemu);
            kinds.push(if is_vm {
                GuestKind::Qemu
            } else {
                GuestKind::Lxc
            });
            match client.extract_config(&cfg.node, volid).await {
                Ok(text) => {
                    let stored = StoredConfigText {
                        volid: volid.clone(),
                        text,
                    };
                    let mib = crate::preflight::memory::stored_memory_mib(Some(&stored));
                    memory_sum = memory_sum.saturating_add(mib);
                    memories.push(format!("{m}: {mib} MiB"));
                    // A VM's addresses are its own guest's (not in PVE's config).
                    if is_vm {
                        continue;
                    }
                    members.push(Member {
                        vmid: m,
                        name: row
                            .and_then(|x| x.name.as_deref())
                            .map(|n| crate::error::outside_text_max(n, 64))
                            .unwrap_or_default(),
                        nics: nic_addresses(&StoredConfig::parse(&stored.text)),
                    });
                }
                Err(e) => r.warn(
                    GROUP_CHECK,
                    format!("group {gn}: member {shown}'s stored config in {volid} cannot be read ({e}); its memory and addresses were not judged, and its run's preflight refuses it if PVE cannot read it then"),
                ),
            }
        }
        let vms = kinds.iter().filter(|k| **k == GuestKind::Qemu).count();
        containers |= vms < kinds.len();
        if vms > 0 && cfg.restore_test.lab_bridges.is_empty() {
            r.fail(
                GROUP_CHECK,
                ErrorCode::ConfigInvalid,
                format!("group {gn}: its VM members need a lab bridge of the group's own: name one in [restore_test] lab_bridges of {} (the lab_bridge line says how to make one)", cfg.path.display()),
            );
        }
        if let Some(free) = band_free {
            if g.guests.len() > free {
                r.warn(
                    GROUP_CHECK,
                    format!(
                        "group {gn}: its {} members need as many vmids of the restore-test band {}-{} at once, and {free} are free (the others are held by guests of the cluster: `felhom-agent guests`); the group is left until they are free",
                        g.guests.len(),
                        band.start(),
                        band.end()
                    ),
                );
            }
        }
        if let (Some((now, most)), false) = (memory, memories.is_empty()) {
            let said = format!(
                "its members' stored memory together ({memory_sum} MiB: {})",
                memories.join(", ")
            );
            if memory_sum > most {
                r.fail(
                    GROUP_CHECK,
                    ErrorCode::ConfigInvalid,
                    format!(
                        "group {gn}: {said} is more than node {} can ever give copies ({most} MiB: its memory less [restore_test] memory_reserve = {}%); the group never runs: lower the members' memory, take a member out of the group, or lower memory_reserve in {}",
                        cfg.node,
                        cfg.restore_test.memory_reserve_percent,
                        cfg.path.display()
                    ),
                );
            } else if memory_sum > now {
                r.warn(
                    GROUP_CHECK,
                    format!(
                        "group {gn}: {said} is more than node {} allows copies now ({now} MiB available beside [restore_test] memory_reserve = {}%); the group is left until the node has that memory free",
                        cfg.node, cfg.restore_test.memory_reserve_percent
                    ),
                );
            }
        }
        for w in address_warnings(gn, &members) {
            r.warn(GROUP_CHECK, w);
        }
        if r.checks.len() == before {
            r.pass(
                GROUP_CHECK,
                format!(
                    "group {gn}: members {} are pool guests of node {} with backups; the containers' stored addresses are static and share a subnet in the group's lab, VMs share a lab bridge of the group's own{}",
                    g.guests.iter().map(u32::to_string).collect::<Vec<_>>().join(", "),
                    cfg.node,
                    match memory {
                        Some((now, _)) => format!("; {memory_sum} MiB of stored memory together, {now} MiB allowed copies now"),
                        None => String::new(),
                    }
                ),
            );
        }
    }
    if containers {
        check_group_lab(cfg, r).await;
    }
}

/// The doctor line of whether a group of containers can get its lab on this node.
const GROUP_LAB_CHECK: &str = "restore_group_lab";

/// A group of containers' lab, made and removed as a run would make it: by the exec helper
/// under its own sandbox (or by this process when it is root and runs `pct` itself). A node
/// where it cannot be made ends every group of containers `group_lab_failed`.
async fn check_group_lab(cfg: &Config, r: &mut DoctorReport) {
    let mode = agent_exec_mode(cfg);
    let made = match &mode {
        ExecMode::Helper { socket, .. } => {
            let socket = socket.clone();
            tokio::task::spawn_blocking(move || crate::exec_helper::client::lab_probe(&socket))
                .await
                .unwrap_or_else(|e| Err(StatusAnswer::NoAnswer(e.to_string())))
                .map_err(|e| match e {
                    StatusAnswer::NoAnswer(why) => format!("it did not answer: {why}"),
                    StatusAnswer::Refused(why) => why,
                })
        }
        ExecMode::Direct => tokio::task::spawn_blocking(crate::guest::group_lab::probe)
            .await
            .unwrap_or_else(|e| Err(e.to_string())),
    };
    match made {
        Ok(note) => r.pass(
            GROUP_LAB_CHECK,
            format!("a group of containers gets its lab here ({}): {note}", mode.describe()),
        ),
        Err(why) => r.fail(
            GROUP_LAB_CHECK,
            ErrorCode::GroupLabFailed,
            format!(
                "a group's lab could not be made here ({}): {why}. Every [[restore_test.group]] of containers would end group_lab_failed (exit 6). Where systemd runs, a lab is an instance of felhom-lab@.service, which the felhom-agent package installs (`systemctl cat felhom-lab@.service`); the helper's journal says more (`journalctl -u felhom-agent-exec.service`)",
                mode.describe()
            ),
        ),
    }
}

/// `[restore_test] lab_bridge`: the bridge exists in the node's network configuration, is a
/// Linux bridge with no ports, carries no address of the node, is up, is isolated in the
/// kernel as the preflight reads it ([`crate::lab_kernel::faults`]; its stanza sets each
/// setting, else a warning), and the token holds
/// `SDN.Use` on `/sdn/zones/localnetwork/<bridge>` (qemu-server `check_bridge_access` →
/// pve-guest-common `check_vnet_access` at the restore). Without the key: a pass that says
/// what an isolated VM copy then is.
async fn check_lab_bridge(cfg: &Config, client: &PveClient, r: &mut DoctorReport) {
    let name = "lab_bridge";
    let bridges = &cfg.restore_test.lab_bridges;
    if bridges.is_empty() {
        r.pass(
            name,
            "[restore_test] lab_bridge is not set: an isolated VM copy starts with no NIC, and its report names the failures that cannot be judged without one (units that need its network); VM copies of a restore run are not limited by a bridge (containers: up to 6 at once, beside the exec helper's reads)",
        );
        return;
    }
    let rows = match client.node_bridges(&cfg.node).await {
        Ok(rows) => rows,
        Err(e) => {
            return r.fail(
                name,
                e.code(),
                format!(
                    "cannot read node {}'s bridges (GET /nodes/{}/network): {e}",
                    cfg.node, cfg.node
                ),
            )
        }
    };
    let mut fails: Vec<(ErrorCode, String)> = Vec::new();
    let mut warns: Vec<String> = Vec::new();
    let mut passes: Vec<String> = Vec::new();
    for bridge in bridges {
        match lab_bridge_verdict(cfg, client, bridge, &rows).await {
            LabVerdict::Fail(code, m) => fails.push((code, m)),
            LabVerdict::Warn(m) => warns.push(m),
            LabVerdict::Pass(m) => passes.push(m),
        }
    }
    let at_once = bridges.len();
    let summary = format!(
        "isolated VM copies start with their stored NICs on a lab bridge, one VM copy per bridge at a time (copies on one bridge would reach each other), so a restore run proves {at_once} VM{} at once beside its containers (up to 6, beside the exec helper's reads)",
        if at_once == 1 { "" } else { "s" }
    );
    if let Some((code, _)) = fails.first() {
        let code = *code;
        let all: Vec<String> = fails.into_iter().map(|(_, m)| m).collect();
        return r.fail(name, code, all.join("; "));
    }
    if !warns.is_empty() {
        return r.warn(name, warns.join("; "));
    }
    r.pass(name, format!("{}; {summary}", passes.join("; ")));
}

/// The lab bridge's MTU against the largest of the node's other network devices (`lo` left
/// out), from `/sys/class/net/<dev>/mtu` under `root`: why a copy could fail there, or `None`.
fn lab_mtu_doubt(root: &std::path::Path, bridge: &str) -> Option<String> {
    let net = root.join("sys/class/net");
    let mtu = |name: &str| -> Option<u32> {
        let text = std::fs::read_to_string(net.join(name).join("mtu")).ok()?;
        text.trim().parse().ok()
    };
    let lab = mtu(bridge)?;
    let (name, largest) = std::fs::read_dir(&net)
        .ok()?
        .filter_map(Result::ok)
        .take(4096)
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            (n != "lo" && n != bridge)
                .then(|| mtu(&n).map(|m| (n, m)))
                .flatten()
        })
        .max_by_key(|(_, m)| *m)?;
    (largest > lab).then(|| {
        format!(
            "bridge {bridge} has MTU {lab} but the node's {} has {largest}: a VM copy's NIC gets the lab bridge's MTU (qemu-server print_netdevice_full, host_mtu), so a guest that sets `mtu {largest}` fails its network unit there, and a NIC stored with `mtu={largest}` refuses its start; add `mtu {largest}` to the bridge's stanza in /etc/network/interfaces, then `ifreload -a`",
            crate::error::outside_text(&name)
        )
    })
}

/// What doctor says of one lab bridge.
enum LabVerdict {
    Fail(ErrorCode, String),
    Warn(String),
    Pass(String),
}

/// One lab bridge judged: the token's `SDN.Use` on it, PVE's view of it (`rows`: the node's
/// bridges), the kernel's view, and its stanza.
async fn lab_bridge_verdict(
    cfg: &Config,
    client: &PveClient,
    bridge: &str,
    rows: &[serde_json::Value],
) -> LabVerdict {
    let path = format!(
        "/sdn/zones/{}/{bridge}",
        crate::preflight::restorable::LOCAL_ZONE
    );
    let token = &cfg.pve.token_id;
    match client.permissions(None, Some(&path)).await {
        Ok(perms) if held_on(&perms, &path).contains("SDN.Use") => {}
        Ok(_) => {
            return LabVerdict::Fail(
                ErrorCode::SdnDenied,
                format!(
                    "token {token} lacks SDN.Use on {path}: PVE refuses a VM copy's NICs on the lab bridge {bridge} at the restore (qemu-server check_bridge_access, pve-guest-common check_vnet_access), and lists the bridge to no one without it; grant it: {}",
                    crate::preflight::restorable::grant_commands(&path, "PVESDNUser", token)
                ),
            )
        }
        Err(e) => {
            return LabVerdict::Fail(
                e.code(),
                format!("cannot read the token's privileges on {path} (GET /access/permissions): {e}"),
            )
        }
    }
    let row = rows
        .iter()
        .find(|row| row.get("iface").and_then(serde_json::Value::as_str) == Some(bridge));
    let faults = crate::preflight::restorable::lab_bridge_faults(bridge, row);
    if !faults.is_empty() {
        return LabVerdict::Fail(
            ErrorCode::ConfigInvalid,
            format!(
                "[restore_test] lab bridge {bridge:?} in {} on node {}: {}",
                cfg.path.display(),
                cfg.node,
                faults.join("; ")
            ),
        );
    }
    // The kernel's own view, as the preflight of every isolated VM copy reads it.
    let kernel = crate::lab_kernel::faults_now(bridge, crate::lab_kernel::Ports::None);
    if !kernel.is_empty() {
        return LabVerdict::Fail(
            ErrorCode::LabBridgeOpen,
            format!(
                "[restore_test] lab bridge {bridge:?} in {} on node {}: {}; the preflight of every isolated VM copy refuses it (lab_bridge_open) until then",
                cfg.path.display(),
                cfg.node,
                kernel.join("; ")
            ),
        );
    }
    // A lab bridge of a smaller MTU than the node's networks: qemu-server gives a VM copy's
    // virtio NIC the bridge's MTU (QemuServer.pm print_netdevice_full: `host_mtu`, and a NIC
    // whose stored `mtu` is bigger than the bridge's refuses the start), so a guest that sets
    // the larger MTU fails its network unit there, or its copy does not start.
    if let Some(doubt) = lab_mtu_doubt(&crate::lab_kernel::kernel_root(), bridge) {
        return LabVerdict::Warn(doubt);
    }
    // The kernel is right now; the stanza keeps it right after a reboot or an `ifreload -a`
    // (and after a write of net.ipv4.ip_forward, which sets every device's forwarding).
    let missing = stanza_lines_missing(bridge, row);
    if !missing.is_empty() {
        return LabVerdict::Warn(
            format!(
                "bridge {bridge} is isolated in the kernel now, but no line of its stanza in /etc/network/interfaces sets {}, so a reboot or a write of net.ipv4.ip_forward undoes it (IPv6 on: the kernel gives the bridge a link-local address (fe80::) once a VM copy's tap is on it, and the copy could reach the node's services on `::`); add {} to its stanza, then `ifreload -a`",
                missing.iter().map(|(what, _)| *what).collect::<Vec<_>>().join(", "),
                missing.iter().map(|(_, line)| format!("`{line}`")).collect::<Vec<_>>().join(" and ")
            ),
        );
    }
    LabVerdict::Pass(format!(
        "bridge {bridge} has no port and no address of the node, IPv6 is off on it, the kernel drops what a copy sends there to the node or beyond (strict IPv4 reverse-path filter, no forwarding) and its stanza sets each, and token {token} holds SDN.Use on {path}"
    ))
}

/// The kernel settings of the lab bridge that no line of its stanza (PVE's `options` and
/// `options6`: the lines it does not parse) sets, each with the line that does.
fn stanza_lines_missing(
    bridge: &str,
    row: Option<&serde_json::Value>,
) -> Vec<(&'static str, String)> {
    let lines: Vec<String> = ["options", "options6"]
        .iter()
        .filter_map(|k| {
            row.and_then(|r| r.get(*k))
                .and_then(serde_json::Value::as_array)
        })
        .flat_map(|a| a.iter().take(256).filter_map(|l| l.as_str()))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    let sets = |key: &str, value: &str| {
        lines.iter().any(|l| {
            l.contains(key)
                && (l.contains(&format!("={value}")) || l.contains(&format!("echo {value}")))
        })
    };
    let [v6, rp, fwd] = crate::lab_kernel::post_up_lines(bridge);
    let mut out = Vec::new();
    if !sets("disable_ipv6", "1") {
        out.push(("IPv6 off", v6));
    }
    if !sets(&format!("{bridge}.rp_filter"), "1") && !sets(&format!("{bridge}/rp_filter"), "1") {
        out.push(("the strict reverse-path filter", rp));
    }
    if !sets(&format!("{bridge}.forwarding"), "0") && !sets(&format!("{bridge}/forwarding"), "0") {
        out.push(("forwarding off", fwd));
    }
    out
}

/// Every pool guest of this node has a backup on `[restore_test] backup_storages`: a guest
/// without one is `no_backup` in `restore-report` (exit 5), and no restore test can prove it.
/// Warns naming each (at most 20 named); reads only.
async fn check_guest_backups(cfg: &Config, client: &PveClient, r: &mut DoctorReport) {
    let name = "guest_backups";
    if !cfg.restore_test.sources.is_empty() {
        return r.pass(
            name,
            format!(
                "[restore_test] sources names {} backup(s) to prove: the pool guests' own backups are not read",
                cfg.restore_test.sources.len()
            ),
        );
    }
    let guests = match client.cluster_vms().await {
        Ok(rows) => rows,
        Err(e) => {
            return r.warn(
                name,
                format!("cannot read the pool's guests (GET /cluster/resources): {e}; the guests without a backup were not looked for"),
            )
        }
    };
    let mut owners = std::collections::BTreeSet::new();
    for sid in &cfg.restore_test.backup_storages {
        match client.backups(&cfg.node, sid, None).await {
            Ok(v) => owners.extend(v.iter().filter_map(|b| b.vmid)),
            Err(e) => {
                return r.warn(
                    name,
                    format!("cannot list the backups on storage {sid} of node {}: {e}; the guests without a backup were not looked for", cfg.node),
                )
            }
        }
    }
    let mine: Vec<_> = guests
        .iter()
        .filter(|g| g.pool.as_deref() == Some(cfg.pool.as_str()) && g.node == cfg.node)
        .filter(|g| crate::vmid::ReservedBand::of(g.vmid).is_none())
        .collect();
    let missing: Vec<String> = mine
        .iter()
        .filter(|g| !owners.contains(&u64::from(g.vmid)))
        .map(|g| match g.name.as_deref() {
            Some(n) if !n.is_empty() => format!("{} ({})", g.vmid, crate::error::outside_text(n)),
            _ => g.vmid.to_string(),
        })
        .collect();
    let storages = cfg.restore_test.backup_storages.join(", ");
    if missing.is_empty() {
        return r.pass(
            name,
            format!(
                "each of the {} pool guest(s) on node {} has a backup on {storages}: a restore run can prove every one",
                mine.len(),
                cfg.node
            ),
        );
    }
    let shown: Vec<&String> = missing.iter().take(20).collect();
    r.warn(
        name,
        format!(
            "{} pool guest(s) on node {} have no backup on {storages}, so no restore test can prove them (`felhom-agent restore-report`: no_backup, exit 5): {}{}; back them up (a backup job that includes them), or name the storage their backups are on in [restore_test] backup_storages of {}",
            missing.len(),
            cfg.node,
            shown.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
            if missing.len() > shown.len() { ", …" } else { "" },
            cfg.path.display()
        ),
    );
}

/// What the configured backups need (the preflight's rules, see
/// [`crate::preflight::restorable`]): `selftest_source` restored as a selftest guest, each
/// `[restore_test] sources` entry as an isolated copy; and the cluster's tag policy for the
/// marker.
async fn check_backups(cfg: &Config, client: &PveClient, r: &mut DoctorReport) {
    use crate::preflight::restorable::{backup_checks, tags_check, Held};
    use crate::preflight::CheckVerdict;
    let files = crate::preflight::read_cluster_files(cfg);
    let token = &cfg.pve.token_id;
    let mut sources: Vec<(&'static str, &str, bool)> = Vec::new();
    if let Some(src) = &cfg.provision.selftest_source {
        sources.push(("selftest_source", src.as_str(), true));
    }
    for src in &cfg.restore_test.sources {
        sources.push(("restore_test_sources", src.as_str(), true));
    }
    // Per check name: the volids that passed, and the first failure.
    type Verdict = (Vec<String>, Option<(ErrorCode, String)>);
    let mut verdicts: BTreeMap<&'static str, Verdict> = BTreeMap::new();
    for (name, volid, isolate) in sources {
        let checks = backup_checks(
            client,
            &cfg.node,
            volid,
            isolate,
            cfg.restore_test.lab_bridge(),
            token,
            &files,
        )
        .await;
        let entry = verdicts.entry(name).or_default();
        match checks.iter().find(|c| c.status == CheckVerdict::Fail) {
            Some(c) if entry.1.is_none() => {
                entry.1 = Some((
                    c.code.unwrap_or(ErrorCode::BackupMissing),
                    c.message.clone(),
                ));
            }
            Some(_) => {}
            None => entry.0.push(volid.to_string()),
        }
    }
    for (name, (fine, failed)) in verdicts {
        match failed {
            Some((code, message)) => r.fail(name, code, message),
            None => r.pass(
                name,
                format!(
                    "{} can be restored by token {token}: privileges, NICs and contents checked",
                    fine.join(", ")
                ),
            ),
        }
    }
    let held = Held::read(client, &BTreeSet::from(["/".to_string()])).await;
    let tags = tags_check(
        &files,
        &held,
        crate::provision::machine::Marker::FLEET_TAG,
        token,
    );
    match tags.code {
        Some(code) => r.fail("tag_policy", code, tags.message),
        None => r.pass("tag_policy", tags.message),
    }
}

/// `pveum role add` for [`ROLE_NAME`]: the PVE 9 privileges, and the PVE 8 variant.
pub fn role_add_command() -> String {
    format!(
        "`pveum role add {ROLE_NAME} -privs \"{}\"` (PVE 8: `{}` instead of `VM.GuestAgent.Unrestricted`)",
        ROLE_PRIVS_PVE9.join(","),
        "VM.Monitor"
    )
}

/// Warn when the token holds on its pool more than [`ROLE_NAME`] (either release's list), and
/// name `VM.Console` first: with it the token can open a root shell on the node through a
/// container's console (`termproxy` with `cmode=shell`, pve-container `src/PVE/API2/LXC.pm`).
fn check_excess(
    cfg: &Config,
    on_pool: &std::collections::BTreeSet<String>,
    pool_path: &str,
    r: &mut DoctorReport,
) {
    let extra: Vec<&str> = on_pool
        .iter()
        .map(String::as_str)
        .filter(|p| !ROLE_PRIVS_PVE9.contains(p) && !ROLE_PRIVS_PVE8.contains(p))
        .collect();
    let token = &cfg.pve.token_id;
    if extra.is_empty() {
        r.pass(
            "least_privilege",
            format!("token {token} holds no more on {pool_path} than the {ROLE_NAME} role"),
        );
        return;
    }
    let console = if extra.contains(&"VM.Console") {
        "VM.Console lets it open a root shell on this node through a container's console (termproxy with cmode=shell, which does not even check that the container runs); "
    } else {
        ""
    };
    r.warn(
        "least_privilege",
        format!(
            "token {token} holds more on {pool_path} than the agent uses: {}. {console}Grant the token (and its user) only {ROLE_NAME} there: {}, `pveum acl modify {pool_path} --tokens '{token}' --roles {ROLE_NAME}`, and `pveum acl delete {pool_path} --tokens '{token}' --roles <the broader role>`",
            extra.join(", "),
            role_add_command()
        ),
    );
}

/// A guest whose backups the agent restores without being in the pool needs `VM.Backup` and
/// nothing else on `/vms/<vmid>` (pve-storage `check_volume_access`, pve-manager
/// `extractconfig`). `Some(warning)` naming each `/vms/<vmid>` where the token holds more than
/// that beyond what its pool role gives (an older README granted `PVEVMUser` there: the
/// console, power and the guest agent's file access on a production guest), with the fix.
pub fn guest_grants_beyond_backup(
    token: &str,
    perms: &Permissions,
    on_pool: &BTreeSet<String>,
) -> Option<String> {
    use crate::preflight::restorable::{backup_owner_role_add, BACKUP_OWNER_ROLE};
    let mut found = Vec::new();
    for path in perms.keys() {
        let Some(vmid) = path.strip_prefix("/vms/") else {
            continue;
        };
        if vmid.is_empty() || !vmid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let extra: Vec<String> = held_on(perms, path)
            .into_iter()
            .filter(|p| p != "VM.Backup" && !on_pool.contains(p))
            .collect();
        if !extra.is_empty() {
            found.push(format!("{path}: {}", extra.join(", ")));
        }
    }
    if found.is_empty() {
        return None;
    }
    let user = token.split('!').next().unwrap_or(token);
    Some(format!(
        "token {token} holds more on guests than the agent uses there ({}); a backup of a guest outside the pool needs VM.Backup there and nothing else (VM.Console is a root shell through the console, VM.PowerMgmt stops a production guest). Replace the grant: `pveum acl delete <path> --tokens '{token}' --roles <the broader role>` and the same with `--users '{user}'`, then `pveum acl modify <path> --tokens '{token}' --roles {BACKUP_OWNER_ROLE}` and the same with `--users '{user}'` (the role: {})",
        found.join("; "),
        backup_owner_role_add()
    ))
}

fn check_privileges(cfg: &Config, perms: &Permissions, r: &mut DoctorReport) {
    let pool_path = format!("/pool/{}", cfg.pool);
    let on_pool = held_on(perms, &pool_path);
    // Each need: the privileges of which one is enough, and the path.
    let mut missing: Vec<(Vec<&str>, String)> = Vec::new();
    for p in POOL_PRIVS {
        if !on_pool.contains(*p) {
            missing.push((vec![*p], pool_path.clone()));
        }
    }
    if !AGENT_PRIVS_ANY.iter().any(|p| on_pool.contains(*p)) {
        missing.push((AGENT_PRIVS_ANY.to_vec(), pool_path.clone()));
    }
    let storage_path = format!("/storage/{}", cfg.provision.storage);
    let on_storage = held_on(perms, &storage_path);
    for p in STORAGE_PRIVS {
        if !on_storage.contains(*p) {
            missing.push((vec![*p], storage_path.clone()));
        }
    }
    if let Some(src) = &cfg.provision.selftest_source {
        if let Some((sid, _)) = src.split_once(':') {
            let path = format!("/storage/{sid}");
            let held = held_on(perms, &path);
            if !BACKUP_STORAGE_PRIVS_ANY.iter().any(|p| held.contains(*p)) {
                missing.push((BACKUP_STORAGE_PRIVS_ANY.to_vec(), path));
            }
        }
    }
    check_excess(cfg, &on_pool, &pool_path, r);
    match guest_grants_beyond_backup(&cfg.pve.token_id, perms, &on_pool) {
        None => r.pass(
            "guest_grants",
            "no guest outside the pool grants the token more than VM.Backup",
        ),
        Some(m) => r.warn("guest_grants", m),
    }
    if missing.is_empty() {
        r.pass("privileges", format!("token {} may restore into {pool_path}, start, configure, destroy and exec in its guests, and allocate on {storage_path}", cfg.pve.token_id));
        return;
    }
    let token = &cfg.pve.token_id;
    let user = token.split('!').next().unwrap_or(token);
    let describe = |needs: &[&(Vec<&str>, String)]| {
        needs
            .iter()
            .map(|(privs, path)| format!("{} on {path}", privs.join(" or ")))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let grant = |who: &str, flag: &str| {
        format!("`pveum acl modify {pool_path} --{flag} '{who}' --roles {ROLE_NAME}` and `pveum acl modify {storage_path} --{flag} '{who}' --roles PVEDatastoreUser` (the role, once per cluster: {})", role_add_command())
    };
    let all: Vec<&(Vec<&str>, String)> = missing.iter().collect();
    // The token holds what PVE computes; for a privilege-separated token (PVE's default) that is
    // what both it and its user are granted. user.cfg (`user_cfg_path`, handed over by the
    // exec helper in its mode) tells which of the two lacks the grant.
    let user_cfg =
        crate::exec_helper::client::node_file(cfg, crate::exec_helper::proto::ClusterFile::UserCfg);
    let message = match user_cfg.map(|t| t.map(|t| UserCfg::parse(&t))) {
        Ok(Some(acl)) if acl.privsep(token) => {
            let lacks = |who: &str| -> Vec<&(Vec<&str>, String)> {
                missing
                    .iter()
                    .filter(|(privs, path)| !privs.iter().any(|p| acl.grants(who, path, p)))
                    .collect()
            };
            let (token_lacks, user_lacks) = (lacks(token), lacks(user));
            let mut parts = Vec::new();
            if !token_lacks.is_empty() {
                parts.push(format!(
                    "token {token} lacks {}; grant them, e.g. {}",
                    describe(&token_lacks),
                    grant(token, "tokens")
                ));
            }
            if !user_lacks.is_empty() {
                parts.push(format!(
                    "user {user} lacks {}: token {token} is privilege-separated and holds only what its user holds too; grant them to the user, e.g. {}",
                    describe(&user_lacks),
                    grant(user, "users")
                ));
            }
            if parts.is_empty() {
                format!("token {token} lacks {} (user.cfg grants them to both the token and user {user}: check for NoAccess, groups or a pool the storage is not in)", describe(&all))
            } else {
                parts.join("; ")
            }
        }
        _ => format!(
            "token {token} lacks {}; grant them, e.g. {} (a privilege-separated token holds only what its user {user} holds too: grant the same to the user)",
            describe(&all),
            grant(token, "tokens")
        ),
    };
    r.fail("privileges", ErrorCode::PveRefused, message);
}

/// The grants of `/etc/pve/user.cfg` (format: shared pve-api-facts §3.4,
/// pve-access-control `AccessControl.pm` `parse_user_config`): token privilege separation,
/// groups, custom roles and ACLs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct UserCfg {
    privsep: BTreeMap<String, bool>,
    groups: BTreeMap<String, BTreeSet<String>>,
    roles: BTreeMap<String, BTreeSet<String>>,
    /// (propagate, path, users/tokens/@groups, roles)
    acls: Vec<(bool, String, Vec<String>, Vec<String>)>,
}

impl UserCfg {
    /// Parse the file's text; lines it does not know are skipped.
    pub fn parse(text: &str) -> UserCfg {
        let mut out = UserCfg::default();
        let list = |s: &str| -> Vec<String> {
            s.split([',', ';', ' '])
                .filter(|x| !x.is_empty())
                .map(str::to_string)
                .collect()
        };
        for line in text.lines() {
            let f: Vec<&str> = line.split(':').collect();
            match f.as_slice() {
                ["token", id, _expire, privsep, ..] => {
                    out.privsep.insert(id.to_string(), *privsep != "0");
                }
                ["group", id, users, ..] => {
                    out.groups
                        .insert(id.to_string(), list(users).into_iter().collect());
                }
                ["role", id, privs, ..] => {
                    out.roles
                        .insert(id.to_string(), list(privs).into_iter().collect());
                }
                ["acl", propagate, path, ugids, roles, ..] => out.acls.push((
                    *propagate != "0",
                    path.to_string(),
                    list(ugids),
                    list(roles),
                )),
                _ => {}
            }
        }
        out
    }

    /// Whether `token` is privilege-separated (PVE's default when the file does not say).
    pub fn privsep(&self, token: &str) -> bool {
        self.privsep.get(token).copied().unwrap_or(true)
    }

    /// Whether an ACL grants `privilege` on `path` to exactly `who` (a user, or a token id),
    /// directly or through a group, on the path or, propagated, on an ancestor.
    pub fn grants(&self, who: &str, path: &str, privilege: &str) -> bool {
        self.acls.iter().any(|(propagate, on, ugids, roles)| {
            let applies = on == path
                || (*propagate
                    && (on == "/"
                        || (path.starts_with(on.as_str())
                            && path.as_bytes().get(on.len()) == Some(&b'/'))));
            let to_who = ugids.iter().any(|u| {
                u == who
                    || u.strip_prefix('@')
                        .is_some_and(|g| self.groups.get(g).is_some_and(|m| m.contains(who)))
            });
            applies && to_who && roles.iter().any(|r| self.role_has(r, privilege))
        })
    }

    fn role_has(&self, role: &str, p: &str) -> bool {
        if let Some(privs) = self.roles.get(role) {
            return privs.contains(p);
        }
        // The built-in roles (shared pve-api-facts §2.3).
        match role {
            "Administrator" => true,
            "PVEVMAdmin" => p.starts_with("VM."),
            "PVEVMUser" => matches!(
                p,
                "VM.Audit"
                    | "VM.Backup"
                    | "VM.Console"
                    | "VM.PowerMgmt"
                    | "VM.Config.CDROM"
                    | "VM.Config.Cloudinit"
                    | "VM.GuestAgent.Audit"
                    | "VM.GuestAgent.FileRead"
                    | "VM.GuestAgent.FileWrite"
                    | "VM.GuestAgent.FileSystemMgmt"
            ),
            "PVEDatastoreAdmin" => p.starts_with("Datastore."),
            "PVEDatastoreUser" => matches!(p, "Datastore.AllocateSpace" | "Datastore.Audit"),
            "PVEPoolAdmin" => matches!(p, "Pool.Allocate" | "Pool.Audit"),
            "PVEPoolUser" => p == "Pool.Audit",
            "PVEAuditor" => p.ends_with(".Audit"),
            _ => false,
        }
    }
}

/// The units that run as the agent's user: neither may bind an abstract socket in the node's
/// network namespace (DESIGN rule 12).
pub const AGENT_USER_UNITS: &[&str] = &["felhom-agent.service", "felhom-restore-test.service"];
/// The syscalls their filter must refuse for that (`SystemCallFilter=~bind listen …`).
pub const MUST_REFUSE: &[&str] = &["bind", "listen"];

/// Whether a unit's effective `SystemCallFilter` as `systemctl show -p SystemCallFilter
/// --value` prints it refuses every one of `calls`: a deny list starts with `~` and names what
/// is refused; an allow list names what is allowed; empty is no filter. `Err`: what is let
/// through.
pub fn filter_refuses(value: &str, calls: &[&str]) -> Result<(), String> {
    let value = value.trim();
    if value.is_empty() {
        return Err("no system call filter at all".to_string());
    }
    let (deny, names) = match value.strip_prefix('~') {
        Some(rest) => (true, rest),
        None => (false, value),
    };
    let names: BTreeSet<&str> = names.split_whitespace().collect();
    let through: Vec<&str> = calls
        .iter()
        .copied()
        .filter(|c| names.contains(c) != deny)
        .collect();
    if through.is_empty() {
        Ok(())
    } else {
        Err(format!("{} allowed", through.join(" and ")))
    }
}

/// Whether a unit's effective `SystemCallArchitectures` (as `systemctl show` prints it) admits
/// the native architecture only: empty (a drop-in's `SystemCallArchitectures=` resets it) lets
/// 32-bit system calls through, where the filter's names may not match (i386 `socketcall`
/// multiplexes bind and listen). `Err`: what is let through.
pub fn native_only(value: &str) -> Result<(), String> {
    let native = match std::env::consts::ARCH {
        "x86_64" => "x86-64",
        "aarch64" => "arm64",
        other => other,
    };
    let archs: Vec<&str> = value.split_whitespace().collect();
    if archs.is_empty() {
        return Err(
            "SystemCallArchitectures is empty: system calls of every architecture are allowed"
                .to_string(),
        );
    }
    let other: Vec<&str> = archs
        .into_iter()
        .filter(|a| *a != "native" && *a != native)
        .collect();
    if other.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "SystemCallArchitectures also allows {}",
            other.join(" ")
        ))
    }
}

/// Whether the units of the agent's user refuse `bind(2)` and `listen(2)`, as systemd has
/// loaded them (a drop-in may have changed the packaged filter): a warning when not, or when
/// systemd cannot be asked. The exec helper's check of the command socket's listener narrows
/// the window either way; this closes it for the agent's user.
fn check_abstract_sockets(r: &mut DoctorReport) {
    let mut problems = Vec::new();
    for unit in AGENT_USER_UNITS {
        let out = std::process::Command::new("systemctl")
            .args([
                "show",
                "-p",
                "SystemCallFilter",
                "-p",
                "SystemCallArchitectures",
                unit,
            ])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .output();
        match out {
            Ok(o) if o.status.success() => {
                let text = String::from_utf8_lossy(&o.stdout);
                let value = |key: &str| {
                    text.lines()
                        .find_map(|l| l.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                        .map(str::to_string)
                };
                match value("SystemCallFilter") {
                    Some(filter) => {
                        if let Err(e) = filter_refuses(&filter, MUST_REFUSE) {
                            problems.push(format!("{unit}: {e}"));
                        }
                    }
                    None => problems.push(format!("{unit}: systemctl showed no SystemCallFilter")),
                }
                if let Err(e) = native_only(&value("SystemCallArchitectures").unwrap_or_default()) {
                    problems.push(format!("{unit}: {e}"));
                }
            }
            Ok(o) => problems.push(format!(
                "{unit}: `systemctl show` failed ({}): {}",
                o.status,
                crate::error::outside_text(String::from_utf8_lossy(&o.stderr).trim())
            )),
            Err(e) => problems.push(format!("{unit}: cannot run systemctl: {e}")),
        }
    }
    if problems.is_empty() {
        r.pass(
            "abstract_sockets",
            format!(
                "{} refuse bind(2) and listen(2), and system calls of other architectures (SystemCallArchitectures=native): the agent's user cannot bind an abstract socket such as a container's LXC command socket",
                AGENT_USER_UNITS.join(" and ")
            ),
        );
    } else {
        r.warn(
            "abstract_sockets",
            format!(
                "cannot confirm that the agent's user is refused abstract sockets ({}). The packaged units refuse bind(2) and listen(2) (`SystemCallFilter=~bind listen io_uring_setup io_uring_enter io_uring_register`) and every call of another architecture (`SystemCallArchitectures=native`: a 32-bit `socketcall` reaches bind otherwise); restore them if a drop-in removed or reset them (`systemctl cat felhom-agent.service felhom-restore-test.service`), then `systemctl daemon-reload` and restart the units. Until then the agent's user could bind a stopped container's LXC command socket, which the exec helper refuses to trust (exec_monitor_untrusted)",
                problems.join("; ")
            ),
        );
    }
}

/// The package's system user (`packaging/felhom-agent.sysusers`): the units run as it.
pub const PACKAGE_USER: &str = "felhom-agent";
/// The home the package gives that user: a folder that does not exist, whose parent only root
/// may write, so nothing sshd, PAM or a user manager would read from a home can be planted.
pub const SAFE_HOME: &str = "/nonexistent";
/// The package's sshd drop-in (Debian's `sshd_config` includes `/etc/ssh/sshd_config.d/*.conf`).
pub const SSHD_DROP_IN: &str = "/etc/ssh/sshd_config.d/felhom-agent.conf";
/// Where logind keeps the users whose user manager runs from boot (`loginctl enable-linger`).
pub const LINGER_DIR: &str = "/var/lib/systemd/linger";
/// The shadow file (account expiry).
const SHADOW: &str = "/etc/shadow";
/// How deep into an existing home the check looks for something the user owns or may write.
const HOME_WALK_DEPTH: usize = 3;
/// How many entries of an existing home the check looks at, at most.
const HOME_WALK_MAX: usize = 10_000;

/// Whether `uid` (with groups `gids`) may change the folder or file `meta`: its owner (who
/// may chmod it), or write access through the group or others. ACLs are not read.
fn user_may_write(meta: &std::fs::Metadata, uid: u32, gids: &[u32]) -> bool {
    use std::os::unix::fs::MetadataExt;
    let mode = meta.mode();
    meta.uid() == uid || (gids.contains(&meta.gid()) && mode & 0o020 != 0) || mode & 0o002 != 0
}

/// Why `home` lets the user `uid` (groups `gids`) plant files there (`~/.ssh/authorized_keys`,
/// `~/.config/systemd/user/`, `~/.pam_environment`), or `None`. An existing home: neither it
/// nor a folder above it may be the user's or writable by it, and nothing in it (three levels
/// deep) either; a missing home: the nearest existing folder above it and those above it may
/// not be, or the user could create the home.
pub fn home_exposure(home: &Path, uid: u32, gids: &[u32]) -> Option<String> {
    if !home.is_absolute() {
        return Some(format!(
            "its home {} is not an absolute path",
            home.display()
        ));
    }
    // Whether the entry below `dir` on the way to the home exists: a sticky folder (as /tmp)
    // protects an existing entry of root's from being renamed, not the creation of a missing one.
    let mut below_exists = false;
    for dir in home.ancestors() {
        match std::fs::symlink_metadata(dir) {
            Ok(m) => {
                if m.file_type().is_symlink() {
                    return Some(format!(
                        "{} on the way to its home {} is a symbolic link",
                        dir.display(),
                        home.display()
                    ));
                }
                if user_may_write(&m, uid, gids) && !(below_exists && sticky_and_not_owned(&m, uid))
                {
                    return Some(if dir == home {
                        format!("it may write its home {}", home.display())
                    } else if below_exists {
                        format!(
                            "it may write {}, above its home {} (and put a folder of its own there)",
                            dir.display(),
                            home.display()
                        )
                    } else {
                        format!(
                            "its home {} does not exist and it may create it in {}",
                            home.display(),
                            dir.display()
                        )
                    });
                }
                below_exists = true;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => below_exists = false,
            Err(e) => {
                return Some(format!(
                    "{} on the way to its home cannot be inspected: {e}",
                    dir.display()
                ))
            }
        }
    }
    if std::fs::symlink_metadata(home).is_ok_and(|m| m.is_dir()) {
        let mut todo = vec![(home.to_path_buf(), 0usize)];
        let mut seen = 0usize;
        while let Some((dir, depth)) = todo.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                seen += 1;
                if seen > HOME_WALK_MAX {
                    return Some(format!(
                        "its home {} holds more than {HOME_WALK_MAX} entries; a home of the agent's user holds nothing",
                        home.display()
                    ));
                }
                let path = entry.path();
                let Ok(m) = std::fs::symlink_metadata(&path) else {
                    continue;
                };
                if !m.file_type().is_symlink() && user_may_write(&m, uid, gids) {
                    return Some(format!(
                        "it may write {} in its home {}",
                        path.display(),
                        home.display()
                    ));
                }
                if m.is_dir() && depth + 1 < HOME_WALK_DEPTH {
                    todo.push((path, depth + 1));
                }
            }
        }
    }
    None
}

/// A sticky folder (such as `/tmp`) that `uid` does not own: it may create entries there but
/// not rename or remove root's, so the folder below it stays root's.
fn sticky_and_not_owned(meta: &std::fs::Metadata, uid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    meta.mode() & 0o1000 != 0 && meta.uid() != uid
}

/// OpenSSH's `match_pattern` (`match.c`): `*` any run, `?` one character, the whole string.
pub fn sshd_pattern_match(s: &str, pattern: &str) -> bool {
    let (s, p): (Vec<char>, Vec<char>) = (s.chars().collect(), pattern.chars().collect());
    // Positions in the pattern reachable after each character of `s`.
    let mut states = vec![false; p.len() + 1];
    states[0] = true;
    let close = |states: &mut Vec<bool>| {
        for i in 0..p.len() {
            if states[i] && p[i] == '*' {
                states[i + 1] = true;
            }
        }
    };
    close(&mut states);
    for c in s {
        let mut next = vec![false; p.len() + 1];
        for i in 0..p.len() {
            if !states[i] {
                continue;
            }
            match p[i] {
                '*' => next[i] = true,
                '?' => next[i + 1] = true,
                x if x == c => next[i + 1] = true,
                _ => {}
            }
        }
        close(&mut next);
        states = next;
    }
    states[p.len()]
}

/// Whether sshd, as `sshd -T` printed its effective settings (`dump`: one `keyword value` a
/// line, arrays one element a line), refuses `user` (in `groups`) before any key is looked at
/// (OpenSSH `auth.c` `allowed_user`: `DenyUsers`, then `AllowUsers`, `DenyGroups`,
/// `AllowGroups`). `Ok`: why it refuses; `Err`: it would let the user try its keys. A
/// `DenyUsers` entry with a host part counts only when the host part is `*`; an `AllowUsers`
/// entry with one counts as allowing.
pub fn sshd_refuses(dump: &str, user: &str, groups: &[String]) -> Result<String, String> {
    let mut values: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for line in dump.lines() {
        let mut words = line.split_whitespace();
        if let Some(key) = words.next() {
            values.entry(key).or_default().extend(words);
        }
    }
    let get = |k: &str| values.get(k).cloned().unwrap_or_default();
    let user_part = |entry: &str| -> (String, Option<String>) {
        match entry.rsplit_once('@') {
            Some((u, h)) => (u.to_string(), Some(h.to_string())),
            None => (entry.to_string(), None),
        }
    };
    for entry in get("denyusers") {
        let (u, host) = user_part(entry);
        if sshd_pattern_match(user, &u) && host.as_deref().is_none_or(|h| h == "*") {
            return Ok(format!("DenyUsers {entry}"));
        }
    }
    let allow = get("allowusers");
    if !allow.is_empty()
        && !allow
            .iter()
            .any(|entry| sshd_pattern_match(user, &user_part(entry).0))
    {
        return Ok(format!("AllowUsers {} does not name it", allow.join(" ")));
    }
    for pattern in get("denygroups") {
        if let Some(g) = groups.iter().find(|g| sshd_pattern_match(g, pattern)) {
            return Ok(format!("DenyGroups {pattern} (its group {g})"));
        }
    }
    let allow = get("allowgroups");
    if !allow.is_empty()
        && !groups
            .iter()
            .any(|g| allow.iter().any(|p| sshd_pattern_match(g, p)))
    {
        return Ok(format!(
            "AllowGroups {} names none of its groups",
            allow.join(" ")
        ));
    }
    Err("no DenyUsers, AllowUsers, DenyGroups or AllowGroups refuses it".to_string())
}

/// Whether `user`'s account has expired in the shadow file `text` on day `today` (days since
/// 1970): field 8, as PAM's `pam_unix` (`check_shadow_expiry`: expired from that day on) and
/// sshd without PAM (`auth_shadow_acctexpired`: after that day) read it; `None` when the user
/// has no line.
pub fn shadow_expired(text: &str, user: &str, today: i64) -> Option<bool> {
    let line = text.lines().find(|l| l.split(':').next() == Some(user))?;
    let expire = line.split(':').nth(7).unwrap_or("").trim();
    Some(
        expire
            .parse::<i64>()
            .is_ok_and(|day| day >= 0 && today > day),
    )
}

/// The agent's user as the node knows it: name, uid, home and groups (ids and names).
struct AgentUser {
    uid: u32,
    home: std::path::PathBuf,
    gids: Vec<u32>,
    groups: Vec<String>,
}

impl AgentUser {
    fn lookup(name: &str) -> Result<Option<AgentUser>, String> {
        let Some(u) = nix::unistd::User::from_name(name).map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        let cname = std::ffi::CString::new(name).map_err(|e| e.to_string())?;
        let gids: Vec<u32> = nix::unistd::getgrouplist(&cname, u.gid)
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(nix::unistd::Gid::as_raw)
            .collect();
        let groups = gids
            .iter()
            .filter_map(|g| {
                nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(*g))
                    .ok()
                    .flatten()
                    .map(|g| g.name)
            })
            .collect();
        Ok(Some(AgentUser {
            uid: u.uid.as_raw(),
            home: u.dir,
            gids,
            groups,
        }))
    }
}

/// The sshd binary: `sshd` on `PATH`, else Debian's `/usr/sbin/sshd`.
fn find_sshd() -> Option<std::path::PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("sshd"))
            .find(|f| f.is_file())
    });
    on_path.or_else(|| {
        let debian = Path::new("/usr/sbin/sshd");
        debian.is_file().then(|| debian.to_path_buf())
    })
}

/// Whether the agent's system user can run anything outside the agent's units: a home it may
/// write (`agent_user_home`: sshd's `authorized_keys`, PAM's `.pam_environment`, a user unit
/// would be read from there), a login sshd would accept (`agent_user_login`), a user manager
/// systemd would start for it (`agent_user_manager`). Each failure names the fix
/// (`agent_user_unconfined`); the package's postinst applies all three.
fn check_agent_user_confinement(cfg: &Config, r: &mut DoctorReport) {
    let name = cfg.agent_user.as_deref().unwrap_or(PACKAGE_USER);
    let user = match AgentUser::lookup(name) {
        Ok(Some(u)) => u,
        Ok(None) => {
            for check in ["agent_user_home", "agent_user_login", "agent_user_manager"] {
                r.pass(
                    check,
                    format!("no user {name} on this node: nothing runs as the agent's user"),
                );
            }
            return;
        }
        Err(e) => {
            for check in ["agent_user_home", "agent_user_login", "agent_user_manager"] {
                r.warn(
                    check,
                    format!("cannot read the user database for {name}: {e}; not checked"),
                );
            }
            return;
        }
    };
    let code = ErrorCode::AgentUserUnconfined;
    let stop_start = "systemctl stop felhom-agent.service felhom-restore-test.service";
    match home_exposure(&user.home, user.uid, &user.gids) {
        None => r.pass(
            "agent_user_home",
            format!(
                "{name}'s home {} is nothing it can write or create: no authorized_keys, user unit or .pam_environment of its own can be read from there",
                user.home.display()
            ),
        ),
        Some(why) => r.fail(
            "agent_user_home",
            code,
            format!(
                "{name} can plant files where sshd, PAM and systemd look for its own (~/.ssh/authorized_keys, ~/.pam_environment, ~/.config/systemd/user): {why}. Move its home: `{stop_start}; usermod -d {SAFE_HOME} {name}; systemctl start felhom-agent.service` (the package's postinst does this), then remove what it planted there"
            ),
        ),
    }

    // Login: sshd's own settings, and the account's expiry (PAM's account check and sshd's).
    let today = time::OffsetDateTime::now_utc()
        .unix_timestamp()
        .div_euclid(86_400);
    let expired = match std::fs::read_to_string(SHADOW) {
        Ok(text) => shadow_expired(&text, name, today),
        Err(_) => None,
    };
    let sshd = find_sshd().map(|bin| {
        let spec = format!("user={name},host=localhost,addr=127.0.0.1");
        let out = std::process::Command::new(&bin)
            .args(["-T", "-C", &spec])
            .stdin(std::process::Stdio::null())
            .output();
        match out {
            Ok(o) if o.status.success() => Ok(sshd_refuses(
                &String::from_utf8_lossy(&o.stdout),
                name,
                &user.groups,
            )),
            Ok(o) => Err(format!(
                "`{} -T` failed ({}): {}",
                bin.display(),
                o.status,
                crate::error::outside_text(String::from_utf8_lossy(&o.stderr).trim())
            )),
            Err(e) => Err(format!("cannot run {}: {e}", bin.display())),
        }
    });
    let expire_fix = format!("`usermod -e 1 {name}` (an expired account: PAM's account check refuses it whatever its keys)");
    let deny_fix = format!(
        "`echo 'DenyUsers {name}' > {SSHD_DROP_IN}; sshd -t && systemctl reload ssh` (the package ships that file; Debian's sshd_config includes /etc/ssh/sshd_config.d/*.conf)"
    );
    let expired_text = match expired {
        Some(true) => "its account has expired".to_string(),
        Some(false) => "its account has not expired".to_string(),
        None => format!("its expiry could not be read from {SHADOW}"),
    };
    match (&sshd, expired) {
        (None, Some(true)) => r.pass(
            "agent_user_login",
            format!("no sshd on this node, and {expired_text}"),
        ),
        (Some(Ok(Ok(why))), Some(true)) => r.pass(
            "agent_user_login",
            format!("sshd refuses {name} before any key ({why}), and {expired_text}"),
        ),
        (Some(Ok(Ok(why))), _) => r.warn(
            "agent_user_login",
            format!("sshd refuses {name} before any key ({why}), but {expired_text}: also {expire_fix}"),
        ),
        (None, _) => r.warn(
            "agent_user_login",
            format!("no sshd on this node, but {expired_text}: {expire_fix}"),
        ),
        (Some(Ok(Err(why))), Some(true)) => r.warn(
            "agent_user_login",
            format!("sshd would let {name} try its keys ({why}); {expired_text}, which PAM's account check refuses: also {deny_fix}"),
        ),
        (Some(Ok(Err(why))), _) => r.fail(
            "agent_user_login",
            code,
            format!("sshd would accept {name}'s keys ({why}) and {expired_text}: whoever runs as the agent's user could log in and run anything outside its units. Fix: {deny_fix}; and {expire_fix}"),
        ),
        (Some(Err(e)), Some(true)) => r.warn(
            "agent_user_login",
            format!("{e}: cannot tell whether sshd refuses {name}; {expired_text}, which PAM's account check refuses. Make sure {SSHD_DROP_IN} is read"),
        ),
        (Some(Err(e)), _) => r.fail(
            "agent_user_login",
            code,
            format!("{e}: cannot tell whether sshd refuses {name}, and {expired_text}. Fix: {expire_fix}; and {deny_fix}"),
        ),
    }

    // The user manager: logind starts user@<uid>.service at a login's session (pam_systemd)
    // or from boot for a lingering user; masked, it never starts.
    let unit = format!("user@{}.service", user.uid);
    let state = std::process::Command::new("systemctl")
        .args(["is-enabled", &unit])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let linger = Path::new(LINGER_DIR).join(name);
    let lingers = linger.exists();
    let mask_fix = format!("`systemctl mask {unit}` (the package's postinst does this)");
    match state {
        Ok(s) if s == "masked" || s == "masked-runtime" => {
            if lingers {
                r.warn(
                    "agent_user_manager",
                    format!("{unit} is masked, so no user manager starts for {name}; but {} asks logind to start one at boot: `loginctl disable-linger {name}`", linger.display()),
                );
            } else {
                r.pass(
                    "agent_user_manager",
                    format!("{unit} is masked: systemd starts no user manager for {name}, and it does not linger"),
                );
            }
        }
        Ok(s) => r.fail(
            "agent_user_manager",
            code,
            format!(
                "{unit} is {}: a session of {name} (or lingering{}) would start its own systemd --user, which runs the units it finds in its home outside the agent's sandbox. Fix: {mask_fix}{}",
                if s.is_empty() { "not masked".to_string() } else { format!("{s}, not masked") },
                if lingers { ", which it does" } else { "" },
                if lingers { format!("; `loginctl disable-linger {name}`") } else { String::new() }
            ),
        ),
        Err(e) => r.warn(
            "agent_user_manager",
            format!("cannot run `systemctl is-enabled {unit}`: {e}; make sure it is masked: {mask_fix}"),
        ),
    }
}

/// `[metrics] dir`: a warning only (the agent works without node_exporter); opened exactly as
/// the writer opens it, nothing written.
fn check_metrics(cfg: &Config, r: &mut DoctorReport) {
    use std::os::unix::fs::MetadataExt;
    let dir = &cfg.metrics.dir;
    match crate::metrics::textfile::open_dir(dir).and_then(|f| {
        f.metadata()
            .map_err(|source| crate::metrics::textfile::TextfileError::OpenDir {
                dir: dir.clone(),
                source,
            })
    }) {
        Ok(_) if nix::unistd::access(dir, nix::unistd::AccessFlags::W_OK).is_err() => r.warn(
            "metrics",
            format!(
                "{} is not writable by this process (uid {}), which the commands run as; no \
                 metrics are written until it is (the package makes it felhom-agent's, mode 0755)",
                dir.display(),
                nix::unistd::geteuid()
            ),
        ),
        Ok(meta) => r.pass(
            "metrics",
            format!(
                "{} is a folder (owner uid {}, mode {:o}); the metrics files are written there \
                 through random exclusive temporary names, never following a symlink; \
                 root copies them, checked, into node_exporter's textfile folder \
                 (/var/lib/prometheus/node-exporter; felhom-agent-metrics.path)",
                dir.display(),
                meta.uid(),
                meta.mode() & 0o7777
            ),
        ),
        Err(e) => r.warn(
            "metrics",
            format!("{e}; no metrics are written until this is fixed"),
        ),
    }
}

/// How the commands reach into containers: with `[agent] user` they never run as root, judged
/// so even when the switch failed here (the agent_user line says why); any uid but 0 stands
/// for the user.
fn agent_exec_mode(cfg: &Config) -> ExecMode {
    let euid = match &cfg.agent_user {
        Some(_) if nix::unistd::geteuid().is_root() => u32::MAX,
        _ => nix::unistd::geteuid().as_raw(),
    };
    ExecMode::choose(cfg, euid)
}

/// `.vmlist` read the way the commands read it: through the exec helper in its mode (the
/// agent's user then needs no pmxcfs group), else by this process. The line says which.
fn check_vmlist(cfg: &Config, r: &mut DoctorReport) {
    use crate::exec_helper::client::{HelperVmlist, VmlistRoute};
    use crate::inventory::{VmlistReader, VmlistUnread, VmlistVia};
    let route = match agent_exec_mode(cfg) {
        ExecMode::Direct => VmlistRoute::Direct,
        ExecMode::Helper { socket, .. } => VmlistRoute::Helper(HelperVmlist::new(socket)),
    };
    let path = cfg.vmlist_path.display();
    match route.read_vmlist(&cfg.vmlist_path) {
        Ok((bytes, via)) => match crate::inventory::parse_vmlist(&bytes) {
            Ok(entries) => match &via {
                VmlistVia::Helper { socket } => r.pass(
                    "vmlist",
                    format!("{path}: {} guests cluster-wide, handed over by the root exec helper at {} (the agent's user needs no pmxcfs group)", entries.len(), socket.display()),
                ),
                VmlistVia::Direct => r.pass(
                    "vmlist",
                    format!("{path}: {} guests cluster-wide, read directly by this process (as root, or through group www-data)", entries.len()),
                ),
                VmlistVia::DirectAfterHelper { socket, why } => r.warn(
                    "vmlist",
                    format!("{path}: {} guests cluster-wide, read directly by this process (group www-data), because the root exec helper at {} did not hand it over ({why}); install the same felhom-agent version for the helper (`systemctl restart felhom-agent-exec.socket`)", entries.len(), socket.display()),
                ),
            },
            Err(e) => r.fail(
                "vmlist",
                ErrorCode::ConfigInvalid,
                format!("{path} ({}) cannot be read as a guest list ({e}); is pmxcfs healthy? (`systemctl status pve-cluster`)", via.describe()),
            ),
        },
        Err(VmlistUnread::Refused(e)) => r.fail("vmlist", e.code(), e.to_string()),
        Err(VmlistUnread::Unreadable(e)) => r.warn("vmlist", format!("{path} is unreadable ({e}); vmids will be checked against `pct list` + `qm list`, which see only this node: run as root on a cluster node or fix vmlist_path")),
    }
}

/// The node's TLS keys and the web interface's secret sit in pmxcfs outside `priv/`, readable
/// by group www-data (pve-cluster `src/pmxcfs/pmxcfs.c` `cfs_fuse_getattr`,
/// `src/PVE/Cluster/Setup.pm` `gen_pve_ssl_key`): whoever reads them can pose as the node's
/// API. Judged by opening each as the process the commands run as (doctor switched to
/// `[agent] user` above).
fn check_node_keys(cfg: &Config, r: &mut DoctorReport) {
    let pve_dir = cfg.vmlist_path.parent().unwrap_or(Path::new("/etc/pve"));
    let node_dir = cfg.exec.pve_nodes_dir.join(&cfg.node);
    let keys = [
        node_dir.join("pve-ssl.key"),
        node_dir.join("pveproxy-ssl.key"),
        pve_dir.join("pve-www.key"),
    ];
    let euid = nix::unistd::geteuid();
    if euid.is_root() {
        if cfg.agent_user.is_some() {
            r.push(
                "node_keys",
                CheckStatus::Skipped,
                None,
                "not checked: the switch to [agent] user failed (see agent_user)".to_string(),
            );
        } else {
            r.warn(
                "node_keys",
                format!("the agent runs as root (no [agent] user): it can read the node's TLS keys ({}); run it as the package's user felhom-agent with the exec helper", node_dir.join("pve-ssl.key").display()),
            );
        }
        return;
    }
    let readable: Vec<String> = keys
        .iter()
        .filter(|k| std::fs::File::open(k).is_ok())
        .map(|k| k.display().to_string())
        .collect();
    if readable.is_empty() {
        r.pass(
            "node_keys",
            format!(
                "uid {euid} cannot read the node's TLS keys or the web secret (under {} and {})",
                node_dir.display(),
                pve_dir.display()
            ),
        );
    } else {
        r.warn(
            "node_keys",
            format!("uid {euid}, as which the agent runs, can read {}: a compromised agent could pose as the node's API. pmxcfs gives every member of group www-data every file outside priv/; the exec helper hands the agent the cluster files it reads, so remove the user from the group (`gpasswd -d {} www-data`, then restart felhom-agent.service)", readable.join(", "), cfg.agent_user.as_deref().unwrap_or("felhom-agent")),
        );
    }
}

fn check_local_files(cfg: &Config, r: &mut DoctorReport) {
    check_vmlist(cfg, r);
    check_node_keys(cfg, r);
    let dc_text = match crate::exec_helper::client::node_file(
        cfg,
        crate::exec_helper::proto::ClusterFile::DatacenterCfg,
    ) {
        Ok(t) => Some(t.unwrap_or_default()),
        Err(e) => {
            r.warn(
                "next_id",
                format!("cannot read {e}; the next-id range was not checked"),
            );
            None
        }
    };
    if let Some(text) = dc_text {
        match crate::vmid::next_id_lint(&cfg.datacenter_cfg, &text) {
            Some(warning) => r.warn("next_id", warning),
            None => r.pass(
                "next_id",
                format!(
                    "the next-id range in {} leaves out 9999 and the restore-test band",
                    cfg.datacenter_cfg.display()
                ),
            ),
        }
    }
    check_backup_jobs(cfg, r);
    for (name, dir) in [
        ("bootstrap_dir", &cfg.provision.bootstrap_dir),
        ("checks_dir", &cfg.provision.checks_dir),
        ("restore_checks_dir", &cfg.restore_test.checks_dir),
    ] {
        if name == "restore_checks_dir" && *dir == cfg.provision.checks_dir {
            continue;
        }
        match crate::config::check_trusted_dir(dir, name) {
            Ok(()) => r.pass(
                name,
                format!(
                    "{} is owned by root and writable by root only",
                    dir.display()
                ),
            ),
            Err(why) => r.fail(
                name,
                ErrorCode::ConfigInvalid,
                format!("{why}; until then every provision is refused by its preflight"),
            ),
        }
    }
    // Config::load refuses a volatile state_dir; checked again here in case the folder was
    // mounted over (tmpfs) after the config was written.
    if let Some(why) = crate::config::state_dir_volatility(&cfg.state_dir) {
        r.fail(
            "state_dir",
            ErrorCode::ConfigInvalid,
            format!(
                "{} {why}; its journal must survive a reboot: set state_dir in {} to a folder on persistent disk, e.g. /var/lib/felhom-agent",
                cfg.state_dir.display(),
                cfg.path.display()
            ),
        );
        return;
    }
    match std::fs::metadata(&cfg.state_dir) {
        Ok(m) if m.is_dir() => {
            match crate::config::untrusted_state_dir_reason(
                &cfg.state_dir,
                &m,
                cfg.agent_user.as_deref(),
            ) {
                None => r.pass(
                    "state_dir",
                    format!(
                        "{} exists, on persistent disk (not in memory, not under /tmp, /run, /dev/shm), owned by uid {} and writable by its owner only",
                        cfg.state_dir.display(),
                        std::os::unix::fs::MetadataExt::uid(&m)
                    ),
                ),
                Some(why) => r.fail(
                    "state_dir",
                    ErrorCode::ConfigInvalid,
                    format!("{why}; its journal decides which guests this agent may destroy"),
                ),
            }
        }
        Ok(_) => r.fail(
            "state_dir",
            ErrorCode::ConfigInvalid,
            format!(
                "{} is not a directory; fix state_dir in {}",
                cfg.state_dir.display(),
                cfg.path.display()
            ),
        ),
        Err(_) => r.warn(
            "state_dir",
            format!(
                "{} does not exist yet; it is created (mode 0700) on the first transaction",
                cfg.state_dir.display()
            ),
        ),
    }
}

/// What the next run's preflight loads, loaded the same way: every check pack (of provisions
/// and, when it has its own folder, of restore tests) and every bootstrap profile. A pack or
/// profile that does not load fails here, named, instead of refusing the next provision or the
/// nightly restore test (exit 3).
/// The restore-test band as an operator reads it.
fn band_text() -> String {
    let band = crate::vmid::RESTORE_TEST_BAND;
    format!("{}-{}", band.start(), band.end())
}

/// The backup jobs of `jobs.cfg` (`backup_jobs`): one warning per job that runs on this node
/// and would back up a restore-test copy ([`backup_job_warning`]), else a pass naming how many
/// jobs were read. The file comes from the exec helper, which hands over only each job's id,
/// guest selection, node, schedule and whether it is enabled
/// ([`crate::exec_helper::jobs_cfg`]); a file that cannot be read warns, it never fails.
fn check_backup_jobs(cfg: &Config, r: &mut DoctorReport) {
    use crate::exec_helper::jobs_cfg;
    let path = cfg.jobs_cfg.display();
    let band = band_text();
    let text = match crate::exec_helper::client::node_file(
        cfg,
        crate::exec_helper::proto::ClusterFile::JobsCfg,
    ) {
        Ok(Some(text)) => text,
        Ok(None) => {
            r.pass(
                "backup_jobs",
                format!("{path} does not exist: this cluster has no backup job, so none backs up restore-test copies ({band})"),
            );
            return;
        }
        Err(e) => {
            r.warn(
                "backup_jobs",
                format!(
                    "cannot read {e}; the backup jobs were not checked for one that would back up restore-test copies ({band}). The root exec helper hands jobs.cfg over (`systemctl start felhom-agent-exec.socket`, the same felhom-agent version as the agent); check jobs_cfg in {}",
                    cfg.path.display()
                ),
            );
            return;
        }
    };
    let jobs = jobs_cfg::parse(&text);
    let mut warned = false;
    for job in &jobs {
        if let Some(w) = backup_job_warning(job, &cfg.node, &cfg.pool, &cfg.jobs_cfg) {
            r.warn("backup_jobs", w);
            warned = true;
        }
    }
    if !warned {
        let here = jobs.iter().filter(|j| j.runs_on(&cfg.node)).count();
        r.pass(
            "backup_jobs",
            format!(
                "read {} backup job{} from {path}, {here} of them run{} on node {}: none would back up a restore-test copy ({band})",
                jobs.len(),
                if jobs.len() == 1 { "" } else { "s" },
                if here == 1 { "s" } else { "" },
                cfg.node
            ),
        );
    }
}

/// `pvesh <verb> /cluster/backup/<id> <args>` when `id` can be typed as it is in a shell and
/// pvesh takes it (PVE's job ids are `\S+` of at most 50 bytes, pve-manager `PVE/VZDump.pm`
/// `pve-backup-jobid`); else how to change the job in `path` by hand.
fn job_fix(id: &str, verb_args: (&str, &str), by_hand: &str, path: &Path) -> String {
    let plain = !id.is_empty()
        && id.len() <= 50
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    let (verb, args) = verb_args;
    if plain {
        format!("`pvesh {verb} /cluster/backup/{id}{args}`")
    } else {
        format!(
            "{by_hand} in {} (its id cannot be given to pvesh as it is)",
            path.display()
        )
    }
}

/// A comma-separated vmid list.
fn vmid_csv<'a>(vmids: impl IntoIterator<Item = &'a u32>) -> String {
    vmids
        .into_iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Why backup job `job` would catch a restore-test copy on `node`, and the fix, or `None`.
/// Only a job that runs on `node` ([`BackupJob::runs_on`]) can: one that backs up every guest
/// of the node without all of the band in its `exclude`, one of the agent's `pool` (the copies
/// are restored into it, and PVE drops `exclude` for a pool job: pve-manager
/// `PVE/API2/Backup.pm` `update_job`), or one that lists vmids of the band. A copy that
/// exists when the job starts is backed up (locked `backup`, so the agent cannot destroy it
/// meanwhile), or fails the job once gone: the job fixes its guests at its start (pve-manager
/// `PVE/VZDump.pm` `get_included_guests`). The message names the job and never another of its
/// keys.
///
/// [`BackupJob::runs_on`]: crate::exec_helper::jobs_cfg::BackupJob::runs_on
pub fn backup_job_warning(
    job: &crate::exec_helper::jobs_cfg::BackupJob,
    node: &str,
    pool: &str,
    path: &Path,
) -> Option<String> {
    use crate::exec_helper::jobs_cfg::Selection;
    if !job.runs_on(node) {
        return None;
    }
    let band = crate::vmid::RESTORE_TEST_BAND;
    let id = crate::error::outside_text_max(&job.id, 80);
    let caught = "a restore-test copy that exists when the job starts is backed up with it \
                  (locked `backup`, so the agent cannot destroy it until its backup ends) or, \
                  destroyed by then, fails the job";
    match job.selection() {
        Selection::All { exclude } => {
            let missing: Vec<u32> = band.clone().filter(|v| !exclude.contains(v)).collect();
            if missing.is_empty() {
                return None;
            }
            let merged: BTreeSet<u32> = exclude.iter().copied().chain(band).collect();
            let fix = job_fix(
                &job.id,
                ("set", &format!(" --exclude {}", vmid_csv(&merged))),
                &format!("add {} to the job's exclude line", vmid_csv(&missing)),
                path,
            );
            Some(format!(
                "backup job {id} backs up every guest of node {node}, and its exclude leaves out restore-test vmid{} {}: {caught}. Exclude the whole band, merged with the job's excludes: {fix}",
                if missing.len() == 1 { "" } else { "s" },
                vmid_csv(&missing)
            ))
        }
        Selection::Pool(p) if p == pool => {
            let all: BTreeSet<u32> = band.clone().collect();
            let all = vmid_csv(&all);
            let fix = job_fix(
                &job.id,
                ("set", &format!(" --all 1 --exclude {all}")),
                &format!("replace its pool line by `all 1` and `exclude {all}`"),
                path,
            );
            Some(format!(
                "backup job {id} backs up pool {pool}, the agent's pool, into which restore tests restore their copies ({}-{}): {caught}. A pool job cannot exclude guests (PVE drops exclude for it); back the pool's guests up with a job that lists their vmids (`--vmid`, updated as guests are added) or with an all job that excludes the band: {fix}",
                band.start(),
                band.end()
            ))
        }
        Selection::Vmids(vmids) => {
            let listed: Vec<u32> = vmids.iter().copied().filter(|v| band.contains(v)).collect();
            if listed.is_empty() {
                return None;
            }
            let rest: Vec<u32> = vmids
                .iter()
                .copied()
                .filter(|v| !band.contains(v))
                .collect();
            let fix = if rest.is_empty() {
                format!(
                    "the job backs up nothing else, so remove it: {}",
                    job_fix(&job.id, ("delete", ""), "remove its section", path)
                )
            } else {
                job_fix(
                    &job.id,
                    ("set", &format!(" --vmid {}", vmid_csv(&rest))),
                    &format!("remove {} from the job's vmid line", vmid_csv(&listed)),
                    path,
                )
            };
            Some(format!(
                "backup job {id} lists restore-test vmid{} {}: {caught}. Take {} out of the job: {fix}",
                if listed.len() == 1 { "" } else { "s" },
                vmid_csv(&listed),
                if listed.len() == 1 { "it" } else { "them" }
            ))
        }
        Selection::Pool(_) | Selection::Refused(_) => None,
    }
}

fn check_packs_and_profiles(cfg: &Config, r: &mut DoctorReport) {
    let mut dirs = vec![(
        "check_packs",
        &cfg.provision.checks_dir,
        "every provision and restore test",
    )];
    if cfg.restore_test.checks_dir != cfg.provision.checks_dir {
        dirs[0].2 = "every provision";
        dirs.push((
            "restore_checks",
            &cfg.restore_test.checks_dir,
            "every restore test",
        ));
    }
    for (name, dir, refused) in dirs {
        match crate::guest::checks::load_packs(dir) {
            Ok(checks) if checks.is_empty() => r.fail(
                name,
                ErrorCode::ChecksInvalid,
                format!(
                    "the check packs in {} define no check; until one does, {refused} is refused by its preflight (checks_invalid, exit 3): install the default pack",
                    dir.display()
                ),
            ),
            Ok(checks) => {
                let mut packs: Vec<String> = checks
                    .iter()
                    .map(|c| {
                        c.pack
                            .file_name()
                            .map_or_else(|| c.pack.display().to_string(), |f| f.to_string_lossy().into_owned())
                    })
                    .collect();
                packs.dedup();
                let said = format!(
                    "{} check(s) in {} pack(s) of {} parse as the preflight parses them ({})",
                    checks.len(),
                    packs.len(),
                    dir.display(),
                    packs.join(", ")
                );
                let mut doubts: Vec<String> = Vec::new();
                // A pack file that defines no check: most often one left half written.
                if let Ok(entries) = std::fs::read_dir(dir) {
                    let mut empty: Vec<String> = entries
                        .filter_map(Result::ok)
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|f| f.ends_with(".toml") && !packs.contains(f))
                        .collect();
                    empty.sort();
                    for f in empty {
                        doubts.push(format!(
                            "pack {} defines no check",
                            crate::error::outside_text(&f)
                        ));
                    }
                }
                // A check for guests the cluster does not have never runs.
                if let Ok(full) = crate::exec_helper::client::full_guest_list(cfg) {
                    for c in &checks {
                        for g in c.scope.guests.iter().filter(|g| full.lookup(**g).is_none()) {
                            doubts.push(format!(
                                "check {} names guest {g} (guests = [...]), which is in no node's guest list: it never runs",
                                crate::error::outside_text(&c.name)
                            ));
                        }
                    }
                }
                if doubts.is_empty() {
                    r.pass(name, said);
                } else {
                    r.warn(
                        name,
                        format!(
                            "{said}; but {}: fix or remove them in {}",
                            doubts.join("; "),
                            dir.display()
                        ),
                    );
                }
            }
            Err(e) => r.fail(
                name,
                ErrorCode::ChecksInvalid,
                format!(
                    "{e}; fix or remove that pack: until then {refused} is refused by its preflight (checks_invalid, exit 3)"
                ),
            ),
        }
    }
    let dir = &cfg.provision.bootstrap_dir;
    let mut names: Vec<String> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .collect(),
        Err(e) => {
            r.fail(
                "profiles",
                ErrorCode::ProfileInvalid,
                format!(
                    "cannot read bootstrap_dir {} ({e}); fix bootstrap_dir in {} or create the folder with the default profile: until then every provision is refused by its preflight (profile_invalid, exit 3)",
                    dir.display(),
                    cfg.path.display()
                ),
            );
            return;
        }
    };
    if !names.iter().any(|n| n == "default") {
        names.push("default".to_string());
    }
    names.sort();
    let mut loaded = Vec::new();
    let mut broken = Vec::new();
    for name in &names {
        match crate::guest::bootstrap::load_profile(dir, name) {
            Ok(p) => loaded.push(format!("{} ({} file(s) besides run)", p.name, p.files.len())),
            Err(e) => broken.push(format!(
                "{e}; until it loads, a provision with profile {name:?}{} is refused by its preflight (profile_invalid, exit 3)",
                if name == "default" { " (the default)" } else { "" }
            )),
        }
    }
    if broken.is_empty() {
        r.pass(
            "profiles",
            format!(
                "the bootstrap profiles in {} load as the preflight loads them: {}",
                dir.display(),
                loaded.join(", ")
            ),
        );
    } else {
        r.fail("profiles", ErrorCode::ProfileInvalid, broken.join("\n"));
    }
}

/// How the agent reaches into containers, and whether the exec helper answers when it is the
/// way.
async fn check_exec(cfg: &Config, r: &mut DoctorReport) {
    let mode = agent_exec_mode(cfg);
    match &mode {
        ExecMode::Direct => {
            let path = std::env::var_os("PATH");
            match crate::exec_helper::resolve_on_path("pct", path.as_deref()) {
                Some(pct) => r.pass(
                    "exec",
                    format!("LXC exec: {}; `pct` is {}", mode.describe(), pct.display()),
                ),
                None => r.fail(
                    "exec",
                    ErrorCode::ConfigInvalid,
                    format!(
                        "LXC exec: {}, but `pct` is not on this process's PATH ({}): a provision would restore and start its guest and then fail its launch proof (launch_unproven, exit 5). Run the agent with PVE's folders on PATH (`pct` is /usr/sbin/pct on a PVE node), or through the exec helper ([exec] helper_socket)",
                        mode.describe(),
                        path.as_deref().map_or_else(|| "unset".to_string(), |p| p.to_string_lossy().into_owned())
                    ),
                ),
            }
        }
        ExecMode::Helper { socket, .. } => match probe(socket).await {
            Ok(()) => {
                let socket = socket.clone();
                let status = tokio::task::spawn_blocking(move || helper_status(&socket))
                    .await
                    .unwrap_or_else(|e| Err(StatusAnswer::NoAnswer(e.to_string())));
                match status {
                    Ok(WireStatus { pct: Some(pct), .. }) => r.pass(
                        "exec",
                        format!("LXC exec: {}; it answers, and its `pct` is {pct}", mode.describe()),
                    ),
                    Ok(WireStatus { pct: None, path }) => r.fail(
                        "exec",
                        ErrorCode::ConfigInvalid,
                        format!(
                            "LXC exec: {}, but `pct` is not on the helper's PATH ({}): a provision would restore and start its guest and then fail its launch proof (launch_unproven, exit 5). Install pve-container (`pct` is /usr/sbin/pct on a PVE node), or give the helper PVE's folders (`systemctl edit felhom-agent-exec.service`: [Service] Environment=PATH=/usr/sbin:/usr/bin:/sbin:/bin)",
                            mode.describe(),
                            path.as_deref().unwrap_or("unset")
                        ),
                    ),
                    Err(StatusAnswer::Refused(e) | StatusAnswer::NoAnswer(e)) => r.warn(
                        "exec",
                        format!(
                            "LXC exec: {}; it answers, but cannot say where its `pct` resolves ({e}): an older helper? Install the same felhom-agent version for the helper (`systemctl restart felhom-agent-exec.socket`)",
                            mode.describe()
                        ),
                    ),
                }
            }
            Err(e) => r.fail(
                "exec",
                ErrorCode::ExecHelperUnavailable,
                format!(
                    "LXC exec: {}, but it does not answer: {e}; start it (`systemctl start felhom-agent-exec.socket`) or run the agent as root",
                    mode.describe()
                ),
            ),
        },
    }
}

async fn check_hub(cfg: &Config, r: &mut DoctorReport) {
    let Some(hub) = &cfg.hub else {
        r.warn(
            "hub",
            "no [hub] configured: reports wait in the outbox until one is",
        );
        return;
    };
    let Some(addr) = hub_authority(&hub.url) else {
        r.fail(
            "hub",
            ErrorCode::ConfigInvalid,
            format!("cannot read host and port from [hub] url {:?}", hub.url),
        );
        return;
    };
    match tokio::time::timeout(
        Duration::from_secs(5),
        tokio::net::TcpStream::connect(&addr),
    )
    .await
    {
        Ok(Ok(_)) => r.pass("hub", format!("hub {addr} accepts connections")),
        Ok(Err(e)) => r.fail(
            "hub",
            ErrorCode::PveUnreachable,
            format!("hub {addr} is unreachable: {e}; reports wait in the outbox meanwhile"),
        ),
        Err(_) => r.fail(
            "hub",
            ErrorCode::PveUnreachable,
            format!("hub {addr} did not answer within 5 s; reports wait in the outbox meanwhile"),
        ),
    }
}

/// Reports the outbox dropped unsent while no hub was configured (`<state_dir>/outbox/dropped`,
/// [`crate::outbox_keep`]): a warning naming how many, since when and what to do.
fn check_outbox_dropped(cfg: &Config, r: &mut DoctorReport) {
    use crate::outbox_keep;
    let dir = cfg.state_dir.join(outbox_keep::OUTBOX_DIR);
    match outbox_keep::read(&dir) {
        Ok(None) if cfg.hub.is_some() => r.pass(
            "outbox",
            "no report was dropped from the outbox: every one waits for the hub's acknowledgement",
        ),
        Ok(None) => r.pass(
            "outbox",
            format!(
                "no report was dropped from the outbox; without a [hub] it keeps {}, dropping \
                 the oldest",
                outbox_keep::Retention::WITHOUT_HUB.describe()
            ),
        ),
        Ok(Some(dropped)) => r.warn(
            "outbox",
            outbox_keep::warning(
                &dropped,
                &dir.join(outbox_keep::DROPPED_FILE),
                cfg.hub.is_some(),
            ),
        ),
        Err(e) => r.warn("outbox", e),
    }
}

/// `host:port` of a `ws(s)://host[:port]/path` URL (default ports 443/80).
pub fn hub_authority(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let authority = rest.split('/').next()?;
    if authority.is_empty() {
        return None;
    }
    let has_port = authority
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.chars().all(|c| c.is_ascii_digit()))
        && !authority.ends_with(']');
    if has_port {
        Some(authority.to_string())
    } else {
        Some(format!(
            "{authority}:{}",
            if scheme == "wss" { 443 } else { 80 }
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`backup_job_warning`] for the job of `text` (a jobs.cfg), on node pve1 of pool felhom.
    fn job_warning(text: &str) -> Option<String> {
        let jobs = crate::exec_helper::jobs_cfg::parse(text);
        assert_eq!(jobs.len(), 1, "{text}");
        backup_job_warning(&jobs[0], "pve1", "felhom", Path::new("/etc/pve/jobs.cfg"))
    }

    #[test]
    fn an_all_job_warns_until_it_excludes_the_whole_band_and_the_fix_merges_its_excludes() {
        let w = job_warning(
            "vzdump: backup-1\n\tschedule 21:00\n\tall 1\n\texclude 120,990000,990001\n\tmailto MARKER@x\n",
        )
        .expect("warns");
        assert!(w.contains("backup job backup-1"), "{w}");
        assert!(
            w.contains(
                "restore-test vmids 990002,990003,990004,990005,990006,990007,990008,990009:"
            ),
            "{w}"
        );
        assert!(
            w.contains("`pvesh set /cluster/backup/backup-1 --exclude 120,990000,990001,990002,990003,990004,990005,990006,990007,990008,990009`"),
            "{w}"
        );
        assert!(!w.contains("MARKER"), "{w}");
        // Without any exclude (all ten missing), and with one missing.
        let w = job_warning("vzdump: b\n\tschedule daily\n\tall 1\n").expect("warns");
        assert!(
            w.contains(
                "--exclude 990000,990001,990002,990003,990004,990005,990006,990007,990008,990009`"
            ),
            "{w}"
        );
        let w = job_warning(
            "vzdump: b\n\tschedule daily\n\tall 1\n\texclude 990000 990001 990002 990003 990004 990005 990006 990007 990008\n",
        )
        .expect("warns");
        assert!(w.contains("restore-test vmid 990009:"), "{w}");
        // The whole band excluded: nothing to say.
        assert_eq!(
            job_warning("vzdump: b\n\tschedule daily\n\tall 1\n\texclude 990000,990001,990002,990003,990004,990005,990006,990007,990008,990009,101\n"),
            None
        );
    }

    #[test]
    fn only_jobs_that_run_here_warn() {
        for text in [
            "vzdump: b\n\tschedule daily\n\tall 1\n\tenabled 0\n",
            "vzdump: b\n\tschedule daily\n\tall 1\n\tnode pve2\n",
            "vzdump: b\n\tall 1\n",
            // Refused by PVE when it starts: it backs up nothing.
            "vzdump: b\n\tschedule daily\n\tall 1\n\tvmid 990000\n",
            // Another pool, and guests outside the band.
            "vzdump: b\n\tschedule daily\n\tpool other\n",
            "vzdump: b\n\tschedule daily\n\tvmid 100,101\n",
        ] {
            assert_eq!(job_warning(text), None, "{text}");
        }
        assert!(job_warning("vzdump: b\n\tschedule daily\n\tall 1\n\tnode pve1\n").is_some());
        assert!(job_warning("vzdump: b\n\tschedule daily\n\tall 1\n\tenabled 1\n").is_some());
    }

    #[test]
    fn a_pool_job_of_the_agents_pool_warns_that_it_cannot_exclude() {
        let w = job_warning(
            "vzdump: backup-pool\n\tschedule daily\n\tpool felhom\n\texclude 990000,990001,990002,990003,990004,990005,990006,990007,990008,990009\n",
        )
        .expect("warns");
        assert!(
            w.contains("backup job backup-pool backs up pool felhom, the agent's pool")
                && w.contains("cannot exclude")
                && w.contains("--vmid")
                && w.contains("`pvesh set /cluster/backup/backup-pool --all 1 --exclude 990000,990001,990002,990003,990004,990005,990006,990007,990008,990009`"),
            "{w}"
        );
    }

    #[test]
    fn a_job_listing_band_vmids_warns_and_an_id_pvesh_cannot_take_is_fixed_by_hand() {
        let w = job_warning("vzdump: b\n\tschedule daily\n\tvmid 100,990003\n").expect("warns");
        assert!(
            w.contains("lists restore-test vmid 990003:")
                && w.contains("`pvesh set /cluster/backup/b --vmid 100`"),
            "{w}"
        );
        let w = job_warning("vzdump: b\n\tschedule daily\n\tvmid 990003\n").expect("warns");
        assert!(w.contains("`pvesh delete /cluster/backup/b`"), "{w}");
        // An id with a character a shell or pvesh would take otherwise: escaped, fixed by hand.
        let w = job_warning("vzdump: b;\u{1b}[2J\n\tschedule daily\n\tall 1\n").expect("warns");
        assert!(
            w.contains("backup job b;\\u{1b}[2J")
                && w.contains("add 990000,990001,990002,990003,990004,990005,990006,990007,990008,990009 to the job's exclude line in /etc/pve/jobs.cfg")
                && !w.contains("pvesh set")
                && !w.contains('\u{1b}'),
            "{w}"
        );
    }

    #[test]
    fn the_version_floor_is_pve_8_1_and_below_it_fails_naming_the_version() {
        assert_eq!(version_floor(), (8, 1));
        assert_eq!(parse_release("8.2.4"), Some((8, 2)));
        assert_eq!(parse_release("9.1"), Some((9, 1)));
        for ok in ["8.1.0", "8.4.14", "9.0.3", "9.1.1", "10.0"] {
            assert_eq!(version_verdict(ok).0, CheckStatus::Pass, "{ok}");
        }
        let (status, msg) = version_verdict("8.0.9");
        assert_eq!(status, CheckStatus::Fail);
        assert!(
            msg.contains("PVE 8.0.9") && msg.contains("PVE 8.1"),
            "{msg}"
        );
        assert!(msg.contains("/pools?poolid="), "{msg}");
        assert_eq!(version_verdict("7.4.17").0, CheckStatus::Fail);
        assert_eq!(version_verdict("fakepve").0, CheckStatus::Warn);
    }
    use std::collections::BTreeMap;

    fn perms(entries: &[(&str, &[&str])]) -> Permissions {
        entries
            .iter()
            .map(|(p, privs)| {
                (
                    p.to_string(),
                    privs
                        .iter()
                        .map(|x| (x.to_string(), serde_json::json!(1)))
                        .collect::<BTreeMap<_, _>>(),
                )
            })
            .collect()
    }

    #[test]
    fn the_filter_must_refuse_bind_and_listen() {
        assert!(filter_refuses("~bind listen io_uring_setup", MUST_REFUSE).is_ok());
        assert!(filter_refuses("read write openat close", MUST_REFUSE).is_ok());
        assert_eq!(
            filter_refuses("read write bind", MUST_REFUSE),
            Err("bind allowed".to_string())
        );
        assert_eq!(
            filter_refuses("~listen", MUST_REFUSE),
            Err("bind allowed".to_string())
        );
        assert!(filter_refuses("", MUST_REFUSE).is_err());
    }

    #[test]
    fn only_the_native_architecture_passes() {
        assert!(native_only("native").is_ok());
        assert!(native_only("").is_err());
        assert!(native_only("  ").is_err());
        assert_eq!(
            native_only("native x86"),
            Err("SystemCallArchitectures also allows x86".to_string())
        );
    }

    #[test]
    fn sshd_patterns_are_openssh_wildcards() {
        assert!(sshd_pattern_match("felhom-agent", "felhom-agent"));
        assert!(sshd_pattern_match("felhom-agent", "felhom-*"));
        assert!(sshd_pattern_match("felhom-agent", "*"));
        assert!(sshd_pattern_match("felhom-agent", "felhom?agent"));
        assert!(!sshd_pattern_match("felhom-agent", "felhom"));
        assert!(!sshd_pattern_match("felhom-agent", "?felhom-agent"));
        assert!(!sshd_pattern_match("felhom-agent", "root"));
    }

    #[test]
    fn sshd_refuses_as_allowed_user_does() {
        let groups = vec!["felhom-agent".to_string(), "www-data".to_string()];
        let u = "felhom-agent";
        let refused = |dump: &str| sshd_refuses(dump, u, &groups);
        assert!(refused("port 22\nusepam yes\n").is_err());
        assert!(refused("denyusers root\ndenyusers felhom-agent\n").is_ok());
        assert!(refused("denyusers felhom-*\n").is_ok());
        assert!(refused("denyusers felhom-agent@*\n").is_ok());
        // Denied from one host only: the user may still log in from others.
        assert!(refused("denyusers felhom-agent@10.0.0.1\n").is_err());
        assert!(refused("allowusers root admin\n").is_ok());
        assert!(refused("allowusers root felhom-agent@10.0.0.1\n").is_err());
        assert!(refused("denygroups www-*\n").is_ok());
        assert!(refused("allowgroups sudo\n").is_ok());
        assert!(refused("allowgroups www-data\n").is_err());
    }

    #[test]
    fn shadow_expiry_is_read_as_pam_and_sshd_read_it() {
        let text = "root:*:19000:0:99999:7:::\nfelhom-agent:!*:19000::::::\nold:!*:19000:::::1:\n";
        assert_eq!(shadow_expired(text, "felhom-agent", 20000), Some(false));
        assert_eq!(shadow_expired(text, "old", 20000), Some(true));
        assert_eq!(shadow_expired(text, "nobody", 20000), None);
    }

    #[test]
    fn a_home_the_user_can_write_or_create_is_exposed() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().expect("tmp");
        let root = d.path();
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let me = nix::unistd::getuid().as_raw();
        let other = me.wrapping_add(4242);
        // Missing, in a folder only its owner may write.
        let home = root.join("nonexistent");
        assert_eq!(home_exposure(&home, other, &[other]), None);
        // ... and the same folder is the user's own: it may create its home.
        let why = home_exposure(&home, me, &[me]).expect("creatable");
        assert!(why.contains("does not exist"), "{why}");
        // An existing home of the owner of the folder: writable.
        std::fs::create_dir(&home).expect("mkdir");
        assert!(home_exposure(&home, me, &[me]).is_some());
        // Something in it that the user owns.
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::create_dir(home.join(".ssh")).expect("mkdir");
        std::fs::set_permissions(home.join(".ssh"), std::fs::Permissions::from_mode(0o777))
            .expect("chmod");
        let why = home_exposure(&home, other, &[other]).expect("world-writable .ssh");
        assert!(why.contains(".ssh"), "{why}");
        assert!(home_exposure(Path::new("relative"), other, &[other]).is_some());
    }

    #[test]
    fn a_guest_outside_the_pool_granting_more_than_vm_backup_warns() {
        let pool: BTreeSet<String> = ROLE_PRIVS_PVE9.iter().map(|p| p.to_string()).collect();
        let token = "felhom@pve!agent";
        let fine = perms(&[
            ("/pool/felhom", ROLE_PRIVS_PVE9),
            ("/vms/101", &["VM.Backup"]),
        ]);
        assert_eq!(guest_grants_beyond_backup(token, &fine, &pool), None);
        let user_role = perms(&[
            ("/pool/felhom", ROLE_PRIVS_PVE9),
            (
                "/vms/101",
                &["VM.Backup", "VM.Console", "VM.PowerMgmt", "VM.Audit"],
            ),
            ("/vms/200", ROLE_PRIVS_PVE9),
        ]);
        let m = guest_grants_beyond_backup(token, &user_role, &pool).expect("a warning");
        assert!(m.contains("/vms/101: VM.Console"), "{m}");
        assert!(!m.contains("/vms/200"), "{m}");
        assert!(m.contains("--roles FelhomVMBackup"), "{m}");
    }

    #[test]
    fn privileges_on_ancestors_count() {
        let p = perms(&[
            ("/pool/felhom", &["VM.Audit"]),
            ("/", &["Sys.Audit"]),
            ("/pool/felhomx", &["VM.Allocate"]),
        ]);
        let held = held_on(&p, "/pool/felhom");
        assert!(held.contains("VM.Audit") && held.contains("Sys.Audit"));
        assert!(
            !held.contains("VM.Allocate"),
            "a sibling path with a common prefix must not count"
        );
    }

    #[test]
    fn hub_authority_defaults() {
        assert_eq!(
            hub_authority("wss://hub.example.net/agent").as_deref(),
            Some("hub.example.net:443")
        );
        assert_eq!(
            hub_authority("ws://127.0.0.5:9000/agent").as_deref(),
            Some("127.0.0.5:9000")
        );
        assert_eq!(hub_authority("wss:///x"), None);
    }

    #[test]
    fn user_cfg_tells_the_token_grant_from_the_user_grant() {
        let cfg = UserCfg::parse(
            "user:felhom@pve:1:0::::::\n\
             token:felhom@pve!agent:0:1::\n\
             token:felhom@pve!open:0:0::\n\
             group:ops:felhom@pve,other@pve::\n\
             pool:felhom::200,300:local-lvm:\n\
             role:only-audit:VM.Audit:\n\
             acl:1:/pool/felhom:felhom@pve!agent:PVEVMAdmin,PVEPoolUser:\n\
             acl:1:/storage:@ops:PVEDatastoreUser:\n\
             acl:0:/pool:felhom@pve:only-audit:\n",
        );
        assert!(cfg.privsep("felhom@pve!agent"));
        assert!(!cfg.privsep("felhom@pve!open"));
        assert!(cfg.privsep("unknown@pve!x"), "PVE's default");
        assert!(cfg.grants("felhom@pve!agent", "/pool/felhom", "VM.Allocate"));
        assert!(cfg.grants("felhom@pve!agent", "/pool/felhom", "Pool.Audit"));
        assert!(!cfg.grants("felhom@pve", "/pool/felhom", "VM.Allocate"));
        // Through a group, propagated from /storage.
        assert!(cfg.grants(
            "felhom@pve",
            "/storage/local-lvm",
            "Datastore.AllocateSpace"
        ));
        assert!(!cfg.grants(
            "felhom@pve!agent",
            "/storage/local-lvm",
            "Datastore.AllocateSpace"
        ));
        // Not propagated: only /pool itself.
        assert!(cfg.grants("felhom@pve", "/pool", "VM.Audit"));
        assert!(!cfg.grants("felhom@pve", "/pool/felhom", "VM.Audit"));
        // A path is not an ancestor of a longer name.
        assert!(!cfg.grants("felhom@pve!agent", "/pool/felhomx", "VM.Allocate"));
    }
}
