//! # ferry-hixl-sys
//!
//! Huawei's HIXL (the transfer library under Mooncake's `ascend_direct` transport) loaded at run
//! time, with a safe-as-possible Rust API over it, for the HIXL backend of Ferry's Ascend
//! transport.
//!
//! HIXL's API is C++: `hixl::Hixl` in `libcann_hixl.so` (CANN >= 8.5) and the deprecated
//! `adxl::AdxlEngine` in `libllm_datadist.so` (CANN 8.3 on), with `ge::AscendString` (from
//! `libmetadef.so`), `std::map` and `std::vector` in their signatures. Ferry has no link-time
//! dependency on any of them:
//!
//! - [`HixlLibrary::load`] finds the libraries on a [`SearchPath`] (`FERRY_ASCEND_LIB_DIR`,
//!   `ASCEND_HOME_PATH`, the CANN install roots, the loader path), opens them with
//!   `RTLD_NOW | RTLD_GLOBAL`, and resolves the member functions by their Itanium-mangled names
//!   ([`HIXL`], [`ADXL`], [`ASCEND_STRING`]). It prefers `hixl::Hixl` when every required entry
//!   point resolves, else `adxl::AdxlEngine`; [`API_ENV`] (`FERRY_HIXL_API=hixl|adxl|auto`)
//!   overrides that. `TransferAsync`, `GetTransferStatus` and `GetCapability` are optional, as
//!   Mooncake treats them. A failure ([`LoadError`]) names every file looked for, where, and why
//!   it was not used.
//! - A small C++ shim (`cpp/hixl_shim.cpp`, built by `build.rs` with the system C++ compiler and
//!   no CANN header) receives the resolved addresses, builds the C++ arguments with the
//!   compiler's libstdc++, calls the member functions (a non-virtual member function is a plain
//!   function taking `this` first) and catches every C++ exception, so none unwinds into Rust.
//! - [`HixlEngine`] owns one engine object: `initialize`, `register_mem`, `deregister_mem`,
//!   `connect`, `disconnect`, `transfer_sync`, `transfer_async` and `poll_transfer`; finalized
//!   and destroyed on drop. [`HixlError`] keeps the C++ function's name and HIXL's [`Status`].
//!
//! Every declaration of HIXL's types here and in the shim is Ferry's own, written from the
//! documented layouts (`docs/research/hixl-interop-facts.md`); HIXL's headers are under a
//! licence that restricts their use and are not used.
//!
//! **Hardware honesty:** this crate has been exercised only against Ferry's emulated HIXL
//! (`ffi/ascend/cann-emu`, which exports the same mangled entry points) and, for C++ exceptions, a tiny
//! test library of its own; never against Huawei's libraries, never on an NPU.

mod engine;
mod error;
mod library;
mod shim;
mod symbols;
mod types;

pub use engine::{HixlEngine, MemHandle, TransferPoll, TransferReq};
pub use error::{ApiFailure, Attempt, HixlError, LoadError};
pub use ferry_ascend_sys::{HIXL_LIBRARY, LLM_DATADIST_LIBRARY, METADEF_LIBRARY, SearchPath};
pub use library::{API_ENV, ApiChoice, HixlApi, HixlLibrary};
pub use symbols::{ADXL, ASCEND_STRING, HIXL, Symbol};
pub use types::{FeatureType, MemType, Status, TransferOp, TransferOpDesc, TransferStatus};
