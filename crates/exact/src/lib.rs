//! lockstep-exact: the exact, order-independent sum of `f32` parts that lockstep's
//! reproducibility rests on, as plain arithmetic with no communication.
//!
//! Each value's parts are converted to `i64` fixed point against one exponent shared by a whole
//! bucket (the largest among all parts, with headroom for their number), added as integers —
//! which is associative, so the order and grouping of the additions cannot change a bit — and
//! converted back once. [`sum_local`] is the sum of parts one process holds;
//! `lockstep_comm::exact` forms the same sums across ranks (all-reduce, reduce-scatter, shared
//! windows) with the same functions, so both give the same bits. Models (tensor-parallel pieces
//! on one worker) use this crate without depending on any transport.
//!
//! [`binned::BinnedSum`] is a second exact sum, one that takes one part at a time in memory that
//! does not grow with the number of parts (the arithmetic gradient accumulation in O(P) needs);
//! its bits are not the shared-exponent sum's, and no training path uses it yet.

pub mod binned;
pub mod fixed_point;
pub mod square_sum;

use std::ops::Range;

use fixed_point::{accumulate_fixed, finish_fixed, max_exponent, shift_for, ALL_ZERO, NON_FINITE};

/// Why an exact sum could not be formed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SumError {
    /// A part holds NaN or infinity in `start..end` (no fixed point can represent it).
    #[error("non-finite value (NaN or infinity) in elements {start}..{end}")]
    NonFinite { start: usize, end: usize },
    /// The parts do not fit the output or the job (a caller's error).
    #[error("exact sum: {0}")]
    Invalid(String),
}

/// The largest exponent bound ([`max_exponent`]) of `range` over all `parts`; [`ALL_ZERO`] when
/// there are none, [`NON_FINITE`] when any value is NaN or infinite.
pub fn parts_max_exponent(parts: &[&[f32]], range: Range<usize>) -> i32 {
    parts
        .iter()
        .map(|p| max_exponent(&p[range.clone()]))
        .max()
        .unwrap_or(ALL_ZERO)
}

/// Every part must have the output's length `len`, and no rank can hold more parts than the job's
/// `total_parts`.
pub fn check_parts(local_parts: &[&[f32]], total_parts: usize, len: usize) -> Result<(), SumError> {
    if let Some(bad) = local_parts.iter().find(|p| p.len() != len) {
        return Err(SumError::Invalid(format!(
            "a local part has {} values but the output has {len}",
            bad.len()
        )));
    }
    if local_parts.len() > total_parts {
        return Err(SumError::Invalid(format!(
            "{} local parts but only {total_parts} in the job",
            local_parts.len()
        )));
    }
    Ok(())
}

/// The exact sum of `parts` that one process holds all of, with one shared exponent for the whole
/// vector: bitwise what `lockstep_comm::exact::ExactReducer::reduce_with_buckets` with the single
/// bucket `0..out.len()` gives when the same `total_parts` parts are spread over any number of
/// ranks, but without communication. Tensor parallelism sums a layer's fixed pieces with it on one
/// worker (and with that one-bucket reduction over its tensor-parallel group on several).
pub fn sum_local(parts: &[&[f32]], total_parts: usize, out: &mut [f32]) -> Result<(), SumError> {
    check_parts(parts, total_parts, out.len())?;
    let e_max = parts_max_exponent(parts, 0..out.len());
    if e_max == NON_FINITE {
        return Err(SumError::NonFinite {
            start: 0,
            end: out.len(),
        });
    }
    if e_max == ALL_ZERO {
        out.fill(0.0);
        return Ok(());
    }
    let shift = shift_for(e_max, total_parts);
    let mut acc = vec![0i64; out.len()];
    for p in parts {
        accumulate_fixed(&mut acc, p, shift);
    }
    finish_fixed(&acc, shift, out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sum_does_not_depend_on_the_order_of_the_parts() {
        let parts: Vec<Vec<f32>> = (0..5)
            .map(|p| {
                (0..64)
                    .map(|i| ((i * 7 + p * 13) as f32).sin() * 1e3)
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
        let mut forward = vec![0f32; 64];
        sum_local(&refs, refs.len(), &mut forward).unwrap();
        let reversed: Vec<&[f32]> = refs.iter().rev().copied().collect();
        let mut backward = vec![0f32; 64];
        sum_local(&reversed, refs.len(), &mut backward).unwrap();
        assert_eq!(
            forward.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            backward.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        // Exact to f32 rounding of the true sum (checked in f64).
        for i in 0..64 {
            let exact: f64 = parts.iter().map(|p| p[i] as f64).sum();
            assert!((forward[i] as f64 - exact).abs() <= exact.abs() * 1e-6 + 1e-3);
        }
    }

    #[test]
    fn non_finite_and_misshapen_parts_are_refused() {
        let mut out = vec![0f32; 2];
        let nan = [1.0, f32::NAN];
        assert_eq!(
            sum_local(&[&nan], 1, &mut out),
            Err(SumError::NonFinite { start: 0, end: 2 })
        );
        assert!(matches!(
            sum_local(&[&[1.0]], 1, &mut out),
            Err(SumError::Invalid(_))
        ));
        assert!(matches!(
            sum_local(&[&[1.0, 2.0], &[3.0, 4.0]], 1, &mut out),
            Err(SumError::Invalid(_))
        ));
    }
}
