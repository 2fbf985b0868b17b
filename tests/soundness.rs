//! Safe code must not be able to make a transport touch memory after the caller may free it
//! (issue 13, section 1).
//!
//! A batch's local memory stays leased until its transport released every request; only then
//! may the region be unregistered (and freed). The caller-facing batch can be waited on, polled
//! and cancelled, nothing else: it cannot release a request the transport still holds.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Buffer, tcp_only};
use ferry::{ErrorKind, InProcessMetadata, Location, MetadataBackend, Opcode, SegmentDescriptor, TransferRequest};

/// A tcp "peer" that accepts connections and never answers: a read to it stays in flight in the
/// tcp transport (its reader would write the response into the local buffer).
fn silent_peer(name: &str) -> (std::net::TcpListener, SegmentDescriptor) {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut d = SegmentDescriptor::new(name, "tcp");
    d.tcp_data_host = Some("127.0.0.1".into());
    d.tcp_data_port = Some(silent.local_addr().unwrap().port());
    d.tcp_proto_version = Some(2);
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
    let (_silent, d) = silent_peer("silent");
    let meta = InProcessMetadata::new();
    MetadataBackend::put(&*meta, "mooncake/ram/silent", &d.to_json()).await.unwrap();
    let e = ferry::builder()
        .transports(tcp_only())
        .protocol("tcp")
        .metadata(meta as Arc<dyn MetadataBackend>)
        .transfer_timeout(Duration::from_secs(30))
        .build()
        .await
        .unwrap();
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
    let batch = e.submit(&[req]).await.unwrap();
    // Everything safe code can do with the batch it was given.
    for i in 0..batch.len() {
        batch.complete(i, Ok(()));
    }
    batch.cancel();
    // The tcp reader still holds the request (its peer never answered): the memory must stay
    // registered, or the caller could free it under the reader.
    let err = e.unregister_memory(local.addr()).await.expect_err("the transport still writes into this region");
    assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
    e.shutdown().await.unwrap();
}
