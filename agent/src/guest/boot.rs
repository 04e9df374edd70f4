//! The boot wait: after the launch proof (an exec answers) and before the bootstrap and the
//! checks, wait until the guest's boot has ended, so the checks judge a booted guest.
//!
//! Right after a container is RUNNING its systemd says `initializing` and no unit has failed
//! yet; a unit that fails a few seconds into the boot would pass `no-failed-units` if the checks
//! ran then. With systemd (`/run/systemd/system` exists: sd_booted(3)) the wait is
//! `systemctl is-system-running --wait`, which returns once the manager left `initializing`
//! and `starting` (systemd `src/systemctl/systemctl-is-system-running.c`); `running` and
//! `degraded` end it (a degraded guest is then judged by the checks, which name the failed
//! units), any other state (`maintenance`, `stopping`, `offline`) is a boot that did not
//! complete. A guest without systemd (busybox or another init) has no boot state to ask for:
//! the launch proof's answering exec is all that is waited for, and the report says so.
//!
//! The wait is bounded; at its end the state seen and the jobs systemd still runs are named
//! (error code `boot_unfinished`). Guest output is hostile: only a closed set of state words is
//! read, and what is quoted is escaped and clipped.

use std::time::{Duration, Instant};

use super::exec::{ExecError, ExecRequest, GuestExec, GuestExit};

pub use crate::config::{BOOT_TIMEOUT, BOOT_TIMEOUT_SECS};
/// The time the final read of the state (after the timeout) may take.
const STATE_READ_TIMEOUT: Duration = Duration::from_secs(20);
/// The pause between two asks when the answer was not final (a systemd older than `--wait`).
const POLL: Duration = Duration::from_secs(1);

/// What the guest runs: whether systemd is its init, and if so the wait's answer. systemd
/// makes `/run/systemd/system` in `mount_setup()` (`src/shared/mount-setup.c`), after its
/// early mounts: an exec can answer before that, while PID 1 is already systemd and its bus not
/// yet there. So PID 1's own binary (`/proc/1/exe`, `/proc/1/comm`) also says systemd; then
/// `systemctl` prints no state word ("Failed to connect to bus") and the wait asks again.
const WAIT_SCRIPT: &str =
    "command -v systemctl >/dev/null 2>&1 && { [ -d /run/systemd/system ] || \
case \"$(readlink /proc/1/exe 2>/dev/null) $(cat /proc/1/comm 2>/dev/null)\" in \
*/systemd\\ *|*\\ systemd) true;; *) false;; esac; } && \
{ printf 'systemd '; systemctl is-system-running --wait 2>/dev/null; exit 0; }; echo no-systemd";
/// The read after the timeout: the state, then up to five jobs systemd still runs, the running
/// ones first (they hold the others).
const STATE_SCRIPT: &str = "printf 'systemd '; systemctl is-system-running 2>/dev/null; \
systemctl list-jobs --no-legend --no-pager 2>/dev/null | awk '$4 == \"running\" {print; next} \
{w[n++] = $0} END {for (i = 0; i < n; i++) print w[i]}' | head -n 5";

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

/// A script the boot wait runs in place of its own (`/bin/sh -c <script> sh <args>…`, with
/// `env`), to act while the boot goes on: it ends by printing the wait's answer as the last
/// line (`systemd <state>`, or `no-systemd`); its other lines are handed back as they were
/// printed (hostile: the caller reads only its own closed set of words).
#[derive(Debug, Clone, Default)]
pub struct BootWatch {
    /// The script (`sh -c`).
    pub script: String,
    /// Its positional arguments.
    pub args: Vec<String>,
    /// Its environment, beside the exec's controlled one.
    pub env: Vec<(&'static str, String)>,
}

/// Wait until the guest's boot has ended, at most `timeout`. `Ok`: what was waited for and
/// seen, for the report. `Err`: the state seen at the end (and the jobs still running), or why
/// the guest could not be asked.
pub async fn wait_boot<E: GuestExec>(exec: &E, timeout: Duration) -> Result<String, String> {
    wait_boot_watched(exec, timeout, None).await.0
}

/// [`wait_boot`], running `watch` in place of the plain wait: also the watch's own lines (at
/// most 64; none from an answer cut by the timeout).
pub async fn wait_boot_watched<E: GuestExec>(
    exec: &E,
    timeout: Duration,
    watch: Option<&BootWatch>,
) -> (Result<String, String>, Vec<String>) {
    let mut lines = Vec::new();
    let waited = wait_boot_inner(exec, timeout, watch, &mut lines).await;
    (waited, lines)
}

async fn wait_boot_inner<E: GuestExec>(
    exec: &E,
    timeout: Duration,
    watch: Option<&BootWatch>,
    lines: &mut Vec<String>,
) -> Result<String, String> {
    let started = Instant::now();
    let deadline = started + timeout;
    let mut last = BootState::Booting("no answer");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let mut req = match watch {
            Some(w) => {
                let mut argv = vec!["/bin/sh".to_string(), "-c".into(), w.script.clone()];
                argv.push("sh".into());
                argv.extend(w.args.iter().cloned());
                let mut req = ExecRequest::new(argv);
                for (k, v) in &w.env {
                    req = req.env(*k, v.clone());
                }
                req
            }
            None => ExecRequest::new(["/bin/sh", "-c", WAIT_SCRIPT]),
        };
        req = req.timeout(left).output_cap(16 * 1024);
        match exec.exec(&req).await {
            Ok(out) if out.exit == GuestExit::TimedOut => break,
            Ok(out) => {
                let text = out.stdout.text();
                let mut state = "";
                for line in text.lines() {
                    if is_state_line(line) {
                        state = line;
                    } else if lines.len() < 64 {
                        lines.push(line.to_string());
                    }
                }
                last = parse_state(state);
                let took = started.elapsed().as_secs_f64();
                match last {
                    BootState::NoSystemd => {
                        return Ok("no systemd in the guest (/run/systemd/system is absent): \
                             its answering exec (the launch proof) is all that was waited for"
                            .to_string())
                    }
                    BootState::Running => {
                        return Ok(format!("systemd: running after {took:.1}s"));
                    }
                    BootState::Degraded => {
                        return Ok(format!(
                            "systemd: degraded after {took:.1}s (units failed; the checks judge them)"
                        ));
                    }
                    BootState::Other(state) => {
                        return Err(format!(
                            "the guest's systemd is {state} after {took:.1}s: its boot did not complete"
                        ));
                    }
                    BootState::Booting(_) => {}
                }
            }
            Err(e @ ExecError::NotRunning { .. }) => {
                return Err(format!("the guest stopped during its boot: {e}"));
            }
            Err(e) => return Err(format!("the guest's boot state could not be read: {e}")),
        }
        tokio::time::sleep(POLL.min(deadline.saturating_duration_since(Instant::now()))).await;
    }
    // The timeout: read the state and what still runs, to name them.
    let req = ExecRequest::new(["/bin/sh", "-c", STATE_SCRIPT])
        .timeout(STATE_READ_TIMEOUT)
        .output_cap(16 * 1024);
    let (state, jobs) = match exec.exec(&req).await {
        Ok(out) if out.exit != GuestExit::TimedOut => {
            let text = out.stdout.text();
            (parse_state(&text), pending_jobs(&text))
        }
        _ => (last, Vec::new()),
    };
    let word = match state {
        BootState::NoSystemd => "no systemd",
        BootState::Running => "running",
        BootState::Degraded => "degraded",
        BootState::Booting(w) | BootState::Other(w) => w,
    };
    let jobs = if jobs.is_empty() {
        String::new()
    } else {
        format!("; jobs still running: {}", jobs.join(", "))
    };
    Err(format!(
        "the guest's boot did not end within {}s ([provision] boot_timeout_secs): its systemd is {word}{jobs}",
        timeout.as_secs()
    ))
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
