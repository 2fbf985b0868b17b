//! Host memory allocated for an engine: [`HostAllocation`], what
//! [`Transport::allocate_host`](crate::Transport::allocate_host) and
//! [`TransferEngine::allocate_host_memory`](crate::TransferEngine::allocate_host_memory) return.
//!
//! Some transports can only move host memory that was allocated their way (the `ascend`
//! transport needs `aclrtMallocHost` memory: HCCL cannot register anything else with the
//! device). The core does not know how; a transport that does hands out a [`HostAllocation`]
//! carrying its own deallocator, and the engine falls back to [`HostAllocation::zeroed`] when
//! none of its transports offers one.
//!
//! **Lifetime.** Registering the memory stays the caller's job (and its `unsafe` promise).
//! What this type adds is that freeing cannot pull memory out from under a registration the
//! engine knows of: an allocation watches the memory registries it was handed out for
//! ([`watch`](HostAllocation::watch)); [`free`](HostAllocation::free) refuses with
//! [`ErrorKind::Busy`] while any of them still has a region overlapping it, and dropping it
//! then leaks the memory (with an error log) instead of freeing it.

use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::memory::{MemoryRegistry, Region};

/// Alignment of [`HostAllocation::zeroed`] memory: 64 KiB, a multiple of every page size Linux
/// uses (4 KiB on x86-64, up to 64 KiB on aarch64 kernels), so the memory is page-aligned
/// whatever the kernel.
pub const HOST_ALIGNMENT: usize = 64 << 10;

/// What frees an allocation; called once, from whichever thread drops or frees it.
type Deallocator = Box<dyn FnOnce() + Send + 'static>;

/// Host memory owned by this value: `len` bytes at `addr`, valid for reads and writes from any
/// thread until it is freed, zero-filled when handed out. Freed by [`free`](Self::free) or when
/// dropped, through the deallocator of whoever allocated it (a transport's, or the engine's
/// fallback) — unless a watched registry still has it registered, in which case it is kept
/// (see the [module documentation](self)).
///
/// The type exposes only the address: reading or writing the bytes is the caller's own
/// `unsafe` code, as it is for any registered memory (a transfer may touch them at any time).
pub struct HostAllocation {
    addr: u64,
    len: usize,
    origin: &'static str,
    free: Option<Deallocator>,
    watched: Vec<Arc<MemoryRegistry>>,
}

impl std::fmt::Debug for HostAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostAllocation")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl HostAllocation {
    /// Wraps memory a transport allocated. `origin` names the allocator for logs and errors
    /// (for example `"aclrtMallocHost"`); `free` releases the memory and is called exactly once,
    /// on whichever thread frees or drops this value (a transport whose allocator is bound to a
    /// thread hands the work to that thread from inside `free`).
    ///
    /// # Safety
    /// `[addr, addr + len)` must be host memory owned by the caller, zero-filled, valid for reads
    /// and writes from any thread until `free` runs, not freed by anything but `free`, and
    /// `len` must be non-zero.
    #[allow(unsafe_code)]
    pub unsafe fn new(addr: u64, len: usize, origin: &'static str, free: impl FnOnce() + Send + 'static) -> Self {
        Self { addr, len, origin, free: Some(Box::new(free)), watched: Vec::new() }
    }

    /// `len` zero-filled bytes aligned to [`HOST_ALIGNMENT`], from the process's allocator:
    /// the engine's fallback when no transport allocates host memory its own way. Large
    /// allocations are zeroed lazily by the system (they come from `calloc`, which maps fresh
    /// pages), so an untouched buffer costs no memory.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] for a zero `len` or one too large for the
    /// address space, [`ErrorKind::Internal`] when the allocator has no memory.
    #[allow(unsafe_code)]
    pub fn zeroed(len: usize) -> Result<Self> {
        use std::alloc::{GlobalAlloc, Layout, System};
        if len == 0 {
            return Err(Error::invalid("cannot allocate 0 bytes of host memory"));
        }
        // Alignment 1 keeps `System` on its `calloc` path (lazy zeroing); the slack leaves room
        // to start on a HOST_ALIGNMENT boundary.
        let layout = len
            .checked_add(HOST_ALIGNMENT - 1)
            .and_then(|total| Layout::from_size_align(total, 1).ok())
            .ok_or_else(|| Error::invalid(format!("{len} bytes of host memory cannot be allocated")))?;
        // SAFETY: `layout` has a non-zero size.
        let base = unsafe { System.alloc_zeroed(layout) };
        if base.is_null() {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("out of memory allocating {len} bytes of host memory"),
            ));
        }
        let offset = base.align_offset(HOST_ALIGNMENT);
        debug_assert!(offset < HOST_ALIGNMENT);
        let addr = base as u64 + offset as u64;
        // The pointer travels as an integer so the deallocator is `Send`.
        let base_addr = base as usize;
        let free = move || {
            // SAFETY: `base_addr` came from `System.alloc_zeroed(layout)` above and is freed
            // once (a deallocator runs once).
            unsafe { System.dealloc(base_addr as *mut u8, layout) }
        };
        // SAFETY: `[addr, addr + len)` lies inside the fresh zeroed allocation (`offset` plus
        // `len` is at most its size), owned by this value alone until `free` runs.
        Ok(unsafe { Self::new(addr, len, "the process allocator", free) })
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes (never zero).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (zero-length allocations are refused). Present for clippy's
    /// `len_without_is_empty` convention.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Who allocated it (`"aclrtMallocHost"`, `"the process allocator"`, ...).
    pub fn origin(&self) -> &'static str {
        self.origin
    }

    /// Refuses to free this memory while `registry` has a region overlapping it (the engine
    /// that hands an allocation out watches its own registry).
    pub fn watch(&mut self, registry: Arc<MemoryRegistry>) {
        if !self.watched.iter().any(|r| Arc::ptr_eq(r, &registry)) {
            self.watched.push(registry);
        }
    }

    /// A registered region overlapping this memory in one of the watched registries, if any.
    pub fn registered(&self) -> Option<Region> {
        self.watched.iter().find_map(|r| r.overlapping(self.addr, self.len as u64))
    }

    /// Frees the memory now. Fails with [`ErrorKind::Busy`] while a watched registry still has
    /// it registered (unregister it first): the allocation is then handed back, untouched.
    #[allow(clippy::result_large_err)]
    pub fn free(mut self) -> std::result::Result<(), (HostAllocation, Error)> {
        if let Some(region) = self.registered() {
            let e = Error::new(
                ErrorKind::Busy,
                format!(
                    "host memory {:#x}+{} is still registered (region {:#x}+{}); unregister it before freeing it",
                    self.addr,
                    self.len,
                    region.addr(),
                    region.len()
                ),
            );
            return Err((self, e));
        }
        if let Some(free) = self.free.take() {
            free();
        }
        Ok(())
    }
}

impl Drop for HostAllocation {
    fn drop(&mut self) {
        let Some(free) = self.free.take() else { return };
        if let Some(region) = self.registered() {
            tracing::error!(
                addr = self.addr,
                len = self.len,
                region = region.addr(),
                "host memory dropped while still registered: leaked rather than freed (unregister it before dropping it)"
            );
            // Leaking the deallocator (and whatever it owns) keeps the memory allocated.
            std::mem::forget(free);
            return;
        }
        free();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::memory::Location;

    #[test]
    fn zeroed_memory_is_aligned_and_zero() {
        for len in [1, 4095, HOST_ALIGNMENT + 1, 3 << 20] {
            let a = HostAllocation::zeroed(len).unwrap();
            assert_eq!(a.addr() % HOST_ALIGNMENT as u64, 0, "{len}");
            assert_eq!(a.len(), len);
            #[allow(unsafe_code)]
            // SAFETY: the allocation owns `len` readable bytes and nothing else touches them.
            let bytes = unsafe { std::slice::from_raw_parts(a.addr() as *const u8, len) };
            assert!(bytes.iter().all(|&b| b == 0), "{len}");
        }
        assert_eq!(HostAllocation::zeroed(0).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(HostAllocation::zeroed(usize::MAX).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }

    fn counted(frees: &Arc<AtomicUsize>) -> HostAllocation {
        let f = frees.clone();
        // SAFETY: the test never touches the (fake) address.
        #[allow(unsafe_code)]
        unsafe {
            HostAllocation::new(0x10_000, 4096, "test", move || {
                f.fetch_add(1, Ordering::SeqCst);
            })
        }
    }

    #[test]
    fn freeing_is_refused_while_a_watched_registry_has_it() {
        let frees = Arc::new(AtomicUsize::new(0));
        let registry = Arc::new(MemoryRegistry::new());
        let mut a = counted(&frees);
        a.watch(registry.clone());
        a.watch(registry.clone());
        // A region sharing only the last byte still counts.
        #[allow(unsafe_code)]
        // SAFETY: the registry is never used to touch memory here.
        unsafe { registry.register(0x10_000 + 4095, 10, Location::Cpu(0)) }.unwrap();
        let (a, e) = a.free().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Busy);
        assert!(e.message().contains("still registered"), "{e}");
        assert_eq!(frees.load(Ordering::SeqCst), 0);
        registry.unregister(0x10_000 + 4095).unwrap();
        a.free().unwrap();
        assert_eq!(frees.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn dropping_frees_unless_registered() {
        let frees = Arc::new(AtomicUsize::new(0));
        drop(counted(&frees));
        assert_eq!(frees.load(Ordering::SeqCst), 1);
        let registry = Arc::new(MemoryRegistry::new());
        let mut a = counted(&frees);
        a.watch(registry.clone());
        #[allow(unsafe_code)]
        // SAFETY: as above.
        unsafe { registry.register(0x10_000, 4096, Location::Cpu(0)) }.unwrap();
        drop(a);
        assert_eq!(frees.load(Ordering::SeqCst), 1, "leaked, not freed, while registered");
    }

    #[test]
    fn overlap_lookup() {
        let registry = MemoryRegistry::new();
        #[allow(unsafe_code)]
        // SAFETY: as above.
        unsafe { registry.register(100, 10, Location::Cpu(0)) }.unwrap();
        assert!(registry.overlapping(90, 10).is_none());
        assert!(registry.overlapping(90, 11).is_some());
        assert!(registry.overlapping(109, 1).is_some());
        assert!(registry.overlapping(110, 5).is_none());
        assert!(registry.overlapping(0, u64::MAX).is_some());
        assert!(registry.overlapping(105, 0).is_none());
    }
}
