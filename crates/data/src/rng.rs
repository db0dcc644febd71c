//! The project's own pseudo-random generator: xoshiro256** seeded through splitmix64.
//!
//! Why not the `rand` crate: bitwise reproducibility is lockstep's core promise, and `rand` has
//! changed its algorithms and sampling methods between versions. Every number here comes from
//! published, fixed algorithms (Blackman & Vigna's xoshiro256** and splitmix64, Lemire's bounded
//! integers, Marsaglia's polar method) using only integer operations and correctly rounded IEEE
//! arithmetic (`+ - * /`, `sqrt`), never the platform's `ln`/`exp`/`sin`, whose last bits vary
//! between C libraries. The golden tests in `tests/rng.rs` pin the output.

/// Increment of splitmix64 (2^64 / golden ratio).
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function: a bijective 64-bit mixer (`mix64(0) == 0`).
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256** generator. `Clone` copies the exact stream position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// Seeds the four state words with consecutive splitmix64 outputs, as the xoshiro authors
    /// recommend, so that similar seeds (0, 1, 2, ...) still give unrelated streams.
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(GOLDEN_GAMMA);
            mix64(x)
        };
        let s = [next(), next(), next(), next()];
        // All-zero is xoshiro's one fixed point; four consecutive splitmix64 outputs cannot all be
        // zero because mix64 is a bijection and its inputs differ.
        debug_assert!(s != [0; 4]);
        Rng { s }
    }

    /// A generator in exactly the given state, e.g. to check against the reference
    /// implementation's test vectors.
    ///
    /// # Panics
    /// If the state is all zero (xoshiro's fixed point, which would output zeros forever).
    pub fn from_state(s: [u64; 4]) -> Rng {
        assert!(s != [0; 4], "xoshiro256** state must not be all zero");
        Rng { s }
    }

    /// An independent stream for `(seed, stream)`, e.g. `(run seed, epoch)`: the same pair always
    /// gives the same generator, different pairs give unrelated ones.
    pub fn stream(seed: u64, stream: u64) -> Rng {
        Rng::new(mix64(seed ^ mix64(stream.wrapping_add(GOLDEN_GAMMA))))
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Upper 32 bits (the better-mixed half).
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform integer in `0..bound`, without modulo bias (Lemire's multiply-and-reject).
    ///
    /// # Panics
    /// If `bound == 0`.
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0, "Rng::below: bound must be at least 1");
        let mut m = u128::from(self.next_u64()) * u128::from(bound);
        if (m as u64) < bound {
            // Only values of the low word under 2^64 mod bound are over-represented; reject them.
            let threshold = bound.wrapping_neg() % bound;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(bound);
            }
        }
        (m >> 64) as u64
    }

    /// Uniform in [0, 1) with 24 random bits (every value is a multiple of 2^-24, exactly
    /// representable in f32).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal sample (mean 0, variance 1), Marsaglia's polar method in f64 with the
    /// logarithm computed by [`ln_unit`] so the result is identical on every platform. The second
    /// value of each pair is discarded to keep the generator state a plain 256-bit word.
    pub fn normal_f32(&mut self) -> f32 {
        loop {
            let u = 2.0 * self.next_f64() - 1.0;
            let v = 2.0 * self.next_f64() - 1.0;
            let s = u * u + v * v;
            if s > 0.0 && s < 1.0 {
                return (u * (-2.0 * ln_unit(s) / s).sqrt()) as f32;
            }
        }
    }

    /// Fisher–Yates shuffle (Durstenfeld's in-place form, from the end).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }

    /// A uniformly random permutation of `0..n`.
    pub fn permutation(&mut self, n: u32) -> Vec<u32> {
        let mut p: Vec<u32> = (0..n).collect();
        self.shuffle(&mut p);
        p
    }
}

/// Natural logarithm of a positive, finite, normal `x`, using only `+ - * /` so that every
/// platform computes the same bits (accurate to a few ulp; used for normal sampling).
///
/// Splits `x = m * 2^e` with `m` in [sqrt(1/2), sqrt(2)), then `ln m = 2 atanh(t)`,
/// `t = (m - 1) / (m + 1)`, `|t| < 0.172`, summed as an odd power series to 13 terms
/// (the first omitted term is below 1e-20 relative).
pub fn ln_unit(x: f64) -> f64 {
    debug_assert!(
        x.is_normal() && x > 0.0,
        "ln_unit needs a positive normal number"
    );
    const LN2: f64 = std::f64::consts::LN_2;
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    // Mantissa with the exponent set to 0: m in [1, 2).
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    if m >= std::f64::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let t = (m - 1.0) / (m + 1.0);
    let t2 = t * t;
    let mut sum = 0.0;
    // Horner form of 1 + t2/3 + t2^2/5 + ... + t2^12/25, innermost first.
    for k in (0..13).rev() {
        sum = sum * t2 + 1.0 / (2 * k + 1) as f64;
    }
    e as f64 * LN2 + 2.0 * t * sum
}
