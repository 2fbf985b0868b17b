//! # ferry-ascend-sys
//!
//! Huawei Ascend's ACL runtime (`libascendcl.so`) and HCCL (`libhccl.so`, `libhcomm.so`)
//! loaded at run time with `libloading`: Ferry builds and runs on machines without CANN, and
//! reports clearly what it looked for when an Ascend transport is asked for there.
//!
//! - [`Library`]: finds and loads the libraries ([`SearchPath`]: `FERRY_ASCEND_LIB_DIR`,
//!   `ASCEND_HOME_PATH`/`ASCEND_TOOLKIT_HOME`, the CANN <= 8.3 and >= 8.5 install roots, the
//!   loader path), resolves the required symbols and the optional ones ([`Capabilities`]), and
//!   turns error codes into text (`aclGetRecentErrMsg`, `HcclGetErrorString`). Loaded once per
//!   process, never unloaded.
//! - The safe layer: [`Device`] (a thread bound with `aclrtSetDevice`), [`Stream`],
//!   [`DeviceBuffer`], [`RootInfo`], [`Communicator`] (two-sided and one-sided),
//!   [`GlobalMem`], and [`DeviceThread`], a bound OS thread that owns state and runs closures
//!   on it: ACL state is per thread, so device objects are not `Send` and live on one thread.
//! - [`AscendError`] keeps the failing call's name and code with the runtime's text.
//!
//! C enums are passed as integers and never mapped to exhaustive Rust enums. Facts about the C
//! surface come from CANN's public headers (see `docs/ascend.md`); everything here has been
//! exercised against Ferry's emulated CANN only, never on an NPU.

mod device;
mod error;
mod hccl;
mod library;
pub mod raw;
mod search;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;
mod worker;

pub use device::{Device, DeviceBuffer, Drained, HostBuffer, PointerKind, Stream};
pub use error::{
    ACL_ERROR_CONTEXT_NULL, ACL_ERROR_INVALID_DEVICE, ACL_ERROR_REPEAT_INITIALIZE, AscendError, Attempt,
    HCCL_E_NOT_SUPPORT, HCCL_E_TIMEOUT, Result, acl_code_name, hccl_code_name,
};
pub use hccl::{Communicator, GlobalMem, MemKind, OneSidedOp, RootInfo};
pub use library::{Capabilities, Library, LoadedPaths};
pub use search::{
    ACL_LIBRARY, CANN_LIB_DIR, CANN_TOOLKIT_LIB_DIR, HCCL_LIBRARY, HCOMM_LIBRARY, HIXL_LIBRARY, LIB_DIR_ENV,
    LLM_DATADIST_LIBRARY, METADEF_LIBRARY, SearchDir, SearchPath,
};
pub use worker::DeviceThread;
