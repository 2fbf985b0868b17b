//! Communicators (common state) and the HCCL exports that apply to every kind of communicator.
//!
//! A communicator is created by `HcclCommInitRootInfo` (two-sided links between the ranks),
//! `HcclCommInitClusterInfo` (rank table file, two-sided links) or
//! `HcclCommInitClusterInfoMemConfig` (rank table string, one-sided service only). Like a
//! device resource it belongs to the device that was current on the creating thread; the
//! operations that queue work (`HcclSend`, `HcclRecv`, `HcclBatchGet`, `HcclBatchPut`) need
//! that device current on the calling thread and a stream of that device; so do the
//! communicator initialisations (`HCCL_E_RUNTIME` on a thread without a device). Destroy,
//! rank queries, bind/unbind and (de)registration do not look at the calling thread.

use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex};

use crate::boundary::{Api, entry, entry_ptr, lock};
use crate::codes::*;
use crate::device::{self, Context};
use crate::endpoint;
use crate::handles::{self, Kind};
use crate::hccl_two_sided::Link;
use crate::rank_table::RankTable;
use crate::stream::{self, Stream};
use crate::types::HcclComm;

/// How a communicator was created (decides which operations it supports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// `HcclCommInitRootInfo`: send/recv.
    RootInfo,
    /// `HcclCommInitClusterInfo`: send/recv.
    Cluster,
    /// `HcclCommInitClusterInfoMemConfig`: the one-sided service.
    #[cfg_attr(not(feature = "onesided"), allow(dead_code))]
    OneSided,
}

/// A communicator.
#[derive(Debug)]
pub(crate) struct Comm {
    pub(crate) handle: u64,
    pub(crate) rank: u32,
    pub(crate) nranks: u32,
    pub(crate) user_id: u32,
    /// Identifies the communicator across processes (root id, or the rank table's key).
    pub(crate) key: u64,
    pub(crate) role: Role,
    pub(crate) table: Option<RankTable>,
    /// Two-sided links by peer rank.
    pub(crate) links: Mutex<HashMap<u32, Arc<Link>>>,
    /// Cluster links accepted by the endpoint listener, waiting for `HcclCommInitClusterInfo`.
    pub(crate) pending: Mutex<HashMap<u32, TcpStream>>,
    pub(crate) pending_cv: Condvar,
    /// Connections the endpoint listener serves for this communicator (closed on destroy).
    pub(crate) served: Mutex<Vec<TcpStream>>,
    pub(crate) endpoint: Mutex<Option<endpoint::Guard>>,
    destroyed: AtomicBool,
    #[cfg(feature = "onesided")]
    pub(crate) one_sided: Option<crate::hccl_one_sided::OneSided>,
}

impl Comm {
    /// A communicator for the calling thread's device.
    pub(crate) fn new(ctx: &Context, rank: u32, nranks: u32, key: u64, role: Role, table: Option<RankTable>) -> Comm {
        Comm {
            handle: handles::new_handle(Kind::Comm),
            rank,
            nranks,
            user_id: ctx.user_id,
            key,
            role,
            table,
            links: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            pending_cv: Condvar::new(),
            served: Mutex::new(Vec::new()),
            endpoint: Mutex::new(None),
            destroyed: AtomicBool::new(false),
            #[cfg(feature = "onesided")]
            one_sided: None,
        }
    }

    /// Whether `HcclCommDestroy` ran.
    pub(crate) fn is_destroyed(&self) -> bool {
        self.destroyed.load(Ordering::Acquire)
    }

    /// Tears the communicator down: links closed (queued operations on them fail), bound
    /// memory released, endpoint reference dropped.
    pub(crate) fn teardown(&self) {
        self.destroyed.store(true, Ordering::Release);
        endpoint::index_remove(self);
        for (_, link) in lock(&self.links).drain() {
            link.shutdown();
        }
        for s in lock(&self.pending).drain().map(|(_, s)| s).chain(lock(&self.served).drain(..)) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.pending_cv.notify_all();
        #[cfg(feature = "onesided")]
        if let Some(os) = &self.one_sided {
            os.teardown(self.handle);
        }
        lock(&self.endpoint).take();
    }
}

static COMMS: LazyLock<Mutex<HashMap<u64, Arc<Comm>>>> = LazyLock::new(Default::default);

/// Makes a communicator reachable through its handle.
pub(crate) fn register(comm: Arc<Comm>) -> u64 {
    let h = comm.handle;
    lock(&COMMS).insert(h, comm);
    h
}

/// The communicator behind an `HcclComm` (NULL → `HCCL_E_PTR`, unknown → `HCCL_E_PARA`).
pub(crate) fn lookup(ptr: *const c_void) -> EmuResult<Arc<Comm>> {
    if ptr.is_null() {
        return Err(err(HCCL_E_PTR, "comm is NULL"));
    }
    handles::from_ptr(Kind::Comm, ptr)
        .and_then(|h| lock(&COMMS).get(&h).cloned())
        .ok_or_else(|| err(HCCL_E_PARA, format!("{ptr:p} is not a live HCCL communicator")))
}

/// The calling thread's device for an HCCL call (`HCCL_E_RUNTIME` when it has none).
pub(crate) fn current_device(name: &str) -> EmuResult<Arc<Context>> {
    device::current().map_err(|e| err(HCCL_E_RUNTIME, format!("{name}: {}", e.message)))
}

/// Checks that the calling thread is on the communicator's device.
pub(crate) fn check_thread_device(name: &str, comm: &Comm) -> EmuResult<()> {
    let ctx = current_device(name)?;
    if ctx.user_id != comm.user_id {
        return Err(err(
            HCCL_E_PARA,
            format!(
                "{name}: this thread is on device {} but the communicator belongs to device {}",
                ctx.user_id, comm.user_id
            ),
        ));
    }
    Ok(())
}

/// The stream of an HCCL call: must exist and belong to the communicator's device.
pub(crate) fn hccl_stream(name: &str, ptr: *const c_void, comm: &Comm) -> EmuResult<Arc<Stream>> {
    if ptr.is_null() {
        return Err(err(HCCL_E_PTR, format!("{name}: stream is NULL")));
    }
    let s = stream::lookup(ptr).ok_or_else(|| err(HCCL_E_PARA, format!("{name}: {ptr:p} is not a live stream")))?;
    if s.user_id != comm.user_id {
        return Err(err(
            HCCL_E_PARA,
            format!("{name}: the stream belongs to device {}, the communicator to device {}", s.user_id, comm.user_id),
        ));
    }
    Ok(s)
}

/// Destroys a communicator: its links close (operations still queued on them fail). A
/// one-sided communicator that still has memory bound is refused with `HCCL_E_PARA` and stays.
///
/// # Safety
/// No memory is dereferenced; the handle is looked up in a registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclCommDestroy(comm: HcclComm) -> i32 {
    entry(
        Api::Hccl,
        "HcclCommDestroy",
        || format!("{comm:p}"),
        || {
            let c = lookup(comm)?;
            // A one-sided communicator with memory still bound is refused and kept (HCOMM `hccl_one_sided_service.cc` `DeInit`, docs/ascend.md rule 2).
            #[cfg(feature = "onesided")]
            if let Some(os) = &c.one_sided
                && os.has_bound()
            {
                return Err(err(
                    HCCL_E_PARA,
                    "HcclCommDestroy: memories still bound to the communicator: call HcclCommUnbindMem for each first",
                ));
            }
            lock(&COMMS).remove(&c.handle);
            c.teardown();
            Ok(())
        },
    )
}

/// This process's rank in the communicator.
///
/// # Safety
/// `rank` is NULL or valid for writing a `uint32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclGetRankId(comm: HcclComm, rank: *mut u32) -> i32 {
    entry(
        Api::Hccl,
        "HcclGetRankId",
        || format!("{comm:p}, {rank:p}"),
        || {
            let c = lookup(comm)?;
            if rank.is_null() {
                return Err(err(HCCL_E_PTR, "rank is NULL"));
            }
            // SAFETY: non-null, valid per this function's contract.
            unsafe { rank.write_unaligned(c.rank) };
            Ok(())
        },
    )
}

/// Number of ranks in the communicator.
///
/// # Safety
/// `rank_size` is NULL or valid for writing a `uint32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclGetRankSize(comm: HcclComm, rank_size: *mut u32) -> i32 {
    entry(
        Api::Hccl,
        "HcclGetRankSize",
        || format!("{comm:p}, {rank_size:p}"),
        || {
            let c = lookup(comm)?;
            if rank_size.is_null() {
                return Err(err(HCCL_E_PTR, "rankSize is NULL"));
            }
            // SAFETY: non-null, valid per this function's contract.
            unsafe { rank_size.write_unaligned(c.nranks) };
            Ok(())
        },
    )
}

/// Readable text of an `HcclResult` (static; unknown codes get a generic text).
///
/// # Safety
/// No pointer arguments.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclGetErrorString(code: i32) -> *const c_char {
    entry_ptr("HcclGetErrorString", || hccl_error_text(code).as_ptr())
}
