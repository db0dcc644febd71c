//! [`Ledger`]: what every training loop does around a step's gradients, written once — resume,
//! the checkpoint and evaluation cadence, the step record, incremental metrics.jsonl, progress
//! events, and at the end the records of all ranks, the summary and the run's outputs.
//!
//! A loop (data-parallel, pipeline) owns only what differs: how gradients are computed and summed,
//! how the whole model reaches rank 0 for a checkpoint, and how evaluation runs.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use lockstep_comm::Communicator;
use lockstep_model::{LrSchedule, Optimizer, UpdateRule};
use sha2::{Digest, Sha256};

use super::checkpoint_writer::{
    settle_set, start_set, write_set, CheckpointWriter, Held, PendingSet, SetCounts, WriteFence,
};
use super::checkpointing::{checkpoint_dir, checkpoint_due, find_checkpoint, Found};
use super::end::{build_summary, emit_progress, gather_run, RunEnd, StepPoint};
use super::outputs::{write_outputs, MetricsLog};
use super::schedule::{optimizer_spec, RECORDS_RESERVED};
use crate::checkpoint::sharded::SharedShard;
use crate::checkpoint::{CheckpointView, Identity, SharedVectors};
use crate::config::TrainConfig;
use crate::context::{Event, JobLabel, WorkerContext};
use crate::error::TrainError;
use crate::faults::Fault;
use crate::memory::{current_rss_bytes, ModelState};
use crate::metrics::{
    Eval, GradientSum, ParamGathering, PipelineSummary, RankSummary, StepRecord, Summary,
};
use lockstep_run::ParallelPlan;

/// The training loss metrics.jsonl in `dir` records for `step` (NaN when it holds none).
fn recorded_loss(dir: &Path, step: u64) -> f64 {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<StepRecord>(l).ok())
        .find(|r| r.step == step)
        .map_or(f64::NAN, |r| r.loss)
}

/// The model part of a checkpoint's identity: the architecture fingerprint, and with a job's own
/// update rule also its name and state vectors (a checkpoint of another rule is not resumed).
/// Without one it is the fingerprint as before, so existing checkpoints keep their identity.
fn model_identity(structure_hash: [u8; 32], rule: Option<&dyn UpdateRule>) -> String {
    let Some(rule) = rule else {
        return hex::encode(structure_hash);
    };
    let mut h = Sha256::new();
    h.update(b"lockstep model with update rule v1\0");
    h.update(structure_hash);
    for part in std::iter::once(rule.name().to_string()).chain(rule.state_names()) {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(h.finalize())
}

/// What [`Ledger::resume`] has the loop do with the checkpoint found: put it (from the checkpoint
/// directory, with the optimizer steps it holds) into the loop's buffers. Collective.
pub(crate) type LoadCheckpoint<'l> =
    dyn FnMut(&mut Communicator, Found, &Path, u64) -> Result<(), TrainError> + 'l;

/// One rank's bookkeeping over one attempt of a run.
pub(crate) struct Ledger<'a> {
    cfg: &'a TrainConfig,
    rank: usize,
    out_dir: &'a Path,
    host: String,
    /// This rank's device, described (for the summary).
    device: String,
    /// Continue from the newest good checkpoint, if there is one.
    resume_requested: bool,
    ckpt_dir: PathBuf,
    identity: Identity,
    /// Deliberately injected faults.
    pub(crate) faults: &'a [Fault],
    on_event: &'a mut dyn FnMut(Event),
    started: Instant,
    pub(crate) start_step: u64,
    pub(crate) total_steps: u64,
    schedule: LrSchedule,
    records: Vec<StepRecord>,
    metrics: MetricsLog,
    evals: Vec<(u64, Eval)>,
    last_loss: f64,
    gradient_sum: Option<GradientSum>,
    param_gathering: Option<ParamGathering>,
    layers_prefetched: Option<usize>,
    plan: ParallelPlan,
    /// Resumed from a checkpoint taken after the last step (an earlier attempt ended before its
    /// summary): no step runs, the final evaluation is run again for the summary.
    resumed_at_end: bool,
    /// The job's name and config sections (summary.json, config.toml).
    job: JobLabel,
    /// The job's own optimizer update (`optimizer.kind = "custom"`).
    rule: Option<Arc<dyn UpdateRule>>,
    /// Rank 0's checkpoint writes (in the step, or in the background).
    writer: CheckpointWriter,
    /// A step done whose `StepDone` waits for a background checkpoint write: the launcher takes
    /// a reported step as "every checkpoint up to it is on disk".
    unreported: Option<u64>,
    /// This rank's shard of a sharded set written in the background (`checkpoint.async`).
    pending_set: Option<PendingSet>,
}

impl<'a> Ledger<'a> {
    /// The ledger of a run of `total_steps` begun at `started` following `plan`, for a model
    /// whose architecture fingerprint is `structure_hash` (checkpoints are keyed by it, the
    /// custom update `rule`'s name and state, and the config's identity); takes the worker
    /// context apart and hands back its communicator.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn open(
        cfg: &'a TrainConfig,
        ctx: WorkerContext<'a>,
        job: JobLabel,
        plan: &ParallelPlan,
        structure_hash: [u8; 32],
        rule: Option<Arc<dyn UpdateRule>>,
        total_steps: u64,
        started: Instant,
    ) -> (&'a mut Communicator, Self) {
        let WorkerContext {
            comm,
            host,
            device,
            out_dir,
            on_event,
            resume,
            faults,
        } = ctx;
        let t = &cfg.train;
        let ckpt_dir = checkpoint_dir(cfg, out_dir);
        let ledger = Ledger {
            cfg,
            rank: comm.rank(),
            out_dir,
            host,
            device: device.info.describe(),
            resume_requested: resume,
            writer: CheckpointWriter::new(
                ckpt_dir.clone(),
                cfg.checkpoint.keep,
                cfg.checkpoint.background,
                faults,
            ),
            unreported: None,
            pending_set: None,
            ckpt_dir,
            identity: Identity {
                config: cfg.identity_hash(),
                model: model_identity(structure_hash, rule.as_deref()),
            },
            faults,
            on_event,
            started,
            start_step: 0,
            total_steps,
            schedule: LrSchedule {
                base_lr: t.lr,
                warmup_steps: t.warmup_steps,
                total_steps,
                min_lr: t.min_lr,
            },
            records: Vec::with_capacity(RECORDS_RESERVED),
            metrics: MetricsLog::new(),
            evals: Vec::new(),
            last_loss: f64::NAN,
            gradient_sum: None,
            param_gathering: None,
            layers_prefetched: None,
            plan: plan.clone(),
            resumed_at_end: false,
            job,
            rule,
        };
        (comm, ledger)
    }

    /// A notice for the log (rank 0 only).
    pub(crate) fn notice(&mut self, text: String) {
        if self.rank == 0 {
            (self.on_event)(Event::Notice(text));
        }
    }

    /// Will [`Ledger::resume`] look for a checkpoint (so the caller needs whole-model buffers)?
    pub(crate) fn resuming(&self) -> bool {
        self.resume_requested
    }

    /// A fresh optimizer for `len` parameters, as the config says.
    pub(crate) fn optimizer(&self, len: usize) -> Optimizer {
        match &self.rule {
            Some(rule) => Optimizer::with_rule(rule.clone(), len),
            None => Optimizer::new(&optimizer_spec(self.cfg), len),
        }
    }

    /// Collective, when resuming was asked for: finds the newest good checkpoint (a whole-model
    /// file or a sharded set) and has `load` put it into the caller's buffers (with the
    /// optimizer steps it holds); sets and returns the step to continue from (0: none, or not
    /// resuming).
    pub(crate) fn resume(
        &mut self,
        comm: &mut Communicator,
        load: &mut LoadCheckpoint<'_>,
    ) -> Result<u64, TrainError> {
        if !self.resume_requested {
            return Ok(0);
        }
        let found = find_checkpoint(comm, &self.ckpt_dir, &self.identity, &mut *self.on_event)?;
        let step = match found {
            Some((step, optimizer_steps, found)) => {
                load(comm, found, &self.ckpt_dir, optimizer_steps)?;
                step
            }
            None => 0,
        };
        self.start_step = step;
        if step > 0 && self.rank == 0 {
            (self.on_event)(Event::Resumed(step));
        }
        if step > 0 && step >= self.total_steps {
            // Every step is done: the summary still needs the last training loss (from
            // metrics.jsonl, which holds every step up to a checkpoint) and the final evaluation.
            self.resumed_at_end = true;
            let mut loss = [f64::NAN];
            if self.rank == 0 {
                loss[0] = recorded_loss(self.out_dir, step - 1);
                self.notice(format!(
                    "every step was done before this attempt: evaluating the model of step \
                     {step} again for the summary"
                ));
            }
            comm.broadcast(&mut loss, 0)?;
            self.last_loss = loss[0];
        }
        Ok(step)
    }

    /// Did [`Ledger::resume`] find every step done, so that the loop runs no step and owes the
    /// summary the final evaluation ([`Ledger::final_evaluation`])?
    pub(crate) fn final_evaluation_owed(&self) -> bool {
        self.resumed_at_end
    }

    /// The final evaluation, run again after a resume at the end.
    pub(crate) fn final_evaluation(&mut self, eval: Eval) {
        self.evaluated(self.total_steps, &eval);
        self.evals.push((self.total_steps, eval));
    }

    /// Tell the caller (rank 0) of the evaluation after `step` steps.
    fn evaluated(&mut self, step: u64, eval: &Eval) {
        if self.rank == 0 {
            (self.on_event)(Event::Evaluated {
                step,
                eval: eval.clone(),
            });
        }
    }

    /// The learning rate of `step`.
    pub(crate) fn lr(&self, step: u64) -> f32 {
        self.schedule.lr(step)
    }

    /// Is a checkpoint written after `step`?
    pub(crate) fn checkpoint_due(&self, step: u64) -> bool {
        checkpoint_due(self.cfg, step, self.total_steps)
    }

    /// Is the model evaluated after `step`? Every `train.eval_every` steps and after the last.
    pub(crate) fn eval_due(&self, step: u64) -> bool {
        let every = self.cfg.train.eval_every;
        (every > 0 && (step + 1).is_multiple_of(every)) || step + 1 == self.total_steps
    }

    /// Rank 0, before the step's record: take the checkpoint after `step` of the whole model —
    /// written under a temporary name now, or kept for the background writer (which first
    /// finishes the previous write). [`Ledger::record_step`] then flushes metrics.jsonl and
    /// [`Ledger::release_checkpoint`] publishes it.
    pub(crate) fn take_checkpoint(
        &mut self,
        step: u64,
        params: Cow<'_, [f32]>,
        optimizer_state: Vec<Cow<'_, [f32]>>,
        optimizer_steps: u64,
    ) -> Result<(), TrainError> {
        let c = CheckpointView {
            step: step + 1,
            params,
            optimizer_state,
            optimizer_steps,
            identity: &self.identity,
        };
        self.writer.take(c, &mut *self.on_event)
    }

    /// Rank 0, before the step's record: take the checkpoint after `step` from the training
    /// loop's own vectors, where they are the whole model (one stage, no tensor parallelism, ZeRO
    /// 0) — written from them now, or held (not copied) for the background writer; as
    /// [`Ledger::take_checkpoint`] otherwise.
    pub(crate) fn take_shared_checkpoint(
        &mut self,
        step: u64,
        vectors: SharedVectors,
        optimizer_steps: u64,
    ) -> Result<(), TrainError> {
        let held = Held::Shared {
            step: step + 1,
            vectors,
            optimizer_steps,
            identity: self.identity.clone(),
        };
        self.writer.take_held(held, &mut *self.on_event)
    }

    /// Collective over the world, with `checkpoint.sharded`: every rank writes its shard of the
    /// checkpoint after `step` (`shard`), staged until [`Ledger::release_checkpoint`] publishes
    /// the set on rank 0, as [`Ledger::take_checkpoint`] does with a whole-model file. With
    /// `checkpoint.async` each rank's shard is written by a thread of its own that holds the
    /// shard's vectors (after the previous set is settled), and [`Ledger::settle_set`]
    /// publishes it at a later step; the fence returned then opens when the write lets go of
    /// the vectors, which the training loop waits for before it updates them.
    pub(crate) fn take_sharded_checkpoint(
        &mut self,
        comm: &mut Communicator,
        step: u64,
        shard: SharedShard,
        optimizer_steps: u64,
        num_params: usize,
    ) -> Result<Option<WriteFence>, TrainError> {
        let counts = SetCounts {
            optimizer_steps,
            num_params,
            vectors: 1 + shard.vectors.state.len(),
        };
        if self.cfg.checkpoint.background {
            // One set in the background at a time: the previous one is settled first.
            self.settle_set(comm)?;
            let (dir, id, faults) = (&self.ckpt_dir, &self.identity, self.faults);
            let pending = start_set(comm, dir, step + 1, id, shard, counts, faults)?;
            let fence = pending.fence();
            self.pending_set = Some(pending);
            return Ok(Some(fence));
        }
        let (dir, id, faults) = (&self.ckpt_dir, &self.identity, self.faults);
        let staged = write_set(comm, dir, step + 1, id, &shard.view(), counts, faults)?;
        if let Some(staged) = staged {
            self.writer.take_set(staged);
        }
        Ok(None)
    }

    /// Whether a sharded set is being written in the background.
    pub(crate) fn set_pending(&self) -> bool {
        self.pending_set.is_some()
    }

    /// Collective, on every rank at the same step (one after the set's, or the next checkpoint,
    /// or the end): the sharded set written in the background since an earlier step waited for,
    /// every rank's outcome learnt, and the set published by rank 0 (its step's record was
    /// flushed when it was taken). Nothing when none is pending.
    pub(crate) fn settle_set(&mut self, comm: &mut Communicator) -> Result<(), TrainError> {
        let Some(pending) = self.pending_set.take() else {
            return Ok(());
        };
        if let Some(staged) = settle_set(comm, &self.ckpt_dir, &self.identity, pending)? {
            self.writer.take_set(staged);
            self.writer.release(&mut *self.on_event)?;
        }
        Ok(())
    }

    /// After the record of a checkpoint step is flushed: publish the checkpoint taken, or start
    /// writing it in the background (nothing when none was taken, e.g. on other ranks).
    pub(crate) fn release_checkpoint(&mut self) -> Result<(), TrainError> {
        self.writer.release(&mut *self.on_event)
    }

    /// After a step's evaluation: keep its record (and evaluation), and when a checkpoint is due
    /// append to metrics.jsonl (collective then). Called before that checkpoint is written, so
    /// that a checkpoint on disk always has every step up to it in metrics.jsonl: a run that
    /// fails between the two (a full disk, a kill) resumes from the previous checkpoint and
    /// records the missing steps again. [`Ledger::step_done`] follows the checkpoint.
    pub(crate) fn record_step(
        &mut self,
        comm: &mut Communicator,
        mut record: StepRecord,
        checkpoint_due: bool,
    ) -> Result<(), TrainError> {
        record.rss_bytes = current_rss_bytes();
        if let Some(e) = &record.eval {
            self.evaluated(record.step + 1, e);
            self.evals.push((record.step + 1, e.clone()));
        }
        self.last_loss = record.loss;
        self.records.push(record);
        if checkpoint_due {
            self.metrics
                .flush(comm, &self.records, self.out_dir, self.start_step)?;
        }
        Ok(())
    }

    /// Report `step` done. Its `StepDone` (the launcher may regroup the job at a checkpoint
    /// boundary it reports) waits while a checkpoint is still being written in the background,
    /// and then reports the newest step done.
    pub(crate) fn step_done(&mut self, step: u64) -> Result<(), TrainError> {
        let point = StepPoint {
            done: step + 1,
            total_steps: self.total_steps,
            start_step: self.start_step,
            started: self.started,
            loss: self.last_loss,
        };
        let writing = self.writer.poll(&mut *self.on_event)? || self.pending_set.is_some();
        self.unreported = writing.then_some(step + 1);
        emit_progress(self.cfg, self.rank, &point, !writing, &mut *self.on_event);
        Ok(())
    }

    /// Wait for a checkpoint still being written in the background, and report the step held
    /// back for it.
    fn checkpoints_written(&mut self) -> Result<(), TrainError> {
        self.writer.wait(&mut *self.on_event)?;
        if let Some(done) = self.unreported.take() {
            if self.rank == 0 {
                (self.on_event)(Event::StepDone(done));
            }
        }
        Ok(())
    }

    /// Records how the run sums its gradients (`summary.json`'s `gradient_sum`).
    pub(crate) fn set_gradient_sum(&mut self, how: GradientSum) {
        self.gradient_sum = Some(how);
    }

    /// Records how ZeRO 3 gathers the stage's parameters (`summary.json`'s `param_gathering`)
    /// and, one layer at a time, how many layers ahead (`layers_prefetched`).
    pub(crate) fn set_param_gathering(
        &mut self,
        (how, prefetched): (ParamGathering, Option<usize>),
    ) {
        self.param_gathering = Some(how);
        self.layers_prefetched = prefetched;
    }

    /// Collective, at the end: every rank's records, host and memory (what `held` counts, with
    /// the most micro-batches this rank held at once) gathered, the summary built (with
    /// `pipeline`'s figures from all records and ranks, for a pipeline) and, on rank 0, written
    /// with the resolved config.
    pub(crate) fn finish(
        mut self,
        comm: &mut Communicator,
        param_hash: String,
        held: ModelState,
        pipeline: impl FnOnce(&[StepRecord], &mut [RankSummary]) -> Option<PipelineSummary>,
    ) -> Result<Summary, TrainError> {
        self.settle_set(comm)?;
        self.checkpoints_written()?;
        let peak_held = self
            .records
            .iter()
            .filter_map(|r| r.pipeline.map(|p| p.peak_activations))
            .max()
            .unwrap_or(1);
        let (all_records, mut ranks) = gather_run(
            comm,
            &mut self.metrics,
            &self.records,
            self.out_dir,
            self.start_step,
            (&self.host, &self.device),
            held.measure(peak_held),
        )?;
        let pipeline = pipeline(&all_records, &mut ranks);
        let sections = self.job.sections;
        let end = RunEnd {
            started: self.started,
            start_step: self.start_step,
            total_steps: self.total_steps,
            last_loss: self.last_loss,
            evals: self.evals,
            param_hash,
            gradient_sum: self.gradient_sum,
            param_gathering: self.param_gathering,
            layers_prefetched: self.layers_prefetched,
            plan: self.plan,
            job: self.job,
        };
        let summary = build_summary(
            self.cfg,
            comm,
            end,
            &all_records,
            ranks,
            pipeline,
            &mut *self.on_event,
        );
        if self.rank == 0 {
            write_outputs(self.out_dir, self.cfg, sections, &summary)?;
        }
        Ok(summary)
    }
}
