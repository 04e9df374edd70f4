//! What a group's run leaves for `journal --last restore-test`: every member's verdict beside
//! each member's own last result (`restore-test-last-<guest>.json`) and the run's
//! (`restore-test-last.json`), so the last test of any member shows the whole group.

use serde::{Deserialize, Serialize};

use super::{guest_last_result_path, last_result_of, write_atomic, CopyRun, LastResult};
use crate::config::Config;
use crate::guest::checks::CheckStatus;

/// The most bytes of a stored message (a check's or an error's); they come from guests and PVE.
const MESSAGE_MAX: usize = 600;

/// A group's run as its members ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupResult {
    /// The group's name.
    pub name: String,
    /// The group run's id (its lab's; the hub's `group.run`).
    pub run: String,
    /// `ok` only when every member is `ok`; else the worst member's ending.
    pub ending: String,
    /// The members in start order.
    pub members: Vec<MemberResult>,
}

/// One member of a group's run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberResult {
    /// Its place in the start order, from 1.
    pub member: u32,
    /// The guest whose backup it proved.
    pub guest: u32,
    /// The guest's name, when known.
    #[serde(default)]
    pub name: String,
    /// The copy's transaction.
    pub txn: String,
    /// The copy's vmid.
    pub vmid: Option<u32>,
    /// How it ended (`ok`, `failed`, …).
    pub ending: String,
    /// Its first check that failed or could not run, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failing: Option<FailingCheck>,
    /// Why it did not end `ok`: `[code] message`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A check that failed (`fail`) or could not run (`error`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailingCheck {
    /// The check's name.
    pub name: String,
    /// `fail` or `error`.
    pub status: String,
    /// Why, clipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

fn clip(text: &str) -> String {
    let mut end = text.len().min(MESSAGE_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// The group's ending from its members' (`ok` only when every member is; else the worst:
/// needs_human, failed, refused, interrupted, skipped).
pub fn group_ending<'a>(endings: impl IntoIterator<Item = &'a str>) -> &'static str {
    let endings: Vec<&str> = endings.into_iter().collect();
    if endings.is_empty() {
        return "skipped";
    }
    for worst in ["needs_human", "failed", "refused", "interrupted", "skipped"] {
        if endings.contains(&worst) {
            return worst;
        }
    }
    if endings.iter().all(|e| *e == "ok") {
        "ok"
    } else {
        "failed"
    }
}

/// The group's run of `copies` (one per member, in start order), `None` when they are no
/// group's.
pub fn of_copies(copies: &[CopyRun]) -> Option<GroupResult> {
    let first = copies.first()?.driven.state.request().group.clone()?;
    let members: Vec<MemberResult> = copies
        .iter()
        .map(|c| {
            let state = &c.driven.state;
            let index = state.request().group.as_ref().map_or(0, |g| g.index);
            MemberResult {
                member: index.saturating_add(1),
                guest: c.guest,
                name: c.name.clone(),
                txn: state.txn().to_string(),
                vmid: state.vmid(),
                ending: super::metrics_label(&c.driven).to_string(),
                failing: c
                    .driven
                    .checks
                    .iter()
                    .find(|r| matches!(r.status, CheckStatus::Fail | CheckStatus::Error))
                    .map(|r| FailingCheck {
                        name: clip(&r.name),
                        status: r.status.as_str().to_string(),
                        message: r.message.as_deref().map(clip),
                    }),
                error: state
                    .failure()
                    .map(|f| clip(&format!("[{}] {}", f.code, f.message))),
            }
        })
        .collect();
    Some(GroupResult {
        name: first.name,
        run: first.lab.to_string(),
        ending: group_ending(members.iter().map(|m| m.ending.as_str())).to_string(),
        members,
    })
}

/// Store the group's run beside every member's last result (and the run's, when it is a
/// member's): `journal --last restore-test` (with `--guest` of any member too) shows the
/// group's members and their verdicts. A failure is logged only.
pub fn store(cfg: &Config, copies: &[CopyRun]) {
    let Some(group) = of_copies(copies) else {
        return;
    };
    let run_path = cfg.state_dir.join(super::LAST_RESULT_FILE);
    let run_last = super::read_last_result(cfg);
    for c in copies {
        let last = LastResult {
            group: Some(group.clone()),
            ..last_result_of(&c.driven)
        };
        let mut paths = vec![guest_last_result_path(cfg, c.guest)];
        if run_last.as_ref().is_some_and(|r| r.txn == last.txn) {
            paths.push(run_path.clone());
        }
        for path in paths {
            let stored = serde_json::to_vec_pretty(&last)
                .map_err(std::io::Error::other)
                .and_then(|bytes| write_atomic(&path, &bytes, 0o600));
            if let Err(e) = stored {
                tracing::warn!(path = %path.display(), error = %e, "cannot store group {}'s members with guest {}'s restore test result", group.name, c.guest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_is_ok_only_when_every_member_is() {
        assert_eq!(group_ending(["ok", "ok"]), "ok");
        assert_eq!(group_ending(["ok", "failed"]), "failed");
        assert_eq!(group_ending(["failed", "ok"]), "failed");
        assert_eq!(group_ending(["ok", "needs_human", "failed"]), "needs_human");
        assert_eq!(group_ending(["ok", "interrupted"]), "interrupted");
        assert_eq!(group_ending(["ok", "what"]), "failed");
        assert_eq!(group_ending([]), "skipped");
    }

    #[test]
    fn messages_are_clipped_on_a_char_boundary() {
        let long = "é".repeat(MESSAGE_MAX);
        let c = clip(&long);
        assert!(c.len() <= MESSAGE_MAX && c.len() >= MESSAGE_MAX - 1);
        assert_eq!(clip("short"), "short");
    }
}
