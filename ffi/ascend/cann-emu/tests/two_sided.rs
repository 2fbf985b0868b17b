//! Two-sided HCCL between two processes: root info, send/recv both ways, mismatches.

mod common;

use std::time::Duration;

use common::*;
use ferry_cann_emu::*;

const T: Duration = Duration::from_secs(90);
const LEN: usize = 3 << 20;
const TEST: &str = "send_and_recv_between_two_processes";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn rank(rank: u32) {
    set_device(0);
    let root = if rank == 0 {
        let mut root = HcclRootInfo::default();
        // SAFETY: valid out-parameter.
        ok(unsafe { HcclGetRootInfo(&mut root) }, "HcclGetRootInfo");
        let bytes: Vec<u8> = root.internal.iter().map(|&c| c as u8).collect();
        say(&format!("ROOT {}", hex(&bytes)));
        root
    } else {
        let bytes = unhex(&hear_expect("ROOT"));
        let mut root = HcclRootInfo::default();
        for (d, s) in root.internal.iter_mut().zip(bytes) {
            *d = s as _;
        }
        root
    };
    let mut comm: HcclComm = std::ptr::null_mut();
    // SAFETY: valid root info and out-parameter.
    ok(unsafe { HcclCommInitRootInfo(2, &root, rank, &mut comm) }, "HcclCommInitRootInfo");
    let (mut r, mut n) = (9, 9);
    // SAFETY: live communicator, valid out-parameters.
    unsafe {
        ok(HcclGetRankId(comm, &mut r), "HcclGetRankId");
        ok(HcclGetRankSize(comm, &mut n), "HcclGetRankSize");
    }
    assert_eq!((r, n), (rank, 2));
    let peer = 1 - rank;
    let mine = dev_alloc(LEN);
    let theirs = dev_alloc(LEN);
    upload(mine, &pattern(rank, LEN));
    let s = new_stream();
    // SAFETY: (all HCCL calls) device buffers of LEN bytes, live communicator and stream.
    unsafe {
        // Rank 0 sends then receives, rank 1 receives then sends: matched in order.
        if rank == 0 {
            ok(HcclSend(mine, LEN as u64, HCCL_DATA_TYPE_UINT8, peer, comm, s), "HcclSend");
            ok(HcclRecv(theirs, LEN as u64 / 4, 2 /* INT32 */, peer, comm, s), "HcclRecv");
        } else {
            ok(HcclRecv(theirs, LEN as u64, HCCL_DATA_TYPE_UINT8, peer, comm, s), "HcclRecv");
            ok(HcclSend(mine, LEN as u64 / 2, 3 /* FP16 */, peer, comm, s), "HcclSend");
        }
        ok(aclrtSynchronizeStream(s), "synchronize");
    }
    assert_eq!(download(theirs, LEN), pattern(peer, LEN), "rank {rank} got the peer's bytes");

    // SAFETY: as above; the bad calls must be refused before touching memory.
    unsafe {
        assert_eq!(HcclSend(mine, 1, HCCL_DATA_TYPE_UINT8, rank, comm, s), HCCL_E_PARA, "send to self");
        assert_eq!(HcclSend(mine, 1, HCCL_DATA_TYPE_UINT8, 2, comm, s), HCCL_E_PARA, "no rank 2");
        assert_eq!(HcclSend(mine, 1, 99, peer, comm, s), HCCL_E_PARA, "unknown data type");
        assert_eq!(HcclSend(mine, LEN as u64 + 1, HCCL_DATA_TYPE_UINT8, peer, comm, s), HCCL_E_PARA, "past the buffer");
        let host = [0u8; 16];
        assert_eq!(HcclSend(host.as_ptr() as _, 16, HCCL_DATA_TYPE_UINT8, peer, comm, s), HCCL_E_PARA, "host memory");
        assert_eq!(HcclSend(mine, 1, HCCL_DATA_TYPE_UINT8, peer, comm, std::ptr::null_mut()), HCCL_E_PTR);
        assert_eq!(HcclSend(mine, 1, HCCL_DATA_TYPE_UINT8, peer, std::ptr::null_mut(), s), HCCL_E_PTR);
        assert_eq!(HcclSend(mine, 1, HCCL_DATA_TYPE_UINT8, peer, 0x1234 as _, s), HCCL_E_PARA, "forged comm");

        // A receive whose size differs from the matching send fails at synchronize.
        if rank == 0 {
            ok(HcclSend(mine, 100, HCCL_DATA_TYPE_UINT8, peer, comm, s), "HcclSend");
            ok(aclrtSynchronizeStream(s), "synchronize");
        } else {
            ok(HcclRecv(theirs, 200, HCCL_DATA_TYPE_UINT8, peer, comm, s), "HcclRecv");
            assert_eq!(aclrtSynchronizeStream(s), ACL_ERROR_RT_SUSPECT_REMOTE_ERROR);
            let text = recent_error();
            assert!(text.contains("carries 100 bytes, this receive expects 200"), "{text}");
            ok(HcclRecv(theirs, 100, HCCL_DATA_TYPE_UINT8, peer, comm, s), "HcclRecv after the failure");
            assert_eq!(aclrtSynchronizeStream(s), ACL_ERROR_RT_LINK_ERROR, "the link stays unusable");
        }
    }
    say("DONE");
    let _ = hear();
    // SAFETY: live communicator.
    ok(unsafe { HcclCommDestroy(comm) }, "HcclCommDestroy");
    // SAFETY: destroyed handle must be refused.
    assert_eq!(unsafe { HcclCommDestroy(comm) }, HCCL_E_PARA);
}

#[test]
fn send_and_recv_between_two_processes() {
    match role().as_deref() {
        Some("rank0") => return rank(0),
        Some("rank1") => return rank(1),
        _ => {}
    }
    let env = [("HCCL_CONNECT_TIMEOUT", "30"), ("HCCL_EXEC_TIMEOUT", "30")];
    let mut r0 = Peer::spawn(TEST, "rank0", &env);
    let root = r0.expect("ROOT", T);
    // The second process is on another card, seen through a container-like device list.
    let mut r1 = Peer::spawn(TEST, "rank1", &[env[0], env[1], ("ASCEND_RT_VISIBLE_DEVICES", "3")]);
    r1.send(&format!("ROOT {root}"));
    r0.expect("DONE", T);
    r1.expect("DONE", T);
    r0.send("END");
    r1.send("END");
    r0.finish(T);
    r1.finish(T);
}

#[test]
fn init_times_out_when_the_peer_never_comes() {
    if role().is_some() {
        set_device(0);
        let mut root = HcclRootInfo::default();
        let mut comm: HcclComm = std::ptr::null_mut();
        // SAFETY: valid pointers.
        unsafe {
            ok(HcclGetRootInfo(&mut root), "HcclGetRootInfo");
            let start = std::time::Instant::now();
            assert_eq!(HcclCommInitRootInfo(2, &root, 0, &mut comm), HCCL_E_TIMEOUT);
            assert!(start.elapsed() >= Duration::from_millis(900), "{:?}", start.elapsed());
            assert!(comm.is_null());
            assert_eq!(HcclCommInitRootInfo(2, &root, 2, &mut comm), HCCL_E_PARA, "rank >= nRanks");
            let junk = HcclRootInfo::default();
            assert_eq!(HcclCommInitRootInfo(2, &junk, 0, &mut comm), HCCL_E_PARA, "foreign root info");
        }
        std::thread::spawn(move || {
            // SAFETY: valid pointers; this thread has no device.
            let rc = unsafe { HcclCommInitRootInfo(1, &root, 0, &mut std::ptr::null_mut()) };
            assert_eq!(rc, HCCL_E_RUNTIME);
        })
        .join()
        .unwrap();
        return;
    }
    run_child("init_times_out_when_the_peer_never_comes", "alone", &[("HCCL_CONNECT_TIMEOUT", "1")], T);
}

#[test]
fn cluster_info_file_links_two_processes() {
    if let Some(role) = role() {
        let r: u32 = role.trim_start_matches("rank").parse().unwrap();
        set_device(0);
        let path = std::env::var("EMU_TABLE_PATH").unwrap();
        let c_path = std::ffi::CString::new(path).unwrap();
        let mut comm: HcclComm = std::ptr::null_mut();
        // SAFETY: valid path and out-parameter.
        ok(unsafe { HcclCommInitClusterInfo(c_path.as_ptr(), r, &mut comm) }, "HcclCommInitClusterInfo");
        let buf = dev_alloc(4096);
        let s = new_stream();
        if r == 0 {
            upload(buf, &pattern(42, 4096));
        }
        // SAFETY: device buffer, live communicator and stream.
        unsafe {
            if r == 0 {
                ok(HcclSend(buf, 4096, HCCL_DATA_TYPE_UINT8, 1, comm, s), "HcclSend");
            } else {
                ok(HcclRecv(buf, 4096, HCCL_DATA_TYPE_UINT8, 0, comm, s), "HcclRecv");
            }
            ok(aclrtSynchronizeStream(s), "synchronize");
        }
        assert_eq!(download(buf, 4096), pattern(42, 4096));
        // SAFETY: live communicator.
        ok(unsafe { HcclCommDestroy(comm) }, "HcclCommDestroy");
        return;
    }
    let (p0, p1) = free_ports();
    let table = format!(
        r#"{{"status":"completed","version":"1.0","server_count":"1","server_list":[{{"server_id":"127.0.0.1","device":[
            {{"device_id":"1","device_ip":"127.0.0.1","device_port":"{p0}","rank_id":"0"}},
            {{"device_id":"6","device_ip":"127.0.0.1","device_port":"{p1}","rank_id":"1"}}]}}]}}"#
    );
    let dir = std::env::temp_dir().join(format!("cann-emu-table-{}-{p0}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rank_table.json");
    std::fs::write(&path, table).unwrap();
    let path = path.to_string_lossy().into_owned();
    let common = [("HCCL_CONNECT_TIMEOUT", "30"), ("EMU_TABLE_PATH", path.as_str())];
    let mut a = Peer::spawn(
        "cluster_info_file_links_two_processes",
        "rank0",
        &[common[0], common[1], ("ASCEND_RT_VISIBLE_DEVICES", "1")],
    );
    let mut b = Peer::spawn(
        "cluster_info_file_links_two_processes",
        "rank1",
        &[common[0], common[1], ("ASCEND_RT_VISIBLE_DEVICES", "6")],
    );
    a.finish(T);
    b.finish(T);
    let _ = std::fs::remove_dir_all(dir);
}
