//! Work inside a guest: exec (LXC through `pct`, QEMU through the guest agent API), bootstrap
//! profiles and osquery checks.
//!
//! - [`exec`]: the [`GuestExec`] seam, its request/outcome types, the controlled environment,
//!   push verification;
//! - [`lxc`]: [`LxcExec`], `pct exec` (files too, on its stdin);
//! - [`lxc_monitor`]: who holds a container's LXC command socket, checked before every `pct exec`;
//! - [`qemu`]: [`QemuExec`] over the [`GuestAgentApi`] seam the PVE client implements;
//! - [`qga_info`]: what a VM's guest agent says it allows (`guest-info`), read before its
//!   first exec;
//! - [`boot`]: the wait for the guest's boot to end (systemd's `is-system-running`, asked once a second in one exec);
//! - [`lab`]: what an isolated copy is given (its stored interfaces, inside it) and which of its
//!   failed units are the isolation's or the node's doing;
//! - [`bootstrap`]: profiles pushed into the guest and run once per transaction;
//! - [`checks`]: osquery check packs, run with `osqueryi --json` and judged pass/fail/error.
//!
//! This module never decides whether a guest may be destroyed and never reads the agent's own
//! environment into a guest.

pub mod boot;
pub mod bootstrap;
pub mod checks;
pub mod exec;
pub mod frames;
pub mod group_lab;
pub mod group_net;
pub mod lab;
pub mod lxc;
pub mod lxc_monitor;
pub mod qemu;
pub mod qemu_pve;
pub mod qga_info;

pub use bootstrap::{
    load_profile, run_bootstrap, BootstrapError, BootstrapMarker, BootstrapOutcome,
    BootstrapProfile, BootstrapReport, BootstrapSettings, BootstrapStatus,
};
pub use checks::{
    load_packs, parse_pack, run_checks, Check, CheckContext, CheckError, CheckResult,
    CheckSettings, CheckStatus, Expectation,
};
pub use exec::{
    Captured, DynGuestExec, ExecError, ExecFuture, ExecIds, ExecOutcome, ExecRequest, GuestExec,
    GuestExit, GuestRef, LxcExecFactory, PushReceipt, PushSource,
};
pub use lxc::{LxcExec, PctConfig};
pub use qemu::{AgentApiError, AgentExecStatus, GuestAgentApi, QemuConfig, QemuExec};

/// Either kind of guest, for callers that pick the implementation at run time.
#[derive(Debug)]
pub enum AnyGuestExec<A> {
    /// An LXC container.
    Lxc(LxcExec),
    /// A QEMU VM.
    Qemu(QemuExec<A>),
}

impl<A: GuestAgentApi> GuestExec for AnyGuestExec<A> {
    fn guest(&self) -> GuestRef {
        match self {
            Self::Lxc(e) => e.guest(),
            Self::Qemu(e) => e.guest(),
        }
    }

    async fn exec(&self, request: &ExecRequest) -> Result<ExecOutcome, ExecError> {
        match self {
            Self::Lxc(e) => e.exec(request).await,
            Self::Qemu(e) => e.exec(request).await,
        }
    }

    async fn push_file(
        &self,
        source: &PushSource,
        guest_path: &str,
        mode: u32,
    ) -> Result<PushReceipt, ExecError> {
        match self {
            Self::Lxc(e) => e.push_file(source, guest_path, mode).await,
            Self::Qemu(e) => e.push_file(source, guest_path, mode).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>(_: &T) {}

    /// The futures of this module can be spawned on a multi-threaded runtime.
    #[test]
    fn guest_futures_are_send() {
        let lxc = LxcExec::new(101, PctConfig::default());
        let request = ExecRequest::new(["true"]);
        assert_send(&lxc.exec(&request));
        let profile = BootstrapProfile {
            name: "p".into(),
            dir: "/nonexistent".into(),
            run: "/nonexistent/run".into(),
            dirs: Vec::new(),
            files: Vec::new(),
        };
        let settings = BootstrapSettings::default();
        assert_send(&run_bootstrap(&lxc, &profile, "01TXN", &settings));
        let ctx = CheckContext::new();
        let check_settings = CheckSettings::default();
        assert_send(&run_checks(&lxc, &[], &ctx, &check_settings));
    }
}
