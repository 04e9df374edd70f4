//! Fuzzes the `pct list` parser: it must never panic, and every entry it accepts is a
//! container on the node it was told.
#![no_main]

use felhom_agent::inventory::{parse_pct_list, GuestType};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(entries) = parse_pct_list(text, "pve1") {
        for e in &entries {
            assert!(e.vmid != 0);
            assert_eq!(e.kind, GuestType::Lxc);
            assert_eq!(&*e.node, "pve1");
        }
    }
});
