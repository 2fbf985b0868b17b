//! The C surface as declared in CANN's headers (see the reference `ascend-cann.md`): plain
//! types, `#[repr(C)]` structs and function-pointer types. C enums are `i32`, never Rust enums.

use std::ffi::{c_char, c_int, c_void};

/// `aclError` (0 = success).
pub type AclError = c_int;
/// `HcclResult` (0 = success).
pub type HcclResult = c_int;
/// `aclrtStream`.
pub type AclrtStream = *mut c_void;
/// `HcclComm`.
pub type HcclComm = *mut c_void;

/// `HcclDataType` value `HCCL_DATA_TYPE_UINT8` (counts are then bytes).
pub const HCCL_DATA_TYPE_UINT8: i32 = 7;
/// Most descriptors one `HcclBatchGet`/`HcclBatchPut` call takes.
pub const MAX_BATCH_DESCRIPTORS: usize = 256;
/// `aclrtMemMallocPolicy` values.
pub mod malloc_policy {
    /// `ACL_MEM_MALLOC_HUGE_FIRST`: huge pages when the size allows, else normal ones.
    pub const HUGE_FIRST: i32 = 0;
    /// `ACL_MEM_MALLOC_HUGE_ONLY`: huge (2 MiB) pages only.
    pub const HUGE_ONLY: i32 = 1;
    /// `ACL_MEM_MALLOC_NORMAL_ONLY`: normal pages only.
    pub const NORMAL_ONLY: i32 = 2;
}

/// `aclrtMemLocationType` values (the `type` of [`AclrtPtrAttributes`]).
pub mod mem_location {
    /// `ACL_MEM_LOCATION_TYPE_HOST`: host memory from `aclrtMallocHost`.
    pub const HOST: i32 = 0;
    /// `ACL_MEM_LOCATION_TYPE_DEVICE`.
    pub const DEVICE: i32 = 1;
    /// `ACL_MEM_LOCATION_TYPE_UNREGISTERED`: host memory the runtime does not know.
    pub const UNREGISTERED: i32 = 2;
}

/// `aclrtMemcpyKind` values.
pub mod memcpy_kind {
    /// Host to host.
    pub const HOST_TO_HOST: i32 = 0;
    /// Host to device.
    pub const HOST_TO_DEVICE: i32 = 1;
    /// Device to host.
    pub const DEVICE_TO_HOST: i32 = 2;
    /// Device to device.
    pub const DEVICE_TO_DEVICE: i32 = 3;
}
/// `CommMem.type` values.
pub mod comm_mem_type {
    /// Device (HBM) memory.
    pub const DEVICE: i32 = 0;
    /// Host memory.
    pub const HOST: i32 = 1;
}

/// `HcclRootInfo`: 4108 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HcclRootInfo {
    /// Opaque content.
    pub internal: [c_char; HCCL_ROOT_INFO_BYTES],
}

/// Size of [`HcclRootInfo`].
pub const HCCL_ROOT_INFO_BYTES: usize = 4108;

/// `CommMem` (24 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CommMem {
    /// 0 device, 1 host.
    pub mem_type: i32,
    /// First byte.
    pub addr: *mut c_void,
    /// Length in bytes.
    pub size: u64,
}

/// `HcclOneSideOpDesc` (32 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct HcclOneSideOpDesc {
    /// Local address.
    pub local_addr: *mut c_void,
    /// The remote rank's address.
    pub remote_addr: *mut c_void,
    /// Element count.
    pub count: u64,
    /// `HcclDataType`.
    pub data_type: i32,
}

/// `HcclPrepareConfig` (32 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct HcclPrepareConfig {
    /// 0 = full mesh.
    pub topo_type: i32,
    /// Reserved.
    pub rsvd0: u64,
    /// Reserved.
    pub rsvd1: u64,
    /// Reserved.
    pub rsvd2: u64,
}

/// Magic of `HcclCommConfig`.
pub const HCCL_COMM_CONFIG_MAGIC: u32 = 0xf0f0_f0f0;
/// Version of the `HcclCommConfig` layout below.
pub const HCCL_COMM_CONFIG_VERSION: u32 = 5;
/// Size of `commName` and `udi`.
pub const HCCL_COMM_NAME_BYTES: usize = 128;

/// `HcclCommConfig`, version 5 (what ADXL passes to `HcclCommInitClusterInfoMemConfig`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HcclCommConfig {
    /// `sizeof` this struct.
    pub size: usize,
    /// [`HCCL_COMM_CONFIG_MAGIC`].
    pub magic: u32,
    /// [`HCCL_COMM_CONFIG_VERSION`].
    pub version: u32,
    /// Reserved.
    pub reserved: u64,
    /// Buffer size in MB (ADXL: 200).
    pub buffer_size_mb: u32,
    /// Deterministic reductions (0).
    pub deterministic: u32,
    /// NUL-terminated communicator name.
    pub comm_name: [c_char; HCCL_COMM_NAME_BYTES],
    /// NUL-terminated UDI ("").
    pub udi: [c_char; HCCL_COMM_NAME_BYTES],
    /// Op expansion mode (0).
    pub op_expansion_mode: u32,
    /// RDMA traffic class (0xffffffff = default).
    pub rdma_traffic_class: u32,
    /// RDMA service level (0xffffffff = default).
    pub rdma_service_level: u32,
}

/// `aclrtPointerGetAttributes` output: `{u32 id; int type; u32 pageSize; u32 rsv[4]}`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AclrtPtrAttributes {
    /// Device id.
    pub id: u32,
    /// Memory type (values are CANN's; kept as an integer).
    pub mem_type: i32,
    /// Page size.
    pub page_size: u32,
    /// Reserved.
    pub rsv: [u32; 4],
}

// ACL.
/// `aclInit`.
pub type AclInit = unsafe extern "C" fn(config_path: *const c_char) -> AclError;
/// `aclrtSetDevice` / `aclrtResetDevice`.
pub type AclrtSetDevice = unsafe extern "C" fn(device_id: i32) -> AclError;
/// `aclrtGetDevice`.
pub type AclrtGetDevice = unsafe extern "C" fn(device_id: *mut i32) -> AclError;
/// `aclrtGetDeviceCount`.
pub type AclrtGetDeviceCount = unsafe extern "C" fn(count: *mut u32) -> AclError;
/// `aclrtMalloc`.
pub type AclrtMalloc = unsafe extern "C" fn(dev_ptr: *mut *mut c_void, size: usize, policy: c_int) -> AclError;
/// `aclrtFree` / `aclrtFreeHost`.
pub type AclrtFree = unsafe extern "C" fn(ptr: *mut c_void) -> AclError;
/// `aclrtMallocHost`.
pub type AclrtMallocHost = unsafe extern "C" fn(host_ptr: *mut *mut c_void, size: usize) -> AclError;
/// `aclrtMemcpy`.
pub type AclrtMemcpy =
    unsafe extern "C" fn(dst: *mut c_void, dest_max: usize, src: *const c_void, count: usize, kind: c_int) -> AclError;
/// `aclrtCreateStream`.
pub type AclrtCreateStream = unsafe extern "C" fn(stream: *mut AclrtStream) -> AclError;
/// `aclrtDestroyStream` / `aclrtSynchronizeStream` / `aclrtStreamAbort`.
pub type AclrtStreamOp = unsafe extern "C" fn(stream: AclrtStream) -> AclError;
/// `aclrtSynchronizeStreamWithTimeout`.
pub type AclrtSynchronizeStreamWithTimeout = unsafe extern "C" fn(stream: AclrtStream, timeout_ms: i32) -> AclError;
/// `aclrtGetPhyDevIdByUserDevId` / `aclrtGetPhyDevIdByLogicDevId`.
pub type AclrtGetPhyDevId = unsafe extern "C" fn(id: i32, phy: *mut i32) -> AclError;
/// `aclrtPointerGetAttributes`.
pub type AclrtPointerGetAttributes =
    unsafe extern "C" fn(ptr: *const c_void, attr: *mut AclrtPtrAttributes) -> AclError;
/// `aclrtStreamQuery(stream, status)`: `*status` is [`ACL_STREAM_STATUS_COMPLETE`] once every
/// task of the stream finished, [`ACL_STREAM_STATUS_NOT_READY`] before (CANN
/// `aclrtStreamQuery`, `aclrtStreamStatus`).
pub type AclrtStreamQuery = unsafe extern "C" fn(stream: AclrtStream, status: *mut c_int) -> AclError;
/// `ACL_STREAM_STATUS_COMPLETE`.
pub const ACL_STREAM_STATUS_COMPLETE: c_int = 0;
/// `ACL_STREAM_STATUS_NOT_READY`.
pub const ACL_STREAM_STATUS_NOT_READY: c_int = 1;
/// An ACL context handle (`aclrtContext`).
pub type AclrtContext = *mut c_void;
/// `aclrtGetCurrentContext(context)`: the calling thread's current context (CANN
/// `aclrtGetCurrentContext`: "obtains the bound context of a thread"; an error when the thread
/// has none).
pub type AclrtGetCurrentContext = unsafe extern "C" fn(context: *mut AclrtContext) -> AclError;
/// `aclrtGetDeviceInfo(deviceId, attr, value)`.
pub type AclrtGetDeviceInfo = unsafe extern "C" fn(device_id: u32, attr: c_int, value: *mut i64) -> AclError;
/// `aclrtDevAttr` values Ferry reads (runtime `acl_rt.h` l.683-686).
pub mod dev_attr {
    /// `ACL_DEV_ATTR_SUPER_POD_DEVICE_ID`: the device's id within its Atlas A3 super pod.
    pub const SUPER_POD_DEVICE_ID: i32 = 403;
    /// `ACL_DEV_ATTR_SUPER_POD_ID`: the device's Atlas A3 super pod.
    pub const SUPER_POD_ID: i32 = 405;
}
/// `aclrtGetVersion`.
pub type AclrtGetVersion = unsafe extern "C" fn(major: *mut i32, minor: *mut i32, patch: *mut i32) -> AclError;
/// `aclGetRecentErrMsg` / `aclrtGetSocName`.
pub type AclGetText = unsafe extern "C" fn() -> *const c_char;

// HCCL.
/// `HcclGetRootInfo`.
pub type HcclGetRootInfo = unsafe extern "C" fn(root: *mut HcclRootInfo) -> HcclResult;
/// `HcclCommInitRootInfo`.
pub type HcclCommInitRootInfo =
    unsafe extern "C" fn(n_ranks: u32, root: *const HcclRootInfo, rank: u32, comm: *mut HcclComm) -> HcclResult;
/// `HcclCommDestroy`.
pub type HcclCommDestroy = unsafe extern "C" fn(comm: HcclComm) -> HcclResult;
/// `HcclSend` / `HcclRecv`.
pub type HcclSendRecv = unsafe extern "C" fn(
    buf: *mut c_void,
    count: u64,
    data_type: c_int,
    peer: u32,
    comm: HcclComm,
    stream: AclrtStream,
) -> HcclResult;
/// `HcclGetErrorString`.
pub type HcclGetErrorString = unsafe extern "C" fn(code: HcclResult) -> *const c_char;
/// `HcclGetRankId` / `HcclGetRankSize`.
pub type HcclCommQuery = unsafe extern "C" fn(comm: HcclComm, out: *mut u32) -> HcclResult;
/// `HcclRegisterGlobalMem`.
pub type HcclRegisterGlobalMem = unsafe extern "C" fn(mem: *const CommMem, handle: *mut *mut c_void) -> HcclResult;
/// `HcclDeregisterGlobalMem`.
pub type HcclDeregisterGlobalMem = unsafe extern "C" fn(handle: *mut c_void) -> HcclResult;
/// `HcclCommInitClusterInfoMemConfig`.
pub type HcclCommInitClusterInfoMemConfig = unsafe extern "C" fn(
    rank_table_json: *const c_char,
    rank: u32,
    config: *mut c_void,
    comm: *mut HcclComm,
) -> HcclResult;
/// `HcclCommBindMem` / `HcclCommUnbindMem`.
pub type HcclCommMem = unsafe extern "C" fn(comm: HcclComm, handle: *mut c_void) -> HcclResult;
/// `HcclCommPrepare`.
pub type HcclCommPrepare =
    unsafe extern "C" fn(comm: HcclComm, config: *const HcclPrepareConfig, timeout_s: c_int) -> HcclResult;
/// `HcclBatchPut` / `HcclBatchGet`.
pub type HcclBatchOp = unsafe extern "C" fn(
    comm: HcclComm,
    remote_rank: u32,
    desc: *mut HcclOneSideOpDesc,
    n: u32,
    stream: AclrtStream,
) -> HcclResult;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_layouts_match_the_headers() {
        assert_eq!(std::mem::size_of::<CommMem>(), 24);
        assert_eq!(std::mem::size_of::<HcclOneSideOpDesc>(), 32);
        assert_eq!(std::mem::size_of::<HcclPrepareConfig>(), 32);
        assert_eq!(std::mem::size_of::<HcclRootInfo>(), 4108);
        assert_eq!(std::mem::offset_of!(HcclCommConfig, buffer_size_mb), 24);
        assert_eq!(std::mem::offset_of!(HcclCommConfig, comm_name), 32);
        assert_eq!(std::mem::offset_of!(HcclCommConfig, op_expansion_mode), 288);
    }
}
