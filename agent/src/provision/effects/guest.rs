//! The executor's work inside the guest: the launch proof, the boot wait (with an isolated
//! copy's lab, `lab.rs`), the bootstrap and the checks, each one trip into the guest.

use std::time::{Duration, Instant};

use super::{Executor, DEFAULT_PROFILE};
use crate::error::{ErrorCode, Failure};
use crate::guest::bootstrap::{load_profile, run_bootstrap, BootstrapSettings};
use crate::guest::checks::{load_packs, run_checks, CheckContext, CheckSettings, CheckStatus};
use crate::guest::exec::{ExecError, ExecRequest, GuestExec};
use crate::guest::qemu::AgentApiError;
use crate::guest::qga_info::{exec_blocked_message, exec_offer, exec_refused_message, ExecOffer};
use crate::provision::machine::{Event, State, TxnKind};
use crate::pve::{GuestKind, PveError};

/// How a launch proof ended without proving the launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LaunchEnd {
    /// No exec answered (`launch_unproven`).
    Unproven(String),
    /// The VM's guest agent answered but refuses exec (`guest_exec_blocked`).
    ExecBlocked(String),
    /// Ctrl-C or SIGTERM during the wait: no verdict (the transaction stays open).
    Interrupted,
}

impl Executor<'_> {
    /// The boot wait, with an isolated copy's lab before and after it, in one exec; Ctrl-C
    /// stops it (the exec is dropped, as in the bootstrap); a resume waits again.
    pub(super) async fn wait_boot(
        &mut self,
        state: &State,
        vmid: u32,
        guest: GuestKind,
    ) -> Result<Event, Failure> {
        let cancel = self.cancel.clone();
        // An isolated copy is given its stored interfaces before the wait, so it boots
        // toward its stored network as its production guest does; what the isolation
        // or the node made fail is settled after it: all in the wait's one exec.
        let mut lab = self.lab_for(state, guest).await;
        // A member of an application group: root joins its stored interfaces to the group's
        // lab before the wait (the copy's own network units then bring them up).
        if let (Some(l), Some(member), GuestKind::Lxc) =
            (lab.as_mut(), state.request().group.as_ref(), guest)
        {
            let names = l.plain_names();
            // /etc/hosts as PVE writes it for the stored net0, before the interfaces exist:
            // nothing in the copy can have resolved its own name with them up meanwhile.
            let hosts_said = match (l.hosts_entry(), names.is_empty()) {
                (Some(h), false) => {
                    let exec = self.exec_for(vmid, guest, state.txn());
                    let lines: Vec<String> = match exec
                        .exec(&crate::guest::lab::hosts_request(h))
                        .await
                    {
                        Ok(out) => String::from_utf8_lossy(&out.stdout.bytes)
                            .lines()
                            .take(16)
                            .map(str::to_string)
                            .collect(),
                        Err(e) => {
                            tracing::warn!(vmid, "the copy's /etc/hosts was not given its stored address before the join: {e}");
                            Vec::new()
                        }
                    };
                    crate::guest::lab::hosts_note(h, &lines)
                }
                _ => None,
            };
            if !names.is_empty() {
                let op = crate::guest::exec::LabOp::Join {
                    lab: member.lab,
                    names,
                    link: member.link_bridge.clone(),
                };
                match self.lxc.lab_op(vmid, state.txn(), op).await {
                    Ok(note) => {
                        tracing::info!(vmid, txn = %state.txn(), "{note}");
                        l.joined = Some(match hosts_said {
                            Some(h) => format!("{h}; {note}"),
                            None => note,
                        });
                    }
                    Err(why) => {
                        return Ok(Event::GroupLabFailed {
                            message: format!(
                                "the copy {vmid} (transaction {}) could not be joined to its group {}'s lab {} on node {}: {why}; nothing was judged. Check that `ip netns` and `nsenter` work for root on the node, then `felhom-agent journal resume {}`",
                                state.txn(),
                                member.name,
                                crate::guest::group_lab::lab_name(member.lab),
                                self.cfg.node,
                                state.txn()
                            ),
                        });
                    }
                }
            }
        }
        let plan = lab.as_ref().map(|l| l.plan()).unwrap_or_default();
        let exec = self.exec_for(vmid, guest, state.txn());
        let trip = tokio::select! {
            t = crate::guest::boot::boot_trip(&exec, self.timeouts.boot, &plan) => t,
            () = cancel.cancelled() => {
                return Err(Failure::new(
                    ErrorCode::Interrupted,
                    format!(
                        "interrupted while waiting for the boot of vmid {vmid} to end (transaction {}); the journal holds the transaction and `felhom-agent journal resume {}` waits again",
                        state.txn(),
                        state.txn()
                    ),
                ));
            }
        };
        drop(exec);
        let waited = match lab {
            Some(lab) => self.lab_done(vmid, &lab, trip),
            None => trip.first,
        };
        Ok(match waited {
            Ok(seen) => {
                tracing::info!(vmid, "boot ended: {seen}");
                self.boot = Some(seen.clone());
                Event::BootEnded { seen }
            }
            Err(message) => {
                self.boot = Some(message.clone());
                Event::BootUnfinished {
                    message: format!(
                        "{message} ({} {vmid} on node {})",
                        guest.pve_word(),
                        self.cfg.node
                    ),
                }
            }
        })
    }

    /// The launch proof: an exec in the guest answers (a container's `pct exec`, a VM's guest
    /// agent), retried while the guest is still coming up, until the launch timeout.
    ///
    /// A VM's guest agent is first pinged (PVE answers 200 only once qemu-ga answered its own
    /// `guest-ping`) and asked what it allows (`agent/info`): one that refuses `guest-exec`
    /// (RHEL, Rocky and Alma ship it so) ends the proof as [`LaunchEnd::ExecBlocked`], as does
    /// an exec refused in qemu-ga's words when `guest-info` said nothing.
    pub(super) async fn prove_launch(
        &self,
        vmid: u32,
        guest: GuestKind,
        txn: ulid::Ulid,
    ) -> Result<(), LaunchEnd> {
        let node = &self.cfg.node;
        let deadline = Instant::now() + self.timeouts.launch_proof;
        let too_late = |last: &str| {
            LaunchEnd::Unproven(format!(
                "{} {vmid} on node {node} did not prove its launch within {}s: {last}; a guest that boots slower needs a higher [provision] launch_timeout_secs",
                guest.pve_word(),
                self.timeouts.launch_proof.as_secs()
            ))
        };
        if guest == GuestKind::Qemu {
            self.vm_agent_answers(vmid, deadline, &too_late).await?;
            match self.pve.agent_info(node, vmid).await {
                Ok(data) => match exec_offer(&data) {
                    ExecOffer::Offered => {}
                    ExecOffer::Refused { refused, version } => {
                        let seen = format!(
                            "its guest-info{}: {}",
                            version
                                .map(|v| format!(" (qemu-ga {v})"))
                                .unwrap_or_default(),
                            refused.join(", ")
                        );
                        return Err(LaunchEnd::ExecBlocked(exec_blocked_message(
                            vmid, node, &seen,
                        )));
                    }
                    ExecOffer::Unknown(why) => {
                        tracing::info!(vmid, "the guest agent's info says nothing of exec ({why}); the exec is tried")
                    }
                },
                Err(e) => {
                    tracing::info!(vmid, error = %e, "the guest agent's info could not be read; the exec is tried")
                }
            }
        }
        let exec = self.exec_for(vmid, guest, txn);
        let mut last: String;
        loop {
            // The exec is the proof (it answers only from a running guest); PVE's status is
            // read only when it did not answer, to say why.
            let req = ExecRequest::new(["/bin/sh", "-c", "echo felhom-launch-ok"])
                .timeout(Duration::from_secs(30));
            let answer = tokio::select! {
                a = exec.exec(&req) => a,
                () = self.cancel.cancelled() => return Err(LaunchEnd::Interrupted),
            };
            match answer {
                Ok(out) if out.success() && out.stdout.text().contains("felhom-launch-ok") => {
                    return Ok(())
                }
                Ok(out) => last = format!("the exec answered {}", out.summary()),
                // Only a guest that is still coming up is worth waiting for; a missing `pct`,
                // a bad request or a vanished guest will not get better.
                Err(e @ (ExecError::NotRunning { .. } | ExecError::AgentNotRunning { .. })) => {
                    last = match self.pve.status_current(node, guest, vmid).await {
                        Ok(st) if !st.is_running() => {
                            format!("{} {vmid} is {}", guest.pve_word(), st.status)
                        }
                        _ => e.to_string(),
                    }
                }
                Err(ExecError::Agent { message, .. })
                    if guest == GuestKind::Qemu && exec_refused_message(&message) =>
                {
                    let seen = format!(
                        "PVE answered its exec: {}",
                        crate::error::outside_text(&message)
                    );
                    return Err(LaunchEnd::ExecBlocked(exec_blocked_message(
                        vmid, node, &seen,
                    )));
                }
                Err(e) => {
                    return Err(LaunchEnd::Unproven(format!(
                        "{} {vmid} on node {node} did not answer an exec: {e}",
                        guest.pve_word()
                    )))
                }
            }
            self.pause_or_end(deadline, || too_late(&last)).await?;
        }
    }

    /// Between two tries of the launch proof: half a second, unless the deadline has passed
    /// (`too_late`) or Ctrl-C/SIGTERM came ([`LaunchEnd::Interrupted`]: an interrupted wait is
    /// no timeout).
    async fn pause_or_end(
        &self,
        deadline: Instant,
        too_late: impl FnOnce() -> LaunchEnd,
    ) -> Result<(), LaunchEnd> {
        if self.cancel.is_cancelled() {
            return Err(LaunchEnd::Interrupted);
        }
        if Instant::now() >= deadline {
            return Err(too_late());
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(500)) => Ok(()),
            () = self.cancel.cancelled() => Err(LaunchEnd::Interrupted),
        }
    }

    /// Ping a VM's guest agent until PVE answers 200 (its `guest-ping` answered, whatever
    /// `result` holds), while the VM or its agent is still coming up, until `deadline`.
    async fn vm_agent_answers(
        &self,
        vmid: u32,
        deadline: Instant,
        too_late: &impl Fn(&str) -> LaunchEnd,
    ) -> Result<(), LaunchEnd> {
        let node = &self.cfg.node;
        loop {
            let last = match self.pve.agent_ping(node, vmid).await {
                Ok(()) => return Ok(()),
                Err(PveError::Api(a)) => match AgentApiError::classify(a.status, &a.message) {
                    AgentApiError::NotRunning | AgentApiError::AgentNotRunning => {
                        match self.pve.status_current(node, GuestKind::Qemu, vmid).await {
                            Ok(st) if !st.is_running() => format!("VM {vmid} is {}", st.status),
                            _ => format!("the QEMU guest agent of VM {vmid} is not running; wait for the guest to finish booting or install and start qemu-guest-agent in it"),
                        }
                    }
                    AgentApiError::NoAgentConfigured => {
                        return Err(LaunchEnd::Unproven(format!(
                            "VM {vmid} on node {node} has no QEMU guest agent configured; set `agent: 1` in its config"
                        )))
                    }
                    other => {
                        return Err(LaunchEnd::Unproven(format!(
                            "VM {vmid} on node {node} did not answer a guest-agent ping: {other}"
                        )))
                    }
                },
                Err(e) => {
                    return Err(LaunchEnd::Unproven(format!(
                        "VM {vmid} on node {node} did not answer a guest-agent ping: {e}"
                    )))
                }
            };
            self.pause_or_end(deadline, || too_late(&last)).await?;
        }
    }

    pub(super) async fn bootstrap(
        &self,
        state: &State,
        vmid: u32,
        guest: GuestKind,
    ) -> Result<(), String> {
        if state.kind() == TxnKind::SelftestRestore {
            // A restored copy of a production guest is checked, never changed.
            tracing::info!(
                vmid,
                "restore test: no bootstrap inside a copy of a production guest"
            );
            return Ok(());
        }
        let name = state
            .request()
            .profile
            .as_deref()
            .unwrap_or(DEFAULT_PROFILE);
        let profile =
            load_profile(&self.cfg.provision.bootstrap_dir, name).map_err(|e| e.to_string())?;
        let exec = self.exec_for(vmid, guest, state.txn());
        let report = run_bootstrap(
            &exec,
            &profile,
            &state.txn().to_string(),
            &BootstrapSettings::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
        // The profile ran in the guest; its result is not journaled yet.
        #[cfg(feature = "test-hooks")]
        super::kill_point("during-bootstrap");
        report.into_result().map(|_| ()).map_err(|e| e.to_string())
    }

    pub(super) async fn run_checks(
        &mut self,
        vmid: u32,
        guest: GuestKind,
        restore: bool,
        txn: ulid::Ulid,
        volid: &str,
    ) -> Result<(), String> {
        let dir = if restore {
            &self.cfg.restore_test.checks_dir
        } else {
            &self.cfg.provision.checks_dir
        };
        let mut checks = load_packs(dir).map_err(|e| e.to_string())?;
        // A check that needs the guest's application group runs only in the group's run.
        let in_group = self.group.is_some();
        checks.retain(|c| in_group || !c.scope.in_group);
        // Checks for chosen guests only (`guests`, `guest_tags`): those of the guest whose
        // backup this copy is, by its vmid or a PVE tag of the restored config.
        if checks.iter().any(|c| c.scope != Default::default()) {
            let source = crate::pve::types::backup_owner_from_volid(volid);
            let tags = if checks.iter().any(|c| c.scope.needs_tags()) {
                match self.pve.config_get(&self.cfg.node, guest, vmid).await {
                    Ok(c) => c
                        .get("tags")
                        .and_then(|v| v.as_str())
                        .map(crate::guest::checks::split_tags)
                        .unwrap_or_default(),
                    Err(_) => Vec::new(),
                }
            } else {
                Vec::new()
            };
            checks.retain(|c| c.scope.applies(source, &tags));
        }
        if checks.is_empty() {
            return Err(format!(
                "no checks in {}: a guest is only green when checked; install the default pack (checks.d/default.toml)",
                dir.display()
            ));
        }
        // The name from a config read of this run (the marker's read-back), else read now.
        let seen = self
            .guest_name
            .lock()
            .ok()
            .and_then(|n| n.clone())
            .filter(|n| n.vmid == vmid);
        let (hostname, cloudinit) = match seen {
            Some(n) => (n.name, n.cloudinit),
            None => match self.pve.config_get(&self.cfg.node, guest, vmid).await {
                Ok(c) => {
                    let n = super::GuestName::of(vmid, guest, &c);
                    (n.name, n.cloudinit)
                }
                Err(_) => (String::new(), None),
            },
        };
        let ctx = CheckContext::new()
            .with("hostname", hostname.clone())
            .with("vmid", vmid.to_string())
            .with("node", self.cfg.node.clone())
            .with("txn", txn.to_string());
        let exec = self.exec_for(vmid, guest, txn);
        self.checks = run_checks(&exec, &checks, &ctx, &CheckSettings::default()).await;
        if guest == GuestKind::Qemu {
            match &cloudinit {
                Some(names) => {
                    crate::guest::checks::vm_hostname_cloudinit(&checks, &mut self.checks, names)
                }
                None => {
                    crate::guest::checks::vm_hostname_unjudged(&checks, &mut self.checks, &hostname)
                }
            }
        }
        crate::guest::checks::say_why_kept(&mut self.checks, &self.lab_kept);
        let bad: Vec<String> = self
            .checks
            .iter()
            // A skipped check (not judged) is no fault: only failures and errors hold the copy.
            .filter(|c| matches!(c.status, CheckStatus::Fail | CheckStatus::Error))
            .map(|c| {
                format!(
                    "{} ({:?}: {})",
                    c.name,
                    c.status,
                    c.message.as_deref().unwrap_or("")
                )
            })
            .collect();
        if bad.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "checks did not pass in {} {vmid}: {}",
                guest.pve_word(),
                bad.join("; ")
            ))
        }
    }
}
