//! Notifications: short messages between engines over the metadata backend's control channel
//! (the P2P handshake's Notify frame, which Mooncake peers understand too).

use std::ffi::{c_char, c_void};

use crate::FerryEngine;
use crate::engine::engine;
use crate::errors::{Out, guard, invalid, str_arg, to_cstring_lossy};

/// Receives one notification: `from` is the sender's segment name, `message` its text; both are
/// NUL-terminated and valid only during the call. `ctx` is the pointer given to
/// `ferry_drain_notifications`.
pub type FerryNotificationFn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, from: *const c_char, message: *const c_char)>;

/// Sends `message` to the engine that owns segment `segment_name`; returns once the peer
/// accepted it.
///
/// Needs the `P2PHANDSHAKE` metadata (`FERRY_E_UNSUPPORTED` with other backends);
/// `FERRY_E_PEER_UNREACHABLE` when the peer cannot be reached.
///
/// # Safety
/// `segment_name` and `message` are NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_notify(engine: FerryEngine, segment_name: *const c_char, message: *const c_char) -> i32 {
    guard("ferry_notify", || {
        // SAFETY: the caller passes NUL-terminated strings (this function's contract).
        let name = unsafe { str_arg(segment_name, "segment_name") }?;
        // SAFETY: as above.
        let message = unsafe { str_arg(message, "message") }?;
        if name.is_empty() {
            return Err(invalid("`segment_name` is empty"));
        }
        let e = self::engine(engine)?;
        e.block_on(e.send_notification(name, message))?
    })
}

/// Takes the notifications this engine received so far and calls `callback(ctx, from,
/// message)` once for each, oldest first, on the calling thread; then stores how many there
/// were in `*count`. Each notification is delivered once.
///
/// The callback may call other `ferry_*` functions (no lock is held while it runs). Interior
/// NUL bytes in a received text are replaced by U+FFFD.
///
/// # Safety
/// `callback` is a valid function (non-NULL); `count` is valid for writing one `size_t`;
/// `ctx` is passed through untouched.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_drain_notifications(
    engine: FerryEngine,
    callback: FerryNotificationFn,
    ctx: *mut c_void,
    count: *mut usize,
) -> i32 {
    guard("ferry_drain_notifications", || {
        // SAFETY: the caller promises `count` is valid for one write (this function's contract).
        let count = unsafe { Out::new(count, "count") }?;
        let callback = callback.ok_or_else(|| invalid("`callback` is null"))?;
        let e = self::engine(engine)?;
        let received = e.get_notifications();
        let n = received.len();
        for note in received {
            let from = to_cstring_lossy(&note.name);
            let message = to_cstring_lossy(&note.notify_msg);
            // SAFETY: the caller promises `callback` is a valid function of this type; both
            // strings are NUL-terminated and outlive the call; `ctx` is the caller's own.
            unsafe { callback(ctx, from.as_ptr(), message.as_ptr()) };
        }
        count.write(n);
        Ok(())
    })
}
