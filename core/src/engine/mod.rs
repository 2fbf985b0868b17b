//! The [`TransferEngine`]: memory registry, segment cache, transport table, metadata store,
//! control channel and resolver chain, and the submit path that ties them together.

mod blocks;
mod builder;
mod notify;
mod publication;
mod registration;
mod segments;
mod service;
mod submit;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use crate::batch::{Batch, Opcode, SegmentHandle, Submission, TransferRequest};
use crate::config::{Config, MetadataServer};
use crate::control::{ControlChannel, NoControlChannel};
use crate::descriptor::{BufferDesc, MetadataKeys, RpcMeta, SegmentDescriptor};
use crate::error::{Error, ErrorKind, Result};
use crate::host_memory::HostAllocation;
use crate::kv::{
    BlockRun, BlockTransfer, KvLayout, check_kv_layout_name, plan_block_transfer, publish_kv_layouts,
    published_kv_layout, published_kv_layout_names,
};
use crate::memory::{Location, MemoryRegistry, Region, RegisteredMemory};
use crate::metadata::{MetadataConnection, MetadataRegistry, MetadataStore, WatchEvent};
use crate::metrics::{EngineMetrics, EngineStats};
use crate::resolver::{Environment, Resolution, ResolveQuery, ResolverChain, ResolverRegistry};
use crate::segment::OpenSegment;
use crate::segment_name::SegmentName;
use crate::transport::{MemoryPromise, Transport, TransportContext, TransportRegistry, no_transport_for};

use blocks::RegisteredLayout;
pub use blocks::{BlockBatch, KvLayoutId};
pub use builder::EngineBuilder;
pub use publication::REPUBLISH_CHECK;
use publication::keep_published;
use segments::{MetadataDescriptors, Route, SegmentTable, watch_segments};
pub use service::{EngineService, ServiceGuard, WeakEngine};

struct EngineInner {
    name: String,
    instance: String,
    config: Arc<Config>,
    memory: Arc<MemoryRegistry>,
    /// Where descriptors and the rpc entry are published and peers' descriptors found.
    store: Arc<dyn MetadataStore>,
    /// Notifications, probes and the RPC port.
    channel: Arc<dyn ControlChannel>,
    keys: MetadataKeys,
    /// Installed transports, in the order they are tried (companions first). Replaced as a
    /// whole when a peer's descriptor makes the engine load another protocol.
    transports: RwLock<Arc<Vec<Arc<dyn Transport>>>>,
    primary: Arc<dyn Transport>,
    /// Where further transports come from (a peer naming a protocol not yet installed).
    transport_registry: TransportRegistry,
    /// What those transports are created with.
    ctx: TransportContext,
    /// Held while regions are attached to transports and while a transport is added, so a new
    /// transport sees every region exactly once.
    transport_change: tokio::sync::Mutex<()>,
    resolvers: ResolverChain,
    local_rank: Option<u32>,
    segments: RwLock<SegmentTable>,
    layouts: RwLock<HashMap<KvLayoutId, RegisteredLayout>>,
    publish_lock: tokio::sync::Mutex<()>,
    runtime: tokio::runtime::Handle,
    owned_runtime: Mutex<Option<tokio::runtime::Runtime>>,
    shut_down: AtomicBool,
    /// Background tasks (re-publication, watch), aborted at shutdown.
    watch_task: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Counters and the batch-latency histogram ([`TransferEngine::stats`]).
    metrics: Arc<EngineMetrics>,
    /// Services started beside the engine (stopped at shutdown, or when this is dropped).
    services: Mutex<Vec<ServiceGuard>>,
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        // Peers in this process and transports still holding the registry get no new leases.
        self.memory.close();
        for task in self.watch_task.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            task.abort();
        }
        // Never block in drop (it may run on a runtime thread).
        if let Some(rt) = self.owned_runtime.lock().unwrap_or_else(|p| p.into_inner()).take() {
            rt.shutdown_background();
        }
    }
}

/// Ferry's transfer engine: registers local memory, publishes where it lives, opens peers'
/// segments and moves bytes between them.
///
/// Cheap to clone (a handle to shared state). All methods take `&self` and may be called from
/// any thread. Async methods run on any tokio runtime; the `*_blocking` forms are for callers
/// outside one (they fail with [`ErrorKind::InvalidArgument`] when called from inside a runtime).
#[derive(Clone)]
pub struct TransferEngine {
    inner: Arc<EngineInner>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("segment", &self.inner.name)
            .field("protocol", &self.inner.primary.protocol())
            .field("metadata", &self.inner.store.name())
            .field("control_channel", &self.inner.channel.name())
            .finish()
    }
}

impl EngineInner {
    fn check_open(&self) -> Result<()> {
        if self.shut_down.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Shutdown, format!("engine `{}` has been shut down", self.name)));
        }
        Ok(())
    }

    /// A snapshot of the installed transports.
    fn transports(&self) -> Arc<Vec<Arc<dyn Transport>>> {
        self.transports.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl TransferEngine {
    /// A builder (no transports pre-installed; see the facade crate for one that has them).
    pub fn builder() -> EngineBuilder {
        EngineBuilder::new()
    }

    /// This engine's segment name.
    pub fn segment_name(&self) -> &str {
        &self.inner.name
    }

    /// The RPC port this engine publishes in its `rpc_meta` entry (where its handshake
    /// listener takes notifications): the control channel's listener port, else the port of a
    /// `host:port` segment name. `None` when it publishes no rpc entry.
    pub fn rpc_port(&self) -> Option<u16> {
        self.inner.channel.rpc_port().or_else(|| SegmentName::parse(&self.inner.name).map(|n| n.port()))
    }

    /// This engine instance's unique id (published as `ferry_instance`).
    pub fn instance_id(&self) -> &str {
        &self.inner.instance
    }

    /// The effective configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// A read-only view of the registered memory (register and unregister through the engine).
    pub fn memory(&self) -> RegisteredMemory {
        RegisteredMemory::new(self.inner.memory.clone())
    }

    /// Protocols of the installed transports, in the order they are tried.
    pub fn protocols(&self) -> Vec<String> {
        self.inner.transports().iter().map(|t| t.protocol().to_owned()).collect()
    }

    /// The primary (configured) transport's protocol (the name it publishes; a configured
    /// alias resolves to it).
    pub fn primary_protocol(&self) -> &str {
        self.inner.primary.protocol()
    }

    /// Name of the metadata store in use.
    pub fn metadata_backend(&self) -> &str {
        self.inner.store.name()
    }

    /// Name of the control channel in use (`none` when notifications and probes are
    /// unsupported).
    pub fn control_channel(&self) -> &str {
        self.inner.channel.name()
    }

    /// The descriptor this engine publishes, as it would be published now.
    pub fn local_descriptor(&self) -> SegmentDescriptor {
        self.inner.descriptor()
    }

    /// A snapshot of this engine's counters: completed and failed requests and their bytes by
    /// transport, peer and opcode (requests this engine initiated), failures and refused
    /// submissions by error kind, batch-latency percentiles and buckets, open segments, and
    /// registered memory. Cheap enough to call every second (it reads the counters, locks the
    /// segment table and the memory registry briefly, and allocates the snapshot); works after
    /// shutdown too. docs/metrics.md describes every field.
    pub fn stats(&self) -> EngineStats {
        let mut stats = self.inner.metrics.snapshot();
        stats.open_segments = self.inner.segments.read().unwrap_or_else(|p| p.into_inner()).len() as u64;
        let regions = self.inner.memory.regions();
        stats.registered_regions = regions.len() as u64;
        stats.registered_bytes = regions.iter().map(|r| r.len()).sum();
        stats
    }

    /// Default transfer timeout (from the config).
    pub fn transfer_timeout(&self) -> Duration {
        self.inner.config.transfer_timeout()
    }

    /// Runs `fut` to completion on the engine's runtime, for callers outside any runtime.
    ///
    /// Most blocking calls never wait (a submit, a lookup): `fut` is polled once here, inside
    /// the runtime's context, and only a future that is not ready goes on to the runtime's
    /// `block_on` (which polls it again with its own waker). That spares the common case
    /// `block_on`'s set-up on every call.
    pub fn block_on<F: Future>(&self, fut: F) -> Result<F::Output> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::invalid(
                "a blocking Ferry call was made from inside an async runtime; use the async method",
            ));
        }
        let mut fut = std::pin::pin!(fut);
        {
            let _context = self.inner.runtime.enter();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if let std::task::Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
                return Ok(out);
            }
        }
        Ok(self.inner.runtime.block_on(fut))
    }

    /// This process's local rank, if known (see [`EngineBuilder::local_rank`]).
    pub fn local_rank(&self) -> Option<u32> {
        self.inner.local_rank
    }

    /// The engine's resolver chain.
    pub fn resolver_chain(&self) -> &ResolverChain {
        &self.inner.resolvers
    }

    /// Resolves this process's identity through the resolver chain (with the explanation).
    pub async fn resolve_local(&self) -> Result<Resolution> {
        let q = ResolveQuery::local(Some(self.inner.name.clone()), self.inner.local_rank);
        self.inner.resolvers.resolve(&q).await
    }

    /// Resolves a peer's identity through the resolver chain.
    pub async fn resolve_peer(&self, segment: &str) -> Result<Resolution> {
        let q = ResolveQuery::peer(segment, Some(self.inner.name.clone()), self.inner.local_rank);
        self.inner.resolvers.resolve(&q).await
    }

    /// Shuts the engine down, after which its registered memory may be freed:
    ///
    /// 1. the memory registry closes (new requests from peers or from this engine are refused);
    /// 2. the transports stop (their servers and connections end);
    /// 3. it waits, up to the transfer timeout, until no request holds registered memory (a
    ///    batch holds it until its transports released every request — also cancelled ones
    ///    they had started), then forgets every region; if memory is still held, it fails with
    ///    [`ErrorKind::Busy`] and the memory must not be freed yet;
    /// 4. its entries are removed from metadata, and its control channel closes (its listening
    ///    port is free when this returns).
    ///
    /// Later calls fail with [`ErrorKind::Shutdown`]. Idempotent.
    pub async fn shutdown(&self) -> Result<()> {
        if self.inner.shut_down.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // No re-publication may race the removal below.
        for task in self.inner.watch_task.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            task.abort();
        }
        self.inner.memory.close();
        // Services stop first (a metrics endpoint stops answering; its counters stay readable
        // through `stats`).
        drop(std::mem::take(&mut *self.inner.services.lock().unwrap_or_else(|p| p.into_inner())));
        let _change = self.inner.transport_change.lock().await;
        for t in self.inner.transports().iter() {
            t.shutdown().await;
        }
        let deadline = tokio::time::Instant::now() + self.transfer_timeout();
        let mut first_err = loop {
            match self.inner.memory.clear() {
                Ok(()) => break None,
                Err(e) if tokio::time::Instant::now() >= deadline => break Some(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        };
        // Wait for a publication in progress; later ones see `shut_down` and do nothing.
        let _publishing = self.inner.publish_lock.lock().await;
        self.inner.channel.descriptor_published(None);
        for key in [self.inner.keys.segment(&self.inner.name), self.inner.keys.rpc(&self.inner.name)] {
            if let Err(e) = self.inner.store.delete(&key).await {
                first_err.get_or_insert(e);
            }
        }
        self.inner.channel.close().await;
        first_err.map_or(Ok(()), Err)
    }

    /// Blocking form of [`shutdown`](Self::shutdown).
    pub fn shutdown_blocking(&self) -> Result<()> {
        self.block_on(self.shutdown())?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{Capabilities, TransportFactory};
    use crate::{IdentityField, InProcessMetadata, Submission};

    /// A transport that moves nothing; its factory keeps the context it was given.
    struct Still;
    #[async_trait::async_trait]
    impl Transport for Still {
        fn protocol(&self) -> &str {
            "still"
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::default()
        }
        fn submit(&self, _: &Arc<OpenSegment>, submission: Submission) {
            submission.fail_all(&Error::invalid("still moves nothing"));
        }
    }
    #[derive(Default)]
    struct StillFactory(Mutex<Option<TransportContext>>);
    #[async_trait::async_trait]
    impl TransportFactory for StillFactory {
        fn protocol(&self) -> &'static str {
            "still"
        }
        async fn create(&self, ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
            *self.0.lock().unwrap() = Some(ctx.clone());
            Ok(Arc::new(Still))
        }
    }

    fn builder(text: &str, factory: &Arc<StillFactory>) -> EngineBuilder {
        let mut b = EngineBuilder::new()
            .config(Config::from_json_str(text, None).unwrap())
            .metadata(InProcessMetadata::new() as Arc<dyn MetadataStore>);
        b.transports_mut().install(factory.clone());
        b
    }

    /// `block_on` answers a ready future at its first poll and a pending one through the
    /// runtime; both see the runtime's context (timers, spawning) from their first poll on.
    #[test]
    fn block_on_finishes_ready_and_waiting_futures_alike() {
        let factory = Arc::new(StillFactory::default());
        let e = builder(r#"{"protocol": "still"}"#, &factory).build_blocking().unwrap();
        assert_eq!(e.block_on(async { 7 }).unwrap(), 7);
        let slept = e
            .block_on(async {
                tokio::time::sleep(Duration::from_millis(5)).await;
                8
            })
            .unwrap();
        assert_eq!(slept, 8);
        let spawned = e.block_on(async { tokio::spawn(async { 9 }).await.unwrap() }).unwrap();
        assert_eq!(spawned, 9);
        let yielded = e
            .block_on(async {
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                10
            })
            .unwrap();
        assert_eq!(yielded, 10);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let inside = rt.block_on(async { e.block_on(async { 11 }) });
        assert_eq!(inside.unwrap_err().kind(), ErrorKind::InvalidArgument);
    }

    #[tokio::test]
    async fn one_config_serves_every_rank_of_a_node() {
        let text = r#"{"local_hostname": "10.0.0.5", "base_port": 17000, "protocol": "still",
                       "physical_devices": [4, 5, 6, 7]}"#;
        for rank in [0u32, 2] {
            let factory = Arc::new(StillFactory::default());
            let e = builder(text, &factory).local_rank(rank).build().await.unwrap();
            let port = 17000 + rank as u16;
            assert_eq!(e.segment_name(), format!("10.0.0.5:{port}"));
            assert_eq!(e.local_rank(), Some(rank));
            // What the transport sees: the rank and this rank's name in the config, the chain.
            let ctx = factory.0.lock().unwrap().clone().unwrap();
            assert_eq!(ctx.config.local_rank(), Some(rank));
            assert_eq!(ctx.config.local_hostname.as_deref(), Some(format!("10.0.0.5:{port}").as_str()));
            assert_eq!(ctx.resolvers.names(), e.resolver_chain().names());
            let r = e.resolve_local().await.unwrap();
            assert_eq!(r.identity.port, Some(port));
            assert_eq!(r.identity.physical_device, Some(4 + rank));
            assert_eq!(r.answer(IdentityField::PhysicalDevice).unwrap().resolver, "config");
            assert!(r.disagreements.is_empty(), "port_offset agrees with the name: {r}");
            let p = e.resolve_peer("10.0.0.6:17001:npu_1").await.unwrap();
            assert_eq!((p.identity.port, p.identity.physical_device), (Some(17001), Some(1)));
            e.shutdown().await.unwrap();
        }
    }

    #[tokio::test]
    async fn the_chain_comes_from_the_config_unless_given() {
        let factory = Arc::new(StillFactory::default());
        let text = r#"{"local_hostname": "10.0.0.5:1", "protocol": "still", "resolvers": ["hostname"]}"#;
        let e = builder(text, &factory).build().await.unwrap();
        assert_eq!(e.resolver_chain().names(), vec!["hostname"]);
        e.shutdown().await.unwrap();
        let e = builder(text, &factory).resolvers(ResolverChain::new()).build().await.unwrap();
        assert!(e.resolver_chain().names().is_empty());
        e.shutdown().await.unwrap();
        let bad = r#"{"local_hostname": "10.0.0.5:1", "protocol": "still", "resolvers": ["dns"]}"#;
        let err = builder(bad, &factory).build().await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.message().contains("unknown resolver \"dns\""), "{err}");
    }

    /// A transport that allocates host memory its own way and counts the frees.
    struct Pinned(Arc<AtomicU64>);
    #[async_trait::async_trait]
    impl Transport for Pinned {
        fn protocol(&self) -> &str {
            "still"
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::default()
        }
        fn submit(&self, _: &Arc<OpenSegment>, submission: Submission) {
            submission.fail_all(&Error::invalid("pinned moves nothing"));
        }
        async fn allocate_host(&self, len: usize) -> Option<Result<HostAllocation>> {
            let mut bytes = vec![0u8; len].into_boxed_slice();
            let addr = bytes.as_mut_ptr() as u64;
            let frees = self.0.clone();
            #[allow(unsafe_code)]
            // SAFETY: the boxed slice is zeroed, owned by the deallocator and dropped by it alone.
            Some(Ok(unsafe {
                HostAllocation::new(addr, len, "pinned", move || {
                    drop(bytes);
                    frees.fetch_add(1, Ordering::SeqCst);
                })
            }))
        }
    }
    struct PinnedFactory(Arc<AtomicU64>);
    #[async_trait::async_trait]
    impl TransportFactory for PinnedFactory {
        fn protocol(&self) -> &'static str {
            "still"
        }
        async fn create(&self, _: &TransportContext) -> Result<Arc<dyn Transport>> {
            Ok(Arc::new(Pinned(self.0.clone())))
        }
    }

    #[tokio::test]
    #[allow(unsafe_code)]
    async fn host_memory_comes_from_the_transport_else_the_fallback_and_is_not_freed_while_registered() {
        let text = r#"{"local_hostname": "10.0.0.5:1", "protocol": "still"}"#;
        // A transport without an allocator: the process allocator, page-aligned.
        let e = builder(text, &Arc::new(StillFactory::default())).build().await.unwrap();
        let a = e.allocate_host_memory(100).await.unwrap();
        assert_eq!(a.origin(), "the process allocator");
        assert_eq!(a.addr() % crate::HOST_ALIGNMENT as u64, 0);
        assert_eq!(e.allocate_host_memory(0).await.unwrap_err().kind(), ErrorKind::InvalidArgument);
        a.free().unwrap();

        // One with an allocator: its memory, watched by the engine's registry.
        let frees = Arc::new(AtomicU64::new(0));
        let mut b = EngineBuilder::new()
            .config(Config::from_json_str(text, None).unwrap())
            .metadata(InProcessMetadata::new() as Arc<dyn MetadataStore>);
        b.transports_mut().install(Arc::new(PinnedFactory(frees.clone())));
        let e = b.build().await.unwrap();
        let a = e.allocate_host_memory(4096).await.unwrap();
        assert_eq!((a.origin(), a.len()), ("pinned", 4096));
        // SAFETY: `a` owns the memory; it is unregistered before it is freed (the test checks
        // that freeing earlier is refused).
        unsafe { e.register_memory(a.addr(), 4096, Location::Any) }.await.unwrap();
        let (a, err) = a.free().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
        assert_eq!(frees.load(Ordering::SeqCst), 0);
        e.unregister_memory(a.addr()).await.unwrap();
        a.free().unwrap();
        assert_eq!(frees.load(Ordering::SeqCst), 1);

        // Dropped while registered: leaked, not freed.
        let a = e.allocate_host_memory(10).await.unwrap();
        // SAFETY: as above; the memory is leaked, so it stays valid for the registration.
        unsafe { e.register_memory(a.addr(), 10, Location::Any) }.await.unwrap();
        drop(a);
        assert_eq!(frees.load(Ordering::SeqCst), 1);
        e.shutdown().await.unwrap();
        assert_eq!(e.allocate_host_memory(1).await.unwrap_err().kind(), ErrorKind::Shutdown);
    }

    /// A control channel that records what the engine asks of it.
    #[derive(Default)]
    struct Recorder {
        events: Mutex<Vec<String>>,
        refuse_claims: bool,
    }
    impl Recorder {
        fn log(&self, event: String) {
            self.events.lock().unwrap().push(event);
        }
        fn events(&self) -> Vec<String> {
            self.events.lock().unwrap().clone()
        }
    }
    #[async_trait::async_trait]
    impl ControlChannel for Recorder {
        fn name(&self) -> &str {
            "recorder"
        }
        fn rpc_port(&self) -> Option<u16> {
            Some(15999)
        }
        async fn claim_rpc_entry(&self, key: &str, entry: &[u8]) -> Result<()> {
            self.log(format!("claim {key} {}", String::from_utf8_lossy(entry)));
            if self.refuse_claims {
                return Err(Error::new(ErrorKind::AlreadyExists, "segment name in use"));
            }
            Ok(())
        }
        fn descriptor_published(&self, descriptor: Option<&[u8]>) {
            let name = descriptor.map(|d| SegmentDescriptor::from_json("k", d).unwrap().name);
            self.log(format!("published {name:?}"));
        }
        async fn notify(&self, segment: &str, n: &crate::Notification) -> Result<()> {
            self.log(format!("notify {segment} {} {}", n.name, n.notify_msg));
            Ok(())
        }
        fn drain_notifications(&self) -> Vec<crate::Notification> {
            vec![crate::Notification { name: "peer".into(), notify_msg: "hi".into() }]
        }
        async fn probe(&self, segment: &str) -> Result<()> {
            self.log(format!("probe {segment}"));
            Ok(())
        }
        async fn close(&self) {
            self.log("close".into());
        }
    }

    #[tokio::test]
    async fn the_engine_tells_its_control_channel_what_it_publishes_and_closes_it_last() {
        let text = r#"{"local_hostname": "10.0.0.5:17000", "protocol": "still"}"#;
        let channel = Arc::new(Recorder::default());
        let meta = InProcessMetadata::new();
        let mut b = EngineBuilder::new()
            .config(Config::from_json_str(text, None).unwrap())
            .metadata(meta.clone() as Arc<dyn MetadataStore>)
            .control_channel(channel.clone());
        b.transports_mut().install(Arc::new(StillFactory::default()));
        let e = b.build().await.unwrap();
        assert_eq!((e.control_channel(), e.rpc_port()), ("recorder", Some(15999)));
        let rpc = r#"{"ip_or_host_name":"10.0.0.5","rpc_port":15999}"#;
        assert_eq!(
            meta.get("mooncake/rpc_meta/10.0.0.5:17000").await.unwrap().as_deref(),
            Some(rpc.as_bytes()),
            "the rpc entry names the channel's port"
        );
        e.send_notification("10.0.0.6:1", "done").await.unwrap();
        e.probe("10.0.0.6:1").await.unwrap();
        assert_eq!(e.get_notifications()[0].notify_msg, "hi");
        e.shutdown().await.unwrap();
        assert_eq!(
            channel.events(),
            [
                r#"published Some("10.0.0.5:17000")"#.to_owned(),
                format!("claim mooncake/rpc_meta/10.0.0.5:17000 {rpc}"),
                "notify 10.0.0.6:1 10.0.0.5:17000 done".to_owned(),
                "probe 10.0.0.6:1".to_owned(),
                "published None".to_owned(),
                "close".to_owned(),
            ]
        );
        assert!(meta.keys().is_empty(), "unpublished before the channel closed");

        // A channel that refuses the name: the engine does not start.
        let refusing = Arc::new(Recorder { refuse_claims: true, ..Recorder::default() });
        let mut b = EngineBuilder::new()
            .config(Config::from_json_str(text, None).unwrap())
            .metadata(InProcessMetadata::new() as Arc<dyn MetadataStore>)
            .control_channel(refusing);
        b.transports_mut().install(Arc::new(StillFactory::default()));
        assert_eq!(b.build().await.unwrap_err().kind(), ErrorKind::AlreadyExists);
    }

    #[tokio::test]
    async fn a_store_given_without_a_channel_answers_unsupported_saying_why() {
        let factory = Arc::new(StillFactory::default());
        let e = builder(r#"{"local_hostname": "10.0.0.5:1", "protocol": "still"}"#, &factory).build().await.unwrap();
        assert_eq!(e.control_channel(), "none");
        assert_eq!(e.rpc_port(), Some(1), "the name's port");
        let err = e.send_notification("10.0.0.6:1", "m").await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unsupported);
        assert!(err.message().contains("EngineBuilder::control_channel"), "{err}");
        e.shutdown().await.unwrap();
    }

    /// A writer collecting what a `tracing` subscriber writes, for tests of logged warnings.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        /// Captures this thread's log lines up to `level` until the guard is dropped.
        fn logs(level: tracing::Level) -> (Self, tracing::subscriber::DefaultGuard) {
            let captured = Captured::default();
            let writer = captured.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_writer(move || writer.clone())
                .with_max_level(level)
                .with_ansi(false)
                .finish();
            (captured, tracing::subscriber::set_default(subscriber))
        }
    }

    #[tokio::test]
    async fn an_engine_warns_of_misspelt_fields_and_names_the_nearest_known_one() {
        let (captured, _guard) = Captured::logs(tracing::Level::WARN);
        let factory = Arc::new(StillFactory::default());
        let text = r#"{"local_hostname": "10.0.0.5:1", "protocol": "still", "metadata_sever": "P2PHANDSHAKE",
                       "trasnfer_timeout_ms": 100, "rdma_devices": "mlx5_0"}"#;
        let e = builder(text, &factory).build().await.unwrap();
        e.shutdown().await.unwrap();
        let logged = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert!(logged.contains("unknown config field `metadata_sever`: did you mean `metadata_server`?"), "{logged}");
        assert!(
            logged.contains("unknown config field `trasnfer_timeout_ms`: did you mean `transfer_timeout_ms`?"),
            "{logged}"
        );
        assert!(logged.contains("unknown config field `rdma_devices`: kept"), "{logged}");
        assert!(logged.contains("WARN"), "{logged}");
    }

    #[tokio::test]
    async fn an_engine_refuses_values_out_of_range_however_they_were_set() {
        let factory = Arc::new(StillFactory::default());
        let base = r#"{"local_hostname": "10.0.0.5:1", "protocol": "still"}"#;
        let refused = |built: Result<TransferEngine>| match built {
            Ok(_) => panic!("built"),
            Err(e) => e,
        };
        let e = refused(builder(base, &factory).transfer_timeout(Duration::ZERO).build().await);
        assert_eq!(e.kind(), ErrorKind::Config);
        assert_eq!(e.message(), "`transfer_timeout_ms` set through the API: is 0; expected 1 to 86400000 milliseconds");
        let e = refused(builder(base, &factory).local_rank(5000).build().await);
        assert!(e.message().starts_with("`local_rank` set through the API: is 5000; expected 0 to 1023"), "{e}");
        let mut b = builder(base, &factory);
        b.config_mut().transfer_timeout_ms = Some(u64::MAX);
        let e = refused(b.build().await);
        assert!(
            e.message().contains("field `transfer_timeout_ms`") && e.message().contains("expected 1 to 86400000"),
            "{e}"
        );
    }

    /// Completes reads, fails writes with a timeout.
    struct Halves;
    #[async_trait::async_trait]
    impl Transport for Halves {
        fn protocol(&self) -> &str {
            "still"
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities { read: true, write: true, ..Capabilities::default() }
        }
        fn submit(&self, _: &Arc<OpenSegment>, mut submission: Submission) {
            let outcomes: Vec<(u32, bool)> =
                submission.requests().map(|(i, r)| (i, r.request.opcode == Opcode::Read)).collect();
            for (i, read) in outcomes {
                submission.complete(i, if read { Ok(()) } else { Err(Error::timeout("writes time out here")) });
            }
        }
    }
    struct HalvesFactory;
    #[async_trait::async_trait]
    impl TransportFactory for HalvesFactory {
        fn protocol(&self) -> &'static str {
            "still"
        }
        async fn create(&self, _: &TransportContext) -> Result<Arc<dyn Transport>> {
            Ok(Arc::new(Halves))
        }
    }

    /// Records that it started and whether it was stopped.
    struct Flag(Arc<AtomicU64>);
    #[async_trait::async_trait]
    impl EngineService for Flag {
        fn name(&self) -> &str {
            "flag"
        }
        async fn start(&self, engine: &TransferEngine) -> Result<Option<ServiceGuard>> {
            if engine.config().metrics_addr().is_none() {
                return Ok(None);
            }
            self.0.fetch_add(1, Ordering::SeqCst);
            let stopped = self.0.clone();
            Ok(Some(ServiceGuard::new(move || {
                stopped.fetch_add(10, Ordering::SeqCst);
            })))
        }
    }

    #[tokio::test]
    #[allow(unsafe_code)]
    async fn stats_count_requests_bytes_failures_latency_segments_and_memory_per_route() {
        let text = r#"{"local_hostname": "10.0.0.5:1", "protocol": "still", "metrics_addr": "127.0.0.1:0"}"#;
        let started = Arc::new(AtomicU64::new(0));
        let mut b = EngineBuilder::new()
            .config(Config::from_json_str(text, None).unwrap())
            .metadata(InProcessMetadata::new() as Arc<dyn MetadataStore>)
            .service(Arc::new(Flag(started.clone())));
        b.transports_mut().install(Arc::new(HalvesFactory));
        let e = b.build().await.unwrap();
        assert_eq!(started.load(Ordering::SeqCst), 1, "the service started");
        let buf = vec![0u8; 8192];
        // SAFETY: `buf` outlives the engine's use of it (shut down below); the transport never
        // touches memory.
        unsafe { e.register_memory(buf.as_ptr() as u64, 8192, Location::Any) }.await.unwrap();
        let peer = e.open_segment("10.0.0.5:1").await.unwrap();
        let req = |opcode, offset: u64, length| TransferRequest {
            opcode,
            source: buf.as_ptr() as u64 + offset,
            target: peer,
            target_offset: buf.as_ptr() as u64 + offset,
            length,
        };
        let batch = e
            .submit(&[req(Opcode::Read, 0, 100), req(Opcode::Read, 100, 28), req(Opcode::Write, 0, 4096)])
            .await
            .unwrap();
        assert!(batch.wait_ok(Duration::from_secs(5)).await.is_err());
        e.transfer(&[req(Opcode::Read, 0, 1000)]).await.unwrap();
        // Outside the registered memory: refused, nothing counted but the refusal.
        let refused = e.submit(&[req(Opcode::Read, 8192, 8)]).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::OutOfBounds);

        let s = e.stats();
        assert_eq!(s.segment, "10.0.0.5:1");
        let route = |op: &str| s.transfers.iter().find(|t| t.opcode == op && t.peer == "10.0.0.5:1").unwrap();
        assert_eq!(route("read").transport, "still");
        assert_eq!((route("read").requests, route("read").bytes, route("read").failed_requests), (3, 1128, 0));
        assert_eq!((route("write").requests, route("write").bytes, route("write").failed_requests), (0, 0, 1));
        assert_eq!(s.totals(), (3, 1128));
        assert_eq!(s.failures["timeout"], 1);
        assert_eq!(s.failures.values().sum::<u64>(), 1);
        assert_eq!(s.rejected_submissions["out_of_bounds"], 1);
        assert_eq!(s.batch_latency.count, 2);
        assert!(s.batch_latency.p50_us > 0.0 && s.batch_latency.p50_us <= s.batch_latency.p999_us);
        assert_eq!((s.open_segments, s.registered_bytes, s.registered_regions), (1, 8192, 1));

        // Closing the segment keeps its totals; the gauge goes down.
        e.close_segment(peer).unwrap();
        let after = e.stats();
        assert_eq!((after.open_segments, after.totals()), (0, (3, 1128)));
        e.shutdown().await.unwrap();
        assert_eq!(started.load(Ordering::SeqCst), 11, "stopped at shutdown");
        assert_eq!(e.stats().registered_bytes, 0, "readable after shutdown");
    }

    #[tokio::test]
    #[allow(unsafe_code)]
    async fn a_failed_batch_is_one_warning_naming_the_peer_and_request_and_successes_log_nothing() {
        let (captured, _guard) = Captured::logs(tracing::Level::INFO);
        let text = r#"{"local_hostname": "10.0.0.5:2", "protocol": "still"}"#;
        let mut b = EngineBuilder::new()
            .config(Config::from_json_str(text, None).unwrap())
            .metadata(InProcessMetadata::new() as Arc<dyn MetadataStore>);
        b.transports_mut().install(Arc::new(HalvesFactory));
        let e = b.build().await.unwrap();
        let buf = vec![0u8; 4096];
        // SAFETY: `buf` outlives the engine's use of it; the transport never touches memory.
        unsafe { e.register_memory(buf.as_ptr() as u64, 4096, Location::Any) }.await.unwrap();
        let peer = e.open_segment("10.0.0.5:2").await.unwrap();
        let req = |opcode, length| TransferRequest {
            opcode,
            source: buf.as_ptr() as u64,
            target: peer,
            target_offset: buf.as_ptr() as u64,
            length,
        };
        let before = captured.0.lock().unwrap().len();
        for _ in 0..50 {
            e.transfer(&[req(Opcode::Read, 64)]).await.unwrap();
        }
        assert_eq!(captured.0.lock().unwrap().len(), before, "successful requests log nothing at info");
        // Three writes fail (and one read succeeds): one line, naming the peer and the first.
        let _ = e
            .transfer(&[req(Opcode::Read, 8), req(Opcode::Write, 16), req(Opcode::Write, 32), req(Opcode::Write, 8)])
            .await;
        let logged = String::from_utf8(captured.0.lock().unwrap()[before..].to_vec()).unwrap();
        let lines: Vec<&str> = logged.lines().collect();
        assert_eq!(lines.len(), 1, "{logged}");
        for needle in [
            "WARN",
            "transfer batch failed",
            "peer=\"10.0.0.5:2\"",
            "request=1",
            "opcode=Write",
            "length=16",
            "failed=3",
            "total=4",
            "kind=timeout",
            "writes time out here",
        ] {
            assert!(lines[0].contains(needle), "{needle:?} not in {logged}");
        }
        e.shutdown().await.unwrap();
    }
}
