//! Vectorisable math for lockstep's own elementwise kernels (`gelu.rs`, `softmax.rs`): short
//! branch-free sequences of IEEE operations the compiler turns into vector code, compiled for
//! AVX-512, AVX2 and plain x86-64 and picked at run time ([`tier`], [`dispatched`]). Every copy
//! performs the same operations per value (Rust never fuses a multiply and an add), so results
//! do not depend on the CPU's vector width; each kernel's tests check that.
//!
//! `exp_nonpositive` is Cody–Waite range reduction (`x = n·ln2 + r`) and Cephes' `expf`
//! polynomial on `r`, scaled by `2ⁿ` through the exponent bits.

/// `exp(x)` for `x ≤ 0`: 0 below −87.3 (the smallest normal's log), NaN for NaN.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, so that n·LN2_HI is exact for |n| < 2⁹.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5·2²³ rounds to the nearest integer (ties to even) in f32.
    const ROUND: f32 = 12_582_912.0;
    // Not `max`, which would turn NaN into −87.3.
    let xc = if x < -87.3 { -87.3 } else { x };
    let n = (xc * LOG2_E + ROUND) - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let er = (p * (r * r) + r) + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
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
