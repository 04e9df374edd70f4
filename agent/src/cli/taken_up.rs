//! What a writing command did before its own work: every writing command first takes up the
//! transactions a stopped run left open (resumed from their last journaled step, or settled
//! through the gate), whatever vmid it was asked about. Its output says so, one line each on
//! stdout with how it ended (`taken_up` in `--json`), so a `destroy -vmid 555` that finished
//! another vmid's provision never looks as if it did nothing.

use std::sync::Mutex;

use serde_json::{json, Value};

use super::CommandOutput;
use crate::guest::checks::CheckResult;
use crate::provision::effects::{Driven, Reporter};
use crate::provision::machine::State;

/// One taken-up transaction: where it was found and how its drive ended.
#[derive(Debug, Clone)]
struct TakenUp {
    json: Value,
    line: String,
}

impl TakenUp {
    fn of(from: &State, driven: &Driven) -> Self {
        let s = &driven.state;
        let ending = driven.ending().unwrap_or("open");
        let vmid = s.vmid().map_or_else(|| "-".to_string(), |v| v.to_string());
        let error = s.failure().or(driven.halted.as_ref());
        let mut line = format!(
            "took up transaction {} ({}, vmid {vmid}) a stopped run had left open at phase {}: {ending} in phase {}; destroy armed: {}, destroyed: {}",
            s.txn(),
            s.kind(),
            from.phase(),
            s.phase(),
            s.destroy_armed(),
            s.destroyed(),
        );
        if let Some(e) = error {
            line.push_str(&format!(" [{}]", e.code));
        }
        TakenUp {
            json: json!({
                "txn": s.txn().to_string(),
                "kind": s.kind().as_str(),
                "vmid": s.vmid(),
                "found_at_phase": from.phase().as_str(),
                "outcome": ending,
                "phase": s.phase().as_str(),
                "destroy_armed": s.destroy_armed(),
                "destroyed": s.destroyed(),
                "error": error,
            }),
            line,
        }
    }
}

/// A reporter that notes every taken-up transaction and hands everything on to `inner`.
pub struct TakeUpNotes<'a> {
    inner: &'a dyn Reporter,
    noted: Mutex<Vec<TakenUp>>,
}

impl<'a> TakeUpNotes<'a> {
    /// Note what passes through to `inner`.
    pub fn new(inner: &'a dyn Reporter) -> Self {
        Self {
            inner,
            noted: Mutex::new(Vec::new()),
        }
    }

    /// `out` with a line per taken-up transaction before its text (on stdout: they are
    /// results, also before an error) and `taken_up` in its document.
    pub fn add_to(&self, mut out: CommandOutput) -> CommandOutput {
        let noted = match self.noted.lock() {
            Ok(n) => n.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        if noted.is_empty() {
            return out;
        }
        let lines: String = noted.iter().map(|t| format!("{}\n", t.line)).collect();
        out.human = format!("{lines}{}", out.human);
        if let Some(obj) = out.json.as_object_mut() {
            obj.insert(
                "taken_up".into(),
                Value::Array(noted.into_iter().map(|t| t.json).collect()),
            );
        }
        out
    }
}

impl Reporter for TakeUpNotes<'_> {
    fn phase(&self, state: &State, record: u64) {
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

    fn taken_up(&self, from: &State, driven: &Driven) {
        if let Ok(mut n) = self.noted.lock() {
            n.push(TakenUp::of(from, driven));
        }
        self.inner.taken_up(from, driven);
    }
}
