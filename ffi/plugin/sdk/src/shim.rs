//! The `extern "C"` functions of a plugin's table, around a Rust [`Transport`].
//!
//! Every shim runs its body under `catch_unwind` (a panic answers `FERRY_E_INTERNAL` and is
//! logged through the host), checks each pointer and string it uses, and reports an error's
//! message through the host's log callback, since only its code crosses the boundary.

use std::cell::Cell;
use std::ffi::{CStr, CString, c_char, c_void};
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use ferry_abi::{
    FERRY_E_CANCELLED, FERRY_E_INTERNAL, FERRY_LOG_ERROR, FERRY_LOG_INFO, FERRY_LOG_WARN, FERRY_OK, FERRY_OPCODE_READ,
    FERRY_OPCODE_WRITE, FERRY_STATE_CANCELLED, FERRY_STATE_COMPLETED, FERRY_STATE_FAILED, FERRY_STATE_PENDING,
    FerryCompletionFn, FerryHostServices, FerryPluginBatch, FerryPluginInstance, FerryPluginTarget, FerryPublishFn,
    FerryTransferRequest, FerryTransferStatus,
};
use ferry_core::{
    Batch, Config, Error, ErrorKind, Location, MemoryPromise, MemoryRegistry, Opcode, OpenSegment, Region,
    RequestStatus, ResolverChain, SegmentDescriptor, SegmentHandle, TransferRequest, Transport, TransportContext,
};
use serde_json::{Map, Value};

use crate::PluginDefinition;
use crate::completion::{BatchReports, HostSink};
use crate::log::{self, HostLog};

type Result<T, E = Error> = std::result::Result<T, E>;

const INSTANCE_MAGIC: u64 = u64::from_be_bytes(*b"FRYinst1");
const TARGET_MAGIC: u64 = u64::from_be_bytes(*b"FRYtgt01");
const BATCH_MAGIC: u64 = u64::from_be_bytes(*b"FRYbatch");

/// A tokio runtime that is never dropped the blocking way: dropping a `Runtime` inside an async
/// context panics, and a host may destroy an instance from one.
struct OwnedRuntime(Option<tokio::runtime::Runtime>);

impl OwnedRuntime {
    fn get(&self) -> &tokio::runtime::Runtime {
        self.0.as_ref().expect("the runtime lives until the instance is dropped")
    }
}

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

thread_local! {
    /// Id of the instance runtime this thread is a worker of (0: none).
    static RUNTIME_ID: Cell<u64> = const { Cell::new(0) };
}

/// One plugin instance: what `create` returns as `FerryPluginInstance *`.
pub(crate) struct Instance {
    magic: u64,
    protocol: &'static str,
    segment_name: String,
    host: Arc<HostLog>,
    /// The host's completion callback, when it offered one (ABI 1.1).
    completions: Arc<HostSink>,
    transport: Arc<dyn Transport>,
    /// The plugin-side mirror of the host's registrations.
    memory: Arc<MemoryRegistry>,
    config: Arc<Config>,
    shut_down: AtomicBool,
    runtime_id: u64,
    /// Declared last: dropped after the transport.
    runtime: OwnedRuntime,
}

impl Instance {
    /// Runs `fut` on this instance's runtime and blocks the calling thread until it finished.
    /// A panic inside `fut` is resumed on the calling thread (where the shim catches it).
    fn block_on<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> Result<T> {
        block_on(self.runtime.get(), self.runtime_id, fut)
    }

    /// Stops the transport (once): no new registrations or leases, then `Transport::shutdown`.
    fn stop(&self) {
        if self.shut_down.swap(true, Ordering::AcqRel) {
            return;
        }
        self.memory.close();
        let transport = self.transport.clone();
        if let Err(e) = self.block_on(async move { transport.shutdown().await }) {
            self.host.log(FERRY_LOG_WARN, &format!("plugin `{}`: shutdown: {e}", self.protocol));
        }
        // A peer engine's transport may be copying into this instance's memory under a lease on
        // this (plugin-side) registry: the host frees the memory once shutdown returns.
        if !wait_until(self.config.transfer_timeout(), || self.memory.leases() == 0) {
            self.host.log(
                FERRY_LOG_ERROR,
                &format!(
                    "plugin `{}`: {} lease(s) on this engine's memory still held at shutdown",
                    self.protocol,
                    self.memory.leases()
                ),
            );
        }
    }

    fn check_running(&self) -> Result<()> {
        if self.shut_down.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::Shutdown,
                format!(
                    "the `{}` plugin instance of segment `{}` has been shut down",
                    self.protocol, self.segment_name
                ),
            ));
        }
        Ok(())
    }

    /// Cancels `batch` and waits, up to the transfer timeout, until the transport released
    /// every request (after which it touches none of the batch's memory).
    fn cancel_and_wait(&self, batch: &Batch) {
        batch.cancel();
        if !wait_until(self.config.transfer_timeout(), || batch.all_released()) {
            let held = (0..batch.len()).filter(|&i| !batch.is_released(i)).count();
            self.host.log(
                FERRY_LOG_ERROR,
                &format!(
                    "plugin `{}`: the transport did not release {held} cancelled request(s) within {:?}; it may still touch their memory",
                    self.protocol,
                    self.config.transfer_timeout()
                ),
            );
        }
    }
}

fn block_on<T: Send + 'static>(
    rt: &tokio::runtime::Runtime,
    runtime_id: u64,
    fut: impl Future<Output = T> + Send + 'static,
) -> Result<T> {
    if RUNTIME_ID.with(Cell::get) == runtime_id {
        // Blocking the only worker on a task queued behind it would never end.
        return Err(Error::new(
            ErrorKind::Internal,
            "a plugin function was called from the plugin instance's own runtime thread",
        ));
    }
    let (tx, rx) = mpsc::sync_channel(1);
    let task = rt.spawn(fut);
    rt.spawn(async move {
        let _ = tx.send(task.await);
    });
    match rx.recv() {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Ok(Err(_)) | Err(_) => {
            Err(Error::new(ErrorKind::Shutdown, "the plugin instance's runtime stopped before the call finished"))
        }
    }
}

/// Polls `done` until it holds or `timeout` passes; returns whether it holds.
fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now().checked_add(timeout);
    let mut pause = Duration::from_micros(20);
    for spin in 0u32.. {
        if done() {
            return true;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return done();
        }
        if spin < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
    unreachable!("the loop returns")
}

/// An opened peer: what `open_target` returns as `FerryPluginTarget *`.
struct Target {
    magic: u64,
    segment: Arc<OpenSegment>,
}

/// A submitted batch: what `submit` returns as `FerryPluginBatch *`.
struct PluginBatch {
    magic: u64,
    batch: Batch,
}

/// What a shim knows while it runs: whom to report to, and what to undo at the end.
#[derive(Default)]
struct Call {
    protocol: &'static str,
    host: Option<Arc<HostLog>>,
    bound: Option<log::EnterGuard>,
    /// Revoked once the shim is done (after a panic report): a failed `create`, a `destroy`.
    revoke_after: Option<Arc<HostLog>>,
}

impl Call {
    fn bind(&mut self, protocol: &'static str, host: &Arc<HostLog>) {
        self.protocol = protocol;
        self.bound = Some(log::enter(host));
        self.host = Some(host.clone());
    }

    fn bind_instance(&mut self, inst: &Instance) {
        self.bind(inst.protocol, &inst.host);
    }

    fn report(&self, level: u32, message: &str) {
        let line = format!("plugin `{}`: {message}", if self.protocol.is_empty() { "?" } else { self.protocol });
        match &self.host {
            Some(host) => host.log(level, &line),
            None => tracing::warn!("{line}"),
        }
    }
}

/// Runs a shim body; a panic is reported and answered with `on_panic`.
fn guarded<R>(what: &'static str, on_panic: R, body: impl FnOnce(&mut Call) -> R) -> R {
    let mut call = Call::default();
    let result = match catch_unwind(AssertUnwindSafe(|| body(&mut call))) {
        Ok(value) => value,
        Err(payload) => {
            call.report(FERRY_LOG_ERROR, &format!("{what} panicked: {}", panic_message(&*payload)));
            // A payload whose destructor panics must not unwind into the host either.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
            on_panic
        }
    };
    drop(call.bound.take());
    if let Some(host) = call.revoke_after.take() {
        host.revoke();
    }
    result
}

/// A shim returning a status: an error is reported and answered with its negated code.
fn status(what: &'static str, body: impl FnOnce(&mut Call) -> Result<()>) -> i32 {
    counted(what, |call| body(call).map(|()| FERRY_OK))
}

/// A shim returning a count or a status.
fn counted(what: &'static str, body: impl FnOnce(&mut Call) -> Result<i32>) -> i32 {
    guarded(what, FERRY_E_INTERNAL, |call| match body(call) {
        Ok(n) => n,
        Err(e) => {
            call.report(FERRY_LOG_WARN, &format!("{what}: {e}"));
            -e.kind().code()
        }
    })
}

/// A shim returning nothing: an error is reported.
fn void(what: &'static str, body: impl FnOnce(&mut Call) -> Result<()>) {
    guarded(what, (), |call| {
        if let Err(e) = body(call) {
            call.report(FERRY_LOG_WARN, &format!("{what}: {e}"));
        }
    })
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_owned()
    }
}

/// Reads a NUL-terminated UTF-8 argument.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid for `'a`.
unsafe fn c_str<'a>(p: *const c_char, name: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::invalid(format!("`{name}` is null")));
    }
    // SAFETY: non-null, and NUL-terminated by the caller's contract.
    let c = unsafe { CStr::from_ptr(p) };
    c.to_str()
        .map_err(|e| Error::invalid(format!("`{name}` is not UTF-8 (invalid byte at offset {})", e.valid_up_to())))
}

/// The instance behind a pointer from `create`.
///
/// # Safety
/// `p` is null or a pointer `create` returned that was not destroyed (the ABI contract). The
/// magic number catches some misuse (a target or batch passed instead), not all.
unsafe fn instance_ref<'a>(p: *mut FerryPluginInstance) -> Result<&'a Instance> {
    if p.is_null() {
        return Err(Error::invalid("`instance` is null"));
    }
    // SAFETY: the caller's contract: a live `Instance` made by `create`.
    let inst = unsafe { &*p.cast::<Instance>() };
    if inst.magic != INSTANCE_MAGIC {
        return Err(Error::invalid("`instance` is not an instance of this plugin (or was destroyed)"));
    }
    Ok(inst)
}

/// # Safety
/// `p` is null or a pointer `open_target` returned that was not closed.
unsafe fn target_ref<'a>(p: *mut FerryPluginTarget) -> Result<&'a Target> {
    if p.is_null() {
        return Err(Error::invalid("`target` is null"));
    }
    // SAFETY: the caller's contract: a live `Target` made by `open_target`.
    let target = unsafe { &*p.cast::<Target>() };
    if target.magic != TARGET_MAGIC {
        return Err(Error::invalid("`target` is not a target of this plugin (or was closed)"));
    }
    Ok(target)
}

/// # Safety
/// `p` is null or a pointer `submit` returned that was not freed.
unsafe fn batch_ref<'a>(p: *mut FerryPluginBatch) -> Result<&'a PluginBatch> {
    if p.is_null() {
        return Err(Error::invalid("`batch` is null"));
    }
    // SAFETY: the caller's contract: a live `PluginBatch` made by `submit`.
    let batch = unsafe { &*p.cast::<PluginBatch>() };
    if batch.magic != BATCH_MAGIC {
        return Err(Error::invalid("`batch` is not a batch of this plugin (or was freed)"));
    }
    Ok(batch)
}

fn new_instance_id(protocol: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{protocol}-{:x}-{nanos:x}-{:x}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

fn build_runtime(protocol: &str, host: &Arc<HostLog>, id: u64) -> Result<OwnedRuntime> {
    let host = host.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(format!("ferry-plugin-{protocol}"))
        .enable_all()
        .on_thread_start(move || {
            RUNTIME_ID.with(|r| r.set(id));
            log::bind_thread(&host);
        })
        .on_thread_stop(log::unbind_thread)
        .build()
        .map_err(|e| Error::new(ErrorKind::Internal, "cannot start the plugin instance's runtime").with_source(e))?;
    Ok(OwnedRuntime(Some(rt)))
}

/// `create`: see [`ferry_abi::FerryPluginApi::create`].
pub(crate) unsafe extern "C" fn create<P: PluginDefinition>(
    host: *const FerryHostServices,
    segment_name: *const c_char,
    config_json: *const c_char,
    out: *mut *mut FerryPluginInstance,
) -> i32 {
    let protocol = P::PROTOCOL.to_str().unwrap_or("?");
    status("create", |call| {
        call.protocol = protocol;
        log::install();
        // SAFETY: the ABI contract: `host` is null or a `FerryHostServices` of at least its
        // `struct_size` bytes, valid until `destroy`.
        let host_log = unsafe { HostLog::from_services(host) }.map_err(Error::invalid)?;
        call.bind(protocol, &host_log);
        // Until the instance exists, a failure must leave no callback behind.
        call.revoke_after = Some(host_log.clone());
        if out.is_null() {
            return Err(Error::invalid("`out` is null"));
        }
        // SAFETY: a NUL-terminated string valid during the call (ABI contract).
        let segment_name = unsafe { c_str(segment_name, "segment_name") }?;
        if segment_name.is_empty() {
            return Err(Error::invalid("`segment_name` is empty"));
        }
        // SAFETY: as above.
        let config_text = unsafe { c_str(config_json, "config_json") }?;
        let config = Arc::new(Config::from_json_str(config_text, None)?);
        let factory = P::factory();
        if factory.protocol() != protocol {
            return Err(Error::new(
                ErrorKind::Plugin,
                format!("the plugin declares protocol `{protocol}` but its factory serves `{}`", factory.protocol()),
            ));
        }
        static NEXT_RUNTIME: AtomicU64 = AtomicU64::new(1);
        let runtime_id = NEXT_RUNTIME.fetch_add(1, Ordering::Relaxed);
        let runtime = build_runtime(protocol, &host_log, runtime_id)?;
        let memory = Arc::new(MemoryRegistry::new());
        let ctx = TransportContext {
            segment_name: segment_name.to_owned(),
            instance: new_instance_id(protocol),
            config: config.clone(),
            memory: memory.clone(),
            runtime: runtime.get().handle().clone(),
            resolvers: ResolverChain::with_defaults(),
            descriptors: None,
        };
        let transport = block_on(runtime.get(), runtime_id, async move { factory.create(&ctx).await })??;
        let declared = P::CAPABILITIES;
        let actual = crate::capability_bits(transport.capabilities());
        if actual != declared {
            call.report(
                FERRY_LOG_WARN,
                &format!(
                    "the transport's capabilities ({actual:#x}) differ from those the plugin declares ({declared:#x}); the host uses the declared ones"
                ),
            );
        }
        let instance = Box::new(Instance {
            magic: INSTANCE_MAGIC,
            protocol,
            segment_name: segment_name.to_owned(),
            host: host_log.clone(),
            completions: Arc::default(),
            transport,
            memory,
            config,
            shut_down: AtomicBool::new(false),
            runtime_id,
            runtime,
        });
        call.revoke_after = None;
        call.report(FERRY_LOG_INFO, &format!("instance created for segment `{segment_name}`"));
        // SAFETY: `out` is non-null and points to writable storage for a pointer (ABI contract).
        unsafe { out.write(Box::into_raw(instance).cast()) };
        Ok(())
    })
}

/// `shutdown`: see [`ferry_abi::FerryPluginApi::shutdown`].
pub(crate) unsafe extern "C" fn shutdown(instance: *mut FerryPluginInstance) {
    void("shutdown", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        inst.stop();
        Ok(())
    })
}

/// `destroy`: see [`ferry_abi::FerryPluginApi::destroy`].
pub(crate) unsafe extern "C" fn destroy(instance: *mut FerryPluginInstance) {
    void("destroy", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        // Whatever happens below, the host's callbacks are not used after `destroy` returns.
        call.revoke_after = Some(inst.host.clone());
        struct Revoke(Arc<HostSink>);
        impl Drop for Revoke {
            fn drop(&mut self) {
                self.0.revoke();
            }
        }
        // Revoked last: requests the teardown releases are still reported.
        let _revoke = Revoke(inst.completions.clone());
        inst.stop();
        // SAFETY: `create` made this pointer with `Box::into_raw`; the host makes no call on
        // the instance after this one, so nothing else refers to it.
        let mut boxed = unsafe { Box::from_raw(instance.cast::<Instance>()) };
        // SAFETY: `boxed.magic` is a valid, aligned `u64` we own; the volatile write keeps the
        // store (which lets a use after free be recognised) from being optimised away.
        unsafe { std::ptr::write_volatile(&mut boxed.magic, 0) };
        // The transport is dropped first, then the runtime (shut down in the background: a
        // runtime is never dropped the blocking way, since the host may call from async code).
        drop(boxed);
        Ok(())
    })
}

fn to_object(desc: &SegmentDescriptor) -> Result<Map<String, Value>> {
    match serde_json::to_value(desc) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Error::new(ErrorKind::Internal, "a descriptor did not serialise to a JSON object")),
        Err(e) => Err(Error::new(ErrorKind::Internal, "a descriptor could not be serialised").with_source(e)),
    }
}

/// `publish`: see [`ferry_abi::FerryPluginApi::publish`].
pub(crate) unsafe extern "C" fn publish(
    instance: *mut FerryPluginInstance,
    descriptor_json: *const c_char,
    sink: FerryPublishFn,
    sink_ctx: *mut c_void,
) -> i32 {
    status("publish", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        let sink = sink.ok_or_else(|| Error::invalid("`sink` is null"))?;
        // SAFETY: a NUL-terminated string valid during the call (ABI contract).
        let text = unsafe { c_str(descriptor_json, "descriptor_json") }?;
        let mut desc = SegmentDescriptor::from_json("the host's descriptor", text.as_bytes())?;
        let before = to_object(&desc)?;
        {
            let _rt = inst.runtime.get().enter();
            inst.transport.publish(&mut desc);
        }
        let after = to_object(&desc)?;
        for (key, value) in &after {
            if before.get(key) == Some(value) {
                continue;
            }
            // JSON text never holds a raw NUL (serde_json escapes it); a key might.
            let (Ok(k), Ok(v)) = (CString::new(key.as_str()), CString::new(value.to_string())) else {
                call.report(FERRY_LOG_WARN, &format!("publish: field {key:?} contains a NUL byte; not published"));
                continue;
            };
            // SAFETY: the host's sink, called with the host's own context and two strings that
            // outlive the call (ABI contract of `publish`).
            unsafe { sink(sink_ctx, k.as_ptr(), v.as_ptr()) };
        }
        for key in before.keys().filter(|k| !after.contains_key(*k)) {
            call.report(
                FERRY_LOG_WARN,
                &format!("publish: the transport removed field `{key}`; a plugin can only add or change fields"),
            );
        }
        Ok(())
    })
}

/// `register_memory`: see [`ferry_abi::FerryPluginApi::register_memory`].
pub(crate) unsafe extern "C" fn register_memory(
    instance: *mut FerryPluginInstance,
    addr: u64,
    length: u64,
    location: *const c_char,
) -> i32 {
    status("register_memory", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        inst.check_running()?;
        // SAFETY: a NUL-terminated string valid during the call (ABI contract).
        let location: Location = unsafe { c_str(location, "location") }?.parse()?;
        // SAFETY: the host registered `[addr, addr + length)` with its engine and guarantees,
        // by the ABI contract of `register_memory`, that it stays valid memory until it calls
        // `unregister_memory` for it: the promise `MemoryRegistry::register` asks for.
        let region = Region::clone(&*unsafe { inst.memory.register(addr, length, location) }?);
        // Undone unless the transport accepts the region (also when it panics). Nothing can
        // hold a lease on the new region yet: the host submits on memory only once its
        // registration returned.
        let mut rollback = Rollback { memory: &inst.memory, addr: Some(addr), call: &*call };
        let transport = inst.transport.clone();
        // SAFETY: the host's promise, relayed (see the registration above): the memory stays
        // valid until the host calls `unregister_memory` for it, which reaches the transport's
        // `unregister_memory` first, or until `destroy`, which shuts the transport down first.
        let promise = unsafe { MemoryPromise::new() };
        inst.block_on(async move { transport.register_memory(&region, promise).await })??;
        rollback.addr = None;
        Ok(())
    })
}

/// Unregisters a new region from the plugin-side registry when dropped armed.
struct Rollback<'a> {
    memory: &'a MemoryRegistry,
    addr: Option<u64>,
    call: &'a Call,
}

impl Drop for Rollback<'_> {
    fn drop(&mut self) {
        if let Some(addr) = self.addr
            && let Err(e) = self.memory.unregister(addr)
        {
            self.call.report(FERRY_LOG_ERROR, &format!("register_memory: rolling back {addr:#x} failed: {e}"));
        }
    }
}

/// `unregister_memory`: see [`ferry_abi::FerryPluginApi::unregister_memory`].
pub(crate) unsafe extern "C" fn unregister_memory(instance: *mut FerryPluginInstance, addr: u64, length: u64) -> i32 {
    status("unregister_memory", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        let region =
            inst.memory.regions().into_iter().find(|r| r.addr() == addr).ok_or_else(|| {
                Error::not_found(format!("no region registered with this plugin starts at {addr:#x}"))
            })?;
        if region.len() != length {
            return Err(Error::invalid(format!(
                "the region at {addr:#x} has {} bytes, not {length}; nothing was unregistered",
                region.len()
            )));
        }
        // A transport that just released its last request may still hold the lease a moment.
        let mut outcome = inst.memory.unregister(addr).map(drop);
        if outcome.as_ref().is_err_and(|e| e.kind() == ErrorKind::Busy) {
            wait_until(inst.config.transfer_timeout(), || {
                outcome = inst.memory.unregister(addr).map(drop);
                !outcome.as_ref().is_err_and(|e| e.kind() == ErrorKind::Busy)
            });
        }
        outcome?;
        let transport = inst.transport.clone();
        inst.block_on(async move { transport.unregister_memory(&region).await })?
    })
}

/// `open_target`: see [`ferry_abi::FerryPluginApi::open_target`].
pub(crate) unsafe extern "C" fn open_target(
    instance: *mut FerryPluginInstance,
    descriptor_json: *const c_char,
    out: *mut *mut FerryPluginTarget,
) -> i32 {
    status("open_target", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        inst.check_running()?;
        if out.is_null() {
            return Err(Error::invalid("`out` is null"));
        }
        // SAFETY: a NUL-terminated string valid during the call (ABI contract).
        let text = unsafe { c_str(descriptor_json, "descriptor_json") }?;
        let desc = SegmentDescriptor::from_json("open_target", text.as_bytes())?;
        if !inst.transport.serves(&desc) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the `{}` transport does not serve segment `{}` (protocol {:?})",
                    inst.protocol, desc.name, desc.protocol
                ),
            ));
        }
        let handle = SegmentHandle::fresh();
        // The transport opens the peer once, here (its error is kept for the target's submits).
        let (transport, opened) = (inst.transport.clone(), desc.clone());
        let peer = inst.block_on(async move { transport.open(&opened).await })?;
        let segment = Arc::new(OpenSegment::new(handle, desc, inst.transport.protocol(), peer));
        let target = Box::new(Target { magic: TARGET_MAGIC, segment });
        // SAFETY: `out` is non-null and points to writable storage for a pointer (ABI contract).
        unsafe { out.write(Box::into_raw(target).cast()) };
        Ok(())
    })
}

/// `close_target`: see [`ferry_abi::FerryPluginApi::close_target`].
pub(crate) unsafe extern "C" fn close_target(instance: *mut FerryPluginInstance, target: *mut FerryPluginTarget) {
    void("close_target", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        // SAFETY: a live target of this instance (ABI contract).
        unsafe { target_ref(target) }?;
        // SAFETY: `open_target` made this pointer with `Box::into_raw`; the host makes no call
        // with it after this one.
        let mut boxed = unsafe { Box::from_raw(target.cast::<Target>()) };
        // SAFETY: a valid, aligned `u64` we own (see `destroy`).
        unsafe { std::ptr::write_volatile(&mut boxed.magic, 0) };
        Ok(())
    })
}

fn opcode(raw: u32, i: usize) -> Result<Opcode> {
    match raw {
        FERRY_OPCODE_READ => Ok(Opcode::Read),
        FERRY_OPCODE_WRITE => Ok(Opcode::Write),
        other => Err(Error::invalid(format!(
            "request {i}: opcode {other} is neither FERRY_OPCODE_READ nor FERRY_OPCODE_WRITE; nothing was submitted"
        ))),
    }
}

/// `submit`: see [`ferry_abi::FerryPluginApi::submit`].
pub(crate) unsafe extern "C" fn submit(
    instance: *mut FerryPluginInstance,
    target: *mut FerryPluginTarget,
    requests: *const FerryTransferRequest,
    count: usize,
    out: *mut *mut FerryPluginBatch,
) -> i32 {
    status("submit", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        inst.check_running()?;
        // SAFETY: a live target of this instance (ABI contract).
        let segment = &unsafe { target_ref(target) }?.segment;
        if out.is_null() {
            return Err(Error::invalid("`out` is null"));
        }
        if count == 0 {
            return Err(Error::invalid("empty batch: `count` is 0"));
        }
        // `poll` returns the pending count as an `int32_t`.
        if count > i32::MAX as usize {
            return Err(Error::invalid(format!("a batch holds at most {} requests, not {count}", i32::MAX)));
        }
        if requests.is_null() {
            return Err(Error::invalid("`requests` is null"));
        }
        // SAFETY: `requests` is non-null and points to `count` requests valid during the call
        // (ABI contract); `count` is small enough for the slice not to exceed `isize::MAX` bytes.
        let requests = unsafe { std::slice::from_raw_parts(requests, count) };
        let mut opcodes = Vec::with_capacity(count);
        for (i, r) in requests.iter().enumerate() {
            opcodes.push(opcode(r.opcode, i)?);
            if r.flags != 0 {
                return Err(Error::invalid(format!(
                    "request {i}: flags {:#x} are reserved and must be 0; nothing was submitted",
                    r.flags
                )));
            }
        }
        let requests: Vec<TransferRequest> = requests
            .iter()
            .zip(&opcodes)
            .map(|(r, &opcode)| TransferRequest {
                opcode,
                source: r.local_addr,
                target: segment.handle(),
                target_offset: r.remote_addr,
                length: r.length,
            })
            .collect();
        // Leases keep every local region registered until the transport released its requests.
        // With the host's completion sink, each release is reported to it (ABI 1.1).
        let reports = inst.completions.is_active().then(|| BatchReports::new(inst.completions.clone()));
        let leased = match &reports {
            Some(reports) => {
                let reports = reports.clone();
                Batch::lease_observed(&inst.memory, &requests, vec![segment.clone()], move |batch, i| {
                    reports.released(batch, i)
                })
            }
            None => Batch::lease(&inst.memory, &requests, vec![segment.clone()]),
        };
        let (batch, submission) =
            leased.map_err(|(i, e)| e.context(format!("request {i}: {}; nothing was submitted", e.message())))?;
        let handle = batch.clone();
        let raw = Box::into_raw(Box::new(PluginBatch { magic: BATCH_MAGIC, batch }));
        // Stored before the transport sees a request: the host matches reports made inside
        // `submit` through `*out`.
        // SAFETY: `out` is non-null and points to writable storage for a pointer (ABI contract).
        unsafe { out.write(raw.cast()) };
        let submitted = catch_unwind(AssertUnwindSafe(|| {
            let _rt = inst.runtime.get().enter();
            inst.transport.submit(segment, submission);
        }));
        if let Err(panic) = submitted {
            // The submission was dropped while unwinding (its requests are released, and were
            // not reported): the host gets the failure, not the batch.
            // SAFETY: `raw` was made by `Box::into_raw` above and is freed once, here; the host
            // uses `*out` only when `submit` succeeds.
            drop(unsafe { Box::from_raw(raw) });
            // SAFETY: as above, `out` is writable.
            unsafe { out.write(std::ptr::null_mut()) };
            std::panic::resume_unwind(panic);
        }
        if let Some(reports) = reports {
            reports.publish(raw.cast(), &handle);
        }
        Ok(())
    })
}

/// `set_completion_sink`: see [`ferry_abi::FerryPluginApi::set_completion_sink`]. Accepted once
/// per instance; batches submitted afterwards are reported to the host, none is polled.
pub(crate) unsafe extern "C" fn set_completion_sink(
    instance: *mut FerryPluginInstance,
    sink: FerryCompletionFn,
    ctx: *mut c_void,
) -> i32 {
    status("set_completion_sink", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        inst.completions.accept(sink, ctx)
    })
}

/// The state of request `i` as the ABI reports it: pending until the transport released it.
pub(crate) fn status_of(batch: &Batch, i: usize) -> FerryTransferStatus {
    let pending = FerryTransferStatus { state: FERRY_STATE_PENDING, code: FERRY_OK, transferred: 0 };
    if !batch.is_released(i) {
        return pending;
    }
    match batch.request_status(i) {
        None | Some(RequestStatus::Pending) => pending,
        Some(RequestStatus::Completed) => FerryTransferStatus {
            state: FERRY_STATE_COMPLETED,
            code: FERRY_OK,
            transferred: batch.request(i).map_or(0, |v| v.request.length),
        },
        Some(RequestStatus::Failed(kind)) => {
            FerryTransferStatus { state: FERRY_STATE_FAILED, code: -kind.code(), transferred: 0 }
        }
        Some(RequestStatus::Cancelled) => {
            FerryTransferStatus { state: FERRY_STATE_CANCELLED, code: FERRY_E_CANCELLED, transferred: 0 }
        }
    }
}

/// `poll`: see [`ferry_abi::FerryPluginApi::poll`].
pub(crate) unsafe extern "C" fn poll(
    instance: *mut FerryPluginInstance,
    batch: *mut FerryPluginBatch,
    statuses: *mut FerryTransferStatus,
    count: usize,
) -> i32 {
    counted("poll", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        // SAFETY: a live batch of this instance (ABI contract).
        let batch = &unsafe { batch_ref(batch) }?.batch;
        if count != batch.len() {
            return Err(Error::invalid(format!("`count` is {count}, but the batch has {} request(s)", batch.len())));
        }
        if statuses.is_null() {
            return Err(Error::invalid("`statuses` is null"));
        }
        // SAFETY: `statuses` is non-null and points to `count` writable statuses, valid during
        // the call and not otherwise accessed meanwhile (ABI contract).
        let out = unsafe { std::slice::from_raw_parts_mut(statuses, count) };
        let mut pending = 0;
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = status_of(batch, i);
            pending += i32::from(slot.state == FERRY_STATE_PENDING);
        }
        Ok(pending)
    })
}

/// `cancel`: see [`ferry_abi::FerryPluginApi::cancel`].
pub(crate) unsafe extern "C" fn cancel(instance: *mut FerryPluginInstance, batch: *mut FerryPluginBatch) {
    void("cancel", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        // SAFETY: a live batch of this instance (ABI contract).
        let batch = &unsafe { batch_ref(batch) }?.batch;
        // Non-blocking: requests the transport already started stay PENDING in `poll` until it
        // released them, and the host keeps polling until then.
        batch.cancel();
        Ok(())
    })
}

/// The message of `e` followed by its causes.
pub(crate) fn error_text(e: &Error) -> String {
    let mut text = e.message().to_owned();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// `batch_error`: see [`ferry_abi::FerryPluginApi::batch_error`].
pub(crate) unsafe extern "C" fn batch_error(
    instance: *mut FerryPluginInstance,
    batch: *mut FerryPluginBatch,
    index: usize,
    buffer: *mut c_char,
    capacity: usize,
) -> usize {
    guarded("batch_error", 0, |call| {
        let found = (|| {
            // SAFETY: a live instance (ABI contract).
            let inst = unsafe { instance_ref(instance) }?;
            call.bind_instance(inst);
            // SAFETY: a live batch of this instance (ABI contract).
            Ok::<_, Error>(unsafe { batch_ref(batch) }?.batch.error(index))
        })();
        // No error (or bad arguments): the buffer still receives a string, an empty one.
        let text = match found {
            Ok(Some(e)) => error_text(&e),
            Ok(None) => String::new(),
            Err(e) => {
                call.report(FERRY_LOG_WARN, &format!("batch_error: {e}"));
                String::new()
            }
        };
        if !buffer.is_null() && capacity > 0 {
            let mut n = text.len().min(capacity - 1);
            while !text.is_char_boundary(n) {
                n -= 1;
            }
            // SAFETY: `buffer` is non-null and has room for `capacity` bytes (ABI contract);
            // `n + 1 <= capacity`, and the source is our own string.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr(), buffer.cast::<u8>(), n);
                buffer.add(n).write(0);
            }
        }
        text.len()
    })
}

/// `free_batch`: see [`ferry_abi::FerryPluginApi::free_batch`].
pub(crate) unsafe extern "C" fn free_batch(instance: *mut FerryPluginInstance, batch: *mut FerryPluginBatch) {
    void("free_batch", |call| {
        // SAFETY: a live instance (ABI contract).
        let inst = unsafe { instance_ref(instance) }?;
        call.bind_instance(inst);
        // SAFETY: a live batch of this instance (ABI contract).
        let held = &unsafe { batch_ref(batch) }?.batch;
        if !held.all_released() {
            call.report(FERRY_LOG_WARN, "free_batch: the batch still has requests in flight; cancelling them first");
            inst.cancel_and_wait(held);
        }
        // SAFETY: `submit` made this pointer with `Box::into_raw`; the host makes no call with
        // it after this one.
        let mut boxed = unsafe { Box::from_raw(batch.cast::<PluginBatch>()) };
        // SAFETY: a valid, aligned `u64` we own (see `destroy`).
        unsafe { std::ptr::write_volatile(&mut boxed.magic, 0) };
        Ok(())
    })
}
