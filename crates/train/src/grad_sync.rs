//! Combining the micro-batch gradients of all ranks into the global-batch gradient.
//!
//! Two modes:
//! - **reproducible** (default): [`ExactReducer`] — fixed-point integer sum with a shared exponent per
//!   bucket; the result's bits depend only on the set of micro-batches, not on the world size or order.
//! - **plain**: local micro-batch gradients summed in order, then an f32 ring/tree all-reduce per
//!   bucket; deterministic run to run at a fixed world size (the reduction order is fixed), but a
//!   different world size groups the additions differently and changes low bits.
//!
//! Both start with the loss exchange, a tiny collective whose duration is time spent waiting for the
//! slowest rank to finish computing; it is reported as `waiting`, the rest as `communication`.

use std::time::Instant;

use lockstep_comm::exact::{ExactError, ExactReducer};
use lockstep_comm::{Communicator, ReduceOp};

pub struct GradSync {
    reproducible: bool,
    bucket_elems: usize,
    reducer: ExactReducer,
    loss_reducer: ExactReducer,
}

/// Timing of one synchronisation.
#[derive(Debug, Clone, Copy, Default)]
pub struct SyncTiming {
    pub waiting: f64,
    pub communication: f64,
}

impl GradSync {
    pub fn new(reproducible: bool, bucket_elems: usize) -> Self {
        Self {
            reproducible,
            bucket_elems,
            reducer: ExactReducer::new(bucket_elems),
            loss_reducer: ExactReducer::new(1),
        }
    }

    /// Sum `local_grads` (one per local micro-batch, already scaled by 1/global_batch) over all ranks
    /// into `out`, and the local losses into the returned global loss.
    pub fn sync(
        &mut self,
        comm: &mut Communicator,
        local_grads: &[&[f32]],
        local_losses: &[f32],
        total_microbatches: usize,
        out: &mut [f32],
    ) -> Result<(f64, SyncTiming), ExactError> {
        let t0 = Instant::now();
        let loss_parts: Vec<[f32; 1]> = local_losses.iter().map(|&l| [l]).collect();
        let loss_refs: Vec<&[f32]> = loss_parts.iter().map(|p| &p[..]).collect();
        let mut loss = [0f32; 1];
        self.loss_reducer.reduce(comm, &loss_refs, total_microbatches, &mut loss)?;
        let t1 = Instant::now();

        if self.reproducible {
            self.reducer.reduce(comm, local_grads, total_microbatches, out)?;
        } else {
            out.fill(0.0);
            for g in local_grads {
                for (o, v) in out.iter_mut().zip(g.iter()) {
                    *o += *v;
                }
            }
            for chunk in out.chunks_mut(self.bucket_elems) {
                comm.all_reduce(chunk, ReduceOp::Sum)?;
            }
        }
        let t2 = Instant::now();
        Ok((
            loss[0] as f64,
            SyncTiming { waiting: (t1 - t0).as_secs_f64(), communication: (t2 - t1).as_secs_f64() },
        ))
    }
}
