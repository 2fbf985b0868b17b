//! ACL and HCCL status codes: the values Ferry tests for, and a name or description for each
//! code, used when the runtime gives no text of its own.

/// `HcclResult` value meaning "not supported" (`HCCL_E_NOT_SUPPORT`).
pub const HCCL_E_NOT_SUPPORT: i32 = 5;
/// `HcclResult` value of a timeout (`HCCL_E_TIMEOUT`).
pub const HCCL_E_TIMEOUT: i32 = 9;
/// `aclError` value of a repeated `aclInit` (treated as success).
pub const ACL_ERROR_REPEAT_INITIALIZE: i32 = 100_002;
/// `aclError` value of an invalid device id.
pub const ACL_ERROR_INVALID_DEVICE: i32 = 107_001;
/// `ACL_ERROR_RT_CONTEXT_NULL`: the calling thread has no current context (no device set).
pub const ACL_ERROR_CONTEXT_NULL: i32 = 107_002;

/// The name of an `HcclResult` code (the reference's list), for when `HcclGetErrorString` is
/// absent or answers nothing.
pub fn hccl_code_name(code: i32) -> &'static str {
    match code {
        0 => "HCCL_SUCCESS",
        1 => "HCCL_E_PARA (invalid parameter)",
        2 => "HCCL_E_PTR (null pointer)",
        3 => "HCCL_E_MEMORY (memory error)",
        4 => "HCCL_E_INTERNAL (internal error)",
        5 => "HCCL_E_NOT_SUPPORT (not supported)",
        6 => "HCCL_E_NOT_FOUND (not found)",
        7 => "HCCL_E_UNAVAIL (resource unavailable)",
        8 => "HCCL_E_SYSCALL (system call failed)",
        9 => "HCCL_E_TIMEOUT (timeout)",
        10 => "HCCL_E_OPEN_FILE_FAILURE (cannot open file)",
        11 => "HCCL_E_TCP_CONNECT (TCP connect failed)",
        12 => "HCCL_E_ROCE_CONNECT (RoCE connect failed)",
        13 => "HCCL_E_TCP_TRANSFER (TCP transfer failed)",
        14 => "HCCL_E_ROCE_TRANSFER (RoCE transfer failed)",
        15 => "HCCL_E_RUNTIME (runtime call failed)",
        16 => "HCCL_E_DRV (driver call failed)",
        17 => "HCCL_E_PROFILING (profiling error)",
        18 => "HCCL_E_CCE (CCE error)",
        19 => "HCCL_E_NETWORK (network error)",
        20 => "HCCL_E_AGAIN (try again)",
        21 => "HCCL_E_REMOTE (remote error)",
        22 => "HCCL_E_SUSPENDING (suspending)",
        23 => "HCCL_E_OPRETRY_FAIL (operation retry failed)",
        24 => "HCCL_E_OOM (out of memory)",
        _ => "unknown HCCL error code",
    }
}

/// A description of common `aclError` codes (the reference's list), used when the runtime
/// gives no text of its own.
pub fn acl_code_name(code: i32) -> &'static str {
    match code {
        0 => "success",
        100_000 => "invalid parameter",
        ACL_ERROR_REPEAT_INITIALIZE => "repeat initialize",
        ACL_ERROR_INVALID_DEVICE => "invalid device id",
        ACL_ERROR_CONTEXT_NULL => "context is null (no device set on this thread)",
        200_000 => "bad alloc",
        207_001 => "device out of memory",
        207_004 => "no device",
        507_033 => "device setup error",
        _ => "see the CANN error code reference",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_have_names_and_unknown_ones_say_so() {
        assert_eq!(hccl_code_name(HCCL_E_TIMEOUT), "HCCL_E_TIMEOUT (timeout)");
        assert_eq!(hccl_code_name(77), "unknown HCCL error code");
        assert_eq!(acl_code_name(ACL_ERROR_INVALID_DEVICE), "invalid device id");
        assert_eq!(acl_code_name(1), "see the CANN error code reference");
    }
}
