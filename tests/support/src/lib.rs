//! Helpers shared by Ferry's integration tests: the facade's own (`tests/` at the workspace
//! root) and each transport's (`transports/*/tests/`, `ffi/plugin/host/tests/`).
//!
//! - [`Buffer`]: heap memory a test registers with an engine, with [`pattern`] and
//!   [`pattern_buffer`] for contents a peer can check byte for byte.
//! - Engines: [`builder`], [`pair`] and [`connected`] on a private in-process metadata store;
//!   [`tcp_only`], [`p2p_tcp_engine`] and [`tcp_engine_on`] for engines whose bytes cross sockets.
//! - Checks between two engines: [`read_across`], [`notify_across`], [`await_notification`].
//! - [`servers`]: real etcd and Redis processes on free loopback ports.
//! - [`workspace_root`] and [`free_port`].
//!
//! The crate is not published. It depends on the `ferry` facade with the `local`, `null`, `tcp`
//! and `p2p` features; its `etcd` feature turns on the facade's `etcd` too.

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub mod servers;

use ferry::{EngineBuilder, InProcessMetadata, MetadataStore, TransferEngine};

/// The workspace's root directory (where `Cargo.lock`, `.venv-mooncake` and `ffi/` are), for
/// tests that read files of another crate or the repository.
pub fn workspace_root() -> PathBuf {
    // This crate is `tests/support` under the root.
    let root =
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().and_then(Path::parent).expect("tests/support has two parents");
    root.to_path_buf()
}

/// A loopback port nothing listens on (free when this returns; good enough for tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A heap buffer whose address is registered with an engine. Kept alive for the test.
pub struct Buffer {
    data: Vec<u8>,
    addr: u64,
}

impl Buffer {
    /// `len` bytes of a pattern derived from `seed` (byte `i` is `i * 31 + seed`, wrapping).
    pub fn filled(len: usize, seed: u8) -> Self {
        Self::from(
            std::iter::repeat_n(0u8, len)
                .enumerate()
                .map(|(i, _)| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect(),
        )
    }
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        Self::from(vec![0; len])
    }
    fn from(mut data: Vec<u8>) -> Self {
        // The address comes from a mutable pointer: engines write through it.
        let addr = data.as_mut_ptr() as u64;
        Self { data, addr }
    }
    /// The address to register and to name in transfer requests.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// The length in bytes.
    pub fn len(&self) -> u64 {
        self.data.len() as u64
    }
    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    /// Overwrites the contents with [`pattern`] of `seed`, through the registered address (no
    /// transfer may be touching the buffer meanwhile).
    pub fn fill_pattern(&self, seed: u64) {
        let p = self.addr as *mut u8;
        for k in 0..self.len() {
            // SAFETY: `k` is inside the buffer, which lives as long as `self`; the address came
            // from a mutable pointer, and the caller guarantees no transfer touches it now.
            unsafe { p.add(k as usize).write(pattern(k, seed)) };
        }
    }
    /// Reads the current contents (the engine writes through raw pointers).
    pub fn bytes(&self) -> &[u8] {
        // Keep the compiler from assuming nothing changed since the last read.
        std::hint::black_box(&self.data)
    }
}

/// Builder with every transport and a private metadata store (tests do not share state).
pub fn builder(meta: &Arc<InProcessMetadata>) -> EngineBuilder {
    ferry::builder().transports(all_transports()).metadata(meta.clone() as Arc<dyn MetadataStore>)
}

/// Every transport of the facade's build, with `local` and `null` always among them.
pub fn all_transports() -> ferry::TransportRegistry {
    ferry::default_transports()
        .with(Arc::new(ferry::transports::local::LocalTransportFactory))
        .with(Arc::new(ferry::transports::null::NullTransportFactory))
}

/// Two engines on `meta` from [`builder`], segments `prefill` and `decode`.
pub async fn pair(meta: &Arc<InProcessMetadata>) -> (TransferEngine, TransferEngine) {
    let a = builder(meta).segment_name("prefill").build().await.unwrap();
    let b = builder(meta).segment_name("decode").build().await.unwrap();
    (a, b)
}

/// Two engines with one buffer each (prefill's filled, decode's zeroed) and decode's handle on
/// prefill's segment.
pub struct Connected {
    /// The engine of segment `prefill`, owner of `src`.
    pub prefill: TransferEngine,
    /// The engine of segment `decode`, owner of `dst`.
    pub decode: TransferEngine,
    /// Prefill's buffer, [`Buffer::filled`] with seed 3.
    pub src: Buffer,
    /// Decode's buffer, zeroed, registered as `Cpu(0)`.
    pub dst: Buffer,
    /// Decode's handle on prefill's segment.
    pub peer: ferry::SegmentHandle,
}

/// [`Connected`] engines on `meta`, with buffers of `len` bytes; prefill's is registered at
/// `src_location`.
pub async fn connected(meta: &Arc<InProcessMetadata>, len: usize, src_location: ferry::Location) -> Connected {
    let (prefill, decode) = pair(meta).await;
    let src = Buffer::filled(len, 3);
    let dst = Buffer::zeroed(len);
    // SAFETY: `Connected` owns both buffers together with the engines.
    unsafe { prefill.register_memory(src.addr(), src.len(), src_location).await }.unwrap();
    // SAFETY: as above.
    unsafe { decode.register_memory(dst.addr(), dst.len(), ferry::Location::Cpu(0)).await }.unwrap();
    let peer = decode.open_segment(prefill.segment_name()).await.unwrap();
    Connected { prefill, decode, src, dst, peer }
}

/// A registry with only the TCP transport (no same-process shortcut), so bytes cross sockets.
pub fn tcp_only() -> ferry::TransportRegistry {
    ferry::TransportRegistry::new().with(Arc::new(ferry::transports::tcp::TcpTransportFactory))
}

/// The descriptor of a TCP peer a test plays by hand (a raw-socket target on 127.0.0.1:`port`):
/// Mooncake's TCP v2 endpoint, the Ferry fence advert `fence` (`None`: a Mooncake peer), and
/// one registered buffer `addr`..`addr + len` on `cpu:0`.
pub fn fake_tcp_peer(name: &str, port: u16, addr: u64, len: u64, fence: Option<u32>) -> ferry::SegmentDescriptor {
    let mut d = ferry::SegmentDescriptor::new(name, "tcp");
    ferry::transports::tcp::TcpEndpoint {
        host: Some("127.0.0.1".into()),
        port,
        proto_version: Some(2),
        fence,
        auth: None,
    }
    .write_to(&mut d)
    .expect("a v2 endpoint writes into a fresh descriptor");
    d.buffers.push(ferry::BufferDesc {
        addr,
        length: len,
        name: "cpu:0".into(),
        device_id: None,
        extra: Default::default(),
    });
    d
}

/// A TCP-only engine on in-process metadata that already holds `descriptors` (peers a test
/// described by hand: fake targets, silent or closed ports), with transfer timeout `timeout`.
pub async fn tcp_engine_knowing(
    descriptors: &[&ferry::SegmentDescriptor],
    timeout: std::time::Duration,
) -> TransferEngine {
    let meta = InProcessMetadata::new();
    for d in descriptors {
        MetadataStore::put(&*meta, &format!("mooncake/ram/{}", d.name), &d.to_json()).await.unwrap();
    }
    ferry::builder()
        .transports(tcp_only())
        .protocol("tcp")
        .metadata(meta as Arc<dyn MetadataStore>)
        .transfer_timeout(timeout)
        .build()
        .await
        .unwrap()
}

/// An engine on P2P handshake metadata and the TCP transport only.
pub async fn p2p_tcp_engine(timeout: std::time::Duration) -> TransferEngine {
    let cfg = ferry::Config::from_json_str(
        r#"{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}"#,
        None,
    )
    .unwrap();
    ferry::builder().config(cfg).transports(tcp_only()).transfer_timeout(timeout).build().await.unwrap()
}

/// Byte `k` of a test pattern with `seed` (the interop scripts compute the same).
pub fn pattern(k: u64, seed: u64) -> u8 {
    ((k + seed) % 251) as u8
}

/// A buffer holding `pattern` from offset 0.
pub fn pattern_buffer(len: usize, seed: u64) -> Buffer {
    let mut b = Buffer::zeroed(len);
    for (k, byte) in b.data.iter_mut().enumerate() {
        *byte = pattern(k as u64, seed);
    }
    b
}

/// An engine named `name` on the metadata service `url`, TCP only, with every metadata store of
/// the facade's build (etcd with this crate's `etcd` feature) and the facade's control channel
/// beside it.
pub async fn tcp_engine_on(url: &str, name: &str) -> TransferEngine {
    let cfg = ferry::Config::from_json_str(
        &format!(r#"{{"local_hostname": "{name}", "metadata_server": "{url}", "protocol": "tcp", "transfer_timeout_ms": 5000}}"#),
        None,
    )
    .unwrap();
    ferry::builder().config(cfg).transports(tcp_only()).build().await.unwrap()
}

/// `b` finds `a` through their metadata service and reads 1 MiB of it, checked byte for byte.
pub async fn read_across(a: &TransferEngine, b: &TransferEngine) {
    let src = pattern_buffer(1 << 20, 7);
    let dst = Buffer::zeroed(1 << 20);
    // SAFETY: both buffers outlive their registrations, which end below.
    unsafe { a.register_memory(src.addr(), src.len(), ferry::Location::Cpu(0)).await }.unwrap();
    // SAFETY: as above.
    unsafe { b.register_memory(dst.addr(), dst.len(), ferry::Location::Cpu(0)).await }.unwrap();
    let peer = b.open_segment(a.segment_name()).await.unwrap();
    b.transfer(&[ferry::TransferRequest {
        opcode: ferry::Opcode::Read,
        source: dst.addr(),
        target: peer,
        target_offset: src.addr(),
        length: src.len(),
    }])
    .await
    .unwrap();
    assert_eq!(dst.bytes(), src.bytes());
    b.unregister_memory(dst.addr()).await.unwrap();
    a.unregister_memory(src.addr()).await.unwrap();
}

/// `a` notifies `b` by segment name (over `b`'s handshake listener, found through `b`'s rpc
/// entry) and `b` receives it, naming `a` as the sender.
pub async fn notify_across(a: &TransferEngine, b: &TransferEngine, message: &str) {
    a.send_notification(b.segment_name(), message)
        .await
        .unwrap_or_else(|e| panic!("{} -> {}: {e}", a.segment_name(), b.segment_name()));
    let n = await_notification(b, message).await;
    assert_eq!(n.name, a.segment_name(), "the sender is named");
}

/// The notification carrying `message` that `e` receives within 10 s (others are drained too).
pub async fn await_notification(e: &TransferEngine, message: &str) -> ferry::Notification {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let got = e.get_notifications();
        if let Some(n) = got.iter().find(|n| n.notify_msg == message) {
            return n.clone();
        }
        assert!(std::time::Instant::now() < deadline, "{} never received {message:?} (got {got:?})", e.segment_name());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
