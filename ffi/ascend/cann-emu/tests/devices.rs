//! Device ids (`ASCEND_RT_VISIBLE_DEVICES`), per-thread device state, contexts, memory.

mod common;

use std::ffi::c_void;
use std::time::Duration;

use common::*;
use ferry_cann_emu::*;

const T: Duration = Duration::from_secs(60);

fn report_devices() {
    let mut n = 0u32;
    // SAFETY: valid out-parameter.
    let code = unsafe { aclrtGetDeviceCount(&mut n) };
    if code == ACL_ERROR_RT_NO_DEVICE {
        say("DEVICES none");
        return;
    }
    ok(code, "aclrtGetDeviceCount");
    let mut phys = Vec::new();
    for user in 0..n as i32 {
        let (mut a, mut b) = (-1, -1);
        // SAFETY: valid out-parameters.
        ok(unsafe { aclrtGetPhyDevIdByUserDevId(user, &mut a) }, "aclrtGetPhyDevIdByUserDevId");
        // SAFETY: valid out-parameter.
        ok(unsafe { aclrtGetPhyDevIdByLogicDevId(user, &mut b) }, "aclrtGetPhyDevIdByLogicDevId");
        assert_eq!(a, b, "both queries map user {user} the same way");
        phys.push(a.to_string());
    }
    let mut out = -1;
    // SAFETY: valid out-parameter.
    assert_eq!(unsafe { aclrtGetPhyDevIdByUserDevId(n as i32, &mut out) }, ACL_ERROR_RT_INVALID_DEVICEID);
    // SAFETY: no pointers.
    assert_eq!(unsafe { aclrtSetDevice(n as i32) }, ACL_ERROR_RT_INVALID_DEVICEID);
    // SAFETY: no pointers.
    assert_eq!(unsafe { aclrtSetDevice(-1) }, ACL_ERROR_RT_INVALID_DEVICEID);
    say(&format!("DEVICES {n} [{}]", phys.join(",")));
}

#[test]
fn visible_devices_are_mapped_as_cann_documents() {
    if role().is_some() {
        report_devices();
        return;
    }
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[], "8 [0,1,2,3,4,5,6,7]"),
        (&[("ASCEND_RT_VISIBLE_DEVICES", "4,5")], "2 [4,5]"),
        (&[("ASCEND_RT_VISIBLE_DEVICES", "1, 2,3")], "1 [1]"),
        (&[("ASCEND_RT_VISIBLE_DEVICES", "1,3,8")], "2 [1,3]"),
        // Descending or repeated ids make the whole variable an error: no device at all.
        (&[("ASCEND_RT_VISIBLE_DEVICES", "5,4")], "none"),
        (&[("ASCEND_RT_VISIBLE_DEVICES", "3,3")], "none"),
        (&[("ASCEND_RT_VISIBLE_DEVICES", "")], "none"),
        (&[("ASCEND_RT_VISIBLE_DEVICES", "x")], "none"),
        (&[("FERRY_CANN_EMU_DEVICES", "4"), ("ASCEND_RT_VISIBLE_DEVICES", "2,5")], "1 [2]"),
        (&[("FERRY_CANN_EMU_DEVICES", "16"), ("ASCEND_RT_VISIBLE_DEVICES", "9,15")], "2 [9,15]"),
        (&[("FERRY_CANN_EMU_DEVICES", "3")], "3 [0,1,2]"),
    ];
    for (envs, expected) in cases {
        let (lines, _) = run_child("visible_devices_are_mapped_as_cann_documents", "report", envs, T);
        assert_eq!(lines, vec![format!("DEVICES {expected}")], "environment {envs:?}");
    }
}

#[test]
fn in_a_container_the_device_call_says_0_but_the_physical_id_is_4() {
    if role().is_some() {
        set_device(0);
        let mut dev = -1;
        // SAFETY: valid out-parameter.
        ok(unsafe { aclrtGetDevice(&mut dev) }, "aclrtGetDevice");
        let mut phy = -1;
        // SAFETY: valid out-parameter.
        ok(unsafe { aclrtGetPhyDevIdByUserDevId(dev, &mut phy) }, "phy");
        let p = dev_alloc(4096);
        let mut attr = AclrtPtrAttributes::default();
        // SAFETY: `attr` is a valid aclrtPtrAttributes.
        ok(unsafe { aclrtPointerGetAttributes(p, (&mut attr as *mut AclrtPtrAttributes).cast()) }, "attributes");
        assert_eq!(attr.location_type, ACL_MEM_LOCATION_TYPE_DEVICE);
        set_device(1);
        let mut dev1 = -1;
        // SAFETY: valid out-parameters.
        ok(unsafe { aclrtGetDevice(&mut dev1) }, "aclrtGetDevice");
        // SAFETY: valid out-parameter.
        ok(unsafe { aclrtGetPhyDevIdByUserDevId(dev1, &mut phy) }, "phy");
        say(&format!("IDS {dev} {} {dev1} {phy}", attr.id));
        return;
    }
    let (lines, _) = run_child(
        "in_a_container_the_device_call_says_0_but_the_physical_id_is_4",
        "container",
        &[("ASCEND_RT_VISIBLE_DEVICES", "4,5")],
        T,
    );
    assert_eq!(lines, vec!["IDS 0 0 1 5".to_string()]);
}

fn get_device() -> i32 {
    let mut d = -1;
    // SAFETY: valid out-parameter.
    let rc = unsafe { aclrtGetDevice(&mut d) };
    if rc == 0 { d } else { -rc }
}

#[test]
fn device_state_is_per_thread() {
    if role().is_none() {
        run_child("device_state_is_per_thread", "threads", &[], T);
        return;
    }
    assert_eq!(get_device(), -ACL_ERROR_RT_CONTEXT_NULL, "a new thread has no device");
    assert!(recent_error().contains("aclrtSetDevice"), "the error text says what to do");
    assert_eq!(recent_error(), "", "reading the text clears it");
    set_device(3);
    assert_eq!(get_device(), 3);
    std::thread::spawn(|| {
        assert_eq!(get_device(), -ACL_ERROR_RT_CONTEXT_NULL, "another thread does not inherit the device");
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-parameter.
        assert_eq!(unsafe { aclrtMalloc(&mut p, 64, 0) }, ACL_ERROR_RT_CONTEXT_NULL);
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-parameter.
        assert_eq!(unsafe { aclrtCreateStream(&mut s) }, ACL_ERROR_RT_CONTEXT_NULL);
        set_device(5);
        assert_eq!(get_device(), 5);
    })
    .join()
    .unwrap();
    assert_eq!(get_device(), 3, "the other thread's choice did not leak");

    let mut ctx: AclrtContext = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    ok(unsafe { aclrtCreateContext(&mut ctx, 6) }, "aclrtCreateContext");
    assert_eq!(get_device(), 6, "a created context becomes current");
    let ctx_value = ctx as usize;
    std::thread::spawn(move || {
        // SAFETY: a handle from aclrtCreateContext.
        ok(unsafe { aclrtSetCurrentContext(ctx_value as *mut c_void) }, "aclrtSetCurrentContext");
        assert_eq!(get_device(), 6);
        let mut cur: AclrtContext = std::ptr::null_mut();
        // SAFETY: valid out-parameter.
        ok(unsafe { aclrtGetCurrentContext(&mut cur) }, "aclrtGetCurrentContext");
        assert_eq!(cur as usize, ctx_value);
    })
    .join()
    .unwrap();
    // SAFETY: handle from aclrtCreateContext.
    ok(unsafe { aclrtDestroyContext(ctx) }, "aclrtDestroyContext");
    assert_eq!(get_device(), -ACL_ERROR_RT_CONTEXT_NULL);
    // SAFETY: the handle was destroyed: the emulator must refuse it, not dereference it.
    assert_eq!(unsafe { aclrtSetCurrentContext(ctx) }, ACL_ERROR_INVALID_PARAM);
    // SAFETY: a forged handle is refused the same way.
    assert_eq!(unsafe { aclrtSetCurrentContext(0xdead_beef as *mut c_void) }, ACL_ERROR_INVALID_PARAM);

    set_device(3);
    // SAFETY: no pointers.
    ok(unsafe { aclrtResetDevice(3) }, "aclrtResetDevice");
    assert_eq!(get_device(), 3, "set twice (once at the top), reset once: still referenced");
    // SAFETY: no pointers.
    ok(unsafe { aclrtResetDevice(3) }, "aclrtResetDevice");
    assert_eq!(get_device(), -ACL_ERROR_RT_CONTEXT_NULL, "the last reset destroys the default context");
}

#[test]
fn acl_init_twice_is_repeat_initialize() {
    if role().is_none() {
        run_child("acl_init_twice_is_repeat_initialize", "init", &[], T);
        return;
    }
    // SAFETY: NULL config path is allowed.
    unsafe {
        assert_eq!(aclInit(std::ptr::null()), 0);
        assert_eq!(aclInit(std::ptr::null()), ACL_ERROR_REPEAT_INITIALIZE);
        assert_eq!(aclFinalize(), 0);
        assert_eq!(aclInit(c"".as_ptr()), 0);
        assert_eq!(aclFinalize(), 0);
        assert_eq!(aclInit(c"/nonexistent/acl.json".as_ptr()), ACL_ERROR_INVALID_FILE);
        let (mut a, mut b, mut c) = (0, 0, 0);
        assert_eq!(aclrtGetVersion(&mut a, &mut b, &mut c), 0);
        assert_eq!((a, b, c), EMULATED_ACL_VERSION);
        assert_eq!(aclrtGetVersion(std::ptr::null_mut(), &mut b, &mut c), ACL_ERROR_INVALID_PARAM);
        assert!(!aclrtGetSocName().is_null());
    }
}

#[test]
fn memory_kinds_and_pointer_attributes() {
    if role().is_none() {
        run_child("memory_kinds_and_pointer_attributes", "memory", &[], T);
        return;
    }
    set_device(2);
    let d = dev_alloc(1 << 20);
    let mut h = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    ok(unsafe { aclrtMallocHost(&mut h, 4096) }, "aclrtMallocHost");
    let mut stack = [0u8; 64];
    let attr = |p: *const c_void| {
        let mut a = AclrtPtrAttributes::default();
        // SAFETY: `a` is a valid aclrtPtrAttributes.
        ok(unsafe { aclrtPointerGetAttributes(p, (&mut a as *mut AclrtPtrAttributes).cast()) }, "attributes");
        a
    };
    let a = attr(d.wrapping_byte_add(1000));
    assert_eq!((a.location_type, a.id, a.page_size), (ACL_MEM_LOCATION_TYPE_DEVICE, 2, 2 << 20));
    assert_eq!(attr(h).location_type, ACL_MEM_LOCATION_TYPE_HOST);
    assert_eq!(attr(stack.as_ptr().cast()).location_type, ACL_MEM_LOCATION_TYPE_UNREGISTERED);

    let data = pattern(1, 4096);
    upload(d, &data);
    assert_eq!(download(d, 4096), data);
    // SAFETY: (all calls below) host buffers are live and large enough; the emulator must
    // refuse the device-side mistakes without touching memory.
    unsafe {
        assert_eq!(
            aclrtMemcpy(stack.as_mut_ptr().cast(), 64, data.as_ptr().cast(), 64, ACL_MEMCPY_HOST_TO_DEVICE),
            ACL_ERROR_INVALID_PARAM,
            "H2D into host memory"
        );
        assert_eq!(aclrtMemcpy(d, 64, d.wrapping_byte_add(64), 64, ACL_MEMCPY_HOST_TO_HOST), ACL_ERROR_INVALID_PARAM);
        assert_eq!(
            aclrtMemcpy(d.wrapping_byte_add((1 << 20) - 8), 16, data.as_ptr().cast(), 16, ACL_MEMCPY_HOST_TO_DEVICE),
            ACL_ERROR_INVALID_PARAM,
            "past the end of the allocation"
        );
        assert_eq!(
            aclrtMemcpy(d, 8, data.as_ptr().cast(), 16, ACL_MEMCPY_HOST_TO_DEVICE),
            ACL_ERROR_INVALID_PARAM,
            "count > destMax"
        );
        assert_eq!(aclrtMemcpy(d, 8, data.as_ptr().cast(), 8, 9), ACL_ERROR_INVALID_PARAM, "unknown kind");
        assert_eq!(aclrtMemcpy(d.wrapping_byte_add(8192), 4096, d, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE), 0);
        assert_eq!(aclrtMemcpy(stack.as_mut_ptr().cast(), 64, d, 64, ACL_MEMCPY_DEFAULT), 0);
        assert_eq!(&stack[..], &data[..64]);
        assert_eq!(aclrtMalloc(std::ptr::null_mut(), 8, 0), ACL_ERROR_INVALID_PARAM);
        let mut p = std::ptr::null_mut();
        assert_eq!(aclrtMalloc(&mut p, 0, 0), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtFree(d.wrapping_byte_add(1)), ACL_ERROR_INVALID_PARAM, "not the start of an allocation");
        assert_eq!(aclrtFreeHost(d), ACL_ERROR_INVALID_PARAM);
        ok(aclrtFree(d), "aclrtFree");
        assert_eq!(aclrtFree(d), ACL_ERROR_INVALID_PARAM, "double free");
        assert_eq!(attr(d).location_type, ACL_MEM_LOCATION_TYPE_UNREGISTERED);
        ok(aclrtFreeHost(h), "aclrtFreeHost");
    }
}
