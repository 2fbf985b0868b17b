//! The ACL runtime exports (`libascendcl.so`).
//!
//! Every function checks its pointers (NULL → `ACL_ERROR_INVALID_PARAM`, 100000), catches
//! panics, and records a readable text for `aclGetRecentErrMsg` when it fails. Out-parameters
//! are written only on success.

use std::ffi::{CStr, c_char, c_void};
use std::sync::Arc;

use crate::boundary::{Api, entry, entry_ptr, take_recent_error};
use crate::codes::*;
use crate::config::config;
use crate::device;
use crate::handles;
use crate::memory::{self, Allocation, MemKind};
use crate::stream::{self, Stream};
use crate::types::*;

/// What `aclrtGetVersion` reports.
pub const EMULATED_ACL_VERSION: (i32, i32, i32) = (1, 0, 0);
/// What `aclrtGetSocName` reports.
pub const EMULATED_SOC_NAME: &CStr = c"Ascend910B3";

pub(crate) fn null(what: &str) -> EmuError {
    err(ACL_ERROR_INVALID_PARAM, format!("{what} is NULL"))
}

/// Writes an out-parameter.
///
/// # Safety
/// `p` is non-null and valid for a write of `T` (alignment is not required).
pub(crate) unsafe fn out<T>(p: *mut T, v: T) {
    // SAFETY: guaranteed by the caller.
    unsafe { p.write_unaligned(v) }
}

/// Initialises ACL. A non-NULL, non-empty `config_path` must name a readable JSON file (or an
/// empty one). A second call returns `ACL_ERROR_REPEAT_INITIALIZE` (100002) until `aclFinalize`.
///
/// # Safety
/// `config_path` is NULL or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclInit(config_path: *const c_char) -> i32 {
    entry(
        Api::Acl,
        "aclInit",
        || format!("{config_path:p}"),
        || {
            if !config_path.is_null() {
                // SAFETY: non-null and NUL-terminated per this function's contract.
                let path = unsafe { CStr::from_ptr(config_path) }.to_string_lossy().into_owned();
                if !path.is_empty() {
                    let text = std::fs::read_to_string(&path).map_err(|e| {
                        err(ACL_ERROR_INVALID_FILE, format!("aclInit: cannot read the configuration file {path}: {e}"))
                    })?;
                    if !text.trim().is_empty() {
                        serde_json::from_str::<serde_json::Value>(&text).map_err(|e| {
                            err(ACL_ERROR_PARSE_FILE, format!("aclInit: {path} is not a JSON document: {e}"))
                        })?;
                    }
                }
            }
            if device::init() {
                Ok(())
            } else {
                Err(err(ACL_ERROR_REPEAT_INITIALIZE, "aclInit: ACL is already initialized in this process"))
            }
        },
    )
}

/// Finalises ACL (a later `aclInit` succeeds again).
///
/// # Safety
/// No pointer arguments; `unsafe` only for symmetry with the C surface.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclFinalize() -> i32 {
    entry(Api::Acl, "aclFinalize", String::new, || {
        device::finalize();
        Ok(())
    })
}

/// Makes user device `device_id`'s default context current for the calling thread (and takes
/// a reference on the device). Out of range → `ACL_ERROR_RT_INVALID_DEVICEID` (107001).
///
/// # Safety
/// No pointer arguments.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtSetDevice(device_id: i32) -> i32 {
    entry(Api::Acl, "aclrtSetDevice", || device_id.to_string(), || device::set_device(device_id))
}

/// Drops a reference on user device `device_id`; at zero its default context and streams go.
///
/// # Safety
/// No pointer arguments.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtResetDevice(device_id: i32) -> i32 {
    entry(Api::Acl, "aclrtResetDevice", || device_id.to_string(), || device::reset_device(device_id))
}

/// The calling thread's current device as a *user* id (inside a container, 0 whatever the card).
/// No current context → `ACL_ERROR_RT_CONTEXT_NULL` (107002).
///
/// # Safety
/// `device_id` is NULL or valid for writing an `int32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtGetDevice(device_id: *mut i32) -> i32 {
    entry(
        Api::Acl,
        "aclrtGetDevice",
        || format!("{device_id:p}"),
        || {
            if device_id.is_null() {
                return Err(null("deviceId"));
            }
            let ctx = device::current()?;
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(device_id, ctx.user_id as i32) };
            Ok(())
        },
    )
}

/// Number of devices visible to the process (after `ASCEND_RT_VISIBLE_DEVICES`).
///
/// # Safety
/// `count` is NULL or valid for writing a `uint32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtGetDeviceCount(count: *mut u32) -> i32 {
    entry(
        Api::Acl,
        "aclrtGetDeviceCount",
        || format!("{count:p}"),
        || {
            if count.is_null() {
                return Err(null("count"));
            }
            if config().visible.is_empty() {
                return Err(err(
                    ACL_ERROR_RT_NO_DEVICE,
                    format!(
                        "no device is visible to this process{}",
                        match std::env::var("ASCEND_RT_VISIBLE_DEVICES") {
                            Ok(v) => format!(
                                " (ASCEND_RT_VISIBLE_DEVICES={v:?} lists no valid logical id: ids must be ascending, \
                                 unique and below the device count)"
                            ),
                            Err(_) => String::new(),
                        }
                    ),
                ));
            }
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(count, config().visible.len() as u32) };
            Ok(())
        },
    )
}

fn check_policy_and_alloc(size: usize, policy: i32) -> EmuResult<usize> {
    let ctx = device::current()?;
    memory::alloc_device(ctx.user_id, ctx.physical_id, size, policy)
}

/// Allocates `size` bytes of emulated memory on the calling thread's device (zeroed,
/// page-aligned). `policy` must be 0..=5 (huge-first, huge-only, normal-only and their P2P
/// variants); the higher bits (bandwidth hints) are ignored.
///
/// # Safety
/// `dev_ptr` is NULL or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMalloc(dev_ptr: *mut *mut c_void, size: usize, policy: i32) -> i32 {
    entry(
        Api::Acl,
        "aclrtMalloc",
        || format!("{dev_ptr:p}, {size}, {policy}"),
        || {
            if dev_ptr.is_null() {
                return Err(null("devPtr"));
            }
            let p = check_policy_and_alloc(size, policy)?;
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(dev_ptr, p as *mut c_void) };
            Ok(())
        },
    )
}

/// Frees memory returned by `aclrtMalloc` (any other pointer → 100000).
///
/// # Safety
/// No memory is dereferenced; `dev_ptr` is looked up in the allocation registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtFree(dev_ptr: *mut c_void) -> i32 {
    entry(
        Api::Acl,
        "aclrtFree",
        || format!("{dev_ptr:p}"),
        || {
            if dev_ptr.is_null() {
                return Err(null("devPtr"));
            }
            memory::free(dev_ptr as usize, true)
        },
    )
}

/// Allocates `size` bytes of host memory known to ACL (reported as `ACL_MEM_LOCATION_TYPE_HOST`).
///
/// # Safety
/// `host_ptr` is NULL or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMallocHost(host_ptr: *mut *mut c_void, size: usize) -> i32 {
    entry(
        Api::Acl,
        "aclrtMallocHost",
        || format!("{host_ptr:p}, {size}"),
        || {
            if host_ptr.is_null() {
                return Err(null("hostPtr"));
            }
            let p = memory::alloc_host(size)?;
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(host_ptr, p as *mut c_void) };
            Ok(())
        },
    )
}

/// Frees memory returned by `aclrtMallocHost`.
///
/// # Safety
/// No memory is dereferenced; `host_ptr` is looked up in the allocation registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtFreeHost(host_ptr: *mut c_void) -> i32 {
    entry(
        Api::Acl,
        "aclrtFreeHost",
        || format!("{host_ptr:p}"),
        || {
            if host_ptr.is_null() {
                return Err(null("hostPtr"));
            }
            memory::free(host_ptr as usize, false)
        },
    )
}

/// A validated copy: device ranges checked and kept alive until the copy ran.
struct Copy {
    dst: usize,
    src: usize,
    count: usize,
    _keep: Vec<Arc<Allocation>>,
    touches_device: bool,
}

impl Copy {
    /// # Safety
    /// The host side of the copy is valid for `count` bytes (the caller's promise to ACL).
    unsafe fn run(&self) {
        if self.count > 0 {
            // SAFETY: device ranges were checked against live allocations that `_keep` holds;
            // host ranges are valid per this function's contract; `copy` allows overlap.
            unsafe { std::ptr::copy(self.src as *const u8, self.dst as *mut u8, self.count) }
        }
    }
}

fn plan_copy(name: &str, dst: usize, dest_max: usize, src: usize, count: usize, kind: i32) -> EmuResult<Copy> {
    if dst == 0 {
        return Err(null("dst"));
    }
    if src == 0 {
        return Err(null("src"));
    }
    if count > dest_max {
        return Err(err(ACL_ERROR_INVALID_PARAM, format!("{name}: count {count} is larger than destMax {dest_max}")));
    }
    let (dst_dev, src_dev) = match kind {
        ACL_MEMCPY_HOST_TO_HOST => (false, false),
        ACL_MEMCPY_HOST_TO_DEVICE => (true, false),
        ACL_MEMCPY_DEVICE_TO_HOST => (false, true),
        ACL_MEMCPY_DEVICE_TO_DEVICE => (true, true),
        ACL_MEMCPY_DEFAULT => (memory::is_device(dst), memory::is_device(src)),
        _ => return Err(err(ACL_ERROR_INVALID_PARAM, format!("{name}: unknown memcpy kind {kind}"))),
    };
    let mut keep = Vec::new();
    for (what, addr, device) in [("dst", dst, dst_dev), ("src", src, src_dev)] {
        if device {
            let a = memory::find_device(addr, count).ok_or_else(|| {
                err(
                    ACL_ERROR_INVALID_PARAM,
                    format!("{name}: {what} {addr:#x}..+{count} is not inside emulated device memory (kind {kind})"),
                )
            })?;
            keep.push(a);
        } else if memory::is_device(addr) {
            return Err(err(
                ACL_ERROR_INVALID_PARAM,
                format!("{name}: {what} {addr:#x} is device memory but kind {kind} says host memory"),
            ));
        }
    }
    Ok(Copy { dst, src, count, _keep: keep, touches_device: dst_dev || src_dev })
}

/// Synchronous copy. `kind` (0 H2H, 1 H2D, 2 D2H, 3 D2D, 4 default) must match the pointers:
/// a device side must lie inside emulated device memory, a host side must not. Copies that touch
/// device memory need a current context on the calling thread.
///
/// # Safety
/// The host side(s) are valid for `count` bytes; device sides are checked by the emulator.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMemcpy(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: i32,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtMemcpy",
        || format!("{dst:p}, {dest_max}, {src:p}, {count}, {kind}"),
        || {
            let copy = plan_copy("aclrtMemcpy", dst as usize, dest_max, src as usize, count, kind)?;
            if copy.touches_device {
                device::current()?;
            }
            // SAFETY: host sides are valid per this function's contract, device sides checked.
            unsafe { copy.run() };
            Ok(())
        },
    )
}

/// Resolves an `aclrtStream` for ACL calls: NULL is the current context's default stream.
fn acl_stream(ptr: *const c_void) -> EmuResult<Arc<Stream>> {
    if ptr.is_null() {
        return device::current()?.default_stream();
    }
    stream::lookup(ptr).ok_or_else(|| err(ACL_ERROR_INVALID_PARAM, format!("{ptr:p} is not a live stream")))
}

/// Queues a copy on `stream` (NULL = the current context's default stream) and returns. The
/// stream must belong to the calling thread's device (`ACL_ERROR_RT_STREAM_CONTEXT` otherwise).
///
/// # Safety
/// The host side(s) stay valid for `count` bytes until the stream has run the copy.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMemcpyAsync(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: i32,
    stream: AclrtStream,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtMemcpyAsync",
        || format!("{dst:p}, {dest_max}, {src:p}, {count}, {kind}, {stream:p}"),
        || {
            let copy = plan_copy("aclrtMemcpyAsync", dst as usize, dest_max, src as usize, count, kind)?;
            let ctx = device::current()?;
            let s = acl_stream(stream)?;
            if s.user_id != ctx.user_id {
                return Err(err(
                    ACL_ERROR_RT_STREAM_CONTEXT,
                    format!(
                        "aclrtMemcpyAsync: the stream belongs to device {}, this thread is on device {}",
                        s.user_id, ctx.user_id
                    ),
                ));
            }
            let delay = crate::faults::faults().delay("aclrtMemcpyAsync");
            s.submit(Box::new(move || {
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                // SAFETY: host sides stay valid until the copy ran (contract of the call);
                // device sides are held alive by the plan.
                unsafe { copy.run() };
                Ok(())
            }))
        },
    )
}

/// Creates a stream on the calling thread's current context.
///
/// # Safety
/// `stream` is NULL or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtCreateStream(stream: *mut AclrtStream) -> i32 {
    entry(
        Api::Acl,
        "aclrtCreateStream",
        || format!("{stream:p}"),
        || {
            if stream.is_null() {
                return Err(null("stream"));
            }
            let ctx = device::current()?;
            let s = Stream::spawn(ctx.user_id, ctx.handle, true)?;
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(stream, handles::to_ptr(s.handle)) };
            Ok(())
        },
    )
}

/// Destroys a stream: operations not started are discarded, the running one is awaited.
///
/// # Safety
/// No memory is dereferenced; the handle is looked up in a registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtDestroyStream(stream: AclrtStream) -> i32 {
    entry(
        Api::Acl,
        "aclrtDestroyStream",
        || format!("{stream:p}"),
        || {
            if stream.is_null() {
                return Err(null("stream"));
            }
            stream::destroy(stream)
        },
    )
}

/// Waits for everything queued on `stream` (NULL = default stream); returns the first
/// asynchronous error of those operations.
///
/// # Safety
/// No memory is dereferenced; the handle is looked up in a registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtSynchronizeStream(stream: AclrtStream) -> i32 {
    entry(Api::Acl, "aclrtSynchronizeStream", || format!("{stream:p}"), || acl_stream(stream)?.synchronize(None))
}

/// `aclrtStreamStatus` `ACL_STREAM_STATUS_COMPLETE`: every task of the stream has finished
/// (CANN `aclrtStreamStatus`, aclcppdevg_03_1395).
pub const ACL_STREAM_STATUS_COMPLETE: i32 = 0;
/// `ACL_STREAM_STATUS_NOT_READY`: at least one task of the stream has not finished.
pub const ACL_STREAM_STATUS_NOT_READY: i32 = 1;

/// Whether every task queued on `stream` (NULL = default stream) has finished, without waiting
/// (CANN `aclrtStreamQuery(aclrtStream stream, aclrtStreamStatus *status)`, aclcppdevg_03_0075):
/// `*status` is `ACL_STREAM_STATUS_COMPLETE` (0) or `ACL_STREAM_STATUS_NOT_READY` (1). An
/// operation's asynchronous error is not reported here: the next synchronize returns it. CANN
/// 8.0 documents the call for inference products and virtual instances only, CANN 9.0 for A2
/// and A3 parts too: a caller treats a failure as "cannot tell" and synchronizes.
///
/// # Safety
/// `status` is NULL or valid for writing an `aclrtStreamStatus` (a C enum, `int`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtStreamQuery(stream: AclrtStream, status: *mut i32) -> i32 {
    entry(
        Api::Acl,
        "aclrtStreamQuery",
        || format!("{stream:p}, {status:p}"),
        || {
            if status.is_null() {
                return Err(null("status"));
            }
            let done = acl_stream(stream)?.is_complete();
            // SAFETY: non-null, valid for writing per this function's contract.
            unsafe { status.write(if done { ACL_STREAM_STATUS_COMPLETE } else { ACL_STREAM_STATUS_NOT_READY }) };
            Ok(())
        },
    )
}

/// Like `aclrtSynchronizeStream` with a timeout in milliseconds (-1 = forever, > 0 = ms, other
/// values → 100000). Past the timeout → `ACL_ERROR_RT_STREAM_SYNC_TIMEOUT` (507046); the queued
/// operations keep running.
///
/// # Safety
/// No memory is dereferenced; the handle is looked up in a registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtSynchronizeStreamWithTimeout(stream: AclrtStream, timeout_ms: i32) -> i32 {
    entry(
        Api::Acl,
        "aclrtSynchronizeStreamWithTimeout",
        || format!("{stream:p}, {timeout_ms}"),
        || {
            let timeout = match timeout_ms {
                -1 => None,
                t if t > 0 => Some(std::time::Duration::from_millis(t as u64)),
                t => {
                    return Err(err(
                        ACL_ERROR_INVALID_PARAM,
                        format!("aclrtSynchronizeStreamWithTimeout: timeout {t} is neither -1 nor positive"),
                    ));
                }
            };
            acl_stream(stream)?.synchronize(timeout)
        },
    )
}

/// `aclrtDevAttr` `ACL_DEV_ATTR_SUPER_POD_DEVICE_ID`: the device's id within its Atlas A3 super
/// pod (runtime `acl_rt.h` l.683-686).
pub const ACL_DEV_ATTR_SUPER_POD_DEVICE_ID: i32 = 403;
/// `aclrtDevAttr` `ACL_DEV_ATTR_SUPER_POD_ID`: the Atlas A3 super pod of the device.
pub const ACL_DEV_ATTR_SUPER_POD_ID: i32 = 405;

/// A device attribute of user device `device_id`. The emulator answers the Atlas A3 super-pod
/// attributes HIXL's v1.2 rank tables need: `ACL_DEV_ATTR_SUPER_POD_DEVICE_ID` (403) is
/// `FERRY_CANN_EMU_SUPER_DEVICE_BASE` (default 0) plus the physical id, `ACL_DEV_ATTR_SUPER_POD_ID`
/// (405) is `FERRY_CANN_EMU_SUPER_POD` (default 0); on a SoC that is not an A3 part, and for
/// other attributes, `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` (207000).
///
/// # Safety
/// `value` is NULL or valid for writing an `int64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtGetDeviceInfo(device_id: u32, attr: i32, value: *mut i64) -> i32 {
    entry(
        Api::Acl,
        "aclrtGetDeviceInfo",
        || format!("{device_id}, {attr}, {value:p}"),
        || {
            if value.is_null() {
                return Err(null("value"));
            }
            let physical = device::physical_id(i32::try_from(device_id).unwrap_or(i32::MAX))?;
            let cfg = config();
            let v = match attr {
                _ if !crate::config::is_a3(&cfg.soc_name) => {
                    return Err(err(
                        ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                        format!("aclrtGetDeviceInfo: attribute {attr} is not supported on {}", cfg.soc_name),
                    ));
                }
                ACL_DEV_ATTR_SUPER_POD_DEVICE_ID => cfg.super_device_base + i64::from(physical),
                ACL_DEV_ATTR_SUPER_POD_ID => cfg.super_pod,
                _ => {
                    return Err(err(
                        ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                        format!("aclrtGetDeviceInfo: the emulator does not model attribute {attr}"),
                    ));
                }
            };
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(value, v) };
            Ok(())
        },
    )
}

/// Aborts the work on `stream` (NULL = the default stream): queued operations are discarded, the
/// running one is waited for; the next synchronize returns `ACL_ERROR_RT_STREAM_ABORT` (107023).
///
/// # Safety
/// No memory is dereferenced; the handle is looked up in a registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtStreamAbort(stream: AclrtStream) -> i32 {
    entry(
        Api::Acl,
        "aclrtStreamAbort",
        || format!("{stream:p}"),
        || {
            acl_stream(stream)?.abort();
            Ok(())
        },
    )
}

/// Creates a context on user device `device_id` and makes it current for the calling thread.
///
/// # Safety
/// `context` is NULL or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtCreateContext(context: *mut AclrtContext, device_id: i32) -> i32 {
    entry(
        Api::Acl,
        "aclrtCreateContext",
        || format!("{context:p}, {device_id}"),
        || {
            if context.is_null() {
                return Err(null("context"));
            }
            let ctx = device::create_context(device_id)?;
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(context, handles::to_ptr(ctx.handle)) };
            Ok(())
        },
    )
}

/// Destroys a context made by `aclrtCreateContext` and its streams (not in the reference's
/// list; exported with CANN's signature so contexts can be released).
///
/// # Safety
/// No memory is dereferenced; the handle is looked up in a registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtDestroyContext(context: AclrtContext) -> i32 {
    entry(Api::Acl, "aclrtDestroyContext", || format!("{context:p}"), || device::destroy_context(context))
}

/// Makes `context` current for the calling thread.
///
/// # Safety
/// No memory is dereferenced; the handle is looked up in a registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtSetCurrentContext(context: AclrtContext) -> i32 {
    entry(Api::Acl, "aclrtSetCurrentContext", || format!("{context:p}"), || device::set_current_context(context))
}

/// The calling thread's current context (`ACL_ERROR_RT_CONTEXT_NULL` if none).
///
/// # Safety
/// `context` is NULL or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtGetCurrentContext(context: *mut AclrtContext) -> i32 {
    entry(
        Api::Acl,
        "aclrtGetCurrentContext",
        || format!("{context:p}"),
        || {
            if context.is_null() {
                return Err(null("context"));
            }
            let ctx = device::current()?;
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(context, handles::to_ptr(ctx.handle)) };
            Ok(())
        },
    )
}

/// The emulated ACL version ([`EMULATED_ACL_VERSION`]).
///
/// # Safety
/// Each pointer is NULL or valid for writing an `int32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtGetVersion(major: *mut i32, minor: *mut i32, patch: *mut i32) -> i32 {
    entry(
        Api::Acl,
        "aclrtGetVersion",
        || format!("{major:p}, {minor:p}, {patch:p}"),
        || {
            if major.is_null() || minor.is_null() || patch.is_null() {
                return Err(null("major/minor/patch"));
            }
            let (a, b, c) = EMULATED_ACL_VERSION;
            // SAFETY: non-null, valid per this function's contract.
            unsafe {
                out(major, a);
                out(minor, b);
                out(patch, c);
            }
            Ok(())
        },
    )
}

/// One id-mapping call: `map` turns the input id into the answer; `what` names the out-parameter.
fn map_id(name: &'static str, id: i32, what: &str, answer: *mut i32, map: fn(i32) -> EmuResult<u32>) -> i32 {
    entry(
        Api::Acl,
        name,
        || format!("{id}, {answer:p}"),
        || {
            if answer.is_null() {
                return Err(null(what));
            }
            let v = map(id)?;
            // SAFETY: non-null; the exported callers pass it on from their own contract.
            unsafe { out(answer, v as i32) };
            Ok(())
        },
    )
}

/// Physical id of user device `user_dev_id` (107001 when out of range). (runtime `device.cpp` l.515-578; docs/ascend.md rule 4)
///
/// # Safety
/// `phy_dev_id` is NULL or valid for writing an `int32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtGetPhyDevIdByUserDevId(user_dev_id: i32, phy_dev_id: *mut i32) -> i32 {
    map_id("aclrtGetPhyDevIdByUserDevId", user_dev_id, "phyDevId", phy_dev_id, device::physical_id)
}

/// Physical id of a device; as CANN documents it, the argument is the *user* id (the id
/// `aclrtSetDevice` takes), whatever its name says. (runtime `04_device_management.md`: the argument "实际为userDevId"; docs/ascend.md rule 4)
///
/// # Safety
/// `phy_dev_id` is NULL or valid for writing an `int32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtGetPhyDevIdByLogicDevId(logic_dev_id: i32, phy_dev_id: *mut i32) -> i32 {
    map_id("aclrtGetPhyDevIdByLogicDevId", logic_dev_id, "phyDevId", phy_dev_id, device::physical_id)
}

/// Logical id (the entry of `ASCEND_RT_VISIBLE_DEVICES`) of user device `user_dev_id`.
/// (runtime `acl_rt.h` l.5113-5163; docs/ascend.md rule 4)
///
/// # Safety
/// `logic_dev_id` is NULL or valid for writing an `int32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtGetLogicDevIdByUserDevId(user_dev_id: i32, logic_dev_id: *mut i32) -> i32 {
    map_id("aclrtGetLogicDevIdByUserDevId", user_dev_id, "logicDevId", logic_dev_id, device::logical_id)
}

/// Where `ptr` lives: `ACL_MEM_LOCATION_TYPE_DEVICE` with the device's user id for emulated
/// device memory (any offset inside an allocation), `ACL_MEM_LOCATION_TYPE_HOST` for
/// `aclrtMallocHost` memory, `ACL_MEM_LOCATION_TYPE_UNREGISTERED` otherwise (as CANN reports
/// plain `malloc`/stack memory).
///
/// # Safety
/// `attr` is NULL or valid for writing an [`AclrtPtrAttributes`]; `ptr` is not dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtPointerGetAttributes(ptr: *const c_void, attr: *mut c_void) -> i32 {
    entry(
        Api::Acl,
        "aclrtPointerGetAttributes",
        || format!("{ptr:p}, {attr:p}"),
        || {
            if ptr.is_null() {
                return Err(null("ptr"));
            }
            if attr.is_null() {
                return Err(null("attributes"));
            }
            let a = match memory::find(ptr as usize, 1) {
                Some(a) => match a.kind {
                    MemKind::Device { user_id, .. } => AclrtPtrAttributes {
                        id: user_id,
                        location_type: ACL_MEM_LOCATION_TYPE_DEVICE,
                        page_size: a.page_size,
                        rsv: [0; 4],
                    },
                    MemKind::Host => AclrtPtrAttributes {
                        id: 0,
                        location_type: ACL_MEM_LOCATION_TYPE_HOST,
                        page_size: a.page_size,
                        rsv: [0; 4],
                    },
                },
                None => AclrtPtrAttributes { location_type: ACL_MEM_LOCATION_TYPE_UNREGISTERED, ..Default::default() },
            };
            // SAFETY: non-null, valid for an `aclrtPtrAttributes` per this function's contract.
            unsafe { out(attr.cast::<AclrtPtrAttributes>(), a) };
            Ok(())
        },
    )
}

/// The emulated SoC name: `FERRY_CANN_EMU_SOC`, else [`EMULATED_SOC_NAME`] (an Atlas A2 part;
/// `Ascend910_93xx` names an Atlas A3 one); static, never freed.
///
/// # Safety
/// No arguments.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtGetSocName() -> *const c_char {
    static NAME: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();
    entry_ptr("aclrtGetSocName", || {
        NAME.get_or_init(|| {
            std::ffi::CString::new(config().soc_name.clone()).unwrap_or_else(|_| EMULATED_SOC_NAME.into())
        })
        .as_ptr()
    })
}

/// The calling thread's most recent error text, or NULL if there is none; reading it clears it.
/// The string stays valid until the next `aclGetRecentErrMsg` call on the same thread.
///
/// # Safety
/// No arguments.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclGetRecentErrMsg() -> *const c_char {
    entry_ptr("aclGetRecentErrMsg", take_recent_error)
}
