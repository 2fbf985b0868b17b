//! # ferry-metadata-p2p
//!
//! Mooncake's P2P handshake (reference `mooncake-wire.md` §4): the listener on an engine's RPC
//! port that answers Metadata frames (its descriptor), Notify frames (notifications) and Probes,
//! so Mooncake peers can notify Ferry engines and the other way round. Two uses:
//!
//! - [`P2pMetadata`], the [`MetadataStore`] for `metadata_server: "P2PHANDSHAKE"`: no store.
//!   The engine's segment name becomes `<host>:<rpc_port>`, and looking up a peer's descriptor
//!   means connecting to the peer and exchanging Metadata frames. It is its own control channel
//!   ([`P2pChannel`]: peers are reached at the port of their names).
//! - [`HandshakeChannel`], the [`ControlChannel`] beside any other store (HTTP, etcd, Redis, or
//!   a third party's), as Mooncake engines on a store run the same listener on their RPC port
//!   (published as `rpc_meta`) and send notifications to the port a peer's `rpc_meta` names.
//!   [`HandshakeChannelFactory`] starts it for every store a
//!   [`MetadataRegistry`](ferry_core::MetadataRegistry) builds (the facade installs it), so
//!   notifications work on every store and with Mooncake peers on any of them.
//!
//! Limits: frames above 1 MiB or of length zero are refused, every frame must arrive within the
//! handshake timeout, and each connection serves one request, so a slow or hostile client holds
//! a single task for at most that long. The handshake timeout is the option
//! `handshake_timeout_ms` ([`HANDSHAKE_TIMEOUT_OPTION`], variable `FERRY_HANDSHAKE_TIMEOUT_MS`,
//! default 10 s), and never longer than the engine's transfer timeout
//! ([`handshake_timeout`]).
//!
//! Authentication (opt-in): with a shared secret configured (`auth_secret_file`,
//! `FERRY_AUTH_SECRET_FILE`, `FERRY_AUTH_SECRET`), every handshake connection, both ways, starts
//! with `ferry-peer-auth`'s mutual proof (see [`auth`]): only peers with the secret fetch this
//! engine's descriptor, notify it or probe it, and Mooncake peers are refused. Without a secret
//! the handshake is Mooncake's, unchanged.

#![forbid(unsafe_code)]

pub mod auth;
pub mod frame;

use std::collections::{HashMap, VecDeque};
use std::ops::RangeInclusive;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::config::check_range;
use ferry_core::{
    Config, ControlChannel, ControlChannelFactory, Environment, Error, ErrorKind, MetadataFactory, MetadataKeys,
    MetadataServer, MetadataStore, Notification, OptionSpec, OptionValue, Result, RpcMeta, SegmentName, Setting,
};
use ferry_listener::{AcceptBackoff, ConnectionSlots};
use ferry_peer_auth::PeerSecret;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::auth::ListenerAuth;
use crate::frame::{DEFAULT_MAX_FRAME, FrameType, read_frame, write_frame};

/// Default time allowed for one handshake exchange (connect, request, reply), and for a peer to
/// send its request to this engine's listener (see [`handshake_timeout`]).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Accepted values of `handshake_timeout_ms` (and `FERRY_HANDSHAKE_TIMEOUT_MS`): 1 ms to 10 min.
pub const HANDSHAKE_TIMEOUT_MS_RANGE: RangeInclusive<u64> = 1..=600_000;

/// The handshake's timeout, declared by both factories of this crate (so a config that sets it
/// is not reported as having an unknown field).
pub const HANDSHAKE_TIMEOUT_OPTION: OptionSpec = OptionSpec {
    key: "handshake_timeout_ms",
    env: Some("FERRY_HANDSHAKE_TIMEOUT_MS"),
    env_invalid: "not a whole number of milliseconds (1 to 600000)",
    default: "10000, or `transfer_timeout_ms` when shorter",
    doc: "time allowed for one exchange with a peer's handshake listener (the P2P handshake's descriptor lookup, a \
          notification, a probe) and for a peer's request to this engine's listener, 1 to 600000 ms. Never longer \
          than `transfer_timeout_ms`: the shorter of the two applies (under `P2PHANDSHAKE` the first transfer to a \
          peer includes fetching its descriptor)",
};

/// The options of this crate's factories: the handshake timeout and peer authentication's
/// `auth_secret` and `auth_secret_file`.
pub const OPTIONS: &[OptionSpec] =
    &[HANDSHAKE_TIMEOUT_OPTION, ferry_peer_auth::options::SECRET, ferry_peer_auth::options::SECRET_FILE];

/// `handshake_timeout_ms` as set (from the API, `FERRY_HANDSHAKE_TIMEOUT_MS` or the config),
/// checked against [`HANDSHAKE_TIMEOUT_MS_RANGE`]; `Ok(None)` when unset.
///
/// # Errors
/// [`ErrorKind::Config`]: a value of the wrong type or out of range, naming the field (its
/// file and position) or the variable, and the range.
pub fn handshake_timeout_setting(config: &Config, env: &Environment) -> Result<Option<Setting<u64>>> {
    let Some(set) = config.option::<u64>(&HANDSHAKE_TIMEOUT_OPTION, env)? else { return Ok(None) };
    check_range(set.value, &HANDSHAKE_TIMEOUT_MS_RANGE, "milliseconds")
        .map_err(|m| config.option_error(&HANDSHAKE_TIMEOUT_OPTION, &set.source, &m))?;
    Ok(Some(set))
}

/// The timeout of every handshake exchange of an engine configured by `config`: its
/// `handshake_timeout_ms` ([`HANDSHAKE_TIMEOUT`] when unset), or its transfer timeout when that
/// is shorter (a handshake is part of the first transfer to a peer under `P2PHANDSHAKE`, and
/// must not outlast it).
///
/// # Errors
/// As [`handshake_timeout_setting`].
pub fn handshake_timeout(config: &Config, env: &Environment) -> Result<Duration> {
    let set = handshake_timeout_setting(config, env)?.map_or(HANDSHAKE_TIMEOUT, |s| Duration::from_millis(s.value));
    Ok(set.min(config.transfer_timeout()))
}

fn read_options(config: &Config, env: &Environment) -> Vec<OptionValue> {
    let mut values = vec![OptionValue::new(&HANDSHAKE_TIMEOUT_OPTION, handshake_timeout_setting(config, env))];
    values.extend(ferry_peer_auth::options::values(config, env));
    values
}

/// Range a random RPC port is drawn from, as in Mooncake.
pub const RPC_PORT_RANGE: std::ops::Range<u16> = 15000..17000;
/// Handshake connections served at once; a new one beyond it closes the oldest.
pub const MAX_CONNECTIONS: usize = 1024;
/// Handshake connections served at once from one remote IP address; a new one beyond it closes
/// the oldest of that address. A handshake takes one round trip, so even a node of many ranks
/// handshaking at once stays far below it, while a flood of idle connections from one address
/// holds no more than this many descriptors.
pub const MAX_CONNECTIONS_PER_IP: usize = 64;
/// Notifications kept before the oldest are dropped (a target that never drains them must not
/// grow without bound).
pub const MAX_PENDING_NOTIFICATIONS: usize = 65536;
/// Bytes of notifications (sender names and messages) kept before the oldest are dropped: a
/// frame may carry up to 1 MiB, so the count alone would let peers pin 64 GiB.
pub const MAX_PENDING_NOTIFICATION_BYTES: usize = 64 << 20;

/// Received notifications not drained yet, bounded by count and by bytes.
#[derive(Default)]
struct PendingNotifications {
    queue: VecDeque<Notification>,
    bytes: usize,
}

impl PendingNotifications {
    fn size(n: &Notification) -> usize {
        n.name.len() + n.notify_msg.len()
    }

    /// Keeps `n`, dropping the oldest while either bound would be exceeded. A notification
    /// larger than the byte bound on its own is dropped (and logged).
    fn push(&mut self, n: Notification) {
        let size = Self::size(&n);
        if size > MAX_PENDING_NOTIFICATION_BYTES {
            tracing::warn!(from = %n.name, bytes = size, "notification larger than the pending limit dropped");
            return;
        }
        while self.queue.len() >= MAX_PENDING_NOTIFICATIONS || self.bytes + size > MAX_PENDING_NOTIFICATION_BYTES {
            let Some(old) = self.queue.pop_front() else { break };
            self.bytes -= Self::size(&old);
        }
        self.bytes += size;
        self.queue.push_back(n);
    }

    fn drain(&mut self) -> Vec<Notification> {
        self.bytes = 0;
        self.queue.drain(..).collect()
    }
}

/// Factory for the P2P handshake store (which is its own control channel).
#[derive(Debug, Default, Clone, Copy)]
pub struct P2pMetadataFactory;

#[async_trait]
impl MetadataFactory for P2pMetadataFactory {
    fn kind(&self) -> &'static str {
        "p2p"
    }

    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn read_options(&self, config: &Config, env: &Environment) -> Vec<OptionValue> {
        read_options(config, env)
    }

    async fn connect(&self, server: &MetadataServer, config: &Config) -> Result<Arc<dyn MetadataStore>> {
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
    notifications: Mutex<PendingNotifications>,
}

/// Mooncake's handshake listener on an engine's RPC port: answers Metadata frames with the
/// engine's descriptor, takes in notifications, answers probes. Stops when dropped.
pub struct HandshakeListener {
    host: String,
    port: u16,
    /// The handshake timeout ([`handshake_timeout`]): of this listener's exchanges with peers,
    /// and of their requests to it.
    timeout: Duration,
    shared: Arc<Shared>,
    auth: ListenerAuth,
    stop: watch::Sender<bool>,
    /// The accept loop (it owns the listening socket).
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for HandshakeListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandshakeListener").field("host", &self.host).field("port", &self.port).finish_non_exhaustive()
    }
}

impl Drop for HandshakeListener {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// The P2P handshake store of one engine: what it published is kept locally and served to
/// peers by its listener; a peer's descriptor is asked of that peer. Its control channel is
/// [`P2pChannel`], on the same listener.
#[derive(Debug)]
pub struct P2pMetadata {
    channel: Arc<P2pChannel>,
}

/// The control channel of a P2P handshake engine: its listener, and peers reached at the
/// `host:port` of their segment names. Stops listening when the last handle drops, or at
/// [`close`](ControlChannel::close).
#[derive(Debug)]
pub struct P2pChannel {
    listener: HandshakeListener,
}

fn random_port() -> u16 {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let mix = (u64::from(nanos) ^ u64::from(std::process::id()).rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    RPC_PORT_RANGE.start + (mix >> 40) as u16 % (RPC_PORT_RANGE.end - RPC_PORT_RANGE.start)
}

/// Where a handshake listener's port comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RpcPortChoice {
    /// Config `rpc_port`, else (with `base_port`) the port the rank's name was given, else a
    /// free port: the P2P handshake, where the name becomes `host:rpc_port`. A port in
    /// `local_hostname` itself is ignored, as Mooncake ignores it under `P2PHANDSHAKE` (several
    /// processes of one host may pass the same `local_hostname`).
    NameOrFree,
    /// Config `rpc_port`, else a free port (published in the rpc entry): beside a store, as a
    /// Mooncake engine on a store does; the port in its name is not the RPC port.
    ConfiguredOrFree,
}

impl HandshakeListener {
    /// Binds the RPC port `choice` says and starts answering handshakes. A free port is drawn
    /// from 15000..17000; a configured one that cannot be bound is an error naming it. With a
    /// peer authentication secret configured, every connection must prove it knows it.
    pub async fn start(config: &Config, choice: RpcPortChoice) -> Result<Self> {
        let timeout = handshake_timeout(config, &Environment::process())?;
        let auth = ListenerAuth::load(config, &Environment::process())?;
        ferry_listener::raise_open_file_limit("P2P handshake");
        let configured = config
            .local_segment_name()
            .ok()
            .flatten()
            .or_else(|| config.local_hostname.clone())
            .unwrap_or_else(|| "127.0.0.1".to_owned());
        let parsed = SegmentName::parse(&configured);
        let host = parsed.as_ref().map(|n| n.host().to_owned()).unwrap_or_else(|| configured.clone());
        let from_name = match choice {
            RpcPortChoice::NameOrFree if config.base_port.is_some() => parsed.map(|n| n.port()),
            RpcPortChoice::NameOrFree | RpcPortChoice::ConfiguredOrFree => None,
        };
        let fixed = config.rpc_port.or(from_name).filter(|p| *p != 0);
        // The address peers are told (the name's host) when it is a literal IP, else every
        // address: a listener on every address would also hold the port on addresses that other
        // services of this host own.
        let bind_ip: std::net::IpAddr = host.parse().unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        let listener = match fixed {
            Some(port) => TcpListener::bind((bind_ip, port)).await.map_err(|e| {
                Error::config(format!("P2P handshake: cannot listen on RPC port {port} of {bind_ip}")).with_source(e)
            })?,
            None => {
                let mut last = None;
                let mut bound = None;
                for attempt in 0..64u16 {
                    let port = RPC_PORT_RANGE.start
                        + (random_port() - RPC_PORT_RANGE.start + attempt * 31)
                            % (RPC_PORT_RANGE.end - RPC_PORT_RANGE.start);
                    match TcpListener::bind((bind_ip, port)).await {
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
        let task = Mutex::new(Some(tokio::spawn(serve(listener, shared.clone(), auth.clone(), stop_rx, timeout))));
        let authentication = if auth.secret().is_some() { ferry_peer_auth::SCHEME } else { "off" };
        tracing::info!(%host, port, ?timeout, authentication, "P2P handshake listening");
        Ok(Self { host, port, timeout, shared, auth, stop, task })
    }

    /// Stops answering and closes the listening socket; returns when the port is free (or after
    /// the handshake timeout, should the accept loop not finish).
    pub async fn close(&self) {
        let _ = self.stop.send(true);
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(task) = task
            && tokio::time::timeout(self.timeout, task).await.is_err()
        {
            tracing::warn!(port = self.port, "P2P handshake listener did not stop in time");
        }
    }

    /// The RPC port.
    pub fn rpc_port(&self) -> u16 {
        self.port
    }

    /// The handshake timeout this listener's engine uses ([`handshake_timeout`]).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The secret this engine proves with on the handshakes it starts (`None`: authentication
    /// off).
    pub fn secret(&self) -> Option<&PeerSecret> {
        self.auth.secret()
    }

    /// Sets the descriptor answered to Metadata frames (`None`: refuse them).
    fn serve_descriptor(&self, descriptor: Option<Vec<u8>>) {
        *self.shared.served.lock().unwrap_or_else(|p| p.into_inner()) = descriptor;
    }

    /// Takes the notifications received so far (oldest first).
    pub fn drain_notifications(&self) -> Vec<Notification> {
        self.shared.notifications.lock().unwrap_or_else(|p| p.into_inner()).drain()
    }
}

/// Sends `notification` to the handshake listener at `host:port` and checks it was accepted,
/// within `timeout`, proving `auth` first when set.
pub async fn send_notification(
    host: &str,
    port: u16,
    notification: &Notification,
    timeout: Duration,
    auth: Option<&PeerSecret>,
) -> Result<()> {
    let body = serde_json::to_vec(notification).expect("json");
    let reply = exchange(host, port, FrameType::Notify, &body, timeout, auth).await?;
    let ok = serde_json::from_slice::<Notification>(&reply).map(|n| n.notify_msg == "success").unwrap_or(false);
    if !ok {
        return Err(Error::new(
            ErrorKind::Transport,
            format!(
                "handshake listener {host}:{port} did not accept the notification (reply {:?})",
                String::from_utf8_lossy(&reply)
            ),
        ));
    }
    Ok(())
}

/// Sends a Probe to the handshake listener at `host:port` and checks it answered
/// `{"status": "success"}` (Mooncake's `send_probe`), within `timeout`, proving `auth` first when
/// set.
pub async fn send_probe(host: &str, port: u16, timeout: Duration, auth: Option<&PeerSecret>) -> Result<()> {
    let reply = exchange(host, port, FrameType::Probe, b"{}", timeout, auth).await?;
    let ok = serde_json::from_slice::<serde_json::Value>(&reply)
        .map(|v| v.get("status").and_then(|s| s.as_str()) == Some("success"))
        .unwrap_or(false);
    if !ok {
        return Err(Error::transport(format!(
            "handshake listener {host}:{port} answered the probe with {:?}",
            String::from_utf8_lossy(&reply)
        )));
    }
    Ok(())
}

/// One request/reply exchange with the handshake listener at `host:port`, after proving `auth`
/// when set, all within `timeout`.
async fn exchange(
    host: &str,
    port: u16,
    kind: FrameType,
    payload: &[u8],
    timeout: Duration,
    auth: Option<&PeerSecret>,
) -> Result<Vec<u8>> {
    let deadline = tokio::time::Instant::now() + timeout;
    let timed_out = || {
        Error::timeout(format!(
            "P2P handshake with {host}:{port} did not finish in {timeout:?} (handshake_timeout_ms, at most \
             transfer_timeout_ms)"
        ))
    };
    // The reply's own deadline (the same timeout) may fire first: a timeout either way.
    let failed = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::TimedOut {
            timed_out()
        } else {
            Error::unreachable(format!("P2P handshake with {host}:{port} failed: {e}")).with_source(e)
        }
    };
    let talk = async {
        let mut s = TcpStream::connect((host, port)).await.map_err(failed)?;
        s.set_nodelay(true).map_err(failed)?;
        auth::prove(&mut s, auth, host, port, deadline).await?;
        write_frame(&mut s, kind, payload).await.map_err(failed)?;
        read_frame(&mut s, DEFAULT_MAX_FRAME, timeout).await.map_err(failed)
    };
    match tokio::time::timeout_at(deadline, talk).await {
        Ok(Ok(reply))
            if auth.is_none()
                && let Some(e) = auth::required_by(&reply.payload, host, port) =>
        {
            Err(e)
        }
        Ok(Ok(reply)) if reply.kind == kind => Ok(reply.payload),
        Ok(Ok(reply)) => Err(Error::transport(format!(
            "P2P handshake with {host}:{port}: answered a {kind:?} frame with a {:?} frame",
            reply.kind
        ))),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(timed_out()),
    }
}

impl P2pMetadata {
    /// Binds the RPC port (config `rpc_port`, else with `base_port` the rank's port, else a free
    /// port in 15000..17000, as Mooncake picks one: a port in `local_hostname` is ignored) and
    /// starts answering handshakes.
    pub async fn start(config: &Config) -> Result<Self> {
        let listener = HandshakeListener::start(config, RpcPortChoice::NameOrFree).await?;
        Ok(Self { channel: Arc::new(P2pChannel { listener }) })
    }

    /// The RPC port.
    pub fn rpc_port(&self) -> u16 {
        self.channel.listener.port
    }

    /// The segment name of the engine on this store: `<host>:<rpc_port>`.
    pub fn segment_name(&self) -> String {
        self.channel.own_name()
    }

    fn peer_of<'a>(&self, key: &'a str) -> Option<&'a str> {
        key.rsplit_once("ram/").map(|(_, name)| name)
    }

    async fn exchange(&self, segment: &str, kind: FrameType, payload: &[u8]) -> Result<Vec<u8>> {
        let (host, port) = host_port(segment)?;
        exchange(&host, port, kind, payload, self.channel.listener.timeout, self.channel.listener.secret()).await
    }
}

impl P2pChannel {
    fn own_name(&self) -> String {
        format!("{}:{}", self.listener.host, self.listener.port)
    }
}

/// `host:port` of a P2P segment name.
fn host_port(segment: &str) -> Result<(String, u16)> {
    SegmentName::parse(segment)
        .map(|n| (n.host().to_owned(), n.port()))
        .ok_or_else(|| Error::invalid(format!("P2P handshake: segment name `{segment}` is not host:port")))
}

#[async_trait]
impl MetadataStore for P2pMetadata {
    fn name(&self) -> &str {
        "p2p"
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let listener = &self.channel.listener;
        if let Some(v) = listener.shared.local.lock().unwrap_or_else(|p| p.into_inner()).get(key) {
            return Ok(Some(v.clone()));
        }
        if let Some((_, name)) = key.rsplit_once("rpc_meta/") {
            // Derived from the name itself: in P2P mode the name is host:rpc_port.
            return Ok(SegmentName::parse(name).map(|n| {
                serde_json::to_vec(&serde_json::json!({"ip_or_host_name": n.host(), "rpc_port": n.port()}))
                    .expect("json")
            }));
        }
        let Some(segment) = self.peer_of(key) else {
            return Ok(None);
        };
        if segment == self.segment_name() {
            return Ok(None); // our own descriptor, not published (yet, or any more)
        }
        let ours =
            listener.shared.served.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_else(|| b"{}".to_vec());
        self.exchange(segment, FrameType::Metadata, &ours).await.map(Some)
    }

    async fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        if key.is_empty() {
            return Err(Error::invalid("metadata key is empty"));
        }
        let listener = &self.channel.listener;
        // Publishing its own descriptor is what makes the listener serve it to peers.
        if self.peer_of(key) == Some(self.segment_name().as_str()) {
            listener.serve_descriptor(Some(value.to_vec()));
        }
        listener.shared.local.lock().unwrap_or_else(|p| p.into_inner()).insert(key.to_owned(), value.to_vec());
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let listener = &self.channel.listener;
        if self.peer_of(key) == Some(self.segment_name().as_str()) {
            listener.serve_descriptor(None);
        }
        listener.shared.local.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
        Ok(())
    }

    fn control_channel(&self) -> Option<Arc<dyn ControlChannel>> {
        Some(self.channel.clone())
    }
}

#[async_trait]
impl ControlChannel for P2pChannel {
    fn name(&self) -> &str {
        "p2p handshake"
    }

    fn segment_name_hint(&self) -> Option<String> {
        Some(self.own_name())
    }

    fn rpc_port(&self) -> Option<u16> {
        Some(self.listener.port)
    }

    fn descriptor_published(&self, descriptor: Option<&[u8]>) {
        self.listener.serve_descriptor(descriptor.map(<[u8]>::to_vec));
    }

    async fn notify(&self, segment: &str, notification: &Notification) -> Result<()> {
        let (host, port) = host_port(segment)?;
        send_notification(&host, port, notification, self.listener.timeout, self.listener.secret()).await
    }

    async fn probe(&self, segment: &str) -> Result<()> {
        let (host, port) = host_port(segment)?;
        send_probe(&host, port, self.listener.timeout, self.listener.secret()).await
    }

    fn drain_notifications(&self) -> Vec<Notification> {
        self.listener.drain_notifications()
    }

    async fn close(&self) {
        self.listener.close().await;
    }
}

/// Mooncake's handshake listener beside a store that is not a channel itself (HTTP, etcd,
/// Redis, a third party's), as a Mooncake engine on a store runs one: the listener on the
/// engine's RPC port takes in notifications and answers probes, and
/// [`notify`](ControlChannel::notify) and [`probe`](ControlChannel::probe) reach the listener a
/// peer's `rpc_meta` entry (read from the store) names. The store knows nothing of it.
pub struct HandshakeChannel {
    store: Arc<dyn MetadataStore>,
    keys: MetadataKeys,
    listener: HandshakeListener,
}

impl std::fmt::Debug for HandshakeChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandshakeChannel").field("store", &self.store.name()).field("listener", &self.listener).finish()
    }
}

impl HandshakeChannel {
    /// Starts the handshake listener for an engine configured by `config` beside `store`. Its
    /// RPC port is the config's `rpc_port`, else a free port in 15000..17000 (as a Mooncake
    /// engine on a store picks one; the engine publishes it in its rpc entry). A configured port
    /// that cannot be bound is an error naming it.
    pub async fn start(store: Arc<dyn MetadataStore>, config: &Config) -> Result<Self> {
        let listener = HandshakeListener::start(config, RpcPortChoice::ConfiguredOrFree).await.map_err(|e| {
            let msg = format!("{} (the RPC port where peers send this engine's notifications)", e.message());
            e.context(msg)
        })?;
        Ok(Self { store, keys: MetadataKeys::new(config.cluster_id()), listener })
    }
}

/// Time a live-owner check waits for the listener of an rpc entry about to be replaced. A
/// listener that does not answer in this time is taken for a dead engine's.
pub const OWNER_PROBE_TIMEOUT: Duration = Duration::from_secs(3);

impl HandshakeChannel {
    /// The handshake listener `segment`'s rpc entry names (`what`: for the error text).
    async fn listener_of(&self, segment: &str, what: &str) -> Result<RpcMeta> {
        let key = self.keys.rpc(segment);
        let entry = self.store.get(&key).await?.ok_or_else(|| {
            Error::not_found(format!(
                "segment `{segment}` has no rpc entry in the {} metadata (key {key}): nowhere to {what}",
                self.store.name()
            ))
        })?;
        let rpc: RpcMeta = serde_json::from_slice(&entry).map_err(|e| {
            Error::invalid(format!("the rpc entry of `{segment}` (key {key}) is not valid: {e}")).with_source(e)
        })?;
        if rpc.rpc_port == 0 || rpc.ip_or_host_name.is_empty() {
            return Err(Error::invalid(format!(
                "the rpc entry of `{segment}` (key {key}) names no listener: {:?}:{}",
                rpc.ip_or_host_name, rpc.rpc_port
            )));
        }
        Ok(rpc)
    }
}

#[async_trait]
impl ControlChannel for HandshakeChannel {
    fn name(&self) -> &str {
        "handshake listener"
    }

    fn rpc_port(&self) -> Option<u16> {
        Some(self.listener.port)
    }

    /// If another value is stored under `key` and the listener it names answers a probe, a
    /// live engine (Ferry or Mooncake) already uses this segment name, and taking it over would
    /// cut that engine off: refused with [`ErrorKind::AlreadyExists`]. An entry whose listener
    /// does not answer is a dead engine's (a crash leaves it behind) and may be replaced.
    async fn claim_rpc_entry(&self, key: &str, entry: &[u8]) -> Result<()> {
        let Some(stored) = self.store.get(key).await? else { return Ok(()) };
        if stored == entry {
            return Ok(());
        }
        let Ok(rpc) = serde_json::from_slice::<RpcMeta>(&stored) else { return Ok(()) };
        if rpc.rpc_port == 0 || rpc.ip_or_host_name.is_empty() {
            return Ok(());
        }
        let probe = send_probe(&rpc.ip_or_host_name, rpc.rpc_port, self.listener.timeout, self.listener.secret());
        let probe = tokio::time::timeout(OWNER_PROBE_TIMEOUT, probe).await;
        // A listener that refused this engine's authentication (or asked for it) answered all
        // the same: it is alive.
        if matches!(&probe, Ok(Ok(()))) || matches!(&probe, Ok(Err(e)) if e.kind() == ErrorKind::Config) {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!(
                    "segment name in use: the {} metadata's rpc entry {key} names a live engine (its handshake \
                     listener at {}:{} answered a probe). Give this engine another local_hostname (host:port), or \
                     stop the other one first",
                    self.store.name(),
                    rpc.ip_or_host_name,
                    rpc.rpc_port
                ),
            ));
        }
        tracing::info!(key, stale = %String::from_utf8_lossy(&stored), "replacing the rpc entry of an engine that no longer answers");
        Ok(())
    }

    /// The listener answers Metadata frames with what the engine published.
    fn descriptor_published(&self, descriptor: Option<&[u8]>) {
        self.listener.serve_descriptor(descriptor.map(<[u8]>::to_vec));
    }

    async fn notify(&self, segment: &str, notification: &Notification) -> Result<()> {
        let rpc = self.listener_of(segment, "send a notification").await?;
        send_notification(
            &rpc.ip_or_host_name,
            rpc.rpc_port,
            notification,
            self.listener.timeout,
            self.listener.secret(),
        )
        .await
    }

    async fn probe(&self, segment: &str) -> Result<()> {
        let rpc = self.listener_of(segment, "send a probe").await?;
        send_probe(&rpc.ip_or_host_name, rpc.rpc_port, self.listener.timeout, self.listener.secret()).await
    }

    fn drain_notifications(&self) -> Vec<Notification> {
        self.listener.drain_notifications()
    }

    async fn close(&self) {
        self.listener.close().await;
    }
}

/// Starts a [`HandshakeChannel`] beside every store a
/// [`MetadataRegistry`](ferry_core::MetadataRegistry) builds that is not a channel itself
/// (install it with [`MetadataRegistry::install_channel`](ferry_core::MetadataRegistry::install_channel)).
#[derive(Debug, Default, Clone, Copy)]
pub struct HandshakeChannelFactory;

#[async_trait]
impl ControlChannelFactory for HandshakeChannelFactory {
    fn name(&self) -> &'static str {
        "handshake listener"
    }

    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn read_options(&self, config: &Config, env: &Environment) -> Vec<OptionValue> {
        read_options(config, env)
    }

    async fn start(&self, store: Arc<dyn MetadataStore>, config: &Config) -> Result<Arc<dyn ControlChannel>> {
        Ok(Arc::new(HandshakeChannel::start(store, config).await?))
    }
}

async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    auth: ListenerAuth,
    mut stop: watch::Receiver<bool>,
    timeout: Duration,
) {
    let mut conns = tokio::task::JoinSet::new();
    // A new connection over either limit closes the oldest (of its address, or of all) instead
    // of waiting behind it: idle connections cannot keep a real peer's handshake queued.
    let slots = ConnectionSlots::new(MAX_CONNECTIONS_PER_IP, MAX_CONNECTIONS, "P2P handshake");
    let mut backoff = AcceptBackoff::new("P2P handshake");
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => break,
        };
        while conns.try_join_next().is_some() {}
        match accepted {
            Ok((mut stream, peer)) => {
                backoff.accepted();
                let shared = shared.clone();
                let auth = auth.clone();
                let mut slot = slots.admit(peer);
                conns.spawn(async move {
                    let work = async {
                        if !auth.admit(&mut stream, peer, timeout).await {
                            return;
                        }
                        if let Err(e) = answer(stream, &shared, timeout).await {
                            tracing::debug!(%peer, error = %e, "P2P handshake: connection closed");
                        }
                    };
                    tokio::select! {
                        () = work => {}
                        () = slot.closed() => tracing::trace!(%peer, "P2P handshake: closed for a newer connection"),
                    }
                });
            }
            Err(e) => {
                // Out of descriptors the pending connection stays queued and every retry fails
                // until one is freed: back off, one warning per period.
                let backoff = backoff.failed(&e);
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = stop.changed() => break,
                }
            }
        }
    }
    conns.shutdown().await;
}

async fn answer(mut s: TcpStream, shared: &Shared, timeout: Duration) -> std::io::Result<()> {
    let work = async {
        let req = read_frame(&mut s, DEFAULT_MAX_FRAME, timeout).await?;
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
                shared.notifications.lock().unwrap_or_else(|p| p.into_inner()).push(n);
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
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "handshake not completed in time"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(i: usize, len: usize) -> Notification {
        Notification { name: format!("p{i}"), notify_msg: "x".repeat(len) }
    }

    #[test]
    fn pending_notifications_are_bounded_by_count_and_by_bytes() {
        let mut p = PendingNotifications::default();
        // By bytes: 1 MiB messages, 64 MiB bound: the oldest go first.
        for i in 0..100 {
            p.push(note(i, 1 << 20));
            assert!(p.bytes <= MAX_PENDING_NOTIFICATION_BYTES);
        }
        let kept = p.drain();
        assert!(kept.len() < 64 && kept.len() > 60, "{}", kept.len());
        assert_eq!(kept.last().unwrap().name, "p99", "the newest are kept");
        assert_eq!(p.bytes, 0);
        // By count.
        for i in 0..MAX_PENDING_NOTIFICATIONS + 10 {
            p.push(note(i, 1));
        }
        let kept = p.drain();
        assert_eq!(kept.len(), MAX_PENDING_NOTIFICATIONS);
        assert_eq!(kept[0].name, "p10");
        // One too large on its own is not kept, and evicts nothing.
        p.push(note(0, 10));
        p.push(note(1, MAX_PENDING_NOTIFICATION_BYTES + 1));
        assert_eq!(p.drain().len(), 1);
    }

    #[test]
    fn the_handshake_timeout_is_its_option_capped_by_the_transfer_timeout() {
        let env =
            |pairs: &[(&str, &str)]| Environment::from_pairs(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let c = |text: &str| Config::from_json_str(text, Some(std::path::Path::new("/m.json"))).unwrap();
        assert_eq!(handshake_timeout(&c("{}"), &env(&[])).unwrap(), HANDSHAKE_TIMEOUT);
        assert_eq!(
            handshake_timeout(&c(r#"{"transfer_timeout_ms": 250}"#), &env(&[])).unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(
            handshake_timeout(&c(r#"{"handshake_timeout_ms": 2000}"#), &env(&[])).unwrap(),
            Duration::from_secs(2)
        );
        let both = c(r#"{"handshake_timeout_ms": 2000, "transfer_timeout_ms": 900}"#);
        assert_eq!(handshake_timeout(&both, &env(&[])).unwrap(), Duration::from_millis(900), "the shorter");
        let v = env(&[("FERRY_HANDSHAKE_TIMEOUT_MS", "700")]);
        assert_eq!(handshake_timeout(&c(r#"{"handshake_timeout_ms": 2000}"#), &v).unwrap(), Duration::from_millis(700));
        let e = handshake_timeout(&c("{\n  \"handshake_timeout_ms\": 0\n}"), &env(&[])).unwrap_err();
        assert_eq!(
            e.message(),
            "config /m.json: field `handshake_timeout_ms` at line 2 column 3: is 0; expected 1 to 600000 milliseconds"
        );
        let e = handshake_timeout(&c("{}"), &env(&[("FERRY_HANDSHAKE_TIMEOUT_MS", "soon")])).unwrap_err();
        assert!(e.message().contains("FERRY_HANDSHAKE_TIMEOUT_MS=\"soon\": not a whole number of milliseconds"), "{e}");
        let e = handshake_timeout(&c("{}"), &env(&[("FERRY_HANDSHAKE_TIMEOUT_MS", "600001")])).unwrap_err();
        assert!(e.message().contains("(from environment variable FERRY_HANDSHAKE_TIMEOUT_MS): is 600001"), "{e}");
    }
}
