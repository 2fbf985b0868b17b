//! Two engines with the `ascend` transport in one process, on emulated cards 4 and 5, against
//! the rules of real CANN the emulator enforces: communicator init and
//! destroy never overlap, memory registered after a communicator was prepared is reached
//! without a failed attempt, a failed build leaves nothing bound, location `*` is asked of the
//! runtime, host memory HCCL cannot register is refused at once with what to do, one range
//! registered by two engines is one HCCL registration, a failure with work in flight aborts
//! the stream and waits before the communicator goes, and a one-sided batch on a ready
//! communicator takes one thread hand-off.
//!
//! Each test runs its body in a child process (the test binary re-executed with
//! `FERRY_HCCL_ENGINES_ROLE`), so the emulator's environment (read once per process) is the
//! test's own. The emulated CANN must be built (`cargo build -p ferry-cann-emu`). Each test's
//! emulated devices live in its own loopback net `127.<net>.0.0/24`, nets 59-69, 77 and 78 here
//! (`hccl_transfer.rs` beside this file uses 21-34, the Python tests 41-46 and the smoke test its own), so
//! suites running at once never share a device endpoint.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{Config, Location, Opcode, TransferEngine, TransferRequest};
use ferry_transport_hccl::runtime::{Device, DeviceBuffer, HostBuffer, PointerKind};
use ferry_transport_hccl::sys::Library;
use ferry_transport_hccl::sys::test_support::{Emulator, TempDir, emulator_lib_dir};
use ferry_transport_hccl::{HcclTransportFactory, stats};

const ROLE: &str = "FERRY_HCCL_ENGINES_ROLE";
const REGION: u64 = 4 << 20;

/// Runs `test` in a child process with `env` (plus an emulated node: CANN library, hccn.conf
/// with loopback device IPs in `127.<net>.0.0/24`); returns true inside the child.
fn in_child(test: &str, net: u8, env: &[(&str, &str)]) -> bool {
    if std::env::var_os(ROLE).is_some() {
        return true;
    }
    run_child(test, net, env);
    false
}

/// Runs `test`'s child (see [`in_child`]) and returns its stdout and stderr.
fn run_child(test: &str, net: u8, env: &[(&str, &str)]) -> String {
    let lib = emulator_lib_dir(Emulator::Current).unwrap_or_else(|e| panic!("{e}"));
    let conf = TempDir::new("ferry-hccn").unwrap();
    let text: String = (0..8).map(|d| format!("address_{d}=127.{net}.0.{}\n", d + 1)).collect();
    std::fs::write(conf.path().join("hccn.conf"), text).unwrap();
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]);
    for var in [
        "LOCAL_RANK",
        "ASCEND_RT_VISIBLE_DEVICES",
        "FERRY_CANN_EMU_FAIL",
        "FERRY_CANN_EMU_DELAY_US",
        "FERRY_CANN_EMU_LOG",
        "FERRY_CANN_EMU_MOUNTED",
        "FERRY_LOCAL_RANK",
        "HCCL_INTRA_ROCE_ENABLE",
        "MOONCAKE_CONFIG_PATH",
    ] {
        cmd.env_remove(var);
    }
    cmd.env(ROLE, "child")
        .env("FERRY_ASCEND_LIB_DIR", lib.path())
        .env("FERRY_HCCN_CONF", conf.path().join("hccn.conf"))
        .env("FERRY_TRANSFER_TIMEOUT_MS", "20000")
        .env("HCCL_CONNECT_TIMEOUT", "20");
    for (k, v) in env {
        cmd.env(k, v);
    }
    // FERRY_TEST_EMU_LOG=1: the children log every emulated call and the transport's debug lines.
    if std::env::var_os("FERRY_TEST_EMU_LOG").is_some() {
        cmd.env("FERRY_CANN_EMU_LOG", "1").env("RUST_LOG", "debug");
    }
    let out = cmd.output().expect("re-running the test binary");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{test} failed in its child process:\n{text}");
    text
}

/// An engine on emulated card `card` (user id = physical id: no visible-devices filter).
fn engine(rt: &tokio::runtime::Runtime, card: u32) -> TransferEngine {
    engine_on(rt, "127.0.0.1", card)
}

/// An engine of host `host` (a loopback address: another "server" than 127.0.0.1).
fn engine_on(rt: &tokio::runtime::Runtime, host: &str, card: u32) -> TransferEngine {
    let mut cfg = Config::from_json_str(
        &format!(r#"{{"local_hostname": "{host}", "metadata_server": "P2PHANDSHAKE", "protocol": "ascend"}}"#),
        None,
    )
    .unwrap();
    cfg.apply_env(|k| std::env::var(k).ok()).unwrap();
    let transports = ferry::TransportRegistry::new().with(Arc::new(HcclTransportFactory::new()));
    rt.block_on(ferry::builder().config(cfg).transports(transports).local_rank(card).build())
        .unwrap_or_else(|e| panic!("engine on card {card}: {e}"))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Device memory on `card` filled with `seed`'s pattern, and the device it was allocated on.
fn device_region(lib: &Arc<Library>, card: u32, seed: u8) -> (Device, DeviceBuffer) {
    let dev = Device::bind(lib, card).unwrap();
    let buf = dev.alloc_huge(REGION as usize).unwrap();
    buf.write(0, &pattern(seed, REGION as usize)).unwrap();
    (dev, buf)
}

/// Two engines on cards 4 and 5, each with one device region (`ma` of pattern 1, `mb` of 2)
/// registered with the locations given.
struct Pair {
    a: TransferEngine,
    b: TransferEngine,
    ma: DeviceBuffer,
    mb: DeviceBuffer,
    _devices: (Device, Device),
}

/// A read of 4 KiB block `k` of `mb` (on `target`) into block `k` of `ma`.
fn block_read(ma: &DeviceBuffer, mb: &DeviceBuffer, target: ferry::SegmentHandle, k: u64) -> TransferRequest {
    TransferRequest {
        opcode: Opcode::Read,
        source: ma.addr() + k * 4096,
        target,
        target_offset: mb.addr() + k * 4096,
        length: 4096,
    }
}

/// Engines on cards 4 (`a`) and 5 (`b`) after one read of `b` by `a` (the communicator is
/// built), and `b`'s segment as `a` opened it.
fn ready_pair(rt: &tokio::runtime::Runtime, lib: &Arc<Library>) -> (Pair, ferry::SegmentHandle) {
    let p = pair(rt, lib, [Location::Npu(4), Location::Npu(5)]);
    read(rt, &p.a, &p.b, p.ma.addr(), p.mb.addr(), 4096);
    let target = rt.block_on(p.a.open_segment(p.b.segment_name())).unwrap();
    (p, target)
}

fn pair(rt: &tokio::runtime::Runtime, lib: &Arc<Library>, at: [Location; 2]) -> Pair {
    let (a, b) = (engine(rt, 4), engine(rt, 5));
    let (da, ma) = device_region(lib, 4, 1);
    let (db, mb) = device_region(lib, 5, 2);
    let [la, lb] = at;
    register(rt, &a, ma.addr(), REGION, la);
    register(rt, &b, mb.addr(), REGION, lb);
    Pair { a, b, ma, mb, _devices: (da, db) }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
}

/// Registers `[addr, addr + len)` with `engine`.
fn register(rt: &tokio::runtime::Runtime, engine: &TransferEngine, addr: u64, len: u64, at: Location) {
    // SAFETY: every region registered by these tests stays allocated until its engine shut down
    // (the buffers are dropped at the end of each test, after `shutdown`).
    rt.block_on(unsafe { engine.register_memory(addr, len, at) }).unwrap();
}

/// Reads `len` bytes at `remote` of `peer` into `local`.
fn read(rt: &tokio::runtime::Runtime, e: &TransferEngine, peer: &TransferEngine, local: u64, remote: u64, len: u64) {
    let target = rt.block_on(e.open_segment(peer.segment_name())).unwrap();
    rt.block_on(e.refresh_segment(target)).unwrap();
    let req = TransferRequest { opcode: Opcode::Read, source: local, target, target_offset: remote, length: len };
    rt.block_on(e.transfer(&[req])).unwrap_or_else(|err| panic!("read of {len} bytes at {remote:#x}: {err}"));
}

fn shutdown(rt: &tokio::runtime::Runtime, engines: Vec<TransferEngine>) {
    for e in engines {
        rt.block_on(e.shutdown()).expect("shutdown");
    }
}

/// 2.2: both engines build their communicators at once (the emulator makes each init take
/// 300 ms, as real HCCL's take long): with one process-wide lock nothing overlaps and no
/// attempt fails.
#[test]
fn two_engines_build_communicators_at_once_without_overlapping_inits() {
    const NAME: &str = "two_engines_build_communicators_at_once_without_overlapping_inits";
    if !in_child(NAME, 61, &[("FERRY_CANN_EMU_DELAY_US", "HcclCommInitClusterInfoMemConfig:300000")]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, .. } = pair(&rt, &lib, [Location::Npu(4), Location::Npu(5)]);
    // Each reads the other's second half into its own first half, at the same time.
    let (pa, pb) = (ma.addr(), mb.addr());
    std::thread::scope(|s| {
        s.spawn(|| read(&rt, &a, &b, pa, pb + REGION / 2, 8192));
        s.spawn(|| read(&rt, &b, &a, pb, pa + REGION / 2, 8192));
    });
    let mut got = vec![0u8; 8192];
    ma.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(2, REGION as usize)[REGION as usize / 2..][..8192]);
    mb.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(1, REGION as usize)[REGION as usize / 2..][..8192]);
    assert_eq!(stats().failed_attempts, 0, "{:?}", stats());
    shutdown(&rt, vec![a, b]);
}

/// 2.3: memory registered after the pair's communicator was prepared (on either side) is
/// reached by the next transfer without a failed attempt.
#[test]
fn memory_registered_after_the_communicator_was_prepared_is_reached_at_once() {
    const NAME: &str = "memory_registered_after_the_communicator_was_prepared_is_reached_at_once";
    if !in_child(NAME, 62, &[]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, .. } = pair(&rt, &lib, [Location::Npu(4), Location::Npu(5)]);
    read(&rt, &a, &b, ma.addr(), mb.addr(), 4096);
    let built = stats().communicators_built;
    // A new region on the target side, then one on the initiator's side (ACL's current device
    // is per thread: bind the card again before allocating on it).
    let mb2 = Device::bind(&lib, 5).unwrap().alloc_huge(REGION as usize).unwrap();
    mb2.write(0, &pattern(3, REGION as usize)).unwrap();
    register(&rt, &b, mb2.addr(), REGION, Location::Npu(5));
    read(&rt, &a, &b, ma.addr(), mb2.addr() + 100, 4096);
    let ma2 = Device::bind(&lib, 4).unwrap().alloc_huge(REGION as usize).unwrap();
    register(&rt, &a, ma2.addr(), REGION, Location::Npu(4));
    read(&rt, &a, &b, ma2.addr(), mb2.addr(), 4096);
    let mut got = vec![0u8; 4096];
    ma.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(3, REGION as usize)[100..4196], "the new remote region");
    ma2.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(3, REGION as usize)[..4096], "into the new local region");
    let s = stats();
    assert_eq!(s.failed_attempts, 0, "{s:?}");
    assert!(s.communicators_built > built, "rebuilt for the new memory: {s:?}");
    shutdown(&rt, vec![a, b]);
}

/// 2.4: a build that fails after binding memory (one rank's Prepare fails) unbinds it and
/// destroys the communicator: the pair builds again and every region unregisters cleanly
/// afterwards. (The other rank waits in its own Prepare until the transfer timeout, as it would
/// on real HCCL, so the first read may time out; the timeout is short here.)
#[test]
fn a_failed_build_leaves_nothing_bound() {
    const NAME: &str = "a_failed_build_leaves_nothing_bound";
    let env = [("FERRY_CANN_EMU_FAIL", "HcclCommPrepare:1:15"), ("FERRY_TRANSFER_TIMEOUT_MS", "3000")];
    if !in_child(NAME, 63, &env) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, .. } = pair(&rt, &lib, [Location::Npu(4), Location::Npu(5)]);
    let target = rt.block_on(a.open_segment(b.segment_name())).unwrap();
    let req =
        TransferRequest { opcode: Opcode::Read, source: ma.addr(), target, target_offset: mb.addr(), length: 4096 };
    // The side whose Prepare failed tears its communicator down; the other side's Prepare waits
    // for it until the (short) timeout, as on real HCCL; then the pair builds again.
    let deadline = Instant::now() + Duration::from_secs(20);
    while let Err(e) = rt.block_on(a.transfer(&[req])) {
        assert!(Instant::now() < deadline, "the pair never recovered: {e}");
    }
    rt.block_on(a.unregister_memory(ma.addr())).unwrap_or_else(|e| panic!("unregistering on a: {e}"));
    rt.block_on(b.unregister_memory(mb.addr())).unwrap_or_else(|e| panic!("unregistering on b: {e}"));
    shutdown(&rt, vec![a, b]);
}

/// 2.1: regions registered with location `*` (what vllm-ascend passes) are placed by
/// `aclrtPointerGetAttributes`: device memory is published as device memory and moved.
#[test]
fn location_any_is_asked_of_the_runtime() {
    const NAME: &str = "location_any_is_asked_of_the_runtime";
    if !in_child(NAME, 64, &[]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, .. } = pair(&rt, &lib, [Location::Any, Location::Any]);
    assert_eq!(b.local_descriptor().buffers[0].device_id, Some(5), "published as device memory of card 5");
    read(&rt, &a, &b, ma.addr(), mb.addr() + 8192, 4096);
    let mut got = vec![0u8; 4096];
    ma.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(2, REGION as usize)[8192..8192 + 4096]);
    assert_eq!(stats().failed_attempts, 0, "{:?}", stats());
    shutdown(&rt, vec![a, b]);
}

/// 2.7 and 2.8: host memory HCCL cannot use is refused at once, saying why and what to do:
/// memory not from `aclrtMallocHost`, and host memory between engines of one server (HCCS IPC
/// shares device memory only). Device transfers of the same engines are not disturbed.
#[test]
fn host_memory_hccl_cannot_use_is_refused_at_once() {
    const NAME: &str = "host_memory_hccl_cannot_use_is_refused_at_once";
    if !in_child(NAME, 65, &[]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, .. } = pair(&rt, &lib, [Location::Npu(4), Location::Npu(5)]);
    let plain = vec![0u8; 65536];
    register(&rt, &a, plain.as_ptr() as u64, plain.len() as u64, Location::Any);
    let pinned: HostBuffer = Device::bind(&lib, 4).unwrap().alloc_host(65536).unwrap();
    register(&rt, &a, pinned.addr(), 65536, Location::Any);
    let target = rt.block_on(a.open_segment(b.segment_name())).unwrap();
    for (what, local, needle) in [
        ("plain host memory", plain.as_ptr() as u64, "aclrtMallocHost"),
        ("pinned host memory to an engine of this server", pinned.addr(), "HCCS IPC"),
    ] {
        let started = Instant::now();
        let req =
            TransferRequest { opcode: Opcode::Read, source: local, target, target_offset: mb.addr(), length: 4096 };
        let err = rt.block_on(a.transfer(&[req])).expect_err(what);
        assert!(err.to_string().contains(needle), "{what}: {err}");
        assert!(started.elapsed() < Duration::from_secs(5), "{what}: refused after {:?}", started.elapsed());
    }
    read(&rt, &a, &b, ma.addr(), mb.addr(), 4096);
    assert_eq!(stats().failed_attempts, 0, "{:?}", stats());
    shutdown(&rt, vec![a, b]);
    drop(plain);
}

/// 2.8 (second half): an ascend engine's host memory comes from `aclrtMallocHost` (the
/// runtime calls it pinned host memory), so HCCL can move it: two engines (RoCE between them,
/// as HCCS IPC carries device memory only) read each other's whole allocation. Freeing it is
/// refused while it is registered, and it outlives its engine.
#[test]
fn engines_allocate_host_memory_hccl_can_move() {
    const NAME: &str = "engines_allocate_host_memory_hccl_can_move";
    if !in_child(NAME, 60, &[("HCCL_INTRA_ROCE_ENABLE", "1")]) {
        return;
    }
    const LEN: usize = 1 << 20;
    let rt = runtime();
    let lib = Library::load().unwrap();
    let (a, b) = (engine(&rt, 4), engine(&rt, 5));
    // Bound after the engines were built (they start on the caller's current device).
    let probe = Device::bind(&lib, 4).unwrap();
    let ma = rt.block_on(a.allocate_host_memory(LEN)).unwrap();
    let mb = rt.block_on(b.allocate_host_memory(LEN)).unwrap();
    for m in [&ma, &mb] {
        assert_eq!(m.origin(), "aclrtMallocHost");
        assert_eq!(probe.pointer_kind(m.addr()).unwrap(), Some(PointerKind::PinnedHost));
        // SAFETY: the allocation owns LEN bytes; nothing else touches them yet.
        let bytes = unsafe { std::slice::from_raw_parts(m.addr() as *const u8, LEN) };
        assert!(bytes.iter().all(|&x| x == 0), "zero-filled");
    }
    // SAFETY: as above.
    unsafe { std::slice::from_raw_parts_mut(mb.addr() as *mut u8, LEN) }.copy_from_slice(&pattern(3, LEN));
    register(&rt, &a, ma.addr(), LEN as u64, Location::Any);
    register(&rt, &b, mb.addr(), LEN as u64, Location::Any);
    read(&rt, &a, &b, ma.addr(), mb.addr(), LEN as u64);
    // SAFETY: the transfer finished; nothing touches the memory now.
    let got = unsafe { std::slice::from_raw_parts(ma.addr() as *const u8, LEN) };
    assert!(got == pattern(3, LEN).as_slice(), "every byte moved");
    assert_eq!(stats().failed_attempts, 0, "{:?}", stats());
    let (ma, busy) = ma.free().expect_err("registered memory is not freed");
    assert_eq!(busy.kind(), ferry::ErrorKind::Busy, "{busy}");
    rt.block_on(a.unregister_memory(ma.addr())).unwrap();
    ma.free().unwrap();
    shutdown(&rt, vec![a, b]);
    // After its engine shut down the memory is still pinned host memory, and is freed on the
    // transport's device thread, which the allocation kept.
    assert_eq!(probe.pointer_kind(mb.addr()).unwrap(), Some(PointerKind::PinnedHost));
    let addr = mb.addr();
    mb.free().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while probe.pointer_kind(addr).unwrap() == Some(PointerKind::PinnedHost) {
        assert!(Instant::now() < deadline, "aclrtFreeHost never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// 2.11: one range registered by two engines of a process on the same card is one HCCL
/// registration (HCCL hands both the same, uncounted handle): the first engine's unregistering
/// does not pull it from under the second. On another card the same range is a registration of
/// its own (HCCL keeps one registry per device).
#[test]
fn one_range_registered_by_two_engines_is_shared() {
    const NAME: &str = "one_range_registered_by_two_engines_is_shared";
    if !in_child(NAME, 66, &[("HCCL_INTRA_ROCE_ENABLE", "1")]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    // a and b on card 4 (two engines of one worker), c on card 5, d on card 6: a talks to c,
    // b to d (two engines of one card cannot be the two ranks of one rank table).
    let (a, b, c, d) = (engine(&rt, 4), engine(&rt, 4), engine(&rt, 5), engine(&rt, 6));
    let (_dc, mc) = device_region(&lib, 5, 3);
    let (_dd, md) = device_region(&lib, 6, 4);
    register(&rt, &c, mc.addr(), REGION, Location::Npu(5));
    register(&rt, &d, md.addr(), REGION, Location::Npu(6));
    let shared: HostBuffer = Device::bind(&lib, 4).unwrap().alloc_host(65536).unwrap();
    register(&rt, &a, shared.addr(), 65536, Location::Any);
    register(&rt, &b, shared.addr(), 65536, Location::Any);
    // The same range on card 5 too: its own registration there.
    register(&rt, &c, shared.addr(), 65536, Location::Any);
    read(&rt, &a, &c, shared.addr(), mc.addr(), 4096);
    read(&rt, &b, &d, shared.addr(), md.addr(), 4096);
    rt.block_on(a.unregister_memory(shared.addr())).unwrap_or_else(|e| panic!("a lets go of the shared range: {e}"));
    read(&rt, &b, &d, shared.addr(), md.addr() + 4096, 4096);
    let got = unsafe_read(&shared, 4096);
    assert_eq!(got, pattern(4, REGION as usize)[4096..8192], "b still reads into the range a let go of");
    rt.block_on(b.unregister_memory(shared.addr())).unwrap_or_else(|e| panic!("b lets go of it too: {e}"));
    rt.block_on(c.unregister_memory(shared.addr())).unwrap_or_else(|e| panic!("c lets go of its own: {e}"));
    assert_eq!(stats().failed_attempts, 0, "{:?}", stats());
    shutdown(&rt, vec![a, b, c, d]);
}

/// The first `len` bytes of `buf`, read after the transfers into it completed.
fn unsafe_read(buf: &HostBuffer, len: usize) -> Vec<u8> {
    // SAFETY: the buffer is live and no transfer into it is in flight (each read completed).
    unsafe { std::slice::from_raw_parts(buf.addr() as *const u8, len) }.to_vec()
}

/// 2.5: a worker that sees several cards, has set one on the thread that builds the engine (as
/// vLLM and torch_npu do) and exports no `LOCAL_RANK` starts on the card it set. In a container
/// (`FERRY_CANN_EMU_MOUNTED`) the visible-device entries are logical ids: user device 1 here is
/// logical 3, physical 7.
#[test]
fn the_engine_drives_the_device_the_caller_set() {
    const NAME: &str = "the_engine_drives_the_device_the_caller_set";
    if !in_child(NAME, 67, &[("FERRY_CANN_EMU_MOUNTED", "2,3,6,7"), ("ASCEND_RT_VISIBLE_DEVICES", "2,3")]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let dev = Device::bind(&lib, 1).unwrap();
    let mut cfg = Config::from_json_str(
        r#"{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "ascend"}"#,
        None,
    )
    .unwrap();
    cfg.apply_env(|k| std::env::var(k).ok()).unwrap();
    let transports = ferry::TransportRegistry::new().with(Arc::new(HcclTransportFactory::new()));
    // Built on this thread (block_on polls here), with no local rank anywhere.
    let e = rt.block_on(ferry::builder().config(cfg).transports(transports).build()).unwrap();
    let info = e.local_descriptor().rank_info.unwrap();
    assert_eq!((info.device_phy_id, info.device_logic_id), (7, 1), "{info:?}");
    assert_eq!(info.device_ip, "127.67.0.8", "hccn.conf address_7");
    let buf = dev.alloc_huge(REGION as usize).unwrap();
    register(&rt, &e, buf.addr(), REGION, Location::Any);
    assert_eq!(e.local_descriptor().buffers[0].device_id, Some(7));
    shutdown(&rt, vec![e]);
}

/// 2.10: a transfer that fails with work in flight (here: the emulated device takes 3 s, the
/// transfer timeout is 1 s) aborts the stream, waits ADXL's 100 ms for AICPU, unbinds, and only
/// then destroys the communicator. Read from the emulator's call log.
#[test]
fn a_failure_with_work_in_flight_aborts_waits_then_tears_down() {
    const NAME: &str = "a_failure_with_work_in_flight_aborts_waits_then_tears_down";
    let env = [
        ("FERRY_CANN_EMU_DELAY_US", "HcclBatchGet:3000000"),
        ("FERRY_TRANSFER_TIMEOUT_MS", "1000"),
        ("FERRY_HCCL_RETRIES", "0"),
        ("FERRY_CANN_EMU_LOG", "1"),
    ];
    if std::env::var_os(ROLE).is_none() {
        let log = run_child(NAME, 68, &env);
        // `[ferry-cann-emu <pid> <secs>.<micros>] <call>(...) -> <code>`
        let at = |call: &str| -> Vec<f64> {
            log.lines()
                .filter(|l| l.contains(&format!("] {call}(")) && l.contains("-> 0"))
                .filter_map(|l| l.split_whitespace().nth(2)?.trim_end_matches(']').parse().ok())
                .collect()
        };
        let aborted = *at("aclrtStreamAbort").first().unwrap_or_else(|| panic!("no abort in the log:\n{log}"));
        let unbound = at("HcclCommUnbindMem").into_iter().find(|&t| t > aborted).expect("an unbind after the abort");
        let destroyed = at("HcclCommDestroy").into_iter().find(|&t| t > aborted).expect("a destroy after the abort");
        assert!(unbound - aborted >= 0.099, "unbound {:.3} s after the abort returned", unbound - aborted);
        assert!(destroyed >= unbound, "destroyed before unbinding");
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let Pair { a, b, ma, mb, .. } = pair(&rt, &lib, [Location::Npu(4), Location::Npu(5)]);
    let target = rt.block_on(a.open_segment(b.segment_name())).unwrap();
    let req =
        TransferRequest { opcode: Opcode::Read, source: ma.addr(), target, target_offset: mb.addr(), length: 4096 };
    let err = rt.block_on(a.transfer(&[req])).expect_err("the read outlives its timeout");
    assert_eq!(err.kind(), ferry::ErrorKind::Timeout, "{err}");
    // The memory stays leased (unregistering is refused as busy) until the device let go of
    // it: after the abort, the wait and the teardown.
    let deadline = Instant::now() + Duration::from_secs(15);
    while let Err(e) = rt.block_on(a.unregister_memory(ma.addr())) {
        assert_eq!(e.kind(), ferry::ErrorKind::Busy, "{e}");
        assert!(Instant::now() < deadline, "still busy after 15 s: {e}");
        std::thread::sleep(Duration::from_millis(50));
    }
    shutdown(&rt, vec![a, b]);
}

/// 2.6: on Atlas A3 (`aclrtGetSocName` = `Ascend910_93xx`) engines on different servers build a
/// v1.2 rank table with each device's super-pod ids (`aclrtGetDeviceInfo`), which HCCL needs
/// between A3 servers; the ids are published in `rank_info`.
#[test]
fn atlas_a3_servers_use_v12_rank_tables() {
    const NAME: &str = "atlas_a3_servers_use_v12_rank_tables";
    let env = [("FERRY_CANN_EMU_SOC", "Ascend910_9391"), ("FERRY_CANN_EMU_SUPER_DEVICE_BASE", "33554432")];
    if !in_child(NAME, 69, &env) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    // Two servers: 127.0.0.1 and 127.0.0.2 (cross-server rules: RoCE, and v1.2 on A3).
    let (a, b) = (engine_on(&rt, "127.0.0.1", 4), engine_on(&rt, "127.0.0.2", 5));
    let info = b.local_descriptor().rank_info.unwrap();
    assert_eq!(info.super_device_id.as_deref(), Some("33554437"), "{info:?}");
    assert_eq!(info.super_pod_id.as_deref(), Some("0"));
    let (_da, ma) = device_region(&lib, 4, 1);
    let (_db, mb) = device_region(&lib, 5, 2);
    register(&rt, &a, ma.addr(), REGION, Location::Npu(4));
    register(&rt, &b, mb.addr(), REGION, Location::Npu(5));
    read(&rt, &a, &b, ma.addr(), mb.addr() + 4096, 4096);
    let mut got = vec![0u8; 4096];
    ma.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(2, REGION as usize)[4096..8192]);
    assert_eq!(stats().failed_attempts, 0, "{:?}", stats());
    shutdown(&rt, vec![a, b]);
}

/// A caller that waits for its batch on its own thread ([`TransferEngine::transfer_blocking`])
/// with the engine's device context current on that thread (it called `aclrtSetDevice` on the
/// same card, as an inference engine's worker does) runs a one-sided batch itself: no hand-off.
/// Without that context, or through the async API, the batch takes its one hand-off. The
/// emulator refuses HCCL calls from a thread on another device, so a batch run on the wrong
/// thread would fail here.
#[test]
fn a_caller_holding_the_device_context_runs_one_sided_batches_itself() {
    const NAME: &str = "a_caller_holding_the_device_context_runs_one_sided_batches_itself";
    if in_child(NAME, 77, &[]) {
        batches_on_the_caller_thread();
    }
}

/// The same where the release refuses `aclrtStreamQuery` (CANN 8.0 documents it for inference
/// parts only): the caller's thread then waits in the synchronize instead of polling, and
/// nothing else changes.
#[test]
fn without_stream_queries_a_caller_thread_batch_waits_in_the_synchronize() {
    const NAME: &str = "without_stream_queries_a_caller_thread_batch_waits_in_the_synchronize";
    if in_child(NAME, 78, &[("FERRY_CANN_EMU_FAIL", "aclrtStreamQuery:*:207000")]) {
        batches_on_the_caller_thread();
    }
}

/// Runs `batch` (a blocking one, on a thread that now has the engine's device context) until
/// one runs on this thread, at most 100 times. The first ones may still go to the device
/// thread: a hand-off's job completes its batch before it lets go of the thread's state, and
/// this thread may be back before it did (then the batch is handed off too, rather than wait).
/// Once one runs here, the device thread has nothing left to do.
fn until_a_batch_runs_here(batch: impl Fn()) {
    let ran_here = (0..100).any(|_| {
        let was = stats().on_caller_thread;
        batch();
        stats().on_caller_thread > was
    });
    assert!(ran_here, "no batch ran on the caller's thread in 100: {:?}", stats());
}

fn batches_on_the_caller_thread() {
    const BATCHES: u64 = 10;
    let rt = runtime();
    let lib = Library::load().unwrap();
    // `pair` leaves this thread on card 5's context; engine `a` is on card 4.
    let (Pair { a, b, ma, mb, .. }, target) = ready_pair(&rt, &lib);
    let req = |k: u64| block_read(&ma, &mb, target, k);
    let blocking = |k: u64| a.transfer_blocking(&[req(k)]).unwrap_or_else(|e| panic!("read of block {k}: {e}"));
    // The first batch to this open segment may go through the driver (it reads its descriptor).
    blocking(1);

    // Another card's context on this thread: one hand-off per batch.
    let before = stats();
    (0..BATCHES).for_each(|k| blocking(2 + k));
    let after = stats();
    assert_eq!(after.handoffs - before.handoffs, BATCHES, "{before:?} -> {after:?}");
    assert_eq!(after.on_caller_thread, before.on_caller_thread, "{after:?}");

    // Card 4's context on this thread: every batch runs here.
    let _card4 = Device::bind(&lib, 4).unwrap();
    until_a_batch_runs_here(|| blocking(1));
    let before = stats();
    (0..BATCHES).for_each(|k| blocking(2 + BATCHES + k));
    let after = stats();
    assert_eq!(after.one_sided_batches - before.one_sided_batches, BATCHES, "{after:?}");
    assert_eq!(after.on_caller_thread - before.on_caller_thread, BATCHES, "{before:?} -> {after:?}");
    assert_eq!(after.handoffs, before.handoffs, "no hand-off: {before:?} -> {after:?}");
    assert_eq!(after.failed_attempts, 0, "{after:?}");

    // Through the async API (the caller may not block in submit): the hand-off again.
    let before = stats();
    rt.block_on(a.transfer(&[req(2 + 2 * BATCHES)])).unwrap();
    let after = stats();
    assert_eq!(after.handoffs - before.handoffs, 1, "{before:?} -> {after:?}");
    assert_eq!(after.on_caller_thread, before.on_caller_thread, "{after:?}");

    let blocks = (3 + 2 * BATCHES) as usize;
    let mut got = vec![0u8; blocks * 4096];
    ma.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(2, REGION as usize)[..blocks * 4096], "every block arrived");
    shutdown(&rt, vec![a, b]);
}

/// A caller without the device's context that blocks for a one-sided batch (handed to the
/// peer's device thread) sleeps only until just before the batch is expected to end, then polls
/// it, once the engine has timed a batch of its size: the transport marks these batches
/// device-completed. Each `HcclBatchGet` takes 5 ms more here (the emulator's delay), so that
/// the waiter cannot find the batch done before it would sleep. A batch run on the caller's
/// own thread is done when `submit` returns, and nobody polls.
#[test]
fn a_blocking_caller_of_a_handed_off_batch_polls_its_expected_end() {
    const NAME: &str = "a_blocking_caller_of_a_handed_off_batch_polls_its_expected_end";
    const BATCHES: u64 = 10;
    if !in_child(NAME, 68, &[("FERRY_CANN_EMU_DELAY_US", "HcclBatchGet:5000")]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    // `pair` leaves this thread on card 5's context; engine `a` is on card 4.
    let (Pair { a, b, ma, mb, .. }, target) = ready_pair(&rt, &lib);
    let blocking = |k: u64| {
        a.transfer_blocking(&[block_read(&ma, &mb, target, k)]).unwrap_or_else(|e| panic!("read of block {k}: {e}"));
    };
    // The first batch to this open segment may go through the driver (it reads its
    // descriptor); the next one teaches the engine how long a 4 KiB read takes.
    blocking(1);
    blocking(2);
    let (before, handoffs) = (a.stats(), stats().handoffs);
    (0..BATCHES).for_each(|k| blocking(3 + k));
    let after = a.stats();
    assert_eq!(stats().handoffs - handoffs, BATCHES, "{:?}", stats());
    let polls = after.tail_polls - before.tail_polls;
    // A waiter whose timer fires after the batch ended is woken by the completion instead: a
    // host stalled for milliseconds could cost a few polls, not most.
    assert!(polls >= BATCHES / 2, "{polls} tail polls in {BATCHES} handed-off batches: {after:?}");
    assert!(after.tail_polls_caught <= after.tail_polls, "{after:?}");

    // Card 4's context on this thread: the batches run here, done when `submit` returns.
    let _card4 = Device::bind(&lib, 4).unwrap();
    until_a_batch_runs_here(|| blocking(1));
    let (before, here) = (a.stats(), stats().on_caller_thread);
    (0..BATCHES).for_each(|k| blocking(3 + BATCHES + k));
    assert_eq!(stats().on_caller_thread - here, BATCHES, "{:?}", stats());
    assert_eq!(a.stats().tail_polls, before.tail_polls, "nobody waits for a batch run on its own thread");

    let blocks = (3 + 2 * BATCHES) as usize;
    let mut got = vec![0u8; blocks * 4096];
    ma.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(2, REGION as usize)[..blocks * 4096], "every block arrived");
    shutdown(&rt, vec![a, b]);
}

/// A one-sided batch on a ready communicator is queued by the caller's thread on the peer's
/// device thread, which completes it: one hand-off (the transport counts them; no timing). A
/// failure there goes back to the driver task, which rebuilds the communicator and retries, and
/// the batch after that takes one hand-off again.
#[test]
fn a_one_sided_batch_on_a_ready_communicator_takes_one_hand_off() {
    const NAME: &str = "a_one_sided_batch_on_a_ready_communicator_takes_one_hand_off";
    const BATCHES: u64 = 20;
    // HcclBatchGet calls: the first read, the warm-up, the batches, then the one that fails.
    let fail = format!("HcclBatchGet:{}", BATCHES + 3);
    if !in_child(NAME, 59, &[("FERRY_CANN_EMU_FAIL", fail.as_str())]) {
        return;
    }
    let rt = runtime();
    let lib = Library::load().unwrap();
    let (Pair { a, b, ma, mb, .. }, target) = ready_pair(&rt, &lib);
    let read_block = |k: u64| {
        rt.block_on(a.transfer(&[block_read(&ma, &mb, target, k)]))
            .unwrap_or_else(|e| panic!("read of block {k}: {e}"));
    };
    // The first batch to this open segment may go through the driver (it reads its descriptor).
    read_block(1);
    let before = stats();
    for k in 0..BATCHES {
        read_block(2 + k);
    }
    let after = stats();
    assert_eq!(after.one_sided_batches - before.one_sided_batches, BATCHES, "{after:?}");
    assert_eq!(after.handoffs - before.handoffs, BATCHES, "one hand-off per batch: {before:?} -> {after:?}");
    assert_eq!(after.failed_attempts, 0, "{after:?}");

    // The injected failure: the device thread's attempt fails, the driver rebuilds and retries.
    let built = after.communicators_built;
    read_block(2 + BATCHES);
    let s = stats();
    assert_eq!(s.failed_attempts, 1, "{s:?}");
    assert!(s.communicators_built > built, "rebuilt after the failure: {s:?}");
    read_block(3 + BATCHES);
    assert_eq!(stats().handoffs - s.handoffs, 1, "straight to the device thread again: {:?}", stats());

    let blocks = (4 + BATCHES) as usize;
    let mut got = vec![0u8; blocks * 4096];
    ma.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(2, REGION as usize)[..blocks * 4096], "every block arrived");
    shutdown(&rt, vec![a, b]);
}
