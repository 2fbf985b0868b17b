//! The thread-local last error, the panic barrier every exported function runs its body in,
//! and the argument checks (strings, out-pointers, arrays) shared by all of them.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use ferry::{Error, ErrorKind};
use ferry_abi::{FERRY_E_INTERNAL, FERRY_OK};

/// Result of an exported function's body.
pub(crate) type CResult<T = ()> = Result<T, Error>;

thread_local! {
    /// "<kind>: <message>" of this thread's last failure (empty when none).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// The `FERRY_E_*` code of `kind` (its stable code, negated).
pub(crate) fn code_of(kind: ErrorKind) -> i32 {
    -kind.code()
}

/// Turns `text` into a C string, replacing interior NUL bytes (which C cannot represent) with
/// U+FFFD so the rest of the text survives.
pub(crate) fn to_cstring_lossy(text: &str) -> CString {
    match CString::new(text) {
        Ok(c) => c,
        Err(_) => CString::new(text.replace('\0', "\u{FFFD}")).unwrap_or_default(),
    }
}

/// Records `e` as this thread's last error.
pub(crate) fn set_last_error(e: &Error) {
    let text = to_cstring_lossy(&e.to_string());
    // `try_with`: a call made while the thread is being torn down loses its message rather
    // than panicking.
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = text;
        }
    });
}

/// A copy of this thread's last error (empty when none).
pub(crate) fn last_error_string() -> String {
    LAST_ERROR
        .try_with(|slot| slot.try_borrow().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default())
        .unwrap_or_default()
}

/// Pointer to this thread's last error text. It stays valid until the slot is next written,
/// which only a later failing `ferry_*` call on this thread does.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| match slot.try_borrow() {
            Ok(s) => s.as_ptr(),
            Err(_) => c"".as_ptr(),
        })
        .unwrap_or(c"".as_ptr())
}

/// Clears this thread's last error.
pub(crate) fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = CString::default();
        }
    });
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_owned()
    }
}

/// The panic barrier: runs `body`, returns [`FERRY_OK`] or the error's `FERRY_E_*` code (after
/// recording it as the last error). A panic becomes [`FERRY_E_INTERNAL`] with a message naming
/// `function`.
pub(crate) fn guard(function: &'static str, body: impl FnOnce() -> CResult<()>) -> i32 {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => FERRY_OK,
        Ok(Err(e)) => {
            tracing::debug!(function, error = %e, "C API call failed");
            set_last_error(&e);
            code_of(e.kind())
        }
        Err(payload) => {
            let e = Error::new(
                ErrorKind::Internal,
                format!("{function} panicked (a bug in Ferry): {}", panic_text(payload.as_ref())),
            );
            tracing::error!(function, error = %e, "panic caught at the C boundary");
            set_last_error(&e);
            FERRY_E_INTERNAL
        }
    }
}

/// Shorthand for an [`ErrorKind::InvalidArgument`] error.
pub(crate) fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(message)
}

/// Reads the NUL-terminated UTF-8 string argument `name`.
///
/// # Safety
/// `ptr` is null or points to a NUL-terminated string that stays valid and unchanged for `'a`.
pub(crate) unsafe fn str_arg<'a>(ptr: *const c_char, name: &str) -> CResult<&'a str> {
    if ptr.is_null() {
        return Err(invalid(format!("`{name}` is null")));
    }
    // SAFETY: non-null, and the caller promises a NUL-terminated string valid for 'a.
    let c = unsafe { CStr::from_ptr(ptr) };
    c.to_str().map_err(|e| invalid(format!("`{name}` is not valid UTF-8 (invalid byte at offset {})", e.valid_up_to())))
}

/// Like [`str_arg`], but a null pointer is `None`.
///
/// # Safety
/// As for [`str_arg`].
pub(crate) unsafe fn opt_str_arg<'a>(ptr: *const c_char, name: &str) -> CResult<Option<&'a str>> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract is this function's contract.
    unsafe { str_arg(ptr, name) }.map(Some)
}

/// Views the array argument `name` of `count` elements. A zero count gives an empty slice
/// whatever the pointer; a null or misaligned pointer with a non-zero count is refused, as is a
/// count whose byte size exceeds the address space.
///
/// # Safety
/// When `count > 0` and `ptr` is non-null, `ptr` points to `count` initialised elements that
/// stay valid and unchanged for `'a`.
pub(crate) unsafe fn slice_arg<'a, T>(ptr: *const T, count: usize, name: &str) -> CResult<&'a [T]> {
    if count == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(invalid(format!("`{name}` is null but its count is {count}")));
    }
    if !ptr.is_aligned() {
        return Err(invalid(format!("`{name}` ({ptr:p}) is not aligned for its element type")));
    }
    if count.checked_mul(size_of::<T>()).is_none_or(|bytes| bytes > isize::MAX as usize) {
        return Err(invalid(format!("`{name}` count {count} exceeds the address space")));
    }
    // SAFETY: non-null, aligned, the byte size fits in isize, and the caller promises `count`
    // initialised elements valid and unchanged for 'a.
    Ok(unsafe { std::slice::from_raw_parts(ptr, count) })
}

/// A checked output array: null only when its count is 0, aligned, with a byte size that fits
/// in the address space. Filled at most once, by a plain copy (the memory may be uninitialised).
pub(crate) struct OutArray<T> {
    ptr: *mut T,
    count: usize,
}

impl<T: Copy> OutArray<T> {
    /// Checks the output array argument `name` of `count` elements.
    ///
    /// # Safety
    /// When `count > 0` and `ptr` is non-null, `ptr` must be valid for writes of `count`
    /// elements until [`OutArray::fill`] is called.
    pub(crate) unsafe fn new(ptr: *mut T, count: usize, name: &str) -> CResult<Self> {
        if count > 0 {
            if ptr.is_null() {
                return Err(invalid(format!("`{name}` is null but its count is {count}")));
            }
            if !ptr.is_aligned() {
                return Err(invalid(format!("`{name}` ({ptr:p}) is not aligned for its element type")));
            }
            if count.checked_mul(size_of::<T>()).is_none_or(|bytes| bytes > isize::MAX as usize) {
                return Err(invalid(format!("`{name}` count {count} exceeds the address space")));
            }
        }
        Ok(Self { ptr, count })
    }

    /// Number of elements the caller provided.
    pub(crate) fn len(&self) -> usize {
        self.count
    }

    /// Copies `values` (at most the array's count) to the front of the array.
    pub(crate) fn fill(self, values: &[T]) {
        let n = values.len().min(self.count);
        if n == 0 {
            return;
        }
        // SAFETY: `new` checked that the pointer is non-null and aligned when the count is
        // non-zero, and its caller promised it is valid for writes of `count >= n` elements;
        // `values` is Rust-owned memory, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), self.ptr, n) }
    }
}

/// A checked out-pointer: non-null and aligned, written at most once.
pub(crate) struct Out<T> {
    ptr: *mut T,
}

impl<T> Out<T> {
    /// Checks the out-pointer argument `name`.
    ///
    /// # Safety
    /// When non-null, `ptr` must be valid for a write of one `T` until [`Out::write`] is called.
    pub(crate) unsafe fn new(ptr: *mut T, name: &str) -> CResult<Self> {
        if ptr.is_null() {
            return Err(invalid(format!("`{name}` is null")));
        }
        if !ptr.is_aligned() {
            return Err(invalid(format!("`{name}` ({ptr:p}) is not aligned")));
        }
        Ok(Self { ptr })
    }

    /// Stores the result.
    pub(crate) fn write(self, value: T) {
        // SAFETY: `new` checked the pointer is non-null and aligned, and its caller promised it
        // is valid for a write of one T.
        unsafe { self.ptr.write(value) }
    }
}

/// Copies `text` NUL-terminated into `buf` of `cap` bytes, truncated (at a UTF-8 character
/// boundary) when it does not fit. Returns whether it fitted whole. Nothing is written when
/// `buf` is null or `cap` is 0.
///
/// # Safety
/// When non-null, `buf` is valid for writes of `cap` bytes.
pub(crate) unsafe fn copy_str(text: &str, buf: *mut c_char, cap: usize) -> bool {
    let fits = text.len() < cap;
    if buf.is_null() || cap == 0 {
        return fits;
    }
    let mut n = text.len().min(cap - 1);
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    // SAFETY: `buf` is valid for `cap` bytes (caller's contract) and `n + 1 <= cap`; `text` is a
    // separate Rust string, so the ranges do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
        buf.add(n).write(0);
    }
    fits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error_with_a_message() {
        let rc = guard("ferry_test", || panic!("boom {}", 42));
        assert_eq!(rc, FERRY_E_INTERNAL);
        assert_eq!(last_error_string(), "internal: ferry_test panicked (a bug in Ferry): boom 42");
        let rc = guard("ferry_test", || std::panic::panic_any(7u8));
        assert_eq!(rc, FERRY_E_INTERNAL);
        assert!(last_error_string().ends_with("a panic with a non-string payload"));
        assert_eq!(guard("ferry_test", || Ok(())), FERRY_OK);
        assert!(last_error_string().starts_with("internal: "), "success leaves the last error alone");
    }

    #[test]
    fn errors_are_recorded_as_kind_and_message() {
        let rc = guard("ferry_test", || Err(Error::not_found("segment `x` is not published")));
        assert_eq!(rc, ferry_abi::FERRY_E_NOT_FOUND);
        assert_eq!(last_error_string(), "not_found: segment `x` is not published");
        // SAFETY: the thread's last error, valid until the next failing call on this thread.
        assert_eq!(unsafe { CStr::from_ptr(last_error_ptr()) }.to_str().unwrap(), last_error_string());
        clear_last_error();
        assert_eq!(last_error_string(), "");
    }

    #[test]
    fn interior_nuls_do_not_lose_the_text() {
        assert_eq!(to_cstring_lossy("a\0b").to_str().unwrap(), "a\u{FFFD}b");
        assert_eq!(to_cstring_lossy("plain").to_str().unwrap(), "plain");
    }

    #[test]
    fn copies_truncate_at_character_boundaries() {
        let mut buf = [0x55 as c_char; 4];
        // "é" is two bytes: with room for 3 bytes of text, "aé" fits, "aéb" does not.
        // SAFETY: `buf` has room for 4 bytes.
        assert!(!unsafe { copy_str("aébc", buf.as_mut_ptr(), 4) });
        // SAFETY: NUL-terminated by copy_str.
        assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(), "aé");
        // SAFETY: as above.
        assert!(!unsafe { copy_str("éé", buf.as_mut_ptr(), 4) });
        // SAFETY: as above.
        assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(), "é", "never half a character");
        // SAFETY: as above.
        assert!(unsafe { copy_str("abc", buf.as_mut_ptr(), 4) });
        // SAFETY: NULL is allowed and writes nothing.
        assert!(!unsafe { copy_str("abc", std::ptr::null_mut(), 0) });
    }

    #[test]
    fn array_and_pointer_arguments_are_checked() {
        // SAFETY: NULL pointers and a zero count are what is being tested; nothing is read.
        unsafe {
            assert!(slice_arg::<u64>(std::ptr::null(), 0, "xs").unwrap().is_empty());
            let e = slice_arg::<u64>(std::ptr::null(), 3, "xs").unwrap_err();
            assert_eq!(e.to_string(), "invalid_argument: `xs` is null but its count is 3");
            let e = Out::<u64>::new(std::ptr::null_mut(), "out").err().unwrap();
            assert_eq!(e.to_string(), "invalid_argument: `out` is null");
            assert!(OutArray::<u32>::new(std::ptr::null_mut(), 0, "ids").is_ok());
            assert!(OutArray::<u32>::new(std::ptr::null_mut(), 1, "ids").is_err());
        }
    }
}
