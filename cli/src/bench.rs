//! `ferry bench`: the flags of Mooncake's `transfer_engine_bench`, so the two can be swapped in
//! one command line, plus latency percentiles, a progress bar and JSON output.
//!
//! Target: `ferry bench --mode=target --metadata_server=P2PHANDSHAKE --local_server_name=127.0.0.1`
//! prints `listening on <host>:<port>` and serves its buffer until interrupted.
//! Initiator: `ferry bench --segment_id=<host>:<port> --operation=read --block_size=65536 ...`
//! ends with Mooncake's `throughput X GB/s` line.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::{Args, ValueEnum};
use ferry::{ByteSize, Config, Location, Opcode, TransferEngine, TransferRequest};
use indicatif::{ProgressBar, ProgressStyle};

use crate::stats::{fmt_latency, percentile};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Target,
    Initiator,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Operation {
    Read,
    Write,
}

/// Which blocks of the buffers each batch moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Access {
    /// As Mooncake's `transfer_engine_bench` does: every batch of thread `t` moves the same
    /// blocks, request `i` at block `i * threads + t` on both sides. The blocks stay warm in the
    /// CPU caches when a thread's batch fits there.
    Same,
    /// Each batch moves the blocks after the previous one's, rotating through the whole buffer:
    /// memory no cache holds, as KV blocks moved once are.
    Rotate,
}

impl Access {
    /// The block (of `slots` in the buffer) that request `i` of thread `t`'s batch number
    /// `round` moves, with `threads` threads of `batch` requests. Every block is below `slots`,
    /// and within one round no two threads move the same block when `batch * threads <= slots`.
    fn slot(self, round: u64, threads: u64, t: u64, batch: u64, i: u64, slots: u64) -> u64 {
        let (threads, t, batch, i, slots) =
            (threads as u128, t as u128, batch as u128, i as u128, slots.max(1) as u128);
        let slot = match self {
            Access::Same => (i * threads + t) % slots,
            // Thread t takes every threads-th group of batch blocks: ((round * threads + t) *
            // batch + i) mod slots, reduced on the way (u128 cannot overflow here).
            Access::Rotate => (((round as u128 % slots) * threads + t) % slots * batch + i) % slots,
        };
        slot as u64
    }
}

/// Options of `ferry bench` (names and defaults as in Mooncake's `transfer_engine_bench`, except
/// where noted).
#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Running mode: the initiator reads/writes blocks of the target's buffer.
    #[arg(long, value_enum, default_value_t = Mode::Initiator)]
    mode: Mode,
    /// Transfer protocol.
    #[arg(long, default_value = "tcp")]
    protocol: String,
    /// Metadata server (Mooncake's default is an etcd address; Ferry's is P2PHANDSHAKE).
    #[arg(long = "metadata_server", default_value = "P2PHANDSHAKE")]
    metadata_server: String,
    /// Local server name for segment discovery.
    #[arg(long = "local_server_name", default_value = "127.0.0.1")]
    local_server_name: String,
    /// Segment to access (initiator): the target's `listening on` address with P2PHANDSHAKE.
    #[arg(long = "segment_id")]
    segment_id: Option<String>,
    /// Operation: read or write.
    #[arg(long, value_enum, default_value_t = Operation::Read)]
    operation: Operation,
    /// Total size of the data buffer (units accepted: 1GiB, 512MB).
    #[arg(long = "buffer_size", default_value = "1GiB", value_parser = parse_size)]
    buffer_size: u64,
    /// Bytes per transfer request.
    #[arg(long = "block_size", default_value = "65536", value_parser = parse_size)]
    block_size: u64,
    /// Requests per batch.
    #[arg(long = "batch_size", default_value_t = 128)]
    batch_size: u32,
    /// Submitting threads (Mooncake's default is 12).
    #[arg(long, default_value_t = 4)]
    threads: u32,
    /// Test duration in seconds.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Throughput unit: GB, GiB, Gb, MB, MiB, Mb, KB, KiB, Kb.
    #[arg(long = "report_unit", default_value = "GB")]
    report_unit: String,
    /// Digits after the decimal point.
    #[arg(long = "report_precision", default_value_t = 2)]
    report_precision: usize,
    /// Which blocks each batch moves: `same` (Mooncake's bench: every batch of a thread moves
    /// the same blocks, warm in the caches when they fit) or `rotate` (each batch the next
    /// blocks of the buffer, cold memory). Not in Mooncake's bench; before 2026-12-02 Ferry's
    /// bench always rotated.
    #[arg(long, value_enum, default_value_t = Access::Same)]
    access: Access,
    /// Print a JSON summary on stdout instead of text.
    #[arg(long)]
    json: bool,
    /// Where the buffer lives: `cpu:0` (host memory), or `npu:N` (device memory of user device
    /// N, the N-th card `ASCEND_RT_VISIBLE_DEVICES` leaves visible, allocated with `aclrtMalloc`
    /// on a thread bound with `aclrtSetDevice`; for `--protocol=ascend`). Not in Mooncake's bench.
    #[arg(long, default_value = "cpu:0", value_parser = parse_device)]
    device: Location,
}

fn parse_device(s: &str) -> Result<Location, String> {
    match s.parse::<Location>() {
        Ok(loc @ (Location::Cpu(_) | Location::Npu(_))) => Ok(loc),
        Ok(other) => Err(format!("{other} buffers are not supported (cpu:0 or npu:N)")),
        Err(e) => Err(e.to_string()),
    }
}

/// The benchmark's buffer: host memory, or device memory with the thread binding that made it
/// (both stay on this thread: ACL state is per thread).
enum Buffer {
    Host(Vec<u8>),
    Npu { mem: ferry::transports::hccl::runtime::DeviceBuffer, _device: ferry::transports::hccl::runtime::Device },
}

impl Buffer {
    /// `len` bytes where `--device` says, every page touched before timing starts.
    fn new(device: &Location, len: usize) -> Result<Buffer> {
        match device {
            Location::Npu(user) => {
                use ferry::transports::hccl::runtime::Device;
                use ferry::transports::hccl::sys::Library;
                let lib = Library::load().context("loading CANN for --device")?;
                let dev = Device::bind(&lib, *user).with_context(|| format!("binding this thread to npu:{user}"))?;
                let mem = dev.alloc(len).with_context(|| format!("allocating {len} bytes on npu:{user}"))?;
                // A pattern, so that a transfer that moved nothing is not all zeros either way.
                let chunk: Vec<u8> = (0..(1usize << 20).min(len)).map(|i| (i / 4096) as u8).collect();
                for off in (0..len).step_by(chunk.len()) {
                    let n = chunk.len().min(len - off);
                    mem.write(off, &chunk[..n]).context("filling the device buffer")?;
                }
                Ok(Buffer::Npu { mem, _device: dev })
            }
            _ => {
                let mut buffer = vec![0u8; len];
                for (i, chunk) in buffer.chunks_mut(4096).enumerate() {
                    chunk[0] = i as u8;
                }
                Ok(Buffer::Host(buffer))
            }
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Buffer::Host(v) => v.as_ptr() as u64,
            Buffer::Npu { mem, .. } => mem.addr(),
        }
    }
}

/// The segment an initiator reads and writes, checked: given, not empty, and `host:port` when
/// it is looked up through the P2P handshake (the target's `listening on` line). `None` for a
/// target.
fn initiator_segment(args: &BenchArgs) -> Result<Option<String>> {
    if args.mode == Mode::Target {
        return Ok(None);
    }
    let segment = args.segment_id.as_deref().map(str::trim).unwrap_or_default();
    ensure!(
        !segment.is_empty(),
        "--segment_id is required in initiator mode: the address the target printed after `listening on` \
         (start one with `ferry bench --mode=target`)"
    );
    if args.metadata_server.eq_ignore_ascii_case("P2PHANDSHAKE") {
        ensure!(
            ferry::SegmentName::parse(segment).is_some(),
            "--segment_id={segment:?}: with --metadata_server=P2PHANDSHAKE a segment is host:port (the address the \
             target printed after `listening on`, e.g. 127.0.0.1:15001)"
        );
    }
    Ok(Some(segment.to_owned()))
}

/// The batch-latency percentiles the summary prints, as text and as JSON (`batch_latency_us`),
/// by the same names.
const PERCENTILES: [(&str, f64); 4] = [("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p999", 99.9)];

fn parse_size(s: &str) -> Result<u64, String> {
    ByteSize::parse(s).map(|b| b.0).and_then(|b| if b == 0 { Err("size must be non-zero".into()) } else { Ok(b) })
}

fn unit_divisor(unit: &str) -> Result<f64> {
    Ok(match unit {
        "GB" => 1e9,
        "GiB" => (1u64 << 30) as f64,
        "Gb" => 1e9 / 8.0,
        "MB" => 1e6,
        "MiB" => (1u64 << 20) as f64,
        "Mb" => 1e6 / 8.0,
        "KB" => 1e3,
        "KiB" => 1024.0,
        "Kb" => 1e3 / 8.0,
        other => bail!("--report_unit {other:?} is not one of GB, GiB, Gb, MB, MiB, Mb, KB, KiB, Kb"),
    })
}

/// Peak resident set size of this process (Linux `VmHWM`), in bytes.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

async fn engine(args: &BenchArgs) -> Result<TransferEngine> {
    let cfg = serde_json::json!({
        "local_hostname": args.local_server_name,
        "metadata_server": args.metadata_server,
        "protocol": args.protocol,
    });
    let mut config = Config::from_json_str(&cfg.to_string(), None)?;
    config.apply_env(|k| std::env::var(k).ok())?;
    Ok(ferry::builder().config(config).build().await?)
}

pub(crate) async fn run(args: BenchArgs) -> Result<std::process::ExitCode> {
    ensure!(args.block_size <= args.buffer_size, "--block_size must not exceed --buffer_size");
    ensure!(args.batch_size > 0 && args.threads > 0, "--batch_size and --threads must be at least 1");
    let divisor = unit_divisor(&args.report_unit)?;
    // Arguments are checked before the buffer is allocated and registered (seconds for 1 GiB).
    let segment = initiator_segment(&args)?;
    let len = usize::try_from(args.buffer_size).context("--buffer_size too large for this machine")?;
    // The buffer is touched once so its pages exist before timing starts.
    let buffer = Buffer::new(&args.device, len)?;
    let engine = engine(&args).await?;
    let base = buffer.addr();
    // SAFETY: `buffer` lives until after `engine.shutdown()` below and is not read by Rust code
    // while transfers run.
    unsafe { engine.register_memory(base, args.buffer_size, args.device.clone()).await }
        .context("registering the buffer")?;

    if args.mode == Mode::Target {
        println!("listening on {}", engine.segment_name());
        eprintln!("ferry bench target: serving {} bytes; stop with Ctrl-C or SIGTERM", args.buffer_size);
        wait_for_signal().await?;
        engine.shutdown().await?;
        drop(buffer);
        return Ok(std::process::ExitCode::SUCCESS);
    }

    let segment = segment.expect("initiator mode has a segment");
    let peer = engine.open_segment(&segment).await?;
    let remote = engine.segment(peer)?;
    let rbuf = remote.descriptor().buffers.first().cloned().context("the target publishes no buffer")?;
    let span = rbuf.length.min(args.buffer_size);
    ensure!(span >= args.block_size, "the target's buffer ({} bytes) is smaller than --block_size", rbuf.length);
    let slots = span / args.block_size;
    let batch_blocks = u64::from(args.batch_size) * u64::from(args.threads);
    ensure!(
        batch_blocks <= slots,
        "the buffer holds {slots} blocks of --block_size, fewer than --batch_size x --threads = {batch_blocks}: \
         threads would move the same blocks at once (raise --buffer_size, on both sides)"
    );
    let opcode = if args.operation == Operation::Read { Opcode::Read } else { Opcode::Write };

    let stop = Arc::new(AtomicBool::new(false));
    let bytes = Arc::new(AtomicU64::new(0));
    let bar = if args.json { ProgressBar::hidden() } else { ProgressBar::new(args.duration) };
    bar.set_style(
        ProgressStyle::with_template("[{bar:40}] {pos}/{len} s  {msg}").expect("static template").progress_chars("=> "),
    );
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..args.threads {
        let (engine, stop, bytes) = (engine.clone(), stop.clone(), bytes.clone());
        let (batch_size, block, timeout) = (args.batch_size as u64, args.block_size, engine.transfer_timeout());
        let (lbase, rbase, threads, access) = (base, rbuf.addr, u64::from(args.threads), args.access);
        // Submitting threads are OS threads calling the blocking API, as Mooncake's bench and
        // Ferry's C and Python callers do.
        tasks.push(std::thread::spawn(move || {
            let mut latencies = Vec::new();
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let reqs: Vec<TransferRequest> = (0..batch_size)
                    .map(|i| {
                        let slot = access.slot(round, threads, u64::from(t), batch_size, i, slots);
                        TransferRequest {
                            opcode,
                            source: lbase + slot * block,
                            target: peer,
                            target_offset: rbase + slot * block,
                            length: block,
                        }
                    })
                    .collect();
                let t0 = Instant::now();
                // The thread waits for its batch at once: a transport may run it on this thread.
                engine.submit_for_blocking_wait(&reqs)?.wait_ok_blocking(timeout)?;
                latencies.push(t0.elapsed());
                bytes.fetch_add(batch_size * block, Ordering::Relaxed);
                round += 1;
            }
            anyhow::Ok(latencies)
        }));
    }
    let deadline = started + Duration::from_secs(args.duration);
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200).min(deadline - Instant::now())).await;
        let secs = started.elapsed().as_secs_f64();
        bar.set_position(secs as u64);
        bar.set_message(format!("{:.2} {}/s", bytes.load(Ordering::Relaxed) as f64 / secs / divisor, args.report_unit));
        if tasks.iter().any(|t| t.is_finished()) {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for t in tasks {
        let joined = tokio::task::spawn_blocking(move || t.join()).await?;
        latencies.extend(joined.map_err(|_| anyhow::anyhow!("a submitting thread panicked"))??);
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    latencies.sort_unstable();
    let moved = bytes.load(Ordering::Relaxed);
    let rate = moved as f64 / elapsed.as_secs_f64() / divisor;
    let p = args.report_precision;
    let peak = peak_rss();
    // A closed stdout (`| head -1`) must not turn into a panic: output errors are ignored.
    let mut out = std::io::stdout().lock();
    if args.json {
        let _ = writeln!(
            out,
            "{}",
            serde_json::json!({
                "operation": format!("{:?}", args.operation).to_lowercase(),
                "protocol": args.protocol,
                "block_size": args.block_size,
                "batch_size": args.batch_size,
                "threads": args.threads,
                "duration_s": elapsed.as_secs_f64(),
                "bytes": moved,
                "batches": latencies.len(),
                "throughput": rate,
                "unit": format!("{}/s", args.report_unit),
                "batch_latency_us": PERCENTILES
                    .iter()
                    .map(|&(name, p)| (name.to_owned(), serde_json::json!(percentile(&latencies, p).as_secs_f64() * 1e6)))
                    .collect::<serde_json::Map<_, _>>(),
                "peak_rss_bytes": peak,
                "buffer_bytes": args.buffer_size,
                "access": format!("{:?}", args.access).to_lowercase(),
                "device": args.device.to_string(),
            })
        );
    } else {
        let _ = writeln!(
            out,
            "Test completed: duration {:.2}, batch count {}, batch latency {}, peak RSS {} MiB (buffer {} MiB)",
            elapsed.as_secs_f64(),
            latencies.len(),
            PERCENTILES
                .iter()
                .map(|&(name, p)| format!("{name} {}", fmt_latency(percentile(&latencies, p))))
                .collect::<Vec<_>>()
                .join(" "),
            peak.map(|b| b >> 20).unwrap_or(0),
            args.buffer_size >> 20,
        );
        let _ = writeln!(out, "throughput {rate:.p$} {}/s", args.report_unit);
    }
    drop(out);
    engine.shutdown().await?;
    drop(buffer);
    Ok(std::process::ExitCode::SUCCESS)
}

async fn wait_for_signal() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Access;
    use proptest::prelude::*;

    #[test]
    fn same_moves_the_blocks_mooncakes_bench_moves() {
        // transfer_engine_bench: source = addr + block_size * (i * threads + thread_id), every batch.
        for round in [0, 1, 7] {
            assert_eq!(Access::Same.slot(round, 2, 1, 4, 3, 1024), 3 * 2 + 1);
        }
        assert_eq!(Access::Rotate.slot(0, 2, 1, 4, 3, 1024), 4 + 3);
        assert_eq!(Access::Rotate.slot(1, 2, 1, 4, 3, 1024), (2 + 1) * 4 + 3);
    }

    proptest! {
        #[test]
        fn every_block_is_inside_the_buffer_and_threads_of_a_round_never_share_one(
            round in any::<u64>(),
            threads in 1u64..=64,
            batch in 1u64..=256,
            extra in 0u64..=1 << 20,
            rotate in any::<bool>(),
        ) {
            let access = if rotate { Access::Rotate } else { Access::Same };
            let slots = threads * batch + extra;
            let mut seen = std::collections::HashSet::new();
            for t in 0..threads {
                for i in 0..batch {
                    let slot = access.slot(round, threads, t, batch, i, slots);
                    prop_assert!(slot < slots);
                    prop_assert!(seen.insert(slot), "block {slot} moved twice in round {round}");
                }
            }
        }

        #[test]
        fn extreme_arguments_stay_inside_the_buffer(
            round in any::<u64>(), threads in any::<u64>(), t in any::<u64>(), batch in any::<u64>(),
            i in any::<u64>(), slots in any::<u64>(), rotate in any::<bool>(),
        ) {
            let access = if rotate { Access::Rotate } else { Access::Same };
            prop_assert!(access.slot(round, threads, t, batch, i, slots) < slots.max(1));
        }
    }
}
