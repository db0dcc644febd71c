//! The fixed-point arithmetic of the exact sum (`lockstep_comm::exact`, [`crate::sum_local`]): exponent bounds, conversion of
//! `f32` values to `i64` against a shared exponent and back — the loops that make up most of an
//! exact reduction's CPU time — compiled for the best vector instruction set this CPU has.
//!
//! Why several compiled copies: a portable x86-64 build may only use SSE2 (two `f64` lanes), so
//! each loop is also compiled with AVX2 (four) and AVX-512F (eight lanes, and 64-bit arithmetic
//! shifts for [`finish_fixed`]), and the copy to run is chosen once per process by
//! `is_x86_feature_detected!`. Every copy performs the same IEEE operations in the same order per
//! value — a conversion, two exact multiplications by powers of two, the rounding addition, integer
//! adds — and Rust never contracts them into fused operations, so **every copy gives the same
//! bits** (tested against the portable copy): a job's results do not depend on which copy ran,
//! unlike burn's matrix kernels (`lockstep_model::Kernels`). `crates/comm/examples/exact_kernels.rs`
//! measures the copies against the portable one in one process (figures on
//! docs/src/performance.md).

use std::ops::Range;
use std::sync::OnceLock;

/// Exponent marker for "this bucket contains a NaN or infinity".
pub const NON_FINITE: i32 = i32::MAX;
/// Exponent of an all-zero bucket.
pub const ALL_ZERO: i32 = i32::MIN;

/// Which compiled copy of the loops runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Avx512,
    Avx2,
    /// The portable build (SSE2 on x86-64; whatever the target has elsewhere).
    Portable,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Avx512 => "avx512f",
            Tier::Avx2 => "avx2",
            Tier::Portable => "portable",
        }
    }
}

thread_local! {
    static PORTABLE_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `f` with the portable copies on this thread: for tests and benchmarks that compare the
/// copies (same bits, different speed).
pub fn portable_only<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            PORTABLE_ONLY.with(|p| p.set(self.0));
        }
    }
    let _restore = Restore(PORTABLE_ONLY.with(|p| p.replace(true)));
    f()
}

/// The copy this thread runs: the best the CPU supports (detected once), unless inside
/// [`portable_only`].
pub fn tier() -> Tier {
    static TIER: OnceLock<Tier> = OnceLock::new();
    if PORTABLE_ONLY.with(|p| p.get()) {
        return Tier::Portable;
    }
    *TIER.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Tier::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Tier::Avx2;
            }
        }
        Tier::Portable
    })
}

/// `$vis fn $name(args) -> ret` running `$any(args)` compiled for [`tier`]'s instruction set.
macro_rules! dispatched {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $any:ident) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            match tier() {
                Tier::Avx512 => {
                    #[target_feature(enable = "avx512f")]
                    unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                        $any($($arg),*)
                    }
                    // SAFETY: tier() found AVX-512F on this CPU.
                    return unsafe { avx512($($arg),*) };
                }
                Tier::Avx2 => {
                    #[target_feature(enable = "avx2")]
                    unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                        $any($($arg),*)
                    }
                    // SAFETY: tier() found AVX2 on this CPU.
                    return unsafe { avx2($($arg),*) };
                }
                Tier::Portable => {}
            }
            $any($($arg),*)
        }
    };
}

pub(crate) use dispatched;

dispatched! {
    /// Max exponent bound of a slice, or `NON_FINITE` (see `max_exponent_any`).
    pub fn max_exponent(values: &[f32]) -> i32 = max_exponent_any
}
dispatched! {
    /// Add `values · 2^shift`, rounded to nearest (ties to even), into `acc` (see
    /// `accumulate_fixed_any`).
    pub fn accumulate_fixed(acc: &mut [i64], values: &[f32], shift: i32) = accumulate_fixed_any
}
dispatched! {
    /// Convert exact sums back: `out = f32(f64(acc) · 2^−shift)`.
    pub fn finish_fixed(acc: &[i64], shift: i32, out: &mut [f32]) = finish_fixed_any
}
dispatched! {
    /// `acc[i] = Σ_p round(p[range.start + i] · 2^shift)` (see `fixed_sum_any`).
    pub fn fixed_sum(acc: &mut [i64], parts: &[&[f32]], range: Range<usize>, shift: i32) = fixed_sum_any
}
dispatched! {
    /// [`fixed_sum`] then [`finish_fixed`], block by block (see `fixed_sum_finished_any`).
    pub fn fixed_sum_finished(out: &mut [f32], parts: &[&[f32]], range: Range<usize>, shift: i32) = fixed_sum_finished_any
}

/// Binary exponent `e` such that `|v| < 2^e` (for finite non-zero v); `ALL_ZERO` for 0.
#[inline(always)]
pub fn exponent_bound(v: f32) -> i32 {
    if v == 0.0 {
        return ALL_ZERO;
    }
    let bits = v.to_bits();
    let biased = ((bits >> 23) & 0xff) as i32;
    if biased == 0 {
        // subnormal: |v| < 2^-126
        -126
    } else {
        biased - 126 // |v| = 1.m · 2^(biased-127) < 2^(biased-126)
    }
}

/// Max exponent bound of a slice, or `NON_FINITE`.
///
/// For non-negative floats the bit patterns order like the values, so one branch-free integer max
/// over `|v|`'s bits (which the compiler vectorises) finds the largest magnitude; infinities and
/// NaNs have the largest patterns of all, so they show up in the same pass.
#[inline(always)]
fn max_exponent_any(values: &[f32]) -> i32 {
    let max_abs_bits = values
        .iter()
        .fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    if max_abs_bits >= 0x7f80_0000 {
        NON_FINITE
    } else {
        exponent_bound(f32::from_bits(max_abs_bits))
    }
}

/// Bits reserved so that the sum of `terms` values, each below 2^62 in magnitude, stays below 2^63.
pub fn headroom_bits(terms: usize) -> i32 {
    (usize::BITS - terms.max(1).saturating_sub(1).leading_zeros()) as i32 + 1
}

/// Scaled values stay below 2^`MAX_SCALED_BITS`, so [`accumulate_fixed`] can round with the
/// 1.5·2^52 bit trick; that keeps 51 bits below the bucket's largest value, far more than f32's 24.
pub const MAX_SCALED_BITS: i32 = 51;

/// The fixed-point shift for a bucket whose values are all below 2^`e_max`.
pub fn shift_for(e_max: i32, terms: usize) -> i32 {
    (62 - headroom_bits(terms)).min(MAX_SCALED_BITS) - e_max
}

/// 2^k as f64 for any k in the f64 exponent range (exact).
#[inline(always)]
pub fn pow2(k: i32) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// Add `values · 2^shift`, rounded to nearest (ties to even), into `acc`.
///
/// The product in f64 is exact (a 24-bit mantissa scaled by a power of two), so the only rounding is
/// the final one to an integer, which depends on nothing but the value and the shift.
#[inline(always)]
fn accumulate_fixed_any(acc: &mut [i64], values: &[f32], shift: i32) {
    debug_assert_eq!(acc.len(), values.len());
    // Split the scale in two when it leaves f64's normal range (tiny e_max ⇒ huge shift).
    let (s1, s2) = split_shift(shift);
    let (m1, m2) = (pow2(s1), pow2(s2));
    for (a, &v) in acc.iter_mut().zip(values) {
        *a += round_to_i64((v as f64) * m1 * m2);
    }
}

/// Round to nearest, ties to even, for |x| < 2^51 — branch-free and without a library call
/// (baseline x86-64 has neither a rounding instruction nor a packed f64→i64 conversion, and this
/// loop is the bulk of an exact reduction's CPU time). Adding 1.5·2^52 pushes the fraction bits out
/// of the mantissa, so the hardware's default rounding rounds, and the integer is then the low
/// mantissa bits: subtracting the constant's bit pattern reads it out.
#[inline(always)]
pub fn round_to_i64(x: f64) -> i64 {
    const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 · 2^52
    (x + MAGIC).to_bits() as i64 - MAGIC.to_bits() as i64
}

/// Convert exact sums back: `out = f32(f64(acc) · 2^−shift)`.
#[inline(always)]
fn finish_fixed_any(acc: &[i64], shift: i32, out: &mut [f32]) {
    debug_assert_eq!(acc.len(), out.len());
    let (s1, s2) = split_shift(-shift);
    let (m1, m2) = (pow2(s1), pow2(s2));
    for (o, &a) in out.iter_mut().zip(acc) {
        *o = (i64_to_f64(a) * m1 * m2) as f32;
    }
}

/// `a as f64` (correctly rounded) in operations the compiler can vectorise on baseline x86-64,
/// which has no packed i64→f64 conversion: the high half converts exactly as an i32 scaled by
/// 2^32, the low half exactly through the 2^52 bit trick, and their one addition rounds once.
#[inline(always)]
pub fn i64_to_f64(a: i64) -> f64 {
    const TWO_52: f64 = 4_503_599_627_370_496.0;
    let hi = ((a >> 32) as i32 as f64) * 4_294_967_296.0;
    let lo = f64::from_bits(TWO_52.to_bits() | (a as u64 & 0xffff_ffff)) - TWO_52;
    hi + lo
}

#[inline(always)]
fn split_shift(shift: i32) -> (i32, i32) {
    let first = shift.clamp(-1000, 1000);
    (first, shift - first)
}

/// `acc[i] = Σ_p round(p[range.start + i] · 2^shift)` over the local parts, in one pass over
/// `acc` (no clearing, one store per value): bitwise [`accumulate_fixed`] of each part in turn
/// into zeros, since every term is rounded on its own and integer addition is exact.
#[inline(always)]
fn fixed_sum_any(acc: &mut [i64], parts: &[&[f32]], range: Range<usize>, shift: i32) {
    debug_assert_eq!(acc.len(), range.len());
    let (s1, s2) = split_shift(shift);
    let (m1, m2) = (pow2(s1), pow2(s2));
    let fixed = |v: f32| round_to_i64((v as f64) * m1 * m2);
    match parts {
        [] => acc.fill(0),
        [a] => {
            for (o, &x) in acc.iter_mut().zip(&a[range]) {
                *o = fixed(x);
            }
        }
        [a, b, rest @ ..] => {
            for (o, (&x, &y)) in acc
                .iter_mut()
                .zip(a[range.clone()].iter().zip(&b[range.clone()]))
            {
                *o = fixed(x) + fixed(y);
            }
            for p in rest {
                accumulate_fixed_any(acc, &p[range.clone()], shift);
            }
        }
    }
}

/// `out[i] = f32(f64(Σ_p round(p[range.start + i] · 2^shift)) · 2^−shift)`: [`fixed_sum`]
/// followed by [`finish_fixed`] in one pass, in blocks small enough to stay in cache.
#[inline(always)]
fn fixed_sum_finished_any(out: &mut [f32], parts: &[&[f32]], range: Range<usize>, shift: i32) {
    const BLOCK: usize = 1024;
    let mut acc = [0i64; BLOCK];
    for (k, dst) in out.chunks_mut(BLOCK).enumerate() {
        let start = range.start + k * BLOCK;
        let acc = &mut acc[..dst.len()];
        fixed_sum_any(acc, parts, start..start + dst.len(), shift);
        finish_fixed_any(acc, shift, dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values of every kind the loops meet: normal, subnormal, zero, both signs, across the
    /// exponent range, and ties of the rounding.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                match i % 7 {
                    0 => 0.0,
                    1 => f32::from_bits((x as u32) & 0x807f_ffff), // subnormal
                    2 => (i as f32 + 0.5) * if x & 1 == 0 { 1.0 } else { -1.0 }, // ties
                    _ => f32::from_bits(
                        ((x as u32) & 0x803f_ffff) | ((100 + (x >> 40) % 60) as u32) << 23,
                    ),
                }
            })
            .collect()
    }

    #[test]
    fn every_copy_gives_the_portable_copys_bits() {
        let n = 4099; // not a multiple of any vector width or block
        let parts: Vec<Vec<f32>> = (0..5).map(|p| values(n, 0x9e37_79b9 + p)).collect();
        let refs: Vec<&[f32]> = parts.iter().map(|p| p.as_slice()).collect();
        let run = || {
            let e = refs.iter().map(|p| max_exponent(p)).max().unwrap();
            let shift = shift_for(e, refs.len());
            let mut acc = vec![0i64; n];
            fixed_sum(&mut acc, &refs, 0..n, shift);
            let mut acc2 = vec![7i64; n];
            for p in &refs {
                accumulate_fixed(&mut acc2, p, shift);
            }
            let mut out = vec![0f32; n];
            finish_fixed(&acc, shift, &mut out);
            let mut fused = vec![0f32; n - 3];
            fixed_sum_finished(&mut fused, &refs, 3..n, shift);
            (
                e,
                acc,
                acc2,
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                fused.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            )
        };
        let best = run();
        let portable = portable_only(run);
        assert_eq!(portable_only(tier), Tier::Portable);
        assert_eq!(
            best,
            portable,
            "the {} copy differs from the portable one",
            tier().name()
        );
        // A NaN anywhere is seen by every copy.
        let mut bad = parts[0].clone();
        bad[n - 1] = f32::NAN;
        assert_eq!(max_exponent(&bad), NON_FINITE);
        assert_eq!(portable_only(|| max_exponent(&bad)), NON_FINITE);
    }
}
