//! Emulated device memory and ACL host memory: host allocations tracked per device.
//!
//! Every allocation is kept in a registry ordered by address, so the emulator can tell whether
//! an address range lies inside emulated device memory (memcpy kinds, HCCL buffers, pointer
//! attributes). An allocation is reference-counted: `aclrtFree` removes it from the registry and
//! the per-device accounting at once, but the bytes are released only when nothing that uses
//! them (a queued copy, a registered global memory) still holds them, so the emulator itself
//! never touches freed memory.

use std::alloc::Layout;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, LazyLock, Mutex, RwLock};

use crate::boundary::{lock, read, write};
use crate::codes::*;

/// Alignment of every allocation (a page; CANN aligns device memory at least this much).
const ALIGN: usize = 4096;
/// Capacity of one emulated device (an Ascend 910B card has 64 GiB of HBM).
pub(crate) const DEVICE_CAPACITY: u64 = 64 << 30;
/// Page size reported for huge-page allocations.
const HUGE_PAGE: u32 = 2 << 20;

/// Where an allocation lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemKind {
    /// Emulated device memory (`aclrtMalloc`).
    Device {
        /// The user id the allocating thread had set.
        user_id: u32,
        /// Its physical id.
        physical_id: u32,
    },
    /// ACL host memory (`aclrtMallocHost`).
    Host,
}

/// One allocation.
#[derive(Debug)]
pub(crate) struct Allocation {
    pub(crate) base: usize,
    pub(crate) size: usize,
    pub(crate) kind: MemKind,
    pub(crate) page_size: u32,
    layout: Layout,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: `base` was returned by `alloc_zeroed(self.layout)` and is released only here,
        // once, when the last reference to the allocation goes away.
        unsafe { std::alloc::dealloc(self.base as *mut u8, self.layout) }
    }
}

impl Allocation {
    /// Whether `[addr, addr + len)` lies inside this allocation.
    pub(crate) fn contains(&self, addr: usize, len: usize) -> bool {
        let end = self.base + self.size;
        addr >= self.base && addr.checked_add(len).is_some_and(|e| e <= end) && (len > 0 || addr <= end)
    }
}

static ALLOCATIONS: LazyLock<RwLock<BTreeMap<usize, Arc<Allocation>>>> = LazyLock::new(Default::default);
static DEVICE_USED: LazyLock<Mutex<HashMap<u32, u64>>> = LazyLock::new(Default::default);

fn allocate(size: usize, kind: MemKind, page_size: u32) -> EmuResult<Arc<Allocation>> {
    // Huge-page allocations start on a huge page, as the device allocator's do.
    let layout = Layout::from_size_align(size, ALIGN.max(page_size as usize))
        .map_err(|_| err(ACL_ERROR_RT_MEMORY_ALLOCATION, format!("cannot allocate {size} bytes")))?;
    // SAFETY: `layout` has a non-zero size (callers refuse size 0) and a valid alignment.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return Err(err(ACL_ERROR_RT_MEMORY_ALLOCATION, format!("host allocation of {size} bytes failed")));
    }
    let a = Arc::new(Allocation { base: p as usize, size, kind, page_size, layout });
    write(&ALLOCATIONS).insert(a.base, Arc::clone(&a));
    Ok(a)
}

/// `aclrtMalloc` on the device of `user_id`/`physical_id`.
pub(crate) fn alloc_device(user_id: u32, physical_id: u32, size: usize, policy: i32) -> EmuResult<usize> {
    if size == 0 {
        return Err(err(ACL_ERROR_INVALID_PARAM, "aclrtMalloc: size must not be 0"));
    }
    if !(0..=5).contains(&(policy & 0xff)) {
        return Err(err(ACL_ERROR_INVALID_PARAM, format!("aclrtMalloc: unknown memory policy {policy}")));
    }
    {
        let mut used = lock(&DEVICE_USED);
        let u = used.entry(physical_id).or_insert(0);
        if u.saturating_add(size as u64) > DEVICE_CAPACITY {
            return Err(err(
                ACL_ERROR_RT_MEMORY_ALLOCATION,
                format!(
                    "aclrtMalloc: device {user_id} (physical {physical_id}) is out of memory: {} of {DEVICE_CAPACITY} bytes in use, {size} requested",
                    *u
                ),
            ));
        }
        *u += size as u64;
    }
    // HUGE_ONLY (1, and its P2P variant 4) always takes huge pages; HUGE_FIRST (0, 3) does for
    // 1 MiB and more; NORMAL_ONLY (2, 5) never does (CANN `aclrtMemMallocPolicy`).
    let huge = match policy & 0xff {
        1 | 4 => true,
        2 | 5 => false,
        _ => size >= (1 << 20),
    };
    match allocate(size, MemKind::Device { user_id, physical_id }, if huge { HUGE_PAGE } else { 4096 }) {
        Ok(a) => Ok(a.base),
        Err(e) => {
            if let Some(u) = lock(&DEVICE_USED).get_mut(&physical_id) {
                *u = u.saturating_sub(size as u64);
            }
            Err(e)
        }
    }
}

/// `aclrtMallocHost`.
pub(crate) fn alloc_host(size: usize) -> EmuResult<usize> {
    if size == 0 {
        return Err(err(ACL_ERROR_INVALID_PARAM, "aclrtMallocHost: size must not be 0"));
    }
    allocate(size, MemKind::Host, 4096).map(|a| a.base)
}

/// `aclrtFree` (`device == true`) or `aclrtFreeHost`: `ptr` must be the start of an allocation
/// of that kind.
pub(crate) fn free(ptr: usize, device: bool) -> EmuResult<()> {
    let name = if device { "aclrtFree" } else { "aclrtFreeHost" };
    let mut all = write(&ALLOCATIONS);
    let Some(a) = all.get(&ptr) else {
        return Err(err(ACL_ERROR_INVALID_PARAM, format!("{name}: {ptr:#x} was not returned by the allocator")));
    };
    match (a.kind, device) {
        (MemKind::Device { physical_id, .. }, true) => {
            if let Some(u) = lock(&DEVICE_USED).get_mut(&physical_id) {
                *u = u.saturating_sub(a.size as u64);
            }
        }
        (MemKind::Host, false) => {}
        (MemKind::Device { .. }, false) => {
            return Err(err(ACL_ERROR_INVALID_PARAM, format!("{name}: {ptr:#x} is device memory (use aclrtFree)")));
        }
        (MemKind::Host, true) => {
            return Err(err(ACL_ERROR_INVALID_PARAM, format!("{name}: {ptr:#x} is host memory (use aclrtFreeHost)")));
        }
    }
    all.remove(&ptr);
    Ok(())
}

/// The allocation containing `[addr, addr + len)`, if any.
pub(crate) fn find(addr: usize, len: usize) -> Option<Arc<Allocation>> {
    let all = read(&ALLOCATIONS);
    let (_, a) = all.range(..=addr).next_back()?;
    a.contains(addr, len).then(|| Arc::clone(a))
}

/// The emulated *device* allocation containing `[addr, addr + len)`, if any.
pub(crate) fn find_device(addr: usize, len: usize) -> Option<Arc<Allocation>> {
    find(addr, len).filter(|a| matches!(a.kind, MemKind::Device { .. }))
}

/// Whether `addr` points into emulated device memory.
pub(crate) fn is_device(addr: usize) -> bool {
    find_device(addr, 1).is_some()
}

/// Alignment `aclrtHostRegister` requires of the host address: "Host内存地址需4KB页对齐" (runtime
/// `docs/zh/api_ref/11-02_host_memory_management.md`, aclrtHostRegister, parameter `ptr`).
pub(crate) const HOST_REGISTER_ALIGN: usize = 4096;

/// One `aclrtHostRegister` mapping: the registered range keeps its `aclrtMallocHost` allocation
/// alive, so the emulator never reads memory that was freed while registered.
#[derive(Debug)]
struct HostRegistration {
    size: usize,
    _keep: Arc<Allocation>,
}

/// Registrations by (user device id, start address).
static HOST_REGISTRATIONS: LazyLock<Mutex<BTreeMap<(u32, usize), HostRegistration>>> = LazyLock::new(Default::default);

/// `aclrtHostRegister`'s driver side on user device `user_id`: `[ptr, ptr + size)` must be
/// 4 KiB aligned and lie inside one `aclrtMallocHost` allocation (the emulator keeps the rule
/// for kernels up to 5.10 and HIXL's documented contract; docs/research/cann-citations.md rules 5
/// and 13), else [`ACL_ERROR_RT_DRV_INTERNAL_ERROR`] (the code real registrations were seen to
/// fail with). A range overlapping a registration on the same device gives
/// [`ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED`].
pub(crate) fn host_register(user_id: u32, ptr: usize, size: usize) -> EmuResult<()> {
    if !ptr.is_multiple_of(HOST_REGISTER_ALIGN) {
        return Err(err(
            ACL_ERROR_RT_DRV_INTERNAL_ERROR,
            format!("aclrtHostRegister: host address {ptr:#x} is not 4 KB page aligned"),
        ));
    }
    let a = find(ptr, size).filter(|a| a.kind == MemKind::Host).ok_or_else(|| {
        err(
            ACL_ERROR_RT_DRV_INTERNAL_ERROR,
            format!(
                "aclrtHostRegister: {ptr:#x}..+{size} is not inside one aclrtMallocHost allocation (the emulator \
                 registers pinned host memory only, as CANN requires on kernels up to 5.10 and HIXL requires always)"
            ),
        )
    })?;
    let end = ptr + size;
    let mut all = lock(&HOST_REGISTRATIONS);
    let before = all.range((user_id, 0)..=(user_id, ptr)).next_back().filter(|((_, b), r)| b + r.size > ptr);
    let after = all.range((user_id, ptr)..=(user_id, usize::MAX)).next().filter(|((_, b), _)| *b < end);
    if let Some(((_, b), r)) = before.or(after) {
        return Err(err(
            ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
            format!(
                "aclrtHostRegister: {ptr:#x}..+{size} overlaps the range {b:#x}..+{} already registered on device {user_id}",
                r.size
            ),
        ));
    }
    all.insert((user_id, ptr), HostRegistration { size, _keep: a });
    Ok(())
}

/// `aclrtHostUnregister` on user device `user_id`: `ptr` must be the start of a registration
/// there, else [`ACL_ERROR_HOST_MEMORY_NOT_REGISTERED`].
pub(crate) fn host_unregister(user_id: u32, ptr: usize) -> EmuResult<()> {
    lock(&HOST_REGISTRATIONS).remove(&(user_id, ptr)).map(|_| ()).ok_or_else(|| {
        err(
            ACL_ERROR_HOST_MEMORY_NOT_REGISTERED,
            format!("aclrtHostUnregister: {ptr:#x} is not the start of a range registered on device {user_id}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked_against_the_allocation() {
        let base = alloc_device(0, 0, 8192, 0).unwrap();
        let a = find_device(base, 8192).unwrap();
        assert!(a.contains(base + 4096, 4096));
        assert!(!a.contains(base + 4096, 4097));
        assert!(!a.contains(base.wrapping_sub(1), 2));
        assert!(find_device(base + 8000, 193).is_none());
        assert!(find_device(usize::MAX - 3, 8).is_none());
        assert!(is_device(base + 8191));
        free(base, true).unwrap();
        assert!(find(base, 1).is_none());
        assert_eq!(free(base, true).unwrap_err().code, ACL_ERROR_INVALID_PARAM);
    }

    #[test]
    fn host_and_device_frees_do_not_mix() {
        let h = alloc_host(100).unwrap();
        assert_eq!(free(h, true).unwrap_err().code, ACL_ERROR_INVALID_PARAM);
        free(h, false).unwrap();
        assert_eq!(alloc_device(0, 0, 0, 0).unwrap_err().code, ACL_ERROR_INVALID_PARAM);
        assert_eq!(alloc_device(0, 0, 1, 9).unwrap_err().code, ACL_ERROR_INVALID_PARAM);
    }

    #[test]
    fn a_device_has_a_capacity() {
        let e = alloc_device(0, 999, (DEVICE_CAPACITY + 1) as usize, 0).unwrap_err();
        assert_eq!(e.code, ACL_ERROR_RT_MEMORY_ALLOCATION);
        assert!(e.message.contains("out of memory"), "{}", e.message);
    }
}
