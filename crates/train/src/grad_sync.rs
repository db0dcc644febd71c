//! Combining the micro-batch gradients of all ranks into the global-batch gradient.
//!
//! Two modes:
//! - **reproducible** (default): [`ExactReducer`] — fixed-point integer sum with a shared exponent per
//!   bucket; the result's bits depend only on the set of micro-batches, not on the world size or order.
//!   After backward it runs as [`ExactReducer::reduce_cheapest`]: the `i64` sums reduce-scattered
//!   and the finished `f32` values all-gathered (1.5× the bytes of a plain all-reduce, not 2×), or,
//!   on one worker, converted and finished in one pass without any `i64` vector — same bits.
//! - **plain**: local micro-batch gradients summed in order, then an f32 ring/tree all-reduce per
//!   bucket; deterministic run to run at a fixed world size (the reduction order is fixed), but a
//!   different world size groups the additions differently and changes low bits.
//!
//! Buckets are fixed ranges of the flat gradient (`bucket_elems` values each, from offset 0), the same
//! on every rank. Two schedules, with bitwise the same result in either mode (every bucket is reduced
//! by the same operation on the same values; only the order of the buckets differs):
//! - [`GradSync::sync`], after backward: the loss exchange, then all buckets. The loss exchange is a
//!   tiny collective whose duration is time spent waiting for the slowest rank to finish computing;
//!   it is reported as `waiting`, the rest as `communication`.
//! - [`GradSync::sync_overlapped`], during backward: this rank's last micro-batch runs the streaming
//!   backward ([`Model::loss_and_grad_streaming`]), which hands out each parameter's gradient as soon
//!   as it exists, output layer first. A scoped communication thread, which holds the
//!   [`Communicator`] for the duration, reduces the buckets from the highest offset down, each as
//!   soon as all of its values (from every local micro-batch) are there. The order is fixed, not the
//!   order of arrival, so every rank issues the same collectives in the same order (a rank without
//!   micro-batches just runs them). Steps:
//!   1. earlier local micro-batches have been computed by the caller with plain `loss_and_grad`;
//!   2. spawn the communication thread; the main thread runs the streaming backward, whose callback
//!      copies each gradient tensor into a channel (`Grad`), then sends the local losses (`Done`);
//!   3. the communication thread reduces the *early* buckets, highest first, each once complete; then
//!      waits for `Done`, runs the loss exchange, and reduces the *late* buckets (those holding part of
//!      the first layer's weight, the last gradient backward produces), highest first;
//!   4. join; a backward error wins over the communication thread's "abandoned" ending, a
//!      communication error is returned once backward has finished (backward cannot be interrupted;
//!      the callback's sends into a closed channel are ignored), a panic is re-raised.
//!
//!   Why the loss exchange sits before the late buckets: the loss is only known when the streaming
//!   call returns, and the late buckets are complete only then as well, so it delays nothing there,
//!   while it is the first collective that every rank can enter only after *all* its compute. Its
//!   duration is therefore, as in `sync`, the time this rank is blocked until the slowest rank has
//!   finished backward: reported as `waiting`. Waiting for peers inside an early bucket's collective
//!   is either hidden behind this rank's backward or counted as exposed `communication`.
//!
//!   When there is no early bucket (every bucket holds part of the first layer's weight, e.g. a model
//!   that fits in one bucket), nothing could overlap, so the step runs the `sync` schedule after a
//!   plain backward instead, without the thread and the streaming taps' cost. This depends only on
//!   the layout and the bucket size, so all ranks choose alike.
//!
//!   Timing: `overlapped_communication` = time the communication thread spent reducing buckets before
//!   this rank's backward ended; after that the step waits for the thread: that interval, less
//!   `waiting`, is `communication`.

use std::ops::Range;
use std::sync::mpsc::{channel, Receiver};
use std::sync::OnceLock;
use std::time::Instant;

use lockstep_comm::exact::{ExactError, ExactReducer};
use lockstep_comm::{Communicator, ReduceOp};
use lockstep_model::{Model, ModelError, TimedLoss};

use crate::grad_parts::GradParts;
use crate::outcome::ReplicaError;
use crate::zero::Zero;

pub struct GradSync {
    reproducible: bool,
    reducer: ExactReducer,
    loss_reducer: ExactReducer,
    /// The buckets of the last vector length synchronised (kept: the length never changes).
    buckets: Vec<Range<usize>>,
}

/// Timing of one synchronisation, in seconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct SyncTiming {
    /// Blocked in the loss exchange until the slowest rank had finished computing.
    pub waiting: f64,
    /// Communication the step waited for once this rank's compute was done (exposed).
    pub communication: f64,
    /// Communication done while this rank's backward was still running (hidden); 0 for `sync`.
    pub overlapped_communication: f64,
}

/// The last local micro-batch of a step: [`GradSync::sync_overlapped`] runs its forward and backward.
pub struct LastMicrobatch<'a> {
    /// Inputs of `n` samples, as for [`Model::loss_and_grad`].
    pub x: &'a [f32],
    pub y: &'a [u8],
    pub n: usize,
    /// Loss scale (1 / global batch).
    pub scale: f32,
    /// Receives this micro-batch's gradient (`model.num_params()` values; overwritten).
    pub grad: &'a mut [f32],
}

/// Result of [`GradSync::sync_overlapped`].
#[derive(Debug, Clone, Copy)]
pub struct Overlapped {
    /// Global loss (sum of all micro-batches' scaled losses).
    pub loss: f64,
    pub timing: SyncTiming,
    /// Forward seconds of the streamed micro-batch: from its start to the first gradient handed
    /// out, so it also contains the loss's and the output layer's backward (small: the output layer
    /// is the narrowest). 0 without a local micro-batch.
    pub forward: f64,
    /// The rest of the streamed micro-batch's backward.
    pub backward: f64,
}

/// Why an overlapped synchronisation failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(transparent)]
    Exact(#[from] ExactError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Replica(#[from] ReplicaError),
}

/// The computation of the last local micro-batch of a step, run inside
/// [`GradSync::sync_streamed`] (the trainer wraps a job's replica in it; [`LastMicrobatch`] wraps
/// a [`Model`]).
pub trait StreamedCompute {
    /// Forward and backward, handing each parameter tensor's gradient (index in the layout) to
    /// `on_grad` as soon as backward produced it; returns the scaled loss.
    fn streaming(&mut self, on_grad: &(dyn Fn(usize, &[f32]) + Sync)) -> Result<f32, SyncError>;
    /// Forward and backward into `grad` (used when no bucket could finish before backward ends).
    fn plain(&mut self, grad: &mut [f32]) -> Result<TimedLoss, SyncError>;
}

/// [`LastMicrobatch`]'s computation on a [`Model`].
struct ModelCompute<'a> {
    model: &'a Model,
    x: &'a [f32],
    y: &'a [u8],
    n: usize,
    scale: f32,
}

impl StreamedCompute for ModelCompute<'_> {
    fn streaming(&mut self, on_grad: &(dyn Fn(usize, &[f32]) + Sync)) -> Result<f32, SyncError> {
        Ok(self
            .model
            .loss_and_grad_streaming(self.x, self.y, self.n, self.scale, on_grad)?)
    }

    fn plain(&mut self, grad: &mut [f32]) -> Result<TimedLoss, SyncError> {
        Ok(self
            .model
            .loss_and_grad_timed(self.x, self.y, self.n, self.scale, grad)?)
    }
}

/// What the main thread tells the communication thread.
enum Event {
    /// Gradient of the parameter tensor with this canonical index (last micro-batch).
    Grad(usize, Vec<f32>),
    /// Backward finished; this rank's losses, one per local micro-batch.
    Done(Vec<f32>),
}

/// One collective step of the overlapped schedule.
#[derive(Clone, Copy)]
enum Work {
    Bucket(usize),
    Loss,
}

/// How the communication thread ended, when it did not finish.
enum CommEnd {
    Failed(ExactError),
    /// The channel closed without `Done`: this rank's backward failed (the main thread has the error).
    Abandoned,
}

impl From<ExactError> for CommEnd {
    fn from(e: ExactError) -> Self {
        CommEnd::Failed(e)
    }
}

impl From<lockstep_comm::CommError> for CommEnd {
    fn from(e: lockstep_comm::CommError) -> Self {
        CommEnd::Failed(ExactError::Comm(e))
    }
}

/// What the communication thread reports back.
struct CommReport {
    loss: f64,
    /// Seconds in the loss exchange.
    waiting: f64,
    /// (start, end) of every bucket reduction.
    busy: Vec<(Instant, Instant)>,
}

impl GradSync {
    pub fn new(reproducible: bool, bucket_elems: usize) -> Self {
        let bucket_elems = bucket_elems.max(1);
        Self {
            reproducible,
            reducer: ExactReducer::new(bucket_elems),
            loss_reducer: ExactReducer::new(1),
            buckets: Vec::new(),
        }
    }

    /// Reduce in these buckets (tiling the gradient in order) instead of fixed ones from offset
    /// 0: a layered model's never straddle a layer (or a tensor-parallel piece).
    pub fn with_buckets(mut self, buckets: Vec<Range<usize>>) -> Self {
        self.buckets = buckets;
        self
    }

    /// Make `self.buckets` the buckets of a `len`-value vector (kept when they already cover it).
    fn set_buckets(&mut self, len: usize) {
        if self.buckets.last().map_or(0, |b| b.end) != len {
            self.buckets = self.reducer.buckets(len).map(|(s, e)| s..e).collect();
        }
    }

    /// One local micro-batch gradient of the coming [`GradSync::reduce`] (or
    /// [`GradSync::sync`]) is complete: in reproducible mode on more than one rank, scan
    /// its per-bucket exponents now, while its values are still in cache, instead of in one cold
    /// pass over all parts inside the sum (which needs them before it can convert anything).
    /// Either every part of the step is announced, in any order, or none; not for
    /// `sync_overlapped`, which scans bucket by bucket. One worker needs no scan ahead: its fused
    /// local pass scans each bucket just before summing it.
    pub fn part_ready(&mut self, comm: &Communicator, part: &[f32]) {
        if comm.size() > 1 {
            self.scan_ahead(part);
        }
    }

    /// [`GradSync::part_ready`] for a caller that knows the group has several ranks.
    pub fn scan_ahead(&mut self, part: &[f32]) {
        if self.reproducible {
            self.set_buckets(part.len());
            self.reducer.scan_part(part, &self.buckets);
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
        let loss = self.exchange_loss(comm, local_losses, total_microbatches)?;
        let t1 = Instant::now();

        self.reduce_parts(comm, local_grads, total_microbatches, out)?;
        let t2 = Instant::now();
        let timing = SyncTiming {
            waiting: (t1 - t0).as_secs_f64(),
            communication: (t2 - t1).as_secs_f64(),
            overlapped_communication: 0.0,
        };
        Ok((loss, timing))
    }

    /// Compute this rank's `last` micro-batch with the streaming backward and reduce the gradients of
    /// all micro-batches of the step (`earlier`, already computed, with `earlier_losses`, plus `last`)
    /// over all ranks into `out`, overlapping the reduction with the backward (see the module doc).
    /// `last` is `None` on a rank without micro-batches this step; it must then have no `earlier`
    /// either. The result is bitwise that of [`GradSync::sync`] on the same gradients.
    #[allow(clippy::too_many_arguments)]
    pub fn sync_overlapped(
        &mut self,
        comm: &mut Communicator,
        model: &Model,
        earlier: &[&[f32]],
        earlier_losses: &[f32],
        last: Option<LastMicrobatch<'_>>,
        total_microbatches: usize,
        out: &mut [f32],
    ) -> Result<Overlapped, SyncError> {
        let len = out.len();
        if model.num_params() != len {
            return Err(SyncError::Exact(ExactError::Invalid(format!(
                "the model has {} parameters but the output {len}",
                model.num_params()
            ))));
        }
        let tensors: Vec<Range<usize>> = model
            .layout()
            .iter()
            .map(|p| p.offset..p.offset + p.len)
            .collect();
        let mut compute;
        let last = match last {
            Some(LastMicrobatch {
                x,
                y,
                n,
                scale,
                grad,
            }) => {
                compute = ModelCompute {
                    model,
                    x,
                    y,
                    n,
                    scale,
                };
                Some((&mut compute as &mut dyn StreamedCompute, grad))
            }
            None => None,
        };
        self.sync_streamed(
            comm,
            &tensors,
            earlier,
            earlier_losses,
            last,
            total_microbatches,
            out,
        )
    }

    /// [`GradSync::sync_overlapped`] for any computation: `tensors` are the flat ranges of the
    /// parameter tensors (the indices `on_grad` receives), `last` the streamed micro-batch's
    /// computation and its gradient buffer.
    #[allow(clippy::too_many_arguments)]
    pub fn sync_streamed(
        &mut self,
        comm: &mut Communicator,
        tensors: &[Range<usize>],
        earlier: &[&[f32]],
        earlier_losses: &[f32],
        last: Option<(&mut dyn StreamedCompute, &mut [f32])>,
        total_microbatches: usize,
        out: &mut [f32],
    ) -> Result<Overlapped, SyncError> {
        let len = out.len();
        let invalid = |m: String| SyncError::Exact(ExactError::Invalid(m));
        if tensors.last().map_or(0, |r| r.end) != len {
            return Err(invalid(format!(
                "the parameter tensors cover {} values but the output has {len}",
                tensors.last().map_or(0, |r| r.end)
            )));
        }
        if let Some(bad) = earlier.iter().find(|g| g.len() != len) {
            return Err(invalid(format!(
                "an earlier gradient has {} values, not {len}",
                bad.len()
            )));
        }
        if earlier.len() != earlier_losses.len() {
            return Err(invalid(format!(
                "{} earlier gradients but {} losses",
                earlier.len(),
                earlier_losses.len()
            )));
        }
        match &last {
            Some((_, grad)) if grad.len() != len => {
                return Err(invalid(format!(
                    "the last gradient buffer has {} values, not {len}",
                    grad.len()
                )));
            }
            None if !earlier.is_empty() => {
                return Err(invalid(
                    "earlier micro-batches but no last one to stream".into(),
                ));
            }
            _ => {}
        }
        self.set_buckets(len);
        let buckets = self.buckets.len();
        if late_buckets(tensors, &self.buckets) == buckets {
            return self.sync_after_backward(
                comm,
                earlier,
                earlier_losses,
                last,
                total_microbatches,
                out,
            );
        }
        let (mut batch, last_grad) = match last {
            Some((compute, grad)) => (Some(compute), Some(grad)),
            None => (None, None),
        };
        let has_batch = batch.is_some();
        let (tx, rx) = channel::<Event>();
        let first_grad = OnceLock::new();

        std::thread::scope(|scope| {
            let worker = scope.spawn(move || {
                CommThread {
                    sync: self,
                    comm,
                    rx,
                    tensors,
                    earlier,
                    last: last_grad,
                    total_microbatches,
                    out,
                }
                .run()
            });

            let compute_start = Instant::now();
            let mut losses = earlier_losses.to_vec();
            let computed = match batch.as_mut() {
                Some(compute) => {
                    let on_grad = |index: usize, values: &[f32]| {
                        first_grad.get_or_init(Instant::now);
                        // A closed channel means the communication thread has failed; its error is
                        // collected at the join, and backward cannot be interrupted anyway.
                        let _ = tx.send(Event::Grad(index, values.to_vec()));
                    };
                    compute.streaming(&on_grad).map(|l| losses.push(l))
                }
                None => Ok(()),
            };
            let backward_end = Instant::now();
            if computed.is_ok() {
                let _ = tx.send(Event::Done(losses));
            }
            drop(tx);
            let report = match worker.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            };
            let joined = Instant::now();
            computed?;
            let report = match report {
                Ok(r) => r,
                Err(CommEnd::Failed(e)) => return Err(SyncError::Exact(e)),
                // Unreachable: `Done` was queued before the channel closed. An error, not a panic.
                Err(CommEnd::Abandoned) => {
                    return Err(invalid(
                        "the communication thread saw the gradient stream end early".into(),
                    ))
                }
            };

            let overlapped: f64 = report
                .busy
                .iter()
                .filter(|(s, _)| *s < backward_end)
                .map(|&(s, e)| (e.min(backward_end) - s).as_secs_f64())
                .sum();
            let exposed = (joined - backward_end).as_secs_f64();
            let (forward, backward) = match (has_batch, first_grad.get()) {
                (false, _) => (0.0, 0.0),
                (true, Some(&first)) => (
                    (first - compute_start).as_secs_f64(),
                    (backward_end - first).as_secs_f64(),
                ),
                (true, None) => ((backward_end - compute_start).as_secs_f64(), 0.0),
            };
            Ok(Overlapped {
                loss: report.loss,
                timing: SyncTiming {
                    waiting: report.waiting,
                    communication: (exposed - report.waiting).max(0.0),
                    overlapped_communication: overlapped,
                },
                forward,
                backward,
            })
        })
    }

    /// [`GradSync::sync_overlapped`] when no bucket can complete before backward ends: compute the
    /// last micro-batch, then [`GradSync::sync`] (no thread, one exponent exchange in all).
    #[allow(clippy::too_many_arguments)]
    fn sync_after_backward(
        &mut self,
        comm: &mut Communicator,
        earlier: &[&[f32]],
        earlier_losses: &[f32],
        last: Option<(&mut dyn StreamedCompute, &mut [f32])>,
        total_microbatches: usize,
        out: &mut [f32],
    ) -> Result<Overlapped, SyncError> {
        let mut parts = earlier.to_vec();
        let mut losses = earlier_losses.to_vec();
        let (mut forward, mut backward) = (0.0, 0.0);
        if let Some((compute, grad)) = last {
            let timed = compute.plain(grad)?;
            (forward, backward) = (timed.forward_seconds, timed.backward_seconds);
            losses.push(timed.loss);
            parts.push(grad);
        }
        let (loss, timing) = self.sync(comm, &parts, &losses, total_microbatches, out)?;
        Ok(Overlapped {
            loss,
            timing,
            forward,
            backward,
        })
    }

    /// The one reduction after backward (every loop's): the micro-batch gradients in `grads`
    /// (this rank's first `local_parts`) summed over `comm` into `out` — read where they lie in
    /// the ranks' shared windows (exact mode; the sum is then in the window), reduce-scattered to
    /// this rank's chunk (ZeRO 2, or ZeRO 3 layer by layer: `zero`), or whole: exact (the
    /// cheapest path, `ExactReducer::reduce_cheapest`) or plain per bucket. The same bits for
    /// every path.
    pub fn reduce(
        &mut self,
        comm: &mut Communicator,
        grads: &mut GradParts,
        local_parts: usize,
        total_microbatches: usize,
        zero: &Zero,
        out: &mut [f32],
    ) -> Result<(), ExactError> {
        match grads {
            GradParts::Shared(shared) => {
                assert!(self.reproducible, "shared parts are summed exactly");
                self.set_buckets(shared.len());
                self.reducer.reduce_shared(
                    comm,
                    shared,
                    local_parts,
                    total_microbatches,
                    &self.buckets,
                )
            }
            GradParts::Private(_) if zero.level() >= 2 || !zero.reduces_in_one_call() => {
                let parts = grads.parts();
                self.set_buckets(parts.first().map_or(out.len(), |p| p.len()));
                zero.reduce_gradients(
                    &mut self.reducer,
                    comm,
                    &parts,
                    total_microbatches,
                    &self.buckets,
                    self.reproducible,
                    out,
                )
            }
            GradParts::Private(_) => {
                self.reduce_parts(comm, &grads.parts(), total_microbatches, out)
            }
        }
    }

    /// One segment of a [`GradSync::reduce`] from ZeRO level 2 on ([`Zero::reduce_segment`]):
    /// `seg_parts` are every local part's values of segment `i`, `out` the rank's reduced chunk
    /// of that segment. What a streamed backward calls as each layer's gradient appears.
    pub fn reduce_segment(
        &mut self,
        comm: &mut Communicator,
        zero: &Zero,
        i: usize,
        seg_parts: &[&[f32]],
        total_microbatches: usize,
        out: &mut [f32],
    ) -> Result<(), ExactError> {
        self.set_buckets(zero.len());
        let (reducer, buckets) = (&mut self.reducer, &self.buckets);
        zero.reduce_segment(
            reducer,
            comm,
            i,
            seg_parts,
            total_microbatches,
            buckets,
            self.reproducible,
            out,
        )
    }

    /// The whole sum of `parts` into `out`: exact by the cheapest path, or plain per bucket.
    fn reduce_parts(
        &mut self,
        comm: &mut Communicator,
        parts: &[&[f32]],
        total_microbatches: usize,
        out: &mut [f32],
    ) -> Result<(), ExactError> {
        self.set_buckets(out.len());
        if self.reproducible {
            self.reducer
                .reduce_cheapest(comm, parts, total_microbatches, out, &self.buckets)
        } else {
            for b in &self.buckets {
                plain_bucket(comm, parts, b.clone(), out)?;
            }
            Ok(())
        }
    }

    /// Global loss: exact sum of every rank's micro-batch losses (`local_losses`: this rank's,
    /// `total_microbatches`: every rank's together).
    pub fn exchange_loss(
        &mut self,
        comm: &mut Communicator,
        local_losses: &[f32],
        total_microbatches: usize,
    ) -> Result<f64, ExactError> {
        let loss_parts: Vec<[f32; 1]> = local_losses.iter().map(|&l| [l]).collect();
        let loss_refs: Vec<&[f32]> = loss_parts.iter().map(|p| &p[..]).collect();
        let mut loss = [0f32; 1];
        self.loss_reducer
            .reduce(comm, &loss_refs, total_microbatches, &mut loss)?;
        Ok(loss[0] as f64)
    }

    /// The job's training metrics, summed exactly over all ranks: `rows` are this rank's
    /// micro-batches' rows of `names` values each (none where another rank counts them), out of
    /// `total_microbatches` in the step. Each value has its own exponent, so the sums do not
    /// depend on the rows' order, on how they are spread over ranks, or on each other.
    pub fn exchange_metrics(
        &mut self,
        comm: &mut Communicator,
        rows: &[Vec<f32>],
        names: usize,
        total_microbatches: usize,
    ) -> Result<Vec<f32>, ExactError> {
        let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let mut sums = vec![0f32; names];
        self.loss_reducer
            .reduce(comm, &refs, total_microbatches, &mut sums)?;
        Ok(sums)
    }

    /// Reduce one bucket in either mode: bitwise the same whichever schedule calls it.
    fn reduce_bucket(
        &mut self,
        comm: &mut Communicator,
        parts: &[&[f32]],
        total_microbatches: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), ExactError> {
        if self.reproducible {
            self.reducer
                .reduce_range(comm, parts, total_microbatches, range, out)
        } else {
            plain_bucket(comm, parts, range, out)
        }
    }
}

/// Plain mode: local sum in micro-batch order, then an f32 all-reduce of the bucket.
fn plain_bucket(
    comm: &mut Communicator,
    parts: &[&[f32]],
    range: Range<usize>,
    out: &mut [f32],
) -> Result<(), ExactError> {
    let dst = &mut out[range.clone()];
    dst.fill(0.0);
    for g in parts {
        for (o, v) in dst.iter_mut().zip(&g[range.clone()]) {
            *o += *v;
        }
    }
    comm.all_reduce(dst, ReduceOp::Sum)?;
    Ok(())
}

/// Number of buckets, counted from offset 0, that hold part of the parameter tensor with canonical
/// index 0 (the first layer's weight). Its gradient is the last one backward produces, so these
/// buckets complete only when backward ends; the others can be reduced while it runs. A function of
/// the layout and the bucket size only, hence the same on every rank.
fn late_buckets(tensors: &[Range<usize>], buckets: &[Range<usize>]) -> usize {
    match tensors.first() {
        // Buckets tile the vector from 0: those starting before the first tensor's end.
        Some(first) if !first.is_empty() => buckets.partition_point(|b| b.start < first.end),
        _ => buckets.len().min(1),
    }
}

/// The communication thread's state for one step.
struct CommThread<'a, 'b> {
    sync: &'a mut GradSync,
    comm: &'a mut Communicator,
    rx: Receiver<Event>,
    /// Flat range of each parameter tensor, by canonical index.
    tensors: &'a [Range<usize>],
    earlier: &'a [&'b [f32]],
    /// The streamed micro-batch's gradient, filled as tensors arrive.
    last: Option<&'a mut [f32]>,
    total_microbatches: usize,
    out: &'a mut [f32],
}

impl CommThread<'_, '_> {
    fn run(mut self) -> Result<CommReport, CommEnd> {
        // The reducer's buckets (fixed, or a layered model's within layers): the same ranges,
        // so the same bits, as the reduction after backward.
        let buckets: Vec<Range<usize>> = self.sync.buckets.clone();
        // Values of each bucket still to arrive; only the streamed micro-batch arrives late.
        let mut pending: Vec<usize> = match self.last {
            Some(_) => buckets.iter().map(|r| r.len()).collect(),
            None => vec![0; buckets.len()],
        };
        let mut losses: Option<Vec<f32>> = None;
        let late = late_buckets(self.tensors, &buckets);
        let mut schedule: Vec<Work> = (late..buckets.len()).rev().map(Work::Bucket).collect();
        schedule.push(Work::Loss);
        schedule.extend((0..late).rev().map(Work::Bucket));

        let mut report = CommReport {
            loss: 0.0,
            waiting: 0.0,
            busy: Vec::with_capacity(buckets.len()),
        };
        for work in schedule {
            match work {
                Work::Loss => {
                    while losses.is_none() {
                        self.receive(&buckets, &mut pending, &mut losses)?;
                    }
                    let t = Instant::now();
                    let local = losses.as_deref().unwrap_or_default();
                    report.loss =
                        self.sync
                            .exchange_loss(self.comm, local, self.total_microbatches)?;
                    report.waiting = t.elapsed().as_secs_f64();
                }
                Work::Bucket(b) => {
                    while pending[b] > 0 {
                        self.receive(&buckets, &mut pending, &mut losses)?;
                    }
                    let t = Instant::now();
                    let mut parts: Vec<&[f32]> = self.earlier.to_vec();
                    parts.extend(self.last.as_deref());
                    self.sync.reduce_bucket(
                        self.comm,
                        &parts,
                        self.total_microbatches,
                        buckets[b].clone(),
                        self.out,
                    )?;
                    report.busy.push((t, Instant::now()));
                }
            }
        }
        Ok(report)
    }

    /// Take one event from the main thread: store a gradient tensor and mark its buckets' values
    /// as arrived, or record the losses.
    fn receive(
        &mut self,
        buckets: &[Range<usize>],
        pending: &mut [usize],
        losses: &mut Option<Vec<f32>>,
    ) -> Result<(), CommEnd> {
        match self.rx.recv() {
            Ok(Event::Grad(index, values)) => {
                let r = self.tensors[index].clone();
                let last = self
                    .last
                    .as_deref_mut()
                    .expect("gradients stream only with a last micro-batch");
                last[r.clone()].copy_from_slice(&values);
                // The buckets the tensor overlaps (buckets are sorted and tile the vector).
                let first = buckets.partition_point(|b| b.end <= r.start);
                for (b, p) in buckets.iter().zip(pending.iter_mut()).skip(first) {
                    if b.start >= r.end {
                        break;
                    }
                    *p -= r.end.min(b.end) - r.start.max(b.start);
                }
                Ok(())
            }
            Ok(Event::Done(l)) => {
                *losses = Some(l);
                Ok(())
            }
            Err(_) => Err(CommEnd::Abandoned),
        }
    }
}
