//! The one training loop, for every model on every `dp × tp × pp` layout: a layered model (the
//! built-in transformer, a user's `LayeredJob`; tensor parallelism: the transformer with
//! `model.tp_pieces > 1`, or a user's layered job with `lockstep::tp` layers) cut into stages, or
//! a model trained whole (`flat.rs`) as one stage computed one call per micro-batch (`whole.rs`).
//!
//! Per step, on every rank (replica `r`, stage `s`, tp rank `k`):
//! 1. the global batch (a function of seed and step only) is cut into the fixed micro-batches;
//!    replica `r` takes its contiguous share of them;
//! 2. the stage runs its schedule (GPipe or 1F1B) over those micro-batches with its pipeline
//!    neighbours (tp rank `k` of each stage), keeping one gradient per micro-batch; a tensor-
//!    parallel stage computes its share of the fixed pieces and sums pieces exactly with its tp
//!    group inside forward and backward, so every tp rank holds the same activations, loss and
//!    replicated gradients;
//! 3. the loss (last stages only) is summed exactly over all ranks; the stage's micro-batch
//!    gradients are summed exactly over the stage's data-parallel group, in buckets that never
//!    straddle a layer boundary (nor, with tensor parallelism, a piece: the stage's own buckets,
//!    over the group of ranks with the same stage and tp rank) — so every layout, including one
//!    stage on one rank, sums the same
//!    multiset of per-micro-batch gradients with the same shared exponents, and the parameters
//!    come out bitwise identical;
//! 4. the optimizer steps the stage's slice of the flat parameter vector (elementwise, so the
//!    slices of all stages together make exactly the whole model's update).
//!
//! Checkpoints hold the whole model (replica 0's stages send their slices to rank 0) or, with
//! `checkpoint.sharded`, every rank's ZeRO chunks of its local vector in canonical coordinates
//! (nothing gathered), so a run can resume on any layout; evaluation runs the validation windows
//! forward through each replica's pipeline.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use lockstep_comm::exact::ExactError;
use lockstep_comm::Communicator;
use lockstep_data::{assign, microbatches, Sampler};
use lockstep_model::{gather_map, param_hash, scatter_map, Optimizer, ParamHasher, TimedLoss};

use super::balance::{balance, stage_ranges};
use super::checkpoint_shards::{check_set, local_ranges, shard_layout};
use super::executor::{run_schedule, ScheduleTiming, StageWork};
use super::layer_gather::{gather_order, with_layer_gather, Chunks, LayerGather};
use super::layered::{Evaluated, Forwarded, LayerSource, LayerStage, Layered};
use super::schedule::{ideal_bubble_fraction, schedule, Op, ScheduleKind};
use super::tensor_parallel::{exchange_maps, gather_stage, GroupPieceSum, TpLink};
use super::whole::{self, WholeStep};
use crate::checkpoint::sharded::{read_local, SharedShard};
use crate::checkpoint::SharedVectors;
use crate::clip::{even_share, Clip};
use crate::config::{OptimizerKind, TrainConfig};
use crate::context::{JobLabel, WorkerContext};
use crate::device;
use crate::draws::Draws;
use crate::error::TrainError;
use crate::faults;
use crate::grad_parts::GradParts;
use crate::grad_sync::{GradSync, StreamedCompute, SyncError};
use crate::memory::ModelState;
use crate::metrics::{
    Eval, GradientSum, ParamGathering, PhaseSeconds, PipelineStep, PipelineSummary, RankSummary,
    StepRecord, Summary,
};
use crate::outcome::ReplicaError;
use crate::parallel_dims::{params_per_tp_rank, ParallelDims};
use crate::run::checkpointing::{broadcast_whole, Found};
use crate::run::collect::{check_same_kernels, check_same_structure, gather_strings};
use crate::run::evaluation::{combine, EvalTotals};
use crate::run::schedule::total_steps;
use crate::run::Ledger;
use crate::run::WriteFence;
use crate::zero::Zero;
use lockstep_run::ParallelPlan;

/// Buckets of a stage's flat gradient (`layers` of a model whose layer offsets are `offsets`),
/// each within one layer: every layer's range cut into `bucket_elems`-value pieces, relative to the
/// stage's first value.
pub fn layer_buckets(
    offsets: &[usize],
    layers: Range<usize>,
    bucket_elems: usize,
) -> Vec<Range<usize>> {
    let base = offsets[layers.start];
    let mut out = Vec::new();
    for l in layers {
        let (mut s, e) = (offsets[l] - base, offsets[l + 1] - base);
        while s < e {
            let end = (s + bucket_elems.max(1)).min(e);
            out.push(s..end);
            s = end;
        }
    }
    out
}

/// The compute of one stage over one step's micro-batches.
struct Work<'a> {
    stage: &'a mut dyn LayerStage,
    /// This replica's micro-batches (sample indices), by local index.
    pieces: &'a [&'a [u32]],
    /// Global index of the first of them (for errors).
    first_microbatch: usize,
    microbatch: usize,
    job: &'a str,
    step: u64,
    /// `train.seed` (the key of each micro-batch's draws, with the step and its global index).
    seed: u64,
    scale: f32,
    grads: &'a mut GradParts,
    /// Where a tensor-parallel stage's piece sums leave a communication failure.
    link: &'a TpLink,
    losses: Vec<f32>,
    data_seconds: f64,
    /// The exact sum's exponent scan, run on each micro-batch's stage gradient as soon as its
    /// backward has written it (while it is in cache); `None` where nothing is scanned ahead.
    scan_ahead: Option<ScanAhead<'a>>,
    /// ZeRO 3 per layer: where the stage takes each layer's parameters; `None`: the stage holds
    /// them all for the step.
    gather: Option<LayerGather<'a>>,
}

/// Where [`Work`] scans gradients ahead ([`GradSync::scan_ahead`]), and the time it took.
struct ScanAhead<'a> {
    sync: &'a mut GradSync,
    seconds: f64,
}

/// What a stage's schedule for one step gave back.
struct Scheduled {
    timing: ScheduleTiming,
    losses: Vec<f32>,
    data_seconds: f64,
    scanned_ahead: f64,
    /// Seconds the stage waited for ZeRO 3's layer gathers (forwards, backwards).
    gathered: [f64; 2],
}

impl Work<'_> {
    fn error(&mut self, mb: usize, cause: ReplicaError) -> TrainError {
        if let Some(c) = self.link.take_failure() {
            return TrainError::Comm(c);
        }
        if let Some(c) = self.gather.as_mut().and_then(|g| g.failure.take()) {
            return TrainError::Comm(c);
        }
        let k = self.first_microbatch + mb;
        TrainError::microbatch(self.job, self.step, k, self.microbatch, cause)
    }
}

impl StageWork for Work<'_> {
    fn forward(
        &mut self,
        mb: usize,
        input: Option<&[f32]>,
    ) -> Result<Option<Vec<f32>>, TrainError> {
        let k = self.first_microbatch + mb;
        self.stage
            .begin_microbatch(Draws::new(self.seed, self.step, k));
        let (id, samples) = (mb as u64, self.pieces[mb]);
        let forwarded = match &mut self.gather {
            Some(g) => {
                g.pass = 0;
                self.stage.forward_from(id, samples, input, self.scale, g)
            }
            None => self.stage.forward(id, samples, input, self.scale),
        };
        let (out, data_seconds) = match forwarded {
            Ok(r) => r,
            Err(e) => return Err(self.error(mb, e)),
        };
        self.data_seconds += data_seconds;
        match out {
            Forwarded::Activations(a) => Ok(Some(a)),
            Forwarded::Loss(l) => {
                self.losses[mb] = l;
                Ok(None)
            }
        }
    }

    fn backward(
        &mut self,
        mb: usize,
        grad_output: Option<&[f32]>,
    ) -> Result<Option<Vec<f32>>, TrainError> {
        let grad = self.grads.part_mut(mb);
        let backward = match &mut self.gather {
            Some(g) => {
                g.pass = 1;
                self.stage.backward_from(mb as u64, grad_output, grad, g)
            }
            None => self.stage.backward(mb as u64, grad_output, grad),
        };
        match backward {
            Ok(g) => {
                if let Some(scan) = &mut self.scan_ahead {
                    let t0 = Instant::now();
                    scan.sync.scan_ahead(self.grads.part(mb));
                    scan.seconds += t0.elapsed().as_secs_f64();
                }
                Ok(g)
            }
            Err(e) => Err(self.error(mb, e)),
        }
    }

    fn input_len(&self, mb: usize) -> usize {
        self.stage.input_len(self.pieces[mb].len())
    }

    fn output_len(&self, mb: usize) -> usize {
        self.stage.output_len(self.pieces[mb].len())
    }

    fn held(&self) -> usize {
        self.stage.held()
    }
}

/// Train `model` according to `cfg` as one rank of `ctx.comm` (see the module doc).
pub fn train<'a>(
    model: &dyn Layered,
    cfg: &'a TrainConfig,
    plan: &ParallelPlan,
    ctx: WorkerContext<'a>,
    job: JobLabel,
) -> Result<Summary, TrainError> {
    let started = Instant::now();
    let t = &cfg.train;
    let samples = model.train_len();
    if samples < t.global_batch {
        return Err(TrainError::TooSmall {
            dataset: model.name(),
            have: samples,
            need: t.global_batch,
        });
    }
    let sampler = Sampler::new(samples, t.global_batch, t.seed)?;
    let total_steps = total_steps(cfg, &sampler)?;
    let rule = match cfg.optimizer.kind {
        OptimizerKind::Custom => Some(model.update_rule(cfg).ok_or_else(|| {
            TrainError::JobSetup {
                job: model.name(),
                message: "optimizer.kind = \"custom\" needs the job's update rule, and the \
                          job gave none on this rank"
                    .into(),
            }
        })?),
        _ => None,
    };
    let (comm, mut ledger) = Ledger::open(
        cfg,
        ctx,
        job,
        plan,
        model.structure_hash(),
        rule,
        total_steps,
        started,
    );
    check_same_structure(comm, model.structure_hash())?;
    check_same_kernels(comm)?;
    // The plan checked the layout against the model (layers, pieces, ZeRO).
    let dims = plan.dims();
    let (cuts, layer_seconds, cuts_from) = choose_cuts(cfg, model, comm, dims.pp)?;
    let ranges = stage_ranges(&cuts, model.num_layers());
    if dims.pp > 1 {
        ledger.notice(format!(
            "pipeline: {} × {} stages ({}), layers per stage {:?} ({cuts_from} cuts)",
            dims.dp, dims.pp, cfg.parallel.schedule, ranges
        ));
    }
    let mut r = StageRank::new(model, cfg, plan, comm, &mut ledger, &ranges)?;
    let start_step = ledger.start_step;
    for step in start_step..total_steps {
        r.step(comm, &mut ledger, &sampler, step)?;
    }
    if ledger.final_evaluation_owed() {
        let eval = r.evaluate(comm, total_steps - 1)?;
        ledger.final_evaluation(eval);
    }
    let (hash, held) = r.final_hash(comm)?;
    let trained_whole = r.stage.whole().is_some();
    ledger.finish(comm, hash, held, |_, ranks| {
        if trained_whole {
            // No pipeline: its section stays out of the summary and the report.
            return None;
        }
        for rs in ranks.iter_mut() {
            if let Some(p) = rs.pipeline.as_mut() {
                p.replica = dims.coords(rs.rank).replica;
            }
        }
        Some(pipeline_summary(
            ranks,
            dims,
            cfg.parallel.schedule,
            ranges,
            cuts_from,
            layer_seconds,
            cfg.microbatches_per_step().div_ceil(dims.dp),
            (total_steps - start_step).max(1),
        ))
    })
}

/// What one rank holds over the run and how it steps: its stage of layers (or the whole model),
/// its groups, its parameters and optimizer shard, its gradient parts and the one reducer.
struct StageRank<'m> {
    model: &'m dyn Layered,
    cfg: &'m TrainConfig,
    plan: &'m ParallelPlan,
    dims: ParallelDims,
    me: crate::Coords,
    rank: usize,
    job: String,
    /// Point to point along the replica's pipeline (tp rank to tp rank).
    pp_comm: Communicator,
    /// The ranks with this rank's stage and tp rank: its gradients' sum, ZeRO's shards.
    dp_comm: Communicator,
    /// The stage's tensor-parallel group (gathers of the stage's parameters).
    tp_comm: Option<Communicator>,
    tp_link: Rc<TpLink>,
    stage: Box<dyn LayerStage + 'm>,
    my_layers: Range<usize>,
    /// Each tp rank's index map into the stage's canonical vector (tp rank 0 knows them all).
    maps: Vec<Vec<Range<usize>>>,
    stage_lens: Vec<usize>,
    /// The stage's local parameters (ZeRO 3: this rank's chunks between steps), shared with a
    /// checkpoint written in the background (`checkpoint.async`) while it is written; updated
    /// through [`Arc::make_mut`], which copies them only while a write still holds them.
    params: Arc<Vec<f32>>,
    optimizer: Optimizer,
    /// A sharded set's write in the background that holds `params` and the optimizer's state:
    /// the next update waits for it ([`StageRank::await_shard_write`]) rather than copying them.
    shard_write: Option<WriteFence>,
    zero: Zero,
    grads: GradParts,
    total_grad: Vec<f32>,
    sync: GradSync,
    /// This replica's micro-batches (indices into each step's list), and the stage's schedule.
    my_micro: Range<usize>,
    ops: Vec<Op>,
    scale: f32,
    /// The flat ranges the gradient streams in with `dist.overlap`: a model trained whole's
    /// parameter tensors, a one-stage layered model's layers.
    tensors: Vec<Range<usize>>,
    /// ZeRO 2 or 3 on one stage: the last micro-batch's backward streams its layers into the sum
    /// (`streamed_zero_gradients`) instead of filling a gradient vector.
    streams_last: bool,
    /// ... and steps the optimizer on each layer's chunk as soon as it is reduced (not with
    /// clipping): `total_grad` then holds one chunk, not the rank's shard.
    steps_in_backward: bool,
    /// ZeRO 3 on a stage that recomputes its layers: each layer's parameters are gathered just
    /// before its forward and again before its recomputed backward, released after
    /// ([`LayerGather`]), instead of the whole stage for the step.
    gathers_layers: bool,
    slowdown: f64,
    /// `optimizer.clip_grad_norm` (None: off).
    clip: Option<Clip>,
    /// The job's training metrics (`Job::TRAIN_METRICS`), summed each step.
    metric_names: Vec<String>,
}

impl<'m> StageRank<'m> {
    fn new(
        model: &'m dyn Layered,
        cfg: &'m TrainConfig,
        plan: &'m ParallelPlan,
        comm: &mut Communicator,
        ledger: &mut Ledger<'_>,
        ranges: &[Range<usize>],
    ) -> Result<Self, TrainError> {
        let dims = plan.dims();
        let rank = comm.rank();
        let me = dims.coords(rank);
        let job = model.name();
        // Stages of one replica talk point to point (tp rank to tp rank); each (stage, tp
        // rank)'s replicas reduce gradients; a stage's tp ranks sum pieces (in the stage) and
        // gather the stage's parameters.
        let colors = dims.colors(me);
        let pp_comm = comm.split(colors.pp, me.stage as u32)?;
        let mut dp_comm = comm.split(colors.dp, me.replica as u32)?;
        let pieces = model.tp_pieces();
        let (mut tp_comm, sum_comm) = if pieces > 1 {
            (
                Some(comm.split(colors.tp, me.tp_rank as u32)?),
                Some(comm.split(colors.tp, me.tp_rank as u32)?),
            )
        } else {
            (None, None)
        };
        let my_layers = ranges[me.stage].clone();
        let offsets = model.layer_offsets();
        let stage_lens: Vec<usize> = ranges
            .iter()
            .map(|r| offsets[r.end] - offsets[r.start])
            .collect();
        let (mut stage, tp_link) =
            build_stage(model, cfg, dims, me.tp_rank, &my_layers, sum_comm, ledger)?;
        let buckets = stage
            .grad_buckets(cfg.dist.bucket_elems)
            .unwrap_or_else(|| layer_buckets(&offsets, my_layers.clone(), cfg.dist.bucket_elems));
        let my_map = stage.index_map();
        let maps = match tp_comm.as_mut() {
            Some(tp) => exchange_maps(tp, &my_map)?,
            None => vec![my_map.clone()],
        };
        let params = stage.params_flat();
        let trained_whole = stage.whole().is_some();
        // Decided once: the stage's layers are ZeRO's segments (at level 2 too) where it streams.
        let streams = streams_last(cfg, dims, !trained_whole);
        let zero = zero_for(
            model,
            cfg,
            dims,
            &my_layers,
            params.len(),
            &dp_comm,
            streams,
        )?;
        let optimizer = ledger.optimizer(zero.optimizer_len());
        let m_total = cfg.microbatches_per_step();
        let my_micro = assign(m_total, dims.dp, me.replica);
        // Micro-batch gradients in this rank's shared window when the stage's replicas share a
        // host and the exact sum takes every part at once (ZeRO below 2, no overlap), else in its
        // own vectors (`grad_parts`); the bits are the same either way.
        let try_shared = cfg.dist.reproducible && zero.level() < 2 && !plan.overlap;
        let base = offsets[my_layers.start];
        // The stage's layers' local ranges: what a streamed backward hands out.
        let layer_ranges: Vec<Range<usize>> = my_layers
            .clone()
            .map(|l| offsets[l] - base..offsets[l + 1] - base)
            .collect();
        let streams_last = streams && !my_micro.is_empty() && zero.segments() == layer_ranges;
        let slots = my_micro.len() - usize::from(streams_last);
        let grads = GradParts::new(&mut dp_comm, slots, params.len(), try_shared)?;
        ledger.set_gradient_sum(match (&grads, dp_comm.size()) {
            (_, 1) => GradientSum::Local,
            (GradParts::Shared(_), _) => GradientSum::SharedWindows,
            (GradParts::Private(_), _) => GradientSum::Collectives,
        });
        let clip = Clip::new(cfg.optimizer.clip_grad_norm);
        let steps_in_backward = crate::memory::steps_in_backward(streams_last, clip.is_some());
        // With shared windows the sum lands in this rank's window (`GradParts::sum`).
        let sum_len = match (grads.sum(), steps_in_backward) {
            (Some(_), _) => 0,
            (None, true) => zero.largest_chunk(),
            (None, false) => zero.grad_len(),
        };
        // With `dist.overlap` the gradient streams by parameter tensor (a model trained
        // whole) or by layer (a layered model on one stage).
        let tensors: Vec<Range<usize>> = match stage.whole() {
            Some(replica) => replica
                .layout()
                .iter()
                .map(|p| p.offset..p.offset + p.len)
                .collect(),
            None => layer_ranges,
        };
        let ahead = cfg.parallel.prefetch_layers;
        let gathers_layers = gathers_layers(plan, ahead, &*stage, streams_last, ledger);
        let mut r = StageRank {
            model,
            cfg,
            plan,
            dims,
            me,
            rank,
            job,
            pp_comm,
            dp_comm,
            tp_comm,
            tp_link,
            stage,
            my_layers,
            maps,
            stage_lens,
            params: Arc::new(params),
            shard_write: None,
            optimizer,
            zero,
            grads,
            total_grad: vec![0f32; sum_len],
            // The one reducer, in buckets that never straddle a layer (or a tp piece).
            sync: GradSync::new(cfg.dist.reproducible, cfg.dist.bucket_elems).with_buckets(buckets),
            // With overlap on a layered model, or streamed into ZeRO 3's sum, the last
            // micro-batch runs outside the schedule.
            ops: schedule(
                cfg.parallel.schedule,
                dims.pp,
                me.stage,
                my_micro.len() - usize::from(plan.overlap && !trained_whole || streams_last),
            ),
            streams_last,
            steps_in_backward,
            gathers_layers,
            my_micro,
            scale: model.loss_scale(cfg.train.global_batch),
            tensors,
            slowdown: faults::slowdown(ledger.faults, rank),
            clip,
            metric_names: Vec::new(),
        };
        r.metric_names = r.stage.train_metric_names();
        r.resume(comm, ledger, offsets[r.my_layers.start])?;
        if r.zero.level() >= 3 {
            // ZeRO 3: between steps this rank keeps only its chunks of the stage's parameters.
            r.params = Arc::new(r.zero.take_owned(&r.params));
            r.stage.release_params();
        }
        Ok(r)
    }

    fn setup_error(&self, e: ReplicaError) -> TrainError {
        TrainError::JobSetup {
            job: self.job.clone(),
            message: e.to_string(),
        }
    }

    /// Resume from the newest good checkpoint: a whole-model file (rank 0 loads it and
    /// broadcasts it; each rank keeps its stage's slice, its tp rank's values of it) or a
    /// sharded set (each rank reads its own values from the shards holding them); then each
    /// rank keeps its shard of the optimizer state. `my_offset`: the stage's first value in the
    /// whole model.
    fn resume(
        &mut self,
        comm: &mut Communicator,
        ledger: &mut Ledger<'_>,
        my_offset: usize,
    ) -> Result<(), TrainError> {
        if !ledger.resuming() {
            return Ok(());
        }
        let full_len = *self.model.layer_offsets().last().expect("offsets");
        // Where the local parameters sit in the stage's canonical vector.
        let my_map = self.stage.index_map();
        let mine = my_offset..my_offset + self.stage_lens[self.me.stage];
        let mut params = vec![0f32; self.params.len()];
        let mut local = ledger.optimizer(params.len());
        let resumed = ledger.resume(comm, &mut |comm, found, dir, steps| {
            match found {
                Found::Whole(c) => {
                    let mut full = vec![0f32; full_len];
                    let mut full_opt = local.fresh(full_len);
                    broadcast_whole(comm, c.as_ref(), dir, steps, &mut full, &mut full_opt)?;
                    params.copy_from_slice(&gather_map(&full[mine.clone()], &my_map));
                    for (dst, src) in local.state_mut().into_iter().zip(full_opt.state()) {
                        dst.copy_from_slice(&gather_map(&src[mine.clone()], &my_map));
                    }
                }
                Found::Set { path, manifest } => {
                    check_set(&path, &manifest, full_len, local.state().len())?;
                    let wanted = local_ranges(&my_map, my_offset, params.len());
                    let mut out: Vec<&mut [f32]> = std::iter::once(&mut params[..])
                        .chain(local.state_mut())
                        .collect();
                    read_local(&path, &manifest, &wanted, &mut out)?;
                }
            }
            local.set_steps_taken(steps);
            Ok(())
        })?;
        if resumed > 0 {
            self.params = Arc::new(params);
            self.optimizer = self.zero.shard_of(&local, 0);
            let params = std::mem::take(&mut self.params);
            let set = self.stage.set_params_flat(&params);
            self.params = params;
            set.map_err(|e| self.setup_error(e))?;
        }
        Ok(())
    }

    /// Bytes this rank sent in all its groups so far.
    fn bytes_sent(&self, comm: &Communicator) -> u64 {
        comm.stats().bytes_sent
            + self.pp_comm.stats().bytes_sent
            + self.dp_comm.stats().bytes_sent
            + self.tp_comm.as_ref().map_or(0, |c| c.stats().bytes_sent)
            + self.tp_link.bytes_sent()
    }

    /// One training step: gradients, their sum, the optimizer, evaluation when due, the
    /// record, then the checkpoint when due.
    fn step(
        &mut self,
        comm: &mut Communicator,
        ledger: &mut Ledger<'_>,
        sampler: &Sampler,
        step: u64,
    ) -> Result<(), TrainError> {
        // Progress marks for the launcher's stall detection (lockstep_comm::activity).
        lockstep_comm::activity::touch();
        faults::at_step(ledger.faults, self.rank, step);
        let step_start = Instant::now();
        let bytes_before = self.bytes_sent(comm);
        let mut sec = PhaseSeconds::default();
        // Device copies are their own phase, taken out of the phase they happened in.
        device::take_copy_seconds();
        if self.zero.level() >= 3 && !self.gathers_layers {
            // The stage's parameters for this step's compute, one all-gather per layer.
            let t0 = Instant::now();
            let whole = self.zero.gather(&self.params, &mut self.dp_comm)?;
            self.stage
                .set_params_flat(&whole)
                .map_err(|e| self.setup_error(e))?;
            sec.communication += t0.elapsed().as_secs_f64();
            move_copies(&mut sec, |s| &mut s.communication);
        }
        let batch = sampler.global_batch(step);
        let pieces = microbatches(&batch, self.cfg.train.microbatch);
        let lr = ledger.lr(step);
        let (loss, pipeline) = self.gradients(comm, &pieces, step, lr, &mut sec)?;
        move_copies(&mut sec, |s| &mut s.backward);
        let train_metrics = self.train_metrics(comm, step, &mut sec)?;
        // (Stepped already, layer by layer, inside a streamed backward.)
        let grad_norm = match self.steps_in_backward {
            true => None,
            false => self.optimizer_step(comm, lr, &mut sec)?,
        };

        let eval = if ledger.eval_due(step) {
            Some(self.evaluate(comm, step)?)
        } else {
            None
        };
        let checkpoint_now = ledger.checkpoint_due(step);
        if checkpoint_now || ledger.set_pending() {
            // A sharded set written in the background since the last step is settled now: its
            // wait, if the write outlasted the step, is stall too.
            let t0 = Instant::now();
            match checkpoint_now {
                true => self.checkpoint(comm, ledger, step)?,
                false => ledger.settle_set(comm)?,
            }
            sec.checkpoint += t0.elapsed().as_secs_f64();
        }
        let step_seconds = step_start.elapsed().as_secs_f64();
        let t = &self.cfg.train;
        let record = StepRecord {
            rank: self.rank,
            step,
            loss,
            lr,
            samples: pieces[self.my_micro.clone()].iter().map(|p| p.len()).sum(),
            samples_per_sec: t.global_batch as f64 / step_seconds,
            step_seconds,
            seconds: sec,
            bytes_sent: self.bytes_sent(comm) - bytes_before,
            eval,
            pipeline,
            rss_bytes: None,
            grad_norm,
            train_metrics,
        };
        ledger.record_step(comm, record, checkpoint_now)?;
        ledger.release_checkpoint()?;
        ledger.step_done(step)
    }

    /// The optimizer's step on the summed gradient (clipped first with
    /// `optimizer.clip_grad_norm`, whose global norm it returns), then the stage's parameters
    /// set from the result (below ZeRO 3; at 3 the rank keeps its updated chunks).
    fn optimizer_step(
        &mut self,
        comm: &mut Communicator,
        lr: f32,
        sec: &mut PhaseSeconds,
    ) -> Result<Option<f64>, TrainError> {
        sec.checkpoint += self.await_shard_write();
        let t0 = Instant::now();
        let grad = self.grads.sum().unwrap_or(&self.total_grad);
        let (grad, grad_norm) = match self.clip.as_mut() {
            Some(clip) => {
                let counted = if self.zero.level() >= 2 {
                    0..grad.len()
                } else {
                    even_share(grad.len(), self.dp_comm.size(), self.dp_comm.rank())
                };
                let c = clip.apply(grad, counted, comm)?;
                (c.grad, Some(c.norm))
            }
            None => (grad, None),
        };
        let gather_seconds = self.zero.step(
            &mut self.optimizer,
            Arc::make_mut(&mut self.params).as_mut_slice(),
            grad,
            lr,
            &mut self.dp_comm,
        )?;
        if self.zero.level() < 3 {
            let set = self.stage.set_params_flat(&self.params);
            set.map_err(|e| self.setup_error(e))?;
        }
        sec.optimizer = t0.elapsed().as_secs_f64() - gather_seconds;
        sec.communication += gather_seconds;
        move_copies(sec, |s| &mut s.optimizer);
        Ok(grad_norm)
    }

    /// Before the parameters or the optimizer's state change: wait for a sharded set's
    /// background write that still holds them. Returns the seconds waited (a stall of the
    /// checkpoint, counted so during a step).
    fn await_shard_write(&mut self) -> f64 {
        let Some(fence) = self.shard_write.take() else {
            return 0.0;
        };
        let t0 = Instant::now();
        fence.wait();
        t0.elapsed().as_secs_f64()
    }

    /// The job's training metrics of this step: the rows of the micro-batches whose loss this
    /// rank counts (the last stage's, on tp rank 0, as for the loss) summed exactly over all
    /// ranks, as per-sample means of the global batch. Empty, with no communication, for a job
    /// without any.
    fn train_metrics(
        &mut self,
        comm: &mut Communicator,
        step: u64,
        sec: &mut PhaseSeconds,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        if self.metric_names.is_empty() {
            return Ok(BTreeMap::new());
        }
        let t0 = Instant::now();
        let rows = self.stage.take_train_metrics();
        let counted = self.me.stage + 1 == self.dims.pp && self.me.tp_rank == 0;
        let rows = if counted { rows } else { Vec::new() };
        let sums = self
            .sync
            .exchange_metrics(
                comm,
                &rows,
                self.metric_names.len(),
                self.cfg.microbatches_per_step(),
            )
            .map_err(|e| sync_error(e, step))?;
        sec.communication += t0.elapsed().as_secs_f64();
        let samples = self.cfg.train.global_batch as f64;
        Ok(self
            .metric_names
            .iter()
            .zip(sums)
            .map(|(name, sum)| (name.clone(), f64::from(sum) / samples))
            .collect())
    }

    /// This rank's micro-batches computed and every rank's summed: a model trained whole one
    /// call per micro-batch (`whole.rs`), a stage of layers by its schedule. Returns the global
    /// loss and, for a stage of layers, its pipeline timing.
    fn gradients(
        &mut self,
        comm: &mut Communicator,
        pieces: &[&[u32]],
        step: u64,
        lr: f32,
        sec: &mut PhaseSeconds,
    ) -> Result<(f64, Option<PipelineStep>), TrainError> {
        let m_total = self.cfg.microbatches_per_step();
        let whole = self.stage.whole().map(|replica| {
            let w = WholeStep {
                job: &self.job,
                step,
                pieces,
                mine: self.my_micro.clone(),
                microbatch: self.cfg.train.microbatch,
                n_micro: m_total,
                scale: self.scale,
                tensors: &self.tensors,
                overlap: self.plan.overlap,
                seed: self.cfg.train.seed,
            };
            whole::step(
                &w,
                replica,
                &mut self.dp_comm,
                &mut self.sync,
                &self.zero,
                &mut self.grads,
                &mut self.total_grad,
            )
        });
        if let Some(computed) = whole {
            let (loss, s) = computed?;
            *sec = s;
            straggle(self.slowdown, sec);
            return Ok((loss, None));
        }
        if self.plan.overlap {
            return self.overlapped_gradients(&pieces[self.my_micro.clone()], step, sec);
        }
        if self.streams_last {
            let mine = &pieces[self.my_micro.clone()];
            return self.streamed_zero_gradients(comm, mine, step, lr, sec);
        }
        let (losses, pipeline) = self.run_schedule(&pieces[self.my_micro.clone()], step, sec)?;
        // The loss: the last stages' micro-batch losses, summed exactly over all ranks.
        let t0 = Instant::now();
        let loss = self
            .sync
            .exchange_loss(comm, &losses, m_total)
            .map_err(|e| sync_error(e, step))?;
        let t1 = Instant::now();
        // The stage's gradients over its data-parallel group: read where they lie in the shared
        // windows, or through the rings (`GradSync::reduce`).
        self.sync
            .reduce(
                &mut self.dp_comm,
                &mut self.grads,
                self.my_micro.len(),
                m_total,
                &self.zero,
                &mut self.total_grad,
            )
            .map_err(|e| sync_error(e, step))?;
        sec.waiting = (t1 - t0).as_secs_f64();
        sec.communication += t1.elapsed().as_secs_f64();
        Ok((loss, Some(pipeline)))
    }

    /// The stage's schedule over `mine` (this replica's micro-batches); returns the losses this
    /// rank counts (the last stage's, on tp rank 0) and the pipeline timing.
    fn run_schedule(
        &mut self,
        mine: &[&[u32]],
        step: u64,
        sec: &mut PhaseSeconds,
    ) -> Result<(Vec<f32>, PipelineStep), TrainError> {
        // Not with overlap: its sum scans each bucket as it goes.
        let scan_ahead = self.cfg.dist.reproducible
            && !self.plan.overlap
            && self.dp_comm.size() > 1
            && self.zero.reduces_in_one_call();
        let (ops, stage, pp_comm) = (&self.ops, self.me.stage, &mut self.pp_comm);
        let (job, tp_link, cfg) = (&self.job, &*self.tp_link, self.cfg);
        let (first_microbatch, scale) = (self.my_micro.start, self.scale);
        let (layer_stage, grads, sync) = (&mut *self.stage, &mut self.grads, &mut self.sync);
        let mut scheduled = |gather: Option<LayerGather<'_>>| {
            let mut work = Work {
                stage: layer_stage,
                pieces: mine,
                first_microbatch,
                microbatch: cfg.train.microbatch,
                job,
                step,
                seed: cfg.train.seed,
                scale,
                grads,
                losses: vec![0.0; mine.len()],
                data_seconds: 0.0,
                link: tp_link,
                // Only where one reduction takes every part (not ZeRO 3's layer by layer), and
                // not on one data-parallel replica, whose fused pass scans each bucket as it
                // sums it.
                scan_ahead: scan_ahead.then_some(ScanAhead { sync, seconds: 0.0 }),
                gather,
            };
            let timing = run_schedule(ops, stage, &mut work, pp_comm)?;
            let gathered = work.gather.as_ref().map(|g| g.waited);
            Ok::<_, TrainError>(Scheduled {
                timing,
                losses: std::mem::take(&mut work.losses),
                data_seconds: work.data_seconds,
                scanned_ahead: work.scan_ahead.as_ref().map_or(0.0, |s| s.seconds),
                gathered: gathered.unwrap_or_default(),
            })
        };
        let done = match self.gathers_layers {
            true => {
                let chunks = Chunks {
                    zero: &self.zero,
                    dp: &mut self.dp_comm,
                    owned: &self.params,
                };
                let order = gather_order(ops, self.zero.segments().len());
                let ahead = cfg.parallel.prefetch_layers;
                with_layer_gather(chunks, order, ahead, |g| scheduled(Some(g)))?
            }
            false => scheduled(None)?,
        };
        let Scheduled {
            timing,
            losses,
            data_seconds,
            scanned_ahead,
            gathered: [gathered_fwd, gathered_bwd],
        } = done;
        if self.zero.level() >= 3 && !self.streams_last {
            // Freed after use: the last backward of the step is done.
            self.stage.release_params();
        }
        sec.data = data_seconds;
        sec.forward = (timing.forward - data_seconds - gathered_fwd).max(0.0);
        // The scan ahead ran inside backward but is the exact sum's work: counted with it.
        sec.backward = (timing.backward - scanned_ahead - gathered_bwd).max(0.0);
        sec.communication += scanned_ahead + gathered_fwd + gathered_bwd;
        straggle(self.slowdown, sec);
        // (A tensor-parallel group's ranks hold the same loss: its tp rank 0 counts it.)
        let counted = self.me.stage + 1 == self.dims.pp && self.me.tp_rank == 0;
        Ok((if counted { losses } else { Vec::new() }, timing.pipeline))
    }

    /// [`StageRank::gradients`] of a layered model on one stage with `dist.overlap`: the earlier
    /// micro-batches by the schedule, the last one's backward streaming layer by layer into a
    /// sum that runs beside it (`GradSync::sync_streamed`, the buckets of the plain sum: the
    /// same bits).
    fn overlapped_gradients(
        &mut self,
        mine: &[&[u32]],
        step: u64,
        sec: &mut PhaseSeconds,
    ) -> Result<(f64, Option<PipelineStep>), TrainError> {
        let last = mine.len() - 1;
        let (mut losses, pipeline) = self.run_schedule(&mine[..last], step, sec)?;
        let job_error = self.microbatch_error(step, last);
        let loss = self.forward_last_streamed(mine, step, sec)?;
        let GradParts::Private(parts) = &mut self.grads else {
            unreachable!("an overlapped sum keeps its parts private (GradParts::new)")
        };
        let (earlier, rest) = parts.split_at_mut(last);
        let earlier: Vec<&[f32]> = earlier.iter().map(|g| g.as_slice()).collect();
        losses.truncate(last);
        let mut stream = StageStream {
            stage: &mut *self.stage,
            id: last as u64,
            layers: &self.tensors,
            loss,
        };
        let o = self
            .sync
            .sync_streamed(
                &mut self.dp_comm,
                &self.tensors,
                &earlier,
                &losses,
                Some((&mut stream as &mut dyn StreamedCompute, &mut rest[0])),
                self.cfg.microbatches_per_step(),
                &mut self.total_grad,
            )
            .map_err(|e| match e {
                SyncError::Exact(e) => sync_error(e, step),
                SyncError::Model(m) => job_error(m.into()),
                SyncError::Replica(r) => job_error(r),
            })?;
        sec.forward += o.forward;
        sec.backward += o.backward;
        sec.waiting = o.timing.waiting;
        sec.communication += o.timing.communication;
        sec.overlapped_communication = o.timing.overlapped_communication;
        Ok((o.loss, Some(pipeline)))
    }

    /// How a failure of this replica's micro-batch `index` (of `my_micro`) at `step` reads.
    fn microbatch_error(&self, step: u64, index: usize) -> impl Fn(ReplicaError) -> TrainError {
        let (job, k) = (self.job.clone(), self.my_micro.start + index);
        let size = self.cfg.train.microbatch;
        move |cause| TrainError::microbatch(job.as_str(), step, k, size, cause)
    }

    /// The forward of this replica's last micro-batch of `mine`, kept for a streamed backward
    /// (`LayerStage::forward_streamed`) on a one-stage model; returns its scaled loss.
    fn forward_last_streamed(
        &mut self,
        mine: &[&[u32]],
        step: u64,
        sec: &mut PhaseSeconds,
    ) -> Result<f32, TrainError> {
        let last = mine.len() - 1;
        let job_error = self.microbatch_error(step, last);
        let t0 = Instant::now();
        let draws = Draws::new(self.cfg.train.seed, step, self.my_micro.start + last);
        self.stage.begin_microbatch(draws);
        let (forwarded, data_seconds) = self
            .stage
            .forward_streamed(last as u64, mine[last], None, self.scale)
            .map_err(&job_error)?;
        let Forwarded::Loss(loss) = forwarded else {
            return Err(job_error(ReplicaError::Other(
                "a one-stage model's forward gave activations, not a loss".into(),
            )));
        };
        sec.data += data_seconds;
        sec.forward += (t0.elapsed().as_secs_f64() - data_seconds).max(0.0);
        Ok(loss)
    }

    /// [`StageRank::gradients`] at ZeRO 2 or 3 on one stage without tensor parallelism: the earlier
    /// micro-batches by the schedule, then the last one's backward streamed layer by layer, each
    /// layer's segment reduce-scattered (`GradSync::reduce_segment`, with the earlier parts'
    /// values of that segment) as soon as its gradient exists. The last micro-batch never has a
    /// whole gradient vector — one layer's at a time — and the bits are those of the sum after
    /// backward: the same segments, parts and exponents, only reduced in another order. With
    /// `steps_in_backward`, each layer's chunk of the sum updates the rank's chunk of the
    /// parameters (at `lr`) as soon as it is reduced, so no shard of reduced gradient is kept:
    /// the optimizer is elementwise, so these are the bits of one step after the whole sum.
    fn streamed_zero_gradients(
        &mut self,
        comm: &mut Communicator,
        mine: &[&[u32]],
        step: u64,
        lr: f32,
        sec: &mut PhaseSeconds,
    ) -> Result<(f64, Option<PipelineStep>), TrainError> {
        let last = mine.len() - 1;
        let (mut losses, pipeline) = self.run_schedule(&mine[..last], step, sec)?;
        losses.push(self.forward_last_streamed(mine, step, sec)?);
        let m_total = self.cfg.microbatches_per_step();
        if self.steps_in_backward {
            sec.checkpoint += self.await_shard_write();
        }
        let t0 = Instant::now();
        let earlier = self.grads.parts();
        let sum = std::sync::Mutex::new(SegmentSum {
            comm: &mut self.dp_comm,
            sync: &mut self.sync,
            out: &mut self.total_grad,
            update: self.steps_in_backward.then_some(LayerUpdate {
                optimizer: &mut self.optimizer,
                params: Arc::make_mut(&mut self.params).as_mut_slice(),
                lr,
                seconds: 0.0,
            }),
            failed: None,
            seconds: 0.0,
        });
        let zero = &self.zero;
        let on_layer = |l: usize, values: &[f32]| {
            let mut s = sum.lock().unwrap_or_else(|e| e.into_inner());
            if s.failed.is_none() {
                let seg = zero.segments()[l].clone();
                let mut parts: Vec<&[f32]> = earlier.iter().map(|p| &p[seg.clone()]).collect();
                parts.push(values);
                s.reduce_layer(zero, l, &parts, m_total);
            }
        };
        let streamed = self
            .stage
            .backward_streaming(last as u64, &self.tensors, &on_layer);
        let SegmentSum {
            failed,
            seconds,
            update,
            ..
        } = sum.into_inner().unwrap_or_else(|e| e.into_inner());
        let stepped = update.map_or(0.0, |u| u.seconds);
        streamed.map_err(self.microbatch_error(step, last))?;
        if let Some(e) = failed {
            return Err(sync_error(e, step));
        }
        let gathered = match self.steps_in_backward {
            true => self.finish_step_in_backward()?,
            false => 0.0,
        };
        if self.zero.level() >= 3 {
            // Freed after use: the last backward of the step is done.
            self.stage.release_params();
        }
        sec.backward += (t0.elapsed().as_secs_f64() - seconds - stepped - gathered).max(0.0);
        sec.communication += seconds + gathered;
        sec.optimizer = stepped;
        let t1 = Instant::now();
        let loss = self
            .sync
            .exchange_loss(comm, &losses, m_total)
            .map_err(|e| sync_error(e, step))?;
        sec.waiting = t1.elapsed().as_secs_f64();
        Ok((loss, Some(pipeline)))
    }

    /// The end of an optimizer step taken layer by layer inside a streamed backward: the step
    /// counted, and below ZeRO 3 every replica's updated chunks all-gathered into the whole
    /// parameters, which the stage then takes. Returns the seconds of the all-gather.
    fn finish_step_in_backward(&mut self) -> Result<f64, TrainError> {
        self.optimizer.finish_step();
        if self.zero.level() >= 3 {
            return Ok(0.0);
        }
        let t0 = Instant::now();
        self.zero.gather_in_place(
            Arc::make_mut(&mut self.params).as_mut_slice(),
            &mut self.dp_comm,
        )?;
        let gathered = t0.elapsed().as_secs_f64();
        let set = self.stage.set_params_flat(&self.params);
        set.map_err(|e| self.setup_error(e))?;
        Ok(gathered)
    }

    /// The evaluation after `step`, through each replica's pipeline (ZeRO 3: the stage
    /// gathered for it, or, where it gathers one layer at a time, each layer once per group of
    /// a step's worth of chunks).
    fn evaluate(&mut self, comm: &mut Communicator, step: u64) -> Result<Eval, TrainError> {
        let (model, dims, me) = (self.model, self.dims, self.me);
        let chunk = model.eval_chunk(self.cfg.train.microbatch);
        let (pp_comm, link) = (&mut self.pp_comm, &*self.tp_link);
        let mut run = EvalRun {
            comm,
            pp: pp_comm,
            model,
            samples: model.eval_samples(),
            dims,
            me,
            link,
            chunk,
            group: 1,
            step,
        };
        if self.gathers_layers {
            run.group = self.my_micro.len().max(1);
            let layers = self.zero.segments().len();
            let order = (0..run.groups()).flat_map(|_| 0..layers).collect();
            let chunks = Chunks {
                zero: &self.zero,
                dp: &mut self.dp_comm,
                owned: &self.params,
            };
            let ahead = self.cfg.parallel.prefetch_layers;
            let stage = &mut *self.stage;
            return with_layer_gather(chunks, order, ahead, |mut gather| {
                let evaluated = run.evaluate(stage, Some(&mut gather));
                match gather.failure.take() {
                    Some(c) => Err(TrainError::Comm(c)),
                    None => evaluated,
                }
            });
        }
        let job = self.job.clone();
        let setup = |e: ReplicaError| TrainError::JobSetup {
            job: job.clone(),
            message: e.to_string(),
        };
        with_whole_stage(
            &self.zero,
            &self.params,
            &mut self.dp_comm,
            &mut *self.stage,
            setup,
            |stage| run.evaluate(stage, None),
        )
    }

    /// This rank's parameters and optimizer state for a checkpoint write, shared (not copied).
    fn shared_vectors(&self) -> SharedVectors {
        SharedVectors {
            params: Arc::clone(&self.params),
            state: self.optimizer.shared_state(),
        }
    }

    /// Collective: the stage (ZeRO 3: gathered) and its optimizer state sent to rank 0, which
    /// takes the checkpoint after `step` (written under a temporary name, or kept for the
    /// background writer; published after the step's record); with `checkpoint.sharded`, every
    /// rank's shard written where it lies, the set published after the record.
    fn checkpoint(
        &mut self,
        comm: &mut Communicator,
        ledger: &mut Ledger<'_>,
        step: u64,
    ) -> Result<(), TrainError> {
        if self.cfg.checkpoint.sharded {
            // Every rank writes its own chunks: nothing is gathered.
            let offset = self.model.layer_offsets()[self.my_layers.start];
            let map = self.stage.index_map();
            let shard = SharedShard {
                layout: shard_layout(&self.zero, &map, offset),
                vectors: self.shared_vectors(),
            };
            let full_len = *self.model.layer_offsets().last().expect("offsets");
            let steps = self.optimizer.steps_taken();
            self.shard_write =
                ledger.take_sharded_checkpoint(comm, step, shard, steps, full_len)?;
            return Ok(());
        }
        // One stage, no tensor parallelism, nothing sharded: rank 0 holds the whole model and
        // its optimizer state already, and writes them where they lie (no other rank takes part).
        let in_place = || {
            self.maps
                .first()
                .is_some_and(|m| covers(m, self.params.len()))
        };
        if self.dims.pp == 1 && self.tp_comm.is_none() && self.zero.level() == 0 && in_place() {
            if self.rank == 0 {
                let steps = self.optimizer.steps_taken();
                ledger.take_shared_checkpoint(step, self.shared_vectors(), steps)?;
            }
            return Ok(());
        }
        let gathered;
        let stage_params: &[f32] = if self.zero.level() >= 3 {
            gathered = self.zero.gather(&self.params, &mut self.dp_comm)?;
            &gathered
        } else {
            &self.params
        };
        // Collective within replica 0: rank 0 receives the whole model.
        let (maps, lens, replica) = (&self.maps, &self.stage_lens, self.me.replica);
        let (tp, pp) = (&mut self.tp_comm, &mut self.pp_comm);
        let mut whole = |v: &[f32]| gather_whole(tp.as_mut(), pp, replica, v, maps, lens);
        let full = whole(stage_params)?;
        let mut full_state = Vec::new();
        for v in self.zero.whole_state(&self.optimizer, &mut self.dp_comm)? {
            full_state.push(whole(&v)?);
        }
        if self.rank == 0 {
            // Gathered for the checkpoint: handed over, never copied again.
            ledger.take_checkpoint(
                step,
                Cow::Owned(full.expect("rank 0 gathers")),
                full_state
                    .into_iter()
                    .map(|s| Cow::Owned(s.expect("rank 0")))
                    .collect(),
                self.optimizer.steps_taken(),
            )?;
        }
        Ok(())
    }

    /// Collective, at the end: replicas of a stage must agree; then rank 0 hashes the whole
    /// model and tells everyone. Returns the hash and what this rank held.
    fn final_hash(&mut self, comm: &mut Communicator) -> Result<(String, ModelState), TrainError> {
        // The last set's write lets go of the parameters before they are gathered: the chunks it
        // holds are then freed, not kept beside the whole stage.
        self.await_shard_write();
        let t = &self.cfg.train;
        let held = ModelState::new(&self.params, &self.optimizer)
            .grads(self.grads.held().into_iter().chain([&self.total_grad[..]]))
            // A streamed last micro-batch's gradient: one layer's values at a time.
            .grad_buffer(match self.streams_last {
                true => self.tensors.iter().map(|r| r.len()).max().unwrap_or(0),
                false => 0,
            })
            .exact_scratch(self.cfg.dist.reproducible, self.zero.scratch_len())
            .activations_per_microbatch(
                4 * (self.model.held_activation_floats(self.my_layers.clone()) * t.microbatch)
                    as u64,
            );
        if self.zero.level() >= 3 {
            self.params = Arc::new(self.zero.gather(&self.params, &mut self.dp_comm)?);
        }
        let stage_hash = param_hash(&self.params);
        let hashes = gather_strings(&mut self.dp_comm, &stage_hash)?;
        if let Some(r) = hashes.iter().position(|h| h != &hashes[0]) {
            return Err(TrainError::Diverged {
                rank: self.dims.rank_of(crate::Coords {
                    replica: r,
                    ..self.me
                }),
                theirs: hashes[r].clone(),
                ours: hashes[0].clone(),
            });
        }
        let whole = hash_whole(
            self.tp_comm.as_mut(),
            &mut self.pp_comm,
            self.me.replica,
            &self.params,
            &self.maps,
            &self.stage_lens,
        )?;
        let mut hash_bytes = [0u8; 64];
        if let Some(hash) = &whole {
            hash_bytes.copy_from_slice(hash.as_bytes());
        }
        comm.broadcast(&mut hash_bytes, 0)?;
        Ok((String::from_utf8_lossy(&hash_bytes).into_owned(), held))
    }
}

/// What a streamed ZeRO 3 backward's layers reduce with (`streamed_zero_gradients`), behind one
/// lock: the backward hands layers out through a shared callback.
struct SegmentSum<'a> {
    comm: &'a mut Communicator,
    sync: &'a mut GradSync,
    /// The rank's reduced chunks (all segments'), or with `update` one segment's chunk.
    out: &'a mut [f32],
    /// The optimizer step each reduced chunk makes at once (`steps_in_backward`).
    update: Option<LayerUpdate<'a>>,
    /// The first reduction that failed; the layers after it are not reduced.
    failed: Option<ExactError>,
    seconds: f64,
}

/// The optimizer, the rank's parameters (its chunks at ZeRO 3, the whole vector at 2) and the
/// step's learning rate, for a streamed sum that steps each layer's chunk as soon as it is
/// reduced.
struct LayerUpdate<'a> {
    optimizer: &'a mut Optimizer,
    params: &'a mut [f32],
    lr: f32,
    seconds: f64,
}

impl SegmentSum<'_> {
    /// Layer `l`'s segment of the sum, from every local part's values of it (`parts`): this
    /// rank's chunk reduced, then (with `update`) stepped at its place among the rank's chunks
    /// of the parameters and optimizer state.
    fn reduce_layer(&mut self, zero: &Zero, l: usize, parts: &[&[f32]], total: usize) {
        let (at, len) = (zero.chunk_offset(l), zero.chunks()[l].len());
        let mine = zero.params_range(l);
        let out = match self.update {
            Some(_) => &mut self.out[..len],
            None => &mut self.out[at..at + len],
        };
        let t = Instant::now();
        let reduced = self
            .sync
            .reduce_segment(self.comm, zero, l, parts, total, out);
        self.seconds += t.elapsed().as_secs_f64();
        if let Err(e) = reduced {
            self.failed = Some(e);
            return;
        }
        if let Some(u) = &mut self.update {
            let t = Instant::now();
            u.optimizer.step_range(at, &mut u.params[mine], out, u.lr);
            u.seconds += t.elapsed().as_secs_f64();
        }
    }
}

/// The streamed last micro-batch of an overlapped step on a one-stage layered model.
struct StageStream<'s> {
    stage: &'s mut dyn LayerStage,
    id: u64,
    /// The stage's layers' local ranges (the indices the stream hands out).
    layers: &'s [Range<usize>],
    /// Its scaled loss, from the forward.
    loss: f32,
}

impl StreamedCompute for StageStream<'_> {
    fn streaming(&mut self, on_grad: &(dyn Fn(usize, &[f32]) + Sync)) -> Result<f32, SyncError> {
        self.stage
            .backward_streaming(self.id, self.layers, on_grad)?;
        Ok(self.loss)
    }

    fn plain(&mut self, grad: &mut [f32]) -> Result<TimedLoss, SyncError> {
        let t0 = Instant::now();
        self.stage.backward(self.id, None, grad)?;
        Ok(TimedLoss {
            loss: self.loss,
            forward_seconds: 0.0,
            backward_seconds: t0.elapsed().as_secs_f64(),
        })
    }
}

/// The device copies since the last call, moved out of the phase `from` picks (the one that
/// timed them) into `device_copy`.
fn move_copies(sec: &mut PhaseSeconds, from: impl FnOnce(&mut PhaseSeconds) -> &mut f64) {
    let copies = device::take_copy_seconds();
    let phase = from(sec);
    *phase = (*phase - copies).max(0.0);
    sec.device_copy += copies;
}

/// An injected straggler (`--inject slow:…`): its computation takes `slowdown` times as long.
fn straggle(slowdown: f64, sec: &mut PhaseSeconds) {
    if slowdown > 1.0 {
        let extra = (sec.forward + sec.backward) * (slowdown - 1.0);
        std::thread::sleep(std::time::Duration::from_secs_f64(extra));
        sec.backward += extra;
    }
}

/// Whether this stage's last micro-batch streams its gradient into the sum, by the rule the plan
/// predicts with ([`crate::memory::streams_last_microbatch`]); the caller also needs its layers
/// (local ranges) to be ZeRO's segments, as [`zero_for`] cuts them for such a stage.
fn streams_last(cfg: &TrainConfig, dims: ParallelDims, layered: bool) -> bool {
    let recompute = cfg.train.recompute == crate::config::Recompute::Layers;
    let zero = cfg.parallel.zero;
    crate::memory::streams_last_microbatch(zero, dims.pp, dims.tp, layered, recompute)
}

/// The rank's stage of `layers`: its tensor-parallel pieces summed over `sums` (the stage's tp
/// group), or the whole layers; and the link the pieces' sums report their time through.
fn build_stage<'m>(
    model: &'m dyn Layered,
    cfg: &TrainConfig,
    dims: ParallelDims,
    tp_rank: usize,
    layers: &Range<usize>,
    sums: Option<Communicator>,
    ledger: &mut Ledger<'_>,
) -> Result<(Box<dyn LayerStage + 'm>, Rc<TpLink>), TrainError> {
    let tp_link = Rc::new(TpLink::default());
    let seed = cfg.train.seed;
    let stage = match sums {
        Some(sums) => {
            let sum = Box::new(GroupPieceSum::new(sums, tp_link.clone()));
            model.tp_stage(layers.clone(), seed, dims.tp, tp_rank, sum)?
        }
        None => model.stage(layers.clone(), seed)?,
    };
    let pieces = model.tp_pieces();
    if pieces > 1 {
        ledger.notice(format!(
            "tensor parallelism: tensor-parallel layers computed as {pieces} fixed pieces, {} \
             per rank over {} tensor-parallel ranks per stage",
            pieces / dims.tp,
            dims.tp
        ));
    }
    Ok((stage, tp_link))
}

/// Whether ZeRO 3 gathers `stage` one layer at a time (`lockstep_run::memory::gathers_layers`),
/// recorded for the summary at level 3.
fn gathers_layers(
    plan: &ParallelPlan,
    ahead: usize,
    stage: &dyn LayerStage,
    streams_last: bool,
    ledger: &mut Ledger<'_>,
) -> bool {
    let even = plan.microbatches.is_multiple_of(plan.dp);
    let by_layer =
        crate::memory::gathers_layers(plan.zero, stage.fetches_layers(), streams_last, even);
    if plan.zero >= 3 {
        ledger.set_param_gathering(match by_layer {
            true => (ParamGathering::Layer, Some(ahead)),
            false => (ParamGathering::Stage, None),
        });
    }
    by_layer
}

/// ZeRO for the stage of `layers` holding `len` local values: the stage's optimizer state (and
/// from level 2 its reduced gradient) sharded over its data-parallel group (of the rank's local
/// vector, with tensor parallelism). At level 3 every layer is chunked on its own, so a layer is
/// gathered by one all-gather (at level 2 too when the stage `streams` its last micro-batch into the
/// sum layer by layer); with tensor parallelism a layer's segment of the local vector is
/// its replicated parameters and this rank's share of the split ones (a tp layout keeps layers
/// contiguous).
fn zero_for(
    model: &dyn Layered,
    cfg: &TrainConfig,
    dims: ParallelDims,
    layers: &Range<usize>,
    len: usize,
    dp_comm: &Communicator,
    streams: bool,
) -> Result<Zero, TrainError> {
    let level = cfg.parallel.zero;
    // At level 2, by layers where the last micro-batch streams into the sum (`streams`).
    if level < 2 || level == 2 && !streams {
        return Ok(Zero::new(level, len, dp_comm));
    }
    let offsets = model.layer_offsets();
    let mut start = 0;
    let segments: Vec<Range<usize>> = layers
        .clone()
        .map(|l| {
            let split = if dims.tp > 1 {
                model.tp_split_params(l)
            } else {
                0
            };
            let n = params_per_tp_rank(offsets[l + 1] - offsets[l], split, dims.tp);
            start += n;
            start - n..start
        })
        .collect();
    if start != len {
        return Err(TrainError::JobSetup {
            job: model.name(),
            message: format!(
                "ZeRO {level}: the stage's layers add up to {start} local parameters, the \
                 stage holds {len}"
            ),
        });
    }
    Ok(Zero::by_segments(level, segments, dp_comm))
}

fn sync_error(e: ExactError, step: u64) -> TrainError {
    match e {
        ExactError::Comm(c) => TrainError::Comm(c),
        other => TrainError::Sync { step, cause: other },
    }
}

/// Stage cuts: from the config, or balanced from layer costs that rank 0 measures and
/// broadcasts (every rank must cut alike; measurements differ from rank to rank).
fn choose_cuts(
    cfg: &TrainConfig,
    model: &dyn Layered,
    comm: &mut Communicator,
    stages: usize,
) -> Result<(Vec<usize>, Vec<f64>, String), TrainError> {
    if stages == 1 {
        return Ok((Vec::new(), Vec::new(), "none".into()));
    }
    if !cfg.parallel.stage_cuts.is_empty() {
        return Ok((cfg.parallel.stage_cuts.clone(), Vec::new(), "manual".into()));
    }
    let mut costs = vec![0f64; model.num_layers()];
    if comm.rank() == 0 {
        costs = model.profile_layers(cfg.train.microbatch, cfg.parallel.profile_reps)?;
    }
    comm.broadcast(&mut costs, 0)?;
    Ok((balance(&costs, stages), costs, "auto".into()))
}

/// Collective over replica 0 (its tensor-parallel groups, then its pipeline of tp ranks 0): rank
/// 0 returns the whole model built from every rank's local parameters (`maps`: each tp rank's
/// index map, known to tp rank 0; without a tp group, this rank's); everyone else gets `None`.
fn gather_whole(
    tp: Option<&mut Communicator>,
    pp: &mut Communicator,
    replica: usize,
    mine: &[f32],
    maps: &[Vec<Range<usize>>],
    stage_lens: &[usize],
) -> Result<Option<Vec<f32>>, TrainError> {
    if replica != 0 {
        return Ok(None);
    }
    // Stage 0's buffer is the whole model's from the start, filled once (a large model is
    // copied once here, never zeroed first or grown by `gather_model`).
    let room = if pp.rank() == 0 {
        stage_lens.iter().sum()
    } else {
        stage_lens[pp.rank()]
    };
    match canonical_stage(tp, mine, maps, stage_lens[pp.rank()], room)? {
        Some(stage) => gather_model(pp, replica, stage.into_owned(), stage_lens),
        None => Ok(None),
    }
}

/// Collective over replica 0, as [`gather_whole`], but rank 0 returns the whole model's
/// [`param_hash`], fed stage by stage: it never holds more than its own stage and one other
/// (and its own is not copied when it is the stage's vector itself).
fn hash_whole(
    tp: Option<&mut Communicator>,
    pp: &mut Communicator,
    replica: usize,
    mine: &[f32],
    maps: &[Vec<Range<usize>>],
    stage_lens: &[usize],
) -> Result<Option<String>, TrainError> {
    if replica != 0 {
        return Ok(None);
    }
    let len = stage_lens[pp.rank()];
    let Some(stage) = canonical_stage(tp, mine, maps, len, len)? else {
        return Ok(None);
    };
    if pp.rank() != 0 {
        pp.send(0, &stage)?;
        return Ok(None);
    }
    let mut hasher = ParamHasher::default();
    hasher.update(&stage);
    drop(stage);
    for (s, &len) in stage_lens.iter().enumerate().skip(1) {
        let mut next = vec![0f32; len];
        pp.recv(s, &mut next)?;
        hasher.update(&next);
    }
    Ok(Some(hasher.finish()))
}

/// Collective over a stage's tp group: the stage's canonical vector of `len` values on tp rank 0
/// (`None` on the others), built from every tp rank's local values; without tensor parallelism
/// this rank's own, lent when it is already the stage's vector in order and no more than `len`
/// values of room are asked for, else built in a buffer of `room` values' capacity.
fn canonical_stage<'v>(
    tp: Option<&mut Communicator>,
    mine: &'v [f32],
    maps: &[Vec<Range<usize>>],
    len: usize,
    room: usize,
) -> Result<Option<Cow<'v, [f32]>>, TrainError> {
    if let Some(tp) = tp {
        return Ok(gather_stage(tp, mine, maps, len)?.map(Cow::Owned));
    }
    let in_order = covers(&maps[0], len);
    if in_order && room <= len {
        return Ok(Some(Cow::Borrowed(mine)));
    }
    let mut stage = Vec::with_capacity(room.max(len));
    if in_order {
        stage.extend_from_slice(mine);
    } else {
        stage.resize(len, 0.0);
        scatter_map(mine, &maps[0], &mut stage);
    }
    Ok(Some(Cow::Owned(stage)))
}

/// Does `map` select all of a stage of `len` values, in order (so that the local vector is the
/// stage's own)?
fn covers(map: &[Range<usize>], len: usize) -> bool {
    matches!(map, [r] if *r == (0..len))
}

/// Collective over one replica's pipeline: replica 0's stages send their slices (stage order =
/// flat order) to stage 0, which returns the whole vector; everyone else gets `None`. Other
/// replicas hold identical copies and take no part.
fn gather_model(
    pp: &mut Communicator,
    replica: usize,
    mine: Vec<f32>,
    stage_lens: &[usize],
) -> Result<Option<Vec<f32>>, TrainError> {
    if replica != 0 {
        return Ok(None);
    }
    if pp.rank() != 0 {
        pp.send(0, &mine)?;
        return Ok(None);
    }
    let mut full = mine;
    let mut at = full.len();
    full.resize(stage_lens.iter().sum(), 0.0);
    for (s, &len) in stage_lens.iter().enumerate().skip(1) {
        pp.recv(s, &mut full[at..at + len])?;
        at += len;
    }
    Ok(Some(full))
}

/// Run `eval` on `stage` holding all its parameters: with ZeRO 3 gathered for it and released
/// after (between steps a rank keeps only its chunks).
fn with_whole_stage<T>(
    zero: &Zero,
    params: &[f32],
    dp_comm: &mut Communicator,
    stage: &mut dyn LayerStage,
    setup: impl Fn(ReplicaError) -> TrainError,
    eval: impl FnOnce(&mut dyn LayerStage) -> Result<T, TrainError>,
) -> Result<T, TrainError> {
    if zero.level() >= 3 {
        let whole = zero.gather(params, dp_comm)?;
        stage.set_params_flat(&whole).map_err(setup)?;
    }
    let out = eval(&mut *stage);
    if zero.level() >= 3 {
        stage.release_params();
    }
    out
}

/// An evaluation through each replica's pipeline: fixed chunks of `chunk` samples whatever the
/// layout (so each chunk's sums have the same bits everywhere), the replicas taking contiguous
/// shares, the last stages' sums combined exactly. A stage evaluates `group` chunks at a time.
struct EvalRun<'a> {
    comm: &'a mut Communicator,
    pp: &'a mut Communicator,
    model: &'a dyn Layered,
    /// The model's evaluation samples (`Layered::eval_samples`), read once per evaluation.
    samples: Vec<u32>,
    dims: ParallelDims,
    me: crate::Coords,
    link: &'a TpLink,
    chunk: usize,
    group: usize,
    step: u64,
}

impl EvalRun<'_> {
    /// Groups every replica evaluates: as many as the largest share needs (a stage taking its
    /// layers one at a time makes the same gathers, collectives, on every replica).
    fn groups(&self) -> usize {
        let chunks = self.samples.len().div_ceil(self.chunk.max(1));
        chunks.div_ceil(self.dims.dp).div_ceil(self.group)
    }

    /// Evaluate the model's evaluation samples; `source`: the stage takes its layers one at a
    /// time from it ([`LayerStage::evaluate_from`]), else each chunk goes through the held stage.
    fn evaluate(
        &mut self,
        stage: &mut dyn LayerStage,
        mut source: Option<&mut dyn LayerSource>,
    ) -> Result<Eval, TrainError> {
        let job = self.model.name();
        let link = self.link;
        let step = self.step;
        let eval_error = |cause| match link.take_failure() {
            Some(c) => TrainError::Comm(c),
            None => TrainError::JobEval {
                job: job.clone(),
                step: step + 1,
                cause,
            },
        };
        let groups = self.groups();
        let all = &self.samples;
        let chunks: Vec<&[u32]> = all.chunks(self.chunk.max(1)).collect();
        let share = &chunks[assign(chunks.len(), self.dims.dp, self.me.replica)];
        let s = self.pp.rank();
        let mut mine = EvalTotals::default();
        for g in 0..groups {
            lockstep_comm::activity::touch();
            let group = share.iter().skip(g * self.group).take(self.group);
            let group: Vec<&[u32]> = group.copied().collect();
            let mut inputs = Vec::with_capacity(group.len());
            for piece in &group {
                inputs.push(match stage.is_first() {
                    true => None,
                    false => {
                        let mut acts = vec![0f32; stage.input_len(piece.len())];
                        self.pp.recv(s - 1, &mut acts)?;
                        Some(acts)
                    }
                });
            }
            let evaluated = match source.as_deref_mut() {
                Some(source) => stage.evaluate_from(&group, &inputs, source),
                None => group
                    .iter()
                    .zip(&inputs)
                    .map(|(piece, input)| stage.evaluate(piece, input.as_deref()))
                    .collect(),
            };
            for evaluated in evaluated.map_err(eval_error)? {
                match evaluated {
                    Evaluated::Activations(out) => self.pp.send(s + 1, &out)?,
                    // A tensor-parallel group's ranks hold the same sums: its tp rank 0 counts them.
                    Evaluated::Sums(sums) if self.me.tp_rank == 0 => {
                        mine.add(sums).map_err(eval_error)?
                    }
                    Evaluated::Sums(_) => {}
                }
            }
        }
        combine(
            self.comm,
            mine,
            self.model.eval_units(all.len()),
            &job,
            step,
        )
    }
}

#[allow(clippy::too_many_arguments)]
fn pipeline_summary(
    ranks: &[RankSummary],
    dims: ParallelDims,
    kind: ScheduleKind,
    ranges: Vec<Range<usize>>,
    cuts_from: String,
    layer_seconds: Vec<f64>,
    m_per_replica: usize,
    steps: u64,
) -> PipelineSummary {
    let pipes: Vec<_> = ranks
        .iter()
        .filter_map(|r| r.pipeline.map(|p| (r, p)))
        .collect();
    let mean_bubble = if pipes.is_empty() {
        0.0
    } else {
        pipes.iter().map(|(_, p)| p.bubble_fraction).sum::<f64>() / pipes.len() as f64
    };
    let per_stage = |f: &dyn Fn(&RankSummary, &crate::metrics::RankPipeline) -> f64| -> Vec<f64> {
        (0..dims.pp)
            .map(|s| {
                let v: Vec<f64> = pipes
                    .iter()
                    .filter(|(_, p)| p.stage == s)
                    .map(|(r, p)| f(r, p))
                    .collect();
                v.iter().sum::<f64>() / v.len().max(1) as f64
            })
            .collect()
    };
    PipelineSummary {
        dp: dims.dp,
        pp: dims.pp,
        microbatches_per_replica: m_per_replica,
        schedule: kind.name().to_string(),
        stage_layers: ranges.iter().map(|r| (r.start, r.end)).collect(),
        cuts_from,
        layer_seconds,
        bubble_fraction: mean_bubble,
        ideal_bubble_fraction: ideal_bubble_fraction(dims.pp, m_per_replica),
        peak_activations: (0..dims.pp)
            .map(|s| {
                pipes
                    .iter()
                    .filter(|(_, p)| p.stage == s)
                    .map(|(_, p)| p.peak_activations)
                    .max()
                    .unwrap_or(0)
            })
            .collect(),
        stage_compute_seconds: per_stage(&|r, _| r.compute_seconds / steps as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_never_straddle_layers_and_agree_across_cuts() {
        let offsets = [0, 10, 35, 60, 61];
        let whole = layer_buckets(&offsets, 0..4, 8);
        assert_eq!(whole.first(), Some(&(0..8)));
        assert!(whole
            .iter()
            .all(|b| offsets.iter().all(|&o| !(b.start < o && o < b.end))));
        // A stage's buckets are the whole model's buckets of its layers, shifted.
        let tail = layer_buckets(&offsets, 2..4, 8);
        let shifted: Vec<Range<usize>> = whole
            .iter()
            .filter(|b| b.start >= 35)
            .map(|b| b.start - 35..b.end - 35)
            .collect();
        assert_eq!(tail, shifted);
    }
}
