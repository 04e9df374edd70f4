//! The preflight: everything that can be known before the first PVE write of a provision,
//! restore test or hub dispatch, checked before the transaction's first journal intent
//! (DESIGN section 2, rule 9). It only reads: the vmid verdict, the backup volume (listed on
//! its storage, its type, the configuration PVE can extract from it), the target storage on
//! this node, the pool, the bootstrap profile, the check packs and the node's `[policy]`.
//!
//! The checks are values; [`run`] gathers them into a [`PreflightReport`] whose verdict is the
//! first failing check's, except that a check that failed for the environment (PVE not
//! answering, a wrong pin, the exec helper not answering, a full state folder: exit 6) is the
//! verdict before any refusal: the request itself could not be judged. [`for_request`] adds
//! the node's own checks: free space in the state folder and, for a container, that the exec
//! helper answers. Nothing here prints; callers render [`PreflightReport::to_json`] or
//! [`PreflightReport::human`].

pub mod memory;
pub mod restorable;

use std::path::Path;

use serde::Serialize;
use serde_json::{json, Value};

use crate::config::{Config, Policy};
use crate::error::{exit_status, ErrorCode, ExitStatus, Failure};
use crate::guest::bootstrap::load_profile;
use crate::guest::checks::load_packs;
use crate::provision::effects::DEFAULT_PROFILE;
use crate::provision::machine::{Event, Marker, Request, TxnKind};
use crate::pve::guest_config::{StoredConfig, StoredConfigText};
use crate::pve::types::{BackupVolume, PoolInfo, StorageStatus};
use crate::pve::{ApiErrorKind, GuestKind, PveClient, PveError};
use restorable::{
    access_check, contents_check, network_check, paths_needed, space_check, tags_check,
};
use restorable::{Asked, ClusterFiles, Held};

/// How one preflight check ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckVerdict {
    /// Nothing stands in the way.
    Pass,
    /// The request cannot pass; nothing may be written.
    Fail,
    /// Does not apply to this request.
    Skipped,
}

impl CheckVerdict {
    /// The word in JSON and human output.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pass => "pass",
            Self::Fail => "fail",
            Self::Skipped => "skipped",
        }
    }
}

/// One check of the preflight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PreflightCheck {
    /// `vmid`, `policy`, `backup`, `storage`, `pool`, `profile`, `checks`.
    pub name: &'static str,
    /// Its verdict.
    pub status: CheckVerdict,
    /// The stable code of a failure.
    pub code: Option<ErrorCode>,
    /// What was found, or what is wrong and what to do.
    pub message: String,
}

impl PreflightCheck {
    /// A passing check.
    pub fn pass(name: &'static str, message: impl Into<String>) -> Self {
        Self {
            name,
            status: CheckVerdict::Pass,
            code: None,
            message: message.into(),
        }
    }

    /// A failing check.
    pub fn fail(name: &'static str, code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            name,
            status: CheckVerdict::Fail,
            code: Some(code),
            message: message.into(),
        }
    }

    /// A check that does not apply.
    pub fn skipped(name: &'static str, message: impl Into<String>) -> Self {
        Self {
            name,
            status: CheckVerdict::Skipped,
            code: None,
            message: message.into(),
        }
    }

    /// The vmid verdict as a check: `Ok(message)` free, `Err(failure)` refused.
    pub fn vmid(verdict: Result<String, Failure>) -> Self {
        match verdict {
            Ok(m) => Self::pass("vmid", m),
            Err(f) => Self::fail("vmid", f.code, f.message),
        }
    }

    fn failure(&self) -> Option<Failure> {
        match (self.status, self.code) {
            (CheckVerdict::Fail, Some(code)) => Some(Failure::new(code, self.message.clone())),
            _ => None,
        }
    }
}

/// The preflight's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every check passed (or did not apply).
    Pass,
    /// Refused: the first failing check's code and message.
    Refused(Failure),
}

/// Every check and the verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreflightReport {
    /// The checks, in the order they are reported.
    pub checks: Vec<PreflightCheck>,
    /// The verdict.
    pub verdict: Verdict,
    /// The configuration stored in the backup, when the preflight read it: handed to the
    /// restore (`Executor::carry_stored_config`) so that a provision reads it once.
    pub stored_config: Option<StoredConfigText>,
    /// The bytes the restore allocates on its target storage (the stored disks' sizes) and
    /// what that storage had free, when both were read: a restore run counts the copies it
    /// admitted against the free space.
    pub space: Option<(u64, u64)>,
}

impl PreflightReport {
    /// The report of these checks: refused by the first failing one, and by the first that
    /// failed for the environment (exit 6) before any other: PVE that does not answer cannot
    /// refuse a request.
    pub fn from_checks(checks: Vec<PreflightCheck>) -> Self {
        let environment = checks
            .iter()
            .filter_map(PreflightCheck::failure)
            .find(|f| exit_status(f.code) == ExitStatus::Environment);
        let verdict = environment
            .or_else(|| checks.iter().find_map(PreflightCheck::failure))
            .map_or(Verdict::Pass, Verdict::Refused);
        Self {
            checks,
            verdict,
            stored_config: None,
            space: None,
        }
    }

    /// The failure that refuses the request, if any.
    pub fn failure(&self) -> Option<&Failure> {
        match &self.verdict {
            Verdict::Pass => None,
            Verdict::Refused(f) => Some(f),
        }
    }

    /// The failure when it is the environment's (exit 6: PVE not answering, a wrong pin, the
    /// exec helper, a full state folder): the request was not judged, so it is not journaled
    /// as a refusal either.
    pub fn environment_failure(&self) -> Option<&Failure> {
        self.failure()
            .filter(|f| exit_status(f.code) == ExitStatus::Environment)
    }

    /// `{"verdict": "pass|refused", "error": null|{code, message}, "checks": [...]}`.
    pub fn to_json(&self) -> Value {
        json!({
            "verdict": if self.failure().is_some() { "refused" } else { "pass" },
            "error": self.failure(),
            "checks": self.checks,
        })
    }

    /// One line per check, then the verdict.
    pub fn human(&self) -> String {
        let mut s = String::from("preflight (read only):\n");
        for c in &self.checks {
            let code = c.code.map(|c| format!(" [{c}]")).unwrap_or_default();
            s.push_str(&format!(
                "  {:<8} {:<7}{code} {}\n",
                c.name,
                c.status.as_str(),
                c.message
            ));
        }
        match self.failure() {
            None => s.push_str("preflight: pass\n"),
            Some(f) => s.push_str(&format!("preflight: refused [{}]: {}\n", f.code, f.message)),
        }
        s
    }
}

/// What a transaction asks for, as the preflight needs it.
#[derive(Debug, Clone)]
pub struct PreflightRequest<'a> {
    /// This node.
    pub node: &'a str,
    /// The fleet's pool.
    pub pool: &'a str,
    /// The guest kind the request implies (from the backup volid's name).
    pub guest: GuestKind,
    /// The backup volid to restore.
    pub volid: &'a str,
    /// The target storage.
    pub storage: &'a str,
    /// The bootstrap profile that will run; `None` when none runs (a restore test).
    pub profile: Option<&'a str>,
    /// `[provision] bootstrap_dir`.
    pub bootstrap_dir: &'a Path,
    /// The check pack folder this transaction uses.
    pub checks_dir: &'a Path,
    /// The node's `[policy]`.
    pub policy: &'a Policy,
    /// The config file, named in messages.
    pub config_path: &'a Path,
    /// The target vmid, when known (a backup of the same vmid needs no `VM.Backup`).
    pub vmid: Option<u32>,
    /// Every NIC of the backup is overridden, isolated (a restore-test copy).
    pub isolate: bool,
    /// The lab bridge (one of `[restore_test] lab_bridges`) where an isolated VM copy's NICs
    /// go.
    pub lab_bridge: Option<&'a str>,
    /// The API token, named in the grant commands.
    pub token_id: &'a str,
    /// The cluster's `datacenter.cfg` (its tag policy) and `sdn/vnets.cfg`, as read
    /// ([`read_cluster_files`]).
    pub cluster_files: &'a ClusterFiles,
}

/// The cluster files the preflight reads, as the commands read them: through the root exec
/// helper in its mode (the agent's user then needs no pmxcfs group), else directly
/// ([`crate::exec_helper::client::node_file`]).
pub fn read_cluster_files(cfg: &Config) -> ClusterFiles {
    use crate::exec_helper::client::node_file;
    use crate::exec_helper::proto::ClusterFile;
    let read = |file| node_file(cfg, file).transpose();
    ClusterFiles::from_texts(
        read(ClusterFile::DatacenterCfg),
        read(ClusterFile::VnetsCfg),
    )
}

/// The owner vmid in a backup volid's name (`…/vzdump-lxc-200-…`).
pub fn owner_from_volid(volid: &str) -> Option<u32> {
    volid
        .split("vzdump-")
        .nth(1)
        .and_then(|r| r.split('-').nth(1))
        .and_then(|v| v.parse().ok())
}

/// The content type a guest's disks need on the target storage.
pub fn content_needed(guest: GuestKind) -> &'static str {
    match guest {
        GuestKind::Lxc => "rootdir",
        GuestKind::Qemu => "images",
    }
}

fn kind_word(guest: GuestKind) -> &'static str {
    match guest {
        GuestKind::Lxc => "container (lxc)",
        GuestKind::Qemu => "VM (qemu)",
    }
}

/// `[policy]`: the storage, the source and the profile must all be allowed.
pub fn policy_check(req: &PreflightRequest<'_>) -> PreflightCheck {
    let p = req.policy;
    if p.is_unlimited() {
        return PreflightCheck::pass("policy", "no [policy] on this node: no limits");
    }
    let mut denied = Vec::new();
    if !p.allows_storage(req.storage) {
        denied.push(format!(
            "target storage {:?} is not in [policy] storages ({})",
            req.storage,
            p.storages.as_deref().unwrap_or_default().join(", ")
        ));
    }
    if !p.allows_source(req.volid) {
        denied.push(format!(
            "backup {:?} matches no pattern of [policy] sources ({})",
            req.volid,
            p.sources.as_deref().unwrap_or_default().join(", ")
        ));
    }
    if let Some(name) = req.profile {
        if !p.allows_profile(name) {
            denied.push(format!(
                "bootstrap profile {:?} is not in [policy] profiles ({})",
                name,
                p.profiles.as_deref().unwrap_or_default().join(", ")
            ));
        }
    }
    if denied.is_empty() {
        PreflightCheck::pass("policy", format!("within [policy] ({})", p.describe()))
    } else {
        PreflightCheck::fail(
            "policy",
            ErrorCode::PolicyDenied,
            format!(
                "{}; nobody, the hub included, may exceed this node's [policy]: use what it allows, or have the node's operator extend [policy] in {}",
                denied.join("; "),
                req.config_path.display()
            ),
        )
    }
}

/// The bootstrap profile loads: a valid name, an executable `run`, within the size limits.
pub fn profile_check(req: &PreflightRequest<'_>) -> PreflightCheck {
    let Some(name) = req.profile else {
        return PreflightCheck::skipped(
            "profile",
            "no bootstrap: a restored copy is checked, never changed",
        );
    };
    match load_profile(req.bootstrap_dir, name) {
        Ok(p) => PreflightCheck::pass(
            "profile",
            format!(
                "bootstrap profile {:?} loads from {} ({} file(s) besides run)",
                p.name,
                p.dir.display(),
                p.files.len()
            ),
        ),
        Err(e) => PreflightCheck::fail(
            "profile",
            ErrorCode::ProfileInvalid,
            format!("{e} (bootstrap_dir {})", req.bootstrap_dir.display()),
        ),
    }
}

/// Every check pack parses and uses only known placeholders.
pub fn checks_check(req: &PreflightRequest<'_>) -> PreflightCheck {
    match load_packs(req.checks_dir) {
        Ok(checks) if checks.is_empty() => PreflightCheck::fail(
            "checks",
            ErrorCode::ChecksInvalid,
            format!(
                "the check packs in {} define no check; a guest is only green when checked: install the default pack",
                req.checks_dir.display()
            ),
        ),
        Ok(checks) => PreflightCheck::pass(
            "checks",
            format!(
                "{} check(s) parse in {}",
                checks.len(),
                req.checks_dir.display()
            ),
        ),
        Err(e) => PreflightCheck::fail(
            "checks",
            ErrorCode::ChecksInvalid,
            format!("{e}; fix or remove the pack before provisioning"),
        ),
    }
}

/// A PVE read that failed for want of an answer (or of trust) fails its check with that
/// error's own code: the preflight could not tell, so nothing is written either way.
fn environment(name: &'static str, e: &PveError) -> Option<PreflightCheck> {
    let no_answer = match e {
        PveError::Api(a) => {
            matches!(
                a.kind,
                ApiErrorKind::Auth | ApiErrorKind::Quorum | ApiErrorKind::NoSuchNode
            ) || (a.kind == ApiErrorKind::Transient && a.status != 500)
        }
        _ => true,
    };
    if !no_answer {
        None
    } else {
        Some(PreflightCheck::fail(
            name,
            e.code(),
            format!("could not be checked: {e}"),
        ))
    }
}

fn kind_of_format(format: &str) -> Option<GuestKind> {
    if format.starts_with("vma") || format == "pbs-vm" {
        Some(GuestKind::Qemu)
    } else if format.starts_with("tar") || format == "tgz" || format == "pbs-ct" {
        Some(GuestKind::Lxc)
    } else {
        None
    }
}

/// What a stored guest configuration says about itself: its kind (from keys only one kind
/// has) and a short summary.
pub fn read_stored_config(text: &str) -> (Option<GuestKind>, String) {
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            break; // snapshots and pending sections follow the current config
        }
        if line.starts_with('#') {
            continue;
        }
        if let Some((k, v)) = line.split_once(':') {
            let k = k.trim();
            if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
                keys.push((k, v.trim()));
            }
        }
    }
    if keys.is_empty() {
        return (
            None,
            "PVE answered, but with no configuration lines".to_string(),
        );
    }
    let has = |want: &str| keys.iter().any(|(k, _)| *k == want);
    let lxc = has("rootfs") || has("arch") || keys.iter().any(|(k, _)| k.starts_with("mp"));
    let qemu = ["scsi", "virtio", "sata", "ide", "efidisk"]
        .iter()
        .any(|p| {
            keys.iter().any(|(k, _)| {
                k.strip_prefix(p)
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
        })
        || has("smbios1")
        || has("bootdisk");
    let kind = match (lxc, qemu) {
        (true, false) => Some(GuestKind::Lxc),
        (false, true) => Some(GuestKind::Qemu),
        _ => None,
    };
    let name = keys
        .iter()
        .find(|(k, _)| *k == "hostname" || *k == "name")
        .map(|(_, v)| v.chars().take(64).collect::<String>());
    let ostype = keys
        .iter()
        .find(|(k, _)| *k == "ostype")
        .map(|(_, v)| v.chars().take(32).collect::<String>());
    let mut summary = format!("{} key(s)", keys.len());
    if let Some(n) = name {
        summary.push_str(&format!(", name {n:?}"));
    }
    if let Some(o) = ostype {
        summary.push_str(&format!(", ostype {o:?}"));
    }
    (kind, summary)
}

/// The backup volume: listed on its storage for this token, of the kind the request implies;
/// `stored` is PVE's extraction of the configuration in the backup, when it was asked for.
pub fn backup_verdict(
    req: &PreflightRequest<'_>,
    listing: Result<Vec<BackupVolume>, PveError>,
    stored: Option<Result<String, PveError>>,
) -> PreflightCheck {
    let volid = req.volid;
    let Some((sid, _)) = volid
        .split_once(':')
        .filter(|(s, v)| !s.is_empty() && !v.is_empty())
    else {
        return PreflightCheck::fail(
            "backup",
            ErrorCode::BackupMissing,
            format!("{volid:?} is not a backup volid (<storage>:backup/vzdump-…); list the backups with `pvesm list <storage> --content backup`"),
        );
    };
    let list = match listing {
        Ok(l) => l,
        Err(e) => {
            if let Some(c) = environment("backup", &e) {
                return c;
            }
            return PreflightCheck::fail(
                "backup",
                ErrorCode::BackupMissing,
                format!(
                    "the backups on storage {sid:?} cannot be listed with this token, so {volid} cannot be restored: {e}; check that the storage exists on node {} and that the token has Datastore.AllocateSpace on /storage/{sid}",
                    req.node
                ),
            );
        }
    };
    let Some(vol) = list.iter().find(|v| v.volid == volid) else {
        let owner = owner_from_volid(volid).map_or("<owner>".to_string(), |o| o.to_string());
        let owner_path = format!("/vms/{owner}");
        return PreflightCheck::fail(
            "backup",
            ErrorCode::BackupMissing,
            format!(
                "backup {volid} does not exist on storage {sid:?} of node {}, or this token may not read it (restoring another guest's backup needs VM.Backup on {owner_path}, and nothing more there: {} with the role {}); {} backup(s) are visible there: list them with `pvesm list {sid} --content backup` and pass one with --from",
                req.node,
                restorable::grant_commands(&owner_path, restorable::BACKUP_OWNER_ROLE, req.token_id),
                restorable::backup_owner_role_add(),
                list.len()
            ),
        );
    };
    let listed_kind = vol.guest_kind();
    // `tar` is a container's format, and that of the oldest VM backups too (qemu-server
    // `restore_tar_archive`): for a volid named as a VM's, the format tells nothing.
    let format_kind = vol.format.as_deref().and_then(kind_of_format).filter(|k| {
        !(*k == GuestKind::Lxc
            && crate::pve::types::backup_kind_from_volid(volid) == Some(GuestKind::Qemu))
    });
    for (what, kind) in [
        ("PVE lists it as", listed_kind),
        ("its format is that of", format_kind),
    ] {
        if let Some(k) = kind {
            if k != req.guest {
                return PreflightCheck::fail(
                    "backup",
                    ErrorCode::BackupMissing,
                    format!(
                        "backup {volid} cannot be restored as a {}: {what} a {} backup; pick a {} backup",
                        kind_word(req.guest),
                        kind_word(k),
                        kind_word(req.guest)
                    ),
                );
            }
        }
    }
    let mut found = format!(
        "{volid} exists ({}, format {}, {} bytes, owner vmid {})",
        kind_word(listed_kind.unwrap_or(req.guest)),
        vol.format.as_deref().unwrap_or("?"),
        vol.size.map_or("?".to_string(), |s| s.to_string()),
        vol.vmid.map_or("?".to_string(), |v| v.to_string()),
    );
    match stored {
        None => {}
        Some(Ok(text)) => {
            let (kind, summary) = read_stored_config(&text);
            if let Some(k) = kind.filter(|k| *k != req.guest) {
                return PreflightCheck::fail(
                    "backup",
                    ErrorCode::BackupMissing,
                    format!(
                        "the configuration stored in backup {volid} is that of a {} ({summary}), not of a {}; pick a {} backup",
                        kind_word(k),
                        kind_word(req.guest),
                        kind_word(req.guest)
                    ),
                );
            }
            found.push_str(&format!("; stored config: {summary}"));
        }
        Some(Err(e)) => {
            if let Some(c) = environment("backup", &e) {
                return c;
            }
            return PreflightCheck::fail(
                "backup",
                ErrorCode::BackupMissing,
                format!(
                    "the configuration stored in backup {volid} could not be read with this token ({}), so the preflight cannot tell what the restore brings along (NICs, privileges, mount points, hookscript); check `pvesh get /nodes/{}/vzdump/extractconfig --volume {volid}` with the agent's token",
                    e.api().map_or_else(|| e.to_string(), |a| a.message.clone()),
                    req.node
                ),
            );
        }
    }
    PreflightCheck::pass("backup", found)
}

/// The target storage on this node: exists, enabled, active, holds what the guest needs.
pub fn storage_verdict(
    req: &PreflightRequest<'_>,
    status: Result<StorageStatus, PveError>,
) -> PreflightCheck {
    let sid = req.storage;
    let node = req.node;
    let need = content_needed(req.guest);
    let st = match status {
        Ok(s) => s,
        Err(e) => {
            if let Some(c) = environment("storage", &e) {
                return c;
            }
            let why = match e.api().map(|a| &a.kind) {
                Some(ApiErrorKind::Permission) => format!(
                    "storage {sid:?} does not exist on node {node}, or this token may not use it"
                ),
                _ => format!("storage {sid:?} does not exist on node {node}"),
            };
            return PreflightCheck::fail(
                "storage",
                ErrorCode::StorageInvalid,
                format!(
                    "{why} (PVE: {e}); pick a storage that `pvesm status --content {need}` lists and the token has Datastore.AllocateSpace on"
                ),
            );
        }
    };
    let fix = format!("pick a storage that `pvesm status --content {need}` lists as active");
    if !st.enabled {
        return PreflightCheck::fail(
            "storage",
            ErrorCode::StorageInvalid,
            format!("storage {sid:?} is disabled on node {node}; {fix}"),
        );
    }
    if !st.active {
        return PreflightCheck::fail(
            "storage",
            ErrorCode::StorageInvalid,
            format!("storage {sid:?} is not active on node {node}; {fix}"),
        );
    }
    if !st.has_content(need) {
        return PreflightCheck::fail(
            "storage",
            ErrorCode::StorageInvalid,
            format!(
                "storage {sid:?} on node {node} holds content {:?}, but a {} needs {need:?}; {fix}",
                st.content,
                kind_word(req.guest)
            ),
        );
    }
    PreflightCheck::pass(
        "storage",
        format!(
            "storage {sid:?} on node {node}: {}, enabled, active, content {:?}{}",
            st.kind.as_deref().unwrap_or("?"),
            st.content,
            st.avail
                .map(|a| format!(", {a} bytes free"))
                .unwrap_or_default()
        ),
    )
}

/// The pool exists and the token sees it. A missing pool is the node's configuration, not the
/// request's: `pool_missing`, with the command that creates it.
pub fn pool_verdict(
    req: &PreflightRequest<'_>,
    pool: Result<Option<PoolInfo>, PveError>,
) -> PreflightCheck {
    let missing = |detail: String| {
        PreflightCheck::fail(
            "pool",
            ErrorCode::PoolMissing,
            format!(
                "pool {:?} does not exist or this token cannot see it{detail}; create it (`pveum pool add {}`) and grant Pool.Audit, or fix `pool` in {}",
                req.pool,
                req.pool,
                req.config_path.display()
            ),
        )
    };
    match pool {
        Ok(Some(p)) => PreflightCheck::pass(
            "pool",
            format!("pool {:?} exists ({} member(s))", p.poolid, p.members.len()),
        ),
        Ok(None) => missing(String::new()),
        Err(e) if e.code() == ErrorCode::PoolMissing => missing(format!(" (PVE: {e})")),
        Err(e) => environment("pool", &e).unwrap_or_else(|| missing(format!(" (PVE: {e})"))),
    }
}

/// Run the whole preflight. `vmid` is the vmid verdict the caller already has. Reads only.
pub async fn run(
    pve: &PveClient,
    req: &PreflightRequest<'_>,
    vmid: PreflightCheck,
) -> PreflightReport {
    let mut checks = vec![vmid, policy_check(req)];
    let backup_sid = req.volid.split_once(':').map(|(s, _)| s).unwrap_or("");
    // The four reads are independent and asked at once: with the privilege reads after them,
    // the preflight costs two round trips to PVE. The stored configuration is asked for
    // before the listing says whether the token can see the backup, and used only when it
    // can: PVE checks the token's access to the volume before it extracts anything
    // (pve-manager `PVE/API2/VZDump.pm` `extractconfig`: `check_volume_access`, then
    // `extract_vzdump_config`), so the early read of a backup the token may not see is a
    // refusal, and nothing is read from it.
    let listing = async {
        if backup_sid.is_empty() {
            Ok(Vec::new())
        } else {
            pve.backups(req.node, backup_sid, None).await
        }
    };
    let extracted = async {
        if backup_sid.is_empty() {
            None
        } else {
            Some(pve.extract_config(req.node, req.volid).await)
        }
    };
    let (listing, storage, pool, extracted) = tokio::join!(
        listing,
        pve.storage_status(req.node, req.storage),
        pve.pool(req.pool),
        extracted
    );
    let listed = listing
        .as_ref()
        .is_ok_and(|l| l.iter().any(|v| v.volid == req.volid));
    // The stored configuration only of a backup the token can see: PVE can tell what the
    // restore would recover before anything is created.
    let stored = if listed { extracted } else { None };
    let owner = listing
        .as_ref()
        .ok()
        .and_then(|l| l.iter().find(|v| v.volid == req.volid))
        .and_then(|v| v.vmid)
        .and_then(|v| u32::try_from(v).ok())
        .or_else(|| owner_from_volid(req.volid));
    let stored_cfg = match &stored {
        Some(Ok(text)) => Some(StoredConfig::parse(text)),
        _ => None,
    };
    // What the restore needs beyond the request: the token's privileges on the paths PVE
    // checks inside the task, and the cluster's files.
    let files = req.cluster_files;
    let asked = Asked {
        node: req.node,
        guest: req.guest,
        volid: req.volid,
        vmid: req.vmid,
        owner,
        isolate: req.isolate,
        lab_bridge: req.lab_bridge,
        token_id: req.token_id,
    };
    let held = Held::read(pve, &paths_needed(stored_cfg.as_ref(), &asked, files)).await;
    let carried = match &stored {
        Some(Ok(text)) => Some(StoredConfigText {
            volid: req.volid.to_string(),
            text: text.clone(),
        }),
        _ => None,
    };
    // A backup the listing does not show is `backup_missing` whatever the token holds: PVE's
    // listing (pve-storage `PVE::API2::Storage::Content` index) drops each volume that
    // `PVE::Storage::check_volume_access` refuses, so "not listed" is "absent or not readable
    // by this token", and the backup check says both.
    let unlisted = listing.as_ref().is_ok_and(|_| !listed);
    if unlisted {
        checks.push(PreflightCheck::skipped(
            "backup_access",
            format!("{} is not listed for this token (see backup)", req.volid),
        ));
    } else {
        checks.push(access_check(&asked, &held));
    }
    checks.push(backup_verdict(req, listing, stored));
    match &stored_cfg {
        Some(sc) => {
            checks.push(contents_check(sc, &asked, &held));
            checks.push(network_check(sc, &asked, files, &held));
            if let Some(lab) = asked.lab_for(sc) {
                checks.push(restorable::lab_bridge_check(pve, req.node, lab).await);
            }
        }
        None => {
            for name in ["contents", "network"] {
                checks.push(PreflightCheck::skipped(
                    name,
                    "the backup's stored configuration was not read",
                ));
            }
        }
    }
    checks.push(tags_check(files, &held, Marker::FLEET_TAG, req.token_id));
    let avail = storage.as_ref().ok().and_then(|s| s.avail);
    checks.push(storage_verdict(req, storage));
    match &stored_cfg {
        Some(sc) => checks.push(space_check(sc, &asked, req.storage, avail)),
        None => checks.push(PreflightCheck::skipped(
            "space",
            "the backup's stored configuration was not read",
        )),
    }
    checks.push(pool_verdict(req, pool));
    checks.push(profile_check(req));
    checks.push(checks_check(req));
    let space = match (&stored_cfg, avail) {
        (Some(sc), Some(avail)) => Some((
            sc.allocated_disks(asked.guest)
                .iter()
                .filter_map(|(_, s)| *s)
                .fold(0, u64::saturating_add),
            avail,
        )),
        _ => None,
    };
    PreflightReport {
        stored_config: carried,
        space,
        ..PreflightReport::from_checks(checks)
    }
}

// ----- glue for the transaction commands (selftest, restore test, hub dispatch) -----------

/// The preflight of a provision or restore-test request; `first` is its vmid verdict.
pub async fn for_request(
    cfg: &Config,
    pve: &PveClient,
    request: &Request,
    first: &Event,
) -> PreflightReport {
    let vmid = match first {
        Event::VmidRefused(f) => PreflightCheck::vmid(Err(f.clone())),
        Event::BandFull { message } => PreflightCheck::skipped("vmid", message.clone()),
        _ => PreflightCheck::vmid(Ok(format!(
            "vmid {} is free in the full guest list ({})",
            request.vmid.map_or("-".to_string(), |v| v.to_string()),
            cfg.vmlist_path.display()
        ))),
    };
    let restore = request.kind == TxnKind::SelftestRestore;
    let profile = if restore {
        None
    } else {
        Some(request.profile.as_deref().unwrap_or(DEFAULT_PROFILE))
    };
    let cluster_files = read_cluster_files(cfg);
    let req = PreflightRequest {
        node: &cfg.node,
        pool: &request.pool,
        guest: request.guest,
        volid: &request.volid,
        storage: &request.storage,
        profile,
        bootstrap_dir: &cfg.provision.bootstrap_dir,
        checks_dir: if restore {
            &cfg.restore_test.checks_dir
        } else {
            &cfg.provision.checks_dir
        },
        policy: &cfg.policy,
        config_path: &cfg.path,
        vmid: request.vmid,
        isolate: request.isolate_network,
        lab_bridge: request
            .lab_bridge
            .as_deref()
            .or_else(|| cfg.restore_test.lab_bridge()),
        token_id: &cfg.pve.token_id,
        cluster_files: &cluster_files,
    };
    let (report, helper) = tokio::join!(run(pve, &req, vmid), helper_check(cfg, request.guest));
    let mut checks = report.checks;
    checks.push(state_dir_space(&cfg.state_dir));
    checks.push(helper);
    PreflightReport {
        stored_config: report.stored_config,
        space: report.space,
        ..PreflightReport::from_checks(checks)
    }
}

/// The least free space the state folder must have before a transaction starts: room for
/// its journal records (at most 64 KiB each), the outbox's events and the metrics, with a
/// margin for the transactions of the daemon running beside it.
pub const STATE_DIR_MIN_FREE_BYTES: u64 = 64 * 1024 * 1024;

/// Free space in the state folder (`statvfs`, the blocks an unprivileged writer may use): a
/// journal that cannot be written stops a transaction between two PVE writes, so a nearly
/// full disk refuses it before the first (`state_dir_full`, exit 6). A folder that does not
/// exist yet is measured where it will be made.
pub fn state_dir_space(state_dir: &Path) -> PreflightCheck {
    let name = "state_space";
    let at = state_dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    match nix::sys::statvfs::statvfs(at) {
        Ok(st) => {
            let free = st.blocks_available().saturating_mul(st.fragment_size());
            if free < STATE_DIR_MIN_FREE_BYTES {
                PreflightCheck::fail(
                    name,
                    ErrorCode::StateDirFull,
                    format!(
                        "the state folder {} has {free} bytes free, less than the {} MiB a transaction's journal and outbox need; free space on its file system (`df -h {}`), then run the command again; nothing was written",
                        state_dir.display(),
                        STATE_DIR_MIN_FREE_BYTES >> 20,
                        at.display()
                    ),
                )
            } else {
                PreflightCheck::pass(
                    name,
                    format!("{} has {} MiB free", state_dir.display(), free >> 20),
                )
            }
        }
        Err(e) => PreflightCheck::fail(
            name,
            ErrorCode::StateDirFull,
            format!(
                "the free space of the state folder {} cannot be read ({e}); check that it is mounted and readable",
                state_dir.display()
            ),
        ),
    }
}

/// [`state_dir_space`] as the guard of a command that writes: `Err(state_dir_full)` before
/// anything is written.
pub fn require_state_dir_space(state_dir: &Path) -> Result<(), Failure> {
    match state_dir_space(state_dir).failure() {
        Some(f) => Err(f),
        None => Ok(()),
    }
}

/// A container's commands go through the root exec helper when the agent is not root (or
/// `[exec] helper_socket` says so): one that does not answer now would fail the run only
/// after the whole restore, so it is asked before the first write (`exec_helper_unavailable`,
/// exit 6). A VM's commands go through PVE's guest agent and need no helper.
pub async fn helper_check(cfg: &Config, guest: GuestKind) -> PreflightCheck {
    use crate::exec_helper::client::{probe, ExecMode};
    let name = "exec_helper";
    if guest != GuestKind::Lxc {
        return PreflightCheck::skipped(name, "a VM's commands go through its guest agent");
    }
    let mode = ExecMode::of_process(cfg);
    match &mode {
        ExecMode::Direct => PreflightCheck::pass(name, mode.describe()),
        ExecMode::Helper { socket, .. } => match probe(socket).await {
            Ok(()) => PreflightCheck::pass(name, format!("{}; it answers", mode.describe())),
            Err(e) => PreflightCheck::fail(
                name,
                ErrorCode::ExecHelperUnavailable,
                format!(
                    "container commands go {}, but it does not answer: {e}; start it (`systemctl start felhom-agent-exec.socket`; `systemctl enable --now felhom-agent-exec.socket` keeps it across boots) and run the command again; nothing was written",
                    mode.describe()
                ),
            ),
        },
    }
}

/// The preflight of `request` as the gate before its first journal intent: a refusal turns
/// the first event (the vmid verdict) into a refusal with the preflight's code; otherwise the
/// event is unchanged.
pub async fn gate(
    cfg: &Config,
    pve: &PveClient,
    request: &Request,
    first: Event,
) -> (PreflightReport, Event) {
    let report = for_request(cfg, pve, request, &first).await;
    let first = match report.failure() {
        Some(f) if matches!(first, Event::VmidAccepted) => Event::VmidRefused(f.clone()),
        _ => first,
    };
    (report, first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pve::error::decode_error;
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    const VOLID: &str = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst";

    struct Dirs {
        _tmp: tempfile::TempDir,
        bootstrap: PathBuf,
        checks: PathBuf,
    }

    fn dirs() -> Dirs {
        let tmp = tempfile::tempdir().expect("tmp");
        let bootstrap = tmp.path().join("bootstrap.d");
        let checks = tmp.path().join("checks.d");
        std::fs::create_dir_all(bootstrap.join("default")).expect("mkdir");
        std::fs::create_dir_all(&checks).expect("mkdir");
        let run = bootstrap.join("default/run");
        std::fs::write(&run, "#!/bin/sh\nexit 0\n").expect("write run");
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::write(
            checks.join("default.toml"),
            "[[check]]\nname = \"h\"\nsql = \"SELECT hostname FROM system_info\"\nexpect = \"hostname == 'ct-{vmid}.{node}.{txn}'\"\n",
        )
        .expect("write pack");
        Dirs {
            _tmp: tmp,
            bootstrap,
            checks,
        }
    }

    /// No `datacenter.cfg`, no SDN vnet.
    static NO_CLUSTER_FILES: ClusterFiles = ClusterFiles {
        datacenter: None,
        vnet_zones: std::collections::BTreeMap::new(),
    };

    fn request<'a>(d: &'a Dirs, policy: &'a Policy) -> PreflightRequest<'a> {
        PreflightRequest {
            node: "pve1",
            pool: "felhom",
            guest: GuestKind::Lxc,
            volid: VOLID,
            storage: "local-lvm",
            profile: Some("default"),
            bootstrap_dir: &d.bootstrap,
            checks_dir: &d.checks,
            policy,
            config_path: Path::new("/etc/felhom-agent/agent.toml"),
            vmid: Some(120),
            isolate: false,
            lab_bridge: None,
            token_id: "felhom@pve!agent",
            cluster_files: &NO_CLUSTER_FILES,
        }
    }

    fn api(status: u16, message: &str) -> PveError {
        PveError::Api(decode_error(
            "GET",
            "/nodes/pve1/storage/x/status",
            status,
            Some(message),
            b"",
        ))
    }

    fn vol(volid: &str, subtype: Option<&str>, format: &str) -> BackupVolume {
        BackupVolume {
            volid: volid.to_string(),
            vmid: Some(200),
            ctime: Some(1),
            size: Some(10),
            subtype: subtype.map(str::to_string),
            format: Some(format.to_string()),
            notes: None,
        }
    }

    fn lvm() -> StorageStatus {
        StorageStatus {
            kind: Some("lvmthin".into()),
            content: "images,rootdir".into(),
            enabled: true,
            active: true,
            avail: Some(1),
        }
    }

    #[test]
    fn local_checks_pass_on_a_good_request() {
        let d = dirs();
        let p = Policy::default();
        let r = request(&d, &p);
        assert_eq!(policy_check(&r).status, CheckVerdict::Pass);
        assert_eq!(
            profile_check(&r).status,
            CheckVerdict::Pass,
            "{:?}",
            profile_check(&r)
        );
        assert_eq!(
            checks_check(&r).status,
            CheckVerdict::Pass,
            "{:?}",
            checks_check(&r)
        );
    }

    #[test]
    fn hostile_or_missing_profiles_are_profile_invalid() {
        let d = dirs();
        let p = Policy::default();
        for name in ["../../../../etc", "nope", "", "a/b"] {
            let mut r = request(&d, &p);
            r.profile = Some(name);
            let c = profile_check(&r);
            assert_eq!(c.code, Some(ErrorCode::ProfileInvalid), "{name:?}: {c:?}");
        }
        let mut r = request(&d, &p);
        r.profile = None;
        assert_eq!(profile_check(&r).status, CheckVerdict::Skipped);
    }

    #[test]
    fn a_broken_pack_or_unknown_placeholder_is_checks_invalid() {
        let d = dirs();
        let p = Policy::default();
        std::fs::write(d.checks.join("zz.toml"), "[[check]\nname=").expect("write");
        let c = checks_check(&request(&d, &p));
        assert_eq!(c.code, Some(ErrorCode::ChecksInvalid), "{c:?}");
        assert!(c.message.contains("zz.toml"), "{c:?}");
        std::fs::write(
            d.checks.join("zz.toml"),
            "[[check]]\nname = \"x\"\nsql = \"SELECT 1\"\nexpect = \"v == '{colour}'\"\n",
        )
        .expect("write");
        let c = checks_check(&request(&d, &p));
        assert_eq!(c.code, Some(ErrorCode::ChecksInvalid), "{c:?}");
        assert!(c.message.contains("colour"), "{c:?}");
    }

    #[test]
    fn policy_names_every_thing_outside_it() {
        let d = dirs();
        let p = Policy {
            storages: Some(vec!["fast".into()]),
            sources: Some(vec!["nfs:backup/*".into()]),
            profiles: Some(vec!["web".into()]),
        };
        let c = policy_check(&request(&d, &p));
        assert_eq!(c.code, Some(ErrorCode::PolicyDenied));
        for word in ["local-lvm", VOLID, "\"default\"", "agent.toml"] {
            assert!(c.message.contains(word), "{word}: {}", c.message);
        }
        let ok = Policy {
            storages: Some(vec!["local-lvm".into()]),
            sources: Some(vec!["local:backup/vzdump-*".into()]),
            profiles: Some(vec!["default".into()]),
        };
        assert_eq!(policy_check(&request(&d, &ok)).status, CheckVerdict::Pass);
    }

    #[test]
    fn backup_listed_of_the_right_kind_passes_and_says_what_it_found() {
        let d = dirs();
        let p = Policy::default();
        let r = request(&d, &p);
        let c = backup_verdict(
            &r,
            Ok(vec![vol(VOLID, Some("lxc"), "tar.zst")]),
            Some(Ok("arch: amd64\nhostname: web1\nostype: debian\nrootfs: local-lvm:vm-200-disk-0,size=8G\n".into())),
        );
        assert_eq!(c.status, CheckVerdict::Pass, "{c:?}");
        assert!(
            c.message.contains("name \"web1\"") && c.message.contains("debian"),
            "{c:?}"
        );
        let c = backup_verdict(
            &r,
            Ok(vec![vol(VOLID, None, "tar.zst")]),
            Some(Err(api(403, "Permission check failed"))),
        );
        // Without the stored config nothing tells what the restore brings along: refused.
        assert_eq!(c.code, Some(ErrorCode::BackupMissing), "{c:?}");
        assert!(c.message.contains("could not be read"), "{c:?}");
    }

    type Listing = Result<Vec<BackupVolume>, PveError>;
    type Stored = Option<Result<String, PveError>>;

    #[test]
    fn backup_missing_unreadable_or_of_the_wrong_kind_is_backup_missing() {
        let d = dirs();
        let p = Policy::default();
        let r = request(&d, &p);
        let other = "local:backup/vzdump-lxc-201-2026_01_01-00_00_00.tar.zst";
        let cases: Vec<(Listing, Stored, &str)> = vec![
            (Ok(vec![vol(other, None, "tar.zst")]), None, "does not exist"),
            (Err(api(403, "Permission check failed (/storage/local, Datastore.Audit|Datastore.AllocateSpace)")), None, "cannot be listed"),
            (Err(api(500, "storage 'local' does not exist")), None, "cannot be listed"),
            (Ok(vec![vol(VOLID, Some("qemu"), "tar.zst")]), None, "VM (qemu)"),
            (Ok(vec![vol(VOLID, None, "vma.zst")]), None, "VM (qemu)"),
            (Ok(vec![vol(VOLID, None, "tar.zst")]), Some(Ok("bootdisk: scsi0\nscsi0: local-lvm:vm-1-disk-0\n".into())), "stored"),
        ];
        for (listing, stored, word) in cases {
            let c = backup_verdict(&r, listing, stored);
            assert_eq!(c.code, Some(ErrorCode::BackupMissing), "{c:?}");
            assert!(c.message.contains(word), "{word}: {}", c.message);
        }
        let mut bad = request(&d, &p);
        bad.volid = "vzdump.tar";
        assert_eq!(
            backup_verdict(&bad, Ok(vec![]), None).code,
            Some(ErrorCode::BackupMissing)
        );
    }

    #[test]
    fn storage_missing_disabled_inactive_or_without_content_is_storage_invalid() {
        let d = dirs();
        let p = Policy::default();
        let r = request(&d, &p);
        assert_eq!(storage_verdict(&r, Ok(lvm())).status, CheckVerdict::Pass);
        let dir = StorageStatus {
            content: "iso,vztmpl,backup".into(),
            ..lvm()
        };
        let off = StorageStatus {
            enabled: false,
            ..lvm()
        };
        let down = StorageStatus {
            active: false,
            ..lvm()
        };
        for (st, word) in [
            (Ok(dir), "needs \"rootdir\""),
            (Ok(off), "disabled"),
            (Ok(down), "not active"),
            (Err(api(500, "storage 'nosuchstore' does not exist")), "does not exist"),
            (Err(api(400, "Parameter verification failed.")), "does not exist"),
            (Err(api(403, "Permission check failed (/storage/nosuchstore, Datastore.Audit|Datastore.AllocateSpace)")), "may not use it"),
        ] {
            let c = storage_verdict(&r, st);
            assert_eq!(c.code, Some(ErrorCode::StorageInvalid), "{c:?}");
            assert!(c.message.contains(word), "{word}: {}", c.message);
        }
        let mut vm = request(&d, &p);
        vm.guest = GuestKind::Qemu;
        let rootdir_only = StorageStatus {
            content: "rootdir".into(),
            ..lvm()
        };
        let c = storage_verdict(&vm, Ok(rootdir_only));
        assert!(c.message.contains("needs \"images\""), "{c:?}");
    }

    #[test]
    fn no_answer_is_not_a_refusal_of_the_request() {
        let d = dirs();
        let p = Policy::default();
        let r = request(&d, &p);
        let c = storage_verdict(&r, Err(api(595, "No route to host")));
        assert_eq!(c.code, Some(ErrorCode::PveUnreachable), "{c:?}");
        let c = pool_verdict(&r, Err(api(401, "Authentication failed!")));
        assert_eq!(c.code, Some(ErrorCode::PveAuth), "{c:?}");
        let c = pool_verdict(&r, Err(api(500, "pool 'felhom' does not exist")));
        assert_eq!(c.code, Some(ErrorCode::PoolMissing), "{c:?}");
        assert!(c.message.contains("pveum pool add felhom"), "{c:?}");
    }

    #[test]
    fn the_first_failing_check_is_the_verdict() {
        let report = PreflightReport::from_checks(vec![
            PreflightCheck::vmid(Ok("free".into())),
            PreflightCheck::pass("policy", "ok"),
            PreflightCheck::fail("storage", ErrorCode::StorageInvalid, "no such storage"),
            PreflightCheck::fail("checks", ErrorCode::ChecksInvalid, "bad pack"),
        ]);
        let f = report.failure().expect("refused");
        assert_eq!(f.code, ErrorCode::StorageInvalid);
        let j = report.to_json();
        assert_eq!(j["verdict"], "refused");
        assert_eq!(j["error"]["code"], "storage_invalid");
        assert_eq!(j["checks"][2]["status"], "fail");
        assert!(
            report
                .human()
                .contains("storage  fail    [storage_invalid] no such storage"),
            "{}",
            report.human()
        );
        let ok = PreflightReport::from_checks(vec![PreflightCheck::pass("vmid", "free")]);
        assert_eq!(ok.verdict, Verdict::Pass);
        assert_eq!(ok.to_json()["verdict"], "pass");
    }
}
