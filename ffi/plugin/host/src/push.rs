//! Completions a plugin reports through the host's callback (ABI 1.1,
//! `FerryPluginApi::set_completion_sink`), for an instance no thread polls.
//!
//! Each instance has one [`CompletionSink`], the callback's context. It lives in the
//! transport's shared state, which is dropped only after the plugin's `destroy` returned, and
//! the plugin reports nothing after that: the context outlives every report. A batch stays in
//! the sink, holding its [`Submission`], until the plugin reported every request of it, even
//! after the host reported a timeout or a cancellation to its caller: a late report finds it
//! and releases the request's memory then. Reports the sink cannot match (an unknown batch, an
//! index outside the batch, a request reported twice, a pending state) are logged and ignored.
//!
//! The callback never calls into the plugin: freeing a finished batch is left to the host's own
//! code (the submitting thread when the batch finished inside `submit`, else the batch's
//! watchdog task).

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ferry_abi::{
    FERRY_STATE_CANCELLED, FERRY_STATE_COMPLETED, FERRY_STATE_FAILED, FERRY_STATE_PENDING, FerryPluginBatch,
    FerryTransferStatus,
};
use ferry_core::{Error, ErrorKind, OpenSegment, Submission};
use tokio::sync::Notify;

/// The error of a request the plugin reported failed with `code`, described by `message` when
/// the plugin gave one.
pub(crate) fn request_failure(protocol: &str, code: i32, message: Option<String>) -> Error {
    let kind = ErrorKind::from_code(code).unwrap_or(ErrorKind::Transport);
    let message = message.filter(|m| !m.is_empty()).unwrap_or_else(|| format!("request failed with code {code}"));
    Error::new(kind, format!("plugin `{protocol}`: {message}"))
}

/// A batch handed to a plugin that reports its completions.
pub(crate) struct Pushed {
    /// Where `submit` stores the plugin's batch pointer (its `out`): a report made inside
    /// `submit` is matched through it.
    pub(crate) slot: Arc<AtomicPtr<FerryPluginBatch>>,
    /// The requests the plugin has not reported yet (the others are completed).
    pub(crate) submission: Submission,
    /// The batch index of each request of the plugin batch, in the plugin's order.
    pub(crate) indices: Vec<u32>,
    /// Which requests of the plugin batch were reported.
    pub(crate) reported: Vec<bool>,
    /// Requests not reported yet.
    pub(crate) remaining: usize,
    /// Woken once the last request was reported.
    pub(crate) done: Arc<Notify>,
    /// Keeps the plugin target open while the batch is outstanding.
    pub(crate) _segment: Arc<OpenSegment>,
}

/// What became of a batch once `submit` returned.
pub(crate) enum Submitted {
    /// Every request was reported inside `submit`: free the plugin batch now.
    Finished,
    /// Requests are outstanding: the batch's watchdog takes over.
    Pending,
}

#[derive(Default)]
struct SinkState {
    next_id: u64,
    /// Batches not yet forgotten, by id.
    batches: HashMap<u64, Pushed>,
    /// Plugin batch pointer to id, once `submit` returned the pointer.
    by_batch: HashMap<usize, u64>,
    /// Ids of the batches whose `submit` is running.
    submitting: Vec<u64>,
}

impl SinkState {
    /// The id of the batch the plugin calls `batch`.
    fn find(&self, batch: usize) -> Option<u64> {
        if batch == 0 {
            return None;
        }
        self.by_batch.get(&batch).copied().or_else(|| {
            self.submitting
                .iter()
                .copied()
                .find(|id| self.batches.get(id).is_some_and(|p| p.slot.load(Ordering::Acquire) as usize == batch))
        })
    }
}

/// One instance's batches in flight, and the context of its completion callback.
pub(crate) struct CompletionSink {
    protocol: &'static str,
    state: Mutex<SinkState>,
}

impl CompletionSink {
    /// An empty sink for a plugin serving `protocol`.
    pub(crate) fn new(protocol: &'static str) -> Self {
        Self { protocol, state: Mutex::new(SinkState::default()) }
    }

    fn lock(&self) -> MutexGuard<'_, SinkState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The context handed to the plugin with [`host_complete`].
    pub(crate) fn as_ctx(&self) -> *mut c_void {
        (self as *const Self).cast_mut().cast()
    }

    /// Records a batch whose `submit` is about to run; returns its id.
    pub(crate) fn begin_submit(&self, pushed: Pushed) -> u64 {
        let mut state = self.lock();
        state.next_id += 1;
        let id = state.next_id;
        state.batches.insert(id, pushed);
        state.submitting.push(id);
        id
    }

    /// `submit` of batch `id` failed: forgets the batch and gives back the requests the plugin
    /// did not report (none, normally: a failed `submit` starts nothing), or `None` when it
    /// reported them all.
    pub(crate) fn submit_failed(&self, id: u64) -> Option<Submission> {
        let mut state = self.lock();
        state.submitting.retain(|&s| s != id);
        let pushed = state.batches.remove(&id)?;
        drop(state);
        let reported = pushed.reported.len() - pushed.remaining;
        if reported > 0 {
            tracing::error!(
                target: "ferry::plugin",
                plugin = self.protocol,
                reported,
                "the plugin reported requests of a batch whose submit failed; the others fail with the submit error"
            );
        }
        (pushed.remaining > 0).then_some(pushed.submission)
    }

    /// `submit` of batch `id` returned `batch`: from now on reports name it by that pointer.
    pub(crate) fn submitted(&self, id: u64, batch: *mut FerryPluginBatch) -> Submitted {
        let mut state = self.lock();
        state.submitting.retain(|&s| s != id);
        let finished = state.batches.get(&id).is_none_or(|p| p.remaining == 0);
        if finished {
            state.batches.remove(&id);
            return Submitted::Finished;
        }
        if let Some(other) = state.by_batch.insert(batch as usize, id) {
            tracing::error!(
                target: "ferry::plugin",
                plugin = self.protocol,
                batch = format_args!("{batch:p}"),
                "submit returned the pointer of a batch still in flight; reports for the earlier batch ({other}) can no longer be matched and its memory stays leased"
            );
        }
        Submitted::Pending
    }

    /// True once every request of batch `id` was reported (or the batch is forgotten).
    pub(crate) fn is_finished(&self, id: u64) -> bool {
        self.lock().batches.get(&id).is_none_or(|p| p.remaining == 0)
    }

    /// Waits until every request of batch `id` was reported; `done` is the batch's.
    pub(crate) async fn finished(&self, id: u64, done: &Notify) {
        // `notify_one` stores a permit when nobody waits yet, so a report between the check and
        // the wait is not missed.
        while !self.is_finished(id) {
            done.notified().await;
        }
    }

    /// Shows `error` to the caller for every request of batch `id` not reported yet, without
    /// releasing them (the plugin may still touch their memory).
    pub(crate) fn report_unfinished(&self, id: u64, error: &Error) {
        if let Some(pushed) = self.lock().batches.get(&id) {
            pushed.submission.report_all(error);
        }
    }

    /// Forgets finished batch `id`, named `batch` by the plugin; later reports naming it are
    /// refused as reports for an unknown batch. The caller then frees the plugin batch.
    pub(crate) fn forget(&self, id: u64, batch: *mut FerryPluginBatch) {
        let mut state = self.lock();
        state.batches.remove(&id);
        if state.by_batch.get(&(batch as usize)) == Some(&id) {
            state.by_batch.remove(&(batch as usize));
        }
    }

    /// Forgets every batch whose `submit` returned: the finished ones' plugin pointers (to free
    /// before `destroy`), and the unfinished ones (dropped after `destroy`, which stops the
    /// plugin from touching their memory).
    pub(crate) fn drain(&self) -> (Vec<*mut FerryPluginBatch>, Vec<Pushed>) {
        let mut state = self.lock();
        let by_batch = std::mem::take(&mut state.by_batch);
        let mut finished = Vec::new();
        let mut unfinished = Vec::new();
        for (batch, id) in by_batch {
            let Some(pushed) = state.batches.remove(&id) else { continue };
            if pushed.remaining == 0 {
                finished.push(batch as *mut FerryPluginBatch);
            } else {
                unfinished.push(pushed);
            }
        }
        (finished, unfinished)
    }

    /// A report from the plugin: request `index` of `batch` is finished with `status`.
    fn report(&self, batch: usize, index: usize, status: Option<FerryTransferStatus>, message: Option<String>) {
        let protocol = self.protocol;
        let mut state = self.lock();
        let Some(pushed) = state.find(batch).and_then(|id| state.batches.get_mut(&id)) else {
            tracing::error!(
                target: "ferry::plugin",
                plugin = protocol,
                batch = format_args!("{:#x}", batch),
                index,
                "the plugin reported a completion for a batch the host does not know (never submitted, already finished or freed); ignored"
            );
            return;
        };
        let len = pushed.reported.len();
        let bad = |what: &str| {
            tracing::error!(target: "ferry::plugin", plugin = protocol, index, len, "the plugin reported {what}; ignored");
        };
        if index >= len {
            return bad("a request index outside its batch");
        }
        if pushed.reported[index] {
            return bad("a request it had reported already (each request is reported exactly once)");
        }
        let Some(status) = status else { return bad("a completion with a null status") };
        let outcome = match status.state {
            FERRY_STATE_COMPLETED => Ok(()),
            FERRY_STATE_CANCELLED => {
                Err(Error::new(ErrorKind::Cancelled, message.filter(|m| !m.is_empty()).unwrap_or("cancelled".into())))
            }
            FERRY_STATE_FAILED => Err(request_failure(protocol, status.code, message)),
            FERRY_STATE_PENDING => return bad("a request as still pending (a report gives its final state)"),
            other => {
                // The plugin is done with the request, but its state means nothing here.
                bad("an unknown state; the request fails");
                Err(Error::new(
                    ErrorKind::Plugin,
                    format!("plugin `{protocol}`: reported unknown state {other} for request {index}"),
                ))
            }
        };
        pushed.reported[index] = true;
        pushed.remaining -= 1;
        pushed.submission.complete(pushed.indices[index], outcome);
        if pushed.remaining == 0 {
            pushed.done.notify_one();
        }
    }
}

/// The completion callback handed to plugins (`FerryCompletionFn`).
///
/// # Safety
/// `ctx` is the [`CompletionSink`] the host handed over with it, still alive (the ABI keeps it
/// valid until `destroy` returns); `status` is null or points to a status, and `message` is null
/// or a NUL-terminated string, both valid during the call.
pub(crate) unsafe extern "C" fn host_complete(
    ctx: *mut c_void,
    batch: *mut FerryPluginBatch,
    index: usize,
    status: *const FerryTransferStatus,
    message: *const c_char,
) {
    let result = std::panic::catch_unwind(|| {
        if ctx.is_null() {
            tracing::error!(target: "ferry::plugin", "a plugin reported a completion with a null context; ignored");
            return;
        }
        // SAFETY: `ctx` is the `CompletionSink` of the instance, which lives in the transport's
        // shared state until after the plugin's `destroy` returned; the plugin reports nothing
        // after that (ABI contract).
        let sink = unsafe { &*ctx.cast::<CompletionSink>() };
        let status = (!status.is_null()).then(|| {
            // SAFETY: a non-null `status` points to a `FerryTransferStatus` valid during the call
            // (ABI contract); read unaligned, since nothing promises its alignment.
            unsafe { status.read_unaligned() }
        });
        let message = (!message.is_null()).then(|| {
            // SAFETY: a non-null `message` is a NUL-terminated string valid during the call
            // (ABI contract).
            unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
        });
        sink.report(batch as usize, index, status, message);
    });
    // A panic must not unwind into the plugin; the report is lost (the batch then times out).
    drop(result);
}
