//! # ferry-cann-emu: an emulated CANN runtime (a test double)
//!
//! This crate builds `libferry_cann_emu.so`, a shared library that exports the ACL runtime
//! (`libascendcl.so`) and HCCL (`libhccl.so`) C symbols Ferry binds at run time, with exactly
//! the prototypes of CANN's public headers (see `docs/ascend.md`), and an emulated HIXL: the C++ entry
//! points of `adxl::AdxlEngine` (`libllm_datadist.so`), `hixl::Hixl` (`libcann_hixl.so`) and
//! `ge::AscendString` (`libmetadef.so`), see [`hixl`]. It emulates N Ascend devices in host
//! memory and runs HCCL between processes over loopback TCP, so Ferry's HCCL transport can be
//! tested on machines without an NPU. It is a **test double**: it behaves like CANN as
//! documented (per-thread device state, user/logical/physical device ids, ordered streams,
//! asynchronous errors reported at synchronize, collective initialisation), never like
//! something Ferry-specific, and nothing in it has been compared with real hardware.
//!
//! Tests put the file in a directory under both names (glibc loads one object for both, so ACL
//! and HCCL share state):
//!
//! ```sh
//! cargo build -p ferry-cann-emu                     # target/debug/libferry_cann_emu.so
//! ln -s $PWD/target/debug/libferry_cann_emu.so emu/libascendcl.so
//! ln -s $PWD/target/debug/libferry_cann_emu.so emu/libhccl.so
//! # HIXL too (Mooncake's ascend_transport.so, Ferry's HIXL shim):
//! for n in libllm_datadist.so libcann_hixl.so libmetadef.so; do
//!   ln -s $PWD/target/debug/libferry_cann_emu.so emu/$n; done
//! # an "older CANN" without the one-sided HCCL symbols (HcclBatchGet, ...):
//! cargo build -p ferry-cann-emu --no-default-features --target-dir target/cann-emu-legacy
//! ```
//!
//! The cargo feature `onesided` (default on) gates the one-sided exports.
//!
//! ## Environment
//!
//! Read once per process, at the first call that needs it.
//!
//! | variable | meaning |
//! | --- | --- |
//! | `FERRY_CANN_EMU_DEVICES` | number of emulated physical devices, ids `0..N-1` (default 8) |
//! | `FERRY_CANN_EMU_MOUNTED` | a container: the physical ids of the cards it mounts, in its logical order (`6,7`: logical 0 is physical 6); unset = bare metal, logical = physical; see [`parse_mounted`] |
//! | `ASCEND_RT_VISIBLE_DEVICES` | CANN's visible-device list of *logical* ids; see [`parse_visible_devices`] for the rules |
//! | `FERRY_CANN_EMU_SOC` | what `aclrtGetSocName` answers (default `Ascend910B3`, an Atlas A2; `Ascend910_9391` makes an Atlas A3) |
//! | `FERRY_CANN_EMU_SUPER_POD`, `FERRY_CANN_EMU_SUPER_DEVICE_BASE` | on an A3 SoC, the super pod id `aclrtGetDeviceInfo` answers, and the base its super-pod device ids start from (the physical id is added); both default 0 |
//! | `HCCL_INTRA_ROCE_ENABLE` | `1`: ranks on one server use RoCE rules instead of HCCS IPC |
//! | `FERRY_CANN_EMU_FAIL` | `<symbol>:<n>[:<code>][,...]`: the n-th call (1-based, per process) of `symbol` fails; `n` may be `a-b` (inclusive) or `*` (every call); the code defaults to a plausible one for the symbol (see `faults`) |
//! | `FERRY_CANN_EMU_DELAY_US` | `<symbol>:<us>[,...]`: each call of `symbol` takes `us` microseconds longer; for the stream-ordered calls (`aclrtMemcpyAsync`, `HcclSend`, `HcclRecv`, `HcclBatchGet`, `HcclBatchPut`) the delay is added to the queued operation, not to the call |
//! | `FERRY_CANN_EMU_NO_ONESIDED` | `1`: the one-sided HCCL calls answer `HCCL_E_NOT_SUPPORT` (5) though their symbols exist |
//! | `FERRY_CANN_EMU_LOG` | `1`: log every call, its arguments and its result to stderr (HIXL calls too) |
//! | `FERRY_CANN_EMU_HIXL_MAX_LINKS` | the legacy HIXL engine's link limit (client and server links together; default 512, HIXL's `kDefaultMaxChannel`); beyond it `Connect` answers `RESOURCE_EXHAUSTED` |
//! | `HCCL_IF_IP` | address the root-info listeners bind (default `127.0.0.1`) |
//! | `HCCL_CONNECT_TIMEOUT` | seconds to wait for peers during communicator set-up (default 120) |
//! | `HCCL_EXEC_TIMEOUT` | seconds an HCCL operation may wait for its peer (default 1800) |
//!
//! HIXL entry points take the names `adxl.<Method>` and `hixl.<Method>` in these variables (see
//! [`hixl::HIXL_SYMBOLS`]); `hixl.ServeConnect` and `hixl.ServeTransfer` name the *server* side of
//! a link's handshake and of a transfer batch, so a delay there makes the peer's `Connect` or
//! `TransferSync` time out and a failure makes the server refuse (`FAILED`).
//!
//! ## Error codes the emulator chose
//!
//! Where CANN documents a code it is used ([`codes`]). Choices where it does not:
//! `aclrtSynchronizeStreamWithTimeout` past its timeout returns
//! [`ACL_ERROR_RT_STREAM_SYNC_TIMEOUT`] (507046). A one-sided request for remote memory the peer
//! has not bound is refused by `HcclBatchGet`/`HcclBatchPut` with [`HCCL_E_PARA`]; if the peer
//! refuses at execution time (it unbound the memory meanwhile) the stream reports
//! [`ACL_ERROR_RT_SUSPECT_REMOTE_ERROR`] (507057) at synchronize. A broken link is
//! [`ACL_ERROR_RT_LINK_ERROR`] (507056), an operation that waited longer than `HCCL_EXEC_TIMEOUT`
//! is [`ACL_ERROR_RT_TASK_TIMEOUT`] (107020). A panic inside the emulator becomes
//! [`ACL_ERROR_RT_INTERNAL_ERROR`] or [`HCCL_E_INTERNAL`]; it never crosses the C boundary.
//!
//! ## Exports beyond the reference
//!
//! Mooncake's `mooncake-transfer-engine-npu` wheel (0.3.11.post1, 0.3.13.post1) imports these
//! `acl*` symbols too, and Python loads it with `RTLD_NOW`, so they must exist
//! (`tests/fixtures/mooncake-npu-acl-imports.txt` lists what the wheels import). Module
//! `acl_extras` has their CANN signatures and sources.
//!
//! | symbol | what the emulator does |
//! | --- | --- |
//! | `aclrtCreateStreamWithConfig` | a stream like `aclrtCreateStream`; priority ignored (CANN clamps it to 0..=7); `FAST_LAUNCH`/`FAST_SYNC`/`HUGE` accepted, `PERSISTENT`/`CPU_SCHEDULE`/`DEVICE_USE_ONLY` → 207000 |
//! | `aclrtMemcpyBatch` | synchronous H2D/D2H copies with CANN's argument checks (100000 from the ACL layer, 107000 from the runtime layer) and `failIndex` |
//! | `aclrtHostRegister`, `aclrtHostUnregister` | per-device registration of 4 KB-aligned ranges inside `aclrtMallocHost` memory; `*devPtr = ptr` (identity mapping); other memory → 507899, overlap → 507910, unknown pointer on unregister → 507911 |
//! | `aclrtMemGetAllocationGranularity` | 2 MiB for huge-page attributes, 1 GiB for `HUGE1G`, 4 KiB for normal pages |
//! | `aclrtReserveMemAddress`, `aclrtReserveMemAddressNoUCMemory`, `aclrtReleaseMemAddress`, `aclrtMallocPhysical`, `aclrtFreePhysical`, `aclrtMapMem`, `aclrtUnmapMem`, `aclrtMemSetAccess` | not modelled: CANN's argument checks (100000), then `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` (207000) |
//! | `aclrtMemExportToShareableHandleV2`, `aclrtMemImportFromShareableHandleV2` | not modelled: argument checks, then 207000 |
//! | `aclrtIpcMemGetExportKey`, `aclrtIpcMemClose`, `aclrtIpcMemImportByKey` | not modelled: argument checks, then 207000 |
//!
//! And one Ferry calls (module `acl`): `aclrtStreamQuery`, whether a stream's tasks have all
//! finished (`ACL_STREAM_STATUS_COMPLETE` 0 / `NOT_READY` 1), without reporting their errors
//! (the next synchronize does).
//!
//! ## Layout
//!
//! `acl` (ACL exports), `acl_extras` (the exports beyond the reference), `hixl` (the emulated
//! HIXL/ADXL: mangled C++ exports, engines, links; its C++ half is `cpp/hixl_layout.cc`, built by
//! `build.rs`), `device` (devices, contexts, per-thread state), `memory` (emulated device
//! and host allocations), `stream` (ordered streams with a worker thread each), `hccl` (common
//! communicator state and exports), `hccl_two_sided` (root info, send/recv), `hccl_one_sided`
//! (global memory, batch get/put), `endpoint` (per-device listeners), `rank_table`, `wire`
//! (framing on the sockets; nothing read from a socket is trusted), `faults`, `config`.

mod acl;
mod acl_extras;
mod boundary;
pub mod codes;
mod config;
mod device;
mod endpoint;
mod faults;
mod handles;
mod hccl;
#[cfg(feature = "onesided")]
mod hccl_one_sided;
mod hccl_two_sided;
pub mod hixl;
mod memory;
mod rank_table;
mod stream;
pub mod types;
mod wire;

pub use acl::*;
pub use acl_extras::*;
pub use codes::*;
pub use config::{parse_mounted, parse_visible_devices};
pub use hccl::*;
#[cfg(feature = "onesided")]
pub use hccl_one_sided::IPC_ALIGNMENT;
#[cfg(feature = "onesided")]
pub use hccl_one_sided::*;
pub use hccl_two_sided::*;
pub use types::*;

/// The ACL and two-sided HCCL symbols, exported by every build: the reference's, in its order,
/// then the ACL calls Mooncake's `mooncake-transfer-engine-npu` wheel imports (see "Exports
/// beyond the reference").
pub const BASE_SYMBOLS: &[&str] = &[
    "aclInit",
    "aclFinalize",
    "aclrtSetDevice",
    "aclrtResetDevice",
    "aclrtGetDevice",
    "aclrtGetDeviceCount",
    "aclrtMalloc",
    "aclrtFree",
    "aclrtMallocHost",
    "aclrtFreeHost",
    "aclrtMemcpy",
    "aclrtMemcpyAsync",
    "aclrtCreateStream",
    "aclrtDestroyStream",
    "aclrtSynchronizeStream",
    "aclrtSynchronizeStreamWithTimeout",
    "aclrtCreateContext",
    "aclrtDestroyContext",
    "aclrtSetCurrentContext",
    "aclrtGetCurrentContext",
    "aclrtGetVersion",
    "aclrtGetPhyDevIdByUserDevId",
    "aclrtGetPhyDevIdByLogicDevId",
    "aclrtGetLogicDevIdByUserDevId",
    "aclrtStreamAbort",
    "aclrtGetDeviceInfo",
    "aclrtPointerGetAttributes",
    "aclrtGetSocName",
    "aclGetRecentErrMsg",
    // Beyond the reference: what Mooncake's NPU wheel imports (module `acl_extras`).
    "aclrtCreateStreamWithConfig",
    "aclrtMemcpyBatch",
    "aclrtHostRegister",
    "aclrtHostUnregister",
    "aclrtMemGetAllocationGranularity",
    "aclrtReserveMemAddress",
    "aclrtReserveMemAddressNoUCMemory",
    "aclrtReleaseMemAddress",
    "aclrtMallocPhysical",
    "aclrtFreePhysical",
    "aclrtMapMem",
    "aclrtUnmapMem",
    "aclrtMemSetAccess",
    "aclrtMemExportToShareableHandleV2",
    "aclrtMemImportFromShareableHandleV2",
    "aclrtIpcMemGetExportKey",
    "aclrtIpcMemClose",
    "aclrtIpcMemImportByKey",
    // Beyond the reference and the wheel: what Ferry polls a stream with (module `acl`).
    "aclrtStreamQuery",
    "HcclGetRootInfo",
    "HcclCommInitRootInfo",
    "HcclCommInitClusterInfo",
    "HcclCommDestroy",
    "HcclSend",
    "HcclRecv",
    "HcclGetRankId",
    "HcclGetRankSize",
    "HcclGetErrorString",
];

/// Every C symbol this build exports: [`BASE_SYMBOLS`], then [`ONE_SIDED_SYMBOLS`] when the
/// `onesided` feature is on.
pub fn exported_symbols() -> Vec<&'static str> {
    let mut all = BASE_SYMBOLS.to_vec();
    if cfg!(feature = "onesided") {
        all.extend_from_slice(ONE_SIDED_SYMBOLS);
    }
    all
}

/// The one-sided HCCL symbols (exported only with the `onesided` feature).
pub const ONE_SIDED_SYMBOLS: &[&str] = &[
    "HcclRegisterGlobalMem",
    "HcclDeregisterGlobalMem",
    "HcclCommInitClusterInfoMemConfig",
    "HcclCommBindMem",
    "HcclCommUnbindMem",
    "HcclCommPrepare",
    "HcclBatchPut",
    "HcclBatchGet",
];
