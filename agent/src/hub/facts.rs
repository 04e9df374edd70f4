//! Host facts for the hello, read with sysinfo. Read once per session and dropped: nothing of
//! sysinfo stays in memory between sessions.

use hub_protocol::HostFacts;
use sysinfo::{CpuRefreshKind, MemoryRefreshKind, RefreshKind, System};

/// The host facts as read now. Unknown values are empty or zero.
pub fn host_facts() -> HostFacts {
    let sys = System::new_with_specifics(
        RefreshKind::nothing()
            .with_cpu(CpuRefreshKind::nothing())
            .with_memory(MemoryRefreshKind::nothing().with_ram()),
    );
    HostFacts {
        hostname: System::host_name().unwrap_or_default(),
        kernel: System::kernel_version().unwrap_or_default(),
        os: System::long_os_version()
            .or_else(System::name)
            .unwrap_or_default(),
        cpu_count: u32::try_from(sys.cpus().len()).unwrap_or(u32::MAX),
        memory_total_bytes: sys.total_memory(),
        uptime_secs: System::uptime(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_host() {
        let facts = host_facts();
        assert!(facts.cpu_count >= 1, "{facts:?}");
        assert!(facts.memory_total_bytes > 0, "{facts:?}");
        assert!(!facts.kernel.is_empty(), "{facts:?}");
        assert!(facts.uptime_secs > 0, "{facts:?}");
    }
}
