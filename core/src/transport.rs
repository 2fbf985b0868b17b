//! The [`Transport`] trait (one implementation per protocol), its factory, and the registry that
//! picks transports by protocol name at run time.

use std::sync::Arc;

use async_trait::async_trait;

use crate::batch::Submission;
use crate::config::Config;
use crate::descriptor::SegmentDescriptor;
use crate::error::{Error, Result};
use crate::host_memory::HostAllocation;
use crate::memory::{MemoryRegistry, Region};
use crate::options::{OptionSpec, OptionValue};
use crate::resolver::{Environment, ResolverChain};
use crate::segment::OpenSegment;
pub use crate::segment::PeerHandle;

/// What a transport can do (queried by the engine and by `ferry doctor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Supports [`Opcode::Read`](crate::Opcode::Read).
    pub read: bool,
    /// Supports [`Opcode::Write`](crate::Opcode::Write).
    pub write: bool,
    /// Can deliver notifications after data lands.
    pub notifications: bool,
    /// Can move host memory.
    pub host_memory: bool,
    /// Can move device (NPU/GPU) memory.
    pub device_memory: bool,
    /// Reaches other processes (false for same-process transports).
    pub cross_process: bool,
}

/// The promise a [`Transport::register_memory`] call comes with: the region's memory stays valid
/// for reads and writes by any thread (and no Rust reference into it is held while transfers
/// may touch it) until the transport's [`unregister_memory`](Transport::unregister_memory) for
/// it returned `Ok`, or its [`shutdown`](Transport::shutdown) returned. A transport may rely on
/// it to expose the region to peers meanwhile, and must stop touching it by then.
///
/// Not `Clone`: one promise per call. Only [`new`](Self::new), an `unsafe fn`, makes one.
#[derive(Debug)]
pub struct MemoryPromise(());

impl MemoryPromise {
    /// Makes the promise.
    ///
    /// # Safety
    /// The caller guarantees what the type documents for the region it passes this promise
    /// with: the engine does (its callers promised as much to
    /// [`TransferEngine::register_memory`](crate::TransferEngine::register_memory), and it
    /// unregisters a region only after every transport let go of it), and so does a plugin
    /// SDK relaying its host's registration under the plugin ABI's contract.
    #[allow(unsafe_code)]
    pub unsafe fn new() -> Self {
        Self(())
    }
}

/// What a transport is given when the engine creates it.
#[derive(Clone)]
pub struct TransportContext {
    /// This engine's segment name.
    pub segment_name: String,
    /// Unique id of this engine instance (published as `ferry_instance`).
    pub instance: String,
    /// The engine's configuration.
    pub config: Arc<Config>,
    /// The engine's local memory registry (authoritative for local bounds checks).
    pub memory: Arc<MemoryRegistry>,
    /// Runtime on which the transport may spawn tasks.
    pub runtime: tokio::runtime::Handle,
    /// Identity resolvers.
    pub resolvers: ResolverChain,
    /// Reads a peer's descriptor afresh from the metadata service (bypassing the engine's
    /// cache), for a transport that retries after a peer may have restarted or re-registered.
    /// `None` where no metadata service is at hand (tests, plugin hosts).
    pub descriptors: Option<Arc<dyn DescriptorSource>>,
}

/// Reads segment descriptors from the engine's metadata service, uncached.
#[async_trait]
pub trait DescriptorSource: Send + Sync {
    /// The descriptor `name` publishes now.
    ///
    /// # Errors
    /// The metadata service's error, or [`ErrorKind::NotFound`](crate::ErrorKind::NotFound)
    /// when the segment is not published.
    async fn fetch_descriptor(&self, name: &str) -> Result<SegmentDescriptor>;
}

impl std::fmt::Debug for TransportContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportContext")
            .field("segment_name", &self.segment_name)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

/// Moves bytes between local registered memory and a remote segment. One implementation per
/// protocol; object-safe.
///
/// # Contract
/// - The engine has already checked every request: the local range lies in a registered region
///   (the request holds a lease on it, so it cannot be unregistered meanwhile) and the remote
///   range lies in a buffer of the target's descriptor. A transport that can see the target's
///   live registry checks again against it; one that cannot relies on the peer to reject.
/// - [`submit`](Transport::submit) must not block on I/O: it queues the requests (or, for a
///   memcpy transport, finishes them) and returns. One exception: when
///   [`Submission::caller_waits`] is true, `submit` runs on the submitting thread (not a
///   runtime worker) and that thread blocks waiting for the batch as soon as `submit` returns,
///   so `submit` may do the requests' I/O itself and complete them before it returns (the TCP
///   transport does, for one request on an idle connection). It must still keep every other
///   promise below, never block past a request's deadline, and return promptly once
///   [`shutdown`](Transport::shutdown) was called. A transport that ignores the flag behaves
///   as for any other submission. It owns the [`Submission`]: it completes
///   every request with [`Submission::complete`] exactly once, within the configured transfer
///   timeout — also a request that was cancelled meanwhile, since that call is also its promise
///   to touch the request's memory no more (a failure to start is completed the same way).
///   Whatever it drops unfinished is completed as an internal error, and its memory released,
///   at the drop: a transport can therefore never leave a request pending, only release it too
///   early by dropping it while a device or socket still uses its memory — keep the submission
///   alive until then.
/// - A transport checks [`Submission::is_cancelled`] before starting each request.
///
/// # Errors
/// Outcomes use [`ErrorKind::PeerUnreachable`](crate::ErrorKind::PeerUnreachable) when the peer is
/// gone (the engine then refreshes the peer's descriptor), `Timeout`, `OutOfBounds` when the
/// peer rejects the address, and `Transport` for anything else, with the cause attached.
///
/// # Threading
/// `Send + Sync`; every method may be called concurrently from any thread.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Protocol name (`local`, `tcp`, `ascend`, ...), as written in descriptors.
    fn protocol(&self) -> &str;

    /// What this transport can do.
    fn capabilities(&self) -> Capabilities;

    /// Whether this transport can reach the segment described by `target`. The default accepts
    /// descriptors of its own protocol; a same-process transport overrides it.
    fn serves(&self, target: &SegmentDescriptor) -> bool {
        target.protocol == self.protocol()
    }

    /// Adds what peers need (ports, rank info) to this engine's descriptor before publication.
    fn publish(&self, descriptor: &mut SegmentDescriptor) {
        let _ = descriptor;
    }

    /// Called after a region is added to the engine's registry; an error rolls the
    /// registration back.
    ///
    /// Only the engine calls it: a transport may expose the region to peers (HCCL binds it for
    /// one-sided access) until `unregister_memory`, so safe code must not hand it a region
    /// whose memory its owner may free meanwhile — a copy from
    /// [`TransferEngine::memory`](crate::TransferEngine::memory), for one:
    ///
    /// ```compile_fail
    /// # async fn f(engine: &ferry_core::TransferEngine, transport: &dyn ferry_core::Transport) {
    /// let region = engine.memory().regions().remove(0);
    /// transport.register_memory(&region).await.unwrap();
    /// # }
    /// ```
    ///
    /// The call takes a [`MemoryPromise`], which only `unsafe` code makes (the engine keeps
    /// it for its callers, who made it to
    /// [`TransferEngine::register_memory`](crate::TransferEngine::register_memory)):
    ///
    /// ```compile_fail
    /// # async fn f(engine: &ferry_core::TransferEngine, transport: &dyn ferry_core::Transport) {
    /// let region = engine.memory().regions().remove(0);
    /// transport.register_memory(&region, ferry_core::MemoryPromise::new()).await.unwrap();
    /// # }
    /// ```
    async fn register_memory(&self, region: &Region, promise: MemoryPromise) -> Result<()> {
        let _ = (region, promise);
        Ok(())
    }

    /// Called after a region was removed from the engine's registry (no request holds it).
    async fn unregister_memory(&self, region: &Region) -> Result<()> {
        let _ = region;
        Ok(())
    }

    /// Allocates `len` bytes of host memory the way this transport needs them, or `None` (the
    /// default) when any host memory will do; the engine then uses its fallback
    /// ([`HostAllocation::zeroed`]). The `ascend` transport answers with `aclrtMallocHost`
    /// memory, the only host memory HCCL can register with the device.
    ///
    /// The memory must be zero-filled, at least page-aligned, and valid for reads and writes
    /// from any thread until the allocation's deallocator runs — which may be on any thread and
    /// after this transport (and its engine) shut down: the deallocator must stay able to free
    /// it then. It is not registered: the caller registers it (the engine's
    /// [`allocate_host_memory`](crate::TransferEngine::allocate_host_memory) documents how).
    async fn allocate_host(&self, len: usize) -> Option<Result<HostAllocation>> {
        let _ = len;
        None
    }

    /// Opens the peer segment `target` describes: reads what this transport needs of the
    /// descriptor and finds or creates its state for that peer (a connection pool, a
    /// communicator's peer, a plugin target). Called by the engine once per descriptor it
    /// fetched, before the first submit to it; the result rides with the open segment
    /// ([`OpenSegment::peer`]) and is replaced when the descriptor changes. An error is kept
    /// and reported to every submit to that segment. The default keeps nothing.
    async fn open(&self, target: &SegmentDescriptor) -> Result<PeerHandle> {
        let _ = target;
        Ok(Arc::new(()))
    }

    /// Starts the requests of `submission`, all addressed to `target`, and completes each (see
    /// the contract above).
    fn submit(&self, target: &Arc<OpenSegment>, submission: Submission);

    /// Stops serving; pending requests fail with [`ErrorKind::Shutdown`](crate::ErrorKind::Shutdown).
    async fn shutdown(&self) {}
}

/// Creates a transport for an engine.
#[async_trait]
pub trait TransportFactory: Send + Sync + 'static {
    /// Protocol name this factory serves.
    fn protocol(&self) -> &'static str;

    /// Other names accepted in a config (`hccl` for `ascend`).
    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }

    /// True for transports installed beside whatever protocol is configured (the same-process
    /// shortcut); they are tried before the primary transport.
    fn companion(&self) -> bool {
        false
    }

    /// The config options this transport reads beyond the core's fields, each with its
    /// environment variable, default and documentation (see [`crate::options`]). The default
    /// declares none. A config's fields that no compiled-in transport declares are reported as
    /// unknown ([`Config::undeclared_fields`], [`TransportRegistry::options`]).
    fn options(&self) -> &'static [OptionSpec] {
        &[]
    }

    /// The effective value of each of [`options`](Self::options) under `config` and `env`,
    /// read and checked as [`create`](Self::create) reads them (so an invalid value carries the
    /// error the transport would start with). The default shows each value as set, unchecked
    /// ([`OptionValue::as_set`]); a transport whose options need checks or have other sources
    /// overrides it.
    fn read_options(&self, config: &Config, env: &Environment) -> Vec<OptionValue> {
        self.options().iter().map(|spec| OptionValue::as_set(spec, config, env)).collect()
    }

    /// Creates the transport (binding listeners and the like).
    async fn create(&self, ctx: &TransportContext) -> Result<Arc<dyn Transport>>;
}

/// A place transport factories come from on demand, consulted when no installed factory serves
/// a protocol that a config or a peer's descriptor names (the plugin loader is one).
pub trait TransportSource: Send + Sync + 'static {
    /// Finds (loading it if needed) a factory for `protocol`: `Ok(None)` when this source has
    /// none, an error when it has one that cannot be used (for example a plugin of the wrong ABI
    /// version). Called again for a protocol it answered `None` for.
    fn load(&self, protocol: &str, config: &Config) -> Result<Option<Arc<dyn TransportFactory>>>;

    /// One line for error messages: what this source searched (for example the plugin
    /// directories).
    fn describe(&self, config: &Config) -> String;
}

/// Transport factories by protocol name, plus the [`TransportSource`]s that supply factories on
/// demand.
#[derive(Clone, Default)]
pub struct TransportRegistry {
    factories: Vec<Arc<dyn TransportFactory>>,
    sources: Vec<Arc<dyn TransportSource>>,
}

impl std::fmt::Debug for TransportRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportRegistry")
            .field("protocols", &self.protocols())
            .field("sources", &self.sources.len())
            .finish()
    }
}

impl TransportRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a factory; one with the same protocol replaces the earlier one.
    pub fn install(&mut self, factory: Arc<dyn TransportFactory>) {
        self.factories.retain(|f| f.protocol() != factory.protocol());
        self.factories.push(factory);
    }

    /// Builder form of [`install`](Self::install).
    pub fn with(mut self, factory: Arc<dyn TransportFactory>) -> Self {
        self.install(factory);
        self
    }

    /// Adds a source consulted, in order, for protocols no installed factory serves.
    pub fn add_source(&mut self, source: Arc<dyn TransportSource>) {
        self.sources.push(source);
    }

    /// Builder form of [`add_source`](Self::add_source).
    pub fn with_source(mut self, source: Arc<dyn TransportSource>) -> Self {
        self.add_source(source);
        self
    }

    /// Installed protocol names (aliases excluded), sorted.
    pub fn protocols(&self) -> Vec<&'static str> {
        let mut p: Vec<_> = self.factories.iter().map(|f| f.protocol()).collect();
        p.sort_unstable();
        p
    }

    /// The options every installed factory declares ([`TransportFactory::options`]), in the
    /// order of installation, each key once.
    pub fn options(&self) -> Vec<&'static OptionSpec> {
        let mut options: Vec<&'static OptionSpec> = Vec::new();
        for spec in self.factories.iter().flat_map(|f| f.options()) {
            if !options.iter().any(|o| o.key == spec.key) {
                options.push(spec);
            }
        }
        options
    }

    /// The factories installed, in the order of installation.
    pub fn factories(&self) -> impl Iterator<Item = &Arc<dyn TransportFactory>> {
        self.factories.iter()
    }

    /// The factory for `name` (a protocol or an alias, case-insensitive).
    pub fn find(&self, name: &str) -> Option<&Arc<dyn TransportFactory>> {
        self.factories.iter().find(|f| {
            f.protocol().eq_ignore_ascii_case(name) || f.aliases().iter().any(|a| a.eq_ignore_ascii_case(name))
        })
    }

    /// Factories marked [`companion`](TransportFactory::companion).
    pub fn companions(&self) -> impl Iterator<Item = &Arc<dyn TransportFactory>> {
        self.factories.iter().filter(|f| f.companion())
    }

    /// The factory for `name`: an installed one, else the first source's. `Ok(None)` when
    /// nothing serves it; an error when a source found one it cannot use.
    pub fn load(&self, name: &str, config: &Config) -> Result<Option<Arc<dyn TransportFactory>>> {
        if let Some(f) = self.find(name) {
            return Ok(Some(f.clone()));
        }
        for source in &self.sources {
            if let Some(f) = source.load(name, config)? {
                return Ok(Some(f));
            }
        }
        Ok(None)
    }

    /// What was searched for a protocol nobody serves: the installed protocols and each
    /// source's description.
    pub fn searched(&self, config: &Config) -> String {
        let installed = self.protocols();
        let mut text =
            format!("installed: {}", if installed.is_empty() { "none".to_owned() } else { installed.join(", ") });
        for source in &self.sources {
            text.push_str("; ");
            text.push_str(&source.describe(config));
        }
        text
    }

    /// The factory for the config's protocol, or a config error listing what is installed and
    /// what the sources searched.
    pub fn for_config(&self, config: &Config) -> Result<Arc<dyn TransportFactory>> {
        let name = config.protocol();
        match self.load(name, config) {
            Ok(Some(f)) => Ok(f),
            Ok(None) if crate::config::RDMA_FAMILY_PROTOCOLS.contains(&name) => Err(config.field_error(
                "protocol",
                &format!(
                    "protocol {name:?} needs an RDMA transport, which Ferry does not have yet. Mooncake runs such an \
                     engine over TCP when {force} is set: set {force}=1 to do the same here, or choose TCP \
                     explicitly with FERRY_PROTOCOL=tcp (or \"protocol\": \"tcp\"); {}",
                    self.searched(config),
                    force = crate::config::FORCE_TCP_ENV,
                ),
            )),
            Ok(None) => {
                Err(config.field_error("protocol", &format!("unknown protocol {name:?}; {}", self.searched(config))))
            }
            Err(e) => Err(e.context(format!("protocol {name:?}: {}", e.message()))),
        }
    }
}

/// Builds the error for a segment no installed transport serves.
pub(crate) fn no_transport_for(desc: &SegmentDescriptor, searched: &str) -> Error {
    Error::new(
        crate::ErrorKind::Unsupported,
        format!(
            "segment `{}` is served over protocol {:?}, which this engine cannot load ({searched})",
            desc.name, desc.protocol,
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_rdma_family_protocol_nobody_serves_names_the_two_ways_out() {
        let registry = TransportRegistry::new();
        for name in ["rdma", "efa"] {
            let cfg = Config::from_json_str(&format!(r#"{{"protocol": "{name}"}}"#), None).unwrap();
            let e = registry.for_config(&cfg).err().expect("no transport serves it");
            assert_eq!(e.kind(), crate::ErrorKind::Config);
            let m = e.message();
            assert!(m.contains(&format!("protocol \"{name}\" needs an RDMA transport")), "{m}");
            assert!(m.contains("MC_FORCE_TCP=1") && m.contains("FERRY_PROTOCOL=tcp"), "{m}");
        }
        let cfg = Config::from_json_str(r#"{"protocol": "gopher"}"#, None).unwrap();
        let e = registry.for_config(&cfg).err().expect("unknown");
        assert!(e.message().contains("unknown protocol \"gopher\""), "{e}");
    }

    const LANES: OptionSpec = OptionSpec {
        key: "widget_lanes",
        env: Some("FERRY_WIDGET_LANES"),
        env_invalid: "",
        default: "2",
        doc: "lanes",
    };
    const PORT: OptionSpec = OptionSpec { key: "widget_port", env: None, env_invalid: "", default: "0", doc: "port" };

    /// A factory that declares options (and one that declares none, as by default).
    struct Widget(&'static str, &'static [OptionSpec]);

    #[async_trait]
    impl TransportFactory for Widget {
        fn protocol(&self) -> &'static str {
            self.0
        }

        fn options(&self) -> &'static [OptionSpec] {
            self.1
        }

        async fn create(&self, _: &TransportContext) -> Result<Arc<dyn Transport>> {
            Err(Error::new(crate::ErrorKind::Unsupported, "not here"))
        }
    }

    #[test]
    fn a_registry_lists_the_options_its_factories_declare() {
        let registry = TransportRegistry::new()
            .with(Arc::new(Widget("a", &[LANES, PORT])))
            .with(Arc::new(Widget("b", &[])))
            .with(Arc::new(Widget("c", &[PORT])));
        let keys: Vec<&str> = registry.options().iter().map(|o| o.key).collect();
        assert_eq!(keys, ["widget_lanes", "widget_port"], "each key once");
        let cfg = Config::from_json_str(r#"{"widget_port": 9, "other": 1}"#, None).unwrap();
        assert_eq!(cfg.undeclared_fields(registry.options()), ["other"]);
        let env = Environment::from_pairs([("FERRY_WIDGET_LANES", "3")]);
        let a = registry.find("a").unwrap().read_options(&cfg, &env);
        let shown: Vec<_> = a.iter().map(|v| v.setting.as_ref().unwrap().as_ref().map(|s| s.value.as_str())).collect();
        assert_eq!(shown, [Some("3"), Some("9")], "the default reading shows each value as set");
        assert!(registry.find("b").unwrap().read_options(&cfg, &env).is_empty());
    }
}
