//! The server side of an emulated HIXL engine: accepts links on the engine's `ip:port` and
//! serves their transfers from the engine's registrations.
//!
//! A link sees the registrations the server had when the link was made, minus `local_only`
//! ones: "memory registered after a link exists cannot be accessed remotely over that link"
//! (HIXL `docs/zh/api/cpp/HIXL-interface.md`, Connect constraints: "否则建链后注册不支持远端访问";
//! the legacy engine hands its segment list over at connect time, `channel_msg_handler.cc`
//! l.306-320). Every request is checked against that view *and* the current registrations
//! (a range deregistered since is refused with FAILED, an inference: the device mapping is gone).

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::engine::{OP_READ, Region, Shared};
use super::options::Mode;
use super::wire as hw;
use crate::boundary::{debug, lock};
use crate::codes::*;
use crate::faults::faults;
use crate::wire::{MAX_FRAME, kind, read_frame, recv_raw, send_raw, set_timeouts, write_frame};

/// Symbol name of the server's link handshake for `FERRY_CANN_EMU_DELAY_US`/`FERRY_CANN_EMU_FAIL`.
pub(crate) const SERVE_CONNECT: &str = "hixl.ServeConnect";
/// Symbol name of the server's handling of one transfer batch.
pub(crate) const SERVE_TRANSFER: &str = "hixl.ServeTransfer";

/// Accepts links until the engine closes.
pub(crate) fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let accepted = listener.accept();
        if shared.closed.load(Ordering::Acquire) {
            return;
        }
        match accepted {
            Ok((stream, _)) => {
                let sh = Arc::clone(&shared);
                let _ = std::thread::Builder::new().name("hixl-emu-link".into()).spawn(move || serve(sh, stream));
            }
            Err(e) => {
                debug(|| format!("hixl server {}: accept failed: {e}", shared.name));
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }
}

static NEXT_LINK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn serve(shared: Arc<Shared>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let _ = set_timeouts(&stream, Some(hw::HELLO_WAIT));
    let Ok(hello) = crate::wire::expect_frame(&mut stream, kind::HX_HELLO, 64 << 10) else { return };
    let mut d = crate::wire::Dec::new(&hello);
    let (Ok(client), Ok(mode)) = (d.str(), d.u8()) else { return };
    let f = faults();
    if let Some(delay) = f.delay(SERVE_CONNECT) {
        std::thread::sleep(delay);
    }
    let refuse = |stream: &mut TcpStream, status: u32, message: String| {
        debug(|| format!("hixl server {}: refused link from {client}: {message}", shared.name));
        let _ = write_frame(stream, kind::HX_HELLO_ACK, &hw::hello_ack(status, &message, &[]));
    };
    if let Some((n, _)) = f.injected_failure(SERVE_CONNECT) {
        return refuse(&mut stream, HIXL_FAILED, format!("injected failure of {SERVE_CONNECT} #{n}"));
    }
    if shared.closed.load(Ordering::Acquire) {
        return refuse(&mut stream, HIXL_FAILED, "the engine is finalizing".into());
    }
    // Both ends must run the same engine (an inference: the legacy and CS engines speak
    // different link protocols, `engine_factory.cc` l.38-77).
    if hw::mode_of(mode) != Some(shared.mode) {
        return refuse(
            &mut stream,
            HIXL_FAILED,
            format!("engine mode mismatch: the client runs {:?}, this server {:?}", hw::mode_of(mode), shared.mode),
        );
    }
    if shared.mode == Mode::Legacy && shared.link_count() >= shared.max_links {
        return refuse(
            &mut stream,
            HIXL_RESOURCE_EXHAUSTED,
            format!("channel resource exhausted ({} links)", shared.max_links),
        );
    }
    let view: Vec<Arc<Region>> = lock(&shared.regions).iter().filter(|r| !r.local_only).cloned().collect();
    let listed: Vec<(u64, u64, u8)> = view.iter().map(|r| (r.addr as u64, r.len as u64, r.mem_type as u8)).collect();
    let id = NEXT_LINK.fetch_add(1, Ordering::Relaxed);
    match stream.try_clone() {
        Ok(c) => {
            lock(&shared.incoming).insert(id, c);
        }
        Err(_) => return,
    }
    if write_frame(&mut stream, kind::HX_HELLO_ACK, &hw::hello_ack(HIXL_SUCCESS, "", &listed)).is_err() {
        lock(&shared.incoming).remove(&id);
        return;
    }
    debug(|| format!("hixl server {}: link from {client} ({} regions visible)", shared.name, listed.len()));
    let _ = set_timeouts(&stream, None);
    while let Ok((k, payload)) = read_frame(&mut stream, MAX_FRAME) {
        match k {
            kind::HX_XFER => {
                if serve_batch(&shared, &view, &mut stream, &payload).is_err() {
                    break;
                }
            }
            kind::HX_BYE => {
                let _ = write_frame(&mut stream, kind::HX_BYE_ACK, &[]);
                break;
            }
            _ => break,
        }
    }
    lock(&shared.incoming).remove(&id);
    let _ = stream.shutdown(std::net::Shutdown::Both);
    debug(|| format!("hixl server {}: link from {client} closed", shared.name));
}

/// Serves one batch; `Err` when the link must close.
fn serve_batch(shared: &Shared, view: &[Arc<Region>], stream: &mut TcpStream, payload: &[u8]) -> std::io::Result<()> {
    let batch = hw::decode_batch(payload)?;
    let f = faults();
    if let Some(delay) = f.delay(SERVE_TRANSFER) {
        std::thread::sleep(delay);
    }
    let refuse = |stream: &mut TcpStream, message: String| {
        debug(|| format!("hixl server {}: refused a batch: {message}", shared.name));
        write_frame(stream, kind::HX_XFER_ACK, &hw::status_frame(HIXL_FAILED, &message))
    };
    if let Some((n, _)) = f.injected_failure(SERVE_TRANSFER) {
        return refuse(stream, format!("injected failure of {SERVE_TRANSFER} #{n}"));
    }
    let current = lock(&shared.regions).clone();
    let mut targets: Vec<(Arc<Region>, usize, usize)> = Vec::with_capacity(batch.ranges.len());
    for &(addr, len) in &batch.ranges {
        let (Ok(addr), Ok(len)) = (usize::try_from(addr), usize::try_from(len)) else {
            return refuse(stream, format!("range {addr:#x}..+{len} is not addressable"));
        };
        let found = view
            .iter()
            .find(|r| addr >= r.addr && addr.checked_add(len).is_some_and(|e| e <= r.addr + r.len) && len > 0);
        let Some(region) = found else {
            return refuse(stream, format!("{addr:#x}..+{len} is not in a registration this link may access"));
        };
        if !current.iter().any(|c| Arc::ptr_eq(c, region)) {
            return refuse(stream, format!("{addr:#x}..+{len}: its registration was deregistered"));
        }
        targets.push((Arc::clone(region), addr, len));
    }
    write_frame(stream, kind::HX_XFER_ACK, &hw::status_frame(HIXL_SUCCESS, ""))?;
    if batch.op == OP_READ {
        for (_keep, addr, len) in &targets {
            // SAFETY: `[addr, +len)` lies inside a registration whose allocation `_keep` holds.
            unsafe { send_raw(stream, *addr as *const u8, *len) }?;
        }
    } else {
        for (_keep, addr, len) in &targets {
            // SAFETY: as above, for writing.
            unsafe { recv_raw(stream, *addr as *mut u8, *len) }?;
        }
        write_frame(stream, kind::HX_XFER_DONE, &hw::status_frame(HIXL_SUCCESS, ""))?;
    }
    Ok(())
}
