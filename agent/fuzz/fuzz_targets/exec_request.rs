//! Fuzzes the exec helper's request decoder (what a caller of the root helper sends): it must
//! never panic, every request it accepts stays within the limits and names no host path (a lab
//! request only plain interface names), and
//! an accepted request encodes and decodes to itself.
#![no_main]

use felhom_agent::exec_helper::proto::{
    decode_request, encode_request, Op, MAX_ARGS, MAX_BLOB_BYTES, MAX_GUEST_PATH_BYTES,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(request) = decode_request(data) else {
        return;
    };
    assert!((100..=999_999_999).contains(&request.vmid));
    match &request.op {
        Op::Exec(e) => {
            assert!(!e.argv.is_empty() && !e.argv[0].is_empty());
            assert!(e.argv.len() + e.env.len() <= MAX_ARGS);
            assert!(e.stdin.as_ref().is_none_or(|s| s.len() <= MAX_BLOB_BYTES));
            assert!(e.argv.iter().all(|a| !a.contains('\0')));
        }
        Op::Push { path, mode, data } => {
            assert!(path.starts_with('/') && path.len() <= MAX_GUEST_PATH_BYTES);
            assert!(!path.split('/').any(|c| c == ".."));
            assert!(*mode <= 0o7777);
            assert!(data.len() <= MAX_BLOB_BYTES);
        }
        // A lab request names only interfaces the lab gives: plain names, never a path.
        Op::LabJoin { names, .. } => {
            assert!(!names.is_empty() && names.len() <= 8);
            assert!(names
                .iter()
                .all(|n| felhom_agent::guest::lab::valid_ifname(n) && !n.contains('/')));
        }
        Op::LabRemove { .. } => {}
    }
    let again = decode_request(&encode_request(&request)).expect("an encoded request decodes");
    assert_eq!(again, request);
});
