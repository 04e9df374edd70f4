//! The operator's door: the clap definitions ([`args`]), the dispatch of a parsed [`Cli`] to
//! the transaction service, the daemon or a read command, and the output of each ([`output`]):
//! a JSON document (printed with `--json`), the human text (printed otherwise) and the exit
//! status. Progress goes to stderr through tracing.
//!
//! It may use every module below it (`service`, `hub`, `doctor`, …); nothing imports it but
//! `main.rs`.

mod args;
pub mod output;
pub mod progress;
pub mod sink;
mod taken_up;

pub use args::*;

use std::io::IsTerminal;

use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::error::{exit_status, ExitStatus, Failure};
use crate::hub::runner::SpoolReporter;
use crate::provision::machine::TxnKind;
use crate::service::{self, ProvisionRequest};
use ulid::Ulid;

/// What a command produced.
#[derive(Debug)]
pub struct CommandOutput {
    /// The `--json` document.
    pub json: serde_json::Value,
    /// What a person reads on stdout.
    pub human: String,
    /// The exit status.
    pub status: ExitStatus,
}

impl CommandOutput {
    /// The output of a failure that ended a command before it produced its own document.
    pub fn failure(f: &Failure) -> Self {
        Self {
            json: json!({"error": {"code": f.code.as_str(), "message": f.message}}),
            human: format!("error [{}]: {}", f.code, f.message),
            status: exit_status(f.code),
        }
    }
}

/// Set up tracing on stderr: human lines (colour only on a terminal) or JSON lines, UTC
/// RFC 3339 timestamps; `-v` debug, `-vv` trace; `FELHOM_AGENT_LOG` overrides the filter.
pub fn init_tracing(global: &GlobalOpts) {
    init_tracing_quiet(global, false);
}

/// [`init_tracing`] for a parsed command line: while a self-test draws its progress view on a
/// terminal, the default level is `warn` (the view shows the phases; `-v` brings the lines
/// back).
pub fn init_tracing_for(cli: &Cli) {
    init_tracing_quiet(
        &cli.global,
        cli.selftest.is_some() && live_view(&cli.global),
    );
}

fn init_tracing_quiet(global: &GlobalOpts, quiet: bool) {
    use tracing_subscriber::fmt::time::UtcTime;
    use tracing_subscriber::EnvFilter;
    let level = match (global.verbose, quiet) {
        (0, true) => "warn",
        (0, false) => "info",
        (1, _) => "debug",
        _ => "trace",
    };
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = EnvFilter::try_from_env("FELHOM_AGENT_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("warn,felhom_agent={level}")));
    // Applied after the operator's filter, whatever it says: the transport libraries log
    // raw requests (the hub's upgrade request with its `Authorization` header) below `info`.
    let cap = tracing_subscriber::filter::filter_fn(|meta| !is_capped_transport(meta));
    let builder = tracing_subscriber::fmt()
        .with_writer(sink::LogStderr)
        // A log line that cannot be written is dropped, never complained about on stderr.
        .log_internal_errors(false)
        .with_env_filter(filter)
        .with_timer(UtcTime::rfc_3339());
    let _ = match global.log_format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .finish()
            .with(cap)
            .try_init(),
        LogFormat::Human | LogFormat::Auto => builder
            .with_ansi(std::io::stderr().is_terminal())
            .with_target(false)
            .finish()
            .with(cap)
            .try_init(),
    };
}

/// Whether the live progress view is drawn: stderr is a terminal and the log format is not
/// JSON.
fn live_view(global: &GlobalOpts) -> bool {
    global.log_format != LogFormat::Json && std::io::stderr().is_terminal()
}

/// The libraries that see credentials on the wire (the websocket handshake, HTTP headers, TLS):
/// their events below `info` are never logged, at any `FELHOM_AGENT_LOG` setting.
const CAPPED_TARGETS: &[&str] = &[
    "tungstenite",
    "tokio_tungstenite",
    "hyper",
    "hyper_util",
    "h2",
    "reqwest",
    "rustls",
    "tokio_rustls",
    "http",
];

/// Whether an event or span is one of those the cap drops.
pub fn is_capped_transport(meta: &tracing::Metadata<'_>) -> bool {
    if *meta.level() <= tracing::Level::INFO {
        return false;
    }
    let target = meta.target();
    CAPPED_TARGETS.iter().any(|t| {
        target == *t
            || target
                .strip_prefix(t)
                .is_some_and(|rest| rest.starts_with("::"))
    })
}

/// Make this process non-dumpable: no core dump (its memory holds the PVE token secret and the
/// hub credential) and no ptrace or `/proc/<pid>/mem` by other users, also for a run from a
/// shell whose core limit is unlimited. Programs it starts are dumpable again after `exec`.
pub fn harden_process() {
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!(
            "cannot mark the process non-dumpable ({e}); a core dump would hold the secrets"
        );
    }
}

/// A token cancelled on SIGINT or SIGTERM.
pub fn shutdown_token() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return,
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::warn!("interrupted: stopping what runs and leaving the journal consistent (Ctrl-C again ends the run at once)");
        t.cancel();
        // A second Ctrl-C (or SIGTERM) ends the process now. The journal is write-ahead, so
        // the transaction stays open where it was and resumes (`journal resume`); the exec
        // helper sees the hang-up and stops the command in the guest.
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        sink::err_line("interrupted twice: ending at once; `felhom-agent journal` shows the transaction to resume");
        std::process::exit(i32::from(ExitStatus::Interrupted.code()));
    });
    token
}

fn usage(msg: &str) -> CommandOutput {
    CommandOutput {
        json: json!({"error": {"code": "usage", "message": msg}}),
        human: format!("usage error: {msg}\nsee `felhom-agent --help`"),
        status: ExitStatus::Usage,
    }
}

/// Load the config or produce the failure output.
pub fn load_config(global: &GlobalOpts) -> Result<Config, CommandOutput> {
    Config::load(&global.config).map_err(|f| CommandOutput::failure(&f))
}

/// Load the config (and its secrets, as whoever started the run), then, when the run started
/// as root and `[agent] user` is set, switch to that user for good ([`crate::privdrop`]).
/// Every command but `doctor` goes through here (`doctor` switches the same way once it has
/// reported on the config: `crate::doctor`'s `agent_user` check).
pub fn load_config_as_agent(global: &GlobalOpts) -> Result<Config, CommandOutput> {
    let cfg = load_config(global)?;
    if let Some(user) = &cfg.agent_user {
        crate::privdrop::drop_to(user).map_err(|f| CommandOutput::failure(&f))?;
    }
    Ok(cfg)
}

/// Run the command line, print its output, and return the exit status.
pub fn run(cli: Cli) -> ExitStatus {
    // The exec helper takes its socket from systemd before any thread starts, and runs its
    // own runtime.
    if let Some(Command::ExecHelper { socket }) = &cli.command {
        if cli.selftest.is_some() {
            sink::err_line("usage error: --selftest cannot be combined with a command");
            return ExitStatus::Usage;
        }
        return crate::exec_helper::server::main(&cli.global.config, socket.as_deref());
    }
    if let Some(Command::MetricsPublish {
        from,
        idle_exit,
        to,
    }) = &cli.command
    {
        return metrics_publish(&cli.global.config, from.as_deref(), to, *idle_exit);
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            sink::err_line(&format!("cannot start the async runtime: {e}"));
            return ExitStatus::Environment;
        }
    };
    let json_out = cli.global.json;
    let out = runtime.block_on(dispatch(cli));
    if json_out {
        sink::out_line(
            &serde_json::to_string_pretty(&out.json).unwrap_or_else(|_| "{}".to_string()),
        );
        // The document holds the error too; a person (or `2>`) sees it on stderr as well
        // (not for a command that succeeded: there it is the transaction's recorded failure).
        if let Some(e) = out
            .json
            .get("error")
            .filter(|e| !e.is_null() && out.status != ExitStatus::Ok)
        {
            sink::err_line(&format!(
                "error [{}]: {}",
                e["code"].as_str().unwrap_or("-"),
                e["message"].as_str().unwrap_or("")
            ));
        }
    } else if !out.human.is_empty() {
        let (results, errors) = split_streams(&out.human);
        if !results.is_empty() {
            sink::out_line(results.trim_end());
        }
        if !errors.is_empty() {
            sink::err_line(errors.trim_end());
        }
    }
    out.status
}

/// Whether a line of a command's human output is an error or a warning: those go to stderr,
/// so `felhom-agent guests > list.txt` never hides one in the file; results go to stdout.
fn is_error_line(line: &str) -> bool {
    [
        "error [",
        "halted [",
        "warning: ",
        "usage error",
        "see `felhom-agent --help`",
    ]
    .iter()
    .any(|p| line.starts_with(p))
}

/// The human output split into (stdout, stderr). A command's text ends with its errors and
/// warnings, and a message may run over several lines (TOML's caret under a mistyped key, the
/// keys it expected): from the first error or warning line on, everything goes to stderr, so
/// no part of an error lands among the results.
fn split_streams(human: &str) -> (String, String) {
    let mut results = String::new();
    let mut errors = String::new();
    let mut in_errors = false;
    for line in human.lines() {
        in_errors = in_errors || is_error_line(line);
        let to = if in_errors { &mut errors } else { &mut results };
        to.push_str(line);
        to.push('\n');
    }
    (results, errors)
}

/// `journal refresh|resolve|resume|cancel`.
async fn journal_op(cfg: &Config, op: JournalOp) -> CommandOutput {
    use crate::service::journal_ops;
    match op {
        JournalOp::Refresh => {
            let report = journal_ops::refresh(cfg).await;
            if let Ok(r) = &report {
                for row in r.changed() {
                    if row.state.resolution().is_some() {
                        crate::hub::aftercare::spool_resolution(cfg, &row.state);
                    }
                }
            }
            output::journal_refresh(report)
        }
        JournalOp::Resolve { txn, reason } => {
            if reason.trim().is_empty() {
                return usage("--reason must say what was done by hand");
            }
            let resolved = journal_ops::resolve(cfg, &txn, &reason);
            let queued = resolved
                .as_ref()
                .ok()
                .map(|state| crate::hub::aftercare::spool_resolution(cfg, state));
            output::journal_resolve(resolved, queued.flatten())
        }
        JournalOp::Resume { txn } => {
            let reporter = SpoolReporter::new(cfg.state_dir.clone());
            output::journal_resume(
                journal_ops::resume(cfg, &txn, &reporter, shutdown_token()).await,
            )
        }
        JournalOp::Cancel { txn } => {
            let reporter = SpoolReporter::new(cfg.state_dir.clone());
            output::journal_cancel(
                journal_ops::cancel(cfg, &txn, &reporter, shutdown_token()).await,
            )
        }
    }
}

/// A mistake in the command line that only the config's reading used to stop (exit 2,
/// `usage`): judged before the config is read, whatever the config holds.
fn usage_mistake(cli: &Cli) -> Option<CommandOutput> {
    let opts = &cli.selftest_opts;
    match (&cli.selftest, &cli.command) {
        (Some(SelftestKind::Provision), None) if opts.vmid.is_none() => Some(usage(
            "--selftest=provision needs -vmid N: the agent never picks a vmid; choose a free one with `felhom-agent guests` / `felhom-agent vmid-check N`",
        )),
        (Some(SelftestKind::Restore), None)
            if opts.vmid.is_some() || opts.from.is_some() || opts.keep || opts.network.is_some() =>
        {
            Some(usage("--selftest=restore picks its own vmids in the restore-test band and proves every guest whose newest backup is due; it takes only --guest VMID and --dry-run (the target storage is [restore_test] storage)"))
        }
        (Some(SelftestKind::Provision), None) if opts.guest.is_some() => {
            Some(usage("--guest belongs to --selftest=restore (prove one guest's newest backup now)"))
        }
        (None, Some(Command::Journal { guest: Some(_), last, kind, .. }))
            if last.is_some_and(|k| k != TxnKind::SelftestRestore) || kind.is_some_and(|k| k != TxnKind::SelftestRestore) =>
        {
            Some(usage("--guest reads restore tests only: `journal --last restore-test --guest VMID` or `journal --kind restore-test --guest VMID`"))
        }
        (None, Some(Command::Journal { op: Some(_), all: true, .. })) => {
            Some(usage("--all belongs to `journal` alone"))
        }
        (None, Some(Command::Journal { op: Some(_), stats: true, .. })) => {
            Some(usage("--stats belongs to `journal` alone"))
        }
        (None, Some(Command::Journal { op: Some(_), kind, last, .. })) if kind.is_some() || last.is_some() => {
            Some(usage("--kind and --last belong to `journal` alone"))
        }
        (None, Some(Command::Journal { op: Some(JournalOp::Resolve { reason, .. }), .. }))
            if reason.trim().is_empty() =>
        {
            Some(usage("--reason must say what was done by hand"))
        }
        (None, Some(Command::Journal { stats: true, since: Some(since), .. })) => {
            crate::metrics::stats::parse_since(since).err().map(|msg| usage(&msg))
        }
        _ => None,
    }
}

// The match arms are kept on one line each (rustfmt would give up on them anyway).
#[rustfmt::skip]
async fn dispatch(cli: Cli) -> CommandOutput {
    if let Some(mistake) = usage_mistake(&cli) {
        return mistake;
    }
    let selftest_opts_given = cli.selftest_opts.vmid.is_some()
        || cli.selftest_opts.from.is_some()
        || cli.selftest_opts.storage.is_some()
        || cli.selftest_opts.keep
        || cli.selftest_opts.network.is_some()
        || cli.selftest_opts.dry_run
        || cli.selftest_opts.guest.is_some();
    match (cli.selftest, cli.command) {
        (Some(_), Some(_)) => usage("--selftest cannot be combined with a command"),
        (None, None) => usage("no command given"),
        (None, Some(_)) if selftest_opts_given => {
            usage("--vmid/--from/--storage/--keep/--network/--dry-run/--guest belong to --selftest (destroy takes its own --vmid after the command)")
        }
        (Some(kind), None) => {
            let cfg = match load_config_as_agent(&cli.global) {
                Ok(c) => c,
                Err(out) => return out,
            };
            let spool = SpoolReporter::new(cfg.state_dir.clone());
            // A restore run drives several copies at once: one line per phase of each copy
            // (its guest and copy named) instead of the one-transaction live view.
            let progress = (live_view(&cli.global) && kind == SelftestKind::Provision)
                .then(|| progress::ProgressReporter::start(SpoolReporter::new(cfg.state_dir.clone())));
            let notes = taken_up::TakeUpNotes::new(match &progress {
                Some(p) => p,
                None => &spool,
            });
            let reporter: &dyn crate::provision::effects::Reporter = &notes;
            let opts = &cli.selftest_opts;
            let out = match kind {
                SelftestKind::Provision => {
                    let req = ProvisionRequest {
                        vmid: opts.vmid.clone(),
                        from: opts.from.clone(),
                        storage: opts.storage.clone(),
                        keep: opts.keep,
                        dry_run: opts.dry_run,
                        profile: None,
                        isolate_network: opts.network.map(|n| n == NetworkMode::Isolated),
                    };
                    let ran = service::provision(
                        &cfg,
                        &req,
                        TxnKind::SelftestProvision,
                        Ulid::new(),
                        reporter,
                        shutdown_token(),
                    )
                    .await;
                    output::transaction(ran, progress.as_ref().is_some_and(|p| p.showed_preflight()))
                }
                SelftestKind::Restore => {
                    let lines = progress::CopyLines::new(reporter, live_view(&cli.global));
                    let ran = service::restore_test::run(
                        &cfg,
                        service::restore_test::RunOptions { dry_run: opts.dry_run, guest: opts.guest },
                        Ulid::new(),
                        &lines,
                        shutdown_token(),
                    )
                    .await;
                    // The coverage it worked out goes to the hub the way its results do: spooled
                    // for the daemon.
                    if let Some(run) = ran.as_ref().ok().filter(|r| !r.dry_run) {
                        crate::hub::coverage::spool(&cfg, &run.coverage);
                    }
                    output::restore_test(ran)
                }
            };
            let out = notes.add_to(out);
            drop(notes);
            if let Some(p) = progress {
                p.finish();
            }
            out
        }
        (None, Some(cmd)) => {
            if let Command::Doctor = cmd {
                return output::doctor(&crate::doctor::check_all(&cli.global.config).await);
            }
            let cfg = match load_config_as_agent(&cli.global) {
                Ok(c) => c,
                Err(out) => return out,
            };
            match cmd {
                Command::Doctor => output::doctor(&crate::doctor::check_all(&cli.global.config).await),
                Command::Guests => output::guests(service::guests(&cfg).await),
                Command::VmidCheck { vmid } => output::vmid_check(service::vmid_check(&cfg, &vmid).await),
                Command::Journal { op: Some(op), .. } => journal_op(&cfg, op).await,
                Command::Journal { stats: true, since, .. } => {
                    let since_s = match since.as_deref().map(crate::metrics::stats::parse_since).transpose() {
                        Ok(s) => s,
                        Err(msg) => return usage(&msg),
                    };
                    output::journal_stats(service::journal_stats(&cfg, since_s))
                }
                Command::Journal { op: None, last: Some(kind), guest, .. } => {
                    output::journal_last(kind, service::last_of_kind(&cfg, kind, guest), guest)
                }
                Command::Journal { op: None, all: true, kind, guest, .. } => output::journal(
                    service::journal_rows(&cfg),
                    Some(service::archived_rows(&cfg)),
                    kind,
                    guest,
                ),
                Command::Journal { op: None, kind, guest, .. } => {
                    output::journal_recent(service::journal_listing(&cfg), kind, guest)
                }
                Command::RestoreReport => output::restore_report(service::restore_test::report(&cfg).await),
                Command::Destroy { vmid } => {
                    let spool = SpoolReporter::new(cfg.state_dir.clone());
                    let notes = taken_up::TakeUpNotes::new(&spool);
                    match service::nothing_to_destroy(&cfg, &vmid, &notes, &shutdown_token()).await {
                        Ok(Some((vmid, message))) => {
                            return notes.add_to(CommandOutput {
                                json: json!({"vmid": vmid, "outcome": "nothing_to_destroy", "destroyed": false, "message": message, "error": null}),
                                human: message,
                                status: ExitStatus::Ok,
                            })
                        }
                        Ok(None) => {}
                        Err(f) => return notes.add_to(CommandOutput::failure(&f)),
                    }
                    let out = output::transaction(
                        service::destroy(&cfg, &vmid, Ulid::new(), &notes, shutdown_token()).await,
                        false,
                    );
                    notes.add_to(out)
                }
                Command::Run => output::daemon(crate::hub::run(&cfg, shutdown_token()).await),
                Command::ExecHelper { .. } => usage("exec-helper runs on its own (felhom-agent exec-helper)"),
                Command::MetricsPublish { .. } => usage("metrics-publish runs on its own (felhom-agent metrics-publish)"),
            }
        }
    }
}

/// `felhom-agent metrics-publish`: see [`crate::metrics::publish`]. Runs as whoever starts it
/// (root, from its unit); reads the config without its secrets. `--from` must name `[metrics]
/// dir` (the path unit watches the folder the unit's `--from` names; a different folder would
/// publish nothing the agent writes, for good).
fn metrics_publish(
    config: &std::path::Path,
    from: Option<&std::path::Path>,
    to: &std::path::Path,
    idle_exit: Option<u64>,
) -> ExitStatus {
    use crate::metrics::publish::Published;
    let cfg = match crate::config::Config::load_without_secrets(config) {
        Ok(c) => c,
        Err(f) => {
            tracing::error!(code = %f.code, "{}", f.message);
            return crate::error::exit_status(f.code);
        }
    };
    let mut owners = vec![0u32];
    if let Some(name) = &cfg.agent_user {
        if let Ok(Some(u)) = nix::unistd::User::from_name(name) {
            owners.push(u.uid.as_raw());
        }
    }
    let configured = cfg.metrics.dir.clone();
    if let Some(f) = from {
        if f != configured {
            tracing::error!(
                code = %crate::error::ErrorCode::ConfigInvalid,
                "metrics-publish: --from {} is not [metrics] dir {} of {}: the agent writes into {} and this would publish {}; make them agree: the packaged felhom-agent-metrics.path and .service name {} (for another [metrics] dir, a drop-in for each: PathChanged= and ExecStart= with --from, see README.systemd.md)",
                f.display(),
                configured.display(),
                config.display(),
                configured.display(),
                f.display(),
                crate::config::DEFAULT_METRICS_DIR
            );
            return ExitStatus::Environment;
        }
    }
    let from = configured;
    let log = |done: &[(&'static str, Published)]| {
        for (name, verdict) in done {
            match verdict {
                Published::Copied => {
                    tracing::info!(file = name, "published into {}", to.display());
                }
                Published::Absent => {
                    tracing::info!(file = name, "not written yet: nothing published");
                }
                Published::Refused(why) => tracing::warn!(
                    file = name,
                    "{} refused ({}); removed from {}; the agent rewrites it within 15 s",
                    from.join(name).display(),
                    crate::error::outside_text(why),
                    to.display()
                ),
            }
        }
    };
    let ended = match idle_exit {
        Some(secs) => crate::metrics::publish::follow(
            &from,
            to,
            &owners,
            std::time::Duration::from_secs(secs),
            log,
        )
        .map(|passes| {
            tracing::info!(
                "{passes} passes; {} still for {secs} s: done",
                from.display()
            );
        }),
        None => crate::metrics::publish::publish(&from, to, &owners).map(|done| log(&done)),
    };
    match ended {
        Ok(()) => ExitStatus::Ok,
        Err(e) => {
            tracing::error!(code = %crate::error::ErrorCode::ConfigInvalid, "metrics-publish: {e}");
            ExitStatus::Environment
        }
    }
}
