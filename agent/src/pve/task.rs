//! Following a PVE task by its UPID to the end.
//!
//! `stopped` with `OK` is success; `WARNINGS: N` is success with the warnings kept; anything
//! else is the task's error, kept with PVE's text and the tail of the log. Polling starts
//! quick and backs off to at most one poll a second. Cancellation (Ctrl-C, SIGTERM) asks PVE
//! to stop the task before returning.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::client::PveClient;
use super::error::PveError;
use super::upid::Upid;

/// First poll interval.
pub const POLL_FIRST: Duration = Duration::from_millis(50);
/// Longest poll interval.
pub const POLL_MAX: Duration = Duration::from_secs(1);
/// Lines of log kept with a failed task.
pub const LOG_TAIL_LINES: u64 = 20;

/// How a successful task ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskOutcome {
    /// The task.
    pub upid: Upid,
    /// `OK` or `WARNINGS: N`.
    pub exitstatus: String,
    /// The number of warnings, when it ended with warnings.
    pub warnings: Option<u32>,
    /// The `WARN:` lines of the log, when there were warnings.
    pub warning_lines: Vec<String>,
    /// How long it was followed.
    pub waited: Duration,
}

/// Options of [`wait_task`].
#[derive(Debug, Clone)]
pub struct WaitOptions {
    /// Give up after this long (the task keeps running; say so).
    pub timeout: Duration,
    /// Cancelled → stop following (the task goes on) and return [`PveError::Interrupted`].
    pub cancel: CancellationToken,
}

impl WaitOptions {
    /// A timeout and a fresh token that is never cancelled.
    pub fn timeout(timeout: Duration) -> Self {
        Self {
            timeout,
            cancel: CancellationToken::new(),
        }
    }
}

/// The poll interval after the task has run for `elapsed`: a twenty-fifth of it, at least
/// [`POLL_FIRST`] and at most [`POLL_MAX`]. The end of a task is noticed at most 4% of its
/// run time late (and never more than a second), with few requests for long tasks.
pub fn next_interval(elapsed: Duration) -> Duration {
    (elapsed / 25).clamp(POLL_FIRST, POLL_MAX)
}

/// Parse `WARNINGS: N`.
pub fn parse_warnings(exitstatus: &str) -> Option<u32> {
    exitstatus
        .strip_prefix("WARNINGS: ")
        .and_then(|n| n.trim().parse().ok())
}

/// Follow `upid` until it stops.
pub async fn wait_task(
    client: &PveClient,
    upid: &Upid,
    opts: &WaitOptions,
) -> Result<TaskOutcome, PveError> {
    let started = Instant::now();
    let deadline = started + opts.timeout;
    loop {
        let status = client.task_status(upid).await?;
        if status.status == "stopped" {
            let exitstatus = status
                .exitstatus
                .unwrap_or_else(|| "unexpected status".to_string());
            if exitstatus == "OK" {
                return Ok(TaskOutcome {
                    upid: upid.clone(),
                    exitstatus,
                    warnings: None,
                    warning_lines: vec![],
                    waited: started.elapsed(),
                });
            }
            if let Some(n) = parse_warnings(&exitstatus) {
                let warning_lines = log_tail(client, upid, 200)
                    .await
                    .into_iter()
                    .filter(|l| l.starts_with("WARN:"))
                    .collect();
                return Ok(TaskOutcome {
                    upid: upid.clone(),
                    exitstatus,
                    warnings: Some(n),
                    warning_lines,
                    waited: started.elapsed(),
                });
            }
            let log_tail = log_tail(client, upid, LOG_TAIL_LINES).await;
            return Err(PveError::TaskFailed {
                upid: upid.clone(),
                exitstatus,
                log_tail,
            });
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(PveError::TaskTimeout {
                upid: upid.clone(),
                waited: started.elapsed(),
            });
        }
        let sleep = next_interval(started.elapsed()).min(deadline - now);
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = opts.cancel.cancelled() => {
                // Never a task_stop here: a shutdown stops the waiting, not PVE's work.
                return Err(PveError::Interrupted { upid: upid.clone() });
            }
        }
    }
}

/// Lines read per request when a task log without `total` is read to its end.
const LOG_PAGE: u64 = 500;
/// Requests at most when a task log without `total` is read to its end.
const LOG_PAGES_MAX: u64 = 20;

/// The last `n` lines of a task log (best effort: an unreadable log gives none).
///
/// PVE answers every log request with `total`, the number of lines of the whole log, beside
/// `data` (pve-manager `PVE/API2/Tasks.pm` `read_task_log` sets the result attribute from
/// pve-common `src/PVE/Tools.pm` `dump_logfile`, which counts every line whatever `start` and
/// `limit`): one line asked for gives the total, then the last `n` are read. An answer without
/// `total` is read page by page to its end (at most [`LOG_PAGES_MAX`] pages), keeping the last
/// `n` lines.
pub async fn log_tail(client: &PveClient, upid: &Upid, n: u64) -> Vec<String> {
    if n == 0 {
        return vec![];
    }
    let total = match client.task_log(upid, 0, 1).await {
        Ok((_, Some(total))) => total,
        Ok((_, None)) => return log_tail_by_pages(client, upid, n).await,
        Err(_) => return vec![],
    };
    let start = total.saturating_sub(n);
    match client.task_log(upid, start, n).await {
        Ok((lines, _)) => lines.into_iter().map(|l| l.t).collect(),
        Err(_) => vec![],
    }
}

async fn log_tail_by_pages(client: &PveClient, upid: &Upid, n: u64) -> Vec<String> {
    let keep = usize::try_from(n).unwrap_or(usize::MAX);
    let mut tail: std::collections::VecDeque<String> = std::collections::VecDeque::new();
    for page in 0..LOG_PAGES_MAX {
        let Ok((lines, _)) = client.task_log(upid, page * LOG_PAGE, LOG_PAGE).await else {
            break;
        };
        let short = (lines.len() as u64) < LOG_PAGE;
        for line in lines {
            if tail.len() == keep {
                tail.pop_front();
            }
            tail.push_back(line.t);
        }
        if short {
            break;
        }
    }
    tail.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_is_quick_at_first_and_backs_off_to_one_second() {
        assert_eq!(next_interval(Duration::ZERO), POLL_FIRST);
        assert_eq!(
            next_interval(Duration::from_secs(5)),
            Duration::from_millis(200)
        );
        assert_eq!(next_interval(Duration::from_secs(3600)), POLL_MAX);
        let seen: Vec<Duration> = (0..200)
            .map(|s| next_interval(Duration::from_millis(s * 250)))
            .collect();
        assert!(seen.windows(2).all(|w| w[1] >= w[0]));
    }

    #[test]
    fn warnings_are_parsed() {
        assert_eq!(parse_warnings("WARNINGS: 3"), Some(3));
        assert_eq!(parse_warnings("OK"), None);
        assert_eq!(parse_warnings("unable to restore CT 1 - x"), None);
    }
}
