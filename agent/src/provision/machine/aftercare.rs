//! What happens to a settled transaction later: an operator closes a `needs_human` after
//! handling it by hand ([`State::resolved`]), and a journal refresh compares a transaction's
//! view of its guest with what PVE shows now ([`State::refreshed`]). Pure like the rest of the
//! machine: the caller reads the clock and the guest.

use serde::{Deserialize, Serialize};

use super::{GuestView, OutcomeKind, Seen, State};

/// The most bytes of a resolution's reason (an operator's text).
pub const RESOLUTION_REASON_MAX_BYTES: usize = 512;

/// Who closed a `needs_human` transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResolvedBy {
    /// An operator, with `journal resolve`.
    Operator,
    /// `journal refresh`, which saw the guest gone.
    Refresh,
}

/// How a `needs_human` transaction was closed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resolution {
    /// Who closed it.
    pub by: ResolvedBy,
    /// Why (clipped to [`RESOLUTION_REASON_MAX_BYTES`]).
    pub reason: String,
    /// When (UTC, RFC 3339).
    pub at: String,
}

/// What a journal refresh found at a transaction's vmid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finding {
    /// The guest is there with this transaction's marker and birth identity.
    PresentWithProof,
    /// A guest is there without them (another guest, a copy, or one the pool token cannot read).
    PresentWithoutProof,
    /// The vmid is not in the full guest list.
    Absent,
}

/// `text` cut to at most `max` bytes on a character boundary, control characters made spaces.
fn clip_reason(text: &str, max: usize) -> String {
    let clean: String = text
        .trim()
        .chars()
        .map(|c| if crate::error::must_escape(c) { ' ' } else { c })
        .collect();
    if clean.len() <= max {
        return clean;
    }
    let mut end = max;
    while !clean.is_char_boundary(end) {
        end -= 1;
    }
    clean[..end].to_string()
}

impl State {
    /// How this `needs_human` transaction was closed, if it was.
    pub fn resolution(&self) -> Option<&Resolution> {
        self.resolution.as_ref()
    }

    /// Whether this transaction ended `needs_human` and nobody has closed it yet.
    pub fn awaits_human(&self) -> bool {
        self.outcome == Some(OutcomeKind::NeedsHuman) && self.resolution.is_none()
    }

    /// Whether this settled transaction still holds a claim on its guest: armed, not
    /// withdrawn, not destroyed (a kept guest).
    pub fn holds_claim(&self) -> bool {
        self.is_terminal() && self.destroy_armed && self.disarmed.is_none() && !self.destroyed
    }

    /// This `needs_human` transaction closed by `by` for `reason` at `at`; `None` when it is
    /// not awaiting a human. A claim it still held is withdrawn: a guest a human has taken over
    /// is never destroyed on this transaction's word.
    pub fn resolved(&self, by: ResolvedBy, reason: &str, at: String) -> Option<State> {
        if !self.awaits_human() {
            return None;
        }
        let reason = clip_reason(reason, RESOLUTION_REASON_MAX_BYTES);
        let mut s = self.clone();
        if s.destroy_armed {
            s.disarm(format!("closed by hand: {reason}"));
        }
        s.resolution = Some(Resolution { by, reason, at });
        Some(s)
    }

    /// What `view` shows of this transaction's guest.
    pub fn finding(&self, view: &GuestView) -> Finding {
        match self.seen(view) {
            Seen::Absent => Finding::Absent,
            Seen::Ours { .. } => Finding::PresentWithProof,
            Seen::NotOurs { .. } | Seen::Copy { .. } | Seen::Unreadable { .. } => {
                Finding::PresentWithoutProof
            }
        }
    }

    /// The state a journal refresh records for this settled transaction after seeing `view`
    /// at `at`, or `None` when nothing changes. A claim whose guest is gone or lacks its proof
    /// is withdrawn; a `needs_human` whose guest is gone is closed ("guest gone"). An open
    /// transaction is never changed here: it is settled through the gate.
    pub fn refreshed(&self, view: &GuestView, at: String) -> Option<State> {
        if !self.is_terminal() {
            return None;
        }
        let vmid = self.request.vmid?;
        let mut s = self.clone();
        let mut changed = false;
        if s.destroy_armed && s.disarmed.is_none() && !s.destroyed {
            let why = match s.seen(view) {
                Seen::Ours { .. } => None,
                Seen::Absent => Some(format!(
                    "guest {vmid} was not in the full guest list at a journal refresh ({at})"
                )),
                Seen::Copy { differs } => Some(format!(
                    "guest {vmid} carried marker {} but not its birth identity ({differs}) at a \
                     journal refresh ({at}): a copy",
                    s.txn_tag()
                )),
                Seen::NotOurs { .. } => Some(format!(
                    "guest {vmid} no longer showed marker {} at a journal refresh ({at})",
                    s.txn_tag()
                )),
                Seen::Unreadable { reason } => Some(format!(
                    "guest {vmid} could not be read with the pool token at a journal refresh \
                     ({at}): {reason}"
                )),
            };
            if let Some(why) = why {
                s.disarm(why);
                changed = true;
            }
        }
        if matches!(view, GuestView::Absent) {
            if let Some(closed) = s.resolved(
                ResolvedBy::Refresh,
                &format!("guest gone: vmid {vmid} was not in the full guest list"),
                at,
            ) {
                s = closed;
                changed = true;
            }
        }
        changed.then_some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_clipped_on_a_character_boundary_and_made_one_line() {
        let long = "é".repeat(400);
        let clipped = clip_reason(&long, RESOLUTION_REASON_MAX_BYTES);
        assert!(clipped.len() <= RESOLUTION_REASON_MAX_BYTES);
        assert_eq!(clipped.len(), 512);
        assert_eq!(clip_reason(" a\nb\tc ", 512), "a b c");
    }
}
