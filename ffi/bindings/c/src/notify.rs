//! Notifications: short messages between engines over the engine's control channel
//! (the P2P handshake's Notify frame, which Mooncake peers understand too).

use std::ffi::{c_char, c_void};

use crate::FerryEngine;
use crate::engine::engine;
use crate::errors::{Out, guard, invalid, opt_str_arg, str_arg, to_cstring_lossy};

/// Receives one notification: `from` is the sender's segment name, `message` its text; both are
/// NUL-terminated and valid only during the call. `ctx` is the pointer given to
/// `ferry_drain_notifications`.
pub type FerryNotificationFn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, from: *const c_char, message: *const c_char)>;

/// Sends `message` to the engine that owns segment `segment_name`; returns once the peer
/// accepted it.
///
/// Needs a metadata backend with a control channel (`P2PHANDSHAKE`, HTTP, Redis, etcd;
/// `FERRY_E_UNSUPPORTED` with the in-process store); `FERRY_E_PEER_UNREACHABLE` when the peer
/// cannot be reached.
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

/// Sends `message` to the engine that owns segment `segment_name` with the notification's
/// `name` field set to `sender_name` (Mooncake's `TransferNotify.name`: its receivers see it as
/// given); NULL means this engine's segment name, as `ferry_notify` sends. Returns once the peer
/// accepted it; errors as `ferry_notify`.
///
/// # Safety
/// `segment_name` and `message` are NUL-terminated strings; `sender_name` is NULL or one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_notify_as(
    engine: FerryEngine,
    segment_name: *const c_char,
    sender_name: *const c_char,
    message: *const c_char,
) -> i32 {
    guard("ferry_notify_as", || {
        // SAFETY: the caller passes NUL-terminated strings (this function's contract).
        let name = unsafe { str_arg(segment_name, "segment_name") }?;
        // SAFETY: as above; NULL is allowed for `sender_name`.
        let sender = unsafe { opt_str_arg(sender_name, "sender_name") }?;
        // SAFETY: as above.
        let message = unsafe { str_arg(message, "message") }?;
        if name.is_empty() {
            return Err(invalid("`segment_name` is empty"));
        }
        let e = self::engine(engine)?;
        let sender = sender.map_or_else(|| e.segment_name().to_owned(), str::to_owned);
        e.block_on(e.send_notification_as(name, sender, message))?
    })
}

/// Checks that the engine owning segment `segment_name` is alive: sends a Probe frame to its
/// handshake listener (found from its name with `P2PHANDSHAKE`, from its `rpc_meta` entry with
/// a store) and waits for the answer, at most the handshake timeout (10 s). Mooncake's
/// `send_probe`; Mooncake peers answer it too.
///
/// Returns `FERRY_E_NOT_FOUND` when the segment publishes no rpc entry,
/// `FERRY_E_PEER_UNREACHABLE` or `FERRY_E_TIMEOUT` when its listener does not answer,
/// `FERRY_E_UNSUPPORTED` with the in-process metadata (no control channel).
///
/// # Safety
/// `segment_name` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_probe(engine: FerryEngine, segment_name: *const c_char) -> i32 {
    guard("ferry_probe", || {
        // SAFETY: the caller passes a NUL-terminated string (this function's contract).
        let name = unsafe { str_arg(segment_name, "segment_name") }?;
        if name.is_empty() {
            return Err(invalid("`segment_name` is empty"));
        }
        let e = self::engine(engine)?;
        e.block_on(e.probe(name))?
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
