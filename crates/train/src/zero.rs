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
//! | 0 | whole | whole | whole | exact reduce-scatter of `i64` sums, all-gather of the finished `f32` sums: `(n−1)/n·(8 + 4)P` bytes sent |
//! | 1 | chunk | whole | whole | the same, then all-gather of the updated `f32` chunks: `+(n−1)/n·4P` |
//! | 2 | chunk | chunk | whole | exact reduce-scatter `(n−1)/n·8P`, all-gather `(n−1)/n·4P` |
//! | 3 | chunk of each layer | chunk of each layer | chunk of each layer between steps | per layer: all-gather `(n−1)/n·4P` before the step, exact reduce-scatter `(n−1)/n·8P` |
//!
//! Why the bits cannot change: the exact sum of a chunk is the same whether it is all-reduced or
//! reduce-scattered (`ExactReducer::reduce_scatter_with_buckets` converts the owned chunk with the
//! buckets' shared exponents, which are all-reduced in full), and every optimizer is an
//! elementwise loop, so updating a chunk on its owner and copying the result to the others is the
//! unsharded update. Whole-model checkpoints gather the chunks of the optimizer state before a
//! save ([`Zero::whole_state`]); sharded ones (`checkpoint.sharded`) have each rank write its
//! chunks ([`Zero::chunks`]) at their canonical coordinates. A resumed whole state is cut into
//! chunks again ([`Zero::shard_of`]), so a sharded run resumes unsharded, on another world size,
//! and back.
//!
//! Level 3 (layered models) chunks each layer of a stage on its own ([`Zero::by_segments`]): the
//! stage's parameters are gathered layer by layer ([`Zero::gather`]) before a step's compute and
//! released after its last backward, so between steps a rank holds its chunks only. burn's
//! autodiff graphs keep a layer's weights from a micro-batch's forward to its backward, so within
//! a step the stage's parameters are whole. Level 2 chunks by layers too where the stage streams
//! its last micro-batch's gradient into the sum layer by layer (one stage, no tensor
//! parallelism, no recomputation: `lockstep_run::memory::streams_last_microbatch`); elsewhere
//! levels 1 and 2 chunk the whole vector as one segment.

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
    /// Ranges of the vector chunked independently over the group: the whole vector, or at level
    /// 3 every layer (so a layer is gathered by one all-gather of its own).
    segments: Vec<Range<usize>>,
    /// This rank's chunk of each segment, as ranges of the whole vector.
    chunks: Vec<Range<usize>>,
}

impl Zero {
    /// Sharding of `len` values over the data-parallel group `dp` at ZeRO `level` (0..=2; the
    /// whole vector is one segment).
    pub fn new(level: u8, len: usize, dp: &Communicator) -> Zero {
        Zero::for_rank(level, one_segment(len), dp.size(), dp.rank())
    }

    /// Sharding of a vector made of `segments` (consecutive ranges from 0, e.g. a stage's layers)
    /// over `dp`, each segment chunked on its own (ZeRO 3: layers are gathered one by one; a
    /// streamed sum reduces them one by one).
    pub fn by_segments(level: u8, segments: Vec<Range<usize>>, dp: &Communicator) -> Zero {
        Zero::for_rank(level, segments, dp.size(), dp.rank())
    }

    /// [`Zero::by_segments`] for rank `rank` of a group of `size`.
    pub fn for_rank(level: u8, segments: Vec<Range<usize>>, size: usize, rank: usize) -> Zero {
        let len = segments.last().map_or(0, |s| s.end);
        debug_assert!(
            segments.windows(2).all(|w| w[0].end == w[1].start)
                && segments.first().is_none_or(|s| s.start == 0),
            "segments must tile 0..{len}"
        );
        let chunks = segments
            .iter()
            .map(|s| {
                let c = chunk_range(s.len(), size.max(1), rank);
                s.start + c.start..s.start + c.end
            })
            .collect();
        Zero {
            level,
            len,
            segments,
            chunks,
        }
    }

    pub fn level(&self) -> u8 {
        self.level
    }

    /// Values of the whole vector.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether [`Zero::reduce_gradients`] sums all the values in one reduction (not layer by
    /// layer, as level 3 does): exponents scanned ahead over the whole vector then fit it.
    pub fn reduces_in_one_call(&self) -> bool {
        self.segments.len() <= 1
    }

    /// Values of the exact reducer's accumulator: the largest segment (the sum is reduced a
    /// segment at a time from level 2 on, the whole vector at once below).
    pub fn scratch_len(&self) -> usize {
        if self.level >= 2 {
            self.segments.iter().map(|s| s.len()).max().unwrap_or(0)
        } else {
            self.len
        }
    }

    /// This rank's chunk of each segment, as ranges of the whole vector (at every level: what
    /// it owns from level 1 on, and what it writes of a sharded checkpoint at any level).
    pub fn chunks(&self) -> &[Range<usize>] {
        &self.chunks
    }

    /// Values of this rank's chunks, in all.
    fn owned_len(&self) -> usize {
        self.chunks.iter().map(|c| c.len()).sum()
    }

    /// Values of optimizer state per state vector on this rank.
    pub fn optimizer_len(&self) -> usize {
        if self.level >= 1 {
            self.owned_len()
        } else {
            self.len
        }
    }

    /// Values of the reduced gradient on this rank.
    pub fn grad_len(&self) -> usize {
        if self.level >= 2 {
            self.owned_len()
        } else {
            self.len
        }
    }

    /// Values of the parameters this rank keeps between steps (its chunks at level 3).
    pub fn params_len(&self) -> usize {
        if self.level >= 3 {
            self.owned_len()
        } else {
            self.len
        }
    }

    /// This rank's chunks of a whole vector, concatenated.
    pub fn take_owned(&self, whole: &[f32]) -> Vec<f32> {
        self.chunks
            .iter()
            .flat_map(|c| whole[c.clone()].iter().copied())
            .collect()
    }

    /// Collective over the group: the whole vector from every rank's chunks (`owned`, as
    /// [`Zero::take_owned`] cut them), one all-gather per segment.
    pub fn gather(&self, owned: &[f32], dp: &mut Communicator) -> Result<Vec<f32>, CommError> {
        let mut whole = vec![0f32; self.len];
        let mut at = 0;
        for c in &self.chunks {
            whole[c.clone()].copy_from_slice(&owned[at..at + c.len()]);
            at += c.len();
        }
        self.gather_in_place(&mut whole, dp)?;
        Ok(whole)
    }

    /// Sum the local micro-batch gradients `parts` (whole vectors) over the group into `grad`
    /// ([`Zero::grad_len`] values: the whole vector below level 2, this rank's chunks from level
    /// 2): exactly with `buckets` in reproducible mode (all-reduced below level 2, reduce-scattered
    /// segment by segment from level 2; buckets never straddle a segment), else a plain `f32` sum.
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
        if self.level < 2 {
            if reproducible {
                return reducer.reduce_cheapest(dp, parts, total_parts, grad, buckets);
            }
            local_sum(parts, grad);
            dp.all_reduce(grad, ReduceOp::Sum)?;
            return Ok(());
        }
        for (i, seg) in self.segments.iter().enumerate() {
            let seg_parts: Vec<&[f32]> = parts.iter().map(|p| &p[seg.clone()]).collect();
            let at = self.chunk_offset(i);
            let out = &mut grad[at..at + self.chunks[i].len()];
            self.reduce_segment(
                reducer,
                dp,
                i,
                &seg_parts,
                total_parts,
                buckets,
                reproducible,
                out,
            )?;
        }
        Ok(())
    }

    /// Where segment `i`'s chunk starts in this rank's owned values (its chunks, segment after
    /// segment): in the reduced gradient from level 2, in the optimizer state from level 1, in
    /// the parameters kept between steps at level 3.
    pub fn chunk_offset(&self, i: usize) -> usize {
        self.chunks[..i].iter().map(|c| c.len()).sum()
    }

    /// Values of this rank's largest chunk of one segment (a streamed ZeRO 3 sum that steps the
    /// optimizer segment by segment holds one such chunk of reduced gradient at a time).
    pub fn largest_chunk(&self) -> usize {
        self.chunks.iter().map(|c| c.len()).max().unwrap_or(0)
    }

    /// Level 2 and up: segment `i`'s part of [`Zero::reduce_gradients`], from `seg_parts` (each
    /// part's values of that segment alone): this rank's chunk of the segment's sum, written to
    /// `out` (that chunk's length). Segments are independent (each its own exponents and
    /// reduce-scatter), so they may be reduced in any order that every rank of `dp` follows —
    /// the last layer first, as a streamed backward hands them out.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_segment(
        &self,
        reducer: &mut ExactReducer,
        dp: &mut Communicator,
        i: usize,
        seg_parts: &[&[f32]],
        total_parts: usize,
        buckets: &[Range<usize>],
        reproducible: bool,
        out: &mut [f32],
    ) -> Result<(), ExactError> {
        let seg = &self.segments[i];
        if reproducible {
            let seg_buckets: Vec<Range<usize>> = buckets
                .iter()
                .filter(|b| b.start >= seg.start && b.end <= seg.end)
                .map(|b| b.start - seg.start..b.end - seg.start)
                .collect();
            reducer.reduce_scatter_with_buckets(dp, seg_parts, total_parts, out, &seg_buckets)?;
        } else {
            let mut sum = vec![0f32; seg.len()];
            local_sum(seg_parts, &mut sum);
            let mine = dp.reduce_scatter(&mut sum, ReduceOp::Sum)?;
            out.copy_from_slice(&sum[mine]);
        }
        Ok(())
    }

    /// The segments the vector is reduced in from level 2 on (ZeRO 3: the stage's layers).
    pub fn segments(&self) -> &[Range<usize>] {
        &self.segments
    }

    /// One optimizer step with `grad` as [`Zero::reduce_gradients`] left it: on the whole
    /// `params` at level 0; at levels 1 and 2 on this rank's chunk of each segment, after which
    /// the chunks are all-gathered so every replica holds the whole updated `params` again; at
    /// level 3 `params` are this rank's chunks and stay so. Returns the seconds spent in the
    /// all-gather (communication, not optimizer work).
    pub fn step(
        &self,
        optimizer: &mut Optimizer,
        params: &mut [f32],
        grad: &[f32],
        lr: f32,
        dp: &mut Communicator,
    ) -> Result<f64, CommError> {
        if self.level == 0 || self.level >= 3 {
            optimizer.step(params, grad, lr);
            return Ok(0.0);
        }
        // Levels 1 and 2: the optimizer state holds the chunks, segment after segment.
        for (i, chunk) in self.chunks.iter().enumerate() {
            let at = self.chunk_offset(i);
            let grad = match self.level {
                1 => &grad[chunk.clone()],
                _ => &grad[at..at + chunk.len()],
            };
            optimizer.step_range(at, &mut params[chunk.clone()], grad, lr);
        }
        optimizer.finish_step();
        let t0 = std::time::Instant::now();
        self.gather_in_place(params, dp)?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Collective over the group: the whole vector `params` on every rank from each rank's
    /// chunks, written in place (this rank's at their places already), one all-gather per
    /// segment.
    pub fn gather_in_place(
        &self,
        params: &mut [f32],
        dp: &mut Communicator,
    ) -> Result<(), CommError> {
        for s in &self.segments {
            dp.all_gather_chunks(&mut params[s.clone()])?;
        }
        Ok(())
    }

    /// Collective over the group, at level 3: segment `i` of the whole vector (a layer of the
    /// stage) from every rank's chunk of it, `owned` being this rank's chunks (one all-gather).
    pub fn gather_segment(
        &self,
        i: usize,
        owned: &[f32],
        dp: &mut Communicator,
    ) -> Result<Vec<f32>, CommError> {
        let (seg, chunk) = (&self.segments[i], &self.chunks[i]);
        let mut values = vec![0f32; seg.len()];
        values[chunk.start - seg.start..chunk.end - seg.start]
            .copy_from_slice(&owned[self.params_range(i)]);
        dp.all_gather_chunks(&mut values)?;
        Ok(values)
    }

    /// Where segment `i`'s chunk lies in the parameters this rank keeps ([`Zero::params_len`]):
    /// among its own chunks at level 3, at its place in the whole vector below.
    pub fn params_range(&self, i: usize) -> Range<usize> {
        match self.level {
            3.. => {
                let at = self.chunk_offset(i);
                at..at + self.chunks[i].len()
            }
            _ => self.chunks[i].clone(),
        }
    }

    /// Collective over the group: the whole optimizer state vectors (for a checkpoint).
    pub fn whole_state<'o>(
        &self,
        optimizer: &'o Optimizer,
        dp: &mut Communicator,
    ) -> Result<Vec<std::borrow::Cow<'o, [f32]>>, CommError> {
        // Level 0 holds the whole state already: lent, not copied.
        optimizer
            .state()
            .into_iter()
            .map(|v| {
                if self.level == 0 {
                    Ok(std::borrow::Cow::Borrowed(v))
                } else {
                    self.gather(v, dp).map(std::borrow::Cow::Owned)
                }
            })
            .collect()
    }

    /// This rank's optimizer, cut from a resumed one whose vectors hold this sharded vector at
    /// `offset` (0 for a whole model; a pipeline stage's first value otherwise).
    pub fn shard_of(&self, whole: &Optimizer, offset: usize) -> Optimizer {
        let mut mine = whole.fresh(self.optimizer_len());
        for (dst, src) in mine.state_mut().into_iter().zip(whole.state()) {
            let src = &src[offset..offset + self.len];
            if self.level == 0 {
                dst.copy_from_slice(src);
            } else {
                dst.copy_from_slice(&self.take_owned(src));
            }
        }
        mine.set_steps_taken(whole.steps_taken());
        mine
    }
}

/// `out` = the plain `f32` sum of `parts`, in order (plain mode: deterministic at a fixed layout).
fn local_sum(parts: &[&[f32]], out: &mut [f32]) {
    out.fill(0.0);
    for p in parts {
        for (a, b) in out.iter_mut().zip(p.iter()) {
            *a += b;
        }
    }
}

/// The whole vector of `len` values as the one segment levels 0–2 chunk.
fn one_segment(len: usize) -> Vec<Range<usize>> {
    std::iter::once(0..len).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_rank_holds_follows_the_level() {
        let z = |level| Zero::for_rank(level, one_segment(10), 3, 1);
        assert_eq!(
            (z(0).optimizer_len(), z(0).grad_len(), z(0).params_len()),
            (10, 10, 10)
        );
        assert_eq!(
            (z(1).optimizer_len(), z(1).grad_len(), z(1).params_len()),
            (3, 10, 10)
        );
        assert_eq!(
            (z(2).optimizer_len(), z(2).grad_len(), z(2).params_len()),
            (3, 3, 10)
        );
        // The chunks tile the vector.
        let chunks: Vec<_> = (0..3)
            .map(|r| Zero::for_rank(2, one_segment(10), 3, r).chunks)
            .collect();
        assert_eq!(chunks, vec![one_segment(4), vec![4..7], vec![7..10]]);
        // Level 3 by layers: each layer chunked on its own.
        let layers = vec![0..5, 5..6, 6..10];
        let z3 = Zero::for_rank(3, layers, 2, 1);
        assert_eq!(z3.chunks, vec![3..5, 6..6, 8..10]);
        assert_eq!(
            (z3.optimizer_len(), z3.grad_len(), z3.params_len()),
            (4, 4, 4)
        );
        let whole: Vec<f32> = (0..10).map(|i| i as f32).collect();
        assert_eq!(z3.take_owned(&whole), vec![3.0, 4.0, 8.0, 9.0]);
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
        let mine = Zero::for_rank(1, one_segment(7), 2, 1).shard_of(&whole, 0);
        assert_eq!(mine.state()[0], &[4.0, 5.0, 6.0][..]);
        assert_eq!(mine.state()[1], &[104.0, 105.0, 106.0][..]);
        assert_eq!(mine.steps_taken(), 5);
        // A stage's 4 values at offset 3, sharded over 2: rank 0 holds 3..5.
        let stage = Zero::for_rank(2, one_segment(4), 2, 0).shard_of(&whole, 3);
        assert_eq!(stage.state()[0], &[3.0, 4.0][..]);
        assert_eq!(
            Zero::for_rank(0, one_segment(4), 2, 0)
                .shard_of(&whole, 3)
                .state()[1],
            &[103.0, 104.0, 105.0, 106.0][..]
        );
    }
}
