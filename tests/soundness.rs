//! Safe code must not be able to make a transport touch memory after the caller may free it
//! (the caller-facing batch cannot release what a transport holds).
//!
//! A batch's local memory stays leased until its transport released every request; only then
//! may the region be unregistered (and freed). The caller-facing batch can be waited on, polled
//! and cancelled, nothing else: it cannot release a request the transport still holds.

use std::time::Duration;

use ferry::{Location, Opcode, SegmentDescriptor, TransferRequest};
use ferry_test_support::{Buffer, tcp_engine_knowing};
use ferry_transport_tcp::TcpEndpoint;

/// A tcp "peer" that accepts connections and never answers: a read to it stays in flight in the
/// tcp transport (its reader would write the response into the local buffer).
fn silent_peer(name: &str) -> (std::net::TcpListener, SegmentDescriptor) {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut d = SegmentDescriptor::new(name, "tcp");
    let port = silent.local_addr().unwrap().port();
    TcpEndpoint { host: Some("127.0.0.1".into()), port, proto_version: Some(2), fence: None, auth: None }
        .write_to(&mut d)
        .unwrap();
    d.buffers.push(ferry::BufferDesc {
        addr: 0x1000,
        length: 1 << 20,
        name: "cpu:0".into(),
        device_id: None,
        extra: Default::default(),
    });
    (silent, d)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_cannot_release_memory_a_transport_still_writes() {
    let (silent, d) = silent_peer("silent");
    let e = tcp_engine_knowing(&[&d], Duration::from_secs(30)).await;
    let local = Buffer::zeroed(1 << 20);
    // SAFETY: `local` outlives the engine (dropped at the end of the test, after shutdown).
    unsafe { e.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = e.open_segment("silent").await.unwrap();
    let req = TransferRequest {
        opcode: Opcode::Read,
        source: local.addr(),
        target: peer,
        target_offset: 0x1000,
        length: 4096,
    };
    // The peer takes the request (its header) and never answers: the read is in flight.
    let (got_header, header_seen) = std::sync::mpsc::channel();
    let peer_side = std::thread::spawn(move || {
        use std::io::Read;
        let (mut sock, _) = silent.accept().unwrap();
        let mut header = [0u8; ferry_transport_tcp::wire::HEADER_LEN];
        sock.read_exact(&mut header).unwrap();
        got_header.send(()).unwrap();
        sock // kept open, silent, until the test drops it
    });
    let batch = e.submit(&[req]).await.unwrap();
    header_seen.recv_timeout(Duration::from_secs(10)).expect("the request reached the peer");
    // Everything safe code can do with the batch it was given (it has no way to complete or
    // release a request: `Batch::complete` does not exist, a compile_fail doctest of `Batch`
    // shows it; nor to unregister behind the engine's back: `RegisteredMemory`'s doctest).
    batch.cancel();
    assert!(batch.is_done(), "cancelled: the caller sees an outcome at once");
    assert!(!batch.all_released(), "but the tcp reader still holds the request");
    // So the memory stays registered: unregistering waits (up to the transfer timeout) for the
    // transport instead of letting the caller free memory under the reader.
    let waited = tokio::time::timeout(Duration::from_millis(500), e.unregister_memory(local.addr())).await;
    assert!(waited.is_err(), "unregistered while the tcp reader may still write into it: {waited:?}");
    assert!(!e.memory().is_empty(), "still registered");
    // The peer goes away: the reader fails and releases the request; now the memory may go.
    drop(peer_side.join().unwrap());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !batch.all_released() {
        assert!(std::time::Instant::now() < deadline, "the transport never released the request");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    e.unregister_memory(local.addr()).await.unwrap();
    e.shutdown().await.unwrap();
}
