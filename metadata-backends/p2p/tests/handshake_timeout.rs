//! The handshake's timeout: never longer than the transfer timeout, and set by its option.

use std::time::{Duration, Instant};

use ferry_core::{Config, ErrorKind, MetadataStore};
use ferry_metadata_p2p::P2pMetadata;

/// A peer that accepts connections and never answers; its `host:port`.
async fn silent_peer() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    (addr, task)
}

/// How long looking up the silent peer's descriptor takes to fail, under `config`.
async fn lookup_fails_after(config: &str) -> Duration {
    let (peer, task) = silent_peer().await;
    let cfg = Config::from_json_str(config, None).unwrap();
    let store = P2pMetadata::start(&cfg).await.unwrap();
    let started = Instant::now();
    let e = store.get(&format!("mooncake/ram/{peer}")).await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    task.abort();
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shorter_transfer_timeout_bounds_the_handshake() {
    let took = lookup_fails_after(
        r#"{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "transfer_timeout_ms": 300}"#,
    )
    .await;
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(3), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handshake_timeout_is_an_option() {
    let took = lookup_fails_after(
        r#"{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "handshake_timeout_ms": 400}"#,
    )
    .await;
    assert!(took >= Duration::from_millis(350) && took < Duration::from_secs(3), "took {took:?}");
}
