//! [`BinnedSum`]: an exact, order-independent running sum of `f32` vectors that takes one part at
//! a time, in memory that does not grow with the number of parts — the arithmetic that gradient
//! accumulation in O(P) needs (each micro-batch's gradient folded in as soon as its backward
//! ends), which the exact sum of [`crate::sum_local`] cannot give: its shared exponent is the
//! largest over *all* parts, so it must hold every part until the last one is known.
//!
//! **Definition.** Magnitudes are cut into fixed bins of [`BIN_BITS`] = 32 bits: bin `b` holds
//! `[2^(G₀+32b), 2^(G₀+32(b+1)))` with `G₀ = −192`. A non-zero finite `f32` with exponent field
//! `E` is below `2^e`, `e = max(E, 1) − 126` (subnormals are counted below `2^−126`), and its top
//! bin is the bin of `2^(e−1)`: 2 to 9. For each position `i` of the vector, let `t` be the highest
//! top bin of any part there and `L = t − 1`; the result at `i` is
//!
//! ```text
//!     Σ_parts trunc(x / 2^(G₀+32L)) · 2^(G₀+32L)        (trunc rounds toward zero)
//! ```
//!
//! rounded once to `f32`. It depends only on the multiset of parts — not on their order, their
//! grouping into accumulators, or how many a rank holds — and keeps at least 32 bits below the
//! largest part at that position (the truncation error is below `2^−32 ×` that part per part).
//!
//! **How it is kept.** Per position: the level `L` (an `i8`, −1 while every part was zero) and two
//! `i64` bins, `hi` (units of `2^(G+32)`) and `lo` (units of `2^G`), `G = G₀ + 32L`. A part
//! `x = ±m·2^k` (`m < 2^24`) with top bin ≤ `L + 1` has `|trunc(x/2^G)| < 2^64`; it adds that
//! integer's high and low 32-bit halves (sign and magnitude) to `hi` and `lo`. When a part raises
//! `L` by one, every earlier part's new integer is its old `hi` half exactly (truncations toward
//! zero compose), and each fits 32 bits, so the bins move down (`lo ← hi`, `hi ← 0`); when it
//! raises `L` by two or more, every earlier part truncates to zero. Merging two accumulators
//! (another rank's, another group of parts) raises both to the higher level the same way and
//! adds the bins. Bins stay exact up to 2³¹ parts.
//!
//! **Cost.** 17 bytes per position (against 4 per part for holding the parts); a fold is one
//! pass over the part and the accumulator, a merge one pass over both: branch-free integer
//! operations per value, compiled for AVX-512 / AVX2 / the portable target like
//! [`crate::fixed_point`]'s loops (same bits in every copy).

use crate::fixed_point::{dispatched, pow2, tier, Tier};
use crate::SumError;

/// Bits per bin.
pub const BIN_BITS: i32 = 32;

/// `G₀`: the scale of bin 0's unit, far enough below the smallest subnormal `f32` (`2^−149`) that
/// every non-zero value's top bin is at least 2 (so its level `top − 1` is a bin, never
/// [`EMPTY`]).
const BASE: i32 = -192;

/// The level of a position every part of which was zero.
const EMPTY: i8 = -1;

/// An exact running sum of `f32` vectors of one length (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BinnedSum {
    level: Vec<i8>,
    hi: Vec<i64>,
    lo: Vec<i64>,
    /// The first position where a part held NaN or an infinity.
    non_finite: Option<usize>,
    /// Parts folded in (merges add theirs): below [`FAST_FINISH_PARTS`], every bin is below
    /// 2^53 and [`BinnedSum::finish`] converts with two exact `f64`s per value.
    parts: u64,
}

/// Parts below which no bin can reach 2^53 (each part adds less than 2^32 to each bin).
const FAST_FINISH_PARTS: u64 = 1 << 21;

/// The level `v` asks for (its top bin − 1; [`EMPTY`] for zeros and non-finite values), and
/// whether it is non-finite. Branch-free, as everything the vector loops call.
#[inline(always)]
fn wish(v: f32) -> (i32, bool) {
    let bits = v.to_bits();
    let biased = ((bits >> 23) & 0xff) as i32;
    let non_finite = biased == 0xff;
    let counts = bits & 0x7fff_ffff != 0 && !non_finite;
    let top = (biased.max(1) - 126 - BASE - 1) / BIN_BITS;
    (if counts { top - 1 } else { EMPTY as i32 }, non_finite)
}

/// `trunc(v / 2^(G₀ + 32·level))`'s high and low 32-bit halves, signed like `v` (0 for zeros and
/// non-finite values); `level` must be at least [`wish`]'s.
#[inline(always)]
fn halves(v: f32, level: i32) -> (i64, i64) {
    let bits = v.to_bits();
    let biased = ((bits >> 23) & 0xff) as i32;
    let finite = biased != 0xff;
    let m = u64::from(bits & 0x7f_ffff) | if biased != 0 { 1 << 23 } else { 0 };
    let m = if finite { m } else { 0 };
    let shift = biased.max(1) - 150 - (BASE + BIN_BITS * level);
    // A part at or below its level's two bins is below 2^64 in units of the grid, so a left
    // shift loses nothing; zeros (m = 0) may meet any shift.
    let magnitude = if shift >= 0 {
        m << shift.min(63)
    } else {
        m >> (-shift).min(63)
    };
    let (hi, lo) = ((magnitude >> 32) as i64, (magnitude & 0xffff_ffff) as i64);
    if bits >> 31 == 1 {
        (-hi, -lo)
    } else {
        (hi, lo)
    }
}

/// Bins `(hi, lo)` at `from` moved up to `to ≥ from` (see the module docs), branch-free.
#[inline(always)]
fn lifted(from: i32, hi: i64, lo: i64, to: i32) -> (i64, i64) {
    let d = to - from;
    (
        if d == 0 { hi } else { 0 },
        if d == 0 {
            lo
        } else if d == 1 {
            hi
        } else {
            0
        },
    )
}

/// [`BinnedSum::fold`]'s loop; returns the first non-finite position (`usize::MAX`: none).
#[inline(always)]
fn fold_any(level: &mut [i8], hi: &mut [i64], lo: &mut [i64], values: &[f32]) -> usize {
    let n = values.len();
    let (level, hi, lo) = (&mut level[..n], &mut hi[..n], &mut lo[..n]);
    let mut first_bad = usize::MAX;
    for i in 0..n {
        let v = values[i];
        let (want, non_finite) = wish(v);
        first_bad = first_bad.min(if non_finite { i } else { usize::MAX });
        let old = i32::from(level[i]);
        let new = old.max(want);
        let (h, l) = lifted(old, hi[i], lo[i], new);
        let (ph, pl) = halves(v, new);
        hi[i] = h + ph;
        lo[i] = l + pl;
        level[i] = new as i8;
    }
    first_bad
}

/// [`BinnedSum::merge`]'s loop.
#[inline(always)]
fn merge_any(level: &mut [i8], hi: &mut [i64], lo: &mut [i64], other: (&[i8], &[i64], &[i64])) {
    let n = level.len();
    let (o_level, o_hi, o_lo) = (&other.0[..n], &other.1[..n], &other.2[..n]);
    let (hi, lo) = (&mut hi[..n], &mut lo[..n]);
    for i in 0..n {
        let (a, b) = (i32::from(level[i]), i32::from(o_level[i]));
        let new = a.max(b);
        let (h, l) = lifted(a, hi[i], lo[i], new);
        // An empty side holds zeros, which any lift keeps zero.
        let (oh, ol) = lifted(b, o_hi[i], o_lo[i], new);
        hi[i] = h + oh;
        lo[i] = l + ol;
        level[i] = new as i8;
    }
}

/// [`BinnedSum::finish`]'s loop for bins below 2^53: [`value`]'s fast path, branch-free.
#[inline(always)]
fn finish_any(level: &[i8], hi: &[i64], lo: &[i64], out: &mut [f32]) {
    let n = out.len();
    let (level, hi, lo) = (&level[..n], &hi[..n], &lo[..n]);
    for i in 0..n {
        out[i] = small_value(i32::from(level[i]), hi[i], lo[i]);
    }
}

/// [`value`] for bins below 2^53 in magnitude: both terms are exact in `f64`, so their one
/// addition is the integer correctly rounded, as `value`'s `i128` conversion. (An empty position
/// holds zeros, so its scale does not matter.)
#[inline(always)]
fn small_value(level: i32, hi: i64, lo: i64) -> f32 {
    let units = hi as f64 * 4_294_967_296.0 + lo as f64;
    (units * pow2(BASE + BIN_BITS * level)) as f32
}

dispatched! {
    fn finish_kernel(level: &[i8], hi: &[i64], lo: &[i64], out: &mut [f32]) = finish_any
}
dispatched! {
    fn fold_kernel(level: &mut [i8], hi: &mut [i64], lo: &mut [i64], values: &[f32]) -> usize = fold_any
}
dispatched! {
    fn merge_kernel(level: &mut [i8], hi: &mut [i64], lo: &mut [i64], other: (&[i8], &[i64], &[i64])) = merge_any
}

impl BinnedSum {
    /// An empty sum of vectors of `len` values.
    pub fn new(len: usize) -> Self {
        BinnedSum {
            level: vec![EMPTY; len],
            hi: vec![0; len],
            lo: vec![0; len],
            non_finite: None,
            parts: 0,
        }
    }

    /// The number of values per vector.
    pub fn len(&self) -> usize {
        self.level.len()
    }

    pub fn is_empty(&self) -> bool {
        self.level.is_empty()
    }

    /// Bytes this accumulator holds (for memory reports).
    pub fn bytes(&self) -> u64 {
        (self.len() * (1 + 2 * std::mem::size_of::<i64>())) as u64
    }

    /// Back to the empty sum, keeping the memory.
    pub fn clear(&mut self) {
        self.level.fill(EMPTY);
        self.hi.fill(0);
        self.lo.fill(0);
        self.non_finite = None;
        self.parts = 0;
    }

    /// Add the part `values` (which must have [`BinnedSum::len`] values).
    pub fn fold(&mut self, values: &[f32]) {
        assert_eq!(values.len(), self.len(), "a part of another length");
        let bad = fold_kernel(&mut self.level, &mut self.hi, &mut self.lo, values);
        self.parts += 1;
        self.note_non_finite((bad != usize::MAX).then_some(bad));
    }

    /// Add every part another accumulator of the same length holds.
    pub fn merge(&mut self, other: &BinnedSum) {
        assert_eq!(other.len(), self.len(), "a sum of another length");
        let theirs = (&other.level[..], &other.hi[..], &other.lo[..]);
        merge_kernel(&mut self.level, &mut self.hi, &mut self.lo, theirs);
        self.parts += other.parts;
        self.note_non_finite(other.non_finite);
    }

    fn note_non_finite(&mut self, at: Option<usize>) {
        self.non_finite = match (self.non_finite, at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// The sums as `f32`, or the first position where a part was not finite.
    pub fn finish(&self, out: &mut [f32]) -> Result<(), SumError> {
        assert_eq!(out.len(), self.len(), "an output of another length");
        if let Some(i) = self.non_finite {
            return Err(SumError::NonFinite {
                start: i,
                end: i + 1,
            });
        }
        if self.parts < FAST_FINISH_PARTS {
            finish_kernel(&self.level, &self.hi, &self.lo, out);
        } else {
            for (i, o) in out.iter_mut().enumerate() {
                *o = value(i32::from(self.level[i]), self.hi[i], self.lo[i]);
            }
        }
        Ok(())
    }
}

/// `(hi · 2^32 + lo) · 2^(G₀ + 32·level)` rounded to `f32` through `f64` (deterministic): the
/// integer rounded once to `f64`, scaled exactly, rounded to `f32`. For any bins.
fn value(level: i32, hi: i64, lo: i64) -> f32 {
    if level == i32::from(EMPTY) {
        return 0.0;
    }
    let units = ((i128::from(hi) << BIN_BITS) + i128::from(lo)) as f64;
    (units * pow2(BASE + BIN_BITS * level)) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values across the whole range: zeros, subnormals, both signs, tiny to huge, and runs of
    /// nearby magnitudes (where truncation and carries matter).
    fn part(len: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let sign = if x & 1 == 0 { 1.0 } else { -1.0 };
                match (i + seed as usize) % 6 {
                    0 => 0.0,
                    1 => f32::from_bits((x as u32) & 0x807f_ffff), // subnormal
                    2 => f32::from_bits((x as u32) & 0xff7f_ffff | 0x0080_0000), // any normal
                    _ => sign * ((x >> 40) as f32) * 2f32.powi((x % 40) as i32 - 20),
                }
            })
            .map(|v: f32| if v.is_finite() { v } else { 1.0 })
            .collect()
    }

    fn folded(parts: &[Vec<f32>]) -> BinnedSum {
        let mut s = BinnedSum::new(parts[0].len());
        for p in parts {
            s.fold(p);
        }
        s
    }

    fn bits(s: &BinnedSum) -> Vec<u32> {
        let mut out = vec![0f32; s.len()];
        s.finish(&mut out).unwrap();
        out.iter().map(|v| v.to_bits()).collect()
    }

    /// The definition, computed per position from all parts at once in `i128`, from the module
    /// docs alone: (level, Σ trunc(x / 2^G)).
    fn reference(parts: &[Vec<f32>], i: usize) -> (i8, i128) {
        let finite: Vec<f32> = parts
            .iter()
            .map(|p| p[i])
            .filter(|v| v.is_finite() && *v != 0.0)
            .collect();
        let field = |v: f32| ((v.to_bits() >> 23) & 0xff) as i32;
        let Some(top) = finite
            .iter()
            .map(|&v| (field(v).max(1) - 126 - 1 - BASE).div_euclid(32))
            .max()
        else {
            return (EMPTY, 0);
        };
        let grid = BASE + 32 * (top - 1);
        let total = finite
            .iter()
            .map(|&v| {
                // v = ±m · 2^k exactly.
                let e = field(v);
                let m = i128::from(v.to_bits() & 0x7f_ffff) | if e > 0 { 1 << 23 } else { 0 };
                let k = e.max(1) - 150;
                let shift = k - grid;
                let magnitude = if shift >= 0 {
                    m << shift
                } else {
                    m.checked_shr(shift.unsigned_abs()).unwrap_or(0)
                };
                if v < 0.0 {
                    -magnitude
                } else {
                    magnitude
                }
            })
            .sum();
        ((top - 1) as i8, total)
    }

    #[test]
    fn the_sum_is_the_definition_whatever_the_order_and_grouping() {
        let parts: Vec<Vec<f32>> = (0..7).map(|s| part(3000, s)).collect();
        let forward = folded(&parts);
        for i in 0..forward.len() {
            let (level, total) = reference(&parts, i);
            assert_eq!(forward.level[i], level, "level at {i}");
            let held = (i128::from(forward.hi[i]) << 32) + i128::from(forward.lo[i]);
            assert_eq!(held, total, "sum at {i}");
        }
        let reversed: Vec<Vec<f32>> = parts.iter().rev().cloned().collect();
        assert_eq!(bits(&folded(&reversed)), bits(&forward));
        // Grouped as three ranks would hold them, merged in two orders.
        let (a, b, c) = (
            folded(&parts[..1]),
            folded(&parts[1..5]),
            folded(&parts[5..]),
        );
        let mut abc = a.clone();
        abc.merge(&b);
        abc.merge(&c);
        let mut cba = c.clone();
        cba.merge(&b);
        cba.merge(&a);
        assert_eq!(bits(&abc), bits(&forward));
        assert_eq!(bits(&cba), bits(&forward));
    }

    #[test]
    fn every_compiled_copy_gives_the_same_bins() {
        let parts: Vec<Vec<f32>> = (0..5).map(|s| part(4001, s + 7)).collect();
        let fast = folded(&parts);
        let portable = crate::fixed_point::portable_only(|| folded(&parts));
        assert_eq!(fast, portable);
        let (mut a, b) = (folded(&parts[..2]), folded(&parts[2..]));
        let mut c = a.clone();
        a.merge(&b);
        crate::fixed_point::portable_only(|| c.merge(&b));
        assert_eq!(a, c);
        assert_eq!(a, fast);
        // The vector finish against the scalar one, on every position.
        let mut out = vec![0f32; a.len()];
        a.finish(&mut out).unwrap();
        for (i, o) in out.iter().enumerate() {
            let want = value(i32::from(a.level[i]), a.hi[i], a.lo[i]);
            assert_eq!(o.to_bits(), want.to_bits(), "at {i}");
        }
    }

    #[test]
    fn small_parts_folded_before_a_large_one_count_as_truncated_at_its_level() {
        // Position 0: 1 + 2^-20 and -3·2^-40 (level 5, grid 2^-32), then 2^33 raises the level by
        // one (grid 1): the earlier parts count as trunc(1 + 2^-20) = 1 and trunc(-3·2^-40) = 0.
        // Position 1: the same, then 2^70 raises it by two: they count as 0.
        let first = [
            vec![1.0f32 + 2f32.powi(-20); 2],
            vec![-3.0 * 2f32.powi(-40); 2],
        ];
        let big = vec![2f32.powi(33), 2f32.powi(70)];
        let small_first = [first[0].clone(), first[1].clone(), big.clone()];
        let big_first = [big.clone(), first[1].clone(), first[0].clone()];
        let (a, b) = (folded(&small_first), folded(&big_first));
        assert_eq!(bits(&a), bits(&b));
        assert_eq!(a, b);
        for i in 0..2 {
            let (level, total) = reference(&small_first, i);
            assert_eq!(a.level[i], level);
            assert_eq!((i128::from(a.hi[i]) << 32) + i128::from(a.lo[i]), total);
        }
        assert_eq!(
            (a.level[0], a.hi[0], a.lo[0]),
            (6, 2, 1),
            "2^33 + 1 at grid 1"
        );
        assert_eq!(
            (a.level[1], a.hi[1], a.lo[1]),
            (7, 64, 0),
            "2^70 at grid 2^32"
        );
        let mut out = [0f32; 2];
        a.finish(&mut out).unwrap();
        assert_eq!(out, [(2f64.powi(33) + 1.0) as f32, 2f32.powi(70)]);
    }

    #[test]
    fn the_result_keeps_32_bits_below_the_largest_part() {
        let parts: Vec<Vec<f32>> = (0..16).map(|s| part(2000, s + 100)).collect();
        let s = folded(&parts);
        let mut out = vec![0f32; s.len()];
        s.finish(&mut out).unwrap();
        for (i, &got) in out.iter().enumerate() {
            let exact: f64 = parts.iter().map(|p| f64::from(p[i])).sum();
            let largest = parts.iter().map(|p| p[i].abs()).fold(0f32, f32::max);
            let bound = f64::from(largest) * 16.0 * 2f64.powi(-32) // truncations
                + exact.abs() * 2f64.powi(-24) // the rounding to f32
                + f64::from(f32::from_bits(1)); // ... and to subnormals
            assert!(
                (f64::from(got) - exact).abs() <= bound,
                "at {i}: {got} against {exact}"
            );
        }
    }

    #[test]
    fn bins_stay_exact_for_many_parts_at_the_top_of_their_range() {
        let near_max = f32::MAX / 2.0;
        let mut s = BinnedSum::new(2);
        for _ in 0..1000 {
            s.fold(&[near_max / 1024.0, -near_max / 1024.0]);
        }
        let mut out = [0f32; 2];
        s.finish(&mut out).unwrap();
        assert_eq!(
            out,
            [near_max / 1024.0 * 1000.0, -near_max / 1024.0 * 1000.0]
        );
    }

    #[test]
    fn the_two_conversions_of_the_bins_agree() {
        for (hi, lo) in [
            (3, -7),
            (-(1 << 52) + 5, (1 << 40) + 3),
            ((1 << 52) - 1, -(1 << 31) + 1),
        ] {
            let wide = ((i128::from(hi) << 32) + i128::from(lo)) as f64;
            assert_eq!(
                small_value(4, hi, lo),
                (wide * pow2(BASE + 128)) as f32,
                "{hi} {lo}"
            );
        }
        // Beyond 2^53 in a bin: the wide conversion.
        let (hi, lo) = (1i64 << 60, 12345);
        assert_eq!(value(6, hi, lo), (((1i128 << 92) + 12345) as f64) as f32);
    }

    #[test]
    fn a_non_finite_part_names_its_first_position() {
        let mut s = BinnedSum::new(4);
        s.fold(&[1.0, 2.0, f32::INFINITY, f32::NAN]);
        let mut other = BinnedSum::new(4);
        other.fold(&[1.0, f32::NAN, 0.0, 0.0]);
        s.merge(&other);
        let mut out = [0f32; 4];
        assert_eq!(
            s.finish(&mut out),
            Err(SumError::NonFinite { start: 1, end: 2 })
        );
        s.clear();
        s.fold(&[0.0, -0.0, 1.5, 0.0]);
        s.finish(&mut out).unwrap();
        assert_eq!(out, [0.0, 0.0, 1.5, 0.0]);
        assert_eq!(s.bytes(), 4 * 17);
    }
}
