//! Bad input through the C API: every case returns a status code and a last error naming the
//! problem; none panics, none touches memory it should not.

mod common;

use std::ffi::{CStr, CString, c_char, c_void};
use std::ptr::{null, null_mut};

use common::*;
use ferry_abi::*;
use ferry_c::*;

/// A string that is not UTF-8 (0xFF never occurs in UTF-8).
const NOT_UTF8: &CStr = c"bad\xffname";

#[test]
fn version_is_the_package_version() {
    // SAFETY: ferry_version returns a static NUL-terminated string.
    let v = unsafe { CStr::from_ptr(ferry_version()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    assert_eq!(v.to_str().unwrap(), "0.1.0");
}

#[test]
fn last_error_starts_empty_keeps_the_last_failure_and_copies_safely() {
    // A fresh thread has no error.
    std::thread::spawn(|| {
        assert_eq!(last_error(), "");
        // SAFETY: NULL with capacity 0 is allowed.
        assert_eq!(unsafe { ferry_last_error_copy(null_mut(), 0) }, 0);

        fails(ferry_engine_destroy(0), FERRY_E_NOT_FOUND, &["not_found: engine handle 0 is 0"]);
        let full = last_error();
        // A successful call leaves it unchanged.
        // SAFETY: a static string.
        assert!(!unsafe { CStr::from_ptr(ferry_version()) }.is_empty());
        assert_eq!(last_error(), full);

        // Copy: the full length is returned, the copy is truncated and NUL-terminated.
        // SAFETY: NULL with capacity 0 is allowed.
        assert_eq!(unsafe { ferry_last_error_copy(null_mut(), 0) }, full.len());
        let mut small = [0x55 as c_char; 10];
        // SAFETY: `small` has room for 10 bytes.
        assert_eq!(unsafe { ferry_last_error_copy(small.as_mut_ptr(), small.len()) }, full.len());
        // SAFETY: the copy is NUL-terminated within the buffer.
        let copied = unsafe { CStr::from_ptr(small.as_ptr()) }.to_str().unwrap();
        assert_eq!(copied, &full[..9]);
        let mut big = [0 as c_char; 256];
        // SAFETY: `big` has room for 256 bytes.
        assert_eq!(unsafe { ferry_last_error_copy(big.as_mut_ptr(), big.len()) }, full.len());
        // SAFETY: NUL-terminated.
        assert_eq!(unsafe { CStr::from_ptr(big.as_ptr()) }.to_str().unwrap(), full);

        ferry_clear_last_error();
        assert_eq!(last_error(), "");
    })
    .join()
    .unwrap();
}

#[test]
fn last_error_is_per_thread() {
    fails(ferry_batch_free(0), FERRY_E_NOT_FOUND, &["batch handle 0"]);
    let other = std::thread::spawn(last_error).join().unwrap();
    assert_eq!(other, "", "another thread's failure is not this thread's error");
    assert!(last_error().contains("batch handle 0"));
}

#[test]
fn bad_configs_name_the_problem() {
    let mut e = 0;
    // SAFETY: valid C strings; a valid out-pointer.
    let rc = unsafe { ferry_engine_create(c"{\"protocol\": \"tcp\",".as_ptr(), &mut e) };
    fails(rc, FERRY_E_CONFIG, &["config: config inline config: is not valid JSON at line 1"]);
    assert_eq!(e, 0, "nothing is stored on failure");

    // SAFETY: as above.
    let rc = unsafe { ferry_engine_create(c"{\"transfer_timeout_ms\": \"soon\"}".as_ptr(), &mut e) };
    fails(rc, FERRY_E_CONFIG, &["field `transfer_timeout_ms` at line 1"]);

    // SAFETY: as above.
    let rc = unsafe { ferry_engine_create(c"{\"protocol\": \"rdma-of-dreams\"}".as_ptr(), &mut e) };
    fails(rc, FERRY_E_CONFIG, &["protocol", "rdma-of-dreams"]);

    // SAFETY: as above.
    let rc = unsafe { ferry_engine_create(c"{\"metadata_server\": \"gopher://x\"}".as_ptr(), &mut e) };
    fails(rc, FERRY_E_CONFIG, &["metadata_server", "gopher"]);

    // SAFETY: as above.
    let rc = unsafe { ferry_engine_create(c"[1, 2]".as_ptr(), &mut e) };
    fails(rc, FERRY_E_CONFIG, &["inline config"]);

    // SAFETY: a non-UTF-8 but NUL-terminated string.
    let rc = unsafe { ferry_engine_create(NOT_UTF8.as_ptr(), &mut e) };
    fails(rc, FERRY_E_INVALID_ARGUMENT, &["`config_json` is not valid UTF-8 (invalid byte at offset 3)"]);

    // SAFETY: a valid string; a null out-pointer is what is being tested.
    let rc = unsafe { ferry_engine_create(null(), null_mut()) };
    fails(rc, FERRY_E_INVALID_ARGUMENT, &["invalid_argument: `out` is null"]);
    assert_eq!(e, 0);
}

#[test]
fn empty_and_null_configs_give_the_embedded_default() {
    for config in [None, Some(""), Some("  ")] {
        let e = engine(config);
        assert!(name(e).starts_with("ferry-"), "embedded engines are named ferry-<pid>-<n>: {}", name(e));
        destroy(e);
    }
}

#[test]
fn config_files_are_read_and_their_errors_name_the_file() {
    let dir = std::env::temp_dir().join(format!("ferry-capi-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("mooncake.json");
    std::fs::write(&good, r#"{"protocol": "local", "transfer_timeout_ms": 1234}"#).unwrap();
    let bad = dir.join("broken.json");
    std::fs::write(&bad, "{\n  \"tcp_lanes\": -1\n}").unwrap();

    let mut e = 0;
    let path = CString::new(good.to_str().unwrap()).unwrap();
    // SAFETY: valid C strings and out-pointers throughout.
    ok(unsafe { ferry_engine_create_from_file(path.as_ptr(), &mut e) });
    destroy(e);

    let path = CString::new(bad.to_str().unwrap()).unwrap();
    // SAFETY: as above.
    let rc = unsafe { ferry_engine_create_from_file(path.as_ptr(), &mut e) };
    fails(rc, FERRY_E_CONFIG, &["broken.json", "field `tcp_lanes` at line 2"]);

    let missing = CString::new(dir.join("absent.json").to_str().unwrap()).unwrap();
    // SAFETY: as above.
    let rc = unsafe { ferry_engine_create_from_file(missing.as_ptr(), &mut e) };
    fails(rc, FERRY_E_CONFIG, &["absent.json: cannot be read"]);

    // SAFETY: as above (null and non-UTF-8 paths are what is tested).
    unsafe {
        fails(ferry_engine_create_from_file(null(), &mut e), FERRY_E_INVALID_ARGUMENT, &["`path` is null"]);
        fails(ferry_engine_create_from_file(NOT_UTF8.as_ptr(), &mut e), FERRY_E_INVALID_ARGUMENT, &["`path`"]);
        fails(ferry_engine_create_from_file(c"".as_ptr(), &mut e), FERRY_E_INVALID_ARGUMENT, &["`path` is empty"]);
        fails(ferry_engine_create_from_file(path.as_ptr(), null_mut()), FERRY_E_INVALID_ARGUMENT, &["`out` is null"]);
        fails(ferry_engine_create_from_env(null_mut()), FERRY_E_INVALID_ARGUMENT, &["`out` is null"]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_foreign_and_destroyed_engine_handles_are_not_found() {
    fails(ferry_engine_destroy(0), FERRY_E_NOT_FOUND, &["engine handle 0 is 0, which is never a valid handle"]);
    fails(ferry_engine_destroy(12345), FERRY_E_NOT_FOUND, &["engine handle 12345 was never issued by Ferry"]);
    fails(ferry_unregister_memory(u64::MAX, 1), FERRY_E_NOT_FOUND, &["never issued"]);

    let e = engine(None);
    let buf = Buffer::pattern(256, 1);
    register(e, &buf);
    let seg = open(e, &name(e));
    let b = submit(e, &[req(FERRY_OPCODE_READ, seg, buf.addr(), buf.addr() + 128, 64)]);
    fails(ferry_engine_destroy(b), FERRY_E_NOT_FOUND, &[&format!("engine handle {b} is a batch handle")]);
    fails(ferry_batch_free(e), FERRY_E_NOT_FOUND, &[&format!("batch handle {e} is an engine handle")]);
    ok(ferry_batch_free(b));

    destroy(e);
    let gone = format!("engine handle {e} was destroyed");
    fails(ferry_engine_destroy(e), FERRY_E_NOT_FOUND, &[&gone]);
    let mut out = 0u64;
    let mut len = 0usize;
    let mut port = 0u16;
    let mut count = 0usize;
    let r = req(FERRY_OPCODE_READ, seg, buf.addr(), buf.addr(), 8);
    // SAFETY: valid pointers throughout; the engine handle is what is being tested.
    unsafe {
        fails(ferry_engine_segment_name(e, null_mut(), 0, &mut len), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_engine_rpc_port(e, &mut port), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_register_memory(e, buf.addr(), 8, null()), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_unregister_memory(e, buf.addr()), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_open_segment(e, c"x".as_ptr(), &mut out), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_close_segment(e, seg), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_submit(e, &r, 1, &mut out), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_transfer_sync(e, &r, 1, 0), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_notify(e, c"x:1".as_ptr(), c"m".as_ptr()), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_drain_notifications(e, Some(ignore), null_mut(), &mut count), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_kv_layout_register(e, &buf.addr(), 1, 1, 8, &mut out), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_kv_layout_unregister(e, 1), FERRY_E_NOT_FOUND, &[&gone]);
    }
    // A new engine never answers to the old handle.
    let e2 = engine(None);
    assert_ne!(e2, e);
    fails(ferry_engine_destroy(e), FERRY_E_NOT_FOUND, &[&gone]);
    destroy(e2);
}

unsafe extern "C" fn ignore(_: *mut c_void, _: *const c_char, _: *const c_char) {}

#[test]
fn segment_name_checks_its_buffer() {
    let e = engine(None);
    let full = name(e);
    let mut len = 0usize;
    // SAFETY: valid pointers, or NULL where NULL is what is being tested.
    unsafe {
        fails(ferry_engine_segment_name(e, null_mut(), 0, null_mut()), FERRY_E_INVALID_ARGUMENT, &["`len` is null"]);
        fails(ferry_engine_segment_name(e, null_mut(), 8, &mut len), FERRY_E_INVALID_ARGUMENT, &["`buf` is null"]);
        // Size query: fails, but reports the length.
        fails(ferry_engine_segment_name(e, null_mut(), 0, &mut len), FERRY_E_INVALID_ARGUMENT, &["too small"]);
        assert_eq!(len, full.len());
        let mut small = [0x55 as c_char; 6];
        len = 0;
        fails(
            ferry_engine_segment_name(e, small.as_mut_ptr(), small.len(), &mut len),
            FERRY_E_INVALID_ARGUMENT,
            &["`cap` is 6, too small"],
        );
        assert_eq!(len, full.len());
        assert_eq!(CStr::from_ptr(small.as_ptr()).to_str().unwrap(), &full[..5], "truncated and terminated");
        // Exactly enough room.
        let mut exact = vec![0 as c_char; full.len() + 1];
        ok(ferry_engine_segment_name(e, exact.as_mut_ptr(), exact.len(), &mut len));
        assert_eq!(CStr::from_ptr(exact.as_ptr()).to_str().unwrap(), full);
    }
    let mut port = 0u16;
    // SAFETY: valid pointers, or NULL where NULL is what is being tested.
    unsafe {
        fails(ferry_engine_rpc_port(e, &mut port), FERRY_E_NOT_FOUND, &["publishes no RPC entry", &full]);
        fails(ferry_engine_rpc_port(e, null_mut()), FERRY_E_INVALID_ARGUMENT, &["`out` is null"]);
    }
    destroy(e);
}

#[test]
fn misaligned_out_pointers_are_refused() {
    let e = engine(None);
    let mut raw = [0u64; 3];
    let misaligned = (raw.as_mut_ptr() as *mut u8).wrapping_add(1) as *mut u64;
    // SAFETY: the pointer is inside `raw` but misaligned, which the call must refuse before
    // writing.
    let rc = unsafe { ferry_open_segment(e, c"x".as_ptr(), misaligned) };
    fails(rc, FERRY_E_INVALID_ARGUMENT, &["`out_segment`", "not aligned"]);
    assert_eq!(raw, [0; 3]);
    destroy(e);
}

#[test]
fn registration_checks_its_arguments() {
    let e = engine(None);
    let buf = Buffer::zeroed(4096);
    // SAFETY: the buffer outlives the engine; bad arguments are what is being tested.
    unsafe {
        fails(ferry_register_memory(e, 0, 64, null()), FERRY_E_INVALID_ARGUMENT, &["`addr` is 0"]);
        fails(ferry_register_memory(e, buf.addr(), 0, null()), FERRY_E_INVALID_ARGUMENT, &["`length` is 0"]);
        fails(
            ferry_register_memory(e, buf.addr(), 64, c"gpu:x".as_ptr()),
            FERRY_E_INVALID_ARGUMENT,
            &["location tag \"gpu:x\""],
        );
        fails(
            ferry_register_memory(e, buf.addr(), 64, NOT_UTF8.as_ptr()),
            FERRY_E_INVALID_ARGUMENT,
            &["`location` is not valid UTF-8"],
        );
        fails(ferry_register_memory(e, u64::MAX - 8, 64, null()), FERRY_E_OUT_OF_BOUNDS, &["overflows"]);
        ok(ferry_register_memory(e, buf.addr(), buf.len(), null()));
        fails(ferry_register_memory(e, buf.addr() + 64, 64, null()), FERRY_E_ALREADY_EXISTS, &["overlaps"]);
    }
    fails(ferry_unregister_memory(e, buf.addr() + 1), FERRY_E_NOT_FOUND, &[]);
    ok(ferry_unregister_memory(e, buf.addr()));
    fails(ferry_unregister_memory(e, buf.addr()), FERRY_E_NOT_FOUND, &[]);
    destroy(e);
}

#[test]
fn unknown_segments_are_reported_by_name() {
    let e = engine(None);
    let mut seg = 0u64;
    // SAFETY: valid pointers, or NULL / bad strings where those are what is being tested.
    unsafe {
        fails(
            ferry_open_segment(e, c"no-such-segment".as_ptr(), &mut seg),
            FERRY_E_NOT_FOUND,
            &["segment `no-such-segment` is not published"],
        );
        fails(ferry_open_segment(e, null(), &mut seg), FERRY_E_INVALID_ARGUMENT, &["`name` is null"]);
        fails(ferry_open_segment(e, c"".as_ptr(), &mut seg), FERRY_E_INVALID_ARGUMENT, &["`name` is empty"]);
        fails(ferry_open_segment(e, NOT_UTF8.as_ptr(), &mut seg), FERRY_E_INVALID_ARGUMENT, &["`name` is not valid"]);
        fails(ferry_open_segment(e, c"x".as_ptr(), null_mut()), FERRY_E_INVALID_ARGUMENT, &["`out_segment` is null"]);
    }
    assert_eq!(seg, 0);
    fails(ferry_close_segment(e, 99), FERRY_E_NOT_FOUND, &["segment handle 99 is not open"]);
    destroy(e);

    // Over the P2P handshake, a name nobody listens on is unreachable.
    let p = p2p_engine(2000);
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dead = CString::new(format!("127.0.0.1:{closed}")).unwrap();
    // SAFETY: valid pointers.
    let rc = unsafe { ferry_open_segment(p, dead.as_ptr(), &mut seg) };
    fails(rc, FERRY_E_PEER_UNREACHABLE, &["peer_unreachable: ", &format!("127.0.0.1:{closed}")]);
    destroy(p);
}

#[test]
fn submit_refuses_bad_requests_and_starts_none() {
    let e = engine(None);
    let src = Buffer::pattern(1024, 9);
    let dst = Buffer::zeroed(1024);
    register(e, &src);
    register(e, &dst);
    let seg = open(e, &name(e));
    let good = req(FERRY_OPCODE_READ, seg, dst.addr(), src.addr(), 512);
    let mut b: FerryBatch = 0;
    let cases: Vec<(FerryTransferRequest, i32, &str)> = vec![
        (FerryTransferRequest { opcode: 7, ..good }, FERRY_E_INVALID_ARGUMENT, "request 1: opcode is 7"),
        (FerryTransferRequest { flags: 1, ..good }, FERRY_E_INVALID_ARGUMENT, "request 1: flags is 1"),
        (FerryTransferRequest { length: 0, ..good }, FERRY_E_INVALID_ARGUMENT, "request 1: zero-length"),
        (FerryTransferRequest { target: 4242, ..good }, FERRY_E_NOT_FOUND, "segment handle 4242"),
        (FerryTransferRequest { local_addr: dst.addr() + 1000, ..good }, FERRY_E_OUT_OF_BOUNDS, "request 1:"),
        (FerryTransferRequest { remote_addr: src.addr() + 1000, ..good }, FERRY_E_OUT_OF_BOUNDS, "request 1:"),
        (FerryTransferRequest { local_addr: 0x10, ..good }, FERRY_E_OUT_OF_BOUNDS, "request 1:"),
    ];
    for (bad, code, needle) in cases {
        let reqs = [good, bad];
        // SAFETY: `reqs` holds 2 requests; `b` is a valid out-pointer.
        fails(unsafe { ferry_submit(e, reqs.as_ptr(), 2, &mut b) }, code, &[needle]);
        // SAFETY: as above.
        fails(unsafe { ferry_transfer_sync(e, reqs.as_ptr(), 2, 0) }, code, &[needle]);
    }
    assert_eq!(b, 0, "no batch was created");
    assert!(dst.bytes().iter().all(|&x| x == 0), "nothing moved: a bad request stops the whole batch");

    // SAFETY: NULL / zero counts / null out-pointers are what is being tested.
    unsafe {
        fails(ferry_submit(e, null(), 2, &mut b), FERRY_E_INVALID_ARGUMENT, &["`requests` is null but its count is 2"]);
        fails(ferry_submit(e, &good, 0, &mut b), FERRY_E_INVALID_ARGUMENT, &["`count` is 0"]);
        fails(ferry_submit(e, &good, 1, null_mut()), FERRY_E_INVALID_ARGUMENT, &["`out` is null"]);
        fails(ferry_transfer_sync(e, null(), 1, 0), FERRY_E_INVALID_ARGUMENT, &["`requests` is null"]);
        fails(ferry_transfer_sync(e, &good, 0, 0), FERRY_E_INVALID_ARGUMENT, &["`count` is 0"]);
        fails(ferry_submit(e, &good, usize::MAX, &mut b), FERRY_E_INVALID_ARGUMENT, &["exceeds the address space"]);
    }
    destroy(e);
}

#[test]
fn batch_calls_check_counts_pointers_and_handles() {
    let e = engine(None);
    let src = Buffer::pattern(1024, 2);
    let dst = Buffer::zeroed(1024);
    register(e, &src);
    register(e, &dst);
    let seg = open(e, &name(e));
    let b = submit(
        e,
        &[
            req(FERRY_OPCODE_READ, seg, dst.addr(), src.addr(), 256),
            req(FERRY_OPCODE_WRITE, seg, src.addr(), dst.addr() + 512, 256),
        ],
    );
    ok(ferry_batch_wait(b, WAIT_MS));
    let mut statuses = [FerryTransferStatus::default(); 3];
    let mut pending = 99usize;
    let mut n = 0usize;
    // SAFETY: every pointer is valid for the count passed, or NULL where that is tested.
    unsafe {
        fails(
            ferry_batch_poll(b, statuses.as_mut_ptr(), 3, &mut pending),
            FERRY_E_INVALID_ARGUMENT,
            &["`count` is 3 but batch", "has 2 request(s)"],
        );
        fails(
            ferry_batch_poll(b, statuses.as_mut_ptr(), 1, &mut pending),
            FERRY_E_INVALID_ARGUMENT,
            &["has 2 request(s)"],
        );
        fails(
            ferry_batch_poll(b, null_mut(), 2, &mut pending),
            FERRY_E_INVALID_ARGUMENT,
            &["`statuses` is null but its count is 2"],
        );
        fails(
            ferry_batch_poll(b, statuses.as_mut_ptr(), 2, null_mut()),
            FERRY_E_INVALID_ARGUMENT,
            &["`pending` is null"],
        );
        assert_eq!(pending, 99, "nothing written on failure");
        assert_eq!(statuses[0], FerryTransferStatus::default());
        ok(ferry_batch_poll(b, null_mut(), 0, &mut pending));
        assert_eq!(pending, 0);
        fails(ferry_batch_len(b, null_mut()), FERRY_E_INVALID_ARGUMENT, &["`out` is null"]);
        ok(ferry_batch_len(b, &mut n));
        assert_eq!(n, 2);
        fails(
            ferry_batch_failed_blocks(b, null_mut(), 0, &mut n),
            FERRY_E_INVALID_ARGUMENT,
            &["was made by ferry_submit, not ferry_kv_submit_blocks"],
        );
    }
    ok(ferry_batch_free(b));
    let gone = format!("batch handle {b} was freed");
    fails(ferry_batch_free(b), FERRY_E_NOT_FOUND, &[&gone]);
    fails(ferry_batch_wait(b, 1), FERRY_E_NOT_FOUND, &[&gone]);
    fails(ferry_batch_cancel(b), FERRY_E_NOT_FOUND, &[&gone]);
    // SAFETY: valid pointers; the batch handle is what is being tested.
    unsafe {
        fails(ferry_batch_poll(b, null_mut(), 0, &mut pending), FERRY_E_NOT_FOUND, &[&gone]);
        fails(ferry_batch_len(b, &mut n), FERRY_E_NOT_FOUND, &[&gone]);
    }
    fails(ferry_batch_wait(0, 1), FERRY_E_NOT_FOUND, &["batch handle 0 is 0"]);
    destroy(e);
}

#[test]
fn kv_calls_check_layouts_and_blocks() {
    let e = engine(None);
    let local = Buffer::zeroed(8 * 64);
    let remote = Buffer::pattern(8 * 64, 4);
    register(e, &local);
    register(e, &remote);
    let seg = open(e, &name(e));
    let mut layout = 0u64;
    let unregistered = Buffer::zeroed(64);
    // SAFETY: every pointer is valid for the count passed, or NULL where that is tested.
    unsafe {
        fails(
            ferry_kv_layout_register(e, null(), 1, 8, 64, &mut layout),
            FERRY_E_INVALID_ARGUMENT,
            &["`bases` is null"],
        );
        fails(
            ferry_kv_layout_register(e, &local.addr(), 0, 8, 64, &mut layout),
            FERRY_E_INVALID_ARGUMENT,
            &["`base_count` is 0"],
        );
        fails(
            ferry_kv_layout_register(e, &local.addr(), 1, 0, 64, &mut layout),
            FERRY_E_INVALID_ARGUMENT,
            &["zero blocks"],
        );
        fails(
            ferry_kv_layout_register(e, &local.addr(), 1, 8, 0, &mut layout),
            FERRY_E_INVALID_ARGUMENT,
            &["zero block length"],
        );
        fails(
            ferry_kv_layout_register(e, &local.addr(), 1, 8, 64, null_mut()),
            FERRY_E_INVALID_ARGUMENT,
            &["`out_layout` is null"],
        );
        fails(
            ferry_kv_layout_register(e, &local.addr(), 1, 9, 64, &mut layout),
            FERRY_E_OUT_OF_BOUNDS,
            &["KV layout region 0", "is not registered memory"],
        );
        fails(ferry_kv_layout_register(e, &unregistered.addr(), 1, 1, 64, &mut layout), FERRY_E_OUT_OF_BOUNDS, &[]);
        ok(ferry_kv_layout_register(e, &local.addr(), 1, 8, 64, &mut layout));
    }
    let rb = [remote.addr()];
    let two = [remote.addr(), remote.addr() + 256];
    let ids = [0u32, 1];
    let far = [0u32, 8];
    let mut b: FerryBatch = 0;
    let submit_blocks = |layout: u64,
                         seg: u64,
                         bases: &[u64],
                         opcode: u32,
                         l: *const u32,
                         r: *const u32,
                         n: usize,
                         out: *mut FerryBatch| {
        // SAFETY: the pointers passed are valid for `n` ids (or NULL where that is tested).
        unsafe { ferry_kv_submit_blocks(e, layout, seg, bases.as_ptr(), bases.len(), 8, 64, opcode, l, r, n, out) }
    };
    fails(
        submit_blocks(layout, seg, &rb, 0, ids.as_ptr(), far.as_ptr(), 2, &mut b),
        FERRY_E_OUT_OF_BOUNDS,
        &["remote block id 8 (position 1)"],
    );
    fails(
        submit_blocks(layout, seg, &rb, 0, far.as_ptr(), ids.as_ptr(), 2, &mut b),
        FERRY_E_OUT_OF_BOUNDS,
        &["local block id 8"],
    );
    fails(
        submit_blocks(layout, seg, &two, 0, ids.as_ptr(), ids.as_ptr(), 2, &mut b),
        FERRY_E_INVALID_ARGUMENT,
        &["local layout has 1 regions, remote has 2"],
    );
    fails(
        submit_blocks(layout, seg, &rb, 0, ids.as_ptr(), ids.as_ptr(), 0, &mut b),
        FERRY_E_INVALID_ARGUMENT,
        &["`block_count` is 0"],
    );
    fails(
        submit_blocks(layout, seg, &rb, 0, null(), ids.as_ptr(), 2, &mut b),
        FERRY_E_INVALID_ARGUMENT,
        &["`local_blocks` is null"],
    );
    fails(
        submit_blocks(layout, seg, &rb, 0, ids.as_ptr(), null(), 2, &mut b),
        FERRY_E_INVALID_ARGUMENT,
        &["`remote_blocks` is null"],
    );
    fails(
        submit_blocks(layout, seg, &rb, 5, ids.as_ptr(), ids.as_ptr(), 2, &mut b),
        FERRY_E_INVALID_ARGUMENT,
        &["`opcode` is 5"],
    );
    fails(
        submit_blocks(layout, seg, &[], 0, ids.as_ptr(), ids.as_ptr(), 2, &mut b),
        FERRY_E_INVALID_ARGUMENT,
        &["`remote_base_count` is 0"],
    );
    fails(
        submit_blocks(layout, seg, &rb, 0, ids.as_ptr(), ids.as_ptr(), 2, null_mut()),
        FERRY_E_INVALID_ARGUMENT,
        &["`out` is null"],
    );
    fails(
        submit_blocks(layout + 100, seg, &rb, 0, ids.as_ptr(), ids.as_ptr(), 2, &mut b),
        FERRY_E_NOT_FOUND,
        &["KV layout"],
    );
    fails(
        submit_blocks(layout, seg + 100, &rb, 0, ids.as_ptr(), ids.as_ptr(), 2, &mut b),
        FERRY_E_NOT_FOUND,
        &["segment handle"],
    );
    let dup = [3u32, 3];
    fails(
        submit_blocks(layout, seg, &rb, 0, dup.as_ptr(), ids.as_ptr(), 2, &mut b),
        FERRY_E_INVALID_ARGUMENT,
        &["local block id 3 is a destination more than once"],
    );
    assert_eq!(b, 0);
    assert!(local.bytes().iter().all(|&x| x == 0), "nothing moved");

    ok(ferry_kv_layout_unregister(e, layout));
    fails(ferry_kv_layout_unregister(e, layout), FERRY_E_NOT_FOUND, &["is not registered"]);
    destroy(e);
}

#[test]
fn notifications_need_a_control_channel_and_valid_arguments() {
    let e = engine(None);
    let mut count = 7usize;
    // SAFETY: valid pointers, or NULL / bad strings where those are tested.
    unsafe {
        fails(
            ferry_notify(e, c"127.0.0.1:1".as_ptr(), c"hello".as_ptr()),
            FERRY_E_UNSUPPORTED,
            &["unsupported: the embedded metadata backend has no control channel"],
        );
        fails(ferry_notify(e, null(), c"m".as_ptr()), FERRY_E_INVALID_ARGUMENT, &["`segment_name` is null"]);
        fails(ferry_notify(e, c"x".as_ptr(), null()), FERRY_E_INVALID_ARGUMENT, &["`message` is null"]);
        fails(ferry_notify(e, c"".as_ptr(), c"m".as_ptr()), FERRY_E_INVALID_ARGUMENT, &["`segment_name` is empty"]);
        fails(
            ferry_probe(e, c"127.0.0.1:1".as_ptr()),
            FERRY_E_UNSUPPORTED,
            &["the embedded metadata backend has no control channel to probe"],
        );
        fails(ferry_probe(e, null()), FERRY_E_INVALID_ARGUMENT, &["`segment_name` is null"]);
        fails(ferry_probe(e, c"".as_ptr()), FERRY_E_INVALID_ARGUMENT, &["`segment_name` is empty"]);
        fails(
            ferry_notify_as(e, c"x".as_ptr(), NOT_UTF8.as_ptr(), c"m".as_ptr()),
            FERRY_E_INVALID_ARGUMENT,
            &["`sender_name` is not valid UTF-8"],
        );
        fails(
            ferry_notify(e, c"x".as_ptr(), NOT_UTF8.as_ptr()),
            FERRY_E_INVALID_ARGUMENT,
            &["`message` is not valid UTF-8"],
        );
        fails(
            ferry_drain_notifications(e, None, null_mut(), &mut count),
            FERRY_E_INVALID_ARGUMENT,
            &["`callback` is null"],
        );
        fails(
            ferry_drain_notifications(e, Some(ignore), null_mut(), null_mut()),
            FERRY_E_INVALID_ARGUMENT,
            &["`count` is null"],
        );
        assert_eq!(count, 7);
        ok(ferry_drain_notifications(e, Some(ignore), null_mut(), &mut count));
        assert_eq!(count, 0);
    }
    destroy(e);
}

#[test]
fn remote_ranges_are_checked_against_the_peers_published_buffers() {
    let silent = SilentPeer::start();
    let e = p2p_engine(3000);
    let local = Buffer::zeroed(64);
    register(e, &local);
    let peer = open(e, &silent.name);
    let end = silent.buffer_addr + silent.buffer_len;
    let mut b: FerryBatch = 0;
    for (remote, len) in [(end - 8, 16), (silent.buffer_addr - 1, 8), (end, 1)] {
        let r = [req(FERRY_OPCODE_READ, peer, local.addr(), remote, len)];
        // SAFETY: `r` holds 1 request; valid out-pointer.
        let rc = unsafe { ferry_submit(e, r.as_ptr(), 1, &mut b) };
        fails(rc, FERRY_E_OUT_OF_BOUNDS, &["request 0: remote range", &silent.name, "nothing was submitted"]);
    }
    assert_eq!(b, 0);
    let mut pending = 0usize;
    // SAFETY: valid pointers; the batch handle is what is tested.
    fails(unsafe { ferry_batch_released(b, &mut pending as *mut usize as *mut i32) }, FERRY_E_NOT_FOUND, &[]);
    // SAFETY: a null out-pointer is what is tested.
    fails(unsafe { ferry_batch_released(1, null_mut()) }, FERRY_E_INVALID_ARGUMENT, &["`released` is null"]);
    destroy(e);
}

#[test]
fn destroy_inside_a_tokio_runtime_is_refused_and_the_engine_survives() {
    let e = engine(None);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let rc = rt.block_on(async { ferry_engine_destroy(e) });
    fails(rc, FERRY_E_INVALID_ARGUMENT, &["inside a tokio runtime", "still alive"]);
    // The handle still works, and a destroy from a plain thread succeeds.
    assert!(!name(e).is_empty());
    ok(ferry_engine_destroy(e));
    fails(ferry_engine_destroy(e), FERRY_E_NOT_FOUND, &["engine handle"]);
}
