//! The boot wait: after the launch proof (an exec answers) and before the bootstrap and the
//! checks, wait until the guest's boot has ended, so the checks judge a booted guest.
//!
//! Right after a container is RUNNING its systemd says `initializing` and no unit has failed
//! yet; a unit that fails a few seconds into the boot would pass `no-failed-units` if the checks
//! ran then. With systemd (`/run/systemd/system` exists: sd_booted(3)) the wait asks
//! `systemctl is-system-running` once a second until the manager has left `initializing` and
//! `starting` (systemd `src/systemctl/systemctl-is-system-running.c`); `running` and
//! `degraded` end it (a degraded guest is then judged by the checks, which name the failed
//! units), any other state (`maintenance`, `stopping`, `offline`) is a boot that did not
//! complete. A guest without systemd (busybox or another init) has no boot state to ask for:
//! the launch proof's answering exec is all that is waited for, and the report says so.
//!
//! The wait is bounded inside the guest; at its end the state seen and the jobs systemd still
//! runs are named (error code `boot_unfinished`). It is one exec, whatever runs beside it (an
//! isolated copy's lab: [`BootPlan`]): each exec is a trip into the guest (a `pct` process on a
//! node, a guest-agent `exec` and its polls). Guest output is hostile: only a closed set of state words is
//! read, and what is quoted is escaped and clipped.

use std::time::{Duration, Instant};

use super::exec::{ExecError, ExecRequest, GuestExec, GuestExit};

pub use crate::config::{BOOT_TIMEOUT, BOOT_TIMEOUT_SECS};
/// The time the final read of the state (after the timeout) may take.
const STATE_READ_TIMEOUT: Duration = Duration::from_secs(20);

/// The boot trip's shell functions. `felhom_init`: whether systemd is the guest's init. systemd
/// makes `/run/systemd/system` in `mount_setup()` (`src/shared/mount-setup.c`), after its early
/// mounts: an exec can answer before that, while PID 1 is already systemd and its bus not yet
/// there, so PID 1's own binary (`/proc/1/exe`, `/proc/1/comm`) also says systemd; `systemctl`
/// then answers `offline` (it asks `sd_booted()` first: `src/systemctl/systemctl-is-system-running.c`)
/// or nothing, and the wait asks again. `felhom_wait SECS`: asks `is-system-running` once a
/// second (a poll, not `--wait`: the wait stays bounded inside the guest, and the tick runs
/// between two asks) until systemd has left `initializing` and `starting`, and prints the answer
/// (`systemd <state>`, or `no-systemd`); after SECS it prints `felhom-timeout` and the state
/// read (the state and up to five jobs systemd still runs, the running ones first).
const WAIT_FNS: &str = r#"
felhom_init() {
  command -v systemctl >/dev/null 2>&1 && { [ -d /run/systemd/system ] ||
    case "$(readlink /proc/1/exe 2>/dev/null) $(cat /proc/1/comm 2>/dev/null)" in
      */systemd\ *|*\ systemd) true;; *) false;; esac; }
}
felhom_wait() {
  felhom_start=$(felhom_ms); felhom_end=$(( $(date +%s) + $1 ))
  while :; do
    felhom_init || { echo no-systemd; felhom_state=none; return; }
    felhom_state=$(systemctl is-system-running 2>/dev/null)
    case $felhom_state in
      running|degraded|maintenance|stopping)
        echo "felhom-took $(( $(felhom_ms) - felhom_start ))"; echo "systemd $felhom_state"; return;;
      offline) [ -d /run/systemd/system ] && { echo "systemd offline"; return; };;
    esac
    felhom_tick
    if [ "$(date +%s)" -ge "$felhom_end" ]; then
      echo felhom-timeout; felhom_state=timeout
      printf 'systemd '; systemctl is-system-running 2>/dev/null
      systemctl list-jobs --no-legend --no-pager 2>/dev/null | awk '$4 == "running" {print; next}
        {w[n++] = $0} END {for (i = 0; i < n; i++) print w[i]}' | head -n 5
      return
    fi
    sleep 1
  done
}
"#;

/// systemd's answer to `is-system-running`, as read from the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootState {
    /// Not systemd: no boot state to ask for.
    NoSystemd,
    /// `running`.
    Running,
    /// `degraded`: booted, some unit failed.
    Degraded,
    /// `initializing` or `starting` (still booting), or no answer yet.
    Booting(&'static str),
    /// `maintenance`, `stopping`, `offline`: the boot did not complete.
    Other(&'static str),
}

/// Whether a line of the guest's output is the wait's answer (`systemd <state>`, `no-systemd`).
fn is_state_line(line: &str) -> bool {
    let line = line.trim();
    line == "no-systemd" || line == "systemd" || line.starts_with("systemd ")
}

/// The closed set of states `is-system-running` answers (systemd `src/core/manager.c`
/// `manager_state_table`), mapped from the guest's first output line.
pub fn parse_state(stdout: &str) -> BootState {
    let first = stdout.lines().next().unwrap_or("").trim();
    if first == "no-systemd" {
        return BootState::NoSystemd;
    }
    let word = first.strip_prefix("systemd").map(str::trim).unwrap_or("");
    match word {
        "running" => BootState::Running,
        "degraded" => BootState::Degraded,
        "initializing" => BootState::Booting("initializing"),
        "starting" => BootState::Booting("starting"),
        "maintenance" => BootState::Other("maintenance"),
        "stopping" => BootState::Other("stopping"),
        "offline" => BootState::Other("offline"),
        "unknown" => BootState::Booting("unknown"),
        _ => BootState::Booting("no answer"),
    }
}

/// The jobs systemd still runs, from the state read's lines after the first (escaped, clipped).
fn pending_jobs(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().nth(1))
        .take(5)
        .map(crate::error::outside_text)
        .collect()
}

/// What one boot trip runs beside the wait, all in the same exec: an isolated copy's lab.
#[derive(Debug, Clone, Default)]
pub struct BootPlan {
    /// Run first, as soon as the guest answers (its own subshell; its lines: [`BootTrip::before`]).
    pub before: Option<String>,
    /// The body of `felhom_tick`, run between two asks of the wait (its lines:
    /// [`BootTrip::tick`]); its variables live on in the script.
    pub tick: Option<String>,
    /// Run once the wait saw systemd `running` or `degraded` (its own subshell), then the wait
    /// again (its lines and the second wait: [`BootTrip::after`]).
    pub after: Option<String>,
    /// The script's positional arguments.
    pub args: Vec<String>,
    /// Its environment, beside the exec's controlled one.
    pub env: Vec<(&'static str, String)>,
}

/// What one boot trip saw.
#[derive(Debug, Clone)]
pub struct BootTrip {
    /// The wait: `Ok`, what was waited for and seen, for the report; `Err`, the state seen at
    /// the end (and the jobs still running), or why the guest could not be asked.
    pub first: Result<String, String>,
    /// The lines of the plan's `before` (at most 256; hostile).
    pub before: Vec<String>,
    /// The lines of the plan's `tick` during the first wait (at most 64; hostile).
    pub tick: Vec<String>,
    /// The lines of the plan's `after` and the second wait, when they ran.
    pub after: Option<(Vec<String>, Result<String, String>)>,
}

/// Wait until the guest's boot has ended, at most `timeout`. `Ok`: what was waited for and
/// seen, for the report. `Err`: the state seen at the end (and the jobs still running), or why
/// the guest could not be asked.
pub async fn wait_boot<E: GuestExec>(exec: &E, timeout: Duration) -> Result<String, String> {
    boot_trip(exec, timeout, &BootPlan::default()).await.first
}

/// The boot wait and what `plan` runs beside it, in one exec: `before`, the wait (each of its
/// waits at most `timeout`) with the `tick`, then `after` and a second wait.
pub async fn boot_trip<E: GuestExec>(exec: &E, timeout: Duration, plan: &BootPlan) -> BootTrip {
    let secs = timeout.as_secs().max(1);
    let mut argv = vec![
        "/bin/sh".to_string(),
        "-c".into(),
        script(plan, secs),
        "sh".into(),
    ];
    argv.extend(plan.args.iter().cloned());
    let mut req = ExecRequest::new(argv);
    for (k, v) in &plan.env {
        req = req.env(*k, v.clone());
    }
    // Each wait is bounded inside the guest; the exec's own bound leaves room for the restarts
    // of `after` and for a `systemctl` that never answers.
    let waits = if plan.after.is_some() { 3 } else { 1 };
    let req = req
        .timeout(timeout * waits + STATE_READ_TIMEOUT)
        .output_cap(64 * 1024);
    let started = Instant::now();
    let out = match exec.exec(&req).await {
        Ok(out) => out,
        Err(e) => {
            let why = match e {
                ExecError::NotRunning { .. } => format!("the guest stopped during its boot: {e}"),
                _ => format!("the guest's boot state could not be read: {e}"),
            };
            return BootTrip {
                first: Err(why),
                before: Vec::new(),
                tick: Vec::new(),
                after: None,
            };
        }
    };
    let text = out.stdout.text();
    let mut sections: Vec<(&str, Vec<&str>)> = Vec::new();
    for line in text.lines().take(1024) {
        match line.strip_prefix("felhom-step ") {
            Some(name @ ("before" | "wait" | "after" | "again")) => {
                sections.push((name, Vec::new()))
            }
            _ => {
                if let Some((_, lines)) = sections.last_mut() {
                    lines.push(line);
                }
            }
        }
    }
    let section = |name: &str| {
        sections
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, l)| l.as_slice())
    };
    let cut = out.exit == GuestExit::TimedOut;
    let mut tick = Vec::new();
    let first = match section("wait") {
        Some(lines) => read_wait(lines, secs, cut, Some(&mut tick)),
        None => Err(match out.exit {
            GuestExit::TimedOut => format!(
                "the guest did not answer within {}s of its boot",
                started.elapsed().as_secs()
            ),
            _ => format!(
                "the guest's boot state could not be read: {}",
                out.summary()
            ),
        }),
    };
    let owned = |lines: Option<&[&str]>, max: usize| -> Vec<String> {
        lines
            .unwrap_or(&[])
            .iter()
            .take(max)
            .map(|l| l.to_string())
            .collect()
    };
    let after = section("after").map(|lines| {
        let again = match section("again") {
            Some(again) => read_wait(again, secs, cut, None),
            None => Err(format!(
                "the guest's boot state could not be read after the isolation: {}",
                out.summary()
            )),
        };
        (owned(Some(lines), 256), again)
    });
    BootTrip {
        first,
        before: owned(section("before"), 256),
        tick,
        after,
    }
}

/// The boot trip's script for `plan`, each wait at most `secs`.
pub fn script(plan: &BootPlan, secs: u64) -> String {
    let mut script = format!(
        "{}{WAIT_FNS}felhom_tick() {{\n{}\n:\n}}\n",
        super::frames::RUN_FNS,
        plan.tick.as_deref().unwrap_or(":")
    );
    if let Some(before) = &plan.before {
        script.push_str(&format!("echo 'felhom-step before'\n(\n{before}\n)\n"));
    }
    script.push_str(&format!("echo 'felhom-step wait'\nfelhom_wait {secs}\n"));
    if let Some(after) = &plan.after {
        script.push_str(&format!(
            "case $felhom_state in running|degraded)\n echo 'felhom-step after'\n (\n{after}\n )\n \
             echo 'felhom-step again'\n felhom_wait {secs};;\nesac\n"
        ));
    }
    script
}

/// One wait's lines: its answer (the last state line, its time from `felhom-took`), or the
/// timeout's state read. `cut`: the exec was stopped before the wait ended. The other lines go
/// to `tick`.
fn read_wait(
    lines: &[&str],
    secs: u64,
    cut: bool,
    mut tick: Option<&mut Vec<String>>,
) -> Result<String, String> {
    let mut state = "";
    let mut took = 0.0;
    let mut timed_out: Option<usize> = None;
    for (i, line) in lines.iter().enumerate() {
        if *line == "felhom-timeout" {
            timed_out = Some(i + 1);
            break;
        }
        if let Some(ms) = line.strip_prefix("felhom-took ") {
            took = ms.trim().parse::<u64>().unwrap_or(0) as f64 / 1000.0;
        } else if is_state_line(line) {
            state = line;
        } else if let Some(t) = tick.as_deref_mut() {
            if t.len() < 64 {
                t.push(line.to_string());
            }
        }
    }
    if timed_out.is_none() && state.is_empty() {
        let why = if cut {
            "the wait was stopped"
        } else {
            "the wait ended without an answer"
        };
        return Err(format!(
            "the guest's boot did not end within {secs}s ([provision] boot_timeout_secs): {why}"
        ));
    }
    if let Some(from) = timed_out {
        let read = lines[from..].join("\n");
        let word = match parse_state(&read) {
            BootState::NoSystemd => "no systemd",
            BootState::Running => "running",
            BootState::Degraded => "degraded",
            BootState::Booting(w) | BootState::Other(w) => w,
        };
        let jobs = pending_jobs(&read);
        let jobs = if jobs.is_empty() {
            String::new()
        } else {
            format!("; jobs still running: {}", jobs.join(", "))
        };
        return Err(format!(
            "the guest's boot did not end within {secs}s ([provision] boot_timeout_secs): its systemd is {word}{jobs}"
        ));
    }
    match parse_state(state) {
        BootState::NoSystemd => Ok("no systemd in the guest (/run/systemd/system is absent): \
             its answering exec (the launch proof) is all that was waited for"
            .to_string()),
        BootState::Running => Ok(format!("systemd: running after {took:.1}s")),
        BootState::Degraded => Ok(format!(
            "systemd: degraded after {took:.1}s (units failed; the checks judge them)"
        )),
        BootState::Other(state) => Err(format!(
            "the guest's systemd is {state} after {took:.1}s: its boot did not complete"
        )),
        BootState::Booting(state) => Err(format!(
            "the guest's boot did not end within {secs}s ([provision] boot_timeout_secs): its systemd is {state}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_are_read_from_a_closed_set() {
        assert_eq!(parse_state("no-systemd\n"), BootState::NoSystemd);
        assert_eq!(parse_state("systemd running\n"), BootState::Running);
        assert_eq!(parse_state("systemd degraded\n"), BootState::Degraded);
        assert_eq!(
            parse_state("systemd starting\n"),
            BootState::Booting("starting")
        );
        assert_eq!(
            parse_state("systemd maintenance\n"),
            BootState::Other("maintenance")
        );
        // Anything else (older systemd without --wait, a guest's own words) is no answer.
        assert_eq!(parse_state("systemd \n"), BootState::Booting("no answer"));
        assert_eq!(
            parse_state("systemd running; rm -rf /\n"),
            BootState::Booting("no answer")
        );
        assert_eq!(parse_state(""), BootState::Booting("no answer"));
    }

    /// Runs the trip's script in a local shell whose `systemctl` is `fake` and whose init is
    /// taken for systemd (this machine's is not): one exec each, counted.
    struct Local {
        dir: tempfile::TempDir,
        execs: std::sync::atomic::AtomicUsize,
    }

    impl Local {
        fn new(fake: &str) -> Self {
            use std::os::unix::fs::PermissionsExt;
            let dir = tempfile::tempdir().expect("temp dir");
            let path = dir.path().join("systemctl");
            std::fs::write(&path, format!("#!/bin/sh\n{fake}\n")).expect("write");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
            Self {
                dir,
                execs: Default::default(),
            }
        }
    }

    impl GuestExec for Local {
        fn guest(&self) -> super::super::exec::GuestRef {
            super::super::exec::GuestRef {
                kind: crate::pve::GuestKind::Lxc,
                vmid: 120,
            }
        }

        async fn exec(
            &self,
            request: &ExecRequest,
        ) -> Result<super::super::exec::ExecOutcome, ExecError> {
            self.execs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut argv = request.argv.clone();
            argv[2] = argv[2].replace("felhom_init() {\n", "felhom_init() {\n  return 0\n");
            let path = format!(
                "{}:{}",
                self.dir.path().display(),
                std::env::var("PATH").unwrap_or_default()
            );
            let started = Instant::now();
            let out = std::process::Command::new(&argv[0])
                .args(&argv[1..])
                .env("PATH", path)
                .envs(request.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .output()
                .expect("sh runs");
            Ok(super::super::exec::ExecOutcome {
                exit: GuestExit::Exited(i64::from(out.status.code().unwrap_or(-1))),
                stdout: super::super::exec::Captured::capped(out.stdout, usize::MAX, false),
                stderr: super::super::exec::Captured::capped(out.stderr, usize::MAX, false),
                duration: started.elapsed(),
            })
        }

        async fn push_file(
            &self,
            _source: &super::super::exec::PushSource,
            _guest_path: &str,
            _mode: u32,
        ) -> Result<super::super::exec::PushReceipt, ExecError> {
            unreachable!("the boot trip pushes nothing")
        }
    }

    #[tokio::test]
    async fn one_exec_waits_while_systemd_starts_and_runs_the_plan_around_the_wait() {
        // `starting` for the first two asks, then `degraded`.
        let g = Local::new(
            "c=\"$(dirname \"$0\")/asks\"; echo x >>\"$c\"\n\
             case \"$1\" in is-system-running) if [ \"$(wc -l <\"$c\")\" -le 2 ]; then echo starting; else echo degraded; fi;; esac",
        );
        let plan = BootPlan {
            before: Some("echo \"given $1\"".into()),
            tick: Some("echo tick".into()),
            after: Some("echo settled; echo \"$FELHOM_X\"".into()),
            args: vec!["eth0".into()],
            env: vec![("FELHOM_X", "from-env".into())],
        };
        let trip = boot_trip(&g, Duration::from_secs(30), &plan).await;
        assert_eq!(g.execs.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(trip.before, ["given eth0"]);
        assert_eq!(trip.tick, ["tick", "tick"]);
        let first = trip.first.expect("the boot ended");
        assert!(first.starts_with("systemd: degraded after "), "{first}");
        let (after, again) = trip.after.expect("the plan's after ran");
        assert_eq!(after, ["settled", "from-env"]);
        assert!(again
            .expect("the second wait")
            .starts_with("systemd: degraded after "));
    }

    #[tokio::test]
    async fn a_boot_that_does_not_end_names_its_state_and_jobs_and_runs_nothing_after() {
        let g = Local::new(
            "case \"$1\" in is-system-running) echo starting;; \
             list-jobs) printf '7 a.service start waiting\\n9 slow.service start running\\n';; esac",
        );
        let plan = BootPlan {
            after: Some("echo settled".into()),
            ..BootPlan::default()
        };
        let trip = boot_trip(&g, Duration::from_secs(2), &plan).await;
        let err = trip.first.expect_err("the boot did not end");
        assert!(
            err.contains("did not end within 2s")
                && err.contains("its systemd is starting")
                && err.contains("jobs still running: slow.service, a.service"),
            "{err}"
        );
        assert!(trip.after.is_none());
        // Without systemd nothing is waited for.
        let g = Local::new("exit 0");
        let mut req_script = script(&BootPlan::default(), 5);
        req_script = req_script.replace("command -v systemctl", "false");
        let out = std::process::Command::new("/bin/sh")
            .args(["-c", &req_script])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            text.lines().collect::<Vec<_>>(),
            ["felhom-step wait", "no-systemd"],
            "{text}"
        );
        drop(g);
    }

    #[test]
    fn pending_jobs_are_the_unit_column_clipped_to_five() {
        let text = "systemd starting\n\
                    12 slow.service start running\n\
                    13 a.service start waiting\n\
                    14 b.service start waiting\n\
                    15 c.service start waiting\n\
                    16 d.service start waiting\n\
                    17 e.service start waiting\n";
        let jobs = pending_jobs(text);
        assert_eq!(jobs.len(), 5);
        assert_eq!(jobs[0], "slow.service");
    }
}
