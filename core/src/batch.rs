//! Transfer requests and batches: what a caller submits, the per-request completion state a
//! transport reports into, and the awaitable (or blocking) wait with timeout and cancellation.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};
use crate::memory::{Region, RegionLease};
use crate::segment::OpenSegment;

/// Direction of a transfer, numbered as in Mooncake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Opcode {
    /// Copy from the target segment into local memory (pull).
    Read = 0,
    /// Copy from local memory into the target segment (push).
    Write = 1,
}

/// Handle of an opened segment (see `TransferEngine::open_segment`). Stable for the engine's
/// lifetime, across descriptor refreshes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentHandle(pub u64);

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
    /// transport released its requests (see [`Batch::complete`]).
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

fn spin_before_sleep() -> Duration {
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

/// A submitted batch: the validated requests and their completion state.
///
/// Transports report into it with [`complete`](Batch::complete); callers poll
/// [`status`](Batch::status), await [`wait`](Batch::wait), block in
/// [`wait_blocking`](Batch::wait_blocking), or [`cancel`](Batch::cancel).
///
/// # Threading
/// Every method takes `&self` and may be called from any thread.
#[derive(Debug)]
pub struct Batch {
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
    done_lock: Mutex<bool>,
    done_cv: Condvar,
}

impl Batch {
    /// Builds a batch from validated requests; `leases` keep their local regions registered
    /// until every transport released its requests; `segments` are the targets it touches (used
    /// to mark a segment's cached descriptor stale when its peer fails).
    pub fn new(
        requests: Vec<ValidatedRequest>,
        leases: Vec<RegionLease>,
        segments: Vec<Arc<OpenSegment>>,
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
            done_lock: Mutex::new(n == 0),
            done_cv: Condvar::new(),
        })
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// True for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Request `i` (panics when `i` is out of range: transports only use indices they were given).
    pub fn request(&self, i: usize) -> &ValidatedRequest {
        &self.requests[i]
    }

    /// All requests.
    pub fn requests(&self) -> &[ValidatedRequest] {
        &self.requests
    }

    /// Total bytes of all requests.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// True once [`cancel`](Self::cancel) was called. Transports check it before starting a
    /// request.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// True while request `i` has no outcome yet.
    pub fn is_pending(&self, i: usize) -> bool {
        self.state[i].load(Ordering::Acquire) == PENDING
    }

    /// True once the transport released request `i` (called [`complete`](Self::complete) for
    /// it): it touches the request's memory no more. A cancelled request may have an outcome
    /// before it is released.
    pub fn is_released(&self, i: usize) -> bool {
        self.released_flags.get(i).is_some_and(|f| f.load(Ordering::Acquire))
    }

    /// True once every request was released (the batch's leases are dropped).
    pub fn all_released(&self) -> bool {
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
    pub fn complete(&self, i: usize, result: Result<()>) -> bool {
        // Release first: a waiter woken by the outcome may unregister the memory at once.
        let first_release = self.released_flags.get(i).is_some_and(|f| !f.swap(true, Ordering::AcqRel));
        if first_release && self.released.fetch_add(1, Ordering::AcqRel) + 1 == self.len() {
            self.leases.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
        self.set_outcome(i, result)
    }

    /// Records request `i`'s outcome **without** releasing it: the caller sees the outcome at
    /// once (for example a timeout), while the transport, which may still touch the request's
    /// memory, releases it later with [`complete`](Self::complete) (whose outcome is then
    /// ignored). Returns whether this call set the outcome.
    pub fn report_outcome(&self, i: usize, result: Result<()>) -> bool {
        self.set_outcome(i, result)
    }

    /// Records an outcome without releasing the request (cancellation does not stop a
    /// transport from touching memory it already started on).
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

    /// Fails every index in `indices` that is still pending with a copy of `error`.
    pub fn fail_all(&self, indices: &[u32], error: &Error) {
        for &i in indices {
            self.complete(i as usize, Err(error.duplicate()));
        }
    }

    fn finish(&self) {
        let _ = self.finished_at.set(Instant::now());
        self.notify.notify_waiters();
        let mut done = self.done_lock.lock().unwrap_or_else(|p| p.into_inner());
        *done = true;
        self.done_cv.notify_all();
    }

    /// Cancels every request that has not completed. Requests a transport already started may
    /// still move their bytes; their outcome is reported as cancelled all the same.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        for i in 0..self.len() {
            self.set_outcome(i, Err(Error::new(ErrorKind::Cancelled, "cancelled by the caller")));
        }
    }

    /// State of request `i`, or `None` when `i` is out of range.
    pub fn request_status(&self, i: usize) -> Option<RequestStatus> {
        let s = self.state.get(i)?.load(Ordering::Acquire);
        Some(match s {
            PENDING => RequestStatus::Pending,
            COMPLETED => RequestStatus::Completed,
            CANCELLED => RequestStatus::Cancelled,
            _ => RequestStatus::Failed(self.error(i).map(|e| e.kind()).unwrap_or(ErrorKind::Transport)),
        })
    }

    /// The error of request `i`, if it failed or was cancelled.
    pub fn error(&self, i: usize) -> Option<Error> {
        let errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        errors.iter().find(|(j, _)| *j == i).map(|(_, e)| e.duplicate())
    }

    /// All failures so far, as (request index, error), in completion order.
    pub fn errors(&self) -> Vec<(usize, Error)> {
        let errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        errors.iter().map(|(i, e)| (*i, e.duplicate())).collect()
    }

    /// Counts of request states.
    pub fn status(&self) -> BatchStatus {
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
    pub fn is_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    /// Time from submission to the last completion (or until now while pending).
    pub fn elapsed(&self) -> Duration {
        self.finished_at.get().copied().unwrap_or_else(Instant::now) - self.submitted_at
    }

    /// Waits until no request is pending, or `timeout` passes ([`ErrorKind::Timeout`]; the batch
    /// keeps running and can be waited on again or cancelled).
    pub async fn wait(&self, timeout: Duration) -> Result<BatchStatus> {
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
    pub async fn wait_ok(&self, timeout: Duration) -> Result<()> {
        let status = self.wait(timeout).await?;
        self.outcome(status)
    }

    /// Blocking form of [`wait`](Self::wait), for callers outside an async runtime. Needs no
    /// runtime itself.
    pub fn wait_blocking(&self, timeout: Duration) -> Result<BatchStatus> {
        if self.spin_until_done() {
            return Ok(self.status());
        }
        // A timeout too large to add to `now` means "no deadline".
        let deadline = Instant::now().checked_add(timeout);
        let mut done = self.done_lock.lock().unwrap_or_else(|p| p.into_inner());
        while !*done {
            done = match deadline {
                None => self.done_cv.wait(done).unwrap_or_else(|p| p.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(self.timeout_error(timeout));
                    }
                    self.done_cv.wait_timeout(done, deadline - now).unwrap_or_else(|p| p.into_inner()).0
                }
            };
        }
        Ok(self.status())
    }

    /// Blocking form of [`wait_ok`](Self::wait_ok).
    pub fn wait_ok_blocking(&self, timeout: Duration) -> Result<()> {
        let status = self.wait_blocking(timeout)?;
        self.outcome(status)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Location, MemoryRegistry};

    fn batch(n: usize) -> Arc<Batch> {
        let reg = MemoryRegistry::new();
        #[allow(unsafe_code)]
        // SAFETY: the address is never accessed: these batches are completed by hand.
        unsafe { reg.register(0, 1 << 20, Location::Any) }.unwrap();
        let lease = reg.lease(0, 8).unwrap();
        let reqs = (0..n)
            .map(|i| ValidatedRequest {
                request: TransferRequest {
                    opcode: Opcode::Read,
                    source: i as u64 * 8,
                    target: SegmentHandle(1),
                    target_offset: 0,
                    length: 8,
                },
                local: Region::clone(&lease),
            })
            .collect();
        Batch::new(reqs, vec![lease], Vec::new())
    }

    #[test]
    fn first_outcome_wins_and_counts_add_up() {
        let b = batch(3);
        assert!(b.complete(0, Ok(())));
        assert!(!b.complete(0, Err(Error::transport("late"))));
        assert!(b.complete(1, Err(Error::transport("boom"))));
        assert_eq!(b.status(), BatchStatus { total: 3, completed: 1, failed: 1, cancelled: 0, pending: 1 });
        assert_eq!(b.request_status(1), Some(RequestStatus::Failed(ErrorKind::Transport)));
        assert_eq!(b.request_status(3), None);
        assert!(!b.is_done());
        b.cancel();
        assert!(b.is_done());
        assert!(b.is_released(0) && b.is_released(1) && !b.is_released(2), "cancel is not a release");
        assert!(!b.all_released() && !b.is_released(9));
        b.complete(2, Ok(()));
        assert!(b.all_released());
        assert_eq!(b.request_status(2), Some(RequestStatus::Cancelled));
        let e = b.wait_ok_blocking(Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Transport);
        assert!(e.message().contains("request 1") && e.message().contains("2 of 3"), "{e}");
    }

    #[test]
    fn leases_are_dropped_once_every_transport_released_its_requests() {
        let reg = MemoryRegistry::new();
        #[allow(unsafe_code)]
        // SAFETY: never accessed.
        unsafe { reg.register(0, 64, Location::Any) }.unwrap();
        let lease = reg.lease(0, 8).unwrap();
        let req = |i: u64| ValidatedRequest {
            request: TransferRequest {
                opcode: Opcode::Read,
                source: i * 8,
                target: SegmentHandle(1),
                target_offset: 0,
                length: 8,
            },
            local: Region::clone(&lease),
        };
        let b = Batch::new(vec![req(0), req(1)], vec![lease], Vec::new());
        assert_eq!(reg.leases(), 1);
        b.cancel();
        assert!(b.is_done());
        assert_eq!(reg.leases(), 1, "cancelled, but a transport may still be writing");
        b.complete(0, Ok(()));
        assert_eq!(reg.leases(), 1);
        b.complete(0, Ok(()));
        assert_eq!(reg.leases(), 1, "a second completion of one index does not count");
        b.complete(1, Err(Error::new(ErrorKind::Cancelled, "seen")));
        assert_eq!(reg.leases(), 0, "released by every transport: memory may go");
        assert_eq!(b.status().cancelled, 2);
    }

    #[tokio::test]
    async fn wait_times_out_then_completes() {
        let b = batch(2);
        let e = b.wait(Duration::from_millis(20)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(e.message().contains("2 of 2"));
        let b2 = b.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b2.complete(0, Ok(()));
            b2.complete(1, Ok(()));
        });
        assert!(b.wait(Duration::from_secs(5)).await.unwrap().is_success());
        b.wait_ok(Duration::from_secs(1)).await.unwrap();
        t.join().unwrap();
    }

    #[test]
    fn blocking_wait_needs_no_runtime() {
        let b = batch(1);
        assert_eq!(b.wait_blocking(Duration::from_millis(10)).unwrap_err().kind(), ErrorKind::Timeout);
        assert!(!b.complete(7, Ok(())), "an index outside the batch is ignored, not a panic");
        let b2 = b.clone();
        let t = std::thread::spawn(move || b2.complete(0, Ok(())));
        b.wait_ok_blocking(Duration::MAX).unwrap();
        t.join().unwrap();
        assert!(b.elapsed() < Duration::from_secs(5));
    }
}
