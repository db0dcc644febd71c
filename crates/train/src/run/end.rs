//! What every training loop (data-parallel and pipeline) does per step for the terminal and once
//! at the end for the run's outputs: progress events, gathering all ranks' records, per-rank
//! totals, balance and straggler, and the [`Summary`].

use std::path::Path;
use std::time::Instant;

use lockstep_comm::Communicator;

use super::collect::{gather_memory, gather_strings};
use super::outputs::MetricsLog;
use crate::config::TrainConfig;
use crate::context::{Event, JobLabel, Progress};
use crate::error::TrainError;
use crate::memory::RankMemory;
use crate::metrics::{
    imbalance, imbalance_within_stages, rank_summaries, CheckpointSummary, ComputeSummary, Eval,
    GradientSum, ParamGathering, PipelineSummary, RankSummary, StepRecord, Summary,
};
use lockstep_run::ParallelPlan;

/// Where the run stands after a step, for [`emit_progress`].
pub(crate) struct StepPoint {
    /// Steps completed (counting from 1).
    pub done: u64,
    pub total_steps: u64,
    pub start_step: u64,
    pub started: Instant,
    pub loss: f64,
}

/// Rank 0: a `StepDone` event when `step_done` (held back while a checkpoint is written in the
/// background) and a `Progress` event every `train.log_every` steps (and at the last one).
pub(crate) fn emit_progress(
    cfg: &TrainConfig,
    rank: usize,
    p: &StepPoint,
    step_done: bool,
    on_event: &mut dyn FnMut(Event),
) {
    if rank != 0 {
        return;
    }
    if step_done {
        on_event(Event::StepDone(p.done));
    }
    if p.done.is_multiple_of(cfg.train.log_every) || p.done == p.total_steps {
        let elapsed = p.started.elapsed().as_secs_f64();
        let done = (p.done - p.start_step) as f64;
        on_event(Event::Progress(Progress {
            step: p.done,
            total_steps: p.total_steps,
            loss: p.loss,
            samples_per_sec: done * cfg.train.global_batch as f64 / elapsed,
            eta_seconds: elapsed / done * (p.total_steps - p.done) as f64,
        }));
    }
}

/// Collective: flush the last records to metrics.jsonl and gather every rank's records, host,
/// device and memory; returns all records of this attempt and the per-rank totals.
pub(crate) fn gather_run(
    comm: &mut Communicator,
    metrics: &mut MetricsLog,
    records: &[StepRecord],
    out_dir: &Path,
    start_step: u64,
    (host, device): (&str, &str),
    memory: RankMemory,
) -> Result<(Vec<StepRecord>, Vec<RankSummary>), TrainError> {
    metrics.flush(comm, records, out_dir, start_step)?;
    let all = metrics.gathered().to_vec();
    let hosts = gather_strings(comm, host)?;
    let devices = gather_strings(comm, device)?;
    let memories = gather_memory(comm, memory)?;
    let mut ranks = rank_summaries(&all, &hosts);
    for ((r, m), d) in ranks.iter_mut().zip(memories).zip(devices) {
        r.memory = Some(m);
        r.device = d;
    }
    Ok((all, ranks))
}

/// The facts of a finished attempt that the summary needs besides the records.
pub(crate) struct RunEnd {
    pub started: Instant,
    pub start_step: u64,
    pub total_steps: u64,
    pub last_loss: f64,
    pub evals: Vec<(u64, Eval)>,
    pub param_hash: String,
    pub gradient_sum: Option<GradientSum>,
    pub param_gathering: Option<ParamGathering>,
    pub layers_prefetched: Option<usize>,
    pub plan: ParallelPlan,
    pub job: JobLabel,
}

/// Build the summary (same on every rank); rank 0 also announces a straggler.
pub(crate) fn build_summary(
    cfg: &TrainConfig,
    comm: &Communicator,
    end: RunEnd,
    all_records: &[StepRecord],
    ranks: Vec<RankSummary>,
    pipeline: Option<PipelineSummary>,
    on_event: &mut dyn FnMut(Event),
) -> Summary {
    let t = &cfg.train;
    // Pipeline stages do different work: only replicas of one stage are comparable.
    let (imb, straggler) = if pipeline.is_some() {
        imbalance_within_stages(&ranks)
    } else {
        imbalance(&ranks)
    };
    if let (Some(r), 0) = (straggler, comm.rank()) {
        on_event(Event::Notice(format!(
            "straggler: rank {r} ({}) computed {imb:.2}× the mean per-rank compute time",
            ranks[r].host
        )));
    }
    let wall_seconds = end.started.elapsed().as_secs_f64();
    let step_total: f64 = all_records.iter().map(|r| r.step_seconds).sum();
    let comm_total: f64 = all_records
        .iter()
        .map(|r| r.seconds.communication + r.seconds.waiting)
        .sum();
    let (test_loss, test_accuracy, test_metrics) = end
        .evals
        .last()
        .map(|(_, e)| (e.test_loss, e.test_accuracy, e.metrics.clone()))
        .unwrap_or((f64::NAN, f64::NAN, Default::default()));
    let steps_run = (end.total_steps - end.start_step) as f64;
    Summary {
        job: end.job.name.clone(),
        world_size: comm.size(),
        steps: end.total_steps,
        global_batch: t.global_batch,
        microbatch: t.microbatch,
        reproducible: cfg.dist.reproducible,
        transport: comm.transport_name().to_string(),
        final_loss: end.last_loss,
        test_loss,
        test_accuracy,
        test_metrics,
        param_hash: end.param_hash,
        config_hash: cfg.hash_hex(),
        wall_seconds,
        samples_per_sec: steps_run * t.global_batch as f64 / wall_seconds,
        imbalance: imb,
        straggler,
        bytes_sent_total: ranks.iter().map(|r| r.bytes_sent).sum(),
        communication_fraction: if step_total > 0.0 {
            comm_total / step_total
        } else {
            0.0
        },
        evals: end.evals,
        ranks,
        pipeline,
        compute: ComputeSummary {
            kernels: lockstep_model::Kernels::detect().name().to_string(),
            threads: lockstep_model::compute_threads(),
            bf16_products: end.plan.bf16_products.then(bf16_products_statement),
        },
        gradient_sum: end.gradient_sum,
        param_gathering: end.param_gathering,
        layers_prefetched: end.layers_prefetched,
        plan: Some(end.plan),
        checkpoints: CheckpointSummary::from_records(
            all_records,
            cfg.checkpoint.background,
            cfg.checkpoint.sharded,
        ),
    }
}

/// summary.json's statement of how bf16 products ran (see `ComputeSummary::bf16_products`).
fn bf16_products_statement() -> String {
    #[cfg(target_arch = "x86_64")]
    let avx512_bf16 = std::arch::is_x86_feature_detected!("avx512bf16");
    #[cfg(not(target_arch = "x86_64"))]
    let avx512_bf16 = false;
    let units = match (lockstep_model::amx_bf16_reported(), avx512_bf16) {
        (true, _) => "this CPU reports AMX-BF16 tiles, which lockstep has no kernel for yet",
        (false, true) => {
            "this CPU has AVX512-BF16 dot products (no AMX), slower than its f32 FMAs (see \
             `lockstep bench`'s machine peaks)"
        }
        (false, false) => "this CPU has no bf16 units",
    };
    format!("f32 kernels on bf16-rounded operands (exact products, f32 sums): {units}")
}
