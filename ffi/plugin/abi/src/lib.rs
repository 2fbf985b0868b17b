//! # ferry-abi
//!
//! The `#[repr(C)]` types that cross Ferry's foreign boundaries. Two ABIs share them:
//!
//! - the **transport-plugin ABI**: a shared library named `libferry_transport_<protocol>.so`
//!   exports [`FERRY_PLUGIN_ENTRY_SYMBOL`], which returns a [`FerryPluginApi`] table of
//!   functions; the host passes [`FerryHostServices`] (a logging callback) to each instance,
//!   and, from ABI 1.1, may hand an instance a [`FerryCompletionFn`] through which the plugin
//!   reports finished requests instead of being polled;
//! - the **public C API** (`ffi/bindings/c`), whose batch submit and poll use the same
//!   [`FerryTransferRequest`] and [`FerryTransferStatus`].
//!
//! Every function in either ABI returns an `int32_t` status: [`FERRY_OK`] (0) or a negated
//! [`ErrorKind` code](https://docs.rs/ferry-core) (`FERRY_E_*`).
//!
//! ## Versioning
//!
//! [`FERRY_PLUGIN_ABI_MAJOR`] changes when an existing field or function changes meaning or
//! place; the host refuses a plugin of another major. [`FERRY_PLUGIN_ABI_MINOR`] grows when
//! fields are appended to the end of [`FerryPluginApi`] or [`FerryHostServices`]; each struct
//! starts with its `struct_size`, so a reader uses only the fields the writer's size covers.
//!
//! | minor | adds |
//! |---|---|
//! | 1.0 | the table up to `free_batch` ([`FERRY_PLUGIN_API_V1_0_SIZE`] bytes); the host polls |
//! | 1.1 | [`FerryPluginApi::set_completion_sink`] ([`FERRY_PLUGIN_API_V1_1_SIZE`] bytes): the plugin reports completions through a host callback |
//!
//! This crate holds only types and constants; the C headers are generated from it by cbindgen.

use std::ffi::{c_char, c_void};

/// Major version of the plugin ABI this crate describes.
pub const FERRY_PLUGIN_ABI_MAJOR: u32 = 1;
/// Minor version of the plugin ABI this crate describes.
pub const FERRY_PLUGIN_ABI_MINOR: u32 = 1;
/// Name of the symbol every plugin exports (type [`FerryPluginEntryFn`]).
pub const FERRY_PLUGIN_ENTRY_SYMBOL: &str = "ferry_transport_plugin_entry";
/// Prefix of a plugin's file name: `libferry_transport_<protocol>.so`.
pub const FERRY_PLUGIN_FILE_PREFIX: &str = "libferry_transport_";

/// Success.
pub const FERRY_OK: i32 = 0;
/// The peer (or the metadata service) could not be reached.
pub const FERRY_E_PEER_UNREACHABLE: i32 = -1;
/// A segment, key, region, layout, batch or handle that was named does not exist.
pub const FERRY_E_NOT_FOUND: i32 = -2;
/// An argument is malformed (null pointer, zero length, not UTF-8, ...).
pub const FERRY_E_INVALID_ARGUMENT: i32 = -3;
/// An address range lies outside every registered region.
pub const FERRY_E_OUT_OF_BOUNDS: i32 = -4;
/// An operation did not finish within its deadline.
pub const FERRY_E_TIMEOUT: i32 = -5;
/// A transport failed while moving data.
pub const FERRY_E_TRANSPORT: i32 = -6;
/// A configuration file or value is invalid.
pub const FERRY_E_CONFIG: i32 = -7;
/// A registration overlaps an existing one, or a name is already taken.
pub const FERRY_E_ALREADY_EXISTS: i32 = -8;
/// The request was cancelled.
pub const FERRY_E_CANCELLED: i32 = -9;
/// The resource is in use.
pub const FERRY_E_BUSY: i32 = -10;
/// Not supported by the selected transport or backend.
pub const FERRY_E_UNSUPPORTED: i32 = -11;
/// The engine has been shut down (or destroyed).
pub const FERRY_E_SHUTDOWN: i32 = -12;
/// A plugin could not be loaded or broke its contract.
pub const FERRY_E_PLUGIN: i32 = -13;
/// A bug inside Ferry or a plugin (a panic), caught at the boundary.
pub const FERRY_E_INTERNAL: i32 = -14;

/// [`FerryTransferRequest::opcode`]: copy from the remote segment into local memory.
pub const FERRY_OPCODE_READ: u32 = 0;
/// [`FerryTransferRequest::opcode`]: copy from local memory into the remote segment.
pub const FERRY_OPCODE_WRITE: u32 = 1;

/// [`FerryTransferStatus::state`]: not finished.
pub const FERRY_STATE_PENDING: i32 = 0;
/// [`FerryTransferStatus::state`]: all bytes moved.
pub const FERRY_STATE_COMPLETED: i32 = 1;
/// [`FerryTransferStatus::state`]: failed; `code` says why.
pub const FERRY_STATE_FAILED: i32 = 2;
/// [`FerryTransferStatus::state`]: cancelled before it completed.
pub const FERRY_STATE_CANCELLED: i32 = 3;

/// [`FerryPluginApi::capabilities`] bit: supports reads.
pub const FERRY_CAP_READ: u32 = 1 << 0;
/// Capability bit: supports writes.
pub const FERRY_CAP_WRITE: u32 = 1 << 1;
/// Capability bit: delivers notifications.
pub const FERRY_CAP_NOTIFICATIONS: u32 = 1 << 2;
/// Capability bit: moves host memory.
pub const FERRY_CAP_HOST_MEMORY: u32 = 1 << 3;
/// Capability bit: moves device memory.
pub const FERRY_CAP_DEVICE_MEMORY: u32 = 1 << 4;
/// Capability bit: reaches other processes.
pub const FERRY_CAP_CROSS_PROCESS: u32 = 1 << 5;

/// [`FerryHostServices::log`] level: error.
pub const FERRY_LOG_ERROR: u32 = 1;
/// Log level: warning.
pub const FERRY_LOG_WARN: u32 = 2;
/// Log level: information.
pub const FERRY_LOG_INFO: u32 = 3;
/// Log level: debugging.
pub const FERRY_LOG_DEBUG: u32 = 4;
/// Log level: tracing.
pub const FERRY_LOG_TRACE: u32 = 5;

/// One transfer, as submitted through the C API or handed to a plugin.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FerryTransferRequest {
    /// [`FERRY_OPCODE_READ`] or [`FERRY_OPCODE_WRITE`].
    pub opcode: u32,
    /// Reserved, must be 0.
    pub flags: u32,
    /// C API: the segment handle from `ferry_open_segment`. Plugins: the host's segment handle
    /// (informational; the target is the `FerryPluginTarget` passed to `submit`).
    pub target: u64,
    /// Local address, inside a registered region.
    pub local_addr: u64,
    /// Address in the peer's address space, inside one of its published buffers.
    pub remote_addr: u64,
    /// Bytes to move (non-zero).
    pub length: u64,
}

/// State of one transfer, as reported by the C API's poll and by a plugin's `poll`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FerryTransferStatus {
    /// `FERRY_STATE_*`.
    pub state: i32,
    /// [`FERRY_OK`], or the `FERRY_E_*` code of a failed or cancelled request.
    pub code: i32,
    /// Bytes moved so far (the request's length once completed).
    pub transferred: u64,
}

/// Logging callback: `level` is `FERRY_LOG_*`, `message` a NUL-terminated UTF-8 string valid
/// for the duration of the call.
pub type FerryLogFn = Option<unsafe extern "C" fn(ctx: *mut c_void, level: u32, message: *const c_char)>;

/// What the host offers a plugin instance. Valid until the instance is destroyed.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FerryHostServices {
    /// `sizeof(FerryHostServices)` as the host built it.
    pub struct_size: u64,
    /// The host's ABI major version.
    pub abi_major: u32,
    /// The host's ABI minor version.
    pub abi_minor: u32,
    /// Opaque host context, passed back to every callback.
    pub ctx: *mut c_void,
    /// Sends a log line to the host's `tracing` subscriber. Callable from any thread.
    pub log: FerryLogFn,
}

/// An instance of a plugin transport (opaque; owned by the plugin).
#[repr(C)]
pub struct FerryPluginInstance {
    _private: [u8; 0],
}

/// A peer segment opened by a plugin instance (opaque; owned by the plugin).
#[repr(C)]
pub struct FerryPluginTarget {
    _private: [u8; 0],
}

/// A batch submitted to a plugin instance (opaque; owned by the plugin).
#[repr(C)]
pub struct FerryPluginBatch {
    _private: [u8; 0],
}

/// Receives one top-level field a plugin adds to its engine's segment descriptor:
/// `key` and `json_value` (a JSON text) are NUL-terminated UTF-8, valid during the call.
pub type FerryPublishFn = Option<unsafe extern "C" fn(ctx: *mut c_void, key: *const c_char, json_value: *const c_char)>;

/// Completion callback (ABI 1.1), handed to an instance by
/// [`FerryPluginApi::set_completion_sink`]: the plugin reports that request `index` of `batch`
/// (the pointer `submit` stored in its `out`) is finished, with its final `status` (state
/// [`FERRY_STATE_COMPLETED`], [`FERRY_STATE_FAILED`] or [`FERRY_STATE_CANCELLED`]) and, for a
/// failure, `message` (a NUL-terminated UTF-8 description valid during the call, or null).
///
/// Called exactly once per request, from any thread, possibly from inside `submit` once `*out`
/// holds the batch; the call is the plugin's promise that it touches the request's memory no
/// more. It never blocks and never calls into the plugin, so the plugin may hold its own locks
/// while calling it. A second report of a request, an index outside the batch, an unknown batch,
/// a null `status` or a pending state are protocol errors: the host logs them and ignores the
/// call.
pub type FerryCompletionFn = Option<
    unsafe extern "C" fn(
        ctx: *mut c_void,
        batch: *mut FerryPluginBatch,
        index: usize,
        status: *const FerryTransferStatus,
        message: *const c_char,
    ),
>;

/// The plugin's entry point, exported as [`FERRY_PLUGIN_ENTRY_SYMBOL`]. Receives the host's ABI
/// version and returns the plugin's function table (static, never freed), or null if the plugin
/// cannot serve this host.
pub type FerryPluginEntryFn = unsafe extern "C" fn(host_abi_major: u32, host_abi_minor: u32) -> *const FerryPluginApi;

/// A plugin's function table (ABI 1.1: the ABI 1.0 table, then `set_completion_sink`).
///
/// Every function returns [`FERRY_OK`] or a `FERRY_E_*` code unless stated otherwise, may be
/// called from any thread, and must not unwind (the Rust SDK catches panics and answers
/// [`FERRY_E_INTERNAL`]). Strings are NUL-terminated UTF-8.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FerryPluginApi {
    /// `sizeof(FerryPluginApi)` as the plugin built it.
    pub struct_size: u64,
    /// The plugin's ABI major version; must equal the host's.
    pub abi_major: u32,
    /// The plugin's ABI minor version.
    pub abi_minor: u32,
    /// Protocol name served, as written in `mooncake.json` and descriptors (static string).
    pub protocol: *const c_char,
    /// `FERRY_CAP_*` bits.
    pub capabilities: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// Creates an instance for the engine whose segment is `segment_name`, configured by
    /// `config_json` (the engine's configuration as a JSON object). `host` stays valid until
    /// `destroy`. On success stores the instance in `*out`.
    pub create: Option<
        unsafe extern "C" fn(
            host: *const FerryHostServices,
            segment_name: *const c_char,
            config_json: *const c_char,
            out: *mut *mut FerryPluginInstance,
        ) -> i32,
    >,
    /// Stops the instance: pending batches fail with [`FERRY_E_SHUTDOWN`]. Called once, before
    /// `destroy`.
    pub shutdown: Option<unsafe extern "C" fn(instance: *mut FerryPluginInstance)>,
    /// Frees the instance. No call on it follows.
    pub destroy: Option<unsafe extern "C" fn(instance: *mut FerryPluginInstance)>,
    /// Adds the fields peers need (ports, rank info) to the engine's descriptor
    /// (`descriptor_json`, the current one) by calling `sink` once per top-level field.
    pub publish: Option<
        unsafe extern "C" fn(
            instance: *mut FerryPluginInstance,
            descriptor_json: *const c_char,
            sink: FerryPublishFn,
            sink_ctx: *mut c_void,
        ) -> i32,
    >,
    /// The host registered `[addr, addr + length)` (location such as `cpu:0` or `npu:3`); the
    /// memory stays valid until `unregister_memory`. An error rolls the registration back.
    pub register_memory: Option<
        unsafe extern "C" fn(
            instance: *mut FerryPluginInstance,
            addr: u64,
            length: u64,
            location: *const c_char,
        ) -> i32,
    >,
    /// The host unregistered the region starting at `addr`; no batch uses it any more.
    pub unregister_memory:
        Option<unsafe extern "C" fn(instance: *mut FerryPluginInstance, addr: u64, length: u64) -> i32>,
    /// Opens the peer described by `descriptor_json` (a Mooncake segment descriptor).
    pub open_target: Option<
        unsafe extern "C" fn(
            instance: *mut FerryPluginInstance,
            descriptor_json: *const c_char,
            out: *mut *mut FerryPluginTarget,
        ) -> i32,
    >,
    /// Closes a target; no batch of it is pending.
    pub close_target: Option<unsafe extern "C" fn(instance: *mut FerryPluginInstance, target: *mut FerryPluginTarget)>,
    /// Starts `count` requests to `target` (the host checked bounds). Must not block on I/O.
    /// On success stores the batch in `*out`; on error none of the requests started.
    pub submit: Option<
        unsafe extern "C" fn(
            instance: *mut FerryPluginInstance,
            target: *mut FerryPluginTarget,
            requests: *const FerryTransferRequest,
            count: usize,
            out: *mut *mut FerryPluginBatch,
        ) -> i32,
    >,
    /// Writes the state of each of the batch's `count` requests to `statuses` and returns how
    /// many are still pending (>= 0), or a `FERRY_E_*` code. Not called on the batches of an
    /// instance that accepted a completion sink (see `set_completion_sink`).
    pub poll: Option<
        unsafe extern "C" fn(
            instance: *mut FerryPluginInstance,
            batch: *mut FerryPluginBatch,
            statuses: *mut FerryTransferStatus,
            count: usize,
        ) -> i32,
    >,
    /// Asks the plugin to stop the batch's pending requests; should not block. A request the
    /// plugin can no longer stop stays [`FERRY_STATE_PENDING`] in `poll` (or unreported, with a
    /// completion sink) until the plugin touches its memory no more; the host keeps the memory
    /// until then, and frees the batch only once nothing is pending.
    pub cancel: Option<unsafe extern "C" fn(instance: *mut FerryPluginInstance, batch: *mut FerryPluginBatch)>,
    /// Copies the error message of request `index` (NUL-terminated, truncated to `capacity`)
    /// into `buffer` and returns its full length in bytes without the NUL (0 when none). With a
    /// completion sink the host takes messages from the reports instead.
    pub batch_error: Option<
        unsafe extern "C" fn(
            instance: *mut FerryPluginInstance,
            batch: *mut FerryPluginBatch,
            index: usize,
            buffer: *mut c_char,
            capacity: usize,
        ) -> usize,
    >,
    /// Frees a batch that has no pending request. With a completion sink the host calls it
    /// once every request was reported, never from inside the callback, but possibly on another
    /// thread while the call that reported the last request is still returning: that report
    /// is the plugin's last use of the batch.
    pub free_batch: Option<unsafe extern "C" fn(instance: *mut FerryPluginInstance, batch: *mut FerryPluginBatch)>,
    /// ABI 1.1, optional: offers the instance a completion sink. The host calls it at most once
    /// per instance, right after `create` and before any other call on the instance.
    ///
    /// Answering [`FERRY_OK`] accepts it: from then on the plugin reports every request of
    /// every batch of the instance through `sink(ctx, ...)` (see [`FerryCompletionFn`]), the
    /// host runs no polling thread for the instance and never calls `poll` or `batch_error`;
    /// `cancel` and `free_batch` keep their meaning. Any other answer (or a null entry, or a
    /// table that ends before it) leaves the instance polled, as in ABI 1.0.
    ///
    /// `sink` and `ctx` stay valid until `destroy` returns; the plugin never calls `sink` after
    /// that, nor for a batch whose `submit` failed (none of its requests started).
    pub set_completion_sink: Option<
        unsafe extern "C" fn(instance: *mut FerryPluginInstance, sink: FerryCompletionFn, ctx: *mut c_void) -> i32,
    >,
}

// SAFETY: the table holds only function pointers and a pointer to a static string; the plugin
// contract makes every function callable from any thread.
unsafe impl Send for FerryPluginApi {}
// SAFETY: as above; the table is immutable once returned.
unsafe impl Sync for FerryPluginApi {}

/// Size of the ABI 1.0 [`FerryPluginApi`] (up to `free_batch`): the least `struct_size` a 1.x
/// plugin may declare.
pub const FERRY_PLUGIN_API_V1_0_SIZE: u64 = std::mem::offset_of!(FerryPluginApi, set_completion_sink) as u64;

/// Size of the ABI 1.1 [`FerryPluginApi`] (up to `set_completion_sink`): a table at least this
/// large has the entry.
pub const FERRY_PLUGIN_API_V1_1_SIZE: u64 = (std::mem::offset_of!(FerryPluginApi, set_completion_sink)
    + std::mem::size_of::<Option<unsafe extern "C" fn()>>()) as u64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_what_the_header_promises() {
        // Offsets are part of the ABI: appending is fine, moving is a major version.
        assert_eq!(std::mem::size_of::<FerryTransferRequest>(), 40);
        assert_eq!(std::mem::size_of::<FerryTransferStatus>(), 16);
        assert_eq!(std::mem::offset_of!(FerryPluginApi, protocol), 16);
        assert_eq!(std::mem::offset_of!(FerryPluginApi, create), 32);
        assert_eq!(FERRY_PLUGIN_API_V1_0_SIZE, 32 + 13 * 8);
        assert_eq!(FERRY_PLUGIN_API_V1_1_SIZE, FERRY_PLUGIN_API_V1_0_SIZE + 8);
        assert_eq!(std::mem::size_of::<FerryPluginApi>() as u64, FERRY_PLUGIN_API_V1_1_SIZE);
        assert_eq!(std::mem::size_of::<FerryHostServices>(), 32);
    }
}
