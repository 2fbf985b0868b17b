//! One peer: its device thread (and communicators), the driver task that runs its transfers in
//! order, the direct path that queues a one-sided batch on the device thread from the caller's
//! thread when the driver has nothing to do, and the epoch agreement that lets either side
//! (re)build their one-sided communicator.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ferry_ascend_runtime::{
    AscendError, Communicator, Device, DeviceBuffer, DeviceThread, Drained, GlobalMem, OneSidedOp, RootInfo, Stream,
};
use ferry_core::{Error, ErrorKind, Opcode, OpenSegment, Result};
use tokio::net::TcpStream;
use tokio::sync::{Notify, OnceCell, mpsc, oneshot, watch};

use crate::counters::{self, bump};
use crate::identity::{PairTable, PeerIdentity};
use crate::pending::Pending;
use crate::watchdog::{self, Held, Watchdog};
use crate::wire::{self, MAX_OPS_PER_REQUEST, Reply, Request, WireOp};
use crate::{Placement, Shared, hccl_error, run_on};

/// A one-sided communicator of this pair.
pub(crate) struct OneSided {
    epoch: u64,
    comm: Communicator,
    peer_rank: u32,
    /// Memory bound to it before its Prepare, by address: all of this side it reaches.
    bound: BTreeMap<u64, Arc<GlobalMem>>,
    /// What the peer bound before its Prepare (from the control channel), when known.
    peer_buffers: Option<Vec<(u64, u64)>>,
    _counted: CardCommunicators,
}

/// One live one-sided communicator of this process on a card, counted: HIXL documents at most
/// [`MAX_COMMUNICATORS_PER_CARD`](crate::MAX_COMMUNICATORS_PER_CARD) per card (its
/// `HIXL-interface.md`, Connect), and more risk device OOM, so passing it is warned about.
struct CardCommunicators(u32);

impl CardCommunicators {
    fn per_card() -> std::sync::MutexGuard<'static, std::collections::HashMap<u32, usize>> {
        static PER_CARD: std::sync::LazyLock<Mutex<std::collections::HashMap<u32, usize>>> =
            std::sync::LazyLock::new(Default::default);
        PER_CARD.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn open(card: u32) -> Self {
        let mut all = Self::per_card();
        let n = all.entry(card).or_default();
        *n += 1;
        if *n > crate::MAX_COMMUNICATORS_PER_CARD {
            tracing::warn!(
                card,
                communicators = *n,
                "more one-sided communicators on this card than HIXL's documented limit of {}: device memory may \
                 run out; fewer peers per card, or fewer engines per process, keep under it",
                crate::MAX_COMMUNICATORS_PER_CARD
            );
        }
        Self(card)
    }
}

impl Drop for CardCommunicators {
    fn drop(&mut self) {
        if let Some(n) = Self::per_card().get_mut(&self.0) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Whether `[addr, addr + len)` lies inside one of `ranges`.
fn within(ranges: impl IntoIterator<Item = (u64, u64)>, addr: u64, len: u64) -> bool {
    ranges.into_iter().any(|(a, l)| addr >= a && addr.checked_add(len).is_some_and(|e| e <= a.saturating_add(l)))
}

impl OneSided {
    /// The first request (local or remote range) this communicator cannot reach: HCCL's
    /// Prepare exchanged memory once, so memory registered afterwards needs a new
    /// communicator (HCOMM `hccl_one_sided_service.cc`; HIXL: register memory before
    /// connecting). `None` when it reaches all of them.
    fn unreachable(&self, ops: &[OneSidedOp]) -> Option<(bool, OneSidedOp)> {
        // The bound region that could hold an address is the last one starting at or before it.
        let local = |addr: u64| self.bound.range(..=addr).next_back().map(|(_, g)| (g.addr(), g.len()));
        for op in ops {
            if !within(local(op.local), op.local, op.len) {
                return Some((true, *op));
            }
            if let Some(peer) = &self.peer_buffers
                && !within(peer.iter().copied(), op.remote, op.len)
            {
                return Some((false, *op));
            }
        }
        None
    }
}

/// State on a peer's device thread (initiator side, and the one-sided communicator).
pub(crate) struct PeerState {
    stream: Stream,
    one_sided: Option<OneSided>,
    /// Two-sided communicator this side initiates on (this side is rank 0).
    two_sided: Option<(u64, Communicator)>,
}

// SAFETY: a stream, HCCL communicators, `Arc<GlobalMem>` registrations (`Send + Sync`), plain
// numbers and a counter guard over a process-wide mutex: nothing tied to the device thread but
// the ACL context, which `DeviceThread::run_here` checks is current before it lends the state
// to another thread, one at a time.
unsafe impl ferry_ascend_runtime::ContextShared for PeerState {}

impl PeerState {
    /// Unbinds every bound region and destroys the one-sided communicator, if any; returns the
    /// destroy's outcome (after a successful one the communicator reaches none of this
    /// process's memory).
    fn drop_one_sided(&mut self) -> std::result::Result<(), AscendError> {
        let Some(c) = self.one_sided.take() else { return Ok(()) };
        teardown(c.comm, c.bound.values())
    }

    /// After a failure: waits until nothing queued on the stream runs any more (see [`drain`]),
    /// then replaces the stream (its queue may be in an error state). When no new stream can be
    /// made the old one, drained, is kept.
    fn recover_stream(&mut self, dev: &Device) {
        if matches!(drain(&self.stream), Drained::Aborted) {
            // Work was in flight: give AICPU time to finish unfolding what the abort cannot
            // stop before the communicator goes (ADXL's guard).
            std::thread::sleep(crate::ABORT_GUARD);
        }
        match dev.create_stream() {
            Ok(s) => self.stream = s,
            Err(e) => tracing::warn!(error = %e, "cannot create a new stream; keeping the old (drained) one"),
        }
    }
}

/// Waits until nothing queued on `stream` runs any more: `aclrtStreamAbort` when the release
/// has it and it succeeds, else an unbounded `aclrtSynchronizeStream` (unbounded here; on
/// hardware every queued HCCL operation ends within HCCL's own `HCCL_EXEC_TIMEOUT`). Memory a
/// queued operation names (staging buffers, the requests' memory) may only be freed or
/// released after this.
pub(crate) fn drain(stream: &Stream) -> Drained {
    let started = Instant::now();
    let drained = stream.drain();
    match &drained {
        Drained::Aborted => tracing::debug!("stream aborted after a failure"),
        Drained::Finished(Ok(())) => {}
        Drained::Finished(Err(e)) => tracing::debug!(error = %e, "the stream's remaining work failed"),
    }
    let took = started.elapsed();
    if took > Duration::from_secs(1) {
        tracing::warn!(?took, "waited for a stream's queued HCCL work to end before releasing its memory");
    }
    drained
}

/// Unbinds every region a one-sided communicator holds, then destroys it: HCCL refuses to
/// destroy a communicator with memory still bound ("memories still bound", `HCCL_E_PARA`) and
/// keeps it, so unbinding comes first, as ADXL's teardown does. The destroy's outcome.
fn teardown<'a>(
    comm: Communicator,
    bound: impl IntoIterator<Item = &'a Arc<GlobalMem>>,
) -> std::result::Result<(), AscendError> {
    for g in bound {
        if let Err(e) = comm.unbind(g) {
            tracing::debug!(error = %e, "unbinding memory from a communicator being torn down");
        }
    }
    comm.destroy().inspect_err(|e| tracing::warn!(error = %e, "destroying a one-sided communicator failed"))
}

/// The operations of one two-sided call queued on a stream, with the device buffers staging
/// host memory. Unless [`settle`](Self::settle)d (the stream was synchronized successfully),
/// dropping it drains the stream first, so that no queued send or receive still points into a
/// staging buffer being freed or into caller memory about to be released; the buffers are
/// freed after that.
struct Queued<'a> {
    stream: &'a Stream,
    staging: Vec<DeviceBuffer>,
    settled: bool,
}

impl Queued<'_> {
    fn settle(&mut self) {
        self.settled = true;
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if !self.settled {
            drain(self.stream);
        }
        // `staging` is dropped (freed) after this, once the stream no longer uses it.
    }
}

/// One side of a two-sided operation: send (`send`) or receive `len` bytes at `addr`; host
/// memory (`host`) is staged through device memory, as `HcclSend`/`HcclRecv` move device
/// memory.
pub(crate) struct SideOp {
    pub(crate) send: bool,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) host: bool,
}

/// Queues `ops` towards rank `peer` on `stream`, waits up to `wait`, then copies staged
/// receives back to host memory.
///
/// # Safety
/// Every `[addr, addr + len)` must be registered memory of this process of the kind `host`
/// says, valid and not touched by anyone else until this returns.
pub(crate) unsafe fn run_side(
    dev: &Device,
    comm: &Communicator,
    stream: &Stream,
    peer: u32,
    ops: &[SideOp],
    wait: Duration,
) -> std::result::Result<(), AscendError> {
    use ferry_ascend_sys::raw::memcpy_kind::{DEVICE_TO_HOST, HOST_TO_DEVICE};
    // Every early return below drops `queued`, which drains the stream before the staging
    // buffers are freed and before the caller releases the requests.
    let mut queued = Queued { stream, staging: Vec::new(), settled: false };
    let mut copy_back = Vec::new();
    for op in ops {
        let addr = if op.host {
            let len = usize::try_from(op.len).map_err(|_| AscendError::InvalidArgument(format!("{} bytes", op.len)))?;
            let buf = dev.alloc(len)?;
            if op.send {
                // SAFETY: `buf` is a live device allocation of `len` bytes; the host range is
                // the caller's (registered, leased) memory.
                unsafe { dev.copy(buf.addr(), op.addr, op.len, HOST_TO_DEVICE)? };
            } else {
                copy_back.push((queued.staging.len(), op.addr, op.len));
            }
            let a = buf.addr();
            queued.staging.push(buf);
            a
        } else {
            op.addr
        };
        // SAFETY: `addr` is either the caller's device memory or a staging buffer kept alive in
        // `queued` until the stream no longer uses it (synchronized, or drained on failure).
        unsafe {
            if op.send {
                comm.send(addr, op.len, peer, stream)?;
            } else {
                comm.recv(addr, op.len, peer, stream)?;
            }
        }
    }
    stream.synchronize(Some(wait))?;
    queued.settle();
    for (k, host, len) in copy_back {
        let buf: &DeviceBuffer = &queued.staging[k];
        // SAFETY: the staging buffer holds `len` received bytes; the host range is the caller's.
        unsafe { dev.copy(host, buf.addr(), len, DEVICE_TO_HOST)? };
    }
    Ok(())
}

impl Drop for PeerState {
    fn drop(&mut self) {
        let _ = self.drop_one_sided();
    }
}

/// State on the device thread serving a peer's two-sided transfers (this side is rank 1).
pub(crate) struct ServerState {
    pub(crate) stream: Stream,
    pub(crate) comm: Option<(u64, Communicator)>,
}

/// [`PeerState::recover_stream`] for the serving side.
pub(crate) fn recover_server_stream(dev: &Device, st: &mut ServerState) {
    drain(&st.stream);
    match dev.create_stream() {
        Ok(s) => st.stream = s,
        Err(e) => tracing::warn!(error = %e, "cannot create a new stream; keeping the old (drained) one"),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Absent,
    Pending,
    Ready,
    Broken,
    Unsupported,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    epoch: u64,
    status: Status,
    why: String,
}

/// [`Peer::answer_init`]'s rule, given this side's slot and the peer instance seen last.
fn join_decision(s: &Slot, seen: Option<&str>, epoch: u64, instance: Option<&str>) -> std::result::Result<(), Reply> {
    let Some(after) = s.epoch.checked_add(1) else {
        return Err(Reply::Error { message: format!("epoch {} cannot grow any more", s.epoch) });
    };
    // A new instance of the peer knows nothing of this side's communicator: rebuild.
    let restarted = matches!((seen, instance), (Some(a), Some(b)) if a != b);
    let joinable = match s.status {
        Status::Unsupported if epoch <= s.epoch && !restarted => {
            return Err(Reply::Unsupported { reason: s.why.clone() });
        }
        _ if restarted => epoch == after,
        Status::Broken | Status::Unsupported => epoch == after,
        Status::Absent | Status::Pending | Status::Ready => epoch == after || (epoch == s.epoch && epoch > 0),
    };
    if joinable { Ok(()) } else { Err(Reply::Stale { epoch: after }) }
}

/// Requests for one peer's driver task.
pub(crate) struct Work {
    target: Arc<OpenSegment>,
    pending: Pending,
    deadline: Instant,
    /// The one-sided attempt the device thread already made of them, when they were submitted
    /// straight to it and it failed: the driver takes over from there (rebuild, retries).
    attempted: Option<Attempted>,
    /// Holds the driver busy (see [`Peer::driver_busy`]) until it let go of these requests.
    claim: Arc<Claim>,
}

/// A failed one-sided attempt, as the driver's retry loop takes it over.
struct Attempted {
    epoch: u64,
    error: AscendError,
    /// Why nothing was queued, when nothing was.
    not_run: Option<NotRun>,
}

/// Why a one-sided attempt queued nothing.
#[derive(Debug, Clone, Copy)]
enum NotRun {
    /// The communicator was prepared without a range the batch touches (local side?, the
    /// request): it is rebuilt.
    OutOfReach(bool, OneSidedOp),
    /// The communicator of the attempt's epoch is gone (an earlier failure tore it down, or the
    /// pair rebuilt it) while the batch was queued.
    NoCommunicator,
}

/// One work's hold on its peer's driver: released once, by whichever comes first of the device
/// thread completing its requests and the driver finishing with it.
pub(crate) struct Claim(AtomicBool);

/// A peer of this transport (either direction).
pub(crate) struct Peer {
    name: String,
    shared: Weak<Shared>,
    tx: Mutex<Option<mpsc::UnboundedSender<Work>>>,
    worker: OnceCell<Arc<DeviceThread<PeerState>>>,
    server_worker: OnceCell<Arc<DeviceThread<ServerState>>>,
    slot: Mutex<Slot>,
    slot_changed: Notify,
    /// Epoch of the two-sided communicator this side serves for the peer.
    pub(crate) server_epoch: AtomicU64,
    /// The peer (or this side) cannot do one-sided: use two-sided.
    two_sided_only: AtomicBool,
    /// What this side learnt of the peer from its published descriptor (when it sent it work),
    /// against which the peer's control requests are checked.
    known: Mutex<Option<Known>>,
    /// The engine instance the peer's last accepted `InitOneSided` came from.
    seen_instance: Mutex<Option<String>>,
    driver: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Work sent to the driver and not let go of yet ([`Claim`]s outstanding). While nonzero,
    /// new batches queue behind it there, in order, instead of going to the device thread.
    driver_busy: AtomicUsize,
    /// The open segment whose descriptor the driver last read (held weakly: compared by
    /// address only) and whether it is on this server over HCCS IPC: a batch to it may skip
    /// the driver.
    direct: Mutex<Option<(Weak<OpenSegment>, bool)>>,
    /// Deadlines of the batches submitted straight to the device thread.
    watchdog: Arc<Watchdog>,
    watchdog_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// A peer's published identity, as far as the control channel checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Known {
    /// `rank_info.hostIp`.
    pub(crate) host_ip: String,
}

static NEXT_THREAD: AtomicU64 = AtomicU64::new(0);

fn shutdown_error() -> Error {
    Error::new(ErrorKind::Shutdown, "ascend transport stopped")
}

fn timeout_error(peer: &str, timeout: Duration) -> Error {
    Error::timeout(format!("HCCL transfer to `{peer}` did not finish within {timeout:?}"))
}

async fn stopped(rx: &mut watch::Receiver<bool>) {
    while !*rx.borrow_and_update() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

impl Peer {
    pub(crate) fn start(shared: &Arc<Shared>, name: &str) -> Arc<Peer> {
        let (tx, rx) = mpsc::unbounded_channel();
        let peer = Arc::new(Peer {
            name: name.to_owned(),
            shared: Arc::downgrade(shared),
            tx: Mutex::new(Some(tx)),
            worker: OnceCell::new(),
            server_worker: OnceCell::new(),
            slot: Mutex::new(Slot { epoch: 0, status: Status::Absent, why: String::new() }),
            slot_changed: Notify::new(),
            server_epoch: AtomicU64::new(0),
            two_sided_only: AtomicBool::new(false),
            known: Mutex::new(None),
            seen_instance: Mutex::new(None),
            driver: Mutex::new(None),
            driver_busy: AtomicUsize::new(0),
            direct: Mutex::new(None),
            watchdog: Watchdog::new(shared.settings.timeout),
            watchdog_task: Mutex::new(None),
        });
        let driver = Driver {
            shared: shared.clone(),
            peer: peer.clone(),
            conn: None,
            two: None,
            two_epoch: 0,
            stop: shared.stop.subscribe(),
        };
        let handle = shared.runtime.spawn(driver.run(rx));
        *peer.driver.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        let (name, timeout) = (peer.name.clone(), shared.settings.timeout);
        let watching =
            peer.watchdog.clone().run(move || timeout_error(&name, timeout), shutdown_error, shared.stop.subscribe());
        *peer.watchdog_task.lock().unwrap_or_else(|p| p.into_inner()) = Some(shared.runtime.spawn(watching));
        peer
    }

    /// Queues requests for this peer (never blocks). A one-sided batch for a ready
    /// communicator, while the driver has nothing to do, goes straight to the peer's device
    /// thread, which completes it: one thread hand-off per batch. Anything else goes to the
    /// driver task, in order.
    pub(crate) fn enqueue(self: &Arc<Self>, shared: &Shared, target: Arc<OpenSegment>, pending: Pending) {
        let Some(pending) = self.try_direct(shared, &target, pending) else { return };
        let claim = self.claim();
        let deadline = Instant::now() + shared.settings.timeout;
        self.to_driver(Work { target, pending, deadline, attempted: None, claim });
    }

    /// A new hold on the driver (see [`Claim`]).
    fn claim(&self) -> Arc<Claim> {
        self.driver_busy.fetch_add(1, Ordering::AcqRel);
        Arc::new(Claim(AtomicBool::new(false)))
    }

    /// Lets go of `claim` (the first call only).
    fn release(&self, claim: &Claim) {
        if !claim.0.swap(true, Ordering::AcqRel) {
            self.driver_busy.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Hands `work` to the driver task (it is failed with a shutdown error when the driver is
    /// gone).
    fn to_driver(&self, work: Work) {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let rejected = match tx.as_ref() {
            Some(tx) => tx.send(work).err().map(|e| e.0),
            None => Some(work),
        };
        drop(tx);
        match rejected {
            Some(w) => {
                self.release(&w.claim);
                w.pending.complete_all(&Err(shutdown_error()));
            }
            None => bump(&counters::HANDOFFS),
        }
    }

    /// Remembers that the driver read `target`'s descriptor (and whether the peer is on this
    /// server, over HCCS IPC): later batches to it may skip the driver.
    fn set_direct(&self, target: &Arc<OpenSegment>, ipc: bool) {
        *self.direct.lock().unwrap_or_else(|p| p.into_inner()) = Some((Arc::downgrade(target), ipc));
    }

    /// Whether `target` is the open segment the driver last read (and then whether it is on
    /// this server over HCCS IPC).
    fn direct_ipc(&self, target: &Arc<OpenSegment>) -> Option<bool> {
        match &*self.direct.lock().unwrap_or_else(|p| p.into_inner()) {
            // A weak reference keeps its allocation: no other segment can be at that address.
            Some((seen, ipc)) if std::ptr::eq(seen.as_ptr(), Arc::as_ptr(target)) => Some(*ipc),
            _ => None,
        }
    }

    /// Submits a one-sided batch from the caller's thread straight onto the device thread when
    /// nothing needs the driver: the transport runs, one-sided works with this peer, its
    /// communicator is ready, the driver has no work (so this batch overtakes none) and already
    /// read this descriptor. The device thread then runs the attempt and completes the requests
    /// itself; only a failure goes back to the driver (with the attempt, so retries count it).
    /// The requests back when the driver must take them.
    fn try_direct(self: &Arc<Self>, shared: &Shared, target: &Arc<OpenSegment>, pending: Pending) -> Option<Pending> {
        if shared.is_stopped()
            || !shared.one_sided_ok()
            || self.two_sided_only()
            || self.driver_busy.load(Ordering::Acquire) != 0
        {
            return Some(pending);
        }
        let Some(worker) = self.worker.get() else { return Some(pending) };
        let Some(ipc) = self.direct_ipc(target) else { return Some(pending) };
        let epoch = {
            let s = self.slot.lock().unwrap_or_else(|p| p.into_inner());
            if s.status != Status::Ready {
                return Some(pending);
            }
            s.epoch
        };
        let pending = pending.unless_cancelled()?;
        let caller_waits = pending.caller_waits();
        let segment = &target.descriptor().name;
        let pending = refuse_out_of_reach(shared, ipc, segment, target, pending)?;
        let (reads, writes) = ops(&pending);
        // Run on the caller's own thread (below), the attempt polls the stream as the caller
        // would have polled the batch (the engine's `FERRY_WAIT_SPIN_US`, small batches only)
        // rather than sleeping in the synchronize: the caller waits anyway, and a thread that
        // sleeps there is woken by the device through a halted vCPU on a virtualised host.
        let bytes: u64 = reads.iter().chain(&writes).map(|op| op.len).sum();
        let poll = if bytes <= ferry_core::batch::SPIN_MAX_BYTES {
            ferry_core::batch::spin_before_sleep()
        } else {
            Duration::ZERO
        };
        let caller = std::thread::current().id();
        let held: Held = Arc::new(Mutex::new(Some(pending)));
        let deadline = self.watchdog.watch(&held);
        let (peer, on_device, target, timeout) = (self.clone(), held.clone(), target.clone(), shared.settings.timeout);
        let job = move |dev: &Device, st: &mut PeerState| {
            let stopped = || peer.shared.upgrade().is_none_or(|s| s.is_stopped());
            let late = || Instant::now() >= deadline;
            if stopped() || late() {
                // Nothing was started: the caller hears why (the watchdog may have said so first).
                let e = if stopped() { shutdown_error() } else { timeout_error(&peer.name, timeout) };
                if let Some(p) = watchdog::take(&on_device) {
                    p.complete_all(&Err(e));
                }
                return;
            }
            let cancelled =
                on_device.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(Pending::is_cancelled);
            if cancelled {
                if let Some(p) = watchdog::take(&on_device) {
                    let _ = p.unless_cancelled();
                }
                return;
            }
            let poll = if std::thread::current().id() == caller { poll } else { Duration::ZERO };
            let (result, not_run) = one_sided_attempt(dev, st, &peer, epoch, &reads, &writes, deadline, poll);
            let Some(p) = watchdog::take(&on_device) else { return };
            match result {
                Ok(()) => p.complete_all(&Ok(())),
                // The device no longer touches the requests' memory (the attempt drained the
                // stream on failure): they may be released.
                Err(_) if stopped() => p.complete_all(&Err(shutdown_error())),
                Err(_) if late() => p.complete_all(&Err(timeout_error(&peer.name, timeout))),
                Err(error) => {
                    let claim = peer.claim();
                    let attempted = Some(Attempted { epoch, error, not_run });
                    peer.to_driver(Work { target, pending: p, deadline, attempted, claim });
                }
            }
        };
        // A caller that waits for the batch on this thread, with the device's context current
        // on it, runs the attempt itself: no hand-off, and nobody to wake when it is done.
        let job = if caller_waits {
            match worker.run_here(job) {
                Ok(()) => {
                    bump(&counters::ON_CALLER_THREAD);
                    return None;
                }
                Err(job) => job,
            }
        } else {
            job
        };
        // The device thread runs one batch get/put and waits in the stream's synchronize: the
        // NPU moves the bytes, and the caller may poll the batch's expected end.
        if let Some(p) = held.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            p.mark_device_completed();
        }
        match worker.submit(job) {
            Ok(()) => {
                bump(&counters::HANDOFFS);
                None
            }
            // The thread stopped (the job, dropped, left the requests here): the driver says why.
            Err(_) => watchdog::take(&held),
        }
    }

    /// The peer's segment name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// What this side learnt of the peer from its descriptor, if it sent it work.
    pub(crate) fn known(&self) -> Option<Known> {
        self.known.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn learn(&self, k: Known) {
        *self.known.lock().unwrap_or_else(|p| p.into_inner()) = Some(k);
    }

    /// The peer's device thread (initiator side, one-sided communicator), started on first use.
    pub(crate) async fn worker(&self) -> Result<&Arc<DeviceThread<PeerState>>> {
        let shared = self.shared.upgrade().ok_or_else(shutdown_error)?;
        self.worker
            .get_or_try_init(|| async {
                let (lib, user) = (shared.lib.clone(), shared.me.user_device);
                let name = format!("hccl-peer-{}", NEXT_THREAD.fetch_add(1, Ordering::Relaxed));
                let t = tokio::task::spawn_blocking(move || {
                    DeviceThread::spawn(&lib, user, name, |dev| {
                        Ok(PeerState { stream: dev.create_stream()?, one_sided: None, two_sided: None })
                    })
                })
                .await
                .map_err(|e| Error::new(ErrorKind::Internal, format!("starting a device thread: {e}")))?
                .map_err(|e| hccl_error("ascend transport: starting a device thread".into(), e))?;
                // A caller that hands one batch after another to this thread finds it awake.
                t.set_idle_poll(ferry_core::batch::spin_before_sleep());
                Ok(Arc::new(t))
            })
            .await
    }

    /// The device thread serving the peer's two-sided transfers, started on first use.
    pub(crate) async fn server_worker(&self) -> Result<&Arc<DeviceThread<ServerState>>> {
        let shared = self.shared.upgrade().ok_or_else(shutdown_error)?;
        self.server_worker
            .get_or_try_init(|| async {
                let (lib, user) = (shared.lib.clone(), shared.me.user_device);
                let name = format!("hccl-serve-{}", NEXT_THREAD.fetch_add(1, Ordering::Relaxed));
                let t = tokio::task::spawn_blocking(move || {
                    DeviceThread::spawn(&lib, user, name, |dev| {
                        Ok(ServerState { stream: dev.create_stream()?, comm: None })
                    })
                })
                .await
                .map_err(|e| Error::new(ErrorKind::Internal, format!("starting a device thread: {e}")))?
                .map_err(|e| hccl_error("ascend transport: starting a device thread".into(), e))?;
                Ok(Arc::new(t))
            })
            .await
    }

    fn slot(&self) -> Slot {
        self.slot.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set_slot(&self, epoch: u64, status: Status, why: String) {
        {
            let mut s = self.slot.lock().unwrap_or_else(|p| p.into_inner());
            if s.epoch != epoch {
                return;
            }
            s.status = status;
            s.why = why;
        }
        self.slot_changed.notify_waiters();
    }

    pub(crate) fn two_sided_only(&self) -> bool {
        self.two_sided_only.load(Ordering::Acquire)
    }

    fn use_two_sided(&self, why: &str) {
        if !self.two_sided_only.swap(true, Ordering::AcqRel) {
            tracing::info!(peer = %self.name, why, "one-sided HCCL unavailable with this peer; using two-sided send/recv");
        }
    }

    /// Waits until the slot differs from `seen`, the deadline passes, or the transport stops.
    async fn wait_slot(&self, seen: &Slot, deadline: Instant, stop: &mut watch::Receiver<bool>) -> Result<()> {
        loop {
            let notified = self.slot_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.slot() != *seen {
                return Ok(());
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline.into()) => {
                    return Err(Error::timeout(format!(
                        "the one-sided communicator with `{}` was not ready within the transfer timeout",
                        self.name
                    )));
                }
                _ = stopped(stop) => return Err(shutdown_error()),
            }
        }
    }

    /// Starts building the one-sided communicator of `epoch` on this side (a no-op when this
    /// side is already at that epoch or later), binding exactly `mine` before its Prepare;
    /// `peer_buffers` is what the peer said it binds. The receiver fires when the build begins
    /// on the device thread (which may first finish an older build still waiting in its
    /// Prepare): the control server answers a peer only then, so that both sides' Prepares
    /// start together rather than one always timing out just as the other begins.
    pub(crate) async fn start_one_sided(
        self: &Arc<Self>,
        epoch: u64,
        table: String,
        (my_rank, peer_rank): (u32, u32),
        mine: Vec<Arc<GlobalMem>>,
        peer_buffers: Option<Vec<(u64, u64)>>,
    ) -> Result<Option<oneshot::Receiver<()>>> {
        let shared = self.shared.upgrade().ok_or_else(shutdown_error)?;
        let worker = self.worker().await?;
        {
            let mut s = self.slot.lock().unwrap_or_else(|p| p.into_inner());
            if s.epoch >= epoch {
                return Ok(None);
            }
            *s = Slot { epoch, status: Status::Pending, why: String::new() };
        }
        self.slot_changed.notify_waiters();
        let name = PairTable { json: table.clone(), rank_a: my_rank, rank_b: peer_rank }.comm_name(epoch);
        let prepare_timeout = shared.settings.timeout;
        let card = shared.me.physical_device;
        let me = self.clone();
        let (began, started) = oneshot::channel();
        let submitted = worker.submit(move |dev, st| {
            let _ = began.send(());
            let _ = st.drop_one_sided();
            let built = (|| -> std::result::Result<OneSided, AscendError> {
                let comm = Communicator::init_from_rank_table(dev, &table, my_rank, &name)?;
                let mut bound = BTreeMap::new();
                let mut ready = Ok(());
                for g in mine {
                    ready = comm.bind(&g);
                    if ready.is_err() {
                        break;
                    }
                    bound.insert(g.addr(), g);
                }
                if ready.is_ok() {
                    ready = comm.prepare(prepare_timeout);
                }
                if let Err(e) = ready {
                    // Nothing may stay bound to a communicator that failed: unbind, destroy.
                    let _ = teardown(comm, bound.values());
                    return Err(e);
                }
                Ok(OneSided { epoch, comm, peer_rank, bound, peer_buffers, _counted: CardCommunicators::open(card) })
            })();
            match built {
                Ok(c) => {
                    st.one_sided = Some(c);
                    bump(&counters::COMMUNICATORS_BUILT);
                    tracing::debug!(peer = %me.name, epoch, "one-sided communicator ready");
                    me.set_slot(epoch, Status::Ready, String::new());
                }
                Err(e) if e.is_not_supported() => me.set_slot(epoch, Status::Unsupported, e.to_string()),
                Err(e) => {
                    tracing::warn!(peer = %me.name, epoch, error = %e, "building the one-sided communicator failed");
                    me.set_slot(epoch, Status::Broken, e.to_string());
                }
            }
        });
        if let Err(e) = submitted {
            self.set_slot(epoch, Status::Broken, e.to_string());
        }
        Ok(Some(started))
    }

    /// Whether a peer's request to build the one-sided communicator of `epoch` can be joined;
    /// the reply to send when not (the epoch to ask for instead, or no one-sided service).
    ///
    /// Joinable: this side's current epoch (unless broken) or the one after it. Anything else
    /// is answered `Stale` with the one after: a lower epoch comes from a peer that restarted,
    /// a higher one from a peer that outlived this side's restart (it starts again from the
    /// answer), and an epoch far ahead is never taken (it would let a peer push the counter to
    /// its end).
    pub(crate) fn answer_init(&self, epoch: u64, instance: Option<&str>) -> std::result::Result<(), Reply> {
        let s = self.slot();
        let mut seen = self.seen_instance.lock().unwrap_or_else(|p| p.into_inner());
        join_decision(&s, seen.as_deref(), epoch, instance)?;
        if let Some(i) = instance {
            *seen = Some(i.to_owned());
        }
        Ok(())
    }

    /// The peer answered `Stale` with an epoch below this side's: it restarted (a live peer is
    /// always at least at this side's epoch). Forgets this side's communicator so that the
    /// pair starts again from `epoch`.
    fn restart_from(self: &Arc<Self>, epoch: u64) {
        let old = {
            let mut s = self.slot.lock().unwrap_or_else(|p| p.into_inner());
            if epoch > s.epoch {
                return;
            }
            let old = s.epoch;
            *s = Slot { epoch: epoch.saturating_sub(1), status: Status::Absent, why: String::new() };
            old
        };
        tracing::info!(peer = %self.name, old, epoch, "the peer restarted; rebuilding the one-sided communicator from its epoch");
        self.slot_changed.notify_waiters();
        if let Some(w) = self.worker.get() {
            let _ = w.submit(move |_, st| {
                if st.one_sided.as_ref().is_some_and(|c| c.epoch >= epoch) {
                    let _ = st.drop_one_sided();
                }
            });
        }
    }

    /// Marks the one-sided communicator of `epoch` broken and tears it down.
    fn mark_broken(self: &Arc<Self>, epoch: u64, why: String) {
        self.set_slot(epoch, Status::Broken, why);
        if let Some(w) = self.worker.get() {
            let _ = w.submit(move |_, st| {
                if st.one_sided.as_ref().is_some_and(|c| c.epoch == epoch) {
                    let _ = st.drop_one_sided();
                }
            });
        }
    }

    /// Unbinds the region at `addr` from the one-sided communicator before it is deregistered.
    /// When `HcclCommUnbindMem` fails the communicator is destroyed instead (it then reaches
    /// none of this process's memory). An error says the memory may still be bound: the
    /// device thread did not answer within `timeout`, or the communicator could not be
    /// destroyed either.
    pub(crate) async fn unbind(self: &Arc<Self>, addr: u64, timeout: Duration) -> std::result::Result<(), String> {
        let Some(w) = self.worker.get() else { return Ok(()) };
        let me = self.clone();
        let job = run_on(w, move |_, st| -> std::result::Result<(), String> {
            let Some(c) = st.one_sided.as_mut() else { return Ok(()) };
            let Some(g) = c.bound.remove(&addr) else { return Ok(()) };
            let Err(e) = c.comm.unbind(&g) else { return Ok(()) };
            let epoch = c.epoch;
            c.bound.insert(addr, g);
            tracing::warn!(peer = %me.name, addr, error = %e, "unbinding memory failed; destroying the communicator instead");
            me.set_slot(epoch, Status::Broken, format!("unbinding {addr:#x} failed: {e}"));
            st.drop_one_sided().map_err(|d| format!("HcclCommUnbindMem failed ({e}) and so did HcclCommDestroy ({d})"))
        });
        match tokio::time::timeout(timeout, job).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("its device thread did not answer within {timeout:?} (busy with a transfer?)")),
        }
    }

    /// Fails queued work, tears the communicators down and stops the threads (both at once,
    /// each waited for up to `timeout`). Returns how many threads were still busy then (they
    /// finish on their own, bounded by HCCL's timeouts, and drop their state when they do).
    pub(crate) async fn shutdown(&self, timeout: Duration) -> usize {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        let driver = self.driver.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(d) = driver
            && tokio::time::timeout(timeout, d).await.is_err()
        {
            tracing::warn!(peer = %self.name, "the peer's driver did not finish within {timeout:?}");
        }
        // It reported the shutdown to the batches it watched and ended.
        let watching = self.watchdog_task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(w) = watching
            && tokio::time::timeout(timeout, w).await.is_err()
        {
            tracing::warn!(peer = %self.name, "the peer's watchdog did not finish within {timeout:?}");
        }
        // Closing a device thread's queue runs what is queued, then drops its state on the
        // thread (unbinding memory, destroying communicators and streams).
        let a = stop_thread(self.worker.get().cloned(), timeout);
        let b = stop_thread(self.server_worker.get().cloned(), timeout);
        let mut busy = 0;
        for r in [a.await, b.await] {
            match r {
                Ok(None) | Ok(Some((_, true))) => {}
                Ok(Some((thread, false))) => {
                    tracing::error!(peer = %self.name, %thread, "a device thread was still busy {timeout:?} after the transport stopped; it finishes on its own");
                    busy += 1;
                }
                Err(e) => {
                    tracing::error!(peer = %self.name, error = %e, "stopping a device thread failed");
                    busy += 1;
                }
            }
        }
        busy
    }
}

/// Stops `w` (if any) on a blocking thread: its name and whether it stopped within `timeout`.
fn stop_thread<S: 'static>(
    w: Option<Arc<DeviceThread<S>>>,
    timeout: Duration,
) -> tokio::task::JoinHandle<Option<(String, bool)>> {
    tokio::task::spawn_blocking(move || w.map(|w| (w.name().to_owned(), w.stop(timeout))))
}

/// A control connection to the peer.
struct Conn {
    stream: TcpStream,
}

enum Ensure {
    /// Use the two-sided path instead.
    NotSupported(String),
    /// Deadline or shutdown: fail the requests with this.
    Interrupted(Error),
    /// This attempt failed (counts against the retries).
    Failed(Error),
}

enum JobResult<R> {
    Finished(std::result::Result<R, AscendError>, Pending),
    /// The job succeeded and the device thread completed the requests itself (asked for with
    /// `complete_on_device`): the caller wakes without a hop through the driver.
    CompletedOnDevice,
    /// Deadline or shutdown came first: the requests were reported and are released when the
    /// device job ends.
    Abandoned,
}

/// Runs one peer's work, in order.
struct Driver {
    shared: Arc<Shared>,
    peer: Arc<Peer>,
    conn: Option<Conn>,
    /// Epoch of this side's ready two-sided communicator.
    two: Option<u64>,
    two_epoch: u64,
    stop: watch::Receiver<bool>,
}

fn ops(pending: &Pending) -> (Vec<OneSidedOp>, Vec<OneSidedOp>) {
    let (mut reads, mut writes) = (Vec::new(), Vec::new());
    for &i in pending.indices() {
        let r = pending.request(i);
        let op = OneSidedOp { local: r.source, remote: r.target_offset, len: r.length };
        match r.opcode {
            Opcode::Read => reads.push(op),
            Opcode::Write => writes.push(op),
        }
    }
    (reads, writes)
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

/// One one-sided attempt on the peer's device thread: the batch's `HcclBatchGet` (`reads`) and
/// `HcclBatchPut` (`writes`) calls on the communicator of `epoch`, then the stream wait, up to the
/// deadline. When it fails the stream is drained and replaced and the communicator torn down
/// (the next attempt rebuilds it), so that the requests may be released as soon as this returns.
/// With the failure, why nothing was queued when nothing was (then nothing is drained). Before
/// the stream wait, the stream is polled for up to `poll` (zero: not at all).
#[allow(clippy::too_many_arguments)]
fn one_sided_attempt(
    dev: &Device,
    st: &mut PeerState,
    peer: &Peer,
    epoch: u64,
    reads: &[OneSidedOp],
    writes: &[OneSidedOp],
    deadline: Instant,
    poll: Duration,
) -> (std::result::Result<(), AscendError>, Option<NotRun>) {
    let started = Instant::now();
    // Measured when the job starts: the wait ends at the deadline, when the caller hears of the
    // timeout.
    let wait = remaining(deadline);
    let Some(c) = st.one_sided.as_ref().filter(|c| c.epoch == epoch) else {
        let e =
            AscendError::InvalidArgument("the communicator was torn down or rebuilt while the batch was queued".into());
        return (Err(e), Some(NotRun::NoCommunicator));
    };
    if let Some((local, op)) = c.unreachable(reads).or_else(|| c.unreachable(writes)) {
        // Nothing was queued: the communicator is rebuilt by the driver.
        let e = AscendError::InvalidArgument(format!(
            "the communicator was prepared before {} {:#x}+{} was registered",
            if local { "local memory" } else { "the peer's memory" },
            if local { op.local } else { op.remote },
            op.len
        ));
        return (Err(e), Some(NotRun::OutOfReach(local, op)));
    }
    let result = (|| {
        // SAFETY: every local range lies in memory the engine registered (the batch holds a
        // lease on it until these requests are completed, after this attempt), which was
        // registered with HCCL and bound to this communicator; remote ranges were checked
        // against the peer's published buffers, and the peer's HCCL refuses anything it did not
        // bind. A failed call may leave earlier calls queued: `recover_stream` below drains them
        // before this returns.
        unsafe {
            if !reads.is_empty() {
                let calls = c.comm.batch_get(c.peer_rank, reads, &st.stream)?;
                counters::add(&counters::ONE_SIDED_CALLS, calls);
            }
            if !writes.is_empty() {
                let calls = c.comm.batch_put(c.peer_rank, writes, &st.stream)?;
                counters::add(&counters::ONE_SIDED_CALLS, calls);
            }
        }
        if !poll.is_zero() {
            st.stream.poll_complete(poll.min(wait));
        }
        st.stream.synchronize(Some(wait))
    })();
    counters::device_time(started);
    if result.is_ok() {
        // Counted before the requests complete (on this thread), so a caller that saw its batch
        // finish also sees it counted.
        bump(&counters::ONE_SIDED_BATCHES);
    }
    if let Err(e) = &result {
        // The requests are released as soon as this returns (also when the caller already
        // heard of a timeout): nothing queued may still touch their memory by then. Drain
        // (abort, else wait for HCCL's own timeout), then tear the communicator down; the next
        // transfer rebuilds it.
        st.recover_stream(dev);
        if st.one_sided.as_ref().is_some_and(|c| c.epoch == epoch) {
            let _ = st.drop_one_sided();
        }
        peer.set_slot(epoch, Status::Broken, e.to_string());
    }
    (result, None)
}

/// Completes, with an error that says why and what to do, the requests HCCL's one-sided
/// service cannot carry: local host memory not from `aclrtMallocHost` (Prepare's
/// `aclrtHostRegister` refuses it), and host memory on either side when the peer is on this
/// server (`ipc`: HCCS IPC shares device memory only) unless `HCCL_INTRA_ROCE_ENABLE=1`. Refused
/// at once: never a retry loop that ends in a timeout. The rest, if any.
fn refuse_out_of_reach(
    shared: &Shared,
    ipc: bool,
    segment: &str,
    target: &OpenSegment,
    mut pending: Pending,
) -> Option<Pending> {
    let remote_is_host = |addr: u64| {
        target.descriptor().buffers.iter().any(|b| b.device_id.is_none() && addr >= b.addr && addr - b.addr < b.length)
    };
    // One look at the placements for the whole batch; the refusals are completed after.
    let refusals: Vec<(usize, String)> = {
        let placements = shared.placements.lock().unwrap_or_else(|p| p.into_inner());
        let placement = |addr: u64| crate::placement_in(&placements, addr);
        pending
            .indices()
            .iter()
            .enumerate()
            .filter_map(|(pos, &i)| {
                let r = pending.request(i);
                let why = match placement(r.source) {
                    Some(Placement::UnpinnedHost) => format!(
                        "local host memory {:#x}+{} was not allocated with aclrtMallocHost, so HCCL cannot \
                         register it with the device: allocate it with aclrtMallocHost (allocate_managed_buffer \
                         does) or use device memory",
                        r.source, r.length
                    ),
                    Some(p) if ipc && p.is_host() => format!(
                        "local host memory {:#x}+{} cannot go to `{}`: engines on one server talk over HCCS IPC, \
                         which shares device memory only; use device memory, or set HCCL_INTRA_ROCE_ENABLE=1 on \
                         both engines",
                        r.source, r.length, segment
                    ),
                    _ if ipc && remote_is_host(r.target_offset) => format!(
                        "`{}` exposes {:#x}+{} as host memory, which engines on one server cannot share over \
                         HCCS IPC (device memory only); use device memory there, or set HCCL_INTRA_ROCE_ENABLE=1 \
                         on both engines",
                        segment, r.target_offset, r.length
                    ),
                    _ => return None,
                };
                Some((pos, why))
            })
            .collect()
    };
    for (pos, why) in refusals.into_iter().rev() {
        pending.complete_at(pos, Err(Error::invalid(format!("ascend transport: {why}"))));
    }
    (!pending.is_empty()).then_some(pending)
}

impl Driver {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Work>) {
        while let Some(work) = rx.recv().await {
            let claim = work.claim.clone();
            self.handle(work).await;
            self.peer.release(&claim);
        }
    }

    fn timeout_error(&self) -> Error {
        timeout_error(&self.peer.name, self.shared.settings.timeout)
    }

    async fn handle(&mut self, work: Work) {
        let Work { target, pending, deadline, attempted, claim } = work;
        if self.shared.is_stopped() {
            pending.complete_all(&Err(shutdown_error()));
            return;
        }
        let Some(pending) = pending.unless_cancelled() else { return };
        if Instant::now() >= deadline {
            let e = self.timeout_error();
            pending.complete_all(&Err(e));
            return;
        }
        let info = match PeerIdentity::from_descriptor(target.descriptor()) {
            Ok(i) => i,
            Err(e) => return pending.complete_all(&Err(e)),
        };
        self.peer.learn(Known { host_ip: info.host_ip.clone() });
        let ipc = self.shared.me.host_ip == info.host_ip && !self.shared.settings.intra_roce;
        self.peer.set_direct(&target, ipc);
        let pending = if self.shared.one_sided_ok() && !self.peer.two_sided_only() {
            let Some(pending) = refuse_out_of_reach(&self.shared, ipc, &info.segment, &target, pending) else { return };
            match self.one_sided(&info, pending, deadline, attempted, claim).await {
                Some(p) => p,
                None => return,
            }
        } else {
            pending
        };
        self.two_sided(&info, pending, deadline).await;
    }

    /// Runs `f` on the peer's device thread for `pending`, bounded by the deadline and shutdown.
    /// With `complete_on_device` (the work's claim on the driver), a job that succeeds completes
    /// the requests on the device thread, letting go of the driver first (the caller is woken
    /// from there, and its next batch may go straight to the device thread).
    async fn job<R: Send + 'static>(
        &mut self,
        f: impl FnOnce(&Device, &mut PeerState) -> std::result::Result<R, AscendError> + Send + 'static,
        deadline: Instant,
        pending: Pending,
        complete_on_device: Option<Arc<Claim>>,
    ) -> JobResult<R> {
        let worker = match self.peer.worker().await {
            Ok(w) => w.clone(),
            Err(e) => {
                pending.complete_all(&Err(e));
                return JobResult::Abandoned;
            }
        };
        // Whoever finishes the requests takes them: the device thread on success (when asked),
        // else the driver. A timeout reported meanwhile stays what the caller sees: a request's
        // first outcome wins; completing only releases it.
        let slot: Held = Arc::new(Mutex::new(Some(pending)));
        let take = watchdog::take;
        let (tx, mut rx) = oneshot::channel();
        let (on_device, peer) = (slot.clone(), self.peer.clone());
        if let Err(e) = worker.submit(move |d, s| {
            let r = f(d, s);
            if let Some(claim) = complete_on_device
                && r.is_ok()
                && let Some(p) = take(&on_device)
            {
                peer.release(&claim);
                p.complete_all(&Ok(()));
            }
            let _ = tx.send(r);
        }) {
            return match take(&slot) {
                Some(p) => JobResult::Finished(Err(e), p),
                None => JobResult::Abandoned,
            };
        }
        // There, and the result back to this task.
        counters::add(&counters::HANDOFFS, 2);
        let gone = || AscendError::Thread { name: worker.name().to_owned(), reason: "the job did not finish".into() };
        let interrupt = tokio::select! {
            r = &mut rx => {
                return match take(&slot) {
                    Some(p) => JobResult::Finished(r.unwrap_or_else(|_| Err(gone())), p),
                    None => JobResult::CompletedOnDevice,
                };
            }
            _ = tokio::time::sleep_until(deadline.into()) => self.timeout_error(),
            _ = stopped(&mut self.stop) => shutdown_error(),
        };
        if let Some(p) = slot.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            p.report_all(&interrupt);
        }
        self.shared.runtime.spawn(async move {
            let _ = rx.await;
            if let Some(p) = take(&slot) {
                p.complete_all(&Err(interrupt));
            }
        });
        JobResult::Abandoned
    }

    /// Sends `req` and reads one reply (connecting first when needed).
    async fn call(&mut self, info: &PeerIdentity, req: &Request, deadline: Instant) -> Result<Reply> {
        let r = self.call_inner(info, req, deadline).await;
        if r.is_err() {
            self.conn = None;
        }
        r
    }

    async fn call_inner(&mut self, info: &PeerIdentity, req: &Request, deadline: Instant) -> Result<Reply> {
        let unreachable = |what: String, e: std::io::Error| {
            Error::unreachable(format!(
                "ascend transport: control channel to `{}` ({}:{}): {what}",
                info.segment, info.host_ip, info.host_port
            ))
            .with_source(e)
        };
        if self.conn.is_none() {
            let connect = TcpStream::connect((info.host_ip.as_str(), info.host_port));
            let stream = match tokio::time::timeout(remaining(deadline), connect).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return Err(unreachable("cannot connect".into(), e)),
                Err(_) => return Err(self.timeout_error()),
            };
            let _ = stream.set_nodelay(true);
            self.conn = Some(Conn { stream });
        }
        let conn = self.conn.as_mut().expect("connected above");
        wire::write_frame(&mut conn.stream, req).await.map_err(|e| unreachable("send failed".into(), e))?;
        self.read_reply(info, deadline).await
    }

    async fn read_reply(&mut self, info: &PeerIdentity, deadline: Instant) -> Result<Reply> {
        let Some(conn) = self.conn.as_mut() else {
            return Err(Error::unreachable(format!("control channel to `{}` is closed", info.segment)));
        };
        let stop = &mut self.stop;
        let read = wire::read_frame::<_, Reply>(&mut conn.stream, remaining(deadline));
        let got = tokio::select! {
            r = read => r,
            _ = stopped(stop) => return Err(shutdown_error()),
        };
        match got {
            Ok(Some(r)) => Ok(r),
            Ok(None) => {
                self.conn = None;
                Err(Error::unreachable(format!("`{}` closed the control channel", info.segment)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                self.conn = None;
                Err(self.timeout_error())
            }
            Err(e) => {
                self.conn = None;
                Err(Error::unreachable(format!("control channel to `{}`: {e}", info.segment)).with_source(e))
            }
        }
    }

    fn interrupted(&self, e: &Error, deadline: Instant) -> bool {
        matches!(e.kind(), ErrorKind::Shutdown | ErrorKind::Timeout)
            || Instant::now() >= deadline
            || self.shared.is_stopped()
    }

    /// Agrees with the peer on a ready one-sided communicator; returns its epoch.
    async fn ensure_one_sided(&mut self, info: &PeerIdentity, deadline: Instant) -> std::result::Result<u64, Ensure> {
        let table = PairTable::build(&self.shared.me.member(), &info.member);
        let mut want = 0u64;
        for _round in 0..16 {
            let slot = self.peer.slot();
            match slot.status {
                Status::Ready => return Ok(slot.epoch),
                Status::Unsupported => return Err(Ensure::NotSupported(slot.why)),
                Status::Pending => {
                    self.peer.wait_slot(&slot, deadline, &mut self.stop).await.map_err(Ensure::Interrupted)?;
                }
                Status::Absent | Status::Broken => {
                    let Some(next) = slot.epoch.checked_add(1) else {
                        return Err(Ensure::Failed(Error::transport(format!(
                            "the one-sided communicator with `{}` cannot be rebuilt: epoch {} cannot grow any more",
                            info.segment, slot.epoch
                        ))));
                    };
                    let epoch = want.max(next);
                    let mine = self.shared.bindable(self.shared.me.host_ip == info.host_ip);
                    let buffers = mine.iter().map(|g| (g.addr(), g.len())).collect();
                    let req = Request::InitOneSided {
                        from: self.shared.me.segment.clone(),
                        instance: Some(self.shared.instance.clone()),
                        host_ip: self.shared.me.host_ip.clone(),
                        host_port: self.shared.control_port,
                        epoch,
                        rank_table: table.json.clone(),
                        your_rank: table.rank_b,
                        buffers: Some(buffers),
                    };
                    let reply = match self.call(info, &req, deadline).await {
                        Ok(r) => r,
                        Err(e) if self.interrupted(&e, deadline) => return Err(Ensure::Interrupted(e)),
                        Err(e) => return Err(Ensure::Failed(e)),
                    };
                    match reply {
                        Reply::Accepted { epoch: agreed, buffers } if agreed == epoch => {
                            self.peer
                                .start_one_sided(epoch, table.json.clone(), (table.rank_a, table.rank_b), mine, buffers)
                                .await
                                .map_err(Ensure::Failed)?;
                            want = 0;
                        }
                        Reply::Stale { epoch } if epoch <= slot.epoch => {
                            // Behind this side: the peer restarted. Start again from its epoch.
                            self.peer.restart_from(epoch);
                            want = epoch;
                        }
                        Reply::Stale { epoch } => want = epoch,
                        Reply::Unsupported { reason } => return Err(Ensure::NotSupported(reason)),
                        Reply::Error { message } => {
                            return Err(Ensure::Failed(Error::transport(format!(
                                "`{}` refused the one-sided communicator: {message}",
                                info.segment
                            ))));
                        }
                        other => {
                            return Err(Ensure::Failed(Error::transport(format!(
                                "`{}` answered {other:?} to a communicator request",
                                info.segment
                            ))));
                        }
                    }
                }
            }
        }
        Err(Ensure::Failed(Error::transport(format!(
            "could not agree on a one-sided communicator with `{}`",
            info.segment
        ))))
    }

    /// The one-sided path with retries, taking over from `attempted` (the device thread's
    /// failed attempt of a batch submitted straight to it) when given. Returns the requests when
    /// the two-sided path must take them instead.
    async fn one_sided(
        &mut self,
        info: &PeerIdentity,
        mut pending: Pending,
        deadline: Instant,
        mut attempted: Option<Attempted>,
        claim: Arc<Claim>,
    ) -> Option<Pending> {
        let (reads, writes) = ops(&pending);
        let retries = self.shared.settings.retries;
        let mut last: Option<Error> = None;
        // A communicator prepared before memory this batch touches was registered (on either
        // side) cannot reach it: it is rebuilt first, once, without counting as an attempt.
        let mut rebuilt_for_new_memory = false;
        let mut attempt = 0;
        while attempt <= retries {
            let Attempted { epoch, error: e, not_run } = match attempted.take() {
                // Queued on the device thread behind a batch that failed: not an attempt.
                Some(Attempted { not_run: Some(NotRun::NoCommunicator), error, .. }) => {
                    tracing::debug!(peer = %info.segment, %error, "retrying a batch queued behind a failure");
                    continue;
                }
                Some(a) => a,
                None => {
                    if attempt > 0 {
                        pending = pending.unless_cancelled()?;
                    }
                    let epoch = match self.ensure_one_sided(info, deadline).await {
                        Ok(e) => e,
                        Err(Ensure::NotSupported(why)) => {
                            self.peer.use_two_sided(&why);
                            return Some(pending);
                        }
                        Err(Ensure::Interrupted(e)) => {
                            pending.complete_all(&Err(e));
                            return None;
                        }
                        Err(Ensure::Failed(e)) => {
                            bump(&counters::FAILED_ATTEMPTS);
                            tracing::warn!(peer = %info.segment, attempt, error = %e, "one-sided communicator setup failed");
                            last = Some(e);
                            attempt += 1;
                            continue;
                        }
                    };
                    let (r, w, peer) = (reads.clone(), writes.clone(), self.peer.clone());
                    let not_run = Arc::new(Mutex::new(None));
                    let not_run_on_device = not_run.clone();
                    let job = move |dev: &Device, st: &mut PeerState| -> std::result::Result<(), AscendError> {
                        let (result, why) = one_sided_attempt(dev, st, &peer, epoch, &r, &w, deadline, Duration::ZERO);
                        *not_run_on_device.lock().unwrap_or_else(|p| p.into_inner()) = why;
                        result
                    };
                    match self.job(job, deadline, pending, Some(claim.clone())).await {
                        JobResult::CompletedOnDevice => return None,
                        JobResult::Finished(Ok(()), p) => {
                            p.complete_all(&Ok(()));
                            return None;
                        }
                        JobResult::Finished(Err(error), p) => {
                            pending = p;
                            let not_run = not_run.lock().unwrap_or_else(|p| p.into_inner()).take();
                            Attempted { epoch, error, not_run }
                        }
                        JobResult::Abandoned => return None,
                    }
                }
            };
            self.peer.mark_broken(epoch, e.to_string());
            match not_run {
                Some(NotRun::OutOfReach(..)) if !rebuilt_for_new_memory => {
                    tracing::debug!(peer = %info.segment, error = %e, "rebuilding the one-sided communicator for newly registered memory");
                    rebuilt_for_new_memory = true;
                    continue;
                }
                Some(NotRun::OutOfReach(local, op)) => {
                    // Still out of reach right after a rebuild: that memory is not
                    // registered with HCCL on its side at all.
                    let e = Error::invalid(if local {
                        format!(
                            "local memory {:#x}+{} is not registered with HCCL: it is host memory not \
                             allocated with aclrtMallocHost, or host memory that engines on one server cannot \
                             share over HCCS IPC (use device memory, or HCCL_INTRA_ROCE_ENABLE=1)",
                            op.local, op.len
                        )
                    } else {
                        format!(
                            "`{}` has not registered its memory {:#x}+{} with HCCL (host memory not from \
                             aclrtMallocHost, or host memory shared over HCCS IPC between engines on one \
                             server): use device memory there, or HCCL_INTRA_ROCE_ENABLE=1",
                            info.segment, op.remote, op.len
                        )
                    });
                    pending.complete_all(&Err(e));
                    return None;
                }
                Some(NotRun::NoCommunicator) | None => {}
            }
            bump(&counters::FAILED_ATTEMPTS);
            tracing::warn!(peer = %info.segment, attempt, error = %e, "one-sided transfer failed; rebuilding the communicator");
            last = Some(hccl_error(format!("HCCL one-sided transfer to `{}`", info.segment), e));
            attempt += 1;
        }
        let e = last.unwrap_or_else(|| Error::transport("one-sided transfer failed"));
        let e = e.context(format!("{} (after {} attempts)", e.message(), retries.saturating_add(1)));
        pending.complete_all(&Err(e));
        None
    }

    /// Builds this side's two-sided communicator with the peer (this side is rank 0).
    async fn ensure_two_sided(&mut self, info: &PeerIdentity, deadline: Instant) -> std::result::Result<u64, Ensure> {
        if let Some(e) = self.two {
            return Ok(e);
        }
        let fail = |this: &Self, e: Error| {
            if this.interrupted(&e, deadline) { Ensure::Interrupted(e) } else { Ensure::Failed(e) }
        };
        let worker = self.peer.worker().await.map_err(Ensure::Failed)?.clone();
        let root = match tokio::time::timeout(remaining(deadline), run_on(&worker, |dev, _| RootInfo::new(dev))).await {
            Ok(Ok(Ok(r))) => r,
            Ok(Ok(Err(e))) | Ok(Err(e)) => return Err(Ensure::Failed(hccl_error("HcclGetRootInfo".into(), e))),
            Err(_) => return Err(Ensure::Interrupted(self.timeout_error())),
        };
        self.two_epoch = self.two_epoch.wrapping_add(1).max(1);
        let epoch = self.two_epoch;
        let req = Request::InitTwoSided {
            from: self.shared.me.segment.clone(),
            epoch,
            root_info: wire::hex(&root.to_bytes()),
        };
        match self.call(info, &req, deadline).await {
            Ok(Reply::Accepted { epoch: e, .. }) if e == epoch => {}
            Ok(Reply::Error { message }) => {
                return Err(Ensure::Failed(Error::transport(format!(
                    "`{}` refused the two-sided communicator: {message}",
                    info.segment
                ))));
            }
            Ok(other) => {
                return Err(Ensure::Failed(Error::transport(format!(
                    "`{}` answered {other:?} to a two-sided communicator request",
                    info.segment
                ))));
            }
            Err(e) => return Err(fail(self, e)),
        }
        let init = run_on(&worker, move |dev, st| {
            st.two_sided = None;
            Communicator::init_root_info(dev, 2, &root, 0).map(|c| st.two_sided = Some((epoch, c)))
        });
        let stop = &mut self.stop;
        let got = tokio::select! {
            r = init => r,
            _ = tokio::time::sleep_until(deadline.into()) => return Err(Ensure::Interrupted(self.timeout_error())),
            _ = stopped(stop) => return Err(Ensure::Interrupted(shutdown_error())),
        };
        match got {
            Ok(Ok(())) => {
                bump(&counters::COMMUNICATORS_BUILT);
                self.two = Some(epoch);
                Ok(epoch)
            }
            Ok(Err(e)) | Err(e) => {
                Err(Ensure::Failed(hccl_error(format!("two-sided communicator with `{}`", info.segment), e)))
            }
        }
    }

    fn drop_two_sided(&mut self) {
        self.two = None;
        self.conn = None;
        if let Some(w) = self.peer.worker.get() {
            let _ = w.submit(|dev, st| {
                st.recover_stream(dev);
                st.two_sided = None;
            });
        }
    }

    /// The two-sided path: chunks of at most 256 requests, each validated by the peer, then
    /// sent or received on both sides; retried after a failure up to `retries` times.
    async fn two_sided(&mut self, info: &PeerIdentity, mut pending: Pending, deadline: Instant) {
        let retries = self.shared.settings.retries;
        let mut failures = 0u32;
        let mut last: Option<Error> = None;
        while !pending.is_empty() {
            let Some(p) = pending.unless_cancelled() else { return };
            pending = p;
            if Instant::now() >= deadline {
                let e = self.timeout_error();
                return pending.complete_all(&Err(e));
            }
            if failures > retries {
                let e = last.take().unwrap_or_else(|| Error::transport("two-sided transfer failed"));
                let e = e.context(format!("{} (after {failures} attempts)", e.message()));
                return pending.complete_all(&Err(e));
            }
            let epoch = match self.ensure_two_sided(info, deadline).await {
                Ok(e) => e,
                Err(Ensure::Interrupted(e)) => return pending.complete_all(&Err(e)),
                Err(Ensure::Failed(e)) => {
                    tracing::warn!(peer = %info.segment, error = %e, "two-sided communicator setup failed");
                    bump(&counters::FAILED_ATTEMPTS);
                    failures += 1;
                    last = Some(e);
                    self.drop_two_sided();
                    continue;
                }
                Err(Ensure::NotSupported(why)) => {
                    failures += 1;
                    last = Some(Error::new(ErrorKind::Unsupported, why));
                    continue;
                }
            };
            let chunk = pending.take_front(MAX_OPS_PER_REQUEST);
            if let Some((chunk, e)) = self.two_sided_chunk(info, epoch, chunk, deadline).await {
                tracing::warn!(peer = %info.segment, error = %e, "two-sided transfer failed; rebuilding the communicator");
                bump(&counters::FAILED_ATTEMPTS);
                failures += 1;
                last = Some(e);
                self.drop_two_sided();
                pending = chunk.append(pending);
            }
        }
    }

    /// One chunk; returns it with the error when it must be retried.
    async fn two_sided_chunk(
        &mut self,
        info: &PeerIdentity,
        epoch: u64,
        mut chunk: Pending,
        deadline: Instant,
    ) -> Option<(Pending, Error)> {
        let wire_ops: Vec<WireOp> = chunk
            .indices()
            .iter()
            .map(|&i| {
                let r = chunk.request(i);
                WireOp { write: r.opcode == Opcode::Write, addr: r.target_offset, len: r.length }
            })
            .collect();
        let req = Request::Transfer { from: self.shared.me.segment.clone(), epoch, ops: wire_ops };
        let rejected = match self.call(info, &req, deadline).await {
            Ok(Reply::Admitted { rejected }) => rejected,
            Ok(Reply::Error { message }) => {
                return Some((chunk, Error::transport(format!("`{}` refused the transfer: {message}", info.segment))));
            }
            Ok(other) => {
                return Some((chunk, Error::transport(format!("`{}` answered {other:?} to a transfer", info.segment))));
            }
            Err(e) if self.interrupted(&e, deadline) => {
                chunk.complete_all(&Err(e));
                return None;
            }
            Err(e) => return Some((chunk, e)),
        };
        let mut refused: Vec<(usize, String)> = rejected
            .into_iter()
            .filter(|(k, _)| (*k as usize) < chunk.indices().len())
            .map(|(k, why)| (k as usize, why))
            .collect();
        refused.sort_by_key(|r| std::cmp::Reverse(r.0));
        refused.dedup_by_key(|r| r.0);
        for (pos, why) in refused {
            let i = chunk.indices()[pos];
            let r = chunk.request(i);
            chunk.complete_at(
                pos,
                Err(Error::out_of_bounds(format!(
                    "`{}` refused {:#x}+{}: {why}",
                    info.segment, r.target_offset, r.length
                ))),
            );
        }
        if chunk.is_empty() {
            // The peer queued nothing; it still answers Done.
            return match self.read_reply(info, deadline).await {
                Ok(Reply::Done { .. }) => None,
                _ => {
                    self.conn = None;
                    None
                }
            };
        }
        let requests: Vec<_> = chunk.indices().iter().map(|&i| chunk.request(i)).collect();
        let hosts = self.shared.host_flags(requests.iter().map(|r| r.source));
        let local: Vec<SideOp> = requests
            .iter()
            .zip(hosts)
            .map(|(r, host)| SideOp { send: r.opcode == Opcode::Write, addr: r.source, len: r.length, host })
            .collect();
        let job = move |dev: &Device, st: &mut PeerState| -> std::result::Result<(), AscendError> {
            let started = Instant::now();
            let wait = remaining(deadline);
            let result = (|| {
                let (_, comm) = st.two_sided.as_ref().filter(|(e, _)| *e == epoch).ok_or_else(|| {
                    AscendError::InvalidArgument("the two-sided communicator was rebuilt meanwhile".into())
                })?;
                // SAFETY: each range lies in memory the engine registered (of the kind its
                // location says) and leased to this batch until the requests are completed,
                // after this job.
                unsafe { run_side(dev, comm, &st.stream, 1, &local, wait) }
            })();
            counters::device_time(started);
            if result.is_err() {
                // `run_side` drained the stream before freeing its staging buffers; the
                // communicator is rebuilt by the next attempt.
                st.recover_stream(dev);
                st.two_sided = None;
            }
            result
        };
        let (local_result, chunk) = match self.job(job, deadline, chunk, None).await {
            JobResult::Finished(r, c) => (r, c),
            // Not asked for here (the peer's `Done` decides); were it to happen, the requests
            // are complete and only the reply is left unread: start a fresh connection.
            JobResult::CompletedOnDevice | JobResult::Abandoned => {
                self.conn = None;
                return None;
            }
        };
        let remote = self.read_reply(info, deadline).await;
        match (local_result, remote) {
            (Ok(()), Ok(Reply::Done { error: None })) => {
                bump(&counters::TWO_SIDED_CHUNKS);
                chunk.complete_all(&Ok(()));
                None
            }
            (Err(e), _) => Some((chunk, hccl_error(format!("HCCL two-sided transfer with `{}`", info.segment), e))),
            (Ok(()), Ok(Reply::Done { error: Some(why) })) => {
                Some((chunk, Error::transport(format!("`{}` failed its half of the transfer: {why}", info.segment))))
            }
            (Ok(()), Ok(other)) => {
                self.conn = None;
                Some((chunk, Error::transport(format!("`{}` answered {other:?} instead of Done", info.segment))))
            }
            (Ok(()), Err(e)) if self.interrupted(&e, deadline) => {
                chunk.complete_all(&Err(e));
                None
            }
            (Ok(()), Err(e)) => Some((chunk, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(epoch: u64, status: Status) -> Slot {
        Slot { epoch, status, why: "no".into() }
    }

    #[test]
    fn a_peer_may_join_this_sides_epoch_or_the_next_one_only() {
        use Status::*;
        let stale = |e| Err(Reply::Stale { epoch: e });
        // Fresh: only epoch 1.
        assert_eq!(join_decision(&slot(0, Absent), None, 1, None), Ok(()));
        assert_eq!(join_decision(&slot(0, Absent), None, 0, None), stale(1));
        // Far ahead (a forged or confused peer, or one that outlived this side): the next one.
        assert_eq!(join_decision(&slot(0, Absent), None, u64::MAX, None), stale(1));
        assert_eq!(join_decision(&slot(4, Ready), None, 6, None), stale(5));
        // Ready or pending at 4: 4 or 5.
        for st in [Ready, Pending] {
            assert_eq!(join_decision(&slot(4, st), None, 4, None), Ok(()));
            assert_eq!(join_decision(&slot(4, st), None, 5, None), Ok(()));
            assert_eq!(join_decision(&slot(4, st), None, 3, None), stale(5), "behind: it restarted");
        }
        // Broken at 4: only 5.
        assert_eq!(join_decision(&slot(4, Broken), None, 4, None), stale(5));
        assert_eq!(join_decision(&slot(4, Broken), None, 5, None), Ok(()));
        // Unsupported: said again, unless the peer asks past it.
        assert!(matches!(join_decision(&slot(2, Unsupported), None, 2, None), Err(Reply::Unsupported { .. })));
        assert_eq!(join_decision(&slot(2, Unsupported), None, 3, None), Ok(()));
        // The counter at its end: refused, no overflow.
        assert!(matches!(join_decision(&slot(u64::MAX, Ready), None, u64::MAX, None), Err(Reply::Error { .. })));
    }

    #[test]
    fn live_communicators_are_counted_per_card() {
        let count = |card| CardCommunicators::per_card().get(&card).copied().unwrap_or(0);
        let a = CardCommunicators::open(900);
        let b = CardCommunicators::open(900);
        let c = CardCommunicators::open(901);
        assert_eq!((count(900), count(901)), (2, 1));
        drop(a);
        drop(c);
        assert_eq!((count(900), count(901)), (1, 0));
        drop(b);
        assert_eq!(count(900), 0);
    }

    #[test]
    fn a_restarted_peer_gets_a_new_communicator() {
        use Status::*;
        // Same instance: the ready communicator may be joined as it is.
        assert_eq!(join_decision(&slot(4, Ready), Some("a"), 4, Some("a")), Ok(()));
        // A new instance asking for the current epoch is sent to the next one (a rebuild).
        assert_eq!(join_decision(&slot(4, Ready), Some("a"), 4, Some("b")), Err(Reply::Stale { epoch: 5 }));
        assert_eq!(join_decision(&slot(4, Ready), Some("a"), 5, Some("b")), Ok(()));
        assert_eq!(join_decision(&slot(2, Unsupported), Some("a"), 3, Some("b")), Ok(()));
    }
}
