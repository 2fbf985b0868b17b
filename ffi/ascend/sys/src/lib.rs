//! # ferry-ascend-sys
//!
//! Huawei Ascend's ACL runtime (`libascendcl.so`) and HCCL (`libhccl.so`, `libhcomm.so`)
//! loaded at run time with `libloading`: Ferry builds and runs on machines without CANN, and
//! reports clearly what it looked for when an Ascend transport is asked for there. This crate
//! holds the raw declarations and the loading only; the safe layer over devices, streams,
//! buffers and communicators is `ferry-ascend-runtime`.
//!
//! - [`raw`]: the C surface as CANN's headers declare it (types, `#[repr(C)]` structs,
//!   function-pointer types, enum values as integers).
//! - [`Library`]: finds and loads the libraries ([`SearchPath`]: `FERRY_ASCEND_LIB_DIR`,
//!   `ASCEND_HOME_PATH`/`ASCEND_TOOLKIT_HOME`, the CANN <= 8.3 and >= 8.5 install roots, the
//!   loader path), resolves the required symbols and the optional ones ([`Capabilities`]) into
//!   tables of function pointers ([`AclFns`], [`HcclFns`], [`OneSidedFns`], [`OptionalFns`]),
//!   runs `aclInit` once, and turns error codes into text (`aclGetRecentErrMsg`,
//!   `HcclGetErrorString`, else the code names of [`acl_code_name`] and [`hccl_code_name`]).
//!   Loaded once per process, never unloaded. A failed load is a [`LoadError`] naming every
//!   [`Attempt`].
//!
//! C enums are passed as integers and never mapped to exhaustive Rust enums. Facts about the C
//! surface come from CANN's public headers (see `docs/ascend.md`); everything here has been
//! exercised against Ferry's emulated CANN only, never on an NPU.

mod codes;
mod error;
mod library;
pub mod raw;
mod search;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;

pub use codes::{
    ACL_ERROR_CONTEXT_NULL, ACL_ERROR_INVALID_DEVICE, ACL_ERROR_REPEAT_INITIALIZE, HCCL_E_NOT_SUPPORT, HCCL_E_TIMEOUT,
    acl_code_name, hccl_code_name,
};
pub use error::{Attempt, LoadError};
pub use library::{AclFns, Capabilities, HcclFns, Library, LoadedPaths, OneSidedFns, OptionalFns};
pub use search::{
    ACL_LIBRARY, CANN_LIB_DIR, CANN_TOOLKIT_LIB_DIR, HCCL_LIBRARY, HCOMM_LIBRARY, HIXL_LIBRARY, LIB_DIR_ENV,
    LLM_DATADIST_LIBRARY, METADEF_LIBRARY, SearchDir, SearchPath,
};
