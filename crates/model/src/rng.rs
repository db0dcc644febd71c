//! Deterministic parameter initialisation.
//!
//! Why our own generator: burn's global RNG is process-global state seeded per process, so two
//! ranks would only agree on initial weights if they also agreed on every earlier draw. Here each
//! parameter tensor gets its own SplitMix64 stream derived from `(seed, tensor index)`, and
//! values are produced with plain IEEE f32 arithmetic, so the same seed gives the same bits on
//! every machine, whatever else the process did before.

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, full-period, passes BigCrush; good enough for
/// weight initialisation and trivially portable.
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// Stream for tensor number `index` of a model seeded with `seed`. Mixing the index through
    /// one SplitMix64 step keeps streams of neighbouring tensors uncorrelated.
    pub(crate) fn for_tensor(seed: u64, index: usize) -> Self {
        let mut mixer = SplitMix64::new(seed ^ (index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        Self::new(mixer.next_u64())
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 24 random bits: every value is exactly representable in f32.
    pub(crate) fn next_unit_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in [-bound, bound).
    pub(crate) fn next_symmetric_f32(&mut self, bound: f32) -> f32 {
        (self.next_unit_f32() * 2.0 - 1.0) * bound
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_reference_values() {
        // Reference outputs of SplitMix64 seeded with 1234567 (from the published C code).
        let mut r = SplitMix64::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
        assert_eq!(r.next_u64(), 9817491932198370423);
    }

    #[test]
    fn unit_values_stay_in_range() {
        let mut r = SplitMix64::for_tensor(7, 3);
        for _ in 0..10_000 {
            let u = r.next_unit_f32();
            assert!((0.0..1.0).contains(&u));
            let s = r.next_symmetric_f32(0.5);
            assert!((-0.5..0.5).contains(&s));
        }
    }
}
