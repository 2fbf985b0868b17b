//! What the fault tests share (`hostile_peers.rs`, `partition.rs`): a seedable generator, the
//! seed printed for replay, and a count of panics on every thread.

// Each test binary uses part of it.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};

/// SplitMix64: small, seedable, and the same everywhere.
#[derive(Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A number in `0..n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// A number in `range`.
    pub(crate) fn within(&mut self, range: std::ops::Range<u64>) -> u64 {
        range.start + self.below(range.end - range.start)
    }
    pub(crate) fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
    pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Fewer than `max` random bytes.
    pub(crate) fn some_bytes(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max);
        self.bytes(n as usize)
    }
    /// A length from 1 to one of `maxes` (picked first, so short lengths are common too).
    pub(crate) fn len_upto(&mut self, maxes: &[u64]) -> u64 {
        let max = self.pick(maxes);
        1 + self.below(max)
    }
    /// A stream of its own for `id`.
    pub(crate) fn fork(&self, id: u64) -> Rng {
        Rng(self.0 ^ id.wrapping_mul(0xA24B_AED4_963E_E407))
    }
}

/// The seed (`FERRY_FAULT_SEED`, else the clock), printed first so that a failing test shows it.
pub(crate) fn seed(test: &str) -> Rng {
    let seed = std::env::var("FERRY_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("{test}: seed {seed} (replay with FERRY_FAULT_SEED={seed})");
    Rng(seed)
}

/// Counts panics on every thread of the process: an engine task's panic is caught by its
/// runtime and would otherwise go unnoticed. Read it before and after the code under test.
pub(crate) fn panics() -> &'static AtomicUsize {
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
    &PANICS
}
