//! Faults and floods the TCP transport must survive: connections that trickle, idle or flood,
//! and a target out of file descriptors.
//!
//! A target that must be starved of descriptors is this test binary run again as a
//! child with `FERRY_TCP_FAULTS_CHILD` set: its test `child_target_process` then runs a TCP
//! target engine, prints its descriptor on one line and serves until its standard input closes
//! (the test is a no-op without the variable).

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry::{InProcessMetadata, Location, MetadataStore, Opcode, SegmentDescriptor, TransferRequest};
use ferry_test_support::{Buffer, tcp_only};
use ferry_transport_tcp::TcpEndpoint;
use ferry_transport_tcp::wire::Header;

/// The variable that turns `child_target_process` into a target.
const CHILD_ENV: &str = "FERRY_TCP_FAULTS_CHILD";
/// Bytes the child registers.
const CHILD_BUFFER: usize = 4 << 20;

/// Runs the child's target when [`CHILD_ENV`] is set (a no-op otherwise).
#[test]
fn child_target_process() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("ferry_transport_tcp=info"))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let e = ferry::builder()
            .transports(tcp_only())
            .protocol("tcp")
            .segment_name("127.0.0.1:1")
            .metadata(InProcessMetadata::new() as Arc<dyn MetadataStore>)
            .transfer_timeout(Duration::from_secs(5))
            .build()
            .await
            .unwrap();
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

fn read(source: u64, target: ferry::SegmentHandle, target_offset: u64, length: u64) -> TransferRequest {
    TransferRequest { opcode: Opcode::Read, source, target, target_offset, length }
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
