//! What every exported function does at the C boundary: count and inject faults, delay, log,
//! catch panics (a panic never crosses into C), record the error text for
//! `aclGetRecentErrMsg`, and turn results into codes.

use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::codes::*;
use crate::faults::{ASYNC_SYMBOLS, faults};

/// Which family an entry point belongs to: decides the panic code and whether
/// `FERRY_CANN_EMU_NO_ONESIDED` applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    /// ACL runtime (`aclError`).
    Acl,
    /// Two-sided HCCL (`HcclResult`).
    Hccl,
    /// One-sided HCCL service (`HcclResult`; disabled by `FERRY_CANN_EMU_NO_ONESIDED=1`).
    #[cfg_attr(not(feature = "onesided"), allow(dead_code))]
    HcclOneSided,
    /// HIXL/ADXL (`Status`, a `uint32_t`; a panic is `FAILED`).
    Hixl,
}

impl Api {
    fn internal_code(self) -> i32 {
        match self {
            Api::Acl => ACL_ERROR_RT_INTERNAL_ERROR,
            Api::Hccl | Api::HcclOneSided => HCCL_E_INTERNAL,
            Api::Hixl => HIXL_FAILED as i32,
        }
    }
}

/// Locks a mutex, ignoring poisoning (a panic elsewhere was already reported as an error code).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Read-locks an `RwLock`, ignoring poisoning.
pub(crate) fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

/// Write-locks an `RwLock`, ignoring poisoning.
pub(crate) fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
struct Recent {
    pending: Option<CString>,
    returned: Option<CString>,
}

thread_local! {
    static RECENT: RefCell<Recent> = RefCell::new(Recent::default());
}

/// Records `message` as this thread's most recent error text.
pub(crate) fn set_recent_error(message: &str) {
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let _ = RECENT.try_with(|r| r.borrow_mut().pending = Some(text));
}

/// `aclGetRecentErrMsg`: hands out this thread's most recent error text and clears it (NULL
/// when there is none). The pointer stays valid until the next `aclGetRecentErrMsg` call on
/// this thread.
pub(crate) fn take_recent_error() -> *const c_char {
    RECENT
        .try_with(|r| {
            let mut r = r.borrow_mut();
            r.returned = r.pending.take();
            r.returned.as_ref().map_or(std::ptr::null(), |s| s.as_ptr())
        })
        .unwrap_or(std::ptr::null())
}

/// Writes one log line to stderr (only called when `FERRY_CANN_EMU_LOG=1`), stamped with the
/// process id and the wall-clock time in seconds (microseconds), so the logs of two processes
/// can be merged in order.
pub(crate) fn log_line(line: &str) {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    eprintln!("[ferry-cann-emu {} {}.{:06}] {line}", std::process::id(), t.as_secs(), t.subsec_micros());
}

/// Logs `line` when `FERRY_CANN_EMU_LOG=1`.
pub(crate) fn debug(line: impl FnOnce() -> String) {
    if faults().log {
        log_line(&line());
    }
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".to_string())
}

/// Runs one exported function that returns a code: faults, delay, panic catching, error text,
/// log. `args` is only evaluated when logging is on.
pub(crate) fn entry(
    api: Api,
    name: &'static str,
    args: impl FnOnce() -> String,
    body: impl FnOnce() -> EmuResult<()>,
) -> i32 {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let f = faults();
        let args = if f.log { Some(args()) } else { None };
        let result = if api == Api::HcclOneSided && f.no_onesided {
            Err(err(
                HCCL_E_NOT_SUPPORT,
                format!("{name}: the one-sided HCCL service is not supported (FERRY_CANN_EMU_NO_ONESIDED=1)"),
            ))
        } else if let Some((n, code)) = f.injected_failure(name) {
            Err(err(code, format!("{name}: injected failure of call #{n} (FERRY_CANN_EMU_FAIL)")))
        } else {
            // A call HCCL does not allow to overlap holds the process's lifecycle section for
            // its whole duration, its injected delay included.
            let _section = match enter_lifecycle(name) {
                Ok(s) => s,
                Err(e) => return finish(name, args, Err(e)),
            };
            if !ASYNC_SYMBOLS.contains(&name)
                && let Some(delay) = f.delay(name)
            {
                std::thread::sleep(delay);
            }
            match catch_unwind(AssertUnwindSafe(body)) {
                Ok(r) => r,
                Err(payload) => Err(err(
                    api.internal_code(),
                    format!("{name}: internal error in the emulator (panic: {})", panic_text(payload.as_ref())),
                )),
            }
        };
        finish(name, args, result)
    }));
    outcome.unwrap_or_else(|_| api.internal_code())
}

/// Records the error text, logs, and turns the result into a code.
fn finish(name: &str, args: Option<String>, result: EmuResult<()>) -> i32 {
    let code = match &result {
        Ok(()) => 0,
        Err(e) => {
            set_recent_error(&e.message);
            e.code
        }
    };
    if let Some(args) = args {
        match &result {
            Ok(()) => log_line(&format!("{name}({args}) -> 0")),
            Err(e) => log_line(&format!("{name}({args}) -> {} ({})", e.code, e.message)),
        }
    }
    code
}

/// HCCL calls that change unlocked process globals and so must never run at the same time in
/// one process. HCOMM `op_base.cc` writes the one-sided globals without a lock in init; HIXL `comm_channel.cc` l.29-31 serialises init because "the underlying hccl library does not support parallel HcclCommInitClusterInfoMemConfig calls" (docs/ascend.md, rule 1).
pub(crate) const LIFECYCLE_SYMBOLS: &[&str] = &["HcclCommInitClusterInfoMemConfig", "HcclCommDestroy"];

static LIFECYCLE: Mutex<Option<&'static str>> = Mutex::new(None);

/// Holds the lifecycle section while a [`LIFECYCLE_SYMBOLS`] call runs.
pub(crate) struct LifecycleSection(bool);

impl Drop for LifecycleSection {
    fn drop(&mut self) {
        if self.0 {
            *lock(&LIFECYCLE) = None;
        }
    }
}

/// Enters the lifecycle section for `name` (a no-op for other calls). A call that finds another
/// one inside fails with `HCCL_E_INTERNAL` and a log line on stderr: real HCCL would corrupt
/// its globals silently; the emulator makes the overlap visible.
fn enter_lifecycle(name: &'static str) -> EmuResult<LifecycleSection> {
    if !LIFECYCLE_SYMBOLS.contains(&name) {
        return Ok(LifecycleSection(false));
    }
    let mut held = lock(&LIFECYCLE);
    if let Some(other) = *held {
        let message = format!(
            "{name} was called while {other} is still running on another thread of this process: HCCL's \
             communicator init and destroy are not thread-safe (unlocked process globals); serialise them with \
             one process-wide lock, as HIXL does"
        );
        eprintln!("[ferry-cann-emu {}] error: {message}", std::process::id());
        return Err(err(HCCL_E_INTERNAL, message));
    }
    *held = Some(name);
    Ok(LifecycleSection(true))
}

/// Runs one exported function that returns a pointer: an injected failure or a panic gives NULL.
pub(crate) fn entry_ptr(name: &'static str, body: impl FnOnce() -> *const c_char) -> *const c_char {
    catch_unwind(AssertUnwindSafe(|| {
        let f = faults();
        if f.injected_failure(name).is_some() {
            if f.log {
                log_line(&format!("{name}() -> NULL (injected failure)"));
            }
            return std::ptr::null();
        }
        if let Some(delay) = f.delay(name) {
            std::thread::sleep(delay);
        }
        let p = body();
        if f.log {
            log_line(&format!("{name}() -> {p:p}"));
        }
        p
    }))
    .unwrap_or(std::ptr::null())
}
