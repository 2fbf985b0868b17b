//! Streams: ordering, asynchrony, synchronize with a timeout, stream/device checks.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ferry_cann_emu::*;

const T: Duration = Duration::from_secs(60);

#[test]
fn operations_on_a_stream_run_in_order_and_calls_do_not_wait() {
    if role().is_none() {
        // Each queued copy takes 20 ms: ordering and asynchrony become observable.
        run_child(
            "operations_on_a_stream_run_in_order_and_calls_do_not_wait",
            "order",
            &[("FERRY_CANN_EMU_DELAY_US", "aclrtMemcpyAsync:20000")],
            T,
        );
        return;
    }
    set_device(0);
    let len = 64 * 1024;
    let bufs: Vec<_> = (0..16).map(|_| dev_alloc(len)).collect();
    let data = pattern(9, len);
    upload(bufs[0], &data);
    let s = new_stream();
    let start = Instant::now();
    for w in bufs.windows(2) {
        // SAFETY: both sides are emulated device memory of `len` bytes.
        ok(unsafe { aclrtMemcpyAsync(w[1], len, w[0], len, ACL_MEMCPY_DEVICE_TO_DEVICE, s) }, "aclrtMemcpyAsync");
    }
    let queued = start.elapsed();
    // SAFETY: live stream.
    ok(unsafe { aclrtSynchronizeStream(s) }, "aclrtSynchronizeStream");
    let done = start.elapsed();
    assert!(done >= Duration::from_millis(15 * 20), "15 copies of 20 ms each took only {done:?}");
    assert!(queued < Duration::from_millis(150), "queueing 15 copies took {queued:?}: the calls waited");
    assert_eq!(download(bufs[15], len), data, "each copy ran after the one it depends on");

    // A timeout shorter than the queued work gives 507046; the work still completes.
    // SAFETY: both sides are emulated device memory of `len` bytes.
    ok(unsafe { aclrtMemcpyAsync(bufs[3], len, bufs[0], len, ACL_MEMCPY_DEVICE_TO_DEVICE, s) }, "aclrtMemcpyAsync");
    // SAFETY: live stream.
    assert_eq!(unsafe { aclrtSynchronizeStreamWithTimeout(s, 1) }, ACL_ERROR_RT_STREAM_SYNC_TIMEOUT);
    assert!(recent_error().contains("timed out"));
    // SAFETY: live stream.
    ok(unsafe { aclrtSynchronizeStreamWithTimeout(s, -1) }, "synchronize forever");
    // SAFETY: live stream; 0 is not a valid timeout.
    assert_eq!(unsafe { aclrtSynchronizeStreamWithTimeout(s, 0) }, ACL_ERROR_INVALID_PARAM);
    // SAFETY: live stream.
    ok(unsafe { aclrtSynchronizeStreamWithTimeout(s, 5000) }, "synchronize 5 s");

    // aclrtStreamQuery says whether the queued work is done, without waiting for it.
    let mut status = -1;
    // SAFETY: live stream, valid out-pointer.
    ok(unsafe { aclrtStreamQuery(s, &mut status) }, "aclrtStreamQuery");
    assert_eq!(status, ACL_STREAM_STATUS_COMPLETE, "nothing is queued");
    // SAFETY: both sides are emulated device memory of `len` bytes.
    ok(unsafe { aclrtMemcpyAsync(bufs[4], len, bufs[0], len, ACL_MEMCPY_DEVICE_TO_DEVICE, s) }, "aclrtMemcpyAsync");
    let asked = Instant::now();
    // SAFETY: live stream, valid out-pointer.
    ok(unsafe { aclrtStreamQuery(s, &mut status) }, "aclrtStreamQuery");
    assert!(asked.elapsed() < Duration::from_millis(15), "the query waited for the 20 ms copy");
    assert_eq!(status, ACL_STREAM_STATUS_NOT_READY, "a 20 ms copy is running");
    while status != ACL_STREAM_STATUS_COMPLETE {
        // SAFETY: live stream, valid out-pointer.
        ok(unsafe { aclrtStreamQuery(s, &mut status) }, "aclrtStreamQuery");
    }
    assert_eq!(download(bufs[4], len), data, "complete means the copy is done");
    // SAFETY: a NULL status pointer is refused.
    assert_eq!(unsafe { aclrtStreamQuery(s, std::ptr::null_mut()) }, ACL_ERROR_INVALID_PARAM);
}

#[test]
fn the_null_stream_is_the_default_stream_and_streams_belong_to_a_device() {
    if role().is_none() {
        run_child("the_null_stream_is_the_default_stream_and_streams_belong_to_a_device", "default", &[], T);
        return;
    }
    set_device(1);
    let a = dev_alloc(4096);
    let b = dev_alloc(4096);
    upload(a, &pattern(3, 4096));
    // SAFETY: device memory of 4096 bytes; NULL = default stream.
    ok(
        unsafe { aclrtMemcpyAsync(b, 4096, a, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE, std::ptr::null_mut()) },
        "async on NULL",
    );
    // SAFETY: NULL = default stream.
    ok(unsafe { aclrtSynchronizeStream(std::ptr::null_mut()) }, "synchronize NULL");
    assert_eq!(download(b, 4096), pattern(3, 4096));

    let s = new_stream();
    let (sv, av, bv) = (s as usize, a as usize, b as usize);
    std::thread::spawn(move || {
        set_device(2);
        // SAFETY: device memory; the stream belongs to device 1, this thread is on device 2.
        let rc = unsafe { aclrtMemcpyAsync(bv as _, 4096, av as _, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE, sv as _) };
        assert_eq!(rc, ACL_ERROR_RT_STREAM_CONTEXT);
    })
    .join()
    .unwrap();
    // SAFETY: live stream.
    ok(unsafe { aclrtDestroyStream(s) }, "aclrtDestroyStream");
    // SAFETY: a destroyed handle must be refused, not dereferenced.
    unsafe {
        assert_eq!(aclrtSynchronizeStream(s), ACL_ERROR_INVALID_PARAM);
        let mut status = -1;
        assert_eq!(aclrtStreamQuery(s, &mut status), ACL_ERROR_INVALID_PARAM);
        assert_eq!(status, -1, "nothing written for a refused query");
        assert_eq!(aclrtDestroyStream(s), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtDestroyStream(std::ptr::null_mut()), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtCreateStream(std::ptr::null_mut()), ACL_ERROR_INVALID_PARAM);
    }
}
