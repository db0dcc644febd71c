//! Gradient clipping by global norm (`optimizer.clip_grad_norm`), the same bits on every layout.
//!
//! The norm is of the step's summed gradient over the whole model: each rank adds the squares
//! of the values it counts to an exact [`SquareSum`] — a data-parallel group's identical copies
//! split evenly among its ranks (ZeRO 0/1), each rank's own shard otherwise (ZeRO 2/3), every
//! pipeline stage its own layers — and one world all-reduce of the sum's integer lanes gives
//! every rank the same total, whatever the split. Every rank then scales the values it updates
//! by the same `f32` factor `min(1, clip / (norm + 1e-6))` (PyTorch's `clip_grad_norm_`), so each
//! parameter sees the one-worker bits. Tensor-parallel ranks (`parallel.tp > 1`) hold replicated
//! tensors twice; the plan refuses clipping there.
//!
//! The shared-window sum area may be read by several ranks, so the gradient is never scaled in
//! place: a clipped step's gradient is a scaled copy.

use std::ops::Range;

use lockstep_comm::{CommError, Communicator, ReduceOp};
use lockstep_exact::square_sum::SquareSum;

/// The clipping state of a rank: the limit and the buffer of a clipped gradient.
pub(crate) struct Clip {
    max_norm: f32,
    scaled: Vec<f32>,
}

/// A step's gradient after clipping.
pub(crate) struct Clipped<'g> {
    /// What the optimizer steps with.
    pub grad: &'g [f32],
    /// The global norm before clipping.
    pub norm: f64,
}

impl Clip {
    /// Clipping to `max_norm`, or `None` when it is off (0).
    pub fn new(max_norm: f32) -> Option<Clip> {
        (max_norm > 0.0).then(|| Clip {
            max_norm,
            scaled: Vec::new(),
        })
    }

    /// `grad` clipped to the global norm: this rank counts `grad[counted]` toward it; collective
    /// over `world` (every rank of the job calls it in the same step).
    pub fn apply<'g>(
        &'g mut self,
        grad: &'g [f32],
        counted: Range<usize>,
        world: &mut Communicator,
    ) -> Result<Clipped<'g>, CommError> {
        let mut sum = SquareSum::default();
        sum.add(&grad[counted]);
        let mut lanes = sum.lanes().to_vec();
        world.all_reduce(&mut lanes, ReduceOp::Sum)?;
        // A NaN or infinite gradient has no norm: leave it to the update (the loss check stops
        // such runs first).
        let norm = SquareSum::from_lanes(lanes)
            .total()
            .map_or(f64::NAN, f64::sqrt);
        let factor = self.factor(norm);
        if factor >= 1.0 || norm.is_nan() {
            return Ok(Clipped { grad, norm });
        }
        self.scaled.clear();
        self.scaled.extend(grad.iter().map(|g| g * factor));
        Ok(Clipped {
            grad: &self.scaled,
            norm,
        })
    }

    /// The scale of a gradient of global norm `norm`.
    fn factor(&self, norm: f64) -> f32 {
        (f64::from(self.max_norm) / (norm + 1e-6)).min(1.0) as f32
    }
}

/// The part of a data-parallel group's identical vector of `len` values that rank `rank` of
/// `size` counts: even, contiguous, disjoint, covering it.
pub(crate) fn even_share(len: usize, size: usize, rank: usize) -> Range<usize> {
    let per = len.div_ceil(size.max(1));
    (rank * per).min(len)..((rank + 1) * per).min(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_shares_cover_the_vector_once() {
        for (len, size) in [(10, 3), (3, 5), (0, 2), (7, 1)] {
            let mut covered = 0;
            for r in 0..size {
                let s = even_share(len, size, r);
                assert_eq!(s.start, covered.min(len));
                covered = s.end.max(covered);
            }
            assert_eq!(covered, len, "{len} over {size}");
        }
    }

    #[test]
    fn the_factor_follows_pytorch() {
        let c = Clip::new(1.0).unwrap();
        assert_eq!(c.factor(0.5), 1.0);
        assert_eq!(c.factor(4.0), (1.0 / (4.0 + 1e-6)) as f32);
        assert!(Clip::new(0.0).is_none());
    }
}
