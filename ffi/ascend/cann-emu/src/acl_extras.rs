//! ACL runtime exports beyond the reference's list, needed so that Mooncake's
//! `mooncake-transfer-engine-npu` wheel (0.3.11.post1, 0.3.13.post1) loads: Python opens its
//! extension modules with `RTLD_NOW`, so every strong `acl*` symbol they import must exist
//! (docs/research/hixl-interop-facts.md §1.2-1.3).
//!
//! Signatures, struct layouts and the order of the argument checks follow the runtime sources
//! of `hicann/runtime` (commit 681ef761): `include/external/acl/acl_rt.h` (declarations),
//! `src/acl/aclrt_impl/*.cpp` (the ACL layer's checks, which answer `ACL_ERROR_INVALID_PARAM`,
//! 100000), `src/runtime/api/impl/api_error.cc` / `api_impl.cc` (the runtime layer's checks,
//! whose `RT_ERROR_INVALID_VALUE` becomes `ACL_ERROR_RT_PARAM_INVALID`, 107000) and
//! `docs/zh/api_ref/*.md`.
//!
//! Implemented: `aclrtCreateStreamWithConfig`, `aclrtMemcpyBatch`, `aclrtHostRegister`,
//! `aclrtHostUnregister`, `aclrtMemGetAllocationGranularity`. The virtual-memory,
//! shareable-handle and IPC families check their arguments as CANN does and then answer
//! `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` (207000): the emulator does not model them.

use std::ffi::{c_char, c_void};
use std::sync::Arc;

use crate::acl::{null, out};
use crate::boundary::{Api, entry};
use crate::codes::*;
use crate::device;
use crate::handles;
use crate::memory::{self, Allocation, MemKind};
use crate::stream::Stream;
use crate::types::*;

/// `DEVMM_MEMCPY_BATCH_MAX_COUNT`: at most this many copies per `aclrtMemcpyBatch` (runtime
/// `pkg_inc/driver/ascend_hal_define.h` l.810; checked in `api_error.cc` l.7298-7320).
pub const ACL_MEMCPY_BATCH_MAX_COUNT: usize = 4096;

/// Granularity the emulator reports for huge-page memory: "2M粒度对齐的大页内存" (runtime
/// `docs/zh/api_ref/11-04_virtual_memory_management.md` l.91, 107, 122).
pub const HUGE_PAGE_GRANULARITY: usize = 2 << 20;
/// Granularity for 1 GiB huge pages ("1G粒度对齐", same doc l.92, 108, 123).
pub const HUGE1G_PAGE_GRANULARITY: usize = 1 << 30;
/// Granularity for normal pages: the emulator's choice (the driver decides on real hardware;
/// it matches the page size the emulator's `aclrtMalloc` reports for normal pages).
pub const NORMAL_PAGE_GRANULARITY: usize = 4096;

/// The error of a call the emulator does not model.
fn unsupported(name: &str, what: &str) -> EmuError {
    err(
        ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
        format!(
            "{name}: the emulated CANN does not model {what}; answering ACL_ERROR_RT_FEATURE_NOT_SUPPORT (207000) \
             as a driver without the feature does"
        ),
    )
}

fn invalid(message: String) -> EmuError {
    err(ACL_ERROR_INVALID_PARAM, message)
}

fn rt_invalid(message: String) -> EmuError {
    err(ACL_ERROR_RT_PARAM_INVALID, message)
}

/// Creates a stream on the calling thread's current context, like `aclrtCreateStream`.
///
/// CANN: `aclError aclrtCreateStreamWithConfig(aclrtStream* stream, uint32_t priority, uint32_t
/// flag)` (runtime `acl_rt.h` l.2745-2759; `docs/zh/api_ref/06_stream_management.md` l.105-207).
/// `stream` NULL → 100000 (`stream.cpp` l.53-58). `priority` is documented as reserved and the
/// runtime clamps it to 0..=7 without an error (`api_error.cc` l.1326-1349); the emulator has no
/// scheduling priority and ignores it. Flags: `ACL_STREAM_FAST_LAUNCH`, `ACL_STREAM_FAST_SYNC`
/// and `ACL_STREAM_HUGE` (which "does not take effect" on current parts) only change speed and
/// depth on hardware, so they give an ordinary emulated stream; unknown bits do too ("配置其他值创建
/// 出来的Stream等同于通过aclrtCreateStream接口创建出来的Stream"). `ACL_STREAM_PERSISTENT`,
/// `ACL_STREAM_CPU_SCHEDULE` and `ACL_STREAM_DEVICE_USE_ONLY` make streams for model binding,
/// AI-CPU scheduling and device-side use, which the emulator does not model: 207000.
///
/// # Safety
/// `stream` is NULL or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtCreateStreamWithConfig(stream: *mut AclrtStream, priority: u32, flag: u32) -> i32 {
    entry(
        Api::Acl,
        "aclrtCreateStreamWithConfig",
        || format!("{stream:p}, {priority}, {flag:#x}"),
        || {
            if stream.is_null() {
                return Err(null("stream"));
            }
            let unmodelled = flag & (ACL_STREAM_PERSISTENT | ACL_STREAM_CPU_SCHEDULE | ACL_STREAM_DEVICE_USE_ONLY);
            if unmodelled != 0 {
                return Err(unsupported(
                    "aclrtCreateStreamWithConfig",
                    &format!(
                        "persistent, CPU-schedule or device-only streams (flag {flag:#x} has {unmodelled:#x}); \
                         FAST_LAUNCH, FAST_SYNC and HUGE are accepted"
                    ),
                ));
            }
            let ctx = device::current()?;
            let s = Stream::spawn(ctx.user_id, ctx.handle, true)?;
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(stream, handles::to_ptr(s.handle)) };
            Ok(())
        },
    )
}

/// Where a pointer lives for `aclrtMemcpyBatch`: `(location type, device user id, allocation)`;
/// memory ACL does not know counts as host memory (`api_impl.cc` l.8775-8777).
fn batch_location(addr: usize) -> (i32, u32, Option<Arc<Allocation>>) {
    match memory::find(addr, 1) {
        Some(a) => match a.kind {
            MemKind::Device { user_id, .. } => (ACL_MEM_LOCATION_TYPE_DEVICE, user_id, Some(a)),
            MemKind::Host => (ACL_MEM_LOCATION_TYPE_HOST, 0, None),
        },
        None => (ACL_MEM_LOCATION_TYPE_HOST, 0, None),
    }
}

fn location_name(t: i32) -> &'static str {
    match t {
        ACL_MEM_LOCATION_TYPE_HOST => "host",
        ACL_MEM_LOCATION_TYPE_DEVICE => "device",
        ACL_MEM_LOCATION_TYPE_UNREGISTERED => "unregistered",
        ACL_MEM_LOCATION_TYPE_MANAGED => "managed",
        ACL_MEM_LOCATION_TYPE_HOST_NUMA => "host-numa",
        _ => "unknown",
    }
}

/// Checks one side of copy `i` against its attribute (`ApiImpl::CheckMemCpyAttr`, `api_impl.cc`
/// l.8794-8830) and that a device side holds `size` bytes (the emulator's own check).
fn check_side(
    i: usize,
    what: &str,
    addr: usize,
    size: usize,
    want: AclrtMemLocation,
) -> EmuResult<(i32, Option<Arc<Allocation>>)> {
    if addr == 0 {
        return Err(rt_invalid(format!("aclrtMemcpyBatch: {what}s[{i}] is NULL")));
    }
    let (actual, id, alloc) = batch_location(addr);
    let wanted = if want.location_type == ACL_MEM_LOCATION_TYPE_HOST_NUMA {
        ACL_MEM_LOCATION_TYPE_HOST
    } else {
        want.location_type
    };
    if actual != wanted || (actual == ACL_MEM_LOCATION_TYPE_DEVICE && id != want.id) {
        return Err(rt_invalid(format!(
            "aclrtMemcpyBatch: copy {i}: the attribute says {what} is {} memory (id {}), but {addr:#x} is {} memory \
             (id {id})",
            location_name(want.location_type),
            want.id,
            location_name(actual)
        )));
    }
    if let Some(a) = &alloc
        && !a.contains(addr, size)
    {
        return Err(rt_invalid(format!(
            "aclrtMemcpyBatch: copy {i}: {what} {addr:#x}..+{size} runs past the end of its device allocation \
             {:#x}..+{}",
            a.base, a.size
        )));
    }
    Ok((actual, alloc))
}

/// A batch of synchronous copies, each host-to-device or device-to-host.
///
/// CANN: `aclError aclrtMemcpyBatch(void** dsts, size_t* destMaxs, void** srcs, size_t* sizes,
/// size_t numBatches, aclrtMemcpyBatchAttr* attrs, size_t* attrsIndexes, size_t numAttrs, size_t*
/// failIndex)` (runtime `acl_rt.h` l.4488-4506; `docs/zh/api_ref/11-03_memory_copy_and_set.md`
/// l.249-306). `attrs[k]` applies to copies `attrsIndexes[k] .. attrsIndexes[k+1]-1`, the last one
/// up to `numBatches-1`. Checks, in CANN's order:
/// - ACL layer (`memory.cpp` l.1692-1773, 1814-1823), 100000, `failIndex` untouched: `failIndex`
///   or `sizes` NULL, `numBatches` 0; then, if every size is 0, success with `*failIndex =
///   SIZE_MAX` and nothing else checked; `dsts`, `destMaxs`, `srcs`, `attrs` or `attrsIndexes`
///   NULL; `destMaxs[i] < sizes[i]`; a non-zero `attrs[k].rsv` byte.
/// - Runtime layer (`api_error.cc` l.7298-7335), 107000, `*failIndex = SIZE_MAX` first:
///   `numAttrs` 0 or above `numBatches`; `numBatches` above 4096; `attrsIndexes[0] != 0`; entries
///   not increasing or not below `numBatches`.
/// - The calling thread needs a current context (107002), as the emulator's `aclrtMemcpy` does
///   for copies touching device memory.
/// - Per copy `i` (`api_impl.cc` l.8760-8792), 107000 with `*failIndex = i`: each side's real
///   location (memory ACL does not know counts as host) must match its attribute (device sides
///   also the device id, a user id as `aclrtPointerGetAttributes` reports), and the two sides must
///   differ (only H2D and D2H). The emulator also refuses a NULL side and a device side that does
///   not hold `sizes[i]` bytes.
///
/// Then every copy runs (in array order; CANN documents the order as unspecified).
///
/// # Safety
/// Every non-NULL array argument holds `numBatches` (`attrs`, `attrsIndexes`: `numAttrs`)
/// elements; the host side of each copy is valid for its size; `failIndex` is NULL or valid for
/// writing a `size_t`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aclrtMemcpyBatch(
    dsts: *mut *mut c_void,
    dest_maxs: *mut usize,
    srcs: *mut *mut c_void,
    sizes: *mut usize,
    num_batches: usize,
    attrs: *mut AclrtMemcpyBatchAttr,
    attrs_indexes: *mut usize,
    num_attrs: usize,
    fail_index: *mut usize,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtMemcpyBatch",
        || {
            format!(
                "{dsts:p}, {dest_maxs:p}, {srcs:p}, {sizes:p}, {num_batches}, {attrs:p}, {attrs_indexes:p}, \
                 {num_attrs}, {fail_index:p}"
            )
        },
        || {
            if fail_index.is_null() {
                return Err(null("failIndex"));
            }
            if sizes.is_null() {
                return Err(null("sizes"));
            }
            if num_batches == 0 {
                return Err(invalid("aclrtMemcpyBatch: numBatches must be greater than 0".into()));
            }
            // SAFETY: non-null; holds `num_batches` elements per this function's contract.
            let sizes = unsafe { std::slice::from_raw_parts(sizes, num_batches) };
            if sizes.iter().all(|&s| s == 0) {
                // SAFETY: non-null, valid per this function's contract.
                unsafe { out(fail_index, usize::MAX) };
                return Ok(());
            }
            for (p, what) in [
                (dsts.is_null(), "dsts"),
                (dest_maxs.is_null(), "destMaxs"),
                (srcs.is_null(), "srcs"),
                (attrs.is_null(), "attrs"),
                (attrs_indexes.is_null(), "attrsIndexes"),
            ] {
                if p {
                    return Err(null(what));
                }
            }
            // SAFETY: non-null; each holds `num_batches` elements per this function's contract.
            let (dsts, dest_maxs, srcs) = unsafe {
                (
                    std::slice::from_raw_parts(dsts.cast_const(), num_batches),
                    std::slice::from_raw_parts(dest_maxs.cast_const(), num_batches),
                    std::slice::from_raw_parts(srcs.cast_const(), num_batches),
                )
            };
            if let Some(i) = (0..num_batches).find(|&i| dest_maxs[i] < sizes[i]) {
                return Err(invalid(format!(
                    "aclrtMemcpyBatch: the memory copy size {} at index {i} exceeds the size {} of the destination \
                     buffer",
                    sizes[i], dest_maxs[i]
                )));
            }
            // SAFETY: non-null; each holds `num_attrs` elements per this function's contract.
            let (attrs, idx) = unsafe {
                (
                    std::slice::from_raw_parts(attrs.cast_const(), num_attrs),
                    std::slice::from_raw_parts(attrs_indexes.cast_const(), num_attrs),
                )
            };
            if let Some(k) = attrs.iter().position(|a| a.rsv.iter().any(|&b| b != 0)) {
                return Err(invalid(format!("aclrtMemcpyBatch: rsv field of attrs[{k}] must be 0")));
            }

            // The runtime layer.
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(fail_index, usize::MAX) };
            if num_attrs == 0 || num_attrs > num_batches {
                return Err(rt_invalid(format!(
                    "aclrtMemcpyBatch: numAttrs {num_attrs} must be between 1 and numBatches {num_batches}"
                )));
            }
            if num_batches > ACL_MEMCPY_BATCH_MAX_COUNT {
                return Err(rt_invalid(format!(
                    "aclrtMemcpyBatch: numBatches {num_batches} is above {ACL_MEMCPY_BATCH_MAX_COUNT}"
                )));
            }
            if idx[0] != 0 {
                return Err(rt_invalid(format!("aclrtMemcpyBatch: attrsIndexes[0] is {}, must be 0", idx[0])));
            }
            if let Some(k) = (1..num_attrs).find(|&k| idx[k] <= idx[k - 1] || idx[k] >= num_batches) {
                return Err(rt_invalid(format!(
                    "aclrtMemcpyBatch: attrsIndexes[{k}] = {} must be greater than attrsIndexes[{}] = {} and less \
                     than numBatches {num_batches}",
                    idx[k],
                    k - 1,
                    idx[k - 1]
                )));
            }
            device::current()?;

            let mut plan = Vec::with_capacity(num_batches);
            let mut k = 0;
            for i in 0..num_batches {
                if k + 1 < num_attrs && i >= idx[k + 1] {
                    k += 1;
                }
                let checked = check_side(i, "dst", dsts[i] as usize, sizes[i], attrs[k].dst_loc)
                    .and_then(|d| check_side(i, "src", srcs[i] as usize, sizes[i], attrs[k].src_loc).map(|s| (d, s)));
                let ((dst_loc, dst_keep), (src_loc, src_keep)) = match checked {
                    Ok(v) => v,
                    Err(e) => {
                        // SAFETY: non-null, valid per this function's contract.
                        unsafe { out(fail_index, i) };
                        return Err(e);
                    }
                };
                if dst_loc == src_loc {
                    // SAFETY: non-null, valid per this function's contract.
                    unsafe { out(fail_index, i) };
                    return Err(rt_invalid(format!(
                        "aclrtMemcpyBatch: copy {i}: only H2D and D2H copy directions are supported, both sides \
                         are {} memory",
                        location_name(dst_loc)
                    )));
                }
                plan.push((dsts[i] as usize, srcs[i] as usize, sizes[i], dst_keep, src_keep));
            }
            for (dst, src, size, _dst_keep, _src_keep) in &plan {
                if *size > 0 {
                    // SAFETY: the device side lies inside a live allocation (checked, held by the
                    // plan); the host side is valid per this function's contract; `copy` allows
                    // overlap.
                    unsafe { std::ptr::copy(*src as *const u8, *dst as *mut u8, *size) }
                }
            }
            Ok(())
        },
    )
}

/// Registers host memory for device access and returns its device address.
///
/// CANN: `aclError aclrtHostRegister(void* ptr, uint64_t size, aclrtHostRegisterType type, void**
/// devPtr)` (runtime `acl_rt.h` l.2040-2052; `docs/zh/api_ref/11-02_host_memory_management.md`
/// l.251-296). Checks, in CANN's order: `ptr` or `devPtr` NULL, `size` 0 → 100000 (`memory.cpp`
/// l.488-498); a `type` with bits other than `ACL_HOST_REGISTER_IOMEMORY` (4) and
/// `ACL_HOST_REGISTER_READONLY` (8) → 207000 (`api_error.cc` l.1992-2003); no current context →
/// 107002 (`api_impl.cc` l.2557-2562).
///
/// The emulator's driver model: `IOMEMORY` (device I/O memory) is not modelled → 207000.
/// `ptr` must be 4 KB aligned and the range must lie inside one `aclrtMallocHost` allocation
/// (the documented rule for kernels up to 5.10, and HIXL's contract: docs/research/cann-citations.md
/// rules 5 and 13), else `ACL_ERROR_RT_DRV_INTERNAL_ERROR` (507899, the code real registrations
/// were seen to fail with); a range overlapping one already registered on the device →
/// `ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED` (507910). Emulated devices share the host's address
/// space, so the mapping is the identity: `*devPtr = ptr` (on hardware it is a distinct device
/// address, usable only on the device). `READONLY` is recorded, not enforced. The registration
/// belongs to the current device and keeps the bytes alive until `aclrtHostUnregister`.
///
/// # Safety
/// `devPtr` is NULL or valid for writing a pointer; `ptr` is not dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtHostRegister(
    ptr: *mut c_void,
    size: u64,
    host_register_type: i32,
    dev_ptr: *mut *mut c_void,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtHostRegister",
        || format!("{ptr:p}, {size}, {host_register_type}, {dev_ptr:p}"),
        || {
            if ptr.is_null() {
                return Err(null("ptr"));
            }
            if dev_ptr.is_null() {
                return Err(null("devPtr"));
            }
            if size == 0 {
                return Err(invalid("aclrtHostRegister: size must be greater than 0".into()));
            }
            let valid = ACL_HOST_REGISTER_IOMEMORY | ACL_HOST_REGISTER_READONLY;
            if host_register_type & !valid != 0 {
                return Err(err(
                    ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                    format!(
                        "aclrtHostRegister: type {host_register_type:#x} is not supported; valid types are \
                         combinations of IOMEMORY (0x4) and READONLY (0x8), or 0 (MAPPED)"
                    ),
                ));
            }
            let ctx = device::current()?;
            if host_register_type & ACL_HOST_REGISTER_IOMEMORY != 0 {
                return Err(unsupported("aclrtHostRegister", "ACL_HOST_REGISTER_IOMEMORY (device I/O memory)"));
            }
            let size = usize::try_from(size).map_err(|_| {
                err(
                    ACL_ERROR_RT_DRV_INTERNAL_ERROR,
                    format!("aclrtHostRegister: size {size} does not fit the address space"),
                )
            })?;
            memory::host_register(ctx.user_id, ptr as usize, size)?;
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(dev_ptr, ptr) };
            Ok(())
        },
    )
}

/// Removes a registration made by `aclrtHostRegister` on the current device.
///
/// CANN: `aclError aclrtHostUnregister(void* ptr)` (runtime `acl_rt.h` l.2079-2088;
/// `docs/zh/api_ref/11-02_host_memory_management.md` l.468-510). `ptr` NULL → 100000
/// (`memory.cpp` l.521-528); no current context → 107002; `ptr` not the start of a registration
/// on the current device → `ACL_ERROR_HOST_MEMORY_NOT_REGISTERED` (507911; `api_impl.cc`
/// l.2614-2641, `api_error.cc` l.2032-2042).
///
/// # Safety
/// No memory is dereferenced; `ptr` is looked up in the registration table.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtHostUnregister(ptr: *mut c_void) -> i32 {
    entry(
        Api::Acl,
        "aclrtHostUnregister",
        || format!("{ptr:p}"),
        || {
            if ptr.is_null() {
                return Err(null("ptr"));
            }
            let ctx = device::current()?;
            memory::host_unregister(ctx.user_id, ptr as usize)
        },
    )
}

/// The allocation granularity for physical memory of the given properties.
///
/// CANN: `aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp* prop,
/// aclrtMemGranularityOptions option, size_t* granularity)` (runtime `acl_rt.h` l.3405-3417;
/// `docs/zh/api_ref/11-04_virtual_memory_management.md` l.1024-1078). Checks (`memory.cpp`
/// l.1299-1345), 100000: `prop` or `granularity` NULL; a device location with a DDR-only
/// attribute (`ACL_DDR_MEM_HUGE/NORMAL`, `ACL_DDR_MEM_P2P_HUGE/NORMAL`); an attribute the ACL
/// layer has no handler for (`ACL_DDR_MEM`, `ACL_HBM_MEM`, `ACL_HBM_MEM_P2P_*`). The emulator
/// also answers 100000 for an `option` other than MINIMUM (0) and RECOMMENDED (1) and for a 1 GiB
/// attribute on a host location ("仅支持Device", doc l.92).
///
/// Answer, for both options: 2 MiB for huge-page attributes ("2M粒度对齐", doc l.91, 107, 122),
/// 1 GiB for the `HUGE1G` ones (doc l.92, 108, 123), 4 KiB for normal pages (the emulator's
/// choice; the driver decides on hardware).
///
/// # Safety
/// `prop` is NULL or valid for reading an [`AclrtPhysicalMemProp`]; `granularity` is NULL or
/// valid for writing a `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMemGetAllocationGranularity(
    prop: *mut AclrtPhysicalMemProp,
    option: i32,
    granularity: *mut usize,
) -> i32 {
    use crate::types::mem_attr::*;
    entry(
        Api::Acl,
        "aclrtMemGetAllocationGranularity",
        || format!("{prop:p}, {option}, {granularity:p}"),
        || {
            if prop.is_null() {
                return Err(null("prop"));
            }
            if granularity.is_null() {
                return Err(null("granularity"));
            }
            // SAFETY: non-null, valid for reading per this function's contract.
            let p = unsafe { prop.read_unaligned() };
            let device = p.location.location_type == ACL_MEM_LOCATION_TYPE_DEVICE;
            let attr = p.mem_attr;
            if device
                && matches!(attr, ACL_DDR_MEM_HUGE | ACL_DDR_MEM_NORMAL | ACL_DDR_MEM_P2P_HUGE | ACL_DDR_MEM_P2P_NORMAL)
            {
                return Err(invalid(format!(
                    "aclrtMemGetAllocationGranularity: memAttr {attr} only supports MEM_LOCATION_TYPE_HOST(0) or \
                     MEM_LOCATION_TYPE_HOST_NUMA(4)"
                )));
            }
            let g = match attr {
                ACL_DDR_MEM_HUGE | ACL_HBM_MEM_HUGE | ACL_DDR_MEM_P2P_HUGE | ACL_MEM_HUGE | ACL_MEM_P2P_HUGE => {
                    HUGE_PAGE_GRANULARITY
                }
                ACL_HBM_MEM_HUGE1G | ACL_MEM_HUGE1G | ACL_MEM_P2P_HUGE1G => {
                    if !device {
                        return Err(invalid(format!(
                            "aclrtMemGetAllocationGranularity: 1 GiB huge pages (memAttr {attr}) exist on devices only"
                        )));
                    }
                    HUGE1G_PAGE_GRANULARITY
                }
                ACL_DDR_MEM_NORMAL
                | ACL_HBM_MEM_NORMAL
                | ACL_DDR_MEM_P2P_NORMAL
                | ACL_MEM_NORMAL
                | ACL_MEM_P2P_NORMAL => NORMAL_PAGE_GRANULARITY,
                _ => {
                    return Err(invalid(format!("aclrtMemGetAllocationGranularity: memAttr {attr} is not supported")));
                }
            };
            if option != ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM && option != ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED {
                return Err(invalid(format!("aclrtMemGetAllocationGranularity: unknown option {option}")));
            }
            // SAFETY: non-null, valid per this function's contract.
            unsafe { out(granularity, g) };
            Ok(())
        },
    )
}

/// Checks shared by `aclrtReserveMemAddress` and `aclrtReserveMemAddressNoUCMemory` (`memory.cpp`
/// l.1044-1058, 2040-2054): `virPtr` NULL, `size` 0, `flags` other than 0 or 1 → 100000.
fn reserve(name: &'static str, vir_ptr: *mut *mut c_void, size: usize, flags: u64) -> EmuResult<()> {
    if vir_ptr.is_null() {
        return Err(null("virPtr"));
    }
    if size == 0 {
        return Err(invalid(format!("{name}: size must be greater than 0")));
    }
    if flags > 1 {
        return Err(invalid(format!("{name}: flags {flags} must be 0")));
    }
    Err(unsupported(name, "virtual address reservations (aclrtReserveMemAddress/aclrtMapMem)"))
}

/// Not modelled: reserves a virtual address range.
///
/// CANN: `aclError aclrtReserveMemAddress(void** virPtr, size_t size, size_t alignment, void*
/// expectPtr, uint64_t flags)` (runtime `acl_rt.h` l.2573-2587; `docs/zh/api_ref/
/// 11-04_virtual_memory_management.md` l.204-280). After the ACL layer's checks (see `reserve`:
/// `virPtr` NULL, `size` 0, `flags` not 0/1 → 100000) the emulator answers
/// `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` (207000), which the ACL layer treats as "not supported" here
/// (`ACL_REQUIRES_RTS_OK_WARN_NOT_SUPPORT`, `memory.cpp` l.1055-1056). `*virPtr` is not written.
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtReserveMemAddress(
    vir_ptr: *mut *mut c_void,
    size: usize,
    alignment: usize,
    expect_ptr: *mut c_void,
    flags: u64,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtReserveMemAddress",
        || format!("{vir_ptr:p}, {size}, {alignment}, {expect_ptr:p}, {flags}"),
        || reserve("aclrtReserveMemAddress", vir_ptr, size, flags),
    )
}

/// Not modelled: reserves a virtual address range without UC memory.
///
/// CANN: `aclError aclrtReserveMemAddressNoUCMemory(void** virPtr, size_t size, size_t alignment,
/// void* expectPtr, uint64_t flags)` (runtime `acl_rt.h` l.5847-5862; `docs/zh/api_ref/
/// 11-04_virtual_memory_management.md` l.281-341). Same checks as `aclrtReserveMemAddress`
/// (`memory.cpp` l.2040-2054), then 207000. The wheel imports it weakly.
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtReserveMemAddressNoUCMemory(
    vir_ptr: *mut *mut c_void,
    size: usize,
    alignment: usize,
    expect_ptr: *mut c_void,
    flags: u64,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtReserveMemAddressNoUCMemory",
        || format!("{vir_ptr:p}, {size}, {alignment}, {expect_ptr:p}, {flags}"),
        || reserve("aclrtReserveMemAddressNoUCMemory", vir_ptr, size, flags),
    )
}

/// Not modelled: releases a reservation.
///
/// CANN: `aclError aclrtReleaseMemAddress(void* virPtr)` (runtime `acl_rt.h` l.2589-2600).
/// `virPtr` NULL → 100000 (`memory.cpp` l.1061-1069), else 207000.
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtReleaseMemAddress(vir_ptr: *mut c_void) -> i32 {
    entry(
        Api::Acl,
        "aclrtReleaseMemAddress",
        || format!("{vir_ptr:p}"),
        || {
            if vir_ptr.is_null() {
                return Err(null("virPtr"));
            }
            Err(unsupported("aclrtReleaseMemAddress", "virtual address reservations"))
        },
    )
}

/// Not modelled: allocates physical memory behind a handle.
///
/// CANN: `aclError aclrtMallocPhysical(aclrtDrvMemHandle* handle, size_t size, const
/// aclrtPhysicalMemProp* prop, uint64_t flags)` (runtime `acl_rt.h` l.2602-2619;
/// `docs/zh/api_ref/11-04_virtual_memory_management.md` l.29-143). ACL-layer checks (`memory.cpp`
/// l.1073-1086), 100000: `handle` or `prop` NULL, `size` 0, `flags` not 0, `prop->handleType` not
/// `ACL_MEM_HANDLE_TYPE_NONE`, `prop->allocationType` not `ACL_MEM_ALLOCATION_TYPE_PINNED`; then
/// 207000. `*handle` is not written.
///
/// # Safety
/// `prop` is NULL or valid for reading an [`AclrtPhysicalMemProp`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMallocPhysical(
    handle: *mut *mut c_void,
    size: usize,
    prop: *const AclrtPhysicalMemProp,
    flags: u64,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtMallocPhysical",
        || format!("{handle:p}, {size}, {prop:p}, {flags}"),
        || {
            if handle.is_null() {
                return Err(null("handle"));
            }
            if prop.is_null() {
                return Err(null("prop"));
            }
            if size == 0 {
                return Err(invalid("aclrtMallocPhysical: size must be greater than 0".into()));
            }
            if flags != 0 {
                return Err(invalid(format!("aclrtMallocPhysical: flags {flags} is reserved and must be 0")));
            }
            // SAFETY: non-null, valid for reading per this function's contract.
            let p = unsafe { prop.read_unaligned() };
            if p.handle_type != 0 {
                return Err(invalid(format!("aclrtMallocPhysical: prop.handleType {} must be 0", p.handle_type)));
            }
            if p.allocation_type != 0 {
                return Err(invalid(format!(
                    "aclrtMallocPhysical: prop.allocationType {} must be 0",
                    p.allocation_type
                )));
            }
            Err(unsupported("aclrtMallocPhysical", "physical memory handles (aclrtMallocPhysical/aclrtMapMem)"))
        },
    )
}

/// Not modelled: frees a physical memory handle.
///
/// CANN: `aclError aclrtFreePhysical(aclrtDrvMemHandle handle)` (runtime `acl_rt.h` l.2621-2633).
/// `handle` NULL → 100000 (`memory.cpp` l.1148-1157), else 207000.
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtFreePhysical(handle: *mut c_void) -> i32 {
    entry(
        Api::Acl,
        "aclrtFreePhysical",
        || format!("{handle:p}"),
        || {
            if handle.is_null() {
                return Err(null("handle"));
            }
            Err(unsupported("aclrtFreePhysical", "physical memory handles"))
        },
    )
}

/// Not modelled: maps a physical handle into a reserved range.
///
/// CANN: `aclError aclrtMapMem(void* virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
/// uint64_t flags)` (runtime `acl_rt.h` l.2635-2651). ACL-layer checks (`memory.cpp` l.1160-1172),
/// 100000: `virPtr` or `handle` NULL, `size` 0, `flags` not 0; then 207000.
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMapMem(
    vir_ptr: *mut c_void,
    size: usize,
    offset: usize,
    handle: *mut c_void,
    flags: u64,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtMapMem",
        || format!("{vir_ptr:p}, {size}, {offset}, {handle:p}, {flags}"),
        || {
            if vir_ptr.is_null() {
                return Err(null("virPtr"));
            }
            if handle.is_null() {
                return Err(null("handle"));
            }
            if size == 0 {
                return Err(invalid("aclrtMapMem: size must be greater than 0".into()));
            }
            if flags != 0 {
                return Err(invalid(format!("aclrtMapMem: flags {flags} must be 0")));
            }
            Err(unsupported("aclrtMapMem", "virtual memory mappings"))
        },
    )
}

/// Not modelled: unmaps a range.
///
/// CANN: `aclError aclrtUnmapMem(void* virPtr)` (runtime `acl_rt.h` l.2653-2664). `virPtr` NULL →
/// 100000 (`memory.cpp` l.1175-1184), else 207000.
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtUnmapMem(vir_ptr: *mut c_void) -> i32 {
    entry(
        Api::Acl,
        "aclrtUnmapMem",
        || format!("{vir_ptr:p}"),
        || {
            if vir_ptr.is_null() {
                return Err(null("virPtr"));
            }
            Err(unsupported("aclrtUnmapMem", "virtual memory mappings"))
        },
    )
}

/// Not modelled: sets access to a mapped range for devices.
///
/// CANN: `aclError aclrtMemSetAccess(void* virPtr, size_t size, aclrtMemAccessDesc* desc, size_t
/// count)` (runtime `acl_rt.h` l.5609-5619; `docs/zh/api_ref/11-04_virtual_memory_management.md`
/// l.1085-1130). The ACL layer checks nothing (`memory.cpp` l.1956-1965); the emulator refuses a
/// NULL `virPtr` or `desc` and a `count` of 0 with 100000, then answers 207000 (which the ACL layer
/// treats as "not supported", `ACL_REQUIRES_RTS_OK_WARN_NOT_SUPPORT`).
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMemSetAccess(
    vir_ptr: *mut c_void,
    size: usize,
    desc: *mut AclrtMemAccessDesc,
    count: usize,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtMemSetAccess",
        || format!("{vir_ptr:p}, {size}, {desc:p}, {count}"),
        || {
            if vir_ptr.is_null() {
                return Err(null("virPtr"));
            }
            if desc.is_null() {
                return Err(null("desc"));
            }
            if count == 0 {
                return Err(invalid("aclrtMemSetAccess: count must be greater than 0".into()));
            }
            Err(unsupported("aclrtMemSetAccess", "virtual memory mappings and their access rights"))
        },
    )
}

/// Not modelled: exports a physical handle for another process.
///
/// CANN: `aclError aclrtMemExportToShareableHandleV2(aclrtDrvMemHandle handle, uint64_t flags,
/// aclrtMemSharedHandleType shareType, void* shareableHandle)` (runtime `acl_rt.h` l.3338-3351;
/// `docs/zh/api_ref/11-04_virtual_memory_management.md` l.828-901). `handle` or
/// `shareableHandle` NULL → 100000 (`memory.cpp` l.1229-1240), else 207000; nothing is written.
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMemExportToShareableHandleV2(
    handle: *mut c_void,
    flags: u64,
    share_type: i32,
    shareable_handle: *mut c_void,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtMemExportToShareableHandleV2",
        || format!("{handle:p}, {flags}, {share_type}, {shareable_handle:p}"),
        || {
            if handle.is_null() {
                return Err(null("handle"));
            }
            if shareable_handle.is_null() {
                return Err(null("shareableHandle"));
            }
            Err(unsupported("aclrtMemExportToShareableHandleV2", "shareable physical memory handles"))
        },
    )
}

/// Not modelled: imports a shareable handle from another process.
///
/// CANN: `aclError aclrtMemImportFromShareableHandleV2(void* shareableHandle,
/// aclrtMemSharedHandleType shareType, uint64_t flags, aclrtDrvMemHandle* handle)` (runtime
/// `acl_rt.h` l.3365-3378; `docs/zh/api_ref/11-04_virtual_memory_management.md` l.960-1023).
/// `shareableHandle` or `handle` NULL, `flags` not 0 → 100000 (`memory.cpp` l.1254-1262), else
/// 207000; `*handle` is not written.
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtMemImportFromShareableHandleV2(
    shareable_handle: *mut c_void,
    share_type: i32,
    flags: u64,
    handle: *mut *mut c_void,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtMemImportFromShareableHandleV2",
        || format!("{shareable_handle:p}, {share_type}, {flags}, {handle:p}"),
        || {
            if shareable_handle.is_null() {
                return Err(null("shareableHandle"));
            }
            if handle.is_null() {
                return Err(null("handle"));
            }
            if flags != 0 {
                return Err(invalid(format!("aclrtMemImportFromShareableHandleV2: flags {flags} must be 0")));
            }
            Err(unsupported("aclrtMemImportFromShareableHandleV2", "shareable physical memory handles"))
        },
    )
}

/// Not modelled: exports device memory to other processes under a key.
///
/// CANN: `aclError aclrtIpcMemGetExportKey(void* devPtr, size_t size, char* key, size_t len,
/// uint64_t flags)` (runtime `acl_rt.h` l.4570-4583; `docs/zh/api_ref/11-07_IPC_memory_sharing.md`
/// l.14). `devPtr` or `key` NULL → 100000 (`memory.cpp` l.1775-1784), else 207000; `key` is not
/// written.
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtIpcMemGetExportKey(
    dev_ptr: *mut c_void,
    size: usize,
    key: *mut c_char,
    len: usize,
    flags: u64,
) -> i32 {
    entry(
        Api::Acl,
        "aclrtIpcMemGetExportKey",
        || format!("{dev_ptr:p}, {size}, {key:p}, {len}, {flags}"),
        || {
            if dev_ptr.is_null() {
                return Err(null("devPtr"));
            }
            if key.is_null() {
                return Err(null("key"));
            }
            Err(unsupported("aclrtIpcMemGetExportKey", "IPC memory sharing (aclrtIpcMem*)"))
        },
    )
}

/// Not modelled: closes an IPC key.
///
/// CANN: `aclError aclrtIpcMemClose(const char* key)` (runtime `acl_rt.h` l.4585-4592). `key`
/// NULL → 100000 (`memory.cpp` l.1786-1793), else 207000; the key is not read.
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtIpcMemClose(key: *const c_char) -> i32 {
    entry(
        Api::Acl,
        "aclrtIpcMemClose",
        || format!("{key:p}"),
        || {
            if key.is_null() {
                return Err(null("key"));
            }
            Err(unsupported("aclrtIpcMemClose", "IPC memory sharing (aclrtIpcMem*)"))
        },
    )
}

/// Not modelled: imports device memory another process exported.
///
/// CANN: `aclError aclrtIpcMemImportByKey(void** devPtr, const char* key, uint64_t flags)`
/// (runtime `acl_rt.h` l.4594-4606). `devPtr` or `key` NULL → 100000 (`memory.cpp` l.1795-1802),
/// else 207000 (which the ACL layer logs as a warning, `memory.cpp` l.1803-1812); `*devPtr` is not
/// written and the key is not read.
///
/// # Safety
/// No pointer is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aclrtIpcMemImportByKey(dev_ptr: *mut *mut c_void, key: *const c_char, flags: u64) -> i32 {
    entry(
        Api::Acl,
        "aclrtIpcMemImportByKey",
        || format!("{dev_ptr:p}, {key:p}, {flags}"),
        || {
            if dev_ptr.is_null() {
                return Err(null("devPtr"));
            }
            if key.is_null() {
                return Err(null("key"));
            }
            Err(unsupported("aclrtIpcMemImportByKey", "IPC memory sharing (aclrtIpcMem*)"))
        },
    )
}
