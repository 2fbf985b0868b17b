//! The ACL calls beyond the reference (Mooncake's NPU wheel imports them): the implemented
//! ones' behaviour and errors, and the unsupported ones' code and message.

mod common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};
use std::time::Duration;

use common::*;
use ferry_cann_emu::mem_attr::*;
use ferry_cann_emu::*;

const T: Duration = Duration::from_secs(60);

/// A recognisable pointer value an export must not overwrite when it fails.
const SENTINEL: *mut c_void = 0x5e17_1e10 as *mut c_void;

fn host_alloc(len: usize) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: `p` is a valid out-parameter.
    ok(unsafe { aclrtMallocHost(&mut p, len) }, "aclrtMallocHost");
    p
}

#[track_caller]
fn fails(code: i32, want: i32, text: &str) {
    assert_eq!(code, want, "recent error: {}", recent_error());
    let msg = recent_error();
    assert!(msg.contains(text), "message {msg:?} lacks {text:?}");
}

#[test]
fn create_stream_with_config_makes_ordinary_streams() {
    if role().is_none() {
        run_child("create_stream_with_config_makes_ordinary_streams", "streams", &[], T);
        return;
    }
    let mut s = SENTINEL;
    // SAFETY: valid out-parameter (or NULL, which must be refused).
    unsafe {
        fails(aclrtCreateStreamWithConfig(null_mut(), 0, 0), ACL_ERROR_INVALID_PARAM, "stream is NULL");
        fails(aclrtCreateStreamWithConfig(&mut s, 0, 0), ACL_ERROR_RT_CONTEXT_NULL, "no current context");
    }
    assert_eq!(s, SENTINEL);
    set_device(0);
    for flag in [ACL_STREAM_PERSISTENT, ACL_STREAM_CPU_SCHEDULE, ACL_STREAM_DEVICE_USE_ONLY | ACL_STREAM_FAST_LAUNCH] {
        // SAFETY: valid out-parameter.
        let rc = unsafe { aclrtCreateStreamWithConfig(&mut s, 0, flag) };
        fails(rc, ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "does not model");
        assert_eq!(s, SENTINEL, "flag {flag:#x}: nothing written on failure");
    }
    // Priority out of 0..=7 is clamped by CANN, unknown flag bits give an ordinary stream.
    for (priority, flag) in [(0, 0), (3, ACL_STREAM_FAST_LAUNCH | ACL_STREAM_FAST_SYNC), (99, ACL_STREAM_HUGE | 0x1000)]
    {
        // SAFETY: valid out-parameter.
        ok(unsafe { aclrtCreateStreamWithConfig(&mut s, priority, flag) }, "aclrtCreateStreamWithConfig");
        let (a, b) = (dev_alloc(4096), dev_alloc(4096));
        upload(a, &pattern(priority, 4096));
        // SAFETY: device memory of 4096 bytes each; a live stream.
        unsafe {
            ok(aclrtMemcpyAsync(b, 4096, a, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE, s), "aclrtMemcpyAsync");
            ok(aclrtSynchronizeStreamWithTimeout(s, 5000), "synchronize");
            ok(aclrtDestroyStream(s), "aclrtDestroyStream");
        }
        assert_eq!(download(b, 4096), pattern(priority, 4096));
    }
}

/// Arguments of one `aclrtMemcpyBatch` call, owned.
struct Batch {
    dsts: Vec<*mut c_void>,
    dest_maxs: Vec<usize>,
    srcs: Vec<*mut c_void>,
    sizes: Vec<usize>,
    attrs: Vec<AclrtMemcpyBatchAttr>,
    idx: Vec<usize>,
}

impl Batch {
    /// Runs it; returns the code and `failIndex` (which starts at 7).
    fn run(&mut self) -> (i32, usize) {
        let mut fail = 7usize;
        // SAFETY: every array holds as many elements as its count says; host sides are live.
        let rc = unsafe {
            aclrtMemcpyBatch(
                self.dsts.as_mut_ptr(),
                self.dest_maxs.as_mut_ptr(),
                self.srcs.as_mut_ptr(),
                self.sizes.as_mut_ptr(),
                self.sizes.len(),
                self.attrs.as_mut_ptr(),
                self.idx.as_mut_ptr(),
                self.attrs.len(),
                &mut fail,
            )
        };
        (rc, fail)
    }
}

fn loc(location_type: i32, id: u32) -> AclrtMemLocation {
    AclrtMemLocation { id, location_type }
}

fn attr(dst: AclrtMemLocation, src: AclrtMemLocation) -> AclrtMemcpyBatchAttr {
    AclrtMemcpyBatchAttr { dst_loc: dst, src_loc: src, rsv: [0; 16] }
}

#[test]
fn memcpy_batch_copies_h2d_and_d2h_with_cann_checks() {
    if role().is_none() {
        run_child("memcpy_batch_copies_h2d_and_d2h_with_cann_checks", "batch", &[], T);
        return;
    }
    let host = |t| loc(t, 0);
    let dev = loc(ACL_MEM_LOCATION_TYPE_DEVICE, 1);
    let h2d = attr(dev, host(ACL_MEM_LOCATION_TYPE_HOST));
    let d2h = attr(host(ACL_MEM_LOCATION_TYPE_HOST), dev);

    // No context yet: the runtime needs one (after the argument checks).
    let mut src0 = pattern(1, 4096);
    let mut b = Batch {
        dsts: vec![0x1000 as *mut c_void],
        dest_maxs: vec![4096],
        srcs: vec![src0.as_mut_ptr().cast()],
        sizes: vec![4096],
        attrs: vec![h2d],
        idx: vec![0],
    };
    let (rc, _) = b.run();
    fails(rc, ACL_ERROR_RT_CONTEXT_NULL, "no current context");

    set_device(1);
    let (d0, d1) = (dev_alloc(4096), dev_alloc(8192));
    let mut src1 = pattern(2, 8192);
    upload(d1, &src1);
    let mut out0 = vec![0u8; 8192];
    let malloc_host = host_alloc(4096);
    // Two H2D copies (one from plain memory, one from aclrtMallocHost memory, HOST_NUMA accepted
    // as host), then one D2H: two attribute ranges.
    // SAFETY: `malloc_host` holds 4096 bytes.
    unsafe { std::ptr::write_bytes(malloc_host.cast::<u8>(), 0xab, 4096) };
    let mut good = Batch {
        dsts: vec![d0, unsafe_offset(d1, 4096), out0.as_mut_ptr().cast()],
        dest_maxs: vec![4096, 4096, 8192],
        srcs: vec![src0.as_mut_ptr().cast(), malloc_host, d1],
        sizes: vec![4096, 4096, 4096],
        attrs: vec![attr(dev, host(ACL_MEM_LOCATION_TYPE_HOST_NUMA)), d2h],
        idx: vec![0, 2],
    };
    assert_eq!(good.run(), (0, usize::MAX), "{}", recent_error());
    assert_eq!(download(d0, 4096), src0);
    assert_eq!(download(unsafe_offset(d1, 4096), 4096), vec![0xab; 4096]);
    assert_eq!(&out0[..4096], &src1[..4096], "the D2H copy read the bytes uploaded before");

    // ACL-layer checks: 100000, failIndex untouched.
    let mut fail = 7usize;
    let mut sizes = [4096usize];
    // SAFETY: NULL arrays must be refused before anything is read.
    unsafe {
        let rc = aclrtMemcpyBatch(
            null_mut(),
            null_mut(),
            null_mut(),
            sizes.as_mut_ptr(),
            1,
            null_mut(),
            null_mut(),
            1,
            null_mut(),
        );
        fails(rc, ACL_ERROR_INVALID_PARAM, "failIndex is NULL");
        let rc =
            aclrtMemcpyBatch(null_mut(), null_mut(), null_mut(), null_mut(), 1, null_mut(), null_mut(), 1, &mut fail);
        fails(rc, ACL_ERROR_INVALID_PARAM, "sizes is NULL");
        let rc = aclrtMemcpyBatch(
            null_mut(),
            null_mut(),
            null_mut(),
            sizes.as_mut_ptr(),
            0,
            null_mut(),
            null_mut(),
            1,
            &mut fail,
        );
        fails(rc, ACL_ERROR_INVALID_PARAM, "numBatches");
        assert_eq!(fail, 7);
        let rc = aclrtMemcpyBatch(
            null_mut(),
            null_mut(),
            null_mut(),
            sizes.as_mut_ptr(),
            1,
            null_mut(),
            null_mut(),
            1,
            &mut fail,
        );
        fails(rc, ACL_ERROR_INVALID_PARAM, "dsts is NULL");
        assert_eq!(fail, 7);
        // Every size 0: success without looking at anything else.
        let mut zero = [0usize, 0];
        ok(
            aclrtMemcpyBatch(
                null_mut(),
                null_mut(),
                null_mut(),
                zero.as_mut_ptr(),
                2,
                null_mut(),
                null_mut(),
                0,
                &mut fail,
            ),
            "all-zero batch",
        );
        assert_eq!(fail, usize::MAX);
    }
    let mut b = Batch { dest_maxs: vec![4095], ..clone_batch(&good, 0, h2d) };
    assert_eq!(b.run(), (ACL_ERROR_INVALID_PARAM, 7));
    assert!(recent_error().contains("exceeds the size 4095"));
    let mut bad_rsv = h2d;
    bad_rsv.rsv[15] = 1;
    let mut b = clone_batch(&good, 0, bad_rsv);
    assert_eq!(b.run(), (ACL_ERROR_INVALID_PARAM, 7));
    assert!(recent_error().contains("rsv"));

    // Runtime-layer checks: 107000, failIndex SIZE_MAX.
    let mut b = Batch { idx: vec![1], ..clone_batch(&good, 0, h2d) };
    assert_eq!(b.run(), (ACL_ERROR_RT_PARAM_INVALID, usize::MAX));
    assert!(recent_error().contains("attrsIndexes[0]"));
    let mut b = Batch { attrs: vec![h2d, h2d], idx: vec![0, 1], ..clone_batch(&good, 0, h2d) };
    assert_eq!(b.run(), (ACL_ERROR_RT_PARAM_INVALID, usize::MAX), "numAttrs above numBatches");
    let mut b = clone_batch(&good, 0, h2d);
    b.dsts.push(d0);
    b.dest_maxs.push(4096);
    b.srcs.push(src0.as_mut_ptr().cast());
    b.sizes.push(4096);
    b.attrs = vec![h2d, h2d];
    b.idx = vec![0, 0];
    assert_eq!(b.run(), (ACL_ERROR_RT_PARAM_INVALID, usize::MAX), "attrsIndexes not increasing");
    assert!(recent_error().contains("attrsIndexes[1]"));
    let n = ACL_MEMCPY_BATCH_MAX_COUNT + 1;
    let mut b = Batch {
        dsts: vec![d0; n],
        dest_maxs: vec![1; n],
        srcs: vec![src0.as_mut_ptr().cast(); n],
        sizes: vec![1; n],
        attrs: vec![h2d],
        idx: vec![0],
    };
    assert_eq!(b.run(), (ACL_ERROR_RT_PARAM_INVALID, usize::MAX), "more than 4096 copies");

    // Per-copy checks: 107000 and the index of the copy.
    upload(d0, &[0; 4096]);
    let mut b = Batch { attrs: vec![h2d], idx: vec![0], ..clone_all(&good) };
    assert_eq!(b.run(), (ACL_ERROR_RT_PARAM_INVALID, 2), "copy 2 is D2H under an H2D attribute");
    assert!(recent_error().contains("copy 2"));
    let mut b = clone_batch(&good, 0, attr(loc(ACL_MEM_LOCATION_TYPE_DEVICE, 0), host(ACL_MEM_LOCATION_TYPE_HOST)));
    assert_eq!(b.run(), (ACL_ERROR_RT_PARAM_INVALID, 0), "wrong device id");
    let mut other = vec![0u8; 4096];
    let h2h = attr(host(ACL_MEM_LOCATION_TYPE_HOST), host(ACL_MEM_LOCATION_TYPE_HOST));
    let mut b = Batch {
        dsts: vec![d0, other.as_mut_ptr().cast()],
        dest_maxs: vec![4096, 4096],
        srcs: vec![src0.as_mut_ptr().cast(), src1.as_mut_ptr().cast()],
        sizes: vec![4096, 4096],
        attrs: vec![h2d, h2h],
        idx: vec![0, 1],
    };
    assert_eq!(b.run(), (ACL_ERROR_RT_PARAM_INVALID, 1), "host to host");
    assert!(recent_error().contains("only H2D and D2H"));
    assert_eq!(download(d0, 4096), vec![0; 4096], "no copy of a refused batch ran");
    let mut b = Batch { dest_maxs: vec![8192], sizes: vec![8192], ..clone_batch(&good, 0, h2d) };
    assert_eq!(b.run(), (ACL_ERROR_RT_PARAM_INVALID, 0), "8192 bytes into a 4096-byte allocation");
    assert!(recent_error().contains("runs past the end"));
    // SAFETY: allocated above.
    ok(unsafe { aclrtFreeHost(malloc_host) }, "aclrtFreeHost");
}

/// All of `b`.
fn clone_all(b: &Batch) -> Batch {
    Batch {
        dsts: b.dsts.clone(),
        dest_maxs: b.dest_maxs.clone(),
        srcs: b.srcs.clone(),
        sizes: b.sizes.clone(),
        attrs: b.attrs.clone(),
        idx: b.idx.clone(),
    }
}

/// Copy `i` of `b` alone, under attribute `a`.
fn clone_batch(b: &Batch, i: usize, a: AclrtMemcpyBatchAttr) -> Batch {
    Batch {
        dsts: vec![b.dsts[i]],
        dest_maxs: vec![b.dest_maxs[i]],
        srcs: vec![b.srcs[i]],
        sizes: vec![b.sizes[i]],
        attrs: vec![a],
        idx: vec![0],
    }
}

fn unsafe_offset(p: *mut c_void, n: usize) -> *mut c_void {
    p.cast::<u8>().wrapping_add(n).cast()
}

#[test]
fn host_register_maps_pinned_host_memory_per_device() {
    if role().is_none() {
        run_child("host_register_maps_pinned_host_memory_per_device", "register", &[], T);
        return;
    }
    let h = host_alloc(16384);
    let mut d = SENTINEL;
    // SAFETY: `h` is live host memory; `d` a valid out-parameter (or NULL, to be refused).
    unsafe {
        fails(
            aclrtHostRegister(null_mut(), 4096, ACL_HOST_REGISTER_MAPPED, &mut d),
            ACL_ERROR_INVALID_PARAM,
            "ptr is NULL",
        );
        fails(
            aclrtHostRegister(h, 4096, ACL_HOST_REGISTER_MAPPED, null_mut()),
            ACL_ERROR_INVALID_PARAM,
            "devPtr is NULL",
        );
        fails(aclrtHostRegister(h, 0, ACL_HOST_REGISTER_MAPPED, &mut d), ACL_ERROR_INVALID_PARAM, "size");
        fails(aclrtHostRegister(h, 4096, 1, &mut d), ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "not supported");
        fails(
            aclrtHostRegister(h, 4096, ACL_HOST_REGISTER_MAPPED, &mut d),
            ACL_ERROR_RT_CONTEXT_NULL,
            "no current context",
        );
        fails(aclrtHostUnregister(h), ACL_ERROR_RT_CONTEXT_NULL, "no current context");
    }
    assert_eq!(d, SENTINEL);
    set_device(0);
    // SAFETY: as above.
    unsafe {
        fails(
            aclrtHostRegister(h, 4096, ACL_HOST_REGISTER_IOMEMORY, &mut d),
            ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
            "does not model",
        );
        fails(aclrtHostRegister(unsafe_offset(h, 512), 1024, 0, &mut d), ACL_ERROR_RT_DRV_INTERNAL_ERROR, "4 KB");
        fails(aclrtHostRegister(h, 16385, 0, &mut d), ACL_ERROR_RT_DRV_INTERNAL_ERROR, "aclrtMallocHost");
        assert_eq!(d, SENTINEL);

        ok(aclrtHostRegister(h, 8192, ACL_HOST_REGISTER_MAPPED, &mut d), "aclrtHostRegister");
        assert_eq!(d, h, "emulated devices share the host's address space: the mapping is the identity");
        fails(
            aclrtHostRegister(unsafe_offset(h, 4096), 8192, 0, &mut d),
            ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
            "overlaps",
        );
        let mut d2 = SENTINEL;
        ok(aclrtHostRegister(unsafe_offset(h, 8192), 4096, ACL_HOST_REGISTER_READONLY, &mut d2), "adjacent range");
        assert_eq!(d2, unsafe_offset(h, 8192));
        fails(aclrtHostUnregister(unsafe_offset(h, 4096)), ACL_ERROR_HOST_MEMORY_NOT_REGISTERED, "not the start");
        fails(aclrtHostUnregister(null_mut()), ACL_ERROR_INVALID_PARAM, "ptr is NULL");
    }
    // Registrations belong to a device: device 1 may register the same range and does not see
    // device 0's.
    let hv = h as usize;
    std::thread::spawn(move || {
        set_device(1);
        let h = hv as *mut c_void;
        let mut d = null_mut();
        // SAFETY: live host memory, valid out-parameter.
        unsafe {
            ok(aclrtHostRegister(h, 4096, 0, &mut d), "same range on device 1");
            ok(aclrtHostUnregister(h), "unregister on device 1");
            fails(aclrtHostUnregister(h), ACL_ERROR_HOST_MEMORY_NOT_REGISTERED, "device 1");
        }
    })
    .join()
    .unwrap();
    // SAFETY: as above.
    unsafe {
        ok(aclrtHostUnregister(h), "aclrtHostUnregister");
        fails(aclrtHostUnregister(h), ACL_ERROR_HOST_MEMORY_NOT_REGISTERED, "not the start");
        ok(aclrtHostUnregister(unsafe_offset(h, 8192)), "aclrtHostUnregister");
    }
    // Device memory and memory ACL does not know are refused.
    let dm = dev_alloc(8192);
    let layout = std::alloc::Layout::from_size_align(8192, 4096).unwrap();
    // SAFETY: a non-zero layout.
    let plain = unsafe { std::alloc::alloc(layout) };
    // SAFETY: live memory; valid out-parameter.
    unsafe {
        fails(aclrtHostRegister(dm, 4096, 0, &mut d), ACL_ERROR_RT_DRV_INTERNAL_ERROR, "aclrtMallocHost");
        fails(aclrtHostRegister(plain.cast(), 4096, 0, &mut d), ACL_ERROR_RT_DRV_INTERNAL_ERROR, "aclrtMallocHost");
        std::alloc::dealloc(plain, layout);
        ok(aclrtFreeHost(h), "aclrtFreeHost");
    }
}

#[test]
fn allocation_granularity_follows_the_page_type() {
    if role().is_none() {
        run_child("allocation_granularity_follows_the_page_type", "granularity", &[], T);
        return;
    }
    let query = |attr: i32, location_type: i32, option: i32| {
        let mut prop = AclrtPhysicalMemProp { mem_attr: attr, location: loc(location_type, 0), ..Default::default() };
        let mut g = 7usize;
        // SAFETY: valid in- and out-parameters.
        let rc = unsafe { aclrtMemGetAllocationGranularity(&mut prop, option, &mut g) };
        (rc, g)
    };
    let (dev, host) = (ACL_MEM_LOCATION_TYPE_DEVICE, ACL_MEM_LOCATION_TYPE_HOST);
    for option in [ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED] {
        for a in [ACL_MEM_HUGE, ACL_MEM_P2P_HUGE, ACL_HBM_MEM_HUGE] {
            assert_eq!(query(a, dev, option), (0, HUGE_PAGE_GRANULARITY), "attr {a}");
        }
        assert_eq!(query(ACL_DDR_MEM_HUGE, host, option), (0, 2 << 20));
        for a in [ACL_MEM_HUGE1G, ACL_MEM_P2P_HUGE1G, ACL_HBM_MEM_HUGE1G] {
            assert_eq!(query(a, dev, option), (0, 1 << 30), "attr {a}");
        }
        for a in [ACL_MEM_NORMAL, ACL_MEM_P2P_NORMAL, ACL_HBM_MEM_NORMAL] {
            assert_eq!(query(a, dev, option), (0, NORMAL_PAGE_GRANULARITY), "attr {a}");
        }
    }
    assert_eq!(query(ACL_MEM_HUGE1G, host, 0), (ACL_ERROR_INVALID_PARAM, 7));
    assert_eq!(query(ACL_DDR_MEM_HUGE, dev, 0), (ACL_ERROR_INVALID_PARAM, 7));
    assert!(recent_error().contains("only supports MEM_LOCATION_TYPE_HOST"));
    for a in [ACL_DDR_MEM, ACL_HBM_MEM, ACL_HBM_MEM_P2P_HUGE, 99] {
        assert_eq!(query(a, dev, 0), (ACL_ERROR_INVALID_PARAM, 7), "attr {a}");
    }
    assert_eq!(query(ACL_MEM_HUGE, dev, 0xffff), (ACL_ERROR_INVALID_PARAM, 7));
    let mut g = 7usize;
    let mut prop = AclrtPhysicalMemProp::default();
    // SAFETY: NULL must be refused.
    unsafe {
        fails(aclrtMemGetAllocationGranularity(null_mut(), 0, &mut g), ACL_ERROR_INVALID_PARAM, "prop is NULL");
        fails(
            aclrtMemGetAllocationGranularity(&mut prop, 0, null_mut()),
            ACL_ERROR_INVALID_PARAM,
            "granularity is NULL",
        );
    }
    assert_eq!(g, 7);
}

#[test]
fn unmodelled_calls_check_arguments_then_answer_feature_not_supported() {
    if role().is_none() {
        run_child("unmodelled_calls_check_arguments_then_answer_feature_not_supported", "unsupported", &[], T);
        return;
    }
    set_device(0);
    let dm = dev_alloc(4096);
    let handle = 0x1234 as *mut c_void;
    let mut p = SENTINEL;
    let mut key = [0x55u8; 64];
    let key_ptr = key.as_mut_ptr().cast::<std::ffi::c_char>();
    let prop = AclrtPhysicalMemProp {
        mem_attr: ACL_MEM_HUGE,
        location: loc(ACL_MEM_LOCATION_TYPE_DEVICE, 0),
        ..Default::default()
    };
    let mut desc = AclrtMemAccessDesc { flags: 3, location: loc(ACL_MEM_LOCATION_TYPE_DEVICE, 0), rsv: [0; 12] };
    let mut fabric = [0x66u8; 128];
    let fab = fabric.as_mut_ptr().cast::<c_void>();
    let ns = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    let bad = ACL_ERROR_INVALID_PARAM;
    // SAFETY: every pointer is NULL (to be refused) or valid for what the call may read or write.
    let cases: Vec<(&str, i32, i32)> = unsafe {
        vec![
            ("reserve", aclrtReserveMemAddress(&mut p, 2 << 20, 0, null_mut(), 0), ns),
            ("reserve flags 1", aclrtReserveMemAddress(&mut p, 2 << 20, 0, null_mut(), 1), ns),
            ("reserve NULL", aclrtReserveMemAddress(null_mut(), 2 << 20, 0, null_mut(), 0), bad),
            ("reserve size 0", aclrtReserveMemAddress(&mut p, 0, 0, null_mut(), 0), bad),
            ("reserve flags 2", aclrtReserveMemAddress(&mut p, 2 << 20, 0, null_mut(), 2), bad),
            ("reserve no-UC", aclrtReserveMemAddressNoUCMemory(&mut p, 2 << 20, 0, null_mut(), 0), ns),
            ("reserve no-UC NULL", aclrtReserveMemAddressNoUCMemory(null_mut(), 2 << 20, 0, null_mut(), 0), bad),
            ("release", aclrtReleaseMemAddress(dm), ns),
            ("release NULL", aclrtReleaseMemAddress(null_mut()), bad),
            ("malloc physical", aclrtMallocPhysical(&mut p, 2 << 20, &prop, 0), ns),
            ("malloc physical NULL prop", aclrtMallocPhysical(&mut p, 2 << 20, null(), 0), bad),
            ("malloc physical NULL handle", aclrtMallocPhysical(null_mut(), 2 << 20, &prop, 0), bad),
            ("malloc physical flags", aclrtMallocPhysical(&mut p, 2 << 20, &prop, 1), bad),
            (
                "malloc physical handle type",
                aclrtMallocPhysical(&mut p, 2 << 20, &AclrtPhysicalMemProp { handle_type: 2, ..prop }, 0),
                bad,
            ),
            ("free physical", aclrtFreePhysical(handle), ns),
            ("free physical NULL", aclrtFreePhysical(null_mut()), bad),
            ("map", aclrtMapMem(dm, 4096, 0, handle, 0), ns),
            ("map NULL handle", aclrtMapMem(dm, 4096, 0, null_mut(), 0), bad),
            ("map flags", aclrtMapMem(dm, 4096, 0, handle, 1), bad),
            ("unmap", aclrtUnmapMem(dm), ns),
            ("unmap NULL", aclrtUnmapMem(null_mut()), bad),
            ("set access", aclrtMemSetAccess(dm, 4096, &mut desc, 1), ns),
            ("set access NULL desc", aclrtMemSetAccess(dm, 4096, null_mut(), 1), bad),
            ("export", aclrtMemExportToShareableHandleV2(handle, 0, 1, fab), ns),
            ("export NULL", aclrtMemExportToShareableHandleV2(handle, 0, 1, null_mut()), bad),
            ("import", aclrtMemImportFromShareableHandleV2(fab, 1, 0, &mut p), ns),
            ("import flags", aclrtMemImportFromShareableHandleV2(fab, 1, 1, &mut p), bad),
            ("import NULL", aclrtMemImportFromShareableHandleV2(null_mut(), 1, 0, &mut p), bad),
            ("ipc export", aclrtIpcMemGetExportKey(dm, 4096, key_ptr, 64, 0), ns),
            ("ipc export NULL key", aclrtIpcMemGetExportKey(dm, 4096, null_mut(), 64, 0), bad),
            ("ipc close", aclrtIpcMemClose(key_ptr), ns),
            ("ipc close NULL", aclrtIpcMemClose(null()), bad),
            ("ipc import", aclrtIpcMemImportByKey(&mut p, key_ptr, 0), ns),
            ("ipc import NULL", aclrtIpcMemImportByKey(null_mut(), key_ptr, 0), bad),
        ]
    };
    // Each call's own message is recorded and replaced by the next; check each code, and the
    // text of one call of each kind.
    for (what, rc, want) in &cases {
        assert_eq!(rc, want, "{what}");
    }
    let says_unmodelled = |rc: i32| {
        assert_eq!(rc, ns);
        let msg = recent_error();
        assert!(msg.contains("does not model") && msg.contains("207000"), "{msg}");
    };
    // SAFETY: as above.
    unsafe {
        says_unmodelled(aclrtReserveMemAddress(&mut p, 2 << 20, 0, null_mut(), 0));
        says_unmodelled(aclrtMallocPhysical(&mut p, 2 << 20, &prop, 0));
        says_unmodelled(aclrtMapMem(dm, 4096, 0, handle, 0));
        says_unmodelled(aclrtMemSetAccess(dm, 4096, &mut desc, 1));
        says_unmodelled(aclrtMemExportToShareableHandleV2(handle, 0, 1, fab));
        says_unmodelled(aclrtIpcMemImportByKey(&mut p, key_ptr, 0));
        says_unmodelled(aclrtIpcMemClose(key_ptr));
        fails(aclrtUnmapMem(null_mut()), bad, "virPtr is NULL");
    }
    assert_eq!(p, SENTINEL, "no out-parameter is written on failure");
    assert_eq!(key, [0x55; 64]);
    assert_eq!(fabric, [0x66; 128]);
}
