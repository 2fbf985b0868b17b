//! A target engine that is shutting down, as its initiators see it: its TCP target closes the
//! connection of a request that arrives once its memory registry is closed (Mooncake's status
//! frame has no code for "shutting down", and "rejected" means "outside registered memory"),
//! and the initiator reports the peer as unreachable, saying it is shutting down.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{
    Capabilities, Config, EngineBuilder, ErrorKind, InProcessMetadata, Location, MetadataStore, Opcode, OpenSegment,
    Result, SegmentDescriptor, Submission, TransferEngine, TransferRequest, Transport, TransportContext,
    TransportFactory, TransportRegistry,
};
use ferry_transport_tcp::TcpTransportFactory;
use tokio::sync::Semaphore;

/// A companion transport that serves nothing and whose shutdown waits for `release`: it holds
/// its engine's shutdown between closing the memory registry and stopping the TCP transport
/// (transports stop in order, companions first), as a slower transport would.
struct Stall {
    entered: Arc<Semaphore>,
    release: Arc<Semaphore>,
}

#[async_trait]
impl Transport for Stall {
    fn protocol(&self) -> &str {
        "stall"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
    fn serves(&self, _: &SegmentDescriptor) -> bool {
        false
    }
    fn submit(&self, _: &Arc<OpenSegment>, submission: Submission) {
        submission.fail_all(&ferry_core::Error::invalid("stall moves nothing"));
    }
    async fn shutdown(&self) {
        self.entered.add_permits(1);
        let _ = self.release.acquire().await;
    }
}

struct StallFactory {
    entered: Arc<Semaphore>,
    release: Arc<Semaphore>,
}

#[async_trait]
impl TransportFactory for StallFactory {
    fn protocol(&self) -> &'static str {
        "stall"
    }
    fn companion(&self) -> bool {
        true
    }
    async fn create(&self, _: &TransportContext) -> Result<Arc<dyn Transport>> {
        Ok(Arc::new(Stall { entered: self.entered.clone(), release: self.release.clone() }))
    }
}

async fn engine(name: &str, meta: &Arc<InProcessMetadata>, transports: TransportRegistry) -> TransferEngine {
    let text = format!(r#"{{"local_hostname": "{name}", "protocol": "tcp", "transfer_timeout_ms": 5000}}"#);
    EngineBuilder::new()
        .config(Config::from_json_str(&text, None).unwrap())
        .metadata(meta.clone() as Arc<dyn MetadataStore>)
        .transports(transports)
        .build()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_shutting_down_is_reported_as_such_not_as_out_of_bounds() {
    let meta = InProcessMetadata::new();
    let (entered, release) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let stall = StallFactory { entered: entered.clone(), release: release.clone() };
    let target = engine(
        "127.0.0.1:1",
        &meta,
        TransportRegistry::new().with(Arc::new(TcpTransportFactory)).with(Arc::new(stall)),
    )
    .await;
    let initiator = engine("127.0.0.1:2", &meta, TransportRegistry::new().with(Arc::new(TcpTransportFactory))).await;
    // Both outlive the engines (shut down below).
    let remote = vec![7u8; 4096];
    let local = vec![0u8; 4096];
    let (remote_addr, local_addr) = (remote.as_ptr() as u64, local.as_ptr() as u64);
    // SAFETY: `remote` stays allocated until after `target` shut down, and is only read.
    unsafe { target.register_memory(remote_addr, 4096, Location::Cpu(0)).await }.unwrap();
    // SAFETY: `local` stays allocated until after `initiator` shut down, and is read only after
    // the transfers completed.
    unsafe { initiator.register_memory(local_addr, 4096, Location::Cpu(0)).await }.unwrap();
    let peer = initiator.open_segment(target.segment_name()).await.unwrap();
    let read = TransferRequest {
        opcode: Opcode::Read,
        source: local_addr,
        target: peer,
        target_offset: remote_addr,
        length: 64,
    };
    initiator.transfer(&[read]).await.unwrap();
    assert_eq!(local[..64], [7u8; 64]);

    let stopping = tokio::spawn({
        let target = target.clone();
        async move { target.shutdown().await }
    });
    // The target's memory registry is closed; its TCP target still serves connections.
    tokio::time::timeout(Duration::from_secs(5), entered.acquire()).await.unwrap().unwrap().forget();
    for opcode in [Opcode::Read, Opcode::Write] {
        let e = initiator.transfer(&[TransferRequest { opcode, ..read }]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{opcode:?}: {e}");
        assert!(e.message().contains("shutting down"), "{opcode:?}: {e}");
    }
    release.add_permits(1);
    stopping.await.unwrap().unwrap();
    initiator.shutdown().await.unwrap();
    drop((remote, local));
}
