//! The one-sided HCCL service (cargo feature `onesided`): global memory, rank-table
//! communicators from a JSON string, bind/unbind, prepare, batch get/put.
//!
//! - `HcclRegisterGlobalMem` records memory the process may expose: type 0 must lie inside
//!   emulated device memory, type 1 is host memory (and must not be device memory).
//!   `HcclDeregisterGlobalMem` refuses memory still bound to a communicator.
//! - `HcclCommInitClusterInfoMemConfig` parses a v1.0/v1.2 rank table *string*, checks that it
//!   gives `rank` the physical id of the calling thread's device, and registers the communicator
//!   at the rank's endpoint (`device_ip:device_port`; one listener per endpoint and process). It
//!   does not wait for the peers; they meet in `HcclCommPrepare`.
//! - `HcclCommBindMem`/`HcclCommUnbindMem` decide which memory the peers may access.
//! - `HcclCommPrepare(comm, cfg, timeout_s)` is blocking and mutual: it returns once every peer
//!   rank has created the communicator and called `HcclCommPrepare` too, exchanging the ranges
//!   each side bound; `HCCL_E_TIMEOUT` after `timeout_s` seconds (≤ 0: `HCCL_CONNECT_TIMEOUT`).
//!   Each pair of ranks meets in exactly one exchange: the higher rank connects to the lower
//!   rank's endpoint and sends `PREPARE` (its ranges); the lower rank's endpoint answers once the
//!   lower rank called Prepare (its ranges), and that answer completes the pair on *both* sides —
//!   the lower rank's Prepare waits for it rather than making a crossing exchange of its own,
//!   which could leave one side waiting for a peer that had already returned and gone away. The
//!   lower rank opens its own service connection to the higher one on first use. No lock is held
//!   while connecting or waiting for a peer's answer during Prepare.
//! - `HcclBatchGet` (read) / `HcclBatchPut` (write) take 1..=256 descriptors and queue the
//!   transfer on the stream. At the call, local ranges must lie in memory bound to this
//!   communicator and remote ranges in memory the peer bound (the peer is asked again when a
//!   range is not in what Prepare exchanged); otherwise the call returns `HCCL_E_PARA`. An
//!   operation before `HcclCommPrepare` returns `HCCL_E_UNAVAIL`. The peer's emulator serves
//!   the transfer and checks every range against its bound memory again; a refusal there
//!   surfaces at stream synchronize as `ACL_ERROR_RT_SUSPECT_REMOTE_ERROR` (507057).

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, c_char, c_void};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::boundary::{Api, debug, entry, lock, read, write};
use crate::codes::*;
use crate::config::config;
use crate::endpoint;
use crate::faults::faults;
use crate::handles::{self, Kind};
use crate::hccl::{self, Comm, Role};
use crate::hccl_two_sided::{build_table_comm, connect_link};
use crate::memory::{self, Allocation};
use crate::rank_table;
use crate::types::*;
use crate::wire::{self, Dec, Enc, kind, purpose};

/// Most ranges in one exchanged list.
const MAX_RANGES: usize = 65536;
const OP_GET: u8 = 0;
const OP_PUT: u8 = 1;

#[derive(Debug, Default)]
struct MemState {
    dead: bool,
    bound: HashSet<u64>,
}

/// Memory registered with `HcclRegisterGlobalMem`.
#[derive(Debug)]
pub(crate) struct GlobalMem {
    handle: u64,
    addr: usize,
    size: usize,
    /// `CommMem.type`: what the caller says the memory is (checked only at Prepare).
    mem_type: i32,
    /// The user device that was current at registration: HCCL keeps one registry per device
    /// (`GlobalMemRegMgr::GetInstance`, HCOMM `global_mem_manager.cc` l.20-40), and a handle is
    /// valid only where it was registered.
    device: u32,
    _alloc: Option<Arc<Allocation>>,
    state: Mutex<MemState>,
}

impl GlobalMem {
    fn contains(&self, addr: u64, len: u64) -> bool {
        let (start, end) = (self.addr as u64, self.addr as u64 + self.size as u64);
        addr >= start && addr.checked_add(len).is_some_and(|e| e <= end)
    }

    fn overlaps(&self, addr: usize, size: usize) -> bool {
        addr < self.addr + self.size && self.addr < addr + size
    }

    /// Whether Prepare can register this memory with the device (HCOMM `mem_mapping_manager_host.cc` l.15-39; HIXL RegisterMem doc; docs/ascend.md rule 5): device memory
    /// must be emulated device memory of the communicator's device; host memory must come from
    /// `aclrtMallocHost` (Prepare hands it to `aclrtHostRegister`, which refuses anything else).
    fn check_registrable(&self, name: &str, user_id: u32) -> EmuResult<()> {
        let (addr, size) = (self.addr, self.size);
        let found = memory::find(addr, size);
        match (self.mem_type, found.as_ref().map(|a| a.kind)) {
            (HCCL_MEM_TYPE_DEVICE, Some(memory::MemKind::Device { user_id: u, .. })) if u == user_id => Ok(()),
            (HCCL_MEM_TYPE_DEVICE, Some(memory::MemKind::Device { user_id: u, .. })) => Err(err(
                PREPARE_REGISTER_FAILED,
                format!(
                    "{name}: device memory {addr:#x}..+{size} belongs to device {u}, not to this communicator's device {user_id}"
                ),
            )),
            (HCCL_MEM_TYPE_DEVICE, _) => Err(err(
                PREPARE_REGISTER_FAILED,
                format!("{name}: {addr:#x}..+{size} was registered as device memory (type 0) but is not device memory"),
            )),
            (_, Some(memory::MemKind::Host)) => Ok(()),
            (_, Some(memory::MemKind::Device { .. })) => Err(err(
                PREPARE_REGISTER_FAILED,
                format!(
                    "{name}: aclrtHostRegister failed: {addr:#x}..+{size} was registered as host memory (type 1) but is device memory"
                ),
            )),
            (_, None) => Err(err(
                PREPARE_REGISTER_FAILED,
                format!(
                    "{name}: aclrtHostRegister failed for host memory {addr:#x}..+{size}: only memory allocated with \
                     aclrtMallocHost can be registered with the device"
                ),
            )),
        }
    }
}

/// What `HcclCommPrepare` returns when bound memory cannot be registered with the device or
/// exchanged with a peer (`aclrtHostRegister failed` → `HCCL_E_RUNTIME`, HCOMM `mem_mapping_manager_host.cc`; IPC alignment, `adapter_rts.cc` l.1257-1284; docs/ascend.md rules 5 and 6).
const PREPARE_REGISTER_FAILED: i32 = HCCL_E_RUNTIME;
/// Alignment HCCS IPC needs of device memory shared with a rank on the same server (HIXL `CacheManager.md` l.179, `HIXL-interface.md` l.430; docs/ascend.md rule 6).
pub const IPC_ALIGNMENT: usize = 2 << 20;

static MEMS: LazyLock<Mutex<HashMap<u64, Arc<GlobalMem>>>> = LazyLock::new(Default::default);

#[derive(Debug)]
struct Peer {
    rank: u32,
    endpoint: SocketAddr,
    /// This side's service connection to the peer (this side's requests go out on it): opened
    /// by Prepare when this is the higher rank of the pair, on first use otherwise. Held only
    /// while one request is on it, never while connecting.
    conn: Mutex<Option<TcpStream>>,
    /// What the peer registered and exchanged at Prepare.
    ranges: RwLock<Vec<(u64, u64)>>,
    /// The pair met in Prepare (changed under `OneSided::prepare_entered`, see `prepare_cv`).
    prepared: AtomicBool,
    /// The peer's rank is on this rank's server (same `server_id`): HCCS IPC, not RoCE.
    same_server: bool,
    /// The peer's Atlas A3 super-pod fields are in the table (`super_device_id`, `super_pod_id`).
    super_fields: bool,
}

impl Peer {
    fn covers(&self, addr: u64, len: u64) -> bool {
        read(&self.ranges)
            .iter()
            .any(|&(a, l)| addr >= a && addr.checked_add(len).is_some_and(|e| e <= a.saturating_add(l)))
    }

    fn drop_connection(&self) {
        if let Some(s) = lock(&self.conn).take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.prepared.store(false, Ordering::Release);
    }

    /// Installs a connection opened without holding `conn`; one installed meanwhile by another
    /// thread is kept when `replace` is false (the new one is closed), closed otherwise.
    fn install(&self, s: TcpStream, replace: bool) {
        let mut conn = lock(&self.conn);
        let extra = if conn.is_none() || replace { conn.replace(s) } else { Some(s) };
        drop(conn);
        if let Some(old) = extra {
            let _ = old.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// One-sided state of a communicator.
#[derive(Debug)]
pub(crate) struct OneSided {
    bound: RwLock<Vec<Arc<GlobalMem>>>,
    /// What Prepare registered and exchanged (set once, by the first successful Prepare):
    /// only this memory is reachable, locally and by the peers (HCOMM `hccl_one_sided_service.cc` `Prepare`/`BindMem`; docs/ascend.md rule 3).
    exported: RwLock<Option<Vec<Arc<GlobalMem>>>>,
    /// Whether a Prepare of this communicator succeeded (later calls are no-ops).
    prepared: AtomicBool,
    /// Whether this rank's own entry has the A3 super-pod fields.
    super_fields: bool,
    /// The table's version (`"1.0"`/`"1.2"`).
    version: String,
    /// Whether this rank called `HcclCommPrepare`; also the mutex of `prepare_cv`, held while a
    /// peer's `prepared` flag is set.
    prepare_entered: Mutex<bool>,
    /// Signalled when Prepare is entered, a peer is marked prepared, or the communicator is
    /// destroyed.
    prepare_cv: Condvar,
    peers: HashMap<u32, Arc<Peer>>,
}

impl OneSided {
    /// The state of a new communicator (peers from its rank table).
    pub(crate) fn new(comm: &Comm) -> OneSided {
        let ranks = comm.table.as_ref().map(|t| t.ranks.as_slice()).unwrap_or_default();
        let me = ranks.iter().find(|r| r.rank == comm.rank);
        let has_super = |r: &crate::rank_table::RankEntry| r.super_device_id.is_some() && r.super_pod_id.is_some();
        let peers = ranks
            .iter()
            .filter(|r| r.rank != comm.rank)
            .map(|r| {
                let p = Peer {
                    rank: r.rank,
                    endpoint: r.endpoint,
                    conn: Mutex::new(None),
                    ranges: RwLock::new(Vec::new()),
                    prepared: AtomicBool::new(false),
                    same_server: me.is_some_and(|m| m.server_id == r.server_id),
                    super_fields: has_super(r),
                };
                (r.rank, Arc::new(p))
            })
            .collect();
        OneSided {
            bound: RwLock::new(Vec::new()),
            exported: RwLock::new(None),
            prepared: AtomicBool::new(false),
            super_fields: me.is_some_and(has_super),
            version: comm.table.as_ref().map(|t| t.version.clone()).unwrap_or_default(),
            prepare_entered: Mutex::new(false),
            prepare_cv: Condvar::new(),
            peers,
        }
    }

    /// The ranges Prepare exchanged (empty before Prepare).
    fn exported_ranges(&self) -> Vec<(u64, u64)> {
        read(&self.exported).iter().flatten().map(|m| (m.addr as u64, m.size as u64)).collect()
    }

    /// Whether `[addr, addr + len)` lies in memory Prepare registered that is still `bound`.
    fn reachable_in(&self, bound: &[Arc<GlobalMem>], addr: u64, len: u64) -> bool {
        read(&self.exported)
            .iter()
            .flatten()
            .any(|m| m.contains(addr, len) && bound.iter().any(|b| b.handle == m.handle))
    }

    /// Whether any memory is still bound (`HcclCommDestroy` refuses then).
    pub(crate) fn has_bound(&self) -> bool {
        !read(&self.bound).is_empty()
    }

    /// Records that `peer` met this rank in Prepare, with the ranges it bound.
    fn mark_prepared(&self, peer: &Peer, ranges: Vec<(u64, u64)>) {
        *write(&peer.ranges) = ranges;
        let _entered = lock(&self.prepare_entered);
        peer.prepared.store(true, Ordering::Release);
        self.prepare_cv.notify_all();
    }

    /// `HcclCommDestroy`: unbinds everything, closes the peer connections.
    pub(crate) fn teardown(&self, comm_handle: u64) {
        for m in write(&self.bound).drain(..) {
            lock(&m.state).bound.remove(&comm_handle);
        }
        for p in self.peers.values() {
            p.drop_connection();
        }
        // Under the mutex, so a Prepare between its check and its wait cannot miss this.
        let _entered = lock(&self.prepare_entered);
        self.prepare_cv.notify_all();
    }
}

fn one_sided<'a>(name: &str, c: &'a Comm) -> EmuResult<&'a OneSided> {
    match (&c.one_sided, c.role) {
        (Some(os), Role::OneSided) => Ok(os),
        _ => Err(err(
            HCCL_E_NOT_SUPPORT,
            format!("{name}: the communicator was not created by HcclCommInitClusterInfoMemConfig"),
        )),
    }
}

fn lookup_mem(ptr: *const c_void) -> EmuResult<Arc<GlobalMem>> {
    if ptr.is_null() {
        return Err(err(HCCL_E_PTR, "memHandle is NULL"));
    }
    handles::from_ptr(Kind::GlobalMem, ptr)
        .and_then(|h| lock(&MEMS).get(&h).cloned())
        .ok_or_else(|| err(HCCL_E_PARA, format!("{ptr:p} is not a registered global memory handle")))
}

/// The handle as the registry of `device` knows it ("The parameter memHandle[%p] is invalid."
/// for a handle registered on another device: HCOMM keeps one registry per device).
fn lookup_mem_on(name: &str, ptr: *const c_void, device: u32) -> EmuResult<Arc<GlobalMem>> {
    let m = lookup_mem(ptr)?;
    if m.device != device {
        return Err(err(
            HCCL_E_PARA,
            format!(
                "{name}: the parameter memHandle[{ptr:p}] is invalid on device {device}: it was registered while \
                 device {} was current (HCCL keeps one registry per device)",
                m.device
            ),
        ));
    }
    Ok(m)
}

/// Registers memory for one-sided access (type 0 device, type 1 host).
///
/// # Safety
/// `mem` is NULL or points to a [`CommMem`]; `mem_handle` is NULL or valid for writing a
/// pointer. The memory is not touched here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclRegisterGlobalMem(mem: *const CommMem, mem_handle: *mut *mut c_void) -> i32 {
    entry(
        Api::HcclOneSided,
        "HcclRegisterGlobalMem",
        || format!("{mem:p}, {mem_handle:p}"),
        || {
            if mem.is_null() || mem_handle.is_null() {
                return Err(err(HCCL_E_PTR, "mem or memHandle is NULL"));
            }
            // SAFETY: non-null, points to a CommMem per this function's contract.
            let m = unsafe { mem.read_unaligned() };
            let (addr, size) = (m.addr as usize, m.size);
            if addr == 0 || size == 0 || size > isize::MAX as u64 || addr.checked_add(size as usize).is_none() {
                return Err(err(HCCL_E_PARA, format!("HcclRegisterGlobalMem: invalid range {addr:#x}..+{size}")));
            }
            let size = size as usize;
            if m.mem_type != HCCL_MEM_TYPE_DEVICE && m.mem_type != HCCL_MEM_TYPE_HOST {
                return Err(err(HCCL_E_PARA, format!("HcclRegisterGlobalMem: unknown memory type {}", m.mem_type)));
            }
            // Only recorded here: whether the device can use the memory is found out by
            // HcclCommPrepare (HCOMM `global_mem_manager.cc` `CheckOverlapAndInsert`; docs/ascend.md rule 2). The same range again is the same handle;
            // a different range overlapping a registered one is refused.
            let device = hccl::current_device("HcclRegisterGlobalMem")?.user_id;
            let mut mems = lock(&MEMS);
            let mut mine = mems.values().filter(|g| g.device == device);
            if let Some(same) = mine.clone().find(|g| g.addr == addr && g.size == size && g.mem_type == m.mem_type) {
                // SAFETY: non-null, valid per this function's contract.
                unsafe { mem_handle.write_unaligned(handles::to_ptr(same.handle)) };
                return Ok(());
            }
            // Overlap is checked among ranges of the same type only.
            if let Some(other) = mine.find(|g| g.mem_type == m.mem_type && g.overlaps(addr, size)) {
                return Err(err(
                    HCCL_E_PARA,
                    format!(
                        "HcclRegisterGlobalMem: {addr:#x}..+{size} overlaps the registered range {:#x}..+{} (type {})",
                        other.addr, other.size, other.mem_type
                    ),
                ));
            }
            let g = Arc::new(GlobalMem {
                handle: handles::new_handle(Kind::GlobalMem),
                addr,
                size,
                mem_type: m.mem_type,
                device,
                _alloc: memory::find(addr, size),
                state: Mutex::new(MemState::default()),
            });
            mems.insert(g.handle, Arc::clone(&g));
            // SAFETY: non-null, valid per this function's contract.
            unsafe { mem_handle.write_unaligned(handles::to_ptr(g.handle)) };
            Ok(())
        },
    )
}

/// Deregisters memory (refused while it is still bound to a communicator).
///
/// # Safety
/// No memory is dereferenced; the handle is looked up in a registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclDeregisterGlobalMem(mem_handle: *mut c_void) -> i32 {
    entry(
        Api::HcclOneSided,
        "HcclDeregisterGlobalMem",
        || format!("{mem_handle:p}"),
        || {
            let device = hccl::current_device("HcclDeregisterGlobalMem")?.user_id;
            let m = lookup_mem_on("HcclDeregisterGlobalMem", mem_handle, device)?;
            let mut st = lock(&m.state);
            // HCOMM `global_mem_manager.cc` `DeReg`: "still bound to comm(s)" → HCCL_E_PARA (docs/ascend.md rule 2)
            if !st.bound.is_empty() {
                return Err(err(
                    HCCL_E_PARA,
                    format!(
                        "HcclDeregisterGlobalMem: the memory is still bound to {} communicator(s): unbind it or destroy them first",
                        st.bound.len()
                    ),
                ));
            }
            st.dead = true;
            lock(&MEMS).remove(&m.handle);
            Ok(())
        },
    )
}

fn read_config_name(config: *mut c_void) -> EmuResult<String> {
    if config.is_null() {
        return Ok(String::new());
    }
    // SAFETY: non-null; an HcclCommConfig starts with this 24-byte header.
    let h = unsafe { config.cast::<HcclCommConfigHeader>().read_unaligned() };
    if h.magic != HCCL_COMM_CONFIG_MAGIC {
        return Err(err(
            HCCL_E_PARA,
            format!("HcclCommInitClusterInfoMemConfig: config magic word is {:#x}, expected 0xf0f0f0f0", h.magic),
        ));
    }
    // Version 5 layout: header (24), bufferSizeMB, deterministic, commName[128] at offset 32.
    if h.size < 160 {
        return Ok(String::new());
    }
    let mut name = [0u8; 128];
    // SAFETY: the caller's struct is `h.size` >= 160 bytes long, so bytes 32..160 are readable.
    unsafe { std::ptr::copy_nonoverlapping(config.cast::<u8>().add(32), name.as_mut_ptr(), 128) };
    let end = name.iter().position(|&b| b == 0).unwrap_or(128);
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// Creates a one-sided communicator from a rank table JSON string (see the module doc).
///
/// # Safety
/// `rank_table` is NULL or a NUL-terminated string; `config` is NULL or points to an
/// `HcclCommConfig` whose `size` field tells its length; `comm` is NULL or valid for writing a
/// pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclCommInitClusterInfoMemConfig(
    rank_table: *const c_char,
    rank: u32,
    config: *mut c_void,
    comm: *mut HcclComm,
) -> i32 {
    const NAME: &str = "HcclCommInitClusterInfoMemConfig";
    entry(
        Api::HcclOneSided,
        NAME,
        || format!("{rank_table:p}, {rank}, {config:p}, {comm:p}"),
        || {
            if rank_table.is_null() || comm.is_null() {
                return Err(err(HCCL_E_PTR, "rankTable or comm is NULL"));
            }
            // SAFETY: non-null and NUL-terminated per this function's contract.
            let text = unsafe { CStr::from_ptr(rank_table) };
            let text = text.to_str().map_err(|_| err(HCCL_E_PARA, format!("{NAME}: the rank table is not UTF-8")))?;
            let mut table = rank_table::parse(text).map_err(|e| err(HCCL_E_PARA, format!("{NAME}: {e}")))?;
            let comm_name = read_config_name(config)?;
            // HCCL tells communicators apart by name (`IsCommNameExistInOneSidedComms`, HCOMM
            // `op_base.cc`): two communicators of one rank table with different names (a pair's
            // next generation, for instance) never meet each other's ranks.
            if !comm_name.is_empty() {
                table.key = rank_table::keyed_by_name(table.key, &comm_name);
            }
            let ctx = hccl::current_device(NAME)?;
            let c = build_table_comm(NAME, &ctx, table, rank, Role::OneSided)?;
            debug(|| format!("{NAME}: communicator {comm_name:?} key {:#x} rank {rank}", c.key));
            let h = hccl::register(c);
            // SAFETY: non-null, valid per this function's contract.
            unsafe { comm.write_unaligned(handles::to_ptr(h)) };
            Ok(())
        },
    )
}

/// Lets the peers of `comm` access the registered memory `mem_handle`.
///
/// # Safety
/// No memory is dereferenced; the handles are looked up in registries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclCommBindMem(comm: HcclComm, mem_handle: *mut c_void) -> i32 {
    entry(
        Api::HcclOneSided,
        "HcclCommBindMem",
        || format!("{comm:p}, {mem_handle:p}"),
        || {
            let c = hccl::lookup(comm)?;
            let os = one_sided("HcclCommBindMem", &c)?;
            let m = lookup_mem_on("HcclCommBindMem", mem_handle, c.user_id)?;
            {
                let mut st = lock(&m.state);
                if st.dead {
                    return Err(err(HCCL_E_PARA, "HcclCommBindMem: the memory was deregistered"));
                }
                if !st.bound.insert(c.handle) {
                    return Err(err(HCCL_E_PARA, "HcclCommBindMem: the memory is already bound to this communicator"));
                }
            }
            write(&os.bound).push(m);
            Ok(())
        },
    )
}

/// Withdraws `mem_handle` from `comm` (waits for transfers of the peers that are using it).
///
/// # Safety
/// No memory is dereferenced; the handles are looked up in registries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclCommUnbindMem(comm: HcclComm, mem_handle: *mut c_void) -> i32 {
    entry(
        Api::HcclOneSided,
        "HcclCommUnbindMem",
        || format!("{comm:p}, {mem_handle:p}"),
        || {
            let c = hccl::lookup(comm)?;
            let os = one_sided("HcclCommUnbindMem", &c)?;
            let m = lookup_mem(mem_handle)?;
            {
                let mut bound = write(&os.bound);
                let Some(i) = bound.iter().position(|b| b.handle == m.handle) else {
                    return Err(err(HCCL_E_PARA, "HcclCommUnbindMem: the memory is not bound to this communicator"));
                };
                bound.remove(i);
            }
            lock(&m.state).bound.remove(&c.handle);
            Ok(())
        },
    )
}

fn io_error(name: &str, peer: u32, e: &std::io::Error) -> EmuError {
    if wire::is_timeout(e) {
        err(HCCL_E_TIMEOUT, format!("{name}: rank {peer} did not answer in time"))
    } else {
        err(HCCL_E_TCP_TRANSFER, format!("{name}: the connection to rank {peer} failed: {e}"))
    }
}

/// Prepare's checks of what it registers with the device and the NIC, and of the rank table,
/// before any exchange (HCOMM `mem_mapping_manager_host.cc` l.15-39; HIXL RegisterMem doc; docs/ascend.md rule 5, HIXL `CacheManager.md` l.179, `HIXL-interface.md` l.430; docs/ascend.md rule 6, HIXL `rank_table_generator.cc`; docs/ascend.md rule 8).
fn check_prepare(c: &Comm, os: &OneSided) -> EmuResult<Vec<Arc<GlobalMem>>> {
    const NAME: &str = "HcclCommPrepare";
    let bound = read(&os.bound).clone();
    for m in &bound {
        m.check_registrable(NAME, c.user_id)?;
    }
    let cfg = config();
    for p in os.peers.values() {
        if p.same_server && !cfg.intra_roce {
            // HCCS IPC between ranks of one server: device memory only, in whole huge pages.
            for m in &bound {
                if m.mem_type == HCCL_MEM_TYPE_HOST {
                    return Err(err(
                        PREPARE_REGISTER_FAILED,
                        format!(
                            "{NAME}: rank {} is on this server (HCCS IPC): host memory {:#x}..+{} cannot be shared \
                             over IPC (only device memory; or set HCCL_INTRA_ROCE_ENABLE=1)",
                            p.rank, m.addr, m.size
                        ),
                    ));
                }
                if m.addr % IPC_ALIGNMENT != 0 {
                    return Err(err(
                        PREPARE_REGISTER_FAILED,
                        format!(
                            "{NAME}: rank {} is on this server (HCCS IPC): device memory {:#x}..+{} is not {} MiB \
                             aligned (allocate it with ACL_MEM_MALLOC_HUGE_ONLY)",
                            p.rank,
                            m.addr,
                            m.size,
                            IPC_ALIGNMENT >> 20
                        ),
                    ));
                }
            }
        } else if crate::config::is_a3(&cfg.soc_name) && (os.version != "1.2" || !os.super_fields || !p.super_fields) {
            return Err(err(
                HCCL_E_PARA,
                format!(
                    "{NAME}: on {} (Atlas A3) ranks on different servers need a v1.2 rank table with \
                     super_device_id and super_pod_id (this table is v{}; rank {} {}, this rank {})",
                    cfg.soc_name,
                    os.version,
                    p.rank,
                    if p.super_fields { "has them" } else { "lacks them" },
                    if os.super_fields { "has them" } else { "lacks them" },
                ),
            ));
        }
    }
    Ok(bound)
}

fn prepare(c: &Comm, os: &OneSided, timeout: Duration) -> EmuResult<()> {
    const NAME: &str = "HcclCommPrepare";
    if os.prepared.load(Ordering::Acquire) {
        // Prepared once already: the exchange is not repeated (HCOMM `hccl_one_sided_service.cc` `Prepare`/`BindMem`; docs/ascend.md rule 3).
        debug(|| format!("{NAME}: communicator key {:#x} rank {} is already prepared; nothing to do", c.key, c.rank));
        return Ok(());
    }
    let registered = check_prepare(c, os)?;
    let mine: Vec<(u64, u64)> = registered.iter().map(|m| (m.addr as u64, m.size as u64)).collect();
    *write(&os.exported) = Some(registered);
    {
        *lock(&os.prepare_entered) = true;
        os.prepare_cv.notify_all();
    }
    let deadline = Instant::now() + timeout;
    let mut lower: Vec<&Arc<Peer>> = os.peers.values().filter(|p| p.rank < c.rank).collect();
    lower.sort_by_key(|p| p.rank);
    // This rank's side of each pair with a lower rank: connect and exchange. Each exchange only
    // needs the lower rank to have *entered* Prepare, so ranks never wait on each other in a
    // cycle.
    for peer in lower {
        prepare_with(c, os, peer, &mine, deadline, timeout)?;
    }
    // The higher ranks come to this rank's endpoint; their exchange completes the pair here.
    let mut entered = lock(&os.prepare_entered);
    loop {
        if c.is_destroyed() {
            return Err(err(HCCL_E_UNAVAIL, format!("{NAME}: the communicator was destroyed during Prepare")));
        }
        let missing = os.peers.values().filter(|p| p.rank > c.rank && !p.prepared.load(Ordering::Acquire));
        let Some(rank) = missing.map(|p| p.rank).min() else {
            os.prepared.store(true, Ordering::Release);
            return Ok(());
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(err(
                HCCL_E_TIMEOUT,
                format!(
                    "{NAME}: rank {rank} did not create the communicator and call HcclCommPrepare within {} s",
                    timeout.as_secs_f64()
                ),
            ));
        }
        entered = os.prepare_cv.wait_timeout(entered, left).unwrap_or_else(|e| e.into_inner()).0;
    }
}

/// Prepare's exchange with a lower rank, on a new connection (no lock is held while connecting
/// or waiting for the answer); the connection becomes this side's service connection.
fn prepare_with(
    c: &Comm,
    os: &OneSided,
    peer: &Peer,
    mine: &[(u64, u64)],
    deadline: Instant,
    timeout: Duration,
) -> EmuResult<()> {
    const NAME: &str = "HcclCommPrepare";
    let hello = endpoint::hello(c.key, c.rank, peer.rank, purpose::ONE_SIDED);
    let mut s = connect_link(NAME, peer.endpoint, &hello, peer.rank, deadline)?;
    let left = deadline.saturating_duration_since(Instant::now());
    let wait_ms = left.as_millis().min(u32::MAX as u128) as u32;
    let exchange = (|| {
        wire::set_timeouts(&s, Some(left + Duration::from_secs(5)))?;
        wire::write_frame(&mut s, kind::PREPARE, &Enc::new().u32(wait_ms).ranges(mine).0)?;
        let p = wire::expect_frame(&mut s, kind::PREPARE_ACK, MAX_RANGES * 16 + 4096)?;
        let mut d = Dec::new(&p);
        Ok::<_, std::io::Error>((d.u32()? as i32, d.str()?, d.ranges(MAX_RANGES)?))
    })();
    let (status, message, ranges) = exchange.map_err(|e| io_error(NAME, peer.rank, &e))?;
    match status {
        HCCL_SUCCESS => {
            peer.install(s, true);
            os.mark_prepared(peer, ranges);
            debug(|| format!("{NAME}: rank {} met rank {} (key {:#x})", c.rank, peer.rank, c.key));
            Ok(())
        }
        HCCL_E_TIMEOUT => Err(err(
            HCCL_E_TIMEOUT,
            format!("{NAME}: rank {} did not call HcclCommPrepare within {} s", peer.rank, timeout.as_secs_f64()),
        )),
        code => Err(err(code, format!("{NAME}: rank {} refused: {message}", peer.rank))),
    }
}

/// Opens this side's service connection to a prepared peer that has none yet (the lower rank of
/// a pair, on first use), without holding `peer.conn`. One attempt: the peer's endpoint was up
/// when the pair met, so a refusal or an unknown communicator means it is gone.
fn ensure_connection(name: &str, c: &Comm, peer: &Peer) -> EmuResult<()> {
    if lock(&peer.conn).is_some() {
        return Ok(());
    }
    if c.is_destroyed() || !peer.prepared.load(Ordering::Acquire) {
        return Err(err(HCCL_E_UNAVAIL, format!("{name}: not prepared for rank {}: call HcclCommPrepare", peer.rank)));
    }
    let t = config().connect_timeout;
    let unreachable = |e: std::io::Error| {
        err(HCCL_E_TCP_CONNECT, format!("{name}: cannot reach rank {} at {}: {e}", peer.rank, peer.endpoint))
    };
    let mut s = TcpStream::connect_timeout(&peer.endpoint, t).map_err(unreachable)?;
    let _ = s.set_nodelay(true);
    wire::set_timeouts(&s, Some(t)).map_err(unreachable)?;
    let hello = endpoint::hello(c.key, c.rank, peer.rank, purpose::ONE_SIDED);
    wire::write_frame(&mut s, kind::HELLO, &hello).map_err(unreachable)?;
    let (status, message) = endpoint::read_ack(&mut s).map_err(unreachable)?;
    if status != HCCL_SUCCESS {
        return Err(err(
            status,
            format!("{name}: rank {} at {} refused the connection: {message}", peer.rank, peer.endpoint),
        ));
    }
    peer.install(s, false);
    Ok(())
}

/// Connects this communicator to its peers and exchanges bound memory; blocking and mutual
/// (every peer must call it too). `timeout` in seconds; ≤ 0 means `HCCL_CONNECT_TIMEOUT`.
/// `cfg.topoType` must be 0 (FULLMESH).
///
/// # Safety
/// `cfg` is NULL or points to an [`HcclPrepareConfig`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclCommPrepare(comm: HcclComm, cfg: *const HcclPrepareConfig, timeout: i32) -> i32 {
    entry(
        Api::HcclOneSided,
        "HcclCommPrepare",
        || format!("{comm:p}, {cfg:p}, {timeout}"),
        || {
            let c = hccl::lookup(comm)?;
            let os = one_sided("HcclCommPrepare", &c)?;
            if cfg.is_null() {
                return Err(err(HCCL_E_PTR, "HcclCommPrepare: prepareConfig is NULL"));
            }
            // SAFETY: non-null, points to an HcclPrepareConfig per this function's contract.
            let cfg = unsafe { cfg.read_unaligned() };
            if cfg.topo_type != 0 {
                return Err(err(
                    HCCL_E_NOT_SUPPORT,
                    format!("HcclCommPrepare: topoType {} is not supported", cfg.topo_type),
                ));
            }
            let t = if timeout > 0 { Duration::from_secs(timeout as u64) } else { config().connect_timeout };
            prepare(&c, os, t)
        },
    )
}

struct Desc {
    local: u64,
    remote: u64,
    len: u64,
}

fn run_batch(comm: &Comm, peer: &Peer, op: u8, descs: &[Desc]) -> EmuResult<()> {
    let name = if op == OP_GET { "HcclBatchGet" } else { "HcclBatchPut" };
    let Some(os) = comm.one_sided.as_ref() else {
        return Err(err(ACL_ERROR_RT_INTERNAL_ERROR, "not a one-sided communicator"));
    };
    let bound = read(&os.bound);
    if let Some(d) = descs.iter().find(|d| !bound.iter().any(|m| m.contains(d.local, d.len))) {
        return Err(err(
            ACL_ERROR_RT_DEVICE_MEM_ERROR,
            format!("{name}: local memory {:#x}..+{} was unbound before the transfer ran", d.local, d.len),
        ));
    }
    if let Err(e) = ensure_connection(name, comm, peer) {
        return Err(err(ACL_ERROR_RT_LINK_ERROR, format!("{name} with rank {} failed: {}", peer.rank, e.message)));
    }
    let mut conn = lock(&peer.conn);
    let Some(s) = conn.as_mut() else {
        return Err(err(
            ACL_ERROR_RT_LINK_ERROR,
            format!("{name}: no connection to rank {} (communicator destroyed or link failed)", peer.rank),
        ));
    };
    let link_err = |e: &std::io::Error| {
        if wire::is_timeout(e) {
            err(
                ACL_ERROR_RT_TASK_TIMEOUT,
                format!(
                    "{name} with rank {} waited longer than HCCL_EXEC_TIMEOUT ({} s)",
                    peer.rank,
                    config().exec_timeout.as_secs()
                ),
            )
        } else {
            err(ACL_ERROR_RT_LINK_ERROR, format!("{name} with rank {} failed: the link broke ({e})", peer.rank))
        }
    };
    let broken = |e: std::io::Error| Fail::Broken(link_err(&e));
    let result = (|| {
        wire::set_timeouts(s, Some(config().exec_timeout)).map_err(broken)?;
        let mut e = Enc::new().u8(op).u32(descs.len() as u32);
        for d in descs {
            e = e.u64(d.remote).u64(d.len);
        }
        wire::write_frame(s, kind::BATCH, &e.0).map_err(broken)?;
        let p = wire::expect_frame(s, kind::BATCH_ACK, 4096).map_err(broken)?;
        let mut d = Dec::new(&p);
        let bad = |_| {
            Fail::Broken(err(
                ACL_ERROR_RT_SUSPECT_REMOTE_ERROR,
                format!("{name}: malformed answer from rank {}", peer.rank),
            ))
        };
        let (status, index, message) = (d.u32().map_err(bad)? as i32, d.u32().map_err(bad)?, d.str().map_err(bad)?);
        if status != HCCL_SUCCESS {
            return Err(Fail::Refused(err(
                ACL_ERROR_RT_SUSPECT_REMOTE_ERROR,
                format!(
                    "{name}: rank {} refused descriptor {index} ({}): {message}",
                    peer.rank,
                    hccl_error_text(status).to_string_lossy()
                ),
            )));
        }
        for d in descs {
            // SAFETY: `d.local..+len` lies in memory bound to this communicator (checked above
            // under the `bound` read lock, which is held until the transfer is over, so the
            // memory can be neither unbound nor deregistered meanwhile).
            let r = unsafe {
                if op == OP_GET {
                    wire::recv_raw(s, d.local as *mut u8, d.len as usize)
                } else {
                    wire::send_raw(s, d.local as *const u8, d.len as usize)
                }
            };
            r.map_err(broken)?;
        }
        if op == OP_PUT {
            let p = wire::expect_frame(s, kind::BATCH_DONE, 64).map_err(broken)?;
            let status = Dec::new(&p).u32().map_err(bad)? as i32;
            if status != HCCL_SUCCESS {
                return Err(Fail::Broken(err(
                    ACL_ERROR_RT_SUSPECT_REMOTE_ERROR,
                    format!("{name}: rank {} failed the write", peer.rank),
                )));
            }
        }
        Ok(())
    })();
    drop(bound);
    match result {
        Ok(()) => Ok(()),
        // A refusal leaves the connection usable.
        Err(Fail::Refused(e)) => Err(e),
        Err(Fail::Broken(e)) => {
            drop(conn);
            peer.drop_connection();
            Err(e)
        }
    }
}

enum Fail {
    Refused(EmuError),
    Broken(EmuError),
}

fn batch(
    name: &'static str,
    op: u8,
    comm: HcclComm,
    remote_rank: u32,
    desc: *const HcclOneSideOpDesc,
    n: u32,
    stream: AclrtStream,
) -> EmuResult<()> {
    let c = hccl::lookup(comm)?;
    let os = one_sided(name, &c)?;
    let s = hccl::hccl_stream(name, stream, &c)?;
    hccl::check_thread_device(name, &c)?;
    if remote_rank >= c.nranks || remote_rank == c.rank {
        return Err(err(
            HCCL_E_PARA,
            format!("{name}: rank {remote_rank} is not a peer (this is rank {} of {})", c.rank, c.nranks),
        ));
    }
    if desc.is_null() {
        return Err(err(HCCL_E_PTR, format!("{name}: desc is NULL")));
    }
    if n == 0 || n > HCCL_MAX_ONE_SIDED_DESCS {
        return Err(err(HCCL_E_PARA, format!("{name}: {n} descriptors (1..={HCCL_MAX_ONE_SIDED_DESCS} per call)")));
    }
    // SAFETY: non-null, `n` descriptors per this function's contract; read unaligned, copied.
    let raw: Vec<HcclOneSideOpDesc> = (0..n as usize).map(|i| unsafe { desc.add(i).read_unaligned() }).collect();
    let mut descs = Vec::with_capacity(raw.len());
    for (i, d) in raw.iter().enumerate() {
        let size = data_type_size(d.data_type)
            .ok_or_else(|| err(HCCL_E_PARA, format!("{name}: descriptor {i}: unknown data type {}", d.data_type)))?;
        let len = d
            .count
            .checked_mul(size)
            .filter(|l| *l <= isize::MAX as u64)
            .ok_or_else(|| err(HCCL_E_PARA, format!("{name}: descriptor {i}: count {} is too large", d.count)))?;
        if len == 0 {
            continue;
        }
        if d.local_addr.is_null() || d.remote_addr.is_null() {
            return Err(err(HCCL_E_PTR, format!("{name}: descriptor {i}: localAddr or remoteAddr is NULL")));
        }
        descs.push(Desc { local: d.local_addr as u64, remote: d.remote_addr as u64, len });
    }
    let peer = os
        .peers
        .get(&remote_rank)
        .cloned()
        .ok_or_else(|| err(HCCL_E_PARA, format!("{name}: no rank {remote_rank}")))?;
    if !peer.prepared.load(Ordering::Acquire) {
        return Err(err(
            HCCL_E_UNAVAIL,
            format!("{name}: not prepared for rank {remote_rank}: call HcclCommPrepare first"),
        ));
    }
    {
        let bound = read(&os.bound);
        for (i, d) in descs.iter().enumerate() {
            if !bound.iter().any(|m| m.contains(d.local, d.len)) {
                return Err(err(
                    HCCL_E_PARA,
                    format!(
                        "{name}: descriptor {i}: local {:#x}..+{} is not in memory bound to this communicator",
                        d.local, d.len
                    ),
                ));
            }
            if !os.reachable_in(&bound, d.local, d.len) {
                // Bound after Prepare: never registered with the NIC (HCOMM `hccl_one_sided_service.cc` `Prepare`/`BindMem`; docs/ascend.md rule 3).
                return Err(err(
                    HCCL_E_INTERNAL,
                    format!(
                        "{name}: descriptor {i}: Can't find localBuffer by key: local {:#x}..+{} was bound after \
                         HcclCommPrepare",
                        d.local, d.len
                    ),
                ));
            }
        }
    }
    // Only what the peer exchanged at Prepare is known here; it is never asked again (HCOMM `hccl_one_sided_service.cc` `Prepare`/`BindMem`; docs/ascend.md rule 3).
    if let Some((i, d)) = descs.iter().enumerate().find(|(_, d)| !peer.covers(d.remote, d.len)) {
        return Err(err(
            HCCL_E_INTERNAL,
            format!(
                "{name}: descriptor {i}: Can't find remoteBuffer by key: remote {:#x}..+{} is not in the memory rank \
                 {remote_rank} exchanged at HcclCommPrepare",
                d.remote, d.len
            ),
        ));
    }
    if descs.is_empty() {
        return Ok(());
    }
    let delay = faults().delay(name);
    s.submit(Box::new(move || {
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
        run_batch(&c, &peer, op, &descs)
    }))
    .map_err(|e| err(HCCL_E_PARA, e.message))
}

/// Queues writes of local memory into the peer's memory (1..=256 descriptors).
///
/// # Safety
/// `desc` is NULL or points to `desc_num` descriptors. Local memory is only read after the
/// emulator checked it is bound to the communicator.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclBatchPut(
    comm: HcclComm,
    remote_rank: u32,
    desc: *mut HcclOneSideOpDesc,
    desc_num: u32,
    stream: AclrtStream,
) -> i32 {
    entry(
        Api::HcclOneSided,
        "HcclBatchPut",
        || format!("{comm:p}, {remote_rank}, {desc:p}, {desc_num}, {stream:p}"),
        || batch("HcclBatchPut", OP_PUT, comm, remote_rank, desc, desc_num, stream),
    )
}

/// Queues reads of the peer's memory into local memory (1..=256 descriptors).
///
/// # Safety
/// `desc` is NULL or points to `desc_num` descriptors. Local memory is only written after the
/// emulator checked it is bound to the communicator.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclBatchGet(
    comm: HcclComm,
    remote_rank: u32,
    desc: *mut HcclOneSideOpDesc,
    desc_num: u32,
    stream: AclrtStream,
) -> i32 {
    entry(
        Api::HcclOneSided,
        "HcclBatchGet",
        || format!("{comm:p}, {remote_rank}, {desc:p}, {desc_num}, {stream:p}"),
        || batch("HcclBatchGet", OP_GET, comm, remote_rank, desc, desc_num, stream),
    )
}

fn refuse(s: &mut TcpStream, status: i32, index: u32, message: &str) -> std::io::Result<()> {
    wire::write_frame(s, kind::BATCH_ACK, &Enc::new().u32(status as u32).u32(index).str(message).0)
}

/// Serves one peer's connection to this process's communicator `(key, rank)`; the peer is
/// rank `src`. Every request is checked against the memory bound *now*; a request outside it
/// is refused and nothing is read or written.
pub(crate) fn serve_connection(mut s: TcpStream, key: u64, rank: u32, src: u32) {
    loop {
        if wire::set_timeouts(&s, None).is_err() {
            return;
        }
        let Ok((k, p)) = wire::read_frame(&mut s, MAX_RANGES * 16 + 4096) else { return };
        if wire::set_timeouts(&s, Some(config().exec_timeout)).is_err() {
            return;
        }
        let comm = endpoint::index_find(key, rank);
        let os = comm.as_ref().and_then(|c| c.one_sided.as_ref());
        let gone = "the communicator no longer exists at this endpoint";
        let ok = match k {
            kind::PREPARE => {
                let mut d = Dec::new(&p);
                let wait = d.u32().map(|ms| Duration::from_millis(ms as u64).min(Duration::from_secs(86_400)));
                let (Ok(wait), Ok(theirs)) = (wait, d.ranges(MAX_RANGES)) else { return };
                let peer = os.and_then(|os| os.peers.get(&src));
                match (os, peer) {
                    (Some(os), Some(peer)) => {
                        let deadline = Instant::now() + wait;
                        let mut entered = lock(&os.prepare_entered);
                        while !*entered && comm.as_ref().is_some_and(|c| !c.is_destroyed()) {
                            let left = deadline.saturating_duration_since(Instant::now());
                            if left.is_zero() {
                                break;
                            }
                            entered = os.prepare_cv.wait_timeout(entered, left).unwrap_or_else(|e| e.into_inner()).0;
                        }
                        let met = *entered;
                        drop(entered);
                        let reply = if met {
                            Enc::new().u32(HCCL_SUCCESS as u32).str("").ranges(&os.exported_ranges())
                        } else {
                            Enc::new().u32(HCCL_E_TIMEOUT as u32).str("HcclCommPrepare was not called here").ranges(&[])
                        };
                        let sent = wire::write_frame(&mut s, kind::PREPARE_ACK, &reply.0);
                        // The answer completes the pair on this side too: a Prepare here that
                        // waits for `src` returns now.
                        if met && sent.is_ok() {
                            os.mark_prepared(peer, theirs);
                            debug(|| format!("HcclCommPrepare: rank {rank} met rank {src} (key {key:#x})"));
                        }
                        sent
                    }
                    _ => wire::write_frame(
                        &mut s,
                        kind::PREPARE_ACK,
                        &Enc::new().u32(HCCL_E_NOT_FOUND as u32).str(gone).ranges(&[]).0,
                    ),
                }
            }
            kind::BATCH => match serve_batch(&mut s, os, &p) {
                Ok(true) => Ok(()),
                Ok(false) | Err(_) => return,
            },
            _ => return,
        };
        if ok.is_err() {
            return;
        }
        debug(|| format!("served frame kind {k} from rank {src} for rank {rank}"));
    }
}

/// Serves one batch; `Ok(false)` closes the connection (protocol violation).
fn serve_batch(s: &mut TcpStream, os: Option<&OneSided>, p: &[u8]) -> std::io::Result<bool> {
    let mut d = Dec::new(p);
    let (Ok(op), Ok(n)) = (d.u8(), d.u32()) else { return Ok(false) };
    if op != OP_GET && op != OP_PUT {
        return Ok(false);
    }
    if n == 0 || n > HCCL_MAX_ONE_SIDED_DESCS {
        refuse(s, HCCL_E_PARA, 0, &format!("{n} descriptors (1..={HCCL_MAX_ONE_SIDED_DESCS})"))?;
        return Ok(true);
    }
    let mut descs = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let (Ok(addr), Ok(len)) = (d.u64(), d.u64()) else { return Ok(false) };
        descs.push((addr, len));
    }
    let Some(os) = os else {
        refuse(s, HCCL_E_NOT_FOUND, 0, "the communicator no longer exists at this endpoint")?;
        return Ok(true);
    };
    let bound = read(&os.bound);
    for (i, &(addr, len)) in descs.iter().enumerate() {
        if len == 0 || !os.reachable_in(&bound, addr, len) {
            drop(bound);
            refuse(
                s,
                HCCL_E_PARA,
                i as u32,
                &format!("{addr:#x}..+{len} is not inside memory bound to the communicator and prepared"),
            )?;
            return Ok(true);
        }
    }
    refuse(s, HCCL_SUCCESS, 0, "")?;
    for &(addr, len) in &descs {
        // SAFETY: `addr..+len` lies inside bound global memory (checked above); the `bound`
        // read lock is held until the transfer ends, so it cannot be unbound, and memory
        // cannot be deregistered while bound.
        unsafe {
            if op == OP_GET {
                wire::send_raw(s, addr as *const u8, len as usize)?;
            } else {
                wire::recv_raw(s, addr as *mut u8, len as usize)?;
            }
        }
    }
    drop(bound);
    if op == OP_PUT {
        wire::write_frame(s, kind::BATCH_DONE, &Enc::new().u32(HCCL_SUCCESS as u32).0)?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use super::*;

    fn mem(addr: usize, size: usize) -> Arc<GlobalMem> {
        Arc::new(GlobalMem {
            handle: 1,
            addr,
            size,
            mem_type: HCCL_MEM_TYPE_DEVICE,
            device: 0,
            _alloc: None,
            state: Mutex::new(MemState::default()),
        })
    }

    fn os_with(bound: Vec<Arc<GlobalMem>>) -> OneSided {
        OneSided {
            exported: RwLock::new(Some(bound.clone())),
            prepared: AtomicBool::new(true),
            super_fields: false,
            version: "1.0".into(),
            bound: RwLock::new(bound),
            prepare_entered: Mutex::new(true),
            prepare_cv: Condvar::new(),
            peers: HashMap::new(),
        }
    }

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    fn batch_frame(op: u8, descs: &[(u64, u64)]) -> Vec<u8> {
        let mut e = Enc::new().u8(op).u32(descs.len() as u32);
        for &(a, l) in descs {
            e = e.u64(a).u64(l);
        }
        e.0
    }

    fn ack(s: &mut TcpStream) -> (i32, u32, String) {
        let p = wire::expect_frame(s, kind::BATCH_ACK, 4096).unwrap();
        let mut d = Dec::new(&p);
        (d.u32().unwrap() as i32, d.u32().unwrap(), d.str().unwrap())
    }

    #[test]
    fn the_server_refuses_anything_outside_bound_memory() {
        let mut buf = vec![7u8; 4096];
        let base = buf.as_mut_ptr() as u64;
        let os = os_with(vec![mem(base as usize, buf.len())]);
        let (mut client, mut server) = pair();
        let attacks: Vec<Vec<(u64, u64)>> = vec![
            vec![(base, 4097)],
            vec![(base + 4096, 1)],
            vec![(base - 1, 2)],
            vec![(base, 16), (u64::MAX - 8, 16)],
            vec![(base + 100, u64::MAX)],
            vec![(0, 1)],
        ];
        for descs in &attacks {
            let frame = batch_frame(OP_GET, descs);
            assert!(serve_batch(&mut server, Some(&os), &frame).unwrap());
            let (status, _, message) = ack(&mut client);
            assert_eq!(status, HCCL_E_PARA, "{descs:?}: {message}");
        }
        let too_many = batch_frame(OP_PUT, &vec![(base, 1); 257]);
        assert!(serve_batch(&mut server, Some(&os), &too_many).unwrap());
        assert_eq!(ack(&mut client).0, HCCL_E_PARA);
        assert!(serve_batch(&mut server, None, &batch_frame(OP_GET, &[(base, 1)])).unwrap());
        assert_eq!(ack(&mut client).0, HCCL_E_NOT_FOUND);
        assert!(!serve_batch(&mut server, Some(&os), &[9, 1, 0, 0, 0]).unwrap(), "unknown op closes");
        assert!(!serve_batch(&mut server, Some(&os), &[OP_GET, 2, 0, 0, 0, 1]).unwrap(), "truncated closes");
        assert_eq!(buf, vec![7u8; 4096], "refused requests touched nothing");
    }

    #[test]
    fn the_server_reads_and_writes_bound_memory() {
        let mut buf: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        let base = buf.as_mut_ptr() as u64;
        let os = os_with(vec![mem(base as usize, buf.len())]);
        let (mut client, mut server) = pair();
        assert!(serve_batch(&mut server, Some(&os), &batch_frame(OP_GET, &[(base + 10, 5), (base, 3)])).unwrap());
        assert_eq!(ack(&mut client).0, HCCL_SUCCESS);
        let mut got = [0u8; 8];
        std::io::Read::read_exact(&mut client, &mut got).unwrap();
        assert_eq!(got, [10, 11, 12, 13, 14, 0, 1, 2]);

        client.write_all(&[0xaa; 4]).unwrap();
        assert!(serve_batch(&mut server, Some(&os), &batch_frame(OP_PUT, &[(base + 4092, 4)])).unwrap());
        assert_eq!(ack(&mut client).0, HCCL_SUCCESS);
        wire::expect_frame(&mut client, kind::BATCH_DONE, 64).unwrap();
        drop(os);
        assert_eq!(&buf[4092..], &[0xaa; 4]);
    }
}
