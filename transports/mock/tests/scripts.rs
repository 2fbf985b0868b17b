//! The mock transport's rules against a real engine: every kind of scripted outcome, the
//! record, peers' memory, and a small KV connector unit-tested with it (the example of
//! `docs/testing.md`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::{
    Batch, ErrorKind, InProcessMetadata, Location, MetadataStore, Opcode, SegmentHandle, TransferEngine,
    TransferRequest,
};
use ferry_transport_mock::{MockScript, Submitted, When};

const BLOCK: u64 = 64;

/// An engine whose only transport follows `script`, with peer `prefill` (8 blocks, block b
/// filled with b) published.
async fn setup(script: &MockScript) -> anyhow::Result<(TransferEngine, SegmentHandle, Vec<u8>)> {
    setup_with(script, InProcessMetadata::new()).await
}

async fn setup_with(
    script: &MockScript,
    meta: Arc<InProcessMetadata>,
) -> anyhow::Result<(TransferEngine, SegmentHandle, Vec<u8>)> {
    let remote: Vec<u8> = (0..8 * BLOCK).map(|i| (i / BLOCK) as u8).collect();
    let d = script.peer("prefill", 0x40_000, remote);
    meta.put("mooncake/ram/prefill", &d.to_json()).await?;
    let engine = TransferEngine::builder()
        .transports(ferry_core::TransportRegistry::new().with(Arc::new(script.factory())))
        .protocol("mock")
        .metadata(meta as Arc<dyn MetadataStore>)
        .transfer_timeout(Duration::from_secs(5))
        .build()
        .await?;
    let cache = vec![0xEEu8; 8 * BLOCK as usize];
    // SAFETY: `cache` is returned to the test, which keeps it until the engine shut down.
    unsafe { engine.register_memory(cache.as_ptr() as u64, cache.len() as u64, Location::Cpu(0)).await? };
    let peer = engine.open_segment("prefill").await?;
    Ok((engine, peer, cache))
}

fn read(cache: &[u8], target: SegmentHandle, local_block: u64, remote_block: u64) -> TransferRequest {
    TransferRequest {
        opcode: Opcode::Read,
        source: cache.as_ptr() as u64 + local_block * BLOCK,
        target,
        target_offset: 0x40_000 + remote_block * BLOCK,
        length: BLOCK,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unscripted_requests_move_their_bytes_and_are_recorded() -> anyhow::Result<()> {
    let script = MockScript::new();
    let (engine, peer, cache) = setup(&script).await?;
    engine.transfer(&[read(&cache, peer, 0, 5), read(&cache, peer, 1, 2)]).await?;
    let write = TransferRequest { opcode: Opcode::Write, ..read(&cache, peer, 1, 7) };
    engine.transfer(&[write]).await?;
    engine.shutdown().await?;
    assert_eq!(&cache[..64], &[5u8; 64][..]);
    assert_eq!(&cache[64..128], &[2u8; 64][..]);
    assert_eq!(&cache[128..], &vec![0xEE; 6 * 64][..], "nothing else touched");
    let remote = script.peer_bytes("prefill").unwrap();
    assert_eq!(&remote[7 * 64..], &[2u8; 64][..], "the write landed in the peer's memory");
    let s = script.submitted();
    assert_eq!(s.len(), 3);
    assert_eq!(
        s[2],
        Submitted {
            seq: 2,
            segment: "prefill".into(),
            opcode: Opcode::Write,
            local: cache.as_ptr() as u64 + 64,
            remote: 0x40_000 + 7 * 64,
            len: 64
        }
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nth_request_fails_after_a_delay_and_the_rest_succeed() -> anyhow::Result<()> {
    let script = MockScript::new();
    script.when(When::Nth(1)).after(Duration::from_millis(50)).fail(ErrorKind::PeerUnreachable);
    let (engine, peer, cache) = setup(&script).await?;
    let t = Instant::now();
    let batch = engine.submit(&[read(&cache, peer, 0, 0), read(&cache, peer, 1, 1), read(&cache, peer, 2, 2)]).await?;
    let status = batch.wait(Duration::from_secs(5)).await?;
    assert!(t.elapsed() >= Duration::from_millis(50), "the failure waited for its delay");
    assert_eq!((status.completed, status.failed), (2, 1));
    assert_eq!(batch.error(1).unwrap().kind(), ErrorKind::PeerUnreachable);
    assert!(engine.segment(peer)?.is_stale(), "an unreachable peer's descriptor is refreshed next time");
    engine.shutdown().await?;
    assert_eq!(&cache[64..128], &[0xEE; 64][..], "the failed request moved nothing");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_request_holds_its_memory_until_cancelled() -> anyhow::Result<()> {
    let script = MockScript::new();
    script.when(When::Any).times(1).stall();
    let (engine, peer, cache) = setup(&script).await?;
    let batch: Batch = engine.submit(&[read(&cache, peer, 0, 3)]).await?;
    assert_eq!(batch.wait(Duration::from_millis(50)).await.unwrap_err().kind(), ErrorKind::Timeout);
    assert_eq!(engine.memory().leases(), 1, "in flight: the memory is leased");
    batch.cancel();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !batch.all_released() {
        assert!(Instant::now() < deadline, "never released after the cancel");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(batch.request_status(0), Some(ferry_core::RequestStatus::Cancelled));
    // The rule was used up: the next request goes through.
    engine.transfer(&[read(&cache, peer, 0, 3)]).await?;
    engine.shutdown().await?;
    assert_eq!(&cache[..64], &[3u8; 64][..]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_success_moves_the_first_bytes_then_fails() -> anyhow::Result<()> {
    let script = MockScript::new();
    script
        .when(When::Remote { segment: "prefill".into(), range: 0x40_000 + 4 * BLOCK..0x40_000 + 5 * BLOCK })
        .partial(16, ErrorKind::Transport);
    script.when(When::Op(Opcode::Write)).fail(ErrorKind::Unsupported);
    let (engine, peer, cache) = setup(&script).await?;
    let e = engine.transfer(&[read(&cache, peer, 0, 4)]).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert!(e.to_string().contains("after 16 byte(s)"), "{e}");
    let write = TransferRequest { opcode: Opcode::Write, ..read(&cache, peer, 1, 1) };
    assert_eq!(engine.transfer(&[write]).await.unwrap_err().kind(), ErrorKind::Unsupported);
    engine.shutdown().await?;
    assert_eq!(&cache[..16], &[4u8; 16][..], "the first 16 bytes moved");
    assert_eq!(&cache[16..64], &[0xEE; 48][..], "the rest did not");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_the_script_does_not_know_is_unreachable() -> anyhow::Result<()> {
    let script = MockScript::new();
    let meta = InProcessMetadata::new();
    // Published, but its memory belongs to another script.
    let ghost = MockScript::new().peer("ghost", 0x1000, vec![0; 64]);
    meta.put("mooncake/ram/ghost", &ghost.to_json()).await?;
    let (engine, _peer, cache) = setup_with(&script, meta).await?;
    let ghost = engine.open_segment("ghost").await?;
    let req = TransferRequest { target_offset: 0x1000, ..read(&cache, ghost, 0, 0) };
    let e = engine.transfer(&[req]).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
    assert!(e.to_string().contains("no mock peer named `ghost`"), "{e}");
    engine.shutdown().await?;
    Ok(())
}

/// A small KV connector as user code would write one: it pulls the prefill blocks a request
/// needs into free local blocks and reports which ones must be recomputed.
mod connector {
    use std::time::Duration;

    use ferry_core::{Opcode, SegmentHandle, TransferEngine, TransferRequest};

    /// Pulls remote blocks `remote[i]` into local blocks `local[i]`; returns the local blocks
    /// that did not arrive (to be recomputed).
    pub(crate) async fn pull_blocks(
        engine: &TransferEngine,
        peer: SegmentHandle,
        local_base: u64,
        remote_base: u64,
        block: u64,
        local: &[u64],
        remote: &[u64],
    ) -> ferry_core::Result<Vec<u64>> {
        let reqs: Vec<TransferRequest> = local
            .iter()
            .zip(remote)
            .map(|(&l, &r)| TransferRequest {
                opcode: Opcode::Read,
                source: local_base + l * block,
                target: peer,
                target_offset: remote_base + r * block,
                length: block,
            })
            .collect();
        let batch = engine.submit(&reqs).await?;
        batch.wait(Duration::from_secs(5)).await?;
        Ok(local.iter().enumerate().filter(|(i, _)| batch.error(*i).is_some()).map(|(_, &l)| l).collect())
    }
}

/// The connector's unit test: no network, no device; one block fails, and the connector reports
/// exactly that block for recomputation while the others hold the right data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_connector_reports_the_blocks_that_failed() -> anyhow::Result<()> {
    let script = MockScript::new();
    script
        .when(When::Remote { segment: "prefill".into(), range: 0x40_000 + 6 * BLOCK..0x40_000 + 7 * BLOCK })
        .fail(ErrorKind::Timeout);
    let (engine, peer, cache) = setup(&script).await?;
    let base = cache.as_ptr() as u64;
    let missing = connector::pull_blocks(&engine, peer, base, 0x40_000, BLOCK, &[0, 1, 2], &[5, 6, 7]).await?;
    assert_eq!(missing, vec![1], "local block 1 (remote block 6) must be recomputed");
    let asked: Vec<u64> = script.submitted().iter().map(|s| (s.remote - 0x40_000) / BLOCK).collect();
    assert_eq!(asked, vec![5, 6, 7], "the connector asked for the right blocks, in order");
    engine.shutdown().await?;
    assert_eq!(&cache[..64], &[5u8; 64][..]);
    assert_eq!(&cache[128..192], &[7u8; 64][..]);
    Ok(())
}
