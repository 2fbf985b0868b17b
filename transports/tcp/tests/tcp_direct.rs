//! The direct path: a caller that submits one request and waits for it on its own thread
//! (`submit_for_blocking_wait`, `transfer_blocking`) has the request's whole round trip done on
//! that thread over an idle direct connection, with no hand-off to an I/O thread; everything
//! else goes through the lanes, as before.
//!
//! The tests count where requests went with `TcpTransport::stats` (the initiator's transport is
//! captured when the engine creates it) and check that a direct request is finished when
//! `submit_for_blocking_wait` returns, which only a request completed on the caller's own thread
//! can be.

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ferry::{
    Config, Environment, ErrorKind, InProcessMetadata, Location, MetadataStore, Opcode, OptionSpec, OptionValue,
    SegmentDescriptor, SegmentHandle, TransferEngine, TransferRequest, Transport, TransportContext, TransportFactory,
    TransportRegistry,
};
use ferry_test_support::{Buffer, fake_tcp_peer, pattern_buffer, tcp_only};
use ferry_transport_tcp::wire::{Header, Status};
use ferry_transport_tcp::{TcpEndpoint, TcpStats, TcpTransport, TcpTransportFactory};

/// The TCP transport's factory, keeping the transport it creates for the test to look at.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Option<Arc<TcpTransport>>>>);

impl Capture {
    fn stats(&self) -> TcpStats {
        self.0.lock().unwrap().as_ref().expect("the engine created its tcp transport").stats()
    }
}

#[async_trait]
impl TransportFactory for Capture {
    fn protocol(&self) -> &'static str {
        "tcp"
    }
    fn options(&self) -> &'static [OptionSpec] {
        TcpTransportFactory.options()
    }
    fn read_options(&self, config: &Config, env: &Environment) -> Vec<OptionValue> {
        TcpTransportFactory.read_options(config, env)
    }
    async fn create(&self, ctx: &TransportContext) -> ferry::Result<Arc<dyn Transport>> {
        let t = Arc::new(TcpTransport::start(ctx).await?);
        *self.0.lock().unwrap() = Some(t.clone());
        Ok(t)
    }
}

/// A TCP-only engine, built for blocking callers, on `meta`.
fn engine(
    meta: &Arc<InProcessMetadata>,
    name: &str,
    transports: TransportRegistry,
    timeout: Duration,
) -> TransferEngine {
    ferry::builder()
        .transports(transports)
        .protocol("tcp")
        .segment_name(name)
        .metadata(meta.clone() as Arc<dyn MetadataStore>)
        .transfer_timeout(timeout)
        .build_blocking()
        .unwrap()
}

/// An initiator whose TCP transport the test can look at.
fn initiator(meta: &Arc<InProcessMetadata>, timeout: Duration) -> (TransferEngine, Capture) {
    let capture = Capture::default();
    let e = engine(meta, "127.0.0.1:2", TransportRegistry::new().with(Arc::new(capture.clone())), timeout);
    (e, capture)
}

/// An engine with peer authentication's shared secret `secret`; with `capture`, its TCP
/// transport is kept there.
fn with_secret(meta: &Arc<InProcessMetadata>, name: &str, secret: &str, capture: Option<&Capture>) -> TransferEngine {
    let transports = match capture {
        Some(c) => TransportRegistry::new().with(Arc::new(c.clone())),
        None => tcp_only(),
    };
    let mut b = ferry::builder()
        .transports(transports)
        .protocol("tcp")
        .segment_name(name)
        .metadata(meta.clone() as Arc<dyn MetadataStore>)
        .transfer_timeout(Duration::from_secs(5));
    b.config_mut().set_option(&ferry_peer_auth::SECRET, secret);
    b.build_blocking().unwrap()
}

fn req(opcode: Opcode, source: u64, target: SegmentHandle, target_offset: u64, length: u64) -> TransferRequest {
    TransferRequest { opcode, source, target, target_offset, length }
}

/// Runs single requests until one goes direct (the first request to a peer goes through a lane
/// and has its direct connection opened meanwhile); fails after 5 s.
fn until_direct(e: &TransferEngine, capture: &Capture, r: TransferRequest) {
    let t = Instant::now();
    loop {
        let before = capture.stats().direct;
        e.transfer_blocking(&[r]).unwrap();
        if capture.stats().direct > before {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "no request went direct in 5 s: {:?}", capture.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Submits `r` for a waiting caller and checks it ran on this thread: finished when the submit
/// returned, counted as direct, nothing handed to a lane.
fn direct(e: &TransferEngine, capture: &Capture, r: TransferRequest) {
    let before = capture.stats();
    let batch = e.submit_for_blocking_wait(&[r]).unwrap();
    assert!(batch.is_done(), "a direct request is finished when its submit returns");
    batch.wait_ok_blocking(Duration::from_secs(5)).unwrap();
    let after = capture.stats();
    assert_eq!(
        (after.direct - before.direct, after.queued - before.queued),
        (1, 0),
        "{r:?} went through a lane: {before:?} -> {after:?}"
    );
}

#[test]
fn a_waiting_callers_single_request_runs_on_its_own_thread() {
    const LEN: usize = 4 << 20;
    let meta = InProcessMetadata::new();
    let target = engine(&meta, "127.0.0.1:1", tcp_only(), Duration::from_secs(5));
    let remote = pattern_buffer(LEN, 7);
    unsafe { target.register_memory_blocking(remote.addr(), remote.len(), Location::Cpu(0)) }.unwrap();
    let (e, capture) = initiator(&meta, Duration::from_secs(5));
    let local = Buffer::zeroed(LEN);
    let out = pattern_buffer(LEN, 9);
    unsafe { e.register_memory_blocking(local.addr(), local.len(), Location::Cpu(0)) }.unwrap();
    unsafe { e.register_memory_blocking(out.addr(), out.len(), Location::Cpu(0)) }.unwrap();
    let peer = e.block_on(e.open_segment("127.0.0.1:1")).unwrap().unwrap();
    let (l, o, r) = (local.addr(), out.addr(), remote.addr());

    until_direct(&e, &capture, req(Opcode::Read, l, peer, r, 4096));
    for (i, &len) in [4096u64, 1 << 20].iter().enumerate() {
        let at = (i as u64 + 1) << 20;
        // READ into local at `at`, WRITE from out at `at` to remote at `at`.
        direct(&e, &capture, req(Opcode::Read, l + at, peer, r + at, len));
        assert_eq!(
            &local.bytes()[at as usize..(at + len) as usize],
            &remote.bytes()[at as usize..(at + len) as usize],
            "READ of {len}"
        );
        direct(&e, &capture, req(Opcode::Write, o + at, peer, r + at, len));
        assert_eq!(
            &remote.bytes()[at as usize..(at + len) as usize],
            &out.bytes()[at as usize..(at + len) as usize],
            "WRITE of {len}"
        );
    }
    // `transfer_blocking` goes direct too.
    let before = capture.stats();
    e.transfer_blocking(&[req(Opcode::Read, l, peer, r, 4096)]).unwrap();
    assert_eq!(capture.stats().direct, before.direct + 1);

    // Everything else goes through the lanes, as before: a submit whose caller does not wait at
    // once, the async API, and batches of more than one request.
    let before = capture.stats();
    e.submit_blocking(&[req(Opcode::Read, l, peer, r, 4096)])
        .unwrap()
        .wait_ok_blocking(Duration::from_secs(5))
        .unwrap();
    e.block_on(e.transfer(&[req(Opcode::Read, l, peer, r, 4096)])).unwrap().unwrap();
    e.transfer_blocking(&[req(Opcode::Read, l, peer, r, 4096), req(Opcode::Read, l + 4096, peer, r + 4096, 4096)])
        .unwrap();
    let after = capture.stats();
    assert_eq!((after.direct, after.queued), (before.direct, before.queued + 4), "{before:?} -> {after:?}");

    e.shutdown_blocking().unwrap();
    target.shutdown_blocking().unwrap();
}

/// With peer authentication on, direct connections prove the secret as the lanes' do (the
/// target serves nothing on a connection that did not), and requests go direct.
#[test]
fn direct_connections_prove_peer_authentication() {
    const SECRET: &str = "the cluster's shared secret for the direct path";
    let meta = InProcessMetadata::new();
    let target = with_secret(&meta, "127.0.0.1:1", SECRET, None);
    let remote = pattern_buffer(1 << 20, 11);
    unsafe { target.register_memory_blocking(remote.addr(), remote.len(), Location::Cpu(0)) }.unwrap();
    let capture = Capture::default();
    let e = with_secret(&meta, "127.0.0.1:2", SECRET, Some(&capture));
    let local = Buffer::zeroed(1 << 20);
    unsafe { e.register_memory_blocking(local.addr(), local.len(), Location::Cpu(0)) }.unwrap();
    let peer = e.block_on(e.open_segment("127.0.0.1:1")).unwrap().unwrap();
    let r = req(Opcode::Read, local.addr(), peer, remote.addr(), 1 << 20);
    until_direct(&e, &capture, r);
    direct(&e, &capture, r);
    assert_eq!(local.bytes(), remote.bytes());
    e.shutdown_blocking().unwrap();
    target.shutdown_blocking().unwrap();
}

/// The descriptor of `d`'s engine as a v1 peer (no `tcp_proto_version`), under `name`.
fn as_v1(d: &SegmentDescriptor, name: &str) -> SegmentDescriptor {
    let mut v1 = d.clone();
    v1.name = name.to_owned();
    let mut endpoint = TcpEndpoint::from_descriptor(d).unwrap().unwrap();
    endpoint.proto_version = None;
    endpoint.fence = None;
    v1.extra.remove("tcp_proto_version");
    v1.extra.remove("ferry_tcp_fence");
    endpoint.write_to(&mut v1).unwrap();
    v1
}

#[test]
fn a_v1_peer_is_served_through_the_lanes() {
    let meta = InProcessMetadata::new();
    let target = engine(&meta, "127.0.0.1:1", tcp_only(), Duration::from_secs(5));
    let remote = pattern_buffer(1 << 20, 3);
    unsafe { target.register_memory_blocking(remote.addr(), remote.len(), Location::Cpu(0)) }.unwrap();
    let v1 = as_v1(&target.local_descriptor(), "old-peer");
    assert!(TcpEndpoint::from_descriptor(&v1).unwrap().unwrap().version() < 2);
    e_block_put(&meta, &v1);
    let (e, capture) = initiator(&meta, Duration::from_secs(5));
    let local = Buffer::zeroed(1 << 20);
    let out = pattern_buffer(1 << 20, 4);
    unsafe { e.register_memory_blocking(local.addr(), local.len(), Location::Cpu(0)) }.unwrap();
    unsafe { e.register_memory_blocking(out.addr(), out.len(), Location::Cpu(0)) }.unwrap();
    let peer = e.block_on(e.open_segment("old-peer")).unwrap().unwrap();
    for _ in 0..20 {
        e.transfer_blocking(&[req(Opcode::Read, local.addr(), peer, remote.addr(), 4096)]).unwrap();
        e.transfer_blocking(&[req(Opcode::Write, out.addr() + 8192, peer, remote.addr() + 8192, 4096)]).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(&local.bytes()[..4096], &remote.bytes()[..4096]);
    assert_eq!(&remote.bytes()[8192..12288], &out.bytes()[8192..12288]);
    assert_eq!(capture.stats(), TcpStats { direct: 0, queued: 40 });
    e.shutdown_blocking().unwrap();
    target.shutdown_blocking().unwrap();
}

fn e_block_put(meta: &Arc<InProcessMetadata>, d: &SegmentDescriptor) {
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    rt.block_on(MetadataStore::put(&**meta, &format!("mooncake/ram/{}", d.name), &d.to_json())).unwrap();
}

/// A fake v2 target over `len` bytes at `addr` that answers READs and never answers a WRITE.
fn silent_on_writes(addr: u64, len: u64) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let mut hdr = [0u8; 24];
                while s.read_exact(&mut hdr).is_ok() {
                    let Ok(h) = Header::decode(&hdr) else { return };
                    assert!(h.addr >= addr && h.addr + h.size <= addr + len);
                    if h.opcode == Opcode::Write {
                        let mut payload = vec![0u8; h.size as usize];
                        let _ = s.read_exact(&mut payload);
                        // Never answered: keep the connection open until the peer closes it.
                        let _ = s.read(&mut [0u8; 1]);
                        return;
                    }
                    let _ = s.write_all(&Status::Ok.encode());
                    let _ = s.write_all(&vec![0u8; h.size as usize]);
                }
            });
        }
    });
    port
}

/// A caller blocked in a direct request (its target never answers) is released by the
/// transport's shutdown, long before the request's deadline, with `Shutdown`.
#[test]
fn shutdown_releases_a_caller_blocked_in_a_direct_request() {
    const REMOTE: u64 = 0x3000_0000;
    let port = silent_on_writes(REMOTE, 1 << 20);
    let meta = InProcessMetadata::new();
    e_block_put(&meta, &fake_tcp_peer("silent", port, REMOTE, 1 << 20, None));
    let (e, capture) = initiator(&meta, Duration::from_secs(30));
    let local = pattern_buffer(1 << 16, 5);
    unsafe { e.register_memory_blocking(local.addr(), local.len(), Location::Cpu(0)) }.unwrap();
    let peer = e.block_on(e.open_segment("silent")).unwrap().unwrap();
    until_direct(&e, &capture, req(Opcode::Read, local.addr(), peer, REMOTE, 4096));
    let before = capture.stats();
    let stopper = {
        let e = e.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            e.shutdown_blocking()
        })
    };
    let t = Instant::now();
    let err = e.transfer_blocking(&[req(Opcode::Write, local.addr(), peer, REMOTE, 4096)]).unwrap_err();
    let took = t.elapsed();
    assert_eq!(err.kind(), ErrorKind::Shutdown, "{err}");
    assert!(took < Duration::from_secs(5), "released after {took:?}");
    assert_eq!(capture.stats().direct, before.direct + 1, "the WRITE went direct: {:?}", capture.stats());
    stopper.join().unwrap().unwrap();
}
