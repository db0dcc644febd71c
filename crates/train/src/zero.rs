//! ZeRO: sharding the model state of data-parallel replicas (`parallel.zero`), without changing
//! a single bit of the result.
//!
//! A data-parallel group of `n` replicas holds `n` copies of the same model state. Sharding
//! splits a flat vector of `P` values (the whole model, or a pipeline stage's slice) into the
//! chunks [`chunk_range`]`(P, n, r)` — the chunk a ring reduce-scatter leaves on rank `r` — and
//! keeps on rank `r` only what its level says:
//!
//! | level | optimizer state | reduced gradient | parameters | per step, besides the local gradients |
//! |---|---|---|---|---|
//! | 0 | whole | whole | whole | exact all-reduce of `i64` sums: `2·(n−1)/n·8P` bytes sent |
//! | 1 | chunk | whole | whole | the same, then all-gather of the updated `f32` chunks: `+(n−1)/n·4P` |
//! | 2 | chunk | chunk | whole | exact reduce-scatter `(n−1)/n·8P`, all-gather `(n−1)/n·4P` |
//! | 3 | chunk | chunk | chunk, gathered layer by layer (layered models; see the pipeline loop) | |
//!
//! Why the bits cannot change: the exact sum of a chunk is the same whether it is all-reduced or
//! reduce-scattered (`ExactReducer::reduce_scatter_with_buckets` converts the owned chunk with the
//! buckets' shared exponents, which are all-reduced in full), and every optimizer is an
//! elementwise loop, so updating a chunk on its owner and copying the result to the others is the
//! unsharded update. Checkpoints stay whole-model: the chunks of the optimizer state are gathered
//! before a save ([`Zero::whole_state`]) and a resumed whole state is cut into chunks again
//! ([`Zero::shard_of`]), so a sharded run resumes unsharded, on another world size, and back.

use std::ops::Range;

use lockstep_comm::collectives::chunk_range;
use lockstep_comm::exact::{ExactError, ExactReducer};
use lockstep_comm::{CommError, Communicator, ReduceOp};
use lockstep_model::Optimizer;

/// How one rank shards a flat vector of model state over its data-parallel group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Zero {
    level: u8,
    len: usize,
    /// This rank's chunk of `0..len`.
    chunk: Range<usize>,
}

impl Zero {
    /// Sharding of `len` values over the data-parallel group `dp` at ZeRO `level` (0..=3).
    pub fn new(level: u8, len: usize, dp: &Communicator) -> Zero {
        Zero::for_rank(level, len, dp.size(), dp.rank())
    }

    /// [`Zero::new`] for rank `rank` of a group of `size`.
    pub fn for_rank(level: u8, len: usize, size: usize, rank: usize) -> Zero {
        Zero {
            level,
            len,
            chunk: chunk_range(len, size.max(1), rank),
        }
    }

    pub fn level(&self) -> u8 {
        self.level
    }

    /// The values the optimizer updates on this rank (and holds state for).
    pub fn update_range(&self) -> Range<usize> {
        if self.level >= 1 {
            self.chunk.clone()
        } else {
            0..self.len
        }
    }

    /// The values of the reduced gradient this rank holds.
    pub fn grad_range(&self) -> Range<usize> {
        if self.level >= 2 {
            self.chunk.clone()
        } else {
            0..self.len
        }
    }

    /// Values of optimizer state per state vector on this rank.
    pub fn optimizer_len(&self) -> usize {
        self.update_range().len()
    }

    /// Values of the reduced gradient on this rank.
    pub fn grad_len(&self) -> usize {
        self.grad_range().len()
    }

    /// Sum the local micro-batch gradients `parts` (whole vectors) over the group into `grad`
    /// ([`Zero::grad_len`] values covering [`Zero::grad_range`]): exactly with `buckets` in
    /// reproducible mode (all-reduced below level 2, reduce-scattered from level 2), else a plain
    /// `f32` sum.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_gradients(
        &self,
        reducer: &mut ExactReducer,
        dp: &mut Communicator,
        parts: &[&[f32]],
        total_parts: usize,
        buckets: &[Range<usize>],
        reproducible: bool,
        grad: &mut [f32],
    ) -> Result<(), ExactError> {
        match (reproducible, self.level >= 2) {
            (true, false) => reducer.reduce_with_buckets(dp, parts, total_parts, grad, buckets),
            (true, true) => reducer
                .reduce_scatter_with_buckets(dp, parts, total_parts, grad, buckets)
                .map(|_| ()),
            (false, scatter) => {
                let mut sum = vec![0f32; self.len];
                for p in parts {
                    for (a, b) in sum.iter_mut().zip(p.iter()) {
                        *a += b;
                    }
                }
                if scatter {
                    let mine = dp.reduce_scatter(&mut sum, ReduceOp::Sum)?;
                    grad.copy_from_slice(&sum[mine]);
                } else {
                    dp.all_reduce(&mut sum, ReduceOp::Sum)?;
                    grad.copy_from_slice(&sum);
                }
                Ok(())
            }
        }
    }

    /// One optimizer step: on the whole vector at level 0; from level 1 on this rank's chunk only
    /// (with `grad` as [`Zero::reduce_gradients`] left it), after which the chunks are all-gathered
    /// so every replica holds the whole updated `params` again. Returns the seconds spent in that
    /// all-gather (communication, not optimizer work).
    pub fn step(
        &self,
        optimizer: &mut Optimizer,
        params: &mut [f32],
        grad: &[f32],
        lr: f32,
        dp: &mut Communicator,
    ) -> Result<f64, CommError> {
        if self.level == 0 {
            optimizer.step(params, grad, lr);
            return Ok(0.0);
        }
        let chunk = self.chunk.clone();
        let grad = if self.level >= 2 {
            grad
        } else {
            &grad[chunk.clone()]
        };
        optimizer.step(&mut params[chunk], grad, lr);
        let t0 = std::time::Instant::now();
        dp.all_gather_chunks(params)?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Collective over the group: the whole optimizer state vectors (for a checkpoint).
    pub fn whole_state(
        &self,
        optimizer: &Optimizer,
        dp: &mut Communicator,
    ) -> Result<Vec<Vec<f32>>, CommError> {
        optimizer
            .state()
            .into_iter()
            .map(|v| {
                if self.level == 0 {
                    return Ok(v.to_vec());
                }
                let mut whole = vec![0f32; self.len];
                whole[self.chunk.clone()].copy_from_slice(v);
                dp.all_gather_chunks(&mut whole)?;
                Ok(whole)
            })
            .collect()
    }

    /// This rank's optimizer, cut from a resumed one whose vectors hold this sharded vector at
    /// `offset` (0 for a whole model; a pipeline stage's first value otherwise).
    pub fn shard_of(&self, whole: &Optimizer, offset: usize) -> Optimizer {
        let r = self.update_range();
        let range = offset + r.start..offset + r.end;
        let mut mine = Optimizer::new(whole.spec(), range.len());
        for (dst, src) in mine.state_mut().into_iter().zip(whole.state()) {
            dst.copy_from_slice(&src[range.clone()]);
        }
        mine.set_steps_taken(whole.steps_taken());
        mine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_follow_the_level() {
        let z = |level| Zero::for_rank(level, 10, 3, 1);
        assert_eq!(z(0).update_range(), 0..10);
        assert_eq!(z(0).grad_range(), 0..10);
        assert_eq!(z(1).update_range(), 4..7);
        assert_eq!(z(1).grad_range(), 0..10);
        assert_eq!(z(2).update_range(), 4..7);
        assert_eq!(z(2).grad_range(), 4..7);
        assert_eq!(z(3).optimizer_len(), 3);
        // The chunks tile the vector.
        let ends: Vec<_> = (0..3).map(|r| Zero::for_rank(2, 10, 3, r).chunk).collect();
        assert_eq!(ends, vec![0..4, 4..7, 7..10]);
    }

    #[test]
    fn a_shard_of_a_whole_optimizer_keeps_its_slice_and_step_count() {
        let spec = lockstep_model::OptimizerSpec::AdamW {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut whole = Optimizer::new(&spec, 7);
        for (k, v) in whole.state_mut().into_iter().enumerate() {
            for (i, x) in v.iter_mut().enumerate() {
                *x = (k * 100 + i) as f32;
            }
        }
        whole.set_steps_taken(5);
        let mine = Zero::for_rank(1, 7, 2, 1).shard_of(&whole, 0);
        assert_eq!(mine.state()[0], &[4.0, 5.0, 6.0][..]);
        assert_eq!(mine.state()[1], &[104.0, 105.0, 106.0][..]);
        assert_eq!(mine.steps_taken(), 5);
        // A stage's 4 values at offset 3, sharded over 2: rank 0 holds 3..5.
        let stage = Zero::for_rank(2, 4, 2, 0).shard_of(&whole, 3);
        assert_eq!(stage.state()[0], &[3.0, 4.0][..]);
        assert_eq!(Zero::for_rank(0, 4, 2, 0).shard_of(&whole, 3).state()[1], &[103.0, 104.0, 105.0, 106.0][..]);
    }
}
