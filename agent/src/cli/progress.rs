//! The live progress view of `--selftest=provision` and `--selftest=restore` on a terminal:
//! the preflight's report as soon as it ran, then one line per phase on stderr (name and
//! elapsed time; a spinner and the UPID while the phase waits on a PVE task; at its end `+`
//! done, `x` failed, `!` needs a person), then a summary table of the phases. Only when
//! stderr is a terminal and the log format is not JSON; otherwise nothing changes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::guest::checks::CheckResult;
use crate::provision::effects::Reporter;
use crate::provision::machine::{Phase, State};

const SPINNER: [char; 4] = ['|', '/', '-', '\\'];
const TICK: Duration = Duration::from_millis(120);

/// The phase on the live line.
#[derive(Debug)]
struct Live {
    phase: Phase,
    since: Instant,
    upid: Option<String>,
}

#[derive(Debug, Default)]
struct View {
    live: Option<Live>,
    done: Vec<(Phase, Duration, char)>,
    tick: usize,
    /// Whether the line naming the transaction and its network was drawn.
    headed: bool,
    /// Whether the preflight's report was drawn.
    preflight_shown: bool,
}

/// The mark of a phase's line once it ended: `x` when it is the failure or its work failed
/// (the next phase is `failed`), `!` for a condition only a person can settle, `+` done.
fn end_mark(phase: Phase, next: Option<Phase>) -> char {
    match (phase, next) {
        (Phase::Failed, _) | (_, Some(Phase::Failed)) => 'x',
        (Phase::NeedsHuman, _) | (_, Some(Phase::NeedsHuman)) => '!',
        _ => '+',
    }
}

impl View {
    /// The line of `live`: with a spinner while it runs (`end` is `None`), else with its mark.
    fn line(&self, live: &Live, end: Option<char>) -> String {
        let secs = live.since.elapsed().as_secs_f64();
        let waits_on_task = end.is_none() && live.phase == Phase::Submitted;
        let mark = end.unwrap_or(SPINNER[self.tick % SPINNER.len()]);
        let mut s = format!("  {mark} {:<13} {secs:>7.1} s", live.phase.as_str());
        if let (true, Some(upid)) = (waits_on_task, live.upid.as_deref()) {
            // A UPID is PVE's, so hostile: printable ASCII only, bounded.
            let clean: String = upid
                .chars()
                .filter(|c| c.is_ascii_graphic())
                .take(120)
                .collect();
            s.push_str(&format!("  waiting on PVE task {clean}"));
        }
        s
    }
}

/// A reporter that draws the progress view and hands everything on to `inner`.
pub struct ProgressReporter<R: Reporter> {
    inner: R,
    view: Arc<Mutex<View>>,
    stop: Arc<AtomicBool>,
    ticker: Option<std::thread::JoinHandle<()>>,
}

fn draw(text: &str, newline: bool) {
    super::sink::write(
        super::sink::Stream::Err,
        format!("\r\x1b[2K{text}{}", if newline { "\n" } else { "" }).as_bytes(),
    );
}

impl<R: Reporter> ProgressReporter<R> {
    /// Start the view (its ticker redraws the live line).
    pub fn start(inner: R) -> Self {
        let view = Arc::new(Mutex::new(View::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let ticker = {
            let (view, stop) = (view.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    if let Ok(mut v) = view.lock() {
                        v.tick += 1;
                        if let Some(live) = &v.live {
                            draw(&v.line(live, None), false);
                        }
                    }
                }
            })
        };
        Self {
            inner,
            view,
            stop,
            ticker: Some(ticker),
        }
    }

    /// Whether the preflight's report was drawn (the command's output then leaves it out).
    pub fn showed_preflight(&self) -> bool {
        self.view.lock().is_ok_and(|v| v.preflight_shown)
    }

    /// Close the last phase's line and print the summary table.
    pub fn finish(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
        let Ok(mut v) = self.view.lock() else { return };
        if let Some(live) = v.live.take() {
            let mark = end_mark(live.phase, None);
            draw(&v.line(&live, Some(mark)), true);
            v.done.push((live.phase, live.since.elapsed(), mark));
        }
        if v.done.is_empty() {
            return;
        }
        let mut table = format!(
            "\n    {:<13} {:>9}   (+ done, x failed, ! needs a person)\n",
            "PHASE", "SECONDS"
        );
        let mut total = Duration::ZERO;
        for (phase, d, mark) in &v.done {
            table.push_str(&format!(
                "  {mark} {:<13} {:>9.2}\n",
                phase.as_str(),
                d.as_secs_f64()
            ));
            total += *d;
        }
        table.push_str(&format!(
            "    {:<13} {:>9.2}\n",
            "total",
            total.as_secs_f64()
        ));
        super::sink::write(super::sink::Stream::Err, table.as_bytes());
    }
}

impl<R: Reporter> Reporter for ProgressReporter<R> {
    fn phase(&self, state: &State, record: u64) {
        if let Ok(mut v) = self.view.lock() {
            let same = v.live.as_ref().is_some_and(|l| l.phase == state.phase());
            if same {
                if let Some(live) = v.live.as_mut() {
                    live.upid = state.upid().map(str::to_string);
                }
            } else {
                if !v.headed && state.kind() != crate::provision::machine::TxnKind::Destroy {
                    v.headed = true;
                    draw(
                        &format!(
                            "transaction {} vmid {}: network {}",
                            state.txn(),
                            state.vmid().map_or("-".to_string(), |n| n.to_string()),
                            if state.request().isolate_network {
                                "isolated (no NIC at the start but on the lab bridge)"
                            } else {
                                "stored (the backup's NICs)"
                            }
                        ),
                        true,
                    );
                }
                if let Some(live) = v.live.take() {
                    let mark = end_mark(live.phase, Some(state.phase()));
                    draw(&v.line(&live, Some(mark)), true);
                    v.done.push((live.phase, live.since.elapsed(), mark));
                }
                let live = Live {
                    phase: state.phase(),
                    since: Instant::now(),
                    upid: state.upid().map(str::to_string),
                };
                draw(&v.line(&live, None), false);
                v.live = Some(live);
            }
        }
        self.inner.phase(state, record);
    }

    fn result(
        &self,
        state: &State,
        checks: &[CheckResult],
        isolation: Option<&str>,
    ) -> Result<(), String> {
        self.inner.result(state, checks, isolation)
    }

    fn preflight(&self, text: &str) {
        if let Ok(mut v) = self.view.lock() {
            draw(text.trim_end(), true);
            v.preflight_shown = true;
            if let Some(live) = &v.live {
                draw(&v.line(live, None), false);
            }
        }
        self.inner.preflight(text);
    }

    fn interrupted(&self, state: &State, record: u64, why: &crate::error::Failure) {
        self.inner.interrupted(state, record, why);
    }

    fn taken_up(&self, from: &State, driven: &crate::provision::effects::Driven) {
        self.inner.taken_up(from, driven);
    }
}

impl<R: Reporter> Drop for ProgressReporter<R> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The progress of a restore-test run on a terminal: one line per phase of each copy, naming
/// the guest whose backup it proves and the copy's vmid (copies run side by side, so one live
/// line would mix them). Everything is handed on to `inner`.
pub struct CopyLines<'a> {
    inner: &'a dyn Reporter,
    show: bool,
}

impl<'a> CopyLines<'a> {
    /// Lines on stderr when `show` (a terminal), else only `inner`.
    pub fn new(inner: &'a dyn Reporter, show: bool) -> Self {
        CopyLines { inner, show }
    }
}

impl Reporter for CopyLines<'_> {
    fn phase(&self, state: &State, record: u64) {
        if self.show {
            let guest = crate::pve::types::backup_guest(&state.request().volid)
                .map_or_else(|| "-".to_string(), |g| g.to_string());
            let copy = state
                .vmid()
                .map_or_else(|| "-".to_string(), |v| v.to_string());
            let mark = match state.phase() {
                Phase::Failed => 'x',
                Phase::NeedsHuman => '!',
                _ => '+',
            };
            super::sink::write(
                super::sink::Stream::Err,
                format!(
                    "  {mark} guest {guest:>6} copy {copy:>6}  {}\n",
                    state.phase().as_str()
                )
                .as_bytes(),
            );
        }
        self.inner.phase(state, record);
    }

    fn result(
        &self,
        state: &State,
        checks: &[CheckResult],
        isolation: Option<&str>,
    ) -> Result<(), String> {
        self.inner.result(state, checks, isolation)
    }

    fn preflight(&self, text: &str) {
        self.inner.preflight(text);
    }

    fn interrupted(&self, state: &State, record: u64, why: &crate::error::Failure) {
        self.inner.interrupted(state, record, why);
    }

    fn taken_up(&self, from: &State, driven: &crate::provision::effects::Driven) {
        self.inner.taken_up(from, driven);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_phase_is_marked_apart_from_a_finished_one() {
        assert_eq!(end_mark(Phase::Validated, Some(Phase::Submitted)), '+');
        // The phase whose work failed, and the failure itself.
        assert_eq!(end_mark(Phase::Launched, Some(Phase::Failed)), 'x');
        assert_eq!(end_mark(Phase::Failed, Some(Phase::Destroyed)), 'x');
        assert_eq!(end_mark(Phase::Failed, None), 'x');
        assert_eq!(end_mark(Phase::Created, Some(Phase::NeedsHuman)), '!');
        assert_eq!(end_mark(Phase::NeedsHuman, None), '!');
        assert_eq!(end_mark(Phase::Destroyed, None), '+');
        let view = View::default();
        let live = Live {
            phase: Phase::Failed,
            since: Instant::now(),
            upid: None,
        };
        assert!(view.line(&live, Some('x')).starts_with("  x failed"));
    }
}
