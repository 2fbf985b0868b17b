//! # ferry-transport-tcp
//!
//! The `tcp` transport, wire-compatible with Mooncake Transfer Engine's TCP data protocol
//! (reference `mooncake-wire.md` §5): a Ferry engine reads and writes Mooncake targets, and
//! Mooncake initiators read and write Ferry targets.
//!
//! - **Target**: listens on `tcp_data_port` of the published host (`tcp_bind_address` chooses
//!   another address), publishes it with `tcp_data_host`, `tcp_proto_version: 2` and
//!   `ferry_tcp_fence: 1`, checks every request against the engine's registered memory before
//!   touching a byte, answers v2 status frames, serves v1 peers too, and bounds what idle,
//!   slow and numerous connections can hold ([`options::MAX_CONNECTIONS_PER_IP`] and
//!   [`options::MAX_CONNECTIONS`], evicting the idlest connection when full, deadlines per
//!   header and per request, a backoff when file descriptors run out).
//! - **Initiator**: `tcp_lanes` persistent connections per peer (default 4; to a peer on this
//!   host, one per two cores, at most 4), requests pipelined on each, payloads moved between
//!   the socket and registered memory without intermediate buffers (payloads up to 64 KiB are
//!   coalesced with their header into one write), a deadline on every request, and a lost
//!   connection failing exactly the requests it carried. Peers
//!   whose descriptor advertises `tcp_proto_version` < 2 (or none) are spoken to in v1. A
//!   connection that failed a WRITE is fenced before anything more goes to a peer that
//!   advertises `ferry_tcp_fence` ([`fence`] module): a request that failed never
//!   lands after a later one succeeded.
//!
//! - **Authentication** (opt-in): with a shared secret configured (`auth_secret_file`,
//!   `FERRY_AUTH_SECRET_FILE`, `FERRY_AUTH_SECRET`), the target publishes `ferry_auth` and every
//!   data connection starts with `ferry-peer-auth`'s mutual proof before any request; peers
//!   without it (Mooncake engines among them) are refused on both sides. Without a secret the
//!   wire is Mooncake's, unchanged.
//!
//! The transport owns its config fields ([`options`]: `tcp_lanes`, `tcp_data_port`,
//! `tcp_io_threads`, `tcp_bind_address`, `tcp_max_connections_per_ip`, `tcp_max_connections`, declared to the engine
//! through [`TcpTransportFactory`], with peer authentication's) and its part of the descriptor
//! ([`TcpEndpoint`], a typed view over the descriptor's flat fields).

mod auth;
mod conns;
mod direct;
mod endpoint;
pub mod fence;
mod initiator;
mod io;
mod memory;
pub mod options;
mod responses;
mod target;
pub mod wire;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{
    Capabilities, Config, Environment, Error, OpenSegment, OptionSpec, OptionValue, PeerHandle, Result,
    SegmentDescriptor, SegmentName, Submission, Transport, TransportContext, TransportFactory,
};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use crate::endpoint::TcpEndpoint;
use crate::initiator::{ConnCounts, ConnectSetup, Peer, PeerAddr};
pub use crate::options::{DEFAULT_LANES, TcpOptions};
use crate::target::TargetLimits;

/// Protocol name.
pub const PROTOCOL: &str = "tcp";
/// Wire protocol version this transport speaks as a target.
pub const PROTO_VERSION: u32 = 2;
/// A peer without requests for this long is forgotten when another one is added.
pub const PEER_IDLE: Duration = Duration::from_secs(300);
/// A target closes a connection that served no request inside registered memory for this long
/// (initiators reconnect transparently).
pub const TARGET_IDLE: Duration = Duration::from_secs(120);
/// Version of Ferry's fence request this transport serves (published as `ferry_tcp_fence`).
pub const FENCE_VERSION: u32 = 1;

/// Factory for the `tcp` transport.
#[derive(Debug, Default, Clone, Copy)]
pub struct TcpTransportFactory;

#[async_trait]
impl TransportFactory for TcpTransportFactory {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    fn options(&self) -> &'static [OptionSpec] {
        options::OPTIONS
    }

    fn read_options(&self, config: &Config, env: &Environment) -> Vec<OptionValue> {
        TcpOptions::values(config, env)
    }

    async fn create(&self, ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
        Ok(Arc::new(TcpTransport::start(ctx).await?))
    }
}

/// The `tcp` transport of one engine.
pub struct TcpTransport {
    host: String,
    port: u16,
    lanes: usize,
    /// Lanes to a peer on this host (see [`TcpOptions::local_lane_count`]).
    local_lanes: usize,
    timeout: Duration,
    auth: auth::DataAuth,
    /// `tcp_local_congestion`, for the connections this engine opens.
    local_congestion: options::LocalCongestion,
    io: IoThreads,
    peers: Mutex<HashMap<PeerAddr, Arc<Peer>>>,
    stop: watch::Sender<bool>,
    server: Mutex<Option<tokio::task::JoinHandle<()>>>,
    stats: Counters,
    /// Every direct connection, cut at shutdown.
    direct: Arc<direct::DirectRegistry>,
}

/// How the initiator's requests went (see [`TcpTransport::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TcpStats {
    /// Requests run to completion on the submitting thread, over a direct connection (no hand-off
    /// to an I/O thread).
    pub direct: u64,
    /// Requests handed to a lane (an I/O thread) to be sent and answered there.
    pub queued: u64,
}

#[derive(Debug, Default)]
struct Counters {
    direct: std::sync::atomic::AtomicU64,
    queued: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport").field("host", &self.host).field("port", &self.port).finish_non_exhaustive()
    }
}

impl TcpTransport {
    /// Binds the data port and starts serving the engine's memory.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](ferry_core::ErrorKind::Config) when an option is invalid
    /// ([`TcpOptions::from_config`], with the process environment) or the port cannot be bound.
    pub async fn start(ctx: &TransportContext) -> Result<Self> {
        let cfg = &ctx.config;
        let options = TcpOptions::from_config(cfg, &Environment::process())?;
        let auth = auth::DataAuth::load(cfg, &Environment::process())?;
        let host =
            SegmentName::parse(&ctx.segment_name).map(SegmentName::into_host).unwrap_or_else(|| "127.0.0.1".to_owned());
        let port = options.port();
        ferry_listener::raise_open_file_limit("tcp transport");
        let listener = listen(&options, &host, port).await?;
        let bound =
            listener.local_addr().map_err(|e| Error::transport("tcp transport: no local address").with_source(e))?;
        let port = bound.port();
        let timeout = cfg.transfer_timeout();
        let limits = Arc::new(TargetLimits {
            idle: TARGET_IDLE,
            header: Duration::from_secs(10).min(timeout),
            io: timeout,
            max_drain: 16 << 20,
            max_connections: options.connections() as usize,
            per_ip: options.connections_per_ip() as usize,
            next_request_poll: ferry_core::batch::spin_before_sleep(),
            local_congestion: options.local_congestion(),
        });
        let (stop, stop_rx) = watch::channel(false);
        let server = ctx.runtime.spawn(target::serve(listener, ctx.memory.clone(), limits, auth.clone(), stop_rx));
        tracing::info!(%host, port, %bound, authentication = auth.scheme().as_deref().unwrap_or("off"), "tcp transport listening");
        let lanes = options.lane_count();
        Ok(Self {
            host,
            port,
            lanes: lanes as usize,
            local_lanes: options.local_lane_count() as usize,
            timeout,
            auth,
            local_congestion: options.local_congestion(),
            io: IoThreads::start(options.io_thread_count(lanes) as usize)?,
            peers: Mutex::new(HashMap::new()),
            stop,
            server: Mutex::new(Some(server)),
            stats: Counters::default(),
            direct: Arc::default(),
        })
    }

    /// How many requests this transport's initiator ran on the submitting thread, and how many
    /// it handed to a lane, since it started.
    pub fn stats(&self) -> TcpStats {
        use std::sync::atomic::Ordering::Relaxed;
        TcpStats { direct: self.stats.direct.load(Relaxed), queued: self.stats.queued.load(Relaxed) }
    }

    /// The data port this transport listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The endpoint this transport publishes.
    pub fn endpoint(&self) -> TcpEndpoint {
        TcpEndpoint {
            host: Some(self.host.clone()),
            port: self.port,
            proto_version: Some(PROTO_VERSION),
            fence: Some(FENCE_VERSION),
            auth: self.auth.scheme(),
        }
    }

    /// The peer `d` describes: its address read from the descriptor, its lanes found or started.
    fn peer_for(&self, d: &SegmentDescriptor) -> Result<Arc<Peer>> {
        let endpoint = TcpEndpoint::from_descriptor(d)?
            .ok_or_else(|| Error::invalid(format!("segment `{}` publishes no tcp_data_port", d.name)))?;
        self.auth.check_peer(&d.name, &endpoint)?;
        let host = endpoint
            .host_for(&d.name)
            .ok_or_else(|| Error::invalid(format!("segment `{}` publishes no tcp_data_host", d.name)))?;
        let addr = PeerAddr { host, port: endpoint.port, v2: endpoint.version() >= 2, fence: endpoint.fences() };
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if !peers.contains_key(&addr) {
            // A new peer: forget the ones nobody used for a while (a peer restarted on another
            // port leaves its old address behind); their lanes end with them.
            peers.retain(|_, p| !p.unused_for(PEER_IDLE));
        }
        // A peer on this host shares this host's cores: fewer lanes (see `local_lane_count`).
        let lanes = if peer_on_this_host(&addr.host, &self.host) { self.local_lanes } else { self.lanes };
        Ok(peers
            .entry(addr.clone())
            .or_insert_with(|| {
                Arc::new(Peer::start(
                    addr,
                    ConnCounts { lanes, direct: self.lanes },
                    &self.io,
                    ConnectSetup { auth: self.auth.secret(), local_congestion: self.local_congestion.clone() },
                    self.stop.subscribe(),
                    self.direct.clone(),
                    self.timeout,
                ))
            })
            .clone())
    }
}

/// The address the data port listens on, and why: `tcp_bind_address` when set, else the
/// published host when it is an IP address, else every address (a name may resolve here to
/// another address than the one peers reach, `/etc/hosts` often maps a host's name to
/// 127.0.1.1).
fn bind_address(options: &TcpOptions, host: &str) -> (IpAddr, &'static str) {
    if let Some(s) = &options.bind_address {
        return (s.value, "tcp_bind_address");
    }
    match host.parse::<IpAddr>() {
        Ok(ip) => (ip, "the segment name's host"),
        Err(_) => (IpAddr::V4(Ipv4Addr::UNSPECIFIED), "every address: the segment name's host is not an IP address"),
    }
}

/// Binds the data port on [`bind_address`]. An address that cannot be bound (one that is not
/// this host's) is an error naming the option, as it is for the P2P handshake listener, which
/// follows the same rule.
async fn listen(options: &TcpOptions, host: &str, port: u16) -> Result<TcpListener> {
    let (ip, why) = bind_address(options, host);
    match TcpListener::bind((ip, port)).await {
        Ok(l) => {
            if ip.is_unspecified() && options.bind_address.is_none() {
                tracing::info!(%host, "tcp transport: listening on every address: {why}");
            }
            Ok(l)
        }
        Err(e) => Err(Error::new(
            ferry_core::ErrorKind::Config,
            format!(
                "tcp transport: cannot listen on {} ({why}); set tcp_bind_address (FERRY_TCP_BIND_ADDRESS) to one \
                 of this host's addresses, or 0.0.0.0 for all",
                std::net::SocketAddr::new(ip, port)
            ),
        )
        .with_source(e)),
    }
}

/// Whether a peer published as `host` is on this host, whose engine publishes `own`
/// ([`io::on_this_host`]). A name is not resolved: it counts as another host (and a loopback
/// peer as this host's even when `own` is a name).
fn peer_on_this_host(host: &str, own: &str) -> bool {
    let own = own.parse::<IpAddr>().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    host.parse::<IpAddr>().is_ok_and(|ip| io::on_this_host(ip, own))
}

/// Threads that run the initiator's lanes, each a single-threaded runtime.
///
/// A lane's writer and reader run on one thread: a request sent from a caller's thread wakes
/// exactly that thread, and its response wakes it again, with no hand-off between runtime
/// workers (on a 2-core VM such hand-offs cost more than a 4 KiB transfer). Several threads let
/// large payloads be copied into sockets in parallel.
pub(crate) struct IoThreads {
    handles: Vec<tokio::runtime::Handle>,
    next: std::sync::atomic::AtomicUsize,
    stop: Vec<tokio::sync::oneshot::Sender<()>>,
}

impl IoThreads {
    fn start(count: usize) -> Result<Self> {
        let mut handles = Vec::with_capacity(count);
        let mut stop = Vec::with_capacity(count);
        for i in 0..count.max(1) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Error::transport("tcp transport: cannot start an I/O thread").with_source(e))?;
            handles.push(rt.handle().clone());
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            stop.push(tx);
            std::thread::Builder::new()
                .name(format!("ferry-tcp-{i}"))
                .spawn(move || {
                    rt.block_on(async {
                        let _ = rx.await;
                    });
                    rt.shutdown_background();
                })
                .map_err(|e| Error::transport("tcp transport: cannot start an I/O thread").with_source(e))?;
        }
        Ok(Self { handles, next: std::sync::atomic::AtomicUsize::new(0), stop })
    }

    /// The runtime of the next thread, round-robin.
    pub(crate) fn next(&self) -> &tokio::runtime::Handle {
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.handles.len();
        &self.handles[i]
    }
}

impl Drop for IoThreads {
    fn drop(&mut self) {
        for tx in self.stop.drain(..) {
            let _ = tx.send(());
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.direct.stop();
        if let Some(h) = self.server.lock().unwrap_or_else(|p| p.into_inner()).take() {
            h.abort();
        }
    }
}

#[async_trait]
impl Transport for TcpTransport {
    fn protocol(&self) -> &str {
        PROTOCOL
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read: true,
            write: true,
            notifications: false,
            host_memory: true,
            device_memory: false,
            cross_process: true,
        }
    }

    fn publish(&self, descriptor: &mut SegmentDescriptor) {
        if let Err(e) = self.endpoint().write_to(descriptor) {
            tracing::error!(error = %e, "tcp transport: its endpoint could not be published");
        }
        descriptor.extra.entry("rdma_server_name").or_insert_with(|| String::new().into());
    }

    async fn open(&self, target: &SegmentDescriptor) -> Result<PeerHandle> {
        Ok(Arc::new(self.peer_for(target)?))
    }

    fn submit(&self, target: &Arc<OpenSegment>, submission: Submission) {
        let peer = match target.peer::<Arc<Peer>>() {
            Ok(p) => p,
            Err(e) => return submission.fail_all(&e),
        };
        let deadline = initiator::deadline(self.timeout);
        // A caller that waits for its one request anyway has it run on its own thread when a
        // direct connection is idle: no hand-off to an I/O thread and back.
        let submission = if submission.caller_waits() && submission.len() == 1 {
            match peer.try_direct(submission, deadline) {
                Ok(()) => {
                    self.stats.direct.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    return;
                }
                Err(s) => s,
            }
        } else {
            submission
        };
        for one in submission.into_each() {
            self.stats.queued.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Err(unsent) = peer.send(one, deadline) {
                unsent.fail_all(&Error::new(ferry_core::ErrorKind::Shutdown, "tcp transport stopped"));
            }
        }
    }

    async fn shutdown(&self) {
        let _ = self.stop.send(true);
        // A caller blocked in a direct request returns at once, with `Shutdown`.
        self.direct.stop();
        let server = self.server.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = server {
            let _ = h.await;
        }
        self.peers.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_port_binds_the_published_host_unless_told_otherwise() {
        let none = TcpOptions::default();
        assert_eq!(bind_address(&none, "10.0.0.5").0, "10.0.0.5".parse::<IpAddr>().unwrap());
        assert_eq!(bind_address(&none, "::1").0, "::1".parse::<IpAddr>().unwrap());
        let (ip, why) = bind_address(&none, "node-7.cluster");
        assert!(ip.is_unspecified() && why.contains("not an IP address"), "{why}");
        let told = TcpOptions {
            bind_address: Some(ferry_core::Setting {
                value: "0.0.0.0".parse().unwrap(),
                source: ferry_core::FieldSource::Env("FERRY_TCP_BIND_ADDRESS"),
            }),
            ..TcpOptions::default()
        };
        assert_eq!(bind_address(&told, "10.0.0.5"), ("0.0.0.0".parse().unwrap(), "tcp_bind_address"));
    }

    #[test]
    fn an_idle_peer_is_prunable_and_a_fresh_one_is_not() {
        let io = IoThreads::start(1).unwrap();
        let addr = PeerAddr { host: "127.0.0.1".into(), port: 1, v2: true, fence: true };
        let (_stop, stop_rx) = tokio::sync::watch::channel(false);
        let peer = Peer::start(
            addr,
            ConnCounts { lanes: 2, direct: 2 },
            &io,
            Default::default(),
            stop_rx,
            Arc::default(),
            Duration::from_secs(1),
        );
        assert!(peer.unused_for(Duration::ZERO), "no load, no use: prunable at once");
        assert!(!peer.unused_for(Duration::from_secs(3600)), "not idle for an hour yet");
    }

    #[test]
    fn a_peer_published_at_a_loopback_address_or_this_engines_own_is_on_this_host() {
        assert!(peer_on_this_host("127.0.0.1", "10.0.0.5"));
        assert!(peer_on_this_host("::1", "node-a"));
        assert!(peer_on_this_host("::ffff:10.0.0.5", "10.0.0.5"));
        assert!(!peer_on_this_host("10.0.0.6", "10.0.0.5"));
        assert!(!peer_on_this_host("localhost", "10.0.0.5"), "names are not resolved");
        assert!(!peer_on_this_host("10.0.0.5", "node-a"));
    }
}
