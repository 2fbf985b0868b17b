//! The control listener: peers ask it to join communicators and, on the two-sided path, to
//! send or receive. Every address is checked against the live memory registry (and leased for
//! the duration) before the device touches it.
//!
//! Nothing read here is trusted. A request names its sender (`from`, a segment name
//! `host:port[...]`); it is only taken from that host: the connection must come from an address
//! of the named host (and, for `InitOneSided`, of the `host_ip` it publishes), and from the
//! `rank_info.hostIp` of the peer's descriptor when this side has it. This holds off forged
//! names from other hosts (which could otherwise tear down a real peer's communicator); it is
//! not authentication against a process on the same host, which the channel does not attempt
//! (it has no secret to check). New peers are limited to `MAX_PEERS`, and epochs are checked
//! (`Peer::answer_init`).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use ferry_ascend_runtime::{Communicator, RootInfo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::identity::PairTable;
use crate::peer::{Peer, SideOp, run_side};
use crate::wire::{self, MAX_OPS_PER_REQUEST, Reply, Request};
use crate::{Shared, run_on};

/// A control connection idle this long is closed (the initiator reconnects).
const IDLE: Duration = Duration::from_secs(300);
/// Connections served at once.
const MAX_CONNECTIONS: usize = 1024;
/// Senders one connection remembers as proven.
const PROVEN_PER_CONNECTION: usize = 16;
/// How long resolving a peer's host name (to check where its request comes from) may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);
/// How much longer than its own stream wait the target's half of a transfer may take before
/// the initiator is told it failed (the device thread keeps the memory leased until its work
/// has drained).
const TRANSFER_GRACE: Duration = Duration::from_secs(2);

/// Accepts control connections until `stop` turns true.
pub(crate) async fn serve(listener: TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut conns = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => break,
        };
        while conns.try_join_next().is_some() {}
        match accepted {
            Ok((stream, peer)) if conns.len() < MAX_CONNECTIONS => {
                let shared = shared.clone();
                conns.spawn(async move {
                    if let Err(e) = serve_connection(stream, peer, &shared).await {
                        tracing::debug!(%peer, error = %e, "ascend control connection closed");
                    }
                });
            }
            Ok((_, peer)) => tracing::warn!(%peer, "ascend control: too many connections; refused"),
            Err(e) => {
                tracing::warn!(error = %e, "ascend control: accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    conns.shutdown().await;
}

async fn serve_connection(mut stream: TcpStream, remote: SocketAddr, shared: &Arc<Shared>) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let remote = remote.ip().to_canonical();
    // Senders this connection already proved (checking a host name costs a DNS lookup).
    let mut proven: HashMap<String, Arc<Peer>> = HashMap::new();
    loop {
        let Some(req) = wire::read_frame::<_, Request>(&mut stream, IDLE).await? else { return Ok(()) };
        match req {
            Request::InitOneSided { from, instance, host_ip, host_port, epoch, rank_table, your_rank, buffers } => {
                // Always checked in full: it carries a host IP too, and is rare.
                let reply = match sender(shared, remote, &from, Some(&host_ip)).await {
                    Ok(peer) => {
                        let ask =
                            InitAsk { instance: instance.as_deref(), host_ip: &host_ip, host_port, epoch, buffers };
                        init_one_sided(shared, &peer, ask, rank_table, your_rank).await
                    }
                    Err(why) => error(why),
                };
                wire::write_frame(&mut stream, &reply).await?;
            }
            Request::InitTwoSided { from, epoch, root_info } => {
                let reply = match proven_sender(&mut proven, shared, remote, &from).await {
                    Ok(peer) => init_two_sided(&peer, epoch, &root_info).await,
                    Err(why) => error(why),
                };
                wire::write_frame(&mut stream, &reply).await?;
            }
            Request::Transfer { from, epoch, ops } => match proven_sender(&mut proven, shared, remote, &from).await {
                Ok(peer) => transfer(&mut stream, shared, &peer, epoch, ops).await?,
                Err(why) => wire::write_frame(&mut stream, &error(why)).await?,
            },
        }
    }
}

/// [`sender`], remembered for the connection (up to [`PROVEN_PER_CONNECTION`] names).
async fn proven_sender(
    proven: &mut HashMap<String, Arc<Peer>>,
    shared: &Arc<Shared>,
    remote: IpAddr,
    from: &str,
) -> std::result::Result<Arc<Peer>, String> {
    if let Some(p) = proven.get(from) {
        return Ok(p.clone());
    }
    let p = sender(shared, remote, from, None).await?;
    if proven.len() < PROVEN_PER_CONNECTION {
        proven.insert(from.to_owned(), p.clone());
    }
    Ok(p)
}

fn error(message: impl Into<String>) -> Reply {
    Reply::Error { message: message.into() }
}

/// Whether `host` (an IP or a name) is `remote`: the same address, or a name resolving to it.
/// Loopback addresses are all one host.
async fn is_host_of(host: &str, remote: IpAddr) -> bool {
    let same = |ip: IpAddr| {
        let ip = ip.to_canonical();
        ip == remote || (ip.is_loopback() && remote.is_loopback())
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        return same(ip);
    }
    match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, 0))).await {
        Ok(Ok(mut addrs)) => addrs.any(|a| same(a.ip())),
        _ => false,
    }
}

/// The peer a request comes from, once it is believed: `from` must be a segment name
/// `host:port[...]` whose host is the connection's address (as must `host_ip` when given, and
/// the host IP of the peer's descriptor when this side knows it); the peer is created on first
/// use, up to the peer limit.
async fn sender(
    shared: &Arc<Shared>,
    remote: IpAddr,
    from: &str,
    host_ip: Option<&str>,
) -> std::result::Result<Arc<Peer>, String> {
    let Some(host) = ferry_core::SegmentName::parse(from).map(ferry_core::SegmentName::into_host) else {
        return Err(format!("`{from}` is not a segment name of the form host:port"));
    };
    if !is_host_of(&host, remote).await {
        tracing::warn!(from, %remote, "ascend control: a request names a peer on another host; refused");
        return Err(format!("a request from {remote} cannot speak for `{from}` (its host is {host})"));
    }
    if let Some(h) = host_ip
        && !is_host_of(h, remote).await
    {
        return Err(format!("a request from {remote} cannot publish host IP {h}"));
    }
    let existing = shared.peers.lock().unwrap_or_else(|p| p.into_inner()).get(from).cloned();
    if let Some(k) = existing.as_ref().and_then(|p| p.known())
        && !is_host_of(&k.host_ip, remote).await
    {
        tracing::warn!(from, %remote, known = %k.host_ip, "ascend control: a request for a known peer from another address; refused");
        return Err(format!("`{from}` publishes host IP {}, but the request came from {remote}", k.host_ip));
    }
    match existing {
        Some(p) => Ok(p),
        None => shared.peer(from).map_err(|e| e.message().to_owned()),
    }
}

#[allow(clippy::too_many_arguments)]
/// What an `InitOneSided` request asks, besides the table.
struct InitAsk<'a> {
    instance: Option<&'a str>,
    host_ip: &'a str,
    host_port: u16,
    epoch: u64,
    buffers: Option<Vec<(u64, u64)>>,
}

async fn init_one_sided(
    shared: &Arc<Shared>,
    peer: &Arc<Peer>,
    ask: InitAsk<'_>,
    table: String,
    your_rank: u32,
) -> Reply {
    let InitAsk { instance, host_ip, host_port, epoch, buffers } = ask;
    if !shared.one_sided_ok() {
        return Reply::Unsupported { reason: "this engine's CANN has no usable one-sided HCCL service".into() };
    }
    if your_rank > 1 {
        return error(format!("rank {your_rank} in a two-rank table"));
    }
    if let Err(why) = PairTable::check_member(&table, your_rank, &shared.me.member()) {
        return error(why);
    }
    tracing::debug!(peer = peer.name(), %host_ip, host_port, epoch, "peer asks for a one-sided communicator");
    if let Err(reply) = peer.answer_init(epoch, instance) {
        return reply;
    }
    let mine = shared.bindable(shared.me.host_ip == host_ip);
    let bound = mine.iter().map(|g| (g.addr(), g.len())).collect();
    match peer.start_one_sided(epoch, table, (your_rank, 1 - your_rank), mine, buffers).await {
        Ok(started) => {
            // Answered once this side's build has begun (see `Peer::start_one_sided`), bounded by
            // the time a Prepare may take.
            if let Some(started) = started {
                let _ = tokio::time::timeout(shared.settings.timeout, started).await;
            }
            Reply::Accepted { epoch, buffers: Some(bound) }
        }
        Err(e) => error(e.to_string()),
    }
}

async fn init_two_sided(peer: &Arc<Peer>, epoch: u64, root_hex: &str) -> Reply {
    let Some(bytes) = wire::unhex(root_hex) else { return error("root info is not hex") };
    let root = match RootInfo::from_bytes(&bytes) {
        Ok(r) => r,
        Err(e) => return error(e.to_string()),
    };
    let worker = match peer.server_worker().await {
        Ok(w) => w.clone(),
        Err(e) => return error(e.to_string()),
    };
    peer.server_epoch.store(epoch, std::sync::atomic::Ordering::Release);
    let name = peer.name().to_owned();
    let submitted = worker.submit(move |dev, st| {
        st.comm = None;
        match Communicator::init_root_info(dev, 2, &root, 1) {
            Ok(c) => st.comm = Some((epoch, c)),
            Err(e) => tracing::warn!(peer = %name, epoch, error = %e, "joining a two-sided communicator failed"),
        }
    });
    match submitted {
        Ok(()) => Reply::Accepted { epoch, buffers: None },
        Err(e) => error(e.to_string()),
    }
}

async fn transfer(
    stream: &mut TcpStream,
    shared: &Arc<Shared>,
    peer: &Arc<Peer>,
    epoch: u64,
    ops: Vec<wire::WireOp>,
) -> std::io::Result<()> {
    let from = peer.name();
    if ops.len() > MAX_OPS_PER_REQUEST {
        return wire::write_frame(
            stream,
            &error(format!("{} operations in one request (limit {MAX_OPS_PER_REQUEST})", ops.len())),
        )
        .await;
    }
    let current = peer.server_epoch.load(std::sync::atomic::Ordering::Acquire);
    if current != epoch {
        let msg =
            format!("no two-sided communicator of epoch {epoch} with `{from}` (current {current}); initialise again");
        return wire::write_frame(stream, &error(msg)).await;
    }
    let mut accepted = Vec::with_capacity(ops.len());
    let mut rejected = Vec::new();
    for (k, op) in ops.into_iter().enumerate() {
        match shared.memory.lease(op.addr, op.len) {
            Ok(lease) => accepted.push((op, lease)),
            Err(e) => rejected.push((k as u32, e.message().to_owned())),
        }
    }
    if !rejected.is_empty() {
        tracing::debug!(peer = from, count = rejected.len(), "two-sided operations outside registered memory refused");
    }
    wire::write_frame(stream, &Reply::Admitted { rejected }).await?;
    if accepted.is_empty() {
        return wire::write_frame(stream, &Reply::Done { error: None }).await;
    }
    let worker = match peer.server_worker().await {
        Ok(w) => w.clone(),
        Err(e) => return wire::write_frame(stream, &Reply::Done { error: Some(e.to_string()) }).await,
    };
    let wait = shared.settings.timeout;
    let hosts = shared.host_flags(accepted.iter().map(|(op, _)| op.addr));
    let ran = run_on(&worker, move |dev, st| {
        let result = (|| {
            let (_, comm) = st.comm.as_ref().filter(|(e, _)| *e == epoch).ok_or_else(|| {
                ferry_ascend_runtime::AscendError::InvalidArgument(format!(
                    "no two-sided communicator of epoch {epoch}"
                ))
            })?;
            let side: Vec<SideOp> = accepted
                .iter()
                .zip(&hosts)
                .map(|((op, _lease), &host)| SideOp { send: !op.write, addr: op.addr, len: op.len, host })
                .collect();
            // SAFETY: every range lies in a region of this engine's registry, leased (so it
            // cannot be unregistered) until this job drops `accepted`, after the stream ran
            // (or, on failure, was drained by `run_side`).
            unsafe { run_side(dev, comm, &st.stream, 0, &side, wait) }
        })();
        if result.is_err() {
            st.comm = None;
            crate::peer::recover_server_stream(dev, st);
        }
        drop(accepted);
        result
    });
    // The device thread may be held up (a drain after a failure waits for HCCL's own timeout):
    // the initiator hears of it in time, and the leases go when the job ends.
    let error = match tokio::time::timeout(wait + TRANSFER_GRACE, ran).await {
        Ok(Ok(Ok(()))) => None,
        Ok(Ok(Err(e))) | Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some(format!(
            "this side's half did not finish within {:?}; its memory stays leased until the device is done with it",
            wait + TRANSFER_GRACE
        )),
    };
    wire::write_frame(stream, &Reply::Done { error }).await
}
