//! # ferry-capi
//!
//! Ferry's C API: the shared library `libferry_c.so` and its header `ffi/include/ferry.h`
//! (generated from this crate by cbindgen; the shared `repr(C)` types and `FERRY_*` constants
//! come from `ferry_abi.h`, generated from the `ferry-abi` crate). It lets C, C++ and Python
//! (ctypes) programs create engines, register memory, open peers, move bytes and KV blocks,
//! and exchange notifications.
//!
//! ## Conventions
//!
//! - Every function returns `int32_t`: `FERRY_OK` (0) or a negative `FERRY_E_*` code (the
//!   negated `ferry_core::ErrorKind` code), unless its documentation says otherwise.
//! - On failure the calling thread's last error (`ferry_last_error`) holds
//!   `"<kind>: <message>"`, naming the bad argument, handle or field.
//! - Engines and batches are `uint64_t` handles from a process-wide table. 0 is never valid; a
//!   destroyed engine's or freed batch's handle is never reused (each carries a generation), so
//!   it answers `FERRY_E_NOT_FOUND` rather than reaching another object.
//! - A null pointer where a value is required, a string that is not UTF-8, a zero count or
//!   length, or a count that does not match the object is `FERRY_E_INVALID_ARGUMENT`.
//! - Panics never cross the boundary: they are caught and returned as `FERRY_E_INTERNAL`.
//! - Every function may be called from any thread. Blocking calls (create, destroy, allocate,
//!   registration, open, submit, wait, notify) block only the calling thread: no lock other
//!   calls need is held while they wait. Called from a thread that is inside a Rust tokio
//!   runtime, they return `FERRY_E_INVALID_ARGUMENT` (a notification callback runs on the
//!   caller's own thread, so it may call them).
//!
//! Rust code can call the functions directly through this crate's rlib (the tests do).

// Declared in the order the header lists them (cbindgen follows source order).
mod errors;
mod handles;

mod engine;

mod batch;

mod kv;

mod notify;

use std::ffi::{CStr, c_char};

pub use batch::{
    ferry_batch_cancel, ferry_batch_failed_blocks, ferry_batch_free, ferry_batch_len, ferry_batch_poll,
    ferry_batch_released, ferry_batch_wait, ferry_submit, ferry_transfer_sync,
};
pub use engine::{
    ferry_allocate_buffer, ferry_close_segment, ferry_engine_create, ferry_engine_create_from_env,
    ferry_engine_create_from_file, ferry_engine_destroy, ferry_engine_rpc_port, ferry_engine_segment_name,
    ferry_engine_stats, ferry_free_buffer, ferry_open_segment, ferry_register_memory, ferry_segment_buffers,
    ferry_unregister_memory,
};
pub use ferry_abi::{FerryTransferRequest, FerryTransferStatus};
pub use kv::{
    ferry_kv_layout_publish, ferry_kv_layout_register, ferry_kv_layout_unregister, ferry_kv_remote_layout,
    ferry_kv_submit_block_regions, ferry_kv_submit_blocks,
};
pub use notify::{FerryNotificationFn, ferry_drain_notifications, ferry_notify, ferry_notify_as, ferry_probe};

/// Handle of an engine (0 is never valid).
pub type FerryEngine = u64;

/// Handle of a submitted batch (0 is never valid).
pub type FerryBatch = u64;

const VERSION: &CStr = match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
    Ok(v) => v,
    Err(_) => panic!("the package version contains a NUL byte"),
};

/// Ferry's version, for example `"0.1.0"` (a static string; never free it).
#[unsafe(no_mangle)]
pub extern "C" fn ferry_version() -> *const c_char {
    VERSION.as_ptr()
}

/// The calling thread's last error: `"<kind>: <message>"` of the last `ferry_*` call on this
/// thread that failed (for example `"not_found: engine handle 72057598332895232 was
/// destroyed"`), or `""` when none failed. Successful calls leave it unchanged. The pointer is
/// owned by Ferry and valid until the next `ferry_*` call on this thread; copy the text to
/// keep it (`ferry_last_error_copy`). Never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_last_error() -> *const c_char {
    std::panic::catch_unwind(errors::last_error_ptr).unwrap_or(c"".as_ptr())
}

/// Copies the calling thread's last error, NUL-terminated, into `buf` of `cap` bytes
/// (truncated at a UTF-8 character boundary when it does not fit) and returns its full length
/// in bytes without the NUL (0 when there is none). With `buf` NULL or `cap` 0 nothing is
/// written: the return value tells the size needed (plus one for the NUL).
///
/// # Safety
/// `buf` is NULL or valid for writing `cap` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_last_error_copy(buf: *mut c_char, cap: usize) -> usize {
    std::panic::catch_unwind(|| {
        let text = errors::last_error_string();
        // SAFETY: `buf` is NULL or valid for `cap` bytes (this function's contract).
        unsafe { errors::copy_str(&text, buf, cap) };
        text.len()
    })
    .unwrap_or(0)
}

/// Clears the calling thread's last error (`ferry_last_error` then returns `""`).
#[unsafe(no_mangle)]
pub extern "C" fn ferry_clear_last_error() {
    let _ = std::panic::catch_unwind(errors::clear_last_error);
}
