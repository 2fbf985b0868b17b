//! The TCP data wire (`ferry_transport_tcp::wire`): every 24-byte window of the input as a
//! request header and every 8-byte window as a status frame, as a target and an initiator read
//! them off a connection.
//!
//! Holds: decoding never panics; a decoded header re-encodes to the same bytes (its 7 padding
//! bytes aside, which decoding ignores and encoding zeroes) and decodes again to itself; a
//! decoded status frame re-encodes to exactly its bytes; every refusal is the one error that
//! describes the bytes.

#![no_main]

use ferry_transport_tcp::wire::{HEADER_LEN, Header, STATUS_LEN, STATUS_MAGIC, Status, V2_FLAG, WireError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for window in data.windows(HEADER_LEN).step_by(1 + data.len() / 64) {
        header(window.try_into().expect("a window of HEADER_LEN bytes"));
    }
    for window in data.windows(STATUS_LEN) {
        status(window.try_into().expect("a window of STATUS_LEN bytes"));
    }
});

fn header(bytes: &[u8; HEADER_LEN]) {
    match Header::decode(bytes) {
        Ok(h) => {
            let again = h.encode();
            assert_eq!(again[..17], bytes[..17], "size, address and opcode byte re-encode unchanged");
            assert_eq!(again[17..], [0u8; 7], "padding is encoded as zeroes");
            assert_eq!(Header::decode(&again), Ok(h));
            assert_eq!(h.v2, bytes[16] & V2_FLAG != 0);
        }
        Err(WireError::BadOpcode(op)) => {
            assert_eq!(op, bytes[16] & !V2_FLAG);
            assert!(op > 1, "READ (0) and WRITE (1) are valid");
            assert!(!WireError::BadOpcode(op).to_string().is_empty());
        }
        Err(e) => panic!("a header can only have a bad opcode, got {e}"),
    }
}

fn status(bytes: &[u8; STATUS_LEN]) {
    let v = u64::from_le_bytes(*bytes);
    match Status::decode(bytes) {
        Ok(s) => assert_eq!(&s.encode(), bytes, "a status frame re-encodes to its bytes"),
        Err(WireError::BadMagic(got)) => {
            assert_eq!(got, v);
            assert_ne!((v >> 32) as u32, STATUS_MAGIC);
        }
        Err(WireError::BadStatus(code)) => {
            assert_eq!((v >> 32) as u32, STATUS_MAGIC);
            assert_eq!(code, v as u32);
            assert!(code > 1);
        }
        Err(e) => panic!("unexpected status error {e}"),
    }
}
