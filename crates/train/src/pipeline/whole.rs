//! One step of a model trained whole (a replica on the one stage of `flat.rs`): each local
//! micro-batch's forward and backward in one call, straight into this rank's gradient part, its
//! exponents scanned while the part is in cache; then the sum ([`GradSync::reduce`]) — or, with
//! `dist.overlap`, the last micro-batch's backward streaming its gradients into a sum that runs
//! alongside it ([`GradSync::sync_streamed`]). Same bits either way.

use std::ops::Range;
use std::time::Instant;

use lockstep_comm::exact::ExactError;
use lockstep_comm::{activity, Communicator};
use lockstep_model::TimedLoss;

use crate::draws::Draws;
use crate::error::TrainError;
use crate::grad_parts::GradParts;
use crate::grad_sync::{GradSync, StreamedCompute, SyncError, SyncTiming};
use crate::metrics::PhaseSeconds;
use crate::outcome::ReplicaError;
use crate::replica::Replica;
use crate::zero::Zero;

/// What one step of a model trained whole computes.
pub(crate) struct WholeStep<'a> {
    pub job: &'a str,
    pub step: u64,
    /// Every micro-batch of the step (sample indices).
    pub pieces: &'a [&'a [u32]],
    /// This rank's micro-batches (indices into `pieces`).
    pub mine: Range<usize>,
    /// Samples per micro-batch.
    pub microbatch: usize,
    /// Micro-batches of the step, over all ranks.
    pub n_micro: usize,
    /// Loss scale (1 / global batch).
    pub scale: f32,
    /// Flat ranges of the parameter tensors (the streamed gradients' indices).
    pub tensors: &'a [Range<usize>],
    /// Stream the last micro-batch's gradients into the sum (`dist.overlap`).
    pub overlap: bool,
    /// `train.seed`: with the step and micro-batch, the key of each micro-batch's draws.
    pub seed: u64,
}

/// One step of a model trained whole: this rank's micro-batches computed, every rank's summed
/// into `total_grad` (or the shared windows' sum area; exactly, in reproducible mode). Returns the global loss and the phase timings.
pub(crate) fn step(
    plan: &WholeStep<'_>,
    replica: &mut dyn Replica,
    comm: &mut Communicator,
    sync: &mut GradSync,
    zero: &Zero,
    grads: &mut GradParts,
    total_grad: &mut [f32],
) -> Result<(f64, PhaseSeconds), TrainError> {
    let (step, pieces) = (plan.step, plan.pieces);
    let mut sec = PhaseSeconds::default();
    let job_error = |k: usize, cause: ReplicaError| {
        TrainError::microbatch(plan.job, step, k, plan.microbatch, cause)
    };
    let mine = plan.mine.clone();
    // With overlap, the last local micro-batch is computed inside the synchronisation (its
    // backward streams gradients to the communication thread); the others are computed here.
    let streamed = usize::from(plan.overlap && !mine.is_empty());
    let mut losses = Vec::with_capacity(mine.len());
    let mut scanned_ahead = 0.0;
    for (slot, k) in mine.clone().enumerate().take(mine.len() - streamed) {
        activity::touch();
        replica.begin_microbatch(Draws::new(plan.seed, step, k));
        let c = replica
            .loss_and_grad(pieces[k], plan.scale, grads.part_mut(slot))
            .map_err(|e| job_error(k, e))?;
        sec.data += c.data_seconds;
        sec.forward += c.forward_seconds;
        sec.backward += c.backward_seconds;
        losses.push(c.loss);
        if !plan.overlap {
            // Part of the exact sum's work, done while the gradient is in cache: counted with it.
            let scan = Instant::now();
            sync.part_ready(comm, grads.part(slot));
            scanned_ahead += scan.elapsed().as_secs_f64();
        }
    }
    let sync_error = |source: SyncError| match source {
        SyncError::Exact(ExactError::Comm(c)) => TrainError::Comm(c),
        SyncError::Exact(other) => TrainError::Sync { step, cause: other },
        SyncError::Model(m) => job_error(mine.end - 1, m.into()),
        SyncError::Replica(r) => job_error(mine.end - 1, r),
    };
    let (loss, timing) = if plan.overlap {
        let GradParts::Private(grads) = grads else {
            unreachable!("an overlapped sum keeps its parts private (GradParts::new)")
        };
        let (earlier, rest) = grads.split_at_mut(mine.len() - streamed);
        if streamed == 1 {
            replica.begin_microbatch(Draws::new(plan.seed, step, mine.end - 1));
        }
        let mut compute = ReplicaCompute {
            replica,
            samples: pieces.get(mine.end.wrapping_sub(1)).copied().unwrap_or(&[]),
            scale: plan.scale,
            data_seconds: 0.0,
        };
        let last = rest.first_mut().map(|grad| {
            (
                &mut compute as &mut dyn StreamedCompute,
                grad.as_mut_slice(),
            )
        });
        let earlier: Vec<&[f32]> = earlier.iter().map(|g| g.as_slice()).collect();
        let o = sync
            .sync_streamed(
                comm,
                plan.tensors,
                &earlier,
                &losses,
                last,
                plan.n_micro,
                total_grad,
            )
            .map_err(sync_error)?;
        sec.data += compute.data_seconds;
        sec.forward += o.forward;
        sec.backward += o.backward;
        (o.loss, o.timing)
    } else {
        let exact = |e| sync_error(SyncError::Exact(e));
        let t0 = Instant::now();
        let loss = sync
            .exchange_loss(comm, &losses, plan.n_micro)
            .map_err(exact)?;
        let t1 = Instant::now();
        sync.reduce(comm, grads, mine.len(), plan.n_micro, zero, total_grad)
            .map_err(exact)?;
        let timing = SyncTiming {
            waiting: (t1 - t0).as_secs_f64(),
            communication: t1.elapsed().as_secs_f64(),
            overlapped_communication: 0.0,
        };
        (loss, timing)
    };
    sec.waiting = timing.waiting;
    sec.communication = timing.communication + scanned_ahead;
    sec.overlapped_communication = timing.overlapped_communication;
    Ok((loss, sec))
}

/// The streamed micro-batch of an overlapped step, on a job's replica.
struct ReplicaCompute<'a> {
    replica: &'a mut dyn Replica,
    samples: &'a [u32],
    scale: f32,
    data_seconds: f64,
}

impl StreamedCompute for ReplicaCompute<'_> {
    fn streaming(&mut self, on_grad: &(dyn Fn(usize, &[f32]) + Sync)) -> Result<f32, SyncError> {
        let c = self
            .replica
            .loss_and_grad_streaming(self.samples, self.scale, on_grad)
            .unwrap_or_else(|| {
                Err(ReplicaError::Other(
                    "the job does not stream gradients".into(),
                ))
            })?;
        self.data_seconds += c.data_seconds;
        Ok(c.loss)
    }

    fn plain(&mut self, grad: &mut [f32]) -> Result<TimedLoss, SyncError> {
        let c = self.replica.loss_and_grad(self.samples, self.scale, grad)?;
        self.data_seconds += c.data_seconds;
        Ok(TimedLoss {
            loss: c.loss,
            forward_seconds: c.forward_seconds,
            backward_seconds: c.backward_seconds,
        })
    }
}
