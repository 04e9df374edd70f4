//! Bootstrap profiles: `bootstrap.d/<profile>/run` (executable) plus an optional `files/` tree,
//! pushed into the guest under `/var/lib/felhom/bootstrap/<txn>/` and run there once per
//! transaction with a timeout and `FELHOM_TXN`, `FELHOM_VMID`, `FELHOM_PROFILE` set.
//!
//! The outcome (exit status, bounded output, time) is recorded in the guest in
//! `/var/lib/felhom/bootstrap.json`. A re-run of the same transaction finds that marker and
//! returns the recorded outcome without running anything; a marker of another transaction (a
//! guest restored from a backup of a bootstrapped guest) is replaced. The pushed payload is
//! removed after the run; the marker stays. Scripts should still be idempotent: a crash between
//! the run and the marker write makes the next attempt run the profile again.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::exec::{ExecError, ExecOutcome, ExecRequest, GuestExec, GuestExit};
use crate::error::ErrorCode;

/// The agent's directory inside a guest.
pub const GUEST_STATE_DIR: &str = "/var/lib/felhom";
/// The marker that records a transaction's bootstrap inside the guest.
pub const MARKER_PATH: &str = "/var/lib/felhom/bootstrap.json";
/// Where profiles are pushed inside the guest (one folder per transaction).
pub const GUEST_BOOTSTRAP_ROOT: &str = "/var/lib/felhom/bootstrap";
/// The marker format version.
pub const MARKER_VERSION: u32 = 1;
/// At most this many files in a profile.
pub const MAX_PROFILE_FILES: usize = 1000;
/// At most this many bytes in a profile.
pub const MAX_PROFILE_BYTES: u64 = 64 * 1024 * 1024;
/// Largest marker read back.
const MARKER_CAP: usize = 1024 * 1024;

/// How a profile is run.
#[derive(Debug, Clone)]
pub struct BootstrapSettings {
    /// How long `run` may take.
    pub timeout: Duration,
    /// Bytes of stdout and of stderr kept (in the report and the marker).
    pub output_cap: usize,
    /// Time allowed for each preparation step (mkdir, marker read and write, cleanup).
    pub step_timeout: Duration,
}

impl Default for BootstrapSettings {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(600),
            output_cap: 32 * 1024,
            step_timeout: Duration::from_secs(60),
        }
    }
}

/// One file of a profile's `files/` tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileFile {
    /// Its path below `files/`, `/`-separated.
    pub relative: String,
    /// Its path on the node.
    pub local: PathBuf,
    /// Its permission bits (kept in the guest).
    pub mode: u32,
}

/// A bootstrap profile read from `bootstrap.d/<name>/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapProfile {
    /// The profile's name.
    pub name: String,
    /// Its folder.
    pub dir: PathBuf,
    /// Its `run` script.
    pub run: PathBuf,
    /// The folders below `files/` (created in the guest, also when empty).
    pub dirs: Vec<String>,
    /// The files below `files/`.
    pub files: Vec<ProfileFile>,
}

/// How the profile's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BootstrapStatus {
    /// `run` exited 0.
    Ok,
    /// `run` exited non-zero or was killed by a signal.
    Failed,
    /// `run` ran past the timeout and was killed.
    TimedOut,
}

/// The recorded outcome of one run: exit status and bounded output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "OutcomeRecord")]
pub struct BootstrapOutcome {
    /// ok, failed or timed_out.
    pub status: BootstrapStatus,
    /// The exit status, when it exited.
    pub exit_code: Option<i64>,
    /// The signal, when it was killed by one.
    pub signal: Option<i32>,
    /// stdout, at most the output cap (invalid UTF-8 replaced).
    pub stdout: String,
    /// stdout was longer than the cap.
    pub stdout_truncated: bool,
    /// stderr, at most the output cap.
    pub stderr: String,
    /// stderr was longer than the cap.
    pub stderr_truncated: bool,
    /// Run time in milliseconds.
    pub duration_ms: u64,
}

/// An outcome as a marker holds it: the output as text (`stdout`, `stderr`), or as the guest's
/// own run writes it, base64 (`stdout_b64`, `stderr_b64`: a shell cannot escape JSON).
#[derive(Deserialize)]
struct OutcomeRecord {
    status: BootstrapStatus,
    exit_code: Option<i64>,
    signal: Option<i32>,
    #[serde(default)]
    stdout: String,
    #[serde(default)]
    stdout_b64: Option<String>,
    stdout_truncated: bool,
    #[serde(default)]
    stderr: String,
    #[serde(default)]
    stderr_b64: Option<String>,
    stderr_truncated: bool,
    duration_ms: u64,
}

impl From<OutcomeRecord> for BootstrapOutcome {
    fn from(r: OutcomeRecord) -> Self {
        use base64::Engine as _;
        let text = |plain: String, b64: Option<String>| match b64 {
            Some(b) => base64::engine::general_purpose::STANDARD
                .decode(b.trim())
                .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
                .unwrap_or_default(),
            None => plain,
        };
        Self {
            status: r.status,
            exit_code: r.exit_code,
            signal: r.signal,
            stdout: text(r.stdout, r.stdout_b64),
            stdout_truncated: r.stdout_truncated,
            stderr: text(r.stderr, r.stderr_b64),
            stderr_truncated: r.stderr_truncated,
            duration_ms: r.duration_ms,
        }
    }
}

impl BootstrapOutcome {
    /// The outcome of a run.
    pub fn from_exec(outcome: &ExecOutcome) -> Self {
        let (status, exit_code, signal) = match outcome.exit {
            GuestExit::Exited(0) => (BootstrapStatus::Ok, Some(0), None),
            GuestExit::Exited(code) => (BootstrapStatus::Failed, Some(code), None),
            GuestExit::Signaled(sig) => (BootstrapStatus::Failed, None, Some(sig)),
            GuestExit::TimedOut => (BootstrapStatus::TimedOut, None, None),
        };
        Self {
            status,
            exit_code,
            signal,
            stdout: outcome.stdout.text().into_owned(),
            stdout_truncated: outcome.stdout.truncated,
            stderr: outcome.stderr.text().into_owned(),
            stderr_truncated: outcome.stderr.truncated,
            duration_ms: u64::try_from(outcome.duration.as_millis()).unwrap_or(u64::MAX),
        }
    }

    fn describe(&self) -> String {
        match (self.status, self.exit_code, self.signal) {
            (BootstrapStatus::Ok, _, _) => "it succeeded".to_owned(),
            (BootstrapStatus::TimedOut, _, _) => {
                format!("it timed out after {} ms", self.duration_ms)
            }
            (BootstrapStatus::Failed, Some(code), _) => format!("it exited with status {code}"),
            (BootstrapStatus::Failed, None, Some(sig)) => format!("it was killed by signal {sig}"),
            (BootstrapStatus::Failed, None, None) => "it failed".to_owned(),
        }
    }
}

/// The marker in the guest (`/var/lib/felhom/bootstrap.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootstrapMarker {
    /// Format version ([`MARKER_VERSION`]).
    pub version: u32,
    /// The transaction that ran the profile.
    pub txn: String,
    /// The profile.
    pub profile: String,
    /// The guest.
    pub vmid: u32,
    /// When the run ended, UTC RFC 3339.
    pub time: String,
    /// How it ended.
    pub outcome: BootstrapOutcome,
}

/// The result of [`run_bootstrap`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BootstrapReport {
    /// What was recorded in the guest.
    #[serde(flatten)]
    pub marker: BootstrapMarker,
    /// True when the marker of this transaction was found and nothing ran.
    pub reused: bool,
}

impl BootstrapReport {
    /// True when the profile's run exited 0.
    pub fn succeeded(&self) -> bool {
        self.marker.outcome.status == BootstrapStatus::Ok
    }

    /// `Ok(self)` when the run succeeded, else the operator-facing error.
    pub fn into_result(self) -> Result<Self, BootstrapError> {
        if self.succeeded() {
            return Ok(self);
        }
        Err(BootstrapError::Failed {
            vmid: self.marker.vmid,
            txn: self.marker.txn.clone(),
            profile: self.marker.profile.clone(),
            what: self.marker.outcome.describe(),
        })
    }
}

/// Why a bootstrap could not be run, or that it failed.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    /// The profile name cannot name a folder.
    #[error("bootstrap profile name {name:?} is invalid; use letters, digits, '.', '_' and '-'")]
    InvalidProfileName {
        /// The name.
        name: String,
    },
    /// The profile has no `run`.
    #[error("bootstrap profile {profile:?} has no run script at {path}; create it (executable) or pick another profile")]
    ProfileMissing {
        /// The profile.
        profile: String,
        /// Where `run` was looked for.
        path: PathBuf,
    },
    /// `run` is not an executable regular file.
    #[error("{path} is not an executable regular file; chmod +x it")]
    RunNotExecutable {
        /// The script.
        path: PathBuf,
    },
    /// Something in `files/` is not a regular file or folder.
    #[error("{path} in bootstrap profile {profile:?} is not a regular file or folder (symlinks and special files are not pushed); replace it")]
    UnsupportedEntry {
        /// The profile.
        profile: String,
        /// The entry.
        path: PathBuf,
    },
    /// The profile is larger than the limits.
    #[error("bootstrap profile {profile:?} is too large ({reason}); keep it under {MAX_PROFILE_FILES} files and {MAX_PROFILE_BYTES} bytes")]
    ProfileTooLarge {
        /// The profile.
        profile: String,
        /// Which limit.
        reason: String,
    },
    /// Reading the profile failed.
    #[error("could not read {path} of a bootstrap profile: {source}")]
    ProfileIo {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The folder or a file of the profile may be changed by someone other than root.
    #[error("bootstrap profile {profile:?} is not trusted: {reason}; a profile runs as root in the guest")]
    Untrusted {
        /// The profile.
        profile: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The transaction id cannot name a folder in the guest.
    #[error("transaction id {txn:?} cannot be used for a bootstrap (letters, digits, '_' and '-', at most 64)")]
    InvalidTxn {
        /// The id.
        txn: String,
    },
    /// A command in the guest could not be run.
    #[error("bootstrap in guest {vmid}: {source}")]
    Exec {
        /// The guest.
        vmid: u32,
        /// Why.
        #[source]
        source: ExecError,
    },
    /// A preparation step ran and failed.
    #[error("bootstrap step '{step}' failed in guest {vmid}: {detail}")]
    Step {
        /// The guest.
        vmid: u32,
        /// Which step.
        step: &'static str,
        /// How it ended.
        detail: String,
    },
    /// The profile ran and did not succeed.
    #[error("bootstrap profile {profile:?} failed in guest {vmid} for transaction {txn}: {what}; its output is in the report and in {MARKER_PATH} inside the guest")]
    Failed {
        /// The guest.
        vmid: u32,
        /// The transaction.
        txn: String,
        /// The profile.
        profile: String,
        /// How it ended.
        what: String,
    },
}

impl BootstrapError {
    /// The stable code.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::InvalidProfileName { .. }
            | Self::ProfileMissing { .. }
            | Self::RunNotExecutable { .. }
            | Self::UnsupportedEntry { .. }
            | Self::ProfileTooLarge { .. }
            | Self::Untrusted { .. }
            | Self::ProfileIo { .. } => ErrorCode::ConfigInvalid,
            Self::Exec { source, .. } if source.guest_down() => ErrorCode::LaunchUnproven,
            Self::Exec { .. }
            | Self::InvalidTxn { .. }
            | Self::Step { .. }
            | Self::Failed { .. } => ErrorCode::BootstrapFailed,
        }
    }
}

fn valid_profile_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

fn valid_txn(txn: &str) -> bool {
    !txn.is_empty()
        && txn.len() <= 64
        && txn
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))
}

/// Read profile `name` from `bootstrap_dir/<name>/`.
pub fn load_profile(bootstrap_dir: &Path, name: &str) -> Result<BootstrapProfile, BootstrapError> {
    if !valid_profile_name(name) {
        return Err(BootstrapError::InvalidProfileName {
            name: name.to_owned(),
        });
    }
    let untrusted = |reason: String| BootstrapError::Untrusted {
        profile: name.to_owned(),
        reason,
    };
    crate::config::check_trusted_dir(bootstrap_dir, "bootstrap_dir").map_err(untrusted)?;
    let dir = bootstrap_dir.join(name);
    if dir.is_dir() {
        crate::config::check_trusted_dir(&dir, "bootstrap profile folder").map_err(untrusted)?;
    }
    let run = dir.join("run");
    let meta = match fs::metadata(&run) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(BootstrapError::ProfileMissing {
                profile: name.to_owned(),
                path: run,
            })
        }
        Err(source) => return Err(BootstrapError::ProfileIo { path: run, source }),
    };
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(BootstrapError::RunNotExecutable { path: run });
    }
    if let Some(why) = crate::config::untrusted_reason(&run, &meta, "run script") {
        return Err(untrusted(why));
    }
    let mut profile = BootstrapProfile {
        name: name.to_owned(),
        dir: dir.clone(),
        run,
        dirs: Vec::new(),
        files: Vec::new(),
    };
    let files_dir = dir.join("files");
    match fs::symlink_metadata(&files_dir) {
        Ok(m) if m.is_dir() => {
            let mut total = meta.len();
            walk_files(&files_dir, "", &mut profile, &mut total)?;
        }
        Ok(_) => {
            return Err(BootstrapError::UnsupportedEntry {
                profile: name.to_owned(),
                path: files_dir,
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(BootstrapError::ProfileIo {
                path: files_dir,
                source,
            })
        }
    }
    Ok(profile)
}

fn walk_files(
    dir: &Path,
    prefix: &str,
    profile: &mut BootstrapProfile,
    total: &mut u64,
) -> Result<(), BootstrapError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| BootstrapError::ProfileIo { path, source }
    };
    let mut entries: Vec<_> = fs::read_dir(dir)
        .map_err(io(dir))?
        .collect::<Result<_, _>>()
        .map_err(io(dir))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let unsupported = || BootstrapError::UnsupportedEntry {
            profile: profile.name.clone(),
            path: path.clone(),
        };
        let name = entry.file_name();
        let name = name.to_str().ok_or_else(unsupported)?;
        if name.contains('\n') {
            return Err(unsupported());
        }
        let relative = if prefix.is_empty() {
            name.to_owned()
        } else {
            format!("{prefix}/{name}")
        };
        let meta = fs::symlink_metadata(&path).map_err(io(&path))?;
        let checked = meta.is_dir() || meta.is_file();
        if let Some(reason) = checked
            .then(|| crate::config::untrusted_reason(&path, &meta, "profile entry"))
            .flatten()
        {
            return Err(BootstrapError::Untrusted {
                profile: profile.name.clone(),
                reason,
            });
        }
        if meta.is_dir() {
            profile.dirs.push(relative.clone());
            walk_files(&path, &relative, profile, total)?;
        } else if meta.is_file() {
            *total += meta.len();
            if profile.files.len() + 1 > MAX_PROFILE_FILES || *total > MAX_PROFILE_BYTES {
                return Err(BootstrapError::ProfileTooLarge {
                    profile: profile.name.clone(),
                    reason: format!("{} files, {} bytes so far", profile.files.len() + 1, *total),
                });
            }
            profile.files.push(ProfileFile {
                relative,
                local: path.clone(),
                mode: meta.permissions().mode() & 0o777,
            });
        } else {
            return Err(unsupported());
        }
    }
    Ok(())
}

/// The bootstrap in one exec (`/bin/sh -c <this> felhom-bootstrap BASE MARKER TXN VMID PROFILE
/// CAP SECS NDIRS DIR… [MODE SIZE SHA256 PATH]…`, the files on stdin, each a `felhom-file` line
/// and its bytes in base64). When the marker names this transaction: `felhom-reused`, the
/// marker as a frame, nothing run. Otherwise BASE is made anew (private), its folders made, each
/// file decoded to BASE/PATH and checked (size, and SHA-256 where the guest has `sha256sum`),
/// `./run` run in BASE (its own session where the guest has `setsid`; killed with what it
/// started after SECS), the marker written (the output base64, at most CAP bytes each) and
/// renamed into place, `felhom-ran` and the marker as a frame, BASE removed. Exit 5: BASE could
/// not be made; 6: a file did not arrive whole (`felhom-badfile <n>`, `felhom-nobase64`); 7: the
/// marker could not be written.
const RUN_SCRIPT: &str = r#"
base=$1 m=$2 txn=$3 vmid=$4 profile=$5 cap=$6 secs=$7 nd=$8; shift 8
if [ -f "$m" ] && grep -q "\"txn\":\"$txn\"" "$m" 2>/dev/null; then
  echo felhom-reused; felhom_frame marker "$m" 1048576; rm -f "$m.kept"; rm -rf "$base"; exit 0
fi
umask 077
rm -rf "$base" && mkdir -p "$base/files" || exit 5
while [ "$nd" -gt 0 ]; do mkdir -p "$base/files/$1" || exit 5; shift; nd=$((nd-1)); done
command -v base64 >/dev/null 2>&1 || { echo felhom-nobase64; exit 6; }
awk -v d="$base" '$0 == "felhom-file" { if (o) close(o); n++; o = d "/.in" n; printf "" > o; next } o { print > o } END { if (o) close(o) }' || exit 5
n=0
while [ $# -ge 4 ]; do
  n=$((n+1)); t="$base/$4"
  [ -f "$base/.in$n" ] && base64 -d <"$base/.in$n" >"$t" 2>/dev/null || { echo "felhom-badfile $n"; exit 6; }
  rm -f "$base/.in$n"
  [ "$(($(wc -c <"$t")))" = "$2" ] || { echo "felhom-badfile $n"; exit 6; }
  if command -v sha256sum >/dev/null 2>&1; then
    [ "$(sha256sum "$t" | cut -d' ' -f1)" = "$3" ] || { echo "felhom-badfile $n"; exit 6; }
  fi
  chmod "$1" "$t" || { echo "felhom-badfile $n"; exit 6; }
  shift 4
done
cd "$base" || exit 5
export FELHOM_TXN="$txn" FELHOM_VMID="$vmid" FELHOM_PROFILE="$profile" FELHOM_BOOTSTRAP_DIR="$base" FELHOM_FILES_DIR="$base/files"
o=$(mktemp "${TMPDIR:-/tmp}/felhom-bootstrap.XXXXXX" 2>/dev/null) || o="$base/.out"
e=$(mktemp "${TMPDIR:-/tmp}/felhom-bootstrap.XXXXXX" 2>/dev/null) || e="$base/.err"
k="$o.killed"
t0=$(felhom_ms)
felhom_watched "$secs" "$o" "$e" "$k" ./run
rc=$felhom_rc
ms=$(( $(felhom_ms) - t0 ))
code=null sig=null
if [ -e "$k" ] && [ "$rc" = 137 ]; then st=timed_out
elif [ "$rc" = 0 ]; then st=ok code=0
elif [ "$rc" -gt 128 ]; then st=failed sig=$((rc - 128))
else st=failed code=$rc; fi
b64() { head -c "$cap" "$1" | base64 | tr -d '\n'; }
over() { if [ "$(($(wc -c <"$1")))" -gt "$cap" ]; then echo true; else echo false; fi; }
mkdir -p "${m%/*}" &&
printf '{"version":1,"txn":"%s","profile":"%s","vmid":%s,"time":"%s","outcome":{"status":"%s","exit_code":%s,"signal":%s,"stdout_b64":"%s","stdout_truncated":%s,"stderr_b64":"%s","stderr_truncated":%s,"duration_ms":%s}}\n' \
  "$txn" "$profile" "$vmid" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$st" "$code" "$sig" "$(b64 "$o")" "$(over "$o")" "$(b64 "$e")" "$(over "$e")" "$ms" >"$m.$txn.tmp" &&
mv -f "$m.$txn.tmp" "$m" || { rm -f "$o" "$e" "$k"; exit 7; }
rm -f "$o" "$e" "$k"
echo felhom-ran; felhom_frame marker "$m" 1048576; rm -f "$m.kept"
cd / && rm -rf "$base" || echo felhom-cleanup-failed
exit 0
"#;

/// Run `profile` in the guest for transaction `txn`, unless the guest's marker says this
/// transaction already ran it (then the recorded outcome comes back with `reused: true`): one
/// exec ([`RUN_SCRIPT`]), the profile's files on its stdin.
///
/// A profile that ran and failed is a report with a non-ok status (see
/// [`BootstrapReport::into_result`]); errors mean it could not be run or recorded.
pub async fn run_bootstrap<E: GuestExec>(
    exec: &E,
    profile: &BootstrapProfile,
    txn: &str,
    settings: &BootstrapSettings,
) -> Result<BootstrapReport, BootstrapError> {
    use base64::Engine as _;
    let vmid = exec.guest().vmid;
    if !valid_txn(txn) {
        return Err(BootstrapError::InvalidTxn {
            txn: txn.to_owned(),
        });
    }
    let step_error =
        |step: &'static str, detail: String| BootstrapError::Step { vmid, step, detail };
    let base = format!("{GUEST_BOOTSTRAP_ROOT}/{txn}");
    let mut argv: Vec<String> = vec![
        "/bin/sh".into(),
        "-c".into(),
        format!(
            "{}{}{RUN_SCRIPT}",
            super::frames::FRAME_FN,
            super::frames::RUN_FNS
        ),
        "felhom-bootstrap".into(),
        base.clone(),
        MARKER_PATH.into(),
        txn.into(),
        vmid.to_string(),
        profile.name.clone(),
        settings.output_cap.to_string(),
        settings.timeout.as_secs().max(1).to_string(),
        profile.dirs.len().to_string(),
    ];
    argv.extend(profile.dirs.iter().cloned());
    let mut stdin = Vec::new();
    let mut sources = vec![(profile.run.clone(), "run".to_string(), 0o700)];
    sources.extend(
        profile
            .files
            .iter()
            .map(|f| (f.local.clone(), format!("files/{}", f.relative), f.mode)),
    );
    for (local, path, mode) in sources {
        let bytes = std::fs::read(&local).map_err(|source| BootstrapError::Exec {
            vmid,
            source: super::exec::ExecError::LocalFile {
                guest: exec.guest(),
                path: local.clone(),
                source,
            },
        })?;
        argv.extend([
            format!("{:o}", mode & 0o7777),
            bytes.len().to_string(),
            super::exec::sha256_hex(&bytes),
            path,
        ]);
        stdin.extend_from_slice(b"felhom-file\n");
        let encoded = base64::engine::general_purpose::STANDARD.encode(&bytes);
        for line in encoded.as_bytes().chunks(76) {
            stdin.extend_from_slice(line);
            stdin.push(b'\n');
        }
    }
    tracing::info!(vmid, txn, profile = %profile.name, "running bootstrap profile");
    let request = ExecRequest::new(argv)
        .stdin(stdin)
        .timeout(settings.timeout + settings.step_timeout)
        .output_cap(MARKER_CAP + 4096);
    let outcome = exec
        .exec(&request)
        .await
        .map_err(|source| BootstrapError::Exec { vmid, source })?;
    let items = super::frames::parse(&outcome.stdout.bytes);
    let mut said = None;
    let mut marker = None;
    for item in &items {
        match item {
            super::frames::Item::Line(l @ ("felhom-reused" | "felhom-ran")) => said = Some(*l),
            super::frames::Item::Line(l)
                if l.starts_with("felhom-badfile ") || *l == "felhom-nobase64" =>
            {
                let detail = if *l == "felhom-nobase64" {
                    "the guest has no `base64` to decode the profile's files with".to_owned()
                } else {
                    format!(
                        "file {} of the profile did not arrive whole",
                        crate::error::outside_text_max(&l[15..], 16)
                    )
                };
                return Err(step_error("push", detail));
            }
            super::frames::Item::Line("felhom-cleanup-failed") => {
                tracing::warn!(
                    vmid,
                    txn,
                    "could not remove the pushed bootstrap profile from the guest"
                );
            }
            super::frames::Item::Frame {
                name: "marker",
                bytes,
                truncated: false,
            } if said.is_some() => {
                marker = Some(serde_json::from_slice::<BootstrapMarker>(bytes));
            }
            _ => {}
        }
    }
    match (said, marker, &outcome.exit) {
        (Some(said), Some(Ok(marker)), GuestExit::Exited(0)) => {
            if said == "felhom-reused" {
                tracing::info!(vmid, txn, profile = %crate::error::outside_text(&marker.profile), "bootstrap already recorded for this transaction; not running it again");
            }
            // The run has ended in the guest; its result is not journaled yet.
            Ok(BootstrapReport {
                reused: said == "felhom-reused",
                marker,
            })
        }
        (Some(_), Some(Err(e)), _) => Err(step_error(
            "read marker",
            format!(
                "the marker {MARKER_PATH} is not readable: {}",
                crate::error::outside_text(&e.to_string())
            ),
        )),
        (_, _, GuestExit::Exited(5)) => Err(step_error("prepare", outcome.summary())),
        (_, _, GuestExit::Exited(7)) => Err(step_error("write marker", outcome.summary())),
        _ => Err(step_error("run", outcome.summary())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest::exec::Captured;

    fn write_exec(path: &Path, text: &str) {
        fs::write(path, text).unwrap();
        fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn a_profile_is_read_with_its_files_tree() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("web");
        fs::create_dir_all(p.join("files/etc/app/empty")).unwrap();
        write_exec(&p.join("run"), "#!/bin/sh\n");
        fs::write(p.join("files/etc/app/app.conf"), "x=1\n").unwrap();
        fs::set_permissions(
            p.join("files/etc/app/app.conf"),
            fs::Permissions::from_mode(0o640),
        )
        .unwrap();
        let profile = load_profile(dir.path(), "web").unwrap();
        assert_eq!(profile.dirs, ["etc", "etc/app", "etc/app/empty"]);
        assert_eq!(profile.files.len(), 1);
        assert_eq!(profile.files[0].relative, "etc/app/app.conf");
        assert_eq!(profile.files[0].mode, 0o640);
    }

    #[test]
    fn broken_profiles_are_refused_with_a_config_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = load_profile(dir.path(), "nope").unwrap_err();
        assert!(
            matches!(err, BootstrapError::ProfileMissing { .. }),
            "{err}"
        );
        assert_eq!(err.code(), ErrorCode::ConfigInvalid);

        for bad in ["", "../x", ".hidden", "a/b"] {
            assert!(matches!(
                load_profile(dir.path(), bad),
                Err(BootstrapError::InvalidProfileName { .. })
            ));
        }

        let p = dir.path().join("noexec");
        fs::create_dir_all(&p).unwrap();
        fs::write(p.join("run"), "#!/bin/sh\n").unwrap();
        fs::set_permissions(p.join("run"), fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            load_profile(dir.path(), "noexec"),
            Err(BootstrapError::RunNotExecutable { .. })
        ));

        let p = dir.path().join("link");
        fs::create_dir_all(p.join("files")).unwrap();
        write_exec(&p.join("run"), "#!/bin/sh\n");
        std::os::unix::fs::symlink("/etc/shadow", p.join("files/shadow")).unwrap();
        assert!(matches!(
            load_profile(dir.path(), "link"),
            Err(BootstrapError::UnsupportedEntry { .. })
        ));
    }

    #[test]
    fn outcomes_record_status_code_and_output() {
        let exec = |exit| ExecOutcome {
            exit,
            stdout: Captured::capped(b"out".to_vec(), 10, false),
            stderr: Captured::capped(b"err".to_vec(), 2, false),
            duration: Duration::from_millis(1500),
        };
        let o = BootstrapOutcome::from_exec(&exec(GuestExit::Exited(0)));
        assert_eq!(o.status, BootstrapStatus::Ok);
        assert_eq!(o.stderr, "er");
        assert!(o.stderr_truncated);
        assert_eq!(o.duration_ms, 1500);
        let o = BootstrapOutcome::from_exec(&exec(GuestExit::Exited(4)));
        assert_eq!((o.status, o.exit_code), (BootstrapStatus::Failed, Some(4)));
        let o = BootstrapOutcome::from_exec(&exec(GuestExit::TimedOut));
        assert_eq!(o.status, BootstrapStatus::TimedOut);
        let json = serde_json::to_value(&o).unwrap();
        assert_eq!(json["status"], "timed_out");
    }

    #[test]
    fn a_failed_report_is_a_bootstrap_failed_error_without_the_output() {
        let report = BootstrapReport {
            marker: BootstrapMarker {
                version: MARKER_VERSION,
                txn: "01TXN".into(),
                profile: "default".into(),
                vmid: 120,
                time: "2026-01-01T00:00:00Z".into(),
                outcome: BootstrapOutcome {
                    status: BootstrapStatus::Failed,
                    exit_code: Some(3),
                    signal: None,
                    stdout: "token=abc".into(),
                    stdout_truncated: false,
                    stderr: "password=hunter2".into(),
                    stderr_truncated: false,
                    duration_ms: 10,
                },
            },
            reused: false,
        };
        let err = report.into_result().unwrap_err();
        assert_eq!(err.code(), ErrorCode::BootstrapFailed);
        let msg = err.to_string();
        assert!(msg.contains("guest 120") && msg.contains("01TXN") && msg.contains("status 3"));
        assert!(
            !msg.contains("hunter2") && !msg.contains("token=abc"),
            "{msg}"
        );
    }
}
