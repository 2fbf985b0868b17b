//! Plugin logs to the host: each instance keeps the host's log callback ([`HostLog`]); a
//! `tracing` layer, installed once per library as the global default, forwards every event as
//! text to the callback of the instance the emitting thread works for.
//!
//! Which instance a thread works for: a shim sets it for the duration of the call
//! ([`enter`]); an instance's runtime threads are bound to it when they start. Events from
//! other threads go to the most recently created live instance's host.

use std::cell::{Cell, RefCell};
use std::ffi::{CString, c_char, c_void};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use ferry_abi::{FERRY_LOG_DEBUG, FERRY_LOG_ERROR, FERRY_LOG_INFO, FERRY_LOG_TRACE, FERRY_LOG_WARN, FerryHostServices};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::{EnvFilter, Layer};

/// Environment variable with the filter (`tracing_subscriber::EnvFilter` syntax) for events a
/// plugin forwards to its host; `RUST_LOG` when unset, else `info`.
pub(crate) const PLUGIN_LOG_ENV: &str = "FERRY_PLUGIN_LOG";

type LogFn = unsafe extern "C" fn(*mut c_void, u32, *const c_char);

/// The host's callback and context.
#[derive(Clone, Copy)]
struct Sink {
    ctx: *mut c_void,
    log: LogFn,
}

// SAFETY: the ABI makes `FerryHostServices::log` callable from any thread with its `ctx`; the
// plugin never dereferences `ctx`, it only passes it back.
unsafe impl Send for Sink {}
// SAFETY: as above.
unsafe impl Sync for Sink {}

/// One instance's way to the host's log. Revoked when the instance is destroyed: after
/// [`revoke`](Self::revoke) returns, the callback is never called again.
pub(crate) struct HostLog {
    sink: RwLock<Option<Sink>>,
}

thread_local! {
    /// The host of the instance this thread works for.
    static CURRENT: RefCell<Option<Arc<HostLog>>> = const { RefCell::new(None) };
    /// Set while this thread is inside a host callback: a host that logs through `tracing`
    /// while sharing it with the plugin (an rlib plugin) must not have its events sent back.
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// Live hosts, most recent last: where events of threads bound to no instance go.
fn live() -> &'static Mutex<Vec<Arc<HostLog>>> {
    static LIVE: OnceLock<Mutex<Vec<Arc<HostLog>>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

impl HostLog {
    /// Reads the log callback from `host`, touching only the fields its `struct_size` covers.
    /// A null `host` or one without a callback gives a `HostLog` that drops every line.
    ///
    /// # Safety
    /// `host` is null or points to at least `struct_size` readable bytes of a
    /// [`FerryHostServices`] (the ABI contract of `create`).
    pub(crate) unsafe fn from_services(host: *const FerryHostServices) -> Result<Arc<Self>, String> {
        let mut sink = None;
        if !host.is_null() {
            // SAFETY: every host struct starts with its `struct_size` (the caller's contract).
            let size = unsafe { host.cast::<u64>().read_unaligned() };
            let covers = |offset: usize, len: usize| (offset + len) as u64 <= size;
            let major_at = std::mem::offset_of!(FerryHostServices, abi_major);
            if covers(major_at, 4) {
                // SAFETY: within the `size` bytes the host declared.
                let major = unsafe { host.cast::<u8>().add(major_at).cast::<u32>().read_unaligned() };
                if major != ferry_abi::FERRY_PLUGIN_ABI_MAJOR {
                    return Err(format!(
                        "the host services declare ABI major version {major}; this plugin implements {}",
                        ferry_abi::FERRY_PLUGIN_ABI_MAJOR
                    ));
                }
            }
            let ctx_at = std::mem::offset_of!(FerryHostServices, ctx);
            let log_at = std::mem::offset_of!(FerryHostServices, log);
            if covers(log_at, std::mem::size_of::<ferry_abi::FerryLogFn>()) {
                // SAFETY: both fields lie within the `size` bytes the host declared; a
                // `FerryLogFn` is a nullable function pointer, so any bit pattern the host
                // wrote there is a valid `Option`.
                let (ctx, log) = unsafe {
                    (
                        host.cast::<u8>().add(ctx_at).cast::<*mut c_void>().read_unaligned(),
                        host.cast::<u8>().add(log_at).cast::<ferry_abi::FerryLogFn>().read_unaligned(),
                    )
                };
                sink = log.map(|log| Sink { ctx, log });
            }
        }
        let host_log = Arc::new(HostLog { sink: RwLock::new(sink) });
        if sink.is_some() {
            live().lock().unwrap_or_else(|p| p.into_inner()).push(host_log.clone());
        }
        Ok(host_log)
    }

    /// Sends one line to the host (NUL bytes in `message` are shown as `\0`).
    pub(crate) fn log(&self, level: u32, message: &str) {
        let guard = self.sink.read().unwrap_or_else(|p| p.into_inner());
        let Some(sink) = *guard else { return };
        if IN_CALLBACK.try_with(|c| c.replace(true)).unwrap_or(true) {
            return;
        }
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                let _ = IN_CALLBACK.try_with(|c| c.set(false));
            }
        }
        let _reset = Reset;
        let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
        // SAFETY: the host keeps its callback and context valid until the instance is
        // destroyed, which revokes the sink (under the write lock this read lock excludes)
        // first; `text` outlives the call.
        unsafe { (sink.log)(sink.ctx, level, text.as_ptr()) };
    }

    /// Stops using the host's callback (waits for calls in progress on other threads).
    pub(crate) fn revoke(self: &Arc<Self>) {
        *self.sink.write().unwrap_or_else(|p| p.into_inner()) = None;
        live().lock().unwrap_or_else(|p| p.into_inner()).retain(|h| !Arc::ptr_eq(h, self));
    }
}

/// Binds this thread to `host` until the guard is dropped.
pub(crate) fn enter(host: &Arc<HostLog>) -> EnterGuard {
    EnterGuard { previous: CURRENT.with(|c| c.replace(Some(host.clone()))) }
}

/// Restores the thread's previous binding.
pub(crate) struct EnterGuard {
    previous: Option<Arc<HostLog>>,
}

impl Drop for EnterGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        // `try_with`: a guard dropped during thread teardown finds the slot gone.
        let _ = CURRENT.try_with(|c| *c.borrow_mut() = previous);
    }
}

/// Binds a runtime thread to its instance's host for the thread's whole life.
pub(crate) fn bind_thread(host: &Arc<HostLog>) {
    let _ = CURRENT.try_with(|c| *c.borrow_mut() = Some(host.clone()));
}

/// Unbinds a runtime thread that is stopping.
pub(crate) fn unbind_thread() {
    let _ = CURRENT.try_with(|c| c.borrow_mut().take());
}

fn current_host() -> Option<Arc<HostLog>> {
    CURRENT
        .try_with(|c| c.borrow().clone())
        .ok()
        .flatten()
        .or_else(|| live().lock().unwrap_or_else(|p| p.into_inner()).last().cloned())
}

/// Installs the forwarding layer as this library's global `tracing` subscriber, once. In a
/// `cdylib` plugin the library has its own copy of `tracing`, so this never touches the host's.
/// When the plugin is linked into a program that already has a global subscriber (an rlib
/// plugin), the program's subscriber stays and receives the plugin's events directly.
pub(crate) fn install() {
    install_with(|| EnvFilter::new(filter_directives(|name| std::env::var(name).ok())));
}

/// [`install`] with a given filter (the first call in a process wins).
pub(crate) fn install_with(filter: impl FnOnce() -> EnvFilter) {
    static INSTALLED: OnceLock<bool> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let subscriber = tracing_subscriber::registry().with(filter()).with(ForwardLayer);
        tracing::subscriber::set_global_default(subscriber).is_ok()
    });
}

/// The filter directives: [`PLUGIN_LOG_ENV`], else `RUST_LOG`, else `info` (empty counts as
/// unset).
pub(crate) fn filter_directives(env: impl Fn(&str) -> Option<String>) -> String {
    env(PLUGIN_LOG_ENV)
        .filter(|v| !v.trim().is_empty())
        .or_else(|| env("RUST_LOG").filter(|v| !v.trim().is_empty()))
        .unwrap_or_else(|| "info".to_owned())
}

/// The `tracing` layer that sends events to the host.
struct ForwardLayer;

impl<S: tracing::Subscriber> Layer<S> for ForwardLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if IN_CALLBACK.try_with(Cell::get).unwrap_or(true) {
            return;
        }
        let Some(host) = current_host() else { return };
        let meta = event.metadata();
        let mut text = TextVisitor::default();
        event.record(&mut text);
        let mut line = format!("{}: {}", meta.target(), text.message);
        if !text.fields.is_empty() {
            line.push_str(&text.fields);
        }
        host.log(level_code(*meta.level()), &line);
    }
}

fn level_code(level: tracing::Level) -> u32 {
    match level {
        tracing::Level::ERROR => FERRY_LOG_ERROR,
        tracing::Level::WARN => FERRY_LOG_WARN,
        tracing::Level::INFO => FERRY_LOG_INFO,
        tracing::Level::DEBUG => FERRY_LOG_DEBUG,
        tracing::Level::TRACE => FERRY_LOG_TRACE,
    }
}

/// Formats an event as `message key=value key=value`.
#[derive(Default)]
struct TextVisitor {
    message: String,
    fields: String,
}

impl Visit for TextVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}
