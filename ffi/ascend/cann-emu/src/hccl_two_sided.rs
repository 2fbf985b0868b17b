//! Two-sided HCCL: root info, communicator initialisation, `HcclSend`/`HcclRecv`.
//!
//! `HcclGetRootInfo` opens a rendezvous listener (on `HCCL_IF_IP`, default `127.0.0.1`, free
//! port) served by a background thread, and writes its endpoint and a random id into
//! `HcclRootInfo`. `HcclCommInitRootInfo(n, root, rank)` is collective, as in HCCL: every rank
//! (the root's creator included) announces itself to the rendezvous, which answers with every
//! rank's link endpoint once all `n` arrived; then each pair of ranks opens one TCP link
//! (the higher rank connects). It blocks until that is done or `HCCL_CONNECT_TIMEOUT` passed
//! (`HCCL_E_TIMEOUT`). `HcclCommInitClusterInfo` does the same from a rank table file, the links
//! going through the ranks' device endpoints.
//!
//! `HcclSend`/`HcclRecv` are queued on the stream; on a link, sends and receives are matched in
//! order, and a receive whose size differs from the matching send fails (the link is then
//! unusable). The buffers must be emulated device memory of the communicator's device's
//! process. An operation that waits longer than `HCCL_EXEC_TIMEOUT` for its peer fails.

use std::collections::BTreeMap;
use std::ffi::{CStr, c_char, c_void};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::boundary::{Api, debug, entry, lock};
use crate::codes::*;
use crate::config::config;
use crate::endpoint;
use crate::faults::faults;
use crate::hccl::{self, Comm, Role};
use crate::memory;
use crate::rank_table;
use crate::types::*;
use crate::wire::{self, Dec, Enc, kind, purpose};

const ROOT_MAGIC: &[u8; 8] = b"FERRYEMU";
const MAX_RANKS: u32 = 4096;

/// A two-sided link to one peer rank.
#[derive(Debug)]
pub(crate) struct Link {
    peer: u32,
    reader: Mutex<(TcpStream, u64)>,
    writer: Mutex<(TcpStream, u64)>,
    control: TcpStream,
    broken: AtomicBool,
}

fn link_error(peer: u32, what: &str, e: &io::Error) -> EmuError {
    if wire::is_timeout(e) {
        err(
            ACL_ERROR_RT_TASK_TIMEOUT,
            format!(
                "{what} with rank {peer} waited longer than HCCL_EXEC_TIMEOUT ({} s)",
                config().exec_timeout.as_secs()
            ),
        )
    } else {
        err(ACL_ERROR_RT_LINK_ERROR, format!("{what} with rank {peer} failed: the link broke ({e})"))
    }
}

impl Link {
    /// Wraps a connected socket.
    pub(crate) fn new(s: TcpStream, peer: u32) -> io::Result<Arc<Link>> {
        let _ = s.set_nodelay(true);
        wire::set_timeouts(&s, Some(config().exec_timeout))?;
        Ok(Arc::new(Link {
            peer,
            reader: Mutex::new((s.try_clone()?, 0)),
            writer: Mutex::new((s.try_clone()?, 0)),
            control: s,
            broken: AtomicBool::new(false),
        }))
    }

    fn check(&self) -> EmuResult<()> {
        if self.broken.load(Ordering::Acquire) {
            return Err(err(
                ACL_ERROR_RT_LINK_ERROR,
                format!("the link with rank {} is unusable after an earlier failure or HcclCommDestroy", self.peer),
            ));
        }
        Ok(())
    }

    fn fail(&self, e: EmuError) -> EmuError {
        self.broken.store(true, Ordering::Release);
        e
    }

    /// Sends `len` bytes at `addr`.
    fn send(&self, addr: usize, len: u64) -> EmuResult<()> {
        self.check()?;
        let mut w = lock(&self.writer);
        let seq = w.1;
        let header = Enc::new().u64(seq).u64(len).0;
        wire::write_frame(&mut w.0, kind::SEND, &header)
            .map_err(|e| self.fail(link_error(self.peer, "HcclSend", &e)))?;
        // SAFETY: `addr..+len` is emulated device memory kept alive by the queued task.
        unsafe { wire::send_raw(&w.0, addr as *const u8, len as usize) }
            .map_err(|e| self.fail(link_error(self.peer, "HcclSend", &e)))?;
        w.1 += 1;
        Ok(())
    }

    /// Receives exactly `len` bytes into `addr`.
    fn recv(&self, addr: usize, len: u64) -> EmuResult<()> {
        self.check()?;
        let mut r = lock(&self.reader);
        let p = wire::expect_frame(&mut r.0, kind::SEND, 16)
            .map_err(|e| self.fail(link_error(self.peer, "HcclRecv", &e)))?;
        let mut d = Dec::new(&p);
        let (seq, bytes) = match (d.u64(), d.u64()) {
            (Ok(a), Ok(b)) => (a, b),
            _ => return Err(self.fail(err(ACL_ERROR_RT_SUSPECT_REMOTE_ERROR, "HcclRecv: malformed send header"))),
        };
        if seq != r.1 || bytes != len {
            return Err(self.fail(err(
                ACL_ERROR_RT_SUSPECT_REMOTE_ERROR,
                format!(
                    "HcclRecv from rank {}: the matching HcclSend (#{seq}, expected #{}) carries {bytes} bytes, this receive expects {len}",
                    self.peer, r.1
                ),
            )));
        }
        // SAFETY: `addr..+len` is emulated device memory kept alive by the queued task, and
        // exactly `len` bytes were announced.
        unsafe { wire::recv_raw(&r.0, addr as *mut u8, len as usize) }
            .map_err(|e| self.fail(link_error(self.peer, "HcclRecv", &e)))?;
        r.1 += 1;
        Ok(())
    }

    /// Closes the link; operations blocked on it fail.
    pub(crate) fn shutdown(&self) {
        self.broken.store(true, Ordering::Release);
        let _ = self.control.shutdown(std::net::Shutdown::Both);
    }
}

fn random_u64() -> u64 {
    let mut h = std::hash::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    h.finish()
}

fn local_ip() -> IpAddr {
    config().if_ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

fn encode_root(id: u64, addr: SocketAddr, out: &mut HcclRootInfo) {
    let mut b = Vec::with_capacity(64);
    b.extend_from_slice(ROOT_MAGIC);
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&id.to_le_bytes());
    let text = addr.to_string();
    b.extend_from_slice(&(text.len() as u16).to_le_bytes());
    b.extend_from_slice(text.as_bytes());
    out.internal = [0; HCCL_ROOT_INFO_BYTES];
    for (dst, src) in out.internal.iter_mut().zip(b) {
        *dst = src as c_char;
    }
}

fn decode_root(info: &HcclRootInfo) -> Option<(u64, SocketAddr)> {
    let b: Vec<u8> = info.internal.iter().map(|&c| c as u8).collect();
    if &b[..8] != ROOT_MAGIC || b[8..12] != 1u32.to_le_bytes() {
        return None;
    }
    let id = u64::from_le_bytes(b[12..20].try_into().ok()?);
    let n = u16::from_le_bytes([b[20], b[21]]) as usize;
    let text = std::str::from_utf8(b.get(22..22 + n)?).ok()?;
    Some((id, text.parse().ok()?))
}

fn table_reply(status: i32, message: &str, endpoints: &[String]) -> Vec<u8> {
    let mut e = Enc::new().u32(status as u32).str(message).u32(endpoints.len() as u32);
    for ep in endpoints {
        e = e.str(ep);
    }
    e.0
}

/// The rendezvous served for one root info until all ranks arrived or the deadline passed.
fn rendezvous(listener: TcpListener, id: u64, deadline: Instant) {
    let mut members: BTreeMap<u32, (TcpStream, String)> = BTreeMap::new();
    let mut nranks: Option<u32> = None;
    while Instant::now() < deadline {
        if !wire::poll_readable(&listener, Duration::from_millis(100)) {
            continue;
        }
        let Ok((mut s, _)) = listener.accept() else { continue };
        let _ = s.set_nonblocking(false);
        if wire::set_timeouts(&s, Some(Duration::from_secs(10))).is_err() {
            continue;
        }
        let Ok(p) = wire::expect_frame(&mut s, kind::RV_HELLO, 4096) else { continue };
        let mut d = Dec::new(&p);
        let (Ok(rid), Ok(n), Ok(rank), Ok(ep)) = (d.u64(), d.u32(), d.u32(), d.str()) else { continue };
        let problem = if rid != id {
            Some("the root info does not match this rendezvous".to_string())
        } else if n == 0 || n > MAX_RANKS {
            Some(format!("nRanks {n} is out of range"))
        } else if nranks.is_some_and(|m| m != n) {
            Some(format!("nRanks {n} differs from the {} announced by another rank", nranks.unwrap_or(0)))
        } else if rank >= n {
            Some(format!("rank {rank} is not below nRanks {n}"))
        } else if members.contains_key(&rank) {
            Some(format!("rank {rank} joined twice"))
        } else if ep.parse::<SocketAddr>().is_err() {
            Some(format!("bad link endpoint {ep:?}"))
        } else {
            None
        };
        if let Some(problem) = problem {
            let _ = wire::write_frame(&mut s, kind::RV_TABLE, &table_reply(HCCL_E_PARA, &problem, &[]));
            continue;
        }
        nranks = Some(n);
        members.insert(rank, (s, ep));
        if members.len() == n as usize {
            let endpoints: Vec<String> = members.values().map(|(_, ep)| ep.clone()).collect();
            let reply = table_reply(HCCL_SUCCESS, "", &endpoints);
            for (s, _) in members.values_mut() {
                let _ = wire::write_frame(s, kind::RV_TABLE, &reply);
            }
            return;
        }
    }
    let reply = table_reply(HCCL_E_TIMEOUT, "not every rank joined the root info in time", &[]);
    for (s, _) in members.values_mut() {
        let _ = wire::write_frame(s, kind::RV_TABLE, &reply);
    }
}

/// Creates root info: a rendezvous endpoint and id that every rank passes to
/// `HcclCommInitRootInfo`. The rendezvous stays open for twice `HCCL_CONNECT_TIMEOUT`.
///
/// # Safety
/// `root_info` is NULL or valid for writing an [`HcclRootInfo`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclGetRootInfo(root_info: *mut HcclRootInfo) -> i32 {
    entry(
        Api::Hccl,
        "HcclGetRootInfo",
        || format!("{root_info:p}"),
        || {
            if root_info.is_null() {
                return Err(err(HCCL_E_PTR, "rootInfo is NULL"));
            }
            let ip = local_ip();
            let listener = TcpListener::bind((ip, 0))
                .map_err(|e| err(HCCL_E_TCP_CONNECT, format!("cannot open the root-info listener on {ip}: {e}")))?;
            let addr = listener.local_addr().map_err(|e| err(HCCL_E_SYSCALL, e.to_string()))?;
            listener.set_nonblocking(true).map_err(|e| err(HCCL_E_SYSCALL, e.to_string()))?;
            let id = random_u64();
            let deadline = Instant::now() + config().connect_timeout * 2;
            std::thread::Builder::new()
                .name("cann-emu-root".into())
                .spawn(move || rendezvous(listener, id, deadline))
                .map_err(|e| err(HCCL_E_SYSCALL, format!("cannot start the rendezvous thread: {e}")))?;
            let mut info = HcclRootInfo::default();
            encode_root(id, addr, &mut info);
            // SAFETY: non-null, valid per this function's contract.
            unsafe { root_info.write_unaligned(info) };
            debug(|| format!("root info {id:#x} at {addr}"));
            Ok(())
        },
    )
}

fn io_init_error(what: &str, e: &io::Error) -> EmuError {
    if wire::is_timeout(e) {
        err(
            HCCL_E_TIMEOUT,
            format!("{what}: timed out (HCCL_CONNECT_TIMEOUT = {} s)", config().connect_timeout.as_secs()),
        )
    } else {
        err(HCCL_E_TCP_TRANSFER, format!("{what}: {e}"))
    }
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

/// Accepts the links of ranks `rank+1..n` on `listener` (root-info communicators).
fn accept_root_links(
    listener: &TcpListener,
    key: u64,
    rank: u32,
    n: u32,
    deadline: Instant,
    links: &mut BTreeMap<u32, Arc<Link>>,
) -> EmuResult<()> {
    while links.len() < (n - rank - 1) as usize {
        if Instant::now() >= deadline {
            return Err(err(
                HCCL_E_TIMEOUT,
                format!("HcclCommInitRootInfo: ranks above {rank} did not connect within HCCL_CONNECT_TIMEOUT"),
            ));
        }
        if !wire::poll_readable(listener, Duration::from_millis(50)) {
            continue;
        }
        let Ok((mut s, _)) = listener.accept() else { continue };
        let _ = s.set_nonblocking(false);
        let _ = wire::set_timeouts(&s, Some(remaining(deadline)));
        let Ok(p) = wire::expect_frame(&mut s, kind::HELLO, 64) else { continue };
        let mut d = Dec::new(&p);
        let (Ok(k), Ok(src), Ok(dst), Ok(pp)) = (d.u64(), d.u32(), d.u32(), d.u8()) else { continue };
        if k != key || dst != rank || pp != purpose::ROOT_LINK || src <= rank || src >= n || links.contains_key(&src) {
            let _ = wire::write_frame(&mut s, kind::HELLO_ACK, &endpoint::ack(HCCL_E_PARA, "unexpected link"));
            continue;
        }
        wire::write_frame(&mut s, kind::HELLO_ACK, &endpoint::ack(HCCL_SUCCESS, ""))
            .map_err(|e| io_init_error("HcclCommInitRootInfo", &e))?;
        links.insert(src, Link::new(s, src).map_err(|e| io_init_error("HcclCommInitRootInfo", &e))?);
    }
    Ok(())
}

/// Connects one link: `HELLO` until accepted (`HCCL_E_NOT_FOUND` answers are retried).
pub(crate) fn connect_link(
    name: &str,
    addr: SocketAddr,
    hello: &[u8],
    peer: u32,
    deadline: Instant,
) -> EmuResult<TcpStream> {
    loop {
        let mut s = wire::connect_until(addr, deadline).map_err(|e| {
            err(HCCL_E_TIMEOUT, format!("{name}: rank {peer} at {addr} is not reachable within the timeout ({e})"))
        })?;
        wire::set_timeouts(&s, Some(remaining(deadline))).map_err(|e| io_init_error(name, &e))?;
        wire::write_frame(&mut s, kind::HELLO, hello).map_err(|e| io_init_error(name, &e))?;
        let (status, message) = endpoint::read_ack(&mut s).map_err(|e| io_init_error(name, &e))?;
        match status {
            HCCL_SUCCESS => return Ok(s),
            HCCL_E_NOT_FOUND if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            HCCL_E_NOT_FOUND => {
                return Err(err(
                    HCCL_E_TIMEOUT,
                    format!("{name}: rank {peer} at {addr} did not create the communicator within the timeout"),
                ));
            }
            code => return Err(err(code, format!("{name}: rank {peer} at {addr} refused the link: {message}"))),
        }
    }
}

fn init_root_info(n: u32, root: &HcclRootInfo, rank: u32) -> EmuResult<Arc<Comm>> {
    const NAME: &str = "HcclCommInitRootInfo";
    if n == 0 || n > MAX_RANKS || rank >= n {
        return Err(err(HCCL_E_PARA, format!("{NAME}: rank {rank} of nRanks {n} is invalid")));
    }
    let ctx = hccl::current_device(NAME)?;
    let (id, root_addr) = decode_root(root)
        .ok_or_else(|| err(HCCL_E_PARA, format!("{NAME}: the root info was not produced by HcclGetRootInfo")))?;
    let deadline = Instant::now() + config().connect_timeout;
    let listener = TcpListener::bind((root_addr.ip(), 0))
        .map_err(|e| err(HCCL_E_TCP_CONNECT, format!("{NAME}: cannot open a link listener: {e}")))?;
    listener.set_nonblocking(true).map_err(|e| err(HCCL_E_SYSCALL, e.to_string()))?;
    let my_ep = listener.local_addr().map_err(|e| err(HCCL_E_SYSCALL, e.to_string()))?;
    let mut s = wire::connect_until(root_addr, deadline)
        .map_err(|e| err(HCCL_E_TCP_CONNECT, format!("{NAME}: the root at {root_addr} is not reachable: {e}")))?;
    wire::set_timeouts(&s, Some(remaining(deadline))).map_err(|e| io_init_error(NAME, &e))?;
    let hello = Enc::new().u64(id).u32(n).u32(rank).str(&my_ep.to_string()).0;
    wire::write_frame(&mut s, kind::RV_HELLO, &hello).map_err(|e| io_init_error(NAME, &e))?;
    let p = wire::expect_frame(&mut s, kind::RV_TABLE, (n as usize) * 128 + 4096).map_err(|e| {
        if wire::is_timeout(&e) {
            err(HCCL_E_TIMEOUT, format!("{NAME}: not all {n} ranks joined within HCCL_CONNECT_TIMEOUT"))
        } else {
            io_init_error(NAME, &e)
        }
    })?;
    let mut d = Dec::new(&p);
    let bad = |_| err(HCCL_E_TCP_TRANSFER, format!("{NAME}: malformed rendezvous answer"));
    let status = d.u32().map_err(bad)? as i32;
    let message = d.str().map_err(bad)?;
    if status != HCCL_SUCCESS {
        return Err(err(status, format!("{NAME}: the rendezvous refused rank {rank}: {message}")));
    }
    let count = d.u32().map_err(bad)?;
    if count != n {
        return Err(err(
            HCCL_E_TCP_TRANSFER,
            format!("{NAME}: the rendezvous returned {count} endpoints for {n} ranks"),
        ));
    }
    let mut endpoints = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let ep = d.str().map_err(bad)?;
        endpoints.push(
            ep.parse::<SocketAddr>().map_err(|_| err(HCCL_E_TCP_TRANSFER, format!("{NAME}: bad endpoint {ep:?}")))?,
        );
    }
    let mut links = BTreeMap::new();
    for (peer, addr) in endpoints.iter().enumerate().take(rank as usize) {
        let peer = peer as u32;
        let hello = endpoint::hello(id, rank, peer, purpose::ROOT_LINK);
        let s = connect_link(NAME, *addr, &hello, peer, deadline)?;
        links.insert(peer, Link::new(s, peer).map_err(|e| io_init_error(NAME, &e))?);
    }
    accept_root_links(&listener, id, rank, n, deadline, &mut links)?;
    let comm = Comm::new(&ctx, rank, n, id, Role::RootInfo, None);
    lock(&comm.links).extend(links);
    Ok(Arc::new(comm))
}

/// Joins the communicator described by `root_info` as `rank` of `n_ranks` (collective: blocks
/// until every rank joined and the links are up, or `HCCL_CONNECT_TIMEOUT`).
///
/// # Safety
/// `root_info` is NULL or points to an [`HcclRootInfo`]; `comm` is NULL or valid for writing a
/// pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclCommInitRootInfo(
    n_ranks: u32,
    root_info: *const HcclRootInfo,
    rank: u32,
    comm: *mut HcclComm,
) -> i32 {
    entry(
        Api::Hccl,
        "HcclCommInitRootInfo",
        || format!("{n_ranks}, {root_info:p}, {rank}, {comm:p}"),
        || {
            if root_info.is_null() || comm.is_null() {
                return Err(err(HCCL_E_PTR, "rootInfo or comm is NULL"));
            }
            // SAFETY: non-null, points to an HcclRootInfo per this function's contract.
            let root = unsafe { root_info.read_unaligned() };
            let c = init_root_info(n_ranks, &root, rank)?;
            let h = hccl::register(c);
            // SAFETY: non-null, valid per this function's contract.
            unsafe { comm.write_unaligned(crate::handles::to_ptr(h)) };
            Ok(())
        },
    )
}

fn init_cluster(path: &str, rank: u32) -> EmuResult<Arc<Comm>> {
    const NAME: &str = "HcclCommInitClusterInfo";
    let meta = std::fs::metadata(path)
        .map_err(|e| err(HCCL_E_OPEN_FILE_FAILURE, format!("{NAME}: cannot open the rank table {path}: {e}")))?;
    if meta.len() > rank_table::MAX_RANK_TABLE as u64 {
        return Err(err(HCCL_E_PARA, format!("{NAME}: the rank table {path} is too large")));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| err(HCCL_E_OPEN_FILE_FAILURE, format!("{NAME}: cannot read the rank table {path}: {e}")))?;
    let table = rank_table::parse(&text).map_err(|e| err(HCCL_E_PARA, format!("{NAME}: {path}: {e}")))?;
    let ctx = hccl::current_device(NAME)?;
    let comm = build_table_comm(NAME, &ctx, table, rank, Role::Cluster)?;
    let deadline = Instant::now() + config().connect_timeout;
    let result = (|| {
        let Some(table) = comm.table.as_ref() else {
            return Err(err(HCCL_E_INTERNAL, format!("{NAME}: the communicator lost its rank table")));
        };
        for peer in 0..comm.nranks {
            if peer == rank {
                continue;
            }
            let link = if peer < rank {
                let hello = endpoint::hello(comm.key, rank, peer, purpose::CLUSTER_LINK);
                connect_link(NAME, table.ranks[peer as usize].endpoint, &hello, peer, deadline)?
            } else {
                let mut pending = lock(&comm.pending);
                loop {
                    if let Some(s) = pending.remove(&peer) {
                        break s;
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() || comm.is_destroyed() {
                        return Err(err(
                            HCCL_E_TIMEOUT,
                            format!("{NAME}: rank {peer} did not connect within HCCL_CONNECT_TIMEOUT"),
                        ));
                    }
                    pending = comm.pending_cv.wait_timeout(pending, left).unwrap_or_else(|e| e.into_inner()).0;
                }
            };
            let link = Link::new(link, peer).map_err(|e| io_init_error(NAME, &e))?;
            lock(&comm.links).insert(peer, link);
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(comm),
        Err(e) => {
            comm.teardown();
            Err(e)
        }
    }
}

/// Creates a rank-table communicator for the calling thread's device: checks that the table
/// lists this device's physical id for `rank`, opens (or shares) the rank's endpoint listener
/// and makes the communicator findable there.
pub(crate) fn build_table_comm(
    name: &str,
    ctx: &crate::device::Context,
    table: rank_table::RankTable,
    rank: u32,
    role: Role,
) -> EmuResult<Arc<Comm>> {
    let n = table.ranks.len() as u32;
    let entry = table
        .ranks
        .get(rank as usize)
        .ok_or_else(|| err(HCCL_E_PARA, format!("{name}: rank {rank} is not in the rank table ({n} ranks)")))?;
    if entry.device_id != ctx.physical_id {
        return Err(err(
            HCCL_E_PARA,
            format!(
                "{name}: the rank table gives rank {rank} device_id {} but this thread's device {} is physical device {}",
                entry.device_id, ctx.user_id, ctx.physical_id
            ),
        ));
    }
    let guard = endpoint::acquire(entry.endpoint)?;
    #[cfg_attr(not(feature = "onesided"), allow(unused_mut))]
    let mut comm = Comm::new(ctx, rank, n, table.key, role, Some(table));
    #[cfg(feature = "onesided")]
    if role == Role::OneSided {
        comm.one_sided = Some(crate::hccl_one_sided::OneSided::new(&comm));
    }
    *lock(&comm.endpoint) = Some(guard);
    let comm = Arc::new(comm);
    endpoint::index_insert(&comm);
    Ok(comm)
}

/// Joins the communicator of a rank table file as `rank` (collective: blocks until the links
/// to every other rank are up, or `HCCL_CONNECT_TIMEOUT`). The table must give `rank` the
/// physical id of the calling thread's device.
///
/// # Safety
/// `rank_table_file_path` is NULL or a NUL-terminated string; `comm` is NULL or valid for
/// writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclCommInitClusterInfo(
    rank_table_file_path: *const c_char,
    rank: u32,
    comm: *mut HcclComm,
) -> i32 {
    entry(
        Api::Hccl,
        "HcclCommInitClusterInfo",
        || format!("{rank_table_file_path:p}, {rank}, {comm:p}"),
        || {
            if rank_table_file_path.is_null() || comm.is_null() {
                return Err(err(HCCL_E_PTR, "rankTableFilePath or comm is NULL"));
            }
            // SAFETY: non-null and NUL-terminated per this function's contract.
            let path = unsafe { CStr::from_ptr(rank_table_file_path) }.to_string_lossy().into_owned();
            let c = init_cluster(&path, rank)?;
            let h = hccl::register(c);
            // SAFETY: non-null, valid per this function's contract.
            unsafe { comm.write_unaligned(crate::handles::to_ptr(h)) };
            Ok(())
        },
    )
}

struct P2p {
    comm: Arc<Comm>,
    stream: Arc<crate::stream::Stream>,
    link: Arc<Link>,
    addr: usize,
    bytes: u64,
    keep: Option<Arc<memory::Allocation>>,
}

fn plan_p2p(
    name: &str,
    buf: *mut c_void,
    count: u64,
    data_type: i32,
    peer: u32,
    comm: HcclComm,
    stream: *mut c_void,
) -> EmuResult<P2p> {
    let c = hccl::lookup(comm)?;
    let s = hccl::hccl_stream(name, stream, &c)?;
    hccl::check_thread_device(name, &c)?;
    if c.role == Role::OneSided {
        return Err(err(
            HCCL_E_NOT_SUPPORT,
            format!("{name}: a communicator of HcclCommInitClusterInfoMemConfig only serves one-sided operations"),
        ));
    }
    let size =
        data_type_size(data_type).ok_or_else(|| err(HCCL_E_PARA, format!("{name}: unknown data type {data_type}")))?;
    let bytes = count
        .checked_mul(size)
        .filter(|b| *b <= isize::MAX as u64)
        .ok_or_else(|| err(HCCL_E_PARA, format!("{name}: count {count} is too large")))?;
    if peer >= c.nranks || peer == c.rank {
        return Err(err(
            HCCL_E_PARA,
            format!("{name}: rank {peer} is not a peer (this is rank {} of {})", c.rank, c.nranks),
        ));
    }
    let link = lock(&c.links)
        .get(&peer)
        .cloned()
        .ok_or_else(|| err(HCCL_E_INTERNAL, format!("{name}: no link to rank {peer}")))?;
    let keep = if bytes == 0 {
        None
    } else {
        if buf.is_null() {
            return Err(err(HCCL_E_PTR, format!("{name}: buf is NULL")));
        }
        Some(memory::find_device(buf as usize, bytes as usize).ok_or_else(|| {
            err(HCCL_E_PARA, format!("{name}: buffer {buf:p}..+{bytes} is not inside emulated device memory"))
        })?)
    };
    Ok(P2p { comm: c, stream: s, link, addr: buf as usize, bytes, keep })
}

/// Queues a send of `count` elements at `buf` to `dest_rank` on `stream`. `buf` must be
/// emulated device memory.
///
/// # Safety
/// No caller memory is read before the emulator checked it is emulated device memory; the
/// memory must stay allocated until the stream ran the send (the emulator keeps it alive).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclSend(
    buf: *mut c_void,
    count: u64,
    data_type: i32,
    dest_rank: u32,
    comm: HcclComm,
    stream: AclrtStream,
) -> i32 {
    entry(
        Api::Hccl,
        "HcclSend",
        || format!("{buf:p}, {count}, {data_type}, {dest_rank}, {comm:p}, {stream:p}"),
        || {
            let p = plan_p2p("HcclSend", buf, count, data_type, dest_rank, comm, stream)?;
            let delay = faults().delay("HcclSend");
            let P2p { comm, stream, link, addr, bytes, keep } = p;
            stream
                .submit(Box::new(move || {
                    let _alive = (keep, comm);
                    if let Some(d) = delay {
                        std::thread::sleep(d);
                    }
                    if bytes == 0 { Ok(()) } else { link.send(addr, bytes) }
                }))
                .map_err(|e| err(HCCL_E_PARA, e.message))
        },
    )
}

/// Queues a receive of `count` elements into `buf` from `src_rank` on `stream`; it must match
/// the peer's send in order and size.
///
/// # Safety
/// No caller memory is written before the emulator checked it is emulated device memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn HcclRecv(
    buf: *mut c_void,
    count: u64,
    data_type: i32,
    src_rank: u32,
    comm: HcclComm,
    stream: AclrtStream,
) -> i32 {
    entry(
        Api::Hccl,
        "HcclRecv",
        || format!("{buf:p}, {count}, {data_type}, {src_rank}, {comm:p}, {stream:p}"),
        || {
            let p = plan_p2p("HcclRecv", buf, count, data_type, src_rank, comm, stream)?;
            let delay = faults().delay("HcclRecv");
            let P2p { comm, stream, link, addr, bytes, keep } = p;
            stream
                .submit(Box::new(move || {
                    let _alive = (keep, comm);
                    if let Some(d) = delay {
                        std::thread::sleep(d);
                    }
                    if bytes == 0 { Ok(()) } else { link.recv(addr, bytes) }
                }))
                .map_err(|e| err(HCCL_E_PARA, e.message))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_info_round_trips_and_foreign_bytes_are_refused() {
        let mut info = HcclRootInfo::default();
        let addr: SocketAddr = "127.0.0.1:4242".parse().unwrap();
        encode_root(0xfeed, addr, &mut info);
        assert_eq!(decode_root(&info), Some((0xfeed, addr)));
        let mut forged = info;
        forged.internal[0] = b'X' as c_char;
        assert_eq!(decode_root(&forged), None);
        let mut long = info;
        long.internal[20] = 0xff_u8 as c_char;
        long.internal[21] = 0xff_u8 as c_char;
        assert_eq!(decode_root(&long), None, "a length past the end is refused");
        assert_eq!(decode_root(&HcclRootInfo::default()), None);
    }
}
