//! Engines in one process moving data through the `local` transport, and the bad inputs that
//! must be refused before a byte moves.

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::time::Duration;

use ferry::{ErrorKind, InProcessMetadata, Location, Opcode, SegmentDescriptor, TransferRequest};
use ferry_test_support::{Buffer, Connected, builder, connected, pair};

const T: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_and_write_between_two_engines() {
    let meta = InProcessMetadata::new();
    let Connected { prefill: _prefill, decode, src, dst, peer } = connected(&meta, 1 << 20, Location::Cpu(0)).await;
    assert_eq!(decode.segment(peer).unwrap().protocol(), "local");
    // Read the second half of prefill's buffer into the first half of ours.
    let half = src.len() / 2;
    let batch = decode
        .submit(&[TransferRequest {
            opcode: Opcode::Read,
            source: dst.addr(),
            target: peer,
            target_offset: src.addr() + half,
            length: half,
        }])
        .await
        .unwrap();
    let status = batch.wait(T).await.unwrap();
    assert!(status.is_success(), "{status:?}");
    assert_eq!(&dst.bytes()[..half as usize], &src.bytes()[half as usize..]);
    assert!(dst.bytes()[half as usize..].iter().all(|&b| b == 0), "nothing beyond the request was written");

    // Write it back elsewhere in prefill's buffer.
    decode
        .transfer(&[TransferRequest {
            opcode: Opcode::Write,
            source: dst.addr(),
            target: peer,
            target_offset: src.addr(),
            length: 4096,
        }])
        .await
        .unwrap();
    assert_eq!(&src.bytes()[..4096], &src.bytes()[half as usize..half as usize + 4096]);
    assert!(batch.elapsed() > Duration::ZERO);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_reaches_its_own_segment_by_memcpy() {
    let meta = InProcessMetadata::new();
    let e = builder(&meta).protocol("null").segment_name("self").build().await.unwrap();
    assert_eq!(e.protocols(), vec!["local", "null"], "local is tried before the configured protocol");
    let buf = Buffer::filled(8192, 9);
    unsafe { e.register_memory(buf.addr(), buf.len(), Location::Any).await }.unwrap();
    let me = e.open_segment("self").await.unwrap();
    assert_eq!(e.segment(me).unwrap().protocol(), "local");
    // Overlapping copy within one region (memmove semantics).
    let expect: Vec<u8> = buf.bytes()[..4096].to_vec();
    e.transfer(&[TransferRequest {
        opcode: Opcode::Write,
        source: buf.addr(),
        target: me,
        target_offset: buf.addr() + 100,
        length: 4096,
    }])
    .await
    .unwrap();
    assert_eq!(&buf.bytes()[100..4196], &expect[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_before_any_byte_moves() {
    let meta = InProcessMetadata::new();
    let Connected { prefill: _prefill, decode, src, dst, peer } = connected(&meta, 4096, Location::Cpu(0)).await;
    let req = |source, target_offset, length| TransferRequest {
        opcode: Opcode::Read,
        source,
        target: peer,
        target_offset,
        length,
    };

    let cases = [
        (vec![req(dst.addr(), src.addr(), 0)], ErrorKind::InvalidArgument, "zero-length"),
        (vec![req(dst.addr() + 4000, src.addr(), 200)], ErrorKind::OutOfBounds, "past the end"),
        (vec![req(8, src.addr(), 8)], ErrorKind::OutOfBounds, "not inside any registered region"),
        (vec![req(dst.addr(), src.addr() + 4000, 200)], ErrorKind::OutOfBounds, "remote range"),
        (
            vec![req(dst.addr(), src.addr(), 10), req(dst.addr() + 10, src.addr() + 5000, 1)],
            ErrorKind::OutOfBounds,
            "request 1",
        ),
        (vec![], ErrorKind::InvalidArgument, "empty batch"),
    ];
    for (reqs, kind, needle) in cases {
        let e = decode.submit(&reqs).await.unwrap_err();
        assert_eq!(e.kind(), kind, "{e}");
        assert!(e.to_string().contains(needle), "{e} should mention {needle}");
    }
    assert!(dst.bytes().iter().all(|&b| b == 0), "nothing was copied");

    // A handle of a segment this engine closed (handles cannot be made from integers; a
    // binding's integer is checked with `segment_handle`).
    let unknown = decode.open_segment(decode.segment_name()).await.unwrap();
    decode.close_segment(unknown).unwrap();
    assert_eq!(decode.segment_handle(unknown.raw()).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(
        decode
            .submit(&[TransferRequest { target: unknown, ..req(dst.addr(), src.addr(), 1) }])
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::NotFound
    );
    let e = decode.open_segment("nobody").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(e.message().contains("mooncake/ram/nobody"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owners_live_registry_is_checked_again() {
    /// The in-process store without its watch, so decode does not learn of the change and keeps
    /// using the descriptor it cached (as with a backend that cannot watch).
    struct NoWatch(std::sync::Arc<InProcessMetadata>);
    #[async_trait::async_trait]
    impl ferry::MetadataStore for NoWatch {
        fn name(&self) -> &str {
            "no-watch"
        }
        async fn get(&self, key: &str) -> ferry::Result<Option<Vec<u8>>> {
            self.0.get(key).await
        }
        async fn put(&self, key: &str, value: &[u8]) -> ferry::Result<()> {
            self.0.put(key, value).await
        }
        async fn delete(&self, key: &str) -> ferry::Result<()> {
            self.0.delete(key).await
        }
    }
    let meta: std::sync::Arc<dyn ferry::MetadataStore> = std::sync::Arc::new(NoWatch(InProcessMetadata::new()));
    let prefill =
        builder(&InProcessMetadata::new()).metadata(meta.clone()).segment_name("prefill").build().await.unwrap();
    let decode = builder(&InProcessMetadata::new()).metadata(meta).segment_name("decode").build().await.unwrap();
    let (src, dst) = (Buffer::filled(4096, 3), Buffer::zeroed(4096));
    unsafe { prefill.register_memory(src.addr(), src.len(), Location::Cpu(0)).await }.unwrap();
    unsafe { decode.register_memory(dst.addr(), dst.len(), Location::Cpu(0)).await }.unwrap();
    let peer = decode.open_segment("prefill").await.unwrap();
    // The peer gives the memory back after we cached its descriptor.
    prefill.unregister_memory(src.addr()).await.unwrap();
    let batch = decode
        .submit(&[TransferRequest {
            opcode: Opcode::Read,
            source: dst.addr(),
            target: peer,
            target_offset: src.addr(),
            length: 16,
        }])
        .await
        .unwrap();
    let e = batch.wait_ok(T).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    assert!(dst.bytes().iter().all(|&b| b == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_descriptor_cache_refreshes_when_the_peer_grows() {
    let meta = InProcessMetadata::new();
    let (prefill, decode) = pair(&meta).await;
    let a = Buffer::filled(4096, 1);
    let b = Buffer::filled(4096, 2);
    let dst = Buffer::zeroed(4096);
    unsafe { prefill.register_memory(a.addr(), a.len(), Location::Cpu(0)).await }.unwrap();
    unsafe { decode.register_memory(dst.addr(), dst.len(), Location::Cpu(0)).await }.unwrap();
    let peer = decode.open_segment("prefill").await.unwrap();
    assert_eq!(decode.segment(peer).unwrap().descriptor().buffers.len(), 1);
    unsafe { prefill.register_memory(b.addr(), b.len(), Location::Cpu(0)).await }.unwrap();
    decode
        .transfer(&[TransferRequest {
            opcode: Opcode::Read,
            source: dst.addr(),
            target: peer,
            target_offset: b.addr(),
            length: 4096,
        }])
        .await
        .unwrap();
    assert_eq!(dst.bytes(), b.bytes());
    assert_eq!(decode.segment(peer).unwrap().descriptor().buffers.len(), 2, "same handle, new descriptor");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_peer_is_unreachable_and_device_memory_is_refused() {
    let meta = InProcessMetadata::new();
    let Connected { prefill, decode, src, dst, peer } = connected(&meta, 4096, Location::Npu(0)).await;
    let req = TransferRequest {
        opcode: Opcode::Read,
        source: dst.addr(),
        target: peer,
        target_offset: src.addr(),
        length: 8,
    };
    let e = decode.transfer(&[req]).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.message().contains("npu:0"), "{e}");

    drop(prefill);
    // The descriptor is still in metadata, but its engine is gone: nothing serves it now.
    let e = decode.transfer(&[req]).await.unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::PeerUnreachable | ErrorKind::Unsupported), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segment_names_are_unique_in_a_process_and_shutdown_unpublishes() {
    let meta = InProcessMetadata::new();
    let a = builder(&meta).segment_name("same").build().await.unwrap();
    let e = builder(&meta).segment_name("same").build().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    let key = "mooncake/ram/same";
    let stored = ferry::MetadataStore::get(&*meta, key).await.unwrap().unwrap();
    let desc = SegmentDescriptor::from_json(key, &stored).unwrap();
    assert_eq!(desc.protocol, "local");
    assert_eq!(desc.ferry_instance.as_deref(), Some(a.instance_id()));
    a.shutdown().await.unwrap();
    assert!(ferry::MetadataStore::get(&*meta, key).await.unwrap().is_none());
    assert_eq!(a.open_segment("same").await.unwrap_err().kind(), ErrorKind::Shutdown);
    // The name is free again.
    drop(a);
    builder(&meta).segment_name("same").build().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_port_names_publish_an_rpc_entry_and_cluster_ids_prefix_keys() {
    let meta = InProcessMetadata::new();
    let mut b = builder(&meta).segment_name("127.0.0.1:17123");
    b.config_mut().cluster_id = Some("blue".into());
    let _e = b.build().await.unwrap();
    let rpc = ferry::MetadataStore::get(&*meta, "mooncake/blue/rpc_meta/127.0.0.1:17123").await.unwrap().unwrap();
    let rpc: ferry::RpcMeta = serde_json::from_slice(&rpc).unwrap();
    assert_eq!(rpc, ferry::RpcMeta { ip_or_host_name: "127.0.0.1".into(), rpc_port: 17123 });
    assert!(meta.keys().contains(&"mooncake/blue/ram/127.0.0.1:17123".to_owned()));
}

#[test]
fn blocking_api_outside_a_runtime() {
    let meta = InProcessMetadata::new();
    let a = builder(&meta).segment_name("blk-a").build_blocking().unwrap();
    let b = builder(&meta).segment_name("blk-b").build_blocking().unwrap();
    let src = Buffer::filled(1024, 5);
    let dst = Buffer::zeroed(1024);
    unsafe { a.register_memory_blocking(src.addr(), src.len(), Location::Cpu(0)) }.unwrap();
    unsafe { b.register_memory_blocking(dst.addr(), dst.len(), Location::Cpu(0)) }.unwrap();
    let peer = b.open_segment_blocking("blk-a").unwrap();
    b.transfer_blocking(&[TransferRequest {
        opcode: Opcode::Read,
        source: dst.addr(),
        target: peer,
        target_offset: src.addr(),
        length: 1024,
    }])
    .unwrap();
    assert_eq!(dst.bytes(), src.bytes());
    b.unregister_memory_blocking(dst.addr()).unwrap();
    a.shutdown_blocking().unwrap();
}

#[tokio::test]
async fn blocking_calls_inside_a_runtime_are_an_error_not_a_panic() {
    let meta = InProcessMetadata::new();
    let e = builder(&meta).build().await.unwrap();
    assert_eq!(e.open_segment_blocking("x").unwrap_err().kind(), ErrorKind::InvalidArgument);
    assert_eq!(builder(&meta).build_blocking().unwrap_err().kind(), ErrorKind::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_shutdown_no_peer_reaches_the_memory_and_finished_batches_do_not_hold_it() {
    let meta = InProcessMetadata::new();
    let Connected { prefill, decode, src, dst, peer } = connected(&meta, 4096, Location::Cpu(0)).await;
    // decode keeps a finished batch: its transport released every request, so it does not keep
    // decode's memory registered.
    let read64 = TransferRequest {
        opcode: Opcode::Read,
        source: dst.addr(),
        target: peer,
        target_offset: src.addr(),
        length: 64,
    };
    let held = decode.submit(&[read64]).await.unwrap();
    held.wait_ok(T).await.unwrap();

    prefill.shutdown().await.unwrap();
    // prefill's memory may now be freed: decode's cached descriptor still lists it, but nothing
    // may touch it any more.
    let e = decode.transfer(&[read64]).await.unwrap_err();
    // Which error depends on whether decode already saw the deletion of prefill's descriptor.
    assert!(matches!(e.kind(), ErrorKind::Shutdown | ErrorKind::PeerUnreachable | ErrorKind::NotFound), "{e}");
    decode.shutdown().await.unwrap();
    assert!(held.is_done());
}
