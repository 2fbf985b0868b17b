//! # ferry-plugin
//!
//! The SDK for Ferry transport plugins written in Rust. A plugin is a `cdylib` named
//! `libferry_transport_<protocol>.so` that exports `ferry_transport_plugin_entry` (see
//! [`ferry_abi`]); Ferry's plugin host loads it at run time and uses it like a built-in
//! transport. With this crate a plugin is an ordinary [`ferry_core::Transport`] plus one line,
//! `ferry_plugin::declare_plugin!(protocol = "example", factory = ExampleTransportFactory);`
//! (see [`declare_plugin!`] for a complete example).
//!
//! [`declare_plugin!`] exports the entry point, which returns a static
//! [`FerryPluginApi`] table of shims. The shims
//!
//! - catch every panic (answering [`FERRY_E_INTERNAL`](ferry_abi::FERRY_E_INTERNAL) and logging
//!   the panic message through the host's log callback) and check every pointer and string
//!   they use (null, UTF-8, JSON → [`FERRY_E_INVALID_ARGUMENT`](ferry_abi::FERRY_E_INVALID_ARGUMENT));
//! - give each instance its own tokio runtime (one worker thread), a plugin-side
//!   [`MemoryRegistry`](ferry_core::MemoryRegistry) mirroring the host's registrations, and a
//!   [`TransportContext`](ferry_core::TransportContext) for the factory;
//! - run the transport's async methods on that runtime and block the calling thread on a
//!   channel, which works whether or not the caller is itself inside a tokio runtime;
//! - forward the plugin's `tracing` events as text to the host's log callback, so plugin logs
//!   land in the host's subscriber.
//!
//! A request is reported pending until the transport *released* it
//! ([`Batch::is_released`](ferry_core::Batch::is_released)), so a host never frees memory a
//! plugin may still touch; `cancel` asks the transport to stop and returns at once.
//!
//! Completions reach the host one of two ways, chosen by the host, with no change to the
//! transport: a host of ABI 1.1 offers a completion callback (`set_completion_sink`), which the
//! table accepts; each request is then reported to the host the moment the transport released
//! it, and the host polls nothing. A host of ABI 1.0 offers none and polls (`poll`), as before.
//!
//! `docs/plugins.md` in the repository describes the whole contract, and how to write a plugin
//! in C.

mod completion;
mod log;
mod shim;

use std::ffi::CStr;
use std::sync::Arc;

pub use ferry_abi;
pub use ferry_abi::FerryPluginApi;
pub use ferry_core;
use ferry_core::{Capabilities, TransportFactory};

/// What [`declare_plugin!`] knows about a plugin; the shims are generic over it. Implemented by
/// the macro (implement it by hand only to build a table with [`plugin_api`] without exporting
/// the entry symbol, as tests do).
pub trait PluginDefinition: 'static {
    /// Protocol name, as written in configs and descriptors.
    const PROTOCOL: &'static CStr;
    /// `FERRY_CAP_*` bits published in the table (see [`capability_bits`]).
    const CAPABILITIES: u32;
    /// The factory that creates one transport per plugin instance. Its
    /// [`protocol`](TransportFactory::protocol) must be [`PROTOCOL`](Self::PROTOCOL).
    fn factory() -> Arc<dyn TransportFactory>;
}

/// The capabilities a plugin declares when [`declare_plugin!`] is not told otherwise: reads and
/// writes of host memory, same process only.
pub const DEFAULT_CAPABILITIES: Capabilities = Capabilities {
    read: true,
    write: true,
    notifications: false,
    host_memory: true,
    device_memory: false,
    cross_process: false,
};

/// `FERRY_CAP_*` bits of `caps`.
pub const fn capability_bits(caps: Capabilities) -> u32 {
    use ferry_abi::*;
    let mut bits = 0;
    if caps.read {
        bits |= FERRY_CAP_READ;
    }
    if caps.write {
        bits |= FERRY_CAP_WRITE;
    }
    if caps.notifications {
        bits |= FERRY_CAP_NOTIFICATIONS;
    }
    if caps.host_memory {
        bits |= FERRY_CAP_HOST_MEMORY;
    }
    if caps.device_memory {
        bits |= FERRY_CAP_DEVICE_MEMORY;
    }
    if caps.cross_process {
        bits |= FERRY_CAP_CROSS_PROCESS;
    }
    bits
}

/// The function table (ABI 1.1) of plugin `P`: every entry is a shim of this crate.
pub const fn plugin_api<P: PluginDefinition>() -> FerryPluginApi {
    FerryPluginApi {
        struct_size: std::mem::size_of::<FerryPluginApi>() as u64,
        abi_major: ferry_abi::FERRY_PLUGIN_ABI_MAJOR,
        abi_minor: ferry_abi::FERRY_PLUGIN_ABI_MINOR,
        protocol: P::PROTOCOL.as_ptr(),
        capabilities: P::CAPABILITIES,
        reserved: 0,
        create: Some(shim::create::<P>),
        shutdown: Some(shim::shutdown),
        destroy: Some(shim::destroy),
        publish: Some(shim::publish),
        register_memory: Some(shim::register_memory),
        unregister_memory: Some(shim::unregister_memory),
        open_target: Some(shim::open_target),
        close_target: Some(shim::close_target),
        submit: Some(shim::submit),
        poll: Some(shim::poll),
        cancel: Some(shim::cancel),
        batch_error: Some(shim::batch_error),
        free_batch: Some(shim::free_batch),
        set_completion_sink: Some(shim::set_completion_sink),
    }
}

/// The body of the exported entry point: `api` when the host's ABI major is this crate's, else
/// null (the host then refuses the plugin).
pub fn entry(api: &'static FerryPluginApi, host_abi_major: u32, host_abi_minor: u32) -> *const FerryPluginApi {
    // A host of another minor version is fine: each side reads only the fields both know.
    let _ = host_abi_minor;
    if host_abi_major == ferry_abi::FERRY_PLUGIN_ABI_MAJOR { api } else { std::ptr::null() }
}

/// Checks a protocol name at compile time and turns `name\0` into a `CStr`: 1 to 64 ASCII
/// letters, digits, `_` or `-` (the name is part of a file name).
#[doc(hidden)]
pub const fn protocol_cstr(with_nul: &'static str) -> &'static CStr {
    let bytes = with_nul.as_bytes();
    assert!(bytes.len() >= 2 && bytes.len() <= 65, "a plugin protocol name has 1 to 64 characters");
    let mut i = 0;
    while i + 1 < bytes.len() {
        let b = bytes[i];
        assert!(
            b.is_ascii_alphanumeric() || b == b'_' || b == b'-',
            "a plugin protocol name is made of ASCII letters, digits, `_` and `-`"
        );
        i += 1;
    }
    match CStr::from_bytes_with_nul(bytes) {
        Ok(c) => c,
        Err(_) => panic!("a plugin protocol name is made of ASCII letters, digits, `_` and `-`"),
    }
}

/// Turns a [`TransportFactory`] into a transport plugin: exports
/// `ferry_transport_plugin_entry`, which returns a static [`FerryPluginApi`] whose functions
/// are this crate's shims around the transports `factory` creates.
///
/// ```
/// use std::sync::Arc;
/// use ferry_plugin::ferry_core::{
///     Capabilities, OpenSegment, Result, Submission, Transport, TransportContext, TransportFactory,
/// };
///
/// /// A transport that completes every request at once, moving nothing.
/// struct Nothing;
///
/// #[async_trait::async_trait]
/// impl Transport for Nothing {
///     fn protocol(&self) -> &str { "nothing" }
///     fn capabilities(&self) -> Capabilities { ferry_plugin::DEFAULT_CAPABILITIES }
///     fn submit(&self, _: &Arc<OpenSegment>, submission: Submission) {
///         submission.complete_all(&Ok(()));
///     }
/// }
///
/// struct NothingFactory;
///
/// #[async_trait::async_trait]
/// impl TransportFactory for NothingFactory {
///     fn protocol(&self) -> &'static str { "nothing" }
///     async fn create(&self, _: &TransportContext) -> Result<Arc<dyn Transport>> {
///         Ok(Arc::new(Nothing))
///     }
/// }
///
/// ferry_plugin::declare_plugin!(protocol = "nothing", factory = NothingFactory);
/// // With more capabilities than the default (host-memory reads and writes in-process):
/// // declare_plugin!(protocol = "nothing", factory = NothingFactory,
/// //     capabilities = Capabilities { cross_process: true, ..ferry_plugin::DEFAULT_CAPABILITIES });
///
/// # fn main() {
/// let api = ferry_transport_plugin_entry(ferry_plugin::ferry_abi::FERRY_PLUGIN_ABI_MAJOR, 0);
/// assert!(!api.is_null());
/// assert!(ferry_transport_plugin_entry(ferry_plugin::ferry_abi::FERRY_PLUGIN_ABI_MAJOR + 1, 0).is_null());
/// # }
/// ```
///
/// - `protocol`: a string literal, checked at compile time (1–64 ASCII letters, digits, `_`,
///   `-`); the library must be named `libferry_transport_<protocol>.so`.
/// - `factory`: an expression of a type implementing [`TransportFactory`], evaluated once per
///   plugin instance; its `protocol()` must equal `protocol`.
/// - `capabilities` (optional): a constant [`Capabilities`], published in the table
///   (default [`DEFAULT_CAPABILITIES`]).
///
/// Use it once per crate, at the crate root, in a crate built as `crate-type = ["cdylib"]`
/// (add `"rlib"` to also link the transport in as a built-in). Two such rlibs cannot be linked
/// into one binary: each defines the entry symbol.
#[macro_export]
macro_rules! declare_plugin {
    (protocol = $protocol:literal, factory = $factory:expr $(, capabilities = $caps:expr)? $(,)?) => {
        /// Entry point of this Ferry transport plugin (`FerryPluginEntryFn` in `ferry-abi`):
        /// returns the plugin's static function table, or null when the host's ABI major
        /// version differs from the plugin's.
        #[unsafe(no_mangle)]
        #[allow(unreachable_pub)]
        pub extern "C" fn ferry_transport_plugin_entry(
            host_abi_major: u32,
            host_abi_minor: u32,
        ) -> *const $crate::FerryPluginApi {
            struct __FerryPluginDefinition;
            impl $crate::PluginDefinition for __FerryPluginDefinition {
                const PROTOCOL: &'static ::std::ffi::CStr = $crate::protocol_cstr(concat!($protocol, "\0"));
                const CAPABILITIES: u32 = $crate::capability_bits($crate::declare_plugin!(@caps $($caps)?));
                fn factory() -> ::std::sync::Arc<dyn $crate::ferry_core::TransportFactory> {
                    ::std::sync::Arc::new($factory)
                }
            }
            static API: $crate::FerryPluginApi = $crate::plugin_api::<__FerryPluginDefinition>();
            $crate::entry(&API, host_abi_major, host_abi_minor)
        }
    };
    (@caps) => {
        $crate::DEFAULT_CAPABILITIES
    };
    (@caps $caps:expr) => {
        $caps
    };
}

#[cfg(test)]
mod tests;
