//! Per-engine counters and the batch-latency histogram, and their snapshot [`EngineStats`].
//!
//! Cheap on the hot path: every counter is an atomic, nothing allocates and no lock is taken per
//! request or per batch. The per-peer counters ([`RouteMetrics`]) are created when a segment is
//! opened (the one place that takes the engine's lock on them) and kept with the open segment,
//! so a finished batch adds its requests to them with a few atomic additions. A batch adds its
//! completed and failed requests once, when its last request has an outcome; a failure also
//! counts its [`ErrorKind`] at once; its latency (submission to last outcome) goes into a
//! log-linear histogram of 976 atomic buckets (about 3 % resolution) for the percentiles, and
//! into fixed buckets for a Prometheus histogram.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::ErrorKind;
use crate::wait_model::WaitModel;

/// Upper bounds (seconds) of the fixed latency buckets of [`LatencyStats::buckets`], the bounds
/// of the Prometheus histogram `ferry_batch_latency_seconds`.
pub const LATENCY_BUCKETS_SECONDS: [f64; 20] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The same bounds in nanoseconds.
const LATENCY_BUCKETS_NS: [u64; 20] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
    30_000_000_000,
];

/// Sub-bucket bits of the fine histogram: 16 buckets per power of two.
const SUB_BITS: u32 = 4;
const SUB: u64 = 1 << SUB_BITS;
/// Values below this are counted exactly.
const LINEAR: u64 = 2 * SUB;
/// Buckets of the fine histogram (every `u64` fits).
const FINE_BUCKETS: usize = (LINEAR + (64 - (SUB_BITS as u64 + 1)) * SUB) as usize;

fn fine_index(v: u64) -> usize {
    if v < LINEAR {
        return v as usize;
    }
    let msb = 63 - v.leading_zeros() as u64; // >= SUB_BITS + 1
    let shift = msb - SUB_BITS as u64;
    let mantissa = (v >> shift) - SUB; // 0..SUB
    (LINEAR + (msb - (SUB_BITS as u64 + 1)) * SUB + mantissa) as usize
}

/// The smallest and largest value of fine bucket `i`.
fn fine_bounds(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < LINEAR {
        return (i, i);
    }
    let msb = (i - LINEAR) / SUB + SUB_BITS as u64 + 1;
    let shift = msb - SUB_BITS as u64;
    let mantissa = (i - LINEAR) % SUB + SUB;
    let low = mantissa << shift;
    (low, low + ((1u64 << shift) - 1))
}

/// A lock-free latency histogram in nanoseconds: log-linear buckets (16 per power of two, so a
/// percentile is within about 3 % of the true value) plus the fixed Prometheus buckets.
struct Histogram {
    fine: Box<[AtomicU64]>,
    fixed: [AtomicU64; LATENCY_BUCKETS_NS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
    max_ns: AtomicU64,
}

impl Histogram {
    fn new() -> Self {
        Self {
            fine: (0..FINE_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            fixed: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
            max_ns: AtomicU64::new(0),
        }
    }

    fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.fine[fine_index(ns)].fetch_add(1, Ordering::Relaxed);
        // Non-cumulative here; the snapshot accumulates. A value past the last bound counts
        // only in `count` (the `+Inf` bucket).
        if let Some(b) = LATENCY_BUCKETS_NS.iter().position(|&le| ns <= le) {
            self.fixed[b].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> LatencyStats {
        let fine: Vec<u64> = self.fine.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let count: u64 = fine.iter().sum();
        let percentile = |q: f64| -> f64 {
            if count == 0 {
                return 0.0;
            }
            let rank = ((q * count as f64).ceil() as u64).clamp(1, count);
            let mut seen = 0;
            for (i, &c) in fine.iter().enumerate() {
                seen += c;
                if seen >= rank {
                    let (low, high) = fine_bounds(i);
                    return (low as f64 + high as f64) / 2.0 / 1e3;
                }
            }
            0.0
        };
        let mut cumulative = 0;
        let buckets = LATENCY_BUCKETS_SECONDS
            .iter()
            .zip(&self.fixed)
            .map(|(&le, c)| {
                cumulative += c.load(Ordering::Relaxed);
                LatencyBucket { le_seconds: le, count: cumulative.min(count) }
            })
            .collect();
        LatencyStats {
            count,
            sum_seconds: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
            p50_us: percentile(0.50),
            p90_us: percentile(0.90),
            p99_us: percentile(0.99),
            p999_us: percentile(0.999),
            max_us: self.max_ns.load(Ordering::Relaxed) as f64 / 1e3,
            buckets,
        }
    }
}

/// Counters of one direction of one route.
#[derive(Default)]
struct OpCounters {
    requests: AtomicU64,
    bytes: AtomicU64,
    failed: AtomicU64,
}

/// The counters of one route: one peer segment reached through one transport. Created by the
/// engine when it opens a segment and kept with the [`OpenSegment`](crate::OpenSegment), so a
/// batch counts into them without a lookup.
pub struct RouteMetrics {
    transport: String,
    peer: String,
    ops: [OpCounters; 2],
}

impl std::fmt::Debug for RouteMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteMetrics").field("transport", &self.transport).field("peer", &self.peer).finish()
    }
}

impl RouteMetrics {
    /// Counts `requests` completed requests of opcode number `opcode` (0 read, 1 write, as
    /// `Opcode as usize`) moving `bytes`, and `failed` failed (or cancelled) ones.
    pub(crate) fn add(&self, opcode: usize, requests: u64, bytes: u64, failed: u64) {
        let Some(c) = self.ops.get(opcode) else { return };
        if requests > 0 {
            c.requests.fetch_add(requests, Ordering::Relaxed);
            c.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        if failed > 0 {
            c.failed.fetch_add(failed, Ordering::Relaxed);
        }
    }
}

/// An engine's counters: the routes it opened, failures by kind, rejected submissions by kind,
/// the batch-latency histogram. Shared by the engine and its batches.
pub(crate) struct EngineMetrics {
    /// The engine's segment name (for logs).
    segment: String,
    /// By (transport, peer): looked up when a segment is opened, never per request.
    routes: Mutex<HashMap<(String, String), Arc<RouteMetrics>>>,
    failures: [AtomicU64; ErrorKind::ALL.len()],
    rejected: [AtomicU64; ErrorKind::ALL.len()],
    latency: Histogram,
    /// When this engine's blocking waiters of device-completed batches should be awake.
    wait_model: WaitModel,
    /// Blocking waits that woke before a device-completed batch's expected end to poll it.
    tail_polls: AtomicU64,
    /// Of those, the ones whose poll saw the batch end.
    tail_polls_caught: AtomicU64,
}

impl std::fmt::Debug for EngineMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineMetrics")
    }
}

fn kind_index(kind: ErrorKind) -> usize {
    ErrorKind::ALL.iter().position(|k| *k == kind).unwrap_or(ErrorKind::ALL.len() - 1)
}

impl EngineMetrics {
    pub(crate) fn new(segment: &str) -> Arc<Self> {
        Arc::new(Self {
            segment: segment.to_owned(),
            routes: Mutex::new(HashMap::new()),
            failures: std::array::from_fn(|_| AtomicU64::new(0)),
            rejected: std::array::from_fn(|_| AtomicU64::new(0)),
            latency: Histogram::new(),
            wait_model: WaitModel::default(),
            tail_polls: AtomicU64::new(0),
            tail_polls_caught: AtomicU64::new(0),
        })
    }

    /// The estimates blocking waiters of device-completed batches plan their wake-up with.
    pub(crate) fn wait_model(&self) -> &WaitModel {
        &self.wait_model
    }

    /// A blocking waiter polled a device-completed batch's expected end; `caught`: the batch
    /// ended while it polled.
    pub(crate) fn tail_poll(&self, caught: bool) {
        self.tail_polls.fetch_add(1, Ordering::Relaxed);
        if caught {
            self.tail_polls_caught.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The engine's segment name.
    pub(crate) fn segment(&self) -> &str {
        &self.segment
    }

    /// The counters of the route to `peer` through `transport`, created on first use (kept when
    /// the segment is closed: the counters are totals since the engine started).
    pub(crate) fn route(&self, transport: &str, peer: &str) -> Arc<RouteMetrics> {
        let mut routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        routes
            .entry((transport.to_owned(), peer.to_owned()))
            .or_insert_with(|| {
                Arc::new(RouteMetrics {
                    transport: transport.to_owned(),
                    peer: peer.to_owned(),
                    ops: Default::default(),
                })
            })
            .clone()
    }

    /// A request failed (or was cancelled) with `kind`.
    pub(crate) fn failure(&self, kind: ErrorKind) {
        self.failures[kind_index(kind)].fetch_add(1, Ordering::Relaxed);
    }

    /// A submission was refused before anything started, with `kind`.
    pub(crate) fn rejected(&self, kind: ErrorKind) {
        self.rejected[kind_index(kind)].fetch_add(1, Ordering::Relaxed);
    }

    /// A batch finished `elapsed` after its submission.
    pub(crate) fn batch_finished(&self, elapsed: Duration) {
        self.latency.record(elapsed);
    }

    /// The counters as they are now; the gauges (segments, memory) are filled in by the engine.
    pub(crate) fn snapshot(&self) -> EngineStats {
        let mut transfers: Vec<TransferStats> = {
            let routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
            routes
                .values()
                .flat_map(|r| {
                    OPCODE_NAMES.iter().zip(&r.ops).map(|(name, c)| TransferStats {
                        transport: r.transport.clone(),
                        peer: r.peer.clone(),
                        opcode: (*name).to_owned(),
                        requests: c.requests.load(Ordering::Relaxed),
                        bytes: c.bytes.load(Ordering::Relaxed),
                        failed_requests: c.failed.load(Ordering::Relaxed),
                    })
                })
                .collect()
        };
        transfers.sort_by(|a, b| (&a.transport, &a.peer, &a.opcode).cmp(&(&b.transport, &b.peer, &b.opcode)));
        let by_kind = |counters: &[AtomicU64]| {
            ErrorKind::ALL
                .iter()
                .zip(counters)
                .map(|(k, c)| (k.as_str().to_owned(), c.load(Ordering::Relaxed)))
                .collect()
        };
        EngineStats {
            segment: self.segment.clone(),
            transfers,
            failures: by_kind(&self.failures),
            rejected_submissions: by_kind(&self.rejected),
            batch_latency: self.latency.snapshot(),
            open_segments: 0,
            registered_bytes: 0,
            registered_regions: 0,
            tail_polls: self.tail_polls.load(Ordering::Relaxed),
            tail_polls_caught: self.tail_polls_caught.load(Ordering::Relaxed),
        }
    }
}

/// The names of the opcodes in [`TransferStats::opcode`] and metric labels, by
/// `Opcode as usize` (Mooncake's numbering: read 0, write 1).
pub const OPCODE_NAMES: [&str; 2] = ["read", "write"];

/// A snapshot of an engine's counters ([`TransferEngine::stats`](crate::TransferEngine::stats)).
///
/// Counters are totals since the engine was built; they never go down. Serialized as JSON by
/// the C API (`ferry_engine_stats`) and the Python package (`TransferEngine.get_stats()`); new
/// fields may be added, none is removed or renamed. docs/metrics.md describes every field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// The engine's segment name.
    pub segment: String,
    /// Requests this engine initiated, one entry per (transport, peer, opcode) of every
    /// segment it opened, sorted.
    pub transfers: Vec<TransferStats>,
    /// Requests that failed or were cancelled, by [`ErrorKind`] name (`timeout`,
    /// `peer_unreachable`, ...; every kind is listed, zero or not).
    pub failures: std::collections::BTreeMap<String, u64>,
    /// Submissions refused before anything started (an invalid request, an unknown segment),
    /// by [`ErrorKind`] name.
    pub rejected_submissions: std::collections::BTreeMap<String, u64>,
    /// Time from a batch's submission to its last request's outcome.
    pub batch_latency: LatencyStats,
    /// Segments open in this engine now.
    pub open_segments: u64,
    /// Bytes of memory registered now.
    pub registered_bytes: u64,
    /// Regions of memory registered now.
    pub registered_regions: u64,
    /// Blocking waits for a device-completed batch (an HCCL one-sided batch handed to the
    /// device thread) that woke before the batch's expected end and polled it, rather than
    /// sleep until the completion woke them (docs/transports.md, "Waiting for a device").
    #[serde(default)]
    pub tail_polls: u64,
    /// Of [`tail_polls`](Self::tail_polls), the ones that saw the batch end while polling (the
    /// others polled their window out and slept again).
    #[serde(default)]
    pub tail_polls_caught: u64,
}

impl EngineStats {
    /// Completed requests and their bytes, summed over every route and opcode.
    pub fn totals(&self) -> (u64, u64) {
        self.transfers.iter().fold((0, 0), |(r, b), t| (r + t.requests, b + t.bytes))
    }
}

/// Requests of one (transport, peer, opcode) initiated by this engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferStats {
    /// Protocol of the transport that served them (`tcp`, `local`, `ascend`, a plugin's).
    pub transport: String,
    /// The peer's segment name.
    pub peer: String,
    /// `read` or `write`.
    pub opcode: String,
    /// Requests completed.
    pub requests: u64,
    /// Bytes of the requests completed.
    pub bytes: u64,
    /// Requests failed or cancelled.
    pub failed_requests: u64,
}

/// Batch latency: count, sum, percentiles (from a log-linear histogram, within about 3 %) and
/// the cumulative fixed buckets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencyStats {
    /// Batches finished.
    pub count: u64,
    /// Sum of their latencies, in seconds.
    pub sum_seconds: f64,
    /// Median, in microseconds (0 before the first batch).
    pub p50_us: f64,
    /// 90th percentile, in microseconds.
    pub p90_us: f64,
    /// 99th percentile, in microseconds.
    pub p99_us: f64,
    /// 99.9th percentile, in microseconds.
    pub p999_us: f64,
    /// Largest latency, in microseconds.
    pub max_us: f64,
    /// Batches at or below each bound of [`LATENCY_BUCKETS_SECONDS`] (cumulative, as in a
    /// Prometheus histogram; `count` is the `+Inf` bucket).
    pub buckets: Vec<LatencyBucket>,
}

/// One cumulative latency bucket.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LatencyBucket {
    /// Upper bound, in seconds.
    pub le_seconds: f64,
    /// Batches whose latency was at most `le_seconds`.
    pub count: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_falls_in_the_bucket_whose_bounds_hold_it() {
        for v in (0..5000u64).chain([u64::MAX, u64::MAX - 1, 1 << 40, (1 << 40) - 1, 123_456_789]) {
            let i = fine_index(v);
            assert!(i < FINE_BUCKETS, "{v} -> {i}");
            let (low, high) = fine_bounds(i);
            assert!(low <= v && v <= high, "{v} in bucket {i} = [{low}, {high}]");
            // Resolution: a bucket is at most 1/16 of its lower bound wide.
            assert!(high - low <= low / 16, "{v}: [{low}, {high}]");
        }
        assert_eq!(fine_index(u64::MAX), FINE_BUCKETS - 1);
    }

    #[test]
    fn percentiles_are_within_the_histograms_resolution() {
        let h = Histogram::new();
        // 1000 batches of 1..=1000 µs.
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let s = h.snapshot();
        assert_eq!(s.count, 1000);
        for (got, want) in [(s.p50_us, 500.0), (s.p90_us, 900.0), (s.p99_us, 990.0), (s.p999_us, 999.0)] {
            assert!((got - want).abs() / want < 0.04, "{got} vs {want}: {s:?}");
        }
        assert_eq!(s.max_us, 1000.0);
        assert!((s.sum_seconds - 0.5005).abs() < 1e-9, "{}", s.sum_seconds);
        // Cumulative buckets: 10 µs holds 10 batches, 100 µs 100, 1 ms all of them.
        let at = |le: f64| s.buckets.iter().find(|b| b.le_seconds == le).unwrap().count;
        assert_eq!((at(0.000_01), at(0.000_1), at(0.001), at(30.0)), (10, 100, 1000, 1000));
        assert!(s.buckets.windows(2).all(|w| w[0].count <= w[1].count));
    }

    #[test]
    fn an_empty_histogram_reports_zeros() {
        let s = Histogram::new().snapshot();
        assert_eq!((s.count, s.p50_us, s.p999_us, s.max_us), (0, 0.0, 0.0, 0.0));
        assert!(s.buckets.iter().all(|b| b.count == 0));
    }

    #[test]
    fn routes_are_shared_by_transport_and_peer_and_counted_by_opcode() {
        let m = EngineMetrics::new("me");
        let a = m.route("tcp", "10.0.0.1:1");
        assert!(Arc::ptr_eq(&a, &m.route("tcp", "10.0.0.1:1")));
        let b = m.route("local", "10.0.0.1:1");
        a.add(0, 3, 300, 1);
        a.add(1, 1, 10, 0);
        b.add(1, 0, 0, 2);
        m.failure(ErrorKind::Timeout);
        m.failure(ErrorKind::Timeout);
        m.rejected(ErrorKind::OutOfBounds);
        let s = m.snapshot();
        assert_eq!(s.transfers.len(), 4, "two routes, two opcodes each");
        let find = |t: &str, op: &str| s.transfers.iter().find(|x| x.transport == t && x.opcode == op).unwrap();
        assert_eq!(
            (find("tcp", "read").requests, find("tcp", "read").bytes, find("tcp", "read").failed_requests),
            (3, 300, 1)
        );
        assert_eq!(find("local", "write").failed_requests, 2);
        assert_eq!(s.totals(), (4, 310));
        assert_eq!(s.failures["timeout"], 2);
        assert_eq!(s.failures.len(), ErrorKind::ALL.len());
        assert_eq!((s.rejected_submissions["out_of_bounds"], s.rejected_submissions["timeout"]), (1, 0));
        // The JSON form round-trips.
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<EngineStats>(&json).unwrap(), s);
    }
}
