//! The [`TransferEngine`]: memory registry, segment cache, transport table, metadata backend
//! and resolver chain, and the submit path that ties them together.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use crate::batch::{Batch, Opcode, SegmentHandle, Submission, TransferRequest};
use crate::config::{Config, MetadataServer};
use crate::descriptor::{BufferDesc, MetadataKeys, RpcMeta, SegmentDescriptor};
use crate::error::{Error, ErrorKind, Result};
use crate::host_memory::HostAllocation;
use crate::kv::{BlockRun, BlockTransfer, KvLayout, plan_block_transfer};
use crate::memory::{Location, MemoryRegistry, Region, RegisteredMemory};
use crate::metadata::{MetadataBackend, MetadataRegistry, WatchEvent};
use crate::resolver::{Environment, Resolution, ResolveQuery, ResolverChain, ResolverRegistry};
use crate::segment::OpenSegment;
use crate::segment_name::SegmentName;
use crate::transport::{Transport, TransportContext, TransportRegistry, no_transport_for};

/// Builds a [`TransferEngine`] from a config or programmatically.
#[must_use]
pub struct EngineBuilder {
    config: Config,
    transports: TransportRegistry,
    metadata_registry: MetadataRegistry,
    metadata: Option<Arc<dyn MetadataBackend>>,
    resolvers: Option<ResolverChain>,
    resolver_registry: ResolverRegistry,
    local_rank: Option<u32>,
}

impl std::fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("protocol", &self.config.protocol())
            .field("transports", &self.transports)
            .finish_non_exhaustive()
    }
}

impl Default for EngineBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl EngineBuilder {
    /// A builder on the embedded default config ([`Config::embedded`]) with no transports
    /// installed; the facade crate's builder pre-installs the ones compiled in.
    pub fn new() -> Self {
        Self {
            config: Config::embedded(),
            transports: TransportRegistry::new(),
            metadata_registry: MetadataRegistry::new(),
            metadata: None,
            resolvers: None,
            resolver_registry: ResolverRegistry::with_builtin(),
            local_rank: None,
        }
    }

    /// Uses `config`.
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Mutable access to the config (for programmatic settings).
    pub fn config_mut(&mut self) -> &mut Config {
        &mut self.config
    }

    /// Sets this engine's segment name (overrides the config).
    pub fn segment_name(mut self, name: impl Into<String>) -> Self {
        self.config.local_hostname = Some(name.into());
        self
    }

    /// Sets the transport protocol (overrides the config).
    pub fn protocol(mut self, protocol: impl Into<String>) -> Self {
        self.config.protocol = Some(protocol.into());
        self
    }

    /// Sets the transfer timeout (overrides the config).
    pub fn transfer_timeout(mut self, timeout: Duration) -> Self {
        self.config.transfer_timeout_ms = Some(timeout.as_millis().min(u128::from(u64::MAX)) as u64);
        self
    }

    /// The transports the engine may install.
    pub fn transports(mut self, transports: TransportRegistry) -> Self {
        self.transports = transports;
        self
    }

    /// Mutable access to the transport registry.
    pub fn transports_mut(&mut self) -> &mut TransportRegistry {
        &mut self.transports
    }

    /// The metadata backends the engine may connect to by config.
    pub fn metadata_registry(mut self, registry: MetadataRegistry) -> Self {
        self.metadata_registry = registry;
        self
    }

    /// Uses this metadata backend instead of the one the config names.
    pub fn metadata(mut self, backend: Arc<dyn MetadataBackend>) -> Self {
        self.metadata = Some(backend);
        self
    }

    /// Uses this resolver chain instead of the one built from the config and the resolver
    /// registry.
    pub fn resolvers(mut self, chain: ResolverChain) -> Self {
        self.resolvers = Some(chain);
        self
    }

    /// The resolvers the engine's chain is built from, by name (the config's `resolvers` list,
    /// else the registry's [default order](ResolverRegistry::default_order)); default
    /// [`ResolverRegistry::with_builtin`] (the core's links only: a transport's crate provides
    /// its device-identity links, and the `ferry` facade installs those compiled in).
    pub fn resolver_registry(mut self, registry: ResolverRegistry) -> Self {
        self.resolver_registry = registry;
        self
    }

    /// Mutable access to the resolver registry (to install a transport's links).
    pub fn resolver_registry_mut(&mut self) -> &mut ResolverRegistry {
        &mut self.resolver_registry
    }

    /// This process's local rank on its node. Overrides `FERRY_LOCAL_RANK`, `LOCAL_RANK` and
    /// the config's `local_rank`; selects the port (`base_port + local_rank`) and, through the
    /// resolvers, the device.
    pub fn local_rank(mut self, rank: u32) -> Self {
        self.local_rank = Some(rank);
        self
    }

    /// Builds the engine on the current tokio runtime (multi-thread recommended; blocking
    /// wrappers need one). Fails with [`ErrorKind::InvalidArgument`] outside a runtime.
    pub async fn build(self) -> Result<TransferEngine> {
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::invalid("EngineBuilder::build must run inside a tokio runtime; use build_blocking"))?;
        self.build_on(handle).await
    }

    /// Builds the engine with its own runtime (one worker thread per core, at most four), for
    /// callers that are not async. Must not be called from inside a runtime.
    pub fn build_blocking(self) -> Result<TransferEngine> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::invalid("build_blocking called inside an async runtime; use build().await"));
        }
        let cores = std::thread::available_parallelism().map(usize::from).unwrap_or(2);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cores.clamp(1, 4))
            .thread_name("ferry-rt")
            .enable_all()
            .build()
            .map_err(|e| Error::new(ErrorKind::Transport, "cannot start the engine's runtime").with_source(e))?;
        let handle = rt.handle().clone();
        let engine = rt.block_on(self.build_on(handle))?;
        *engine.inner.owned_runtime.lock().unwrap_or_else(|p| p.into_inner()) = Some(rt);
        Ok(engine)
    }

    async fn build_on(self, runtime: tokio::runtime::Handle) -> Result<TransferEngine> {
        let mut config = self.config;
        // The local rank: the API's, else FERRY_LOCAL_RANK / LOCAL_RANK, else the config's.
        match self.local_rank {
            Some(rank) => config.set_local_rank(rank),
            None => config.apply_local_rank_env(|k| std::env::var(k).ok())?,
        }
        // Everything the config alone can refute is checked before any connection is made.
        let server = config.metadata()?;
        let primary_factory = self.transports.for_config(&config)?;
        // With `base_port`, this rank's port is part of the name from here on.
        let configured_name = config.fix_segment_name()?;
        let resolvers = match self.resolvers {
            Some(chain) => chain,
            None => self.resolver_registry.build_chain(&config, &Environment::process())?,
        };
        let metadata = match self.metadata {
            Some(m) => m,
            None => self.metadata_registry.connect(&config).await?,
        };
        let name = match metadata.segment_name_hint().or(configured_name) {
            Some(n) => n,
            None if server == MetadataServer::Embedded || metadata.name() == "embedded" => {
                static NEXT: AtomicU64 = AtomicU64::new(0);
                format!("ferry-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
            }
            None => {
                return Err(config.field_error(
                    "local_hostname",
                    "no segment name: set local_hostname (or role with prefill_url/decode_url, or FERRY_LOCAL_HOSTNAME)",
                ));
            }
        };
        let keys = MetadataKeys::new(config.cluster_id());
        let instance = new_instance_id();
        let memory = Arc::new(MemoryRegistry::new());
        let local_rank = config.local_rank();
        let config = Arc::new(config);
        let ctx = TransportContext {
            segment_name: name.clone(),
            instance: instance.clone(),
            config: config.clone(),
            memory: memory.clone(),
            runtime: runtime.clone(),
            resolvers: resolvers.clone(),
            descriptors: Some(Arc::new(MetadataDescriptors { metadata: metadata.clone(), keys: keys.clone() })),
        };
        let mut transports: Vec<Arc<dyn Transport>> = Vec::new();
        for factory in self.transports.companions() {
            if factory.protocol() != primary_factory.protocol() {
                transports.push(factory.create(&ctx).await?);
            }
        }
        let primary = primary_factory.create(&ctx).await?;
        transports.push(primary.clone());
        let transport_registry = self.transports;

        let inner = Arc::new(EngineInner {
            name,
            instance,
            config,
            memory,
            metadata,
            keys,
            transports: RwLock::new(Arc::new(transports)),
            primary,
            transport_registry,
            ctx,
            transport_change: tokio::sync::Mutex::new(()),
            local_rank,
            resolvers,
            segments: RwLock::new(SegmentTable::default()),
            layouts: RwLock::new(HashMap::new()),
            publish_lock: tokio::sync::Mutex::new(()),
            runtime,
            owned_runtime: Mutex::new(None),
            shut_down: AtomicBool::new(false),
            watch_task: Mutex::new(Vec::new()),
        });
        inner.refuse_live_namesake().await?;
        inner.publish().await?;
        inner.publish_rpc().await?;
        let mut tasks = vec![inner.runtime.spawn(keep_published(Arc::downgrade(&inner)))];
        if let Some(rx) = inner.metadata.watch(inner.keys.prefix()).await? {
            tasks.push(inner.runtime.spawn(watch_segments(Arc::downgrade(&inner), rx)));
        }
        *inner.watch_task.lock().unwrap_or_else(|p| p.into_inner()) = tasks;
        tracing::info!(segment = %inner.name, protocol = inner.primary.protocol(), metadata = inner.metadata.name(), "engine started");
        Ok(TransferEngine { inner })
    }
}

fn new_instance_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{:x}-{:x}-{:x}", std::process::id(), nanos, NEXT.fetch_add(1, Ordering::Relaxed))
}

#[derive(Default)]
struct SegmentTable {
    by_name: HashMap<String, SegmentHandle>,
    by_handle: HashMap<SegmentHandle, Arc<OpenSegment>>,
}

/// Identifies a KV layout registered with [`TransferEngine::register_kv_layout`]. Not made from
/// an integer (bindings turn theirs back with [`TransferEngine::kv_layout_id`], which checks it);
/// unique in the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayoutId(u64);

impl KvLayoutId {
    /// Its number, for bindings that pass ids as integers.
    pub fn raw(self) -> u64 {
        self.0
    }
}

struct EngineInner {
    name: String,
    instance: String,
    config: Arc<Config>,
    memory: Arc<MemoryRegistry>,
    metadata: Arc<dyn MetadataBackend>,
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
    layouts: RwLock<HashMap<KvLayoutId, Arc<KvLayout>>>,
    publish_lock: tokio::sync::Mutex<()>,
    runtime: tokio::runtime::Handle,
    owned_runtime: Mutex<Option<tokio::runtime::Runtime>>,
    shut_down: AtomicBool,
    /// Background tasks (re-publication, watch), aborted at shutdown.
    watch_task: Mutex<Vec<tokio::task::JoinHandle<()>>>,
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

/// How often an engine checks that its descriptor is still published.
pub const REPUBLISH_CHECK: Duration = Duration::from_secs(2);

/// Re-publishes this engine's entries whenever the metadata service lost them (a server
/// restart, an expired etcd lease), once it answers again.
async fn keep_published(engine: Weak<EngineInner>) {
    loop {
        tokio::time::sleep(REPUBLISH_CHECK).await;
        let Some(engine) = engine.upgrade() else { return };
        if engine.shut_down.load(Ordering::Acquire) {
            return;
        }
        match engine.metadata.get(&engine.keys.segment(&engine.name)).await {
            Ok(Some(_)) => {}
            Ok(None) => {
                tracing::warn!(segment = %engine.name, metadata = engine.metadata.name(), "descriptor missing from metadata; publishing again");
                if let Err(e) = async {
                    engine.publish().await?;
                    engine.publish_rpc().await
                }
                .await
                {
                    tracing::warn!(segment = %engine.name, error = %e, "re-publication failed; will retry");
                }
            }
            Err(e) => tracing::debug!(segment = %engine.name, error = %e, "metadata unreachable; will check again"),
        }
    }
}

async fn watch_segments(engine: Weak<EngineInner>, mut rx: tokio::sync::mpsc::Receiver<WatchEvent>) {
    while let Some(event) = rx.recv().await {
        let Some(engine) = engine.upgrade() else { return };
        let Some(name) = engine.keys.segment_name_of(event.key()) else { continue };
        if name == engine.name {
            continue;
        }
        let table = engine.segments.read().unwrap_or_else(|p| p.into_inner());
        if let Some(seg) = table.by_name.get(name).and_then(|h| table.by_handle.get(h)) {
            tracing::debug!(segment = name, "descriptor changed in metadata; cache entry marked stale");
            seg.mark_stale();
        }
    }
}

impl EngineInner {
    fn check_open(&self) -> Result<()> {
        if self.shut_down.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Shutdown, format!("engine `{}` has been shut down", self.name)));
        }
        Ok(())
    }

    /// Refuses to publish over a descriptor that a live engine of this process owns (same
    /// name, same metadata namespace). A descriptor left by a process that died, or by this
    /// engine's predecessor after a restart, is replaced as Mooncake does.
    async fn refuse_live_namesake(&self) -> Result<()> {
        let key = self.keys.segment(&self.name);
        let Ok(Some(bytes)) = self.metadata.get(&key).await else { return Ok(()) };
        let Ok(existing) = SegmentDescriptor::from_json(&key, &bytes) else { return Ok(()) };
        let live_here = self.transports().iter().any(|t| !t.capabilities().cross_process && t.serves(&existing));
        if live_here && existing.ferry_instance.as_deref() != Some(&self.instance) {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!(
                    "segment name `{}` is already published by a live engine of this process (key {key})",
                    self.name
                ),
            ));
        }
        Ok(())
    }

    fn descriptor(&self) -> SegmentDescriptor {
        let mut d = SegmentDescriptor::new(self.name.clone(), self.primary.protocol());
        d.buffers = self
            .memory
            .regions_in_registration_order()
            .iter()
            .map(|r| BufferDesc {
                addr: r.addr(),
                length: r.len(),
                name: r.location().to_string(),
                device_id: None,
                extra: Default::default(),
            })
            .collect();
        d.ferry_instance = Some(self.instance.clone());
        d.timestamp = Some(timestamp_now());
        for t in self.transports().iter() {
            t.publish(&mut d);
        }
        d
    }

    async fn publish(&self) -> Result<()> {
        let _guard = self.publish_lock.lock().await;
        // Shutdown removes the entries under this lock: never publish after it.
        self.check_open()?;
        let desc = self.descriptor();
        let key = self.keys.segment(&self.name);
        self.metadata.put(&key, &desc.to_json()).await.map_err(|e| {
            e.context(format!(
                "publishing segment `{}` to {} metadata (key {key}): {}",
                self.name,
                self.metadata.name(),
                e.message()
            ))
        })?;
        Ok(())
    }

    /// Publishes the `rpc_meta` entry (once, at start: it never changes, and Mooncake's Python
    /// metadata servers refuse a second PUT of it).
    async fn publish_rpc(&self) -> Result<()> {
        // The handshake listener's port when the backend runs one, else the name's port; a name
        // without a port (`host`) is its own host part.
        let (host, port) = match SegmentName::parse(&self.name) {
            Some(n) => (n.host().to_owned(), self.metadata.rpc_port().or(Some(n.port()))),
            None => (self.name.clone(), self.metadata.rpc_port()),
        };
        if let Some(port) = port {
            let rpc = RpcMeta { ip_or_host_name: host, rpc_port: port };
            let body = serde_json::to_vec(&rpc).expect("serialisable");
            self.metadata.put(&self.keys.rpc(&self.name), &body).await?;
        }
        Ok(())
    }

    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        fetch_descriptor(self.metadata.as_ref(), &self.keys, name).await
    }

    /// A snapshot of the installed transports.
    fn transports(&self) -> Arc<Vec<Arc<dyn Transport>>> {
        self.transports.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The transport serving `desc`: an installed one, else one created from the registry
    /// (loading a plugin when a source has it). A new transport is told about every registered
    /// region and may add fields to this engine's descriptor, which is then republished.
    async fn pick_transport(&self, desc: &SegmentDescriptor) -> Result<Arc<dyn Transport>> {
        if let Some(t) = self.transports().iter().find(|t| t.serves(desc)) {
            return Ok(t.clone());
        }
        let _change = self.transport_change.lock().await;
        // Shutdown stops the transports under this lock: none may be added after it.
        self.check_open()?;
        if let Some(t) = self.transports().iter().find(|t| t.serves(desc)) {
            return Ok(t.clone());
        }
        let factory = self
            .transport_registry
            .load(&desc.protocol, &self.config)
            .map_err(|e| e.context(format!("segment `{}`: {}", desc.name, e.message())))?
            .ok_or_else(|| no_transport_for(desc, &self.transport_registry.searched(&self.config)))?;
        let transport = factory.create(&self.ctx).await?;
        if !transport.serves(desc) {
            transport.shutdown().await;
            return Err(no_transport_for(desc, &self.transport_registry.searched(&self.config)));
        }
        let regions = self.memory.regions();
        for (i, region) in regions.iter().enumerate() {
            if let Err(e) = transport.register_memory(region).await {
                for r in &regions[..i] {
                    let _ = transport.unregister_memory(r).await;
                }
                transport.shutdown().await;
                return Err(e.context(format!(
                    "the {} transport (loaded for segment `{}`) refused registered memory: {}",
                    desc.protocol,
                    desc.name,
                    e.message()
                )));
            }
        }
        {
            let mut list = self.transports.write().unwrap_or_else(|p| p.into_inner());
            let mut next = Vec::clone(&list);
            next.push(transport.clone());
            *list = Arc::new(next);
        }
        tracing::info!(segment = %self.name, protocol = %desc.protocol, peer = %desc.name, "transport added for a peer");
        drop(_change);
        if let Err(e) = self.publish().await {
            tracing::warn!(segment = %self.name, error = %e, "republishing after adding a transport failed");
        }
        Ok(transport)
    }

    /// Fetches `name` and stores it under its existing handle or a new one.
    async fn load_segment(&self, name: &str) -> Result<Arc<OpenSegment>> {
        let desc = self.fetch(name).await?;
        if desc.name != name {
            return Err(Error::invalid(format!(
                "the descriptor stored for segment `{name}` names another segment, `{}`",
                desc.name
            )));
        }
        let transport = self.pick_transport(&desc).await?;
        // The transport opens the peer once per descriptor; an error is kept for its submits.
        let peer = transport.open(&desc).await;
        let mut table = self.segments.write().unwrap_or_else(|p| p.into_inner());
        let handle = match table.by_name.get(name) {
            Some(h) => *h,
            None => {
                let h = SegmentHandle::fresh();
                table.by_name.insert(name.to_owned(), h);
                h
            }
        };
        let seg = Arc::new(OpenSegment::new(handle, desc, transport, peer));
        table.by_handle.insert(handle, seg.clone());
        Ok(seg)
    }

    fn cached(&self, handle: SegmentHandle) -> Result<Arc<OpenSegment>> {
        let table = self.segments.read().unwrap_or_else(|p| p.into_inner());
        table
            .by_handle
            .get(&handle)
            .cloned()
            .ok_or_else(|| Error::not_found(format!("segment handle {} is not open in this engine", handle.raw())))
    }

    /// The cached segment, refreshed first when it was marked stale.
    async fn segment_for_use(&self, handle: SegmentHandle) -> Result<Arc<OpenSegment>> {
        let seg = self.cached(handle)?;
        if seg.is_stale() {
            return match self.load_segment(seg.name()).await {
                // The metadata service is down: keep using what we know (the peer may well
                // still be there); the entry stays stale and is refetched on the next use.
                Err(e) if matches!(e.kind(), ErrorKind::PeerUnreachable | ErrorKind::Timeout) => {
                    tracing::warn!(segment = seg.name(), error = %e, "metadata unreachable; using the cached descriptor");
                    Ok(seg)
                }
                other => other,
            };
        }
        Ok(seg)
    }
}

/// Formats the current UTC time as Mooncake does: `YYYY-MM-DD HH:MM:SS.micros`.
fn timestamp_now() -> String {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{:06}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
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
            .field("metadata", &self.inner.metadata.name())
            .finish()
    }
}

/// A submitted block transfer: the batch plus the mapping from requests back to blocks.
#[derive(Debug, Clone)]
pub struct BlockBatch {
    batch: Batch,
    runs: Vec<BlockRun>,
    local_blocks: Vec<u32>,
}

impl BlockBatch {
    /// The underlying batch (one request per run).
    pub fn batch(&self) -> &Batch {
        &self.batch
    }

    /// The merged runs, in request order.
    pub fn runs(&self) -> &[BlockRun] {
        &self.runs
    }

    /// Local block ids whose transfer failed or was cancelled (in any region), sorted.
    pub fn failed_blocks(&self) -> Vec<u32> {
        let mut out = Vec::new();
        for (i, run) in self.runs.iter().enumerate() {
            if matches!(
                self.batch.request_status(i),
                Some(crate::RequestStatus::Failed(_) | crate::RequestStatus::Cancelled)
            ) {
                let first = run.first_pair as usize;
                out.extend_from_slice(&self.local_blocks[first..first + run.pairs as usize]);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Waits for every run; `Ok` only when every block moved.
    pub async fn wait(&self, timeout: Duration) -> Result<()> {
        self.batch.wait_ok(timeout).await
    }

    /// Blocking form of [`wait`](Self::wait).
    pub fn wait_blocking(&self, timeout: Duration) -> Result<()> {
        self.batch.wait_ok_blocking(timeout)
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
    /// listener takes notifications): the metadata backend's listener port, else the port of a
    /// `host:port` segment name. `None` when it publishes no rpc entry.
    pub fn rpc_port(&self) -> Option<u16> {
        self.inner.metadata.rpc_port().or_else(|| SegmentName::parse(&self.inner.name).map(|n| n.port()))
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

    /// Name of the metadata backend in use.
    pub fn metadata_backend(&self) -> &str {
        self.inner.metadata.name()
    }

    /// The descriptor this engine publishes, as it would be published now.
    pub fn local_descriptor(&self) -> SegmentDescriptor {
        self.inner.descriptor()
    }

    /// Default transfer timeout (from the config).
    pub fn transfer_timeout(&self) -> Duration {
        self.inner.config.transfer_timeout()
    }

    /// Runs `fut` to completion on the engine's runtime, for callers outside any runtime.
    pub fn block_on<F: Future>(&self, fut: F) -> Result<F::Output> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::invalid(
                "a blocking Ferry call was made from inside an async runtime; use the async method",
            ));
        }
        Ok(self.inner.runtime.block_on(fut))
    }

    /// Registers `[addr, addr + len)` at `location` and republishes the descriptor. From now on
    /// local requests may use the range, and peers may read and write it.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] for a zero length, [`ErrorKind::AlreadyExists`]
    /// for an overlap, a transport's error (the registration is then rolled back).
    ///
    /// # Safety
    /// See [`MemoryRegistry::register`]: the range must be memory this process owns, valid for
    /// reads and writes by any thread (host memory, or device memory the transports can reach)
    /// until it is unregistered or the engine is shut down, and Rust code must not hold
    /// references into it while transfers may touch it.
    #[allow(unsafe_code)]
    pub async unsafe fn register_memory(&self, addr: u64, len: u64, location: Location) -> Result<()> {
        // SAFETY: the caller's contract is this function's contract.
        unsafe { self.register_memory_batch(&[(addr, len, location)]).await }
    }

    /// Registers several regions: all or none.
    ///
    /// # Safety
    /// As for [`register_memory`](Self::register_memory), for every region.
    #[allow(unsafe_code)]
    pub async unsafe fn register_memory_batch(&self, regions: &[(u64, u64, Location)]) -> Result<()> {
        self.inner.check_open()?;
        if regions.is_empty() {
            return Err(Error::invalid("no regions to register"));
        }
        // Registry and transports change together: a transport added meanwhile (a peer naming a
        // new protocol) sees each region exactly once.
        let change = self.inner.transport_change.lock().await;
        // SAFETY: the caller's contract is this function's contract.
        let added = unsafe { self.inner.memory.register_batch(regions) }?;
        let addrs: Vec<u64> = added.iter().map(|r| r.addr()).collect();
        if let Err(e) = self.attach(&added).await {
            drop(change);
            drop(added);
            return Err(self.roll_back(&addrs, e, false).await);
        }
        drop(change);
        drop(added);
        if let Err(e) = self.inner.publish().await {
            return Err(self.roll_back(&addrs, e, true).await);
        }
        Ok(())
    }

    /// Undoes a registration that failed with `cause`. A request may have leased the new
    /// regions meanwhile (they were visible): wait for it like `unregister_memory` does; if the
    /// regions still cannot be removed, say so, since the caller must then not free them.
    async fn roll_back(&self, addrs: &[u64], cause: Error, attached: bool) -> Error {
        let deadline = tokio::time::Instant::now() + self.transfer_timeout();
        loop {
            let undone = if attached {
                self.unregister_local(addrs).await
            } else {
                self.inner.memory.unregister_batch(addrs).map(|_| ()).map_err(|e| {
                    let wait = e.kind() == ErrorKind::Busy;
                    (e, wait)
                })
            };
            match undone {
                Ok(()) => return cause,
                Err((_, true)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err((e, _)) => {
                    let msg = format!(
                        "{}; the registration could not be rolled back ({}): the memory is still registered and must not be freed before unregister_memory succeeds",
                        cause.message(),
                        e.message()
                    );
                    return cause.context(msg);
                }
            }
        }
    }

    /// Tells every transport about new regions; on failure, detaches what was attached. The
    /// caller holds `transport_change`.
    async fn attach(&self, regions: &[Arc<Region>]) -> Result<()> {
        let transports = self.inner.transports();
        for (i, region) in regions.iter().enumerate() {
            for (t_idx, t) in transports.iter().enumerate() {
                if let Err(e) = t.register_memory(region).await {
                    for t in &transports[..t_idx] {
                        let _ = t.unregister_memory(region).await;
                    }
                    for r in &regions[..i] {
                        for t in transports.iter() {
                            let _ = t.unregister_memory(r).await;
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Removes regions from the registry and from every transport. A transport that cannot let
    /// go of a region (a device communicator that still has it bound) makes the whole call fail
    /// with that transport's error: the regions are registered again (in the registry and in
    /// the transports that had already let go), so the caller keeps them and must not free them.
    #[allow(unsafe_code)]
    /// Unregisters `addrs` from the registry, then from every transport. The error says
    /// whether waiting may help: `true` when a lease held the memory (a request finishing),
    /// `false` when a transport refused (it keeps the memory; asking again cannot change that
    /// and must not pretend it did).
    async fn unregister_local(&self, addrs: &[u64]) -> std::result::Result<(), (Error, bool)> {
        let _change = self.inner.transport_change.lock().await;
        let removed = self.inner.memory.unregister_batch(addrs).map_err(|e| {
            let wait = e.kind() == ErrorKind::Busy;
            (e, wait)
        })?;
        let transports = self.inner.transports();
        let mut failure: Option<Error> = None;
        let mut detached: Vec<(usize, usize)> = Vec::new(); // (region, transport) pairs undone
        for (r, region) in removed.iter().enumerate() {
            for (t_idx, t) in transports.iter().enumerate() {
                match t.unregister_memory(region).await {
                    Ok(()) => detached.push((r, t_idx)),
                    Err(e) => {
                        tracing::warn!(addr = region.addr(), transport = t.protocol(), error = %e, "transport cannot unregister memory; it stays registered");
                        failure.get_or_insert(e.context(format!(
                            "the {} transport still uses the region at {:#x}: {}; it stays registered and must not be freed",
                            t.protocol(),
                            region.addr(),
                            e.message()
                        )));
                    }
                }
            }
        }
        let Some(failure) = failure else { return Ok(()) };
        let specs: Vec<(u64, u64, Location)> =
            removed.iter().map(|r| (r.addr(), r.len(), r.location().clone())).collect();
        // SAFETY: these regions were registered under `register_memory`'s contract and their
        // unregistration has not succeeded, so the caller still guarantees the memory.
        let restored = unsafe { self.inner.memory.register_batch(&specs) }.map_err(|e| {
            (e.context(format!("{}; restoring the registration failed: {}", failure.message(), e.message())), false)
        })?;
        for (r, t_idx) in detached {
            if let Err(e) = transports[t_idx].register_memory(&restored[r]).await {
                tracing::error!(addr = restored[r].addr(), transport = transports[t_idx].protocol(), error = %e, "re-registering memory after a failed unregister failed");
            }
        }
        Err((failure, false))
    }

    /// Unregisters the region starting at `addr` and republishes.
    ///
    /// Errors: [`ErrorKind::NotFound`] when no region starts there, [`ErrorKind::Busy`] when
    /// requests on it are still in flight after the transfer timeout, or at once when a
    /// transport cannot let go of it (it then stays registered and must not be freed).
    pub async fn unregister_memory(&self, addr: u64) -> Result<()> {
        self.unregister_memory_batch(&[addr]).await
    }

    /// Unregisters several regions: all or none.
    pub async fn unregister_memory_batch(&self, addrs: &[u64]) -> Result<()> {
        self.inner.check_open()?;
        // A transfer that just finished may hold its lease a moment longer (a target's serving
        // task, a transport finishing a cancelled request): wait for it, up to the transfer
        // timeout, before answering Busy.
        let deadline = tokio::time::Instant::now() + self.transfer_timeout();
        loop {
            match self.unregister_local(addrs).await {
                Ok(()) => break,
                Err((_, true)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err((e, _)) => return Err(e),
            }
        }
        self.inner.publish().await
    }

    /// Blocking form of [`register_memory`](Self::register_memory).
    ///
    /// # Safety
    /// As for [`register_memory`](Self::register_memory).
    #[allow(unsafe_code)]
    pub unsafe fn register_memory_blocking(&self, addr: u64, len: u64, location: Location) -> Result<()> {
        // SAFETY: the caller's contract is this function's contract.
        self.block_on(unsafe { self.register_memory(addr, len, location) })?
    }

    /// Blocking form of [`unregister_memory`](Self::unregister_memory).
    pub fn unregister_memory_blocking(&self, addr: u64) -> Result<()> {
        self.block_on(self.unregister_memory(addr))?
    }

    /// Allocates `len` bytes of zero-filled host memory suited to this engine's transports:
    /// the first transport that allocates host memory its own way
    /// ([`Transport::allocate_host`]; the primary transport is asked first, then the others in
    /// the order they are tried) provides it — `aclrtMallocHost` memory for the `ascend`
    /// transport — else the process allocator does ([`HostAllocation::zeroed`], aligned to
    /// [`HOST_ALIGNMENT`](crate::HOST_ALIGNMENT)).
    ///
    /// The memory is not registered: register it with
    /// [`register_memory`](Self::register_memory) (location `*` lets the transports detect
    /// it). The allocation watches this engine's memory registry: while a region overlapping it
    /// is registered here, [`HostAllocation::free`] refuses with [`ErrorKind::Busy`] and
    /// dropping it leaks the memory instead of freeing it, so memory a transport may still touch
    /// is never given back. It may outlive the engine (its deallocator does not need the engine).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] for a zero `len`, [`ErrorKind::Shutdown`] after
    /// shutdown, the transport's error when its allocator fails (no fallback then: memory the
    /// transport cannot move would only fail later).
    pub async fn allocate_host_memory(&self, len: usize) -> Result<HostAllocation> {
        self.inner.check_open()?;
        if len == 0 {
            return Err(Error::invalid("cannot allocate 0 bytes of host memory"));
        }
        let transports = self.inner.transports();
        let primary = std::iter::once(&self.inner.primary);
        let others = transports.iter().filter(|t| !Arc::ptr_eq(t, &self.inner.primary));
        let mut allocated = None;
        for t in primary.chain(others) {
            if let Some(r) = t.allocate_host(len).await {
                let a = r.map_err(|e| {
                    let msg = format!(
                        "the {} transport could not allocate {len} bytes of host memory: {}",
                        t.protocol(),
                        e.message()
                    );
                    e.context(msg)
                })?;
                tracing::debug!(
                    addr = a.addr(),
                    len,
                    transport = t.protocol(),
                    origin = a.origin(),
                    "host memory allocated"
                );
                allocated = Some(a);
                break;
            }
        }
        let mut a = match allocated {
            Some(a) => a,
            None => HostAllocation::zeroed(len)?,
        };
        a.watch(self.inner.memory.clone());
        Ok(a)
    }

    /// Blocking form of [`allocate_host_memory`](Self::allocate_host_memory).
    pub fn allocate_host_memory_blocking(&self, len: usize) -> Result<HostAllocation> {
        self.block_on(self.allocate_host_memory(len))?
    }

    /// Opens the segment `name` (this engine's own name included): looks it up in the cache, or
    /// fetches its descriptor from metadata and picks the transport that serves it. A cached
    /// descriptor marked stale (its peer failed, or metadata reported a change) is refetched.
    ///
    /// Errors: [`ErrorKind::NotFound`] when it is not published; the backend's error when
    /// metadata cannot be reached; [`ErrorKind::Unsupported`] when no installed transport
    /// serves its protocol.
    pub async fn open_segment(&self, name: &str) -> Result<SegmentHandle> {
        self.inner.check_open()?;
        if name.is_empty() {
            return Err(Error::invalid("segment name is empty"));
        }
        let cached = {
            let table = self.inner.segments.read().unwrap_or_else(|p| p.into_inner());
            table.by_name.get(name).and_then(|h| table.by_handle.get(h)).cloned()
        };
        match cached {
            Some(seg) if !seg.is_stale() => Ok(seg.handle()),
            _ => Ok(self.inner.load_segment(name).await?.handle()),
        }
    }

    /// Blocking form of [`open_segment`](Self::open_segment).
    pub fn open_segment_blocking(&self, name: &str) -> Result<SegmentHandle> {
        self.block_on(self.open_segment(name))?
    }

    /// Refetches a segment's descriptor now.
    pub async fn refresh_segment(&self, handle: SegmentHandle) -> Result<()> {
        let name = self.inner.cached(handle)?.name().to_owned();
        self.inner.load_segment(&name).await.map(|_| ())
    }

    /// The opened segment behind `handle`.
    pub fn segment(&self, handle: SegmentHandle) -> Result<Arc<OpenSegment>> {
        self.inner.cached(handle)
    }

    /// The handle of an open segment numbered `raw` ([`SegmentHandle::raw`]), for bindings that
    /// pass handles as integers: [`ErrorKind::NotFound`] unless this engine has it open.
    pub fn segment_handle(&self, raw: u64) -> Result<SegmentHandle> {
        let handle = SegmentHandle::from_raw(raw);
        let table = self.inner.segments.read().unwrap_or_else(|p| p.into_inner());
        if table.by_handle.contains_key(&handle) {
            Ok(handle)
        } else {
            Err(Error::not_found(format!("segment handle {raw} is not open in this engine")))
        }
    }

    /// The id of a KV layout numbered `raw` ([`KvLayoutId::raw`]), for bindings that pass ids as
    /// integers: [`ErrorKind::NotFound`] unless this engine has it registered.
    pub fn kv_layout_id(&self, raw: u64) -> Result<KvLayoutId> {
        let id = KvLayoutId(raw);
        if self.inner.layouts.read().unwrap_or_else(|p| p.into_inner()).contains_key(&id) {
            Ok(id)
        } else {
            Err(Error::not_found(format!("KV layout {raw} is not registered with this engine")))
        }
    }

    /// Forgets an opened segment (its handle becomes invalid).
    pub fn close_segment(&self, handle: SegmentHandle) -> Result<()> {
        let mut table = self.inner.segments.write().unwrap_or_else(|p| p.into_inner());
        let seg = table
            .by_handle
            .remove(&handle)
            .ok_or_else(|| Error::not_found(format!("segment handle {} is not open", handle.raw())))?;
        table.by_name.remove(seg.name());
        Ok(())
    }

    /// Validates and starts a batch of requests.
    ///
    /// Every local range must lie in one registered region and every remote range in one buffer
    /// of the target's descriptor (a failing remote check refetches that descriptor once, since
    /// the peer may have registered more memory). When any request is invalid, nothing is
    /// started and the error names the request's index. Returns the batch to poll, await,
    /// or cancel.
    ///
    /// The caller must not run two transfers into overlapping destination ranges at the same
    /// time, nor touch a destination range until its request completed (as with any DMA engine).
    pub async fn submit(&self, requests: &[TransferRequest]) -> Result<Batch> {
        self.inner.check_open()?;
        if requests.is_empty() {
            return Err(Error::invalid("empty batch: no requests to submit"));
        }
        // Every local range in registered memory, leased (for the batch) before any segment is
        // looked up.
        let leases = self
            .inner
            .memory
            .lease_many(requests.iter().map(|r| (r.source, r.length)))
            .map_err(|(i, e)| request_error(i, e))?;

        // Distinct target segments, in first-use order (usually one).
        let mut segments: Vec<Arc<OpenSegment>> = Vec::with_capacity(1);
        let mut slot_of: Vec<u32> = Vec::with_capacity(requests.len());
        for r in requests {
            let slot = match segments.iter().position(|s| s.handle() == r.target) {
                Some(p) => p,
                None => {
                    segments.push(self.inner.segment_for_use(r.target).await?);
                    segments.len() - 1
                }
            };
            slot_of.push(slot as u32);
        }
        let mut refreshed = vec![false; segments.len()];
        'validate: loop {
            let caps: Vec<_> = segments.iter().map(|s| s.transport().capabilities()).collect();
            for (i, r) in requests.iter().enumerate() {
                let slot = slot_of[i] as usize;
                let seg = &segments[slot];
                let caps = caps[slot];
                if (r.opcode == Opcode::Read && !caps.read) || (r.opcode == Opcode::Write && !caps.write) {
                    return Err(request_error(
                        i,
                        Error::new(
                            ErrorKind::Unsupported,
                            format!("transport `{}` cannot {:?}", seg.transport().protocol(), r.opcode),
                        ),
                    ));
                }
                if let Err(e) = seg.check_remote(r.target_offset, r.length) {
                    if e.kind() == ErrorKind::OutOfBounds && !refreshed[slot] {
                        refreshed[slot] = true;
                        segments[slot] = self.inner.load_segment(seg.name()).await?;
                        continue 'validate;
                    }
                    return Err(request_error(i, e));
                }
            }
            break;
        }

        let (batch, mut all) =
            Batch::from_leases(requests, leases, segments.clone(), None).map_err(|(i, e)| request_error(i, e))?;
        if segments.len() == 1 {
            segments[0].transport().submit(&segments[0], all);
        } else {
            for (slot, seg) in segments.iter().enumerate() {
                let mine: Submission = all.take(|i, _| slot_of[i as usize] as usize == slot);
                seg.transport().submit(seg, mine);
            }
        }
        Ok(batch)
    }

    /// Blocking form of [`submit`](Self::submit).
    pub fn submit_blocking(&self, requests: &[TransferRequest]) -> Result<Batch> {
        self.block_on(self.submit(requests))?
    }

    /// Submits and waits (with the configured transfer timeout); `Ok` only when every request
    /// completed.
    pub async fn transfer(&self, requests: &[TransferRequest]) -> Result<()> {
        let batch = self.submit(requests).await?;
        let outcome = batch.wait_ok(self.transfer_timeout()).await;
        if outcome.as_ref().is_err_and(|e| e.kind() == ErrorKind::Timeout) {
            batch.cancel();
        }
        outcome
    }

    /// Blocking form of [`transfer`](Self::transfer).
    pub fn transfer_blocking(&self, requests: &[TransferRequest]) -> Result<()> {
        let batch = self.submit_blocking(requests)?;
        let outcome = batch.wait_ok_blocking(self.transfer_timeout());
        if outcome.as_ref().is_err_and(|e| e.kind() == ErrorKind::Timeout) {
            batch.cancel();
        }
        outcome
    }

    /// Registers a KV layout of local memory. Every region's bytes must lie inside one
    /// registered memory region ([`ErrorKind::OutOfBounds`] otherwise).
    pub fn register_kv_layout(&self, layout: KvLayout) -> Result<KvLayoutId> {
        self.inner.check_open()?;
        let ranges = layout.validate()?;
        for (i, (base, len)) in ranges.into_iter().enumerate() {
            self.inner.memory.lease(base, len).map_err(|e| {
                Error::new(
                    e.kind(),
                    format!("KV layout region {i} ({base:#x}+{len}) is not registered memory: {}", e.message()),
                )
            })?;
        }
        static NEXT_LAYOUT: AtomicU64 = AtomicU64::new(1);
        let id = KvLayoutId(NEXT_LAYOUT.fetch_add(1, Ordering::Relaxed));
        self.inner.layouts.write().unwrap_or_else(|p| p.into_inner()).insert(id, Arc::new(layout));
        Ok(id)
    }

    /// Forgets a KV layout.
    pub fn unregister_kv_layout(&self, id: KvLayoutId) -> Result<()> {
        self.inner
            .layouts
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id)
            .map(|_| ())
            .ok_or_else(|| Error::not_found(format!("KV layout {} is not registered", id.0)))
    }

    /// The registered layout `id`.
    pub fn kv_layout(&self, id: KvLayoutId) -> Result<Arc<KvLayout>> {
        self.inner
            .layouts
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| Error::not_found(format!("KV layout {} is not registered", id.0)))
    }

    /// Moves blocks between local layout `local` and `remote_layout` of segment `target`
    /// (the peer's layout, as it described it). Adjacent blocks are merged into one request per
    /// region; [`BlockBatch::failed_blocks`] names the local blocks that did not move.
    pub async fn submit_blocks(
        &self,
        local: KvLayoutId,
        target: SegmentHandle,
        remote_layout: &KvLayout,
        spec: &BlockTransfer<'_>,
    ) -> Result<BlockBatch> {
        let layout = self.kv_layout(local)?;
        let runs = plan_block_transfer(&layout, remote_layout, spec)?;
        let requests: Vec<TransferRequest> = runs.iter().map(|r| r.to_request(spec.opcode, target)).collect();
        let batch = self.submit(&requests).await?;
        Ok(BlockBatch { batch, runs, local_blocks: spec.local_blocks.to_vec() })
    }

    /// Blocking form of [`submit_blocks`](Self::submit_blocks).
    pub fn submit_blocks_blocking(
        &self,
        local: KvLayoutId,
        target: SegmentHandle,
        remote_layout: &KvLayout,
        spec: &BlockTransfer<'_>,
    ) -> Result<BlockBatch> {
        self.block_on(self.submit_blocks(local, target, remote_layout, spec))?
    }

    /// Sends a notification to the owner of segment `name` over the metadata backend's control
    /// channel (the P2P handshake's Notify frame, which Mooncake peers understand too).
    ///
    /// Errors: [`ErrorKind::Unsupported`] when the backend has no control channel, the
    /// backend's error (for example [`ErrorKind::PeerUnreachable`]) otherwise.
    pub async fn send_notification(&self, name: &str, message: impl Into<String>) -> Result<()> {
        self.send_notification_as(name, self.inner.name.clone(), message).await
    }

    /// [`send_notification`](Self::send_notification) with the `name` field of the
    /// notification chosen by the caller (Mooncake's `TransferNotify.name`, which its receivers
    /// see as given) instead of this engine's segment name.
    pub async fn send_notification_as(
        &self,
        segment: &str,
        sender: impl Into<String>,
        message: impl Into<String>,
    ) -> Result<()> {
        self.inner.check_open()?;
        let n = crate::Notification { name: sender.into(), notify_msg: message.into() };
        self.inner.metadata.notify(segment, &n).await
    }

    /// Submits `requests`, waits until every byte landed, then notifies the target segment of
    /// the first request with `message`: the target receives the notification only after the
    /// data. When the transfer fails no notification is sent.
    pub async fn transfer_with_notification(
        &self,
        requests: &[TransferRequest],
        message: impl Into<String>,
    ) -> Result<()> {
        let first = requests.first().ok_or_else(|| Error::invalid("empty batch: no requests to submit"))?;
        let target = self.inner.cached(first.target)?.name().to_owned();
        self.transfer(requests).await?;
        self.send_notification(&target, message).await
    }

    /// Checks that the owner of segment `name` is alive and answers on its control channel
    /// (Mooncake's `send_probe`; SGLang uses it to decide whether a failed peer may be tried
    /// again). Bounded by the backend's handshake timeout.
    pub async fn probe(&self, name: &str) -> Result<()> {
        self.inner.metadata.probe(name).await
    }

    /// Takes the notifications received so far, oldest first.
    pub fn get_notifications(&self) -> Vec<crate::Notification> {
        self.inner.metadata.drain_notifications()
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
    /// 4. its entries are removed from metadata.
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
        for key in [self.inner.keys.segment(&self.inner.name), self.inner.keys.rpc(&self.inner.name)] {
            if let Err(e) = self.inner.metadata.delete(&key).await {
                first_err.get_or_insert(e);
            }
        }
        self.inner.metadata.close().await;
        first_err.map_or(Ok(()), Err)
    }

    /// Blocking form of [`shutdown`](Self::shutdown).
    pub fn shutdown_blocking(&self) -> Result<()> {
        self.block_on(self.shutdown())?
    }
}

fn request_error(i: usize, e: Error) -> Error {
    e.context(format!("request {i}: {}; nothing was submitted", e.message()))
}

/// Reads `name`'s descriptor from `metadata`.
async fn fetch_descriptor(
    metadata: &dyn MetadataBackend,
    keys: &MetadataKeys,
    name: &str,
) -> Result<SegmentDescriptor> {
    let key = keys.segment(name);
    let bytes = metadata.get(&key).await.map_err(|e| {
        Error::new(e.kind(), format!("looking up segment `{name}` in {} metadata: {}", metadata.name(), e.message()))
            .with_source(e)
    })?;
    let bytes = bytes.ok_or_else(|| {
        Error::not_found(format!(
            "segment `{name}` is not published in the {} metadata store (key {key})",
            metadata.name()
        ))
    })?;
    SegmentDescriptor::from_json(&key, &bytes)
}

/// The engine's metadata service as a [`DescriptorSource`] for its transports.
struct MetadataDescriptors {
    metadata: Arc<dyn MetadataBackend>,
    keys: MetadataKeys,
}

#[async_trait::async_trait]
impl crate::transport::DescriptorSource for MetadataDescriptors {
    async fn fetch_descriptor(&self, name: &str) -> Result<SegmentDescriptor> {
        fetch_descriptor(self.metadata.as_ref(), &self.keys, name).await
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
            .metadata(InProcessMetadata::new() as Arc<dyn MetadataBackend>);
        b.transports_mut().install(factory.clone());
        b
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
            .metadata(InProcessMetadata::new() as Arc<dyn MetadataBackend>);
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

    #[test]
    fn timestamps_look_like_mooncakes() {
        let t = timestamp_now();
        assert_eq!(t.len(), "2026-11-30 06:21:30.151346".len(), "{t}");
        assert!(t.starts_with("20"), "{t}");
        assert_eq!(&t[4..5], "-");
        assert_eq!(&t[10..11], " ");
    }
}
