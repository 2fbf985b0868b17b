//! `ferry demo`: two engines on the embedded default, KV-shaped buffers, block-level transfers
//! in both directions with every moved block verified by checksum.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use ferry::{BlockTransfer, ByteSize, KvLayout, Location, Opcode, TransferEngine};
use indicatif::{ProgressBar, ProgressStyle};

use crate::stats::{fmt_latency, gb_per_s, percentile};

/// Options of `ferry demo`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Model layers; each has a K and a V region.
    #[arg(long, default_value_t = 4)]
    layers: u32,
    /// Blocks per region.
    #[arg(long, default_value_t = 128)]
    blocks: u32,
    /// Bytes per block (accepts units: 16KiB, 1MB).
    #[arg(long, default_value = "16KiB", value_parser = parse_size)]
    block_size: u64,
    /// Block transfers per direction.
    #[arg(long, default_value_t = 200)]
    transfers: u32,
    /// Blocks per transfer (a request's share of the KV cache).
    #[arg(long, default_value_t = 16)]
    blocks_per_transfer: u32,
    /// Seed of the block selection.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Run the prefill engine in a second process and move blocks over TCP (P2P handshake)
    /// instead of between two engines of this process.
    #[arg(long)]
    two_process: bool,
    /// Internal: be the prefill process of `--two-process`.
    #[arg(long, hide = true)]
    serve_prefill: bool,
}

/// P2P handshake + TCP on loopback: the two-process demo's engines.
fn tcp_config() -> Result<ferry::Config> {
    let mut c = ferry::Config::from_json_str(
        r#"{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}"#,
        None,
    )?;
    c.apply_env(|k| std::env::var(k).ok())?;
    Ok(c)
}

/// The prefill process of `--two-process`: serves its KV cache until its stdin closes.
async fn serve_prefill(args: &DemoArgs, regions: usize) -> Result<std::process::ExitCode> {
    let engine = ferry::builder().config(tcp_config()?).build().await.context("starting the prefill engine")?;
    let cache = KvCache::new(regions, args.blocks, args.block_size, Some(args.seed))?;
    cache.register(&engine).await?;
    println!("{}", serde_json::json!({"segment": engine.segment_name(), "bases": cache.bases()}));
    use std::io::Read;
    let _ = tokio::task::spawn_blocking(|| std::io::stdin().read_to_end(&mut Vec::new())).await;
    engine.shutdown().await?;
    drop(cache);
    Ok(std::process::ExitCode::SUCCESS)
}

/// Where the prefill side lives.
enum Prefill {
    /// An engine of this process (with its cache, which must outlive it).
    InProcess { engine: TransferEngine, _cache: KvCache },
    /// A child process (killed when dropped).
    Child(std::process::Child),
}

impl Drop for Prefill {
    fn drop(&mut self) {
        if let Prefill::Child(c) = self {
            drop(c.stdin.take());
            if c.wait_timeout_ok().is_err() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

trait WaitTimeout {
    fn wait_timeout_ok(&mut self) -> std::io::Result<()>;
}

impl WaitTimeout for std::process::Child {
    /// Waits up to five seconds for the child to exit by itself.
    fn wait_timeout_ok(&mut self) -> std::io::Result<()> {
        for _ in 0..500 {
            if self.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(std::io::ErrorKind::TimedOut.into())
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    ByteSize::parse(s).map(|b| b.0).and_then(|b| if b == 0 { Err("size must be non-zero".into()) } else { Ok(b) })
}

/// xorshift64*: a small deterministic generator for picking blocks (the demo must be
/// reproducible from its seed; statistical quality is beside the point).
struct Picker(u64);

impl Picker {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One engine's KV cache: `regions` buffers of `blocks * block_len` bytes.
struct KvCache {
    regions: Vec<Vec<u8>>,
    block_len: usize,
}

impl KvCache {
    fn new(regions: usize, blocks: u32, block_len: u64, fill: Option<u64>) -> Result<Self> {
        let len = usize::try_from(u64::from(blocks) * block_len).context("KV cache too large for this machine")?;
        let regions = (0..regions)
            .map(|r| match fill {
                Some(seed) => {
                    let mut p = Picker(seed ^ (r as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    (0..len).map(|_| p.next() as u8).collect()
                }
                None => {
                    // Touch every page now, so first-touch faults are not timed as transfer latency.
                    let mut v = vec![0u8; len];
                    std::hint::black_box(&mut v).fill(0);
                    v
                }
            })
            .collect();
        Ok(Self { regions, block_len: block_len as usize })
    }
    fn bases(&self) -> Vec<u64> {
        self.regions.iter().map(|r| r.as_ptr() as u64).collect()
    }
    fn block(&self, region: usize, id: u32) -> &[u8] {
        let start = id as usize * self.block_len;
        // The engines write through raw pointers; keep the compiler from caching old contents.
        &std::hint::black_box(&self.regions[region])[start..start + self.block_len]
    }
    /// Copies block `from` of `src` into block `to` of this (unregistered) cache.
    fn copy_block_from(&mut self, src: &KvCache, region: usize, from: u32, to: u32) {
        let data = src.block(region, from).to_vec();
        let start = to as usize * self.block_len;
        self.regions[region][start..start + self.block_len].copy_from_slice(&data);
    }

    fn crc(&self, region: usize, id: u32) -> u32 {
        crc32fast::hash(self.block(region, id))
    }
    async fn register(&self, engine: &TransferEngine) -> Result<()> {
        let regs: Vec<(u64, u64, Location)> =
            self.regions.iter().map(|r| (r.as_ptr() as u64, r.len() as u64, Location::Cpu(0))).collect();
        // SAFETY: the regions are this cache's heap buffers; the demo shuts both engines down
        // before the caches are dropped, and reads them only between transfers.
        unsafe { engine.register_memory_batch(&regs).await }.context("registering the KV cache")?;
        Ok(())
    }
}

/// Picks `n` destination blocks (one contiguous range below `dst_limit`) and `n` source blocks
/// laid out as runs of 1–8 adjacent blocks at random places, so some pairs merge and some do not.
fn pick(p: &mut Picker, blocks: u32, dst_limit: u32, n: u32) -> (Vec<u32>, Vec<u32>) {
    let dst_start = p.below(u64::from(dst_limit - n + 1)) as u32;
    let dst: Vec<u32> = (dst_start..dst_start + n).collect();
    let mut src = Vec::with_capacity(n as usize);
    while src.len() < n as usize {
        let run = (1 + p.below(8) as u32).min(n - src.len() as u32);
        let start = p.below(u64::from(blocks - run + 1)) as u32;
        src.extend(start..start + run);
    }
    (dst, src)
}

#[derive(Default)]
struct Phase {
    latencies: Vec<Duration>,
    bytes: u64,
    blocks: u64,
    requests: u64,
    verified_pairs: u64,
}

impl Phase {
    fn summary(&mut self, name: &str) -> serde_json::Value {
        self.latencies.sort_unstable();
        let busy: Duration = self.latencies.iter().sum();
        serde_json::json!({
            "phase": name,
            "transfers": self.latencies.len(),
            "blocks": self.blocks,
            "requests": self.requests,
            "bytes": self.bytes,
            "gb_per_s": gb_per_s(self.bytes, busy),
            "latency_us": {
                "p50": percentile(&self.latencies, 50.0).as_secs_f64() * 1e6,
                "p99": percentile(&self.latencies, 99.0).as_secs_f64() * 1e6,
                "p999": percentile(&self.latencies, 99.9).as_secs_f64() * 1e6,
            },
            "verified_block_pairs": self.verified_pairs,
        })
    }
}

pub(crate) async fn run(args: DemoArgs) -> Result<std::process::ExitCode> {
    ensure!(args.layers > 0, "--layers must be at least 1");
    ensure!(args.blocks_per_transfer > 0, "--blocks-per-transfer must be at least 1");
    ensure!(
        args.blocks >= args.blocks_per_transfer,
        "--blocks ({}) must be at least --blocks-per-transfer ({})",
        args.blocks,
        args.blocks_per_transfer
    );
    let regions = 2 * args.layers as usize;
    if args.serve_prefill {
        return serve_prefill(&args, regions).await;
    }
    let (prefill, prefill_name, p_bases, decode) = if args.two_process {
        let mut child = std::process::Command::new(std::env::current_exe()?)
            .args([
                "demo",
                "--serve-prefill",
                &format!("--layers={}", args.layers),
                &format!("--blocks={}", args.blocks),
                &format!("--block-size={}", args.block_size),
                &format!("--seed={}", args.seed),
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("starting the prefill process")?;
        let mut line = String::new();
        let stdout = child.stdout.take().context("prefill process stdout")?;
        let prefill = Prefill::Child(child);
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
        let info: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("the prefill process said {line:?}"))?;
        let name = info["segment"].as_str().context("no segment in the prefill process's answer")?.to_owned();
        let bases: Vec<u64> = serde_json::from_value(info["bases"].clone())?;
        let decode = ferry::builder().config(tcp_config()?).build().await.context("starting the decode engine")?;
        (prefill, name, bases, decode)
    } else {
        let engine =
            ferry::builder().segment_name("ferry-demo-prefill").build().await.context("starting the prefill engine")?;
        let cache = KvCache::new(regions, args.blocks, args.block_size, Some(args.seed))?;
        cache.register(&engine).await?;
        let (name, bases) = (engine.segment_name().to_owned(), cache.bases());
        let decode =
            ferry::builder().segment_name("ferry-demo-decode").build().await.context("starting the decode engine")?;
        (Prefill::InProcess { engine, _cache: cache }, name, bases, decode)
    };
    // What the prefill side holds, kept here to check every block against (the prefill memory
    // may be in another process).
    let mut mirror = KvCache::new(regions, args.blocks, args.block_size, Some(args.seed))?;
    let d_cache = KvCache::new(regions, args.blocks, args.block_size, None)?;
    d_cache.register(&decode).await?;
    let p_layout = KvLayout::uniform(&p_bases, args.blocks, args.block_size);
    let d_layout_id = decode.register_kv_layout(KvLayout::uniform(&d_cache.bases(), args.blocks, args.block_size))?;
    let peer = decode.open_segment(&prefill_name).await?;
    let transport = decode.segment(peer)?.protocol().to_owned();

    let per_engine = u64::from(args.blocks) * args.block_size * regions as u64;
    if !args.json {
        println!(
            "ferry demo: engines `{prefill_name}` and `{}` in {}, {} metadata, transport `{transport}`",
            decode.segment_name(),
            if args.two_process { "two processes" } else { "one process" },
            decode.metadata_backend(),
        );
        println!(
            "KV layout: {} layers x (K, V) = {regions} regions x {} blocks x {} bytes ({:.1} MiB per engine)",
            args.layers,
            args.blocks,
            args.block_size,
            per_engine as f64 / (1u64 << 20) as f64
        );
    }
    let bar = if args.json { ProgressBar::hidden() } else { ProgressBar::new(2 * u64::from(args.transfers)) };
    bar.set_style(
        ProgressStyle::with_template("{msg:>6} [{bar:40}] {pos}/{len} transfers  {elapsed_precise}")
            .expect("static template")
            .progress_chars("=> "),
    );

    let mut picker = Picker(args.seed | 1);
    let timeout = decode.transfer_timeout();
    let mut written = vec![false; args.blocks as usize];
    let mut phases = Vec::new();
    for opcode in [Opcode::Read, Opcode::Write] {
        let mut phase = Phase::default();
        bar.set_message(if opcode == Opcode::Read { "read" } else { "write" });
        for _ in 0..args.transfers {
            // Read: decode pulls prefill's `src` blocks into its `dst` blocks.
            // Write: decode pushes its `src` blocks into prefill's `dst` blocks.
            // Reads land only in the lower three quarters of decode's blocks, so the rest can be
            // checked afterwards to be untouched.
            let dst_limit = match opcode {
                Opcode::Read => (args.blocks / 4 * 3).max(args.blocks_per_transfer),
                Opcode::Write => args.blocks,
            };
            let (dst, src) = pick(&mut picker, args.blocks, dst_limit, args.blocks_per_transfer);
            let (local, remote) = match opcode {
                Opcode::Read => (&dst, &src),
                Opcode::Write => (&src, &dst),
            };
            let spec = BlockTransfer::new(opcode, local, remote);
            let started = Instant::now();
            let kb = decode.submit_blocks(d_layout_id, peer, &p_layout, &spec).await?;
            kb.wait(timeout).await.with_context(|| format!("blocks {:?} failed", kb.failed_blocks()))?;
            phase.latencies.push(started.elapsed());
            phase.requests += kb.runs().len() as u64;
            phase.blocks += u64::from(args.blocks_per_transfer);
            phase.bytes += u64::from(args.blocks_per_transfer) * args.block_size * regions as u64;
            for (l, r) in local.iter().zip(remote.iter()) {
                for region in 0..regions {
                    if opcode == Opcode::Write {
                        mirror.copy_block_from(&d_cache, region, *l, *r);
                    }
                    let (lc, rc) = (d_cache.crc(region, *l), mirror.crc(region, *r));
                    if lc != rc {
                        bail!(
                            "checksum mismatch after {opcode:?}: region {region} local block {l} ({lc:08x}) vs remote block {r} ({rc:08x})"
                        );
                    }
                }
                phase.verified_pairs += 1;
            }
            if opcode == Opcode::Read {
                for &d in &dst {
                    written[d as usize] = true;
                }
            }
            bar.inc(1);
        }
        if opcode == Opcode::Read {
            // Blocks no transfer named must be untouched: block-level, not whole-cache.
            for (id, _) in written.iter().enumerate().filter(|(_, w)| !**w) {
                for region in 0..regions {
                    ensure!(
                        d_cache.block(region, id as u32).iter().all(|&b| b == 0),
                        "block {id} of region {region} changed although no transfer named it"
                    );
                }
            }
        }
        phases.push(phase.summary(if opcode == Opcode::Read { "read" } else { "write" }));
    }
    bar.finish_and_clear();
    let untouched = written.iter().filter(|w| !**w).count();

    // Read the whole prefill cache back and compare it with the mirror: every pushed block
    // landed where it should, and nothing else changed.
    let check = KvCache::new(regions, args.blocks, args.block_size, None)?;
    check.register(&decode).await?;
    let check_id = decode.register_kv_layout(KvLayout::uniform(&check.bases(), args.blocks, args.block_size))?;
    let all: Vec<u32> = (0..args.blocks).collect();
    let spec = BlockTransfer::read(&all, &all);
    decode.submit_blocks(check_id, peer, &p_layout, &spec).await?.wait(timeout).await?;
    for region in 0..regions {
        for id in 0..args.blocks {
            ensure!(
                check.block(region, id) == mirror.block(region, id),
                "prefill block {id} of region {region} does not hold what it should after the write phase"
            );
        }
    }

    let summary = serde_json::json!({
        "transport": transport,
        "regions": regions,
        "blocks_per_region": args.blocks,
        "block_size": args.block_size,
        "phases": phases,
        "untouched_blocks_checked": untouched,
        "verified": true,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        for p in &phases {
            let lat = |k: &str| fmt_latency(Duration::from_secs_f64(p["latency_us"][k].as_f64().unwrap_or(0.0) / 1e6));
            println!(
                "{:<5}: {} transfers, {} blocks as {} requests over {regions} regions (adjacent blocks merged), {:.1} MiB, {:.2} GB/s, latency p50 {} p99 {} p999 {}",
                p["phase"].as_str().unwrap_or(""),
                p["transfers"],
                p["blocks"],
                p["requests"],
                p["bytes"].as_u64().unwrap_or(0) as f64 / (1u64 << 20) as f64,
                p["gb_per_s"].as_f64().unwrap_or(0.0),
                lat("p50"),
                lat("p99"),
                lat("p999"),
            );
        }
        println!(
            "checksums: every moved block verified in all {regions} regions (crc32); {untouched} block(s) no transfer named are still zero; the prefill cache read back whole matches"
        );
        println!("verified: OK");
    }
    decode.shutdown().await?;
    drop(d_cache);
    drop(check);
    if let Prefill::InProcess { engine, .. } = &prefill {
        engine.shutdown().await?;
    }
    drop(prefill);
    Ok(std::process::ExitCode::SUCCESS)
}
