//! The control listener: peers ask it to join communicators and, on the two-sided path, to
//! send or receive. Every address is checked against the live memory registry (and leased for
//! the duration) before the device touches it.

use std::sync::Arc;
use std::time::Duration;

use ferry_ascend_sys::{Communicator, RootInfo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::identity::PairTable;
use crate::peer::{SideOp, is_host, run_side};
use crate::wire::{self, MAX_OPS_PER_REQUEST, Reply, Request};
use crate::{Shared, run_on};

/// A control connection idle this long is closed (the initiator reconnects).
const IDLE: Duration = Duration::from_secs(300);
/// Connections served at once.
const MAX_CONNECTIONS: usize = 1024;

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
                    if let Err(e) = serve_connection(stream, &shared).await {
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

async fn serve_connection(mut stream: TcpStream, shared: &Arc<Shared>) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    loop {
        let Some(req) = wire::read_frame::<_, Request>(&mut stream, IDLE).await? else { return Ok(()) };
        match req {
            Request::InitOneSided { from, host_ip, host_port, epoch, rank_table, your_rank } => {
                let reply = init_one_sided(shared, &from, &host_ip, host_port, epoch, rank_table, your_rank).await;
                wire::write_frame(&mut stream, &reply).await?;
            }
            Request::InitTwoSided { from, epoch, root_info } => {
                let reply = init_two_sided(shared, &from, epoch, &root_info).await;
                wire::write_frame(&mut stream, &reply).await?;
            }
            Request::Transfer { from, epoch, ops } => transfer(&mut stream, shared, &from, epoch, ops).await?,
        }
    }
}

fn error(message: impl Into<String>) -> Reply {
    Reply::Error { message: message.into() }
}

async fn init_one_sided(
    shared: &Arc<Shared>,
    from: &str,
    host_ip: &str,
    host_port: u16,
    epoch: u64,
    table: String,
    your_rank: u32,
) -> Reply {
    if !shared.one_sided_ok() {
        return Reply::Unsupported { reason: "this engine's CANN has no usable one-sided HCCL service".into() };
    }
    if your_rank > 1 {
        return error(format!("rank {your_rank} in a two-rank table"));
    }
    if let Err(why) = PairTable::check_member(&table, your_rank, &shared.me.member()) {
        return error(why);
    }
    let peer = match shared.peer(from) {
        Ok(p) => p,
        Err(e) => return error(e.to_string()),
    };
    tracing::debug!(peer = from, %host_ip, host_port, epoch, "peer asks for a one-sided communicator");
    match peer.answer_init(epoch) {
        Ok(()) => {}
        Err(reply) => return reply,
    }
    match peer.start_one_sided(epoch, table, your_rank, 1 - your_rank).await {
        Ok(()) => Reply::Accepted { epoch },
        Err(e) => error(e.to_string()),
    }
}

async fn init_two_sided(shared: &Arc<Shared>, from: &str, epoch: u64, root_hex: &str) -> Reply {
    let Some(bytes) = wire::unhex(root_hex) else { return error("root info is not hex") };
    let root = match RootInfo::from_bytes(&bytes) {
        Ok(r) => r,
        Err(e) => return error(e.to_string()),
    };
    let peer = match shared.peer(from) {
        Ok(p) => p,
        Err(e) => return error(e.to_string()),
    };
    let worker = match peer.server_worker().await {
        Ok(w) => w.clone(),
        Err(e) => return error(e.to_string()),
    };
    peer.server_epoch.store(epoch, std::sync::atomic::Ordering::Release);
    let name = from.to_owned();
    let submitted = worker.submit(move |dev, st| {
        st.comm = None;
        match Communicator::init_root_info(dev, 2, &root, 1) {
            Ok(c) => st.comm = Some((epoch, c)),
            Err(e) => tracing::warn!(peer = %name, epoch, error = %e, "joining a two-sided communicator failed"),
        }
    });
    match submitted {
        Ok(()) => Reply::Accepted { epoch },
        Err(e) => error(e.to_string()),
    }
}

async fn transfer(
    stream: &mut TcpStream,
    shared: &Arc<Shared>,
    from: &str,
    epoch: u64,
    ops: Vec<wire::WireOp>,
) -> std::io::Result<()> {
    if ops.len() > MAX_OPS_PER_REQUEST {
        return wire::write_frame(
            stream,
            &error(format!("{} operations in one request (limit {MAX_OPS_PER_REQUEST})", ops.len())),
        )
        .await;
    }
    let peer = match shared.peer(from) {
        Ok(p) => p,
        Err(e) => return wire::write_frame(stream, &error(e.to_string())).await,
    };
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
    let ran = run_on(&worker, move |dev, st| {
        let result = (|| {
            let (_, comm) = st.comm.as_ref().filter(|(e, _)| *e == epoch).ok_or_else(|| {
                ferry_ascend_sys::AscendError::InvalidArgument(format!("no two-sided communicator of epoch {epoch}"))
            })?;
            let side: Vec<SideOp> = accepted
                .iter()
                .map(|(op, lease)| SideOp {
                    send: !op.write,
                    addr: op.addr,
                    len: op.len,
                    host: is_host(lease.location()),
                })
                .collect();
            // SAFETY: every range lies in a region of this engine's registry, leased (so it
            // cannot be unregistered) until this job drops `accepted`, after the stream ran.
            unsafe { run_side(dev, comm, &st.stream, 0, &side, wait) }
        })();
        if result.is_err() {
            st.comm = None;
            st.stream.abort();
            if let Ok(s) = dev.create_stream() {
                st.stream = s;
            }
        }
        drop(accepted);
        result
    })
    .await;
    let error = match ran {
        Ok(Ok(())) => None,
        Ok(Err(e)) | Err(e) => Some(e.to_string()),
    };
    wire::write_frame(stream, &Reply::Done { error }).await
}
