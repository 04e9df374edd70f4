//! The guest exec seam's QEMU side ([`GuestAgentApi`]) implemented by the PVE client: the
//! guest layer uses the PVE client, never the other way round.

use super::qemu::{AgentApiError, AgentExecStatus, GuestAgentApi};
use crate::pve::request::build;
use crate::pve::{PveClient, PveError};

fn agent_error(e: PveError) -> AgentApiError {
    match e {
        PveError::Api(a) => AgentApiError::classify(a.status, &a.message),
        PveError::Unreachable { detail, .. } => AgentApiError::Transport { message: detail },
        other => AgentApiError::Other {
            status: 0,
            message: other.to_string(),
        },
    }
}

impl GuestAgentApi for PveClient {
    async fn agent_exec(
        &self,
        node: &str,
        vmid: u32,
        command: &[String],
        input_data: Option<&str>,
    ) -> Result<u64, AgentApiError> {
        PveClient::agent_exec(self, node, vmid, command, input_data)
            .await
            .map_err(agent_error)
    }

    async fn agent_exec_status(
        &self,
        node: &str,
        vmid: u32,
        pid: u64,
    ) -> Result<AgentExecStatus, AgentApiError> {
        // One request, never retried: qemu-ga forgets a pid once it reported its exit.
        let req = build::agent_exec_status(node, vmid, pid);
        let data = self
            .call_once_max(&req, crate::pve::client::MAX_EXEC_STATUS_BYTES)
            .await
            .map_err(agent_error)?;
        AgentExecStatus::from_json(&data).map_err(|message| AgentApiError::Other {
            status: 200,
            message,
        })
    }
}
