//! The error type of this crate: every failure of a call keeps the C function's name and its
//! code, with the runtime's own text when it gives one ([`Library::acl_text`],
//! [`Library::hccl_text`]).

use ferry_ascend_sys::{HCCL_E_NOT_SUPPORT, HCCL_E_TIMEOUT, Library, LoadError, OneSidedFns};

/// Result alias of this crate.
pub type Result<T, E = AscendError> = std::result::Result<T, E>;

/// Everything that can go wrong when loading or calling ACL and HCCL.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum AscendError {
    /// The libraries could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
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

/// Turning the codes of calls through a [`Library`]'s function tables into [`AscendError`]s.
pub(crate) trait Checks {
    /// `Ok` for 0, else [`AscendError::Acl`] with the runtime's text.
    fn acl_check(&self, call: &'static str, code: i32) -> Result<()>;
    /// `Ok` for 0, else [`AscendError::Hccl`] with the runtime's text.
    fn hccl_check(&self, call: &'static str, code: i32) -> Result<()>;
    /// The one-sided functions, or [`AscendError::Unavailable`] naming `call`.
    fn one_sided(&self, call: &'static str) -> Result<&OneSidedFns>;
    /// `aclInit` once per process ([`Library::initialize`]), its failure as an [`AscendError`].
    fn init(&self) -> Result<()>;
}

impl Checks for Library {
    fn acl_check(&self, call: &'static str, code: i32) -> Result<()> {
        if code == 0 { Ok(()) } else { Err(AscendError::Acl { call, code, message: self.acl_text(code) }) }
    }

    fn hccl_check(&self, call: &'static str, code: i32) -> Result<()> {
        if code == 0 { Ok(()) } else { Err(AscendError::Hccl { call, code, message: self.hccl_text(code) }) }
    }

    fn one_sided(&self, call: &'static str) -> Result<&OneSidedFns> {
        self.optional()
            .one_sided
            .as_ref()
            .ok_or(AscendError::Unavailable { symbol: call, purpose: "the one-sided HCCL service" })
    }

    fn init(&self) -> Result<()> {
        self.initialize().or_else(|code| self.acl_check("aclInit", code))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_ascend_sys::Attempt;

    #[test]
    fn errors_keep_call_and_code_and_loading_errors_their_attempts() {
        let e = AscendError::Hccl { call: "HcclBatchGet", code: 4, message: "boom".into() };
        assert_eq!(e.code(), Some(4));
        assert_eq!(e.call(), Some("HcclBatchGet"));
        assert_eq!(e.to_string(), "HcclBatchGet failed with HCCL error 4: boom");
        assert!(AscendError::Hccl { call: "x", code: 5, message: String::new() }.is_not_supported());
        assert!(AscendError::Hccl { call: "x", code: 9, message: String::new() }.is_hccl_timeout());
        let load = LoadError::NotFound {
            library: "libascendcl.so",
            tried: vec![Attempt {
                path: "/a/libascendcl.so".into(),
                source: "FERRY_ASCEND_LIB_DIR".into(),
                reason: "no such file".into(),
            }],
        };
        let e = AscendError::from(load.clone());
        assert_eq!(e.to_string(), load.to_string(), "a loading error reads as itself");
        assert_eq!((e.code(), e.call()), (None, None));
    }
}
