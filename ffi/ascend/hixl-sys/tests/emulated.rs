//! `ferry-hixl-sys` against Ferry's emulated HIXL (`ffi/ascend/cann-emu`): a real `dlopen` of a real
//! library exporting HIXL's mangled entry points, each part played in its own process (see
//! `common`). Build the emulator first: `cargo build -p ferry-cann-emu`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ferry_ascend_runtime::Device;
use ferry_ascend_sys::Library as Acl;
use ferry_hixl_sys::*;

const LONG: Duration = Duration::from_secs(60);

fn lib_from_env() -> std::sync::Arc<HixlLibrary> {
    HixlLibrary::load(&SearchPath::from_env()).unwrap_or_else(|e| panic!("{e}"))
}

/// The options each API is initialized with: HIXL's client/server engine (`LocalCommRes`
/// version 1.3, a JSON value with quotes) for `hixl::`, the legacy engine with the `adxl.`
/// prefixed key for `adxl::`; no AutoConnect, so a missing link is `NOT_CONNECTED`.
fn options(api: HixlApi) -> Vec<(&'static str, &'static str)> {
    match api {
        HixlApi::Hixl => vec![("LocalCommRes", r#"{"version":"1.3"}"#), ("AutoConnect", "0"), ("BufferPool", "0:0")],
        HixlApi::Adxl => vec![("AutoConnect", "0"), ("adxl.BufferPool", "0:0")],
    }
}

// ---------------------------------------------------------------------------------------------
// Loading

#[test]
fn the_api_follows_ferry_hixl_api() {
    if role().is_some() {
        match HixlLibrary::load(&SearchPath::from_env()) {
            Ok(lib) => {
                say(&format!("loaded {lib} async={} capability_query={}", lib.has_async(), lib.has_capability_query()))
            }
            Err(e) => say(&format!("error {}", e.to_string().replace('\n', " | "))),
        }
        return;
    }
    let dir = emu_dir();
    let d = dir.path().display().to_string();
    let test = "the_api_follows_ferry_hixl_api";
    for (choice, class, file) in [
        (None, "hixl::Hixl", "libcann_hixl.so"),
        (Some("auto"), "hixl::Hixl", "libcann_hixl.so"),
        (Some("hixl"), "hixl::Hixl", "libcann_hixl.so"),
        (Some("adxl"), "adxl::AdxlEngine", "libllm_datadist.so"),
    ] {
        let mut envs = vec![("FERRY_ASCEND_LIB_DIR", d.as_str())];
        envs.extend(choice.map(|c| ("FERRY_HIXL_API", c)));
        let line = run_child(test, "load", &envs, "");
        assert_eq!(line, format!("loaded {class} ({d}/{file}) async=true capability_query=true"), "{choice:?}");
    }
    let line = run_child(test, "load", &[("FERRY_ASCEND_LIB_DIR", &d), ("FERRY_HIXL_API", "rdma")], "");
    assert_eq!(line, "error FERRY_HIXL_API=\"rdma\" is not one of hixl, adxl, auto");
}

#[test]
fn without_libcann_hixl_the_default_is_adxl_and_the_override_says_what_is_missing() {
    if role().is_some() {
        match HixlLibrary::load(&SearchPath::from_env()) {
            Ok(lib) => say(&format!("loaded {lib}")),
            Err(e) => say(&format!("error {}", e.to_string().replace('\n', " | "))),
        }
        return;
    }
    let dir = emu_dir();
    std::fs::remove_file(dir.path().join("libcann_hixl.so")).unwrap();
    let d = dir.path().display().to_string();
    let test = "without_libcann_hixl_the_default_is_adxl_and_the_override_says_what_is_missing";
    let line = run_child(test, "load", &[("FERRY_ASCEND_LIB_DIR", &d)], "");
    assert_eq!(line, format!("loaded adxl::AdxlEngine ({d}/libllm_datadist.so)"));
    let line = run_child(test, "load", &[("FERRY_ASCEND_LIB_DIR", &d), ("FERRY_HIXL_API", "hixl")], "");
    assert!(line.starts_with("error HIXL could not be loaded (FERRY_HIXL_API=hixl;"), "{line}");
    assert!(line.contains(&format!("{d}/libcann_hixl.so (FERRY_ASCEND_LIB_DIR): no such file")), "{line}");
    assert!(line.contains("libcann_hixl.so (dynamic loader search path): cannot be loaded"), "{line}");
    assert!(!line.contains("libllm_datadist.so"), "only the chosen API is tried: {line}");
}

// ---------------------------------------------------------------------------------------------
// Two processes: a server engine with registered device memory, a client that reads and writes it

const LEN: usize = 256 * 1024;

fn two_processes(api: HixlApi, test: &str) {
    let dir = emu_dir();
    let d = dir.path().display().to_string();
    let api_env = match api {
        HixlApi::Hixl => "hixl",
        HixlApi::Adxl => "adxl",
    };
    let port = free_port().to_string();
    let base = [("FERRY_ASCEND_LIB_DIR", d.as_str()), ("FERRY_HIXL_API", api_env)];
    let mut server_env = base.to_vec();
    server_env.push(("T_PORT", &port));
    let mut server = Peer::spawn(test, "server", &server_env);
    let ready = server.expect("ready ", LONG);
    let (remote, raddr) = ready.split_once(' ').expect("ready <name> <addr>");
    let mut client_env = base.to_vec();
    client_env.extend([("T_REMOTE", remote), ("T_RADDR", raddr)]);
    let mut client = Peer::spawn(test, "client", &client_env);
    let summary = client.expect("client done", LONG);
    client.finish(LONG);
    server.send("check");
    server.expect("checked", LONG);
    server.send("quit");
    server.expect("server done", LONG);
    server.finish(LONG);
    eprintln!("{api}: {summary}");
}

fn play(api: HixlApi) {
    match role().as_deref() {
        Some("server") => server(api),
        Some("client") => client(api),
        r => panic!("unknown role {r:?}"),
    }
}

fn server(api: HixlApi) {
    let acl = Acl::load().unwrap();
    let dev = Device::bind(&acl, 0).unwrap();
    let buf = dev.alloc(LEN).unwrap();
    buf.write(0, &pattern(1, 0, LEN)).unwrap();
    let lib = lib_from_env();
    assert_eq!(lib.api(), api);
    let mut engine = HixlEngine::new(lib).unwrap();
    let name = format!("127.0.0.1:{}", env("T_PORT"));
    engine.initialize(&name, &options(api)).unwrap();
    // SAFETY: `buf` outlives the registration (deregistered below, before it is freed).
    let handle = unsafe { engine.register_mem(buf.addr() as usize, LEN, MemType::Device) }.unwrap();
    say(&format!("ready {name} {:#x}", buf.addr()));
    if hear("") == "check" {
        let mut got = vec![0u8; LEN];
        buf.read(0, &mut got).unwrap();
        let half = LEN / 2;
        assert_bytes("the server's first half (never written)", &got[..half], &pattern(1, 0, half));
        assert_bytes("the server's second half (written by the client)", &got[half..], &pattern(2, 0, half));
        say("checked");
        hear("quit");
    }
    engine.deregister_mem(&handle).unwrap();
    engine.finalize();
    assert!(!engine.is_initialized());
    say("server done");
}

fn client(api: HixlApi) {
    let acl = Acl::load().unwrap();
    let dev = Device::bind(&acl, 1).unwrap();
    let buf = dev.alloc(LEN).unwrap();
    buf.write(0, &vec![0u8; LEN]).unwrap();
    let lib = lib_from_env();
    let mut engine = HixlEngine::new(lib.clone()).unwrap();
    // A client-only engine: no port.
    engine.initialize("127.0.0.1", &options(api)).unwrap();
    let local = buf.addr() as usize;
    // SAFETY: `buf` outlives the registration (deregistered below).
    let handle = unsafe { engine.register_mem(local, LEN, MemType::Device) }.unwrap();
    let remote = env("T_REMOTE");
    let raddr = usize::from_str_radix(env("T_RADDR").trim_start_matches("0x"), 16).unwrap();
    let half = LEN / 2;
    let whole = [TransferOpDesc { local_addr: local, remote_addr: raddr, len: LEN }];
    let read = |descs: &[TransferOpDesc]| {
        // SAFETY: every local range lies in `buf`, registered above; nothing else touches it.
        unsafe { engine.transfer_sync(&remote, TransferOp::Read, descs, 5000) }
    };

    // No link yet, and no AutoConnect.
    let e = read(&whole).unwrap_err();
    assert!(e.is_not_connected(), "{e}");
    assert_eq!(e.to_string(), format!("{} failed: NOT_CONNECTED (103902)", call_name(api, "TransferSync")));

    engine.connect(&remote, 5000).unwrap();
    let e = engine.connect(&remote, 5000).unwrap_err();
    assert!(e.is_already_connected(), "{e}");
    assert_eq!(e.to_string(), format!("{} failed: ALREADY_CONNECTED (103903)", call_name(api, "Connect")));
    // An empty batch is HIXL's to judge; whatever it answers is passed through.
    let empty = read(&[]).map(|()| "SUCCESS".to_string()).unwrap_or_else(|e| e.to_string());
    // SAFETY: as for `read`.
    let e = unsafe { engine.transfer_sync(&remote, TransferOp::Read, &whole, 0) }.unwrap_err();
    assert!(e.is_param_invalid() && e.status() == Some(Status::PARAM_INVALID), "timeout 0: {e}");

    // READ everything, one descriptor: every byte is the server's pattern.
    read(&whole).unwrap();
    let mut got = vec![0u8; LEN];
    buf.read(0, &mut got).unwrap();
    assert_bytes("READ of the whole region", &got, &pattern(1, 0, LEN));

    // READ in four descriptors, the chunks swapped end for end.
    buf.write(0, &vec![0u8; LEN]).unwrap();
    let q = LEN / 4;
    let swapped: Vec<TransferOpDesc> = (0..4)
        .map(|i| TransferOpDesc { local_addr: local + i * q, remote_addr: raddr + (3 - i) * q, len: q })
        .collect();
    read(&swapped).unwrap();
    buf.read(0, &mut got).unwrap();
    for i in 0..4 {
        assert_bytes(&format!("chunk {i} of the swapped READ"), &got[i * q..(i + 1) * q], &pattern(1, (3 - i) * q, q));
    }

    // Four threads share the engine (`HixlEngine: Sync`), each READing one chunk at once; each
    // binds the client's device first, as a thread calling into CANN must.
    buf.write(0, &vec![0u8; LEN]).unwrap();
    std::thread::scope(|s| {
        for i in 0..4 {
            let (engine, remote, acl) = (&engine, &remote, &acl);
            s.spawn(move || {
                let _dev = Device::bind(acl, 1).unwrap();
                let d = [TransferOpDesc { local_addr: local + i * q, remote_addr: raddr + i * q, len: q }];
                for _ in 0..8 {
                    // SAFETY: each thread's local range is its own chunk of `buf`.
                    unsafe { engine.transfer_sync(remote, TransferOp::Read, &d, 5000) }.unwrap();
                }
            });
        }
    });
    buf.read(0, &mut got).unwrap();
    assert_bytes("READs from four threads", &got, &pattern(1, 0, LEN));

    // WRITE the first local half (pattern 2) over the server's second half.
    buf.write(0, &pattern(2, 0, half)).unwrap();
    let w = [TransferOpDesc { local_addr: local, remote_addr: raddr + half, len: half }];
    // SAFETY: the local range lies in `buf`, registered above.
    unsafe { engine.transfer_sync(&remote, TransferOp::Write, &w, 5000) }.unwrap();

    // The asynchronous path, when exported: READ the server's second half back.
    let mut summary = format!("sync ok; an empty TransferSync: {empty}");
    if lib.has_async() {
        buf.write(half, &vec![0u8; half]).unwrap();
        let a = [TransferOpDesc { local_addr: local + half, remote_addr: raddr + half, len: half }];
        // SAFETY: the local range lies in `buf`, which is not touched until the request is done.
        let mut req = unsafe { engine.transfer_async(&remote, TransferOp::Read, &a) }.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut polls = 0;
        let status = loop {
            polls += 1;
            match engine.poll_transfer(req).unwrap() {
                TransferPoll::Waiting(r) => {
                    assert!(Instant::now() < deadline, "the async READ is still waiting after 10 s");
                    std::thread::sleep(Duration::from_micros(100));
                    req = r;
                }
                TransferPoll::Done(s) => break s,
            }
        };
        assert_eq!(status, TransferStatus::Completed);
        buf.read(half, &mut got[half..]).unwrap();
        assert_bytes("async READ of what was written", &got[half..], &pattern(2, 0, half));
        summary = format!("{summary}; async ok ({polls} polls)");
    }

    engine.disconnect(&remote, 5000).unwrap();
    let e = engine.disconnect(&remote, 5000).unwrap_err();
    assert!(e.is_not_connected(), "{e}");
    assert_eq!(e.to_string(), format!("{} failed: NOT_CONNECTED (103902)", call_name(api, "Disconnect")));
    assert!(read(&whole).unwrap_err().is_not_connected());
    engine.deregister_mem(&handle).unwrap();
    engine.finalize();
    say(&format!("client done {summary}"));
}

/// `hixl::Hixl::<method>` or `adxl::AdxlEngine::<method>`.
fn call_name(api: HixlApi, method: &str) -> String {
    format!("{}::{method}", api.class())
}

#[test]
fn hixl_reads_and_writes_between_two_processes() {
    if role().is_some() {
        return play(HixlApi::Hixl);
    }
    two_processes(HixlApi::Hixl, "hixl_reads_and_writes_between_two_processes");
}

#[test]
fn adxl_reads_and_writes_between_two_processes() {
    if role().is_some() {
        return play(HixlApi::Adxl);
    }
    two_processes(HixlApi::Adxl, "adxl_reads_and_writes_between_two_processes");
}

// ---------------------------------------------------------------------------------------------
// A peer that answers too late

#[test]
fn a_slow_peer_is_a_timeout() {
    let test = "a_slow_peer_is_a_timeout";
    match role().as_deref() {
        Some("server") => return server(HixlApi::Hixl),
        Some("client") => return slow_client(),
        _ => {}
    }
    let dir = emu_dir();
    let d = dir.path().display().to_string();
    let port = free_port().to_string();
    // The emulated server takes 2 s to serve each transfer.
    let mut server = Peer::spawn(
        test,
        "server",
        &[
            ("FERRY_ASCEND_LIB_DIR", &d),
            ("FERRY_HIXL_API", "hixl"),
            ("T_PORT", &port),
            ("FERRY_CANN_EMU_DELAY_US", "hixl.ServeTransfer:2000000"),
        ],
    );
    let ready = server.expect("ready ", LONG);
    let (remote, raddr) = ready.split_once(' ').expect("ready <name> <addr>");
    let line = run_child(
        test,
        "client",
        &[("FERRY_ASCEND_LIB_DIR", &d), ("FERRY_HIXL_API", "hixl"), ("T_REMOTE", remote), ("T_RADDR", raddr)],
        "client done",
    );
    server.send("quit");
    server.expect("server done", LONG);
    server.finish(LONG);
    eprintln!("{line}");
}

fn slow_client() {
    let acl = Acl::load().unwrap();
    let dev = Device::bind(&acl, 1).unwrap();
    let buf = dev.alloc(4096).unwrap();
    let mut engine = HixlEngine::new(lib_from_env()).unwrap();
    engine.initialize("127.0.0.1", &options(HixlApi::Hixl)).unwrap();
    // SAFETY: `buf` outlives the registration (released by `finalize` below).
    let _handle = unsafe { engine.register_mem(buf.addr() as usize, 4096, MemType::Device) }.unwrap();
    let remote = env("T_REMOTE");
    let raddr = usize::from_str_radix(env("T_RADDR").trim_start_matches("0x"), 16).unwrap();
    engine.connect(&remote, 5000).unwrap();
    let d = [TransferOpDesc { local_addr: buf.addr() as usize, remote_addr: raddr, len: 4096 }];
    let start = Instant::now();
    // SAFETY: the local range is `buf`, registered above, which lives until the process ends
    // (the emulated client marks the link broken on a timeout and reads no late answer).
    let e = unsafe { engine.transfer_sync(&remote, TransferOp::Read, &d, 200) }.unwrap_err();
    let took = start.elapsed();
    assert!(e.is_timeout(), "{e}");
    assert_eq!(e.to_string(), "hixl::Hixl::TransferSync failed: TIMEOUT (103901)");
    assert!(took < Duration::from_millis(1900), "the 200 ms timeout took {took:?}");
    let after = engine.disconnect(&remote, 1000).map(|()| "SUCCESS".to_string()).unwrap_or_else(|e| e.to_string());
    engine.finalize();
    say(&format!("client done: {e} after {took:?}; then Disconnect: {after}"));
}

// ---------------------------------------------------------------------------------------------
// Errors without a peer

fn errors_alone(api: HixlApi) {
    let acl = Acl::load().unwrap();
    let dev = Device::bind(&acl, 0).unwrap();
    let buf = dev.alloc(4096).unwrap();
    let lib = lib_from_env();
    assert_eq!(lib.api(), api);
    assert_eq!(lib.capability(FeatureType::AUTO_CONNECT), Some(true));
    let e = lib.capability_value(FeatureType(-1)).unwrap_err();
    assert!(e.is_param_invalid(), "a negative feature: {e}");

    let mut engine = HixlEngine::new(lib.clone()).unwrap();
    // Refused before HIXL is called: not initialized, NUL bytes, an option twice.
    let e = engine.connect("127.0.0.1:1", 1000).unwrap_err();
    assert!(matches!(e, HixlError::InvalidState { .. }), "{e}");
    let e = engine.initialize("127.0.0.1\0:1", &[]).unwrap_err();
    assert!(matches!(e, HixlError::InvalidArgument { .. }) && e.to_string().contains("NUL byte at offset 9"), "{e}");
    let e = engine.initialize("127.0.0.1", &[("AutoConnect", "0"), ("AutoConnect", "1")]).unwrap_err();
    assert!(e.to_string().contains("option \"AutoConnect\" is given twice"), "{e}");
    let e = engine.initialize("127.0.0.1", &[("AutoConnect", "0\0")]).unwrap_err();
    assert!(e.to_string().contains("the value of option \"AutoConnect\""), "{e}");
    // HIXL's own refusal of a bad option value.
    let e = engine.initialize("127.0.0.1", &[("AutoConnect", "yes")]).unwrap_err();
    assert!(e.status() == Some(Status::PARAM_INVALID), "AutoConnect=yes: {e}");
    assert!(!engine.is_initialized());

    let port = free_port();
    engine.initialize(&format!("127.0.0.1:{port}"), &options(api)).unwrap();
    let e = engine.initialize("127.0.0.1", &[]).unwrap_err();
    assert!(matches!(e, HixlError::InvalidState { .. }), "{e}");
    // SAFETY: `buf` outlives the registration (released by `finalize` below).
    let handle = unsafe { engine.register_mem(buf.addr() as usize, 4096, MemType::Device) }.unwrap();
    // SAFETY: a null address is refused by HIXL; nothing is registered.
    let e = unsafe { engine.register_mem(0, 4096, MemType::Device) }.unwrap_err();
    assert!(e.status() == Some(Status::PARAM_INVALID), "a null address: {e}");

    let nobody = format!("127.0.0.1:{}", free_port());
    let e = engine.disconnect(&nobody, 1000).unwrap_err();
    assert_eq!(e.status(), Some(Status::NOT_CONNECTED), "{e}");
    let e = engine.connect(&nobody, 0).unwrap_err();
    assert_eq!(e.status(), Some(Status::PARAM_INVALID), "{e}");
    assert_eq!(e.to_string(), format!("{}::Connect failed: PARAM_INVALID (103900)", api.class()));
    let e = engine.disconnect(&nobody, -5).unwrap_err();
    assert_eq!(e.status(), Some(Status::PARAM_INVALID), "{e}");
    let nothing = engine.connect(&nobody, 500).unwrap_err();
    assert!(nothing.status().is_some(), "connecting to nothing: {nothing}");
    let e = engine.connect("bad\0name", 500).unwrap_err();
    assert!(e.is_param_invalid() && e.status().is_none(), "{e}");
    let d = [TransferOpDesc { local_addr: buf.addr() as usize, remote_addr: 0x1000, len: 16 }];
    // SAFETY: the local range is registered; HIXL refuses the transfer (no link).
    let e = unsafe { engine.transfer_sync(&nobody, TransferOp::Read, &d, 1000) }.unwrap_err();
    assert!(e.is_not_connected(), "{e}");
    if lib.has_async() {
        // SAFETY: as above.
        let e = unsafe { engine.transfer_async(&nobody, TransferOp::Read, &d) }.unwrap_err();
        assert!(e.is_not_connected(), "{e}");
    }

    // A handle of another engine is refused without calling HIXL.
    let mut other = HixlEngine::new(lib).unwrap();
    other.initialize("127.0.0.1", &options(api)).unwrap();
    let e = other.deregister_mem(&handle).unwrap_err();
    assert!(e.to_string().contains("is not this engine's"), "{e}");
    drop(other);
    engine.finalize();
    engine.finalize();
    let e = engine.connect(&nobody, 1000).unwrap_err();
    assert!(matches!(e, HixlError::InvalidState { .. }), "after finalize: {e}");
    say(&format!("errors done; connecting to nothing: {nothing}"));
}

#[test]
fn hixl_errors_carry_hixls_status_names() {
    let test = "hixl_errors_carry_hixls_status_names";
    if role().is_some() {
        return errors_alone(HixlApi::Hixl);
    }
    let dir = emu_dir();
    let d = dir.path().display().to_string();
    let line = run_child(test, "alone", &[("FERRY_ASCEND_LIB_DIR", &d), ("FERRY_HIXL_API", "hixl")], "errors done");
    eprintln!("hixl::Hixl: {line}");
}

#[test]
fn adxl_errors_carry_hixls_status_names() {
    let test = "adxl_errors_carry_hixls_status_names";
    if role().is_some() {
        return errors_alone(HixlApi::Adxl);
    }
    let dir = emu_dir();
    let d = dir.path().display().to_string();
    let line = run_child(test, "alone", &[("FERRY_ASCEND_LIB_DIR", &d), ("FERRY_HIXL_API", "adxl")], "errors done");
    eprintln!("adxl::AdxlEngine: {line}");
}
