//! The only place this crate touches registered memory: byte slices over a leased region.

use ferry_core::Region;

/// The bytes `[addr, addr + len)` of `region`, or `None` when the range is not inside it.
pub(crate) fn bytes(region: &Region, addr: u64, len: u64) -> Option<&[u8]> {
    if !region.contains(addr, len) {
        return None;
    }
    // SAFETY: the range lies inside `region` (checked above). A registered region is its
    // owner's promise that `[addr, addr + len)` is valid, host-addressable memory until it is
    // unregistered, and the caller holds a lease on `region` (the borrow ties the slice to it),
    // which makes unregistration fail with `Busy` while the slice lives. Concurrent writes by
    // the owner to memory under transfer are the owner's race, as with any DMA engine.
    Some(unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len as usize) })
}

/// The bytes `[addr, addr + len)` of `region` for writing, or `None` when the range is not
/// inside it.
#[allow(clippy::mut_from_ref)] // the memory belongs to the region's owner, not to `region`
pub(crate) fn bytes_mut(region: &Region, addr: u64, len: u64) -> Option<&mut [u8]> {
    if !region.contains(addr, len) {
        return None;
    }
    // SAFETY: as in `bytes`: the range is inside a leased, registered region. Ferry's contract
    // (documented on `TransferEngine::submit`) is that callers do not run two transfers into
    // overlapping destination ranges at once; the memory is plain bytes, so even a caller who
    // breaks it gets interleaved bytes, never an invalid value.
    Some(unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut u8, len as usize) })
}
