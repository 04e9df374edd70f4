//! Fuzzes the `/etc/pve/.vmlist` parser: it must never panic, and whatever it accepts must be
//! a list a vmid check can trust (no vmid twice, no vmid 0, no empty node).
#![no_main]

use std::collections::BTreeSet;

use felhom_agent::inventory::parse_vmlist;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(entries) = parse_vmlist(data) {
        let mut seen = BTreeSet::new();
        for e in &entries {
            assert!(e.vmid != 0, "vmid 0 accepted");
            assert!(!e.node.is_empty(), "empty node accepted");
            assert!(seen.insert(e.vmid), "vmid {} accepted twice", e.vmid);
        }
    }
});
