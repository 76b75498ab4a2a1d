//! Feeds arbitrary bytes to the pgoutput decoder, inside and outside a streamed
//! block. The decoder must never panic or read out of bounds, and whatever it accepts
//! must re-encode to exactly the input.

#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use walbox_pgoutput::{decode, encode};

fuzz_target!(|data: &[u8]| {
    let buf = Bytes::copy_from_slice(data);
    for in_stream in [false, true] {
        if let Ok(msg) = decode(&buf, in_stream) {
            let mut again = BytesMut::new();
            encode(&msg, &mut again);
            assert_eq!(&again[..], data, "accepted input does not round-trip: {msg:?}");
        }
    }
});
