//! Fault injection and logging by environment.

mod common;

use std::ffi::CStr;
use std::time::Duration;

use common::*;
use ferry_cann_emu::*;

const T: Duration = Duration::from_secs(60);

#[test]
fn the_nth_call_fails_with_a_plausible_or_chosen_code() {
    if role().is_none() {
        run_child(
            "the_nth_call_fails_with_a_plausible_or_chosen_code",
            "fail",
            &[(
                "FERRY_CANN_EMU_FAIL",
                "aclrtMalloc:2,HcclGetRootInfo:1:21,aclrtGetSocName:1,aclrtSetDevice:3-4,HcclBatchGet:1",
            )],
            T,
        );
        return;
    }
    set_device(0);
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-parameters throughout.
    unsafe {
        assert_eq!(aclrtMalloc(&mut p, 64, 0), 0, "call 1");
        let before = p;
        assert_eq!(aclrtMalloc(&mut p, 64, 0), ACL_ERROR_RT_MEMORY_ALLOCATION, "call 2 is injected");
        assert_eq!(p, before, "a failed call does not write its out-parameter");
        assert!(recent_error().contains("injected failure of call #2"));
        assert_eq!(aclrtMalloc(&mut p, 64, 0), 0, "call 3");

        let mut root = HcclRootInfo::default();
        assert_eq!(HcclGetRootInfo(&mut root), HCCL_E_REMOTE, "the chosen code");
        assert!(aclrtGetSocName().is_null(), "pointer functions return NULL");
        assert!(!aclrtGetSocName().is_null());

        assert_eq!(aclrtSetDevice(0), 0, "call 2");
        assert_eq!(aclrtSetDevice(0), ACL_ERROR_RT_DEV_SETUP_ERROR, "call 3");
        assert_eq!(aclrtSetDevice(0), ACL_ERROR_RT_DEV_SETUP_ERROR, "call 4");
        assert_eq!(aclrtSetDevice(0), 0, "call 5");
    }
    #[cfg(feature = "onesided")]
    // SAFETY: injection happens before argument checks; the second call checks them.
    unsafe {
        let s = new_stream();
        assert_eq!(HcclBatchGet(std::ptr::null_mut(), 1, std::ptr::null_mut(), 1, s), HCCL_E_ROCE_TRANSFER);
        assert_eq!(HcclBatchGet(std::ptr::null_mut(), 1, std::ptr::null_mut(), 1, s), HCCL_E_PTR);
    }
}

#[test]
fn no_onesided_hides_the_service_at_run_time() {
    if role().is_none() {
        run_child("no_onesided_hides_the_service_at_run_time", "no1s", &[("FERRY_CANN_EMU_NO_ONESIDED", "1")], T);
        return;
    }
    set_device(0);
    #[cfg(feature = "onesided")]
    // SAFETY: valid pointers; the calls must answer before looking at them.
    unsafe {
        let d = dev_alloc(4096);
        let mem = CommMem { mem_type: HCCL_MEM_TYPE_DEVICE, addr: d, size: 4096 };
        let mut h = std::ptr::null_mut();
        assert_eq!(HcclRegisterGlobalMem(&mem, &mut h), HCCL_E_NOT_SUPPORT);
        assert!(recent_error().contains("FERRY_CANN_EMU_NO_ONESIDED"));
        let mut comm = std::ptr::null_mut();
        assert_eq!(
            HcclCommInitClusterInfoMemConfig(c"{}".as_ptr(), 0, std::ptr::null_mut(), &mut comm),
            HCCL_E_NOT_SUPPORT
        );
        assert_eq!(
            HcclBatchGet(std::ptr::null_mut(), 0, std::ptr::null_mut(), 0, std::ptr::null_mut()),
            HCCL_E_NOT_SUPPORT
        );
        assert_eq!(
            HcclBatchPut(std::ptr::null_mut(), 0, std::ptr::null_mut(), 0, std::ptr::null_mut()),
            HCCL_E_NOT_SUPPORT
        );
        assert_eq!(HcclCommPrepare(std::ptr::null_mut(), std::ptr::null(), 0), HCCL_E_NOT_SUPPORT);
    }
    // SAFETY: two-sided calls are unaffected: a NULL argument is still HCCL_E_PTR.
    unsafe {
        assert_eq!(HcclGetRootInfo(std::ptr::null_mut()), HCCL_E_PTR);
        let text = CStr::from_ptr(HcclGetErrorString(HCCL_E_NOT_SUPPORT));
        assert!(text.to_string_lossy().contains("not supported"), "{text:?}");
    }
}

#[test]
fn calls_are_logged_to_stderr_when_asked() {
    if role().is_none() {
        let (_, stderr) = run_child("calls_are_logged_to_stderr_when_asked", "log", &[("FERRY_CANN_EMU_LOG", "1")], T);
        assert!(stderr.contains("aclrtSetDevice(4) -> 0"), "{stderr}");
        assert!(stderr.contains("aclrtGetDevice(0x0) -> 100000 (deviceId is NULL)"), "{stderr}");
        let (_, quiet) = run_child("calls_are_logged_to_stderr_when_asked", "log", &[], T);
        assert!(!quiet.contains("aclrtSetDevice("), "{quiet}");
        let (_, warned) = run_child(
            "calls_are_logged_to_stderr_when_asked",
            "log",
            &[("FERRY_CANN_EMU_FAIL", "aclrtNope:1,aclrtMalloc:zero")],
            T,
        );
        assert!(warned.contains("unknown symbol \"aclrtNope\""), "{warned}");
        assert!(warned.contains("entry \"aclrtMalloc:zero\" ignored"), "{warned}");
        return;
    }
    set_device(4);
    // SAFETY: NULL is refused.
    assert_eq!(unsafe { aclrtGetDevice(std::ptr::null_mut()) }, ACL_ERROR_INVALID_PARAM);
    let mut d = 0;
    // SAFETY: valid out-parameter.
    ok(unsafe { aclrtGetDevice(&mut d) }, "aclrtGetDevice");
}
