//! [`EngineBuilder`]: what an engine is built from, and building it (metadata store and
//! control channel, resolver chain, transports, first publication).

use super::*;
use crate::config::FieldSource;
use crate::options::OptionSpec;

/// Builds a [`TransferEngine`] from a config or programmatically.
#[must_use]
pub struct EngineBuilder {
    config: Config,
    transports: TransportRegistry,
    metadata_registry: MetadataRegistry,
    metadata: Option<Arc<dyn MetadataStore>>,
    control_channel: Option<Arc<dyn ControlChannel>>,
    resolvers: Option<ResolverChain>,
    resolver_registry: ResolverRegistry,
    local_rank: Option<u32>,
    services: Vec<Arc<dyn EngineService>>,
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
            control_channel: None,
            resolvers: None,
            resolver_registry: ResolverRegistry::with_builtin(),
            local_rank: None,
            services: Vec::new(),
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

    /// Sets the transfer timeout (overrides the config). Whole milliseconds, within
    /// [`TRANSFER_TIMEOUT_MS_RANGE`](crate::config::TRANSFER_TIMEOUT_MS_RANGE) (1 ms to 24 h):
    /// [`build`](Self::build) refuses another value.
    pub fn transfer_timeout(mut self, timeout: Duration) -> Self {
        self.config.transfer_timeout_ms = Some(timeout.as_millis().min(u128::from(u64::MAX)) as u64);
        self.config.set_source("transfer_timeout_ms", FieldSource::Api);
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

    /// The metadata stores the engine may connect to by config, and the control channel started
    /// beside them.
    pub fn metadata_registry(mut self, registry: MetadataRegistry) -> Self {
        self.metadata_registry = registry;
        self
    }

    /// Uses this metadata store instead of the one the config names. Its control channel is the
    /// one given with [`control_channel`](Self::control_channel), else the store's own
    /// ([`MetadataStore::control_channel`]), else none: the registry's channel is started only
    /// beside the stores it builds ([`MetadataRegistry::channel_beside`] starts it for a store
    /// built elsewhere).
    pub fn metadata(mut self, store: Arc<dyn MetadataStore>) -> Self {
        self.metadata = Some(store);
        self
    }

    /// Uses this control channel (notifications, probes, the RPC port published in the rpc
    /// entry) instead of the one the metadata store brings or the registry starts.
    pub fn control_channel(mut self, channel: Arc<dyn ControlChannel>) -> Self {
        self.control_channel = Some(channel);
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

    /// Adds a service started beside the engine once it is built (and stopped with it); the
    /// facade's builder adds its metrics endpoint this way.
    pub fn service(mut self, service: Arc<dyn EngineService>) -> Self {
        self.services.push(service);
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

    pub(super) async fn build_on(self, runtime: tokio::runtime::Handle) -> Result<TransferEngine> {
        let mut config = self.config;
        // The local rank: the API's, else FERRY_LOCAL_RANK / LOCAL_RANK, else the config's.
        match self.local_rank {
            Some(rank) => config.set_local_rank(rank),
            None => config.apply_local_rank_env(|k| std::env::var(k).ok())?,
        }
        // Everything the config alone can refute is checked before any connection is made: the
        // ranges of its fields (again: values may have been set through the API), its metadata
        // server and its protocol.
        config.validate()?;
        let server = config.metadata()?;
        let primary_factory = self.transports.for_config(&config)?;
        // Fields nothing in this engine reads are most often misspelt ones: say so, naming the
        // nearest field that would be read.
        let declared: Vec<&OptionSpec> = self
            .transports
            .options()
            .into_iter()
            .chain(primary_factory.options())
            .chain(self.metadata_registry.options())
            .collect();
        for unknown in config.unknown_field_warnings(declared) {
            tracing::warn!(field = unknown.key.as_str(), "{unknown}");
        }
        // With `base_port`, this rank's port is part of the name from here on.
        let configured_name = config.fix_segment_name()?;
        let resolvers = match self.resolvers {
            Some(chain) => chain,
            None => self.resolver_registry.build_chain(&config, &Environment::process())?,
        };
        let MetadataConnection { store, channel } = match (self.metadata, self.control_channel) {
            (Some(store), Some(channel)) => MetadataConnection { store, channel },
            (Some(store), None) => {
                let channel = store.control_channel().unwrap_or_else(|| {
                    Arc::new(NoControlChannel::new(
                        store.name(),
                        "a store given to EngineBuilder::metadata has none unless one is given with \
                         EngineBuilder::control_channel",
                    ))
                });
                MetadataConnection { store, channel }
            }
            (None, Some(channel)) => {
                MetadataConnection { store: self.metadata_registry.connect_store(&config).await?, channel }
            }
            (None, None) => self.metadata_registry.connect(&config).await?,
        };
        let name = match channel.segment_name_hint().or(configured_name) {
            Some(n) => n,
            None if server == MetadataServer::Embedded || store.name() == "embedded" => {
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
            descriptors: Some(Arc::new(MetadataDescriptors { store: store.clone(), keys: keys.clone() })),
        };
        let mut transports: Vec<Arc<dyn Transport>> = Vec::new();
        // The same-process shortcut, unless the config leaves it out (`local_transport: false`).
        if config.local_transport() {
            for factory in self.transports.companions() {
                if factory.protocol() != primary_factory.protocol() {
                    transports.push(factory.create(&ctx).await?);
                }
            }
        }
        let primary = primary_factory.create(&ctx).await?;
        transports.push(primary.clone());
        let transport_registry = self.transports;

        let metrics = EngineMetrics::new(&name);
        let inner = Arc::new(EngineInner {
            name,
            instance,
            config,
            memory,
            store,
            channel,
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
            metrics,
            services: Mutex::new(Vec::new()),
        });
        inner.refuse_live_namesake().await?;
        inner.publish().await?;
        inner.publish_rpc().await?;
        let mut tasks = vec![inner.runtime.spawn(keep_published(Arc::downgrade(&inner)))];
        if let Some(rx) = inner.store.watch(inner.keys.prefix()).await? {
            tasks.push(inner.runtime.spawn(watch_segments(Arc::downgrade(&inner), rx)));
        }
        *inner.watch_task.lock().unwrap_or_else(|p| p.into_inner()) = tasks;
        tracing::info!(
            segment = %inner.name,
            protocol = inner.primary.protocol(),
            metadata = inner.store.name(),
            control_channel = inner.channel.name(),
            "engine started"
        );
        let engine = TransferEngine { inner };
        for service in &self.services {
            match service.start(&engine).await {
                Ok(Some(guard)) => engine.inner.services.lock().unwrap_or_else(|p| p.into_inner()).push(guard),
                Ok(None) => {}
                Err(e) => {
                    let _ = engine.shutdown().await;
                    return Err(e.context(format!("starting the engine's {}: {}", service.name(), e.message())));
                }
            }
        }
        Ok(engine)
    }
}

pub(super) fn new_instance_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{:x}-{:x}-{:x}", std::process::id(), nanos, NEXT.fetch_add(1, Ordering::Relaxed))
}
