//! The Redis and etcd backends against real servers: the shared contract, engines meeting
//! through them, and the engine's behaviour when the service restarts or goes away (leases that
//! expire, watches that invalidate cached descriptors, transfers from cache during an outage,
//! re-publication afterwards).
//!
//! The contract tests use the servers `scripts/test.sh` starts (`FERRY_TEST_REDIS`,
//! `FERRY_TEST_ETCD`) and start private ones otherwise; restart tests always use private ones.

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::time::{Duration, Instant};

use ferry::{Location, MetadataStore, Opcode, TransferEngine, TransferRequest};
use ferry_metadata_etcd::EtcdMetadata;
use ferry_metadata_redis::RedisMetadata;
use ferry_test_support::servers::Server;
use ferry_test_support::{Buffer, notify_across, pattern_buffer, read_across, tcp_engine_on};

/// The contract (same as tests/metadata_contract.rs, which cannot be shared across test crates
/// without a library of its own).
async fn contract(m: &dyn MetadataStore) {
    let name = m.name().to_owned();
    let key = format!("mooncake/ram/127.0.0.1:{}", std::process::id());
    assert_eq!(m.get(&key).await.unwrap(), None, "{name}: an absent key is None");
    m.put(&key, br#"{"v":1}"#).await.unwrap();
    m.put(&key, br#"{"v":2}"#).await.unwrap();
    assert_eq!(m.get(&key).await.unwrap().as_deref(), Some(&br#"{"v":2}"#[..]), "{name}: re-publish replaces");
    let odd = format!("mooncake/blue/ram/a b&c=d?e#{}", std::process::id());
    m.put(&odd, b"odd").await.unwrap();
    assert_eq!(m.get(&odd).await.unwrap().as_deref(), Some(&b"odd"[..]), "{name}");
    m.delete(&key).await.unwrap();
    m.delete(&key).await.unwrap();
    assert_eq!(m.get(&key).await.unwrap(), None, "{name}: deleted");
    m.delete(&odd).await.unwrap();
}

fn shared_or_private(var: &str, start: fn() -> Server) -> (String, Option<Server>) {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => (url, None),
        _ => {
            let s = start();
            (s.url(), Some(s))
        }
    }
}

#[tokio::test]
async fn redis_backend_keeps_the_contract_and_honours_the_db_index() {
    let (url, _server) = shared_or_private("FERRY_TEST_REDIS", Server::redis);
    let db0 = RedisMetadata::connect(&url, |_| None).await.unwrap();
    contract(&db0).await;
    let db3 = RedisMetadata::connect(&url, |k| (k == "MC_REDIS_DB_INDEX").then(|| "3".to_owned())).await.unwrap();
    db3.put("ferry-db-test", b"3").await.unwrap();
    assert_eq!(db0.get("ferry-db-test").await.unwrap(), None, "MC_REDIS_DB_INDEX selects another database");
    db3.delete("ferry-db-test").await.unwrap();
    let e = RedisMetadata::connect(&url, |k| (k == "MC_REDIS_PASSWORD").then(|| "wrong".to_owned())).await.unwrap_err();
    assert!(e.message().contains(&url), "a bad password is reported with the endpoint: {e}");
    let e = RedisMetadata::connect("redis://127.0.0.1:1", |_| None).await.unwrap_err();
    assert_eq!(e.kind(), ferry::ErrorKind::PeerUnreachable, "{e}");
}

#[tokio::test]
async fn etcd_backend_keeps_the_contract() {
    let (url, _server) = shared_or_private("FERRY_TEST_ETCD", Server::etcd);
    let eps = vec![url.trim_start_matches("etcd://").to_owned()];
    contract(&EtcdMetadata::connect(&eps).await.unwrap()).await;
    let e = EtcdMetadata::connect(&["127.0.0.1:1".to_owned()]).await.unwrap_err();
    assert!(e.message().contains("127.0.0.1:1"), "{e}");
}

async fn engine(metadata: &str, name: &str) -> TransferEngine {
    tcp_engine_on(metadata, name).await
}

async fn read_all(from: &TransferEngine, peer: ferry::SegmentHandle, src: &Buffer, dst: &Buffer) -> ferry::Result<()> {
    from.transfer(&[TransferRequest {
        opcode: Opcode::Read,
        source: dst.addr(),
        target: peer,
        target_offset: src.addr(),
        length: src.len(),
    }])
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_meet_through_redis_and_etcd() {
    let (redis, _r) = shared_or_private("FERRY_TEST_REDIS", Server::redis);
    let (etcd, _e) = shared_or_private("FERRY_TEST_ETCD", Server::etcd);
    for (i, url) in [redis, etcd].into_iter().enumerate() {
        let a = engine(&url, &format!("127.0.0.1:{}", 41000 + i * 10)).await;
        let b = engine(&url, &format!("127.0.0.1:{}", 41001 + i * 10)).await;
        read_across(&a, &b).await;
        notify_across(&a, &b, &format!("a to b over {url}")).await;
        notify_across(&b, &a, &format!("b to a over {url}")).await;
        b.shutdown().await.unwrap();
        a.shutdown().await.unwrap();
    }
}

async fn eventually(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "{what} did not happen within {limit:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_lease_removes_a_dead_engine_and_a_watch_invalidates_cached_descriptors() {
    let server = Server::etcd();
    let url = server.url();
    let eps = vec![url.trim_start_matches("etcd://").to_owned()];
    let observer = EtcdMetadata::connect(&eps).await.unwrap();

    let a = engine(&url, "127.0.0.1:42001").await;
    let b = engine(&url, "127.0.0.1:42002").await;
    let src = pattern_buffer(4096, 1);
    unsafe { a.register_memory(src.addr(), src.len(), Location::Cpu(0)).await }.unwrap();
    let peer = b.open_segment("127.0.0.1:42001").await.unwrap();
    assert!(!b.segment(peer).unwrap().is_stale());
    // A re-publishes (more memory): B's watch marks its cached descriptor stale.
    let more = pattern_buffer(4096, 2);
    unsafe { a.register_memory(more.addr(), more.len(), Location::Cpu(0)).await }.unwrap();
    eventually("watch invalidation", Duration::from_secs(5), async || b.segment(peer).unwrap().is_stale()).await;

    // A dies without a clean shutdown: its lease expires and its descriptor disappears.
    drop(a);
    let key = "mooncake/ram/127.0.0.1:42001";
    eventually("lease expiry", Duration::from_secs(ferry_metadata_etcd::LEASE_TTL_SECS as u64 + 10), async || {
        observer.get(key).await.unwrap().is_none()
    })
    .await;
    assert!(observer.get("mooncake/ram/127.0.0.1:42002").await.unwrap().is_some(), "the live engine stays");
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_continue_from_cache_while_etcd_is_down_and_publication_resumes() {
    let mut server = Server::etcd();
    let url = server.url();
    let a = engine(&url, "127.0.0.1:43001").await;
    let b = engine(&url, "127.0.0.1:43002").await;
    let src = pattern_buffer(1 << 16, 4);
    let dst = Buffer::zeroed(1 << 16);
    unsafe { a.register_memory(src.addr(), src.len(), Location::Cpu(0)).await }.unwrap();
    unsafe { b.register_memory(dst.addr(), dst.len(), Location::Cpu(0)).await }.unwrap();
    let peer = b.open_segment("127.0.0.1:43001").await.unwrap();
    // Make the cached entry stale, so the next use wants to refetch it.
    b.segment(peer).unwrap().mark_stale();

    server.stop();
    read_all(&b, peer, &src, &dst).await.expect("served from the cached descriptor while etcd is down");
    assert_eq!(dst.bytes(), src.bytes());

    server.start();
    let eps = vec![url.trim_start_matches("etcd://").to_owned()];
    let observer = EtcdMetadata::connect(&eps).await.unwrap();
    // The data survived the restart, but the leases of both engines may have expired while it
    // was down; either way both descriptors are published again.
    for key in ["mooncake/ram/127.0.0.1:43001", "mooncake/ram/127.0.0.1:43002"] {
        eventually("re-publication", Duration::from_secs(30), async || {
            observer.get(key).await.is_ok_and(|v| v.is_some())
        })
        .await;
    }
    b.refresh_segment(peer).await.unwrap();
    read_all(&b, peer, &src, &dst).await.unwrap();
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_publish_again_after_a_metadata_server_restart_that_lost_everything() {
    let mut server = Server::redis(); // started without persistence: a restart loses every key
    let url = server.url();
    let a = engine(&url, "127.0.0.1:44001").await;
    let observer = RedisMetadata::connect(&url, |_| None).await.unwrap();
    assert!(observer.get("mooncake/ram/127.0.0.1:44001").await.unwrap().is_some());
    server.stop();
    server.start();
    assert!(
        RedisMetadata::connect(&url, |_| None)
            .await
            .unwrap()
            .get("mooncake/ram/127.0.0.1:44001")
            .await
            .unwrap()
            .is_none()
    );
    eventually("re-publication", Duration::from_secs(20), async || {
        match RedisMetadata::connect(&url, |_| None).await {
            Ok(m) => {
                m.get("mooncake/ram/127.0.0.1:44001").await.is_ok_and(|v| v.is_some())
                    && m.get("mooncake/rpc_meta/127.0.0.1:44001").await.is_ok_and(|v| v.is_some())
            }
            Err(_) => false,
        }
    })
    .await;
    a.shutdown().await.unwrap();
}
