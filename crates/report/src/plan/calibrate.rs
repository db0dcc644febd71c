//! Calibration from a finished run: compute per sample, optimizer seconds per parameter and
//! per-step overhead as medians over its steady steps, and the CPU cost of the synchronisation
//! left once the model of the run's own links has taken the network's share.

use lockstep_run::metrics::median;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::cost::{boundary_bytes, p2p_bytes_per_rank, sync_units, Placement};
use super::stages::{balanced_stages, even, stage_groups};
use super::{Cluster, Layout, Link, PlanError, Workload};
use crate::scaling::warmup_steps;
use lockstep_run::metrics::{GradientSum, StepRecord, Summary};

/// What a real run says about this machine and model.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Calibration {
    pub world: usize,
    pub dp: usize,
    pub pp: usize,
    pub transport: String,
    /// Steady-state steps the medians are taken over.
    pub steps_used: usize,
    /// Median over steady steps of the slowest rank's step time.
    pub measured_step_s: f64,
    /// Data + forward + backward seconds per sample (`c`), under the run's concurrency.
    pub work_per_sample_s: f64,
    /// Optimizer seconds per parameter (`o`).
    pub optimizer_per_param_s: f64,
    /// Seconds per gradient value per CPU pass of the synchronisation (`κ`).
    pub sync_cpu_per_unit_s: f64,
    /// Remaining per-step seconds (`x`).
    pub overhead_s: f64,
    /// Median measured synchronisation (communication + waiting) of the critical rank.
    pub measured_sync_s: f64,
    /// The model's network time for the run's own links (subtracted to get `κ`).
    pub modelled_network_s: f64,
    /// The calibration run's links as given.
    pub link: Link,
    /// Share of the compute per layer (from the run's measured layer costs, else even).
    pub layer_shares: Vec<f64>,
    pub layer_shares_from: String,
    /// Bytes sent per rank per steady step: measured (mean over ranks of each rank's median) and
    /// as the model counts them.
    pub measured_bytes_per_rank_step: f64,
    pub modelled_bytes_per_rank_step: f64,
    /// Things the user should know about this calibration.
    pub notes: Vec<String>,
}

/// Calibrate from a finished run (`summary.json` + `metrics.jsonl` records) of `workload`, whose
/// links are described by `link`.
pub fn calibrate(
    summary: &Summary,
    records: &[StepRecord],
    workload: &Workload,
    link: &Link,
) -> Result<Calibration, PlanError> {
    let world = summary.world_size.max(1);
    let shape = RunShape::of(summary, world)?;
    if workload.params == 0 {
        return Err(PlanError::Calibration("the model has no parameters".into()));
    }
    let steady = SteadySteps::of(records);
    let rows = steady.rows(shape, workload.microbatch.max(1) as f64);
    if rows.is_empty() {
        return Err(PlanError::Calibration(format!(
            "no steady-state steps to measure: the run has {} step(s) and the first {} are warm-up; run more steps (e.g. --set train.steps=40)",
            steady.total, steady.skip
        )));
    }
    let col = |i: usize| median(rows.iter().map(|r| r[i]).collect());
    let (work_per_sample_s, measured_sync_s, opt_s, overhead_s, measured_step_s) =
        (col(0), col(1), col(2), col(3), col(4));
    let (layer_shares, layer_shares_from) = layer_shares(summary, workload);
    let (dp, pp) = (shape.dp, shape.pp);
    if pp > workload.layers.len() {
        return Err(PlanError::Calibration(format!(
            "the run has {pp} pipeline stages but its model has {} layer(s)",
            workload.layers.len()
        )));
    }

    // The calibration run's layout on its own links.
    let cluster = Cluster::uniform(world, *link);
    let place = Placement::new(&cluster, world);
    let (stage, groups) = stage_groups(workload, Layout::dp_pp(dp, pp), &layer_shares);
    let stage_params = stage.params;
    let local = if pp == 1 {
        workload.microbatches.div_ceil(world)
    } else {
        shape.m_rep
    };
    let as_run = summed_as_run(summary, workload);
    let net = place.loss_exchange(world, &as_run) + place.gradient_sync(&groups, stage, &as_run);
    let mut notes = Vec::new();
    let units = sync_units(stage_params, local, workload.reproducible);
    let cpu = measured_sync_s - net.seconds;
    if cpu < 0.0 {
        notes.push(format!(
            "the run's synchronisation ({:.2} ms) took less than the model of its links predicts ({:.2} ms): its links are faster than described (calibration link {:.2} GB/s, {:.1} µs)",
            measured_sync_s * 1e3,
            net.seconds * 1e3,
            link.bytes_per_s / 1e9,
            link.latency_s * 1e6
        ));
    }
    let p2p_bytes = pipeline_p2p_bytes(summary, workload, shape, &layer_shares);
    Ok(Calibration {
        world,
        dp,
        pp,
        transport: summary.transport.clone(),
        steps_used: rows.len(),
        measured_step_s,
        work_per_sample_s,
        optimizer_per_param_s: opt_s / stage_params.max(1) as f64,
        sync_cpu_per_unit_s: if units > 0.0 {
            cpu.max(0.0) / units
        } else {
            0.0
        },
        overhead_s,
        measured_sync_s,
        modelled_network_s: net.seconds,
        link: *link,
        layer_shares,
        layer_shares_from,
        measured_bytes_per_rank_step: steady.bytes_per_rank(world),
        modelled_bytes_per_rank_step: net.bytes_per_rank + p2p_bytes,
        notes,
    })
}

/// The calibration run's layout: data-parallel replicas, pipeline stages and micro-batches per
/// replica (0 without a pipeline), refused for a tensor-parallel or inconsistent run.
#[derive(Debug, Clone, Copy)]
struct RunShape {
    dp: usize,
    pp: usize,
    m_rep: usize,
}

impl RunShape {
    fn of(summary: &Summary, world: usize) -> Result<RunShape, PlanError> {
        let (dp, pp, m_rep) = match &summary.pipeline {
            Some(p) => (p.dp.max(1), p.pp.max(1), p.microbatches_per_replica.max(1)),
            None => (world, 1, 0),
        };
        if dp * pp != world && world.is_multiple_of(dp * pp) {
            return Err(PlanError::Calibration(format!(
                "the run is tensor-parallel (tp = {}); the plan calibrates from a run with \
                 parallel.tp = 1 (the same config on 1 worker or data-parallel) and predicts tp \
                 layouts from it",
                world / (dp * pp)
            )));
        }
        if dp * pp != world {
            return Err(PlanError::Calibration(format!(
                "summary.json says {world} workers but a layout of dp {dp} × pp {pp}"
            )));
        }
        Ok(RunShape { dp, pp, m_rep })
    }
}

/// The run's training records after its warm-up, by step.
struct SteadySteps<'r> {
    by_step: BTreeMap<u64, Vec<&'r StepRecord>>,
    total: u64,
    skip: u64,
}

impl<'r> SteadySteps<'r> {
    fn of(records: &'r [StepRecord]) -> SteadySteps<'r> {
        let total = records.iter().map(|r| r.step + 1).max().unwrap_or(0);
        let skip = warmup_steps(total);
        let mut by_step: BTreeMap<u64, Vec<&StepRecord>> = BTreeMap::new();
        for r in records
            .iter()
            .filter(|r| r.step >= skip && r.eval.is_none())
        {
            by_step.entry(r.step).or_default().push(r);
        }
        SteadySteps {
            by_step,
            total,
            skip,
        }
    }

    /// Per step: (per-sample compute, sync, optimizer, overhead, step) of its critical rank,
    /// `mb` samples per micro-batch.
    fn rows(&self, shape: RunShape, mb: f64) -> Vec<[f64; 5]> {
        let mut rows = Vec::new();
        for recs in self.by_step.values() {
            let step = recs.iter().map(|r| r.step_seconds).fold(0.0, f64::max);
            let crit = *recs
                .iter()
                .max_by(|a, b| busy(a).total_cmp(&busy(b)))
                .expect("a step has records");
            let per_sample = if shape.pp == 1 {
                if crit.samples == 0 {
                    continue;
                }
                work(crit) / crit.samples as f64
            } else {
                // A replica's stages together compute each of its samples once.
                let mut sums: BTreeMap<usize, f64> = BTreeMap::new();
                for r in recs {
                    *sums.entry(r.rank / shape.pp).or_default() += work(r);
                }
                sums.values().copied().fold(0.0, f64::max) / (shape.m_rep as f64 * mb)
            };
            let sync = crit.seconds.communication + crit.seconds.waiting;
            let other = (step - busy(crit) - sync - crit.seconds.optimizer).max(0.0);
            rows.push([per_sample, sync, crit.seconds.optimizer, other, step]);
        }
        rows
    }

    /// Bytes sent per rank per steady step: each rank's median, averaged over the `world` ranks.
    fn bytes_per_rank(&self, world: usize) -> f64 {
        let mut per_rank: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
        for recs in self.by_step.values() {
            for r in recs {
                per_rank
                    .entry(r.rank)
                    .or_default()
                    .push(r.bytes_sent as f64);
            }
        }
        per_rank.into_values().map(median).sum::<f64>() / world as f64
    }
}

/// A rank's per-micro-batch work. Device copies (gradients off and parameters onto the model's
/// device, host copies on the CPU) are per micro-batch work like the forward and backward they
/// were taken out of.
fn work(r: &StepRecord) -> f64 {
    r.seconds.data + r.seconds.forward + r.seconds.backward + r.seconds.device_copy
}

/// A rank's busy time in a step: its work, or its pipeline schedule's.
fn busy(r: &StepRecord) -> f64 {
    match &r.pipeline {
        Some(p) => r.seconds.data + p.schedule_seconds,
        None => work(r),
    }
}

/// Share of the compute per layer: the run's measured layer costs, else an even split; and
/// where the shares came from.
fn layer_shares(summary: &Summary, workload: &Workload) -> (Vec<f64>, String) {
    match &summary.pipeline {
        Some(p)
            if p.layer_seconds.len() == workload.layers.len()
                && p.layer_seconds.iter().sum::<f64>() > 0.0 =>
        {
            let s: f64 = p.layer_seconds.iter().sum();
            (
                p.layer_seconds.iter().map(|x| x / s).collect(),
                "measured layer costs (summary.json pipeline.layer_seconds)".to_string(),
            )
        }
        _ => (
            even(workload.layers.len()),
            "even split over layers (no measured layer costs in the run)".to_string(),
        ),
    }
}

/// `workload` with the gradient sum the run did: ranks on several hosts use the collectives even
/// where the transport would share memory on one (the calibration cluster is one node of
/// `link`s).
fn summed_as_run(summary: &Summary, workload: &Workload) -> Workload {
    Workload {
        shared_memory: match summary.gradient_sum {
            Some(GradientSum::SharedWindows) => true,
            Some(GradientSum::Collectives | GradientSum::Local) => false,
            None => workload.shared_memory,
        },
        ..workload.clone()
    }
}

/// A pipeline run's activations and gradients sent between stages per rank and step, cut where
/// the run cut (0 without a pipeline).
fn pipeline_p2p_bytes(
    summary: &Summary,
    workload: &Workload,
    shape: RunShape,
    layer_shares: &[f64],
) -> f64 {
    match &summary.pipeline {
        Some(p) if shape.pp > 1 => {
            let valid = p.stage_layers.len() == shape.pp
                && p.stage_layers
                    .iter()
                    .all(|&(a, b)| a < b && b <= workload.layers.len());
            let stages = if valid {
                p.stage_layers.clone()
            } else {
                balanced_stages(layer_shares, shape.pp)
            };
            p2p_bytes_per_rank(
                Layout::dp_pp(shape.dp, shape.pp),
                &boundary_bytes(workload, &stages),
                shape.m_rep,
            )
        }
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::predict::predict;
    use crate::plan::test_support::{close, pipeline_workload, whole, workload};
    use lockstep_run::metrics::{PhaseSeconds, PipelineSummary};

    fn rec(
        rank: usize,
        step: u64,
        work: f64,
        sync: f64,
        opt: f64,
        total: f64,
        samples: usize,
    ) -> StepRecord {
        StepRecord {
            rank,
            step,
            loss: 1.0,
            lr: 0.1,
            samples,
            samples_per_sec: 1.0,
            step_seconds: total,
            seconds: PhaseSeconds {
                data: work * 0.1,
                forward: work * 0.3,
                backward: work * 0.6,
                communication: sync * 0.8,
                waiting: sync * 0.2,
                optimizer: opt,
                overlapped_communication: 0.0,
                device_copy: 0.0,
                checkpoint: 0.0,
            },
            bytes_sent: 1000,
            eval: None,
            pipeline: None,
            rss_bytes: None,
            grad_norm: None,
            train_metrics: Default::default(),
        }
    }

    fn summary(world: usize, transport: &str) -> Summary {
        Summary {
            job: String::new(),
            global_batch: 256,
            microbatch: 64,
            transport: transport.into(),
            final_loss: 1.0,
            test_loss: 1.0,
            test_accuracy: 0.5,
            test_metrics: Default::default(),
            config_hash: "00".into(),
            wall_seconds: 1.0,
            ..crate::scaling::tests::summary(world, "00")
        }
    }

    #[test]
    fn calibration_recovers_the_synthetic_run() {
        // 2 workers, 2 micro-batches of 64 each; rank 1 is the slower. Steps 0–1 are warm-up
        // (10% of 20) and step 5 is wildly slow: the medians must ignore both.
        let p = 1_000_000;
        let w = workload(p);
        let link = Link::new(10e-6, 4e9);
        let mut records = Vec::new();
        for step in 0..20u64 {
            let slow = if step < 2 || step == 5 { 10.0 } else { 1.0 };
            records.push(rec(0, step, 0.010, 0.012, 0.002, 0.0245, 128));
            records.push(rec(
                1,
                step,
                0.0128 * slow,
                0.011,
                0.002,
                0.0275 * slow,
                128,
            ));
        }
        let cal = calibrate(&summary(2, "tcp"), &records, &w, &link).unwrap();
        assert_eq!(cal.steps_used, 18);
        assert!(
            close(cal.work_per_sample_s, 0.0128 / 128.0),
            "{}",
            cal.work_per_sample_s
        );
        assert!(close(cal.measured_step_s, 0.0275));
        assert!(close(cal.optimizer_per_param_s, 0.002 / p as f64));
        // Overhead: 27.5 − 12.8 − 11 − 2 ms on the critical rank.
        assert!(
            (cal.overhead_s - 0.0017).abs() < 1e-12,
            "{}",
            cal.overhead_s
        );
        // κ: the critical rank's 11 ms of sync less the modelled network, over P·(2+1) passes.
        let own = Cluster::uniform(2, link);
        let place = Placement::new(&own, 2);
        let g = vec![vec![0, 1]];
        let net = (place.loss_exchange(2, &w) + place.gradient_sync(&g, whole(&w), &w)).seconds;
        assert!(close(cal.modelled_network_s, net));
        assert!(close(
            cal.sync_cpu_per_unit_s,
            (0.011 - net) / (3 * p) as f64
        ));
        // And the model then predicts the calibration run's own step from its parts.
        let c = Cluster::uniform(2, link);
        let pred = predict(&c, &w, &cal, Layout::dp_pp(2, 1)).unwrap();
        assert!((pred.step_s - 0.0275).abs() < 1e-9, "{}", pred.step_s);
        assert_eq!(cal.layer_shares, vec![1.0]);
    }

    #[test]
    fn device_copies_are_compute_and_the_sum_is_modelled_as_the_run_did_it() {
        // A layered model's run: 1 ms of every 10 ms of compute is device copies, taken out of
        // the forward and backward. Two hosts, so its sum went through the collectives although
        // its transport (auto) would share memory on one host.
        let p = 1_000_000;
        let w = Workload {
            shared_memory: true,
            ..workload(p)
        };
        let link = Link::new(10e-6, 4e9);
        let records: Vec<StepRecord> = (0..20u64)
            .flat_map(|step| {
                (0..2).map(move |rank| {
                    let mut r = rec(rank, step, 0.009, 0.012, 0.002, 0.0245, 128);
                    r.seconds.device_copy = 0.001;
                    r
                })
            })
            .collect();
        let mut s = summary(2, "tcp");
        s.gradient_sum = Some(GradientSum::Collectives);
        let cal = calibrate(&s, &records, &w, &link).unwrap();
        assert!(
            close(cal.work_per_sample_s, 0.010 / 128.0),
            "{}",
            cal.work_per_sample_s
        );
        // The exact sum's ring over two ranks: i64 half-vectors out, f32 half-vectors back.
        let ring = 6.0 * p as f64;
        assert!(
            (cal.modelled_bytes_per_rank_step - ring).abs() < 0.001 * ring,
            "{}",
            cal.modelled_bytes_per_rank_step
        );
        // The same run on one host summed through shared windows: barrier tokens only.
        s.gradient_sum = Some(GradientSum::SharedWindows);
        let windows = calibrate(&s, &records, &w, &link).unwrap();
        assert!(windows.modelled_bytes_per_rank_step < 1000.0);
    }

    #[test]
    fn calibration_without_steady_steps_says_what_to_do() {
        // A one-step run: its only step is the last, which also evaluates: nothing steady.
        let mut last = rec(0, 0, 0.01, 0.0, 0.001, 0.011, 256);
        last.eval = Some(lockstep_run::metrics::Eval {
            test_loss: 1.0,
            test_accuracy: 0.5,
            ..Default::default()
        });
        let records = vec![last];
        let e = calibrate(
            &summary(1, "shm"),
            &records,
            &workload(10),
            &Link::new(0.0, 1e9),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("steady-state") && e.contains("train.steps"),
            "{e}"
        );
    }

    #[test]
    fn pipeline_calibration_sums_a_replicas_stages() {
        // dp 1 × pp 2: stage 0 computes 3 ms, stage 1 5 ms per step over 2 micro-batches of 64.
        let w = Workload {
            microbatches: 2,
            ..pipeline_workload(2, 256)
        };
        let mut s = summary(2, "shm");
        s.pipeline = Some(PipelineSummary {
            dp: 1,
            pp: 2,
            microbatches_per_replica: 2,
            schedule: "1f1b".into(),
            stage_layers: vec![(0, 1), (1, 2)],
            cuts_from: "auto".into(),
            layer_seconds: vec![0.001, 0.003],
            bubble_fraction: 0.3,
            ideal_bubble_fraction: 1.0 / 3.0,
            peak_activations: vec![2, 1],
            stage_compute_seconds: vec![0.003, 0.005],
        });
        let mut records = Vec::new();
        for step in 0..20 {
            records.push(rec(0, step, 0.003, 0.001, 0.0005, 0.012, 0));
            records.push(rec(1, step, 0.005, 0.001, 0.0005, 0.012, 0));
        }
        let w = Workload {
            microbatch: 64,
            ..w
        };
        let cal = calibrate(&s, &records, &w, &Link::new(1e-6, 1e10)).unwrap();
        assert!(
            close(cal.work_per_sample_s, 0.008 / 128.0),
            "{}",
            cal.work_per_sample_s
        );
        assert_eq!(cal.layer_shares, vec![0.25, 0.75]);
        assert_eq!((cal.dp, cal.pp), (1, 2));
        // Per step: one activation forward and one gradient back per micro-batch over the one
        // boundary (256 B × 64 samples), half of it per rank, plus the 16-byte loss exchange.
        assert_eq!(
            cal.modelled_bytes_per_rank_step,
            2.0 * 2.0 * 16384.0 / 2.0 + 16.0
        );
    }
}
