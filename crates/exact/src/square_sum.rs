//! The exact sum of squares of `f32` values held anywhere: the global gradient norm for clipping
//! (`optimizer.clip_grad_norm`), the same bits however the values are split across ranks.
//!
//! Every finite `f32` is `m · 2^e` with an integer `|m| < 2^24` and `e` in `-149..=104` (254
//! values), so its square is `m² · 2^(2e)` with `m² < 2^48`, exactly. [`SquareSum`] keeps one
//! integer bin per `e`, split into two `i64` lanes (`m²`'s low 32 bits and its high 16 bits) so
//! that adding a value never overflows before 2^31 values per bin and lanes add across ranks as
//! plain integers (`ReduceOp::Sum`, wrapping, exact while the total stays in range): the bins —
//! and so [`SquareSum::total`], one fixed function of them — do not depend on how the values were
//! grouped, ordered or split. Steps: one pass over the values (a few integer operations each);
//! bytes: 2 × 254 `i64` per rank in one all-reduce.

/// Bins: one per binary exponent of an `f32` (`e + 149`).
pub const BINS: usize = 254;

/// Lanes of a [`SquareSum`] as it travels: low halves, high halves, then the count of NaN or
/// infinite values.
pub const LANES: usize = 2 * BINS + 1;

/// An exact sum of squares (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SquareSum {
    /// `[low 32 bits of Σ m² per bin…, high bits of Σ m² per bin…, non-finite values]`.
    lanes: Vec<i64>,
}

impl Default for SquareSum {
    fn default() -> Self {
        SquareSum {
            lanes: vec![0; LANES],
        }
    }
}

impl SquareSum {
    /// Add the squares of `values`.
    pub fn add(&mut self, values: &[f32]) {
        let (low, rest) = self.lanes.split_at_mut(BINS);
        let (high, non_finite) = rest.split_at_mut(BINS);
        for v in values {
            let bits = v.to_bits();
            let biased = (bits >> 23) & 0xff;
            let fraction = u64::from(bits & 0x7f_ffff);
            let (m, bin) = match biased {
                0 => (fraction, 0),
                0xff => {
                    non_finite[0] += 1;
                    continue;
                }
                b => (fraction | 1 << 23, b as usize - 1),
            };
            let square = m * m;
            low[bin] += (square & 0xffff_ffff) as i64;
            high[bin] += (square >> 32) as i64;
        }
    }

    /// The lanes to all-reduce (sum) across ranks.
    pub fn lanes(&self) -> &[i64] {
        &self.lanes
    }

    /// The sum whose lanes are `lanes` (every rank's [`SquareSum::lanes`] summed).
    pub fn from_lanes(lanes: Vec<i64>) -> Self {
        assert_eq!(lanes.len(), LANES, "a square sum has {LANES} lanes");
        SquareSum { lanes }
    }

    /// The sum of squares, rounded to `f64` by one fixed procedure (bins from the largest
    /// exponent down); `None` if a value was NaN or infinite.
    pub fn total(&self) -> Option<f64> {
        let (low, rest) = self.lanes.split_at(BINS);
        let (high, non_finite) = rest.split_at(BINS);
        if non_finite[0] != 0 {
            return None;
        }
        let mut sum = 0.0f64;
        for bin in (0..BINS).rev() {
            let m2 = (u128::from(high[bin] as u64) << 32) + u128::from(low[bin] as u64);
            if m2 != 0 {
                // m · 2^e with e = bin − 149 (bin 0: the subnormals and the smallest normals).
                let e = bin as i32 - 149;
                sum += m2 as f64 * 2f64.powi(2 * e);
            }
        }
        Some(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
                let scale = [1e-30f32, 1e-3, 1.0, 7e3, 1e-42][i % 5];
                (h as f32 / 16_777_216.0 - 0.5) * scale
            })
            .collect()
    }

    #[test]
    fn the_total_matches_a_wide_reference_and_ignores_the_split() {
        let v = values(10_000);
        let mut whole = SquareSum::default();
        whole.add(&v);
        let reference: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let total = whole.total().unwrap();
        assert!(
            (total - reference).abs() <= reference * 1e-12,
            "{total} vs {reference}"
        );
        // Any split into parts, summed as lanes in any order: the same bits.
        for parts in [2, 3, 7] {
            let mut lanes = vec![0i64; LANES];
            for chunk in v.chunks(v.len().div_ceil(parts)).rev() {
                let mut s = SquareSum::default();
                s.add(chunk);
                for (a, b) in lanes.iter_mut().zip(s.lanes()) {
                    let b = *b;
                    *a = a.wrapping_add(b);
                }
            }
            let split = SquareSum::from_lanes(lanes);
            assert_eq!(split, whole, "{parts} parts");
            assert_eq!(split.total().unwrap().to_bits(), total.to_bits());
        }
    }

    #[test]
    fn closed_forms_and_extremes() {
        let mut s = SquareSum::default();
        s.add(&[3.0, -4.0]);
        assert_eq!(s.total(), Some(25.0));
        let mut tiny = SquareSum::default();
        tiny.add(&[f32::from_bits(1)]); // 2^-149
        assert_eq!(tiny.total(), Some(2f64.powi(-298)));
        let mut big = SquareSum::default();
        big.add(&[f32::MAX]);
        assert_eq!(big.total(), Some(f64::from(f32::MAX) * f64::from(f32::MAX)));
        assert_eq!(SquareSum::default().total(), Some(0.0));
    }

    #[test]
    fn a_non_finite_value_poisons_the_sum_across_ranks() {
        let mut bad = SquareSum::default();
        bad.add(&[1.0, f32::NAN]);
        let mut good = SquareSum::default();
        good.add(&[2.0]);
        let lanes: Vec<i64> = bad
            .lanes()
            .iter()
            .zip(good.lanes())
            .map(|(a, b)| a.wrapping_add(*b))
            .collect();
        assert_eq!(SquareSum::from_lanes(lanes).total(), None);
    }
}
