//! The error type of this crate: every failure keeps the C call's name and its code, with the
//! runtime's own text when it gives one.

use std::fmt;

/// `HcclResult` value meaning "not supported" (`HCCL_E_NOT_SUPPORT`).
pub const HCCL_E_NOT_SUPPORT: i32 = 5;
/// `HcclResult` value of a timeout (`HCCL_E_TIMEOUT`).
pub const HCCL_E_TIMEOUT: i32 = 9;
/// `aclError` value of a repeated `aclInit` (treated as success).
pub const ACL_ERROR_REPEAT_INITIALIZE: i32 = 100_002;
/// `aclError` value of an invalid device id.
pub const ACL_ERROR_INVALID_DEVICE: i32 = 107_001;
/// `ACL_ERROR_RT_CONTEXT_NULL`: the calling thread has no current context (no device set).
pub const ACL_ERROR_CONTEXT_NULL: i32 = 107_002;

/// Result alias of this crate.
pub type Result<T, E = AscendError> = std::result::Result<T, E>;

/// One place the loader looked for a library, and why it was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// The path (or bare file name, for the dynamic loader's own search) that was tried.
    pub path: String,
    /// Where that candidate came from (`FERRY_ASCEND_LIB_DIR`, `CANN <= 8.3 default root`, ...).
    pub source: String,
    /// Why it was not used.
    pub reason: String,
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.path, self.source, self.reason)
    }
}

/// Everything that can go wrong when loading or calling ACL and HCCL.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum AscendError {
    /// A library could not be loaded from any candidate; `tried` lists each one with its reason.
    #[error(
        "{library} could not be loaded (is CANN installed? source its set_env.sh or set FERRY_ASCEND_LIB_DIR); tried:{}",
        list(tried)
    )]
    NotFound {
        /// The library looked for (`libascendcl.so`, `libhccl.so`).
        library: &'static str,
        /// Every candidate, in search order.
        tried: Vec<Attempt>,
    },
    /// A required symbol is in none of the loaded libraries (a CANN too old, or not CANN at all).
    #[error("required symbol {symbol} is missing from {searched} (a CANN release Ferry does not support?)")]
    MissingSymbol {
        /// The symbol.
        symbol: &'static str,
        /// The libraries searched.
        searched: String,
    },
    /// An ACL call returned an error code.
    #[error("{call} failed with ACL error {code}: {message}")]
    Acl {
        /// The C function.
        call: &'static str,
        /// The `aclError` it returned.
        code: i32,
        /// `aclGetRecentErrMsg`'s text, or a description of the code.
        message: String,
    },
    /// An HCCL call returned an error code.
    #[error("{call} failed with HCCL error {code}: {message}")]
    Hccl {
        /// The C function.
        call: &'static str,
        /// The `HcclResult` it returned.
        code: i32,
        /// `HcclGetErrorString`'s text, or the code's name.
        message: String,
    },
    /// An optional function this CANN release does not export was needed.
    #[error("{symbol} is not available in the loaded CANN libraries ({purpose})")]
    Unavailable {
        /// The symbol.
        symbol: &'static str,
        /// What it was needed for.
        purpose: &'static str,
    },
    /// A caller passed something the C API cannot take (an interior NUL, a size that does not
    /// fit, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A device thread stopped (its queue is closed) or could not be started.
    #[error("device thread {name}: {reason}")]
    Thread {
        /// The thread's name.
        name: String,
        /// What happened.
        reason: String,
    },
}

fn list(tried: &[Attempt]) -> String {
    if tried.is_empty() {
        return " nothing".to_owned();
    }
    tried.iter().map(|a| format!("\n  - {a}")).collect()
}

impl AscendError {
    /// The ACL or HCCL code, when this error came from a call.
    pub fn code(&self) -> Option<i32> {
        match self {
            AscendError::Acl { code, .. } | AscendError::Hccl { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The C function that failed, when this error came from a call.
    pub fn call(&self) -> Option<&'static str> {
        match self {
            AscendError::Acl { call, .. } | AscendError::Hccl { call, .. } => Some(call),
            _ => None,
        }
    }

    /// True for an HCCL `HCCL_E_NOT_SUPPORT` answer or an absent optional function: the caller
    /// should take another path.
    pub fn is_not_supported(&self) -> bool {
        matches!(self, AscendError::Hccl { code: HCCL_E_NOT_SUPPORT, .. } | AscendError::Unavailable { .. })
    }

    /// True for an HCCL timeout.
    pub fn is_hccl_timeout(&self) -> bool {
        matches!(self, AscendError::Hccl { code: HCCL_E_TIMEOUT, .. })
    }
}

/// The name of an `HcclResult` code (the reference's list), for when `HcclGetErrorString` is
/// absent or answers nothing.
pub fn hccl_code_name(code: i32) -> &'static str {
    match code {
        0 => "HCCL_SUCCESS",
        1 => "HCCL_E_PARA (invalid parameter)",
        2 => "HCCL_E_PTR (null pointer)",
        3 => "HCCL_E_MEMORY (memory error)",
        4 => "HCCL_E_INTERNAL (internal error)",
        5 => "HCCL_E_NOT_SUPPORT (not supported)",
        6 => "HCCL_E_NOT_FOUND (not found)",
        7 => "HCCL_E_UNAVAIL (resource unavailable)",
        8 => "HCCL_E_SYSCALL (system call failed)",
        9 => "HCCL_E_TIMEOUT (timeout)",
        10 => "HCCL_E_OPEN_FILE_FAILURE (cannot open file)",
        11 => "HCCL_E_TCP_CONNECT (TCP connect failed)",
        12 => "HCCL_E_ROCE_CONNECT (RoCE connect failed)",
        13 => "HCCL_E_TCP_TRANSFER (TCP transfer failed)",
        14 => "HCCL_E_ROCE_TRANSFER (RoCE transfer failed)",
        15 => "HCCL_E_RUNTIME (runtime call failed)",
        16 => "HCCL_E_DRV (driver call failed)",
        17 => "HCCL_E_PROFILING (profiling error)",
        18 => "HCCL_E_CCE (CCE error)",
        19 => "HCCL_E_NETWORK (network error)",
        20 => "HCCL_E_AGAIN (try again)",
        21 => "HCCL_E_REMOTE (remote error)",
        22 => "HCCL_E_SUSPENDING (suspending)",
        23 => "HCCL_E_OPRETRY_FAIL (operation retry failed)",
        24 => "HCCL_E_OOM (out of memory)",
        _ => "unknown HCCL error code",
    }
}

/// A description of common `aclError` codes (the reference's list), used when the runtime
/// gives no text of its own.
pub fn acl_code_name(code: i32) -> &'static str {
    match code {
        0 => "success",
        100_000 => "invalid parameter",
        ACL_ERROR_REPEAT_INITIALIZE => "repeat initialize",
        ACL_ERROR_INVALID_DEVICE => "invalid device id",
        107_002 => "context is null (no device set on this thread)",
        200_000 => "bad alloc",
        207_001 => "device out of memory",
        207_004 => "no device",
        507_033 => "device setup error",
        _ => "see the CANN error code reference",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_keep_call_and_code_and_list_every_attempt() {
        let e = AscendError::Hccl { call: "HcclBatchGet", code: 4, message: "boom".into() };
        assert_eq!(e.code(), Some(4));
        assert_eq!(e.call(), Some("HcclBatchGet"));
        assert_eq!(e.to_string(), "HcclBatchGet failed with HCCL error 4: boom");
        assert!(AscendError::Hccl { call: "x", code: 5, message: String::new() }.is_not_supported());
        let nf = AscendError::NotFound {
            library: "libascendcl.so",
            tried: vec![
                Attempt {
                    path: "/a/libascendcl.so".into(),
                    source: "FERRY_ASCEND_LIB_DIR".into(),
                    reason: "no such file".into(),
                },
                Attempt { path: "libascendcl.so".into(), source: "dynamic loader".into(), reason: "not found".into() },
            ],
        };
        let text = nf.to_string();
        assert!(text.contains("/a/libascendcl.so (FERRY_ASCEND_LIB_DIR): no such file"), "{text}");
        assert!(text.contains("libascendcl.so (dynamic loader): not found"), "{text}");
        assert_eq!(hccl_code_name(9), "HCCL_E_TIMEOUT (timeout)");
        assert_eq!(hccl_code_name(77), "unknown HCCL error code");
    }
}
