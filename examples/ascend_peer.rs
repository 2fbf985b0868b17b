//! A prefill or decode process on the `ascend` transport, used by the HCCL integration tests
//! (`transports/hccl/tests/hccl_transfer.rs`) and handy for trying a deployment by hand.
//!
//! ```text
//! ascend_peer prefill [--host-memory|--plain-host-memory] [--any-location] [--regions N]
//!     [--blocks N] [--block-len N]
//!     registers a KV cache filled with a pattern (seed 1), prints `READY <json>` (segment,
//!     layout, rank_info), then serves the stdin commands below until `quit` or end of input.
//! ascend_peer decode --peer SEGMENT --peer-layout JSON [--read R:L,...] [--write L:R,...]
//!     [--host-memory|--plain-host-memory] [--any-location] [--expect-failure] [--expect-timeout [--no-wait-release]] [--repeat N]
//!     [--async-submit] [--stay]
//!     reads remote blocks R into local blocks L (checking the pattern), writes local blocks
//!     (filled with seed 2) into remote ones, prints `DONE <json>` (or `FAILED <json>` with
//!     --expect-failure when the read fails); with --stay it then serves the stdin commands.
//!     With --expect-timeout the read is expected to time out: `TIMED_OUT <json>` gives the
//!     error's kind, when the caller saw it and when the transport released the batch's memory
//!     (unless --no-wait-release: then it shuts down at once).
//!
//! Every process prints `SHUTDOWN {"error": ..., "threads_left_running": N}` after its engine
//! shut down; when device threads were left running, or the engine could not release all memory,
//! the process keeps its buffers (never frees memory a device may still write) and, with
//! --expect-timeout, still exits 0.
//!
//! Memory: device memory in huge pages (`aclrtMalloc` with `ACL_MEM_MALLOC_HUGE_ONLY`), or with
//! `--host-memory` host memory from `aclrtMallocHost`, or with `--plain-host-memory` host memory
//! from the Rust allocator (which HCCL cannot register with the device). Registered as `npu:N` /
//! `cpu:0`, or with `--any-location` as `*` (the transport asks the runtime where it lives).
//!
//! stdin commands:
//!     verify <dst>:<src>,... <seed>   checks blocks written by a peer: `VERIFIED ok|bad ...`
//!     transfer <segment> <layout-json> <R:L,...|-> <L:R,...|-> <peer-seed>
//!                                     reads the peer's blocks R into local L (checked against
//!                                     the peer's pattern), then writes local L into its R:
//!                                     `TRANSFERRED {"error": null|"...", "stats": {...}}`
//!     stats                           `STATS <counters>`
//!     unregister <region>             unregisters region <region> (0-based) through the engine
//!                                     (every transport first) and prints
//!                                     `UNREGISTERED {"error": null|"...", "kind": ...}`
//!     quit                            shuts the engine down and exits
//! ```
//!
//! Everything else comes from the environment, as in a real deployment: `FERRY_ASCEND_LIB_DIR`
//! (or a CANN install), `LOCAL_RANK`, `ASCEND_RT_VISIBLE_DEVICES`, `FERRY_HCCN_CONF`,
//! `FERRY_TRANSFER_TIMEOUT_MS`. Metadata is the P2P handshake; the segment is `127.0.0.1:<port>`.

use std::io::BufRead;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use ferry::{BlockTransfer, Config, KvLayout, Location, Opcode};
use ferry_transport_hccl::HcclTransportFactory;
use ferry_transport_hccl::runtime::{Device, DeviceBuffer, HostBuffer};
use ferry_transport_hccl::sys::Library;

/// Byte `offset` of block `block` of region `region` in the pattern of `seed`.
fn pattern(seed: u64, region: u64, block: u64, offset: u64) -> u8 {
    (seed.wrapping_mul(131) ^ region.wrapping_mul(31) ^ block.wrapping_mul(7) ^ offset.wrapping_mul(13)) as u8
}

/// A KV region in device memory, pinned host memory (`aclrtMallocHost`) or plain host memory.
enum Mem {
    Device(DeviceBuffer),
    Pinned(HostBuffer),
    Host(Vec<u8>),
}

impl Mem {
    fn addr(&self) -> u64 {
        match self {
            Mem::Device(d) => d.addr(),
            Mem::Pinned(h) => h.addr(),
            Mem::Host(v) => v.as_ptr() as u64,
        }
    }
    fn write(&mut self, off: usize, data: &[u8]) -> anyhow::Result<()> {
        match self {
            Mem::Device(d) => Ok(d.write(off, data)?),
            Mem::Pinned(h) => {
                h.as_mut_slice()[off..off + data.len()].copy_from_slice(data);
                Ok(())
            }
            Mem::Host(v) => {
                v[off..off + data.len()].copy_from_slice(data);
                Ok(())
            }
        }
    }
    fn read(&self, off: usize, out: &mut [u8]) -> anyhow::Result<()> {
        match self {
            Mem::Device(d) => Ok(d.read(off, out)?),
            Mem::Pinned(h) => {
                // SAFETY: the buffer lives while `self` does; the engine writes it through raw
                // pointers, so it is read through one too (volatile-free but not assumed
                // unchanged: `black_box` below).
                let all = unsafe { std::slice::from_raw_parts(h.addr() as *const u8, h.len()) };
                out.copy_from_slice(&std::hint::black_box(all)[off..off + out.len()]);
                Ok(())
            }
            Mem::Host(v) => {
                // The engine writes through raw pointers: keep the compiler from assuming
                // nothing changed.
                let v = std::hint::black_box(v);
                out.copy_from_slice(&v[off..off + out.len()]);
                Ok(())
            }
        }
    }
}

struct Args {
    role: String,
    peer: Option<String>,
    peer_layout: Option<String>,
    host_memory: bool,
    /// Host memory from the Rust allocator (not `aclrtMallocHost`).
    plain_host_memory: bool,
    /// Registers with location `*` (Mooncake's default) instead of `npu:N`/`cpu:0`.
    any_location: bool,
    regions: u64,
    blocks: u32,
    block_len: u64,
    /// Reads through the async API (`submit_blocks` on the runtime) instead of
    /// `submit_blocks_for_blocking_wait` from this thread, which holds the device's context:
    /// the transport then hands each batch to its device thread instead of running it here.
    async_submit: bool,
    read: Vec<(u32, u32)>,
    write: Vec<(u32, u32)>,
    expect_failure: bool,
    expect_timeout: bool,
    wait_release: bool,
    repeat: u32,
    stay: bool,
}

fn pairs(s: &str) -> anyhow::Result<Vec<(u32, u32)>> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (a, b) = p.split_once(':').context("block pairs are A:B")?;
            Ok((a.parse()?, b.parse()?))
        })
        .collect()
}

fn parse_args() -> anyhow::Result<Args> {
    let mut it = std::env::args().skip(1);
    let role = it.next().context("usage: ascend_peer prefill|decode [options]")?;
    let mut a = Args {
        role,
        peer: None,
        peer_layout: None,
        host_memory: false,
        plain_host_memory: false,
        any_location: false,
        regions: 4,
        blocks: 64,
        block_len: 4096,
        read: pairs("3:0,4:1,5:2,9:3,40:4")?,
        write: pairs("6:20,7:21")?,
        expect_failure: false,
        expect_timeout: false,
        wait_release: true,
        repeat: 1,
        async_submit: false,
        stay: false,
    };
    while let Some(flag) = it.next() {
        let mut val = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--peer" => a.peer = Some(val()?),
            "--peer-layout" => a.peer_layout = Some(val()?),
            "--host-memory" => a.host_memory = true,
            "--plain-host-memory" => a.plain_host_memory = true,
            "--any-location" => a.any_location = true,
            "--regions" => a.regions = val()?.parse()?,
            "--blocks" => a.blocks = val()?.parse()?,
            "--block-len" => a.block_len = val()?.parse()?,
            "--read" => a.read = pairs(&val()?)?,
            "--write" => a.write = pairs(&val()?)?,
            "--expect-failure" => a.expect_failure = true,
            "--expect-timeout" => a.expect_timeout = true,
            "--no-wait-release" => a.wait_release = false,
            "--repeat" => a.repeat = val()?.parse()?,
            "--async-submit" => a.async_submit = true,
            "--stay" => a.stay = true,
            other => bail!("unknown option {other}"),
        }
    }
    Ok(a)
}

/// The transport's counters, as JSON.
fn stats_json() -> serde_json::Value {
    let s = ferry_transport_hccl::stats();
    serde_json::json!({
        "one_sided_batches": s.one_sided_batches,
        "two_sided_chunks": s.two_sided_chunks,
        "failed_attempts": s.failed_attempts,
        "communicators_built": s.communicators_built,
        "one_sided_calls": s.one_sided_calls,
        "threads_left_running": s.threads_left_running,
        "handoffs": s.handoffs,
        "on_caller_thread": s.on_caller_thread,
    })
}

/// Moves blocks between this process and `peer`: `pairs` are `(local, remote)` block numbers.
fn move_blocks(
    rt: &tokio::runtime::Runtime,
    engine: &ferry::TransferEngine,
    local_layout: ferry::KvLayoutId,
    peer: ferry::SegmentHandle,
    peer_layout: &KvLayout,
    opcode: Opcode,
    pairs: &[(u32, u32)],
) -> anyhow::Result<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    let (local, remote): (Vec<u32>, Vec<u32>) = pairs.iter().copied().unzip();
    let spec = BlockTransfer::new(opcode, &local, &remote);
    let batch = rt.block_on(engine.submit_blocks(local_layout, peer, peer_layout, &spec))?;
    batch
        .wait_blocking(engine.transfer_timeout())
        .with_context(|| format!("{opcode:?} of blocks {pairs:?} (failed: {:?})", batch.failed_blocks()))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("ascend_peer: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let args = parse_args()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut cfg = Config::from_json_str(
        r#"{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "ascend"}"#,
        None,
    )?;
    cfg.apply_env(|k| std::env::var(k).ok())?;
    let transports = ferry::TransportRegistry::new().with(Arc::new(HcclTransportFactory::new()));
    let engine = rt.block_on(ferry::builder().config(cfg).transports(transports).build())?;

    // This thread holds the device memory, bound to the same device as the engine.
    let user: u32 = std::env::var("LOCAL_RANK").ok().map(|v| v.parse()).transpose()?.unwrap_or(0);
    let lib = Library::load()?;
    let device = Device::bind(&lib, user)?;
    let acl_device = device.current()?;
    let region_len = u64::from(args.blocks) * args.block_len;
    let mut mems: Vec<Mem> = Vec::new();
    for _ in 0..args.regions {
        mems.push(if args.plain_host_memory {
            Mem::Host(vec![0u8; region_len as usize])
        } else if args.host_memory {
            let mut h = device.alloc_host(region_len as usize)?;
            h.as_mut_slice().fill(0);
            Mem::Pinned(h)
        } else {
            // KV caches are large allocations in huge pages (what torch_npu hands vLLM), which
            // engines of one server can share over HCCS IPC.
            let d = device.alloc_huge(region_len as usize)?;
            d.write(0, &vec![0u8; region_len as usize])?;
            Mem::Device(d)
        });
    }
    let location = if args.any_location {
        Location::Any
    } else if args.host_memory || args.plain_host_memory {
        Location::Cpu(0)
    } else {
        Location::Npu(user)
    };
    let seed = if args.role == "prefill" { 1 } else { 2 };
    for (r, m) in mems.iter_mut().enumerate() {
        for b in 0..u64::from(args.blocks) {
            let data: Vec<u8> = (0..args.block_len).map(|o| pattern(seed, r as u64, b, o)).collect();
            m.write((b * args.block_len) as usize, &data)?;
        }
    }
    let regions: Vec<(u64, u64, Location)> = mems.iter().map(|m| (m.addr(), region_len, location.clone())).collect();
    // SAFETY: the buffers live until the end of this function, after the engine shut down,
    // and are only read through the ACL (or after transfers completed) meanwhile.
    rt.block_on(unsafe { engine.register_memory_batch(&regions) })?;
    let bases: Vec<u64> = mems.iter().map(Mem::addr).collect();
    let layout = KvLayout::uniform(&bases, args.blocks, args.block_len);
    let local_layout = engine.register_kv_layout(layout.clone())?;
    let me = engine.local_descriptor();

    let verify = |mems: &[Mem], pairs: &[(u32, u32)], seed: u64| -> anyhow::Result<()> {
        let mut got = vec![0u8; args.block_len as usize];
        for (r, m) in mems.iter().enumerate() {
            for &(dst, src) in pairs {
                m.read((u64::from(dst) * args.block_len) as usize, &mut got)?;
                for (o, &byte) in got.iter().enumerate() {
                    let want = pattern(seed, r as u64, u64::from(src), o as u64);
                    if byte != want {
                        bail!(
                            "region {r} block {dst} byte {o} is {byte}, expected {want} (block {src} of seed {seed})"
                        );
                    }
                }
            }
        }
        Ok(())
    };

    // Reads the peer's blocks (remote, local), checks them against its pattern, then writes
    // local blocks into the peer's (local, remote).
    let transfer = |segment: &str, peer_layout: &str, reads: &[(u32, u32)], writes: &[(u32, u32)], peer_seed: u64| {
        let peer_layout: KvLayout = serde_json::from_str(peer_layout).context("the peer layout")?;
        let peer = rt.block_on(engine.open_segment(segment))?;
        let local_remote: Vec<(u32, u32)> = reads.iter().map(|&(r, l)| (l, r)).collect();
        move_blocks(&rt, &engine, local_layout, peer, &peer_layout, Opcode::Read, &local_remote)?;
        verify(&mems, &local_remote, peer_seed).context("the blocks read from the peer")?;
        move_blocks(&rt, &engine, local_layout, peer, &peer_layout, Opcode::Write, writes)
    };
    let list = |word: &str| if word == "-" { Ok(Vec::new()) } else { pairs(word) };
    // The stdin commands (see the header), until `quit` or end of input.
    let commands = || -> anyhow::Result<()> {
        for line in std::io::stdin().lock().lines() {
            let line = line?;
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["verify", list, seed] => match verify(&mems, &pairs(list)?, seed.parse()?) {
                    Ok(()) => println!("VERIFIED ok"),
                    Err(e) => println!("VERIFIED bad {e:#}"),
                },
                ["transfer", segment, layout, reads, writes, seed] => {
                    let result = transfer(segment, layout, &list(reads)?, &list(writes)?, seed.parse()?);
                    let error = result.err().map(|e| format!("{e:#}"));
                    println!("TRANSFERRED {}", serde_json::json!({ "error": error, "stats": stats_json() }));
                }
                ["stats"] => println!("STATS {:?}", ferry_transport_hccl::stats()),
                ["unregister", region] => {
                    let base = mems.get(region.parse::<usize>()?).context("no such region")?.addr();
                    let result = rt.block_on(engine.unregister_memory(base));
                    let (error, kind) = match &result {
                        Ok(()) => (None, None),
                        Err(e) => (Some(e.to_string()), Some(e.kind().as_str())),
                    };
                    println!("UNREGISTERED {}", serde_json::json!({ "error": error, "kind": kind }));
                }
                ["quit"] => break,
                [] => {}
                _ => println!("ERROR unknown command {line:?}"),
            }
        }
        Ok(())
    };

    if args.role == "prefill" {
        let ready = serde_json::json!({
            "segment": engine.segment_name(),
            "layout": layout,
            "rank_info": me.rank_info,
            "buffers": me.buffers,
            "acl_device": acl_device,
        });
        println!("READY {ready}");
        commands()?;
    } else {
        let peer_name = args.peer.clone().context("decode needs --peer")?;
        let peer_layout: KvLayout =
            serde_json::from_str(args.peer_layout.as_deref().context("decode needs --peer-layout")?)?;
        let peer = rt.block_on(engine.open_segment(&peer_name))?;
        let peer_desc = engine.segment(peer)?.descriptor().clone();
        let (remote, local): (Vec<u32>, Vec<u32>) = args.read.iter().copied().unzip();
        let spec = BlockTransfer::read(&local, &remote);
        let before_reads = ferry_transport_hccl::stats();
        let engine_before_reads = engine.stats();
        let started = Instant::now();
        let mut read_ok = true;
        if args.expect_timeout {
            // The read must time out: when does the caller hear of it, and when does the
            // transport let go of the batch's memory?
            let batch = rt.block_on(engine.submit_blocks(local_layout, peer, &peer_layout, &spec))?;
            let waited = batch.batch().wait_blocking(engine.transfer_timeout() + std::time::Duration::from_secs(30));
            let seen = started.elapsed();
            let released_when_seen = batch.batch().all_released();
            let first = batch.batch().errors().into_iter().next().map(|(_, e)| e);
            let mut released = None;
            if args.wait_release {
                while started.elapsed() < std::time::Duration::from_secs(60) {
                    if batch.batch().all_released() {
                        released = Some(started.elapsed());
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
            let out = serde_json::json!({
                "waited": waited.as_ref().map(|s| format!("{s:?}")).map_err(|e| e.to_string()),
                "kind": first.as_ref().map(|e| e.kind().as_str()),
                "error": first.as_ref().map(|e| e.to_string()),
                "seen_ms": seen.as_millis() as u64,
                "released_when_seen": released_when_seen,
                "released_ms": released.map(|d| d.as_millis() as u64),
                "stats": stats_json(),
            });
            println!("TIMED_OUT {out}");
            read_ok = false;
        }
        // Per batch: wall time minus the device jobs' time (the transport's own overhead), for
        // the distribution; the mean is the totals' difference below.
        let mut overheads_ns: Vec<i64> = Vec::with_capacity(if read_ok { args.repeat as usize } else { 0 });
        for _ in 0..if read_ok { args.repeat } else { 0 } {
            let device_before = ferry_transport_hccl::stats().device_ns;
            let batch_started = Instant::now();
            // This thread holds the device's context (it allocated the device memory) and waits
            // for each batch at once: the transport may run the batch here.
            let batch = if args.async_submit {
                rt.block_on(engine.submit_blocks(local_layout, peer, &peer_layout, &spec))?
            } else {
                engine.submit_blocks_for_blocking_wait(local_layout, peer, &peer_layout, &spec)?
            };
            if let Err(e) = batch.wait_blocking(engine.transfer_timeout()) {
                if !args.expect_failure {
                    return Err(e).context(format!("reading blocks {:?}", batch.failed_blocks()));
                }
                let failed = serde_json::json!({
                    "error": e.to_string(),
                    "kind": e.kind().as_str(),
                    "source": std::error::Error::source(&e).map(|s| s.to_string()),
                    "failed_blocks": batch.failed_blocks(),
                    "stats": format!("{:?}", ferry_transport_hccl::stats()),
                });
                println!("FAILED {failed}");
                read_ok = false;
                break;
            }
            let wall = i64::try_from(batch_started.elapsed().as_nanos()).unwrap_or(i64::MAX);
            let device = ferry_transport_hccl::stats().device_ns.saturating_sub(device_before);
            overheads_ns.push(wall.saturating_sub(i64::try_from(device).unwrap_or(i64::MAX)));
        }
        let read_time = started.elapsed();
        overheads_ns.sort_unstable();
        let overhead_us = |q: f64| {
            let last = overheads_ns.len().saturating_sub(1);
            overheads_ns.get((last as f64 * q).round() as usize).map(|&ns| ns as f64 / 1e3)
        };
        let after_reads = ferry_transport_hccl::stats();
        let engine_after_reads = engine.stats();
        if read_ok {
            let checks: Vec<(u32, u32)> = args.read.iter().map(|&(r, l)| (l, r)).collect();
            verify(&mems, &checks, 1).context("the blocks read from the prefill process")?;
            if args.expect_failure {
                bail!("the read succeeded but a failure was expected");
            }
            let (wl, wr): (Vec<u32>, Vec<u32>) = args.write.iter().copied().unzip();
            let spec = BlockTransfer::write(&wl, &wr);
            let batch = rt.block_on(engine.submit_blocks(local_layout, peer, &peer_layout, &spec))?;
            batch.wait_blocking(engine.transfer_timeout()).context("writing blocks to the prefill process")?;
            let done = serde_json::json!({
                "segment": engine.segment_name(),
                "layout": layout,
                "rank_info": me.rank_info,
                "buffers": me.buffers,
                "peer_rank_info": peer_desc.rank_info,
                "acl_device": acl_device,
                "read_us_per_batch": read_time.as_secs_f64() * 1e6 / f64::from(args.repeat.max(1)),
                "device_us_per_read_batch": (after_reads.device_ns - before_reads.device_ns) as f64 / 1e3 / f64::from(args.repeat.max(1)),
                "overhead_us_p50": overhead_us(0.5),
                "overhead_us_p90": overhead_us(0.9),
                "handoffs_per_read_batch": (after_reads.handoffs - before_reads.handoffs) as f64 / f64::from(args.repeat.max(1)),
                "on_caller_per_read_batch": (after_reads.on_caller_thread - before_reads.on_caller_thread) as f64 / f64::from(args.repeat.max(1)),
                // Blocking waits that polled the batch's expected end, and those that saw it end.
                "tail_polls_per_read_batch": (engine_after_reads.tail_polls - engine_before_reads.tail_polls) as f64 / f64::from(args.repeat.max(1)),
                "tail_polls_caught_per_read_batch": (engine_after_reads.tail_polls_caught - engine_before_reads.tail_polls_caught) as f64 / f64::from(args.repeat.max(1)),
                "stats": stats_json(),
            });
            println!("DONE {done}");
            if args.stay {
                commands()?;
            }
        }
    }
    let shut = rt.block_on(engine.shutdown());
    let left = ferry_transport_hccl::stats().threads_left_running;
    let error = shut.as_ref().err().map(|e| format!("{e:#}"));
    println!("SHUTDOWN {}", serde_json::json!({ "error": error, "threads_left_running": left }));
    if left > 0 || shut.is_err() {
        // A device thread may still write into these buffers: never free them.
        std::mem::forget(mems);
        if args.expect_timeout {
            return Ok(());
        }
    } else {
        drop(mems);
    }
    shut?;
    Ok(())
}
