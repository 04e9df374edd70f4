//! Fuzzes the frame decoder with arbitrary frames, in both directions. It must never panic,
//! every error must be sendable back as a bounded `protocol_error`, and every frame it accepts
//! must re-encode to a frame that decodes to the same envelope.
#![no_main]

use std::fmt::Debug;

use hub_protocol::{
    decode, encode, AgentMessage, HubMessage, Message, MAX_ERROR_MESSAGE_BYTES, MAX_FRAME_BYTES,
};
use libfuzzer_sys::fuzz_target;

fn check<M: Message + PartialEq + Debug>(frame: &str) {
    match decode::<M>(frame) {
        Err(err) => {
            assert!(!err.message.is_empty(), "empty protocol error message");
            assert!(
                err.message.len() <= MAX_ERROR_MESSAGE_BYTES,
                "unbounded message"
            );
        }
        Ok(envelope) => {
            assert!(frame.len() <= MAX_FRAME_BYTES, "oversized frame accepted");
            if let Ok(again) = encode(&envelope) {
                assert_eq!(
                    decode::<M>(&again).ok(),
                    Some(envelope),
                    "round trip differs"
                );
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // Websocket text frames are UTF-8; map anything else onto text so every input counts.
    let frame = String::from_utf8_lossy(data);
    check::<AgentMessage>(&frame);
    check::<HubMessage>(&frame);
});
