//! Peer authentication between real engines over loopback sockets: the TCP data path and the
//! P2P handshake, with the same secret, another secret, no secret on one side, and raw sockets
//! speaking Mooncake's wire (Mooncake has no authentication) to a target that requires it.

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{
    Config, ErrorKind, InProcessMetadata, Location, MetadataStore, Opcode, SegmentDescriptor, TransferEngine,
    TransferRequest,
};
use ferry_metadata_p2p::auth::AUTH_REQUIRED_KEY;
use ferry_metadata_p2p::frame::{FrameType, encode, read_frame};
use ferry_peer_auth::SECRET;
use ferry_test_support::{Buffer, pattern, pattern_buffer, tcp_only};
use ferry_transport_tcp::TcpEndpoint;
use ferry_transport_tcp::wire::Header;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(10);
const SECRET_A: &str = "the cluster's shared secret, A";
const SECRET_B: &str = "another cluster's secret, B";

fn req(opcode: Opcode, source: u64, target: ferry::SegmentHandle, target_offset: u64, length: u64) -> TransferRequest {
    TransferRequest { opcode, source, target, target_offset, length }
}

/// An engine on the P2P handshake and the TCP transport, with `secret` (set through the API, so
/// the process environment cannot change it) or without one.
async fn p2p_engine(secret: Option<&str>, timeout: Duration) -> TransferEngine {
    let mut cfg = Config::from_json_str(
        r#"{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}"#,
        None,
    )
    .unwrap();
    if let Some(s) = secret {
        cfg.set_option(&SECRET, s);
    }
    ferry::builder().config(cfg).transports(tcp_only()).transfer_timeout(timeout).build().await.unwrap()
}

/// An engine named `name` on the shared in-process store `meta` (no handshake: only the data
/// path is exercised), TCP only.
async fn store_engine(meta: &Arc<InProcessMetadata>, name: &str, secret: Option<&str>) -> TransferEngine {
    let mut b = ferry::builder()
        .transports(tcp_only())
        .protocol("tcp")
        .segment_name(name)
        .metadata(meta.clone() as Arc<dyn MetadataStore>)
        .transfer_timeout(T);
    if let Some(s) = secret {
        b.config_mut().set_option(&SECRET, s);
    }
    b.build().await.unwrap()
}

fn data_port(e: &TransferEngine) -> u16 {
    TcpEndpoint::from_descriptor(&e.local_descriptor()).unwrap().unwrap().port
}

fn rpc_port(e: &TransferEngine) -> u16 {
    e.segment_name().rsplit_once(':').unwrap().1.parse().unwrap()
}

/// True when the peer closes `s` (or resets it) within 5 s without sending a byte.
async fn closed_without_a_byte(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    matches!(tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await, Ok(Ok(0)) | Ok(Err(_)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_with_the_same_secret_transfer_notify_and_probe() {
    let target = p2p_engine(Some(SECRET_A), T).await;
    let initiator = p2p_engine(Some(SECRET_A), T).await;
    let remote = pattern_buffer(1 << 20, 3);
    let local = Buffer::zeroed(1 << 20);
    unsafe { target.register_memory(remote.addr(), remote.len(), Location::Cpu(0)).await }.unwrap();
    unsafe { initiator.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();

    // The descriptor comes over an authenticated handshake and advertises the requirement.
    let peer = initiator.open_segment(target.segment_name()).await.unwrap();
    let endpoint = TcpEndpoint::from_descriptor(initiator.segment(peer).unwrap().descriptor()).unwrap().unwrap();
    assert_eq!(endpoint.auth.as_deref(), Some("hmac-sha256-v1"));

    // Reads of several sizes, a batch over every lane, and a write with a notification.
    for size in [1u64, 4096, 1 << 20] {
        initiator.transfer(&[req(Opcode::Read, local.addr(), peer, remote.addr(), size)]).await.unwrap();
        assert!(local.bytes()[..size as usize].iter().enumerate().all(|(k, &b)| b == pattern(k as u64, 3)));
    }
    let reqs: Vec<TransferRequest> =
        (0..64u64).map(|i| req(Opcode::Read, local.addr() + i * 4096, peer, remote.addr() + i * 4096, 4096)).collect();
    initiator.transfer(&reqs).await.unwrap();
    let src = pattern_buffer(4096, 77);
    unsafe { initiator.register_memory(src.addr(), src.len(), Location::Cpu(0)).await }.unwrap();
    initiator
        .transfer_with_notification(&[req(Opcode::Write, src.addr(), peer, remote.addr() + 8192, 4096)], "kv:1")
        .await
        .unwrap();
    assert_eq!(&remote.bytes()[8192..8192 + 4096], src.bytes());
    let notes = target.get_notifications();
    assert_eq!(notes.len(), 1);
    assert_eq!((notes[0].name.as_str(), notes[0].notify_msg.as_str()), (initiator.segment_name(), "kv:1"));
    initiator.probe(target.segment_name()).await.unwrap();
    // And the other way round.
    target.send_notification(initiator.segment_name(), "back").await.unwrap();
    assert_eq!(initiator.get_notifications()[0].notify_msg, "back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_fails_on_the_handshake_and_on_the_data_path() {
    // Handshake: descriptor fetch, notification and probe are refused; nothing is delivered.
    let target = p2p_engine(Some(SECRET_A), T).await;
    let stranger = p2p_engine(Some(SECRET_B), T).await;
    let e = stranger.open_segment(target.segment_name()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    let port = rpc_port(&target);
    assert!(
        e.message().contains(&format!("P2P handshake with 127.0.0.1:{port}: authentication is on here"))
            && e.message().contains("the two auth secrets differ"),
        "{e}"
    );
    let e = stranger.send_notification(target.segment_name(), "forged").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    let e = stranger.probe(target.segment_name()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(target.get_notifications().is_empty(), "no notification from a peer without the secret");

    // Data path: the descriptor comes from a shared store, the connection is refused.
    let meta = InProcessMetadata::new();
    let owner = store_engine(&meta, "127.0.0.1:1", Some(SECRET_A)).await;
    let other = store_engine(&meta, "127.0.0.1:2", Some(SECRET_B)).await;
    let remote = pattern_buffer(8192, 1);
    let local = pattern_buffer(8192, 200);
    unsafe { owner.register_memory(remote.addr(), remote.len(), Location::Cpu(0)).await }.unwrap();
    unsafe { other.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = other.open_segment(owner.segment_name()).await.unwrap();
    let e = other.transfer(&[req(Opcode::Write, local.addr(), peer, remote.addr(), 4096)]).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        e.message().contains(&format!("tcp peer 127.0.0.1:{}: authentication is on here", data_port(&owner)))
            && e.message().contains("refused this node's proof: the two auth secrets differ"),
        "{e}"
    );
    assert!(remote.bytes().iter().enumerate().all(|(k, &b)| b == pattern(k as u64, 1)), "nothing was written");
    let e = other.transfer(&[req(Opcode::Read, local.addr(), peer, remote.addr(), 4096)]).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(local.bytes().iter().enumerate().all(|(k, &b)| b == pattern(k as u64, 200)), "nothing was read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_sockets_speaking_mooncakes_wire_are_refused_without_touching_memory() {
    // A short transfer timeout: the target's authentication deadline follows its header limit.
    let target = p2p_engine(Some(SECRET_A), Duration::from_secs(1)).await;
    let buf = pattern_buffer(1 << 16, 9);
    unsafe { target.register_memory(buf.addr(), buf.len(), Location::Cpu(0)).await }.unwrap();
    let port = data_port(&target);

    // A Mooncake v2 WRITE into registered memory, payload and all: closed, nothing written.
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let write = Header { size: 64, addr: buf.addr(), opcode: Opcode::Write, v2: true }.encode();
    s.write_all(&write).await.unwrap();
    let _ = s.write_all(&[0xEE; 64]).await;
    assert!(closed_without_a_byte(&mut s).await, "no status frame, no acknowledgement");
    // A Mooncake v2 READ: closed, no data.
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(&Header { size: 64, addr: buf.addr(), opcode: Opcode::Read, v2: true }.encode()).await.unwrap();
    assert!(closed_without_a_byte(&mut s).await, "no status frame, no data");
    // A v1 READ (no status frame at all): closed, no data.
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(&Header { size: 64, addr: buf.addr(), opcode: Opcode::Read, v2: false }.encode()).await.unwrap();
    assert!(closed_without_a_byte(&mut s).await, "no data");
    // Silence: closed at the authentication deadline.
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let t = Instant::now();
    assert!(closed_without_a_byte(&mut s).await);
    assert!(t.elapsed() < Duration::from_secs(3), "closed after {:?}", t.elapsed());
    assert!(buf.bytes().iter().enumerate().all(|(k, &b)| b == pattern(k as u64, 9)), "memory untouched");

    // The handshake port: a Mooncake Notify frame is answered that authentication is required
    // and is not delivered; a Metadata frame gets no descriptor.
    let rpc = rpc_port(&target);
    for (kind, payload) in
        [(FrameType::Notify, &br#"{"name":"forger","notify_msg":"kv:9"}"#[..]), (FrameType::Metadata, b"{}")]
    {
        let mut s = TcpStream::connect(("127.0.0.1", rpc)).await.unwrap();
        s.write_all(&encode(kind, payload)).await.unwrap();
        let reply = read_frame(&mut s, 1 << 20, Duration::from_secs(5)).await.unwrap();
        assert_eq!(reply.kind, kind);
        let v: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(v[AUTH_REQUIRED_KEY], "hmac-sha256-v1", "{v}");
        assert!(SegmentDescriptor::from_json("x", &reply.payload).map(|d| d.buffers.is_empty()).unwrap_or(true));
    }
    assert!(target.get_notifications().is_empty(), "the forged notification was not delivered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_with_a_secret_refuses_peers_that_do_not_offer_authentication() {
    // A "Mooncake target": a descriptor without `ferry_auth`, and a socket that records whether
    // anything connected.
    let meta = InProcessMetadata::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut d = SegmentDescriptor::new("127.0.0.1:3", "tcp");
    let port = listener.local_addr().unwrap().port();
    TcpEndpoint { host: Some("127.0.0.1".into()), port, proto_version: Some(2), fence: None, auth: None }
        .write_to(&mut d)
        .unwrap();
    d.buffers.push(ferry::BufferDesc {
        addr: 0x1000,
        length: 1 << 20,
        name: "cpu:0".into(),
        device_id: None,
        extra: Default::default(),
    });
    MetadataStore::put(&*meta, "mooncake/ram/127.0.0.1:3", &d.to_json()).await.unwrap();
    let initiator = store_engine(&meta, "127.0.0.1:4", Some(SECRET_A)).await;
    let local = Buffer::zeroed(4096);
    unsafe { initiator.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = initiator.open_segment("127.0.0.1:3").await.unwrap();
    let e = initiator.transfer(&[req(Opcode::Read, local.addr(), peer, 0x1000, 16)]).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        e.message().contains("tcp peer `127.0.0.1:3`: peer authentication is on here")
            && e.message().contains("does not offer it (its descriptor has no `ferry_auth`)")
            && e.message().contains("Mooncake engines have no authentication"),
        "{e}"
    );
    let accepted = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
    assert!(accepted.is_err(), "no connection was made to a peer without authentication");

    // On the handshake: a listener without authentication does not answer the hello.
    let plain = p2p_engine(None, T).await;
    let with = p2p_engine(Some(SECRET_A), T).await;
    let e = with.open_segment(plain.segment_name()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("does not offer Ferry authentication"), "{e}");
    let e = with.send_notification(plain.segment_name(), "m").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(plain.get_notifications().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_without_a_secret_is_told_the_target_requires_one() {
    // Handshake: the listener answers that authentication is required.
    let target = p2p_engine(Some(SECRET_A), T).await;
    let plain = p2p_engine(None, T).await;
    let e = plain.open_segment(target.segment_name()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        e.message().contains(
            "the peer requires peer authentication (`hmac-sha256-v1`), and no auth secret is configured here"
        ),
        "{e}"
    );
    let e = plain.send_notification(target.segment_name(), "m").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(target.get_notifications().is_empty());

    // Data path: the descriptor says so; no request is sent.
    let meta = InProcessMetadata::new();
    let owner = store_engine(&meta, "127.0.0.1:5", Some(SECRET_A)).await;
    let other = store_engine(&meta, "127.0.0.1:6", None).await;
    let remote = pattern_buffer(4096, 4);
    let local = Buffer::zeroed(4096);
    unsafe { owner.register_memory(remote.addr(), remote.len(), Location::Cpu(0)).await }.unwrap();
    unsafe { other.register_memory(local.addr(), local.len(), Location::Cpu(0)).await }.unwrap();
    let peer = other.open_segment(owner.segment_name()).await.unwrap();
    let e = other.transfer(&[req(Opcode::Read, local.addr(), peer, remote.addr(), 4096)]).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        e.message().contains("tcp peer `127.0.0.1:5` requires peer authentication (`ferry_auth`: `hmac-sha256-v1`)")
            && e.message().contains("no auth secret is configured here"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_secret_setting_stops_the_engine_from_starting() {
    let mut cfg =
        Config::from_json_str(r#"{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE"}"#, None).unwrap();
    cfg.set_option(&SECRET, "too short");
    let e = ferry::builder().config(cfg).transports(tcp_only()).protocol("tcp").build().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("is 9 bytes; at least 16 are required") && !e.message().contains("too short"), "{e}");
}
