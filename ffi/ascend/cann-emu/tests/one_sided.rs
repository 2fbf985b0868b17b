//! One-sided HCCL between two processes: register, init from a rank table string, bind,
//! prepare, batch get/put with data verified, out-of-bounds requests refused.
#![cfg(feature = "onesided")]

mod common;

use std::ffi::{CString, c_void};
use std::time::{Duration, Instant};

use common::*;
use ferry_cann_emu::*;

const T: Duration = Duration::from_secs(90);
const LEN: usize = 256 * 1024;
const TEST: &str = "get_and_put_between_two_processes";

fn table(p0: u16, p1: u16, dev0: u32, dev1: u32) -> String {
    format!(
        r#"{{"status":"completed","version":"1.0","server_count":"2","server_list":[
        {{"server_id":"prefill","host_ip":"127.0.0.1","device":[{{"device_id":"{dev0}","device_ip":"127.0.0.1","device_port":"{p0}","rank_id":"0"}}]}},
        {{"server_id":"decode","host_ip":"127.0.0.1","device":[{{"device_id":"{dev1}","device_ip":"127.0.0.1","device_port":"{p1}","rank_id":"1"}}]}}]}}"#
    )
}

struct Side {
    comm: HcclComm,
    mem: *mut c_void,
    buf: *mut c_void,
    stream: AclrtStream,
}

/// Registers, creates the communicator and binds; no Prepare yet.
fn init_side(rank: u32, table: &str) -> Side {
    set_device(0);
    let buf = dev_alloc(LEN);
    upload(buf, &pattern(rank, LEN));
    let mut mem = std::ptr::null_mut();
    let mut comm: HcclComm = std::ptr::null_mut();
    let t = CString::new(table).unwrap();
    // SAFETY: valid pointers; the buffer is emulated device memory of LEN bytes.
    unsafe {
        let m = CommMem { mem_type: HCCL_MEM_TYPE_DEVICE, addr: buf, size: LEN as u64 };
        ok(HcclRegisterGlobalMem(&m, &mut mem), "HcclRegisterGlobalMem");
        let mut config = [0u8; 400];
        config[..8].copy_from_slice(&400usize.to_le_bytes());
        config[8..12].copy_from_slice(&HCCL_COMM_CONFIG_MAGIC.to_le_bytes());
        config[12..16].copy_from_slice(&5u32.to_le_bytes());
        config[32..40].copy_from_slice(b"emu_test");
        ok(HcclCommInitClusterInfoMemConfig(t.as_ptr(), rank, config.as_mut_ptr().cast(), &mut comm), "init");
        ok(HcclCommBindMem(comm, mem), "HcclCommBindMem");
    }
    Side { comm, mem, buf, stream: new_stream() }
}

/// Calls `HcclCommPrepare` and returns how long it took.
fn prepare(side: &Side, timeout_s: i32) -> Duration {
    let start = Instant::now();
    // SAFETY: live communicator; the config is a valid struct.
    ok(unsafe { HcclCommPrepare(side.comm, &HcclPrepareConfig::default(), timeout_s) }, "HcclCommPrepare");
    start.elapsed()
}

/// Unbinds, destroys and deregisters.
fn teardown(side: &Side) {
    // SAFETY: live handles.
    unsafe {
        ok(HcclCommUnbindMem(side.comm, side.mem), "HcclCommUnbindMem");
        ok(HcclCommDestroy(side.comm), "HcclCommDestroy");
        ok(HcclDeregisterGlobalMem(side.mem), "HcclDeregisterGlobalMem");
    }
}

fn setup(rank: u32, table: &str) -> Side {
    let side = init_side(rank, table);
    prepare(&side, 30);
    side
}

fn desc(local: *mut c_void, remote: u64, count: u64) -> HcclOneSideOpDesc {
    HcclOneSideOpDesc { local_addr: local, remote_addr: remote as *mut c_void, count, data_type: HCCL_DATA_TYPE_UINT8 }
}

/// Rank 0 (prefill): passive; its memory is read and written by rank 1.
fn prefill(table: &str) {
    let side = setup(0, table);
    say(&format!("ADDR {:x}", side.buf as usize));
    let _peer = hear_expect("PEER");
    hear_expect("CHECK");
    // Rank 1 wrote its bytes 0..4096 at our offset 8192.
    let now = download(side.buf, LEN);
    let mut expected = pattern(0, LEN);
    expected[8192..8192 + 4096].copy_from_slice(&pattern(1, 4096));
    assert!(now == expected, "the put landed exactly where it was aimed");
    // SAFETY: live handles.
    unsafe {
        assert_eq!(HcclDeregisterGlobalMem(side.mem), HCCL_E_PARA, "still bound");
        ok(HcclCommUnbindMem(side.comm, side.mem), "HcclCommUnbindMem");
    }
    say("UNBOUND");
    hear_expect("FINISH");
    // SAFETY: live handles.
    unsafe {
        ok(HcclCommDestroy(side.comm), "HcclCommDestroy");
        ok(HcclDeregisterGlobalMem(side.mem), "HcclDeregisterGlobalMem");
        assert_eq!(HcclDeregisterGlobalMem(side.mem), HCCL_E_PARA, "already deregistered");
    }
}

/// Rank 1 (decode): reads and writes rank 0's memory.
fn decode(table: &str) {
    let side = setup(1, table);
    say(&format!("ADDR {:x}", side.buf as usize));
    let remote = u64::from_str_radix(&hear_expect("PEER"), 16).unwrap();
    let (buf, comm, s) = (side.buf, side.comm, side.stream);
    let at = |off: usize| buf.wrapping_byte_add(off);
    let peer0 = pattern(0, LEN);
    // SAFETY: descriptors point into bound memory of both sides; live comm and stream.
    unsafe {
        // Two reads of rank 0's memory into our upper half, one write of our first 4 KiB.
        let mut gets =
            [desc(at(LEN / 2), remote + 100, 5000), desc(at(LEN / 2 + 8192), remote + LEN as u64 - 4000, 4000)];
        ok(HcclBatchGet(comm, 0, gets.as_mut_ptr(), 2, s), "HcclBatchGet");
        let mut puts = [desc(at(0), remote + 8192, 4096)];
        ok(HcclBatchPut(comm, 0, puts.as_mut_ptr(), 1, s), "HcclBatchPut");
        ok(aclrtSynchronizeStreamWithTimeout(s, 30_000), "synchronize");
        let got = download(at(LEN / 2), 8192 + 4000);
        assert_eq!(&got[..5000], &peer0[100..5100], "first read");
        assert_eq!(&got[8192..], &peer0[LEN - 4000..], "second read");

        // Outside what rank 0 exchanged at Prepare: refused at the call, nothing queued.
        let mut oob = [desc(at(0), remote + LEN as u64 - 8, 16)];
        assert_eq!(HcclBatchGet(comm, 0, oob.as_mut_ptr(), 1, s), HCCL_E_INTERNAL);
        assert!(recent_error().contains("Can't find remoteBuffer by key"));
        let mut below = [desc(at(0), remote - 1, 2)];
        assert_eq!(HcclBatchPut(comm, 0, below.as_mut_ptr(), 1, s), HCCL_E_INTERNAL);
        let mut wrap = [desc(at(0), u64::MAX - 2, 16)];
        assert_eq!(HcclBatchGet(comm, 0, wrap.as_mut_ptr(), 1, s), HCCL_E_INTERNAL);
        let mut local_oob = [desc(at(LEN - 4), remote, 16)];
        assert_eq!(HcclBatchGet(comm, 0, local_oob.as_mut_ptr(), 1, s), HCCL_E_PARA, "local memory not bound");
        let mut many = vec![desc(at(0), remote, 1); 257];
        assert_eq!(HcclBatchGet(comm, 0, many.as_mut_ptr(), 257, s), HCCL_E_PARA, "more than 256 descriptors");
        assert_eq!(HcclBatchGet(comm, 1, gets.as_mut_ptr(), 1, s), HCCL_E_PARA, "to ourselves");
        assert_eq!(HcclBatchGet(comm, 0, std::ptr::null_mut(), 1, s), HCCL_E_PTR);
        ok(aclrtSynchronizeStream(s), "nothing failed asynchronously");
        let mut max = vec![desc(at(0), remote, 16); 256];
        ok(HcclBatchGet(comm, 0, max.as_mut_ptr(), 256, s), "256 descriptors");
        ok(aclrtSynchronizeStream(s), "synchronize");
    }
    say("PUT_DONE");
    hear_expect("UNBOUND");
    // SAFETY: as above. Rank 0 unbound its memory after our Prepare: the call passes our
    // snapshot, the peer refuses when it serves the request, the stream reports it.
    unsafe {
        let mut late = [desc(at(0), remote, 64)];
        ok(HcclBatchGet(comm, 0, late.as_mut_ptr(), 1, s), "HcclBatchGet (queued)");
        assert_eq!(aclrtSynchronizeStream(s), ACL_ERROR_RT_SUSPECT_REMOTE_ERROR);
        let text = recent_error();
        assert!(text.contains("refused"), "{text}");
        ok(aclrtSynchronizeStream(s), "the error was reported once");
        // The peer is never asked again: the next call passes too and is refused when served.
        let mut again = [desc(at(0), remote + 64, 64)];
        ok(HcclBatchGet(comm, 0, again.as_mut_ptr(), 1, s), "HcclBatchGet (queued again)");
        assert_eq!(aclrtSynchronizeStream(s), ACL_ERROR_RT_SUSPECT_REMOTE_ERROR);
        ok(HcclCommUnbindMem(comm, side.mem), "unbind");
        ok(HcclCommDestroy(comm), "HcclCommDestroy");
        ok(HcclDeregisterGlobalMem(side.mem), "HcclDeregisterGlobalMem");
    }
    say("DONE");
}

#[test]
fn get_and_put_between_two_processes() {
    if let Some(role) = role() {
        let table = std::env::var("EMU_TABLE").unwrap();
        return if role == "prefill" { prefill(&table) } else { decode(&table) };
    }
    let (p0, p1) = free_ports();
    let t = table(p0, p1, 2, 5);
    let env = |devices| {
        vec![
            ("HCCL_CONNECT_TIMEOUT", "30"),
            ("HCCL_EXEC_TIMEOUT", "30"),
            ("EMU_TABLE", t.as_str()),
            ("ASCEND_RT_VISIBLE_DEVICES", devices),
        ]
    };
    // Physical devices 2 and 5, both user id 0 in their process (as in containers).
    let mut p = Peer::spawn(TEST, "prefill", &env("2"));
    let mut d = Peer::spawn(TEST, "decode", &env("5"));
    let pa = p.expect("ADDR", T);
    let da = d.expect("ADDR", T);
    p.send(&format!("PEER {da}"));
    d.send(&format!("PEER {pa}"));
    d.expect("PUT_DONE", T);
    p.send("CHECK");
    p.expect("UNBOUND", T);
    d.send("UNBOUND");
    d.expect("DONE", T);
    p.send("FINISH");
    d.finish(T);
    p.finish(T);
}

#[test]
fn prepare_waits_for_the_peer_and_times_out_without_it() {
    if role().is_some() {
        let t = std::env::var("EMU_TABLE").unwrap();
        let c = CString::new(t).unwrap();
        set_device(0);
        let mut comm: HcclComm = std::ptr::null_mut();
        // SAFETY: valid pointers.
        unsafe {
            ok(HcclCommInitClusterInfoMemConfig(c.as_ptr(), 0, std::ptr::null_mut(), &mut comm), "init");
            let start = std::time::Instant::now();
            assert_eq!(HcclCommPrepare(comm, &HcclPrepareConfig::default(), 1), HCCL_E_TIMEOUT);
            assert!(start.elapsed() >= Duration::from_millis(900));
            let cfg = HcclPrepareConfig { topo_type: 3, ..Default::default() };
            assert_eq!(HcclCommPrepare(comm, &cfg, 1), HCCL_E_NOT_SUPPORT);
            assert_eq!(HcclCommPrepare(comm, std::ptr::null(), 1), HCCL_E_PTR);
            let s = new_stream();
            let mut d = [desc(std::ptr::null_mut(), 1, 1)];
            assert_eq!(HcclBatchGet(comm, 1, d.as_mut_ptr(), 1, s), HCCL_E_PTR);
            let buf = dev_alloc(64);
            let mut d = [desc(buf, 1, 1)];
            assert_eq!(HcclBatchGet(comm, 1, d.as_mut_ptr(), 1, s), HCCL_E_UNAVAIL, "not prepared");
            assert_eq!(HcclSend(buf, 1, HCCL_DATA_TYPE_UINT8, 1, comm, s), HCCL_E_NOT_SUPPORT, "one-sided comm");
            ok(HcclCommDestroy(comm), "HcclCommDestroy");
            // The table says rank 1 is physical device 5; this thread is on device 0.
            assert_eq!(HcclCommInitClusterInfoMemConfig(c.as_ptr(), 1, std::ptr::null_mut(), &mut comm), HCCL_E_PARA);
            assert!(recent_error().contains("device_id 5"));
            assert_eq!(HcclCommInitClusterInfoMemConfig(c.as_ptr(), 2, std::ptr::null_mut(), &mut comm), HCCL_E_PARA);
            let bad = CString::new(t_replace(&std::env::var("EMU_TABLE").unwrap())).unwrap();
            assert_eq!(HcclCommInitClusterInfoMemConfig(bad.as_ptr(), 0, std::ptr::null_mut(), &mut comm), HCCL_E_PARA);
            assert!(recent_error().contains("status"));
            let mut wrong_magic = [0u8; 24];
            wrong_magic[..8].copy_from_slice(&24usize.to_le_bytes());
            assert_eq!(
                HcclCommInitClusterInfoMemConfig(c.as_ptr(), 0, wrong_magic.as_mut_ptr().cast(), &mut comm),
                HCCL_E_PARA
            );
            // Registration only records a range (Prepare finds out whether it can be used).
            let host = [0u8; 64];
            let m = CommMem { mem_type: HCCL_MEM_TYPE_DEVICE, addr: host.as_ptr() as _, size: 64 };
            let mut h = std::ptr::null_mut();
            ok(HcclRegisterGlobalMem(&m, &mut h), "host memory registered as device is recorded");
            ok(HcclDeregisterGlobalMem(h), "deregister");
            let m = CommMem { mem_type: HCCL_MEM_TYPE_HOST, addr: host.as_ptr() as _, size: 64 };
            ok(HcclRegisterGlobalMem(&m, &mut h), "host memory as host");
            ok(HcclDeregisterGlobalMem(h), "deregister");
        }
        return;
    }
    let (p0, p1) = free_ports();
    let t = table(p0, p1, 0, 5);
    run_child("prepare_waits_for_the_peer_and_times_out_without_it", "alone", &[("EMU_TABLE", t.as_str())], T);
}

fn t_replace(t: &str) -> String {
    t.replace("completed", "initializing")
}

/// Both ranks call Prepare at the same moment: both return promptly, then each reads the
/// other's memory (the lower rank opens its service connection on first use).
#[test]
fn both_ranks_prepare_at_once_and_then_read_each_other() {
    const NAME: &str = "both_ranks_prepare_at_once_and_then_read_each_other";
    if let Some(role) = role() {
        let rank: u32 = role.parse().unwrap();
        let side = init_side(rank, &std::env::var("EMU_TABLE").unwrap());
        say(&format!("ADDR {:x}", side.buf as usize));
        let remote = u64::from_str_radix(&hear_expect("PEER"), 16).unwrap();
        hear_expect("GO");
        let took = prepare(&side, 20);
        say(&format!("PREPARED {}", took.as_millis()));
        let peer = 1 - rank;
        let at = |off: usize| side.buf.wrapping_byte_add(off);
        // The peer reads our [0, 4096) and [LEN - 1000, LEN); we land its bytes elsewhere.
        let mut gets = [desc(at(LEN / 2), remote, 4096), desc(at(LEN / 2 + 4096), remote + LEN as u64 - 1000, 1000)];
        // SAFETY: descriptors inside bound memory of both sides; live comm and stream.
        unsafe {
            ok(HcclBatchGet(side.comm, peer, gets.as_mut_ptr(), 2, side.stream), "HcclBatchGet");
            ok(aclrtSynchronizeStreamWithTimeout(side.stream, 20_000), "synchronize");
        }
        let got = download(at(LEN / 2), 5096);
        let theirs = pattern(peer, LEN);
        assert!(got[..4096] == theirs[..4096], "rank {rank}: first read of rank {peer}'s memory");
        assert!(got[4096..] == theirs[LEN - 1000..], "rank {rank}: second read of rank {peer}'s memory");
        say("READ_OK");
        hear_expect("FINISH");
        teardown(&side);
        return;
    }
    let (p0, p1) = free_ports();
    let t = table(p0, p1, 2, 5);
    let env = |devices| {
        vec![
            ("HCCL_CONNECT_TIMEOUT", "20"),
            ("HCCL_EXEC_TIMEOUT", "20"),
            ("EMU_TABLE", t.as_str()),
            ("ASCEND_RT_VISIBLE_DEVICES", devices),
        ]
    };
    let mut r0 = Peer::spawn(NAME, "0", &env("2"));
    let mut r1 = Peer::spawn(NAME, "1", &env("5"));
    let a0 = r0.expect("ADDR", T);
    let a1 = r1.expect("ADDR", T);
    r0.send(&format!("PEER {a1}"));
    r1.send(&format!("PEER {a0}"));
    r0.send("GO");
    r1.send("GO");
    for (rank, p) in [(0, &mut r0), (1, &mut r1)] {
        let ms: u64 = p.expect("PREPARED", T).parse().unwrap();
        assert!(ms < 3000, "rank {rank}'s HcclCommPrepare took {ms} ms");
    }
    r0.expect("READ_OK", T);
    r1.expect("READ_OK", T);
    r0.send("FINISH");
    r1.send("FINISH");
    r0.finish(T);
    r1.finish(T);
}

/// Rank 0 calls Prepare before rank 1 even exists; rank 1 then prepares and tears everything
/// down at once. Rank 0's Prepare still returns promptly (the pair met), and a read towards
/// the departed rank fails at synchronize instead of hanging.
#[test]
fn prepare_returns_when_the_peer_leaves_right_after_its_own() {
    const NAME: &str = "prepare_returns_when_the_peer_leaves_right_after_its_own";
    if let Some(role) = role() {
        let table = std::env::var("EMU_TABLE").unwrap();
        if role == "early" {
            let side = init_side(0, &table);
            say("PREPARING");
            let took = prepare(&side, 20);
            say(&format!("PREPARED {}", took.as_millis()));
            let remote = u64::from_str_radix(&hear_expect("PEER_GONE"), 16).unwrap();
            let mut gets = [desc(side.buf, remote, 64)];
            let start = Instant::now();
            // SAFETY: descriptors inside bound memory (rank 1's as announced at Prepare); live
            // comm and stream.
            unsafe {
                ok(HcclBatchGet(side.comm, 1, gets.as_mut_ptr(), 1, side.stream), "HcclBatchGet (queued)");
                assert_eq!(aclrtSynchronizeStreamWithTimeout(side.stream, 20_000), ACL_ERROR_RT_LINK_ERROR);
            }
            let text = recent_error();
            assert!(text.contains("rank 1"), "{text}");
            assert!(start.elapsed() < Duration::from_secs(5), "the failure took {:?}", start.elapsed());
            teardown(&side);
        } else {
            let side = init_side(1, &table);
            say(&format!("ADDR {:x}", side.buf as usize));
            prepare(&side, 20);
            teardown(&side);
            say("GONE");
        }
        return;
    }
    let (p0, p1) = free_ports();
    let t = table(p0, p1, 2, 5);
    let env = |devices| {
        vec![
            ("HCCL_CONNECT_TIMEOUT", "20"),
            ("HCCL_EXEC_TIMEOUT", "20"),
            ("EMU_TABLE", t.as_str()),
            ("ASCEND_RT_VISIBLE_DEVICES", devices),
        ]
    };
    let mut early = Peer::spawn(NAME, "early", &env("2"));
    early.expect("PREPARING", T);
    // Rank 0 is now inside Prepare, and rank 1's endpoint does not exist yet.
    std::thread::sleep(Duration::from_millis(300));
    let mut late = Peer::spawn(NAME, "late", &env("5"));
    let addr = late.expect("ADDR", T);
    late.expect("GONE", T);
    let gone = Instant::now();
    early.expect("PREPARED", Duration::from_secs(30));
    assert!(
        gone.elapsed() < Duration::from_secs(3),
        "rank 0's Prepare returned {:?} after rank 1 left",
        gone.elapsed()
    );
    late.finish(T);
    early.send(&format!("PEER_GONE {addr}"));
    early.finish(T);
}
