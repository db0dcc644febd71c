//! Vectorisable math for lockstep's own elementwise kernels (`gelu.rs`, `softmax.rs`): short
//! branch-free sequences of IEEE operations the compiler turns into vector code, compiled for
//! AVX-512, AVX2 and plain x86-64 and picked at run time ([`tier`], [`dispatched`]). Every copy
//! performs the same operations per value (Rust never fuses a multiply and an add), so results
//! do not depend on the CPU's vector width; each kernel's tests check that.
//!
//! `exp_nonpositive` is Cody–Waite range reduction (`x = n·ln2 + r`) and Cephes' `expf`
//! polynomial on `r`, scaled by `2ⁿ` through the exponent bits.

/// `x` clamped to `[−87.3, 0]` (NaN kept), and `n = round(x·log2 e)` as a float and as an
/// integer.
#[inline(always)]
fn reduce(x: f32) -> (f32, f32, i32) {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // Adding and subtracting 1.5·2²³ rounds to the nearest integer (ties to even) in f32.
    const ROUND: f32 = 12_582_912.0;
    // Not `max`, which would turn NaN into −87.3.
    let xc = if x < -87.3 { -87.3 } else { x };
    let shifted = xc * LOG2_E + ROUND;
    let n = shifted - ROUND;
    // n ∈ [−126, 0] is an integer and `shifted` = 1.5·2²³ + n lies in 1.5·2²³'s binade, whose ulp
    // is 1: its bits are ROUND's plus n. Read n from them rather than by `n as i32`, whose
    // saturating conversion the compiler cannot vectorise (the same value; tested).
    let n_int = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    (xc, n, n_int)
}

/// `exp(x)` for `x ≤ 0`: 0 below −87.3 (the smallest normal's log), NaN for NaN.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    // ln 2 in two parts, so that n·LN2_HI is exact for |n| < 2⁹.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let (xc, n, n_int) = reduce(x);
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let er = (p * (r * r) + r) + 1.0;
    // For NaN, er is NaN and any scale keeps it so.
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    if x < -87.3 {
        0.0
    } else {
        er * scale
    }
}

/// The instruction set a pass runs: `lockstep_exact::fixed_point`'s detection (once per process;
/// its `portable_only` forces the portable copy on a thread, as tests do).
pub(crate) use lockstep_exact::fixed_point::{tier, Tier};

/// `$vis fn $name(tier, args)` running `$any(args)` compiled for `tier`'s instruction set (or
/// `Portable`).
macro_rules! dispatched {
    ($vis:vis $name:ident($($arg:ident: $ty:ty),*) = $any:ident) => {
        $vis fn $name(tier: Tier, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            match tier {
                Tier::Avx512 => {
                    #[target_feature(enable = "avx512f")]
                    unsafe fn avx512($($arg: $ty),*) {
                        $any($($arg),*)
                    }
                    // SAFETY: only called with a tier that `tier()` found on this CPU.
                    return unsafe { avx512($($arg),*) };
                }
                Tier::Avx2 => {
                    #[target_feature(enable = "avx2")]
                    unsafe fn avx2($($arg: $ty),*) {
                        $any($($arg),*)
                    }
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
                Tier::Portable => {}
            }
            let _ = tier;
            $any($($arg),*)
        }
    };
}

pub(crate) use dispatched;

#[cfg(test)]
mod tests {
    use super::*;

    /// The integer read from the bits is `n as i32` (what the exponent's scale was first built
    /// from, so the bits of `exp_nonpositive` are unchanged) for every non-positive float down
    /// to −100 (each 97th bit pattern, and all those near the rounding boundaries of n) and −∞;
    /// NaN still gives NaN.
    #[test]
    fn the_exponent_is_read_without_a_conversion() {
        let check = |x: f32| {
            let (_, n, n_int) = reduce(x);
            assert_eq!(n_int, n as i32, "x = {x}");
        };
        let stop = (-100f32).to_bits();
        let mut bits = (-0f32).to_bits();
        while bits <= stop {
            check(f32::from_bits(bits));
            bits += 97;
        }
        for k in 0..=126 {
            let edge = (-(k as f32 + 0.5) * std::f32::consts::LN_2).to_bits();
            for b in edge - 32..edge + 32 {
                check(f32::from_bits(b));
            }
        }
        for x in [
            0.0,
            -0.0,
            f32::NEG_INFINITY,
            -87.3,
            -87.299_99,
            -f32::MIN_POSITIVE,
        ] {
            check(x);
        }
        assert!(exp_nonpositive(f32::NAN).is_nan() && exp_nonpositive(-f32::NAN).is_nan());
    }
}
