//! The C ABI of `cpp/hixl_shim.cpp` (keep the two in step: the layout test below checks the
//! sizes the shim was compiled with).

use std::ffi::{c_char, c_void};

/// The resolved addresses (`FerryHixlFns`); the last three may be null.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fns {
    pub(crate) string_ctor: *const c_void,
    pub(crate) string_less: *const c_void,
    pub(crate) engine_ctor: *const c_void,
    pub(crate) engine_dtor: *const c_void,
    pub(crate) initialize: *const c_void,
    pub(crate) finalize: *const c_void,
    pub(crate) register_mem: *const c_void,
    pub(crate) deregister_mem: *const c_void,
    pub(crate) connect: *const c_void,
    pub(crate) disconnect: *const c_void,
    pub(crate) transfer_sync: *const c_void,
    pub(crate) transfer_async: *const c_void,
    pub(crate) get_transfer_status: *const c_void,
    pub(crate) get_capability: *const c_void,
}

/// A C++ exception the shim caught (`FerryHixlError`).
#[repr(C)]
pub(crate) struct CxxError {
    pub(crate) thrown: i32,
    pub(crate) what: [c_char; 256],
}

impl CxxError {
    pub(crate) fn new() -> Self {
        Self { thrown: 0, what: [0; 256] }
    }

    /// The exception's text, when one was thrown.
    pub(crate) fn take(&self) -> Option<String> {
        if self.thrown == 0 {
            return None;
        }
        let bytes: Vec<u8> = self.what.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// `MemDesc` (144 bytes; `local_only` is `hixl::MemDesc`'s, a reserved byte for `adxl::`).
#[repr(C)]
pub(crate) struct MemDesc {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) local_only: u8,
    pub(crate) reserved: [u8; 127],
}

/// The sizes the shim was compiled with (`FerryHixlLayout`).
#[cfg(test)]
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) ascend_string: usize,
    pub(crate) options_map: usize,
    pub(crate) op_desc_vector: usize,
    pub(crate) mem_desc: usize,
    pub(crate) op_desc: usize,
    pub(crate) transfer_args: usize,
    pub(crate) engine_alloc: usize,
}

// Every function is `noexcept` on the C++ side: C++ exceptions are caught there and reported
// through the `CxxError` argument.
unsafe extern "C" {
    #[cfg(test)]
    pub(crate) fn ferry_hixl_layout(out: *mut Layout);
    pub(crate) fn ferry_hixl_engine_new(fns: *const Fns, engine: *mut *mut c_void, err: *mut CxxError) -> u32;
    pub(crate) fn ferry_hixl_engine_delete(
        fns: *const Fns,
        engine: *mut c_void,
        finalize_first: i32,
        err: *mut CxxError,
    );
    pub(crate) fn ferry_hixl_initialize(
        fns: *const Fns,
        engine: *mut c_void,
        local_engine: *const c_char,
        keys: *const *const c_char,
        values: *const *const c_char,
        n_options: usize,
        err: *mut CxxError,
    ) -> u32;
    pub(crate) fn ferry_hixl_finalize(fns: *const Fns, engine: *mut c_void, err: *mut CxxError);
    pub(crate) fn ferry_hixl_register_mem(
        fns: *const Fns,
        engine: *mut c_void,
        desc: *const MemDesc,
        mem_type: i32,
        handle: *mut *mut c_void,
        err: *mut CxxError,
    ) -> u32;
    pub(crate) fn ferry_hixl_deregister_mem(
        fns: *const Fns,
        engine: *mut c_void,
        handle: *mut c_void,
        err: *mut CxxError,
    ) -> u32;
    pub(crate) fn ferry_hixl_connect(
        fns: *const Fns,
        engine: *mut c_void,
        remote: *const c_char,
        timeout_ms: i32,
        err: *mut CxxError,
    ) -> u32;
    pub(crate) fn ferry_hixl_disconnect(
        fns: *const Fns,
        engine: *mut c_void,
        remote: *const c_char,
        timeout_ms: i32,
        err: *mut CxxError,
    ) -> u32;
    pub(crate) fn ferry_hixl_transfer_sync(
        fns: *const Fns,
        engine: *mut c_void,
        remote: *const c_char,
        op: i32,
        descs: *const crate::TransferOpDesc,
        n_descs: usize,
        timeout_ms: i32,
        err: *mut CxxError,
    ) -> u32;
    pub(crate) fn ferry_hixl_transfer_async(
        fns: *const Fns,
        engine: *mut c_void,
        remote: *const c_char,
        op: i32,
        descs: *const crate::TransferOpDesc,
        n_descs: usize,
        req: *mut *mut c_void,
        err: *mut CxxError,
    ) -> u32;
    pub(crate) fn ferry_hixl_get_transfer_status(
        fns: *const Fns,
        engine: *mut c_void,
        req: *mut c_void,
        status: *mut i32,
        err: *mut CxxError,
    ) -> u32;
    pub(crate) fn ferry_hixl_get_capability(fns: *const Fns, feature: i32, value: *mut i32, err: *mut CxxError) -> u32;
}

/// The sizes the shim was compiled with.
#[cfg(test)]
pub(crate) fn layout() -> Layout {
    let mut l = Layout::default();
    // SAFETY: `l` is a valid out-pointer; the function only writes it.
    unsafe { ferry_hixl_layout(&mut l) };
    l
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shim_and_rust_agree_on_the_layouts() {
        let l = layout();
        assert_eq!(l.ascend_string, 16, "ge::AscendString is one shared_ptr");
        assert_eq!(l.options_map, 48, "libstdc++ std::map");
        assert_eq!(l.op_desc_vector, 3 * std::mem::size_of::<usize>());
        assert_eq!(l.mem_desc, std::mem::size_of::<MemDesc>());
        assert_eq!(l.mem_desc, 144);
        assert_eq!(l.op_desc, std::mem::size_of::<crate::TransferOpDesc>());
        assert_eq!(l.transfer_args, 128);
        assert!(l.engine_alloc >= 8, "the engine object is one unique_ptr");
        assert_eq!(std::mem::size_of::<CxxError>(), 260);
    }

    #[test]
    fn exception_text_is_read_up_to_the_nul() {
        let mut e = CxxError::new();
        assert_eq!(e.take(), None);
        e.thrown = 1;
        for (i, b) in b"boom".iter().enumerate() {
            e.what[i] = *b as c_char;
        }
        assert_eq!(e.take().as_deref(), Some("boom"));
    }
}
