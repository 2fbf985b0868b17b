//! Errors: [`LoadError`] when HIXL cannot be loaded, [`HixlError`] when a call fails.

use std::fmt;

pub use ferry_ascend_sys::Attempt;

use crate::library::{API_ENV, ApiChoice, HixlApi};
use crate::types::Status;

/// A failed HIXL call.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HixlError {
    /// The call returned a status other than `SUCCESS`.
    #[error("{call} failed: {status}")]
    Status {
        /// The C++ function (`hixl::Hixl::Connect`).
        call: &'static str,
        /// What it returned.
        status: Status,
    },
    /// The call threw a C++ exception (caught by the shim; it never unwinds into Rust).
    #[error("{call} threw a C++ exception: {what}")]
    Exception {
        /// The C++ function.
        call: &'static str,
        /// The exception's `what()`.
        what: String,
    },
    /// An argument HIXL cannot take (a string with a NUL byte, an option given twice, a handle of
    /// another engine, ...); HIXL was not called.
    #[error("{call}: invalid argument: {reason}")]
    InvalidArgument {
        /// The C++ function that was about to be called.
        call: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The engine is not in a state that allows the call (not initialized, already
    /// initialized); HIXL was not called.
    #[error("{call}: {reason}")]
    InvalidState {
        /// The C++ function that was about to be called.
        call: &'static str,
        /// Why not.
        reason: &'static str,
    },
    /// An optional entry point this HIXL release does not export.
    #[error("{call} is not exported by {library}")]
    Unsupported {
        /// The missing C++ function.
        call: &'static str,
        /// The library it was looked for in.
        library: String,
    },
}

impl HixlError {
    /// The C++ function the error is about.
    pub fn call(&self) -> &'static str {
        match self {
            HixlError::Status { call, .. }
            | HixlError::Exception { call, .. }
            | HixlError::InvalidArgument { call, .. }
            | HixlError::InvalidState { call, .. }
            | HixlError::Unsupported { call, .. } => call,
        }
    }

    /// The status HIXL returned, when it returned one.
    pub fn status(&self) -> Option<Status> {
        match self {
            HixlError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// HIXL returned `TIMEOUT`.
    pub fn is_timeout(&self) -> bool {
        self.status() == Some(Status::TIMEOUT)
    }

    /// HIXL returned `NOT_CONNECTED`.
    pub fn is_not_connected(&self) -> bool {
        self.status() == Some(Status::NOT_CONNECTED)
    }

    /// HIXL returned `ALREADY_CONNECTED`.
    pub fn is_already_connected(&self) -> bool {
        self.status() == Some(Status::ALREADY_CONNECTED)
    }

    /// HIXL returned `PARAM_INVALID`, or the argument was refused before HIXL was called.
    pub fn is_param_invalid(&self) -> bool {
        matches!(self, HixlError::InvalidArgument { .. }) || self.status() == Some(Status::PARAM_INVALID)
    }

    /// HIXL returned `RESOURCE_EXHAUSTED`.
    pub fn is_resource_exhausted(&self) -> bool {
        self.status() == Some(Status::RESOURCE_EXHAUSTED)
    }

    /// HIXL returned `UNSUPPORTED`, or the entry point is not exported.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, HixlError::Unsupported { .. }) || self.status() == Some(Status::UNSUPPORTED)
    }
}

/// Why one API could not be used: every place its library was looked for, and why each failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiFailure {
    /// The API.
    pub api: HixlApi,
    /// Each candidate file, in search order.
    pub tried: Vec<Attempt>,
}

/// HIXL could not be loaded.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// `FERRY_HIXL_API` holds something other than `hixl`, `adxl` or `auto`.
    #[error("{API_ENV}={value:?} is not one of hixl, adxl, auto")]
    BadChoice {
        /// The value found.
        value: String,
    },
    /// No acceptable library was found for any API that was allowed.
    #[error("{}", not_found(*choice, failures))]
    NotFound {
        /// The choice that was in force.
        choice: ApiChoice,
        /// One entry per API tried, in order.
        failures: Vec<ApiFailure>,
    },
}

fn not_found(choice: ApiChoice, failures: &[ApiFailure]) -> String {
    let why = match choice {
        ApiChoice::Auto => format!("looked for hixl::Hixl, then adxl::AdxlEngine; {API_ENV} picks one"),
        ApiChoice::Hixl => format!("{API_ENV}=hixl"),
        ApiChoice::Adxl => format!("{API_ENV}=adxl"),
    };
    let mut s = format!(
        "HIXL could not be loaded ({why}; CANN >= 8.3 provides it: source its set_env.sh or set FERRY_ASCEND_LIB_DIR); tried:"
    );
    for f in failures {
        s.push_str(&format!("\n  {} in {}:", f.api, f.api.library_file()));
        if f.tried.is_empty() {
            s.push_str(" nothing");
        }
        for a in &f.tried {
            s.push_str(&format!("\n    - {a}"));
        }
    }
    s
}

impl fmt::Display for ApiFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} in {}:", self.api, self.api.library_file())?;
        for a in &self.tried {
            write!(f, " [{a}]")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_errors_name_the_call_and_the_status() {
        let e = HixlError::Status { call: "hixl::Hixl::Connect", status: Status::NOT_CONNECTED };
        assert_eq!(e.to_string(), "hixl::Hixl::Connect failed: NOT_CONNECTED (103902)");
        assert!(e.is_not_connected() && !e.is_timeout() && !e.is_already_connected());
        assert_eq!(e.call(), "hixl::Hixl::Connect");
        assert_eq!(e.status(), Some(Status::NOT_CONNECTED));
        let t = HixlError::Status { call: "x", status: Status::TIMEOUT };
        assert!(t.is_timeout());
        assert!(HixlError::Status { call: "x", status: Status::ALREADY_CONNECTED }.is_already_connected());
        assert!(HixlError::Status { call: "x", status: Status::PARAM_INVALID }.is_param_invalid());
        assert!(HixlError::Status { call: "x", status: Status::RESOURCE_EXHAUSTED }.is_resource_exhausted());
        assert!(HixlError::Status { call: "x", status: Status::UNSUPPORTED }.is_unsupported());
        let u = HixlError::Unsupported { call: "hixl::Hixl::TransferAsync", library: "/x/libcann_hixl.so".into() };
        assert!(u.is_unsupported() && u.status().is_none());
        assert_eq!(u.to_string(), "hixl::Hixl::TransferAsync is not exported by /x/libcann_hixl.so");
        let i = HixlError::InvalidArgument { call: "hixl::Hixl::Connect", reason: "NUL".into() };
        assert!(i.is_param_invalid());
        let x = HixlError::Exception { call: "hixl::Hixl::Initialize", what: "std::bad_alloc".into() };
        assert_eq!(x.to_string(), "hixl::Hixl::Initialize threw a C++ exception: std::bad_alloc");
    }
}
