//! Faults, floods and exposure of the TCP transport: a target stopped (SIGSTOP) while WRITEs are
//! in flight and resumed after they were reported failed (fences), peers that answer late or not
//! at all, connections that trickle, idle or flood, a target out of file descriptors, and the
//! address the data port listens on.
//!
//! A target that must be stopped or starved of descriptors is this test binary run again as a
//! child with `FERRY_TCP_FAULTS_CHILD` set: its test `child_target_process` then runs a TCP
//! target engine, prints its descriptor on one line and serves until its standard input closes
//! (the test is a no-op without the variable).

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry::{ErrorKind, InProcessMetadata, Location, MetadataStore, Opcode, SegmentDescriptor, TransferRequest};
use ferry_test_support::{Buffer, fake_tcp_peer, pattern_buffer, tcp_engine_knowing, tcp_only};
use ferry_transport_tcp::TcpEndpoint;
use ferry_transport_tcp::wire::{FENCE_OPCODE, Header, STATUS_LEN, Status, V2_FLAG};

/// The variable that turns `child_target_process` into a target.
const CHILD_ENV: &str = "FERRY_TCP_FAULTS_CHILD";
/// With this variable set too, the child publishes its descriptor through the P2P handshake
/// (its segment is `127.0.0.1:<rpc port>`, served by its handshake listener) instead of
/// printing it for an in-process store.
const CHILD_P2P_ENV: &str = "FERRY_TCP_FAULTS_CHILD_P2P";
/// Bytes the child registers.
const CHILD_BUFFER: usize = 4 << 20;

/// Runs the child's target when [`CHILD_ENV`] is set (a no-op otherwise).
#[test]
fn child_target_process() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "ferry_transport_tcp=info,ferry_metadata_p2p=info,ferry_listener=info",
        ))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let e = if std::env::var_os(CHILD_P2P_ENV).is_some() {
            ferry_test_support::p2p_tcp_engine(Duration::from_secs(5)).await
        } else {
            ferry::builder()
                .transports(tcp_only())
                .protocol("tcp")
                .segment_name("127.0.0.1:1")
                .metadata(InProcessMetadata::new() as Arc<dyn MetadataStore>)
                .transfer_timeout(Duration::from_secs(5))
                .build()
                .await
                .unwrap()
        };
        let buf = Buffer::zeroed(CHILD_BUFFER);
        unsafe { e.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
        let json = String::from_utf8(e.local_descriptor().to_json()).unwrap();
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "READY {json}").unwrap();
            out.flush().unwrap();
        }
        // Serve until the parent closes our standard input.
        let _ = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
                line.clear();
            }
        })
        .await;
        e.shutdown().await.unwrap();
        drop(buf);
    });
}

/// A child target process, killed when dropped.
struct ChildTarget {
    child: Child,
    _stdin: ChildStdin,
    descriptor: SegmentDescriptor,
    /// Every line the child wrote to its standard error.
    log: Arc<Mutex<Vec<String>>>,
}

impl ChildTarget {
    /// Starts the child with `env`; with `nofile`, under that open-file limit (soft and hard).
    #[allow(clippy::zombie_processes)] // `Drop` kills and waits for it
    fn spawn(env: &[(&str, &str)], nofile: Option<u32>) -> Self {
        let exe = std::env::current_exe().unwrap();
        let args = ["--exact", "child_target_process", "--nocapture", "--test-threads=1"];
        let mut cmd = match nofile {
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c").arg(format!("ulimit -n {n} && exec \"$0\" \"$@\"")).arg(&exe).args(args);
                c
            }
            None => {
                let mut c = Command::new(&exe);
                c.args(args);
                c
            }
        };
        cmd.env(CHILD_ENV, "1").stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(stdout.read_line(&mut line).unwrap() > 0, "the child target exited: {:?}", log.lock().unwrap());
            // libtest may have printed the test's name on the same line.
            if let Some((_, json)) = line.trim_end().split_once("READY ") {
                let descriptor = SegmentDescriptor::from_json("child", json.as_bytes()).unwrap();
                std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
                return Self { child, _stdin: stdin, descriptor, log };
            }
        }
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.id();
        let ok = Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success();
        assert!(ok, "kill {sig} failed");
        if sig == "-STOP" {
            // `kill` returns once the signal is sent; a thread of the child that is running stops
            // only when it next takes the signal. Wait until every thread is stopped, so that
            // nothing the test sends next can be served before the stop.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !all_threads_stopped(pid) {
                assert!(std::time::Instant::now() < deadline, "the target process {pid} did not stop");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// An initiator engine with the child's descriptor in its metadata, and its handle on it.
    async fn initiator(&self, timeout: Duration) -> (ferry::TransferEngine, ferry::SegmentHandle) {
        initiator_for(&self.descriptor, timeout).await
    }

    /// The address of the child's registered buffer.
    fn buffer(&self) -> u64 {
        self.descriptor.buffers[0].addr
    }
}

/// An initiator engine with `descriptor` in its metadata, and its handle on that segment.
async fn initiator_for(
    descriptor: &SegmentDescriptor,
    timeout: Duration,
) -> (ferry::TransferEngine, ferry::SegmentHandle) {
    let meta = InProcessMetadata::new();
    let name = descriptor.name.clone();
    MetadataStore::put(&*meta, &format!("mooncake/ram/{name}"), &descriptor.to_json()).await.unwrap();
    let e = ferry::builder()
        .transports(tcp_only())
        .protocol("tcp")
        .segment_name("127.0.0.1:2")
        .metadata(meta as Arc<dyn MetadataStore>)
        .transfer_timeout(timeout)
        .build()
        .await
        .unwrap();
    let peer = e.open_segment(&name).await.unwrap();
    (e, peer)
}

impl Drop for ChildTarget {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write(source: u64, target: ferry::SegmentHandle, target_offset: u64, length: u64) -> TransferRequest {
    TransferRequest { opcode: Opcode::Write, source, target, target_offset, length }
}

fn read(source: u64, target: ferry::SegmentHandle, target_offset: u64, length: u64) -> TransferRequest {
    TransferRequest { opcode: Opcode::Read, source, target, target_offset, length }
}

/// A WRITE that timed out while its target was stopped never lands after a later WRITE to the
/// same range succeeded: every round writes X to a stopped target, sees it fail, writes Y, and
/// reads back Y.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_write_never_overwrites_a_later_one() {
    const ROUNDS: u64 = 8;
    const PIECE: u64 = 64 << 10;
    const PIECES: u64 = 32; // X: 2 MiB in 64 KiB writes, all to the same 64 KiB range
    let target = ChildTarget::spawn(&[], None);
    let (e, peer) = target.initiator(Duration::from_millis(700)).await;
    let remote = target.buffer();
    let x = Buffer::zeroed(PIECE as usize);
    let y = Buffer::zeroed(PIECE as usize);
    let back = Buffer::zeroed(PIECE as usize);
    for b in [&x, &y, &back] {
        unsafe { e.register_memory(b.addr(), b.len(), Location::Cpu(0)).await }.unwrap();
    }
    let mut overwritten = Vec::new();
    for round in 0..ROUNDS {
        x.fill_pattern(2 * round + 1);
        y.fill_pattern(2 * round + 2);
        // A clean start: the range holds neither pattern.
        e.transfer(&[write(back.addr(), peer, remote, PIECE)]).await.unwrap();

        target.signal("-STOP");
        let xs: Vec<TransferRequest> = (0..PIECES).map(|_| write(x.addr(), peer, remote, PIECE)).collect();
        let err = e.transfer(&xs).await.expect_err("X cannot complete while the target is stopped");
        assert!(matches!(err.kind(), ErrorKind::Timeout | ErrorKind::PeerUnreachable), "{err}");
        // Y is sent while the target is still stopped and goes out as soon as it may; the
        // target resumes with X's bytes still in its sockets.
        let ys = e.submit(&[write(y.addr(), peer, remote, PIECE)]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        target.signal("-CONT");
        ys.wait_ok(Duration::from_secs(5)).await.unwrap_or_else(|e| panic!("round {round}: Y failed: {e}"));
        // Whatever of X is still on its way has time to land (it must not).
        tokio::time::sleep(Duration::from_millis(300)).await;
        e.transfer(&[read(back.addr(), peer, remote, PIECE)]).await.unwrap();
        if back.bytes() != y.bytes() {
            overwritten.push(round);
        }
        // Clear `back` for the next round's clean start.
        unsafe { std::ptr::write_bytes(back.addr() as *mut u8, 0, PIECE as usize) };
    }
    assert!(overwritten.is_empty(), "X overwrote Y in rounds {overwritten:?} of {ROUNDS}");
}

/// What a fake TCP target saw: per connection, its remote address and the opcode bytes of the
/// requests it read, and every fence payload.
#[derive(Default)]
struct Seen {
    opcodes: Vec<(SocketAddr, u8)>,
    fences: Vec<String>,
}

/// A fake TCP target (Mooncake's framing, plus fences when it advertises them) over a buffer of
/// `len` bytes at `addr`: it answers every request except the first WRITE, which it never
/// answers.
fn fake_target(addr: u64, len: u64, seen: Arc<Mutex<Seen>>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let first_write = Arc::new(AtomicBool::new(true));
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let (seen, first_write) = (seen.clone(), first_write.clone());
            std::thread::spawn(move || {
                let peer = s.peer_addr().unwrap();
                let mut hdr = [0u8; 24];
                while s.read_exact(&mut hdr).is_ok() {
                    seen.lock().unwrap().opcodes.push((peer, hdr[16]));
                    let size = u64::from_le_bytes(hdr[..8].try_into().unwrap());
                    if hdr[16] == FENCE_OPCODE | V2_FLAG {
                        let mut payload = vec![0u8; size.min(256) as usize];
                        if s.read_exact(&mut payload).is_err() {
                            return;
                        }
                        seen.lock().unwrap().fences.push(String::from_utf8_lossy(&payload).into_owned());
                        let _ = s.write_all(&Status::Ok.encode());
                        continue;
                    }
                    let h = Header::decode(&hdr).unwrap();
                    assert!(h.addr >= addr && h.addr + h.size <= addr + len);
                    if h.opcode == Opcode::Write {
                        let mut payload = vec![0u8; h.size as usize];
                        if s.read_exact(&mut payload).is_err() {
                            return;
                        }
                        if first_write.swap(false, Ordering::SeqCst) {
                            continue; // never answered
                        }
                        let _ = s.write_all(&Status::Ok.encode());
                    } else {
                        let _ = s.write_all(&Status::Ok.encode());
                        let _ = s.write_all(&vec![0u8; h.size as usize]);
                    }
                }
            });
        }
    });
    port
}

/// After a WRITE timed out, a peer that advertises `ferry_tcp_fence` is sent a fence naming the
/// connection that carried it before anything else; a Mooncake peer (no such field) never sees
/// the fence opcode, and is spoken to as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_go_only_to_peers_that_advertise_them() {
    const REMOTE: u64 = 0x1000_0000;
    for (name, fence) in [("mooncake", None), ("ferry", Some(1))] {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let port = fake_target(REMOTE, 1 << 20, seen.clone());
        let d = fake_tcp_peer(name, port, REMOTE, 1 << 20, fence);
        let e = tcp_engine_knowing(&[&d], Duration::from_millis(300)).await;
        let local = pattern_buffer(64 << 10, 3);
        unsafe { e.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
        let peer = e.open_segment(name).await.unwrap();
        let err = e.transfer(&[write(local.addr(), peer, REMOTE, 4096)]).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{name}: {err}");
        e.transfer(&[write(local.addr(), peer, REMOTE, 4096)]).await.unwrap();
        e.transfer(&[read(local.addr(), peer, REMOTE, 4096)]).await.unwrap();
        let seen = seen.lock().unwrap();
        let fences: Vec<_> = seen.opcodes.iter().filter(|(_, op)| op & !V2_FLAG == FENCE_OPCODE).collect();
        match fence {
            None => assert!(fences.is_empty() && seen.fences.is_empty(), "{name} was sent a fence: {:?}", seen.opcodes),
            Some(_) => {
                assert_eq!(fences.len(), 1, "{name}: one fence: {:?}", seen.opcodes);
                // It names the connection of the timed-out WRITE, and says where it comes from.
                let timed_out = seen.opcodes[0].0;
                assert_eq!(seen.fences, [format!("{timed_out} {}", fences[0].0)]);
                // ... and it went out before the next WRITE.
                let fence_at = seen.opcodes.iter().position(|(_, op)| op & !V2_FLAG == FENCE_OPCODE).unwrap();
                assert_eq!(seen.opcodes[fence_at + 1].1, Opcode::Write as u8 | V2_FLAG, "{:?}", seen.opcodes);
            }
        }
    }
}

/// A READ that timed out never writes into the caller's memory afterwards, however late the
/// rest of its response arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_read_response_never_lands_in_memory_given_back() {
    const REMOTE: u64 = 0x2000_0000;
    const LEN: usize = 256 << 10;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (go, rest) = std::sync::mpsc::channel::<()>();
    let sent = Arc::new(AtomicBool::new(false));
    let sent_flag = sent.clone();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hdr = [0u8; 24];
        s.read_exact(&mut hdr).unwrap();
        s.write_all(&Status::Ok.encode()).unwrap();
        s.write_all(&[0xAB; LEN / 2]).unwrap(); // half now
        rest.recv().unwrap(); // the other half once the caller has its memory back
        let _ = s.write_all(&[0xCD; LEN / 2]);
        let _ = s.write_all(&[0xEF; 4096]);
        sent_flag.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(500));
    });
    let d = fake_tcp_peer("late", port, REMOTE, LEN as u64, None);
    let e = tcp_engine_knowing(&[&d], Duration::from_millis(300)).await;
    let local = Buffer::zeroed(LEN);
    unsafe { e.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = e.open_segment("late").await.unwrap();
    let err = e.transfer(&[read(local.addr(), peer, REMOTE, LEN as u64)]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    // The caller reuses its buffer at once.
    unsafe { std::ptr::write_bytes(local.addr() as *mut u8, 0x11, LEN) };
    go.send(()).unwrap();
    let t = Instant::now();
    while !sent.load(Ordering::SeqCst) && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(local.bytes().iter().all(|&b| b == 0x11), "the late response was written into memory given back");
    e.unregister_memory(local.addr()).await.unwrap();
}

/// A target engine on in-process metadata whose data port raw sockets reach; `extra` are more
/// config fields (JSON members).
async fn raw_target(timeout: Duration, extra: &str) -> (ferry::TransferEngine, Buffer, u16) {
    let cfg = ferry::Config::from_json_str(&format!(r#"{{"protocol": "tcp"{extra}}}"#), None).unwrap();
    let e = ferry::builder()
        .config(cfg)
        .transports(tcp_only())
        .segment_name("127.0.0.1:1")
        .metadata(InProcessMetadata::new() as Arc<dyn MetadataStore>)
        .transfer_timeout(timeout)
        .build()
        .await
        .unwrap();
    let buf = Buffer::zeroed(1 << 20);
    unsafe { e.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
    let port = TcpEndpoint::from_descriptor(&e.local_descriptor()).unwrap().unwrap().port;
    (e, buf, port)
}

fn hdr(size: u64, addr: u64, opcode: Opcode) -> [u8; 24] {
    Header { size, addr, opcode, v2: true }.encode()
}

fn fence_request(fenced: SocketAddr, via: SocketAddr) -> Vec<u8> {
    let payload = format!("{fenced} {via}");
    let mut out = (payload.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&[0u8; 8]);
    out.push(FENCE_OPCODE | V2_FLAG);
    out.extend_from_slice(&[0u8; 7]);
    out.extend_from_slice(payload.as_bytes());
    out
}

fn status_of(s: &mut TcpStream) -> Status {
    let mut st = [0u8; STATUS_LEN];
    s.read_exact(&mut st).unwrap();
    Status::decode(&st).unwrap()
}

/// Whether the target closed `s` (within 5 s).
fn closed_by_target(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) => return e.kind() != std::io::ErrorKind::WouldBlock && e.kind() != std::io::ErrorKind::TimedOut,
        }
    }
}

/// A Ferry target answers a fence only once the named connection's WRITE stopped copying, and
/// applies nothing that connection sends afterwards; a fence that names a connection of another
/// address, or comes from another address than it says, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_connection_lands_nothing_after_the_answer() {
    let (_e, buf, port) = raw_target(Duration::from_secs(5), "").await;
    const LEN: usize = 64 << 10;
    let mut a = TcpStream::connect(("127.0.0.1", port)).unwrap();
    a.write_all(&hdr(LEN as u64, buf.addr(), Opcode::Write)).unwrap();
    a.write_all(&[0x11; 1024]).unwrap();
    std::thread::sleep(Duration::from_millis(100)); // the copy is under way, waiting for more
    let mut f = TcpStream::connect(("127.0.0.1", port)).unwrap();
    f.write_all(&fence_request(a.local_addr().unwrap(), f.local_addr().unwrap())).unwrap();
    assert_eq!(status_of(&mut f), Status::Ok);
    // The rest of the payload, after the answer: none of it may land.
    let _ = a.write_all(&[0x22; LEN - 1024]);
    std::thread::sleep(Duration::from_millis(200));
    assert!(buf.bytes()[..1024].iter().all(|&b| b == 0x11), "what came before the fence landed");
    assert!(!buf.bytes()[1024..LEN].contains(&0x22), "bytes sent on a fenced connection landed");
    assert!(closed_by_target(&mut a), "the fenced connection is closed");

    // A fence for a connection that no longer exists is answered OK, and the fence connection
    // serves requests as usual afterwards.
    f.write_all(&fence_request(a.local_addr().unwrap(), f.local_addr().unwrap())).unwrap();
    assert_eq!(status_of(&mut f), Status::Ok);
    f.write_all(&hdr(4, buf.addr(), Opcode::Read)).unwrap();
    assert_eq!(status_of(&mut f), Status::Ok);
    let mut four = [0u8; 4];
    f.read_exact(&mut four).unwrap();
    assert_eq!(four, [0x11; 4]);

    // Refused: another address than its own, and a connection of another IP.
    let b = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let claimed: SocketAddr = "127.0.0.1:9".parse().unwrap();
    f.write_all(&fence_request(b.local_addr().unwrap(), claimed)).unwrap();
    assert_eq!(status_of(&mut f), Status::Rejected);
    let other: SocketAddr = "127.0.0.2:40000".parse().unwrap();
    f.write_all(&fence_request(other, f.local_addr().unwrap())).unwrap();
    assert_eq!(status_of(&mut f), Status::Rejected);
    let mut b = b;
    b.write_all(&hdr(4, buf.addr(), Opcode::Read)).unwrap();
    assert_eq!(status_of(&mut b), Status::Ok, "a refused fence closes nothing");
}

/// One deadline per header, however it trickles, and one per request from its header, however
/// its payload trickles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_headers_and_payloads_are_cut_at_their_deadline() {
    // The transfer timeout (1 s) bounds both the header (10 s or less) and the request.
    let (_e, buf, port) = raw_target(Duration::from_secs(1), "").await;
    // Sends `prefix` at once, then `bytes` one every 300 ms; returns how long until the target
    // closed the connection, if it did.
    let trickle = move |prefix: Vec<u8>, bytes: Vec<u8>| {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(&prefix).unwrap();
        let t = Instant::now();
        for b in bytes {
            if s.write_all(&[b]).is_err() {
                return Some(t.elapsed());
            }
            std::thread::sleep(Duration::from_millis(300));
            s.set_nonblocking(true).unwrap();
            let mut some = [0u8; 64];
            let read = s.read(&mut some);
            s.set_nonblocking(false).unwrap();
            match read {
                Ok(0) => return Some(t.elapsed()),
                Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => return Some(t.elapsed()),
                _ => {}
            }
        }
        None
    };
    let header = hdr(4, buf.addr(), Opcode::Read).to_vec();
    let cut = tokio::task::spawn_blocking(move || trickle(Vec::new(), header)).await.unwrap();
    assert!(cut.is_some_and(|t| t < Duration::from_secs(3)), "a header trickled a byte per 300 ms: cut after {cut:?}");
    let header = hdr(64, buf.addr(), Opcode::Write).to_vec();
    let cut = tokio::task::spawn_blocking(move || trickle(header, vec![7u8; 64])).await.unwrap();
    assert!(cut.is_some_and(|t| t < Duration::from_secs(3)), "a payload trickled a byte per 300 ms: cut after {cut:?}");
}

/// Connections from one address beyond `tcp_max_connections_per_ip` close the idlest ones, and
/// requests that are rejected (empty ones included) do not make a connection less idle: a flood
/// of silent and of empty-request connections holds no more than the limit, and a real peer on
/// the same address is served throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_one_address_is_held_to_its_limit() {
    const LIMIT: usize = 8;
    let (target, buf, port) =
        raw_target(Duration::from_secs(5), &format!(r#", "tcp_max_connections_per_ip": {LIMIT}"#)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        let addr = buf.addr();
        tokio::task::spawn_blocking(move || {
            let mut conns = Vec::new();
            for i in 0..200 {
                let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                s.set_nonblocking(true).unwrap();
                conns.push((s, i % 2 == 0));
            }
            // Half of them send an empty READ every 100 ms (rejected, status 1), half are silent.
            let mut closed = vec![false; conns.len()];
            let until = Instant::now() + Duration::from_secs(3);
            while Instant::now() < until && !stop.load(Ordering::SeqCst) {
                for (k, (s, chatty)) in conns.iter_mut().enumerate() {
                    let mut some = [0u8; 256];
                    match s.read(&mut some) {
                        Ok(0) => closed[k] = true,
                        Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => closed[k] = true,
                        _ => {}
                    }
                    if *chatty && !closed[k] {
                        let _ = s.write_all(&hdr(0, addr, Opcode::Read));
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            closed.iter().filter(|&&c| c).count()
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A real peer on the same address is served during the flood.
    let (initiator, peer) = initiator_for(&target.local_descriptor(), Duration::from_secs(5)).await;
    let local = Buffer::zeroed(4096);
    unsafe { initiator.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    for _ in 0..5 {
        initiator.transfer(&[read(local.addr(), peer, buf.addr(), 4096)]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let closed = flood.await.unwrap();
    stop.store(true, Ordering::SeqCst);
    assert!(
        closed >= 200 - LIMIT - 2,
        "only {closed} of 200 idle or empty-request connections were closed (limit {LIMIT})"
    );
}

/// A target out of file descriptors backs off instead of retrying accept in a loop, says so in
/// one line per period instead of a line per retry, and serves again once the flood is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_out_of_descriptors_backs_off_and_recovers() {
    // 128 descriptors, hard limit too; no limit per address, so the flood reaches the limit.
    let target = ChildTarget::spawn(&[("FERRY_TCP_MAX_CONNECTIONS_PER_IP", "65536")], Some(128));
    let data = TcpEndpoint::from_descriptor(&target.descriptor).unwrap().unwrap();
    // More than the child has descriptors for, until its accept queue is full too.
    let to = SocketAddr::from(([127, 0, 0, 1], data.port));
    let flood: Vec<TcpStream> =
        (0..300).map_while(|_| TcpStream::connect_timeout(&to, Duration::from_millis(200)).ok()).collect();
    assert!(flood.len() > 128, "only {} connections", flood.len());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let failures: Vec<String> =
        target.log.lock().unwrap().iter().filter(|l| l.contains("accept failed")).cloned().collect();
    assert!(!failures.is_empty(), "the child never ran out of descriptors: {:?}", target.log.lock().unwrap());
    assert!(failures.len() <= 2, "{} accept failures logged in 3 s: {failures:#?}", failures.len());
    assert!(failures[0].contains("Too many open files"), "{}", failures[0]);
    drop(flood);
    let (e, peer) = target.initiator(Duration::from_secs(5)).await;
    let local = Buffer::zeroed(4096);
    unsafe { e.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    e.transfer(&[read(local.addr(), peer, target.buffer(), 4096)]).await.unwrap();
}

/// Connections from many addresses beyond `tcp_max_connections` close the idlest of all for a
/// new one: 69 addresses × 64 silent connections (more than the default 4096 in all, none over
/// its address's limit) do not keep a real peer's connection queued behind them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_many_addresses_cannot_fill_the_target() {
    const ADDRESSES: u8 = 69;
    const PER_ADDRESS: usize = 64;
    let (target, buf, port) = raw_target(Duration::from_secs(5), "").await;
    let mut flood = Vec::new();
    'flood: for last in 2..2 + ADDRESSES {
        for _ in 0..PER_ADDRESS {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(SocketAddr::from(([127, 0, 0, last], 0))).unwrap();
            let to = SocketAddr::from(([127, 0, 0, 1], port));
            match tokio::time::timeout(Duration::from_secs(2), socket.connect(to)).await {
                Ok(Ok(stream)) => flood.push(stream.into_std().unwrap()), // non-blocking
                // The accept queue is full: the target stopped accepting.
                _ => break 'flood,
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (initiator, peer) = initiator_for(&target.local_descriptor(), Duration::from_secs(5)).await;
    let local = Buffer::zeroed(4096);
    unsafe { initiator.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let started = Instant::now();
    let served = initiator.transfer(&[read(local.addr(), peer, buf.addr(), 4096)]).await;
    assert!(
        served.is_ok() && started.elapsed() < Duration::from_secs(3),
        "a real peer behind {} idle connections from {ADDRESSES} addresses: {served:?} after {:?}",
        flood.len(),
        started.elapsed()
    );
    // The flood was cut to the limit: the target closed at least what it had no room for.
    let closed = flood.iter().filter(|s| matches!((&mut &**s).read(&mut [0u8; 1]), Ok(0))).count();
    assert!(closed >= flood.len() - 4096, "only {closed} of {} connections were closed", flood.len());
}

/// At `ulimit -n 1024` (soft and hard, so nothing can be raised), 1,100 idle connections to the
/// data port and 1,100 to the handshake listener leave both serving: a new peer's handshake
/// and read succeed at once, and neither listener logs more than a line or two about it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_floods_at_1024_descriptors_leave_both_listeners_serving() {
    const FLOOD: usize = 1100;
    let target = ChildTarget::spawn(&[(CHILD_P2P_ENV, "1")], Some(1024));
    let data = TcpEndpoint::from_descriptor(&target.descriptor).unwrap().unwrap();
    let rpc: SocketAddr = target.descriptor.name.parse().expect("a P2P segment name is host:rpc_port");
    let mut flood = Vec::new();
    for to in [SocketAddr::from(([127, 0, 0, 1], data.port)), rpc] {
        for _ in 0..FLOOD {
            match tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(to)).await {
                Ok(Ok(s)) => flood.push(s),
                other => panic!(
                    "connection {} to {to} failed: {other:?}; the target's log: {:#?}",
                    flood.len(),
                    target.log.lock().unwrap()
                ),
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let e = ferry_test_support::p2p_tcp_engine(Duration::from_secs(3)).await;
    let local = Buffer::zeroed(4096);
    unsafe { e.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let started = Instant::now();
    let served = match e.open_segment(&target.descriptor.name).await {
        Ok(peer) => e.transfer(&[read(local.addr(), peer, target.buffer(), 4096)]).await.map(|_| ()),
        Err(err) => Err(err),
    };
    assert!(
        served.is_ok() && started.elapsed() < Duration::from_secs(2),
        "handshake and read behind {} idle connections: {served:?} after {:?}",
        flood.len(),
        started.elapsed()
    );
    let log = target.log.lock().unwrap().clone();
    let failures = log.iter().filter(|l| l.contains("accept failed")).count();
    assert!(failures <= 2, "{failures} accept failures logged: {:#?}", &log[..log.len().min(20)]);
    drop(flood);
}

/// The data port listens on the segment name's host when it is an IP address: an engine named
/// `127.0.0.1:…` is not reachable on 127.0.0.2. `tcp_bind_address` says otherwise, and a host
/// given by name listens on every address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_port_listens_on_the_published_host() {
    let reachable_on = |port: u16, ip: &str| TcpStream::connect((ip, port)).is_ok();
    let (e, _buf, port) = raw_target(Duration::from_secs(5), "").await;
    assert!(reachable_on(port, "127.0.0.1"));
    assert!(!reachable_on(port, "127.0.0.2"), "an engine named 127.0.0.1 listens on every address");
    drop(e);
    let (e, _buf, port) = raw_target(Duration::from_secs(5), r#", "tcp_bind_address": "0.0.0.0""#).await;
    assert!(reachable_on(port, "127.0.0.2"), "tcp_bind_address 0.0.0.0: every address");
    drop(e);
    let named = ferry::builder()
        .transports(tcp_only())
        .protocol("tcp")
        .segment_name("localhost:1")
        .metadata(InProcessMetadata::new() as Arc<dyn MetadataStore>)
        .build()
        .await
        .unwrap();
    let ep = TcpEndpoint::from_descriptor(&named.local_descriptor()).unwrap().unwrap();
    assert_eq!(ep.host.as_deref(), Some("localhost"));
    assert!(reachable_on(ep.port, "127.0.0.2"), "a name: every address");
    // A configured address that is not this host's is an error naming the option.
    let cfg = ferry::Config::from_json_str(r#"{"protocol": "tcp", "tcp_bind_address": "192.0.2.1"}"#, None).unwrap();
    let err = ferry::builder()
        .config(cfg)
        .transports(tcp_only())
        .segment_name("127.0.0.1:1")
        .metadata(InProcessMetadata::new() as Arc<dyn MetadataStore>)
        .build()
        .await
        .unwrap_err();
    assert!(err.message().contains("tcp_bind_address"), "{err}");
}

/// True when every thread of process `pid` is stopped (state `T` in `/proc/<pid>/task/*/stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T') || rest.starts_with('t')))
            .unwrap_or(false)
    })
}

/// A runtime for an engine driven from this (non-runtime) thread with the blocking API.
fn blocking_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Single requests for a waiting caller until one runs on this thread (it is finished when
/// `submit_for_blocking_wait` returns; the first to a peer goes through a lane and has the
/// peer's direct connection opened meanwhile).
fn until_direct(e: &ferry::TransferEngine, r: TransferRequest) {
    let t = Instant::now();
    loop {
        let batch = e.submit_for_blocking_wait(&[r]).unwrap();
        let direct = batch.is_done();
        batch.wait_ok_blocking(Duration::from_secs(5)).unwrap();
        if direct {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "no request ran on the caller's thread in 5 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The direct path keeps the lanes' guarantees with a target stopped (SIGSTOP) under it: a
/// direct WRITE fails with `Timeout` at its deadline (not later), the next WRITE goes through a
/// lane that fences the direct connection first, and the timed-out WRITE never lands after it.
#[test]
fn a_direct_write_that_timed_out_is_fenced_and_never_lands_later() {
    const ROUNDS: u64 = 4;
    const PIECE: u64 = 64 << 10;
    let timeout = Duration::from_millis(700);
    let target = ChildTarget::spawn(&[], None);
    let rt = blocking_runtime();
    let (e, peer) = rt.block_on(target.initiator(timeout));
    let remote = target.buffer();
    let (x, y, back) = (Buffer::zeroed(PIECE as usize), Buffer::zeroed(PIECE as usize), Buffer::zeroed(PIECE as usize));
    for b in [&x, &y, &back] {
        unsafe { e.register_memory_blocking(b.addr(), b.len(), Location::Cpu(0)) }.unwrap();
    }
    until_direct(&e, read(back.addr(), peer, remote, PIECE));
    let mut overwritten = Vec::new();
    for round in 0..ROUNDS {
        x.fill_pattern(2 * round + 1);
        y.fill_pattern(2 * round + 2);
        // A clean start (the range holds neither pattern), on the direct connection.
        until_direct(&e, write(back.addr(), peer, remote, PIECE));

        target.signal("-STOP");
        let t = Instant::now();
        let xs = e.submit_for_blocking_wait(&[write(x.addr(), peer, remote, PIECE)]).unwrap();
        let took = t.elapsed();
        assert!(xs.is_done(), "round {round}: X ran on the caller's thread");
        let err = xs.wait_ok_blocking(Duration::ZERO).expect_err("X cannot complete while the target is stopped");
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
        assert!(
            took >= timeout - Duration::from_millis(20) && took < timeout + Duration::from_millis(400),
            "round {round}: X failed after {took:?}, its deadline was {timeout:?}"
        );
        // Y is submitted while the target is still stopped: a fence is due, so it goes through a
        // lane (it is not finished when the submit returns), which fences X's connection first.
        let ys = e.submit_for_blocking_wait(&[write(y.addr(), peer, remote, PIECE)]).unwrap();
        assert!(!ys.is_done(), "round {round}: Y went direct with a fence due");
        std::thread::sleep(Duration::from_millis(30));
        target.signal("-CONT");
        ys.wait_ok_blocking(Duration::from_secs(5)).unwrap_or_else(|e| panic!("round {round}: Y failed: {e}"));
        // Whatever of X is still on its way has time to land (it must not).
        std::thread::sleep(Duration::from_millis(300));
        e.transfer_blocking(&[read(back.addr(), peer, remote, PIECE)]).unwrap();
        if back.bytes() != y.bytes() {
            overwritten.push(round);
        }
        unsafe { std::ptr::write_bytes(back.addr() as *mut u8, 0, PIECE as usize) };
    }
    assert!(overwritten.is_empty(), "X overwrote Y in rounds {overwritten:?} of {ROUNDS}");
    e.shutdown_blocking().unwrap();
}

/// A direct WRITE that was never answered is fenced, by the address of the direct connection
/// that carried it, before the next WRITE goes out.
#[test]
fn a_direct_write_that_timed_out_is_fenced_by_its_connection() {
    const REMOTE: u64 = 0x1000_0000;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let port = fake_target(REMOTE, 1 << 20, seen.clone());
    let d = fake_tcp_peer("ferry", port, REMOTE, 1 << 20, Some(1));
    let rt = blocking_runtime();
    let e = rt.block_on(tcp_engine_knowing(&[&d], Duration::from_millis(300)));
    let local = pattern_buffer(64 << 10, 3);
    unsafe { e.register_memory_blocking(local.addr(), local.len(), Location::Cpu(0)) }.unwrap();
    let peer = e.block_on(e.open_segment("ferry")).unwrap().unwrap();
    until_direct(&e, read(local.addr(), peer, REMOTE, 4096));
    let batch = e.submit_for_blocking_wait(&[write(local.addr(), peer, REMOTE, 4096)]).unwrap();
    assert!(batch.is_done(), "the WRITE ran on the caller's thread");
    assert_eq!(batch.wait_ok_blocking(Duration::ZERO).unwrap_err().kind(), ErrorKind::Timeout);
    e.transfer_blocking(&[write(local.addr(), peer, REMOTE, 4096)]).unwrap();
    let seen = seen.lock().unwrap();
    let write_at = seen.opcodes.iter().position(|(_, op)| *op == Opcode::Write as u8 | V2_FLAG).unwrap();
    let timed_out = seen.opcodes[write_at].0;
    let fence_at = seen.opcodes.iter().position(|(_, op)| op & !V2_FLAG == FENCE_OPCODE).expect("a fence");
    assert!(fence_at > write_at, "{:?}", seen.opcodes);
    assert_eq!(seen.fences, [format!("{timed_out} {}", seen.opcodes[fence_at].0)]);
    assert_eq!(seen.opcodes[fence_at + 1].1, Opcode::Write as u8 | V2_FLAG, "{:?}", seen.opcodes);
    drop(seen);
    e.shutdown_blocking().unwrap();
}
