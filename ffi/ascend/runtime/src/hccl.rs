//! HCCL: root info, communicators (two-sided init + send/recv; one-sided init from a rank
//! table, bind, prepare, batch get/put) and global memory handles.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::marker::PhantomData;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, Weak};
use std::time::Duration;

use ferry_ascend_sys::{Library, raw};

use crate::device::{Device, Stream};
use crate::error::{AscendError, Checks, Result};

/// HCCL's communicator init and destroy change unlocked process globals and must never run at
/// the same time in one process (HCOMM `op_base.cc`; HIXL serialises
/// `HcclCommInitClusterInfoMemConfig` with one process-wide mutex because "the underlying hccl
/// library does not support parallel HcclCommInitClusterInfoMemConfig calls"). Every
/// one-sided init and every destroy in this process, whichever engine makes it, holds this lock.
/// The collective two-sided init (`HcclCommInitRootInfo`) does not: it blocks until every rank
/// joined, and two engines of one process initialising with each other would deadlock on it.
static LIFECYCLE: Mutex<()> = Mutex::new(());

fn lifecycle() -> MutexGuard<'static, ()> {
    LIFECYCLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// An `HcclRootInfo`: what the root rank hands the others for a two-sided init.
#[derive(Clone)]
pub struct RootInfo(Box<raw::HcclRootInfo>);

impl std::fmt::Debug for RootInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RootInfo(..)")
    }
}

impl RootInfo {
    /// `HcclGetRootInfo` on `device` (this process becomes the root of the next init).
    pub fn new(device: &Device) -> Result<Self> {
        let lib = device.library();
        let mut info = Box::new(raw::HcclRootInfo { internal: [0; raw::HCCL_ROOT_INFO_BYTES] });
        // SAFETY: `info` is a valid, writable HcclRootInfo.
        let code = unsafe { (lib.hccl().get_root_info)(&mut *info) };
        lib.hccl_check("HcclGetRootInfo", code)?;
        Ok(Self(info))
    }

    /// The opaque bytes (to send to the other ranks).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.internal.iter().map(|&c| c as u8).collect()
    }

    /// Rebuilds a root info from [`to_bytes`](Self::to_bytes) output.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != raw::HCCL_ROOT_INFO_BYTES {
            return Err(AscendError::InvalidArgument(format!(
                "root info has {} bytes, expected {}",
                bytes.len(),
                raw::HCCL_ROOT_INFO_BYTES
            )));
        }
        let mut info = Box::new(raw::HcclRootInfo { internal: [0; raw::HCCL_ROOT_INFO_BYTES] });
        for (d, &s) in info.internal.iter_mut().zip(bytes) {
            *d = s as std::ffi::c_char;
        }
        Ok(Self(info))
    }
}

/// Kind of memory registered with [`GlobalMem::register`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Device memory (`CommMem.type` 0).
    Device,
    /// Host memory (`CommMem.type` 1).
    Host,
}

/// Memory registered with the one-sided service (`HcclRegisterGlobalMem`) on one device: one
/// handle may be bound to several communicators of that device, and every engine of the process
/// that registers the same range on the same device shares it ([`GlobalMem::register`] hands out one `Arc` per range:
/// HCCL answers an identical range with the same handle and keeps no count, so the first
/// deregistration would pull it from under the others). Deregistered when the last holder
/// drops it (unbind it from every communicator first).
pub struct GlobalMem {
    lib: Arc<Library>,
    handle: *mut c_void,
    addr: u64,
    len: u64,
    kind: MemKind,
}

// SAFETY: the handle is an opaque token of HCCL's process-wide registration table, not tied to
// a thread; HCCL's one-sided functions take it from any thread bound to the device.
unsafe impl Send for GlobalMem {}
// SAFETY: as above; this type never mutates through a shared reference.
unsafe impl Sync for GlobalMem {}

impl std::fmt::Debug for GlobalMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlobalMem").field("addr", &self.addr).field("len", &self.len).field("kind", &self.kind).finish()
    }
}

impl GlobalMem {
    /// Registers `[addr, addr + len)` with the one-sided service, or returns this process's
    /// live registration of exactly that range (see the type's doc).
    ///
    /// # Safety
    /// The range must be memory of this process of the given kind, valid until the last holder
    /// of the returned handle dropped it, and readable and writable by peers bound to it
    /// meanwhile.
    pub unsafe fn register(device: &Device, kind: MemKind, addr: u64, len: u64) -> Result<Arc<Self>> {
        // HCCL keeps one registry per device: the same range on another device is another
        // registration (HCOMM `global_mem_manager.cc`, `GlobalMemRegMgr::GetInstance`).
        let key = (device.user_id(), addr, len, kind);
        let mut registrations = registrations();
        if let Some(live) = registrations.get(&key).and_then(Weak::upgrade) {
            return Ok(live);
        }
        let lib = device.library();
        let f = lib.one_sided("HcclRegisterGlobalMem")?;
        let mem = raw::CommMem {
            mem_type: match kind {
                MemKind::Device => raw::comm_mem_type::DEVICE,
                MemKind::Host => raw::comm_mem_type::HOST,
            },
            addr: addr as *mut c_void,
            size: len,
        };
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: `mem` and `handle` are valid for the call; the caller vouches for the range.
        let code = unsafe { (f.register_global_mem)(&mem, &mut handle) };
        lib.hccl_check("HcclRegisterGlobalMem", code)?;
        let g = Arc::new(Self { lib: lib.clone(), handle, addr, len, kind });
        registrations.retain(|_, w| w.strong_count() > 0);
        registrations.insert(key, Arc::downgrade(&g));
        Ok(g)
    }

    /// How many holders share this registration (engines of this process, and the
    /// communicators it is bound to).
    pub fn holders(self: &Arc<Self>) -> usize {
        Arc::strong_count(self)
    }

    /// First byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false (HCCL refuses empty registrations).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device or host.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// Deregisters now, reporting the outcome (dropping does the same, silently).
    pub fn deregister(mut self) -> Result<()> {
        self.deregister_inner()
    }

    fn deregister_inner(&mut self) -> Result<()> {
        if self.handle.is_null() {
            return Ok(());
        }
        let f = self.lib.one_sided("HcclDeregisterGlobalMem")?;
        // Under the registry's lock, so that a registration of the same range cannot be handed
        // HCCL's same handle while this one deregisters it.
        let mut registrations = registrations();
        registrations.retain(|_, w| w.strong_count() > 0);
        let handle = std::mem::replace(&mut self.handle, std::ptr::null_mut());
        // SAFETY: `handle` came from HcclRegisterGlobalMem and is deregistered once (the field
        // is cleared above).
        let code = unsafe { (f.deregister_global_mem)(handle) };
        self.lib.hccl_check("HcclDeregisterGlobalMem", code)
    }
}

impl Drop for GlobalMem {
    fn drop(&mut self) {
        if let Err(e) = self.deregister_inner() {
            tracing::warn!(addr = self.addr, len = self.len, error = %e, "deregistering global memory failed");
        }
    }
}

/// Live registrations by (user device, address, length, kind).
type Registrations = HashMap<(u32, u64, u64, MemKind), Weak<GlobalMem>>;

fn registrations() -> MutexGuard<'static, Registrations> {
    static REGISTRATIONS: LazyLock<Mutex<Registrations>> = LazyLock::new(Default::default);
    REGISTRATIONS.lock().unwrap_or_else(|p| p.into_inner())
}

/// One transfer of a one-sided batch: `len` bytes between a local and a remote address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OneSidedOp {
    /// Local address (in memory bound to the communicator).
    pub local: u64,
    /// The remote rank's address (in memory it bound to the communicator).
    pub remote: u64,
    /// Bytes.
    pub len: u64,
}

/// An HCCL communicator; destroyed when dropped (on its thread). Not `Send`.
pub struct Communicator {
    lib: Arc<Library>,
    raw: raw::HcclComm,
    _bound: PhantomData<*const ()>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator").field("raw", &self.raw).finish()
    }
}

impl Communicator {
    /// Two-sided init: `HcclCommInitRootInfo(n_ranks, root, rank)`. Blocks until every rank
    /// joined (or HCCL's connect timeout, `HCCL_CONNECT_TIMEOUT`).
    pub fn init_root_info(device: &Device, n_ranks: u32, root: &RootInfo, rank: u32) -> Result<Self> {
        let lib = device.library();
        let mut comm: raw::HcclComm = std::ptr::null_mut();
        // SAFETY: `root` points to a valid HcclRootInfo; `comm` is a valid out-pointer.
        let code = unsafe { (lib.hccl().comm_init_root_info)(n_ranks, &*root.0, rank, &mut comm) };
        lib.hccl_check("HcclCommInitRootInfo", code)?;
        Ok(Self { lib: lib.clone(), raw: comm, _bound: PhantomData })
    }

    /// One-sided init: `HcclCommInitClusterInfoMemConfig` with the rank table as a JSON string
    /// and an `HcclCommConfig` (version 5) named `name`. Blocks until the ranks met.
    pub fn init_from_rank_table(device: &Device, rank_table_json: &str, rank: u32, name: &str) -> Result<Self> {
        let lib = device.library();
        let f = lib.one_sided("HcclCommInitClusterInfoMemConfig")?;
        let table = CString::new(rank_table_json)
            .map_err(|_| AscendError::InvalidArgument("rank table contains a NUL byte".into()))?;
        let mut config = comm_config(name)?;
        let mut comm: raw::HcclComm = std::ptr::null_mut();
        let _serial = lifecycle();
        // SAFETY: `table` is NUL-terminated, `config` a valid HcclCommConfig (size, magic and
        // version set), `comm` a valid out-pointer; all outlive the call.
        let code = unsafe {
            (f.init_cluster_info_mem_config)(
                table.as_ptr(),
                rank,
                (&mut config as *mut raw::HcclCommConfig).cast(),
                &mut comm,
            )
        };
        lib.hccl_check("HcclCommInitClusterInfoMemConfig", code)?;
        Ok(Self { lib: lib.clone(), raw: comm, _bound: PhantomData })
    }

    /// Queues `HcclSend` of `len` bytes at `addr` to rank `peer` on `stream`.
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay valid and unchanged until the stream ran the send.
    pub unsafe fn send(&self, addr: u64, len: u64, peer: u32, stream: &Stream) -> Result<()> {
        // SAFETY: the caller vouches for the buffer; comm and stream are live on this thread.
        let code = unsafe {
            (self.lib.hccl().send)(addr as *mut c_void, len, raw::HCCL_DATA_TYPE_UINT8, peer, self.raw, stream.raw())
        };
        self.lib.hccl_check("HcclSend", code)
    }

    /// Queues `HcclRecv` of `len` bytes into `addr` from rank `peer` on `stream`.
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay valid, and untouched by anyone else, until the stream ran
    /// the receive.
    pub unsafe fn recv(&self, addr: u64, len: u64, peer: u32, stream: &Stream) -> Result<()> {
        // SAFETY: the caller vouches for the buffer; comm and stream are live on this thread.
        let code = unsafe {
            (self.lib.hccl().recv)(addr as *mut c_void, len, raw::HCCL_DATA_TYPE_UINT8, peer, self.raw, stream.raw())
        };
        self.lib.hccl_check("HcclRecv", code)
    }

    /// `HcclCommBindMem`: peers of this communicator may now reach `mem`.
    pub fn bind(&self, mem: &GlobalMem) -> Result<()> {
        let f = self.lib.one_sided("HcclCommBindMem")?;
        // SAFETY: live communicator and registration handle.
        let code = unsafe { (f.bind_mem)(self.raw, mem.handle) };
        self.lib.hccl_check("HcclCommBindMem", code)
    }

    /// `HcclCommUnbindMem`.
    pub fn unbind(&self, mem: &GlobalMem) -> Result<()> {
        let f = self.lib.one_sided("HcclCommUnbindMem")?;
        // SAFETY: live communicator and registration handle.
        let code = unsafe { (f.unbind_mem)(self.raw, mem.handle) };
        self.lib.hccl_check("HcclCommUnbindMem", code)
    }

    /// `HcclCommPrepare` (full mesh) with a timeout (whole seconds, at least one).
    pub fn prepare(&self, timeout: Duration) -> Result<()> {
        let f = self.lib.one_sided("HcclCommPrepare")?;
        let cfg = raw::HcclPrepareConfig::default();
        let secs = i32::try_from(timeout.as_secs().max(1)).unwrap_or(i32::MAX);
        // SAFETY: live communicator; `cfg` valid for the call.
        let code = unsafe { (f.prepare)(self.raw, &cfg, secs) };
        self.lib.hccl_check("HcclCommPrepare", code)
    }

    /// Queues one-sided reads (remote → local) on `stream`, in calls of at most 256
    /// descriptors. Returns the number of calls made.
    ///
    /// # Safety
    /// Every local range must be memory bound to this communicator, valid and untouched by
    /// anyone else until the stream ran the reads.
    pub unsafe fn batch_get(&self, remote_rank: u32, ops: &[OneSidedOp], stream: &Stream) -> Result<usize> {
        let f = self.lib.one_sided("HcclBatchGet")?.batch_get;
        // SAFETY: forwarded contract.
        unsafe { self.batch(f, "HcclBatchGet", remote_rank, ops, stream) }
    }

    /// Queues one-sided writes (local → remote) on `stream`, in calls of at most 256
    /// descriptors. Returns the number of calls made.
    ///
    /// # Safety
    /// Every local range must be memory bound to this communicator, valid and unchanged until
    /// the stream ran the writes.
    pub unsafe fn batch_put(&self, remote_rank: u32, ops: &[OneSidedOp], stream: &Stream) -> Result<usize> {
        let f = self.lib.one_sided("HcclBatchPut")?.batch_put;
        // SAFETY: forwarded contract.
        unsafe { self.batch(f, "HcclBatchPut", remote_rank, ops, stream) }
    }

    unsafe fn batch(
        &self,
        f: raw::HcclBatchOp,
        call: &'static str,
        remote_rank: u32,
        ops: &[OneSidedOp],
        stream: &Stream,
    ) -> Result<usize> {
        let mut calls = 0;
        let mut descs: Vec<raw::HcclOneSideOpDesc> = Vec::with_capacity(ops.len().min(raw::MAX_BATCH_DESCRIPTORS));
        for chunk in ops.chunks(raw::MAX_BATCH_DESCRIPTORS) {
            descs.clear();
            descs.extend(chunk.iter().map(|op| raw::HcclOneSideOpDesc {
                local_addr: op.local as *mut c_void,
                remote_addr: op.remote as *mut c_void,
                count: op.len,
                data_type: raw::HCCL_DATA_TYPE_UINT8,
            }));
            // SAFETY: `descs` holds `chunk.len()` (<= 256) valid descriptors for the call; the
            // caller vouches for the memory they name; comm and stream are live.
            let code = unsafe { f(self.raw, remote_rank, descs.as_mut_ptr(), descs.len() as u32, stream.raw()) };
            self.lib.hccl_check(call, code)?;
            calls += 1;
        }
        Ok(calls)
    }

    /// `HcclGetRankId`, when available.
    pub fn rank(&self) -> Option<u32> {
        let f = self.lib.optional().rank_id?;
        let mut r = 0;
        // SAFETY: live communicator; valid out-pointer.
        (unsafe { f(self.raw, &mut r) } == 0).then_some(r)
    }

    /// `HcclGetRankSize`, when available.
    pub fn size(&self) -> Option<u32> {
        let f = self.lib.optional().rank_size?;
        let mut n = 0;
        // SAFETY: live communicator; valid out-pointer.
        (unsafe { f(self.raw, &mut n) } == 0).then_some(n)
    }

    /// Destroys the communicator now, reporting the outcome (dropping does the same, silently).
    pub fn destroy(mut self) -> Result<()> {
        self.destroy_inner()
    }

    fn destroy_inner(&mut self) -> Result<()> {
        if self.raw.is_null() {
            return Ok(());
        }
        let _serial = lifecycle();
        // SAFETY: a live communicator created on this thread (the type is not Send); HCCL
        // refuses to destroy a one-sided communicator with memory still bound and keeps it, so
        // the handle is cleared only once the destroy succeeded (a failed one may be retried).
        let code = unsafe { (self.lib.hccl().comm_destroy)(self.raw) };
        self.lib.hccl_check("HcclCommDestroy", code)?;
        self.raw = std::ptr::null_mut();
        Ok(())
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if let Err(e) = self.destroy_inner() {
            tracing::debug!(error = %e, "destroying a communicator failed");
        }
    }
}

/// Builds an `HcclCommConfig` version 5 the way ADXL fills it (200 MB buffers, default RDMA
/// traffic class and service level), named `name` (at most 127 bytes).
fn comm_config(name: &str) -> Result<raw::HcclCommConfig> {
    if name.len() >= raw::HCCL_COMM_NAME_BYTES || name.contains('\0') {
        return Err(AscendError::InvalidArgument(format!("communicator name {name:?} is too long or has a NUL")));
    }
    let mut comm_name = [0 as std::ffi::c_char; raw::HCCL_COMM_NAME_BYTES];
    for (d, &s) in comm_name.iter_mut().zip(name.as_bytes()) {
        *d = s as std::ffi::c_char;
    }
    Ok(raw::HcclCommConfig {
        size: std::mem::size_of::<raw::HcclCommConfig>(),
        magic: raw::HCCL_COMM_CONFIG_MAGIC,
        version: raw::HCCL_COMM_CONFIG_VERSION,
        reserved: 0,
        buffer_size_mb: 200,
        deterministic: 0,
        comm_name,
        udi: [0; raw::HCCL_COMM_NAME_BYTES],
        op_expansion_mode: 0,
        rdma_traffic_class: u32::MAX,
        rdma_service_level: u32::MAX,
    })
}
