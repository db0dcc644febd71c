//! Prediction and recommendation: one layout's step time on a cluster from the calibration
//! (compute, pipeline schedule, network, CPU sync, optimizer and overhead), every layout's
//! speedup against one worker, and the fastest layout with its reasons in one sentence.

use lockstep_run::memory::RankMemory;
use serde::{Deserialize, Serialize};

use super::cost::{boundary_bytes, p2p_bytes_per_rank, sync_units, Placement};
use super::memory::fullest_rank;
use super::stages::{balanced_stages, even, stage_groups};
use super::{candidate_layouts, Calibration, Cluster, Layout, Workload};

/// The model's figures for one layout.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Prediction {
    pub layout: Layout,
    pub workers: usize,
    pub nodes_used: usize,
    /// "shm" (one node) or "tcp".
    pub transport: String,
    pub microbatches_per_replica: usize,
    /// Layer range `[first, end)` of every stage.
    pub stage_layers: Vec<(usize, usize)>,
    pub step_s: f64,
    /// Critical rank's compute (pipeline: the slowest stage's, all micro-batches).
    pub compute_s: f64,
    /// CPU work of the gradient sum (`κ·U`).
    pub sync_cpu_s: f64,
    /// Loss exchange and gradient all-reduces on the wire.
    pub network_s: f64,
    /// Pipeline point-to-point on the critical path.
    pub p2p_s: f64,
    /// Pipeline fill and drain: `(p − 1)·t_stage`.
    pub bubble_s: f64,
    /// Optimizer and per-step overhead.
    pub other_s: f64,
    /// Bubble / schedule time (0 without a pipeline).
    pub bubble_fraction: f64,
    /// Against one worker on this cluster.
    pub speedup: f64,
    pub efficiency: f64,
    pub bytes_per_rank_step: f64,
    /// The fullest rank's memory: model state, and (`peak_rss_bytes`) its predicted peak
    /// resident memory.
    #[serde(default)]
    pub memory: RankMemory,
    /// Whether that peak fits the stated per-worker memory (`--memory-gib`; true without one).
    #[serde(default = "yes")]
    pub fits_memory: bool,
}

fn yes() -> bool {
    true
}

impl Prediction {
    /// Everything that is not compute: synchronisation, point-to-point and the bubble.
    pub fn communication_s(&self) -> f64 {
        self.sync_cpu_s + self.network_s + self.p2p_s
    }
}

/// Predict one layout, or say why it cannot run.
pub fn predict(
    cluster: &Cluster,
    w: &Workload,
    cal: &Calibration,
    layout: Layout,
) -> Result<Prediction, String> {
    let world = layout.world();
    if world > cluster.capacity() {
        return Err(format!(
            "needs {world} workers, the cluster has {} ({} nodes × {})",
            cluster.capacity(),
            cluster.nodes,
            cluster.workers_per_node
        ));
    }
    if w.microbatches < layout.dp {
        return Err(format!(
            "{} replicas need at least {} micro-batches per step, the config has {}",
            layout.dp, layout.dp, w.microbatches
        ));
    }
    if layout.pp > 1 && w.layers.len() < 2 {
        return Err(format!(
            "{} pipeline stages need a layered model (model.kind = \"transformer\")",
            layout.pp
        ));
    }
    if layout.tp > 1 && (w.tp_pieces == 1 || !w.tp_pieces.is_multiple_of(layout.tp)) {
        return Err(format!(
            "tp = {} needs a model whose tensor-parallel pieces it divides (the transformer's \
             model.tp_pieces, a layered job's lockstep::tp layers; this one has {} piece(s))",
            layout.tp, w.tp_pieces
        ));
    }
    if layout.pp > w.layers.len() {
        return Err(format!(
            "{} stages but the model has {} layers",
            layout.pp,
            w.layers.len()
        ));
    }
    let shares = if cal.layer_shares.len() == w.layers.len() {
        cal.layer_shares.clone()
    } else {
        even(w.layers.len())
    };
    let place = Placement::new(cluster, world);
    let cs = cluster.compute_scale;
    let per_sample = cal.work_per_sample_s / cs;
    let mb = w.microbatch as f64;
    let m = w.microbatches.div_ceil(layout.dp);
    let (stage, groups) = stage_groups(w, layout, &shares);
    let stage_params = stage.params;
    // A tensor-parallel rank computes its layers' replicated part and its share of the split
    // part: each layer's compute in proportion to the parameters the rank holds.
    let rank_shares: Vec<f64> = shares
        .iter()
        .zip(&w.layers)
        .map(|(s, l)| s * l.params_per_tp_rank(layout.tp) as f64 / l.params.max(1) as f64)
        .collect();
    let (compute_s, bubble_s, p2p_s, stage_layers) = if layout.pp == 1 {
        (
            m as f64 * mb * per_sample * rank_shares.iter().sum::<f64>(),
            0.0,
            0.0,
            vec![(0, w.layers.len())],
        )
    } else {
        let stages = balanced_stages(&shares, layout.pp);
        let t: Vec<f64> = stages
            .iter()
            .map(|&(a, b)| rank_shares[a..b].iter().sum::<f64>() * mb * per_sample)
            .collect();
        let t_max = t.iter().copied().fold(0.0, f64::max);
        let t_sum: f64 = t.iter().sum();
        let (x_busiest, x_first) = place.pipeline_p2p(layout, &boundary_bytes(w, &stages), w);
        // The slowest resource (stage or link direction) paces m − 1 micro-batches; the first
        // one crosses every stage and every link forward and back.
        let schedule = (m as f64 - 1.0) * t_max.max(x_busiest) + t_sum + x_first;
        let compute = m as f64 * t_max;
        let bubble = t_sum - t_max;
        (compute, bubble, schedule - compute - bubble, stages)
    };
    let net = place.loss_exchange(world, w)
        + place.gradient_sync(&groups, stage, w)
        + tp_sums(&place, w, layout, &stage_layers, m);
    let sync_cpu_s = cal.sync_cpu_per_unit_s * sync_units(stage_params, m, w.reproducible) / cs;
    let other_s = (cal.optimizer_per_param_s * stage_params as f64 + cal.overhead_s) / cs;
    let step_s = compute_s + bubble_s + p2p_s + sync_cpu_s + net.seconds + other_s;
    let schedule = compute_s + bubble_s + p2p_s;
    let p2p_bytes = p2p_bytes_per_rank(layout, &boundary_bytes(w, &stage_layers), m);
    let memory = fullest_rank(w, layout, &stage_layers);
    Ok(Prediction {
        layout,
        workers: world,
        nodes_used: place.nodes_used,
        transport: place.transport().to_string(),
        microbatches_per_replica: m,
        stage_layers,
        step_s,
        compute_s,
        sync_cpu_s,
        network_s: net.seconds,
        p2p_s,
        bubble_s,
        other_s,
        bubble_fraction: if layout.pp > 1 && schedule > 0.0 {
            bubble_s / schedule
        } else {
            0.0
        },
        speedup: 1.0,
        efficiency: 1.0,
        bytes_per_rank_step: net.bytes_per_rank + p2p_bytes,
        memory,
        fits_memory: true,
    })
}

/// Tensor parallelism's piece sums per step on the busiest stage: per micro-batch and split layer
/// (a transformer block), two row-parallel outputs forward and two column-parallel input
/// gradients backward, each the layer's output (`activation_bytes_per_sample` per sample).
fn tp_sums(
    place: &Placement,
    w: &Workload,
    layout: Layout,
    stages: &[(usize, usize)],
    m: usize,
) -> super::cost::Cost {
    stages
        .iter()
        .map(|&(a, b)| {
            let split = &w.layers[a..b];
            let split: Vec<_> = split.iter().filter(|l| l.tp_split_params > 0).collect();
            let elems = split
                .iter()
                .map(|l| l.activation_bytes_per_sample / 4 * w.microbatch)
                .max()
                .unwrap_or(0);
            place.piece_sums(layout, elems, 4 * split.len() * m, w)
        })
        .max_by(|x, y| x.seconds.total_cmp(&y.seconds))
        .unwrap_or_default()
}

/// A layout the model did not predict, and why.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Skipped {
    pub layout: Layout,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Recommendation {
    pub layout: Layout,
    pub step_s: f64,
    pub why: String,
}

/// Everything `lockstep plan` prints and writes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Plan {
    pub cluster: Cluster,
    pub workload: Workload,
    pub calibration: Calibration,
    /// Predicted step of one worker on this cluster: the speedup baseline.
    pub single_worker_step_s: f64,
    pub predictions: Vec<Prediction>,
    pub skipped: Vec<Skipped>,
    pub recommendation: Option<Recommendation>,
    /// The stated per-worker memory (`--memory-gib`), in bytes.
    #[serde(default)]
    pub memory_limit_bytes: Option<u64>,
    /// Set when no predicted layout fits that memory: what the smallest would need.
    #[serde(default)]
    pub memory_note: Option<String>,
}

/// Predict `layouts` (default: [`candidate_layouts`]) and recommend the fastest of those whose
/// fullest rank fits `memory_limit_bytes` per worker (all of them without a limit).
pub fn plan(
    cluster: &Cluster,
    workload: &Workload,
    calibration: &Calibration,
    layouts: Option<&[Layout]>,
    memory_limit_bytes: Option<u64>,
) -> Plan {
    let layouts = match layouts {
        Some(l) => l.to_vec(),
        None => candidate_layouts(cluster, workload),
    };
    let one = predict(cluster, workload, calibration, Layout::dp_pp(1, 1))
        .expect("one worker always fits")
        .step_s;
    let mut predictions = Vec::new();
    let mut skipped = Vec::new();
    for l in layouts {
        match predict(cluster, workload, calibration, l) {
            Ok(mut p) => {
                p.speedup = one / p.step_s;
                p.efficiency = p.speedup / p.workers as f64;
                p.fits_memory = memory_limit_bytes.is_none_or(|m| p.memory.peak_rss_bytes <= m);
                predictions.push(p);
            }
            Err(reason) => skipped.push(Skipped { layout: l, reason }),
        }
    }
    let fitting: Vec<Prediction> = predictions
        .iter()
        .filter(|p| p.fits_memory)
        .cloned()
        .collect();
    let recommendation = recommend(&fitting, cluster);
    let memory_note = match (memory_limit_bytes, fitting.is_empty()) {
        (Some(limit), true) => predictions
            .iter()
            .min_by_key(|p| p.memory.peak_rss_bytes)
            .map(|p| {
                format!(
                    "no layout fits in {:.2} GiB per worker: the smallest, {}, needs {:.2} GiB on its fullest rank",
                    limit as f64 / GIB,
                    p.layout,
                    p.memory.peak_rss_bytes as f64 / GIB
                )
            }),
        _ => None,
    };
    Plan {
        cluster: cluster.clone(),
        workload: workload.clone(),
        calibration: calibration.clone(),
        single_worker_step_s: one,
        predictions,
        skipped,
        recommendation,
        memory_limit_bytes,
        memory_note,
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// The fastest layout (fewer workers on a tie), with the reasons in one sentence.
pub fn recommend(predictions: &[Prediction], cluster: &Cluster) -> Option<Recommendation> {
    let mut order: Vec<&Prediction> = predictions.iter().collect();
    order.sort_by(|a, b| {
        a.step_s
            .total_cmp(&b.step_s)
            .then(a.workers.cmp(&b.workers))
    });
    let best = *order.first()?;
    let ms = |s: f64| s * 1e3;
    let pct = |part: f64| 100.0 * part / best.step_s;
    let mut why = format!(
        "{} on {} node(s): {:.1} ms/step, {:.2}× one worker ({:.0}% efficient)",
        best.layout,
        best.nodes_used,
        ms(best.step_s),
        best.speedup,
        best.efficiency * 100.0
    );
    match order.get(1) {
        Some(next) => {
            why += &format!(
                "; the fastest of {} layouts, {:.0}% faster than the next, {} ({:.1} ms)",
                order.len(),
                100.0 * (next.step_s / best.step_s - 1.0),
                next.layout,
                ms(next.step_s)
            )
        }
        None => why += "; the only layout that fits",
    }
    why += &format!(
        "; its step is {:.0}% compute, {:.0}% communication{}",
        pct(best.compute_s),
        pct(best.communication_s()),
        if best.bubble_s > 0.0 {
            format!(", {:.0}% pipeline bubble", pct(best.bubble_s))
        } else {
            String::new()
        }
    );
    let bigger: Vec<&&Prediction> = order.iter().filter(|p| p.workers > best.workers).collect();
    if let Some(b) = bigger.iter().min_by(|a, b| a.step_s.total_cmp(&b.step_s)) {
        let crosses = b.nodes_used > 1 && best.nodes_used == 1;
        why += &format!(
            "; more workers do not pay: {} would spend {:.1} ms communicating{} to save {:.1} ms of compute",
            b.layout,
            ms(b.communication_s() + b.bubble_s),
            if crosses {
                format!(
                    " (over {:.3} GB/s, {:.0} µs links between nodes)",
                    cluster.inter.bytes_per_s / 1e9,
                    cluster.inter.latency_s * 1e6
                )
            } else {
                String::new()
            },
            ms((best.compute_s - b.compute_s).max(0.0))
        );
    }
    Some(Recommendation {
        layout: best.layout,
        step_s: best.step_s,
        why,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_support::{close, pipeline_workload, workload};
    use crate::plan::{ClusterSpec, Link};

    fn flat_calibration(per_sample: f64, layers: usize) -> Calibration {
        Calibration {
            world: 1,
            dp: 1,
            pp: 1,
            transport: "shm".into(),
            steps_used: 10,
            measured_step_s: 0.0,
            work_per_sample_s: per_sample,
            optimizer_per_param_s: 0.0,
            sync_cpu_per_unit_s: 0.0,
            overhead_s: 0.0,
            measured_sync_s: 0.0,
            modelled_network_s: 0.0,
            link: Link::new(0.0, 1e9),
            layer_shares: even(layers),
            layer_shares_from: "even".into(),
            measured_bytes_per_rank_step: 0.0,
            modelled_bytes_per_rank_step: 0.0,
            notes: vec![],
        }
    }

    #[test]
    fn pipeline_step_has_the_ideal_bubble_on_a_free_network() {
        // 4 equal layers on 4 stages, m = 8 micro-batches of 4 samples, 1 ms per sample.
        let w = pipeline_workload(4, 1024);
        let cal = flat_calibration(1e-3, 4);
        let free = Link::new(0.0, 1e18);
        let c = Cluster::uniform(4, free);
        let p = predict(&c, &w, &cal, Layout::dp_pp(1, 4)).unwrap();
        let t_stage = 0.25 * 4.0 * 1e-3;
        assert!(close(p.compute_s + p.bubble_s, (8.0 + 3.0) * t_stage));
        assert!(
            close(p.bubble_fraction, 3.0 / 11.0),
            "{}",
            p.bubble_fraction
        );
        assert_eq!(p.stage_layers, vec![(0, 1), (1, 2), (2, 3), (3, 4)]);
        // 3 boundaries × 8 micro-batches × 4 KiB each way over 4 ranks, plus the loss exchange
        // (recursive doubling on 4 ranks: 2 rounds of 8 + 8 bytes).
        assert_eq!(p.bytes_per_rank_step, 2.0 * 8.0 * 3.0 * 4096.0 / 4.0 + 32.0);
        // Latency α = 2 ms per message, more than a stage's 1 ms: the links pace the pipeline.
        // (m − 1)·α for the stream, p·t_stage and 2(p − 1)·α for the first micro-batch's path.
        let slow = Cluster::uniform(4, Link::new(2e-3, 1e18));
        let q = predict(&slow, &w, &cal, Layout::dp_pp(1, 4)).unwrap();
        let schedule = 7.0 * 2e-3 + 4.0 * t_stage + 6.0 * 2e-3;
        assert!(close(q.compute_s + q.bubble_s + q.p2p_s, schedule), "{q:?}");
        assert!(close(q.p2p_s, schedule - 11.0 * t_stage), "{}", q.p2p_s);
    }

    #[test]
    fn recommendation_picks_the_fastest_feasible_layout() {
        let w = workload(669_706);
        let mut cal = flat_calibration(1e-4, 1);
        cal.sync_cpu_per_unit_s = 1e-9;
        let spec = |nodes: usize, gbps: f64| ClusterSpec {
            nodes: Some(nodes),
            workers_per_node: Some(1),
            link_gbps: Some(gbps),
            link_latency_us: Some(50.0),
            ..Default::default()
        };
        // A fast network: all four workers (a dp of 8 is skipped: only 4 micro-batches).
        let fast = spec(8, 400.0).resolve().unwrap();
        let p = plan(
            &fast,
            &w,
            &cal,
            Some(&[
                Layout::dp_pp(1, 1),
                Layout::dp_pp(2, 1),
                Layout::dp_pp(4, 1),
                Layout::dp_pp(8, 1),
            ]),
            None,
        );
        assert_eq!(
            p.recommendation.as_ref().unwrap().layout,
            Layout::dp_pp(4, 1)
        );
        assert_eq!(p.skipped.len(), 1);
        assert!(
            p.skipped[0].reason.contains("micro-batches"),
            "{}",
            p.skipped[0].reason
        );
        let best = p
            .predictions
            .iter()
            .map(|x| x.step_s)
            .fold(f64::INFINITY, f64::min);
        assert_eq!(p.recommendation.as_ref().unwrap().step_s, best);
        // A slow network: the gradient (5.4 MB) costs more than the compute it saves.
        let slow = spec(4, 0.1).resolve().unwrap();
        let p = plan(&slow, &w, &cal, None, None);
        let r = p.recommendation.unwrap();
        assert_eq!(r.layout, Layout::dp_pp(1, 1));
        assert!(r.why.contains("more workers do not pay"), "{}", r.why);
        // Speedup and efficiency are against one worker.
        for x in &p.predictions {
            assert!(close(x.speedup, p.single_worker_step_s / x.step_s));
            assert!(close(x.efficiency, x.speedup / x.workers as f64));
        }
    }

    #[test]
    fn layouts_that_do_not_fit_the_stated_memory_are_not_recommended() {
        // 20 M parameters with AdamW, 4 micro-batches: about 0.9 GB of state on one worker, less
        // on each of 4 (one micro-batch's gradient each).
        let w = workload(20_000_000);
        let cal = flat_calibration(1e-4, 1);
        let c = ClusterSpec {
            nodes: Some(1),
            workers_per_node: Some(4),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        let layouts = [Layout::dp_pp(1, 1), Layout::dp_pp(4, 1)];
        let free = plan(&c, &w, &cal, Some(&layouts), None);
        assert!(free.predictions.iter().all(|p| p.fits_memory));
        let (one, four) = (&free.predictions[0].memory, &free.predictions[1].memory);
        assert!(four.peak_rss_bytes < one.peak_rss_bytes, "{one:?} {four:?}");
        // A limit between the two: only dp = 4 fits, and it is recommended whatever its speed.
        let limit = (one.peak_rss_bytes + four.peak_rss_bytes) / 2;
        let p = plan(&c, &w, &cal, Some(&layouts), Some(limit));
        assert!(!p.predictions[0].fits_memory && p.predictions[1].fits_memory);
        assert_eq!(p.recommendation.unwrap().layout, Layout::dp_pp(4, 1));
        assert_eq!(p.memory_note, None);
        // A limit below both: nothing is recommended, and the note names the smallest need.
        let p = plan(&c, &w, &cal, Some(&layouts), Some(four.peak_rss_bytes - 1));
        assert!(p.recommendation.is_none());
        let note = p.memory_note.unwrap();
        assert!(
            note.contains("no layout fits") && note.contains("dp=4"),
            "{note}"
        );
    }
}
