//! `ferry metadata-server`: Mooncake's HTTP metadata protocol (reference `mooncake-wire.md` §3)
//! with what the reference servers lack: idempotent re-publish of any key (an `rpc_meta` key
//! only with the identical value, as Mooncake's servers: another value is a second engine
//! taking a name in use, answered 400), `GET /health`,
//! persistence across restarts (`--data-dir`), limits on key length, body size and the total
//! stored, keys checked to be UTF-8 (never merged by lossy decoding), an optional write token
//! (PUT and DELETE need `Authorization: Bearer <token>`; reads stay open), graceful shutdown,
//! request logging, and `GET /metrics` (Prometheus text: requests by route, method and status,
//! stored keys and bytes; docs/metrics.md).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder as ConnectionBuilder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_io_timeout::TimeoutStream;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use crate::store::Store;
use crate::token::Token;

/// The content type of `/metrics` (OpenMetrics 1.0 text, which Prometheus scrapes).
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels of `ferry_metadata_requests_total`: route, method, status.
type RequestLabels = [(&'static str, String); 3];

/// The server's Prometheus metrics.
struct ServerMetrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    keys: Gauge,
    bytes: Gauge,
}

impl ServerMetrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "ferry_metadata_requests",
            "HTTP requests answered, by route (/metadata, /health, /metrics, other), method and status",
            requests.clone(),
        );
        let keys = Gauge::default();
        registry.register("ferry_metadata_keys", "Keys stored", keys.clone());
        let bytes = Gauge::default();
        registry.register_with_unit(
            "ferry_metadata_stored",
            "Bytes of the keys and values stored (what --max-total-bytes limits)",
            Unit::Bytes,
            bytes.clone(),
        );
        Self { registry, requests, keys, bytes }
    }
}

/// Limits of the server.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Longest key accepted (bytes); longer ones get 400.
    pub max_key: usize,
    /// Largest body accepted (bytes); larger ones get 413.
    pub max_body: usize,
    /// Most bytes of keys and values stored at once ([`Store::bytes`]); a write that would
    /// pass it gets 507 and stores nothing.
    pub max_total: usize,
    /// Time a client has to send a request's headers, also while its connection is idle
    /// between requests: a keep-alive connection idle this long is closed.
    pub header_read_timeout: Duration,
    /// A connection on which nothing arrives while the server waits to read, or nothing can be
    /// sent while it waits to write, for this long is closed: a client that connects and says
    /// nothing (or half an HTTP/2 preface), stalls in the middle of a body, keeps an HTTP/2
    /// connection idle, or stops reading responses.
    pub idle_timeout: Duration,
    /// Time a stopping server lets requests in progress finish; connections still open then
    /// are dropped.
    pub drain_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_key: 4096,
            max_body: 16 << 20,
            max_total: 256 << 20,
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Clone)]
struct App {
    store: Arc<Store>,
    limits: Limits,
    /// What PUT and DELETE must present, if anything.
    write_token: Option<Token>,
    /// Held while an `rpc_meta` key is compared and written, so two engines racing for one name
    /// cannot both succeed.
    rpc_meta: Arc<std::sync::Mutex<()>>,
    metrics: Arc<ServerMetrics>,
}

/// `application/x-www-form-urlencoded` decoding of one query component, to bytes: `+` is a
/// space, `%XY` the byte 0xXY, anything else (a `%` not followed by two hex digits too) itself.
fn form_decode(component: &str) -> Vec<u8> {
    let b = component.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(hi), Some(lo)) => {
                    out.push(hi << 4 | lo);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    out
}

/// The `key` parameter of the query string. Decoded strictly: a key that is not UTF-8 once
/// decoded is refused (decoding it lossily would store `%FF` and `%FE` under one key).
fn key_of(app: &App, uri: &Uri) -> Result<String, (StatusCode, String)> {
    let mut key = None;
    for pair in uri.query().unwrap_or("").split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if form_decode(name) != b"key" {
            continue;
        }
        if key.is_some() {
            return Err((StatusCode::BAD_REQUEST, "more than one key parameter".into()));
        }
        key = Some(form_decode(value));
    }
    match key {
        None => Err((StatusCode::BAD_REQUEST, "missing key".into())),
        Some(k) if k.is_empty() => Err((StatusCode::BAD_REQUEST, "empty key".into())),
        Some(k) if k.len() > app.limits.max_key => {
            Err((StatusCode::BAD_REQUEST, format!("key longer than {} bytes", app.limits.max_key)))
        }
        Some(k) => String::from_utf8(k).map_err(|e| {
            (
                StatusCode::BAD_REQUEST,
                format!(
                    "key is not valid UTF-8 once decoded (byte {}); metadata keys are UTF-8 text",
                    e.utf8_error().valid_up_to()
                ),
            )
        }),
    }
}

/// Refuses a write (any method but GET and HEAD) that does not carry the server's write token
/// as `Authorization: Bearer <token>`, with 401 before its body is read. Reads need no token.
async fn require_token(State(app): State<App>, req: Request, next: Next) -> Response {
    let Some(token) = &app.write_token else { return next.run(req).await };
    if req.method() == Method::GET || req.method() == Method::HEAD {
        return next.run(req).await;
    }
    let presented = req.headers().get(header::AUTHORIZATION).map(|v| v.as_bytes()).and_then(|v| {
        let (scheme, rest) = v.split_at_checked(7)?;
        scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
    });
    if presented.is_some_and(|p| token.matches(p)) {
        return next.run(req).await;
    }
    let why = if presented.is_some() { "the token presented is not the server's" } else { "no bearer token" };
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        format!("writes need `Authorization: Bearer <token>` with the server's write token: {why}"),
    )
        .into_response()
}

async fn get_key(State(app): State<App>, uri: Uri) -> Response {
    let key = match key_of(&app, &uri) {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    match app.store.get(&key) {
        Some(v) => (StatusCode::OK, v).into_response(),
        None => (StatusCode::NOT_FOUND, "metadata not found").into_response(),
    }
}

/// How a PUT ended, short of an error.
enum Put {
    Written,
    /// An `rpc_meta` key that holds another value.
    Duplicate,
    Full(crate::store::StoreFull),
}

async fn put_key(State(app): State<App>, uri: Uri, body: Result<Bytes, BytesRejection>) -> Response {
    let key = match key_of(&app, &uri) {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    let body = match body {
        Ok(b) => b,
        Err(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            let msg = format!("value larger than {} bytes (the server's --max-body-bytes)", app.limits.max_body);
            return (StatusCode::PAYLOAD_TOO_LARGE, msg).into_response();
        }
        Err(r) => return r.into_response(),
    };
    let store = app.store.clone();
    let rpc_meta = app.rpc_meta.clone();
    let max_total = app.limits.max_total;
    let written = tokio::task::spawn_blocking(move || {
        let put = |store: &Store| {
            store.put_within(&key, &body, max_total).map(|r| r.map_or_else(Put::Full, |()| Put::Written))
        };
        // As Mooncake's servers do: a second engine may not take an `rpc_meta` name that is
        // already published (Mooncake engines fail to start on the 400, which is how they learn
        // the name is taken). Re-publishing the identical entry is accepted, as by its C++ server.
        if key.contains("rpc_meta") {
            let _one_at_a_time = rpc_meta.lock().unwrap_or_else(|p| p.into_inner());
            if store.get(&key).is_some_and(|stored| stored != body) {
                return Ok(Put::Duplicate);
            }
            return put(&store);
        }
        put(&store)
    })
    .await;
    match written {
        Ok(Ok(Put::Duplicate)) => (StatusCode::BAD_REQUEST, "Duplicate rpc_meta key not allowed").into_response(),
        Ok(Ok(Put::Written)) => (StatusCode::OK, "metadata updated").into_response(),
        Ok(Ok(Put::Full(full))) => {
            tracing::warn!(%full, "metadata write refused: the store is full");
            let msg = format!("{full} (the server's --max-total-bytes); nothing was stored");
            (StatusCode::INSUFFICIENT_STORAGE, msg).into_response()
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "metadata store write failed");
            (StatusCode::INTERNAL_SERVER_ERROR, format!("store write failed: {e}")).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("store task failed: {e}")).into_response(),
    }
}

async fn delete_key(State(app): State<App>, uri: Uri) -> Response {
    let key = match key_of(&app, &uri) {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    let store = app.store.clone();
    match tokio::task::spawn_blocking(move || store.delete(&key)).await {
        Ok(Ok(true)) => (StatusCode::OK, "metadata deleted").into_response(),
        Ok(Ok(false)) => (StatusCode::NOT_FOUND, "metadata not found").into_response(),
        Ok(Err(e)) => (StatusCode::INTERNAL_SERVER_ERROR, format!("store write failed: {e}")).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("store task failed: {e}")).into_response(),
    }
}

async fn health(State(app): State<App>) -> Response {
    (StatusCode::OK, format!("OK {} keys", app.store.len())).into_response()
}

/// `GET /metrics`: the request counters, and the store's keys and bytes as they are now.
async fn metrics(State(app): State<App>) -> Response {
    app.metrics.keys.set(i64::try_from(app.store.len()).unwrap_or(i64::MAX));
    app.metrics.bytes.set(i64::try_from(app.store.bytes()).unwrap_or(i64::MAX));
    let mut text = String::new();
    match encode(&mut text, &app.metrics.registry) {
        Ok(()) => (StatusCode::OK, [(header::CONTENT_TYPE, OPENMETRICS)], text).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding the metrics: {e}")).into_response(),
    }
}

/// Counts every request by route, method and status (the route is one of the server's paths,
/// else `other`, so the label's values stay few whatever clients ask for).
async fn count_request(State(app): State<App>, req: Request, next: Next) -> Response {
    let route: &'static str = match req.uri().path() {
        "/metadata" => "/metadata",
        "/health" => "/health",
        "/metrics" => "/metrics",
        _ => "other",
    };
    let method = req.method().as_str().to_owned();
    let resp = next.run(req).await;
    let labels = [("route", route.to_owned()), ("method", method), ("status", resp.status().as_u16().to_string())];
    app.metrics.requests.get_or_create(&labels).inc();
    resp
}

async fn log_request(req: Request, next: Next) -> Response {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return next.run(req).await;
    }
    let (method, uri, started) = (req.method().clone(), req.uri().clone(), Instant::now());
    let resp = next.run(req).await;
    tracing::debug!(%method, %uri, status = resp.status().as_u16(), micros = started.elapsed().as_micros() as u64, "metadata request");
    resp
}

/// The server's routes over `store`, with no write token.
pub fn router(store: Arc<Store>, limits: Limits) -> Router {
    router_with(store, limits, None)
}

/// The server's routes over `store`; with `write_token`, PUT and DELETE (every method but GET
/// and HEAD) need `Authorization: Bearer <token>` and get 401 without it.
pub fn router_with(store: Arc<Store>, limits: Limits, write_token: Option<Token>) -> Router {
    let body_limit = limits.max_body;
    let app = App { store, limits, write_token, rpc_meta: Arc::default(), metrics: Arc::new(ServerMetrics::new()) };
    Router::new()
        .route("/metadata", get(get_key).put(put_key).delete(delete_key))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn_with_state(app.clone(), require_token))
        .layer(middleware::from_fn(log_request))
        .layer(middleware::from_fn_with_state(app.clone(), count_request))
        .with_state(app)
}

/// Serves on `listener` until `shutdown` completes, then stops accepting, closes idle
/// connections, lets requests in progress finish for up to `limits.drain_timeout` and drops the
/// connections still open after that.
///
/// Connections are served by hyper directly rather than through `axum::serve` for the settings
/// it does not expose: header-read and I/O idle timeouts (a client that never finishes its
/// headers, or says nothing at all, would otherwise hold a connection, and a stopping server,
/// forever) and a bound on the drain.
/// `TCP_NODELAY` is set: without it a client that pipelines requests waits for its own delayed
/// ACK (40 ms) before every second response. hyper's `pipeline_flush` (responses to pipelined
/// requests written together) is deliberately off: with it hyper buffers responses without
/// bound while unread requests wait, so one client pipelining GETs of a large value and never
/// reading could exhaust the server's memory.
pub async fn serve(
    listener: TcpListener,
    store: Arc<Store>,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, store, limits, None, shutdown).await
}

/// [`serve`] with a write token: PUT and DELETE need `Authorization: Bearer <token>`
/// ([`router_with`]).
pub async fn serve_with(
    listener: TcpListener,
    store: Arc<Store>,
    limits: Limits,
    write_token: Option<Token>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    tracing::info!(%addr, writes_need_token = write_token.is_some(), "metadata server listening");
    let (header_read_timeout, idle_timeout, drain_timeout) =
        (limits.header_read_timeout, limits.idle_timeout, limits.drain_timeout);
    let service = TowerToHyperService::new(router_with(store, limits, write_token));
    let mut builder = ConnectionBuilder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(header_read_timeout);
    let graceful = GracefulShutdown::new();
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of descriptors and the like: wait rather than spin; the connections
                    // being served are not affected.
                    tracing::warn!(error = %e, "metadata server cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        while connections.try_join_next().is_some() {}
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY on a metadata connection");
        }
        // hyper's header timeout only starts once it knows the connection is HTTP/1, and HTTP/2
        // and request bodies have none: every read and write is bounded here instead.
        let mut io = TimeoutStream::new(tcp);
        io.set_read_timeout(Some(idle_timeout));
        io.set_write_timeout(Some(idle_timeout));
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(Box::pin(io)), service.clone());
        let connection = graceful.watch(connection.into_owned());
        connections.spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "metadata connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(drain_timeout, graceful.shutdown()).await.is_err() {
        tracing::warn!(
            open = connections.len(),
            "metadata server: connections still open {drain_timeout:?} after the stop are dropped"
        );
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    Ok(())
}
