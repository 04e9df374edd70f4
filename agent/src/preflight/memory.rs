//! The memory a restore-test copy takes and the node can give copies: read by the run's
//! admission and by `doctor`.

use crate::config::Config;

/// The node's memory for copies (MiB): what is available now less the reserve, and the most it
/// could ever be (its total less the reserve).
pub fn node_memory_for_copies(cfg: &Config) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(meminfo_path()).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
    };
    let total = field("MemTotal:")?;
    let avail = field("MemAvailable:")?;
    let reserve = total / 100 * u64::from(cfg.restore_test.memory_reserve_percent);
    Some((
        avail.saturating_sub(reserve) / 1024,
        total.saturating_sub(reserve) / 1024,
    ))
}

#[cfg(not(feature = "test-hooks"))]
fn meminfo_path() -> std::path::PathBuf {
    std::path::PathBuf::from("/proc/meminfo")
}

/// The bed may hand a meminfo of its own (`FELHOM_AGENT_MEMINFO`), to show a node short of
/// memory.
#[cfg(feature = "test-hooks")]
fn meminfo_path() -> std::path::PathBuf {
    std::env::var_os("FELHOM_AGENT_MEMINFO").map_or_else(
        || std::path::PathBuf::from("/proc/meminfo"),
        std::path::PathBuf::from,
    )
}

/// The memory a copy of this stored config takes (MiB): its `memory` (PVE's default 512).
pub fn stored_memory_mib(stored: Option<&crate::pve::guest_config::StoredConfigText>) -> u64 {
    stored
        .and_then(|s| {
            s.text
                .lines()
                .take_while(|l| !l.starts_with('['))
                .find_map(|l| l.strip_prefix("memory:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .unwrap_or(512)
}
