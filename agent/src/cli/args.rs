//! Command-line definitions (clap) and the one-dash long-flag normalisation.
//!
//! Operators type Go-style flags (`-vmid 120`, `-vmid=120`, `-selftest=provision`, `-json`), so
//! every long flag is also accepted with a single dash. [`normalize_args`] rewrites those before
//! clap sees them; short flags (`-v`) are left alone.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};

use crate::provision::machine::TxnKind;

/// The default configuration path.
pub const DEFAULT_CONFIG: &str = "/etc/felhom-agent/agent.toml";

/// felhom-agent: provision Proxmox VE guests from backups, prove they launched, verify them
/// from inside, report to the hub, and never touch a guest this agent did not create.
#[derive(Debug, Parser)]
#[command(
    allow_negative_numbers = true,
    name = "felhom-agent",
    version,
    about = "Provision Proxmox VE guests from backups, safely, and report to the felhom hub",
    long_about = "Provision Proxmox VE guests from backups with a pool-scoped API token, prove they \
launched, verify them from inside with osquery, and report every step to the hub.\n\n\
Every vmid is validated against the node's FULL guest list (/etc/pve/.vmlist), not the \
token's pool view; reserved vmids (9999 and 990000-990009) are always refused; a guest is \
destroyed only when this agent's own transaction provably created it.\n\n\
Every long flag also works with one dash: -vmid 120, -vmid=120, -selftest=provision, -json.",
    after_help = "Examples:\n  \
felhom-agent doctor                          preflight of this node, writes nothing\n  \
felhom-agent guests                          the full guest list, pool and foreign\n  \
felhom-agent vmid-check 120                  is vmid 120 free for a provision?\n  \
felhom-agent --selftest=provision -vmid 120  provision, verify and destroy a test guest\n  \
felhom-agent --selftest=restore --dry-run    show what the restore test would do\n  \
felhom-agent restore-report                  which guests' backups are proven, due, failed\n  \
felhom-agent journal                         transactions and whether destroy is armed\n  \
felhom-agent journal --stats --since 7d      per-phase p50/p95/max and outcomes, last 7 days\n\n\
Exit codes: 0 done (also a skipped restore test), 2 usage, 3 refused before any write,\n\
4 PVE refused or failed the create, 5 restored and started but not verified: its launch proof\n\
or boot or bootstrap or checks failed (`doctor` finds a missing `pct` before),\n\
or a VM's guest agent refuses exec (guest_exec_blocked),\n\
6 environment (config, PVE unreachable, auth, TLS pin), 7 needs a human,\n\
130 interrupted (Ctrl-C or SIGTERM; the transaction stays open for `journal resume`)."
)]
pub struct Cli {
    /// Global options.
    #[command(flatten)]
    pub global: GlobalOpts,

    /// Run a self-test transaction: `provision` (needs -vmid) or `restore`.
    #[arg(long, value_enum, value_name = "KIND")]
    pub selftest: Option<SelftestKind>,

    /// Options of `--selftest`.
    #[command(flatten)]
    pub selftest_opts: SelftestOpts,

    /// The command to run (see below); `--selftest=…` runs a self-test instead.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// Options every command takes.
#[derive(Debug, Args)]
pub struct GlobalOpts {
    /// Configuration file.
    #[arg(long, global = true, env = "FELHOM_AGENT_CONFIG", default_value = DEFAULT_CONFIG, value_name = "PATH")]
    pub config: PathBuf,

    /// Print one JSON document on stdout at the end; progress stays on stderr.
    #[arg(long, global = true)]
    pub json: bool,

    /// More detail on stderr (-v: debug, -vv: trace).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// Format of the progress and log lines on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Auto, value_name = "FORMAT")]
    pub log_format: LogFormat,
}

/// Options of `--selftest=provision` / `--selftest=restore`.
#[derive(Debug, Args, Default)]
pub struct SelftestOpts {
    /// The vmid to provision into (required for `--selftest=provision`; never picked for you).
    #[arg(long, value_name = "N")]
    pub vmid: Option<String>,

    /// Backup volid to restore from (default: provision.selftest_source in the config).
    #[arg(long, value_name = "VOLID")]
    pub from: Option<String>,

    /// Target storage for the guest's disks (default: provision.storage in the config).
    #[arg(long, value_name = "ID")]
    pub storage: Option<String>,

    /// Keep the guest after the test instead of destroying it. A kept container with
    /// --network=isolated has no NIC, so nothing tells it from a copy of it: the agent cannot
    /// destroy it later (`destroy` refuses it, exit 7); remove it with `pct destroy N`.
    #[arg(long)]
    pub keep: bool,

    /// The guest's network: `isolated` (no NIC at all: every stored netN is removed before
    /// the first start) or `stored` (the NICs its backup stores, bridges and addresses
    /// included). Default: isolated, or stored with --keep.
    #[arg(long, value_enum, value_name = "MODE")]
    pub network: Option<NetworkMode>,

    /// Print the plan (verdict and the calls it would make) and write nothing.
    #[arg(long)]
    pub dry_run: bool,

    /// With --selftest=restore: prove this pool guest's newest backup now, due or not
    /// (without it, the run proves every guest whose newest backup is due).
    #[arg(long, value_name = "VMID")]
    pub guest: Option<u32>,
}

/// The network a `--selftest=provision` guest starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NetworkMode {
    /// No NIC: a copy of a customer's guest never meets its network as a twin.
    Isolated,
    /// The NICs its backup stores (a guest meant to serve).
    Stored,
}

/// The kind of self-test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SelftestKind {
    /// Full provision transaction into -vmid N, bootstrap, checks, gated destroy.
    Provision,
    /// One self-restore-test run in the 990000-990009 band.
    Restore,
}

/// Format of stderr lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human lines, coloured only on a terminal (the default).
    Auto,
    /// Human-readable lines.
    Human,
    /// One JSON object per line.
    Json,
}

/// Commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The daemon: hub session, dispatches, heartbeats (started by systemd).
    Run,
    /// The full guest list: vmid, type, node, and whether it is in the pool or foreign.
    Guests,
    /// The verdict on one vmid: free, invalid, reserved, or in use. Exit 0 free, 3 refused.
    #[command(allow_negative_numbers = true)]
    VmidCheck {
        /// The vmid to check, as the operator typed it.
        #[arg(value_name = "N")]
        vmid: String,
    },
    /// The node's preflight: config, token file, PVE TLS, token and privileges, pool,
    /// .vmlist (and how it is read), the node's TLS keys out of the agent's reach, exec (and the
    /// helper's `pct`), hub; as the [agent] user, like the other commands. Writes nothing. Exit 0
    /// when nothing failed (warnings are counted), 6 otherwise.
    Doctor,
    /// The transactions, their phase and whether destroy is armed; with --stats, how long
    /// each phase takes; with refresh, resolve, resume or cancel, act on them (see `felhom-agent
    /// journal --help`).
    #[command(
        long_about = "The transactions, their phase and whether destroy is armed: every open \
transaction, every needs_human one, every kept one (destroy armed), and the 50 settled ones written \
last (from the journal folder, then the archive); it says how many older ones are not shown. With \
--all: every transaction, the archive's too. OUTCOME is ok, failed, refused, needs_human or \
skipped once settled; interrupted for an open one whose process is gone; open while a process runs \
it. --kind KIND lists one kind only (provision, destroy, selftest-provision, restore-test).\n\n\
--last KIND shows the newest transaction of that kind in full; `journal --last restore-test` is \
the last restore test at a glance: the backup it restored, how it ended and why, each check with \
pass, fail or error and why, the boot, and what the isolation changed.\n\n\
With --stats: per kind of transaction and per phase, how many times the phase ended and how \
long it lasted (p50, p95 and max in seconds, nearest-rank percentiles), and the outcomes \
counted (`open` for transactions not settled). A phase lasts from the journal record that \
entered it to the record that entered the next phase; the last phase of a transaction has no \
duration. Reads the journal and its archive only: no PVE call, nothing written.\n\n\
An open transaction whose process is gone is shown as `interrupted` with the command that \
resumes it (`felhom-agent journal resume TXN`; the next writing command resumes it too).\n\n\
With a verb (refresh, resolve, resume, cancel): act on the journal; see each verb's --help."
    )]
    Journal {
        /// Print per-phase durations (count, p50, p95, max) and outcome counts per kind.
        #[arg(long)]
        stats: bool,
        /// With --stats: only transactions started within this long before now: a number and
        /// a unit, s, m, h or d (e.g. 90m, 36h, 7d).
        #[arg(long, value_name = "DURATION", requires = "stats")]
        since: Option<String>,
        /// List every transaction: the whole journal folder and the archive (settled ones older
        /// than `[journal] keep_days`), not only the open, needs_human, kept and 50 newest.
        #[arg(long)]
        all: bool,
        /// List only transactions of this kind: provision, destroy, selftest-provision, or
        /// restore-test (also spelled selftest-restore).
        #[arg(long, value_name = "KIND", value_parser = parse_txn_kind, conflicts_with = "stats")]
        kind: Option<TxnKind>,
        /// Show the newest transaction of this kind in full instead of the list: its outcome,
        /// phase, backup, error and, for `--last restore-test`, each check with pass, fail or
        /// error and why, the boot and what the isolation changed.
        #[arg(long, value_name = "KIND", value_parser = parse_txn_kind, conflicts_with_all = ["stats", "all", "kind"])]
        last: Option<TxnKind>,
        /// With --last restore-test: the last restore test of this guest's backups; in the
        /// list: only restore tests of this guest's backups.
        #[arg(long, value_name = "VMID", conflicts_with = "stats")]
        guest: Option<u32>,
        /// What to do with the journal (default: list it).
        #[command(subcommand)]
        op: Option<JournalOp>,
    },
    /// Per pool guest of this node: its newest backup, the last restore test of it, the newest
    /// proven restore point and its age, and a status (proven, due, overdue, failed,
    /// no_backup, unprovable; stale beside it). Exit 0 when every guest is proven or merely
    /// due, 5 otherwise.
    #[command(
        long_about = "Per pool guest of this node (and per configured source): its newest backup \
(volid and time), the last restore test of that backup (when, how it ended, the failing checks), \
the newest proven restore point still on storage (the backup an operator can really fall back \
to, and its age), and a status: proven (its newest backup restored, booted and passed its \
checks), due (a newer backup is not proven yet; the next run proves it), overdue (due for \
longer than [restore_test] prove_within), failed (a test of its backup failed and no later \
backup is proven yet), no_backup (nothing on the backup storages), unprovable (the preflight \
refuses its backup for good, with the code). stale: its newest backup is older than \
[restore_test] backup_max_age, or, unset, than the schedule of its backup job allows (the \
longest gap between two starts plus a day), else 8 days.\n\n\
Exit 0 when every guest is proven or merely due and none is stale (with daily backups every \
guest is due every morning), 5 otherwise: fit for a cron job or an auditor. Reads the backup \
lists and the proof store; writes nothing."
    )]
    RestoreReport,
    /// Gated destroy of a guest this agent created; anything else is refused (exit 7).
    #[command(allow_negative_numbers = true)]
    Destroy {
        /// The vmid of the guest to destroy.
        #[arg(long, value_name = "N", required = true)]
        vmid: String,
    },
    /// The root exec helper: runs `pct exec` for an agent that does not run as root (started
    /// by systemd through felhom-agent-exec.socket).
    #[command(
        long_about = "The root exec helper. `pct exec` needs root; an agent that runs as \
an unprivileged system user ([agent] user) asks this helper, over a Unix socket, to run a command in \
an LXC container or to copy a file into one (through `pct exec`, the bytes on stdin, written by a \
process inside the container; never `pct push`, which writes as host root following the guest's \
links). It also hands the agent five cluster files it reads, so that the agent's user needs no \
pmxcfs group (www-data reads the node's TLS key): .vmlist, datacenter.cfg (only its \
user-tag-access, registered-tags and next-id lines), user.cfg (only its token, group, role and acl \
lines, never a user line), sdn/vnets.cfg and jobs.cfg (only each backup job's id, schedule, all, \
enabled, exclude, pool, node and vmid lines), each from the path of its own config, opened as root from / without following a \
link, only through folders of root's nobody else can write, a regular file of root's of at most \
16 MiB (else config_invalid; a request names one of the five, never a path); and says where its \
`pct` resolves (doctor's exec check). For a restore test's application group of containers \
it makes the group's lab (README \"Application groups\"): it joins a running copy's stored \
interfaces to the lab its journaled transaction names (and links that lab to the group's lab \
bridge when the transaction names one of [restore_test] lab_bridges, which it reads in the \
kernel first), removes the lab at the group's end, and for doctor makes and removes one of its \
own (lab_probe); where systemd runs, each lab is an instance of felhom-lab@.service. The helper \
does nothing else.\n\n\
Who may call it: only processes of root and of the [agent] user (checked with SO_PEERCRED on \
every connection; anyone else gets exec_caller_refused). Before every request it reads, fresh: \
the journal in state_dir (the transaction named must be open, with an armed claim on exactly this \
vmid; else exec_not_owned; and at a step that runs commands in the guest: launch proof, bootstrap \
or checks; else exec_wrong_phase, so a kept or settled guest is never entered), the node's full \
guest list (the vmid must be an LXC container on this node; else exec_not_owned), user_cfg_path \
(the vmid must be in the config's pool; else exec_not_in_pool) and the container's own config in \
pve_nodes_dir, opened as root without following links (it must say `unprivileged: 1` and carry \
no raw lxc. key, no host-path mount point and no devN; else exec_guest_privileged). A malformed, oversized or other-version request gets \
exec_request_invalid. A request never names a file on the node: pushed files travel inside it.\n\n\
How it starts: systemd socket activation, felhom-agent-exec.socket (default \
/run/felhom-agent/exec.sock) starts felhom-agent-exec.service on the first connection; the helper \
exits after two idle minutes. With --socket PATH it binds PATH itself, which is for tests and \
debugging: a full path, only in a folder of root's that group and others cannot write, below \
folders of root's nobody else can write (or sticky, as /tmp), bound in a private folder there, \
given mode 0660 and the [agent] user's group, then renamed into place; at exit the socket is \
removed only if the name still holds it. Right before \
every pct exec, the container's LXC command socket must be held by root's LXC monitor of that \
container (else exec_monitor_untrusted), and what pct exec starts must run in the namespaces \
of the init that monitor names before the command runs (else it is killed: exec_attach_mismatch). \
It logs every request (caller uid, vmid, \
transaction, argv, result), never environment values or stdin.",
        after_help = "Exit codes: 0 stopped (idle or SIGTERM), 6 the config, the [agent] user or the socket \
is unusable."
    )]
    ExecHelper {
        /// Bind this socket path instead of taking the socket from systemd.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
    },
    /// Copy the agent's metrics files, checked, into node_exporter's textfile folder (root).
    #[command(
        long_about = "Run as root by felhom-agent-metrics.service when the agent's metrics folder ([metrics] dir) changes (felhom-agent-metrics.path). For each of felhom_transactions.prom, felhom_hub.prom, felhom_restore_test.prom and felhom_backup_coverage.prom only: opened in the agent's folder without following a link and without blocking (a FIFO or a link is refused), it must be a regular file of root or the [agent] user, at most 1 MiB, holding only HELP/TYPE lines and samples of the metrics the agent writes into that file, with exactly their label keys, each label value one the agent writes (a transaction kind, a phase, an outcome, a bucket bound, a vmid in PVE's range, a coverage or check status, a guest name without control characters), no series twice, at most 1000 samples (11 a guest in the coverage file, for at most 1000 guests), without timestamps. What passes is written into node_exporter's folder through a random temporary name and a rename; a file that is missing or refused is removed there, so node_exporter reads only files root wrote, or nothing; a refused agent folder removes all four. Every pass ends by writing felhom_metrics_publish.prom there: felhom_metrics_published{file} 1 for each file published, 0 for one missing or refused (the alerts on missing and stale metrics read it). With --idle-exit SECS it stays after the first pass and publishes again at every change of the folder until the folder has been still for SECS (the packaged unit: systemd's path unit does not watch while the publisher runs). --from must be [metrics] dir: the path unit watches the folder --from names.",
        after_help = "Exit codes: 0 done (each file copied, absent or refused, logged), 6 the config or a folder is unusable, or --from is not [metrics] dir."
    )]
    MetricsPublish {
        /// The agent's metrics folder; must be [metrics] dir (default: [metrics] dir).
        #[arg(long, value_name = "DIR")]
        from: Option<PathBuf>,
        /// Stay and publish at every change until the folder is still for SECS.
        #[arg(long, value_name = "SECS")]
        idle_exit: Option<u64>,
        /// node_exporter's textfile folder.
        #[arg(
            long,
            value_name = "DIR",
            default_value = "/var/lib/prometheus/node-exporter"
        )]
        to: PathBuf,
    },
}

/// The journal's verbs.
#[derive(Debug, Subcommand)]
pub enum JournalOp {
    /// Re-read every guest the journal may still own or concern and record what PVE shows.
    #[command(
        long_about = "For every transaction that may still own or concern a guest (open, \
needs_human, or kept with destroy armed), read the node's full guest list and the guest's config \
through the pool token again, and record what is there: the guest with this transaction's proof \
(marker and birth identity), a guest without it, or nothing.\n\n\
A kept guest found gone or without its proof is disarmed for good (a later `destroy` is refused). \
A needs_human transaction whose guest is gone is closed with \"guest gone\". An open transaction \
is only reported: `journal resume` or the next writing command resumes it, `journal cancel` ends it.\n\n\
Never writes to PVE. A PVE error that says nothing about the guest (unreachable, 5xx, \
token refused) changes nothing; a 403 for the guest counts as present without its proof. A transaction whose vmid lock is \
held by a running agent is skipped and said so.",
        after_help = "Exit codes: 0 done (also with skipped locks), 6 the guest list, the journal or \
PVE could not be read for some guest (nothing was changed for it; run it again later)."
    )]
    Refresh,
    /// Close a needs_human transaction after handling it by hand.
    #[command(
        long_about = "Close a needs_human transaction after you have handled its guest by hand \
(removed it, or taken it over). The reason (clipped to 512 bytes) and the time are journaled, \
`journal` shows them, and when a hub is configured the closure is queued for it (the daemon \
sends it, at once when it runs, else at its next start). A destroy claim the transaction still \
held is withdrawn.\n\n\
Never touches PVE. Takes the vmid's lock like every writer.",
        after_help = "Exit codes: 0 closed, 2 usage, 3 refused: the transaction is not awaiting a \
human (not_needs_human), is unknown (txn_unknown), or its vmid is locked by a running agent \
(vmid_in_use); 6 the journal could not be written."
    )]
    Resolve {
        /// The transaction id (see `felhom-agent journal`).
        #[arg(value_name = "TXN")]
        txn: String,
        /// What was done by hand, for the journal and the hub.
        #[arg(long, value_name = "TEXT", required = true)]
        reason: String,
    },
    /// Resume one interrupted transaction from its last journaled step and run it to its end.
    #[command(
        long_about = "Resume one open transaction whose process was stopped (its vmid lock is \
free) from its last journaled step, exactly as the next writing command would, and run it to its \
end: the recorded restore task is followed, then the marker, the start, the launch proof, the \
bootstrap, the checks, the report and the destroy (or keep), as if it had not been stopped. A \
bootstrap or checks the stop interrupted run again from their start (profiles and check packs are \
idempotent). Where it cannot be resumed (the guest gone or without its proof, its task failed or \
unreadable, a failure already recorded) it is settled through the ownership gate as `journal \
cancel` would.",
        after_help = "Exit codes: as the transaction ends (0 ok, 4 PVE refused or a task failed, 5 \
launch, bootstrap or checks failed, 7 needs_human); 3 refused: its vmid lock is held by a running \
agent, or it is an isolated VM copy whose lab bridge another agent's copy holds (vmid_in_use), it \
is not open (txn_not_open) or unknown (txn_unknown); 6 PVE or the journal could not be read (the \
transaction stays open)."
    )]
    Resume {
        /// The transaction id (see `felhom-agent journal`).
        #[arg(value_name = "TXN")]
        txn: String,
    },
    /// End one open transaction whose process is gone, without resuming it.
    #[command(
        long_about = "End one open transaction whose process is gone (its vmid lock is free) \
without resuming it: the recorded restore task is followed to its end and the guest read again, \
its own guest is cleaned up only through the ownership gate (marker and birth identity re-read \
right before the DELETE), and the transaction ends failed, saying where it had stopped; anything \
unproven ends needs_human without a write to PVE. (The next writing command, and `journal \
resume`, resume an interrupted transaction instead.)",
        after_help = "Exit codes: 0 settled, 3 refused: its vmid lock is held by a running agent \
(vmid_in_use), it is not open (txn_not_open) or unknown (txn_unknown); 7 settled as needs_human; \
6 PVE or the journal could not be read (the transaction stays open)."
    )]
    Cancel {
        /// The transaction id (see `felhom-agent journal`).
        #[arg(value_name = "TXN")]
        txn: String,
    },
}

/// The kinds `journal --kind` and `--last` take: each kind's journal name, and `restore-test`
/// for a self-restore-test.
pub fn parse_txn_kind(s: &str) -> Result<TxnKind, String> {
    match s {
        "provision" => Ok(TxnKind::Provision),
        "destroy" => Ok(TxnKind::Destroy),
        "selftest-provision" => Ok(TxnKind::SelftestProvision),
        "restore-test" | "selftest-restore" => Ok(TxnKind::SelftestRestore),
        other => Err(format!(
            "{other:?} is no kind of transaction: provision, destroy, selftest-provision, restore-test (or selftest-restore)"
        )),
    }
}

/// Rewrite Go-style single-dash long flags (`-vmid=120`, `-json`) to their double-dash form.
///
/// Only names that are long flags of the command line are rewritten, so short flags and
/// values such as `-v` stay as they are. Everything after a bare `--` is left untouched.
pub fn normalize_args<I>(args: I) -> Vec<OsString>
where
    I: IntoIterator<Item = OsString>,
{
    let longs = long_flag_names();
    let mut out = Vec::new();
    let mut passthrough = false;
    for (i, arg) in args.into_iter().enumerate() {
        if i == 0 || passthrough {
            out.push(arg);
            continue;
        }
        if arg == "--" {
            passthrough = true;
            out.push(arg);
            continue;
        }
        let rewritten = arg.to_str().and_then(|s| {
            let rest = s.strip_prefix('-')?;
            if rest.starts_with('-') || rest.len() < 2 {
                return None;
            }
            let name = rest.split('=').next().unwrap_or(rest);
            longs
                .iter()
                .any(|l| l == name)
                .then(|| OsString::from(format!("-{s}")))
        });
        out.push(rewritten.unwrap_or(arg));
    }
    out
}

fn long_flag_names() -> Vec<String> {
    fn collect(cmd: &clap::Command, into: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            if let Some(l) = arg.get_long() {
                into.push(l.to_string());
            }
        }
        for sub in cmd.get_subcommands() {
            collect(sub, into);
        }
    }
    let mut names = vec!["help".to_string(), "version".to_string()];
    collect(&Cli::command(), &mut names);
    names
}

/// Parse a command line (with one-dash normalisation).
pub fn parse_from<I>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = OsString>,
{
    Cli::try_parse_from(normalize_args(args))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        parse_from(args.iter().map(OsString::from))
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn one_dash_long_flags_are_accepted() {
        let cli = parse(&[
            "felhom-agent",
            "-selftest=provision",
            "-vmid",
            "120",
            "-json",
        ]);
        let cli = cli.expect("parses");
        assert_eq!(cli.selftest, Some(SelftestKind::Provision));
        assert_eq!(cli.selftest_opts.vmid.as_deref(), Some("120"));
        assert!(cli.global.json);

        let cli = parse(&[
            "felhom-agent",
            "-selftest",
            "provision",
            "-vmid=121",
            "-keep",
        ])
        .expect("parses");
        assert_eq!(cli.selftest_opts.vmid.as_deref(), Some("121"));
        assert!(cli.selftest_opts.keep);
    }

    #[test]
    fn short_flags_stay_short() {
        let cli = parse(&["felhom-agent", "-v", "-v", "doctor"]).expect("parses");
        assert_eq!(cli.global.verbose, 2);
        assert!(matches!(cli.command, Some(Command::Doctor)));
    }

    #[test]
    fn subcommand_flags_with_one_dash() {
        let cli = parse(&["felhom-agent", "destroy", "-vmid", "130", "-json"]).expect("parses");
        match cli.command {
            Some(Command::Destroy { vmid }) => assert_eq!(vmid, "130"),
            other => panic!("unexpected {other:?}"),
        }
        assert!(cli.global.json);
    }

    #[test]
    fn unknown_single_dash_word_is_not_rewritten() {
        let out = normalize_args(["x", "-nonsense", "--", "-vmid"].map(OsString::from));
        assert_eq!(out, ["x", "-nonsense", "--", "-vmid"].map(OsString::from));
    }

    #[test]
    fn journal_verbs_parse_with_one_dash_flags() {
        let cli = parse(&[
            "felhom-agent",
            "journal",
            "resolve",
            "01M8PVF4ZJGKG5D6KGFRA5Z6S1",
            "-reason",
            "removed by hand",
            "-json",
        ])
        .expect("parses");
        match cli.command {
            Some(Command::Journal {
                op: Some(JournalOp::Resolve { txn, reason }),
                all: false,
                ..
            }) => {
                assert_eq!(txn, "01M8PVF4ZJGKG5D6KGFRA5Z6S1");
                assert_eq!(reason, "removed by hand");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(cli.global.json);
        assert!(
            parse(&["felhom-agent", "journal", "resolve", "X"]).is_err(),
            "--reason is required"
        );
        assert!(matches!(
            parse(&["felhom-agent", "journal", "-all"])
                .expect("parses")
                .command,
            Some(Command::Journal {
                op: None,
                all: true,
                ..
            })
        ));
        assert!(matches!(
            parse(&["felhom-agent", "journal", "refresh"])
                .expect("parses")
                .command,
            Some(Command::Journal {
                op: Some(JournalOp::Refresh),
                ..
            })
        ));
        assert!(matches!(
            parse(&["felhom-agent", "journal", "resume", "X"])
                .expect("parses")
                .command,
            Some(Command::Journal {
                op: Some(JournalOp::Resume { .. }),
                ..
            })
        ));
        assert!(matches!(
            parse(&["felhom-agent", "journal", "cancel", "X"])
                .expect("parses")
                .command,
            Some(Command::Journal {
                op: Some(JournalOp::Cancel { .. }),
                ..
            })
        ));
    }

    #[test]
    fn vmid_check_takes_positional() {
        let cli = parse(&["felhom-agent", "vmid-check", "0120", "--json"]).expect("parses");
        match cli.command {
            Some(Command::VmidCheck { vmid }) => assert_eq!(vmid, "0120"),
            other => panic!("unexpected {other:?}"),
        }
    }
}
