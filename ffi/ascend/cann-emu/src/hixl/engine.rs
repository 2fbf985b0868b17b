//! One emulated HIXL engine: its registrations, its server (a real TCP listener on the engine's
//! `ip:port`), its links to other engines and its asynchronous requests.
//!
//! Every rule cites the HIXL source it follows (`hicann/hixl` at 9ed283b2; paths relative to
//! that repository) or says that it is an inference. `docs/ascend.md` ("What the emulated HIXL
//! enforces, and its sources") lists them all.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::abi::{MemDesc, TransferOpDesc};
use super::options::{self, Mode, Options};
use super::wire as hw;
use crate::boundary::{debug, lock};
use crate::codes::*;
use crate::device;
use crate::memory::{self, Allocation, MemKind};

/// `MemType::MEM_DEVICE`.
pub(crate) const MEM_DEVICE: i32 = 0;
/// `MemType::MEM_HOST`.
pub(crate) const MEM_HOST: i32 = 1;
/// `TransferOp::READ`.
pub(crate) const OP_READ: i32 = 0;
/// `TransferOp::WRITE`.
pub(crate) const OP_WRITE: i32 = 1;

/// The legacy engine's link limit: `kDefaultMaxChannel = 512` (`src/llm_datadist/adxl/adxl_utils.h`
/// l.40), counted over client and server channels (`channel_msg_handler.cc` l.735-739).
pub const DEFAULT_MAX_LINKS: usize = 512;

/// How long an asynchronous transfer may run at most (the caller enforces its own timeout,
/// HIXL `docs/zh/api/cpp/HIXL-interface.md` "GetTransferStatus"; this bound only keeps a thread
/// from waiting forever on a peer that never answers; an emulator choice, HCCL's default
/// `HCCL_EXEC_TIMEOUT` of 1800 s).
const ASYNC_LIMIT: Duration = Duration::from_secs(1800);

/// The legacy engine's link limit: `FERRY_CANN_EMU_HIXL_MAX_LINKS`, else 512.
/// Read once per process, like the emulator's other variables.
pub(crate) fn max_links() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("FERRY_CANN_EMU_HIXL_MAX_LINKS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(DEFAULT_MAX_LINKS)
    })
}

/// A registered range.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) handle: u64,
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) mem_type: i32,
    /// `hixl::MemDesc::local_only`: never offered to a peer.
    pub(crate) local_only: bool,
    /// Keeps the bytes alive while registered (and while a transfer uses them), so the emulator
    /// never touches freed memory even if the caller frees registered memory.
    _keep: Arc<Allocation>,
}

impl Region {
    fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|e| e <= self.addr + self.len)
    }
}

/// A remote range a link may access (the server's registrations when the link was made).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RemoteRegion {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) mem_type: u8,
}

impl RemoteRegion {
    fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|e| e <= self.addr + self.len)
    }
}

/// What the server side of an engine shares with its connection threads.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) mode: Mode,
    pub(crate) regions: Mutex<Vec<Arc<Region>>>,
    /// Accepted links (their sockets, to shut them down at Finalize).
    pub(crate) incoming: Mutex<HashMap<u64, TcpStream>>,
    /// Outgoing links (mirrors `Engine::links.len()`, for the link limit).
    pub(crate) outgoing: std::sync::atomic::AtomicUsize,
    pub(crate) closed: AtomicBool,
    pub(crate) max_links: usize,
}

impl Shared {
    /// Client plus server links (`channel_msg_handler.cc` l.735-739).
    pub(crate) fn link_count(&self) -> usize {
        lock(&self.incoming).len() + self.outgoing.load(Ordering::Acquire)
    }
}

/// One link to a remote engine (a client channel).
#[derive(Debug)]
pub(crate) struct Link {
    remote: String,
    stream: Mutex<TcpStream>,
    /// A second handle on the socket, to shut it down while a transfer holds `stream`.
    ctl: TcpStream,
    /// The server's remotely accessible registrations when the link was made.
    remote_regions: Vec<RemoteRegion>,
    /// CS mode: this engine's registrations when the link was made (the client hands its memory
    /// list to the new client, `hixl_engine.cc` l.415-420; `hixl_mem_store.cc` l.259-278 checks
    /// local addresses against it).
    local_snapshot: Option<Vec<Arc<Region>>>,
    broken: AtomicBool,
}

impl Link {
    /// Closes the socket (a transfer running on it fails, as on a dropped link).
    fn shutdown(&self) {
        let _ = self.ctl.shutdown(std::net::Shutdown::Both);
    }
}

/// State of an asynchronous request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReqState {
    Waiting,
    Completed,
    Failed,
}

#[derive(Debug)]
struct Request {
    state: Mutex<ReqState>,
    done: Condvar,
}

/// An initialised engine.
#[derive(Debug)]
pub(crate) struct Engine {
    pub(crate) name: String,
    pub(crate) opts: Options,
    /// The user device current at Initialize (device memory must belong to it).
    device: u32,
    shared: Arc<Shared>,
    server: Mutex<Option<(TcpListener, std::thread::JoinHandle<()>)>>,
    links: Mutex<HashMap<String, Arc<Link>>>,
    /// Serialises link creation (`adxl_inner_engine.cc` l.434-447 `connection_mutex_`).
    connecting: Mutex<()>,
    requests: Mutex<HashMap<u64, Arc<Request>>>,
    finalized: AtomicBool,
}

fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Memory handles are tagged numbers, never pointers (like the emulator's other handles).
fn new_mem_handle() -> u64 {
    0x4d48_0000_0000 | next_id()
}

impl Engine {
    /// `Initialize(local_engine, options)`.
    pub(crate) fn initialize(name: &str, pairs: &[(String, String)]) -> EmuResult<Arc<Engine>> {
        let opts = options::parse(pairs)?;
        // The legacy engine reads the calling thread's device first and passes ACL's error
        // through (`adxl_inner_engine.cc` l.172-173, `adxl_checker.h` l.99-108,
        // `adxl_utils.cc` l.38-48): without aclrtSetDevice that is ACL_ERROR_RT_CONTEXT_NULL
        // (107002). The CS engine's endpoint generation needs the device too (an inference).
        let ctx = device::current()?;
        let (ip, port) = options::parse_engine_name(name)?;
        let shared = Arc::new(Shared {
            name: name.to_string(),
            mode: opts.mode,
            regions: Mutex::new(Vec::new()),
            incoming: Mutex::new(HashMap::new()),
            outgoing: std::sync::atomic::AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            max_links: max_links(),
        });
        // A port > 0 makes the engine a server listening on ip:port (HIXL-interface.md
        // "Initialize"; `channel_msg_handler.cc` l.191-195; a bind failure is FAILED,
        // `ctrl_msg_plugin.cc` l.176).
        let server = if port > 0 {
            let addr = SocketAddr::new(ip, port as u16);
            let listener = TcpListener::bind(addr)
                .map_err(|e| hixl_err(HIXL_FAILED, format!("{name}: cannot listen on {addr}: {e}")))?;
            let clone = listener.try_clone().map_err(|e| hixl_err(HIXL_FAILED, format!("{name}: {e}")))?;
            let sh = Arc::clone(&shared);
            let t = std::thread::Builder::new()
                .name("hixl-emu-server".into())
                .spawn(move || super::server::accept_loop(sh, clone))
                .map_err(|e| hixl_err(HIXL_FAILED, format!("{name}: cannot start the server thread: {e}")))?;
            Some((listener, t))
        } else {
            None
        };
        debug(|| format!("hixl engine {name}: {:?}, server {}", opts, server.is_some()));
        Ok(Arc::new(Engine {
            name: name.to_string(),
            opts,
            device: ctx.user_id,
            shared,
            server: Mutex::new(server),
            links: Mutex::new(HashMap::new()),
            connecting: Mutex::new(()),
            requests: Mutex::new(HashMap::new()),
            finalized: AtomicBool::new(false),
        }))
    }

    /// `Finalize`: stops the server, drops every link, forgets the registrations. Idempotent.
    pub(crate) fn finalize(&self) {
        if self.finalized.swap(true, Ordering::AcqRel) {
            return;
        }
        self.shared.closed.store(true, Ordering::Release);
        if let Some((listener, t)) = lock(&self.server).take() {
            // SAFETY: shutdown(2) on the listener's own descriptor, alive for the call; it makes
            // the blocked accept() return.
            unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RDWR) };
            let _ = t.join();
        }
        for (_, s) in lock(&self.shared.incoming).drain() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let links: Vec<Arc<Link>> = lock(&self.links).drain().map(|(_, l)| l).collect();
        self.shared.outgoing.store(0, Ordering::Release);
        for l in links {
            l.broken.store(true, Ordering::Release);
            l.shutdown();
        }
        lock(&self.shared.regions).clear();
    }

    fn check_alive(&self) -> EmuResult<()> {
        if self.finalized.load(Ordering::Acquire) {
            return Err(hixl_err(HIXL_FAILED, format!("{}: the engine was finalized", self.name)));
        }
        Ok(())
    }

    /// `RegisterMem`.
    pub(crate) fn register(&self, desc: &MemDesc, mem_type: i32, hixl_api: bool) -> EmuResult<u64> {
        self.check_alive()?;
        let (addr, len) = (desc.addr, desc.len);
        // A null address is PARAM_INVALID (`adxl_engine_impl.cc` l.122, `hixl_impl.cc` l.115);
        // a range that wraps is PARAM_INVALID (`channel_msg_handler.cc` l.225-227,
        // `hixl_server.cc` l.106-107).
        if addr == 0 {
            return Err(hixl_err(HIXL_PARAM_INVALID, "mem.addr can not be null"));
        }
        // A zero size: HCCL's registration refuses it (HCCL_E_PARA, docs/ascend.md "What the
        // emulated CANN enforces" rule 2), which HIXL maps to PARAM_INVALID (`adxl_utils.cc`
        // l.24-36).
        if len == 0 {
            return Err(hixl_err(HIXL_PARAM_INVALID, format!("mem.len is 0 (addr {addr:#x})")));
        }
        let Some(_end) = addr.checked_add(len) else {
            return Err(hixl_err(HIXL_PARAM_INVALID, format!("mem range overflow, addr:{addr:#x}, len:{len}")));
        };
        if mem_type != MEM_DEVICE && mem_type != MEM_HOST {
            // HCCL refuses an unknown CommMem type (HCCL_E_PARA → PARAM_INVALID,
            // `adxl_utils.cc` l.24-36); an inference for the CS engine.
            return Err(hixl_err(HIXL_PARAM_INVALID, format!("unknown MemType {mem_type}")));
        }
        // Device memory must be emulated device memory of this engine's device; host memory
        // must come from aclrtMallocHost (HIXL-interface.md RegisterMem: "Host内存需通过
        // aclrtMallocHost申请"). HCCL fails to map anything else; HIXL maps an HCCL failure other
        // than PARA/TIMEOUT/NOT_SUPPORT to FAILED (`adxl_utils.cc` l.24-36). That the check
        // happens at RegisterMem, not at the first link, is an emulator choice.
        let found = memory::find(addr, len.max(1));
        let keep = match (mem_type, found) {
            (MEM_DEVICE, Some(a)) if matches!(a.kind, MemKind::Device { user_id, .. } if user_id == self.device) => a,
            (MEM_DEVICE, Some(a)) if matches!(a.kind, MemKind::Device { .. }) => {
                return Err(hixl_err(
                    HIXL_FAILED,
                    format!(
                        "{addr:#x}..+{len} is device memory of another device (the engine runs on device {})",
                        self.device
                    ),
                ));
            }
            (MEM_DEVICE, _) => {
                return Err(hixl_err(
                    HIXL_FAILED,
                    format!("{addr:#x}..+{len} was registered as MEM_DEVICE but is not (emulated) device memory"),
                ));
            }
            (_, Some(a)) if a.kind == MemKind::Host => a,
            (_, _) => {
                return Err(hixl_err(
                    HIXL_FAILED,
                    format!(
                        "{addr:#x}..+{len} was registered as MEM_HOST but does not lie inside one aclrtMallocHost \
                         allocation (HIXL requires aclrtMallocHost memory for host registrations)"
                    ),
                ));
            }
        };
        let mut regions = lock(&self.shared.regions);
        // The same range and type again: SUCCESS with the same handle; an overlap of the same
        // type: PARAM_INVALID (`hixl_utils.cc` l.242-264, used by `hixl_server.cc` l.111-119; an
        // inference for the legacy engine, whose HCCL registration refuses overlaps too).
        for r in regions.iter() {
            if r.mem_type == mem_type && addr < r.addr + r.len && r.addr < addr + len {
                if r.addr == addr && r.len == len {
                    return Ok(r.handle);
                }
                return Err(hixl_err(
                    HIXL_PARAM_INVALID,
                    format!(
                        "Mem addr range overlap with existing registered mem, new [{addr:#x}, {:#x}), existing [{:#x}, {:#x})",
                        addr + len,
                        r.addr,
                        r.addr + r.len
                    ),
                ));
            }
        }
        let region = Region {
            handle: new_mem_handle(),
            addr,
            len,
            mem_type,
            // Only `hixl::MemDesc` has `local_only`; the ADXL wrapper copies addr and len only
            // (`adxl_engine_impl.cc` l.28-30).
            local_only: hixl_api && desc.local_only != 0,
            _keep: keep,
        };
        let handle = region.handle;
        regions.push(Arc::new(region));
        Ok(handle)
    }

    /// `DeregisterMem` (the null handle was refused by the caller).
    pub(crate) fn deregister(&self, handle: u64) -> EmuResult<()> {
        self.check_alive()?;
        let mut regions = lock(&self.shared.regions);
        let Some(i) = regions.iter().position(|r| r.handle == handle) else {
            // Unknown or already deregistered: SUCCESS (`hixl_engine.cc` l.124-128,
            // `channel_msg_handler.cc` l.246-250).
            return Ok(());
        };
        // CS mode: refused while this engine has any client link (`hixl_engine.cc` l.129-133:
        // "All clients must be disconnected before deregistration"). The legacy engine removes
        // the range without looking at links (`channel_msg_handler.cc` l.244-258).
        if self.opts.mode == Mode::ClientServer && !lock(&self.links).is_empty() {
            return Err(hixl_err(
                HIXL_FAILED,
                format!(
                    "Failed to deregister mem. All clients must be disconnected before deregistration, local_engine: {}",
                    self.name
                ),
            ));
        }
        regions.remove(i);
        Ok(())
    }

    fn remote_addr(&self, remote: &str) -> EmuResult<SocketAddr> {
        let (ip, port): (IpAddr, i64) = options::parse_engine_name(remote)?;
        if port <= 0 {
            // No port: nothing listens there; the TCP connect fails (an inference: HIXL
            // connects to the parsed port, `channel_msg_handler.cc` l.509-518).
            return Err(hixl_err(HIXL_FAILED, format!("{remote} names no port: it is not a server engine")));
        }
        Ok(SocketAddr::new(ip, port as u16))
    }

    /// Makes a link to `remote` (the caller checked there is none).
    fn make_link(&self, remote: &str, timeout: Duration) -> EmuResult<Arc<Link>> {
        let deadline = Instant::now() + timeout;
        // Connecting to itself: PARAM_INVALID (CS: `hixl_engine.cc` l.147-150 and l.393-396;
        // legacy: the rank table has no peer rank on the same device, `channel_msg_handler.cc`
        // l.333-337, an inference for a name-equal engine).
        if remote == self.name {
            return Err(hixl_err(
                HIXL_PARAM_INVALID,
                format!("Do not support connection with self, local_engine:{}, remote_engine:{remote}", self.name),
            ));
        }
        // The legacy engine's link limit (RESOURCE_EXHAUSTED, `channel_msg_handler.cc`
        // l.346-353; the CS engine has none, HIXL-interface.md "Connect").
        if self.opts.mode == Mode::Legacy && self.shared.link_count() >= self.shared.max_links {
            return Err(hixl_err(
                HIXL_RESOURCE_EXHAUSTED,
                format!("Failed to connect {remote}: channel resource exhausted ({} links)", self.shared.max_links),
            ));
        }
        let addr = self.remote_addr(remote)?;
        // One TCP connect attempt bounded by the timeout; a refused or failed connect is FAILED,
        // not TIMEOUT (`ctrl_msg_plugin.cc` l.71-81 and l.119-122, `msg_handler_plugin.cc`
        // l.66-77 and l.112-115: DoConnect returns FAILED, and the timeout check runs only
        // between address candidates).
        let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| {
            hixl_err(HIXL_FAILED, format!("Failed to connect peer {addr} (engine {remote}), timeout:{timeout:?}: {e}"))
        })?;
        let _ = stream.set_nodelay(true);
        // The handshake: once the peer accepted, an answer later than the timeout is TIMEOUT
        // (`ctrl_msg_plugin.cc` l.250-263).
        let answer = hw::client_hello(&mut stream, &self.name, self.opts.mode, deadline)
            .map_err(|e| hw::io_status(e, &format!("connecting to {remote}")))?;
        let (status, message, regions) = answer;
        if status != HIXL_SUCCESS {
            return Err(hixl_err(status, format!("{remote} refused the link: {message}")));
        }
        let local_snapshot = (self.opts.mode == Mode::ClientServer).then(|| lock(&self.shared.regions).clone());
        let ctl = stream.try_clone().map_err(|e| hixl_err(HIXL_FAILED, format!("link to {remote}: {e}")))?;
        Ok(Arc::new(Link {
            remote: remote.to_string(),
            stream: Mutex::new(stream),
            ctl,
            remote_regions: regions,
            local_snapshot,
            broken: AtomicBool::new(false),
        }))
    }

    /// `Connect(remote, timeout_ms)` (timeout > 0 was checked by the caller).
    pub(crate) fn connect(&self, remote: &str, timeout: Duration) -> EmuResult<()> {
        self.check_alive()?;
        let _serial = lock(&self.connecting);
        if lock(&self.links).contains_key(remote) {
            // `channel_msg_handler.cc` l.492-495, `hixl_engine.cc` l.159-162.
            return Err(hixl_err(HIXL_ALREADY_CONNECTED, format!("remote_engine:{remote} is already connected")));
        }
        if remote == self.name {
            return Err(hixl_err(
                HIXL_PARAM_INVALID,
                format!("Do not support connection with self, local_engine:{}, remote_engine:{remote}", self.name),
            ));
        }
        let link = self.make_link(remote, timeout)?;
        self.add_link(link);
        Ok(())
    }

    fn add_link(&self, link: Arc<Link>) {
        let mut links = lock(&self.links);
        links.insert(link.remote.clone(), link);
        self.shared.outgoing.store(links.len(), Ordering::Release);
    }

    fn drop_link(&self, remote: &str) -> Option<Arc<Link>> {
        let mut links = lock(&self.links);
        let l = links.remove(remote);
        self.shared.outgoing.store(links.len(), Ordering::Release);
        l
    }

    /// `Disconnect(remote, timeout_ms)` (timeout > 0 was checked by the caller).
    pub(crate) fn disconnect(&self, remote: &str, timeout: Duration) -> EmuResult<()> {
        self.check_alive()?;
        // No link: NOT_CONNECTED (`channel_msg_handler.cc` l.580-583 and l.627-629; CS:
        // `client_manager_.DestroyClient`, an inference that it answers the same).
        let Some(link) = self.drop_link(remote) else {
            return Err(hixl_err(HIXL_NOT_CONNECTED, format!("Disconnect failed, {remote} is not connected")));
        };
        // Tell the peer; a peer that is gone does not stop the local clean-up
        // (`channel_msg_handler.cc` l.652-659).
        let told = {
            let deadline = Instant::now() + timeout;
            match link.stream.lock() {
                Ok(mut s) => hw::client_bye(&mut s, deadline),
                Err(_) => Err(std::io::Error::other("poisoned")),
            }
        };
        link.shutdown();
        match told {
            Ok(()) => Ok(()),
            // The legacy engine reaches the peer over a new connection to say goodbye; when the
            // peer's server is gone that fails, and HIXL reports it (`channel_msg_handler.cc`
            // l.574-590, l.630-634). The emulator drops its side of the link anyway (real HIXL
            // leaves it to the heartbeat; an emulator choice).
            Err(e) if self.opts.mode == Mode::Legacy && !link.broken.load(Ordering::Acquire) => {
                Err(hixl_err(HIXL_FAILED, format!("Disconnect from {remote}: the peer did not answer: {e}")))
            }
            Err(_) => Ok(()),
        }
    }

    /// The link to use for a transfer: the existing one, or with `AutoConnect` a new one
    /// (`adxl_inner_engine.cc` l.486-491, `hixl_engine.cc` l.383-413); none → NOT_CONNECTED.
    fn link_for(&self, remote: &str, timeout: Duration) -> EmuResult<Arc<Link>> {
        if let Some(l) = lock(&self.links).get(remote) {
            return Ok(Arc::clone(l));
        }
        if !self.opts.auto_connect {
            return Err(hixl_err(
                HIXL_NOT_CONNECTED,
                format!("Failed to get channel, remote_engine:{remote}: not connected and AutoConnect is off"),
            ));
        }
        let _serial = lock(&self.connecting);
        if let Some(l) = lock(&self.links).get(remote) {
            return Ok(Arc::clone(l));
        }
        let link = self.make_link(remote, timeout)?;
        self.add_link(Arc::clone(&link));
        Ok(link)
    }

    /// Checks every descriptor before anything moves; returns the local regions they use.
    fn validate(&self, link: &Link, descs: &[TransferOpDesc]) -> EmuResult<Vec<Arc<Region>>> {
        // An empty list is PARAM_INVALID (`comm_engine.cc` l.60; an inference for CS mode).
        if descs.is_empty() {
            return Err(hixl_err(HIXL_PARAM_INVALID, "TransferSync failed, op_descs is empty"));
        }
        let current = lock(&self.shared.regions).clone();
        let local_view: &[Arc<Region>] = link.local_snapshot.as_deref().unwrap_or(&current);
        let mut used = Vec::with_capacity(descs.len());
        for (i, d) in descs.iter().enumerate() {
            // A zero length is PARAM_INVALID (`hixl_mem_store.cc` l.265-267).
            if d.len == 0 {
                return Err(hixl_err(HIXL_PARAM_INVALID, format!("desc {i}: len is 0")));
            }
            // The local range must lie in a local registration (CS: one known to the link;
            // `hixl_mem_store.cc` l.273-277), the remote range in a registration the link saw
            // (`hixl_mem_store.cc` l.268-272): else PARAM_INVALID. (Legacy with its buffer pool
            // would move unregistered memory through the pool, `adxl_inner_engine.cc` l.379-406;
            // the emulator does not model that and refuses the same way.)
            let local = local_view
                .iter()
                .find(|r| r.contains(d.local_addr, d.len) && current.iter().any(|c| Arc::ptr_eq(c, r)))
                .ok_or_else(|| {
                    hixl_err(
                        HIXL_PARAM_INVALID,
                        format!(
                            "Client memory verification failed, memory is not registered, idx:{i}, client_addr:{:#x}, buf_len:{}",
                            d.local_addr, d.len
                        ),
                    )
                })?;
            if !link.remote_regions.iter().any(|r| r.contains(d.remote_addr as u64, d.len as u64)) {
                return Err(hixl_err(
                    HIXL_PARAM_INVALID,
                    format!(
                        "Server memory verification failed, memory is not registered (for this link), idx:{i}, \
                         server_addr:{:#x}, buf_len:{}",
                        d.remote_addr, d.len
                    ),
                ));
            }
            used.push(Arc::clone(local));
        }
        Ok(used)
    }

    /// After a failed transfer with AutoConnect the link goes (`hixl_engine.cc` l.205-210 and
    /// l.422-432, `adxl_inner_engine.cc` l.408-415 and l.507-512).
    fn on_failure(&self, link: &Arc<Link>) {
        if self.opts.auto_connect {
            let mut links = lock(&self.links);
            if links.get(&link.remote).is_some_and(|l| Arc::ptr_eq(l, link)) {
                links.remove(&link.remote);
                self.shared.outgoing.store(links.len(), Ordering::Release);
            }
            drop(links);
            link.shutdown();
        }
    }

    /// `TransferSync(remote, op, descs, timeout_ms)` (timeout > 0 and non-null addresses were
    /// checked by the caller).
    pub(crate) fn transfer_sync(
        &self,
        remote: &str,
        op: i32,
        descs: &[TransferOpDesc],
        timeout: Duration,
    ) -> EmuResult<()> {
        self.check_alive()?;
        let deadline = Instant::now() + timeout;
        let link = self.link_for(remote, timeout)?;
        let result = self.validate(&link, descs).and_then(|used| run_on_link(&link, op, descs, &used, deadline));
        if result.is_err() {
            self.on_failure(&link);
        }
        result
    }

    /// `TransferAsync`: checks like `TransferSync`, then moves the bytes on a thread. With
    /// AutoConnect the implicit connect has a fixed 3000 ms timeout (`hixl_engine.cc` l.27,
    /// l.224; `adxl_inner_engine.cc` l.32, l.521-523).
    pub(crate) fn transfer_async(self: &Arc<Self>, remote: &str, op: i32, descs: &[TransferOpDesc]) -> EmuResult<u64> {
        self.check_alive()?;
        let link = self.link_for(remote, Duration::from_millis(3000))?;
        let used = match self.validate(&link, descs) {
            Ok(u) => u,
            Err(e) => {
                self.on_failure(&link);
                return Err(e);
            }
        };
        let id = next_id();
        let req = Arc::new(Request { state: Mutex::new(ReqState::Waiting), done: Condvar::new() });
        lock(&self.requests).insert(id, Arc::clone(&req));
        let me = Arc::clone(self);
        let descs = descs.to_vec();
        let spawned = std::thread::Builder::new().name("hixl-emu-async".into()).spawn(move || {
            let r = run_on_link(&link, op, &descs, &used, Instant::now() + ASYNC_LIMIT);
            if let Err(e) = &r {
                debug(|| format!("hixl async request {id} to {} failed: {}", link.remote, e.message));
                me.on_failure(&link);
            }
            *lock(&req.state) = if r.is_ok() { ReqState::Completed } else { ReqState::Failed };
            req.done.notify_all();
        });
        if let Err(e) = spawned {
            lock(&self.requests).remove(&id);
            return Err(hixl_err(HIXL_RESOURCE_EXHAUSTED, format!("cannot start a transfer thread: {e}")));
        }
        Ok(id)
    }

    /// `GetTransferStatus(req)`: WAITING, or COMPLETED/FAILED once (the request is then
    /// released). An unknown or released request is PARAM_INVALID ("Request not found, request
    /// has been completed or does not exist", `hixl_engine.cc` l.241-247,
    /// `adxl_inner_engine.cc` l.557-562). A failed transfer reports FAILED with SUCCESS (an
    /// inference: HIXL documents FAILED as a status, `HIXL-interface.md` "GetTransferStatus").
    pub(crate) fn transfer_status(&self, req: u64) -> EmuResult<ReqState> {
        let mut requests = lock(&self.requests);
        let Some(r) = requests.get(&req) else {
            return Err(hixl_err(
                HIXL_PARAM_INVALID,
                format!("Request not found, request has been completed or does not exist, req:{req}"),
            ));
        };
        let state = *lock(&r.state);
        if state != ReqState::Waiting {
            requests.remove(&req);
        }
        Ok(state)
    }
}

/// Moves the bytes of one checked batch over `link`.
fn run_on_link(
    link: &Link,
    op: i32,
    descs: &[TransferOpDesc],
    used: &[Arc<Region>],
    deadline: Instant,
) -> EmuResult<()> {
    if link.broken.load(Ordering::Acquire) {
        return Err(hixl_err(
            HIXL_FAILED,
            format!("the link to {} is broken; Disconnect and connect again", link.remote),
        ));
    }
    // Several threads may transfer on one link; they take turns, within their own deadline.
    let mut stream = loop {
        match link.stream.try_lock() {
            Ok(s) => break s,
            Err(std::sync::TryLockError::Poisoned(p)) => break p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                if Instant::now() >= deadline {
                    return Err(hixl_err(
                        HIXL_TIMEOUT,
                        format!("the link to {} stayed busy until the timeout", link.remote),
                    ));
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    };
    let r = hw::client_transfer(&mut stream, op, descs, deadline);
    // `used` holds the local allocations alive until the bytes moved.
    let _ = used;
    match r {
        Ok(Ok(())) => Ok(()),
        // The server refused (its registration went, or an injected failure): the link stays
        // in step.
        Ok(Err((status, message))) => Err(hixl_err(status, format!("{}: {message}", link.remote))),
        Err(e) => {
            // The stream is out of step now: the link is broken.
            link.broken.store(true, Ordering::Release);
            Err(hw::io_status(e, &format!("transfer with {}", link.remote)))
        }
    }
}
