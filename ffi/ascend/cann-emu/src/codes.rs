//! Return codes (`aclError`, `HcclResult`, HIXL's `Status`) and their texts.
//!
//! The ACL values are CANN's (`acl_base.h`, `rt_error_codes.h`); the HCCL values are
//! `HcclResult`'s. Both are plain `int`s at the C boundary.

use std::ffi::CStr;

/// ACL: success.
pub const ACL_SUCCESS: i32 = 0;
/// ACL: a parameter failed validation (null pointer, unknown handle, bad value).
pub const ACL_ERROR_INVALID_PARAM: i32 = 100000;
/// ACL: `aclInit` was already called (callers treat it as success).
pub const ACL_ERROR_REPEAT_INITIALIZE: i32 = 100002;
/// ACL: the `aclInit` configuration file cannot be read.
pub const ACL_ERROR_INVALID_FILE: i32 = 100003;
/// ACL: the `aclInit` configuration file is not JSON.
pub const ACL_ERROR_PARSE_FILE: i32 = 100006;
/// Runtime: invalid device id (user id out of range).
pub const ACL_ERROR_RT_INVALID_DEVICEID: i32 = 107001;
/// Runtime: the calling thread has no current context (no `aclrtSetDevice` on this thread).
pub const ACL_ERROR_RT_CONTEXT_NULL: i32 = 107002;
/// Runtime: the stream does not belong to the calling thread's device.
pub const ACL_ERROR_RT_STREAM_CONTEXT: i32 = 107003;
/// Runtime: a queued operation waited longer than `HCCL_EXEC_TIMEOUT` for its peer.
pub const ACL_ERROR_RT_TASK_TIMEOUT: i32 = 107020;
/// Runtime: an invalid parameter found by the runtime layer (`rtError` `RT_ERROR_INVALID_VALUE`
/// maps to it, runtime `errcode_manage.cc` l.314; the ACL layer's own checks give
/// [`ACL_ERROR_INVALID_PARAM`] instead). Runtime `rt_error_codes.h` l.21.
pub const ACL_ERROR_RT_PARAM_INVALID: i32 = 107000;
/// `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` (runtime `rt_error_codes.h` l.69, "feature not support";
/// `docs/zh/api_ref/25-01_aclError.md` l.152): the call, flag or attribute is not supported by
/// this device or driver. The emulator also answers it for calls it does not model.
pub const ACL_ERROR_RT_FEATURE_NOT_SUPPORT: i32 = 207000;
/// The emulator's earlier name for 207000, kept for existing callers. Note that CANN's own
/// `ACL_ERROR_FEATURE_UNSUPPORTED` is a different code, 200006 (runtime
/// `acl_base_rt.h` l.128); use [`ACL_ERROR_RT_FEATURE_NOT_SUPPORT`].
pub const ACL_ERROR_FEATURE_UNSUPPORTED: i32 = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
/// `ACL_ERROR_RT_NO_DEVICE`: no device visible (also an invalid `ASCEND_RT_VISIBLE_DEVICES`).
pub const ACL_ERROR_RT_NO_DEVICE: i32 = 207004;
/// `ACL_ERROR_RT_STREAM_ABORT`: the stream's tasks were aborted (`aclrtStreamAbort`).
pub const ACL_ERROR_RT_STREAM_ABORT: i32 = 107023;
/// Runtime: device memory allocation failed (per-device capacity exhausted or host OOM).
pub const ACL_ERROR_RT_MEMORY_ALLOCATION: i32 = 207001;
/// Runtime: resource allocation failed (contexts).
pub const ACL_ERROR_RT_RESOURCE_ALLOC_FAIL: i32 = 207005;
/// Runtime: no stream resource (stream creation failed).
pub const ACL_ERROR_RT_NO_STREAM_RESOURCE: i32 = 207008;
/// Runtime: internal error (also: a panic caught inside the emulator).
pub const ACL_ERROR_RT_INTERNAL_ERROR: i32 = 507000;
/// Runtime: device set-up error (injected `aclrtSetDevice` failures use it).
pub const ACL_ERROR_RT_DEV_SETUP_ERROR: i32 = 507033;
/// Runtime: `aclrtSynchronizeStreamWithTimeout` timed out.
pub const ACL_ERROR_RT_STREAM_SYNC_TIMEOUT: i32 = 507046;
/// Runtime: driver internal error (runtime `rt_error_codes.h` l.150). The code
/// `aclrtHostRegister` was seen to fail with (docs/research/cann-citations.md, rule 5); the
/// emulator's `aclrtHostRegister` answers it for memory its driver model refuses.
pub const ACL_ERROR_RT_DRV_INTERNAL_ERROR: i32 = 507899;
/// `ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED`: the host range is already registered (runtime
/// `rt_error_codes.h` l.161).
pub const ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED: i32 = 507910;
/// `ACL_ERROR_HOST_MEMORY_NOT_REGISTERED`: `aclrtHostUnregister` of a pointer that is not the
/// start of a registration (runtime `rt_error_codes.h` l.162; `api_impl.cc` l.2636-2641).
pub const ACL_ERROR_HOST_MEMORY_NOT_REGISTERED: i32 = 507911;
/// Runtime: a queued operation found its local memory gone (unbound meanwhile).
pub const ACL_ERROR_RT_DEVICE_MEM_ERROR: i32 = 507053;
/// Runtime: the link to the peer broke during a queued HCCL operation.
pub const ACL_ERROR_RT_LINK_ERROR: i32 = 507056;
/// Runtime: the peer refused or answered a queued HCCL operation with something unexpected.
pub const ACL_ERROR_RT_SUSPECT_REMOTE_ERROR: i32 = 507057;

/// HCCL: success.
pub const HCCL_SUCCESS: i32 = 0;
/// HCCL: parameter error.
pub const HCCL_E_PARA: i32 = 1;
/// HCCL: null pointer.
pub const HCCL_E_PTR: i32 = 2;
/// HCCL: memory error.
pub const HCCL_E_MEMORY: i32 = 3;
/// HCCL: internal error (also: a panic caught inside the emulator).
pub const HCCL_E_INTERNAL: i32 = 4;
/// HCCL: not supported (one-sided calls under `FERRY_CANN_EMU_NO_ONESIDED=1`).
pub const HCCL_E_NOT_SUPPORT: i32 = 5;
/// HCCL: not found.
pub const HCCL_E_NOT_FOUND: i32 = 6;
/// HCCL: resource unavailable (one-sided operation before `HcclCommPrepare`).
pub const HCCL_E_UNAVAIL: i32 = 7;
/// HCCL: system call failed.
pub const HCCL_E_SYSCALL: i32 = 8;
/// HCCL: timeout (peers did not arrive within `HCCL_CONNECT_TIMEOUT` / the prepare timeout).
pub const HCCL_E_TIMEOUT: i32 = 9;
/// HCCL: a file cannot be opened (rank table path).
pub const HCCL_E_OPEN_FILE_FAILURE: i32 = 10;
/// HCCL: TCP connection failed.
pub const HCCL_E_TCP_CONNECT: i32 = 11;
/// HCCL: RoCE connection failed.
pub const HCCL_E_ROCE_CONNECT: i32 = 12;
/// HCCL: TCP transfer failed.
pub const HCCL_E_TCP_TRANSFER: i32 = 13;
/// HCCL: RoCE transfer failed.
pub const HCCL_E_ROCE_TRANSFER: i32 = 14;
/// HCCL: runtime error (no current device on the calling thread).
pub const HCCL_E_RUNTIME: i32 = 15;
/// HCCL: driver error.
pub const HCCL_E_DRV: i32 = 16;
/// HCCL: profiling error.
pub const HCCL_E_PROFILING: i32 = 17;
/// HCCL: CCE error.
pub const HCCL_E_CCE: i32 = 18;
/// HCCL: network error.
pub const HCCL_E_NETWORK: i32 = 19;
/// HCCL: try again.
pub const HCCL_E_AGAIN: i32 = 20;
/// HCCL: remote error.
pub const HCCL_E_REMOTE: i32 = 21;
/// HCCL: suspending.
pub const HCCL_E_SUSPENDING: i32 = 22;
/// HCCL: operation retry failed.
pub const HCCL_E_OPRETRY_FAIL: i32 = 23;
/// HCCL: out of memory.
pub const HCCL_E_OOM: i32 = 24;

/// HIXL/ADXL `Status` (`uint32_t`): success. The HIXL values are those of HIXL
/// `include/hixl/hixl_types.h` and `include/adxl/adxl_types.h` (the same numbers in both
/// namespaces) and `docs/zh/api/HIXL-error-code.md`.
pub const HIXL_SUCCESS: u32 = 0;
/// HIXL: a parameter failed validation (null address, timeout ≤ 0, bad option, unregistered
/// range, connecting to itself in client/server mode, an unknown request).
pub const HIXL_PARAM_INVALID: u32 = 103900;
/// HIXL: the peer did not answer within the timeout.
pub const HIXL_TIMEOUT: u32 = 103901;
/// HIXL: no link to the remote engine (and `AutoConnect` is off).
pub const HIXL_NOT_CONNECTED: u32 = 103902;
/// HIXL: `Connect` to an engine this engine is already linked to.
pub const HIXL_ALREADY_CONNECTED: u32 = 103903;
/// HIXL: reserved for notifications (never returned by the emulator).
pub const HIXL_NOTIFY_FAILED: u32 = 103904;
/// HIXL: the call or feature is not supported.
pub const HIXL_UNSUPPORTED: u32 = 103905;
/// HIXL: out of resources (streams, or the legacy engine's link limit).
pub const HIXL_RESOURCE_EXHAUSTED: u32 = 203900;
/// HIXL: any other failure (also: a panic caught inside the emulator, a call before
/// `Initialize`).
pub const HIXL_FAILED: u32 = 503900;

/// Readable name of a HIXL `Status` (for logs and test messages).
pub fn hixl_status_name(code: u32) -> &'static str {
    match code {
        HIXL_SUCCESS => "SUCCESS",
        HIXL_PARAM_INVALID => "PARAM_INVALID",
        HIXL_TIMEOUT => "TIMEOUT",
        HIXL_NOT_CONNECTED => "NOT_CONNECTED",
        HIXL_ALREADY_CONNECTED => "ALREADY_CONNECTED",
        HIXL_NOTIFY_FAILED => "NOTIFY_FAILED",
        HIXL_UNSUPPORTED => "UNSUPPORTED",
        HIXL_RESOURCE_EXHAUSTED => "RESOURCE_EXHAUSTED",
        HIXL_FAILED => "FAILED",
        _ => "(a code passed through from ACL/HCCL)",
    }
}

/// An error inside the emulator: the code returned at the C boundary (an `aclError` or an
/// `HcclResult`, depending on the entry point) and the text `aclGetRecentErrMsg` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EmuError {
    pub(crate) code: i32,
    pub(crate) message: String,
}

/// Result of the emulator's internal operations.
pub(crate) type EmuResult<T> = Result<T, EmuError>;

/// Builds an [`EmuError`] carrying a HIXL `Status`.
pub(crate) fn hixl_err(code: u32, message: impl Into<String>) -> EmuError {
    EmuError { code: code as i32, message: message.into() }
}

/// Builds an [`EmuError`].
pub(crate) fn err(code: i32, message: impl Into<String>) -> EmuError {
    EmuError { code, message: message.into() }
}

/// Readable text of an `HcclResult` (static, NUL-terminated).
pub(crate) fn hccl_error_text(code: i32) -> &'static CStr {
    match code {
        HCCL_SUCCESS => c"HCCL_SUCCESS: success",
        HCCL_E_PARA => c"HCCL_E_PARA: parameter error",
        HCCL_E_PTR => c"HCCL_E_PTR: null pointer",
        HCCL_E_MEMORY => c"HCCL_E_MEMORY: memory error",
        HCCL_E_INTERNAL => c"HCCL_E_INTERNAL: internal error",
        HCCL_E_NOT_SUPPORT => c"HCCL_E_NOT_SUPPORT: feature not supported",
        HCCL_E_NOT_FOUND => c"HCCL_E_NOT_FOUND: specific resource not found",
        HCCL_E_UNAVAIL => c"HCCL_E_UNAVAIL: resource unavailable",
        HCCL_E_SYSCALL => c"HCCL_E_SYSCALL: system call error",
        HCCL_E_TIMEOUT => c"HCCL_E_TIMEOUT: timeout",
        HCCL_E_OPEN_FILE_FAILURE => c"HCCL_E_OPEN_FILE_FAILURE: open file fail",
        HCCL_E_TCP_CONNECT => c"HCCL_E_TCP_CONNECT: tcp connect fail",
        HCCL_E_ROCE_CONNECT => c"HCCL_E_ROCE_CONNECT: roce connect fail",
        HCCL_E_TCP_TRANSFER => c"HCCL_E_TCP_TRANSFER: tcp transfer fail",
        HCCL_E_ROCE_TRANSFER => c"HCCL_E_ROCE_TRANSFER: roce transfer fail",
        HCCL_E_RUNTIME => c"HCCL_E_RUNTIME: call runtime api fail",
        HCCL_E_DRV => c"HCCL_E_DRV: call driver api fail",
        HCCL_E_PROFILING => c"HCCL_E_PROFILING: call profiling api fail",
        HCCL_E_CCE => c"HCCL_E_CCE: call cce api fail",
        HCCL_E_NETWORK => c"HCCL_E_NETWORK: call network api fail",
        HCCL_E_AGAIN => c"HCCL_E_AGAIN: try again",
        HCCL_E_REMOTE => c"HCCL_E_REMOTE: error cqe",
        HCCL_E_SUSPENDING => c"HCCL_E_SUSPENDING: error communicator suspending",
        HCCL_E_OPRETRY_FAIL => c"HCCL_E_OPRETRY_FAIL: retry constraint",
        HCCL_E_OOM => c"HCCL_E_OOM: out of memory",
        _ => c"unknown HcclResult code",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_hccl_code_has_its_own_text() {
        let texts: Vec<_> = (0..=24).map(hccl_error_text).collect();
        for (code, text) in texts.iter().enumerate() {
            assert_ne!(*text, c"unknown HcclResult code", "code {code}");
        }
        assert_eq!(hccl_error_text(25), c"unknown HcclResult code");
        assert_eq!(hccl_error_text(-1), c"unknown HcclResult code");
    }
}
