//! The C++ types HIXL's callers build inline, read and built through the C++ half of the
//! emulator (`cpp/hixl_layout.cc`, compiled by `build.rs` against the system libstdc++).
//!
//! - `ge::AscendString`: one `std::shared_ptr<std::string>` (16 bytes). Callers copy and
//!   destroy it inline; only its `const char*` constructor and `operator<` are exported.
//! - `std::map<AscendString, AscendString>`: built inline by the caller with the exported
//!   `operator<`; the emulator only walks it.
//! - `std::vector<TransferOpDesc>`: `TransferOpDesc` is three 64-bit words.
//! - `MemDesc` (144 bytes): `addr`, `len`, then `hixl::MemDesc::local_only` (a `bool` at offset
//!   16; `adxl::MemDesc` has reserved bytes there, which the ADXL wrapper drops: HIXL
//!   `src/llm_datadist/api/adxl_engine_impl.cc` l.28-30 copies only `addr` and `len`).

use std::ffi::{c_char, c_void};

unsafe extern "C" {
    fn ferry_cann_emu_hixl_str_new(this: *mut c_void, text: *const c_char) -> i32;
    fn ferry_cann_emu_hixl_str_drop(this: *mut c_void);
    fn ferry_cann_emu_hixl_str_get(this: *const c_void, data: *mut *const c_char, len: *mut usize) -> i32;
    fn ferry_cann_emu_hixl_str_less(a: *const c_void, b: *const c_void) -> i32;
    fn ferry_cann_emu_hixl_map_visit(
        map: *const c_void,
        visit: unsafe extern "C" fn(*mut c_void, *const c_void, *const c_void),
        ctx: *mut c_void,
    );
    fn ferry_cann_emu_hixl_vec_get(vec: *const c_void, data: *mut *const c_void, len: *mut usize);
    fn ferry_cann_emu_hixl_map_new(
        keys: *const *const c_char,
        values: *const *const c_char,
        n: usize,
        out: *mut *mut c_void,
    ) -> i32;
    fn ferry_cann_emu_hixl_map_drop(map: *mut c_void);
    fn ferry_cann_emu_hixl_vec_new(descs: *const TransferOpDesc, n: usize, out: *mut *mut c_void) -> i32;
    fn ferry_cann_emu_hixl_vec_drop(vec: *mut c_void);
}

/// `MemDesc` of both APIs (144 bytes): `hixl::MemDesc` has `bool local_only` at offset 16,
/// `adxl::MemDesc` reserved bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MemDesc {
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// `hixl::MemDesc::local_only` (0 or 1); reserved in `adxl::MemDesc`.
    pub local_only: u8,
    /// Reserved.
    pub reserved: [u8; 127],
}

impl MemDesc {
    /// A descriptor of `[addr, addr + len)`, remotely accessible.
    pub fn new(addr: usize, len: usize) -> MemDesc {
        MemDesc { addr, len, local_only: 0, reserved: [0; 127] }
    }
}

/// `TransferOpDesc` of both APIs (24 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferOpDesc {
    /// Local address.
    pub local_addr: usize,
    /// Remote address.
    pub remote_addr: usize,
    /// Length in bytes.
    pub len: usize,
}

/// `TransferArgs` of both APIs (128 bytes; `hixl::TransferArgs` starts with `user_data`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TransferArgs {
    /// `hixl::TransferArgs::user_data`; reserved in `adxl::TransferArgs`.
    pub user_data: *const c_void,
    /// Reserved.
    pub reserved: [u8; 120],
}

impl Default for TransferArgs {
    fn default() -> TransferArgs {
        TransferArgs { user_data: std::ptr::null(), reserved: [0; 120] }
    }
}

const _: () = assert!(size_of::<MemDesc>() == 144);
const _: () = assert!(std::mem::offset_of!(MemDesc, local_only) == 16);
const _: () = assert!(size_of::<TransferOpDesc>() == 24);
const _: () = assert!(size_of::<TransferArgs>() == 128);

/// Reads an `ge::AscendString`: `None` when it holds no string; invalid UTF-8 is replaced.
///
/// # Safety
/// `s` points to a live `ge::AscendString`.
pub(crate) unsafe fn read_str(s: *const c_void) -> Option<String> {
    let mut data: *const c_char = std::ptr::null();
    let mut len = 0usize;
    // SAFETY: `s` is a live AscendString (caller); the out-pointers are locals.
    if unsafe { ferry_cann_emu_hixl_str_get(s, &mut data, &mut len) } == 0 {
        return None;
    }
    if len == 0 {
        return Some(String::new());
    }
    // SAFETY: the shim returned the string's buffer and length; it stays alive while `s` does.
    let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) };
    Some(String::from_utf8_lossy(bytes).into_owned())
}

/// Builds a `ge::AscendString` in the 16 uninitialised bytes at `this`; false when the
/// allocation failed (then `this` holds an empty AscendString).
///
/// # Safety
/// `this` is valid for writes of 16 bytes, 8-aligned; `text` is NULL or NUL-terminated.
pub(crate) unsafe fn construct_str(this: *mut c_void, text: *const c_char) -> bool {
    // SAFETY: guaranteed by the caller; the shim never throws.
    unsafe { ferry_cann_emu_hixl_str_new(this, text) == 0 }
}

/// `ge::AscendString::operator<`.
///
/// # Safety
/// Both point to live AscendStrings.
pub(crate) unsafe fn str_less(a: *const c_void, b: *const c_void) -> bool {
    // SAFETY: guaranteed by the caller; the shim never throws.
    unsafe { ferry_cann_emu_hixl_str_less(a, b) != 0 }
}

unsafe extern "C" fn collect(ctx: *mut c_void, key: *const c_void, value: *const c_void) {
    // SAFETY: `ctx` is the `Vec` passed by `read_options`; key and value are live entries of
    // the map being walked. Nothing here unwinds except on allocation failure, which aborts.
    unsafe {
        let out = &mut *ctx.cast::<Vec<(String, String)>>();
        out.push((read_str(key).unwrap_or_default(), read_str(value).unwrap_or_default()));
    }
}

/// Reads a `std::map<AscendString, AscendString>` into `(key, value)` pairs, in map order (an
/// AscendString holding no string reads as "").
///
/// # Safety
/// `map` points to a live map of that type.
pub(crate) unsafe fn read_options(map: *const c_void) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    // SAFETY: `map` is live (caller); `collect` matches the callback type and `out` outlives
    // the call.
    unsafe { ferry_cann_emu_hixl_map_visit(map, collect, (&mut out as *mut Vec<(String, String)>).cast()) };
    out
}

/// Reads a `std::vector<TransferOpDesc>`.
///
/// # Safety
/// `vec` points to a live vector of that type.
pub(crate) unsafe fn read_descs(vec: *const c_void) -> Vec<TransferOpDesc> {
    let mut data: *const c_void = std::ptr::null();
    let mut len = 0usize;
    // SAFETY: `vec` is live (caller); out-pointers are locals.
    unsafe { ferry_cann_emu_hixl_vec_get(vec, &mut data, &mut len) };
    if len == 0 || data.is_null() {
        return Vec::new();
    }
    // SAFETY: the vector's buffer holds `len` initialised TransferOpDescs.
    unsafe { std::slice::from_raw_parts(data.cast::<TransferOpDesc>(), len) }.to_vec()
}

/// A `ge::AscendString` owned by Rust (for tests and Rust callers of the exports).
#[repr(C, align(8))]
#[derive(Debug)]
pub struct AscendString([u8; 16]);

impl AscendString {
    /// Builds one from `text` (as `ge::AscendString(const char*)` does).
    pub fn new(text: &str) -> AscendString {
        let c = std::ffi::CString::new(text).expect("no NUL inside an AscendString");
        let mut s = AscendString([0; 16]);
        // SAFETY: 16 writable, 8-aligned bytes; `c` is NUL-terminated.
        let ok = unsafe { construct_str(s.0.as_mut_ptr().cast(), c.as_ptr()) };
        assert!(ok, "allocating an AscendString failed");
        s
    }

    /// Its address, to pass as `const AscendString&`.
    pub fn as_ptr(&self) -> *const c_void {
        self.0.as_ptr().cast()
    }

    /// Its text.
    pub fn text(&self) -> Option<String> {
        // SAFETY: `self` is a live AscendString.
        unsafe { read_str(self.as_ptr()) }
    }
}

impl Drop for AscendString {
    fn drop(&mut self) {
        // SAFETY: built by `new`, destroyed once.
        unsafe { ferry_cann_emu_hixl_str_drop(self.0.as_mut_ptr().cast()) }
    }
}

/// A `std::map<AscendString, AscendString>` owned by Rust (options for `Initialize`).
#[derive(Debug)]
pub struct OptionMap(*mut c_void);

impl OptionMap {
    /// A map of `pairs`.
    pub fn new(pairs: &[(&str, &str)]) -> OptionMap {
        let keys: Vec<std::ffi::CString> =
            pairs.iter().map(|(k, _)| std::ffi::CString::new(*k).expect("no NUL")).collect();
        let values: Vec<std::ffi::CString> =
            pairs.iter().map(|(_, v)| std::ffi::CString::new(*v).expect("no NUL")).collect();
        let kp: Vec<*const c_char> = keys.iter().map(|k| k.as_ptr()).collect();
        let vp: Vec<*const c_char> = values.iter().map(|v| v.as_ptr()).collect();
        let mut out = std::ptr::null_mut();
        // SAFETY: `kp`/`vp` hold `pairs.len()` NUL-terminated strings alive for the call.
        let rc = unsafe { ferry_cann_emu_hixl_map_new(kp.as_ptr(), vp.as_ptr(), pairs.len(), &mut out) };
        assert_eq!(rc, 0, "allocating an option map failed");
        OptionMap(out)
    }

    /// Its address, to pass as `const std::map<...>&`.
    pub fn as_ptr(&self) -> *const c_void {
        self.0
    }
}

impl Drop for OptionMap {
    fn drop(&mut self) {
        // SAFETY: built by `new`, freed once.
        unsafe { ferry_cann_emu_hixl_map_drop(self.0) }
    }
}

/// A `std::vector<TransferOpDesc>` owned by Rust.
#[derive(Debug)]
pub struct DescVec(*mut c_void);

impl DescVec {
    /// A vector holding `descs`.
    pub fn new(descs: &[TransferOpDesc]) -> DescVec {
        let mut out = std::ptr::null_mut();
        // SAFETY: `descs` is a live slice of `descs.len()` elements.
        let rc = unsafe { ferry_cann_emu_hixl_vec_new(descs.as_ptr(), descs.len(), &mut out) };
        assert_eq!(rc, 0, "allocating a descriptor vector failed");
        DescVec(out)
    }

    /// Its address, to pass as `const std::vector<TransferOpDesc>&`.
    pub fn as_ptr(&self) -> *const c_void {
        self.0
    }
}

impl Drop for DescVec {
    fn drop(&mut self) {
        // SAFETY: built by `new`, freed once.
        unsafe { ferry_cann_emu_hixl_vec_drop(self.0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_maps_and_vectors_round_trip_through_libstdcxx() {
        let a = AscendString::new("AutoConnect");
        let b = AscendString::new("BufferPool");
        assert_eq!(a.text().as_deref(), Some("AutoConnect"));
        // SAFETY: both are live AscendStrings.
        unsafe {
            assert!(str_less(a.as_ptr(), b.as_ptr()));
            assert!(!str_less(b.as_ptr(), a.as_ptr()));
            assert!(!str_less(a.as_ptr(), a.as_ptr()));
        }
        let m = OptionMap::new(&[("b", "2"), ("a", "1"), ("c", "")]);
        // SAFETY: a live map.
        let pairs = unsafe { read_options(m.as_ptr()) };
        assert_eq!(pairs, vec![("a".into(), "1".into()), ("b".into(), "2".into()), ("c".into(), "".into())]);
        let d = [
            TransferOpDesc { local_addr: 1, remote_addr: 2, len: 3 },
            TransferOpDesc { local_addr: 4, remote_addr: 5, len: 6 },
        ];
        let v = DescVec::new(&d);
        // SAFETY: a live vector.
        assert_eq!(unsafe { read_descs(v.as_ptr()) }, d.to_vec());
        // SAFETY: a live empty vector.
        assert!(unsafe { read_descs(DescVec::new(&[]).as_ptr()) }.is_empty());
    }

    #[test]
    fn a_null_ascend_string_sorts_first() {
        let mut raw = AscendString([0; 16]);
        // SAFETY: 16 writable aligned bytes; NULL text.
        assert!(unsafe { construct_str(raw.0.as_mut_ptr().cast(), std::ptr::null()) });
        assert_eq!(raw.text(), None);
        let a = AscendString::new("");
        // SAFETY: both live.
        unsafe {
            assert!(str_less(raw.as_ptr(), a.as_ptr()));
            assert!(!str_less(a.as_ptr(), raw.as_ptr()));
        }
    }
}
