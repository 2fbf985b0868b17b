//! Latency percentiles and throughput formatting for the CLI's summaries.

use std::time::Duration;

/// Percentile `p` (0–100) of `sorted` by the nearest-rank method; zero for an empty slice.
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Bytes per second in GB/s (10^9), as Mooncake's bench reports.
pub(crate) fn gb_per_s(bytes: u64, elapsed: Duration) -> f64 {
    if elapsed.is_zero() { 0.0 } else { bytes as f64 / elapsed.as_secs_f64() / 1e9 }
}

/// Human-readable duration in µs/ms.
pub(crate) fn fmt_latency(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 { format!("{us:.1} µs") } else { format!("{:.2} ms", us / 1000.0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&v, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&v, 99.9), Duration::from_millis(100));
        assert_eq!(percentile(&v, 0.0), Duration::from_millis(1));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
        assert_eq!(gb_per_s(2_000_000_000, Duration::from_secs(2)), 1.0);
        assert_eq!(fmt_latency(Duration::from_micros(1500)), "1.50 ms");
    }
}
