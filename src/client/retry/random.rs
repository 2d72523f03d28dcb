//! The retry layer's random numbers: SplitMix64 on one atomic word, so that clones of a policy
//! share one sequence without a lock, and a seed makes a run repeatable.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

/// SplitMix64's increment (the golden ratio in 64 bits).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// A seeded generator shared by reference.
#[derive(Debug)]
pub(crate) struct Rng {
    state: AtomicU64,
}

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            state: AtomicU64::new(seed),
        }
    }

    /// A seed from the process's hash keys (random per process; no clock read).
    pub(crate) fn entropy() -> u64 {
        std::collections::hash_map::RandomState::new().hash_one(0x7011_6a7e_u64)
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&self) -> u64 {
        let mut z = self
            .state
            .fetch_add(GAMMA, Ordering::Relaxed)
            .wrapping_add(GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)` (zero when `n` is zero), by a 128-bit multiply (Lemire): integer
    /// only, and biased by at most `n / 2^64`.
    pub(crate) fn below(&self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_its_reference_values() {
        // The first outputs of SplitMix64 seeded with 0 (from its reference implementation).
        let rng = Rng::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(rng.next_u64(), 0x06C4_5D18_8009_454F);
    }

    #[test]
    fn below_stays_below() {
        let rng = Rng::new(7);
        assert_eq!(rng.below(0), 0);
        assert_eq!(rng.below(1), 0);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            let x = rng.below(10);
            assert!(x < 10);
            seen[x as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
        assert!((0..1000).any(|_| rng.below(u64::MAX) > u64::MAX / 2));
        assert_ne!(Rng::entropy(), Rng::entropy());
    }
}
