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

/// `aclrtMemLocationType` `ACL_MEM_LOCATION_TYPE_MANAGED` (runtime `acl_rt.h` l.314-320).
pub const ACL_MEM_LOCATION_TYPE_MANAGED: i32 = 3;
/// `aclrtMemLocationType` `ACL_MEM_LOCATION_TYPE_HOST_NUMA` (runtime `acl_rt.h` l.314-320).
pub const ACL_MEM_LOCATION_TYPE_HOST_NUMA: i32 = 4;

/// `aclrtCreateStreamWithConfig` flag `ACL_STREAM_FAST_LAUNCH` (runtime `acl_rt.h` l.36).
pub const ACL_STREAM_FAST_LAUNCH: u32 = 0x01;
/// `aclrtCreateStreamWithConfig` flag `ACL_STREAM_FAST_SYNC` (runtime `acl_rt.h` l.37).
pub const ACL_STREAM_FAST_SYNC: u32 = 0x02;
/// `aclrtCreateStreamWithConfig` flag `ACL_STREAM_PERSISTENT` (runtime `acl_rt.h` l.38).
pub const ACL_STREAM_PERSISTENT: u32 = 0x04;
/// `aclrtCreateStreamWithConfig` flag `ACL_STREAM_HUGE` (runtime `acl_rt.h` l.39).
pub const ACL_STREAM_HUGE: u32 = 0x08;
/// `aclrtCreateStreamWithConfig` flag `ACL_STREAM_CPU_SCHEDULE` (runtime `acl_rt.h` l.40).
pub const ACL_STREAM_CPU_SCHEDULE: u32 = 0x10;
/// `aclrtCreateStreamWithConfig` flag `ACL_STREAM_DEVICE_USE_ONLY` (runtime `acl_rt.h` l.41).
pub const ACL_STREAM_DEVICE_USE_ONLY: u32 = 0x20;

/// `aclrtHostRegisterType` `ACL_HOST_REGISTER_MAPPED` (runtime `acl_rt.h` l.191-195).
pub const ACL_HOST_REGISTER_MAPPED: i32 = 0;
/// `aclrtHostRegisterType` `ACL_HOST_REGISTER_IOMEMORY`.
pub const ACL_HOST_REGISTER_IOMEMORY: i32 = 0x04;
/// `aclrtHostRegisterType` `ACL_HOST_REGISTER_READONLY`.
pub const ACL_HOST_REGISTER_READONLY: i32 = 0x08;

/// `aclrtMemGranularityOptions` `ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM` (runtime `acl_rt.h` l.377-381).
pub const ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM: i32 = 0;
/// `aclrtMemGranularityOptions` `ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED`.
pub const ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED: i32 = 1;

/// `aclrtMemAttr` values (runtime `acl_rt.h` l.227-246), in enum order.
pub mod mem_attr {
    /// `ACL_DDR_MEM`.
    pub const ACL_DDR_MEM: i32 = 0;
    /// `ACL_HBM_MEM`.
    pub const ACL_HBM_MEM: i32 = 1;
    /// `ACL_DDR_MEM_HUGE`.
    pub const ACL_DDR_MEM_HUGE: i32 = 2;
    /// `ACL_DDR_MEM_NORMAL`.
    pub const ACL_DDR_MEM_NORMAL: i32 = 3;
    /// `ACL_HBM_MEM_HUGE`.
    pub const ACL_HBM_MEM_HUGE: i32 = 4;
    /// `ACL_HBM_MEM_NORMAL`.
    pub const ACL_HBM_MEM_NORMAL: i32 = 5;
    /// `ACL_DDR_MEM_P2P_HUGE`.
    pub const ACL_DDR_MEM_P2P_HUGE: i32 = 6;
    /// `ACL_DDR_MEM_P2P_NORMAL`.
    pub const ACL_DDR_MEM_P2P_NORMAL: i32 = 7;
    /// `ACL_HBM_MEM_P2P_HUGE`.
    pub const ACL_HBM_MEM_P2P_HUGE: i32 = 8;
    /// `ACL_HBM_MEM_P2P_NORMAL`.
    pub const ACL_HBM_MEM_P2P_NORMAL: i32 = 9;
    /// `ACL_HBM_MEM_HUGE1G`.
    pub const ACL_HBM_MEM_HUGE1G: i32 = 10;
    /// `ACL_HBM_MEM_P2P_HUGE1G`.
    pub const ACL_HBM_MEM_P2P_HUGE1G: i32 = 11;
    /// `ACL_MEM_NORMAL`.
    pub const ACL_MEM_NORMAL: i32 = 12;
    /// `ACL_MEM_HUGE`.
    pub const ACL_MEM_HUGE: i32 = 13;
    /// `ACL_MEM_HUGE1G`.
    pub const ACL_MEM_HUGE1G: i32 = 14;
    /// `ACL_MEM_P2P_NORMAL`.
    pub const ACL_MEM_P2P_NORMAL: i32 = 15;
    /// `ACL_MEM_P2P_HUGE`.
    pub const ACL_MEM_P2P_HUGE: i32 = 16;
    /// `ACL_MEM_P2P_HUGE1G`.
    pub const ACL_MEM_P2P_HUGE1G: i32 = 17;
}

/// `aclrtMemLocation`: `{ uint32_t id; aclrtMemLocationType type; }` (runtime `acl_rt.h` l.322-325).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AclrtMemLocation {
    /// Device id when `location_type` is `ACL_MEM_LOCATION_TYPE_DEVICE`.
    pub id: u32,
    /// `ACL_MEM_LOCATION_TYPE_*`.
    pub location_type: i32,
}

/// `aclrtMemcpyBatchAttr`: `{ aclrtMemLocation dstLoc; aclrtMemLocation srcLoc; uint8_t rsv[16]; }`
/// (runtime `acl_rt.h` l.754-758).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AclrtMemcpyBatchAttr {
    /// Where the destinations of the copies this attribute applies to live.
    pub dst_loc: AclrtMemLocation,
    /// Where their sources live.
    pub src_loc: AclrtMemLocation,
    /// Reserved, must be 0.
    pub rsv: [u8; 16],
}

/// `aclrtPhysicalMemProp`: `{ aclrtMemHandleType handleType; aclrtMemAllocationType
/// allocationType; aclrtMemAttr memAttr; aclrtMemLocation location; uint64_t reserve; }`
/// (runtime `acl_rt.h` l.369-375).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AclrtPhysicalMemProp {
    /// `aclrtMemHandleType` (`ACL_MEM_HANDLE_TYPE_NONE` = 0).
    pub handle_type: i32,
    /// `aclrtMemAllocationType` (`ACL_MEM_ALLOCATION_TYPE_PINNED` = 0).
    pub allocation_type: i32,
    /// `aclrtMemAttr` (see [`mem_attr`]).
    pub mem_attr: i32,
    /// Where the memory lives.
    pub location: AclrtMemLocation,
    /// Reserved.
    pub reserve: u64,
}

/// `aclrtMemAccessDesc`: `{ aclrtMemAccessFlags flags; aclrtMemLocation location; uint8_t rsv[12]; }`
/// (runtime `acl_rt.h` l.946-956).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AclrtMemAccessDesc {
    /// `aclrtMemAccessFlags`.
    pub flags: i32,
    /// Which device gets the access.
    pub location: AclrtMemLocation,
    /// Reserved.
    pub rsv: [u8; 12],
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
const _: () = assert!(size_of::<AclrtMemLocation>() == 8);
const _: () = assert!(size_of::<AclrtMemcpyBatchAttr>() == 32);
const _: () = assert!(size_of::<AclrtPhysicalMemProp>() == 32);
const _: () = assert!(size_of::<AclrtMemAccessDesc>() == 24);

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
