//! C types of the ACL and HCCL surface (layouts from the reference), and HCCL enum values.

use std::ffi::{c_char, c_void};

/// `aclrtStream`.
pub type AclrtStream = *mut c_void;
/// `aclrtContext`.
pub type AclrtContext = *mut c_void;
/// `HcclComm`.
pub type HcclComm = *mut c_void;

/// `HcclDataType` UINT8 (use with count = bytes).
pub const HCCL_DATA_TYPE_UINT8: i32 = 7;
/// `aclrtMemcpyKind` host to host.
pub const ACL_MEMCPY_HOST_TO_HOST: i32 = 0;
/// `aclrtMemcpyKind` host to device.
pub const ACL_MEMCPY_HOST_TO_DEVICE: i32 = 1;
/// `aclrtMemcpyKind` device to host.
pub const ACL_MEMCPY_DEVICE_TO_HOST: i32 = 2;
/// `aclrtMemcpyKind` device to device.
pub const ACL_MEMCPY_DEVICE_TO_DEVICE: i32 = 3;
/// `aclrtMemcpyKind` default (the runtime looks at the pointers).
pub const ACL_MEMCPY_DEFAULT: i32 = 4;
/// `aclrtMemLocationType` of `aclrtMallocHost` memory.
pub const ACL_MEM_LOCATION_TYPE_HOST: i32 = 0;
/// `aclrtMemLocationType` of device memory.
pub const ACL_MEM_LOCATION_TYPE_DEVICE: i32 = 1;
/// `aclrtMemLocationType` of memory the runtime does not know (plain `malloc`, the stack).
pub const ACL_MEM_LOCATION_TYPE_UNREGISTERED: i32 = 2;
/// `CommMem.type` of device memory.
pub const HCCL_MEM_TYPE_DEVICE: i32 = 0;
/// `CommMem.type` of host memory.
pub const HCCL_MEM_TYPE_HOST: i32 = 1;
/// Magic word of `HcclCommConfig`.
pub const HCCL_COMM_CONFIG_MAGIC: u32 = 0xf0f0_f0f0;
/// Size of `HcclRootInfo.internal`.
pub const HCCL_ROOT_INFO_BYTES: usize = 4108;
/// At most this many descriptors per `HcclBatchGet`/`HcclBatchPut` call.
pub const HCCL_MAX_ONE_SIDED_DESCS: u32 = 256;

/// `HcclRootInfo`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HcclRootInfo {
    /// Opaque bytes (the emulator stores its rendezvous endpoint and id here).
    pub internal: [c_char; HCCL_ROOT_INFO_BYTES],
}

impl Default for HcclRootInfo {
    fn default() -> Self {
        HcclRootInfo { internal: [0; HCCL_ROOT_INFO_BYTES] }
    }
}

/// `aclrtPtrAttributes`: `{ aclrtMemLocation { u32 id; int type; } location; u32 pageSize; u32 rsv[4]; }`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AclrtPtrAttributes {
    /// Device (user) id for device memory, 0 otherwise.
    pub id: u32,
    /// `ACL_MEM_LOCATION_TYPE_*`.
    pub location_type: i32,
    /// Page size of the allocation (0 when unregistered).
    pub page_size: u32,
    /// Reserved.
    pub rsv: [u32; 4],
}

/// `CommMem` (24 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CommMem {
    /// `HCCL_MEM_TYPE_DEVICE` (0) or `HCCL_MEM_TYPE_HOST` (1).
    pub mem_type: i32,
    /// Start of the memory.
    pub addr: *mut c_void,
    /// Length in bytes.
    pub size: u64,
}

/// `HcclOneSideOpDesc` (32 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct HcclOneSideOpDesc {
    /// Local memory (bound to the communicator).
    pub local_addr: *mut c_void,
    /// Remote memory (bound to the peer's communicator), as the peer's virtual address.
    pub remote_addr: *mut c_void,
    /// Number of elements.
    pub count: u64,
    /// `HcclDataType`.
    pub data_type: i32,
}

/// `HcclPrepareConfig` (32 bytes).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct HcclPrepareConfig {
    /// 0 = FULLMESH (the only value the emulator accepts).
    pub topo_type: i32,
    /// Reserved.
    pub rsvd0: u64,
    /// Reserved.
    pub rsvd1: u64,
    /// Reserved.
    pub rsvd2: u64,
}

/// The fixed head of `HcclCommConfig` (its first 24 bytes).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct HcclCommConfigHeader {
    /// `sizeof` the caller's config struct.
    pub size: usize,
    /// [`HCCL_COMM_CONFIG_MAGIC`].
    pub magic: u32,
    /// Struct version.
    pub version: u32,
    /// Reserved.
    pub reserved: u64,
}

const _: () = assert!(size_of::<CommMem>() == 24);
const _: () = assert!(size_of::<HcclOneSideOpDesc>() == 32);
const _: () = assert!(size_of::<HcclPrepareConfig>() == 32);
const _: () = assert!(size_of::<HcclCommConfigHeader>() == 24);
const _: () = assert!(size_of::<AclrtPtrAttributes>() == 28);
const _: () = assert!(size_of::<HcclRootInfo>() == 4108);

/// Size in bytes of one element of an `HcclDataType`, `None` if unknown.
pub(crate) fn data_type_size(data_type: i32) -> Option<u64> {
    Some(match data_type {
        0 | 7 | 14..=17 => 1,
        1 | 3 | 8 | 11 => 2,
        2 | 4 | 9 => 4,
        5 | 6 | 10 => 8,
        12 => 16,
        _ => return None,
    })
}
