//! Property tests of the P2P handshake's frame decoders (`frame::decode`, `frame::read_frame`)
//! and the JSON bodies they carry, on the stable toolchain: arbitrary bytes under any size
//! limit, valid frames mutated, and pipelined frames split at arbitrary points. Decoding never
//! panics, the two decoders agree, and what decodes re-encodes to its bytes. The fuzz target
//! `p2p_frame` (fuzz/, nightly) checks the same at scale.
//!
//! Seeded (a fixed proptest seed), a few hundred cases each: seconds.

use std::time::Duration;

use ferry_core::{Notification, SegmentDescriptor};
use ferry_metadata_p2p::frame::{DEFAULT_MAX_FRAME, Frame, FrameError, FrameType, decode, encode, read_frame};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_seed: RngSeed::Fixed(0x00F2_A3E5),
        failure_persistence: None,
        max_shrink_time: 20_000,
        ..ProptestConfig::default()
    }
}

const KINDS: [FrameType; 4] = [FrameType::Connection, FrameType::Metadata, FrameType::Notify, FrameType::Probe];

/// What `read_frame` makes of `bytes` (a connection that sends them, then closes).
fn read_all(bytes: &[u8], max: u64) -> std::io::Result<Frame> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    rt.block_on(read_frame(&mut &bytes[..], max, Duration::from_secs(60)))
}

/// Decodes `bytes` both ways and checks what must hold.
fn check(bytes: &[u8], max: u64) -> Result<(), TestCaseError> {
    let decoded = decode(bytes, max);
    let announced = bytes.first_chunk::<8>().map(|b| u64::from_le_bytes(*b));
    match &decoded {
        Ok(Some((frame, used))) => {
            let len = announced.unwrap();
            prop_assert!(len >= 1 && len <= max);
            prop_assert_eq!(*used as u64, 8 + len);
            let body = &bytes[8..*used];
            if body[0] <= 3 {
                prop_assert_eq!(encode(frame.kind, &frame.payload), &bytes[..*used], "re-encodes to its bytes");
            } else {
                prop_assert_eq!(frame, &Frame { kind: FrameType::Metadata, payload: body.to_vec() }, "old protocol");
            }
        }
        Ok(None) => {
            if let Some(len) = announced {
                prop_assert!((bytes.len() as u64 - 8) < len, "more bytes are needed only when they are missing");
            }
        }
        Err(FrameError::Empty) => prop_assert_eq!(announced, Some(0)),
        Err(FrameError::TooLong(len, limit)) => {
            prop_assert_eq!(Some(*len), announced);
            prop_assert!(len > limit && *limit <= max);
        }
    }
    match (&decoded, read_all(bytes, max)) {
        (Ok(Some((frame, _))), Ok(got)) => prop_assert_eq!(&got, frame),
        (Ok(None), Err(e)) => prop_assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof),
        (Err(_), Err(e)) => prop_assert_eq!(e.kind(), std::io::ErrorKind::InvalidData),
        (d, r) => prop_assert!(false, "decode gave {:?}, read_frame {:?}", d, r),
    }
    Ok(())
}

/// Size limits: small ones, the default, and ones near `u64::MAX` (which let any length pass).
fn limit() -> impl Strategy<Value = u64> {
    prop_oneof![
        1u64..64,
        Just(DEFAULT_MAX_FRAME),
        (0u64..16).prop_map(|d| u64::MAX - d),
        any::<u64>().prop_map(|m| m.max(1))
    ]
}

/// A frame's announced length: small, near the default limit, or near `u64::MAX`.
fn length() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..64,
        (DEFAULT_MAX_FRAME - 2)..(DEFAULT_MAX_FRAME + 2),
        (0u64..16).prop_map(|d| u64::MAX - d),
        any::<u64>()
    ]
}

/// A JSON body a handshake carries: a notification, a descriptor, a probe or an empty object.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        (".{0,16}", ".{0,32}")
            .prop_map(|(name, notify_msg)| serde_json::to_vec(&Notification { name, notify_msg }).unwrap()),
        Just(br#"{"name":"127.0.0.1:16000","protocol":"tcp","tcp_data_port":40000,"tcp_proto_version":2}"#.to_vec()),
        Just(br#"{"status":"success"}"#.to_vec()),
        Just(b"{}".to_vec()),
    ]
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn arbitrary_bytes_under_any_limit(bytes in prop::collection::vec(any::<u8>(), 0..96), max in limit()) {
        check(&bytes, max)?;
    }

    #[test]
    fn any_announced_length_under_any_limit(len in length(), tail in prop::collection::vec(any::<u8>(), 0..32), max in limit()) {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(&tail);
        check(&bytes, max)?;
    }

    /// A valid frame with its bytes mutated: an overwritten byte, a cut, or bytes inserted.
    #[test]
    fn mutated_valid_frames(
        kind in 0usize..4,
        payload in body(),
        at in any::<usize>(),
        byte in any::<u8>(),
        how in 0u8..3,
    ) {
        let mut bytes = encode(KINDS[kind], &payload);
        let at = at % bytes.len();
        match how {
            0 => bytes[at] = byte,
            1 => bytes.truncate(at),
            _ => bytes.insert(at, byte),
        }
        check(&bytes, DEFAULT_MAX_FRAME)?;
        // What a listener then parses never panics.
        if let Ok(Some((f, _))) = decode(&bytes, DEFAULT_MAX_FRAME) {
            let _ = serde_json::from_slice::<Notification>(&f.payload);
            let _ = SegmentDescriptor::from_json("peer", &f.payload);
        }
    }

    /// Frames sent back to back and received in arbitrary pieces: each decode either needs more
    /// bytes or returns the next frame, in order, using exactly its bytes.
    #[test]
    fn pipelined_frames_arrive_in_pieces(
        frames in prop::collection::vec((0usize..4, body()), 1..6),
        cuts in prop::collection::vec(1usize..40, 1..40),
    ) {
        let stream: Vec<u8> = frames.iter().flat_map(|(k, p)| encode(KINDS[*k], p)).collect();
        let mut got = Vec::new();
        let (mut buf, mut sent) = (Vec::new(), 0);
        for n in cuts.iter().cycle() {
            if sent == stream.len() {
                break;
            }
            let next = (sent + n).min(stream.len());
            buf.extend_from_slice(&stream[sent..next]);
            sent = next;
            while let Some((frame, used)) = decode(&buf, DEFAULT_MAX_FRAME).unwrap() {
                buf.drain(..used);
                got.push(frame);
            }
        }
        prop_assert!(buf.is_empty());
        let want: Vec<Frame> = frames.into_iter().map(|(k, payload)| Frame { kind: KINDS[k], payload }).collect();
        prop_assert_eq!(got, want);
    }

    /// A notification with any sender and message survives the frame and its JSON.
    #[test]
    fn notifications_round_trip(name in any::<String>(), notify_msg in any::<String>()) {
        let n = Notification { name, notify_msg };
        let bytes = encode(FrameType::Notify, &serde_json::to_vec(&n).unwrap());
        let (f, used) = decode(&bytes, DEFAULT_MAX_FRAME).unwrap().unwrap();
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(serde_json::from_slice::<Notification>(&f.payload).unwrap(), n);
    }
}

/// A limit that allows lengths no buffer can hold (a caller's choice: the listener uses 1 MiB)
/// refuses such a length instead of overflowing the frame's end offset (which panicked in debug
/// builds and wrapped in release ones).
#[test]
fn a_length_past_the_address_space_is_too_long_whatever_the_limit() {
    for len in [u64::MAX, u64::MAX - 3, u64::MAX - 7] {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[1; 8]);
        assert!(matches!(decode(&bytes, u64::MAX), Err(FrameError::TooLong(l, _)) if l == len), "{len}");
        let e = read_all(&bytes, u64::MAX).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    }
    // The largest length that fits is merely incomplete.
    let fits = (usize::MAX - 8) as u64;
    assert_eq!(decode(&fits.to_le_bytes(), u64::MAX), Ok(None));
}
