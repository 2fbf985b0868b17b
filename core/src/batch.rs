//! Transfer requests and batches: what a caller submits, the caller's [`Batch`] (wait, poll,
//! cancel), and the transport's [`Submission`] (the requests it was handed, each with its leased
//! local span, which it completes exactly once — or its drop does).

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};
use crate::memory::{LeasedSpans, Region, RegionLease};
use crate::metrics::EngineMetrics;
use crate::segment::OpenSegment;
pub use crate::segment::SegmentHandle;
use crate::wait_model::TailPlan;

/// Direction of a transfer, numbered as in Mooncake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Opcode {
    /// Copy from the target segment into local memory (pull).
    Read = 0,
    /// Copy from local memory into the target segment (push).
    Write = 1,
}

/// One transfer: `length` bytes between local address `source` and the target segment's
/// address `target_offset` (the peer's virtual address, as in Mooncake).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferRequest {
    /// Read or write.
    pub opcode: Opcode,
    /// Local address (inside a registered region).
    pub source: u64,
    /// Target segment.
    pub target: SegmentHandle,
    /// Target address in the peer's address space (inside one of its published buffers).
    pub target_offset: u64,
    /// Bytes to move (non-zero).
    pub length: u64,
}

/// A request after the engine validated it, with the local region it lies in.
#[derive(Debug)]
pub struct ValidatedRequest {
    /// The request as submitted.
    pub request: TransferRequest,
    /// The local region it reads or writes. The batch holds a lease on it until every
    /// transport released its requests (see [`Submission::complete`]).
    pub local: Region,
}

/// State of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// Not finished.
    Pending,
    /// All bytes moved.
    Completed,
    /// Failed; [`Batch::error`] has the details.
    Failed(ErrorKind),
    /// Cancelled before it completed.
    Cancelled,
}

const PENDING: u8 = 0;
const COMPLETED: u8 = 1;
const FAILED: u8 = 2;
const CANCELLED: u8 = 3;

/// Largest batch (in bytes) [`Batch::wait_blocking`] polls for before sleeping.
pub const SPIN_MAX_BYTES: u64 = 64 * 1024;

/// Default time [`Batch::wait_blocking`] polls for completion before it sleeps
/// (`FERRY_WAIT_SPIN_US` overrides; 0 disables polling). The async [`Batch::wait`] never polls.
pub const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(50);

/// How long a waiter that is about to sleep polls first: [`SPIN_BEFORE_SLEEP`], or
/// `FERRY_WAIT_SPIN_US` (at most 10 ms; 0 disables polling). Read once per process. Used by
/// [`Batch::wait_blocking`] and by transports whose caller's thread waits on a socket itself
/// (the TCP transport's direct path).
pub fn spin_before_sleep() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        std::env::var("FERRY_WAIT_SPIN_US")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(|us| Duration::from_micros(us.min(10_000)))
            .unwrap_or(SPIN_BEFORE_SLEEP)
    })
}

/// Counts of a batch's request states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchStatus {
    /// Requests in the batch.
    pub total: usize,
    /// Completed.
    pub completed: usize,
    /// Failed.
    pub failed: usize,
    /// Cancelled.
    pub cancelled: usize,
    /// Still pending.
    pub pending: usize,
}

impl BatchStatus {
    /// True when no request is pending.
    pub fn is_done(&self) -> bool {
        self.pending == 0
    }
    /// True when every request completed.
    pub fn is_success(&self) -> bool {
        self.completed == self.total
    }
}

/// Called once per request of a batch when its transport releases it: see
/// [`Batch::lease_observed`].
type ReleaseObserver = Box<dyn Fn(&Batch, usize) + Send + Sync>;

/// Whether a batch is done, and how many blocking waiters sleep on it (both under one lock).
#[derive(Debug)]
struct Done {
    done: bool,
    sleepers: usize,
}

/// A batch's [`ReleaseObserver`], if any (a newtype only to give it a `Debug`).
struct OnRelease(Option<ReleaseObserver>);

impl std::fmt::Debug for OnRelease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Some(<observer>)" } else { "None" })
    }
}

/// The shared state of a batch: the validated requests and their completion state. Callers see
/// it through [`Batch`], transports through [`Submission`]s.
#[derive(Debug)]
pub(crate) struct BatchCore {
    requests: Box<[ValidatedRequest]>,
    state: Box<[AtomicU8]>,
    errors: Mutex<Vec<(usize, Error)>>,
    remaining: AtomicUsize,
    cancelled: AtomicBool,
    segments: Vec<Arc<OpenSegment>>,
    /// Leases on the local regions, dropped once every request was released by its transport.
    leases: Mutex<Vec<RegionLease>>,
    /// Requests released by their transport (a first `complete` call per index, won or not).
    released: AtomicUsize,
    /// Which indices were released (a second `complete` for an index must not count).
    released_flags: Box<[AtomicBool]>,
    total_bytes: u64,
    submitted_at: Instant,
    finished_at: OnceLock<Instant>,
    notify: tokio::sync::Notify,
    done_lock: Mutex<Done>,
    done_cv: Condvar,
    /// Told about each request once it is released.
    on_release: OnRelease,
    /// The engine's counters (for batches an engine minted).
    metrics: Option<Arc<EngineMetrics>>,
    /// A request failed (not cancelled): the batch logs one line when it finishes.
    any_failed: AtomicBool,
    /// The submitting thread blocks waiting for this batch right after submitting it
    /// ([`Submission::caller_waits`]).
    caller_waits: bool,
    /// A device moves the bytes and the host's threads idle meanwhile
    /// ([`Submission::mark_device_completed`]): a blocking waiter polls the batch's expected end.
    device_completed: AtomicBool,
}

impl BatchCore {
    /// Builds a batch from validated requests; `leases` keep their local regions registered
    /// until every transport released its requests; `segments` are the targets it touches (used
    /// to mark a segment's cached descriptor stale when its peer fails).
    pub(crate) fn new(
        requests: Vec<ValidatedRequest>,
        leases: Vec<RegionLease>,
        segments: Vec<Arc<OpenSegment>>,
        on_release: Option<ReleaseObserver>,
        metrics: Option<Arc<EngineMetrics>>,
        caller_waits: bool,
    ) -> Arc<Self> {
        let n = requests.len();
        let total_bytes = requests.iter().map(|r| r.request.length).sum();
        Arc::new(Self {
            requests: requests.into_boxed_slice(),
            state: (0..n).map(|_| AtomicU8::new(PENDING)).collect(),
            errors: Mutex::new(Vec::new()),
            remaining: AtomicUsize::new(n),
            cancelled: AtomicBool::new(false),
            segments,
            leases: Mutex::new(leases),
            released: AtomicUsize::new(0),
            released_flags: (0..n).map(|_| AtomicBool::new(false)).collect(),
            total_bytes,
            submitted_at: Instant::now(),
            finished_at: OnceLock::new(),
            notify: tokio::sync::Notify::new(),
            done_lock: Mutex::new(Done { done: n == 0, sleepers: 0 }),
            done_cv: Condvar::new(),
            on_release: OnRelease(on_release),
            metrics,
            any_failed: AtomicBool::new(false),
            caller_waits,
            device_completed: AtomicBool::new(false),
        })
    }

    /// Number of requests.
    pub(crate) fn len(&self) -> usize {
        self.requests.len()
    }

    /// True for an empty batch.
    pub(crate) fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// All requests.
    pub(crate) fn requests(&self) -> &[ValidatedRequest] {
        &self.requests
    }

    /// Total bytes of all requests.
    pub(crate) fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// True once [`cancel`](Self::cancel) was called. Transports check it before starting a
    /// request.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// True once the transport released request `i` (called [`complete`](Self::complete) for
    /// it): it touches the request's memory no more. A cancelled request may have an outcome
    /// before it is released.
    pub(crate) fn is_released(&self, i: usize) -> bool {
        self.released_flags.get(i).is_some_and(|f| f.load(Ordering::Acquire))
    }

    /// True once every request was released (the batch's leases are dropped).
    pub(crate) fn all_released(&self) -> bool {
        self.released.load(Ordering::Acquire) == self.len()
    }

    /// A transport reports that it is done with request `i`, with its outcome. The first outcome
    /// wins; later ones (for example a completion racing a cancellation) are ignored. Returns
    /// whether this call set it.
    ///
    /// A transport calls this exactly once for every index it accepted, **even for a request
    /// that was cancelled meanwhile**: the call also says "I no longer touch this request's
    /// memory". Once every request has been released, the batch drops its leases on local
    /// memory, so the memory may be unregistered while the caller still holds the batch.
    ///
    /// The batch's release observer, if any, is told about a first release once its outcome is
    /// recorded.
    pub(crate) fn complete(self: &Arc<Self>, i: usize, result: Result<()>) -> bool {
        // Release first: a waiter woken by the outcome may unregister the memory at once.
        let first_release = self.released_flags.get(i).is_some_and(|f| !f.swap(true, Ordering::AcqRel));
        if first_release && self.released.fetch_add(1, Ordering::AcqRel) + 1 == self.len() {
            self.leases.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
        let set = self.set_outcome(i, result);
        if first_release && let Some(observe) = &self.on_release.0 {
            observe(&Batch { core: self.clone() }, i);
        }
        set
    }

    /// [`complete`](Self::complete) for every index in `indices` with a copy of `outcome`. A
    /// successful outcome updates the batch's release and remaining counts once for all of
    /// them instead of once per request (two atomic operations per request instead of four),
    /// and releases every request before it records any outcome, so a waiter woken by the
    /// last one finds them all released, as with `complete`. A failure, or a batch with a
    /// release observer, takes `complete`'s path per request (failures are logged and counted
    /// one by one).
    pub(crate) fn complete_many(self: &Arc<Self>, indices: &[u32], outcome: &Result<()>) {
        if outcome.is_err() || self.on_release.0.is_some() {
            for &i in indices {
                let o = match outcome {
                    Ok(()) => Ok(()),
                    Err(e) => Err(e.duplicate()),
                };
                self.complete(i as usize, o);
            }
            return;
        }
        let first_releases = indices
            .iter()
            .filter(|&&i| self.released_flags.get(i as usize).is_some_and(|f| !f.swap(true, Ordering::AcqRel)))
            .count();
        if first_releases > 0
            && self.released.fetch_add(first_releases, Ordering::AcqRel) + first_releases == self.len()
        {
            self.leases.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
        let mut set = 0;
        for &i in indices {
            let Some(state) = self.state.get(i as usize) else {
                tracing::error!(
                    index = i,
                    len = self.state.len(),
                    "a transport completed a request index outside its batch"
                );
                continue;
            };
            if state.compare_exchange(PENDING, COMPLETED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                set += 1;
            }
        }
        if set > 0 && self.remaining.fetch_sub(set, Ordering::AcqRel) == set {
            self.finish();
        }
    }

    /// Records request `i`'s outcome **without** releasing it: the caller sees the outcome at
    /// once (for example a timeout), while the transport, which may still touch the request's
    /// memory, releases it later with [`complete`](Self::complete) (whose outcome is then
    /// ignored). Returns whether this call set the outcome.
    pub(crate) fn report_outcome(&self, i: usize, result: Result<()>) -> bool {
        self.set_outcome(i, result)
    }

    /// Records an outcome without releasing the request (cancellation does not stop a
    /// transport from touching memory it already started on). [`complete_many`](Self::complete_many)
    /// does what this does for a success, for many requests at once: keep the two in step.
    fn set_outcome(&self, i: usize, result: Result<()>) -> bool {
        if i >= self.state.len() {
            tracing::error!(
                index = i,
                len = self.state.len(),
                "a transport completed a request index outside its batch"
            );
            return false;
        }
        let new = match &result {
            Ok(()) => COMPLETED,
            Err(e) if e.kind() == ErrorKind::Cancelled => CANCELLED,
            Err(_) => FAILED,
        };
        if self.state[i].compare_exchange(PENDING, new, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return false;
        }
        if let Err(e) = result {
            if let Some(m) = &self.metrics {
                m.failure(e.kind());
            }
            if e.kind() != ErrorKind::Cancelled {
                self.any_failed.store(true, Ordering::Release);
                let r = &self.requests[i].request;
                tracing::debug!(
                    segment = self.metrics.as_ref().map_or("", |m| m.segment()),
                    peer = self.peer_name(r.target),
                    request = i,
                    opcode = ?r.opcode,
                    length = r.length,
                    kind = %e.kind(),
                    error = %e,
                    "transfer request failed"
                );
            }
            if e.kind() == ErrorKind::PeerUnreachable {
                let target = self.requests[i].request.target;
                if let Some(seg) = self.segments.iter().find(|s| s.handle() == target) {
                    seg.mark_stale();
                }
            }
            self.errors.lock().unwrap_or_else(|p| p.into_inner()).push((i, e));
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.finish();
        }
        true
    }

    fn finish(&self) {
        let now = Instant::now();
        let _ = self.finished_at.set(now);
        let failed = self.any_failed.load(Ordering::Acquire);
        if let Some(m) = &self.metrics {
            m.batch_finished(now - self.submitted_at);
            self.count_into_routes();
            // Only a batch that ran its course says how long the next one will take.
            if self.device_completed.load(Ordering::Relaxed) && !failed && !self.is_cancelled() {
                m.wait_model().record_completion(self.total_bytes, now - self.submitted_at);
            }
        }
        if failed {
            self.log_failure();
        }
        self.notify.notify_waiters();
        let sleepers = {
            let mut done = self.done_lock.lock().unwrap_or_else(|p| p.into_inner());
            done.done = true;
            done.sleepers
        };
        // A notification is a system call even with nobody waiting: a batch completed before
        // its caller waited (on the caller's own thread, for one) is not worth one. It is sent
        // after the lock is let go: a sleeper woken while it is held (on a host that runs both
        // threads on one core, at once) would only find it taken and sleep again, to be woken
        // a second time by the unlock. A sleeper counted above sees `done` when it wakes; one
        // that comes after sees it before it sleeps.
        if sleepers > 0 {
            self.done_cv.notify_all();
        }
    }

    /// The segment name of target `handle`, for logs.
    fn peer_name(&self, handle: SegmentHandle) -> &str {
        self.segments.iter().find(|s| s.handle() == handle).map_or("?", |s| s.name())
    }

    /// One line per failed batch, at `warn`: the peer and request of its first failure, and how
    /// many failed (each failed request has its own line at `debug`).
    fn log_failure(&self) {
        let errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        let failed: Vec<&(usize, Error)> = errors.iter().filter(|(_, e)| e.kind() != ErrorKind::Cancelled).collect();
        let Some((i, e)) = failed.iter().min_by_key(|(i, _)| *i) else { return };
        let r = &self.requests[*i].request;
        tracing::warn!(
            segment = self.metrics.as_ref().map_or("", |m| m.segment()),
            peer = self.peer_name(r.target),
            request = i,
            opcode = ?r.opcode,
            length = r.length,
            failed = failed.len(),
            total = self.len(),
            kind = %e.kind(),
            error = %e,
            "transfer batch failed"
        );
    }

    /// Adds the finished batch's requests to the counters of their routes: each run of requests
    /// to one segment with one opcode with a few atomic additions (every outcome is final here).
    fn count_into_routes(&self) {
        let flush = |key: Option<(SegmentHandle, usize)>, (requests, bytes, failed): (u64, u64, u64)| {
            let Some((target, opcode)) = key else { return };
            let seg = match self.segments.as_slice() {
                [only] if only.handle() == target => Some(only),
                all => all.iter().find(|s| s.handle() == target),
            };
            if let Some(route) = seg.and_then(|s| s.metrics()) {
                route.add(opcode, requests, bytes, failed);
            }
        };
        let mut key = None;
        let mut acc = (0u64, 0u64, 0u64);
        for (r, state) in self.requests.iter().zip(self.state.iter()) {
            let this = Some((r.request.target, r.request.opcode as usize));
            if this != key {
                flush(key, acc);
                key = this;
                acc = (0, 0, 0);
            }
            if state.load(Ordering::Acquire) == COMPLETED {
                acc.0 += 1;
                acc.1 += r.request.length;
            } else {
                acc.2 += 1;
            }
        }
        flush(key, acc);
    }

    /// Cancels every request that has not completed. Requests a transport already started may
    /// still move their bytes; their outcome is reported as cancelled all the same.
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        for i in 0..self.len() {
            self.set_outcome(i, Err(Error::new(ErrorKind::Cancelled, "cancelled by the caller")));
        }
    }

    /// State of request `i`, or `None` when `i` is out of range.
    pub(crate) fn request_status(&self, i: usize) -> Option<RequestStatus> {
        let s = self.state.get(i)?.load(Ordering::Acquire);
        Some(match s {
            PENDING => RequestStatus::Pending,
            COMPLETED => RequestStatus::Completed,
            CANCELLED => RequestStatus::Cancelled,
            _ => RequestStatus::Failed(self.error(i).map(|e| e.kind()).unwrap_or(ErrorKind::Transport)),
        })
    }

    /// The error of request `i`, if it failed or was cancelled.
    pub(crate) fn error(&self, i: usize) -> Option<Error> {
        let errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        errors.iter().find(|(j, _)| *j == i).map(|(_, e)| e.duplicate())
    }

    /// All failures so far, as (request index, error), in completion order.
    pub(crate) fn errors(&self) -> Vec<(usize, Error)> {
        let errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        errors.iter().map(|(i, e)| (*i, e.duplicate())).collect()
    }

    /// Counts of request states.
    pub(crate) fn status(&self) -> BatchStatus {
        let mut s = BatchStatus { total: self.len(), ..BatchStatus::default() };
        for st in self.state.iter() {
            match st.load(Ordering::Acquire) {
                PENDING => s.pending += 1,
                COMPLETED => s.completed += 1,
                CANCELLED => s.cancelled += 1,
                _ => s.failed += 1,
            }
        }
        s
    }

    /// True when no request is pending.
    pub(crate) fn is_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    /// Time from submission to the last completion (or until now while pending).
    pub(crate) fn elapsed(&self) -> Duration {
        self.finished_at.get().copied().unwrap_or_else(Instant::now) - self.submitted_at
    }

    /// Waits until no request is pending, or `timeout` passes ([`ErrorKind::Timeout`]; the batch
    /// keeps running and can be waited on again or cancelled).
    pub(crate) async fn wait(&self, timeout: Duration) -> Result<BatchStatus> {
        // No polling here: a task that spins holds its worker thread, and with it, often, the
        // very task that would complete the batch.
        let done = async {
            loop {
                let notified = self.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.is_done() {
                    return;
                }
                notified.await;
            }
        };
        match tokio::time::timeout(timeout, done).await {
            Ok(()) => Ok(self.status()),
            Err(_) => Err(self.timeout_error(timeout)),
        }
    }

    /// Like [`wait`](Self::wait), then turns the first failure into an error.
    pub(crate) async fn wait_ok(&self, timeout: Duration) -> Result<()> {
        let status = self.wait(timeout).await?;
        self.outcome(status)
    }

    /// Blocking form of [`wait`](Self::wait), for callers outside an async runtime. Needs no
    /// runtime itself.
    pub(crate) fn wait_blocking(&self, timeout: Duration) -> Result<BatchStatus> {
        if self.spin_until_done() {
            return Ok(self.status());
        }
        // A timeout too large to add to `now` means "no deadline".
        let deadline = Instant::now().checked_add(timeout);
        // A device-completed batch: sleep until just before its expected end, then poll.
        let mut tail = self.tail_plan();
        let mut done = self.done_lock.lock().unwrap_or_else(|p| p.into_inner());
        // Counted under the lock `finish` takes to set `done`: it notifies only when someone
        // sleeps.
        done.sleepers += 1;
        let mut timed_out = false;
        // Whether the last sleep was bounded by the tail plan's wake-up (so its lateness is a
        // sample of this host's).
        let mut slept_for_tail = false;
        while !done.done {
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                timed_out = true;
                break;
            }
            if let Some(plan) = tail
                && now >= plan.wake_at
            {
                tail = None;
                if slept_for_tail && let Some(m) = &self.metrics {
                    m.wait_model().record_lateness(now - plan.wake_at);
                }
                // Not counted while it polls: `finish` need not notify a thread that is awake.
                done.sleepers -= 1;
                drop(done);
                if self.poll_tail(plan, deadline) {
                    return Ok(self.status());
                }
                done = self.done_lock.lock().unwrap_or_else(|p| p.into_inner());
                done.sleepers += 1;
                continue;
            }
            let wake = deadline.into_iter().chain(tail.map(|plan| plan.wake_at)).min();
            slept_for_tail = tail.is_some_and(|plan| wake == Some(plan.wake_at));
            done = match wake {
                None => self.done_cv.wait(done).unwrap_or_else(|p| p.into_inner()),
                Some(wake) => self.done_cv.wait_timeout(done, wake - now).unwrap_or_else(|p| p.into_inner()).0,
            };
        }
        done.sleepers -= 1;
        drop(done);
        if timed_out {
            return Err(self.timeout_error(timeout));
        }
        Ok(self.status())
    }

    /// Blocking form of [`wait_ok`](Self::wait_ok).
    pub(crate) fn wait_ok_blocking(&self, timeout: Duration) -> Result<()> {
        let status = self.wait_blocking(timeout)?;
        self.outcome(status)
    }

    /// When a blocking waiter of a device-completed batch should wake to poll its end: `None`
    /// for other batches, when polling is off (`FERRY_WAIT_SPIN_US=0`), for a batch no engine
    /// minted, and before the engine finished a batch of this size class.
    fn tail_plan(&self) -> Option<TailPlan> {
        if !self.device_completed.load(Ordering::Relaxed) || spin_before_sleep().is_zero() {
            return None;
        }
        self.metrics.as_ref()?.wait_model().plan(self.total_bytes, self.submitted_at)
    }

    /// Polls a device-completed batch until it is done (true) or the plan's window, or the
    /// caller's `deadline`, is over, and counts the poll. It yields between looks rather than
    /// spin: on a host where the device is emulated by host threads (ours), a spinning waiter
    /// took the core they needed (a 1 MiB batch's device time rose from ~280 to ~480 µs on
    /// the 2-core VM; docs/performance.md, issue 15's sixth pass), while a yielding one lets
    /// any runnable thread go first and keeps its vCPU from halting.
    fn poll_tail(&self, plan: TailPlan, deadline: Option<Instant>) -> bool {
        let stop = deadline.map_or(plan.poll_until, |d| d.min(plan.poll_until));
        while !self.is_done() && Instant::now() < stop {
            std::thread::yield_now();
        }
        let caught = self.is_done();
        if let Some(m) = &self.metrics {
            m.tail_poll(caught);
        }
        caught
    }

    /// Polls for completion for up to [`SPIN_BEFORE_SLEEP`] before a blocking waiter sleeps:
    /// waking a sleeping thread costs tens of microseconds on a loaded or virtualised host, as
    /// much as a whole small transfer.
    fn spin_until_done(&self) -> bool {
        let spin = spin_before_sleep();
        // Only small batches are worth polling for: a large one keeps the other core busy
        // moving bytes, and a poller would compete with it.
        if spin.is_zero() || self.total_bytes > SPIN_MAX_BYTES {
            return self.is_done();
        }
        let start = Instant::now();
        loop {
            if self.is_done() {
                return true;
            }
            if start.elapsed() >= spin {
                return false;
            }
            std::hint::spin_loop();
        }
    }

    fn outcome(&self, status: BatchStatus) -> Result<()> {
        if status.is_success() {
            return Ok(());
        }
        let errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        let (i, e) = errors.iter().min_by_key(|(i, _)| *i).expect("a batch that did not succeed has an error");
        Err(e.context(format!(
            "{} of {} request(s) failed; first, request {i}: {}",
            status.failed + status.cancelled,
            status.total,
            e.message()
        )))
    }

    fn timeout_error(&self, timeout: Duration) -> Error {
        let s = self.status();
        Error::timeout(format!("{} of {} request(s) still pending after {timeout:?}", s.pending, s.total))
    }
}

/// A submitted batch, as its caller sees it: wait for it, poll it, cancel it.
///
/// It cannot complete or release a request: only the transport that holds a request (through
/// its [`Submission`]) can, so memory a transport still touches stays leased whatever the
/// caller does. Cloning is cheap (a shared handle).
///
/// ```compile_fail
/// # fn f(batch: ferry_core::Batch) {
/// batch.complete(0, Ok(())); // a caller cannot release a request
/// # }
/// ```
///
/// # Threading
/// Every method takes `&self` and may be called from any thread.
#[derive(Debug, Clone)]
pub struct Batch {
    core: Arc<BatchCore>,
}

impl Batch {
    /// Leases every request's local range in `memory` and starts a batch over them: the
    /// caller's handle, and the [`Submission`] of all its requests for the transport(s)
    /// (split it per target with [`Submission::take`]). `segments` are the targets the requests
    /// name (a failure with [`ErrorKind::PeerUnreachable`] marks its segment stale).
    ///
    /// This is the only way to make a submission: every request it hands out lies in memory
    /// registered in `memory` (registration is `unsafe`: its caller promised the memory stays
    /// valid until unregistered) and leased until the transport released it.
    ///
    /// # Errors
    /// The index of the first request whose local range is not inside one registered region
    /// (or whose length is zero or wraps), with why.
    pub fn lease(
        memory: &crate::memory::MemoryRegistry,
        requests: &[TransferRequest],
        segments: Vec<Arc<OpenSegment>>,
    ) -> std::result::Result<(Batch, Submission), (usize, Error)> {
        let leased = memory.lease_spans(requests.iter().map(|r| (r.source, r.length)))?;
        Self::from_leases(requests, leased, segments, None, None, false)
    }

    /// [`lease`](Self::lease), with `on_release` told about each request once its transport
    /// released it (the first [`Submission::complete`] for it, or the drop of a submission
    /// holding it), with the batch and the request's index: the request's outcome is recorded
    /// by then, and its memory is touched no more. A plugin SDK reports completions to its host
    /// this way, without polling.
    ///
    /// `on_release` runs on the releasing thread, inside the transport's `complete` (possibly
    /// inside its `submit`), exactly once per request; it must not block, and should not keep
    /// the [`Batch`] it is given (that would keep the batch alive as long as itself).
    ///
    /// # Errors
    /// As [`lease`](Self::lease).
    pub fn lease_observed(
        memory: &crate::memory::MemoryRegistry,
        requests: &[TransferRequest],
        segments: Vec<Arc<OpenSegment>>,
        on_release: impl Fn(&Batch, usize) + Send + Sync + 'static,
    ) -> std::result::Result<(Batch, Submission), (usize, Error)> {
        let leased = memory.lease_spans(requests.iter().map(|r| (r.source, r.length)))?;
        Self::from_leases(requests, leased, segments, Some(Box::new(on_release)), None, false)
    }

    /// [`lease`](Self::lease) with the leases already taken (the region of each request's local
    /// range, in order, and one lease per region: the engine checks the local ranges before it
    /// looks up the segments, and takes them only once), counting into the engine's `metrics`.
    /// `caller_waits`: see [`Submission::caller_waits`].
    pub(crate) fn from_leases(
        requests: &[TransferRequest],
        leased: LeasedSpans,
        segments: Vec<Arc<OpenSegment>>,
        on_release: Option<ReleaseObserver>,
        metrics: Option<Arc<EngineMetrics>>,
        caller_waits: bool,
    ) -> std::result::Result<(Batch, Submission), (usize, Error)> {
        if leased.regions.len() != requests.len() {
            return Err((0, Error::new(ErrorKind::Internal, "a batch's leased regions do not match its requests")));
        }
        let validated: Vec<ValidatedRequest> =
            requests.iter().zip(leased.regions).map(|(r, local)| ValidatedRequest { request: *r, local }).collect();
        let core = BatchCore::new(validated, leased.leases, segments, on_release, metrics, caller_waits);
        let n =
            u32::try_from(requests.len()).map_err(|_| (0, Error::invalid("more than 2^32 requests in one batch")))?;
        let submission = Submission::new(core.clone(), (0..n).collect());
        Ok((Batch { core }, submission))
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.core.len()
    }

    /// True for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.core.is_empty()
    }

    /// Request `i`, or `None` when out of range.
    pub fn request(&self, i: usize) -> Option<&ValidatedRequest> {
        self.core.requests.get(i)
    }

    /// All requests.
    pub fn requests(&self) -> &[ValidatedRequest] {
        self.core.requests()
    }

    /// Total bytes of all requests.
    pub fn total_bytes(&self) -> u64 {
        self.core.total_bytes()
    }

    /// True once [`cancel`](Self::cancel) was called.
    pub fn is_cancelled(&self) -> bool {
        self.core.is_cancelled()
    }

    /// True once the transport released request `i`: it touches the request's memory no more.
    /// A cancelled request may have an outcome before it is released.
    pub fn is_released(&self, i: usize) -> bool {
        self.core.is_released(i)
    }

    /// True once every request was released (the batch's leases are dropped: its memory may be
    /// unregistered).
    pub fn all_released(&self) -> bool {
        self.core.all_released()
    }

    /// Cancels every request that has not completed. Requests a transport already started may
    /// still move their bytes; their outcome is reported as cancelled all the same, and their
    /// memory stays leased until the transport released them.
    pub fn cancel(&self) {
        self.core.cancel();
    }

    /// State of request `i`, or `None` when `i` is out of range.
    pub fn request_status(&self, i: usize) -> Option<RequestStatus> {
        self.core.request_status(i)
    }

    /// The error of request `i`, if it failed or was cancelled.
    pub fn error(&self, i: usize) -> Option<Error> {
        self.core.error(i)
    }

    /// All failures so far, as (request index, error), in completion order.
    pub fn errors(&self) -> Vec<(usize, Error)> {
        self.core.errors()
    }

    /// Counts of request states.
    pub fn status(&self) -> BatchStatus {
        self.core.status()
    }

    /// True when no request is pending.
    pub fn is_done(&self) -> bool {
        self.core.is_done()
    }

    /// Time from submission to the last completion (or until now while pending).
    pub fn elapsed(&self) -> Duration {
        self.core.elapsed()
    }

    /// Waits until no request is pending, or `timeout` passes ([`ErrorKind::Timeout`]; the batch
    /// keeps running and can be waited on again or cancelled).
    pub async fn wait(&self, timeout: Duration) -> Result<BatchStatus> {
        self.core.wait(timeout).await
    }

    /// Like [`wait`](Self::wait), then turns the first failure into an error.
    pub async fn wait_ok(&self, timeout: Duration) -> Result<()> {
        self.core.wait_ok(timeout).await
    }

    /// Blocking form of [`wait`](Self::wait), for callers outside an async runtime. Needs no
    /// runtime itself.
    pub fn wait_blocking(&self, timeout: Duration) -> Result<BatchStatus> {
        self.core.wait_blocking(timeout)
    }

    /// Blocking form of [`wait_ok`](Self::wait_ok).
    pub fn wait_ok_blocking(&self, timeout: Duration) -> Result<()> {
        self.core.wait_ok_blocking(timeout)
    }

    /// Whether `a` and `b` are the same batch.
    pub fn ptr_eq(a: &Batch, b: &Batch) -> bool {
        Arc::ptr_eq(&a.core, &b.core)
    }
}

/// Requests of one batch handed to a transport: each with its leased local span, to be
/// completed exactly once.
///
/// Made only by [`Batch::lease`] (the engine, or a plugin host, mints it) and never cloned.
/// The transport completes each request it holds with [`complete`](Self::complete) — its
/// outcome and its promise to touch the request's memory no more — or shows an outcome first
/// with [`report`](Self::report) (a timeout while the device may still write) and completes it
/// later. Whatever a submission still holds when it is dropped is completed with an
/// [`ErrorKind::Internal`] error, so no request is ever left pending, and its memory is released
/// only then.
#[derive(Debug)]
pub struct Submission {
    core: Arc<BatchCore>,
    /// The batch indices it holds are `indices[done..]`: completing them in order (what most
    /// transports do) only moves `done`, so a large submission completes in linear time.
    indices: Vec<u32>,
    done: usize,
}

impl Submission {
    fn new(core: Arc<BatchCore>, indices: Vec<u32>) -> Self {
        Self { core, indices, done: 0 }
    }

    /// Takes the indices it still holds out of it (it then holds none).
    fn take_held(&mut self) -> Vec<u32> {
        let held = self.indices.split_off(self.done);
        self.indices.clear();
        self.done = 0;
        held
    }

    /// The batch indices it holds, in order.
    pub fn indices(&self) -> &[u32] {
        &self.indices[self.done..]
    }

    /// How many requests it holds.
    pub fn len(&self) -> usize {
        self.indices().len()
    }

    /// True when it holds none.
    pub fn is_empty(&self) -> bool {
        self.indices().is_empty()
    }

    /// Request `i` of its batch. `i` is an index this submission holds (or held): any other
    /// index of the batch is readable too, a foreign one panics.
    pub fn request(&self, i: u32) -> &ValidatedRequest {
        &self.core.requests[i as usize]
    }

    /// The requests it holds, with their indices.
    pub fn requests(&self) -> impl Iterator<Item = (u32, &ValidatedRequest)> + '_ {
        self.indices().iter().map(|&i| (i, &self.core.requests[i as usize]))
    }

    /// True while request `i` of its batch is not released (by this submission or another of
    /// the same batch): its local memory is leased. False for an index outside the batch.
    pub fn is_leased(&self, i: u32) -> bool {
        (i as usize) < self.core.len() && !self.core.is_released(i as usize)
    }

    /// True once the caller cancelled the batch: check before starting a request.
    pub fn is_cancelled(&self) -> bool {
        self.core.is_cancelled()
    }

    /// True when the thread that submitted the batch blocks waiting for it right after
    /// [`Transport::submit`](crate::Transport::submit) returns, and `submit` runs on that
    /// thread, outside any async runtime
    /// ([`TransferEngine::submit_for_blocking_wait`](crate::TransferEngine::submit_for_blocking_wait),
    /// which `transfer_blocking`, C's `ferry_transfer_sync` and `ferry bench` use). A transport
    /// may then run a request to completion inside `submit`, blocking on its I/O, instead of
    /// handing it to another thread whose completion would have to wake the caller: the
    /// caller would wait anyway. Never true for a batch submitted through the async API, whose
    /// `submit` may run on a runtime worker that must not block.
    pub fn caller_waits(&self) -> bool {
        self.core.caller_waits
    }

    /// Says that a device moves these requests' bytes, with the host's threads idle until it
    /// is done (an NPU's copy engines, not a host thread copying or a socket), and that the
    /// transport completes them as soon as it is.
    ///
    /// A thread blocked in [`Batch::wait_blocking`] then sleeps only until just before the batch
    /// is expected to end, from how long the engine's earlier device-completed batches of its
    /// size took and how late this host's timed sleeps return, and polls the rest (yielding
    /// between looks), so that it is awake when the batch ends instead of being woken after (a
    /// wake-up costs ~30 µs on a virtualised host whose idle vCPUs halt). It polls for at most
    /// 500 µs, then sleeps again; `FERRY_WAIT_SPIN_US=0` turns it off with the waiter's other
    /// polling. A transport whose host threads move the bytes (TCP) should not call it: the
    /// poll would take a core they need. docs/transports.md, "Waiting for a device".
    pub fn mark_device_completed(&self) {
        self.core.device_completed.store(true, Ordering::Relaxed);
    }

    /// The batch's caller handle (for a transport that reports per batch, such as a plugin host).
    pub fn batch(&self) -> Batch {
        Batch { core: self.core.clone() }
    }

    /// Completes request `i` with `outcome` and releases it (its memory is touched no more).
    /// An index this submission does not hold is ignored (logged): it was completed already.
    pub fn complete(&mut self, i: u32, outcome: Result<()>) {
        if self.indices.get(self.done) == Some(&i) {
            self.done += 1;
        } else if let Some(pos) = self.indices().iter().position(|&j| j == i) {
            self.indices.remove(self.done + pos);
        } else {
            tracing::error!(index = i, "a transport completed a request it does not hold");
            return;
        }
        self.core.complete(i as usize, outcome);
    }

    /// Shows `outcome` to the caller for request `i` without releasing it (the transport may
    /// still touch its memory and completes it later).
    pub fn report(&self, i: u32, outcome: Result<()>) {
        if self.indices().contains(&i) {
            self.core.report_outcome(i as usize, outcome);
        }
    }

    /// [`report`](Self::report)s `error` for every request it holds.
    pub fn report_all(&self, error: &Error) {
        for &i in self.indices() {
            self.core.report_outcome(i as usize, Err(error.duplicate()));
        }
    }

    /// Completes (and releases) every request it holds with a copy of `outcome`.
    pub fn complete_all(mut self, outcome: &Result<()>) {
        let held = self.take_held();
        self.core.complete_many(&held, outcome);
    }

    /// Completes every request it holds with a copy of `error`.
    pub fn fail_all(self, error: &Error) {
        self.complete_all(&Err(error.duplicate()));
    }

    /// When the batch was cancelled, completes everything it holds as cancelled (`what` says
    /// before what) and returns `None`.
    pub fn unless_cancelled(self, what: &str) -> Option<Self> {
        if self.is_cancelled() {
            self.complete_all(&Err(Error::new(ErrorKind::Cancelled, format!("cancelled before {what}"))));
            None
        } else {
            Some(self)
        }
    }

    /// Splits off the first `n` requests it holds (all of them when it holds fewer).
    pub fn split_front(&mut self, n: usize) -> Submission {
        let mut held = self.take_held();
        let n = n.min(held.len());
        self.indices = held.split_off(n);
        Submission::new(self.core.clone(), held)
    }

    /// Moves the requests it holds for which `pick` is true into a new submission (order kept).
    pub fn take(&mut self, mut pick: impl FnMut(u32, &ValidatedRequest) -> bool) -> Submission {
        let core = self.core.clone();
        let (taken, kept): (Vec<u32>, Vec<u32>) =
            self.take_held().into_iter().partition(|&i| pick(i, &core.requests[i as usize]));
        self.indices = kept;
        Submission::new(core, taken)
    }

    /// One submission per request it holds, in order.
    pub fn into_each(mut self) -> impl Iterator<Item = Submission> {
        let core = self.core.clone();
        self.take_held().into_iter().map(move |i| Submission::new(core.clone(), vec![i]))
    }

    /// Takes over what `other` holds (it must be of the same batch; otherwise `other` keeps
    /// its requests and is returned).
    pub fn absorb(&mut self, mut other: Submission) -> std::result::Result<(), Submission> {
        if !Arc::ptr_eq(&self.core, &other.core) {
            return Err(other);
        }
        let mut held = self.take_held();
        held.append(&mut other.take_held());
        self.indices = held;
        Ok(())
    }

    /// Whether `self` and `other` are requests of the same batch.
    pub fn same_batch(&self, other: &Submission) -> bool {
        Arc::ptr_eq(&self.core, &other.core)
    }
}

impl Drop for Submission {
    fn drop(&mut self) {
        if self.is_empty() {
            return;
        }
        tracing::error!(count = self.len(), "a transport dropped requests without an outcome");
        let e = Error::new(
            ErrorKind::Internal,
            "the transport lost track of this request (it was dropped without an outcome)",
        );
        for i in self.take_held() {
            self.core.complete(i as usize, Err(e.duplicate()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Location, MemoryRegistry};

    /// A batch of `n` 8-byte reads in a registry of its own (never accessed: completed by hand).
    fn batch(n: usize) -> (Arc<MemoryRegistry>, Batch, Submission) {
        let reg = Arc::new(MemoryRegistry::new());
        #[allow(unsafe_code)]
        // SAFETY: the address is never accessed: these batches are completed by hand.
        unsafe { reg.register(0, 1 << 20, Location::Any) }.unwrap();
        let reqs: Vec<TransferRequest> = (0..n)
            .map(|i| TransferRequest {
                opcode: Opcode::Read,
                source: i as u64 * 8,
                target: SegmentHandle::fresh(),
                target_offset: 0,
                length: 8,
            })
            .collect();
        let (b, s) = Batch::lease(&reg, &reqs, Vec::new()).unwrap();
        (reg, b, s)
    }

    #[test]
    fn first_outcome_wins_and_counts_add_up() {
        let (_reg, b, mut s) = batch(3);
        s.complete(0, Ok(()));
        s.complete(0, Err(Error::transport("late")));
        s.complete(1, Err(Error::transport("boom")));
        assert_eq!(b.status(), BatchStatus { total: 3, completed: 1, failed: 1, cancelled: 0, pending: 1 });
        assert_eq!(b.request_status(1), Some(RequestStatus::Failed(ErrorKind::Transport)));
        assert_eq!(b.request_status(3), None);
        assert!(!b.is_done());
        b.cancel();
        assert!(b.is_done());
        assert!(b.is_released(0) && b.is_released(1) && !b.is_released(2), "cancel is not a release");
        assert!(!b.all_released() && !b.is_released(9));
        s.complete(2, Ok(()));
        assert!(b.all_released());
        assert_eq!(b.request_status(2), Some(RequestStatus::Cancelled));
        let e = b.wait_ok_blocking(Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Transport);
        assert!(e.message().contains("request 1") && e.message().contains("2 of 3"), "{e}");
    }

    #[test]
    fn leases_are_dropped_once_every_transport_released_its_requests() {
        let (reg, b, mut s) = batch(2);
        assert_eq!(reg.leases(), 1, "one lease per region");
        b.cancel();
        assert!(b.is_done());
        assert_eq!(reg.leases(), 1, "cancelled, but a transport may still be writing");
        assert!(reg.unregister(0).is_err(), "leased memory cannot be unregistered");
        s.complete(0, Ok(()));
        assert_eq!(reg.leases(), 1);
        s.complete(0, Ok(()));
        assert_eq!(reg.leases(), 1, "a second completion of one index does not count");
        s.complete(1, Err(Error::new(ErrorKind::Cancelled, "seen")));
        assert_eq!(reg.leases(), 0, "released by every transport: memory may go");
        assert_eq!(b.status().cancelled, 2);
    }

    #[test]
    fn a_dropped_submission_completes_and_releases_what_it_held() {
        let (reg, b, mut s) = batch(4);
        let front = s.split_front(1);
        let odd = s.take(|i, _| i % 2 == 1);
        assert_eq!((front.indices(), odd.indices(), s.indices()), (&[0u32][..], &[1u32, 3][..], &[2u32][..]));
        s.report(2, Err(Error::timeout("at the deadline")));
        assert_eq!(b.request_status(2), Some(RequestStatus::Failed(ErrorKind::Timeout)), "shown at once");
        assert!(!b.is_released(2), "reported, not released");
        front.complete_all(&Ok(()));
        drop(odd);
        assert_eq!(b.request_status(1), Some(RequestStatus::Failed(ErrorKind::Internal)));
        assert!(b.error(3).unwrap().message().contains("dropped without an outcome"));
        assert_eq!(reg.leases(), 1, "request 2 is still held");
        drop(s);
        assert!(b.all_released());
        assert_eq!(reg.leases(), 0);
        assert_eq!(b.request_status(2), Some(RequestStatus::Failed(ErrorKind::Timeout)), "the first outcome stays");
    }

    #[test]
    fn completing_in_any_order_keeps_the_rest_held_in_order() {
        let (reg, b, mut s) = batch(5);
        assert!(s.is_leased(0) && !s.is_leased(9));
        s.complete(0, Ok(()));
        s.complete(3, Ok(()));
        s.complete(1, Ok(()));
        assert_eq!(s.indices(), &[2, 4]);
        assert!(!s.is_leased(0) && s.is_leased(2));
        let front = s.split_front(1);
        assert_eq!((front.indices(), s.indices()), (&[2u32][..], &[4u32][..]));
        drop(front);
        s.complete(4, Ok(()));
        assert!(s.is_empty() && b.all_released());
        assert_eq!(reg.leases(), 0);
    }

    #[test]
    fn submissions_merge_only_within_their_batch_and_split_per_request() {
        let (_r1, b1, mut s1) = batch(3);
        let (_r2, _b2, s2) = batch(1);
        let mut two = s1.split_front(2);
        let back = s1.absorb(s2).expect_err("another batch");
        assert!(!back.same_batch(&s1));
        two.absorb(s1).unwrap();
        let each: Vec<Submission> = two.into_each().collect();
        assert_eq!(each.iter().map(|s| s.indices()[0]).collect::<Vec<_>>(), vec![0, 1, 2]);
        for s in each {
            s.complete_all(&Ok(()));
        }
        assert!(b1.status().is_success());
        back.complete_all(&Ok(()));
    }

    #[test]
    fn the_release_observer_hears_each_request_once_after_its_outcome() {
        let reg = Arc::new(MemoryRegistry::new());
        #[allow(unsafe_code)]
        // SAFETY: never accessed: the batch is completed by hand.
        unsafe { reg.register(0, 4096, Location::Any) }.unwrap();
        let reqs: Vec<TransferRequest> = (0..3)
            .map(|i| TransferRequest {
                opcode: Opcode::Read,
                source: i * 8,
                target: SegmentHandle::fresh(),
                target_offset: 0,
                length: 8,
            })
            .collect();
        let heard = Arc::new(Mutex::new(Vec::new()));
        let log = heard.clone();
        let (b, mut s) = Batch::lease_observed(&reg, &reqs, Vec::new(), move |batch, i| {
            log.lock().unwrap().push((i, batch.is_released(i), batch.request_status(i)));
        })
        .unwrap();
        s.report(1, Err(Error::timeout("shown, not released")));
        b.cancel();
        assert!(heard.lock().unwrap().is_empty(), "outcomes alone release nothing");
        s.complete(2, Ok(()));
        s.complete(2, Ok(()));
        drop(s);
        let heard = heard.lock().unwrap().clone();
        assert_eq!(
            heard,
            [
                (2, true, Some(RequestStatus::Cancelled)),
                (0, true, Some(RequestStatus::Cancelled)),
                (1, true, Some(RequestStatus::Failed(ErrorKind::Timeout))),
            ],
            "once per request, released, with the outcome that won"
        );
        assert_eq!(reg.leases(), 0);
        drop(b);
    }

    #[test]
    fn a_batch_leases_only_registered_memory() {
        let reg = MemoryRegistry::new();
        #[allow(unsafe_code)]
        // SAFETY: never accessed.
        unsafe { reg.register(4096, 4096, Location::Any) }.unwrap();
        let r = |source, length| TransferRequest {
            opcode: Opcode::Write,
            source,
            target: SegmentHandle::fresh(),
            target_offset: 0,
            length,
        };
        let (i, e) = Batch::lease(&reg, &[r(4096, 8), r(8000, 200)], Vec::new()).unwrap_err();
        assert_eq!(i, 1, "{e}");
        assert!(Batch::lease(&reg, &[r(0, 8)], Vec::new()).is_err());
        assert_eq!(reg.leases(), 0, "nothing stays leased after a refusal");
    }

    /// The compile_fail doctests of `Batch` and `RegisteredMemory` fail only for the missing
    /// method: the same calls with methods that exist compile (this function is never run).
    #[allow(dead_code)]
    fn the_compile_fail_doctests_name_real_paths(engine: &crate::TransferEngine, batch: crate::Batch) {
        let _ = engine.memory().regions();
        batch.cancel();
    }

    #[tokio::test]
    async fn wait_times_out_then_completes() {
        let (_reg, b, mut s) = batch(2);
        let e = b.wait(Duration::from_millis(20)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(e.message().contains("2 of 2"));
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            s.complete(0, Ok(()));
            s.complete(1, Ok(()));
        });
        assert!(b.wait(Duration::from_secs(5)).await.unwrap().is_success());
        b.wait_ok(Duration::from_secs(1)).await.unwrap();
        t.join().unwrap();
    }

    /// What happens to a request before the transport completes the rest in one call.
    #[derive(Debug, Clone, Copy)]
    enum Before {
        /// Nothing.
        Pending,
        /// Its outcome was reported (a timeout) but it was not released.
        Reported,
        /// It was completed (released) on its own, successfully.
        Completed,
        /// It was completed (released) on its own, failed.
        Failed,
    }

    fn before_strategy() -> impl proptest::strategy::Strategy<Value = Before> {
        use proptest::prelude::*;
        prop_oneof![Just(Before::Pending), Just(Before::Reported), Just(Before::Completed), Just(Before::Failed)]
    }

    proptest::proptest! {
        /// `complete_many` leaves a batch exactly as completing its requests one by one does:
        /// the same outcomes and counts, the same requests released, the leases dropped (or
        /// kept) alike, and done alike — whatever happened to some requests before, and with
        /// indices repeated or outside the batch.
        #[test]
        fn completing_many_at_once_equals_one_by_one(
            before in proptest::collection::vec(before_strategy(), 1..40),
            cancelled in proptest::bool::ANY,
            extra in proptest::collection::vec(0u32..50, 0..4),
            ok in proptest::bool::ANY,
        ) {
            let n = before.len();
            let (reg_many, many, s_many) = batch(n);
            let (reg_one, one, s_one) = batch(n);
            let mut rest = Vec::new();
            for (i, what) in before.iter().enumerate() {
                for b in [&many, &one] {
                    match what {
                        Before::Pending => {}
                        Before::Reported => {
                            b.core.report_outcome(i, Err(Error::timeout("late")));
                        }
                        Before::Completed => {
                            b.core.complete(i, Ok(()));
                        }
                        Before::Failed => {
                            b.core.complete(i, Err(Error::new(ErrorKind::Internal, "broke")));
                        }
                    }
                }
                if matches!(what, Before::Pending | Before::Reported) {
                    rest.push(i as u32);
                }
            }
            if cancelled {
                many.cancel();
                one.cancel();
            }
            rest.extend(&extra);
            let outcome = if ok { Ok(()) } else { Err(Error::new(ErrorKind::Internal, "all broke")) };
            many.core.complete_many(&rest, &outcome);
            for &i in &rest {
                let o = match &outcome {
                    Ok(()) => Ok(()),
                    Err(e) => Err(e.duplicate()),
                };
                one.core.complete(i as usize, o);
            }
            proptest::prop_assert_eq!(many.status(), one.status());
            proptest::prop_assert_eq!(many.is_done(), one.is_done());
            proptest::prop_assert_eq!(many.core.all_released(), one.core.all_released());
            for i in 0..n {
                proptest::prop_assert_eq!(many.core.is_released(i), one.core.is_released(i));
            }
            proptest::prop_assert_eq!(reg_many.leases(), reg_one.leases());
            proptest::prop_assert_eq!(
                many.core.done_lock.lock().unwrap().done,
                one.core.done_lock.lock().unwrap().done
            );
            // Every request is released by now: nothing stays leased.
            proptest::prop_assert_eq!(reg_many.leases(), 0);
            proptest::prop_assert!(many.is_done());
            drop((s_many, s_one));
        }
    }

    /// `finish` wakes sleepers after letting the lock go: no waiter may sleep through a
    /// completion that races with it (such a waiter would time out here).
    #[test]
    fn a_blocking_waiter_racing_the_completion_always_wakes() {
        let reg = Arc::new(MemoryRegistry::new());
        #[allow(unsafe_code)]
        // SAFETY: the address is never accessed: these batches are completed by hand.
        unsafe { reg.register(0, 1 << 20, Location::Any) }.unwrap();
        // Larger than `SPIN_MAX_BYTES`: the waiter sleeps at once rather than polling.
        let req = TransferRequest {
            opcode: Opcode::Read,
            source: 0,
            target: SegmentHandle::fresh(),
            target_offset: 0,
            length: 2 * SPIN_MAX_BYTES,
        };
        race_completions(
            || Batch::lease(&reg, std::slice::from_ref(&req), Vec::new()).unwrap(),
            |round| {
                for _ in 0..round % 7 {
                    std::thread::yield_now();
                }
            },
        );
        assert_eq!(reg.leases(), 0);
    }

    /// 300 rounds: a batch from `make` is completed on another thread after `pause(round)`
    /// while this one blocks in `wait_blocking` (a lost wake-up would time out).
    fn race_completions(make: impl Fn() -> (Batch, Submission), pause: fn(u32)) {
        for round in 0..300u32 {
            let (b, mut s) = make();
            let t = std::thread::spawn(move || {
                pause(round);
                s.complete(0, Ok(()));
            });
            let status = b.wait_blocking(Duration::from_secs(10)).unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert!(status.is_success());
            t.join().unwrap();
        }
    }

    /// A device-completed batch of `len` bytes, counted into `metrics`.
    fn device_batch(reg: &MemoryRegistry, metrics: &Arc<EngineMetrics>, len: u64) -> (Batch, Submission) {
        let req = TransferRequest {
            opcode: Opcode::Read,
            source: 0,
            target: SegmentHandle::fresh(),
            target_offset: 0,
            length: len,
        };
        let leased = reg.lease_spans([(req.source, req.length)].into_iter()).unwrap();
        let (b, s) = Batch::from_leases(&[req], leased, Vec::new(), None, Some(metrics.clone()), false).unwrap();
        s.mark_device_completed();
        (b, s)
    }

    fn registry() -> Arc<MemoryRegistry> {
        let reg = Arc::new(MemoryRegistry::new());
        #[allow(unsafe_code)]
        // SAFETY: the address is never accessed: these batches are completed by hand.
        unsafe { reg.register(0, 1 << 20, Location::Any) }.unwrap();
        reg
    }

    /// Hybrid waiting: once the engine knows how long a device-completed batch of this size
    /// takes, a blocking waiter wakes by itself before that (its timer's lateness is then
    /// recorded), polls, and sleeps again when the batch is late; it never returns early.
    #[test]
    fn a_waiter_of_a_device_completed_batch_wakes_before_the_expected_end() {
        let reg = registry();
        let metrics = EngineMetrics::new("me");
        let len = 2 * SPIN_MAX_BYTES;
        // No estimate yet: the first batch's waiter sleeps until the completion wakes it.
        let (b, mut s) = device_batch(&reg, &metrics, len);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            s.complete(0, Ok(()));
        });
        assert!(b.wait_blocking(Duration::from_secs(10)).unwrap().is_success());
        t.join().unwrap();
        assert_eq!((metrics.snapshot().tail_polls, metrics.wait_model().lateness_estimate()), (0, None));
        // Batches of this size take 50 ms, steadily; this one ends 200 ms late.
        for _ in 0..64 {
            metrics.wait_model().record_completion(len, Duration::from_millis(50));
        }
        let (b, mut s) = device_batch(&reg, &metrics, len);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(250));
            s.complete(0, Ok(()));
        });
        let started = Instant::now();
        assert!(b.wait_blocking(Duration::from_secs(10)).unwrap().is_success());
        assert!(started.elapsed() >= Duration::from_millis(240), "returned before the batch was done");
        t.join().unwrap();
        let stats = metrics.snapshot();
        assert_eq!((stats.tail_polls, stats.tail_polls_caught), (1, 0), "one poll, in vain");
        assert!(metrics.wait_model().lateness_estimate().is_some(), "the waiter did not wake by its timer");
        assert_eq!(reg.leases(), 0);
    }

    /// A plan that expects the end long before it comes neither hides the timeout nor stretches
    /// it; a batch not marked device-completed gets no plan, and teaches none.
    #[test]
    fn a_tail_plan_keeps_the_timeout_and_only_marked_batches_use_one() {
        let reg = registry();
        let metrics = EngineMetrics::new("me");
        let len = 2 * SPIN_MAX_BYTES;
        metrics.wait_model().record_completion(len, Duration::from_millis(5));
        let (b, _s) = device_batch(&reg, &metrics, len);
        let started = Instant::now();
        let e = b.wait_blocking(Duration::from_millis(200)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(5), "waited {waited:?}");
        assert_eq!(metrics.snapshot().tail_polls, 1);

        let other = EngineMetrics::new("other");
        let req = TransferRequest {
            opcode: Opcode::Read,
            source: 0,
            target: SegmentHandle::fresh(),
            target_offset: 0,
            length: 4 * SPIN_MAX_BYTES,
        };
        let leased = reg.lease_spans([(req.source, req.length)].into_iter()).unwrap();
        let (b, mut s) = Batch::from_leases(&[req], leased, Vec::new(), None, Some(other.clone()), false).unwrap();
        s.complete(0, Ok(()));
        assert!(b.is_done());
        assert_eq!(other.wait_model().plan(4 * SPIN_MAX_BYTES, Instant::now()), None);
        // A failed device-completed batch teaches nothing either.
        let (b, mut s) = device_batch(&reg, &other, len);
        s.complete(0, Err(Error::transport("boom")));
        assert!(b.is_done());
        assert_eq!(other.wait_model().plan(len, Instant::now()), None);
    }

    /// A waiter that switches between sleeping and polling never misses a completion that
    /// races with the switch (such a waiter would time out here).
    #[test]
    fn a_hybrid_waiter_racing_the_completion_always_wakes() {
        let reg = registry();
        let metrics = EngineMetrics::new("me");
        let len = 2 * SPIN_MAX_BYTES;
        for _ in 0..8 {
            metrics.wait_model().record_completion(len, Duration::from_micros(200));
        }
        race_completions(
            || device_batch(&reg, &metrics, len),
            |round| {
                let until = Instant::now() + Duration::from_micros(u64::from(round % 9) * 50);
                while Instant::now() < until {
                    std::thread::yield_now();
                }
            },
        );
        assert_eq!(reg.leases(), 0);
    }

    #[test]
    fn blocking_wait_needs_no_runtime() {
        let (_reg, b, mut s) = batch(1);
        assert_eq!(b.wait_blocking(Duration::from_millis(10)).unwrap_err().kind(), ErrorKind::Timeout);
        s.complete(7, Ok(()));
        assert!(!b.is_done(), "an index the submission does not hold is ignored, not a panic");
        let t = std::thread::spawn(move || s.complete(0, Ok(())));
        b.wait_ok_blocking(Duration::MAX).unwrap();
        t.join().unwrap();
        assert!(b.elapsed() < Duration::from_secs(5));
    }
}
