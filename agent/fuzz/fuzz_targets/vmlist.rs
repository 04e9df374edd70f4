//! Fuzzes the `/etc/pve/.vmlist` parser: it must never panic, it must give exactly what the
//! JSON reference decoder gives, and whatever it accepts must be a list a vmid check can trust
//! (no vmid twice, no vmid 0, no empty node).
#![no_main]

use std::collections::BTreeSet;

use felhom_agent::inventory::{parse_vmlist, parse_vmlist_reference};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let parsed = parse_vmlist(data);
    assert_eq!(parsed, parse_vmlist_reference(data));
    if let Ok(entries) = parsed {
        let mut seen = BTreeSet::new();
        for e in &entries {
            assert!(e.vmid != 0, "vmid 0 accepted");
            assert!(!e.node.is_empty(), "empty node accepted");
            assert!(seen.insert(e.vmid), "vmid {} accepted twice", e.vmid);
        }
    }
});
