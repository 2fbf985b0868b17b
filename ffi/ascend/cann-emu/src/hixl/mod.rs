//! The emulated HIXL (`libllm_datadist.so` for `adxl::AdxlEngine`, `libcann_hixl.so` for
//! `hixl::Hixl`, `libmetadef.so` for `ge::AscendString`): the same shared object as the emulated
//! ACL and HCCL, so HIXL uses the emulator's devices and memory.
//!
//! An engine is a real TCP server on its `ip:port` (when the port is > 0); a link is a TCP
//! connection to another engine's server, made by `Connect` or, with `AutoConnect=1`, by the
//! first transfer; transfers move the bytes over the link between processes. The rules and
//! their HIXL sources are in `docs/ascend.md` ("What the emulated HIXL enforces, and its
//! sources") and beside the code in `engine`, `options`, `server` and `exports`.
//!
//! | module | what |
//! | --- | --- |
//! | `abi` | the C++ layouts (`AscendString`, the options map, the descriptor vector) through `cpp/hixl_layout.cc` |
//! | `exports` | the mangled entry points and the wrapper-level checks |
//! | `options` | engine names and `Initialize` options |
//! | `engine` | registrations, links, transfers, asynchronous requests |
//! | `server` | an engine's listener and the serving side of its links |
//! | `wire` | the protocol between emulated engines |

pub(crate) mod abi;
mod engine;
pub(crate) mod exports;
mod options;
mod server;
mod wire;

pub use abi::{AscendString, DescVec, MemDesc, OptionMap, TransferArgs, TransferOpDesc};
pub use engine::DEFAULT_MAX_LINKS;
pub use exports::*;

/// `MemType::MEM_DEVICE`.
pub const HIXL_MEM_DEVICE: i32 = 0;
/// `MemType::MEM_HOST`.
pub const HIXL_MEM_HOST: i32 = 1;
/// `TransferOp::READ`: remote memory into local memory.
pub const HIXL_READ: i32 = 0;
/// `TransferOp::WRITE`: local memory into remote memory.
pub const HIXL_WRITE: i32 = 1;
/// `TransferStatus::WAITING`.
pub const HIXL_STATUS_WAITING: i32 = 0;
/// `TransferStatus::COMPLETED`.
pub const HIXL_STATUS_COMPLETED: i32 = 1;
/// `TransferStatus::TIMEOUT` (HIXL documents it as not supported yet; never reported).
pub const HIXL_STATUS_TIMEOUT: i32 = 2;
/// `TransferStatus::FAILED`.
pub const HIXL_STATUS_FAILED: i32 = 3;
/// `FeatureType::AUTO_CONNECT`.
pub const HIXL_FEATURE_AUTO_CONNECT: i32 = 0;
/// `FeatureType::CLIENT_SERVER_COMM`.
pub const HIXL_FEATURE_CLIENT_SERVER_COMM: i32 = 1;

/// `ge::AscendString` exports (`libmetadef.so`), mangled: `AscendString(const char*)`,
/// `operator<(const AscendString&) const`.
pub const GE_EXPORTS: &[&str] = &["_ZN2ge12AscendStringC1EPKc", "_ZNK2ge12AscendStringltERKS0_"];

/// `adxl::AdxlEngine` exports (`libllm_datadist.so`), mangled, in the order: C1, D1,
/// Initialize, Finalize, RegisterMem, DeregisterMem, Connect, Disconnect, TransferSync,
/// TransferAsync, GetTransferStatus, MallocMem, FreeMem, GetCapability,
/// ExportToShareableHandle. The first nine are what Mooncake's wheel imports strongly.
pub const ADXL_EXPORTS: &[&str] = &[
    "_ZN4adxl10AdxlEngineC1Ev",
    "_ZN4adxl10AdxlEngineD1Ev",
    "_ZN4adxl10AdxlEngine10InitializeERKN2ge12AscendStringERKSt3mapIS2_S2_St4lessIS2_ESaISt4pairIS3_S2_EEE",
    "_ZN4adxl10AdxlEngine8FinalizeEv",
    "_ZN4adxl10AdxlEngine11RegisterMemERKNS_7MemDescENS_7MemTypeERPv",
    "_ZN4adxl10AdxlEngine13DeregisterMemEPv",
    "_ZN4adxl10AdxlEngine7ConnectERKN2ge12AscendStringEi",
    "_ZN4adxl10AdxlEngine10DisconnectERKN2ge12AscendStringEi",
    "_ZN4adxl10AdxlEngine12TransferSyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EEi",
    "_ZN4adxl10AdxlEngine13TransferAsyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EERKNS_12TransferArgsERPv",
    "_ZN4adxl10AdxlEngine17GetTransferStatusERKPvRNS_14TransferStatusE",
    "_ZN4adxl10AdxlEngine9MallocMemENS_7MemTypeEmPPv",
    "_ZN4adxl10AdxlEngine7FreeMemEPv",
    "_ZN4adxl10AdxlEngine13GetCapabilityENS_11FeatureTypeERi",
    "_ZN4adxl10AdxlEngine23ExportToShareableHandleEPvR20aclrtMemFabricHandle",
];

/// `hixl::Hixl` exports (`libcann_hixl.so`, CANN ≥ 8.5), mangled, in the order: C1, D1,
/// Initialize, Finalize, RegisterMem, DeregisterMem, Connect, Disconnect, TransferSync,
/// TransferAsync, GetTransferStatus(const TransferReq&, TransferStatus&), GetCapability.
/// Derived by compiling Ferry's own declarations (`cpp/ferry_hixl_abi.hpp`) with g++.
pub const HIXL_EXPORTS: &[&str] = &[
    "_ZN4hixl4HixlC1Ev",
    "_ZN4hixl4HixlD1Ev",
    "_ZN4hixl4Hixl10InitializeERKN2ge12AscendStringERKSt3mapIS2_S2_St4lessIS2_ESaISt4pairIS3_S2_EEE",
    "_ZN4hixl4Hixl8FinalizeEv",
    "_ZN4hixl4Hixl11RegisterMemERKNS_7MemDescENS_7MemTypeERPv",
    "_ZN4hixl4Hixl13DeregisterMemEPv",
    "_ZN4hixl4Hixl7ConnectERKN2ge12AscendStringEi",
    "_ZN4hixl4Hixl10DisconnectERKN2ge12AscendStringEi",
    "_ZN4hixl4Hixl12TransferSyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EEi",
    "_ZN4hixl4Hixl13TransferAsyncERKN2ge12AscendStringENS_10TransferOpERKSt6vectorINS_14TransferOpDescESaIS7_EERKNS_12TransferArgsERPv",
    "_ZN4hixl4Hixl17GetTransferStatusERKPvRNS_14TransferStatusE",
    "_ZN4hixl4Hixl13GetCapabilityENS_11FeatureTypeERi",
];

/// The names the HIXL entry points have in logs, `FERRY_CANN_EMU_FAIL` and
/// `FERRY_CANN_EMU_DELAY_US` (`adxl.<Method>`, `hixl.<Method>`), plus the server-side
/// operations `hixl.ServeConnect` (answering a new link) and `hixl.ServeTransfer` (serving a
/// batch): a delay there makes the peer's `Connect`/`TransferSync` time out, a failure makes it
/// refuse.
pub const HIXL_SYMBOLS: &[&str] = &[
    "adxl.Initialize",
    "adxl.RegisterMem",
    "adxl.DeregisterMem",
    "adxl.Connect",
    "adxl.Disconnect",
    "adxl.TransferSync",
    "adxl.TransferAsync",
    "adxl.GetTransferStatus",
    "adxl.GetCapability",
    "adxl.MallocMem",
    "adxl.FreeMem",
    "adxl.ExportToShareableHandle",
    "hixl.Initialize",
    "hixl.RegisterMem",
    "hixl.DeregisterMem",
    "hixl.Connect",
    "hixl.Disconnect",
    "hixl.TransferSync",
    "hixl.TransferAsync",
    "hixl.GetTransferStatus",
    "hixl.GetCapability",
    server::SERVE_CONNECT,
    server::SERVE_TRANSFER,
];
