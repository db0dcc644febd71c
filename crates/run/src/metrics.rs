//! What a run records: one [`StepRecord`] per rank per step (→ `metrics.jsonl`) and the run's
//! [`Summary`] (→ `summary.json`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::memory::RankMemory;

/// Seconds one rank spent in each phase of one step.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct PhaseSeconds {
    /// Gathering the micro-batches' samples.
    pub data: f64,
    pub forward: f64,
    pub backward: f64,
    /// Exposed communication: moving and reducing gradients after the slowest rank arrived and,
    /// with `dist.overlap`, after backward ended (the part the step actually waited for).
    pub communication: f64,
    /// Blocked in the first collective of the step, waiting for slower ranks (load imbalance).
    pub waiting: f64,
    pub optimizer: f64,
    /// Communication hidden behind computation (0 unless gradients stream out during backward).
    pub overlapped_communication: f64,
    /// Moving gradients off and parameters onto the model's device (a user's burn model; host
    /// memory copies on the CPU), taken out of the phase it happened in. Absent in older runs.
    #[serde(default)]
    pub device_copy: f64,
    /// Training stalled for a checkpoint in this step: gathering the model to rank 0, then
    /// writing and syncing the file (`checkpoint.async = false`) or waiting for the previous
    /// background write (`true`); with sharded sets in the background, also the step after one
    /// waiting for its write (before its update, and to settle it). Absent in older runs and
    /// zero on other steps.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub checkpoint: f64,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

impl PhaseSeconds {
    pub fn compute(&self) -> f64 {
        self.forward + self.backward
    }
    pub fn add(&mut self, o: &PhaseSeconds) {
        self.data += o.data;
        self.forward += o.forward;
        self.backward += o.backward;
        self.communication += o.communication;
        self.waiting += o.waiting;
        self.optimizer += o.optimizer;
        self.overlapped_communication += o.overlapped_communication;
        self.device_copy += o.device_copy;
        self.checkpoint += o.checkpoint;
    }
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StepRecord {
    pub rank: usize,
    pub step: u64,
    /// Mean training loss over the global batch (the same on every rank).
    pub loss: f64,
    pub lr: f32,
    /// Samples this rank computed in this step.
    pub samples: usize,
    /// Global-batch samples per second of wall time for this step.
    pub samples_per_sec: f64,
    pub step_seconds: f64,
    pub seconds: PhaseSeconds,
    /// Payload bytes this rank sent in this step.
    pub bytes_sent: u64,
    /// Test-set evaluation, on the steps where one ran.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval: Option<Eval>,
    /// Pipeline figures (pipeline-parallel runs only).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pipeline: Option<PipelineStep>,
    /// Resident memory of this rank's process at the end of the step (`VmRSS`; filled in by the
    /// run ledger, absent where unknown).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub rss_bytes: Option<u64>,
    /// The global L2 norm of the step's summed gradient before clipping (runs with
    /// `optimizer.clip_grad_norm` only; the same on every rank and layout).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub grad_norm: Option<f64>,
    /// The job's training metrics of this step (`Job::TRAIN_METRICS`), per-sample means over
    /// the global batch (the same on every rank and layout).
    #[serde(skip_serializing_if = "BTreeMap::is_empty", default)]
    pub train_metrics: BTreeMap<String, f64>,
}

/// What one pipeline stage did in one step.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct PipelineStep {
    pub stage: usize,
    /// Wall time of the schedule: all of this stage's forwards, backwards and point-to-point
    /// transfers of the step.
    pub schedule_seconds: f64,
    /// Seconds inside sends of activations (forward) or input gradients (backward) to neighbours.
    pub send_seconds: f64,
    /// Seconds inside receives from neighbours: mostly waiting for them (the bubble).
    pub recv_seconds: f64,
    /// Idle time: `schedule_seconds` minus this stage's forward and backward compute.
    pub bubble_seconds: f64,
    /// Most micro-batches whose activations this stage held at once (1F1B: ≤ stages, GPipe: all).
    pub peak_activations: usize,
    /// Bytes of activations and gradients this stage sent to its neighbours.
    pub p2p_bytes: u64,
}

/// The pipeline part of `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PipelineSummary {
    pub dp: usize,
    pub pp: usize,
    /// Micro-batches each replica's pipeline runs per step.
    pub microbatches_per_replica: usize,
    /// "gpipe" or "1f1b".
    pub schedule: String,
    /// Layer range `[first, end)` of every stage.
    pub stage_layers: Vec<(usize, usize)>,
    /// Whether the cuts came from measured layer costs ("auto") or the config ("manual").
    pub cuts_from: String,
    /// Measured seconds (forward + backward of one micro-batch) per layer, when balanced automatically.
    pub layer_seconds: Vec<f64>,
    /// Mean over stages of bubble / schedule time.
    pub bubble_fraction: f64,
    /// The schedule's ideal bubble with balanced stages: (p − 1) / (m + p − 1).
    pub ideal_bubble_fraction: f64,
    /// Most micro-batches held at once, per stage (max over replicas and steps).
    pub peak_activations: Vec<usize>,
    /// Mean forward + backward seconds per step, per stage (averaged over replicas).
    pub stage_compute_seconds: Vec<f64>,
}

/// Figures of one evaluation over the whole evaluation set (per-sample means).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct Eval {
    pub test_loss: f64,
    /// The job's `accuracy` metric; NaN (`null` in JSON) for a job that reports none.
    #[serde(with = "nan_as_null")]
    pub test_accuracy: f64,
    /// The job's other metrics, by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, f64>,
}

/// JSON has no NaN: serde_json writes it as `null`; read `null` back as NaN.
pub mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

/// Per-rank totals in `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RankSummary {
    pub rank: usize,
    pub host: String,
    /// The rank's device: burn backend, adapter index and name (`flex 0: <the CPU's model>`,
    /// `wgpu/vulkan 0: llvmpipe …`, `cuda 1: NVIDIA H100 …`); empty in older summaries.
    #[serde(default)]
    pub device: String,
    pub samples: u64,
    pub compute_seconds: f64,
    pub communication_seconds: f64,
    pub waiting_seconds: f64,
    pub data_seconds: f64,
    pub optimizer_seconds: f64,
    pub overlapped_communication_seconds: f64,
    /// Moving gradients and parameters between the model's device and the host.
    #[serde(default)]
    pub device_copy_seconds: f64,
    /// Training stalled for checkpoints (see `PhaseSeconds::checkpoint`).
    #[serde(default)]
    pub checkpoint_seconds: f64,
    pub bytes_sent: u64,
    pub step_seconds_mean: f64,
    pub step_seconds_max: f64,
    /// Pipeline totals of this rank (pipeline-parallel runs only).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pipeline: Option<RankPipeline>,
    /// What this rank held and its peak resident memory (absent in runs older than the field).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub memory: Option<RankMemory>,
}

/// Per-rank pipeline totals over the run.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct RankPipeline {
    pub stage: usize,
    pub replica: usize,
    pub send_seconds: f64,
    pub recv_seconds: f64,
    pub bubble_seconds: f64,
    pub schedule_seconds: f64,
    /// bubble / schedule seconds.
    pub bubble_fraction: f64,
    pub peak_activations: usize,
    pub p2p_bytes: u64,
}

/// `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    /// The job's name (`Job::name`; "lockstep" for the built-in models); absent in summaries
    /// written before it was recorded.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub job: String,
    pub world_size: usize,
    pub steps: u64,
    pub global_batch: usize,
    pub microbatch: usize,
    pub reproducible: bool,
    pub transport: String,
    pub final_loss: f64,
    pub test_loss: f64,
    /// Test accuracy (the job's `accuracy` metric); NaN (`null`) for a job that reports none.
    #[serde(with = "nan_as_null")]
    pub test_accuracy: f64,
    /// The job's other evaluation metrics at the end of the run, by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub test_metrics: BTreeMap<String, f64>,
    /// SHA-256 (hex) of all parameters, little-endian f32, canonical order.
    pub param_hash: String,
    pub config_hash: String,
    pub wall_seconds: f64,
    pub samples_per_sec: f64,
    /// max / mean of per-rank compute seconds (1.0 = perfectly balanced); for a pipeline, among
    /// the replicas of each stage (the worst stage), since stages hold different layers.
    pub imbalance: f64,
    /// Rank with the most compute time, when imbalance is notable (> 1.10).
    pub straggler: Option<usize>,
    pub bytes_sent_total: u64,
    /// Fraction of the summed step time of all ranks spent communicating or waiting.
    pub communication_fraction: f64,
    pub evals: Vec<(u64, Eval)>,
    pub ranks: Vec<RankSummary>,
    /// Pipeline layout and figures (pipeline-parallel runs only).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pipeline: Option<PipelineSummary>,
    /// How the workers computed (the same on every rank: checked at start-up).
    #[serde(default)]
    pub compute: ComputeSummary,
    /// How the run summed its gradients over each data-parallel group (absent in summaries
    /// written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_sum: Option<GradientSum>,
    /// At ZeRO 3, how each stage's parameters were gathered for its compute (absent below ZeRO 3
    /// and in summaries written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param_gathering: Option<ParamGathering>,
    /// With `param_gathering = "layer"`: how many layers were gathered ahead of the one
    /// computing (`parallel.prefetch_layers`; 0: each when it was needed). Absent otherwise and
    /// in summaries written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers_prefetched: Option<usize>,
    /// The parallel plan the run followed (absent in summaries written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<crate::layout::ParallelPlan>,
    /// What this attempt's checkpoints cost the training (absent when it took none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<CheckpointSummary>,
}

/// How long checkpoints stalled the training: per checkpoint step, the longest `checkpoint`
/// phase of any rank (the others wait for it at the next collective).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CheckpointSummary {
    /// Written in the background (`checkpoint.async = true`) or in the step.
    pub background: bool,
    /// Every rank wrote its own shard (`checkpoint.sharded = true`); absent: rank 0 wrote the
    /// whole model.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sharded: bool,
    /// Checkpoints taken in this attempt.
    pub count: usize,
    pub stall_seconds_median: f64,
    pub stall_seconds_max: f64,
    /// Median seconds of the steps without a checkpoint (to read the stall against); absent
    /// when every step took one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ordinary_step_seconds_median: Option<f64>,
}

impl CheckpointSummary {
    /// From every rank's records; `None` when no step took a checkpoint.
    pub fn from_records(
        records: &[StepRecord],
        background: bool,
        sharded: bool,
    ) -> Option<CheckpointSummary> {
        let mut stall: BTreeMap<u64, f64> = BTreeMap::new();
        let mut step_max: BTreeMap<u64, f64> = BTreeMap::new();
        for r in records {
            let s = step_max.entry(r.step).or_default();
            *s = s.max(r.step_seconds);
            if r.seconds.checkpoint > 0.0 {
                let s = stall.entry(r.step).or_default();
                *s = s.max(r.seconds.checkpoint);
            }
        }
        if stall.is_empty() {
            return None;
        }
        let ordinary: Vec<f64> = step_max
            .iter()
            .filter(|(k, _)| !stall.contains_key(k))
            .map(|(_, v)| *v)
            .collect();
        let stalls: Vec<f64> = stall.values().copied().collect();
        Some(CheckpointSummary {
            background,
            sharded,
            count: stalls.len(),
            stall_seconds_median: median(stalls.clone()),
            stall_seconds_max: stalls.iter().copied().fold(0.0, f64::max),
            ordinary_step_seconds_median: (!ordinary.is_empty()).then(|| median(ordinary)),
        })
    }
}

/// How a data-parallel step's gradients were summed across the workers.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum GradientSum {
    /// One worker: its own micro-batches only.
    Local,
    /// Through the transport's collectives (rings, recursive doubling, the streamed overlap).
    Collectives,
    /// Each worker read its peers' gradients from their shared-memory windows
    /// (`lockstep_comm::shared_parts`).
    SharedWindows,
}

/// How ZeRO 3 gathered a stage's parameters for its compute (`summary.json`'s
/// `param_gathering`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ParamGathering {
    /// The whole stage, once per step, held for the step's schedule.
    Stage,
    /// One layer at a time, before its forward and again before its recomputed backward, and
    /// released after (`lockstep_run::memory::gathers_layers`): a rank holds its chunks and one
    /// layer.
    Layer,
}

/// The `compute` part of `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ComputeSummary {
    /// burn flex's matrix-multiply kernel set: "avx512f", "fma" or "scalar"
    /// (`lockstep_model::Kernels`); results' bits are specific to it. "unknown" in summaries
    /// written before it was recorded.
    pub kernels: String,
    /// Threads each worker's own compute loops ran on (`--threads-per-worker`;
    /// `lockstep_model::compute_threads`): the dense layers' matrix products, the optimizer's
    /// update and the one-worker exact sum; burn's other kernels run on one. Any count gives the
    /// same bits. 0 in summaries written before it was recorded.
    #[serde(default)]
    pub threads: usize,
    /// How `train.precision = "bf16"` products were computed (absent for `f32`): always on the
    /// `f32` kernels above, on bf16-rounded operands (each product exact, the sums `f32`), and
    /// why — lockstep has no bf16 matrix kernel yet, and this CPU's bf16 units (AVX512-BF16 dot
    /// products, AMX tiles where CPUID reports them) are named so a reader knows what was left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16_products: Option<String>,
}

impl Default for ComputeSummary {
    fn default() -> Self {
        ComputeSummary {
            kernels: "unknown".into(),
            threads: 0,
            bf16_products: None,
        }
    }
}

/// The median (mean of the two middle values for an even count); NaN for no values.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Build the per-rank totals and the balance figures from every rank's records.
pub fn rank_summaries(records: &[StepRecord], hosts: &[String]) -> Vec<RankSummary> {
    let world = hosts.len();
    (0..world)
        .map(|r| {
            let mine: Vec<&StepRecord> = records.iter().filter(|s| s.rank == r).collect();
            let mut total = PhaseSeconds::default();
            let mut step_max = 0f64;
            let mut step_sum = 0f64;
            for s in &mine {
                total.add(&s.seconds);
                step_max = step_max.max(s.step_seconds);
                step_sum += s.step_seconds;
            }
            RankSummary {
                rank: r,
                host: hosts[r].clone(),
                device: String::new(),
                samples: mine.iter().map(|s| s.samples as u64).sum(),
                compute_seconds: total.compute(),
                communication_seconds: total.communication,
                waiting_seconds: total.waiting,
                data_seconds: total.data,
                optimizer_seconds: total.optimizer,
                overlapped_communication_seconds: total.overlapped_communication,
                device_copy_seconds: total.device_copy,
                checkpoint_seconds: total.checkpoint,
                bytes_sent: mine.iter().map(|s| s.bytes_sent).sum(),
                step_seconds_mean: if mine.is_empty() {
                    0.0
                } else {
                    step_sum / mine.len() as f64
                },
                step_seconds_max: step_max,
                pipeline: rank_pipeline(&mine),
                memory: None,
            }
        })
        .collect()
}

/// Sum a rank's per-step pipeline figures (`None` when it ran no pipeline). The replica is filled
/// in by the caller, which knows the layout.
fn rank_pipeline(mine: &[&StepRecord]) -> Option<RankPipeline> {
    let mut total: Option<RankPipeline> = None;
    for p in mine.iter().filter_map(|s| s.pipeline.as_ref()) {
        let t = total.get_or_insert(RankPipeline {
            stage: p.stage,
            ..Default::default()
        });
        t.send_seconds += p.send_seconds;
        t.recv_seconds += p.recv_seconds;
        t.bubble_seconds += p.bubble_seconds;
        t.schedule_seconds += p.schedule_seconds;
        t.peak_activations = t.peak_activations.max(p.peak_activations);
        t.p2p_bytes += p.p2p_bytes;
    }
    if let Some(t) = total.as_mut() {
        t.bubble_fraction = if t.schedule_seconds > 0.0 {
            t.bubble_seconds / t.schedule_seconds
        } else {
            0.0
        };
    }
    total
}

/// `(imbalance, straggler)`: imbalance is max/mean compute seconds (uneven shares count: that is
/// load imbalance too). The straggler is judged per sample, so a rank that simply holds one more
/// micro-batch is not blamed: the rank whose compute seconds per sample exceed the mean rate by
/// more than 25%.
pub fn imbalance(ranks: &[RankSummary]) -> (f64, Option<usize>) {
    let busy: Vec<&RankSummary> = ranks.iter().filter(|r| r.samples > 0).collect();
    if busy.len() < 2 {
        return (1.0, None);
    }
    let mean = busy.iter().map(|r| r.compute_seconds).sum::<f64>() / busy.len() as f64;
    let max = busy.iter().map(|r| r.compute_seconds).fold(0.0, f64::max);
    let ratio = if mean > 0.0 { max / mean } else { 1.0 };
    let rate = |r: &RankSummary| r.compute_seconds / r.samples as f64;
    let mean_rate = busy.iter().map(|r| rate(r)).sum::<f64>() / busy.len() as f64;
    let slowest = busy
        .iter()
        .max_by(|a, b| rate(a).total_cmp(&rate(b)))
        .expect("two or more ranks");
    let straggler = (mean_rate > 0.0 && rate(slowest) > 1.25 * mean_rate).then_some(slowest.rank);
    (ratio, straggler)
}

/// [`imbalance`] among ranks that do the same work: for a pipeline, the replicas of each stage
/// (stages hold different layers, so comparing them is stage balance, not a straggler — see
/// [`PipelineSummary::stage_compute_seconds`]). Returns the worst group's ratio and its straggler.
pub fn imbalance_within_stages(ranks: &[RankSummary]) -> (f64, Option<usize>) {
    let stages: std::collections::BTreeSet<usize> = ranks
        .iter()
        .map(|r| r.pipeline.map_or(0, |p| p.stage))
        .collect();
    let mut worst = (1.0, None);
    for s in stages {
        let group: Vec<RankSummary> = ranks
            .iter()
            .filter(|r| r.pipeline.map_or(0, |p| p.stage) == s)
            .cloned()
            .collect();
        let candidate = imbalance(&group);
        // A group with a straggler beats one without; then the larger ratio.
        let beats = match (candidate.1.is_some(), worst.1.is_some()) {
            (true, false) => true,
            (false, true) => false,
            _ => candidate.0 > worst.0,
        };
        if beats {
            worst = candidate;
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(rank: usize, compute: f64) -> StepRecord {
        StepRecord {
            rank,
            step: 0,
            loss: 1.0,
            lr: 0.1,
            samples: 8,
            samples_per_sec: 1.0,
            step_seconds: compute + 0.5,
            seconds: PhaseSeconds {
                forward: compute / 2.0,
                backward: compute / 2.0,
                communication: 0.5,
                ..Default::default()
            },
            bytes_sent: 10,
            eval: None,
            pipeline: None,
            rss_bytes: None,
            grad_norm: None,
            train_metrics: Default::default(),
        }
    }

    #[test]
    fn checkpoint_stalls_are_the_slowest_ranks_and_read_against_ordinary_steps() {
        // Two ranks, steps 0..4, checkpoints after steps 1 and 3.
        let at = |rank, step, seconds, stall| StepRecord {
            step,
            step_seconds: seconds,
            seconds: PhaseSeconds {
                checkpoint: stall,
                ..Default::default()
            },
            ..rec(rank, 0.0)
        };
        let records = vec![
            at(0, 0, 1.0, 0.0),
            at(1, 0, 1.2, 0.0),
            at(0, 1, 2.0, 0.5),
            at(1, 1, 2.0, 0.1),
            at(0, 2, 1.4, 0.0),
            at(1, 2, 1.1, 0.0),
            at(0, 3, 3.0, 0.9),
            at(1, 3, 3.0, 0.2),
        ];
        let c = CheckpointSummary::from_records(&records, true, false).unwrap();
        assert_eq!(c.count, 2);
        assert!(c.background);
        assert_eq!((c.stall_seconds_median, c.stall_seconds_max), (0.7, 0.9));
        // Ordinary steps 0 and 2, each its slowest rank's time: 1.2 and 1.4.
        assert!((c.ordinary_step_seconds_median.unwrap() - 1.3).abs() < 1e-12);
        // Every step a checkpoint: nothing to read against (absent, never a NaN in the JSON).
        let c = CheckpointSummary::from_records(&records[2..4], false, true).unwrap();
        assert_eq!(c.ordinary_step_seconds_median, None);
        assert_eq!(
            CheckpointSummary::from_records(&records[..2], false, false),
            None
        );
    }

    #[test]
    fn imbalance_names_the_straggler() {
        let records = vec![
            rec(0, 1.0),
            rec(1, 1.0),
            rec(2, 2.0),
            rec(0, 1.0),
            rec(1, 1.0),
            rec(2, 2.0),
        ];
        let hosts = vec!["h".to_string(); 3];
        let ranks = rank_summaries(&records, &hosts);
        assert_eq!(ranks[2].compute_seconds, 4.0);
        assert_eq!(ranks[0].bytes_sent, 20);
        let (ratio, straggler) = imbalance(&ranks);
        assert!((ratio - 1.5).abs() < 1e-12);
        assert_eq!(straggler, Some(2));
        let balanced = rank_summaries(&[rec(0, 1.0), rec(1, 1.02)], &hosts[..2]);
        assert_eq!(imbalance(&balanced).1, None);
        // Twice the work for twice the samples is imbalance, not a straggler.
        let mut uneven = rec(0, 2.0);
        uneven.samples = 16;
        let ranks = rank_summaries(&[uneven, rec(1, 1.0), rec(2, 1.0)], &hosts);
        let (ratio, straggler) = imbalance(&ranks);
        assert!(ratio > 1.4);
        assert_eq!(straggler, None);
    }

    #[test]
    fn pipeline_stages_are_compared_only_with_their_replicas() {
        let staged = |rank: usize, stage: usize, compute: f64| {
            let mut r = rec(rank, compute);
            r.pipeline = Some(PipelineStep {
                stage,
                ..Default::default()
            });
            r
        };
        let hosts = vec!["h".to_string(); 4];
        // Stage 1 does twice the work of stage 0 in both replicas: balanced replicas, no straggler.
        let even = [
            staged(0, 0, 1.0),
            staged(1, 1, 2.0),
            staged(2, 0, 1.0),
            staged(3, 1, 2.0),
        ];
        let ranks = rank_summaries(&even, &hosts);
        assert!(
            imbalance(&ranks).1.is_some(),
            "compared across stages, a stage-1 rank would be blamed"
        );
        assert_eq!(imbalance_within_stages(&ranks), (1.0, None));
        // Rank 3 (stage 1, replica 1) is slow compared with rank 1, its stage's other replica.
        let slow = [
            staged(0, 0, 1.0),
            staged(1, 1, 2.0),
            staged(2, 0, 1.0),
            staged(3, 1, 4.0),
        ];
        let (ratio, straggler) = imbalance_within_stages(&rank_summaries(&slow, &hosts));
        assert_eq!(straggler, Some(3));
        assert!((ratio - 4.0 / 3.0).abs() < 1e-12);
    }
}
