//! `SegmentDescriptor::from_json`, the decoder of what peers and metadata stores publish (and
//! the TCP transport's view of it, `TcpEndpoint::from_descriptor`).
//!
//! Holds: decoding never panics; a decoded descriptor passes its own validation, re-encodes to
//! JSON that decodes to an equal descriptor, and encodes the same the second time; its buffers
//! answer range queries without overflowing; its name and tcp endpoint are read without a panic.

#![no_main]

use ferry_core::{SegmentDescriptor, SegmentName};
use ferry_transport_tcp::TcpEndpoint;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let d = match SegmentDescriptor::from_json("mooncake/ram/fuzz", data) {
        Ok(d) => d,
        Err(e) => {
            assert!(e.message().contains("mooncake/ram/fuzz"), "errors name the origin: {e}");
            return;
        }
    };
    d.validate("fuzz").expect("a decoded descriptor is valid");
    let json = d.to_json();
    let again = SegmentDescriptor::from_json("again", &json).expect("a decoded descriptor re-encodes to one");
    assert_eq!(again, d, "a round trip changes nothing");
    assert_eq!(again.to_json(), json, "re-encoding is stable");
    for b in &d.buffers {
        assert_eq!(b.contains(b.addr, b.length), b.length > 0);
        assert!(!b.contains(b.addr, u64::MAX) || (b.addr == 0 && b.length == u64::MAX));
        let _ = b.contains(u64::MAX, 1);
    }
    let _ = SegmentName::parse(&d.name);
    if let Ok(Some(endpoint)) = TcpEndpoint::from_descriptor(&d) {
        let _ = (endpoint.host_for(&d.name), endpoint.version());
    }
});
