//! Fuzzes the vmid policy with arbitrary operator input: one verdict, never a panic, and a
//! vmid that is accepted is exactly PVE's format and never reserved.
#![no_main]

use std::collections::BTreeMap;

use felhom_agent::vmid::{check, Holder, ReservedBand, VmidVerdict};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(input) = std::str::from_utf8(data) else {
        return;
    };
    let guests: BTreeMap<u32, Holder> = BTreeMap::new();
    let verdict = check(input, &guests);
    let message = verdict.message();
    assert!(!message.is_empty());
    match verdict {
        VmidVerdict::Free { vmid } => {
            assert_eq!(vmid.to_string(), input);
            assert!(ReservedBand::of(vmid).is_none());
        }
        VmidVerdict::Reserved { vmid, .. } => assert!(ReservedBand::of(vmid).is_some()),
        VmidVerdict::InUse { .. } => panic!("in use with no guests"),
        VmidVerdict::Invalid { .. } => assert!(verdict_code_is_invalid(input)),
    }
});

fn verdict_code_is_invalid(input: &str) -> bool {
    let b = input.as_bytes();
    !(b.len() >= 3 && b.len() <= 9 && b[0] != b'0' && b.iter().all(u8::is_ascii_digit))
}
