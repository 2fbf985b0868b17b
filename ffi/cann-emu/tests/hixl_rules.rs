//! The rules of HIXL/ADXL the emulated HIXL enforces (issue 17, section 3), one test each, and
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
