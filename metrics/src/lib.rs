//! Ferry's Prometheus endpoint: an engine's counters ([`TransferEngine::stats`]) served as
//! Prometheus text (the OpenMetrics flavour, encoded by `prometheus-client`) at `/metrics`.
//!
//! [`MetricsService`] is an [`EngineService`]: the facade's builder adds it, and it starts an
//! endpoint when the engine's config has `metrics_addr` (or `FERRY_METRICS_ADDR`, for configs
//! from `Config::discover`). Engines of one process that name the same address share one
//! endpoint (each engine's series carry its `segment` label); port 0 gives an engine an
//! endpoint of its own on a free port ([`endpoint_of`] says which). An endpoint runs on a
//! thread of its own, so it outlives no engine and depends on no engine's runtime; it stops when
//! the last engine on it shuts down or is dropped.
//!
//! docs/metrics.md lists every metric.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};

use axum::Router;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use ferry_core::{EngineService, EngineStats, Error, ErrorKind, Result, ServiceGuard, TransferEngine, WeakEngine};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

/// The content type of the text `/metrics` serves (OpenMetrics 1.0, which Prometheus scrapes).
pub const CONTENT_TYPE_OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Reads one percentile (in microseconds) of a latency snapshot.
type Percentile = fn(&ferry_core::LatencyStats) -> f64;

/// Quantiles exported as `ferry_batch_latency_quantile_seconds{quantile=...}`.
const QUANTILES: [(&str, Percentile); 4] =
    [("0.5", |l| l.p50_us), ("0.9", |l| l.p90_us), ("0.99", |l| l.p99_us), ("0.999", |l| l.p999_us)];

/// Snapshots of engines' counters as a `prometheus-client` collector.
#[derive(Debug)]
struct StatsCollector(Vec<EngineStats>);

impl Collector for StatsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::result::Result<(), std::fmt::Error> {
        let route = |s: &EngineStats, t: &ferry_core::TransferStats| {
            vec![
                ("segment", s.segment.clone()),
                ("transport", t.transport.clone()),
                ("peer", t.peer.clone()),
                ("opcode", t.opcode.clone()),
            ]
        };
        type Field = fn(&ferry_core::TransferStats) -> u64;
        let per_route: [(&str, &str, Option<&Unit>, Field); 3] = [
            ("ferry_transfer_requests", "Requests this engine initiated that completed", None, |t| t.requests),
            ("ferry_transfer", "Bytes of the requests this engine initiated that completed", Some(&Unit::Bytes), |t| {
                t.bytes
            }),
            (
                "ferry_transfer_failed_requests",
                "Requests this engine initiated that failed or were cancelled",
                None,
                |t| t.failed_requests,
            ),
        ];
        for (name, help, unit, field) in per_route {
            let mut family = encoder.encode_descriptor(name, help, unit, MetricType::Counter)?;
            for s in &self.0 {
                for t in &s.transfers {
                    ConstCounter::new(field(t)).encode(family.encode_family(&route(s, t))?)?;
                }
            }
        }
        type Kinds = fn(&EngineStats) -> &std::collections::BTreeMap<String, u64>;
        let by_kind: [(&str, &str, Kinds); 2] = [
            ("ferry_request_failures", "Requests that failed or were cancelled, by error kind", |s| &s.failures),
            ("ferry_rejected_submissions", "Submissions refused before anything started, by error kind", |s| {
                &s.rejected_submissions
            }),
        ];
        for (name, help, field) in by_kind {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for s in &self.0 {
                for (kind, n) in field(s) {
                    let labels = [("segment", s.segment.as_str()), ("kind", kind.as_str())];
                    ConstCounter::new(*n).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        let mut family = encoder.encode_descriptor(
            "ferry_batch_latency",
            "Time from a batch's submission to its last request's outcome",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for s in &self.0 {
            let l = &s.batch_latency;
            let buckets: Vec<(f64, u64)> = l.buckets.iter().map(|b| (b.le_seconds, b.count)).collect();
            family.encode_family(&[("segment", s.segment.as_str())])?.encode_histogram::<NoLabelSet>(
                l.sum_seconds,
                l.count,
                &buckets,
                None,
            )?;
        }
        let mut family = encoder.encode_descriptor(
            "ferry_batch_latency_quantile",
            "Batch latency percentiles since the engine started (from a log-linear histogram, within about 3 %)",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?;
        for s in &self.0 {
            for (q, get) in QUANTILES {
                let labels = [("segment", s.segment.as_str()), ("quantile", q)];
                ConstGauge::new(get(&s.batch_latency) / 1e6).encode(family.encode_family(&labels)?)?;
            }
        }
        type Count = fn(&EngineStats) -> u64;
        let counters: [(&str, &str, Count); 2] = [
            (
                "ferry_tail_polls",
                "Blocking waits that woke before a device-completed batch's expected end to poll it",
                |s| s.tail_polls,
            ),
            ("ferry_tail_polls_caught", "Tail polls that saw their batch end", |s| s.tail_polls_caught),
        ];
        for (name, help, field) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for s in &self.0 {
                ConstCounter::new(field(s)).encode(family.encode_family(&[("segment", s.segment.as_str())])?)?;
            }
        }
        type Gauge = fn(&EngineStats) -> u64;
        let gauges: [(&str, &str, Option<&Unit>, Gauge); 3] = [
            ("ferry_open_segments", "Segments open in the engine", None, |s| s.open_segments),
            ("ferry_registered", "Memory registered with the engine", Some(&Unit::Bytes), |s| s.registered_bytes),
            ("ferry_registered_regions", "Regions of memory registered with the engine", None, |s| {
                s.registered_regions
            }),
        ];
        for (name, help, unit, field) in gauges {
            let mut family = encoder.encode_descriptor(name, help, unit, MetricType::Gauge)?;
            for s in &self.0 {
                ConstGauge::new(field(s) as i64).encode(family.encode_family(&[("segment", s.segment.as_str())])?)?;
            }
        }
        Ok(())
    }
}

/// The Prometheus text of the engines' counters: what `/metrics` serves.
pub fn encode(stats: Vec<EngineStats>) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(StatsCollector(stats)));
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text
}

/// One endpoint and the engines it serves.
struct Endpoint {
    addr: SocketAddr,
    engines: Mutex<Vec<(u64, WeakEngine)>>,
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl Endpoint {
    fn render(&self) -> String {
        let engines: Vec<TransferEngine> = {
            let list = self.engines.lock().unwrap_or_else(|p| p.into_inner());
            list.iter().filter_map(|(_, w)| w.upgrade()).collect()
        };
        encode(engines.iter().map(TransferEngine::stats).collect())
    }
}

/// Endpoints on configured (non-zero) ports, shared by the engines that name them.
fn shared() -> &'static Mutex<HashMap<SocketAddr, Arc<Endpoint>>> {
    static SHARED: OnceLock<Mutex<HashMap<SocketAddr, Arc<Endpoint>>>> = OnceLock::new();
    SHARED.get_or_init(Default::default)
}

/// Every endpoint by the segment names of its engines (for [`endpoint_of`]).
fn by_segment() -> &'static Mutex<HashMap<String, SocketAddr>> {
    static BY_SEGMENT: OnceLock<Mutex<HashMap<String, SocketAddr>>> = OnceLock::new();
    BY_SEGMENT.get_or_init(Default::default)
}

/// The address of the endpoint serving the engine named `segment`, while it runs (with port 0
/// configured, the port it was given).
pub fn endpoint_of(segment: &str) -> Option<SocketAddr> {
    by_segment().lock().unwrap_or_else(|p| p.into_inner()).get(segment).copied()
}

/// Binds `addr` and serves `/metrics` from a thread of its own.
fn start_endpoint(addr: SocketAddr) -> Result<Arc<Endpoint>> {
    let listener = std::net::TcpListener::bind(addr).map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("cannot listen for metrics on {addr} (`metrics_addr` / FERRY_METRICS_ADDR): {e}"),
        )
        .with_source(e)
    })?;
    listener.set_nonblocking(true).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
    let bound = listener.local_addr().map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let endpoint = Arc::new(Endpoint { addr: bound, engines: Mutex::new(Vec::new()), stop: Mutex::new(Some(tx)) });
    let serving = Arc::downgrade(&endpoint);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot start the metrics endpoint's runtime: {e}")))?;
    std::thread::Builder::new()
        .name("ferry-metrics".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(addr = %bound, error = %e, "metrics endpoint cannot listen");
                        return;
                    }
                };
                let app = Router::new().route(
                    "/metrics",
                    get(move || {
                        let serving = serving.clone();
                        async move {
                            let body = serving.upgrade().map(|e| e.render()).unwrap_or_default();
                            ([(CONTENT_TYPE, CONTENT_TYPE_OPENMETRICS)], body).into_response()
                        }
                    }),
                );
                let served = axum::serve(listener, app).with_graceful_shutdown(async move {
                    let _ = rx.await;
                });
                if let Err(e) = served.await {
                    tracing::warn!(addr = %bound, error = %e, "metrics endpoint stopped");
                }
            })
        })
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot start the metrics endpoint's thread: {e}")))?;
    tracing::info!(addr = %bound, "metrics endpoint listening at http://{bound}/metrics");
    Ok(endpoint)
}

/// Starts (or joins) the endpoint of an engine whose config has `metrics_addr`: the
/// [`EngineService`] the facade's builder adds.
#[derive(Debug, Default, Clone, Copy)]
pub struct MetricsService;

#[async_trait::async_trait]
impl EngineService for MetricsService {
    fn name(&self) -> &str {
        "metrics endpoint"
    }

    async fn start(&self, engine: &TransferEngine) -> Result<Option<ServiceGuard>> {
        let Some(addr) = engine.config().metrics_addr() else { return Ok(None) };
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let endpoint = if addr.port() == 0 {
            start_endpoint(addr)?
        } else {
            let mut shared = shared().lock().unwrap_or_else(|p| p.into_inner());
            match shared.get(&addr) {
                Some(e) => e.clone(),
                None => {
                    let e = start_endpoint(addr)?;
                    shared.insert(addr, e.clone());
                    e
                }
            }
        };
        endpoint.engines.lock().unwrap_or_else(|p| p.into_inner()).push((id, engine.downgrade()));
        let segment = engine.segment_name().to_owned();
        by_segment().lock().unwrap_or_else(|p| p.into_inner()).insert(segment.clone(), endpoint.addr);
        Ok(Some(ServiceGuard::new(move || {
            let mut by = by_segment().lock().unwrap_or_else(|p| p.into_inner());
            if by.get(&segment) == Some(&endpoint.addr) {
                by.remove(&segment);
            }
            drop(by);
            let mut shared = shared().lock().unwrap_or_else(|p| p.into_inner());
            let mut engines = endpoint.engines.lock().unwrap_or_else(|p| p.into_inner());
            engines.retain(|(i, _)| *i != id);
            if engines.is_empty() {
                if shared.get(&endpoint.addr).is_some_and(|e| Arc::ptr_eq(e, &endpoint)) {
                    shared.remove(&endpoint.addr);
                }
                if let Some(stop) = endpoint.stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    let _ = stop.send(());
                }
            }
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::{Config, InProcessMetadata, Location, MetadataStore, Opcode, TransferRequest};

    async fn engine(meta: &Arc<InProcessMetadata>, name: &str, metrics_addr: &str) -> Result<TransferEngine> {
        let text = format!(r#"{{"local_hostname": "{name}", "protocol": "local", "metrics_addr": "{metrics_addr}"}}"#);
        let mut b = ferry_core::EngineBuilder::new()
            .config(Config::from_json_str(&text, None).unwrap())
            .metadata(meta.clone() as Arc<dyn MetadataStore>)
            .service(Arc::new(MetricsService));
        b.transports_mut().install(Arc::new(ferry_transport_local::LocalTransportFactory));
        b.build().await
    }

    async fn scrape(addr: SocketAddr) -> Option<String> {
        let r = reqwest::get(format!("http://{addr}/metrics")).await.ok()?;
        assert_eq!(r.headers()["content-type"], CONTENT_TYPE_OPENMETRICS);
        r.text().await.ok()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[allow(unsafe_code)]
    async fn an_engine_serves_its_counters_until_it_shuts_down() {
        let meta = InProcessMetadata::new();
        let a = engine(&meta, "metrics-a:1", "127.0.0.1:0").await.unwrap();
        let addr = endpoint_of("metrics-a:1").expect("a free port was given");
        assert_ne!(addr.port(), 0);
        let src = vec![7u8; 4096];
        let dst = vec![0u8; 4096];
        // SAFETY: both buffers outlive the engine (shut down below).
        unsafe { a.register_memory(src.as_ptr() as u64, 4096, Location::Any) }.await.unwrap();
        // SAFETY: as above.
        unsafe { a.register_memory(dst.as_ptr() as u64, 4096, Location::Any) }.await.unwrap();
        let me = a.open_segment("metrics-a:1").await.unwrap();
        let read = TransferRequest {
            opcode: Opcode::Read,
            source: dst.as_ptr() as u64,
            target: me,
            target_offset: src.as_ptr() as u64,
            length: 1000,
        };
        a.transfer(&[read, read]).await.unwrap();
        let text = scrape(addr).await.unwrap();
        let route = r#"{segment="metrics-a:1",transport="local",peer="metrics-a:1",opcode="read"}"#;
        for line in [
            format!("ferry_transfer_requests_total{route} 2"),
            format!("ferry_transfer_bytes_total{route} 2000"),
            format!("ferry_transfer_failed_requests_total{route} 0"),
            r#"ferry_registered_bytes{segment="metrics-a:1"} 8192"#.to_owned(),
            r#"ferry_registered_regions{segment="metrics-a:1"} 2"#.to_owned(),
            r#"ferry_open_segments{segment="metrics-a:1"} 1"#.to_owned(),
            r#"ferry_request_failures_total{segment="metrics-a:1",kind="timeout"} 0"#.to_owned(),
            r#"ferry_batch_latency_seconds_count{segment="metrics-a:1"} 1"#.to_owned(),
            "# TYPE ferry_batch_latency_seconds histogram".to_owned(),
            // `local` batches are not device-completed: nobody polls them.
            r#"ferry_tail_polls_total{segment="metrics-a:1"} 0"#.to_owned(),
            r#"ferry_tail_polls_caught_total{segment="metrics-a:1"} 0"#.to_owned(),
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line:?} in\n{text}");
        }
        assert!(text.contains(r#"ferry_batch_latency_quantile_seconds{segment="metrics-a:1",quantile="0.999"}"#));
        assert!(text.ends_with("# EOF\n"));
        a.shutdown().await.unwrap();
        assert_eq!(endpoint_of("metrics-a:1"), None);
        // The endpoint stops with its engine.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            assert!(std::time::Instant::now() < deadline, "{addr} still accepts connections");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn engines_naming_one_address_share_it_and_a_taken_one_fails_the_build() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let meta = InProcessMetadata::new();
        let a = engine(&meta, "share-a:1", &addr.to_string()).await.unwrap();
        let b = engine(&meta, "share-b:1", &addr.to_string()).await.unwrap();
        let text = scrape(addr).await.unwrap();
        assert!(text.contains(r#"ferry_open_segments{segment="share-a:1"} 0"#), "{text}");
        assert!(text.contains(r#"ferry_open_segments{segment="share-b:1"} 0"#), "{text}");
        a.shutdown().await.unwrap();
        let text = scrape(addr).await.unwrap();
        assert!(!text.contains("share-a:1") && text.contains("share-b:1"), "{text}");
        b.shutdown().await.unwrap();

        // Something else holds the port: the build fails naming it, and no engine is left.
        let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = holder.local_addr().unwrap();
        let err = engine(&meta, "taken:1", &taken.to_string()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.message().contains(&format!("cannot listen for metrics on {taken}")), "{err}");
        assert!(meta.get("mooncake/ram/taken:1").await.unwrap().is_none(), "the engine was shut down");
    }

    #[test]
    fn encoding_an_empty_set_gives_the_descriptors_alone() {
        let text = encode(Vec::new());
        assert!(text.contains("# TYPE ferry_transfer_requests counter"), "{text}");
        assert!(text.contains("# UNIT ferry_transfer_bytes bytes"), "{text}");
        assert!(text.contains("# TYPE ferry_registered_bytes gauge"), "{text}");
        assert!(!text.lines().any(|l| l.starts_with("ferry_")), "no samples: {text}");
    }
}
