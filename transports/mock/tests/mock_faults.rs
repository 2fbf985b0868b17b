//! Error paths that real components cannot produce on demand, injected with mockall doubles of
//! the three core traits.

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use ferry::{
    Capabilities, Error, ErrorKind, Identity, InProcessMetadata, Location, MetadataStore, Opcode, OpenSegment,
    ResolveQuery, ResolverChain, SegmentDescriptor, SegmentResolver, Submission, TransferRequest, Transport,
    TransportContext, TransportFactory, TransportRegistry, WatchEvent,
};
use ferry_test_support::{Buffer, builder};
use mockall::mock;

mock! {
    pub Meta {}
    #[async_trait]
    impl MetadataStore for Meta {
        fn name(&self) -> &str;
        async fn get(&self, key: &str) -> ferry::Result<Option<Vec<u8>>>;
        async fn put(&self, key: &str, value: &[u8]) -> ferry::Result<()>;
        async fn delete(&self, key: &str) -> ferry::Result<()>;
        async fn watch(&self, prefix: &str) -> ferry::Result<Option<tokio::sync::mpsc::Receiver<WatchEvent>>>;
    }
}

mock! {
    pub Wire {}
    #[async_trait]
    impl Transport for Wire {
        fn protocol(&self) -> &str;
        fn capabilities(&self) -> Capabilities;
        fn serves(&self, target: &SegmentDescriptor) -> bool;
        fn publish(&self, descriptor: &mut SegmentDescriptor);
        async fn register_memory(&self, region: &ferry::Region, promise: ferry::MemoryPromise) -> ferry::Result<()>;
        async fn unregister_memory(&self, region: &ferry::Region) -> ferry::Result<()>;
        async fn open(&self, target: &SegmentDescriptor) -> ferry::Result<ferry::PeerHandle>;
        fn submit(&self, target: &Arc<OpenSegment>, submission: Submission);
        async fn shutdown(&self);
    }
}

mock! {
    pub Resolver {}
    #[async_trait]
    impl SegmentResolver for Resolver {
        fn name(&self) -> &str;
        async fn resolve(&self, query: &ResolveQuery, known: &Identity) -> ferry::Result<Identity>;
    }
}

/// Hands out one pre-built transport.
struct Fixed(Arc<dyn Transport>);
#[async_trait]
impl TransportFactory for Fixed {
    fn protocol(&self) -> &'static str {
        "wire"
    }
    async fn create(&self, _ctx: &TransportContext) -> ferry::Result<Arc<dyn Transport>> {
        Ok(self.0.clone())
    }
}

fn wire_basics(w: &mut MockWire) {
    w_basics_without_open(w);
    w.expect_open().returning(|_| Ok(Arc::new(())));
}

fn peer_descriptor(addr: u64, len: u64) -> Vec<u8> {
    let mut d = SegmentDescriptor::new("peer", "wire");
    d.buffers.push(ferry::BufferDesc {
        addr,
        length: len,
        name: "cpu:0".into(),
        device_id: None,
        extra: Default::default(),
    });
    d.to_json()
}

async fn engine_with(wire: MockWire, meta: Arc<dyn MetadataStore>) -> ferry::Result<ferry::TransferEngine> {
    ferry::builder()
        .transports(TransportRegistry::new().with(Arc::new(Fixed(Arc::new(wire)))))
        .protocol("wire")
        .segment_name("me")
        .transfer_timeout(Duration::from_millis(200))
        .metadata(meta)
        .build()
        .await
}

#[tokio::test]
async fn metadata_unreachable_at_open_is_reported_with_its_kind() {
    let mut meta = MockMeta::new();
    meta.expect_name().return_const("mock".to_owned());
    meta.expect_put().returning(|_, _| Ok(()));
    meta.expect_watch().returning(|_| Ok(None));
    meta.expect_get().returning(|k| {
        if k.ends_with("/me") { Ok(None) } else { Err(Error::unreachable("connection refused by 127.0.0.1:1")) }
    });
    let mut wire = MockWire::new();
    wire_basics(&mut wire);
    let e = engine_with(wire, Arc::new(meta)).await.unwrap();
    let err = e.open_segment("peer").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PeerUnreachable);
    assert!(err.message().contains("peer") && err.message().contains("refused"), "{err}");
}

#[tokio::test]
async fn a_failed_publication_fails_the_build_and_rolls_back_registration() {
    let puts = Arc::new(AtomicUsize::new(0));
    let mut meta = MockMeta::new();
    meta.expect_name().return_const("mock".to_owned());
    meta.expect_get().returning(|_| Ok(None));
    meta.expect_watch().returning(|_| Ok(None));
    let p = puts.clone();
    meta.expect_put().returning(move |_, _| {
        // The first publication (at build) works; the one after registration fails.
        if p.fetch_add(1, Ordering::SeqCst) == 0 { Ok(()) } else { Err(Error::timeout("metadata put timed out")) }
    });
    let mut wire = MockWire::new();
    wire_basics(&mut wire);
    wire.expect_register_memory().times(1).returning(|_, _| Ok(()));
    wire.expect_unregister_memory().times(1).returning(|_| Ok(()));
    let e = engine_with(wire, Arc::new(meta)).await.unwrap();
    let buf = Buffer::zeroed(64);
    let err = unsafe { e.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(e.memory().is_empty(), "the registration was rolled back");
}

#[tokio::test]
async fn a_transport_refusing_registration_rolls_it_back() {
    let mut wire = MockWire::new();
    wire_basics(&mut wire);
    wire.expect_register_memory()
        .returning(|r, _| if r.len() > 100 { Err(Error::transport("cannot pin that much")) } else { Ok(()) });
    wire.expect_unregister_memory().times(1).returning(|_| Ok(()));
    let e = engine_with(wire, InProcessMetadata::new()).await.unwrap();
    let (a, b) = (Buffer::zeroed(64), Buffer::zeroed(4096));
    let regions = [(a.addr(), a.len(), Location::Any), (b.addr(), b.len(), Location::Any)];
    let err = unsafe { e.register_memory_batch(&regions).await }.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transport);
    assert!(e.memory().is_empty());
    assert!(e.local_descriptor().buffers.is_empty());
}

#[tokio::test]
async fn submit_errors_fail_every_request_and_peer_loss_refreshes_the_descriptor() {
    let meta = InProcessMetadata::new();
    let buf = Buffer::zeroed(4096);
    let remote = 0x7000_0000u64;
    MetadataStore::put(&*meta, "mooncake/ram/peer", &peer_descriptor(remote, 1 << 20)).await.unwrap();

    let calls = Arc::new(AtomicUsize::new(0));
    let mut wire = MockWire::new();
    wire_basics(&mut wire);
    wire.expect_register_memory().returning(|_, _| Ok(()));
    let c = calls.clone();
    wire.expect_submit().returning(move |_, submission| match c.fetch_add(1, Ordering::SeqCst) {
        0 => submission.fail_all(&Error::transport("queue full")),
        1 => submission.fail_all(&Error::unreachable("peer reset the connection")),
        _ => submission.complete_all(&Ok(())),
    });
    let e = engine_with(wire, meta.clone()).await.unwrap();
    unsafe { e.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
    let peer = e.open_segment("peer").await.unwrap();
    let reqs: Vec<TransferRequest> = (0..4)
        .map(|i| TransferRequest {
            opcode: Opcode::Write,
            source: buf.addr() + i * 16,
            target: peer,
            target_offset: remote + i * 16,
            length: 16,
        })
        .collect();

    // 1. The transport refuses the whole batch.
    let b = e.submit(&reqs).await.unwrap();
    let st = b.wait(Duration::from_secs(1)).await.unwrap();
    assert_eq!((st.failed, st.completed), (4, 0));
    assert_eq!(b.error(2).unwrap().kind(), ErrorKind::Transport);

    // 2. The peer goes away: requests fail as unreachable and the cached descriptor turns stale.
    let b = e.submit(&reqs).await.unwrap();
    assert_eq!(b.wait_ok(Duration::from_secs(1)).await.unwrap_err().kind(), ErrorKind::PeerUnreachable);
    assert!(e.segment(peer).unwrap().is_stale());

    // 3. The peer re-published with a different buffer: the next submit refetches and sees it.
    MetadataStore::put(&*meta, "mooncake/ram/peer", &peer_descriptor(remote + (1 << 20), 1 << 20)).await.unwrap();
    let moved: Vec<TransferRequest> =
        reqs.iter().map(|r| TransferRequest { target_offset: r.target_offset + (1 << 20), ..*r }).collect();
    e.transfer(&moved).await.unwrap();
    assert!(!e.segment(peer).unwrap().is_stale());
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_transport_that_never_completes_times_out_and_can_be_cancelled() {
    let meta = InProcessMetadata::new();
    let remote = 0x1000u64;
    MetadataStore::put(&*meta, "mooncake/ram/peer", &peer_descriptor(remote, 4096)).await.unwrap();
    let mut wire = MockWire::new();
    wire_basics(&mut wire);
    wire.expect_register_memory().returning(|_, _| Ok(()));
    // Accepts, then goes silent (it keeps the requests: they stay leased).
    let silent: Arc<std::sync::Mutex<Vec<Submission>>> = Arc::default();
    let keep = silent.clone();
    wire.expect_submit().returning(move |_, s| keep.lock().unwrap().push(s));
    let e = engine_with(wire, meta).await.unwrap();
    let buf = Buffer::zeroed(64);
    unsafe { e.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
    let peer = e.open_segment("peer").await.unwrap();
    let b = e
        .submit(&[TransferRequest {
            opcode: Opcode::Read,
            source: buf.addr(),
            target: peer,
            target_offset: remote,
            length: 64,
        }])
        .await
        .unwrap();
    assert_eq!(b.wait(Duration::from_millis(30)).await.unwrap_err().kind(), ErrorKind::Timeout);
    // Cannot unregister memory a pending request still holds.
    assert_eq!(e.unregister_memory(buf.addr()).await.unwrap_err().kind(), ErrorKind::Busy);
    b.cancel();
    assert_eq!(b.request_status(0), Some(ferry::RequestStatus::Cancelled));
    assert_eq!(b.wait_ok(Duration::from_secs(1)).await.unwrap_err().kind(), ErrorKind::Cancelled);
    // Cancelled, but the transport never said it stopped touching the memory: shutdown must not
    // let the caller free it.
    let err = e.shutdown().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
    // Once the transport lets go of the requests, the memory is released.
    silent.lock().unwrap().clear();
    assert_eq!(e.memory().leases(), 0);
}

/// A transport that drops what it was given without an outcome cannot leave the caller waiting:
/// the submission completes its requests as an internal error (and releases them) when dropped.
#[tokio::test]
async fn a_transport_that_drops_its_requests_fails_them_instead_of_hanging() {
    let meta = InProcessMetadata::new();
    let remote = 0x1000u64;
    MetadataStore::put(&*meta, "mooncake/ram/peer", &peer_descriptor(remote, 4096)).await.unwrap();
    let mut wire = MockWire::new();
    wire_basics(&mut wire);
    wire.expect_register_memory().returning(|_, _| Ok(()));
    wire.expect_unregister_memory().returning(|_| Ok(()));
    wire.expect_submit().returning(|_, s| drop(s));
    let e = engine_with(wire, meta).await.unwrap();
    let buf = Buffer::zeroed(64);
    unsafe { e.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
    let peer = e.open_segment("peer").await.unwrap();
    let req =
        TransferRequest { opcode: Opcode::Read, source: buf.addr(), target: peer, target_offset: remote, length: 64 };
    let err = e.transfer(&[req]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Internal, "{err}");
    assert!(err.to_string().contains("dropped without an outcome"), "{err}");
    e.unregister_memory(buf.addr()).await.unwrap();
}

#[tokio::test]
async fn a_descriptor_of_an_unknown_protocol_names_what_is_installed() {
    let meta = InProcessMetadata::new();
    let mut d = SegmentDescriptor::new("rdma-peer", "rdma");
    d.buffers.clear();
    MetadataStore::put(&*meta, "mooncake/ram/rdma-peer", &d.to_json()).await.unwrap();
    MetadataStore::put(&*meta, "mooncake/ram/garbage", b"{\"name\": 3}").await.unwrap();
    let mut wire = MockWire::new();
    wire_basics(&mut wire);
    let e = engine_with(wire, meta).await.unwrap();
    let err = e.open_segment("rdma-peer").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    assert!(err.message().contains("\"rdma\"") && err.message().contains("installed: wire"), "{err}");
    let err = e.open_segment("garbage").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert!(err.message().contains("mooncake/ram/garbage") && err.message().contains("`name`"), "{err}");
}

#[tokio::test]
async fn resolver_errors_name_the_resolver_and_answers_are_explained() {
    let mut broken = MockResolver::new();
    broken.expect_name().return_const("rank-table".to_owned());
    broken.expect_resolve().returning(|_, _| Err(Error::config("/etc/ranktable.json: status is \"initializing\"")));
    let mut env = MockResolver::new();
    env.expect_name().return_const("env".to_owned());
    env.expect_resolve().returning(|_, _| Ok(Identity { physical_device: Some(5), ..Identity::default() }));

    let meta = InProcessMetadata::new();
    let good = builder(&meta)
        .segment_name("10.0.0.1:16000")
        .resolvers(ResolverChain::with_defaults().with(Arc::new(env)))
        .build()
        .await
        .unwrap();
    let r = good.resolve_local().await.unwrap();
    assert_eq!(r.identity.port, Some(16000));
    assert_eq!(r.identity.physical_device, Some(5));
    assert!(r.answers.iter().any(|a| a.resolver == "env" && a.value == "5"));

    let bad = builder(&meta).resolvers(ResolverChain::new().with(Arc::new(broken))).build().await.unwrap();
    let err = bad.resolve_local().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.message().contains("resolver `rank-table`") && err.message().contains("initializing"), "{err}");
}

#[tokio::test]
async fn a_transport_that_cannot_let_go_of_memory_keeps_it_registered() {
    let refuse = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let registered = Arc::new(AtomicUsize::new(0));
    let mut wire = MockWire::new();
    wire_basics(&mut wire);
    let r = registered.clone();
    wire.expect_register_memory().returning(move |_, _| {
        r.fetch_add(1, Ordering::SeqCst);
        Ok(())
    });
    let f = refuse.clone();
    wire.expect_unregister_memory().returning(move |_| {
        if f.load(Ordering::SeqCst) {
            Err(Error::new(ErrorKind::Transport, "memory still bound to a communicator"))
        } else {
            Ok(())
        }
    });
    let e = engine_with(wire, InProcessMetadata::new()).await.unwrap();
    let buf = Buffer::zeroed(4096);
    unsafe { e.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
    let err = e.unregister_memory(buf.addr()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transport, "{err}");
    assert!(err.message().contains("stays registered") && err.message().contains("still bound"), "{err}");
    assert_eq!(e.memory().len(), 1, "the region is still registered");
    assert_eq!(e.local_descriptor().buffers.len(), 1, "and still published");
    // Once the transport lets go, unregistering succeeds.
    refuse.store(false, Ordering::SeqCst);
    e.unregister_memory(buf.addr()).await.unwrap();
    assert!(e.memory().is_empty());
    assert_eq!(registered.load(Ordering::SeqCst), 1, "no transport had let go, so none was re-registered");
}

/// A transport opens each peer once per descriptor the engine fetched (not per submit); what it
/// opened reaches every submit through the open segment, and an error from `open` is reported to
/// each submit to that segment until a refreshed descriptor opens cleanly.
#[tokio::test]
async fn a_peer_is_opened_once_per_descriptor_and_its_error_reaches_each_submit() {
    let meta = InProcessMetadata::new();
    let remote = 0x1000u64;
    MetadataStore::put(&*meta, "mooncake/ram/peer", &peer_descriptor(remote, 4096)).await.unwrap();
    let opens = Arc::new(AtomicUsize::new(0));
    let mut wire = MockWire::new();
    w_basics_without_open(&mut wire);
    wire.expect_register_memory().returning(|_, _| Ok(()));
    let o = opens.clone();
    wire.expect_open().returning(move |d| match o.fetch_add(1, Ordering::SeqCst) {
        0 => Err(Error::invalid(format!("segment `{}` publishes no route (first descriptor)", d.name))),
        n => Ok(Arc::new(n) as ferry::PeerHandle),
    });
    wire.expect_submit().returning(|target, submission| match target.peer::<usize>() {
        Ok(&1) => submission.complete_all(&Ok(())),
        Ok(n) => submission.fail_all(&Error::transport(format!("opened as {n}"))),
        Err(e) => submission.fail_all(&e),
    });
    let e = engine_with(wire, meta.clone()).await.unwrap();
    let buf = Buffer::zeroed(64);
    unsafe { e.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
    let peer = e.open_segment("peer").await.unwrap();
    let req =
        TransferRequest { opcode: Opcode::Read, source: buf.addr(), target: peer, target_offset: remote, length: 64 };
    for _ in 0..2 {
        let err = e.transfer(&[req]).await.unwrap_err();
        assert!(err.to_string().contains("publishes no route"), "{err}");
    }
    assert_eq!(opens.load(Ordering::SeqCst), 1, "opened once for two submits");
    e.refresh_segment(peer).await.unwrap();
    for _ in 0..3 {
        e.transfer(&[req]).await.unwrap();
    }
    assert_eq!(opens.load(Ordering::SeqCst), 2, "opened again only for the refreshed descriptor");
}

fn w_basics_without_open(w: &mut MockWire) {
    w.expect_protocol().return_const("wire".to_owned());
    w.expect_capabilities().return_const(Capabilities {
        read: true,
        write: true,
        host_memory: true,
        cross_process: true,
        ..Default::default()
    });
    w.expect_serves().returning(|d| d.protocol == "wire");
    w.expect_publish().return_const(());
    w.expect_shutdown().return_const(());
}
