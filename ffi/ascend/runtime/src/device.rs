//! Thread-bound device state: [`Device`] (a thread on which `aclrtSetDevice` succeeded),
//! [`Stream`] and [`DeviceBuffer`]. None of them is `Send`: ACL keeps device and context
//! state per thread, so each lives and dies on the thread that made it.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use ferry_ascend_sys::{Library, raw};

use crate::error::{AscendError, Checks, Result};

/// Makes a type `!Send` and `!Sync`.
type ThreadBound = PhantomData<*const ()>;

/// This thread, bound to one device with `aclrtSetDevice`. Not `Send`: it stays on the thread
/// it was made on, and so does everything created through it.
pub struct Device {
    lib: Arc<Library>,
    user_id: u32,
    _bound: ThreadBound,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("user_id", &self.user_id).finish()
    }
}

impl Device {
    /// Initialises ACL if needed and binds the calling thread to user device `user_id` (the
    /// index after `ASCEND_RT_VISIBLE_DEVICES` filtering).
    pub fn bind(lib: &Arc<Library>, user_id: u32) -> Result<Device> {
        lib.init()?;
        let id = i32::try_from(user_id).map_err(|_| AscendError::InvalidArgument(format!("device id {user_id}")))?;
        // SAFETY: plain integer argument.
        let code = unsafe { (lib.acl().set_device)(id) };
        lib.acl_check("aclrtSetDevice", code)?;
        Ok(Device { lib: lib.clone(), user_id, _bound: PhantomData })
    }

    /// The user device id this thread is bound to.
    pub fn user_id(&self) -> u32 {
        self.user_id
    }

    /// The library.
    pub fn library(&self) -> &Arc<Library> {
        &self.lib
    }

    /// `aclrtGetDevice` on this thread (a user id: 0 for the first visible device, whatever
    /// its physical id).
    pub fn current(&self) -> Result<i32> {
        let mut id = -1;
        // SAFETY: `id` is a valid out-pointer.
        let code = unsafe { (self.lib.acl().get_device)(&mut id) };
        self.lib.acl_check("aclrtGetDevice", code)?;
        Ok(id)
    }

    /// Creates a stream on this device.
    pub fn create_stream(&self) -> Result<Stream> {
        let mut s: raw::AclrtStream = std::ptr::null_mut();
        // SAFETY: `s` is a valid out-pointer.
        let code = unsafe { (self.lib.acl().create_stream)(&mut s) };
        self.lib.acl_check("aclrtCreateStream", code)?;
        Ok(Stream { lib: self.lib.clone(), raw: s, _bound: PhantomData })
    }

    /// Allocates `len` bytes of device memory (`aclrtMalloc`, huge pages first).
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        self.alloc_with_policy(len, raw::malloc_policy::HUGE_FIRST)
    }

    /// Allocates `len` bytes of device memory in huge pages only
    /// (`ACL_MEM_MALLOC_HUGE_ONLY`): it starts on a 2 MiB boundary, as memory shared with
    /// another rank of the same server over HCCS IPC must.
    pub fn alloc_huge(&self, len: usize) -> Result<DeviceBuffer> {
        self.alloc_with_policy(len, raw::malloc_policy::HUGE_ONLY)
    }

    fn alloc_with_policy(&self, len: usize, policy: i32) -> Result<DeviceBuffer> {
        if len == 0 {
            return Err(AscendError::InvalidArgument("zero-length device allocation".into()));
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; `policy` is one of ACL's memory policies.
        let code = unsafe { (self.lib.acl().malloc)(&mut p, len, policy) };
        self.lib.acl_check("aclrtMalloc", code)?;
        Ok(DeviceBuffer { lib: self.lib.clone(), ptr: p, len, _bound: PhantomData })
    }

    /// Allocates `len` bytes of host memory the device can register (`aclrtMallocHost`): what
    /// HCCL's one-sided service needs of host memory. [`AscendError::Unavailable`] when the
    /// release lacks the call.
    pub fn alloc_host(&self, len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Err(AscendError::InvalidArgument("zero-length host allocation".into()));
        }
        let (Some(malloc), Some(free)) = (self.lib.optional().malloc_host, self.lib.optional().free_host) else {
            return Err(AscendError::Unavailable {
                symbol: "aclrtMallocHost",
                purpose: "allocating pinned host memory",
            });
        };
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer.
        let code = unsafe { malloc(&mut p, len) };
        self.lib.acl_check("aclrtMallocHost", code)?;
        Ok(HostBuffer { lib: self.lib.clone(), free, ptr: p, len })
    }

    /// What `aclrtPointerGetAttributes` says of the memory at `addr`, `None` when this
    /// release lacks the call.
    pub fn pointer_kind(&self, addr: u64) -> Result<Option<PointerKind>> {
        Ok(self.pointer_attributes(addr)?.map(|(id, ty)| match ty {
            raw::mem_location::DEVICE => PointerKind::Device(id),
            raw::mem_location::HOST => PointerKind::PinnedHost,
            _ => PointerKind::OtherHost,
        }))
    }

    /// `aclrtMemcpy` of `len` bytes from `src` to `dst` with copy kind `kind`
    /// ([`raw::memcpy_kind`]): staging host memory through device memory, for example.
    ///
    /// # Safety
    /// Both ranges must be valid memory of the kinds `kind` names, `dst` writable and not
    /// accessed by anyone else during the copy.
    pub unsafe fn copy(&self, dst: u64, src: u64, len: u64, kind: i32) -> Result<()> {
        let n = usize::try_from(len).map_err(|_| AscendError::InvalidArgument(format!("copy of {len} bytes")))?;
        // SAFETY: the caller vouches for both ranges.
        let code = unsafe { (self.lib.acl().memcpy)(dst as *mut c_void, n, src as *const c_void, n, kind) };
        self.lib.acl_check("aclrtMemcpy", code)
    }

    /// The device of the memory at `addr` per `aclrtPointerGetAttributes` (id, memory type), or
    /// `None` when this CANN release cannot tell.
    pub fn pointer_attributes(&self, addr: u64) -> Result<Option<(u32, i32)>> {
        let Some(f) = self.lib.optional().pointer_attributes else { return Ok(None) };
        let mut attr = raw::AclrtPtrAttributes::default();
        // SAFETY: the runtime only inspects the address value; `attr` is a valid out-pointer.
        let code = unsafe { f(addr as *const c_void, &mut attr) };
        self.lib.acl_check("aclrtPointerGetAttributes", code)?;
        Ok(Some((attr.id, attr.mem_type)))
    }
}

/// Where memory lives, per `aclrtPointerGetAttributes` (`aclrtMemLocationType`: HOST 0,
/// DEVICE 1, UNREGISTERED 2, and newer values; CANN runtime `acl_rt.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointerKind {
    /// Device memory of the user device with this id.
    Device(u32),
    /// Host memory from `aclrtMallocHost` (the device can register it).
    PinnedHost,
    /// Any other host memory (`malloc`, the stack, a mapping): HCCL cannot register it with
    /// the device (`aclrtHostRegister` refuses it).
    OtherHost,
}

/// An ACL stream; destroyed when dropped (on its thread).
pub struct Stream {
    lib: Arc<Library>,
    raw: raw::AclrtStream,
    _bound: ThreadBound,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("raw", &self.raw).finish()
    }
}

impl Stream {
    pub(crate) fn raw(&self) -> raw::AclrtStream {
        self.raw
    }

    /// Waits until everything queued on the stream ran and returns its first error. With a
    /// `timeout`, uses `aclrtSynchronizeStreamWithTimeout` when the release has it (else the
    /// wait is unbounded, `aclrtSynchronizeStream`).
    pub fn synchronize(&self, timeout: Option<Duration>) -> Result<()> {
        match (timeout, self.lib.optional().sync_with_timeout) {
            (Some(t), Some(f)) => {
                let ms = i32::try_from(t.as_millis()).unwrap_or(i32::MAX).max(1);
                // SAFETY: `raw` is a live stream of this thread.
                let code = unsafe { f(self.raw, ms) };
                self.lib.acl_check("aclrtSynchronizeStreamWithTimeout", code)
            }
            _ => {
                // SAFETY: `raw` is a live stream of this thread.
                let code = unsafe { (self.lib.acl().synchronize_stream)(self.raw) };
                self.lib.acl_check("aclrtSynchronizeStream", code)
            }
        }
    }

    /// Polls the stream (`aclrtStreamQuery`) until everything queued on it finished, for at
    /// most `spin`, without sleeping: true once it finished (its outcome is then the next
    /// [`synchronize`](Self::synchronize)'s, which returns at once), false when `spin` passed
    /// first, or the release cannot say (it lacks the call, or refuses it: CANN 8.0 documents
    /// it for inference parts only). A caller that would otherwise sleep in a synchronize and be
    /// woken by the device spends the wait awake instead.
    pub fn poll_complete(&self, spin: Duration) -> bool {
        let Some(query) = self.lib.optional().stream_query else { return false };
        let until = std::time::Instant::now() + spin;
        loop {
            let mut status = raw::ACL_STREAM_STATUS_NOT_READY;
            // SAFETY: `raw` is a live stream of this device's context; `status` is a valid
            // out-pointer.
            let code = unsafe { query(self.raw, &mut status) };
            if code != 0 {
                return false;
            }
            if status == raw::ACL_STREAM_STATUS_COMPLETE {
                return true;
            }
            if std::time::Instant::now() >= until {
                return false;
            }
            std::hint::spin_loop();
        }
    }

    /// Aborts the work queued on the stream (`aclrtStreamAbort`: the running task is stopped,
    /// the queued ones are discarded), then clears the `ACL_ERROR_RT_STREAM_ABORT` the abort
    /// leaves for the next synchronize. Returns true only when the release has the function
    /// **and** it succeeded; false means the stream's work may still be running.
    pub fn abort(&self) -> bool {
        let Some(f) = self.lib.optional().stream_abort else { return false };
        // SAFETY: `raw` is a live stream of this thread.
        let code = unsafe { f(self.raw) };
        if code != 0 {
            let e = self.lib.acl_check("aclrtStreamAbort", code).err();
            tracing::warn!(code, error = ?e, "aclrtStreamAbort failed; the stream will be drained instead");
            return false;
        }
        // SAFETY: as above; after a successful abort nothing is left to run, so this returns
        // at once (with the abort's own error, which is dropped).
        let _ = unsafe { (self.lib.acl().synchronize_stream)(self.raw) };
        true
    }

    /// Makes sure nothing queued on the stream runs any more, so that the memory its
    /// operations name may be freed or handed back: [`abort`](Self::abort) when the release
    /// has `aclrtStreamAbort` and it succeeds, else an **unbounded** `aclrtSynchronizeStream`
    /// (on hardware every HCCL operation is bounded by HCCL's own `HCCL_EXEC_TIMEOUT`, and
    /// copies by the runtime's task timeout). Call it before dropping a stream or memory its
    /// work may still touch after a failed or timed-out wait: CANN requires a stream's work to
    /// be finished before `aclrtDestroyStream`.
    pub fn drain(&self) -> Drained {
        if self.abort() {
            return Drained::Aborted;
        }
        // SAFETY: `raw` is a live stream of this thread.
        let code = unsafe { (self.lib.acl().synchronize_stream)(self.raw) };
        Drained::Finished(self.lib.acl_check("aclrtSynchronizeStream", code))
    }
}

/// How [`Stream::drain`] stopped a stream's work.
#[derive(Debug)]
pub enum Drained {
    /// `aclrtStreamAbort` stopped it.
    Aborted,
    /// Everything queued ran to its end; the first error of those operations, if any (the
    /// stream is idle either way).
    Finished(Result<()>),
}

// SAFETY: a stream is an ACL handle and an `Arc<Library>`: a thread with the stream's context
// current may use it (CANN `aclrtSetCurrentContext` restrictions), one at a time.
unsafe impl crate::worker::ContextShared for Stream {}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: `raw` is a live stream created on this thread (the type is not Send) and is
        // not used after this.
        let code = unsafe { (self.lib.acl().destroy_stream)(self.raw) };
        if code != 0 {
            tracing::debug!(code, "aclrtDestroyStream failed");
        }
    }
}

/// Device memory from `aclrtMalloc`; freed when dropped (on its thread).
pub struct DeviceBuffer {
    lib: Arc<Library>,
    ptr: *mut c_void,
    len: usize,
    _bound: ThreadBound,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer").field("addr", &self.ptr).field("len", &self.len).finish()
    }
}

impl DeviceBuffer {
    /// Device address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (zero-length allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `data` to byte `offset` of the buffer (host to device).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        let end = offset.checked_add(data.len()).filter(|&e| e <= self.len);
        if end.is_none() {
            return Err(AscendError::InvalidArgument(format!(
                "write of {} bytes at {offset} runs past a {}-byte device buffer",
                data.len(),
                self.len
            )));
        }
        // SAFETY: the destination range lies inside this live allocation (checked above) and
        // the source is a valid slice.
        let code = unsafe {
            (self.lib.acl().memcpy)(
                self.ptr.cast::<u8>().add(offset).cast(),
                self.len - offset,
                data.as_ptr().cast(),
                data.len(),
                raw::memcpy_kind::HOST_TO_DEVICE,
            )
        };
        self.lib.acl_check("aclrtMemcpy", code)
    }

    /// Copies bytes from `offset` of the buffer into `out` (device to host).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(out.len()).filter(|&e| e <= self.len);
        if end.is_none() {
            return Err(AscendError::InvalidArgument(format!(
                "read of {} bytes at {offset} runs past a {}-byte device buffer",
                out.len(),
                self.len
            )));
        }
        // SAFETY: the source range lies inside this live allocation (checked above) and the
        // destination is a valid mutable slice of `out.len()` bytes.
        let code = unsafe {
            (self.lib.acl().memcpy)(
                out.as_mut_ptr().cast(),
                out.len(),
                self.ptr.cast::<u8>().add(offset).cast(),
                out.len(),
                raw::memcpy_kind::DEVICE_TO_HOST,
            )
        };
        self.lib.acl_check("aclrtMemcpy", code)
    }
}

/// Host memory from `aclrtMallocHost`; freed with `aclrtFreeHost` when dropped.
pub struct HostBuffer {
    lib: Arc<Library>,
    free: raw::AclrtFree,
    ptr: *mut c_void,
    len: usize,
}

// SAFETY: host memory is not tied to a thread; the pointer is owned by this value alone and
// freed once, in `drop`.
unsafe impl Send for HostBuffer {}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer").field("addr", &self.ptr).field("len", &self.len).finish()
    }
}

impl HostBuffer {
    /// First byte.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (zero-length allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live allocation of `len` bytes owned by this value.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from aclrtMallocHost and is freed once.
        let code = unsafe { (self.free)(self.ptr) };
        if code != 0 {
            tracing::debug!(code, "aclrtFreeHost failed");
        }
        let _ = &self.lib;
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from aclrtMalloc on this thread's device and is freed once.
        let code = unsafe { (self.lib.acl().free)(self.ptr) };
        if code != 0 {
            tracing::debug!(code, "aclrtFree failed");
        }
    }
}
