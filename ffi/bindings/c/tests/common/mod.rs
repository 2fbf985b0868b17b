//! Helpers shared by the C API tests: engines, buffers, requests, last-error checks, and a
//! silent TCP peer that keeps requests pending.
#![allow(dead_code, reason = "each test binary uses a subset of the helpers")]

use std::ffi::{CStr, CString};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferry_abi::{FERRY_OK, FerryTransferRequest};
use ferry_c::*;

/// Timeout (ms) used by waits that must succeed.
pub(crate) const WAIT_MS: u64 = 10_000;

/// This thread's last error.
pub(crate) fn last_error() -> String {
    // SAFETY: ferry_last_error never returns NULL and the text is valid until the next call.
    unsafe { CStr::from_ptr(ferry_last_error()) }.to_string_lossy().into_owned()
}

/// Asserts success, showing the last error otherwise.
#[track_caller]
pub(crate) fn ok(rc: i32) {
    assert_eq!(rc, FERRY_OK, "call failed: {}", last_error());
}

/// Asserts that a call failed with `code` and that the last error contains every `needle`.
#[track_caller]
pub(crate) fn fails(rc: i32, code: i32, needles: &[&str]) {
    let msg = last_error();
    assert_eq!(rc, code, "unexpected result; last error: {msg}");
    for n in needles {
        assert!(msg.contains(n), "last error {msg:?} does not contain {n:?}");
    }
}

/// An engine from a JSON config (`None`: the embedded default).
#[track_caller]
pub(crate) fn engine(config: Option<&str>) -> FerryEngine {
    let c = config.map(|c| CString::new(c).unwrap());
    let mut e = 0;
    // SAFETY: a valid C string (or NULL) and a valid out-pointer.
    ok(unsafe { ferry_engine_create(c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()), &mut e) });
    assert_ne!(e, 0);
    e
}

/// The P2P-handshake + tcp config of the C example, with a transfer timeout.
pub(crate) fn p2p_config(timeout_ms: u64) -> String {
    format!(
        r#"{{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "transfer_timeout_ms": {timeout_ms}}}"#
    )
}

/// An engine on P2P handshake metadata with the tcp transport (real loopback sockets).
pub(crate) fn p2p_engine(timeout_ms: u64) -> FerryEngine {
    engine(Some(&p2p_config(timeout_ms)))
}

/// The engine's segment name.
#[track_caller]
pub(crate) fn name(e: FerryEngine) -> String {
    let mut buf = [0 as std::ffi::c_char; 256];
    let mut len = 0usize;
    // SAFETY: `buf` has room for 256 bytes; `len` is a valid out-pointer.
    ok(unsafe { ferry_engine_segment_name(e, buf.as_mut_ptr(), buf.len(), &mut len) });
    // SAFETY: the call wrote a NUL-terminated string into `buf`.
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap().to_owned();
    assert_eq!(s.len(), len);
    s
}

/// Destroys an engine, asserting success.
#[track_caller]
pub(crate) fn destroy(e: FerryEngine) {
    ok(ferry_engine_destroy(e));
}

/// Heap memory to register. Only read through `bytes()` while no transfer touches it.
pub(crate) struct Buffer {
    data: Vec<u8>,
    addr: u64,
}

impl Buffer {
    /// `len` zero bytes.
    pub(crate) fn zeroed(len: usize) -> Self {
        Self::from_vec(vec![0; len])
    }

    /// `len` bytes of a pattern that depends on `seed`.
    pub(crate) fn pattern(len: usize, seed: u8) -> Self {
        Self::from_vec((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect())
    }

    /// These bytes.
    pub(crate) fn from_bytes(data: Vec<u8>) -> Self {
        Self::from_vec(data)
    }

    fn from_vec(mut data: Vec<u8>) -> Self {
        let addr = data.as_mut_ptr() as u64;
        Self { data, addr }
    }

    /// Address of byte 0.
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.data.len() as u64
    }

    /// The contents (read after the transfers that write it have finished).
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Overwrites the contents (while no transfer touches it).
    pub(crate) fn fill(&mut self, value: u8) {
        self.data.fill(value);
    }
}

/// Registers `buf` with `e` as `cpu:0`. The buffer must outlive the engine or be unregistered.
#[track_caller]
pub(crate) fn register(e: FerryEngine, buf: &Buffer) {
    // SAFETY: the buffer is heap memory the test keeps alive until it unregisters it or
    // destroys the engine.
    ok(unsafe { ferry_register_memory(e, buf.addr(), buf.len(), c"cpu:0".as_ptr()) });
}

/// Opens segment `name` from engine `e`.
#[track_caller]
pub(crate) fn open(e: FerryEngine, name: &str) -> u64 {
    let c = CString::new(name).unwrap();
    let mut seg = 0;
    // SAFETY: a valid C string and out-pointer.
    ok(unsafe { ferry_open_segment(e, c.as_ptr(), &mut seg) });
    seg
}

/// One request.
pub(crate) fn req(opcode: u32, target: u64, local_addr: u64, remote_addr: u64, length: u64) -> FerryTransferRequest {
    FerryTransferRequest { opcode, flags: 0, target, local_addr, remote_addr, length }
}

/// Submits `reqs`, asserting success.
#[track_caller]
pub(crate) fn submit(e: FerryEngine, reqs: &[FerryTransferRequest]) -> FerryBatch {
    let mut b = 0;
    // SAFETY: `reqs` holds `reqs.len()` requests; `b` is a valid out-pointer.
    ok(unsafe { ferry_submit(e, reqs.as_ptr(), reqs.len(), &mut b) });
    assert_ne!(b, 0);
    b
}

/// Sends a Mooncake handshake frame.
fn write_frame(s: &mut TcpStream, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut out = (payload.len() as u64 + 1).to_le_bytes().to_vec();
    out.push(kind);
    out.extend_from_slice(payload);
    s.write_all(&out)
}

/// Reads one handshake frame: (type, payload).
fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let mut body = vec![0u8; u64::from_le_bytes(len) as usize];
    s.read_exact(&mut body)?;
    let kind = body.first().copied().unwrap_or(1);
    Ok((kind, body.split_off(1.min(body.len()))))
}

/// A peer reached over the P2P handshake (it answers Metadata frames with a descriptor) whose
/// tcp data port accepts connections and never answers: requests to it stay pending until
/// they are cancelled, time out, or the peer hangs up.
pub(crate) struct SilentPeer {
    /// Its segment name (`127.0.0.1:<handshake port>`).
    pub(crate) name: String,
    /// The remote buffer it publishes.
    pub(crate) buffer_addr: u64,
    /// Length of that buffer.
    pub(crate) buffer_len: u64,
    held: Arc<Mutex<Vec<TcpStream>>>,
    hung_up: Arc<AtomicBool>,
}

impl SilentPeer {
    /// Starts the peer's two listeners on loopback (background threads for the test's life).
    pub(crate) fn start() -> Self {
        let data = TcpListener::bind("127.0.0.1:0").unwrap();
        let data_port = data.local_addr().unwrap().port();
        let held = Arc::new(Mutex::new(Vec::new()));
        let hung_up = Arc::new(AtomicBool::new(false));
        let (h, hu) = (held.clone(), hung_up.clone());
        std::thread::spawn(move || {
            for conn in data.incoming().flatten() {
                if hu.load(Ordering::Acquire) {
                    let _ = conn.shutdown(Shutdown::Both);
                } else {
                    h.lock().unwrap().push(conn); // kept open, never read or answered
                }
            }
        });
        let handshake = TcpListener::bind("127.0.0.1:0").unwrap();
        let name = format!("127.0.0.1:{}", handshake.local_addr().unwrap().port());
        let (buffer_addr, buffer_len) = (0x1000_0000, 1 << 20);
        let mut d = ferry::SegmentDescriptor::new(name.clone(), "tcp");
        let endpoint = ferry::transports::tcp::TcpEndpoint {
            host: Some("127.0.0.1".into()),
            port: data_port,
            proto_version: Some(2),
            fence: None,
            auth: None,
        };
        endpoint.write_to(&mut d).unwrap();
        d.buffers.push(ferry::BufferDesc {
            addr: buffer_addr,
            length: buffer_len,
            name: "cpu:0".into(),
            device_id: None,
            extra: Default::default(),
        });
        let json = d.to_json();
        std::thread::spawn(move || {
            for mut conn in handshake.incoming().flatten() {
                if let Ok((kind, _)) = read_frame(&mut conn) {
                    let _ = write_frame(&mut conn, kind, &json);
                }
            }
        });
        Self { name, buffer_addr, buffer_len, held, hung_up }
    }

    /// Closes every data connection and refuses new ones: the requests in flight fail at once
    /// (their transport lets go of their memory).
    pub(crate) fn hang_up(&self) {
        self.hung_up.store(true, Ordering::Release);
        for conn in self.held.lock().unwrap().drain(..) {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}
