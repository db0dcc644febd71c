//! Memory per rank of a layout, before it runs: every stage's model state (the formula of
//! `lockstep_run::memory::predict`, which the resource limits use too — parameters, a gradient
//! per local micro-batch, the reduced gradient and its fixed-point accumulator, optimizer state,
//! each sharded by the ZeRO level; activations of the micro-batches a stage holds at once) and the
//! predicted peak resident memory, for the fullest rank; and whether it fits `--memory-gib`.
//! Under tensor parallelism a rank's parameters — and with them its gradients and optimizer
//! state — are the replicated ones plus its share of the split matrices
//! (`Layer::tp_split_params`); its activations are counted whole, as the training loop counts
//! them (a tp rank keeps the replicated segments and its pieces' inputs).

use lockstep_run::config::ScheduleKind;
use lockstep_run::memory::{
    predict, predicted_peak_bytes, steps_in_backward, streams_last_microbatch, RankMemory,
    StateShape,
};

use super::stages::rank_params;
use super::{Layout, Workload};

/// The fullest rank of `layout` whose stages are `stages` (`[first, end)` layers):
/// `peak_rss_bytes` is its predicted peak resident memory.
pub(super) fn fullest_rank(w: &Workload, layout: Layout, stages: &[(usize, usize)]) -> RankMemory {
    let m = w.microbatches.div_ceil(layout.dp.max(1));
    // Only a layered model runs a schedule (a data-parallel replica holds one micro-batch).
    let layered = w.layers.len() > 1;
    stages
        .iter()
        .enumerate()
        .map(|(s, &(a, b))| {
            let layers = &w.layers[a..b];
            let stage_params = rank_params(layers, layout.tp);
            let held_per_sample: usize = layers
                .iter()
                .map(|l| l.held_activation_bytes_per_sample)
                .sum();
            let peak_held = match (layered, w.schedule) {
                (false, _) => 1,
                (true, ScheduleKind::GPipe) => m,
                (true, ScheduleKind::OneFOneB) => m.min(layout.pp - s),
            };
            let streamed_last =
                streams_last_microbatch(w.zero, layout.pp, layout.tp, layered, w.recompute);
            let mut r = predict(&StateShape {
                stage_params,
                local_microbatches: m,
                optimizer_vectors: w.optimizer_vectors,
                reproducible: w.reproducible,
                largest_layer: layers
                    .iter()
                    .map(|l| rank_params(std::slice::from_ref(l), layout.tp))
                    .max()
                    .unwrap_or(0),
                dp: layout.dp,
                zero: w.zero,
                activation_bytes_per_microbatch: (held_per_sample * w.microbatch) as u64,
                peak_held,
                streamed_last,
                steps_in_backward: steps_in_backward(streamed_last, w.clipped),
            });
            r.peak_rss_bytes = predicted_peak_bytes(&r, stage_params);
            r
        })
        .max_by_key(|r| r.peak_rss_bytes)
        .unwrap_or_default()
}

/// Bytes in `gib` GiB.
pub fn gib_bytes(gib: f64) -> u64 {
    (gib * (1u64 << 30) as f64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_support::{pipeline_workload, workload};

    #[test]
    fn the_fullest_rank_follows_stages_schedule_and_zero() {
        // One layer of 1000 parameters, AdamW, 4 micro-batches, exact sum.
        let w = workload(1000);
        let one = fullest_rank(&w, Layout::dp_pp(1, 1), &[(0, 1)]);
        assert_eq!(one.params_bytes, 4000);
        assert_eq!(one.optimizer_bytes, 8000);
        assert_eq!(one.grads_bytes, (4 + 1) * 4000 + 8000);
        let dp2 = fullest_rank(&w, Layout::dp_pp(2, 1), &[(0, 1)]);
        assert_eq!(
            dp2.grads_bytes,
            (2 + 1) * 4000 + 8000,
            "2 local micro-batches"
        );
        let zero1 = fullest_rank(
            &Workload {
                zero: 1,
                ..w.clone()
            },
            Layout::dp_pp(2, 1),
            &[(0, 1)],
        );
        assert_eq!(zero1.optimizer_bytes, dp2.optimizer_bytes / 2);
        assert!(zero1.peak_rss_bytes < dp2.peak_rss_bytes);
        // 4 layers of 1000 on 2 stages; 8 micro-batches; 10 bytes held per sample per layer.
        let mut p = pipeline_workload(4, 64);
        for l in &mut p.layers {
            l.held_activation_bytes_per_sample = 10;
        }
        let stages = [(0, 2), (2, 4)];
        let f1b = fullest_rank(&p, Layout::dp_pp(1, 2), &stages);
        assert_eq!(f1b.params_bytes, 8000);
        // Stage 0 of 1F1B holds 2 micro-batches of 4 samples × 2 layers × 10 bytes.
        assert_eq!(f1b.activation_peak_bytes, 2 * 4 * 20);
        let gpipe = fullest_rank(
            &Workload {
                schedule: ScheduleKind::GPipe,
                ..p.clone()
            },
            Layout::dp_pp(1, 2),
            &stages,
        );
        assert_eq!(gpipe.activation_peak_bytes, 8 * 4 * 20);
        // ZeRO 3 on one stage (dp 2: 4 local micro-batches): the last one streams, holding one
        // layer (1000 values) instead of the stage's 4000; with recomputation it does not.
        let z3 = Workload {
            zero: 3,
            ..p.clone()
        };
        let streamed = fullest_rank(&z3, Layout::dp_pp(2, 1), &[(0, 4)]);
        let fixed = 8 * 1000;
        // It steps the optimizer layer by layer too: one layer's chunk (500) of reduced gradient
        // instead of the shard (2000) — unless clipping needs the whole gradient's norm first.
        assert_eq!(streamed.grads_bytes, (3 * 4000 + 1000 + 500) * 4 + fixed);
        let clipped = Workload {
            clipped: true,
            ..z3.clone()
        };
        let clipped = fullest_rank(&clipped, Layout::dp_pp(2, 1), &[(0, 4)]);
        assert_eq!(clipped.grads_bytes, (3 * 4000 + 1000 + 2000) * 4 + fixed);
        let recomputed = Workload {
            recompute: true,
            ..z3.clone()
        };
        let whole = fullest_rank(&recomputed, Layout::dp_pp(2, 1), &[(0, 4)]);
        assert_eq!(whole.grads_bytes, (4 * 4000 + 2000) * 4 + fixed);
    }
}
