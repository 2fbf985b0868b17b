//! The rules of real CANN the emulator enforces, one test each. Every
//! rule cites its public source in `docs/ascend.md` ("What the emulated CANN enforces").
//!
//! Two-rank cases run both ranks in one child process, on two threads bound to two emulated
//! cards (the emulator serves several devices per process), so a test needs no coordination
//! over pipes; the environment a rule depends on is set on that child only.
#![cfg(feature = "onesided")]

mod common;

use std::ffi::{CString, c_void};
use std::time::{Duration, Instant};

use common::*;
use ferry_cann_emu::*;

const T: Duration = Duration::from_secs(60);
const LEN: usize = 4 << 20;

/// A two-rank table: rank 0 is physical device 2 on `server0`, rank 1 device 5 on `server1`
/// (`server1 == server0`: one server). `extra` is spliced into each device entry (A3 fields).
fn table(ports: (u16, u16), servers: (&str, &str), version: &str, extra: (&str, &str), pods: &str) -> String {
    let dev = |id: u32, port: u16, rank: u32, extra: &str| {
        format!(r#"{{"device_id":"{id}","device_ip":"127.0.0.1","device_port":"{port}","rank_id":"{rank}"{extra}}}"#)
    };
    let d0 = dev(2, ports.0, 0, extra.0);
    let d1 = dev(5, ports.1, 1, extra.1);
    let list = if servers.0 == servers.1 {
        format!(r#"[{{"server_id":"{}","host_ip":"127.0.0.1","device":[{d0},{d1}]}}]"#, servers.0)
    } else {
        format!(
            r#"[{{"server_id":"{}","host_ip":"127.0.0.1","device":[{d0}]}},{{"server_id":"{}","host_ip":"127.0.0.2","device":[{d1}]}}]"#,
            servers.0, servers.1
        )
    };
    let count = if servers.0 == servers.1 { 1 } else { 2 };
    format!(r#"{{"status":"completed","version":"{version}","server_count":"{count}","server_list":{list}{pods}}}"#)
}

fn two_servers() -> String {
    table(free_ports(), ("s0", "s1"), "1.0", ("", ""), "")
}

fn one_server() -> String {
    table(free_ports(), ("s0", "s0"), "1.0", ("", ""), "")
}

/// One rank's communicator and the memory it bound.
struct Rank {
    comm: HcclComm,
    handles: Vec<*mut c_void>,
    stream: AclrtStream,
}

// SAFETY: the handles are opaque numbers; the emulator checks each use.
unsafe impl Send for Rank {}

fn register(kind: i32, addr: *mut c_void, len: usize) -> *mut c_void {
    let mut h = std::ptr::null_mut();
    let m = CommMem { mem_type: kind, addr, size: len as u64 };
    // SAFETY: valid pointers; the range is only recorded.
    ok(unsafe { HcclRegisterGlobalMem(&m, &mut h) }, "HcclRegisterGlobalMem");
    h
}

/// What every caller of HCCL must do (rule 1): one process-wide lock around communicator init
/// and destroy.
static LIFECYCLE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn lifecycle() -> std::sync::MutexGuard<'static, ()> {
    LIFECYCLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets `device`, creates rank `rank`'s communicator and binds `mems` (type, address, length).
fn rank(device: i32, rank: u32, table: &str, mems: &[(i32, *mut c_void, usize)]) -> Rank {
    set_device(device);
    let t = CString::new(table).unwrap();
    let mut comm: HcclComm = std::ptr::null_mut();
    let serial = lifecycle();
    // SAFETY: valid pointers.
    ok(unsafe { HcclCommInitClusterInfoMemConfig(t.as_ptr(), rank, std::ptr::null_mut(), &mut comm) }, "init");
    drop(serial);
    let handles: Vec<_> = mems.iter().map(|&(k, a, l)| register(k, a, l)).collect();
    for &h in &handles {
        // SAFETY: live handles.
        ok(unsafe { HcclCommBindMem(comm, h) }, "HcclCommBindMem");
    }
    Rank { comm, handles, stream: new_stream() }
}

fn prepare(r: &Rank, timeout_s: i32) -> i32 {
    // SAFETY: live communicator, valid config.
    unsafe { HcclCommPrepare(r.comm, &HcclPrepareConfig::default(), timeout_s) }
}

/// Unbinds everything, destroys, deregisters.
fn teardown(r: Rank) {
    // SAFETY: live handles.
    unsafe {
        for &h in &r.handles {
            ok(HcclCommUnbindMem(r.comm, h), "HcclCommUnbindMem");
        }
        let serial = lifecycle();
        ok(HcclCommDestroy(r.comm), "HcclCommDestroy");
        drop(serial);
        for &h in &r.handles {
            let _ = HcclDeregisterGlobalMem(h);
        }
    }
}

fn get(r: &Rank, peer: u32, local: *mut c_void, remote: *mut c_void, len: u64) -> i32 {
    let mut d = [HcclOneSideOpDesc { local_addr: local, remote_addr: remote, count: len, data_type: 7 }];
    // SAFETY: the emulator checks every range against bound memory.
    unsafe { HcclBatchGet(r.comm, peer, d.as_mut_ptr(), 1, r.stream) }
}

fn sync(r: &Rank) -> i32 {
    // SAFETY: live stream.
    unsafe { aclrtSynchronizeStreamWithTimeout(r.stream, 20_000) }
}

fn dev_alloc_policy(len: usize, policy: i32) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    ok(unsafe { aclrtMalloc(&mut p, len, policy) }, "aclrtMalloc");
    p
}

fn host_alloc(len: usize) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    ok(unsafe { aclrtMallocHost(&mut p, len) }, "aclrtMallocHost");
    p
}

/// Runs rank 0 on this thread and rank 1 on another; returns both results.
fn both<A: Send + 'static, B: Send + 'static>(
    r0: impl FnOnce() -> A + Send + 'static,
    r1: impl FnOnce() -> B + Send + 'static,
) -> (A, B) {
    let t = std::thread::spawn(r1);
    let a = r0();
    (a, t.join().expect("rank 1 panicked"))
}

fn child(test: &str, envs: &[(&str, &str)]) -> bool {
    if role().is_some() {
        return true;
    }
    run_child(test, "child", envs, T);
    false
}

/// Rule 1: `HcclCommInitClusterInfoMemConfig` and `HcclCommDestroy` must not overlap in one
/// process: the second fails with `HCCL_E_INTERNAL` and says why.
#[test]
fn init_and_destroy_must_not_overlap() {
    const NAME: &str = "init_and_destroy_must_not_overlap";
    if !child(NAME, &[("FERRY_CANN_EMU_DELAY_US", "HcclCommInitClusterInfoMemConfig:1000000")]) {
        return;
    }
    let t = two_servers();
    let first = rank(2, 0, &t, &[]);
    let t2 = t.clone();
    let started = Instant::now();
    let (second, destroy) = both(
        move || rank(5, 1, &t2, &[]),
        move || {
            // Well inside the other thread's init (which takes a second), even on a busy machine.
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: a live communicator.
            let code = unsafe { HcclCommDestroy(first.comm) };
            (code, recent_error(), first)
        },
    );
    let (code, text, first) = destroy;
    assert!(started.elapsed() >= Duration::from_millis(1000));
    assert_eq!(code, HCCL_E_INTERNAL, "destroy during an init");
    assert!(text.contains("not thread-safe"), "{text}");
    // One after the other both succeed.
    teardown(first);
    teardown(second);
}

/// Rule 2: a communicator with memory bound is not destroyed; bound memory is not
/// deregistered; the same range registered twice is one handle, an overlapping one refused.
#[test]
fn bound_memory_holds_the_communicator_and_registrations_are_by_range() {
    const NAME: &str = "bound_memory_holds_the_communicator_and_registrations_are_by_range";
    if !child(NAME, &[]) {
        return;
    }
    set_device(2);
    let buf = dev_alloc(LEN);
    let h = register(HCCL_MEM_TYPE_DEVICE, buf, LEN);
    assert_eq!(register(HCCL_MEM_TYPE_DEVICE, buf, LEN), h, "the same range is the same handle");
    let m = CommMem { mem_type: HCCL_MEM_TYPE_DEVICE, addr: buf.wrapping_byte_add(4096), size: 8192 };
    let mut other = std::ptr::null_mut();
    // SAFETY: valid pointers.
    assert_eq!(unsafe { HcclRegisterGlobalMem(&m, &mut other) }, HCCL_E_PARA, "overlapping range");
    let r = rank(2, 0, &two_servers(), &[]);
    // SAFETY: live handles throughout.
    unsafe {
        ok(HcclCommBindMem(r.comm, h), "bind");
        assert_eq!(HcclDeregisterGlobalMem(h), HCCL_E_PARA, "still bound");
        assert_eq!(HcclCommDestroy(r.comm), HCCL_E_PARA, "memories still bound");
        assert!(recent_error().contains("still bound"));
        // Nothing was destroyed: the communicator still answers.
        let mut rank_id = 9;
        ok(HcclGetRankId(r.comm, &mut rank_id), "the communicator is alive");
        ok(HcclCommUnbindMem(r.comm, h), "unbind");
        ok(HcclCommDestroy(r.comm), "destroy once nothing is bound");
        ok(HcclDeregisterGlobalMem(h), "deregister");
    }
    // One registry per device: the same host range on two devices is two registrations, and a
    // handle is unknown to the other device's registry and communicators.
    let host = host_alloc(8192);
    set_device(2);
    let on2 = register(HCCL_MEM_TYPE_HOST, host, 8192);
    let r5 = rank(5, 1, &two_servers(), &[]);
    let on5 = register(HCCL_MEM_TYPE_HOST, host, 8192);
    assert_ne!(on2, on5, "a registration per device");
    // SAFETY: live handles.
    unsafe {
        assert_eq!(HcclCommBindMem(r5.comm, on2), HCCL_E_PARA, "device 2's handle on device 5's communicator");
        assert!(recent_error().contains("invalid on device 5"));
        assert_eq!(HcclDeregisterGlobalMem(on2), HCCL_E_PARA, "deregistered where it is not known");
        ok(HcclDeregisterGlobalMem(on5), "deregister on its own device");
        set_device(2);
        ok(HcclDeregisterGlobalMem(on2), "deregister on its own device");
    }
    set_device(5);
    teardown(r5);
}

/// Rule 3: Prepare exchanges memory once. Memory bound after it is reachable neither by the
/// peer ("Can't find remoteBuffer by key") nor locally; a second Prepare changes nothing.
#[test]
fn memory_bound_after_prepare_is_not_reachable() {
    const NAME: &str = "memory_bound_after_prepare_is_not_reachable";
    if !child(NAME, &[]) {
        return;
    }
    let t = two_servers();
    let t1 = t.clone();
    let (r0, (r1, late, first1)) = both(
        move || {
            set_device(2);
            let buf = dev_alloc(LEN);
            let r = rank(2, 0, &t, &[(HCCL_MEM_TYPE_DEVICE, buf, LEN)]);
            assert_eq!(prepare(&r, 20), 0);
            (r, buf as usize)
        },
        move || {
            set_device(5);
            let buf = dev_alloc(LEN);
            let r = rank(5, 1, &t1, &[(HCCL_MEM_TYPE_DEVICE, buf, LEN)]);
            assert_eq!(prepare(&r, 20), 0);
            // Bound after Prepare.
            let late = dev_alloc(LEN);
            let h = register(HCCL_MEM_TYPE_DEVICE, late, LEN);
            // SAFETY: live handles.
            ok(unsafe { HcclCommBindMem(r.comm, h) }, "bind after prepare");
            let started = Instant::now();
            assert_eq!(prepare(&r, 20), 0, "a second Prepare succeeds");
            assert!(started.elapsed() < Duration::from_millis(500), "and does nothing");
            let mut r = r;
            r.handles.push(h);
            (r, late as usize, buf as usize)
        },
    );
    let (r0, buf0) = r0;
    // Rank 0 reads rank 1's late memory: unknown remote buffer.
    assert_eq!(get(&r0, 1, buf0 as *mut c_void, late as *mut c_void, 64), HCCL_E_INTERNAL);
    let text = recent_error();
    assert!(text.contains("Can't find remoteBuffer by key"), "{text}");
    // Rank 1 uses its late memory locally: also unknown.
    set_device(5);
    assert_eq!(get(&r1, 0, late as *mut c_void, buf0 as *mut c_void, 64), HCCL_E_INTERNAL);
    set_device(2);
    assert_eq!(get(&r0, 1, buf0 as *mut c_void, first1 as *mut c_void, 64), 0, "the prepared memory works");
    assert_eq!(sync(&r0), 0);
    teardown(r0);
    teardown(r1);
}

/// Rule 5: host memory is recorded at registration; Prepare registers it with the device and
/// fails, for the whole communicator, unless it came from `aclrtMallocHost`. A device address
/// registered as host memory fails Prepare too.
#[test]
fn prepare_registers_host_memory_only_from_malloc_host() {
    const NAME: &str = "prepare_registers_host_memory_only_from_malloc_host";
    if !child(NAME, &[]) {
        return;
    }
    type Alloc = fn() -> (*mut c_void, bool);
    let cases: [(&str, Alloc); 3] = [
        ("malloc", || (Box::leak(vec![0u8; 8192].into_boxed_slice()).as_mut_ptr().cast(), false)),
        ("device as host", || (dev_alloc(8192), false)),
        ("aclrtMallocHost", || (host_alloc(8192), true)),
    ];
    for (what, alloc) in cases {
        let t = two_servers();
        let t1 = t.clone();
        let (c0, c1) = both(
            move || {
                set_device(2);
                let dev = dev_alloc(LEN);
                let (host, fine) = alloc();
                let r = rank(2, 0, &t, &[(HCCL_MEM_TYPE_DEVICE, dev, LEN), (HCCL_MEM_TYPE_HOST, host, 8192)]);
                let code = prepare(&r, 3);
                let text = recent_error();
                teardown(r);
                (code, text, fine)
            },
            move || {
                set_device(5);
                let dev = dev_alloc(LEN);
                let r = rank(5, 1, &t1, &[(HCCL_MEM_TYPE_DEVICE, dev, LEN)]);
                let code = prepare(&r, 3);
                teardown(r);
                code
            },
        );
        let (code, text, fine) = c0;
        if fine {
            assert_eq!((code, c1), (0, 0), "{what}: {text}");
        } else {
            assert_eq!(code, HCCL_E_RUNTIME, "{what}: the whole communicator fails: {text}");
            assert!(text.contains("aclrtHostRegister"), "{what}: {text}");
            // The peer never meets it: it times out waiting, sees the link drop when rank 0
            // tears its communicator down (had it already reached rank 0's endpoint), or reaches
            // the endpoint just after the teardown and is told the communicator is gone.
            assert!(
                c1 == HCCL_E_TIMEOUT || c1 == HCCL_E_TCP_TRANSFER || c1 == HCCL_E_NOT_FOUND,
                "{what}: the peer's Prepare answered {c1}, expected a timeout, a dropped link or a gone communicator"
            );
        }
    }
}

/// Rule 6: ranks of one server (equal `server_id`) share device memory over HCCS IPC: host
/// memory fails Prepare, and so does device memory not on a 2 MiB boundary; with
/// `HCCL_INTRA_ROCE_ENABLE=1` the RoCE rules apply instead.
#[test]
fn one_server_shares_only_aligned_device_memory() {
    const NAME: &str = "one_server_shares_only_aligned_device_memory";
    let roce = std::env::var("EMU_ROCE").is_ok();
    if role().is_none() {
        run_child(NAME, "ipc", &[], T);
        run_child(NAME, "roce", &[("HCCL_INTRA_ROCE_ENABLE", "1"), ("EMU_ROCE", "1")], T);
        return;
    }
    type Alloc = fn() -> (*mut c_void, usize, i32);
    let cases: [(&str, Alloc, bool); 3] = [
        ("huge-only device memory", || (dev_alloc_policy(LEN, 1), LEN, HCCL_MEM_TYPE_DEVICE), true),
        ("device memory off a 2 MiB boundary", || (dev_alloc_policy(LEN, 1).wrapping_byte_add(4096), 8192, 0), roce),
        ("host memory", || (host_alloc(8192), 8192, HCCL_MEM_TYPE_HOST), roce),
    ];
    for (what, alloc, fine) in cases {
        let t = one_server();
        let t1 = t.clone();
        let (c0, c1) = both(
            move || {
                set_device(2);
                let (p, len, kind) = alloc();
                let r = rank(2, 0, &t, &[(kind, p, len)]);
                let code = prepare(&r, 3);
                let text = recent_error();
                teardown(r);
                (code, text)
            },
            move || {
                set_device(5);
                let r = rank(5, 1, &t1, &[(0, dev_alloc_policy(LEN, 1), LEN)]);
                let code = prepare(&r, 3);
                teardown(r);
                code
            },
        );
        if fine {
            assert_eq!((c0.0, c1), (0, 0), "{what}: {}", c0.1);
        } else {
            assert_eq!(c0.0, HCCL_E_RUNTIME, "{what}: {}", c0.1);
            assert!(c0.1.contains("HCCS IPC"), "{what}: {}", c0.1);
        }
    }
    assert_eq!(IPC_ALIGNMENT, 2 << 20);
    let p = dev_alloc_policy(LEN, 1);
    assert_eq!(p as usize % IPC_ALIGNMENT, 0, "huge-only memory starts on a huge page");
}

/// Rule 7: `host_ip` is a literal IP address; a host name fails init with `HCCL_E_PARA`.
#[test]
fn host_ip_must_be_a_literal_address() {
    const NAME: &str = "host_ip_must_be_a_literal_address";
    if !child(NAME, &[]) {
        return;
    }
    set_device(2);
    let t = two_servers().replace(r#""host_ip":"127.0.0.1""#, r#""host_ip":"prefill-node""#);
    let c = CString::new(t).unwrap();
    let mut comm: HcclComm = std::ptr::null_mut();
    // SAFETY: valid pointers.
    let code = unsafe { HcclCommInitClusterInfoMemConfig(c.as_ptr(), 0, std::ptr::null_mut(), &mut comm) };
    assert_eq!(code, HCCL_E_PARA);
    let text = recent_error();
    assert!(text.contains("host_ip") && text.contains("prefill-node"), "{text}");
}

/// Rule 8: on Atlas A3 (`Ascend910_93xx`) ranks on different servers need a v1.2 table with
/// `super_device_id` and `super_pod_id`; a v1.0 table fails Prepare.
#[test]
fn atlas_a3_needs_a_v12_table_across_servers() {
    const NAME: &str = "atlas_a3_needs_a_v12_table_across_servers";
    let env = [
        ("FERRY_CANN_EMU_SOC", "Ascend910_9391"),
        ("FERRY_CANN_EMU_SUPER_POD", "7"),
        ("FERRY_CANN_EMU_SUPER_DEVICE_BASE", "100"),
    ];
    if !child(NAME, &env) {
        return;
    }
    let soc = {
        // SAFETY: returns a static string.
        let p = unsafe { aclrtGetSocName() };
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
    };
    assert_eq!(soc, "Ascend910_9391");
    let info = |dev: u32, attr: i32| {
        let mut v = -1i64;
        // SAFETY: valid out-parameter.
        let code = unsafe { aclrtGetDeviceInfo(dev, attr, &mut v) };
        (code, v)
    };
    assert_eq!(info(5, ACL_DEV_ATTR_SUPER_POD_DEVICE_ID), (0, 5 + 100), "base + physical id");
    assert_eq!(info(5, ACL_DEV_ATTR_SUPER_POD_ID), (0, 7));
    assert_eq!(info(5, 1).0, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    let pods = r#","super_pod_list":[{"super_pod_id":"0","server_list":[{"server_id":"s0"},{"server_id":"s1"}]}]"#;
    let v12 = table(
        free_ports(),
        ("s0", "s1"),
        "1.2",
        (r#","super_device_id":"33554432""#, r#","super_device_id":"33554437""#),
        pods,
    );
    for (what, t, fine) in [("v1.0", two_servers(), false), ("v1.2 with super fields", v12, true)] {
        let t1 = t.clone();
        let (c0, c1) = both(
            move || {
                set_device(2);
                let r = rank(2, 0, &t, &[(0, dev_alloc(LEN), LEN)]);
                let code = prepare(&r, 3);
                let text = recent_error();
                teardown(r);
                (code, text)
            },
            move || {
                set_device(5);
                let r = rank(5, 1, &t1, &[(0, dev_alloc(LEN), LEN)]);
                let code = prepare(&r, 3);
                teardown(r);
                code
            },
        );
        if fine {
            assert_eq!((c0.0, c1), (0, 0), "{what}: {}", c0.1);
        } else {
            assert_eq!((c0.0, c1), (HCCL_E_PARA, HCCL_E_PARA), "{what}: {}", c0.1);
            assert!(c0.1.contains("v1.2"), "{what}: {}", c0.1);
        }
    }
}

/// Rule 4: in a container `ASCEND_RT_VISIBLE_DEVICES` lists logical ids of the mounted cards;
/// the id calls map user → logical → physical as CANN documents
/// (`aclrtGetPhyDevIdByLogicDevId` takes the user id).
#[test]
fn container_ids_map_user_to_logical_to_physical() {
    const NAME: &str = "container_ids_map_user_to_logical_to_physical";
    if role().is_none() {
        run_child(NAME, "one", &[("FERRY_CANN_EMU_MOUNTED", "6,7"), ("ASCEND_RT_VISIBLE_DEVICES", "1")], T);
        // Logical ids stop at the first one not below the device count (2 mounted cards).
        run_child(NAME, "cut", &[("FERRY_CANN_EMU_MOUNTED", "6,7"), ("ASCEND_RT_VISIBLE_DEVICES", "0,2")], T);
        run_child(NAME, "bare", &[("ASCEND_RT_VISIBLE_DEVICES", "3")], T);
        return;
    }
    let map = |f: unsafe extern "C" fn(i32, *mut i32) -> i32, id: i32| {
        let mut v = -1;
        // SAFETY: valid out-parameter.
        let code = unsafe { f(id, &mut v) };
        (code, v)
    };
    let mut count = 0u32;
    // SAFETY: valid out-parameter.
    ok(unsafe { aclrtGetDeviceCount(&mut count) }, "aclrtGetDeviceCount");
    let expected = match role().unwrap().as_str() {
        "one" => (1, 1, 7),
        "cut" => (1, 0, 6),
        _ => (1, 3, 3),
    };
    assert_eq!(count, expected.0);
    assert_eq!(map(aclrtGetLogicDevIdByUserDevId, 0), (0, expected.1));
    assert_eq!(map(aclrtGetPhyDevIdByUserDevId, 0), (0, expected.2));
    assert_eq!(map(aclrtGetPhyDevIdByLogicDevId, 0), (0, expected.2), "takes the user id");
    assert_eq!(map(aclrtGetPhyDevIdByUserDevId, 1).0, ACL_ERROR_RT_INVALID_DEVICEID);
    set_device(0);
    let mut got = -1;
    // SAFETY: valid out-parameter.
    ok(unsafe { aclrtGetDevice(&mut got) }, "aclrtGetDevice");
    assert_eq!(got, 0, "the current device is user id 0 whatever the card");
}

/// Rule 9: `aclrtStreamAbort` discards queued work; a synchronize waiting meanwhile returns
/// `ACL_ERROR_RT_STREAM_ABORT` (107023); afterwards the stream is normal.
#[test]
fn stream_abort_discards_queued_work() {
    const NAME: &str = "stream_abort_discards_queued_work";
    if !child(NAME, &[("FERRY_CANN_EMU_DELAY_US", "aclrtMemcpyAsync:200000")]) {
        return;
    }
    set_device(1);
    let d = dev_alloc(4096);
    let s = new_stream();
    let src = pattern(3, 4096);
    let started = Instant::now();
    let stream = s as usize;
    // SAFETY: `src` outlives the stream's work (the stream is synchronized below).
    unsafe {
        for _ in 0..4 {
            ok(aclrtMemcpyAsync(d, 4096, src.as_ptr().cast(), 4096, ACL_MEMCPY_HOST_TO_DEVICE, s), "queue");
        }
    }
    // SAFETY: a live stream (its handle is a number).
    let waiter = std::thread::spawn(move || unsafe { aclrtSynchronizeStream(stream as AclrtStream) });
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: live stream.
    ok(unsafe { aclrtStreamAbort(s) }, "aclrtStreamAbort");
    // Four copies of 200 ms each would take 800 ms: less means the queued ones were discarded.
    assert!(started.elapsed() < Duration::from_millis(790), "three of four copies were discarded");
    assert_eq!(waiter.join().unwrap(), ACL_ERROR_RT_STREAM_ABORT, "the waiting synchronize");
    // SAFETY: live stream; `src` outlives the copy.
    unsafe {
        ok(aclrtSynchronizeStream(s), "after the abort the stream is normal");
        ok(aclrtMemcpyAsync(d, 4096, src.as_ptr().cast(), 4096, ACL_MEMCPY_HOST_TO_DEVICE, s), "usable again");
        ok(aclrtSynchronizeStream(s), "and runs work");
    }
}
