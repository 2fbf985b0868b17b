//! Per-device endpoints of rank-table communicators.
//!
//! A rank's endpoint is its rank table entry's `device_ip:device_port`. A process opens one
//! listener per endpoint, shared by every communicator of that device (reference-counted: it
//! closes when the last communicator using it is destroyed). A connection starts with a
//! `HELLO {key, src, dst, purpose}`; the listener finds the local communicator with that key
//! and rank `dst` and either parks the connection as a two-sided link of
//! `HcclCommInitClusterInfo` or serves it as a one-sided service connection. An unknown
//! communicator is answered `HCCL_E_NOT_FOUND` so the peer can retry until its timeout.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::boundary::{debug, lock};
use crate::codes::*;
use crate::config::config;
use crate::hccl::{Comm, Role};
use crate::wire::{self, Dec, Enc, kind, purpose};

type Listeners = HashMap<SocketAddr, (Arc<AtomicBool>, usize)>;
type Index = HashMap<(u64, u32), Weak<Comm>>;

static LISTENERS: LazyLock<Mutex<Listeners>> = LazyLock::new(Default::default);
static INDEX: LazyLock<Mutex<Index>> = LazyLock::new(Default::default);

/// A reference on an endpoint listener; dropping the last one closes the listener.
#[derive(Debug)]
pub(crate) struct Guard {
    addr: SocketAddr,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut all = lock(&LISTENERS);
        if let Some((stop, refs)) = all.get_mut(&self.addr) {
            *refs -= 1;
            if *refs == 0 {
                stop.store(true, Ordering::Release);
                all.remove(&self.addr);
            }
        }
    }
}

/// Takes a reference on the listener of `addr`, opening it if needed.
pub(crate) fn acquire(addr: SocketAddr) -> EmuResult<Guard> {
    let mut all = lock(&LISTENERS);
    if let Some((_, refs)) = all.get_mut(&addr) {
        *refs += 1;
        return Ok(Guard { addr });
    }
    // A listener of this address that just closed may still hold the port for a moment.
    let deadline = Instant::now() + Duration::from_secs(2);
    let listener = loop {
        match TcpListener::bind(addr) {
            Ok(l) => break l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(err(
                    HCCL_E_TCP_CONNECT,
                    format!(
                        "cannot listen on the device endpoint {addr} (device_ip:device_port of this rank; the emulator needs a local address): {e}"
                    ),
                ));
            }
        }
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| err(HCCL_E_SYSCALL, format!("cannot configure the listener on {addr}: {e}")))?;
    let stop = Arc::new(AtomicBool::new(false));
    let thread_stop = Arc::clone(&stop);
    std::thread::Builder::new()
        .name(format!("cann-emu-ep-{}", addr.port()))
        .spawn(move || accept_loop(listener, thread_stop))
        .map_err(|e| err(HCCL_E_SYSCALL, format!("cannot start the listener thread of {addr}: {e}")))?;
    all.insert(addr, (stop, 1));
    debug(|| format!("endpoint {addr}: listening"));
    Ok(Guard { addr })
}

fn accept_loop(listener: TcpListener, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Acquire) {
        if !wire::poll_readable(&listener, Duration::from_millis(50)) {
            continue;
        }
        if let Ok((s, _)) = listener.accept() {
            let _ = s.set_nonblocking(false);
            let _ = s.set_nodelay(true);
            let _ = std::thread::Builder::new().name("cann-emu-serve".into()).spawn(move || {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve(s)));
            });
        }
    }
}

/// Makes a communicator findable by connections to its endpoint.
pub(crate) fn index_insert(comm: &Arc<Comm>) {
    lock(&INDEX).insert((comm.key, comm.rank), Arc::downgrade(comm));
}

/// Removes a communicator from the index (if it is the one registered under its key and rank).
pub(crate) fn index_remove(comm: &Comm) {
    let mut index = lock(&INDEX);
    if index.get(&(comm.key, comm.rank)).and_then(Weak::upgrade).is_some_and(|c| c.handle == comm.handle) {
        index.remove(&(comm.key, comm.rank));
    }
}

/// The live local communicator with `key` and `rank`.
pub(crate) fn index_find(key: u64, rank: u32) -> Option<Arc<Comm>> {
    lock(&INDEX).get(&(key, rank)).and_then(Weak::upgrade).filter(|c| !c.is_destroyed())
}

/// `HELLO` payload.
pub(crate) fn hello(key: u64, src: u32, dst: u32, purpose: u8) -> Vec<u8> {
    Enc::new().u64(key).u32(src).u32(dst).u8(purpose).0
}

/// `HELLO_ACK` payload.
pub(crate) fn ack(status: i32, message: &str) -> Vec<u8> {
    Enc::new().u32(status as u32).str(message).0
}

/// Reads a `HELLO_ACK`: `(status, message)`.
pub(crate) fn read_ack(s: &mut TcpStream) -> std::io::Result<(i32, String)> {
    let p = wire::expect_frame(s, kind::HELLO_ACK, wire::MAX_FRAME)?;
    let mut d = Dec::new(&p);
    Ok((d.u32()? as i32, d.str()?))
}

fn serve(mut s: TcpStream) {
    if wire::set_timeouts(&s, Some(config().connect_timeout)).is_err() {
        return;
    }
    let Ok(p) = wire::expect_frame(&mut s, kind::HELLO, 64) else { return };
    let mut d = Dec::new(&p);
    let (Ok(key), Ok(src), Ok(dst), Ok(purpose)) = (d.u64(), d.u32(), d.u32(), d.u8()) else { return };
    let reply =
        |s: &mut TcpStream, status: i32, message: &str| wire::write_frame(s, kind::HELLO_ACK, &ack(status, message));
    let Some(comm) = index_find(key, dst) else {
        let _ = reply(&mut s, HCCL_E_NOT_FOUND, "no such communicator (yet) at this endpoint");
        return;
    };
    if src >= comm.nranks || src == comm.rank {
        let _ = reply(&mut s, HCCL_E_PARA, &format!("rank {src} is not a peer in this communicator"));
        return;
    }
    match purpose {
        purpose::CLUSTER_LINK if comm.role == Role::Cluster => {
            let mut pending = lock(&comm.pending);
            if pending.contains_key(&src) || lock(&comm.links).contains_key(&src) {
                drop(pending);
                let _ = reply(&mut s, HCCL_E_PARA, &format!("rank {src} is already linked"));
                return;
            }
            if reply(&mut s, HCCL_SUCCESS, "").is_ok() {
                pending.insert(src, s);
                comm.pending_cv.notify_all();
            }
        }
        #[cfg(feature = "onesided")]
        purpose::ONE_SIDED if comm.role == Role::OneSided => {
            if reply(&mut s, HCCL_SUCCESS, "").is_ok() {
                if let Ok(c) = s.try_clone() {
                    lock(&comm.served).push(c);
                }
                let (key, rank) = (comm.key, comm.rank);
                drop(comm);
                crate::hccl_one_sided::serve_connection(s, key, rank, src);
            }
        }
        _ => {
            let _ = reply(&mut s, HCCL_E_NOT_SUPPORT, "the communicator does not support this kind of connection");
        }
    }
}
