//! The HIXL backend of the `ascend` transport: Huawei's HIXL (ADXL before CANN 8.5) as
//! Mooncake's `ascend_direct` transport drives it, so Ferry and Mooncake Ascend nodes reach each
//! other.
//!
//! - **Engine.** One HIXL engine per transport, initialised on the transport's device thread
//!   (HIXL wants `aclrtSetDevice` first) as a server on `hostIp:port`. The port follows
//!   Mooncake's scheme (`utils.cpp`, `findAscendAvailablePort`): a random one of
//!   `[base + phy × 100, base + (phy + 1) × 100]`, `base` = `ASCEND_BASE_PORT` (default 20000;
//!   Mooncake's docs say 11000, its code 20000), the first that binds of up to 500 tries. The
//!   engine name is published as `rank_info.endpoints[0]` with `rank_info.hostIp`; device
//!   buffers carry `device_id` (the ACL device id, as `aclrtGetDevice` answers).
//! - **Options** (Mooncake's `transfer_executor_base.cpp`): the buffer pool off (`0:0`) unless
//!   `ASCEND_BUFFER_POOL` says otherwise; RDMA traffic class and service level from
//!   `ASCEND_RDMA_TC`/`HCCL_RDMA_TC` and `ASCEND_RDMA_SL`/`HCCL_RDMA_SL`; `LocalCommRes` from
//!   `ASCEND_LOCAL_COMM_RES`, else `{"version":"1.3"}` (client/server mode) when
//!   `GetCapability(CLIENT_SERVER_COMM)` says the library has it.
//! - **Memory.** Registered with HIXL when the engine registers it (device memory as
//!   `MEM_DEVICE`, `aclrtMallocHost` memory as `MEM_HOST`; other host memory cannot be
//!   registered, as with HCCL). HIXL does not let a link reach memory registered after it was
//!   made ("register before Connect", HIXL `Connect` constraints), so every registration makes
//!   this side's links stale: each is re-made before its next transfer. Unregistering first
//!   disconnects every link of this engine, then deregisters (Mooncake's `deregisterMem`:
//!   `disconnectAllForEngine` before `DeregisterMem`; HIXL's client/server mode refuses
//!   `DeregisterMem` while clients are connected).
//! - **Transfers.** Requests are grouped by opcode and remote engine (the endpoint indexed by
//!   the `device_id` of the remote buffer holding the address, else the first endpoint, as
//!   Mooncake 0.3.13 picks it); each group is one `Connect` (when not connected) and one
//!   `TransferSync` on one of [`WORKERS`] device threads (a remote engine always on the same
//!   one, so a peer's groups stay in order). Every call is bounded by the transfer timeout.
//!   After a failure the link is disconnected (HIXL then holds nothing of ours in flight), the
//!   peer's descriptor is read again from the metadata service and the group retried once
//!   (Mooncake's `kTransferRetryTimes`); a second failure fails the group's requests.
//!
//! Validated against Ferry's emulated HIXL (`ffi/ascend/cann-emu`) and Mooncake's NPU wheel on it;
//! never on an NPU.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_ascend_runtime::DeviceThread;
use ferry_core::{DescriptorSource, Error, ErrorKind, Opcode, OpenSegment, Result, SegmentDescriptor, Submission};
use ferry_hixl_sys::{
    FeatureType, HixlApi, HixlEngine, HixlError, HixlLibrary, MemHandle, MemType, TransferOp, TransferOpDesc,
};

use crate::counters;
use crate::pending::Pending;
use crate::{Placement, run_on};

/// Device threads that run HIXL transfers (each blocks in `TransferSync`).
pub const WORKERS: usize = 4;
/// Mooncake's default base of the HIXL listen ports (`ASCEND_BASE_PORT`).
pub const DEFAULT_BASE_PORT: u16 = 20000;
/// Mooncake's variable for [`DEFAULT_BASE_PORT`].
pub const BASE_PORT_ENV: &str = "ASCEND_BASE_PORT";
/// Mooncake's connect timeout variable (milliseconds; default [`DEFAULT_CONNECT_TIMEOUT`]).
pub const CONNECT_TIMEOUT_ENV: &str = "ASCEND_CONNECT_TIMEOUT";
/// Mooncake's default connect timeout (`transfer_executor_base.h`: 10000 ms; its docs say 3000).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Attempts per group: the first and one after a metadata refresh (Mooncake's
/// `kTransferRetryTimes = 2`).
pub const ATTEMPTS: usize = 2;
/// How long a `Disconnect` may take (Mooncake uses 1000 ms after a failed transfer).
const DISCONNECT_TIMEOUT_MS: i32 = 1000;

/// A link to one remote engine.
#[derive(Default)]
struct Link {
    /// The memory generation it was made at; `None` when not connected.
    connected_at: Option<u64>,
}

/// The HIXL side of one transport.
pub(crate) struct HixlSide {
    lib: Arc<HixlLibrary>,
    engine: Arc<HixlEngine>,
    /// This engine's name (`ip:port`), published in `rank_info.endpoints`.
    name: String,
    main: Arc<DeviceThread<()>>,
    workers: Vec<DeviceThread<()>>,
    /// HIXL registrations by region address: (length, handle).
    handles: Mutex<BTreeMap<u64, (u64, Arc<MemHandle>)>>,
    /// Bumped by every (de)registration: links made before it are stale.
    generation: AtomicU64,
    links: Mutex<HashMap<String, Arc<Mutex<Link>>>>,
    connect_timeout: Duration,
    transfer_timeout: Duration,
    descriptors: Option<Arc<dyn DescriptorSource>>,
    runtime: tokio::runtime::Handle,
}

/// What the transport needs to start the HIXL side.
pub(crate) struct HixlStart {
    pub(crate) lib: Arc<HixlLibrary>,
    pub(crate) host_ip: String,
    pub(crate) physical_device: u32,
    pub(crate) user_device: u32,
    pub(crate) transfer_timeout: Duration,
    pub(crate) descriptors: Option<Arc<dyn DescriptorSource>>,
    pub(crate) runtime: tokio::runtime::Handle,
}

fn hixl_err(context: String, e: HixlError) -> Error {
    let kind = if e.is_timeout() { ErrorKind::Timeout } else { ErrorKind::Transport };
    Error::new(kind, format!("{context}: {e}")).with_source(e)
}

/// Mooncake's engine-name form: `ip:port`, `[ipv6]:port`.
pub(crate) fn engine_name(host: &str, port: u16) -> String {
    if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

/// A random free port of `[base + phy × 100, base + (phy + 1) × 100]`, tried as Mooncake tries
/// (bind the wildcard address, up to 500 times). `None` when none binds or the range leaves
/// the port space.
pub(crate) fn pick_port(base: u16, physical: u32, ipv6: bool) -> Option<u16> {
    let low = u32::from(base) + physical.checked_mul(100)?;
    let high = low + 100;
    if high > u32::from(u16::MAX) {
        return None;
    }
    let seed = std::collections::hash_map::RandomState::new();
    for attempt in 0u32..500 {
        let r = seed.hash_one((attempt, std::process::id()));
        let port = u16::try_from(low + u32::try_from(r % 101).ok()?).ok()?;
        let bound = if ipv6 {
            std::net::TcpListener::bind((std::net::Ipv6Addr::UNSPECIFIED, port)).is_ok()
        } else {
            std::net::TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, port)).is_ok()
        };
        if bound {
            return Some(port);
        }
    }
    None
}

/// `ASCEND_BASE_PORT`, else [`DEFAULT_BASE_PORT`] (an invalid value is warned about, as
/// Mooncake does).
fn base_port() -> u16 {
    match std::env::var(BASE_PORT_ENV) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(value = %v, "{BASE_PORT_ENV} is not a port; using {DEFAULT_BASE_PORT}");
            DEFAULT_BASE_PORT
        }),
        Err(_) => DEFAULT_BASE_PORT,
    }
}

/// `ASCEND_CONNECT_TIMEOUT` (ms), else [`DEFAULT_CONNECT_TIMEOUT`].
/// An invalid value is warned about and the default used, as Mooncake does.
fn connect_timeout() -> Duration {
    let Ok(v) = std::env::var(CONNECT_TIMEOUT_ENV) else { return DEFAULT_CONNECT_TIMEOUT };
    match v.trim().parse::<u64>() {
        Ok(ms) if ms > 0 => Duration::from_millis(ms),
        _ => {
            tracing::warn!(value = %v, "{CONNECT_TIMEOUT_ENV} is not a positive number of milliseconds; using {DEFAULT_CONNECT_TIMEOUT:?}");
            DEFAULT_CONNECT_TIMEOUT
        }
    }
}

/// The options Mooncake's `ascend_direct` passes to `Initialize`, with the key spelling of the
/// loaded API (`adxl.` prefixed for `adxl::AdxlEngine`; HIXL accepts both).
fn initialize_options(lib: &HixlLibrary) -> Vec<(String, String)> {
    let prefix = if lib.api() == HixlApi::Adxl { "adxl." } else { "" };
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let mut options = vec![(format!("{prefix}BufferPool"), env("ASCEND_BUFFER_POOL").unwrap_or_else(|| "0:0".into()))];
    if let Some(tc) = env("ASCEND_RDMA_TC").or_else(|| env("HCCL_RDMA_TC")) {
        options.push((format!("{prefix}RdmaTrafficClass"), tc));
    }
    if let Some(sl) = env("ASCEND_RDMA_SL").or_else(|| env("HCCL_RDMA_SL")) {
        options.push((format!("{prefix}RdmaServiceLevel"), sl));
    }
    if let Some(res) = env("ASCEND_LOCAL_COMM_RES") {
        options.push((format!("{prefix}LocalCommRes"), res));
    } else if lib.capability(FeatureType::CLIENT_SERVER_COMM) == Some(true) {
        options.push((format!("{prefix}LocalCommRes"), r#"{"version":"1.3"}"#.into()));
    }
    options
}

/// Milliseconds left until `deadline`, at least 1 (HIXL refuses 0), at most `cap`.
fn ms_until(deadline: Instant, cap: Duration) -> i32 {
    let left = deadline.saturating_duration_since(Instant::now()).min(cap);
    i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1)
}

/// The remote engine of `remote` in `d`: the endpoint its buffer's `device_id` indexes, else
/// the first (Mooncake 0.3.13's choice, `getTargetEngineName`).
pub(crate) fn remote_engine(d: &SegmentDescriptor, remote: u64) -> Option<&str> {
    let endpoints = &d.rank_info.as_ref()?.endpoints;
    let indexed = d
        .buffers
        .iter()
        .find(|b| remote >= b.addr && remote - b.addr < b.length)
        .and_then(|b| b.device_id)
        .and_then(|id| usize::try_from(id).ok())
        .and_then(|i| endpoints.get(i));
    indexed.or_else(|| endpoints.first()).map(String::as_str)
}

impl HixlSide {
    /// Creates and initialises the engine on `main` (bound to the device), and the transfer
    /// threads.
    pub(crate) async fn start(
        s: HixlStart,
        main: Arc<DeviceThread<()>>,
        acl: &Arc<ferry_ascend_sys::Library>,
    ) -> Result<Self> {
        let ipv6 = s.host_ip.contains(':');
        let base = base_port();
        let port = pick_port(base, s.physical_device, ipv6).ok_or_else(|| {
            Error::config(format!(
                "ascend transport (HIXL): no free port in {}..={} ({BASE_PORT_ENV}={base} + physical NPU {} × 100); \
                 set {BASE_PORT_ENV} to a free range",
                u32::from(base) + s.physical_device * 100,
                u32::from(base) + s.physical_device * 100 + 100,
                s.physical_device
            ))
        })?;
        let name = engine_name(&s.host_ip, port);
        let options = initialize_options(&s.lib);
        let (lib, n, opts) = (s.lib.clone(), name.clone(), options.clone());
        let engine = run_on(&main, move |_, _| {
            let mut engine = HixlEngine::new(lib)?;
            let pairs: Vec<(&str, &str)> = opts.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            engine.initialize(&n, &pairs)?;
            Ok::<_, HixlError>(engine)
        })
        .await
        .map_err(|e| Error::transport(format!("ascend transport (HIXL): device thread: {e}")).with_source(e))?
        .map_err(|e| hixl_err(format!("ascend transport (HIXL): initialising engine {name} with {options:?}"), e))?;
        let mut workers = Vec::with_capacity(WORKERS);
        for i in 0..WORKERS {
            let user = s.user_device;
            let w = DeviceThread::spawn(acl, user, format!("ferry-hixl-{i}"), |_| Ok(())).map_err(|e| {
                Error::transport(format!("ascend transport (HIXL): starting transfer thread {i}: {e}")).with_source(e)
            })?;
            workers.push(w);
        }
        tracing::info!(engine = %name, api = %s.lib.api(), ?options, "HIXL engine initialised");
        Ok(Self {
            lib: s.lib,
            engine: Arc::new(engine),
            name,
            main,
            workers,
            handles: Mutex::new(BTreeMap::new()),
            generation: AtomicU64::new(0),
            links: Mutex::new(HashMap::new()),
            connect_timeout: connect_timeout(),
            transfer_timeout: s.transfer_timeout,
            descriptors: s.descriptors,
            runtime: s.runtime,
        })
    }

    /// This engine's name (`ip:port`).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The loaded API, for logs and `doctor`.
    pub(crate) fn api(&self) -> String {
        self.lib.to_string()
    }

    /// Registers a region with HIXL (nothing for host memory HIXL cannot register).
    pub(crate) async fn register(&self, addr: u64, len: u64, placement: Placement) -> Result<()> {
        let kind = match placement {
            Placement::Device => MemType::Device,
            Placement::PinnedHost => MemType::Host,
            Placement::UnpinnedHost => return Ok(()),
        };
        let engine = self.engine.clone();
        let (a, l) = (usize::try_from(addr), usize::try_from(len));
        let (Ok(a), Ok(l)) = (a, l) else {
            return Err(Error::invalid(format!("region {addr:#x}+{len} does not fit this platform's address space")));
        };
        let handle = run_on(&self.main, move |_, _| {
            // SAFETY: the engine registered this region, whose contract keeps it valid until it
            // is unregistered; `unregister` disconnects every link and deregisters it first.
            unsafe { engine.register_mem(a, l, kind) }
        })
        .await
        .map_err(|e| Error::transport(format!("ascend transport (HIXL): device thread: {e}")).with_source(e))?
        .map_err(|e| hixl_err(format!("ascend transport (HIXL): registering {addr:#x}+{len}"), e))?;
        self.handles.lock().unwrap_or_else(|p| p.into_inner()).insert(addr, (len, Arc::new(handle)));
        // Links made before cannot reach it (HIXL: register before Connect).
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Disconnects every link, then deregisters the region (Mooncake's order). On any failure
    /// the registration is kept (and unregistering it again tries again).
    pub(crate) async fn unregister(&self, addr: u64, len: u64) -> Result<()> {
        let Some(handle) = self.handles.lock().unwrap_or_else(|p| p.into_inner()).get(&addr).map(|(_, h)| h.clone())
        else {
            return Ok(());
        };
        self.disconnect_all().await;
        let engine = self.engine.clone();
        let done = run_on(&self.main, move |_, _| engine.deregister_mem(&handle))
            .await
            .map_err(|e| Error::transport(format!("ascend transport (HIXL): device thread: {e}")).with_source(e))?;
        match done {
            Ok(()) => {
                self.handles.lock().unwrap_or_else(|p| p.into_inner()).remove(&addr);
                self.generation.fetch_add(1, Ordering::AcqRel);
                Ok(())
            }
            Err(e) => Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "ascend transport (HIXL): deregistering {addr:#x}+{len} failed: {e}; it stays registered with \
                     HIXL and must not be freed yet (HIXL's client/server mode refuses while this engine's own links \
                     exist; unregistering again tries again)"
                ),
            )
            .with_source(e)),
        }
    }

    /// Disconnects every link of this engine (waiting for transfers on them to end first).
    async fn disconnect_all(&self) {
        let links: Vec<(String, Arc<Mutex<Link>>)> =
            self.links.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        for (name, link) in links {
            let engine = self.engine.clone();
            let job = run_on(&self.main, move |_, _| {
                let mut l = link.lock().unwrap_or_else(|p| p.into_inner());
                if l.connected_at.take().is_some()
                    && let Err(e) = engine.disconnect(&name, DISCONNECT_TIMEOUT_MS)
                    && !e.is_not_connected()
                {
                    tracing::warn!(remote = %name, error = %e, "HIXL disconnect failed");
                }
            });
            if let Err(e) = job.await {
                tracing::warn!(error = %e, "HIXL disconnect: device thread");
            }
        }
    }

    /// Queues `submission` (requests to `target`) on the transfer threads, grouped by opcode and
    /// remote engine. A request whose remote address names no engine fails at once.
    pub(crate) fn submit(self: &Arc<Self>, target: &Arc<OpenSegment>, mut submission: Submission) {
        let d = target.descriptor();
        let mut groups: BTreeMap<(bool, String), Submission> = BTreeMap::new();
        while !submission.is_empty() {
            let first = submission.indices()[0];
            let r = submission.request(first).request;
            let write = r.opcode == Opcode::Write;
            let Some(engine) = remote_engine(d, r.target_offset).map(str::to_owned) else {
                return submission.fail_all(&Error::invalid(format!(
                    "segment `{}` publishes no HIXL endpoint (rank_info.endpoints)",
                    d.name
                )));
            };
            let group = submission.take(|_, v| {
                (v.request.opcode == Opcode::Write) == write
                    && remote_engine(d, v.request.target_offset) == Some(engine.as_str())
            });
            match groups.entry((write, engine)) {
                std::collections::btree_map::Entry::Occupied(mut o) => {
                    let _ = o.get_mut().absorb(group);
                }
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(group);
                }
            }
        }
        let deadline = Instant::now() + self.transfer_timeout;
        for ((write, engine), group) in groups {
            let worker = &self.workers[shard(&engine, self.workers.len())];
            let (side, target) = (self.clone(), target.clone());
            let group = Pending::new(group);
            if let Err(e) = worker.submit(move |_, _| side.run(&target, engine, write, group, deadline)) {
                // The job was dropped with its `Pending`, which completed its requests as lost.
                tracing::error!(error = %e, "ascend transport (HIXL): a transfer thread is gone");
            }
        }
    }

    /// Runs one group on a transfer thread: connect when needed, `TransferSync`, one retry
    /// after a refresh.
    fn run(&self, target: &Arc<OpenSegment>, mut engine: String, write: bool, group: Pending, deadline: Instant) {
        let Some(group) = group.unless_cancelled() else { return };
        let descs: Vec<TransferOpDesc> = group
            .indices()
            .iter()
            .map(|&i| {
                let r = group.request(i);
                TransferOpDesc {
                    local_addr: r.source as usize,
                    remote_addr: r.target_offset as usize,
                    len: r.length as usize,
                }
            })
            .collect();
        let op = if write { TransferOp::Write } else { TransferOp::Read };
        let mut last = None;
        for attempt in 0..ATTEMPTS {
            if Instant::now() >= deadline {
                break;
            }
            match self.attempt(&engine, op, &descs, deadline) {
                Ok(()) => {
                    counters::bump(&counters::HIXL_TRANSFERS);
                    group.complete_all(&Ok(()));
                    return;
                }
                Err(e) => {
                    counters::bump(&counters::HIXL_FAILED_ATTEMPTS);
                    tracing::debug!(remote = %engine, attempt, error = %e, "HIXL transfer failed");
                    // Nothing of ours may stay in flight on a link we give up on.
                    self.drop_link(&engine);
                    last = Some(e);
                    if attempt + 1 < ATTEMPTS
                        && let Some(fresh) = self.refresh(target)
                        && let Some(first) = descs.first()
                        && let Some(name) = remote_engine(&fresh, first.remote_addr as u64)
                    {
                        engine = name.to_owned();
                    }
                }
            }
        }
        let e = last.unwrap_or_else(|| {
            Error::new(ErrorKind::Timeout, format!("HIXL transfer to {engine} not started before the transfer timeout"))
        });
        let e = Error::new(
            e.kind(),
            format!("ascend transport (HIXL): {} to `{}` ({engine}): {}", op_name(write), target.name(), e.message()),
        );
        group.complete_all(&Err(e));
    }

    fn attempt(&self, engine: &str, op: TransferOp, descs: &[TransferOpDesc], deadline: Instant) -> Result<()> {
        self.ensure_link(engine, deadline)?;
        // SAFETY: every local range lies in a region this engine registered with HIXL and
        // leased for the batch (the engine checked it; the lease keeps it registered until the
        // group completes, after this call returned and, on failure, after the link was
        // disconnected); remote ranges are the peer's to check.
        unsafe { self.engine.transfer_sync(engine, op, descs, ms_until(deadline, Duration::MAX)) }
            .map_err(|e| hixl_err(format!("TransferSync of {} request(s)", descs.len()), e))
    }

    /// Connects to `engine` unless a link made since the last (de)registration exists.
    fn ensure_link(&self, engine: &str, deadline: Instant) -> Result<()> {
        let link = self.links.lock().unwrap_or_else(|p| p.into_inner()).entry(engine.to_owned()).or_default().clone();
        let mut l = link.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.generation.load(Ordering::Acquire);
        match l.connected_at {
            Some(g) if g == now => return Ok(()),
            Some(_) => {
                l.connected_at = None;
                if let Err(e) = self.engine.disconnect(engine, DISCONNECT_TIMEOUT_MS)
                    && !e.is_not_connected()
                {
                    tracing::debug!(remote = %engine, error = %e, "HIXL disconnect of a stale link failed");
                }
            }
            None => {}
        }
        match self.engine.connect(engine, ms_until(deadline, self.connect_timeout)) {
            Ok(()) => counters::bump(&counters::HIXL_CONNECTS),
            // Ours from before (a link this side lost track of) — usable.
            Err(e) if e.is_already_connected() => {}
            Err(e) => return Err(hixl_err(format!("Connect to {engine}"), e)),
        }
        l.connected_at = Some(now);
        Ok(())
    }

    fn drop_link(&self, engine: &str) {
        let link = self.links.lock().unwrap_or_else(|p| p.into_inner()).get(engine).cloned();
        if let Some(link) = link {
            let mut l = link.lock().unwrap_or_else(|p| p.into_inner());
            l.connected_at = None;
        }
        if let Err(e) = self.engine.disconnect(engine, DISCONNECT_TIMEOUT_MS)
            && !e.is_not_connected()
        {
            tracing::debug!(remote = %engine, error = %e, "HIXL disconnect after a failure failed");
        }
    }

    /// The peer's descriptor read again (and the engine's copy marked stale), for a retry.
    fn refresh(&self, target: &Arc<OpenSegment>) -> Option<SegmentDescriptor> {
        target.mark_stale();
        let source = self.descriptors.clone()?;
        let name = target.name().to_owned();
        match self.runtime.block_on(async move { source.fetch_descriptor(&name).await }) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::debug!(segment = target.name(), error = %e, "HIXL retry: descriptor refresh failed");
                None
            }
        }
    }

    /// Disconnects everything and finalises the engine (on the device thread).
    pub(crate) async fn shutdown(&self, timeout: Duration) -> bool {
        self.disconnect_all().await;
        let engine = self.engine.clone();
        let handles: Vec<Arc<MemHandle>> = std::mem::take(&mut *self.handles.lock().unwrap_or_else(|p| p.into_inner()))
            .into_values()
            .map(|(_, h)| h)
            .collect();
        let done = run_on(&self.main, move |_, _| {
            for h in handles {
                if let Err(e) = engine.deregister_mem(&h) {
                    tracing::warn!(error = %e, "HIXL deregistration at shutdown failed");
                }
            }
        });
        let ok = matches!(tokio::time::timeout(timeout, done).await, Ok(Ok(())));
        for w in &self.workers {
            let _ = w.stop(timeout);
        }
        ok
    }
}

fn op_name(write: bool) -> &'static str {
    if write { "write" } else { "read" }
}

/// The transfer thread of remote engine `name`.
fn shard(name: &str, n: usize) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    usize::try_from(h.finish() % u64::try_from(n.max(1)).unwrap_or(1)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::{BufferDesc, RankInfo};

    fn desc(endpoints: &[&str], buffers: &[(u64, u64, Option<i64>)]) -> SegmentDescriptor {
        let mut d = SegmentDescriptor::new("peer", "ascend");
        d.rank_info =
            Some(RankInfo { endpoints: endpoints.iter().map(|s| s.to_string()).collect(), ..Default::default() });
        d.buffers = buffers
            .iter()
            .map(|&(addr, length, device_id)| BufferDesc {
                addr,
                length,
                name: "npu:0".into(),
                device_id,
                extra: Default::default(),
            })
            .collect();
        d
    }

    #[test]
    fn the_remote_engine_is_indexed_by_the_buffers_device_id_else_the_first() {
        let d = desc(
            &["10.0.0.1:20000", "10.0.0.1:20100"],
            &[(0x1000, 0x1000, Some(1)), (0x4000, 0x100, Some(7)), (0x8000, 0x10, None)],
        );
        assert_eq!(remote_engine(&d, 0x1800), Some("10.0.0.1:20100"));
        assert_eq!(remote_engine(&d, 0x4000), Some("10.0.0.1:20000"), "out of range: the first");
        assert_eq!(remote_engine(&d, 0x8000), Some("10.0.0.1:20000"), "no device_id: the first");
        assert_eq!(remote_engine(&d, 0x9_0000), Some("10.0.0.1:20000"), "no buffer: the first");
        assert_eq!(remote_engine(&desc(&[], &[]), 0), None);
    }

    #[test]
    fn engine_names_bracket_ipv6() {
        assert_eq!(engine_name("10.1.2.3", 20001), "10.1.2.3:20001");
        assert_eq!(engine_name("fe80::1", 20001), "[fe80::1]:20001");
    }

    #[test]
    fn ports_stay_in_the_devices_range() {
        for phy in [0u32, 3, 7] {
            let p = pick_port(30000, phy, false).expect("a free port");
            let low = 30000 + phy * 100;
            assert!((low..=low + 100).contains(&u32::from(p)), "{p} outside {low}..={}", low + 100);
        }
        assert_eq!(pick_port(65500, 1, false), None, "a range past 65535 is refused");
    }

    #[test]
    fn deadlines_give_hixl_at_least_one_millisecond() {
        assert_eq!(ms_until(Instant::now(), Duration::MAX), 1);
        let ms = ms_until(Instant::now() + Duration::from_secs(5), Duration::from_secs(2));
        assert!((1900..=2000).contains(&ms), "{ms}");
    }
}
