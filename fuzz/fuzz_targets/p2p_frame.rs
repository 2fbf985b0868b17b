//! The P2P handshake's frames (`ferry_metadata_p2p::frame`) and the JSON bodies they carry.
//!
//! Holds: `decode` never panics, whatever the input and the size limit (the default 1 MiB, and
//! one the input picks, up to `u64::MAX`); a decoded frame uses exactly its announced length,
//! and re-encodes to the bytes it came from (an old-protocol frame, without a type byte, is a
//! metadata frame whose payload is the whole body); a refused length is refused for the reason
//! it has; the streaming reader (`read_frame`) agrees with `decode` on every input; and the
//! bodies a handshake listener or client parses (a notification, a descriptor, a probe reply,
//! an rpc entry) decode to a value or an error, and a decoded notification or descriptor
//! re-encodes to one that decodes to itself.

#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use ferry_core::{Notification, RpcMeta, SegmentDescriptor};
use ferry_metadata_p2p::frame::{DEFAULT_MAX_FRAME, Frame, FrameError, FrameType, decode, encode, read_frame};
use ferry_transport_tcp::TcpEndpoint;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check(data, DEFAULT_MAX_FRAME);
    // The last 8 bytes pick a limit, so lengths near `u64::MAX` are accepted ones too.
    if let Some((body, tail)) = data.split_last_chunk::<8>() {
        check(body, u64::from_le_bytes(*tail).max(1));
    }
});

fn check(buf: &[u8], max: u64) {
    let decoded = decode(buf, max);
    let announced = buf.first_chunk::<8>().map(|b| u64::from_le_bytes(*b));
    match &decoded {
        Ok(Some((frame, used))) => {
            let len = announced.expect("a decoded frame has a length");
            assert!(len >= 1 && len <= max);
            assert_eq!(*used as u64, 8 + len, "a frame uses its length and the 8 bytes announcing it");
            let body = &buf[8..*used];
            if body[0] <= 3 {
                assert_eq!(frame.kind as u8, body[0]);
                assert_eq!(encode(frame.kind, &frame.payload), &buf[..*used], "re-encodes to its bytes");
            } else {
                assert_eq!(frame, &Frame { kind: FrameType::Metadata, payload: body.to_vec() }, "old protocol");
            }
            bodies(frame);
        }
        Ok(None) => {
            if let Some(len) = announced {
                assert!(len >= 1 && len <= max);
                assert!(((buf.len() - 8) as u64) < len, "more bytes are needed only when they are missing");
            }
        }
        Err(FrameError::Empty) => assert_eq!(announced, Some(0)),
        Err(FrameError::TooLong(len, limit)) => {
            assert_eq!(Some(*len), announced);
            assert!(len > limit && *limit <= max);
        }
    }
    if let Err(e) = &decoded {
        assert!(!e.to_string().is_empty());
    }
    // The reader a listener runs on a connection agrees with `decode`.
    let read = runtime().block_on(read_frame(&mut &buf[..], max, Duration::from_secs(60)));
    match (&decoded, read) {
        (Ok(Some((frame, _))), Ok(got)) => assert_eq!(&got, frame),
        (Ok(None), Err(e)) => assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}"),
        (Err(_), Err(e)) => assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}"),
        (d, r) => panic!("decode gave {d:?}, read_frame {r:?}"),
    }
}

/// The JSON a frame's receiver parses.
fn bodies(frame: &Frame) {
    let payload = frame.payload.as_slice();
    match frame.kind {
        FrameType::Notify => {
            if let Ok(n) = serde_json::from_slice::<Notification>(payload) {
                let again: Notification = serde_json::from_slice(&serde_json::to_vec(&n).unwrap()).unwrap();
                assert_eq!(again, n);
            }
        }
        FrameType::Metadata => {
            if let Ok(d) = SegmentDescriptor::from_json("a peer", payload) {
                let json = d.to_json();
                let again = SegmentDescriptor::from_json("again", &json).expect("a decoded descriptor re-decodes");
                assert_eq!(again, d);
                if let Ok(Some(endpoint)) = TcpEndpoint::from_descriptor(&d) {
                    let _ = endpoint.host_for(&d.name);
                }
            }
        }
        FrameType::Probe => {
            let _ = serde_json::from_slice::<serde_json::Value>(payload);
        }
        FrameType::Connection => {}
    }
    let _ = serde_json::from_slice::<RpcMeta>(payload);
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap())
}
