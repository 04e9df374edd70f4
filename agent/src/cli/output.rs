//! What each command prints: the `--json` document (DESIGN section 3), the human text and the
//! exit status, built from the values the service, the doctor and the daemon return.

use serde_json::{json, Value};

use super::CommandOutput;
use crate::doctor::{CheckStatus as DoctorStatus, DoctorReport};
use crate::error::{ExitStatus, Failure};
use crate::guest::checks::CheckResult;
use crate::hub::DaemonReport;
use crate::inventory::{FullGuestList, GuestsReport};
use crate::preflight::PreflightReport;
use crate::provision::journal::{JournalRow, Listing};
use crate::provision::machine::{State, TxnKind};
use crate::service::restore_test::coverage::CoverageRow;
use crate::service::restore_test::{CopyRun, RestoreTestRun};
use crate::service::{Driven, TxnRun};
use crate::vmid::{VmidCheckReport, VmidVerdict};

/// The final JSON of a transaction: DESIGN section 3's fields, plus `plan` for a dry run.
pub fn result_json(state: &State, checks: &[CheckResult], plan: Option<&Value>) -> Value {
    let outcome = state.outcome();
    let mut v = json!({
        "txn": state.txn().to_string(),
        "kind": state.kind().as_str(),
        "vmid": state.vmid(),
        "outcome": outcome.as_ref().map(|o| o.outcome.as_str()),
        "phase": state.phase().as_str(),
        "reached": state.reached().as_str(),
        "destroy_armed": state.destroy_armed(),
        "disarmed": state.disarmed(),
        "destroyed": state.destroyed(),
        "upid": state.upid(),
        "checks": checks,
        "error": state.failure(),
    });
    if let (Some(p), Some(obj)) = (plan, v.as_object_mut()) {
        obj.insert("plan".to_string(), p.clone());
    }
    if let (Some(n), Some(obj)) = (network_word(state), v.as_object_mut()) {
        obj.insert("network".to_string(), json!(n));
    }
    v
}

/// `isolated` (the guest starts with no NIC) or `stored` (with its backup's NICs) for a
/// transaction that restores a guest; `None` for a destroy.
fn network_word(state: &State) -> Option<&'static str> {
    (state.kind() != TxnKind::Destroy).then_some(if state.request().isolate_network {
        "isolated"
    } else {
        "stored"
    })
}

/// The human summary; `open_word` names an open transaction (`open`, or `interrupted` when a
/// stop left it for a resume).
fn human(state: &State, checks: &[CheckResult], plan: Option<&Value>, open_word: &str) -> String {
    let mut s = String::new();
    if let Some(Value::Array(steps)) = plan {
        s.push_str(&format!(
            "dry run of transaction {} (nothing was written):\n",
            state.txn()
        ));
        for (i, step) in steps.iter().enumerate() {
            s.push_str(&format!("  {}. {}\n", i + 1, step));
        }
    }
    match network_word(state) {
        Some("isolated") => s.push_str(
            "network: isolated (nothing reaches a network: a container starts with no NIC, a VM with its stored NICs on [restore_test] lab_bridge when it is set, else with none)\n",
        ),
        Some(_) => s.push_str(
            "network: stored (the guest starts with the NICs its backup stores: bridges, addresses and MACs of the original's network)\n",
        ),
        None => {}
    }
    s.push_str(&check_lines(checks));
    let outcome = state.outcome();
    s.push_str(&format!(
        "transaction {} ({}) vmid {}: {} in phase {}; destroy armed: {}, destroyed: {}\n",
        state.txn(),
        state.kind(),
        state
            .vmid()
            .map(|v| v.to_string())
            .unwrap_or_else(|| "-".into()),
        outcome
            .as_ref()
            .map(|o| o.outcome.as_str())
            .unwrap_or(open_word),
        state.phase(),
        state.destroy_armed(),
        state.destroyed(),
    ));
    if let Some(why) = state.disarmed() {
        s.push_str(&format!("destroy disarmed: {why}\n"));
    }
    if let Some(f) = state.failure() {
        s.push_str(&format!("error [{}]: {}\n", f.code, f.message));
    }
    s
}

/// One line per check: its name, `pass`, `fail`, `error` or `skipped`, and why (for a pass,
/// how many rows the query returned).
/// The most bytes of one stored text (a message, a boot or isolation line) shown on a terminal.
const TERMINAL_TEXT_MAX: usize = 8192;

fn check_lines(checks: &[CheckResult]) -> String {
    let mut s = String::new();
    for c in checks {
        // Check names come from check packs and messages carry what the guest printed: shown
        // escaped (a terminal never gets their control sequences).
        let why = match c.message.as_deref() {
            Some(m) => format!(": {}", crate::error::outside_text_max(m, TERMINAL_TEXT_MAX)),
            None => format!(
                " ({} row{})",
                c.row_count,
                if c.row_count == 1 { "" } else { "s" }
            ),
        };
        s.push_str(&format!(
            "check {:<28} {}{why}\n",
            crate::error::outside_text(&c.name),
            c.status.as_str()
        ));
    }
    s
}

/// A stop (Ctrl-C, SIGTERM) is no outcome (the journal resumes the transaction), but the
/// document says what happened: `outcome` is `interrupted`, never null or `needs_human`.
fn mark_interrupted(json: &mut Value) {
    if let Some(obj) = json.as_object_mut() {
        obj.insert("outcome".into(), json!("interrupted"));
    }
}

/// What the boot wait waited for and saw: `boot` in the JSON, a `boot:` line in the text
/// (before the summary line, after the checks).
fn add_boot(json: &mut Value, text: &mut String, driven: &Driven) {
    let Some(boot) = &driven.boot else {
        return;
    };
    if let Some(obj) = json.as_object_mut() {
        obj.insert("boot".into(), json!(boot));
        if let Some(changed) = &driven.isolation {
            obj.insert("isolation".into(), json!(changed));
        }
    }
    let mut lines = format!("boot: {boot}\n");
    if let Some(changed) = &driven.isolation {
        lines.push_str(&format!("isolation: {changed}\n"));
    }
    text.insert_str(0, &lines);
}

fn driven_output(driven: &Driven) -> CommandOutput {
    let plan = driven
        .plan
        .as_ref()
        .map(|p| serde_json::to_value(p).unwrap_or(Value::Null));
    let mut json = result_json(&driven.state, &driven.checks, plan.as_ref());
    let open_word = if driven.interrupted() {
        "interrupted"
    } else {
        "open"
    };
    let mut text = human(&driven.state, &driven.checks, plan.as_ref(), open_word);
    if driven.interrupted() {
        mark_interrupted(&mut json);
    }
    add_boot(&mut json, &mut text, driven);
    if let Some(h) = &driven.halted {
        if let Some(obj) = json.as_object_mut() {
            obj.insert(
                "halted".into(),
                json!({"code": h.code.as_str(), "message": h.message}),
            );
        }
        text.push_str(&format!("halted [{}]: {}\n", h.code, h.message));
    }
    CommandOutput {
        json,
        human: text,
        status: driven.exit_status(),
    }
}

/// Add the preflight's checks to a command's output: `preflight` in the JSON, one line per
/// check before the human summary (unless the live view already drew them: `shown`).
fn with_preflight(
    mut out: CommandOutput,
    report: Option<&PreflightReport>,
    shown: bool,
) -> CommandOutput {
    if let Some(report) = report {
        if let Some(obj) = out.json.as_object_mut() {
            obj.insert("preflight".into(), report.to_json());
        }
        if !shown {
            out.human = format!("{}{}", report.human(), out.human);
        }
    }
    out
}

/// `--selftest=provision` and `destroy`; `preflight_shown`: the live view drew the preflight.
pub fn transaction(ran: Result<TxnRun, Failure>, preflight_shown: bool) -> CommandOutput {
    match ran {
        Ok(run) => with_preflight(
            driven_output(&run.driven),
            run.preflight.as_ref(),
            preflight_shown,
        ),
        Err(f) => CommandOutput::failure(&f),
    }
}

/// One copy of a restore-test run: its transaction's document (as `--selftest=provision`
/// prints one) with the guest and the backup it proves, and its text block.
fn copy_output(c: &CopyRun) -> (Value, String) {
    let driven = &c.driven;
    let plan = driven
        .plan
        .as_ref()
        .map(|p| serde_json::to_value(p).unwrap_or_default());
    let mut doc = result_json(&driven.state, &driven.checks, plan.as_ref());
    if let Some(obj) = doc.as_object_mut() {
        obj.insert("guest".into(), json!(c.guest));
        obj.insert("name".into(), json!(c.name));
        obj.insert("backup".into(), json!(c.backup));
        obj.insert("verdict".into(), json!(c.verdict.map(|v| v.as_str())));
        if let Some(g) = &driven.state.request().group {
            obj.insert(
                "group".into(),
                json!({"name": g.name, "member": g.index + 1, "lab": crate::guest::group_lab::lab_name(g.lab)}),
            );
        }
        if let Some(h) = &driven.halted {
            obj.insert(
                "halted".into(),
                json!({"code": h.code.as_str(), "message": h.message}),
            );
        }
        if let Some(p) = &c.preflight {
            obj.insert("preflight".into(), p.to_json());
        }
    }
    if driven.interrupted() {
        mark_interrupted(&mut doc);
    }
    let mut boot = String::new();
    add_boot(&mut doc, &mut boot, driven);
    let outcome = driven.ending().unwrap_or("needs_human");
    let copy = driven
        .state
        .vmid()
        .map_or_else(|| "-".to_string(), |v| v.to_string());
    let mut name = if c.name.is_empty() {
        String::new()
    } else {
        format!(" ({})", crate::error::outside_text(&c.name))
    };
    if let Some(g) = &driven.state.request().group {
        name.push_str(&format!(", member {} of group {}", g.index + 1, g.name));
    }
    let mut h = String::new();
    let refused = c.preflight.as_ref().is_some_and(|p| p.failure().is_some());
    if driven.state.request().dry_run {
        h.push_str(&format!(
            "guest {}{name}: would restore backup {} into vmid {copy}, isolated; nothing was written\n",
            c.guest, c.backup
        ));
        if let Some(p) = &c.preflight {
            for line in p.human().lines() {
                h.push_str(&format!("  {line}\n"));
            }
        }
        return (doc, h);
    }
    h.push_str(&format!(
        "guest {}{name}: backup {} in copy {copy} (txn {}): {outcome}\n",
        c.guest,
        c.backup,
        driven.state.txn()
    ));
    if refused {
        if let Some(p) = &c.preflight {
            for line in p.human().lines() {
                h.push_str(&format!("  {line}\n"));
            }
        }
    }
    for line in boot.lines() {
        h.push_str(&format!("  {line}\n"));
    }
    for line in check_lines(&driven.checks).lines() {
        h.push_str(&format!("  {line}\n"));
    }
    if !driven.checks.is_empty() {
        h.push_str(&format!("  {}", checks_summary(&driven.checks)));
    } else if !refused {
        h.push_str("  checks: none ran (the copy ended before them)\n");
    }
    if let Some(f) = driven.state.failure() {
        h.push_str(&format!("  error [{}]: {}\n", f.code, f.message));
    }
    if let Some(hl) = &driven.halted {
        h.push_str(&format!("  halted [{}]: {}\n", hl.code, hl.message));
    }
    if c.verdict.is_none() && outcome != "interrupted" && driven.state.outcome_kind().is_some() {
        h.push_str("  this ending says nothing of the backup: the guest stays due\n");
    }
    (doc, h)
}

/// `--selftest=restore`: every copy of the run, what it left, and the coverage after it.
pub fn restore_test(ran: Result<RestoreTestRun, Failure>) -> CommandOutput {
    let run = match ran {
        Ok(r) => r,
        Err(f) => return CommandOutput::failure(&f),
    };
    let mut copies = Vec::new();
    let mut human = String::new();
    for c in &run.copies {
        let (doc, text) = copy_output(c);
        copies.push(doc);
        human.push_str(&text);
    }
    let groups = run_groups(&run);
    for g in &groups {
        let each: Vec<String> = g
            .members
            .iter()
            .map(|m| format!("member {} guest {} {}", m.member, m.guest, m.ending))
            .collect();
        human.push_str(&format!(
            "group {} (run {}): {} ({})\n",
            crate::error::outside_text(&g.name),
            g.run,
            g.ending,
            each.join(", ")
        ));
    }
    for l in &run.left {
        human.push_str(&format!(
            "guest {}: backup {} left for a later run: {}\n",
            l.guest,
            crate::error::outside_text(&l.backup),
            l.reason
        ));
    }
    let proven = run
        .copies
        .iter()
        .filter(|c| c.verdict == Some(crate::service::restore_test::coverage::Verdict::Ok))
        .count();
    let failed = run
        .copies
        .iter()
        .filter(|c| c.verdict == Some(crate::service::restore_test::coverage::Verdict::Failed))
        .count();
    let outcome = if run.dry_run {
        "dry_run"
    } else if run.interrupted {
        "interrupted"
    } else {
        run.metrics_outcome()
    };
    if run.dry_run {
        human.push_str(&format!(
            "dry run: {} guest(s) due, {} at once at most; nothing was written\n",
            run.due, run.at_once
        ));
    } else if run.due == 0 && run.copies.is_empty() {
        human.push_str(&format!(
            "nothing due: every guest's newest backup is proven or cannot be tested ({} guest(s)); `felhom-agent restore-report` shows each\n",
            run.coverage.len()
        ));
    } else {
        human.push_str(&format!(
            "restore test run {}: {} due, {} copies, {proven} proven, {failed} failed, {} left; at most {} at once ({} allowed); {:.1} s\n",
            run.run,
            run.due,
            run.copies.len(),
            run.left.len(),
            run.peak_at_once,
            run.at_once,
            run.duration_s
        ));
    }
    if !run.dry_run && !run.coverage.is_empty() {
        use crate::service::restore_test::coverage::Status;
        for r in run
            .coverage
            .iter()
            .filter(|r| matches!(r.status, Status::NoBackup | Status::Unprovable))
        {
            let name = if r.name.is_empty() {
                String::new()
            } else {
                format!(" ({})", crate::error::outside_text(&r.name))
            };
            let why = match (r.status, r.last_test.as_ref()) {
                (Status::NoBackup, _) => {
                    "no backup on the backup storages: nothing to prove".to_string()
                }
                (_, Some(t)) => format!(
                    "its newest backup cannot be proven: [{}] {}",
                    t.record.code.as_deref().unwrap_or("-"),
                    t.record
                        .message
                        .as_deref()
                        .map(crate::error::outside_text)
                        .unwrap_or_default()
                ),
                _ => "its newest backup cannot be proven".to_string(),
            };
            human.push_str(&format!(
                "guest {}{name}: {}: {why}\n",
                r.vmid,
                r.status.as_str()
            ));
        }
        human.push_str(&format!(
            "coverage: {} (`felhom-agent restore-report` for each guest)\n",
            coverage_counts(&run.coverage)
        ));
    }
    if let Some(m) = &run.metrics_error {
        human.push_str(&format!("warning: {m}\n"));
    }
    let mut json = json!({
        "run": {
            "id": run.run.to_string(),
            "outcome": outcome,
            "due": run.due,
            "at_once": run.at_once,
            "peak_at_once": run.peak_at_once,
            "band": run.band,
            "duration_s": run.duration_s,
            "dry_run": run.dry_run,
        },
        "copies": copies,
        "left": run.left,
        "coverage": run.coverage,
    });
    if !groups.is_empty() {
        json["groups"] = json!(groups);
    }
    if let Some(m) = &run.metrics_error {
        json["metrics_error"] = json!(m);
    }
    CommandOutput {
        json,
        human,
        status: run.status(),
    }
}

/// The application groups of a run: each group run's members (by its lab), their verdicts
/// and the group's ending (`ok` only when every member's is).
fn run_groups(
    run: &RestoreTestRun,
) -> Vec<crate::service::restore_test::group_result::GroupResult> {
    let mut labs: Vec<ulid::Ulid> = Vec::new();
    for c in &run.copies {
        if let Some(g) = &c.driven.state.request().group {
            if !labs.contains(&g.lab) {
                labs.push(g.lab);
            }
        }
    }
    labs.iter()
        .filter_map(|lab| {
            let mut members: Vec<CopyRun> = run
                .copies
                .iter()
                .filter(|c| {
                    c.driven
                        .state
                        .request()
                        .group
                        .as_ref()
                        .is_some_and(|g| g.lab == *lab)
                })
                .cloned()
                .collect();
            members.sort_by_key(|c| c.driven.state.request().group.as_ref().map(|g| g.index));
            crate::service::restore_test::group_result::of_copies(&members)
        })
        .collect()
}

/// `4 proven, 1 due, 1 failed (1 stale)`: the statuses that occur.
fn coverage_counts(rows: &[CoverageRow]) -> String {
    use crate::service::restore_test::coverage::Status;
    let mut parts: Vec<String> = Status::ALL
        .iter()
        .filter_map(|s| {
            let n = rows.iter().filter(|r| r.status == *s).count();
            (n > 0).then(|| format!("{n} {}", s.as_str()))
        })
        .collect();
    let stale = rows.iter().filter(|r| r.stale).count();
    if stale > 0 {
        parts.push(format!("{stale} stale"));
    }
    parts.join(", ")
}

/// An age in seconds for a person: `3d 4h`, `5h 12m`, `40m`.
fn age_text(secs: u64) -> String {
    let (d, h, m) = (secs / 86_400, secs % 86_400 / 3600, secs % 3600 / 60);
    match (d, h) {
        (0, 0) => format!("{m}m"),
        (0, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

/// `restore-report`: one row per guest; exit 0 when every guest is proven or merely due and
/// none is stale, 5 otherwise.
pub fn restore_report(rows: Result<Vec<CoverageRow>, Failure>) -> CommandOutput {
    let rows = match rows {
        Ok(r) => r,
        Err(f) => return CommandOutput::failure(&f),
    };
    let mut human = format!(
        "{:>7}  {:<20} {:<12} {:<10} {:<5}  {:>10}  {:>10}  {}\n",
        "GUEST",
        "NAME",
        "GROUP",
        "STATUS",
        "STALE",
        "BACKUP AGE",
        "PROVEN AGE",
        "NEWEST BACKUP / WHY"
    );
    for r in &rows {
        let name: String = crate::error::outside_text(&r.name)
            .chars()
            .take(20)
            .collect();
        let group: String = r.group.as_deref().unwrap_or("-").chars().take(12).collect();
        let backup_age = r.backup_age.map_or_else(|| "-".to_string(), age_text);
        let proven_age = r
            .proven
            .as_ref()
            .map_or_else(|| "never".to_string(), |p| age_text(p.age_seconds));
        let newest = r.newest_backup.as_ref().map_or_else(
            || "no backup on the backup storages".to_string(),
            |b| crate::error::outside_text(&b.volid),
        );
        human.push_str(&format!(
            "{:>7}  {:<20} {:<12} {:<10} {:<5}  {:>10}  {:>10}  {newest}\n",
            r.vmid,
            name,
            group,
            r.status.as_str(),
            if r.stale { "yes" } else { "no" },
            backup_age,
            proven_age,
        ));
        let why =
            r.failed_test.as_ref().or(r.last_test.as_ref().filter(|t| {
                t.record.verdict != crate::service::restore_test::coverage::Verdict::Ok
            }));
        if let Some(t) = why {
            let mut line = format!(
                "{:>9}{} test of {} (txn {}): {}",
                "",
                t.record.verdict.as_str(),
                crate::error::outside_text(&t.volid),
                t.record.txn,
                t.record.code.as_deref().unwrap_or("")
            );
            if !t.record.failing.is_empty() {
                line.push_str(&format!(
                    "; failing checks: {}",
                    t.record.failing.join(", ")
                ));
            }
            if let Some(m) = &t.record.message {
                line.push_str(&format!("; {}", crate::error::outside_text(m)));
            }
            human.push_str(&line);
            human.push('\n');
        }
        {
            use crate::service::restore_test::coverage::Status;
            let hint = match r.status {
                Status::NoBackup => Some(format!(
                    "back it up (`vzdump {} --storage <a backup storage>`) or name its backup storage in [restore_test] backup_storages",
                    r.vmid
                )),
                Status::Failed => Some(format!(
                    "`felhom-agent journal --last restore-test --guest {}` shows why; a later backup proven ok clears it",
                    r.vmid
                )),
                Status::Overdue => Some(format!(
                    "due for longer than [restore_test] prove_within: the next `felhom-agent --selftest=restore` proves it (`--guest {}` now)",
                    r.vmid
                )),
                _ => None,
            };
            if let Some(h) = hint {
                human.push_str(&format!("{:>9}{h}\n", ""));
            }
            if r.stale {
                human.push_str(&format!(
                    "{:>9}stale: its newest backup is older than {} ([restore_test] backup_max_age, else what its backup job's schedule allows); check the node's backup job for guest {}\n",
                    "",
                    age_text(r.stale_after),
                    r.vmid
                ));
            }
        }
        if let Some(gone) = &r.proven_gone {
            human.push_str(&format!(
                "{:>9}the newer proven backup {} is no longer on storage (pruned)\n",
                "",
                crate::error::outside_text(gone)
            ));
        }
        if let Some(p) = r
            .proven
            .as_ref()
            .filter(|_| r.status != crate::service::restore_test::coverage::Status::Proven)
        {
            human.push_str(&format!(
                "{:>9}newest proven restore point: {} ({} old)\n",
                "",
                crate::error::outside_text(&p.volid),
                age_text(p.age_seconds)
            ));
        }
    }
    if rows.is_empty() {
        human.push_str("(no pool guest on this node)\n");
    }
    human.push_str(&group_lines(&rows));
    let fine = crate::service::restore_test::coverage::all_fine(&rows);
    human.push_str(&format!(
        "{}: {}\n",
        if fine { "ok" } else { "attention" },
        if rows.is_empty() {
            "no guest".to_string()
        } else {
            coverage_counts(&rows)
        }
    ));
    CommandOutput {
        json: json!({"guests": rows, "ok": fine}),
        human,
        status: if fine {
            ExitStatus::Ok
        } else {
            ExitStatus::GuestFailed
        },
    }
}

/// One line per application group of the table: its members (by vmid) and their statuses,
/// as `group shop: proven together (200 db proven, 201 shop proven)`, or what keeps it from
/// it. Empty when no row is in a group.
fn group_lines(rows: &[CoverageRow]) -> String {
    use crate::service::restore_test::coverage::Status;
    let mut names: Vec<&str> = Vec::new();
    for g in rows.iter().filter_map(|r| r.group.as_deref()) {
        if !names.contains(&g) {
            names.push(g);
        }
    }
    let mut out = String::new();
    for g in names {
        let members: Vec<&CoverageRow> = rows
            .iter()
            .filter(|r| r.group.as_deref() == Some(g))
            .collect();
        let each: Vec<String> = members
            .iter()
            .map(|r| {
                let name = if r.name.is_empty() {
                    String::new()
                } else {
                    format!(" {}", crate::error::outside_text(&r.name))
                };
                format!("{}{name} {}", r.vmid, r.status.as_str())
            })
            .collect();
        let word = if members.iter().all(|r| r.status == Status::Proven) {
            "proven together"
        } else if members.iter().any(|r| r.status == Status::Failed) {
            "failed"
        } else if members.iter().any(|r| r.due) {
            "due (a member is due: the next run proves the group)"
        } else {
            "not proven"
        };
        out.push_str(&format!("group {g}: {word} ({})\n", each.join(", ")));
    }
    out
}

/// `checks: N passed, N failed, N could not run, N not judged` for a person: a skipped check
/// is never counted as passed.
fn checks_summary(checks: &[CheckResult]) -> String {
    use crate::guest::checks::CheckStatus;
    let count = |st: CheckStatus| checks.iter().filter(|c| c.status == st).count();
    format!(
        "checks: {} passed, {} failed, {} could not run, {} not judged\n",
        count(CheckStatus::Pass),
        count(CheckStatus::Fail),
        count(CheckStatus::Error),
        count(CheckStatus::Skipped)
    )
}

/// `guests`.
pub fn guests(report: Result<GuestsReport, Failure>) -> CommandOutput {
    let report = match report {
        Ok(r) => r,
        Err(f) => return CommandOutput::failure(&f),
    };
    let mut human = format!(
        "{:>10}  {:<5} {:<12} {:<8} NAME\n",
        "VMID", "TYPE", "NODE", "POOL"
    );
    for g in &report.guests {
        human.push_str(&format!(
            "{:>10}  {:<5} {:<12} {:<8} {}\n",
            g.vmid,
            g.kind.as_str(),
            g.node,
            if g.in_pool { "pool" } else { "foreign" },
            g.name.as_deref().unwrap_or(if g.in_pool {
                ""
            } else {
                "(not visible to the token)"
            }),
        ));
    }
    human.push_str(&format!("source: {}\n", report.source_description));
    CommandOutput {
        json: serde_json::to_value(&report).unwrap_or_else(|_| json!({})),
        human,
        status: ExitStatus::Ok,
    }
}

/// `vmid-check N`: exit 0 when free, 3 when refused.
pub fn vmid_check(verdict: Result<(VmidVerdict, FullGuestList), Failure>) -> CommandOutput {
    let (verdict, full) = match verdict {
        Ok(v) => v,
        Err(f) => return CommandOutput::failure(&f),
    };
    let report = VmidCheckReport::from_verdict(&verdict).with_source(full.source());
    let status = if verdict.is_free() {
        ExitStatus::Ok
    } else {
        ExitStatus::Refused
    };
    let human = match report.code {
        None => format!("free: {}", report.message),
        Some(code) => format!("refused [{code}]: {}", report.message),
    };
    CommandOutput {
        json: serde_json::to_value(&report).unwrap_or_else(|_| json!({})),
        human,
        status,
    }
}

/// `journal`.
pub fn journal(
    rows: Result<Vec<JournalRow>, Failure>,
    archived: Option<Result<Vec<JournalRow>, Failure>>,
    kind: Option<TxnKind>,
    guest: Option<u32>,
) -> CommandOutput {
    let rows = match rows {
        Ok(r) => of_kind(r, kind, guest),
        Err(f) => return CommandOutput::failure(&f),
    };
    let archived = match archived.transpose() {
        Ok(a) => a.map(|a| of_kind(a, kind, guest)),
        Err(f) => return CommandOutput::failure(&f),
    };
    let mut human = journal_table(&rows);
    if rows.is_empty() {
        human.push_str("(no transactions yet)\n");
    }
    let mut json = json!({"transactions": rows});
    if let Some(a) = &archived {
        human.push_str(&format!(
            "\narchived ({} settled transaction(s) older than [journal] keep_days):\n",
            a.len()
        ));
        human.push_str(&journal_table(a));
        json["archived"] = json!(a);
    }
    CommandOutput {
        json,
        human,
        status: ExitStatus::Ok,
    }
}

/// `felhom-agent journal`: what may still own or concern a guest and the settled ones written
/// last; says how many older ones `--all` would add.
pub fn journal_recent(
    listing: Result<Listing, Failure>,
    kind: Option<TxnKind>,
    guest: Option<u32>,
) -> CommandOutput {
    let mut listing = match listing {
        Ok(l) => l,
        Err(f) => return CommandOutput::failure(&f),
    };
    listing.rows = of_kind(std::mem::take(&mut listing.rows), kind, guest);
    let mut human = journal_table(&listing.rows);
    if listing.rows.is_empty() {
        human.push_str("(no transactions yet)\n");
    }
    if listing.not_shown > 0 {
        human.push_str(&format!(
            "\n{} older settled transaction(s) not shown; `felhom-agent journal --all` lists \
             every one (the archive too)\n",
            listing.not_shown
        ));
    }
    CommandOutput {
        json: json!({"transactions": listing.rows, "not_shown": listing.not_shown}),
        human,
        status: ExitStatus::Ok,
    }
}

/// The rows of `kind` only (all when `None`), and of restore tests of `guest`'s backups only
/// when it is given.
fn of_kind(rows: Vec<JournalRow>, kind: Option<TxnKind>, guest: Option<u32>) -> Vec<JournalRow> {
    rows.into_iter()
        .filter(|r| kind.is_none_or(|k| r.kind == k))
        .filter(|r| guest.is_none_or(|g| r.guest == Some(g)))
        .collect()
}

/// A row's OUTCOME: its outcome once settled, `interrupted` when open and no process runs
/// it, `open` while one does.
fn outcome_word(r: &JournalRow) -> &'static str {
    match (r.outcome, r.interrupted) {
        (Some(o), _) => o.as_str(),
        (None, true) => "interrupted",
        (None, false) => "open",
    }
}

fn journal_table(rows: &[JournalRow]) -> String {
    let mut human = format!(
        "{:<26}  {:<18} {:>10}  {:<12} {:<12} {:<6} {:<9} {}\n",
        "TXN", "KIND", "VMID", "OUTCOME", "PHASE", "ARMED", "DESTROYED", "UPDATED"
    );
    for r in rows {
        human.push_str(&format!(
            "{:<26}  {:<18} {:>10}  {:<12} {:<12} {:<6} {:<9} {}\n",
            r.txn.to_string(),
            r.kind.as_str(),
            r.vmid.map(|v| v.to_string()).unwrap_or_else(|| "-".into()),
            outcome_word(r),
            r.phase.as_str(),
            if r.destroy_armed { "yes" } else { "no" },
            if r.destroyed { "yes" } else { "no" },
            r.updated_at,
        ));
        if let (Some(g), Some(b)) = (r.guest, r.backup.as_deref()) {
            human.push_str(&format!(
                "{:<28}proves guest {g}'s backup {}\n",
                "",
                crate::error::outside_text(b)
            ));
        }
        if let Some(cmd) = r.resume.as_deref().filter(|_| r.interrupted) {
            human.push_str(&format!(
                "{:<28}stopped at phase {}, step {}; it resumes from there with `{cmd}` (or the \
                 next writing command, or the daemon's next start)\n",
                "",
                r.phase.as_str(),
                r.step.as_str()
            ));
        }
        if let Some(e) = &r.error {
            human.push_str(&format!("{:<28}[{}] {}\n", "", e.code, e.message));
        }
        if let Some(why) = &r.disarmed {
            human.push_str(&format!("{:<28}disarmed: {why}\n", ""));
        }
        if let Some(res) = &r.resolution {
            human.push_str(&format!("{:<28}closed at {}: {}\n", "", res.at, res.reason));
        }
    }
    human
}

/// `journal --last KIND`: the newest transaction of that kind in full; exit 0 (also when
/// there is none: it says so).
pub fn journal_last(
    kind: TxnKind,
    last: Result<Option<crate::service::LastOfKind>, Failure>,
    guest: Option<u32>,
) -> CommandOutput {
    let last = match last {
        Ok(l) => l,
        Err(f) => return CommandOutput::failure(&f),
    };
    let Some(last) = last else {
        let of_guest = guest
            .map(|g| format!(" of guest {g}'s backups"))
            .unwrap_or_default();
        return CommandOutput {
            json: json!({"kind": kind.as_str(), "guest": guest, "transaction": null}),
            human: format!("no {kind} transaction{of_guest} in the journal or its archive\n"),
            status: ExitStatus::Ok,
        };
    };
    let r = &last.row;
    let what = if kind == TxnKind::SelftestRestore {
        "restore test"
    } else {
        kind.as_str()
    };
    let vmid = r.vmid.map_or_else(|| "-".to_string(), |v| v.to_string());
    let mut human = format!(
        "{what} {} vmid {vmid}: {} in phase {}\n",
        r.txn,
        outcome_word(r),
        r.phase
    );
    if let Some(g) = r.guest {
        human.push_str(&format!("  guest:      {g} (the copy is vmid {vmid})\n"));
    }
    if let Some(b) = &last.backup {
        human.push_str(&format!(
            "  backup:     {}\n",
            crate::error::outside_text(b)
        ));
    }
    human.push_str(&format!("  started:    {}\n", r.started_at));
    human.push_str(&format!("  updated:    {}\n", r.updated_at));
    human.push_str(&format!(
        "  destroy armed: {}, destroyed: {}\n",
        r.destroy_armed, r.destroyed
    ));
    // What the journal holds was written by the agent from what PVE and the guest said:
    // shown escaped.
    if let Some(e) = &r.error {
        human.push_str(&format!(
            "  why:        [{}] {}\n",
            e.code,
            crate::error::outside_text_max(&e.message, TERMINAL_TEXT_MAX)
        ));
    }
    if let Some(cmd) = r.resume.as_deref().filter(|_| r.interrupted) {
        human.push_str(&format!("  resume:     `{cmd}`\n"));
    }
    let mut json =
        json!({"kind": kind.as_str(), "transaction": r, "backup": last.backup, "guest": r.guest});
    match &last.restore_test {
        Some(rt) => {
            if let Some(b) = &rt.boot {
                human.push_str(&format!(
                    "  boot:       {}\n",
                    crate::error::outside_text_max(b, TERMINAL_TEXT_MAX)
                ));
            }
            if let Some(i) = &rt.isolation {
                human.push_str(&format!(
                    "  isolation:  {}\n",
                    crate::error::outside_text_max(i, TERMINAL_TEXT_MAX)
                ));
            }
            if rt.checks.is_empty() {
                human.push_str("  checks: none ran (the run ended before them)\n");
            } else {
                human.push_str(&format!("  {}", checks_summary(&rt.checks)));
                for line in check_lines(&rt.checks).lines() {
                    human.push_str(&format!("    {line}\n"));
                }
            }
            json["checks"] = json!(rt.checks);
            json["boot"] = json!(rt.boot);
            json["isolation"] = json!(rt.isolation);
            if let Some(g) = &rt.group {
                human.push_str(&group_members_text(g));
                json["group"] = json!(g);
            }
        }
        None if kind == TxnKind::SelftestRestore => {
            human.push_str("  checks: not stored for this run\n");
            json["checks"] = Value::Null;
        }
        None => {}
    }
    CommandOutput {
        json,
        human,
        status: ExitStatus::Ok,
    }
}

/// A group's run in `journal --last restore-test`: the group, then one line per member in
/// start order with its copy, its ending and its first failing check (or its error).
fn group_members_text(g: &crate::service::restore_test::group_result::GroupResult) -> String {
    let mut s = format!(
        "  group:      {} (run {}): {}, {} member(s) in start order\n",
        crate::error::outside_text(&g.name),
        g.run,
        g.ending,
        g.members.len()
    );
    for m in &g.members {
        let name = if m.name.is_empty() {
            String::new()
        } else {
            format!(" ({})", crate::error::outside_text(&m.name))
        };
        let copy = m.vmid.map_or_else(|| "-".to_string(), |v| v.to_string());
        let mut line = format!(
            "    member {}: guest {}{name} in copy {copy} (txn {}): {}",
            m.member, m.guest, m.txn, m.ending
        );
        if let Some(f) = &m.failing {
            line.push_str(&format!(
                "; first failing check {} {}",
                crate::error::outside_text(&f.name),
                f.status
            ));
            if let Some(msg) = &f.message {
                line.push_str(&format!(": {}", crate::error::outside_text(msg)));
            }
        } else if let Some(e) = &m.error {
            line.push_str(&format!("; {}", crate::error::outside_text(e)));
        }
        s.push_str(&line);
        s.push('\n');
    }
    s
}

/// `journal resolve`: exit 0 when closed, else the refusal's status.
pub fn journal_resolve(resolved: Result<State, Failure>, hub: Option<String>) -> CommandOutput {
    let state = match resolved {
        Ok(s) => s,
        Err(f) => return CommandOutput::failure(&f),
    };
    let resolution = state.resolution();
    let mut human = format!(
        "transaction {} (vmid {}) closed by hand: {}\n",
        state.txn(),
        state
            .vmid()
            .map_or_else(|| "-".to_string(), |v| v.to_string()),
        resolution.map_or("", |r| r.reason.as_str())
    );
    if let Some(h) = &hub {
        human.push_str(&format!("hub: {h}\n"));
    }
    CommandOutput {
        json: json!({
            "txn": state.txn().to_string(),
            "vmid": state.vmid(),
            "outcome": state.outcome_kind().map(|o| o.as_str()),
            "resolution": resolution,
            "destroy_armed": state.destroy_armed(),
            "hub": hub,
        }),
        human,
        status: ExitStatus::Ok,
    }
}

/// `journal --stats`.
pub fn journal_stats(stats: Result<crate::metrics::stats::Stats, Failure>) -> CommandOutput {
    match stats {
        Ok(s) => CommandOutput {
            json: serde_json::to_value(&s).unwrap_or_else(|_| json!({})),
            human: crate::metrics::stats::human(&s),
            status: ExitStatus::Ok,
        },
        Err(f) => CommandOutput::failure(&f),
    }
}

/// `journal refresh`: exit 0, or 6 when some guest could not be read.
pub fn journal_refresh(
    report: Result<crate::service::journal_ops::RefreshReport, Failure>,
) -> CommandOutput {
    let report = match report {
        Ok(r) => r,
        Err(f) => return CommandOutput::failure(&f),
    };
    let mut human = String::new();
    for r in &report.rows {
        let finding = r
            .finding
            .map(|f| match f {
                crate::provision::machine::Finding::PresentWithProof => "present with its proof",
                crate::provision::machine::Finding::PresentWithoutProof => {
                    "present WITHOUT its proof"
                }
                crate::provision::machine::Finding::Absent => "absent",
            })
            .unwrap_or("not read");
        human.push_str(&format!(
            "{}  vmid {:>10}  {:<11}  {finding}\n",
            r.txn, r.vmid, r.concern
        ));
        if let Some(c) = &r.change {
            human.push_str(&format!("{:<28}changed: {c}\n", ""));
        }
        if let Some(s) = &r.skipped {
            human.push_str(&format!("{:<28}skipped: {s}\n", ""));
        }
    }
    let changed = report.changed().count();
    human.push_str(&format!(
        "journal refresh: {} transaction(s) looked at, {changed} changed; nothing was written to PVE\n",
        report.rows.len()
    ));
    CommandOutput {
        json: json!({"at": report.at, "transactions": report.rows, "changed": changed}),
        human,
        status: if report.had_errors() {
            ExitStatus::Environment
        } else {
            ExitStatus::Ok
        },
    }
}

/// `journal resume`: the resumed transaction, with the exit status of how it ended.
pub fn journal_resume(ran: Result<Driven, Failure>) -> CommandOutput {
    let driven = match ran {
        Ok(d) => d,
        Err(f) => return CommandOutput::failure(&f),
    };
    let mut out = driven_output(&driven);
    out.human = format!("resumed from its last journaled step:\n{}", out.human);
    out
}

/// `journal cancel`: the settled transaction; exit 0 unless it ended `needs_human` (7) or the
/// drive halted.
pub fn journal_cancel(ran: Result<Driven, Failure>) -> CommandOutput {
    let driven = match ran {
        Ok(d) => d,
        Err(f) => return CommandOutput::failure(&f),
    };
    let mut out = driven_output(&driven);
    out.human = format!("settled through the ownership gate:\n{}", out.human);
    out.status = match (&driven.halted, driven.state.outcome_kind()) {
        (Some(_), _) => out.status,
        (None, Some(crate::provision::machine::OutcomeKind::NeedsHuman)) => ExitStatus::NeedsHuman,
        (None, _) => ExitStatus::Ok,
    };
    // The cancel succeeded: the transaction's recorded failure says why it had stopped (a
    // result of the command), not that the command failed.
    if let (ExitStatus::Ok, Some(f)) = (out.status, driven.state.failure()) {
        out.human = out.human.replace(
            &format!("error [{}]: {}\n", f.code, f.message),
            &format!("why it had stopped [{}]: {}\n", f.code, f.message),
        );
    }
    out
}

/// `doctor`: exit 0 when nothing failed, 6 otherwise.
pub fn doctor(report: &DoctorReport) -> CommandOutput {
    let mut human = String::new();
    for c in &report.checks {
        let tag = match c.status {
            DoctorStatus::Pass => "ok  ",
            DoctorStatus::Warn => "warn",
            DoctorStatus::Fail => "FAIL",
            DoctorStatus::Skipped => "skip",
        };
        human.push_str(&wrap_under(
            &format!("[{tag}] {:<12} ", c.name),
            7,
            &c.message,
            report_width(),
        ));
    }
    let warnings = report
        .checks
        .iter()
        .filter(|c| c.status == DoctorStatus::Warn)
        .count();
    human.push_str(&match (report.ok, warnings) {
        (false, _) => {
            "doctor: some checks failed, fix them and run `felhom-agent doctor` again\n".to_string()
        }
        (true, 0) => "doctor: all checks passed\n".to_string(),
        (true, n) => format!(
            "doctor: passed with {n} warning{}; read the [warn] lines\n",
            if n == 1 { "" } else { "s" }
        ),
    });
    CommandOutput {
        json: serde_json::to_value(report).unwrap_or_else(|_| json!({"ok": false})),
        human,
        status: if report.ok {
            ExitStatus::Ok
        } else {
            ExitStatus::Environment
        },
    }
}

/// The width the human report is wrapped to: `$COLUMNS` when set (40 or more), else 80.
fn report_width() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse::<usize>().ok())
        .filter(|&c| c >= 40)
        .unwrap_or(80)
}

/// `head` then `text`, wrapped at spaces to `width` columns; the lines after the first are
/// indented by `indent` spaces. A line of `text` (several lines: TOML's caret under a key)
/// keeps its leading spaces; a word longer than the room (a long path) stays whole on a line
/// of its own.
pub fn wrap_under(head: &str, indent: usize, text: &str, width: usize) -> String {
    let indent = " ".repeat(indent);
    let mut lines: Vec<String> = Vec::new();
    let room = |lines: &Vec<String>| {
        let lead = if lines.is_empty() { head } else { &indent };
        width.saturating_sub(lead.chars().count()).max(20)
    };
    for src in text.lines() {
        let lead: String = src.chars().take_while(|c| *c == ' ').collect();
        let mut line = lead.clone();
        let mut has_word = false;
        for word in src[lead.len()..].split(' ').filter(|w| !w.is_empty()) {
            let need = line.chars().count() + usize::from(has_word) + word.chars().count();
            // A word that does not fit beside the head starts the next line (with the wider
            // room of an indented one).
            let at_head = !has_word && lines.is_empty();
            if (has_word || at_head) && need > room(&lines) {
                lines.push(std::mem::replace(&mut line, lead.clone()));
                has_word = false;
            }
            if has_word {
                line.push(' ');
            }
            line.push_str(word);
            has_word = true;
        }
        lines.push(line);
    }
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        out.push_str(if i == 0 { head } else { &indent });
        out.push_str(line);
        out = out.trim_end_matches(' ').to_string();
        out.push('\n');
    }
    if lines.is_empty() {
        out.push_str(head.trim_end());
        out.push('\n');
    }
    out
}

/// `run`: how the daemon ended.
pub fn daemon(ended: Result<DaemonReport, Failure>) -> CommandOutput {
    match ended {
        Ok(report) => CommandOutput {
            json: json!({
                "stopped": true,
                "sessions": report.sessions,
                "outbox_depth": report.outbox_depth,
                "open_dispatches": report.open_dispatches,
            }),
            human: format!(
                "stopped: {} messages wait in the outbox, {} dispatches resume at the next start",
                report.outbox_depth, report.open_dispatches
            ),
            status: ExitStatus::Ok,
        },
        Err(f) => CommandOutput::failure(&f),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coverage_row(vmid: u32, name: &str, status: &str, group: Option<&str>) -> CoverageRow {
        use crate::service::restore_test::coverage::Status;
        let status = Status::ALL
            .into_iter()
            .find(|s| s.as_str() == status)
            .expect("a status");
        CoverageRow {
            vmid,
            name: name.to_string(),
            status,
            stale: false,
            stale_after: 86_400,
            backup_age: None,
            newest_backup: None,
            last_test: None,
            failed_test: None,
            proven: None,
            proven_gone: None,
            due_since: None,
            due: status == Status::Due,
            group: group.map(str::to_string),
        }
    }

    /// `restore-report` names each row's group in its GROUP column (`-` for a guest alone), in
    /// `--json` (`group`, absent for a guest alone), and sums each group up in one line.
    #[test]
    fn restore_report_shows_each_row_s_group_and_a_line_per_group() {
        let rows = vec![
            coverage_row(120, "web", "proven", None),
            coverage_row(200, "db", "failed", Some("shop")),
            coverage_row(201, "shop", "failed", Some("shop")),
            coverage_row(300, "mail", "proven", Some("post")),
            coverage_row(301, "relay", "proven", Some("post")),
        ];
        let out = restore_report(Ok(rows));
        let lines: Vec<&str> = out.human.lines().collect();
        assert!(lines[0].contains(" GROUP "), "{}", out.human);
        let col = lines[0].find("GROUP").expect("the column");
        let at = |vmid: &str| {
            let line = lines
                .iter()
                .find(|l| l.trim_start().starts_with(vmid))
                .expect("the row");
            line[col..]
                .split_whitespace()
                .next()
                .expect("a cell")
                .to_string()
        };
        assert_eq!(
            [at("120"), at("200"), at("201"), at("300")],
            ["-", "shop", "shop", "post"].map(str::to_string)
        );
        assert!(
            out.human
                .contains("group shop: failed (200 db failed, 201 shop failed)\n"),
            "{}",
            out.human
        );
        assert!(
            out.human
                .contains("group post: proven together (300 mail proven, 301 relay proven)\n"),
            "{}",
            out.human
        );
        let guests = out.json["guests"].as_array().expect("rows");
        assert!(guests[0].get("group").is_none(), "{:#}", out.json);
        assert_eq!(guests[1]["group"], "shop");
    }

    /// `journal --last restore-test` of a group member: the group's ending and one line per
    /// member in start order, with its first failing check (escaped) or its error.
    #[test]
    fn a_group_s_members_in_journal_last() {
        use crate::service::restore_test::group_result::{FailingCheck, GroupResult, MemberResult};
        let g = GroupResult {
            name: "shop".to_string(),
            run: "01KJGXC7D9F1H3K5M7P9R1T3V5".to_string(),
            ending: "failed".to_string(),
            members: vec![
                MemberResult {
                    member: 1,
                    guest: 200,
                    name: "db".to_string(),
                    txn: "01KJGXC8D0F2H4K6M8P0R2T4V6".to_string(),
                    vmid: Some(990_000),
                    ending: "failed".to_string(),
                    failing: Some(FailingCheck {
                        name: "database-serves".to_string(),
                        status: "fail".to_string(),
                        message: Some("0 rows\u{1b}[2J".to_string()),
                    }),
                    error: Some("[check_failed] check database-serves failed".to_string()),
                },
                MemberResult {
                    member: 2,
                    guest: 201,
                    name: "shop".to_string(),
                    txn: "01KJGXC8E0G2J4M6N8Q0S2T4W6".to_string(),
                    vmid: None,
                    ending: "refused".to_string(),
                    failing: None,
                    error: Some("[storage_missing] no storage".to_string()),
                },
            ],
        };
        let text = group_members_text(&g);
        assert!(!text.contains('\u{1b}'), "{text:?}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[0]
                .contains("group:      shop (run 01KJGXC7D9F1H3K5M7P9R1T3V5): failed, 2 member(s)"),
            "{text}"
        );
        assert!(
            lines[1].starts_with("    member 1: guest 200 (db) in copy 990000 (txn 01KJGXC8D0F2H4K6M8P0R2T4V6): failed; first failing check database-serves fail: 0 rows"),
            "{text}"
        );
        assert_eq!(
            lines[2],
            "    member 2: guest 201 (shop) in copy - (txn 01KJGXC8E0G2J4M6N8Q0S2T4W6): refused; [storage_missing] no storage"
        );
    }

    /// What a guest printed reaches a terminal escaped: no control sequence of its own (a
    /// check pack's name, a check's message, neither clears the screen or moves the cursor).
    #[test]
    fn check_lines_escape_what_packs_and_guests_wrote() {
        let checks = vec![CheckResult {
            name: "web\u{1b}]0;owned\u{7}".to_string(),
            status: hub_protocol::CheckStatus::Fail,
            rows: Vec::new(),
            row_count: 1,
            rows_truncated: false,
            message: Some("nginx: \u{1b}[2J\u{1b}[Hall good\u{202e}".to_string()),
            duration_ms: 3,
        }];
        let text = check_lines(&checks);
        assert!(
            !text
                .chars()
                .any(|c| c == '\u{1b}' || c == '\u{7}' || c == '\u{202e}'),
            "{text:?}"
        );
        assert!(
            text.contains("nginx: ") && text.contains("all good"),
            "{text}"
        );
    }

    /// A check that could not judge is counted as not judged, never as passed, and its line
    /// says `skipped` with why.
    #[test]
    fn a_skipped_check_is_counted_as_not_judged() {
        use hub_protocol::CheckStatus;
        let check = |name: &str, status: CheckStatus, message: Option<&str>| CheckResult {
            name: name.to_string(),
            status,
            rows: Vec::new(),
            row_count: 1,
            rows_truncated: false,
            message: message.map(str::to_string),
            duration_ms: 3,
        };
        let checks = vec![
            check("osquery-version", CheckStatus::Pass, None),
            check("hostname", CheckStatus::Skipped, Some("not judged: a VM")),
        ];
        assert_eq!(
            checks_summary(&checks),
            "checks: 1 passed, 0 failed, 0 could not run, 1 not judged\n"
        );
        let lines = check_lines(&checks);
        assert!(
            lines
                .lines()
                .any(|l| l.starts_with("check hostname ")
                    && l.ends_with(" skipped: not judged: a VM")),
            "{lines}"
        );
    }
}
