//! Property tests of the TCP data wire's decoders (`wire::Header`, `wire::Status`) on the
//! stable toolchain: arbitrary byte streams cut into frames, every single-bit flip of a valid
//! header and status frame, and valid frames with bytes overwritten. Decoding never panics,
//! refuses exactly what it must, and what decodes re-encodes to its bytes. The fuzz target
//! `tcp_wire` (fuzz/, nightly) checks the same at scale.
//!
//! Seeded (a fixed proptest seed), a few hundred cases each: seconds.

use ferry_core::Opcode;
use ferry_transport_tcp::wire::{HEADER_LEN, Header, STATUS_LEN, STATUS_MAGIC, Status, V2_FLAG, WireError};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_seed: RngSeed::Fixed(0x07C9_3A1E),
        failure_persistence: None,
        max_shrink_time: 20_000,
        ..ProptestConfig::default()
    }
}

fn header() -> impl Strategy<Value = Header> {
    let edge = prop_oneof![any::<u64>(), Just(0), Just(1), Just(u64::MAX), Just(u64::MAX - 1), Just(1 << 63)];
    (edge.clone(), edge, any::<bool>(), any::<bool>()).prop_map(|(size, addr, write, v2)| Header {
        size,
        addr,
        opcode: if write { Opcode::Write } else { Opcode::Read },
        v2,
    })
}

/// What decoding 24 bytes must give: the fields as laid out, or the bad opcode.
fn expected(b: &[u8; HEADER_LEN]) -> Result<Header, WireError> {
    let opcode = match b[16] & !V2_FLAG {
        0 => Opcode::Read,
        1 => Opcode::Write,
        other => return Err(WireError::BadOpcode(other)),
    };
    Ok(Header {
        size: u64::from_le_bytes(b[..8].try_into().unwrap()),
        addr: u64::from_le_bytes(b[8..16].try_into().unwrap()),
        opcode,
        v2: b[16] & V2_FLAG != 0,
    })
}

fn check_header(b: &[u8; HEADER_LEN]) -> Result<(), TestCaseError> {
    let got = Header::decode(b);
    prop_assert_eq!(got, expected(b));
    if let Ok(h) = got {
        let again = h.encode();
        prop_assert_eq!(&again[..17], &b[..17]);
        prop_assert_eq!(Header::decode(&again), Ok(h));
    }
    Ok(())
}

fn check_status(b: &[u8; STATUS_LEN]) -> Result<(), TestCaseError> {
    let v = u64::from_le_bytes(*b);
    let want = match ((v >> 32) as u32, v as u32) {
        (STATUS_MAGIC, 0) => Ok(Status::Ok),
        (STATUS_MAGIC, 1) => Ok(Status::Rejected),
        (STATUS_MAGIC, c) => Err(WireError::BadStatus(c)),
        _ => Err(WireError::BadMagic(v)),
    };
    let got = Status::decode(b);
    prop_assert_eq!(got, want);
    if let Ok(s) = got {
        prop_assert_eq!(&s.encode(), b);
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(512))]

    /// Any bytes a connection may carry, read as a target reads headers and an initiator
    /// reads status frames: at every offset.
    #[test]
    fn arbitrary_streams(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        for w in bytes.windows(HEADER_LEN) {
            check_header(w.try_into().unwrap())?;
        }
        for w in bytes.windows(STATUS_LEN) {
            check_status(w.try_into().unwrap())?;
        }
    }

    /// Headers sent back to back (pipelined) decode one by one to what was sent.
    #[test]
    fn pipelined_headers(headers in prop::collection::vec(header(), 1..16)) {
        let stream: Vec<u8> = headers.iter().flat_map(Header::encode).collect();
        let got: Vec<Header> = stream.chunks_exact(HEADER_LEN).map(|c| Header::decode(c.try_into().unwrap()).unwrap()).collect();
        prop_assert_eq!(got, headers);
    }

    /// Each of a valid header's 192 bits flipped: a field changes by exactly that bit, the
    /// opcode becomes invalid, or (in the padding) nothing changes.
    #[test]
    fn every_bit_flip_of_a_header(h in header()) {
        for bit in 0..HEADER_LEN * 8 {
            let mut b = h.encode();
            b[bit / 8] ^= 1 << (bit % 8);
            let got = Header::decode(&b);
            match bit {
                0..64 => prop_assert_eq!(got, Ok(Header { size: h.size ^ (1 << bit), ..h })),
                64..128 => prop_assert_eq!(got, Ok(Header { addr: h.addr ^ (1 << (bit - 64)), ..h })),
                128 => {
                    let flipped = if h.opcode == Opcode::Read { Opcode::Write } else { Opcode::Read };
                    prop_assert_eq!(got, Ok(Header { opcode: flipped, ..h }));
                }
                129..135 => prop_assert_eq!(got, Err(WireError::BadOpcode((h.opcode as u8) | (1 << (bit - 128))))),
                135 => prop_assert_eq!(got, Ok(Header { v2: !h.v2, ..h })),
                _ => prop_assert_eq!(got, Ok(h), "padding is ignored"),
            }
        }
    }

    /// Each of a valid status frame's 64 bits flipped: the low bit swaps OK and rejected, other
    /// code bits make a bad status, magic bits a bad magic.
    #[test]
    fn every_bit_flip_of_a_status_frame(rejected in any::<bool>()) {
        let s = if rejected { Status::Rejected } else { Status::Ok };
        for bit in 0..64 {
            let v = u64::from_le_bytes(s.encode()) ^ (1 << bit);
            let got = Status::decode(&v.to_le_bytes());
            match bit {
                0 => prop_assert_eq!(got, Ok(if rejected { Status::Ok } else { Status::Rejected })),
                1..32 => prop_assert_eq!(got, Err(WireError::BadStatus(v as u32))),
                _ => prop_assert_eq!(got, Err(WireError::BadMagic(v))),
            }
        }
    }

    /// A valid header and status frame with a few bytes overwritten.
    #[test]
    fn overwritten_bytes(h in header(), writes in prop::collection::vec((0usize..HEADER_LEN + STATUS_LEN, any::<u8>()), 1..6)) {
        let mut b = h.encode().to_vec();
        b.extend_from_slice(&Status::Ok.encode());
        for (at, v) in writes {
            b[at] = v;
        }
        check_header(b[..HEADER_LEN].try_into().unwrap())?;
        check_status(b[HEADER_LEN..].try_into().unwrap())?;
    }
}
