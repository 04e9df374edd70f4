//! Test bed for felhom-agent: the fakepve wrapper, the `pct` stand-in, the development hub.
//!
//! Everything here runs on loopback only and is shared by the integration tests in `tests/`.
//! [`fakepve`] starts a fake Proxmox VE API per test from a scenario and drives it; it needs the
//! fakepve venv that `tests/run.sh` installs.

pub mod agent;
pub mod devhub;
pub mod fakepve;
pub mod guestbed;
pub mod nspawn;
pub mod reach;
pub mod verdict;
pub mod world;

/// Print a figure a test measured so that it shows in the test command's output even when the
/// test passes: on the stderr handle (cargo's test harness captures `print!`, not that), and
/// appended to the file `FELHOM_TEST_REPORTS` names, if any (`tests/run.sh` prints that file
/// after the run: nextest keeps a passing test's output to itself).
pub fn report(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
    if let Some(path) = std::env::var_os("FELHOM_TEST_REPORTS") {
        // One write of a short line to a file opened for appending: lines of tests running at
        // once do not interleave.
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(format!("{line}\n").as_bytes());
        }
    }
}

/// Every `.rs` file below `dir`, in path order (panics when a folder cannot be read): what the
/// source-reading tests (module dependencies, the PVE call map) walk.
pub fn rust_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut entries: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            e.unwrap_or_else(|e| panic!("entry of {}: {e}", dir.display()))
                .path()
        })
        .collect();
    entries.sort();
    let mut out = Vec::new();
    for p in entries {
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}
