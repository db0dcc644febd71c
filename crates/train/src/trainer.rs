//! The data-parallel training loop, run by every rank.
//!
//! Per step: the global batch (a function of seed and step only) is cut into fixed micro-batches;
//! this rank computes the gradients of its contiguous share of them; [`GradSync`] combines all
//! micro-batch gradients; every rank applies the same optimizer update to the same parameters, so
//! replicas never drift (checked at the end by comparing parameter hashes across ranks).

use std::ops::Range;
use std::time::Instant;

use lockstep_comm::exact::ExactError;
use lockstep_comm::{activity, Communicator};
use lockstep_data::{assign, microbatches, Sampler};
use lockstep_model::{param_hash, TimedLoss};

use crate::config::TrainConfig;
use crate::context::WorkerContext;
use crate::error::TrainError;
use crate::faults;
use crate::grad_parts::GradParts;
use crate::grad_sync::{GradSync, StreamedCompute, SyncError, SyncTiming};
use crate::job::{catch_job_panic, JobSpec, Replica, ReplicaError, Trainable};
use crate::memory::ModelState;
use crate::metrics::{Eval, GradientSum, PhaseSeconds, StepRecord, Summary};
use crate::run::collect::{check_same_hash, check_same_kernels, check_same_structure};
use crate::run::evaluation::{combine, EvalTotals};
use crate::run::schedule::total_steps;
use crate::run::Ledger;
use crate::zero::Zero;
use lockstep_run::{ModelShape, ParallelPlan};

/// Train `job` according to `cfg` as one rank of `ctx.comm`. Returns the summary (complete on
/// rank 0; other ranks return it too, with the same global figures).
pub fn train<'a>(
    job: &dyn JobSpec,
    cfg: &'a TrainConfig,
    ctx: WorkerContext<'a>,
) -> Result<Summary, TrainError> {
    let name = job.name();
    let built = catch_job_panic(|| job.build(cfg)).map_err(|p| TrainError::JobSetup {
        job: name.clone(),
        message: format!("opening the job panicked: {p}"),
    })??;
    // The plan, again from what the built model can do (the launcher made it from what the job
    // declared): every capability rule is `ParallelPlan`'s.
    let shape = match &built {
        Trainable::Layered(model) => ModelShape::Layered {
            layers: Some(model.num_layers()),
            tp_pieces: Some(model.tp_pieces()),
            pieces_from: match job.shape(cfg) {
                ModelShape::Layered { pieces_from, .. } if !pieces_from.is_empty() => pieces_from,
                _ => format!("job `{name}`'s tensor-parallel layers"),
            },
        },
        Trainable::Replica(replica) => match job.shape(cfg) {
            ModelShape::Flat { to_layer, .. } => ModelShape::Flat {
                streams_gradients: replica.streams_gradients(),
                to_layer,
            },
            layered => layered,
        },
    };
    let plan = ParallelPlan::new(cfg, ctx.comm.size(), &shape)?;
    match built {
        // Layered model: the pipeline loop (one stage when parallel.pp = 1).
        Trainable::Layered(model) => crate::pipeline::train::train(&*model, cfg, &plan, ctx),
        Trainable::Replica(replica) => train_replica(&name, replica, cfg, &plan, ctx),
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
fn train_replica<'a>(
    job: &str,
    mut replica: Box<dyn Replica + '_>,
    cfg: &'a TrainConfig,
    plan: &ParallelPlan,
    ctx: WorkerContext<'a>,
) -> Result<Summary, TrainError> {
    let started = Instant::now();
    let (rank, world) = (ctx.comm.rank(), ctx.comm.size());
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
    let sampler = Sampler::new(replica.train_len(), t.global_batch, t.seed)?;
    let total_steps = total_steps(cfg, &sampler)?;
    let n_micro = cfg.microbatches_per_step();

    let (comm, mut ledger) = Ledger::open(
        cfg,
        ctx,
        plan,
        replica.structure_hash(),
        total_steps,
        started,
    );
    check_same_structure(comm, replica.structure_hash())?;
    check_same_kernels(comm)?;
    let mut params = replica.params_flat();
    comm.broadcast(&mut params, 0)?;
    replica
        .set_params_flat(&params)
        .map_err(|e| setup(e.to_string()))?;
    // ZeRO: the optimizer state (and from level 2 the reduced gradient) sharded over the ranks.
    let zero = Zero::new(cfg.parallel.zero, params.len(), comm);
    let mut optimizer = ledger.optimizer(zero.optimizer_len());
    if ledger.resuming() {
        let mut whole = ledger.optimizer(params.len());
        if ledger.resume(comm, &mut params, &mut whole)? > 0 {
            optimizer = zero.shard_of(&whole, 0);
            replica
                .set_params_flat(&params)
                .map_err(|e| setup(e.to_string()))?;
        }
    }
    let faults = ledger.faults;
    let slowdown = faults::slowdown(faults, rank);
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
    // Exact sums that take every part at once read the peers' parts where they lie, when the
    // ranks share memory (`grad_parts`).
    let shared = cfg.dist.reproducible && !cfg.dist.overlap && zero.level() < 2;
    let mut grads = GradParts::new(comm, plan.mine.len(), params.len(), shared)?;
    ledger.set_gradient_sum(match (&grads, comm.size()) {
        (_, 1) => GradientSum::Local,
        (GradParts::Shared(_), _) => GradientSum::SharedWindows,
        (GradParts::Private(_), _) => GradientSum::Collectives,
    });
    // With shared windows the sum lands in this rank's window (`GradParts::sum`).
    let sum_len = if grads.sum().is_some() {
        0
    } else {
        zero.grad_len()
    };
    let mut total_grad = vec![0f32; sum_len];

    for step in ledger.start_step..total_steps {
        // Progress marks for the launcher's stall detection (lockstep_comm::activity).
        activity::touch();
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
            &zero,
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
        let lr = ledger.lr(step);
        let grad = grads.sum().unwrap_or(&total_grad);
        let gather_seconds = zero.step(&mut optimizer, &mut params, grad, lr, comm)?;
        replica
            .set_params_flat(&params)
            .map_err(|e| setup(e.to_string()))?;
        sec.optimizer = t0.elapsed().as_secs_f64() - gather_seconds;
        sec.communication += gather_seconds;
        let eval = if ledger.eval_due(step) {
            Some(evaluate(comm, job, &mut *replica, step)?)
        } else {
            None
        };
        let step_seconds = step_start.elapsed().as_secs_f64();
        let record = StepRecord {
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
            rss_bytes: None,
        };
        let checkpoint_now = ledger.checkpoint_due(step);
        ledger.record_step(comm, record, checkpoint_now)?;
        if checkpoint_now {
            // Collective when sharded: the optimizer state's chunks gathered whole.
            let state = zero.whole_state(&optimizer, comm)?;
            if rank == 0 {
                ledger.save_checkpoint(step, params.clone(), state, optimizer.steps_taken())?;
            }
        }
        ledger.step_done(step);
    }
    if ledger.final_evaluation_owed() {
        let eval = evaluate(comm, job, &mut *replica, total_steps - 1)?;
        ledger.final_evaluation(eval);
    }

    let hash = param_hash(&params);
    check_same_hash(comm, &hash)?;
    let held = ModelState::new(&params, &optimizer)
        .grads(grads.held().into_iter().chain([&total_grad[..]]))
        .exact_scratch(cfg.dist.reproducible, params.len())
        .activations_per_microbatch(replica.activation_bytes(t.microbatch));
    ledger.finish(comm, hash, held, |_, _| None)
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
    zero: &Zero,
    grads: &mut GradParts,
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
    let mut scanned_ahead = 0.0;
    for (slot, k) in mine.clone().enumerate().take(mine.len() - streamed) {
        activity::touch();
        let c = replica
            .loss_and_grad(pieces[k], plan.scale, grads.part_mut(slot))
            .map_err(|e| job_error(k, e))?;
        sec.data += c.data_seconds;
        sec.forward += c.forward_seconds;
        sec.backward += c.backward_seconds;
        losses.push(c.loss);
        if !cfg.dist.overlap {
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
    let (loss, timing) = if cfg.dist.overlap {
        let GradParts::Private(grads) = grads else {
            unreachable!("an overlapped sum keeps its parts private (GradParts::new)")
        };
        let (earlier, rest) = grads.split_at_mut(mine.len() - streamed);
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

/// Evaluation samples per chunk: a chunk's sums are computed in one call, in float, so chunks are
/// fixed whatever the world size and only whole chunks are shared out.
const EVAL_CHUNK: usize = 512;

/// Shard the evaluation set over ranks (contiguous shares of fixed chunks of [`EVAL_CHUNK`]
/// samples, so every chunk's sums have the same bits on any world size) and combine the loss and
/// the job's metrics over all ranks exactly (`run::evaluation`).
fn evaluate(
    comm: &mut Communicator,
    job: &str,
    replica: &mut dyn Replica,
    step: u64,
) -> Result<Eval, TrainError> {
    let total = replica.eval_len();
    let chunks = assign(total.div_ceil(EVAL_CHUNK), comm.size(), comm.rank());
    let shard = (chunks.start * EVAL_CHUNK).min(total)..(chunks.end * EVAL_CHUNK).min(total);
    let idx: Vec<u32> = (shard.start as u32..shard.end as u32).collect();
    let eval_error = |cause| TrainError::JobEval {
        job: job.to_string(),
        step: step + 1,
        cause,
    };
    let mut mine = EvalTotals::default();
    for chunk in idx.chunks(EVAL_CHUNK) {
        activity::touch();
        let sums = replica.evaluate(chunk).map_err(eval_error)?;
        mine.add(sums).map_err(eval_error)?;
    }
    combine(comm, mine, total as f64, job, step)
}
