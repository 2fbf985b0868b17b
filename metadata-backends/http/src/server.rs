//! `ferry metadata-server`: Mooncake's HTTP metadata protocol (reference `mooncake-wire.md` §3)
//! with what the reference servers lack: idempotent re-publish of any key (an `rpc_meta` key
//! only with the identical value, as Mooncake's servers: another value is a second engine
//! taking a name in use, answered 400), `GET /health`,
//! persistence across restarts (`--data-dir`), limits on key length and body size, graceful
//! shutdown and request logging.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder as ConnectionBuilder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_io_timeout::TimeoutStream;

use crate::store::Store;

/// Limits of the server.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Longest key accepted (bytes); longer ones get 400.
    pub max_key: usize,
    /// Largest body accepted (bytes); larger ones get 413.
    pub max_body: usize,
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
    /// Held while an `rpc_meta` key is compared and written, so two engines racing for one name
    /// cannot both succeed.
    rpc_meta: Arc<std::sync::Mutex<()>>,
}

/// The query string: `?key=...`.
#[derive(serde::Deserialize)]
struct KeyQuery {
    key: Option<String>,
}

fn key_of(app: &App, q: KeyQuery) -> Result<String, (StatusCode, String)> {
    match q.key {
        None => Err((StatusCode::BAD_REQUEST, "missing key".into())),
        Some(k) if k.is_empty() => Err((StatusCode::BAD_REQUEST, "empty key".into())),
        Some(k) if k.len() > app.limits.max_key => {
            Err((StatusCode::BAD_REQUEST, format!("key longer than {} bytes", app.limits.max_key)))
        }
        Some(k) => Ok(k),
    }
}

async fn get_key(State(app): State<App>, Query(q): Query<KeyQuery>) -> Response {
    let key = match key_of(&app, q) {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    match app.store.get(&key) {
        Some(v) => (StatusCode::OK, v).into_response(),
        None => (StatusCode::NOT_FOUND, "metadata not found").into_response(),
    }
}

async fn put_key(State(app): State<App>, Query(q): Query<KeyQuery>, body: Bytes) -> Response {
    let key = match key_of(&app, q) {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    let store = app.store.clone();
    let rpc_meta = app.rpc_meta.clone();
    let written = tokio::task::spawn_blocking(move || {
        // As Mooncake's servers do: a second engine may not take an `rpc_meta` name that is
        // already published (Mooncake engines fail to start on the 400, which is how they learn
        // the name is taken). Re-publishing the identical entry is accepted, as by its C++ server.
        if key.contains("rpc_meta") {
            let _one_at_a_time = rpc_meta.lock().unwrap_or_else(|p| p.into_inner());
            if store.get(&key).is_some_and(|stored| stored != body) {
                return Ok(false);
            }
            return store.put(&key, &body).map(|()| true);
        }
        store.put(&key, &body).map(|()| true)
    })
    .await;
    match written {
        Ok(Ok(false)) => (StatusCode::BAD_REQUEST, "Duplicate rpc_meta key not allowed").into_response(),
        Ok(Ok(true)) => (StatusCode::OK, "metadata updated").into_response(),
        Ok(Err(e)) => {
            tracing::error!(error = %e, "metadata store write failed");
            (StatusCode::INTERNAL_SERVER_ERROR, format!("store write failed: {e}")).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("store task failed: {e}")).into_response(),
    }
}

async fn delete_key(State(app): State<App>, Query(q): Query<KeyQuery>) -> Response {
    let key = match key_of(&app, q) {
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

async fn log_request(req: Request, next: Next) -> Response {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return next.run(req).await;
    }
    let (method, uri, started) = (req.method().clone(), req.uri().clone(), Instant::now());
    let resp = next.run(req).await;
    tracing::debug!(%method, %uri, status = resp.status().as_u16(), micros = started.elapsed().as_micros() as u64, "metadata request");
    resp
}

/// The server's routes over `store`.
pub fn router(store: Arc<Store>, limits: Limits) -> Router {
    let body_limit = limits.max_body;
    Router::new()
        .route("/metadata", get(get_key).put(put_key).delete(delete_key))
        .route("/health", get(health))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn(log_request))
        .with_state(App { store, limits, rpc_meta: Arc::default() })
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
    let addr: SocketAddr = listener.local_addr()?;
    tracing::info!(%addr, "metadata server listening");
    let (header_read_timeout, idle_timeout, drain_timeout) =
        (limits.header_read_timeout, limits.idle_timeout, limits.drain_timeout);
    let service = TowerToHyperService::new(router(store, limits));
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
