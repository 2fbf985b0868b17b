//! Completion reports to the host (ABI 1.1): when the host offers a completion sink
//! (`set_completion_sink`), each batch is leased with a release observer
//! ([`Batch::lease_observed`]) that reports every request to the host the moment the
//! transport released it, so the host polls nothing.
//!
//! Reports of a batch are held back until `submit` stored the batch in the host's `*out` (a
//! synchronous transport releases its requests inside `submit`); a batch whose `submit` fails
//! is never reported. After `destroy` the sink is revoked: reports of requests released later
//! (a runtime shut down in the background drops its tasks, and their submissions, late) are
//! dropped, since the host's context is gone.

use std::ffi::{CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use ferry_abi::{FERRY_STATE_COMPLETED, FerryPluginBatch, FerryTransferStatus};
use ferry_core::{Batch, Error, ErrorKind};

/// The host's callback with its context.
#[derive(Clone, Copy)]
struct Sink {
    report: unsafe extern "C" fn(*mut c_void, *mut FerryPluginBatch, usize, *const FerryTransferStatus, *const c_char),
    ctx: *mut c_void,
}

// SAFETY: the ABI makes the completion callback callable from any thread with its `ctx`; the
// plugin never dereferences `ctx`, it only passes it back.
unsafe impl Send for Sink {}
// SAFETY: as above.
unsafe impl Sync for Sink {}

/// One instance's way to the host's completion callback: unset until the host offers it,
/// revoked at `destroy` (after [`revoke`](Self::revoke) returns, the callback is never called
/// again).
#[derive(Default)]
pub(crate) struct HostSink {
    sink: RwLock<Option<Sink>>,
    /// Set once the host offered a sink (it stays set after the revocation).
    offered: AtomicBool,
}

impl HostSink {
    /// Takes the host's offer. Refused when a sink was offered before, or `report` is null.
    pub(crate) fn accept(&self, report: ferry_abi::FerryCompletionFn, ctx: *mut c_void) -> Result<(), Error> {
        let report = report.ok_or_else(|| Error::invalid("`sink` is null"))?;
        if self.offered.swap(true, Ordering::AcqRel) {
            return Err(Error::new(ErrorKind::AlreadyExists, "a completion sink was set for this instance already"));
        }
        *self.sink.write().unwrap_or_else(|p| p.into_inner()) = Some(Sink { report, ctx });
        Ok(())
    }

    /// True while batches are to be reported (offered and not revoked).
    pub(crate) fn is_active(&self) -> bool {
        self.sink.read().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Calls the host's callback, unless revoked.
    fn report(&self, batch: usize, index: usize, status: &FerryTransferStatus, message: Option<&CString>) {
        let guard = self.sink.read().unwrap_or_else(|p| p.into_inner());
        let Some(sink) = *guard else { return };
        let message = message.map_or(std::ptr::null(), |m| m.as_ptr());
        // SAFETY: the host keeps its callback and context valid until the instance is destroyed,
        // which revokes the sink (under the write lock this read lock excludes) first; `status`
        // and `message` outlive the call; `batch` is the pointer `submit` stored in `*out`.
        unsafe { (sink.report)(sink.ctx, batch as *mut FerryPluginBatch, index, status, message) };
    }

    /// Stops using the host's callback (waits for reports in progress on other threads).
    pub(crate) fn revoke(&self) {
        *self.sink.write().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// The reports of one batch.
pub(crate) struct BatchReports {
    sink: Arc<HostSink>,
    /// The batch's pointer as the host knows it (`*out`), once published.
    batch: AtomicUsize,
    /// Requests released before the batch was published, reported at [`publish`](Self::publish);
    /// `None` once published.
    held: Mutex<Option<Vec<usize>>>,
}

impl BatchReports {
    /// Reports for a batch about to be submitted to the transport.
    pub(crate) fn new(sink: Arc<HostSink>) -> Arc<Self> {
        Arc::new(Self { sink, batch: AtomicUsize::new(0), held: Mutex::new(Some(Vec::new())) })
    }

    /// The release observer: request `i` of `batch` was released.
    pub(crate) fn released(&self, batch: &Batch, i: usize) {
        // A panic here would unwind into the transport that completed the request.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            if let Some(held) = self.held.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
                held.push(i);
                return;
            }
            self.send(batch, i);
        }));
    }

    /// The host knows the batch as `ptr` now: reports what was released so far, and from now
    /// on each request as it is released. Never called for a batch whose `submit` failed.
    pub(crate) fn publish(&self, ptr: *mut FerryPluginBatch, batch: &Batch) {
        self.batch.store(ptr as usize, Ordering::Release);
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or_default();
        for i in held {
            self.send(batch, i);
        }
    }

    fn send(&self, batch: &Batch, i: usize) {
        let status = crate::shim::status_of(batch, i);
        let message = (status.state != FERRY_STATE_COMPLETED)
            .then(|| batch.error(i))
            .flatten()
            .map(|e| CString::new(crate::shim::error_text(&e).replace('\0', "\\0")).unwrap_or_default());
        self.sink.report(self.batch.load(Ordering::Acquire), i, &status, message.as_ref());
    }
}
