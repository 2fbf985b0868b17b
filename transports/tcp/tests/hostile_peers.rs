//! Hostile peers against live engines (the `tcp` transport and the P2P handshake, real sockets
//! on loopback), from a seeded generator of frames:
//!
//! - [`a_live_engine_survives_hostile_peers`]: clients from many loopback addresses send the
//!   target's data port valid, mutated and random frames (bad opcodes, huge sizes, addresses
//!   outside registered memory, wrapping ranges, truncated headers and payloads, early closes),
//!   hold idle and half-sent connections open, and send its handshake listener bad lengths,
//!   invalid JSON, oversized bodies and notifications in other engines' names, all at once,
//!   while a legitimate peer transfers and notifies. Each answer is the one the wire defines
//!   (data and status 0, status 1, or a closed connection without a byte), no byte outside the
//!   registered region changes (canaries on both sides), the legitimate peer is served
//!   throughout and after, and nothing panics.
//! - [`an_initiator_survives_hostile_handshake_listeners_and_targets`]: the engine as client,
//!   against a handshake listener answering garbage and a data target answering bad status
//!   frames, short or long payloads, random bytes, silence or a closed connection: every call
//!   ends in time, with a result or a clean error, and no byte around the initiator's
//!   destination buffer changes.
//!
//! The seed is printed first (shown when a test fails); `FERRY_FAULT_SEED=<seed>` replays it.

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry::{ErrorKind, Location, Notification, Opcode, SegmentDescriptor, TransferEngine, TransferRequest};
use ferry_metadata_p2p::frame::{DEFAULT_MAX_FRAME, FrameType, encode, read_frame};
use ferry_test_support::{Buffer, p2p_tcp_engine, pattern, pattern_buffer};
use ferry_transport_tcp::TcpEndpoint;
use ferry_transport_tcp::wire::{HEADER_LEN, Header, STATUS_LEN, Status};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod fault;
use fault::{Rng, seed};

/// Longest any single answer may take before the test calls it a hang.
const ANSWER: Duration = Duration::from_secs(10);

/// A connection to `127.0.0.1:port` from `127.0.0.<host>` (every 127/8 address is loopback):
/// hostile clients come from many addresses, as they would from many hosts.
async fn connect_from(host: u8, port: u16) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from(([127, 0, 0, host], 0)))?;
    socket.connect(SocketAddr::from(([127, 0, 0, 1], port))).await
}

/// Reads until the peer closes; the bytes received before it did. A reset counts as closed.
async fn until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let read = tokio::time::timeout(ANSWER, async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    });
    assert!(read.await.is_ok(), "the connection was not closed within {ANSWER:?}");
    got
}

async fn read_exactly(s: &mut TcpStream, n: usize, what: &str) -> Vec<u8> {
    let mut b = vec![0u8; n];
    match tokio::time::timeout(ANSWER, s.read_exact(&mut b)).await {
        Ok(Ok(_)) => b,
        Ok(Err(e)) => panic!("{what}: connection failed before {n} bytes arrived: {e}"),
        Err(_) => panic!("{what}: no answer within {ANSWER:?}"),
    }
}

async fn status(s: &mut TcpStream, what: &str) -> Status {
    let b = read_exactly(s, STATUS_LEN, what).await;
    Status::decode(&b.try_into().unwrap()).unwrap_or_else(|e| panic!("{what}: the target sent a bad status frame: {e}"))
}

/// The target's registered region, inside a larger allocation whose other bytes (the canaries)
/// no peer may change, in three zones: read-only (a known pattern nobody writes), scratch
/// (hostile writes land here), and the legitimate peer's.
struct Guarded {
    buf: Buffer,
    canaries: Vec<u8>,
}

const CANARY: u64 = 4096;
const ZONE: u64 = 16 << 10;
const RO: u64 = 0;
const SCRATCH: u64 = ZONE;
const LEGIT: u64 = 3 * ZONE;
const REGION: u64 = 4 * ZONE;

impl Guarded {
    fn new() -> Self {
        let buf = Buffer::filled((2 * CANARY + REGION) as usize, 0xC5);
        let canaries = outside(&buf, REGION);
        Self { buf, canaries }
    }
    /// The first registered byte.
    fn base(&self) -> u64 {
        self.buf.addr() + CANARY
    }
    fn region(&self) -> &[u8] {
        &self.buf.bytes()[CANARY as usize..(CANARY + REGION) as usize]
    }
    fn assert_canaries(&self) {
        let now = outside(&self.buf, REGION);
        let changed = now.iter().zip(&self.canaries).filter(|(a, b)| a != b).count();
        assert_eq!(changed, 0, "{changed} byte(s) outside the registered region changed");
    }
}

/// The bytes of `buf` outside `[CANARY, CANARY + len)`.
fn outside(buf: &Buffer, len: u64) -> Vec<u8> {
    let b = buf.bytes();
    [&b[..CANARY as usize], &b[(CANARY + len) as usize..]].concat()
}

/// What the target must answer to one hostile action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Status 0 (v2) and then `len` bytes, which equal the region's from `offset` when
    /// `offset` is in the read-only zone.
    Data { v2: bool, offset: u64, len: u64 },
    /// Status 0 (a v2 write).
    Ok,
    /// No answer (a v1 write); the next request's answer comes after it.
    Nothing,
    /// Status 1, the connection stays.
    Rejected,
    /// Status 1, then the connection closes (a rejected write too large to drain).
    RejectedThenClosed,
    /// The connection closes without a byte.
    Closed,
    /// The client gives up on the connection itself (truncated or abandoned input).
    Abandoned,
}

/// One hostile action on the data port: the bytes to send and what must come back.
fn data_action(rng: &mut Rng, base: u64) -> (Vec<u8>, Expect) {
    let v2 = rng.below(5) != 0;
    let hdr = |size: u64, addr: u64, opcode: Opcode, v2: bool| Header { size, addr, opcode, v2 }.encode().to_vec();
    let rejected = |v2: bool| if v2 { Expect::Rejected } else { Expect::Closed };
    match rng.below(14) {
        // Valid reads: of the read-only zone (checked byte for byte) or of the scratch zone.
        0 | 1 => {
            let (zone, zone_len) = rng.pick(&[(RO, ZONE), (SCRATCH, 2 * ZONE)]);
            let len = rng.len_upto(&[16, 4096, zone_len]).min(zone_len);
            let offset = zone + rng.below(zone_len - len + 1);
            (hdr(len, base + offset, Opcode::Read, v2), Expect::Data { v2, offset, len })
        }
        // Valid writes of random bytes into the scratch zone.
        2 | 3 => {
            let len = rng.len_upto(&[16, 4096, 2 * ZONE]);
            let offset = SCRATCH + rng.below(2 * ZONE - len + 1);
            let mut b = hdr(len, base + offset, Opcode::Write, v2);
            b.extend(rng.bytes(len as usize));
            (b, if v2 { Expect::Ok } else { Expect::Nothing })
        }
        // Out of registered memory: in the canaries, straddling an edge, far away, wrapping
        // around the address space, too long, or empty.
        4..=6 => {
            let (addr, size) = rng.pick(&[
                (base - CANARY, 64),
                (base - 1, 2),
                (base + REGION - 8, 16),
                (base + REGION, 1),
                (base + REGION + CANARY - 1, 1),
                (base, REGION + 1),
                (base, 0),
                (0, 16),
                (8, 1),
                (1 << 40, 4096),
                (u64::MAX - 7, 16),
                (u64::MAX, 1),
                (base + 16, u64::MAX - 8),
                (base, u64::MAX),
            ]);
            let opcode = rng.pick(&[Opcode::Read, Opcode::Write]);
            let mut b = hdr(size, addr, opcode, v2);
            if opcode == Opcode::Write && v2 && size <= 4096 {
                b.extend(rng.bytes(size as usize)); // drained by the target
            } else if opcode == Opcode::Write && v2 {
                // Larger than the target drains: rejected, then closed. Nothing more is sent.
                return (b, if size > 16 << 20 { Expect::RejectedThenClosed } else { Expect::Abandoned });
            }
            (b, rejected(v2))
        }
        // A huge read or write at a registered address.
        7 => {
            let size = rng.pick(&[REGION * 2, 1 << 40, u64::MAX]);
            let opcode = rng.pick(&[Opcode::Read, Opcode::Write]);
            let expect = match (v2, opcode) {
                (false, _) => Expect::Closed,
                (true, Opcode::Read) => Expect::Rejected,
                (true, Opcode::Write) if size > 16 << 20 => Expect::RejectedThenClosed,
                (true, Opcode::Write) => return (hdr(size, base, opcode, v2), Expect::Abandoned),
            };
            (hdr(size, base + SCRATCH, opcode, v2), expect)
        }
        // A bad opcode: the connection is closed.
        8 => {
            let mut b = hdr(16, base, Opcode::Read, v2);
            b[16] = (b[16] & 0x80) | (2 + rng.below(126) as u8);
            (b, Expect::Closed)
        }
        // A header cut short, or a write whose payload is cut short, then the client leaves.
        9 => {
            let mut b = hdr(64, base + SCRATCH, Opcode::Write, v2);
            b.truncate(rng.below(HEADER_LEN as u64) as usize + 1);
            (b, Expect::Abandoned)
        }
        10 => {
            let len = 64 + rng.below(8192);
            let mut b = hdr(len, base + SCRATCH + rng.below(ZONE), Opcode::Write, v2);
            b.extend(rng.some_bytes(len));
            (b, Expect::Abandoned)
        }
        // A read whose answer the client does not wait for.
        11 => (hdr(2 * ZONE, base + SCRATCH, Opcode::Read, v2), Expect::Abandoned),
        // Random bytes.
        12 => {
            let n = 1 + rng.below(200) as usize;
            (rng.bytes(n), Expect::Abandoned)
        }
        // A valid header with a random byte of it overwritten (the payload is not sent).
        _ => {
            let (size, offset) = (rng.below(1 << 20), rng.below(REGION));
            let mut b = hdr(size, base + offset, rng.pick(&[Opcode::Read, Opcode::Write]), v2);
            let at = rng.below(HEADER_LEN as u64) as usize;
            b[at] = rng.next() as u8;
            (b, Expect::Abandoned)
        }
    }
}

/// One hostile client of the data port: `actions` actions, reconnecting whenever a connection
/// ends. Checks every answer against [`Expect`].
async fn data_client(mut rng: Rng, host: u8, port: u16, g: Arc<Guarded>, actions: usize) {
    let ro = g.region()[..ZONE as usize].to_vec();
    let mut conn: Option<TcpStream> = None;
    for i in 0..actions {
        let (bytes, expect) = data_action(&mut rng, g.base());
        let what = format!("client 127.0.0.{host}, action {i} ({expect:?}, {} bytes)", bytes.len());
        let s = match conn.as_mut() {
            Some(s) => s,
            None => conn.insert(connect_from(host, port).await.unwrap_or_else(|e| panic!("{what}: connect: {e}"))),
        };
        if s.write_all(&bytes).await.is_err() {
            // Only a connection the target already closed refuses bytes; start afresh.
            assert_eq!(expect, Expect::Abandoned, "{what}: the target closed a connection it should keep");
            conn = None;
            continue;
        }
        match expect {
            Expect::Data { v2, offset, len } => {
                if v2 {
                    assert_eq!(status(s, &what).await, Status::Ok, "{what}");
                }
                let data = read_exactly(s, len as usize, &what).await;
                if offset + len <= RO + ZONE {
                    assert!(data == ro[offset as usize..(offset + len) as usize], "{what}: wrong bytes read");
                }
            }
            Expect::Ok => assert_eq!(status(s, &what).await, Status::Ok, "{what}"),
            Expect::Nothing => {}
            Expect::Rejected => assert_eq!(status(s, &what).await, Status::Rejected, "{what}"),
            Expect::RejectedThenClosed => {
                assert_eq!(status(s, &what).await, Status::Rejected, "{what}");
                assert!(until_closed(s).await.is_empty(), "{what}: bytes after the rejection");
                conn = None;
            }
            Expect::Closed => {
                let got = until_closed(s).await;
                assert!(got.is_empty(), "{what}: {} bytes before the close", got.len());
                conn = None;
            }
            Expect::Abandoned => conn = None,
        }
    }
}

/// The legitimate peer's name in notifications, and the handshake's forged senders.
fn forged_names(legit: &str, target: &str) -> Vec<String> {
    vec![
        legit.to_owned(),
        target.to_owned(),
        String::new(),
        "10.0.0.9:15000".into(),
        "é\u{0}\"".into(),
        "n".repeat(4096),
    ]
}

/// One hostile client of the handshake listener (each connection carries one request).
/// Returns the forged notifications the listener accepted.
async fn handshake_client(
    mut rng: Rng,
    host: u8,
    port: u16,
    names: Arc<Vec<String>>,
    target: String,
    actions: usize,
    big: Arc<AtomicUsize>,
) -> Vec<Notification> {
    let mut forged = Vec::new();
    for i in 0..actions {
        let mut s = connect_from(host, port).await.unwrap();
        let what = format!("handshake client 127.0.0.{host}, action {i}");
        match rng.below(10) {
            // Lengths the listener refuses: zero, just past 1 MiB, huge.
            0 => {
                let len = rng.pick(&[0, DEFAULT_MAX_FRAME + 1, 1 << 40, 1 << 63, u64::MAX]);
                let mut b = len.to_le_bytes().to_vec();
                b.extend(rng.some_bytes(64));
                let _ = s.write_all(&b).await;
                assert!(until_closed(&mut s).await.is_empty(), "{what}: length {len} answered");
            }
            // A notification whose JSON is invalid (sometimes a whole 1 MiB of it, the largest
            // frame), or an RDMA connection frame: closed without an answer.
            1 | 2 => {
                let kind = rng.pick(&[FrameType::Notify, FrameType::Notify, FrameType::Connection]);
                let n = if big.fetch_add(1, Ordering::Relaxed) < 4 { DEFAULT_MAX_FRAME as usize - 1 } else { 200 };
                let mut body = match rng.below(3) {
                    0 => br#"{"name":"a","notify_msg":"#.to_vec(),
                    1 => br#"{"name":7,"notify_msg":"x"}"#.to_vec(),
                    _ => [b"x".to_vec(), rng.some_bytes(n as u64)].concat(),
                };
                if n > 200 {
                    body.resize(n, b' ');
                    body[0] = b'x';
                }
                let _ = s.write_all(&encode(kind, &body)).await;
                assert!(until_closed(&mut s).await.is_empty(), "{what}: invalid {kind:?} answered");
            }
            // A frame cut short, then the client leaves.
            3 => {
                let f = encode(FrameType::Notify, br#"{"name":"a","notify_msg":"b"}"#);
                let _ = s.write_all(&f[..1 + rng.below(f.len() as u64 - 1) as usize]).await;
            }
            // A notification in someone else's name: accepted as what it claims (the listener
            // does not authenticate senders); recorded to tell it from the legitimate ones.
            4 | 5 => {
                let name = names[rng.below(names.len() as u64) as usize].clone();
                let n = Notification { name, notify_msg: format!("forged-{host}-{i}") };
                s.write_all(&encode(FrameType::Notify, &serde_json::to_vec(&n).unwrap())).await.unwrap();
                let reply = tokio::time::timeout(ANSWER, read_frame(&mut s, DEFAULT_MAX_FRAME, ANSWER)).await;
                let reply = reply.unwrap_or_else(|_| panic!("{what}: no reply")).unwrap();
                assert_eq!(reply.kind, FrameType::Notify);
                let ok: Notification = serde_json::from_slice(&reply.payload).unwrap();
                assert_eq!(ok.notify_msg, "success", "{what}");
                forged.push(n);
            }
            // A probe, and a metadata request (new protocol, or the old one without a type
            // byte), with a random body: answered, and nothing else on that connection.
            6 | 7 => {
                let body = [b"x".to_vec(), rng.some_bytes(100)].concat();
                let (frame, want) = match rng.below(3) {
                    0 => (encode(FrameType::Probe, &body), FrameType::Probe),
                    1 => (encode(FrameType::Metadata, &body), FrameType::Metadata),
                    _ => {
                        let mut f = (body.len() as u64 + 1).to_le_bytes().to_vec();
                        f.push(b'{');
                        f.extend_from_slice(&body);
                        (f, FrameType::Metadata)
                    }
                };
                s.write_all(&frame).await.unwrap();
                let reply = read_frame(&mut s, DEFAULT_MAX_FRAME, ANSWER).await.unwrap();
                assert_eq!(reply.kind, want, "{what}");
                if want == FrameType::Metadata {
                    let d = SegmentDescriptor::from_json("target", &reply.payload).unwrap();
                    assert_eq!(d.name, target);
                } else {
                    assert_eq!(reply.payload, br#"{"status":"success"}"#);
                }
                // One request per connection: a second one is not answered.
                let _ = s.write_all(&encode(FrameType::Probe, b"{}")).await;
                assert!(until_closed(&mut s).await.is_empty(), "{what}: a second request was answered");
            }
            // Random bytes.
            8 => {
                let _ = s.write_all(&[vec![0xEE], rng.some_bytes(64)].concat()).await;
            }
            // Connect and leave at once.
            _ => {}
        }
    }
    forged
}

fn req(opcode: Opcode, source: u64, target: ferry::SegmentHandle, target_offset: u64, length: u64) -> TransferRequest {
    TransferRequest { opcode, source, target, target_offset, length }
}

/// The legitimate peer: writes fresh bytes into its zone of the target and reads them back,
/// reads the read-only zone, and notifies (messages `<label>-<round>`), at least three rounds
/// and until `stop`; returns the rounds it completed and the messages it sent.
async fn legit_peer(
    initiator: &TransferEngine,
    target: &str,
    g: &Guarded,
    label: &str,
    stop: &AtomicBool,
) -> (usize, Vec<String>) {
    let local = Buffer::zeroed(2 * ZONE as usize);
    unsafe { initiator.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = initiator.open_segment(target).await.unwrap();
    let (mut rounds, mut sent) = (0, Vec::new());
    while rounds < 3 || !stop.load(Ordering::Relaxed) {
        let src = pattern_buffer(ZONE as usize, rounds as u64 + 11);
        unsafe { initiator.register_memory(src.addr(), src.len(), Location::Cpu(0)).await }.unwrap();
        initiator.transfer(&[req(Opcode::Write, src.addr(), peer, g.base() + LEGIT, ZONE)]).await.unwrap();
        initiator
            .transfer(&[
                req(Opcode::Read, local.addr(), peer, g.base() + LEGIT, ZONE),
                req(Opcode::Read, local.addr() + ZONE, peer, g.base() + RO, ZONE),
            ])
            .await
            .unwrap();
        assert!(local.bytes()[..ZONE as usize] == *src.bytes(), "round {rounds}: the legitimate write read back");
        assert!(local.bytes()[ZONE as usize..] == g.region()[..ZONE as usize], "round {rounds}: the read-only zone");
        initiator.unregister_memory(src.addr()).await.unwrap();
        let msg = format!("{label}-{rounds}");
        initiator.send_notification(target, msg.clone()).await.unwrap();
        sent.push(msg);
        rounds += 1;
    }
    initiator.unregister_memory(local.addr()).await.unwrap();
    (rounds, sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_engine_survives_hostile_peers() {
    let rng = seed("a_live_engine_survives_hostile_peers");
    let panics = fault::panics();
    let panics_before = panics.load(Ordering::SeqCst);
    let started = Instant::now();

    let target = p2p_tcp_engine(Duration::from_secs(2)).await;
    let initiator = p2p_tcp_engine(ANSWER).await;
    let g = Arc::new(Guarded::new());
    unsafe { target.register_memory(g.base(), REGION, Location::Cpu(0)).await }.unwrap();
    let data_port = TcpEndpoint::from_descriptor(&target.local_descriptor()).unwrap().unwrap().port;
    let rpc_port = target.rpc_port().unwrap();

    // Connections held open all along: silent or half-sent frames to the handshake listener,
    // idle connections and half-sent headers to the data port.
    let mut held = Vec::new();
    for i in 0..150u16 {
        let (port, sent) = match i % 3 {
            0 => (rpc_port, usize::from(i % 2) * 5),
            1 => (data_port, 0),
            _ => (data_port, 10),
        };
        let mut s = connect_from(2 + (i % 100) as u8, port).await.unwrap();
        s.write_all(&rng.fork(1000 + u64::from(i)).bytes(sent)).await.unwrap();
        held.push(s);
    }

    let stop = Arc::new(AtomicBool::new(false));
    let names = Arc::new(forged_names(initiator.segment_name(), target.segment_name()));
    let big = Arc::new(AtomicUsize::new(0));
    let mut data = tokio::task::JoinSet::new();
    for c in 0..48u64 {
        data.spawn(data_client(rng.fork(c), 2 + (c % 100) as u8, data_port, g.clone(), 80));
    }
    let mut hs = tokio::task::JoinSet::new();
    for c in 0..24u64 {
        let (names, name, big) = (names.clone(), target.segment_name().to_owned(), big.clone());
        hs.spawn(handshake_client(rng.fork(100 + c), 102 + c as u8, rpc_port, names, name, 40, big));
    }
    let barrage = async {
        while let Some(r) = data.join_next().await {
            r.expect("a hostile data client found a wrong answer");
        }
        let mut forged = Vec::new();
        while let Some(r) = hs.join_next().await {
            forged.extend(r.expect("a hostile handshake client found a wrong answer"));
        }
        stop.store(true, Ordering::Relaxed);
        forged
    };
    let (forged, (rounds, legit)) =
        tokio::join!(barrage, legit_peer(&initiator, target.segment_name(), &g, "legit", &stop));
    let barrage_took = started.elapsed();

    // After: the legitimate peer is still served, and nothing outside the region changed.
    let (_, more) = legit_peer(&initiator, target.segment_name(), &g, "legit-after", &AtomicBool::new(true)).await;
    g.assert_canaries();
    // The handshake listener closed the connections that never completed a request, and the
    // data port those that stopped inside a header; idle data connections may stay.
    for (i, mut s) in held.into_iter().enumerate() {
        if i % 3 != 1 {
            assert!(until_closed(&mut s).await.is_empty(), "held connection {i} was answered");
        }
    }

    // Every notification is a legitimate one (all of them arrived, named by their sender) or a
    // forged one exactly as the forger sent it.
    let got = target.get_notifications();
    let forged: HashSet<(String, String)> = forged.into_iter().map(|n| (n.name, n.notify_msg)).collect();
    let mut legit_seen = HashSet::new();
    for n in &got {
        if n.name == initiator.segment_name() && n.notify_msg.starts_with("legit-") {
            legit_seen.insert(n.notify_msg.clone());
        } else {
            assert!(forged.contains(&(n.name.clone(), n.notify_msg.clone())), "unexpected notification {n:?}");
        }
    }
    for m in legit.iter().chain(&more) {
        assert!(legit_seen.contains(m), "legitimate notification {m} lost");
    }
    assert_eq!(got.len(), legit_seen.len() + forged.len(), "every accepted notification is kept once");

    target.shutdown().await.unwrap();
    initiator.shutdown().await.unwrap();
    assert_eq!(panics.load(Ordering::SeqCst), panics_before, "something panicked (see the output above)");
    eprintln!(
        "hostile peers: {rounds} legitimate rounds during the barrage ({barrage_took:?}), {} forged notifications",
        forged.len()
    );
}

/// What a hostile handshake listener answers a metadata request with.
#[derive(Debug, Clone, Copy)]
enum HsReply {
    Close,
    Garbage,
    Length(u64),
    WrongKind,
    InvalidJson,
    OtherName,
    Mutated,
    Wrapping,
    BadPort,
    Silent,
    /// A valid descriptor naming the hostile data target.
    Valid,
}

/// The descriptor of a hostile segment `name` whose data target listens on `data_port`.
fn hostile_descriptor(name: &str, data_port: u16) -> SegmentDescriptor {
    let mut d = SegmentDescriptor::new(name, "tcp");
    TcpEndpoint { host: Some("127.0.0.1".into()), port: data_port, proto_version: Some(2), fence: None, auth: None }
        .write_to(&mut d)
        .unwrap();
    d.buffers.push(ferry::BufferDesc {
        addr: 0x10_0000,
        length: 1 << 20,
        name: "cpu:0".into(),
        device_id: None,
        extra: Default::default(),
    });
    d
}

/// A handshake listener that answers one metadata request as `reply` says; its port.
async fn hostile_listener(reply: HsReply, data_port: u16, mut rng: Rng) -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        let Ok((mut s, _)) = l.accept().await else { return };
        let _ = read_frame(&mut s, DEFAULT_MAX_FRAME, ANSWER).await;
        let name = format!("127.0.0.1:{port}");
        let d = hostile_descriptor(&name, data_port);
        let bytes = match reply {
            HsReply::Close => return,
            HsReply::Silent => {
                tokio::time::sleep(ANSWER).await;
                return;
            }
            HsReply::Garbage => [vec![0xFF], rng.some_bytes(64)].concat(),
            HsReply::Length(n) => [n.to_le_bytes().to_vec(), vec![1; 16]].concat(),
            HsReply::WrongKind => encode(FrameType::Probe, &d.to_json()),
            HsReply::InvalidJson => encode(FrameType::Metadata, b"{\"name\":"),
            HsReply::OtherName => {
                encode(FrameType::Metadata, &hostile_descriptor("10.0.0.9:15000", data_port).to_json())
            }
            HsReply::Mutated => {
                let mut json = d.to_json();
                for _ in 0..1 + rng.below(3) {
                    let at = rng.below(json.len() as u64) as usize;
                    json[at] = rng.pick(b"{}[]\":,0-9e\\ x");
                }
                encode(FrameType::Metadata, &json)
            }
            HsReply::Wrapping => {
                let mut w = d.clone();
                w.buffers[0].addr = u64::MAX - 10;
                let json = String::from_utf8(w.to_json()).unwrap();
                encode(FrameType::Metadata, json.as_bytes())
            }
            HsReply::BadPort => {
                let json = String::from_utf8(d.to_json()).unwrap().replace(&format!(":{data_port},"), ":70000,");
                encode(FrameType::Metadata, json.as_bytes())
            }
            HsReply::Valid => encode(FrameType::Metadata, &d.to_json()),
        };
        let _ = s.write_all(&bytes).await;
        let _ = s.shutdown().await;
    });
    port
}

/// What a hostile data target does with one request.
#[derive(Debug, Clone, Copy)]
enum DataReply {
    Honest,
    BadMagic,
    Rejected,
    ShortThenClose,
    LongPayload,
    Random,
    Silent,
    Close,
}

const DATA_REPLIES: &[DataReply] = &[
    DataReply::Honest,
    DataReply::BadMagic,
    DataReply::Rejected,
    DataReply::ShortThenClose,
    DataReply::LongPayload,
    DataReply::Random,
    DataReply::Silent,
    DataReply::Close,
];

/// A data target serving the hostile segment: honest while `honest` is set, else each request
/// gets a reply drawn from `rng`. Its port.
async fn hostile_target(rng: Arc<Mutex<Rng>>, honest: Arc<AtomicBool>) -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let (rng, honest) = (rng.clone(), honest.clone());
            tokio::spawn(async move {
                loop {
                    let mut h = [0u8; HEADER_LEN];
                    if s.read_exact(&mut h).await.is_err() {
                        return;
                    }
                    let Ok(h) = Header::decode(&h) else { return };
                    if h.opcode == Opcode::Write {
                        let mut sink = vec![0u8; h.size as usize];
                        if s.read_exact(&mut sink).await.is_err() {
                            return;
                        }
                    }
                    let (reply, junk) = {
                        let mut r = rng.lock().unwrap();
                        let reply =
                            if honest.load(Ordering::Relaxed) { DataReply::Honest } else { r.pick(DATA_REPLIES) };
                        (reply, [vec![0xA5], r.some_bytes(40)].concat())
                    };
                    let data: Vec<u8> = (0..h.size).map(|k| pattern(h.addr + k, 1)).collect();
                    let read = h.opcode == Opcode::Read;
                    let out = match reply {
                        DataReply::Honest => [Status::Ok.encode().to_vec(), if read { data } else { vec![] }].concat(),
                        DataReply::BadMagic => 0x1234u64.to_le_bytes().to_vec(),
                        DataReply::Rejected => Status::Rejected.encode().to_vec(),
                        DataReply::ShortThenClose => {
                            let cut = data.len() / 2;
                            let _ = s.write_all(&[&Status::Ok.encode()[..], &data[..cut]].concat()).await;
                            return;
                        }
                        DataReply::LongPayload => [Status::Ok.encode().to_vec(), data, junk].concat(),
                        DataReply::Random => junk,
                        DataReply::Silent => {
                            tokio::time::sleep(ANSWER).await;
                            return;
                        }
                        DataReply::Close => return,
                    };
                    if s.write_all(&out).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_survives_hostile_handshake_listeners_and_targets() {
    let mut rng = seed("an_initiator_survives_hostile_handshake_listeners_and_targets");
    let panics = fault::panics();
    let panics_before = panics.load(Ordering::SeqCst);
    const TIMEOUT: Duration = Duration::from_millis(400);
    let initiator = p2p_tcp_engine(TIMEOUT).await;
    let honest = Arc::new(AtomicBool::new(false));
    let data_port = hostile_target(Arc::new(Mutex::new(rng.fork(7))), honest.clone()).await;

    let local = Buffer::filled((2 * CANARY + 64 * 1024) as usize, 0x3C);
    let canaries = outside(&local, 64 * 1024);
    let dst = local.addr() + CANARY;
    unsafe { initiator.register_memory(dst, 64 * 1024, Location::Cpu(0)).await }.unwrap();

    // Handshake listeners answering garbage: every lookup ends in time, refused, or opened with
    // a descriptor whose transfers then end in time too (a descriptor the transport cannot use,
    // such as one with a port past 65535, is opened, and each transfer fails with why).
    #[derive(Debug, PartialEq)]
    enum Then {
        Refused,
        TransfersFail,
        Either,
    }
    let replies = [
        (HsReply::Close, Then::Refused),
        (HsReply::Garbage, Then::Refused),
        (HsReply::Length(0), Then::Refused),
        (HsReply::Length(DEFAULT_MAX_FRAME + 1), Then::Refused),
        (HsReply::Length(u64::MAX), Then::Refused),
        (HsReply::Length(64), Then::Refused),
        (HsReply::WrongKind, Then::Refused),
        (HsReply::InvalidJson, Then::Refused),
        (HsReply::OtherName, Then::Refused),
        (HsReply::Wrapping, Then::Refused),
        (HsReply::Silent, Then::Refused),
        (HsReply::BadPort, Then::TransfersFail),
        (HsReply::Mutated, Then::Either),
        (HsReply::Mutated, Then::Either),
        (HsReply::Mutated, Then::Either),
        (HsReply::Mutated, Then::Either),
    ];
    for (reply, then) in replies {
        let fork = rng.next();
        let port = hostile_listener(reply, data_port, rng.fork(fork)).await;
        let t = Instant::now();
        let r = initiator.open_segment(&format!("127.0.0.1:{port}")).await;
        assert!(t.elapsed() < TIMEOUT + Duration::from_secs(2), "{reply:?}: took {:?}", t.elapsed());
        match r {
            Err(e) => {
                assert_ne!(then, Then::TransfersFail, "{reply:?}: {e}");
                if matches!(reply, HsReply::Silent) {
                    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
                    assert!(t.elapsed() >= TIMEOUT, "{reply:?} failed early: {:?}", t.elapsed());
                }
            }
            Ok(peer) => {
                assert_ne!(then, Then::Refused, "{reply:?} was opened");
                let t = Instant::now();
                let r = initiator.transfer(&[req(Opcode::Read, dst, peer, 0x10_0000, 16)]).await;
                assert!(t.elapsed() < TIMEOUT + Duration::from_secs(2), "{reply:?}: a transfer took {:?}", t.elapsed());
                if then == Then::TransfersFail {
                    assert_eq!(r.expect_err("a transfer to an unusable descriptor").kind(), ErrorKind::InvalidArgument);
                }
            }
        }
        assert_eq!(outside(&local, 64 * 1024), canaries, "{reply:?}: bytes outside the destination");
    }

    // A valid descriptor whose data target answers badly: every transfer ends in time, with a
    // result or a clean error, and nothing lands outside the destination.
    let port = hostile_listener(HsReply::Valid, data_port, rng.fork(9)).await;
    let peer = initiator.open_segment(&format!("127.0.0.1:{port}")).await.unwrap();
    for round in 0..40 {
        let len = rng.len_upto(&[16, 4096, 64 * 1024]);
        let remote = 0x10_0000 + rng.below((1 << 20) - len);
        let opcode = rng.pick(&[Opcode::Read, Opcode::Read, Opcode::Write]);
        let t = Instant::now();
        let r = initiator.transfer(&[req(opcode, dst, peer, remote, len)]).await;
        assert!(t.elapsed() < TIMEOUT + Duration::from_secs(2), "round {round}: took {:?}", t.elapsed());
        if let Err(e) = r {
            assert!(
                matches!(e.kind(), ErrorKind::Timeout | ErrorKind::PeerUnreachable | ErrorKind::OutOfBounds),
                "round {round}: {e}"
            );
        }
        assert_eq!(outside(&local, 64 * 1024), canaries, "round {round}: bytes outside the destination");
    }

    // Once the target is honest, the initiator's lanes recover and the data is right.
    honest.store(true, Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match initiator.transfer(&[req(Opcode::Read, dst, peer, 0x10_0000 + 5, 4096)]).await {
            Ok(()) => break,
            Err(e) => assert!(Instant::now() < deadline, "no recovery once the target is honest: {e}"),
        }
    }
    let got = &local.bytes()[CANARY as usize..CANARY as usize + 4096];
    assert!(got.iter().enumerate().all(|(k, &b)| b == pattern(0x10_0000 + 5 + k as u64, 1)));
    initiator.shutdown().await.unwrap();
    assert_eq!(panics.load(Ordering::SeqCst), panics_before, "something panicked (see the output above)");
}
