//! The rules of HIXL/ADXL the emulated HIXL enforces, one test each, and
//! transfers between two processes with every byte checked. Every rule cites its HIXL source in
//! `docs/ascend.md` ("What the emulated HIXL enforces, and its sources") and beside the code.
//!
//! The tests call the exported entry points themselves (the Rust functions behind the mangled
//! symbols, linked from the crate); `tests/hixl_cxx.rs` drives the built library from a C++
//! program through the mangled names. Cases that need a peer run it as a child process (the
//! test binary re-executed, `tests/common/mod.rs`); cases that read the environment run in a
//! child too.

mod common;

use std::ffi::c_void;
use std::time::{Duration, Instant};

use common::*;
use ferry_cann_emu::hixl::*;
use ferry_cann_emu::*;

const T: Duration = Duration::from_secs(60);

/// Which API a test drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Adxl,
    Hixl,
}

impl Api {
    fn parse(s: &str) -> Api {
        if s == "hixl" { Api::Hixl } else { Api::Adxl }
    }
    fn name(self) -> &'static str {
        match self {
            Api::Adxl => "adxl",
            Api::Hixl => "hixl",
        }
    }
}

/// An engine object as a caller allocates it: 8 bytes.
struct Engine {
    api: Api,
    obj: Box<u64>,
}

impl Engine {
    fn new(api: Api) -> Engine {
        let mut obj = Box::new(0xdead_beef_u64);
        let this = (&mut *obj as *mut u64).cast::<c_void>();
        // SAFETY: `this` is an 8-byte, 8-aligned object that lives as long as `Engine`.
        unsafe {
            match api {
                Api::Adxl => adxl_engine_c1(this),
                Api::Hixl => hixl_c1(this),
            }
        }
        Engine { api, obj }
    }

    fn this(&self) -> *mut c_void {
        (&*self.obj as *const u64).cast_mut().cast()
    }

    fn init(&self, name: &str, opts: &[(&str, &str)]) -> u32 {
        let n = AscendString::new(name);
        let o = OptionMap::new(opts);
        // SAFETY: live engine object, AscendString and map.
        unsafe {
            match self.api {
                Api::Adxl => adxl_engine_initialize(self.this(), n.as_ptr(), o.as_ptr()),
                Api::Hixl => hixl_initialize(self.this(), n.as_ptr(), o.as_ptr()),
            }
        }
    }

    fn finalize(&self) {
        // SAFETY: live engine object.
        unsafe {
            match self.api {
                Api::Adxl => adxl_engine_finalize(self.this()),
                Api::Hixl => hixl_finalize(self.this()),
            }
        }
    }

    fn register_desc(&self, desc: MemDesc, mem_type: i32) -> (u32, *mut c_void) {
        let mut h = std::ptr::null_mut();
        // SAFETY: live engine object and descriptor; `h` is writable.
        let rc = unsafe {
            match self.api {
                Api::Adxl => adxl_engine_register_mem(self.this(), &desc, mem_type, &mut h),
                Api::Hixl => hixl_register_mem(self.this(), &desc, mem_type, &mut h),
            }
        };
        (rc, h)
    }

    fn register(&self, addr: *const c_void, len: usize, mem_type: i32) -> (u32, *mut c_void) {
        self.register_desc(MemDesc::new(addr as usize, len), mem_type)
    }

    fn deregister(&self, h: *mut c_void) -> u32 {
        // SAFETY: live engine object.
        unsafe {
            match self.api {
                Api::Adxl => adxl_engine_deregister_mem(self.this(), h),
                Api::Hixl => hixl_deregister_mem(self.this(), h),
            }
        }
    }

    fn connect(&self, remote: &str, timeout_ms: i32) -> u32 {
        let r = AscendString::new(remote);
        // SAFETY: live engine object and AscendString.
        unsafe {
            match self.api {
                Api::Adxl => adxl_engine_connect(self.this(), r.as_ptr(), timeout_ms),
                Api::Hixl => hixl_connect(self.this(), r.as_ptr(), timeout_ms),
            }
        }
    }

    fn disconnect(&self, remote: &str, timeout_ms: i32) -> u32 {
        let r = AscendString::new(remote);
        // SAFETY: live engine object and AscendString.
        unsafe {
            match self.api {
                Api::Adxl => adxl_engine_disconnect(self.this(), r.as_ptr(), timeout_ms),
                Api::Hixl => hixl_disconnect(self.this(), r.as_ptr(), timeout_ms),
            }
        }
    }

    fn transfer(&self, remote: &str, op: i32, descs: &[TransferOpDesc], timeout_ms: i32) -> u32 {
        let r = AscendString::new(remote);
        let v = DescVec::new(descs);
        // SAFETY: live engine object, AscendString and vector; the local ranges are ours.
        unsafe {
            match self.api {
                Api::Adxl => adxl_engine_transfer_sync(self.this(), r.as_ptr(), op, v.as_ptr(), timeout_ms),
                Api::Hixl => hixl_transfer_sync(self.this(), r.as_ptr(), op, v.as_ptr(), timeout_ms),
            }
        }
    }

    fn transfer_async(&self, remote: &str, op: i32, descs: &[TransferOpDesc]) -> (u32, *mut c_void) {
        let r = AscendString::new(remote);
        let v = DescVec::new(descs);
        let args = TransferArgs::default();
        let mut req = std::ptr::null_mut();
        // SAFETY: live engine object, AscendString, vector and args; `req` writable.
        let rc = unsafe {
            match self.api {
                Api::Adxl => adxl_engine_transfer_async(self.this(), r.as_ptr(), op, v.as_ptr(), &args, &mut req),
                Api::Hixl => hixl_transfer_async(self.this(), r.as_ptr(), op, v.as_ptr(), &args, &mut req),
            }
        };
        (rc, req)
    }

    fn status(&self, req: *mut c_void) -> (u32, i32) {
        let mut st = -1;
        // SAFETY: live engine object; `req` and `st` are locals.
        let rc = unsafe {
            match self.api {
                Api::Adxl => adxl_engine_get_transfer_status(self.this(), &req, &mut st),
                Api::Hixl => hixl_get_transfer_status(self.this(), &req, &mut st),
            }
        };
        (rc, st)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SAFETY: live engine object (D1 finalizes).
        unsafe {
            match self.api {
                Api::Adxl => adxl_engine_d1(self.this()),
                Api::Hixl => hixl_d1(self.this()),
            }
        }
    }
}

#[track_caller]
fn st(code: u32, want: u32, what: &str) {
    assert_eq!(
        code,
        want,
        "{what}: got {code} ({}), want {want} ({}); recent error: {}",
        hixl_status_name(code),
        hixl_status_name(want),
        recent_error()
    );
}

fn host_alloc(len: usize) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-parameter.
    ok(unsafe { aclrtMallocHost(&mut p, len) }, "aclrtMallocHost");
    p
}

fn free_port() -> u16 {
    free_ports().0
}

fn desc(local: usize, remote: usize, len: usize) -> TransferOpDesc {
    TransferOpDesc { local_addr: local, remote_addr: remote, len }
}

// ---- two processes ------------------------------------------------------------------------

const LEN: usize = 1 << 20;

/// The server side of a two-process transfer: exposes `src` (pattern 1) and `dst` (zeros), then
/// checks what the client wrote into `dst` (pattern 2).
fn serve_two_buffers(api: Api, port: u16, opts: &[(&str, &str)], host: bool) {
    set_device(0);
    let e = Engine::new(api);
    st(e.init(&format!("127.0.0.1:{port}"), opts), HIXL_SUCCESS, "server Initialize");
    let (src, dst, kind) = if host {
        (host_alloc(LEN), host_alloc(LEN), HIXL_MEM_HOST)
    } else {
        (dev_alloc(LEN), dev_alloc(LEN), HIXL_MEM_DEVICE)
    };
    let put = |p: *mut c_void, data: &[u8]| {
        if host {
            // SAFETY: `p` is LEN bytes of our host memory.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p.cast::<u8>(), data.len()) }
        } else {
            upload(p, data)
        }
    };
    put(src, &pattern(1, LEN));
    put(dst, &vec![0u8; LEN]);
    st(e.register(src, LEN, kind).0, HIXL_SUCCESS, "register src");
    st(e.register(dst, LEN, kind).0, HIXL_SUCCESS, "register dst");
    say(&format!("ready {} {}", src as usize, dst as usize));
    hear_expect("check");
    let got = if host {
        // SAFETY: `dst` is LEN bytes of our host memory.
        unsafe { std::slice::from_raw_parts(dst.cast::<u8>(), LEN) }.to_vec()
    } else {
        download(dst, LEN)
    };
    let want = pattern(2, LEN);
    let bad = got.iter().zip(&want).position(|(a, b)| a != b);
    say(&format!("checked {bad:?}"));
    hear_expect("bye");
    e.finalize();
}

/// The client side: reads `src` into its buffer (checks pattern 1), writes pattern 2 into `dst`.
fn read_and_write(api: Api, server: &str, opts: &[(&str, &str)], connect: bool, src: usize, dst: usize) {
    set_device(0);
    let e = Engine::new(api);
    st(e.init("127.0.0.1", opts), HIXL_SUCCESS, "client Initialize");
    let mine = dev_alloc(LEN);
    let out = dev_alloc(LEN);
    upload(out, &pattern(2, LEN));
    st(e.register(mine, LEN, HIXL_MEM_DEVICE).0, HIXL_SUCCESS, "register local");
    st(e.register(out, LEN, HIXL_MEM_DEVICE).0, HIXL_SUCCESS, "register local out");
    if connect {
        st(e.connect(server, 5000), HIXL_SUCCESS, "Connect");
    }
    // Two descriptors per batch, in two halves, to check offsets.
    let half = LEN / 2;
    let r = [desc(mine as usize, src, half), desc(mine as usize + half, src + half, half)];
    st(e.transfer(server, HIXL_READ, &r, 5000), HIXL_SUCCESS, "TransferSync READ");
    assert_eq!(download(mine, LEN), pattern(1, LEN), "READ moved the server's bytes");
    let w = [desc(out as usize, dst, half), desc(out as usize + half, dst + half, half)];
    st(e.transfer(server, HIXL_WRITE, &w, 5000), HIXL_SUCCESS, "TransferSync WRITE");
    if connect {
        st(e.disconnect(server, 1000), HIXL_SUCCESS, "Disconnect");
    }
    e.finalize();
}

fn two_process_case(test: &str, api: Api, opts: &str, connect: bool, host: bool) {
    match role().as_deref() {
        Some("server") => {
            let port: u16 = std::env::var("HX_PORT").unwrap().parse().unwrap();
            let api = Api::parse(&std::env::var("HX_API").unwrap());
            let opts = std::env::var("HX_OPTS").unwrap();
            serve_two_buffers(api, port, &parse_opts(&opts), std::env::var("HX_HOST").is_ok_and(|v| v == "1"));
        }
        Some("client") => {
            let api = Api::parse(&std::env::var("HX_API").unwrap());
            let opts = std::env::var("HX_OPTS").unwrap();
            let server = std::env::var("HX_SERVER").unwrap();
            let a = hear_expect("addrs");
            let mut it = a.split_whitespace().map(|x| x.parse::<usize>().unwrap());
            let (src, dst) = (it.next().unwrap(), it.next().unwrap());
            read_and_write(api, &server, &parse_opts(&opts), connect, src, dst);
            say("done");
        }
        Some(_) => {}
        None => {
            let port = free_port().to_string();
            let server_name = format!("127.0.0.1:{port}");
            let base = [
                ("HX_API", api.name()),
                ("HX_OPTS", opts),
                ("HX_PORT", port.as_str()),
                ("HX_HOST", if host { "1" } else { "0" }),
            ];
            let mut s = Peer::spawn(test, "server", &base);
            let ready = s.expect("ready", T);
            let mut c = Peer::spawn(test, "client", &[base[0], base[1], ("HX_SERVER", server_name.as_str())]);
            c.send(&format!("addrs {ready}"));
            c.expect("done", T);
            c.finish(T);
            s.send("check");
            assert_eq!(s.expect("checked", T), "None", "the server's dst holds the client's bytes");
            s.send("bye");
            s.finish(T);
        }
    }
}

/// `k=v;k=v` → pairs.
fn parse_opts(s: &str) -> Vec<(&str, &str)> {
    s.split(';').filter(|p| !p.is_empty()).map(|p| p.split_once('=').unwrap()).collect()
}

const CS: &str = r#"adxl.LocalCommRes={"version":"1.3"};adxl.BufferPool=0:0"#;

#[test]
fn adxl_read_and_write_between_two_processes() {
    two_process_case(
        "adxl_read_and_write_between_two_processes",
        Api::Adxl,
        "AutoConnect=0;adxl.BufferPool=0:0",
        true,
        false,
    );
}

#[test]
fn hixl_read_and_write_between_two_processes() {
    two_process_case("hixl_read_and_write_between_two_processes", Api::Hixl, "AutoConnect=0", true, false);
}

#[test]
fn client_server_mode_with_auto_connect_moves_host_memory() {
    two_process_case(
        "client_server_mode_with_auto_connect_moves_host_memory",
        Api::Adxl,
        &format!("{CS};AutoConnect=1"),
        false,
        true,
    );
}

#[test]
fn get_capability_answers_before_initialize() {
    let mut v = -1;
    // SAFETY: `v` is writable.
    st(unsafe { adxl_engine_get_capability(HIXL_FEATURE_AUTO_CONNECT, &mut v) }, HIXL_SUCCESS, "AUTO_CONNECT");
    assert_eq!(v, 1);
    // SAFETY: as above.
    st(unsafe { hixl_get_capability(HIXL_FEATURE_CLIENT_SERVER_COMM, &mut v) }, HIXL_SUCCESS, "CS");
    assert_eq!(v, 1);
    // SAFETY: as above.
    st(unsafe { hixl_get_capability(7, &mut v) }, HIXL_SUCCESS, "unknown");
    assert_eq!(v, 0);
    // SAFETY: as above.
    st(unsafe { adxl_engine_get_capability(-1, &mut v) }, HIXL_PARAM_INVALID, "negative");
}

// ---- one process, two engines ------------------------------------------------------------

/// A server engine with one registered device buffer (pattern 1) and a client engine with one
/// registered device buffer (zeros), in this process.
struct Pair {
    server: Engine,
    client: Engine,
    server_name: String,
    remote: *mut c_void,
    remote_handle: *mut c_void,
    local: *mut c_void,
    local_handle: *mut c_void,
}

const PLEN: usize = 64 << 10;

fn pair(api: Api, server_opts: &[(&str, &str)], client_opts: &[(&str, &str)]) -> Pair {
    set_device(0);
    let server = Engine::new(api);
    let server_name = format!("127.0.0.1:{}", free_port());
    st(server.init(&server_name, server_opts), HIXL_SUCCESS, "server Initialize");
    let remote = dev_alloc(PLEN);
    upload(remote, &pattern(1, PLEN));
    let (rc, remote_handle) = server.register(remote, PLEN, HIXL_MEM_DEVICE);
    st(rc, HIXL_SUCCESS, "server RegisterMem");
    let client = Engine::new(api);
    st(client.init("127.0.0.1", client_opts), HIXL_SUCCESS, "client Initialize");
    let local = dev_alloc(PLEN);
    let (rc, local_handle) = client.register(local, PLEN, HIXL_MEM_DEVICE);
    st(rc, HIXL_SUCCESS, "client RegisterMem");
    Pair { server, client, server_name, remote, remote_handle, local, local_handle }
}

impl Pair {
    fn read_all(&self) -> Vec<TransferOpDesc> {
        vec![desc(self.local as usize, self.remote as usize, PLEN)]
    }
}

#[test]
fn transfer_async_completes_once_then_the_request_is_gone() {
    for api in [Api::Adxl, Api::Hixl] {
        let p = pair(api, &[("AutoConnect", "1")], &[("AutoConnect", "1")]);
        let (rc, req) = p.client.transfer_async(&p.server_name, HIXL_READ, &p.read_all());
        st(rc, HIXL_SUCCESS, "TransferAsync");
        assert!(!req.is_null());
        let deadline = Instant::now() + Duration::from_secs(10);
        let last = loop {
            let (rc, s) = p.client.status(req);
            st(rc, HIXL_SUCCESS, "GetTransferStatus");
            assert!(s == HIXL_STATUS_WAITING || s == HIXL_STATUS_COMPLETED, "status {s}");
            if s != HIXL_STATUS_WAITING || Instant::now() > deadline {
                break s;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(last, HIXL_STATUS_COMPLETED);
        assert_eq!(download(p.local, PLEN), pattern(1, PLEN));
        // Released after COMPLETED: asking again is refused, and the status reads FAILED.
        let (rc, s) = p.client.status(req);
        st(rc, HIXL_PARAM_INVALID, "GetTransferStatus of a released request");
        assert_eq!(s, HIXL_STATUS_FAILED);
        // A null request is FAILED.
        let (rc, s) = p.client.status(std::ptr::null_mut());
        st(rc, HIXL_FAILED, "GetTransferStatus(nullptr)");
        assert_eq!(s, HIXL_STATUS_FAILED);
        st(p.client.disconnect(&p.server_name, 1000), HIXL_SUCCESS, "Disconnect");
        st(p.client.deregister(p.local_handle), HIXL_SUCCESS, "DeregisterMem");
        st(p.server.deregister(p.remote_handle), HIXL_SUCCESS, "server DeregisterMem");
    }
}

/// Runs `test`'s body in a child with `envs` (the emulator reads its environment once).
fn in_child(test: &str, envs: &[(&str, &str)], body: impl FnOnce()) -> Option<String> {
    match role().as_deref() {
        Some("main") => {
            body();
            None
        }
        Some(_) => None,
        None => Some(run_child(test, "main", envs, T).1),
    }
}

fn both(f: impl Fn(Api)) {
    for api in [Api::Adxl, Api::Hixl] {
        f(api);
    }
}

const NO_POOL: (&str, &str) = ("adxl.BufferPool", "0:0");
const CS_RES: (&str, &str) = ("adxl.LocalCommRes", r#"{"version":"1.3"}"#);

// ---- Initialize ---------------------------------------------------------------------------

#[test]
fn initialize_accepts_ip_ip_port_and_bracketed_ipv6_names() {
    both(|api| {
        set_device(0);
        let client = Engine::new(api);
        st(client.init("127.0.0.1", &[]), HIXL_SUCCESS, "ip only: a client");
        let v6 = Engine::new(api);
        let v6_name = format!("[::1]:{}", free_port());
        st(v6.init(&v6_name, &[]), HIXL_SUCCESS, "[ipv6]:port");
        let remote = dev_alloc(4096);
        st(v6.register(remote, 4096, HIXL_MEM_DEVICE).0, HIXL_SUCCESS, "register on the v6 server");
        st(client.connect(&v6_name, 2000), HIXL_SUCCESS, "connect to [::1]:port");
        st(Engine::new(api).init("[::1]", &[]), HIXL_SUCCESS, "[ipv6] without a port");
        for bad in ["", "localhost:1", "1.2.3.4:x", "::1", "1.2.3.4:1:2"] {
            st(Engine::new(api).init(bad, &[]), HIXL_PARAM_INVALID, &format!("name {bad:?}"));
        }
    });
}

#[test]
fn a_port_makes_a_listening_server_and_finalize_closes_it_idempotently() {
    both(|api| {
        set_device(0);
        let port = free_port();
        let e = Engine::new(api);
        st(e.init(&format!("127.0.0.1:{port}"), &[]), HIXL_SUCCESS, "Initialize");
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(), "the engine listens on its port");
        e.finalize();
        e.finalize();
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "Finalize closed the port");
        // After Finalize calls fail as before Initialize.
        st(e.connect("127.0.0.1:1", 100), HIXL_FAILED, "Connect after Finalize");
        // The destructor finalizes too.
        let port = free_port();
        {
            let d = Engine::new(api);
            st(d.init(&format!("127.0.0.1:{port}"), &[]), HIXL_SUCCESS, "Initialize");
        }
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "the destructor closed the port");
    });
}

#[test]
fn initialize_needs_a_device_on_the_calling_thread() {
    both(|api| {
        let code = std::thread::spawn(move || Engine::new(api).init("127.0.0.1", &[])).join().unwrap();
        assert_eq!(code, ACL_ERROR_RT_CONTEXT_NULL as u32, "ACL's error passes through");
    });
}

#[test]
fn auto_connect_must_be_zero_or_one() {
    both(|api| {
        set_device(0);
        for ok_value in ["0", "1"] {
            st(Engine::new(api).init("127.0.0.1", &[("AutoConnect", ok_value)]), HIXL_SUCCESS, ok_value);
        }
        for bad in ["", "2", "true", "-1"] {
            st(Engine::new(api).init("127.0.0.1", &[("AutoConnect", bad)]), HIXL_PARAM_INVALID, &format!("{bad:?}"));
        }
    });
}

#[test]
fn options_are_checked_as_hixl_checks_them() {
    both(|api| {
        set_device(0);
        let init = |opts: &[(&str, &str)]| Engine::new(api).init("127.0.0.1", opts);
        st(init(&[("Unknown", "1")]), HIXL_PARAM_INVALID, "an unknown key");
        st(init(&[("adxl.BufferPool", "4")]), HIXL_PARAM_INVALID, "BufferPool without a size");
        st(init(&[("BufferPool", "0:8")]), HIXL_PARAM_INVALID, "BufferPool with 0 buffers");
        st(init(&[("BufferPool", "2:16")]), HIXL_SUCCESS, "BufferPool 2:16");
        st(init(&[CS_RES, ("BufferPool", "4:8")]), HIXL_PARAM_INVALID, "CS mode accepts only 0:0");
        st(init(&[CS_RES, NO_POOL]), HIXL_SUCCESS, "CS mode with 0:0");
        st(init(&[("LocalCommRes", "{not json")]), HIXL_PARAM_INVALID, "LocalCommRes that is not JSON");
        st(init(&[("GlobalResourceConfig", "[1]")]), HIXL_PARAM_INVALID, "GlobalResourceConfig not an object");
        st(init(&[("EnableUseFabricMem", "1")]), HIXL_UNSUPPORTED, "FabricMemEngine is not modelled");
        st(init(&[CS_RES, ("EnableUseFabricMem", "0")]), HIXL_PARAM_INVALID, "the CS engine rejects the key");
        st(init(&[("adxl.RdmaTrafficClass", "6")]), HIXL_PARAM_INVALID, "traffic class not a multiple of 4");
        st(init(&[("adxl.RdmaServiceLevel", "8")]), HIXL_PARAM_INVALID, "service level above 7");
    });
}

#[test]
fn initialize_twice_replaces_adxl_and_keeps_a_listening_hixl() {
    set_device(0);
    let name = format!("127.0.0.1:{}", free_port());
    // adxl: the impl is replaced before the new one initializes, so the port is free again.
    let a = Engine::new(Api::Adxl);
    st(a.init(&name, &[]), HIXL_SUCCESS, "adxl first");
    st(a.init(&name, &[]), HIXL_SUCCESS, "adxl again on the same port");
    // hixl: the new impl must initialize while the old one still listens: the port is taken.
    let name = format!("127.0.0.1:{}", free_port());
    let h = Engine::new(Api::Hixl);
    st(h.init(&name, &[]), HIXL_SUCCESS, "hixl first");
    let mem = dev_alloc(4096);
    upload(mem, &pattern(9, 4096));
    st(h.register(mem, 4096, HIXL_MEM_DEVICE).0, HIXL_SUCCESS, "register on the first engine");
    st(h.init(&name, &[]), HIXL_FAILED, "hixl again on the same port");
    // The old engine is untouched: a client still reads its memory.
    let c = Engine::new(Api::Hixl);
    st(c.init("127.0.0.1", &[]), HIXL_SUCCESS, "client");
    let local = dev_alloc(4096);
    st(c.register(local, 4096, HIXL_MEM_DEVICE).0, HIXL_SUCCESS, "client register");
    st(c.connect(&name, 2000), HIXL_SUCCESS, "connect to the old engine");
    st(c.transfer(&name, HIXL_READ, &[desc(local as usize, mem as usize, 4096)], 2000), HIXL_SUCCESS, "READ");
    assert_eq!(download(local, 4096), pattern(9, 4096));
    // A client-only engine initializes twice.
    st(c.init("127.0.0.1", &[]), HIXL_SUCCESS, "hixl client again");
}

#[test]
fn calls_before_initialize_fail() {
    both(|api| {
        set_device(0);
        let e = Engine::new(api);
        let mem = dev_alloc(4096);
        st(e.register(mem, 4096, HIXL_MEM_DEVICE).0, HIXL_FAILED, "RegisterMem");
        st(e.deregister(0x10 as *mut c_void), HIXL_FAILED, "DeregisterMem");
        st(e.connect("127.0.0.1:1", 100), HIXL_FAILED, "Connect");
        st(e.disconnect("127.0.0.1:1", 100), HIXL_FAILED, "Disconnect");
        st(e.transfer("127.0.0.1:1", HIXL_READ, &[desc(1, 1, 1)], 100), HIXL_FAILED, "TransferSync");
        st(e.status(0x10 as *mut c_void).0, HIXL_FAILED, "GetTransferStatus");
        e.finalize();
    });
}

// ---- RegisterMem / DeregisterMem ----------------------------------------------------------

#[test]
fn register_mem_rules() {
    both(|api| {
        set_device(0);
        let e = Engine::new(api);
        st(e.init("127.0.0.1", &[]), HIXL_SUCCESS, "Initialize");
        st(e.register(std::ptr::null(), 16, HIXL_MEM_DEVICE).0, HIXL_PARAM_INVALID, "addr 0");
        let dev = dev_alloc(8192);
        let (rc, h1) = e.register(dev, 8192, HIXL_MEM_DEVICE);
        st(rc, HIXL_SUCCESS, "device memory");
        let (rc, h2) = e.register(dev, 8192, HIXL_MEM_DEVICE);
        st(rc, HIXL_SUCCESS, "the same range again");
        assert_eq!(h1, h2, "the same range gives the same handle");
        let inner = (dev as usize + 4096) as *const c_void;
        st(e.register(inner, 4096, HIXL_MEM_DEVICE).0, HIXL_PARAM_INVALID, "an overlapping range");
        let host = host_alloc(8192);
        st(e.register(host, 8192, HIXL_MEM_DEVICE).0, HIXL_FAILED, "host memory as MEM_DEVICE");
        let (rc, hh) = e.register(host, 8192, HIXL_MEM_HOST);
        st(rc, HIXL_SUCCESS, "aclrtMallocHost memory as MEM_HOST");
        assert!(!hh.is_null() && hh != h1);
        let plain = vec![0u8; 8192];
        st(e.register(plain.as_ptr().cast(), 8192, HIXL_MEM_HOST).0, HIXL_FAILED, "malloc memory as MEM_HOST");
        let dev2 = dev_alloc(4096);
        st(e.register(dev2, 4096, HIXL_MEM_HOST).0, HIXL_FAILED, "device memory as MEM_HOST");
        st(e.register(dev2, 4096, 7).0, HIXL_PARAM_INVALID, "an unknown MemType");
        // Device memory of another device.
        let other = std::thread::spawn(|| {
            set_device(1);
            dev_alloc(4096) as usize
        })
        .join()
        .unwrap();
        st(e.register(other as *const c_void, 4096, HIXL_MEM_DEVICE).0, HIXL_FAILED, "another device's memory");
        st(e.register(dev, usize::MAX, HIXL_MEM_DEVICE).0, HIXL_PARAM_INVALID, "a range that wraps");
        st(e.register(dev, 0, HIXL_MEM_DEVICE).0, HIXL_PARAM_INVALID, "size 0");
    });
}

#[test]
fn deregister_mem_rules() {
    both(|api| {
        set_device(0);
        let e = Engine::new(api);
        st(e.init("127.0.0.1", &[]), HIXL_SUCCESS, "Initialize");
        st(e.deregister(std::ptr::null_mut()), HIXL_PARAM_INVALID, "nullptr");
        st(e.deregister(0x1234 as *mut c_void), HIXL_SUCCESS, "an unknown handle");
        let dev = dev_alloc(4096);
        let (rc, h) = e.register(dev, 4096, HIXL_MEM_DEVICE);
        st(rc, HIXL_SUCCESS, "register");
        st(e.deregister(h), HIXL_SUCCESS, "deregister");
        st(e.deregister(h), HIXL_SUCCESS, "deregister again");
        // The range can be registered again (it is gone).
        st(e.register(dev, 4096, HIXL_MEM_DEVICE).0, HIXL_SUCCESS, "register again");
    });
}

#[test]
fn client_server_mode_refuses_deregister_while_linked_legacy_does_not() {
    both(|api| {
        let cs = pair(api, &[CS_RES, NO_POOL], &[CS_RES, NO_POOL]);
        st(cs.client.connect(&cs.server_name, 2000), HIXL_SUCCESS, "Connect");
        st(cs.client.deregister(cs.local_handle), HIXL_FAILED, "CS: deregister while linked");
        st(cs.client.disconnect(&cs.server_name, 1000), HIXL_SUCCESS, "Disconnect");
        st(cs.client.deregister(cs.local_handle), HIXL_SUCCESS, "CS: deregister after Disconnect");

        let legacy = pair(api, &[NO_POOL], &[NO_POOL]);
        st(legacy.client.connect(&legacy.server_name, 2000), HIXL_SUCCESS, "Connect");
        st(legacy.client.deregister(legacy.local_handle), HIXL_SUCCESS, "legacy: deregister while linked");
    });
}

#[test]
fn memory_registered_after_the_link_is_not_reachable_over_it() {
    both(|api| {
        let p = pair(api, &[NO_POOL], &[NO_POOL]);
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
        let late = dev_alloc(PLEN);
        upload(late, &pattern(5, PLEN));
        st(p.server.register(late, PLEN, HIXL_MEM_DEVICE).0, HIXL_SUCCESS, "register after the link");
        let d = [desc(p.local as usize, late as usize, PLEN)];
        st(p.client.transfer(&p.server_name, HIXL_READ, &d, 2000), HIXL_PARAM_INVALID, "READ of the late memory");
        // Memory registered before the link is reachable.
        st(p.client.transfer(&p.server_name, HIXL_READ, &p.read_all(), 2000), HIXL_SUCCESS, "READ of early memory");
        // A new link sees it.
        st(p.client.disconnect(&p.server_name, 1000), HIXL_SUCCESS, "Disconnect");
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect again");
        st(p.client.transfer(&p.server_name, HIXL_READ, &d, 2000), HIXL_SUCCESS, "READ over the new link");
        assert_eq!(download(p.local, PLEN), pattern(5, PLEN));
    });
}

#[test]
fn local_only_memory_is_not_reachable_remotely() {
    both(|api| {
        let p = pair(api, &[NO_POOL], &[NO_POOL]);
        let private = dev_alloc(PLEN);
        upload(private, &pattern(6, PLEN));
        let mut d = MemDesc::new(private as usize, PLEN);
        d.local_only = 1;
        st(p.server.register_desc(d, HIXL_MEM_DEVICE).0, HIXL_SUCCESS, "register local_only");
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
        let read = [desc(p.local as usize, private as usize, PLEN)];
        let rc = p.client.transfer(&p.server_name, HIXL_READ, &read, 2000);
        match api {
            // hixl::MemDesc::local_only: not offered to peers.
            Api::Hixl => st(rc, HIXL_PARAM_INVALID, "READ of local_only memory"),
            // adxl::MemDesc has reserved bytes there, which ADXL drops.
            Api::Adxl => st(rc, HIXL_SUCCESS, "adxl ignores the reserved byte"),
        }
    });
}

#[test]
fn a_range_the_server_deregistered_after_the_link_is_refused() {
    both(|api| {
        let p = pair(api, &[NO_POOL], &[NO_POOL]);
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
        st(p.server.deregister(p.remote_handle), HIXL_SUCCESS, "legacy server deregisters while linked");
        st(p.client.transfer(&p.server_name, HIXL_READ, &p.read_all(), 2000), HIXL_FAILED, "READ of a gone range");
        // The refusal keeps the link in step (AutoConnect off).
        st(p.client.disconnect(&p.server_name, 1000), HIXL_SUCCESS, "Disconnect");
        // An asynchronous transfer of it ends FAILED.
        st(p.server.register(p.remote, PLEN, HIXL_MEM_DEVICE).0, HIXL_SUCCESS, "register again");
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
        let (rc, h) = p.server.register(p.remote, PLEN, HIXL_MEM_DEVICE);
        st(rc, HIXL_SUCCESS, "its handle");
        st(p.server.deregister(h), HIXL_SUCCESS, "deregister again");
        let (rc, req) = p.client.transfer_async(&p.server_name, HIXL_READ, &p.read_all());
        st(rc, HIXL_SUCCESS, "TransferAsync");
        let deadline = Instant::now() + Duration::from_secs(10);
        let s = loop {
            let (rc, s) = p.client.status(req);
            st(rc, HIXL_SUCCESS, "GetTransferStatus");
            if s != HIXL_STATUS_WAITING || Instant::now() > deadline {
                break s;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(s, HIXL_STATUS_FAILED);
        st(p.client.status(req).0, HIXL_PARAM_INVALID, "a released request");
    });
}

// ---- Connect / Disconnect -----------------------------------------------------------------

#[test]
fn connect_rules() {
    both(|api| {
        let p = pair(api, &[NO_POOL], &[NO_POOL]);
        st(p.client.connect(&p.server_name, 0), HIXL_PARAM_INVALID, "timeout 0");
        st(p.client.connect(&p.server_name, -5), HIXL_PARAM_INVALID, "a negative timeout");
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
        st(p.client.connect(&p.server_name, 2000), HIXL_ALREADY_CONNECTED, "Connect again");
        let nobody = format!("127.0.0.1:{}", free_port());
        st(p.client.connect(&nobody, 500), HIXL_FAILED, "nothing listens there");
        st(p.client.connect("127.0.0.2", 500), HIXL_FAILED, "a name without a port");
        st(p.server.connect(&p.server_name, 500), HIXL_PARAM_INVALID, "legacy: connect to itself");
        let cs = pair(api, &[CS_RES, NO_POOL], &[CS_RES, NO_POOL]);
        st(cs.server.connect(&cs.server_name, 500), HIXL_PARAM_INVALID, "CS: connect to itself");
        // A CS client cannot link to a legacy server.
        st(cs.client.connect(&p.server_name, 2000), HIXL_FAILED, "engine modes differ");
    });
}

#[test]
fn a_server_that_does_not_answer_the_handshake_in_time_is_a_timeout() {
    let test = "a_server_that_does_not_answer_the_handshake_in_time_is_a_timeout";
    in_child(test, &[("FERRY_CANN_EMU_DELAY_US", "hixl.ServeConnect:1500000")], || {
        both(|api| {
            let p = pair(api, &[NO_POOL], &[NO_POOL]);
            let t0 = Instant::now();
            st(p.client.connect(&p.server_name, 300), HIXL_TIMEOUT, "Connect");
            assert!(t0.elapsed() < Duration::from_millis(1200), "TIMEOUT came after the timeout, not the delay");
            st(p.client.connect(&p.server_name, 5000), HIXL_SUCCESS, "a longer timeout");
        });
    });
}

#[test]
fn the_legacy_engine_has_a_link_limit_client_server_mode_has_none() {
    let test = "the_legacy_engine_has_a_link_limit_client_server_mode_has_none";
    in_child(test, &[("FERRY_CANN_EMU_HIXL_MAX_LINKS", "2")], || {
        both(|api| {
            for (opts, limited) in [(&[NO_POOL][..], true), (&[CS_RES, NO_POOL][..], false)] {
                set_device(0);
                let servers: Vec<(Engine, String)> = (0..3)
                    .map(|_| {
                        let e = Engine::new(api);
                        let n = format!("127.0.0.1:{}", free_port());
                        st(e.init(&n, opts), HIXL_SUCCESS, "server");
                        (e, n)
                    })
                    .collect();
                let c = Engine::new(api);
                st(c.init("127.0.0.1", opts), HIXL_SUCCESS, "client");
                st(c.connect(&servers[0].1, 2000), HIXL_SUCCESS, "link 1");
                st(c.connect(&servers[1].1, 2000), HIXL_SUCCESS, "link 2");
                let want = if limited { HIXL_RESOURCE_EXHAUSTED } else { HIXL_SUCCESS };
                st(c.connect(&servers[2].1, 2000), want, "link 3");
                if limited {
                    // The server side counts too: a server with two links refuses a third.
                    let a = Engine::new(api);
                    st(a.init("127.0.0.1", opts), HIXL_SUCCESS, "client a");
                    let b = Engine::new(api);
                    st(b.init("127.0.0.1", opts), HIXL_SUCCESS, "client b");
                    st(a.connect(&servers[2].1, 2000), HIXL_SUCCESS, "server 2: link 1");
                    st(b.connect(&servers[2].1, 2000), HIXL_SUCCESS, "server 2: link 2");
                    let x = Engine::new(api);
                    st(x.init("127.0.0.1", opts), HIXL_SUCCESS, "client x");
                    st(x.connect(&servers[2].1, 2000), HIXL_RESOURCE_EXHAUSTED, "server 2: link 3");
                    // Disconnecting frees a slot.
                    st(c.disconnect(&servers[1].1, 1000), HIXL_SUCCESS, "Disconnect");
                    st(c.connect(&servers[0].1, 2000), HIXL_ALREADY_CONNECTED, "still linked to server 0");
                }
            }
        });
    });
}

#[test]
fn disconnect_rules() {
    both(|api| {
        let p = pair(api, &[NO_POOL], &[NO_POOL]);
        st(p.client.disconnect(&p.server_name, 1000), HIXL_NOT_CONNECTED, "not connected");
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
        st(p.client.disconnect(&p.server_name, 0), HIXL_PARAM_INVALID, "timeout 0");
        st(p.client.disconnect(&p.server_name, 1000), HIXL_SUCCESS, "Disconnect");
        st(p.client.disconnect(&p.server_name, 1000), HIXL_NOT_CONNECTED, "Disconnect again");
        st(p.client.transfer(&p.server_name, HIXL_READ, &p.read_all(), 1000), HIXL_NOT_CONNECTED, "after Disconnect");
    });
}

#[test]
fn a_finalized_server_fails_its_clients_transfers() {
    both(|api| {
        let p = pair(api, &[NO_POOL], &[NO_POOL]);
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
        p.server.finalize();
        st(p.client.disconnect(&p.server_name, 500), HIXL_FAILED, "legacy: Disconnect from a gone server");
        st(p.client.connect(&p.server_name, 500), HIXL_FAILED, "Connect to a gone server");
        let q = pair(api, &[NO_POOL], &[NO_POOL]);
        st(q.client.connect(&q.server_name, 2000), HIXL_SUCCESS, "Connect");
        q.server.finalize();
        st(q.client.transfer(&q.server_name, HIXL_READ, &q.read_all(), 1000), HIXL_FAILED, "READ from a gone server");
        st(q.client.disconnect(&q.server_name, 500), HIXL_SUCCESS, "Disconnect of the broken link");
    });
}

// ---- TransferSync -------------------------------------------------------------------------

#[test]
fn transfer_argument_rules() {
    both(|api| {
        let p = pair(api, &[NO_POOL], &[NO_POOL]);
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
        let good = p.read_all();
        st(p.client.transfer(&p.server_name, HIXL_READ, &good, 0), HIXL_PARAM_INVALID, "timeout 0");
        let null_local = [desc(0, p.remote as usize, 16)];
        st(p.client.transfer(&p.server_name, HIXL_READ, &null_local, 1000), HIXL_PARAM_INVALID, "null local");
        let null_remote = [desc(p.local as usize, 0, 16)];
        st(p.client.transfer(&p.server_name, HIXL_WRITE, &null_remote, 1000), HIXL_PARAM_INVALID, "null remote");
        st(p.client.transfer(&p.server_name, HIXL_READ, &[], 1000), HIXL_PARAM_INVALID, "no descriptors");
        let zero = [desc(p.local as usize, p.remote as usize, 0)];
        st(p.client.transfer(&p.server_name, HIXL_READ, &zero, 1000), HIXL_PARAM_INVALID, "len 0");
        st(p.client.transfer(&p.server_name, 2, &good, 1000), HIXL_PARAM_INVALID, "an unknown op");
        // Nothing of that broke the link.
        st(p.client.transfer(&p.server_name, HIXL_READ, &good, 2000), HIXL_SUCCESS, "a good READ");
    });
}

#[test]
fn local_and_remote_ranges_must_lie_in_registrations() {
    both(|api| {
        let p = pair(api, &[NO_POOL], &[NO_POOL]);
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
        let stray = dev_alloc(PLEN);
        let r = |d: TransferOpDesc| p.client.transfer(&p.server_name, HIXL_READ, &[d], 1000);
        st(r(desc(stray as usize, p.remote as usize, 16)), HIXL_PARAM_INVALID, "unregistered local memory");
        st(r(desc(p.local as usize, stray as usize, 16)), HIXL_PARAM_INVALID, "unregistered remote memory");
        st(r(desc(p.local as usize, p.remote as usize + 1, PLEN)), HIXL_PARAM_INVALID, "remote runs past the end");
        st(r(desc(p.local as usize + 1, p.remote as usize, PLEN)), HIXL_PARAM_INVALID, "local runs past the end");
        st(r(desc(p.local as usize + 8, p.remote as usize + 16, 64)), HIXL_SUCCESS, "a sub-range");
        assert_eq!(download((p.local as usize + 8) as *const c_void, 64), pattern(1, PLEN)[16..80].to_vec());
    });
}

#[test]
fn without_a_link_and_auto_connect_off_a_transfer_is_not_connected() {
    both(|api| {
        let p = pair(api, &[NO_POOL, ("AutoConnect", "0")], &[NO_POOL, ("AutoConnect", "0")]);
        st(p.client.transfer(&p.server_name, HIXL_READ, &p.read_all(), 1000), HIXL_NOT_CONNECTED, "TransferSync");
        st(p.client.transfer_async(&p.server_name, HIXL_READ, &p.read_all()).0, HIXL_NOT_CONNECTED, "TransferAsync");
    });
}

#[test]
fn auto_connect_links_on_the_first_transfer_and_drops_the_link_after_a_failure() {
    both(|api| {
        let p = pair(api, &[NO_POOL], &[NO_POOL, ("AutoConnect", "1")]);
        st(p.client.transfer(&p.server_name, HIXL_READ, &p.read_all(), 2000), HIXL_SUCCESS, "READ without Connect");
        assert_eq!(download(p.local, PLEN), pattern(1, PLEN));
        st(p.client.connect(&p.server_name, 2000), HIXL_ALREADY_CONNECTED, "the transfer made a link");
        // A failed transfer drops the link (HIXL disconnects on error with AutoConnect).
        let bad = [desc(p.local as usize, p.remote as usize + 1, PLEN)];
        st(p.client.transfer(&p.server_name, HIXL_READ, &bad, 1000), HIXL_PARAM_INVALID, "a bad READ");
        st(p.client.disconnect(&p.server_name, 1000), HIXL_NOT_CONNECTED, "the link is gone");
        // Without AutoConnect the link stays.
        let q = pair(api, &[NO_POOL], &[NO_POOL, ("AutoConnect", "0")]);
        st(q.client.connect(&q.server_name, 2000), HIXL_SUCCESS, "Connect");
        let bad = [desc(q.local as usize, q.remote as usize + 1, PLEN)];
        st(q.client.transfer(&q.server_name, HIXL_READ, &bad, 1000), HIXL_PARAM_INVALID, "a bad READ");
        st(q.client.disconnect(&q.server_name, 1000), HIXL_SUCCESS, "the link is still there");
    });
}

#[test]
fn a_target_that_does_not_answer_in_time_is_a_timeout() {
    let test = "a_target_that_does_not_answer_in_time_is_a_timeout";
    in_child(test, &[("FERRY_CANN_EMU_DELAY_US", "hixl.ServeTransfer:1500000")], || {
        both(|api| {
            let p = pair(api, &[NO_POOL], &[NO_POOL]);
            st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
            let t0 = Instant::now();
            st(p.client.transfer(&p.server_name, HIXL_READ, &p.read_all(), 300), HIXL_TIMEOUT, "READ");
            assert!(t0.elapsed() < Duration::from_millis(1200), "TIMEOUT after the timeout, not the delay");
            // The link is out of step: later transfers fail until it is rebuilt.
            st(p.client.transfer(&p.server_name, HIXL_READ, &p.read_all(), 5000), HIXL_FAILED, "on a broken link");
            st(p.client.disconnect(&p.server_name, 1000), HIXL_SUCCESS, "Disconnect");
            st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect again");
            st(p.client.transfer(&p.server_name, HIXL_WRITE, &p.read_all(), 5000), HIXL_SUCCESS, "a patient WRITE");
            // With AutoConnect the timed-out link is dropped.
            let q = pair(api, &[NO_POOL], &[NO_POOL, ("AutoConnect", "1")]);
            st(q.client.transfer(&q.server_name, HIXL_READ, &q.read_all(), 300), HIXL_TIMEOUT, "auto READ");
            st(q.client.disconnect(&q.server_name, 1000), HIXL_NOT_CONNECTED, "dropped after the timeout");
        });
    });
}

#[test]
fn a_failure_on_the_target_is_failed() {
    let test = "a_failure_on_the_target_is_failed";
    in_child(test, &[("FERRY_CANN_EMU_FAIL", "hixl.ServeTransfer:1")], || {
        let p = pair(Api::Adxl, &[NO_POOL], &[NO_POOL]);
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
        st(p.client.transfer(&p.server_name, HIXL_READ, &p.read_all(), 2000), HIXL_FAILED, "the injected refusal");
        st(p.client.transfer(&p.server_name, HIXL_READ, &p.read_all(), 2000), HIXL_SUCCESS, "the next one");
        assert_eq!(download(p.local, PLEN), pattern(1, PLEN));
    });
}

// ---- static calls ---------------------------------------------------------------------------

#[test]
fn malloc_free_and_export_rules() {
    set_device(0);
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is writable.
    st(unsafe { adxl_engine_malloc_mem(HIXL_MEM_HOST, 0, &mut p) }, HIXL_PARAM_INVALID, "size 0");
    // SAFETY: as above.
    st(unsafe { adxl_engine_malloc_mem(5, 4096, &mut p) }, HIXL_PARAM_INVALID, "an unknown type");
    // SAFETY: a null out-pointer is refused.
    st(unsafe { adxl_engine_malloc_mem(HIXL_MEM_HOST, 4096, std::ptr::null_mut()) }, HIXL_PARAM_INVALID, "ptr null");
    // SAFETY: `p` is writable.
    st(unsafe { adxl_engine_malloc_mem(HIXL_MEM_HOST, 4096, &mut p) }, HIXL_SUCCESS, "MallocMem host");
    // It is memory HIXL registers as host memory.
    let e = Engine::new(Api::Adxl);
    st(e.init("127.0.0.1", &[]), HIXL_SUCCESS, "Initialize");
    let (rc, h) = e.register(p, 4096, HIXL_MEM_HOST);
    st(rc, HIXL_SUCCESS, "register MallocMem memory");
    st(e.deregister(h), HIXL_SUCCESS, "deregister");
    let mut handle = [0u8; 256];
    // SAFETY: `handle` is writable scratch.
    let rc = unsafe { adxl_engine_export_to_shareable_handle(p, handle.as_mut_ptr().cast()) };
    assert_eq!(rc, ACL_ERROR_RT_FEATURE_NOT_SUPPORT as u32, "export of MallocMem memory is not modelled");
    let other = host_alloc(4096);
    // SAFETY: as above.
    let rc = unsafe { adxl_engine_export_to_shareable_handle(other, handle.as_mut_ptr().cast()) };
    st(rc, HIXL_PARAM_INVALID, "export of memory MallocMem did not hand out");
    // SAFETY: as above.
    st(
        unsafe { adxl_engine_export_to_shareable_handle(std::ptr::null_mut(), handle.as_mut_ptr().cast()) },
        HIXL_PARAM_INVALID,
        "export of NULL",
    );
    // SAFETY: `p` came from MallocMem.
    st(unsafe { adxl_engine_free_mem(p) }, HIXL_SUCCESS, "FreeMem");
    // SAFETY: refused, never dereferenced.
    st(unsafe { adxl_engine_free_mem(p) }, HIXL_FAILED, "FreeMem twice");
    // SAFETY: as above.
    st(unsafe { adxl_engine_free_mem(std::ptr::null_mut()) }, HIXL_PARAM_INVALID, "FreeMem(nullptr)");
    let mut d = std::ptr::null_mut();
    // SAFETY: `d` is writable.
    st(unsafe { adxl_engine_malloc_mem(HIXL_MEM_DEVICE, 4096, &mut d) }, HIXL_SUCCESS, "MallocMem device");
    st(e.register(d, 4096, HIXL_MEM_DEVICE).0, HIXL_SUCCESS, "register it as device memory");
    // SAFETY: `d` came from MallocMem.
    st(unsafe { adxl_engine_free_mem(d) }, HIXL_SUCCESS, "FreeMem device");
    let code = std::thread::spawn(|| {
        let mut q = std::ptr::null_mut();
        // SAFETY: `q` is writable.
        unsafe { adxl_engine_malloc_mem(HIXL_MEM_HOST, 4096, &mut q) }
    })
    .join()
    .unwrap();
    assert_eq!(code, ACL_ERROR_RT_CONTEXT_NULL as u32, "MallocMem needs the thread's device");
}

#[test]
fn the_log_traces_hixl_calls() {
    let test = "the_log_traces_hixl_calls";
    let stderr = in_child(test, &[("FERRY_CANN_EMU_LOG", "1")], || {
        let p = pair(Api::Hixl, &[NO_POOL], &[NO_POOL]);
        st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
        st(p.client.connect(&p.server_name, 0), HIXL_PARAM_INVALID, "Connect with timeout 0");
    });
    if let Some(stderr) = stderr {
        assert!(stderr.contains("hixl.Initialize("), "{stderr}");
        assert!(stderr.contains("hixl.Connect(") && stderr.contains("-> 0"), "{stderr}");
        assert!(stderr.contains("-> 103900 (timeout_in_millis:0 must > 0)"), "{stderr}");
    }
}

// ---- the wire ------------------------------------------------------------------------------

/// A frame of the emulator's protocol, built by hand (as a hostile peer would).
fn frame(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&0x554d_4546u32.to_le_bytes());
    f.extend_from_slice(&1u16.to_le_bytes());
    f.extend_from_slice(&kind.to_le_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend_from_slice(payload);
    f
}

fn read_frame(s: &mut std::net::TcpStream) -> std::io::Result<(u16, Vec<u8>)> {
    use std::io::Read;
    let mut h = [0u8; 16];
    s.read_exact(&mut h)?;
    let kind = u16::from_le_bytes([h[6], h[7]]);
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    assert!(len < 1 << 20);
    let mut p = vec![0u8; len];
    s.read_exact(&mut p)?;
    Ok((kind, p))
}

#[test]
fn the_server_trusts_nothing_it_reads_from_a_socket() {
    use std::io::Write;
    let p = pair(Api::Hixl, &[NO_POOL], &[NO_POOL]);
    let addr: std::net::SocketAddr = p.server_name.parse().unwrap();
    let timeout = Some(Duration::from_secs(5));
    // Garbage: the server closes the connection.
    let mut g = std::net::TcpStream::connect(addr).unwrap();
    g.set_read_timeout(timeout).unwrap();
    g.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(read_frame(&mut g).is_err(), "no answer to garbage");
    // A forged hello, then requests outside the registrations and an absurd list.
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(timeout).unwrap();
    let mut hello = Vec::new();
    hello.extend_from_slice(&4u32.to_le_bytes());
    hello.extend_from_slice(b"evil");
    hello.push(0);
    s.write_all(&frame(20, &hello)).unwrap();
    let (k, ack) = read_frame(&mut s).unwrap();
    assert_eq!((k, u32::from_le_bytes([ack[0], ack[1], ack[2], ack[3]])), (21, HIXL_SUCCESS), "hello answered");
    let batch = |op: u8, ranges: &[(u64, u64)], count: u32| {
        let mut b = vec![op];
        b.extend_from_slice(&count.to_le_bytes());
        for (a, l) in ranges {
            b.extend_from_slice(&a.to_le_bytes());
            b.extend_from_slice(&l.to_le_bytes());
        }
        frame(22, &b)
    };
    let remote = p.remote as u64;
    for bad in [(remote + PLEN as u64 - 8, 16), (remote, 0), (8, 8), (u64::MAX - 4, 8)] {
        s.write_all(&batch(0, &[bad], 1)).unwrap();
        let (k, ack) = read_frame(&mut s).unwrap();
        assert_eq!((k, u32::from_le_bytes([ack[0], ack[1], ack[2], ack[3]])), (23, HIXL_FAILED), "{bad:?} refused");
    }
    // A count larger than the frame holds: the server drops the link.
    s.write_all(&batch(1, &[(remote, 8)], 1_000_000)).unwrap();
    assert!(read_frame(&mut s).is_err(), "the link is closed");
    // The server still serves honest clients, and its memory is intact.
    st(p.client.connect(&p.server_name, 2000), HIXL_SUCCESS, "Connect");
    st(p.client.transfer(&p.server_name, HIXL_READ, &p.read_all(), 2000), HIXL_SUCCESS, "READ");
    assert_eq!(download(p.local, PLEN), pattern(1, PLEN));
}
