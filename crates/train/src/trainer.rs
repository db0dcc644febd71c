//! The data-parallel training loop, run by every rank.
//!
//! Per step: the global batch (a function of seed and step only) is cut into fixed micro-batches;
//! this rank computes the gradients of its contiguous share of them; [`GradSync`] combines all
//! micro-batch gradients; every rank applies the same optimizer update to the same parameters, so
//! replicas never drift (checked at the end by comparing parameter hashes across ranks).

use std::ops::Range;
use std::path::Path;
use std::time::Instant;

use lockstep_comm::exact::ExactError;
use lockstep_comm::{CommError, Communicator, ReduceOp};
use lockstep_data::{assign, microbatches, Dataset, Sampler};
use lockstep_model::{param_hash, LrSchedule, ModelSpec, Optimizer, OptimizerSpec, TimedLoss};

use crate::checkpoint::{self, Checkpoint, CheckpointError, Identity};
use crate::config::TrainConfig;
use crate::faults::{self, Fault};
use crate::grad_sync::{GradSync, StreamedCompute, SyncError};
use crate::job::{catch_job_panic, JobSpec, Replica, ReplicaError, Trainable};
use crate::metrics::{Eval, PhaseSeconds, StepRecord, Summary};
use crate::run_end::{build_summary, emit_progress, gather_run, RunEnd, StepPoint};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("gradient synchronisation at step {step}: {cause}")]
    Sync { step: u64, cause: ExactError },
    #[error(transparent)]
    Data(#[from] lockstep_data::DataError),
    #[error(transparent)]
    Model(#[from] lockstep_model::ModelError),
    #[error("model structure differs between ranks: rank {rank} has {theirs}, rank 0 has {ours} (same config and binary on every worker?)")]
    ModelMismatch {
        rank: usize,
        theirs: String,
        ours: String,
    },
    #[error(
        "replicas diverged: rank {rank} ended with parameter hash {theirs}, rank 0 with {ours}"
    )]
    Diverged {
        rank: usize,
        theirs: String,
        ours: String,
    },
    #[error(
        "dataset `{dataset}` has {have} training samples, fewer than one global batch (train.global_batch = {need})"
    )]
    TooSmall {
        dataset: String,
        have: usize,
        need: usize,
    },
    #[error(
        "dataset `{dataset}`: the validation text has {chars} characters, too short for one \
         window of model.context = {context} characters (it needs at least {})",
        context + 1
    )]
    ValidationTooShort {
        dataset: String,
        chars: usize,
        context: usize,
    },
    #[error("writing {path}: {cause}")]
    Io { path: String, cause: std::io::Error },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("rank 0 could not load the checkpoint to resume from (see its error)")]
    ResumeFailed,
    #[error("job `{job}`: opening the {split} data: {message}")]
    JobData {
        job: String,
        split: &'static str,
        message: String,
    },
    #[error("job `{job}`: {message}")]
    JobSetup { job: String, message: String },
    #[error("job `{job}`, step {step}, micro-batch {microbatch} (samples {first}..{end} of the global batch): {cause}", step = step + 1, first = samples.start, end = samples.end)]
    Job {
        job: String,
        /// Counting from 0 (shown from 1, as in the progress lines).
        step: u64,
        microbatch: usize,
        samples: std::ops::Range<usize>,
        cause: ReplicaError,
    },
    #[error("job `{job}`, evaluation after step {step}: {cause}")]
    JobEval {
        job: String,
        step: u64,
        cause: ReplicaError,
    },
}

impl TrainError {
    /// Failures that a restart cannot cure: the input is wrong (config, data, model, a checkpoint
    /// of another run) or the disk is full. The launcher ends the job instead of retrying.
    pub fn is_permanent(&self) -> bool {
        match self {
            TrainError::Data(_)
            | TrainError::Config(_)
            | TrainError::Model(_)
            | TrainError::ModelMismatch { .. }
            | TrainError::TooSmall { .. }
            | TrainError::ValidationTooShort { .. }
            | TrainError::ResumeFailed
            | TrainError::JobData { .. }
            | TrainError::JobSetup { .. }
            | TrainError::Job { .. }
            | TrainError::JobEval { .. }
            | TrainError::Checkpoint(CheckpointError::Mismatch { .. })
            | TrainError::Checkpoint(CheckpointError::NoSpace { .. }) => true,
            TrainError::Io { cause, .. } => crate::files::is_no_space(cause),
            _ => false,
        }
    }
}

/// A progress report for the terminal (rank 0 only).
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub step: u64,
    pub total_steps: u64,
    pub loss: f64,
    pub samples_per_sec: f64,
    pub eta_seconds: f64,
}

/// What the loop tells its caller (rank 0 only, except `Notice`).
#[derive(Debug, Clone)]
pub enum Event {
    /// Every `train.log_every` steps.
    Progress(Progress),
    /// A step completed (its number, counting from 1).
    StepDone(u64),
    /// Training continues from the checkpoint of this step.
    Resumed(u64),
    /// Something worth a log line (damaged checkpoint skipped, straggler, …).
    Notice(String),
}

/// Everything the loop needs that is not in the config.
pub struct WorkerContext<'a> {
    pub comm: &'a mut Communicator,
    /// Host name of this rank (for the summary).
    pub host: String,
    /// Run directory; only rank 0 writes to it (outputs and checkpoints).
    pub out_dir: &'a Path,
    pub on_event: &'a mut dyn FnMut(Event),
    /// Continue from the newest good checkpoint, if there is one.
    pub resume: bool,
    /// Deliberately injected faults (tests, demonstrations).
    pub faults: &'a [Fault],
}

pub fn model_spec(cfg: &TrainConfig, data: &Dataset) -> ModelSpec {
    let [c, h, w] = data.shape;
    match cfg.model.kind.as_str() {
        "cnn" => ModelSpec::Cnn {
            channels: c,
            height: h,
            width: w,
            conv: cfg.model.conv.clone(),
            hidden: cfg.model.cnn_hidden,
            classes: data.classes,
        },
        _ => ModelSpec::Mlp {
            input: c * h * w,
            hidden: cfg.model.hidden.clone(),
            classes: data.classes,
        },
    }
}

pub fn optimizer_spec(cfg: &TrainConfig) -> OptimizerSpec {
    let o = &cfg.optimizer;
    match o.kind.as_str() {
        "adamw" => OptimizerSpec::AdamW {
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
        },
        _ => OptimizerSpec::Sgd {
            momentum: o.momentum,
            weight_decay: o.weight_decay,
            nesterov: o.nesterov,
        },
    }
}

/// Step records reserved up front (more are added as the run goes; a run's length is no reason
/// to allocate its records before the first step).
pub(crate) const RECORDS_RESERVED: usize = 4096;

/// Steps of the run: `train.steps`, or `train.epochs` passes over a dataset the sampler covers —
/// refused, naming `train.epochs`, when that is more than [`crate::limits::MAX_STEPS`].
pub(crate) fn total_steps(cfg: &TrainConfig, sampler: &Sampler) -> Result<u64, TrainError> {
    let t = &cfg.train;
    if t.steps > 0 {
        return Ok(t.steps);
    }
    let per_epoch = sampler.steps_per_epoch() as u64;
    match t.epochs.checked_mul(per_epoch) {
        Some(n) if n <= crate::limits::MAX_STEPS => Ok(n),
        _ => Err(crate::config::ConfigError::Invalid {
            field: "train.epochs",
            message: format!(
                "{} epochs of {per_epoch} steps exceed the limit of {} steps",
                t.epochs,
                crate::limits::MAX_STEPS
            ),
        }
        .into()),
    }
}

/// Is a checkpoint written after `step` (counting from 0)? Every `checkpoint.every` steps, and
/// after the last step, so that a finished run can be extended from where it ended.
pub(crate) fn checkpoint_due(cfg: &TrainConfig, step: u64, total_steps: u64) -> bool {
    let every = cfg.checkpoint.every;
    every > 0 && ((step + 1) % every == 0 || step + 1 == total_steps)
}

/// Train `job` according to `cfg` as one rank of `ctx.comm`. Returns the summary (complete on
/// rank 0; other ranks return it too, with the same global figures).
pub fn train(
    job: &dyn JobSpec,
    cfg: &TrainConfig,
    ctx: WorkerContext<'_>,
) -> Result<Summary, TrainError> {
    let name = job.name();
    let built = catch_job_panic(|| job.build(cfg)).map_err(|p| TrainError::JobSetup {
        job: name.clone(),
        message: format!("opening the job panicked: {p}"),
    })??;
    match built {
        // Layered model: the pipeline loop (one stage when parallel.pp = 1).
        Trainable::BuiltinTransformer => crate::pipeline::train::train(cfg, ctx),
        Trainable::Replica(replica) => train_replica(&name, replica, cfg, ctx),
    }
}

/// What stays fixed over a data-parallel run.
struct Plan<'a> {
    job: &'a str,
    sampler: Sampler,
    n_micro: usize,
    /// This rank's micro-batches (indices into each step's list).
    mine: Range<usize>,
    scale: f32,
    /// Flat ranges of the parameter tensors (for streaming).
    tensors: Vec<Range<usize>>,
}

/// The data-parallel loop over one rank's replica of a job (see the module doc).
fn train_replica(
    job: &str,
    mut replica: Box<dyn Replica + '_>,
    cfg: &TrainConfig,
    ctx: WorkerContext<'_>,
) -> Result<Summary, TrainError> {
    let WorkerContext {
        comm,
        host,
        out_dir,
        on_event,
        resume,
        faults,
    } = ctx;
    let started = Instant::now();
    let (rank, world) = (comm.rank(), comm.size());
    let t = &cfg.train;
    let setup = |message: String| TrainError::JobSetup {
        job: job.to_string(),
        message,
    };
    if replica.train_len() < t.global_batch {
        return Err(TrainError::TooSmall {
            dataset: job.to_string(),
            have: replica.train_len(),
            need: t.global_batch,
        });
    }
    if replica.eval_len() == 0 {
        return Err(setup("the evaluation dataset is empty".into()));
    }
    if cfg.dist.overlap && !replica.streams_gradients() {
        return Err(crate::config::ConfigError::Invalid {
            field: "dist.overlap",
            message: format!(
                "job `{job}` does not stream gradients during backward \
                 (Replica::loss_and_grad_streaming); set dist.overlap = false"
            ),
        }
        .into());
    }
    let sampler = Sampler::new(replica.train_len(), t.global_batch, t.seed)?;
    let total_steps = total_steps(cfg, &sampler)?;
    let n_micro = cfg.microbatches_per_step();

    check_same_structure(comm, replica.structure_hash())?;
    let mut params = replica.params_flat();
    comm.broadcast(&mut params, 0)?;
    replica
        .set_params_flat(&params)
        .map_err(|e| setup(e.to_string()))?;

    let mut optimizer = Optimizer::new(&optimizer_spec(cfg), params.len());
    let identity = Identity {
        config: cfg.identity_hash(),
        model: hex::encode(replica.structure_hash()),
    };
    let ckpt_dir = checkpoint_dir(cfg, out_dir);
    let start_step = if resume {
        resume_from_checkpoint(
            comm,
            &ckpt_dir,
            &identity,
            &mut params,
            &mut optimizer,
            on_event,
        )?
    } else {
        0
    };
    if start_step > 0 {
        replica
            .set_params_flat(&params)
            .map_err(|e| setup(e.to_string()))?;
        if rank == 0 {
            on_event(Event::Resumed(start_step));
        }
    }
    let slowdown = faults::slowdown(faults, rank);
    let schedule = LrSchedule {
        base_lr: t.lr,
        warmup_steps: t.warmup_steps,
        total_steps,
        min_lr: t.min_lr,
    };
    let plan = Plan {
        job,
        sampler,
        n_micro,
        mine: assign(n_micro, world, rank),
        scale: 1.0 / t.global_batch as f32,
        tensors: replica
            .layout()
            .iter()
            .map(|p| p.offset..p.offset + p.len)
            .collect(),
    };
    let mut sync = GradSync::new(cfg.dist.reproducible, cfg.dist.bucket_elems);
    let mut grads: Vec<Vec<f32>> = vec![vec![0f32; params.len()]; plan.mine.len()];
    let mut total_grad = vec![0f32; params.len()];
    let mut records = Vec::with_capacity(RECORDS_RESERVED);
    // Every rank's records, gathered at each checkpoint (and at the end) and appended to
    // metrics.jsonl by rank 0, so a crash loses only steps that will be recomputed anyway.
    let mut metrics = MetricsLog::new();
    let mut last_loss = f64::NAN;
    let mut evals = Vec::new();

    for step in start_step..total_steps {
        faults::at_step(faults, rank, step);
        let step_start = Instant::now();
        let bytes_before = comm.stats().bytes_sent;
        let (loss, mut sec) = gradients(
            cfg,
            &plan,
            step,
            &mut *replica,
            comm,
            &mut sync,
            &mut grads,
            &mut total_grad,
        )?;
        if slowdown > 1.0 {
            // An injected straggler: its computation takes `slowdown` times as long.
            let extra = (sec.forward + sec.backward) * (slowdown - 1.0);
            std::thread::sleep(std::time::Duration::from_secs_f64(extra));
            sec.backward += extra;
        }

        let t0 = Instant::now();
        let lr = schedule.lr(step);
        optimizer.step(&mut params, &total_grad, lr);
        replica
            .set_params_flat(&params)
            .map_err(|e| setup(e.to_string()))?;
        sec.optimizer = t0.elapsed().as_secs_f64();
        let checkpoint_now = checkpoint_due(cfg, step, total_steps);
        if rank == 0 && checkpoint_now {
            let c = Checkpoint {
                step: step + 1,
                params: params.clone(),
                optimizer_state: optimizer.state().iter().map(|v| v.to_vec()).collect(),
                optimizer_steps: optimizer.steps_taken(),
                identity: identity.clone(),
            };
            // (the metrics flush below is collective, so it runs on every rank)
            save_checkpoint(cfg, &ckpt_dir, &c, faults, on_event)?;
        }

        let eval =
            if (t.eval_every > 0 && (step + 1) % t.eval_every == 0) || step + 1 == total_steps {
                let e = evaluate(comm, job, &mut *replica, step)?;
                evals.push((step + 1, e.clone()));
                Some(e)
            } else {
                None
            };
        let step_seconds = step_start.elapsed().as_secs_f64();
        last_loss = loss;
        records.push(StepRecord {
            rank,
            step,
            loss,
            lr,
            samples: plan.mine.len() * t.microbatch,
            samples_per_sec: t.global_batch as f64 / step_seconds,
            step_seconds,
            seconds: sec,
            bytes_sent: comm.stats().bytes_sent - bytes_before,
            eval,
            pipeline: None,
        });
        if checkpoint_now {
            metrics.flush(comm, &records, out_dir, start_step)?;
        }
        let point = StepPoint {
            done: step + 1,
            total_steps,
            start_step,
            started,
            loss,
        };
        emit_progress(cfg, rank, &point, on_event);
    }

    let hash = param_hash(&params);
    check_same_hash(comm, &hash)?;
    let (all_records, ranks) =
        gather_run(comm, &mut metrics, &records, out_dir, start_step, &host)?;
    let end = RunEnd {
        started,
        start_step,
        total_steps,
        last_loss,
        evals,
        param_hash: hash,
    };
    let summary = build_summary(cfg, comm, end, &all_records, ranks, None, on_event);
    if rank == 0 {
        write_outputs(out_dir, cfg, &summary)?;
    }
    Ok(summary)
}

/// One step's gradient: this rank's micro-batches computed, every rank's summed into
/// `total_grad` (exactly, in reproducible mode). Returns the global loss and the phase timings.
#[allow(clippy::too_many_arguments)]
fn gradients(
    cfg: &TrainConfig,
    plan: &Plan<'_>,
    step: u64,
    replica: &mut dyn Replica,
    comm: &mut Communicator,
    sync: &mut GradSync,
    grads: &mut [Vec<f32>],
    total_grad: &mut [f32],
) -> Result<(f64, PhaseSeconds), TrainError> {
    let t = &cfg.train;
    let mut sec = PhaseSeconds::default();
    let batch = plan.sampler.global_batch(step);
    let pieces = microbatches(&batch, t.microbatch);
    let job_error = |k: usize, cause: ReplicaError| TrainError::Job {
        job: plan.job.to_string(),
        step,
        microbatch: k,
        samples: k * t.microbatch..(k + 1) * t.microbatch,
        cause,
    };
    let mine = plan.mine.clone();
    // With overlap, the last local micro-batch is computed inside the synchronisation (its
    // backward streams gradients to the communication thread); the others are computed here.
    let streamed = usize::from(cfg.dist.overlap && !mine.is_empty());
    let mut losses = Vec::with_capacity(mine.len());
    for (slot, k) in mine.clone().enumerate().take(mine.len() - streamed) {
        let c = replica
            .loss_and_grad(pieces[k], plan.scale, &mut grads[slot])
            .map_err(|e| job_error(k, e))?;
        sec.data += c.data_seconds;
        sec.forward += c.forward_seconds;
        sec.backward += c.backward_seconds;
        losses.push(c.loss);
    }
    let sync_error = |source: SyncError| match source {
        SyncError::Exact(ExactError::Comm(c)) => TrainError::Comm(c),
        SyncError::Exact(other) => TrainError::Sync { step, cause: other },
        SyncError::Model(m) => job_error(mine.end - 1, m.into()),
        SyncError::Replica(r) => job_error(mine.end - 1, r),
    };
    let (loss, timing) = if cfg.dist.overlap {
        let (earlier, rest) = grads.split_at_mut(mine.len() - streamed);
        let mut compute = ReplicaCompute {
            replica,
            samples: pieces.get(mine.end.wrapping_sub(1)).copied().unwrap_or(&[]),
            scale: plan.scale,
            data_seconds: 0.0,
        };
        let last = rest
            .first_mut()
            .map(|grad| (&mut compute as &mut dyn StreamedCompute, grad.as_mut_slice()));
        let earlier: Vec<&[f32]> = earlier.iter().map(|g| g.as_slice()).collect();
        let o = sync
            .sync_streamed(
                comm,
                &plan.tensors,
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
        let grad_refs: Vec<&[f32]> = grads.iter().map(|g| g.as_slice()).collect();
        sync.sync(comm, &grad_refs, &losses, plan.n_micro, total_grad)
            .map_err(|e| sync_error(SyncError::Exact(e)))?
    };
    sec.waiting = timing.waiting;
    sec.communication = timing.communication;
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

/// Shard the evaluation set over ranks (contiguous shares, chunks of 512); sum the loss and the
/// job's metrics over all ranks. `accuracy`, when the job reports it, is the test accuracy.
fn evaluate(
    comm: &mut Communicator,
    job: &str,
    replica: &mut dyn Replica,
    step: u64,
) -> Result<Eval, TrainError> {
    let total = replica.eval_len();
    let shard = assign(total, comm.size(), comm.rank());
    let idx: Vec<u32> = (shard.start as u32..shard.end as u32).collect();
    let mut loss = 0f64;
    let mut named: Vec<(String, f64)> = Vec::new();
    let eval_error = |cause| TrainError::JobEval {
        job: job.to_string(),
        step: step + 1,
        cause,
    };
    for chunk in idx.chunks(512) {
        let sums = replica.evaluate(chunk).map_err(eval_error)?;
        loss += sums.loss;
        if named.is_empty() {
            named = sums.metrics;
        } else {
            for ((name, v), (other, add)) in named.iter_mut().zip(sums.metrics) {
                if *name != other {
                    return Err(eval_error(ReplicaError::Other(format!(
                        "metrics must be the same names in the same order on every batch \
                         (`{name}` then `{other}`)"
                    ))));
                }
                *v += add;
            }
        }
    }
    // Every rank must report the same metric names (a rank with an empty shard reports none):
    // the names travel with the sums.
    let names = gather_strings(
        comm,
        &named
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join("\n"),
    )?;
    let reference = names
        .iter()
        .find(|n| !n.is_empty())
        .cloned()
        .unwrap_or_default();
    let metric_names: Vec<&str> = if reference.is_empty() {
        Vec::new()
    } else {
        reference.split('\n').collect()
    };
    let mut sums = vec![0f64; 1 + metric_names.len()];
    sums[0] = loss;
    if !named.is_empty() {
        if named.len() != metric_names.len()
            || named.iter().zip(&metric_names).any(|((a, _), b)| a != b)
        {
            return Err(eval_error(ReplicaError::Other(
                "ranks report different metric names".into(),
            )));
        }
        for (i, (_, v)) in named.iter().enumerate() {
            sums[1 + i] = *v;
        }
    }
    comm.all_reduce(&mut sums, ReduceOp::Sum)?;
    let n = total.max(1) as f64;
    let mut metrics: std::collections::BTreeMap<String, f64> = metric_names
        .iter()
        .zip(&sums[1..])
        .map(|(name, v)| (name.to_string(), v / n))
        .collect();
    let test_accuracy = metrics.remove("accuracy").unwrap_or(f64::NAN);
    Ok(Eval {
        test_loss: sums[0] / n,
        test_accuracy,
        metrics,
    })
}

/// All ranks must build the same model: compare everyone's structure hash with rank 0's.
pub(crate) fn check_same_structure(
    comm: &mut Communicator,
    mine: [u8; 32],
) -> Result<(), TrainError> {
    let mut all = vec![0u8; 32 * comm.size()];
    comm.all_gather(&mine[..], &mut all)?;
    let ours = hex::encode(&all[..32]);
    for (rank, h) in all.chunks(32).enumerate() {
        if h != &all[..32] {
            return Err(TrainError::ModelMismatch {
                rank,
                theirs: hex::encode(h),
                ours,
            });
        }
    }
    Ok(())
}

fn check_same_hash(comm: &mut Communicator, hash_hex: &str) -> Result<(), TrainError> {
    let hashes = gather_strings(comm, hash_hex)?;
    for (rank, h) in hashes.iter().enumerate() {
        if h != &hashes[0] {
            return Err(TrainError::Diverged {
                rank,
                theirs: h.clone(),
                ours: hashes[0].clone(),
            });
        }
    }
    Ok(())
}

/// All-gather one variable-length byte string per rank.
pub(crate) fn gather_bytes(
    comm: &mut Communicator,
    mine: &[u8],
) -> Result<Vec<Vec<u8>>, TrainError> {
    let n = comm.size();
    let mut lens = vec![0i64; n];
    comm.all_gather(&[mine.len() as i64], &mut lens)?;
    let max = lens.iter().copied().max().unwrap_or(0) as usize;
    let mut padded = mine.to_vec();
    padded.resize(max, 0);
    let mut all = vec![0u8; max * n];
    comm.all_gather(&padded, &mut all)?;
    Ok((0..n)
        .map(|r| all[r * max..r * max + lens[r] as usize].to_vec())
        .collect())
}

pub(crate) fn gather_strings(
    comm: &mut Communicator,
    mine: &str,
) -> Result<Vec<String>, TrainError> {
    Ok(gather_bytes(comm, mine.as_bytes())?
        .into_iter()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .collect())
}

fn gather_records(
    comm: &mut Communicator,
    mine: &[StepRecord],
) -> Result<Vec<StepRecord>, TrainError> {
    let bytes = serde_json::to_vec(mine).expect("records serialise");
    let mut all = Vec::new();
    for b in gather_bytes(comm, &bytes)? {
        let recs: Vec<StepRecord> =
            serde_json::from_slice(&b).expect("records from our own ranks parse");
        all.extend(recs);
    }
    all.sort_by_key(|r| (r.step, r.rank));
    Ok(all)
}

/// `metrics.jsonl`, written incrementally.
pub(crate) struct MetricsLog {
    /// All ranks' records of this attempt gathered so far, by (step, rank).
    gathered: Vec<StepRecord>,
    /// How many of this rank's records were already gathered.
    flushed: usize,
    /// Whether this attempt has rewritten the file yet.
    started: bool,
}

impl MetricsLog {
    /// Collective: gather every rank's new records; rank 0 appends them to metrics.jsonl. The
    /// first flush of an attempt rewrites the file keeping only the earlier attempts' lines for
    /// steps before `start_step`, so the file stays one continuous curve across restarts.
    pub(crate) fn new() -> Self {
        MetricsLog {
            gathered: Vec::new(),
            flushed: 0,
            started: false,
        }
    }

    /// All ranks' records of this attempt gathered so far.
    pub(crate) fn gathered(&self) -> &[StepRecord] {
        &self.gathered
    }

    pub(crate) fn flush(
        &mut self,
        comm: &mut Communicator,
        mine: &[StepRecord],
        dir: &Path,
        start_step: u64,
    ) -> Result<(), TrainError> {
        let new = gather_records(comm, &mine[self.flushed..])?;
        self.flushed = mine.len();
        if comm.rank() == 0 {
            let path = dir.join("metrics.jsonl");
            let io = |source| TrainError::Io {
                path: path.display().to_string(),
                cause: source,
            };
            std::fs::create_dir_all(dir).map_err(io)?;
            let mut lines = Vec::new();
            if !self.started {
                if start_step > 0 {
                    for line in std::fs::read_to_string(&path).unwrap_or_default().lines() {
                        if serde_json::from_str::<StepRecord>(line)
                            .is_ok_and(|r| r.step < start_step)
                        {
                            lines.extend_from_slice(line.as_bytes());
                            lines.push(b'\n');
                        }
                    }
                }
            } else {
                lines = std::fs::read(&path).map_err(io)?;
            }
            for r in &new {
                serde_json::to_writer(&mut lines, r).expect("record serialises");
                lines.push(b'\n');
            }
            write_atomic(&path, &lines)?;
        }
        self.started = true;
        self.gathered.extend(new);
        Ok(())
    }
}

pub(crate) fn write_outputs(
    dir: &Path,
    cfg: &TrainConfig,
    summary: &Summary,
) -> Result<(), TrainError> {
    std::fs::create_dir_all(dir).map_err(|source| TrainError::Io {
        path: dir.display().to_string(),
        cause: source,
    })?;
    write_atomic(&dir.join("config.toml"), cfg.to_toml().as_bytes())?;
    let mut s = serde_json::to_vec_pretty(summary).expect("summary serialises");
    s.push(b'\n');
    write_atomic(&dir.join("summary.json"), &s)?;
    Ok(())
}

pub use crate::files::write_atomic;

/// Where checkpoints live: `checkpoint.dir`, or `<run dir>/checkpoints`.
pub fn checkpoint_dir(cfg: &TrainConfig, out_dir: &Path) -> std::path::PathBuf {
    if cfg.checkpoint.dir.is_empty() {
        out_dir.join("checkpoints")
    } else {
        std::path::PathBuf::from(&cfg.checkpoint.dir)
    }
}

/// Rank 0 loads the newest good checkpoint and broadcasts it; returns the step to continue
/// from (0 when there is none). Only rank 0 reads files, so node 0's disk is enough.
pub(crate) fn resume_from_checkpoint(
    comm: &mut Communicator,
    dir: &Path,
    identity: &Identity,
    params: &mut [f32],
    optimizer: &mut Optimizer,
    on_event: &mut dyn FnMut(Event),
) -> Result<u64, TrainError> {
    // status: 0 = nothing to resume from, 1 = found, 2 = rank 0 failed.
    let mut header = [0i64; 3];
    let mut loaded = Ok(None);
    if comm.rank() == 0 {
        loaded = checkpoint::load_latest(dir, identity).map(|(c, skipped)| {
            for (path, why) in skipped {
                on_event(Event::Notice(format!(
                    "skipping damaged checkpoint {}: {why}",
                    path.display()
                )));
            }
            c
        });
        header = match &loaded {
            Ok(Some(c)) => [1, c.step as i64, c.optimizer_steps as i64],
            Ok(None) => [0, 0, 0],
            Err(_) => [2, 0, 0],
        };
    }
    comm.broadcast(&mut header, 0)?;
    match header[0] {
        0 => return Ok(0),
        2 => {
            return Err(loaded
                .err()
                .map(TrainError::Checkpoint)
                .unwrap_or(TrainError::ResumeFailed))
        }
        _ => {}
    }
    if let Ok(Some(c)) = &loaded {
        // Every state vector, not just their number: copy_from_slice panics on a length mismatch.
        let state: Vec<usize> = optimizer.state().iter().map(|v| v.len()).collect();
        c.check_sizes(dir, params.len(), &state)?;
        params.copy_from_slice(&c.params);
        for (dst, src) in optimizer.state_mut().into_iter().zip(&c.optimizer_state) {
            dst.copy_from_slice(src);
        }
    }
    comm.broadcast(params, 0)?;
    for v in optimizer.state_mut() {
        comm.broadcast(v, 0)?;
    }
    optimizer.set_steps_taken(header[2] as u64);
    Ok(header[1] as u64)
}

/// Rank 0: write checkpoint `c` atomically (keeping the newest `checkpoint.keep`), then damage it
/// if a `corrupt-checkpoint` fault is injected for its step.
pub(crate) fn save_checkpoint(
    cfg: &TrainConfig,
    dir: &Path,
    c: &Checkpoint,
    faults: &[Fault],
    on_event: &mut dyn FnMut(Event),
) -> Result<(), TrainError> {
    let path = checkpoint::save(dir, c, cfg.checkpoint.keep)?;
    if faults::corrupts_checkpoint(faults, c.step) {
        damage(&path)?;
        on_event(Event::Notice(format!(
            "injected fault: damaged checkpoint {}",
            path.display()
        )));
    }
    Ok(())
}

/// Flip one byte in the middle of a file (the `corrupt-checkpoint` fault).
fn damage(path: &Path) -> Result<(), TrainError> {
    let io = |source| TrainError::Io {
        path: path.display().to_string(),
        cause: source,
    };
    let mut bytes = std::fs::read(path).map_err(io)?;
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(path, bytes).map_err(io)
}
