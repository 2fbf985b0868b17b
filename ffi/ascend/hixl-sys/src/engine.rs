//! One HIXL engine (`hixl::Hixl` or `adxl::AdxlEngine` object).

use std::ffi::{CString, c_char, c_void};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::HixlError;
use crate::library::{HixlLibrary, check};
use crate::shim::{self, CxxError, MemDesc};
use crate::symbols::idx;
use crate::types::{MemType, TransferOp, TransferOpDesc, TransferStatus};

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// A registration ([`HixlEngine::register_mem`]); give it back to
/// [`HixlEngine::deregister_mem`] of the same engine.
#[must_use = "memory stays registered (and reachable by peers) until the handle is deregistered"]
#[derive(PartialEq, Eq, Hash)]
pub struct MemHandle {
    raw: usize,
    engine: u64,
}

impl MemHandle {
    /// HIXL's handle value (for logs).
    pub fn raw(&self) -> usize {
        self.raw
    }
}

impl fmt::Debug for MemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemHandle({:#x} of engine {})", self.raw, self.engine)
    }
}

/// An asynchronous transfer in flight ([`HixlEngine::transfer_async`]). HIXL releases it once it
/// reports `COMPLETED` or `FAILED` and does not support asking again, so
/// [`HixlEngine::poll_transfer`] takes it by value and gives it back only while it is waiting.
#[must_use = "poll the request until it completes or fails"]
#[derive(PartialEq, Eq, Hash)]
pub struct TransferReq {
    raw: usize,
    engine: u64,
}

impl TransferReq {
    /// HIXL's request value (for logs).
    pub fn raw(&self) -> usize {
        self.raw
    }
}

impl fmt::Debug for TransferReq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TransferReq({:#x} of engine {})", self.raw, self.engine)
    }
}

/// What [`HixlEngine::poll_transfer`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum TransferPoll {
    /// Still in flight (`WAITING`): poll again with the request given back.
    Waiting(TransferReq),
    /// Finished, and released by HIXL: `Completed`, `Failed` (or `Timeout`, or a value this
    /// crate does not know).
    Done(TransferStatus),
}

/// One HIXL engine: a `hixl::Hixl` or `adxl::AdxlEngine` object, by [`HixlLibrary::api`].
///
/// The object is created by [`HixlEngine::new`], brought up with [`HixlEngine::initialize`]
/// (which, with a port, makes it a server listening on it), and on drop finalized (when it was
/// initialized) and destroyed. The order HIXL requires is the caller's: register memory before
/// connecting (memory registered after a link exists is not reachable over it), disconnect every
/// peer before deregistering, use timeouts > 0.
pub struct HixlEngine {
    lib: Arc<HixlLibrary>,
    obj: NonNull<c_void>,
    id: u64,
    initialized: bool,
}

// SAFETY: the engine is a heap object owned by this value alone, and HIXL's engines are meant to
// be shared by threads: Mooncake's `ascend_direct` calls TransferSync on one engine from up to 16
// worker threads at once, registers and deregisters memory while they run, and polls
// GetTransferStatus from a separate thread (docs/research/hixl-interop-facts.md §3.5, §3.6). The
// calls that take `&self` here are exactly those; Initialize, Finalize and the destructor, which
// HIXL does not expect concurrently with anything, take `&mut self` or run in `drop`.
unsafe impl Send for HixlEngine {}
// SAFETY: see `Send`: every `&self` method is one HIXL documents and Mooncake uses concurrently.
unsafe impl Sync for HixlEngine {}

impl fmt::Debug for HixlEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HixlEngine")
            .field("api", &self.lib.api())
            .field("id", &self.id)
            .field("initialized", &self.initialized)
            .finish()
    }
}

/// `s` as a C string for `call`, or an error naming the argument and the NUL's offset.
pub(crate) fn c_string(call: &'static str, what: &str, s: &str) -> Result<CString, HixlError> {
    CString::new(s).map_err(|e| HixlError::InvalidArgument {
        call,
        reason: format!("{what} {s:?} contains a NUL byte at offset {}", e.nul_position()),
    })
}

impl HixlEngine {
    /// Constructs an engine object (not initialized yet).
    pub fn new(lib: Arc<HixlLibrary>) -> Result<Self, HixlError> {
        let call = lib.call(idx::CTOR);
        let mut obj: *mut c_void = std::ptr::null_mut();
        let mut err = CxxError::new();
        // SAFETY: `lib.fns` holds the constructor and destructor of the API's class (resolved by
        // their mangled names); the shim allocates the object (aligned, with room to spare) and
        // runs the constructor on it. `obj` and `err` are valid out-pointers.
        let status = unsafe { shim::ferry_hixl_engine_new(&lib.fns, &mut obj, &mut err) };
        check(call, status, &err)?;
        let obj = NonNull::new(obj).ok_or(HixlError::Status { call, status: crate::Status::FAILED })?;
        Ok(Self { lib, obj, id: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed), initialized: false })
    }

    /// The library this engine came from.
    pub fn library(&self) -> &Arc<HixlLibrary> {
        &self.lib
    }

    /// Whether [`Self::initialize`] succeeded (and [`Self::finalize`] has not run since).
    pub fn is_initialized(&self) -> bool {
        self.initialized
    }

    /// `Initialize(local_engine, options)`.
    ///
    /// `local_engine` is `ip`, `ip:port` or `[ipv6]:port`; a port > 0 makes this engine a
    /// server listening on it. The options are passed as given (HIXL accepts `BufferPool`,
    /// `AutoConnect`, `LocalCommRes`, ... and the `adxl.` prefixed forms). The calling thread
    /// must have an ACL device set (`aclrtSetDevice`), as HIXL requires.
    ///
    /// # Errors
    /// HIXL's status; [`HixlError::InvalidArgument`] for a NUL byte in a string or an option
    /// given twice; [`HixlError::InvalidState`] when already initialized (HIXL would answer
    /// SUCCESS and ignore the new name and options).
    pub fn initialize(&mut self, local_engine: &str, options: &[(&str, &str)]) -> Result<(), HixlError> {
        let call = self.lib.call(idx::INITIALIZE);
        if self.initialized {
            return Err(HixlError::InvalidState { call, reason: "the engine is already initialized" });
        }
        let name = c_string(call, "the local engine name", local_engine)?;
        let mut keys = Vec::with_capacity(options.len());
        let mut values = Vec::with_capacity(options.len());
        for (i, (k, v)) in options.iter().enumerate() {
            if options[..i].iter().any(|(other, _)| other == k) {
                return Err(HixlError::InvalidArgument { call, reason: format!("option {k:?} is given twice") });
            }
            keys.push(c_string(call, "the option key", k)?);
            values.push(c_string(call, &format!("the value of option {k:?}"), v)?);
        }
        let key_ptrs: Vec<*const c_char> = keys.iter().map(|k| k.as_ptr()).collect();
        let value_ptrs: Vec<*const c_char> = values.iter().map(|v| v.as_ptr()).collect();
        let mut err = CxxError::new();
        // SAFETY: `self.obj` is a constructed engine of `self.lib`'s class; the strings are
        // NUL-terminated and outlive the call; the two arrays hold `options.len()` pointers each.
        // The shim builds the AscendStrings and the options map and calls Initialize.
        let status = unsafe {
            shim::ferry_hixl_initialize(
                &self.lib.fns,
                self.obj.as_ptr(),
                name.as_ptr(),
                key_ptrs.as_ptr(),
                value_ptrs.as_ptr(),
                options.len(),
                &mut err,
            )
        };
        check(call, status, &err)?;
        self.initialized = true;
        Ok(())
    }

    /// `Finalize()`: closes every link and releases HIXL's resources. Does nothing when not
    /// initialized. The engine may be initialized again afterwards. (Dropping the engine
    /// finalizes it too.)
    pub fn finalize(&mut self) {
        if !self.initialized {
            return;
        }
        self.initialized = false;
        let mut err = CxxError::new();
        // SAFETY: `self.obj` is a constructed, initialized engine; `&mut self` keeps every other
        // call out while Finalize runs.
        unsafe { shim::ferry_hixl_finalize(&self.lib.fns, self.obj.as_ptr(), &mut err) };
        if let Some(what) = err.take() {
            tracing::warn!(call = self.lib.call(idx::FINALIZE), %what, "HIXL Finalize threw a C++ exception");
        }
    }

    fn require_initialized(&self, call: &'static str) -> Result<(), HixlError> {
        if self.initialized {
            Ok(())
        } else {
            Err(HixlError::InvalidState { call, reason: "the engine is not initialized" })
        }
    }

    /// `RegisterMem({addr, len}, kind)`: makes `len` bytes at `addr` reachable by peers (over
    /// links made after this call). Registering the same range again returns the same handle.
    ///
    /// # Safety
    /// Until the handle is deregistered (or the engine finalized or dropped), any connected peer
    /// may read and write these bytes at any time: the range must stay allocated, and nothing
    /// may rely on its contents being left alone. `kind` must say where the memory lives (device
    /// memory from `aclrtMalloc`, host memory from `aclrtMallocHost`).
    pub unsafe fn register_mem(&self, addr: usize, len: usize, kind: MemType) -> Result<MemHandle, HixlError> {
        let call = self.lib.call(idx::REGISTER_MEM);
        self.require_initialized(call)?;
        let desc = MemDesc { addr, len, local_only: 0, reserved: [0; 127] };
        let mut handle: *mut c_void = std::ptr::null_mut();
        let mut err = CxxError::new();
        // SAFETY: `self.obj` is an initialized engine; `desc` is a MemDesc in HIXL's layout and
        // `handle`/`err` are valid out-pointers. The caller vouches for the memory (see above).
        let status = unsafe {
            shim::ferry_hixl_register_mem(&self.lib.fns, self.obj.as_ptr(), &desc, kind.raw(), &mut handle, &mut err)
        };
        check(call, status, &err)?;
        Ok(MemHandle { raw: handle as usize, engine: self.id })
    }

    /// `DeregisterMem(handle)`. HIXL wants every peer disconnected first (its client/server
    /// engine refuses with `FAILED` otherwise).
    ///
    /// # Errors
    /// HIXL's status; [`HixlError::InvalidArgument`] for a handle of another engine (HIXL is not
    /// called). The handle is borrowed: after a failure the memory is still registered, and the
    /// caller keeps the handle to try again (and must not free the memory meanwhile).
    pub fn deregister_mem(&self, handle: &MemHandle) -> Result<(), HixlError> {
        let call = self.lib.call(idx::DEREGISTER_MEM);
        if handle.engine != self.id {
            return Err(HixlError::InvalidArgument { call, reason: format!("{handle:?} is not this engine's") });
        }
        self.require_initialized(call)?;
        let mut err = CxxError::new();
        // SAFETY: `self.obj` is an initialized engine and `handle.raw` is a handle its
        // RegisterMem returned.
        let status = unsafe {
            shim::ferry_hixl_deregister_mem(&self.lib.fns, self.obj.as_ptr(), handle.raw as *mut c_void, &mut err)
        };
        check(call, status, &err)
    }

    /// `Connect(remote, timeout_ms)`: links to the engine named `remote` (`ip:port`).
    /// `ALREADY_CONNECTED` is an error here, as in HIXL.
    pub fn connect(&self, remote: &str, timeout_ms: i32) -> Result<(), HixlError> {
        self.link(idx::CONNECT, remote, timeout_ms)
    }

    /// `Disconnect(remote, timeout_ms)`; `NOT_CONNECTED` when there is no link.
    pub fn disconnect(&self, remote: &str, timeout_ms: i32) -> Result<(), HixlError> {
        self.link(idx::DISCONNECT, remote, timeout_ms)
    }

    fn link(&self, i: usize, remote: &str, timeout_ms: i32) -> Result<(), HixlError> {
        let call = self.lib.call(i);
        self.require_initialized(call)?;
        let name = c_string(call, "the remote engine name", remote)?;
        let mut err = CxxError::new();
        let f = if i == idx::CONNECT { shim::ferry_hixl_connect } else { shim::ferry_hixl_disconnect };
        // SAFETY: `self.obj` is an initialized engine; `name` is NUL-terminated and outlives the
        // call; `err` is a valid out-pointer.
        let status = unsafe { f(&self.lib.fns, self.obj.as_ptr(), name.as_ptr(), timeout_ms, &mut err) };
        check(call, status, &err)
    }

    /// `TransferSync(remote, op, descs, timeout_ms)`: copies every descriptor and returns when all
    /// are done, or with `TIMEOUT` after `timeout_ms`.
    ///
    /// # Safety
    /// For [`TransferOp::Read`] HIXL writes `len` bytes at each `local_addr`, for
    /// [`TransferOp::Write`] it reads them: each local range must be memory this engine
    /// registered, valid for that access for the whole call, and not accessed by anything else
    /// meanwhile in a way the copy would race with. The remote ranges are the peer's to check.
    /// HIXL does not document whether a copy can still land after the call failed (`TIMEOUT`
    /// in particular): until the link is disconnected, treat a failed READ's local ranges as
    /// possibly still being written.
    pub unsafe fn transfer_sync(
        &self,
        remote: &str,
        op: TransferOp,
        descs: &[TransferOpDesc],
        timeout_ms: i32,
    ) -> Result<(), HixlError> {
        let call = self.lib.call(idx::TRANSFER_SYNC);
        self.require_initialized(call)?;
        let name = c_string(call, "the remote engine name", remote)?;
        let mut err = CxxError::new();
        // SAFETY: `self.obj` is an initialized engine; `name` is NUL-terminated; `descs` is
        // `descs.len()` TransferOpDescs in HIXL's layout (the shim copies them into a vector).
        // The caller vouches for the local memory (see above).
        let status = unsafe {
            shim::ferry_hixl_transfer_sync(
                &self.lib.fns,
                self.obj.as_ptr(),
                name.as_ptr(),
                op.raw(),
                descs.as_ptr(),
                descs.len(),
                timeout_ms,
                &mut err,
            )
        };
        check(call, status, &err)
    }

    /// `TransferAsync(remote, op, descs, {}, req)`: starts the copies and returns a request to
    /// [poll](Self::poll_transfer). HIXL enforces no timeout on it: the caller does (and should
    /// disconnect on one).
    ///
    /// # Errors
    /// [`HixlError::Unsupported`] when this release lacks `TransferAsync` or
    /// `GetTransferStatus` ([`HixlLibrary::has_async`]); HIXL's status otherwise.
    ///
    /// # Safety
    /// As for [`Self::transfer_sync`], for as long as the request is in flight: until
    /// [`Self::poll_transfer`] reports it done (or the engine is finalized or dropped).
    pub unsafe fn transfer_async(
        &self,
        remote: &str,
        op: TransferOp,
        descs: &[TransferOpDesc],
    ) -> Result<TransferReq, HixlError> {
        let call = self.lib.call(idx::TRANSFER_ASYNC);
        if !self.lib.has_async() {
            let missing =
                if self.lib.fns.transfer_async.is_null() { idx::TRANSFER_ASYNC } else { idx::GET_TRANSFER_STATUS };
            return Err(self.lib.unsupported(self.lib.call(missing)));
        }
        self.require_initialized(call)?;
        let name = c_string(call, "the remote engine name", remote)?;
        let mut req: *mut c_void = std::ptr::null_mut();
        let mut err = CxxError::new();
        // SAFETY: as in `transfer_sync`; `req` is a valid out-pointer, and the shim passes
        // zeroed TransferArgs.
        let status = unsafe {
            shim::ferry_hixl_transfer_async(
                &self.lib.fns,
                self.obj.as_ptr(),
                name.as_ptr(),
                op.raw(),
                descs.as_ptr(),
                descs.len(),
                &mut req,
                &mut err,
            )
        };
        check(call, status, &err)?;
        Ok(TransferReq { raw: req as usize, engine: self.id })
    }

    /// `GetTransferStatus(req, status)`. A request that is done is released by HIXL and consumed
    /// here; a waiting one is given back in [`TransferPoll::Waiting`].
    ///
    /// # Errors
    /// HIXL's status (HIXL then counts the request as failed); [`HixlError::InvalidArgument`]
    /// for a request of another engine (HIXL is not called).
    pub fn poll_transfer(&self, req: TransferReq) -> Result<TransferPoll, HixlError> {
        let call = self.lib.call(idx::GET_TRANSFER_STATUS);
        if req.engine != self.id {
            return Err(HixlError::InvalidArgument { call, reason: format!("{req:?} is not this engine's") });
        }
        if !self.lib.has_async() {
            return Err(self.lib.unsupported(call));
        }
        self.require_initialized(call)?;
        let mut status = 0i32;
        let mut err = CxxError::new();
        // SAFETY: `self.obj` is an initialized engine and `req.raw` a request its TransferAsync
        // returned that has not been reported done (done requests are consumed above).
        let rc = unsafe {
            shim::ferry_hixl_get_transfer_status(
                &self.lib.fns,
                self.obj.as_ptr(),
                req.raw as *mut c_void,
                &mut status,
                &mut err,
            )
        };
        check(call, rc, &err)?;
        Ok(match TransferStatus::from_raw(status) {
            TransferStatus::Waiting => TransferPoll::Waiting(req),
            done => TransferPoll::Done(done),
        })
    }
}

impl Drop for HixlEngine {
    fn drop(&mut self) {
        let mut err = CxxError::new();
        // SAFETY: `self.obj` is a constructed engine that nothing else references (`&mut self`);
        // the shim runs Finalize when it was initialized, then the destructor, then frees it.
        unsafe {
            shim::ferry_hixl_engine_delete(&self.lib.fns, self.obj.as_ptr(), i32::from(self.initialized), &mut err)
        };
        if let Some(what) = err.take() {
            tracing::warn!(api = %self.lib.api(), %what, "a C++ exception while finalizing a HIXL engine");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interior_nuls_are_an_error_naming_the_argument() {
        let e = c_string("hixl::Hixl::Connect", "the remote engine name", "10.0.0.1\0:20000").unwrap_err();
        assert!(e.is_param_invalid());
        assert_eq!(e.call(), "hixl::Hixl::Connect");
        assert_eq!(
            e.to_string(),
            "hixl::Hixl::Connect: invalid argument: the remote engine name \"10.0.0.1\\0:20000\" contains a NUL byte at offset 8"
        );
        assert_eq!(c_string("x", "y", "10.0.0.1:20000").unwrap().as_bytes(), b"10.0.0.1:20000");
    }

    #[test]
    fn handles_and_requests_print_their_engine() {
        let h = MemHandle { raw: 0x10, engine: 3 };
        assert_eq!(format!("{h:?}"), "MemHandle(0x10 of engine 3)");
        assert_eq!(h.raw(), 0x10);
        let r = TransferReq { raw: 0x20, engine: 4 };
        assert_eq!(format!("{r:?}"), "TransferReq(0x20 of engine 4)");
    }
}
