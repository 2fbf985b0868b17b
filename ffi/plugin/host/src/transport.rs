//! A loaded plugin used as a `ferry_core::Transport`.

use std::collections::VecDeque;
use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ferry_abi::{
    FERRY_CAP_CROSS_PROCESS, FERRY_CAP_DEVICE_MEMORY, FERRY_CAP_HOST_MEMORY, FERRY_CAP_NOTIFICATIONS, FERRY_CAP_READ,
    FERRY_CAP_WRITE, FERRY_LOG_DEBUG, FERRY_LOG_ERROR, FERRY_LOG_INFO, FERRY_LOG_WARN, FERRY_OK, FERRY_OPCODE_READ,
    FERRY_OPCODE_WRITE, FERRY_PLUGIN_ABI_MAJOR, FERRY_PLUGIN_ABI_MINOR, FERRY_STATE_CANCELLED, FERRY_STATE_COMPLETED,
    FERRY_STATE_FAILED, FERRY_STATE_PENDING, FerryHostServices, FerryPluginApi, FerryPluginBatch, FerryPluginInstance,
    FerryPluginTarget, FerryTransferRequest, FerryTransferStatus,
};
use ferry_core::{
    Batch, Capabilities, Error, ErrorKind, MemoryPromise, Opcode, OpenSegment, Region, Result, SegmentDescriptor,
    Submission, Transport, TransportContext, TransportFactory,
};
use tokio::sync::Notify;

use crate::loader::LoadedPlugin;
use crate::push::{CompletionSink, Pushed, Submitted, host_complete, request_failure};

/// Prefix of the name of the completion thread the host runs for each instance of a plugin it
/// polls (`ferry-poll-<protocol>`; the kernel keeps the first 15 bytes of a thread's name).
pub const POLL_THREAD_PREFIX: &str = "ferry-poll-";

/// Creates transports from a loaded plugin.
#[derive(Debug, Clone)]
pub struct PluginTransportFactory {
    plugin: Arc<LoadedPlugin>,
}

impl PluginTransportFactory {
    /// A factory for `plugin`.
    pub fn new(plugin: Arc<LoadedPlugin>) -> Self {
        Self { plugin }
    }

    /// The plugin behind it.
    pub fn plugin(&self) -> &Arc<LoadedPlugin> {
        &self.plugin
    }
}

/// Turns a plugin's status code into an error naming the plugin and the call.
fn status_error(plugin: &LoadedPlugin, call: &str, code: i32) -> Error {
    let kind = ErrorKind::from_code(code).unwrap_or(ErrorKind::Plugin);
    let what = if kind == ErrorKind::Internal { " (the plugin panicked or hit a bug)" } else { "" };
    Error::new(kind, format!("plugin `{}`: {call} failed with code {code}{what}", plugin.protocol()))
}

/// Host services handed to every instance: its log callback context names the plugin.
struct HostServicesBox {
    services: FerryHostServices,
    _protocol: Box<CString>,
}

// SAFETY: the box is immutable after creation; its `ctx` points at the `CString` it owns, which
// the log callback only reads, from any thread (the ABI allows that).
unsafe impl Send for HostServicesBox {}
// SAFETY: as above.
unsafe impl Sync for HostServicesBox {}

unsafe extern "C" fn host_log(ctx: *mut c_void, level: u32, message: *const c_char) {
    let result = std::panic::catch_unwind(|| {
        if message.is_null() {
            return;
        }
        // SAFETY: `ctx` is the `CString` this host created for the instance (see
        // `HostServicesBox`), alive as long as the instance; `message` is a NUL-terminated string
        // valid for the call, per the ABI.
        let (plugin, message) = unsafe {
            let plugin =
                if ctx.is_null() { "?".into() } else { CStr::from_ptr(ctx as *const c_char).to_string_lossy() };
            (plugin, CStr::from_ptr(message).to_string_lossy())
        };
        match level {
            FERRY_LOG_ERROR => tracing::error!(target: "ferry::plugin", plugin = %plugin, "{message}"),
            FERRY_LOG_WARN => tracing::warn!(target: "ferry::plugin", plugin = %plugin, "{message}"),
            FERRY_LOG_INFO => tracing::info!(target: "ferry::plugin", plugin = %plugin, "{message}"),
            FERRY_LOG_DEBUG => tracing::debug!(target: "ferry::plugin", plugin = %plugin, "{message}"),
            _ => tracing::trace!(target: "ferry::plugin", plugin = %plugin, "{message}"),
        }
    });
    // A panic must not unwind into the plugin; logging is best effort.
    drop(result);
}

#[async_trait]
impl TransportFactory for PluginTransportFactory {
    fn protocol(&self) -> &'static str {
        self.plugin.protocol()
    }

    async fn create(&self, ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
        let api = *self.plugin.api();
        let config = serde_json::to_string(&*ctx.config)
            .map_err(|e| Error::config("the engine's config cannot be serialised for a plugin").with_source(e))?;
        let config = CString::new(config).map_err(|_| Error::config("the engine's config contains a NUL byte"))?;
        let name = CString::new(ctx.segment_name.clone())
            .map_err(|_| Error::invalid("the segment name contains a NUL byte"))?;
        let protocol = Box::new(CString::new(self.plugin.protocol()).unwrap_or_default());
        let host = Box::new(HostServicesBox {
            services: FerryHostServices {
                struct_size: std::mem::size_of::<FerryHostServices>() as u64,
                abi_major: FERRY_PLUGIN_ABI_MAJOR,
                abi_minor: FERRY_PLUGIN_ABI_MINOR,
                ctx: protocol.as_ptr() as *mut c_void,
                log: Some(host_log),
            },
            _protocol: protocol,
        });
        let create = api.create.ok_or_else(|| status_error(&self.plugin, "create", ferry_abi::FERRY_E_PLUGIN))?;
        let mut instance: *mut FerryPluginInstance = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; `host` lives in the transport's shared
        // state until after `destroy`, as the ABI requires.
        let code = unsafe { create(&host.services, name.as_ptr(), config.as_ptr(), &mut instance) };
        if code != FERRY_OK {
            return Err(status_error(&self.plugin, "create", code));
        }
        if instance.is_null() {
            return Err(Error::new(
                ErrorKind::Plugin,
                format!("plugin `{}`: create reported success but returned no instance", self.plugin.protocol()),
            ));
        }
        let mut shared = Shared {
            plugin: self.plugin.clone(),
            api,
            instance: InstancePtr(instance),
            _host: host,
            targets: Mutex::new(Vec::new()),
            queue: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            pushes: false,
            sink: Box::new(CompletionSink::new(self.plugin.protocol())),
            runtime: ctx.runtime.clone(),
            stopping: AtomicBool::new(false),
            timeout: ctx.config.transfer_timeout(),
        };
        // ABI 1.1: offer the completion sink; a plugin that takes it is not polled.
        if let Some(offer) = api.set_completion_sink {
            // SAFETY: a live instance, right after `create` and before any other call on it;
            // the sink's context is boxed in `shared`, which is dropped only after `destroy`.
            let code = unsafe { offer(instance, Some(host_complete), shared.sink.as_ctx()) };
            if code == FERRY_OK {
                shared.pushes = true;
            } else {
                tracing::info!(
                    plugin = self.plugin.protocol(),
                    code,
                    "the plugin declined the completion callback; its batches are polled"
                );
            }
        }
        let shared = Arc::new(shared);
        if !shared.pushes {
            let poller = shared.clone();
            std::thread::Builder::new()
                .name(format!("{POLL_THREAD_PREFIX}{}", self.plugin.protocol()))
                .spawn(move || poller.poll_loop())
                .map_err(|e| {
                    Error::new(ErrorKind::Plugin, "cannot start the plugin's completion thread").with_source(e)
                })?;
        }
        Ok(Arc::new(PluginTransport { shared }))
    }
}

#[derive(Debug, Clone, Copy)]
struct InstancePtr(*mut FerryPluginInstance);
#[derive(Debug, Clone, Copy)]
struct TargetPtr(*mut FerryPluginTarget);
#[derive(Debug, Clone, Copy)]
struct BatchPtr(*mut FerryPluginBatch);
// SAFETY: the ABI makes instances, targets and batches usable from any thread; these wrappers
// only carry the opaque pointers between threads.
unsafe impl Send for InstancePtr {}
// SAFETY: as above.
unsafe impl Sync for InstancePtr {}
// SAFETY: as above.
unsafe impl Send for TargetPtr {}
// SAFETY: as above.
unsafe impl Send for BatchPtr {}

/// A submitted batch whose requests are not all finished.
struct Outstanding {
    pbatch: BatchPtr,
    /// The requests, in the plugin batch's order; taken (and completed) once the plugin reports
    /// none pending. An `Outstanding` is never dropped before: the completion thread exits only
    /// when its queue is empty.
    submission: Option<Submission>,
    /// Keeps the plugin target open while the batch is outstanding (targets are closed once
    /// their segment is gone).
    _segment: Arc<OpenSegment>,
    deadline: Instant,
    /// The plugin was asked to cancel the batch.
    cancel_sent: bool,
}

struct Shared {
    plugin: Arc<LoadedPlugin>,
    api: FerryPluginApi,
    instance: InstancePtr,
    _host: Box<HostServicesBox>,
    /// Plugin targets by the host segment they were opened for.
    targets: Mutex<Vec<(Weak<OpenSegment>, TargetPtr)>>,
    /// Batches the completion thread polls (a polled instance's).
    queue: Mutex<VecDeque<Outstanding>>,
    wake: Condvar,
    /// The plugin accepted the completion sink: it reports its batches' completions to `sink`,
    /// and no thread polls it.
    pushes: bool,
    /// The completion callback's context and the batches it reports on. Boxed (its address is
    /// the plugin's `ctx`) and dropped after `destroy` returned.
    sink: Box<CompletionSink>,
    /// The engine's runtime, where a reported batch's watchdog runs.
    runtime: tokio::runtime::Handle,
    stopping: AtomicBool,
    timeout: Duration,
}

impl Shared {
    fn protocol(&self) -> &'static str {
        self.plugin.protocol()
    }

    /// The plugin target for `segment`, opened on first use. Targets of segments the engine
    /// dropped are closed when a new target is opened (and at destroy).
    fn target_for(&self, segment: &Arc<OpenSegment>) -> Result<TargetPtr> {
        let mut targets = self.targets.lock().unwrap_or_else(|p| p.into_inner());
        // A held `Weak` keeps its allocation, so an address match is this very segment.
        if let Some((_, t)) = targets.iter().find(|(w, _)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(segment))) {
            return Ok(*t);
        }
        // A miss: close the targets of segments the engine forgot before opening a new one
        // (kept off the per-batch path).
        let close = self.api.close_target;
        targets.retain(|(weak, t)| {
            if weak.strong_count() > 0 {
                return true;
            }
            if let Some(close) = close {
                // SAFETY: the target came from this instance's `open_target`; its segment is gone,
                // so no batch for it is outstanding (a batch holds its segments).
                unsafe { close(self.instance.0, t.0) };
            }
            false
        });
        let json = CString::new(segment.descriptor().to_json())
            .map_err(|_| Error::invalid(format!("segment `{}`: descriptor contains a NUL byte", segment.name())))?;
        let open =
            self.api.open_target.ok_or_else(|| status_error(&self.plugin, "open_target", ferry_abi::FERRY_E_PLUGIN))?;
        let mut target: *mut FerryPluginTarget = std::ptr::null_mut();
        // SAFETY: valid instance, NUL-terminated descriptor, valid out-pointer.
        let code = unsafe { open(self.instance.0, json.as_ptr(), &mut target) };
        if code != FERRY_OK {
            return Err(status_error(&self.plugin, &format!("open_target(`{}`)", segment.name()), code));
        }
        targets.push((Arc::downgrade(segment), TargetPtr(target)));
        Ok(TargetPtr(target))
    }

    /// Polls `out` once. When the plugin reports nothing pending, reports every request to the
    /// batch (releasing it), frees the plugin batch and returns true. A request the plugin still
    /// reports pending is never released: its memory may still be touched.
    fn poll_once(&self, out: &mut Outstanding, statuses: &mut Vec<FerryTransferStatus>) -> bool {
        let Some(held) = out.submission.as_ref() else { return true };
        statuses.clear();
        statuses.resize(held.len(), FerryTransferStatus::default());
        let Some(poll) = self.api.poll else { return false };
        // SAFETY: a live batch of this instance, and a status array of the batch's length.
        let pending = unsafe { poll(self.instance.0, out.pbatch.0, statuses.as_mut_ptr(), statuses.len()) };
        if pending < 0 {
            // The plugin cannot say what it is doing: fail the requests for the caller now, ask
            // the plugin to stop, and keep the memory until it reports the batch finished.
            let e = status_error(&self.plugin, "poll", pending);
            held.report_all(&e);
            self.cancel_once(out);
            return false;
        }
        if pending > 0 || statuses.iter().any(|st| st.state == FERRY_STATE_PENDING) {
            return false;
        }
        self.finish(out, statuses);
        true
    }

    /// Asks the plugin (once) to stop the batch.
    fn cancel_once(&self, out: &mut Outstanding) {
        if out.cancel_sent {
            return;
        }
        out.cancel_sent = true;
        if let Some(cancel) = self.api.cancel {
            // SAFETY: a live batch of this instance. The plugin keeps reporting a request
            // pending until it touches its memory no more (ABI contract).
            unsafe { cancel(self.instance.0, out.pbatch.0) };
        }
    }

    /// Asks the plugin to stop a batch that reports its completions.
    fn cancel_pushed(&self, pbatch: BatchPtr) {
        if let Some(cancel) = self.api.cancel {
            // SAFETY: a live batch of this instance: its watchdog, the caller, frees it only
            // after this call returned.
            unsafe { cancel(self.instance.0, pbatch.0) };
        }
    }

    /// Frees a plugin batch every request of which was reported (or polled finished).
    fn free_plugin_batch(&self, pbatch: BatchPtr) {
        if let Some(free) = self.api.free_batch {
            // SAFETY: a batch of this instance with nothing pending, freed once: the sink forgot
            // it, so no other path frees it.
            unsafe { free(self.instance.0, pbatch.0) };
        }
    }

    /// The watchdog of a batch that reports its completions, a task on the engine's runtime (no
    /// thread): waits for the plugin's reports. When the caller cancels the batch, or its
    /// deadline passes, first, it asks the plugin (once) to stop, after showing the caller the
    /// timeout at once; then it waits, without a deadline, until the plugin reported every
    /// request (their memory stays leased until then). Last, it frees the plugin batch.
    ///
    /// `deadline` is `None` when the transfer timeout is too large to add to the current time.
    async fn watch(
        self: Arc<Self>,
        id: u64,
        pbatch: BatchPtr,
        batch: Batch,
        done: Arc<Notify>,
        deadline: Option<Instant>,
    ) {
        let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now()));
        let timed_out = tokio::select! {
            () = self.sink.finished(id, &done) => false,
            // Returns early only when every outcome of the batch is known: the caller cancelled
            // it (outcomes shown, requests not released), or the plugin finished.
            waited = batch.wait(left) => waited.is_err(),
        };
        if !self.sink.is_finished(id) {
            if timed_out {
                let e = Error::timeout(format!(
                    "plugin `{}`: requests not finished within {:?}",
                    self.protocol(),
                    self.timeout
                ));
                self.sink.report_unfinished(id, &e);
            }
            self.cancel_pushed(pbatch);
            self.sink.finished(id, &done).await;
        }
        self.sink.forget(id, pbatch.0);
        self.free_plugin_batch(pbatch);
    }

    /// Reports each request's outcome (releasing it) and frees the plugin batch. Only called
    /// once the plugin reported no request pending. An outcome recorded earlier (a timeout,
    /// the caller's cancel) stays; `complete` only releases then.
    fn finish(&self, out: &mut Outstanding, statuses: &[FerryTransferStatus]) {
        let Some(mut held) = out.submission.take() else { return };
        for (k, i) in held.indices().to_vec().into_iter().enumerate() {
            let st = statuses.get(k).copied().unwrap_or_default();
            let result = match st.state {
                FERRY_STATE_COMPLETED => Ok(()),
                FERRY_STATE_CANCELLED => Err(Error::new(ErrorKind::Cancelled, "cancelled")),
                FERRY_STATE_FAILED => Err(self.request_error(out, k, st.code)),
                other => Err(Error::new(
                    ErrorKind::Plugin,
                    format!("plugin `{}`: poll reported unknown state {other} for request {k}", self.protocol()),
                )),
            };
            held.complete(i, result);
        }
        if let Some(free) = self.api.free_batch {
            // SAFETY: nothing of the batch is pending; it is freed once.
            unsafe { free(self.instance.0, out.pbatch.0) };
        }
    }

    fn request_error(&self, out: &Outstanding, k: usize, code: i32) -> Error {
        let mut message = None;
        if let Some(describe) = self.api.batch_error {
            let mut buf = vec![0u8; 512];
            // SAFETY: a live batch of this instance; `buf` has `buf.len()` writable bytes.
            let n = unsafe { describe(self.instance.0, out.pbatch.0, k, buf.as_mut_ptr().cast(), buf.len()) };
            if n > 0 {
                let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
                message = Some(String::from_utf8_lossy(&buf[..end]).into_owned());
            }
        }
        request_failure(self.protocol(), code, message)
    }

    /// The completion thread: polls outstanding batches, asks the plugin to cancel those the
    /// caller cancelled or that passed their deadline (the caller sees the timeout at once; the
    /// memory is released only when the plugin lets go of it), and exits once the transport is
    /// gone and nothing is left.
    fn poll_loop(self: Arc<Self>) {
        let mut statuses = Vec::new();
        let mut idle_polls = 0u32;
        loop {
            let current: Vec<Outstanding> = {
                let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                while q.is_empty() {
                    if self.stopping.load(Ordering::Acquire) {
                        return;
                    }
                    idle_polls = 0;
                    q = self.wake.wait_timeout(q, Duration::from_millis(100)).unwrap_or_else(|p| p.into_inner()).0;
                }
                q.drain(..).collect()
            };
            let mut still = Vec::new();
            let mut progressed = false;
            for mut out in current {
                if out.submission.as_ref().is_some_and(Submission::is_cancelled) {
                    self.cancel_once(&mut out);
                } else if !out.cancel_sent && Instant::now() >= out.deadline {
                    let e = Error::timeout(format!(
                        "plugin `{}`: requests not finished within {:?}",
                        self.protocol(),
                        self.timeout
                    ));
                    if let Some(held) = &out.submission {
                        held.report_all(&e);
                    }
                    self.cancel_once(&mut out);
                }
                if self.poll_once(&mut out, &mut statuses) {
                    progressed = true;
                } else {
                    still.push(out);
                }
            }
            if !still.is_empty() {
                self.queue.lock().unwrap_or_else(|p| p.into_inner()).extend(still);
            }
            // Poll eagerly for a little while after progress, then back off to 1 ms.
            idle_polls = if progressed { 0 } else { idle_polls.saturating_add(1) };
            if idle_polls > 64 {
                let backoff = 50u64 << ((idle_polls - 64) / 16).min(5);
                std::thread::sleep(Duration::from_micros(backoff.min(1000)));
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The last reference: the transport is gone and the completion thread (or every
        // watchdog) has exited, so no call on the instance can follow. Batches left in the sink
        // had their watchdog dropped with the engine's runtime: the finished ones are freed
        // now, the others when `destroy` has stopped the plugin from touching their memory.
        let (finished, unfinished) = self.sink.drain();
        for pbatch in finished {
            self.free_plugin_batch(BatchPtr(pbatch));
        }
        let targets = std::mem::take(self.targets.get_mut().unwrap_or_else(|p| p.into_inner()));
        for (_, t) in targets {
            if let Some(close) = self.api.close_target {
                // SAFETY: a target of this instance, closed once, with no batch outstanding.
                unsafe { close(self.instance.0, t.0) };
            }
        }
        if let Some(destroy) = self.api.destroy {
            // SAFETY: the instance is destroyed once, after every other call on it.
            unsafe { destroy(self.instance.0) };
        }
        // Completed as lost (and released) only now.
        drop(unfinished);
    }
}

/// A transport implemented by a plugin library.
pub struct PluginTransport {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for PluginTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginTransport").field("protocol", &self.shared.protocol()).finish_non_exhaustive()
    }
}

impl PluginTransport {
    /// True when the plugin reports its completions through the host's callback (ABI 1.1): no
    /// thread polls it. False for a plugin that is polled (built against ABI 1.0, or one that
    /// declined the callback).
    pub fn pushes_completions(&self) -> bool {
        self.shared.pushes
    }

    /// Hands `submission` to the plugin; on an error the plugin has not taken it and it comes
    /// back with the error.
    fn try_submit(
        &self,
        target: &Arc<OpenSegment>,
        submission: Submission,
    ) -> std::result::Result<(), Box<(Error, Submission)>> {
        let shared = &self.shared;
        if shared.stopping.load(Ordering::Acquire) {
            let e = Error::new(ErrorKind::Shutdown, format!("plugin `{}` transport is shut down", shared.protocol()));
            return Err(Box::new((e, submission)));
        }
        let Some(submission) = submission.unless_cancelled("the plugin saw it") else { return Ok(()) };
        let ptarget = match shared.target_for(target) {
            Ok(t) => t,
            Err(e) => return Err(Box::new((e, submission))),
        };
        let requests: Vec<FerryTransferRequest> = submission
            .requests()
            .map(|(_, v)| {
                let r = &v.request;
                FerryTransferRequest {
                    opcode: match r.opcode {
                        Opcode::Read => FERRY_OPCODE_READ,
                        Opcode::Write => FERRY_OPCODE_WRITE,
                    },
                    flags: 0,
                    target: r.target.raw(),
                    local_addr: r.source,
                    remote_addr: r.target_offset,
                    length: r.length,
                }
            })
            .collect();
        let Some(submit) = shared.api.submit else {
            return Err(Box::new((status_error(&shared.plugin, "submit", ferry_abi::FERRY_E_PLUGIN), submission)));
        };
        if shared.pushes {
            return self.submit_pushed(submit, target, ptarget, &requests, submission);
        }
        let mut pbatch: *mut FerryPluginBatch = std::ptr::null_mut();
        // SAFETY: valid instance and target; `requests` holds `len` requests the engine checked
        // against registered memory (local) and the target's descriptor (remote).
        let code = unsafe { submit(shared.instance.0, ptarget.0, requests.as_ptr(), requests.len(), &mut pbatch) };
        if code != FERRY_OK {
            return Err(Box::new((status_error(&shared.plugin, "submit", code), submission)));
        }
        if pbatch.is_null() {
            let e = Error::new(
                ErrorKind::Plugin,
                format!("plugin `{}`: submit reported success but returned no batch", shared.protocol()),
            );
            return Err(Box::new((e, submission)));
        }
        let n = submission.len();
        let mut out = Outstanding {
            pbatch: BatchPtr(pbatch),
            submission: Some(submission),
            _segment: target.clone(),
            deadline: Instant::now() + shared.timeout,
            cancel_sent: false,
        };
        // A synchronous plugin is done already: finish here, without a thread hop.
        let mut statuses = Vec::with_capacity(n);
        if !shared.poll_once(&mut out, &mut statuses) {
            shared.queue.lock().unwrap_or_else(|p| p.into_inner()).push_back(out);
            shared.wake.notify_one();
        }
        Ok(())
    }
}

/// The plugin's `submit` function.
type SubmitFn = unsafe extern "C" fn(
    *mut FerryPluginInstance,
    *mut FerryPluginTarget,
    *const FerryTransferRequest,
    usize,
    *mut *mut FerryPluginBatch,
) -> i32;

impl PluginTransport {
    /// `try_submit` for a plugin that reports its completions: the batch is recorded in the
    /// sink before `submit` runs (a report may come from inside it); a batch finished by the
    /// time `submit` returned is freed at once, any other gets a watchdog task.
    fn submit_pushed(
        &self,
        submit: SubmitFn,
        target: &Arc<OpenSegment>,
        ptarget: TargetPtr,
        requests: &[FerryTransferRequest],
        submission: Submission,
    ) -> std::result::Result<(), Box<(Error, Submission)>> {
        let shared = &self.shared;
        let n = submission.len();
        let batch = submission.batch();
        let slot = Arc::new(AtomicPtr::new(std::ptr::null_mut()));
        let done = Arc::new(Notify::new());
        let id = shared.sink.begin_submit(Pushed {
            slot: slot.clone(),
            indices: submission.indices().to_vec(),
            submission,
            reported: vec![false; n],
            remaining: n,
            done: done.clone(),
            _segment: target.clone(),
        });
        // SAFETY: valid instance and target; `requests` holds `len` requests the engine checked
        // against registered memory (local) and the target's descriptor (remote); `slot` (the
        // `out` pointer) is a live `AtomicPtr`, which has the layout of a pointer.
        let code = unsafe { submit(shared.instance.0, ptarget.0, requests.as_ptr(), requests.len(), slot.as_ptr()) };
        let pbatch = slot.load(Ordering::Acquire);
        if code != FERRY_OK || pbatch.is_null() {
            let e = if code != FERRY_OK {
                status_error(&shared.plugin, "submit", code)
            } else {
                Error::new(
                    ErrorKind::Plugin,
                    format!("plugin `{}`: submit reported success but returned no batch", shared.protocol()),
                )
            };
            return match shared.sink.submit_failed(id) {
                Some(submission) => Err(Box::new((e, submission))),
                None => Ok(()),
            };
        }
        match shared.sink.submitted(id, pbatch) {
            // A synchronous plugin is done already: nothing waits, no task is spawned.
            Submitted::Finished => shared.free_plugin_batch(BatchPtr(pbatch)),
            Submitted::Pending => {
                let deadline = Instant::now().checked_add(shared.timeout);
                shared.runtime.spawn(shared.clone().watch(id, BatchPtr(pbatch), batch, done, deadline));
            }
        }
        Ok(())
    }
}

impl Drop for PluginTransport {
    fn drop(&mut self) {
        // The completion thread (or, for a plugin that reports, each batch's watchdog) finishes
        // what is left, and the last of them drops the last reference.
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.wake.notify_all();
    }
}

unsafe extern "C" fn collect_field(ctx: *mut c_void, key: *const c_char, value: *const c_char) {
    let _ = std::panic::catch_unwind(|| {
        if ctx.is_null() || key.is_null() || value.is_null() {
            return;
        }
        // SAFETY: `ctx` is the `Vec` passed by `PluginTransport::publish` for the duration of the
        // call; `key` and `value` are NUL-terminated strings valid during this callback.
        let (fields, key, value) =
            unsafe { (&mut *(ctx as *mut Vec<(String, String)>), CStr::from_ptr(key), CStr::from_ptr(value)) };
        fields.push((key.to_string_lossy().into_owned(), value.to_string_lossy().into_owned()));
    });
}

/// Fields a plugin may not set in its engine's descriptor.
const RESERVED_FIELDS: &[&str] = &["name", "protocol", "buffers", "ferry_instance", "timestamp"];

#[async_trait]
impl Transport for PluginTransport {
    fn protocol(&self) -> &str {
        self.shared.protocol()
    }

    fn capabilities(&self) -> Capabilities {
        let c = self.shared.api.capabilities;
        Capabilities {
            read: c & FERRY_CAP_READ != 0,
            write: c & FERRY_CAP_WRITE != 0,
            notifications: c & FERRY_CAP_NOTIFICATIONS != 0,
            host_memory: c & FERRY_CAP_HOST_MEMORY != 0,
            device_memory: c & FERRY_CAP_DEVICE_MEMORY != 0,
            cross_process: c & FERRY_CAP_CROSS_PROCESS != 0,
        }
    }

    fn serves(&self, target: &SegmentDescriptor) -> bool {
        target.protocol.eq_ignore_ascii_case(self.protocol())
    }

    fn publish(&self, descriptor: &mut SegmentDescriptor) {
        let Some(publish) = self.shared.api.publish else { return };
        let Ok(json) = CString::new(descriptor.to_json()) else { return };
        let mut fields: Vec<(String, String)> = Vec::new();
        // SAFETY: valid instance and descriptor string; `fields` outlives the call, and
        // `collect_field` is the only user of the context pointer.
        let code = unsafe {
            publish(self.shared.instance.0, json.as_ptr(), Some(collect_field), (&mut fields as *mut Vec<_>).cast())
        };
        if code != FERRY_OK {
            tracing::warn!(plugin = self.protocol(), code, "plugin publish failed; its fields are not published");
            return;
        }
        let Ok(serde_json::Value::Object(mut object)) = serde_json::to_value(&*descriptor) else { return };
        for (key, value) in fields {
            if RESERVED_FIELDS.contains(&key.as_str()) {
                tracing::warn!(plugin = self.protocol(), field = %key, "plugin tried to overwrite a reserved descriptor field; ignored");
                continue;
            }
            match serde_json::from_str::<serde_json::Value>(&value) {
                Ok(v) => {
                    object.insert(key, v);
                }
                Err(e) => {
                    tracing::warn!(plugin = self.protocol(), field = %key, error = %e, "plugin published a field that is not JSON; ignored")
                }
            }
        }
        let bytes = serde_json::to_vec(&object).unwrap_or_default();
        match SegmentDescriptor::from_json("plugin publish", &bytes) {
            Ok(d) => *descriptor = d,
            Err(e) => {
                tracing::warn!(plugin = self.protocol(), error = %e, "plugin fields make the descriptor invalid; ignored")
            }
        }
    }

    async fn register_memory(&self, region: &Region, _promise: MemoryPromise) -> Result<()> {
        let Some(register) = self.shared.api.register_memory else { return Ok(()) };
        let location = CString::new(region.location().to_string()).unwrap_or_default();
        // SAFETY: valid instance and string; the region stays registered (and valid) until the
        // matching `unregister_memory` (the `MemoryPromise` this call came with), which is what
        // the plugin is told.
        let code = unsafe { register(self.shared.instance.0, region.addr(), region.len(), location.as_ptr()) };
        if code != FERRY_OK {
            return Err(status_error(&self.shared.plugin, "register_memory", code));
        }
        Ok(())
    }

    async fn unregister_memory(&self, region: &Region) -> Result<()> {
        let Some(unregister) = self.shared.api.unregister_memory else { return Ok(()) };
        // SAFETY: valid instance; plain integers.
        let code = unsafe { unregister(self.shared.instance.0, region.addr(), region.len()) };
        if code != FERRY_OK {
            return Err(status_error(&self.shared.plugin, "unregister_memory", code));
        }
        Ok(())
    }

    fn submit(&self, target: &Arc<OpenSegment>, submission: Submission) {
        if let Err(e) = self.try_submit(target, submission) {
            // `try_submit` gives the submission back only when the plugin did not take it.
            let (e, submission) = *e;
            submission.fail_all(&e);
        }
    }

    async fn shutdown(&self) {
        if let Some(shutdown) = self.shared.api.shutdown {
            // SAFETY: valid instance; called once here (the engine shuts a transport down once).
            unsafe { shutdown(self.shared.instance.0) };
        }
    }
}
