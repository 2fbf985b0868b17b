//! One contract, every metadata backend: the same tests run against the in-process store and
//! against `ferry metadata-server` over real HTTP on loopback; engines find each other and move
//! data through each, notifying each other over the control channel beside the store (a third
//! party's store, which has no channel code, included); the HTTP server's answers to bad
//! requests.

// Test buffers are `ferry_test_support::Buffer`s that outlive the engines they are registered with.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::sync::Arc;

use ferry::{ErrorKind, InProcessMetadata, MetadataStore};
use ferry_metadata_http::HttpMetadata;
use ferry_metadata_http::server::{Limits, serve};
use ferry_metadata_http::store::Store;
use ferry_test_support::{free_port, notify_across, read_across, tcp_engine_on, tcp_only};

/// A `ferry metadata-server` on a loopback port; stops when the returned sender drops.
async fn http_server(store: Store, limits: Limits) -> (String, tokio::sync::oneshot::Sender<()>) {
    let (addr, stop, _task) = stoppable(store, limits).await;
    (format!("http://{addr}/metadata"), stop)
}

/// A server on a loopback port with `limits`: its address, its stop sender and its task.
async fn stoppable(
    store: Store,
    limits: Limits,
) -> (String, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<std::io::Result<()>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, Arc::new(store), limits, async move {
        let _ = stopped.await;
    }));
    (addr, stop, server)
}

/// The contract every backend keeps.
async fn contract(m: &dyn MetadataStore) {
    let name = m.name().to_owned();
    let key = "mooncake/ram/127.0.0.1:17000";
    assert_eq!(m.get(key).await.unwrap(), None, "{name}: an absent key is None");
    m.put(key, br#"{"v":1}"#).await.unwrap();
    assert_eq!(m.get(key).await.unwrap().as_deref(), Some(&br#"{"v":1}"#[..]), "{name}");
    m.put(key, br#"{"v":2}"#).await.unwrap();
    assert_eq!(m.get(key).await.unwrap().as_deref(), Some(&br#"{"v":2}"#[..]), "{name}: re-publish replaces");
    let rpc = "mooncake/rpc_meta/127.0.0.1:17000";
    m.put(rpc, br#"{"ip_or_host_name":"127.0.0.1","rpc_port":17000}"#).await.unwrap();
    m.put(rpc, br#"{"ip_or_host_name":"127.0.0.1","rpc_port":17000}"#).await.unwrap();
    // Keys that need escaping survive the trip.
    let odd = "mooncake/blue/ram/a b&c=d?e#f%20";
    m.put(odd, b"odd").await.unwrap();
    assert_eq!(m.get(odd).await.unwrap().as_deref(), Some(&b"odd"[..]), "{name}: escaped key");
    m.delete(key).await.unwrap();
    assert_eq!(m.get(key).await.unwrap(), None, "{name}: deleted");
    m.delete(key).await.unwrap();
    assert_eq!(m.get(odd).await.unwrap().as_deref(), Some(&b"odd"[..]), "{name}: other keys untouched");
}

#[tokio::test]
async fn in_process_backend_keeps_the_contract() {
    contract(&*InProcessMetadata::new()).await;
}

#[tokio::test]
async fn http_backend_keeps_the_contract() {
    let (url, _stop) = http_server(Store::in_memory(), Limits::default()).await;
    contract(&HttpMetadata::new(&url).unwrap()).await;
}

/// Two engines on `url` find each other and move data.
async fn engines_meet(url: &str) {
    let a = tcp_engine_on(url, "127.0.0.1:40001").await;
    let b = tcp_engine_on(url, "127.0.0.1:40002").await;
    assert_eq!(a.metadata_backend(), "http");
    read_across(&a, &b).await;
    notify_across(&a, &b, "a to b").await;
    notify_across(&b, &a, "b to a").await;
    a.shutdown().await.unwrap();
    let m = HttpMetadata::new(url).unwrap();
    assert_eq!(m.get("mooncake/ram/127.0.0.1:40001").await.unwrap(), None, "a clean shutdown unpublishes");
    assert!(m.get("mooncake/ram/127.0.0.1:40002").await.unwrap().is_some());
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_find_each_other_through_ferry_metadata_server() {
    let (url, _stop) = http_server(Store::in_memory(), Limits::default()).await;
    engines_meet(&url).await;
}

/// The `rpc_meta` entry of `name` on the HTTP metadata server at `url`.
async fn rpc_entry(url: &str, name: &str) -> serde_json::Value {
    let m = HttpMetadata::new(url).unwrap();
    serde_json::from_slice(&m.get(&format!("mooncake/rpc_meta/{name}")).await.unwrap().unwrap()).unwrap()
}

/// An engine named `name` on `url` whose handshake listener must use `rpc_port`.
async fn engine_with_rpc_port(url: &str, name: &str, rpc_port: u16) -> ferry::Result<ferry::TransferEngine> {
    let cfg = ferry::Config::from_json_str(
        &format!(
            r#"{{"local_hostname": "{name}", "metadata_server": "{url}", "protocol": "tcp", "rpc_port": {rpc_port}}}"#
        ),
        None,
    )
    .unwrap();
    ferry::builder().config(cfg).build().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rpc_entry_names_the_handshake_listener_which_is_freed_at_shutdown() {
    let (url, _stop) = http_server(Store::in_memory(), Limits::default()).await;
    // Without `rpc_port` the listener takes a free port in 15000..17000, whether the name has a
    // port or not (as a Mooncake engine on a store does), and the rpc entry says which.
    for name in ["127.0.0.1", "127.0.0.1:40011"] {
        let a = tcp_engine_on(&url, name).await;
        let rpc = rpc_entry(&url, name).await;
        let port = rpc["rpc_port"].as_u64().unwrap() as u16;
        assert!((15000..17000).contains(&port) && rpc["ip_or_host_name"] == "127.0.0.1", "{name}: {rpc}");
        assert_eq!(a.rpc_port(), Some(port), "what get_rpc_port reports");
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(), "someone listens on {port}");
        a.shutdown().await.unwrap();
    }
    // With `rpc_port`, that port. Once shut down it is free at once: an engine of the same name
    // starts again in the same process.
    let port = free_port();
    let name = "127.0.0.1:40012";
    let b = engine_with_rpc_port(&url, name, port).await.unwrap();
    assert_eq!(rpc_entry(&url, name).await["rpc_port"], port);
    b.shutdown().await.unwrap();
    let again = engine_with_rpc_port(&url, name, port).await.unwrap();
    // Held by `again` now: another engine wanting that port is refused, naming it.
    let e = engine_with_rpc_port(&url, "127.0.0.1:40013", port).await.unwrap_err();
    assert!(e.message().contains(&port.to_string()) && e.message().contains("notifications"), "{e}");
    again.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_or_unparsable_server_is_named_at_start() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/metadata", l.local_addr().unwrap())
    };
    let cfg = ferry::Config::from_json_str(
        &format!(r#"{{"local_hostname": "127.0.0.1:40003", "metadata_server": "{dead}", "protocol": "tcp"}}"#),
        None,
    )
    .unwrap();
    let e = ferry::builder().config(cfg).build().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
    assert!(e.message().contains(&dead) && e.message().contains("3 attempts"), "{e}");
    let e = HttpMetadata::new("http://[::1/metadata").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
}

#[tokio::test]
async fn the_server_answers_bad_requests_with_the_right_status() {
    let (url, _stop) =
        http_server(Store::in_memory(), Limits { max_key: 64, max_body: 1024, ..Limits::default() }).await;
    let c = reqwest::Client::new();
    let base = url.trim_end_matches("/metadata").to_owned();
    let st = |r: reqwest::Response| r.status().as_u16();
    assert_eq!(st(c.get(&url).send().await.unwrap()), 400, "missing key");
    assert_eq!(st(c.get(format!("{url}?key=")).send().await.unwrap()), 400, "empty key");
    assert_eq!(st(c.get(format!("{url}?key={}", "k".repeat(65))).send().await.unwrap()), 400, "key too long");
    assert_eq!(st(c.post(format!("{url}?key=a")).body("x").send().await.unwrap()), 405, "unsupported method");
    assert_eq!(st(c.put(format!("{url}?key=a")).body(vec![b'x'; 2048]).send().await.unwrap()), 413, "oversized body");
    let r = c.get(format!("{url}?key=absent")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert_eq!(r.text().await.unwrap(), "metadata not found");
    let r = c.put(format!("{url}?key=a")).body("{}").send().await.unwrap();
    assert_eq!(r.text().await.unwrap(), "metadata updated");
    assert_eq!(st(c.put(format!("{url}?key=a")).body("{}").send().await.unwrap()), 200, "re-publish is idempotent");
    assert_eq!(c.delete(format!("{url}?key=a")).send().await.unwrap().text().await.unwrap(), "metadata deleted");
    assert_eq!(st(c.delete(format!("{url}?key=a")).send().await.unwrap()), 404, "delete of an absent key");
    let health = c.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    // A value that is not JSON where a descriptor is expected: the engine names the key.
    c.put(format!("{url}?key=mooncake/ram/broken")).body("not json").send().await.unwrap();
    let e = ferry::builder()
        .metadata(Arc::new(HttpMetadata::new(&url).unwrap()))
        .build()
        .await
        .unwrap()
        .open_segment("broken")
        .await
        .unwrap_err();
    assert!(e.message().contains("mooncake/ram/broken"), "{e}");
}

/// Sends `raw` on one connection and reads until the server closes it.
async fn exchange(addr: &str, raw: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(raw.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut out)).await.unwrap().unwrap();
    String::from_utf8(out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    let (url, _stop) = http_server(Store::in_memory(), Limits::default()).await;
    let addr = url.trim_start_matches("http://").trim_end_matches("/metadata").to_owned();
    // Three requests in one write (HTTP/1.1 pipelining), the last closing the connection.
    let raw = format!(
        "GET /metadata?key=p HTTP/1.1\r\nHost: {addr}\r\n\r\n\
         PUT /metadata?key=p HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 7\r\n\r\n{{\"v\":1}}\
         GET /metadata?key=p HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    );
    let answer = exchange(&addr, &raw).await;
    let statuses: Vec<&str> = answer.match_indices("HTTP/1.1 ").map(|(at, _)| &answer[at..at + 12]).collect();
    assert_eq!(statuses, ["HTTP/1.1 404", "HTTP/1.1 200", "HTTP/1.1 200"], "{answer}");
    let (missing, updated, value) = (
        answer.find("metadata not found").unwrap(),
        answer.find("metadata updated").unwrap(),
        answer.rfind(r#"{"v":1}"#).unwrap(),
    );
    assert!(missing < updated && updated < value, "answers out of order: {answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_server_finishes_requests_closes_idle_connections_and_returns() {
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // A drain bound far above what the test waits: `serve` returning in time shows the idle
    // connection was closed, not waited out.
    let (addr, stop, server) =
        stoppable(Store::in_memory(), Limits { drain_timeout: Duration::from_secs(60), ..Limits::default() }).await;
    let c = reqwest::Client::new();
    assert_eq!(c.get(format!("http://{addr}/health")).send().await.unwrap().status().as_u16(), 200);
    // A request in progress when the stop comes: headers read (the server asked for the body
    // with `100 Continue`), body not sent yet.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(
        format!("PUT /metadata?key=s HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 7\r\nExpect: 100-continue\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut interim = [0u8; 25];
    tokio::time::timeout(Duration::from_secs(10), slow.read_exact(&mut interim)).await.unwrap().unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    let stopped = Instant::now();
    stop.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    slow.write_all(br#"{"v":2}"#).await.unwrap();
    // The answer comes, then the server closes the connection (read_to_string ends).
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), slow.read_to_string(&mut answer)).await.unwrap().unwrap();
    assert!(answer.starts_with("HTTP/1.1 200 OK") && answer.contains("metadata updated"), "{answer}");
    tokio::time::timeout(Duration::from_secs(20), server).await.expect("serve returns").unwrap().unwrap();
    assert!(stopped.elapsed() < Duration::from_secs(20), "waited {:?}", stopped.elapsed());
    assert!(tokio::net::TcpStream::connect(&addr).await.is_err(), "the listener is closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_holds_a_stopping_server_only_for_the_drain_bound() {
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = Limits {
        header_read_timeout: Duration::from_secs(120),
        drain_timeout: Duration::from_millis(500),
        ..Limits::default()
    };
    let (addr, stop, server) = stoppable(Store::in_memory(), limits).await;
    let mut stuck = tokio::net::TcpStream::connect(&addr).await.unwrap();
    stuck.write_all(b"GET /metadata?key=s HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stopped = Instant::now();
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), server).await.expect("serve returns").unwrap().unwrap();
    assert!(stopped.elapsed() < Duration::from_secs(30), "waited {:?}", stopped.elapsed());
    // Its connection was dropped: the client reads the end of the stream, no answer.
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stuck.read_to_end(&mut rest)).await.unwrap().unwrap();
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_go_quiet_are_closed_after_the_idle_timeout() {
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = Limits {
        header_read_timeout: Duration::from_secs(120),
        idle_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let (addr, _stop, _server) = stoppable(Store::in_memory(), limits).await;
    let cases: [(&str, &[u8]); 4] = [
        ("says nothing", b""),
        ("half an HTTP/2 preface", b"PRI * HTTP/2.0\r\n"),
        ("the whole HTTP/2 preface, then nothing", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        ("stalls in the middle of a body", b"PUT /metadata?key=k HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab"),
    ];
    for (what, sent) in cases {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(sent).await.unwrap();
        // The server closes it (end of stream, or a reset) long before the 120 s header limit.
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "a client that {what} is still connected");
    }
    // An active client is not affected.
    let c = reqwest::Client::new();
    assert_eq!(c.get(format!("http://{addr}/health")).send().await.unwrap().status().as_u16(), 200);
}

/// A third party's store: get/put/delete over a map the test's engines share, and no control
/// channel code at all.
struct ThirdParty(Arc<InProcessMetadata>);

#[async_trait::async_trait]
impl MetadataStore for ThirdParty {
    fn name(&self) -> &str {
        "third-party"
    }
    async fn get(&self, key: &str) -> ferry::Result<Option<Vec<u8>>> {
        self.0.get(key).await
    }
    async fn put(&self, key: &str, value: &[u8]) -> ferry::Result<()> {
        self.0.put(key, value).await
    }
    async fn delete(&self, key: &str) -> ferry::Result<()> {
        self.0.delete(key).await
    }
}

/// Serves `redis://` URLs with a [`ThirdParty`] store on `.0`.
struct ThirdPartyFactory(Arc<InProcessMetadata>);

#[async_trait::async_trait]
impl ferry::MetadataFactory for ThirdPartyFactory {
    fn kind(&self) -> &'static str {
        "redis"
    }
    async fn connect(&self, _: &ferry::MetadataServer, _: &ferry::Config) -> ferry::Result<Arc<dyn MetadataStore>> {
        Ok(Arc::new(ThirdParty(self.0.clone())))
    }
}

fn third_party_config(name: &str) -> ferry::Config {
    let text = format!(
        r#"{{"local_hostname": "{name}", "metadata_server": "redis://third-party.invalid:6379", "protocol": "tcp",
             "transfer_timeout_ms": 5000}}"#
    );
    ferry::Config::from_json_str(&text, None).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_party_store_gets_notifications_through_the_generic_listener() {
    let shared = InProcessMetadata::new();
    let engine = async |name: &str| {
        let mut metadata = ferry::default_metadata();
        metadata.install(Arc::new(ThirdPartyFactory(shared.clone())));
        let b = ferry::builder().config(third_party_config(name)).transports(tcp_only());
        b.metadata_registry(metadata).build().await.unwrap()
    };
    let a = engine("127.0.0.1:40041").await;
    let b = engine("127.0.0.1:40042").await;
    assert_eq!((a.metadata_backend(), a.control_channel()), ("third-party", "handshake listener"));
    // The rpc entry in the store names the listener started beside it.
    let rpc = shared.get("mooncake/rpc_meta/127.0.0.1:40041").await.unwrap().unwrap();
    let rpc: ferry::RpcMeta = serde_json::from_slice(&rpc).unwrap();
    assert!(a.rpc_port() == Some(rpc.rpc_port) && (15000..17000).contains(&rpc.rpc_port), "{rpc:?}");
    read_across(&a, &b).await;
    notify_across(&a, &b, "a to b through a third party's store").await;
    notify_across(&b, &a, "b to a through a third party's store").await;
    a.probe(b.segment_name()).await.unwrap();

    // Given to the builder directly, the store has no channel unless one is given with it.
    let store: Arc<dyn MetadataStore> = Arc::new(ThirdParty(shared.clone()));
    let alone = ferry::builder()
        .config(third_party_config("127.0.0.1:40043"))
        .transports(tcp_only())
        .metadata(store.clone())
        .build()
        .await
        .unwrap();
    assert_eq!(alone.control_channel(), "none");
    let e = alone.send_notification(a.segment_name(), "unsent").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.message().contains("the third-party metadata backend has no control channel"), "{e}");
    alone.shutdown().await.unwrap();
    let cfg = third_party_config("127.0.0.1:40044");
    let channel = ferry::default_metadata().channel_beside(&store, &cfg).await.unwrap();
    let given = ferry::builder()
        .config(cfg)
        .transports(tcp_only())
        .metadata(store)
        .control_channel(channel)
        .build()
        .await
        .unwrap();
    notify_across(&given, &a, "from an engine given the store and its channel").await;
    notify_across(&a, &given, "to an engine given the store and its channel").await;

    for e in [given, b, a] {
        e.shutdown().await.unwrap();
    }
    assert!(shared.keys().is_empty(), "every engine unpublished itself: {:?}", shared.keys());
}

#[tokio::test]
async fn p2p_backend_keeps_its_form_of_the_contract() {
    use ferry_metadata_p2p::P2pMetadata;
    // P2P has no store: an engine's own entries are kept locally and served to peers, and
    // "get" of another segment asks that segment's owner.
    let cfg = ferry::Config::from_json_str(r#"{"local_hostname": "127.0.0.1"}"#, None).unwrap();
    let a = P2pMetadata::start(&cfg).await.unwrap();
    let b = P2pMetadata::start(&cfg).await.unwrap();
    let a_name = a.segment_name();
    let a_key = format!("mooncake/ram/{a_name}");
    assert_eq!(a.get(&a_key).await.unwrap(), None, "own descriptor not published yet");
    assert!(b.get(&a_key).await.is_err(), "a peer with nothing published does not answer");
    let desc = format!(r#"{{"name":"{a_name}","protocol":"tcp","buffers":[]}}"#);
    a.put(&a_key, desc.as_bytes()).await.unwrap();
    a.put(&a_key, desc.as_bytes()).await.unwrap(); // re-publish
    assert_eq!(a.get(&a_key).await.unwrap().as_deref(), Some(desc.as_bytes()));
    assert_eq!(b.get(&a_key).await.unwrap().as_deref(), Some(desc.as_bytes()), "fetched from its owner");
    let rpc: ferry::RpcMeta =
        serde_json::from_slice(&b.get(&format!("mooncake/rpc_meta/{a_name}")).await.unwrap().unwrap()).unwrap();
    assert_eq!(format!("{}:{}", rpc.ip_or_host_name, rpc.rpc_port), a_name);
    a.delete(&a_key).await.unwrap();
    a.delete(&a_key).await.unwrap();
    assert_eq!(a.get(&a_key).await.unwrap(), None);
    let e = b.get("mooncake/ram/127.0.0.1:1").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "a peer that is not there: {e}");
}

#[tokio::test]
async fn the_server_refuses_a_second_engines_rpc_meta_but_accepts_the_identical_entry() {
    let (url, _stop) = http_server(Store::in_memory(), Limits::default()).await;
    let c = reqwest::Client::new();
    let key = format!("{url}?key=mooncake/rpc_meta/127.0.0.1:17000");
    let first = r#"{"ip_or_host_name":"127.0.0.1","rpc_port":15001}"#;
    let put = |body: &'static str| c.put(&key).body(body).send();
    assert_eq!(put(first).await.unwrap().status().as_u16(), 200);
    assert_eq!(put(first).await.unwrap().status().as_u16(), 200, "the identical entry again: idempotent");
    let r = put(r#"{"ip_or_host_name":"127.0.0.1","rpc_port":15002}"#).await.unwrap();
    assert_eq!(r.status().as_u16(), 400, "another engine's entry under a name in use, as Mooncake's servers");
    assert_eq!(r.text().await.unwrap(), "Duplicate rpc_meta key not allowed");
    let stored = c.get(&key).send().await.unwrap().text().await.unwrap();
    assert_eq!(stored, first, "the first engine keeps its entry");
    // Other keys are replaced as before.
    let desc = format!("{url}?key=mooncake/ram/127.0.0.1:17000");
    assert_eq!(c.put(&desc).body("1").send().await.unwrap().status().as_u16(), 200);
    assert_eq!(c.put(&desc).body("2").send().await.unwrap().status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_engine_cannot_take_a_live_engines_name_but_replaces_a_dead_ones() {
    let (url, _stop) = http_server(Store::in_memory(), Limits::default()).await;
    let name = "127.0.0.1:40021";
    let a = tcp_engine_on(&url, name).await;
    let cfg = ferry::Config::from_json_str(
        &format!(r#"{{"local_hostname": "{name}", "metadata_server": "{url}", "protocol": "tcp"}}"#),
        None,
    )
    .unwrap();
    let e = ferry::builder().config(cfg.clone()).build().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    assert!(e.message().contains("segment name in use") && e.message().contains("answered a probe"), "{e}");
    assert_eq!(a.probe(name).await.map_err(|e| e.to_string()), Ok(()), "the first engine is untouched");
    a.shutdown().await.unwrap();
    // A crashed engine's entry (its listener gone) is replaced.
    let m = HttpMetadata::new(&url).unwrap();
    let dead = free_port();
    let stale = format!(r#"{{"ip_or_host_name":"127.0.0.1","rpc_port":{dead}}}"#);
    m.put(&format!("mooncake/rpc_meta/{name}"), stale.as_bytes()).await.unwrap();
    let b = ferry::builder().config(cfg).build().await.unwrap();
    assert_eq!(rpc_entry(&url, name).await["rpc_port"], b.rpc_port().unwrap());
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_reaches_a_live_peer_on_a_store_and_names_an_unknown_one() {
    let (url, _stop) = http_server(Store::in_memory(), Limits::default()).await;
    let a = tcp_engine_on(&url, "127.0.0.1:40031").await;
    let b = tcp_engine_on(&url, "127.0.0.1:40032").await;
    a.probe("127.0.0.1:40032").await.unwrap();
    let e = a.probe("unreachable_peer:9").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(e.message().contains("no rpc entry"), "{e}");
    b.shutdown().await.unwrap();
    let e = a.probe("127.0.0.1:40032").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "a cleanly stopped peer unpublished its entry: {e}");
    a.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_engines_ignore_the_port_of_local_hostname_as_mooncake_does() {
    // The port in the name is held by someone else, and two engines pass the same name: both
    // start, each on a free RPC port of its own, and probe each other.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let make = || async {
        let cfg = ferry::Config::from_json_str(
            &format!(
                r#"{{"local_hostname": "127.0.0.1:{port}", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}}"#
            ),
            None,
        )
        .unwrap();
        ferry::builder().config(cfg).build().await.unwrap()
    };
    let (a, b) = (make().await, make().await);
    assert_ne!(a.segment_name(), b.segment_name());
    for e in [&a, &b] {
        assert_ne!(e.rpc_port(), Some(port), "{}", e.segment_name());
        assert!((15000..17000).contains(&e.rpc_port().unwrap()), "{}", e.segment_name());
    }
    a.probe(b.segment_name()).await.unwrap();
    b.probe(a.segment_name()).await.unwrap();
    let e = a.probe("127.0.0.1:1").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}
