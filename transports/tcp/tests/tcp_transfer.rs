//! The TCP transport and the P2P handshake between Ferry engines over real loopback sockets,
//! and the bad input and faults the target must survive.

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{ErrorKind, InProcessMetadata, Location, MetadataStore, Opcode, SegmentDescriptor, TransferRequest};
use ferry_metadata_p2p::frame::{FrameType, encode, read_frame};
use ferry_test_support::{
    Buffer, fake_tcp_peer, p2p_tcp_engine, pattern, pattern_buffer, tcp_engine_knowing, tcp_only,
};
use ferry_transport_tcp::TcpEndpoint;
use ferry_transport_tcp::wire::{Header, STATUS_LEN, Status};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(10);

fn req(opcode: Opcode, source: u64, target: ferry::SegmentHandle, target_offset: u64, length: u64) -> TransferRequest {
    TransferRequest { opcode, source, target, target_offset, length }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_writes_of_every_size_cross_the_socket() {
    let target = p2p_tcp_engine(T).await;
    let initiator = p2p_tcp_engine(T).await;
    assert!(target.segment_name().starts_with("127.0.0.1:"), "P2P names the engine host:rpc_port");
    const LEN: usize = 20 << 20;
    let remote = pattern_buffer(LEN, 5);
    let local = Buffer::zeroed(LEN);
    unsafe { target.register_memory(remote.addr(), remote.len(), Location::Cpu(0)).await }.unwrap();
    unsafe { initiator.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = initiator.open_segment(target.segment_name()).await.unwrap();
    assert_eq!(initiator.segment(peer).unwrap().protocol(), "tcp");
    let endpoint = TcpEndpoint::from_descriptor(initiator.segment(peer).unwrap().descriptor()).unwrap().unwrap();
    assert_eq!(endpoint.proto_version, Some(2));

    for (i, size) in [1u64, 7, 4096, 65_539, 1 << 20, 16 << 20].into_iter().enumerate() {
        let off = (i as u64 * 4099) % 4096;
        initiator.transfer(&[req(Opcode::Read, local.addr(), peer, remote.addr() + off, size)]).await.unwrap();
        let got = &local.bytes()[..size as usize];
        assert!(got.iter().enumerate().all(|(k, &b)| b == pattern(k as u64 + off, 5)), "read of {size} bytes");
    }
    // Write a different pattern into the target.
    let src = pattern_buffer(LEN, 77);
    unsafe { initiator.register_memory(src.addr(), src.len(), Location::Cpu(0)).await }.unwrap();
    for size in [1u64, 4096, 3 << 20] {
        initiator.transfer(&[req(Opcode::Write, src.addr(), peer, remote.addr() + 100, size)]).await.unwrap();
        assert_eq!(&remote.bytes()[100..100 + size as usize], &src.bytes()[..size as usize], "write of {size} bytes");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_batch_is_pipelined_over_the_lanes() {
    let target = p2p_tcp_engine(T).await;
    let initiator = p2p_tcp_engine(T).await;
    let remote = pattern_buffer(1 << 20, 9);
    let local = Buffer::zeroed(1 << 20);
    unsafe { target.register_memory(remote.addr(), remote.len(), Location::Cpu(0)).await }.unwrap();
    unsafe { initiator.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = initiator.open_segment(target.segment_name()).await.unwrap();
    let reqs: Vec<TransferRequest> =
        (0..256u64).map(|i| req(Opcode::Read, local.addr() + i * 4096, peer, remote.addr() + i * 4096, 4096)).collect();
    let batch = initiator.submit(&reqs).await.unwrap();
    assert!(batch.wait(T).await.unwrap().is_success());
    assert_eq!(local.bytes(), remote.bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_request_fails_alone_and_the_connection_keeps_serving() {
    let target = p2p_tcp_engine(T).await;
    let initiator = p2p_tcp_engine(T).await;
    let a = pattern_buffer(8192, 1);
    let b = pattern_buffer(8192, 2);
    let local = Buffer::zeroed(8192);
    let regions = [(a.addr(), a.len(), Location::Cpu(0)), (b.addr(), b.len(), Location::Cpu(0))];
    unsafe { target.register_memory_batch(&regions).await }.unwrap();
    unsafe { initiator.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = initiator.open_segment(target.segment_name()).await.unwrap();
    // The target gives `a` back after we cached its descriptor: our check passes, its check fails.
    target.unregister_memory(a.addr()).await.unwrap();
    let batch = initiator
        .submit(&[
            req(Opcode::Read, local.addr(), peer, a.addr(), 4096),
            req(Opcode::Read, local.addr() + 4096, peer, b.addr(), 4096),
        ])
        .await
        .unwrap();
    batch.wait(T).await.unwrap();
    assert_eq!(batch.request_status(0), Some(ferry::RequestStatus::Failed(ErrorKind::OutOfBounds)));
    assert_eq!(batch.request_status(1), Some(ferry::RequestStatus::Completed));
    assert_eq!(&local.bytes()[4096..], &b.bytes()[..4096]);
}

/// A lane reads the responses in flight with one read, as if every status said OK, and waits
/// for a good part of them at once: a rejection in the middle of a pipeline (no data after its
/// status) must neither shift the data of the responses after it nor leave the reader waiting
/// for bytes that never come (it would wait until the deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_inside_a_pipeline_shifts_nothing_and_stalls_nothing() {
    let target = p2p_tcp_engine(T).await;
    let initiator = p2p_tcp_engine(T).await;
    const BLOCK: u64 = 64 << 10;
    const N: u64 = 48;
    let gone = pattern_buffer(BLOCK as usize, 1);
    let remote = pattern_buffer((N * BLOCK) as usize, 2);
    let local = Buffer::zeroed((N * BLOCK) as usize);
    let regions = [(gone.addr(), gone.len(), Location::Cpu(0)), (remote.addr(), remote.len(), Location::Cpu(0))];
    unsafe { target.register_memory_batch(&regions).await }.unwrap();
    unsafe { initiator.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = initiator.open_segment(target.segment_name()).await.unwrap();
    // Our cached descriptor still has `gone`; the target refuses it.
    target.unregister_memory(gone.addr()).await.unwrap();
    let rejected = [5u64, 6, 30, N - 1];
    for round in 0..3 {
        local.fill_pattern(200 + round);
        let reqs: Vec<TransferRequest> = (0..N)
            .map(|i| {
                let from = if rejected.contains(&i) { gone.addr() } else { remote.addr() + i * BLOCK };
                req(Opcode::Read, local.addr() + i * BLOCK, peer, from, BLOCK)
            })
            .collect();
        let started = Instant::now();
        let batch = initiator.submit(&reqs).await.unwrap();
        batch.wait(T).await.unwrap();
        assert!(
            started.elapsed() < T / 2,
            "round {round}: the batch took {:?}: a reader waited for data a rejection never sent",
            started.elapsed()
        );
        for i in 0..N {
            let at = (i * BLOCK) as usize..((i + 1) * BLOCK) as usize;
            if rejected.contains(&i) {
                assert_eq!(
                    batch.request_status(i as usize),
                    Some(ferry::RequestStatus::Failed(ErrorKind::OutOfBounds))
                );
            } else {
                assert_eq!(
                    batch.request_status(i as usize),
                    Some(ferry::RequestStatus::Completed),
                    "round {round}: {i}"
                );
                assert!(local.bytes()[at.clone()] == remote.bytes()[at], "round {round}: request {i}'s data");
            }
        }
    }
}

/// A target engine on in-process metadata whose data port a raw socket can reach.
async fn raw_target(timeout: Duration) -> (ferry::TransferEngine, Buffer, u16) {
    let meta = InProcessMetadata::new();
    let e = ferry::builder()
        .transports(tcp_only())
        .protocol("tcp")
        .segment_name("127.0.0.1:1")
        .metadata(meta as Arc<dyn MetadataStore>)
        .transfer_timeout(timeout)
        .build()
        .await
        .unwrap();
    let buf = pattern_buffer(1 << 16, 3);
    unsafe { e.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
    let port = TcpEndpoint::from_descriptor(&e.local_descriptor()).unwrap().unwrap().port;
    (e, buf, port)
}

async fn status(s: &mut TcpStream) -> Status {
    let mut st = [0u8; STATUS_LEN];
    s.read_exact(&mut st).await.unwrap();
    Status::decode(&st).unwrap()
}

async fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await, Ok(Ok(0)) | Ok(Err(_)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_target_rejects_bad_requests_and_keeps_serving_everyone_else() {
    let (_e, buf, port) = raw_target(Duration::from_millis(500)).await;
    let hdr = |size, addr, opcode, v2| Header { size, addr, opcode, v2 }.encode();
    let mut good = TcpStream::connect(("127.0.0.1", port)).await.unwrap();

    // Out-of-range READ, zero size, and a small WRITE outside memory: status 1, connection lives.
    good.write_all(&hdr(1 << 40, buf.addr(), Opcode::Read, true)).await.unwrap();
    assert_eq!(status(&mut good).await, Status::Rejected);
    good.write_all(&hdr(0, buf.addr(), Opcode::Read, true)).await.unwrap();
    assert_eq!(status(&mut good).await, Status::Rejected);
    good.write_all(&hdr(16, 8, Opcode::Write, true)).await.unwrap();
    good.write_all(&[0xAB; 16]).await.unwrap();
    assert_eq!(status(&mut good).await, Status::Rejected);
    // Then a valid READ on the same connection.
    good.write_all(&hdr(32, buf.addr() + 10, Opcode::Read, true)).await.unwrap();
    assert_eq!(status(&mut good).await, Status::Ok);
    let mut data = [0u8; 32];
    good.read_exact(&mut data).await.unwrap();
    assert_eq!(&data[..], &buf.bytes()[10..42]);

    // Random bytes: the offending connection is closed.
    let mut junk = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    junk.write_all(&[0x42; 24]).await.unwrap();
    assert!(closed(&mut junk).await, "a bad opcode closes the connection");
    // A truncated header followed by silence (slow loris): closed after the header timeout.
    let mut slow = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    slow.write_all(&hdr(8, buf.addr(), Opcode::Read, true)[..10]).await.unwrap();
    let t = Instant::now();
    assert!(closed(&mut slow).await, "a stalled header closes the connection");
    assert!(t.elapsed() < Duration::from_secs(4));
    // A huge WRITE outside memory: rejected, then closed rather than drained.
    let mut huge = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    huge.write_all(&hdr(u64::MAX, 8, Opcode::Write, true)).await.unwrap();
    assert_eq!(status(&mut huge).await, Status::Rejected);
    assert!(closed(&mut huge).await);
    // A v1 READ gets data with no status frame; a v1 rejection closes.
    let mut v1 = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    v1.write_all(&hdr(4, buf.addr(), Opcode::Read, false)).await.unwrap();
    let mut four = [0u8; 4];
    v1.read_exact(&mut four).await.unwrap();
    assert_eq!(&four[..], &buf.bytes()[..4]);
    v1.write_all(&hdr(4, 8, Opcode::Read, false)).await.unwrap();
    assert!(closed(&mut v1).await);
    // A v1 WRITE lands with no acknowledgement.
    v1 = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    v1.write_all(&hdr(3, buf.addr(), Opcode::Write, false)).await.unwrap();
    v1.write_all(&[9, 9, 9]).await.unwrap();
    v1.write_all(&hdr(3, buf.addr(), Opcode::Read, false)).await.unwrap();
    v1.read_exact(&mut four[..3]).await.unwrap();
    assert_eq!(&four[..3], &[9, 9, 9]);

    // Everyone else was served all along.
    good.write_all(&hdr(8, buf.addr() + 3, Opcode::Read, true)).await.unwrap();
    assert_eq!(status(&mut good).await, Status::Ok);
    let mut eight = [0u8; 8];
    good.read_exact(&mut eight).await.unwrap();
    assert_eq!(&eight[..], &buf.bytes()[3..11]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handshake_refuses_bad_frames_and_answers_probes() {
    let e = p2p_tcp_engine(T).await;
    let port: u16 = e.segment_name().rsplit_once(':').unwrap().1.parse().unwrap();
    for bad in [0u64.to_le_bytes().to_vec(), u64::MAX.to_le_bytes().to_vec(), (1u64 << 21).to_le_bytes().to_vec()] {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        s.write_all(&bad).await.unwrap();
        assert!(closed(&mut s).await, "frame length {bad:?} must close the connection");
    }
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(&encode(FrameType::Probe, b"{}")).await.unwrap();
    let reply = read_frame(&mut s, 1 << 20, Duration::from_secs(5)).await.unwrap();
    assert_eq!(reply.kind, FrameType::Probe);
    assert_eq!(reply.payload, br#"{"status":"success"}"#);
    // A Metadata request gets the descriptor, in Mooncake's JSON.
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(&encode(FrameType::Metadata, b"{}")).await.unwrap();
    let reply = read_frame(&mut s, 1 << 20, Duration::from_secs(5)).await.unwrap();
    let d = SegmentDescriptor::from_json("handshake", &reply.payload).unwrap();
    assert_eq!(d.name, e.segment_name());
    assert_eq!(d.protocol, "tcp");
    assert!(TcpEndpoint::from_descriptor(&d).unwrap().is_some(), "with its tcp endpoint: {d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_arrive_after_the_data() {
    let target = p2p_tcp_engine(T).await;
    let initiator = p2p_tcp_engine(T).await;
    let remote = Buffer::zeroed(4096);
    let local = pattern_buffer(4096, 4);
    unsafe { target.register_memory(remote.addr(), remote.len(), Location::Cpu(0)).await }.unwrap();
    unsafe { initiator.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = initiator.open_segment(target.segment_name()).await.unwrap();
    initiator
        .transfer_with_notification(&[req(Opcode::Write, local.addr(), peer, remote.addr(), 4096)], "req-7:2")
        .await
        .unwrap();
    let got = target.get_notifications();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].notify_msg, "req-7:2");
    assert_eq!(got[0].name, initiator.segment_name());
    assert_eq!(remote.bytes(), local.bytes(), "the data landed before the notification was sent");
    initiator.send_notification(target.segment_name(), "standalone").await.unwrap();
    assert_eq!(target.get_notifications()[0].notify_msg, "standalone");
    assert!(target.get_notifications().is_empty(), "draining empties the queue");
    let e = initiator.send_notification("127.0.0.1:1", "nobody").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_times_out_and_a_dead_peer_is_unreachable() {
    // A "peer" that accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let d = fake_tcp_peer("silent", silent_port, 0x1000, 1 << 20, None);
    let mut dead = d.clone();
    dead.name = "dead".into();
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port() // closed when `l` drops: nothing listens there
    };
    TcpEndpoint { host: Some("127.0.0.1".into()), port: closed, proto_version: Some(2), fence: None, auth: None }
        .write_to(&mut dead)
        .unwrap();
    let e = tcp_engine_knowing(&[&d, &dead], Duration::from_millis(300)).await;
    let local = Buffer::zeroed(4096);
    unsafe { e.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();

    let peer = e.open_segment("silent").await.unwrap();
    let t = Instant::now();
    let err = e.transfer(&[req(Opcode::Read, local.addr(), peer, 0x1000, 16)]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(t.elapsed() < Duration::from_secs(3), "failed within the configured timeout, took {:?}", t.elapsed());

    let peer = e.open_segment("dead").await.unwrap();
    let err = e.transfer(&[req(Opcode::Write, local.addr(), peer, 0x1000, 16)]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PeerUnreachable, "{err}");
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_goes_away_fails_its_requests_and_a_restarted_one_is_reachable() {
    let initiator = p2p_tcp_engine(Duration::from_secs(2)).await;
    let local = Buffer::zeroed(1 << 20);
    unsafe { initiator.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();

    let first = p2p_tcp_engine(T).await;
    let name = first.segment_name().to_owned();
    let remote = pattern_buffer(1 << 20, 1);
    unsafe { first.register_memory(remote.addr(), remote.len(), Location::Cpu(0)).await }.unwrap();
    let peer = initiator.open_segment(&name).await.unwrap();
    initiator.transfer(&[req(Opcode::Read, local.addr(), peer, remote.addr(), 1 << 20)]).await.unwrap();

    // Another peer keeps working throughout.
    let other = p2p_tcp_engine(T).await;
    let other_buf = pattern_buffer(4096, 2);
    unsafe { other.register_memory(other_buf.addr(), other_buf.len(), Location::Cpu(0)).await }.unwrap();
    let other_peer = initiator.open_segment(other.segment_name()).await.unwrap();

    first.shutdown().await.unwrap();
    drop(first);
    let t = Instant::now();
    let err = initiator.transfer(&[req(Opcode::Read, local.addr(), peer, remote.addr(), 4096)]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PeerUnreachable, "{err}");
    assert!(t.elapsed() < Duration::from_secs(3));
    initiator.transfer(&[req(Opcode::Read, local.addr(), other_peer, other_buf.addr(), 4096)]).await.unwrap();
    assert_eq!(&local.bytes()[..4096], other_buf.bytes());

    // The peer restarts on the same RPC port (new data port, new buffer): reachable again.
    let port: u16 = name.rsplit_once(':').unwrap().1.parse().unwrap();
    let cfg = ferry::Config::from_json_str(
        &format!(
            r#"{{"local_hostname": "127.0.0.1", "rpc_port": {port}, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}}"#
        ),
        None,
    )
    .unwrap();
    let again = ferry::builder().config(cfg).transports(tcp_only()).build().await.unwrap();
    assert_eq!(again.segment_name(), name);
    let remote2 = pattern_buffer(4096, 3);
    unsafe { again.register_memory(remote2.addr(), remote2.len(), Location::Cpu(0)).await }.unwrap();
    initiator.transfer(&[req(Opcode::Read, local.addr(), peer, remote2.addr(), 4096)]).await.unwrap();
    assert_eq!(&local.bytes()[..4096], remote2.bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_answer_never_releases_a_write_whose_payload_is_still_being_sent() {
    // A "peer" that answers OK right after the header and then stops reading.
    let early = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = early.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        if let Ok((mut s, _)) = early.accept() {
            let mut hdr = [0u8; 24];
            let _ = s.read_exact(&mut hdr);
            let _ = s.write_all(&Status::Ok.encode());
            std::thread::sleep(Duration::from_secs(3));
        }
    });
    let d = fake_tcp_peer("early", port, 0x1000_0000, 64 << 20, None);
    let e = tcp_engine_knowing(&[&d], Duration::from_millis(800)).await;
    let local = pattern_buffer(32 << 20, 1);
    unsafe { e.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = e.open_segment("early").await.unwrap();
    let batch = e.submit(&[req(Opcode::Write, local.addr(), peer, 0x1000_0000, 32 << 20)]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!batch.is_done(), "the OK came early, but the payload is still being sent");
    assert_eq!(e.memory().leases(), 1, "its memory is still in use: the batch keeps its lease");
    let err = batch.wait_ok(Duration::from_secs(5)).await.unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::PeerUnreachable | ErrorKind::Timeout), "{err}");
    e.unregister_memory(local.addr()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_fails_requests_waiting_on_a_silent_peer_at_once() {
    // Without this, a request cancelled while waiting for a peer that never answers held its
    // memory until its deadline, and a shutdown right after the cancel answered Busy.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let d = fake_tcp_peer("silent", silent.local_addr().unwrap().port(), 0x1000, 1 << 20, None);
    let e = tcp_engine_knowing(&[&d], Duration::from_secs(20)).await;
    let local = Buffer::zeroed(4096);
    unsafe { e.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = e.open_segment("silent").await.unwrap();
    let batch = e.submit(&[req(Opcode::Read, local.addr(), peer, 0x1000, 16)]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await; // the request is on the wire
    batch.cancel();
    assert!(!batch.all_released(), "the lane still owns the request's memory");
    let t = Instant::now();
    e.shutdown().await.expect("shutdown releases the in-flight request instead of answering Busy");
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?} (the transfer timeout is 20 s)", t.elapsed());
    assert!(batch.all_released());
    drop(silent);
}
