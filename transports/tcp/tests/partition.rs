//! Network partitions, stalls and loss between two engines (P2P handshake and the `tcp`
//! transport), each in a network namespace of its own, joined only by a user-space proxy that
//! can forward, delay, hold (partition) or reset what crosses it.
//!
//! The target engine lives in one fresh network namespace, the initiator in another; the proxy
//! listens in the initiator's namespace on the target's own addresses (its RPC port and data
//! port on 127.0.0.1) and connects into the target's namespace, so every byte between the two
//! engines crosses it, handshakes and notifications included. Each engine's threads are created
//! inside its namespace (the namespace of a socket is its creating thread's), so the engines are
//! unchanged Ferry engines.
//!
//! The proxy models what a network does to TCP: a partition holds every byte (none is lost:
//! TCP would retransmit it, and it arrives once the partition heals, if the connection is still
//! there); loss shows as stalls (retransmission delays) and as connections reset with the bytes
//! they carried ("drop"). It never removes bytes from inside a live connection, which no network
//! can do to TCP, and which no protocol without checksums (Mooncake's wire has none) survives.
//!
//! Scenarios, in one run: a baseline transfer and notification; a partition during a batch
//! (every request fails with a timeout at the configured transfer timeout, not before, and the
//! batch does not hang; a notification times out at the handshake timeout); the partition
//! healed (the next transfer succeeds, timed); seeded bursts of stalls, partitions longer than
//! the timeout, resets and latency while batches run (each request succeeds with its data
//! intact, or fails with a timeout or an unreachable peer), then healed again; and throughout,
//! no byte outside the target's registered region changes, and a write that failed leaves each
//! of its bytes either as it was or as written (it may land late, once a partition heals).
//!
//! Creating namespaces needs CAP_SYS_ADMIN: as root the test makes them itself; otherwise it
//! runs itself again under `unshare -rn` (a user namespace, root inside it), and where that
//! fails too it prints why and passes without running. The seed is printed first;
//! `FERRY_FAULT_SEED=<seed>` replays it.

#![allow(clippy::undocumented_unsafe_blocks)] // test buffers outlive the engines they are registered with

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry::{ErrorKind, Location, Opcode, RequestStatus, TransferRequest};
use ferry_test_support::{Buffer, p2p_tcp_engine, pattern_buffer};
use ferry_transport_tcp::TcpEndpoint;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

mod fault;
use fault::Rng;

/// Set in the copy of this test that runs under `unshare -rn`.
const CHILD: &str = "FERRY_NETNS_CHILD";
/// Both engines' transfer timeout (and so their handshake timeout).
const TIMEOUT: Duration = Duration::from_secs(1);
/// How soon after a partition heals the next transfer must have succeeded.
const HEAL_BOUND: Duration = Duration::from_secs(2);

#[test]
fn partitions_stalls_and_loss_between_engines_in_network_namespaces() {
    if let Err(why) = netns::probe() {
        assert!(std::env::var_os(CHILD).is_none(), "under `unshare -rn`, network namespaces still fail: {why}");
        match netns::rerun_under_unshare("partitions_stalls_and_loss_between_engines_in_network_namespaces") {
            Ok(status) => {
                assert!(status.success(), "the run under `unshare -rn` failed ({status}); its output is above")
            }
            Err(e) => eprintln!(
                "SKIPPED: network namespaces cannot be created here ({why}), and `unshare -rn` cannot make them \
                 either ({e}); nothing was tested"
            ),
        }
        return;
    }
    let rng = fault::seed("partitions_stalls_and_loss_between_engines_in_network_namespaces");
    let panics = fault::panics().load(Ordering::SeqCst);
    let target = netns::Side::new("target").expect("the target's namespace");
    let initiator = netns::Side::new("initiator").expect("the initiator's namespace");
    initiator.run(scenario(target.handle(), rng));
    drop((initiator, target));
    assert_eq!(fault::panics().load(Ordering::SeqCst), panics, "something panicked (see the output above)");
}

/// Network namespaces: each [`Side`] is a tokio runtime whose threads live in a fresh one.
mod netns {
    use std::time::Duration;

    /// Whether this process can create network namespaces (a thread tries, and ends).
    pub(crate) fn probe() -> Result<(), String> {
        std::thread::spawn(|| unshare_net().and_then(|()| lo_up()).map_err(|e| e.to_string()))
            .join()
            .map_err(|_| "the probe thread panicked".to_owned())?
    }

    /// Runs `test` of this test binary again under `unshare -rn`; its output goes to ours.
    pub(crate) fn rerun_under_unshare(test: &str) -> std::io::Result<std::process::ExitStatus> {
        let works = std::process::Command::new("unshare")
            .args(["-rn", "true"])
            .status()
            .map_err(|e| std::io::Error::new(e.kind(), format!("`unshare` (util-linux) could not be run: {e}")))?;
        if !works.success() {
            return Err(std::io::Error::other(format!("`unshare -rn true` exited with {works}")));
        }
        let exe = std::env::current_exe()?;
        eprintln!("re-running {test} under `unshare -rn`");
        std::process::Command::new("unshare")
            .arg("-rn")
            .arg(exe)
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(super::CHILD, "1")
            .status()
    }

    /// Moves the calling thread into a new network namespace.
    fn unshare_net() -> std::io::Result<()> {
        // SAFETY: unshare(2) with CLONE_NEWNET only changes the calling thread's network
        // namespace; it takes no pointers.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Brings up `lo` of the calling thread's network namespace (a new one starts with it down).
    fn lo_up() -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let socket = std::net::UdpSocket::bind("0.0.0.0:0")?;
        // SAFETY: `ifreq` is plain data, for which all zeroes is a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        // SAFETY: SIOCGIFFLAGS and SIOCSIFFLAGS read and write the `ifreq` passed, which lives
        // across both calls; the descriptor is the open socket's.
        unsafe {
            if libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            if libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &req) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// A multi-threaded runtime whose threads (and so the sockets its tasks create) are in a
    /// network namespace of their own, with `lo` up.
    pub(crate) struct Side {
        rt: Option<tokio::runtime::Runtime>,
    }

    impl Side {
        pub(crate) fn new(name: &'static str) -> std::io::Result<Self> {
            // The runtime's threads are started by this thread, after it moved: they inherit
            // its namespace.
            let rt = std::thread::spawn(move || {
                unshare_net()?;
                lo_up()?;
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name(format!("netns-{name}"))
                    .enable_all()
                    .build()
            })
            .join()
            .expect("the namespace thread panicked")?;
            Ok(Self { rt: Some(rt) })
        }

        pub(crate) fn handle(&self) -> tokio::runtime::Handle {
            self.rt.as_ref().expect("running").handle().clone()
        }

        /// Runs `fut` as a task of this side (never on the calling thread, whose namespace is
        /// another) and returns its output.
        pub(crate) fn run<T: Send + 'static>(&self, fut: impl std::future::Future<Output = T> + Send + 'static) -> T {
            let rt = self.rt.as_ref().expect("running");
            rt.block_on(rt.spawn(fut)).unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
        }
    }

    impl Drop for Side {
        fn drop(&mut self) {
            if let Some(rt) = self.rt.take() {
                rt.shutdown_timeout(Duration::from_secs(5));
            }
        }
    }
}

/// The proxy's state, shared by all of its connections.
struct Link {
    /// `true` forwards, `false` holds everything (a partition).
    forward: watch::Sender<bool>,
    /// Latency added to every chunk, in milliseconds.
    delay_ms: AtomicU64,
    /// Bumped to reset every connection open at the time.
    cut: watch::Sender<u64>,
}

impl Link {
    fn new() -> Arc<Self> {
        Arc::new(Self { forward: watch::channel(true).0, delay_ms: AtomicU64::new(0), cut: watch::channel(0).0 })
    }
    fn partition(&self) {
        self.forward.send_replace(false);
    }
    fn heal(&self) {
        self.forward.send_replace(true);
    }
    fn delay(&self, ms: u64) {
        self.delay_ms.store(ms, Ordering::Relaxed);
    }
    /// Resets every open connection, with whatever it was carrying.
    fn cut(&self) {
        self.cut.send_modify(|n| *n += 1);
    }
    async fn forwarding(&self) {
        let _ = self.forward.subscribe().wait_for(|&f| f).await;
    }
}

/// Accepts connections on `listener` (in the initiator's namespace) and joins each to a
/// connection to `upstream` that `dial` (a runtime in the target's namespace) opens.
async fn proxy(listener: TcpListener, upstream: SocketAddr, dial: tokio::runtime::Handle, link: Arc<Link>) {
    while let Ok((a, _)) = listener.accept().await {
        let (dial, link) = (dial.clone(), link.clone());
        tokio::spawn(async move {
            let mut cut = link.cut.subscribe();
            // In a partition a new connection carries nothing, its far end included, until it heals.
            tokio::select! {
                () = link.forwarding() => {}
                _ = cut.changed() => return reset(a, None),
            }
            let Ok(Ok(b)) = dial.spawn(async move { TcpStream::connect(upstream).await?.into_std() }).await else {
                return reset(a, None);
            };
            let Ok(b) = TcpStream::from_std(b) else { return };
            let (mut a, mut b) = (a, b);
            let _ = (a.set_nodelay(true), b.set_nodelay(true));
            let cut_now = tokio::select! {
                () = async {
                    let (mut ar, mut aw) = a.split();
                    let (mut br, mut bw) = b.split();
                    tokio::join!(pump(&mut ar, &mut bw, &link), pump(&mut br, &mut aw, &link));
                } => false,
                _ = cut.changed() => true,
            };
            if cut_now {
                reset(a, Some(b));
            }
        });
    }
}

/// Copies one direction chunk by chunk, after the link's delay and only while it forwards.
async fn pump(from: &mut tokio::net::tcp::ReadHalf<'_>, to: &mut tokio::net::tcp::WriteHalf<'_>, link: &Link) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        link.forwarding().await;
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let delay = link.delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        // Bytes read when a partition starts are held too.
        link.forwarding().await;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// Closes both ends with a reset (what a middlebox that drops a connection's state causes).
fn reset(a: TcpStream, b: Option<TcpStream>) {
    for s in std::iter::once(a).chain(b) {
        let _ = s.set_zero_linger();
    }
}

const CANARY: u64 = 4096;
/// The target's registered region: a read-only part (its initial pattern) and a part written.
const RO: u64 = 0;
const RO_LEN: u64 = 1 << 20;
const WR: u64 = RO_LEN;
const REGION: u64 = 8 << 20;

/// A write whose outcome is checked at the end: target offset, source offset, length.
#[derive(Debug, Clone, Copy)]
struct Written {
    at: u64,
    from: u64,
    len: u64,
}

/// The target's memory and what the test knows about it.
struct Target {
    /// Canary, region, canary.
    buf: Buffer,
    initial: Vec<u8>,
    /// Next unwritten offset of the write part (every write gets bytes of its own).
    next: u64,
    /// Writes that failed: each of their bytes is either initial or written.
    failed: Vec<Written>,
}

impl Target {
    fn base(&self) -> u64 {
        self.buf.addr() + CANARY
    }
    fn region(&self) -> &[u8] {
        &self.buf.bytes()[CANARY as usize..(CANARY + REGION) as usize]
    }
    /// Fresh target bytes for a write of `len`.
    fn take(&mut self, len: u64) -> u64 {
        let at = self.next;
        assert!(at + len <= REGION, "the write part is used up");
        self.next += len;
        at
    }
    fn check(&self, src: &[u8]) {
        let all = self.buf.bytes();
        let outside = |b: &[u8]| [&b[..CANARY as usize], &b[(CANARY + REGION) as usize..]].concat();
        assert!(outside(all) == outside(&self.initial), "bytes outside the registered region changed");
        let region = self.region();
        let initial = &self.initial[CANARY as usize..(CANARY + REGION) as usize];
        assert!(region[..RO_LEN as usize] == initial[..RO_LEN as usize], "the read-only part changed");
        for w in &self.failed {
            for k in 0..w.len {
                let (got, was, new) =
                    (region[(w.at + k) as usize], initial[(w.at + k) as usize], src[(w.from + k) as usize]);
                assert!(got == was || got == new, "failed write {w:?}: byte {k} is {got}, neither {was} nor {new}");
            }
        }
    }
}

fn req(opcode: Opcode, source: u64, target: ferry::SegmentHandle, target_offset: u64, length: u64) -> TransferRequest {
    TransferRequest { opcode, source, target, target_offset, length }
}

/// The whole scenario, run on the initiator's side; the target engine is built on `target_rt`.
async fn scenario(target_rt: tokio::runtime::Handle, mut rng: Rng) {
    let started = Instant::now();
    let (target, tbuf) = target_rt
        .spawn(async {
            let e = p2p_tcp_engine(TIMEOUT).await;
            let buf = Buffer::filled((2 * CANARY + REGION) as usize, 0x5A);
            unsafe { e.register_memory(buf.addr() + CANARY, REGION, Location::Cpu(0)).await }.unwrap();
            (e, buf)
        })
        .await
        .unwrap();
    let initial = tbuf.bytes().to_vec();
    let mut t = Target { buf: tbuf, initial, next: WR, failed: Vec::new() };
    let rpc_port = target.rpc_port().unwrap();
    let data_port = TcpEndpoint::from_descriptor(&target.local_descriptor()).unwrap().unwrap().port;

    // The proxy takes the target's addresses in this namespace before anything else can.
    let link = Link::new();
    for port in [rpc_port, data_port] {
        let l = TcpListener::bind(("127.0.0.1", port)).await.expect("the target's port is free in this namespace");
        tokio::spawn(proxy(l, SocketAddr::from(([127, 0, 0, 1], port)), target_rt.clone(), link.clone()));
    }
    let initiator = p2p_tcp_engine(TIMEOUT).await;
    let local = Buffer::zeroed(4 << 20);
    let src = pattern_buffer(4 << 20, 3);
    for b in [&local, &src] {
        unsafe { initiator.register_memory(b.addr(), b.len(), Location::Cpu(0)).await }.unwrap();
    }
    let name = target.segment_name().to_owned();

    // Baseline, through the proxy: the handshake, a write and a read, a notification.
    let peer = initiator.open_segment(&name).await.expect("the handshake crosses the proxy");
    let at = t.take(1 << 20);
    initiator.transfer(&[req(Opcode::Write, src.addr(), peer, t.base() + at, 1 << 20)]).await.unwrap();
    initiator.transfer(&[req(Opcode::Read, local.addr(), peer, t.base() + RO, RO_LEN)]).await.unwrap();
    assert!(t.region()[at as usize..(at + (1 << 20)) as usize] == src.bytes()[..1 << 20], "baseline write");
    assert!(local.bytes()[..RO_LEN as usize] == t.region()[..RO_LEN as usize], "baseline read");
    initiator.send_notification(&name, "baseline").await.unwrap();
    assert_eq!(target.get_notifications().iter().map(|n| n.notify_msg.as_str()).collect::<Vec<_>>(), ["baseline"]);

    // A partition while a batch is in flight (latency keeps it in flight when it starts).
    link.delay(100);
    let mut reqs = Vec::new();
    let mut writes = Vec::new();
    for i in 0..16u64 {
        reqs.push(req(Opcode::Read, local.addr() + i * 32768, peer, t.base() + RO + i * 32768, 32768));
        let w = Written { at: t.take(32768), from: i * 32768, len: 32768 };
        reqs.push(req(Opcode::Write, src.addr() + w.from, peer, t.base() + w.at, w.len));
        writes.push(w);
    }
    let submitted = Instant::now();
    let batch = initiator.submit(&reqs).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    link.partition();
    let notify = {
        let (initiator, name) = (initiator.clone(), name.clone());
        tokio::spawn(async move {
            let t = Instant::now();
            (initiator.send_notification(&name, "during the partition").await, t.elapsed())
        })
    };
    let mut first_failure = None;
    while !batch.is_done() {
        if first_failure.is_none() && batch.status().failed > 0 {
            first_failure = Some(submitted.elapsed());
        }
        assert!(submitted.elapsed() < TIMEOUT + Duration::from_secs(3), "the batch hangs: {:?}", batch.status());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let done = submitted.elapsed();
    let first_failure = first_failure.unwrap_or(done);
    for i in 0..reqs.len() {
        assert_eq!(batch.request_status(i), Some(RequestStatus::Failed(ErrorKind::Timeout)), "request {i}");
    }
    assert!(first_failure >= TIMEOUT, "a request failed after {first_failure:?}, before the {TIMEOUT:?} timeout");
    assert!(done < TIMEOUT + Duration::from_millis(1500), "the batch took {done:?} to fail");
    t.failed.extend(writes);
    let (notified, took) = notify.await.unwrap();
    let e = notified.expect_err("a notification across a partition");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(took >= TIMEOUT - Duration::from_millis(1), "the notification failed after {took:?}");
    eprintln!("partition: first failure after {first_failure:?}, all {} failed after {done:?}", reqs.len());

    // Healed: the next transfer succeeds, soon. (The held bytes flow too: the partition's
    // writes and notification may land now, after they were reported failed.)
    link.delay(0);
    link.heal();
    let healed = Instant::now();
    let at = t.take(65536);
    initiator
        .transfer(&[
            req(Opcode::Write, src.addr() + 65536, peer, t.base() + at, 65536),
            req(Opcode::Read, local.addr() + (2 << 20), peer, t.base() + RO + 4096, 65536),
        ])
        .await
        .expect("the first transfer after the partition healed");
    let recovered = healed.elapsed();
    assert!(recovered < HEAL_BOUND, "the first transfer after healing took {recovered:?}");
    assert!(t.region()[at as usize..(at + 65536) as usize] == src.bytes()[65536..131072]);
    assert!(local.bytes()[2 << 20..(2 << 20) + 65536] == t.region()[4096..4096 + 65536]);
    initiator.send_notification(&name, "healed").await.unwrap();
    eprintln!("healed: the next transfer succeeded {recovered:?} after");

    // Bursts of stalls, partitions longer than the timeout, resets and latency while batches
    // run; then healed again.
    let weather = {
        let (link, mut rng) = (link.clone(), rng.fork(1));
        // A deck of about 4 s of events, with at least one partition longer than the timeout
        // and two resets, shuffled.
        let mut deck = vec![("partition", rng.within(1000..1400)), ("reset", 0), ("reset", 0)];
        while deck.iter().map(|e| e.1 + 60).sum::<u64>() < 4000 {
            deck.push(match rng.below(10) {
                0..=5 => ("forward", rng.within(50..300)),
                6..=8 => ("stall", rng.within(50..700)),
                _ => ("reset", 0),
            });
        }
        for i in (1..deck.len()).rev() {
            deck.swap(i, rng.below(i as u64 + 1) as usize);
        }
        tokio::spawn(async move {
            let mut events = Vec::new();
            for (what, ms) in deck {
                let delay = rng.pick(&[0, 0, 0, 2, 20]);
                link.delay(delay);
                match what {
                    "forward" => link.heal(),
                    "reset" => {
                        link.heal();
                        link.cut();
                    }
                    _ => link.partition(),
                }
                events.push(format!("{what} {ms}ms (+{delay}ms)"));
                // Every event lasts a little, so that batches meet it.
                tokio::time::sleep(Duration::from_millis(ms + 60)).await;
            }
            link.delay(0);
            link.heal();
            events
        })
    };
    let (mut ok, mut failed, mut rounds) = (0, 0, 0);
    while !weather.is_finished() {
        rounds += 1;
        let mut reqs = Vec::new();
        let mut round_writes = Vec::new();
        let mut reads = Vec::new();
        let mut dst = 0u64;
        // Paced, so that the rounds of the whole phase fit the write part.
        tokio::time::sleep(Duration::from_millis(20)).await;
        for _ in 0..4 {
            let len = rng.within(1..4096);
            let remote = rng.below(RO_LEN - len);
            reads.push((reqs.len(), dst, remote, len));
            reqs.push(req(Opcode::Read, local.addr() + dst, peer, t.base() + RO + remote, len));
            dst += len;
            let w = Written { at: t.take(len), from: rng.below((4 << 20) - len), len };
            round_writes.push((reqs.len(), w));
            reqs.push(req(Opcode::Write, src.addr() + w.from, peer, t.base() + w.at, w.len));
        }
        let notify = {
            let (initiator, name) = (initiator.clone(), name.clone());
            tokio::spawn(async move {
                let t = Instant::now();
                (initiator.send_notification(&name, format!("round {rounds}")).await, t.elapsed())
            })
        };
        let submitted = Instant::now();
        let batch = initiator.submit(&reqs).await.unwrap();
        let status = batch.wait(TIMEOUT + Duration::from_secs(3)).await.expect("a batch under loss hangs");
        assert!(status.is_done() && submitted.elapsed() < TIMEOUT + Duration::from_secs(2), "{status:?}");
        let outcome = |i: usize| match batch.request_status(i) {
            Some(RequestStatus::Completed) => true,
            Some(RequestStatus::Failed(ErrorKind::Timeout | ErrorKind::PeerUnreachable)) => false,
            other => panic!("round {rounds}, request {i}: {other:?} {:?}", batch.error(i)),
        };
        for &(i, dst, remote, len) in &reads {
            if outcome(i) {
                ok += 1;
                let got = &local.bytes()[dst as usize..(dst + len) as usize];
                assert!(
                    got == &t.region()[(RO + remote) as usize..(RO + remote + len) as usize],
                    "round {rounds}: read {i}"
                );
            } else {
                failed += 1;
            }
        }
        for &(i, w) in &round_writes {
            if outcome(i) {
                ok += 1;
                let landed = &t.region()[w.at as usize..(w.at + w.len) as usize];
                assert!(
                    landed == &src.bytes()[w.from as usize..(w.from + w.len) as usize],
                    "round {rounds}: write {i}"
                );
            } else {
                failed += 1;
                t.failed.push(w);
            }
        }
        let (notified, took) = notify.await.unwrap();
        assert!(took < TIMEOUT + Duration::from_secs(2), "a notification under loss took {took:?}");
        if let Err(e) = notified {
            assert!(matches!(e.kind(), ErrorKind::Timeout | ErrorKind::PeerUnreachable), "{e}");
        }
    }
    let events = weather.await.unwrap();
    let healed = Instant::now();
    let at = t.take(4096);
    initiator
        .transfer(&[req(Opcode::Write, src.addr(), peer, t.base() + at, 4096)])
        .await
        .expect("the first transfer after the bursts ended");
    let recovered = healed.elapsed();
    assert!(recovered < HEAL_BOUND, "the first transfer after the bursts took {recovered:?}");
    assert!(t.region()[at as usize..(at + 4096) as usize] == src.bytes()[..4096]);
    eprintln!(
        "loss: {rounds} rounds, {ok} requests succeeded, {failed} failed cleanly, recovered in {recovered:?}; {}",
        events.join(", ")
    );

    // Late bytes of failed writes have had time to land; none went astray.
    tokio::time::sleep(Duration::from_millis(200)).await;
    t.check(src.bytes());
    let landed = t
        .failed
        .iter()
        .filter(|w| {
            t.region()[w.at as usize..(w.at + w.len) as usize]
                != t.initial[(CANARY + w.at) as usize..(CANARY + w.at + w.len) as usize]
        })
        .count();
    eprintln!("{landed} of the {} writes reported failed changed the target's memory anyway (late)", t.failed.len());
    initiator.shutdown().await.unwrap();
    let shutdown = target_rt.spawn(async move { target.shutdown().await });
    shutdown.await.unwrap().unwrap();
    t.check(src.bytes());
    eprintln!("partition suite took {:?}", started.elapsed());
}
