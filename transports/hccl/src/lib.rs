//! # ferry-transport-hccl
//!
//! Ferry's Ascend transport (`protocol: "ascend"`, alias `"hccl"`), over HCCL loaded at run
//! time by [`ferry_ascend_sys`] and called through [`ferry_ascend_runtime`].
//!
//! - **Identity.** At start the transport resolves this process through the engine's resolver
//!   chain plus the [`AclQueryResolver`] (`acl`: user device → physical NPU through the ACL
//!   runtime). The other Ascend links (`rank_table`, `env`, `hccn_conf`) and the transport's
//!   options (`hccl_retries`, `hccl_control_port`, the rank-table and `hccn.conf` paths) are in
//!   [`ascend_identity`] (no FFI); [`install_resolvers`] puts every Ascend link in an engine's
//!   resolver registry. It refuses to start, naming what is missing and what was resolved, when
//!   the physical NPU, the user device or the device IP is unknown: it never assumes device 0.
//!   It publishes Mooncake's `rank_info` (host IP and control port, physical and logical device,
//!   device IP and port, pid) and `device_id` on device buffers.
//! - **Control channel.** A small TCP listener (length-prefixed JSON, bounded frames, timeouts)
//!   where peers ask to build a communicator and, on the two-sided path, to send or receive;
//!   every address is checked against the live memory registry before the device touches it.
//!   A request is taken only from the host its sender's segment name (and published host IP)
//!   names; peers are limited to [`MAX_PEERS`]; a communicator epoch more than one ahead is
//!   refused. (This keeps forged names from other hosts out; there is no secret, so a process
//!   on the same host is trusted.)
//! - **One-sided path** (when the CANN release has it): each registered region is registered
//!   with `HcclRegisterGlobalMem`; per peer a two-rank v1.0 rank table is built from both
//!   identities (same order on both sides), the communicator is initialised from it, memory is
//!   bound, the communicator prepared; transfers are `HcclBatchGet`/`HcclBatchPut` calls of at
//!   most 256 descriptors followed by a stream sync with timeout. One communicator per peer,
//!   cached; after a failure it is torn down and rebuilt (both sides agree on a new epoch), and
//!   the batch retried up to `retries` times (default 2, at most [`MAX_RETRIES`]) before its
//!   requests fail with the HCCL error. An `HCCL_E_NOT_SUPPORT` answer, or a release without
//!   the symbols, selects:
//! - **Two-sided path**: root info exchanged over the control channel, then `HcclSend`/`HcclRecv`
//!   pairs driven over it.
//!
//! All ACL/HCCL calls run on device threads ([`ferry_ascend_runtime::DeviceThread`]) bound to this
//! process's device, never on async workers. A one-sided batch on a ready communicator is
//! queued by `submit`, on the caller's thread, on the peer's device thread, which runs it and
//! completes it: one thread hand-off per batch ([`Stats::handoffs`]), while a watchdog task per
//! peer reports the deadline if it passes first. The device thread polls its queue for
//! [`spin_before_sleep`](ferry_core::batch::spin_before_sleep) after each job
//! ([`DeviceThread::set_idle_poll`](ferry_ascend_runtime::DeviceThread::set_idle_poll)), so a
//! caller that submits one batch after another rarely has to wake it. When the caller waits
//! for the batch on its own thread
//! ([`Submission::caller_waits`](ferry_core::Submission::caller_waits)) and that thread has the
//! device's context current, `submit` runs the batch there instead
//! ([`DeviceThread::run_here`](ferry_ascend_runtime::DeviceThread::run_here)): no hand-off
//! ([`Stats::on_caller_thread`]). Anything else (the first batch, a rebuild, retries after a
//! failure, the two-sided path) goes through the peer's driver task, in order.
//!
//! **Memory safety after failures and timeouts.** A request's memory (and a staging buffer) is
//! handed back only once nothing queued on the stream can touch it: after a failed or
//! timed-out stream wait the stream is aborted (`aclrtStreamAbort`, when the release has it and
//! it succeeds) or else synchronized without a bound, then replaced. A timeout is reported to
//! the caller at the transfer deadline all the same (`Batch::report_outcome`); the requests are
//! released (`Batch::complete`) when the stream has drained. Without
//! `aclrtSynchronizeStreamWithTimeout`, and while draining, stream waits are bounded only by
//! HCCL's own `HCCL_EXEC_TIMEOUT` (the device thread waits; the caller does not). Unregistering
//! memory that may still be bound to a communicator (its device thread did not answer within
//! [`UNBIND_TIMEOUT`], or unbinding and destroying the communicator both failed) is an
//! [`ErrorKind::Busy`] error and the HCCL registration is kept; a shutdown that leaves device
//! threads running logs an error and counts them in [`Stats::threads_left_running`].
//!
//! Validated on Ferry's emulated CANN only (`ffi/ascend/cann-emu`), never on an NPU.

#[cfg(feature = "hixl")]
mod hixl;
mod identity;
mod peer;
mod pending;
mod server;
mod watchdog;
pub mod wire;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ferry_ascend_identity::{AscendBackend, AscendOptions};
use ferry_ascend_runtime::{AclQueries, AscendError, DeviceThread, GlobalMem, HostBuffer, MemKind, PointerKind};
use ferry_ascend_sys::{Library, SearchPath};
use ferry_core::{
    Capabilities, Config, Environment, Error, ErrorKind, HostAllocation, Location, MemoryPromise, MemoryRegistry,
    OpenSegment, OptionSpec, OptionValue, PeerHandle, RankInfo, Region, Resolution, ResolveQuery, Result,
    SegmentDescriptor, SegmentName, Submission, Transport, TransportContext, TransportFactory,
};
use tokio::sync::watch;

pub use ferry_ascend_identity as ascend_identity;
pub use ferry_ascend_identity::RETRIES_ENV;
pub use ferry_ascend_runtime as runtime;
pub use ferry_ascend_sys as sys;
pub use identity::{
    ACL_RESOLVER_NAME, AclQueryResolver, AclResolverFactory, CURRENT_DEVICE_RESOLVER_NAME, CurrentDeviceResolver,
    CurrentDeviceResolverFactory, DEFAULT_DEVICE_PORT, LocalIdentity, PairTable, PeerIdentity, RankMember, SuperPod,
    install_resolvers, resolver_registry, with_acl_link,
};

use crate::peer::Peer;
use crate::pending::Pending;

/// Protocol name.
pub const PROTOCOL: &str = "ascend";
/// Accepted alias: the direct-HCCL backend alone (unless `ascend_backend` says otherwise).
pub const ALIAS: &str = "hccl";
/// Accepted aliases asking for the HIXL backend alone: Mooncake's transport name and HIXL's.
pub const HIXL_ALIASES: [&str; 2] = ["ascend_direct", "hixl"];
#[cfg(feature = "hixl")]
pub use ferry_hixl_sys as hixl_sys;
#[cfg(feature = "hixl")]
pub use hixl::{
    ATTEMPTS as HIXL_ATTEMPTS, BASE_PORT_ENV, CONNECT_TIMEOUT_ENV, DEFAULT_BASE_PORT, DEFAULT_CONNECT_TIMEOUT,
    WORKERS as HIXL_WORKERS,
};

/// How this transport reaches one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerBackend {
    /// Through HIXL, to the engine in the peer's `rank_info.endpoints`.
    Hixl,
    /// Through direct HCCL, to the device and control channel in the peer's `rank_info`.
    Hccl,
}

impl std::fmt::Display for PeerBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeerBackend::Hixl => "HIXL",
            PeerBackend::Hccl => "direct HCCL",
        })
    }
}

/// What the transport opened for one peer segment (per descriptor).
enum OpenedPeer {
    /// Reached through HIXL (the engine name is picked per request from the descriptor).
    Hixl,
    /// Reached through direct HCCL, by this peer state.
    Hccl(Arc<Peer>),
}

/// Which backends run on this side, and why the others do not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backends {
    /// What the config (or the protocol name) asked for.
    pub asked: AscendBackend,
    /// HIXL: the API and engine name (`adxl::AdxlEngine (…/libllm_datadist.so) as ip:port`),
    /// or why it does not run.
    pub hixl: std::result::Result<String, String>,
    /// Direct HCCL: runs, or why not.
    pub hccl: std::result::Result<(), String>,
}

impl Backends {
    /// How a peer publishing `d` is reached, with the reason; an error says why it cannot be.
    /// A peer publishing HIXL endpoints goes through HIXL when it runs here (what Mooncake's
    /// `ascend_direct` nodes and Ferry nodes with HIXL publish); else one publishing Ferry's
    /// direct-HCCL fields (`deviceIp`, `hostPort`) through HCCL.
    pub fn for_peer(&self, d: &SegmentDescriptor) -> std::result::Result<(PeerBackend, String), String> {
        let Some(r) = d.rank_info.as_ref() else {
            return Err(format!("segment `{}` publishes no rank_info: it is not an Ascend segment", d.name));
        };
        let has_endpoints = !r.endpoints.is_empty();
        let has_hccl = !r.device_ip.is_empty() && r.host_port != 0;
        if has_endpoints && let Ok(h) = &self.hixl {
            return Ok((
                PeerBackend::Hixl,
                format!("it publishes HIXL endpoint(s) {:?}; HIXL runs here ({h})", r.endpoints),
            ));
        }
        if has_hccl && self.hccl.is_ok() {
            // (A peer with endpoints while HIXL runs was taken above.)
            let why_not_hixl = match &self.hixl {
                Err(why) if has_endpoints => format!("HIXL does not run here: {why}"),
                _ => "it publishes no HIXL endpoint".to_owned(),
            };
            return Ok((
                PeerBackend::Hccl,
                format!("{why_not_hixl}; it publishes deviceIp {} and hostPort {}", r.device_ip, r.host_port),
            ));
        }
        let mut why = Vec::new();
        match (&self.hixl, has_endpoints) {
            (_, false) => why.push("it publishes no HIXL endpoint (rank_info.endpoints)".to_owned()),
            (Err(e), true) => why.push(format!(
                "it publishes HIXL endpoint(s) {:?} (a Mooncake ascend_direct node or a Ferry node with HIXL), but HIXL \
                 does not run here: {e}",
                r.endpoints
            )),
            (Ok(_), true) => {}
        }
        match (&self.hccl, has_hccl) {
            (_, false) => why.push("it publishes no direct-HCCL fields (deviceIp and hostPort are empty)".to_owned()),
            (Err(e), true) => {
                why.push(format!("it publishes direct-HCCL fields, but direct HCCL does not run here: {e}"))
            }
            (Ok(()), true) => {}
        }
        Err(format!("ascend transport cannot reach segment `{}`: {}", d.name, why.join("; ")))
    }
}

impl std::fmt::Display for Backends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "asked {}; HIXL: ", self.asked)?;
        match &self.hixl {
            Ok(h) => write!(f, "on, {h}")?,
            Err(why) => write!(f, "off ({why})")?,
        }
        f.write_str("; direct HCCL: ")?;
        match &self.hccl {
            Ok(()) => f.write_str("on"),
            Err(why) => write!(f, "off ({why})"),
        }
    }
}
/// Default number of retries after a failed transfer (Mooncake's default).
pub const DEFAULT_RETRIES: u32 = 2;
/// Most retries honoured: a larger configured count is capped here (with a warning), so that a
/// failing peer cannot hold a batch for an unbounded number of rebuilds.
pub const MAX_RETRIES: u32 = 100;
/// Most peers (segments this transport sends to or is asked to serve) at once; beyond it new
/// peers are refused with an error saying so. Each peer has a driver task, a watchdog task and up
/// to two device threads.
pub const MAX_PEERS: usize = 1024;
/// How long unregistering memory waits for the peers' device threads to unbind it (all peers
/// at once) and for its deregistration.
pub const UNBIND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for each part (the control server, every peer's threads, all at
/// once, and the global memory's deregistration).
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Counters of this process's ascend transports (all engines together), for tests, benchmarks
/// and diagnostics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Batches moved by `HcclBatchGet`/`HcclBatchPut` (one per submitted group of requests).
    pub one_sided_batches: u64,
    /// Chunks (up to 256 requests) moved by `HcclSend`/`HcclRecv`.
    pub two_sided_chunks: u64,
    /// Attempts that failed (each followed by a rebuild and a retry while retries remain).
    pub failed_attempts: u64,
    /// Communicators built (both paths, this side).
    pub communicators_built: u64,
    /// Nanoseconds spent in transfer jobs on device threads (the HCCL calls and the stream
    /// wait): end-to-end time minus this is the transport's own overhead.
    pub device_ns: u64,
    /// `HcclBatchGet`/`HcclBatchPut` calls (a batch of more than 256 requests takes several).
    pub one_sided_calls: u64,
    /// Device threads still busy when their transport shut down (they end on their own once
    /// HCCL's timeouts fire); nonzero means a shutdown was not clean.
    pub threads_left_running: u64,
    /// HIXL `TransferSync` calls that succeeded (one per group of a batch).
    pub hixl_transfers: u64,
    /// HIXL attempts (connect or transfer) that failed; each is followed by a disconnect and,
    /// on the first, a descriptor refresh and one retry.
    pub hixl_failed_attempts: u64,
    /// HIXL `Connect` calls that succeeded.
    pub hixl_connects: u64,
    /// Thread hand-offs of direct-HCCL batches: each time a batch's requests, or a device job's
    /// result, pass to another of this transport's threads to go on (the caller to a peer's
    /// driver task, the driver to the device thread and the job's result back, the device
    /// thread to the driver after a failed attempt). A one-sided batch on a ready communicator
    /// takes one: the caller's thread queues it on the device thread, which completes it (that
    /// wakes the caller, if it sleeps, and is not counted).
    pub handoffs: u64,
    /// One-sided batches run to completion on their caller's thread, with no hand-off at all:
    /// the caller waits for the batch on that thread
    /// ([`Submission::caller_waits`](ferry_core::Submission::caller_waits)) and has the
    /// device's context current on it ([`DeviceThread::run_here`]).
    pub on_caller_thread: u64,
}

pub(crate) mod counters {
    use std::sync::atomic::AtomicU64;
    pub(crate) static ONE_SIDED_BATCHES: AtomicU64 = AtomicU64::new(0);
    pub(crate) static TWO_SIDED_CHUNKS: AtomicU64 = AtomicU64::new(0);
    pub(crate) static FAILED_ATTEMPTS: AtomicU64 = AtomicU64::new(0);
    pub(crate) static COMMUNICATORS_BUILT: AtomicU64 = AtomicU64::new(0);
    pub(crate) static DEVICE_NS: AtomicU64 = AtomicU64::new(0);
    pub(crate) static ONE_SIDED_CALLS: AtomicU64 = AtomicU64::new(0);
    pub(crate) static THREADS_LEFT_RUNNING: AtomicU64 = AtomicU64::new(0);
    pub(crate) static HIXL_TRANSFERS: AtomicU64 = AtomicU64::new(0);
    pub(crate) static HIXL_FAILED_ATTEMPTS: AtomicU64 = AtomicU64::new(0);
    pub(crate) static HIXL_CONNECTS: AtomicU64 = AtomicU64::new(0);
    pub(crate) static HANDOFFS: AtomicU64 = AtomicU64::new(0);
    pub(crate) static ON_CALLER_THREAD: AtomicU64 = AtomicU64::new(0);

    /// Adds the time since `start` to the device-time counter.
    pub(crate) fn device_time(start: std::time::Instant) {
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        DEVICE_NS.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn bump(c: &AtomicU64) {
        add(c, 1);
    }

    pub(crate) fn add(c: &AtomicU64, n: usize) {
        c.fetch_add(u64::try_from(n).unwrap_or(u64::MAX), std::sync::atomic::Ordering::Relaxed);
    }
}

/// The counters so far.
pub fn stats() -> Stats {
    use counters::*;
    let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    Stats {
        one_sided_batches: get(&ONE_SIDED_BATCHES),
        two_sided_chunks: get(&TWO_SIDED_CHUNKS),
        failed_attempts: get(&FAILED_ATTEMPTS),
        communicators_built: get(&COMMUNICATORS_BUILT),
        device_ns: get(&DEVICE_NS),
        one_sided_calls: get(&ONE_SIDED_CALLS),
        threads_left_running: get(&THREADS_LEFT_RUNNING),
        hixl_transfers: get(&HIXL_TRANSFERS),
        hixl_failed_attempts: get(&HIXL_FAILED_ATTEMPTS),
        hixl_connects: get(&HIXL_CONNECTS),
        handoffs: get(&HANDOFFS),
        on_caller_thread: get(&ON_CALLER_THREAD),
    }
}

/// Where the factory gets the CANN libraries.
#[derive(Clone)]
enum LibrarySource {
    Env,
    Search(SearchPath),
    Loaded(Arc<Library>),
}

/// Factory of the `ascend` transport.
#[derive(Clone)]
pub struct HcclTransportFactory {
    source: LibrarySource,
}

impl std::fmt::Debug for HcclTransportFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HcclTransportFactory").finish_non_exhaustive()
    }
}

impl Default for HcclTransportFactory {
    fn default() -> Self {
        Self::new()
    }
}

impl HcclTransportFactory {
    /// Loads CANN from the process's search path (`FERRY_ASCEND_LIB_DIR`, `ASCEND_HOME_PATH`,
    /// the install roots, the loader path) when an engine creates the transport.
    pub fn new() -> Self {
        Self { source: LibrarySource::Env }
    }

    /// Loads CANN from `search` instead.
    pub fn with_search_path(search: SearchPath) -> Self {
        Self { source: LibrarySource::Search(search) }
    }

    /// Uses an already loaded library.
    pub fn with_library(lib: Arc<Library>) -> Self {
        Self { source: LibrarySource::Loaded(lib) }
    }

    fn library(&self) -> Result<Arc<Library>> {
        let loaded = match &self.source {
            LibrarySource::Env => Library::load(),
            LibrarySource::Search(s) => Library::load_from(s),
            LibrarySource::Loaded(l) => Ok(l.clone()),
        };
        loaded.map_err(|e| Error::config(format!("ascend transport: {e}")).with_source(e))
    }
}

#[async_trait]
impl TransportFactory for HcclTransportFactory {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    fn aliases(&self) -> &'static [&'static str] {
        &[ALIAS, HIXL_ALIASES[0], HIXL_ALIASES[1]]
    }

    /// The Ascend side's options (`rank_table_path`, `hccn_conf_path`, `hccl_retries`,
    /// `hccl_control_port`, `ascend_backend`), read by this transport and the identity links it
    /// brings ([`install_resolvers`]).
    fn options(&self) -> &'static [OptionSpec] {
        ferry_ascend_identity::OPTIONS
    }

    fn read_options(&self, config: &Config, env: &Environment) -> Vec<OptionValue> {
        AscendOptions::values(config, env)
    }

    async fn create(&self, ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
        let lib = self.library()?;
        let search = match &self.source {
            LibrarySource::Env => SearchPath::from_env(),
            LibrarySource::Search(s) => s.clone(),
            LibrarySource::Loaded(l) => search_beside(l),
        };
        Ok(Arc::new(HcclTransport::start_with(ctx, lib, &search).await?))
    }
}

/// Where to look for HIXL beside an already loaded ACL: the directory it was loaded from, else
/// the process's search path.
fn search_beside(lib: &Library) -> SearchPath {
    match std::path::Path::new(&lib.paths().acl).parent() {
        Some(dir) if !dir.as_os_str().is_empty() => SearchPath::only(dir),
        _ => SearchPath::from_env(),
    }
}

/// Tunables, from the config's unknown fields and the environment.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// Per-request deadline.
    pub(crate) timeout: Duration,
    /// Retries after a failure (at most [`MAX_RETRIES`]).
    pub(crate) retries: u32,
    /// `HCCL_INTRA_ROCE_ENABLE=1`: engines on one server talk over RoCE, so host memory and
    /// device memory off a huge page may cross between them (otherwise HCCS IPC forbids both).
    pub(crate) intra_roce: bool,
}

/// Where a registered region's memory lives, as the device sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Device memory of this engine's card.
    Device,
    /// Host memory from `aclrtMallocHost`: HCCL can register it with the device.
    PinnedHost,
    /// Other host memory: HCCL's one-sided service cannot reach it (Prepare's
    /// `aclrtHostRegister` refuses it), so it is never registered with HCCL.
    UnpinnedHost,
}

impl Placement {
    /// Host memory of either kind.
    pub(crate) fn is_host(self) -> bool {
        self != Placement::Device
    }
}

/// The placement of the region of `placements` (by address, with length) holding `addr`.
pub(crate) fn placement_in(placements: &BTreeMap<u64, (u64, Placement)>, addr: u64) -> Option<Placement> {
    let (&base, &(len, kind)) = placements.range(..=addr).next_back()?;
    (addr - base < len).then_some(kind)
}

/// Alignment HCCS IPC needs of device memory two engines of one server share: a huge page
/// (HIXL's interface documentation; `ACL_MEM_MALLOC_HUGE_ONLY` memory starts on one).
pub const IPC_ALIGNMENT: u64 = 2 << 20;
/// HIXL's documented limit of communicators per card (rank table versions 1.0 and 1.2).
pub const MAX_COMMUNICATORS_PER_CARD: usize = 512;
/// HIXL's documented limit of device memory registered per card.
pub const MAX_DEVICE_REGISTERED: u64 = 50_000_000_000;
/// HIXL's documented limit of host memory registered (below HDK 25.5).
pub const MAX_HOST_REGISTERED: u64 = 20_000_000_000;
/// ADXL's wait after aborting a stream that had work in flight, before destroying the
/// communicator: enough for AICPU to finish unfolding tasks the abort cannot stop
/// (`kAicpuUnfoldGuardMs`, HIXL `src/llm_datadist/adxl/comm_channel.cc`).
pub const ABORT_GUARD: Duration = Duration::from_millis(100);

/// State shared by the transport, its peers' drivers and the control server.
pub(crate) struct Shared {
    pub(crate) lib: Arc<Library>,
    pub(crate) me: LocalIdentity,
    /// This engine's instance id (`ferry_instance`), sent to peers so they notice a restart.
    pub(crate) instance: String,
    pub(crate) control_port: u16,
    pub(crate) settings: Settings,
    pub(crate) memory: Arc<MemoryRegistry>,
    pub(crate) runtime: tokio::runtime::Handle,
    /// Registers global memory and allocates pinned host memory. Shared with every
    /// [`HostAllocation`] it made, whose deallocator frees on it: the thread (one idle OS
    /// thread bound to the device) lives until the transport and all of them are gone.
    pub(crate) main: Arc<DeviceThread<()>>,
    /// The one-sided service may be used (the release has it and it did not answer NOT_SUPPORT).
    pub(crate) one_sided: AtomicBool,
    /// Global memory handles by region address.
    pub(crate) globals: Arc<Mutex<BTreeMap<u64, Arc<GlobalMem>>>>,
    /// Every registered region's placement, by address (with its length).
    pub(crate) placements: Mutex<BTreeMap<u64, (u64, Placement)>>,
    /// Registrations of unregistered regions that may still be bound to a communicator: kept
    /// (not deregistered) until shutdown.
    pub(crate) stranded: Mutex<Vec<Arc<GlobalMem>>>,
    pub(crate) peers: Mutex<HashMap<String, Arc<Peer>>>,
    pub(crate) stop: watch::Sender<bool>,
    pub(crate) stopped: AtomicBool,
    /// The HIXL backend, when it runs.
    #[cfg(feature = "hixl")]
    pub(crate) hixl: Option<Arc<hixl::HixlSide>>,
    /// What runs and why.
    pub(crate) backends: Backends,
}

impl Shared {
    /// Whether direct HCCL runs (this side publishes its fields and reaches peers with it).
    pub(crate) fn hccl_on(&self) -> bool {
        self.backends.hccl.is_ok()
    }

    pub(crate) fn one_sided_ok(&self) -> bool {
        self.one_sided.load(Ordering::Acquire)
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// The placement of the registered region holding `addr`, if any.
    pub(crate) fn placement(&self, addr: u64) -> Option<Placement> {
        placement_in(&self.placements.lock().unwrap_or_else(|p| p.into_inner()), addr)
    }

    /// For each address, whether its registered memory is host memory as this transport placed
    /// it (`*` regions were asked of the runtime; an unknown address counts as host), under one
    /// look at the placements.
    pub(crate) fn host_flags(&self, addrs: impl IntoIterator<Item = u64>) -> Vec<bool> {
        let placements = self.placements.lock().unwrap_or_else(|p| p.into_inner());
        addrs.into_iter().map(|a| placement_in(&placements, a).is_none_or(Placement::is_host)).collect()
    }

    /// The global memory a communicator with a peer binds: device memory always; host memory
    /// only when the peer is on another server or `HCCL_INTRA_ROCE_ENABLE=1` (HCCS IPC shares
    /// device memory only).
    pub(crate) fn bindable(&self, one_server: bool) -> Vec<Arc<GlobalMem>> {
        let ipc = one_server && !self.settings.intra_roce;
        self.globals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|g| !ipc || g.kind() == MemKind::Device)
            .cloned()
            .collect()
    }

    /// The peer named `name`, created (with its driver) on first use.
    pub(crate) fn peer(self: &Arc<Self>, name: &str) -> Result<Arc<Peer>> {
        if self.is_stopped() {
            return Err(Error::new(ErrorKind::Shutdown, "ascend transport stopped"));
        }
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = peers.get(name) {
            return Ok(p.clone());
        }
        if peers.len() >= MAX_PEERS {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("ascend transport: already {MAX_PEERS} peers (the limit); `{name}` refused"),
            ));
        }
        let p = Peer::start(self, name);
        peers.insert(name.to_owned(), p.clone());
        Ok(p)
    }
}

/// The `ascend` transport of one engine.
pub struct HcclTransport {
    shared: Arc<Shared>,
    server: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for HcclTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HcclTransport").field("identity", &self.shared.me).finish_non_exhaustive()
    }
}

/// The host IP to publish as `rank_info.hostIp` (where peers reach the control channel): the
/// resolved host, else the segment name's host, else `local_hostname`'s. Never a guess: with
/// none of them the transport refuses to start (publishing loopback would make every peer on
/// another host talk to itself).
fn published_host(ctx: &TransportContext, resolution: &Resolution) -> Result<String> {
    if let Some(h) = resolution.identity.host.clone().filter(|h| !h.trim().is_empty()) {
        return Ok(h);
    }
    if let Some(h) = SegmentName::host_of(&ctx.segment_name) {
        return Ok(h);
    }
    if let Some(h) = ctx.config.local_hostname.as_deref().and_then(SegmentName::host_of) {
        return Ok(h);
    }
    Err(Error::config(format!(
        "ascend transport: cannot tell which host IP to publish as rank_info.hostIp: the segment name {:?} has no \
         host part (expected host:port) and local_hostname is {}; set local_hostname to this host's IP",
        ctx.segment_name,
        match &ctx.config.local_hostname {
            Some(h) => format!("{h:?}, which names no host"),
            None => "not set".to_owned(),
        }
    )))
}

/// What [`HcclTransport::start`] would run, without starting anything: HIXL loaded (not
/// initialised) from `search` unless `asked` excludes it, direct HCCL unless `asked` excludes
/// it or (when HIXL does not load) `device_ip_known` is false. For `ferry doctor`.
pub fn probe_backends(asked: AscendBackend, search: &SearchPath, device_ip_known: bool) -> Backends {
    #[cfg(feature = "hixl")]
    let hixl = load_hixl(asked, search).map(|lib| format!("{lib} (loaded; the engine starts with the transport)"));
    #[cfg(not(feature = "hixl"))]
    let hixl: std::result::Result<String, String> = load_hixl(asked, search).map(|never| match never {});
    let hccl = match asked {
        AscendBackend::Hixl => Err(format!("ascend_backend is {asked}")),
        _ if !device_ip_known => Err("no device IP is known for this NPU".to_owned()),
        _ => Ok(()),
    };
    Backends { asked, hixl, hccl }
}

/// HIXL loaded for `asked`, or why it is not used.
#[cfg(feature = "hixl")]
fn load_hixl(
    asked: AscendBackend,
    search: &SearchPath,
) -> std::result::Result<Arc<ferry_hixl_sys::HixlLibrary>, String> {
    if asked == AscendBackend::Hccl {
        return Err("ascend_backend is hccl".into());
    }
    ferry_hixl_sys::HixlLibrary::load(search).map_err(|e| format!("HIXL cannot be loaded: {e}"))
}

/// Without the `hixl` feature HIXL is never loaded.
#[cfg(not(feature = "hixl"))]
fn load_hixl(asked: AscendBackend, _search: &SearchPath) -> std::result::Result<std::convert::Infallible, String> {
    Err(if asked == AscendBackend::Hccl {
        "ascend_backend is hccl".into()
    } else {
        "this build of Ferry has no HIXL support (the `hixl` cargo feature is off)".into()
    })
}

/// The retry count: the configured one ([`DEFAULT_RETRIES`] when none), at most [`MAX_RETRIES`].
fn capped_retries(configured: Option<u32>) -> u32 {
    let retries = configured.unwrap_or(DEFAULT_RETRIES);
    if retries > MAX_RETRIES {
        tracing::warn!(configured = retries, limit = MAX_RETRIES, "ascend transport: retry count capped");
    }
    retries.min(MAX_RETRIES)
}

impl HcclTransport {
    /// Resolves this process's identity, starts the device thread and the control listener.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] when the physical NPU, the user device or the device IP cannot be
    /// resolved (the message shows what was resolved and from where), and the ACL error when
    /// the device cannot be bound.
    pub async fn start(ctx: &TransportContext, lib: Arc<Library>) -> Result<Self> {
        let search = search_beside(&lib);
        Self::start_with(ctx, lib, &search).await
    }

    /// [`start`](Self::start), looking for HIXL in `hixl_search`.
    ///
    /// # Errors
    /// As [`start`](Self::start); also [`ErrorKind::Config`] when HIXL is asked for alone
    /// (`ascend_backend: "hixl"`, protocol `hixl`/`ascend_direct`) and does not load or start.
    pub async fn start_with(ctx: &TransportContext, lib: Arc<Library>, hixl_search: &SearchPath) -> Result<Self> {
        // The Ascend options (`hccl_retries` and `hccl_control_port` with their variables,
        // Mooncake's retry variable first; a fixed port with `base_port` is refused).
        let options = AscendOptions::from_config(&ctx.config, &Environment::process())?;
        let asked = options.backend(ctx.config.protocol());
        let retries = capped_retries(options.hccl_retries.map(|s| s.value));
        let control_port: u16 = options.hccl_control_port.map_or(0, |s| s.value);
        let hixl_lib = load_hixl(asked, hixl_search);
        if asked == AscendBackend::Hixl
            && let Err(why) = &hixl_lib
        {
            return Err(Error::config(format!(
                "ascend transport: the HIXL backend was asked for (protocol {:?}, ascend_backend {}) but {why}",
                ctx.config.protocol(),
                asked
            )));
        }

        let chain = with_acl_link(ctx.resolvers.clone(), Arc::new(AclQueryResolver::new(lib.clone())));
        let query = ResolveQuery::local(Some(ctx.segment_name.clone()), ctx.config.local_rank);
        let resolution =
            chain.resolve(&query).await.map_err(|e| e.context(format!("ascend transport: {}", e.message())))?;
        let host = published_host(ctx, &resolution)?;
        // HIXL finds its device NICs itself: the device IP is needed only by direct HCCL.
        let mut me = LocalIdentity::from_resolution_for(&ctx.segment_name, &host, &resolution, hixl_lib.is_err())?;
        let mut hccl_state: std::result::Result<(), String> = match asked {
            AscendBackend::Hixl => Err(format!("ascend_backend is {asked}")),
            _ if me.device_ip.is_empty() => Err(format!(
                "no device IP is known for physical NPU {} (hccn.conf, hccn_tool or a rank table gives it)",
                me.physical_device
            )),
            _ => Ok(()),
        };
        if lib.is_atlas_a3() {
            // HCCL needs a v1.2 rank table with each device's super-pod ids between A3 servers
            // (HIXL reads them the same way for its own tables).
            let (l, user) = (lib.clone(), me.user_device);
            let ids = tokio::task::spawn_blocking(move || l.super_pod_ids(user))
                .await
                .map_err(|e| Error::new(ErrorKind::Internal, format!("ascend transport: {e}")))?
                .map_err(|e| {
                    Error::config(format!("ascend transport: reading the Atlas A3 super-pod ids of device {user}: {e}"))
                        .with_source(e)
                })?;
            match ids {
                Some((device_id, pod_id)) => {
                    me.super_pod = Some(SuperPod { device_id: device_id.to_string(), pod_id: pod_id.to_string() });
                }
                None => tracing::warn!(
                    "Atlas A3 without aclrtGetDeviceInfo: rank tables stay v1.0, which HCCL cannot use between servers"
                ),
            }
        }

        let main = {
            let (lib, user) = (lib.clone(), me.user_device);
            tokio::task::spawn_blocking(move || {
                DeviceThread::spawn(&lib, user, "ferry-hccl-main", move |dev| {
                    tracing::debug!(user_device = user, acl_current = ?dev.current(), "hccl main device thread bound");
                    Ok(())
                })
            })
            .await
            .map_err(|e| Error::new(ErrorKind::Internal, format!("ascend transport: {e}")))?
            .map_err(|e| {
                Error::config(format!(
                    "ascend transport: cannot bind user device {} (physical NPU {}): {e}",
                    me.user_device, me.physical_device
                ))
                .with_source(e)
            })?
        };
        let main = Arc::new(main);

        #[cfg(feature = "hixl")]
        let (hixl_side, hixl_state) = match hixl_lib {
            Ok(hlib) => {
                let start = hixl::HixlStart {
                    lib: hlib,
                    host_ip: me.host_ip.clone(),
                    physical_device: me.physical_device,
                    user_device: me.user_device,
                    transfer_timeout: ctx.config.transfer_timeout(),
                    descriptors: ctx.descriptors.clone(),
                    runtime: ctx.runtime.clone(),
                };
                match hixl::HixlSide::start(start, main.clone(), &lib).await {
                    Ok(side) => {
                        let desc = format!("{} as {}", side.api(), side.name());
                        (Some(Arc::new(side)), Ok(desc))
                    }
                    Err(e) if asked == AscendBackend::Hixl || hccl_state.is_err() => return Err(e),
                    Err(e) => {
                        tracing::warn!(error = %e, "HIXL did not start; using direct HCCL for every peer");
                        (None, Err(format!("it did not start: {e}")))
                    }
                }
            }
            Err(why) => (None, Err(why)),
        };
        #[cfg(not(feature = "hixl"))]
        let hixl_state: std::result::Result<String, String> = hixl_lib.map(|never| match never {});
        #[cfg(feature = "hixl")]
        let hixl_on = hixl_side.is_some();
        #[cfg(not(feature = "hixl"))]
        let hixl_on = false;
        if !hixl_on && hccl_state.is_err() {
            hccl_state = Ok(());
        }
        if !hixl_on && me.device_ip.is_empty() {
            // Only reachable when HIXL was expected: say what is missing now.
            LocalIdentity::from_resolution(&ctx.segment_name, &host, &resolution)?;
        }
        if let Err(why) = &hixl_state {
            tracing::info!("ascend transport: HIXL is off ({why}); direct HCCL reaches every peer");
        }
        let backends = Backends { asked, hixl: hixl_state, hccl: hccl_state };

        // The control channel listens where peers are told to reach it (the published host IP),
        // as the TCP transport's data port and the P2P handshake listener do.
        let bind_ip = options.hccl_bind_address.as_ref().map(|s| s.value).unwrap_or_else(|| {
            me.host_ip.parse().unwrap_or_else(|_| {
                tracing::info!(host = %me.host_ip, "ascend transport: the host is not an IP address: control channel on every address");
                std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
            })
        });
        let listener = tokio::net::TcpListener::bind((bind_ip, control_port)).await.map_err(|e| {
            Error::config(format!(
                "ascend transport: cannot listen on {}; set hccl_bind_address (FERRY_HCCL_BIND_ADDRESS) to one of \
                 this host's addresses, or 0.0.0.0 for all",
                std::net::SocketAddr::new(bind_ip, control_port)
            ))
            .with_source(e)
        })?;
        let control_port = listener
            .local_addr()
            .map_err(|e| Error::transport("ascend transport: no local address").with_source(e))?
            .port();
        let (stop, stop_rx) = watch::channel(false);
        let caps = lib.capabilities();
        if !caps.sync_with_timeout {
            // Documented limit: the transfer deadline is still reported to the caller on time,
            // but the device thread waits until HCCL's own HCCL_EXEC_TIMEOUT ends the work.
            tracing::warn!(
                "aclrtSynchronizeStreamWithTimeout is absent: stream waits are bounded only by HCCL_EXEC_TIMEOUT"
            );
        }
        let shared = Arc::new(Shared {
            lib,
            me,
            instance: ctx.instance.clone(),
            control_port,
            settings: Settings {
                timeout: ctx.config.transfer_timeout(),
                retries,
                intra_roce: std::env::var("HCCL_INTRA_ROCE_ENABLE").is_ok_and(|v| v.trim() == "1"),
            },
            memory: ctx.memory.clone(),
            runtime: ctx.runtime.clone(),
            main,
            one_sided: AtomicBool::new(caps.one_sided),
            globals: Arc::new(Mutex::new(BTreeMap::new())),
            placements: Mutex::new(BTreeMap::new()),
            stranded: Mutex::new(Vec::new()),
            peers: Mutex::new(HashMap::new()),
            stop,
            stopped: AtomicBool::new(false),
            #[cfg(feature = "hixl")]
            hixl: hixl_side,
            backends,
        });
        let server = ctx.runtime.spawn(server::serve(listener, shared.clone(), stop_rx));
        tracing::info!(
            segment = %shared.me.segment,
            physical_device = shared.me.physical_device,
            user_device = shared.me.user_device,
            device_ip = %shared.me.device_ip,
            control_port,
            one_sided = caps.one_sided,
            backends = %shared.backends,
            "ascend transport started\n{resolution}"
        );
        Ok(Self { shared, server: Mutex::new(Some(server)) })
    }

    /// This transport's identity.
    pub fn identity(&self) -> &LocalIdentity {
        &self.shared.me
    }

    /// Which backends run, and why the others do not.
    pub fn backends(&self) -> &Backends {
        &self.shared.backends
    }

    /// The HIXL engine name published in `rank_info.endpoints`, when HIXL runs.
    pub fn hixl_engine(&self) -> Option<String> {
        #[cfg(feature = "hixl")]
        {
            self.shared.hixl.as_ref().map(|h| h.name().to_owned())
        }
        #[cfg(not(feature = "hixl"))]
        {
            None
        }
    }

    /// The control channel port.
    pub fn control_port(&self) -> u16 {
        self.shared.control_port
    }

    /// Whether transfers use the one-sided service (else two-sided send/recv).
    pub fn one_sided(&self) -> bool {
        self.shared.one_sided_ok()
    }

    /// Where `region`'s memory lives, asked of the runtime with `aclrtPointerGetAttributes`
    /// (as Mooncake's Ascend transports do for `*`, Mooncake's default and what vllm-ascend
    /// passes): never assumed host. A region tagged `npu:N` must be device memory of this
    /// engine's card; one the runtime places elsewhere is refused, naming both.
    async fn place(&self, region: &Region) -> Result<Placement> {
        let me = &self.shared.me;
        let said_device = match region.location() {
            Location::Npu(n) if *n == me.user_device || *n == me.physical_device => true,
            Location::Npu(n) => {
                return Err(Error::invalid(format!(
                    "region {:#x}+{} is on npu:{n}, but this engine's ascend transport drives user device {} \
                     (physical NPU {}); register each device's memory with the engine of that device",
                    region.addr(),
                    region.len(),
                    me.user_device,
                    me.physical_device
                )));
            }
            Location::Cuda(_) => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("region {:#x} is CUDA memory, which the ascend transport cannot move", region.addr()),
                ));
            }
            _ => false,
        };
        let addr = region.addr();
        let kind = run_on(&self.shared.main, move |dev, _| dev.pointer_kind(addr))
            .await
            .map_err(|e| hccl_error("ascend transport: device thread".into(), e))?
            .map_err(|e| hccl_error(format!("ascend transport: asking where {addr:#x} lives"), e))?;
        Ok(match kind {
            Some(PointerKind::Device(id)) if id == me.user_device => Placement::Device,
            Some(PointerKind::Device(id)) => {
                return Err(Error::invalid(format!(
                    "region {addr:#x}+{} is device memory of user device {id}, but this engine's ascend transport \
                     drives user device {} (physical NPU {}); register it with the engine of that device",
                    region.len(),
                    me.user_device,
                    me.physical_device
                )));
            }
            Some(_) if said_device => {
                return Err(Error::invalid(format!(
                    "region {addr:#x}+{} is registered as {} but the runtime says it is host memory",
                    region.len(),
                    region.location()
                )));
            }
            Some(PointerKind::PinnedHost) => Placement::PinnedHost,
            Some(PointerKind::OtherHost) => Placement::UnpinnedHost,
            // A release without aclrtPointerGetAttributes: what the caller said.
            None if said_device => Placement::Device,
            None => Placement::PinnedHost,
        })
    }
}

/// Runs `f` on `worker` and awaits its result without blocking the async runtime.
pub(crate) async fn run_on<S: 'static, R: Send + 'static>(
    worker: &DeviceThread<S>,
    f: impl FnOnce(&ferry_ascend_runtime::Device, &mut S) -> R + Send + 'static,
) -> std::result::Result<R, AscendError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    worker.submit(move |d, s| {
        let _ = tx.send(f(d, s));
    })?;
    rx.await
        .map_err(|_| AscendError::Thread { name: worker.name().to_owned(), reason: "the job did not finish".into() })
}

/// An HCCL/ACL failure as a Ferry transport error (the HCCL text is the source).
pub(crate) fn hccl_error(context: String, e: AscendError) -> Error {
    Error::transport(format!("{context}: {e}")).with_source(e)
}

impl Drop for HcclTransport {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::Release);
        let _ = self.shared.stop.send(true);
        if let Some(h) = self.server.lock().unwrap_or_else(|p| p.into_inner()).take() {
            h.abort();
        }
    }
}

#[async_trait]
impl Transport for HcclTransport {
    fn protocol(&self) -> &str {
        PROTOCOL
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read: true,
            write: true,
            notifications: false,
            host_memory: true,
            device_memory: true,
            cross_process: true,
        }
    }

    fn publish(&self, descriptor: &mut SegmentDescriptor) {
        let me = &self.shared.me;
        #[cfg_attr(not(feature = "hixl"), allow(unused_mut))]
        let mut rank_info = if self.shared.hccl_on() {
            me.rank_info(self.shared.control_port)
        } else {
            // HIXL alone: what Mooncake's ascend_direct publishes (transfer_metadata.cpp:
            // every field, only hostIp and endpoints set; rankId and deviceType at their
            // defaults).
            RankInfo {
                rank_id: u64::from(u32::MAX),
                host_ip: me.host_ip.clone(),
                device_type: 5,
                ..RankInfo::default()
            }
        };
        #[cfg(feature = "hixl")]
        if let Some(h) = &self.shared.hixl {
            rank_info.endpoints = vec![h.name().to_owned()];
        }
        let hixl_on = !rank_info.endpoints.is_empty();
        descriptor.rank_info = Some(rank_info);
        for b in &mut descriptor.buffers {
            if self.shared.placement(b.addr) == Some(Placement::Device) {
                // With HIXL, the ACL device id as Mooncake's ascend_direct publishes it
                // (aclrtGetDevice at registration); direct HCCL alone: the physical NPU.
                b.device_id = Some(i64::from(if hixl_on { me.user_device } else { me.physical_device }));
            }
        }
    }

    async fn register_memory(&self, region: &Region, _promise: MemoryPromise) -> Result<()> {
        let placement = self.place(region).await?;
        let (addr, len) = (region.addr(), region.len());
        if placement == Placement::Device
            && addr % IPC_ALIGNMENT != 0
            && !self.shared.settings.intra_roce
            && self.shared.one_sided_ok()
            && self.shared.hccl_on()
        {
            return Err(Error::invalid(format!(
                "device region {addr:#x}+{len} does not start on a 2 MiB boundary: engines on one server share \
                 device memory over HCCS IPC, which needs huge pages. Allocate it with ACL_MEM_MALLOC_HUGE_ONLY \
                 (aclrtMalloc policy 1) and register the allocation from its start, or set \
                 HCCL_INTRA_ROCE_ENABLE=1 if engines on one server should use RoCE instead"
            )));
        }
        #[cfg(feature = "hixl")]
        if let Some(h) = &self.shared.hixl {
            h.register(addr, len, placement).await?;
        }
        self.shared.placements.lock().unwrap_or_else(|p| p.into_inner()).insert(addr, (len, placement));
        if placement == Placement::UnpinnedHost {
            tracing::warn!(
                addr,
                len,
                "host region not allocated with aclrtMallocHost: HCCL cannot register it with the device, so the \
                 ascend transport will refuse transfers that touch it (allocate it with aclrtMallocHost, as \
                 allocate_managed_buffer does, or use device memory)"
            );
            return Ok(());
        }
        if !self.shared.one_sided_ok() || !self.shared.hccl_on() {
            return Ok(());
        }
        let kind = if placement == Placement::Device { MemKind::Device } else { MemKind::Host };
        let registered = run_on(&self.shared.main, move |dev, _| {
            // SAFETY: the engine registered this region, whose contract keeps it valid until it
            // is unregistered; unregister_memory unbinds it from every communicator of this
            // engine and lets go of this engine's hold on the registration first.
            unsafe { GlobalMem::register(dev, kind, addr, len) }
        })
        .await
        .map_err(|e| hccl_error("ascend transport: device thread".into(), e))?;
        match registered {
            Ok(g) => {
                let mut globals = self.shared.globals.lock().unwrap_or_else(|p| p.into_inner());
                globals.insert(addr, g);
                let total = |k: MemKind| globals.values().filter(|g| g.kind() == k).map(|g| g.len()).sum::<u64>();
                let (device, host) = (total(MemKind::Device), total(MemKind::Host));
                if device > MAX_DEVICE_REGISTERED || host > MAX_HOST_REGISTERED {
                    tracing::warn!(
                        device,
                        host,
                        "registered memory is past HIXL's documented limits ({MAX_DEVICE_REGISTERED} bytes of device \
                         memory per card, {MAX_HOST_REGISTERED} bytes of host memory below HDK 25.5); HCCL may refuse it"
                    );
                }
                // Communicators already prepared do not see it: each is rebuilt before a
                // transfer touches it (see `peer`), never bound after its Prepare.
                Ok(())
            }
            Err(e) if e.is_not_supported() => {
                tracing::warn!(error = %e, "the one-sided HCCL service is not supported here; using two-sided send/recv");
                self.shared.one_sided.store(false, Ordering::Release);
                Ok(())
            }
            Err(e) => {
                self.shared.placements.lock().unwrap_or_else(|p| p.into_inner()).remove(&addr);
                #[cfg(feature = "hixl")]
                if let Some(h) = &self.shared.hixl
                    && let Err(undo) = h.unregister(addr, len).await
                {
                    tracing::error!(error = %undo, "undoing the HIXL registration failed");
                }
                Err(hccl_error(format!("ascend transport: registering {addr:#x}+{len} with HCCL"), e))
            }
        }
    }

    async fn unregister_memory(&self, region: &Region) -> Result<()> {
        let (addr, len) = (region.addr(), region.len());
        // HIXL first: every link disconnected, then deregistered; a refusal keeps the region
        // registered everywhere (the caller must not free it).
        #[cfg(feature = "hixl")]
        if let Some(h) = &self.shared.hixl {
            h.unregister(addr, len).await?;
        }
        // A registration an earlier unregister could not take back (it may still be bound to a
        // communicator on the device) stays until shutdown: never report it unregistered.
        if self.shared.stranded.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|g| g.addr() == addr) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "ascend transport: region {addr:#x}+{len} may still be bound to an HCCL communicator (an earlier \
                     unbind failed); it stays registered with HCCL until the transport shuts down and must not be \
                     freed before"
                ),
            ));
        }
        self.shared.placements.lock().unwrap_or_else(|p| p.into_inner()).remove(&addr);
        let g = self.shared.globals.lock().unwrap_or_else(|p| p.into_inner()).remove(&addr);
        let Some(g) = g else { return Ok(()) };
        let peers: Vec<Arc<Peer>> =
            self.shared.peers.lock().unwrap_or_else(|p| p.into_inner()).values().cloned().collect();
        // Every peer's communicator unbinds it at once (a busy peer does not hold up the others).
        let mut unbinding = tokio::task::JoinSet::new();
        for p in peers {
            unbinding.spawn(async move {
                let r = p.unbind(addr, UNBIND_TIMEOUT).await;
                (p.name().to_owned(), r)
            });
        }
        let mut still_bound = Vec::new();
        while let Some(done) = unbinding.join_next().await {
            match done {
                Ok((_, Ok(()))) => {}
                Ok((peer, Err(why))) => still_bound.push(format!("with `{peer}`: {why}")),
                Err(e) => still_bound.push(format!("an unbinding task failed: {e}")),
            }
        }
        if !still_bound.is_empty() {
            // Deregistering memory a communicator may still reach would let HCCL touch memory
            // the application is about to free: keep the registration (it is deregistered when
            // the last communicator holding it is torn down) and say so.
            let msg = format!(
                "ascend transport: region {addr:#x}+{len} may still be bound to HCCL communicator(s) ({}); it stays \
                 registered with HCCL and must not be freed yet",
                still_bound.join("; ")
            );
            tracing::error!("{msg}");
            self.shared.stranded.lock().unwrap_or_else(|p| p.into_inner()).push(g);
            return Err(Error::new(ErrorKind::Busy, msg));
        }
        // No communicator of this engine holds it any more. Another engine of this process may
        // share the registration (same range): then it is deregistered when that one lets go.
        // Otherwise it is deregistered on the device thread.
        let dereg = run_on(&self.shared.main, move |_, _| match Arc::try_unwrap(g) {
            Ok(g) => g.deregister().map_err(|e| e.to_string()),
            Err(shared) => {
                tracing::debug!(addr, holders = shared.holders() - 1, "another engine shares this HCCL registration");
                Ok(())
            }
        });
        let failed = match tokio::time::timeout(UNBIND_TIMEOUT, dereg).await {
            Ok(Ok(Ok(()))) => return Ok(()),
            Ok(Ok(Err(why))) => why,
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("the device thread did not deregister it within {UNBIND_TIMEOUT:?}"),
        };
        let msg = format!("ascend transport: deregistering region {addr:#x}+{len} from HCCL failed: {failed}");
        tracing::error!("{msg}");
        Err(Error::transport(msg))
    }

    /// `aclrtMallocHost` memory, zero-filled, allocated on the `main` device thread (ACL keeps
    /// its context per thread: that thread is bound to this engine's device). Its deallocator
    /// hands the `aclrtFreeHost` back to that thread, which it keeps alive, so the memory may
    /// outlive this transport and its engine; if the thread is gone anyway, the buffer is freed
    /// on the caller's thread. `None` (the engine's fallback) on a CANN release without
    /// `aclrtMallocHost`.
    async fn allocate_host(&self, len: usize) -> Option<Result<HostAllocation>> {
        let main = self.shared.main.clone();
        let allocated = run_on(&main, move |dev, _| {
            let mut buf = dev.alloc_host(len)?;
            // CANN does not promise zeroed memory; callers (Mooncake's managed buffers) expect it.
            buf.as_mut_slice().fill(0);
            Ok::<HostBuffer, AscendError>(buf)
        })
        .await;
        let buf = match allocated {
            Ok(Ok(buf)) => buf,
            Ok(Err(AscendError::Unavailable { symbol, .. })) => {
                tracing::warn!(symbol, "this CANN release cannot allocate pinned host memory; using plain host memory");
                return None;
            }
            Ok(Err(e)) => return Some(Err(hccl_error(format!("ascend transport: aclrtMallocHost of {len} bytes"), e))),
            Err(e) => return Some(Err(hccl_error("ascend transport: device thread".into(), e))),
        };
        let (addr, len) = (buf.addr(), buf.len());
        let free = move || {
            // A job that cannot be queued is dropped here with the buffer: freed on this thread.
            if let Err(e) = main.submit(move |_, _| drop(buf)) {
                tracing::debug!(addr, error = %e, "aclrtFreeHost on the caller's thread: the device thread is gone");
            }
        };
        // SAFETY: `buf` is a fresh `aclrtMallocHost` allocation of `len` bytes, zero-filled above,
        // host memory valid from any thread; only the deallocator (which owns it) frees it.
        Some(Ok(unsafe { HostAllocation::new(addr, len, "aclrtMallocHost", free) }))
    }

    /// Decides, once per descriptor, which backend reaches the peer (logged with why), and for
    /// direct HCCL finds or starts its peer state.
    async fn open(&self, target: &SegmentDescriptor) -> Result<PeerHandle> {
        if self.shared.is_stopped() {
            return Err(Error::new(ErrorKind::Shutdown, "ascend transport stopped"));
        }
        let (backend, why) = self.shared.backends.for_peer(target).map_err(Error::invalid)?;
        tracing::info!(segment = %target.name, %backend, "ascend transport: peer reached via {backend}: {why}");
        Ok(Arc::new(match backend {
            PeerBackend::Hixl => OpenedPeer::Hixl,
            PeerBackend::Hccl => OpenedPeer::Hccl(self.shared.peer(&target.name)?),
        }))
    }

    fn submit(&self, target: &Arc<OpenSegment>, submission: Submission) {
        let opened = match target.peer::<OpenedPeer>() {
            Ok(p) => p,
            Err(e) => return submission.fail_all(&e),
        };
        if self.shared.is_stopped() {
            return submission.fail_all(&Error::new(ErrorKind::Shutdown, "ascend transport stopped"));
        }
        match opened {
            #[cfg(feature = "hixl")]
            OpenedPeer::Hixl => match &self.shared.hixl {
                Some(h) => h.submit(target, submission),
                None => submission.fail_all(&Error::new(ErrorKind::Internal, "HIXL peer without HIXL")),
            },
            #[cfg(not(feature = "hixl"))]
            OpenedPeer::Hixl => submission.fail_all(&Error::new(ErrorKind::Internal, "HIXL peer without HIXL")),
            OpenedPeer::Hccl(peer) => peer.enqueue(&self.shared, target.clone(), Pending::new(submission)),
        }
    }

    async fn shutdown(&self) {
        self.shared.stopped.store(true, Ordering::Release);
        let _ = self.shared.stop.send(true);
        let server = self.server.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut h) = server
            && tokio::time::timeout(SHUTDOWN_TIMEOUT, &mut h).await.is_err()
        {
            tracing::error!("ascend transport: the control server did not stop within {SHUTDOWN_TIMEOUT:?}; aborted");
            h.abort();
        }
        #[cfg(feature = "hixl")]
        let hixl_clean = match &self.shared.hixl {
            Some(h) => h.shutdown(SHUTDOWN_TIMEOUT).await,
            None => true,
        };
        #[cfg(not(feature = "hixl"))]
        let hixl_clean = true;
        let peers: Vec<Arc<Peer>> =
            self.shared.peers.lock().unwrap_or_else(|p| p.into_inner()).drain().map(|(_, p)| p).collect();
        // All peers at once: each waits up to SHUTDOWN_TIMEOUT for its threads.
        let mut stopping = tokio::task::JoinSet::new();
        for p in peers {
            stopping.spawn(async move { p.shutdown(SHUTDOWN_TIMEOUT).await });
        }
        let mut busy = usize::from(!hixl_clean);
        while let Some(done) = stopping.join_next().await {
            busy += done.unwrap_or(1);
        }
        let mut globals: Vec<Arc<GlobalMem>> =
            std::mem::take(&mut *self.shared.globals.lock().unwrap_or_else(|p| p.into_inner())).into_values().collect();
        globals.append(&mut self.shared.stranded.lock().unwrap_or_else(|p| p.into_inner()));
        let dereg = run_on(&self.shared.main, move |_, _| drop(globals));
        let main_done = matches!(tokio::time::timeout(SHUTDOWN_TIMEOUT, dereg).await, Ok(Ok(())));
        if !main_done {
            busy += 1;
        }
        if busy > 0 {
            counters::add(&counters::THREADS_LEFT_RUNNING, busy);
            tracing::error!(
                threads = busy,
                "ascend transport: shut down uncleanly: device thread(s) were still busy after {SHUTDOWN_TIMEOUT:?} (they \
                 end once HCCL's own timeouts fire; memory they use must stay allocated until the process exits)"
            );
        } else {
            tracing::debug!("ascend transport shut down");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_capped() {
        assert_eq!(capped_retries(None), DEFAULT_RETRIES);
        assert_eq!(capped_retries(Some(0)), 0);
        assert_eq!(capped_retries(Some(7)), 7);
        assert_eq!(capped_retries(Some(u32::MAX)), MAX_RETRIES);
    }
}
