//! # ferry-metadata-p2p
//!
//! Mooncake's P2P handshake (`metadata_server: "P2PHANDSHAKE"`, reference `mooncake-wire.md`
//! §4) as a [`MetadataBackend`]: no store. The engine listens on an RPC port, its segment name
//! becomes `<host>:<rpc_port>`, and looking up a peer's descriptor means connecting to the peer
//! and exchanging Metadata frames. The same socket carries notifications (Notify frames) and
//! probes, so Mooncake peers can notify Ferry engines and the other way round.
//!
//! Limits: frames above 1 MiB or of length zero are refused, every frame must arrive within the
//! handshake timeout (10 s), and each connection serves one request, so a slow or hostile client
//! holds a single task for at most that long.

#![forbid(unsafe_code)]

pub mod frame;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{
    Config, Error, ErrorKind, HostnameResolver, MetadataBackend, MetadataFactory, MetadataServer, Notification, Result,
};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::frame::{DEFAULT_MAX_FRAME, FrameType, read_frame, write_frame};

/// Time allowed for one handshake exchange (connect, request, reply).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Range a random RPC port is drawn from, as in Mooncake.
pub const RPC_PORT_RANGE: std::ops::Range<u16> = 15000..17000;
/// Handshake connections served at once.
pub const MAX_CONNECTIONS: usize = 1024;
/// Notifications kept before the oldest are dropped (a target that never drains them must not
/// grow without bound).
pub const MAX_PENDING_NOTIFICATIONS: usize = 65536;

/// Factory for the P2P handshake backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct P2pMetadataFactory;

#[async_trait]
impl MetadataFactory for P2pMetadataFactory {
    fn kind(&self) -> &'static str {
        "p2p"
    }

    async fn connect(&self, server: &MetadataServer, config: &Config) -> Result<Arc<dyn MetadataBackend>> {
        debug_assert_eq!(server, &MetadataServer::P2pHandshake);
        Ok(Arc::new(P2pMetadata::start(config).await?))
    }
}

#[derive(Default)]
struct Shared {
    /// What this engine published (its own descriptor, its rpc entry, anything else put).
    local: Mutex<HashMap<String, Vec<u8>>>,
    /// The descriptor served to peers.
    served: Mutex<Option<Vec<u8>>>,
    notifications: Mutex<VecDeque<Notification>>,
}

/// The P2P handshake backend of one engine.
pub struct P2pMetadata {
    host: String,
    port: u16,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
}

impl std::fmt::Debug for P2pMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2pMetadata").field("host", &self.host).field("port", &self.port).finish_non_exhaustive()
    }
}

impl Drop for P2pMetadata {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

fn random_port() -> u16 {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let mix = (u64::from(nanos) ^ u64::from(std::process::id()).rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    RPC_PORT_RANGE.start + (mix >> 40) as u16 % (RPC_PORT_RANGE.end - RPC_PORT_RANGE.start)
}

impl P2pMetadata {
    /// Binds the RPC port (config `rpc_port`, else the port of `local_hostname`, else a free port
    /// in 15000..17000) and starts answering handshakes.
    pub async fn start(config: &Config) -> Result<Self> {
        let configured = config.local_hostname.as_deref().unwrap_or("127.0.0.1");
        let parsed = HostnameResolver::parse(configured);
        let host = parsed.as_ref().and_then(|id| id.host.clone()).unwrap_or_else(|| configured.to_owned());
        let fixed = config.rpc_port.or(parsed.and_then(|id| id.port)).filter(|p| *p != 0);
        let listener = match fixed {
            Some(port) => TcpListener::bind(("0.0.0.0", port)).await.map_err(|e| {
                Error::config(format!("P2P handshake: cannot listen on RPC port {port}")).with_source(e)
            })?,
            None => {
                let mut last = None;
                let mut bound = None;
                for attempt in 0..64u16 {
                    let port = RPC_PORT_RANGE.start
                        + (random_port() - RPC_PORT_RANGE.start + attempt * 31)
                            % (RPC_PORT_RANGE.end - RPC_PORT_RANGE.start);
                    match TcpListener::bind(("0.0.0.0", port)).await {
                        Ok(l) => {
                            bound = Some(l);
                            break;
                        }
                        Err(e) => last = Some(e),
                    }
                }
                bound.ok_or_else(|| {
                    let e = Error::config("P2P handshake: no free RPC port in 15000..17000 after 64 attempts");
                    match last {
                        Some(src) => e.with_source(src),
                        None => e,
                    }
                })?
            }
        };
        let port = listener
            .local_addr()
            .map_err(|e| Error::transport("P2P handshake: no local address").with_source(e))?
            .port();
        let shared = Arc::new(Shared::default());
        let (stop, stop_rx) = watch::channel(false);
        tokio::spawn(serve(listener, shared.clone(), stop_rx));
        tracing::info!(%host, port, "P2P handshake listening");
        Ok(Self { host, port, shared, stop })
    }

    /// The RPC port.
    pub fn rpc_port(&self) -> u16 {
        self.port
    }

    fn peer_of<'a>(&self, key: &'a str) -> Option<&'a str> {
        key.rsplit_once("ram/").map(|(_, name)| name)
    }

    async fn exchange(&self, segment: &str, kind: FrameType, payload: &[u8]) -> Result<Vec<u8>> {
        let id = HostnameResolver::parse(segment)
            .filter(|id| id.port.is_some())
            .ok_or_else(|| Error::invalid(format!("P2P handshake: segment name `{segment}` is not host:port")))?;
        let (host, port) = (id.host.unwrap_or_default(), id.port.unwrap_or_default());
        let talk = async {
            let mut s = TcpStream::connect((host.as_str(), port)).await?;
            s.set_nodelay(true)?;
            write_frame(&mut s, kind, payload).await?;
            let reply = read_frame(&mut s, DEFAULT_MAX_FRAME, HANDSHAKE_TIMEOUT).await?;
            Ok::<_, std::io::Error>(reply)
        };
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, talk).await {
            Ok(Ok(reply)) if reply.kind == kind => Ok(reply.payload),
            Ok(Ok(reply)) => Err(Error::transport(format!(
                "P2P handshake with {host}:{port}: answered a {kind:?} frame with a {:?} frame",
                reply.kind
            ))),
            Ok(Err(e)) => {
                Err(Error::unreachable(format!("P2P handshake with {host}:{port} failed: {e}")).with_source(e))
            }
            Err(_) => {
                Err(Error::timeout(format!("P2P handshake with {host}:{port} did not finish in {HANDSHAKE_TIMEOUT:?}")))
            }
        }
    }
}

#[async_trait]
impl MetadataBackend for P2pMetadata {
    fn name(&self) -> &str {
        "p2p"
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        if let Some(v) = self.shared.local.lock().unwrap_or_else(|p| p.into_inner()).get(key) {
            return Ok(Some(v.clone()));
        }
        if let Some((_, name)) = key.rsplit_once("rpc_meta/") {
            // Derived from the name itself: in P2P mode the name is host:rpc_port.
            return Ok(HostnameResolver::parse(name).and_then(|id| Some((id.host?, id.port?))).map(|(h, p)| {
                serde_json::to_vec(&serde_json::json!({"ip_or_host_name": h, "rpc_port": p})).expect("json")
            }));
        }
        let Some(segment) = self.peer_of(key) else {
            return Ok(None);
        };
        if segment == format!("{}:{}", self.host, self.port) {
            return Ok(None); // our own descriptor, not published (yet, or any more)
        }
        let ours =
            self.shared.served.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_else(|| b"{}".to_vec());
        self.exchange(segment, FrameType::Metadata, &ours).await.map(Some)
    }

    async fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        if key.is_empty() {
            return Err(Error::invalid("metadata key is empty"));
        }
        let own = format!("{}:{}", self.host, self.port);
        if self.peer_of(key) == Some(own.as_str()) {
            *self.shared.served.lock().unwrap_or_else(|p| p.into_inner()) = Some(value.to_vec());
        }
        self.shared.local.lock().unwrap_or_else(|p| p.into_inner()).insert(key.to_owned(), value.to_vec());
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let own = format!("{}:{}", self.host, self.port);
        if self.peer_of(key) == Some(own.as_str()) {
            *self.shared.served.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        self.shared.local.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
        Ok(())
    }

    fn segment_name_hint(&self) -> Option<String> {
        Some(format!("{}:{}", self.host, self.port))
    }

    async fn notify(&self, segment: &str, notification: &Notification) -> Result<()> {
        let body = serde_json::to_vec(notification).expect("json");
        let reply = self.exchange(segment, FrameType::Notify, &body).await?;
        let ok = serde_json::from_slice::<Notification>(&reply).map(|n| n.notify_msg == "success").unwrap_or(false);
        if !ok {
            return Err(Error::new(
                ErrorKind::Transport,
                format!(
                    "P2P handshake: {segment} did not accept the notification (reply {:?})",
                    String::from_utf8_lossy(&reply)
                ),
            ));
        }
        Ok(())
    }

    fn drain_notifications(&self) -> Vec<Notification> {
        self.shared.notifications.lock().unwrap_or_else(|p| p.into_inner()).drain(..).collect()
    }
}

async fn serve(listener: TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut conns = tokio::task::JoinSet::new();
    // At most MAX_CONNECTIONS handshakes at once; more wait in the accept queue.
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = stop.changed() => break,
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => break,
        };
        while conns.try_join_next().is_some() {}
        match accepted {
            Ok((stream, peer)) => {
                let shared = shared.clone();
                conns.spawn(async move {
                    let _permit = permit;
                    if let Err(e) = answer(stream, &shared).await {
                        tracing::debug!(%peer, error = %e, "P2P handshake: connection closed");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "P2P handshake: accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    conns.shutdown().await;
}

async fn answer(mut s: TcpStream, shared: &Shared) -> std::io::Result<()> {
    let work = async {
        let req = read_frame(&mut s, DEFAULT_MAX_FRAME, HANDSHAKE_TIMEOUT).await?;
        match req.kind {
            FrameType::Metadata => {
                let ours = shared.served.lock().unwrap_or_else(|p| p.into_inner()).clone();
                let Some(ours) = ours else {
                    return Err(std::io::Error::other("no descriptor published yet"));
                };
                write_frame(&mut s, FrameType::Metadata, &ours).await?;
            }
            FrameType::Notify => {
                let n: Notification = serde_json::from_slice(&req.payload)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
                {
                    let mut q = shared.notifications.lock().unwrap_or_else(|p| p.into_inner());
                    if q.len() >= MAX_PENDING_NOTIFICATIONS {
                        q.pop_front();
                    }
                    q.push_back(n);
                }
                let ok = Notification { name: String::new(), notify_msg: "success".into() };
                write_frame(&mut s, FrameType::Notify, &serde_json::to_vec(&ok).expect("json")).await?;
            }
            FrameType::Probe => write_frame(&mut s, FrameType::Probe, br#"{"status":"success"}"#).await?,
            FrameType::Connection => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    "RDMA connection frames are not served",
                ));
            }
        }
        s.shutdown().await
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, work)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "handshake not completed in time"))?
}
