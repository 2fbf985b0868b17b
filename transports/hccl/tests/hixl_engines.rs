//! The `ascend` transport's HIXL backend, engine to engine on the emulated CANN and
//! emulated HIXL (`ffi/ascend/cann-emu`, one library also serving as `libllm_datadist.so`,
//! `libcann_hixl.so` and `libmetadef.so`): both engines publish Mooncake `ascend_direct`'s
//! descriptor (`rank_info.hostIp`, `rank_info.endpoints`, per-buffer `device_id`) and move
//! device memory through HIXL; memory registered after a link exists is reached after one
//! refresh and retry; unregistering disconnects first; a stalled peer fails at the transfer
//! timeout; without HIXL the node falls back to direct HCCL, and a protocol asking for HIXL
//! alone is refused saying why.
//!
//! Each test runs its body in a child process (the test binary re-executed with
//! `FERRY_HIXL_ENGINES_ROLE`), so the emulator's environment is the test's own. The emulated CANN
//! must be built (`cargo build -p ferry-cann-emu`). Nets `127.<net>.0.0/24` 70-79 and HIXL
//! port bases `ASCEND_BASE_PORT` = 21000 + 1000 × (net - 70) keep tests that run at once apart.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{Config, ErrorKind, Location, Opcode, TransferEngine, TransferRequest};
use ferry_transport_hccl::runtime::{Device, DeviceBuffer};
use ferry_transport_hccl::sys::Library;
use ferry_transport_hccl::sys::test_support::{Emulator, TempDir, emulator_lib_dir, emulator_lib_dir_with_hixl};
use ferry_transport_hccl::{HcclTransportFactory, stats};

const ROLE: &str = "FERRY_HIXL_ENGINES_ROLE";
const REGION: u64 = 4 << 20;

/// What the child's library directory holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Libs {
    /// ACL, HCCL and HIXL.
    WithHixl,
    /// ACL and HCCL only: a CANN without HIXL.
    WithoutHixl,
}

/// Runs `test` in a child process with `env` and an emulated node (`libs`, an hccn.conf with
/// loopback device IPs in `127.<net>.0.0/24` unless `hccn` is false); true inside the child.
fn in_child(test: &str, net: u8, libs: Libs, hccn: bool, env: &[(&str, &str)]) -> bool {
    if std::env::var_os(ROLE).is_some() {
        return true;
    }
    let lib = match libs {
        Libs::WithHixl => emulator_lib_dir_with_hixl(Emulator::Current),
        Libs::WithoutHixl => emulator_lib_dir(Emulator::Current),
    }
    .unwrap_or_else(|e| panic!("{e}"));
    let conf = TempDir::new("ferry-hccn").unwrap();
    let text: String = (0..8).map(|d| format!("address_{d}=127.{net}.0.{}\n", d + 1)).collect();
    std::fs::write(conf.path().join("hccn.conf"), text).unwrap();
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]);
    for var in [
        "LOCAL_RANK",
        "ASCEND_RT_VISIBLE_DEVICES",
        "ASCEND_BASE_PORT",
        "ASCEND_CONNECT_TIMEOUT",
        "ASCEND_LOCAL_COMM_RES",
        "FERRY_ASCEND_BACKEND",
        "FERRY_CANN_EMU_FAIL",
        "FERRY_CANN_EMU_DELAY_US",
        "FERRY_CANN_EMU_LOG",
        "FERRY_CANN_EMU_MOUNTED",
        "FERRY_LOCAL_RANK",
        "FERRY_HCCN_CONF",
        "HCCL_INTRA_ROCE_ENABLE",
        "MOONCAKE_CONFIG_PATH",
    ] {
        cmd.env_remove(var);
    }
    cmd.env(ROLE, "child")
        .env("FERRY_ASCEND_LIB_DIR", lib.path())
        .env("ASCEND_BASE_PORT", (21000 + 1000 * (u32::from(net) - 70)).to_string())
        .env("FERRY_TRANSFER_TIMEOUT_MS", "20000")
        .env("HCCL_CONNECT_TIMEOUT", "20");
    if hccn {
        cmd.env("FERRY_HCCN_CONF", conf.path().join("hccn.conf"));
    } else {
        // No hccn.conf (the default /etc/hccn.conf is absent here) and no hccn_tool (the
        // driver's is not installed here): no device IP can be found.
        assert!(!std::path::Path::new("/etc/hccn.conf").exists(), "this test needs a machine without /etc/hccn.conf");
        cmd.env_remove("FERRY_HCCN_TOOL");
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    if std::env::var_os("FERRY_TEST_EMU_LOG").is_some() {
        cmd.env("FERRY_CANN_EMU_LOG", "1").env("RUST_LOG", "debug");
    }
    let out = cmd.output().expect("re-running the test binary");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{test} failed in its child process:\n{text}");
    false
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// The config of an engine speaking `protocol` on host 127.0.0.1.
fn config(protocol: &str) -> Config {
    let mut cfg = Config::from_json_str(
        &format!(r#"{{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "{protocol}"}}"#),
        None,
    )
    .unwrap();
    cfg.apply_env(|k| std::env::var(k).ok()).unwrap();
    cfg
}

/// An engine speaking `protocol` on emulated card `card`.
fn try_engine(rt: &tokio::runtime::Runtime, protocol: &str, card: u32) -> ferry::Result<TransferEngine> {
    let transports = ferry::TransportRegistry::new().with(Arc::new(HcclTransportFactory::new()));
    rt.block_on(ferry::builder().config(config(protocol)).transports(transports).local_rank(card).build())
}

fn engine(rt: &tokio::runtime::Runtime, protocol: &str, card: u32) -> TransferEngine {
    try_engine(rt, protocol, card).unwrap_or_else(|e| panic!("engine on card {card}: {e}"))
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13) ^ seed).collect()
}

/// Device memory on `card` filled with `seed`'s pattern.
fn device_region(lib: &Arc<Library>, card: u32, seed: u8) -> (Device, DeviceBuffer) {
    let dev = Device::bind(lib, card).unwrap();
    let buf = dev.alloc_huge(REGION as usize).unwrap();
    buf.write(0, &pattern(seed, REGION as usize)).unwrap();
    (dev, buf)
}

/// Engines speaking `protocols` on cards 4 (`a`) and 5 (`b`), each with one device region of
/// [`REGION`] bytes registered: `ma` filled with pattern 1, `mb` with pattern 2.
struct Pair {
    a: TransferEngine,
    b: TransferEngine,
    ma: DeviceBuffer,
    mb: DeviceBuffer,
    _devices: (Device, Device),
}

fn pair(rt: &tokio::runtime::Runtime, lib: &Arc<Library>, protocols: [&str; 2]) -> Pair {
    let (a, b) = (engine(rt, protocols[0], 4), engine(rt, protocols[1], 5));
    let (da, ma) = device_region(lib, 4, 1);
    let (db, mb) = device_region(lib, 5, 2);
    register(rt, &a, &ma, 4);
    register(rt, &b, &mb, 5);
    Pair { a, b, ma, mb, _devices: (da, db) }
}

fn register(rt: &tokio::runtime::Runtime, engine: &TransferEngine, buf: &DeviceBuffer, card: u32) {
    // SAFETY: every region registered by these tests stays allocated until its engine shut down
    // (the buffers are dropped at the end of each test, after `shutdown`).
    rt.block_on(unsafe { engine.register_memory(buf.addr(), REGION, Location::Npu(card)) }).unwrap();
}

fn transfer(
    rt: &tokio::runtime::Runtime,
    e: &TransferEngine,
    peer: &TransferEngine,
    opcode: Opcode,
    local: u64,
    remote: u64,
    len: u64,
) -> ferry::Result<()> {
    let target = rt.block_on(e.open_segment(peer.segment_name()))?;
    let req = TransferRequest { opcode, source: local, target, target_offset: remote, length: len };
    rt.block_on(e.transfer(&[req]))
}

fn shutdown(rt: &tokio::runtime::Runtime, engines: Vec<TransferEngine>) {
    for e in engines {
        rt.block_on(e.shutdown()).expect("shutdown");
    }
}

fn bytes(buf: &DeviceBuffer, offset: usize, len: usize) -> Vec<u8> {
    let mut got = vec![0u8; len];
    buf.read(offset, &mut got).unwrap();
    got
}

/// Two engines on cards 4 and 5 publish Mooncake ascend_direct's descriptor and move device
/// memory through HIXL, both ways, every byte checked; direct HCCL is not used for them.
#[test]
fn engines_with_hixl_publish_endpoints_and_move_memory_through_it() {
    const NAME: &str = "engines_with_hixl_publish_endpoints_and_move_memory_through_it";
    if !in_child(NAME, 70, Libs::WithHixl, true, &[]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, _devices } = pair(&rt, &lib, ["ascend", "ascend"]);

    let d = b.local_descriptor();
    let r = d.rank_info.as_ref().expect("rank_info");
    assert_eq!(r.host_ip, "127.0.0.1");
    assert_eq!(r.endpoints.len(), 1, "one HIXL engine per transport: {r:?}");
    let port: u32 = r.endpoints[0].strip_prefix("127.0.0.1:").expect("ip:port").parse().unwrap();
    assert!((21500..=21600).contains(&port), "ASCEND_BASE_PORT 21000 + physical 5 x 100 + [0, 100]: {port}");
    assert!(!r.device_ip.is_empty(), "direct HCCL runs too (auto): its fields are published");
    assert_eq!(d.buffers[0].device_id, Some(5), "the ACL device id, as aclrtGetDevice answers");

    let before = stats();
    // a reads b's second half into its first half; b writes its first 64 KiB into a's end.
    transfer(&rt, &a, &b, Opcode::Read, ma.addr(), mb.addr() + REGION / 2, 1 << 20).unwrap();
    transfer(&rt, &b, &a, Opcode::Write, mb.addr(), ma.addr() + REGION - 65536, 65536).unwrap();
    let half = REGION as usize / 2;
    assert_eq!(bytes(&ma, 0, 1 << 20), pattern(2, REGION as usize)[half..half + (1 << 20)]);
    assert_eq!(bytes(&ma, REGION as usize - 65536, 65536), pattern(2, 65536));
    assert_eq!(bytes(&ma, 1 << 20, 4096), pattern(1, REGION as usize)[1 << 20..(1 << 20) + 4096], "untouched");
    let s = stats();
    assert_eq!(s.hixl_transfers - before.hixl_transfers, 2, "{s:?}");
    assert_eq!(s.one_sided_batches, before.one_sided_batches, "no direct HCCL: {s:?}");
    assert_eq!(s.hixl_failed_attempts, 0, "{s:?}");
    shutdown(&rt, vec![a, b]);
}

/// HIXL links do not reach memory registered after they were made: the first transfer to a
/// region the peer registered later fails, the link is dropped, the descriptor read again and
/// the retry reaches it. Memory registered on this side re-makes this side's links before use.
#[test]
fn memory_registered_after_a_link_is_reached_after_one_refresh() {
    const NAME: &str = "memory_registered_after_a_link_is_reached_after_one_refresh";
    if !in_child(NAME, 71, Libs::WithHixl, true, &[]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, _devices } = pair(&rt, &lib, ["ascend", "ascend"]);
    transfer(&rt, &a, &b, Opcode::Read, ma.addr(), mb.addr(), 4096).unwrap();
    let connects = stats().hixl_connects;

    let mb2 = Device::bind(&lib, 5).unwrap().alloc_huge(REGION as usize).unwrap();
    mb2.write(0, &pattern(3, REGION as usize)).unwrap();
    register(&rt, &b, &mb2, 5);
    let target = rt.block_on(a.open_segment(b.segment_name())).unwrap();
    rt.block_on(a.refresh_segment(target)).unwrap();
    transfer(&rt, &a, &b, Opcode::Read, ma.addr(), mb2.addr() + 100, 4096).unwrap();
    assert_eq!(bytes(&ma, 0, 4096), pattern(3, REGION as usize)[100..4196]);
    let s = stats();
    assert_eq!(s.hixl_failed_attempts, 1, "the old link could not reach the new region: {s:?}");
    assert!(s.hixl_connects > connects, "a new link: {s:?}");

    let ma2 = Device::bind(&lib, 4).unwrap().alloc_huge(REGION as usize).unwrap();
    register(&rt, &a, &ma2, 4);
    transfer(&rt, &a, &b, Opcode::Read, ma2.addr(), mb2.addr(), 4096).unwrap();
    assert_eq!(bytes(&ma2, 0, 4096), pattern(3, 4096));
    assert_eq!(stats().hixl_failed_attempts, 1, "a local registration re-makes the link before use");
    shutdown(&rt, vec![a, b]);
}

/// Unregistering disconnects this engine's links first, then deregisters (Mooncake's order);
/// the initiator can unregister right after a transfer, and memory is reached again once
/// registered again.
#[test]
fn unregistering_disconnects_first() {
    const NAME: &str = "unregistering_disconnects_first";
    if !in_child(NAME, 72, Libs::WithHixl, true, &[]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, _devices } = pair(&rt, &lib, ["ascend", "ascend"]);
    transfer(&rt, &a, &b, Opcode::Read, ma.addr(), mb.addr(), 4096).unwrap();
    rt.block_on(a.unregister_memory(ma.addr())).unwrap_or_else(|e| panic!("unregistering on a: {e}"));
    register(&rt, &a, &ma, 4);
    transfer(&rt, &a, &b, Opcode::Read, ma.addr(), mb.addr() + 4096, 4096).unwrap();
    assert_eq!(bytes(&ma, 0, 4096), pattern(2, 8192)[4096..]);
    // b's side of the pair: b first drops its own client links (HIXL's client/server mode, which
    // both engines chose as Mooncake does because GetCapability reports it, refuses
    // DeregisterMem while the engine's own clients exist, `hixl_engine.cc`), so its
    // unregistering succeeds though a is still linked to b...
    let (_db2, mb2) = device_region(&lib, 5, 4);
    register(&rt, &b, &mb2, 5);
    transfer(&rt, &b, &a, Opcode::Read, mb2.addr(), ma.addr(), 4096).unwrap();
    rt.block_on(b.unregister_memory(mb.addr())).unwrap_or_else(|e| panic!("unregistering on b: {e}"));
    // ...and a's next read of the region b let go fails (after the refresh and retry) instead of
    // reaching memory b's owner may free.
    let e = transfer(&rt, &a, &b, Opcode::Read, ma.addr(), mb.addr(), 4096).expect_err("b deregistered it");
    assert!(e.to_string().contains("HIXL"), "{e}");
    shutdown(&rt, vec![a, b]);
}

/// A peer that does not answer fails the transfer at the transfer timeout (HIXL's
/// `TransferSync` is given what is left of it), as a timeout.
#[test]
fn a_stalled_peer_fails_at_the_transfer_timeout() {
    const NAME: &str = "a_stalled_peer_fails_at_the_transfer_timeout";
    let env = [("FERRY_TRANSFER_TIMEOUT_MS", "1500"), ("FERRY_CANN_EMU_DELAY_US", "hixl.ServeTransfer:5000000")];
    if !in_child(NAME, 73, Libs::WithHixl, true, &env) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, _devices } = pair(&rt, &lib, ["ascend", "ascend"]);
    let start = Instant::now();
    let e = transfer(&rt, &a, &b, Opcode::Read, ma.addr(), mb.addr(), 4096).unwrap_err();
    let took = start.elapsed();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(took < Duration::from_millis(4000), "bounded by the 1.5 s transfer timeout: {took:?}");
    // The transport gives the request back once HIXL's TransferSync (given the same deadline)
    // returned and the link was dropped: the region can then be unregistered, well before the
    // stalled peer answers.
    let deadline = Instant::now() + Duration::from_secs(3);
    while let Err(e) = rt.block_on(a.unregister_memory(ma.addr())) {
        assert!(Instant::now() < deadline, "the timed-out request was never released: {e}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(start.elapsed() < Duration::from_secs(4), "released at the deadline, not when the peer answered");
    let s = stats();
    assert!(s.hixl_failed_attempts >= 1 && s.hixl_transfers == 0, "{s:?}");
    shutdown(&rt, vec![a, b]);
}

/// Without HIXL (a CANN without libllm_datadist.so) the `ascend` protocol falls back to direct
/// HCCL: nothing about HIXL is published and memory moves over HCCL.
#[test]
fn without_hixl_the_node_falls_back_to_direct_hccl() {
    const NAME: &str = "without_hixl_the_node_falls_back_to_direct_hccl";
    if !in_child(NAME, 74, Libs::WithoutHixl, true, &[]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, _devices } = pair(&rt, &lib, ["ascend", "ascend"]);
    let d = b.local_descriptor();
    let r = d.rank_info.as_ref().unwrap();
    assert!(r.endpoints.is_empty(), "no HIXL endpoint: {r:?}");
    assert_eq!(d.buffers[0].device_id, Some(5), "the physical NPU, as before");
    let before = stats();
    transfer(&rt, &a, &b, Opcode::Read, ma.addr(), mb.addr() + 8192, 4096).unwrap();
    assert_eq!(bytes(&ma, 0, 4096), pattern(2, 8192 + 4096)[8192..]);
    let s = stats();
    assert_eq!(s.hixl_transfers, before.hixl_transfers, "{s:?}");
    assert!(s.one_sided_batches > before.one_sided_batches, "direct HCCL moved it: {s:?}");
    shutdown(&rt, vec![a, b]);
}

/// Asking for HIXL alone (protocol `hixl` or `ascend_direct`) where it cannot be loaded is
/// refused at start, naming what was looked for; `hccl` never loads it.
#[test]
fn asking_for_hixl_without_it_is_refused_saying_why() {
    const NAME: &str = "asking_for_hixl_without_it_is_refused_saying_why";
    if !in_child(NAME, 75, Libs::WithoutHixl, true, &[]) {
        return;
    }
    let rt = runtime();
    for protocol in ["hixl", "ascend_direct"] {
        let e = try_engine(&rt, protocol, 4).expect_err("no HIXL here");
        let text = e.to_string();
        assert_eq!(e.kind(), ErrorKind::Config, "{text}");
        assert!(text.contains("HIXL") && text.contains("libllm_datadist.so"), "{text}");
    }
    let e = engine(&rt, "hccl", 4);
    assert!(e.local_descriptor().rank_info.unwrap().endpoints.is_empty());
    shutdown(&rt, vec![e]);
}

/// HIXL alone needs no device IP (HIXL finds its NICs itself): with no hccn.conf the node starts
/// and publishes what Mooncake's ascend_direct publishes; with direct HCCL it would be refused.
#[test]
fn hixl_alone_needs_no_device_ip() {
    const NAME: &str = "hixl_alone_needs_no_device_ip";
    if !in_child(NAME, 76, Libs::WithHixl, false, &[]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, _devices } = pair(&rt, &lib, ["hixl", "ascend"]);
    let r = a.local_descriptor().rank_info.unwrap();
    assert_eq!((r.device_ip.as_str(), r.host_port, r.rank_id, r.device_type), ("", 0, u64::from(u32::MAX), 5), "{r:?}");
    assert_eq!(r.endpoints.len(), 1);
    transfer(&rt, &b, &a, Opcode::Read, mb.addr(), ma.addr() + 4096, 4096).unwrap();
    assert_eq!(bytes(&mb, 0, 4096), pattern(1, 8192)[4096..]);
    shutdown(&rt, vec![a, b]);
    let e = try_engine(&rt, "hccl", 4).expect_err("direct HCCL needs the device IP");
    assert!(e.to_string().contains("device IP"), "{e}");
}
