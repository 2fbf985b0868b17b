//! Opaque handles (`aclrtStream`, `aclrtContext`, `HcclComm`, memory handles).
//!
//! A handle is never a pointer to emulator memory: it is a tagged number looked up in a
//! registry, so a stale, foreign or forged handle is an error code, never a dereference.
//! Layout: bits 40..48 hold the kind's tag, bits 0..40 a process-wide counter.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

/// Kinds of handles, each with its own tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `aclrtStream`.
    Stream = 0x51,
    /// `aclrtContext`.
    Context = 0xc7,
    /// `HcclComm`.
    Comm = 0xcc,
    /// Handle of `HcclRegisterGlobalMem`.
    #[cfg_attr(not(feature = "onesided"), allow(dead_code))]
    GlobalMem = 0x3e,
}

const TAG_SHIFT: u32 = 40;
const COUNTER_MASK: u64 = (1 << TAG_SHIFT) - 1;

/// A new handle value of `kind`.
pub(crate) fn new_handle(kind: Kind) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed) & COUNTER_MASK;
    ((kind as u64) << TAG_SHIFT) | n.max(1)
}

/// The C value of a handle.
pub(crate) fn to_ptr(handle: u64) -> *mut c_void {
    handle as usize as *mut c_void
}

/// The handle value of a C pointer if it carries `kind`'s tag.
pub(crate) fn from_ptr(kind: Kind, ptr: *const c_void) -> Option<u64> {
    let v = ptr as usize as u64;
    (v >> TAG_SHIFT == kind as u64 && v & COUNTER_MASK != 0).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_keep_their_kind() {
        let h = new_handle(Kind::Stream);
        assert_eq!(from_ptr(Kind::Stream, to_ptr(h)), Some(h));
        assert_eq!(from_ptr(Kind::Comm, to_ptr(h)), None);
        assert_eq!(from_ptr(Kind::Stream, std::ptr::null()), None);
        assert_ne!(new_handle(Kind::Stream), h);
    }
}
